/* conv1d + bias + tanh-GELU as one op (the GPT-2 MLP's first layer): the backend's
 * dense_gelu_fwd slot runs one GEMM whose epilogue adds the bias and applies the GELU,
 * storing the pre-activation for backward. Backward: dpre = dy * gelu'(pre), then the
 * conv1d rules dx = dpre @ w^T, dw = x^T @ dpre, db = column sums of dpre (taken by the
 * dw GEMM while it packs dpre), with the GEMMs at the matmul precision as anneal_conv1d's. */
#include "ops_internal.h"

#include <string.h>

/* Saved: x2 (R, in) contiguous, w (in, out) contiguous, pre (R, out). */
static anneal_status conv1d_gelu_backward(anneal_node *node, anneal_tensor *const *gout,
                                          anneal_tensor **gin) {
    anneal_tensor *x2 = node->saved[0], *w = node->saved[1], *pre = node->saved[2];
    const anneal_backend *be = anneal_backend_get(pre->device);
    anneal_tensor *dy = anneal_ops_contiguous_raw(gout[0]);
    if (!be || !dy) return anneal_last_status();
    int64_t R = pre->shape[0], N = pre->shape[1], K = x2->shape[1];
    anneal_dtype cd = anneal_get_matmul_dtype();
    anneal_tensor *dy2 = anneal_alias(dy, 2, (int64_t[]){R, N}, (int64_t[]){N, 1}, dy->offset);
    anneal_tensor *dpre = anneal_empty_on(pre->device, ANNEAL_F32, 2, (int64_t[]){R, N});
    if (!dy2 || !dpre || be->unary_bwd(ANNEAL_UNARY_GELU_TANH, dpre, pre, dy2, 0.0f) != ANNEAL_OK)
        return anneal_last_status();
    if (anneal_node_input_needs_grad(node, 0)) {
        const anneal_edge *e = &node->inputs[0];
        anneal_tensor *dx = anneal_empty_on(pre->device, ANNEAL_F32, e->ndim, e->shape);
        anneal_tensor *dx2 = dx ? anneal_alias(dx, 2, (int64_t[]){R, K}, (int64_t[]){K, 1}, 0) : NULL;
        anneal_tensor *wt = anneal_alias(w, 2, (int64_t[]){N, K}, (int64_t[]){1, N}, w->offset);
        if (!dx2 || !wt) return anneal_last_status();
        if (R > 0 && be->matmul(dx2, dpre, wt, 1.0f, 0.0f, cd) != ANNEAL_OK) return anneal_last_status();
        gin[0] = dx;
    }
    bool want_db = node->n_inputs == 3 && anneal_node_input_needs_grad(node, 2);
    if (anneal_node_input_needs_grad(node, 1)) {
        anneal_tensor *dw = anneal_empty_on(pre->device, ANNEAL_F32, 2, w->shape);
        anneal_tensor *xt = anneal_alias(x2, 2, (int64_t[]){K, R}, (int64_t[]){1, K}, x2->offset);
        if (!dw || !xt) return anneal_last_status();
        anneal_status s;
        if (R > 0 && want_db && be->matmul_bsum) { /* db = column sums of dpre, with dW */
            anneal_tensor *db = anneal_empty_on(pre->device, ANNEAL_F32, 1, &N);
            if (!db) return anneal_last_status();
            s = be->matmul_bsum(dw, xt, dpre, db, cd);
            gin[2] = db;
            want_db = false;
        } else {
            s = R > 0 ? be->matmul(dw, xt, dpre, 1.0f, 0.0f, cd) : be->fill(dw, 0.0);
        }
        if (s != ANNEAL_OK) return s;
        gin[1] = dw;
    }
    if (want_db) {
        if (R == 0) {
            anneal_tensor *db = anneal_empty_on(pre->device, ANNEAL_F32, 1, &N);
            if (!db || be->fill(db, 0.0) != ANNEAL_OK) return anneal_last_status();
            gin[2] = db;
        } else {
            gin[2] = anneal_ops_sum_to(dpre, 1, &N);
        }
    }
    return anneal_last_status();
}

anneal_tensor *anneal_conv1d_gelu(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b) {
    const char *op = "conv1d_gelu";
    anneal_tensor *in[3] = {x, w, b};
    int n = b ? 3 : 2;
    const anneal_backend *be = anneal_ops_backend(op, n, in);
    if (!be) return NULL;
    if (!anneal_ops_require_f32(op, "x", x) || !anneal_ops_require_f32(op, "weight", w) ||
        (b && !anneal_ops_require_f32(op, "bias", b)))
        return NULL;
    char sx[128], sw[128], sb[128];
    if (w->ndim != 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: weight must be 2-D (in, out), got %s", op,
                         anneal_shape_str(w, sw, sizeof sw));
        return NULL;
    }
    if (x->ndim < 1) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x must have at least 1 dim, got a 0-dim tensor", op);
        return NULL;
    }
    int64_t K = w->shape[0], N = w->shape[1];
    if (x->shape[x->ndim - 1] != K) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x %s has %lld features but weight %s (in, out) expects %lld",
                         op, anneal_shape_str(x, sx, sizeof sx), (long long)x->shape[x->ndim - 1],
                         anneal_shape_str(w, sw, sizeof sw), (long long)K);
        return NULL;
    }
    if (b && (b->ndim != 1 || b->shape[0] != N)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: bias %s must be (%lld) for weight %s (in, out)", op,
                         anneal_shape_str(b, sb, sizeof sb), (long long)N,
                         anneal_shape_str(w, sw, sizeof sw));
        return NULL;
    }
    int64_t shape[ANNEAL_MAX_DIMS], R = 1;
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = N;
    for (int i = 0; i < x->ndim - 1; i++) R *= x->shape[i];
    anneal_tensor *y = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, shape);
    anneal_scope *tmp = y ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* pre, views and copies die with tmp unless saved */
    anneal_tensor *xc = anneal_ops_contiguous_raw(x), *wc = anneal_ops_contiguous_raw(w);
    anneal_tensor *bc = b ? anneal_ops_contiguous_raw(b) : NULL;
    anneal_tensor *x2 = xc ? anneal_alias(xc, 2, (int64_t[]){R, K}, (int64_t[]){K, 1}, xc->offset) : NULL;
    anneal_tensor *y2 = anneal_alias(y, 2, (int64_t[]){R, N}, (int64_t[]){N, 1}, 0);
    anneal_tensor *pre = anneal_empty_on(x->device, ANNEAL_F32, 2, (int64_t[]){R, N});
    anneal_status s = (x2 && wc && (bc || !b) && y2 && pre) ? ANNEAL_OK : anneal_last_status();
    if (s == ANNEAL_OK) s = be->dense_gelu_fwd(y2, pre, x2, wc, bc, anneal_get_matmul_dtype());
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record(op, conv1d_gelu_backward, n, in, 1, &y);
        if (node) {
            anneal_node_save(node, x2);
            anneal_node_save(node, wc);
            anneal_node_save(node, pre);
            if (node->n_saved != 3) s = anneal_last_status();
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? y : NULL;
}
