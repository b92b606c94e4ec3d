/* Internals shared by the CPU attention kernels: attention.c (f32 tiles, dispatch),
 * attention_bf16.c (bf16 operands on the f32 tile code) and attention_avx512bf16.c
 * (bf16 operands on VDPBF16PS). Nothing here is part of the public API. */
#ifndef ANNEAL_CPU_ATTENTION_INTERNAL_H
#define ANNEAL_CPU_ATTENTION_INTERNAL_H

#include <stddef.h>

#include "cpu/cpu_kernels.h"

enum { ANNEAL_ATTN_BQ = 64, ANNEAL_ATTN_BK = 64 }; /* query / key tile sizes */

/* C[M x N] (= or +=) A[M x K] @ B[K x N]. A(i, k) = A[i*a_rs + k*a_cs] (so A may be a
 * transposed view); B rows have stride ldb, C rows ldc; the last dims are contiguous. */
typedef void (*anneal_attn_gemm_fn)(int M, int N, int K, const float *A, int64_t a_rs,
                                    int64_t a_cs, const float *B, int64_t ldb, float *C,
                                    int64_t ldc, bool accumulate);
/* x[j] = exp(a * x[j] - b) for j < n; returns the sum of the new x. */
typedef float (*anneal_attn_exp_fn)(float *x, int n, float a, float b);
/* Largest of x[0..n), n >= 1 (NaN-ignoring like fmaxf). */
typedef float (*anneal_attn_max_fn)(const float *x, int n);

/* The f32 tile kernels of one instruction set. */
typedef struct anneal_attn_isa {
    anneal_attn_gemm_fn gemm;
    anneal_attn_exp_fn exp_row;
    anneal_attn_max_fn row_max;
} anneal_attn_isa;

/* The f32 tile kernels for this CPU: AVX-512, else AVX2 + FMA, else portable C, the best
 * at or below the ISA limit (anneal_cpu_isa_limit, read at every call); the choice is
 * recorded as a path of op (ANNEAL_CPU_OP_ATTN_F32 or _BF16; -1: not recorded). */
const anneal_attn_isa *anneal_attn_pick_isa(int op);
#if defined(__x86_64__) || defined(__i386__)
/* The AVX2 + FMA tile kernels (attention_avx2.c); only when anneal_cpu_has_avx2(). */
extern const anneal_attn_isa anneal_attn_isa_avx2;
#endif

/* This thread's attention workspace of at least nfloats 4-byte words, 64-byte aligned,
 * kept between calls (freed when the thread ends); NULL when out of memory. One buffer
 * per thread, shared by all the attention kernels (never used by two at once). */
float *anneal_attn_alloc(size_t nfloats);

/* Key/value heads of d: Hkv, or H when Hkv is 0 (or, a caller error, does not divide H). */
static inline int64_t anneal_attn_kv_heads(const anneal_cpu_attn_desc *d) {
    const int64_t hkv = d->Hkv;
    return hkv > 0 && hkv <= d->H && d->H % hkv == 0 ? hkv : d->H;
}

/* The key/value head query head h reads: h / (H / Hkv). */
static inline int64_t anneal_attn_kv_head(const anneal_cpu_attn_desc *d, int64_t h) {
    return h / (d->H / anneal_attn_kv_heads(d));
}

/* Number of keys query row i may see: Tk, or i + (Tk - Tq) + 1 clamped to [0, Tk]. */
static inline int64_t anneal_attn_visible(const anneal_cpu_attn_desc *d, int64_t i) {
    if (!d->causal) return d->Tk;
    int64_t n = i + (d->Tk - d->Tq) + 1;
    return n < 0 ? 0 : n > d->Tk ? d->Tk : n;
}

/* Columns of row i of a key tile starting at k0 with nk keys that the row sees. */
static inline int anneal_attn_row_keys(const anneal_cpu_attn_desc *d, int64_t i, int64_t k0,
                                       int nk) {
    int64_t nv = anneal_attn_visible(d, i) - k0;
    return nv < 0 ? 0 : nv > nk ? nk : (int)nv;
}

/* The bf16 attention (see attention_bf16.c for the arithmetic): same contract as
 * anneal_cpu_attention_fwd / _bwd. They pick the AVX512-BF16 kernels below when the
 * CPU has them and ANNEAL_CPU_ISA is not portable or avx2. */
