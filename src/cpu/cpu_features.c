/* Runtime CPU feature detection for the CPU backend's ISA dispatch. */
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"

#include <stdatomic.h>

/* Each answer is cached after the first call (a benign race: every thread computes the
 * same value). __builtin_cpu_supports checks both CPUID and the OS-enabled register
 * state. */
static bool cached_feature(atomic_int *cached, int (*probe)(void)) {
    int v = atomic_load_explicit(cached, memory_order_relaxed);
    if (v < 0) {
        __builtin_cpu_init();
        v = probe() ? 1 : 0;
        atomic_store_explicit(cached, v, memory_order_relaxed);
    }
    return v == 1;
}

static int probe_avx512(void) { return __builtin_cpu_supports("avx512f"); }
static int probe_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
static int probe_avx512bf16(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
}

/* True when the running CPU (and OS) support AVX-512F. */
bool anneal_cpu_has_avx512(void) {
    static atomic_int cached = -1;
    return cached_feature(&cached, probe_avx512);
}

/* True with AVX2, FMA and F16C (the AVX2 GEMM kernel's needs). */
bool anneal_cpu_has_avx2(void) {
    static atomic_int cached = -1;
    return cached_feature(&cached, probe_avx2);
}

/* True with AVX512-BF16 (and the AVX-512 F/BW/VL/DQ the bf16 GEMM kernel also uses). */
bool anneal_cpu_has_avx512bf16(void) {
    static atomic_int cached = -1;
    return cached_feature(&cached, probe_avx512bf16);
}
