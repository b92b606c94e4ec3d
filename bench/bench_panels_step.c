/* A decode step's bf16 panel products with cold weights: GPT-2 124M's 12 layers (q/k/v
 * fused, attention out, MLP up, MLP down) and the tied head, each its own packed copy
 * (anneal_gemv_pack_panels_bf16, 247 MB together: far beyond the caches, as in the
 * decode engine), run in order for n rows, --reps times; prints the median pass's
 * wall ms and GFLOP/s. What `anneal bench decode --batch N` spends in its products,
 * without attention, norms or sampling.
 *
 * Build and run (from the repository root, after building the anneal target):
 *   gcc -O2 -std=c11 -D_GNU_SOURCE -fopenmp -Iinclude bench/bench_panels_step.c build/libanneal.a \
 *       -lm -lpthread -o /tmp/bench_panels_step && /tmp/bench_panels_step [--threads N] [--rows a,b,..] [--reps R] */
#include "anneal/anneal.h"
#include "anneal/decode_kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int threads = 2, reps = 9, nrows = 3, huge = 0;
    int64_t rows[8] = {1, 16, 64};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--huge")) huge = 1;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) {
            nrows = 0;
            for (char *s = strtok(argv[++i], ","); s && nrows < 8; s = strtok(NULL, ",")) rows[nrows++] = atoll(s);
        }
    }
    if (reps < 1 || reps > 99) reps = 9;
    anneal_set_num_threads(threads);
    const struct { int64_t in, out; } shapes[] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}};
    enum { L = 12, NW = 4 * L + 1 };
    anneal_gemv_weight w[NW];
    int64_t maxn = 1, flop1 = 0, bytes = 0;
    for (int ri = 0; ri < nrows; ri++) maxn = rows[ri] > maxn ? rows[ri] : maxn;
    uint64_t s = 1;
    for (int i = 0; i < NW; i++) {
        const int64_t in = i < NW - 1 ? shapes[i % 4].in : 768, out = i < NW - 1 ? shapes[i % 4].out : 50257;
        float *wf = malloc(sizeof(float) * (size_t)(in * out));
        for (int64_t j = 0; j < in * out; j++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            wf[j] = (float)((double)(s >> 40) / 16777216.0 - 0.5) * 0.05f;
        }
        const int64_t len = anneal_gemv_panels_bf16_len(in, out);
        const size_t sz = (size_t)(2 * len + (2 << 20) - 1) / (2 << 20) * (2 << 20);
        uint16_t *wq = aligned_alloc(2 << 20, sz);
        if (huge) madvise(wq, sz, MADV_HUGEPAGE);
        anneal_gemv_pack_panels_bf16(wf, true, in, out, wq);
        free(wf);
        memset(&w[i], 0, sizeof w[i]);
        w[i].w = wq, w[i].dtype = ANNEAL_BF16, w[i].in = in, w[i].out = out, w[i].bf16_panels = true;
        flop1 += 2 * in * out, bytes += 2 * len;
    }
    float *x = aligned_alloc(64, sizeof(float) * (size_t)(maxn * 3072));
    float *y = aligned_alloc(64, sizeof(float) * (size_t)(maxn * 50257 + 16));
    for (int64_t j = 0; j < maxn * 3072; j++) x[j] = (float)((j * 7919) % 1000) / 1000.0f - 0.5f;
    printf("bf16 panels, a GPT-2 124M decode step's products (%.1f MB of weights, cold), %d thread(s)\n", bytes / 1e6,
           threads);
    printf("%5s %10s %10s %10s\n", "rows", "ms", "GFLOP/s", "GB/s(W)");
    for (int ri = 0; ri < nrows; ri++) {
        const int64_t n = rows[ri];
        double t[99];
        for (int r = 0; r < reps + 1; r++) {
            const double t0 = now();
            for (int i = 0; i < NW; i++) anneal_gemv(&w[i], x, w[i].in, n, y, w[i].out, ANNEAL_GEMV_NONE);
            if (r) t[r - 1] = now() - t0; /* the first pass warms the code, not the weights */
        }
        qsort(t, (size_t)reps, sizeof t[0], cmp);
        const double m = t[reps / 2];
        printf("%5lld %10.3f %10.1f %10.2f\n", (long long)n, m * 1e3, (double)flop1 * n / m / 1e9, bytes / m / 1e9);
    }
    return 0;
}
