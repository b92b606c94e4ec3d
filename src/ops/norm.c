/* Normalisation over the last dim: LayerNorm (weight and bias optional) and RMSNorm
 * (weight optional). x (..., C) is treated as N = numel/C rows of C; the kernels
 * write per-row statistics (mean, rstd: (N)) that the backward reuses. */
#include "ops_internal.h"

/* Checks that a norm parameter p (weight or bias) is f32 with shape exactly (C). */
static bool check_param(const char *op, const char *arg, const anneal_tensor *p, int64_t C) {
    if (!anneal_ops_require_f32(op, arg, p)) return false;
    if (p->ndim != 1 || p->shape[0] != C) {
        char buf[128];
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: %s has shape %s, expected (%lld) to match the last dim of x",
                         op, arg, anneal_shape_str(p, buf, sizeof buf), (long long)C);
        return false;
    }
    return true;
}

/* Checks x (f32, at least 1-D) and returns its row count N (leading dims) and C. */
static bool check_x(const char *op, const anneal_tensor *x, int64_t *N, int64_t *C) {
    if (!anneal_ops_require_f32(op, "x", x)) return false;
    if (x->ndim < 1) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x is 0-dim; it needs a last dim to normalise over", op);
        return false;
    }
    *C = x->shape[x->ndim - 1];
    *N = 1;
    for (int i = 0; i < x->ndim - 1; i++) *N *= x->shape[i];
    return true;
}

/* A contiguous (C) weight: p made contiguous, or a tensor of ones when p is NULL (the
 * kernels always read a weight). */
static anneal_tensor *weight_or_ones(const anneal_backend *be, anneal_tensor *p, anneal_device dev,
                                     int64_t C) {
    if (p) return anneal_ops_contiguous_raw(p);
    anneal_tensor *ones = anneal_empty_on(dev, ANNEAL_F32, 1, &C);
    if (!ones || be->fill(be->ctx, ones, 1.0) != ANNEAL_OK) return NULL;
    return ones;
}

/* -------------------------------------------------------------- LayerNorm */

/* Gradients of y = (x - mean) * rstd * w + b; saved: x (contiguous), w (or ones),
 * mean (N), rstd (N). Only the wanted gradients are allocated and computed. */
static anneal_status layer_norm_backward(anneal_node *node, anneal_tensor *const *gout,
                                         anneal_tensor **gin) {
    anneal_tensor *x = node->saved[0], *w = node->saved[1], *mean = node->saved[2],
                  *rstd = node->saved[3];
    const anneal_backend *be = anneal_backend_get(x->device);
    anneal_tensor *dy = anneal_ops_contiguous_raw(gout[0]);
    if (!be || !dy) return anneal_last_status();
    anneal_tensor *dx = NULL, *dw = NULL, *db = NULL;
    if (anneal_node_input_needs_grad(node, 0) && !(dx = anneal_ops_new_like(x))) return anneal_last_status();
    if (anneal_node_input_needs_grad(node, 1) && !(dw = anneal_ops_new_like(w))) return anneal_last_status();
    if (anneal_node_input_needs_grad(node, 2) && !(db = anneal_ops_new_like(w))) return anneal_last_status();
    int64_t span_t0 = anneal_span_begin();
    anneal_status s = anneal_ops_span_end("layer_norm_bwd", &span_t0, 0, anneal_ops_span_bytes(dx), be->layer_norm_bwd(be->ctx, dx, dw, db, x, w, mean, rstd, dy));
    gin[0] = dx;
    gin[1] = dw;
    gin[2] = db;
    return s;
}

