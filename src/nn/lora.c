/* LoRA adapters on dense layers, as PEFT's LoraLayer: y = base(x) + scale * (dropout(x)
 * A^T) B^T with A (r, in), B (out, r), scale = alpha / r. anneal_lora_apply finds the
 * dense layers of a parameter set by the last component of the prefix they were
 * created under (PEFT's target_modules), adds the adapters as trainable parameters
 * "<prefix>.lora_A.weight" / "<prefix>.lora_B.weight" (PEFT's names without the
 * "base_model.model." wrapper and adapter name), and freezes every other parameter;
 * optionally the frozen dense weights move to bf16 (anneal_dense reads them at compute
 * bf16 without a change in the numbers). */
#include "nn_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Last dot-separated component of a prefix ("c_attn" of "transformer.h.0.attn.c_attn"). */
static const char *last_component(const char *prefix) {
    const char *dot = strrchr(prefix, '.');
    return dot ? dot + 1 : prefix;
}

/* The output head ("lm_head") is a dense layer whose weight models hand to the fused
 * lm-head loss directly (anneal_linear_cross_entropy), not through the dense forward:
 * an adapter there would be ignored, and the loss needs its weight in f32. */
static bool is_head(const char *prefix) { return strcmp(last_component(prefix), "lm_head") == 0; }

static anneal_status check_config(const anneal_params *ps, const anneal_lora_config *c) {
    if (!ps || !c) return anneal_set_error(ANNEAL_ERR_ARG, "lora: NULL parameter set or config");
    if (ps->lora.rank > 0) return anneal_set_error(ANNEAL_ERR_STATE, "lora: the model has adapters already");
    if (c->rank <= 0 || c->rank > 65536) return anneal_set_error(ANNEAL_ERR_ARG, "lora: rank %d must be in [1, 65536]", c->rank);
    if (!(c->alpha > 0.0f) || !isfinite(c->alpha))
        return anneal_set_error(ANNEAL_ERR_ARG, "lora: alpha %g must be positive", (double)c->alpha);
    if (!(c->dropout >= 0.0f && c->dropout < 1.0f))
        return anneal_set_error(ANNEAL_ERR_ARG, "lora: dropout %g must be in [0, 1)", (double)c->dropout);
    if (c->n_targets <= 0 || !c->targets) return anneal_set_error(ANNEAL_ERR_ARG, "lora: no target modules");
    if (c->base_dtype != ANNEAL_F32 && c->base_dtype != ANNEAL_BF16)
        return anneal_set_error(ANNEAL_ERR_ARG, "lora: frozen weights are kept in f32 or bf16, not %s",
                                anneal_dtype_name(c->base_dtype));
    return ANNEAL_OK;
}

/* ANNEAL_ERR_ARG naming the first target that matches no dense layer, with the names
 * the set's dense layers end in. */
static anneal_status check_targets(const anneal_params *ps, const anneal_lora_config *c) {
    for (int t = 0; t < c->n_targets; t++) {
        const char *want = c->targets[t];
        if (!want || !*want) return anneal_set_error(ANNEAL_ERR_ARG, "lora: empty target module name");
        if (is_head(want))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "lora: target module 'lm_head': adapters on the output head "
                                    "are not supported (the fused lm-head loss reads its weight directly)");
        bool hit = false;
        for (int i = 0; i < ps->n_dense && !hit; i++) hit = strcmp(last_component(ps->dense[i].prefix), want) == 0;
        if (hit) continue;
        char known[512] = "";
        size_t k = 0;
        for (int i = 0; i < ps->n_dense && k + 2 < sizeof known; i++) {
            const char *n = last_component(ps->dense[i].prefix);
            if (is_head(n)) continue;
            bool seen = false;
            for (int j = 0; j < i && !seen; j++) seen = strcmp(last_component(ps->dense[j].prefix), n) == 0;
            if (!seen) k += (size_t)snprintf(known + k, sizeof known - k, "%s%s", k ? ", " : "", n);
        }
        return anneal_set_error(ANNEAL_ERR_ARG, "lora: target module '%s' matches no dense layer of the model (its dense "
                                "layers: %s)", want, k ? known : "none");
    }
    return ANNEAL_OK;
}

