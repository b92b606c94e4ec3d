/* ONNX graphs in memory: a small builder (nodes, initializers that are anneal tensors,
 * graph inputs and outputs with symbolic dims) that the nn blocks describe themselves
 * in, that each architecture assembles into its forward graph (src/models/gpt2_onnx.c, llama_onnx.c,
 * reached through the model interface's optional onnx_graph op), and that io writes as
 * an ONNX ModelProto (include/anneal/io.h: anneal_onnx_save, anneal_model_save_onnx).
 *
 * Errors propagate like NaN: every builder call returns the name of the value it made
 * (owned by the graph, valid until anneal_onnx_graph_free), or NULL once anything has
 * failed; a call given a NULL input returns NULL without work. The first error is kept
 * (anneal_onnx_graph_status) and also recorded with anneal_set_error.
 *
 * Initializers hold a reference to their tensor (any float dtype, any device: written
 * as f32, converted and, when asked, transposed by the writer), so a graph outlives the
 * scope it was built in. */
#ifndef ANNEAL_ONNX_H
#define ANNEAL_ONNX_H

#include "anneal/nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The operator set the graphs use (ai.onnx, default domain) and the IR version that
 * goes with it. */
#define ANNEAL_ONNX_OPSET 17
#define ANNEAL_ONNX_IR_VERSION 8

/* ONNX TensorProto.DataType values of the element types the graphs use. */
typedef enum anneal_onnx_elem {
    ANNEAL_ONNX_FLOAT = 1,
    ANNEAL_ONNX_INT64 = 7,
    ANNEAL_ONNX_BOOL = 9,
} anneal_onnx_elem;

/* One node attribute: kind 'i' (int), 'f' (float), 'I' (ints: n values at ints). */
typedef struct anneal_onnx_attr {
    const char *name;
    char kind;
    int64_t i;
    float f;
    const int64_t *ints;
    int n;
} anneal_onnx_attr;

#define ANNEAL_ONNX_ATTR_INT(nm, v) ((anneal_onnx_attr){.name = (nm), .kind = 'i', .i = (v)})
#define ANNEAL_ONNX_ATTR_FLOAT(nm, v) ((anneal_onnx_attr){.name = (nm), .kind = 'f', .f = (v)})
#define ANNEAL_ONNX_ATTR_INTS(nm, p, cnt) ((anneal_onnx_attr){.name = (nm), .kind = 'I', .ints = (p), .n = (cnt)})

typedef struct anneal_onnx_node_def {
    char *op_type, *name;
    int n_in, n_out;
    char **inputs, **outputs; /* "" is an omitted optional input */
    int n_attrs;
    anneal_onnx_attr *attrs;  /* names and ints owned by the graph */
} anneal_onnx_node_def;

typedef struct anneal_onnx_initializer {
    char *name;
    anneal_onnx_elem elem;
    int ndim;
    int64_t dims[ANNEAL_MAX_DIMS];
    anneal_tensor *tensor; /* FLOAT from a tensor (retained), or NULL: data below */
    bool transpose;        /* 2-D tensor stored transposed (dims are the stored ones) */
    void *data;            /* owned constant (INT64 / FLOAT) when tensor is NULL */
    size_t nbytes;
} anneal_onnx_initializer;

/* A graph input or output: dims[i] < 0 is symbolic, named dim_names[i]. */
typedef struct anneal_onnx_value {
    char *name;
    anneal_onnx_elem elem;
    int ndim;
    int64_t dims[ANNEAL_MAX_DIMS];
    char *dim_names[ANNEAL_MAX_DIMS];
} anneal_onnx_value;

typedef struct anneal_onnx_graph {
    char *name;
    int n_nodes, n_inits, n_inputs, n_outputs;
    anneal_onnx_node_def *nodes;
    anneal_onnx_initializer *inits;
    anneal_onnx_value *inputs, *outputs;
    char *doc;               /* free text written as the model's doc_string (or NULL) */
    /* builder state, not for users */
    int cap_nodes, cap_inits, cap_inputs, cap_outputs;
    int64_t counter;         /* makes value and node names unique */
    char prefix[160];        /* scope of the names made now ("model.layers.0.self_attn") */
    anneal_status status;    /* the first error, ANNEAL_OK while none */
    char **strings;          /* every other string the graph owns */
    int n_strings, cap_strings;
} anneal_onnx_graph;

