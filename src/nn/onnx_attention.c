/* Causal self-attention as an ONNX graph piece, and what a decoder's layers share:
 * input_ids, the past key/value inputs (Hugging Face Optimum's names), the positions of
 * the new rows (after the past ones), the additive causal mask and the rotary tables.
 *
 * Shapes: x (batch, T, C); q (batch, Hq, T, D), k and v (batch, Hkv, past + T, D);
 * grouped-query heads without copying keys: q as (batch, Hkv, Hq/Hkv, T, D) against k
 * as (batch, Hkv, 1, past + T, D) (MatMul broadcasts), query head h reading key head
 * h / (Hq / Hkv) as anneal's attention does. RoPE is rotate_half's pairing with
 * anneal's own cos and sin tables (anneal_onnx_rope_tables), the arithmetic of
 * src/cpu/rope.c (x1 c - x2 s, x2 c + x1 s). */
#include "anneal/autograd.h"
#include "anneal/ops.h"
#include "anneal/onnx.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void anneal_onnx_decoder_free(anneal_onnx_decoder *d) {
    if (!d) return;
    free(d->past_key);
    free(d->past_value);
    free(d->present_key);
    free(d->present_value);
    d->past_key = d->past_value = d->present_key = d->present_value = NULL;
}

/* Squeeze(Shape(x)[start:end]): one dim of x as a 0-D int64. */
static const char *dim_of(anneal_onnx_graph *g, const char *x, int64_t dim) {
    anneal_onnx_attr se[2] = {ANNEAL_ONNX_ATTR_INT("start", dim), ANNEAL_ONNX_ATTR_INT("end", dim + 1)};
    return anneal_onnx_op1(g, "Squeeze", anneal_onnx_node(g, "Shape", 1, &x, se, 2));
}

/* Unsqueeze(x, [axis]). */
static const char *unsqueeze(anneal_onnx_graph *g, const char *x, int64_t axis) {
    return anneal_onnx_op2(g, "Unsqueeze", x, anneal_onnx_ints(g, 1, &axis));
}

