/* anneal nn: named parameters (Hugging Face compatible names) held in one
 * long-lived scope, and the building blocks models are written with. */
#ifndef ANNEAL_NN_H
#define ANNEAL_NN_H

#include "anneal/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the forward passes of a model's blocks run with: the matrix-product precision
 * (see anneal_dense) and whether dropout is on. Models hold one and hand it to their
 * blocks; there is no global or thread-local setting. */
/* Tensor parallelism as the blocks see it (Megatron-LM): this model is rank `rank` of a
 * group of `size` and holds 1/size of the attention heads and of the MLP width.
 * copy_in is Megatron's f (identity forward, the gradient summed over the group
 * backward), put before the column-parallel projections; reduce_out is g (the sum over
 * the group forward, identity backward), after the row-parallel ones. The parallel
 * layer makes them (anneal_tp_nn in parallel.h); user is handed back to both. */
typedef struct anneal_nn_tp {
    int rank, size;
    anneal_tensor *(*copy_in)(void *user, anneal_tensor *x);
    anneal_tensor *(*reduce_out)(void *user, anneal_tensor *x);
    /* The vocabulary split: this rank holds rows [lo, lo + rows) of the token embedding.
     * vocab_embed: the lookup of ids summed over the group (rows outside give zeros);
     * vocab_loss: the mean cross-entropy from this rank's columns of the logits (the
     * softmax's max and sum over the group), targets == ignore_index skipped. */
    anneal_tensor *(*vocab_embed)(void *user, anneal_tensor *weight, anneal_tensor *ids, int64_t lo);
    anneal_tensor *(*vocab_loss)(void *user, anneal_tensor *logits, anneal_tensor *targets, int64_t lo,
                                 int32_t ignore_index);
    /* vocab_gather: the whole (..., V) logits from every rank's (..., V/N) columns, in
     * rank order (inference: no gradient flows back). NULL: not available. */
    anneal_tensor *(*vocab_gather)(void *user, anneal_tensor *logits);
    void *user;
    /* ctx.deterministic (parallel's tp_det.c): a column-parallel projection (outputs in
     * `parts` segments of `chunks` chunks each on this rank) and a row-parallel one
     * (inputs in `chunks` chunks) computed per chunk, the cross-chunk sums in one fixed
     * tree over the group; they replace copy_in / reduce_out. NULL: not available. */
    anneal_tensor *(*det_col)(void *user, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                              anneal_weight_layout layout, int parts, int chunks, anneal_dtype compute);
    anneal_tensor *(*det_row)(void *user, anneal_tensor *x, anneal_tensor *w, anneal_weight_layout layout, int chunks,
                              anneal_dtype compute);
} anneal_nn_tp;

typedef struct anneal_nn_ctx {
    anneal_dtype compute; /* ANNEAL_F32 (0), ANNEAL_BF16 or ANNEAL_F16 */
    bool training;        /* dropout on */
    anneal_dtype kv_dtype; /* storage of the KV caches the model makes: ANNEAL_F32 (0), ANNEAL_BF16 or ANNEAL_I8 */
    const anneal_nn_tp *tp; /* tensor parallelism of a model made with cfg.tp_size > 1 (NULL: none) */
    bool deterministic;     /* --deterministic: the blocks' projections through tp->det_col/det_row (any tp_size) */
} anneal_nn_ctx;

/* One trainable tensor with its hierarchical name ("transformer.h.0.ln_1.weight"). */
typedef struct anneal_param {
    char *name;
    anneal_tensor *tensor; /* f32 leaf, requires_grad while trainable (a frozen dense weight may be bf16) */
    bool decay;            /* receives weight decay (matmul weights, not biases/norms/embeddings) */
    bool trainable;        /* false: frozen (no grad, no optimizer state; LoRA's base weights) */
} anneal_param;

struct anneal_nn_dense;
struct anneal_nn_lora;
struct anneal_nn_quant;

/* A dense layer created in the set through anneal_nn_dense_create, with the prefix it
 * was created under ("transformer.h.0.attn.c_attn"): what LoRA targets by name. */
