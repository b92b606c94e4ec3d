/* AVX2 + FMA GEMM micro-kernel and packing for CPUs without AVX-512: a 6 x 16 tile of C in
 * 12 ymm accumulators, plus the F16C rounding helper.
 *
 * Per k step the kernel loads one 16-float row of the packed B micro-panel (two ymm),
 * broadcasts the 6 values of the packed A micro-panel and issues 12 FMAs: 12 independent
 * accumulators cover the FMA latency (4-5 cycles) on two FMA pipes, and 15 of the 16 ymm
 * registers are in use. bf16 and f16 products use this kernel over operands rounded while
 * packing (round_vec8), so their numerics are exactly those of the f32 kernel on rounded
 * copies.
 *
 * Compiled with a target attribute; gemm.c only calls these after checking
 * anneal_cpu_has_avx2() (AVX2, FMA and F16C). */
#include "cpu/gemm_internal.h"

#include <immintrin.h>

#define AVX2_MR 6
#define AVX2_NR 16
#define AVX2_KC 256  /* B micro-panel 256 x 16 floats = 16 KiB, A micro-panel 6 KiB in L1 */
#define AVX2_MC 168  /* A block 168 x 256 floats = 168 KiB in L2 (a multiple of 6 rows) */
#define AVX2_NC 3072 /* B block 256 x 3072 floats = 3 MiB per thread in L3 */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* C[0:m, 0:n] = alpha * (ap @ bp) + beta * C for a 6 x 16 tile (see gemm_internal.h).
 * Edge tiles go through a stack tile with the same arithmetic as full ones. */
AVX2_TARGET static void kernel_6x16(int64_t kc, const void *ap_, const void *bp_,
                                    float *restrict c, int64_t ldc, int m, int n, float alpha,
                                    float beta) {
    const float *restrict ap = ap_, *restrict bp = bp_;
    __m256 acc[AVX2_MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < AVX2_MR; i++) {
        acc[i][0] = _mm256_setzero_ps();
        acc[i][1] = _mm256_setzero_ps();
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_load_ps(bp);
        const __m256 b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 6
        for (int i = 0; i < AVX2_MR; i++) {
            const __m256 a = _mm256_broadcast_ss(ap + i);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
        ap += AVX2_MR;
        bp += AVX2_NR;
    }
    const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
    const bool full = n == AVX2_NR;
    float tile[AVX2_NR] = {0};
#pragma GCC unroll 6
    for (int i = 0; i < AVX2_MR; i++) {
        if (i >= m) continue;
        float *row = c + i * ldc;
        float *dst = full ? row : tile;
        if (!full && beta != 0.0f)
            for (int j = 0; j < n; j++) tile[j] = row[j];
        __m256 r0 = _mm256_mul_ps(va, acc[i][0]);
        __m256 r1 = _mm256_mul_ps(va, acc[i][1]);
        if (beta != 0.0f) {
            r0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(dst), r0);
            r1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(dst + 8), r1);
        }
        _mm256_storeu_ps(dst, r0);
        _mm256_storeu_ps(dst + 8, r1);
        if (!full)
            for (int j = 0; j < n; j++) row[j] = tile[j];
    }
}

/* round(v) lane-wise for one ANNEAL_GEMM_ROUND_* mode, bit-identical to anneal_gemm_round. */
AVX2_TARGET static inline __m256 round_vec8(__m256 v, int round) {
    if (round == ANNEAL_GEMM_ROUND_BF16) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
        const __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                               _mm256_set1_epi32(0x7f800000));
        const __m256i s = _mm256_blendv_epi8(r, q, nan);
        return _mm256_castsi256_ps(_mm256_and_si256(s, _mm256_set1_epi32((int)0xffff0000u)));
    }
    if (round == ANNEAL_GEMM_ROUND_F16)
        return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

/* Mask of the first n (0..8) lanes for maskload/maskstore. */
AVX2_TARGET static inline __m256i first8(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)), idx);
}

/* Packs whole micro-panels with rounding (see anneal_gemm_pack); width 6 or 16.
 * Copy case: blocks of 16 source rows, then panel by panel (as pack_avx512); each row of a
 * panel is read 8 lanes at a time (masked at the edges) and stored contiguously.
 * Transpose case: each source lane is read 8 depths at a time, rounded, and its values
 * scattered to their depth rows (one stream per lane). */
