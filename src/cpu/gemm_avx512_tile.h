/* Pieces shared by the AVX-512 GEMM files (gemm_avx512.c: f32 FMA; gemm_avx512bf16.c:
 * VDPBF16PS; gemm_amx.c's packers): the 8 x 32 accumulator tile's start and store, the
 * lane masks, the 16 x 16 in-register transpose their packing uses, and the bf16 pair
 * words of the bf16 packers (AVX512-BF16 callers only). Each is always inlined into its
 * caller, whose target attribute (a superset of ANNEAL_A512_TARGET) it takes on, so the
 * tile stays in registers. Include only from files compiled for AVX-512 this way. */
#ifndef ANNEAL_CPU_GEMM_AVX512_TILE_H
#define ANNEAL_CPU_GEMM_AVX512_TILE_H

#include <immintrin.h>
#include <stdint.h>

#define ANNEAL_A512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define ANNEAL_A512_INLINE ANNEAL_A512_TARGET __attribute__((always_inline)) static inline

enum { ANNEAL_A512_MR = 8 }; /* rows of the tile; its 32 columns are two zmm */

/* Lane mask of the first n (clamped to 0..16) lanes. */
ANNEAL_A512_INLINE __mmask16 anneal_a512_first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n < 0 ? 0 : n)) - 1u);
}

/* Zeroes the accumulators and starts pulling the tile's m rows of C (touched once, at the
 * end) into L1. */
ANNEAL_A512_INLINE void anneal_a512_tile_start(__m512 acc[ANNEAL_A512_MR][2], const float *c,
                                               int64_t ldc, int m) {
#pragma GCC unroll 8
    for (int i = 0; i < ANNEAL_A512_MR; i++) {
        acc[i][0] = _mm512_setzero_ps();
        acc[i][1] = _mm512_setzero_ps();
        if (i < m) {
            _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);
            _mm_prefetch((const char *)(c + i * ldc + 16), _MM_HINT_T0);
        }
    }
}

/* C[0:m, 0:n] = alpha * acc + beta * C (one FMA; C not read when beta == 0), with masked
 * loads and stores, so edge tiles get the same arithmetic as full ones. Fully unrolled
 * with constant indices so acc stays in registers. */
ANNEAL_A512_INLINE void anneal_a512_tile_store(__m512 acc[ANNEAL_A512_MR][2], float *c,
                                               int64_t ldc, int m, int n, float alpha,
                                               float beta) {
    const __mmask16 m0 = anneal_a512_first_lanes(n), m1 = anneal_a512_first_lanes(n - 16);
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 8
    for (int i = 0; i < ANNEAL_A512_MR; i++) {
        if (i < m) {
            float *row = c + i * ldc;
            __m512 r0 = _mm512_mul_ps(va, acc[i][0]);
            __m512 r1 = _mm512_mul_ps(va, acc[i][1]);
            if (beta != 0.0f) {
                r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, row), r0);
                r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, row + 16), r1);
            }
            _mm512_mask_storeu_ps(row, m0, r0);
            _mm512_mask_storeu_ps(row + 16, m1, r1);
        }
    }
}

/* In-register transpose of a 16 x 16 block of 32-bit words: r[i] holds row i on entry,
 * column i on exit. Three rounds: 32-bit interleave, 64-bit interleave, then two rounds
 * of 128-bit lane shuffles. */
ANNEAL_A512_INLINE void anneal_a512_transpose16(__m512 r[16]) {
    __m512 t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* r[i] now holds, in each 128-bit lane q, the 4-row column group of rows 4*(i/4)..+3. */
#pragma GCC unroll 2
    for (int h = 0; h < 16; h += 8) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* The bf16 values of 32 floats (lo: the first 16, hi: the next 16) as 16 words holding
 * consecutive pairs: VCVTNE2PS2BF16 rounds to nearest even (NaN made quiet) and treats
 * f32 subnormal inputs as zero, as the bf16 kernels do with bf16 subnormals. */
#define ANNEAL_A512BF16_INLINE                                                                                    \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"), always_inline)) static inline
ANNEAL_A512BF16_INLINE __m512i anneal_a512_bf16_words(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* The words (x0[l], x1[l]) for 16 lanes: the bf16 of x0 in the lower halves. */
ANNEAL_A512BF16_INLINE __m512i anneal_a512_bf16_interleave(__m512 x0, __m512 x1) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, anneal_a512_bf16_words(x0, x1));
}

#endif
