/* Tensors: shape, strides and dtype over refcounted storage; creation, aliases
 * (the raw material of views), reference counting and element access. */
#include "anneal/backend.h"
#include "core_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void (*node_release_hook)(struct anneal_node *n);

void anneal_set_node_release_hook(void (*fn)(struct anneal_node *n)) { node_release_hook = fn; }

int64_t anneal_numel(const anneal_tensor *t) {
    if (!t) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

int64_t anneal_size(const anneal_tensor *t, int dim) {
    if (!t) return -1;
    if (dim < 0) dim += t->ndim;
    if (dim < 0 || dim >= t->ndim) return -1;
    return t->shape[dim];
}

bool anneal_is_contiguous(const anneal_tensor *t) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != expect) return false;
        expect *= t->shape[i];
    }
    return true;
}

void *anneal_data(const anneal_tensor *t) {
    return (char *)t->storage->data + t->offset * (int64_t)anneal_dtype_size(t->dtype);
}

const char *anneal_dims_str(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, ")");
    return buf;
}

const char *anneal_shape_str(const anneal_tensor *t, char *buf, size_t n) {
    return anneal_dims_str(t ? t->ndim : 0, t ? t->shape : NULL, buf, n);
}

bool anneal_same_shape(const anneal_tensor *a, const anneal_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

static bool check_shape(int ndim, const int64_t *shape, int64_t *numel_out) {
    if (ndim < 0 || ndim > ANNEAL_MAX_DIMS) {
        anneal_set_error(ANNEAL_ERR_ARG, "tensor rank %d is outside 0..%d", ndim, ANNEAL_MAX_DIMS);
        return false;
    }
    if (ndim > 0 && !shape) {
        anneal_set_error(ANNEAL_ERR_ARG, "NULL shape for a rank-%d tensor", ndim);
        return false;
    }
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            anneal_set_error(ANNEAL_ERR_ARG, "negative size %lld in dim %d", (long long)shape[i], i);
            return false;
        }
        if (shape[i] && n > INT64_MAX / 16 / shape[i]) {
            anneal_set_error(ANNEAL_ERR_OOM, "tensor of %d dims is too large", ndim);
            return false;
        }
        n *= shape[i];
    }
    *numel_out = n;
    return true;
}

static anneal_tensor *tensor_struct(anneal_storage *st, anneal_dtype dt, anneal_device dev) {
    anneal_tensor *t = anneal_pool_alloc(sizeof *t); /* zero-filled, reused across steps */
    if (!t) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory allocating a tensor");
        return NULL;
    }
    t->storage = st;
    t->dtype = dt;
    t->device = dev;
    t->refcount = 1;
    return t;
}

/* A contiguous tensor on dev in the current scope; with zero set, its bytes are zero
 * when *zeroed says so (fresh memory the backend handed out zeroed). */
static anneal_tensor *new_contiguous(anneal_device dev, anneal_dtype dt, int ndim, const int64_t *shape, bool zero,
                                     bool *zeroed) {
    if ((unsigned)dt >= ANNEAL_DTYPE_COUNT) {
        anneal_set_error(ANNEAL_ERR_DTYPE, "invalid dtype %d", (int)dt);
        return NULL;
    }
    int64_t n;
    if (!check_shape(ndim, shape, &n)) return NULL;
    size_t bytes = (size_t)n * anneal_dtype_size(dt);
    anneal_storage *st = zero ? anneal_storage_new_zeroed(dev, bytes, zeroed) : anneal_storage_new(dev, bytes);
    if (!st) return NULL;
    anneal_tensor *t = tensor_struct(st, dt, dev);
    if (!t) {
        anneal_storage_release(st);
        return NULL;
    }
    t->ndim = ndim;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->shape[i] = shape[i];
        t->strides[i] = stride;
        stride *= shape[i];
    }
    anneal_scope_register(t);
    return t;
}

anneal_tensor *anneal_empty_on(anneal_device dev, anneal_dtype dt, int ndim, const int64_t *shape) {
    return new_contiguous(dev, dt, ndim, shape, false, NULL);
}

