/* The model's block hook (anneal_model.block_hook), what ZeRO-3 hangs on: called before
 * and after each block's forward in block order, and with --recompute block again
 * around each block's replay in backward, last block first; a failing hook fails the
 * forward with its error. A hook that takes the blocks' parameter storage away after
 * each block and gives it back (a copy) before it, as ZeRO-3 does, leaves loss and
 * gradients bit-identical (GPT-2 and Llama). Also anneal_tensor_set_storage's checks
 * and the allocator's per-category peak. */
#include "anneal/anneal.h"
#include "test.h"

#include <stdlib.h>

#define MAX_CALLS 64

typedef struct {
    char seq[MAX_CALLS * 4];
    int fail_at;        /* the call number that fails (-1: none) */
    int calls;
    anneal_model *m;
    bool steal;         /* take the blocks' storage away after each block */
    anneal_tensor **saved; /* per parameter: a copy of its values (steal) */
} hook_state;

static int block_of(const char *name) {
    for (const char *p = name; *p; p++)
        if (p[0] == '.' && p[1] >= '0' && p[1] <= '9') return atoi(p + 1);
    return -1;
}

static anneal_status hook(void *user, int layer, bool before) {
    hook_state *h = user;
    size_t n = strlen(h->seq);
    snprintf(h->seq + n, sizeof h->seq - n, "%s%c%d", n ? " " : "", before ? '+' : '-', layer);
    if (h->calls++ == h->fail_at) return anneal_set_error(ANNEAL_ERR_IO, "hook failed at layer %d", layer);
    if (!h->steal) return ANNEAL_OK;
    anneal_params *ps = h->m->params;
    for (int i = 0; i < ps->n; i++) {
        if (block_of(ps->items[i].name) != layer) continue;
        anneal_tensor *t = ps->items[i].tensor;
        if (!before) {
            anneal_status s = anneal_tensor_set_storage(t, NULL, 0);
            if (s != ANNEAL_OK) return s;
            continue;
        }
        /* a fresh buffer with the values, like an all-gather into new memory */
        anneal_scope_enter(NULL);
        anneal_tensor *fresh = anneal_empty_like(h->saved[i]);
        anneal_scope_leave();
        if (!fresh) return anneal_last_status();
        memcpy(anneal_data(fresh), anneal_data(h->saved[i]), (size_t)anneal_numel(fresh) * sizeof(float));
        anneal_status s = anneal_tensor_set_storage(t, fresh, 0);
        anneal_release(fresh);
        if (s != ANNEAL_OK) return s;
    }
    return ANNEAL_OK;
}

