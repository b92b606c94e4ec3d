/* Attention ops: scaled dot-product attention on (B, H, T, D) tensors and GPT-2's
 * causal self-attention on a fused qkv (B, T, 3C) projection, with backward rules.
 * Both run the backend's flash-style kernels, which take strided (B, H, T, D) views
 * with a unit-stride last dim: heads are views into the projections, never copies,
 * and the output is written in (B, T, H, D) order so merging the heads is free. */
#include "ops_internal.h"

#include <math.h>
#include <string.h>

/* 1/sqrt(D) unless the caller gave a positive scale. */
static float default_scale(float scale, int64_t D) {
    if (scale > 0.0f) return scale;
    return D > 0 ? 1.0f / sqrtf((float)D) : 1.0f;
}

/* t as the kernel needs it: itself when its last dim has unit stride, else a
 * contiguous copy (no autograd). */
static anneal_tensor *unit_last(anneal_tensor *t) {
    if (!t) return NULL;
    if (t->strides[t->ndim - 1] == 1 || t->shape[t->ndim - 1] <= 1) return t;
    return anneal_ops_contiguous_raw(t);
}

/* True when t's elements fill a gap-free block with no overlap (a permutation of a
 * contiguous layout, e.g. the (B, T, H, D) storage seen as (B, H, T, D)). */
static bool dense_layout(const anneal_tensor *t) {
    int idx[ANNEAL_MAX_DIMS], n = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) return false;
        if (t->shape[i] > 1) idx[n++] = i;
    }
    /* Sort the non-trivial dims by stride, innermost first (insertion sort, n <= 8). */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && t->strides[idx[j]] < t->strides[idx[j - 1]]; j--) {
            int s = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = s;
        }
    int64_t expect = 1;
    for (int i = 0; i < n; i++) {
        if (t->strides[idx[i]] != expect) return false;
        expect *= t->shape[idx[i]];
    }
    return true;
}

/* A new uninitialised tensor with t's shape and t's strides (t must be dense_layout):
 * a buffer the kernel can address with t's strides. */
static anneal_tensor *new_with_strides(const anneal_tensor *t) {
    int64_t n = anneal_numel(t);
    anneal_scope_enter(NULL);
    anneal_tensor *base = anneal_empty_on(t->device, ANNEAL_F32, 1, &n);
    anneal_scope_leave();
    if (!base) return NULL;
    anneal_tensor *v = anneal_alias(base, t->ndim, t->shape, t->strides, 0);
    anneal_release(base); /* v keeps the storage */
    return v;
}

/* True when a and b address their elements alike (strides equal where size > 1). */
static bool same_strides(const anneal_tensor *a, const anneal_tensor *b) {
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] > 1 && a->strides[i] != b->strides[i]) return false;
    return true;
}

/* ---------------------------------------------------------------- attention */

/* Recomputes the probabilities tile by tile (attention_bwd). The kernel writes dq, dk,
 * dv with the strides of q, k, v, so each gets a buffer with its input's layout when
 * that layout is dense, else input and gradient are both made contiguous; dout is
 * given o's layout. Saved: q, k, v (unit last stride), o, lse; ints[0] = causal,
 * ints[1] = the forward's compute precision (the backward runs at it, whatever the
 * thread's matmul precision is now, so it differentiates the forward that ran). */
static anneal_status attention_backward(anneal_node *node, anneal_tensor *const *gout,
                                        anneal_tensor **gin) {
    anneal_tensor *o = node->saved[3], *lse = node->saved[4];
    const anneal_backend *be = anneal_backend_get(o->device);
    if (!be) return anneal_last_status();
    anneal_tensor *dout = gout[0];
    if (!same_strides(o, dout)) {
        anneal_tensor *d = new_with_strides(o);
        if (!d || be->copy(d, dout) != ANNEAL_OK) return anneal_last_status();
        dout = d;
    }
    anneal_tensor *x[3], *g[3];
    for (int i = 0; i < 3; i++) {
        anneal_tensor *s = node->saved[i];
        x[i] = dense_layout(s) ? s : anneal_ops_contiguous_raw(s);
        g[i] = x[i] ? new_with_strides(x[i]) : NULL;
        if (!g[i]) return anneal_last_status();
    }
    anneal_status s = be->attention_bwd(g[0], g[1], g[2], x[0], x[1], x[2], o, dout, lse,
                                        node->ints[0] != 0, (float)node->scalars[0],
                                        (anneal_dtype)node->ints[1]);
    if (s != ANNEAL_OK) return s;
    for (int i = 0; i < 3; i++)
        if (anneal_node_input_needs_grad(node, i)) gin[i] = g[i];
    return ANNEAL_OK;
}

