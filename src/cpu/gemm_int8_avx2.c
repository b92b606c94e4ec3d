/* The int8 GEMM on AVX2. vpmaddubsw (u8 x s8 into saturating int16 pair sums) can
 * saturate (255 * 127 * 2 > 32767), so this path sign-extends 16 bytes of each operand
 * to int16 (vpmovsxbw) and multiplies with vpmaddwd, whose int32 pair sums cannot
 * overflow (2 * 128 * 128 = 32768): exact. Tiles of 2 rows of A by 4 rows of B
 * (8 accumulators; a lone last row of A by itself), 16 values of K per step, the K tail
 * in scalar code. */
#include "gemm_int8_internal.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>

#define AVX2_TARGET __attribute__((target("avx2")))

/* Rows m, m + 1 (R = 2) or row m alone (R = 1: a last odd row, and every row of a
 * one-row product such as decoding, which would otherwise compute its row twice) by B
 * rows n .. n + 3 (clamped), into C. */
AVX2_TARGET static inline __attribute__((always_inline)) void tile(int64_t m, int R, int64_t n, int64_t n1, int64_t K,
                                                                   const int8_t *A, int64_t lda, const int8_t *B,
                                                                   int64_t ldb, int32_t *C, int64_t ldc) {
    const int64_t kfull = K & ~(int64_t)15;
    const int8_t *b[4];
    for (int j = 0; j < 4; j++) b[j] = B + (n + j < n1 ? n + j : n1 - 1) * ldb;
    const int8_t *a[2] = {A + m * lda, A + (m + R - 1) * lda};
    __m256i acc[2][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < kfull; k += 16) {
        __m256i av[2];
        for (int i = 0; i < R; i++) av[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a[i] + k)));
        for (int j = 0; j < 4; j++) {
            const __m256i bv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b[j] + k)));
            for (int i = 0; i < R; i++) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(av[i], bv));
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4 && n + j < n1; j++) {
            int32_t s = anneal_hsum8_s32(acc[i][j]);
            for (int64_t k = kfull; k < K; k++) s += (int32_t)a[i][k] * (int32_t)b[j][k];
            C[(m + i) * ldc + n + j] = s;
        }
}

/* See gemm_int8_internal.h. Tiles of 2 rows of A (a last odd row alone) by 4 of B. */
AVX2_TARGET void anneal_gemm_s8_block_avx2(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K,
                                           const int8_t *A, int64_t lda, const int8_t *B, int64_t ldb, int32_t *C,
                                           int64_t ldc) {
    for (int64_t n = n0; n < n1; n += 4) {
        int64_t m = m0;
        for (; m + 2 <= m1; m += 2) tile(m, 2, n, n1, K, A, lda, B, ldb, C, ldc);
        if (m < m1) tile(m, 1, n, n1, K, A, lda, B, ldb, C, ldc);
    }
}

/* ------------------------------------------------ few rows, fused epilogue */

/* Bytes ahead of the weight row being read that the few-rows kernel prefetches: the
 * weight is walked in address order (one row after the next), so this is the linear
 * stream a few rows ahead, which the hardware prefetchers alone start too late for. */
enum { QROWS_PREFETCH = 1024 };

/* The 32 products xq[k..k+32) * w[k..k+32) of one row of xq pair-summed into acc (int32
 * lanes), with ub = |w| as u8 and bv = w (the sign trick, see anneal_qrows_s8_avx2). */
AVX2_TARGET static inline __attribute__((always_inline)) __m256i qdot32(__m256i acc, __m256i ub, __m256i bv,
                                                                        const int8_t *a) {
    const __m256i p = _mm256_maddubs_epi16(ub, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a), bv));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* R (1 to 4, a constant) rows m .. m + R - 1 of xq by weight row n, into y with the
 * epilogue; PF: prefetch the weight stream QROWS_PREFETCH bytes ahead (the first pass
 * over the row). 32 values of K a step, the tail in scalar code. */
AVX2_TARGET static inline __attribute__((always_inline)) void qrows_row(const anneal_qrows_s8_args *q, int64_t m,
                                                                        const int R, int64_t n, bool pf) {
    const int64_t K = q->K, kfull = K & ~(int64_t)31;
    const int8_t *b = q->w + n * K;
    const int8_t *a[4];
    for (int i = 0; i < R; i++) a[i] = q->xq + (m + i) * K;
    __m256i acc[4];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_si256();
    int64_t k = 0;
    if (pf)
        for (; k + 64 <= kfull; k += 64) {
            _mm_prefetch((const char *)(b + k + QROWS_PREFETCH), _MM_HINT_T0);
            for (int h = 0; h < 64; h += 32) {
                const __m256i bv = _mm256_loadu_si256((const __m256i *)(b + k + h));
                const __m256i ub = _mm256_sign_epi8(bv, bv); /* |w| as u8 (-128 -> 128) */
                for (int i = 0; i < R; i++) acc[i] = qdot32(acc[i], ub, bv, a[i] + k + h);
            }
        }
    for (; k < kfull; k += 32) {
        const __m256i bv = _mm256_loadu_si256((const __m256i *)(b + k));
        const __m256i ub = _mm256_sign_epi8(bv, bv);
        for (int i = 0; i < R; i++) acc[i] = qdot32(acc[i], ub, bv, a[i] + k);
    }
    const float ws = q->wscale[n], bias = q->bias ? q->bias[n] : 0.0f;
    for (int i = 0; i < R; i++) {
        int32_t s = anneal_hsum8_s32(acc[i]);
        for (int64_t kk = kfull; kk < K; kk++) s += (int32_t)a[i][kk] * (int32_t)b[kk];
        q->y[(m + i) * q->N + n] = (float)s * (q->sx[m + i] * ws) + bias;
    }
}

