/* Elementwise ops: broadcasting add/sub/mul/div, scalar scale and shift, GELU, SiLU
 * and dropout, with their backward rules. */
#include "ops_internal.h"

#include <string.h>

/* ---------------------------------------------------------------- binary */

static const char *const k_binary_names[] = {"add", "sub", "mul", "div"};

/* Gradients of out = a op b; saved: a, b (mul, div). Reduced to each input's shape. */
static anneal_status binary_backward(anneal_node *node, anneal_tensor *const *gout,
                                     anneal_tensor **gin) {
    anneal_binary_op op = (anneal_binary_op)node->ints[0];
    anneal_tensor *dy = gout[0], *a = node->saved[0], *b = node->saved[1];
    const anneal_edge *ea = &node->inputs[0], *eb = &node->inputs[1];
    anneal_tensor *ga = NULL, *gb = NULL;
    switch (op) {
    case ANNEAL_ADD: ga = dy; gb = dy; break;
    case ANNEAL_SUB: ga = dy; gb = eb->needs_grad ? anneal_scale(dy, -1.0f) : NULL; break;
    case ANNEAL_MUL:
        ga = ea->needs_grad ? anneal_mul(dy, b) : NULL;
        gb = eb->needs_grad ? anneal_mul(dy, a) : NULL;
        break;
    case ANNEAL_DIV:
        ga = ea->needs_grad ? anneal_div(dy, b) : NULL;
        /* d(a/b)/db = -a / b^2 */
        gb = eb->needs_grad ? anneal_scale(anneal_div(anneal_mul(dy, a), anneal_mul(b, b)), -1.0f) : NULL;
        break;
    }
    if (ea->needs_grad) gin[0] = ga ? anneal_ops_sum_to(ga, ea->ndim, ea->shape) : NULL;
    if (eb->needs_grad) gin[1] = gb ? anneal_ops_sum_to(gb, eb->ndim, eb->shape) : NULL;
    return anneal_last_status();
}

static anneal_tensor *binary(anneal_binary_op op, anneal_tensor *a, anneal_tensor *b) {
    const char *name = k_binary_names[op];
    anneal_tensor *in[2] = {a, b};
    const anneal_backend *be = anneal_ops_backend(name, 2, in);
    if (!be) return NULL;
    if (!anneal_ops_require_f32(name, "a", a) || !anneal_ops_require_f32(name, "b", b) ||
        !anneal_ops_kernel(name, be, ANNEAL_OP_BINARY, ANNEAL_F32))
        return NULL;
    int nd;
    int64_t shape[ANNEAL_MAX_DIMS];
    if (!anneal_ops_broadcast_shape(name, a, b, &nd, shape)) return NULL;
    anneal_tensor *out = anneal_empty_on(a->device, ANNEAL_F32, nd, shape);
    if (!out) return NULL;
    anneal_scope_enter(NULL);
    anneal_tensor *xa = anneal_ops_expand(a, nd, shape), *xb = anneal_ops_expand(b, nd, shape);
    anneal_scope_leave();
    int64_t span_t0 = anneal_span_begin();
    anneal_status s = (xa && xb) ? anneal_ops_span_end("binary", &span_t0, 0, anneal_ops_span_bytes(xa), be->binary(be->ctx, op, out, xa, xb)) : anneal_last_status();
    anneal_release(xa);
    anneal_release(xb);
    if (s != ANNEAL_OK) return NULL;
    anneal_node *node = anneal_record(name, binary_backward, 2, in, 1, &out);
    if (node) {
        node->ints[0] = op;
        if (op == ANNEAL_MUL || op == ANNEAL_DIV) {
            anneal_node_save(node, a);
            anneal_node_save(node, b);
        }
    }
    return out;
}

anneal_tensor *anneal_add(anneal_tensor *a, anneal_tensor *b) { return binary(ANNEAL_ADD, a, b); }
anneal_tensor *anneal_sub(anneal_tensor *a, anneal_tensor *b) { return binary(ANNEAL_SUB, a, b); }
anneal_tensor *anneal_mul(anneal_tensor *a, anneal_tensor *b) { return binary(ANNEAL_MUL, a, b); }
anneal_tensor *anneal_div(anneal_tensor *a, anneal_tensor *b) { return binary(ANNEAL_DIV, a, b); }

/* ----------------------------------------------------------------- unary */

static const char *unary_name(anneal_unary_op op) {
    switch (op) {
    case ANNEAL_UNARY_SCALE: return "scale";
    case ANNEAL_UNARY_ADD_SCALAR: return "add_scalar";
    case ANNEAL_UNARY_GELU_TANH: return "gelu_tanh";
    case ANNEAL_UNARY_GELU_ERF: return "gelu";
    case ANNEAL_UNARY_SILU: return "silu";
    }
    return "unary";
}

