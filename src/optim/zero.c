/* ZeRO stages 1-3: an optimizer whose state covers only this rank's shard of the flat
 * parameter space (the pieces of anneal_ddp_shard_pieces). A step updates each piece
 * of the parameters (at stage 3 the sync's parameter shard, zero3.c) from the rank's mean-gradient shard with the same backend
 * kernels the plain optimizer uses (be->adamw; be->binary / be->copy for SGD) on 1-D
 * slices; those kernels are elementwise, so a slice gets exactly the bits the whole
 * tensor would. Then the parameters are all-gathered so every rank holds all of them.
 * Every parameter counts as having a gradient (the sync fills missing ones with
 * zeros), so every per-parameter step count advances on every rank alike.
 *
 * Checkpoints: anneal_optimizer_gather_state builds full-size state tensors in the
 * optimizer's ordinary slots (so anneal_optimizer_state and everything written for
 * the plain optimizer work on them); anneal_optimizer_scatter_state copies the rank's
 * pieces back into the shard and frees them. A step with full tensors present scatters
 * them first, so a state restored into them is never ignored.
 *
 * Everything runs on the parameters' device through its backend (the shard state is
 * made there, pieces move by copies on views); only the gradient sync's collectives
 * see raw memory. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "anneal/backend.h"
#include "anneal/parallel.h"
#include "optim_internal.h"

struct anneal_zero {
    anneal_ddp *d;
    anneal_scope *scope;  /* owns the shard state */
    anneal_tensor *s[2];  /* shard_numel each: exp_avg/momentum, exp_avg_sq (NULL: not used or empty shard) */
    int n_state;          /* 2 AdamW, 1 SGD with momentum, 0 plain SGD */
};

/* Frees a ZeRO state (the optimizer calls it when it is freed). */
static void zero_free(void *state) {
    struct anneal_zero *z = state;
    if (!z) return;
    anneal_scope_free(z->scope);
    free(z);
}

static anneal_status zero_step(anneal_optimizer *o, double lr);

/* The optimizer variant: the ZeRO step, full state tensors for init_state (gathered),
 * and the shard state freed with the optimizer. */
static const anneal_optimizer_variant k_zero_variant = {
    .name = "zero",
    .step = zero_step,
    .init_state = anneal_optimizer_gather_state,
    .free_state = zero_free,
};

/* o's ZeRO state, or NULL for an optimizer that is not sharded. */
static struct anneal_zero *zero_of(const anneal_optimizer *o) {
    return anneal_optimizer_variant_state(o, &k_zero_variant);
}

/* An AdamW/SGD over ps whose state is the shard of d (stage 1 or 2, same ps). */
anneal_optimizer *anneal_optimizer_new_zero(anneal_params *ps, anneal_optim_config cfg, anneal_ddp *d) {
    if (!d || anneal_ddp_stage(d) < 1) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_new_zero: needs a gradient sync made with zero stage 1, 2 or 3");
        return NULL;
    }
    if (anneal_ddp_params(d) != ps) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_new_zero: the sync covers a different parameter set");
        return NULL;
    }
    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    if (!o) return NULL;
    struct anneal_zero *z = calloc(1, sizeof *z);
    if (!z || !(z->scope = anneal_scope_new())) {
        free(z);
        anneal_optimizer_free(o);
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a ZeRO optimizer");
        return NULL;
    }
    z->d = d;
    anneal_optimizer_set_variant(o, &k_zero_variant, z); /* freed with o from here on */
    z->n_state = cfg.kind == ANNEAL_OPTIM_ADAMW ? 2 : cfg.momentum != 0 ? 1 : 0;
    int64_t n = anneal_ddp_shard_numel(d);
    if (n > 0) {
        anneal_device dev = ps->items[0].tensor->device; /* the sync keeps them on one device */
        const anneal_backend *be = anneal_backend_get(dev);
        anneal_scope_enter(z->scope);
        for (int k = 0; k < z->n_state && be; k++) {
            anneal_tensor *t = anneal_empty_on(dev, ANNEAL_F32, 1, &n);
            if (!t || be->fill(be->ctx, t, 0.0) != ANNEAL_OK) break;
            z->s[k] = t;
        }
        anneal_scope_leave();
        for (int k = 0; k < z->n_state; k++)
            if (!z->s[k]) {
                anneal_optimizer_free(o);
                return NULL;
            }
    }
    anneal_ddp_set_state_bytes(d, n * 4 * z->n_state);
    return o;
}

/* A 1-D view of len elements of t starting at element off (relative to t's start),
 * owned by the current scope (by the caller when none is open). */
static anneal_tensor *slice(const anneal_tensor *t, int64_t off, int64_t len) {
    return anneal_alias(t, 1, &len, (int64_t[]){1}, t->offset + off);
}

/* value broadcast over len elements (zero stride) on device dev, for in-place scalar
 * multiplies. */
