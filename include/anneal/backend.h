/* The device interface: one versioned table of kernels per device, with the
 * backend's own context, as ggml's backend interface and SQLite's VFS do it.
 *
 * - Ops never call a kernel directly. They look up the backend of their inputs'
 *   device (anneal_backend_get) and call through this table, handing it
 *   descriptors they built themselves (matmul batch folding and transposes,
 *   attention layouts and head counts): a backend is kernels only.
 * - Every slot gets the backend's ctx first. Work is enqueued on the backend's
 *   current stream and may run asynchronously: a slot returns as soon as the work
 *   is queued. Results reach the host only through copy_to_host + synchronize,
 *   so a training step needs at most one synchronisation (reductions such as
 *   norms and loss sums stay on the device until then). The CPU backend runs
 *   every slot synchronously, which the contract allows.
 * - A slot can fail at once (a bad argument, no memory: an anneal_status with the
 *   message) or, on an asynchronous device, later: the first deferred error (an
 *   out-of-range target found by a kernel, a device fault) is what synchronize
 *   returns.
 * - supports_op lets a backend decline an op it has no kernel for (a dtype, an
 *   epilogue, a head layout); the op then reports ANNEAL_ERR_UNSUPPORTED naming
 *   the device and the op instead of calling a NULL slot.
 * - Versioning: a table says which ANNEAL_BACKEND_VERSION it was written for.
 *   Slots are only ever appended, each documented with the version that added it;
 *   a slot newer than a table's version is treated as absent (ANNEAL_BACKEND_SLOT).
 * - Registration: backends register themselves (anneal_backend_register); core
 *   knows none by name. The library's built-in backends are listed, one line
 *   each, in src/backends/registry.c.
 *
 * Unless a slot says otherwise, tensor arguments are f32, contiguous, on the
 * backend's device, and already shape-checked by the op. Kernels do no autograd
 * and no file I/O, and must be deterministic (no atomics in reductions): the same
 * inputs give the same bits on every call. */
#ifndef ANNEAL_BACKEND_H
#define ANNEAL_BACKEND_H

#include "anneal/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The table layout this header describes. 3: workspace_bytes (a hint, appended after
 * the version 2 slots); 4: alloc_zeroed. */
#define ANNEAL_BACKEND_VERSION 5

typedef enum anneal_binary_op { ANNEAL_ADD, ANNEAL_SUB, ANNEAL_MUL, ANNEAL_DIV } anneal_binary_op;

typedef enum anneal_unary_op {
    ANNEAL_UNARY_SCALE,      /* alpha * x */
    ANNEAL_UNARY_ADD_SCALAR, /* x + alpha */
    ANNEAL_UNARY_GELU_TANH,
    ANNEAL_UNARY_GELU_ERF,
    ANNEAL_UNARY_SILU,
} anneal_unary_op;

/* ---------------------------------------------------------------- matmul */

/* What a matrix product does to each finished element v = alpha*acc + beta*c of C,
 * while the tile is still in registers or cache (fusion by epilogue: a new
 * activation is a new value here, not a new slot). */
typedef enum anneal_epilogue {
    ANNEAL_EPILOGUE_NONE = 0,
    ANNEAL_EPILOGUE_BIAS,      /* c = v + bias[j] */
    ANNEAL_EPILOGUE_BIAS_GELU, /* pre = v + bias[j] (bias optional; pre stored in aux_out when
                                  given), c = gelu_tanh(pre) */
    ANNEAL_EPILOGUE_SILU_MUL,  /* pre = v + bias[j] (bias optional; stored in aux_out when given),
                                  c = silu(pre) * aux_in[i, j] (the SwiGLU gate times the up
                                  projection) */
    ANNEAL_EPILOGUE_BSUM,      /* c = v; and bsum[j] = sum over k of op(B)[k, j] (f32 additions in
                                  ascending k, of B's values before any rounding): a dense
                                  layer's bias gradient taken while the weight-gradient GEMM
                                  reads dy */
    ANNEAL_EPILOGUE_COUNT
} anneal_epilogue;

