/* CPU GEMM: C = alpha * op(A) @ op(B) + beta * C, row-major, GotoBLAS/BLIS style, at f32,
 * bf16 or f16 operand precision, with an optional fused epilogue.
 *
 * Blocking (kc, mc, nc and the mr x nr tile come from the ISA descriptor; loops from
 * outside in; see gemm_blocked):
 *
 *   for jc over N in steps of nc             one B block of columns
 *     for pc over K in steps of kc           one depth block
 *       pack op(B)[pc:+kc, jc:+nc] -> Bp     kc x nr micro-panels (kc x nc elements, in L3),
 *                                            once, the threads sharing the work
 *       for each row block (<= mc rows)      taken by the threads one at a time
 *         pack op(A)[rows, pc:+kc] -> Ap     mr x kc micro-panels (<= mc x kc, in L2)
 *         for jr over nc in steps of nr      one B micro-panel (kc x nr, stays in L1)
 *           for ir over the rows by mr       micro-kernel: mr x nr tile of C += Ap @ Bp,
 *                                            then (last depth block) the epilogue on it
 *
 * A product may also take op(B) packed beforehand (anneal_cpu_gemm_pack_b), when several
 * products share it: then work items of rows x columns run over all of K (gemm_prepacked).
 *
 * Packing copies the operands into contiguous, 64-byte aligned, zero-padded micro-panels,
 * so the micro-kernel sees unit-stride data whatever the transposes and leading dims are,
 * and edge tiles run the same code as full ones. Packing is also where the operands are
 * rounded to the compute precision: to bf16 pairs for the AVX512-BF16 kernel, or to
 * bf16/f16 values kept as f32 for the f32 kernels (f16 products are exact in f32, so the
 * f32 kernel over f16-rounded panels gives f16 numerics at f32 speed).
 *
 * Threads: every C element is computed by exactly one work item, accumulating over k in
 * the same order (kc-blocks in order, k in order inside a block, the kc split depending
 * only on K and the kernel), so results are bit-identical for any thread count and any
 * assignment of items to threads, and the epilogue is elementwise. op(B) is packed once
 * per product and op(A) once per column block, however many threads share the product.
 *
 * Single-row products (M == 1, generation) skip packing altogether: see "one row" below.
 *
 * beta is applied by the first kc-block only (later blocks accumulate with beta = 1), so
 * beta == 0 never reads C. The pack buffers are cached thread-locally and grow to the
 * largest block seen (the calling thread's op(B) block, kc x nc elements, shared with its
 * team; each thread's op(A) block, mc x kc elements; about 3.4 MiB with AVX-512). */
#include "anneal/core.h"
#include "anneal/backend.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "cpu/vec_math.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ portable kernel */

#define PORT_MR 4
#define PORT_NR 16

/* Portable micro-kernel over a 4 x 16 tile: plain C whose loops have constant trip counts
 * and are fully unrolled, so the compiler keeps the 64 accumulators in vector registers
 * (16 SSE registers on baseline x86-64: ~30 GFLOP/s per core here; wider with -march).
 * Larger tiles spill on baseline x86-64. */
static void kernel_portable(int64_t kc, const void *ap_, const void *bp_, float *restrict c,
                            int64_t ldc, int m, int n, float alpha, float beta) {
    const float *restrict ap = ap_, *restrict bp = bp_;
    float acc[PORT_MR][PORT_NR];
#pragma GCC unroll 4
    for (int i = 0; i < PORT_MR; i++)
#pragma GCC unroll 16
        for (int j = 0; j < PORT_NR; j++) acc[i][j] = 0.0f;
    for (int64_t k = 0; k < kc; k++) {
#pragma GCC unroll 4
        for (int i = 0; i < PORT_MR; i++) {
            const float a = ap[i];
#pragma GCC unroll 16
            for (int j = 0; j < PORT_NR; j++) acc[i][j] += a * bp[j];
        }
        ap += PORT_MR;
        bp += PORT_NR;
    }
    for (int i = 0; i < m; i++) {
        float *row = c + i * ldc;
        if (beta == 0.0f) {
            for (int j = 0; j < n; j++) row[j] = alpha * acc[i][j];
        } else {
            for (int j = 0; j < n; j++) row[j] = alpha * acc[i][j] + beta * row[j];
        }
    }
}

/* ------------------------------------------------------------ packing */

/* Portable pack of whole micro-panels with rounding (see anneal_gemm_pack). */
static void pack_portable(const float *src, int64_t stride, bool lanes_contig, int64_t lanes,
                          int width, int64_t kc, int round, void *dst_) {
    float *restrict dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    if (lanes_contig) {
        /* Blocks of 16 source rows, then panel by panel: the rows are read from memory once
         * and each panel gets a contiguous burst (see pack_avx512 for why). */
        for (int64_t k0 = 0; k0 < kc; k0 += 16) {
            const int64_t k1 = k0 + 16 < kc ? k0 + 16 : kc;
            for (int64_t p = 0; p < npan; p++) {
                const int64_t l0 = p * width;
                const int n = lanes - l0 < width ? (int)(lanes - l0) : width;
                for (int64_t k = k0; k < k1; k++) {
                    const float *s = src + k * stride + l0;
                    float *d = dst + p * kc * width + k * width;
                    int l = 0;
                    if (round == ANNEAL_GEMM_ROUND_NONE)
                        for (; l < n; l++) d[l] = s[l];
                    else
                        for (; l < n; l++) d[l] = anneal_gemm_round(s[l], round);
                    for (; l < width; l++) d[l] = 0.0f;
                }
            }
        }
    } else {
        /* A transpose: walk each source lane once (one stream per lane). */
        for (int64_t p = 0; p < npan; p++) {
            float *d = dst + p * kc * width;
            for (int l = 0; l < width; l++) {
                const int64_t sl = p * width + l;
                if (sl < lanes) {
                    const float *s = src + sl * stride;
                    for (int64_t k = 0; k < kc; k++) d[k * width + l] = anneal_gemm_round(s[k], round);
                } else {
                    for (int64_t k = 0; k < kc; k++) d[k * width + l] = 0.0f;
                }
            }
        }
    }
}

