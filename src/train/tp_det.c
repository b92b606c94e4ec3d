/* --deterministic with and without --tp: the model's blocks run their projections in
 * canonical chunks (parallel's tp_det.c: the heads, the same G chunks on every layout,
 * the cross-chunk sums in one fixed tree), and the gradient norm is the one process's
 * arithmetic.
 *
 * One process gets the single-process table (anneal_tp_nn_single: rank 0 of 1) and
 * ctx.deterministic; a --tp shard model gets its group's table and the flag (tp.c's
 * make_shards copies the context). The vocabulary stays whole on every rank under
 * --deterministic (cfg.tp_vocab_whole): the lm head and the fused cross-entropy run
 * replicated, as in one process, instead of split over the group (the vocab-parallel
 * loss has no canonical order yet). The norm: every sharded gradient is gathered whole
 * over the group (anneal_tp_gather) and every parameter's sum of squares taken by the
 * backend over the whole tensor, added in registration order, as optim's
 * anneal_grad_norm does in one process. Cost: one all-gather of the sharded gradients
 * per step, beside the chunks' all-gathers (G/N partials per projection where
 * Megatron all-reduces one). */
#include "train_internal.h"

#include "anneal/backend.h"

#include <stdlib.h>
#include <string.h>

anneal_status anneal_train_tp_det_setup(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    anneal_model *m = t->model;
    if (!c->deterministic || !m) return ANNEAL_OK;
    bool gpt2 = !strcmp(m->cfg.arch, "gpt2"), llama = !strcmp(m->cfg.arch, "llama");
    /* other architectures, LoRA adapters and int8 layers keep their plain blocks (none
     * of them runs with --tp) */
    if ((!gpt2 && !llama) || c->lora_rank > 0 || m->params->quant != ANNEAL_QUANT_NONE) return ANNEAL_OK;
    /* Llama's MLP in gcd(n_ff, n_head) chunks (llama.c): --tp must divide them */
    int a = m->cfg.n_ff, b = m->cfg.n_head, tp = c->tp > 1 ? (int)c->tp : 1;
    while (b) {
        int r = a % b;
        a = b;
        b = r;
    }
    if (llama && a % tp) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--deterministic with --tp %d: the MLP is summed in gcd(n_ff %d, n_head "
                                "%d) = %d canonical chunks, which --tp must divide", tp, m->cfg.n_ff, m->cfg.n_head, a);
    }
    if (!m->ctx.tp) m->ctx.tp = anneal_tp_nn_single(); /* --tp: tp.c's make_shards puts the group's table */
    m->ctx.deterministic = true;
    return ANNEAL_OK;
}

anneal_status anneal_train_tp_det_sumsq(trainer *t, anneal_comm *group, const anneal_tp_split *split, double *total) {
    anneal_params *ps = t->model->params;
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    int64_t n = ps->n > 0 ? ps->n : 1;
    double *ss = calloc((size_t)n, sizeof *ss);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *acc = anneal_empty(ANNEAL_F64, 1, &n);
    anneal_status st = ss && acc && be ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "--tp: out of memory for the norm");
    /* every rank of the group runs every gather, in parameter order (the same gradients
     * exist on every rank: the same graph) */
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
        anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g) continue;
        if (g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g))
            st = anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--tp: the gradient of %s is not contiguous f32",
                                  ps->items[i].name);
        anneal_tensor *whole = g;
        anneal_scope *one = anneal_scope_open(); /* the gathered whole, freed after its sum */
        if (st == ANNEAL_OK && split[i].dim >= 0) {
            int64_t shape[ANNEAL_MAX_DIMS];
            memcpy(shape, g->shape, sizeof(int64_t) * (size_t)g->ndim);
            shape[split[i].dim] *= anneal_comm_size(group);
            whole = anneal_empty(ANNEAL_F32, g->ndim, shape);
            st = whole ? anneal_tp_gather(group, g, whole, split[i]) : anneal_last_status();
        }
        if (st == ANNEAL_OK) st = be->sum_squares(be->ctx, acc, i, whole);
        anneal_scope_close(one);
    }
    if (st == ANNEAL_OK) st = be->copy_to_host(be->ctx, ss, anneal_data(acc), (size_t)ps->n * sizeof *ss);
    if (st == ANNEAL_OK) st = be->synchronize(be->ctx);
    double s = 0;
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++)
        if (ps->items[i].tensor->grad) s += ss[i];
    anneal_scope_close(sc);
    free(ss);
    if (st == ANNEAL_OK) *total = s;
    return st;
}
