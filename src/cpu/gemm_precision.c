/* GEMM at a chosen operand precision with a fused epilogue (anneal_cpu_gemm).
 * FIRST VERSION (to be replaced by packed bf16/f16 kernels): rounds copies of the
 * operands to the compute dtype, runs the f32 GEMM, then applies the epilogue. */
#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Round-to-nearest-even of x to bf16, returned as the f32 it stands for. */
static float round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    else if (u & 0x007fffffu) u |= 0x00400000u; /* quiet NaN */
    memcpy(&x, &u, 4);
    return x;
}

static float round_f16(float x) { return (float)(_Float16)x; }

/* Copy of the rows x cols matrix at p (row stride ld) rounded to compute. */
static float *rounded(int compute, const float *p, int64_t rows, int64_t cols, int64_t ld) {
    float *q = malloc((size_t)(rows * cols) * sizeof *q + 1);
    if (!q) return NULL;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            float v = p[i * ld + j];
            q[i * cols + j] = compute == ANNEAL_BF16 ? round_bf16(v) : round_f16(v);
        }
    return q;
}

static float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

static void epilogue(int64_t M, int64_t N, float *C, int64_t ldc, const anneal_gemm_epilogue *ep) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float v = C[i * ldc + j] + (ep->bias ? ep->bias[j] : 0.0f);
            if (ep->gelu_tanh) {
                if (ep->pre) ep->pre[i * ldc + j] = v;
                v = gelu_tanh(v);
            }
            C[i * ldc + j] = v;
        }
}

void anneal_cpu_gemm(int compute, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                     float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                     float beta, float *C, int64_t ldc, const anneal_gemm_epilogue *ep) {
    if (M <= 0 || N <= 0) return;
    if (compute == ANNEAL_F32 || K <= 0) {
        anneal_cpu_sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else {
        int64_t ar = trans_a ? K : M, ac = trans_a ? M : K, br = trans_b ? N : K, bc = trans_b ? K : N;
        float *a = rounded(compute, A, ar, ac, lda), *b = rounded(compute, B, br, bc, ldb);
        if (a && b) anneal_cpu_sgemm(trans_a, trans_b, M, N, K, alpha, a, ac, b, bc, beta, C, ldc);
        free(a);
        free(b);
    }
    if (ep && (ep->bias || ep->gelu_tanh)) epilogue(M, N, C, ldc, ep);
}

void anneal_cpu_gemm_batched(int compute, int64_t batch, bool trans_a, bool trans_b, int64_t M,
                             int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                             int64_t stride_a, const float *B, int64_t ldb, int64_t stride_b,
                             float beta, float *C, int64_t ldc, int64_t stride_c) {
    if (compute == ANNEAL_F32) {
        anneal_cpu_sgemm_batched(batch, trans_a, trans_b, M, N, K, alpha, A, lda, stride_a, B, ldb,
                                 stride_b, beta, C, ldc, stride_c);
        return;
    }
    for (int64_t i = 0; i < batch; i++)
        anneal_cpu_gemm(compute, trans_a, trans_b, M, N, K, alpha, A + i * stride_a, lda,
                        B + i * stride_b, ldb, beta, C + i * stride_c, ldc, NULL);
}
