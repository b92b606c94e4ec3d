/* The int8 GEMM's kernels by ISA (gemm_int8.c dispatches between them). Each computes
 * C[m, n] = sum_k A[m, k] * B[n, k] for rows [m0, m1) of A and [n0, n1) of B, exactly
 * in int32 (A: M x K int8, row stride lda; B: N x K int8, row stride ldb, a weight in
 * torch.nn.Linear's (out, in) layout; C: int32, row stride ldc). Only call one when the
 * matching CPU feature is present. */
#ifndef ANNEAL_CPU_GEMM_INT8_INTERNAL_H
#define ANNEAL_CPU_GEMM_INT8_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* The sum of the 8 int32 lanes of v (wrapping): the AVX2 int8 kernels' dot totals. */
__attribute__((target("avx2"))) static inline int32_t anneal_hsum8_s32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

typedef void (*anneal_gemm_s8_block_fn)(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A,
                                        int64_t lda, const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc);

/* Plain C, one int32 dot product per element (gemm_int8_portable.c): the reference. */
void anneal_gemm_s8_block_portable(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A,
                                   int64_t lda, const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc);
/* AVX-512 VNNI (vpdpbusd, u8 x s8): A is offset by +128 to u8 in registers, and 128 times
 * the row sums of B (taken in the same pass) are subtracted: exact. */
void anneal_gemm_s8_block_avx512vnni(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A,
                                     int64_t lda, const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc);
/* AMX-INT8 (gemm_amx_s8.c): rows [m0, m1) a multiple of 32 (whole tiles), at most 32
 * outputs [n0, n1); the same int32 sums. Only where anneal_cpu_amx_usable(). The model:
 * the same body over the C model of the tiles, on any CPU (tests). */
void anneal_gemm_s8_block_amx(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A, int64_t lda,
                              const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc);
void anneal_gemm_s8_block_amx_model(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A,
                                    int64_t lda, const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc);
/* AVX2: both operands sign-extended to int16 and multiplied pairwise into int32
 * (vpmaddwd): no saturation anywhere (vpmaddubsw's int16 pair sums would saturate). */
void anneal_gemm_s8_block_avx2(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A,
                               int64_t lda, const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc);

/* The few-rows quantized product with its epilogue fused (decode: one pass over the
 * weight, no int32 workspace): y[m, n] = (float)(sum_k xq[m, k] w[n, k]) * (sx[m] *
 * wscale[n]) + bias[n], for every m < M and n in [n0, n1). */
typedef struct anneal_qrows_s8_args {
    int64_t M, N, K;
    const int8_t *xq;     /* M x K, every value in [-127, 127] (the quantizer's range) */
    const float *sx;      /* M */
    const int8_t *w;      /* N x K, any int8 */
    const float *wscale;  /* N */
    const float *bias;    /* N or NULL */
    float *y;             /* M x N */
} anneal_qrows_s8_args;
/* AVX2: vpmaddubsw on |w| (u8) and xq with w's sign (vpsignb), then vpmaddwd by ones:
 * the int16 pair sums are at most 2 * 128 * 127 = 32512 in magnitude because xq never
 * holds -128, so nothing saturates and the int32 sums are exact (the same bits as the
 * GEMM then the epilogue). One weight row at a time in address order (prefetched ahead;
 * interleaving several rows' short streams ran at half the bandwidth on Zen 3) against
 * up to 4 rows of xq, 32 values of K a step. */
void anneal_qrows_s8_avx2(const anneal_qrows_s8_args *q, int64_t n0, int64_t n1);
/* The same product and bits on AVX-512 VNNI (qrows_avx512vnni.c), weight rows [n0, n1):
 * xu is xq + 128 as u8 (M x K, xq ^ 0x80), each weight row's sum taken in the same pass.
 * Only where anneal_cpu_has_avx512vnni(). */
