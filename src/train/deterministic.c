/* --deterministic: a run's losses and parameters bit-identical whatever the number of
 * data-parallel ranks W (same flags, same --threads per rank).
 *
 * The step. A step is M = --accum micro-batches of --batch rows each, whatever W: the
 * micro-batch, not the rank, is the unit of work, so every forward and backward runs
 * on the same rows with the same shapes on every layout. Rank r runs the contiguous
 * micro-batches [r M/W, (r+1) M/W): its train source is opened with M/W x --batch rows
 * per batch (anneal_train_det_rows), which the loader's rank split (global row
 * n * rows * W + r * rows + b) turns into exactly those micro-batches, and its cursor
 * moves by M x --batch rows per step on any layout (so resuming on another W works).
 * Dropout of micro-batch j draws from (seed, (step + 1) * 2^40 + j * 2^40 / 2^ceil(log2 M)),
 * a function of (step, j) only; before block l the block hook moves it to sub-range l + 1
 * of that range (det_block_hook), so a block's masks do not depend on the blocks before
 * it on the rank (pipeline stages).
 *
 * The sum. Each micro-batch's loss is scaled by 1/M before its backward (as --accum
 * does), its gradient is flattened out of .grad and pushed into a pairwise-summation
 * tree (anneal_det_tree, src/parallel/det_reduce.c); with M/W a power of two the
 * rank's result is one complete subtree of the tree over all M micro-batches. Across
 * ranks the gradient sync's comm hook (anneal_det_sync) all-gathers the W subtree
 * sums and every rank combines them in the same tree, instead of MPI's all-reduce; the
 * losses go the same way (doubles, anneal_det_allreduce_f64). Norm, clipping and AdamW
 * then see the same bits on every layout: the stage-0 sync's norm is computed like
 * the single process's (src/parallel/ddp.c, full_norm).
 *
 * With --tp, W counts the data-parallel replicas (t->data_world; a tensor-parallel
 * group's ranks run the same micro-batches) and the blocks run their projections in
 * canonical chunks on every layout (tp_det.c).
 *
 * ZeRO 1-3: the same hook leaves each whole combined bucket on every rank, which keeps
 * its chunk, and the norm is summed per parameter over whole gradients
 * (anneal_ddp_set_full_norm), not per shard (whose bounds move with W).
 *
 * --pp N x D replicas (pipeline.c calls the anneal_train_det_pp_* functions below): a
 * replica runs M/D micro-batches; each stage pushes its parameters' gradient into its
 * tree after each micro-batch's backward (in order 0, 1, ...); the tied embedding's head
 * half goes from the last stage to the first after each micro-batch and is added there
 * as one process adds it (then the first stage's sum is broadcast back at the step's
 * end); the loss is the last stage's tree; the data group's sync uses the same hook.
 *
 * Evaluation: every rank reads and evaluates the whole val batches one process does
 * (setup.c opens the val source unsplit; evaluate.c skips the mean over ranks).
 *
 * Not covered: PowerSGD (a lossy, W-dependent approximation) and devices other than
 * the CPU (their kernels' bit-identity across layouts is not established). Cost: no overlap of communication
 * with backward, W x the evaluation work, W x the gradient received per rank, a copy of the gradient and up to
 * log2(M/W) partial sums per rank; with ZeRO, full-size gradients on every rank; with
 * --pp and a tied embedding, V x C floats sent per micro-batch. */
#include "train_internal.h"

#include "anneal/trace.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct train_det {
    anneal_params *ps;     /* the parameters summed: the model's, or (--pp) the stage's */
    anneal_train_det_pp pp; /* --pp: the stage (pp.n == 0: no pipeline) */
    float *tied_buf;       /* --pp, first stage: the head's half of the tied gradient */
    int64_t tied_off;      /* --pp: the tied parameter's offset in flat */
    anneal_block_hook_fn prev_hook; /* the model's block hook before ours (ZeRO-3's), chained */
    void *prev_user;
    bool hooked, active;   /* our block hook installed; reseeding (inside a step's micro-batches) */
    int shift, sub_shift;  /* generator offset bits of a micro-batch and of a block in it */
    anneal_det_tree *tree; /* the rank's micro-batch gradients */
    anneal_det_sync *sync; /* the sync's comm hook (W > 1) */
    float *flat;           /* one gradient, all parameters concatenated */
    bool *seen;            /* parameters that got a gradient this step */
    int32_t *ids, *tg;     /* the rank's rows of the step: M/W micro-batches */
    double *losses;        /* the rank's micro-batch losses */
    int64_t numel;
};

