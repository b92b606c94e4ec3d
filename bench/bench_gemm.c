/* GFLOP/s of anneal_cpu_sgemm on the model's shapes, all transposes, 1 and 2 threads.
 *
 * Build and run (from the repository root):
 *   gcc -std=c11 -O3 -Wall -Wextra -Werror -Wno-unused-parameter -D_GNU_SOURCE -fopenmp \
 *       -Iinclude -Isrc bench/bench_gemm.c src/cpu/gemm.c src/cpu/gemm_avx512.c \
 *       src/cpu/cpu_features.c -lm -o /tmp/bench_gemm && /tmp/bench_gemm
 *
 * Options: --quick (fewer shapes and runs), --isa portable|avx512, --threads N (only N),
 *          --shape M,N,K (only that shape, all transposes), --batched (only the batched
 *          lines), --best (fastest run, not median),
 *          --cputime (process CPU time / threads instead of wall time: steadier on a shared
 *          machine, but counts barrier spinning as work).
 * Each figure is the median of several timed runs after 0.1 s of warm-up; FLOPs = 2*M*N*K.
 * The machine should be otherwise idle: with 2 threads on 2 cores, any other busy process
 * stalls the threads at every barrier and the figures collapse.
 * The batched line times 48 attention-like products (M = N = T, K = 64). */
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct shape {
    int64_t M, N, K;
    const char *what;
} shape;

static const shape SHAPES[] = {
    {256, 768, 768, "attn proj, B*T=256"},
    {256, 3072, 768, "mlp up, B*T=256"},
    {256, 768, 3072, "mlp down, B*T=256"},
    {1024, 2304, 768, "qkv, B*T=1024"},
    {2048, 768, 768, "attn proj, B*T=2048"},
    {2048, 3072, 768, "mlp up, B*T=2048"},
    {2048, 768, 3072, "mlp down, B*T=2048"},
    {768, 3072, 2048, "weight grad (K=B*T)"},
    {768, 768, 2048, "weight grad (K=B*T)"},
    {2048, 50304, 768, "lm head"},
};

static bool use_best;    /* report the fastest run instead of the median */
static bool use_cputime; /* time with process CPU time divided by the thread count */

/* Seconds on the chosen clock. */
static double now(void) {
    if (!use_cputime) return omp_get_wtime();
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ((double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec) / omp_get_max_threads();
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Fills n floats with a cheap deterministic pattern in [-1, 1). */
static void fill(float *x, size_t n, unsigned seed) {
    uint32_t s = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)(s >> 8) / (float)(1 << 23) - 1.0f;
    }
}

/* Median seconds of `runs` calls of the product (after 0.1 s of warm-up calls). */
static double time_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float *A,
                        const float *B, float *C, int runs) {
    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
    double t[16];
    for (double t0 = omp_get_wtime(); omp_get_wtime() - t0 < 0.1;) /* warm up */
        anneal_cpu_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N);
    for (int r = 0; r < runs; r++) {
        double t0 = now();
        anneal_cpu_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N);
        t[r] = now() - t0;
    }
    qsort(t, (size_t)runs, sizeof(double), cmp_double);
    return use_best ? t[0] : t[runs / 2];
}

static double time_batched(int64_t batch, int64_t T, int64_t D, const float *A, const float *B,
                           float *C, int runs) {
    double t[16];
    for (double t0 = omp_get_wtime(); omp_get_wtime() - t0 < 0.1;) /* warm up */
        anneal_cpu_sgemm_batched(batch, false, true, T, T, D, 1.0f, A, D, T * D, B, D, T * D,
                                 0.0f, C, T, T * T);
    for (int r = 0; r < runs; r++) {
        double t0 = now();
        anneal_cpu_sgemm_batched(batch, false, true, T, T, D, 1.0f, A, D, T * D, B, D, T * D,
                                 0.0f, C, T, T * T);
        t[r] = now() - t0;
    }
    qsort(t, (size_t)runs, sizeof(double), cmp_double);
    return use_best ? t[0] : t[runs / 2];
}