/* An empty graph named name (NULL + ANNEAL_ERR_OOM). */
anneal_onnx_graph *anneal_onnx_graph_new(const char *name);
/* Frees the graph, its strings and its references to tensors. NULL is fine. */
void anneal_onnx_graph_free(anneal_onnx_graph *g);
/* ANNEAL_OK, or the first error of a builder call on g. */
anneal_status anneal_onnx_graph_status(const anneal_onnx_graph *g);
/* Records an error on g (kept if it is the first; anneal_set_error too); returns it. */
anneal_status anneal_onnx_graph_fail(anneal_onnx_graph *g, anneal_status s, const char *fmt, ...);
/* Sets the scope the next names are made in ("" for none; a readable graph). */
void anneal_onnx_set_prefix(anneal_onnx_graph *g, const char *fmt, ...);

/* Declares a graph input (its name is the value's name). dims < 0 are symbolic, named
 * by dim_names[i]. */
const char *anneal_onnx_input(anneal_onnx_graph *g, const char *name, anneal_onnx_elem elem, int ndim,
                              const int64_t *dims, const char *const *dim_names);
/* Declares value as the graph output called name (an Identity node when they differ). */
const char *anneal_onnx_output(anneal_onnx_graph *g, const char *value, const char *name, anneal_onnx_elem elem,
                               int ndim, const int64_t *dims, const char *const *dim_names);

/* A FLOAT initializer called name holding t (2-D t stored transposed when transpose).
 * A name already used refers to the same initializer (t must then be the same). */
const char *anneal_onnx_weight(anneal_onnx_graph *g, const char *name, anneal_tensor *t, bool transpose);
/* INT64 constants: a 1-D tensor of n values, or (scalar) one 0-D value. */
const char *anneal_onnx_ints(anneal_onnx_graph *g, int n, const int64_t *v);
const char *anneal_onnx_int_scalar(anneal_onnx_graph *g, int64_t v);
/* A FLOAT constant: 0-D (ndim 0) or shaped. */
const char *anneal_onnx_floats(anneal_onnx_graph *g, int ndim, const int64_t *dims, const float *v);
const char *anneal_onnx_float_scalar(anneal_onnx_graph *g, float v);

/* A node of op_type (default domain) with n_in inputs (NULL input: NULL result; "" an
 * omitted optional one) and n_out outputs whose new names go to out[]; returns out[0]. */
const char *anneal_onnx_node_n(anneal_onnx_graph *g, const char *op_type, int n_in, const char *const *in,
                               int n_out, const char **out, const anneal_onnx_attr *attrs, int n_attrs);
/* The same with one output. */
const char *anneal_onnx_node(anneal_onnx_graph *g, const char *op_type, int n_in, const char *const *in,
                             const anneal_onnx_attr *attrs, int n_attrs);
/* One- and two-input nodes without attributes. */
const char *anneal_onnx_op1(anneal_onnx_graph *g, const char *op_type, const char *a);
const char *anneal_onnx_op2(anneal_onnx_graph *g, const char *op_type, const char *a, const char *b);
/* Reshape of x to the constant shape (0 copies the input's dim, -1 infers one dim). */
const char *anneal_onnx_reshape(anneal_onnx_graph *g, const char *x, int n, const int64_t *shape);
/* Transpose of x by perm (n dims). */
const char *anneal_onnx_transpose(anneal_onnx_graph *g, const char *x, int n, const int64_t *perm);

/* ------------------------------------------------ the nn blocks as graphs */

/* What a decoder's attention layers share: the positions of the new rows, the additive
 * causal mask, the rotary tables gathered at the positions, and the cache inputs. */
