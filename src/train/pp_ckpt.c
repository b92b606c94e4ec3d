/* Checkpoints under --pp without --tp (pipeline.c): no rank holds the whole model.
 * Rank 0 (stage 0 of replica 0) writes the single-process checkpoint files
 * (anneal_checkpoint_save_parts) from its own stage's parameters and optimizer state
 * where they are, and asks the owning stage of every other tensor for it when the
 * file's writer reaches it: a request (parameter index, -1 for the parameter or the
 * state's index) to the owner over replica 0's pipeline group, the tensor back, one
 * tensor in rank 0's memory at a time. The other stages of replica 0 first send their
 * parameters' step counts (the optimizer file's header needs them), then answer
 * requests until rank 0 says it is done (also after a failed write: the failure is
 * rank 0's, reported as any failed checkpoint). With ZeRO 1-2 the stage's state is
 * first assembled over the data group (collective) and scattered again after. Other
 * replicas take no part but the ZeRO collectives.
 *
 * With --tp each tensor comes in shards from the owning stage's group (tp_ckpt.c). */
#include "pp_internal.h"

#include <stdlib.h>
#include <string.h>

#define TAG_STEPS 32100 /* above the micro-batches' tags (pp_internal.h), below 32768 */
#define TAG_REQ 32101
#define TAG_DATA 32102

static const char *const state_names[] = {"exp_avg", "exp_avg_sq"};

bool anneal_train_pp_ckpt_streamed(const trainer *t) { return t->pp && t->pp->tp == 1; }

/* The view index of model parameter j on this rank, or -1. */
static int view_index(const struct train_pp *pp, int j) {
    for (int v = 0; v < pp->view.n; v++)
        if (pp->view_of[v] == j) return v;
    return -1;
}

typedef struct fetcher {
    trainer *t;
    float *buf; /* one tensor: the largest parameter's size */
} fetcher;

bool anneal_train_ckpt_entry(const anneal_params *ps, const char *name, int64_t req[2]) {
    req[0] = req[1] = -1;
    for (int j = 0; j < ps->n && req[0] < 0; j++) {
        size_t l = strlen(ps->items[j].name);
        if (strncmp(name, ps->items[j].name, l) != 0) continue;
        if (name[l] == '\0') req[0] = j;
        for (int k = 0; k < 2 && req[0] < 0; k++)
            if (name[l] == '.' && !strcmp(name + l + 1, state_names[k])) req[0] = j, req[1] = k;
    }
    return req[0] >= 0;
}

/* Rank 0's fetch: entry name -> (parameter, state) -> its owning stage's bytes. */
static anneal_status fetch(void *ctx, const char *name, const void **data) {
    fetcher *f = ctx;
    struct train_pp *pp = f->t->pp;
    anneal_params *ps = f->t->model->params;
    int64_t req[2];
    if (!anneal_train_ckpt_entry(ps, name, req)) return anneal_set_error(ANNEAL_ERR_STATE, "pipeline checkpoint: no parameter for %s", name);
    int o = pp->owner[req[0]];
    if (o == 0) return anneal_set_error(ANNEAL_ERR_STATE, "pipeline checkpoint: %s is stage 0's but not here", name);
    anneal_status st = anneal_comm_send(pp->pipe, req, 2, ANNEAL_I64, o, TAG_REQ);
    if (st == ANNEAL_OK)
        st = anneal_comm_recv(pp->pipe, f->buf, anneal_numel(ps->items[req[0]].tensor), ANNEAL_F32, o, TAG_DATA);
    *data = f->buf;
    return st;
}

