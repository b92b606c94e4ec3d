/* AMX-BF16 GEMM micro-kernel and packing (Intel's tile unit, Sapphire Rapids and later):
 * bf16 operands, f32 accumulation, a 32 x 32 tile of C in four 16 x 16 tile registers.
 *
 * NOT YET RUN ON AMX HARDWARE: no machine this project was built on so far had AMX (the
 * GPU machine's Intel host, which may, has not been lent since this was written). The
 * kernel body (gemm_amx_kernel.h) is compiled twice: over the tile instructions
 * (anneal_gemm_isa_amx, chosen at run time where anneal_cpu_amx_usable()) and over a C
 * model of the tile registers below (anneal_gemm_isa_amx_model), which the tests run on
 * every CPU through the whole GEMM driver; the tests that need the real unit skip,
 * saying so, elsewhere.
 *
 * What the kernel computes. TDPBF16PS c, a, b does, for each of the 16 x 16 f32
 * elements of c and each of the 16 depth pairs q in order,
 *   c += a(2q) * b(2q), then c += a(2q + 1) * b(2q + 1)
 * (Intel's pseudo-code: products of bf16 values are exact in f32, each add rounds to
 * nearest even, bf16 inputs and f32 results below 2^-126 count as zero; the model does
 * exactly that). One rounding per product added, as the VDPBF16PS kernel, so the same
 * error bound holds: (K + 4) * 2^-24 * (|alpha| * sum_k |a_k b_k| + |beta C|), plus the
 * flushes (tests/cpu/test_gemm_amx.c checks it). How the hardware orders the adds inside
 * one instruction is its own affair; the bound does not depend on it.
 *
 * Layout of the packed panels (32-bit words, each a depth pair of bf16: the lower half
 * depth 2q, the upper 2q + 1; depths past K are zero, and the depth is padded to a
 * multiple of 32, one tile's worth):
 *   A micro-panel (pack_a): word[i * kq + q] for its 32 rows i (kq = padded depth / 2):
 *     a row of C is a row of a tile, so rows i0..i0+15 over pairs q0..q0+15 are one
 *     TILELOADD at a stride of kq * 4 bytes;
 *   B micro-panel (pack_b): word[q * 32 + j] for its 32 columns j (gemm_avx512bf16.c's
 *     layout): columns j0..j0+15 over 16 pairs are one TILELOADD at a stride of 128 bytes.
 * Rounding to bf16 happens while packing (nearest even, as anneal_gemm_round_bf16), in
 * plain C loops the compiler vectorises (AVX-512 for the tile unit's copy). */
#include "anneal/backend.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_amx_tiles.h"
#include "cpu/gemm_internal.h"

#include <immintrin.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_MR 32
#define AMX_NR 32
#define AMX_KC 512  /* depths per block: A and B micro-panels 32 x 512 bf16 = 32 KiB each */
#define AMX_MC 256  /* A block 256 x 512 bf16 = 256 KiB in L2 */
#define AMX_NC 3072 /* B block 512 x 3072 bf16 = 3 MiB in L3 */
#define AMX_KSTEP 32

#define AMX_TARGET ANNEAL_AMX_TARGET
#define AMX_VEC_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

/* ---------------------------------------------------------------- permission */

/* Linux hands the tile state (XTILEDATA, 8 KiB per thread) only to processes that ask
 * (arch_prctl ARCH_REQ_XCOMP_PERM): without it the first tile instruction raises SIGILL. */
static int request_tile_permission(void) {
#ifdef __linux__
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

bool anneal_cpu_amx_usable(void) {
    static atomic_int cached = -1;
    int v = atomic_load_explicit(&cached, memory_order_acquire);
    if (v < 0) {
        v = anneal_cpu_has_amx() && request_tile_permission() ? 1 : 0;
        atomic_store_explicit(&cached, v, memory_order_release);
    }
    return v == 1;
}

/* ---------------------------------------------------------------- packing */

/* The bf16 bits of x (nearest even, as anneal_gemm_round_bf16). */
static inline __attribute__((always_inline)) uint32_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return anneal_gemm_round_bf16_bits(u) >> 16;
}

/* The word of depths (2q, 2q + 1) of lane l: x(l, k) = src[k * stride + l] when
 * lanes_contig, else src[l * stride + k]; depths at or past kc are zero. */