anneal_status anneal_onnx_decoder_begin(anneal_onnx_graph *g, anneal_onnx_decoder *d, int n_layer, int n_kv_head,
                                        int64_t head_dim, bool kv_cache, const char *rope_cos_table,
                                        const char *rope_sin_table) {
    memset(d, 0, sizeof *d);
    if (!g || g->status != ANNEAL_OK) return g ? g->status : ANNEAL_ERR_ARG;
    d->kv_cache = kv_cache;
    d->n_layer = n_layer;
    d->n_kv_head = n_kv_head;
    d->head_dim = head_dim;
    size_t L = (size_t)(n_layer > 0 ? n_layer : 1);
    d->past_key = calloc(L, sizeof *d->past_key);
    d->past_value = calloc(L, sizeof *d->past_value);
    d->present_key = calloc(L, sizeof *d->present_key);
    d->present_value = calloc(L, sizeof *d->present_value);
    if (!d->past_key || !d->past_value || !d->present_key || !d->present_value) {
        anneal_onnx_decoder_free(d);
        return anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "out of memory");
    }
    anneal_onnx_set_prefix(g, "");
    const int64_t ids_dims[2] = {-1, -1};
    const char *ids_names[2] = {"batch", "sequence"};
    d->ids = anneal_onnx_input(g, "input_ids", ANNEAL_ONNX_INT64, 2, ids_dims, ids_names);
    const char *past_len = NULL;
    if (kv_cache) {
        const int64_t kv_dims[4] = {-1, n_kv_head, -1, head_dim};
        const char *kv_names[4] = {"batch", NULL, "past_sequence", NULL};
        for (int l = 0; l < n_layer; l++) {
            char name[64];
            snprintf(name, sizeof name, "past_key_values.%d.key", l);
            d->past_key[l] = anneal_onnx_input(g, name, ANNEAL_ONNX_FLOAT, 4, kv_dims, kv_names);
            snprintf(name, sizeof name, "past_key_values.%d.value", l);
            d->past_value[l] = anneal_onnx_input(g, name, ANNEAL_ONNX_FLOAT, 4, kv_dims, kv_names);
        }
        past_len = dim_of(g, d->past_key[0], 2);
    } else {
        past_len = anneal_onnx_int_scalar(g, 0);
    }
    /* positions past_len .. past_len + T - 1; keys 0 .. past_len + T - 1 */
    anneal_onnx_set_prefix(g, "positions");
    const char *T = dim_of(g, d->ids, 1);
    const char *total = anneal_onnx_op2(g, "Add", past_len, T);
    const char *one = anneal_onnx_int_scalar(g, 1);
    const char *r_in[3] = {past_len, total, one};
    d->positions = anneal_onnx_node(g, "Range", 3, r_in, NULL, 0);
    const char *k_in[3] = {anneal_onnx_int_scalar(g, 0), total, one};
    const char *kpos = anneal_onnx_node(g, "Range", 3, k_in, NULL, 0);
    /* mask[i][j] = 0 where key j <= query position i (bottom-right aligned), -inf after */
    const char *allowed = anneal_onnx_op2(g, "LessOrEqual", unsqueeze(g, kpos, 0), unsqueeze(g, d->positions, 1));
    const char *w_in[3] = {allowed, anneal_onnx_float_scalar(g, 0.0f), anneal_onnx_float_scalar(g, -INFINITY)};
    d->mask = anneal_onnx_node(g, "Where", 3, w_in, NULL, 0);
    if (rope_cos_table && rope_sin_table) {
        anneal_onnx_attr ax = ANNEAL_ONNX_ATTR_INT("axis", 0);
        const char *c_in[2] = {rope_cos_table, d->positions}, *s_in[2] = {rope_sin_table, d->positions};
        d->rope_cos = anneal_onnx_node(g, "Gather", 2, c_in, &ax, 1);
        d->rope_sin = anneal_onnx_node(g, "Gather", 2, s_in, &ax, 1);
    }
    anneal_onnx_set_prefix(g, "");
    if (g->status != ANNEAL_OK) anneal_onnx_decoder_free(d);
    return g->status;
}

anneal_status anneal_onnx_decoder_end(anneal_onnx_graph *g, anneal_onnx_decoder *d, const char *logits,
                                      int64_t vocab) {
    if (!g) return ANNEAL_ERR_ARG;
    anneal_onnx_set_prefix(g, "");
    const int64_t ld[3] = {-1, -1, vocab};
    const char *ln[3] = {"batch", "sequence", NULL};
    anneal_onnx_output(g, logits, "logits", ANNEAL_ONNX_FLOAT, 3, ld, ln);
    if (d->kv_cache && g->status == ANNEAL_OK) {
        const int64_t kv_dims[4] = {-1, d->n_kv_head, -1, d->head_dim};
        const char *kv_names[4] = {"batch", NULL, "total_sequence", NULL};
        for (int l = 0; l < d->n_layer; l++) {
            char name[64];
            snprintf(name, sizeof name, "present.%d.key", l);
            anneal_onnx_output(g, d->present_key[l], name, ANNEAL_ONNX_FLOAT, 4, kv_dims, kv_names);
            snprintf(name, sizeof name, "present.%d.value", l);
            anneal_onnx_output(g, d->present_value[l], name, ANNEAL_ONNX_FLOAT, 4, kv_dims, kv_names);
        }
        if (g->status == ANNEAL_OK)
            for (int l = 0; l < d->n_layer; l++)
                if (!d->present_key[l] || !d->present_value[l])
                    anneal_onnx_graph_fail(g, ANNEAL_ERR_STATE, "layer %d made no present key/value", l);
    }
    anneal_onnx_decoder_free(d);
    return g->status;
}

