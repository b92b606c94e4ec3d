/* --tp N: tensor parallelism in the trainer. The world of W ranks is N-rank tensor-
 * parallel groups of consecutive ranks (0..N-1, N..2N-1, ...) times W/N data-parallel
 * replicas (ranks of one position in every group: 0, N, 2N, ...). A group shares each
 * block (its heads and MLP width split over the ranks, Megatron-LM's column/row-parallel
 * layers, src/models/gpt2.c with src/parallel/tp.c); the ranks of a group read the same
 * batches (the data is split over the replicas only); the gradient sync (DDP) runs over
 * the replica group, for this rank's shards.
 *
 * The weights start whole, never all at once: setup makes the whole model without
 * storage (pp_setup.c's anneal_train_tp_by_param; with --pp, with the stage's tensors),
 * then this file builds the rank's shard model and, a batch of tensors at a time (at
 * most 1/N of the model), fills the whole-width ones as one process would (the seeded
 * initialisation, --init or the resumed checkpoint), copies their slices (and of a
 * resumed optimizer state) into it and drops them. So initialisation and checkpoints
 * are those of a one-process run, and a checkpoint is layout-independent: rank 0 writes
 * the one-process files fetching each tensor's shards (and AdamW moments) from the
 * group in turn (tp_ckpt.c), and a resume slices whatever layout wrote it. The lm head
 * (tied to the token embedding), the embeddings, LayerNorms and the row-parallel biases
 * are replicated: their gradients are the same on every rank of a group. */
#include "train_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct train_tp {
    int size, rank;          /* the tensor-parallel group and this rank in it */
    int dp_size, dp_rank;    /* the data-parallel replicas and this rank's */
    anneal_comm *tp_comm, *dp_comm;
    anneal_tp *tp;
    anneal_tp_split *split;  /* per parameter of the shard model */
    int n_split;
};

static const char *const moments[] = {"exp_avg", "exp_avg_sq"};

#define USAGE(...) (*usage = true, anneal_set_error(ANNEAL_ERR_ARG, __VA_ARGS__))

bool anneal_train_tp_active(const trainer *t) { return t->tp != NULL; }
int anneal_train_tp_data_rank(const trainer *t) { return t->tp ? t->tp->dp_rank : t->rank; }
int anneal_train_tp_data_world(const trainer *t) { return t->tp ? t->tp->dp_size : t->world; }
anneal_comm *anneal_train_tp_dp_comm(const trainer *t) { return t->tp ? t->tp->dp_comm : t->comm; }

/* "0-1" or "0,2" for the group of `n` ranks first, first+step, ... */
static void group_text(char *buf, size_t n, int first, int count, int step) {
    size_t k = 0;
    buf[0] = '\0';
    for (int i = 0; i < count && k + 12 < n; i++) k += (size_t)snprintf(buf + k, n - k, "%s%d", i ? "," : "", first + i * step);
}

anneal_status anneal_train_tp_begin(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    if (c->tp <= 1) return ANNEAL_OK;
    int n = (int)c->tp;
    if (t->world % n)
        return USAGE("--tp %d does not divide the %d ranks: the world is --tp ranks per tensor-parallel group times "
                     "the data-parallel replicas (start a multiple of %d ranks%s)", n, t->world, n,
                     c->resume ? "; a resume keeps the run's --tp unless given: --tp 1 resumes on one process" : "");
    if (c->zero > 2)
        return USAGE("--tp %d with --zero %lld: ZeRO-3's per-block gathering does not know the shards yet; use --zero 0, "
                     "1 or 2", n, (long long)c->zero);
    if (c->lora_rank > 0) return USAGE("--tp %d with --lora-rank: not built (LoRA adapters are not sharded)", n);
    if (c->device && strcmp(c->device, "cpu"))
        return USAGE("--tp %d with --device %s: the group's collectives run on CPU tensors only", n, c->device);
    struct train_tp *p = calloc(1, sizeof *p);
    if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "--tp: out of memory");
    t->tp = p;
    p->size = n;
    p->rank = t->rank % n;
    int grp = n * (c->pp > 1 ? (int)c->pp : 1); /* --pp: a group per stage, stages next (pipeline.c) */
    p->dp_size = t->world / grp;
    p->dp_rank = t->rank / grp;
    p->tp_comm = anneal_comm_split(t->comm, t->rank / n, t->rank);
    p->dp_comm = p->tp_comm ? anneal_comm_split(t->comm, t->rank % grp, t->rank) : NULL;
    if (!p->tp_comm || !p->dp_comm || !(p->tp = anneal_tp_new(p->tp_comm))) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s", anneal_last_error());
        return anneal_set_error(ANNEAL_ERR_STATE, "--tp %d: cannot make the rank groups: %s", n, msg);
    }
    if (c->pp > 1) return ANNEAL_OK; /* the layout: pipeline.c prints tp x pp x dp */
    /* the layout, printed by rank 0 */
    char g0[96], d0[96];
    group_text(g0, sizeof g0, 0, n, 1);
    group_text(d0, sizeof d0, 0, p->dp_size, n);
    anneal_progress_note(t->prog, "parallel layout: %d ranks = tensor-parallel %d x data-parallel %d; tensor-parallel "
                         "groups of consecutive ranks (first {%s}), data-parallel groups of every %d-th rank (first "
                         "{%s}); this rank %d: tp rank %d, dp rank %d", t->world, n, p->dp_size, g0, n, d0, t->rank,
                         p->rank, p->dp_rank);
    return ANNEAL_OK;
}

