/* Softmax and log-softmax over the last dim. The backward needs only the output y:
 * softmax dx = y * (dy - sum(dy * y)), log-softmax dx = dy - exp(y) * sum(dy). */
#include "ops_internal.h"

/* dx from the saved output y (contiguous); ints[0] = 1 for log-softmax. */
static anneal_status softmax_backward(anneal_node *node, anneal_tensor *const *gout,
                                      anneal_tensor **gin) {
    anneal_tensor *y = node->saved[0];
    const anneal_backend *be = anneal_backend_get(y->device);
    anneal_tensor *dy = anneal_ops_contiguous_raw(gout[0]);
    anneal_tensor *dx = dy ? anneal_ops_new_like(y) : NULL;
    if (!be || !dx) return anneal_last_status();
    gin[0] = dx;
    int64_t span_t0 = anneal_span_begin();
    return anneal_ops_span_end("softmax_bwd", &span_t0, 0, anneal_ops_span_bytes(dx), be->softmax_bwd(be->ctx, dx, y, dy, node->ints[0] != 0));
}

/* y (x's shape, contiguous) = (log-)softmax of x over its last dim (a 0-dim x is one
 * row of one element). */
static anneal_tensor *softmax(const char *op, anneal_tensor *x, bool log) {
    const anneal_backend *be = anneal_ops_backend(op, 1, &x);
    if (!be || !anneal_ops_require_f32(op, "x", x) || !anneal_ops_kernel(op, be, ANNEAL_OP_SOFTMAX, ANNEAL_F32))
        return NULL;
    anneal_tensor *xc = anneal_ops_contiguous_raw(x);
    anneal_tensor *y = xc ? anneal_ops_new_like(x) : NULL;
    int64_t span_t0 = anneal_span_begin();
    if (!y || anneal_ops_span_end("softmax_fwd", &span_t0, 0, anneal_ops_span_bytes(y), be->softmax_fwd(be->ctx, y, xc, log)) != ANNEAL_OK) return NULL;
    anneal_node *node = anneal_record(op, softmax_backward, 1, &x, 1, &y);
    if (node) {
        node->ints[0] = log;
        if (anneal_node_save(node, y) < 0) return NULL;
    }
    return y;
}

anneal_tensor *anneal_softmax(anneal_tensor *x) { return softmax("softmax", x, false); }
anneal_tensor *anneal_log_softmax(anneal_tensor *x) { return softmax("log_softmax", x, true); }
