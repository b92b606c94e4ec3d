/* The causal self-attention block: q/k/v projections (one packed GEMM or three),
 * grouped-query heads, optional rotary embedding, flash attention, and the output
 * projection; with a KV cache for generation.
 *
 * Training runs the packed projection straight into anneal_attention_packed (whose
 * gradient lands in one buffer of the projection's shape) or the three projections'
 * head views into anneal_attention_ex. With a cache, the new rows' keys and values
 * (rotated first when RoPE is on) are copied into the layer's slots at positions
 * [len, len + T) and the new queries attend to [0, len + T) with the causal diagonal
 * at the bottom right (query row i sees keys up to len + i): every other part of a
 * decoder block works per row, so the new rows equal the last T rows of the full
 * forward pass. */
#include "nn_internal.h"

anneal_status anneal_nn_attention_create(anneal_nn_attention *a, anneal_params *ps, const char *prefix,
                                         const anneal_nn_attention_config *c) {
    if (!a || !c) return anneal_set_error(ANNEAL_ERR_ARG, "nn attention %s: NULL block or config", prefix);
    int hkv = c->n_kv_head ? c->n_kv_head : c->n_head;
    if (c->n_head <= 0 || c->n_embd <= 0 || hkv <= 0 || hkv > c->n_head || c->n_head % hkv)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "nn attention %s: n_head %d must be a positive multiple of n_kv_head %d (n_embd %lld)",
                                prefix, c->n_head, hkv, (long long)c->n_embd);
    int64_t D = c->head_dim;
    if (D == 0) {
        if (c->n_embd % c->n_head)
            return anneal_set_error(ANNEAL_ERR_ARG, "nn attention %s: n_embd %lld is not divisible by n_head %d", prefix,
                                    (long long)c->n_embd, c->n_head);
        D = c->n_embd / c->n_head;
    }
    if (D <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "nn attention %s: head_dim %lld", prefix, (long long)D);
    *a = (anneal_nn_attention){.n_head = c->n_head, .n_kv_head = hkv, .head_dim = D, .packed = c->qkv_name != NULL};
    if (c->rope) {
        a->has_rope = true;
        a->rope = *c->rope;
    }
    char name[ANNEAL_NN_NAME_MAX];
    anneal_status s;
    int64_t C = c->n_embd, nq = (int64_t)c->n_head * D, nkv = (int64_t)hkv * D;
    if (a->packed) {
        if (!anneal_nn_name(name, sizeof name, "attention", prefix, c->qkv_name)) return anneal_last_status();
        if ((s = anneal_nn_dense_create(&a->qkv, ps, name, C, nq + 2 * nkv, c->layout, c->qkv_bias)) != ANNEAL_OK)
            return s;
    } else {
        const char *names[3] = {c->q_name, c->k_name, c->v_name};
        anneal_nn_dense *d[3] = {&a->q, &a->k, &a->v};
        int64_t outs[3] = {nq, nkv, nkv};
        for (int i = 0; i < 3; i++) {
            if (!anneal_nn_name(name, sizeof name, "attention", prefix, names[i])) return anneal_last_status();
            if ((s = anneal_nn_dense_create(d[i], ps, name, C, outs[i], c->layout, c->qkv_bias)) != ANNEAL_OK) return s;
        }
    }
    if (!anneal_nn_name(name, sizeof name, "attention", prefix, c->out_name)) return anneal_last_status();
    return anneal_nn_dense_create(&a->out, ps, name, nq, C, c->layout, c->out_bias);
}

/* Heads of columns [col, col + H*D) of a contiguous (B, T, W) tensor as a (B, H, T, D)
 * view. */
static anneal_tensor *heads(anneal_tensor *t, int64_t H, int64_t D, int64_t col) {
    if (!t) return NULL;
    int64_t B = t->shape[0], T = t->shape[1], W = t->shape[2];
    return anneal_alias(t, 4, (int64_t[]){B, H, T, D}, (int64_t[]){T * W, D, W, 1}, t->offset + col);
}

/* (B, H, T, D) attention output, a view of (B, T, H, D) storage, as (B, T, H*D). */
static anneal_tensor *merge_heads(anneal_tensor *o) {
    if (!o) return NULL;
    int64_t B = o->shape[0], H = o->shape[1], T = o->shape[2], D = o->shape[3];
    return anneal_reshape(anneal_transpose(o, 1, 2), 3, (int64_t[]){B, T, H * D});
}

