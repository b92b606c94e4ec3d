/* Pipeline parallelism (`--pp N`): the model's blocks split into N contiguous stages,
 * one per pipeline rank, a step's --accum M micro-batches scheduled 1F1B (warm-up
 * forwards, then one forward and one backward in turn, then the remaining backwards),
 * activations sent forward and their gradients backward point to point.
 *
 * Layout: world W = T x N x D (T = --tp, 1 without). Rank r is tensor-parallel index
 * r % T of stage r / T % N of data-parallel replica r / (T N) (Megatron's order: a
 * tensor-parallel group is T consecutive ranks, tp.c's group); the pipeline group of a
 * replica and tp index is its N ranks, the data group of a stage and tp index its D ranks
 * (gradients of the stage's parameters are averaged over it by DDP, or sharded over it
 * with --zero 1-2: optimizer state and the averaged gradients of the stage), and the
 * first and last stage form the tied-embedding group when the model shares one tensor
 * between the embedding and the head (GPT-2's wte): their two gradients are summed
 * there (Megatron's embedding group), so the two copies stay identical.
 *
 * What a rank owns: setup makes every parameter's tensor but gives storage only to the
 * stage's, initialises them with the bits one process gives them (or reads only them
 * from --init's checkpoint or Hugging Face weights) and, on resume, reads only their
 * tensors and optimizer state from the checkpoint (pp_setup.c); with --tp, tp.c cuts the
 * stage's shards from the stage's whole-width tensors (and a resume slices their state);
 * LoRA would build its whole model as one process and then drop the storage of every
 * parameter the stage does not use (the tensors stay, empty); only the
 * stage's parameters get gradients, optimizer state and updates (the optimizer runs
 * over a view holding only them, so AdamW never decays a parameter it does not own).
 * The global gradient norm is the sum of every parameter's sum of squares in
 * registration order (each counted once, a tied one by its first stage), the
 * single-process order; clipping scales owned gradients by the same coefficient on
 * every rank.
 *
 * Data: every pipeline rank of a replica reads the same batches (the first stage needs
 * the ids, the last the targets), sharded over the D replicas as DDP shards over ranks.
 *
 * Evaluation runs through the stages (anneal_train_pp_evaluate): each rank runs its
 * blocks on every val batch and the last stage's loss is broadcast. So do samples
 * (split_sample.c): each token's full-context forward goes stage to stage, the last stage
 * samples it (one process's sampler and positions) and broadcasts the id.
 *
 * Layout independence: a checkpoint is the single-process one. Rank 0 writes it tensor
 * by tensor, fetching each other stage's parameter and optimizer state when the file
 * reaches it (pp_ckpt.c; with --tp each tensor's shards from the owning stage's group,
 * tp_ckpt.c): no rank holds more than its stage. So a run saved with --pp 2 resumes with --pp 1
 * (or any other layout) and the other way. With --tp, the activations go between ranks
 * of the same tp index, sharded parameters' squares are summed over the tp group for
 * the norm.
 *
 * With the rest: fp16 scales the loss at the last stage (the overflow agreed over the
 * world, precision.c); PowerSGD compresses the stage's sync over its replicas;
 * --offload optimizer keeps the stage's AdamW state in the rank's file, --offload
 * activations every in-flight micro-batch's saved tensors in another.
 *
 * Not done: samples keep no KV cache per stage (a full-context forward per token, see
 * split_sample.c); LoRA is refused with --pp; dropout masks are drawn from per-rank
 * generator positions that differ from a single process's (the same distribution, other
 * masks), except under --deterministic (deterministic.c: bit-identical to one process). */
#include "anneal/backend.h"
#include "anneal/trace.h"
#include "pp_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define USAGE(...) (*usage = true, anneal_set_error(ANNEAL_ERR_ARG, __VA_ARGS__))

/* Stage of blocks of rank p in N over L blocks: [p L / N, (p + 1) L / N). */
static void stage_blocks(int p, int n, int L, int *first, int *last) {
    *first = (int)((int64_t)p * L / n);
    *last = (int)((int64_t)(p + 1) * L / n);
}

anneal_status anneal_train_pp_layout(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    t->data_rank = t->rank;
    t->data_world = t->world;
    if (c->pp <= 1) return ANNEAL_OK;
    long long tp = c->tp > 1 ? (long long)c->tp : 1, g = tp * (long long)c->pp;
    if (tp > 1 && t->world % g != 0)
        return USAGE("--tp %lld x --pp %lld = %lld does not divide the %d rank%s of the job: the ranks are tensor-"
                     "parallel groups times pipeline stages times data-parallel replicas (start a multiple of %lld "
                     "ranks)", tp, (long long)c->pp, g, t->world, t->world == 1 ? "" : "s", g);
    if (t->world % c->pp != 0)
        return USAGE("--pp %lld does not divide the %d rank%s of the job: the ranks are --pp pipeline stages times "
                     "data-parallel replicas (start a multiple of %lld ranks, e.g. mpirun -np %lld, or give a --pp "
                     "that divides %d; a resume keeps the checkpoint's --pp unless given)",
                     (long long)c->pp, t->world, t->world == 1 ? "" : "s", (long long)c->pp, (long long)c->pp, t->world);
    if (c->accum < c->pp)
        return USAGE("--accum %lld is below --pp %lld: 1F1B needs at least one micro-batch per stage in flight "
                     "(give --accum >= %lld; the bubble is (N-1)/(M+N-1) of a step)",
                     (long long)c->accum, (long long)c->pp, (long long)c->pp);
    t->data_world = t->world / (int)g;
    t->data_rank = t->rank / (int)g;
    return ANNEAL_OK;
}

