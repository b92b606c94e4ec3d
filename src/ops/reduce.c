/* Reductions: sum and mean over all elements or one dim, with backward rules
 * that broadcast the incoming gradient back over the reduced elements. */
#include "ops_internal.h"

#include <string.h>

/* d(sum)/dx = 1 broadcast: expand dy (with kept dims) to the input shape, scaled for mean. */
static anneal_status sum_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin) {
    const anneal_edge *e = &node->inputs[0];
    anneal_tensor *dy = gout[0];
    /* Restore the reduced dim as size 1 so broadcasting lines up. */
    int64_t kshape[ANNEAL_MAX_DIMS];
    int nd = e->ndim;
    for (int i = 0; i < nd; i++) kshape[i] = e->shape[i];
    if (node->ints[0] >= 0) kshape[node->ints[0]] = 1;
    else for (int i = 0; i < nd; i++) kshape[i] = 1;
    anneal_tensor *k = anneal_reshape(dy, nd, kshape);
    if (!k) return anneal_last_status();
    anneal_tensor *ex = anneal_ops_expand(k, nd, e->shape);
    anneal_tensor *dx = ex ? anneal_ops_new_like(ex) : NULL;
    const anneal_backend *be = dx ? anneal_backend_get(dx->device) : NULL;
    if (!be || be->copy(be->ctx, dx, ex) != ANNEAL_OK) return anneal_last_status();
    float scale = (float)node->scalars[0];
    if (scale != 1.0f) dx = anneal_scale(dx, scale);
    gin[0] = dx;
    return anneal_last_status();
}

static anneal_tensor *reduce(const char *name, anneal_tensor *x, int dim, bool keepdim, bool mean) {
    const anneal_backend *be = anneal_ops_backend(name, 1, &x);
    if (!be || !anneal_ops_require_f32(name, "x", x) || !anneal_ops_kernel(name, be, ANNEAL_OP_REDUCE_SUM, ANNEAL_F32))
        return NULL;
    int d = -1;
    int64_t kshape[ANNEAL_MAX_DIMS];
    int64_t count;
    if (dim == INT32_MIN) { /* all elements */
        for (int i = 0; i < x->ndim; i++) kshape[i] = 1;
        count = anneal_numel(x);
    } else {
        d = anneal_ops_dim(name, dim, x->ndim);
        if (d < 0) return NULL;
        memcpy(kshape, x->shape, sizeof kshape);
        kshape[d] = 1;
        count = x->shape[d];
    }
    anneal_tensor *k = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, kshape);
    if (!k) return NULL;
    if (anneal_numel(x) == 0) {
        if (be->fill(be->ctx, k, 0.0) != ANNEAL_OK) return NULL;
    } else if (be->reduce_sum(be->ctx, k, x) != ANNEAL_OK) {
        return NULL;
    }
    float scale = mean ? (count ? 1.0f / (float)count : 0.0f) : 1.0f;
    if (mean && be->unary(be->ctx, ANNEAL_UNARY_SCALE, k, k, scale) != ANNEAL_OK) return NULL;
    /* Final shape: scalar for all, or drop dim d unless keepdim. */
    int nd = 0;
    int64_t oshape[ANNEAL_MAX_DIMS];
    if (d >= 0)
        for (int i = 0; i < x->ndim; i++)
            if (i != d || keepdim) oshape[nd++] = kshape[i];
    int64_t strides[ANNEAL_MAX_DIMS], st = 1;
    for (int i = nd - 1; i >= 0; i--) {
        strides[i] = st;
        st *= oshape[i];
    }
    anneal_tensor *out = anneal_alias(k, nd, oshape, strides, 0);
    anneal_node *node = out ? anneal_record(name, sum_backward, 1, &x, 1, &out) : NULL;
    if (node) {
        node->ints[0] = d;
        node->scalars[0] = scale;
    }
    return out;
}

anneal_tensor *anneal_sum(anneal_tensor *x) { return reduce("sum", x, INT32_MIN, false, false); }
anneal_tensor *anneal_mean(anneal_tensor *x) { return reduce("mean", x, INT32_MIN, false, true); }
anneal_tensor *anneal_sum_dim(anneal_tensor *x, int dim, bool keepdim) {
    return reduce("sum_dim", x, dim, keepdim, false);
}
anneal_tensor *anneal_mean_dim(anneal_tensor *x, int dim, bool keepdim) {
    return reduce("mean_dim", x, dim, keepdim, true);
}
