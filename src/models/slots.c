/* The slots API of continuous batching (model.h): a cache's batch rows are independent
 * sequences. Prefill runs the model's cached forward (batched GEMMs over the prompt's
 * rows) on one slot, focused as a cache of batch 1, or under bf16 compute the decode
 * engine's prefill (its bf16 weight copies, chunks of rows); a decode step checks its arguments
 * once, then runs the decode engine (decode_engine.c: one pass over the weights for all
 * n rows) where the architecture offers one, or one cached forward per slot. */
#include "anneal/autograd.h"
#include "decode_engine.h"

#include <stdlib.h>
#include <string.h>

/* Checks the model and cache belong together (ANNEAL_ERR_ARG naming fn). */
static bool cache_ok(const anneal_model *m, const anneal_kv_cache *kv, const char *fn) {
    if (!m || !kv) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL model or cache", fn);
        return false;
    }
    if (anneal_kv_cache_owner(kv) != m) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: the cache was made for another model", fn);
        return false;
    }
    return true;
}

/* True when every id is in [0, vocab) (else ANNEAL_ERR_ARG naming fn and the index). */
static bool ids_ok(const anneal_model *m, const int32_t *ids, int64_t n, const char *fn) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->cfg.vocab_size) {
            anneal_set_error(ANNEAL_ERR_ARG, "%s: id %d at %lld is outside the vocabulary [0, %d)", fn, ids[i],
                             (long long)i, m->cfg.vocab_size);
            return false;
        }
    return true;
}

/* Whether a prefill runs the decode engine (anneal_decode_engine_prefill) before the
 * tensor path: under bf16 compute on the CPU, where the engine's bf16 weight copies
 * spare the tensor path's GEMMs their per-call weight packing. f32 compute and int8
 * models keep the tensor path's GEMMs, which measured faster than the engine's for a
 * 512-token prompt (int8: 598 against 520-580 tok/s, GPT-2 124M, 2 Zen 3 cores). */
static bool engine_prefills(const anneal_model *m) {
    return m->device == ANNEAL_CPU && m->ctx.compute == ANNEAL_BF16;
}

/* True when the n slots are in range and distinct and each has room for counts[i] more
 * positions (counts NULL: one each); else ANNEAL_ERR_ARG naming fn. */
static bool slots_ok(const anneal_model *m, const anneal_kv_cache *kv, const int64_t *slots, const int64_t *counts,
                     int64_t n, const char *fn) {
    int64_t S = anneal_kv_cache_slots(kv);
    int64_t cap = anneal_kv_cache_max_len(kv) < m->cfg.n_ctx ? anneal_kv_cache_max_len(kv) : m->cfg.n_ctx;
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= S) {
            anneal_set_error(ANNEAL_ERR_ARG, "%s: slot %lld (at %lld) is outside [0, %lld)", fn, (long long)slots[i],
                             (long long)i, (long long)S);
            return false;
        }
        for (int64_t j = 0; j < i; j++)
            if (slots[j] == slots[i]) {
                anneal_set_error(ANNEAL_ERR_ARG, "%s: slot %lld is given twice (at %lld and %lld)", fn,
                                 (long long)slots[i], (long long)j, (long long)i);
                return false;
            }
        int64_t len = anneal_kv_cache_slot_len(kv, slots[i]), c = counts ? counts[i] : 1;
        if (!counts && len >= cap) {
            anneal_set_error(ANNEAL_ERR_ARG, "%s: slot %lld is full (%lld positions)", fn, (long long)slots[i],
                             (long long)cap);
            return false;
        }
        if (c < 1 || c > cap - len) {
            anneal_set_error(ANNEAL_ERR_ARG, "%s: %lld ids for slot %lld, which holds %lld of %lld positions", fn,
                             (long long)c, (long long)slots[i], (long long)len, (long long)cap);
            return false;
        }
    }
    return true;
}