/* Blocking for the portable kernel: B micro-panel 256 x 16 floats = 16 KiB in L1, A block
 * 256 x 256 floats = 256 KiB in L2, B block 256 x 3072 floats = 3 MiB in L3. */
static const anneal_gemm_isa isa_portable = {
    .name = "portable",
    .mr = PORT_MR,
    .nr = PORT_NR,
    .kc = 256,
    .mc = 256,
    .nc = 3072,
    .esize = 4,
    .kstep = 1,
    .kernel = kernel_portable,
    .pack = pack_portable,
};

/* ------------------------------------------------------------ ISA dispatch */

/* -2: not chosen yet; otherwise an ANNEAL_GEMM_ISA_* value. */
static atomic_int gemm_isa_choice = -2;
static atomic_bool bf16_kernel_allowed = true;
static const anneal_gemm_isa *_Atomic bf16_isa_forced; /* tests: anneal_cpu_gemm_set_bf16_isa */

/* True when the CPU can run that ISA. */
static bool isa_available(int isa) {
    return isa == ANNEAL_GEMM_ISA_PORTABLE ||
           (isa == ANNEAL_GEMM_ISA_AVX512 && anneal_cpu_has_avx512()) ||
           (isa == ANNEAL_GEMM_ISA_AVX2 && anneal_cpu_has_avx2());
}

/* The best ISA the CPU has at or below the ISA limit (anneal_cpu_isa_limit). */
static int gemm_isa_default(void) {
    const int limit = anneal_cpu_isa_limit();
    if (limit >= ANNEAL_ISA_AVX512 && anneal_cpu_has_avx512()) return ANNEAL_GEMM_ISA_AVX512;
    if (limit >= ANNEAL_ISA_AVX2 && anneal_cpu_has_avx2()) return ANNEAL_GEMM_ISA_AVX2;
    return ANNEAL_GEMM_ISA_PORTABLE;
}

/* The f32 descriptor the next call uses; the choice is made once (a benign race: every
 * thread computes the same value). */
static const anneal_gemm_isa *gemm_isa(void) {
    int v = atomic_load_explicit(&gemm_isa_choice, memory_order_relaxed);
    if (v == -2) {
        v = gemm_isa_default();
        atomic_store_explicit(&gemm_isa_choice, v, memory_order_relaxed);
    }
    return v == ANNEAL_GEMM_ISA_AVX512 ? &anneal_gemm_isa_avx512
           : v == ANNEAL_GEMM_ISA_AVX2 ? &anneal_gemm_isa_avx2
                                       : &isa_portable;
}

/* The kernel and packing rounding for a product at precision `compute`: bf16 runs the
 * AMX tiles or else the AVX512-BF16 kernel when the f32 choice is AVX-512 and the CPU
 * (and the ISA limit) allow and VDPBF16PS is the faster unit (anneal_cpu_bf16_dot_preferred);
 * otherwise the f32 kernel over operands rounded while packing. */
static const anneal_gemm_isa *gemm_select(int compute, int *round) {
    const anneal_gemm_isa *isa = gemm_isa();
    *round = compute == ANNEAL_BF16  ? ANNEAL_GEMM_ROUND_BF16
             : compute == ANNEAL_F16 ? ANNEAL_GEMM_ROUND_F16
                                     : ANNEAL_GEMM_ROUND_NONE;
    if (*round != ANNEAL_GEMM_ROUND_BF16) return isa;
    const anneal_gemm_isa *forced = atomic_load_explicit(&bf16_isa_forced, memory_order_relaxed);
    if (forced) return forced;
    if (isa != &anneal_gemm_isa_avx512 || !atomic_load_explicit(&bf16_kernel_allowed, memory_order_relaxed))
        return isa;
    const int limit = anneal_cpu_isa_limit();
    if (limit >= ANNEAL_ISA_AMX && anneal_cpu_amx_usable()) return &anneal_gemm_isa_amx;
    if (anneal_cpu_bf16_dot_preferred()) return &anneal_gemm_isa_avx512bf16;
    return isa;
}

/* gemm_select for a product that runs now: records the path (anneal_cpu_path_note). */
static const anneal_gemm_isa *gemm_select_run(int compute, int *round) {
    const anneal_gemm_isa *isa = gemm_select(compute, round);
    const int op = compute == ANNEAL_BF16 ? ANNEAL_CPU_OP_GEMM_BF16
                   : compute == ANNEAL_F16 ? ANNEAL_CPU_OP_GEMM_F16
                                           : ANNEAL_CPU_OP_GEMM_F32;
    anneal_cpu_path_note(op, isa == &anneal_gemm_isa_amx || isa == &anneal_gemm_isa_amx_model ? ANNEAL_CPU_PATH_AMX
                             : isa == &anneal_gemm_isa_avx512bf16 ? ANNEAL_CPU_PATH_AVX512BF16
                             : isa == &anneal_gemm_isa_avx512   ? ANNEAL_CPU_PATH_AVX512
                             : isa == &anneal_gemm_isa_avx2     ? ANNEAL_CPU_PATH_AVX2
                                                                : ANNEAL_CPU_PATH_PORTABLE);
    return isa;
}

