/* GEMV / skinny GEMM for decoding (decode_kernels.h): y = act(x W + b) for a few rows,
 * f32 or bf16 weights, f32 activations and accumulation.
 *
 * Decoding is memory-bound: per token every weight is read once and used for n rows, so
 * the kernels stream W in its stored layout (no packing) and keep the n-row partial sums
 * in registers:
 *   W (in, out) (GPT-2's Conv1D): each thread a contiguous range of output columns; it
 *     walks W's rows in k order, 4 rows at a time, in strips of up to 1024 columns, so W
 *     is read as long contiguous row pieces (strided narrow tiles would touch a new page
 *     per row and wait on each miss); the n rows' partial sums live in y (L1/L2), k in
 *     increasing order.
 *   W (out, in) (torch Linear, the tied lm head): 4 output rows per work item, each a dot
 *     product with up to 4 rows of x over k in 16-lane chunks (16 accumulators), the 16
 *     lanes summed at the end.
 * bf16 weights are widened exactly (the bits shifted into the high half of an f32).
 * Threads take contiguous ranges of output columns; every output is computed by one item, so the bits do not depend on the
 * thread count. Without AVX-512, AVX2 + FMA kernels compute the same sums in the same
 * order in 8-lane halves (same bits); without either, a scalar loop computes the same
 * sums for W (in, out), and in k order for W (out, in). */
#include "anneal/decode_kernels.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "cpu/gemv_panels.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GEMV_X86 1
#endif

enum { OUT_ROWS = 4, XROWS = 4 };

/* act on one value. */
static inline float epilogue(float y, int act) {
    if (act == ANNEAL_GEMV_GELU_TANH) {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        return 0.5f * y * (1.0f + tanhf(c * (y + 0.044715f * y * y * y)));
    }
    return y;
}

/* W[k, j] (the weight of input k in output j) in w's layout. */
static inline float w_at(const anneal_gemv_weight *w, int64_t j, int64_t k) {
    int64_t idx = k * w->out + j;
    if (w->out_in) {
        int64_t i = k;
        if (w->bf16_pairs && k < w->in / 16 * 16) i = (k & ~(int64_t)15) + ((k & 15) < 8 ? 2 * (k & 7) : 2 * (k & 7) + 1);
        idx = j * w->in + i;
    }
    return w->dtype == ANNEAL_BF16 ? anneal_bf16_to_f32(((const uint16_t *)w->w)[idx]) : ((const float *)w->w)[idx];
}

void anneal_gemv_pair_bf16(uint16_t *w, int64_t rows, int64_t in) {
    const int64_t full = in / 16 * 16;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < full; k += 16) {
            uint16_t *c = w + r * in + k, t[16];
            for (int l = 0; l < 8; l++) t[2 * l] = c[l], t[2 * l + 1] = c[8 + l];
            memcpy(c, t, sizeof t);
        }
}

/* Scalar: output columns [j0, j1) of every row. */
static void gemv_scalar(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                        int act, int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = j0; j < j1; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < w->in; k++)
                s = fmaf(x[r * ldx + k], w_at(w, j, k), s);
            if (w->bias) s += w->bias[j];
            y[r * ldy + j] = epilogue(s, act);
        }
}

#ifdef GEMV_X86
#define GEMV_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

#define GEMV_INLINE static inline __attribute__((always_inline))

/* 16 weights at p: f32, or bf16 widened (BF, a constant at every call). */
GEMV_TARGET GEMV_INLINE __m512 loadw(const void *p, const bool BF) {
    if (BF) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
    return _mm512_loadu_ps(p);
}

