/* Internals of the CPU GEMM provider (gemm.c, gemm_avx512.c, gemm_avx512bf16.c,
 * gemm_avx2.c, gemm_precision.c): the micro-kernel and packing interfaces, the per-ISA
 * blocking parameters, operand rounding, the fused epilogue, and an ISA override for tests
 * and benchmarks. Nothing here is part of the public API. */
#ifndef ANNEAL_CPU_GEMM_INTERNAL_H
#define ANNEAL_CPU_GEMM_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "cpu/cpu_kernels.h"

/* How packing rounds the f32 operands (the compute precision of the product). */
enum {
    ANNEAL_GEMM_ROUND_NONE = 0, /* f32 as is */
    ANNEAL_GEMM_ROUND_BF16 = 1, /* nearest-even bf16 (NaN stays NaN), kept as f32 */
    ANNEAL_GEMM_ROUND_F16 = 2,  /* nearest-even f16, overflow to +-inf, kept as f32 */
};

/* Micro-kernel over one MR x NR tile of C:
 *   C[i, j] = alpha * sum_k ap(k, i) * bp(k, j) + beta * C[i, j]   (i < m, j < n)
 * ap is a packed A micro-panel (kc x MR), bp a packed B micro-panel (kc x NR), both
 * zero-padded to the full tile and 64-byte aligned; their element type and layout belong
 * to the ISA (f32: ap[k*MR + i], bp[k*NR + j]; bf16 pairs: see gemm_avx512bf16.c), kc is
 * a multiple of the ISA's kstep. beta == 0 means C is not read. The sum runs over k in
 * order, and every element of the tile gets the same arithmetic whatever m and n are, so
 * edge tiles give the same bits as full ones (this is what makes results independent of
 * the thread partition). */
typedef void (*anneal_gemm_ukernel)(int64_t kc, const void *ap, const void *bp, float *c,
                                    int64_t ldc, int m, int n, float alpha, float beta);

/* Packs consecutive micro-panels of `width` lanes each (mr rows of op(A) or nr columns of
 * op(B)) over kc depths, rounding each value as `round` says (ANNEAL_GEMM_ROUND_*; an ISA
 * with a non-f32 element type rounds to that type and ignores it). For the f32 layout,
 * lane l (0 <= l < lanes) goes to panel l / width:
 *   dst[(l / width) * kc * width + k * width + l % width] = round(x(l, k)),
 * and the last panel is zero-padded to a whole panel (and the depth to a multiple of the
 * ISA's kstep), where
 *   x(l, k) = src[k*stride + l] when lanes_contig (a plain copy per k), and
 *   x(l, k) = src[l*stride + k] otherwise (a transpose).
 * Packing several panels per call lets the copy case read long contiguous rows. */
typedef void (*anneal_gemm_pack)(const float *src, int64_t stride, bool lanes_contig,
                                 int64_t lanes, int width, int64_t kc, int round, void *dst);

/* One instruction-set flavour of the GEMM: its micro-kernel and blocking.
 * kc: largest depth of a packed block (B micro-panel kc x nr sized for L1); the only
 *     blocking parameter that changes the rounding (results depend on it, not on mc/nc);
 * mc: rows of the packed A block streamed against each B micro-panel (mc x kc for L2);
 * nc: columns of the packed B block (kc x nc for L3);
 * esize: bytes per packed element; kstep: packed depths are padded to a multiple of it. */
typedef struct anneal_gemm_isa {
    const char *name;
    int mr, nr;
    int64_t kc, mc, nc;
    int esize, kstep;
    anneal_gemm_ukernel kernel;
    anneal_gemm_pack pack;   /* B micro-panels, and A's unless pack_a is set */
    anneal_gemm_pack pack_a; /* NULL, or A micro-panels in a layout of the ISA's own (AMX: rows of depth pairs) */
} anneal_gemm_isa;

enum {
    ANNEAL_GEMM_ISA_AUTO = -1,    /* best the CPU supports (or ANNEAL_CPU_ISA) */
    ANNEAL_GEMM_ISA_PORTABLE = 0, /* plain C, auto-vectorised by the compiler */
    ANNEAL_GEMM_ISA_AVX512 = 1,   /* AVX-512F + FMA intrinsics (+ AVX512-BF16 for bf16) */
    ANNEAL_GEMM_ISA_AVX2 = 2,     /* AVX2 + FMA + F16C intrinsics */
};

/* Forces the ISA of later GEMM calls (ANNEAL_GEMM_ISA_AUTO restores the default choice).
 * Returns 0, or -1 (and changes nothing) if the CPU lacks that ISA. Not thread-safe against
 * concurrent GEMM calls; meant for tests and benchmarks. The environment variable
 * ANNEAL_CPU_ISA=portable|avx2|avx512 read at the first call has the same effect. */
