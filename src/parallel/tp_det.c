/* Tensor parallelism under --deterministic: the column- and row-parallel projections
 * computed in canonical chunks, so one process and every --tp layout add the same
 * floats in the same order.
 *
 * A projection's split dimension (the output columns of a column-parallel one, the
 * input rows of a row-parallel one) is cut into G equal chunks, G the same in every
 * layout (the model passes its heads: a rank of a group of N holds G/N consecutive
 * chunks, one process all G). Every GEMM runs per chunk, with the same shapes on every
 * layout: the chunk's columns (or rows) of the weight and of the activations are
 * copied into contiguous tensors first. What a single GEMM summed across chunks:
 *
 * - the row-parallel forward, y = sum_j x_j W_j: one (rows, out) partial per chunk,
 *   added in the fixed pairwise tree of anneal_det_combine_blocks over the G chunks:
 *   one process locally; under N ranks with G/N a power of two each rank sums its
 *   complete subtree and the N sums go through anneal_det_allreduce (a butterfly for
 *   N = 2^k: log2 N exchanges of one partial, about Megatron's all-reduce), otherwise
 *   the ranks all-gather their G/N partials each (G/N x the bytes) and every rank adds
 *   the G of them;
 * - the column-parallel backward, dX = sum_j dY_j W_j^T (Megatron's f): the same, per
 *   chunk partials gathered and tree-summed, so dX is replicated over the group.
 *
 * The column-parallel forward (each output column one dot product over the whole
 * input), the row-parallel backward's dX (each chunk's columns its own), and the
 * weight and bias gradients (sums over the rows, per chunk) need no communication.
 * The ops replace f and g (copy_in, reduce_out) on the deterministic path. A NULL
 * group is a group of one (the single-process run). */
#include "tp_det.h"

#include "anneal/custom_op.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A call's parameters. */
typedef struct det_params {
    anneal_comm *c;              /* the group, or NULL: one process */
    int chunks;                  /* this rank's chunks (G / N) */
    int parts;                   /* column-parallel: segments of the output ([q | k | v]: 3) */
    anneal_weight_layout layout; /* of the weight */
    anneal_dtype compute;
} det_params;

static int group_size(const det_params *p) { return p->c ? anneal_comm_size(p->c) : 1; }

/* Rows and last dimension of a contiguous tensor. */
static void rows_cols(const anneal_tensor *t, int64_t *rows, int64_t *cols) {
    *cols = t->ndim ? t->shape[t->ndim - 1] : 1;
    *rows = *cols ? anneal_numel(t) / *cols : 0;
}

/* dst (rows, parts * w) contiguous <- or -> the columns {q * stride + off + [0, w)} of
 * src (rows, n) for q < parts; to_dst false copies the other way. */
static void move_cols(float *dst, float *src, int64_t rows, int64_t n, int parts, int64_t stride, int64_t off,
                      int64_t w, bool to_dst) {
    int64_t dw = parts * w;
    for (int64_t i = 0; i < rows; i++)
        for (int q = 0; q < parts; q++) {
            float *d = dst + i * dw + q * w, *s = src + i * n + q * stride + off;
            if (to_dst) memcpy(d, s, (size_t)w * sizeof(float));
            else memcpy(s, d, (size_t)w * sizeof(float));
        }
}

/* A fresh contiguous f32 (r, c) tensor. */
static anneal_tensor *mat(int64_t r, int64_t c) { return anneal_empty(ANNEAL_F32, 2, (int64_t[]){r, c}); }

/* The chunk's slice of a weight along its split dimension: IN_OUT (in, out) has the
 * outputs as columns, OUT_IN (out, in) as rows. out_dim: the split runs along the
 * output dimension (column-parallel) or the input one (row-parallel). Returns a
 * contiguous copy (or, from_t, writes t back into w's slice). */
static anneal_tensor *weight_slice(float *w, const anneal_tensor *wt, const det_params *p, bool out_dim, int64_t stride,
                                   int64_t off, int64_t width, int parts, anneal_tensor *from_t) {
    int64_t r = wt->shape[0], c = wt->shape[1];
    bool along_cols = (p->layout == ANNEAL_WEIGHT_IN_OUT) == out_dim;
    anneal_tensor *t = from_t;
    if (along_cols) {
        if (!t && !(t = mat(r, parts * width))) return NULL;
        move_cols(anneal_data(t), w, r, c, parts, stride, off, width, !from_t);
    } else { /* rows: a block of whole rows per part */
        if (!t && !(t = mat(parts * width, c))) return NULL;
        for (int q = 0; q < parts; q++) {
            float *s = w + (q * stride + off) * c, *d = (float *)anneal_data(t) + q * width * c;
            if (from_t) memcpy(s, d, (size_t)(width * c) * sizeof(float));
            else memcpy(d, s, (size_t)(width * c) * sizeof(float));
        }
    }
    return t;
}