typedef struct anneal_params_dense {
    char *prefix;
    struct anneal_nn_dense *dense; /* the caller's block: must stay at this address while the set lives */
    struct anneal_nn_lora *lora;   /* its adapter (owned by the set), or NULL */
    struct anneal_nn_quant *quant; /* its int8 weight or calibration state (owned by the set), or NULL */
} anneal_params_dense;

/* The LoRA settings a set's adapters were made with (see anneal_lora_apply). */
typedef struct anneal_params_lora {
    int rank;             /* 0: no adapters */
    float alpha, dropout;
    char *targets;        /* comma-separated last name components, as given */
} anneal_params_lora;

/* The parameters of a model, in registration order, owning their tensors. */
typedef struct anneal_params {
    int n, cap;
    anneal_param *items;
    anneal_scope *scope; /* holds every parameter tensor */
    anneal_device device; /* where anneal_params_create puts them */
    int n_dense, cap_dense;
    anneal_params_dense *dense; /* the dense layers, in creation order */
    anneal_params_lora lora;
    anneal_quant_mode quant;   /* ANNEAL_QUANT_NONE, or how the set's dense layers were quantized */
    int64_t quant_group;       /* weight-only group size (0: per output channel) */
    struct anneal_nn_quant *head; /* the lm head's int8 weight (anneal_nn_quantize_head), or NULL */
    bool packed_bf16;          /* dense weights replaced by bf16 panels (anneal_params_pack_bf16): inference only */
} anneal_params;

/* Empty parameter set whose parameters live on the CPU (NULL + error on OOM). */
anneal_params *anneal_params_new(void);
/* The same on device dev. */
anneal_params *anneal_params_new_on(anneal_device dev);
/* Frees the set and every parameter tensor (and its grad). */
void anneal_params_free(anneal_params *ps);
/* Creates an f32 parameter of `shape` named `name` (zero-filled) on the set's device,
 * registers it, marks it requires_grad. Fails on a duplicate name. */
anneal_tensor *anneal_params_create(anneal_params *ps, const char *name, int ndim,
                                    const int64_t *shape, bool decay);
/* While on (this thread), anneal_params_create makes tensors without storage (shape
 * only; anneal_tensor_set_storage gives them some) and the initialisers below skip such
 * tensors, advancing the generator by what they would have drawn: a pipeline stage
 * (--pp) builds the whole model's parameters, gives its own storage and initialises,
 * and those get the bits a whole model's initialisation gives them. */
void anneal_params_defer_storage(bool on);
/* The parameter called name, or NULL (no error recorded). */
anneal_param *anneal_params_find(const anneal_params *ps, const char *name);
/* Total number of elements over all parameters. */
int64_t anneal_params_numel(const anneal_params *ps);
/* Drops every gradient (set to none). */
void anneal_params_zero_grad(anneal_params *ps);
/* Marks p trainable (requires_grad) or frozen (no grad: its gradient is dropped, the
 * optimizers skip it and keep no state for it). */
anneal_status anneal_params_set_trainable(anneal_params *ps, anneal_param *p, bool trainable);
/* Elements over the trainable parameters. */
int64_t anneal_params_numel_trainable(const anneal_params *ps);
/* FNV-1a 64 over the names, shapes and f32 values (bf16 ones widened) of the
 * parameters, in order; frozen_only: of the frozen ones only. 0 and an error when a
 * value cannot be read. Identifies the base weights a LoRA run was made on. */
uint64_t anneal_params_fingerprint(const anneal_params *ps, bool frozen_only);
/* Records d, created under prefix, as a dense layer of the set (anneal_nn_dense_create
 * does it). ANNEAL_ERR_OOM. */
anneal_status anneal_params_add_dense(anneal_params *ps, const char *prefix, struct anneal_nn_dense *d);
/* Replaces parameter p's tensor by t (same shape; e.g. a bf16 copy of a frozen weight),
 * taking t into the set's scope and releasing the old one. Blocks holding the old
 * pointer must be updated by the caller. */
