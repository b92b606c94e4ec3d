/* The int8 few-rows kernels of a serving step, one shape at a time, in one run: the
 * sign-trick kernel (anneal_qrows_s8_avx2) and the int16 kernel
 * (anneal_qrows_s8_wide_avx2), and with -DBENCH_OLD=F a third one, F, of the wide
 * kernel's signature (an older build of it, renamed), threads splitting the weight rows
 * in blocks of 48. Prints CPU ms per call (all threads; BENCH_WALL=1: wall ms) and G
 * multiply-adds per CPU second per kernel and shape, and
 * whether the outputs' bits agree. GPT-2 124M's shapes (N x K): 2304x768, 768x768,
 * 3072x768, 768x3072, 50257x768 (the head); "panel" is anneal_qpanels_s8_avx2 (weights
 * packed in panels of 16 rows, threads over blocks of 3 panels). Build (no library needed):
 *   gcc -O3 -std=c11 -D_GNU_SOURCE -fopenmp -Isrc/cpu bench/bench_qrows.c src/cpu/gemm_int8_avx2.c \
 *       src/cpu/qrows_wide_avx2.c src/cpu/qpanels_avx2.c -o /tmp/bench_qrows -lm
 *   OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1 /tmp/bench_qrows [M] [reps]
 * The old kernel: git show REV:src/cpu/qrows_wide_avx2.c | sed s/_wide_avx2/_old_avx2/ > /tmp/old.c, and
 * -DBENCH_OLD=anneal_qrows_s8_old_avx2 /tmp/old.c on the line above. -O3: the library's flags
 * (at -O2 the sign-trick kernel ran at about half its -O3 speed). */
#include "gemm_int8_internal.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* CPU seconds of the process (all threads): on a shared machine, time on the CPU rather
 * than waiting for it (run with OMP_WAIT_POLICY=passive so idle threads do not spin). */
static double now_s(void) {
    struct timespec ts;
    clock_gettime(getenv("BENCH_WALL") ? CLOCK_MONOTONIC : CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 7;
static uint32_t next(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 33);
}

#ifdef BENCH_OLD
void BENCH_OLD(const anneal_qrows_s8_args *q, const int16_t *x16, int64_t n0, int64_t n1);
#endif

/* One call of kernel kind (0 sign trick, 1 wide, 2 old), threads over blocks of 48 weight rows. */
static void run(int kind, const anneal_qrows_s8_args *q, const int16_t *x16, const int16_t *x16k,
                const int8_t *panels, const int16_t *x16p) {
    if (kind == 3) { /* panels of 16 weight rows, 3 panels (48 rows) a block */
        const int64_t np = (q->N + 15) / 16, nb = (np + 2) / 3;
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nb; b++) anneal_qpanels_s8_avx2(q, panels, x16p, b * 3, b * 3 + 3 < np ? b * 3 + 3 : np);
        return;
    }
    const int64_t nb = (q->N + 47) / 48;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t n0 = b * 48, n1 = n0 + 48 < q->N ? n0 + 48 : q->N;
        if (kind == 0) anneal_qrows_s8_avx2(q, n0, n1);
        else if (kind == 1) anneal_qrows_s8_wide_avx2(q, x16, n0, n1);
#ifdef BENCH_OLD
        else BENCH_OLD(q, x16k, n0, n1);
#else
        else (void)x16k;
#endif
    }
}

