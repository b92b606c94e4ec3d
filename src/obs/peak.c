/* Machine figures for the run summary and MFU: the peak FMA rate and the peak bf16
 * dot-product rate (measured, since the nominal clock of a shared or throttled CPU says
 * little) and the peak RSS. */
#include "anneal/backend.h"
#include "anneal/obs.h"

#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

/* The kernels run `iters` rounds of 12 independent FMA chains (enough to cover the
 * 4-cycle latency on two FMA ports) and return a value that depends on every result,
 * so the compiler keeps them. Flops per round: 12 chains x lanes x 2. */
#define CHAINS 12

__attribute__((target("avx512f"))) static float fma_avx512(int64_t iters, float seed) {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps(seed + (float)c);
    for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    __m512 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static float fma_avx2(int64_t iters, float seed) {
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps(seed + (float)c);
    for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    __m256 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm256_add_ps(s, acc[c]);
    float v[8];
    _mm256_storeu_ps(v, s);
    return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

static float fma_scalar(int64_t iters, float seed) {
    float acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = seed + (float)c;
    for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * 0.999999f + 1e-7f;
    float s = 0;
    for (int c = 0; c < CHAINS; c++) s += acc[c];
    return s;
}

/* The bf16 kernel: BF16_CHAINS independent VDPBF16PS chains (the instruction's latency,
 * up to 6 cycles, times two ports needs 12; 16 leaves margin). Each instruction does, per
 * f32 lane, two bf16 multiply-adds: 4 FLOPs per lane, 64 per zmm instruction. */
#define BF16_CHAINS 16
#define BF16_FLOPS_PER_INSN (16 * 4)

__attribute__((target("avx512f,avx512bf16"))) static float dot_bf16_avx512(int64_t iters,
                                                                           float seed) {
    __m512 acc[BF16_CHAINS];
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999f), _mm512_set1_ps(0.999f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7f), _mm512_set1_ps(1e-7f));
    for (int c = 0; c < BF16_CHAINS; c++) acc[c] = _mm512_set1_ps(seed + (float)c);
    for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 16
        for (int c = 0; c < BF16_CHAINS; c++) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
    __m512 s = acc[0];
    for (int c = 1; c < BF16_CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}

/* Which microbenchmark runs: 4 AMX tiles, 3 bf16 dot products, 2 AVX-512 FMA, 1 AVX2 FMA,
 * 0 scalar. */
static float run_kernel(int kind, int64_t iters, float seed) {
    return kind == 4   ? anneal_cpu_amx_peak_loop(iters) + seed
           : kind == 3 ? dot_bf16_avx512(iters, seed)
           : kind == 2 ? fma_avx512(iters, seed)
           : kind == 1 ? fma_avx2(iters, seed)
                       : fma_scalar(iters, seed);
}

/* FLOPs per round of a kernel. */
static double flops_per_iter(int kind) {
    return kind == 4   ? 4 * 16.0 * 16.0 * 32.0 * 2.0 /* four TDPBF16PS of 16 x 16 x 32 */
           : kind == 3 ? (double)BF16_CHAINS * BF16_FLOPS_PER_INSN
           : kind == 2 ? CHAINS * 16 * 2.0
           : kind == 1 ? CHAINS * 8 * 2.0
                       : CHAINS * 2.0;
}

/* The calling thread's CPU time in seconds. */
static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Times kernel `kind`: calibrated on one thread to about seconds / 8, then all threads
 * together on a fixed amount of about `seconds`, best of three. Returns GFLOP/s: the sum
 * over threads of each one's work over its own CPU time, so a thread the OS parks to run
 * another process (a shared machine, a build beside the run) does not lower the ceiling.
 * Measured by wall time, one such disturbance at start-up halved the peak and a
 * training run printed MFU 114-123%. */
static double measure(int kind, int threads, double seconds) {
    if (threads <= 0) threads = omp_get_max_threads();
    if (seconds <= 0) seconds = 0.05;
    int64_t iters = 1 << 14;
    double t;
    volatile float sink = 0;
    for (;;) {
        double t0 = thread_cpu_s();
        sink += run_kernel(kind, iters, 1);
        t = thread_cpu_s() - t0;
        if (t > seconds / 8 || iters > ((int64_t)1 << 40)) break;
        iters *= 2;
    }
    int64_t n = (int64_t)((double)iters * (seconds / (t > 0 ? t : 1e-9)));
    if (n < 1) n = 1;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double gf = 0;
#pragma omp parallel num_threads(threads) reduction(+ : gf)
        {
            double t0 = thread_cpu_s();
            float r = run_kernel(kind, n, (float)omp_get_thread_num());
            double dt = thread_cpu_s() - t0;
#pragma omp critical
            sink += r;
            gf = (double)n * flops_per_iter(kind) / (dt > 0 ? dt : 1e-9) / 1e9;
        }
        if (gf > best) best = gf;
    }
    (void)sink;
    return best;
}

