/* The dense layer: y = act(x @ op(W) + b) in either weight layout (linear: W (out,
 * in) as torch.nn.Linear; conv1d: W (in, out) as Hugging Face's Conv1D), with the bias
 * and the activation fused into one GEMM through the matmul slot's epilogue:
 *   NONE      y = x W + b               (epilogue BIAS, or none without a bias)
 *   GELU_TANH y = gelu_tanh(pre)         (epilogue BIAS_GELU; pre = x W + b kept)
 *   SILU_MUL  y = silu(pre) * mul        (epilogue SILU_MUL; pre kept: SwiGLU's gate)
 * A backend that declines an epilogue gets the same arithmetic unfused (bias broadcast
 * into y before the GEMM, the activation as its own pass). The compute precision is an
 * argument recorded on the node; the backward's GEMMs run at it.
 * Backward: d_pre = dy (NONE), dy * gelu'(pre) (GELU), dy * mul * silu'(pre) and
 * d_mul = dy * silu(pre) (SILU_MUL); then dx = d_pre @ op(W)^T, dW in W's own layout
 * (linear: d_pre^T x, conv1d: x^T d_pre), db = column sums of d_pre (conv1d: taken by
 * the dW GEMM while it packs d_pre, epilogue BSUM).
 * A weight that requires no gradient may be bf16 (a frozen LoRA base): it is widened to
 * an f32 temporary for each GEMM (exact) and saved as bf16 for backward. */
#include "ops_internal.h"

#include <string.h>

/* The op's name in messages: the plain layers keep theirs. */
static const char *dense_name(bool out_in, anneal_activation act) {
    switch (act) {
    case ANNEAL_ACT_NONE: return out_in ? "linear" : "conv1d";
    case ANNEAL_ACT_GELU_TANH: return out_in ? "linear_gelu" : "conv1d_gelu";
    case ANNEAL_ACT_SILU_MUL: return out_in ? "linear_silu_mul" : "conv1d_silu_mul";
    }
    return "dense";
}

/* True when the backend runs this epilogue on one product at `compute`. */
static bool epilogue_ok(const anneal_backend *be, anneal_epilogue ep, anneal_dtype compute) {
    anneal_matmul_desc d = {.batch = 1, .compute = compute, .epilogue = ep};
    anneal_op_query q = {.kind = ANNEAL_OP_MATMUL, .dtype = ANNEAL_F32, .matmul = &d};
    return anneal_backend_supports(be, &q);
}

/* 2-D (rows, cols) contiguous alias of a contiguous tensor t. */
static anneal_tensor *as_2d(const anneal_tensor *t, int64_t rows, int64_t cols) {
    return t ? anneal_alias(t, 2, (int64_t[]){rows, cols}, (int64_t[]){cols, 1}, t->offset) : NULL;
}

/* A frozen bf16 weight as the f32 operand the GEMM reads: a contiguous copy in the
 * current scope, exact (every bf16 value is an f32 value), so at compute bf16 the
 * product equals the one of the f32 weight it was rounded from. Other weights: the
 * GEMM operand itself. */
static anneal_tensor *weight_operand(const anneal_backend *be, anneal_tensor *w) {
    if (!w || w->dtype == ANNEAL_F32) return anneal_ops_gemm_operand(w);
    anneal_tensor *f = anneal_empty_on(w->device, ANNEAL_F32, w->ndim, w->shape);
    if (!f || be->copy(be->ctx, f, w) != ANNEAL_OK) return NULL;
    return f;
}

/* ------------------------------------------------------------- backward */

/* d_pre (R, N) from dy (R, N) for the node's activation; for SILU_MUL, when emul (the
 * mul input's edge) is given, also d_mul (emul's shape) into *dmul. Saved (GELU,
 * SILU_MUL): pre at saved[2]; (SILU_MUL) mul at saved[3]. */
