/* anneal ops: the differentiable operations models are written with. Every op
 * returns a new tensor owned by the current scope, or NULL with an anneal_status
 * recorded (shape/dtype/device mismatch, out of memory, bad argument). An op given
 * a NULL input returns NULL without doing work or overwriting the first error, so
 * model code checks once at the end. Ops record a tape node when an input requires
 * grad and grad mode is on. Float ops compute in f32 for now. */
#ifndef ANNEAL_OPS_H
#define ANNEAL_OPS_H

#include "anneal/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --------------------------------------------------------------- creation */

/* Normal(mean, std) values from the global Philox generator (advances it). */
anneal_tensor *anneal_randn(anneal_dtype dt, int ndim, const int64_t *shape, float mean, float std);
/* Tensor of shape filled with value. */
anneal_tensor *anneal_full(anneal_dtype dt, int ndim, const int64_t *shape, double value);
/* A new tensor with t's values converted to dtype dt (differentiable between floats). */
anneal_tensor *anneal_cast(anneal_tensor *t, anneal_dtype dt);
/* Contiguous copy of t (t itself, retained into the scope, if already contiguous). */
anneal_tensor *anneal_contiguous(anneal_tensor *t);
/* A differentiable copy (always new storage). */
anneal_tensor *anneal_clone(anneal_tensor *t);

/* ------------------------------------------------------------------ views */

/* Same elements with a new shape (one dim may be -1). A view when the strides allow,
 * otherwise a copy (like torch.reshape). */
anneal_tensor *anneal_reshape(anneal_tensor *t, int ndim, const int64_t *shape);
/* Swaps two dims (view). Negative dims count from the end. */
anneal_tensor *anneal_transpose(anneal_tensor *t, int d0, int d1);
/* Reorders dims (view): result dim i is t's dim perm[i]. */
anneal_tensor *anneal_permute(anneal_tensor *t, const int *perm);
/* Elements start..start+len-1 along dim (view). */
anneal_tensor *anneal_narrow(anneal_tensor *t, int dim, int64_t start, int64_t len);
/* Splits along dim into n pieces of the given sizes (views); returns ANNEAL_OK or an error. */
anneal_status anneal_split(anneal_tensor *t, int dim, int n, const int64_t *sizes,
                           anneal_tensor **out);
/* Concatenates n tensors along dim (new storage). */
anneal_tensor *anneal_cat(int n, anneal_tensor *const *ts, int dim);

/* ------------------------------------------------------------ elementwise */

/* Broadcasting binary ops (NumPy rules). */
anneal_tensor *anneal_add(anneal_tensor *a, anneal_tensor *b);
anneal_tensor *anneal_sub(anneal_tensor *a, anneal_tensor *b);
anneal_tensor *anneal_mul(anneal_tensor *a, anneal_tensor *b);
anneal_tensor *anneal_div(anneal_tensor *a, anneal_tensor *b);
/* x * s. */
anneal_tensor *anneal_scale(anneal_tensor *x, float s);
/* x + s. */
anneal_tensor *anneal_add_scalar(anneal_tensor *x, float s);
/* GELU: exact (erf) or tanh approximation. */
anneal_tensor *anneal_gelu(anneal_tensor *x, bool tanh_approx);
anneal_tensor *anneal_silu(anneal_tensor *x);
/* Inverted dropout with probability p from the global Philox generator; identity
 * (returns x) when !training or p == 0. Same seed -> same mask at any thread count. */
anneal_tensor *anneal_dropout(anneal_tensor *x, float p, bool training);

/* -------------------------------------------------------------- reductions */

/* Sum / mean of all elements: a 0-dim tensor. */
anneal_tensor *anneal_sum(anneal_tensor *x);
anneal_tensor *anneal_mean(anneal_tensor *x);
/* Sum / mean over one dim, keeping it as size 1 when keepdim. */
anneal_tensor *anneal_sum_dim(anneal_tensor *x, int dim, bool keepdim);
anneal_tensor *anneal_mean_dim(anneal_tensor *x, int dim, bool keepdim);

/* ---------------------------------------------------------------- linear */

/* Matrix product over the last two dims, with NumPy-style broadcast of leading dims
 * (a (..., M, K) @ b (..., K, N)). Transposed operands are views: no copy is made. */
anneal_tensor *anneal_matmul(anneal_tensor *a, anneal_tensor *b);
/* x (..., in) @ w^T + b, w (out, in) as torch.nn.Linear; b (out) may be NULL. */
anneal_tensor *anneal_linear(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b);
/* x (..., in) @ w + b, w (in, out) as Hugging Face's Conv1D (GPT-2); b may be NULL. */
anneal_tensor *anneal_conv1d(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b);

/* ------------------------------------------------------------- normalise */

/* LayerNorm over the last dim with weight and bias (either may be NULL). */
anneal_tensor *anneal_layer_norm(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, float eps);
/* RMSNorm over the last dim with weight (may be NULL). */
anneal_tensor *anneal_rms_norm(anneal_tensor *x, anneal_tensor *w, float eps);
/* Softmax / log-softmax over the last dim. */
anneal_tensor *anneal_softmax(anneal_tensor *x);
anneal_tensor *anneal_log_softmax(anneal_tensor *x);

