/* The generic key/value cache of generation: per layer, two (B, Hkv, max_len, D)
 * buffers in a scope of their own, stored as f32, bf16 or int8 (int8: one f32 scale per
 * slot, head and position, (B, Hkv, max_len), symmetric: x ~ q * scale, scale =
 * max|x| / 127 over the head's D values), and the count of positions each of the B
 * slots holds. Attention blocks write a layer's new rows; the model advances the count
 * once every layer has (so a failure half-way leaves the lengths unchanged and the next
 * call overwrites the rows).
 *
 * Two ways to use it. Whole batch (anneal_model_forward_cached): every slot has the
 * same length, len/batch/write/keys/values act on all B. One slot (the slots API of
 * continuous batching): anneal_kv_cache_focus(kv, s) makes the same functions act on
 * slot s alone, as if it were a cache of batch 1, until focus(kv, -1). */
#include "anneal/decode_kernels.h"
#include "anneal/nn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct anneal_kv_cache {
    const void *owner;
    int n_layer;
    int64_t batch, n_kv_head, head_dim, max_len;
    anneal_dtype dtype;     /* F32, BF16 or I8 */
    int64_t *slot_len;      /* positions held by each slot */
    int64_t focus;          /* -1: the whole batch; else the one slot the accessors act on */
    anneal_scope *scope;    /* owns the buffers */
    anneal_tensor **k, **v; /* per layer: (B, Hkv, max_len, D) of dtype */
    anneal_tensor **ks, **vs; /* int8: per layer (B, Hkv, max_len) f32 scales; else NULL */
    void *aux;              /* the decode engine's state (owned, freed by aux_free) */
    void (*aux_free)(void *);
};

anneal_kv_cache *anneal_kv_cache_new_dtype(anneal_device dev, int n_layer, int64_t batch, int64_t n_kv_head,
                                           int64_t head_dim, int64_t max_len, anneal_dtype dtype, const void *owner) {
    if (n_layer < 0 || batch <= 0 || n_kv_head <= 0 || head_dim <= 0 || max_len <= 0) {
        anneal_set_error(ANNEAL_ERR_ARG,
                         "kv_cache: n_layer %d must be >= 0 and batch %lld, heads %lld, head_dim %lld, max_len %lld "
                         "positive",
                         n_layer, (long long)batch, (long long)n_kv_head, (long long)head_dim, (long long)max_len);
        return NULL;
    }
    if (dtype != ANNEAL_F32 && dtype != ANNEAL_BF16 && dtype != ANNEAL_I8) {
        anneal_set_error(ANNEAL_ERR_ARG, "kv_cache: dtype %s is not f32, bf16 or int8", anneal_dtype_name(dtype));
        return NULL;
    }
    if (dtype != ANNEAL_F32 && dev != ANNEAL_CPU) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "kv_cache: a %s cache lives on the CPU only",
                         anneal_dtype_name(dtype));
        return NULL;
    }
    anneal_kv_cache *kv = calloc(1, sizeof *kv);
    size_t nl = (size_t)n_layer + 1;
    if (!kv || !(kv->k = calloc(nl, sizeof *kv->k)) || !(kv->v = calloc(nl, sizeof *kv->v)) ||
        !(kv->ks = calloc(nl, sizeof *kv->ks)) || !(kv->vs = calloc(nl, sizeof *kv->vs)) ||
        !(kv->slot_len = calloc((size_t)batch, sizeof *kv->slot_len)) || !(kv->scope = anneal_scope_new())) {
        if (kv) free(kv->k), free(kv->v), free(kv->ks), free(kv->vs), free(kv->slot_len);
        free(kv);
        anneal_set_error(ANNEAL_ERR_OOM, "kv_cache: out of memory");
        return NULL;
    }
    kv->owner = owner;
    kv->n_layer = n_layer;
    kv->batch = batch;
    kv->n_kv_head = n_kv_head;
    kv->head_dim = head_dim;
    kv->max_len = max_len;
    kv->dtype = dtype;
    kv->focus = -1;
    int64_t shape[4] = {batch, n_kv_head, max_len, head_dim};
    bool ok = true;
    anneal_scope_enter(kv->scope);
    for (int l = 0; l < n_layer && ok; l++) {
        kv->k[l] = anneal_empty_on(dev, dtype, 4, shape);
        kv->v[l] = anneal_empty_on(dev, dtype, 4, shape);
        ok = kv->k[l] && kv->v[l];
        if (ok && dtype == ANNEAL_I8) {
            kv->ks[l] = anneal_empty_on(dev, ANNEAL_F32, 3, shape);
            kv->vs[l] = anneal_empty_on(dev, ANNEAL_F32, 3, shape);
            ok = kv->ks[l] && kv->vs[l];
        }
    }
    anneal_scope_leave();
    if (!ok) {
        anneal_kv_cache_free(kv);
        return NULL;
    }
    return kv;
}