static bool is_target(const anneal_lora_config *c, const char *prefix) {
    const char *n = last_component(prefix);
    for (int t = 0; t < c->n_targets; t++)
        if (strcmp(c->targets[t], n) == 0) return true;
    return false;
}

/* "a,b,c" of the targets (malloc'd). */
static char *join_targets(const anneal_lora_config *c) {
    size_t n = 1;
    for (int t = 0; t < c->n_targets; t++) n += strlen(c->targets[t]) + 1;
    char *s = malloc(n), *p = s;
    if (!s) return NULL;
    for (int t = 0; t < c->n_targets; t++) p += sprintf(p, "%s%s", t ? "," : "", c->targets[t]);
    *p = '\0';
    return s;
}

/* The frozen weight w as a bf16 tensor put in its place (parameter and block). */
static anneal_status weight_to_bf16(anneal_params *ps, anneal_nn_dense *d) {
    anneal_param *p = NULL;
    for (int i = 0; i < ps->n && !p; i++)
        if (ps->items[i].tensor == d->weight) p = &ps->items[i];
    if (!p) return anneal_set_error(ANNEAL_ERR_STATE, "lora: a dense weight is not in the parameter set");
    if (p->tensor->dtype == ANNEAL_BF16) return ANNEAL_OK;
    anneal_scope_enter(NULL);
    anneal_tensor *h = anneal_empty_on(p->tensor->device, ANNEAL_BF16, p->tensor->ndim, p->tensor->shape);
    anneal_scope_leave();
    if (!h) return anneal_last_status();
    anneal_status s = anneal_copy_(h, p->tensor);
    if (s == ANNEAL_OK) s = anneal_params_replace(ps, p, h);
    if (s != ANNEAL_OK) {
        anneal_release(h);
        return s;
    }
    d->weight = h; /* the set's scope holds our reference now */
    return ANNEAL_OK;
}

anneal_status anneal_lora_apply(anneal_params *ps, const anneal_lora_config *c) {
    if (anneal_params_require_float(ps, "lora") != ANNEAL_OK) return anneal_last_status();
    if (ps && ps->quant != ANNEAL_QUANT_NONE)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "lora: the model is int8 quantized (adapters train on a float base)");
    anneal_status s = check_config(ps, c);
    if (s == ANNEAL_OK) s = check_targets(ps, c);
    if (s != ANNEAL_OK) return s;
    char *targets = join_targets(c);
    if (!targets) return anneal_set_error(ANNEAL_ERR_OOM, "lora: out of memory");
    int n_base = ps->n;
    for (int i = 0; i < n_base && s == ANNEAL_OK; i++) s = anneal_params_set_trainable(ps, &ps->items[i], false);
    for (int i = 0; i < ps->n_dense && s == ANNEAL_OK; i++) {
        anneal_params_dense *r = &ps->dense[i];
        if (!is_target(c, r->prefix)) continue;
        anneal_nn_dense *d = r->dense;
        anneal_nn_lora *l = calloc(1, sizeof *l);
        if (!l) {
            s = anneal_set_error(ANNEAL_ERR_OOM, "lora: out of memory");
            break;
        }
        *l = (anneal_nn_lora){.rank = c->rank, .alpha = c->alpha, .scale = c->alpha / (float)c->rank,
                              .dropout = c->dropout};
        r->lora = l;
        int64_t sa[2] = {c->rank, d->in}, sb[2] = {d->out, c->rank};
        l->a = anneal_nn_param(ps, r->prefix, "lora_A.weight", 2, sa, true);
        l->b = l->a ? anneal_nn_param(ps, r->prefix, "lora_B.weight", 2, sb, true) : NULL;
        if (!l->b) {
            s = anneal_last_status();
            break;
        }
        float bound = 1.0f / sqrtf((float)d->in); /* kaiming_uniform_(a=sqrt(5)) on (r, in) */
        s = anneal_init_uniform_(l->a, -bound, bound);
        if (s == ANNEAL_OK) d->lora = l;
    }
    for (int i = 0; i < ps->n_dense && s == ANNEAL_OK && c->base_dtype == ANNEAL_BF16; i++)
        if (!is_head(ps->dense[i].prefix)) s = weight_to_bf16(ps, ps->dense[i].dense);
    if (s != ANNEAL_OK) {
        free(targets);
        return s;
    }
    ps->lora = (anneal_params_lora){.rank = c->rank, .alpha = c->alpha, .dropout = c->dropout, .targets = targets};
    return ANNEAL_OK;
}