/* See gemm_int8_internal.h. One weight row at a time, in address order (the weight is
 * streamed once, linearly, prefetched ahead), against every row of xq in groups of 4
 * (the row stays in L1 for the later groups). */
AVX2_TARGET void anneal_qrows_s8_avx2(const anneal_qrows_s8_args *q, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        int64_t m = 0;
        for (; m + 4 <= q->M; m += 4) qrows_row(q, m, 4, n, m == 0);
        switch (q->M - m) {
        case 3: qrows_row(q, m, 3, n, m == 0); break;
        case 2: qrows_row(q, m, 2, n, m == 0); break;
        case 1: qrows_row(q, m, 1, n, m == 0); break;
        default: break;
        }
    }
}

/* ------------------------------------------------ many rows, fused epilogue */

/* Rows m .. m + R - 1 of xq by weight rows n .. n + C - 1 (R 1 to 3, C 1 or 2, constants)
 * into y with the epilogue: the sign trick of qrows_row, 32 values of K a step (R * C
 * int32 accumulators, the weight vectors and their magnitudes in registers), the tail in
 * scalar code. */
AVX2_TARGET static inline __attribute__((always_inline)) void qgemm_tile(const anneal_qrows_s8_args *q, int64_t m,
                                                                         const int R, int64_t n, const int C) {
    const int64_t K = q->K, kfull = K & ~(int64_t)31;
    const int8_t *a[3], *b[2];
    for (int i = 0; i < R; i++) a[i] = q->xq + (m + i) * K;
    for (int j = 0; j < C; j++) b[j] = q->w + (n + j) * K;
    __m256i acc[3][2];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) acc[i][j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < kfull; k += 32) {
        __m256i bv[2], ub[2];
        for (int j = 0; j < C; j++) {
            bv[j] = _mm256_loadu_si256((const __m256i *)(b[j] + k));
            ub[j] = _mm256_sign_epi8(bv[j], bv[j]);
        }
        for (int i = 0; i < R; i++) {
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a[i] + k));
            for (int j = 0; j < C; j++) {
                const __m256i p = _mm256_maddubs_epi16(ub[j], _mm256_sign_epi8(av, bv[j]));
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            int32_t s = anneal_hsum8_s32(acc[i][j]);
            for (int64_t kk = kfull; kk < K; kk++) s += (int32_t)a[i][kk] * (int32_t)b[j][kk];
            const int64_t mm = m + i, nn = n + j;
            q->y[mm * q->N + nn] = (float)s * (q->sx[mm] * q->wscale[nn]) + (q->bias ? q->bias[nn] : 0.0f);
        }
}

/* Rows [m, m + R) (R 1 to 3, a constant) by weight rows [n0, n1), two at a time. */
AVX2_TARGET static inline __attribute__((always_inline)) void qgemm_rows(const anneal_qrows_s8_args *q, int64_t m,
                                                                         const int R, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) qgemm_tile(q, m, R, n, 2);
    if (n < n1) qgemm_tile(q, m, R, n, 1);
}

/* See gemm_int8_internal.h. Weight rows in blocks of about 128 KiB (kept in L2), and for
 * each block every 3 rows of xq [m0, m1) (kept in L1) against the block's rows two at a
 * time (3 x 2 tiles: 4 x 2 ones spill accumulators on AVX2's 16 registers). */
AVX2_TARGET void anneal_qgemm_s8_avx2(const anneal_qrows_s8_args *q, int64_t m0, int64_t m1) {
    int64_t nb = (int64_t)(128 * 1024) / (q->K > 0 ? q->K : 1);
    nb = nb < 2 ? 2 : nb & ~(int64_t)1;
    for (int64_t n0 = 0; n0 < q->N; n0 += nb) {
        const int64_t n1 = n0 + nb < q->N ? n0 + nb : q->N;
        int64_t m = m0;
        for (; m + 3 <= m1; m += 3) qgemm_rows(q, m, 3, n0, n1);
        switch (m1 - m) {
        case 2: qgemm_rows(q, m, 2, n0, n1); break;
        case 1: qgemm_rows(q, m, 1, n0, n1); break;
        default: break;
        }
    }
}

/* See gemm_int8_internal.h. */
AVX2_TARGET void anneal_quantize_row_s8_avx2(int64_t K, const float *x, float fixed, int8_t *q, float *scale) {
    float s = fixed;
    if (!(fixed > 0.0f)) { /* dynamic: max(amax / 127, FLT_EPSILON), NaNs skipped as fmaxf does */
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 mx = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), absmask), mx);
        float t[8], amax = 0.0f;
        _mm256_storeu_ps(t, mx);
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, t[i]);
        for (; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
        s = fmaxf(amax / 127.0f, FLT_EPSILON);
        *scale = s;
    }
    /* nearbyint(x / s) clamped to [-127, 127]: IEEE division and the current rounding
     * mode, as the scalar quantizer */
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i v[4];
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k + 8 * i), vs), _MM_FROUND_CUR_DIRECTION);
            v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permutevar8x32_epi32(b, order));
    }
    for (; k < K; k++) {
        float r = nearbyintf(x[k] / s);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[k] = (int8_t)r;
    }
}