anneal_status anneal_params_replace(anneal_params *ps, anneal_param *p, anneal_tensor *t);
/* For an inference-only model on the CPU: every dense layer of the set with an f32
 * weight (no LoRA adapter, not int8, not "lm_head": see anneal_nn_quant_skips) gets its weight as bf16 panels (d->panels, the
 * layout the decode engine reads: anneal_gemv_pack_panels_bf16), and the f32 weight is
 * released (a stride-0 view of one zero of its shape stands in, as for int8 weights), one
 * layer at a time, the allocator's cache given back to the system at the end: the weights'
 * memory halves, and a peak never holds both copies of more than one layer. The forward
 * of such a layer is anneal_panels_linear (no backward); the set is marked packed_bf16,
 * and what needs the float weights (training, checkpoints, exports, LoRA, int8
 * quantization) refuses it. No-op for a set packed already. */
anneal_status anneal_params_pack_bf16(anneal_params *ps);
/* ANNEAL_ERR_UNSUPPORTED naming `what` when ps holds packed bf16 weights (see above),
 * else ANNEAL_OK. */
anneal_status anneal_params_require_float(const anneal_params *ps, const char *what);

/* In-place initialisers (no autograd), drawing from the global Philox generator. */
anneal_status anneal_init_normal_(anneal_tensor *t, float mean, float std);
anneal_status anneal_init_fill_(anneal_tensor *t, float value);
/* U(lo, hi) from the global Philox generator (one counter per 4 elements, 24-bit
 * uniforms), host-side then copied to t's device. PEFT's kaiming-uniform LoRA A is
 * U(-1/sqrt(in), 1/sqrt(in)). */
anneal_status anneal_init_uniform_(anneal_tensor *t, float lo, float hi);

/* ==================================================================== blocks
 *
 * The pieces decoder-only models are built from (as llama.cpp's build_norm,
 * build_attn, build_ffn). Each is a small struct filled by its create function, which
 * registers the block's parameters in an anneal_params under Hugging Face names
 * ("<prefix>.weight", "<prefix>.bias"; prefix as "transformer.h.0.attn.c_attn"), and a
 * forward taking the model's anneal_nn_ctx (matrix-product precision, training mode).
 * Parameters start zero-filled: a model's init sets them. Forwards return tensors of
 * the current scope and propagate NULL like every op. A create that fails records the
 * error and returns it (the parameters already registered stay in the set, which the
 * model frees). */

/* ------------------------------------------------------------------ dense */

/* A LoRA adapter of a dense layer (PEFT's LoraLayer): y += scale * (dropout(x) A^T) B^T. */
typedef struct anneal_nn_lora {
    anneal_tensor *a; /* (rank, in): "<prefix>.lora_A.weight", kaiming-uniform */
    anneal_tensor *b; /* (out, rank): "<prefix>.lora_B.weight", zero at creation */
    int rank;
    float alpha, scale; /* scale = alpha / rank */
    float dropout;      /* on the adapter's input while training */
} anneal_nn_lora;

/* A dense (fully connected) layer: y = x W (+ b), W in either layout, plus an optional
 * LoRA adapter. */
typedef struct anneal_nn_dense {
    anneal_tensor *weight; /* (out, in) for ANNEAL_WEIGHT_OUT_IN, (in, out) for IN_OUT; f32, or bf16 when frozen */
    anneal_tensor *bias;   /* (out), or NULL */
    anneal_weight_layout layout;
    int64_t in, out;
    anneal_nn_lora *lora;  /* NULL: none (owned by the parameter set) */
    struct anneal_nn_quant *quant; /* NULL: none; int8 weight or calibration (owned by the set) */
    anneal_tensor *panels; /* NULL, or the weight as bf16 panels (anneal_params_pack_bf16; weight then stands in) */
} anneal_nn_dense;

/* Registers "<prefix>.weight" (weight decay on) and, with bias, "<prefix>.bias", and
 * records d under prefix in ps (so anneal_lora_apply can find it: d must stay at its
 * address while ps lives). */
anneal_status anneal_nn_dense_create(anneal_nn_dense *d, anneal_params *ps, const char *prefix, int64_t in,
                                     int64_t out, anneal_weight_layout layout, bool bias);
