/* The seam between the optimizer (optimizer.c) and its variants (today ZeRO, zero.c):
 * a variant installs its step / init_state / free and its state on an optimizer, which
 * calls them instead of its own without knowing the variant (zero.c depends on
 * optimizer.c, never the reverse), and reaches the optimizer's state slots and scope
 * through the calls below. */
#ifndef ANNEAL_OPTIM_INTERNAL_H
#define ANNEAL_OPTIM_INTERNAL_H

#include "anneal/optim.h"

/* What a variant does in place of the optimizer's own step and init_state (both
 * called with the variant's state installed), and how its state is freed (with the
 * optimizer). */
typedef struct anneal_optimizer_variant {
    const char *name;
    anneal_status (*step)(anneal_optimizer *o, double lr);
    anneal_status (*init_state)(anneal_optimizer *o);
    void (*free_state)(void *state);
} anneal_optimizer_variant;

/* --- in grad_sumsq.c */
/* ss[i] (ps->n entries) = the sum of squares, in double, of parameter i's gradient (0
 * without one), with one copy to the host and one synchronisation per device. Gradients
 * must be f32 (ANNEAL_ERR_DTYPE naming `who` and the parameter otherwise). */
anneal_status anneal_optim_grad_sumsq(const char *who, const anneal_params *ps, double *ss);
/* Parameters whose sums of squares fit a stack buffer (more: malloc), so a training
 * step's clipping makes no system allocation. */
#define ANNEAL_OPTIM_STACK_PARAMS 1024

/* --- in optimizer.c */
/* Installs variant v with its state on o (freed by v->free_state with o). */
void anneal_optimizer_set_variant(anneal_optimizer *o, const anneal_optimizer_variant *v, void *state);
/* The state of o's variant v, or NULL when o has another variant or none. */
void *anneal_optimizer_variant_state(const anneal_optimizer *o, const anneal_optimizer_variant *v);
/* &slot i's state tensor k (0: exp_avg / momentum, 1: exp_avg_sq), growing the slots;
 * NULL + error on OOM or a bad index. */
anneal_tensor **anneal_optimizer_state_slot(anneal_optimizer *o, int i, int k);
/* The scope that owns the optimizer's state tensors. */
anneal_scope *anneal_optimizer_state_scope(anneal_optimizer *o);
anneal_params *anneal_optimizer_param_set(const anneal_optimizer *o);

#endif