/* -------------------------------------------------------------- attention */

/* Scaled dot-product attention of q (B, H, Tq, D) against k, v (B, H, Tk, D), causal
 * or not, scale 1/sqrt(D) when scale <= 0. Flash-style: no Tq x Tk matrix is kept.
 * Output (B, H, Tq, D) is a view of (B, Tq, H, D) storage, so transposing dims 1 and
 * 2 and reshaping to (B, Tq, H*D) costs nothing. */
anneal_tensor *anneal_attention(anneal_tensor *q, anneal_tensor *k, anneal_tensor *v, bool causal,
                                float scale);
/* GPT-2 style causal self-attention from a fused qkv (B, T, 3C) projection with
 * n_head heads: returns (B, T, C); the gradient goes straight into a (B, T, 3C) buffer. */
anneal_tensor *anneal_causal_attention(anneal_tensor *qkv, int n_head);

/* ------------------------------------------------------- embedding, loss */

/* Rows of weight (V, C) picked by integer ids (any shape, i32): (..., C). Ids out of
 * range are an error that names the bad id. Backward scatter-adds into weight. */
anneal_tensor *anneal_embedding(anneal_tensor *ids, anneal_tensor *weight);
/* Mean cross-entropy of logits (..., V) against i32 targets (...), skipping targets
 * equal to ignore_index; a 0-dim tensor. Fused log-softmax; targets out of range are
 * an error. If every target is ignored the loss is 0 (not NaN). */
anneal_tensor *anneal_cross_entropy(anneal_tensor *logits, anneal_tensor *targets,
                                    int32_t ignore_index);

/* ------------------------------------------------------------------ fused */

/* gelu_tanh(x (..., in) @ w + b) with w (in, out) as Hugging Face's Conv1D and b (out)
 * optional: one GEMM whose epilogue adds the bias and applies the GELU; the
 * pre-activation is kept for backward. Equal to anneal_gelu(anneal_conv1d(x, w, b), true). */
anneal_tensor *anneal_conv1d_gelu(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b);
/* Residual add + LayerNorm in one pass: s = x + r (same shapes, no broadcast) is stored
 * in *sum_out (the new residual stream) and LayerNorm(s; w, b, eps) is returned (w and b
 * optional). Gradients reaching s through both uses are combined. On error returns NULL
 * and sets *sum_out to NULL. */
anneal_tensor *anneal_add_layer_norm(anneal_tensor *x, anneal_tensor *r, anneal_tensor *w,
                                     anneal_tensor *b, float eps, anneal_tensor **sum_out);
/* cross_entropy(h (..., C) @ w (V, C)^T, targets (...), ignore_index) without ever
 * holding the (N, V) logits: rows go through in chunks, and when a gradient is wanted
 * each chunk's softmax - onehot is turned into dh and dw at once. A 0-dim mean loss. */
anneal_tensor *anneal_linear_cross_entropy(anneal_tensor *h, anneal_tensor *w,
                                           anneal_tensor *targets, int32_t ignore_index);

/* ------------------------------------------------- precision and fusion */

/* Every op that runs matrix products takes its compute precision as a value
 * (`compute`: ANNEAL_F32, ANNEAL_BF16 or ANNEAL_F16, like torch.autocast's dtype): the
 * GEMM operands are rounded to it (nearest even; f16 overflows to inf) and the products
 * accumulate in f32; results are f32 tensors. The precision is recorded on the autograd
 * node, so backward runs at the forward's. The plain functions above are f32. */

/* anneal_matmul at `compute`. */
anneal_tensor *anneal_matmul_ex(anneal_tensor *a, anneal_tensor *b, anneal_dtype compute);

/* Layout of a dense layer's weight. */
typedef enum anneal_weight_layout {
    ANNEAL_WEIGHT_OUT_IN = 0, /* (out, in), as torch.nn.Linear */
    ANNEAL_WEIGHT_IN_OUT = 1, /* (in, out), as Hugging Face's Conv1D (GPT-2) */
} anneal_weight_layout;

/* What a dense layer applies to x @ W + b, fused into the GEMM's epilogue. */
typedef enum anneal_activation {
    ANNEAL_ACT_NONE = 0,
    ANNEAL_ACT_GELU_TANH, /* gelu_tanh(x @ W + b) (the pre-activation kept for backward) */
    ANNEAL_ACT_SILU_MUL,  /* silu(x @ W + b) * mul: the SwiGLU gate times the up projection */
} anneal_activation;

typedef struct anneal_dense_opts {
    anneal_weight_layout layout;
    anneal_activation act;
    anneal_tensor *mul;   /* ANNEAL_ACT_SILU_MUL: the multiplier, the output's shape */
    anneal_dtype compute; /* 0 = ANNEAL_F32 */
    /* At bf16 compute on the CPU the layer saves x for backward as a bf16 copy (its dW
     * GEMM reads x only as bf16-rounded operands: the same bits, half the bytes). True:
     * save x as it is, because another op keeps it in f32 anyway (attention's output). */
    bool x_kept_f32;
} anneal_dense_opts;