anneal_kv_cache *anneal_kv_cache_new(anneal_device dev, int n_layer, int64_t batch, int64_t n_kv_head,
                                     int64_t head_dim, int64_t max_len, const void *owner) {
    return anneal_kv_cache_new_dtype(dev, n_layer, batch, n_kv_head, head_dim, max_len, ANNEAL_F32, owner);
}

void anneal_kv_cache_free(anneal_kv_cache *kv) {
    if (!kv) return;
    if (kv->aux && kv->aux_free) kv->aux_free(kv->aux);
    anneal_scope_free(kv->scope);
    free(kv->k);
    free(kv->v);
    free(kv->ks);
    free(kv->vs);
    free(kv->slot_len);
    free(kv);
}

void anneal_kv_cache_reset(anneal_kv_cache *kv) {
    if (!kv) return;
    if (kv->focus >= 0)
        kv->slot_len[kv->focus] = 0;
    else
        memset(kv->slot_len, 0, (size_t)kv->batch * sizeof *kv->slot_len);
}

/* True when every slot holds the same number of positions. */
static bool uniform(const anneal_kv_cache *kv) {
    for (int64_t b = 1; b < kv->batch; b++)
        if (kv->slot_len[b] != kv->slot_len[0]) return false;
    return true;
}

int64_t anneal_kv_cache_len(const anneal_kv_cache *kv) {
    if (!kv) return 0;
    if (kv->focus >= 0) return kv->slot_len[kv->focus];
    int64_t mx = 0;
    for (int64_t b = 0; b < kv->batch; b++) mx = kv->slot_len[b] > mx ? kv->slot_len[b] : mx;
    return mx;
}

bool anneal_kv_cache_uniform(const anneal_kv_cache *kv) { return kv && (kv->focus >= 0 || uniform(kv)); }
int64_t anneal_kv_cache_batch(const anneal_kv_cache *kv) { return kv ? (kv->focus >= 0 ? 1 : kv->batch) : 0; }
int64_t anneal_kv_cache_slots(const anneal_kv_cache *kv) { return kv ? kv->batch : 0; }
int64_t anneal_kv_cache_max_len(const anneal_kv_cache *kv) { return kv ? kv->max_len : 0; }
const void *anneal_kv_cache_owner(const anneal_kv_cache *kv) { return kv ? kv->owner : NULL; }
anneal_dtype anneal_kv_cache_dtype(const anneal_kv_cache *kv) { return kv ? kv->dtype : ANNEAL_F32; }

int64_t anneal_kv_cache_bytes(const anneal_kv_cache *kv) {
    if (!kv) return 0;
    int64_t per = kv->batch * kv->n_kv_head * kv->max_len;
    int64_t b = 2 * per * kv->head_dim * (int64_t)anneal_dtype_size(kv->dtype);
    if (kv->dtype == ANNEAL_I8) b += 2 * per * (int64_t)sizeof(float);
    return b * kv->n_layer;
}

void anneal_kv_cache_slot_reset(anneal_kv_cache *kv, int64_t slot) {
    if (kv && slot >= 0 && slot < kv->batch) kv->slot_len[slot] = 0;
}

int64_t anneal_kv_cache_slot_len(const anneal_kv_cache *kv, int64_t slot) {
    return kv && slot >= 0 && slot < kv->batch ? kv->slot_len[slot] : 0;
}

anneal_status anneal_kv_cache_focus(anneal_kv_cache *kv, int64_t slot) {
    if (!kv) return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_focus: NULL cache");
    if (slot < -1 || slot >= kv->batch)
        return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_focus: slot %lld is outside [0, %lld)", (long long)slot,
                                (long long)kv->batch);
    kv->focus = slot;
    return ANNEAL_OK;
}

