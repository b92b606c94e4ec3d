/* The few-rows quantized product (decode and serving steps: see anneal_qrows_s8_args in
 * gemm_int8_internal.h) on AVX-512 VNNI. VPDPBUSD multiplies u8 by s8, so the activations
 * come offset to u8 (xu = xq + 128, which the caller makes once per call) and each weight
 * row's sum (taken in the same pass: VPDPBUSD of ones by w) times 128 is subtracted:
 * sum xq w = sum (xq + 128) w - 128 sum w. VPDPBUSD adds its four products into int32
 * without saturating, and the lanes and the correction are summed with wraparound, so the
 * result is the exact int32 sum whenever that fits in int32, as the reference's: the same
 * bits as the GEMM then the epilogue. Per 64 weight bytes: one load, one VPDPBUSD for the
 * row sum and one per row of x (the AVX2 kernel spends five instructions per 32 bytes and
 * row). One weight row at a time in address order, prefetched ahead, against up to 4 rows
 * of x; the tail of K by masked loads (zeros add nothing to either sum). */
#include "cpu/gemm_int8_internal.h"

#include <immintrin.h>
#include <stdbool.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

enum { PREFETCH_BYTES = 1024 }; /* the weight stream read ahead (as the AVX2 kernel) */

/* R (1 to 4, a constant) rows m .. m + R - 1 of x by weight row n, into y with the
 * epilogue; pf: prefetch the weight stream (the first pass over the row). */
VNNI_TARGET static inline __attribute__((always_inline)) void qrow(const anneal_qrows_s8_args *q, const uint8_t *xu,
                                                                   int64_t m, const int R, int64_t n, bool pf) {
    const int64_t K = q->K, kfull = K & ~(int64_t)63;
    const int8_t *b = q->w + n * K;
    const uint8_t *a[4];
    for (int i = 0; i < R; i++) a[i] = xu + (m + i) * K;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc[4], wsum = _mm512_setzero_si512();
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k < kfull; k += 64) {
        if (pf) _mm_prefetch((const char *)(b + k + PREFETCH_BYTES), _MM_HINT_T0);
        const __m512i bv = _mm512_loadu_si512((const void *)(b + k));
        wsum = _mm512_dpbusd_epi32(wsum, ones, bv);
        for (int i = 0; i < R; i++)
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512((const void *)(a[i] + k)), bv);
    }
    if (k < K) {
        const __mmask64 mk = _cvtu64_mask64(~0ULL >> (64 - (K - k)));
        const __m512i bv = _mm512_maskz_loadu_epi8(mk, b + k);
        wsum = _mm512_dpbusd_epi32(wsum, ones, bv);
        for (int i = 0; i < R; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_maskz_loadu_epi8(mk, a[i] + k), bv);
    }
    const uint32_t corr = 128u * (uint32_t)_mm512_reduce_add_epi32(wsum);
    const float ws = q->wscale[n], bias = q->bias ? q->bias[n] : 0.0f;
    for (int i = 0; i < R; i++) {
        const int32_t s = (int32_t)((uint32_t)_mm512_reduce_add_epi32(acc[i]) - corr);
        q->y[(m + i) * q->N + n] = (float)s * (q->sx[m + i] * ws) + bias;
    }
}

/* The four lane-wise sums of v[0..3] (lane i of the result: the sum of v[i]'s 16 lanes,
 * wrapping): unpacks and adds instead of four reductions. */
VNNI_TARGET static inline __m128i sum4_epi32(const __m512i v[4]) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
    /* per 128-bit lane: v0, v1, v2, v3's partial sums */
    const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    const __m256i d = _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
}

/* One row of x (decoding) by weight rows n .. n + 3: four independent VPDPBUSD chains for
 * the products and four for the row sums (one row at a time is one chain of each, bound by
 * VPDPBUSD's latency), the correction taken lane-wise (acc - 128 wsum: the same wrapping
 * sum) and the four rows' lanes summed together (sum4_epi32). The next group's rows are
 * prefetched (the four rows are one contiguous stream of 4 K bytes). */
VNNI_TARGET static inline void qrow1x4(const anneal_qrows_s8_args *q, const uint8_t *xu, int64_t n) {
    const int64_t K = q->K, kfull = K & ~(int64_t)63;
    const int8_t *b = q->w + n * K;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc[4], wsum[4];
    for (int i = 0; i < 4; i++) acc[i] = wsum[i] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k < kfull; k += 64) {
        const __m512i xv = _mm512_loadu_si512((const void *)(xu + k));
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char *)(b + (4 + i) * K + k), _MM_HINT_T0);
            const __m512i bv = _mm512_loadu_si512((const void *)(b + i * K + k));
            wsum[i] = _mm512_dpbusd_epi32(wsum[i], ones, bv);
            acc[i] = _mm512_dpbusd_epi32(acc[i], xv, bv);
        }
    }
    if (k < K) {
        const __mmask64 mk = _cvtu64_mask64(~0ULL >> (64 - (K - k)));
        const __m512i xv = _mm512_maskz_loadu_epi8(mk, xu + k);
        for (int i = 0; i < 4; i++) {
            const __m512i bv = _mm512_maskz_loadu_epi8(mk, b + i * K + k);
            wsum[i] = _mm512_dpbusd_epi32(wsum[i], ones, bv);
            acc[i] = _mm512_dpbusd_epi32(acc[i], xv, bv);
        }
    }
    for (int i = 0; i < 4; i++) acc[i] = _mm512_sub_epi32(acc[i], _mm512_slli_epi32(wsum[i], 7));
    int32_t s[4];
    _mm_storeu_si128((__m128i *)s, sum4_epi32(acc));
    for (int i = 0; i < 4; i++)
        q->y[n + i] = (float)s[i] * (q->sx[0] * q->wscale[n + i]) + (q->bias ? q->bias[n + i] : 0.0f);
}

/* See gemm_int8_internal.h: weight rows [n0, n1), every row of x in groups of 4 (the
 * weight row stays in L1 for the later groups); one row of x four weight rows at a time. */
VNNI_TARGET void anneal_qrows_s8_avx512vnni(const anneal_qrows_s8_args *q, const uint8_t *xu, int64_t n0,
                                            int64_t n1) {
    if (q->M == 1)
        for (; n0 + 4 <= n1; n0 += 4) qrow1x4(q, xu, n0);
    for (int64_t n = n0; n < n1; n++) {
        int64_t m = 0;
        for (; m + 4 <= q->M; m += 4) qrow(q, xu, m, 4, n, m == 0);
        switch (q->M - m) {
        case 3: qrow(q, xu, m, 3, n, m == 0); break;
        case 2: qrow(q, xu, m, 2, n, m == 0); break;
        case 1: qrow(q, xu, m, 1, n, m == 0); break;
        default: break;
        }
    }
}