int anneal_cpu_sgemm_set_isa(int isa);
/* Name of the ISA the next f32 GEMM call will use ("avx512", "avx2" or "portable"). */
const char *anneal_cpu_sgemm_isa_name(void);
/* Name of the kernel a GEMM at `compute` precision (an anneal_dtype) will use: the f32
 * ISA's name, or "amx" / "avx512bf16" for bf16 on the tile unit / the AVX512-BF16 kernel. */
const char *anneal_cpu_gemm_kernel_name(int compute);
/* Allows (true, the default) or forbids the bf16 kernels (AMX, AVX512-BF16); when
 * forbidden, bf16 products round the operands while packing and run the f32 kernel. For
 * tests. */
void anneal_cpu_gemm_allow_bf16_kernel(bool allow);
/* For tests: every bf16 product (anneal_cpu_gemm, _packed, _pack_b) runs on isa (NULL:
 * the normal choice again), e.g. &anneal_gemm_isa_amx_model on a CPU without AMX. Not
 * thread-safe against concurrent GEMM calls. */
void anneal_cpu_gemm_set_bf16_isa(const anneal_gemm_isa *isa);

/* CPU features beyond anneal_cpu_has_avx512 (cpu_features.c), each checked once:
 * AVX2 + FMA + F16C, and AVX512-BF16 (with AVX-512F/BW/VL). */
bool anneal_cpu_has_avx2(void);
bool anneal_cpu_has_avx512bf16(void);

/* Descriptors of the kernels (gemm_avx512.c, gemm_avx512bf16.c, gemm_avx2.c); only call
 * one when the matching anneal_cpu_has_* is true. */
extern const anneal_gemm_isa anneal_gemm_isa_avx512;
extern const anneal_gemm_isa anneal_gemm_isa_avx512bf16;
extern const anneal_gemm_isa anneal_gemm_isa_avx2;
/* The AMX-BF16 kernel (gemm_amx.c; only where anneal_cpu_amx_usable()), and the same
 * kernel body over a C model of the tile registers, which runs on any CPU (tests). */
extern const anneal_gemm_isa anneal_gemm_isa_amx;
extern const anneal_gemm_isa anneal_gemm_isa_amx_model;

/* The bits of bf16(x) (as an f32) from the bits u of x: nearest even, overflow to inf; a
 * NaN is made quiet, keeping its sign and top payload. Branch-free, so loops over it
 * vectorise. */
static inline uint32_t anneal_gemm_round_bf16_bits(uint32_t u) {
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t q = (u | 0x00400000u) & 0xffff0000u;
    return (u & 0x7fffffffu) > 0x7f800000u ? q : r;
}

/* Scalar operand rounding (the reference the vector packers match bit for bit). */
static inline float anneal_gemm_round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = anneal_gemm_round_bf16_bits(u);
    memcpy(&x, &u, 4);
    return x;
}
/* Nearest-even f16 (overflow to inf, f16 subnormals kept), as f32. */
float anneal_gemm_round_f16(float x);
/* round(x) for one ANNEAL_GEMM_ROUND_* mode. */
static inline float anneal_gemm_round(float x, int round) {
    return round == ANNEAL_GEMM_ROUND_BF16  ? anneal_gemm_round_bf16(x)
           : round == ANNEAL_GEMM_ROUND_F16 ? anneal_gemm_round_f16(x)
                                            : x;
}
/* dst[i] = round(src[i]) for n floats (vectorised where the CPU allows; dst may be src). */
void anneal_gemm_round_array(int64_t n, const float *src, float *dst, int round);
/* The f16 case with F16C (gemm_avx2.c); only when anneal_cpu_has_avx2(). */
void anneal_gemm_round_f16_avx2(int64_t n, const float *src, float *dst);
/* acc[j] += ak * f16(b[j]) for n floats, with F16C (gemm_avx2.c); only when
 * anneal_cpu_has_avx2(). The product and the sum are rounded separately (no FMA), as in
 * the portable loop. */
void anneal_gemm_axpy_f16_avx2(int64_t n, float ak, const float *b, float *acc);

/* The epilogue (cpu_kernels.h) over an m x n tile of C at c (row stride ldc): bias points at
 * the tile's first column's bias (or NULL), pre and mul at the tile's first element of the
 * pre-activation and of the SiLU multiplier (or NULL; row stride ldc). mul non-NULL selects
 * the SiLU-times-multiplier epilogue (ep->gelu_tanh is then ignored). The GELU is
 * bit-identical to anneal_cpu_gelu_fwd(..., tanh_approx = true), the SiLU to
 * anneal_cpu_silu_fwd. */
void anneal_gemm_epilogue_tile(const anneal_gemm_epilogue *ep, int64_t m, int64_t n, float *c,
                               int64_t ldc, const float *bias, float *pre, const float *mul);
/* True when ep does something to C. */
static inline bool anneal_gemm_epilogue_active(const anneal_gemm_epilogue *ep) {
    return ep && (ep->bias || ep->gelu_tanh || ep->silu_mul);
}

#endif
