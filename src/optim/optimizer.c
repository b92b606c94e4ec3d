/* AdamW and SGD (with momentum / Nesterov) over an anneal_params set, following
 * PyTorch's torch.optim semantics: state is created lazily, zero-filled, in an
 * optimizer-owned scope; every parameter keeps its own step count (bias correction
 * uses it), and parameters without a gradient are skipped without advancing it;
 * frozen parameters (anneal_param.trainable false) are never updated and get no state.
 * Updates go through the backend table only (be->adamw for AdamW; be->fill /
 * be->binary / be->copy for SGD), so they run on whatever device the parameters
 * live on. No autograd is recorded: the kernels write the tensors directly. */
#include "anneal/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "anneal/backend.h"
#include "optim/optim_internal.h"

/* Per-parameter state, index-aligned with ps->items. */
typedef struct optim_slot {
    anneal_tensor *s0; /* AdamW exp_avg, SGD momentum buffer (NULL until first needed) */
    anneal_tensor *s1; /* AdamW exp_avg_sq */
    int64_t steps;     /* updates this parameter received (PyTorch state["step"]) */
} optim_slot;

struct anneal_optimizer {
    anneal_params *ps;
    anneal_optim_config cfg;
    anneal_scope *scope; /* owns every state tensor */
    optim_slot *slots;
    int n_slots;         /* grows when ps gains parameters after creation */
    anneal_adamw_group *groups; /* n_slots entries: the one-pass AdamW's arguments */
    int64_t step_count;  /* successful anneal_optimizer_step calls */
    const anneal_optimizer_variant *variant; /* ZeRO (zero.c), or NULL for a plain optimizer */
    void *variant_state;
};

/* PyTorch defaults for each kind. */
anneal_optim_config anneal_optim_defaults(anneal_optim_kind kind) {
    anneal_optim_config c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.beta1 = 0.9;
    c.beta2 = 0.999;
    c.eps = 1e-8;
    c.weight_decay = 0.0;
    c.momentum = 0.0;
    c.nesterov = false;
    return c;
}

/* Checks the hyper-parameters the way torch.optim's constructors do; records an
 * ANNEAL_ERR_ARG naming the bad value. */
static bool config_ok(const anneal_optim_config *c) {
    if (!isfinite(c->weight_decay) || c->weight_decay < 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "optimizer: invalid weight_decay %g", (double)c->weight_decay);
        return false;
    }
    switch (c->kind) {
    case ANNEAL_OPTIM_ADAMW:
        if (!(c->beta1 >= 0 && c->beta1 < 1) || !(c->beta2 >= 0 && c->beta2 < 1)) {
            anneal_set_error(ANNEAL_ERR_ARG, "AdamW: betas (%g, %g) must lie in [0, 1)",
                             (double)c->beta1, (double)c->beta2);
            return false;
        }
        if (!isfinite(c->eps) || c->eps < 0) {
            anneal_set_error(ANNEAL_ERR_ARG, "AdamW: invalid eps %g", (double)c->eps);
            return false;
        }
        return true;
    case ANNEAL_OPTIM_SGD:
        if (!isfinite(c->momentum) || c->momentum < 0) {
            anneal_set_error(ANNEAL_ERR_ARG, "SGD: invalid momentum %g", (double)c->momentum);
            return false;
        }
        if (c->nesterov && c->momentum == 0) {
            anneal_set_error(ANNEAL_ERR_ARG, "SGD: nesterov needs a momentum > 0");
            return false;
        }
        return true;
    }
    anneal_set_error(ANNEAL_ERR_ARG, "optimizer: unknown kind %d", (int)c->kind);
    return false;
}

/* Optimizer over ps (which must outlive it); no state is allocated until the
 * first step. NULL + ANNEAL_ERR_ARG for a NULL set or a bad config. */
anneal_optimizer *anneal_optimizer_new(anneal_params *ps, anneal_optim_config cfg) {
    if (!ps) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_new: NULL parameter set");
        return NULL;
    }
    if (!config_ok(&cfg)) return NULL;
    anneal_optimizer *o = calloc(1, sizeof *o);
    if (!o) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating an optimizer");
        return NULL;
    }
    o->ps = ps;
    o->cfg = cfg;
    o->scope = anneal_scope_new();
    if (!o->scope) {
        free(o);
        return NULL;
    }
    return o;
}

/* Frees the optimizer and its state tensors (not the parameters). */
void anneal_optimizer_free(anneal_optimizer *o) {
    if (!o) return;
    if (o->variant) o->variant->free_state(o->variant_state);
    anneal_scope_free(o->scope);
    free(o->slots);
    free(o->groups);
    free(o);
}

