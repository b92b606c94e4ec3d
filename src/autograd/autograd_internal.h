/* Autograd-internal entry points shared by engine.c and checkpoint.c. */
#ifndef ANNEAL_AUTOGRAD_INTERNAL_H
#define ANNEAL_AUTOGRAD_INTERNAL_H

#include "anneal/autograd.h"

/* Backward from `out` with gradient `grad`. nested: called from inside another
 * backward (a recompute region), so grad-ready hooks stay silent. */
anneal_status anneal_backward_internal(anneal_tensor *out, anneal_tensor *grad, bool nested);

/* Saved-tensor hooks (node.c): pausing (nests) keeps pack silent, for a recompute
 * region's forward and for backward; unpack_all asks unpack for each saved tensor of
 * node and puts what it gives in the node's place. */
void anneal_saved_hooks_pause(bool pause);
anneal_status anneal_saved_unpack_all(anneal_node *node);

#endif
