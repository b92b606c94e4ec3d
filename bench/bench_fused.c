/* Step time of GPT-2 training with the fused kernels (anneal_gpt2_loss: residual add +
 * ln_2, fc + GELU, chunked lm head + cross-entropy) against the same model written
 * with the unfused ops (layer_norm, conv1d, gelu, add, linear + cross_entropy), on the
 * same weights and batch, alternating A/B so machine noise hits both alike. A step is
 * loss forward + backward + one AdamW update. Prints per config and compute precision the
 * median and range of ms/step, and the allocator's peak (tensor storage).
 * Build and run (from the repository root, after building build/):
 *   gcc -std=gnu11 -O3 -fopenmp -Iinclude -Isrc bench/bench_fused.c build/libanneal.a \
 *       $(pkg-config --libs libcjson libpcre2-8) -lm -o /tmp/bench_fused &&
 *   OMP_NUM_THREADS=2 /tmp/bench_fused [steps] [tiny|d6|ops]
 * ("ops": each fused op against its unfused ops, forward + backward, on d6 shapes)
 * (add -lmpi when libanneal was built with MPI).
 * The machine should be otherwise idle; figures on a shared 2-core box are noisy. */
#include "anneal/anneal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU time of the whole process (all threads): less sensitive than wall time to other
 * processes on a shared machine (though OpenMP threads spinning at barriers count). */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* x @ w + b, w (in, out), at precision dt (no fused activation). */
static anneal_tensor *conv1d_at(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, anneal_dtype dt) {
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_IN_OUT, .compute = dt};
    return anneal_dense(x, w, b, &o);
}

/* The block as it was before the fused ops (dropout 0 here). */
static anneal_tensor *unfused_block(const anneal_gpt2_block *b, anneal_tensor *x) {
    const anneal_model_config *cfg = &b->model->base.cfg;
    anneal_dtype dt = b->model->base.ctx.compute;
    anneal_tensor *h = anneal_layer_norm(x, b->ln_1.weight, b->ln_1.bias, cfg->norm_eps);
    anneal_tensor *qkv = conv1d_at(h, b->attn.qkv.weight, b->attn.qkv.bias, dt);
    anneal_attention_opts ao = {.causal = true, .compute = dt};
    anneal_tensor *att = anneal_attention_packed(qkv, cfg->n_head, cfg->n_head, &ao);
    x = anneal_add(x, conv1d_at(att, b->attn.out.weight, b->attn.out.bias, dt));
    h = anneal_layer_norm(x, b->ln_2.weight, b->ln_2.bias, cfg->norm_eps);
    anneal_tensor *f = anneal_gelu(conv1d_at(h, b->mlp.fc.weight, b->mlp.fc.bias, dt), true);
    return anneal_add(x, conv1d_at(f, b->mlp.proj.weight, b->mlp.proj.bias, dt));
}

static anneal_tensor *unfused_loss(anneal_gpt2 *m, anneal_tensor *ids, anneal_tensor *pos,
                                   anneal_tensor *targets) {
    anneal_tensor *x = anneal_add(anneal_embedding(ids, m->wte.weight), anneal_embedding(pos, m->wpe.weight));
    for (int l = 0; l < m->base.cfg.n_layer; l++) x = unfused_block(&m->blocks[l], x);
    x = anneal_layer_norm(x, m->ln_f.weight, m->ln_f.bias, m->base.cfg.norm_eps);
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m->base.ctx.compute};
    return anneal_cross_entropy(anneal_dense(x, m->wte.weight, NULL, &o), targets, -100);
}

/* One training step; returns wall seconds (or -1 on error), the CPU seconds in *cpu
 * and the allocator peak. */
static double step(anneal_gpt2 *m, anneal_optimizer *opt, bool fused, anneal_tensor *ids,
                   anneal_tensor *pos, anneal_tensor *tg, int64_t *peak, double *cpu) {
    anneal_params_zero_grad(m->base.params);
    anneal_memory_reset_peak(ANNEAL_CPU);
    double t0 = now(), c0 = cpu_now();
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *loss = fused ? anneal_gpt2_loss(m, ids, tg) : unfused_loss(m, ids, pos, tg);
    bool ok = loss && anneal_backward(loss) == ANNEAL_OK;
    anneal_scope_close(s);
    ok = ok && anneal_optimizer_step(opt, 1e-4) == ANNEAL_OK;
    double t = now() - t0;
    *cpu = cpu_now() - c0;
    *peak = anneal_memory_stats_get(ANNEAL_CPU).peak_bytes;
    if (!ok) fprintf(stderr, "step failed: %s\n", anneal_last_error());
    return ok ? t : -1;
}

