/* The per-device kernel table. Ops never call a kernel directly: they look up the
 * backend of their inputs' device and call through this table, so a CUDA backend
 * plugs in by filling the same table. Kernels do no autograd and no file I/O.
 * Unless a slot says otherwise, tensor arguments are contiguous, f32, on the
 * backend's device, and already shape-checked by the op. */
#ifndef ANNEAL_BACKEND_H
#define ANNEAL_BACKEND_H

#include "anneal/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum anneal_binary_op { ANNEAL_ADD, ANNEAL_SUB, ANNEAL_MUL, ANNEAL_DIV } anneal_binary_op;

typedef enum anneal_unary_op {
    ANNEAL_UNARY_SCALE,     /* alpha * x */
    ANNEAL_UNARY_ADD_SCALAR,/* x + alpha */
    ANNEAL_UNARY_GELU_TANH,
    ANNEAL_UNARY_GELU_ERF,
    ANNEAL_UNARY_SILU,
} anneal_unary_op;

/* Rotary position embedding (RoPE) as Hugging Face's Llama applies it: the rotated
 * dims are split in halves (rotate_half), dim i < D/2 pairs with i + D/2; the angle of
 * position p and pair i is p * inv_freq[i], inv_freq[i] = theta^(-2i/D) in f32,
 * adjusted by the scaling: LINEAR divides positions by factor; LLAMA3 rescales inv_freq
 * by wavelength (low_freq_factor, high_freq_factor, original_max_pos, factor) as
 * transformers' _compute_llama3_parameters. cos and sin are computed in f32 as
 * transformers does. */
typedef enum anneal_rope_scaling {
    ANNEAL_ROPE_SCALING_NONE = 0,
    ANNEAL_ROPE_SCALING_LINEAR,
    ANNEAL_ROPE_SCALING_LLAMA3,
} anneal_rope_scaling;

typedef struct anneal_rope_desc {
    float theta;                 /* base, e.g. 10000 or 500000; > 0 */
    anneal_rope_scaling scaling;
    float factor;                /* LINEAR, LLAMA3 */
    float low_freq_factor, high_freq_factor; /* LLAMA3 */
    int64_t original_max_pos;    /* LLAMA3 */
} anneal_rope_desc;

/* One parameter of a multi-tensor AdamW step: contiguous f32 arrays of numel
 * elements on the backend's device, with that parameter's weight decay and bias
 * corrections bc = 1 - beta^t (t its own step count). */
typedef struct anneal_adamw_group {
    float *p;
    const float *g;
    float *m, *v;
    int64_t numel;
    double weight_decay, bc1, bc2;
} anneal_adamw_group;

