/* Runtime CPU feature detection for the CPU backend's ISA dispatch. */
#include "cpu/cpu_kernels.h"

#include <stdatomic.h>

/* True when the running CPU (and OS) support AVX-512F. __builtin_cpu_supports checks
 * both CPUID and the OS-enabled register state; the answer is cached after the first
 * call (a benign race: every thread computes the same value). */
bool anneal_cpu_has_avx512(void) {
    static atomic_int cached = -1;
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512f") ? 1 : 0;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v == 1;
}