/* x (..., in) -> x W + b (..., out), one GEMM at ctx->compute. */
anneal_tensor *anneal_nn_dense_forward(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x);
/* The same with act fused into the GEMM's epilogue (ANNEAL_ACT_SILU_MUL multiplies by mul,
 * shaped like the output; NULL otherwise). With a LoRA adapter: act(x W + b + scale *
 * (dropout(x) A^T) B^T), the activation then a pass of its own. */
anneal_tensor *anneal_nn_dense_forward_act(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                           anneal_activation act, anneal_tensor *mul);

/* ------------------------------------------------------------------- LoRA */

/* What anneal_lora_apply adds (PEFT's LoraConfig). */
typedef struct anneal_lora_config {
    int rank;                    /* r > 0 */
    float alpha;                 /* lora_alpha > 0; scale = alpha / rank */
    float dropout;               /* lora_dropout in [0, 1) */
    const char *const *targets;  /* last name components ("q_proj", "c_attn") */
    int n_targets;
    anneal_dtype base_dtype;     /* frozen dense weights: ANNEAL_F32 (0) or ANNEAL_BF16 (half the memory) */
} anneal_lora_config;

/* Adds an adapter to every dense layer of ps whose prefix's last component is a target
 * ("<prefix>.lora_A.weight" (rank, in) U(-1/sqrt(in), 1/sqrt(in)) from the global
 * generator in creation order, "<prefix>.lora_B.weight" (out, rank) zero; trainable,
 * weight decay on) and freezes every other parameter; with base_dtype BF16 the frozen
 * dense weights are stored in bf16 (the blocks updated; not "lm_head", which the fused
 * loss reads in f32, and which cannot be a target: ANNEAL_ERR_UNSUPPORTED). A target that matches no dense
 * layer is ANNEAL_ERR_ARG naming it and the layers' names; a set with adapters already,
 * bad rank/alpha/dropout too. */
anneal_status anneal_lora_apply(anneal_params *ps, const anneal_lora_config *cfg);
/* Folds every adapter into its base weight, W += scale * B A (the (in, out) layout:
 * W += (scale * B A)^T, PEFT's fan_in_fan_out), in f32 on the host, then removes the
 * adapters from the set and makes every parameter trainable again: the set is the
 * merged plain model (PEFT's merge_and_unload). Base weights must be f32. */
anneal_status anneal_lora_merge(anneal_params *ps);
/* Number of dense layers of ps with an adapter. */
int anneal_lora_count(const anneal_params *ps);
/* x (..., in) -> scale * (dropout(x) A^T) B^T (..., out), at ctx's precision. */
anneal_tensor *anneal_nn_lora_forward(const anneal_nn_lora *l, const anneal_nn_ctx *ctx, anneal_tensor *x);

/* ------------------------------------------------------------------- int8 */

/* A dense layer's int8 weight (anneal_nn_quantize), or, before it, the calibration
 * statistics of its input (static quantization). While active, the layer's forward is
 * anneal_qlinear(x, weight, scale, bias) (then the activation as its own op), and the
 * f32 weight parameter is released (a stride-0 zero view of its shape stays). */
typedef struct anneal_nn_quant {
    bool active;              /* the int8 weight is in use */
    anneal_quant_mode mode;
    int64_t group;            /* weight-only group size, 0: per output channel */
    anneal_tensor *weight;    /* (out, in) i8, whatever the layer's layout */
    anneal_tensor *scale;     /* f32 (out) or (out, in / group) */
    float act_scale;          /* static: the input's scale */
    /* calibration: |x| seen so far (static) */
    bool observing;
    double count;             /* values seen */
    float amax;
    float hist_hi;            /* the histogram covers [0, hist_hi) in ANNEAL_NN_QUANT_BINS bins */
    double *hist;
} anneal_nn_quant;

#define ANNEAL_NN_QUANT_BINS 4096

/* How anneal_nn_calibrate_end turns the statistics into a scale. */
typedef enum anneal_calib_method {
    ANNEAL_CALIB_MINMAX = 0, /* scale = max |x| / 127 (torch MinMaxObserver, symmetric [-127, 127]) */
    ANNEAL_CALIB_PERCENTILE, /* scale = the percentile-th |x| (histogram bin edge) / 127 */
} anneal_calib_method;

