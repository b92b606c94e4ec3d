/* GFLOP/s and GB/s of anneal_gemv (decode_kernels.h) on GPT-2 124M's W (out, in) bf16
 * shapes (q/k/v fused, attention out, MLP up, MLP down, tied head), for n rows (1 and 16
 * by default), bf16 weights plain, in pair order (anneal_gemv_pair_bf16) and in panels
 * (anneal_gemv_pack_panels_bf16, what the decode engine's copies use), and f32 weights;
 * --ab: only pairs and panels, alternated twice (A B A B) for each shape and n. Time is the fastest call's thread CPU time
 * with one thread (the least disturbed on a shared machine; memory-bound rows are then the
 * one-core stream rate), or its wall time with --threads N > 1.
 *
 * Build and run (from the repository root, after building the anneal target):
 *   gcc -O2 -std=c11 -D_GNU_SOURCE -fopenmp -Iinclude bench/bench_gemv.c build/libanneal.a \
 *       -lm -lpthread -o /tmp/bench_gemv && /tmp/bench_gemv [--threads N] [--rows a,b,..] */
#include "anneal/anneal.h"
#include "anneal/decode_kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    int threads = 1;
    int64_t rows[8] = {1, 16};
    int nrows = 2, ab = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ab")) ab = 1;
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) {
            nrows = 0;
            for (char *s = strtok(argv[++i], ","); s && nrows < 8; s = strtok(NULL, ",")) rows[nrows++] = atoll(s);
        }
    }
    anneal_set_num_threads(threads);
    const clockid_t clk = threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
    const struct { const char *name; int64_t in, out; } shapes[] = {
        {"qkv", 768, 2304}, {"attn_out", 768, 768}, {"fc", 768, 3072}, {"down", 3072, 768}, {"head", 768, 50257}};
    printf("anneal_gemv, path %s, %d thread(s), %s time\n", anneal_gemv_path_name(), threads,
           threads == 1 ? "thread CPU" : "wall");
    printf("%-9s %5s  %-10s %9s %9s %9s\n", "shape", "rows", "weights", "ms", "GFLOP/s", "GB/s(W)");
    int64_t maxn = 1;
    for (int ri = 0; ri < nrows; ri++) maxn = rows[ri] > maxn ? rows[ri] : maxn;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t in = shapes[si].in, out = shapes[si].out;
        /* 64-byte aligned, as the decode engine's buffers and weight copies */
        float *wf = aligned_alloc(64, sizeof(float) * (size_t)(in * out));
        uint16_t *wb = aligned_alloc(64, 2 * (size_t)(in * out)), *wp = aligned_alloc(64, 2 * (size_t)(in * out));
        float *x = aligned_alloc(64, sizeof(float) * (size_t)(maxn * in)), *y = aligned_alloc(64, sizeof(float) * (size_t)(maxn * out));
        uint16_t *wq = aligned_alloc(64, 2 * (size_t)anneal_gemv_panels_bf16_len(in, out));
        uint64_t s = 1;
        for (int64_t i = 0; i < in * out; i++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            wf[i] = (float)((double)(s >> 40) / 16777216.0 - 0.5);
        }
        for (int64_t i = 0; i < maxn * in; i++) x[i] = wf[i % (in * out)];
        anneal_gemv_pack_panels_bf16(wf, true, in, out, wq);
        anneal_gemv_to_bf16(wf, wb, in * out);
        memcpy(wp, wb, 2 * (size_t)(in * out));
        anneal_gemv_pair_bf16(wp, out, in);
        for (int ri = 0; ri < nrows; ri++) {
            const int64_t n = rows[ri];
            static const int all[] = {0, 3, 1, 2}, abk[] = {0, 3, 0, 3};
            for (int ki = 0; ki < 4; ki++) {
                const int kind = ab ? abk[ki] : all[ki];
                anneal_gemv_weight w = {.w = kind == 0 ? (void *)wp : kind == 1 ? (void *)wb : kind == 3 ? (void *)wq : (void *)wf,
                                        .dtype = kind == 2 ? ANNEAL_F32 : ANNEAL_BF16, .out_in = true, .in = in,
                                        .out = out, .bf16_pairs = kind == 0, .bf16_panels = kind == 3};
                anneal_gemv(&w, x, in, n, y, out, ANNEAL_GEMV_NONE); /* warm */
                double per = 1e30, t0 = now(CLOCK_MONOTONIC);
                do { /* the fastest call: the least disturbed by other processes */
                    double t1 = now(clk);
                    anneal_gemv(&w, x, in, n, y, out, ANNEAL_GEMV_NONE);
                    double t = now(clk) - t1;
                    per = t < per ? t : per;
                } while (now(CLOCK_MONOTONIC) - t0 < 0.4);
                const double bytes = (double)(in * out) * (kind == 2 ? 4 : 2);
                printf("%-9s %5lld  %-10s %9.3f %9.1f %9.2f\n", shapes[si].name, (long long)n,
                       kind == 0 ? "bf16 pairs" : kind == 1 ? "bf16" : kind == 3 ? "bf16 panel" : "f32", per * 1e3,
                       2.0 * (double)(n * in * out) / per * 1e-9, bytes / per * 1e-9);
            }
        }
        free(wf), free(wb), free(wp), free(wq), free(x), free(y);
    }
    return 0;
}
