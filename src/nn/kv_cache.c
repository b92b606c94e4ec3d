/* The generic key/value cache of generation: per layer, two (B, Hkv, max_len, D)
 * buffers in a scope of their own, and the count of positions they hold. Attention
 * blocks write a layer's new rows; the model advances the count once every layer has
 * (so a failure half-way leaves len unchanged and the next call overwrites the rows). */
#include "anneal/nn.h"

#include <stdlib.h>

struct anneal_kv_cache {
    const void *owner;
    int n_layer;
    int64_t batch, n_kv_head, head_dim, max_len, len;
    anneal_scope *scope;    /* owns the buffers */
    anneal_tensor **k, **v; /* per layer: (B, Hkv, max_len, D) */
};

anneal_kv_cache *anneal_kv_cache_new(anneal_device dev, int n_layer, int64_t batch, int64_t n_kv_head,
                                     int64_t head_dim, int64_t max_len, const void *owner) {
    if (n_layer < 0 || batch <= 0 || n_kv_head <= 0 || head_dim <= 0 || max_len <= 0) {
        anneal_set_error(ANNEAL_ERR_ARG,
                         "kv_cache: n_layer %d must be >= 0 and batch %lld, heads %lld, head_dim %lld, max_len %lld "
                         "positive",
                         n_layer, (long long)batch, (long long)n_kv_head, (long long)head_dim, (long long)max_len);
        return NULL;
    }
    anneal_kv_cache *kv = calloc(1, sizeof *kv);
    size_t nl = (size_t)n_layer + 1;
    if (!kv || !(kv->k = calloc(nl, sizeof *kv->k)) || !(kv->v = calloc(nl, sizeof *kv->v)) ||
        !(kv->scope = anneal_scope_new())) {
        if (kv) free(kv->k), free(kv->v);
        free(kv);
        anneal_set_error(ANNEAL_ERR_OOM, "kv_cache: out of memory");
        return NULL;
    }
    *kv = (anneal_kv_cache){.owner = owner, .n_layer = n_layer, .batch = batch, .n_kv_head = n_kv_head,
                            .head_dim = head_dim, .max_len = max_len, .scope = kv->scope, .k = kv->k, .v = kv->v};
    int64_t shape[4] = {batch, n_kv_head, max_len, head_dim};
    bool ok = true;
    anneal_scope_enter(kv->scope);
    for (int l = 0; l < n_layer && ok; l++) {
        kv->k[l] = anneal_empty_on(dev, ANNEAL_F32, 4, shape);
        kv->v[l] = anneal_empty_on(dev, ANNEAL_F32, 4, shape);
        ok = kv->k[l] && kv->v[l];
    }
    anneal_scope_leave();
    if (!ok) {
        anneal_kv_cache_free(kv);
        return NULL;
    }
    return kv;
}

void anneal_kv_cache_free(anneal_kv_cache *kv) {
    if (!kv) return;
    anneal_scope_free(kv->scope);
    free(kv->k);
    free(kv->v);
    free(kv);
}

void anneal_kv_cache_reset(anneal_kv_cache *kv) {
    if (kv) kv->len = 0;
}

int64_t anneal_kv_cache_len(const anneal_kv_cache *kv) { return kv ? kv->len : 0; }
int64_t anneal_kv_cache_batch(const anneal_kv_cache *kv) { return kv ? kv->batch : 0; }
int64_t anneal_kv_cache_max_len(const anneal_kv_cache *kv) { return kv ? kv->max_len : 0; }
const void *anneal_kv_cache_owner(const anneal_kv_cache *kv) { return kv ? kv->owner : NULL; }

/* True when layer is one of the cache's (else an error naming fn). */
static bool layer_ok(const anneal_kv_cache *kv, int layer, const char *fn) {
    if (kv && layer >= 0 && layer < kv->n_layer) return true;
    anneal_set_error(ANNEAL_ERR_ARG, "%s: %s", fn, kv ? "layer out of range" : "NULL cache");
    return false;
}

anneal_status anneal_kv_cache_write(anneal_kv_cache *kv, int layer, anneal_tensor *k, anneal_tensor *v) {
    if (!k || !v) return anneal_last_status() != ANNEAL_OK ? anneal_last_status()
                                                           : anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_write: NULL k or v");
    if (!layer_ok(kv, layer, "kv_cache_write")) return anneal_last_status();
    int64_t T = k->ndim == 4 ? k->shape[2] : -1;
    bool fits = k->ndim == 4 && anneal_same_shape(k, v) && k->shape[0] == kv->batch && k->shape[1] == kv->n_kv_head &&
                k->shape[3] == kv->head_dim;
    if (!fits) {
        char s[64];
        return anneal_set_error(ANNEAL_ERR_SHAPE, "kv_cache_write: k and v must be (%lld, %lld, T, %lld), got %s",
                                (long long)kv->batch, (long long)kv->n_kv_head, (long long)kv->head_dim,
                                anneal_shape_str(k, s, sizeof s));
    }
    if (kv->len + T > kv->max_len)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "kv_cache_write: %lld cached + %lld new positions exceed max_len %lld",
                                (long long)kv->len, (long long)T, (long long)kv->max_len);
    anneal_tensor *kd = anneal_narrow(kv->k[layer], 2, kv->len, T), *vd = anneal_narrow(kv->v[layer], 2, kv->len, T);
    if (!kd || !vd) return anneal_last_status();
    anneal_status s = anneal_copy_(kd, k);
    return s == ANNEAL_OK ? anneal_copy_(vd, v) : s;
}

anneal_tensor *anneal_kv_cache_keys(anneal_kv_cache *kv, int layer, int64_t n) {
    return layer_ok(kv, layer, "kv_cache_keys") ? anneal_narrow(kv->k[layer], 2, 0, n) : NULL;
}

anneal_tensor *anneal_kv_cache_values(anneal_kv_cache *kv, int layer, int64_t n) {
    return layer_ok(kv, layer, "kv_cache_values") ? anneal_narrow(kv->v[layer], 2, 0, n) : NULL;
}

anneal_status anneal_kv_cache_advance(anneal_kv_cache *kv, int64_t n) {
    if (!kv) return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_advance: NULL cache");
    if (n < 0 || kv->len + n > kv->max_len)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "kv_cache_advance: %lld cached + %lld new positions exceed max_len %lld",
                                (long long)kv->len, (long long)n, (long long)kv->max_len);
    kv->len += n;
    return ANNEAL_OK;
}
