/* Matrix products: matmul with NumPy broadcasting of batch dims, and the dense layer
 * in both weight layouts (linear: w (out, in) as torch.nn.Linear; conv1d: w (in, out)
 * as Hugging Face's Conv1D), with their backward rules. Every product goes through
 * the backend's matmul slot; transposed operands are handed over as strided views
 * (the GEMM reads either layout), so no transpose is ever copied. */
#include "ops_internal.h"

#include <string.h>

/* ------------------------------------------------------------ operands */

/* True when the last two dims of t (rows, cols) can go to the backend GEMM as they are:
 * one dim has unit stride and the other's stride spans it (the CPU adapter's rule). */
static bool gemm_ok(const anneal_tensor *t) {
    int nd = t->ndim;
    int64_t rows = t->shape[nd - 2], cols = t->shape[nd - 1];
    int64_t sr = t->strides[nd - 2], sc = t->strides[nd - 1];
    if ((sc == 1 || cols == 1) && (rows == 1 || sr >= cols)) return true; /* row-major */
    if ((sr == 1 || rows == 1) && (cols == 1 || sc >= rows)) return true; /* column-major */
    return false;
}

/* t itself when the GEMM can read it, otherwise a contiguous copy (no autograd). */
static anneal_tensor *gemm_operand(anneal_tensor *t) {
    if (!t) return NULL;
    return gemm_ok(t) ? t : anneal_ops_contiguous_raw(t);
}

