/* AVX512-BF16 GEMM micro-kernel and packing: bf16 operands, f32 accumulation, an 8 x 32
 * tile of C in 16 zmm accumulators.
 *
 * What the kernel computes. VDPBF16PS takes, per f32 lane, a pair of bf16 values from each
 * operand and does  acc = (acc + a[2q+1] * b[2q+1]) + a[2q] * b[2q]:  the products of two
 * bf16 values are exact in f32, and each is added with its own round-to-nearest-even, the
 * odd depth of the pair first (Intel's definition; checked on this machine's AMD EPYC (Zen 5):
 * acc 2^30 + (-2^30 at depth 2q) + (1 at depth 2q+1) gives 0, i.e. 2^30 + 1 was rounded
 * first). Unlike MXCSR-governed arithmetic it always treats subnormal inputs (bf16
 * operands and the f32 accumulator) as zero (DAZ) and flushes subnormal results to zero
 * (FTZ). So each C element is
 *   alpha * (sum of bf16(a_ik) * bf16(b_kj) over k in the order 1, 0, 3, 2, 5, 4, ... within
 *            each depth block, f32 accumulation, values below 2^-126 counted as zero)
 *   + beta * C  (one fused multiply-add; later depth blocks add alpha * their sum to C),
 * where bf16() rounds to nearest even. That is one rounding per product added, as a plain
 * f32 FMA loop over the rounded operands, so against the exact sum of the rounded products
 * the error is within the recursive-summation bound (K + 4) * 2^-24 * (|alpha| *
 * sum_k |a_k b_k| + |beta C|), plus the flushes, which only act below 2^-126
 * (tests/cpu/test_gemm_precision.c checks this bound). The depth is blocked in blocks of at
 * most kc = 512 whose split depends on K only, so results do not depend on the thread
 * partition.
 *
 * Layout of the packed panels (32-bit words, each holding a depth pair of bf16: the lower
 * half is depth 2q, the upper 2q+1; a missing depth 2q+1 at the end of K is zero):
 *   A micro-panel: word[q * 8 + i] = (a(i, 2q), a(i, 2q + 1)) for the 8 rows i,
 *   B micro-panel: word[q * 32 + j] = (b(2q, j), b(2q + 1, j)) for the 32 columns j,
 * so per depth pair the kernel loads two zmm of B, broadcasts one word of A per row and
 * issues 16 VDPBF16PS (32 bf16 products each). Rounding to bf16 happens while packing,
 * with VCVTNE2PS2BF16: nearest even as anneal_gemm_round_bf16, except that f32 subnormal
 * inputs become zero (which the kernel's DAZ would make of them anyway).
 *
 * Compiled with a target attribute; gemm.c only calls this after checking
 * anneal_cpu_has_avx512bf16(). */
#include "cpu/gemm_avx512_tile.h"
#include "cpu/gemm_internal.h"

#include <immintrin.h>

#define BF_MR ANNEAL_A512_MR
#define BF_NR 32
#define BF_KC 512  /* depths: B micro-panel 512 x 32 bf16 = 32 KiB in L1, A 8 KiB */
#define BF_MC 384  /* A block 384 x 512 bf16 = 384 KiB in L2 */
#define BF_NC 3072 /* B block 512 x 3072 bf16 = 3 MiB per thread in L3 */
#define PACK_QB 8  /* depth pairs per block in the copy case of pack_bf16 */

#define BF_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* C[0:m, 0:n] = alpha * (ap @ bp) + beta * C for an 8 x 32 tile over kc depths (kc even;
 * see the top of the file for the layout and the arithmetic). */