AVX2_TARGET static void pack_avx2(const float *src, int64_t stride, bool lanes_contig,
                                  int64_t lanes, int width, int64_t kc, int round,
                                  void *dst_) {
    float *restrict dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    if (lanes_contig) {
        for (int64_t k0 = 0; k0 < kc; k0 += 16) {
            const int64_t k1 = k0 + 16 < kc ? k0 + 16 : kc;
            for (int64_t p = 0; p < npan; p++) {
                const int64_t l0 = p * width;
                for (int64_t k = k0; k < k1; k++) {
                    const float *s = src + k * stride + l0;
                    float *d = dst + p * kc * width + k * width;
                    for (int j = 0; j < width; j += 8) {
                        const int64_t nl = lanes - l0 - j;
                        const int wj = width - j < 8 ? width - j : 8;
                        /* plain loads and stores where whole: AMD cores microcode
                         * vmaskmovps stores (tens of cycles each), which made packing
                         * cost half of the kernel's time on Zen 3 */
                        const __m256 v = round_vec8(nl >= wj && wj == 8 ? _mm256_loadu_ps(s + j)
                                                                        : _mm256_maskload_ps(s + j, first8(nl < wj ? nl : wj)),
                                                    round);
                        if (wj == 8) {
                            _mm256_storeu_ps(d + j, v);
                        } else if (wj == 6) { /* the A panels of the 6 x 16 kernel */
                            _mm_storeu_ps(d + j, _mm256_castps256_ps128(v));
                            _mm_storel_pi((__m64 *)(d + j + 4), _mm256_extractf128_ps(v, 1));
                        } else {
                            _mm256_maskstore_ps(d + j, first8(wj), v);
                        }
                    }
                }
            }
        }
        return;
    }
    for (int64_t p = 0; p < npan; p++) {
        float *d = dst + p * kc * width;
        for (int l = 0; l < width; l++) {
            const int64_t sl = p * width + l;
            if (sl >= lanes) {
                for (int64_t k = 0; k < kc; k++) d[k * width + l] = 0.0f;
                continue;
            }
            const float *s = src + sl * stride;
            for (int64_t k0 = 0; k0 < kc; k0 += 8) {
                const int64_t nk = kc - k0 < 8 ? kc - k0 : 8;
                float t[8];
                _mm256_storeu_ps(t, round_vec8(nk == 8 ? _mm256_loadu_ps(s + k0) : _mm256_maskload_ps(s + k0, first8(nk)),
                                               round));
                for (int64_t i = 0; i < nk; i++) d[(k0 + i) * width + l] = t[i];
            }
        }
    }
}

/* dst[i] = f16(src[i]) as f32 for n floats (see gemm_internal.h). */
AVX2_TARGET void anneal_gemm_round_f16_avx2(int64_t n, const float *src, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, round_vec8(_mm256_loadu_ps(src + i), ANNEAL_GEMM_ROUND_F16));
    if (i < n) {
        const __m256i mk = first8(n - i);
        _mm256_maskstore_ps(dst + i, mk,
                            round_vec8(_mm256_maskload_ps(src + i, mk), ANNEAL_GEMM_ROUND_F16));
    }
}

/* acc[j] += ak * f16(b[j]) for n floats (see gemm_internal.h): one pass over b, in order,
 * one rounding per product and one per sum as the plain loop. */
AVX2_TARGET void anneal_gemm_axpy_f16_avx2(int64_t n, float ak, const float *b, float *acc) {
    const __m256 va = _mm256_set1_ps(ak);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = round_vec8(_mm256_loadu_ps(b + j), ANNEAL_GEMM_ROUND_F16);
        _mm256_storeu_ps(acc + j, _mm256_add_ps(_mm256_loadu_ps(acc + j), _mm256_mul_ps(va, v)));
    }
    for (; j < n; j++) acc[j] += ak * anneal_gemm_round_f16(b[j]);
}

/* Blocking for the AVX2 kernel: see the AVX2_* constants above. */
const anneal_gemm_isa anneal_gemm_isa_avx2 = {
    .name = "avx2",
    .mr = AVX2_MR,
    .nr = AVX2_NR,
    .kc = AVX2_KC,
    .mc = AVX2_MC,
    .nc = AVX2_NC,
    .esize = 4,
    .kstep = 1,
    .kernel = kernel_6x16,
    .pack = pack_avx2,
};