static inline __attribute__((always_inline)) uint32_t pair_word(const float *src, int64_t stride, bool lanes_contig,
                                                                 int64_t l, int64_t q, int64_t kc) {
    const int64_t k = 2 * q;
    if (k >= kc) return 0;
    const float x0 = lanes_contig ? src[k * stride + l] : src[l * stride + k];
    const float x1 = k + 1 >= kc ? 0.0f : lanes_contig ? src[(k + 1) * stride + l] : src[l * stride + k + 1];
    return bf16_bits(x0) | bf16_bits(x1) << 16;
}

/* B micro-panels of `width` lanes: word[p * kq * width + q * width + j] for lane p * width
 * + j (zero past `lanes`), kq = the padded depth / 2. The copy case (lanes contiguous in
 * the source) runs along the lanes, the transpose case along the depths. */
static inline __attribute__((always_inline)) void pack_b_body(const float *src, int64_t stride, bool lanes_contig,
                                                               int64_t lanes, int width, int64_t kc, void *dst_) {
    uint32_t *dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    const int64_t kq = (kc + AMX_KSTEP - 1) / AMX_KSTEP * AMX_KSTEP / 2;
    for (int64_t p = 0; p < npan; p++) {
        uint32_t *d = dst + p * kq * width;
        const int64_t l0 = p * width, nl = lanes - l0 < width ? lanes - l0 : width;
        if (lanes_contig) {
            for (int64_t q = 0; q < kq; q++) {
                uint32_t *w = d + q * width;
                for (int64_t j = 0; j < nl; j++) w[j] = pair_word(src, stride, true, l0 + j, q, kc);
                for (int64_t j = nl; j < width; j++) w[j] = 0;
            }
        } else {
            for (int64_t j = 0; j < width; j++)
                for (int64_t q = 0; q < kq; q++) d[q * width + j] = j < nl ? pair_word(src, stride, false, l0 + j, q, kc) : 0;
        }
    }
}

/* A micro-panels of `width` rows: word[p * kq * width + j * kq + q] for row p * width + j
 * (zero past `lanes`): each row's depth pairs contiguous, as a tile row. The transpose
 * case (a row-major A: depths contiguous in the source) runs along the depths. */
static inline __attribute__((always_inline)) void pack_a_body(const float *src, int64_t stride, bool lanes_contig,
                                                               int64_t lanes, int width, int64_t kc, void *dst_) {
    uint32_t *dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    const int64_t kq = (kc + AMX_KSTEP - 1) / AMX_KSTEP * AMX_KSTEP / 2;
    for (int64_t p = 0; p < npan; p++) {
        uint32_t *d = dst + p * kq * width;
        const int64_t l0 = p * width, nl = lanes - l0 < width ? lanes - l0 : width;
        if (lanes_contig) {
            for (int64_t q = 0; q < kq; q++)
                for (int64_t j = 0; j < width; j++) d[j * kq + q] = j < nl ? pair_word(src, stride, true, l0 + j, q, kc) : 0;
        } else {
            for (int64_t j = 0; j < width; j++) {
                uint32_t *w = d + j * kq;
                if (j >= nl) {
                    memset(w, 0, (size_t)kq * sizeof *w);
                    continue;
                }
                const float *row = src + (l0 + j) * stride;
                const int64_t full = kc / 2; /* pairs with both depths inside kc */
                for (int64_t q = 0; q < full; q++) w[q] = bf16_bits(row[2 * q]) | bf16_bits(row[2 * q + 1]) << 16;
                for (int64_t q = full; q < kq; q++) w[q] = pair_word(src, stride, false, l0 + j, q, kc);
            }
        }
    }
}

/* The packers of the tile unit's descriptor (vectorised for AVX-512, which every AMX CPU
 * has) and of the model's (plain x86-64). `round` is ignored: always bf16. */
AMX_VEC_TARGET static void pack_b_vec(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width,
                                      int64_t kc, int round, void *dst) {
    (void)round;
    pack_b_body(src, stride, lanes_contig, lanes, width, kc, dst);
}
AMX_VEC_TARGET static void pack_a_vec(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width,
                                      int64_t kc, int round, void *dst) {
    (void)round;
    pack_a_body(src, stride, lanes_contig, lanes, width, kc, dst);
}
static void pack_b_plain(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width, int64_t kc,
                         int round, void *dst) {
    (void)round;
    pack_b_body(src, stride, lanes_contig, lanes, width, kc, dst);
}
static void pack_a_plain(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width, int64_t kc,
                         int round, void *dst) {
    (void)round;
    pack_a_body(src, stride, lanes_contig, lanes, width, kc, dst);
}

