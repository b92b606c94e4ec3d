/* The engine's view of the model: `slots` independent sequences in one KV cache
 * (the model's slots API, include/anneal/model.h), a prefill of one slot, a decode
 * step over many in one pass over the weights, and both at once (a mixed pass). Logits come back as host f32 rows. */
#include "serve_internal.h"

#include <stdlib.h>
#include <string.h>

struct anneal_serve_batch {
    anneal_model *m;
    int64_t slots, max_len, vocab;
    anneal_kv_cache *kv; /* `slots` sequences */
};

anneal_serve_batch *anneal_serve_batch_new(anneal_model *m, int64_t slots, int64_t max_len) {
    anneal_serve_batch *b = calloc(1, sizeof *b);
    if (!b) {
        anneal_set_error(ANNEAL_ERR_OOM, "serve: out of memory for %lld slots", (long long)slots);
        return NULL;
    }
    b->m = m;
    b->slots = slots;
    b->max_len = max_len;
    b->vocab = m->cfg.vocab_size;
    if (!(b->kv = anneal_model_kv_cache_new(m, slots, max_len))) {
        free(b);
        return NULL;
    }
    return b;
}

void anneal_serve_batch_free(anneal_serve_batch *b) {
    if (!b) return;
    anneal_kv_cache_free(b->kv);
    free(b);
}

void anneal_serve_batch_reset(anneal_serve_batch *b, int64_t slot) { anneal_kv_cache_slot_reset(b->kv, slot); }

/* Copies the (rows, vocab) f32 logits into out, closing the scope they live in. */
static anneal_status take(anneal_scope *sc, anneal_tensor *logits, float *out) {
    anneal_status s = logits ? anneal_to_f32_buffer(logits, out) : anneal_last_status();
    anneal_scope_close(sc);
    return s;
}

anneal_status anneal_serve_batch_prefill(anneal_serve_batch *b, int64_t slot, const int32_t *ids, int64_t n,
                                         float *logits) {
    anneal_scope *sc = anneal_scope_open();
    return take(sc, anneal_model_prefill_slot(b->m, b->kv, slot, ids, n), logits);
}

anneal_status anneal_serve_batch_decode(anneal_serve_batch *b, const int64_t *slots, const int32_t *ids, int64_t n,
                                        float *logits) {
    anneal_scope *sc = anneal_scope_open();
    return take(sc, anneal_model_decode_slots(b->m, b->kv, slots, ids, n), logits);
}

anneal_status anneal_serve_batch_extend(anneal_serve_batch *b, const int64_t *slots, const int32_t *ids,
                                        const int64_t *counts, int64_t n, float *logits) {
    anneal_scope *sc = anneal_scope_open();
    return take(sc, anneal_model_extend_slots(b->m, b->kv, slots, ids, counts, n), logits);
}
