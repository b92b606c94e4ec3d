/* The CPU backend table: adapts tensor arguments (shapes, strides) to the raw
 * kernels of cpu_kernels.h and registers itself with core. */
#include "cpu_backend.h"
#include "cpu_kernels.h"
#include "fused.h"

#include <stdlib.h>
#include <string.h>

static void *cpu_alloc(size_t n) {
    size_t rounded = (n + 63) & ~(size_t)63;
    return aligned_alloc(64, rounded ? rounded : 64);
}

static void cpu_free(void *p) { free(p); }

static anneal_status cpu_memcpy(void *dst, const void *src, size_t n) {
    if (n) memcpy(dst, src, n);
    return ANNEAL_OK;
}

/* How a 2-D operand (rows x cols with strides) is handed to GEMM: untransposed
 * with row stride ld, or transposed (stored cols x rows) with ld. */
static bool gemm_operand(int64_t rows, int64_t cols, int64_t s_row, int64_t s_col, bool *trans,
                         int64_t *ld) {
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

/* c (M, N) = a @ b (2-D) with the epilogue ep (bias on C, or B's column sums). */
static anneal_status cpu_matmul_2d(anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b,
                                   const anneal_gemm_epilogue *ep, anneal_dtype compute) {
    int64_t M = c->shape[0], N = c->shape[1], K = a->shape[1];
    bool ta, tb;
    int64_t lda, ldb;
    if (!gemm_operand(M, K, a->strides[0], a->strides[1], &ta, &lda) ||
        !gemm_operand(K, N, b->strides[0], b->strides[1], &tb, &ldb))
        return anneal_set_error(ANNEAL_ERR_ARG, "matmul operand needs a unit stride in its last two dims");
    anneal_cpu_gemm((int)compute, ta, tb, M, N, K, 1.0f, anneal_data(a), lda, anneal_data(b), ldb,
                    0.0f, anneal_data(c), N > 0 ? N : 1, ep);
    return ANNEAL_OK;
}

/* c = a @ b + bias, the bias in the GEMM's epilogue (see the backend slot). */
static anneal_status cpu_matmul_bias(anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b,
                                     const anneal_tensor *bias, anneal_dtype compute) {
    anneal_gemm_epilogue ep = {.bias = anneal_data(bias)};
    return cpu_matmul_2d(c, a, b, &ep, compute);
}

/* c = a @ b and bsum = column sums of b, taken while packing b (see the backend slot). */
static anneal_status cpu_matmul_bsum(anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b,
                                     anneal_tensor *bsum, anneal_dtype compute) {
    anneal_gemm_epilogue ep = {.b_colsum = anneal_data(bsum)};
    return cpu_matmul_2d(c, a, b, &ep, compute);
}

static anneal_status cpu_matmul(anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b,
                                float alpha, float beta, anneal_dtype compute) {
    int nd = c->ndim;
    int64_t M = c->shape[nd - 2], N = c->shape[nd - 1], K = a->shape[a->ndim - 1];
    bool ta, tb;
    int64_t lda, ldb;
    if (!gemm_operand(M, K, a->strides[a->ndim - 2], a->strides[a->ndim - 1], &ta, &lda) ||
        !gemm_operand(K, N, b->strides[b->ndim - 2], b->strides[b->ndim - 1], &tb, &ldb))
        return anneal_set_error(ANNEAL_ERR_ARG, "matmul operand needs a unit stride in its last two dims");
    const float *pa = anneal_data(a), *pb = anneal_data(b);
    float *pc = anneal_data(c);
    /* Batch dims of c (contiguous); a and b are broadcast to them (aligned from the right). */
    int nb = nd - 2;
    int64_t batch = 1, sa[ANNEAL_MAX_DIMS] = {0}, sb[ANNEAL_MAX_DIMS] = {0};
    for (int d = 0; d < nb; d++) {
        batch *= c->shape[d];
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim);
        sa[d] = (da >= 0 && a->shape[da] != 1) ? a->strides[da] : 0;
        sb[d] = (db >= 0 && b->shape[db] != 1) ? b->strides[db] : 0;
    }
    if (batch == 0 || M == 0 || N == 0) return ANNEAL_OK;
    /* x (batch.., M, K) @ w (K, N): fold the batch into M when a's rows are evenly strided. */
    bool b_shared = true, a_foldable = !ta;
    int64_t expect = M * lda;
    for (int d = nb - 1; d >= 0; d--) {
        if (sb[d] != 0) b_shared = false;
        if (c->shape[d] != 1 && sa[d] != expect) a_foldable = false;
        expect *= c->shape[d];
    }
    if (b_shared && a_foldable && (M == 1 ? lda >= K : true)) {
        anneal_cpu_gemm(compute, false, tb, batch * M, N, K, alpha, pa, lda, pb, ldb, beta, pc, N, NULL);
        return ANNEAL_OK;
    }
    /* One uniform stride per operand across the flattened batch -> batched call. */
    int64_t ua = 0, ub = 0;
    bool uniform = true;
    {
        int64_t ea = -1, eb = -1, span = 1;
        for (int d = nb - 1; d >= 0; d--) {
            if (c->shape[d] != 1) {
                if (ea < 0) { ua = sa[d]; ub = sb[d]; ea = sa[d] * c->shape[d]; eb = sb[d] * c->shape[d]; }
                else {
                    if (sa[d] != ea || sb[d] != eb) uniform = false;
                    ea = sa[d] * c->shape[d];
                    eb = sb[d] * c->shape[d];
                }
            }
            span *= c->shape[d];
        }
        (void)span;
    }
    if (uniform) {
        anneal_cpu_gemm_batched(compute, batch, ta, tb, M, N, K, alpha, pa, lda, ua, pb, ldb, ub, beta,
                                pc, N, M * N);
        return ANNEAL_OK;
    }
    for (int64_t i = 0; i < batch; i++) {
        int64_t oa = 0, ob = 0, r = i;
        for (int d = nb - 1; d >= 0; d--) {
            int64_t idx = r % c->shape[d];
            r /= c->shape[d];
            oa += idx * sa[d];
            ob += idx * sb[d];
        }
        anneal_cpu_gemm(compute, ta, tb, M, N, K, alpha, pa + oa, lda, pb + ob, ldb, beta, pc + i * M * N, N,
                        NULL);
    }
    return ANNEAL_OK;
}

