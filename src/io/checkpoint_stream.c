/* Writing a checkpoint of a model held in parts (anneal_checkpoint_save_parts): a
 * pipeline's stages each hold some of the parameters and their optimizer state, and the
 * checkpoint must be the one file set a single process writes. The writer's snapshot
 * (checkpoint_internal.h) is built over the tensors where they are, without copies:
 * this process's parameters and state are written straight from their storage, every
 * other entry's data is left NULL and fetched from its holder (the caller's callback)
 * when the safetensors writer reaches it, so one remote tensor is in memory at a time.
 * The rest (temp directory, fsync, rename, state.json with the checksums, latest,
 * pruning) is anneal_ckpt_write's, unchanged. */
#include "io/checkpoint_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct parts_sink {
    anneal_ckpt_snapshot *s;
    const anneal_model *m;
} parts_sink;

/* True when t can be written from where it is (f32, contiguous, host memory). */
static bool in_place(const anneal_tensor *t) {
    return t->dtype == ANNEAL_F32 && t->device == ANNEAL_CPU && anneal_is_contiguous(t);
}

/* One model-file entry: a parameter of m itself (an export of another tensor would not
 * outlive the call), pointing at its data, or NULL data when it has no storage here. */
static anneal_status sink_put(void *ctx, const char *name, const anneal_tensor *t) {
    parts_sink *ps = ctx;
    anneal_ckpt_snapshot *s = ps->s;
    bool param = false;
    for (int i = 0; i < ps->m->params->n && !param; i++) param = ps->m->params->items[i].tensor == t;
    if (!param || (t->storage && !in_place(t)))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "checkpoint of a model in parts: %s is not written from a "
                                "parameter's f32 host storage (this architecture's export cannot be streamed)", name);
    if (s->n_model == s->cap_model) {
        int cap = s->cap_model ? 2 * s->cap_model : 64;
        anneal_ckpt_buf *b = realloc(s->model, (size_t)cap * sizeof *b);
        if (!b) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
        s->model = b;
        s->cap_model = cap;
    }
    anneal_ckpt_buf *b = &s->model[s->n_model];
    memset(b, 0, sizeof *b);
    if (!(b->name = strdup(name))) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    s->n_model++;
    b->ndim = t->ndim;
    memcpy(b->shape, t->shape, sizeof b->shape);
    b->nbytes = (size_t)anneal_numel(t) * sizeof(float);
    b->data = t->storage ? (float *)anneal_data((anneal_tensor *)t) : NULL;
    return ANNEAL_OK;
}

/* The snapshot's fetch: the caller's, by entry name. */
static anneal_status fetch_entry(void *ctx, const anneal_st_write_entry *e, const void **data) {
    const anneal_checkpoint_parts *p = ctx;
    anneal_status r = p->fetch(p->fetch_ctx, e->name, data);
    if (r == ANNEAL_OK && !*data) r = anneal_set_error(ANNEAL_ERR_STATE, "checkpoint: no data for %s", e->name);
    return r;
}

/* Frees the names and arrays (the data is the tensors', not the snapshot's). */
static void release(anneal_ckpt_snapshot *s) {
    for (int i = 0; i < s->n_model; i++) free(s->model[i].name);
    for (int i = 0; s->state && i < s->n_params * s->n_state; i++) free(s->state[i].name);
    for (int i = 0; s->param_names && i < s->n_params; i++) free(s->param_names[i]);
    free(s->model);
    free(s->state);
    free(s->param_names);
    free(s->param_steps);
    free(s->config_json);
}

anneal_status anneal_checkpoint_save_parts(const char *run_dir, int keep, const anneal_model *m,
                                           const anneal_checkpoint_parts *parts, const anneal_train_state *st,
                                           const char *config_json) {
    if (!run_dir || !m || !parts || !st || !parts->fetch || !parts->param_steps || !parts->state)
        return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint of a model in parts: NULL argument");
    if (parts->opt_cfg.kind != ANNEAL_OPTIM_ADAMW)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "checkpoint of a model in parts: AdamW only");
    if (anneal_params_require_float(m->params, "checkpoint") != ANNEAL_OK) return anneal_last_status();
    anneal_ckpt_snapshot s;
    memset(&s, 0, sizeof s);
    s.model_cfg = m->cfg;
    s.st = *st;
    s.tokenizer = parts->tokenizer;
    s.fetch = fetch_entry;
    s.fetch_ctx = (void *)parts;
    anneal_status r = ANNEAL_OK;
    if (config_json && !(s.config_json = strdup(config_json))) r = anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    parts_sink ctx = {&s, m};
    anneal_tensor_sink sink = {.ctx = &ctx, .put = sink_put};
    if (r == ANNEAL_OK) r = anneal_model_hf_export(m, &sink);
    const anneal_params *ps = m->params;
    int n = ps->n;
    s.has_opt = true;
    s.opt_cfg = parts->opt_cfg;
    s.opt_step_count = parts->opt_step_count;
    s.n_state = 2;
    s.state_names[0] = "exp_avg";
    s.state_names[1] = "exp_avg_sq";
    s.n_params = n;
    s.param_names = calloc((size_t)n + 1, sizeof *s.param_names);
    s.param_steps = calloc((size_t)n + 1, sizeof *s.param_steps);
    s.state = calloc(2 * (size_t)n + 1, sizeof *s.state);
    if (r == ANNEAL_OK && (!s.param_names || !s.param_steps || !s.state))
        r = anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    for (int i = 0; r == ANNEAL_OK && i < n; i++) {
        const anneal_param *p = &ps->items[i];
        if (!(s.param_names[i] = strdup(p->name))) r = anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
        s.param_steps[i] = parts->param_steps[i];
        for (int j = 0; r == ANNEAL_OK && j < 2; j++) {
            anneal_ckpt_buf *b = &s.state[2 * i + j];
            anneal_tensor *x = parts->state[2 * i + j];
            if (asprintf(&b->name, "%s.%s", p->name, s.state_names[j]) < 0) {
                b->name = NULL;
                r = anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
                break;
            }
            b->ndim = p->tensor->ndim;
            memcpy(b->shape, p->tensor->shape, sizeof b->shape);
            b->nbytes = (size_t)anneal_numel(p->tensor) * sizeof(float);
            if (x && (!in_place(x) || !anneal_same_shape(x, p->tensor)))
                r = anneal_set_error(ANNEAL_ERR_STATE, "checkpoint: the optimizer state %s is not f32 host memory of the "
                                     "parameter's shape", b->name);
            else b->data = x ? anneal_data(x) : NULL;
        }
    }
    if (r == ANNEAL_OK) r = anneal_ckpt_write(run_dir, keep, &s);
    release(&s);
    return r;
}
