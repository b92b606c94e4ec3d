/* Core-internal helpers shared by tensor.c, scope.c and alloc.c. */
#ifndef ANNEAL_CORE_INTERNAL_H
#define ANNEAL_CORE_INTERNAL_H

#include "anneal/core.h"

/* New storage of nbytes on device d (one reference), NULL + ANNEAL_ERR_OOM on failure. */
anneal_storage *anneal_storage_new(anneal_device d, size_t nbytes);
void anneal_storage_retain(anneal_storage *s);
void anneal_storage_release(anneal_storage *s);

/* Registers a newly created tensor (one reference) with the current scope. */
void anneal_scope_register(anneal_tensor *t);
/* Called when a tensor held by a scope is released by something else. */
void anneal_scope_forget(anneal_tensor *t);

/* Autograd hook from tensor release: drop a reference to a node (set by autograd). */
extern void (*anneal_core_node_release_hook)(struct anneal_node *n);

#endif