/* Copies a resumed optimizer's state (whole) into the shard optimizer's slices. */
static anneal_status slice_optimizer(trainer *t, anneal_optimizer *whole, anneal_optimizer *shard, anneal_model *wm) {
    struct train_tp *p = t->tp;
    anneal_params *ps = t->model->params;
    anneal_status st = anneal_optimizer_init_state(shard);
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
        anneal_param *w = anneal_params_find(wm->params, ps->items[i].name);
        int wi = w ? (int)(w - wm->params->items) : -1;
        for (int j = 0; j < 2 && st == ANNEAL_OK; j++) {
            anneal_tensor *src = wi >= 0 ? anneal_optimizer_state(whole, wi, moments[j]) : NULL;
            anneal_tensor *dst = anneal_optimizer_state(shard, i, moments[j]);
            if (!src || !dst)
                st = anneal_set_error(ANNEAL_ERR_STATE, "--tp: no %s state for %s to restore", moments[j],
                                      ps->items[i].name);
            else st = anneal_tp_slice(src, dst, p->split[i], p->rank);
        }
        if (st == ANNEAL_OK) st = anneal_optimizer_set_param_steps(shard, i, anneal_optimizer_param_steps(whole, wi));
    }
    if (st == ANNEAL_OK) st = anneal_optimizer_set_step_count(shard, anneal_optimizer_step_count(whole));
    return st;
}

/* --tp alone by parameter: storage for whole's tensors from i on, up to the batch size
 * (one at least), filled from the run's source (pp_setup.c's anneal_train_fill_held). */
static anneal_status fill_batch(trainer *t, anneal_model *whole, int i, int64_t batch_elems) {
    anneal_params *ws = whole->params;
    anneal_status st = ANNEAL_OK;
    for (int64_t elems = 0; i < ws->n && st == ANNEAL_OK; i++) {
        anneal_tensor *x = ws->items[i].tensor;
        if (x->storage) continue;
        if (elems > 0 && elems + anneal_numel(x) > batch_elems) break;
        elems += anneal_numel(x);
        st = anneal_train_pp_hold_tensor(x);
    }
    return st == ANNEAL_OK ? anneal_train_fill_held(t, whole) : st;
}

