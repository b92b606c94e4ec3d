/* Named parameter sets: an ordered list of (name, f32 leaf tensor, decay flag)
 * whose tensors live in one long-lived scope owned by the set, plus the in-place
 * initialisers (normal, fill) models use to set their starting values. */
#include "nn_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "anneal/autograd.h"
#include "anneal/backend.h"

/* Empty set with its own detached scope; NULL + ANNEAL_ERR_OOM on failure. */
anneal_params *anneal_params_new(void) { return anneal_params_new_on(ANNEAL_CPU); }

/* As anneal_params_new, the parameters created on dev. */
anneal_params *anneal_params_new_on(anneal_device dev) {
    anneal_params *ps = calloc(1, sizeof *ps);
    if (!ps) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a parameter set");
        return NULL;
    }
    ps->scope = anneal_scope_new();
    if (!ps->scope) {
        free(ps);
        return NULL;
    }
    ps->device = dev;
    return ps;
}

/* Releases every parameter tensor (and with it its grad) through the scope, then
 * the names and the set itself. NULL is fine. */
void anneal_params_free(anneal_params *ps) {
    if (!ps) return;
    anneal_scope_free(ps->scope);
    for (int i = 0; i < ps->n; i++) free(ps->items[i].name);
    free(ps->items);
    for (int i = 0; i < ps->n_dense; i++) {
        free(ps->dense[i].prefix);
        free(ps->dense[i].lora);
        if (ps->dense[i].quant) free(ps->dense[i].quant->hist);
        free(ps->dense[i].quant);
    }
    free(ps->dense);
    free(ps->head);
    free(ps->lora.targets);
    free(ps);
}

/* Linear search by name: sets hold hundreds of parameters at most and lookups
 * happen at load/registration time, not per step. */
anneal_param *anneal_params_find(const anneal_params *ps, const char *name) {
    if (!ps || !name) return NULL;
    for (int i = 0; i < ps->n; i++)
        if (strcmp(ps->items[i].name, name) == 0) return &ps->items[i];
    return NULL;
}

/* Set by anneal_params_defer_storage: new parameters get no storage. */
static _Thread_local bool defer_storage;

void anneal_params_defer_storage(bool on) { defer_storage = on; }

/* A contiguous f32 tensor of shape without storage (the header only): an alias of a
 * one-element tensor with zero strides, its storage dropped, its strides made the
 * contiguous ones for the storage anneal_tensor_set_storage gives it later. */
static anneal_tensor *storageless(anneal_device dev, int ndim, const int64_t *shape) {
    int64_t one = 1, zero[ANNEAL_MAX_DIMS] = {0};
    if (ndim < 0 || ndim > ANNEAL_MAX_DIMS) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_create: rank %d is outside 0..%d", ndim, ANNEAL_MAX_DIMS);
        return NULL;
    }
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0) {
            anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_create: negative size in dim %d", i);
            return NULL;
        }
    anneal_scope_enter(NULL);
    anneal_tensor *unit = anneal_empty_on(dev, ANNEAL_F32, 1, &one);
    anneal_scope_leave();
    anneal_tensor *t = unit ? anneal_alias(unit, ndim, shape, zero, 0) : NULL;
    anneal_release(unit);
    if (!t) return NULL;
    anneal_tensor_set_storage(t, NULL, 0);
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->strides[i] = stride;
        stride *= shape[i];
    }
    return t;
}

/* Registers a zero-filled f32 leaf (requires_grad, named) of `shape` created in the
 * set's scope. Checks everything before allocating so a failure leaves ps as it was. */
