/* Residual add + LayerNorm as one op with two outputs: s = x + r (the new residual
 * stream, output 1) and y = LayerNorm(s) (output 0), computed by the backend's
 * add_layer_norm_fwd in one pass over memory. Backward: s's gradient is ds (from s's
 * other uses) plus LayerNorm's dx, combined by add_layer_norm_bwd in the same pass,
 * and it is the gradient of both x and r. */
#include "ops_internal.h"

/* Checks that a norm parameter p is f32 with shape exactly (C). */
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

/* Saved: s (contiguous), w (or ones), mean (N), rstd (N). Inputs: x, r, w, b. */
static anneal_status add_layer_norm_backward(anneal_node *node, anneal_tensor *const *gout,
                                             anneal_tensor **gin) {
    anneal_tensor *s = node->saved[0], *w = node->saved[1], *mean = node->saved[2],
                  *rstd = node->saved[3];
    const anneal_backend *be = anneal_backend_get(s->device);
    if (!be) return anneal_last_status();
    anneal_tensor *dy = gout[0] ? anneal_ops_contiguous_raw(gout[0]) : NULL;
    anneal_tensor *ds = gout[1] ? anneal_ops_contiguous_raw(gout[1]) : NULL;
    if ((gout[0] && !dy) || (gout[1] && !ds)) return anneal_last_status();
    bool want_x = anneal_node_input_needs_grad(node, 0), want_r = anneal_node_input_needs_grad(node, 1);
    if (!dy) { /* only s's other uses sent a gradient: it passes straight to x and r */
        gin[0] = want_x ? ds : NULL;
        gin[1] = want_r ? ds : NULL;
        return ANNEAL_OK;
    }
    anneal_tensor *dx = NULL, *dw = NULL, *db = NULL;
    if ((want_x || want_r) && !(dx = anneal_ops_new_like(s))) return anneal_last_status();
    if (anneal_node_input_needs_grad(node, 2) && !(dw = anneal_ops_new_like(w))) return anneal_last_status();
    if (anneal_node_input_needs_grad(node, 3) && !(db = anneal_ops_new_like(w))) return anneal_last_status();
    int64_t span_t0 = anneal_span_begin();
    anneal_status st = anneal_ops_span_end("add_layer_norm_bwd", &span_t0, 0, anneal_ops_span_bytes(dx), be->add_layer_norm_bwd(be->ctx, dx, dw, db, s, w, mean, rstd, dy, ds));
    gin[0] = want_x ? dx : NULL; /* the engine never modifies a gradient in place: sharing is safe */
    gin[1] = want_r ? dx : NULL;
    gin[2] = dw;
    gin[3] = db;
    return st;
}

anneal_tensor *anneal_add_layer_norm(anneal_tensor *x, anneal_tensor *r, anneal_tensor *w,
                                     anneal_tensor *b, float eps, anneal_tensor **sum_out) {
    const char *op = "add_layer_norm";
    if (!sum_out) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: sum_out must not be NULL (it receives x + r)", op);
        return NULL;
    }
    *sum_out = NULL;
    anneal_tensor *given[4];
    int n_given = 0;
    given[n_given++] = x;
    given[n_given++] = r;
    if (w) given[n_given++] = w;
    if (b) given[n_given++] = b;
    const anneal_backend *be = anneal_ops_backend(op, n_given, given);
    if (!be || !anneal_ops_require_f32(op, "x", x) || !anneal_ops_require_f32(op, "r", r) ||
        !anneal_ops_kernel(op, be, ANNEAL_OP_ADD_LAYER_NORM, ANNEAL_F32))
        return NULL;
    char b1[128], b2[128];
    if (x->ndim < 1 || !anneal_same_shape(x, r)) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "%s: x %s and r %s must have the same shape with at least 1 dim (no "
                         "broadcasting)",
                         op, anneal_shape_str(x, b1, sizeof b1), anneal_shape_str(r, b2, sizeof b2));
        return NULL;
    }
    int64_t C = x->shape[x->ndim - 1], N = 1;
    for (int i = 0; i < x->ndim - 1; i++) N *= x->shape[i];
    if ((w && !check_param(op, "weight", w, C)) || (b && !check_param(op, "bias", b, C))) return NULL;
    anneal_tensor *xc = anneal_ops_contiguous_raw(x), *rc = anneal_ops_contiguous_raw(r);
    anneal_tensor *wc = w ? anneal_ops_contiguous_raw(w) : anneal_empty_on(x->device, ANNEAL_F32, 1, &C);
    anneal_tensor *bc = b ? anneal_ops_contiguous_raw(b) : NULL; /* NULL bias: none added */
    if (!xc || !rc || !wc || (b && !bc)) return NULL;
    if (!w && be->fill(be->ctx, wc, 1.0) != ANNEAL_OK) return NULL;
    anneal_tensor *s = anneal_ops_new_like(x), *y = anneal_ops_new_like(x);
    anneal_tensor *mean = anneal_empty_on(x->device, ANNEAL_F32, 1, &N);
    anneal_tensor *rstd = anneal_empty_on(x->device, ANNEAL_F32, 1, &N);
    int64_t span_t0 = anneal_span_begin();
    if (!s || !y || !mean || !rstd ||
        anneal_ops_span_end("add_layer_norm_fwd", &span_t0, 0, anneal_ops_span_bytes(s), be->add_layer_norm_fwd(be->ctx, s, y, mean, rstd, xc, rc, wc, bc, eps)) != ANNEAL_OK)
        return NULL;
    anneal_tensor *in[4] = {x, r, w, b}, *out[2] = {y, s};
    anneal_node *node = anneal_record(op, add_layer_norm_backward, 4, in, 2, out);
    if (node) {
        node->scalars[0] = eps;
        anneal_node_save(node, s);
        anneal_node_save(node, wc);
        anneal_node_save(node, mean);
        anneal_node_save(node, rstd);
        if (node->n_saved != 4) return NULL;
    }
    *sum_out = s;
    return y;
}
