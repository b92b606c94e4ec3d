/* The few-rows quantized product for 2 or more rows on AVX2 (serving steps: one row per
 * running request; short prompts): the same sums and epilogue as anneal_qrows_s8_avx2,
 * faster. The activations are widened to int16 once per call
 * (the caller's x16, rows anneal_qrows_x16_ld(K) apart); each weight row is widened as it is read (vpmovsxbw, about one
 * per cycle on Zen 3) and multiplied into 8 rows of x16 with vpmaddwd (two per cycle):
 * one widening per 8 multiplies, where the sign trick of anneal_qrows_s8_avx2 spends
 * three uops of the same two pipes per 32 products. int16 x int16 pair sums (at most
 * 2 * 127 * 128 in magnitude) and the int32 accumulation are exact, so y has the bits
 * of anneal_qrows_s8_avx2 (tests/serve/test_serve_qrows.c). Rows go 8 at a time, the
 * rest 4 at a time (the last block over the caller's zero rows: 15 rows cost 16). Past
 * K = WIDE_KMAX (GPT-2's 3072-wide MLP projection) x16 outgrows L1, and K goes in
 * chunks (wide_chunked). */
#include "gemm_int8_internal.h"

#include <immintrin.h>

#define AVX2_TARGET __attribute__((target("avx2")))

/* The chunk of K of wide_chunked, the weight rows that share a chunk of x16 there, and
 * the most rows of x16 it holds sums for (the driver's few-rows limit). */
enum { WIDE_KCHUNK = 512, WIDE_GROUP = 8, WIDE_MMAX = 32 };

/* Rows m .. m + count - 1 of y for weight row n: each lane total of c plus the K tail
 * past the 16-wide steps (a: x16 row m), through the epilogue. */
AVX2_TARGET static inline __attribute__((always_inline)) void store_rows(const anneal_qrows_s8_args *q,
                                                                          const int16_t *a, const int8_t *b,
                                                                          const __m256i *c, int64_t m, int64_t n,
                                                                          int count) {
    const int64_t K = q->K, kfull = K & ~(int64_t)15, L = anneal_qrows_x16_ld(K);
    for (int i = 0; i < count; i++) {
        int32_t s = anneal_hsum8_s32(c[i]);
        for (int64_t k = kfull; k < K; k++) s += (int32_t)a[i * L + k] * (int32_t)b[k];
        const int64_t mm = m + i;
        q->y[mm * q->N + n] = (float)s * (q->sx[mm] * q->wscale[n]) + (q->bias ? q->bias[n] : 0.0f);
    }
}

#define ROW(i) c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a + (i) * L + k)), bv))

/* Rows m .. m + R - 1 (R = 8 or 4, a constant) of x16 by weight row n over K values
 * [k0, k1) (16-value steps), the int32 lane sums carried in acc (R vectors). */
AVX2_TARGET static inline __attribute__((always_inline)) void part(const anneal_qrows_s8_args *q, const int16_t *x16,
                                                                   int64_t m, int64_t n, int64_t k0, int64_t k1,
                                                                   __m256i *acc, const int R) {
    const int64_t L = anneal_qrows_x16_ld(q->K);
    const int8_t *b = q->w + n * q->K;
    const int16_t *a = x16 + m * L;
    __m256i c0 = acc[0], c1 = acc[1], c2 = acc[2], c3 = acc[3], c4, c5, c6, c7;
    if (R == 8) c4 = acc[4], c5 = acc[5], c6 = acc[6], c7 = acc[7];
    for (int64_t k = k0; k < k1; k += 16) {
        const __m256i bv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + k)));
        ROW(0);
        ROW(1);
        ROW(2);
        ROW(3);
        if (R == 8) {
            ROW(4);
            ROW(5);
            ROW(6);
            ROW(7);
        }
    }
    acc[0] = c0, acc[1] = c1, acc[2] = c2, acc[3] = c3;
    if (R == 8) acc[4] = c4, acc[5] = c5, acc[6] = c6, acc[7] = c7;
}

/* Rows m .. m + R - 1 (R = 8 or 4) by weight row n over all of K, stored (valid rows). */
AVX2_TARGET static inline __attribute__((always_inline)) void rows(const anneal_qrows_s8_args *q, const int16_t *x16,
                                                                   int64_t m, int64_t n, const int R, int valid) {
    __m256i c[8];
    for (int i = 0; i < R; i++) c[i] = _mm256_setzero_si256();
    part(q, x16, m, n, 0, q->K & ~(int64_t)15, c, R);
    store_rows(q, x16 + m * anneal_qrows_x16_ld(q->K), q->w + n * q->K, c, m, n, valid);
}

/* The product for K > ANNEAL_QROWS_WIDE_KMAX: K in chunks of WIDE_KCHUNK values, each
 * chunk of x16 (16 KiB at 16 rows; the rows padded apart so that they do not share L1
 * sets, anneal_qrows_x16_ld) passing over WIDE_GROUP weight rows from L1 before the next
 * chunk; the lane sums wait in acc between chunks. The same int32 sums, the same bits. */
AVX2_TARGET static void wide_chunked(const anneal_qrows_s8_args *q, const int16_t *x16, int64_t n0, int64_t n1) {
    const int64_t M = q->M, M4 = (M + 3) & ~(int64_t)3, m8 = M & ~(int64_t)7, K = q->K,
                  kfull = K & ~(int64_t)15, L = anneal_qrows_x16_ld(K);
    __m256i acc[WIDE_GROUP * WIDE_MMAX];
    for (int64_t g0 = n0; g0 < n1; g0 += WIDE_GROUP) {
        const int64_t g1 = g0 + WIDE_GROUP < n1 ? g0 + WIDE_GROUP : n1;
        for (int64_t i = 0; i < (g1 - g0) * M4; i++) acc[i] = _mm256_setzero_si256();
        for (int64_t k0 = 0; k0 < kfull; k0 += WIDE_KCHUNK) {
            const int64_t k1 = k0 + WIDE_KCHUNK < kfull ? k0 + WIDE_KCHUNK : kfull;
            for (int64_t n = g0; n < g1; n++) {
                __m256i *c = acc + (n - g0) * M4;
                for (int64_t m = 0; m < m8; m += 8) part(q, x16, m, n, k0, k1, c + m, 8);
                for (int64_t m = m8; m < M; m += 4) part(q, x16, m, n, k0, k1, c + m, 4);
            }
        }
        for (int64_t n = g0; n < g1; n++) {
            const int8_t *b = q->w + n * K;
            const __m256i *c = acc + (n - g0) * M4;
            for (int64_t m = 0; m < m8; m += 8) store_rows(q, x16 + m * L, b, c + m, m, n, 8);
            for (int64_t m = m8; m < M; m += 4) store_rows(q, x16 + m * L, b, c + m, m, n, M - m < 4 ? (int)(M - m) : 4);
        }
    }
}

/* See gemm_int8_internal.h. */
AVX2_TARGET void anneal_qrows_s8_wide_avx2(const anneal_qrows_s8_args *q, const int16_t *x16, int64_t n0, int64_t n1) {
    const int64_t M = q->M, m8 = M & ~(int64_t)7;
    if (q->K > ANNEAL_QROWS_WIDE_KMAX && M <= WIDE_MMAX) {
        wide_chunked(q, x16, n0, n1);
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < m8; m += 8) rows(q, x16, m, n, 8, 8);
        for (int64_t m = m8; m < M; m += 4) rows(q, x16, m, n, 4, M - m < 4 ? (int)(M - m) : 4);
    }
}