/* The other layout (dense with the transposed weight). */
static anneal_weight_layout flip(anneal_weight_layout l) {
    return l == ANNEAL_WEIGHT_IN_OUT ? ANNEAL_WEIGHT_OUT_IN : ANNEAL_WEIGHT_IN_OUT;
}

/* Out features and in features of a 2-D weight in p's layout. */
static void weight_dims(const anneal_tensor *w, const det_params *p, int64_t *out, int64_t *in) {
    bool io = p->layout == ANNEAL_WEIGHT_IN_OUT;
    *in = w->shape[io ? 0 : 1];
    *out = w->shape[io ? 1 : 0];
}

/* blocks: this rank's `chunks` partials of n floats; the tree sum of all G of the
 * group's partials (rank r holds chunks r G/N ..) into out. When G/N is a power of two
 * the rank's partials are one complete subtree: summed here, then the N sums combined
 * by anneal_det_allreduce in the tree over them (the same additions as the tree over
 * the G leaves, det_reduce.c); otherwise every partial is all-gathered. */
static anneal_status gather_tree(const det_params *p, float *blocks, int64_t n, float *out, const char *name) {
    int size = group_size(p), G = p->chunks * size;
    if ((p->chunks & (p->chunks - 1)) == 0) {
        anneal_det_combine_blocks(blocks, p->chunks, n);
        anneal_status st = size > 1 ? anneal_det_allreduce(p->c, blocks, n) : ANNEAL_OK;
        if (st == ANNEAL_OK) memcpy(out, blocks, (size_t)n * sizeof(float));
        return st;
    }
    float *all = blocks;
    if (size > 1) {
        all = malloc((size_t)G * (size_t)n * sizeof(float));
        if (!all) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory for %d partials", name, G);
        anneal_status st = anneal_comm_all_gather(p->c, blocks, all, (int64_t)p->chunks * n, ANNEAL_F32);
        if (st != ANNEAL_OK) {
            free(all);
            return st;
        }
    }
    anneal_det_combine_blocks(all, G, n);
    memcpy(out, all, (size_t)n * sizeof(float));
    if (all != blocks) free(all);
    return ANNEAL_OK;
}

/* ----------------------------------------------------- column-parallel */

/* y (..., out) of x (..., in), weight, bias (out) or none. */
static anneal_status col_shape(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_custom_out_spec *out) {
    const det_params *p = c->params;
    const anneal_tensor *x = in[0], *w = in[1];
    int64_t no = 0, ni = 0;
    if (w->ndim == 2) weight_dims(w, p, &no, &ni);
    if (x->dtype != ANNEAL_F32 || w->dtype != ANNEAL_F32 || w->ndim != 2 || x->ndim < 1 ||
        x->shape[x->ndim - 1] != ni || p->chunks < 1 || p->parts < 1 || no % ((int64_t)p->chunks * p->parts) ||
        (c->n_inputs > 2 && (in[2]->dtype != ANNEAL_F32 || anneal_numel(in[2]) != no)))
        return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: f32 x (..., in), weight (in, out) or (out, in) whose out splits "
                                "into %d x %d chunks, bias (out)", c->name, p->parts, p->chunks);
    out[0].dtype = ANNEAL_F32;
    out[0].ndim = x->ndim;
    memcpy(out[0].shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    out[0].shape[x->ndim - 1] = no;
    return ANNEAL_OK;
}

