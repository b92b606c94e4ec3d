/* Helpers shared by the op families: argument checks that record clear errors,
 * backend lookup, broadcasting and reducing a gradient back to an input's shape. */
#ifndef ANNEAL_OPS_INTERNAL_H
#define ANNEAL_OPS_INTERNAL_H

#include "anneal/autograd.h"
#include "anneal/backend.h"
#include "anneal/ops.h"
#include "anneal/trace.h"

/* Backend for the inputs of op `name` (all non-NULL inputs on one device), or NULL:
 * silently when an input is NULL (an earlier error), with an error otherwise. */
const anneal_backend *anneal_ops_backend(const char *name, int n, anneal_tensor *const *inputs);
/* True when t is f32; records ANNEAL_ERR_DTYPE naming op and argument otherwise. */
bool anneal_ops_require_f32(const char *op, const char *arg, const anneal_tensor *t);
/* True when t's dtype is i32; records ANNEAL_ERR_DTYPE otherwise. */
bool anneal_ops_require_i32(const char *op, const char *arg, const anneal_tensor *t);
/* Normalises a possibly negative dim for a rank-ndim tensor; -1 + error if out of range. */
int anneal_ops_dim(const char *op, int dim, int ndim);
/* NumPy broadcast of two shapes into out (ndim written); false + ANNEAL_ERR_SHAPE if incompatible. */
bool anneal_ops_broadcast_shape(const char *op, const anneal_tensor *a, const anneal_tensor *b,
                                int *ndim, int64_t *shape);
/* View of t expanded to (ndim, shape) with stride 0 in broadcast dims (no autograd). */
anneal_tensor *anneal_ops_expand(const anneal_tensor *t, int ndim, const int64_t *shape);
/* Sums gradient g (broadcast shape) down to (ndim, shape) (no autograd). */
anneal_tensor *anneal_ops_sum_to(const anneal_tensor *g, int ndim, const int64_t *shape);
/* A contiguous version of t without recording autograd (t itself if contiguous). */
anneal_tensor *anneal_ops_contiguous_raw(anneal_tensor *t);
/* True when be has a kernel for q (anneal_backend_supports); otherwise records
 * ANNEAL_ERR_UNSUPPORTED naming op, the device and what was asked. */
bool anneal_ops_supported(const char *op, const anneal_backend *be, const anneal_op_query *q);
/* anneal_ops_supported for a kernel without a descriptor, on tensors of dtype dt. */
bool anneal_ops_kernel(const char *op, const anneal_backend *be, anneal_op_kind kind, anneal_dtype dt);
/* Checks that every element of the contiguous i32 tensor ids is in [0, n) or, when
 * has_ignore, ignore_index (the backend's check_index: the error names op, `what`, the
 * value and its position). When count_out is given it gets a new I64 0-dim tensor on
 * ids' device holding the elements that are not ignored. */
anneal_status anneal_ops_check_index(const char *op, const char *what, const anneal_backend *be,
                                     const anneal_tensor *ids, int64_t n, bool has_ignore,
                                     int32_t ignore_index, anneal_tensor **count_out);
/* A matrix of rows x cols with strides (s_row, s_col) as a GEMM reads it: untransposed
 * with row stride ld, or transposed (stored cols x rows) with ld; false when neither
 * dim has unit stride. */
bool anneal_ops_gemm_layout(int64_t rows, int64_t cols, int64_t s_row, int64_t s_col, bool *trans, int64_t *ld);
/* c (M, N) (contiguous rows) = a (M, K) @ b (K, N), 2-D views with a unit stride in one
 * dim, as one product at `compute` with the epilogue fields of epi (epilogue, bias,
 * aux_in, aux_out, bsum; NULL: none). Asks the backend first (ANNEAL_ERR_UNSUPPORTED
 * naming op when it declines). */
anneal_status anneal_ops_gemm_2d(const char *op, const anneal_backend *be, anneal_tensor *c, const anneal_tensor *a,
                                 const anneal_tensor *b, const anneal_matmul_desc *epi, anneal_dtype compute);
/* c (batch.., M, N) contiguous = alpha * a @ b + beta * c over the last two dims, a and b
 * broadcast over c's batch dims (stride 0 where broadcast): folded into one product,
 * one batched product, or one product per batch element (see gemm.c). */
anneal_status anneal_ops_gemm_nd(const char *op, const anneal_backend *be, anneal_tensor *c, const anneal_tensor *a,
                                 const anneal_tensor *b, float alpha, float beta, anneal_dtype compute);
/* GEMM operand helpers (matmul.c). True when the last two dims of t can go to the GEMM
 * as they are (one has unit stride, the other's stride spans it). */
bool anneal_ops_gemm_ok(const anneal_tensor *t);
/* t itself when the GEMM can read it, otherwise a contiguous copy (no autograd). */
anneal_tensor *anneal_ops_gemm_operand(anneal_tensor *t);
/* View of t (ndim >= 2) with its last two dims swapped: t^T without a copy. */
anneal_tensor *anneal_ops_mT(const anneal_tensor *t);
/* Product of the sizes of dims [0, n). */
int64_t anneal_ops_prod(const int64_t *shape, int n);
/* True when the leading dims of t merge into one evenly strided row dim (stride in *rs). */
bool anneal_ops_rows_stride(const anneal_tensor *t, int64_t *rs);
/* t (..., cols) as a 2-D (rows, cols) matrix the GEMM can read: a view when the leading
 * dims merge, else a contiguous copy. */
