/* Shape ops: reshape, transpose, permute, narrow (views sharing storage), split,
 * cat, contiguous, clone and cast, with their backward rules. */
#include "ops_internal.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------- reshape family */

/* Gradient of any op whose output holds the input's elements in row-major order
 * (reshape, contiguous, clone): reshape dy back to the input's shape. */
static anneal_status reshape_backward(anneal_node *node, anneal_tensor *const *gout,
                                      anneal_tensor **gin) {
    gin[0] = anneal_reshape(gout[0], node->inputs[0].ndim, node->inputs[0].shape);
    return anneal_last_status();
}

anneal_tensor *anneal_reshape(anneal_tensor *t, int ndim, const int64_t *shape) {
    if (!anneal_ops_backend("reshape", 1, &t)) return NULL;
    if (ndim < 0 || ndim > ANNEAL_MAX_DIMS || (ndim && !shape)) {
        anneal_set_error(ANNEAL_ERR_ARG, "reshape: bad rank %d", ndim);
        return NULL;
    }
    int64_t s[ANNEAL_MAX_DIMS], known = 1, n = anneal_numel(t);
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        s[i] = shape[i];
        if (s[i] == -1 && infer < 0) infer = i;
        else if (s[i] < 0) {
            anneal_set_error(ANNEAL_ERR_SHAPE, "reshape: bad size %lld in dim %d", (long long)s[i], i);
            return NULL;
        } else known *= s[i];
    }
    if (infer >= 0) s[infer] = known ? n / known : 0;
    int64_t total = 1;
    for (int i = 0; i < ndim; i++) total *= s[i];
    if (total != n || (infer >= 0 && known && n % known)) {
        char b[128];
        anneal_set_error(ANNEAL_ERR_SHAPE, "reshape: cannot view %s (%lld elements) as %lld elements",
                         anneal_shape_str(t, b, sizeof b), (long long)n, (long long)total);
        return NULL;
    }
    anneal_tensor *src = anneal_ops_contiguous_raw(t);
    if (!src) return NULL;
    int64_t strides[ANNEAL_MAX_DIMS], st = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        strides[i] = st;
        st *= s[i];
    }
    anneal_tensor *out = anneal_alias(src, ndim, s, strides, src->offset);
    if (out) anneal_record("reshape", reshape_backward, 1, &t, 1, &out);
    return out;
}

anneal_tensor *anneal_contiguous(anneal_tensor *t) {
    if (!anneal_ops_backend("contiguous", 1, &t)) return NULL;
    if (anneal_is_contiguous(t)) return t;
    return anneal_clone(t);
}

anneal_tensor *anneal_clone(anneal_tensor *t) {
    const anneal_backend *be = anneal_ops_backend("clone", 1, &t);
    if (!be) return NULL;
    anneal_tensor *out = anneal_empty_on(t->device, t->dtype, t->ndim, t->shape);
    if (!out || be->copy(be->ctx, out, t) != ANNEAL_OK) return NULL;
    anneal_record("clone", reshape_backward, 1, &t, 1, &out);
    return out;
}

/* ------------------------------------------------------------- permute */

/* Gradient of a permutation: the inverse permutation of dy. */
static anneal_status permute_backward(anneal_node *node, anneal_tensor *const *gout,
                                      anneal_tensor **gin) {
    int inv[ANNEAL_MAX_DIMS];
    for (int i = 0; i < node->inputs[0].ndim; i++) inv[node->ints[i]] = i;
    gin[0] = anneal_permute(gout[0], inv);
    return anneal_last_status();
}

anneal_tensor *anneal_permute(anneal_tensor *t, const int *perm) {
    if (!anneal_ops_backend("permute", 1, &t)) return NULL;
    int64_t shape[ANNEAL_MAX_DIMS], strides[ANNEAL_MAX_DIMS];
    bool used[ANNEAL_MAX_DIMS] = {false};
    for (int i = 0; i < t->ndim; i++) {
        int p = perm ? perm[i] : -1;
        if (p < 0 || p >= t->ndim || used[p]) {
            anneal_set_error(ANNEAL_ERR_ARG, "permute: not a permutation of %d dims", t->ndim);
            return NULL;
        }
        used[p] = true;
        shape[i] = t->shape[p];
        strides[i] = t->strides[p];
    }
    anneal_tensor *out = anneal_alias(t, t->ndim, shape, strides, t->offset);
    anneal_node *node = out ? anneal_record("permute", permute_backward, 1, &t, 1, &out) : NULL;
    if (node)
        for (int i = 0; i < t->ndim; i++) node->ints[i] = perm[i];
    return out;
}

