/* The dynamic int8 dense product as the decode engine calls it (anneal_cpu_qmatmul: the
 * activations quantized per row, the int8 product, the epilogue), with and without the
 * weight's panel copy (anneal_gemv_pack_qpanels: the layout of this CPU's int8 path),
 * next to the f32 GEMM of the same shape (anneal_cpu_gemm, x W^T), on GPT-2 124M's
 * shapes (N x K: 2304x768 qkv, 768x768 proj, 3072x768 fc, 768x3072 down) at M rows.
 * The variants alternate within each repetition so a shared machine's noise hits all of
 * them alike; prints the median wall ms of each, G multiply-adds/s, the ratios, and
 * whether the int8 outputs agree bit for bit.
 * Build and run (from the repository root, after building build/):
 *   gcc -O2 -std=c11 -D_GNU_SOURCE -fopenmp -Iinclude -Isrc bench/bench_qmatmul.c build/libanneal.a \
 *       $(pkg-config --libs libcjson libpcre2-8 libprotobuf-c libmicrohttpd cairo) -lm -lpthread -o /tmp/bench_qmatmul
 *   OMP_NUM_THREADS=2 /tmp/bench_qmatmul [M ...]        (default: 1 16 512) */
#include "anneal/decode_kernels.h"
#include "cpu/cpu_kernels.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 7;
static uint32_t next(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 33);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

enum { REPS = 15 };

static void one_shape(int64_t M, int64_t N, int64_t K) {
    float *x = malloc((size_t)(M * K) * 4), *wf = malloc((size_t)(N * K) * 4), *ws = malloc((size_t)N * 4);
    float *bias = malloc((size_t)N * 4), *y[3];
    int8_t *w = malloc((size_t)(N * K));
    int8_t *panels = aligned_alloc(64, (size_t)(anneal_gemv_qpanels_len(K, N) + 63) / 64 * 64);
    for (int i = 0; i < 3; i++) y[i] = malloc((size_t)(M * N) * 4);
    for (int64_t i = 0; i < M * K; i++) x[i] = ((float)(next() % 20001) - 10000.0f) * 1e-4f;
    for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)((int)(next() % 255) - 127), wf[i] = (float)w[i] * 1e-3f;
    for (int64_t i = 0; i < N; i++) ws[i] = 1e-3f, bias[i] = (float)(next() % 100) * 1e-3f;
    anneal_gemv_pack_qpanels(w, K, N, panels);
    double t[3][REPS];
    for (int r = 0; r < REPS; r++)
        for (int j = 0; j < 3; j++) {
            const int v = (j + r) % 3; /* 0: int8 with panels, 1: int8 without, 2: f32 GEMM */
            const double t0 = now_s();
            if (v == 2) {
                anneal_gemm_epilogue ep = {.bias = bias};
                anneal_cpu_gemm(ANNEAL_F32, false, true, M, N, K, 1.0f, x, K, wf, K, 0.0f, y[2], N, &ep);
            } else {
                anneal_cpu_qmatmul_args a = {.mode = ANNEAL_CPU_QUANT_DYNAMIC, .compute = ANNEAL_F32, .M = M, .N = N,
                                             .K = K, .x = x, .w = w, .wscale = ws, .bias = bias, .y = y[v],
                                             .wpanels = v == 0 ? panels : NULL};
                if (anneal_cpu_qmatmul(&a)) {
                    fprintf(stderr, "qmatmul failed\n");
                    exit(1);
                }
            }
            t[v][r] = now_s() - t0;
        }
    double med[3];
    for (int v = 0; v < 3; v++) qsort(t[v], REPS, sizeof t[v][0], cmp_double), med[v] = t[v][REPS / 2];
    const double mac = (double)(M * N * K);
    printf("M %4lld  %5lld x %4lld  int8+panels %8.3f ms %6.1f GMAC/s  int8 %8.3f ms %6.1f  f32 %8.3f ms %6.1f"
           "  panels/int8 %.2fx  panels/f32 %.2fx  bits %s\n",
           (long long)M, (long long)N, (long long)K, med[0] * 1e3, mac / med[0] * 1e-9, med[1] * 1e3,
           mac / med[1] * 1e-9, med[2] * 1e3, mac / med[2] * 1e-9, med[1] / med[0], med[2] / med[0],
           memcmp(y[0], y[1], (size_t)(M * N) * 4) ? "DIFFER" : "equal");
    free(x), free(wf), free(ws), free(bias), free(w), free(panels);
    for (int i = 0; i < 3; i++) free(y[i]);
}

int main(int argc, char **argv) {
    static const int64_t shapes[][2] = {{2304, 768}, {768, 768}, {3072, 768}, {768, 3072}};
    int64_t ms[16] = {1, 16, 512};
    int nm = 3;
    if (argc > 1) {
        nm = 0;
        for (int i = 1; i < argc && nm < 16; i++) ms[nm++] = atoll(argv[i]);
    }
    printf("%d threads, median of %d; int8 path %s, panels %s\n", omp_get_max_threads(), REPS,
           anneal_cpu_gemm_s8_isa_name(anneal_cpu_gemm_s8_isa()), anneal_gemv_qpanels_useful() ? "used" : "not used");
    for (int i = 0; i < nm; i++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) one_shape(ms[i], shapes[s][0], shapes[s][1]);
    return 0;
}
