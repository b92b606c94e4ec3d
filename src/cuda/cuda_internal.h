/* What the CUDA backend's files share (src/cuda/, C and CUDA C++ alike).
 *
 * The backend is one table (cuda_backend.c) whose slots are filled by the files that
 * own them, each through its anneal_cuda_table_<part> function below. Every slot gets
 * the backend context first, queues its work on ctx->stream and returns at once;
 * results reach the host only through copy_to_host + synchronize. Kernels are
 * deterministic: no floating-point atomics, fixed launch shapes for reductions, so the
 * same inputs give the same bits on every call. */
#ifndef ANNEAL_CUDA_INTERNAL_H
#define ANNEAL_CUDA_INTERNAL_H

#include "anneal/backend.h"

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Temporary device buffers that live inside one slot call (grow-only, one per purpose
 * so that two of them can be in use at once). Stream order makes reuse safe: the
 * next slot's kernels run after this one's. */
typedef enum anneal_cuda_scratch_id {
    ANNEAL_CUDA_SCRATCH_GEMM_A = 0, /* a GEMM operand rounded to bf16/f16 */
    ANNEAL_CUDA_SCRATCH_GEMM_B,
    ANNEAL_CUDA_SCRATCH_GEMM_C,     /* an epilogue's temporary */
    ANNEAL_CUDA_SCRATCH_REDUCE,     /* partial sums of two-pass reductions */
    ANNEAL_CUDA_SCRATCH_SORT,       /* embedding backward: keys, values, cub temp */
    ANNEAL_CUDA_SCRATCH_LOSS,       /* linear cross-entropy's chunk buffers */
    ANNEAL_CUDA_SCRATCH_ATTN,       /* attention backward's row statistics */
    ANNEAL_CUDA_SCRATCH_MISC,
    ANNEAL_CUDA_SCRATCH_COUNT
} anneal_cuda_scratch_id;

/* The backend's state: one device per process (ANNEAL_CUDA), chosen before first use. */
typedef struct anneal_cuda_ctx {
    int initialized;          /* 1 after a successful anneal_cuda_ensure, -1 after a failed one */
    int ordinal;              /* the CUDA device ordinal (anneal_cuda_select) */
    cudaStream_t stream;      /* where slots queue their work now (stream_set) */
    cudaStream_t main_stream; /* the backend's own non-blocking stream (the default) */
    struct cudaDeviceProp prop;
    void *cublaslt;           /* cublasLtHandle_t (cuda_gemm.cu) */
    void *gemm_state;         /* cuda_gemm.cu's workspace and heuristics cache */
    int allow_tf32;           /* f32 GEMMs may use TF32 (off by default: parity with the CPU) */
    void *scratch[ANNEAL_CUDA_SCRATCH_COUNT];
    size_t scratch_bytes[ANNEAL_CUDA_SCRATCH_COUNT];
    void *index_state;        /* cuda_loss.cu's pending index checks (deferred errors) */
    char init_error[256];     /* why anneal_cuda_ensure failed */
} anneal_cuda_ctx;

/* The one context of the table (cuda_backend.c). */
anneal_cuda_ctx *anneal_cuda_context(void);
/* Initialises the context on first use (device, stream, cuBLASLt) and makes its device
 * current on the calling thread. ANNEAL_ERR_DEVICE with the CUDA message when there is
 * no usable GPU. Every slot that can be the first to touch the device calls it. */
anneal_status anneal_cuda_ensure(anneal_cuda_ctx *c);
/* ANNEAL_OK for cudaSuccess; otherwise records "cuda <op>: <name>: <message>" as
 * ANNEAL_ERR_OOM (cudaErrorMemoryAllocation) or ANNEAL_ERR_DEVICE, and returns it. */
anneal_status anneal_cuda_check(cudaError_t e, const char *op);
/* anneal_cuda_check of cudaGetLastError(): call after every kernel launch. */
anneal_status anneal_cuda_launch_check(const char *op);
/* A device buffer of at least nbytes for purpose id (grow-only; NULL + error on OOM). */
void *anneal_cuda_scratch(anneal_cuda_ctx *c, anneal_cuda_scratch_id id, size_t nbytes);

/* C = alpha * op(A) @ op(B) + beta * C on raw f32 device pointers, laid out by d (the
 * batch, strides, transposes and compute of anneal_matmul_desc; epilogue NONE). For the
 * backend's own composite kernels (linear cross-entropy). cuda_gemm.cu. */
anneal_status anneal_cuda_gemm_f32(anneal_cuda_ctx *c, const anneal_matmul_desc *d, float *C,
                                   const float *A, const float *B);

/* Called by synchronize after the stream is drained: the first failed index check since
 * the last call, as ANNEAL_ERR_ARG with check_index's message (cuda_loss.cu). */
anneal_status anneal_cuda_index_checks_collect(anneal_cuda_ctx *c);

/* Each part fills its slots of the table (and says which queries it supports). */
void anneal_cuda_table_elementwise(anneal_backend *b); /* cuda_elementwise.cu: copy, fill, binary, unary,
                                                          unary_bwd, scale_by, reduce_sum, sum_squares */
void anneal_cuda_table_gemm(anneal_backend *b);        /* cuda_gemm.cu: matmul */
void anneal_cuda_table_rows(anneal_backend *b);        /* cuda_rows.cu: layer_norm, add_layer_norm,
                                                          rms_norm, softmax, rope */
void anneal_cuda_table_random(anneal_backend *b);      /* cuda_random.cu: dropout, randn */
void anneal_cuda_table_attention(anneal_backend *b);   /* cuda_attention.cu: attention_fwd/bwd */
void anneal_cuda_table_loss(anneal_backend *b);        /* cuda_loss.cu: check_index, embedding,
                                                          cross_entropy, loss_mean, linear_cross_entropy */
void anneal_cuda_table_adamw(anneal_backend *b);       /* cuda_adamw.cu: adamw, adamw_multi */

/* supports_op of each part, for the kinds it owns (true: it has a kernel for q). */
bool anneal_cuda_supports_elementwise(const anneal_op_query *q);
bool anneal_cuda_supports_gemm(const anneal_op_query *q);
bool anneal_cuda_supports_rows(const anneal_op_query *q);
bool anneal_cuda_supports_random(const anneal_op_query *q);
bool anneal_cuda_supports_attention(const anneal_op_query *q);
bool anneal_cuda_supports_loss(const anneal_op_query *q);
bool anneal_cuda_supports_adamw(const anneal_op_query *q);

#ifdef __cplusplus
}
#endif
#endif