/* Forces (or with ANNEAL_GEMM_ISA_AUTO, re-derives) the ISA; -1 if the CPU lacks it. */
int anneal_cpu_sgemm_set_isa(int isa) {
    if (isa == ANNEAL_GEMM_ISA_AUTO) isa = gemm_isa_default();
    if (isa != ANNEAL_GEMM_ISA_AVX512 && isa != ANNEAL_GEMM_ISA_PORTABLE &&
        isa != ANNEAL_GEMM_ISA_AVX2)
        return -1;
    if (!isa_available(isa)) return -1;
    atomic_store_explicit(&gemm_isa_choice, isa, memory_order_relaxed);
    return 0;
}

/* Name of the ISA the next f32 call uses. */
const char *anneal_cpu_sgemm_isa_name(void) { return gemm_isa()->name; }

/* Name of the kernel a product at `compute` uses. */
const char *anneal_cpu_gemm_kernel_name(int compute) {
    int round;
    return gemm_select(compute, &round)->name;
}

/* Allows or forbids the AVX512-BF16 kernel (tests). */
void anneal_cpu_gemm_allow_bf16_kernel(bool allow) {
    atomic_store_explicit(&bf16_kernel_allowed, allow, memory_order_relaxed);
}

/* Runs every bf16 product on isa (tests; NULL: the normal choice). */
void anneal_cpu_gemm_set_bf16_isa(const anneal_gemm_isa *isa) {
    atomic_store_explicit(&bf16_isa_forced, isa, memory_order_relaxed);
}

/* ------------------------------------------------------------ pack buffers */

/* Two growable 64-byte aligned buffers per thread (0: packed B, 1: packed A). Kept for the
 * thread's lifetime so steady-state calls neither allocate nor page-fault, and freed when
 * the thread exits (OpenMP retires threads when the team size shrinks). */
static _Thread_local void *tl_buf[2];
static _Thread_local size_t tl_cap[2];
static pthread_key_t tl_key;
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;
static bool tl_key_ok;

/* Thread exit: free this thread's buffers. */
static void pack_buffers_free(void *unused) {
    (void)unused;
    for (int i = 0; i < 2; i++) free(tl_buf[i]), tl_buf[i] = NULL, tl_cap[i] = 0;
}

static void tl_key_init(void) { tl_key_ok = pthread_key_create(&tl_key, pack_buffers_free) == 0; }

/* A buffer of at least `bytes` bytes, or NULL when out of memory. */
static void *pack_buffer(int which, size_t bytes) {
    if (tl_cap[which] >= bytes) return tl_buf[which];
    if (!tl_buf[0] && !tl_buf[1]) { /* this thread's first: have its exit free them */
        pthread_once(&tl_once, tl_key_init);
        if (tl_key_ok) pthread_setspecific(tl_key, (void *)1);
    }
    free(tl_buf[which]);
    bytes = (bytes + 63) & ~(size_t)63;
    tl_buf[which] = aligned_alloc(64, bytes);
    tl_cap[which] = tl_buf[which] ? bytes : 0;
    return tl_buf[which];
}

/* ------------------------------------------------------------ driver */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* One product's settings shared by every block of it. bias, pre and mul (the epilogue's
 * operands) are at C's origin wherever they are passed. */
typedef struct gemm_ctx {
    const anneal_gemm_isa *isa;
    int round;
    bool ta, tb;
    float alpha;
    const anneal_gemm_epilogue *ep; /* NULL when it does nothing to C */
    float *colsum;                  /* the epilogue's B column sums, or NULL */
} gemm_ctx;

/* C = beta * C over M x N (beta == 0 writes zeros without reading C). */
static void scale_c(int64_t M, int64_t N, float beta, float *C, int64_t ldc) {
    if (beta == 1.0f) return;
#pragma omp parallel for schedule(static) if (M * N > (1 << 16) && !omp_in_parallel())
    for (int64_t i = 0; i < M; i++) {
        float *row = C + i * ldc;
        if (beta == 0.0f)
            for (int64_t j = 0; j < N; j++) row[j] = 0.0f;
        else
            for (int64_t j = 0; j < N; j++) row[j] = beta * row[j];
    }
}

/* Depth of the kc-blocks for this K: K split into ceil(K / kc_max) near-equal blocks,
 * rounded up to a multiple of 8. Depends on K and the ISA only, never on threads. */
static int64_t block_depth(int64_t K, int64_t kc_max) {
    int64_t nblocks = ceil_div(K, kc_max);
    int64_t kc = ceil_div(K, nblocks);
    return min64(kc_max, (kc + 7) & ~(int64_t)7);
}

/* Threads worth using for an M x N x K product: one per ~4 MFLOP so tiny products skip the
 * fork/join, none beyond the OpenMP limit, and one inside an enclosing parallel region. */