/* The idle share of a 1F1B step with equal stages and no communication time. */
static double ideal_bubble(const trainer *t) {
    double n = (double)t->cfg.pp, m = (double)t->cfg.accum;
    return (n - 1) / (m + n - 1);
}

/* Re-records the current error with a prefix. */
static anneal_status restate(anneal_status code, const char *prefix) {
    if (code == ANNEAL_OK) code = ANNEAL_ERR_STATE;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", anneal_last_error());
    anneal_clear_error();
    return anneal_set_error(code, "%s%s", prefix, msg);
}

/* What --pp cannot run with (yet): ANNEAL_ERR_ARG naming it. */
static anneal_status refuse(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    long long n = (long long)c->pp;
    if (!anneal_model_has_stages(t->model))
        return USAGE("--pp %lld: the %s architecture cannot be split into pipeline stages", n, t->mcfg.arch);
    if (c->pp > t->mcfg.n_layer)
        return USAGE("--pp %lld: more pipeline stages than the model's %d blocks (each stage needs a block)", n,
                     t->mcfg.n_layer);
    long long tpn = c->tp > 1 ? (long long)c->tp : 1;
    if (c->grad_compress && strcmp(c->grad_compress, "none") && t->world / (tpn * n) < 2)
        return USAGE("--pp %lld with --grad-compress %s: it compresses the sync between data-parallel replicas, and "
                     "this job has none (start a multiple of %lld ranks: --pp x --tp x 2 or more)", n, c->grad_compress,
                     2 * tpn * n);
    if (anneal_lora_count(t->model->params) > 0) return USAGE("--pp %lld with LoRA adapters: not built", n);
    if (t->device != ANNEAL_CPU) return USAGE("--pp %lld: CPU runs only", n);
    if (c->zero > 2)
        return USAGE("--pp %lld with --zero %lld: the stages run their blocks without ZeRO-3's per-block gathering "
                     "(not built); use --zero 0, 1 or 2", n, (long long)c->zero);
    return ANNEAL_OK;
}

/* The optimizer over the view, with the owned part of t->opt's state (a resume). */
static anneal_status make_stage_optimizer(trainer *t) {
    struct train_pp *pp = t->pp;
    anneal_optimizer *full = t->opt;
    anneal_optimizer *o = anneal_optimizer_new(&pp->view, anneal_optimizer_config(full));
    if (!o) return restate(anneal_last_status(), "pipeline optimizer: ");
    anneal_status st = ANNEAL_OK;
    if (t->resume_ckpt[0] && anneal_train_pp_stage_only(t)) { /* only the stage's state, read by name */
        st = pp->tp > 1 ? anneal_train_pp_load_tp_state(t, &pp->view, o, INT64_MAX) /* whole-width, sliced (pp_setup.c) */
                        : anneal_checkpoint_load_optimizer_part(t->resume_ckpt, &pp->view, o);
        if (st != ANNEAL_OK) st = restate(st, "--resume: ");
    } else if (t->resume_ckpt[0]) {
        static const char *const names[] = {"exp_avg", "exp_avg_sq"};
        if ((st = anneal_optimizer_init_state(o)) == ANNEAL_OK) st = anneal_optimizer_init_state(full);
        for (int j = 0; j < pp->view.n && st == ANNEAL_OK; j++) {
            int i = pp->view_of[j];
            for (int k = 0; k < 2 && st == ANNEAL_OK; k++) {
                anneal_tensor *src = anneal_optimizer_state(full, i, names[k]), *dst = anneal_optimizer_state(o, j, names[k]);
                if (!src || !dst || anneal_numel(src) != anneal_numel(dst))
                    st = anneal_set_error(ANNEAL_ERR_STATE, "pipeline optimizer: no state %s for %s", names[k],
                                          pp->view.items[j].name);
                else memcpy(anneal_data(dst), anneal_data(src), (size_t)anneal_numel(src) * sizeof(float));
            }
            if (st == ANNEAL_OK) st = anneal_optimizer_set_param_steps(o, j, anneal_optimizer_param_steps(full, i));
        }
        if (st == ANNEAL_OK) st = anneal_optimizer_set_step_count(o, anneal_optimizer_step_count(full));
    }
    if (st != ANNEAL_OK) {
        anneal_optimizer_free(o);
        return st;
    }
    anneal_optimizer_free(full);
    t->opt = o;
    return ANNEAL_OK;
}

