/* GFLOP/s of anneal_cpu_gemm at f32, bf16 and f16 operand precision on the GPT-2 124M
 * training shapes (B*T = 2048 rows, forward, dX and dW products with the transposes the
 * model uses), next to the measured peaks (anneal_peak_gflops_measure_dtype: the FMA
 * microbenchmark for f32/f16, VDPBF16PS for bf16) and the percentage of peak.
 *
 * Build and run (from the repository root, after building build/):
 *   gcc -std=c11 -O3 -Wall -Wextra -Werror -Wno-unused-parameter -D_GNU_SOURCE -fopenmp \
 *       -Iinclude -Isrc bench/bench_gemm.c build/libanneal.a \
 *       $(pkg-config --libs libcjson libpcre2-8) -lm -o /tmp/bench_gemm && /tmp/bench_gemm
 *
 * Options: --quick (fewer shapes and runs), --isa portable|avx2|avx512,
 *          --threads N (default: 2, or 1 with one core), --dtype f32|bf16|f16 (only that one),
 *          --shape M,N,K[,NN|NT|TN|TT] (only that shape), --all-trans (every transpose
 *          of each shape), --batched (only the batched lines), --best (fastest run, not
 *          median), --cputime (process CPU time / threads instead of wall time: steadier on
 *          a shared machine, but counts barrier spinning as work; the peaks are then
 *          measured on one thread in CPU time and multiplied by the thread count),
 *          --threadtime (a run's time is the largest CPU time any OpenMP thread spent in
 *          it: the best clock on a busy machine, where the others are inflated by the time
 *          other processes hold the cores; peaks as with --cputime; run it with
 *          OMP_WAIT_POLICY=passive, or a thread spinning at the end of a product while its
 *          partner is descheduled counts the wait as work),
 *          --peak-seconds S.
 * Each figure is the median of several timed runs after 0.1 s of warm-up; FLOPs = 2*M*N*K.
 * The machine should be otherwise idle: with 2 threads on 2 cores, any other busy process
 * stalls the threads and the figures collapse.
 * The batched line times 48 attention-like products (M = N = T, K = 64). */
#include "anneal/obs.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"

#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

typedef struct shape {
    int64_t M, N, K;
    int trans; /* bit 1: op(A) transposed, bit 0: op(B) transposed */
    const char *what;
} shape;

/* GPT-2 124M, B*T = 2048, C = 768, Conv1D weights (in, out) and the tied lm head
 * wte (V, C): forward x @ W (NN; lm head x @ wte^T, NT), dX = dY @ W^T (NT; lm head NN),
 * dW = X^T @ dY (TN). */
#define NN 0
#define NT 1
#define TN 2
#define TT 3
static const shape SHAPES[] = {
    {2048, 2304, 768, NN, "qkv fwd"},
    {2048, 768, 768, NN, "attn proj fwd"},
    {2048, 3072, 768, NN, "mlp up fwd"},
    {2048, 768, 3072, NN, "mlp down fwd"},
    {2048, 768, 2304, NT, "qkv dX"},
    {2048, 768, 768, NT, "attn proj dX"},
    {2048, 768, 3072, NT, "mlp up dX"},
    {2048, 3072, 768, NT, "mlp down dX"},
    {768, 2304, 2048, TN, "qkv dW"},
    {768, 768, 2048, TN, "attn proj dW"},
    {768, 3072, 2048, TN, "mlp up dW"},
    {3072, 768, 2048, TN, "mlp down dW"},
    {2048, 50304, 768, NT, "lm head fwd"},
    {2048, 768, 50304, NN, "lm head dX"},
    {50304, 768, 2048, TN, "lm head dW"},
};
#define NQUICK 12 /* --quick: the transformer-block shapes only */

static const char *TRANS_NAME[4] = {"NN", "NT", "TN", "TT"};

static bool use_best;    /* report the fastest run instead of the median */
static bool use_cputime; /* time with process CPU time divided by the thread count */

