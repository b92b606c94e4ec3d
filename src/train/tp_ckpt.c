/* Checkpoints with --tp (alone or under --pp): no rank holds the whole model. Rank 0
 * writes the single-process checkpoint files (anneal_checkpoint_save_parts) for a whole
 * model made without storage, so every entry is fetched when the file's writer reaches
 * it: for each entry (a parameter or one of its AdamW moments) rank 0 asks the ranks of
 * replica 0 that hold its shards (the tensor-parallel group of the owning stage: world
 * ranks stage x T + r) for them and places each shard where it belongs
 * (anneal_tp_place); a replicated tensor comes from the group's first rank. One whole
 * tensor and one shard are in rank 0's memory at a time. The owning stages' first ranks
 * send rank 0 their parameters' step counts first (the optimizer file's header); every
 * other rank of replica 0 answers requests until rank 0 says it is done (also after a
 * failed write: the failure is rank 0's, reported as any failed checkpoint). Around it:
 * ZeRO 1-2 assembles each rank's state over its data group and scatters it after
 * (collective, every replica), --offload optimizer takes the state out of its file and
 * puts it back. */
#include "pp_internal.h"

#include <stdlib.h>
#include <string.h>

#define TAG_STEPS 32110 /* on the world communicator: nothing else sends point-to-point there */
#define TAG_REQ 32111
#define TAG_DATA 32112

static const char *const state_names[] = {"exp_avg", "exp_avg_sq"};

bool anneal_train_tp_ckpt_streamed(const trainer *t) { return anneal_train_tp_active(t); }

static int group_size(const trainer *t) { return (int)t->cfg.tp; }
static int stages(const trainer *t) { return t->pp ? t->pp->n : 1; }
/* The stage that owns model parameter j (its first one, for the tied embedding). */
static int owner(const trainer *t, int j) { return t->pp ? t->pp->owner[j] : 0; }

/* The optimizer's index of model parameter j on this rank (the stage's view under --pp),
 * or -1 when this rank does not own it. */
static int opt_index(const trainer *t, int j) {
    if (!t->pp) return j;
    const struct train_pp *pp = t->pp;
    if (pp->owner[j] != pp->stage) return -1;
    for (int v = 0; v < pp->view.n; v++)
        if (pp->view_of[v] == j) return v;
    return -1;
}

/* This rank's tensor of request (j, k): parameter j (k < 0) or its moment k; NULL when
 * it does not hold it. */
static anneal_tensor *local_tensor(trainer *t, int j, int k) {
    anneal_params *ps = t->model->params;
    int v = j >= 0 && j < ps->n ? opt_index(t, j) : -1;
    if (v < 0) return NULL;
    anneal_tensor *x = k < 0 ? ps->items[j].tensor : anneal_optimizer_state(t->opt, v, state_names[k & 1]);
    return x && x->storage ? x : NULL;
}

typedef struct fetcher {
    trainer *t;
    anneal_model *whole;  /* without storage: the entries' shapes */
    anneal_tensor *buf;   /* the whole entry being written (until the next fetch) */
    anneal_tensor *shard; /* one shard received */
    anneal_scope *scope;  /* owns buf and shard */
} fetcher;

