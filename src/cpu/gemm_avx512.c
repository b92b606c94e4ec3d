/* AVX-512 SGEMM micro-kernel and packing: an 8 x 32 tile of C held in 16 zmm accumulators.
 *
 * Per k step the kernel loads one 32-float row of the packed B micro-panel (two zmm),
 * broadcasts the 8 values of the packed A micro-panel, and issues 16 FMAs. 16 independent
 * accumulators cover the FMA latency (4 cycles) times the two FMA pipes, and the 10 loads
 * per 16 FMAs fit the load ports. In L1 this runs at ~98% of the FMA peak on Zen 5, as do
 * 10, 12 and 14 row variants; 8 rows wins in the full GEMM because the A micro-panel
 * (8 x 256 floats, 8 KiB) and the B micro-panel (32 KiB) fit L1 (48 KiB) together, and
 * M = B*T is usually a multiple of 8 (no ragged edge tiles).
 *
 * Compiled with a target attribute so the rest of the library needs no -mavx512f;
 * gemm.c only calls these after checking anneal_cpu_has_avx512(). */
#include "cpu/gemm_avx512_tile.h"
#include "cpu/gemm_internal.h"

#include <immintrin.h>

#define A512_MR ANNEAL_A512_MR
#define A512_NR 32
#define A512_KC 256  /* B micro-panel kc x 32 = 32 KiB in L1 with the 8 KiB A micro-panel */
#define A512_MC 384  /* A block 384 x 256 floats = 384 KiB in L2 (1 MiB) */
#define A512_NC 3072 /* B block 256 x 3072 floats = 3 MiB per thread in L3 */
#define PACK_KB 16   /* source rows per block in the copy case of pack_avx512 */

#define A512_TARGET ANNEAL_A512_TARGET

/* C[0:m, 0:n] = alpha * (ap @ bp) + beta * C for an 8 x 32 tile (see gemm_internal.h).
 * Edge tiles use masked loads/stores with the same arithmetic as full tiles. */
A512_TARGET static void kernel_8x32(int64_t kc, const void *ap_, const void *bp_,
                                    float *restrict c, int64_t ldc, int m, int n, float alpha,
                                    float beta) {
    const float *restrict ap = ap_, *restrict bp = bp_;
    __m512 acc[A512_MR][2];
    anneal_a512_tile_start(acc, c, ldc, m);

#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_load_ps(bp);
        const __m512 b1 = _mm512_load_ps(bp + 16);
#pragma GCC unroll 8
        for (int i = 0; i < A512_MR; i++) {
            const __m512 a = _mm512_set1_ps(ap[i]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
        }
        ap += A512_MR;
        bp += A512_NR;
    }

    anneal_a512_tile_store(acc, c, ldc, m, n, alpha, beta);
}

/* round(v) for one ANNEAL_GEMM_ROUND_* mode, lane-wise, bit-identical to
 * anneal_gemm_round: bf16 by integer nearest-even (NaN made quiet), f16 through F16C
 * (nearest even, overflow to inf, f16 subnormals kept). */
