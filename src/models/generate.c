/* Text generation for any model of the interface: prefill the prompt into a KV cache
 * (slot 0 of a one-slot cache, in the model's KV dtype), then sample (temperature,
 * top-k, top-p, a Philox draw per position) and feed one id at a time; when the
 * sequence reaches n_ctx the cache is rebuilt from the last n_ctx/2 tokens. */
#include "anneal/autograd.h"
#include "anneal/model.h"

#include <stdlib.h>
#include <string.h>

/* Logits (V) of the last position after feeding ids[0..n) to slot 0 of the cache, into
 * buf: a prompt is prefilled (batched GEMMs), a single id is a decode step (the decode
 * engine's one pass over the weights). */
static anneal_status feed(anneal_model *m, anneal_kv_cache *kv, const int32_t *ids, int64_t n, float *buf) {
    anneal_scope *sc = anneal_scope_open();
    static const int64_t slot0 = 0;
    bool step = n == 1 && anneal_kv_cache_slot_len(kv, 0) > 0;
    anneal_tensor *logits = step ? anneal_model_decode_slots(m, kv, &slot0, ids, 1)
                                 : anneal_model_prefill_slot(m, kv, 0, ids, n);
    anneal_status s = logits ? anneal_to_f32_buffer(logits, buf) : anneal_last_status();
    anneal_scope_close(sc);
    return s;
}

anneal_status anneal_model_generate(anneal_model *m, const int32_t *prompt, int64_t n_prompt, int64_t max_new,
                                    const anneal_sampler_config *cfg, int32_t stop_id, anneal_token_fn on_token,
                                    void *user) {
    if (!m || !cfg || (!prompt && n_prompt > 0))
        return anneal_set_error(ANNEAL_ERR_ARG, "generate: NULL model, prompt or sampler config");
    if (n_prompt <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "generate: the prompt is empty");
    if (max_new < 0) return anneal_set_error(ANNEAL_ERR_ARG, "generate: max_new %lld < 0", (long long)max_new);
    if (max_new == 0) return ANNEAL_OK;
    int64_t n_ctx = m->cfg.n_ctx, keep = n_ctx / 2 > 0 ? n_ctx / 2 : 1, V = m->cfg.vocab_size;
    /* win: the tokens in the cache (at most n_ctx) and the one just sampled */
    int32_t *win = malloc((size_t)(n_ctx + 1) * sizeof *win);
    float *logits = malloc((size_t)V * sizeof *logits);
    anneal_kv_cache *kv = (win && logits) ? anneal_model_kv_cache_new(m, 1, n_ctx) : NULL;
    if (!kv) {
        free(win);
        free(logits);
        return win && logits ? anneal_last_status() : anneal_set_error(ANNEAL_ERR_OOM, "generate: out of memory");
    }
    /* The model sees at most n_ctx tokens: a longer prompt starts from its last n_ctx/2. */
    int64_t w = n_prompt > n_ctx ? keep : n_prompt;
    memcpy(win, prompt + n_prompt - w, (size_t)w * sizeof *win);
    anneal_status s = feed(m, kv, win, w, logits);
    /* pos: the position of the next token in the whole sequence (seeds its draw) */
    for (int64_t i = 0, pos = n_prompt; i < max_new && s == ANNEAL_OK; i++, pos++) {
        if ((s = anneal_interrupt_check("generating")) != ANNEAL_OK) break;
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
            anneal_kv_cache_reset(kv);
            s = feed(m, kv, win, w, logits);
        }
    }
    anneal_kv_cache_free(kv);
    free(win);
    free(logits);
    return s;
}
