/* Shared by the Llama tests: a Hugging Face model directory (config.json +
 * model.safetensors, as tests/fixtures/gen_hf_llama.py writes) loaded into an anneal
 * model, and its reference.safetensors compared with anneal's logits, loss and every
 * gradient. */
#ifndef ANNEAL_TEST_LLAMA_FIXTURE_H
#define ANNEAL_TEST_LLAMA_FIXTURE_H

#include "anneal/anneal.h"
#include "test.h"

/* dir/name into a rotating static buffer. */
static inline const char *llama_fx_join(const char *dir, const char *name) {
    static char bufs[4][1024];
    static int next;
    char *b = bufs[next++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", dir, name);
    return b;
}

/* The model of HF directory dir (config.json read through the registry, weights through
 * hf_import), or NULL after a recorded failure. */
static inline anneal_model *llama_fx_load(const char *dir) {
    anneal_model_config cfg;
    if (anneal_model_config_from_hf_file(llama_fx_join(dir, "config.json"), &cfg) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "%s: config: %s", dir, anneal_last_error());
        return NULL;
    }
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (!m || anneal_model_load_safetensors(m, llama_fx_join(dir, "model.safetensors")) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "%s: weights: %s", dir, anneal_last_error());
        anneal_model_free(m);
        return NULL;
    }
    return m;
}

/* Largest |a - b| over n floats divided by the largest |b|: the error relative to the
 * tensor's scale. */
static inline double llama_fx_rel_err(const float *a, const float *b, int64_t n) {
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= e)) e = d; /* NaN propagates */
        if (fabs(b[i]) > s) s = fabs(b[i]);
    }
    return s > 0 ? e / s : e;
}

typedef struct llama_fx_errors {
    double logits, loss, grad; /* worst relative errors (grad: over every parameter) */
    const char *worst_grad;    /* the parameter of the worst gradient */
    int n_grads;               /* gradients compared */
} llama_fx_errors;

/* Runs m on the reference's ids at m's current compute precision: logits (no grad),
 * then the loss on targets and its backward; compares with the reference (every
 * parameter's gradient against "grad.<name>"). Missing tensors are failures. */
static inline llama_fx_errors llama_fx_compare(anneal_model *m, const char *dir) {
    llama_fx_errors e = {NAN, NAN, NAN, NULL, 0};
    anneal_safetensors *ref = NULL;
    if (anneal_safetensors_open(llama_fx_join(dir, "reference.safetensors"), &ref) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "%s", anneal_last_error());
        return e;
    }
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *ids = anneal_safetensors_load(ref, "ids", ANNEAL_I32);
    anneal_tensor *tg = anneal_safetensors_load(ref, "targets", ANNEAL_I32);
    anneal_tensor *want = anneal_safetensors_load(ref, "logits", ANNEAL_F32);
    anneal_tensor *want_loss = anneal_safetensors_load(ref, "loss", ANNEAL_F32);
    anneal_no_grad_begin();
    anneal_tensor *got = ids ? anneal_contiguous(anneal_model_logits(m, ids)) : NULL;
    anneal_no_grad_end();
    if (!got || !want || !anneal_same_shape(got, want)) {
        anneal_test_fail(__FILE__, __LINE__, "%s: logits: %s", dir, anneal_last_error());
    } else {
        e.logits = llama_fx_rel_err(anneal_data(got), anneal_data(want), anneal_numel(want));
    }
    anneal_params_zero_grad(m->params);
    anneal_tensor *loss = tg ? anneal_model_loss(m, ids, tg) : NULL;
    if (!loss || !want_loss || anneal_backward(loss) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "%s: loss/backward: %s", dir, anneal_last_error());
    } else {
        e.loss = fabs(anneal_item(loss) - anneal_item(want_loss)) / fabs(anneal_item(want_loss));
        e.grad = 0;
        for (int i = 0; i < m->params->n; i++) {
            const anneal_param *p = &m->params->items[i];
            char key[256];
            snprintf(key, sizeof key, "grad.%s", p->name);
            anneal_tensor *w = anneal_safetensors_load(ref, key, ANNEAL_F32);
            if (!w || !p->tensor->grad || !anneal_same_shape(w, p->tensor->grad)) {
                anneal_test_fail(__FILE__, __LINE__, "%s: gradient of %s: %s", dir, p->name, anneal_last_error());
                anneal_clear_error();
                e.grad = NAN;
                continue;
            }
            double r = llama_fx_rel_err(anneal_data(p->tensor->grad), anneal_data(w), anneal_numel(w));
            if (!(r <= e.grad)) {
                e.grad = r;
                e.worst_grad = p->name;
            }
            e.n_grads++;
        }
    }
    anneal_scope_close(sc);
    anneal_safetensors_close(ref);
    return e;
}

#endif
