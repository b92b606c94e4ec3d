/* Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) over a communicator group: the
 * two autograd ops that join the column- and row-parallel halves of a block, and the
 * slicing and gathering of parameters between the whole layout and a rank's shard.
 *
 * f (anneal_tp_copy_in) is the identity forward and the sum of the gradient over the
 * group backward: it stands before a column-parallel projection, whose input is
 * replicated and whose input gradient each rank only knows its heads' part of. g
 * (anneal_tp_reduce_out) is the sum over the group forward and the identity backward:
 * it stands after a row-parallel projection, whose partial products add up to the
 * output. Both are custom ops (custom_op.h) over f32 CPU tensors; their collectives are
 * the group's all-reduce, so every rank of the group must run the same ops in the same
 * order (the same model on the same batch does).
 *
 * A sharded parameter is split along one dimension (the one whose size differs between
 * the whole and the shard), in `parts` equal segments each split over the ranks: GPT-2's
 * packed c_attn (C, 3C) = [q | k | v] is 3 parts, so rank r holds columns r of each of
 * q, k and v. A parameter of the same shape in both is replicated.
 *
 * The vocabulary split (Megatron's vocab-parallel embedding and cross-entropy): rank r
 * holds rows [lo, lo + V/N) of the token embedding. The lookup takes the ids in its
 * range (the others give zeros) and sums over the group (g); the loss takes this rank's
 * V/N columns of the logits, the row maxima and the sums of exp over the group and the
 * target's logit from the rank that holds it, so the (rows, V) logits are never
 * gathered; its backward is local: softmax minus the one-hot target, over this rank's
 * columns. */
#include "anneal/custom_op.h"
#include "anneal/parallel.h"
#include "tp_det.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct anneal_tp {
    anneal_comm *c;
    anneal_nn_tp nn;
};

/* The call's parameter block: the group. */
typedef struct tp_params {
    anneal_comm *c;
} tp_params;

/* Output 0 of the input's shape; f32 only (the activations of a CPU run). */
static anneal_status same_shape(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_custom_out_spec *out) {
    if (in[0]->dtype != ANNEAL_F32)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: takes f32 tensors, got %s", c->name,
                                anneal_dtype_name(in[0]->dtype));
    out[0].dtype = ANNEAL_F32;
    out[0].ndim = in[0]->ndim;
    memcpy(out[0].shape, in[0]->shape, sizeof(int64_t) * (size_t)in[0]->ndim);
    return ANNEAL_OK;
}

/* dst = src (or zeros when src is NULL), then the sum over the group when reduce. */
static anneal_status copy_sum(const anneal_custom_ctx *c, anneal_tensor *dst, const anneal_tensor *src, bool reduce) {
    int64_t n = anneal_numel(dst);
    if (src) memcpy(anneal_data(dst), anneal_data(src), (size_t)n * sizeof(float));
    else memset(anneal_data(dst), 0, (size_t)n * sizeof(float));
    if (!reduce) return ANNEAL_OK;
    const tp_params *p = c->params;
    return anneal_comm_allreduce(p->c, anneal_data(dst), n, ANNEAL_F32, ANNEAL_REDUCE_SUM);
}

static anneal_status f_fwd(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    return copy_sum(c, out[0], in[0], false);
}
static anneal_status f_bwd(const anneal_custom_ctx *c, anneal_tensor *const *gin, const anneal_tensor *const *in,
                           const anneal_tensor *const *out, const anneal_tensor *const *gout) {
    (void)in, (void)out;
    return gin[0] ? copy_sum(c, gin[0], gout[0], true) : ANNEAL_OK;
}
static anneal_status g_fwd(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    return copy_sum(c, out[0], in[0], true);
}
static anneal_status g_bwd(const anneal_custom_ctx *c, anneal_tensor *const *gin, const anneal_tensor *const *in,
                           const anneal_tensor *const *out, const anneal_tensor *const *gout) {
    (void)in, (void)out;
    return gin[0] ? copy_sum(c, gin[0], gout[0], false) : ANNEAL_OK;
}