anneal_tensor *anneal_model_prefill_slot(anneal_model *m, anneal_kv_cache *kv, int64_t slot, const int32_t *ids,
                                         int64_t n) {
    static const char fn[] = "model_prefill_slot";
    if (!cache_ok(m, kv, fn)) return NULL;
    int64_t S = anneal_kv_cache_slots(kv), len = anneal_kv_cache_slot_len(kv, slot);
    if (slot < 0 || slot >= S) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: slot %lld is outside [0, %lld)", fn, (long long)slot, (long long)S);
        return NULL;
    }
    if (!ids || n < 1) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: %s", fn, ids ? "no ids (n < 1)" : "NULL ids");
        return NULL;
    }
    int64_t cap = anneal_kv_cache_max_len(kv) < m->cfg.n_ctx ? anneal_kv_cache_max_len(kv) : m->cfg.n_ctx;
    if (len + n > cap) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: slot %lld holds %lld positions; %lld more exceed the cache's %lld", fn,
                         (long long)slot, (long long)len, (long long)n, (long long)cap);
        return NULL;
    }
    if (!ids_ok(m, ids, n, fn)) return NULL;
    if (engine_prefills(m)) {
        anneal_tensor *out = anneal_empty(ANNEAL_F32, 2, (int64_t[]){1, m->cfg.vocab_size});
        if (!out) return NULL;
        anneal_no_grad_begin();
        anneal_status s = anneal_decode_engine_prefill(m, kv, slot, ids, n, anneal_data(out));
        anneal_no_grad_end();
        if (s == ANNEAL_OK) return out;
        if (s != ANNEAL_ERR_UNSUPPORTED) return NULL;
    }
    anneal_scope *outer = anneal_scope_current();
    anneal_scope *tmp = anneal_scope_open();
    anneal_tensor *logits = NULL;
    if (anneal_kv_cache_focus(kv, slot) == ANNEAL_OK) {
        anneal_tensor *t = anneal_from_data_on(anneal_model_device(m), ANNEAL_I32, 2, (int64_t[]){1, n}, ids);
        logits = t ? anneal_model_forward_cached_last(m, kv, t, 1) : NULL;
        anneal_kv_cache_focus(kv, -1);
    }
    if (logits) logits = anneal_reshape(logits, 2, (int64_t[]){1, m->cfg.vocab_size});
    if (logits) logits = anneal_contiguous(anneal_cast(logits, ANNEAL_F32));
    if (logits) anneal_keep(logits, outer);
    anneal_scope_close(tmp);
    return logits;
}

/* One cached forward per slot (any device, any architecture): row i of out from slot
 * slots[i] alone. On failure the slots already advanced are rolled back. */
static anneal_status decode_each(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots, const int32_t *ids,
                                 int64_t n, float *out) {
    int64_t V = m->cfg.vocab_size, i = 0;
    anneal_status s = ANNEAL_OK;
    for (; i < n && s == ANNEAL_OK; i++) {
        anneal_scope *sc = anneal_scope_open();
        s = anneal_kv_cache_focus(kv, slots[i]);
        anneal_tensor *t = s == ANNEAL_OK ? anneal_from_data_on(anneal_model_device(m), ANNEAL_I32, 2,
                                                                (int64_t[]){1, 1}, &ids[i])
                                          : NULL;
        anneal_tensor *lg = t ? anneal_model_forward_cached_last(m, kv, t, 1) : NULL;
        anneal_kv_cache_focus(kv, -1);
        if (s == ANNEAL_OK) s = lg ? anneal_to_f32_buffer(lg, out + i * V) : anneal_last_status();
        anneal_scope_close(sc);
    }
    if (s != ANNEAL_OK) /* the slots before the failing one advanced: take them back */
        for (int64_t j = 0; j + 1 < i; j++) {
            anneal_kv_cache_focus(kv, slots[j]);
            int64_t len = anneal_kv_cache_len(kv);
            anneal_kv_cache_focus(kv, -1);
            anneal_kv_cache_slot_reset(kv, slots[j]);
            anneal_kv_cache_slot_advance(kv, slots[j], len - 1);
        }
    return s;
}

anneal_tensor *anneal_model_decode_slots(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                         const int32_t *ids, int64_t n) {
    static const char fn[] = "model_decode_slots";
    if (!cache_ok(m, kv, fn)) return NULL;
    int64_t S = anneal_kv_cache_slots(kv);
    if (!slots || !ids || n < 1 || n > S) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: need 1 <= n <= %lld slots and ids (n = %lld%s)", fn, (long long)S,
                         (long long)n, !slots || !ids ? ", NULL slots or ids" : "");
        return NULL;
    }
    if (!slots_ok(m, kv, slots, NULL, n, fn)) return NULL;
    if (!ids_ok(m, ids, n, fn)) return NULL;
    int64_t V = m->cfg.vocab_size;
    anneal_tensor *out = anneal_empty(ANNEAL_F32, 2, (int64_t[]){n, V});
    if (!out) return NULL;
    anneal_no_grad_begin();
    anneal_status s = anneal_decode_engine_step(m, kv, slots, ids, n, anneal_data(out));
    if (s == ANNEAL_ERR_UNSUPPORTED) s = decode_each(m, kv, slots, ids, n, anneal_data(out));
    anneal_no_grad_end();
    return s == ANNEAL_OK ? out : NULL;
}

/* Whether a mixed pass with prompt_rows prompt rows runs as one engine pass: bf16
 * compute (the panel GEMM) and int8 models (the tensor path's int8 kernel) always; f32
 * weights only for a few prompt rows: the f32 GEMV's time grows with every row (a
 * 64-row prompt took 2.4x the tensor path's GEMM, GPT-2 124M on 2 Zen 3 cores) while a
 * 9-row one rode cheaper in the pass than a prefill of its own. */
