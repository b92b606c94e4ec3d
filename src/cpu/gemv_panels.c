/* bf16 GEMM over pre-packed weight panels (decode_kernels.h: anneal_gemv_weight's
 * .bf16_panels, anneal_gemv_pack_panels_bf16): y = act(x W^T + b) for 1 to hundreds of
 * rows of x, f32 activations and accumulation.
 *
 * Layout: the output columns in panels of 16 (the last zero-padded); a panel is `in`
 * steps of 32 bytes, step k holding W[j, k] of its 16 columns with 32-bit word l (l < 8)
 * = column l in the low half and column 8 + l in the high half, so one 32-byte load
 * widens exactly to two 8-lane f32 vectors by a shift (columns 0..7) and a mask (8..15).
 * Panels follow each other in memory: a thread's contiguous range of panels is one
 * linear stream. 16 columns = two ymm per step: a 6-row x 16-column register tile is 12
 * accumulators + 2 weight vectors + 1 broadcast, the 16 AVX2 registers.
 *
 * Order of the sums: every output element is one f32 accumulator, started at 0 and
 * updated with a fused multiply-add for k = 0, 1, .., in - 1, then the bias added and the
 * epilogue applied. Nothing else (no partial sums, no K split), so an element's bits do
 * not depend on n, on the row's place in the batch, on the thread count or on the path
 * (AVX-512 from 3 rows, AVX2 + FMA, or the portable fmaf loop).
 *
 * Blocking (walk_panels, both x86 kernels): each thread's panels in column blocks of about
 * PANEL_BLOCK bytes (kept in L2 and reused by every strip of rows); rows in balanced strips
 * of at most 6 (AVX2; 8 and 2-panel tiles on AVX-512, below); per
 * (strip, block) the tiles of R rows x P panels (P = 4 for one row, 2 for two: enough
 * independent FMA chains to hide the FMA latency, the single row then being memory-bound)
 * walk k from 0 to in - 1. From 3 rows the first strip's tiles prefetch the next panel
 * (into L2); for 1 and 2 rows the hardware prefetchers follow the linear stream alone
 * (faster on Zen 3 than any software prefetch tried: a block ahead, a panel ahead, T0, T1). */
#include "cpu/gemv_panels.h"

#include "anneal/decode_kernels.h"
#include "cpu/cpu_kernels.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PANELS_X86 1
#endif

enum { PW = 16, MAX_R = 6, MAX_R512 = 8 }; /* panel width; rows per tile: AVX2, AVX-512 */

/* Bytes of weights per column block (L2 is 512 KiB a core on Zen 3; 96 KiB and 384 KiB
 * measured no different at 16 and 128 rows). */
#ifndef PANEL_BLOCK
#define PANEL_BLOCK (192 * 1024)
#endif

/* The position in a panel step of column c (0..15). */
static inline int lane_pos(int c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }

int64_t anneal_gemv_panels_bf16_len(int64_t in, int64_t out) { return (out + PW - 1) / PW * PW * in; }

/* f to bf16 as anneal_f32_to_bf16 (nearest even, NaNs quieted), inline for the packing. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void anneal_gemv_pack_panels_bf16(const float *src, bool out_in, int64_t in, int64_t out, uint16_t *dst) {
    const int64_t panels = (out + PW - 1) / PW;
#pragma omp parallel for schedule(static) if (in * out >= (1 << 18))
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *d = dst + p * PW * in;
        const int cols = (int)(out - p * PW < PW ? out - p * PW : PW);
        if (cols < PW) memset(d, 0, (size_t)(PW * in) * sizeof *d);
        if (out_in) { /* column c is row p * 16 + c of src: read each row once, in order */
            for (int c = 0; c < cols; c++) {
                const float *s = src + (p * PW + c) * in;
                const int pos = lane_pos(c);
                for (int64_t k = 0; k < in; k++) d[k * PW + pos] = bf16_round(s[k]);
            }
        } else { /* step k is 16 contiguous values of src's row k */
            for (int64_t k = 0; k < in; k++) {
                const float *s = src + k * out + p * PW;
                for (int c = 0; c < cols; c++) d[k * PW + lane_pos(c)] = bf16_round(s[c]);
            }
        }
    }
}

/* act on one value: gemv.c's epilogue, the same expression (so the same bits). */
static inline float epilogue(float y, int act) {
    if (act == ANNEAL_GEMV_GELU_TANH) {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        return 0.5f * y * (1.0f + tanhf(c * (y + 0.044715f * y * y * y)));
    }
    return y;
}

/* Stores the 16 sums s of one row and panel (columns j0 ..) into y: the first `cols` of
 * them, plus the bias, through the epilogue. Not inlined: every path runs this code. */
