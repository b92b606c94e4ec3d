/* int8 quantization of a parameter set's dense layers (weight-only, dynamic, static),
 * the calibration of static activation scales, and the forward of a quantized dense
 * layer. The hook is in the dense block (dense.c calls anneal_nn_quant_forward), so every
 * architecture built from anneal_nn_dense gets it without model code. */
#include "nn_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const char *anneal_quant_mode_name(anneal_quant_mode mode) {
    switch (mode) {
    case ANNEAL_QUANT_WEIGHT_ONLY: return "weight-only";
    case ANNEAL_QUANT_DYNAMIC: return "dynamic";
    case ANNEAL_QUANT_STATIC: return "static";
    default: return NULL;
    }
}

bool anneal_quant_mode_parse(const char *name, anneal_quant_mode *out) {
    for (int m = ANNEAL_QUANT_WEIGHT_ONLY; m <= ANNEAL_QUANT_STATIC; m++)
        if (name && strcmp(name, anneal_quant_mode_name((anneal_quant_mode)m)) == 0) {
            *out = (anneal_quant_mode)m;
            return true;
        }
    return false;
}

bool anneal_nn_quant_skips(const char *prefix) {
    const char *last = strrchr(prefix, '.');
    return strcmp(last ? last + 1 : prefix, "lm_head") == 0;
}

/* The layer's quant record, made on first use (owned by the set). */
static anneal_nn_quant *quant_of(anneal_params_dense *pd) {
    if (!pd->quant && !(pd->quant = calloc(1, sizeof *pd->quant))) {
        anneal_set_error(ANNEAL_ERR_OOM, "nn quant %s: out of memory", pd->prefix);
        return NULL;
    }
    pd->dense->quant = pd->quant;
    return pd->quant;
}

anneal_status anneal_nn_calibrate_begin(anneal_params *ps) {
    if (anneal_params_require_float(ps, "calibration") != ANNEAL_OK) return anneal_last_status();
    if (!ps) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_nn_calibrate_begin: NULL set");
    if (ps->quant != ANNEAL_QUANT_NONE)
        return anneal_set_error(ANNEAL_ERR_STATE, "calibration: the model is quantized already");
    for (int i = 0; i < ps->n_dense; i++) {
        anneal_params_dense *pd = &ps->dense[i];
        if (anneal_nn_quant_skips(pd->prefix)) continue;
        anneal_nn_quant *q = quant_of(pd);
        if (!q) return anneal_last_status();
        free(q->hist);
        *q = (anneal_nn_quant){.observing = true, .hist = calloc(ANNEAL_NN_QUANT_BINS, sizeof(double))};
        if (!q->hist) return anneal_set_error(ANNEAL_ERR_OOM, "calibration %s: out of memory", pd->prefix);
    }
    return ANNEAL_OK;
}

/* Adds |x| of n values to the statistics: the max, and a histogram over [0, hist_hi)
 * whose range doubles (neighbouring bins merged) until it covers the max, so its bin
 * edges stay those of the first range times powers of two. */
static void observe(anneal_nn_quant *q, const float *x, int64_t n) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (!(amax < INFINITY)) amax = 3.0e38f; /* a non-finite input: the range ends at the largest float */
    if (q->hist_hi <= 0.0f) q->hist_hi = amax > 0.0f ? amax * 1.0001f : 1e-6f;
    while (amax >= q->hist_hi) {
        for (int b = 0; b < ANNEAL_NN_QUANT_BINS / 2; b++) q->hist[b] = q->hist[2 * b] + q->hist[2 * b + 1];
        memset(q->hist + ANNEAL_NN_QUANT_BINS / 2, 0, ANNEAL_NN_QUANT_BINS / 2 * sizeof(double));
        q->hist_hi *= 2.0f;
    }
    const float inv = (float)ANNEAL_NN_QUANT_BINS / q->hist_hi;
    for (int64_t i = 0; i < n; i++) {
        int b = (int)(fminf(fabsf(x[i]), 3.0e38f) * inv);
        q->hist[b < ANNEAL_NN_QUANT_BINS ? b : ANNEAL_NN_QUANT_BINS - 1] += 1.0;
    }
    q->amax = fmaxf(q->amax, amax);
    q->count += (double)n;
}

