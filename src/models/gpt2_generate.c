/* GPT-2 text generation: a KV cache, the cached forward pass and the generation loop.
 *
 * The cache keeps, per layer, the keys and values of every position seen so far in
 * two (B, H, max_len, D) buffers. A cached forward over T_new new ids at positions
 * [L, L + T_new) runs each block on the new rows only: the fused qkv projection of the
 * new rows is split into head views, the new k and v are copied into the cache, and
 * the new queries attend to cached positions [0, L + T_new) with causal alignment at
 * the bottom right (query row i sees keys up to L + i). Everything else in a block is
 * per-row, so the new rows equal the last T_new rows of the full forward pass. */
#include "anneal/autograd.h"
#include "anneal/models.h"
#include "anneal/ops.h"
#include "gpt2_internal.h"

#include <stdlib.h>
#include <string.h>

struct anneal_gpt2_kv_cache {
    const anneal_gpt2 *model;
    int64_t batch, max_len, len;
    anneal_scope *scope;  /* owns the k and v buffers */
    anneal_tensor **k, **v; /* per layer: (B, H, max_len, D) */
};

anneal_gpt2_kv_cache *anneal_gpt2_kv_cache_new(const anneal_gpt2 *m, int64_t batch, int64_t max_len) {
    if (!m) {
        anneal_set_error(ANNEAL_ERR_ARG, "kv_cache: NULL model");
        return NULL;
    }
    if (batch <= 0 || max_len <= 0 || max_len > m->cfg.n_ctx) {
        anneal_set_error(ANNEAL_ERR_ARG,
                         "kv_cache: batch %lld must be positive and max_len %lld in [1, n_ctx %d]",
                         (long long)batch, (long long)max_len, m->cfg.n_ctx);
        return NULL;
    }
    anneal_gpt2_kv_cache *kv = calloc(1, sizeof *kv);
    int L = m->cfg.n_layer;
    if (!kv || !(kv->k = calloc((size_t)L, sizeof *kv->k)) || !(kv->v = calloc((size_t)L, sizeof *kv->v)) ||
        !(kv->scope = anneal_scope_new())) {
        if (kv) free(kv->k), free(kv->v);
        free(kv);
        anneal_set_error(ANNEAL_ERR_OOM, "kv_cache: out of memory");
        return NULL;
    }
    kv->model = m;
    kv->batch = batch;
    kv->max_len = max_len;
    int64_t H = m->cfg.n_head, D = m->cfg.n_embd / H;
    int64_t shape[4] = {batch, H, max_len, D};
    bool ok = true;
    anneal_scope_enter(kv->scope);
    for (int l = 0; l < L && ok; l++) {
        kv->k[l] = anneal_empty_on(m->wte->device, ANNEAL_F32, 4, shape);
        kv->v[l] = anneal_empty_on(m->wte->device, ANNEAL_F32, 4, shape);
        ok = kv->k[l] && kv->v[l];
    }
    anneal_scope_leave();
    if (!ok) {
        anneal_gpt2_kv_cache_free(kv);
        return NULL;
    }
    return kv;
}

void anneal_gpt2_kv_cache_free(anneal_gpt2_kv_cache *kv) {
    if (!kv) return;
    anneal_scope_free(kv->scope);
    free(kv->k);
    free(kv->v);
    free(kv);
}

void anneal_gpt2_kv_cache_reset(anneal_gpt2_kv_cache *kv) {
    if (kv) kv->len = 0;
}

int64_t anneal_gpt2_kv_cache_len(const anneal_gpt2_kv_cache *kv) { return kv ? kv->len : 0; }

/* Heads of columns [col, col + C) of a contiguous (B, T, 3C) qkv as a (B, H, T, D) view. */
static anneal_tensor *qkv_heads(anneal_tensor *qkv, int64_t H, int64_t col) {
    if (!qkv) return NULL;
    int64_t B = qkv->shape[0], T = qkv->shape[1], W = qkv->shape[2], D = W / 3 / H;
    return anneal_alias(qkv, 4, (int64_t[]){B, H, T, D}, (int64_t[]){T * W, D, W, 1}, qkv->offset + col);
}