/* One (batched) matrix product, laid out by the op:
 *   for i in [0, batch): C_i = alpha * op(A_i) @ op(B_i) + beta * C_i, then the epilogue,
 * where X_i starts at X's first element (anneal_data) + i * stride_x, op(A_i) is M x K,
 * op(B_i) is K x N and C_i is M x N. A is stored M x K with row stride lda (K x M when
 * trans_a), B K x N with ldb (N x K when trans_b), C M x N with ldc (row-major, unit
 * column stride). A stride of 0 broadcasts that operand over the batch. beta == 0
 * means C is not read (it may hold NaN). The operands are rounded to `compute`
 * (F32: none; BF16 / F16: round to nearest even, f16 overflowing to inf) and the
 * products accumulate in f32. Epilogue operands (bias (N), aux_in and aux_out (M x N,
 * row stride ldc), bsum (N)) apply to batch == 1 only. Ops fold batch dims into M
 * where the layout allows it, so the batched form is for attention-like products. */
/* How a dense layer's weight is quantized to int8 (symmetric, zero point 0): the weight
 * only (dequantized on the fly, f32/bf16 products), or the weight and the activations
 * with an int8 x int8 -> int32 product: activations quantized per row (token) on the
 * fly (dynamic) or with one calibrated scale (static). */
typedef enum anneal_quant_mode {
    ANNEAL_QUANT_NONE = 0,
    ANNEAL_QUANT_WEIGHT_ONLY,
    ANNEAL_QUANT_DYNAMIC,
    ANNEAL_QUANT_STATIC,
} anneal_quant_mode;

/* A quantized dense product y (M, N) = x (M, K) W^T + b, W int8 (N, K) with f32 scales
 * (N) or, weight-only, (N, K / group). */
typedef struct anneal_qmatmul_desc {
    anneal_quant_mode mode;
    anneal_dtype compute; /* weight-only: ANNEAL_F32 or ANNEAL_BF16 (x rounded to bf16) */
    int64_t group;        /* weight-only group size dividing K; 0: one scale per row of W */
    float act_scale;      /* static: the activations' scale */
} anneal_qmatmul_desc;

typedef struct anneal_matmul_desc {
    int64_t batch, M, N, K;
    bool trans_a, trans_b;
    int64_t lda, ldb, ldc;
    int64_t stride_a, stride_b, stride_c;
    float alpha, beta;
    anneal_dtype compute;
    anneal_epilogue epilogue;
    const anneal_tensor *bias;   /* BIAS (required), BIAS_GELU / SILU_MUL (optional) */
    const anneal_tensor *aux_in; /* SILU_MUL: the multiplier */
    anneal_tensor *aux_out;      /* BIAS_GELU / SILU_MUL: the pre-activation, or NULL */
    anneal_tensor *bsum;         /* BSUM: the column sums of op(B) */
} anneal_matmul_desc;

/* -------------------------------------------------------------- attention */

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

/* Scaled dot-product attention over strided 4-D views, laid out by the op.
 * q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D) with Hq a multiple of Hkv: query head h
 * reads key/value head h / (Hq / Hkv) (grouped-query attention; Hkv == 1 is
 * multi-query). o (B, Hq, Tq, D). Strides are in elements; the last dim of every
 * operand has unit stride. When causal, query i sees key j <= i + (Tk - Tq)
 * (bottom-right aligned: a KV cache's new rows see every cached position).
 * lse (B, Hq, Tq) contiguous: the natural-log logsumexp of each query row's scaled
 * scores. compute: BF16 rounds the operands of every tile product (Q K^T and P V, and in
 * backward the recomputed scores, dV, dP, dQ and dK) to bf16 with f32 accumulation,
 * softmax statistics, lse and normalisation in f32; F32 and F16 run f32 attention. */