/* The ISA cap the kernels obey (ANNEAL_ISA, anneal_cpu_isa_limit_name): 0 portable,
 * 1 avx2, 2 avx512, 3 avx512bf16, 4 amx, 5 none; the peak is the ceiling of what may run. */
static int isa_cap(void) {
    static const char *levels[] = {"portable", "avx2", "avx512", "avx512bf16", "amx"};
    const char *n = anneal_cpu_isa_limit_name(NULL);
    for (int i = 0; n && i < 5; i++)
        if (!strcmp(n, levels[i])) return i;
    return 5;
}

/* The FMA kernel this CPU runs best under the cap (2 AVX-512, 1 AVX2, 0 scalar) and its name. */
static int fma_kind(const char **isa) {
    __builtin_cpu_init();
    const int cap = isa_cap();
    int kind = __builtin_cpu_supports("avx512f") && cap >= 2                                   ? 2
               : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cap >= 1 ? 1
                                                                                             : 0;
    if (isa) *isa = kind == 2 ? "avx512 fma" : kind == 1 ? "avx2 fma" : "scalar";
    return kind;
}

double anneal_peak_gflops_measure(int threads, double seconds, const char **isa) {
    return measure(fma_kind(isa), threads, seconds);
}

/* bf16 on a CPU with AMX: the tiles (what the bf16 GEMM runs on there); where the bf16
 * GEMM runs VDPBF16PS (anneal_cpu_bf16_dot_preferred): the dot-product kernel; otherwise
 * (and for f32 and f16, whose GEMMs run on f32 FMAs) the FMA kernel. */
double anneal_peak_gflops_measure_dtype(int threads, double seconds, anneal_dtype dt,
                                        const char **isa) {
    __builtin_cpu_init();
    if (dt == ANNEAL_BF16 && isa_cap() >= 4 && anneal_cpu_amx_usable()) {
        if (isa) *isa = "amx tiles (TDPBF16PS)";
        return measure(4, threads, seconds);
    }
    if (dt == ANNEAL_BF16 && anneal_cpu_bf16_dot_preferred()) {
        if (isa) *isa = "avx512bf16 dot-product";
        return measure(3, threads, seconds);
    }
    if (dt == ANNEAL_BF16) {
        int kind = fma_kind(NULL);
        const bool slow_dot = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") && isa_cap() >= 3;
        if (isa) *isa = kind == 2 ? (slow_dot ? "avx512 fma (bf16 products on f32 FMA: VDPBF16PS is half its rate here)"
                                              : "no avx512bf16: avx512 fma")
                        : kind == 1 ? "no avx512bf16: avx2 fma" : "no avx512bf16: scalar";
        return measure(kind, threads, seconds);
    }
    return anneal_peak_gflops_measure(threads, seconds, isa);
}

int64_t anneal_peak_rss_bytes(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (int64_t)ru.ru_maxrss * 1024;
}
