/* Attention ops: scaled dot-product attention on (B, H, T, D) tensors with separate
 * query and key/value head counts (grouped-query; multi-query when Hkv == 1) and an
 * optional rotary embedding, and self-attention from one packed qkv projection, with
 * backward rules. Both lay out an anneal_attention_desc (shapes, head counts, the
 * strides of every operand) for the backend's flash-style kernels, which take strided
 * views with a unit-stride last dim: heads are views into the projections, never
 * copies, and the output is written in (B, T, H, D) order so merging the heads is free.
 * The compute precision is an argument recorded on the node, so the backward runs at
 * the forward's. With RoPE, q and k are rotated into fresh buffers before the kernel
 * (the inputs are never modified) and the kernel's dq, dk are rotated back. */
#include "ops_internal.h"

#include <math.h>
#include <string.h>

/* 1/sqrt(D) unless the caller gave a positive scale. */
static float default_scale(float scale, int64_t D) {
    if (scale > 0.0f) return scale;
    return D > 0 ? 1.0f / sqrtf((float)D) : 1.0f;
}

/* The kernel's description of q (B, Hq, Tq, D), k, v (B, Hkv, Tk, D), o (B, Hq, Tq, D):
 * shapes and each operand's batch/head/time strides (dq, dk, dv, dout share them). */
static anneal_attention_desc layout(const anneal_tensor *q, const anneal_tensor *k, const anneal_tensor *v,
                                    const anneal_tensor *o, bool causal, float scale, anneal_dtype compute) {
    return (anneal_attention_desc){
        .B = q->shape[0], .Hq = q->shape[1], .Hkv = k->shape[1], .Tq = q->shape[2], .Tk = k->shape[2],
        .D = q->shape[3],
        .q_sb = q->strides[0], .q_sh = q->strides[1], .q_st = q->strides[2],
        .k_sb = k->strides[0], .k_sh = k->strides[1], .k_st = k->strides[2],
        .v_sb = v->strides[0], .v_sh = v->strides[1], .v_st = v->strides[2],
        .o_sb = o->strides[0], .o_sh = o->strides[1], .o_st = o->strides[2],
        .scale = scale, .causal = causal, .compute = compute};
}

/* True when the backend runs attention with this layout (and its rotary embedding);
 * ANNEAL_ERR_UNSUPPORTED naming op otherwise. */
static bool supported(const char *op, const anneal_backend *be, const anneal_attention_desc *d,
                      const anneal_rope_desc *rope) {
    anneal_op_query q = {.kind = ANNEAL_OP_ATTENTION, .dtype = ANNEAL_F32, .attention = d, .rope = rope};
    if (!anneal_ops_supported(op, be, &q)) return false;
    anneal_op_query r = {.kind = ANNEAL_OP_ROPE, .dtype = ANNEAL_F32, .rope = rope};
    return !rope || anneal_ops_supported(op, be, &r);
}

/* t as the kernel needs it: itself when its last dim has unit stride, else a
 * contiguous copy (no autograd). */
static anneal_tensor *unit_last(anneal_tensor *t) {
    if (!t) return NULL;
    if (t->strides[t->ndim - 1] == 1 || t->shape[t->ndim - 1] <= 1) return t;
    return anneal_ops_contiguous_raw(t);
}

/* True when a and b address their elements alike (strides equal where size > 1). */
static bool same_strides(const anneal_tensor *a, const anneal_tensor *b) {
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] > 1 && a->strides[i] != b->strides[i]) return false;
    return true;
}

/* The node's attention settings: ints[0] causal, ints[1] compute, ints[2] rope on,
 * ints[3] rope_pos0, ints[4..5] and scalars[1..4] the rope desc; scalars[0] scale. */
static void save_settings(anneal_node *node, bool causal, anneal_dtype compute, float scale,
                          const anneal_rope_desc *rope, int64_t pos0) {
    node->ints[0] = causal;
    node->ints[1] = compute;
    node->ints[2] = rope != NULL;
    node->ints[3] = pos0;
    node->scalars[0] = scale;
    if (rope) anneal_ops_rope_save(node, 1, 4, rope);
}

/* ---------------------------------------------------------------- attention */

