/* The nn blocks as ONNX graph pieces (include/anneal/onnx.h): dense, embedding,
 * LayerNorm, RMSNorm, the GELU and SwiGLU MLPs and the lm head, each the same
 * arithmetic as the block's forward (the weights are the block's own tensors). The
 * attention and the decoder's shared inputs are onnx_attention.c. */
#include "anneal/onnx.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* The parameter name of t, or a made-up one for an unnamed tensor. */
static const char *weight_name(const anneal_tensor *t, const char *fallback) {
    return t && t->name && t->name[0] ? t->name : fallback;
}

const char *anneal_nn_dense_onnx(anneal_onnx_graph *g, const anneal_nn_dense *d, const char *x) {
    if (!g || !x || g->status != ANNEAL_OK) return NULL;
    if (!d || !d->weight) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_ARG, "a dense layer without a weight");
        return NULL;
    }
    const char *wn = weight_name(d->weight, "dense.weight");
    if (d->lora) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_UNSUPPORTED,
                               "%s carries a LoRA adapter, which the exporter does not express: merge it first "
                               "(anneal lora merge) and export the merged model", wn);
        return NULL;
    }
    /* MatMul wants W as (in, out): Hugging Face's Conv1D layout as is; torch Linear's
     * (out, in) stored transposed, under the parameter's name + ".T" */
    const char *w;
    if (d->layout == ANNEAL_WEIGHT_IN_OUT) {
        w = anneal_onnx_weight(g, wn, d->weight, false);
    } else {
        char name[256];
        snprintf(name, sizeof name, "%s.T", wn);
        w = anneal_onnx_weight(g, name, d->weight, true);
    }
    const char *y = anneal_onnx_op2(g, "MatMul", x, w);
    if (d->bias)
        y = anneal_onnx_op2(g, "Add", y, anneal_onnx_weight(g, weight_name(d->bias, "dense.bias"), d->bias, false));
    return y;
}

const char *anneal_nn_embedding_onnx(anneal_onnx_graph *g, const anneal_nn_embedding *e, const char *ids) {
    if (!g || !ids || g->status != ANNEAL_OK) return NULL;
    const char *w = anneal_onnx_weight(g, weight_name(e->weight, "embedding.weight"), e->weight, false);
    anneal_onnx_attr axis = ANNEAL_ONNX_ATTR_INT("axis", 0);
    const char *in[2] = {w, ids};
    return anneal_onnx_node(g, "Gather", 2, in, &axis, 1);
}

const char *anneal_nn_layer_norm_onnx(anneal_onnx_graph *g, const anneal_nn_layer_norm *n, const char *x) {
    if (!g || !x || g->status != ANNEAL_OK) return NULL;
    const char *in[3] = {x, anneal_onnx_weight(g, weight_name(n->weight, "ln.weight"), n->weight, false), ""};
    if (n->bias) in[2] = anneal_onnx_weight(g, weight_name(n->bias, "ln.bias"), n->bias, false);
    anneal_onnx_attr a[2] = {ANNEAL_ONNX_ATTR_INT("axis", -1), ANNEAL_ONNX_ATTR_FLOAT("epsilon", n->eps)};
    return anneal_onnx_node(g, "LayerNormalization", n->bias ? 3 : 2, in, a, 2);
}

const char *anneal_nn_rms_norm_onnx(anneal_onnx_graph *g, const anneal_nn_rms_norm *n, const char *x) {
    if (!g || !x || g->status != ANNEAL_OK) return NULL;
    /* transformers' LlamaRMSNorm: x * rsqrt(mean(x^2, -1) + eps) * weight */
    const int64_t axes[1] = {-1};
    anneal_onnx_attr a[2] = {ANNEAL_ONNX_ATTR_INTS("axes", axes, 1), ANNEAL_ONNX_ATTR_INT("keepdims", 1)};
    const char *sq = anneal_onnx_op2(g, "Mul", x, x);
    const char *ms = anneal_onnx_node(g, "ReduceMean", 1, &sq, a, 2); /* opset 17: axes is an attribute */
    const char *rs = anneal_onnx_op1(g, "Sqrt", anneal_onnx_op2(g, "Add", ms, anneal_onnx_float_scalar(g, n->eps)));
    const char *y = anneal_onnx_op2(g, "Mul", x, anneal_onnx_op1(g, "Reciprocal", rs));
    return anneal_onnx_op2(g, "Mul", y, anneal_onnx_weight(g, weight_name(n->weight, "rms.weight"), n->weight, false));
}

