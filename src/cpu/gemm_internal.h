/* Internals of the CPU SGEMM provider (gemm.c, gemm_avx512.c): the micro-kernel
 * interface, the per-ISA blocking parameters, and an ISA override for tests and
 * benchmarks. Nothing here is part of the public API. */
#ifndef ANNEAL_CPU_GEMM_INTERNAL_H
#define ANNEAL_CPU_GEMM_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

/* Micro-kernel over one MR x NR tile of C:
 *   C[i, j] = alpha * sum_k ap[k*MR + i] * bp[k*NR + j] + beta * C[i, j]   (i < m, j < n)
 * ap is a packed A micro-panel (kc x MR, MR contiguous per k), bp a packed B micro-panel
 * (kc x NR, NR contiguous per k), both zero-padded to the full tile and 64-byte aligned.
 * beta == 0 means C is not read. The sum runs k = 0..kc-1 in order, and every element of
 * the tile gets the same arithmetic whatever m and n are, so edge tiles give the same bits
 * as full ones (this is what makes results independent of the thread partition). */
typedef void (*anneal_gemm_ukernel)(int64_t kc, const float *ap, const float *bp, float *c,
                                    int64_t ldc, int m, int n, float alpha, float beta);

/* Packs consecutive micro-panels of `width` lanes each (mr rows of op(A) or nr columns of
 * op(B)) over kc depths. Lane l (0 <= l < lanes) goes to panel l / width:
 *   dst[(l / width) * kc * width + k * width + l % width] = x(l, k),
 * and the last panel is zero-padded to a whole panel, where
 *   x(l, k) = src[k*stride + l] when lanes_contig (a plain copy per k), and
 *   x(l, k) = src[l*stride + k] otherwise (a transpose).
 * Packing several panels per call lets the copy case read long contiguous rows. */
typedef void (*anneal_gemm_pack)(const float *src, int64_t stride, bool lanes_contig,
                                 int64_t lanes, int width, int64_t kc, float *dst);

/* One instruction-set flavour of the GEMM: its micro-kernel and blocking.
 * kc: largest depth of a packed block (B micro-panel kc x nr sized for L1); the only
 *     blocking parameter that changes the rounding (results depend on it, not on mc/nc);
 * mc: rows of the packed A block streamed against each B micro-panel (mc x kc for L2);
 * nc: columns of the packed B block (kc x nc for L3). */
typedef struct anneal_gemm_isa {
    const char *name;
    int mr, nr;
    int64_t kc, mc, nc;
    anneal_gemm_ukernel kernel;
    anneal_gemm_pack pack;
} anneal_gemm_isa;

enum {
    ANNEAL_GEMM_ISA_AUTO = -1,    /* best the CPU supports (or ANNEAL_CPU_ISA) */
    ANNEAL_GEMM_ISA_PORTABLE = 0, /* plain C, auto-vectorised by the compiler */
    ANNEAL_GEMM_ISA_AVX512 = 1,   /* AVX-512F + FMA intrinsics */
};

/* Forces the ISA of later GEMM calls (ANNEAL_GEMM_ISA_AUTO restores the default choice).
 * Returns 0, or -1 (and changes nothing) if the CPU lacks that ISA. Not thread-safe against
 * concurrent GEMM calls; meant for tests and benchmarks. The environment variable
 * ANNEAL_CPU_ISA=portable|avx512 read at the first call has the same effect. */
int anneal_cpu_sgemm_set_isa(int isa);
/* Name of the ISA the next GEMM call will use ("avx512" or "portable"). */
const char *anneal_cpu_sgemm_isa_name(void);

/* Descriptor of the AVX-512 kernel (gemm_avx512.c); only call its kernel when
 * anneal_cpu_has_avx512() is true. */
extern const anneal_gemm_isa anneal_gemm_isa_avx512;

#endif
