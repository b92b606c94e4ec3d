/* Matrix-product descriptors: how ops hand strided tensors to the backend's one
 * matmul slot. A 2-D operand goes as it is when one of its dims has unit stride (the
 * GEMM reads either layout: a transposed view costs nothing); batch dims are folded
 * into the rows when the left operand's rows are evenly strided and the right one is
 * shared, else the product is one batched call when every operand has one stride per
 * batch step, else one call per batch element. Backends then only map descriptors to
 * kernels. */
#include "ops_internal.h"

#include <string.h>

bool anneal_ops_gemm_layout(int64_t rows, int64_t cols, int64_t s_row, int64_t s_col, bool *trans, int64_t *ld) {
    if ((s_col == 1 || cols == 1) && (rows == 1 || s_row >= cols)) {
        *trans = false;
        *ld = rows == 1 ? (cols > 0 ? cols : 1) : s_row;
        return true;
    }
    if ((s_row == 1 || rows == 1) && (cols == 1 || s_col >= rows)) {
        *trans = true;
        *ld = cols == 1 ? (rows > 0 ? rows : 1) : s_col;
        return true;
    }
    return false;
}

/* Calls be->matmul with d after asking the backend whether it has the kernel. */
static anneal_status run(const char *op, const anneal_backend *be, const anneal_matmul_desc *d, anneal_tensor *c,
                         const anneal_tensor *a, const anneal_tensor *b) {
    anneal_op_query q = {.kind = ANNEAL_OP_MATMUL, .dtype = ANNEAL_F32, .matmul = d};
    if (!anneal_ops_supported(op, be, &q)) return anneal_last_status();
    int64_t span_t0 = anneal_span_begin();
    return anneal_ops_span_end("matmul", &span_t0, anneal_ops_matmul_flops(d), 0, be->matmul(be->ctx, d, c, a, b));
}

static anneal_status layout_error(const char *op) {
    return anneal_set_error(ANNEAL_ERR_ARG, "%s: matmul operand needs a unit stride in its last two dims", op);
}

anneal_status anneal_ops_gemm_2d(const char *op, const anneal_backend *be, anneal_tensor *c, const anneal_tensor *a,
                                 const anneal_tensor *b, const anneal_matmul_desc *epi, anneal_dtype compute) {
    anneal_matmul_desc d = epi ? *epi : (anneal_matmul_desc){0};
    d.batch = 1;
    d.M = c->shape[0];
    d.N = c->shape[1];
    d.K = a->shape[1];
    if (!anneal_ops_gemm_layout(d.M, d.K, a->strides[0], a->strides[1], &d.trans_a, &d.lda) ||
        !anneal_ops_gemm_layout(d.K, d.N, b->strides[0], b->strides[1], &d.trans_b, &d.ldb))
        return layout_error(op);
    d.ldc = d.N > 0 ? d.N : 1;
    d.stride_a = d.stride_b = d.stride_c = 0;
    d.alpha = 1.0f;
    d.beta = 0.0f;
    d.compute = compute;
    return run(op, be, &d, c, a, b);
}

/* Matrix i of a batch (its M x K / K x N / M x N block at element offset off) as a
 * 2-D view for a single product. */
static anneal_tensor *matrix_at(const anneal_tensor *t, int64_t rows, int64_t cols, bool trans, int64_t ld,
                                int64_t off) {
    int64_t shape[2] = {trans ? cols : rows, trans ? rows : cols}, strides[2] = {ld, 1};
    return anneal_alias(t, 2, shape, strides, t->offset + off);
}

anneal_status anneal_ops_gemm_nd(const char *op, const anneal_backend *be, anneal_tensor *c, const anneal_tensor *a,
                                 const anneal_tensor *b, float alpha, float beta, anneal_dtype compute) {
    int nd = c->ndim;
    anneal_matmul_desc d = {.M = c->shape[nd - 2], .N = c->shape[nd - 1], .K = a->shape[a->ndim - 1],
                            .alpha = alpha, .beta = beta, .compute = compute};
    if (!anneal_ops_gemm_layout(d.M, d.K, a->strides[a->ndim - 2], a->strides[a->ndim - 1], &d.trans_a, &d.lda) ||
        !anneal_ops_gemm_layout(d.K, d.N, b->strides[b->ndim - 2], b->strides[b->ndim - 1], &d.trans_b, &d.ldb))
        return layout_error(op);
    d.ldc = d.N;
    /* Batch dims of c (contiguous); a and b are broadcast to them (aligned from the right). */
    int nb = nd - 2;
    int64_t batch = 1, sa[ANNEAL_MAX_DIMS] = {0}, sb[ANNEAL_MAX_DIMS] = {0};
    for (int i = 0; i < nb; i++) {
        batch *= c->shape[i];
        int ia = i - (nd - a->ndim), ib = i - (nd - b->ndim);
        sa[i] = (ia >= 0 && a->shape[ia] != 1) ? a->strides[ia] : 0;
        sb[i] = (ib >= 0 && b->shape[ib] != 1) ? b->strides[ib] : 0;
    }
    if (batch == 0 || d.M == 0 || d.N == 0) return ANNEAL_OK;
    /* x (batch.., M, K) @ w (K, N): fold the batch into M when a's rows are evenly strided. */
    bool b_shared = true, a_foldable = !d.trans_a;
    int64_t expect = d.M * d.lda;
    for (int i = nb - 1; i >= 0; i--) {
        if (sb[i] != 0) b_shared = false;
        if (c->shape[i] != 1 && sa[i] != expect) a_foldable = false;
        expect *= c->shape[i];
    }
    if (b_shared && a_foldable && (d.M == 1 ? d.lda >= d.K : true)) {
        d.batch = 1;
        d.M *= batch;
        return run(op, be, &d, c, a, b);
    }
    /* One uniform stride per operand across the flattened batch: one batched call. */
    bool uniform = true, first = true;
    int64_t ea = 0, eb = 0;
    for (int i = nb - 1; i >= 0; i--) {
        if (c->shape[i] == 1) continue;
        if (first) {
            d.stride_a = sa[i];
            d.stride_b = sb[i];
            first = false;
        } else if (sa[i] != ea || sb[i] != eb) {
            uniform = false;
        }
        ea = sa[i] * c->shape[i];
        eb = sb[i] * c->shape[i];
    }
    if (uniform) {
        d.batch = batch;
        d.stride_c = d.M * d.N;
        return run(op, be, &d, c, a, b);
    }
    /* Otherwise one product per batch element, on views of its matrices. */
    d.batch = 1;
    d.stride_a = d.stride_b = 0;
    anneal_status s = ANNEAL_OK;
    for (int64_t i = 0; i < batch && s == ANNEAL_OK; i++) {
        int64_t oa = 0, ob = 0, r = i;
        for (int k = nb - 1; k >= 0; k--) {
            int64_t idx = r % c->shape[k];
            r /= c->shape[k];
            oa += idx * sa[k];
            ob += idx * sb[k];
        }
        anneal_scope_enter(NULL);
        anneal_tensor *ai = matrix_at(a, d.M, d.K, d.trans_a, d.lda, oa);
        anneal_tensor *bi = matrix_at(b, d.K, d.N, d.trans_b, d.ldb, ob);
        anneal_tensor *ci = matrix_at(c, d.M, d.N, false, d.N, i * d.M * d.N);
        anneal_scope_leave();
        s = ai && bi && ci ? run(op, be, &d, ci, ai, bi) : anneal_last_status();
        anneal_release(ai);
        anneal_release(bi);
        anneal_release(ci);
    }
    return s;
}