/* Recomputes the probabilities tile by tile (attention_bwd). The kernel writes dq, dk,
 * dv with the strides of q, k, v, so each gets a buffer with its input's layout when
 * that layout is dense, else input and gradient are both made contiguous; dout is
 * given o's layout. With RoPE the saved q and k are the rotated ones and dq, dk are
 * rotated back (queries at rope_pos0 + Tk - Tq + i, keys at rope_pos0 + j). Saved: q, k,
 * v (unit last stride; at bf16 on the CPU their bf16 roundings, saved_bf16.c), o, lse;
 * settings as save_settings. */
static anneal_status attention_backward(anneal_node *node, anneal_tensor *const *gout,
                                        anneal_tensor **gin) {
    anneal_tensor *o = node->saved[3], *lse = node->saved[4];
    const anneal_backend *be = anneal_backend_get(o->device);
    if (!be) return anneal_last_status();
    anneal_tensor *dout = gout[0];
    if (!same_strides(o, dout)) {
        anneal_tensor *d = anneal_ops_empty_with_strides(o, ANNEAL_F32);
        if (!d || be->copy(be->ctx, d, dout) != ANNEAL_OK) return anneal_last_status();
        dout = d;
    }
    anneal_tensor *x[3], *g[3];
    for (int i = 0; i < 3; i++) {
        anneal_tensor *s = anneal_ops_saved_f32(be, node->saved[i]); /* bf16-saved: widened, exact */
        if (!s) return anneal_last_status();
        x[i] = anneal_ops_dense_layout(s) ? s : anneal_ops_contiguous_raw(s);
        g[i] = x[i] ? anneal_ops_empty_with_strides(x[i], ANNEAL_F32) : NULL;
        if (!g[i]) return anneal_last_status();
    }
    anneal_attention_desc d = layout(x[0], x[1], x[2], o, node->ints[0] != 0, (float)node->scalars[0],
                                     (anneal_dtype)node->ints[1]);
    int64_t span_t0 = anneal_span_begin();
    anneal_status s = anneal_ops_span_end("attention_bwd", &span_t0, anneal_ops_attention_flops(d, true), 0, be->attention_bwd(be->ctx, &d, g[0], g[1], g[2], x[0], x[1], x[2], o, dout, lse));
    if (s == ANNEAL_OK && node->ints[2]) {
        anneal_rope_desc r = anneal_ops_rope_load(node, 1, 4);
        int64_t pos0 = node->ints[3];
        s = anneal_ops_rope_apply("attention", be, g[0], &r, pos0 + d.Tk - d.Tq, true);
        if (s == ANNEAL_OK) s = anneal_ops_rope_apply("attention", be, g[1], &r, pos0, true);
    }
    if (s != ANNEAL_OK) return s;
    for (int i = 0; i < 3; i++)
        if (anneal_node_input_needs_grad(node, i)) gin[i] = g[i];
    return ANNEAL_OK;
}

