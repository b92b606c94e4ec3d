/* The architectures built into the library, one line each. Adding an architecture is
 * a file in src/models/ defining `const anneal_model_arch anneal_<name>_arch` and its
 * X(...) line here; model.c registers them before the registry is first used, in this
 * order. */
#include "models_internal.h"

#define ANNEAL_BUILTIN_ARCHS(X) \
    X(anneal_gpt2_arch)         \
    X(anneal_llama_arch)        \
    /* one line per architecture, above this comment */

#define ANNEAL_DECLARE_ARCH(a) extern const anneal_model_arch a;
#define ANNEAL_LIST_ARCH(a) &a,
ANNEAL_BUILTIN_ARCHS(ANNEAL_DECLARE_ARCH)

const anneal_model_arch *const anneal_builtin_archs[] = {ANNEAL_BUILTIN_ARCHS(ANNEAL_LIST_ARCH) NULL};