/* Groups, ownership, buffers (no collectives but anneal_comm_split). */
static anneal_status build(trainer *t) {
    const anneal_train_config *c = &t->cfg;
    struct train_pp *pp = calloc(1, sizeof *pp);
    if (!pp) return anneal_set_error(ANNEAL_ERR_OOM, "pipeline: out of memory");
    t->pp = pp;
    pp->n = (int)c->pp;
    pp->tp = c->tp > 1 ? (int)c->tp : 1;
    /* Megatron's order: tensor-parallel index innermost, then the stage, then the replica */
    pp->tp_rank = t->rank % pp->tp;
    pp->stage = t->rank / pp->tp % pp->n;
    pp->replicas = t->world / (pp->n * pp->tp);
    pp->replica = t->rank / (pp->n * pp->tp);
    int L = t->mcfg.n_layer;
    stage_blocks(pp->stage, pp->n, L, &pp->first, &pp->last);
    /* every rank calls every split, in the same order; a pipeline (and the tied group)
     * joins the stages of one replica and tensor-parallel index, a data group the
     * replicas of one stage and index */
    int line = pp->replica * pp->tp + pp->tp_rank;
    pp->pipe = anneal_comm_split(t->comm, line, pp->stage);
    pp->data = anneal_comm_split(t->comm, pp->stage * pp->tp + pp->tp_rank, pp->replica);
    bool end = pp->stage == 0 || pp->stage == pp->n - 1;
    anneal_comm *e = anneal_comm_split(t->comm, end ? line : t->world + t->rank, pp->stage);
    if (!pp->pipe || !pp->data || !e) return restate(anneal_last_status(), "pipeline groups: ");
    if (end) pp->embed = e;
    else anneal_comm_free(e);
    anneal_params *ps = t->model->params;
    int n = ps->n, M = (int)c->accum;
    pp->owner = calloc((size_t)n, sizeof *pp->owner);
    pp->tied = calloc((size_t)n, sizeof *pp->tied);
    pp->view_of = calloc((size_t)n, sizeof *pp->view_of);
    pp->view.items = calloc((size_t)n, sizeof *pp->view.items);
    pp->ss = calloc((size_t)n, sizeof *pp->ss);
    pp->ss_all = calloc((size_t)n * (size_t)pp->n, sizeof *pp->ss_all);
    pp->ss_tp = calloc((size_t)n * (size_t)pp->tp, sizeof *pp->ss_tp);
    pp->act = t->local_batch * c->seq * t->mcfg.n_embd;
    pp->send_act = malloc((size_t)M * (size_t)pp->act * sizeof(float));
    pp->send_grad = malloc((size_t)M * (size_t)pp->act * sizeof(float));
    pp->reqs = calloc((size_t)(2 * M), sizeof *pp->reqs);
    pp->scopes = calloc((size_t)M, sizeof *pp->scopes);
    pp->in = calloc((size_t)M, sizeof *pp->in);
    pp->out = calloc((size_t)M, sizeof *pp->out);
    if (!pp->owner || !pp->tied || !pp->view_of || !pp->view.items || !pp->ss || !pp->ss_all || !pp->ss_tp ||
        !pp->send_act || !pp->send_grad || !pp->reqs || !pp->scopes || !pp->in || !pp->out)
        return anneal_set_error(ANNEAL_ERR_OOM, "pipeline: out of memory");
    pp->view.device = ps->device;
    for (int i = 0; i < n; i++) {
        int a, b;
        anneal_model_param_span(t->model, i, &a, &b);
        int sa = anneal_train_pp_stage_of(a, pp->n, L), sb = anneal_train_pp_stage_of(b, pp->n, L);
        if (sa != sb && (a != -1 || b != L))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "pipeline: parameter %s is used by blocks %d to %d: only the "
                                    "embedding may be shared (with the head)", ps->items[i].name, a, b);
        pp->owner[i] = sa;
        pp->tied[i] = sa != sb;
        if (pp->stage == sa || pp->stage == sb) {
            pp->view_of[pp->view.n] = i;
            pp->view.items[pp->view.n++] = ps->items[i];
        }
    }
    return ANNEAL_OK;
}

/* Whether this stage holds model parameter i: it owns it, or (tied) shares it. */
static bool holds(const struct train_pp *pp, int i) {
    return pp->owner[i] == pp->stage || (pp->tied[i] && pp->stage == pp->n - 1);
}

/* Drops the storage of the parameters this stage does not hold: from here on the rank
 * keeps its stage's parameters only (the tensors stay, empty, so the model's pointers
 * and the checkpoint's names do not change). */
static void release_others(trainer *t) {
    struct train_pp *pp = t->pp;
    anneal_params *ps = t->model->params;
    for (int i = 0; i < ps->n; i++)
        if (!holds(pp, i)) anneal_tensor_set_storage(ps->items[i].tensor, NULL, 0);
}

/* --zero 1-2: the stage optimizer replaced by one sharded over the data group (t->ddp),
 * with the stage's state when resumed. Collective over the data group. */
static anneal_status make_zero_optimizer(trainer *t) {
    struct train_pp *pp = t->pp;
    static const char *const names[] = {"exp_avg", "exp_avg_sq"};
    anneal_optimizer *plain = t->opt;
    pp->view_ss = calloc((size_t)pp->view.n + 1, sizeof *pp->view_ss);
    pp->view_ss_all = calloc(((size_t)pp->view.n + 1) * (size_t)pp->replicas, sizeof *pp->view_ss_all);
    if (!pp->view_ss || !pp->view_ss_all) anneal_comm_abort(t->comm, 1, "pipeline: out of memory");
    anneal_optimizer *z = anneal_optimizer_new_zero(&pp->view, anneal_optimizer_config(plain), t->ddp);
    if (!z) return restate(anneal_last_status(), "ZeRO optimizer of the stage: ");
    anneal_status st = ANNEAL_OK;
    if (t->resume_ckpt[0]) {
        st = anneal_optimizer_init_state(z);
        anneal_status g = anneal_optimizer_gather_state(z); /* collective */
        if (st == ANNEAL_OK) st = g;
        for (int j = 0; j < pp->view.n && st == ANNEAL_OK; j++) {
            for (int k = 0; k < 2 && st == ANNEAL_OK; k++) {
                anneal_tensor *src = anneal_optimizer_state(plain, j, names[k]), *dst = anneal_optimizer_state(z, j, names[k]);
                if (!src || !dst || anneal_numel(src) != anneal_numel(dst))
                    st = anneal_set_error(ANNEAL_ERR_STATE, "ZeRO optimizer of the stage: no state %s for %s", names[k],
                                          pp->view.items[j].name);
                else memcpy(anneal_data(dst), anneal_data(src), (size_t)anneal_numel(src) * sizeof(float));
            }
            if (st == ANNEAL_OK) st = anneal_optimizer_set_param_steps(z, j, anneal_optimizer_param_steps(plain, j));
        }
        if (st == ANNEAL_OK) st = anneal_optimizer_set_step_count(z, anneal_optimizer_step_count(plain));
        anneal_status sc = anneal_optimizer_scatter_state(z); /* collective */
        if (st == ANNEAL_OK) st = sc;
    }
    anneal_optimizer_free(plain);
    t->opt = z;
    return st;
}