anneal_tensor *anneal_layer_norm(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, float eps) {
    const char *op = "layer_norm";
    /* w and b are optional: only the given ones take part in the device check. */
    anneal_tensor *given[3];
    int n_given = 0;
    given[n_given++] = x;
    if (w) given[n_given++] = w;
    if (b) given[n_given++] = b;
    const anneal_backend *be = anneal_ops_backend(op, n_given, given);
    int64_t N, C;
    if (!be || !check_x(op, x, &N, &C) || !anneal_ops_kernel(op, be, ANNEAL_OP_LAYER_NORM, ANNEAL_F32)) return NULL;
    if ((w && !check_param(op, "weight", w, C)) || (b && !check_param(op, "bias", b, C))) return NULL;
    anneal_tensor *xc = anneal_ops_contiguous_raw(x);
    anneal_tensor *wc = xc ? weight_or_ones(be, w, x->device, C) : NULL;
    anneal_tensor *bc = b ? anneal_ops_contiguous_raw(b) : NULL; /* NULL bias: the kernel adds none */
    if (!wc || (b && !bc)) return NULL;
    anneal_tensor *y = anneal_ops_new_like(x);
    anneal_tensor *mean = y ? anneal_empty_on(x->device, ANNEAL_F32, 1, &N) : NULL;
    anneal_tensor *rstd = mean ? anneal_empty_on(x->device, ANNEAL_F32, 1, &N) : NULL;
    int64_t span_t0 = anneal_span_begin();
    if (!rstd || anneal_ops_span_end("layer_norm_fwd", &span_t0, 0, anneal_ops_span_bytes(y), be->layer_norm_fwd(be->ctx, y, mean, rstd, xc, wc, bc, eps)) != ANNEAL_OK) return NULL;
    anneal_tensor *in[3] = {x, w, b};
    anneal_node *node = anneal_record(op, layer_norm_backward, 3, in, 1, &y);
    if (node) {
        node->scalars[0] = eps;
        anneal_node_save(node, xc);
        anneal_node_save(node, wc);
        anneal_node_save(node, mean);
        anneal_node_save(node, rstd);
        if (node->n_saved != 4) return NULL;
    }
    return y;
}

/* ---------------------------------------------------------------- RMSNorm */

/* Gradients of y = x * rstd * w; saved: x (contiguous), w (or ones), rstd (N). */
static anneal_status rms_norm_backward(anneal_node *node, anneal_tensor *const *gout,
                                       anneal_tensor **gin) {
    anneal_tensor *x = node->saved[0], *w = node->saved[1], *rstd = node->saved[2];
    const anneal_backend *be = anneal_backend_get(x->device);
    anneal_tensor *dy = anneal_ops_contiguous_raw(gout[0]);
    if (!be || !dy) return anneal_last_status();
    anneal_tensor *dx = NULL, *dw = NULL;
    if (anneal_node_input_needs_grad(node, 0) && !(dx = anneal_ops_new_like(x))) return anneal_last_status();
    if (anneal_node_input_needs_grad(node, 1) && !(dw = anneal_ops_new_like(w))) return anneal_last_status();
    int64_t span_t0 = anneal_span_begin();
    anneal_status s = anneal_ops_span_end("rms_norm_bwd", &span_t0, 0, anneal_ops_span_bytes(dx), be->rms_norm_bwd(be->ctx, dx, dw, x, w, rstd, dy));
    gin[0] = dx;
    gin[1] = dw;
    return s;
}

anneal_tensor *anneal_rms_norm(anneal_tensor *x, anneal_tensor *w, float eps) {
    const char *op = "rms_norm";
    anneal_tensor *given[2] = {x, w};
    const anneal_backend *be = anneal_ops_backend(op, w ? 2 : 1, given);
    int64_t N, C;
    if (!be || !check_x(op, x, &N, &C) || !anneal_ops_kernel(op, be, ANNEAL_OP_RMS_NORM, ANNEAL_F32)) return NULL;
    if (w && !check_param(op, "weight", w, C)) return NULL;
    anneal_tensor *xc = anneal_ops_contiguous_raw(x);
    anneal_tensor *wc = xc ? weight_or_ones(be, w, x->device, C) : NULL;
    if (!wc) return NULL;
    anneal_tensor *y = anneal_ops_new_like(x);
    anneal_tensor *rstd = y ? anneal_empty_on(x->device, ANNEAL_F32, 1, &N) : NULL;
    int64_t span_t0 = anneal_span_begin();
    if (!rstd || anneal_ops_span_end("rms_norm_fwd", &span_t0, 0, anneal_ops_span_bytes(y), be->rms_norm_fwd(be->ctx, y, rstd, xc, wc, eps)) != ANNEAL_OK) return NULL;
    anneal_tensor *in[2] = {x, w};
    anneal_node *node = anneal_record(op, rms_norm_backward, 2, in, 1, &y);
    if (node) {
        node->scalars[0] = eps;
        anneal_node_save(node, xc);
        anneal_node_save(node, wc);
        anneal_node_save(node, rstd);
        if (node->n_saved != 3) return NULL;
    }
    return y;
}