static void run(const char *preset, int B, int T, anneal_dtype dt, int steps) {
    anneal_model_config cfg;
    if (!anneal_gpt2_preset(preset, &cfg)) return;
    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    anneal_optimizer *opt = m && anneal_gpt2_init(m, 1) == ANNEAL_OK
                                ? anneal_optimizer_new(m->base.params, anneal_optim_defaults(ANNEAL_OPTIM_ADAMW))
                                : NULL;
    if (!opt) {
        fprintf(stderr, "setup failed: %s\n", anneal_last_error());
        return;
    }
    m->base.ctx.training = true;
    anneal_model_set_compute(&m->base, dt);
    int64_t n = (int64_t)B * T;
    int32_t *idv = malloc((size_t)n * sizeof *idv), *tv = malloc((size_t)n * sizeof *tv),
            *pv = malloc((size_t)T * sizeof *pv);
    for (int64_t i = 0; i < n; i++) idv[i] = (int32_t)((i * 7919) % cfg.vocab_size),
                                    tv[i] = (int32_t)((i * 104729 + 13) % cfg.vocab_size);
    for (int t = 0; t < T; t++) pv[t] = t;
    anneal_tensor *ids = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, idv);
    anneal_tensor *tg = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, tv);
    anneal_tensor *pos = anneal_from_data(ANNEAL_I32, 1, (int64_t[]){T}, pv);
    double tf[64], tu[64], cf[64], cu[64], c;
    int64_t pf = 0, pu = 0, p;
    if (steps > 64) steps = 64;
    step(m, opt, true, ids, pos, tg, &p, &c); /* warm-up */
    step(m, opt, false, ids, pos, tg, &p, &c);
    for (int i = 0; i < steps; i++) {
        tf[i] = step(m, opt, true, ids, pos, tg, &p, &cf[i]), pf = p > pf ? p : pf;
        tu[i] = step(m, opt, false, ids, pos, tg, &p, &cu[i]), pu = p > pu ? p : pu;
    }
    qsort(tf, (size_t)steps, sizeof *tf, cmp_double);
    qsort(tu, (size_t)steps, sizeof *tu, cmp_double);
    qsort(cf, (size_t)steps, sizeof *cf, cmp_double);
    qsort(cu, (size_t)steps, sizeof *cu, cmp_double);
    const char *dn = dt == ANNEAL_BF16 ? "bf16" : dt == ANNEAL_F16 ? "f16" : "f32";
    printf("%-5s B=%d T=%d %-4s  unfused %8.1f ms [%.1f-%.1f] peak %7.1f MiB | fused %8.1f ms [%.1f-%.1f] "
           "peak %7.1f MiB | speedup %.3fx\n",
           preset, B, T, dn, 1e3 * tu[steps / 2], 1e3 * tu[0], 1e3 * tu[steps - 1], pu / 1048576.0,
           1e3 * tf[steps / 2], 1e3 * tf[0], 1e3 * tf[steps - 1], pf / 1048576.0, tu[steps / 2] / tf[steps / 2]);
    printf("%-5s B=%d T=%d %-4s  CPU time (both threads): unfused median %8.1f ms (min %.1f) | fused median "
           "%8.1f ms (min %.1f) | ratio %.3fx\n",
           preset, B, T, dn, 1e3 * cu[steps / 2], 1e3 * cu[0], 1e3 * cf[steps / 2], 1e3 * cf[0],
           cu[steps / 2] / cf[steps / 2]);
    fflush(stdout);
    free(idv), free(tv), free(pv);
    anneal_optimizer_free(opt);
    anneal_gpt2_free(m);
}

/* ------------------------------------------------- per-op forward + backward */

typedef struct {
    anneal_tensor *x, *r, *w, *b, *lw, *lb, *wte, *tg;
} op_data;