/* The op registered as name (registered on first use). */
static const anneal_custom_op *op_get(const char *name, bool reduce_forward) {
    const anneal_custom_op *op = anneal_custom_op_find(name);
    if (op) return op;
    anneal_custom_op_def d = {.version = ANNEAL_CUSTOM_OP_VERSION, .name = name, .n_inputs = 1, .n_outputs = 1,
                              .param_size = sizeof(tp_params), .shape = same_shape, .differentiable = 0x1};
    d.kernels[ANNEAL_CPU] = reduce_forward ? (anneal_custom_kernel){g_fwd, g_bwd, NULL}
                                           : (anneal_custom_kernel){f_fwd, f_bwd, NULL};
    if (anneal_custom_op_register(&d, &op) != ANNEAL_OK) return anneal_custom_op_find(name); /* a race: taken */
    return op;
}

/* Runs op on x over group c. */
static anneal_tensor *apply(const char *name, bool reduce_forward, anneal_comm *c, anneal_tensor *x) {
    if (!x) return NULL;
    if (!c) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL group", name);
        return NULL;
    }
    const anneal_custom_op *op = op_get(name, reduce_forward);
    tp_params p = {c};
    return op ? anneal_custom_op_call(op, &x, &p) : NULL;
}

anneal_tensor *anneal_tp_copy_in(anneal_comm *c, anneal_tensor *x) { return apply("anneal_tp_copy_in", false, c, x); }
anneal_tensor *anneal_tp_reduce_out(anneal_comm *c, anneal_tensor *x) {
    return apply("anneal_tp_reduce_out", true, c, x);
}

/* ------------------------------------------------ the vocabulary split */

anneal_tensor *anneal_tp_vocab_embedding(anneal_comm *c, anneal_tensor *weight, anneal_tensor *ids, int64_t lo) {
    if (!c || !weight || !ids) {
        if (!c) anneal_set_error(ANNEAL_ERR_ARG, "tp vocab embedding: NULL group");
        return NULL;
    }
    if (ids->dtype != ANNEAL_I32 || ids->device != ANNEAL_CPU || !anneal_is_contiguous(ids) || weight->ndim != 2 ||
        ids->ndim >= ANNEAL_MAX_DIMS) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "tp vocab embedding: contiguous i32 CPU ids and a 2-D weight");
        return NULL;
    }
    /* ids of this rank's rows as local row numbers, the others as row 0 masked out */
    int64_t rows = weight->shape[0], n = anneal_numel(ids);
    int64_t mshape[ANNEAL_MAX_DIMS];
    memcpy(mshape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
    mshape[ids->ndim] = 1;
    anneal_tensor *local = anneal_empty(ANNEAL_I32, ids->ndim, ids->shape);
    anneal_tensor *mask = anneal_empty(ANNEAL_F32, ids->ndim + 1, mshape);
    if (!local || !mask) return NULL;
    const int32_t *id = anneal_data(ids);
    int32_t *li = anneal_data(local);
    float *mk = anneal_data(mask);
    for (int64_t i = 0; i < n; i++) {
        bool mine = id[i] >= lo && id[i] < lo + rows;
        li[i] = mine ? (int32_t)(id[i] - lo) : 0;
        mk[i] = mine ? 1.0f : 0.0f;
    }
    return anneal_tp_reduce_out(c, anneal_mul(anneal_embedding(local, weight), mask));
}

/* The vocabulary-parallel cross-entropy's parameters. */
typedef struct vce_params {
    anneal_comm *c;
    int64_t lo, vocab; /* this rank's first column, the whole vocabulary */
    int32_t ignore;
} vce_params;

/* (loss 0-dim, logsumexp per row) of logits (..., Vl) and targets (...). */
static anneal_status vce_shape(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_custom_out_spec *out) {
    const anneal_tensor *l = in[0], *t = in[1];
    if (l->dtype != ANNEAL_F32 || t->dtype != ANNEAL_I32 || l->ndim < 1 ||
        anneal_numel(t) * l->shape[l->ndim - 1] != anneal_numel(l))
        return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: f32 logits (..., V/N) and i32 targets (...) of their rows", c->name);
    out[0].dtype = out[1].dtype = ANNEAL_F32;
    out[0].ndim = 0;
    out[1].ndim = 1;
    out[1].shape[0] = anneal_numel(t);
    return ANNEAL_OK;
}

