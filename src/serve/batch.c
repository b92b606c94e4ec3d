/* The engine's view of the model: `slots` independent sequences in KV-cache slots,
 * a prefill of one slot and a decode step over many. Logits come back as host f32
 * rows. */
#include "serve_internal.h"

#include "anneal/autograd.h"

#include <stdlib.h>
#include <string.h>

struct anneal_serve_batch {
    anneal_model *m;
    int64_t slots, max_len, vocab;
    anneal_kv_cache **kv; /* one batch-1 cache per slot */
};

anneal_serve_batch *anneal_serve_batch_new(anneal_model *m, int64_t slots, int64_t max_len) {
    anneal_serve_batch *b = calloc(1, sizeof *b);
    if (!b || !(b->kv = calloc((size_t)slots, sizeof *b->kv))) {
        free(b);
        anneal_set_error(ANNEAL_ERR_OOM, "serve: out of memory for %lld slots", (long long)slots);
        return NULL;
    }
    b->m = m;
    b->slots = slots;
    b->max_len = max_len;
    b->vocab = m->cfg.vocab_size;
    for (int64_t i = 0; i < slots; i++)
        if (!(b->kv[i] = anneal_model_kv_cache_new(m, 1, max_len))) {
            anneal_serve_batch_free(b);
            return NULL;
        }
    return b;
}

void anneal_serve_batch_free(anneal_serve_batch *b) {
    if (!b) return;
    for (int64_t i = 0; i < b->slots; i++) anneal_kv_cache_free(b->kv[i]);
    free(b->kv);
    free(b);
}

void anneal_serve_batch_reset(anneal_serve_batch *b, int64_t slot) { anneal_kv_cache_reset(b->kv[slot]); }

int64_t anneal_serve_batch_len(const anneal_serve_batch *b, int64_t slot) { return anneal_kv_cache_len(b->kv[slot]); }

/* Feeds n ids to one slot's cache; the last position's logits into out (V floats). */
static anneal_status feed(anneal_serve_batch *b, int64_t slot, const int32_t *ids, int64_t n, float *out) {
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *t = anneal_from_data_on(anneal_model_device(b->m), ANNEAL_I32, 2, (int64_t[]){1, n}, ids);
    anneal_tensor *logits = t ? anneal_model_forward_cached_last(b->m, b->kv[slot], t, 1) : NULL;
    anneal_status s = logits ? anneal_to_f32_buffer(logits, out) : anneal_last_status();
    anneal_scope_close(sc);
    return s;
}

anneal_status anneal_serve_batch_prefill(anneal_serve_batch *b, int64_t slot, const int32_t *ids, int64_t n,
                                         float *logits) {
    if (slot < 0 || slot >= b->slots || n <= 0 || anneal_kv_cache_len(b->kv[slot]) + n > b->max_len)
        return anneal_set_error(ANNEAL_ERR_ARG, "serve: prefill of %lld ids into slot %lld does not fit", (long long)n,
                                (long long)slot);
    return feed(b, slot, ids, n, logits);
}

anneal_status anneal_serve_batch_decode(anneal_serve_batch *b, const int64_t *slots, const int32_t *ids, int64_t n,
                                        float *logits) {
    for (int64_t i = 0; i < n; i++) {
        anneal_status s = feed(b, slots[i], ids + i, 1, logits + i * b->vocab);
        if (s != ANNEAL_OK) return s;
    }
    return ANNEAL_OK;
}