void *anneal_kv_cache_aux(const anneal_kv_cache *kv) { return kv ? kv->aux : NULL; }

void anneal_kv_cache_set_aux(anneal_kv_cache *kv, void *aux, void (*aux_free)(void *)) {
    if (!kv) return;
    if (kv->aux && kv->aux_free) kv->aux_free(kv->aux);
    kv->aux = aux;
    kv->aux_free = aux_free;
}

anneal_status anneal_kv_cache_raw(anneal_kv_cache *kv, int layer, anneal_kv_cache_layer *out) {
    if (!kv || !out || layer < 0 || layer >= kv->n_layer)
        return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_raw: NULL cache or layer %d out of range", layer);
    *out = (anneal_kv_cache_layer){.k = anneal_data(kv->k[layer]), .v = anneal_data(kv->v[layer]),
                                   .k_scale = kv->ks[layer] ? anneal_data(kv->ks[layer]) : NULL,
                                   .v_scale = kv->vs[layer] ? anneal_data(kv->vs[layer]) : NULL,
                                   .dtype = kv->dtype, .n_kv_head = kv->n_kv_head, .head_dim = kv->head_dim,
                                   .max_len = kv->max_len};
    return ANNEAL_OK;
}

/* True when layer is one of the cache's (else an error naming fn). */
static bool layer_ok(const anneal_kv_cache *kv, int layer, const char *fn) {
    if (kv && layer >= 0 && layer < kv->n_layer) return true;
    anneal_set_error(ANNEAL_ERR_ARG, "%s: %s", fn, kv ? "layer out of range" : "NULL cache");
    return false;
}

/* The slots the accessors act on: [b0, b0 + nb). */
static void focus_range(const anneal_kv_cache *kv, int64_t *b0, int64_t *nb) {
    *b0 = kv->focus >= 0 ? kv->focus : 0;
    *nb = kv->focus >= 0 ? 1 : kv->batch;
}

/* Writes the (nb, Hkv, T, D) f32 rows of src (contiguous host copy) into int8 storage
 * dst / scales at positions [at, at + T) of slots [b0, b0 + nb). */
static void write_i8(const anneal_kv_cache *kv, anneal_tensor *dst, anneal_tensor *scales, const float *src,
                     int64_t b0, int64_t nb, int64_t at, int64_t T) {
    int64_t H = kv->n_kv_head, D = kv->head_dim, M = kv->max_len;
    int8_t *q = anneal_data(dst);
    float *sc = anneal_data(scales);
    for (int64_t b = 0; b < nb; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                int64_t row = ((b0 + b) * H + h) * M + at + t;
                anneal_kv_quantize_row_i8(src + ((b * H + h) * T + t) * D, D, q + row * D, sc + row);
            }
}

anneal_status anneal_kv_cache_write(anneal_kv_cache *kv, int layer, anneal_tensor *k, anneal_tensor *v) {
    if (!k || !v) return anneal_last_status() != ANNEAL_OK ? anneal_last_status()
                                                           : anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_write: NULL k or v");
    if (!layer_ok(kv, layer, "kv_cache_write")) return anneal_last_status();
    int64_t b0, nb;
    focus_range(kv, &b0, &nb);
    int64_t T = k->ndim == 4 ? k->shape[2] : -1;
    bool fits = k->ndim == 4 && anneal_same_shape(k, v) && k->shape[0] == nb && k->shape[1] == kv->n_kv_head &&
                k->shape[3] == kv->head_dim;
    if (!fits) {
        char s[64];
        return anneal_set_error(ANNEAL_ERR_SHAPE, "kv_cache_write: k and v must be (%lld, %lld, T, %lld), got %s",
                                (long long)nb, (long long)kv->n_kv_head, (long long)kv->head_dim,
                                anneal_shape_str(k, s, sizeof s));
    }
    if (kv->focus < 0 && !uniform(kv))
        return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_write: the slots hold different lengths (write one slot)");
    int64_t len = anneal_kv_cache_len(kv);
    if (len + T > kv->max_len)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "kv_cache_write: %lld cached + %lld new positions exceed max_len %lld",
                                (long long)len, (long long)T, (long long)kv->max_len);
    if (kv->dtype == ANNEAL_I8) {
        anneal_tensor *kc = anneal_contiguous(anneal_cast(k, ANNEAL_F32)), *vc = anneal_contiguous(anneal_cast(v, ANNEAL_F32));
        if (!kc || !vc) return anneal_last_status();
        write_i8(kv, kv->k[layer], kv->ks[layer], anneal_data(kc), b0, nb, len, T);
        write_i8(kv, kv->v[layer], kv->vs[layer], anneal_data(vc), b0, nb, len, T);
        return ANNEAL_OK;
    }
    anneal_tensor *kd = anneal_narrow(anneal_narrow(kv->k[layer], 0, b0, nb), 2, len, T);
    anneal_tensor *vd = anneal_narrow(anneal_narrow(kv->v[layer], 0, b0, nb), 2, len, T);
    if (!kd || !vd) return anneal_last_status();
    anneal_status s = anneal_copy_(kd, k);
    return s == ANNEAL_OK ? anneal_copy_(vd, v) : s;
}

