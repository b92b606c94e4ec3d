/* A steady-state training step makes no system allocation: GPT-2 tiny steps
 * (forward with dropout, backward, global-norm clip, AdamW) through the library, as
 * the trainer runs them. After 2 warm-up steps, steps 3-5 must
 *   - call none of malloc/calloc/realloc/free/posix_memalign/aligned_alloc/memalign
 *     (counted by interposers in this binary that forward to glibc's __libc_*), and
 *   - take no block from the system by the allocator's own count (n_system_allocs).
 * Under ASan the interposers stay idle (ASan owns malloc), so only the allocator's
 * counter is checked there. The same holds with recompute attn and block.
 * Threads: as ctest runs it (OMP_NUM_THREADS=2, one worker per core here). Known
 * exceptions elsewhere: with 1 thread the attention kernel's dynamic loop makes
 * libgomp allocate an orphaned work share per call, and with more threads than
 * cores GEMM's varying team sizes defeat libgomp's one-team cache.
 * ANNEAL_TEST_MALLOC_TRACE=1 prints a backtrace of each
 * counted call, to hunt new ones down. */
#include "anneal/anneal.h"
#include "test.h"

#include <execinfo.h>
#include <stdatomic.h>
#include <unistd.h>

/* ------------------------------------------------------------ interposers */

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);

static atomic_int g_counting;   /* count while set */
static atomic_long g_calls;     /* counted calls */
static bool g_trace;
static _Thread_local int g_in_trace;

__attribute__((unused)) static void note(const char *what) {
    if (!atomic_load_explicit(&g_counting, memory_order_relaxed)) return;
    atomic_fetch_add(&g_calls, 1);
    if (g_trace && !g_in_trace) {
        g_in_trace = 1;
        void *frames[12];
        int n = backtrace(frames, 12);
        char line[64];
        int k = snprintf(line, sizeof line, "-- %s\n", what);
        if (write(2, line, (size_t)k) < 0) { /* best effort */ }
        backtrace_symbols_fd(frames, n, 2);
        g_in_trace = 0;
    }
}

#if !defined(__SANITIZE_ADDRESS__)
void *malloc(size_t n) {
    note("malloc");
    return __libc_malloc(n);
}
void *calloc(size_t a, size_t b) {
    note("calloc");
    return __libc_calloc(a, b);
}
void *realloc(void *p, size_t n) {
    note("realloc");
    return __libc_realloc(p, n);
}
void free(void *p) {
    if (p) note("free");
    __libc_free(p);
}
void *memalign(size_t a, size_t n) {
    note("memalign");
    return __libc_memalign(a, n);
}
void *aligned_alloc(size_t a, size_t n) {
    note("aligned_alloc");
    return __libc_memalign(a, n);
}
int posix_memalign(void **out, size_t a, size_t n) {
    note("posix_memalign");
    void *p = __libc_memalign(a, n);
    if (!p) return 12; /* ENOMEM */
    *out = p;
    return 0;
}
#define INTERPOSED 1
#else
#define INTERPOSED 0
#endif

/* --------------------------------------------------------------- the step */

typedef struct {
    anneal_model *model;
    anneal_optimizer *opt;
    int32_t *ids, *tg;
    int64_t B, T;
} run;

/* One trainer-like step: seeded dropout, forward + backward in a step scope, clip,
 * AdamW. Returns the loss (NaN on failure). */
static double step(run *r, int64_t k) {
    anneal_rng_set((anneal_rng_state){7, (uint64_t)(k + 1) << 40});
    anneal_model_set_training(r->model, true);
    anneal_params_zero_grad(r->model->params);
    anneal_scope *s = anneal_scope_open();
    int64_t shape[2] = {r->B, r->T};
    anneal_tensor *ids = anneal_empty(ANNEAL_I32, 2, shape), *tg = anneal_empty(ANNEAL_I32, 2, shape);
    double loss_v = NAN;
    if (ids && tg) {
        memcpy(anneal_data(ids), r->ids, (size_t)(r->B * r->T) * sizeof(int32_t));
        memcpy(anneal_data(tg), r->tg, (size_t)(r->B * r->T) * sizeof(int32_t));
        anneal_tensor *loss = anneal_model_loss(r->model, ids, tg);
        if (loss && anneal_backward(loss) == ANNEAL_OK) loss_v = anneal_item(loss);
    }
    anneal_scope_close(s);
    float norm = 0;
    if (anneal_clip_grad_norm(r->model->params, 1.0f, &norm) != ANNEAL_OK) return NAN;
    if (anneal_optimizer_step(r->opt, 1e-3) != ANNEAL_OK) return NAN;
    anneal_params_zero_grad(r->model->params);
    return loss_v;
}

