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
    if (dev == ANNEAL_DEVICE_COUNT) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: no inputs", name);
        return NULL;
    }
    return anneal_backend_get(dev);
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
    if (!be || be->reduce_sum(be->ctx, k, g) != ANNEAL_OK) return NULL;
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
    if (!be || be->copy(be->ctx, c, t) != ANNEAL_OK) return NULL;
    return c;
}

anneal_tensor *anneal_ops_new_like(const anneal_tensor *t) {
    return anneal_empty_on(t->device, ANNEAL_F32, t->ndim, t->shape);
}

/* Words for an op query in an error message. */
static const char *kind_name(anneal_op_kind k) {
    static const char *const names[ANNEAL_OP_KIND_COUNT] = {
        "copy", "fill", "binary", "unary", "reduce_sum", "matmul", "layer_norm", "add_layer_norm", "rms_norm",
        "softmax", "attention", "rope", "embedding", "cross_entropy", "linear_cross_entropy", "dropout", "randn",
        "adamw", "sum_squares", "check_index", "loss_mean", "scale_by"};
    return (unsigned)k < ANNEAL_OP_KIND_COUNT ? names[k] : "?";
}

static const char *epilogue_name(anneal_epilogue e) {
    static const char *const names[ANNEAL_EPILOGUE_COUNT] = {"none", "bias", "bias_gelu", "silu_mul", "bsum"};
    return (unsigned)e < ANNEAL_EPILOGUE_COUNT ? names[e] : "?";
}

bool anneal_ops_supported(const char *op, const anneal_backend *be, const anneal_op_query *q) {
    if (anneal_backend_supports(be, q)) return true;
    char what[160];
    int n = snprintf(what, sizeof what, "%s kernel on %s", kind_name(q->kind), anneal_dtype_name(q->dtype));
    if (q->matmul && n > 0 && (size_t)n < sizeof what)
        snprintf(what + n, sizeof what - (size_t)n, " (batch %lld, epilogue %s, compute %s)", (long long)q->matmul->batch,
                 epilogue_name(q->matmul->epilogue), anneal_dtype_name(q->matmul->compute));
    else if (q->attention && n > 0 && (size_t)n < sizeof what)
        snprintf(what + n, sizeof what - (size_t)n, " (%lld query heads over %lld key/value heads, compute %s%s)",
                 (long long)q->attention->Hq, (long long)q->attention->Hkv, anneal_dtype_name(q->attention->compute),
                 q->rope ? ", rotary embedding" : "");
    anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: the %s backend (device %d) has no %s", op, be->name,
                     (int)be->device, what);
    return false;
}

bool anneal_ops_kernel(const char *op, const anneal_backend *be, anneal_op_kind kind, anneal_dtype dt) {
    anneal_op_query q = {.kind = kind, .dtype = dt};
    return anneal_ops_supported(op, be, &q);
}

anneal_status anneal_ops_check_index(const char *op, const char *what, const anneal_backend *be,
                                     const anneal_tensor *ids, int64_t n, bool has_ignore,
                                     int32_t ignore_index, anneal_tensor **count_out) {
    if (!anneal_ops_kernel(op, be, ANNEAL_OP_CHECK_INDEX, ids->dtype)) return anneal_last_status();
    anneal_tensor *count = NULL;
    if (count_out && !(count = *count_out = anneal_empty_on(ids->device, ANNEAL_I64, 0, NULL)))
        return anneal_last_status();
    return be->check_index(be->ctx, op, what, ids, n, has_ignore, ignore_index, count);
}

bool anneal_ops_check_compute(const char *op, anneal_dtype compute) {
    if (compute == ANNEAL_F32 || compute == ANNEAL_BF16 || compute == ANNEAL_F16) return true;
    anneal_set_error(ANNEAL_ERR_ARG, "%s: compute precision must be f32, bf16 or f16, not %s", op,
                     anneal_dtype_name(compute));
    return false;
}

/* See ops_internal.h. */
bool anneal_ops_dense_layout(const anneal_tensor *t) {
    int idx[ANNEAL_MAX_DIMS], n = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) return false;
        if (t->shape[i] > 1) idx[n++] = i;
    }
    /* Sort the non-trivial dims by stride, innermost first (insertion sort, n <= 8). */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && t->strides[idx[j]] < t->strides[idx[j - 1]]; j--) {
            int s = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = s;
        }
    int64_t expect = 1;
    for (int i = 0; i < n; i++) {
        if (t->strides[idx[i]] != expect) return false;
        expect *= t->shape[idx[i]];
    }
    return true;
}

/* See ops_internal.h. */
anneal_tensor *anneal_ops_empty_with_strides(const anneal_tensor *t, anneal_dtype dt) {
    int64_t n = anneal_numel(t);
    anneal_scope_enter(NULL);
    anneal_tensor *base = anneal_empty_on(t->device, dt, 1, &n);
    anneal_scope_leave();
    if (!base) return NULL;
    anneal_tensor *v = anneal_alias(base, t->ndim, t->shape, t->strides, 0);
    anneal_release(base); /* v keeps the storage */
    return v;
}