/* Seconds on the chosen clock. */
static double now(void) {
    if (!use_cputime) return omp_get_wtime();
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ((double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec) / omp_get_max_threads();
}

/* --threadtime: each OpenMP pool thread's own CPU clock; a run's time is the largest
 * increase among them (the busiest thread's running time, not counting the time other
 * processes held its core). */
#define MAX_TEAM 64
static bool use_threadtime;
static clockid_t team_clock[MAX_TEAM];
static int team_size;

/* Records the CPU clocks of the `threads` threads of the OpenMP team (the pool threads that
 * later parallel regions of that size reuse). */
static void team_setup(int threads) {
    team_size = threads < MAX_TEAM ? threads : MAX_TEAM;
#pragma omp parallel num_threads(team_size)
    pthread_getcpuclockid(pthread_self(), &team_clock[omp_get_thread_num()]);
}

/* The team's CPU times now. */
static void team_times(double *t) {
    for (int i = 0; i < team_size; i++) {
        struct timespec ts;
        clock_gettime(team_clock[i], &ts);
        t[i] = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
}

/* Starts a timed run: wall or process clock (now()), or the team's clocks. */
typedef struct run_timer {
    double t0, team0[MAX_TEAM];
} run_timer;

static void timer_start(run_timer *r) {
    if (use_threadtime)
        team_times(r->team0);
    else
        r->t0 = now();
}

static double timer_stop(const run_timer *r) {
    if (!use_threadtime) return now() - r->t0;
    double t[MAX_TEAM], m = 0;
    team_times(t);
    for (int i = 0; i < team_size; i++)
        if (t[i] - r->team0[i] > m) m = t[i] - r->team0[i];
    return m;
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

/* Median seconds of `runs` calls of the product at precision dt (after 0.1 s of warm-up
 * calls). */
static double time_gemm(int dt, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                        const float *A, const float *B, float *C, int runs,
                        const anneal_gemm_epilogue *ep) {
    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
    double t[16];
    for (double t0 = omp_get_wtime(); omp_get_wtime() - t0 < 0.1;) /* warm up */
        anneal_cpu_gemm(dt, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N, ep);
    for (int r = 0; r < runs; r++) {
        run_timer rt;
        timer_start(&rt);
        anneal_cpu_gemm(dt, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N, ep);
        t[r] = timer_stop(&rt);
    }
    qsort(t, (size_t)runs, sizeof(double), cmp_double);
    return use_best ? t[0] : t[runs / 2];
}

static double time_batched(int dt, int64_t batch, int64_t T, int64_t D, const float *A,
                           const float *B, float *C, int runs) {
    double t[16];
    for (double t0 = omp_get_wtime(); omp_get_wtime() - t0 < 0.1;) /* warm up */
        anneal_cpu_gemm_batched(dt, batch, false, true, T, T, D, 1.0f, A, D, T * D, B, D, T * D,
                                0.0f, C, T, T * T);
    for (int r = 0; r < runs; r++) {
        run_timer rt;
        timer_start(&rt);
        anneal_cpu_gemm_batched(dt, batch, false, true, T, T, D, 1.0f, A, D, T * D, B, D, T * D,
                                0.0f, C, T, T * T);
        t[r] = timer_stop(&rt);
    }
    qsort(t, (size_t)runs, sizeof(double), cmp_double);
    return use_best ? t[0] : t[runs / 2];
}

/* The peak for dt on `threads` threads. With --cputime or --threadtime (a shared machine)
 * the figure must
 * be on the same clock as the GEMM timings: it is measured on one thread, whose process
 * CPU time is its running time, scaled by wall / CPU time (the share of the core it got)
 * and multiplied by the thread count (the cores' FMA units are independent). */
static double measure_peak(int threads, double seconds, int dt, const char **isa) {
    if (!use_cputime && !use_threadtime)
        return anneal_peak_gflops_measure_dtype(threads, seconds, dt, isa);
    struct timespec c0, c1;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    const double w0 = omp_get_wtime();
    const double gf = anneal_peak_gflops_measure_dtype(1, seconds, dt, isa);
    const double wall = omp_get_wtime() - w0;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    const double cpu = (double)(c1.tv_sec - c0.tv_sec) + 1e-9 * (double)(c1.tv_nsec - c0.tv_nsec);
    return gf * (cpu > 0 ? wall / cpu : 1.0) * threads;
}

static const int DTYPES[3] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_F16};
static const char *DTYPE_NAME[3] = {"f32", "bf16", "f16"};

int main(int argc, char **argv) {
    bool quick = false, only_batched = false, all_trans = false;
    int threads = omp_get_max_threads() >= 2 ? 2 : 1, only_dtype = -1;
    double peak_seconds = 0.5;
    shape custom = {0, 0, 0, NN, "custom"};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            quick = true;
        } else if (!strcmp(argv[i], "--best")) {
            use_best = true;
        } else if (!strcmp(argv[i], "--batched")) {
            only_batched = true;
        } else if (!strcmp(argv[i], "--all-trans")) {
            all_trans = true;
        } else if (!strcmp(argv[i], "--cputime")) {
            use_cputime = true;
        } else if (!strcmp(argv[i], "--threadtime")) {
            use_threadtime = true;

        } else if (!strcmp(argv[i], "--isa") && i + 1 < argc) {
            const char *v = argv[++i];
            int isa = !strcmp(v, "portable") ? ANNEAL_GEMM_ISA_PORTABLE
                      : !strcmp(v, "avx2")   ? ANNEAL_GEMM_ISA_AVX2
                      : !strcmp(v, "avx512") ? ANNEAL_GEMM_ISA_AVX512
                                             : 99;
            if (anneal_cpu_sgemm_set_isa(isa) != 0) {
                fprintf(stderr, "ISA %s not available\n", v);
                return 1;
            }
        } else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) {
            const char *v = argv[++i];
            for (int d = 0; d < 3; d++)
                if (!strcmp(v, DTYPE_NAME[d])) only_dtype = d;
            if (only_dtype < 0) {
                fprintf(stderr, "--dtype %s: expected f32, bf16 or f16\n", v);
                return 1;
            }
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
            if (threads < 1) return 1;
        } else if (!strcmp(argv[i], "--peak-seconds") && i + 1 < argc) {
            peak_seconds = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            long long m, n, k;
            char tr[3] = "NN";
            int got = sscanf(argv[++i], "%lld,%lld,%lld,%2s", &m, &n, &k, tr);
            if (got < 3) return 1;
            int t = 0;
            for (int q = 0; q < 4; q++)
                if (!strcmp(tr, TRANS_NAME[q])) t = q;
            custom = (shape){m, n, k, t, "custom"};
        } else {
            fprintf(stderr, "usage: %s [--quick] [--isa portable|avx2|avx512] [--threads N] "
                            "[--dtype f32|bf16|f16] [--shape M,N,K[,NN|NT|TN|TT]] [--all-trans] "
                            "[--best] [--cputime] [--threadtime] [--batched] [--peak-seconds S]\n", argv[0]);
            return 1;
        }
    }
    omp_set_num_threads(threads);
    if (use_threadtime) {
        team_setup(threads);
        const char *wp = getenv("OMP_WAIT_POLICY");
        if (threads > 1 && !(wp && !strcasecmp(wp, "passive")))
            fprintf(stderr, "note: --threadtime without OMP_WAIT_POLICY=passive counts spinning "
                            "at joins as work\n");
    }
    const int runs = quick ? 3 : 5;
    const shape *shapes = custom.M ? &custom : SHAPES;
    const int nshapes = only_batched ? 0
                        : custom.M ? 1
                        : quick    ? NQUICK
                                   : (int)(sizeof SHAPES / sizeof SHAPES[0]);

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

    /* Peaks: f32 (and f16, which runs on f32 FMAs) and bf16. */
    const char *isa32 = NULL, *isa16 = NULL;
    const double peak32 = measure_peak(threads, peak_seconds, ANNEAL_F32, &isa32);
    const double peakbf = measure_peak(threads, peak_seconds, ANNEAL_BF16, &isa16);
    const double peak[3] = {peak32, peakbf, peak32};
    printf("%d threads; GFLOP/s, %s of %d runs (3 for the lm head)\n", threads,
           use_best ? "best" : "median", runs);
    printf("peak f32/f16 %.1f GFLOP/s (%s), peak bf16 %.1f GFLOP/s (%s)\n", peak32, isa32,
           peakbf, isa16);
    printf("kernels: f32 %s, bf16 %s, f16 %s\n", anneal_cpu_gemm_kernel_name(ANNEAL_F32),
           anneal_cpu_gemm_kernel_name(ANNEAL_BF16), anneal_cpu_gemm_kernel_name(ANNEAL_F16));
    printf("%-6s %-6s %-6s %-15s tr  ", "M", "N", "K", "what");
    for (int d = 0; d < 3; d++)
        if (only_dtype < 0 || only_dtype == d) printf("  %5s GF/s  %%pk", DTYPE_NAME[d]);
    printf("\n");
    double tot_flops[3] = {0}, tot_time[3] = {0};
    for (int s = 0; s < nshapes; s++) {
        const shape *sh = &shapes[s];
        for (int tr = 0; tr < 4; tr++) {
            if (!all_trans && tr != sh->trans) continue;
            const bool ta = tr >> 1, tb = tr & 1;
            printf("%-6lld %-6lld %-6lld %-15s %s  ", (long long)sh->M, (long long)sh->N,
                   (long long)sh->K, sh->what, TRANS_NAME[tr]);
            const double flops = 2.0 * sh->M * sh->N * sh->K;
            for (int d = 0; d < 3; d++) {
                if (only_dtype >= 0 && only_dtype != d) continue;
                double t = time_gemm(DTYPES[d], ta, tb, sh->M, sh->N, sh->K, A, B, C,
                                     flops > 5e10 ? 3 : runs, NULL);
                const double gf = flops / t / 1e9;
                printf("  %10.1f %4.0f%%", gf, 100.0 * gf / peak[d]);
                fflush(stdout);
                if (tr == sh->trans) {
                    tot_flops[d] += flops;
                    tot_time[d] += t;
                }
            }
            printf("\n");
        }
    }
    if (nshapes > 1) {
        printf("%-40s ", "all shapes above (total flops / time)");
        for (int d = 0; d < 3; d++)
            if (only_dtype < 0 || only_dtype == d)
                printf("  %10.1f %4.0f%%", tot_flops[d] / tot_time[d] / 1e9,
                       100.0 * tot_flops[d] / tot_time[d] / 1e9 / peak[d]);
        printf("\n");
    }
    if (!custom.M && !only_batched) {
        /* The MLP up projection with its fused epilogue (bias, tanh-GELU, pre-activation
         * kept for backward), as the model runs it. */
        const int64_t M = 2048, N = 3072, K = 768;
        float *bias = malloc(sizeof(float) * N), *pre = malloc(sizeof(float) * M * N);
        if (!bias || !pre) return 1;
        fill(bias, (size_t)N, 5);
        anneal_gemm_epilogue ep = {.bias = bias, .gelu_tanh = true, .pre = pre};
        printf("%-6lld %-6lld %-6lld %-15s %s  ", (long long)M, (long long)N, (long long)K,
               "+bias+GELU+pre", "NN");
        for (int d = 0; d < 3; d++) {
            if (only_dtype >= 0 && only_dtype != d) continue;
            double t = time_gemm(DTYPES[d], false, false, M, N, K, A, B, C, runs, &ep);
            const double gf = 2.0 * M * N * K / t / 1e9;
            printf("  %10.1f %4.0f%%", gf, 100.0 * gf / peak[d]);
        }
        printf("\n");
        free(bias);
        free(pre);
    }
    if (!custom.M) {
        const int64_t batch = 48, D = 64;
        float *Ab = malloc(sizeof(float) * batch * 256 * D),
              *Bb = malloc(sizeof(float) * batch * 256 * D),
              *Cb = malloc(sizeof(float) * batch * 256 * 256);
        if (!Ab || !Bb || !Cb) return 1;
        fill(Ab, (size_t)(batch * 256 * D), 3);
        fill(Bb, (size_t)(batch * 256 * D), 4);
        for (int64_t T = 64; T <= 256; T *= 2) {
            printf("batched 48 x (%lld x %lld x %lld, NT):", (long long)T, (long long)T,
                   (long long)D);
            for (int d = 0; d < 3; d++) {
                if (only_dtype >= 0 && only_dtype != d) continue;
                double t = time_batched(DTYPES[d], batch, T, D, Ab, Bb, Cb, runs);
                printf("  %s %7.1f", DTYPE_NAME[d], 2.0 * batch * T * T * D / t / 1e9);
            }
            printf(" GFLOP/s\n");
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