/* Five steps of GPT-2 tiny with the given recompute mode; steps 3-5 are checked. */
static void steady_state(anneal_recompute_mode mode) {
    anneal_model_config cfg;
    REQUIRE(anneal_model_preset("tiny", &cfg));
    cfg.dropout = 0.1f;
    cfg.recompute = mode;
    run r = {.B = 4, .T = 64}; /* B*T*C = 16384: row kernels take their parallel paths, bias-sized ones not */
    r.model = anneal_model_new(&cfg, ANNEAL_CPU);
    REQUIRE(r.model && anneal_model_init(r.model, 3) == ANNEAL_OK);
    anneal_optim_config oc = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    r.opt = anneal_optimizer_new(r.model->params, oc);
    REQUIRE(r.opt);
    r.ids = malloc((size_t)(r.B * r.T) * sizeof(int32_t));
    r.tg = malloc((size_t)(r.B * r.T) * sizeof(int32_t));
    REQUIRE(r.ids && r.tg);
    for (int64_t i = 0; i < r.B * r.T; i++) {
        r.ids[i] = (int32_t)((i * 37 + 11) % cfg.vocab_size);
        r.tg[i] = (int32_t)((i * 53 + 5) % cfg.vocab_size);
    }
    g_trace = getenv("ANNEAL_TEST_MALLOC_TRACE") != NULL;
    if (g_trace) {
        void *f[2];
        backtrace(f, 2); /* loads libgcc_s now, not while counting */
    }
    double losses[5];
    for (int k = 0; k < 2; k++) losses[k] = step(&r, k); /* warm-up: caches fill */
    anneal_memory_reset_peak(ANNEAL_CPU);
    anneal_memory_stats before = anneal_memory_stats_get(ANNEAL_CPU);
    atomic_store(&g_calls, 0);
    atomic_store(&g_counting, 1);
    for (int k = 2; k < 5; k++) losses[k] = step(&r, k);
    atomic_store(&g_counting, 0);
    long calls = atomic_load(&g_calls);
    anneal_memory_stats after = anneal_memory_stats_get(ANNEAL_CPU);
    const char *name = anneal_recompute_name(mode);
    for (int k = 0; k < 5; k++)
        CHECK(isfinite(losses[k]), "%s, step %d: loss %g (%s)", name, k + 1, losses[k], anneal_last_error());
    CHECK(losses[4] < losses[0], "%s: loss should fall: %g -> %g", name, losses[0], losses[4]);
    CHECK(after.n_allocs > before.n_allocs, "the steps made tensors (%lld -> %lld)", (long long)before.n_allocs,
          (long long)after.n_allocs);
    CHECK(after.n_system_allocs == before.n_system_allocs,
          "recompute %s: steps 3-5 took %lld blocks from the system (allocator count)", name,
          (long long)(after.n_system_allocs - before.n_system_allocs));
    /* Nothing held from the system grew (the cache served every block) and nothing
     * stayed live across steps (every step's tensors went back at its scope's close). */
    CHECK(after.peak_reserved_bytes == before.reserved_bytes && after.reserved_bytes == before.reserved_bytes,
          "recompute %s: reserved bytes grew during steps 3-5: %lld -> %lld (peak %lld)", name,
          (long long)before.reserved_bytes, (long long)after.reserved_bytes, (long long)after.peak_reserved_bytes);
    CHECK(after.live_bytes == before.live_bytes, "recompute %s: live bytes %lld before steps 3-5, %lld after",
          name, (long long)before.live_bytes, (long long)after.live_bytes);
    printf("  recompute %s, steps 3-5: %lld tensor allocations, %lld system blocks, live %lld B, reserved %lld B "
           "(peak live %lld, peak reserved %lld)\n",
           name, (long long)(after.n_allocs - before.n_allocs),
           (long long)(after.n_system_allocs - before.n_system_allocs), (long long)after.live_bytes,
           (long long)after.reserved_bytes, (long long)after.peak_bytes, (long long)after.peak_reserved_bytes);
    if (INTERPOSED) {
        CHECK(calls == 0, "recompute %s: steps 3-5 made %ld malloc-family calls (ANNEAL_TEST_MALLOC_TRACE=1 "
              "shows where)", name, calls);
        printf("  recompute %s, steps 3-5: %ld malloc-family calls\n", name, calls);
    } else {
        printf("  ASan build: malloc interposers off (ASan owns malloc); allocator count checked only\n");
    }
    free(r.ids);
    free(r.tg);
    anneal_optimizer_free(r.opt);
    anneal_model_free(r.model);
}

TEST(steady_state_step_makes_no_system_allocation) { steady_state(ANNEAL_RECOMPUTE_NONE); }

/* The same with recompute regions (their nodes, contexts and replays are pooled too). */
TEST(steady_state_with_recompute) {
    steady_state(ANNEAL_RECOMPUTE_ATTN);
    steady_state(ANNEAL_RECOMPUTE_BLOCK);
}

/* The interposers really count: a malloc while counting is seen (guards against a
 * build where the library's calls bypass them). */
TEST(interposers_count) {
    if (!INTERPOSED) SKIP("ASan build: malloc is ASan's, the interposers are compiled out");
    atomic_store(&g_calls, 0);
    atomic_store(&g_counting, 1);
    anneal_scope *s = anneal_scope_open();
    void *volatile p = malloc(100);
    anneal_scope_close(s);
    atomic_store(&g_counting, 0);
    free(p);
    CHECK(atomic_load(&g_calls) >= 1, "a counted malloc was missed (%ld)", (long)atomic_load(&g_calls));
}

int main(void) {
    RUN(interposers_count);
    RUN(steady_state_step_makes_no_system_allocation);
    RUN(steady_state_with_recompute);
    return anneal_test_summary();
}