static bool engine_extends(const anneal_model *m, int64_t prompt_rows) {
    if (m->device != ANNEAL_CPU) return false;
    if (m->ctx.compute == ANNEAL_BF16 || (m->params && m->params->quant != ANNEAL_QUANT_NONE)) return true;
    return prompt_rows <= 16;
}

/* anneal_model_extend_slots without one pass for all: each entry of more than one id
 * prefilled on its own, the single ids stepped together; logits row i into out. On
 * failure every slot is back at its length before the call. */
static anneal_status extend_apart(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots, const int32_t *ids,
                                  const int64_t *counts, int64_t n, float *out) {
    int64_t V = m->cfg.vocab_size, *len = malloc((size_t)n * sizeof *len), *one = malloc((size_t)n * sizeof *one);
    int32_t *one_ids = malloc((size_t)n * sizeof *one_ids);
    anneal_status s = len && one && one_ids ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "model_extend_slots: out of memory");
    int64_t n_one = 0, off = 0;
    for (int64_t i = 0; i < n && len; i++) len[i] = anneal_kv_cache_slot_len(kv, slots[i]);
    for (int64_t i = 0; i < n && s == ANNEAL_OK; off += counts[i], i++) {
        if (counts[i] == 1) {
            one[n_one] = i;
            one_ids[n_one++] = ids[off];
            continue;
        }
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *lg = anneal_model_prefill_slot(m, kv, slots[i], ids + off, counts[i]);
        s = lg ? anneal_to_f32_buffer(lg, out + i * V) : anneal_last_status();
        anneal_scope_close(sc);
    }
    if (s == ANNEAL_OK && n_one > 0) {
        anneal_scope *sc = anneal_scope_open();
        int64_t *sl = malloc((size_t)n_one * sizeof *sl);
        anneal_tensor *lg = NULL;
        if (sl) {
            for (int64_t k = 0; k < n_one; k++) sl[k] = slots[one[k]];
            lg = anneal_model_decode_slots(m, kv, sl, one_ids, n_one);
        }
        s = lg ? ANNEAL_OK : sl ? anneal_last_status() : anneal_set_error(ANNEAL_ERR_OOM, "model_extend_slots: out of memory");
        for (int64_t k = 0; lg && k < n_one; k++)
            memcpy(out + one[k] * V, (const float *)anneal_data(lg) + k * V, (size_t)V * sizeof *out);
        free(sl);
        anneal_scope_close(sc);
    }
    if (s != ANNEAL_OK && len) /* take back what advanced */
        for (int64_t i = 0; i < n; i++)
            if (anneal_kv_cache_slot_len(kv, slots[i]) != len[i]) {
                anneal_kv_cache_slot_reset(kv, slots[i]);
                if (len[i] > 0) anneal_kv_cache_slot_advance(kv, slots[i], len[i]);
            }
    free(len);
    free(one);
    free(one_ids);
    return s;
}

anneal_tensor *anneal_model_extend_slots(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                         const int32_t *ids, const int64_t *counts, int64_t n) {
    static const char fn[] = "model_extend_slots";
    if (!cache_ok(m, kv, fn)) return NULL;
    int64_t S = anneal_kv_cache_slots(kv);
    if (!slots || !ids || !counts || n < 1 || n > S) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: need 1 <= n <= %lld entries with slots, ids and counts (n = %lld%s)", fn,
                         (long long)S, (long long)n, !slots || !ids || !counts ? ", a NULL array" : "");
        return NULL;
    }
    if (!slots_ok(m, kv, slots, counts, n, fn)) return NULL;
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += counts[i];
    if (!ids_ok(m, ids, total, fn)) return NULL;
    int64_t V = m->cfg.vocab_size;
    anneal_tensor *out = anneal_empty(ANNEAL_F32, 2, (int64_t[]){n, V});
    if (!out) return NULL;
    float *o = anneal_data(out);
    int64_t prompt_rows = 0;
    for (int64_t i = 0; i < n; i++) prompt_rows += counts[i] > 1 ? counts[i] : 0;
    anneal_no_grad_begin();
    anneal_status s = engine_extends(m, prompt_rows) ? anneal_decode_engine_extend(m, kv, slots, ids, counts, n, o)
                                                     : ANNEAL_ERR_UNSUPPORTED;
    if (s == ANNEAL_ERR_UNSUPPORTED) s = extend_apart(m, kv, slots, ids, counts, n, o);
    anneal_no_grad_end();
    return s == ANNEAL_OK ? out : NULL;
}
