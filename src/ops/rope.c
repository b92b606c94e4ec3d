/* Rotary position embedding (RoPE) as an op, and the helpers attention uses to rotate
 * q and k before its kernel. The rotation runs on the backend's rope slot, in place on
 * a fresh buffer (an op never modifies its input); its backward is the rotation by the
 * negative angle (the rotation is orthogonal), applied in place to the gradient. */
#include "ops_internal.h"

#include <math.h>

bool anneal_ops_rope_check(const char *op, const anneal_rope_desc *r, int64_t D) {
    const char *bad = NULL;
    if (!(r->theta > 0.0f) || !isfinite(r->theta)) bad = "theta must be a positive finite base";
    else if ((unsigned)r->scaling > ANNEAL_ROPE_SCALING_LLAMA3) bad = "unknown scaling";
    else if (r->scaling != ANNEAL_ROPE_SCALING_NONE && !(r->factor > 0.0f)) bad = "scaling factor must be positive";
    else if (r->scaling == ANNEAL_ROPE_SCALING_LLAMA3 &&
             (!(r->low_freq_factor > 0.0f) || !(r->high_freq_factor > r->low_freq_factor) || r->original_max_pos <= 0))
        bad = "llama3 scaling needs 0 < low_freq_factor < high_freq_factor and original_max_pos > 0";
    if (bad) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: rope: %s", op, bad);
        return false;
    }
    if (D % 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: rope needs an even head size, got D = %lld", op, (long long)D);
        return false;
    }
    return true;
}

void anneal_ops_rope_save(anneal_node *node, int s0, int i0, const anneal_rope_desc *r) {
    node->scalars[s0] = r->theta;
    node->scalars[s0 + 1] = r->factor;
    node->scalars[s0 + 2] = r->low_freq_factor;
    node->scalars[s0 + 3] = r->high_freq_factor;
    node->ints[i0] = r->scaling;
    node->ints[i0 + 1] = r->original_max_pos;
}

anneal_rope_desc anneal_ops_rope_load(const anneal_node *node, int s0, int i0) {
    return (anneal_rope_desc){.theta = (float)node->scalars[s0], .factor = (float)node->scalars[s0 + 1],
                              .low_freq_factor = (float)node->scalars[s0 + 2],
                              .high_freq_factor = (float)node->scalars[s0 + 3],
                              .scaling = (anneal_rope_scaling)node->ints[i0], .original_max_pos = node->ints[i0 + 1]};
}

anneal_status anneal_ops_rope_apply(const char *op, const anneal_backend *be, anneal_tensor *x,
                                    const anneal_rope_desc *r, int64_t pos0, bool inverse) {
    anneal_op_query q = {.kind = ANNEAL_OP_ROPE, .dtype = x->dtype, .rope = r};
    if (!anneal_ops_supported(op, be, &q)) return anneal_last_status();
    int64_t span_t0 = anneal_span_begin();
    return anneal_ops_span_end("rope", &span_t0, 0, anneal_ops_span_bytes(x), be->rope(be->ctx, r, x, pos0, inverse));
}

/* A fresh copy of x (4-D) with x's shape, contiguous, rotated: position of row t is pos0 + t. */
anneal_tensor *anneal_ops_rope_copy(const char *op, const anneal_backend *be, const anneal_tensor *x,
                                    const anneal_rope_desc *r, int64_t pos0) {
    anneal_tensor *y = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, x->shape);
    if (!y || be->copy(be->ctx, y, x) != ANNEAL_OK || anneal_ops_rope_apply(op, be, y, r, pos0, false) != ANNEAL_OK)
        return NULL;
    return y;
}

/* dx = the inverse rotation of dy (a fresh contiguous buffer). Saved: nothing;
 * scalars[0..3], ints[0..1]: the rope desc; ints[2]: pos0. */
static anneal_status rope_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin) {
    anneal_rope_desc r = anneal_ops_rope_load(node, 0, 0);
    anneal_tensor *dy = gout[0];
    const anneal_backend *be = anneal_backend_get(dy->device);
    anneal_tensor *dx = be ? anneal_empty_on(dy->device, ANNEAL_F32, dy->ndim, dy->shape) : NULL;
    if (!dx || be->copy(be->ctx, dx, dy) != ANNEAL_OK ||
        anneal_ops_rope_apply("rope", be, dx, &r, node->ints[2], true) != ANNEAL_OK)
        return anneal_last_status();
    gin[0] = dx;
    return ANNEAL_OK;
}

anneal_tensor *anneal_rope(anneal_tensor *x, const anneal_rope_desc *rope, int64_t pos0) {
    const char *op = "rope";
    const anneal_backend *be = anneal_ops_backend(op, 1, &x);
    if (!be || !anneal_ops_require_f32(op, "x", x)) return NULL;
    char sx[128];
    if (!rope) {
        anneal_set_error(ANNEAL_ERR_ARG, "rope: NULL rope description");
        return NULL;
    }
    if (x->ndim != 4) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "rope: x must be 4-D (B, H, T, D), got %s", anneal_shape_str(x, sx, sizeof sx));
        return NULL;
    }
    if (pos0 < 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "rope: first position %lld is negative", (long long)pos0);
        return NULL;
    }
    if (!anneal_ops_rope_check(op, rope, x->shape[3])) return NULL;
    anneal_tensor *y = anneal_ops_rope_copy(op, be, x, rope, pos0);
    if (!y) return NULL;
    anneal_node *node = anneal_record(op, rope_backward, 1, &x, 1, &y);
    if (node) {
        anneal_ops_rope_save(node, 0, 0, rope);
        node->ints[2] = pos0;
    }
    return y;
}