void anneal_qrows_s8_avx512vnni(const anneal_qrows_s8_args *q, const uint8_t *xu, int64_t n0, int64_t n1);
/* The same product and bits for any M (qrows_wide_avx2.c; the driver uses it from 2 rows): x16 = xq widened to int16,
 * M rows then zero rows up to a multiple of 4; 8, then 4 rows per widened weight row (the last M % 4 of
 * M > 4 rows through anneal_qrows_s8_avx2),
 * with vpmaddwd. AVX2. */
void anneal_qrows_s8_wide_avx2(const anneal_qrows_s8_args *q, const int16_t *x16, int64_t n0, int64_t n1);

/* The same product and bits for any M over weights packed in panels of 16 rows
 * (qpanels_avx2.c: the layout there): anneal_qpanels_s8_len(N, K) bytes, packed from
 * w (N x K) by anneal_qpanels_s8_pack; x16 = xq widened to int16 with rows Kp = K
 * rounded up to even long (a zero past K when K is odd); panels [p0, p1) give outputs
 * [16 p0, min(16 p1, N)). 6 rows x 16 outputs a tile, vpmaddwd on pairs of k. AVX2. */
int64_t anneal_qpanels_s8_len(int64_t N, int64_t K);
void anneal_qpanels_s8_pack(const int8_t *w, int64_t N, int64_t K, int8_t *dst);
void anneal_qpanels_s8_avx2(const anneal_qrows_s8_args *q, const int8_t *panels, const int16_t *x16, int64_t p0,
                            int64_t p1);

/* The same product and bits for any M on AVX-512 VNNI over weights packed in panels of
 * 16 rows for VPDPBUSD (qpanels_avx512vnni.c: the layout there, with each row's
 * correction): anneal_qpanels_vnni_len(N, K) bytes (a multiple of 64 per panel), packed
 * from w (N x K) by anneal_qpanels_vnni_pack; xu = xq + 128 as u8 with rows Kq =
 * anneal_qpanels_vnni_kq(K) (K rounded up to a multiple of 4) long, any bytes past K
 * (they meet zero weights); rows [m0, m1) by panels [p0, p1), outputs [16 p0, min(16 p1,
 * N)). 8 rows x 48 outputs a tile (best from a 64-byte aligned start). Only where
 * anneal_cpu_has_avx512vnni(). */
int64_t anneal_qpanels_vnni_kq(int64_t K);
int64_t anneal_qpanels_vnni_len(int64_t N, int64_t K);
void anneal_qpanels_vnni_pack(const int8_t *w, int64_t N, int64_t K, int8_t *dst);
void anneal_qpanels_s8_avx512vnni(const anneal_qrows_s8_args *q, const int8_t *panels, const uint8_t *xu,
                                  int64_t m0, int64_t m1, int64_t p0, int64_t p1);

/* The same product for many rows (prompt processing), rows [m0, m1) of xq by every
 * weight row: the same sign trick and int32 sums (exact, so the same bits as the GEMM
 * then the epilogue), tiles of 3 rows of xq by 2 rows of w, the weight in L2-sized blocks.
 * The caller splits the rows between threads. AVX2. */
void anneal_qgemm_s8_avx2(const anneal_qrows_s8_args *q, int64_t m0, int64_t m1);

/* One row of K activations to int8 as anneal_cpu_quantize_s8 (fixed <= 0: dynamic,
 * *scale = max(amax / 127, FLT_EPSILON)) or anneal_cpu_quantize_s8_fixed (fixed > 0:
 * that scale, *scale untouched), with the same bits: IEEE x / scale, rounded in the
 * current mode (nearbyint), clamped to [-127, 127]. AVX2. */
void anneal_quantize_row_s8_avx2(int64_t K, const float *x, float fixed, int8_t *q, float *scale);

/* True with AVX-512 F/BW/VL and VNNI (cpu_features.c). */
bool anneal_cpu_has_avx512vnni(void);

#endif