int64_t anneal_optimizer_step_count(const anneal_optimizer *o) { return o ? o->step_count : 0; }

/* Makes room for one slot per parameter currently registered. */
static bool grow_slots(anneal_optimizer *o) {
    int n = o->ps->n;
    if (n <= o->n_slots) return true;
    optim_slot *s = realloc(o->slots, (size_t)n * sizeof *s);
    if (!s) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory growing optimizer state");
        return false;
    }
    memset(s + o->n_slots, 0, (size_t)(n - o->n_slots) * sizeof *s);
    o->slots = s;
    anneal_adamw_group *g = realloc(o->groups, (size_t)n * sizeof *g);
    if (!g) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory growing optimizer state");
        return false;
    }
    o->groups = g;
    o->n_slots = n;
    return true;
}

/* Zero-filled state tensor shaped like p, owned by the optimizer's scope. */
static anneal_tensor *new_state(anneal_optimizer *o, const anneal_tensor *p) {
    anneal_scope_enter(o->scope);
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_OPTIMIZER);
    anneal_tensor *t = anneal_zeros_like(p);
    anneal_memory_category_set(mc);
    anneal_scope_leave();
    return t;
}

/* Checks that parameter i can be updated with its gradient (called for every
 * parameter before any is touched, so a bad gradient leaves the model unchanged). */
static bool check_param(const anneal_param *pa) {
    const anneal_tensor *p = pa->tensor, *g = p->grad;
    char b1[96], b2[96];
    if (p->dtype != ANNEAL_F32 || g->dtype != ANNEAL_F32) {
        anneal_set_error(ANNEAL_ERR_DTYPE, "optimizer: parameter '%s' and its grad must be f32 (got %s, %s)",
                         pa->name, anneal_dtype_name(p->dtype), anneal_dtype_name(g->dtype));
        return false;
    }
    if (!anneal_same_shape(p, g)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "optimizer: grad of '%s' has shape %s, parameter %s", pa->name,
                         anneal_shape_str(g, b1, sizeof b1), anneal_shape_str(p, b2, sizeof b2));
        return false;
    }
    if (g->device != p->device) {
        anneal_set_error(ANNEAL_ERR_DEVICE, "optimizer: grad of '%s' is on %s, parameter on %s",
                         pa->name, anneal_device_name(g->device), anneal_device_name(p->device));
        return false;
    }
    if (!anneal_is_contiguous(p)) {
        anneal_set_error(ANNEAL_ERR_ARG, "optimizer: parameter '%s' is not contiguous", pa->name);
        return false;
    }
    return true;
}

/* The gradient as a contiguous tensor: g itself, or a copy made in the current
 * (step-temporary) scope. NULL + error on failure. */
static anneal_tensor *contiguous_grad(const anneal_backend *be, anneal_tensor *g) {
    if (anneal_is_contiguous(g)) return g;
    anneal_tensor *c = anneal_empty_on(g->device, ANNEAL_F32, g->ndim, g->shape);
    if (!c || be->copy(be->ctx, c, g) != ANNEAL_OK) return NULL;
    return c;
}

/* One AdamW update of parameter pa through be->adamw (torch 1.13 arithmetic):
 * bias corrections bc = 1 - beta^t with t this parameter's own step count;
 * decoupled weight decay only where pa->decay. */
static anneal_status adamw_update(anneal_optimizer *o, optim_slot *sl, const anneal_param *pa,
                                  const anneal_backend *be, anneal_tensor *g, double lr) {
    const anneal_optim_config *c = &o->cfg;
    int64_t t = sl->steps + 1;
    /* In double, as PyTorch does with Python floats. */
    double bc1 = 1.0 - pow(c->beta1, (double)t);
    double bc2 = 1.0 - pow(c->beta2, (double)t);
    double wd = pa->decay ? c->weight_decay : 0.0;
    anneal_status s = be->adamw(be->ctx, pa->tensor, g, sl->s0, sl->s1, lr, c->beta1, c->beta2, c->eps, wd,
                                bc1, bc2);
    if (s == ANNEAL_OK) sl->steps = t;
    return s;
}

/* AdamW over every parameter with a gradient in one backend call (be->adamw_multi:
 * one parallel pass over all elements, bit-identical to per-parameter be->adamw).
 * Used when every such parameter lives on one device whose backend has the slot;
 * *handled = 0 otherwise (the caller then updates parameter by parameter). State
 * tensors exist already (the caller made them). */
