/* Pipeline parallelism's setup (`--pp N`, pipeline.c): a rank builds only its stage's
 * parameters. The model is made with every parameter's tensor but without storage
 * (anneal_params_defer_storage), the stage's parameters (its blocks, the embedding on
 * the first stage, the final norm and head on the last, a tied embedding on both:
 * pipeline.c's ownership rule) get zeroed storage, and then the architecture's
 * initialisation runs as in one process: the initialisers draw from a counter-based
 * generator and skip the tensors without storage after reserving their counters, so
 * every held tensor gets the bits a whole model's initialisation gives it. A resume
 * reads only the held tensors from the checkpoint (anneal_checkpoint_load sees the
 * tensors without storage) and, in pipeline.c's stage optimizer, only their optimizer
 * state (anneal_checkpoint_load_optimizer_part). Nothing of another stage is allocated.
 *
 * With --tp: the whole model is built so, with the stage's whole-width parameters only
 * (initialised, or read from --init or the resumed checkpoint), and tp.c's make_shards
 * then gives storage only to the shards of the tensors the whole one holds, cutting each
 * and dropping its whole-width tensor (so a rank holds the stage's whole-width tensors
 * and one shard at most, then the shards alone). A resume's optimizer state is read for
 * the stage's whole-width tensors and sliced (anneal_train_pp_load_tp_state).
 *
 * --init reads only the held tensors too: a checkpoint as a resume does, a Hugging Face
 * directory or file through the architecture's import, which skips the parameters
 * without storage after checking every tensor's name and shape (hf_import.c).
 *
 * --tp alone (anneal_train_tp_by_param): the whole model is made without storage at
 * all (every source checked, nothing read) and make_shards fills it a batch of tensors
 * at a time, at most 1/T of the model's elements or the largest tensor, from the same
 * source (anneal_train_fill_held: the initialisation, --init or the resumed checkpoint),
 * cuts the batch into this rank's shards and drops it; a resume's AdamW state comes in
 * batches of the same size (anneal_train_pp_load_tp_state). A rank so holds its shards
 * and one batch at most, never the whole model.
 *
 * Not for LoRA (refused with --pp anyway; a LoRA checkpoint given to --resume or
 * --init): that builds the whole model first, as before. */
#include "train_internal.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

int anneal_train_pp_stage_of(int l, int n, int L) {
    if (l < 0) return 0;
    if (l >= L) return n - 1;
    for (int p = 0; p < n; p++) /* stage p runs blocks [p L / N, (p + 1) L / N) (pipeline.c) */
        if (l >= (int)((int64_t)p * L / n) && l < (int)((int64_t)(p + 1) * L / n)) return p;
    return n - 1;
}

/* Whether a rank builds only its part: ways (--tp x --pp) dividing the world, no LoRA,
 * on the CPU, and no LoRA checkpoint to start from. */
static bool part_build(const trainer *t, int ways) {
    const anneal_train_config *c = &t->cfg;
    if (!(ways > 1 && c->lora_rank == 0 && t->device == ANNEAL_CPU && t->world > 1 && t->world % ways == 0))
        return false;
    /* a LoRA checkpoint (its adapter_config.json) resumed or given to --init: the whole
     * model, as before (the checkpoint reader then refuses it by name or merges it) */
    char p[PATH_MAX + 32], ck[PATH_MAX];
    struct stat sb;
    const char *from = t->resume_ckpt[0] ? t->resume_ckpt : c->init;
    if (!t->resume_ckpt[0] && c->init && anneal_checkpoint_resolve(c->init, ck, sizeof ck) == ANNEAL_OK) from = ck;
    anneal_clear_error(); /* (an --init that is no checkpoint: a Hugging Face model) */
    return !(from && (size_t)snprintf(p, sizeof p, "%s/adapter_config.json", from) < sizeof p && stat(p, &sb) == 0);
}

bool anneal_train_pp_stage_only(const trainer *t) {
    const anneal_train_config *c = &t->cfg;
    return c->pp > 1 && part_build(t, (c->tp > 1 ? (int)c->tp : 1) * (int)c->pp);
}

bool anneal_train_tp_by_param(const trainer *t) {
    const anneal_train_config *c = &t->cfg;
    return c->tp > 1 && c->pp <= 1 && part_build(t, (int)c->tp);
}

int64_t anneal_train_tp_batch_elems(const anneal_params *ps, int tp) {
    int64_t total = 0, largest = 0;
    for (int i = 0; i < ps->n; i++) {
        int64_t n = anneal_numel(ps->items[i].tensor);
        total += n;
        if (n > largest) largest = n;
    }
    return total / tp > largest ? total / tp : largest;
}

bool anneal_train_init_is_checkpoint(const char *p) {
    char f[PATH_MAX + 16];
    struct stat sb;
    if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode)) return false;
    static const char *const marks[2] = {"state.json", "latest"};
    for (int k = 0; k < 2; k++)
        if ((size_t)snprintf(f, sizeof f, "%s/%s", p, marks[k]) < sizeof f && stat(f, &sb) == 0) return true;
    return !((size_t)snprintf(f, sizeof f, "%s/config.json", p) < sizeof f && stat(f, &sb) == 0);
}

