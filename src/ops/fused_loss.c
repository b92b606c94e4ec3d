/* lm head + cross-entropy without the (N, V) logits: anneal_linear_cross_entropy(h, w,
 * targets) = cross_entropy(h @ w^T, targets). The backend walks the rows in chunks
 * through a (rows, V) workspace; when a gradient is wanted the forward already turns
 * each chunk's softmax - onehot (scaled by 1/n_valid; 2^15 at f16, see the note on f16
 * below) into dh and dw, and the backward only multiplies them by the upstream
 * gradient (scale_by, on the device). The targets are checked and counted, and the
 * mean is taken in double in row order, on the device as anneal_cross_entropy does. */
#include "ops_internal.h"

/* Rows per chunk. Every chunk re-reads w for its logits and dh GEMMs and re-reads and
 * re-writes dw (V*C each), a fixed cost per chunk (measured on d6's lm head, N = 2048,
 * V = 50257, C = 384, f32: +37% at 128 rows, +16% at 256, +9% at 512, none at 1024),
 * so chunks are as large as the memory goal allows: at most a quarter of the rows (the
 * workspace is at most 1/4 of the full logits), at most 128 MiB of workspace and 1024
 * rows, at least 32 rows; the rows are then split evenly (multiples of 16). A backend
 * that gives a workspace hint (version 3: workspace_bytes > 0, a GPU, where small
 * chunks mean small, slow GEMMs) gets chunks of up to hint bytes of workspace, any
 * number of rows up to N (at least 32), split evenly the same way. */
static int64_t chunk_rows(int64_t N, int64_t V, int64_t hint_bytes) {
    int64_t cap = N / 4;
    int64_t by_bytes = ((int64_t)128 << 20) / (V * (int64_t)sizeof(float));
    if (by_bytes < cap) cap = by_bytes;
    if (cap > 1024) cap = 1024;
    if (hint_bytes > 0) cap = hint_bytes / (V * (int64_t)sizeof(float));
    if (cap < 32) cap = 32;
    if (cap >= N) return N > 0 ? N : 1;
    int64_t chunks = (N + cap - 1) / cap, r = (N + chunks - 1) / chunks;
    r = (r + 15) / 16 * 16;
    return r < cap ? r : cap;
}

/* The dlogits handed to the dh/dw GEMMs are scaled (by the backend, from the kept-row
 * count on the device). f32 and bf16 share f32's exponent range: 1/n_valid, as
 * anneal_cross_entropy's dlogits (so results match it when the upstream gradient is
 * 1). f16 underflows below 6e-8 (subnormal below 6e-5): with 1/n_valid a probability of
 * 1e-4 over 2048 rows would be 5e-8 and lost, and a loss scaler's factor arrives only
 * in backward, too late. So f16 uses 2^15: |dlogits| <= 32768 stays below f16's max
 * (65504) and small probabilities stay representable; the GEMMs accumulate in f32, and
 * backward divides the power of two (and n_valid) out exactly: its factor is
 * 2^-15 / n_valid, the correctly rounded 1 / (n_valid * 2^15). */
#define F16_FACTOR (1.0 / 32768.0)

/* Saved: dh (h's shape) and dw (V, C) computed at the backend's scale (either may be
 * absent: ints[0], ints[1] give their saved index or -1), the kept-row count (ints[2]:
 * its saved index); ints[3]: compute. Each is multiplied in place by the upstream
 * gradient (at f16 also by 2^-15 / count) on the device. */
static anneal_status linear_ce_backward(anneal_node *node, anneal_tensor *const *gout,
                                        anneal_tensor **gin) {
    bool f16 = node->ints[3] == ANNEAL_F16;
    anneal_tensor *count = f16 ? node->saved[node->ints[2]] : NULL;
    for (int i = 0; i < 2; i++) {
        if (node->ints[i] < 0 || !anneal_node_input_needs_grad(node, i)) continue;
        anneal_tensor *g = node->saved[node->ints[i]];
        const anneal_backend *be = anneal_backend_get(g->device);
        if (!be) return anneal_last_status();
        /* The saved gradient belongs to this node alone and backward runs once: scale in place. */
        if (be->scale_by(be->ctx, g, gout[0], count, f16 ? F16_FACTOR : 1.0) != ANNEAL_OK)
            return anneal_last_status();
        gin[i] = g;
    }
    return ANNEAL_OK;
}