/* Rows of the last dim: (N, C) view of a contiguous tensor. */
static void rows_cols(const anneal_tensor *x, int64_t *N, int64_t *C) {
    *C = x->ndim ? x->shape[x->ndim - 1] : 1;
    *N = *C ? anneal_numel(x) / *C : 0;
}

#define F(t) ((float *)((t) ? anneal_data(t) : NULL))

static anneal_status cpu_layer_norm_fwd(anneal_tensor *y, anneal_tensor *mean, anneal_tensor *rstd,
                                        const anneal_tensor *x, const anneal_tensor *w,
                                        const anneal_tensor *b, float eps) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_layer_norm_fwd(N, C, F(x), F(w), F(b), eps, F(y), F(mean), F(rstd));
    return ANNEAL_OK;
}

static anneal_status cpu_layer_norm_bwd(anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                        const anneal_tensor *x, const anneal_tensor *w,
                                        const anneal_tensor *mean, const anneal_tensor *rstd,
                                        const anneal_tensor *dy) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_layer_norm_bwd(N, C, F(x), F(w), F(mean), F(rstd), F(dy), F(dx), F(dw), F(db));
    return ANNEAL_OK;
}

static anneal_status cpu_rms_norm_fwd(anneal_tensor *y, anneal_tensor *rstd, const anneal_tensor *x,
                                      const anneal_tensor *w, float eps) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_rms_norm_fwd(N, C, F(x), F(w), eps, F(y), F(rstd));
    return ANNEAL_OK;
}

