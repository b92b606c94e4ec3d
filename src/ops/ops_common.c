/* Shared argument checks and broadcasting helpers for ops (see ops_internal.h). */
#include "ops_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const anneal_backend *anneal_ops_backend(const char *name, int n, anneal_tensor *const *inputs) {
    anneal_device dev = ANNEAL_DEVICE_COUNT;
    for (int i = 0; i < n; i++) {
        if (!inputs[i]) {
            if (anneal_last_status() == ANNEAL_OK)
                anneal_set_error(ANNEAL_ERR_ARG, "%s: input %d is NULL", name, i);
            return NULL;
        }
        if (dev == ANNEAL_DEVICE_COUNT) dev = inputs[i]->device;
        else if (inputs[i]->device != dev) {
            anneal_set_error(ANNEAL_ERR_DEVICE, "%s: inputs on %s and %s", name,
                             anneal_device_name(dev), anneal_device_name(inputs[i]->device));
            return NULL;
        }
    }
    return anneal_backend_get(dev == ANNEAL_DEVICE_COUNT ? ANNEAL_CPU : dev);
}

bool anneal_ops_require_f32(const char *op, const char *arg, const anneal_tensor *t) {
    if (t->dtype == ANNEAL_F32) return true;
    anneal_set_error(ANNEAL_ERR_DTYPE, "%s: %s must be f32, got %s", op, arg,
                     anneal_dtype_name(t->dtype));
    return false;
}

bool anneal_ops_require_i32(const char *op, const char *arg, const anneal_tensor *t) {
    if (t->dtype == ANNEAL_I32) return true;
    anneal_set_error(ANNEAL_ERR_DTYPE, "%s: %s must be i32, got %s", op, arg,
                     anneal_dtype_name(t->dtype));
    return false;
}

int anneal_ops_dim(const char *op, int dim, int ndim) {
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= ndim) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: dim %d out of range for a %d-dim tensor", op, dim, ndim);
        return -1;
    }
    return d;
}

bool anneal_ops_broadcast_shape(const char *op, const anneal_tensor *a, const anneal_tensor *b,
                                int *ndim, int64_t *shape) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int ia = i - (nd - a->ndim), ib = i - (nd - b->ndim);
        int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char x[128], y[128];
            anneal_set_error(ANNEAL_ERR_SHAPE, "%s: shapes %s and %s do not broadcast", op,
                             anneal_shape_str(a, x, sizeof x), anneal_shape_str(b, y, sizeof y));
            return false;
        }
        shape[i] = sa == 1 ? sb : sa;
    }
    *ndim = nd;
    return true;
}

anneal_tensor *anneal_ops_expand(const anneal_tensor *t, int ndim, const int64_t *shape) {
    int64_t strides[ANNEAL_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        int it = i - (ndim - t->ndim);
        strides[i] = (it >= 0 && t->shape[it] == shape[i]) ? t->strides[it] : 0;
    }
    return anneal_alias(t, ndim, shape, strides, t->offset);
}

anneal_tensor *anneal_ops_sum_to(const anneal_tensor *g, int ndim, const int64_t *shape) {
    bool same = g->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = g->shape[i] == shape[i];
    if (same) return (anneal_tensor *)g;
    /* Reduce over g's dims that are broadcast in `shape` (keeping g's rank), then view. */
    int64_t kshape[ANNEAL_MAX_DIMS];
    for (int i = 0; i < g->ndim; i++) {
        int is = i - (g->ndim - ndim);
        kshape[i] = (is >= 0 && shape[is] == g->shape[i]) ? g->shape[i] : 1;
    }
    anneal_tensor *k = anneal_empty_on(g->device, g->dtype, g->ndim, kshape);
    if (!k) return NULL;
    const anneal_backend *be = anneal_backend_get(g->device);
    if (!be || be->reduce_sum(k, g) != ANNEAL_OK) return NULL;
    int64_t strides[ANNEAL_MAX_DIMS], st = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        strides[i] = st;
        st *= shape[i];
    }
    return anneal_alias(k, ndim, shape, strides, 0);
}

anneal_tensor *anneal_ops_contiguous_raw(anneal_tensor *t) {
    if (!t) return NULL;
    if (anneal_is_contiguous(t)) return t;
    anneal_tensor *c = anneal_empty_on(t->device, t->dtype, t->ndim, t->shape);
    if (!c) return NULL;
    const anneal_backend *be = anneal_backend_get(t->device);
    if (!be || be->copy(c, t) != ANNEAL_OK) return NULL;
    return c;
}

anneal_tensor *anneal_ops_new_like(const anneal_tensor *t) {
    return anneal_empty_on(t->device, ANNEAL_F32, t->ndim, t->shape);
}

const char *anneal_ops_index_str(const anneal_tensor *t, int64_t pos, char *buf, size_t n) {
    int64_t idx[ANNEAL_MAX_DIMS];
    for (int d = t->ndim - 1; d >= 0; d--) {
        idx[d] = t->shape[d] ? pos % t->shape[d] : 0;
        pos = t->shape[d] ? pos / t->shape[d] : 0;
    }
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < t->ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", d ? ", " : "", (long long)idx[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

const void *anneal_ops_host_view(const anneal_backend *be, const anneal_tensor *t, size_t elem,
                                 void **owned) {
    *owned = NULL;
    int64_t n = anneal_numel(t);
    if (t->device == ANNEAL_CPU || n == 0) return anneal_data(t);
    void *p = malloc((size_t)n * elem);
    if (!p) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory reading %lld values to the host", (long long)n);
        return NULL;
    }
    if (be->to_host(p, anneal_data(t), (size_t)n * elem) != ANNEAL_OK) {
        free(p);
        return NULL;
    }
    *owned = p;
    return p;
}

const int32_t *anneal_ops_check_targets(const char *op, const anneal_backend *be, const anneal_tensor *tc,
                                        int64_t V, int32_t ignore_index, int64_t *count, void **owned) {
    const int32_t *t = anneal_ops_host_view(be, tc, sizeof(int32_t), owned);
    if (!t) return NULL;
    int64_t n = anneal_numel(tc), kept = 0;
    for (int64_t i = 0; i < n; i++) {
        if (t[i] == ignore_index) continue;
        if (t[i] < 0 || t[i] >= V) {
            char b[128];
            anneal_set_error(ANNEAL_ERR_ARG,
                             "%s: target %d at position %s (flat index %lld) is outside [0, V) with V = %lld and "
                             "is not ignore_index (%d)",
                             op, (int)t[i], anneal_ops_index_str(tc, i, b, sizeof b), (long long)i, (long long)V,
                             (int)ignore_index);
            free(*owned);
            *owned = NULL;
            return NULL;
        }
        kept++;
    }
    *count = kept;
    return t;
}