anneal_tensor *anneal_empty(anneal_dtype dt, int ndim, const int64_t *shape) {
    return anneal_empty_on(ANNEAL_CPU, dt, ndim, shape);
}

anneal_tensor *anneal_empty_like(const anneal_tensor *like) {
    if (!like) return NULL;
    return anneal_empty_on(like->device, like->dtype, like->ndim, like->shape);
}

/* t (fresh, contiguous) filled with zeros by its device's backend; NULL on failure. */
static anneal_tensor *fill_zero(anneal_tensor *t) {
    if (!t) return NULL;
    const anneal_backend *be = anneal_backend_get(t->device);
    if (!be || be->fill(be->ctx, t, 0.0) != ANNEAL_OK) return NULL;
    return t;
}

/* Zeros on dev: memory handed out zeroed is not written (so not touched). */
static anneal_tensor *zeros_on(anneal_device dev, anneal_dtype dt, int ndim, const int64_t *shape) {
    bool zeroed = false;
    anneal_tensor *t = new_contiguous(dev, dt, ndim, shape, true, &zeroed);
    return zeroed ? t : fill_zero(t);
}

anneal_tensor *anneal_zeros(anneal_dtype dt, int ndim, const int64_t *shape) {
    return zeros_on(ANNEAL_CPU, dt, ndim, shape);
}

anneal_tensor *anneal_zeros_like(const anneal_tensor *like) {
    return like ? zeros_on(like->device, like->dtype, like->ndim, like->shape) : NULL;
}

anneal_tensor *anneal_from_data(anneal_dtype dt, int ndim, const int64_t *shape, const void *data) {
    return anneal_from_data_on(ANNEAL_CPU, dt, ndim, shape, data);
}

anneal_tensor *anneal_from_data_on(anneal_device dev, anneal_dtype dt, int ndim, const int64_t *shape,
                                   const void *data) {
    anneal_tensor *t = anneal_empty_on(dev, dt, ndim, shape);
    if (!t) return NULL;
    size_t n = t->storage->nbytes;
    if (!data && n) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_from_data_on: NULL data");
        return NULL;
    }
    const anneal_backend *be = anneal_backend_get(dev);
    if (!be || (n && be->copy_from_host(be->ctx, t->storage->data, data, n) != ANNEAL_OK)) return NULL;
    return t;
}

anneal_tensor *anneal_scalar(float v) { return anneal_from_data(ANNEAL_F32, 0, NULL, &v); }

anneal_tensor *anneal_alias(const anneal_tensor *src, int ndim, const int64_t *shape,
                            const int64_t *strides, int64_t offset) {
    if (!src) return NULL;
    if (ndim < 0 || ndim > ANNEAL_MAX_DIMS) {
        anneal_set_error(ANNEAL_ERR_ARG, "alias rank %d is outside 0..%d", ndim, ANNEAL_MAX_DIMS);
        return NULL;
    }
    /* The alias must stay inside the storage. */
    int64_t lo = offset, hi = offset, esz = (int64_t)anneal_dtype_size(src->dtype);
    bool empty = false;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            anneal_set_error(ANNEAL_ERR_ARG, "alias with negative size in dim %d", i);
            return NULL;
        }
        if (shape[i] == 0) empty = true;
        int64_t span = (shape[i] - 1) * strides[i];
        if (span < 0) lo += span; else hi += span;
    }
    if (!empty && (lo < 0 || (hi + 1) * esz > (int64_t)src->storage->nbytes)) {
        anneal_set_error(ANNEAL_ERR_ARG, "view reaches outside its storage");
        return NULL;
    }
    anneal_tensor *t = tensor_struct(src->storage, src->dtype, src->device);
    if (!t) return NULL;
    anneal_storage_retain(src->storage);
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        t->strides[i] = strides[i];
    }
    t->offset = offset;
    anneal_scope_register(t);
    return t;
}

