/* Operand rounding and the fused epilogue of the CPU GEMM (see gemm_internal.h).
 * The GEMM driver (gemm.c) calls the epilogue on each tile of C right after the tile's last
 * depth block, while it is in L1; the rounding helpers serve the single-row path (which
 * streams B unpacked) and are the scalar reference of the vector packers. */
#include "cpu/gemm_internal.h"
#include "cpu/vec_math.h"

#include "anneal/core.h"

#define GELU_SQRT_2_OVER_PI 0.7978845608028654f /* sqrt(2/pi), as in pointwise.c */
#define GELU_KAPPA 0.044715f

/* Nearest-even f16 of x as f32: gcc's _Float16 conversion (F16C or libgcc), IEEE
 * round-to-nearest-even with overflow to inf and f16 subnormals kept. clang 14 (the
 * fuzz build) has no _Float16 on x86 without AVX512-FP16: there core's conversion
 * pair, which rounds the same way. */
#if defined(__clang__) && __clang_major__ < 15
float anneal_gemm_round_f16(float x) { return anneal_f16_to_f32(anneal_f32_to_f16(x)); }
#else
float anneal_gemm_round_f16(float x) { return (float)(_Float16)x; }
#endif

/* dst[i] = bf16(src[i]) for n floats: integer arithmetic the compiler vectorises (one
 * clone per ISA, same bits everywhere). */
ANNEAL_VEC_CLONES
static void round_bf16_block(int64_t n, const float *src, float *dst) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, 4);
        u = anneal_gemm_round_bf16_bits(u);
        memcpy(dst + i, &u, 4);
    }
}

/* dst[i] = round(src[i]) (see gemm_internal.h). f16 uses F16C when the CPU has it. */
void anneal_gemm_round_array(int64_t n, const float *src, float *dst, int round) {
    if (round == ANNEAL_GEMM_ROUND_BF16) {
        round_bf16_block(n, src, dst);
    } else if (round == ANNEAL_GEMM_ROUND_F16) {
        if (anneal_cpu_has_avx2()) {
            anneal_gemm_round_f16_avx2(n, src, dst);
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] = anneal_gemm_round_f16(src[i]);
        }
    } else if (dst != src) {
        memmove(dst, src, (size_t)n * sizeof(float));
    }
}

/* tanh-GELU in the sigmoid form of pointwise.c: x / (1 + e^(-2u)), u = sqrt(2/pi) *
 * (x + 0.044715 x^3), the same operations in the same order, so the same bits. */
ANNEAL_INLINE float gelu_tanh(float x) {
    float u = GELU_SQRT_2_OVER_PI * (x + GELU_KAPPA * (x * x * x));
    return x / anneal_v1p_expf(-2.0f * u);
}

/* One row of the epilogue: c[j] += bias[j] (bias may be NULL); with gelu, pre[j] = c[j]
 * (pre may be NULL) and c[j] = gelu_tanh(c[j]). One pass per case (no add of a zero bias:
 * -0 stays -0, as without the epilogue). */
ANNEAL_INLINE void epilogue_row(int64_t n, float *restrict c, const float *restrict bias,
                                float *restrict pre, bool gelu) {
    if (!gelu) {
        if (bias)
            for (int64_t j = 0; j < n; j++) c[j] = c[j] + bias[j];
    } else if (bias && pre) {
        for (int64_t j = 0; j < n; j++) {
            float x = c[j] + bias[j];
            pre[j] = x;
            c[j] = gelu_tanh(x);
        }
    } else if (bias) {
        for (int64_t j = 0; j < n; j++) c[j] = gelu_tanh(c[j] + bias[j]);
    } else if (pre) {
        for (int64_t j = 0; j < n; j++) {
            float x = c[j];
            pre[j] = x;
            c[j] = gelu_tanh(x);
        }
    } else {
        for (int64_t j = 0; j < n; j++) c[j] = gelu_tanh(c[j]);
    }
}

/* epilogue_row over m rows ldc apart (pre's rows too). One call per tile, and rows of the
 * AVX-512 kernel's full width (32) get a loop of constant length that the compiler turns
 * into two vectors with no remainder code: per-row calls of a general loop cost the
 * tanh-GELU up-projection a third of its GEMM's speed. Same operations, so the same bits. */
ANNEAL_VEC_CLONES
static void epilogue_rows(int64_t m, int64_t n, float *restrict c, int64_t ldc, const float *restrict bias,
                          float *restrict pre, bool gelu) {
    for (int64_t i = 0; i < m; i++) {
        float *ci = c + i * ldc, *pi = pre ? pre + i * ldc : NULL;
        if (n == 32) epilogue_row(32, ci, bias, pi, gelu);
        else epilogue_row(n, ci, bias, pi, gelu);
    }
}

/* silu(x) * m: x / (1 + e^(-x)) as anneal_cpu_silu_fwd computes it (pointwise.c: the same
 * operations, so the same bits), then the product. */
ANNEAL_INLINE float silu_times(float x, float m) { return x / anneal_v1p_expf(-x) * m; }

/* One row of the SiLU-times-multiplier epilogue: c[j] += bias[j] (bias may be NULL),
 * pre[j] = c[j] (pre may be NULL), c[j] = silu(c[j]) * mul[j]. */
ANNEAL_VEC_CLONES
static void epilogue_silu_mul_row(int64_t n, float *restrict c, const float *restrict bias,
                                  float *restrict pre, const float *restrict mul) {
    if (bias)
        for (int64_t j = 0; j < n; j++) c[j] = c[j] + bias[j];
    if (pre)
        for (int64_t j = 0; j < n; j++) pre[j] = c[j];
    for (int64_t j = 0; j < n; j++) c[j] = silu_times(c[j], mul[j]);
}

/* The epilogue over an m x n tile (see gemm_internal.h). */
void anneal_gemm_epilogue_tile(const anneal_gemm_epilogue *ep, int64_t m, int64_t n, float *c,
                               int64_t ldc, const float *bias, float *pre, const float *mul) {
    if (mul) {
        for (int64_t i = 0; i < m; i++)
            epilogue_silu_mul_row(n, c + i * ldc, bias, pre ? pre + i * ldc : NULL, mul + i * ldc);
        return;
    }
    epilogue_rows(m, n, c, ldc, bias, pre, ep->gelu_tanh);
}