/* Micro-batches per rank (per replica of the data group with --pp). */
static int64_t local_count(const trainer *t) { return t->cfg.accum / (t->data_world > 0 ? t->data_world : 1); }

int64_t anneal_train_det_rows(const trainer *t) {
    return t->cfg.deterministic ? t->local_batch * local_count(t) : t->local_batch;
}

anneal_status anneal_train_det_check(trainer *t) {
    const anneal_train_config *c = &t->cfg;
    if (!c->deterministic) return ANNEAL_OK;
    if (t->device != ANNEAL_CPU)
        return anneal_set_error(ANNEAL_ERR_ARG, "--deterministic with --device %s: CPU runs only (that the device's "
                                                "kernels give the same bits on every layout is not established)",
                                c->device ? c->device : "?");
    if (c->grad_compress && strcmp(c->grad_compress, "none"))
        return anneal_set_error(ANNEAL_ERR_ARG, "--deterministic with --grad-compress %s: the compressed gradient is "
                                                "an approximation that depends on the number of ranks; use "
                                                "--grad-compress none", c->grad_compress);
    /* the ranks that split the micro-batches: all of them, or with --pp / --tp the replicas */
    int w = t->data_world > 0 ? t->data_world : 1;
    const char *who = c->pp > 1 || c->tp > 1 ? "data-parallel replicas" : "ranks";
    if (c->accum % w != 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "--deterministic: --accum %lld is not divisible by the %d %s "
                                                "(with --deterministic, --accum counts the step's micro-batches over "
                                                "all ranks, each of --batch rows)", (long long)c->accum, w, who);
    int64_t ml = c->accum / w;
    if (w > 1 && (ml & (ml - 1)) != 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "--deterministic: --accum %lld over %d %s gives %lld micro-batches "
                                                "per %s, which must be a power of two (each share is one "
                                                "complete subtree of the fixed summation tree)",
                                (long long)c->accum, w, who, (long long)ml, c->pp > 1 || c->tp > 1 ? "replica" : "rank");
    return ANNEAL_OK;
}

/* ceil(log2 m) for m >= 1. */
static int ceil_log2(int64_t m) {
    int k = 0;
    while (((int64_t)1 << k) < m) k++;
    return k;
}

/* The state, made on first use (the model exists by then; pp: the stage, or NULL). */
static anneal_status get_state_pp(trainer *t, const anneal_train_det_pp *pp, struct train_det **out) {
    if (t->det) {
        *out = t->det;
        return ANNEAL_OK;
    }
    struct train_det *d = calloc(1, sizeof *d);
    int64_t ml = local_count(t), rows = t->local_batch * t->cfg.seq * ml;
    anneal_params *ps = pp && pp->n > 1 ? pp->view : t->model->params;
    if (d) {
        d->ps = ps;
        if (pp) d->pp = *pp;
        d->pp.tied = pp && pp->n > 1 && pp->embed ? pp->tied : -1;
        d->shift = 40 - ceil_log2(t->cfg.accum);
        d->sub_shift = d->shift - ceil_log2((int64_t)t->mcfg.n_layer + 1);
        for (int p = 0; p < d->pp.tied; p++) d->tied_off += anneal_numel(ps->items[p].tensor);
        if (d->pp.tied >= 0 && d->pp.stage == 0)
            d->tied_buf = malloc((size_t)anneal_numel(ps->items[d->pp.tied].tensor) * sizeof(float));
        d->numel = anneal_params_numel(ps);
        d->tree = anneal_det_tree_new(d->numel);
        d->flat = malloc((size_t)(d->numel > 0 ? d->numel : 1) * sizeof *d->flat);
        d->seen = calloc((size_t)(ps->n > 0 ? ps->n : 1), sizeof *d->seen);
        d->ids = malloc((size_t)rows * sizeof *d->ids);
        d->tg = malloc((size_t)rows * sizeof *d->tg);
        d->losses = calloc((size_t)ml, sizeof *d->losses);
    }
    t->det = d;
    if (!d || !d->tree || !d->flat || !d->seen || !d->ids || !d->tg || !d->losses ||
        (d->pp.tied >= 0 && d->pp.stage == 0 && !d->tied_buf))
        return anneal_set_error(ANNEAL_ERR_OOM, "--deterministic: out of memory for the gradient tree");
    *out = d;
    return ANNEAL_OK;
}