int main(int argc, char **argv) {
    bool quick = false, only_batched = false;
    int only_threads = 0;
    shape custom = {0, 0, 0, "custom"};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            quick = true;
        } else if (!strcmp(argv[i], "--best")) {
            use_best = true;
        } else if (!strcmp(argv[i], "--batched")) {
            only_batched = true;
        } else if (!strcmp(argv[i], "--cputime")) {
            use_cputime = true;
        } else if (!strcmp(argv[i], "--isa") && i + 1 < argc) {
            const char *v = argv[++i];
            int isa = !strcmp(v, "portable") ? ANNEAL_GEMM_ISA_PORTABLE : ANNEAL_GEMM_ISA_AVX512;
            if (anneal_cpu_sgemm_set_isa(isa) != 0) {
                fprintf(stderr, "ISA %s not available\n", v);
                return 1;
            }
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            only_threads = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            long long m, n, k;
            if (sscanf(argv[++i], "%lld,%lld,%lld", &m, &n, &k) != 3) return 1;
            custom = (shape){m, n, k, "custom"};
        } else {
            fprintf(stderr, "usage: %s [--quick] [--isa portable|avx512] [--threads N] "
                            "[--shape M,N,K] [--best] [--cputime] [--batched]\n", argv[0]);
            return 1;
        }
    }
    const int runs = quick ? 3 : 7;
    const shape *shapes = custom.M ? &custom : SHAPES;
    const int nshapes = only_batched ? 0
                        : custom.M ? 1
                        : quick    ? 7
                                   : (int)(sizeof SHAPES / sizeof SHAPES[0]);
    const int max_threads = omp_get_max_threads();

    size_t maxa = 0, maxb = 0, maxc = 0;
    for (int s = 0; s < nshapes; s++) {
        size_t a = (size_t)(shapes[s].M * shapes[s].K), b = (size_t)(shapes[s].K * shapes[s].N),
               c = (size_t)(shapes[s].M * shapes[s].N);
        if (a > maxa) maxa = a;
        if (b > maxb) maxb = b;
        if (c > maxc) maxc = c;
    }
    float *A = aligned_alloc(64, (maxa * 4 + 64) & ~(size_t)63);
    float *B = aligned_alloc(64, (maxb * 4 + 64) & ~(size_t)63);
    float *C = aligned_alloc(64, (maxc * 4 + 64) & ~(size_t)63);
    if (!A || !B || !C) return 1;
    fill(A, maxa, 1);
    fill(B, maxb, 2);

    printf("isa %s, %d max threads; GFLOP/s, %s of %d runs\n", anneal_cpu_sgemm_isa_name(),
           max_threads, use_best ? "best" : "median", runs);
    printf("%-6s %-6s %-6s %-22s thr     NN      NT      TN      TT\n", "M", "N", "K", "what");
    for (int s = 0; s < nshapes; s++) {
        const shape *sh = &shapes[s];
        for (int th = 1; th <= max_threads && th <= 2; th++) {
            if (only_threads && th != only_threads) continue;
            omp_set_num_threads(th);
            printf("%-6lld %-6lld %-6lld %-22s %3d", (long long)sh->M, (long long)sh->N,
                   (long long)sh->K, sh->what, th);
            for (int tr = 0; tr < 4; tr++) {
                bool ta = tr >> 1, tb = tr & 1;
                double t = time_gemm(ta, tb, sh->M, sh->N, sh->K, A, B, C,
                                     sh->N > 10000 ? 3 : runs);
                printf(" %7.1f", 2.0 * sh->M * sh->N * sh->K / t / 1e9);
                fflush(stdout);
            }
            printf("\n");
        }
    }
    if (!custom.M) {
        const int64_t batch = 48, D = 64;
        float *Ab = malloc(sizeof(float) * batch * 256 * D),
              *Bb = malloc(sizeof(float) * batch * 256 * D),
              *Cb = malloc(sizeof(float) * batch * 256 * 256);
        if (!Ab || !Bb || !Cb) return 1;
        fill(Ab, (size_t)(batch * 256 * D), 3);
        fill(Bb, (size_t)(batch * 256 * D), 4);
        for (int64_t T = 64; T <= 256; T *= 2)
            for (int th = 1; th <= max_threads && th <= 2; th++) {
                if (only_threads && th != only_threads) continue;
                omp_set_num_threads(th);
                double t = time_batched(batch, T, D, Ab, Bb, Cb, runs);
                printf("batched 48 x (%lld x %lld x %lld, NT) %d thr: %7.1f GFLOP/s\n",
                       (long long)T, (long long)T, (long long)D, th,
                       2.0 * batch * T * T * D / t / 1e9);
            }
        free(Ab);
        free(Bb);
        free(Cb);
    }
    free(A);
    free(B);
    free(C);
    return 0;
}