static __attribute__((noinline)) void finish(const float *s, float *y, int64_t j0, int64_t cols, const float *bias,
                                             int act) {
    for (int64_t c = 0; c < cols; c++) {
        float v = s[c];
        if (bias) v += bias[j0 + c];
        y[j0 + c] = epilogue(v, act);
    }
}

/* Portable: panels [p0, p1) for the n rows, each sum an fmaf loop in k order. */
static void panels_scalar(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                          int64_t ldy, int act, int64_t p0, int64_t p1) {
    const uint16_t *W = w->w;
    const int64_t in = w->in;
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *pan = W + p * PW * in;
        const int64_t j0 = p * PW, cols = w->out - j0 < PW ? w->out - j0 : PW;
        for (int64_t r = 0; r < n; r++) {
            const float *xr = x + r * ldx;
            float s[PW] = {0};
            for (int64_t k = 0; k < in; k++)
                for (int c = 0; c < PW; c++) s[c] = fmaf(xr[k], anneal_bf16_to_f32(pan[k * PW + lane_pos(c)]), s[c]);
            finish(s, y + r * ldy, j0, cols, w->bias, act);
        }
    }
}

#ifdef PANELS_X86
#define PANELS_AVX2 __attribute__((target("avx2,fma")))
#define PANELS_INLINE static inline __attribute__((always_inline))

/* The two widened halves of panel step u: columns 0..7 (shift) and 8..15 (mask). */
#define WIDEN(u, wl, wh)                                                                                     \
    const __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));                                        \
    const __m256 wh = _mm256_castsi256_ps(_mm256_and_si256(u, mask))

/* R rows (xr, yr) x P consecutive panels (the first at pan, `pst` elements apart, its first
 * column j0) over k = 0 .. in - 1, one FMA chain per element (R, P constants: P = 1 and
 * R <= 6, or R = 1 and P = 4, or R = 2 and P = 2). The accumulators are named variables
 * (pair i = r * P + p): GCC keeps an array of them in memory, storing it every step. */
PANELS_AVX2 PANELS_INLINE void tile(const uint16_t *pan, size_t pst, const float *const *xr, float *const *yr,
                                    const int R, const int P, int64_t in, int64_t j0, int64_t out, const float *bias,
                                    int act, const char *pf) {
    __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0,
           h4 = l0, l5 = l0, h5 = l0;
    const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);
    const float *x0 = xr[0], *x1 = xr[R > 1 ? 1 : 0], *x2 = xr[R > 2 ? 2 : 0], *x3 = xr[R > 3 ? 3 : 0],
                *x4 = xr[R > 4 ? 4 : 0], *x5 = xr[R > 5 ? 5 : 0];
    for (int64_t k = 0; k < in; k++) {
        if (P == 1) {
            const __m256i u = _mm256_loadu_si256((const __m256i *)(pan + k * PW));
            WIDEN(u, wl, wh);
#define ROW(i)                                                                                               \
    if (R > i) {                                                                                             \
        const __m256 b = _mm256_broadcast_ss(x##i + k);                                                      \
        l##i = _mm256_fmadd_ps(b, wl, l##i);                                                                 \
        h##i = _mm256_fmadd_ps(b, wh, h##i);                                                                 \
    }
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
        } else if (P == 4) {
            const __m256 b = _mm256_broadcast_ss(x0 + k);
#define PAN(i)                                                                                               \
    {                                                                                                        \
        const __m256i u = _mm256_loadu_si256((const __m256i *)(pan + (size_t)i * pst + k * PW));             \
        WIDEN(u, wl, wh);                                                                                    \
        l##i = _mm256_fmadd_ps(b, wl, l##i);                                                                 \
        h##i = _mm256_fmadd_ps(b, wh, h##i);                                                                 \
    }
            PAN(0) PAN(1) PAN(2) PAN(3)
#undef PAN
        } else {
            const __m256 b0 = _mm256_broadcast_ss(x0 + k), b1 = _mm256_broadcast_ss(x1 + k);
            const __m256i u0 = _mm256_loadu_si256((const __m256i *)(pan + k * PW));
            const __m256i u1 = _mm256_loadu_si256((const __m256i *)(pan + pst + k * PW));
            WIDEN(u0, wl0, wh0);
            WIDEN(u1, wl1, wh1);
            l0 = _mm256_fmadd_ps(b0, wl0, l0), h0 = _mm256_fmadd_ps(b0, wh0, h0);
            l1 = _mm256_fmadd_ps(b0, wl1, l1), h1 = _mm256_fmadd_ps(b0, wh1, h1);
            l2 = _mm256_fmadd_ps(b1, wl0, l2), h2 = _mm256_fmadd_ps(b1, wh0, h2);
            l3 = _mm256_fmadd_ps(b1, wl1, l3), h3 = _mm256_fmadd_ps(b1, wh1, h3);
        }
        if (pf && !(k & 1)) _mm_prefetch(pf + (size_t)k * PW * 2, _MM_HINT_T1);
    }
    float s[6][PW];
    _mm256_storeu_ps(s[0], l0), _mm256_storeu_ps(s[0] + 8, h0);
    _mm256_storeu_ps(s[1], l1), _mm256_storeu_ps(s[1] + 8, h1);
    _mm256_storeu_ps(s[2], l2), _mm256_storeu_ps(s[2] + 8, h2);
    _mm256_storeu_ps(s[3], l3), _mm256_storeu_ps(s[3] + 8, h3);
    _mm256_storeu_ps(s[4], l4), _mm256_storeu_ps(s[4] + 8, h4);
    _mm256_storeu_ps(s[5], l5), _mm256_storeu_ps(s[5] + 8, h5);
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            const int64_t jp = j0 + p * PW;
            finish(s[r * P + p], yr[r], jp, out - jp < PW ? out - jp : PW, bias, act);
        }
}
#undef WIDEN

