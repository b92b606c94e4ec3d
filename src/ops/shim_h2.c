/* TEMPORARY: deleted when h1a merges */
/* The new op API of include/anneal/ops.h (compute precision as a value) on top of the
 * old one (the thread's matmul precision), for branch h2 until h1a's ops land: each
 * op sets the thread-local to its `compute` around the old op. The old backward reads
 * the thread-local when it runs, so code running backward at bf16/f16 brackets it
 * with anneal_shim_h2_backward_begin/end (marked TEMPORARY where called). Ops the old
 * API cannot express (RoPE, grouped-query attention) are ANNEAL_ERR_UNSUPPORTED. */
#include "ops_internal.h"

/* The thread's precision set to dt (returned: the previous one, for restore). */
static anneal_dtype push(anneal_dtype dt) {
    anneal_dtype prev = anneal_get_matmul_dtype();
    anneal_set_matmul_dtype(dt);
    return prev;
}

/* TEMPORARY (h2 shim): sets the thread's matmul precision for a backward pass. */
anneal_dtype anneal_shim_h2_backward_begin(anneal_dtype compute);
anneal_dtype anneal_shim_h2_backward_begin(anneal_dtype compute) { return push(compute); }
/* TEMPORARY (h2 shim): restores what anneal_shim_h2_backward_begin returned. */
void anneal_shim_h2_backward_end(anneal_dtype prev);
void anneal_shim_h2_backward_end(anneal_dtype prev) { anneal_set_matmul_dtype(prev); }

static anneal_tensor *unsupported(const char *op, const char *what) {
    anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: %s (needs the ops of branch h1a)", op, what);
    return NULL;
}

anneal_tensor *anneal_matmul_ex(anneal_tensor *a, anneal_tensor *b, anneal_dtype compute) {
    if (!a || !b) return NULL;
    anneal_dtype prev = push(compute);
    anneal_tensor *r = anneal_matmul(a, b);
    anneal_set_matmul_dtype(prev);
    return r;
}

anneal_tensor *anneal_dense(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, const anneal_dense_opts *opts) {
    if (!x || !w) return NULL;
    anneal_dense_opts o = opts ? *opts : (anneal_dense_opts){0};
    anneal_dtype prev = push(o.compute);
    bool in_out = o.layout == ANNEAL_WEIGHT_IN_OUT;
    anneal_tensor *r = NULL;
    switch (o.act) {
    case ANNEAL_ACT_NONE: r = in_out ? anneal_conv1d(x, w, b) : anneal_linear(x, w, b); break;
    case ANNEAL_ACT_GELU_TANH: r = in_out ? anneal_conv1d_gelu(x, w, b) : anneal_gelu(anneal_linear(x, w, b), true); break;
    case ANNEAL_ACT_SILU_MUL:
        r = o.mul ? anneal_mul(anneal_silu(in_out ? anneal_conv1d(x, w, b) : anneal_linear(x, w, b)), o.mul) : NULL;
        break;
    }
    anneal_set_matmul_dtype(prev);
    return r;
}

anneal_tensor *anneal_linear_cross_entropy_ex(anneal_tensor *h, anneal_tensor *w, anneal_tensor *targets,
                                              int32_t ignore_index, anneal_dtype compute) {
    if (!h || !w || !targets) return NULL;
    anneal_dtype prev = push(compute);
    anneal_tensor *r = anneal_linear_cross_entropy(h, w, targets, ignore_index);
    anneal_set_matmul_dtype(prev);
    return r;
}

anneal_tensor *anneal_attention_ex(anneal_tensor *q, anneal_tensor *k, anneal_tensor *v,
                                   const anneal_attention_opts *opts) {
    if (!q || !k || !v) return NULL;
    anneal_attention_opts o = opts ? *opts : (anneal_attention_opts){0};
    if (o.rope) return unsupported("attention_ex", "rotary embedding");
    if (q->ndim == 4 && k->ndim == 4 && q->shape[1] != k->shape[1])
        return unsupported("attention_ex", "grouped-query heads");
    anneal_dtype prev = push(o.compute);
    anneal_tensor *r = anneal_attention(q, k, v, o.causal, o.scale);
    anneal_set_matmul_dtype(prev);
    return r;
}

anneal_tensor *anneal_attention_packed(anneal_tensor *qkv, int n_head, int n_kv_head,
                                       const anneal_attention_opts *opts) {
    if (!qkv) return NULL;
    anneal_attention_opts o = opts ? *opts : (anneal_attention_opts){.causal = true};
    if (o.rope) return unsupported("attention_packed", "rotary embedding");
    if (n_kv_head != n_head) return unsupported("attention_packed", "grouped-query heads");
    if (!o.causal || o.scale > 0) return unsupported("attention_packed", "non-causal or scaled attention");
    anneal_dtype prev = push(o.compute);
    anneal_tensor *r = anneal_causal_attention(qkv, n_head);
    anneal_set_matmul_dtype(prev);
    return r;
}

anneal_tensor *anneal_rope(anneal_tensor *x, const anneal_rope_desc *rope, int64_t pos0) {
    if (!x) return NULL;
    return unsupported("rope", "rotary embedding");
}

anneal_tensor *anneal_arange(anneal_device dev, int64_t start, int64_t n) {
    if (dev != ANNEAL_CPU) return unsupported("arange", "a device other than the CPU");
    anneal_tensor *t = anneal_empty(ANNEAL_I32, 1, (int64_t[]){n});
    for (int64_t i = 0; t && i < n; i++) ((int32_t *)anneal_data(t))[i] = (int32_t)(start + i);
    return t;
}

anneal_tensor *anneal_to_device(anneal_tensor *t, anneal_device dev) {
    if (!t) return NULL;
    if (t->device != dev) return unsupported("to_device", "copies between devices");
    return t;
}