int main(int argc, char **argv) {
    const int64_t M = argc > 1 ? atoi(argv[1]) : 16;
    const int reps = argc > 2 ? atoi(argv[2]) : 10;
    static const int64_t shapes[][2] = {{2304, 768}, {768, 768}, {3072, 768}, {768, 3072}, {50257, 768}};
    static const char *names[] = {"sign", "wide", "old", "panel"};
#ifdef BENCH_OLD
    const int kinds = 4;
#else
    const int kinds = 3; /* sign, wide, panel (kind 3, at j == 2) */
#endif
    printf("M %lld, %d threads, best of %d\n", (long long)M, omp_get_max_threads(), reps);
    for (size_t s = 0; s < 5; s++) {
        const int64_t N = shapes[s][0], K = shapes[s][1], M4 = (M + 3) & ~(int64_t)3;
        const int64_t copies = getenv("BENCH_HOT") ? 1 : (64ll << 20) / (N * K) + 1; /* weights cold: >= 64 MiB of copies in turn (> L3); BENCH_HOT=1: one copy */
        int8_t *xq = malloc((size_t)(M * K)), *w = malloc((size_t)(N * K * copies));
        /* x16 64-byte aligned; the old kernel's copy BENCH_X16_OFFSET bytes past a 64-byte
         * boundary (malloc gives 16-byte alignment: 16 splits every other 32-byte load) */
        const size_t x16b = (size_t)(M4 * K) * sizeof(int16_t), off = getenv("BENCH_X16_OFFSET") ? (size_t)atoi(getenv("BENCH_X16_OFFSET")) : 0;
        char *x16mem = aligned_alloc(64, (x16b + 127) / 64 * 64), *x16kmem = aligned_alloc(64, (x16b + 127) / 64 * 64);
        int16_t *x16 = (int16_t *)x16mem, *x16k = (int16_t *)(x16kmem + off);
        memset(x16mem, 0, x16b), memset(x16k, 0, x16b);
        float *sx = malloc((size_t)M * 4), *ws = malloc((size_t)N * 4), *y[4];
        for (int i = 0; i < 4; i++) y[i] = malloc((size_t)(M * N) * 4);
        const int64_t plen = anneal_qpanels_s8_len(N, K), Kp = (K + 1) & ~(int64_t)1;
        int8_t *panels = aligned_alloc(64, (size_t)(plen * copies + 63) / 64 * 64);
        int16_t *x16p = calloc((size_t)(M * Kp), sizeof *x16p);
        for (int64_t i = 0; i < M * K; i++) x16k[i] = x16[i] = xq[i] = (int8_t)((int)(next() % 255) - 127);
        for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)((int)(next() % 256) - 128);
        for (int64_t c = 1; c < copies; c++) memcpy(w + c * N * K, w, (size_t)(N * K));
        for (int64_t c = 0; c < copies; c++) anneal_qpanels_s8_pack(w, N, K, panels + c * plen);
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k++) x16p[i * Kp + k] = xq[i * K + k];
        for (int64_t i = 0; i < M; i++) sx[i] = 1e-3f;
        for (int64_t i = 0; i < N; i++) ws[i] = 1e-3f;
        printf("%5lld x %4lld:", (long long)N, (long long)K);
        /* the kernels in turn within each repetition, so a machine that changes speed
         * (shared cores) weighs on all of them alike; the best of reps each. Each call reads
         * a weight copy no recent call read (none in cache but by size) */
        double best[4] = {1e30, 1e30, 1e30, 1e30};
        for (int r = 0; r < reps; r++)
            for (int j = 0; j < kinds; j++) {
                int kind = (j + r) % kinds; /* each kind first in turn, each call its own weight copy */
#ifndef BENCH_OLD
                kind = kind == 2 ? 3 : kind;
#endif
                if ((kind == 1 || kind == 2) && M < 2) continue;
                anneal_qrows_s8_args q = {.M = M, .N = N, .K = K, .xq = xq, .sx = sx,
                                          .w = w + ((int64_t)r * kinds + kind) % copies * N * K,
                                          .wscale = ws, .y = y[kind]};
                double t0 = now_s();
                run(kind, &q, x16, x16k, panels + ((int64_t)r * kinds + kind) % copies * plen, x16p);
                double t = now_s() - t0;
                best[kind] = t < best[kind] ? t : best[kind];
            }
        for (int kind = 0; kind < 4; kind++)
            if (best[kind] < 1e30)
                printf("  %s %.3f ms %.1f GMAC/s", names[kind], best[kind] * 1e3, (double)(M * N * K) / best[kind] * 1e-9);
        const bool eq = (M < 2 || !memcmp(y[0], y[1], (size_t)(M * N) * 4)) && !memcmp(y[0], y[3], (size_t)(M * N) * 4);
        printf("  bits %s\n", eq ? "equal" : "DIFFER");
        free(xq), free(w), free(x16mem), free(x16kmem), free(sx), free(ws), free(panels), free(x16p);
        for (int i = 0; i < 4; i++) free(y[i]);
    }
    return 0;
}