anneal_tensor *anneal_params_create(anneal_params *ps, const char *name, int ndim,
                                    const int64_t *shape, bool decay) {
    if (!ps || !name || !name[0]) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_create: %s",
                         !ps ? "NULL parameter set" : "empty or NULL name");
        return NULL;
    }
    if (anneal_interrupt_check("creating the model's parameters") != ANNEAL_OK) return NULL; /* a stop during setup */
    if (anneal_params_find(ps, name)) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_create: duplicate parameter name '%s'", name);
        return NULL;
    }
    if (ps->n == ps->cap) {
        int cap = ps->cap ? 2 * ps->cap : 16;
        anneal_param *items = realloc(ps->items, (size_t)cap * sizeof *items);
        if (!items) {
            anneal_set_error(ANNEAL_ERR_OOM, "out of memory registering parameter '%s'", name);
            return NULL;
        }
        ps->items = items;
        ps->cap = cap;
    }
    char *copy = strdup(name);
    if (!copy) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory registering parameter '%s'", name);
        return NULL;
    }
    anneal_scope_enter(ps->scope);
    anneal_tensor *t = NULL; /* the constructors check ndim/shape */
    if (defer_storage) {
        t = storageless(ps->device, ndim, shape);
    } else if (ps->device == ANNEAL_CPU) {
        t = anneal_zeros(ANNEAL_F32, ndim, shape);
    } else if ((t = anneal_empty_on(ps->device, ANNEAL_F32, ndim, shape)) && anneal_init_fill_(t, 0.0f) != ANNEAL_OK) {
        anneal_release(t);
        t = NULL;
    }
    anneal_scope_leave();
    if (!t || anneal_set_requires_grad(t, true) != ANNEAL_OK || !anneal_set_name(t, name)) {
        anneal_release(t); /* drops the scope's reference (NULL is fine) */
        free(copy);
        return NULL;
    }
    ps->items[ps->n++] = (anneal_param){.name = copy, .tensor = t, .decay = decay, .trainable = true};
    return t;
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

/* Host copies one parameter at a time (f32), hashed with its name and shape. */
uint64_t anneal_params_fingerprint(const anneal_params *ps, bool frozen_only) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int i = 0; ps && i < ps->n; i++) {
        const anneal_param *p = &ps->items[i];
        if (frozen_only && p->trainable) continue;
        int64_t n = anneal_numel(p->tensor);
        float *buf = malloc((size_t)(n ? n : 1) * sizeof *buf);
        if (!buf) {
            anneal_set_error(ANNEAL_ERR_OOM, "fingerprint of %s: out of memory", p->name);
            return 0;
        }
        if (anneal_to_f32_buffer(p->tensor, buf) != ANNEAL_OK) {
            free(buf);
            return 0;
        }
        h = fnv1a(h, p->name, strlen(p->name) + 1);
        h = fnv1a(h, p->tensor->shape, (size_t)p->tensor->ndim * sizeof p->tensor->shape[0]);
        h = fnv1a(h, buf, (size_t)n * sizeof *buf);
        free(buf);
    }
    return h ? h : 1;
}

