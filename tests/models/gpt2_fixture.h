/* Fixture helpers shared by the GPT-2 parity tests: tensors of a safetensors fixture
 * and of anneal, as malloc'd f32 buffers (the caller frees them). */
#ifndef ANNEAL_TEST_GPT2_FIXTURE_H
#define ANNEAL_TEST_GPT2_FIXTURE_H

#include "anneal/anneal.h"

#include <stdlib.h>

/* Entry `name` of st as f32 (numel in *n); NULL (and *n = 0) if absent. */
static inline float *entry_f32(const anneal_safetensors *st, const char *name, int64_t *n) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *t = anneal_safetensors_load(st, name, ANNEAL_F32);
    float *out = NULL;
    *n = 0;
    if (t) {
        *n = anneal_numel(t);
        out = malloc((size_t)(*n ? *n : 1) * sizeof *out);
        anneal_to_f32_buffer(t, out);
    }
    anneal_scope_close(s);
    return out;
}

/* The elements of t as f32. */
static inline float *tensor_f32(const anneal_tensor *t) {
    float *out = malloc((size_t)(anneal_numel(t) ? anneal_numel(t) : 1) * sizeof *out);
    anneal_to_f32_buffer(t, out);
    return out;
}

#endif
