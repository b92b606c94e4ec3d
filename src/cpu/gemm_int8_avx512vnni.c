/* The int8 GEMM on AVX-512 VNNI. vpdpbusd multiplies unsigned bytes by signed bytes and
 * adds groups of four products into int32 lanes. The activations are signed, so each
 * byte of A is flipped to a + 128 (an XOR of the sign bit) and the result corrected:
 * sum_k (a + 128) b = sum_k a b + 128 sum_k b. The row sums of B come from vpdpbusd
 * with a vector of ones in the same pass over B. int32 lanes wrap (vpdpbusd does not
 * saturate), so the corrected sum is exact whenever the true result fits in int32
 * (K <= 65536, checked by the dispatch). Tiles of 4 rows of A (the last rows one at a
 * time) by 4 rows of B: 16 accumulators plus 4 for the sums, 64 bytes of K per step, the K tail by masked
 * loads (zeros); rows past the edge are clamped to the last one and not stored. */
#include "gemm_int8_internal.h"

#include <immintrin.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* The sum of the 16 int32 lanes (wrapping). */
VNNI_TARGET static inline int32_t hsum(__m512i v) { return _mm512_reduce_add_epi32(v); }

/* Rows [m0, m1) of A against [n0, n1) of B in tiles of MR x 4 (MR a constant: the
 * compiler keeps the accumulators in registers). */
VNNI_TARGET static inline __attribute__((always_inline)) void
block_mr(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A, int64_t lda, const int8_t *B,
         int64_t ldb, int32_t *C, int64_t ldc, const int MR) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    const int64_t kfull = K & ~(int64_t)63;
    const __mmask64 tail = K - kfull ? (~(__mmask64)0 >> (64 - (K - kfull))) : 0;
    for (int64_t n = n0; n < n1; n += 4) {
        const int8_t *b[4];
        for (int j = 0; j < 4; j++) b[j] = B + (n + j < n1 ? n + j : n1 - 1) * ldb;
        for (int64_t m = m0; m < m1; m += MR) {
            const int8_t *a[4];
            for (int i = 0; i < MR; i++) a[i] = A + (m + i < m1 ? m + i : m1 - 1) * lda;
            __m512i acc[4][4], bs[4];
            for (int j = 0; j < 4; j++) {
                bs[j] = _mm512_setzero_si512();
                for (int i = 0; i < MR; i++) acc[i][j] = _mm512_setzero_si512();
            }
            for (int64_t k = 0; k <= K; k += 64) {
                __m512i bv[4], av[4];
                if (k < kfull) {
                    for (int j = 0; j < 4; j++) bv[j] = _mm512_loadu_si512((const void *)(b[j] + k));
                    for (int i = 0; i < MR; i++)
                        av[i] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(a[i] + k)), flip);
                } else if (tail) {
                    for (int j = 0; j < 4; j++) bv[j] = _mm512_maskz_loadu_epi8(tail, b[j] + k);
                    for (int i = 0; i < MR; i++)
                        av[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail, a[i] + k), flip);
                } else {
                    break;
                }
                for (int j = 0; j < 4; j++) {
                    bs[j] = _mm512_dpbusd_epi32(bs[j], ones, bv[j]);
                    for (int i = 0; i < MR; i++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], av[i], bv[j]);
                }
                if (k >= kfull) break;
            }
            for (int j = 0; j < 4 && n + j < n1; j++) {
                const int32_t corr = (int32_t)((uint32_t)hsum(bs[j]) * 128u);
                for (int i = 0; i < MR && m + i < m1; i++)
                    C[(m + i) * ldc + n + j] = (int32_t)((uint32_t)hsum(acc[i][j]) - (uint32_t)corr);
            }
        }
    }
}

/* See gemm_int8_internal.h: 4-row tiles, then the rows left one at a time. */
VNNI_TARGET void anneal_gemm_s8_block_avx512vnni(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K,
                                                 const int8_t *A, int64_t lda, const int8_t *B, int64_t ldb,
                                                 int32_t *C, int64_t ldc) {
    const int64_t m4 = m0 + (m1 - m0) / 4 * 4;
    if (m4 > m0) block_mr(m0, m4, n0, n1, K, A, lda, B, ldb, C, ldc, 4);
    if (m1 > m4) block_mr(m4, m1, n0, n1, K, A, lda, B, ldb, C, ldc, 1); /* decode: one row, no wasted tiles */
}