/* 16 bf16 weights at p in anneal_gemv_pair_bf16's order (PR), else as loadw. */
GEMV_TARGET GEMV_INLINE __m512 loadw_p(const void *p, const bool BF, const bool PR) {
    if (!PR) return loadw(p, BF);
    const __m256i u = _mm256_loadu_si256(p);
    const __m256d lo = _mm256_castsi256_pd(_mm256_slli_epi32(u, 16));
    const __m256d hi = _mm256_castsi256_pd(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
}

/* The same with the lanes outside mask m zero (and not read). */
GEMV_TARGET GEMV_INLINE __m512 loadw_m(const void *p, const bool BF, __mmask16 m) {
    if (BF) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    return _mm512_maskz_loadu_ps(m, p);
}

static inline __mmask16 lane_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* One 16-column vector (mask m, MASKED a constant) of the KB rows at `rows` (ld bytes
 * apart) added into n rows of y: y[r] = fma(x[r, k0 + i], w_i, y[r]) for i in order. */
GEMV_TARGET GEMV_INLINE void in_out_vec(const char *rows, size_t ld, int kb, const float *x, int64_t ldx, int64_t n,
                                        float *y, int64_t ldy, const bool BF, const bool MASKED, __mmask16 m) {
    enum { KB = 4 };
    __m512 wv[KB];
    for (int i = 0; i < kb; i++) wv[i] = MASKED ? loadw_m(rows + i * ld, BF, m) : loadw(rows + i * ld, BF);
    for (int64_t r = 0; r < n; r++) {
        float *yr = y + r * ldy;
        const float *xr = x + r * ldx;
        __m512 acc = MASKED ? _mm512_maskz_loadu_ps(m, yr) : _mm512_loadu_ps(yr);
        for (int i = 0; i < kb; i++) acc = _mm512_fmadd_ps(_mm512_set1_ps(xr[i]), wv[i], acc);
        if (MASKED)
            _mm512_mask_storeu_ps(yr, m, acc);
        else
            _mm512_storeu_ps(yr, acc);
    }
}

/* W (in, out): columns [j0, j1) of all n rows, summed in place in y: for each block of
 * KB rows of W (k in increasing order), each 16-column vector of the strip is loaded
 * once and added into every row's partial sums (y = fma(x_k, w_k, y), k in order), so
 * W is read as KB contiguous row pieces at a time (streams the prefetchers follow);
 * then the bias and the epilogue. */
GEMV_TARGET GEMV_INLINE void range_in_out(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                          float *y, int64_t ldy, int act, int64_t j0, int64_t j1, const bool BF) {
    enum { KB = 4, STRIP = 1024 };
    const size_t es = BF ? 2 : 4;
    const int64_t in = w->in;
    const size_t ld = (size_t)w->out * es;
    for (int64_t s0 = j0; s0 < j1; s0 += STRIP) {
        const int64_t s1 = s0 + STRIP < j1 ? s0 + STRIP : j1;
        const int64_t full = s0 + (s1 - s0) / 16 * 16;
        for (int64_t r = 0; r < n; r++) memset(y + r * ldy + s0, 0, (size_t)(s1 - s0) * sizeof(float));
        for (int64_t k0 = 0; k0 < in; k0 += KB) {
            const int kb = (int)(in - k0 < KB ? in - k0 : KB);
            const char *rows = (const char *)w->w + ((size_t)k0 * (size_t)w->out) * es;
            if (kb == KB) {
                for (int64_t c = s0; c < full; c += 16)
                    in_out_vec(rows + (size_t)c * es, ld, KB, x + k0, ldx, n, y + c, ldy, BF, false, 0xFFFF);
            } else {
                for (int64_t c = s0; c < full; c += 16)
                    in_out_vec(rows + (size_t)c * es, ld, kb, x + k0, ldx, n, y + c, ldy, BF, false, 0xFFFF);
            }
            if (full < s1)
                in_out_vec(rows + (size_t)full * es, ld, kb, x + k0, ldx, n, y + full, ldy, BF, true,
                           lane_mask(s1 - full));
        }
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = s0; j < s1; j++) {
                float v = y[r * ldy + j];
                if (w->bias) v += w->bias[j];
                y[r * ldy + j] = epilogue(v, act);
            }
    }
}

GEMV_TARGET static void range_in_out_f32(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                         float *y, int64_t ldy, int act, int64_t j0, int64_t j1) {
    range_in_out(w, x, ldx, n, y, ldy, act, j0, j1, false);
}

GEMV_TARGET static void range_in_out_bf16(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                          float *y, int64_t ldy, int act, int64_t j0, int64_t j1) {
    range_in_out(w, x, ldx, n, y, ldy, act, j0, j1, true);
}

/* W (out, in): output rows jr[0..4) (clamped duplicates allowed; only the first nj stored)
 * for R rows of x (R, BF constants): 16 lanes over k mod 16, whole 16-chunks unmasked,
 * the tail masked, the lanes summed at the end. */
