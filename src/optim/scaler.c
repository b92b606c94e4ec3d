/* Dynamic loss scaling for f16 training, with the semantics of PyTorch's
 * torch.cuda.amp.GradScaler (torch 1.13: GradScaler.unscale_ and the
 * _amp_update_scale_ kernel). The state is two numbers (scale, growth tracker), kept
 * in checkpoints so a resumed run scales exactly as a straight one. Gradients are
 * touched through the backend table only, so the scaler runs on any device. */
#include "anneal/optim.h"

#include <math.h>
#include <stdlib.h>

#include "anneal/backend.h"
#include "optim_internal.h"

anneal_loss_scaler_config anneal_loss_scaler_defaults(void) {
    return (anneal_loss_scaler_config){
        .init_scale = 65536.0, .growth_factor = 2.0, .backoff_factor = 0.5, .growth_interval = 2000, .dynamic = true};
}

/* Rejects settings GradScaler would misbehave with: a scale that is not a positive
 * finite f32, growth that does not grow, backoff that does not shrink. */
anneal_status anneal_loss_scaler_init(anneal_loss_scaler *s, anneal_loss_scaler_config cfg) {
    if (!s) return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: NULL scaler");
    float init = (float)cfg.init_scale;
    if (!(cfg.init_scale > 0) || !isfinite(init) || init <= 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: init_scale %g must be a positive finite f32", cfg.init_scale);
    if (cfg.dynamic) {
        if (!(cfg.growth_factor > 1.0) || !isfinite(cfg.growth_factor))
            return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: growth_factor %g must be > 1", cfg.growth_factor);
        if (!(cfg.backoff_factor > 0.0 && cfg.backoff_factor < 1.0))
            return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: backoff_factor %g must be in (0, 1)", cfg.backoff_factor);
        if (cfg.growth_interval < 1)
            return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: growth_interval %lld must be >= 1",
                                    (long long)cfg.growth_interval);
    }
    s->cfg = cfg;
    s->scale = init;
    s->growth_tracker = 0;
    return ANNEAL_OK;
}

anneal_status anneal_loss_scaler_set_state(anneal_loss_scaler *s, float scale, int64_t growth_tracker) {
    if (!s) return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: NULL scaler");
    if (!(scale > 0) || !isfinite(scale))
        return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: scale %g must be positive and finite", (double)scale);
    if (growth_tracker < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "loss scaler: growth tracker %lld must be >= 0",
                                (long long)growth_tracker);
    s->scale = scale;
    s->growth_tracker = growth_tracker;
    return ANNEAL_OK;
}

/* g *= coef in place through scale_by (strided grads through a contiguous temporary). */
static anneal_status scale_in_place(const anneal_backend *be, anneal_tensor *g, float coef) {
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

/* GradScaler.unscale_: inv_scale = float(1 / double(scale)); every value is checked
 * before it is multiplied (torch's _amp_foreach_non_finite_check_and_unscale_): a grad
 * holds a NaN/Inf exactly when its sum of squares (in double, where no sum of finite f32
 * squares overflows) is not finite; the sums stay on the devices until one copy to the
 * host (grad_sumsq.c). A multiply by exactly 1 is skipped, as torch skips it. */
anneal_status anneal_loss_scaler_unscale(const anneal_loss_scaler *s, anneal_params *ps, bool *found_inf) {
    if (!s || !ps || !found_inf) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_loss_scaler_unscale: NULL argument");
    *found_inf = false;
    float inv = (float)(1.0 / (double)s->scale);
    double stack[ANNEAL_OPTIM_STACK_PARAMS];
    double *ss = ps->n <= ANNEAL_OPTIM_STACK_PARAMS ? stack : malloc((size_t)ps->n * sizeof *ss);
    if (!ss) return anneal_set_error(ANNEAL_ERR_OOM, "loss scaler: out of memory");
    anneal_status st = anneal_optim_grad_sumsq("loss scaler", ps, ss);
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
        anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g) continue;
        *found_inf = *found_inf || !isfinite(ss[i]);
        if (inv == 1.0f) continue;
        const anneal_backend *be = anneal_backend_get(g->device);
        st = be ? scale_in_place(be, g, inv) : anneal_last_status();
    }
    if (ss != stack) free(ss);
    return st;
}

/* torch _amp_update_scale_ (AmpKernels.cu): the tracker is incremented before it is
 * compared, so growth happens on the growth_interval-th clean step in a row. `>=`
 * instead of torch's `==` only matters for a tracker restored above a smaller
 * interval (a resume with a new --scale-growth-interval): it grows at once instead
 * of never. */
void anneal_loss_scaler_update(anneal_loss_scaler *s, bool found_inf) {
    if (!s || !s->cfg.dynamic) return;
    if (found_inf) {
        s->scale = (float)((double)s->scale * s->cfg.backoff_factor);
        s->growth_tracker = 0;
        return;
    }
    int64_t successful = s->growth_tracker + 1;
    if (successful >= s->cfg.growth_interval) {
        float grown = (float)((double)s->scale * s->cfg.growth_factor);
        if (isfinite(grown)) s->scale = grown; /* never past the f32 range */
        s->growth_tracker = 0;
    } else {
        s->growth_tracker = successful;
    }
}