/* Attention of the new rows of layer l: qkv (B, T_new, 3C) -> (B, T_new, C). Writes
 * the new keys and values at cache positions [len, len + T_new) and attends to
 * [0, len + T_new). */
static anneal_tensor *cached_attention(void *ctx, int l, anneal_tensor *qkv) {
    anneal_gpt2_kv_cache *kv = ctx;
    qkv = anneal_contiguous(qkv); /* the head views address it as (B, T, 3C) row-major */
    if (!qkv) return NULL;
    int64_t H = kv->model->cfg.n_head, C = kv->model->cfg.n_embd;
    int64_t B = qkv->shape[0], T = qkv->shape[1], end = kv->len + T;
    anneal_tensor *q = qkv_heads(qkv, H, 0), *k = qkv_heads(qkv, H, C), *v = qkv_heads(qkv, H, 2 * C);
    anneal_tensor *k_new = anneal_narrow(kv->k[l], 2, kv->len, T), *v_new = anneal_narrow(kv->v[l], 2, kv->len, T);
    if (!q || !k || !v || !k_new || !v_new || anneal_copy_(k_new, k) != ANNEAL_OK ||
        anneal_copy_(v_new, v) != ANNEAL_OK)
        return NULL;
    anneal_tensor *k_all = anneal_narrow(kv->k[l], 2, 0, end), *v_all = anneal_narrow(kv->v[l], 2, 0, end);
    /* (B, H, T, D), a view of (B, T, H, D) storage: merging the heads is a free reshape */
    anneal_attention_opts opts = {.causal = true, .compute = kv->model->compute};
    anneal_tensor *o = anneal_attention_ex(q, k_all, v_all, &opts);
    return anneal_reshape(anneal_transpose(o, 1, 2), 3, (int64_t[]){B, T, C});
}

/* Final hidden states (B, T_new, C) of the new ids, in the current scope; advances the
 * cache on success. Grad mode must be off. */
static anneal_tensor *cached_hidden(anneal_gpt2 *m, anneal_gpt2_kv_cache *kv, anneal_tensor *ids) {
    if (!m || !kv || !ids) {
        if (!ids) return NULL; /* an upstream error is already recorded */
        anneal_set_error(ANNEAL_ERR_ARG, "gpt2_forward_cached: NULL model or cache");
        return NULL;
    }
    if (kv->model != m) {
        anneal_set_error(ANNEAL_ERR_ARG, "gpt2_forward_cached: the cache was made for another model");
        return NULL;
    }
    char s[64];
    if (ids->ndim != 2 || ids->dtype != ANNEAL_I32 || ids->shape[0] != kv->batch || ids->shape[1] <= 0) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "gpt2_forward_cached: ids must be i32 (B = %lld, T_new >= 1), got %s",
                         (long long)kv->batch, anneal_shape_str(ids, s, sizeof s));
        return NULL;
    }
    int64_t T = ids->shape[1];
    if (kv->len + T > kv->max_len) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "gpt2_forward_cached: %lld cached + %lld new positions exceed the cache's "
                         "max_len %lld",
                         (long long)kv->len, (long long)T, (long long)kv->max_len);
        return NULL;
    }
    /* token + position embeddings of positions len .. len + T - 1: (B, T, C) + (T, C) */
    anneal_tensor *pos = anneal_arange(ids->device, kv->len, T);
    anneal_tensor *x = anneal_add(anneal_embedding(ids, m->wte), anneal_embedding(pos, m->wpe));
    /* each block with the attention replaced by the cached one (dropout is off here) */
    for (int l = 0; l < m->cfg.n_layer; l++)
        x = anneal_gpt2_block_apply(&m->blocks[l], l, x, cached_attention, kv);
    x = anneal_layer_norm(x, m->ln_f_w, m->ln_f_b, m->cfg.ln_eps);
    if (x) kv->len += T;
    return x;
}

/* Runs cached_hidden, then the tied lm head on the last `rows` rows
 * (all when rows <= 0), under no-grad with every intermediate in a scope closed here;
 * the logits go to the caller's scope. */
