/* The seam between the optimizer (optimizer.c) and its ZeRO variant (zero.c): the
 * ZeRO state hangs off the optimizer, which dispatches step / init_state / free to
 * it, and zero.c reaches the optimizer's state slots and scope through these calls. */
#ifndef ANNEAL_OPTIM_INTERNAL_H
#define ANNEAL_OPTIM_INTERNAL_H

#include "anneal/optim.h"

struct anneal_zero;

/* --- in zero.c */
/* One ZeRO step (o->zero is set): shard update, parameter all-gather, step counts. */
anneal_status anneal_zero_step(anneal_optimizer *o, double lr);
void anneal_zero_free(struct anneal_zero *z);

/* --- in grad_sumsq.c */
/* ss[i] (ps->n entries) = the sum of squares, in double, of parameter i's gradient (0
 * without one), with one copy to the host and one synchronisation per device. Gradients
 * must be f32 (ANNEAL_ERR_DTYPE naming `who` and the parameter otherwise). */
anneal_status anneal_optim_grad_sumsq(const char *who, const anneal_params *ps, double *ss);
/* Parameters whose sums of squares fit a stack buffer (more: malloc), so a training
 * step's clipping makes no system allocation. */
#define ANNEAL_OPTIM_STACK_PARAMS 1024

/* --- in optimizer.c */
struct anneal_zero *anneal_optimizer_zero_(const anneal_optimizer *o);
void anneal_optimizer_set_zero_(anneal_optimizer *o, struct anneal_zero *z);
/* &slot i's state tensor k (0: exp_avg / momentum, 1: exp_avg_sq), growing the slots;
 * NULL + error on OOM or a bad index. */
anneal_tensor **anneal_optimizer_state_slot_(anneal_optimizer *o, int i, int k);
/* The scope that owns the optimizer's state tensors. */
anneal_scope *anneal_optimizer_scope_(anneal_optimizer *o);
anneal_params *anneal_optimizer_params_(const anneal_optimizer *o);

#endif
