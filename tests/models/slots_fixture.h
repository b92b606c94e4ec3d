/* Shared by the slots tests (test_decode_slots.c, test_engine_prefill.c): random ids,
 * a random model whose logits are far from uniform, its full-forward logits, and the
 * relative error the tests bound. */
#ifndef ANNEAL_TEST_SLOTS_FIXTURE_H
#define ANNEAL_TEST_SLOTS_FIXTURE_H

#include "anneal/anneal.h"

#include <math.h>
#include <string.h>

static int32_t lcg_id(uint64_t *s, int V) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int32_t)((*s >> 33) % (uint64_t)V);
}

/* A random model of preset name with weights large enough that logits are far from
 * uniform and positions matter (norm weights 1, biases and matrices normal). */
static anneal_model *make_model(const char *preset, bool qkv_bias, uint64_t seed) {
    anneal_model_config c;
    if (!anneal_model_preset(preset, &c)) return NULL;
    c.n_ctx = 64;
    if (qkv_bias) c.qkv_bias = c.out_bias = true;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (!m) return NULL;
    anneal_manual_seed(seed);
    anneal_scope *sc = anneal_scope_open();
    for (int i = 0; i < m->params->n; i++) {
        anneal_param *p = &m->params->items[i];
        bool norm = strstr(p->name, "norm") || strstr(p->name, "ln_");
        if (norm && p->tensor->ndim == 1 && strstr(p->name, "weight"))
            anneal_init_fill_(p->tensor, 1.0f);
        else
            anneal_init_normal_(p->tensor, 0.0f, p->tensor->ndim == 1 ? 0.1f : 0.2f);
    }
    anneal_scope_close(sc);
    return m;
}

/* Full-forward logits (T, V) of one sequence into out. */
static bool full_logits(anneal_model *m, const int32_t *ids, int64_t T, float *out) {
    anneal_scope *sc = anneal_scope_open();
    anneal_no_grad_begin();
    anneal_tensor *lg = anneal_model_logits(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, T}, ids));
    anneal_no_grad_end();
    bool ok = lg && anneal_to_f32_buffer(lg, out) == ANNEAL_OK;
    anneal_scope_close(sc);
    return ok;
}

/* Largest |a - b| over n, divided by the largest |b|. */
static double rel_err(const float *a, const float *b, int64_t n) {
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        e = fmax(e, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)b[i]));
    }
    return s > 0 ? e / s : e;
}

#endif