static anneal_tensor *scalar_as(const anneal_backend *be, anneal_device dev, int64_t len, double value) {
    anneal_tensor *s = anneal_empty_on(dev, ANNEAL_F32, 1, (int64_t[]){1});
    if (!s || be->fill(be->ctx, s, value) != ANNEAL_OK) return NULL;
    return anneal_alias(s, 1, &len, (int64_t[]){0}, s->offset);
}

/* optimizer.c's sgd_update on one piece, op for op (the same backend calls in the
 * same order, so the same roundings). Temporaries go to the caller's scope. */
static anneal_status sgd_piece(const anneal_optim_config *c, const anneal_backend *be, anneal_tensor *p,
                               anneal_tensor *g, anneal_tensor *buf, bool decay, int64_t steps, double lr) {
    int64_t len = anneal_numel(p);
    anneal_tensor *d = g;
    double wd = decay ? c->weight_decay : 0.0;
    anneal_status s = ANNEAL_OK;
#define TRY(expr) do { if ((s = (expr)) != ANNEAL_OK) return s; } while (0)
#define NEW(var, expr) do { if (!((var) = (expr))) return anneal_last_status(); } while (0)
    if (wd != 0) {
        anneal_tensor *wd_s, *tmp;
        NEW(wd_s, scalar_as(be, p->device, len, wd));
        NEW(tmp, anneal_empty_like(p));
        TRY(be->binary(be->ctx, ANNEAL_MUL, tmp, p, wd_s));
        TRY(be->binary(be->ctx, ANNEAL_ADD, tmp, tmp, g));
        d = tmp;
    }
    if (c->momentum != 0) {
        anneal_tensor *mom;
        NEW(mom, scalar_as(be, p->device, len, c->momentum));
        if (steps == 0) {
            TRY(be->copy(be->ctx, buf, d));
        } else {
            TRY(be->binary(be->ctx, ANNEAL_MUL, buf, buf, mom));
            TRY(be->binary(be->ctx, ANNEAL_ADD, buf, buf, d));
        }
        if (c->nesterov) {
            anneal_tensor *tmp;
            NEW(tmp, anneal_empty_like(p));
            TRY(be->binary(be->ctx, ANNEAL_MUL, tmp, buf, mom));
            TRY(be->binary(be->ctx, ANNEAL_ADD, tmp, tmp, d));
            d = tmp;
        } else {
            d = buf;
        }
    }
    anneal_tensor *lr_s, *step;
    NEW(lr_s, scalar_as(be, p->device, len, lr));
    NEW(step, anneal_empty_like(p));
    TRY(be->binary(be->ctx, ANNEAL_MUL, step, d, lr_s));
    TRY(be->binary(be->ctx, ANNEAL_SUB, p, p, step));
#undef TRY
#undef NEW
    return ANNEAL_OK;
}

static bool has_full_state(anneal_optimizer *o, const struct anneal_zero *z) {
    anneal_params *ps = anneal_optimizer_param_set(o);
    for (int i = 0; i < ps->n; i++)
        for (int k = 0; k < z->n_state; k++)
            if (anneal_optimizer_state(o, i, k == 0 ? (z->n_state == 2 ? "exp_avg" : "momentum") : "exp_avg_sq"))
                return true;
    return false;
}

/* Updates the shard's pieces, advances every parameter's step count, all-gathers the
 * parameters. Needs anneal_ddp_finish to have run. */
static anneal_status zero_step(anneal_optimizer *o, double lr) {
    struct anneal_zero *z = zero_of(o);
    anneal_ddp *d = z->d;
    if (!anneal_ddp_synced(d))
        return anneal_set_error(ANNEAL_ERR_STATE, "ZeRO optimizer step: gradients not synchronised (call anneal_ddp_finish)");
    anneal_status s = ANNEAL_OK;
    if (has_full_state(o, z) && (s = anneal_optimizer_scatter_state(o)) != ANNEAL_OK) return s;
    anneal_optim_config c = anneal_optimizer_config(o);
    anneal_params *ps = anneal_optimizer_param_set(o);
    anneal_tensor *g = anneal_ddp_shard_grad_tensor(d);
    const anneal_backend *be = ps->n ? anneal_backend_get(ps->items[0].tensor->device) : NULL;
    if (ps->n && !be) return anneal_last_status();
    int np = 0;
    const anneal_ddp_piece *pcs = anneal_ddp_shard_pieces(d, &np);
    anneal_tensor *pshard = anneal_ddp_param_shard(d);
    anneal_scope *tmp = anneal_scope_open();
    if (!tmp) return anneal_last_status();
    for (int k = 0; k < np && s == ANNEAL_OK; k++) {
        const anneal_ddp_piece *pc = &pcs[k];
        const anneal_param *pa = &ps->items[pc->param];
        int64_t steps = anneal_optimizer_param_steps(o, pc->param);
        /* ZeRO-3: the parameters' values are the sync's shard (zero3.c) */
        anneal_tensor *p = pshard ? slice(pshard, pc->shard_offset, pc->len) : slice(pa->tensor, pc->offset, pc->len);
        anneal_tensor *gs = slice(g, pc->shard_offset, pc->len);
        anneal_tensor *m = z->s[0] ? slice(z->s[0], pc->shard_offset, pc->len) : NULL;
        anneal_tensor *v = z->s[1] ? slice(z->s[1], pc->shard_offset, pc->len) : NULL;
        if (!p || !gs || (z->n_state > 0 && !m) || (z->n_state > 1 && !v)) {
            s = anneal_last_status();
            break;
        }
        if (c.kind == ANNEAL_OPTIM_ADAMW) {
            /* As optimizer.c's adamw_update: bias corrections in double from the
             * parameter's own step count. */
            double t = (double)(steps + 1);
            double bc1 = 1.0 - pow(c.beta1, t), bc2 = 1.0 - pow(c.beta2, t);
            s = be->adamw(be->ctx, p, gs, m, v, lr, c.beta1, c.beta2, c.eps, pa->decay ? c.weight_decay : 0.0, bc1, bc2);
        } else {
            s = sgd_piece(&c, be, p, gs, m, pa->decay, steps, lr);
        }
    }
    anneal_scope_close(tmp);
    if (s != ANNEAL_OK) return s;
    for (int i = 0; i < ps->n && s == ANNEAL_OK; i++)
        s = anneal_optimizer_set_param_steps(o, i, anneal_optimizer_param_steps(o, i) + 1);
    if (s == ANNEAL_OK) s = anneal_ddp_gather_params(d);
    if (s == ANNEAL_OK) s = anneal_optimizer_set_step_count(o, anneal_optimizer_step_count(o) + 1);
    return s;
}