anneal_tensor *anneal_linear_cross_entropy_ex(anneal_tensor *h, anneal_tensor *w, anneal_tensor *targets,
                                              int32_t ignore_index, anneal_dtype compute) {
    const char *op = "linear_cross_entropy";
    anneal_tensor *in[3] = {h, w, targets};
    const anneal_backend *be = anneal_ops_backend(op, 3, in);
    if (!be || !anneal_ops_require_f32(op, "h", h) || !anneal_ops_require_f32(op, "weight", w) ||
        !anneal_ops_require_i32(op, "targets", targets) || !anneal_ops_check_compute(op, compute))
        return NULL;
    char b1[128], b2[128];
    if (w->ndim != 2 || h->ndim < 1 || h->shape[h->ndim - 1] != w->shape[1] || w->shape[0] == 0) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "%s: h %s and weight %s: weight must be (V, C) with V > 0 and C the last dim of h",
                         op, anneal_shape_str(h, b1, sizeof b1), anneal_shape_str(w, b2, sizeof b2));
        return NULL;
    }
    bool shape_ok = targets->ndim == h->ndim - 1;
    for (int i = 0; shape_ok && i < targets->ndim; i++) shape_ok = targets->shape[i] == h->shape[i];
    if (!shape_ok) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "%s: h %s and targets %s: targets must have h's shape without its last dim",
                         op, anneal_shape_str(h, b1, sizeof b1), anneal_shape_str(targets, b2, sizeof b2));
        return NULL;
    }
    int64_t V = w->shape[0], C = w->shape[1], N = anneal_numel(targets);
    if (!anneal_ops_kernel(op, be, ANNEAL_OP_LINEAR_CROSS_ENTROPY, ANNEAL_F32) ||
        !anneal_ops_kernel(op, be, ANNEAL_OP_LOSS_MEAN, ANNEAL_F32) ||
        !anneal_ops_kernel(op, be, ANNEAL_OP_SCALE_BY, ANNEAL_F32))
        return NULL;
    anneal_tensor *tc = anneal_ops_contiguous_raw(targets);
    anneal_tensor *hc = tc ? anneal_ops_contiguous_raw(h) : NULL;
    anneal_tensor *wc = hc ? anneal_ops_contiguous_raw(w) : NULL;
    if (!wc) return NULL;

    bool grad = anneal_grad_enabled();
    bool want_h = grad && h->requires_grad, want_w = grad && w->requires_grad;
    anneal_tensor *out = anneal_empty_on(h->device, ANNEAL_F32, 0, NULL);
    anneal_scope *tmp = out ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* workspace, count and unsaved results die with tmp */
    /* Targets in [0, V) or ignored; the kept rows counted on the device. */
    anneal_tensor *count = NULL;
    anneal_status s = anneal_ops_check_index(op, "target", be, tc, V, true, ignore_index, &count);
    if (s != ANNEAL_OK) {
        anneal_scope_leave();
        anneal_scope_free(tmp);
        return NULL;
    }
    int64_t CH = chunk_rows(N, V, be->version >= 3 ? be->workspace_bytes : 0);
    anneal_tensor *loss = anneal_empty_on(h->device, ANNEAL_F32, 1, &N);
    anneal_tensor *lse = anneal_empty_on(h->device, ANNEAL_F32, 1, &N);
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_WORKSPACE); /* the chunk's logits */
    anneal_tensor *work = anneal_empty_on(h->device, ANNEAL_F32, 2, (int64_t[]){CH, V});
    anneal_memory_category_set(mc);
    anneal_tensor *dh = want_h ? anneal_ops_new_like(hc) : NULL;
    anneal_tensor *dw = want_w ? anneal_empty_on(h->device, ANNEAL_F32, 2, (int64_t[]){V, C}) : NULL;
    anneal_tensor *h2 = anneal_alias(hc, 2, (int64_t[]){N, C}, (int64_t[]){C, 1}, hc->offset);
    anneal_tensor *dh2 = dh ? anneal_alias(dh, 2, (int64_t[]){N, C}, (int64_t[]){C, 1}, 0) : NULL;
    if (!(loss && lse && work && h2 && (dh2 || !want_h) && (dw || !want_w))) s = anneal_last_status();
    int64_t span_t0 = anneal_span_begin(); /* the logits GEMM and, fused, those of dh and dw */
    double span_flops = span_t0 ? 2.0 * (double)N * (double)V * (double)C * (1.0 + (dh2 != NULL) + (dw != NULL)) : 0;
    if (s == ANNEAL_OK)
        s = anneal_ops_span_end("linear_cross_entropy", &span_t0, span_flops, 0, be->linear_cross_entropy(be->ctx, loss, lse, dh2, dw, work, h2, wc, tc, ignore_index, count, compute));
    if (s == ANNEAL_OK) s = be->loss_mean(be->ctx, out, loss, tc, ignore_index, count);
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record(op, linear_ce_backward, 2, in, 1, &out);
        if (node) {
            node->ints[0] = dh ? anneal_node_save(node, dh) : -1;
            node->ints[1] = dw ? anneal_node_save(node, dw) : -1;
            node->ints[2] = anneal_node_save(node, count);
            node->ints[3] = compute;
            if (node->n_saved != (dh != NULL) + (dw != NULL) + 1) s = anneal_last_status();
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}

anneal_tensor *anneal_linear_cross_entropy(anneal_tensor *h, anneal_tensor *w, anneal_tensor *targets,
                                           int32_t ignore_index) {
    return anneal_linear_cross_entropy_ex(h, w, targets, ignore_index, ANNEAL_F32);
}