static anneal_tensor *act_backward(anneal_node *node, const anneal_backend *be, anneal_tensor *dy,
                                   anneal_tensor **dmul, const anneal_edge *emul) {
    anneal_activation act = (anneal_activation)node->ints[1];
    if (act == ANNEAL_ACT_NONE) return dy;
    anneal_tensor *pre = node->saved[2];
    int64_t R = pre->shape[0], N = pre->shape[1];
    anneal_tensor *dyc = anneal_ops_contiguous_raw(dy);
    anneal_tensor *dpre = dyc ? anneal_empty_on(pre->device, ANNEAL_F32, 2, (int64_t[]){R, N}) : NULL;
    if (!dpre) return NULL;
    int64_t span_t0 = anneal_span_begin();
    if (act == ANNEAL_ACT_GELU_TANH)
        return anneal_ops_span_end("unary_bwd", &span_t0, 0, anneal_ops_span_bytes(pre), be->unary_bwd(be->ctx, ANNEAL_UNARY_GELU_TANH, dpre, pre, dyc, 0.0f)) == ANNEAL_OK ? dpre : NULL;
    /* SiLU times mul: d_pre = (dy * mul) * silu'(pre); d_mul = dy * silu(pre) */
    anneal_tensor *mul = node->saved[3];
    anneal_tensor *t = anneal_empty_on(pre->device, ANNEAL_F32, 2, (int64_t[]){R, N});
    span_t0 = anneal_span_begin();
    if (!t || anneal_ops_span_end("binary", &span_t0, 0, anneal_ops_span_bytes(dyc), be->binary(be->ctx, ANNEAL_MUL, t, dyc, mul)) != ANNEAL_OK ||
        anneal_ops_span_end("unary_bwd", &span_t0, 0, anneal_ops_span_bytes(pre), be->unary_bwd(be->ctx, ANNEAL_UNARY_SILU, dpre, pre, t, 0.0f)) != ANNEAL_OK)
        return NULL;
    if (emul) {
        anneal_tensor *sp = anneal_empty_on(pre->device, ANNEAL_F32, 2, (int64_t[]){R, N});
        anneal_tensor *dm = sp ? anneal_empty_on(pre->device, ANNEAL_F32, emul->ndim, emul->shape) : NULL;
        anneal_tensor *dm2 = as_2d(dm, R, N);
        span_t0 = anneal_span_begin();
        if (!dm2 || anneal_ops_span_end("unary", &span_t0, 0, anneal_ops_span_bytes(pre), be->unary(be->ctx, ANNEAL_UNARY_SILU, sp, pre, 0.0f)) != ANNEAL_OK ||
            anneal_ops_span_end("binary", &span_t0, 0, anneal_ops_span_bytes(dyc), be->binary(be->ctx, ANNEAL_MUL, dm2, dyc, sp)) != ANNEAL_OK)
            return NULL;
        *dmul = dm;
    }
    return dpre;
}

static anneal_status dense_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin);

/* x (rows, in) for the dW GEMM from saved[0]: x itself, x widened from its bf16 copy,
 * or with ints[5] set x = gelu_tanh(saved[0]) recomputed from the pre-activation the
 * GELU layer before saved (its epilogue's function, so the same bits). */
static anneal_tensor *saved_x(anneal_node *node, const anneal_backend *be) {
    anneal_tensor *x2 = node->saved[0];
    if (!node->ints[5]) return anneal_ops_saved_f32(be, x2); /* saved as bf16: widened, exact */
    anneal_tensor *x = anneal_ops_new_like(x2);
    int64_t span_t0 = anneal_span_begin();
    if (!x || !anneal_ops_kernel("dense", be, ANNEAL_OP_UNARY, ANNEAL_F32) ||
        anneal_ops_span_end("unary", &span_t0, 0, anneal_ops_span_bytes(x2),
                            be->unary(be->ctx, ANNEAL_UNARY_GELU_TANH, x, x2, 0.0f)) != ANNEAL_OK)
        return NULL;
    return x;
}

/* When x is the whole output of a GELU dense layer on the CPU (GPT-2's MLP: proj(gelu(fc
 * x))), that layer's saved pre-activation (R, in), from which backward recomputes x: the
 * layer saves pre in f32 anyway, so this one saves no bytes of its own. NULL otherwise. */
static anneal_tensor *gelu_source(const anneal_tensor *x, int64_t R, int64_t n_in) {
    const anneal_node *p = x->grad_fn;
    if (!anneal_ops_gelu_resave_on() || x->device != ANNEAL_CPU || !p || p->backward != dense_backward ||
        p->released || x->grad_fn_output != 0 || p->ints[1] != ANNEAL_ACT_GELU_TANH || p->n_saved < 3)
        return NULL;
    anneal_tensor *pre = p->saved[2];
    return pre->ndim == 2 && pre->shape[0] == R && pre->shape[1] == n_in && anneal_is_contiguous(pre) ? pre : NULL;
}

/* Saved: x as a (rows, in) matrix the GEMM reads (at bf16 compute on the CPU its bf16
 * rounding, saved_bf16.c, unless opts.x_kept_f32; or, ints[5] = 1, the pre-activation x
 * is gelu_tanh of, see gelu_source), w, [pre (R, out), mul (R, out)];
 * ints[0]: w is (out, in); ints[1]: the activation; ints[2]: compute; ints[3]: index
 * of the bias input (-1: none); ints[4]: index of the mul input (-1: none). */