/* ---------------------------------------------------------------- the tile unit */

/* The tile configuration is per thread state; this thread's is loaded once. */
static _Thread_local bool tiles_configured;

#define AMX_KERNEL_NAME kernel_amx_32x32
#define AMX_KERNEL_ATTR AMX_TARGET
#define AMX_TILES_BEGIN() anneal_amx_tiles_begin(&tiles_configured)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_STORE(t, p, stride) _tile_stored(t, p, stride)
#include "cpu/gemm_amx_kernel.h"
#undef AMX_KERNEL_NAME
#undef AMX_KERNEL_ATTR
#undef AMX_TILES_BEGIN
#undef AMX_ZERO
#undef AMX_LOAD
#undef AMX_DP
#undef AMX_STORE

/* ---------------------------------------------------------------- the model */

/* A bf16 value as f32, subnormals as zero (the unit's input rule). */
static inline float model_bf16(uint32_t h) {
    uint32_t u = (h & 0xffffu) << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* An f32 result below 2^-126 in magnitude flushed to a zero of its sign. */
static inline float model_ftz(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&x, &u, 4);
    return x;
}

/* TDPBF16PS c, a, b as Intel's pseudo-code states it (see the top of the file). */
static void model_dp(anneal_amx_model_tile *c, const anneal_amx_model_tile *a, const anneal_amx_model_tile *b) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc = c->f[m][n];
            for (int q = 0; q < 16; q++) {
                const float p0 = model_bf16(a->w[m][q]) * model_bf16(b->w[q][n]);
                acc = model_ftz(acc + p0);
                const float p1 = model_bf16(a->w[m][q] >> 16) * model_bf16(b->w[q][n] >> 16);
                acc = model_ftz(acc + p1);
            }
            c->f[m][n] = acc;
        }
}

#define AMX_KERNEL_NAME kernel_model_32x32
#define AMX_KERNEL_ATTR
#define AMX_TILES_BEGIN() anneal_amx_model_tile tmm[8]
#define AMX_ZERO(t) memset(&tmm[t], 0, sizeof tmm[t])
#define AMX_LOAD(t, p, stride) anneal_amx_model_load(&tmm[t], p, stride)
#define AMX_DP(c, a, b) model_dp(&tmm[c], &tmm[a], &tmm[b])
#define AMX_STORE(t, p, stride) anneal_amx_model_store(&tmm[t], p, stride)
#include "cpu/gemm_amx_kernel.h"
#undef AMX_KERNEL_NAME
#undef AMX_KERNEL_ATTR
#undef AMX_TILES_BEGIN
#undef AMX_ZERO
#undef AMX_LOAD
#undef AMX_DP
#undef AMX_STORE

/* ---------------------------------------------------------------- descriptors */

const anneal_gemm_isa anneal_gemm_isa_amx = {
    .name = "amx",
    .mr = AMX_MR,
    .nr = AMX_NR,
    .kc = AMX_KC,
    .mc = AMX_MC,
    .nc = AMX_NC,
    .esize = 2,
    .kstep = AMX_KSTEP,
    .kernel = kernel_amx_32x32,
    .pack = pack_b_vec,
    .pack_a = pack_a_vec,
};

const anneal_gemm_isa anneal_gemm_isa_amx_model = {
    .name = "amx-model",
    .mr = AMX_MR,
    .nr = AMX_NR,
    .kc = AMX_KC,
    .mc = AMX_MC,
    .nc = AMX_NC,
    .esize = 2,
    .kstep = AMX_KSTEP,
    .kernel = kernel_model_32x32,
    .pack = pack_b_plain,
    .pack_a = pack_a_plain,
};

/* ---------------------------------------------------------------- peak */

/* `iters` rounds of four independent TDPBF16PS (16 x 16 x 32 each: 16384 FLOPs) on tiles
 * filled with small values; returns the sum of one result tile (only after
 * anneal_cpu_amx_usable()). */
AMX_TARGET float anneal_cpu_amx_peak_loop(int64_t iters) {
    anneal_amx_tiles_begin(&tiles_configured);
    uint32_t src[16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 16; i++) src[i] = 0x3c003c00u; /* bf16 pairs of 2^-7 */
    float out[16 * 16] __attribute__((aligned(64)));
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    _tile_loadd(6, src, 64);
    _tile_loadd(7, src, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    float s = 0;
    for (int i = 0; i < 16 * 16; i++) s += out[i];
    return s;
}