/* True for the dense layers quantization leaves alone: "lm_head" (the fused lm-head
 * loss reads its weight itself, as for LoRA). */
bool anneal_nn_quant_skips(const char *prefix);
/* Starts recording the inputs of every dense layer of ps that quantization covers
 * (their forwards stay f32). ANNEAL_ERR_STATE when the set is quantized already. */
anneal_status anneal_nn_calibrate_begin(anneal_params *ps);
/* Ends recording: each layer's static scale from its statistics. ANNEAL_ERR_STATE for
 * a layer that saw no input, ANNEAL_ERR_ARG for a percentile outside (0, 100]. */
anneal_status anneal_nn_calibrate_end(anneal_params *ps, anneal_calib_method method, double percentile);
/* Quantizes every dense layer of ps but lm_head: the weight to int8 with per-output-
 * channel (group 0) or, weight-only, per-group scales (group divides in-features:
 * ANNEAL_ERR_SHAPE naming the layer otherwise); static needs anneal_nn_calibrate_end
 * first. The f32 weights are released. Refused (ANNEAL_ERR_UNSUPPORTED) on a set with
 * LoRA adapters or bf16 weights, ANNEAL_ERR_STATE when quantized already. */
anneal_status anneal_nn_quantize(anneal_params *ps, anneal_quant_mode mode, int64_t group);
/* Gives the dense layer pd of ps a quantized weight read from a file (the reader's
 * path): weight (out, in) i8 and scale as anneal_nn_quant says, act_scale for static;
 * every dtype and shape checked (errors name the layer). Releases the f32 weight. */
anneal_status anneal_nn_quant_attach(anneal_params *ps, anneal_params_dense *pd, anneal_quant_mode mode,
                                     int64_t group, anneal_tensor *weight, anneal_tensor *scale, float act_scale);
/* The lm head (w: (vocab, C) f32, the head's weight or the tied embedding, which stays
 * f32 for the lookup) quantized per row to int8 and kept as ps->head, after
 * anneal_nn_quantize: weight-only products for a weight-only set, per-token dynamic
 * ones for a dynamic or static set (no input scale is calibrated for the head).
 * ANNEAL_ERR_STATE when ps is not quantized or its head is already. */
anneal_status anneal_nn_quantize_head(anneal_params *ps, anneal_tensor *w);
/* The reader's path: the head's int8 weight (vocab, C) and scales (vocab) f32 (each
 * checked), with mode WEIGHT_ONLY or DYNAMIC. */
anneal_status anneal_nn_quant_head_attach(anneal_params *ps, anneal_quant_mode mode, anneal_tensor *weight,
                                          anneal_tensor *scale);
/* Logits h (..., C) -> (..., vocab) through ps->head (which must be set). */
anneal_tensor *anneal_nn_quant_head_forward(const anneal_params *ps, const anneal_nn_ctx *ctx, anneal_tensor *h);
/* The mean cross-entropy (anneal_cross_entropy's) of the logits of h (..., C) through
 * ps->head against targets (...), in chunks of 256 rows so that no (rows, vocab) logits
 * are made at once; a 0-dim f32 tensor, no autograd (inference only). */
anneal_tensor *anneal_nn_quant_head_loss(const anneal_params *ps, const anneal_nn_ctx *ctx, anneal_tensor *h,
                                         anneal_tensor *targets, int32_t ignore_index);
/* "weight-only", "dynamic", "static" (NULL otherwise); the parser (false if unknown). */
const char *anneal_quant_mode_name(anneal_quant_mode mode);
bool anneal_quant_mode_parse(const char *name, anneal_quant_mode *out);

/* -------------------------------------------------------------- embedding */

/* A lookup table of n rows of width dim. */
typedef struct anneal_nn_embedding {
    anneal_tensor *weight; /* (n, dim) */
} anneal_nn_embedding;

