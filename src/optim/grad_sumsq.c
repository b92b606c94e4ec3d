/* The sums of squares of every gradient of a parameter set with one synchronisation
 * per device: each device's backend writes every one of its gradients' sums (in double)
 * into one F64 tensor on that device (sum_squares at the parameter's index), then one
 * copy_to_host + synchronize per device brings them all to the host. Clipping and the
 * loss scaler add them up in registration order there, so the norm has the same bits
 * as summing one parameter at a time. */
#include "optim_internal.h"

#include <stdlib.h>

#include "anneal/backend.h"

/* Sum of squares of g into acc[index] (a non-contiguous g through a contiguous
 * temporary owned by the current scope). */
static anneal_status one(const anneal_backend *be, anneal_tensor *acc, int64_t index, const anneal_tensor *g) {
    if (anneal_is_contiguous(g)) return be->sum_squares(be->ctx, acc, index, g);
    anneal_tensor *c = anneal_empty_on(g->device, ANNEAL_F32, g->ndim, g->shape);
    anneal_status s = c ? be->copy(be->ctx, c, g) : anneal_last_status();
    return s == ANNEAL_OK ? be->sum_squares(be->ctx, acc, index, c) : s;
}

anneal_status anneal_optim_grad_sumsq(const char *who, const anneal_params *ps, double *ss) {
    int n = ps->n;
    for (int i = 0; i < n; i++) {
        const anneal_tensor *g = ps->items[i].tensor->grad;
        ss[i] = 0.0;
        if (g && g->dtype != ANNEAL_F32)
            return anneal_set_error(ANNEAL_ERR_DTYPE, "%s: grad of '%s' is %s, not f32", who, ps->items[i].name,
                                    anneal_dtype_name(g->dtype));
    }
    anneal_scope *tmp = anneal_scope_open();
    if (!tmp) return anneal_last_status();
    anneal_tensor *acc[ANNEAL_DEVICE_COUNT] = {0};
    const anneal_backend *bes[ANNEAL_DEVICE_COUNT] = {0};
    anneal_status s = ANNEAL_OK;
    for (int i = 0; i < n && s == ANNEAL_OK; i++) {
        const anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g) continue;
        anneal_device d = g->device;
        if (!acc[d]) {
            int64_t len = n;
            if (!(bes[d] = anneal_backend_get(d)) || !(acc[d] = anneal_empty_on(d, ANNEAL_F64, 1, &len))) {
                s = anneal_last_status();
                break;
            }
            anneal_op_query q = {.kind = ANNEAL_OP_SUM_SQUARES, .dtype = ANNEAL_F32};
            if (!anneal_backend_supports(bes[d], &q)) {
                s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: device %s has no sum-of-squares kernel", who,
                                     anneal_device_name(d));
                break;
            }
        }
        s = one(bes[d], acc[d], i, g);
    }
    /* One device (the usual case): its sums land in ss directly; with several, each
     * device's go through a host buffer and only its parameters' entries are kept. */
    int n_dev = 0;
    for (int d = 0; d < ANNEAL_DEVICE_COUNT; d++) n_dev += acc[d] != NULL;
    double *host = s == ANNEAL_OK && n_dev > 1 ? malloc((size_t)n * sizeof *host) : ss;
    if (!host) s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory for the gradient norm", who);
    for (int d = 0; d < ANNEAL_DEVICE_COUNT && s == ANNEAL_OK; d++) {
        if (!acc[d]) continue;
        s = bes[d]->copy_to_host(bes[d]->ctx, host, anneal_data(acc[d]), (size_t)n * sizeof *host);
        if (s == ANNEAL_OK) s = bes[d]->synchronize(bes[d]->ctx);
        for (int i = 0; i < n && s == ANNEAL_OK; i++) {
            const anneal_tensor *g = ps->items[i].tensor->grad;
            if (!g) ss[i] = 0.0;
            else if (g->device == (anneal_device)d) ss[i] = host[i];
        }
    }
    if (host != ss) free(host);
    anneal_scope_close(tmp);
    return s;
}