static anneal_status get_state(trainer *t, struct train_det **out) { return get_state_pp(t, NULL, out); }

/* The model's block hook while a step's micro-batches run: before block l the generator
 * goes to sub-range l + 1 of the micro-batch's range (slot 0 is the embedding's), found
 * from the current offset (a micro-batch's range is 2^shift aligned), so dropout in a
 * block does not depend on which blocks ran before it on this rank (--pp stages), and a
 * recompute replay (which restores the generator of the block's start) draws the same.
 * Then the hook it replaced (ZeRO-3's gathering). */
static anneal_status det_block_hook(void *user, int layer, bool before) {
    trainer *t = user;
    struct train_det *d = t->det;
    if (before && d->active) {
        anneal_rng_state r = anneal_rng_get();
        uint64_t mask = ((uint64_t)1 << d->shift) - 1;
        r.offset = (r.offset & ~mask) + ((uint64_t)(layer + 1) << d->sub_shift);
        anneal_rng_set(r);
    }
    return d->prev_hook ? d->prev_hook(d->prev_user, layer, before) : ANNEAL_OK;
}

/* Installs det_block_hook in front of the model's (at the first step: ZeRO-3 installs
 * its own during setup, after the state is made). */
static void hook_blocks(trainer *t, struct train_det *d) {
    anneal_model *m = t->model;
    if (d->hooked) return;
    d->prev_hook = m->block_hook;
    d->prev_user = m->block_hook_user;
    m->block_hook = det_block_hook;
    m->block_hook_user = t;
    d->hooked = true;
}

anneal_status anneal_train_det_attach(trainer *t) {
    if (!t->cfg.deterministic || !t->ddp) return ANNEAL_OK;
    struct train_det *d = NULL;
    anneal_status st = get_state(t, &d);
    if (st != ANNEAL_OK) return st;
    d->sync = anneal_det_sync_new(t->ddp);
    if (!d->sync) return anneal_last_status();
    /* --tp with ZeRO 1-2: the norm gathers whole gradients over the group (tp_det.c), which
     * the shards alone do not hold: the agreed ones stay in .grad too */
    return anneal_train_tp_active(t) && t->cfg.zero > 0 ? anneal_ddp_set_keep_full_grads(t->ddp) : ANNEAL_OK;
}

void anneal_train_det_free(trainer *t) {
    struct train_det *d = t->det;
    if (!d) return;
    if (d->hooked && t->model && t->model->block_hook == det_block_hook) { /* the hook it replaced, back */
        t->model->block_hook = d->prev_hook;
        t->model->block_hook_user = d->prev_user;
    }
    anneal_det_sync_free(d->sync);
    free(d->tied_buf);
    anneal_det_tree_free(d->tree);
    free(d->flat);
    free(d->seen);
    free(d->ids);
    free(d->tg);
    free(d->losses);
    free(d);
    t->det = NULL;
}

int64_t anneal_train_det_memory_bytes(const trainer *t) {
    const struct train_det *d = t->det;
    if (!d) return 0;
    int64_t rows = t->local_batch * t->cfg.seq * local_count(t);
    int64_t tied = d->tied_buf ? anneal_numel(d->ps->items[d->pp.tied].tensor) * (int64_t)sizeof(float) : 0;
    return anneal_det_tree_memory_bytes(d->tree) + d->numel * (int64_t)sizeof(float) +
           anneal_det_sync_memory_bytes(d->sync) + 2 * rows * (int64_t)sizeof(int32_t) + tied;
}