GEMV_TARGET GEMV_INLINE void tile_out_in(const anneal_gemv_weight *w, const float *const *xr, float *const *yr, int R,
                                         int64_t j0, int nj, int act, const bool BF, const bool PR) {
    const size_t es = BF ? 2 : 4;
    const int64_t in = w->in, full = in / 16 * 16;
    const char *wr[OUT_ROWS];
    for (int j = 0; j < OUT_ROWS; j++)
        wr[j] = (const char *)w->w + (size_t)(j0 + (j < nj ? j : nj - 1)) * (size_t)in * es;
    __m512 acc[XROWS][OUT_ROWS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < OUT_ROWS; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 16) {
        __m512 xv[XROWS];
        for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_ps(xr[r] + k);
        for (int j = 0; j < OUT_ROWS; j++) {
            __m512 wv = loadw_p(wr[j] + (size_t)k * es, BF, PR);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
    if (full < in) {
        __mmask16 m = lane_mask(in - full);
        __m512 xv[XROWS];
        for (int r = 0; r < R; r++) xv[r] = _mm512_maskz_loadu_ps(m, xr[r] + full);
        for (int j = 0; j < OUT_ROWS; j++) {
            __m512 wv = loadw_m(wr[j] + (size_t)full * es, BF, m);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nj; j++) {
            float s = _mm512_reduce_add_ps(acc[r][j]);
            if (w->bias) s += w->bias[j0 + j];
            yr[r][j0 + j] = epilogue(s, act);
        }
}

/* Work item `it` (4 output rows of W (out, in)) for every row of x, in groups of 4 rows
 * (a last group of 1 runs the 1-row kernel; 2 or 3 rows run the 4-row one with the last
 * row repeated, writing its equal values twice). */
GEMV_TARGET GEMV_INLINE void item_out_in(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                         float *y, int64_t ldy, int act, int64_t it, const bool BF, const bool PR) {
    for (int64_t r0 = 0; r0 < n; r0 += XROWS) {
        int64_t nr = n - r0 < XROWS ? n - r0 : XROWS;
        const float *xr[XROWS];
        float *yr[XROWS];
        for (int r = 0; r < XROWS; r++) {
            int64_t rr = r0 + (r < nr ? r : nr - 1);
            xr[r] = x + rr * ldx;
            yr[r] = y + rr * ldy;
        }
        int64_t j0 = it * OUT_ROWS;
        int nj = (int)(w->out - j0 < OUT_ROWS ? w->out - j0 : OUT_ROWS);
        if (nr == 1)
            tile_out_in(w, xr, yr, 1, j0, nj, act, BF, PR);
        else
            tile_out_in(w, xr, yr, XROWS, j0, nj, act, BF, PR);
    }
}

GEMV_TARGET static void item_out_in_f32(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                        int64_t ldy, int act, int64_t it) {
    item_out_in(w, x, ldx, n, y, ldy, act, it, false, false);
}

GEMV_TARGET static void item_out_in_bf16(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                         float *y, int64_t ldy, int act, int64_t it) {
    if (w->bf16_pairs)
        item_out_in(w, x, ldx, n, y, ldy, act, it, true, true);
    else
        item_out_in(w, x, ldx, n, y, ldy, act, it, true, false);
}
#endif


#ifdef GEMV_X86
/* ---- AVX2 + FMA: the same sums in the same order as the AVX-512 kernels, in 8-lane
 * halves. W (in, out): each column's y = fma(x_k, w_k, y) for k in order, as the
 * scalar loop and AVX-512 do. W (out, in): lanes l and l + 8 of a 16-lane AVX-512
 * accumulator are lane l of two 8-lane ones, and the final sum repeats the order of
 * GCC's _mm512_reduce_add_ps (halves added, then quarters, then pairs), so the three
 * x86 paths give the same bits. */
#define GEMV_AVX2 __attribute__((target("avx2,fma")))

/* 8 weights at p (f32, or bf16 widened exactly). */
GEMV_AVX2 GEMV_INLINE __m256 loadw8(const void *p, const bool BF) {
    if (BF) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
    return _mm256_loadu_ps(p);
}

/* The first `left` (0..8) of 8 weights at p, the other lanes zero and not read. */
GEMV_AVX2 GEMV_INLINE __m256 loadw8_m(const void *p, const bool BF, int64_t left) {
    if (left >= 8) return loadw8(p, BF);
    if (BF) {
        uint16_t t[8] = {0};
        memcpy(t, p, (size_t)(left > 0 ? left : 0) * 2);
        return loadw8(t, true);
    }
    float t[8] = {0};
    memcpy(t, p, (size_t)(left > 0 ? left : 0) * 4);
    return _mm256_loadu_ps(t);
}

/* 8 floats at p, the first `left` of them (others zero). */
GEMV_AVX2 GEMV_INLINE __m256 loadx8_m(const float *p, int64_t left) { return loadw8_m(p, false, left); }

/* One 8-column vector of KB rows of W added into n rows of y (see in_out_vec). */
GEMV_AVX2 GEMV_INLINE void in_out_vec8(const char *rows, size_t ld, int kb, const float *x, int64_t ldx, int64_t n,
                                       float *y, int64_t ldy, const bool BF, int64_t left) {
    enum { KB = 4 };
    __m256 wv[KB];
    for (int i = 0; i < kb; i++) wv[i] = left < 8 ? loadw8_m(rows + i * ld, BF, left) : loadw8(rows + i * ld, BF);
    for (int64_t r = 0; r < n; r++) {
        float *yr = y + r * ldy;
        const float *xr = x + r * ldx;
        __m256 acc = left < 8 ? loadx8_m(yr, left) : _mm256_loadu_ps(yr);
        for (int i = 0; i < kb; i++) acc = _mm256_fmadd_ps(_mm256_set1_ps(xr[i]), wv[i], acc);
        if (left < 8) {
            float t[8];
            _mm256_storeu_ps(t, acc);
            memcpy(yr, t, (size_t)left * sizeof(float));
        } else {
            _mm256_storeu_ps(yr, acc);
        }
    }
}

/* W (in, out), columns [j0, j1): range_in_out in 8-column vectors. */
GEMV_AVX2 GEMV_INLINE void range_in_out8(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                         float *y, int64_t ldy, int act, int64_t j0, int64_t j1, const bool BF) {
    enum { KB = 4, PF = 4 };
    /* columns per strip: a thread's whole range of a GPT-2 matrix for one or two rows (a
     * second short strip would re-walk every row of W for a few hundred bytes each),
     * 1024 from 4 rows on (the rows' partial sums stay in L1/L2) */
    const int64_t STRIP = n >= 4 ? 1024 : 4096 / n;
    const size_t es = BF ? 2 : 4;
    const int64_t in = w->in;
    const size_t ld = (size_t)w->out * es;
    for (int64_t s0 = j0; s0 < j1; s0 += STRIP) {
        const int64_t s1 = s0 + STRIP < j1 ? s0 + STRIP : j1;
        const int64_t full = s0 + (s1 - s0) / 8 * 8;
        for (int64_t r = 0; r < n; r++) memset(y + r * ldy + s0, 0, (size_t)(s1 - s0) * sizeof(float));
        for (int64_t k0 = 0; k0 < in; k0 += KB) {
            const int kb = (int)(in - k0 < KB ? in - k0 : KB);
            const char *rows = (const char *)w->w + ((size_t)k0 * (size_t)w->out) * es;
            if (kb == KB) {
                /* the rows PF blocks ahead, a cache line at a time: W is read as short
                 * row pieces far apart, which the hardware prefetchers follow late */
                const bool pf = k0 + (PF + 1) * KB <= in;
                const char *ahead = rows + (size_t)(PF * KB) * ld;
                for (int64_t c = s0; c < full; c += 8) {
                    if (pf && (((size_t)(c - s0) * es) & 63) == 0)
                        for (int i = 0; i < KB; i++) _mm_prefetch(ahead + i * ld + (size_t)c * es, _MM_HINT_T0);
                    in_out_vec8(rows + (size_t)c * es, ld, KB, x + k0, ldx, n, y + c, ldy, BF, 8);
                }
            } else {
                for (int64_t c = s0; c < full; c += 8)
                    in_out_vec8(rows + (size_t)c * es, ld, kb, x + k0, ldx, n, y + c, ldy, BF, 8);
            }
            if (full < s1)
                in_out_vec8(rows + (size_t)full * es, ld, kb, x + k0, ldx, n, y + full, ldy, BF, s1 - full);
        }
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = s0; j < s1; j++) {
                float v = y[r * ldy + j];
                if (w->bias) v += w->bias[j];
                y[r * ldy + j] = epilogue(v, act);
            }
    }
}

GEMV_AVX2 static void range_in_out8_f32(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                        float *y, int64_t ldy, int act, int64_t j0, int64_t j1) {
    range_in_out8(w, x, ldx, n, y, ldy, act, j0, j1, false);
}

GEMV_AVX2 static void range_in_out8_bf16(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n,
                                         float *y, int64_t ldy, int act, int64_t j0, int64_t j1) {
    range_in_out8(w, x, ldx, n, y, ldy, act, j0, j1, true);
}

/* The 16-lane sum of (lo, hi) in _mm512_reduce_add_ps's order. */
GEMV_AVX2 GEMV_INLINE float reduce16(__m256 lo, __m256 hi) {
    __m256 t3 = _mm256_add_ps(hi, lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

/* The low (k mod 16 < 8) and high halves of the 16 weights at p: f32, bf16, or bf16 in
 * anneal_gemv_pair_bf16's order (PR: one load, the halves by a shift and a mask). */
GEMV_AVX2 GEMV_INLINE __m256 w16_lo(const char *p, const bool BF, const bool PR) {
    if (PR) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16));
    return loadw8(p, BF);
}

GEMV_AVX2 GEMV_INLINE __m256 w16_hi(const char *p, const bool BF, const bool PR) {
    if (PR)
        return _mm256_castsi256_ps(
            _mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi32((int)0xffff0000u)));
    return loadw8(p + 8 * (BF ? 2 : 4), BF);
}

/* Bytes ahead of the weight row being read that the W (out, in) AVX2 kernel prefetches:
 * the rows are walked one after another in address order, so this is the linear stream. */
enum { OUT_IN_PREFETCH = 1024 };

/* W (out, in): output row j for R (1 or 2, a constant) rows of x, lanes as the AVX-512
 * tile (k mod 16 in two 8-lane halves). One weight row at a time, in address order,
 * prefetched ahead: interleaving the 4 rows of an item as short streams ran at half the
 * memory bandwidth on Zen 3. */
GEMV_AVX2 GEMV_INLINE void row_out_in8(const anneal_gemv_weight *w, const float *const *xr, float *const *yr, const int R,
                                       int64_t j, int act, const bool BF, const bool PR) {
    const size_t es = BF ? 2 : 4;
    const int64_t in = w->in, full = in / 16 * 16;
    const char *wr = (const char *)w->w + (size_t)j * (size_t)in * es;
    __m256 lo[2], hi[2];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < full; k += 16) {
        _mm_prefetch(wr + (size_t)k * es + OUT_IN_PREFETCH, _MM_HINT_T0);
        const __m256 wl = w16_lo(wr + (size_t)k * es, BF, PR), wh = w16_hi(wr + (size_t)k * es, BF, PR);
        for (int r = 0; r < R; r++) {
            lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + k), wl, lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + k + 8), wh, hi[r]);
        }
    }
    if (full < in) {
        const int64_t left = in - full;
        const __m256 wl = loadw8_m(wr + (size_t)full * es, BF, left);
        const __m256 wh = left > 8 ? loadw8_m(wr + (size_t)(full + 8) * es, BF, left - 8) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            lo[r] = _mm256_fmadd_ps(loadx8_m(xr[r] + full, left), wl, lo[r]);
            hi[r] = _mm256_fmadd_ps(loadx8_m(xr[r] + full + 8, left - 8), wh, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = reduce16(lo[r], hi[r]);
        if (w->bias) s += w->bias[j];
        yr[r][j] = epilogue(s, act);
    }
}