/* Rows (R) and this rank's columns (Vl) of the logits. */
static void vce_dims(const anneal_tensor *l, int64_t *R, int64_t *Vl) {
    *Vl = l->shape[l->ndim - 1];
    *R = anneal_numel(l) / *Vl;
}

static anneal_status vce_fwd(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    const vce_params *p = c->params;
    int64_t R, Vl;
    vce_dims(in[0], &R, &Vl);
    const float *l = anneal_data(in[0]);
    const int32_t *tg = anneal_data(in[1]);
    float *lse = anneal_data(out[1]);
    int size = anneal_comm_size(p->c);
    for (int64_t i = 0; i < R; i++)
        if (tg[i] != p->ignore && (tg[i] < 0 || tg[i] >= p->vocab))
            return anneal_set_error(ANNEAL_ERR_ARG, "%s: target %d at row %lld is outside [0, %lld)", c->name, (int)tg[i],
                                    (long long)i, (long long)p->vocab);
    /* the row maxima over the group (gathered: the communicator sums only), then the
     * sums of exp and the target's logit from the rank that holds it */
    float *mx = malloc((size_t)R * sizeof *mx), *all = malloc((size_t)R * (size_t)size * sizeof *all);
    float *sums = malloc((size_t)R * 2 * sizeof *sums);
    anneal_status st = mx && all && sums ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", c->name);
    for (int64_t i = 0; i < R && st == ANNEAL_OK; i++) {
        float m = -INFINITY;
        for (int64_t j = 0; j < Vl; j++) m = l[i * Vl + j] > m ? l[i * Vl + j] : m;
        mx[i] = m;
    }
    if (st == ANNEAL_OK) st = anneal_comm_all_gather(p->c, mx, all, R, ANNEAL_F32);
    for (int64_t i = 0; i < R && st == ANNEAL_OK; i++) {
        float m = all[i];
        for (int r = 1; r < size; r++) m = all[(size_t)r * (size_t)R + (size_t)i] > m ? all[(size_t)r * (size_t)R + (size_t)i] : m;
        mx[i] = m;
        double s = 0;
        for (int64_t j = 0; j < Vl; j++) s += exp((double)l[i * Vl + j] - m);
        sums[2 * i] = (float)s;
        int64_t k = (int64_t)tg[i] - p->lo;
        sums[2 * i + 1] = tg[i] != p->ignore && k >= 0 && k < Vl ? l[i * Vl + k] : 0.0f;
    }
    if (st == ANNEAL_OK) st = anneal_comm_allreduce(p->c, sums, 2 * R, ANNEAL_F32, ANNEAL_REDUCE_SUM);
    double total = 0;
    int64_t valid = 0;
    for (int64_t i = 0; i < R && st == ANNEAL_OK; i++) {
        lse[i] = mx[i] + logf(sums[2 * i]);
        if (tg[i] == p->ignore) continue;
        total += (double)lse[i] - sums[2 * i + 1];
        valid++;
    }
    if (st == ANNEAL_OK) *(float *)anneal_data(out[0]) = valid ? (float)(total / (double)valid) : 0.0f;
    free(mx);
    free(all);
    free(sums);
    return st;
}

static anneal_status vce_bwd(const anneal_custom_ctx *c, anneal_tensor *const *gin, const anneal_tensor *const *in,
                             const anneal_tensor *const *out, const anneal_tensor *const *gout) {
    const vce_params *p = c->params;
    if (!gin[0]) return ANNEAL_OK;
    int64_t R, Vl;
    vce_dims(in[0], &R, &Vl);
    const float *l = anneal_data(in[0]), *lse = anneal_data(out[1]);
    const int32_t *tg = anneal_data(in[1]);
    float *d = anneal_data(gin[0]);
    int64_t valid = 0;
    for (int64_t i = 0; i < R; i++) valid += tg[i] != p->ignore;
    float g = gout[0] && valid ? *(const float *)anneal_data(gout[0]) / (float)valid : 0.0f;
    for (int64_t i = 0; i < R; i++) {
        bool skip = tg[i] == p->ignore || g == 0.0f;
        int64_t k = skip ? -1 : (int64_t)tg[i] - p->lo;
        for (int64_t j = 0; j < Vl; j++)
            d[i * Vl + j] = skip ? 0.0f : g * (expf(l[i * Vl + j] - lse[i]) - (j == k ? 1.0f : 0.0f));
    }
    return ANNEAL_OK;
}

