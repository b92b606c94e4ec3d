/* Mean cross-entropy with a fused log-softmax: logits (..., V) against i32 targets
 * (...), skipping targets equal to ignore_index. The kernel gives per-row losses and
 * logsumexps; the mean over kept rows is taken here in double, in row order, so the
 * loss does not depend on the thread count. */
#include "ops_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* dlogits = (dloss / count) * (softmax - onehot) on kept rows, 0 on ignored ones;
 * saved: logits (contiguous), targets (contiguous), lse (N); ints: count, ignore_index. */
static anneal_status cross_entropy_backward(anneal_node *node, anneal_tensor *const *gout,
                                            anneal_tensor **gin) {
    anneal_tensor *logits = node->saved[0], *targets = node->saved[1], *lse = node->saved[2];
    int64_t count = node->ints[0];
    int32_t ignore_index = (int32_t)node->ints[1];
    const anneal_backend *be = anneal_backend_get(logits->device);
    double dloss = anneal_item(gout[0]);
    anneal_tensor *dlogits = anneal_ops_new_like(logits);
    if (!be || !dlogits || anneal_last_status() != ANNEAL_OK) return anneal_last_status();
    float scale = count ? (float)(dloss / (double)count) : 0.0f;
    gin[0] = dlogits;
    return be->cross_entropy_bwd(dlogits, logits, targets, lse, ignore_index, scale);
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
    anneal_tensor *tc = anneal_ops_contiguous_raw(targets);
    anneal_tensor *lc = tc ? anneal_ops_contiguous_raw(logits) : NULL;
    if (!lc) return NULL;

    /* Validate the targets on the host and count the kept rows. */
    void *owned_t;
    int64_t count;
    const int32_t *t = anneal_ops_check_targets("cross_entropy", be, tc, V, ignore_index, &count, &owned_t);
    if (!t) return NULL;

    anneal_tensor *loss = anneal_empty_on(logits->device, ANNEAL_F32, 1, &N);
    anneal_tensor *lse = loss ? anneal_empty_on(logits->device, ANNEAL_F32, 1, &N) : NULL;
    if (!lse || be->cross_entropy_fwd(loss, lse, lc, tc, ignore_index) != ANNEAL_OK) {
        free(owned_t);
        return NULL;
    }
    /* Mean over kept rows, in double and in row order (0 when every row is ignored). */
    void *owned_l;
    const float *l = anneal_ops_host_view(be, loss, sizeof(float), &owned_l);
    if (!l) {
        free(owned_t);
        return NULL;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < N; i++)
        if (t[i] != ignore_index) sum += (double)l[i];
    free(owned_l);
    free(owned_t);
    double mean = count ? sum / (double)count : 0.0;

    anneal_tensor *out = anneal_empty_on(logits->device, ANNEAL_F32, 0, NULL);
    if (!out || be->fill(out, mean) != ANNEAL_OK) return NULL;
    anneal_node *node = anneal_record(op, cross_entropy_backward, 1, &logits, 1, &out);
    if (node) {
        node->ints[0] = count;
        node->ints[1] = ignore_index;
        anneal_node_save(node, lc);
        anneal_node_save(node, tc);
        anneal_node_save(node, lse);
        if (node->n_saved != 3) return NULL;
    }
    return out;
}