anneal_status anneal_train_pp_build(trainer *t, bool *usage) {
    anneal_status st = refuse(t, usage);
    return st == ANNEAL_OK ? build(t) : st;
}

/* Ends the job on a failure inside the collectives of the optimizer setup (the other
 * ranks may be waiting in one). */
static anneal_status fatal(trainer *t, anneal_status st) {
    if (st == ANNEAL_OK) return st;
    char msg[1200];
    snprintf(msg, sizeof msg, "rank %d: anneal train: %s (ending the job)", t->rank, anneal_last_error());
    anneal_comm_abort(t->comm, 1, msg);
    return st;
}

anneal_status anneal_train_pp_optimizer(trainer *t) {
    struct train_pp *pp = t->pp;
    anneal_status st = make_stage_optimizer(t);
    if (st == ANNEAL_OK && pp->replicas > 1) {
        anneal_ddp_config dc = anneal_ddp_defaults();
        dc.bucket_bytes = (int64_t)(t->cfg.bucket_mb * 1048576.0);
        if (dc.bucket_bytes < 4) dc.bucket_bytes = 4;
        dc.overlap = t->cfg.overlap;
        dc.zero_stage = (int)t->cfg.zero;
        /* ZeRO 1-2 keep only a shard of the synced gradient: the tied sum must come first,
         * so the stage's buckets are filled from .grad in anneal_ddp_finish (no overlap) */
        bool psgd = t->cfg.grad_compress && !strcmp(t->cfg.grad_compress, "powersgd");
        /* PowerSGD too: it must compress the tied gradient's sum, not each stage's half */
        pp->tied_before_sync = (dc.zero_stage > 0 || psgd) && pp->embed;
        if (pp->tied_before_sync) dc.overlap = false;
        t->ddp = anneal_ddp_new(pp->data, &pp->view, dc);
        if (!t->ddp) st = restate(anneal_last_status(), "gradient sync of the stage: ");
        if (st == ANNEAL_OK && dc.zero_stage > 0) st = fatal(t, make_zero_optimizer(t));
    }
    if (st == ANNEAL_OK && t->cfg.deterministic) { /* the stage's tree and the data group's ordered combine */
        anneal_train_det_pp dp = {.stage = pp->stage, .n = pp->n, .pipe = pp->pipe, .data = pp->data,
                                  .embed = pp->embed, .view = &pp->view, .tied = -1};
        for (int j = 0; j < pp->view.n; j++)
            if (pp->tied[pp->view_of[j]]) dp.tied = j;
        st = anneal_train_det_pp_attach(t, &dp);
    }
    /* every replica starts from replica 0's weights (as DDP starts from rank 0's) */
    if (st == ANNEAL_OK && t->ddp && (st = anneal_ddp_broadcast_params(t->ddp)) != ANNEAL_OK)
        st = restate(st, "broadcast of the parameters: ");
    /* initialised (or loaded) whole as one process would: now only the stage's part stays */
    if (st == ANNEAL_OK) release_others(t);
    return fatal(t, st);
}

static double now_ms(void) { return anneal_train_now_ms(); }

/* Blocking receive into buf, its wait counted as idle. */
static anneal_status recv_idle(struct train_pp *pp, float *buf, int src, int tag) {
    double t0 = now_ms();
    anneal_status st = anneal_comm_recv(pp->pipe, buf, pp->act, ANNEAL_F32, src, tag);
    pp->idle_ms += now_ms() - t0;
    return st;
}

/* Forward of micro-batch k on this stage; the graph stays in the micro-batch's scope. */
static anneal_status forward(trainer *t, int k, bool inject) {
    struct train_pp *pp = t->pp;
    const anneal_train_config *c = &t->cfg;
    int64_t shape[3] = {t->local_batch, c->seq, t->mcfg.n_embd};
    pp->scopes[k] = anneal_scope_new();
    if (!pp->scopes[k]) return anneal_last_status();
    anneal_scope_enter(pp->scopes[k]);
    int64_t span_t0 = anneal_span_begin();
    int32_t *h_ids = t->host_ids, *h_tg = t->host_tg; /* --deterministic: micro-batch k of the step's rows */
    anneal_status st = c->deterministic ? anneal_train_det_pp_forward(t, pp->step, k, &h_ids, &h_tg)
                                        : anneal_train_source_next(&t->train, t->host_ids, t->host_tg);
    anneal_span_end(ANNEAL_SPAN_LOADER, "next batch", span_t0, 0, 0);
    anneal_tensor *in = NULL, *tg = NULL;
    bool last = pp->stage == pp->n - 1;
    if (st == ANNEAL_OK && pp->stage == 0) in = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, shape, h_ids);
    if (st == ANNEAL_OK && last) tg = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, shape, h_tg);
    if (st == ANNEAL_OK && pp->stage > 0) {
        in = anneal_empty_on(ANNEAL_CPU, ANNEAL_F32, 3, shape);
        st = in ? recv_idle(pp, anneal_data(in), pp->stage - 1, ACT_TAG(k)) : anneal_last_status();
        if (st == ANNEAL_OK) st = anneal_set_requires_grad(in, true);
        pp->in[k] = in;
    }
    anneal_tensor *out = NULL;
    if (st == ANNEAL_OK) {
        span_t0 = anneal_span_begin();
        out = anneal_model_stage_forward(t->model, pp->first, pp->last, in, tg);
        anneal_span_end(ANNEAL_SPAN_STEP, "forward", span_t0, 0, 0);
        if (!out) st = anneal_last_status();
    }
    if (st == ANNEAL_OK && last) {
        if (inject) out = anneal_scale(out, NAN); /* test hook: a non-finite loss and gradient */
        st = out ? anneal_to_f32_buffer(out, &t->host_losses[k]) : anneal_last_status();
        if (st == ANNEAL_OK && c->accum > 1) out = anneal_scale(out, 1.0f / (float)c->accum);
        if (st == ANNEAL_OK && out) out = anneal_train_scale_loss(t, out); /* fp16: loss * scale (precision.c) */
        if (!out) st = anneal_last_status();
    } else if (st == ANNEAL_OK) {
        float *buf = pp->send_act + (size_t)k * (size_t)pp->act;
        st = anneal_to_f32_buffer(out, buf);
        if (st == ANNEAL_OK)
            st = anneal_comm_send_start(pp->pipe, buf, pp->act, ANNEAL_F32, pp->stage + 1, ACT_TAG(k),
                                        &pp->reqs[pp->n_reqs++]);
    }
    pp->out[k] = out;
    anneal_scope_leave();
    return st;
}

