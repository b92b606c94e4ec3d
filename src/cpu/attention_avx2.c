/* The f32 attention tile kernels on AVX2 + FMA (attention.c's anneal_attn_isa: the
 * small GEMMs of a tile, the exponentials of a row with their sum, a row's maximum),
 * for x86 CPUs without AVX-512. The same arithmetic as the AVX-512 path, 8 lanes wide:
 * each C element is one FMA chain over k in order, the exponential is the same Cephes
 * polynomial (2^n applied as two exact power-of-two factors, since AVX2 has no scalef),
 * a row's sum adds 8 lanes then folds them in a fixed order. Tails of N use masked
 * loads and stores only at the tail (AMD microcodes vmaskmov). */
#include "cpu/attention_internal.h"

#include <math.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2_FN __attribute__((target("avx2,fma")))
#define AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) static inline

/* Lanes j < n all ones, the others zero (n clamped to 0..8). */
AVX2_INLINE __m256i tail_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n < 0 ? 0 : n > 8 ? 8 : n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Register tile of MR rows x 8*NV columns of C over the whole K; `full`: all 8*NV
 * columns exist (else m0/m1 mask the two vectors). MR, NV are constants at every call
 * site: 12 accumulators at most, plus two B vectors and a broadcast. */
AVX2_INLINE void micro_avx2(const int MR, const int NV, const bool full, int K, const float *A, int64_t a_rs,
                            int64_t a_cs, const float *B, int64_t ldb, float *C, int64_t ldc, __m256i m0, __m256i m1,
                            bool accumulate) {
    __m256 c[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        c[r][0] = _mm256_setzero_ps();
        c[r][1] = _mm256_setzero_ps();
    }
    for (int k = 0; k < K; k++) {
        const float *b = B + (int64_t)k * ldb;
        const float *a = A + (int64_t)k * a_cs;
        const __m256 b0 = full ? _mm256_loadu_ps(b) : _mm256_maskload_ps(b, m0);
        const __m256 b1 = NV > 1 ? (full ? _mm256_loadu_ps(b + 8) : _mm256_maskload_ps(b + 8, m1)) : _mm256_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const __m256 av = _mm256_broadcast_ss(a + r * a_rs);
            c[r][0] = _mm256_fmadd_ps(av, b0, c[r][0]);
            if (NV > 1) c[r][1] = _mm256_fmadd_ps(av, b1, c[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        float *cr = C + (int64_t)r * ldc;
        if (full) {
            if (accumulate) c[r][0] = _mm256_add_ps(c[r][0], _mm256_loadu_ps(cr));
            _mm256_storeu_ps(cr, c[r][0]);
            if (NV > 1) {
                if (accumulate) c[r][1] = _mm256_add_ps(c[r][1], _mm256_loadu_ps(cr + 8));
                _mm256_storeu_ps(cr + 8, c[r][1]);
            }
        } else {
            if (accumulate) c[r][0] = _mm256_add_ps(c[r][0], _mm256_maskload_ps(cr, m0));
            _mm256_maskstore_ps(cr, m0, c[r][0]);
            if (NV > 1) {
                if (accumulate) c[r][1] = _mm256_add_ps(c[r][1], _mm256_maskload_ps(cr + 8, m1));
                _mm256_maskstore_ps(cr + 8, m1, c[r][1]);
            }
        }
    }
}

/* C (=, +=) A B: panels of 16 columns, register tiles of 6 rows (fewer at the tails). */
AVX2_FN static void gemm_avx2(int M, int N, int K, const float *A, int64_t a_rs, int64_t a_cs, const float *B,
                              int64_t ldb, float *C, int64_t ldc, bool accumulate) {
    for (int j0 = 0; j0 < N; j0 += 16) {
        const int nc = N - j0 < 16 ? N - j0 : 16;
        const __m256i m0 = tail_mask(nc), m1 = tail_mask(nc - 8);
        const int nv = nc > 8 ? 2 : 1;
        const bool full = nc == 8 * nv;
        for (int i0 = 0; i0 < M; i0 += 6) {
            const int mr = M - i0 < 6 ? M - i0 : 6;
            const float *a = A + (int64_t)i0 * a_rs;
            const float *b = B + j0;
            float *c = C + (int64_t)i0 * ldc + j0;
#define ATTN_MICRO(R, V, F) micro_avx2(R, V, F, K, a, a_rs, a_cs, b, ldb, c, ldc, m0, m1, accumulate)
#define ATTN_CASE(R)                                                                                                   \
    case R:                                                                                                            \
        if (nv == 2) {                                                                                                 \
            if (full) ATTN_MICRO(R, 2, true);                                                                          \
            else ATTN_MICRO(R, 2, false);                                                                              \
        } else {                                                                                                       \
            if (full) ATTN_MICRO(R, 1, true);                                                                          \
            else ATTN_MICRO(R, 1, false);                                                                              \
        }                                                                                                              \
        break
            switch (mr) {
                ATTN_CASE(1);
                ATTN_CASE(2);
                ATTN_CASE(3);
                ATTN_CASE(4);
                ATTN_CASE(5);
                ATTN_CASE(6);
            }
#undef ATTN_CASE
#undef ATTN_MICRO
        }
    }
}

/* 2^n for integral n in [-126, 127] held as floats: the exponent field built directly. */
AVX2_INLINE __m256 pow2i(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

/* exp(x) for 8 lanes, the AVX-512 path's method: x clamped to [-104, 88.72], x = n ln2 +
 * r, Cephes degree-6 polynomial, then times 2^n as 2^(n - h) 2^h with h = trunc(n / 2)
 * (both factors normal, so the product rounds once: subnormal results as scalef gives).
 * NaN stays NaN (the constants are max/min's first operands), -inf gives 0. */
AVX2_INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.7228394f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256 h = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2i(_mm256_sub_ps(n, h))), pow2i(h));
}

/* The 8 lanes of v added in a fixed order. */
AVX2_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_FN static float exp_row_avx2(float *x, int n, float a, float b) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    __m256 sum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp256(_mm256_fmsub_ps(va, _mm256_loadu_ps(x + j), vb));
        _mm256_storeu_ps(x + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {
        const __m256i m = tail_mask(n - j);
        const __m256 e = _mm256_and_ps(exp256(_mm256_fmsub_ps(va, _mm256_maskload_ps(x + j, m), vb)),
                                       _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(x + j, m, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum(sum);
}

AVX2_FN static float row_max_avx2(const float *x, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + j), m); /* a NaN of x loses to m */
    if (j < n) {
        const __m256i k = tail_mask(n - j);
        const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + j, k), _mm256_castsi256_ps(k));
        m = _mm256_max_ps(v, m);
    }
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

const anneal_attn_isa anneal_attn_isa_avx2 = {gemm_avx2, exp_row_avx2, row_max_avx2};
#endif