/* View of t (ndim >= 2) with its last two dims swapped: t^T without a copy. */
static anneal_tensor *mT(const anneal_tensor *t) {
    if (!t) return NULL;
    int nd = t->ndim;
    int64_t shape[ANNEAL_MAX_DIMS], strides[ANNEAL_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    memcpy(strides, t->strides, sizeof strides);
    shape[nd - 2] = t->shape[nd - 1];
    shape[nd - 1] = t->shape[nd - 2];
    strides[nd - 2] = t->strides[nd - 1];
    strides[nd - 1] = t->strides[nd - 2];
    return anneal_alias(t, nd, shape, strides, t->offset);
}

/* Product of the sizes of dims [0, n). */
static int64_t prod(const int64_t *shape, int n) {
    int64_t p = 1;
    for (int i = 0; i < n; i++) p *= shape[i];
    return p;
}

/* When all leading dims of t (ndim >= 1) merge into one evenly strided row dim, writes
 * the row stride and returns true: t is then a (rows, cols) matrix without a copy. */
static bool rows_stride(const anneal_tensor *t, int64_t *rs) {
    int nd = t->ndim;
    int64_t cols = t->shape[nd - 1], expect = -1;
    *rs = -1;
    for (int d = nd - 2; d >= 0; d--) {
        if (t->shape[d] == 1) continue;
        if (*rs < 0) *rs = t->strides[d];
        else if (t->strides[d] != expect) return false;
        expect = t->strides[d] * t->shape[d];
    }
    if (*rs < 0) *rs = cols > 0 ? cols : 1; /* a single row: any stride spanning it */
    return true;
}

/* t (..., cols) as a 2-D (rows, cols) matrix the GEMM can read: a view when the
 * leading dims merge (any row stride, either unit-stride layout), else a copy. */
static anneal_tensor *flat_operand(anneal_tensor *t) {
    if (!t) return NULL;
    int nd = t->ndim;
    int64_t rows = prod(t->shape, nd - 1), cols = t->shape[nd - 1], rs;
    if (rows_stride(t, &rs)) {
        int64_t shape[2] = {rows, cols}, strides[2] = {rs, t->strides[nd - 1]};
        anneal_tensor *v = anneal_alias(t, 2, shape, strides, t->offset);
        if (!v || gemm_ok(v)) return v;
    }
    anneal_tensor *c = anneal_ops_contiguous_raw(t);
    if (!c) return NULL;
    int64_t shape[2] = {rows, cols}, strides[2] = {cols, 1};
    return anneal_alias(c, 2, shape, strides, c->offset);
}

/* ------------------------------------------------------------- matmul */

/* dst (c's batch dims, left's rows, right's cols) = left @ right, summed down to the
 * shape of edge e (over the batch dims the operand was broadcast in). */
static anneal_tensor *product_to(const anneal_backend *be, int nb, const int64_t *batch,
                                 anneal_tensor *left, anneal_tensor *right, const anneal_edge *e) {
    if (!left || !right) return NULL;
    int64_t shape[ANNEAL_MAX_DIMS];
    memcpy(shape, batch, sizeof(int64_t) * (size_t)nb);
    shape[nb] = left->shape[left->ndim - 2];
    shape[nb + 1] = right->shape[right->ndim - 1];
    anneal_tensor *full = anneal_empty_on(left->device, ANNEAL_F32, nb + 2, shape);
    if (!full || be->matmul(full, left, right, 1.0f, 0.0f, anneal_get_matmul_dtype()) != ANNEAL_OK) return NULL;
    return anneal_ops_sum_to(full, e->ndim, e->shape);
}

/* dB = A^T @ dC as one GEMM when B is shared by every batch: A (batch.., M, K) and
 * dC (batch.., M, N) fold into (batch*M, K) and (batch*M, N) matrices, so the sum over
 * the batch happens inside the GEMM. NULL without error when they do not fold. */
static anneal_tensor *shared_rhs_grad(const anneal_backend *be, anneal_tensor *a,
                                      anneal_tensor *dc, const anneal_edge *eb) {
    int64_t ra, rc;
    if (prod(a->shape, a->ndim - 2) != prod(dc->shape, dc->ndim - 2)) return NULL;
    if (!rows_stride(a, &ra) || !rows_stride(dc, &rc)) return NULL;
    int64_t R = prod(a->shape, a->ndim - 1), K = a->shape[a->ndim - 1],
            N = dc->shape[dc->ndim - 1];
    int64_t sa[2] = {a->strides[a->ndim - 1], ra}, sc[2] = {rc, dc->strides[dc->ndim - 1]};
    anneal_tensor *at = anneal_alias(a, 2, (int64_t[]){K, R}, sa, a->offset);
    anneal_tensor *c2 = anneal_alias(dc, 2, (int64_t[]){R, N}, sc, dc->offset);
    if (!at || !c2 || !gemm_ok(at) || !gemm_ok(c2)) return NULL;
    anneal_tensor *db = anneal_empty_on(a->device, ANNEAL_F32, eb->ndim, eb->shape);
    anneal_tensor *db2 = db ? anneal_alias(db, 2, (int64_t[]){K, N}, (int64_t[]){N, 1}, 0) : NULL;
    if (!db2 || be->matmul(db2, at, c2, 1.0f, 0.0f, anneal_get_matmul_dtype()) != ANNEAL_OK) return NULL;
    return db;
}

/* dA = dC @ B^T and dB = A^T @ dC (transposes are views), each reduced over the batch
 * dims its operand was broadcast in. Saved: a, b (as handed to the GEMM). */
static anneal_status matmul_backward(anneal_node *node, anneal_tensor *const *gout,
                                     anneal_tensor **gin) {
    anneal_tensor *a = node->saved[0], *b = node->saved[1];
    anneal_tensor *dc = gemm_operand(gout[0]);
    const anneal_backend *be = dc ? anneal_backend_get(dc->device) : NULL;
    if (!be) return anneal_last_status();
    const anneal_edge *ea = &node->inputs[0], *eb = &node->inputs[1];
    int nb = dc->ndim - 2;
    if (ea->needs_grad) gin[0] = product_to(be, nb, dc->shape, dc, mT(b), ea);
    if (eb->needs_grad) {
        anneal_tensor *db = NULL;
        if (nb > 0 && prod(b->shape, b->ndim - 2) == 1 && prod(dc->shape, nb) > 1)
            db = shared_rhs_grad(be, a, dc, eb);
        gin[1] = db ? db : product_to(be, nb, dc->shape, mT(a), dc, eb);
    }
    return anneal_last_status();
}

anneal_tensor *anneal_matmul(anneal_tensor *a, anneal_tensor *b) {
    anneal_tensor *in[2] = {a, b};
    const anneal_backend *be = anneal_ops_backend("matmul", 2, in);
    if (!be) return NULL;
    if (!anneal_ops_require_f32("matmul", "a", a) || !anneal_ops_require_f32("matmul", "b", b))
        return NULL;
    char sa[128], sb[128];
    if (a->ndim < 2 || b->ndim < 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "matmul: operands need at least 2 dims (1-D operands are not supported: "
                         "reshape to (1, K) or (K, 1)), got a %s and b %s",
                         anneal_shape_str(a, sa, sizeof sa), anneal_shape_str(b, sb, sizeof sb));
        return NULL;
    }
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    if (b->shape[b->ndim - 2] != K) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "matmul: a %s @ b %s: inner dims differ (%lld vs %lld)",
                         anneal_shape_str(a, sa, sizeof sa), anneal_shape_str(b, sb, sizeof sb),
                         (long long)K, (long long)b->shape[b->ndim - 2]);
        return NULL;
    }
    /* Batch dims: NumPy broadcast of a's and b's leading dims, aligned from the right. */
    int na = a->ndim - 2, nbb = b->ndim - 2, nb = na > nbb ? na : nbb;
    int64_t shape[ANNEAL_MAX_DIMS];
    for (int i = 0; i < nb; i++) {
        int ia = i - (nb - na), ib = i - (nb - nbb);
        int64_t xa = ia >= 0 ? a->shape[ia] : 1, xb = ib >= 0 ? b->shape[ib] : 1;
        if (xa != xb && xa != 1 && xb != 1) {
            anneal_set_error(ANNEAL_ERR_SHAPE, "matmul: batch dims of a %s and b %s do not broadcast",
                             anneal_shape_str(a, sa, sizeof sa), anneal_shape_str(b, sb, sizeof sb));
            return NULL;
        }
        shape[i] = xa == 1 ? xb : xa;
    }
    shape[nb] = M;
    shape[nb + 1] = N;
    anneal_tensor *out = anneal_empty_on(a->device, ANNEAL_F32, nb + 2, shape);
    anneal_scope *tmp = out ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* copies made for the GEMM die with tmp unless saved */
    anneal_tensor *ac = gemm_operand(a), *bc = gemm_operand(b);
    anneal_status s = (ac && bc) ? be->matmul(out, ac, bc, 1.0f, 0.0f, anneal_get_matmul_dtype()) : anneal_last_status();
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record("matmul", matmul_backward, 2, in, 1, &out);
        if (node) {
            anneal_node_save(node, ac);
            anneal_node_save(node, bc);
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}