/* tile() with R and P as constants (the shapes the blocking uses). */
PANELS_AVX2 static void tile_rp(const uint16_t *pan, size_t pst, const float *const *xr, float *const *yr, int R,
                                int P, int64_t in, int64_t j0, int64_t out, const float *bias, int act, const char *pf) {
#define T(RR, PP) tile(pan, pst, xr, yr, RR, PP, in, j0, out, bias, act, pf)
    if (P == 4) { T(1, 4); return; }
    if (P == 2) { T(2, 2); return; }
    switch (R) {
    case 1: T(1, 1); break;
    case 2: T(2, 1); break;
    case 3: T(3, 1); break;
    case 4: T(4, 1); break;
    case 5: T(5, 1); break;
    default: T(6, 1); break;
    }
#undef T
}

/* A tile kernel: R rows (xr, yr) x P consecutive panels from pan (see tile()). */
typedef void (*tile_fn)(const uint16_t *pan, size_t pst, const float *const *xr, float *const *yr, int R, int P,
                        int64_t in, int64_t j0, int64_t out, const float *bias, int act, const char *pf);

/* Panels [p0, p1) for the n rows through `tile` (see the top): column blocks of about
 * PANEL_BLOCK bytes (whole tiles), balanced strips of at most max_r rows, tiles of P
 * panels (a last single panel as P = 1). From 3 rows the first strip prefetches the
 * panel after each tile into L2 (for 1 and 2 rows the hardware prefetchers alone were
 * faster). */
static void walk_panels(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                        int act, int64_t p0, int64_t p1, int max_r, int P, tile_fn tile) {
    const uint16_t *W = w->w;
    const int64_t in = w->in;
    const size_t pst = (size_t)(PW * in);
    const int64_t pbytes = PW * in * 2;
    int64_t cb = PANEL_BLOCK / pbytes / P * P;
    if (cb < P) cb = P;
    const int64_t strips = (n + max_r - 1) / max_r;
    for (int64_t b0 = p0; b0 < p1; b0 += cb) {
        const int64_t b1 = b0 + cb < p1 ? b0 + cb : p1;
        for (int64_t s = 0; s < strips; s++) {
            const int64_t r0 = n * s / strips, r1 = n * (s + 1) / strips;
            const int R = (int)(r1 - r0);
            const float *xr[MAX_R512];
            float *yr[MAX_R512];
            for (int r = 0; r < R; r++) xr[r] = x + (r0 + r) * ldx, yr[r] = y + (r0 + r) * ldy;
            for (int64_t p = b0; p < b1;) {
                const int pp = b1 - p >= P ? P : 1;
                const char *pf = n > 2 && s == 0 && p + pp < p1 ? (const char *)(W + (size_t)(p + pp) * pst) : NULL;
                tile(W + (size_t)p * pst, pst, xr, yr, R, pp, in, p * PW, w->out, w->bias, act, pf);
                p += pp;
            }
        }
    }
}

/* AVX-512 (3 or more rows): a panel step's 32 bytes zero-extended to 16 dwords and
 * shifted into f32 (vpmovzxwd + vpslld) give the 16 columns in one register, in the
 * step's order (lane 2l = column l, lane 2l + 1 = column 8 + l), so
 * a tile of R <= 8 rows x 2 panels is 16 accumulators, each lane one FMA chain in k order
 * as in the AVX2 kernel: the same bits. At the end a permute puts the lanes in column
 * order. Per step: 2 loads and 4 widening uops for 16 FMAs of 16 lanes, where AVX2 spends
 * 2 widening uops on 12 FMAs of 8 (twice the multiply-adds per cycle on a core with two
 * 512-bit FMA units). */