typedef struct anneal_attention_desc {
    int64_t B, Hq, Hkv, Tq, Tk, D;
    int64_t q_sb, q_sh, q_st; /* q and dq */
    int64_t k_sb, k_sh, k_st; /* k and dk */
    int64_t v_sb, v_sh, v_st; /* v and dv */
    int64_t o_sb, o_sh, o_st; /* o and dout */
    float scale;
    bool causal;
    anneal_dtype compute;
} anneal_attention_desc;

/* ------------------------------------------------------------- supports_op */

/* The kernels a backend can be asked about. */
typedef enum anneal_op_kind {
    ANNEAL_OP_COPY, ANNEAL_OP_FILL, ANNEAL_OP_BINARY, ANNEAL_OP_UNARY, ANNEAL_OP_REDUCE_SUM,
    ANNEAL_OP_MATMUL, ANNEAL_OP_LAYER_NORM, ANNEAL_OP_ADD_LAYER_NORM, ANNEAL_OP_RMS_NORM,
    ANNEAL_OP_SOFTMAX, ANNEAL_OP_ATTENTION, ANNEAL_OP_ROPE, ANNEAL_OP_EMBEDDING,
    ANNEAL_OP_CROSS_ENTROPY, ANNEAL_OP_LINEAR_CROSS_ENTROPY, ANNEAL_OP_DROPOUT, ANNEAL_OP_RANDN,
    ANNEAL_OP_ADAMW, ANNEAL_OP_SUM_SQUARES, ANNEAL_OP_CHECK_INDEX, ANNEAL_OP_LOSS_MEAN,
    ANNEAL_OP_SCALE_BY,
    ANNEAL_OP_KIND_COUNT
} anneal_op_kind;

/* What an op is about to ask for: the kind, the dtypes involved and, for MATMUL,
 * ATTENTION and ROPE, the descriptor (NULL otherwise). */
typedef struct anneal_op_query {
    anneal_op_kind kind;
    anneal_dtype dtype;                     /* the tensors' storage dtype */
    const anneal_matmul_desc *matmul;       /* MATMUL */
    const anneal_attention_desc *attention; /* ATTENTION */
    const anneal_rope_desc *rope;           /* ROPE (and ATTENTION with a rotary embedding) */
} anneal_op_query;

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

/* An opaque stream and event of a backend (NULL on backends without them). */
typedef struct anneal_stream anneal_stream;
typedef struct anneal_event anneal_event;

typedef struct anneal_backend anneal_backend;

struct anneal_backend {
    /* ---------------------------------------------- version 1: identity */
    int version;         /* the ANNEAL_BACKEND_VERSION the table was written for */
    const char *name;    /* "cpu", "cuda" */
    anneal_device device;
    void *ctx;           /* the backend's state (handles, workspaces, current stream) */

    /* ------------------------------------- version 1: memory and streams */
    /* Device memory, 64-byte aligned; NULL on failure (no error recorded: the caching
     * allocator in core reports it). */
    void *(*alloc)(void *ctx, size_t nbytes);
    void (*free)(void *ctx, void *p);
    /* Queue a copy between host memory and this device's memory on the current stream.
     * The host buffer must stay valid (and, for to_host, unread) until synchronize. */
    anneal_status (*copy_to_host)(void *ctx, void *host_dst, const void *dev_src, size_t nbytes);
    anneal_status (*copy_from_host)(void *ctx, void *dev_dst, const void *host_src, size_t nbytes);
    /* Waits until every queued piece of work is done; returns the first deferred error
     * since the last synchronize (ANNEAL_OK if none). */
    anneal_status (*synchronize)(void *ctx);
    /* True when the backend has a kernel for q. NULL: everything in the table. */
    bool (*supports_op)(void *ctx, const anneal_op_query *q);
    /* Optional (NULL: one implicit stream, events complete at once). stream_set makes
     * later slots queue on s (NULL: the default stream). An event marks the point of a
     * stream where it was recorded; event_wait makes the current stream wait for it. */
    anneal_stream *(*stream_new)(void *ctx);
    void (*stream_free)(void *ctx, anneal_stream *s);
    anneal_status (*stream_set)(void *ctx, anneal_stream *s);
    anneal_event *(*event_record)(void *ctx);
    anneal_status (*event_wait)(void *ctx, anneal_event *e);
    void (*event_free)(void *ctx, anneal_event *e);