/* --------------------------------------------------------- linear, conv1d */

/* dx = dy @ op(w)^T, dW in w's own layout (linear: dy^T x, conv1d: x^T dy),
 * db = column sums of dy (conv1d: taken by the dW GEMM while it packs dy, matmul_bsum).
 * Saved: x as a (rows, in) matrix, w; ints[0]: w is (out, in). */
static anneal_status dense_backward(anneal_node *node, anneal_tensor *const *gout,
                                    anneal_tensor **gin) {
    bool out_in = node->ints[0] != 0;
    anneal_tensor *x2 = node->saved[0], *w = node->saved[1];
    anneal_tensor *dy = flat_operand(gout[0]); /* (rows, out) */
    const anneal_backend *be = dy ? anneal_backend_get(dy->device) : NULL;
    if (!be) return anneal_last_status();
    int64_t R = dy->shape[0], n_out = dy->shape[1], n_in = x2->shape[1];
    if (anneal_node_input_needs_grad(node, 0)) {
        const anneal_edge *e = &node->inputs[0];
        anneal_tensor *dx = anneal_empty_on(dy->device, ANNEAL_F32, e->ndim, e->shape);
        anneal_tensor *dx2 =
            dx ? anneal_alias(dx, 2, (int64_t[]){R, n_in}, (int64_t[]){n_in, 1}, 0) : NULL;
        anneal_tensor *wt = out_in ? w : mT(w); /* (out, in) */
        if (!dx2 || !wt || be->matmul(dx2, dy, wt, 1.0f, 0.0f, anneal_get_matmul_dtype()) != ANNEAL_OK)
            return anneal_last_status();
        gin[0] = dx;
    }
    bool want_db = node->n_inputs == 3 && anneal_node_input_needs_grad(node, 2);
    if (anneal_node_input_needs_grad(node, 1)) {
        anneal_tensor *dw = anneal_empty_on(dy->device, ANNEAL_F32, 2, w->shape);
        anneal_tensor *l = out_in ? mT(dy) : mT(x2), *r = out_in ? x2 : dy;
        if (!dw || !l) return anneal_last_status();
        anneal_status s;
        if (want_db && !out_in && R > 0 && be->matmul_bsum) {
            /* conv1d: dy is the GEMM's right operand, so db = its column sums come with dW */
            anneal_tensor *db = anneal_empty_on(dy->device, ANNEAL_F32, 1, &n_out);
            if (!db) return anneal_last_status();
            s = be->matmul_bsum(dw, l, r, db, anneal_get_matmul_dtype());
            gin[2] = db;
            want_db = false;
        } else {
            s = be->matmul(dw, l, r, 1.0f, 0.0f, anneal_get_matmul_dtype());
        }
        if (s != ANNEAL_OK) return anneal_last_status();
        gin[1] = dw;
    }
    if (want_db) {
        if (R == 0) {
            anneal_tensor *db = anneal_empty_on(dy->device, ANNEAL_F32, 1, &n_out);
            if (!db || be->fill(db, 0.0) != ANNEAL_OK) return anneal_last_status();
            gin[2] = db;
        } else {
            gin[2] = anneal_ops_sum_to(dy, 1, &n_out);
        }
    }
    return anneal_last_status();
}