anneal_tensor *anneal_detach(const anneal_tensor *t) {
    if (!t) return NULL;
    return anneal_alias(t, t->ndim, t->shape, t->strides, t->offset);
}

/* A caller-owned contiguous tensor of src's shape and dtype on device dev. */
static anneal_tensor *staging(anneal_device dev, const anneal_tensor *src) {
    anneal_scope_enter(NULL);
    anneal_tensor *t = anneal_empty_on(dev, src->dtype, src->ndim, src->shape);
    anneal_scope_leave();
    return t;
}

/* dst = src across devices through host memory: src's elements are made contiguous on
 * its device, copied to a host buffer, copied to a contiguous tensor on dst's device
 * and converted into dst there. Two synchronisations (the host buffer is freed after). */
static anneal_status copy_across(anneal_tensor *dst, const anneal_tensor *src) {
    const anneal_backend *bs = anneal_backend_get(src->device), *bd = anneal_backend_get(dst->device);
    if (!bs || !bd) return anneal_last_status();
    size_t nbytes = (size_t)anneal_numel(src) * anneal_dtype_size(src->dtype);
    anneal_tensor *a = staging(src->device, src), *b = a ? staging(dst->device, src) : NULL;
    void *host = b ? malloc(nbytes ? nbytes : 1) : NULL;
    anneal_status s = host ? ANNEAL_OK
                           : a && b ? anneal_set_error(ANNEAL_ERR_OOM, "copy from %s to %s: out of memory for %zu bytes",
                                                       anneal_device_name(src->device),
                                                       anneal_device_name(dst->device), nbytes)
                                    : anneal_last_status();
    if (s == ANNEAL_OK) s = bs->copy(bs->ctx, a, src);
    if (s == ANNEAL_OK && nbytes) s = bs->copy_to_host(bs->ctx, host, anneal_data(a), nbytes);
    if (s == ANNEAL_OK) s = bs->synchronize(bs->ctx);
    if (s == ANNEAL_OK && nbytes) s = bd->copy_from_host(bd->ctx, anneal_data(b), host, nbytes);
    if (s == ANNEAL_OK) s = bd->copy(bd->ctx, dst, b);
    if (s == ANNEAL_OK) s = bd->synchronize(bd->ctx);
    free(host);
    anneal_release(a);
    anneal_release(b);
    return s;
}

anneal_status anneal_copy_(anneal_tensor *dst, const anneal_tensor *src) {
    if (!dst || !src) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_copy_: NULL tensor");
    if (!anneal_same_shape(dst, src)) {
        char a[128], b[128];
        return anneal_set_error(ANNEAL_ERR_SHAPE, "copy: shape %s into %s",
                                anneal_shape_str(src, a, sizeof a), anneal_shape_str(dst, b, sizeof b));
    }
    if (dst->device != src->device) return copy_across(dst, src);
    const anneal_backend *be = anneal_backend_get(dst->device);
    if (!be) return anneal_last_status();
    return be->copy(be->ctx, dst, src);
}