anneal_status anneal_nn_calibrate_end(anneal_params *ps, anneal_calib_method method, double percentile) {
    if (!ps) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_nn_calibrate_end: NULL set");
    if (method == ANNEAL_CALIB_PERCENTILE && !(percentile > 0.0 && percentile <= 100.0))
        return anneal_set_error(ANNEAL_ERR_ARG, "calibration: the percentile must be in (0, 100], not %g", percentile);
    for (int i = 0; i < ps->n_dense; i++) {
        anneal_nn_quant *q = ps->dense[i].quant;
        if (!q || !q->observing) continue;
        if (q->count <= 0)
            return anneal_set_error(ANNEAL_ERR_STATE, "calibration: dense layer %s saw no input", ps->dense[i].prefix);
        float t = q->amax;
        if (method == ANNEAL_CALIB_PERCENTILE) {
            const double want = q->count * percentile / 100.0;
            double c = 0.0;
            for (int b = 0; b < ANNEAL_NN_QUANT_BINS; b++) {
                c += q->hist[b];
                if (c >= want) {
                    t = fminf(q->amax, (float)(b + 1) * (q->hist_hi / ANNEAL_NN_QUANT_BINS));
                    break;
                }
            }
        }
        q->act_scale = fmaxf(t / 127.0f, 1.1920928955078125e-07f);
        q->observing = false;
        free(q->hist);
        q->hist = NULL;
    }
    return ANNEAL_OK;
}

/* The (out, in) f32 weight of d as a contiguous tensor of the current scope. */
static anneal_tensor *weight_out_in(const anneal_nn_dense *d) {
    return d->layout == ANNEAL_WEIGHT_IN_OUT ? anneal_contiguous(anneal_transpose(d->weight, 0, 1))
                                             : anneal_contiguous(d->weight);
}

anneal_status anneal_nn_quant_attach(anneal_params *ps, anneal_params_dense *pd, anneal_quant_mode mode,
                                     int64_t group, anneal_tensor *weight, anneal_tensor *scale, float act_scale) {
    if (!ps || !pd || !weight || !scale) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_nn_quant_attach: NULL argument");
    const anneal_nn_dense *d = pd->dense;
    if (!anneal_quant_mode_name(mode))
        return anneal_set_error(ANNEAL_ERR_ARG, "nn quant %s: unknown quantization mode %d", pd->prefix, (int)mode);
    if (pd->lora) return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "nn quant %s: a layer with a LoRA adapter", pd->prefix);
    if (weight->dtype != ANNEAL_I8 || weight->ndim != 2 || weight->shape[0] != d->out || weight->shape[1] != d->in)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "nn quant %s: the weight must be int8 (%lld, %lld), not %s with %d dims",
                                pd->prefix, (long long)d->out, (long long)d->in, anneal_dtype_name(weight->dtype),
                                weight->ndim);
    if (group < 0 || (group > 0 && d->in % group))
        return anneal_set_error(ANNEAL_ERR_SHAPE, "nn quant %s: group size %lld does not divide in-features %lld",
                                pd->prefix, (long long)group, (long long)d->in);
    if (group > 0 && mode != ANNEAL_QUANT_WEIGHT_ONLY)
        return anneal_set_error(ANNEAL_ERR_ARG, "nn quant %s: group-wise scales are for weight-only quantization",
                                pd->prefix);
    const bool pg = group > 0;
    if (scale->dtype != ANNEAL_F32 || scale->ndim != (pg ? 2 : 1) || scale->shape[0] != d->out ||
        (pg && scale->shape[1] != d->in / group))
        return anneal_set_error(ANNEAL_ERR_SHAPE, "nn quant %s: the scales must be f32 (%lld%s%lld)", pd->prefix,
                                (long long)d->out, pg ? ", " : "", pg ? (long long)(d->in / group) : 0LL);
    if (mode == ANNEAL_QUANT_STATIC && !(act_scale > 0.0f && act_scale < 3.0e38f))
        return anneal_set_error(ANNEAL_ERR_ARG, "nn quant %s: the static input scale must be positive and finite (%g)",
                                pd->prefix, (double)act_scale);
    anneal_nn_quant *q = quant_of(pd);
    if (!q) return anneal_last_status();
    if (!anneal_keep(weight, ps->scope) || !anneal_keep(scale, ps->scope)) return anneal_last_status();
    free(q->hist);
    *q = (anneal_nn_quant){.active = true, .mode = mode, .group = group, .weight = weight, .scale = scale,
                           .act_scale = mode == ANNEAL_QUANT_STATIC ? act_scale : 0.0f};
    anneal_status s = anneal_nn_release_weight(ps, pd);
    if (s != ANNEAL_OK) return s;
    ps->quant = mode;
    ps->quant_group = group;
    return ANNEAL_OK;
}

