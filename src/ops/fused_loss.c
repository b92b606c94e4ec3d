/* lm head + cross-entropy without the (N, V) logits: anneal_linear_cross_entropy(h, w,
 * targets) = cross_entropy(h @ w^T, targets). The backend walks the rows in chunks
 * through a (rows, V) workspace; when a gradient is wanted the forward already turns
 * each chunk's softmax - onehot (scaled by 1/n_valid; 2^15 at f16, see gemm_scale)
 * into dh and dw, and the backward only multiplies them by the upstream gradient. The mean is taken here in double in
 * row order, as anneal_cross_entropy does. */
#include "ops_internal.h"

#include <stdlib.h>

/* Rows per chunk. Every chunk re-reads w for its logits and dh GEMMs and re-reads and
 * re-writes dw (V*C each), a fixed cost per chunk (measured on d6's lm head, N = 2048,
 * V = 50257, C = 384, f32: +37% at 128 rows, +16% at 256, +9% at 512, none at 1024),
 * so chunks are as large as the memory goal allows: at most a quarter of the rows (the
 * workspace is at most 1/4 of the full logits), at most 128 MiB of workspace and 1024
 * rows, at least 32 rows; the rows are then split evenly (multiples of 16). */
static int64_t chunk_rows(int64_t N, int64_t V) {
    int64_t cap = N / 4;
    int64_t by_bytes = ((int64_t)128 << 20) / (V * (int64_t)sizeof(float));
    if (by_bytes < cap) cap = by_bytes;
    if (cap > 1024) cap = 1024;
    if (cap < 32) cap = 32;
    if (cap >= N) return N > 0 ? N : 1;
    int64_t chunks = (N + cap - 1) / cap, r = (N + chunks - 1) / chunks;
    r = (r + 15) / 16 * 16;
    return r < cap ? r : cap;
}

/* Scale of the dlogits handed to the dh/dw GEMMs. f32 and bf16 share f32's exponent
 * range: 1/n_valid, as anneal_cross_entropy's dlogits (so results match it when the
 * upstream gradient is 1). f16 underflows below 6e-8 (subnormal below 6e-5): with
 * 1/n_valid a probability of 1e-4 over 2048 rows would be 5e-8 and lost, and a loss
 * scaler's factor arrives only in backward, too late. So f16 uses 2^15: |dlogits| <=
 * 32768 stays below f16's max (65504) and small probabilities stay representable; the
 * GEMMs accumulate in f32, and backward divides the power of two out exactly. */
static float gemm_scale(anneal_dtype compute, int64_t count) {
    if (!count) return 0.0f;
    return compute == ANNEAL_F16 ? 32768.0f : (float)(1.0 / (double)count);
}

/* Saved: dh (h's shape) and dw (V, C) computed with gemm_scale (either may be absent:
 * ints[0], ints[1] give their saved index or -1); scalars[0]: the factor that turns
 * them into d(mean loss) (1, or 1/(n_valid * 2^15) for f16). */
static anneal_status linear_ce_backward(anneal_node *node, anneal_tensor *const *gout,
                                        anneal_tensor **gin) {
    double dloss = anneal_item(gout[0]) * node->scalars[0];
    if (anneal_last_status() != ANNEAL_OK) return anneal_last_status();
    for (int i = 0; i < 2; i++) {
        if (node->ints[i] < 0 || !anneal_node_input_needs_grad(node, i)) continue;
        anneal_tensor *g = node->saved[node->ints[i]];
        const anneal_backend *be = anneal_backend_get(g->device);
        if (!be) return anneal_last_status();
        /* The saved gradient belongs to this node alone and backward runs once: scale in place. */
        if (dloss != 1.0 && be->unary(ANNEAL_UNARY_SCALE, g, g, (float)dloss) != ANNEAL_OK)
            return anneal_last_status();
        gin[i] = g;
    }
    return ANNEAL_OK;
}