static int gemm_threads(int64_t M, int64_t N, int64_t K) {
    if (omp_in_parallel()) return 1;
    int T = omp_get_max_threads();
    double work = 2.0 * (double)M * (double)N * (double)K;
    int64_t by_work = (int64_t)(work / 4e6) + 1;
    if (by_work < T) T = (int)by_work;
    return T < 1 ? 1 : T;
}

/* Fallback for when the pack buffers cannot be allocated: plain loops, same contract. */
static void gemm_unpacked(const gemm_ctx *g, int64_t M, int64_t N, int64_t K, const float *A,
                          int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                          int64_t ldc, const float *bias, float *pre, const float *mul) {
    const bool ta = g->ta, tb = g->tb;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++)
                s += anneal_gemm_round(ta ? A[k * lda + i] : A[i * lda + k], g->round) *
                     anneal_gemm_round(tb ? B[j * ldb + k] : B[k * ldb + j], g->round);
            C[i * ldc + j] = g->alpha * s + (beta == 0.0f ? 0.0f : beta * C[i * ldc + j]);
        }
    if (g->ep) anneal_gemm_epilogue_tile(g->ep, M, N, C, ldc, bias, pre, mul);
}

/* ------------------------------------------------------------ packing op(B) */

#define PACK_GROUP 8 /* micro-panels per packing task */

/* sum[c] (c in [c0, c0+n)) += op(B)[k, c] over k in [pc, pc+kc), in ascending k (set
 * instead of added when pc == 0): the B column sums of anneal_gemm_epilogue, over a block
 * just packed and still in cache. Each column is one sequential f32 sum, so the bits do
 * not depend on the layout of B, the blocking or the threads. */
ANNEAL_VEC_CLONES
static void column_sums_block(bool tb, const float *B, int64_t ldb, int64_t pc, int64_t kc,
                              int64_t c0, int64_t n, float *restrict sum) {
    if (pc == 0)
        for (int64_t c = c0; c < c0 + n; c++) sum[c] = 0.0f;
    if (!tb) {
        for (int64_t k = pc; k < pc + kc; k++) {
            const float *restrict row = B + k * ldb;
            for (int64_t c = c0; c < c0 + n; c++) sum[c] += row[c];
        }
    } else {
        for (int64_t c = c0; c < c0 + n; c++) {
            const float *restrict col = B + c * ldb;
            float t = sum[c];
            for (int64_t k = pc; k < pc + kc; k++) t += col[k];
            sum[c] = t;
        }
    }
}

/* Packs the depth block [pc, pc+kc) of op(B)'s columns [c0, c0+n) (op(B)[k, c] is
 * B[k*ldb + c], or B[c*ldb + k] when transposed) into dst as consecutive micro-panels,
 * the tasks (groups of PACK_GROUP panels) dealt round robin to the threads of the
 * enclosing parallel region (or all done by the caller outside one), then a barrier.
 * (Work sharing is hand-made throughout this file: libgomp allocates memory for a dynamic
 * `omp for` once a region has used a few, and a steady-state training step must not.) */
static void pack_b_block(const anneal_gemm_isa *isa, int round, bool tb, const float *B,
                         int64_t ldb, int64_t pc, int64_t kc, int64_t c0, int64_t n, char *dst,
                         float *colsum) {
    const int nr = isa->nr;
    const size_t es = (size_t)isa->esize;
    const int64_t kcp = ceil_div(kc, isa->kstep) * isa->kstep;
    const int64_t ngrp = ceil_div(ceil_div(n, nr), PACK_GROUP);
    const int T = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t grp = tid; grp < ngrp; grp += T) {
        const int64_t g0 = c0 + grp * PACK_GROUP * nr;
        const int64_t lanes = min64((int64_t)PACK_GROUP * nr, c0 + n - g0);
        isa->pack(tb ? B + g0 * ldb + pc : B + pc * ldb + g0, ldb, !tb, lanes, nr, kc, round,
                  dst + (size_t)(grp * PACK_GROUP * kcp * nr) * es);
        if (colsum) column_sums_block(tb, B, ldb, pc, kc, g0, lanes, colsum);
    }
#pragma omp barrier
}

/* ------------------------------------------------------------ driver */

/* Rows [r0, r0+m) x columns [c0, c0+n) of C (c0 a multiple of nr) over the depth block
 * [pc, pc+kc): pack op(A) of the rows into ap, then run the micro-kernel over the tiles
 * against the block's B micro-panels (bblk: panel p of the columns at p * kcp * nr
 * elements, column 0 of the panels being C's column 0), the epilogue after the last block.
 * Every C element gets the same arithmetic whichever thread computes it. */