    /* --------------------------------------------- version 1: elementwise */
    /* dst = src elementwise, any strides and any dtypes (converting); same shape. */
    anneal_status (*copy)(void *ctx, anneal_tensor *dst, const anneal_tensor *src);
    /* Every element of dst (any strides, any dtype) = value. */
    anneal_status (*fill)(void *ctx, anneal_tensor *dst, double value);
    /* out = a op b; out contiguous; a and b have out's shape with any strides (stride 0
     * where broadcast). out may alias a (in-place accumulate). */
    anneal_status (*binary)(void *ctx, anneal_binary_op op, anneal_tensor *out,
                            const anneal_tensor *a, const anneal_tensor *b);
    /* out = f(x; alpha), contiguous; for SCALE and ADD_SCALAR out may be x (in place). */
    anneal_status (*unary)(void *ctx, anneal_unary_op op, anneal_tensor *out,
                           const anneal_tensor *x, float alpha);
    /* dx = dy * f'(x; alpha), contiguous. */
    anneal_status (*unary_bwd)(void *ctx, anneal_unary_op op, anneal_tensor *dx,
                               const anneal_tensor *x, const anneal_tensor *dy, float alpha);
    /* x *= c in place (x contiguous f32), where c = (float)(s * f) in double, s the value
     * of the 0-dim f32 tensor `s` on this device (1 when s is NULL) and f = factor, or,
     * when count (I64 0-dim on this device) is given and its value n is not 0,
     * f = factor / n: a scale known only on the device (an upstream loss gradient, a
     * mean's divisor) applied without reading it to the host. A no-op when c == 1. */
    anneal_status (*scale_by)(void *ctx, anneal_tensor *x, const anneal_tensor *s,
                              const anneal_tensor *count, double factor);
    /* out (contiguous, same ndim as x with size 1 in reduced dims) = sum of x over the
     * dims where out has size 1 and x does not. x any strides. */
    anneal_status (*reduce_sum)(void *ctx, anneal_tensor *out, const anneal_tensor *x);
    /* out (F64, 1-D, on this device) element `index` = the sum of squares of x's
     * elements (x contiguous f32), accumulated in double: a norm's pieces stay on the
     * device, and one copy_to_host after the last one reads them all. */
    anneal_status (*sum_squares)(void *ctx, anneal_tensor *out, int64_t index,
                                 const anneal_tensor *x);

    /* ------------------------------------------------ version 1: products */
    /* See anneal_matmul_desc. a, b and c give the device and the first element. */
    anneal_status (*matmul)(void *ctx, const anneal_matmul_desc *d, anneal_tensor *c,
                            const anneal_tensor *a, const anneal_tensor *b);