static anneal_status dense_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin) {
    bool out_in = node->ints[0] != 0;
    anneal_dtype cd = (anneal_dtype)node->ints[2];
    int ib = (int)node->ints[3], im = (int)node->ints[4];
    const char *op = dense_name(out_in, (anneal_activation)node->ints[1]);
    anneal_tensor *x2 = node->saved[0], *w = node->saved[1];
    anneal_tensor *dy = anneal_ops_flat_operand(gout[0]); /* (rows, out) */
    const anneal_backend *be = dy ? anneal_backend_get(dy->device) : NULL;
    if (!be || !(w = weight_operand(be, w))) return anneal_last_status(); /* bf16 (frozen): f32 for this backward */
    int64_t R = dy->shape[0], n_out = dy->shape[1], n_in = x2->shape[1];
    anneal_tensor *dmul = NULL;
    bool want_mul = im >= 0 && anneal_node_input_needs_grad(node, im);
    anneal_tensor *dpre = act_backward(node, be, dy, &dmul, want_mul ? &node->inputs[im] : NULL);
    if (!dpre) return anneal_last_status();
    if (want_mul) gin[im] = dmul;
    if (anneal_node_input_needs_grad(node, 0)) {
        const anneal_edge *e = &node->inputs[0];
        anneal_tensor *dx = anneal_empty_on(dy->device, ANNEAL_F32, e->ndim, e->shape);
        anneal_tensor *dx2 = dx ? as_2d(dx, R, n_in) : NULL;
        anneal_tensor *wt = out_in ? w : anneal_ops_mT(w); /* (out, in) */
        if (!dx2 || !wt || anneal_ops_gemm_nd(op, be, dx2, dpre, wt, 1.0f, 0.0f, cd) != ANNEAL_OK)
            return anneal_last_status();
        gin[0] = dx;
    }
    bool want_db = ib >= 0 && anneal_node_input_needs_grad(node, ib);
    if (anneal_node_input_needs_grad(node, 1)) {
        if (!(x2 = saved_x(node, be))) return anneal_last_status();
        anneal_tensor *dw = anneal_empty_on(dy->device, ANNEAL_F32, 2, w->shape);
        anneal_tensor *l = out_in ? anneal_ops_mT(dpre) : anneal_ops_mT(x2), *r = out_in ? x2 : dpre;
        if (!dw || !l) return anneal_last_status();
        anneal_status s;
        if (want_db && !out_in && R > 0 && epilogue_ok(be, ANNEAL_EPILOGUE_BSUM, cd)) {
            /* conv1d: d_pre is the GEMM's right operand, so db = its column sums come with dW */
            anneal_tensor *db = anneal_empty_on(dy->device, ANNEAL_F32, 1, &n_out);
            if (!db) return anneal_last_status();
            s = anneal_ops_gemm_2d(op, be, dw, l, r, &(anneal_matmul_desc){.epilogue = ANNEAL_EPILOGUE_BSUM, .bsum = db},
                                   cd);
            gin[ib] = db;
            want_db = false;
        } else {
            s = anneal_ops_gemm_nd(op, be, dw, l, r, 1.0f, 0.0f, cd);
        }
        if (s != ANNEAL_OK) return anneal_last_status();
        gin[1] = dw;
    }
    if (want_db) {
        if (R == 0) {
            anneal_tensor *db = anneal_empty_on(dy->device, ANNEAL_F32, 1, &n_out);
            if (!db || be->fill(be->ctx, db, 0.0) != ANNEAL_OK) return anneal_last_status();
            gin[ib] = db;
        } else {
            gin[ib] = anneal_ops_sum_to(dpre, 1, &n_out);
        }
    }
    return anneal_last_status();
}

/* -------------------------------------------------------------- forward */

/* y2 (R, out) = act(x2 @ wop + b) with the epilogue the backend runs, or unfused;
 * pre (R, out) receives x2 @ wop + b for GELU and SILU_MUL. */
