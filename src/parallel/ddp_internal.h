/* Hooks of the gradient sync used by the ZeRO optimizer (src/optim/zero.c): the
 * shard as a tensor, gathering any shard-layout buffer back into full per-parameter
 * arrays, and the state-bytes figure reported by anneal_ddp_memory_get. */
#ifndef ANNEAL_DIST_DDP_INTERNAL_H
#define ANNEAL_DIST_DDP_INTERNAL_H

#include "anneal/parallel.h"

/* The ZeRO stage d was made with. */
int anneal_ddp_stage_(const anneal_ddp *d);
/* The parameter set d synchronises. */
anneal_params *anneal_ddp_params_(const anneal_ddp *d);
/* The rank's mean-gradient shard as a 1-D f32 tensor of shard_numel elements (NULL
 * when the shard is empty); owned by d. */
anneal_tensor *anneal_ddp_shard_grad_tensor_(anneal_ddp *d);
/* True once anneal_ddp_finish has left synchronised gradients (cleared by the next
 * synchronising anneal_ddp_begin_backward). */
bool anneal_ddp_synced_(const anneal_ddp *d);
/* Collective: every rank's shard (a 1-D f32 tensor in shard layout, shard_numel long,
 * on the parameters' device; NULL when the shard is empty) is gathered into the full
 * tensors dst[i] (parameter i's shape, f32, on that device) for every parameter. */
anneal_status anneal_ddp_gather_shard_(anneal_ddp *d, const anneal_tensor *shard, anneal_tensor *const *dst);
/* Optimizer-state bytes a ZeRO optimizer holds for d (reported in the memory figures). */
void anneal_ddp_set_state_bytes_(anneal_ddp *d, int64_t bytes);

#endif
