/* A tiny GPT-2 (through the model interface) and a fixed batch for the gradient-sync and ZeRO tests: every rank
 * builds the same batch (from a fixed seed) and takes its rows; the reference is one
 * process running the whole batch. Header-only. */
#ifndef ANNEAL_TESTS_DIST_MODEL_H
#define ANNEAL_TESTS_DIST_MODEL_H

#include "dist_test.h"

#define DM_B 24 /* batch rows (divisible by 2, 3 and 4 ranks x 2 micro-steps) */
#define DM_T 8 /* tokens per row */

static int32_t dm_ids[DM_B * DM_T], dm_tg[DM_B * DM_T];

static inline anneal_model_config dm_config(void) {
    anneal_model_config c = {.arch = "gpt2", .n_layer = 2, .n_head = 2, .n_embd = 32, .vocab_size = 64, .n_ctx = 16,
                             .dropout = 0.0f, .norm_eps = 1e-5f, .recompute = ANNEAL_RECOMPUTE_NONE};
    return c;
}

/* The batch: tokens from the test RNG (same seed on every rank). */
static inline void dm_batch(uint64_t seed) {
    anneal_test_rng_state = seed;
    for (int i = 0; i < DM_B * DM_T; i++) {
        dm_ids[i] = (int32_t)(anneal_test_next_u64() % 64);
        dm_tg[i] = (int32_t)(anneal_test_next_u64() % 64);
    }
}

static inline anneal_model *dm_model(uint64_t seed) {
    anneal_model_config c = dm_config();
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (m && anneal_model_init(m, seed) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    return m;
}

/* Forward + backward of rows [row0, row0 + rows) (mean loss over them), gradients
 * accumulated into the parameters; the loss, NAN on failure. */
static inline double dm_backward(anneal_model *m, int row0, int rows) {
    anneal_scope *sc = anneal_scope_open();
    int64_t shape[2] = {rows, DM_T};
    anneal_tensor *ids = anneal_from_data(ANNEAL_I32, 2, shape, dm_ids + row0 * DM_T);
    anneal_tensor *tg = anneal_from_data(ANNEAL_I32, 2, shape, dm_tg + row0 * DM_T);
    anneal_tensor *loss = ids && tg ? anneal_model_loss(m, ids, tg) : NULL;
    double v = loss && anneal_backward(loss) == ANNEAL_OK ? anneal_item(loss) : NAN;
    anneal_scope_close(sc);
    return v;
}

/* Every gradient (missing ones as zeros) / every parameter concatenated; malloc'd. */
static inline float *dm_flat(const anneal_params *ps, bool grads) {
    float *out = malloc((size_t)anneal_params_numel(ps) * sizeof *out + 4);
    int64_t o = 0;
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *t = ps->items[i].tensor;
        int64_t n = anneal_numel(t);
        if (grads && !t->grad) memset(out + o, 0, (size_t)n * sizeof *out);
        else anneal_to_f32_buffer(grads ? t->grad : t, out + o);
        o += n;
    }
    return out;
}

/* max |a - b| / max |b|: the error relative to the gradient's scale (elementwise
 * relative error is meaningless for the many near-zero entries). */
static inline double dm_rel_err(const float *a, const float *b, int64_t n) {
    double md = 0, mb = 0;
    for (int64_t i = 0; i < n; i++) {
        md = fmax(md, fabs((double)a[i] - (double)b[i]));
        mb = fmax(mb, fabs((double)b[i]));
    }
    return mb > 0 ? md / mb : md;
}

#endif