anneal_tensor *anneal_attention(anneal_tensor *q, anneal_tensor *k, anneal_tensor *v, bool causal,
                                float scale) {
    anneal_tensor *in[3] = {q, k, v};
    const anneal_backend *be = anneal_ops_backend("attention", 3, in);
    if (!be) return NULL;
    if (!anneal_ops_require_f32("attention", "q", q) || !anneal_ops_require_f32("attention", "k", k) ||
        !anneal_ops_require_f32("attention", "v", v))
        return NULL;
    char sq[128], sk[128], sv[128];
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "attention: q, k, v must be 4-D (B, H, T, D), got q %s, k %s, v %s",
                         anneal_shape_str(q, sq, sizeof sq), anneal_shape_str(k, sk, sizeof sk),
                         anneal_shape_str(v, sv, sizeof sv));
        return NULL;
    }
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], D = q->shape[3];
    if (k->shape[0] != B || k->shape[1] != H || k->shape[3] != D || !anneal_same_shape(k, v)) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "attention: k %s and v %s must both be (B, H, Tk, D) = "
                         "(%lld, %lld, Tk, %lld) to match q %s",
                         anneal_shape_str(k, sk, sizeof sk), anneal_shape_str(v, sv, sizeof sv),
                         (long long)B, (long long)H, (long long)D, anneal_shape_str(q, sq, sizeof sq));
        return NULL;
    }
    scale = default_scale(scale, D);
    /* o lives in (B, Tq, H, D) storage and is returned as its (B, H, Tq, D) view. */
    anneal_scope_enter(NULL);
    anneal_tensor *ob = anneal_empty_on(q->device, ANNEAL_F32, 4, (int64_t[]){B, Tq, H, D});
    anneal_scope_leave();
    if (!ob) return NULL;
    anneal_tensor *out = anneal_alias(ob, 4, (int64_t[]){B, H, Tq, D},
                                      (int64_t[]){Tq * H * D, D, H * D, 1}, 0);
    anneal_release(ob);
    anneal_scope *tmp = out ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* lse and copies die with tmp unless saved */
    anneal_tensor *qc = unit_last(q), *kc = unit_last(k), *vc = unit_last(v);
    anneal_tensor *lse = anneal_empty_on(q->device, ANNEAL_F32, 3, (int64_t[]){B, H, Tq});
    /* The thread's matmul precision: bf16 rounds the tile products' operands. */
    const anneal_dtype compute = anneal_get_matmul_dtype();
    anneal_status s = (qc && kc && vc && lse)
                          ? be->attention_fwd(out, lse, qc, kc, vc, causal, scale, compute)
                          : anneal_last_status();
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record("attention", attention_backward, 3, in, 1, &out);
        if (node) {
            node->ints[0] = causal;
            node->ints[1] = compute;
            node->scalars[0] = scale;
            anneal_node_save(node, qc);
            anneal_node_save(node, kc);
            anneal_node_save(node, vc);
            anneal_node_save(node, out);
            anneal_node_save(node, lse);
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}

/* ------------------------------------------------------- causal_attention */

/* Heads of columns [col, col + H*D) of a contiguous (B, T, W) buffer as a (B, H, T, D)
 * view: strides (T*W, D, W, 1). */
static anneal_tensor *heads(const anneal_tensor *t, int64_t H, int64_t D, int64_t col) {
    int64_t B = t->shape[0], T = t->shape[1], W = t->shape[2];
    return anneal_alias(t, 4, (int64_t[]){B, H, T, D}, (int64_t[]){T * W, D, W, 1}, t->offset + col);
}

/* The gradient of qkv in one fresh (B, T, 3C) buffer: dq, dk, dv are its three head
 * views and tile it, so the kernel (which overwrites them) leaves nothing unwritten.
 * Saved: qkv (contiguous), o (B, T, C), lse; ints[0] = n_head, ints[1] = the forward's
 * compute precision (the backward runs at it, as in attention_backward). */