anneal_tensor *anneal_transpose(anneal_tensor *t, int d0, int d1) {
    if (!anneal_ops_backend("transpose", 1, &t)) return NULL;
    int a = anneal_ops_dim("transpose", d0, t->ndim), b = anneal_ops_dim("transpose", d1, t->ndim);
    if (a < 0 || b < 0) return NULL;
    int perm[ANNEAL_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) perm[i] = i;
    perm[a] = b;
    perm[b] = a;
    return anneal_permute(t, perm);
}

/* -------------------------------------------------------------- narrow */

/* Gradient of narrow: dy placed into zeros of the input's shape. */
static anneal_status narrow_backward(anneal_node *node, anneal_tensor *const *gout,
                                     anneal_tensor **gin) {
    const anneal_edge *e = &node->inputs[0];
    anneal_tensor *dx = anneal_empty_on(gout[0]->device, gout[0]->dtype, e->ndim, e->shape);
    const anneal_backend *be = dx ? anneal_backend_get(dx->device) : NULL;
    if (!be || be->fill(be->ctx, dx, 0.0) != ANNEAL_OK) return anneal_last_status();
    int dim = (int)node->ints[0];
    int64_t start = node->ints[1];
    int64_t shape[ANNEAL_MAX_DIMS];
    memcpy(shape, dx->shape, sizeof shape);
    shape[dim] = gout[0]->shape[dim];
    anneal_tensor *win = anneal_alias(dx, dx->ndim, shape, dx->strides, start * dx->strides[dim]);
    anneal_status s = win ? be->copy(be->ctx, win, gout[0]) : anneal_last_status();
    gin[0] = dx;
    return s;
}

anneal_tensor *anneal_narrow(anneal_tensor *t, int dim, int64_t start, int64_t len) {
    if (!anneal_ops_backend("narrow", 1, &t)) return NULL;
    int d = anneal_ops_dim("narrow", dim, t->ndim);
    if (d < 0) return NULL;
    if (start < 0 || len < 0 || start + len > t->shape[d]) {
        anneal_set_error(ANNEAL_ERR_ARG, "narrow: [%lld, %lld) is outside dim %d of size %lld",
                         (long long)start, (long long)(start + len), d, (long long)t->shape[d]);
        return NULL;
    }
    int64_t shape[ANNEAL_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[d] = len;
    anneal_tensor *out = anneal_alias(t, t->ndim, shape, t->strides, t->offset + start * t->strides[d]);
    anneal_node *node = out ? anneal_record("narrow", narrow_backward, 1, &t, 1, &out) : NULL;
    if (node) {
        node->ints[0] = d;
        node->ints[1] = start;
    }
    return out;
}

anneal_status anneal_split(anneal_tensor *t, int dim, int n, const int64_t *sizes, anneal_tensor **out) {
    if (!out || n <= 0 || !sizes) return anneal_set_error(ANNEAL_ERR_ARG, "split: bad arguments");
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (!anneal_ops_backend("split", 1, &t)) return anneal_last_status();
    int d = anneal_ops_dim("split", dim, t->ndim);
    if (d < 0) return anneal_last_status();
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += sizes[i] < 0 ? t->shape[d] + 1 : sizes[i];
    if (total != t->shape[d])
        return anneal_set_error(ANNEAL_ERR_SHAPE, "split: sizes add up to %lld, dim %d has %lld",
                                (long long)total, d, (long long)t->shape[d]);
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
        out[i] = anneal_narrow(t, d, start, sizes[i]);
        if (!out[i]) return anneal_last_status();
        start += sizes[i];
    }
    return ANNEAL_OK;
}

/* ----------------------------------------------------------------- cat */

/* Gradient of cat: the slice of dy that each input occupied. */
static anneal_status cat_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin) {
    int dim = (int)node->ints[0];
    int64_t start = 0;
    for (int i = 0; i < node->n_inputs; i++) {
        int64_t len = ((const int64_t *)node->ctx)[i];
        if (node->inputs[i].needs_grad) gin[i] = anneal_narrow(gout[0], dim, start, len);
        start += len;
    }
    return anneal_last_status();
}