static void gemm_tile_block(const gemm_ctx *g, int64_t r0, int64_t m, int64_t c0, int64_t n,
                            int64_t pc, int64_t kc, bool last, const float *A, int64_t lda,
                            const char *bblk, float beta, float *C, int64_t ldc,
                            const float *bias, float *pre, const float *mul, char *ap) {
    const anneal_gemm_isa *isa = g->isa;
    const int mr = isa->mr, nr = isa->nr;
    const size_t es = (size_t)isa->esize;
    const int64_t kcp = ceil_div(kc, isa->kstep) * isa->kstep; /* packed (zero-padded) depth */
    const float beta_eff = pc == 0 ? beta : 1.0f;                 /* beta once, then accumulate */
    /* op(A)[r, k] is A[r*lda + k], or A[k*lda + r] when transposed. */
    (isa->pack_a ? isa->pack_a : isa->pack)(g->ta ? A + pc * lda + r0 : A + r0 * lda + pc, lda, g->ta, m, mr, kc,
                                             g->round, ap);
    for (int64_t jr = c0; jr < c0 + n; jr += nr) {
        const int nn = (int)min64(nr, c0 + n - jr);
        const char *bpan = bblk + (size_t)(jr / nr * kcp * nr) * es;
        for (int64_t ir = 0; ir < m; ir += mr) {
            const int mm = (int)min64(mr, m - ir);
            float *ct = C + (r0 + ir) * ldc + jr;
            isa->kernel(kcp, ap + (size_t)(ir * kcp) * es, bpan, ct, ldc, mm, nn, g->alpha,
                        beta_eff);
            if (last && g->ep)
                anneal_gemm_epilogue_tile(g->ep, mm, nn, ct, ldc, bias ? bias + jr : NULL,
                                          pre ? pre + (r0 + ir) * ldc + jr : NULL,
                                          mul ? mul + (r0 + ir) * ldc + jr : NULL);
        }
    }
}

/* Row blocks for nt threads: at least 2 per thread (so a thread slowed by another process
 * hands work to the others), a multiple of nt (equal shares on a quiet machine), at most
 * mc rows each, whole mr tiles. Returns the rows per block. */
static int64_t row_block(const anneal_gemm_isa *isa, int nt, int64_t M) {
    const int64_t tiles = ceil_div(M, isa->mr);
    if (nt <= 1) return min64(isa->mc, tiles * isa->mr);
    int64_t per = ceil_div(M, isa->mc * nt);
    int64_t nb = nt * (per < 2 ? 2 : per);
    if (nb > tiles) nb = tiles;
    return ceil_div(ceil_div(M, nb), isa->mr) * isa->mr;
}

/* The blocked product on nt threads (M, N, K >= 1; nt == 1: the caller alone), op(B)
 * packed here:
 *   for each block of at most nc columns and each depth block (in order):
 *     the threads pack op(B)'s block (kc x nc, shared), a barrier,
 *     the threads take row blocks one at a time from a shared counter and run
 *     gemm_tile_block on them, a barrier.
 * So op(B) is packed once and op(A) once per column block whatever the thread count (a
 * static grid packs the shared operand once per thread), and a thread slowed by another
 * process simply takes fewer row blocks. bias, pre and mul are at C's origin. */
static void gemm_blocked(const gemm_ctx *g, int nt, int64_t M, int64_t N, int64_t K,
                         const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                         float *C, int64_t ldc, const float *bias, float *pre,
                         const float *mul) {
    const anneal_gemm_isa *isa = g->isa;
    const size_t es = (size_t)isa->esize;
    const int64_t kc_full = block_depth(K, isa->kc);
    const int64_t kcp_full = ceil_div(kc_full, isa->kstep) * isa->kstep;
    const int64_t nc = min64(isa->nc, ceil_div(N, isa->nr) * isa->nr);
    const int64_t rows = row_block(isa, nt, M), ni = ceil_div(M, rows);
    char *bp = pack_buffer(0, (size_t)(kcp_full * nc) * es);
    if (!bp) {
        gemm_unpacked(g, M, N, K, A, lda, B, ldb, beta, C, ldc, bias, pre, mul);
        if (g->colsum) column_sums_block(g->tb, B, ldb, 0, K, 0, N, g->colsum);
        return;
    }
    const size_t a_bytes = (size_t)(rows * kcp_full) * es;
    atomic_llong next = 0;         /* row-block counter of the current pass */
    bool no_a = false;             /* some thread has no A buffer */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        char *ap = pack_buffer(1, a_bytes);
        if (!ap) no_a = true; /* read by all only after the first barrier */
        const bool first = omp_get_thread_num() == 0;
        for (int64_t jc = 0; jc < N; jc += nc) {
            const int64_t n = min64(nc, N - jc);
            for (int64_t pc = 0; pc < K; pc += kc_full) {
                const int64_t kc = min64(kc_full, K - pc);
                /* the last pass's claims ended at its closing barrier, and none of this
                 * pass's start before the packing barrier below */
                if (first) atomic_store_explicit(&next, 0, memory_order_relaxed);
                pack_b_block(isa, g->round, g->tb, B, ldb, pc, kc, jc, n, bp,
                             g->colsum); /* + barrier */
                if (no_a) break; /* every thread sees the same value here */
                for (;;) {
                    const int64_t i = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
                    if (i >= ni) break;
                    const int64_t r0 = i * rows;
                    gemm_tile_block(g, r0, min64(rows, M - r0), 0, n, pc, kc, pc + kc >= K, A,
                                    lda, bp, beta, C + jc, ldc, bias ? bias + jc : NULL,
                                    pre ? pre + jc : NULL, mul ? mul + jc : NULL, ap);
                }
#pragma omp barrier
            }
            if (no_a) break;
        }
    }
    if (no_a) { /* out of memory for an A block: plain loops (C untouched so far) */
        gemm_unpacked(g, M, N, K, A, lda, B, ldb, beta, C, ldc, bias, pre, mul);
        if (g->colsum) column_sums_block(g->tb, B, ldb, 0, K, 0, N, g->colsum);
    }
}

/* The product from op(B) packed whole (anneal_cpu_gemm_pack_b's layout: depth block b,
 * panel p at b * npan * kcp_full * nr + p * kcp_b * nr elements) on nt threads: work
 * items of a row block x at most nc columns, each over all of K, taken one at a time; no
 * barrier between depth blocks, as nothing is repacked. */