typedef struct anneal_onnx_decoder {
    const char *ids;       /* input_ids (batch, sequence) int64 */
    const char *positions; /* (sequence) int64: past_len .. past_len + sequence - 1 */
    const char *mask;      /* (sequence, past_len + sequence) float: 0 where key j <= query i, -inf after */
    const char *rope_cos, *rope_sin; /* (sequence, head_dim / 2) float, or NULL without RoPE */
    bool kv_cache;
    int n_layer, n_kv_head;
    int64_t head_dim;
    const char **past_key, **past_value;       /* n_layer inputs past_key_values.N.key/.value */
    const char **present_key, **present_value; /* filled by the attention of layer N */
} anneal_onnx_decoder;

/* Declares input_ids (and, with kv_cache, past_key_values.N.key / .value (batch,
 * n_kv_head, past_sequence, head_dim) for each layer, named as Hugging Face Optimum
 * does) and builds the positions and the causal mask. With rope (cos and sin of every
 * position < n_ctx, see anneal_onnx_rope_tables), gathers its tables at the positions. */
anneal_status anneal_onnx_decoder_begin(anneal_onnx_graph *g, anneal_onnx_decoder *d, int n_layer, int n_kv_head,
                                        int64_t head_dim, bool kv_cache, const char *rope_cos_table,
                                        const char *rope_sin_table);
/* Declares logits (batch, sequence, vocab) and, with kv_cache, present.N.key / .value
 * (batch, n_kv_head, total_sequence, head_dim); frees d's arrays. */
anneal_status anneal_onnx_decoder_end(anneal_onnx_graph *g, anneal_onnx_decoder *d, const char *logits,
                                      int64_t vocab);
/* Frees d's arrays (after a failure; decoder_end does it otherwise). */
void anneal_onnx_decoder_free(anneal_onnx_decoder *d);

/* Adds initializers rope.cos and rope.sin (n_ctx, D/2): anneal's own rotary angles
 * (anneal_rope applied to a probe), so the graph rotates with exactly anneal's cos and
 * sin; names in *cos_name, *sin_name. */
anneal_status anneal_onnx_rope_tables(anneal_onnx_graph *g, const anneal_rope_desc *rope, int64_t n_ctx,
                                      int64_t head_dim, const char **cos_name, const char **sin_name);

/* x (..., in) -> x W + b (MatMul, Add). A dense with a LoRA adapter is refused
 * (ANNEAL_ERR_UNSUPPORTED: merge it first). */
const char *anneal_nn_dense_onnx(anneal_onnx_graph *g, const anneal_nn_dense *d, const char *x);
/* Rows of the table for int64 ids (Gather). */
const char *anneal_nn_embedding_onnx(anneal_onnx_graph *g, const anneal_nn_embedding *e, const char *ids);
/* LayerNormalization over the last dim. */
const char *anneal_nn_layer_norm_onnx(anneal_onnx_graph *g, const anneal_nn_layer_norm *n, const char *x);
/* x / sqrt(mean(x^2) + eps) * weight over the last dim (opset 17 has no RMSNorm op). */
const char *anneal_nn_rms_norm_onnx(anneal_onnx_graph *g, const anneal_nn_rms_norm *n, const char *x);
/* The MLP: c_proj(gelu_tanh(c_fc x)) or down(silu(gate x) * up x). */
const char *anneal_nn_mlp_onnx(anneal_onnx_graph *g, const anneal_nn_mlp *m, const char *x);
/* Causal (grouped-query) self-attention of layer `layer` on x (batch, sequence, n_embd),
 * RoPE when a has it, keys and values after d's past ones (present outputs recorded in
 * d), returns the output projection's result (batch, sequence, n_embd). */
const char *anneal_nn_attention_onnx(anneal_onnx_graph *g, const anneal_nn_attention *a, anneal_onnx_decoder *d,
                                     int layer, const char *x);
/* logits = h W^T for a (vocab, C) weight w (the tied embedding or an untied head) as
 * Gemm(transB) on (batch * sequence, C): no transposed copy of the table. */
const char *anneal_onnx_lm_head(anneal_onnx_graph *g, const char *h, const char *weight, int64_t n_embd);

#ifdef __cplusplus
}
#endif
#endif
