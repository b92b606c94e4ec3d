/* Throughput of the CPU flash attention kernels on GPT-2-small-like shapes
 * (B=4, H=12, T=256, D=64, causal, q/k/v interleaved in a (B, T, 3C) buffer).
 * FLOPs count only the visible (causal) score pairs: forward 4*D per pair
 * (QK^T, PV), backward 10*D per pair (QK^T recompute, dO V^T, P^T dO, dS K, dS^T Q).
 * Build: gcc -std=c11 -O3 -D_GNU_SOURCE -fopenmp -Iinclude -Isrc bench/bench_attention.c \
 *        src/cpu/attention.c src/cpu/cpu_features.c -lm -o /tmp/bench_attention
 * Run:   OMP_NUM_THREADS=2 /tmp/bench_attention [B H T D]   (ANNEAL_CPU_ISA=portable for C) */
#include "cpu/cpu_kernels.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    int64_t B = 4, H = 12, T = 256, D = 64;
    if (argc == 5) B = atoll(argv[1]), H = atoll(argv[2]), T = atoll(argv[3]), D = atoll(argv[4]);
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
                              .causal = true};
    const double pairs = (double)B * H * T * (T + 1) / 2.0;
    const int reps = 20;
    double tf = 1e30, tb = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = omp_get_wtime();
        anneal_cpu_attention_fwd(&d, qkv, qkv + C, qkv + 2 * C, o, lse);
        double t1 = omp_get_wtime();
        anneal_cpu_attention_bwd(&d, qkv, qkv + C, qkv + 2 * C, o, dout, lse, dqkv, dqkv + C,
                                 dqkv + 2 * C);
        double t2 = omp_get_wtime();
        if (t1 - t0 < tf) tf = t1 - t0;
        if (t2 - t1 < tb) tb = t2 - t1;
    }
    printf("attention B=%lld H=%lld T=%lld D=%lld causal, %d threads (best of %d)\n", (long long)B,
           (long long)H, (long long)T, (long long)D, omp_get_max_threads(), reps);
    printf("  fwd %.3f ms  %.1f GFLOP/s\n", tf * 1e3, 4.0 * D * pairs / tf * 1e-9);
    printf("  bwd %.3f ms  %.1f GFLOP/s\n", tb * 1e3, 10.0 * D * pairs / tb * 1e-9);
    free(qkv), free(dqkv), free(o), free(dout), free(lse);
    return 0;
}