/* (B, T, H*D) projection output as (B, H, T, D), differentiable. */
static anneal_tensor *split_heads(anneal_tensor *t, int64_t H, int64_t D) {
    if (!t) return NULL;
    return anneal_transpose(anneal_reshape(t, 4, (int64_t[]){t->shape[0], t->shape[1], H, D}), 1, 2);
}

/* Causal self-attention over x's own positions. */
static anneal_tensor *self_attention(const anneal_nn_attention *a, const anneal_nn_ctx *ctx, anneal_tensor *x) {
    anneal_attention_opts o = {.causal = true, .compute = ctx ? ctx->compute : ANNEAL_F32,
                               .rope = a->has_rope ? &a->rope : NULL};
    if (a->packed)
        return anneal_attention_packed(anneal_nn_dense_forward(&a->qkv, ctx, x), a->n_head, a->n_kv_head, &o);
    /* x feeds three projections: saved once in f32 rather than as three bf16 copies */
    anneal_tensor *q = split_heads(anneal_nn_dense_forward_kept(&a->q, ctx, x, ANNEAL_ACT_NONE, NULL, true), a->n_head,
                                   a->head_dim);
    anneal_tensor *k = split_heads(anneal_nn_dense_forward_kept(&a->k, ctx, x, ANNEAL_ACT_NONE, NULL, true),
                                   a->n_kv_head, a->head_dim);
    anneal_tensor *v = split_heads(anneal_nn_dense_forward_kept(&a->v, ctx, x, ANNEAL_ACT_NONE, NULL, true),
                                   a->n_kv_head, a->head_dim);
    return merge_heads(anneal_attention_ex(q, k, v, &o));
}

/* The new rows of x against the cache (see the file comment). */
static anneal_tensor *cached_attention(const anneal_nn_attention *a, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                       anneal_kv_cache *kv, int layer) {
    int64_t Hq = a->n_head, Hkv = a->n_kv_head, D = a->head_dim;
    anneal_tensor *q, *k, *v;
    if (a->packed) {
        /* the head views address the projection as (B, T, W) row-major */
        anneal_tensor *qkv = anneal_contiguous(anneal_nn_dense_forward(&a->qkv, ctx, x));
        q = heads(qkv, Hq, D, 0);
        k = heads(qkv, Hkv, D, Hq * D);
        v = heads(qkv, Hkv, D, (Hq + Hkv) * D);
    } else {
        q = heads(anneal_contiguous(anneal_nn_dense_forward(&a->q, ctx, x)), Hq, D, 0);
        k = heads(anneal_contiguous(anneal_nn_dense_forward(&a->k, ctx, x)), Hkv, D, 0);
        v = heads(anneal_contiguous(anneal_nn_dense_forward(&a->v, ctx, x)), Hkv, D, 0);
    }
    if (!q || !k || !v) return NULL;
    int64_t len = anneal_kv_cache_len(kv), T = q->shape[2];
    if (a->has_rope) { /* the cache holds rotated keys: each position is rotated once */
        q = anneal_rope(q, &a->rope, len);
        k = anneal_rope(k, &a->rope, len);
    }
    if (!q || !k || anneal_kv_cache_write(kv, layer, k, v) != ANNEAL_OK) return NULL;
    anneal_attention_opts o = {.causal = true, .compute = ctx ? ctx->compute : ANNEAL_F32};
    return merge_heads(anneal_attention_ex(q, anneal_kv_cache_keys(kv, layer, len + T),
                                           anneal_kv_cache_values(kv, layer, len + T), &o));
}

anneal_tensor *anneal_nn_attention_core(const anneal_nn_attention *a, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                        anneal_kv_cache *kv, int layer) {
    if (!a || !x) return NULL;
    if (x->ndim != 3) {
        char s[64];
        anneal_set_error(ANNEAL_ERR_SHAPE, "nn attention: x must be (B, T, C), got %s", anneal_shape_str(x, s, sizeof s));
        return NULL;
    }
    return kv ? cached_attention(a, ctx, x, kv, layer) : self_attention(a, ctx, x);
}

anneal_tensor *anneal_nn_attention_out(const anneal_nn_attention *a, const anneal_nn_ctx *ctx, anneal_tensor *att) {
    return anneal_nn_dense_forward_kept(a ? &a->out : NULL, ctx, att, ANNEAL_ACT_NONE, NULL, true);
}

anneal_tensor *anneal_nn_attention_forward(const anneal_nn_attention *a, const anneal_nn_ctx *ctx,
                                           anneal_tensor *x, anneal_kv_cache *kv, int layer) {
    return anneal_nn_attention_out(a, ctx, anneal_nn_attention_core(a, ctx, x, kv, layer));
}