/* Rank 0: the steps of every stage, the files written, every stage told it is done. */
static anneal_status write_on_rank0(trainer *t) {
    struct train_pp *pp = t->pp;
    anneal_params *ps = t->model->params;
    int n = ps->n;
    int64_t *steps = calloc((size_t)n + 1, sizeof *steps), *theirs = calloc((size_t)n + 1, sizeof *theirs), big = 1;
    anneal_tensor **state = calloc(2 * (size_t)n + 1, sizeof *state);
    for (int j = 0; j < n; j++) big = anneal_numel(ps->items[j].tensor) > big ? anneal_numel(ps->items[j].tensor) : big;
    fetcher f = {t, malloc((size_t)big * sizeof(float))};
    anneal_status st = steps && theirs && state && f.buf ? ANNEAL_OK
                                                          : anneal_set_error(ANNEAL_ERR_OOM, "pipeline checkpoint: out of memory");
    if (!steps || !theirs) anneal_comm_abort(t->comm, 1, "pipeline checkpoint: out of memory"); /* peers wait */
    for (int j = 0; j < n; j++) {
        int v = pp->owner[j] == 0 ? view_index(pp, j) : -1;
        if (v < 0) continue;
        steps[j] = anneal_optimizer_param_steps(t->opt, v);
        for (int k = 0; k < 2 && state; k++) state[2 * j + k] = anneal_optimizer_state(t->opt, v, state_names[k]);
    }
    for (int p = 1; p < pp->n; p++) { /* every stage's counts (always received: the peers send them) */
        anneal_status r = anneal_comm_recv(pp->pipe, theirs, n, ANNEAL_I64, p, TAG_STEPS);
        if (r != ANNEAL_OK) return anneal_train_dist_fatal(t, r);
        for (int j = 0; j < n; j++)
            if (pp->owner[j] == p) steps[j] = theirs[j];
    }
    if (st == ANNEAL_OK) {
        anneal_checkpoint_parts parts = {.opt_cfg = anneal_optimizer_config(t->opt),
                                         .opt_step_count = anneal_optimizer_step_count(t->opt),
                                         .param_steps = steps, .state = state, .fetch = fetch, .fetch_ctx = &f,
                                         .tokenizer = t->tok};
        st = anneal_checkpoint_save_parts(t->run_dir, (int)t->cfg.keep, t->model, &parts, &t->st, t->config_json);
    }
    int64_t done[2] = {-1, -1};
    for (int p = 1; p < pp->n; p++) {
        anneal_status r = anneal_comm_send(pp->pipe, done, 2, ANNEAL_I64, p, TAG_REQ);
        if (r != ANNEAL_OK) return anneal_train_dist_fatal(t, r);
    }
    free(steps);
    free(theirs);
    free(state);
    free(f.buf);
    return st;
}

/* Stages 1..N-1 of replica 0: the counts to rank 0, then each requested tensor. */
static anneal_status serve(trainer *t) {
    struct train_pp *pp = t->pp;
    anneal_params *ps = t->model->params;
    int n = ps->n;
    int64_t *steps = calloc((size_t)n + 1, sizeof *steps);
    if (!steps) anneal_comm_abort(t->comm, 1, "pipeline checkpoint: out of memory");
    for (int v = 0; v < pp->view.n; v++)
        if (pp->owner[pp->view_of[v]] == pp->stage) steps[pp->view_of[v]] = anneal_optimizer_param_steps(t->opt, v);
    anneal_status st = anneal_comm_send(pp->pipe, steps, n, ANNEAL_I64, 0, TAG_STEPS);
    free(steps);
    for (;;) {
        int64_t req[2];
        if (st == ANNEAL_OK) st = anneal_comm_recv(pp->pipe, req, 2, ANNEAL_I64, 0, TAG_REQ);
        if (st != ANNEAL_OK || req[0] < 0) break;
        int j = (int)req[0], v = j < n && pp->owner[j] == pp->stage ? view_index(pp, j) : -1;
        anneal_tensor *x = v < 0 ? NULL : req[1] < 0 ? ps->items[j].tensor
                                                      : anneal_optimizer_state(t->opt, v, state_names[req[1] & 1]);
        if (!x || !x->storage) { /* rank 0 waits for the bytes: the job cannot go on */
            anneal_set_error(ANNEAL_ERR_STATE, "pipeline checkpoint: stage %d asked for %lld/%lld, which it does not "
                             "hold", pp->stage, (long long)req[0], (long long)req[1]);
            return anneal_train_dist_fatal(t, ANNEAL_ERR_STATE);
        }
        st = anneal_comm_send(pp->pipe, anneal_data(x), anneal_numel(x), ANNEAL_F32, 0, TAG_DATA);
    }
    return anneal_train_dist_fatal(t, st);
}

anneal_status anneal_train_pp_ckpt_save(trainer *t) {
    struct train_pp *pp = t->pp;
    bool sharded = t->ddp && anneal_ddp_stage(t->ddp) > 0;
    /* the state exists from the first step on; before it, zeros (as a one-process save);
     * --offload optimizer: out of its file (its init_state) */
    anneal_status st = sharded ? anneal_optimizer_gather_state(t->opt) : anneal_optimizer_init_state(t->opt);
    st = anneal_train_dist_fatal(t, st);
    if (st == ANNEAL_OK && pp->replica == 0) st = pp->stage == 0 ? write_on_rank0(t) : serve(t);
    if (sharded) {
        anneal_status sc = anneal_train_dist_fatal(t, anneal_optimizer_scatter_state(t->opt));
        if (st == ANNEAL_OK) st = sc;
    }
    /* --offload optimizer: init_state took the state out of its file; back into it */
    anneal_status so = anneal_train_dist_fatal(t, anneal_optimizer_offload_scatter(t->opt));
    return st == ANNEAL_OK ? so : st;
}