static anneal_status forward(const char *op, const anneal_backend *be, anneal_activation act, anneal_tensor *y2,
                             anneal_tensor *pre, anneal_tensor *x2, anneal_tensor *wop, anneal_tensor *b,
                             anneal_tensor *mul2, anneal_dtype cd) {
    int64_t R = y2->shape[0];
    static const anneal_epilogue fused[] = {ANNEAL_EPILOGUE_BIAS, ANNEAL_EPILOGUE_BIAS_GELU, ANNEAL_EPILOGUE_SILU_MUL};
    anneal_epilogue ep = fused[act];
    if (act == ANNEAL_ACT_NONE && !(b && R > 0)) return anneal_ops_gemm_nd(op, be, y2, x2, wop, 1.0f, 0.0f, cd);
    if (epilogue_ok(be, ep, cd)) {
        anneal_matmul_desc d = {.epilogue = ep, .bias = b, .aux_in = mul2, .aux_out = pre};
        return anneal_ops_gemm_2d(op, be, y2, x2, wop, &d, cd);
    }
    /* Unfused: target = x2 @ wop (+ b broadcast into it first, accumulated onto). */
    anneal_tensor *target = act == ANNEAL_ACT_NONE ? y2 : pre;
    float beta = 0.0f;
    anneal_status s = ANNEAL_OK;
    if (b && R > 0) {
        anneal_tensor *bx = anneal_ops_expand(b, 2, target->shape); /* stride 0 over rows */
        s = bx ? be->copy(be->ctx, target, bx) : anneal_last_status();
        beta = 1.0f;
    }
    if (s == ANNEAL_OK) s = anneal_ops_gemm_nd(op, be, target, x2, wop, 1.0f, beta, cd);
    if (s != ANNEAL_OK || act == ANNEAL_ACT_NONE) return s;
    if (!anneal_ops_kernel(op, be, ANNEAL_OP_UNARY, ANNEAL_F32)) return anneal_last_status();
    int64_t span_t0 = anneal_span_begin();
    if (act == ANNEAL_ACT_GELU_TANH) return anneal_ops_span_end("unary", &span_t0, 0, anneal_ops_span_bytes(pre), be->unary(be->ctx, ANNEAL_UNARY_GELU_TANH, y2, pre, 0.0f));
    s = anneal_ops_span_end("unary", &span_t0, 0, anneal_ops_span_bytes(pre), be->unary(be->ctx, ANNEAL_UNARY_SILU, y2, pre, 0.0f));
    return s == ANNEAL_OK ? anneal_ops_span_end("binary", &span_t0, 0, anneal_ops_span_bytes(y2), be->binary(be->ctx, ANNEAL_MUL, y2, y2, mul2)) : s;
}