/* Full state tensors (every rank's shard gathered into each parameter's shape). */
anneal_status anneal_optimizer_gather_state(anneal_optimizer *o) {
    if (!o) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_gather_state: NULL optimizer");
    struct anneal_zero *z = zero_of(o);
    if (!z) return ANNEAL_OK;
    anneal_params *ps = anneal_optimizer_param_set(o);
    anneal_tensor **dst = malloc((size_t)(ps->n > 0 ? ps->n : 1) * sizeof *dst);
    if (!dst) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory gathering optimizer state");
    anneal_status s = ANNEAL_OK;
    for (int k = 0; k < z->n_state && s == ANNEAL_OK; k++) {
        for (int i = 0; i < ps->n && s == ANNEAL_OK; i++) {
            anneal_tensor **slot = anneal_optimizer_state_slot(o, i, k);
            if (!slot) {
                s = anneal_last_status();
                break;
            }
            if (!*slot) {
                anneal_scope_enter(anneal_optimizer_state_scope(o));
                *slot = anneal_zeros_like(ps->items[i].tensor);
                anneal_scope_leave();
                if (!*slot) {
                    s = anneal_last_status();
                    break;
                }
            }
            dst[i] = *slot;
        }
        if (s == ANNEAL_OK) s = anneal_ddp_gather_shard(z->d, z->s[k], dst);
    }
    free(dst);
    return s;
}

/* The rank's pieces of the full state tensors go back into the shard; the full
 * tensors are freed. */
anneal_status anneal_optimizer_scatter_state(anneal_optimizer *o) {
    if (!o) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_scatter_state: NULL optimizer");
    struct anneal_zero *z = zero_of(o);
    if (!z) return ANNEAL_OK;
    anneal_params *ps = anneal_optimizer_param_set(o);
    int np = 0;
    const anneal_ddp_piece *pcs = anneal_ddp_shard_pieces(z->d, &np);
    for (int k = 0; k < z->n_state; k++) {
        for (int j = 0; j < np; j++) {
            anneal_tensor **slot = anneal_optimizer_state_slot(o, pcs[j].param, k);
            if (!slot) return anneal_last_status();
            const anneal_tensor *full = *slot;
            if (!full) continue;
            if (full->dtype != ANNEAL_F32 || !anneal_is_contiguous(full) ||
                anneal_numel(full) != anneal_numel(ps->items[pcs[j].param].tensor))
                return anneal_set_error(ANNEAL_ERR_STATE, "ZeRO: state of '%s' is not a contiguous f32 tensor of "
                                                          "the parameter's size", ps->items[pcs[j].param].name);
            const anneal_backend *be = anneal_backend_get(full->device);
            anneal_tensor *dst = slice(z->s[k], pcs[j].shard_offset, pcs[j].len);
            anneal_tensor *src = slice(full, pcs[j].offset, pcs[j].len);
            anneal_status s = be && dst && src ? be->copy(be->ctx, dst, src) : anneal_last_status();
            anneal_release(dst);
            anneal_release(src);
            if (s != ANNEAL_OK) return s;
        }
        for (int i = 0; i < ps->n; i++) {
            anneal_tensor **slot = anneal_optimizer_state_slot(o, i, k);
            if (!slot) return anneal_last_status();
            if (!*slot) continue;
            anneal_tensor *t = anneal_keep(*slot, NULL); /* out of the optimizer's scope ... */
            *slot = NULL;
            anneal_release(t);                          /* ... and gone */
        }
    }
    return ANNEAL_OK;
}