static void gemm_prepacked(const gemm_ctx *g, int nt, int64_t M, int64_t N, int64_t K,
                           const float *A, int64_t lda, const char *packed, float beta, float *C,
                           int64_t ldc, const float *bias, float *pre, const float *mul) {
    const anneal_gemm_isa *isa = g->isa;
    const int nr = isa->nr;
    const size_t es = (size_t)isa->esize;
    const int64_t kc_full = block_depth(K, isa->kc);
    const int64_t kcp_full = ceil_div(kc_full, isa->kstep) * isa->kstep;
    const int64_t npan = ceil_div(N, nr), nc = min64(isa->nc, npan * nr), nj = ceil_div(N, nc);
    /* with 2+ column blocks per thread those items balance the threads, so the row blocks
     * are as tall as for one thread (up to mc): each B micro-panel serves more row tiles */
    const int64_t rows = row_block(isa, nj >= 2 * nt ? 1 : nt, M), ni = ceil_div(M, rows);
    const size_t a_bytes = (size_t)(rows * kcp_full) * es;
    bool oom = false;
    atomic_llong next = 0; /* work-item counter */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        char *ap = pack_buffer(1, a_bytes);
        if (!ap) oom = true; /* benign race: only ever set to true */
        for (;;) {
            const int64_t it = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
            if (it >= ni * nj || !ap) break;
            const int64_t r0 = it / nj * rows, m = min64(rows, M - r0);
            const int64_t c0 = it % nj * nc, n = min64(nc, N - c0);
            for (int64_t pc = 0, b = 0; pc < K; pc += kc_full, b++) {
                const int64_t kc = min64(kc_full, K - pc);
                const int64_t kcp = ceil_div(kc, isa->kstep) * isa->kstep;
                const char *bblk = packed + (size_t)(b * npan * kcp_full * nr) * es +
                                   (size_t)(c0 / nr * kcp * nr) * es;
                gemm_tile_block(g, r0, m, 0, n, pc, kc, pc + kc >= K, A, lda, bblk, beta,
                                C + c0, ldc, bias ? bias + c0 : NULL, pre ? pre + c0 : NULL,
                                mul ? mul + c0 : NULL, ap);
            }
        }
    }
    if (oom) /* NaN, as errors propagate (the packed B cannot be multiplied unpacked) */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) C[i * ldc + j] = __builtin_nanf("");
}

/* Bytes of op(B) (K x N) packed for products at precision `compute` (see cpu_kernels.h). */
size_t anneal_cpu_gemm_packed_b_size(int compute, int64_t K, int64_t N) {
    int round;
    const anneal_gemm_isa *isa = gemm_select(compute, &round);
    if (K <= 0 || N <= 0) return 0;
    const int64_t kc_full = block_depth(K, isa->kc), nblk = ceil_div(K, kc_full);
    const int64_t kcp_full = ceil_div(kc_full, isa->kstep) * isa->kstep;
    const int64_t kcp_last = ceil_div(K - (nblk - 1) * kc_full, isa->kstep) * isa->kstep;
    return (size_t)(((nblk - 1) * kcp_full + kcp_last) * ceil_div(N, isa->nr) * isa->nr) *
           (size_t)isa->esize;
}

/* Packs op(B) whole for products at precision `compute` (see cpu_kernels.h). */
void anneal_cpu_gemm_pack_b(int compute, bool trans_b, int64_t K, int64_t N, const float *B,
                            int64_t ldb, void *dst) {
    int round;
    const anneal_gemm_isa *isa = gemm_select_run(compute, &round);
    if (K <= 0 || N <= 0) return;
    const int64_t kc_full = block_depth(K, isa->kc);
    const int64_t kcp_full = ceil_div(kc_full, isa->kstep) * isa->kstep;
    const int64_t npan = ceil_div(N, isa->nr);
    const int nt = gemm_threads(K, N, 64); /* packing an element costs ~ 64 flops' time */
#pragma omp parallel num_threads(nt) if (nt > 1)
    for (int64_t pc = 0, b = 0; pc < K; pc += kc_full, b++)
        pack_b_block(isa, round, trans_b, B, ldb, pc, min64(kc_full, K - pc), 0, N,
                     (char *)dst + (size_t)(b * npan * kcp_full * isa->nr) * (size_t)isa->esize,
                     NULL);
}

/* ------------------------------------------------------------ one row */

/* With M == 1 (token-by-token generation), packing B would cost more than the product
 * (it reads and writes all of B for 2 flops per element), so these products stream B once,
 * unpacked, with threads splitting the columns:
 *   op(B) = B^T (B stored N x K, a Linear weight): each C element is a dot product of two
 *     contiguous rows;
 *   op(B) = B (B stored K x N): C accumulates a[k] * B[k, j0:j1] over k, in column chunks
 *     of at most ROW_COLS (long contiguous reads of B, the chunk of C stays in L1).
 * At bf16/f16 the row a is rounded once into a buffer and B is rounded on the fly, piece by
 * piece through a stack buffer (same values as packing would give; the products are formed
 * in f32 on every ISA). Both accumulate in a fixed order that does not depend on the thread
 * count. The loops are plain C that the compiler vectorises; the product is memory bound. */