static anneal_status col_fwd(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    const det_params *p = c->params;
    int64_t R, K, N, ni;
    rows_cols(in[0], &R, &K);
    weight_dims(in[1], p, &N, &ni);
    int64_t seg = N / p->parts, w = seg / p->chunks, cw = p->parts * w;
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_alias(in[0], 2, (int64_t[]){R, K}, (int64_t[]){K, 1}, in[0]->offset);
    anneal_status st = x ? ANNEAL_OK : anneal_last_status();
    anneal_dense_opts o = {.layout = p->layout, .compute = p->compute};
    for (int j = 0; j < p->chunks && st == ANNEAL_OK; j++) {
        anneal_tensor *wj = weight_slice(anneal_data(in[1]), in[1], p, true, seg, j * w, w, p->parts, NULL);
        anneal_tensor *bj = NULL;
        if (c->n_inputs > 2 && (bj = anneal_empty(ANNEAL_F32, 1, &cw)))
            move_cols(anneal_data(bj), anneal_data(in[2]), 1, N, p->parts, seg, j * w, w, true);
        anneal_tensor *yj = anneal_contiguous(anneal_dense(x, wj, bj, &o));
        if (!yj) st = anneal_last_status();
        else move_cols(anneal_data(yj), anneal_data(out[0]), R, N, p->parts, seg, j * w, w, false);
    }
    anneal_scope_close(s);
    return st;
}

static anneal_status col_bwd(const anneal_custom_ctx *c, anneal_tensor *const *gin, const anneal_tensor *const *in,
                             const anneal_tensor *const *out, const anneal_tensor *const *gout) {
    (void)out;
    const det_params *p = c->params;
    int64_t R, K, N, ni;
    rows_cols(in[0], &R, &K);
    weight_dims(in[1], p, &N, &ni);
    int64_t seg = N / p->parts, w = seg / p->chunks, cw = p->parts * w;
    bool io = p->layout == ANNEAL_WEIGHT_IN_OUT;
    float *parts_dx = gin[0] ? malloc((size_t)p->chunks * (size_t)(R * K) * sizeof(float)) : NULL;
    if (gin[0] && !parts_dx) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", c->name);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_alias(in[0], 2, (int64_t[]){R, K}, (int64_t[]){K, 1}, in[0]->offset);
    anneal_tensor *dy = mat(R, cw);
    anneal_status st = x && dy ? ANNEAL_OK : anneal_last_status();
    for (int j = 0; j < p->chunks && st == ANNEAL_OK; j++) {
        if (gout[0]) move_cols(anneal_data(dy), anneal_data(gout[0]), R, N, p->parts, seg, j * w, w, true);
        else memset(anneal_data(dy), 0, (size_t)(R * cw) * sizeof(float));
        anneal_scope *sj = anneal_scope_open();
        if (gin[0]) { /* this chunk's part of dX: dY_j W_j^T */
            anneal_tensor *wj = weight_slice(anneal_data(in[1]), in[1], p, true, seg, j * w, w, p->parts, NULL);
            anneal_dense_opts o = {.layout = flip(p->layout), .compute = p->compute};
            anneal_tensor *dx = anneal_contiguous(anneal_dense(dy, wj, NULL, &o));
            if (!dx) st = anneal_last_status();
            else memcpy(parts_dx + (size_t)j * (size_t)(R * K), anneal_data(dx), (size_t)(R * K) * sizeof(float));
        }
        if (gin[1] && st == ANNEAL_OK) { /* dW_j: x^T dY_j (in, cw) or dY_j^T x (cw, in) */
            anneal_tensor *dw = anneal_contiguous(io ? anneal_matmul(anneal_transpose(x, 0, 1), dy)
                                                     : anneal_matmul(anneal_transpose(dy, 0, 1), x));
            if (!dw) st = anneal_last_status();
            else weight_slice(anneal_data(gin[1]), in[1], p, true, seg, j * w, w, p->parts, dw);
        }
        if (c->n_inputs > 2 && gin[2] && st == ANNEAL_OK) { /* db_j: column sums in row order */
            const float *d = anneal_data(dy);
            anneal_tensor *db = anneal_empty(ANNEAL_F32, 1, &cw);
            float *col = db ? anneal_data(db) : NULL;
            if (!col) st = anneal_last_status();
            for (int64_t k = 0; k < cw && col; k++) {
                double a = 0;
                for (int64_t i = 0; i < R; i++) a += d[i * cw + k];
                col[k] = (float)a;
            }
            if (col) move_cols(col, anneal_data(gin[2]), 1, N, p->parts, seg, j * w, w, false);
        }
        anneal_scope_close(sj);
    }
    anneal_scope_close(s);
    if (gin[0] && st == ANNEAL_OK) st = gather_tree(p, parts_dx, R * K, anneal_data(gin[0]), c->name);
    free(parts_dx);
    return st;
}