anneal_tensor *anneal_cat(int n, anneal_tensor *const *ts, int dim) {
    if (n <= 0 || !ts) {
        anneal_set_error(ANNEAL_ERR_ARG, "cat: no tensors");
        return NULL;
    }
    const anneal_backend *be = anneal_ops_backend("cat", n, ts);
    if (!be) return NULL;
    int d = anneal_ops_dim("cat", dim, ts[0]->ndim);
    if (d < 0) return NULL;
    int64_t shape[ANNEAL_MAX_DIMS];
    memcpy(shape, ts[0]->shape, sizeof shape);
    shape[d] = 0;
    for (int i = 0; i < n; i++) {
        bool ok = ts[i]->ndim == ts[0]->ndim && ts[i]->dtype == ts[0]->dtype;
        for (int k = 0; ok && k < ts[0]->ndim; k++) ok = k == d || ts[i]->shape[k] == ts[0]->shape[k];
        if (!ok) {
            char a[128], b[128];
            anneal_set_error(ANNEAL_ERR_SHAPE, "cat: tensor %d %s %s does not fit tensor 0 %s %s on dim %d",
                             i, anneal_shape_str(ts[i], a, sizeof a), anneal_dtype_name(ts[i]->dtype),
                             anneal_shape_str(ts[0], b, sizeof b), anneal_dtype_name(ts[0]->dtype), d);
            return NULL;
        }
        shape[d] += ts[i]->shape[d];
    }
    anneal_tensor *out = anneal_empty_on(ts[0]->device, ts[0]->dtype, ts[0]->ndim, shape);
    if (!out) return NULL;
    int64_t start = 0;
    int64_t *lens = malloc((size_t)n * sizeof *lens);
    if (!lens) {
        anneal_set_error(ANNEAL_ERR_OOM, "cat: out of memory");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        int64_t s2[ANNEAL_MAX_DIMS];
        memcpy(s2, shape, sizeof s2);
        s2[d] = ts[i]->shape[d];
        lens[i] = s2[d];
        anneal_scope_enter(NULL);
        anneal_tensor *win = anneal_alias(out, out->ndim, s2, out->strides, start * out->strides[d]);
        anneal_scope_leave();
        anneal_status s = win ? be->copy(be->ctx, win, ts[i]) : anneal_last_status();
        anneal_release(win);
        if (s != ANNEAL_OK) {
            free(lens);
            return NULL;
        }
        start += s2[d];
    }
    anneal_node *node = anneal_record("cat", cat_backward, n, ts, 1, &out);
    if (node) {
        node->ints[0] = d;
        node->ctx = lens;
        node->ctx_free = free;
    } else {
        free(lens);
    }
    return out;
}

/* ---------------------------------------------------------------- cast */

/* Gradient of a cast: dy converted back to the input's dtype. */
static anneal_status cast_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin) {
    gin[0] = anneal_cast(gout[0], (anneal_dtype)node->ints[0]);
    return anneal_last_status();
}

anneal_tensor *anneal_cast(anneal_tensor *t, anneal_dtype dt) {
    const anneal_backend *be = anneal_ops_backend("cast", 1, &t);
    if (!be) return NULL;
    if ((unsigned)dt >= ANNEAL_DTYPE_COUNT) {
        anneal_set_error(ANNEAL_ERR_DTYPE, "cast: invalid dtype %d", (int)dt);
        return NULL;
    }
    anneal_tensor *out = anneal_empty_on(t->device, dt, t->ndim, t->shape);
    if (!out || be->copy(be->ctx, out, t) != ANNEAL_OK) return NULL;
    if (anneal_dtype_is_float(dt)) {
        anneal_node *node = anneal_record("cast", cast_backward, 1, &t, 1, &out);
        if (node) node->ints[0] = t->dtype;
    }
    return out;
}

/* ------------------------------------------------------------ creation */

anneal_tensor *anneal_full(anneal_dtype dt, int ndim, const int64_t *shape, double value) {
    anneal_tensor *t = anneal_empty(dt, ndim, shape);
    const anneal_backend *be = t ? anneal_backend_get(t->device) : NULL;
    if (!be || be->fill(be->ctx, t, value) != ANNEAL_OK) return NULL;
    return t;
}

anneal_tensor *anneal_randn(anneal_dtype dt, int ndim, const int64_t *shape, float mean, float std) {
    anneal_tensor *t = anneal_empty(ANNEAL_F32, ndim, shape);
    const anneal_backend *be = t ? anneal_backend_get(t->device) : NULL;
    if (!be) return NULL;
    anneal_rng_state rs = anneal_rng_get();
    uint64_t offset = anneal_rng_reserve(2 * (uint64_t)anneal_numel(t));
    if (be->randn(be->ctx, t, mean, std, rs.seed, offset) != ANNEAL_OK) return NULL;
    return dt == ANNEAL_F32 ? t : anneal_cast(t, dt);
}
