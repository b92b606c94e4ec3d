/* matmul with NumPy broadcasting of batch dims, at a compute precision recorded on
 * its node (the backward's products run at it), and its backward rule. Every product
 * goes through the backend's matmul slot with a descriptor built here (gemm.c);
 * transposed operands are handed over as strided views (the GEMM reads either
 * layout), so no transpose is ever copied. The operand helpers are shared with the
 * dense layer (dense.c). */
#include "ops_internal.h"

#include <string.h>

/* ------------------------------------------------------------ operands */

/* True when the last two dims of t (rows, cols) can go to the backend GEMM as they are:
 * one dim has unit stride and the other's stride spans it (the CPU adapter's rule). */
bool anneal_ops_gemm_ok(const anneal_tensor *t) {
    int nd = t->ndim;
    int64_t rows = t->shape[nd - 2], cols = t->shape[nd - 1];
    int64_t sr = t->strides[nd - 2], sc = t->strides[nd - 1];
    if ((sc == 1 || cols == 1) && (rows == 1 || sr >= cols)) return true; /* row-major */
    if ((sr == 1 || rows == 1) && (cols == 1 || sc >= rows)) return true; /* column-major */
    return false;
}

/* t itself when the GEMM can read it, otherwise a contiguous copy (no autograd). */
anneal_tensor *anneal_ops_gemm_operand(anneal_tensor *t) {
    if (!t) return NULL;
    return anneal_ops_gemm_ok(t) ? t : anneal_ops_contiguous_raw(t);
}