/* Backward of micro-batch k: from the loss (last stage) or the gradient the next stage
 * sent; the input's gradient goes to the stage before. Frees the micro-batch's graph. */
static anneal_status backward(trainer *t, int k) {
    struct train_pp *pp = t->pp;
    const anneal_train_config *c = &t->cfg;
    int64_t shape[3] = {t->local_batch, c->seq, t->mcfg.n_embd};
    anneal_scope_enter(pp->scopes[k]);
    anneal_status st = ANNEAL_OK;
    /* distributed over the data group: gradients are communicated on the last micro-batch
     * (--deterministic: after the step's tree, anneal_train_det_pp_finish) */
    if (t->ddp && !c->deterministic) st = anneal_ddp_begin_backward(t->ddp, k == c->accum - 1);
    int64_t span_t0 = anneal_span_begin();
    if (st == ANNEAL_OK && pp->stage == pp->n - 1) {
        st = anneal_backward(pp->out[k]);
    } else if (st == ANNEAL_OK) {
        anneal_tensor *g = anneal_empty_on(ANNEAL_CPU, ANNEAL_F32, 3, shape);
        st = g ? recv_idle(pp, anneal_data(g), pp->stage + 1, GRAD_TAG(k)) : anneal_last_status();
        if (st == ANNEAL_OK) st = anneal_backward_grad(pp->out[k], g);
    }
    anneal_span_end(ANNEAL_SPAN_STEP, "backward", span_t0, 0, 0);
    if (st == ANNEAL_OK && pp->stage > 0) {
        anneal_tensor *gi = pp->in[k]->grad;
        float *buf = pp->send_grad + (size_t)k * (size_t)pp->act;
        if (!gi) st = anneal_set_error(ANNEAL_ERR_STATE, "pipeline: the stage's input got no gradient");
        else st = anneal_to_f32_buffer(gi, buf);
        if (st == ANNEAL_OK)
            st = anneal_comm_send_start(pp->pipe, buf, pp->act, ANNEAL_F32, pp->stage - 1, GRAD_TAG(k),
                                        &pp->reqs[pp->n_reqs++]);
    }
    if (st == ANNEAL_OK && c->deterministic) st = anneal_train_det_pp_push(t, k); /* into the stage's tree */
    anneal_scope_leave();
    anneal_scope_free(pp->scopes[k]);
    pp->scopes[k] = NULL;
    pp->in[k] = pp->out[k] = NULL;
    return st;
}

/* The tied parameters' gradients summed over the first and last stage. */
static anneal_status sum_tied(trainer *t) {
    struct train_pp *pp = t->pp;
    if (!pp->embed) return ANNEAL_OK;
    for (int j = 0; j < pp->view.n; j++) {
        int i = pp->view_of[j];
        if (!pp->tied[i]) continue;
        anneal_tensor *g = pp->view.items[j].tensor->grad;
        if (!g || g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g))
            return anneal_set_error(ANNEAL_ERR_STATE, "pipeline: tied parameter %s has no contiguous f32 gradient",
                                    pp->view.items[j].name);
        anneal_status st = anneal_comm_allreduce(pp->embed, anneal_data(g), anneal_numel(g), ANNEAL_F32, ANNEAL_REDUCE_SUM);
        if (st != ANNEAL_OK) return st;
    }
    return ANNEAL_OK;
}

/* ZeRO 1-2: ss[i] of every owned model parameter i from the shards of the data group
 * (each rank's pieces, gathered and added in replica order); tied ones only at their
 * first stage. */
static anneal_status shard_sums(trainer *t, const anneal_backend *be, anneal_tensor *acc) {
    struct train_pp *pp = t->pp;
    int np = 0, nv = pp->view.n;
    const anneal_ddp_piece *pc = anneal_ddp_shard_pieces(t->ddp, &np);
    anneal_tensor *g = anneal_ddp_shard_grad_tensor(t->ddp);
    const double *full = anneal_ddp_full_norm_sums(t->ddp); /* --deterministic: per parameter, whole */
    for (int j = 0; full && j < nv; j++)
        if (pp->owner[pp->view_of[j]] == pp->stage) ((double *)anneal_data(acc))[pp->view_of[j]] = full[j];
    if (full) return ANNEAL_OK;
    anneal_scope *s = anneal_scope_open();
    int64_t len = np > 0 ? np : 1;
    anneal_tensor *part = anneal_empty_on(ANNEAL_CPU, ANNEAL_F64, 1, &len);
    anneal_status st = part ? ANNEAL_OK : anneal_last_status();
    memset(pp->view_ss, 0, (size_t)nv * sizeof(double));
    for (int k = 0; k < np && st == ANNEAL_OK && g; k++) {
        anneal_tensor *v = anneal_narrow(g, 0, pc[k].shard_offset, pc[k].len);
        st = v ? be->sum_squares(be->ctx, part, k, v) : anneal_last_status();
        if (st == ANNEAL_OK) pp->view_ss[pc[k].param] += ((double *)anneal_data(part))[k];
    }
    anneal_scope_close(s);
    if (st == ANNEAL_OK)
        st = anneal_comm_all_gather(pp->data, pp->view_ss, pp->view_ss_all, (int64_t)nv * 8, ANNEAL_U8);
    double *out = anneal_data(acc);
    for (int j = 0; j < nv && st == ANNEAL_OK; j++) {
        int i = pp->view_of[j];
        if (pp->owner[i] != pp->stage) continue;
        double sum = 0;
        for (int r = 0; r < pp->replicas; r++) sum += pp->view_ss_all[(size_t)r * (size_t)nv + (size_t)j];
        out[i] = sum;
    }
    return st;
}