/* Rank 0's fetch: entry name -> (parameter, moment) -> its shards from their ranks. */
static anneal_status fetch(void *ctx, const char *name, const void **data) {
    fetcher *f = ctx;
    trainer *t = f->t;
    anneal_params *ps = t->model->params;
    int64_t req[2];
    if (!anneal_train_ckpt_entry(ps, name, req)) return anneal_set_error(ANNEAL_ERR_STATE, "--tp checkpoint: no parameter for %s", name);
    int j = (int)req[0], k = (int)req[1], T = group_size(t), o = owner(t, j);
    const anneal_tensor *sh = ps->items[j].tensor; /* the shard's shape (storage or not) */
    anneal_param *wp = anneal_params_find(f->whole->params, ps->items[j].name);
    if (!wp) return anneal_set_error(ANNEAL_ERR_STATE, "--tp checkpoint: the whole model has no %s", name);
    int dim = anneal_train_tp_split_dim(t, j);
    anneal_tp_split sp = {.dim = dim, .parts = dim >= 0 ? anneal_train_tp_split_parts(t, j) : 1};
    if (f->scope) anneal_scope_free(f->scope); /* the previous entry's buffers */
    f->scope = anneal_scope_open();
    f->buf = anneal_empty(ANNEAL_F32, wp->tensor->ndim, wp->tensor->shape);
    f->shard = anneal_empty(ANNEAL_F32, sh->ndim, sh->shape);
    anneal_scope_leave();
    anneal_status st = f->buf && f->shard ? ANNEAL_OK : anneal_last_status();
    for (int r = 0; r < (dim >= 0 ? T : 1) && st == ANNEAL_OK; r++) {
        int src = o * T + r;
        const anneal_tensor *part = NULL;
        if (src == 0) {
            part = local_tensor(t, j, k);
            if (!part) st = anneal_set_error(ANNEAL_ERR_STATE, "--tp checkpoint: rank 0 does not hold %s", name);
        } else {
            st = anneal_comm_send(t->comm, req, 2, ANNEAL_I64, src, TAG_REQ);
            if (st == ANNEAL_OK)
                st = anneal_comm_recv(t->comm, anneal_data(f->shard), anneal_numel(f->shard), ANNEAL_F32, src, TAG_DATA);
            part = f->shard;
        }
        if (st == ANNEAL_OK) st = anneal_tp_place(part, f->buf, sp, r);
    }
    *data = st == ANNEAL_OK ? anneal_data(f->buf) : NULL;
    return st;
}

/* Rank 0: the step counts of every stage, the files written, every other rank of
 * replica 0 told it is done. */
static anneal_status write_on_rank0(trainer *t) {
    anneal_params *ps = t->model->params;
    int n = ps->n, T = group_size(t), N = stages(t);
    anneal_model_config cfg = t->model->cfg;
    cfg.tp_size = cfg.tp_rank = 0;
    anneal_params_defer_storage(true); /* the whole model's names and shapes only */
    anneal_model *whole = anneal_model_new(&cfg, ANNEAL_CPU);
    anneal_params_defer_storage(false);
    int wn = whole ? whole->params->n : 0;
    int64_t *steps = calloc((size_t)n + 1, sizeof *steps), *theirs = calloc((size_t)n + 1, sizeof *theirs);
    int64_t *wsteps = calloc((size_t)wn + 1, sizeof *wsteps);
    anneal_tensor **state = calloc(2 * (size_t)wn + 1, sizeof *state); /* all fetched */
    if (!steps || !theirs) anneal_comm_abort(t->comm, 1, "--tp checkpoint: out of memory"); /* peers wait */
    anneal_status st = whole ? ANNEAL_OK : anneal_last_status();
    if (st == ANNEAL_OK && (!wsteps || !state)) st = anneal_set_error(ANNEAL_ERR_OOM, "--tp checkpoint: out of memory");
    for (int j = 0; j < n; j++) {
        int v = owner(t, j) == 0 ? opt_index(t, j) : -1;
        if (v >= 0) steps[j] = anneal_optimizer_param_steps(t->opt, v);
    }
    for (int p = 1; p < N; p++) { /* every other stage's counts (always received: its first rank sends them) */
        anneal_status r = anneal_comm_recv(t->comm, theirs, n, ANNEAL_I64, p * T, TAG_STEPS);
        if (r != ANNEAL_OK) return anneal_train_dist_fatal(t, r);
        for (int j = 0; j < n; j++)
            if (owner(t, j) == p) steps[j] = theirs[j];
    }
    for (int w = 0; w < wn && st == ANNEAL_OK; w++) { /* by name: the whole model's parameter order */
        anneal_param *sp = anneal_params_find(ps, whole->params->items[w].name);
        if (!sp) st = anneal_set_error(ANNEAL_ERR_STATE, "--tp checkpoint: no shard of %s", whole->params->items[w].name);
        else wsteps[w] = steps[sp - ps->items];
    }
    fetcher f = {.t = t, .whole = whole};
    if (st == ANNEAL_OK) {
        anneal_checkpoint_parts parts = {.opt_cfg = anneal_optimizer_config(t->opt),
                                         .opt_step_count = anneal_optimizer_step_count(t->opt),
                                         .param_steps = wsteps, .state = state, .fetch = fetch, .fetch_ctx = &f,
                                         .tokenizer = t->tok};
        st = anneal_checkpoint_save_parts(t->run_dir, (int)t->cfg.keep, whole, &parts, &t->st, t->config_json);
    }
    if (f.scope) anneal_scope_free(f.scope);
    int64_t done[2] = {-1, -1};
    for (int r = 1; r < N * T; r++) {
        anneal_status s = anneal_comm_send(t->comm, done, 2, ANNEAL_I64, r, TAG_REQ);
        if (s != ANNEAL_OK) return anneal_train_dist_fatal(t, s);
    }
    anneal_model_free(whole);
    free(steps);
    free(theirs);
    free(wsteps);
    free(state);
    return st;
}

