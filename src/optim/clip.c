/* Global gradient-norm clipping (PyTorch's clip_grad_norm_ with the L2 norm): the
 * norm of all gradients taken together, and a uniform rescale of every gradient
 * when it exceeds max_norm. The per-gradient sums of squares stay on their devices
 * until one copy to the host per device (grad_sumsq.c); the rescale is the backend's
 * scale_by, so nothing else crosses to the host. */
#include "anneal/optim.h"

#include <math.h>
#include <stdlib.h>

#include "anneal/backend.h"
#include "optim_internal.h"

/* sqrt of the sum over parameters (registration order, in double) of each grad's
 * sum of squares (deterministic per backend). Parameters without a grad count as
 * zero; no grads at all gives 0. Grads must be f32. */
anneal_status anneal_grad_norm(const anneal_params *ps, float *norm_out) {
    if (!ps || !norm_out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_grad_norm: NULL argument");
    double stack[ANNEAL_OPTIM_STACK_PARAMS];
    double *ss = ps->n <= ANNEAL_OPTIM_STACK_PARAMS ? stack : malloc((size_t)ps->n * sizeof *ss);
    if (!ss) return anneal_set_error(ANNEAL_ERR_OOM, "anneal_grad_norm: out of memory");
    anneal_status s = anneal_optim_grad_sumsq("anneal_grad_norm", ps, ss);
    double total = 0;
    for (int i = 0; i < ps->n && s == ANNEAL_OK; i++)
        if (ps->items[i].tensor->grad) total += ss[i];
    if (ss != stack) free(ss);
    if (s == ANNEAL_OK) *norm_out = (float)sqrt(total);
    return s;
}

/* g *= coef in place (scale_by: an f32 multiply per element, the same bits as the
 * multiply by coef broadcast over g this used to be); strided grads go through a
 * contiguous temporary and are copied back. */
static anneal_status scale_grad(const anneal_backend *be, anneal_tensor *g, float coef) {
    if (anneal_is_contiguous(g)) return be->scale_by(be->ctx, g, NULL, NULL, coef);
    anneal_scope *tmp = anneal_scope_open();
    if (!tmp) return anneal_last_status();
    anneal_tensor *c = anneal_empty_on(g->device, ANNEAL_F32, g->ndim, g->shape);
    anneal_status s = c ? be->copy(be->ctx, c, g) : anneal_last_status();
    if (s == ANNEAL_OK) s = be->scale_by(be->ctx, c, NULL, NULL, coef);
    if (s == ANNEAL_OK) s = be->copy(be->ctx, g, c);
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