static anneal_status cpu_rms_norm_bwd(anneal_tensor *dx, anneal_tensor *dw, const anneal_tensor *x,
                                      const anneal_tensor *w, const anneal_tensor *rstd,
                                      const anneal_tensor *dy) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_rms_norm_bwd(N, C, F(x), F(w), F(rstd), F(dy), F(dx), F(dw));
    return ANNEAL_OK;
}

static anneal_status cpu_softmax_fwd(anneal_tensor *y, const anneal_tensor *x, bool log) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_softmax_fwd(N, C, F(x), F(y), log);
    return ANNEAL_OK;
}

static anneal_status cpu_softmax_bwd(anneal_tensor *dx, const anneal_tensor *y,
                                     const anneal_tensor *dy, bool log) {
    int64_t N, C;
    rows_cols(y, &N, &C);
    anneal_cpu_softmax_bwd(N, C, F(y), F(dy), F(dx), log);
    return ANNEAL_OK;
}

static void attn_desc(anneal_cpu_attn_desc *d, const anneal_tensor *q, const anneal_tensor *k,
                      const anneal_tensor *v, const anneal_tensor *o, bool causal, float scale) {
    d->B = q->shape[0];
    d->H = q->shape[1];
    d->Tq = q->shape[2];
    d->Tk = k->shape[2];
    d->D = q->shape[3];
    d->q_sb = q->strides[0]; d->q_sh = q->strides[1]; d->q_st = q->strides[2];
    d->k_sb = k->strides[0]; d->k_sh = k->strides[1]; d->k_st = k->strides[2];
    d->v_sb = v->strides[0]; d->v_sh = v->strides[1]; d->v_st = v->strides[2];
    d->o_sb = o->strides[0]; d->o_sh = o->strides[1]; d->o_st = o->strides[2];
    d->scale = scale;
    d->causal = causal;
}

static anneal_status cpu_attention_fwd(anneal_tensor *o, anneal_tensor *lse, const anneal_tensor *q,
                                       const anneal_tensor *k, const anneal_tensor *v, bool causal,
                                       float scale, anneal_dtype compute) {
    anneal_cpu_attn_desc d;
    attn_desc(&d, q, k, v, o, causal, scale);
    anneal_cpu_attention_fwd(&d, F(q), F(k), F(v), F(o), F(lse), (int)compute);
    return ANNEAL_OK;
}

static anneal_status cpu_attention_bwd(anneal_tensor *dq, anneal_tensor *dk, anneal_tensor *dv,
                                       const anneal_tensor *q, const anneal_tensor *k,
                                       const anneal_tensor *v, const anneal_tensor *o,
                                       const anneal_tensor *dout, const anneal_tensor *lse,
                                       bool causal, float scale, anneal_dtype compute) {
    anneal_cpu_attn_desc d;
    attn_desc(&d, q, k, v, o, causal, scale);
    anneal_cpu_attention_bwd(&d, F(q), F(k), F(v), F(o), F(dout), F(lse), F(dq), F(dk), F(dv),
                             (int)compute);
    return ANNEAL_OK;
}

static anneal_status cpu_embedding_fwd(anneal_tensor *y, const anneal_tensor *ids,
                                       const anneal_tensor *w) {
    anneal_cpu_embedding_fwd(anneal_numel(ids), w->shape[1], anneal_data(ids), F(w), F(y));
    return ANNEAL_OK;
}

static anneal_status cpu_embedding_bwd(anneal_tensor *dw, const anneal_tensor *ids,
                                       const anneal_tensor *dy) {
    anneal_cpu_embedding_bwd(anneal_numel(ids), dw->shape[1], dw->shape[0], anneal_data(ids), F(dy),
                             F(dw));
    return ANNEAL_OK;
}