/* The first n positions of buffer t (scales sc for int8) of the focused slots as f32:
 * a view for an f32 cache, a converted copy in the current scope otherwise. */
static anneal_tensor *read_f32(const anneal_kv_cache *kv, anneal_tensor *t, anneal_tensor *sc, int64_t n) {
    int64_t b0, nb;
    focus_range(kv, &b0, &nb);
    anneal_tensor *view = anneal_narrow(anneal_narrow(t, 0, b0, nb), 2, 0, n);
    if (!view || kv->dtype == ANNEAL_F32) return view;
    if (kv->dtype == ANNEAL_BF16) return anneal_contiguous(anneal_cast(view, ANNEAL_F32));
    int64_t H = kv->n_kv_head, D = kv->head_dim, M = kv->max_len;
    anneal_tensor *out = anneal_empty(ANNEAL_F32, 4, (int64_t[]){nb, H, n, D});
    if (!out) return NULL;
    float *o = anneal_data(out);
    const int8_t *q = anneal_data(t);
    const float *s = anneal_data(sc);
    for (int64_t b = 0; b < nb; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t p = 0; p < n; p++) {
                int64_t row = ((b0 + b) * H + h) * M + p;
                float f = s[row];
                float *dst = o + ((b * H + h) * n + p) * D;
                for (int64_t d = 0; d < D; d++) dst[d] = (float)q[row * D + d] * f;
            }
    return out;
}

anneal_tensor *anneal_kv_cache_keys(anneal_kv_cache *kv, int layer, int64_t n) {
    return layer_ok(kv, layer, "kv_cache_keys") ? read_f32(kv, kv->k[layer], kv->ks[layer], n) : NULL;
}

anneal_tensor *anneal_kv_cache_values(anneal_kv_cache *kv, int layer, int64_t n) {
    return layer_ok(kv, layer, "kv_cache_values") ? read_f32(kv, kv->v[layer], kv->vs[layer], n) : NULL;
}

anneal_status anneal_kv_cache_advance(anneal_kv_cache *kv, int64_t n) {
    if (!kv) return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_advance: NULL cache");
    int64_t b0, nb, len = anneal_kv_cache_len(kv);
    focus_range(kv, &b0, &nb);
    if (n < 0 || len + n > kv->max_len)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "kv_cache_advance: %lld cached + %lld new positions exceed max_len %lld",
                                (long long)len, (long long)n, (long long)kv->max_len);
    if (kv->focus < 0 && !uniform(kv))
        return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_advance: the slots hold different lengths");
    for (int64_t b = b0; b < b0 + nb; b++) kv->slot_len[b] += n;
    return ANNEAL_OK;
}

anneal_status anneal_kv_cache_slot_advance(anneal_kv_cache *kv, int64_t slot, int64_t n) {
    if (!kv || slot < 0 || slot >= kv->batch || n < 0 || kv->slot_len[slot] + n > kv->max_len)
        return anneal_set_error(ANNEAL_ERR_ARG, "kv_cache_slot_advance: bad cache, slot %lld or count %lld",
                                (long long)slot, (long long)n);
    kv->slot_len[slot] += n;
    return ANNEAL_OK;
}
