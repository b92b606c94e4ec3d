/* Helpers of the CPU GEMM precision tests (test_gemm_precision.c, test_gemm_amx.c):
 * random operands, one product's problem, the summation bound against a double reference
 * over the rounded operands (see test_gemm_precision.c's top), bit comparisons, and the
 * shapes every kernel is run on. */
#ifndef ANNEAL_TESTS_CPU_GEMM_CHECK_H
#define ANNEAL_TESTS_CPU_GEMM_CHECK_H

#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x243F6A8885A308D3ull;

static inline double urand(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static inline int64_t irand(int64_t lo, int64_t hi) { return lo + (int64_t)(urand() * (double)(hi - lo + 1)); }

/* n floats in [-1, 1) (at least one element allocated). */
static inline float *rand_buf(int64_t n) {
    float *x = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(2.0 * urand() - 1.0);
    return x;
}

static inline float *copy_buf(const float *x, int64_t n) {
    float *y = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    memcpy(y, x, sizeof(float) * (size_t)n);
    return y;
}

static inline float round_to(int compute, float x) {
    return compute == ANNEAL_BF16 ? anneal_gemm_round_bf16(x)
           : compute == ANNEAL_F16 ? anneal_gemm_round_f16(x)
                                   : x;
}

static inline float *rounded_copy(int compute, const float *x, int64_t n) {
    float *y = copy_buf(x, n);
    for (int64_t i = 0; i < n; i++) y[i] = round_to(compute, y[i]);
    return y;
}

static inline bool bits_equal(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* The f32 ISAs this CPU can run. */
static inline int isa_list(int *isas) {
    int n = 0;
    isas[n++] = ANNEAL_GEMM_ISA_PORTABLE;
    if (anneal_cpu_has_avx2()) isas[n++] = ANNEAL_GEMM_ISA_AVX2;
    if (anneal_cpu_has_avx512()) isas[n++] = ANNEAL_GEMM_ISA_AVX512;
    return n;
}

/* One product's operands: op(A) M x K, op(B) K x N, C M x N, leading dims padded by pad. */
typedef struct prob {
    bool ta, tb;
    int64_t M, N, K, lda, ldb, ldc;
    float alpha, beta;
    float *A, *B, *C0; /* C0: C before the product */
    int64_t na, nb, nc;
} prob;

static inline prob make_prob(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, float beta,
                      int64_t pad) {
    prob p = {.ta = ta, .tb = tb, .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta};
    p.lda = (ta ? M : K) + pad;
    p.ldb = (tb ? K : N) + pad;
    p.ldc = N + pad;
    p.na = (ta ? K : M) * p.lda;
    p.nb = (tb ? N : K) * p.ldb;
    p.nc = M * p.ldc;
    p.A = rand_buf(p.na);
    p.B = rand_buf(p.nb);
    p.C0 = rand_buf(p.nc);
    return p;
}

static inline void free_prob(prob *p) {
    free(p->A);
    free(p->B);
    free(p->C0);
}

/* C = a fresh copy of C0 after anneal_cpu_gemm(compute, ..., ep). */
static inline float *run_gemm(const prob *p, int compute, const anneal_gemm_epilogue *ep) {
    float *C = copy_buf(p->C0, p->nc);
    anneal_cpu_gemm(compute, p->ta, p->tb, p->M, p->N, p->K, p->alpha, p->A, p->lda, p->B, p->ldb,
                    p->beta, C, p->ldc, ep);
    return C;
}

/* Elements of C (M x N) outside the summation bound around the double reference over the
 * operands rounded to `compute` (see the top of the file); reports the first. */
static inline int64_t count_outside_bound(const prob *p, int compute, const float *C, const char *what) {
    const double u = ldexp(1.0, -24), lim_rel = (double)(p->K + 4) * u;
    float *ar = rounded_copy(compute, p->A, p->na), *br = rounded_copy(compute, p->B, p->nb);
    int64_t bad = 0;
    for (int64_t i = 0; i < p->M; i++)
        for (int64_t j = 0; j < p->N; j++) {
            double s = 0, sa = 0;
            for (int64_t k = 0; k < p->K; k++) {
                double a = p->ta ? ar[k * p->lda + i] : ar[i * p->lda + k];
                double b = p->tb ? br[j * p->ldb + k] : br[k * p->ldb + j];
                s += a * b;
                sa += fabs(a * b);
            }
            double c0 = p->beta == 0.0f ? 0.0 : (double)p->beta * p->C0[i * p->ldc + j];
            double ref = p->alpha * s + c0;
            double lim = lim_rel * (fabs((double)p->alpha) * sa + fabs(c0)) + 1e-30;
            double c = C[i * p->ldc + j];
            if (!(fabs(c - ref) <= lim)) {
                if (!bad)
                    anneal_test_fail(__FILE__, __LINE__,
                                     "%s %c%c M=%lld N=%lld K=%lld: C[%lld,%lld] = %.9g, ref %.9g "
                                     "(bound %.3g)", what, p->ta ? 'T' : 'N', p->tb ? 'T' : 'N',
                                     (long long)p->M, (long long)p->N, (long long)p->K,
                                     (long long)i, (long long)j, c, ref, lim);
                bad++;
            }
        }
    free(ar);
    free(br);
    return bad;
}

/* Elements (including padding) where a and b differ in bits; reports the first. */
static inline int64_t count_diff(const float *a, const float *b, int64_t n, const char *what) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!bits_equal(a[i], b[i])) {
            if (!bad)
                anneal_test_fail(__FILE__, __LINE__, "%s: element %lld is %.9g, expected %.9g",
                                 what, (long long)i, a[i], b[i]);
            bad++;
        }
    return bad;
}

/* Random problem shapes: edge sizes around the tiles (mr 4/6/8, nr 16/32), and larger
 * ones spanning several depth blocks (kc 256 f32, 512 bf16) with odd K. */
static const int64_t SHAPES[][3] = {
    {1, 1, 1},   {2, 3, 1},    {7, 17, 5},    {8, 32, 2},    {9, 33, 3},   {13, 47, 31},
    {6, 16, 64}, {31, 15, 129}, {65, 70, 257}, {40, 100, 600}, {17, 40, 1025}, {1, 300, 77},
    {1, 70, 600}};
#define NSHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))

#endif