anneal_tensor *anneal_tp_vocab_cross_entropy(anneal_comm *c, anneal_tensor *logits, anneal_tensor *targets, int64_t lo,
                                             int32_t ignore_index) {
    if (!logits || !targets) return NULL;
    if (!c) {
        anneal_set_error(ANNEAL_ERR_ARG, "tp vocab cross-entropy: NULL group");
        return NULL;
    }
    const char *name = "anneal_tp_vocab_cross_entropy";
    const anneal_custom_op *op = anneal_custom_op_find(name);
    if (!op) {
        anneal_custom_op_def d = {.version = ANNEAL_CUSTOM_OP_VERSION, .name = name, .n_inputs = 2, .n_outputs = 2,
                                  .param_size = sizeof(vce_params), .shape = vce_shape, .differentiable = 0x1,
                                  .save_inputs = 0x3, .save_outputs = 0x2};
        d.kernels[ANNEAL_CPU] = (anneal_custom_kernel){vce_fwd, vce_bwd, NULL};
        if (anneal_custom_op_register(&d, &op) != ANNEAL_OK && !(op = anneal_custom_op_find(name))) return NULL;
        anneal_clear_error();
    }
    vce_params p = {c, lo, logits->shape[logits->ndim - 1] * anneal_comm_size(c), ignore_index};
    anneal_tensor *in[2] = {logits, targets};
    return anneal_custom_op_call(op, in, &p);
}

anneal_tensor *anneal_tp_vocab_gather(anneal_comm *c, anneal_tensor *logits) {
    if (!c || !logits) {
        if (!c) anneal_set_error(ANNEAL_ERR_ARG, "tp vocab gather: NULL group");
        return NULL;
    }
    if (logits->dtype != ANNEAL_F32 || logits->device != ANNEAL_CPU || logits->ndim < 1) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "tp vocab gather: f32 CPU logits");
        return NULL;
    }
    const int N = anneal_comm_size(c);
    const int64_t Vl = logits->shape[logits->ndim - 1], rows = Vl > 0 ? anneal_numel(logits) / Vl : 0;
    int64_t shape[ANNEAL_MAX_DIMS];
    memcpy(shape, logits->shape, sizeof(int64_t) * (size_t)logits->ndim);
    shape[logits->ndim - 1] = Vl * N;
    anneal_tensor *src = anneal_contiguous(anneal_detach(logits));
    anneal_tensor *out = anneal_empty(ANNEAL_F32, logits->ndim, shape);
    float *all = src && out ? malloc((size_t)(rows * Vl * N) * sizeof *all) : NULL;
    if (!all) {
        if (src && out) anneal_set_error(ANNEAL_ERR_OOM, "tp vocab gather: out of memory");
        return NULL;
    }
    anneal_status st = anneal_comm_all_gather(c, anneal_data(src), all, rows * Vl, ANNEAL_F32);
    if (st == ANNEAL_OK) { /* rank r's block (rows, V/N) into columns r V/N.. of every row */
        float *o = anneal_data(out);
        for (int r = 0; r < N; r++)
            for (int64_t i = 0; i < rows; i++)
                memcpy(o + i * Vl * N + r * Vl, all + ((int64_t)r * rows + i) * Vl, (size_t)Vl * sizeof *o);
    }
    free(all);
    return st == ANNEAL_OK ? out : NULL;
}