/* The shard model of the whole one t->model holds (weights copied). */
static anneal_status make_shards(trainer *t, anneal_model *whole) {
    struct train_tp *p = t->tp;
    anneal_model_config cfg = whole->cfg;
    cfg.tp_size = p->size;
    cfg.tp_rank = p->rank;
    cfg.tp_vocab_whole = t->cfg.deterministic; /* the lm head and loss whole on every rank (tp_det.c) */
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_PARAMETERS);
    bool stage = anneal_train_pp_stage_only(t); /* --pp: only the shards of what the whole holds (pp_setup.c) */
    bool by_param = anneal_train_tp_by_param(t); /* --tp alone: the whole filled a batch at a time */
    int64_t batch = by_param ? anneal_train_tp_batch_elems(whole->params, p->size) : 0;
    stage = stage || by_param;
    anneal_params_defer_storage(stage);
    anneal_model *m = anneal_model_new(&cfg, t->device);
    anneal_params_defer_storage(false);
    anneal_memory_category_set(mc);
    if (!m) return anneal_last_status();
    m->ctx = whole->ctx;
    m->ctx.tp = anneal_tp_nn(p->tp);
    t->model = m;
    anneal_params *ps = m->params;
    p->split = calloc((size_t)ps->n + 1, sizeof *p->split);
    if (!p->split) return anneal_set_error(ANNEAL_ERR_OOM, "--tp: out of memory");
    p->n_split = ps->n;
    anneal_status st = ANNEAL_OK;
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
        anneal_param *w = anneal_params_find(whole->params, ps->items[i].name);
        if (!w) st = anneal_set_error(ANNEAL_ERR_STATE, "--tp: the whole model has no %s", ps->items[i].name);
        if (st == ANNEAL_OK)
            st = anneal_tp_split_of(ps->items[i].name, w->tensor, ps->items[i].tensor, p->size, &p->split[i]);
        if (st == ANNEAL_OK && by_param && !w->tensor->storage)
            st = fill_batch(t, whole, (int)(w - whole->params->items), batch);
        if (st == ANNEAL_OK && stage && !w->tensor->storage) continue;
        if (st == ANNEAL_OK && stage) st = anneal_train_pp_hold_tensor(ps->items[i].tensor);
        if (st == ANNEAL_OK) st = anneal_tp_slice(w->tensor, ps->items[i].tensor, p->split[i], p->rank);
        if (st == ANNEAL_OK && stage) anneal_tensor_set_storage(w->tensor, NULL, 0); /* cut: the whole-width one goes */
    }
    return st;
}

anneal_status anneal_train_tp_shard(trainer *t, bool *usage) {
    if (!t->tp || t->cfg.deterministic) { /* --deterministic: the chunked projections (tp_det.c) */
        anneal_status ds = anneal_train_tp_det_setup(t, usage);
        if (ds != ANNEAL_OK || !t->tp) return ds;
    }
    anneal_model *whole = t->model;
    anneal_optimizer *wopt = t->opt;
    if (strcmp(whole->cfg.arch, "gpt2") && strcmp(whole->cfg.arch, "llama"))
        return USAGE("--tp %d: tensor parallelism is built for GPT-2 and the Llama family only (this model is %s)",
                     t->tp->size, whole->cfg.arch);
    anneal_status st = make_shards(t, whole);
    if (st != ANNEAL_OK) {
        if (t->model != whole) anneal_model_free(t->model);
        t->model = whole;
        return st;
    }
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_OPTIMIZER);
    t->opt = anneal_optimizer_new(t->model->params, anneal_optimizer_config(wopt));
    anneal_memory_category_set(mc);
    if (!t->opt) st = anneal_last_status();
    else if (t->resume_ckpt[0] && anneal_train_tp_by_param(t)) /* the whole-width state in batches, sliced */
        st = anneal_train_pp_load_tp_state(t, t->model->params, t->opt,
                                           anneal_train_tp_batch_elems(whole->params, t->tp->size));
    else if (anneal_optimizer_step_count(wopt) > 0) st = slice_optimizer(t, wopt, t->opt, whole);
    anneal_optimizer_free(wopt);
    anneal_model_free(whole);
    const anneal_model_config *cf = &t->model->cfg;
    int n = t->tp->size;
    if (st == ANNEAL_OK)
        anneal_progress_note(t->prog, "tensor parallelism: %d of %d heads and %d of %d MLP columns per rank; vocabulary "
                             "%s", cf->n_head / n, cf->n_head, (cf->n_ff ? cf->n_ff : 4 * cf->n_embd) / n,
                             cf->n_ff ? cf->n_ff : 4 * cf->n_embd,
                             cf->vocab_size % n ? "whole on every rank (not divisible by --tp)"
                             : cf->tp_vocab_whole ? "whole on every rank (--deterministic)"
                                                  : "split (token embedding rows, lm head columns)");
    return st;
}

/* Sum of squares of x[0..n). */
static double sumsq(const float *x, int64_t n) {
    double s = 0;
    for (int64_t k = 0; k < n; k++) s += (double)x[k] * x[k];
    return s;
}