/* -------------------------------------------------------- row-parallel */

/* y (..., out) of x (..., in) (this rank's input columns) and weight. */
static anneal_status row_shape(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_custom_out_spec *out) {
    const det_params *p = c->params;
    const anneal_tensor *x = in[0], *w = in[1];
    int64_t no = 0, ni = 0;
    if (w->ndim == 2) weight_dims(w, p, &no, &ni);
    if (x->dtype != ANNEAL_F32 || w->dtype != ANNEAL_F32 || w->ndim != 2 || x->ndim < 1 ||
        x->shape[x->ndim - 1] != ni || p->chunks < 1 || ni % p->chunks)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: f32 x (..., in), weight (in, out) or (out, in) whose in splits "
                                "into %d chunks", c->name, p->chunks);
    out[0].dtype = ANNEAL_F32;
    out[0].ndim = x->ndim;
    memcpy(out[0].shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    out[0].shape[x->ndim - 1] = no;
    return ANNEAL_OK;
}

static anneal_status row_fwd(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    const det_params *p = c->params;
    int64_t R, K, N, ni;
    rows_cols(in[0], &R, &K);
    weight_dims(in[1], p, &N, &ni);
    int64_t w = K / p->chunks;
    float *partial = malloc((size_t)p->chunks * (size_t)(R * N) * sizeof(float));
    if (!partial) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", c->name);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *xj = mat(R, w);
    anneal_status st = xj ? ANNEAL_OK : anneal_last_status();
    anneal_dense_opts o = {.layout = p->layout, .compute = p->compute};
    for (int j = 0; j < p->chunks && st == ANNEAL_OK; j++) {
        move_cols(anneal_data(xj), anneal_data(in[0]), R, K, 1, 0, j * w, w, true);
        anneal_scope *sj = anneal_scope_open();
        anneal_tensor *wj = weight_slice(anneal_data(in[1]), in[1], p, false, 0, j * w, w, 1, NULL);
        anneal_tensor *y = anneal_contiguous(anneal_dense(xj, wj, NULL, &o));
        if (!y) st = anneal_last_status();
        else memcpy(partial + (size_t)j * (size_t)(R * N), anneal_data(y), (size_t)(R * N) * sizeof(float));
        anneal_scope_close(sj);
    }
    anneal_scope_close(s);
    if (st == ANNEAL_OK) st = gather_tree(p, partial, R * N, anneal_data(out[0]), c->name);
    free(partial);
    return st;
}

static anneal_status row_bwd(const anneal_custom_ctx *c, anneal_tensor *const *gin, const anneal_tensor *const *in,
                             const anneal_tensor *const *out, const anneal_tensor *const *gout) {
    (void)out;
    const det_params *p = c->params;
    int64_t R, K, N, ni;
    rows_cols(in[0], &R, &K);
    weight_dims(in[1], p, &N, &ni);
    int64_t w = K / p->chunks;
    bool io = p->layout == ANNEAL_WEIGHT_IN_OUT;
    if (!gout[0]) { /* no gradient reached y: zeros */
        if (gin[0]) memset(anneal_data(gin[0]), 0, (size_t)anneal_numel(gin[0]) * sizeof(float));
        if (gin[1]) memset(anneal_data(gin[1]), 0, (size_t)anneal_numel(gin[1]) * sizeof(float));
        return ANNEAL_OK;
    }
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *dy = anneal_alias(gout[0], 2, (int64_t[]){R, N}, (int64_t[]){N, 1}, gout[0]->offset);
    anneal_tensor *xj = mat(R, w);
    anneal_status st = dy && xj ? ANNEAL_OK : anneal_last_status();
    for (int j = 0; j < p->chunks && st == ANNEAL_OK; j++) {
        anneal_scope *sj = anneal_scope_open();
        anneal_tensor *wj = weight_slice(anneal_data(in[1]), in[1], p, false, 0, j * w, w, 1, NULL);
        if (gin[0]) { /* dX_j = dY W_j^T: chunk j's columns */
            anneal_dense_opts o = {.layout = flip(p->layout), .compute = p->compute};
            anneal_tensor *dx = anneal_contiguous(anneal_dense(dy, wj, NULL, &o));
            if (!dx) st = anneal_last_status();
            else move_cols(anneal_data(dx), anneal_data(gin[0]), R, K, 1, 0, j * w, w, false);
        }
        if (gin[1] && st == ANNEAL_OK) { /* dW_j: x_j^T dY (w, out) or dY^T x_j (out, w) */
            move_cols(anneal_data(xj), anneal_data(in[0]), R, K, 1, 0, j * w, w, true);
            anneal_tensor *dw = anneal_contiguous(io ? anneal_matmul(anneal_transpose(xj, 0, 1), dy)
                                                     : anneal_matmul(anneal_transpose(dy, 0, 1), xj));
            if (!dw) st = anneal_last_status();
            else weight_slice(anneal_data(gin[1]), in[1], p, false, 0, j * w, w, 1, dw);
        }
        anneal_scope_close(sj);
    }
    anneal_scope_close(s);
    return st;
}

