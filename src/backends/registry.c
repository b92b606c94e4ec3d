/* The library's built-in backends, one line each. Core calls
 * anneal_backends_register_builtin once, on the first lookup of a device without a
 * table (see anneal_backend_register). Adding a backend to the library is its folder
 * (src/<name>/, defining `anneal_status anneal_<name>_backend_register(void)`) plus its
 * X(...) line here, under the build condition that compiles it. */
#include "anneal/backend.h"

#ifdef ANNEAL_HAVE_CUDA_BACKEND
#define ANNEAL_CUDA_BACKEND(X) X(anneal_cuda_backend_register)
#else
#define ANNEAL_CUDA_BACKEND(X)
#endif

#define ANNEAL_BUILTIN_BACKENDS(X)      \
    X(anneal_cpu_backend_register)      \
    ANNEAL_CUDA_BACKEND(X)              \
    /* one line per backend, above this comment */

#define ANNEAL_DECLARE_BACKEND(f) anneal_status f(void);
#define ANNEAL_CALL_BACKEND(f) f();
ANNEAL_BUILTIN_BACKENDS(ANNEAL_DECLARE_BACKEND)

void anneal_backends_register_builtin(void) { ANNEAL_BUILTIN_BACKENDS(ANNEAL_CALL_BACKEND) }