static anneal_tensor *nn_vocab_gather(void *user, anneal_tensor *logits) { return anneal_tp_vocab_gather(user, logits); }
static anneal_tensor *nn_copy_in(void *user, anneal_tensor *x) { return anneal_tp_copy_in(user, x); }
static anneal_tensor *nn_reduce_out(void *user, anneal_tensor *x) { return anneal_tp_reduce_out(user, x); }
static anneal_tensor *nn_vocab_embed(void *user, anneal_tensor *w, anneal_tensor *ids, int64_t lo) {
    return anneal_tp_vocab_embedding(user, w, ids, lo);
}
static anneal_tensor *nn_vocab_loss(void *user, anneal_tensor *logits, anneal_tensor *targets, int64_t lo,
                                    int32_t ignore_index) {
    return anneal_tp_vocab_cross_entropy(user, logits, targets, lo, ignore_index);
}

anneal_tp *anneal_tp_new(anneal_comm *group) {
    if (!group) {
        anneal_set_error(ANNEAL_ERR_ARG, "tensor parallelism: NULL group");
        return NULL;
    }
    anneal_tp *tp = calloc(1, sizeof *tp);
    if (!tp) {
        anneal_set_error(ANNEAL_ERR_OOM, "tensor parallelism: out of memory");
        return NULL;
    }
    tp->c = group;
    tp->nn = (anneal_nn_tp){.rank = anneal_comm_rank(group), .size = anneal_comm_size(group), .copy_in = nn_copy_in,
                            .reduce_out = nn_reduce_out, .vocab_embed = nn_vocab_embed,
                            .vocab_loss = nn_vocab_loss, .vocab_gather = nn_vocab_gather, .user = group,
                            .det_col = anneal_tp_det_nn_col,
                            .det_row = anneal_tp_det_nn_row};
    return tp;
}

void anneal_tp_free(anneal_tp *tp) { free(tp); }
const anneal_nn_tp *anneal_tp_nn(const anneal_tp *tp) { return tp ? &tp->nn : NULL; }
anneal_comm *anneal_tp_comm(const anneal_tp *tp) { return tp ? tp->c : NULL; }

/* True when the last component of name before ".weight"/".bias" is `what`. */
static bool is_component(const char *name, const char *what) {
    const char *dot = strrchr(name, '.');
    if (!dot) return false;
    size_t n = strlen(what);
    return (size_t)(dot - name) >= n + 1 && dot[-(long)n - 1] == '.' && !strncmp(dot - n, what, n);
}

anneal_status anneal_tp_split_of(const char *name, const anneal_tensor *full, const anneal_tensor *local, int size,
                                 anneal_tp_split *out) {
    *out = (anneal_tp_split){.dim = -1, .parts = 1};
    if (!full || !local || full->ndim != local->ndim)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "tensor parallelism: %s has another rank in the shard", name);
    for (int d = 0; d < full->ndim; d++) {
        if (full->shape[d] == local->shape[d]) continue;
        if (out->dim >= 0 || local->shape[d] * size != full->shape[d])
            return anneal_set_error(ANNEAL_ERR_SHAPE, "tensor parallelism: %s of %lld along dim %d is no 1/%d shard of "
                                    "%lld", name, (long long)local->shape[d], d, size, (long long)full->shape[d]);
        out->dim = d;
    }
    /* GPT-2's packed projection: [q | k | v] along its output dimension */
    if (out->dim >= 0 && is_component(name, "c_attn")) out->parts = 3;
    if (out->dim >= 0 && local->shape[out->dim] % out->parts)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "tensor parallelism: %s does not split into %d parts", name,
                                out->parts);
    return ANNEAL_OK;
}

/* (outer, length along dim, inner) of a contiguous tensor. */
static void dims3(const anneal_tensor *t, int dim, int64_t *outer, int64_t *len, int64_t *inner) {
    *outer = *inner = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (d < dim) *outer *= t->shape[d];
        else if (d > dim) *inner *= t->shape[d];
    }
    *len = t->shape[dim];
}

/* Copies between rank r's shard data (sh) and the whole (wh): to_whole says which way. */
static void move_shard(float *wh, const anneal_tensor *whole, float *sh, const anneal_tensor *shard, anneal_tp_split sp,
                       int r, bool to_whole) {
    int64_t outer, lf, inner, ls;
    dims3(whole, sp.dim, &outer, &lf, &inner);
    ls = shard->shape[sp.dim];
    int64_t sf = lf / sp.parts, ss = ls / sp.parts;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t j = 0; j < ls; j++) {
            int64_t jf = (j / ss) * sf + (int64_t)r * ss + j % ss;
            float *w = wh + (o * lf + jf) * inner, *s = sh + (o * ls + j) * inner;
            if (to_whole) memcpy(w, s, (size_t)inner * sizeof(float));
            else memcpy(s, w, (size_t)inner * sizeof(float));
        }
}