BF_TARGET static void kernel_bf16_8x32(int64_t kc, const void *ap_, const void *bp_,
                                       float *restrict c, int64_t ldc, int m, int n,
                                       float alpha, float beta) {
    const int32_t *restrict ap = ap_;
    const __m512i *restrict bp = bp_;
    __m512 acc[BF_MR][2];
    anneal_a512_tile_start(acc, c, ldc, m);
    const int64_t kq = kc / 2;
#pragma GCC unroll 4
    for (int64_t q = 0; q < kq; q++) {
        const __m512bh b0 = (__m512bh)_mm512_load_si512(bp);
        const __m512bh b1 = (__m512bh)_mm512_load_si512(bp + 1);
#pragma GCC unroll 8
        for (int i = 0; i < BF_MR; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(ap[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
        ap += BF_MR;
        bp += 2;
    }

    anneal_a512_tile_store(acc, c, ldc, m, n, alpha, beta);
}

/* Packs whole micro-panels of depth-pair words (layout at the top of the file; width 8 or
 * a multiple of 16), rounding to bf16 (the `round` argument is ignored: always bf16).
 * x(l, k) = src[k*stride + l] when lanes_contig, else src[l*stride + k].
 * Copy case: for each depth pair, rows 2q and 2q+1 of the source are loaded 16 lanes at a
 * time, converted together and interleaved into words (anneal_a512_bf16_interleave), in
 * blocks of PACK_QB pairs then lane group by lane group (as pack_avx512, for the same
 * reasons); with width 8 a group of 16 lanes fills two panels.
 * Transpose case: each of 16 lanes gives 32 consecutive depths, which as bf16 are 16 words
 * in order (anneal_a512_bf16_words); a 16 x 16 word transpose turns them into 16
 * depth-pair rows of 16 lanes. */
BF_TARGET static void pack_bf16(const float *src, int64_t stride, bool lanes_contig,
                                int64_t lanes, int width, int64_t kc, int round, void *dst_) {
    int32_t *dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    const int64_t padded = npan * width; /* lanes including the zero padding */
    const int64_t kq = (kc + 1) / 2;     /* depth pairs */
    if (lanes_contig) {
        for (int64_t q0 = 0; q0 < kq; q0 += PACK_QB) {
            const int64_t q1 = q0 + PACK_QB < kq ? q0 + PACK_QB : kq;
            for (int64_t l0 = 0; l0 < padded; l0 += 16) {
                const __mmask16 mk = anneal_a512_first_lanes(lanes - l0);
                int32_t *d0 = dst + (l0 / width) * kq * width + l0 % width;
                int32_t *d1 = d0 + kq * width;
                const bool second = width == 8 && l0 + 8 < padded;
                for (int64_t q = q0; q < q1; q++) {
                    const float *s0 = src + 2 * q * stride + l0;
                    const __m512 x0 = _mm512_maskz_loadu_ps(mk, s0);
                    const __m512 x1 = 2 * q + 1 < kc ? _mm512_maskz_loadu_ps(mk, s0 + stride)
                                                     : _mm512_setzero_ps();
                    const __m512i word = anneal_a512_bf16_interleave(x0, x1);
                    if (width == 8) {
                        _mm256_storeu_si256((__m256i *)(d0 + q * 8), _mm512_castsi512_si256(word));
                        if (second)
                            _mm256_storeu_si256((__m256i *)(d1 + q * 8),
                                                _mm512_extracti64x4_epi64(word, 1));
                    } else {
                        _mm512_storeu_si512(d0 + q * width, word);
                    }
                }
            }
        }
        return;
    }
    for (int64_t l0 = 0; l0 < padded; l0 += 16) {
        const int64_t nl = lanes - l0;
        int32_t *d0 = dst + (l0 / width) * kq * width + l0 % width;
        int32_t *d1 = d0 + kq * width;
        const bool second = width == 8 && l0 + 8 < padded;
        for (int64_t k0 = 0; k0 < kc; k0 += 32) {
            const int64_t nk = kc - k0 < 32 ? kc - k0 : 32;
            const int nq = (int)((nk + 1) / 2);
            const __mmask16 ka = anneal_a512_first_lanes(nk), kb = anneal_a512_first_lanes(nk - 16);
            __m512 r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                if (i < nl) {
                    const float *s = src + (l0 + i) * stride + k0;
                    r[i] = _mm512_castsi512_ps(anneal_a512_bf16_words(_mm512_maskz_loadu_ps(ka, s),
                                                          _mm512_maskz_loadu_ps(kb, s + 16)));
                } else {
                    r[i] = _mm512_setzero_ps();
                }
            }
            anneal_a512_transpose16(r);
            const int64_t qb = k0 / 2;
            if (width == 8) {
                for (int i = 0; i < nq; i++) {
                    _mm256_storeu_ps((float *)(d0 + (qb + i) * 8), _mm512_castps512_ps256(r[i]));
                    if (second)
                        _mm256_storeu_ps((float *)(d1 + (qb + i) * 8),
                                         _mm512_extractf32x8_ps(r[i], 1));
                }
            } else {
                for (int i = 0; i < nq; i++) _mm512_storeu_ps((float *)(d0 + (qb + i) * width), r[i]);
            }
        }
    }
}

/* Blocking as the f32 AVX-512 kernel, in bytes: twice the depth per block. */
const anneal_gemm_isa anneal_gemm_isa_avx512bf16 = {
    .name = "avx512bf16",
    .mr = BF_MR,
    .nr = BF_NR,
    .kc = BF_KC,
    .mc = BF_MC,
    .nc = BF_NC,
    .esize = 2,
    .kstep = 2,
    .kernel = kernel_bf16_8x32,
    .pack = pack_bf16,
};