    /* ---------------------------------------------- version 1: row ops */
    /* Normalisation over the last dim. x (N, C) flattened; mean/rstd (N). */
    anneal_status (*layer_norm_fwd)(void *ctx, anneal_tensor *y, anneal_tensor *mean,
                                    anneal_tensor *rstd, const anneal_tensor *x,
                                    const anneal_tensor *w, const anneal_tensor *b, float eps);
    /* dx, dw, db may each be NULL (not wanted). */
    anneal_status (*layer_norm_bwd)(void *ctx, anneal_tensor *dx, anneal_tensor *dw,
                                    anneal_tensor *db, const anneal_tensor *x,
                                    const anneal_tensor *w, const anneal_tensor *mean,
                                    const anneal_tensor *rstd, const anneal_tensor *dy);
    /* s = x + r and y = LayerNorm(s) (mean/rstd (N) written) in one pass; all (N, C). */
    anneal_status (*add_layer_norm_fwd)(void *ctx, anneal_tensor *s, anneal_tensor *y,
                                        anneal_tensor *mean, anneal_tensor *rstd,
                                        const anneal_tensor *x, const anneal_tensor *r,
                                        const anneal_tensor *w, const anneal_tensor *b, float eps);
    /* dx = LayerNorm backward of dy at s, plus ds (the gradient of s's other uses; may
     * be NULL); dx, dw, db may each be NULL (not wanted). */
    anneal_status (*add_layer_norm_bwd)(void *ctx, anneal_tensor *dx, anneal_tensor *dw,
                                        anneal_tensor *db, const anneal_tensor *s,
                                        const anneal_tensor *w, const anneal_tensor *mean,
                                        const anneal_tensor *rstd, const anneal_tensor *dy,
                                        const anneal_tensor *ds);
    anneal_status (*rms_norm_fwd)(void *ctx, anneal_tensor *y, anneal_tensor *rstd,
                                  const anneal_tensor *x, const anneal_tensor *w, float eps);
    anneal_status (*rms_norm_bwd)(void *ctx, anneal_tensor *dx, anneal_tensor *dw,
                                  const anneal_tensor *x, const anneal_tensor *w,
                                  const anneal_tensor *rstd, const anneal_tensor *dy);
    /* Softmax / log-softmax over the last dim. */
    anneal_status (*softmax_fwd)(void *ctx, anneal_tensor *y, const anneal_tensor *x, bool log);
    anneal_status (*softmax_bwd)(void *ctx, anneal_tensor *dx, const anneal_tensor *y,
                                 const anneal_tensor *dy, bool log);

    /* ---------------------------------------------- version 1: attention */
    /* See anneal_attention_desc; q, k, v, o give the first elements. */
    anneal_status (*attention_fwd)(void *ctx, const anneal_attention_desc *d, anneal_tensor *o,
                                   anneal_tensor *lse, const anneal_tensor *q,
                                   const anneal_tensor *k, const anneal_tensor *v);
    /* dq, dk, dv are addressed with the strides of q, k, v and overwritten (with GQA, dk
     * and dv sum the query heads of their group, in ascending head order). dout has o's
     * strides. compute is the forward's. */
    anneal_status (*attention_bwd)(void *ctx, const anneal_attention_desc *d, anneal_tensor *dq,
                                   anneal_tensor *dk, anneal_tensor *dv, const anneal_tensor *q,
                                   const anneal_tensor *k, const anneal_tensor *v,
                                   const anneal_tensor *o, const anneal_tensor *dout,
                                   const anneal_tensor *lse);
    /* Rotary embedding of x (B, H, T, D), any strides with a unit last dim, in place:
     * position of row t is pos0 + t. inverse: rotate by the negative angle (the
     * backward of the forward rotation). */
    anneal_status (*rope)(void *ctx, const anneal_rope_desc *d, anneal_tensor *x, int64_t pos0,
                          bool inverse);

