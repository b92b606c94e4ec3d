/* Mean cross-entropy with a fused log-softmax: logits (..., V) against i32 targets
 * (...), skipping targets equal to ignore_index. Everything stays on the device: the
 * backend checks the targets and counts the kept rows (check_index), gives per-row
 * losses and logsumexps, and takes the mean over kept rows in double, in row order
 * (loss_mean), so the loss does not depend on the thread count; the backward reads the
 * upstream gradient and the count on the device as well. */
#include "ops_internal.h"

/* dlogits = (dloss / count) * (softmax - onehot) on kept rows, 0 on ignored ones;
 * saved: logits (contiguous), targets (contiguous), lse (N), count (I64 0-dim);
 * ints[0]: ignore_index. */
static anneal_status cross_entropy_backward(anneal_node *node, anneal_tensor *const *gout,
                                            anneal_tensor **gin) {
    anneal_tensor *logits = node->saved[0], *targets = node->saved[1], *lse = node->saved[2];
    anneal_tensor *count = node->saved[3];
    int32_t ignore_index = (int32_t)node->ints[0];
    const anneal_backend *be = anneal_backend_get(logits->device);
    anneal_tensor *dlogits = be ? anneal_ops_new_like(logits) : NULL;
    if (!dlogits) return anneal_last_status();
    gin[0] = dlogits;
    int64_t span_t0 = anneal_span_begin();
    return anneal_ops_span_end("cross_entropy_bwd", &span_t0, 0, anneal_ops_span_bytes(dlogits), be->cross_entropy_bwd(be->ctx, dlogits, logits, targets, lse, ignore_index, gout[0], count));
}

anneal_tensor *anneal_cross_entropy(anneal_tensor *logits, anneal_tensor *targets,
                                    int32_t ignore_index) {
    const char *op = "cross_entropy";
    anneal_tensor *in[2] = {logits, targets};
    const anneal_backend *be = anneal_ops_backend(op, 2, in);
    if (!be || !anneal_ops_require_f32(op, "logits", logits) ||
        !anneal_ops_require_i32(op, "targets", targets))
        return NULL;
    char b1[128], b2[128];
    bool shape_ok = logits->ndim >= 1 && targets->ndim == logits->ndim - 1;
    for (int i = 0; shape_ok && i < targets->ndim; i++) shape_ok = targets->shape[i] == logits->shape[i];
    if (!shape_ok) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "cross_entropy: logits %s and targets %s: targets must have the logits' "
                         "shape without its last (class) dim",
                         anneal_shape_str(logits, b1, sizeof b1), anneal_shape_str(targets, b2, sizeof b2));
        return NULL;
    }
    int64_t V = logits->shape[logits->ndim - 1], N = anneal_numel(targets);
    if (V == 0) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "cross_entropy: logits %s have no classes",
                         anneal_shape_str(logits, b1, sizeof b1));
        return NULL;
    }
    if (!anneal_ops_kernel(op, be, ANNEAL_OP_CROSS_ENTROPY, ANNEAL_F32) ||
        !anneal_ops_kernel(op, be, ANNEAL_OP_LOSS_MEAN, ANNEAL_F32))
        return NULL;
    anneal_tensor *tc = anneal_ops_contiguous_raw(targets);
    anneal_tensor *lc = tc ? anneal_ops_contiguous_raw(logits) : NULL;
    if (!lc) return NULL;
    /* Targets in [0, V) or ignored; the kept rows counted on the device. */
    anneal_tensor *count;
    if (anneal_ops_check_index(op, "target", be, tc, V, true, ignore_index, &count) != ANNEAL_OK) return NULL;
    anneal_tensor *loss = anneal_empty_on(logits->device, ANNEAL_F32, 1, &N);
    anneal_tensor *lse = loss ? anneal_empty_on(logits->device, ANNEAL_F32, 1, &N) : NULL;
    anneal_tensor *out = lse ? anneal_empty_on(logits->device, ANNEAL_F32, 0, NULL) : NULL;
    int64_t span_t0 = anneal_span_begin();
    if (!out || anneal_ops_span_end("cross_entropy_fwd", &span_t0, 0, anneal_ops_span_bytes(loss), be->cross_entropy_fwd(be->ctx, loss, lse, lc, tc, ignore_index)) != ANNEAL_OK ||
        be->loss_mean(be->ctx, out, loss, tc, ignore_index, count) != ANNEAL_OK)
        return NULL;
    anneal_node *node = anneal_record(op, cross_entropy_backward, 1, &logits, 1, &out);
    if (node) {
        node->ints[0] = ignore_index;
        anneal_node_save(node, lc);
        anneal_node_save(node, tc);
        anneal_node_save(node, lse);
        anneal_node_save(node, count);
        if (node->n_saved != 4) return NULL;
    }
    return out;
}