/* The global gradient norm (single-process order) and clipping of the owned gradients. */
static anneal_status norm_and_clip(trainer *t, float max_norm, float *norm_out) {
    struct train_pp *pp = t->pp;
    int n = t->model->params->n;
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    if (!be) return anneal_last_status();
    bool sharded = t->ddp && anneal_ddp_stage(t->ddp) > 0;
    anneal_scope *s = anneal_scope_open();
    int64_t len = n;
    anneal_tensor *acc = anneal_empty_on(ANNEAL_CPU, ANNEAL_F64, 1, &len);
    anneal_status st = acc ? ANNEAL_OK : anneal_last_status();
    if (st == ANNEAL_OK) memset(anneal_data(acc), 0, (size_t)n * sizeof(double));
    if (st == ANNEAL_OK && sharded) st = shard_sums(t, be, acc);
    for (int j = 0; j < pp->view.n && st == ANNEAL_OK && !sharded; j++) {
        int i = pp->view_of[j];
        anneal_tensor *g = pp->view.items[j].tensor->grad;
        if (!g || pp->owner[i] != pp->stage) continue; /* a tied one counts once, at its first stage */
        if (g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g))
            st = anneal_set_error(ANNEAL_ERR_STATE, "pipeline: gradient of %s is not contiguous f32", pp->view.items[j].name);
        else st = be->sum_squares(be->ctx, acc, i, g);
    }
    if (st == ANNEAL_OK) memcpy(pp->ss, anneal_data(acc), (size_t)n * sizeof(double));
    anneal_scope_close(s);
    if (st != ANNEAL_OK) return st;
    if (pp->tp > 1) { /* --tp: a sharded parameter's squares summed over the group in rank order; a
                       * replicated one (the same gradient on every rank of the group) counted once */
        st = anneal_comm_all_gather(anneal_train_tp_group(t), pp->ss, pp->ss_tp, (int64_t)n * 8, ANNEAL_U8);
        for (int i = 0; i < n && st == ANNEAL_OK; i++) {
            if (anneal_train_tp_split_dim(t, i) < 0) continue;
            pp->ss[i] = 0;
            for (int r = 0; r < pp->tp; r++) pp->ss[i] += pp->ss_tp[(size_t)r * (size_t)n + (size_t)i];
        }
        if (st != ANNEAL_OK) return st;
    }
    st = anneal_comm_all_gather(pp->pipe, pp->ss, pp->ss_all, (int64_t)n * 8, ANNEAL_U8);
    if (st != ANNEAL_OK) return st;
    double total = 0;
    for (int i = 0; i < n; i++) total += pp->ss_all[(size_t)pp->owner[i] * (size_t)n + (size_t)i];
    float norm = (float)sqrt(total);
    *norm_out = norm;
    if (!(max_norm > 0) || !isfinite(norm)) return ANNEAL_OK;
    float coef = max_norm / (norm + 1e-6f);
    if (!(coef < 1.0f)) return ANNEAL_OK;
    if (sharded) return anneal_ddp_scale_grads(t->ddp, coef); /* the shard */
    for (int j = 0; j < pp->view.n && st == ANNEAL_OK; j++) {
        anneal_tensor *g = pp->view.items[j].tensor->grad;
        if (g) st = be->scale_by(be->ctx, g, NULL, NULL, coef);
    }
    return st;
}

