/* A product on operands that are already 16-bit (cuda_gemm_bf16.cu), for the backend's
 * composite kernels (linear cross-entropy), which round an operand once and use it in
 * many products instead of letting every anneal_cuda_gemm_f32 call round it again. */
#ifndef ANNEAL_CUDA_GEMM_BF16_H
#define ANNEAL_CUDA_GEMM_BF16_H

#include "cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* C (M x N, row-major, row stride ldc, f32) = op(A) @ op(B) + beta * C, one product
 * (batch 1), with A and B row-major 16-bit device matrices of type ab (ANNEAL_BF16 or
 * ANNEAL_F16): A stored M x K (row stride lda), or K x M when ta; B stored K x N (ldb),
 * or N x K when tb. f32 accumulation (CUBLAS_COMPUTE_32F) through cuBLASLt on c->stream
 * with a handle of this file's own and a plan (heuristic) cached per shape, layout and
 * alignment, so a shape always runs the same algorithm (deterministic). beta == 0 never
 * reads C. ws (ws_bytes, 16-byte aligned) is the cuBLASLt workspace. When cuBLASLt has no
 * algorithm for the product *no_algo is set and nothing is queued (ANNEAL_OK); other
 * failures are ANNEAL_ERR_DEVICE / ANNEAL_ERR_OOM with the message recorded. */
anneal_status anneal_cuda_gemm16(anneal_cuda_ctx *c, anneal_dtype ab, int64_t M, int64_t N, int64_t K, bool ta,
                                 bool tb, const void *A, int64_t lda, const void *B, int64_t ldb, float *C,
                                 int64_t ldc, float beta, void *ws, size_t ws_bytes, bool *no_algo);

#ifdef __cplusplus
}
#endif
#endif
