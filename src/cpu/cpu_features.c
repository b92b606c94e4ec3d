/* Runtime CPU feature detection for the CPU backend's ISA dispatch. */
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "cpu/gemm_int8_internal.h"

#include <cpuid.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
/* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports has no "f16c"
 * (the OS state it needs is AVX's, which the "avx2" check covers). */
static int probe_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
static int probe_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && probe_f16c();
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

/* Intel cores issue VDPBF16PS on one port and f32 FMA on two, so there the f32 kernel over
 * bf16-rounded operands runs bf16 products at twice the dot-product kernel's rate (anneal
 * bench peak on 2 cores of a Xeon with AVX512-BF16: 330 GFLOP/s FMA, 165 VDPBF16PS). */
static int probe_intel(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu; /* "Genu" "ineI" "ntel" */
}

bool anneal_cpu_bf16_dot_preferred(void) {
    if (!anneal_cpu_has_avx512() || !anneal_cpu_has_avx512bf16()) return false;
    const int limit = anneal_cpu_isa_limit();
    if (limit == ANNEAL_ISA_AVX512BF16) return true; /* named: forced, for tests and comparisons */
    if (limit < ANNEAL_ISA_AVX512BF16) return false;
    static atomic_int cached = -1;
    return !cached_feature(&cached, probe_intel);
}

/* ------------------------------------------------------- the ISA limit */

static const char *const isa_levels[] = {"portable", "avx2", "avx512", "avx512bf16", "amx"};

/* The variable in force and its value (ANNEAL_ISA wins over the older ANNEAL_CPU_ISA). */
static const char *isa_env(const char **name) {
    const char *v = getenv("ANNEAL_ISA");
    *name = "ANNEAL_ISA";
    if (!v || !*v) {
        v = getenv("ANNEAL_CPU_ISA");
        *name = "ANNEAL_CPU_ISA";
    }
    return v && *v ? v : NULL;
}

static int parse_level(const char *v) {
    for (int i = 0; i < (int)(sizeof isa_levels / sizeof isa_levels[0]); i++)
        if (strcmp(v, isa_levels[i]) == 0) return i;
    return -1;
}

int anneal_cpu_isa_limit(void) {
    const char *name, *v = isa_env(&name);
    int l = v ? parse_level(v) : -1;
    return l < 0 ? ANNEAL_ISA_BEST : l;
}

const char *anneal_cpu_isa_level_name(int level) {
    return level >= 0 && level < ANNEAL_ISA_BEST ? isa_levels[level] : "best";
}

const char *anneal_cpu_isa_env_error(void) {
    static _Thread_local char msg[256];
    const char *name, *v = isa_env(&name);
    if (!v || parse_level(v) >= 0) return NULL;
    snprintf(msg, sizeof msg, "%s=%.64s: not an instruction-set level (portable, avx2, avx512, avx512bf16 or amx)",
             name, v);
    return msg;
}

static int probe_amx(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const unsigned need = (1u << 22) | (1u << 24) | (1u << 25); /* amx-bf16, amx-tile, amx-int8 */
    if ((d & need) != need) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & (3u << 17)) == (3u << 17); /* XTILECFG, XTILEDATA enabled by the OS */
}

bool anneal_cpu_has_amx(void) {
    static atomic_int cached = -1;
    return cached_feature(&cached, probe_amx);
}

/* --------------------------------------------------------- paths taken */

static atomic_uint paths_taken[ANNEAL_CPU_OP_COUNT];

/* Records that op ran the path (cheap when already recorded: one relaxed load). */
void anneal_cpu_path_note(int op, unsigned path) {
    if (op < 0 || op >= ANNEAL_CPU_OP_COUNT) return;
    if ((atomic_load_explicit(&paths_taken[op], memory_order_relaxed) & path) != path)
        atomic_fetch_or_explicit(&paths_taken[op], path, memory_order_relaxed);
}

/* The ANNEAL_CPU_PATH_* bits op has run since the last reset. */
unsigned anneal_cpu_paths_taken(int op) {
    return op < 0 || op >= ANNEAL_CPU_OP_COUNT ? 0 : atomic_load_explicit(&paths_taken[op], memory_order_relaxed);
}

/* Forgets every recorded path. */
void anneal_cpu_paths_reset(void) {
    for (int i = 0; i < ANNEAL_CPU_OP_COUNT; i++) atomic_store_explicit(&paths_taken[i], 0, memory_order_relaxed);
}

/* The kernel family's name ("?" when out of range). */
const char *anneal_cpu_op_name(int op) {
    static const char *names[ANNEAL_CPU_OP_COUNT] = {"gemm f32", "gemm bf16", "gemm f16", "attention f32",
                                                      "attention bf16"};
    return op < 0 || op >= ANNEAL_CPU_OP_COUNT ? "?" : names[op];
}

/* The name of one ANNEAL_CPU_PATH_* bit ("?" otherwise). */
const char *anneal_cpu_path_name(unsigned path) {
    return path == ANNEAL_CPU_PATH_PORTABLE     ? "portable"
           : path == ANNEAL_CPU_PATH_AVX2       ? "avx2"
           : path == ANNEAL_CPU_PATH_AVX512     ? "avx512"
           : path == ANNEAL_CPU_PATH_AVX512BF16 ? "avx512bf16"
           : path == ANNEAL_CPU_PATH_AMX        ? "amx"
                                                : "?";
}

static int probe_avx512vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* True with AVX-512 F/BW/VL and VNNI (the int8 GEMM's vpdpbusd kernel, the weight-only kernel). */
bool anneal_cpu_has_avx512vnni(void) {
    static atomic_int cached = -1;
    return cached_feature(&cached, probe_avx512vnni);
}