anneal_status anneal_train_pp_step(trainer *t, int64_t step, bool inject, double lr, double *loss, float *norm,
                                   bool *skipped, bool *overflow, float *loss_scale) {
    struct train_pp *pp = t->pp;
    const anneal_train_config *c = &t->cfg;
    /* --deterministic: the replica's accum / replicas micro-batches of --batch rows */
    int M = (int)(c->deterministic ? c->accum / pp->replicas : c->accum), N = pp->n, p = pp->stage;
    pp->step = step;
    int warm = N - p - 1 < M ? N - p - 1 : M;
    double t0 = now_ms();
    pp->idle_ms = 0;
    pp->n_reqs = 0;
    anneal_status st = ANNEAL_OK;
    /* 1F1B: warm-up forwards, one forward and one backward in turn, the last backwards */
    for (int k = 0; k < warm && st == ANNEAL_OK; k++) st = forward(t, k, inject);
    for (int k = 0; k < M - warm && st == ANNEAL_OK; k++) {
        st = forward(t, warm + k, inject);
        if (st == ANNEAL_OK) st = backward(t, k);
    }
    for (int k = M - warm; k < M && st == ANNEAL_OK; k++) st = backward(t, k);
    /* a failure leaves graphs behind: freed here (the caller ends the job) */
    for (int k = 0; k < M; k++)
        if (pp->scopes[k]) anneal_scope_free(pp->scopes[k]), pp->scopes[k] = NULL;
    double tw = now_ms();
    for (int r = 0; r < pp->n_reqs; r++) {
        anneal_status sw = anneal_comm_wait(pp->reqs[r]);
        pp->reqs[r] = NULL;
        if (st == ANNEAL_OK) st = sw;
    }
    pp->idle_ms += now_ms() - tw;
    pp->n_reqs = 0;
    if (st != ANNEAL_OK) return st;
    int64_t span_t0 = anneal_span_begin(); /* gradient sync, norm, clipping, update */
    double mean = 0;
    if (c->deterministic) { /* the trees, the tied copy, the loss in the tree's order (deterministic.c) */
        if ((st = anneal_train_det_pp_finish(t, step, &mean)) != ANNEAL_OK) return st;
        if (t->ddp && (st = anneal_ddp_finish(t->ddp)) != ANNEAL_OK) return st;
        goto update;
    }
    if (pp->tied_before_sync && (st = sum_tied(t)) != ANNEAL_OK) return st;
    if (t->ddp && (st = anneal_ddp_finish(t->ddp)) != ANNEAL_OK) return st;
    if (!pp->tied_before_sync && (st = sum_tied(t)) != ANNEAL_OK) return st;
    /* the loss: the last stage's mean of its micro-batches (in double, in order, as one
     * process sums them), sent to the whole pipeline; then the mean over replicas */
    if (p == N - 1) {
        for (int k = 0; k < M; k++) mean += (double)t->host_losses[k];
        mean /= (double)M;
    }
    if ((st = anneal_comm_broadcast(pp->pipe, &mean, 8, ANNEAL_U8, N - 1)) != ANNEAL_OK) return st;
    if (pp->replicas > 1) { /* as DDP's mean: in f32 over every rank (each replica's ranks agree) */
        float v = (float)mean;
        if ((st = anneal_comm_allreduce(t->comm, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_MEAN)) != ANNEAL_OK) return st;
        mean = v;
    }
update:
    *loss = mean;
    /* fp16: gradients * 1/scale, the overflow agreed over the world, the scaler updated */
    if ((st = anneal_train_unscale_grads(t, mean, overflow, loss_scale)) != ANNEAL_OK) return st;
    if ((st = norm_and_clip(t, c->clip > 0 ? (float)c->clip : 0.0f, norm)) != ANNEAL_OK) return st;
    *skipped = !isfinite(mean) || !isfinite(*norm) || *overflow; /* an overflow anywhere (a tied copy too) */
    /* PowerSGD: a non-finite gradient went into the error feedback and Q (every rank sees
     * the same norm, so every rank resets) */
    if (*skipped && t->psgd) anneal_powersgd_reset(t->psgd);
    if (!*skipped) st = anneal_optimizer_step(t->opt, lr);
    anneal_params_zero_grad(t->model->params);
    anneal_span_end(ANNEAL_SPAN_STEP, "optimizer", span_t0, 0, 0);
    if (st != ANNEAL_OK) return st;
    /* the measured bubble: each rank's time waiting for its peers over its step time */
    pp->step_ms = now_ms() - t0;
    float mine = pp->step_ms > 0 ? (float)(pp->idle_ms / pp->step_ms) : 0.0f;
    float *all = calloc((size_t)t->world, sizeof *all);
    if (!all) return anneal_set_error(ANNEAL_ERR_OOM, "pipeline: out of memory");
    st = anneal_comm_all_gather(t->comm, &mine, all, 1, ANNEAL_F32);
    double sum = 0, mx = 0;
    for (int r = 0; r < t->world; r++) sum += all[r], mx = fmax(mx, all[r]);
    free(all);
    pp->bubble_mean = sum / t->world;
    pp->bubble_max = mx;
    pp->bubble_sum += pp->bubble_mean;
    pp->bubble_steps++;
    return st;
}

/* Validation through the stages, as training's forward runs (dropout off, no autograd):
 * each val batch's hidden state goes from stage to stage (blocking sends: stage p works
 * on batch i + 1 while stage p + 1 takes batch i), the last stage takes its loss, and the
 * mean of the batches (double, summed in batch order, as anneal_model_evaluate sums full
 * batches) goes to the whole pipeline; with replicas, the mean over them as DDP's (f32,
 * over every rank; --deterministic: none, every replica evaluated the same whole batches).
 * No rank holds another stage's parameters; a failure ends the job (peers wait in a
 * receive). */
anneal_status anneal_train_pp_evaluate(trainer *t, double *val_loss) {
    struct train_pp *pp = t->pp;
    const anneal_train_config *c = &t->cfg;
    int64_t shape[3] = {t->local_batch, c->seq, t->mcfg.n_embd};
    bool last = pp->stage == pp->n - 1;
    anneal_model *m = t->model;
    bool was_training = m->ctx.training;
    m->ctx.training = false;
    anneal_no_grad_begin();
    anneal_status st = ANNEAL_OK;
    double sum = 0.0;
    for (int64_t i = 0; i < t->eval_batches && st == ANNEAL_OK; i++) {
        st = anneal_train_source_next(&t->val, t->host_ids, t->host_tg);
        if (st != ANNEAL_OK) break;
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *in = NULL, *tg = NULL;
        if (pp->stage == 0) in = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, shape, t->host_ids);
        else if ((in = anneal_empty_on(ANNEAL_CPU, ANNEAL_F32, 3, shape)))
            st = anneal_comm_recv(pp->pipe, anneal_data(in), pp->act, ANNEAL_F32, pp->stage - 1, ACT_TAG(i));
        if (last) tg = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, shape, t->host_tg);
        anneal_tensor *out = st == ANNEAL_OK && in && (tg || !last)
                                 ? anneal_model_stage_forward(m, pp->first, pp->last, in, tg)
                                 : NULL;
        if (st == ANNEAL_OK && !out) st = anneal_last_status();
        if (st == ANNEAL_OK && last) {
            sum += anneal_item(out);
        } else if (st == ANNEAL_OK) {
            st = anneal_to_f32_buffer(out, pp->send_act); /* slot 0: no step is in flight */
            if (st == ANNEAL_OK)
                st = anneal_comm_send(pp->pipe, pp->send_act, pp->act, ANNEAL_F32, pp->stage + 1, ACT_TAG(i));
        }
        anneal_scope_close(sc);
    }
    anneal_no_grad_end();
    m->ctx.training = was_training;
    if (st != ANNEAL_OK) return fatal(t, restate(st, "pipeline evaluation: "));
    double mean = last && t->eval_batches > 0 ? sum / (double)t->eval_batches : 0.0;
    if ((st = anneal_comm_broadcast(pp->pipe, &mean, 8, ANNEAL_U8, pp->n - 1)) != ANNEAL_OK) return st;
    if (pp->replicas > 1 && !c->deterministic) {
        float v = (float)mean;
        if ((st = anneal_comm_allreduce(t->comm, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_MEAN)) != ANNEAL_OK) return st;
        mean = v;
    }
    *val_loss = mean;
    return ANNEAL_OK;
}