anneal_tensor *anneal_dense(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, const anneal_dense_opts *opts) {
    anneal_dense_opts o = opts ? *opts : (anneal_dense_opts){0};
    if ((unsigned)o.layout > ANNEAL_WEIGHT_IN_OUT || (unsigned)o.act > ANNEAL_ACT_SILU_MUL) {
        anneal_set_error(ANNEAL_ERR_ARG, "dense: unknown weight layout %d or activation %d", (int)o.layout, (int)o.act);
        return NULL;
    }
    bool out_in = o.layout == ANNEAL_WEIGHT_OUT_IN;
    const char *name = dense_name(out_in, o.act);
    bool silu = o.act == ANNEAL_ACT_SILU_MUL;
    anneal_tensor *in[4] = {x, w};
    int n = 2, ib = -1, im = -1;
    if (b) in[ib = n++] = b;
    if (silu) in[im = n++] = o.mul;
    const anneal_backend *be = anneal_ops_backend(name, n, in);
    if (!be) return NULL;
    if (!silu && o.mul) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: mul is only for ANNEAL_ACT_SILU_MUL", name);
        return NULL;
    }
    /* a frozen weight may be stored in bf16 (LoRA's base); a trained one is f32 */
    bool w_bf16 = w->dtype == ANNEAL_BF16 && !w->requires_grad;
    if (!anneal_ops_require_f32(name, "x", x) || (!w_bf16 && !anneal_ops_require_f32(name, "weight", w)) ||
        (b && !anneal_ops_require_f32(name, "bias", b)) || (silu && !anneal_ops_require_f32(name, "mul", o.mul)) ||
        !anneal_ops_check_compute(name, o.compute))
        return NULL;
    const char *layout = out_in ? "(out, in)" : "(in, out)";
    char sx[128], sw[128], sbias[128];
    if (w->ndim != 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: weight must be 2-D %s, got %s", name, layout,
                         anneal_shape_str(w, sw, sizeof sw));
        return NULL;
    }
    if (x->ndim < 1) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x must have at least 1 dim, got a 0-dim tensor", name);
        return NULL;
    }
    int64_t n_in = out_in ? w->shape[1] : w->shape[0], n_out = out_in ? w->shape[0] : w->shape[1];
    if (x->shape[x->ndim - 1] != n_in) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x %s has %lld features but weight %s %s expects %lld",
                         name, anneal_shape_str(x, sx, sizeof sx), (long long)x->shape[x->ndim - 1],
                         anneal_shape_str(w, sw, sizeof sw), layout, (long long)n_in);
        return NULL;
    }
    if (b && (b->ndim != 1 || b->shape[0] != n_out)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: bias %s must be (%lld) for weight %s %s", name,
                         anneal_shape_str(b, sbias, sizeof sbias), (long long)n_out,
                         anneal_shape_str(w, sw, sizeof sw), layout);
        return NULL;
    }
    int64_t shape[ANNEAL_MAX_DIMS], R = anneal_ops_prod(x->shape, x->ndim - 1);
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = n_out;
    if (silu) {
        bool same = o.mul->ndim == x->ndim;
        for (int i = 0; same && i < x->ndim; i++) same = o.mul->shape[i] == shape[i];
        if (!same) {
            char sm[128];
            anneal_set_error(ANNEAL_ERR_SHAPE, "%s: mul %s must have the output's shape (x %s with %lld features)",
                             name, anneal_shape_str(o.mul, sm, sizeof sm), anneal_shape_str(x, sx, sizeof sx),
                             (long long)n_out);
            return NULL;
        }
    }
    anneal_tensor *y = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, shape);
    anneal_scope *tmp = y ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* views, copies and pre die with tmp unless saved */
    anneal_tensor *x2 = anneal_ops_flat_operand(x), *wc = weight_operand(be, w);
    anneal_tensor *bc = b ? anneal_ops_contiguous_raw(b) : NULL;
    anneal_tensor *y2 = as_2d(y, R, n_out);
    anneal_tensor *wop = wc ? (out_in ? anneal_ops_mT(wc) : wc) : NULL; /* (in, out) */
    anneal_tensor *pre = o.act != ANNEAL_ACT_NONE ? anneal_empty_on(x->device, ANNEAL_F32, 2, (int64_t[]){R, n_out})
                                                  : NULL;
    anneal_tensor *mc = silu ? anneal_ops_contiguous_raw(o.mul) : NULL;
    anneal_tensor *mul2 = mc ? as_2d(mc, R, n_out) : NULL;
    anneal_status s = x2 && wop && y2 && (bc || !b) && (pre || o.act == ANNEAL_ACT_NONE) && (mul2 || !silu)
                          ? ANNEAL_OK
                          : anneal_last_status();
    if (s == ANNEAL_OK) s = forward(name, be, o.act, y2, pre, x2, wop, bc, mul2, o.compute);
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record(name, dense_backward, n, in, 1, &y);
        if (node) {
            node->ints[0] = out_in;
            node->ints[1] = o.act;
            node->ints[2] = o.compute;
            node->ints[3] = ib;
            node->ints[4] = im;
            /* x = gelu(pre) of the layer before: its pre (saved there anyway); else at bf16
             * compute x is read only as a bf16-rounded operand of the dW GEMM */
            anneal_tensor *gp = anneal_node_input_needs_grad(node, 1) ? gelu_source(x, R, n_in) : NULL;
            bool x_bf16 = !gp && !o.x_kept_f32 && anneal_node_input_needs_grad(node, 1) &&
                          anneal_ops_bf16_save_ok(x2, o.compute);
            anneal_tensor *xs = gp ? gp : x_bf16 ? anneal_ops_bf16_save_copy(be, x2) : x2;
            node->ints[5] = gp != NULL;
            if (xs) anneal_node_save(node, xs);
            anneal_node_save(node, w_bf16 ? w : wc); /* bf16: converted again in backward, not kept as f32 */
            if (pre) anneal_node_save(node, pre);
            if (mul2) anneal_node_save(node, mul2);
            if (node->n_saved != 2 + (pre != NULL) + (mul2 != NULL)) s = anneal_last_status();
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? y : NULL;
}

anneal_tensor *anneal_linear(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b) {
    return anneal_dense(x, w, b, &(anneal_dense_opts){.layout = ANNEAL_WEIGHT_OUT_IN});
}

anneal_tensor *anneal_conv1d(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b) {
    return anneal_dense(x, w, b, &(anneal_dense_opts){.layout = ANNEAL_WEIGHT_IN_OUT});
}

anneal_tensor *anneal_conv1d_gelu(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b) {
    return anneal_dense(x, w, b, &(anneal_dense_opts){.layout = ANNEAL_WEIGHT_IN_OUT, .act = ANNEAL_ACT_GELU_TANH});
}