/* which: 0 fc+gelu, 1 add+ln, 2 lm head + loss; fused or not. Returns seconds. */
static double op_once(const op_data *d, int which, bool fused, anneal_dtype dt, double *cpu) {
    anneal_grad_clear(d->x), anneal_grad_clear(d->r), anneal_grad_clear(d->w), anneal_grad_clear(d->wte);
    anneal_dense_opts fc = {.layout = ANNEAL_WEIGHT_IN_OUT, .act = fused ? ANNEAL_ACT_GELU_TANH : ANNEAL_ACT_NONE,
                            .compute = dt};
    anneal_dense_opts head = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = dt};
    double t0 = now(), c0 = cpu_now();
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *L = NULL;
    if (which == 0) {
        anneal_tensor *y = fused ? anneal_dense(d->x, d->w, d->b, &fc) : anneal_gelu(anneal_dense(d->x, d->w, d->b, &fc), true);
        L = anneal_sum(y);
    } else if (which == 1) {
        anneal_tensor *sum = NULL, *y;
        if (fused) {
            y = anneal_add_layer_norm(d->x, d->r, d->lw, d->lb, 1e-5f, &sum);
        } else {
            sum = anneal_add(d->x, d->r);
            y = anneal_layer_norm(sum, d->lw, d->lb, 1e-5f);
        }
        L = anneal_add(anneal_sum(y), anneal_sum(sum));
    } else {
        L = fused ? anneal_linear_cross_entropy_ex(d->x, d->wte, d->tg, -100, dt)
                  : anneal_cross_entropy(anneal_dense(d->x, d->wte, NULL, &head), d->tg, -100);
    }
    bool ok = L && anneal_backward(L) == ANNEAL_OK;
    anneal_scope_close(s);
    if (!ok) fprintf(stderr, "op failed: %s\n", anneal_last_error());
    *cpu = cpu_now() - c0;
    return now() - t0;
}

/* d6 shapes (B*T = 2048 rows, C = 384, 4C MLP, V = 50257), alternating A/B. */
static void run_ops(int reps, anneal_dtype dt) {
    int64_t N = 2048, C = 384, V = 50257;
    anneal_scope *s = anneal_scope_open();
    op_data d;
    d.x = anneal_randn(ANNEAL_F32, 2, (int64_t[]){N, C}, 0, 1);
    d.r = anneal_randn(ANNEAL_F32, 2, (int64_t[]){N, C}, 0, 1);
    d.w = anneal_randn(ANNEAL_F32, 2, (int64_t[]){C, 4 * C}, 0, 0.02f);
    d.b = anneal_randn(ANNEAL_F32, 1, (int64_t[]){4 * C}, 0, 0.02f);
    d.lw = anneal_randn(ANNEAL_F32, 1, &C, 1, 0.1f);
    d.lb = anneal_randn(ANNEAL_F32, 1, &C, 0, 0.1f);
    d.wte = anneal_randn(ANNEAL_F32, 2, (int64_t[]){V, C}, 0, 0.02f);
    int32_t *tv = malloc((size_t)N * sizeof *tv);
    for (int64_t i = 0; i < N; i++) tv[i] = (int32_t)((i * 104729 + 13) % V);
    d.tg = anneal_from_data(ANNEAL_I32, 1, &N, tv);
    free(tv);
    anneal_tensor *req[4] = {d.x, d.r, d.w, d.wte};
    for (int i = 0; i < 4; i++) anneal_set_requires_grad(req[i], true);
    const char *names[3] = {"fc+gelu (2048x384 -> 1536)", "add+ln_2 (2048x384)", "lm head+CE (2048x384, V=50257)"};
    const char *dn = dt == ANNEAL_BF16 ? "bf16" : "f32";
    for (int which = 0; which < 3; which++) {
        double tf[64], tu[64], cf[64], cu[64], c;
        int n = reps > 64 ? 64 : reps;
        op_once(&d, which, true, dt, &c), op_once(&d, which, false, dt, &c);
        for (int i = 0; i < n; i++)
            tf[i] = op_once(&d, which, true, dt, &cf[i]), tu[i] = op_once(&d, which, false, dt, &cu[i]);
        qsort(tf, (size_t)n, sizeof *tf, cmp_double);
        qsort(tu, (size_t)n, sizeof *tu, cmp_double);
        qsort(cf, (size_t)n, sizeof *cf, cmp_double);
        qsort(cu, (size_t)n, sizeof *cu, cmp_double);
        printf("%-32s %-4s fwd+bwd wall: unfused median %7.2f ms (min %7.2f) | fused median %7.2f ms (min %7.2f)"
               " | CPU: unfused %7.2f ms, fused %7.2f ms\n",
               names[which], dn, 1e3 * tu[n / 2], 1e3 * tu[0], 1e3 * tf[n / 2], 1e3 * tf[0], 1e3 * cu[n / 2],
               1e3 * cf[n / 2]);
        fflush(stdout);
    }
    anneal_scope_close(s);
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 5;
    const char *only = argc > 2 ? argv[2] : NULL;
    if (only && !strcmp(only, "ops")) {
        run_ops(steps, ANNEAL_F32);
        run_ops(steps, ANNEAL_BF16);
        return 0;
    }
    anneal_dtype dts[2] = {ANNEAL_F32, ANNEAL_BF16};
    for (int d = 0; d < 2; d++) {
        if (!only || !strcmp(only, "tiny")) run("tiny", 8, 256, dts[d], steps);
        if (!only || !strcmp(only, "d6")) run("d6", 8, 256, dts[d], steps);
    }
    return 0;
}
