/* Autograd-internal entry points shared by engine.c and checkpoint.c. */
#ifndef ANNEAL_AUTOGRAD_INTERNAL_H
#define ANNEAL_AUTOGRAD_INTERNAL_H

#include "anneal/autograd.h"

/* Backward from `out` with gradient `grad`. nested: called from inside another
 * backward (a recompute region), so grad-ready hooks stay silent. */
anneal_status anneal_backward_internal(anneal_tensor *out, anneal_tensor *grad, bool nested);

#endif