    /* ------------------------------------ version 1: embedding and losses */
    /* Checks every element of ids (i32, contiguous, any shape) is ignore_index (when
     * has_ignore) or in [0, n): an index out of range is ANNEAL_ERR_ARG (at once, or from
     * synchronize on an asynchronous device) with the message
     *   "<op>: <what> <value> at position [i, j] (flat index <k>) is outside [0, V) with
     *    V = <n>" + (has_ignore: " and is not ignore_index (<ignore_index>)")
     * for the first bad element (the position is its multi-index in ids' shape). When
     * count is given (I64, 0-dim, on this device), it receives the number of elements
     * that are not ignore_index. */
    anneal_status (*check_index)(void *ctx, const char *op, const char *what,
                                 const anneal_tensor *ids, int64_t n, bool has_ignore,
                                 int32_t ignore_index, anneal_tensor *count);
    /* y (N, C) = w[ids]; ids i32 (N), validated by the op. */
    anneal_status (*embedding_fwd)(void *ctx, anneal_tensor *y, const anneal_tensor *ids,
                                   const anneal_tensor *w);
    /* dw (V, C) overwritten with the scatter-add of dy rows (rows in order). */
    anneal_status (*embedding_bwd)(void *ctx, anneal_tensor *dw, const anneal_tensor *ids,
                                   const anneal_tensor *dy);
    /* Per-row loss (N) and logsumexp (N) of logits (N, V) against i32 targets (N);
     * rows whose target is ignore_index get loss 0. */
    anneal_status (*cross_entropy_fwd)(void *ctx, anneal_tensor *loss, anneal_tensor *lse,
                                       const anneal_tensor *logits, const anneal_tensor *targets,
                                       int32_t ignore_index);
    /* dlogits = scale * (softmax - onehot) on kept rows, 0 on ignored rows, where scale
     * = (float)(s / count) with s the 0-dim f32 upstream gradient and count the I64
     * 0-dim number of kept rows (both on this device; scale 0 when count is 0). */
    anneal_status (*cross_entropy_bwd)(void *ctx, anneal_tensor *dlogits,
                                       const anneal_tensor *logits, const anneal_tensor *targets,
                                       const anneal_tensor *lse, int32_t ignore_index,
                                       const anneal_tensor *s, const anneal_tensor *count);
    /* out (0-dim f32) = (float)(the sum in double, in row order, of rows[i] over the
     * rows whose target is not ignore_index, divided by count) (0 when count is 0).
     * rows (N) f32, targets (N) i32, count I64 0-dim. */
    anneal_status (*loss_mean)(void *ctx, anneal_tensor *out, const anneal_tensor *rows,
                               const anneal_tensor *targets, int32_t ignore_index,
                               const anneal_tensor *count);
    /* Cross-entropy of logits = h (N, C) @ w (V, C)^T against i32 targets (N), in chunks
     * of work->shape[0] rows through the workspace work (rows, V): loss (N) per row (0
     * where ignored) and lse (N). When dh (N, C) / dw (V, C) are given, each chunk's
     * dlogits = g * (softmax - onehot) (0 on ignored rows) is used at once: dh rows =
     * dlogits @ w, dw += dlogits^T @ h (dw overwritten, chunks in order), where g = 1 /
     * count (count: I64 0-dim, the kept rows; g = 0 when count is 0), except at compute
     * F16, where g = 32768 (2^15: f16 keeps small probabilities; the op divides it out
     * exactly). GEMMs at `compute`. */
    anneal_status (*linear_cross_entropy)(void *ctx, anneal_tensor *loss, anneal_tensor *lse,
                                          anneal_tensor *dh, anneal_tensor *dw, anneal_tensor *work,
                                          const anneal_tensor *h, const anneal_tensor *w,
                                          const anneal_tensor *targets, int32_t ignore_index,
                                          const anneal_tensor *count, anneal_dtype compute);

    /* ------------------------------------------- version 1: randomness */
    /* y = x * mask / (1 - p) with mask ~ Bernoulli(1 - p) from Philox(seed, offset + i/4);
     * mask (u8) written for backward. */
    anneal_status (*dropout_fwd)(void *ctx, anneal_tensor *y, anneal_tensor *mask,
                                 const anneal_tensor *x, float p, uint64_t seed, uint64_t offset);
    /* dx = dy * mask / (1 - p). */
    anneal_status (*dropout_bwd)(void *ctx, anneal_tensor *dx, const anneal_tensor *mask,
                                 const anneal_tensor *dy, float p);
    /* Fills x with normal(mean, std) from Philox(seed, offset + i/4) (Box-Muller). */
    anneal_status (*randn)(void *ctx, anneal_tensor *x, float mean, float std, uint64_t seed,
                           uint64_t offset);