/* Appends (prefix copy, d) to the set's dense records. */
anneal_status anneal_params_add_dense(anneal_params *ps, const char *prefix, struct anneal_nn_dense *d) {
    if (!ps || !d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_add_dense: NULL set or block");
    if (ps->n_dense == ps->cap_dense) {
        int cap = ps->cap_dense ? 2 * ps->cap_dense : 16;
        anneal_params_dense *r = realloc(ps->dense, (size_t)cap * sizeof *r);
        if (!r) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory recording dense layer '%s'", prefix);
        ps->dense = r;
        ps->cap_dense = cap;
    }
    char *copy = strdup(prefix ? prefix : "");
    if (!copy) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory recording dense layer '%s'", prefix);
    ps->dense[ps->n_dense++] = (anneal_params_dense){.prefix = copy, .dense = d};
    return ANNEAL_OK;
}

/* requires_grad follows the flag; a frozen parameter's gradient is dropped. */
anneal_status anneal_params_set_trainable(anneal_params *ps, anneal_param *p, bool trainable) {
    if (!ps || !p || !p->tensor) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_set_trainable: NULL argument");
    if (trainable && p->tensor->dtype != ANNEAL_F32)
        return anneal_set_error(ANNEAL_ERR_DTYPE, "parameter %s is %s: only f32 parameters can be trained", p->name,
                                anneal_dtype_name(p->tensor->dtype));
    anneal_grad_clear(p->tensor);
    anneal_status s = anneal_set_requires_grad(p->tensor, trainable);
    if (s == ANNEAL_OK) p->trainable = trainable;
    return s;
}

/* Sum of numel over the trainable parameters. */
int64_t anneal_params_numel_trainable(const anneal_params *ps) {
    int64_t n = 0;
    for (int i = 0; ps && i < ps->n; i++)
        if (ps->items[i].trainable) n += anneal_numel(ps->items[i].tensor);
    return n;
}

/* Swaps p's tensor for t: t gets the set's scope (the caller's reference stays the
 * caller's), the old tensor's scope reference is dropped. */
anneal_status anneal_params_replace(anneal_params *ps, anneal_param *p, anneal_tensor *t) {
    if (!ps || !p || !t) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_replace: NULL argument");
    if (!anneal_same_shape(t, p->tensor)) {
        char a[96], b[96];
        return anneal_set_error(ANNEAL_ERR_SHAPE, "anneal_params_replace: %s is %s, the replacement %s", p->name,
                                anneal_shape_str(p->tensor, a, sizeof a), anneal_shape_str(t, b, sizeof b));
    }
    if (!anneal_keep(t, ps->scope) || !anneal_set_name(t, p->name)) return anneal_last_status();
    anneal_status s = anneal_set_requires_grad(t, p->trainable);
    if (s != ANNEAL_OK) return s;
    anneal_release(p->tensor);
    p->tensor = t;
    return ANNEAL_OK;
}

/* See nn.h: a set packed as bf16 panels has no float weights to give. */
anneal_status anneal_params_require_float(const anneal_params *ps, const char *what) {
    if (ps && ps->packed_bf16)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: the model's dense weights were packed as bf16 panels for inference and their float "
                                "values released (load the model again without packing)",
                                what);
    return ANNEAL_OK;
}

/* The f32 weight of pd as a frozen stride-0 view of one zero (see nn_internal.h). */
anneal_status anneal_nn_release_weight(anneal_params *ps, anneal_params_dense *pd) {
    anneal_param *p = NULL;
    for (int i = 0; i < ps->n && !p; i++)
        if (ps->items[i].tensor == pd->dense->weight) p = &ps->items[i];
    if (!p) return anneal_set_error(ANNEAL_ERR_STATE, "nn %s: its weight is not a parameter of the set", pd->prefix);
    anneal_status s = anneal_params_set_trainable(ps, p, false);
    if (s != ANNEAL_OK) return s;
    anneal_scope *tmp = anneal_scope_open();
    anneal_tensor *one = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){1});
    anneal_tensor *z = one ? anneal_alias(one, 2, p->tensor->shape, (int64_t[]){0, 0}, 0) : NULL;
    s = z ? anneal_params_replace(ps, p, z) : anneal_last_status();
    anneal_scope_close(tmp);
    if (s == ANNEAL_OK) pd->dense->weight = z;
    return s;
}

/* Sum of numel over the registered parameters (0 for NULL). */
int64_t anneal_params_numel(const anneal_params *ps) {
    int64_t n = 0;
    if (!ps) return 0;
    for (int i = 0; i < ps->n; i++) n += anneal_numel(ps->items[i].tensor);
    return n;
}

/* Sets every parameter's grad to none (set_to_none semantics). */
void anneal_params_zero_grad(anneal_params *ps) {
    if (!ps) return;
    for (int i = 0; i < ps->n; i++) anneal_grad_clear(ps->items[i].tensor);
}

/* Backend of t after the common checks of the initialisers (NULL + error). */
static const anneal_backend *init_backend(const char *fn, const anneal_tensor *t) {
    if (!t) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL tensor", fn);
        return NULL;
    }
    return anneal_backend_get(t->device);
}

/* Fills t (any float dtype, any strides) with N(mean, std) from the global Philox
 * generator, advancing it by 2*numel counter values exactly like anneal_randn, so the
 * same seed gives the same values whether a tensor is made by randn or initialised
 * here. Non-contiguous or non-f32 tensors go through a contiguous f32 temporary. */