anneal_status anneal_nn_quantize(anneal_params *ps, anneal_quant_mode mode, int64_t group) {
    if (anneal_params_require_float(ps, "quantize") != ANNEAL_OK) return anneal_last_status();
    if (!ps) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_nn_quantize: NULL set");
    if (!anneal_quant_mode_name(mode))
        return anneal_set_error(ANNEAL_ERR_ARG, "quantize: unknown quantization mode %d", (int)mode);
    if (ps->quant != ANNEAL_QUANT_NONE) return anneal_set_error(ANNEAL_ERR_STATE, "quantize: the model is quantized already");
    if (ps->lora.rank > 0) return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "quantize: the model has LoRA adapters (merge them first: anneal lora merge)");
    if (group != 0 && mode != ANNEAL_QUANT_WEIGHT_ONLY)
        return anneal_set_error(ANNEAL_ERR_ARG, "quantize: --group is for weight-only quantization (%s uses one scale per output channel)",
                                anneal_quant_mode_name(mode));
    if (group < 0) return anneal_set_error(ANNEAL_ERR_ARG, "quantize: negative group size %lld", (long long)group);
    int n = 0;
    for (int i = 0; i < ps->n_dense; i++) { /* every check before any change */
        anneal_params_dense *pd = &ps->dense[i];
        if (anneal_nn_quant_skips(pd->prefix)) continue;
        n++;
        if (pd->dense->weight->dtype != ANNEAL_F32)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "quantize: %s.weight is %s, not f32", pd->prefix,
                                    anneal_dtype_name(pd->dense->weight->dtype));
        if (group > 0 && pd->dense->in % group)
            return anneal_set_error(ANNEAL_ERR_SHAPE, "quantize: group size %lld does not divide the in-features %lld of %s",
                                    (long long)group, (long long)pd->dense->in, pd->prefix);
        if (mode == ANNEAL_QUANT_STATIC && (!pd->quant || pd->quant->observing || !(pd->quant->act_scale > 0.0f)))
            return anneal_set_error(ANNEAL_ERR_STATE, "quantize: static mode needs calibrated input scales (%s has none)",
                                    pd->prefix);
    }
    if (!n) return anneal_set_error(ANNEAL_ERR_ARG, "quantize: the model has no dense layer to quantize");
    for (int i = 0; i < ps->n_dense; i++) {
        anneal_params_dense *pd = &ps->dense[i];
        if (anneal_nn_quant_skips(pd->prefix)) continue;
        float act = pd->quant ? pd->quant->act_scale : 0.0f;
        anneal_scope *tmp = anneal_scope_open();
        anneal_tensor *scale = NULL;
        anneal_tensor *w = weight_out_in(pd->dense);
        anneal_tensor *q = w ? anneal_quantize_s8(w, group, &scale) : NULL;
        anneal_status s = q ? anneal_nn_quant_attach(ps, pd, mode, group, q, scale, act) : anneal_last_status();
        anneal_scope_close(tmp);
        if (s != ANNEAL_OK) return s;
    }
    return ANNEAL_OK;
}

/* See nn_internal.h. */
anneal_status anneal_nn_quant_observe(const anneal_nn_dense *d, anneal_tensor *x) {
    if (!x) return anneal_last_status();
    int64_t n = anneal_numel(x);
    float *buf = malloc((size_t)(n ? n : 1) * sizeof *buf);
    if (!buf) return anneal_set_error(ANNEAL_ERR_OOM, "calibration: no memory for %lld values", (long long)n);
    anneal_status s = anneal_to_f32_buffer(x, buf);
    if (s == ANNEAL_OK) observe(d->quant, buf, n);
    free(buf);
    return s;
}

/* See nn_internal.h. */
anneal_tensor *anneal_nn_quant_forward(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                       anneal_activation act, anneal_tensor *mul) {
    const anneal_nn_quant *q = d->quant;
    anneal_qmatmul_desc qd = {.mode = q->mode, .compute = ctx && ctx->compute == ANNEAL_BF16 ? ANNEAL_BF16 : ANNEAL_F32,
                              .group = q->group, .act_scale = q->act_scale};
    anneal_tensor *pre = anneal_qlinear(x, q->weight, q->scale, d->bias, &qd);
    return anneal_nn_act_unfused(pre, act, mul);
}

anneal_status anneal_nn_quant_head_attach(anneal_params *ps, anneal_quant_mode mode, anneal_tensor *weight,
                                          anneal_tensor *scale) {
    if (!ps || !weight || !scale) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_nn_quant_head_attach: NULL argument");
    if (ps->head) return anneal_set_error(ANNEAL_ERR_STATE, "nn quant lm head: quantized already");
    if (mode != ANNEAL_QUANT_WEIGHT_ONLY && mode != ANNEAL_QUANT_DYNAMIC)
        return anneal_set_error(ANNEAL_ERR_ARG, "nn quant lm head: mode %s (weight-only or dynamic)",
                                anneal_quant_mode_name(mode) ? anneal_quant_mode_name(mode) : "?");
    if (weight->dtype != ANNEAL_I8 || weight->ndim != 2 || weight->shape[0] <= 0 || weight->shape[1] <= 0)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "nn quant lm head: the weight must be int8 (vocab, C), not %s with %d dims",
                                anneal_dtype_name(weight->dtype), weight->ndim);
    if (scale->dtype != ANNEAL_F32 || scale->ndim != 1 || scale->shape[0] != weight->shape[0])
        return anneal_set_error(ANNEAL_ERR_SHAPE, "nn quant lm head: the scales must be f32 (%lld)",
                                (long long)weight->shape[0]);
    anneal_nn_quant *q = calloc(1, sizeof *q);
    if (!q) return anneal_set_error(ANNEAL_ERR_OOM, "nn quant lm head: out of memory");
    if (!anneal_keep(weight, ps->scope) || !anneal_keep(scale, ps->scope)) {
        free(q);
        return anneal_last_status();
    }
    *q = (anneal_nn_quant){.active = true, .mode = mode, .weight = weight, .scale = scale};
    ps->head = q;
    return ANNEAL_OK;
}