/* tanh-GELU, composed (opset 17 has no Gelu): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
static const char *gelu_tanh(anneal_onnx_graph *g, const char *x) {
    const char *x3 = anneal_onnx_op2(g, "Mul", anneal_onnx_op2(g, "Mul", x, x), x);
    const char *k = anneal_onnx_float_scalar(g, 0.044715f);
    const char *inner = anneal_onnx_op2(g, "Add", x, anneal_onnx_op2(g, "Mul", x3, k));
    const char *u = anneal_onnx_op2(g, "Mul", inner, anneal_onnx_float_scalar(g, (float)sqrt(2.0 / M_PI)));
    const char *t = anneal_onnx_op2(g, "Add", anneal_onnx_op1(g, "Tanh", u), anneal_onnx_float_scalar(g, 1.0f));
    return anneal_onnx_op2(g, "Mul", anneal_onnx_op2(g, "Mul", x, t), anneal_onnx_float_scalar(g, 0.5f));
}

const char *anneal_nn_mlp_onnx(anneal_onnx_graph *g, const anneal_nn_mlp *m, const char *x) {
    if (!g || !x || g->status != ANNEAL_OK) return NULL;
    if (m->kind == ANNEAL_MLP_GELU)
        return anneal_nn_dense_onnx(g, &m->proj, gelu_tanh(g, anneal_nn_dense_onnx(g, &m->fc, x)));
    /* SwiGLU: down(silu(gate x) * up x), silu(z) = z * sigmoid(z) */
    const char *gate = anneal_nn_dense_onnx(g, &m->gate, x);
    const char *act = anneal_onnx_op2(g, "Mul", gate, anneal_onnx_op1(g, "Sigmoid", gate));
    return anneal_nn_dense_onnx(g, &m->down, anneal_onnx_op2(g, "Mul", act, anneal_nn_dense_onnx(g, &m->up, x)));
}

const char *anneal_onnx_lm_head(anneal_onnx_graph *g, const char *h, const char *weight, int64_t n_embd) {
    if (!g || !h || !weight || g->status != ANNEAL_OK) return NULL;
    /* (batch, sequence, C) -> (batch * sequence, C) -> Gemm with W (vocab, C) transposed
     * -> (batch * sequence, vocab) -> (batch, sequence, vocab) */
    const int64_t flat[2] = {-1, n_embd};
    const char *h2 = anneal_onnx_reshape(g, h, 2, flat);
    anneal_onnx_attr tb = ANNEAL_ONNX_ATTR_INT("transB", 1);
    const char *in[2] = {h2, weight};
    const char *y = anneal_onnx_node(g, "Gemm", 2, in, &tb, 1);
    anneal_onnx_attr se[2] = {ANNEAL_ONNX_ATTR_INT("start", 0), ANNEAL_ONNX_ATTR_INT("end", 2)};
    const char *bt = anneal_onnx_node(g, "Shape", 1, &h, se, 2);
    const int64_t minus1[1] = {-1};
    const char *cat_in[2] = {bt, anneal_onnx_ints(g, 1, minus1)};
    anneal_onnx_attr ax = ANNEAL_ONNX_ATTR_INT("axis", 0);
    const char *shape = anneal_onnx_node(g, "Concat", 2, cat_in, &ax, 1);
    return anneal_onnx_op2(g, "Reshape", y, shape);
}
