/* Global gradient-norm clipping (PyTorch's clip_grad_norm_ with the L2 norm): the
 * norm of all gradients taken together, and a uniform rescale of every gradient
 * when it exceeds max_norm. */
#include "anneal/optim.h"

#include <math.h>

#include "anneal/backend.h"

/* Sum of squares of one gradient (any strides: a non-contiguous one is summed
 * through a contiguous temporary). */
static anneal_status grad_sum_squares(const anneal_backend *be, const anneal_tensor *g, double *out) {
    if (anneal_is_contiguous(g)) return be->sum_squares(g, out);
    anneal_scope_enter(NULL);
    anneal_tensor *c = anneal_empty_on(g->device, ANNEAL_F32, g->ndim, g->shape);
    anneal_scope_leave();
    if (!c) return anneal_last_status();
    anneal_status s = be->copy(c, g);
    if (s == ANNEAL_OK) s = be->sum_squares(c, out);
    anneal_release(c);
    return s;
}

/* sqrt of the sum over parameters (registration order, in double) of each grad's
 * sum of squares (deterministic per backend). Parameters without a grad count as
 * zero; no grads at all gives 0. Grads must be f32. */
anneal_status anneal_grad_norm(const anneal_params *ps, float *norm_out) {
    if (!ps || !norm_out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_grad_norm: NULL argument");
    double total = 0;
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g) continue;
        if (g->dtype != ANNEAL_F32)
            return anneal_set_error(ANNEAL_ERR_DTYPE, "anneal_grad_norm: grad of '%s' is %s, not f32",
                                    ps->items[i].name, anneal_dtype_name(g->dtype));
        const anneal_backend *be = anneal_backend_get(g->device);
        if (!be) return anneal_last_status();
        double ss = 0;
        anneal_status s = grad_sum_squares(be, g, &ss);
        if (s != ANNEAL_OK) return s;
        total += ss;
    }
    *norm_out = (float)sqrt(total);
    return ANNEAL_OK;
}

/* g *= coef in place: a binary multiply by coef broadcast with zero strides (the
 * binary slot allows out == a) on contiguous grads; strided grads go through a
 * contiguous temporary and are copied back. */
static anneal_status scale_grad(const anneal_backend *be, anneal_tensor *g, float coef) {
    anneal_scope *tmp = anneal_scope_open();
    if (!tmp) return anneal_last_status();
    int64_t zero[ANNEAL_MAX_DIMS] = {0};
    anneal_tensor *c = anneal_empty_on(g->device, ANNEAL_F32, 1, (int64_t[]){1});
    anneal_tensor *cb = c ? anneal_alias(c, g->ndim, g->shape, zero, c->offset) : NULL;
    anneal_tensor *work = anneal_is_contiguous(g) ? g : anneal_empty_on(g->device, ANNEAL_F32, g->ndim, g->shape);
    anneal_status s = cb && work ? ANNEAL_OK : anneal_last_status();
    if (s == ANNEAL_OK) s = be->fill(c, coef);
    if (s == ANNEAL_OK && work != g) s = be->copy(work, g);
    if (s == ANNEAL_OK) s = be->binary(ANNEAL_MUL, work, work, cb);
    if (s == ANNEAL_OK && work != g) s = be->copy(g, work);
    anneal_scope_close(tmp);
    return s;
}

/* PyTorch clip_grad_norm_(max_norm, norm_type=2): norm as anneal_grad_norm; coef =
 * max_norm / (norm + 1e-6) in f32 (as torch computes it on an f32 tensor); when
 * coef < 1 every grad is multiplied by coef (torch multiplies by min(coef, 1), which
 * is the identity otherwise). A NaN/Inf norm is written to *norm_out and the grads are
 * left as they are, returning ANNEAL_OK: the caller decides to skip the step (as a
 * loss scaler does). max_norm must be >= 0 (not NaN). */
anneal_status anneal_clip_grad_norm(anneal_params *ps, float max_norm, float *norm_out) {
    if (!ps) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_clip_grad_norm: NULL parameter set");
    if (!(max_norm >= 0))
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_clip_grad_norm: invalid max_norm %g", (double)max_norm);
    float norm = 0;
    anneal_status s = anneal_grad_norm(ps, &norm);
    if (s != ANNEAL_OK) return s;
    if (norm_out) *norm_out = norm;
    if (!isfinite(norm)) return ANNEAL_OK;
    float coef = max_norm / (norm + 1e-6f);
    if (!(coef < 1.0f)) return ANNEAL_OK;
    for (int i = 0; i < ps->n; i++) {
        anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g) continue;
        const anneal_backend *be = anneal_backend_get(g->device);
        if (!be) return anneal_last_status();
        if ((s = scale_grad(be, g, coef)) != ANNEAL_OK) return s;
    }
    return ANNEAL_OK;
}