anneal_status anneal_nn_quantize_head(anneal_params *ps, anneal_tensor *w) {
    if (!ps || !w) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_nn_quantize_head: NULL argument");
    if (ps->quant == ANNEAL_QUANT_NONE)
        return anneal_set_error(ANNEAL_ERR_STATE, "quantize lm head: quantize the dense layers first");
    if (ps->head) return anneal_set_error(ANNEAL_ERR_STATE, "quantize lm head: quantized already");
    if (w->dtype != ANNEAL_F32 || w->ndim != 2)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "quantize lm head: the weight is %s with %d dims, not f32 (vocab, C)",
                                anneal_dtype_name(w->dtype), w->ndim);
    anneal_scope *tmp = anneal_scope_open();
    anneal_tensor *scale = NULL;
    anneal_tensor *q = anneal_quantize_s8(anneal_contiguous(w), 0, &scale);
    anneal_status s = q ? anneal_nn_quant_head_attach(ps, ps->quant == ANNEAL_QUANT_WEIGHT_ONLY ? ANNEAL_QUANT_WEIGHT_ONLY
                                                                                              : ANNEAL_QUANT_DYNAMIC,
                                                      q, scale)
                        : anneal_last_status();
    anneal_scope_close(tmp);
    return s;
}

anneal_tensor *anneal_nn_quant_head_forward(const anneal_params *ps, const anneal_nn_ctx *ctx, anneal_tensor *h) {
    if (!ps || !ps->head) {
        anneal_set_error(ANNEAL_ERR_STATE, "nn quant lm head: the head is not quantized");
        return NULL;
    }
    const anneal_nn_quant *q = ps->head;
    anneal_qmatmul_desc qd = {.mode = q->mode, .compute = ctx && ctx->compute == ANNEAL_BF16 ? ANNEAL_BF16 : ANNEAL_F32};
    return anneal_qlinear(h, q->weight, q->scale, NULL, &qd);
}

anneal_tensor *anneal_nn_quant_head_loss(const anneal_params *ps, const anneal_nn_ctx *ctx, anneal_tensor *h,
                                         anneal_tensor *targets, int32_t ignore_index) {
    enum { CHUNK = 256 }; /* rows of logits made at a time: 256 x vocab f32 */
    if (!h || !targets) return NULL;
    const int64_t C = h->ndim > 0 ? h->shape[h->ndim - 1] : 0, rows = anneal_numel(targets);
    if (C <= 0 || rows * C != anneal_numel(h)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "nn quant lm head loss: %lld targets for hidden states of %lld values",
                         (long long)rows, (long long)anneal_numel(h));
        return NULL;
    }
    float *t = malloc((size_t)(rows ? rows : 1) * sizeof *t);
    if (!t) {
        anneal_set_error(ANNEAL_ERR_OOM, "nn quant lm head loss: out of memory");
        return NULL;
    }
    if (anneal_to_f32_buffer(targets, t) != ANNEAL_OK) {
        free(t);
        return NULL;
    }
    anneal_tensor *h2 = anneal_reshape(anneal_contiguous(h), 2, (int64_t[]){rows, C});
    anneal_tensor *t1 = anneal_reshape(anneal_contiguous(targets), 1, (int64_t[]){rows});
    double sum = 0.0;
    int64_t count = 0;
    bool ok = h2 && t1;
    for (int64_t r0 = 0; ok && r0 < rows; r0 += CHUNK) {
        const int64_t n = rows - r0 < CHUNK ? rows - r0 : CHUNK;
        int64_t valid = 0;
        for (int64_t i = r0; i < r0 + n; i++) valid += t[i] != (float)ignore_index;
        if (!valid) continue;
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *l = anneal_cross_entropy(anneal_nn_quant_head_forward(ps, ctx, anneal_narrow(h2, 0, r0, n)),
                                                anneal_narrow(t1, 0, r0, n), ignore_index);
        if (l) sum += (double)anneal_item(l) * (double)valid, count += valid;
        ok = l != NULL;
        anneal_scope_close(sc);
    }
    free(t);
    return ok ? anneal_scalar(count ? (float)(sum / (double)count) : 0.0f) : NULL;
}