    /* -------------------------------------------- version 1: optimizer */
    /* One AdamW step on p (f32) with grad g and moments m, v (same numel). Scalars in
     * double: the kernel forms its constants from them as PyTorch does. */
    anneal_status (*adamw)(void *ctx, anneal_tensor *p, const anneal_tensor *g, anneal_tensor *m,
                           anneal_tensor *v, double lr, double beta1, double beta2, double eps,
                           double weight_decay, double bc1, double bc2);
    /* One AdamW step over n parameters in one pass (groups' pointers are device
     * addresses); each element is updated exactly as adamw would (bit-identical).
     * Optional (NULL: the optimizer calls adamw per parameter). */
    anneal_status (*adamw_multi)(void *ctx, const anneal_adamw_group *groups, int n, double lr,
                                 double beta1, double beta2, double eps);

    /* ----------------------------------- version 2: int8 quantization */
    /* Symmetric int8 quantization of x (rows, cols) f32 contiguous into q (i8, same
     * shape) and scales (f32 (rows) with group 0, (rows, cols / group) otherwise):
     * scale = max(amax / 127, FLT_EPSILON), q = clamp(round-half-even(x / scale), -127,
     * 127). Optional. */
    anneal_status (*quantize_s8)(void *ctx, anneal_tensor *q, anneal_tensor *scales, const anneal_tensor *x,
                                 int64_t group);
    /* The quantized dense product of d: y (M, N) f32 from x (M, K) f32, wq (N, K) i8,
     * wscale f32, bias (N) or NULL; all contiguous. Optional. */
    anneal_status (*qmatmul)(void *ctx, const anneal_qmatmul_desc *d, anneal_tensor *y, const anneal_tensor *x,
                             const anneal_tensor *wq, const anneal_tensor *wscale, const anneal_tensor *bias);

    /* --------------------------------------- version 3: sizing hints */
    /* The most workspace (bytes) a chunked op (linear cross-entropy's (rows, V) logits)
     * should ask for at once on this device; 0: the op's own default (sized for CPU
     * caches). Read only when version >= 3 (an older table has no such field). A device
     * with memory to spare and a per-chunk fixed cost (a GPU) sets it large. */
    int64_t workspace_bytes;

    /* -------------------------------------------- version 4: zeroed memory */
    /* Memory as alloc gives it, every byte zero. Optional (NULL: alloc, then fill). For a
     * backend whose system allocator hands out fresh pages already zero (the CPU's
     * calloc), so a large zero tensor (a model's parameters before a load overwrites or
     * replaces them, optimizer moments) is not written, and so not made resident, until
     * it is used. */
    void *(*alloc_zeroed)(void *ctx, size_t nbytes);

    /* ------------------------------------- version 5: bf16 panel weights */
    /* y (M, N) = x (M, K) W + b, f32, for W (K inputs, N outputs) packed as bf16 panels of
     * 16 outputs (decode_kernels.h's anneal_gemv_pack_panels_bf16 layout; `panels` a 1-D
     * ANNEAL_BF16 tensor of anneal_gemv_panels_bf16_len(K, N) values), bias (N) f32 or
     * NULL; x and y contiguous. Each element one f32 sum in k order over the bf16 weights
     * widened exactly: the decode engine's arithmetic. For an inference-only model whose
     * float weights were replaced by these (anneal_params_pack_bf16). Optional. */
    anneal_status (*panels_matmul)(void *ctx, anneal_tensor *y, const anneal_tensor *x, const anneal_tensor *panels,
                                   const anneal_tensor *bias);
};

/* True when table b has slot `field` (non-NULL, and b's version is at least the one
 * that added it). */