#define DOT_LANES 16
#define ROW_COLS 4096
#define ROUND_CHUNK 1024 /* floats of B rounded at a time (a multiple of DOT_LANES) */

/* s[l] += a[k] * b[k] for k = l mod DOT_LANES, over n floats; only the last piece of a
 * longer sum may have n not a multiple of DOT_LANES. */
static void dot_accumulate(float s[DOT_LANES], const float *restrict a, const float *restrict b,
                           int64_t n) {
    float t[DOT_LANES];
    memcpy(t, s, sizeof t);
    int64_t k = 0;
    for (; k + DOT_LANES <= n; k += DOT_LANES)
#pragma GCC unroll 16
        for (int l = 0; l < DOT_LANES; l++) t[l] += a[k + l] * b[k + l];
    for (int l = 0; k + l < n; l++) t[l] += a[k + l] * b[k + l];
    memcpy(s, t, sizeof t);
}

/* Pairwise tree over the lanes. */
static float dot_finish(float s[DOT_LANES]) {
    for (int w = DOT_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) s[l] += s[l + w];
    return s[0];
}

/* Dot product of a and round(b) over n floats in a fixed order: DOT_LANES interleaved
 * partial sums (a loop the compiler vectorises without reassociating), then a pairwise
 * tree over the lanes. */
static float dot_fixed(const float *restrict a, const float *restrict b, int64_t n, int round) {
    float s[DOT_LANES] = {0};
    if (round == ANNEAL_GEMM_ROUND_NONE) {
        dot_accumulate(s, a, b, n);
    } else {
        float buf[ROUND_CHUNK];
        for (int64_t k = 0; k < n; k += ROUND_CHUNK) {
            const int64_t w = min64(ROUND_CHUNK, n - k);
            anneal_gemm_round_array(w, b + k, buf, round);
            dot_accumulate(s, a + k, buf, w);
        }
    }
    return dot_finish(s);
}

/* acc[j] += ak * bf16(b[j]) over n floats, the rounding inline (integer arithmetic the
 * compiler vectorises, as anneal_gemm_round_bf16), so B is read once. */
ANNEAL_VEC_CLONES
static void axpy_bf16(int64_t n, float ak, const float *restrict b, float *restrict acc) {
    for (int64_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, b + j, 4);
        u = anneal_gemm_round_bf16_bits(u);
        float v;
        memcpy(&v, &u, 4);
        acc[j] += ak * v;
    }
}

/* c = alpha * acc + beta * c, not reading c when beta == 0. */
static inline void store_c(float *c, float acc, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * acc : alpha * acc + beta * *c;
}

/* The product for M == 1 with nt threads (see above). op(A) is the row a[k] = A[k] (or
 * A[k*lda] when transposed, gathered into a buffer first). */
static void gemm_one_row(const gemm_ctx *g, int nt, int64_t N, int64_t K, const float *A,
                         int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                         const float *bias, float *pre, const float *mul) {
    const float alpha = g->alpha;
    const int round = g->round;
    const float *a = A;
    if ((g->ta && lda != 1) || round != ANNEAL_GEMM_ROUND_NONE) {
        float *buf = pack_buffer(1, (size_t)K * sizeof(float));
        if (!buf) {
            gemm_unpacked(g, 1, N, K, A, lda, B, ldb, beta, C, N, bias, pre, mul);
            return;
        }
        const int64_t step = g->ta ? lda : 1;
        for (int64_t k = 0; k < K; k++) buf[k] = anneal_gemm_round(A[k * step], round);
        a = buf;
    }
    if (g->tb) {
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
        for (int64_t j = 0; j < N; j++)
            store_c(C + j, dot_fixed(a, B + j * ldb, K, round), alpha, beta);
    } else {
        /* Column chunks: at most ROW_COLS, and at least one per thread. */
        const int64_t cols = min64(ROW_COLS, (ceil_div(N, nt) + 15) & ~(int64_t)15);
        const bool f16c = anneal_cpu_has_avx2();
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
        for (int64_t j0 = 0; j0 < N; j0 += cols) {
            const int64_t w = min64(cols, N - j0);
            float acc[ROW_COLS], rb[ROW_COLS];
            for (int64_t j = 0; j < w; j++) acc[j] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const float ak = a[k];
                const float *restrict b = B + k * ldb + j0;
                if (round == ANNEAL_GEMM_ROUND_BF16) {
                    axpy_bf16(w, ak, b, acc);
                    continue;
                }
                if (round == ANNEAL_GEMM_ROUND_F16 && f16c) {
                    anneal_gemm_axpy_f16_avx2(w, ak, b, acc);
                    continue;
                }
                if (round != ANNEAL_GEMM_ROUND_NONE) {
                    anneal_gemm_round_array(w, b, rb, round);
                    b = rb;
                }
                for (int64_t j = 0; j < w; j++) acc[j] += ak * b[j];
            }
            for (int64_t j = 0; j < w; j++) store_c(C + j0 + j, acc[j], alpha, beta);
        }
    }
    if (g->ep) anneal_gemm_epilogue_tile(g->ep, 1, N, C, N, bias, pre, mul);
}

/* ------------------------------------------------------------ entry points */

/* The product at precision `compute` with epilogue ep (NULL: none) on nt threads. The B
 * column sums come from gemm_blocked's packing, or (where B is not packed, or K is 0)
 * from column_sums_block on the caller's thread, the same arithmetic. */