static anneal_tensor *cached_logits(anneal_gpt2 *m, anneal_gpt2_kv_cache *kv, anneal_tensor *ids,
                                    int64_t rows) {
    anneal_scope *outer = anneal_scope_current();
    anneal_no_grad_begin();
    anneal_scope *tmp = anneal_scope_open();
    bool training = m ? m->training : false;
    if (m) m->training = false; /* generation never uses dropout */
    anneal_tensor *h = cached_hidden(m, kv, ids);
    if (m) m->training = training;
    if (h && rows > 0 && rows < h->shape[1]) h = anneal_narrow(h, 1, h->shape[1] - rows, rows);
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m ? m->compute : ANNEAL_F32};
    anneal_tensor *logits = anneal_dense(h, m ? m->wte : NULL, NULL, &o);
    if (logits) anneal_keep(logits, outer);
    anneal_scope_close(tmp);
    anneal_no_grad_end();
    return logits;
}

anneal_tensor *anneal_gpt2_forward_cached(anneal_gpt2 *m, anneal_gpt2_kv_cache *kv, anneal_tensor *ids) {
    return cached_logits(m, kv, ids, 0);
}

/* Logits (V) of the last position after feeding ids[0..n) to the cache, into buf. */
static anneal_status feed(anneal_gpt2 *m, anneal_gpt2_kv_cache *kv, const int32_t *ids, int64_t n,
                          float *buf) {
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *t = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, n}, ids);
    anneal_tensor *logits = t ? cached_logits(m, kv, t, 1) : NULL;
    anneal_status s = logits ? anneal_to_f32_buffer(logits, buf) : anneal_last_status();
    anneal_scope_close(sc);
    return s;
}

anneal_status anneal_gpt2_generate(anneal_gpt2 *m, const int32_t *prompt, int64_t n_prompt,
                                   int64_t max_new, const anneal_sampler_config *cfg,
                                   int32_t stop_id, anneal_token_fn on_token, void *user) {
    if (!m || !cfg || (!prompt && n_prompt > 0))
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2_generate: NULL model, prompt or sampler config");
    if (n_prompt <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2_generate: the prompt is empty");
    if (max_new < 0) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2_generate: max_new %lld < 0", (long long)max_new);
    if (max_new == 0) return ANNEAL_OK;
    int64_t n_ctx = m->cfg.n_ctx, keep = n_ctx / 2 > 0 ? n_ctx / 2 : 1, V = m->cfg.vocab_size;
    /* win: the tokens in the cache (at most n_ctx) and the one just sampled */
    int32_t *win = malloc((size_t)(n_ctx + 1) * sizeof *win);
    float *logits = malloc((size_t)V * sizeof *logits);
    anneal_gpt2_kv_cache *kv = (win && logits) ? anneal_gpt2_kv_cache_new(m, 1, n_ctx) : NULL;
    if (!kv) {
        free(win);
        free(logits);
        return win && logits ? anneal_last_status()
                             : anneal_set_error(ANNEAL_ERR_OOM, "gpt2_generate: out of memory");
    }
    /* The model sees at most n_ctx tokens: a longer prompt starts from its last n_ctx/2. */
    int64_t w = n_prompt > n_ctx ? keep : n_prompt;
    memcpy(win, prompt + n_prompt - w, (size_t)w * sizeof *win);
    anneal_status s = feed(m, kv, win, w, logits);
    /* pos: the position of the next token in the whole sequence (seeds its draw) */
    for (int64_t i = 0, pos = n_prompt; i < max_new && s == ANNEAL_OK; i++, pos++) {
        int32_t id = anneal_sample_logits(logits, V, cfg, (uint64_t)pos);
        if ((stop_id >= 0 && id == stop_id) || (on_token && !on_token(id, user))) break;
        if (i + 1 == max_new) break;
        win[w++] = id;
        if (w <= n_ctx) {
            s = feed(m, kv, &id, 1, logits);
        } else {
            /* context full: rebuild the cache from the last n_ctx/2 tokens */
            memmove(win, win + w - keep, (size_t)keep * sizeof *win);
            w = keep;
            anneal_gpt2_kv_cache_reset(kv);
            s = feed(m, kv, win, w, logits);
        }
    }
    anneal_gpt2_kv_cache_free(kv);
    free(win);
    free(logits);
    return s;
}
