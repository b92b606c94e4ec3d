/* The trainer's side of --zero 3 (parameters sharded, src/parallel/zero3.c): what it
 * needs from the other settings, and its figures for the distributed memory report
 * (dist.c makes the sharded parameters and gathers them around checkpoints and
 * samples). */
#include "train_internal.h"

#include <string.h>

anneal_status anneal_train_zero3_check(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    *usage = true;
    /* a block's parameters are gathered around its forward; backward must run that
     * forward again (recompute) rather than keep activations that point into them */
    if (t->model->cfg.recompute != ANNEAL_RECOMPUTE_BLOCK)
        return anneal_set_error(ANNEAL_ERR_ARG, "--zero 3 needs --recompute block (each block's parameters are "
                                                "gathered for its forward and again for its recompute in backward)");
    if (c->grad_compress && strcmp(c->grad_compress, "none"))
        return anneal_set_error(ANNEAL_ERR_ARG, "--zero 3 with --grad-compress %s: not available (PowerSGD keeps "
                                                "full-size error feedback per rank)", c->grad_compress);
    if (c->offload && strcmp(c->offload, "none"))
        return anneal_set_error(ANNEAL_ERR_ARG, "--zero 3 with --offload %s: not available (the offloaded optimizer "
                                                "steps full parameters, ZeRO-3 keeps only a shard)", c->offload);
    *usage = false;
    return ANNEAL_OK;
}

/* Parameters: zero3's peak (the device's parameter category at each of its
 * allocations; only zero3 allocates parameters once it runs). Gradients: the peak of the
 * device's gradient category (the .grad tensors backward makes; no gradient exists
 * before the first backward, so the peak is the run's) plus the rank's gradient shard.
 * The sync's bucket buffers in flight are not in either figure. */
void anneal_train_zero3_memory(const trainer *t, double out[2]) {
    if (!t->z3) return;
    anneal_memory_categories mc = anneal_memory_categories_get(anneal_model_device(t->model));
    out[0] = (double)anneal_zero3_memory_get(t->z3).peak_param_bytes;
    out[1] = (double)(mc.peak[ANNEAL_MEM_GRADIENTS] + anneal_ddp_shard_numel(t->ddp) * 4);
}