anneal_tensor *anneal_attention_ex(anneal_tensor *q, anneal_tensor *k, anneal_tensor *v,
                                   const anneal_attention_opts *opts) {
    const char *op = "attention";
    anneal_attention_opts o = opts ? *opts : (anneal_attention_opts){0};
    anneal_tensor *in[3] = {q, k, v};
    const anneal_backend *be = anneal_ops_backend(op, 3, in);
    if (!be) return NULL;
    if (!anneal_ops_require_f32(op, "q", q) || !anneal_ops_require_f32(op, "k", k) ||
        !anneal_ops_require_f32(op, "v", v) || !anneal_ops_check_compute(op, o.compute))
        return NULL;
    char sq[128], sk[128], sv[128];
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "attention: q, k, v must be 4-D (B, H, T, D), got q %s, k %s, v %s",
                         anneal_shape_str(q, sq, sizeof sq), anneal_shape_str(k, sk, sizeof sk),
                         anneal_shape_str(v, sv, sizeof sv));
        return NULL;
    }
    int64_t B = q->shape[0], Hq = q->shape[1], Tq = q->shape[2], D = q->shape[3], Hkv = k->shape[1];
    if (k->shape[0] != B || k->shape[3] != D || !anneal_same_shape(k, v) || Hkv <= 0 || Hq % Hkv) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "attention: k %s and v %s must both be (B, H, Tk, D) = "
                         "(%lld, H, Tk, %lld) with H dividing q's %lld heads, to match q %s",
                         anneal_shape_str(k, sk, sizeof sk), anneal_shape_str(v, sv, sizeof sv),
                         (long long)B, (long long)D, (long long)Hq, anneal_shape_str(q, sq, sizeof sq));
        return NULL;
    }
    int64_t Tk = k->shape[2];
    if (o.rope && (o.rope_pos0 < 0 || !anneal_ops_rope_check(op, o.rope, D))) {
        if (o.rope_pos0 < 0)
            anneal_set_error(ANNEAL_ERR_ARG, "attention: rope_pos0 %lld is negative", (long long)o.rope_pos0);
        return NULL;
    }
    float scale = default_scale(o.scale, D);
    /* o lives in (B, Tq, Hq, D) storage and is returned as its (B, Hq, Tq, D) view. */
    anneal_scope_enter(NULL);
    anneal_tensor *ob = anneal_empty_on(q->device, ANNEAL_F32, 4, (int64_t[]){B, Tq, Hq, D});
    anneal_scope_leave();
    if (!ob) return NULL;
    anneal_tensor *out = anneal_alias(ob, 4, (int64_t[]){B, Hq, Tq, D},
                                      (int64_t[]){Tq * Hq * D, D, Hq * D, 1}, 0);
    anneal_release(ob);
    anneal_scope *tmp = out ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* lse, rotated copies and copies die with tmp unless saved */
    anneal_tensor *qc = unit_last(q), *kc = unit_last(k), *vc = unit_last(v);
    anneal_tensor *lse = anneal_empty_on(q->device, ANNEAL_F32, 3, (int64_t[]){B, Hq, Tq});
    anneal_status s = qc && kc && vc && lse ? ANNEAL_OK : anneal_last_status();
    anneal_attention_desc d = {0};
    if (s == ANNEAL_OK) {
        d = layout(qc, kc, vc, out, o.causal, scale, o.compute);
        if (!supported(op, be, &d, o.rope)) s = anneal_last_status();
    }
    if (s == ANNEAL_OK && o.rope) { /* rotated copies: the inputs stay as they are */
        qc = anneal_ops_rope_copy(op, be, qc, o.rope, o.rope_pos0 + Tk - Tq);
        kc = qc ? anneal_ops_rope_copy(op, be, kc, o.rope, o.rope_pos0) : NULL;
        if (!kc) s = anneal_last_status();
        else d = layout(qc, kc, vc, out, o.causal, scale, o.compute);
    }
    int64_t span_t0 = anneal_span_begin();
    if (s == ANNEAL_OK) s = anneal_ops_span_end("attention_fwd", &span_t0, anneal_ops_attention_flops(d, false), 0, be->attention_fwd(be->ctx, &d, out, lse, qc, kc, vc));
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record(op, attention_backward, 3, in, 1, &out);
        if (node) {
            save_settings(node, o.causal, o.compute, scale, o.rope, o.rope_pos0);
            /* at bf16 on the CPU backward reads q, k, v only as bf16-rounded tile operands */
            anneal_tensor *sv[3] = {qc, kc, vc};
            for (int i = 0; i < 3; i++) {
                anneal_tensor *c = anneal_ops_bf16_save_ok(sv[i], o.compute) ? anneal_ops_bf16_save_copy(be, sv[i])
                                                                              : sv[i];
                if (c) anneal_node_save(node, c);
            }
            anneal_node_save(node, out);
            anneal_node_save(node, lse);
            if (node->n_saved != 5) s = anneal_last_status();
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}

anneal_tensor *anneal_attention(anneal_tensor *q, anneal_tensor *k, anneal_tensor *v, bool causal,
                                float scale) {
    return anneal_attention_ex(q, k, v, &(anneal_attention_opts){.causal = causal, .scale = scale});
}

/* ------------------------------------------------------- attention_packed */

/* Heads of columns [col, col + H*D) of a contiguous (B, T, W) buffer as a (B, H, T, D)
 * view: strides (T*W, D, W, 1). */
static anneal_tensor *heads(const anneal_tensor *t, int64_t H, int64_t D, int64_t col) {
    int64_t B = t->shape[0], T = t->shape[1], W = t->shape[2];
    return anneal_alias(t, 4, (int64_t[]){B, H, T, D}, (int64_t[]){T * W, D, W, 1}, t->offset + col);
}