anneal_status anneal_to_f32_buffer(const anneal_tensor *t, float *out) {
    if (!t || !out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_to_f32_buffer: NULL argument");
    const anneal_backend *be = anneal_backend_get(t->device);
    if (!be) return anneal_last_status();
    anneal_scope_enter(NULL);
    anneal_tensor *dst = anneal_empty_on(t->device, ANNEAL_F32, t->ndim, t->shape);
    anneal_scope_leave();
    if (!dst) return anneal_last_status();
    size_t nbytes = (size_t)anneal_numel(t) * sizeof(float);
    anneal_status s = be->copy(be->ctx, dst, t);
    if (s == ANNEAL_OK && nbytes) s = be->copy_to_host(be->ctx, out, anneal_data(dst), nbytes);
    if (s == ANNEAL_OK) s = be->synchronize(be->ctx);
    anneal_release(dst);
    return s;
}

double anneal_item_at(const anneal_tensor *t, int64_t linear) {
    if (!t || linear < 0 || linear >= anneal_numel(t)) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_item_at: index %lld out of range", (long long)linear);
        return 0.0;
    }
    int64_t off = t->offset;
    for (int i = t->ndim - 1; i >= 0; i--) {
        off += (linear % t->shape[i]) * t->strides[i];
        linear /= t->shape[i];
    }
    size_t esz = anneal_dtype_size(t->dtype);
    unsigned char raw[8];
    const anneal_backend *be = anneal_backend_get(t->device);
    if (!be) return 0.0;
    if (be->copy_to_host(be->ctx, raw, (char *)t->storage->data + off * (int64_t)esz, esz) != ANNEAL_OK ||
        be->synchronize(be->ctx) != ANNEAL_OK)
        return 0.0;
    switch (t->dtype) {
    case ANNEAL_F32: { float v; memcpy(&v, raw, 4); return v; }
    case ANNEAL_BF16: { uint16_t v; memcpy(&v, raw, 2); return anneal_bf16_to_f32(v); }
    case ANNEAL_F16: { uint16_t v; memcpy(&v, raw, 2); return anneal_f16_to_f32(v); }
    case ANNEAL_I32: { int32_t v; memcpy(&v, raw, 4); return v; }
    case ANNEAL_I64: { int64_t v; memcpy(&v, raw, 8); return (double)v; }
    case ANNEAL_U16: { uint16_t v; memcpy(&v, raw, 2); return v; }
    case ANNEAL_U8: return raw[0];
    case ANNEAL_I8: return (int8_t)raw[0];
    case ANNEAL_F64: { double v; memcpy(&v, raw, 8); return v; }
    default: return 0.0;
    }
}

double anneal_item(const anneal_tensor *t) { return anneal_item_at(t, 0); }

anneal_status anneal_tensor_set_storage(anneal_tensor *t, const anneal_tensor *src, int64_t offset) {
    if (!t) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_tensor_set_storage: NULL tensor");
    if (src) {
        int64_t hi = offset;
        for (int i = 0; i < t->ndim; i++) hi += (t->shape[i] - 1) * t->strides[i];
        if (src->dtype != t->dtype || src->device != t->device || offset < 0 || !src->storage ||
            (hi + 1) * (int64_t)anneal_dtype_size(t->dtype) > (int64_t)src->storage->nbytes)
            return anneal_set_error(ANNEAL_ERR_ARG, "anneal_tensor_set_storage: the tensor does not fit the storage");
        anneal_storage_retain(src->storage);
    }
    anneal_storage_release(t->storage);
    t->storage = src ? src->storage : NULL;
    t->offset = src ? offset : 0;
    return ANNEAL_OK;
}

anneal_tensor *anneal_retain(anneal_tensor *t) {
    if (t) t->refcount++;
    return t;
}

void anneal_release(anneal_tensor *t) {
    if (!t) return;
    if (--t->refcount > 0) {
        /* The last reference may be the scope's; nothing else to do. */
        return;
    }
    if (t->_scope) anneal_scope_forget(t);
    if (t->grad) anneal_release(t->grad);
    if (t->grad_fn && node_release_hook) node_release_hook(t->grad_fn);
    anneal_storage_release(t->storage);
    free(t->name);
    anneal_pool_free(t);
}

anneal_status anneal_set_requires_grad(anneal_tensor *t, bool on) {
    if (!t) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_set_requires_grad: NULL tensor");
    if (on && !anneal_dtype_is_float(t->dtype))
        return anneal_set_error(ANNEAL_ERR_DTYPE, "only float tensors can require grad (got %s)",
                                anneal_dtype_name(t->dtype));
    if (!on && t->grad_fn)
        return anneal_set_error(ANNEAL_ERR_STATE, "requires_grad cannot be turned off on a non-leaf");
    t->requires_grad = on;
    return ANNEAL_OK;
}

anneal_tensor *anneal_set_name(anneal_tensor *t, const char *name) {
    if (!t) return NULL;
    char *copy = name ? strdup(name) : NULL;
    if (name && !copy) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory naming a tensor");
        return NULL;
    }
    free(t->name);
    t->name = copy;
    return t;
}
