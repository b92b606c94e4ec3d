/* AMX-BF16 GEMM micro-kernel and packing (Intel's tile unit, Sapphire Rapids and later):
 * bf16 operands, f32 accumulation, a 32 x 32 tile of C in four 16 x 16 tile registers.
 *
 * Run on AMX hardware once so far (2026-11-30, the GPU machine's 16-core Intel host:
 * tests/cpu/test_gemm_amx.c's tile-unit checks passed). The kernel body
 * (gemm_amx_kernel.h) is compiled twice: over the tile instructions (anneal_gemm_isa_amx,
 * chosen at run time where anneal_cpu_amx_usable()) and over a C model of the tile
 * registers below (anneal_gemm_isa_amx_model), which the tests run on every CPU through
 * the whole GEMM driver; the tests that need the real unit skip, saying so, elsewhere.
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
 * multiple of 32, one tile's worth). A micro-panel of 32 lanes (A: rows of C; B: columns)
 * is, per step of 16 depth pairs and per half of 16 lanes, one tile of 16 rows x 16
 * words, 1 KiB contiguous, so every TILELOADD reads 64-byte rows back to back:
 *   A: word[s * 512 + h * 256 + r * 16 + w] = row 16 h + r, pair 16 s + w (a tile row
 *      is a row of C's, as TDPBF16PS's first source wants);
 *   B: word[s * 512 + h * 256 + w * 16 + j] = pair 16 s + w, column 16 h + j (a tile row
 *      is a depth pair over 16 columns).
 * (The first layout, rows of the whole depth in A and B's 32 columns side by side, made
 * every A tile load 16 lines 1 KiB apart: GPT-2 124M's bf16 products ran at about a tenth
 * of the tiles' peak on 2 cores.) Rounding to bf16 happens while packing: nearest even,
 * f32 subnormal inputs as zero (VCVTNE2PS2BF16 in the tile unit's packers, which need
 * AVX512-BF16, as every AMX CPU has; the same bits in plain C for the model). */
#include "anneal/backend.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_amx_tiles.h"
#include "cpu/gemm_avx512_tile.h"
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
#define AMX_VEC_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

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
        /* the packers use AVX512-BF16, which every AMX-BF16 CPU has */
        v = anneal_cpu_has_amx() && anneal_cpu_has_avx512bf16() && request_tile_permission() ? 1 : 0;
        atomic_store_explicit(&cached, v, memory_order_release);
    }
    return v == 1;
}

/* ---------------------------------------------------------------- packing */

/* The bf16 bits of x as VCVTNE2PS2BF16 makes them (the tile unit's packers): nearest
 * even (as anneal_gemm_round_bf16, NaN made quiet), f32 subnormal inputs as zeros of
 * their sign (which the unit's DAZ makes of bf16 subnormals anyway). */
static inline __attribute__((always_inline)) uint32_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
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

/* The index of lane l's (0..31) depth pair q in a micro-panel (layout at the top of the
 * file): step q / 16, half l / 16, then the tile's rows (A: lanes; B: pairs). */
static inline __attribute__((always_inline)) int64_t panel_word(bool a_layout, int64_t l, int64_t q) {
    const int64_t base = q / 16 * 512 + l / 16 * 256;
    return a_layout ? base + l % 16 * 16 + q % 16 : base + q % 16 * 16 + l % 16;
}

/* Micro-panels of `width` (32) lanes in the A or B layout, plain C: the model's packers,
 * and the reference the tile unit's match bit for bit (tests/cpu/test_gemm_amx.c). */
static void pack_plain(bool a_layout, const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width,
                       int64_t kc, void *dst_) {
    uint32_t *dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    const int64_t kq = (kc + AMX_KSTEP - 1) / AMX_KSTEP * AMX_KSTEP / 2;
    for (int64_t p = 0; p < npan; p++) {
        uint32_t *d = dst + p * kq * width;
        const int64_t l0 = p * width, nl = lanes - l0 < width ? lanes - l0 : width;
        for (int64_t j = 0; j < width; j++)
            for (int64_t q = 0; q < kq; q++)
                d[panel_word(a_layout, j, q)] = j < nl ? pair_word(src, stride, lanes_contig, l0 + j, q, kc) : 0;
    }
}