void anneal_train_det_print_header(trainer *t) {
    const anneal_train_config *c = &t->cfg;
    if (!c->deterministic) return;
    int64_t ml = local_count(t);
    anneal_progress_note(t->prog,
                         "deterministic: %lld micro-batch%s of %lld rows per step, %lld on each of %d %s%s (this one: "
                         "%lld-%lld), gradients and losses summed in one fixed binary tree: bit-identical for any number "
                         "of ranks at the same --threads per rank (%d here)",
                         (long long)c->accum, c->accum > 1 ? "es" : "", (long long)t->local_batch, (long long)ml,
                         t->data_world, t->pp || c->tp > 1 ? "data-parallel replica" : "rank", t->data_world > 1 ? "s" : "", (long long)(t->data_rank * ml),
                         (long long)(t->data_rank * ml + ml - 1), anneal_get_num_threads());
}

/* True on every rank when any rank's flag is set (anneal_train_dist_any's sum; dist.c
 * calls this file, so this file does not call dist.c). */
static anneal_status any_rank(trainer *t, bool *flag) {
    if (!t->comm || t->world <= 1) return ANNEAL_OK;
    float v = *flag ? 1.0f : 0.0f;
    anneal_status st = anneal_comm_allreduce(t->comm, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_SUM);
    if (st == ANNEAL_OK) *flag = v > 0;
    return st;
}

/* The micro-batch's gradient (in .grad) into the tree; .grad is cleared for the next. */
static anneal_status push_grads(struct train_det *d) {
    anneal_params *ps = d->ps;
    int64_t off = 0;
    for (int p = 0; p < ps->n; p++) {
        const anneal_tensor *x = ps->items[p].tensor, *g = x->grad;
        int64_t n = anneal_numel(x);
        if (g) {
            if (g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g) || anneal_numel(g) != n)
                return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--deterministic: the gradient of '%s' is not a "
                                                                "contiguous f32 tensor", ps->items[p].name);
            memcpy(d->flat + off, anneal_data(g), (size_t)n * sizeof(float));
            d->seen[p] = true;
        } else {
            memset(d->flat + off, 0, (size_t)n * sizeof(float));
        }
        off += n;
    }
    anneal_params_zero_grad(ps);
    return ANNEAL_OK;
}

/* The tree sum into .grad of every parameter that got a gradient. */
static anneal_status finish_grads(struct train_det *d) {
    anneal_status st = anneal_det_tree_finish(d->tree, d->flat);
    anneal_params *ps = d->ps;
    int64_t off = 0;
    for (int p = 0; p < ps->n && st == ANNEAL_OK; p++) {
        anneal_tensor *x = ps->items[p].tensor;
        int64_t n = anneal_numel(x);
        if (d->seen[p]) {
            if (!x->grad) {
                anneal_scope_enter(NULL);
                anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_GRADIENTS);
                x->grad = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, x->shape);
                anneal_memory_category_set(mc);
                anneal_scope_leave();
                if (!x->grad) st = anneal_last_status();
            }
            if (st == ANNEAL_OK) memcpy(anneal_data(x->grad), d->flat + off, (size_t)n * sizeof(float));
        }
        off += n;
    }
    return st;
}