/* v[0..k) summed over c: gathered as bits (the communicator reduces f32 only) and added
 * in rank order, so every rank gets the same doubles. */
static anneal_status sum_over(anneal_comm *c, double *v, int k) {
    int size = anneal_comm_size(c);
    double *all = calloc((size_t)size * (size_t)k, sizeof *all);
    if (!all) return anneal_set_error(ANNEAL_ERR_OOM, "--tp: out of memory");
    anneal_status st = anneal_comm_all_gather(c, v, all, k, ANNEAL_I64);
    for (int j = 0; j < k && st == ANNEAL_OK; j++) {
        v[j] = 0;
        for (int r = 0; r < size; r++) v[j] += all[(size_t)r * (size_t)k + (size_t)j];
    }
    free(all);
    return st;
}

anneal_status anneal_train_tp_clip(trainer *t, float max_norm, float *norm_out) {
    struct train_tp *p = t->tp;
    anneal_params *ps = t->model->params;
    /* squares of the sharded parameters' gradients [0] and the replicated ones' [1]:
     * from .grad (ZeRO 0), or from this rank's ZeRO shard, then over the replicas */
    double sq[2] = {0, 0};
    anneal_status st = ANNEAL_OK;
    if (t->cfg.deterministic) { /* the one process's sums over whole gradients (tp_det.c) */
        st = anneal_train_tp_det_sumsq(t, p->tp_comm, p->split, &sq[0]);
        if (st != ANNEAL_OK) return st;
    } else if (t->cfg.zero > 0) {
        int np = 0;
        const anneal_ddp_piece *pc = anneal_ddp_shard_pieces(t->ddp, &np);
        const float *g = anneal_ddp_shard_grad(t->ddp);
        for (int k = 0; k < np && g; k++)
            sq[p->split[pc[k].param].dim >= 0 ? 0 : 1] += sumsq(g + pc[k].shard_offset, pc[k].len);
        st = sum_over(p->dp_comm, sq, 2);
    } else {
        for (int i = 0; i < ps->n; i++) {
            anneal_tensor *g = ps->items[i].tensor->grad;
            if (!g) continue;
            if (g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g))
                return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--tp: the gradient of %s is not contiguous f32",
                                        ps->items[i].name);
            sq[p->split[i].dim >= 0 ? 0 : 1] += sumsq(anneal_data(g), anneal_numel(g));
        }
    }
    /* the shards summed over the group; the replicated ones (the same on every rank of
     * the group) counted once */
    if (st == ANNEAL_OK && !t->cfg.deterministic) st = sum_over(p->tp_comm, sq, 1);
    if (st != ANNEAL_OK) return st;
    float norm = (float)sqrt(sq[0] + sq[1]);
    if (norm_out) *norm_out = norm;
    if (!isfinite(norm) || !(max_norm > 0)) return ANNEAL_OK;
    float coef = max_norm / (norm + 1e-6f); /* PyTorch's coefficient, as anneal_ddp_clip_grad_norm */
    return coef < 1.0f ? anneal_ddp_scale_grads(t->ddp, coef) : ANNEAL_OK;
}

void anneal_train_tp_teardown(trainer *t) {
    struct train_tp *p = t->tp;
    if (!p) return;
    /* the model runs with p->tp: the caller frees the model first (teardown order) */
    anneal_tp_free(p->tp);
    if (p->dp_comm) anneal_comm_free(p->dp_comm);
    if (p->tp_comm) anneal_comm_free(p->tp_comm);
    free(p->split);
    free(p);
    t->tp = NULL;
}

/* For pipeline.c's gradient norm: which dimension parameter i of the shard model is
 * split along (-1: replicated on every rank of the group), and the group. */
int anneal_train_tp_split_dim(const trainer *t, int i) {
    return t->tp && t->tp->split && i >= 0 && i < t->tp->n_split ? t->tp->split[i].dim : -1;
}

int anneal_train_tp_split_parts(const trainer *t, int i) {
    return t->tp && t->tp->split && i >= 0 && i < t->tp->n_split && t->tp->split[i].parts > 0 ? t->tp->split[i].parts : 1;
}

anneal_comm *anneal_train_tp_group(const trainer *t) { return t->tp ? t->tp->tp_comm : NULL; }