void anneal_train_pp_print_header(trainer *t) {
    struct train_pp *pp = t->pp;
    if (!pp) return;
    int L = t->mcfg.n_layer, T = pp->tp;
    anneal_progress_note(t->prog, "parallel layout: %d ranks = tensor-parallel %d x pipeline %d x data-parallel %d "
                         "(rank = (replica x %d + stage) x %d + tp rank: tensor-parallel groups of consecutive ranks)",
                         t->world, T, pp->n, pp->replicas, pp->n, T);
    anneal_progress_note(t->prog, "pipeline: %d stages x %d data-parallel replica%s, %lld micro-batches per step "
                         "scheduled 1F1B, ideal bubble (N-1)/(M+N-1) = %.3f", pp->n, pp->replicas,
                         pp->replicas > 1 ? "s" : "", (long long)t->cfg.accum, ideal_bubble(t));
    for (int r = 0; r < t->world; r++) {
        int p = r / T % pp->n, a, b;
        char tpr[32] = "";
        if (T > 1) snprintf(tpr, sizeof tpr, ", tp rank %d", r % T);
        stage_blocks(p, pp->n, L, &a, &b);
        anneal_progress_note(t->prog, "  rank %d: stage %d (blocks %d-%d%s%s)%s, replica %d", r, p, a, b - 1,
                             p == 0 ? ", embedding" : "", p == pp->n - 1 ? ", final norm + head" : "", tpr,
                             r / (T * pp->n));
    }
}

void anneal_train_pp_log_step(trainer *t, struct cJSON *o) {
    struct train_pp *pp = t->pp;
    if (!pp) return;
    cJSON_AddNumberToObject(o, "pp_bubble", pp->bubble_mean);
    cJSON_AddNumberToObject(o, "pp_bubble_max", pp->bubble_max);
    cJSON_AddNumberToObject(o, "pp_bubble_ideal", ideal_bubble(t));
}

void anneal_train_pp_note_summary(trainer *t) {
    struct train_pp *pp = t->pp;
    if (!pp || pp->bubble_steps == 0) return;
    anneal_progress_note(t->prog, "  pipeline bubble: %.3f of the step time waiting for other stages (mean over ranks "
                         "and %lld steps; ideal (N-1)/(M+N-1) = %.3f)", pp->bubble_sum / (double)pp->bubble_steps,
                         (long long)pp->bubble_steps, ideal_bubble(t));
}

anneal_params *anneal_train_pp_opt_params(trainer *t) { return t->pp ? &t->pp->view : NULL; }

void anneal_train_pp_memory(trainer *t, double out[3]) {
    struct train_pp *pp = t->pp;
    if (!pp) return;
    int64_t owned = anneal_params_numel(&pp->view), held = 0;
    anneal_params *ps = t->model->params;
    for (int i = 0; i < ps->n; i++) /* what holds storage now: the stage's parameters between steps */
        if (ps->items[i].tensor->storage) held += anneal_numel(ps->items[i].tensor);
    out[0] = (double)held * sizeof(float);
    if (!t->ddp) out[1] = (double)owned * sizeof(float);
    out[2] = (double)owned * 2.0 * sizeof(float);
    if (t->ddp && anneal_ddp_stage(t->ddp) > 0) out[2] = (double)anneal_ddp_shard_numel(t->ddp) * 2.0 * sizeof(float);
    if (anneal_optimizer_is_offloaded(t->opt)) out[2] = 0; /* in its file (--offload optimizer) */
}

void anneal_train_pp_teardown(trainer *t) {
    struct train_pp *pp = t->pp;
    if (!pp) return;
    for (int r = 0; r < pp->n_reqs; r++) anneal_comm_wait(pp->reqs[r]);
    for (int k = 0; pp->scopes && k < (int)t->cfg.accum; k++)
        if (pp->scopes[k]) anneal_scope_free(pp->scopes[k]);
    if (pp->embed) anneal_comm_free(pp->embed);
    if (pp->data) anneal_comm_free(pp->data);
    if (pp->pipe) anneal_comm_free(pp->pipe);
    free(pp->view.items);
    free(pp->view_of);
    free(pp->owner);
    free(pp->tied);
    free(pp->ss);
    free(pp->ss_all);
    free(pp->ss_tp);
    free(pp->view_ss);
    free(pp->view_ss_all);
    free(pp->send_act);
    free(pp->send_grad);
    free(pp->reqs);
    free(pp->scopes);
    free(pp->in);
    free(pp->out);
    free(pp);
    t->pp = NULL;
}
