/* The few-rows quantized product for 2 or more rows on AVX2 (serving steps: one row per
 * running request; short prompts): the same sums and epilogue as anneal_qrows_s8_avx2,
 * faster. The activations are widened to int16 once per call
 * (the caller's x16); each weight row is widened as it is read (vpmovsxbw, about one
 * per cycle on Zen 3) and multiplied into 8 rows of x16 with vpmaddwd (two per cycle):
 * one widening per 8 multiplies, where the sign trick of anneal_qrows_s8_avx2 spends
 * three uops of the same two pipes per 32 products. int16 x int16 pair sums (at most
 * 2 * 127 * 128 in magnitude) and the int32 accumulation are exact, so y has the bits
 * of anneal_qrows_s8_avx2 (tests/serve/test_serve_qrows.c). Rows go 8 at a time, the
 * rest 4 at a time (the last block over the caller's zero rows: 15 rows cost 16). */
#include "gemm_int8_internal.h"

#include <immintrin.h>

#define AVX2_TARGET __attribute__((target("avx2")))

/* Rows m .. m + count - 1 of y for weight row n: each lane total of c plus the K tail
 * past the 16-wide steps, through the epilogue. */
AVX2_TARGET static inline __attribute__((always_inline)) void store_rows(const anneal_qrows_s8_args *q,
                                                                          const int16_t *a, const int8_t *b,
                                                                          const __m256i *c, int64_t m, int64_t n,
                                                                          int count) {
    const int64_t K = q->K, kfull = K & ~(int64_t)15;
    for (int i = 0; i < count; i++) {
        int32_t s = anneal_hsum8_s32(c[i]);
        for (int64_t k = kfull; k < K; k++) s += (int32_t)a[i * K + k] * (int32_t)b[k];
        const int64_t mm = m + i;
        q->y[mm * q->N + n] = (float)s * (q->sx[mm] * q->wscale[n]) + (q->bias ? q->bias[n] : 0.0f);
    }
}

#define ROW(i) c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a + (i) * K + k)), bv))

/* Rows m .. m + 7 of y for weight row n (K: the full 16-value steps, then the tail). */
AVX2_TARGET static inline __attribute__((always_inline)) void rows8(const anneal_qrows_s8_args *q, const int16_t *x16,
                                                                    int64_t m, int64_t n) {
    const int64_t K = q->K, kfull = K & ~(int64_t)15;
    const int8_t *b = q->w + n * K;
    const int16_t *a = x16 + m * K;
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (int64_t k = 0; k < kfull; k += 16) {
        const __m256i bv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + k)));
        ROW(0);
        ROW(1);
        ROW(2);
        ROW(3);
        ROW(4);
        ROW(5);
        ROW(6);
        ROW(7);
    }
    const __m256i c[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
    store_rows(q, a, b, c, m, n, 8);
}

/* Rows m .. m + valid - 1 (valid <= 4) of y for weight row n: 4 rows of x16 computed
 * (the rows past M are the caller's zero padding), the valid ones stored. */
AVX2_TARGET static inline __attribute__((always_inline)) void rows4(const anneal_qrows_s8_args *q, const int16_t *x16,
                                                                    int64_t m, int64_t n, int valid) {
    const int64_t K = q->K, kfull = K & ~(int64_t)15;
    const int8_t *b = q->w + n * K;
    const int16_t *a = x16 + m * K;
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t k = 0; k < kfull; k += 16) {
        const __m256i bv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + k)));
        ROW(0);
        ROW(1);
        ROW(2);
        ROW(3);
    }
    const __m256i c[4] = {c0, c1, c2, c3};
    store_rows(q, a, b, c, m, n, valid);
}

/* See gemm_int8_internal.h. The last M % 4 rows (when M > 4) go through the sign-trick
 * kernel on the same weight row (in L1 by then) rather than a 4-row block over zero
 * rows: at -O3 on Zen 3 a 9- or 13-row product (a short prompt's prefill) took 8-20% less time
 * than as padded 4-row blocks here (bench/bench_qrows.c). */
AVX2_TARGET void anneal_qrows_s8_wide_avx2(const anneal_qrows_s8_args *q, const int16_t *x16, int64_t n0, int64_t n1) {
    const int64_t M = q->M, m8 = M & ~(int64_t)7, m4 = M > 4 ? M & ~(int64_t)3 : M;
    anneal_qrows_s8_args t = *q; /* rows m4 .. M - 1 alone */
    t.M = M - m4, t.xq = q->xq + m4 * q->K, t.sx = q->sx + m4, t.y = q->y + m4 * q->N;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < m8; m += 8) rows8(q, x16, m, n);
        for (int64_t m = m8; m < m4; m += 4) rows4(q, x16, m, n, M - m < 4 ? (int)(M - m) : 4);
        if (t.M > 0) anneal_qrows_s8_avx2(&t, n, n + 1);
    }
}