anneal_status anneal_train_fill_held(trainer *t, anneal_model *m) {
    const anneal_train_config *c = &t->cfg;
    if (c->resume) return anneal_checkpoint_load(t->resume_ckpt, m, NULL, NULL);
    anneal_status st = anneal_model_init(m, (uint64_t)c->seed);
    if (st != ANNEAL_OK || !c->init) return st;
    if (!anneal_train_init_is_checkpoint(c->init)) return anneal_model_load_hf_weights(m, c->init);
    char ck[PATH_MAX];
    st = anneal_checkpoint_resolve(c->init, ck, sizeof ck);
    return st == ANNEAL_OK ? anneal_checkpoint_load(ck, m, NULL, NULL) : st;
}

anneal_status anneal_train_pp_hold_tensor(anneal_tensor *x) {
    if (x->storage) return ANNEAL_OK;
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_PARAMETERS);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *buf = anneal_zeros(x->dtype, x->ndim, x->shape);
    anneal_status st = buf ? anneal_tensor_set_storage(x, buf, 0) : anneal_last_status();
    anneal_scope_close(s);
    anneal_memory_category_set(mc);
    return st;
}

anneal_status anneal_train_pp_hold_stage(trainer *t) {
    anneal_model *m = t->model;
    anneal_params *ps = m->params;
    int n = (int)t->cfg.pp, L = t->mcfg.n_layer, stage = t->rank / (t->cfg.tp > 1 ? (int)t->cfg.tp : 1) % n;
    /* a model that cannot be split (refused by pipeline.c's checks): every parameter */
    bool all = !anneal_model_has_stages(m) || n > L;
    anneal_status st = ANNEAL_OK;
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
        anneal_tensor *x = ps->items[i].tensor;
        int a, b;
        anneal_model_param_span(m, i, &a, &b);
        int sa = anneal_train_pp_stage_of(a, n, L), sb = anneal_train_pp_stage_of(b, n, L);
        /* pipeline.c's holds(): the first stage that uses it, and a tied one's last */
        if (all || stage == sa || (sa != sb && stage == sb)) st = anneal_train_pp_hold_tensor(x);
    }
    return st;
}

anneal_status anneal_train_pp_load_tp_state(trainer *t, const anneal_params *view, anneal_optimizer *o,
                                           int64_t batch_elems) {
    int T = (int)t->cfg.tp, tpr = t->rank % T;
    /* the whole-width tensors' shapes: a whole model without storage */
    anneal_params_defer_storage(true);
    anneal_model *w = anneal_model_new(&t->mcfg, ANNEAL_CPU);
    anneal_params_defer_storage(false);
    if (!w) return anneal_last_status();
    anneal_params wide = {.items = calloc((size_t)view->n + 1, sizeof *wide.items), .n = view->n, .device = ANNEAL_CPU};
    anneal_status st = wide.items ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "--tp resume: out of memory");
    for (int j = 0; j < view->n && st == ANNEAL_OK; j++) {
        anneal_param *p = anneal_params_find(w->params, view->items[j].name);
        if (!p) st = anneal_set_error(ANNEAL_ERR_STATE, "--tp resume: no whole-width %s", view->items[j].name);
        else wide.items[j] = *p;
    }
    /* the stage's whole-width state read by name, a batch of at most batch_elems
     * elements (one tensor at least) at a time, then this rank's slices of it */
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_OPTIMIZER);
    static const char *const names[] = {"exp_avg", "exp_avg_sq"};
    int64_t step_count = 0;
    for (int j0 = 0, j1; j0 < view->n && st == ANNEAL_OK; j0 = j1) {
        int64_t elems = anneal_numel(wide.items[j0].tensor);
        for (j1 = j0 + 1; j1 < view->n && elems + anneal_numel(wide.items[j1].tensor) <= batch_elems; j1++)
            elems += anneal_numel(wide.items[j1].tensor);
        anneal_params part = {.items = wide.items + j0, .n = j1 - j0, .device = ANNEAL_CPU};
        anneal_optimizer *wo = anneal_optimizer_new(&part, anneal_optimizer_config(o));
        if (!wo) st = anneal_last_status();
        if (st == ANNEAL_OK) st = anneal_checkpoint_load_optimizer_part(t->resume_ckpt, &part, wo);
        /* o's state once the first batch is read (the reader's conversion buffers gone) */
        if (st == ANNEAL_OK && j0 == 0) st = anneal_optimizer_init_state(o);
        for (int j = j0; j < j1 && st == ANNEAL_OK; j++) {
            anneal_tp_split sp;
            st = anneal_tp_split_of(view->items[j].name, wide.items[j].tensor, view->items[j].tensor, T, &sp);
            for (int k = 0; k < 2 && st == ANNEAL_OK; k++) {
                anneal_tensor *src = anneal_optimizer_state(wo, j - j0, names[k]);
                anneal_tensor *dst = anneal_optimizer_state(o, j, names[k]);
                st = src && dst ? anneal_tp_slice(src, dst, sp, tpr)
                                : anneal_set_error(ANNEAL_ERR_STATE, "--tp resume: no %s state for %s", names[k],
                                                   view->items[j].name);
            }
            if (st == ANNEAL_OK) st = anneal_optimizer_set_param_steps(o, j, anneal_optimizer_param_steps(wo, j - j0));
        }
        if (st == ANNEAL_OK) step_count = anneal_optimizer_step_count(wo);
        anneal_optimizer_free(wo);
    }
    if (st == ANNEAL_OK) st = anneal_optimizer_set_step_count(o, step_count);
    anneal_memory_category_set(mc);
    free(wide.items);
    anneal_model_free(w);
    return st;
}