int anneal_lora_count(const anneal_params *ps) {
    int n = 0;
    for (int i = 0; ps && i < ps->n_dense; i++) n += ps->dense[i].lora != NULL && ps->dense[i].dense->lora != NULL;
    return n;
}


/* W (as stored, either layout) += scale * B A, one dense layer, on host copies. */
static anneal_status merge_one(anneal_nn_dense *d) {
    const anneal_nn_lora *l = d->lora;
    if (d->weight->dtype != ANNEAL_F32)
        return anneal_set_error(ANNEAL_ERR_DTYPE, "lora merge: base weight %s is %s, not f32", d->weight->name,
                                anneal_dtype_name(d->weight->dtype));
    int64_t in = d->in, out = d->out, r = l->rank;
    float *w = malloc((size_t)(in * out) * sizeof *w), *a = malloc((size_t)(r * in) * sizeof *a),
          *b = malloc((size_t)(out * r) * sizeof *b), *delta = malloc((size_t)in * sizeof *delta);
    anneal_status s = w && a && b && delta ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "lora merge: out of memory");
    if (s == ANNEAL_OK) s = anneal_to_f32_buffer(d->weight, w);
    if (s == ANNEAL_OK) s = anneal_to_f32_buffer(l->a, a);
    if (s == ANNEAL_OK) s = anneal_to_f32_buffer(l->b, b);
    bool in_out = d->layout == ANNEAL_WEIGHT_IN_OUT;
    for (int64_t o = 0; s == ANNEAL_OK && o < out; o++) {
        /* row o of B A in f32, then times scale (PEFT: (B @ A) * scaling) */
        for (int64_t i = 0; i < in; i++) delta[i] = 0.0f;
        for (int64_t k = 0; k < r; k++) {
            float bk = b[o * r + k];
            for (int64_t i = 0; i < in; i++) delta[i] += bk * a[k * in + i];
        }
        for (int64_t i = 0; i < in; i++) w[in_out ? i * out + o : o * in + i] += delta[i] * l->scale;
    }
    if (s == ANNEAL_OK) {
        anneal_scope_enter(NULL);
        anneal_tensor *h = anneal_from_data_on(d->weight->device, ANNEAL_F32, 2, d->weight->shape, w);
        anneal_scope_leave();
        s = h ? anneal_copy_(d->weight, h) : anneal_last_status();
        anneal_release(h);
    }
    free(w);
    free(a);
    free(b);
    free(delta);
    return s;
}

anneal_status anneal_lora_merge(anneal_params *ps) {
    if (!ps) return anneal_set_error(ANNEAL_ERR_ARG, "lora merge: NULL parameter set");
    if (anneal_lora_count(ps) == 0) return anneal_set_error(ANNEAL_ERR_STATE, "lora merge: the model has no adapters");
    anneal_status s = ANNEAL_OK;
    for (int i = 0; i < ps->n_dense && s == ANNEAL_OK; i++)
        if (ps->dense[i].dense->lora) s = merge_one(ps->dense[i].dense);
    if (s != ANNEAL_OK) return s;
    /* drop the adapter parameters (compacting the list) and unfreeze the rest */
    int k = 0;
    for (int i = 0; i < ps->n; i++) {
        anneal_param p = ps->items[i];
        bool adapter = false;
        for (int j = 0; j < ps->n_dense && !adapter; j++) {
            const anneal_nn_lora *l = ps->dense[j].lora;
            adapter = l && (p.tensor == l->a || p.tensor == l->b);
        }
        if (adapter) {
            anneal_release(p.tensor);
            free(p.name);
            continue;
        }
        ps->items[k++] = p;
    }
    ps->n = k;
    for (int j = 0; j < ps->n_dense; j++) {
        if (ps->dense[j].dense) ps->dense[j].dense->lora = NULL;
        free(ps->dense[j].lora);
        ps->dense[j].lora = NULL;
    }
    for (int i = 0; i < ps->n && s == ANNEAL_OK; i++) s = anneal_params_set_trainable(ps, &ps->items[i], true);
    free(ps->lora.targets);
    ps->lora = (anneal_params_lora){0};
    return s;
}