/* pack_plain's panels with AVX-512 (every AMX CPU has AVX512-BF16), the same bits. Per
 * step of 32 depths and half of 16 lanes, one 16 x 16 block of words, which is a tile
 * (1 KiB, 64-byte rows): A's rows are lanes, B's rows pairs. A lane's 32 depths convert
 * to its 16 pair words in one VCVTNE2PS2BF16 (anneal_a512_bf16_words, bf16_bits' bits);
 * two depth rows of 16 lanes interleave into the 16 lanes' words of one pair; a 16 x 16
 * transpose turns one into the other. */
AMX_VEC_TARGET static void pack_vec(bool a_layout, const float *src, int64_t stride, bool lanes_contig, int64_t lanes,
                                    int width, int64_t kc, void *dst_) {
    float *dst = dst_;
    const int64_t npan = (lanes + width - 1) / width;
    const int64_t kq = (kc + AMX_KSTEP - 1) / AMX_KSTEP * AMX_KSTEP / 2;
    for (int64_t p = 0; p < npan; p++)
        for (int64_t s = 0; s < kq / 16; s++) {
            const int64_t k0 = 32 * s;
            const __mmask16 ka = anneal_a512_first_lanes(kc - k0), kb = anneal_a512_first_lanes(kc - k0 - 16);
            for (int h = 0; h < width / 16; h++) {
                const int64_t l0 = p * width + 16 * h;
                float *d = dst + p * kq * width + s * 512 + h * 256;
                __m512 r[16];
                if (lanes_contig) { /* r[w]: pair 16 s + w of the 16 lanes */
                    const __mmask16 ml = anneal_a512_first_lanes(lanes - l0);
#pragma GCC unroll 16
                    for (int w = 0; w < 16; w++) {
                        const int64_t k = k0 + 2 * w;
                        const __m512 x0 = k < kc ? _mm512_maskz_loadu_ps(ml, src + k * stride + l0) : _mm512_setzero_ps();
                        const __m512 x1 =
                            k + 1 < kc ? _mm512_maskz_loadu_ps(ml, src + (k + 1) * stride + l0) : _mm512_setzero_ps();
                        r[w] = _mm512_castsi512_ps(anneal_a512_bf16_interleave(x0, x1));
                    }
                } else { /* r[j]: the 16 pairs of lane l0 + j */
#pragma GCC unroll 16
                    for (int j = 0; j < 16; j++) {
                        const float *row = src + (l0 + j) * stride + k0; /* read only below `lanes` */
                        r[j] = l0 + j < lanes ? _mm512_castsi512_ps(anneal_a512_bf16_words(
                                                    _mm512_maskz_loadu_ps(ka, row), _mm512_maskz_loadu_ps(kb, row + 16)))
                                              : _mm512_setzero_ps();
                    }
                }
                /* A's tile rows are lanes, B's pairs: transpose when the loads gave the other */
                if (lanes_contig == a_layout) anneal_a512_transpose16(r);
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) _mm512_storeu_ps(d + 16 * i, r[i]);
            }
        }
}

/* The packers of the tile unit's descriptor and of the model's. `round` is ignored:
 * always bf16. */
AMX_VEC_TARGET static void pack_b_vec(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width,
                                      int64_t kc, int round, void *dst) {
    (void)round;
    pack_vec(false, src, stride, lanes_contig, lanes, width, kc, dst);
}
AMX_VEC_TARGET static void pack_a_vec(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width,
                                      int64_t kc, int round, void *dst) {
    (void)round;
    pack_vec(true, src, stride, lanes_contig, lanes, width, kc, dst);
}
static void pack_b_plain(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width, int64_t kc,
                         int round, void *dst) {
    (void)round;
    pack_plain(false, src, stride, lanes_contig, lanes, width, kc, dst);
}
static void pack_a_plain(const float *src, int64_t stride, bool lanes_contig, int64_t lanes, int width, int64_t kc,
                         int round, void *dst) {
    (void)round;
    pack_plain(true, src, stride, lanes_contig, lanes, width, kc, dst);
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
#define AMX_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#include "cpu/gemm_amx_kernel.h"
#undef AMX_PREFETCH
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
#define AMX_PREFETCH(p) (void)(p)
#include "cpu/gemm_amx_kernel.h"
#undef AMX_PREFETCH
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