void anneal_attn_bf16_fwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                          const float *v, float *o, float *lse);
void anneal_attn_bf16_bwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                          const float *v, const float *o, const float *dout, const float *lse,
                          float *dq, float *dk, float *dv);

/* The online-softmax step of a bf16 forward over one key tile (attention_bf16.c): for
 * each of the nq query rows (from q0) of S (raw scores r(q) . r(k), row stride
 * ANNEAL_ATTN_BK, nk keys from k0), zeroes the keys the row may not see, updates its
 * running max m and sum l, rescales its accumulator row (acc, D wide) and leaves
 * p = exp(scale * s - m) in S (unrounded). */
void anneal_attn_bf16_online_softmax(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                                     float *S, int64_t q0, int nq, int64_t k0, int nk, float *m,
                                     float *l, float *acc);

/* The AVX512-BF16 versions (attention_avx512bf16.c); only call them when
 * anneal_cpu_has_avx512bf16() and anneal_cpu_has_avx512(). */
void anneal_attn_avx512bf16_fwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                                const float *v, float *o, float *lse);
void anneal_attn_avx512bf16_bwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                                const float *v, const float *o, const float *dout,
                                const float *lse, float *dq, float *dk, float *dv);

/* One forward task: query rows q0..q0+nq-1 of one (b, h) (pointers offset to it: q, o,
 * lse to query head h, k and v to its key/value head). */
typedef void (*anneal_attn_fwd_tile_fn)(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                                        const float *q, const float *k, const float *v, float *o,
                                        float *lse, int64_t q0, int nq, float *ws);
/* Runs tile over every (b, h, query tile) of a forward on the threads (dynamic schedule:
 * causal tiles differ in cost; each row is produced by one task, so the bits do not
 * depend on the schedule), with a workspace of ws_floats per thread; a thread without one
 * fills its tasks' outputs with NaN. */
void anneal_attn_run_fwd(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                         const float *q, const float *k, const float *v, float *o, float *lse,
                         size_t ws_floats, anneal_attn_fwd_tile_fn tile);

/* One query head (b, h) of a backward: pointers offset to its batch and head (q, o,
 * dout, lse, dq to query head h; k, v, dk, dv to its key/value head), ws its thread's
 * workspace. Overwrites dq; adds its contribution to dk and dv (zeroed by the caller
 * before the first query head of the group), unscaled where the kernel's arithmetic
 * scales dk at the end (see anneal_attn_run_bwd's scale_dk). */
typedef void (*anneal_attn_bwd_head_fn)(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                                        const float *q, const float *k, const float *v,
                                        const float *o, const float *dout, const float *lse,
                                        float *dq, float *dk, float *dv, float *ws);
/* Runs a backward on the threads: one task per (b, key/value head) (dynamic schedule),
 * which zeroes its dk and dv, runs head over the query heads of its group in ascending
 * order, and then, when scale_dk, multiplies dk by d->scale. Each task writes only its
 * own rows, in a fixed order, so the bits do not depend on the thread count; with
 * Hkv == H this is the per-(b, h) backward it always was. ws_floats: workspace per
 * thread; a thread without one fills its tasks' gradients with NaN. */
void anneal_attn_run_bwd(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                         const float *q, const float *k, const float *v, const float *o,
                         const float *dout, const float *lse, float *dq, float *dk, float *dv,
                         size_t ws_floats, anneal_attn_bwd_head_fn head, bool scale_dk);

/* The end of a forward task: o = acc / l and lse = m + log(l) for query rows
 * q0..q0+nq-1 of one (b, h) (o and lse offset to it; acc (nq, D), m and l (nq) the online
 * softmax state), or o = 0 and lse = -inf for a row that saw no key. */
void anneal_attn_finish_rows(const anneal_cpu_attn_desc *d, float *o, float *lse, int64_t q0,
                             int nq, const float *acc, const float *m, const float *l);

/* Scratch-allocation failure: the outputs of one forward task are filled with NaN
 * (errors propagate like NaN; nothing aborts). Pointers are offset to the task's batch
 * and head. (A backward task's gradients likewise, inside anneal_attn_run_bwd.) */
void anneal_attn_fail_fwd(const anneal_cpu_attn_desc *d, float *o, float *lse, int64_t q0,
                          int nq);

#endif