#define ANNEAL_BACKEND_SLOT(b, field, since) ((b)->version >= (since) && (b)->field != NULL)

/* Installs the table for its device, replacing any earlier one (the built-in tables
 * are registered before the first caller's, so a caller's table replaces a built-in
 * one, never the other way round). ANNEAL_ERR_ARG, with a message naming what is
 * wrong, for a table without the version 1 essentials (name, alloc, free, copies,
 * synchronize, copy, fill), of a newer version than this build knows, or with a device
 * id outside [0, ANNEAL_DEVICE_COUNT). The table must outlive its use. */
anneal_status anneal_backend_register(const anneal_backend *b);
/* The backend for device d: the built-in ones are registered on first use (through
 * src/backends/registry.c). NULL with ANNEAL_ERR_DEVICE set when this build has none. */
const anneal_backend *anneal_backend_get(anneal_device d);
/* True when b (non-NULL) has a kernel for q: supports_op, or, without it, the slot
 * is present. */
bool anneal_backend_supports(const anneal_backend *b, const anneal_op_query *q);
/* Waits for device d's queued work; returns its first deferred error. */
anneal_status anneal_device_synchronize(anneal_device d);
/* Registers the library's built-in backends, one anneal_backend_register each. Defined
 * by the library's backend registry (src/backends/registry.c), not by core: core calls
 * it once, on the first lookup of a device that has no table yet. */
void anneal_backends_register_builtin(void);

/* ------------------------------------------------- the CPU's kernel dispatch */

/* One row of the CPU backend's dispatch report: a kernel family, the path its next call
 * takes on this machine under the ISA limit in force, and why that one. */
typedef struct anneal_cpu_kernel_info {
    const char *family; /* "gemm f32", "gemm bf16", ... */
    const char *path;   /* "portable", "avx2", "avx512", "avx512bf16", "avx512vnni" */
    char why[200];
} anneal_cpu_kernel_info;

/* Fills rows[0 .. max) with the report (running no kernel); returns the number of rows
 * there are (which may exceed max). */
int anneal_cpu_kernel_report(anneal_cpu_kernel_info *rows, int max);
/* The CPU's model name from /proc/cpuinfo ("unknown" where there is none) into buf. */
const char *anneal_cpu_model_name(char *buf, size_t n);
/* The ISA features the kernels look for, as "avx2 yes, fma yes, ..." into buf. */
void anneal_cpu_features_line(char *buf, size_t n);
/* The ISA limit in force: "best" when ANNEAL_ISA (or ANNEAL_CPU_ISA) is unset, else the
 * level; NULL when the variable holds no level, with *error set to a message. */
const char *anneal_cpu_isa_limit_name(const char **error);
/* True when the CPU has AMX-BF16 tiles, the OS enables their state and Linux granted this
 * process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once); the bf16 GEMM then
 * runs on the tiles (unless ANNEAL_ISA caps it below amx). */
bool anneal_cpu_amx_usable(void);
/* True when bf16 products (GEMM, attention) should run VDPBF16PS where AMX does not take
 * them: the CPU has AVX-512 and AVX512-BF16, and either ANNEAL_ISA names avx512bf16 (forced,
 * for comparisons) or it is unset/amx and the CPU is not an Intel core. Intel cores issue
 * VDPBF16PS at half the rate of f32 FMA, so there bf16 runs on the f32 kernels over operands
 * rounded to bf16 (the same products, summed in f32 one at a time). Fixed for a process, so
 * a run gives the same bits twice. */
bool anneal_cpu_bf16_dot_preferred(void);
/* The AMX peak microbenchmark: `iters` rounds of four independent TDPBF16PS (16384 FLOPs
 * each) on this thread; returns a value that depends on the results. Only where
 * anneal_cpu_amx_usable(). */
float anneal_cpu_amx_peak_loop(int64_t iters);

#ifdef __cplusplus
}
#endif
#endif
