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
 * Not for: --tp (the tensor-parallel shard model is cut from the whole one, tp.c),
 * --init (the Hugging Face and checkpoint readers write every parameter) and LoRA
 * (refused with --pp anyway): those build the whole model first, as before. */
#include "train_internal.h"

#include <limits.h>
#include <stdio.h>
#include <sys/stat.h>

int anneal_train_pp_stage_of(int l, int n, int L) {
    if (l < 0) return 0;
    if (l >= L) return n - 1;
    for (int p = 0; p < n; p++) /* stage p runs blocks [p L / N, (p + 1) L / N) (pipeline.c) */
        if (l >= (int)((int64_t)p * L / n) && l < (int)((int64_t)(p + 1) * L / n)) return p;
    return n - 1;
}

bool anneal_train_pp_stage_only(const trainer *t) {
    const anneal_train_config *c = &t->cfg;
    if (!(c->pp > 1 && c->tp <= 1 && !c->init && c->lora_rank == 0 && t->device == ANNEAL_CPU && t->world > 1 &&
          t->world % (int)c->pp == 0))
        return false;
    /* a LoRA checkpoint (its adapter_config.json) resumed without adapters: the whole
     * model, as before (the checkpoint reader then refuses it by name) */
    char p[PATH_MAX + 32];
    struct stat sb;
    return !(t->resume_ckpt[0] && (size_t)snprintf(p, sizeof p, "%s/adapter_config.json", t->resume_ckpt) < sizeof p &&
             stat(p, &sb) == 0);
}

anneal_status anneal_train_pp_hold_stage(trainer *t) {
    anneal_model *m = t->model;
    anneal_params *ps = m->params;
    int n = (int)t->cfg.pp, L = t->mcfg.n_layer, stage = t->rank % n;
    /* a model that cannot be split (refused by pipeline.c's checks): every parameter */
    bool all = !anneal_model_has_stages(m) || n > L;
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_PARAMETERS);
    anneal_scope *s = anneal_scope_open();
    anneal_status st = ANNEAL_OK;
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
        anneal_tensor *x = ps->items[i].tensor;
        int a, b;
        anneal_model_param_span(m, i, &a, &b);
        int sa = anneal_train_pp_stage_of(a, n, L), sb = anneal_train_pp_stage_of(b, n, L);
        /* pipeline.c's holds(): the first stage that uses it, and a tied one's last */
        if (x->storage || !(all || stage == sa || (sa != sb && stage == sb))) continue;
        anneal_tensor *buf = anneal_zeros(x->dtype, x->ndim, x->shape);
        st = buf ? anneal_tensor_set_storage(x, buf, 0) : anneal_last_status();
    }
    anneal_scope_close(s);
    anneal_memory_category_set(mc);
    return st;
}