anneal_tensor *anneal_ops_flat_operand(anneal_tensor *t);
/* RoPE helpers (rope.c). True when r is a valid description for heads of size D;
 * otherwise ANNEAL_ERR_ARG / SHAPE naming op. */
bool anneal_ops_rope_check(const char *op, const anneal_rope_desc *r, int64_t D);
/* Stores r in node->scalars[s0..s0+3] and node->ints[i0..i0+1]; load reads it back. */
void anneal_ops_rope_save(anneal_node *node, int s0, int i0, const anneal_rope_desc *r);
anneal_rope_desc anneal_ops_rope_load(const anneal_node *node, int s0, int i0);
/* Rotates x (B, H, T, D; unit last stride) in place on the backend's rope slot (row t at
 * position pos0 + t; inverse: by the negative angle), after asking the backend. */
anneal_status anneal_ops_rope_apply(const char *op, const anneal_backend *be, anneal_tensor *x,
                                    const anneal_rope_desc *r, int64_t pos0, bool inverse);
/* A fresh contiguous copy of x (4-D), rotated (row t at position pos0 + t). */
anneal_tensor *anneal_ops_rope_copy(const char *op, const anneal_backend *be, const anneal_tensor *x,
                                    const anneal_rope_desc *r, int64_t pos0);
/* True for ANNEAL_F32, BF16, F16 (0 is F32); else ANNEAL_ERR_ARG naming op. */
bool anneal_ops_check_compute(const char *op, anneal_dtype compute);
/* New contiguous f32 tensor with t's shape on t's device. */
anneal_tensor *anneal_ops_new_like(const anneal_tensor *t);
/* True when t's elements fill a gap-free block with no overlap (a permutation of a
 * contiguous layout, e.g. the (B, T, H, D) storage seen as (B, H, T, D)). */
bool anneal_ops_dense_layout(const anneal_tensor *t);
/* A new uninitialised tensor of dtype dt with t's shape and t's strides (t must be
 * anneal_ops_dense_layout), in the current scope: a buffer addressed as t is. */
anneal_tensor *anneal_ops_empty_with_strides(const anneal_tensor *t, anneal_dtype dt);

/* ---- saved activations in bf16 (saved_bf16.c) ---- */

/* True when an op computing at `compute` may save activation t as its bf16 copy: bf16
 * compute on the CPU (whose products round operands to bf16 exactly as the copy does),
 * f32 t, grad mode on, and the test switch on. */
bool anneal_ops_bf16_save_ok(const anneal_tensor *t, anneal_dtype compute);
/* t rounded to bf16 (nearest even) in t's layout when dense, else contiguous; current scope. */
anneal_tensor *anneal_ops_bf16_save_copy(const anneal_backend *be, anneal_tensor *t);
/* A saved tensor as f32: t itself when f32, else widened (exact) in its layout. */
anneal_tensor *anneal_ops_saved_f32(const anneal_backend *be, anneal_tensor *t);
/* Test switch: false makes every op save f32 as before (default true). */
void anneal_ops_bf16_saves_set(bool on);
/* Test switch for dense.c's gelu_source: false saves the input of a dense layer after a
 * GELU one as before (default true); and its state. */
void anneal_ops_gelu_resave_set(bool on);
bool anneal_ops_gelu_resave_on(void);

/* ---- profiler spans around backend kernels (include/anneal/trace.h) ---- */

/* Records the op span begun at *t0 (0: not recording) with its work, restarts *t0 at
 * now (so chained kernels on one line measure each their own time) and passes the
 * kernel's status through. */
static inline anneal_status anneal_ops_span_end(const char *name, int64_t *t0, double flops, double bytes,
                                                anneal_status s) {
    if (*t0) {
        anneal_span_record(ANNEAL_SPAN_OP, name, *t0, flops, bytes);
        *t0 = anneal_trace_now_ns();
    }
    return s;
}
/* FLOPs of a matmul: 2 * batch * M * N * K. */
static inline double anneal_ops_matmul_flops(const anneal_matmul_desc *d) {
    return anneal_trace_enabled() ? 2.0 * (double)(d->batch > 0 ? d->batch : 1) * (double)d->M * (double)d->N * (double)d->K : 0;
}
/* FLOPs of attention: QK^T and PV, 4 * B * Hq * Tq * Tk * D forward (halved when
 * causal), 2.5x that backward (dV, dP, dS->dQ, dK and the recomputed P). */
static inline double anneal_ops_attention_flops(anneal_attention_desc d, bool backward) {
    if (!anneal_trace_enabled()) return 0;
    double f = 4.0 * (double)d.B * (double)d.Hq * (double)d.Tq * (double)d.Tk * (double)d.D;
    if (d.causal) f *= 0.5;
    return backward ? 2.5 * f : f;
}
/* Bytes a memory-bound kernel moves, estimated as reading and writing a tensor of
 * t's size (2 * numel * element size). */
static inline double anneal_ops_span_bytes(const anneal_tensor *t) {
    return anneal_trace_enabled() && t ? 2.0 * (double)anneal_numel(t) * (double)anneal_dtype_size(t->dtype) : 0;
}

#endif