/* The gradient of qkv in one fresh buffer of its shape: dq, dk, dv are its three head
 * views and tile it, so the kernel (which overwrites them) leaves nothing unwritten;
 * with RoPE dq and dk are rotated back in place. Saved: qkv (contiguous; with RoPE a
 * copy whose q and k columns are rotated: the kernel addresses q and dq, k and dk with
 * the same strides; at bf16 on the CPU its bf16 rounding, saved_bf16.c), o (B, T, Hq*D),
 * lse; ints[6]: Hq, ints[7]: Hkv; settings as save_settings. */
static anneal_status packed_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin) {
    anneal_tensor *qkv = node->saved[0], *o = node->saved[1], *lse = node->saved[2];
    const anneal_backend *be = anneal_backend_get(qkv->device);
    if (be && !(qkv = anneal_ops_saved_f32(be, qkv))) return anneal_last_status(); /* bf16-saved: widened */
    anneal_tensor *dout = be ? anneal_ops_contiguous_raw(gout[0]) : NULL;
    anneal_tensor *dqkv = dout ? anneal_ops_new_like(qkv) : NULL;
    if (!dqkv) return anneal_last_status();
    int64_t Hq = node->ints[6], Hkv = node->ints[7], D = o->shape[2] / Hq;
    bool rope = node->ints[2] != 0;
    anneal_tensor *q = heads(qkv, Hq, D, 0), *k = heads(qkv, Hkv, D, Hq * D);
    anneal_tensor *v = heads(qkv, Hkv, D, (Hq + Hkv) * D);
    anneal_tensor *dq = heads(dqkv, Hq, D, 0), *dk = heads(dqkv, Hkv, D, Hq * D);
    anneal_tensor *dv = heads(dqkv, Hkv, D, (Hq + Hkv) * D);
    anneal_tensor *o4 = heads(o, Hq, D, 0), *do4 = heads(dout, Hq, D, 0);
    if (!q || !k || !v || !dq || !dk || !dv || !o4 || !do4) return anneal_last_status();
    anneal_attention_desc d = layout(q, k, v, o4, node->ints[0] != 0, (float)node->scalars[0],
                                     (anneal_dtype)node->ints[1]);
    int64_t span_t0 = anneal_span_begin();
    anneal_status s = anneal_ops_span_end("attention_bwd", &span_t0, anneal_ops_attention_flops(d, true), 0, be->attention_bwd(be->ctx, &d, dq, dk, dv, q, k, v, o4, do4, lse));
    if (s == ANNEAL_OK && rope) {
        anneal_rope_desc r = anneal_ops_rope_load(node, 1, 4);
        s = anneal_ops_rope_apply("attention_packed", be, dq, &r, node->ints[3], true);
        if (s == ANNEAL_OK) s = anneal_ops_rope_apply("attention_packed", be, dk, &r, node->ints[3], true);
    }
    if (s == ANNEAL_OK) gin[0] = dqkv;
    return s;
}

/* Checks qkv (B, T, W) against the head counts and returns D (0 with an error). With
 * n_head == n_kv_head the messages are those of GPT-2's causal_attention. */
static int64_t packed_head_size(const char *op, const anneal_tensor *qkv, int n_head, int n_kv_head) {
    char sq[128];
    if (qkv->ndim != 3) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: qkv must be 3-D (B, T, (n_head + 2 * n_kv_head) * D), got %s", op,
                         anneal_shape_str(qkv, sq, sizeof sq));
        return 0;
    }
    if (n_head <= 0 || n_kv_head <= 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: n_head (%d) and n_kv_head (%d) must be positive", op, n_head, n_kv_head);
        return 0;
    }
    if (n_head % n_kv_head) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: n_head = %d is not a multiple of n_kv_head = %d", op, n_head, n_kv_head);
        return 0;
    }
    int64_t W = qkv->shape[2], parts = (int64_t)n_head + 2 * (int64_t)n_kv_head;
    if (n_head == n_kv_head) {
        if (W % 3 != 0) {
            anneal_set_error(ANNEAL_ERR_SHAPE, "%s: last dim of qkv %s is %lld, not a multiple of 3", op,
                             anneal_shape_str(qkv, sq, sizeof sq), (long long)W);
            return 0;
        }
        if ((W / 3) % n_head != 0) {
            anneal_set_error(ANNEAL_ERR_SHAPE, "%s: C = %lld (qkv %s) is not divisible by n_head = %d", op,
                             (long long)(W / 3), anneal_shape_str(qkv, sq, sizeof sq), n_head);
            return 0;
        }
    } else if (W % parts != 0) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: last dim of qkv %s is %lld, not divisible by n_head + 2 * n_kv_head = %lld",
                         op, anneal_shape_str(qkv, sq, sizeof sq), (long long)W, (long long)parts);
        return 0;
    }
    return W / parts;
}

