/* Throughput of the CPU row, pointwise, embedding, loss and optimizer kernels on
 * GPT-2-small training shapes (B*T = 4096 rows, C = 768, 4C MLP, V = 50257).
 * Each line: median time of several runs after a warm-up, and the memory traffic the
 * kernel must move (bytes read + written once) per second, for 1 and 2 threads.
 * Build and run (from the repository root):
 *   gcc -std=c11 -O3 -D_GNU_SOURCE -fopenmp -Iinclude -Isrc bench/bench_rowops.c \
 *       src/cpu/norm.c src/cpu/softmax.c src/cpu/pointwise.c src/cpu/embedding.c \
 *       src/cpu/cross_entropy.c src/cpu/adamw.c -lm -o /tmp/bench_rowops && /tmp/bench_rowops
 * The machine should be otherwise idle; figures on a shared 2-core box are noisy. */
#include "cpu/cpu_kernels.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RUNS = 7 };
enum { N_ROWS = 4096, C_MODEL = 768, V_VOCAB = 50257, N_CE = 256 };

static float *buf(int64_t n, float lo, float hi) {
    float *p = malloc((size_t)n * sizeof *p);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    uint32_t s = 12345u + (uint32_t)n;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        p[i] = lo + (hi - lo) * (float)(s >> 8) / 16777216.0f;
    }
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    float *x, *y, *dy, *dx, *w, *b, *dw, *db, *mean, *rstd; /* rows x C */
    float *h, *hy, *hdy, *hdx;                              /* rows x 4C */
    float *sx, *sy, *sdy, *sdx;                             /* attention-like 1024-wide rows */
    float *logits, *dlogits, *loss, *lse;                   /* N_CE x V */
    int32_t *ids, *targets;
    float *wte, *dwte;                                      /* V x C */
    float *p, *g, *m, *v;                                   /* 124M/8 parameters */
    int64_t np;
} data;

typedef void (*bench_fn)(data *);
static void ln_fwd(data *d) {
    anneal_cpu_layer_norm_fwd(N_ROWS, C_MODEL, d->x, d->w, d->b, 1e-5f, d->y, d->mean, d->rstd);
}
static void ln_bwd(data *d) {
    anneal_cpu_layer_norm_bwd(N_ROWS, C_MODEL, d->x, d->w, d->mean, d->rstd, d->dy, d->dx, d->dw,
                              d->db);
}
static void rms_fwd(data *d) {
    anneal_cpu_rms_norm_fwd(N_ROWS, C_MODEL, d->x, d->w, 1e-6f, d->y, d->rstd);
}
static void rms_bwd(data *d) {
    anneal_cpu_rms_norm_bwd(N_ROWS, C_MODEL, d->x, d->w, d->rstd, d->dy, d->dx, d->dw);
}
static void sm_fwd(data *d) { anneal_cpu_softmax_fwd(N_ROWS * 3, 1024, d->sx, d->sy, false); }
static void sm_bwd(data *d) { anneal_cpu_softmax_bwd(N_ROWS * 3, 1024, d->sy, d->sdy, d->sdx, false); }
static void gelu_t_fwd(data *d) { anneal_cpu_gelu_fwd(N_ROWS * 4 * C_MODEL, d->h, d->hy, true); }
static void gelu_t_bwd(data *d) {
    anneal_cpu_gelu_bwd(N_ROWS * 4 * C_MODEL, d->h, d->hdy, d->hdx, true);
}
static void gelu_e_fwd(data *d) { anneal_cpu_gelu_fwd(N_ROWS * 4 * C_MODEL, d->h, d->hy, false); }
static void gelu_e_bwd(data *d) {
    anneal_cpu_gelu_bwd(N_ROWS * 4 * C_MODEL, d->h, d->hdy, d->hdx, false);
}
static void silu_f(data *d) { anneal_cpu_silu_fwd(N_ROWS * 4 * C_MODEL, d->h, d->hy); }
static void silu_b(data *d) { anneal_cpu_silu_bwd(N_ROWS * 4 * C_MODEL, d->h, d->hdy, d->hdx); }
static void emb_fwd(data *d) { anneal_cpu_embedding_fwd(N_ROWS, C_MODEL, d->ids, d->wte, d->y); }
static void emb_bwd(data *d) {
    anneal_cpu_embedding_bwd(N_ROWS, C_MODEL, V_VOCAB, d->ids, d->dy, d->dwte);
}
static void ce_fwd(data *d) {
    anneal_cpu_cross_entropy_fwd(N_CE, V_VOCAB, d->logits, d->targets, -100, d->loss, d->lse);
}
static void ce_bwd(data *d) {
    anneal_cpu_cross_entropy_bwd(N_CE, V_VOCAB, d->logits, d->targets, -100, d->lse, 1.0f / N_CE,
                                 d->dlogits);
}
static void adamw(data *d) {
    anneal_cpu_adamw(d->np, d->p, d->g, d->m, d->v, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.1f);
}
static volatile double sink;
static void sumsq(data *d) { sink = anneal_cpu_sum_squares(d->np, d->g); }