/* Work item `it` (4 output rows of W (out, in)) for every row of x: row by row of W, each
 * against the rows of x two at a time (the weight row stays in L1 for the later pairs). */
GEMV_AVX2 GEMV_INLINE void item_out_in8(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                        int64_t ldy, int act, int64_t it, const bool BF, const bool PR) {
    const int64_t j0 = it * OUT_ROWS, j1 = j0 + OUT_ROWS < w->out ? j0 + OUT_ROWS : w->out;
    for (int64_t j = j0; j < j1; j++)
        for (int64_t r0 = 0; r0 < n; r0 += 2) {
            const float *xr[2] = {x + r0 * ldx, x + (r0 + 1 < n ? r0 + 1 : r0) * ldx};
            float *yr[2] = {y + r0 * ldy, y + (r0 + 1 < n ? r0 + 1 : r0) * ldy};
            if (r0 + 1 < n)
                row_out_in8(w, xr, yr, 2, j, act, BF, PR);
            else
                row_out_in8(w, xr, yr, 1, j, act, BF, PR);
        }
}

/* The many-row product's blocking: TILE_J rows of W per register tile, MANY_ITEM rows of
 * W per work item, rows of x in groups of up to MANY_RG, k in blocks of MANY_KC (a group's
 * x block, 16 KiB, and the item's weight block stay in L1 while every tile uses them). */