static anneal_status causal_attention_backward(anneal_node *node, anneal_tensor *const *gout,
                                               anneal_tensor **gin) {
    anneal_tensor *qkv = node->saved[0], *o = node->saved[1], *lse = node->saved[2];
    const anneal_backend *be = anneal_backend_get(qkv->device);
    anneal_tensor *dout = be ? anneal_ops_contiguous_raw(gout[0]) : NULL;
    anneal_tensor *dqkv = dout ? anneal_ops_new_like(qkv) : NULL;
    if (!dqkv) return anneal_last_status();
    int64_t H = node->ints[0], C = o->shape[2], D = C / H;
    anneal_tensor *q = heads(qkv, H, D, 0), *k = heads(qkv, H, D, C), *v = heads(qkv, H, D, 2 * C);
    anneal_tensor *dq = heads(dqkv, H, D, 0), *dk = heads(dqkv, H, D, C);
    anneal_tensor *dv = heads(dqkv, H, D, 2 * C);
    anneal_tensor *o4 = heads(o, H, D, 0), *do4 = heads(dout, H, D, 0);
    if (!q || !k || !v || !dq || !dk || !dv || !o4 || !do4) return anneal_last_status();
    anneal_status s = be->attention_bwd(dq, dk, dv, q, k, v, o4, do4, lse, true,
                                        (float)node->scalars[0], (anneal_dtype)node->ints[1]);
    if (s == ANNEAL_OK) gin[0] = dqkv;
    return s;
}

anneal_tensor *anneal_causal_attention(anneal_tensor *qkv, int n_head) {
    const anneal_backend *be = anneal_ops_backend("causal_attention", 1, &qkv);
    if (!be || !anneal_ops_require_f32("causal_attention", "qkv", qkv)) return NULL;
    char sq[128];
    if (qkv->ndim != 3) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "causal_attention: qkv must be 3-D (B, T, 3C), got %s",
                         anneal_shape_str(qkv, sq, sizeof sq));
        return NULL;
    }
    if (n_head <= 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "causal_attention: n_head must be positive, got %d", n_head);
        return NULL;
    }
    int64_t B = qkv->shape[0], T = qkv->shape[1], C3 = qkv->shape[2];
    if (C3 % 3 != 0) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "causal_attention: last dim of qkv %s is %lld, not a multiple of 3",
                         anneal_shape_str(qkv, sq, sizeof sq), (long long)C3);
        return NULL;
    }
    int64_t C = C3 / 3;
    if (C % n_head != 0) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "causal_attention: C = %lld (qkv %s) is not divisible by n_head = %d",
                         (long long)C, anneal_shape_str(qkv, sq, sizeof sq), n_head);
        return NULL;
    }
    int64_t H = n_head, D = C / H;
    float scale = default_scale(0.0f, D);
    anneal_tensor *out = anneal_empty_on(qkv->device, ANNEAL_F32, 3, (int64_t[]){B, T, C});
    anneal_scope *tmp = out ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* views, lse and copies die with tmp unless saved */
    anneal_tensor *qc = anneal_ops_contiguous_raw(qkv);
    anneal_tensor *lse = qc ? anneal_empty_on(qkv->device, ANNEAL_F32, 3, (int64_t[]){B, H, T}) : NULL;
    anneal_tensor *q = lse ? heads(qc, H, D, 0) : NULL, *k = q ? heads(qc, H, D, C) : NULL;
    anneal_tensor *v = k ? heads(qc, H, D, 2 * C) : NULL, *o4 = v ? heads(out, H, D, 0) : NULL;
    const anneal_dtype compute = anneal_get_matmul_dtype(); /* bf16: rounded tile operands */
    anneal_status s =
        o4 ? be->attention_fwd(o4, lse, q, k, v, true, scale, compute) : anneal_last_status();
    if (s == ANNEAL_OK) {
        anneal_node *node =
            anneal_record("causal_attention", causal_attention_backward, 1, &qkv, 1, &out);
        if (node) {
            node->ints[0] = H;
            node->ints[1] = compute;
            node->scalars[0] = scale;
            anneal_node_save(node, qc);
            anneal_node_save(node, out);
            anneal_node_save(node, lse);
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}
