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

/* See gemm_int8_internal.h: weight rows [n0, n1), every row of x in groups of 4 (the
 * weight row stays in L1 for the later groups). */
VNNI_TARGET void anneal_qrows_s8_avx512vnni(const anneal_qrows_s8_args *q, const uint8_t *xu, int64_t n0,
                                            int64_t n1) {
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