typedef struct anneal_backend {
    const char *name;
    anneal_device device;

    /* Memory: 64-byte aligned; NULL on failure. */
    void *(*alloc)(size_t nbytes);
    void (*free)(void *p);
    /* Copies between host memory and this device (either direction). */
    anneal_status (*to_host)(void *dst, const void *src, size_t nbytes);
    anneal_status (*from_host)(void *dst, const void *src, size_t nbytes);

    /* dst = src elementwise, any strides and any dtypes (converting); same shape. */
    anneal_status (*copy)(anneal_tensor *dst, const anneal_tensor *src);
    /* Every element of dst (any strides, any dtype) = value. */
    anneal_status (*fill)(anneal_tensor *dst, double value);
    /* out = a op b; out contiguous; a and b have out's shape with any strides
     * (stride 0 where broadcast). out may alias a (in-place accumulate). */
    anneal_status (*binary)(anneal_binary_op op, anneal_tensor *out, const anneal_tensor *a,
                            const anneal_tensor *b);
    /* out = f(x; alpha), contiguous; for SCALE and ADD_SCALAR out may be x (in place). */
    anneal_status (*unary)(anneal_unary_op op, anneal_tensor *out, const anneal_tensor *x,
                           float alpha);
    /* dx = dy * f'(x; alpha), contiguous. */
    anneal_status (*unary_bwd)(anneal_unary_op op, anneal_tensor *dx, const anneal_tensor *x,
                               const anneal_tensor *dy, float alpha);
    /* out (contiguous, same ndim as x with size 1 in reduced dims) = sum of x over the
     * dims where out has size 1 and x does not. x any strides. Deterministic. */
    anneal_status (*reduce_sum)(anneal_tensor *out, const anneal_tensor *x);

    /* c = alpha * a @ b + beta * c over the last two dims; leading (batch) dims of a
     * and b are broadcast to c's (stride 0 allowed). a and b: any strides as long as
     * one of the last two dims has stride 1; c contiguous. `compute` is the precision
     * the operands are rounded to (F32, BF16 or F16; see anneal_set_matmul_dtype). */
    anneal_status (*matmul)(anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b,
                            float alpha, float beta, anneal_dtype compute);

    /* Normalisation over the last dim. x (N, C) flattened; mean/rstd (N). */
    anneal_status (*layer_norm_fwd)(anneal_tensor *y, anneal_tensor *mean, anneal_tensor *rstd,
                                    const anneal_tensor *x, const anneal_tensor *w,
                                    const anneal_tensor *b, float eps);
    /* dx, dw, db may each be NULL (not wanted). */
    anneal_status (*layer_norm_bwd)(anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                    const anneal_tensor *x, const anneal_tensor *w,
                                    const anneal_tensor *mean, const anneal_tensor *rstd,
                                    const anneal_tensor *dy);
    anneal_status (*rms_norm_fwd)(anneal_tensor *y, anneal_tensor *rstd, const anneal_tensor *x,
                                  const anneal_tensor *w, float eps);
    anneal_status (*rms_norm_bwd)(anneal_tensor *dx, anneal_tensor *dw, const anneal_tensor *x,
                                  const anneal_tensor *w, const anneal_tensor *rstd,
                                  const anneal_tensor *dy);
    /* Softmax / log-softmax over the last dim. */
    anneal_status (*softmax_fwd)(anneal_tensor *y, const anneal_tensor *x, bool log);
    anneal_status (*softmax_bwd)(anneal_tensor *dx, const anneal_tensor *y,
                                 const anneal_tensor *dy, bool log);

    /* Attention on (B, H, T, D) tensors whose last dim has stride 1 (other strides
     * free, so views into a fused qkv buffer work). lse (B, H, Tq) contiguous.
     * compute: ANNEAL_BF16 rounds the operands of every tile product to bf16 (f32
     * accumulation; softmax statistics, lse and the normalisation in f32); ANNEAL_F32
     * and ANNEAL_F16 run f32 attention (the same bits). */
    anneal_status (*attention_fwd)(anneal_tensor *o, anneal_tensor *lse, const anneal_tensor *q,
                                   const anneal_tensor *k, const anneal_tensor *v, bool causal,
                                   float scale, anneal_dtype compute);
    /* dq, dk, dv: same shape and strides as q, k, v; overwritten. compute: the
     * forward's. */
    anneal_status (*attention_bwd)(anneal_tensor *dq, anneal_tensor *dk, anneal_tensor *dv,
                                   const anneal_tensor *q, const anneal_tensor *k,
                                   const anneal_tensor *v, const anneal_tensor *o,
                                   const anneal_tensor *dout, const anneal_tensor *lse,
                                   bool causal, float scale, anneal_dtype compute);

    /* y (N, C) = w[ids]; ids i32 (N), validated by the op. */
    anneal_status (*embedding_fwd)(anneal_tensor *y, const anneal_tensor *ids,
                                   const anneal_tensor *w);
    /* dw (V, C) overwritten with the scatter-add of dy rows. */
    anneal_status (*embedding_bwd)(anneal_tensor *dw, const anneal_tensor *ids,
                                   const anneal_tensor *dy);
    /* Per-row loss (N) and logsumexp (N) of logits (N, V) against i32 targets (N). */
    anneal_status (*cross_entropy_fwd)(anneal_tensor *loss, anneal_tensor *lse,
                                       const anneal_tensor *logits, const anneal_tensor *targets,
                                       int32_t ignore_index);
    anneal_status (*cross_entropy_bwd)(anneal_tensor *dlogits, const anneal_tensor *logits,
                                       const anneal_tensor *targets, const anneal_tensor *lse,
                                       int32_t ignore_index, float scale);
    /* y = x * mask / (1 - p) with mask ~ Bernoulli(1 - p) from Philox(seed, offset + i/4);
     * mask (u8) written for backward. */
    anneal_status (*dropout_fwd)(anneal_tensor *y, anneal_tensor *mask, const anneal_tensor *x,
                                 float p, uint64_t seed, uint64_t offset);
    /* dx = dy * mask / (1 - p). */
    anneal_status (*dropout_bwd)(anneal_tensor *dx, const anneal_tensor *mask,
                                 const anneal_tensor *dy, float p);
    /* Fills x with normal(mean, std) from Philox(seed, offset + i/4) (Box-Muller). */
    anneal_status (*randn)(anneal_tensor *x, float mean, float std, uint64_t seed, uint64_t offset);

    /* One AdamW step on p (f32) with grad g and moments m, v (same numel). Scalars in
     * double: the kernel forms its constants from them as PyTorch does. */
    anneal_status (*adamw)(anneal_tensor *p, const anneal_tensor *g, anneal_tensor *m,
                           anneal_tensor *v, double lr, double beta1, double beta2, double eps,
                           double weight_decay, double bc1, double bc2);
    /* One AdamW step over n parameters in one pass: the total elements are split
     * evenly across the threads (one parallel region, not one per parameter); each
     * element is updated exactly as adamw would (bit-identical). May be NULL. */
    anneal_status (*adamw_multi)(const anneal_adamw_group *groups, int n, double lr,
                                 double beta1, double beta2, double eps);
    /* Sum of squares of all elements, accumulated in double (deterministic). */
    anneal_status (*sum_squares)(const anneal_tensor *x, double *out);

    /* Fused kernels (issue 5). x (R, K), w (K, N) row-major, b (N) or NULL:
     * pre (R, N) = x @ w + b and y = gelu_tanh(pre) in one pass over the output (GEMM
     * epilogue); operands rounded to `compute` as for matmul. */
    anneal_status (*dense_gelu_fwd)(anneal_tensor *y, anneal_tensor *pre, const anneal_tensor *x,
                                    const anneal_tensor *w, const anneal_tensor *b,
                                    anneal_dtype compute);
    /* c (M, N) = a (M, K) @ b (K, N) + bias (N, added to every row in the GEMM's epilogue
     * instead of a broadcast pass before it); a, b 2-D with a unit stride in either dim,
     * c contiguous, operands rounded to `compute` as for matmul. Optional (NULL: the ops
     * broadcast the bias and call matmul with beta = 1). */
    anneal_status (*matmul_bias)(anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b,
                                 const anneal_tensor *bias, anneal_dtype compute);
    /* c = a @ b as matmul_bias without the bias, and bsum (N) = the column sums of b (f32
     * additions over k in order), taken while the GEMM packs b: a dense layer's weight
     * gradient x^T @ dy and bias gradient (column sums of dy) in one pass over dy.
     * Optional (NULL: the ops sum separately). */
    anneal_status (*matmul_bsum)(anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b,
                                 anneal_tensor *bsum, anneal_dtype compute);
    /* s = x + r and y = LayerNorm(s) (mean/rstd (N) written) in one pass; all (N, C). */
    anneal_status (*add_layer_norm_fwd)(anneal_tensor *s, anneal_tensor *y, anneal_tensor *mean,
                                        anneal_tensor *rstd, const anneal_tensor *x,
                                        const anneal_tensor *r, const anneal_tensor *w,
                                        const anneal_tensor *b, float eps);
    /* dx = LayerNorm backward of dy at s, plus ds (the gradient of s's other uses; may
     * be NULL); dx, dw, db may each be NULL (not wanted). */
    anneal_status (*add_layer_norm_bwd)(anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                        const anneal_tensor *s, const anneal_tensor *w,
                                        const anneal_tensor *mean, const anneal_tensor *rstd,
                                        const anneal_tensor *dy, const anneal_tensor *ds);
    /* Cross-entropy of logits = h (N, C) @ w (V, C)^T against i32 targets (N) (validated
     * by the op), in chunks of work->shape[0] rows through the workspace work (rows, V):
     * loss (N) per row (0 where ignored), lse (N). When dh (N, C) / dw (V, C) are given,
     * each chunk's dlogits = scale * (softmax - onehot) (0 on ignored rows) is used at
     * once: dh rows = dlogits @ w, dw += dlogits^T @ h (dw overwritten, chunks in order).
     * GEMMs at `compute`. */
    anneal_status (*linear_cross_entropy)(anneal_tensor *loss, anneal_tensor *lse,
                                          anneal_tensor *dh, anneal_tensor *dw, anneal_tensor *work,
                                          const anneal_tensor *h, const anneal_tensor *w,
                                          const anneal_tensor *targets, int32_t ignore_index,
                                          float scale, anneal_dtype compute);
} anneal_backend;

/* The backend for device d, or NULL with ANNEAL_ERR_DEVICE set when none is built. */
const anneal_backend *anneal_backend_get(anneal_device d);
/* Installs the table for its device (used by backends at init). */
void anneal_backend_register(const anneal_backend *b);

#ifdef __cplusplus
}
#endif
#endif