anneal_status anneal_init_normal_(anneal_tensor *t, float mean, float std) {
    if (anneal_interrupt_check("initialising the model") != ANNEAL_OK) return ANNEAL_ERR_INTERRUPTED;
    const anneal_backend *be = init_backend("anneal_init_normal_", t);
    if (!be) return anneal_last_status();
    if (!anneal_dtype_is_float(t->dtype))
        return anneal_set_error(ANNEAL_ERR_DTYPE, "anneal_init_normal_: needs a float tensor, got %s",
                                anneal_dtype_name(t->dtype));
    if (!isfinite(mean) || !isfinite(std) || std < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_init_normal_: bad mean %g / std %g",
                                (double)mean, (double)std);
    int64_t n = anneal_numel(t);
    if (n == 0) return ANNEAL_OK;
    anneal_rng_state rs = anneal_rng_get();
    uint64_t offset = anneal_rng_reserve(2 * (uint64_t)n);
    if (!t->storage) return ANNEAL_OK; /* a parameter without storage: its draws skipped */
    if (t->dtype == ANNEAL_F32 && anneal_is_contiguous(t))
        return be->randn(be->ctx, t, mean, std, rs.seed, offset);
    anneal_scope_enter(NULL);
    anneal_tensor *tmp = anneal_empty_on(t->device, ANNEAL_F32, t->ndim, t->shape);
    anneal_scope_leave();
    if (!tmp) return anneal_last_status();
    anneal_status s = be->randn(be->ctx, tmp, mean, std, rs.seed, offset);
    if (s == ANNEAL_OK) s = be->copy(be->ctx, t, tmp);
    anneal_release(tmp);
    return s;
}

/* Host-side uniforms: counter block c of the reserved range gives elements 4c..4c+3,
 * each the top 24 bits of its word scaled to [0, 1). */
anneal_status anneal_init_uniform_(anneal_tensor *t, float lo, float hi) {
    const anneal_backend *be = init_backend("anneal_init_uniform_", t);
    if (!be) return anneal_last_status();
    if (!anneal_dtype_is_float(t->dtype))
        return anneal_set_error(ANNEAL_ERR_DTYPE, "anneal_init_uniform_: needs a float tensor, got %s",
                                anneal_dtype_name(t->dtype));
    if (!isfinite(lo) || !isfinite(hi) || hi < lo)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_init_uniform_: bad range [%g, %g)", (double)lo, (double)hi);
    int64_t n = anneal_numel(t);
    if (n == 0) return ANNEAL_OK;
    anneal_rng_state rs = anneal_rng_get();
    uint64_t offset = anneal_rng_reserve(4 * (((uint64_t)n + 3) / 4));
    if (!t->storage) return ANNEAL_OK; /* a parameter without storage: its draws skipped */
    float *h = malloc((size_t)n * sizeof *h);
    if (!h) return anneal_set_error(ANNEAL_ERR_OOM, "anneal_init_uniform_: out of memory for %lld values", (long long)n);
    for (int64_t i = 0; i < n; i += 4) {
        uint32_t r[4];
        uint64_t c = offset / 4 + (uint64_t)i / 4;
        anneal_philox4x32(rs.seed, 0, c, r);
        for (int k = 0; k < 4 && i + k < n; k++) h[i + k] = lo + (hi - lo) * (float)(r[k] >> 8) * 0x1p-24f;
    }
    anneal_scope_enter(NULL);
    anneal_tensor *src = anneal_from_data_on(t->device, ANNEAL_F32, t->ndim, t->shape, h);
    anneal_scope_leave();
    free(h);
    if (!src) return anneal_last_status();
    anneal_status s = be->copy(be->ctx, t, src);
    anneal_release(src);
    return s;
}

/* Sets every element of t (any dtype, any strides) to value. */
anneal_status anneal_init_fill_(anneal_tensor *t, float value) {
    if (anneal_interrupt_check("initialising the model") != ANNEAL_OK) return ANNEAL_ERR_INTERRUPTED;
    const anneal_backend *be = init_backend("anneal_init_fill_", t);
    if (!be) return anneal_last_status();
    if (!t->storage) return ANNEAL_OK; /* a parameter without storage */
    return be->fill(be->ctx, t, value);
}