anneal_tensor *anneal_attention_packed(anneal_tensor *qkv, int n_head, int n_kv_head,
                                       const anneal_attention_opts *opts) {
    const char *op = "attention_packed";
    anneal_attention_opts o = opts ? *opts : (anneal_attention_opts){0};
    const anneal_backend *be = anneal_ops_backend(op, 1, &qkv);
    if (!be || !anneal_ops_require_f32(op, "qkv", qkv) || !anneal_ops_check_compute(op, o.compute)) return NULL;
    int64_t D = packed_head_size(op, qkv, n_head, n_kv_head);
    if (D <= 0) return NULL;
    if (o.rope && (o.rope_pos0 < 0 || !anneal_ops_rope_check(op, o.rope, D))) {
        if (o.rope_pos0 < 0)
            anneal_set_error(ANNEAL_ERR_ARG, "%s: rope_pos0 %lld is negative", op, (long long)o.rope_pos0);
        return NULL;
    }
    int64_t B = qkv->shape[0], T = qkv->shape[1], Hq = n_head, Hkv = n_kv_head, C = Hq * D;
    float scale = default_scale(o.scale, D);
    anneal_tensor *out = anneal_empty_on(qkv->device, ANNEAL_F32, 3, (int64_t[]){B, T, C});
    anneal_scope *tmp = out ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* views, lse, rotated copies and copies die with tmp unless saved */
    anneal_tensor *qc = anneal_ops_contiguous_raw(qkv);
    anneal_tensor *lse = qc ? anneal_empty_on(qkv->device, ANNEAL_F32, 3, (int64_t[]){B, Hq, T}) : NULL;
    anneal_tensor *q = lse ? heads(qc, Hq, D, 0) : NULL, *k = q ? heads(qc, Hkv, D, C) : NULL;
    anneal_tensor *v = k ? heads(qc, Hkv, D, C + Hkv * D) : NULL, *o4 = v ? heads(out, Hq, D, 0) : NULL;
    anneal_status s = o4 ? ANNEAL_OK : anneal_last_status();
    anneal_attention_desc d = {0};
    if (s == ANNEAL_OK) {
        d = layout(q, k, v, o4, o.causal, scale, o.compute);
        if (!supported(op, be, &d, o.rope)) s = anneal_last_status();
    }
    if (s == ANNEAL_OK && o.rope) {
        /* a copy of the projection with its q and k columns rotated (the input stays as
         * it is; self-attention: queries and keys at the same positions) */
        qc = anneal_ops_new_like(qkv);
        s = qc ? be->copy(be->ctx, qc, qkv) : anneal_last_status();
        q = s == ANNEAL_OK ? heads(qc, Hq, D, 0) : NULL, k = q ? heads(qc, Hkv, D, C) : NULL;
        v = k ? heads(qc, Hkv, D, C + Hkv * D) : NULL;
        if (!v) s = anneal_last_status();
        if (s == ANNEAL_OK) s = anneal_ops_rope_apply(op, be, q, o.rope, o.rope_pos0, false);
        if (s == ANNEAL_OK) s = anneal_ops_rope_apply(op, be, k, o.rope, o.rope_pos0, false);
    }
    int64_t span_t0 = anneal_span_begin();
    if (s == ANNEAL_OK) s = anneal_ops_span_end("attention_fwd", &span_t0, anneal_ops_attention_flops(d, false), 0, be->attention_fwd(be->ctx, &d, o4, lse, q, k, v));
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record(op, packed_backward, 1, &qkv, 1, &out);
        if (node) {
            save_settings(node, o.causal, o.compute, scale, o.rope, o.rope_pos0);
            node->ints[6] = Hq;
            node->ints[7] = Hkv;
            /* at bf16 on the CPU backward reads q, k, v only as bf16-rounded tile operands */
            anneal_tensor *c = anneal_ops_bf16_save_ok(qc, o.compute) ? anneal_ops_bf16_save_copy(be, qc) : qc;
            if (c) anneal_node_save(node, c);
            anneal_node_save(node, out);
            anneal_node_save(node, lse);
            if (node->n_saved != 3) s = anneal_last_status();
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}