static anneal_status cpu_cross_entropy_fwd(anneal_tensor *loss, anneal_tensor *lse,
                                           const anneal_tensor *logits, const anneal_tensor *targets,
                                           int32_t ignore_index) {
    int64_t N, V;
    rows_cols(logits, &N, &V);
    anneal_cpu_cross_entropy_fwd(N, V, F(logits), anneal_data(targets), ignore_index, F(loss), F(lse));
    return ANNEAL_OK;
}

static anneal_status cpu_cross_entropy_bwd(anneal_tensor *dlogits, const anneal_tensor *logits,
                                           const anneal_tensor *targets, const anneal_tensor *lse,
                                           int32_t ignore_index, float scale) {
    int64_t N, V;
    rows_cols(logits, &N, &V);
    anneal_cpu_cross_entropy_bwd(N, V, F(logits), anneal_data(targets), ignore_index, F(lse), scale,
                                 F(dlogits));
    return ANNEAL_OK;
}

static anneal_status cpu_adamw(anneal_tensor *p, const anneal_tensor *g, anneal_tensor *m,
                               anneal_tensor *v, double lr, double beta1, double beta2, double eps,
                               double weight_decay, double bc1, double bc2) {
    anneal_cpu_adamw(anneal_numel(p), F(p), F(g), F(m), F(v), lr, beta1, beta2, eps, weight_decay,
                     bc1, bc2);
    return ANNEAL_OK;
}

static anneal_status cpu_adamw_multi(const anneal_adamw_group *groups, int n, double lr,
                                     double beta1, double beta2, double eps) {
    anneal_cpu_adamw_multi(groups, n, lr, beta1, beta2, eps);
    return ANNEAL_OK;
}

static anneal_status cpu_sum_squares(const anneal_tensor *x, double *out) {
    *out = anneal_cpu_sum_squares(anneal_numel(x), F(x));
    return ANNEAL_OK;
}

#undef F

static const anneal_backend k_cpu_backend = {
    .name = "cpu",
    .device = ANNEAL_CPU,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .to_host = cpu_memcpy,
    .from_host = cpu_memcpy,
    .copy = anneal_cpu_copy,
    .fill = anneal_cpu_fill,
    .binary = anneal_cpu_binary,
    .unary = anneal_cpu_unary,
    .unary_bwd = anneal_cpu_unary_bwd,
    .reduce_sum = anneal_cpu_reduce_sum,
    .matmul = cpu_matmul,
    .layer_norm_fwd = cpu_layer_norm_fwd,
    .layer_norm_bwd = cpu_layer_norm_bwd,
    .rms_norm_fwd = cpu_rms_norm_fwd,
    .rms_norm_bwd = cpu_rms_norm_bwd,
    .softmax_fwd = cpu_softmax_fwd,
    .softmax_bwd = cpu_softmax_bwd,
    .attention_fwd = cpu_attention_fwd,
    .attention_bwd = cpu_attention_bwd,
    .embedding_fwd = cpu_embedding_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .cross_entropy_fwd = cpu_cross_entropy_fwd,
    .cross_entropy_bwd = cpu_cross_entropy_bwd,
    .dropout_fwd = anneal_cpu_dropout_fwd,
    .dropout_bwd = anneal_cpu_dropout_bwd,
    .randn = anneal_cpu_randn,
    .adamw = cpu_adamw,
    .adamw_multi = cpu_adamw_multi,
    .sum_squares = cpu_sum_squares,
    .dense_gelu_fwd = anneal_cpu_dense_gelu_fwd,
    .matmul_bias = cpu_matmul_bias,
    .matmul_bsum = cpu_matmul_bsum,
    .add_layer_norm_fwd = anneal_cpu_add_layer_norm_fwd,
    .add_layer_norm_bwd = anneal_cpu_add_layer_norm_bwd,
    .linear_cross_entropy = anneal_cpu_linear_cross_entropy,
};

void anneal_cpu_backend_init(void) { anneal_backend_register(&k_cpu_backend); }