typedef struct {
    const char *name;
    bench_fn fn;
    double bytes; /* compulsory traffic of one call */
} bench;

int main(void) {
    const double RC = (double)N_ROWS * C_MODEL * 4, H4 = RC * 4, S = (double)N_ROWS * 3 * 1024 * 4;
    const double CE = (double)N_CE * V_VOCAB * 4;
    data d = {0};
    d.np = 124000000 / 8;
    d.x = buf(N_ROWS * C_MODEL, -2, 2), d.y = buf(N_ROWS * C_MODEL, 0, 1);
    d.dy = buf(N_ROWS * C_MODEL, -1, 1), d.dx = buf(N_ROWS * C_MODEL, 0, 1);
    d.w = buf(C_MODEL, 0.5f, 1.5f), d.b = buf(C_MODEL, -1, 1), d.dw = buf(C_MODEL, 0, 1);
    d.db = buf(C_MODEL, 0, 1), d.mean = buf(N_ROWS, 0, 1), d.rstd = buf(N_ROWS, 0, 1);
    d.h = buf(N_ROWS * 4 * C_MODEL, -4, 4), d.hy = buf(N_ROWS * 4 * C_MODEL, 0, 1);
    d.hdy = buf(N_ROWS * 4 * C_MODEL, -1, 1), d.hdx = buf(N_ROWS * 4 * C_MODEL, 0, 1);
    d.sx = buf(N_ROWS * 3 * 1024, -8, 8), d.sy = buf(N_ROWS * 3 * 1024, 0, 1);
    d.sdy = buf(N_ROWS * 3 * 1024, -1, 1), d.sdx = buf(N_ROWS * 3 * 1024, 0, 1);
    d.logits = buf((int64_t)N_CE * V_VOCAB, -10, 10), d.dlogits = buf((int64_t)N_CE * V_VOCAB, 0, 1);
    d.loss = buf(N_CE, 0, 1), d.lse = buf(N_CE, 0, 1);
    d.wte = buf((int64_t)V_VOCAB * C_MODEL, -1, 1), d.dwte = buf((int64_t)V_VOCAB * C_MODEL, 0, 1);
    d.ids = malloc(N_ROWS * sizeof *d.ids), d.targets = malloc(N_CE * sizeof *d.targets);
    for (int i = 0; i < N_ROWS; i++) d.ids[i] = (int32_t)((i * 2654435761u) % V_VOCAB);
    for (int i = 0; i < N_CE; i++) d.targets[i] = (int32_t)((i * 40503u) % V_VOCAB);
    d.p = buf(d.np, -1, 1), d.g = buf(d.np, -1, 1), d.m = buf(d.np, -0.1f, 0.1f);
    d.v = buf(d.np, 0, 0.01f);
    const bench benches[] = {
        {"layer_norm fwd  4096x768", ln_fwd, 2 * RC},
        {"layer_norm bwd  4096x768", ln_bwd, 5 * RC}, /* x, dy read twice (dx rows, dw cols) */
        {"rms_norm fwd    4096x768", rms_fwd, 2 * RC},
        {"rms_norm bwd    4096x768", rms_bwd, 5 * RC},
        {"softmax fwd    12288x1024", sm_fwd, 2 * S},
        {"softmax bwd    12288x1024", sm_bwd, 3 * S},
        {"gelu tanh fwd   4096x3072", gelu_t_fwd, 2 * H4},
        {"gelu tanh bwd   4096x3072", gelu_t_bwd, 3 * H4},
        {"gelu erf fwd    4096x3072", gelu_e_fwd, 2 * H4},
        {"gelu erf bwd    4096x3072", gelu_e_bwd, 3 * H4},
        {"silu fwd        4096x3072", silu_f, 2 * H4},
        {"silu bwd        4096x3072", silu_b, 3 * H4},
        {"embedding fwd   4096x768", emb_fwd, 2 * RC},
        {"embedding bwd   4096x768 V=50257", emb_bwd, 2 * RC + (double)V_VOCAB * C_MODEL * 4},
        {"cross_entropy fwd 256x50257", ce_fwd, CE},
        {"cross_entropy bwd 256x50257", ce_bwd, 2 * CE},
        {"adamw           15.5M params", adamw, (double)d.np * 4 * 7},
        {"sum_squares     15.5M", sumsq, (double)d.np * 4},
    };
    printf("%-36s %22s %22s\n", "kernel", "1 thread", "2 threads");
    for (size_t k = 0; k < sizeof benches / sizeof benches[0]; k++) {
        printf("%-36s", benches[k].name);
        for (int t = 1; t <= 2; t++) {
            omp_set_num_threads(t);
            double times[RUNS];
            benches[k].fn(&d); /* warm-up */
            for (int r = 0; r < RUNS; r++) {
                double t0 = omp_get_wtime();
                benches[k].fn(&d);
                times[r] = omp_get_wtime() - t0;
            }
            qsort(times, RUNS, sizeof times[0], cmp_double);
            double med = times[RUNS / 2];
            printf(" %8.2f ms %6.1f GB/s", med * 1e3, benches[k].bytes / med / 1e9);
        }
        printf("\n");
        fflush(stdout);
    }
    return 0;
}
