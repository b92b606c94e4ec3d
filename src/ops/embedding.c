/* Embedding lookup: rows of a weight table (V, C) picked by integer ids of any
 * shape, giving (..., C). Ids are checked by the backend (check_index) before the
 * kernel runs, so a bad token id is a clear error rather than an out-of-bounds read. */
#include "ops_internal.h"

/* dW (V, C) = scatter-add of dy rows by id; saved: ids (contiguous). Ids get nothing. */
static anneal_status embedding_backward(anneal_node *node, anneal_tensor *const *gout,
                                        anneal_tensor **gin) {
    anneal_tensor *ids = node->saved[0];
    const anneal_edge *e = &node->inputs[0];
    const anneal_backend *be = anneal_backend_get(ids->device);
    anneal_tensor *dy = anneal_ops_contiguous_raw(gout[0]);
    anneal_tensor *dw = dy ? anneal_empty_on(ids->device, ANNEAL_F32, e->ndim, e->shape) : NULL;
    if (!be || !dw) return anneal_last_status();
    gin[0] = dw;
    int64_t span_t0 = anneal_span_begin();
    return anneal_ops_span_end("embedding_bwd", &span_t0, 0, anneal_ops_span_bytes(dy), be->embedding_bwd(be->ctx, dw, ids, dy));
}

anneal_tensor *anneal_embedding(anneal_tensor *ids, anneal_tensor *weight) {
    const char *op = "embedding";
    anneal_tensor *in[2] = {ids, weight};
    const anneal_backend *be = anneal_ops_backend(op, 2, in);
    if (!be || !anneal_ops_require_i32(op, "ids", ids) || !anneal_ops_require_f32(op, "weight", weight))
        return NULL;
    char buf[128];
    if (weight->ndim != 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "embedding: weight has shape %s, expected (V, C)",
                         anneal_shape_str(weight, buf, sizeof buf));
        return NULL;
    }
    if (ids->ndim + 1 > ANNEAL_MAX_DIMS) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "embedding: ids has %d dims; the result would exceed %d",
                         ids->ndim, ANNEAL_MAX_DIMS);
        return NULL;
    }
    int64_t V = weight->shape[0], C = weight->shape[1];
    anneal_tensor *idc = anneal_ops_contiguous_raw(ids);
    if (!anneal_ops_kernel(op, be, ANNEAL_OP_EMBEDDING, ANNEAL_F32) || !idc ||
        anneal_ops_check_index(op, "id", be, idc, V, false, 0, NULL) != ANNEAL_OK)
        return NULL;
    anneal_tensor *wc = anneal_ops_contiguous_raw(weight);
    if (!wc) return NULL;
    int64_t shape[ANNEAL_MAX_DIMS];
    for (int i = 0; i < ids->ndim; i++) shape[i] = ids->shape[i];
    shape[ids->ndim] = C;
    anneal_tensor *y = anneal_empty_on(weight->device, ANNEAL_F32, ids->ndim + 1, shape);
    int64_t span_t0 = anneal_span_begin();
    if (!y || anneal_ops_span_end("embedding_fwd", &span_t0, 0, anneal_ops_span_bytes(y), be->embedding_fwd(be->ctx, y, idc, wc)) != ANNEAL_OK) return NULL;
    /* Only the weight is a differentiable input: integer ids never require grad. */
    anneal_node *node = anneal_record(op, embedding_backward, 1, &weight, 1, &y);
    if (node && anneal_node_save(node, idc) < 0) return NULL;
    return y;
}