anneal_tensor *anneal_linear_cross_entropy(anneal_tensor *h, anneal_tensor *w,
                                           anneal_tensor *targets, int32_t ignore_index) {
    const char *op = "linear_cross_entropy";
    anneal_tensor *in[3] = {h, w, targets};
    const anneal_backend *be = anneal_ops_backend(op, 3, in);
    if (!be || !anneal_ops_require_f32(op, "h", h) || !anneal_ops_require_f32(op, "weight", w) ||
        !anneal_ops_require_i32(op, "targets", targets))
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
    anneal_tensor *tc = anneal_ops_contiguous_raw(targets);
    anneal_tensor *hc = tc ? anneal_ops_contiguous_raw(h) : NULL;
    anneal_tensor *wc = hc ? anneal_ops_contiguous_raw(w) : NULL;
    if (!wc) return NULL;

    /* Validate the targets on the host and count the kept rows. */
    void *owned_t;
    int64_t count;
    const int32_t *t = anneal_ops_check_targets(op, be, tc, V, ignore_index, &count, &owned_t);
    if (!t) return NULL;

    bool grad = anneal_grad_enabled();
    bool want_h = grad && h->requires_grad, want_w = grad && w->requires_grad;
    anneal_tensor *out = anneal_empty_on(h->device, ANNEAL_F32, 0, NULL);
    anneal_scope *tmp = out ? anneal_scope_new() : NULL;
    if (!tmp) {
        free(owned_t);
        return NULL;
    }
    anneal_scope_enter(tmp); /* workspace and unsaved results die with tmp */
    int64_t CH = chunk_rows(N, V);
    anneal_tensor *loss = anneal_empty_on(h->device, ANNEAL_F32, 1, &N);
    anneal_tensor *lse = anneal_empty_on(h->device, ANNEAL_F32, 1, &N);
    anneal_tensor *work = anneal_empty_on(h->device, ANNEAL_F32, 2, (int64_t[]){CH, V});
    anneal_tensor *dh = want_h ? anneal_ops_new_like(hc) : NULL;
    anneal_tensor *dw = want_w ? anneal_empty_on(h->device, ANNEAL_F32, 2, (int64_t[]){V, C}) : NULL;
    anneal_tensor *h2 = anneal_alias(hc, 2, (int64_t[]){N, C}, (int64_t[]){C, 1}, hc->offset);
    anneal_tensor *dh2 = dh ? anneal_alias(dh, 2, (int64_t[]){N, C}, (int64_t[]){C, 1}, 0) : NULL;
    anneal_dtype cd = anneal_get_matmul_dtype();
    float scale = gemm_scale(cd, count);
    double post = cd == ANNEAL_F16 && count ? 1.0 / ((double)count * 32768.0) : 1.0;
    anneal_status s = (loss && lse && work && h2 && (dh2 || !want_h) && (dw || !want_w))
                          ? ANNEAL_OK : anneal_last_status();
    if (s == ANNEAL_OK)
        s = be->linear_cross_entropy(loss, lse, dh2, dw, work, h2, wc, tc, ignore_index, scale, cd);
    double mean = 0.0;
    if (s == ANNEAL_OK) {
        void *owned_l;
        const float *l = anneal_ops_host_view(be, loss, sizeof(float), &owned_l);
        if (!l) {
            s = anneal_last_status();
        } else {
            double sum = 0.0;
            for (int64_t i = 0; i < N; i++)
                if (t[i] != ignore_index) sum += (double)l[i];
            free(owned_l);
            mean = count ? sum / (double)count : 0.0;
        }
    }
    free(owned_t);
    if (s == ANNEAL_OK) s = be->fill(out, mean);
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record(op, linear_ce_backward, 2, in, 1, &out);
        if (node) {
            node->scalars[0] = post;
            node->ints[0] = dh ? anneal_node_save(node, dh) : -1;
            node->ints[1] = dw ? anneal_node_save(node, dw) : -1;
            if (node->n_saved != (dh != NULL) + (dw != NULL)) s = anneal_last_status();
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}