anneal_status anneal_onnx_rope_tables(anneal_onnx_graph *g, const anneal_rope_desc *rope, int64_t n_ctx,
                                      int64_t head_dim, const char **cos_name, const char **sin_name) {
    if (!g || g->status != ANNEAL_OK) return g ? g->status : ANNEAL_ERR_ARG;
    if (n_ctx <= 0 || head_dim <= 0 || head_dim % 2)
        return anneal_onnx_graph_fail(g, ANNEAL_ERR_ARG, "rope tables: n_ctx %lld, head_dim %lld", (long long)n_ctx,
                                      (long long)head_dim);
    /* a probe row (1 .. 1, 0 .. 0) rotated at position p is (cos a_i, sin a_i) of p */
    int64_t half = head_dim / 2, shape[4] = {1, 1, n_ctx, head_dim};
    float *probe = malloc((size_t)(n_ctx * head_dim) * sizeof *probe);
    if (!probe) return anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "rope tables: out of memory");
    for (int64_t t = 0; t < n_ctx; t++)
        for (int64_t i = 0; i < head_dim; i++) probe[t * head_dim + i] = i < half ? 1.0f : 0.0f;
    anneal_scope *sc = anneal_scope_open();
    anneal_no_grad_begin();
    anneal_tensor *x = anneal_from_data(ANNEAL_F32, 4, shape, probe);
    anneal_tensor *r = anneal_rope(x, rope, 0);
    const int64_t tshape[2] = {n_ctx, half};
    anneal_tensor *c = r ? anneal_reshape(anneal_contiguous(anneal_narrow(r, 3, 0, half)), 2, tshape) : NULL;
    anneal_tensor *s = r ? anneal_reshape(anneal_contiguous(anneal_narrow(r, 3, half, half)), 2, tshape) : NULL;
    anneal_no_grad_end();
    free(probe);
    if (c && s) {
        anneal_set_name(c, "rope.cos");
        anneal_set_name(s, "rope.sin");
        *cos_name = anneal_onnx_weight(g, "rope.cos", c, false);
        *sin_name = anneal_onnx_weight(g, "rope.sin", s, false);
    } else {
        anneal_onnx_graph_fail(g, anneal_last_status(), "rope tables: %s", anneal_last_error());
    }
    anneal_scope_close(sc); /* the graph holds its own references */
    return g->status;
}

/* (batch, T, H * D) -> (batch, H, T, D). */
static const char *heads(anneal_onnx_graph *g, const char *x, int64_t H, int64_t D) {
    const int64_t shape[4] = {0, 0, H, D}, perm[4] = {0, 2, 1, 3};
    return anneal_onnx_transpose(g, anneal_onnx_reshape(g, x, 4, shape), 4, perm);
}

/* rotate_half RoPE of x (batch, H, T, D) with cos, sin (T, D/2). */
static const char *rope(anneal_onnx_graph *g, const char *x, const char *cos, const char *sin, int64_t D) {
    const int64_t halves[2] = {D / 2, D / 2};
    const char *in[2] = {x, anneal_onnx_ints(g, 2, halves)};
    const char *xs[2] = {NULL, NULL};
    anneal_onnx_attr ax = ANNEAL_ONNX_ATTR_INT("axis", -1);
    anneal_onnx_node_n(g, "Split", 2, in, 2, xs, &ax, 1);
    const char *lo =
        anneal_onnx_op2(g, "Sub", anneal_onnx_op2(g, "Mul", xs[0], cos), anneal_onnx_op2(g, "Mul", xs[1], sin));
    const char *hi =
        anneal_onnx_op2(g, "Add", anneal_onnx_op2(g, "Mul", xs[1], cos), anneal_onnx_op2(g, "Mul", xs[0], sin));
    const char *cat[2] = {lo, hi};
    return anneal_onnx_node(g, "Concat", 2, cat, &ax, 1);
}