/* View of t (ndim >= 2) with its last two dims swapped: t^T without a copy. */
anneal_tensor *anneal_ops_mT(const anneal_tensor *t) {
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
int64_t anneal_ops_prod(const int64_t *shape, int n) {
    int64_t p = 1;
    for (int i = 0; i < n; i++) p *= shape[i];
    return p;
}

/* When all leading dims of t (ndim >= 1) merge into one evenly strided row dim, writes
 * the row stride and returns true: t is then a (rows, cols) matrix without a copy. */
bool anneal_ops_rows_stride(const anneal_tensor *t, int64_t *rs) {
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
anneal_tensor *anneal_ops_flat_operand(anneal_tensor *t) {
    if (!t) return NULL;
    int nd = t->ndim;
    int64_t rows = anneal_ops_prod(t->shape, nd - 1), cols = t->shape[nd - 1], rs;
    if (anneal_ops_rows_stride(t, &rs)) {
        int64_t shape[2] = {rows, cols}, strides[2] = {rs, t->strides[nd - 1]};
        anneal_tensor *v = anneal_alias(t, 2, shape, strides, t->offset);
        if (!v || anneal_ops_gemm_ok(v)) return v;
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
                                 anneal_tensor *left, anneal_tensor *right, const anneal_edge *e,
                                 anneal_dtype compute) {
    if (!left || !right) return NULL;
    int64_t shape[ANNEAL_MAX_DIMS];
    memcpy(shape, batch, sizeof(int64_t) * (size_t)nb);
    shape[nb] = left->shape[left->ndim - 2];
    shape[nb + 1] = right->shape[right->ndim - 1];
    anneal_tensor *full = anneal_empty_on(left->device, ANNEAL_F32, nb + 2, shape);
    if (!full || anneal_ops_gemm_nd("matmul", be, full, left, right, 1.0f, 0.0f, compute) != ANNEAL_OK) return NULL;
    return anneal_ops_sum_to(full, e->ndim, e->shape);
}

/* dB = A^T @ dC as one GEMM when B is shared by every batch: A (batch.., M, K) and
 * dC (batch.., M, N) fold into (batch*M, K) and (batch*M, N) matrices, so the sum over
 * the batch happens inside the GEMM. NULL without error when they do not fold. */
static anneal_tensor *shared_rhs_grad(const anneal_backend *be, anneal_tensor *a,
                                      anneal_tensor *dc, const anneal_edge *eb, anneal_dtype compute) {
    int64_t ra, rc;
    if (anneal_ops_prod(a->shape, a->ndim - 2) != anneal_ops_prod(dc->shape, dc->ndim - 2)) return NULL;
    if (!anneal_ops_rows_stride(a, &ra) || !anneal_ops_rows_stride(dc, &rc)) return NULL;
    int64_t R = anneal_ops_prod(a->shape, a->ndim - 1), K = a->shape[a->ndim - 1],
            N = dc->shape[dc->ndim - 1];
    int64_t sa[2] = {a->strides[a->ndim - 1], ra}, sc[2] = {rc, dc->strides[dc->ndim - 1]};
    anneal_tensor *at = anneal_alias(a, 2, (int64_t[]){K, R}, sa, a->offset);
    anneal_tensor *c2 = anneal_alias(dc, 2, (int64_t[]){R, N}, sc, dc->offset);
    if (!at || !c2 || !anneal_ops_gemm_ok(at) || !anneal_ops_gemm_ok(c2)) return NULL;
    anneal_tensor *db = anneal_empty_on(a->device, ANNEAL_F32, eb->ndim, eb->shape);
    anneal_tensor *db2 = db ? anneal_alias(db, 2, (int64_t[]){K, N}, (int64_t[]){N, 1}, 0) : NULL;
    if (!db2 || anneal_ops_gemm_nd("matmul", be, db2, at, c2, 1.0f, 0.0f, compute) != ANNEAL_OK) return NULL;
    return db;
}

/* dA = dC @ B^T and dB = A^T @ dC (transposes are views), each reduced over the batch
 * dims its operand was broadcast in, at the forward's compute precision. Saved: a, b
 * (as handed to the GEMM); ints[0]: compute. */
static anneal_status matmul_backward(anneal_node *node, anneal_tensor *const *gout,
                                     anneal_tensor **gin) {
    anneal_tensor *a = node->saved[0], *b = node->saved[1];
    anneal_tensor *dc = anneal_ops_gemm_operand(gout[0]);
    const anneal_backend *be = dc ? anneal_backend_get(dc->device) : NULL;
    if (!be) return anneal_last_status();
    const anneal_edge *ea = &node->inputs[0], *eb = &node->inputs[1];
    int nb = dc->ndim - 2;
    anneal_dtype cd = (anneal_dtype)node->ints[0];
    if (ea->needs_grad) gin[0] = product_to(be, nb, dc->shape, dc, anneal_ops_mT(b), ea, cd);
    if (eb->needs_grad) {
        anneal_tensor *db = NULL;
        if (nb > 0 && anneal_ops_prod(b->shape, b->ndim - 2) == 1 && anneal_ops_prod(dc->shape, nb) > 1)
            db = shared_rhs_grad(be, a, dc, eb, cd);
        gin[1] = db ? db : product_to(be, nb, dc->shape, anneal_ops_mT(a), dc, eb, cd);
    }
    return anneal_last_status();
}

anneal_tensor *anneal_matmul_ex(anneal_tensor *a, anneal_tensor *b, anneal_dtype compute) {
    anneal_tensor *in[2] = {a, b};
    const anneal_backend *be = anneal_ops_backend("matmul", 2, in);
    if (!be) return NULL;
    if (!anneal_ops_require_f32("matmul", "a", a) || !anneal_ops_require_f32("matmul", "b", b) ||
        !anneal_ops_check_compute("matmul", compute))
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
    anneal_tensor *ac = anneal_ops_gemm_operand(a), *bc = anneal_ops_gemm_operand(b);
    anneal_status s = (ac && bc) ? anneal_ops_gemm_nd("matmul", be, out, ac, bc, 1.0f, 0.0f, compute)
                                 : anneal_last_status();
    if (s == ANNEAL_OK) {
        anneal_node *node = anneal_record("matmul", matmul_backward, 2, in, 1, &out);
        if (node) {
            node->ints[0] = compute;
            anneal_node_save(node, ac);
            anneal_node_save(node, bc);
        }
    }
    anneal_scope_leave();
    anneal_scope_free(tmp);
    return s == ANNEAL_OK ? out : NULL;
}


anneal_tensor *anneal_matmul(anneal_tensor *a, anneal_tensor *b) { return anneal_matmul_ex(a, b, ANNEAL_F32); }