/* The other ranks of replica 0: the counts to rank 0 (each stage's first rank), then
 * each requested shard. */
static anneal_status serve(trainer *t) {
    anneal_params *ps = t->model->params;
    int n = ps->n, T = group_size(t);
    anneal_status st = ANNEAL_OK;
    if (t->pp && t->pp->stage > 0 && t->rank % T == 0) {
        int64_t *steps = calloc((size_t)n + 1, sizeof *steps);
        if (!steps) anneal_comm_abort(t->comm, 1, "--tp checkpoint: out of memory");
        for (int j = 0; j < n; j++) {
            int v = opt_index(t, j);
            if (v >= 0) steps[j] = anneal_optimizer_param_steps(t->opt, v);
        }
        st = anneal_comm_send(t->comm, steps, n, ANNEAL_I64, 0, TAG_STEPS);
        free(steps);
    }
    for (;;) {
        int64_t req[2];
        if (st == ANNEAL_OK) st = anneal_comm_recv(t->comm, req, 2, ANNEAL_I64, 0, TAG_REQ);
        if (st != ANNEAL_OK || req[0] < 0) break;
        anneal_tensor *x = req[0] < n ? local_tensor(t, (int)req[0], (int)req[1]) : NULL;
        if (!x) { /* rank 0 waits for the bytes: the job cannot go on */
            anneal_set_error(ANNEAL_ERR_STATE, "--tp checkpoint: rank %d was asked for %lld/%lld, which it does not hold",
                             t->rank, (long long)req[0], (long long)req[1]);
            return anneal_train_dist_fatal(t, ANNEAL_ERR_STATE);
        }
        st = anneal_comm_send(t->comm, anneal_data(x), anneal_numel(x), ANNEAL_F32, 0, TAG_DATA);
    }
    return anneal_train_dist_fatal(t, st);
}

anneal_status anneal_train_tp_ckpt_save(trainer *t) {
    bool sharded = t->ddp && anneal_ddp_stage(t->ddp) > 0;
    /* the state: out of its file (--offload optimizer), assembled over the data group
     * (ZeRO 1-2), or, before the first step, zeros (as a one-process save) */
    anneal_status st = anneal_optimizer_offload_gather(t->opt);
    if (st == ANNEAL_OK) st = sharded ? anneal_optimizer_gather_state(t->opt) : anneal_optimizer_init_state(t->opt);
    st = anneal_train_dist_fatal(t, st);
    bool replica0 = t->rank < group_size(t) * stages(t); /* tp innermost, then the stages, then the replicas */
    if (st == ANNEAL_OK && replica0) st = t->rank == 0 ? write_on_rank0(t) : serve(t);
    if (sharded) {
        anneal_status sc = anneal_train_dist_fatal(t, anneal_optimizer_scatter_state(t->opt));
        if (st == ANNEAL_OK) st = sc;
    }
    anneal_status so = anneal_train_dist_fatal(t, anneal_optimizer_offload_scatter(t->opt));
    return st == ANNEAL_OK ? so : st;
}
