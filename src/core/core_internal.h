/* Core-internal helpers shared by tensor.c, scope.c, alloc.c and pool.c. */
#ifndef ANNEAL_CORE_INTERNAL_H
#define ANNEAL_CORE_INTERNAL_H

#include "anneal/core.h"

/* New storage of nbytes on device d (one reference), NULL + ANNEAL_ERR_OOM on failure. */
anneal_storage *anneal_storage_new(anneal_device d, size_t nbytes);
/* The same, preferring memory the backend hands out zeroed (alloc_zeroed); *zeroed
 * tells whether it did (else the caller fills the block). */
anneal_storage *anneal_storage_new_zeroed(anneal_device d, size_t nbytes, bool *zeroed);
void anneal_storage_retain(anneal_storage *s);
void anneal_storage_release(anneal_storage *s);

/* Frees the scopes kept for reuse (scope.c). */
void anneal_scope_release_cache(void);

/* Registers a newly created tensor (one reference) with the current scope. */
void anneal_scope_register(anneal_tensor *t);
/* Called when a tensor held by a scope is released by something else. */
void anneal_scope_forget(anneal_tensor *t);


/* Marks a cached block unusable (POISON) or usable again (UNPOISON) for AddressSanitizer,
 * so a use after release into the allocator's or the pool's cache is reported; no-ops in
 * other builds. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#endif