static void gemm_run(int compute, int nt, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                     float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                     float beta, float *C, int64_t ldc, const anneal_gemm_epilogue *ep) {
    if (N <= 0) return;
    float *colsum = ep ? ep->b_colsum : NULL;
    if (!anneal_gemm_epilogue_active(ep)) ep = NULL;
    const float *bias = ep ? ep->bias : NULL, *mul = ep ? ep->silu_mul : NULL;
    float *pre = ep && (ep->gelu_tanh || mul) ? ep->pre : NULL;
    const bool packs = M > 1 && K > 0 && alpha != 0.0f; /* gemm_blocked below */
    if (colsum && !packs) {
        for (int64_t c = 0; c < N; c++) colsum[c] = 0.0f;
        if (K > 0) column_sums_block(tb, B, ldb, 0, K, 0, N, colsum);
    }
    if (M <= 0) return;
    if (K <= 0 || alpha == 0.0f) {
        scale_c(M, N, beta, C, ldc);
        if (ep) anneal_gemm_epilogue_tile(ep, M, N, C, ldc, bias, pre, mul);
        return;
    }
    gemm_ctx g = {.ta = ta, .tb = tb, .alpha = alpha, .ep = ep, .colsum = packs ? colsum : NULL};
    g.isa = gemm_select_run(compute, &g.round);
    if (M == 1)
        gemm_one_row(&g, nt, N, K, A, lda, B, ldb, beta, C, bias, pre, mul);
    else
        gemm_blocked(&g, nt, M, N, K, A, lda, B, ldb, beta, C, ldc, bias, pre, mul);
}

/* C = alpha * op(A) @ op(B) + beta * C (see cpu_kernels.h). */
void anneal_cpu_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                      const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                      float *C, int64_t ldc) {
    gemm_run(ANNEAL_F32, gemm_threads(M, N, K), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb,
             beta, C, ldc, NULL);
}

/* The same at precision `compute` with a fused epilogue (see cpu_kernels.h). */
void anneal_cpu_gemm(int compute, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                     float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                     float beta, float *C, int64_t ldc, const anneal_gemm_epilogue *ep) {
    gemm_run(compute, gemm_threads(M, N, K), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb,
             beta, C, ldc, ep);
}

/* The same with op(B) from anneal_cpu_gemm_pack_b (see cpu_kernels.h). */
void anneal_cpu_gemm_packed(int compute, bool trans_a, int64_t M, int64_t N, int64_t K,
                            float alpha, const float *A, int64_t lda, const void *packed_b,
                            float beta, float *C, int64_t ldc, const anneal_gemm_epilogue *ep) {
    if (M <= 0 || N <= 0) return;
    if (!anneal_gemm_epilogue_active(ep)) ep = NULL;
    const float *bias = ep ? ep->bias : NULL, *mul = ep ? ep->silu_mul : NULL;
    float *pre = ep && (ep->gelu_tanh || mul) ? ep->pre : NULL;
    if (K <= 0 || alpha == 0.0f) {
        scale_c(M, N, beta, C, ldc);
        if (ep) anneal_gemm_epilogue_tile(ep, M, N, C, ldc, bias, pre, mul);
        return;
    }
    gemm_ctx g = {.ta = trans_a, .tb = false, .alpha = alpha, .ep = ep};
    g.isa = gemm_select_run(compute, &g.round);
    gemm_prepacked(&g, gemm_threads(M, N, K), M, N, K, A, lda, packed_b, beta, C, ldc, bias, pre,
                   mul);
}

/* `batch` independent GEMMs at precision `compute` (see cpu_kernels.h). Many small products
 * run one per thread (each single-threaded, same bits as the threaded path); few large ones
 * run in order, each using all threads. A shared C (stride_c == 0) runs in order, so the
 * result is the well-defined sequential one. */
void anneal_cpu_gemm_batched(int compute, int64_t batch, bool trans_a, bool trans_b, int64_t M,
                             int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                             int64_t stride_a, const float *B, int64_t ldb, int64_t stride_b,
                             float beta, float *C, int64_t ldc, int64_t stride_c) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    const int T = omp_in_parallel() ? 1 : omp_get_max_threads();
    const double flops = 2.0 * (double)M * (double)N * (double)K;
    const bool across = T > 1 && stride_c != 0 && batch >= T &&
                        (batch >= 4 * T || flops <= 2.0 * 256 * 256 * 256);
    if (!across) {
        for (int64_t b = 0; b < batch; b++)
            anneal_cpu_gemm(compute, trans_a, trans_b, M, N, K, alpha, A + b * stride_a, lda,
                            B + b * stride_b, ldb, beta, C + b * stride_c, ldc, NULL);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(T)
    for (int64_t b = 0; b < batch; b++)
        gemm_run(compute, 1, trans_a, trans_b, M, N, K, alpha, A + b * stride_a, lda,
                 B + b * stride_b, ldb, beta, C + b * stride_c, ldc, NULL);
}

/* f32 batched GEMM (see cpu_kernels.h). */
void anneal_cpu_sgemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N,
                              int64_t K, float alpha, const float *A, int64_t lda,
                              int64_t stride_a, const float *B, int64_t ldb, int64_t stride_b,
                              float beta, float *C, int64_t ldc, int64_t stride_c) {
    anneal_cpu_gemm_batched(ANNEAL_F32, batch, trans_a, trans_b, M, N, K, alpha, A, lda,
                            stride_a, B, ldb, stride_b, beta, C, ldc, stride_c);
}