static anneal_status adamw_one_pass(anneal_optimizer *o, double lr, int *handled) {
    const anneal_optim_config *c = &o->cfg;
    anneal_params *ps = o->ps;
    const anneal_backend *be = NULL;
    *handled = 0;
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *p = ps->items[i].tensor;
        if (!p->grad || !ps->items[i].trainable) continue;
        const anneal_backend *pb = anneal_backend_get(p->device);
        if (!pb) return ANNEAL_OK;
        if (be && pb != be) return ANNEAL_OK; /* mixed devices: per parameter */
        be = pb;
    }
    if (!be || !be->adamw_multi) return ANNEAL_OK;
    *handled = 1;
    anneal_scope *tmp = anneal_scope_open(); /* contiguous copies of strided grads */
    if (!tmp) return anneal_last_status();
    anneal_status s = ANNEAL_OK;
    int n = 0;
    for (int i = 0; i < ps->n && s == ANNEAL_OK; i++) {
        const anneal_param *pa = &ps->items[i];
        anneal_tensor *g = pa->tensor->grad;
        if (!g || !pa->trainable) continue;
        if (!(g = contiguous_grad(be, g))) {
            s = anneal_last_status();
            break;
        }
        optim_slot *sl = &o->slots[i];
        double t = (double)(sl->steps + 1);
        o->groups[n++] = (anneal_adamw_group){
            .p = anneal_data(pa->tensor), .g = anneal_data(g), .m = anneal_data(sl->s0),
            .v = anneal_data(sl->s1), .numel = anneal_numel(pa->tensor),
            .weight_decay = pa->decay ? c->weight_decay : 0.0,
            /* in double, as PyTorch does with Python floats (as adamw_update) */
            .bc1 = 1.0 - pow(c->beta1, t), .bc2 = 1.0 - pow(c->beta2, t)};
    }
    if (s == ANNEAL_OK) s = be->adamw_multi(be->ctx, o->groups, n, lr, c->beta1, c->beta2, c->eps);
    if (s == ANNEAL_OK)
        for (int i = 0; i < ps->n; i++)
            if (ps->items[i].tensor->grad && ps->items[i].trainable) o->slots[i].steps++;
    anneal_scope_close(tmp);
    return s;
}

/* value broadcast to like's shape (a 1-element tensor viewed with zero strides),
 * for in-place scalar multiplies through be->binary, whose out may alias a. */
static anneal_tensor *scalar_as(const anneal_backend *be, const anneal_tensor *like, double value) {
    anneal_tensor *s = anneal_empty_on(like->device, ANNEAL_F32, 1, (int64_t[]){1});
    if (!s || be->fill(be->ctx, s, value) != ANNEAL_OK) return NULL;
    int64_t zero[ANNEAL_MAX_DIMS] = {0};
    return anneal_alias(s, like->ndim, like->shape, zero, s->offset);
}

/* One SGD update (torch.optim.SGD, dampening 0) as backend slot calls on contiguous
 * f32 tensors (binary with out aliasing a, copy):
 *   d = g (+ wd * p for decay params);
 *   with momentum: buf = d on the parameter's first step, else buf = momentum*buf + d;
 *                  d = nesterov ? d + momentum*buf : buf;
 *   p = p - lr * d.
 * Temporaries belong to the caller's per-parameter scope. */