/* Registers "<prefix>.weight" (no weight decay). */
anneal_status anneal_nn_embedding_create(anneal_nn_embedding *e, anneal_params *ps, const char *prefix, int64_t n,
                                         int64_t dim);
/* Rows of the table for i32 ids (...): (..., dim). */
anneal_tensor *anneal_nn_embedding_forward(const anneal_nn_embedding *e, anneal_tensor *ids);

/* ------------------------------------------------------------------ norms */

/* LayerNorm over the last dim with weight and (optional) bias. */
typedef struct anneal_nn_layer_norm {
    anneal_tensor *weight, *bias; /* (dim); bias NULL when created without */
    float eps;
} anneal_nn_layer_norm;

/* Registers "<prefix>.weight" and, with bias, "<prefix>.bias" (no weight decay). */
anneal_status anneal_nn_layer_norm_create(anneal_nn_layer_norm *n, anneal_params *ps, const char *prefix,
                                          int64_t dim, float eps, bool bias);
anneal_tensor *anneal_nn_layer_norm_forward(const anneal_nn_layer_norm *n, anneal_tensor *x);
/* The residual add and this norm in one pass: *sum = x + r (the new residual stream),
 * returns LayerNorm(*sum). */
anneal_tensor *anneal_nn_add_layer_norm(const anneal_nn_layer_norm *n, anneal_tensor *x, anneal_tensor *r,
                                        anneal_tensor **sum);

/* RMSNorm over the last dim with a weight (Llama). */
typedef struct anneal_nn_rms_norm {
    anneal_tensor *weight; /* (dim) */
    float eps;
} anneal_nn_rms_norm;

/* Registers "<prefix>.weight" (no weight decay). */
anneal_status anneal_nn_rms_norm_create(anneal_nn_rms_norm *n, anneal_params *ps, const char *prefix, int64_t dim,
                                        float eps);
anneal_tensor *anneal_nn_rms_norm_forward(const anneal_nn_rms_norm *n, anneal_tensor *x);

/* --------------------------------------------------------------- KV cache */

/* The key/value cache of generation: per layer, the keys and values of every position
 * seen so far in (batch, n_kv_head, max_len, head_dim) buffers, so a new token costs
 * one position of attention. The attention block writes a layer's new rows at
 * positions [len, len + T_new); the model advances len once every layer has. This is
 * the anneal_kv_cache of the model interface (model.h). */
typedef struct anneal_kv_cache anneal_kv_cache;

/* A zero-length cache on device dev for n_layer layers (>= 0) of batch sequences of up
 * to max_len positions; owner tags the model it belongs to (checked by the model).
 * NULL + ANNEAL_ERR_ARG for non-positive sizes, ANNEAL_ERR_OOM. */
anneal_kv_cache *anneal_kv_cache_new(anneal_device dev, int n_layer, int64_t batch, int64_t n_kv_head,
                                     int64_t head_dim, int64_t max_len, const void *owner);
void anneal_kv_cache_free(anneal_kv_cache *kv);
/* Forgets every position. */
void anneal_kv_cache_reset(anneal_kv_cache *kv);
/* Positions cached so far (0 for NULL). */
int64_t anneal_kv_cache_len(const anneal_kv_cache *kv);
int64_t anneal_kv_cache_batch(const anneal_kv_cache *kv);
int64_t anneal_kv_cache_max_len(const anneal_kv_cache *kv);
const void *anneal_kv_cache_owner(const anneal_kv_cache *kv);
/* Copies k and v (batch, n_kv_head, T_new, head_dim) of layer into positions
 * [len, len + T_new) (ANNEAL_ERR_SHAPE past max_len or for other shapes). */
anneal_status anneal_kv_cache_write(anneal_kv_cache *kv, int layer, anneal_tensor *k, anneal_tensor *v);
/* Views (batch, n_kv_head, n, head_dim) of the first n positions of layer's keys / values. */
anneal_tensor *anneal_kv_cache_keys(anneal_kv_cache *kv, int layer, int64_t n);
anneal_tensor *anneal_kv_cache_values(anneal_kv_cache *kv, int layer, int64_t n);
/* len += n (ANNEAL_ERR_SHAPE past max_len). */
anneal_status anneal_kv_cache_advance(anneal_kv_cache *kv, int64_t n);