enum { TILE_J = 3, MANY_ITEM = 6, MANY_RG = 16, MANY_KC = 256 };

/* W (out, in), many rows of x: output rows j0 .. j0 + nj (nj <= TILE_J; a short tile
 * repeats its last row, storing it once) for R (1 or 2) rows of x over k in [k0, k1) (whole
 * 16-chunks), register-blocked: each 8-lane x vector feeds TILE_J products, each weight
 * vector R; 2 x 3 x 2 accumulators, zero when `first`, else read from acc (where they are
 * left). With `last`, the row tail, the lane sums, bias and epilogue into y: each output's
 * lanes, tail and final sum are row_out_in8's, so the bits are too. */
GEMV_AVX2 GEMV_INLINE void tile_out_in8(const anneal_gemv_weight *w, const float *const *xr, float *const *yr,
                                        const int R, int64_t j0, int nj, int64_t k0, int64_t k1, bool first,
                                        bool last, __m256 *acc, int act, const bool BF, const bool PR) {
    const size_t es = BF ? 2 : 4;
    const int64_t in = w->in, full = in / 16 * 16;
    const char *wr[TILE_J];
    for (int j = 0; j < TILE_J; j++) wr[j] = (const char *)w->w + (size_t)(j0 + (j < nj ? j : nj - 1)) * (size_t)in * es;
    __m256 lo[2][TILE_J], hi[2][TILE_J];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < TILE_J; j++) {
            lo[r][j] = first ? _mm256_setzero_ps() : acc[(r * TILE_J + j) * 2];
            hi[r][j] = first ? _mm256_setzero_ps() : acc[(r * TILE_J + j) * 2 + 1];
        }
    for (int64_t k = k0; k < k1; k += 16) {
        __m256 xv[2];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(xr[r] + k);
        for (int j = 0; j < TILE_J; j++) {
            const __m256 wv = w16_lo(wr[j] + (size_t)k * es, BF, PR);
            for (int r = 0; r < R; r++) lo[r][j] = _mm256_fmadd_ps(xv[r], wv, lo[r][j]);
        }
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(xr[r] + k + 8);
        for (int j = 0; j < TILE_J; j++) {
            const __m256 wv = w16_hi(wr[j] + (size_t)k * es, BF, PR);
            for (int r = 0; r < R; r++) hi[r][j] = _mm256_fmadd_ps(xv[r], wv, hi[r][j]);
        }
    }
    if (!last) {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < TILE_J; j++) {
                acc[(r * TILE_J + j) * 2] = lo[r][j];
                acc[(r * TILE_J + j) * 2 + 1] = hi[r][j];
            }
        return;
    }
    if (full < in) {
        const int64_t left = in - full;
        for (int j = 0; j < TILE_J; j++) {
            const __m256 wl = loadw8_m(wr[j] + (size_t)full * es, BF, left);
            const __m256 wh = left > 8 ? loadw8_m(wr[j] + (size_t)(full + 8) * es, BF, left - 8) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                lo[r][j] = _mm256_fmadd_ps(loadx8_m(xr[r] + full, left), wl, lo[r][j]);
                hi[r][j] = _mm256_fmadd_ps(loadx8_m(xr[r] + full + 8, left - 8), wh, hi[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nj; j++) {
            float s = reduce16(lo[r][j], hi[r][j]);
            if (w->bias) s += w->bias[j0 + j];
            yr[r][j0 + j] = epilogue(s, act);
        }
}

/* Prefetches the weights of the next k block a many-row item reads (rows j0 .. j0 +
 * MANY_ITEM from k0, within W): without it each block's first tile waits on memory. */
GEMV_AVX2 GEMV_INLINE void prefetch_block(const anneal_gemv_weight *w, int64_t j0, int64_t k0, size_t es) {
    const int64_t k1 = k0 + MANY_KC < w->in ? k0 + MANY_KC : w->in;
    for (int64_t j = j0; j < j0 + MANY_ITEM && j < w->out && k0 < k1; j++) {
        const char *p = (const char *)w->w + ((size_t)j * (size_t)w->in + (size_t)k0) * es;
        for (size_t b = 0; b < (size_t)(k1 - k0) * es; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
}

/* Prefetches the MANY_ITEM weight rows from j0 (contiguous in W (out, in)) into L2: the
 * next item's, while this one computes (a matrix larger than the caches, the lm head,
 * otherwise waits on memory at every block). */
GEMV_AVX2 GEMV_INLINE void prefetch_item_l2(const anneal_gemv_weight *w, int64_t j0, size_t es) {
    const int64_t j1 = j0 + MANY_ITEM < w->out ? j0 + MANY_ITEM : w->out;
    if (j0 >= j1) return;
    const char *p = (const char *)w->w + (size_t)j0 * (size_t)w->in * es;
    for (size_t b = 0; b < (size_t)(j1 - j0) * (size_t)w->in * es; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* Many-row work item `it` (MANY_ITEM rows of W (out, in)) for every row of x: per group
 * of up to MANY_RG rows of x, per block of MANY_KC of k, every tile of TILE_J weight rows
 * against the group's rows two at a time (the partial sums kept in acc between blocks). */
GEMV_AVX2 GEMV_INLINE void item_many8(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                      int64_t ldy, int act, int64_t it, const bool BF, const bool PR) {
    enum { TILES = MANY_ITEM / TILE_J, PAIRS = MANY_RG / 2, ACC = 2 * TILE_J * 2 };
    __m256 acc[TILES][PAIRS][ACC];
    const int64_t j0 = it * MANY_ITEM, j1 = j0 + MANY_ITEM < w->out ? j0 + MANY_ITEM : w->out;
    const int64_t full = w->in / 16 * 16;
    const size_t es = BF ? 2 : 4;
    for (int64_t g0 = 0; g0 < n; g0 += MANY_RG) {
        const int64_t g1 = g0 + MANY_RG < n ? g0 + MANY_RG : n;
        for (int64_t k0 = 0; k0 == 0 || k0 < full; k0 += MANY_KC) {
            const int64_t k1 = k0 + MANY_KC < full ? k0 + MANY_KC : full;
            const bool first = k0 == 0, last = k1 == full;
            prefetch_block(w, last ? j1 : j0, last ? 0 : k1, es);
            if (first && g0 == 0) prefetch_item_l2(w, j1, es);
            for (int64_t jt = j0, t = 0; jt < j1; jt += TILE_J, t++) {
                const int nj = (int)(j1 - jt < TILE_J ? j1 - jt : TILE_J);
                for (int64_t r0 = g0; r0 < g1; r0 += 2) {
                    const float *xr[2] = {x + r0 * ldx, x + (r0 + 1 < g1 ? r0 + 1 : r0) * ldx};
                    float *yr[2] = {y + r0 * ldy, y + (r0 + 1 < g1 ? r0 + 1 : r0) * ldy};
                    __m256 *a = acc[t][(r0 - g0) / 2];
                    if (r0 + 1 < g1)
                        tile_out_in8(w, xr, yr, 2, jt, nj, k0, k1, first, last, a, act, BF, PR);
                    else
                        tile_out_in8(w, xr, yr, 1, jt, nj, k0, k1, first, last, a, act, BF, PR);
                }
            }
        }
    }
}

GEMV_AVX2 static void item_many8_f32(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                     int64_t ldy, int act, int64_t it) {
    item_many8(w, x, ldx, n, y, ldy, act, it, false, false);
}

GEMV_AVX2 static void item_many8_bf16(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                      int64_t ldy, int act, int64_t it) {
    if (w->bf16_pairs)
        item_many8(w, x, ldx, n, y, ldy, act, it, true, true);
    else
        item_many8(w, x, ldx, n, y, ldy, act, it, true, false);
}

GEMV_AVX2 static void item_out_in8_f32(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                       int64_t ldy, int act, int64_t it) {
    item_out_in8(w, x, ldx, n, y, ldy, act, it, false, false);
}

GEMV_AVX2 static void item_out_in8_bf16(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                        int64_t ldy, int act, int64_t it) {
    if (w->bf16_pairs)
        item_out_in8(w, x, ldx, n, y, ldy, act, it, true, true);
    else
        item_out_in8(w, x, ldx, n, y, ldy, act, it, true, false);
}
#endif

enum { GEMV_SCALAR, GEMV_AVX2_PATH, GEMV_AVX512_PATH };

/* Rows of x from which the AVX2 W (out, in) product runs the register-blocked many-row
 * tiles (below: one weight row at a time, the linear stream batch-1 decoding wants). */
enum { MANY_MIN_ROWS = 2 };

/* The path this call takes: the best the CPU has (AVX-512 F/BW/VL, else AVX2 + FMA,
 * else scalar), or the best at or below the ISA limit (anneal_cpu_isa_limit: (read at every call,
 * so tests can compare the paths); all three give the same bits on x86. */
static int gemv_path(void) {
#ifdef GEMV_X86
    static int best = -1;
    if (best < 0)
        best = anneal_cpu_has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
                   ? GEMV_AVX512_PATH
               : anneal_cpu_has_avx2() && __builtin_cpu_supports("fma") ? GEMV_AVX2_PATH
                                                                          : GEMV_SCALAR;
    const int limit = anneal_cpu_isa_limit();
    if (limit < ANNEAL_ISA_AVX2) return GEMV_SCALAR;
    if (limit < ANNEAL_ISA_AVX512 && best >= GEMV_AVX2_PATH) return GEMV_AVX2_PATH;
    return best;
#else
    return GEMV_SCALAR;
#endif
}

const char *anneal_gemv_path_name(void) {
    int p = gemv_path();
    return p == GEMV_AVX512_PATH ? "avx512" : p == GEMV_AVX2_PATH ? "avx2" : "portable";
}

/* int8 weights: anneal_cpu_qmatmul on the n rows (x and y gathered into contiguous
 * buffers when their rows are not), then the epilogue. False when out of memory. */
static bool gemv_int8(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                      int act) {
    static const int modes[] = {[ANNEAL_QUANT_WEIGHT_ONLY] = ANNEAL_CPU_QUANT_WEIGHT_ONLY,
                                [ANNEAL_QUANT_DYNAMIC] = ANNEAL_CPU_QUANT_DYNAMIC,
                                [ANNEAL_QUANT_STATIC] = ANNEAL_CPU_QUANT_STATIC};
    if (w->qmode < ANNEAL_QUANT_WEIGHT_ONLY || w->qmode > ANNEAL_QUANT_STATIC) return false;
    const bool gx = n > 1 && ldx != w->in, gy = n > 1 && ldy != w->out;
    float *xb = gx ? malloc((size_t)(n * w->in) * sizeof *xb) : NULL;
    float *yb = gy ? malloc((size_t)(n * w->out) * sizeof *yb) : NULL;
    bool ok = (!gx || xb) && (!gy || yb);
    if (ok && gx)
        for (int64_t r = 0; r < n; r++) memcpy(xb + r * w->in, x + r * ldx, (size_t)w->in * sizeof *xb);
    anneal_cpu_qmatmul_args a = {.mode = modes[w->qmode], .compute = (int)w->qcompute, .M = n, .N = w->out,
                                 .K = w->in, .group = w->qgroup, .x = gx ? xb : x, .w = w->w, .wscale = w->qscale,
                                 .bias = w->bias, .act_scale = w->qact_scale, .y = gy ? yb : y,
                                 .wpanels = w->qpanels};
    ok = ok && anneal_cpu_qmatmul(&a) == 0;
    for (int64_t r = 0; ok && r < n; r++) {
        float *yr = y + r * ldy;
        if (gy) memcpy(yr, yb + r * w->out, (size_t)w->out * sizeof *yr);
        if (act != ANNEAL_GEMV_NONE)
            for (int64_t j = 0; j < w->out; j++) yr[j] = epilogue(yr[j], act);
    }
    free(xb);
    free(yb);
    return ok;
}

bool anneal_gemv(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                 int act) {
    if (!w || !x || !y || n <= 0 || w->in <= 0 || w->out <= 0) return true;
    if (w->dtype == ANNEAL_I8) return gemv_int8(w, x, ldx, n, y, ldy, act);
    if (w->dtype == ANNEAL_BF16 && w->bf16_panels) {
        anneal_gemv_panels(w, x, ldx, n, y, ldy, act);
        return true;
    }
    /* threads only pay off past ~64K multiply-adds */
    const bool par = w->out > 16 && w->in * w->out * n >= 65536;
    const int path = gemv_path();
    const bool bf = w->dtype == ANNEAL_BF16;
#ifdef GEMV_X86
    if (w->out_in && path == GEMV_AVX2_PATH && n >= MANY_MIN_ROWS) {
        const int64_t items = (w->out + MANY_ITEM - 1) / MANY_ITEM;
#pragma omp parallel for schedule(static) if (par)
        for (int64_t it = 0; it < items; it++) {
            if (bf)
                item_many8_bf16(w, x, ldx, n, y, ldy, act, it);
            else
                item_many8_f32(w, x, ldx, n, y, ldy, act, it);
        }
        return true;
    }
#endif
    if (w->out_in) {
        const int64_t items = (w->out + OUT_ROWS - 1) / OUT_ROWS;
#pragma omp parallel for schedule(static) if (par)
        for (int64_t it = 0; it < items; it++) {
#ifdef GEMV_X86
            if (path == GEMV_AVX512_PATH) {
                if (bf)
                    item_out_in_bf16(w, x, ldx, n, y, ldy, act, it);
                else
                    item_out_in_f32(w, x, ldx, n, y, ldy, act, it);
                continue;
            }
            if (path == GEMV_AVX2_PATH) {
                if (bf)
                    item_out_in8_bf16(w, x, ldx, n, y, ldy, act, it);
                else
                    item_out_in8_f32(w, x, ldx, n, y, ldy, act, it);
                continue;
            }
#endif
            int64_t j0 = it * OUT_ROWS, j1 = j0 + OUT_ROWS < w->out ? j0 + OUT_ROWS : w->out;
            gemv_scalar(w, x, ldx, n, y, ldy, act, j0, j1);
        }
        return true;
    }
    /* W (in, out): each thread a contiguous range of 16-column groups */
    const int64_t groups = (w->out + 15) / 16;
#pragma omp parallel if (par)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        const int64_t j0 = g0 * 16, j1 = g1 * 16 < w->out ? g1 * 16 : w->out;
        if (j0 < j1) {
#ifdef GEMV_X86
            if (path == GEMV_AVX512_PATH && bf)
                range_in_out_bf16(w, x, ldx, n, y, ldy, act, j0, j1);
            else if (path == GEMV_AVX512_PATH)
                range_in_out_f32(w, x, ldx, n, y, ldy, act, j0, j1);
            else if (path == GEMV_AVX2_PATH && bf)
                range_in_out8_bf16(w, x, ldx, n, y, ldy, act, j0, j1);
            else if (path == GEMV_AVX2_PATH)
                range_in_out8_f32(w, x, ldx, n, y, ldy, act, j0, j1);
            else
#endif
                gemv_scalar(w, x, ldx, n, y, ldy, act, j0, j1);
        }
    }
    return true;
}

void anneal_gemv_to_bf16(const float *src, uint16_t *dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= (1 << 20))
    for (int64_t i = 0; i < n; i++) dst[i] = anneal_f32_to_bf16(src[i]);
}

void anneal_kv_quantize_row_i8(const float *x, int64_t D, int8_t *q, float *scale) {
    float mx = 0.0f;
    for (int64_t d = 0; d < D; d++) mx = fabsf(x[d]) > mx ? fabsf(x[d]) : mx;
    float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
    for (int64_t d = 0; d < D; d++) {
        float r = nearbyintf(x[d] * inv);
        q[d] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    *scale = mx / 127.0f;
}
