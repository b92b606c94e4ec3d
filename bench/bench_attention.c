/* Throughput of the CPU flash attention kernels on GPT-2-like shapes (default B=8, H=12,
 * T=256, D=64, causal, q/k/v interleaved in a (B, T, 3C) buffer) at f32 and bf16 compute
 * precision (bf16: tile products on bf16 operands with f32 accumulation; the AVX512-BF16
 * kernel where the CPU has it, else the rounded-operand fallback; ANNEAL_ISA=avx512, avx2
 * or portable forces the fallback on those tiles).
 * FLOPs count only the visible (causal) score pairs: forward 4*D per pair
 * (QK^T, PV), backward 10*D per pair (QK^T recompute, dO V^T, P^T dO, dS K, dS^T Q).
 * Each figure is the median of the timed runs, in two clocks: wall time, and thread time
 * (the largest CPU time any OpenMP thread spent in the call: on a shared machine this is
 * not inflated by the time other processes hold the cores; run with
 * OMP_WAIT_POLICY=passive so that a thread waiting at the end of the loop does not count
 * its spinning).
 * Build (after building the library in build/):
 *   gcc -std=c11 -O3 -D_GNU_SOURCE -fopenmp -Iinclude -Isrc bench/bench_attention.c \
 *       build/libanneal.a -lm -o /tmp/bench_attention
 * Run:   OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive /tmp/bench_attention [B H T D] [f32|bf16|both]
 *        [reps] */
#include "anneal/core.h"
#include "cpu/cpu_kernels.h"

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_TEAM 64
static clockid_t team_clock[MAX_TEAM];
static int team_size;

/* Records the CPU clocks of the OpenMP pool threads (reused by later regions). */
static void team_setup(void) {
    team_size = omp_get_max_threads() < MAX_TEAM ? omp_get_max_threads() : MAX_TEAM;
#pragma omp parallel num_threads(team_size)
    pthread_getcpuclockid(pthread_self(), &team_clock[omp_get_thread_num()]);
}

static void team_times(double *t) {
    for (int i = 0; i < team_size; i++) {
        struct timespec ts;
        clock_gettime(team_clock[i], &ts);
        t[i] = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
}

/* Largest increase of a team clock since t0. */
static double team_elapsed(const double *t0) {
    double t[MAX_TEAM], m = 0;
    team_times(t);
    for (int i = 0; i < team_size; i++)
        if (t[i] - t0[i] > m) m = t[i] - t0[i];
    return m;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

int main(int argc, char **argv) {
    int64_t B = 8, H = 12, T = 256, D = 64;
    int ai = 1;
    if (argc >= 5) {
        B = atoll(argv[1]), H = atoll(argv[2]), T = atoll(argv[3]), D = atoll(argv[4]);
        ai = 5;
    }
    const char *mode = argc > ai ? argv[ai] : "both";
    const int reps = argc > ai + 1 ? atoi(argv[ai + 1]) : 15;
    if (reps < 1 || (strcmp(mode, "f32") && strcmp(mode, "bf16") && strcmp(mode, "both"))) {
        fprintf(stderr, "usage: %s [B H T D] [f32|bf16|both] [reps]\n", argv[0]);
        return 2;
    }
    const int64_t C = H * D;
    float *qkv = malloc(sizeof(float) * (size_t)(B * T * 3 * C));
    float *dqkv = malloc(sizeof(float) * (size_t)(B * T * 3 * C));
    float *o = malloc(sizeof(float) * (size_t)(B * T * C));
    float *dout = malloc(sizeof(float) * (size_t)(B * T * C));
    float *lse = malloc(sizeof(float) * (size_t)(B * H * T));
    srand(1);
    for (int64_t i = 0; i < B * T * 3 * C; i++) qkv[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int64_t i = 0; i < B * T * C; i++) dout[i] = (float)rand() / RAND_MAX - 0.5f;
    anneal_cpu_attn_desc d = {.B = B,
                              .H = H,
                              .Tq = T,
                              .Tk = T,
                              .D = D,
                              .q_sb = T * 3 * C,
                              .q_sh = D,
                              .q_st = 3 * C,
                              .k_sb = T * 3 * C,
                              .k_sh = D,
                              .k_st = 3 * C,
                              .v_sb = T * 3 * C,
                              .v_sh = D,
                              .v_st = 3 * C,
                              .o_sb = T * C,
                              .o_sh = D,
                              .o_st = C,
                              .scale = 1.0f / sqrtf((float)D),
                              .causal = true,
                              .Hkv = 0 /* = H: multi-head */};
    const double pairs = (double)B * H * T * (T + 1) / 2.0;
    team_setup();
    printf("attention B=%lld H=%lld T=%lld D=%lld causal, %d threads (median of %d; ms per call)\n",
           (long long)B, (long long)H, (long long)T, (long long)D, omp_get_max_threads(), reps);
    const int computes[2] = {ANNEAL_F32, ANNEAL_BF16};
    for (int ci = 0; ci < 2; ci++) {
        const int cd = computes[ci];
        if (strcmp(mode, "both") && strcmp(mode, cd == ANNEAL_BF16 ? "bf16" : "f32")) continue;
        double *wf = malloc(sizeof(double) * (size_t)reps), *wb = malloc(sizeof(double) * (size_t)reps);
        double *tf = malloc(sizeof(double) * (size_t)reps), *tb = malloc(sizeof(double) * (size_t)reps);
        for (int r = -2; r < reps; r++) { /* two warm-up calls */
            double c0[MAX_TEAM], c1[MAX_TEAM];
            team_times(c0);
            const double t0 = omp_get_wtime();
            anneal_cpu_attention_fwd(&d, qkv, qkv + C, qkv + 2 * C, o, lse, cd);
            const double t1 = omp_get_wtime(), f_thr = team_elapsed(c0);
            team_times(c1);
            const double t1b = omp_get_wtime();
            anneal_cpu_attention_bwd(&d, qkv, qkv + C, qkv + 2 * C, o, dout, lse, dqkv, dqkv + C,
                                     dqkv + 2 * C, cd);
            const double t2 = omp_get_wtime(), b_thr = team_elapsed(c1);
            if (r < 0) continue;
            wf[r] = t1 - t0, wb[r] = t2 - t1b, tf[r] = f_thr, tb[r] = b_thr;
        }
        const double mwf = median(wf, reps), mwb = median(wb, reps);
        const double mtf = median(tf, reps), mtb = median(tb, reps);
        printf("  %-4s fwd %7.3f ms wall %7.3f ms thread (%5.1f GFLOP/s)  bwd %7.3f ms wall %7.3f ms "
               "thread (%5.1f GFLOP/s)  fwd+bwd %7.3f wall %7.3f thread\n",
               cd == ANNEAL_BF16 ? "bf16" : "f32", mwf * 1e3, mtf * 1e3, 4.0 * D * pairs / mtf * 1e-9,
               mwb * 1e3, mtb * 1e3, 10.0 * D * pairs / mtb * 1e-9, (mwf + mwb) * 1e3,
               (mtf + mtb) * 1e3);
        free(wf), free(wb), free(tf), free(tb);
    }
    free(qkv), free(dqkv), free(o), free(dout), free(lse);
    return 0;
}