/* Slots: the batch rows of a cache are independent sequences, each with its own length
 * (continuous batching). With ragged lengths, anneal_kv_cache_len is the longest and
 * whole-batch writes / advances are refused (ANNEAL_ERR_ARG). */
/* The same as anneal_kv_cache_new with the storage dtype: ANNEAL_F32, ANNEAL_BF16 or
 * ANNEAL_I8 (int8: one f32 scale per slot, head and position, scale = max|x| / 127 of
 * that head's D values, round to nearest). bf16 and int8 on the CPU only. */
anneal_kv_cache *anneal_kv_cache_new_dtype(anneal_device dev, int n_layer, int64_t batch, int64_t n_kv_head,
                                           int64_t head_dim, int64_t max_len, anneal_dtype dtype, const void *owner);
anneal_dtype anneal_kv_cache_dtype(const anneal_kv_cache *kv);
/* Bytes of the key/value buffers (and int8 scales) over every layer. */
int64_t anneal_kv_cache_bytes(const anneal_kv_cache *kv);
/* Number of slots (the batch it was made with, whatever the focus). */
int64_t anneal_kv_cache_slots(const anneal_kv_cache *kv);
/* True when every slot holds the same number of positions (or one slot is focused). */
bool anneal_kv_cache_uniform(const anneal_kv_cache *kv);
/* Empties one slot (length 0); out-of-range slots are ignored. */
void anneal_kv_cache_slot_reset(anneal_kv_cache *kv, int64_t slot);
/* Positions cached in slot (0 out of range). */
int64_t anneal_kv_cache_slot_len(const anneal_kv_cache *kv, int64_t slot);
/* slot's length += n (ANNEAL_ERR_ARG past max_len or out of range). */
anneal_status anneal_kv_cache_slot_advance(anneal_kv_cache *kv, int64_t slot, int64_t n);
/* Makes len, batch (1), reset, write, keys, values and advance act on slot alone, as a
 * cache of batch 1 (slot -1: the whole batch again). ANNEAL_ERR_ARG out of range. */
anneal_status anneal_kv_cache_focus(anneal_kv_cache *kv, int64_t slot);
/* The raw storage of one layer, for decode kernels: k and v (slots, n_kv_head, max_len,
 * head_dim) of dtype, row-major; int8 scales (slots, n_kv_head, max_len). */
typedef struct anneal_kv_cache_layer {
    void *k, *v;
    float *k_scale, *v_scale; /* int8 only, else NULL */
    anneal_dtype dtype;
    int64_t n_kv_head, head_dim, max_len;
} anneal_kv_cache_layer;
anneal_status anneal_kv_cache_raw(anneal_kv_cache *kv, int layer, anneal_kv_cache_layer *out);
/* State a decode engine keeps with the cache (workspace): freed with aux_free when the
 * cache is freed or another is set. */
void *anneal_kv_cache_aux(const anneal_kv_cache *kv);
void anneal_kv_cache_set_aux(anneal_kv_cache *kv, void *aux, void (*aux_free)(void *));

/* -------------------------------------------------------------- attention */

/* Causal self-attention: query/key/value projections (one packed projection, as GPT-2's
 * c_attn, or three, as Llama's q_proj/k_proj/v_proj), grouped-query heads (n_kv_head
 * divides n_head), optional rotary position embedding, and the output projection. */
typedef struct anneal_nn_attention_config {
    int64_t n_embd;               /* input and output width */
    int n_head;                   /* query heads */
    int n_kv_head;                /* key/value heads; 0: n_head */
    int64_t head_dim;             /* 0: n_embd / n_head */
    anneal_weight_layout layout;  /* of every projection's weight */
    bool qkv_bias, out_bias;      /* biases of the q/k/v projections, of the output projection */
    const char *qkv_name;         /* packed projection ("c_attn"); NULL: three projections */
    const char *q_name, *k_name, *v_name; /* the three ("q_proj", "k_proj", "v_proj") */
    const char *out_name;         /* output projection ("c_proj", "o_proj") */
    const anneal_rope_desc *rope; /* NULL: no rotary embedding (copied by create) */
} anneal_nn_attention_config;