/* y (..., out) = x (..., in) @ op(w) + b: one GEMM over the flattened rows of x, the bias
 * added in its epilogue (backends without matmul_bias: broadcast into y first and
 * accumulated onto, beta = 1). */
static anneal_tensor *dense(const char *name, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                            bool out_in) {
    anneal_tensor *in[3] = {x, w, b};
    int n = b ? 3 : 2;
    const anneal_backend *be = anneal_ops_backend(name, n, in);
    if (!be) return NULL;
    if (!anneal_ops_require_f32(name, "x", x) || !anneal_ops_require_f32(name, "weight", w) ||
        (b && !anneal_ops_require_f32(name, "bias", b)))
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
    int64_t shape[ANNEAL_MAX_DIMS], R = prod(x->shape, x->ndim - 1);
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = n_out;
    anneal_tensor *y = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, shape);
    anneal_scope *tmp = y ? anneal_scope_new() : NULL;
    if (!tmp) return NULL;
    anneal_scope_enter(tmp); /* views and copies for the GEMM die with tmp unless saved */
    anneal_tensor *x2 = flat_operand(x), *wc = gemm_operand(w);
    anneal_tensor *y2 = anneal_alias(y, 2, (int64_t[]){R, n_out}, (int64_t[]){n_out, 1}, 0);
    anneal_tensor *wop = out_in ? mT(wc) : wc; /* (in, out) */
    anneal_status s = (x2 && wop && y2) ? ANNEAL_OK : anneal_last_status();
    float beta = 0.0f;
    if (s == ANNEAL_OK && b && R > 0 && be->matmul_bias) {
        s = be->matmul_bias(y2, x2, wop, b, anneal_get_matmul_dtype()); /* bias in the epilogue */
    } else {
        if (s == ANNEAL_OK && b && R > 0) {
            anneal_tensor *bx = anneal_ops_expand(b, 2, y2->shape); /* stride 0 over rows */
            s = bx ? be->copy(y2, bx) : anneal_last_status();
            beta = 1.0f;
        }
        if (s == ANNEAL_OK) s = be->matmul(y2, x2, wop, 1.0f, beta, anneal_get_matmul_dtype());
    }
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record(name, dense_backward, n, in, 1, &y);
        if (node) {
            node->ints[0] = out_in;
            anneal_node_save(node, x2);
            anneal_node_save(node, wc);
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? y : NULL;
}

anneal_tensor *anneal_linear(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b) {
    return dense("linear", x, w, b, true);
}

anneal_tensor *anneal_conv1d(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b) {
    return dense("conv1d", x, w, b, false);
}