const char *anneal_nn_attention_onnx(anneal_onnx_graph *g, const anneal_nn_attention *a, anneal_onnx_decoder *d,
                                     int layer, const char *x) {
    if (!g || !x || g->status != ANNEAL_OK) return NULL;
    const int64_t Hq = a->n_head, Hkv = a->n_kv_head, D = a->head_dim;
    if (Hkv <= 0 || Hq % Hkv || layer < 0 || layer >= d->n_layer || Hkv != d->n_kv_head || D != d->head_dim) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_ARG, "attention of layer %d: heads %lld/%lld, head_dim %lld do not fit "
                               "the decoder's", layer, (long long)Hq, (long long)Hkv, (long long)D);
        return NULL;
    }
    if (a->has_rope && (!d->rope_cos || !d->rope_sin)) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_ARG, "attention of layer %d has RoPE but the decoder no tables", layer);
        return NULL;
    }
    /* projections: one packed (GPT-2's c_attn, queries first) or q, k, v */
    const char *q, *k, *v;
    if (a->packed) {
        const int64_t split[3] = {Hq * D, Hkv * D, Hkv * D};
        const char *in[2] = {anneal_nn_dense_onnx(g, &a->qkv, x), anneal_onnx_ints(g, 3, split)};
        const char *o[3] = {NULL, NULL, NULL};
        anneal_onnx_attr ax = ANNEAL_ONNX_ATTR_INT("axis", -1);
        anneal_onnx_node_n(g, "Split", 2, in, 3, o, &ax, 1);
        q = o[0], k = o[1], v = o[2];
    } else {
        q = anneal_nn_dense_onnx(g, &a->q, x);
        k = anneal_nn_dense_onnx(g, &a->k, x);
        v = anneal_nn_dense_onnx(g, &a->v, x);
    }
    q = heads(g, q, Hq, D);
    k = heads(g, k, Hkv, D);
    v = heads(g, v, Hkv, D);
    if (a->has_rope) {
        q = rope(g, q, d->rope_cos, d->rope_sin, D);
        k = rope(g, k, d->rope_cos, d->rope_sin, D);
    }
    if (d->kv_cache) {
        anneal_onnx_attr ax = ANNEAL_ONNX_ATTR_INT("axis", 2);
        const char *kin[2] = {d->past_key[layer], k}, *vin[2] = {d->past_value[layer], v};
        k = anneal_onnx_node(g, "Concat", 2, kin, &ax, 1);
        v = anneal_onnx_node(g, "Concat", 2, vin, &ax, 1);
        d->present_key[layer] = k;
        d->present_value[layer] = v;
    }
    const char *o;
    if (Hq == Hkv) {
        const int64_t kt[4] = {0, 1, 3, 2}, back[4] = {0, 2, 1, 3};
        const char *s = anneal_onnx_op2(g, "MatMul", q, anneal_onnx_transpose(g, k, 4, kt));
        s = anneal_onnx_op2(g, "Add", anneal_onnx_op2(g, "Mul", s, anneal_onnx_float_scalar(g, 1.0f / sqrtf((float)D))),
                            d->mask);
        anneal_onnx_attr ax = ANNEAL_ONNX_ATTR_INT("axis", -1);
        const char *p = anneal_onnx_node(g, "Softmax", 1, &s, &ax, 1);
        o = anneal_onnx_transpose(g, anneal_onnx_op2(g, "MatMul", p, v), 4, back);
    } else {
        const int64_t q5[5] = {0, Hkv, Hq / Hkv, -1, D}, kt[5] = {0, 1, 2, 4, 3}, back[5] = {0, 3, 1, 2, 4};
        const char *qg = anneal_onnx_reshape(g, q, 5, q5);
        const char *s = anneal_onnx_op2(g, "MatMul", qg, anneal_onnx_transpose(g, unsqueeze(g, k, 2), 5, kt));
        s = anneal_onnx_op2(g, "Add", anneal_onnx_op2(g, "Mul", s, anneal_onnx_float_scalar(g, 1.0f / sqrtf((float)D))),
                            d->mask);
        anneal_onnx_attr ax = ANNEAL_ONNX_ATTR_INT("axis", -1);
        const char *p = anneal_onnx_node(g, "Softmax", 1, &s, &ax, 1);
        o = anneal_onnx_transpose(g, anneal_onnx_op2(g, "MatMul", p, unsqueeze(g, v, 2)), 5, back);
    }
    const int64_t flat[3] = {0, 0, Hq * D};
    return anneal_nn_dense_onnx(g, &a->out, anneal_onnx_reshape(g, o, 3, flat));
}
