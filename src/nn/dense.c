/* The dense layer block: a weight in torch.nn.Linear's (out, in) or Hugging Face
 * Conv1D's (in, out) layout, an optional bias, and one GEMM per forward with the
 * activation fused into its epilogue (anneal_dense); with a LoRA adapter (lora.c) the
 * base product plus the adapter's, then the activation unfused. Also the name helper
 * of every block. */
#include "nn_internal.h"

#include <stdio.h>

bool anneal_nn_name(char *buf, size_t n, const char *what, const char *prefix, const char *name) {
    if (!name) {
        anneal_set_error(ANNEAL_ERR_ARG, "nn %s %s: a name is missing", what, prefix ? prefix : "");
        return false;
    }
    int k = prefix && *prefix ? snprintf(buf, n, "%s.%s", prefix, name) : snprintf(buf, n, "%s", name);
    if (k >= 0 && (size_t)k < n) return true;
    anneal_set_error(ANNEAL_ERR_ARG, "nn %s: name %s.%s is longer than %zu bytes", what, prefix ? prefix : "", name,
                     n - 1);
    return false;
}

anneal_tensor *anneal_nn_param(anneal_params *ps, const char *prefix, const char *suffix, int ndim,
                               const int64_t *shape, bool decay) {
    char name[ANNEAL_NN_NAME_MAX];
    if (!anneal_nn_name(name, sizeof name, "parameter", prefix, suffix)) return NULL;
    return anneal_params_create(ps, name, ndim, shape, decay);
}

anneal_status anneal_nn_dense_create(anneal_nn_dense *d, anneal_params *ps, const char *prefix, int64_t in,
                                     int64_t out, anneal_weight_layout layout, bool bias) {
    if (!d || !ps) return anneal_set_error(ANNEAL_ERR_ARG, "nn dense %s: NULL block or parameter set", prefix);
    if (in <= 0 || out <= 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "nn dense %s: sizes must be positive (in %lld, out %lld)", prefix,
                                (long long)in, (long long)out);
    *d = (anneal_nn_dense){.layout = layout, .in = in, .out = out};
    int64_t shape[2] = {layout == ANNEAL_WEIGHT_IN_OUT ? in : out, layout == ANNEAL_WEIGHT_IN_OUT ? out : in};
    if (!(d->weight = anneal_nn_param(ps, prefix, "weight", 2, shape, true))) return anneal_last_status();
    if (bias && !(d->bias = anneal_nn_param(ps, prefix, "bias", 1, &out, false))) return anneal_last_status();
    return anneal_params_add_dense(ps, prefix, d);
}

/* The adapter's path (lora.c adds adapters; running one is the dense layer's). */
anneal_tensor *anneal_nn_lora_forward(const anneal_nn_lora *l, const anneal_nn_ctx *ctx, anneal_tensor *x) {
    if (!l || !x) return NULL;
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = ctx ? ctx->compute : ANNEAL_F32};
    bool train = ctx && ctx->training;
    anneal_tensor *h = l->dropout > 0.0f ? anneal_dropout(x, l->dropout, train) : x;
    o.x_kept_f32 = h == x; /* the base layer's node saves x in f32 anyway: no bf16 copy beside it */
    anneal_tensor *t = anneal_dense(h, l->a, NULL, &o); /* (..., r) */
    o.x_kept_f32 = false;
    return anneal_scale(anneal_dense(t, l->b, NULL, &o), l->scale);
}

anneal_tensor *anneal_nn_dense_forward_kept(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                            anneal_activation act, anneal_tensor *mul, bool x_kept_f32) {
    if (!d || !x) return NULL;
    if (d->quant && d->quant->active) return anneal_nn_quant_forward(d, ctx, x, act, mul); /* int8 (quant.c) */
    if (d->panels) return anneal_nn_packed_forward(d, x, act, mul); /* bf16 panels (packed.c) */
    if (d->quant && d->quant->observing && anneal_nn_quant_observe(d, x) != ANNEAL_OK) return NULL; /* calibration */
    anneal_dense_opts o = {.layout = d->layout, .act = act, .mul = mul, .compute = ctx ? ctx->compute : ANNEAL_F32,
                           .x_kept_f32 = x_kept_f32};
    if (!d->lora) return anneal_dense(x, d->weight, d->bias, &o);
    /* with an adapter the activation cannot sit in the base GEMM's epilogue: its input
     * is the sum of the base product and the adapter's */
    if (act != ANNEAL_ACT_SILU_MUL && mul) {
        anneal_set_error(ANNEAL_ERR_ARG, "nn dense: mul is only for ANNEAL_ACT_SILU_MUL");
        return NULL;
    }
    o.act = ANNEAL_ACT_NONE;
    o.mul = NULL;
    anneal_tensor *pre = anneal_add(anneal_dense(x, d->weight, d->bias, &o), anneal_nn_lora_forward(d->lora, ctx, x));
    return anneal_nn_act_unfused(pre, act, mul);
}

anneal_tensor *anneal_nn_dense_forward_act(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                           anneal_activation act, anneal_tensor *mul) {
    return anneal_nn_dense_forward_kept(d, ctx, x, act, mul, false);
}

anneal_tensor *anneal_nn_dense_forward(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x) {
    return anneal_nn_dense_forward_act(d, ctx, x, ANNEAL_ACT_NONE, NULL);
}