/* dx = dy * f'(x); saved: x (contiguous) for the nonlinear ones. */
static anneal_status unary_backward(anneal_node *node, anneal_tensor *const *gout,
                                    anneal_tensor **gin) {
    anneal_unary_op op = (anneal_unary_op)node->ints[0];
    anneal_tensor *dy = anneal_ops_contiguous_raw(gout[0]);
    if (!dy) return anneal_last_status();
    anneal_tensor *dx = anneal_ops_new_like(dy);
    const anneal_backend *be = anneal_backend_get(dy->device);
    if (!dx || !be) return anneal_last_status();
    int64_t span_t0 = anneal_span_begin();
    anneal_status s = be->unary_bwd(be->ctx, op, dx, node->n_saved ? node->saved[0] : NULL, dy,
                                    (float)node->scalars[0]);
    anneal_ops_span_end("unary_bwd", &span_t0, 0, anneal_ops_span_bytes(dx), ANNEAL_OK);
    gin[0] = dx;
    return s;
}

static anneal_tensor *unary(anneal_unary_op op, anneal_tensor *x, float alpha) {
    const char *name = unary_name(op);
    const anneal_backend *be = anneal_ops_backend(name, 1, &x);
    if (!be || !anneal_ops_require_f32(name, "x", x) || !anneal_ops_kernel(name, be, ANNEAL_OP_UNARY, ANNEAL_F32))
        return NULL;
    anneal_tensor *xc = anneal_ops_contiguous_raw(x);
    anneal_tensor *out = xc ? anneal_ops_new_like(x) : NULL;
    int64_t span_t0 = anneal_span_begin();
    if (!out || anneal_ops_span_end("unary", &span_t0, 0, anneal_ops_span_bytes(xc), be->unary(be->ctx, op, out, xc, alpha)) != ANNEAL_OK) return NULL;
    anneal_node *node = anneal_record(name, unary_backward, 1, &x, 1, &out);
    if (node) {
        node->ints[0] = op;
        node->scalars[0] = alpha;
        if (op != ANNEAL_UNARY_SCALE && op != ANNEAL_UNARY_ADD_SCALAR) anneal_node_save(node, xc);
    }
    return out;
}

anneal_tensor *anneal_scale(anneal_tensor *x, float s) { return unary(ANNEAL_UNARY_SCALE, x, s); }
anneal_tensor *anneal_add_scalar(anneal_tensor *x, float s) {
    return unary(ANNEAL_UNARY_ADD_SCALAR, x, s);
}
anneal_tensor *anneal_gelu(anneal_tensor *x, bool tanh_approx) {
    return unary(tanh_approx ? ANNEAL_UNARY_GELU_TANH : ANNEAL_UNARY_GELU_ERF, x, 0.0f);
}
anneal_tensor *anneal_silu(anneal_tensor *x) { return unary(ANNEAL_UNARY_SILU, x, 0.0f); }

/* --------------------------------------------------------------- dropout */

/* dx = dy * mask / (1 - p); saved: mask. */
static anneal_status dropout_backward(anneal_node *node, anneal_tensor *const *gout,
                                      anneal_tensor **gin) {
    anneal_tensor *dy = anneal_ops_contiguous_raw(gout[0]);
    anneal_tensor *dx = dy ? anneal_ops_new_like(dy) : NULL;
    const anneal_backend *be = dx ? anneal_backend_get(dx->device) : NULL;
    if (!be) return anneal_last_status();
    gin[0] = dx;
    int64_t span_t0 = anneal_span_begin();
    return anneal_ops_span_end("dropout_bwd", &span_t0, 0, anneal_ops_span_bytes(dx), be->dropout_bwd(be->ctx, dx, node->saved[0], dy, (float)node->scalars[0]));
}

anneal_tensor *anneal_dropout(anneal_tensor *x, float p, bool training) {
    const anneal_backend *be = anneal_ops_backend("dropout", 1, &x);
    if (!be) return NULL;
    if (!(p >= 0.0f && p < 1.0f)) {
        anneal_set_error(ANNEAL_ERR_ARG, "dropout: p = %g is outside [0, 1)", (double)p);
        return NULL;
    }
    if (!training || p == 0.0f) return x;
    if (!anneal_ops_require_f32("dropout", "x", x) || !anneal_ops_kernel("dropout", be, ANNEAL_OP_DROPOUT, ANNEAL_F32))
        return NULL;
    anneal_tensor *xc = anneal_ops_contiguous_raw(x);
    anneal_tensor *out = xc ? anneal_ops_new_like(x) : NULL;
    anneal_tensor *mask = out ? anneal_empty_on(x->device, ANNEAL_U8, x->ndim, x->shape) : NULL;
    if (!mask) return NULL;
    anneal_rng_state rs = anneal_rng_get();
    uint64_t offset = anneal_rng_reserve((uint64_t)anneal_numel(x));
    int64_t span_t0 = anneal_span_begin();
    if (anneal_ops_span_end("dropout_fwd", &span_t0, 0, anneal_ops_span_bytes(out), be->dropout_fwd(be->ctx, out, mask, xc, p, rs.seed, offset)) != ANNEAL_OK) return NULL;
    anneal_node *node = anneal_record("dropout", dropout_backward, 1, &x, 1, &out);
    if (node) {
        node->scalars[0] = p;
        anneal_node_save(node, mask);
    }
    return out;
}