A512_TARGET static inline __m512 round_vec(__m512 v, int round) {
    if (round == ANNEAL_GEMM_ROUND_BF16) {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
        return _mm512_castsi512_ps(_mm512_and_si512(r, hi));
    }
    if (round == ANNEAL_GEMM_ROUND_F16)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

/* Copies n (0..16) floats from s to d, rounded, zero-filling d up to w (8 or 16) floats. */
A512_TARGET static inline void copy_lanes(float *d, const float *s, int64_t n, int w, int round) {
    __m512 v;
    if (n >= w)
        v = w == 16 ? _mm512_loadu_ps(s) : _mm512_castps256_ps512(_mm256_loadu_ps(s));
    else
        v = _mm512_maskz_loadu_ps(anneal_a512_first_lanes(n), s);
    v = round_vec(v, round);
    if (w == 16)
        _mm512_storeu_ps(d, v);
    else
        _mm256_storeu_ps(d, _mm512_castps512_ps256(v));
}

/* Packs whole micro-panels (see anneal_gemm_pack in gemm_internal.h) of width 8 or a
 * multiple of 16 (the widths of this file's kernel).
 * Copy case (lanes contiguous in the source): blocks of PACK_KB source rows, then panel by
 * panel. The rows are read from memory once (later panels find them in L1) and each
 * panel gets a contiguous burst of stores. (Walking all panels per single k stores to npan
 * streams kc*width floats apart, the same L1 sets, and thrashes; walking one panel over all
 * k reads only a few lines per row and starves the prefetchers. Either is ~4x slower.)
 * Values are rounded (round_vec) between load and store.
 * Transpose case: 16 lanes x 16 depths are loaded (one row per lane), transposed in
 * registers and stored as 16 depth rows; with width 8 the 16 lanes feed two panels. */
A512_TARGET static void pack_avx512(const float *src, int64_t stride, bool lanes_contig,
                                    int64_t lanes, int width, int64_t kc, int round,
                                    void *dst_) {
    float *dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    const int w = width < 16 ? width : 16; /* floats per vector store */
    if (lanes_contig && width == 8) {
        /* Groups of 16 lanes fill two panels: one full-width load per row for both. */
        const int64_t padded = npan * 8;
        for (int64_t k0 = 0; k0 < kc; k0 += PACK_KB) {
            const int64_t k1 = k0 + PACK_KB < kc ? k0 + PACK_KB : kc;
            for (int64_t l0 = 0; l0 < padded; l0 += 16) {
                const int64_t nl = lanes - l0;
                float *d0 = dst + (l0 / 8) * kc * 8, *d1 = d0 + kc * 8;
                const bool second = l0 + 8 < padded;
                for (int64_t k = k0; k < k1; k++) {
                    const float *s = src + k * stride + l0;
                    __m512 v = nl >= 16 ? _mm512_loadu_ps(s)
                                        : _mm512_maskz_loadu_ps(anneal_a512_first_lanes(nl), s);
                    v = round_vec(v, round);
                    _mm256_storeu_ps(d0 + k * 8, _mm512_castps512_ps256(v));
                    if (second) _mm256_storeu_ps(d1 + k * 8, _mm512_extractf32x8_ps(v, 1));
                }
            }
        }
        return;
    }
    if (lanes_contig) {
        for (int64_t k0 = 0; k0 < kc; k0 += PACK_KB) {
            const int64_t k1 = k0 + PACK_KB < kc ? k0 + PACK_KB : kc;
            for (int64_t p = 0; p < npan; p++) {
                const int64_t l0 = p * width;
                for (int64_t k = k0; k < k1; k++) {
                    const float *s = src + k * stride + l0;
                    float *d = dst + p * kc * width + k * width;
                    for (int j = 0; j < width; j += w)
                        copy_lanes(d + j, s + j, lanes - l0 - j, w, round);
                }
            }
        }
        return;
    }
    const int64_t padded = npan * width; /* lanes including the zero padding */
    for (int64_t l0 = 0; l0 < padded; l0 += 16) {
        const int64_t nl = lanes - l0; /* source lanes present in this group (may be <= 0) */
        /* Destination of lane l0 (and, with width 8, of lane l0 + 8 in the next panel). */
        float *d0 = dst + (l0 / width) * kc * width + l0 % width;
        float *d1 = d0 + kc * width;
        const bool second = width == 8 && l0 + 8 < padded;
        for (int64_t k0 = 0; k0 < kc; k0 += 16) {
            const int nk = kc - k0 < 16 ? (int)(kc - k0) : 16;
            const __mmask16 kmask = anneal_a512_first_lanes(nk);
            __m512 r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                r[i] = i < nl ? round_vec(_mm512_maskz_loadu_ps(kmask, src + (l0 + i) * stride + k0),
                                          round)
                              : _mm512_setzero_ps();
            anneal_a512_transpose16(r);
            if (width == 8) {
                for (int i = 0; i < nk; i++) {
                    _mm256_storeu_ps(d0 + (k0 + i) * 8, _mm512_castps512_ps256(r[i]));
                    if (second) _mm256_storeu_ps(d1 + (k0 + i) * 8, _mm512_extractf32x8_ps(r[i], 1));
                }
            } else {
                for (int i = 0; i < nk; i++) _mm512_storeu_ps(d0 + (k0 + i) * width, r[i]);
            }
        }
    }
}

/* Blocking for a core with 48 KiB L1d, 1 MiB L2 and a shared L3 (Zen 4/5; Skylake-X and
 * later Intel have 48 KiB / 1-2 MiB too): see the A512_* constants above. */
const anneal_gemm_isa anneal_gemm_isa_avx512 = {
    .name = "avx512",
    .mr = A512_MR,
    .nr = A512_NR,
    .kc = A512_KC,
    .mc = A512_MC,
    .nc = A512_NC,
    .esize = 4,
    .kstep = 1,
    .kernel = kernel_8x32,
    .pack = pack_avx512,
};