typedef struct anneal_nn_attention {
    int n_head, n_kv_head;
    int64_t head_dim;
    bool packed;
    anneal_nn_dense qkv;     /* packed: (n_embd) -> (n_head + 2 n_kv_head) head_dim, queries first */
    anneal_nn_dense q, k, v; /* separate: n_head head_dim, n_kv_head head_dim, n_kv_head head_dim */
    anneal_nn_dense out;     /* n_head head_dim -> n_embd */
    bool has_rope;
    anneal_rope_desc rope;
} anneal_nn_attention;

/* Registers the projections under "<prefix>.<name>.weight/.bias": the packed one (or q,
 * k, v in that order), then the output projection. ANNEAL_ERR_ARG for inconsistent
 * head counts or missing names. */
anneal_status anneal_nn_attention_create(anneal_nn_attention *a, anneal_params *ps, const char *prefix,
                                         const anneal_nn_attention_config *cfg);
/* The attention of x (B, T, n_embd) before the output projection: (B, T, n_head
 * head_dim). kv NULL: causal self-attention over x's own positions (training). kv
 * given: x's rows are the positions after the cached ones; their keys and values are
 * written to layer's slots of kv at [len, len + T) (rotated first with RoPE) and the
 * queries attend to [0, len + T) (generation; no autograd wanted). */
anneal_tensor *anneal_nn_attention_core(const anneal_nn_attention *a, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                        anneal_kv_cache *kv, int layer);
/* The output projection of core's result att (B, T, n_head head_dim): out(att), saving
 * att in f32 (attention keeps it in f32 for its own backward) at any compute. */
anneal_tensor *anneal_nn_attention_out(const anneal_nn_attention *a, const anneal_nn_ctx *ctx, anneal_tensor *att);
/* out(core(x)): (B, T, n_embd). */
anneal_tensor *anneal_nn_attention_forward(const anneal_nn_attention *a, const anneal_nn_ctx *ctx,
                                           anneal_tensor *x, anneal_kv_cache *kv, int layer);

/* -------------------------------------------------------------------- MLP */

typedef enum anneal_nn_mlp_kind {
    ANNEAL_MLP_GELU = 0, /* proj(gelu_tanh(fc x)): GPT-2's, fc + GELU in one GEMM */
    ANNEAL_MLP_SWIGLU,   /* down(silu(gate x) * up x): Llama's, gate + SiLU * up in one GEMM */
} anneal_nn_mlp_kind;

typedef struct anneal_nn_mlp {
    anneal_nn_mlp_kind kind;
    anneal_nn_dense fc, proj;       /* GELU: "<prefix>.c_fc", "<prefix>.c_proj" */
    anneal_nn_dense gate, up, down; /* SWIGLU: "<prefix>.gate_proj", ".up_proj", ".down_proj" */
} anneal_nn_mlp;

/* GELU MLP n_embd -> n_ff -> n_embd: registers "<prefix>.<fc_name>" then
 * "<prefix>.<proj_name>" (weights and, with bias, biases). */
anneal_status anneal_nn_mlp_create_gelu(anneal_nn_mlp *m, anneal_params *ps, const char *prefix, int64_t n_embd,
                                        int64_t n_ff, anneal_weight_layout layout, bool bias, const char *fc_name,
                                        const char *proj_name);
/* SwiGLU MLP: registers "<prefix>.gate_proj", ".up_proj", ".down_proj". */
anneal_status anneal_nn_mlp_create_swiglu(anneal_nn_mlp *m, anneal_params *ps, const char *prefix, int64_t n_embd,
                                          int64_t n_ff, anneal_weight_layout layout, bool bias);
/* x (..., n_embd) -> (..., n_embd). */
anneal_tensor *anneal_nn_mlp_forward(const anneal_nn_mlp *m, const anneal_nn_ctx *ctx, anneal_tensor *x);

#ifdef __cplusplus
}
#endif
#endif