static anneal_model *make(const char *arch, anneal_recompute_mode mode) {
    anneal_model_config c;
    if (!anneal_model_preset(!strcmp(arch, "llama") ? "llama-tiny" : "tiny", &c)) return NULL;
    c.n_layer = 3;
    c.vocab_size = 64;
    c.dropout = 0.0f;
    c.recompute = mode;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (m && anneal_model_init(m, 5) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    if (m) anneal_model_set_training(m, true);
    return m;
}

/* Forward + backward of a fixed batch; the loss (NAN on failure), gradients left in m. */
static double step(anneal_model *m) {
    anneal_scope *s = anneal_scope_open();
    int64_t shape[2] = {2, 8};
    int32_t ids[16], tg[16];
    for (int i = 0; i < 16; i++) ids[i] = (i * 7 + 3) % 64, tg[i] = (i * 5 + 1) % 64;
    anneal_tensor *x = anneal_from_data(ANNEAL_I32, 2, shape, ids), *y = anneal_from_data(ANNEAL_I32, 2, shape, tg);
    anneal_tensor *loss = anneal_model_loss(m, x, y);
    double v = loss && anneal_backward(loss) == ANNEAL_OK ? anneal_item(loss) : NAN;
    anneal_scope_close(s);
    return v;
}

static void check_order(const char *arch) {
    static const struct {
        anneal_recompute_mode mode;
        const char *want;
    } cases[] = {
        {ANNEAL_RECOMPUTE_NONE, "+0 -0 +1 -1 +2 -2"},
        {ANNEAL_RECOMPUTE_ATTN, "+0 -0 +1 -1 +2 -2"},
        {ANNEAL_RECOMPUTE_BLOCK, "+0 -0 +1 -1 +2 -2 +2 -2 +1 -1 +0 -0"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        anneal_model *m = make(arch, cases[k].mode);
        REQUIRE(m);
        hook_state h = {.fail_at = -1, .m = m};
        m->block_hook = hook;
        m->block_hook_user = &h;
        double v = step(m);
        CHECK(isfinite(v), "%s: %s", arch, anneal_last_error());
        CHECK(!strcmp(h.seq, cases[k].want), "%s, recompute %s: calls \"%s\", want \"%s\"", arch,
              anneal_recompute_name(cases[k].mode), h.seq, cases[k].want);
        anneal_model_free(m);
    }
}

TEST(hook_order_gpt2) { check_order("gpt2"); }
TEST(hook_order_llama) { check_order("llama"); }

TEST(failing_hook_fails_the_forward) {
    for (int at = 0; at < 2; at++) { /* the "before" and the "after" call of block 0 */
        anneal_model *m = make("gpt2", ANNEAL_RECOMPUTE_BLOCK);
        REQUIRE(m);
        hook_state h = {.fail_at = at, .m = m};
        m->block_hook = hook;
        m->block_hook_user = &h;
        anneal_clear_error();
        double v = step(m);
        CHECK(isnan(v) && anneal_last_status() == ANNEAL_ERR_IO && strstr(anneal_last_error(), "hook failed"),
              "loss %g, error %s", v, anneal_last_error());
        anneal_clear_error();
        anneal_model_free(m);
    }
}

/* Blocks' parameters without storage outside their hook calls: same loss and gradients. */
static void check_stealing(const char *arch) {
    anneal_model *ref = make(arch, ANNEAL_RECOMPUTE_BLOCK), *m = make(arch, ANNEAL_RECOMPUTE_BLOCK);
    REQUIRE(ref && m);
    double want = step(ref);
    anneal_params *ps = m->params;
    hook_state h = {.fail_at = -1, .m = m, .steal = true, .saved = calloc((size_t)ps->n, sizeof(anneal_tensor *))};
    REQUIRE(h.saved);
    anneal_scope_enter(NULL);
    for (int i = 0; i < ps->n; i++) {
        h.saved[i] = anneal_empty_like(ps->items[i].tensor);
        memcpy(anneal_data(h.saved[i]), anneal_data(ps->items[i].tensor),
               (size_t)anneal_numel(ps->items[i].tensor) * sizeof(float));
    }
    anneal_scope_leave();
    int blocks = 0;
    for (int i = 0; i < ps->n; i++) {
        if (block_of(ps->items[i].name) < 0) continue;
        REQUIRE(anneal_tensor_set_storage(ps->items[i].tensor, NULL, 0) == ANNEAL_OK);
        blocks++;
    }
    CHECK(blocks > 0, "%s: no block parameters", arch);
    m->block_hook = hook;
    m->block_hook_user = &h;
    double got = step(m);
    CHECK(got == want, "%s: loss %.9g with the storage taken away, %.9g without", arch, got, want);
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *a = ps->items[i].tensor->grad, *b = ref->params->items[i].tensor->grad;
        REQUIRE(a && b);
        CHECK(memcmp(anneal_data(a), anneal_data(b), (size_t)anneal_numel(a) * sizeof(float)) == 0, "%s: gradient of %s differs",
              arch, ps->items[i].name);
        if (block_of(ps->items[i].name) >= 0)
            CHECK(ps->items[i].tensor->storage == NULL, "%s: %s kept its storage after backward", arch, ps->items[i].name);
    }
    for (int i = 0; i < ps->n; i++) anneal_release(h.saved[i]);
    free(h.saved);
    anneal_model_free(m);
    anneal_model_free(ref);
}

TEST(storage_taken_away_between_blocks_gpt2) { check_stealing("gpt2"); }
TEST(storage_taken_away_between_blocks_llama) { check_stealing("llama"); }

TEST(set_storage_checks) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *t = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){2, 3});
    anneal_tensor *big = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){8}, (float[]){0, 1, 2, 3, 4, 5, 6, 7});
    anneal_tensor *small = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){5});
    anneal_tensor *ints = anneal_zeros(ANNEAL_I32, 1, (int64_t[]){8});
    REQUIRE(t && big && small && ints);
    CHECK_TRUE(anneal_tensor_set_storage(t, big, 2) == ANNEAL_OK);
    CHECK(anneal_item_at(t, 0) == 2.0 && anneal_item_at(t, 5) == 7.0, "view at offset 2: %g .. %g", anneal_item_at(t, 0),
          anneal_item_at(t, 5));
    anneal_clear_error();
    CHECK_TRUE(anneal_tensor_set_storage(t, big, 3) == ANNEAL_ERR_ARG);  /* 3 + 6 > 8 */
    CHECK_TRUE(anneal_tensor_set_storage(t, small, 0) == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_tensor_set_storage(t, ints, 0) == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_tensor_set_storage(t, big, -1) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK(anneal_item_at(t, 0) == 2.0, "a refused rebind changed the tensor");
    CHECK_TRUE(anneal_tensor_set_storage(t, NULL, 0) == ANNEAL_OK && t->storage == NULL);
    anneal_scope_close(s); /* releasing a tensor without storage is fine */
}

TEST(category_peaks) {
    anneal_memory_reset_peak(ANNEAL_CPU);
    anneal_memory_categories before = anneal_memory_categories_get(ANNEAL_CPU);
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_GRADIENTS);
    anneal_tensor *a = anneal_empty(ANNEAL_F32, 1, (int64_t[]){1000});
    anneal_release(a);
    anneal_tensor *b = anneal_empty(ANNEAL_F32, 1, (int64_t[]){500});
    anneal_memory_category_set(mc);
    anneal_memory_categories now = anneal_memory_categories_get(ANNEAL_CPU);
    CHECK(now.peak[ANNEAL_MEM_GRADIENTS] == before.live[ANNEAL_MEM_GRADIENTS] + 4000, "gradient peak %lld, want %lld",
          (long long)now.peak[ANNEAL_MEM_GRADIENTS], (long long)(before.live[ANNEAL_MEM_GRADIENTS] + 4000));
    CHECK(now.live[ANNEAL_MEM_GRADIENTS] == before.live[ANNEAL_MEM_GRADIENTS] + 2000, "gradient live %lld",
          (long long)now.live[ANNEAL_MEM_GRADIENTS]);
    anneal_release(b);
    anneal_memory_reset_peak(ANNEAL_CPU);
    now = anneal_memory_categories_get(ANNEAL_CPU);
    CHECK(now.peak[ANNEAL_MEM_GRADIENTS] == now.live[ANNEAL_MEM_GRADIENTS], "reset: peak %lld, live %lld",
          (long long)now.peak[ANNEAL_MEM_GRADIENTS], (long long)now.live[ANNEAL_MEM_GRADIENTS]);
}

int main(void) {
    RUN(hook_order_gpt2);
    RUN(hook_order_llama);
    RUN(failing_hook_fails_the_forward);
    RUN(storage_taken_away_between_blocks_gpt2);
    RUN(storage_taken_away_between_blocks_llama);
    RUN(set_storage_checks);
    RUN(category_peaks);
    return anneal_test_summary();
}