/* A dense layer x (..., in) with weight w (layout per opts), bias b (out) or NULL, and
 * the activation fused into one GEMM (opts NULL: linear, f32, no activation).
 * anneal_linear, anneal_conv1d and anneal_conv1d_gelu are this op at f32. */
anneal_tensor *anneal_dense(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                            const anneal_dense_opts *opts);

/* anneal_linear_cross_entropy at `compute`. */
anneal_tensor *anneal_linear_cross_entropy_ex(anneal_tensor *h, anneal_tensor *w,
                                              anneal_tensor *targets, int32_t ignore_index,
                                              anneal_dtype compute);

/* Attention settings. */
typedef struct anneal_attention_opts {
    bool causal;                 /* query i sees key j <= i + (Tk - Tq) */
    float scale;                 /* <= 0: 1/sqrt(D) */
    anneal_dtype compute;        /* 0 = ANNEAL_F32; BF16: bf16 tile products */
    const anneal_rope_desc *rope; /* NULL: none; else q and k are rotated first, key row j at
                                    position rope_pos0 + j and query row i at rope_pos0 +
                                    (Tk - Tq) + i */
    int64_t rope_pos0;
} anneal_attention_opts;

/* Scaled dot-product attention of q (B, Hq, Tq, D) against k, v (B, Hkv, Tk, D), Hq a
 * multiple of Hkv (grouped-query; Hkv == 1 is multi-query): flash-style, no Tq x Tk
 * matrix kept. Returns (B, Hq, Tq, D) as a view of (B, Tq, Hq, D) storage, so
 * transposing dims 1 and 2 and reshaping to (B, Tq, Hq*D) costs nothing. */
anneal_tensor *anneal_attention_ex(anneal_tensor *q, anneal_tensor *k, anneal_tensor *v,
                                   const anneal_attention_opts *opts);
/* Self-attention from one packed projection qkv (B, T, (n_head + 2 * n_kv_head) * D):
 * the first n_head * D columns are the queries, then the keys, then the values, each
 * head's D columns together (GPT-2's c_attn output, or Llama's q/k/v projections in one
 * GEMM). Returns (B, T, n_head * D); the gradient lands in one buffer of qkv's shape. */
anneal_tensor *anneal_attention_packed(anneal_tensor *qkv, int n_head, int n_kv_head,
                                       const anneal_attention_opts *opts);
/* Rotary embedding of x (B, H, T, D) (row t at position pos0 + t): a new tensor;
 * differentiable (the backward rotates back). */
anneal_tensor *anneal_rope(anneal_tensor *x, const anneal_rope_desc *rope, int64_t pos0);

/* ---------------------------------------------------------------- devices */

/* i32 tensor [start, start + n) on device dev (position ids). */
anneal_tensor *anneal_arange(anneal_device dev, int64_t start, int64_t n);
/* A copy of t on device dev (t itself, retained into the scope, when it is there
 * already); not differentiable. Moving a model or a batch between devices is this,
 * explicitly. */
anneal_tensor *anneal_to_device(anneal_tensor *t, anneal_device dev);

/* ------------------------------------------------------------ int8 */

/* Symmetric int8 quantization of x (..., cols) f32: per row (group 0; *scales f32 of
 * x's leading dims) or per group of `group` columns (group divides cols; *scales (...,
 * cols / group)). scale = max(amax / 127, FLT_EPSILON), q = clamp(round-half-even(x /
 * scale), -127, 127): PyTorch's per-channel symmetric scheme over [-127, 127]. Returns
 * q (i8, x's shape); no autograd. */
anneal_tensor *anneal_quantize_s8(anneal_tensor *x, int64_t group, anneal_tensor **scales);
/* The quantized dense product y (..., N) = x (..., K) W^T + b: wq (N, K) i8 in
 * torch.nn.Linear's layout, wscale f32 (N) or, weight-only with a group, (N, K / group),
 * bias (N) or NULL, and d (mode, compute, group, static scale). Inference only: an x
 * that wants a gradient is ANNEAL_ERR_UNSUPPORTED. */
anneal_tensor *anneal_qlinear(anneal_tensor *x, anneal_tensor *wq, anneal_tensor *wscale, anneal_tensor *bias,
                              const anneal_qmatmul_desc *d);
/* y (..., out) = x (..., in) W + b for W (in inputs, out outputs) packed as bf16 panels
 * (anneal_gemv_pack_panels_bf16's layout; panels a 1-D bf16 tensor of
 * anneal_gemv_panels_bf16_len(in, out) values), bias (out) f32 or NULL: each element one
 * f32 sum in k order over the widened bf16 weights (the decode engine's arithmetic).
 * Inference only: an x that wants a gradient is ANNEAL_ERR_UNSUPPORTED. */
anneal_tensor *anneal_panels_linear(anneal_tensor *x, anneal_tensor *panels, anneal_tensor *bias, int64_t in,
                                    int64_t out);

#ifdef __cplusplus
}
#endif
#endif