anneal_status anneal_train_det_micro_batches(trainer *t, int64_t step, double *loss_out) {
    const anneal_train_config *c = &t->cfg;
    struct train_det *d = NULL;
    anneal_status st = get_state(t, &d);
    if (st != ANNEAL_OK) return st;
    int64_t M = c->accum, ml = local_count(t), first = (int64_t)t->data_rank * ml;
    int64_t B = t->local_batch, T = c->seq, shape[2] = {B, T};
    int shift = d->shift;
    hook_blocks(t, d);
    anneal_model_set_training(t->model, true);
    anneal_params_zero_grad(t->model->params);
    memset(d->seen, 0, (size_t)t->model->params->n * sizeof *d->seen);
    bool inject = anneal_train_inject_nan(t, step + 1);
    int64_t span_t0 = anneal_span_begin();
    st = anneal_train_source_next(&t->train, d->ids, d->tg); /* the rank's micro-batches of the step */
    anneal_span_end(ANNEAL_SPAN_LOADER, "next batch", span_t0, 0, 0);
    bool abandoned = false;
    d->active = true;
    for (int64_t i = 0; i < ml && st == ANNEAL_OK; i++) {
        if (i > 0) { /* a stop request between micro-batches abandons the step, as in loop.c */
            bool stop = anneal_train_stop_requested(NULL);
            if ((st = any_rank(t, &stop)) != ANNEAL_OK) break;
            if (stop) {
                abandoned = true;
                break;
            }
        }
        uint64_t j = (uint64_t)(first + i);
        anneal_rng_set((anneal_rng_state){(uint64_t)c->seed, ((uint64_t)(step + 1) << 40) + (j << shift)});
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *ids = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, shape, d->ids + i * B * T);
        anneal_tensor *tg = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, shape, d->tg + i * B * T);
        span_t0 = anneal_span_begin();
        anneal_tensor *loss = anneal_model_loss(t->model, ids, tg);
        anneal_span_end(ANNEAL_SPAN_STEP, "forward", span_t0, 0, 0);
        if (inject) loss = anneal_scale(loss, NAN); /* test hook: a non-finite loss and gradient */
        anneal_tensor *obj = M > 1 ? anneal_scale(loss, 1.0f / (float)M) : loss;
        obj = anneal_train_scale_loss(t, obj); /* fp16: loss * scale (precision.c) */
        span_t0 = anneal_span_begin();
        st = obj ? anneal_backward(obj) : anneal_last_status();
        anneal_span_end(ANNEAL_SPAN_STEP, "backward", span_t0, 0, 0);
        float lv = NAN;
        if (st == ANNEAL_OK) st = anneal_to_f32_buffer(loss, &lv);
        d->losses[i] = (double)lv;
        anneal_scope_close(s);
        if (st == ANNEAL_OK) st = push_grads(d);
        if (st == ANNEAL_OK) st = anneal_det_tree_push(d->tree, d->flat);
    }
    /* the generator as the next step sets it: the same on every layout */
    d->active = false;
    anneal_rng_set((anneal_rng_state){(uint64_t)c->seed, (uint64_t)(step + 2) << 40});
    if (abandoned || st != ANNEAL_OK) {
        float scratch;
        if (anneal_det_tree_leaves(d->tree) > 0) anneal_det_tree_finish(d->tree, d->numel > 0 ? d->flat : &scratch);
        anneal_params_zero_grad(t->model->params);
        return abandoned ? ANNEAL_ERR_INTERRUPTED : st;
    }
    if ((st = finish_grads(d)) != ANNEAL_OK) return st;
    /* the loss: the rank's subtree, then the tree over the ranks' subtrees, over M */
    double loss = anneal_det_sum_f64(d->losses, ml);
    anneal_comm *dc = anneal_train_tp_dp_comm(t); /* the replicas (--tp: a group's ranks share micro-batches) */
    if (dc && t->data_world > 1 && (st = anneal_det_allreduce_f64(dc, &loss)) != ANNEAL_OK) return st;
    *loss_out = loss / (double)M;
    /* the sync (anneal_ddp_finish in the optimizer phase) combines the ranks' subtrees */
    if (t->ddp) st = anneal_ddp_begin_backward(t->ddp, true);
    return st;
}

/* ------------------------------------------------------------------ --pp */

#define TIED_TAG 31101 /* the head's half of the tied gradient, last stage -> first (embed group) */

anneal_status anneal_train_det_pp_attach(trainer *t, const anneal_train_det_pp *pp) {
    if (!t->cfg.deterministic) return ANNEAL_OK;
    struct train_det *d = NULL;
    anneal_status st = get_state_pp(t, pp, &d);
    if (st != ANNEAL_OK || !t->ddp || d->sync) return st;
    d->sync = anneal_det_sync_new(t->ddp); /* the data group's sync over the stage's parameters */
    return d->sync ? ANNEAL_OK : anneal_last_status();
}