static anneal_status sgd_update(anneal_optimizer *o, optim_slot *sl, const anneal_param *pa,
                                const anneal_backend *be, anneal_tensor *g, double lr) {
    const anneal_optim_config *c = &o->cfg;
    anneal_tensor *p = pa->tensor, *d = g;
    double wd = pa->decay ? c->weight_decay : 0.0;
    anneal_status s = ANNEAL_OK;
#define TRY(expr) do { if ((s = (expr)) != ANNEAL_OK) return s; } while (0)
#define NEW(var, expr) do { if (!((var) = (expr))) return anneal_last_status(); } while (0)
    if (wd != 0) {
        anneal_tensor *wd_s, *tmp;
        NEW(wd_s, scalar_as(be, p, wd));
        NEW(tmp, anneal_empty_like(p));
        TRY(be->binary(be->ctx, ANNEAL_MUL, tmp, p, wd_s));  /* wd * p */
        TRY(be->binary(be->ctx, ANNEAL_ADD, tmp, tmp, g));   /* g + wd * p */
        d = tmp;
    }
    if (c->momentum != 0) {
        anneal_tensor *mom;
        NEW(mom, scalar_as(be, p, c->momentum));
        if (sl->steps == 0) {
            TRY(be->copy(be->ctx, sl->s0, d));                /* buf = d */
        } else {
            TRY(be->binary(be->ctx, ANNEAL_MUL, sl->s0, sl->s0, mom)); /* momentum * buf */
            TRY(be->binary(be->ctx, ANNEAL_ADD, sl->s0, sl->s0, d));   /* + d */
        }
        if (c->nesterov) {
            anneal_tensor *tmp;
            NEW(tmp, anneal_empty_like(p));
            TRY(be->binary(be->ctx, ANNEAL_MUL, tmp, sl->s0, mom)); /* momentum * buf */
            TRY(be->binary(be->ctx, ANNEAL_ADD, tmp, tmp, d));      /* d + momentum * buf */
            d = tmp;
        } else {
            d = sl->s0;
        }
    }
    anneal_tensor *lr_s, *step;
    NEW(lr_s, scalar_as(be, p, lr));
    NEW(step, anneal_empty_like(p));
    TRY(be->binary(be->ctx, ANNEAL_MUL, step, d, lr_s)); /* lr * d */
    TRY(be->binary(be->ctx, ANNEAL_SUB, p, p, step));    /* p - lr * d */
#undef TRY
#undef NEW
    sl->steps++;
    return ANNEAL_OK;
}

/* One update of every parameter that has a gradient. Validates everything and
 * allocates any missing state first, so an error (bad lr, mismatched grad, out
 * of memory) leaves parameters untouched; a kernel failure midway cannot be undone.
 * lr must be finite and >= 0. The optimizer's step count advances on every successful
 * call, even one where no parameter had a gradient. Parameters registered in ps after
 * the optimizer was made are picked up (with fresh state) on their first gradient. */
anneal_status anneal_optimizer_step(anneal_optimizer *o, double lr) {
    if (!o) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_step: NULL optimizer");
    if (!isfinite(lr) || lr < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_step: invalid learning rate %g", (double)lr);
    if (o->variant) return o->variant->step(o, lr);
    if (!grow_slots(o)) return anneal_last_status();
    anneal_params *ps = o->ps;
    bool adamw = o->cfg.kind == ANNEAL_OPTIM_ADAMW;
    bool need_buf = adamw || o->cfg.momentum != 0;
    for (int i = 0; i < ps->n; i++)
        if (ps->items[i].tensor->grad && ps->items[i].trainable && !check_param(&ps->items[i]))
            return anneal_last_status();
    for (int i = 0; i < ps->n; i++) {
        const anneal_param *pa = &ps->items[i];
        if (!pa->tensor->grad || !pa->trainable) continue;
        optim_slot *sl = &o->slots[i];
        if (need_buf && !sl->s0 && !(sl->s0 = new_state(o, pa->tensor))) return anneal_last_status();
        if (adamw && !sl->s1 && !(sl->s1 = new_state(o, pa->tensor))) return anneal_last_status();
    }
    if (adamw) {
        int handled = 0;
        anneal_status ms = adamw_one_pass(o, lr, &handled);
        if (handled) {
            if (ms == ANNEAL_OK) o->step_count++;
            return ms;
        }
    }
    anneal_status s = ANNEAL_OK;
    for (int i = 0; i < ps->n && s == ANNEAL_OK; i++) {
        const anneal_param *pa = &ps->items[i];
        anneal_tensor *g = pa->tensor->grad;
        if (!g || !pa->trainable) continue; /* PyTorch: no grad, no update, step count unchanged; frozen: never */
        const anneal_backend *be = anneal_backend_get(pa->tensor->device);
        if (!be) return anneal_last_status();
        /* Per-parameter scope for temporaries (contiguous grad copy, SGD terms), so
         * the transient memory is a few copies of the largest parameter at most. */
        anneal_scope *tmp = anneal_scope_open();
        if (!tmp) return anneal_last_status();
        if (!(g = contiguous_grad(be, g))) s = anneal_last_status();
        else if (adamw) s = adamw_update(o, &o->slots[i], pa, be, g, lr);
        else s = sgd_update(o, &o->slots[i], pa, be, g, lr);
        anneal_scope_close(tmp);
    }
    if (s == ANNEAL_OK) o->step_count++;
    return s;
}

/* State tensor `which` of parameter i, NULL until created. Unknown names, or an
 * index outside the parameter set, record ANNEAL_ERR_ARG. */
anneal_tensor *anneal_optimizer_state(const anneal_optimizer *o, int i, const char *which) {
    if (!o || !which || i < 0 || i >= o->ps->n) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_state: bad optimizer, index %d or name", i);
        return NULL;
    }
    bool adamw = o->cfg.kind == ANNEAL_OPTIM_ADAMW;
    int k = -1;
    if (adamw && strcmp(which, "exp_avg") == 0) k = 0;
    else if (adamw && strcmp(which, "exp_avg_sq") == 0) k = 1;
    else if (!adamw && strcmp(which, "momentum") == 0) k = 0;
    if (k < 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_state: no state '%s' for %s", which,
                         adamw ? "AdamW" : "SGD");
        return NULL;
    }
    if (i >= o->n_slots) return NULL;
    return k == 0 ? o->slots[i].s0 : o->slots[i].s1;
}

