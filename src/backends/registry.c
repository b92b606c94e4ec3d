/* The library's built-in backends, one registration line each. Core calls this once,
 * on the first lookup of a device without a table (see anneal_backend_register):
 * adding a backend to the library is its folder plus one line here. */
#include "anneal/backend.h"

anneal_status anneal_cpu_backend_register(void); /* src/cpu/cpu_backend.c */
#ifdef ANNEAL_HAVE_CUDA
/* anneal_status anneal_cuda_backend_register(void); */ /* src/cuda/cuda_backend.c */
#endif

void anneal_backends_register_builtin(void) {
    anneal_cpu_backend_register();
#ifdef ANNEAL_HAVE_CUDA
    /* anneal_cuda_backend_register(); */
#endif
}