anneal_status anneal_train_det_pp_forward(trainer *t, int64_t step, int k, int32_t **ids, int32_t **tg) {
    struct train_det *d = t->det;
    const anneal_train_config *c = &t->cfg;
    anneal_status st = ANNEAL_OK;
    if (!d) return anneal_set_error(ANNEAL_ERR_STATE, "--deterministic --pp: no state (attach not called)");
    if (k == 0) { /* the replica's micro-batches of the step, as the single process reads its own */
        hook_blocks(t, d);
        memset(d->seen, 0, (size_t)d->ps->n * sizeof *d->seen);
        int64_t span_t0 = anneal_span_begin();
        st = anneal_train_source_next(&t->train, d->ids, d->tg);
        anneal_span_end(ANNEAL_SPAN_LOADER, "next batch", span_t0, 0, 0);
        d->active = true;
    }
    /* micro-batch j's generator, as anneal_train_det_micro_batches sets it */
    uint64_t j = (uint64_t)((int64_t)t->data_rank * local_count(t) + k);
    anneal_rng_set((anneal_rng_state){(uint64_t)c->seed, ((uint64_t)(step + 1) << 40) + (j << d->shift)});
    int64_t bt = t->local_batch * c->seq;
    *ids = d->ids + k * bt;
    *tg = d->tg + k * bt;
    return st;
}

anneal_status anneal_train_det_pp_push(trainer *t, int k) {
    (void)k; /* pushed in micro-batch order: every stage runs its backwards 0, 1, ... */
    struct train_det *d = t->det;
    anneal_status st = push_grads(d);
    if (st == ANNEAL_OK && d->pp.tied >= 0) {
        int64_t n = anneal_numel(d->ps->items[d->pp.tied].tensor);
        float *g = d->flat + d->tied_off;
        if (d->pp.stage == d->pp.n - 1) {
            /* blocking: the first stage receives after its backward of this micro-batch,
             * which needs nothing more from this stage (the input gradient went before) */
            st = anneal_comm_send(d->pp.embed, g, n, ANNEAL_F32, 0, TIED_TAG);
            memset(g, 0, (size_t)n * sizeof(float)); /* the first stage's tree holds the tied sum */
        } else {
            st = anneal_comm_recv(d->pp.embed, d->tied_buf, n, ANNEAL_F32, 1, TIED_TAG);
            /* one process: the head's gradient lands in .grad first and the embedding's is
             * added to it (one f32 add per element: accumulate_leaf) */
            for (int64_t i = 0; i < n && st == ANNEAL_OK; i++) g[i] = d->tied_buf[i] + g[i];
            d->seen[d->pp.tied] = true;
        }
    }
    if (st == ANNEAL_OK) st = anneal_det_tree_push(d->tree, d->flat);
    return st;
}

anneal_status anneal_train_det_pp_finish(trainer *t, int64_t step, double *loss) {
    struct train_det *d = t->det;
    const anneal_train_config *c = &t->cfg;
    int64_t ml = local_count(t);
    d->active = false;
    anneal_rng_set((anneal_rng_state){(uint64_t)c->seed, (uint64_t)(step + 2) << 40});
    anneal_status st = finish_grads(d);
    if (st == ANNEAL_OK && d->pp.tied >= 0) { /* the first stage's tree sum, bit for bit, on the last */
        anneal_tensor *x = d->ps->items[d->pp.tied].tensor;
        if (!x->grad || x->grad->dtype != ANNEAL_F32 || !anneal_is_contiguous(x->grad))
            st = anneal_set_error(ANNEAL_ERR_STATE, "--deterministic --pp: the tied '%s' has no f32 gradient",
                                  d->ps->items[d->pp.tied].name);
        else st = anneal_comm_broadcast(d->pp.embed, anneal_data(x->grad), anneal_numel(x), ANNEAL_F32, 0);
    }
    /* the loss: the last stage's micro-batch losses in the replica's subtree, sent down the
     * pipeline as bits, then the tree over the replicas' subtrees, over M */
    double sum = 0;
    if (d->pp.stage == d->pp.n - 1) {
        for (int64_t k = 0; k < ml; k++) d->losses[k] = (double)t->host_losses[k];
        sum = anneal_det_sum_f64(d->losses, ml);
    }
    if (st == ANNEAL_OK) st = anneal_comm_broadcast(d->pp.pipe, &sum, 8, ANNEAL_U8, d->pp.n - 1);
    if (st == ANNEAL_OK && d->pp.data && anneal_comm_size(d->pp.data) > 1) st = anneal_det_allreduce_f64(d->pp.data, &sum);
    *loss = sum / (double)c->accum;
    if (st == ANNEAL_OK && t->ddp) st = anneal_ddp_begin_backward(t->ddp, true); /* the sync combines the replicas' */
    return st;
}