#define PANELS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

/* Panel step u (16 bf16) widened to f32 in the step's lane order. */
#define WIDEN512(ptr) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ptr))), 16))

/* R rows x P panels (R <= 8, P <= 2, constants), as tile() above. */
PANELS_AVX512 PANELS_INLINE void tile512(const uint16_t *pan, size_t pst, const float *const *xr, float *const *yr,
                                         const int R, const int P, int64_t in, int64_t j0, int64_t out,
                                         const float *bias, int act, const char *pf) {
    __m512 c[MAX_R512][2];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) c[r][q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k++) {
        __m512 wv[2];
        for (int q = 0; q < P; q++) wv[q] = WIDEN512(pan + (size_t)q * pst + k * PW);
        for (int r = 0; r < R; r++) {
            const __m512 b = _mm512_set1_ps(xr[r][k]);
            for (int q = 0; q < P; q++) c[r][q] = _mm512_fmadd_ps(b, wv[q], c[r][q]);
        }
        if (pf && !(k & 1)) _mm_prefetch(pf + (size_t)k * PW * 2, _MM_HINT_T1);
    }
    /* lane lane_pos(col) holds column col */
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) {
            float s[PW];
            _mm512_storeu_ps(s, _mm512_permutexvar_ps(order, c[r][q]));
            const int64_t jp = j0 + q * PW;
            finish(s, yr[r], jp, out - jp < PW ? out - jp : PW, bias, act);
        }
}
#undef WIDEN512

/* tile512() with R and P as constants. */
PANELS_AVX512 static void tile512_rp(const uint16_t *pan, size_t pst, const float *const *xr, float *const *yr,
                                     int R, int P, int64_t in, int64_t j0, int64_t out, const float *bias, int act,
                                     const char *pf) {
#define T(RR)                                                                                                \
    case RR:                                                                                                 \
        if (P == 2) tile512(pan, pst, xr, yr, RR, 2, in, j0, out, bias, act, pf);                             \
        else tile512(pan, pst, xr, yr, RR, 1, in, j0, out, bias, act, pf);                                    \
        break;
    switch (R) {
        T(1) T(2) T(3) T(4) T(5) T(6) T(7)
    default:
        if (P == 2) tile512(pan, pst, xr, yr, 8, 2, in, j0, out, bias, act, pf);
        else tile512(pan, pst, xr, yr, 8, 1, in, j0, out, bias, act, pf);
        break;
    }
#undef T
}

#endif

/* The panel kernel this call takes: AVX2 + FMA where the CPU has them and ANNEAL_CPU_ISA
 * allows, else portable. */
static bool use_avx2(void) {
#ifdef PANELS_X86
    static int has = -1;
    if (has < 0) has = anneal_cpu_has_avx2() && __builtin_cpu_supports("fma");
    return has && anneal_cpu_isa_limit() >= ANNEAL_ISA_AVX2;
#else
    return false;
#endif
}

/* AVX-512 F/BW/VL where the CPU has them and ANNEAL_CPU_ISA allows avx512. */
static bool use_avx512(void) {
#ifdef PANELS_X86
    static int has = -1;
    if (has < 0)
        has = anneal_cpu_has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
              __builtin_cpu_supports("fma");
    return has && anneal_cpu_isa_limit() >= ANNEAL_ISA_AVX512;
#else
    return false;
#endif
}

void anneal_gemv_panels(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                        int act) {
    const int64_t panels = (w->out + PW - 1) / PW;
    const bool par = panels > 1 && w->in * w->out * n >= 65536;
    const bool avx2 = use_avx2(), avx512 = n >= 3 && use_avx512(); /* 1 and 2 rows: memory-bound, AVX2 */
#pragma omp parallel if (par)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (p0 < p1) {
#ifdef PANELS_X86
            if (avx512) /* tiles of 8 rows x 2 panels */
                walk_panels(w, x, ldx, n, y, ldy, act, p0, p1, MAX_R512, 2, tile512_rp);
            else if (avx2) /* tile_rp's shapes: (1, 4), (2, 2), (R <= 6, 1) */
                walk_panels(w, x, ldx, n, y, ldy, act, p0, p1, MAX_R, n == 1 ? 4 : n == 2 ? 2 : 1, tile_rp);
            else
#endif
                panels_scalar(w, x, ldx, n, y, ldy, act, p0, p1);
        }
    }
    (void)avx2, (void)avx512;
}