/* The configuration the optimizer was made with (checkpoints record it). */
anneal_optim_config anneal_optimizer_config(const anneal_optimizer *o) {
    if (!o) return anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    return o->cfg;
}

/* Creates, zero-filled, every state tensor the kind needs (AdamW: exp_avg and
 * exp_avg_sq; SGD with momentum: the momentum buffer; plain SGD: none) that does not
 * exist yet, for every trainable parameter (frozen ones have none). Existing state is kept. A zero buffer
 * with a step count of 0 behaves exactly like lazily created state. */
anneal_status anneal_optimizer_init_state(anneal_optimizer *o) {
    if (!o) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_init_state: NULL optimizer");
    if (o->variant) return o->variant->init_state(o); /* ZeRO: full tensors holding the shards' state */
    if (!grow_slots(o)) return anneal_last_status();
    bool adamw = o->cfg.kind == ANNEAL_OPTIM_ADAMW;
    bool need_buf = adamw || o->cfg.momentum != 0;
    for (int i = 0; i < o->ps->n; i++) {
        const anneal_tensor *p = o->ps->items[i].tensor;
        optim_slot *sl = &o->slots[i];
        if (!o->ps->items[i].trainable) continue; /* frozen: no state */
        if (need_buf && !sl->s0 && !(sl->s0 = new_state(o, p))) return anneal_last_status();
        if (adamw && !sl->s1 && !(sl->s1 = new_state(o, p))) return anneal_last_status();
    }
    return ANNEAL_OK;
}

/* Parameter i's update count (0 before its first update); -1 + ANNEAL_ERR_ARG for a
 * bad optimizer or index. */
int64_t anneal_optimizer_param_steps(const anneal_optimizer *o, int i) {
    if (!o || i < 0 || i >= o->ps->n) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_param_steps: bad optimizer or index %d", i);
        return -1;
    }
    return i < o->n_slots ? o->slots[i].steps : 0;
}

/* Sets parameter i's update count (resume); steps must be >= 0. */
anneal_status anneal_optimizer_set_param_steps(anneal_optimizer *o, int i, int64_t steps) {
    if (!o || i < 0 || i >= o->ps->n)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_set_param_steps: bad optimizer or index %d", i);
    if (steps < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_set_param_steps: negative step count %lld",
                                (long long)steps);
    if (!grow_slots(o)) return anneal_last_status();
    o->slots[i].steps = steps;
    return ANNEAL_OK;
}

/* Sets the optimizer's own step count (resume); n must be >= 0. */
anneal_status anneal_optimizer_set_step_count(anneal_optimizer *o, int64_t n) {
    if (!o) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_set_step_count: NULL optimizer");
    if (n < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_set_step_count: negative count %lld", (long long)n);
    o->step_count = n;
    return ANNEAL_OK;
}

/* ---- the ZeRO seam (optim_internal.h) */
void anneal_optimizer_set_variant(anneal_optimizer *o, const anneal_optimizer_variant *v, void *state) {
    o->variant = v;
    o->variant_state = state;
}

void *anneal_optimizer_variant_state(const anneal_optimizer *o, const anneal_optimizer_variant *v) {
    return o && o->variant == v ? o->variant_state : NULL;
}
anneal_scope *anneal_optimizer_state_scope(anneal_optimizer *o) { return o->scope; }
anneal_params *anneal_optimizer_param_set(const anneal_optimizer *o) { return o->ps; }
anneal_tensor **anneal_optimizer_state_slot(anneal_optimizer *o, int i, int k) {
    if (!grow_slots(o)) return NULL;
    if (i < 0 || i >= o->n_slots) {
        anneal_set_error(ANNEAL_ERR_ARG, "optimizer state slot %d out of range", i);
        return NULL;
    }
    return k ? &o->slots[i].s1 : &o->slots[i].s0;
}