/* -------------------------------------------------------------- calls */

/* The op registered as name (on first use). */
static const anneal_custom_op *det_op(const char *name, int n_inputs, anneal_custom_shape_fn shape,
                                      anneal_custom_forward_fn fwd, anneal_custom_backward_fn bwd) {
    const anneal_custom_op *op = anneal_custom_op_find(name);
    if (op) return op;
    anneal_custom_op_def d = {.version = ANNEAL_CUSTOM_OP_VERSION, .name = name, .n_inputs = n_inputs, .n_outputs = 1,
                              .param_size = sizeof(det_params), .shape = shape,
                              .differentiable = (1u << n_inputs) - 1, .save_inputs = 0x3};
    d.kernels[ANNEAL_CPU] = (anneal_custom_kernel){fwd, bwd, NULL};
    if (anneal_custom_op_register(&d, &op) != ANNEAL_OK && !(op = anneal_custom_op_find(name))) return NULL;
    anneal_clear_error();
    return op;
}

/* Contiguous f32 CPU 2-D weight (a bf16 frozen one is not taken). */
static bool check_args(const char *what, anneal_tensor *x, anneal_tensor *w) {
    if (!x || !w) return false;
    if (x->device != ANNEAL_CPU || w->device != ANNEAL_CPU || x->dtype != ANNEAL_F32 || w->dtype != ANNEAL_F32) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: f32 CPU tensors only (--deterministic runs on the CPU)", what);
        return false;
    }
    return true;
}

anneal_tensor *anneal_tp_det_col(anneal_comm *c, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                                 anneal_weight_layout layout, int parts, int chunks, anneal_dtype compute) {
    if (!check_args("anneal_tp_det_col", x, w)) return NULL;
    const anneal_custom_op *op = b ? det_op("anneal_tp_det_col_bias", 3, col_shape, col_fwd, col_bwd)
                                   : det_op("anneal_tp_det_col", 2, col_shape, col_fwd, col_bwd);
    det_params p = {c, chunks, parts, layout, compute};
    anneal_tensor *in[3] = {x, w, b};
    return op ? anneal_custom_op_call(op, in, &p) : NULL;
}

anneal_tensor *anneal_tp_det_row(anneal_comm *c, anneal_tensor *x, anneal_tensor *w, anneal_weight_layout layout,
                                 int chunks, anneal_dtype compute) {
    if (!check_args("anneal_tp_det_row", x, w)) return NULL;
    const anneal_custom_op *op = det_op("anneal_tp_det_row", 2, row_shape, row_fwd, row_bwd);
    det_params p = {c, chunks, 1, layout, compute};
    anneal_tensor *in[2] = {x, w};
    return op ? anneal_custom_op_call(op, in, &p) : NULL;
}

/* The nn table's entries: user is the group (NULL: one process). */
anneal_tensor *anneal_tp_det_nn_col(void *user, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                                    anneal_weight_layout layout, int parts, int chunks, anneal_dtype compute) {
    return anneal_tp_det_col(user, x, w, b, layout, parts, chunks, compute);
}
anneal_tensor *anneal_tp_det_nn_row(void *user, anneal_tensor *x, anneal_tensor *w, anneal_weight_layout layout,
                                    int chunks, anneal_dtype compute) {
    return anneal_tp_det_row(user, x, w, layout, chunks, compute);
}

const anneal_nn_tp *anneal_tp_nn_single(void) {
    static const anneal_nn_tp single = {.rank = 0, .size = 1, .det_col = anneal_tp_det_nn_col,
                                        .det_row = anneal_tp_det_nn_row, .user = NULL};
    return &single;
}