/* f32 contiguous CPU, or an error naming what. */
static anneal_status check_f32(const anneal_tensor *t, const char *what) {
    if (!t || t->dtype != ANNEAL_F32 || t->device != ANNEAL_CPU || !anneal_is_contiguous(t))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "tensor parallelism: %s must be a contiguous f32 CPU tensor",
                                what);
    return ANNEAL_OK;
}

/* Between whole and rank's shard (to_whole: shard -> whole), after checking both are
 * f32 contiguous CPU tensors and that the shard fits: anneal_tp_slice and _place. */
static anneal_status copy_part(anneal_tensor *whole, anneal_tensor *shard, anneal_tp_split sp, int rank, bool to_whole) {
    anneal_status s = check_f32(whole, "the whole parameter");
    if (s == ANNEAL_OK) s = check_f32(shard, "the shard");
    if (s != ANNEAL_OK) return s;
    if (sp.dim < 0) {
        if (anneal_numel(whole) != anneal_numel(shard))
            return anneal_set_error(ANNEAL_ERR_SHAPE, "tensor parallelism: a replicated parameter changed size");
        if (to_whole) memcpy(anneal_data(whole), anneal_data(shard), (size_t)anneal_numel(shard) * sizeof(float));
        else memcpy(anneal_data(shard), anneal_data(whole), (size_t)anneal_numel(shard) * sizeof(float));
        return ANNEAL_OK;
    }
    bool ok = whole->ndim == shard->ndim && sp.dim < whole->ndim && sp.parts > 0 && shard->shape[sp.dim] > 0 &&
              whole->shape[sp.dim] % shard->shape[sp.dim] == 0 && shard->shape[sp.dim] % sp.parts == 0 && rank >= 0 &&
              rank < whole->shape[sp.dim] / shard->shape[sp.dim];
    for (int d = 0; ok && d < whole->ndim; d++) ok = d == sp.dim || whole->shape[d] == shard->shape[d];
    if (!ok) return anneal_set_error(ANNEAL_ERR_SHAPE, "tensor parallelism: shard %d does not fit the whole parameter", rank);
    move_shard(anneal_data(whole), whole, anneal_data(shard), shard, sp, rank, to_whole);
    return ANNEAL_OK;
}

anneal_status anneal_tp_slice(const anneal_tensor *whole, anneal_tensor *shard, anneal_tp_split sp, int rank) {
    return copy_part((anneal_tensor *)whole, shard, sp, rank, false);
}

anneal_status anneal_tp_place(const anneal_tensor *shard, anneal_tensor *whole, anneal_tp_split sp, int rank) {
    return copy_part(whole, (anneal_tensor *)shard, sp, rank, true);
}

anneal_status anneal_tp_gather(anneal_comm *c, const anneal_tensor *shard, anneal_tensor *whole, anneal_tp_split sp) {
    anneal_status s = check_f32(whole, "the whole parameter");
    if (s == ANNEAL_OK) s = check_f32(shard, "the shard");
    if (s != ANNEAL_OK) return s;
    int64_t n = anneal_numel(shard);
    if (sp.dim < 0) { /* replicated: every rank holds the same values */
        memcpy(anneal_data(whole), anneal_data(shard), (size_t)n * sizeof(float));
        return ANNEAL_OK;
    }
    int size = anneal_comm_size(c);
    float *all = malloc((size_t)n * (size_t)size * sizeof(float));
    if (!all) return anneal_set_error(ANNEAL_ERR_OOM, "tensor parallelism: out of memory gathering a parameter");
    s = anneal_comm_all_gather(c, anneal_data(shard), all, n, ANNEAL_F32);
    for (int r = 0; r < size && s == ANNEAL_OK; r++)
        move_shard(anneal_data(whole), whole, all + (size_t)r * (size_t)n, shard, sp, r, true);
    free(all);
    return s;
}
