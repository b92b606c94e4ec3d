/* Symmetric int8 quantization and the quantized dense product (the qmatmul slot).
 *
 * Quantization (PyTorch's symmetric per-channel scheme with quant range [-127, 127],
 * torch.ao's PerChannelMinMaxObserver + torch.quantize_per_channel): a row, or each
 * group of `group` values of a row, gets scale = max(amax / 127, FLT_EPSILON) and
 * q = clamp(nearbyint(x / scale), -127, 127) (round half to even).
 *
 * The product y (M x N) = x (M x K) W^T + b with W int8 (N x K) and its scales:
 * - weight-only: W dequantized on the fly, f32 accumulation (x rounded to bf16 first
 *   at compute bf16; int8 values are exact in bf16). Up to 7 rows (decode, batch 1)
 *   stream the int8 weight once, 4 rows of x per pass (AVX-512, AVX2 + FMA or
 *   portable C); more rows dequantize W to f32 once and run the f32 GEMM on it (prompt processing).
 * - dynamic: each row of x quantized with its own scale (per token), the exact int8
 *   GEMM (gemm_int8.c), y = acc * (sx[m] * sw[n]) + b; up to QROWS_MAX rows on VNNI/AMX
 *   CPUs the fused VPDPBUSD pass of qrows_avx512vnni.c; on AVX2 fused passes with the
 *   same int32 sums and the same epilogue, so the same bits: up to QROWS_MAX rows
 *   gemm_int8_avx2.c's anneal_qrows_s8_avx2 (the weight streamed once), more rows its
 *   blocked anneal_qgemm_s8_avx2 (prompt processing), the activations quantized row by
 *   row in AVX2 in both; 2 or more rows over a weight packed in panels (.wpanels, the
 *   decode engine's copy) the panel kernel of its layout: qpanels_avx512vnni.c on VNNI
 *   CPUs, AMX ones included (any number of rows), qpanels_avx2.c on AVX2 ones; more than
 *   QROWS_MAX rows without a copy (prompts on the tensor path) pack the weight for the
 *   call and take the same kernel (1.5-2x the VPDPBUSD GEMM; on AMX faster than the
 *   AMX-INT8 GEMM as measured, see below).
 * - static: the same with one calibrated scale for every row. */
#include "anneal/core.h"
#include "anneal/decode_kernels.h"
#include "cpu_kernels.h"
#include "gemm_int8_internal.h"
#include "gemm_internal.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* nearbyint(x / scale) clamped to [-127, 127]. */
static inline int8_t quant1(float x, float scale) {
    float r = nearbyintf(x / scale);
    r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
    return (int8_t)r;
}

void anneal_cpu_quantize_s8(int64_t rows, int64_t cols, int64_t group, const float *x, int8_t *q, float *scales) {
    const int64_t g = group > 0 ? group : cols, ng = g > 0 ? cols / g : 0;
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < ng; j++) {
            const float *xs = x + r * cols + j * g;
            float amax = 0.0f;
            for (int64_t k = 0; k < g; k++) amax = fmaxf(amax, fabsf(xs[k]));
            float s = fmaxf(amax / 127.0f, FLT_EPSILON);
            scales[r * ng + j] = s;
            for (int64_t k = 0; k < g; k++) q[r * cols + j * g + k] = quant1(xs[k], s);
        }
    }
}

void anneal_cpu_quantize_s8_fixed(int64_t n, const float *x, float scale, int8_t *q) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) q[i] = quant1(x[i], scale);
}

void anneal_cpu_dequantize_s8(int64_t rows, int64_t cols, int64_t group, const int8_t *q, const float *scales,
                              float *x) {
    const int64_t g = group > 0 ? group : cols, ng = g > 0 ? cols / g : 0;
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++) x[r * cols + k] = (float)q[r * cols + k] * scales[r * ng + k / g];
}

/* ------------------------------------------------ weight-only, few rows */

/* y[m, n] for m in [m0, m0 + 4) (rows past M clamped and not stored), n in [n0, n1):
 * per group, the f32 sum of x * w, times the group's scale, summed over groups. */
static void wo_rows_portable(const anneal_cpu_qmatmul_args *a, int64_t m0, int64_t n0, int64_t n1) {
    const int64_t K = a->K, g = a->group > 0 ? a->group : K, ng = K / g;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = a->w + n * K;
        for (int64_t m = m0; m < m0 + 4 && m < a->M; m++) {
            const float *x = a->x + m * K;
            float acc = 0.0f;
            for (int64_t j = 0; j < ng; j++) {
                float s = 0.0f;
                for (int64_t k = j * g; k < (j + 1) * g; k++) s += x[k] * (float)w[k];
                acc += s * a->wscale[n * ng + j];
            }
            a->y[m * a->N + n] = acc + (a->bias ? a->bias[n] : 0.0f);
        }
    }
}

#define WO_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

/* MR rows of x (a constant, so the accumulators stay in registers). */
WO_TARGET static inline __attribute__((always_inline)) void wo_rows_mr(const anneal_cpu_qmatmul_args *a, int64_t m0,
                                                                      int64_t n0, int64_t n1, const int MR) {
    const int64_t K = a->K, g = a->group > 0 ? a->group : K, ng = K / g;
    const float *x[4];
    for (int i = 0; i < MR; i++) x[i] = a->x + (m0 + i < a->M ? m0 + i : a->M - 1) * K;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = a->w + n * K;
        __m512 acc[4];
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < ng; j++) {
            __m512 s[4];
            for (int i = 0; i < MR; i++) s[i] = _mm512_setzero_ps();
            for (int64_t k = j * g; k < (j + 1) * g; k += 16) {
                const int64_t left = (j + 1) * g - k;
                const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
                const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, w + k)));
                for (int i = 0; i < MR; i++) s[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x[i] + k), wv, s[i]);
            }
            const __m512 sc = _mm512_set1_ps(a->wscale[n * ng + j]);
            for (int i = 0; i < MR; i++) acc[i] = _mm512_fmadd_ps(s[i], sc, acc[i]);
        }
        for (int i = 0; i < MR && m0 + i < a->M; i++)
            a->y[(m0 + i) * a->N + n] = _mm512_reduce_add_ps(acc[i]) + (a->bias ? a->bias[n] : 0.0f);
    }
}

/* Rows [m0, m0 + 4) of x (fewer at the end: one at a time, so decode does no wasted work). */
WO_TARGET static void wo_rows_avx512(const anneal_cpu_qmatmul_args *a, int64_t m0, int64_t n0, int64_t n1) {
    if (a->M - m0 >= 4) {
        wo_rows_mr(a, m0, n0, n1, 4);
        return;
    }
    for (int64_t m = m0; m < a->M; m++) wo_rows_mr(a, m, n0, n1, 1);
}

#define WO_AVX2 __attribute__((target("avx2,fma")))

/* The first `left` (< 8) int8 weights at w widened to f32 (the others zero, not read). */
WO_AVX2 static inline __m256 wo_w8_tail(const int8_t *w, int64_t left) {
    int8_t t[8] = {0};
    memcpy(t, w, (size_t)left);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)t)));
}

/* The first `left` (< 8) floats at x (the others zero, not read). */
WO_AVX2 static inline __m256 wo_x8_tail(const float *x, int64_t left) {
    float t[8] = {0};
    memcpy(t, x, (size_t)left * sizeof *t);
    return _mm256_loadu_ps(t);
}

/* wo_rows_mr in AVX2 + FMA: 8 lanes, the weights widened with vpmovsxbd. */
WO_AVX2 static inline __attribute__((always_inline)) void wo_rows_mr8(const anneal_cpu_qmatmul_args *a, int64_t m0,
                                                                     int64_t n0, int64_t n1, const int MR) {
    const int64_t K = a->K, g = a->group > 0 ? a->group : K, ng = K / g;
    const float *x[4];
    for (int i = 0; i < MR; i++) x[i] = a->x + (m0 + i < a->M ? m0 + i : a->M - 1) * K;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = a->w + n * K;
        __m256 acc[4];
        for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < ng; j++) {
            __m256 s[4];
            for (int i = 0; i < MR; i++) s[i] = _mm256_setzero_ps();
            const int64_t end = (j + 1) * g;
            int64_t k = j * g;
            for (; k + 8 <= end; k += 8) {
                const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k))));
                for (int i = 0; i < MR; i++) s[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k), wv, s[i]);
            }
            if (k < end) {
                const __m256 wv = wo_w8_tail(w + k, end - k);
                for (int i = 0; i < MR; i++) s[i] = _mm256_fmadd_ps(wo_x8_tail(x[i] + k, end - k), wv, s[i]);
            }
            const __m256 sc = _mm256_set1_ps(a->wscale[n * ng + j]);
            for (int i = 0; i < MR; i++) acc[i] = _mm256_fmadd_ps(s[i], sc, acc[i]);
        }
        for (int i = 0; i < MR && m0 + i < a->M; i++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            a->y[(m0 + i) * a->N + n] = _mm_cvtss_f32(h) + (a->bias ? a->bias[n] : 0.0f);
        }
    }
}

/* Rows [m0, m0 + 4) of x in AVX2 (fewer at the end: one at a time). */
WO_AVX2 static void wo_rows_avx2(const anneal_cpu_qmatmul_args *a, int64_t m0, int64_t n0, int64_t n1) {
    if (a->M - m0 >= 4) {
        wo_rows_mr8(a, m0, n0, n1, 4);
        return;
    }
    for (int64_t m = m0; m < a->M; m++) wo_rows_mr8(a, m, n0, n1, 1);
}

/* The few-rows weight-only product: threads split N, each streams its weight rows once
 * per 4 rows of x. */
static void weight_only_rows(const anneal_cpu_qmatmul_args *a) {
    /* AVX-512 F/BW/VL (the VNNI probe checks them; VNNI itself is not used here) unless
     * the ISA limit is below avx512 */
    const bool v = anneal_cpu_has_avx512vnni() && anneal_cpu_isa_limit() >= ANNEAL_ISA_AVX512;
    /* AVX2 + FMA otherwise (Zen 3 and other CPUs without AVX-512) unless the limit is portable */
    const bool v2 = !v && anneal_cpu_has_avx2() && anneal_cpu_isa_limit() >= ANNEAL_ISA_AVX2;
    const int64_t nb = (a->N + 15) / 16;
#pragma omp parallel for schedule(static) if (a->N * a->K > 65536)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t n0 = b * 16, n1 = n0 + 16 < a->N ? n0 + 16 : a->N;
        for (int64_t m0 = 0; m0 < a->M; m0 += 4) {
            if (v) wo_rows_avx512(a, m0, n0, n1);
            else if (v2) wo_rows_avx2(a, m0, n0, n1);
            else wo_rows_portable(a, m0, n0, n1);
        }
    }
}

/* ---------------------------------------------------------------- driver */

/* n bytes (n > 0) at a 64-byte boundary, for free(): the AVX2 kernels' 32-byte loads of
 * the activations (xq, x16; rows a multiple of 64 bytes long at K = 768) then never split
 * a cache line. malloc's 16-byte alignment split every other one when the block started
 * 16 past a line: the int16 kernel took 15-45% longer (bench/bench_qrows.c,
 * BENCH_X16_OFFSET=16, Zen 3). */
static void *alloc64(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

/* The panel copies of decode_kernels.h: a 64-byte header, then the panels in the layout
 * of the int8 path at the time of packing: VPDPBUSD quads (qpanels_avx512vnni.c) on VNNI
 * and AMX CPUs, vpmaddwd pairs (qpanels_avx2.c) on AVX2 ones. The header names the layout
 * and the shape, so a copy is only read by its own kernel (ANNEAL_ISA can change the path
 * between calls: then the row kernels run, same bits). ANNEAL_INT8_PANELS=0 turns the
 * copies off, for side-by-side timing. */
typedef struct qpanels_header {
    uint32_t magic, layout;
    int64_t N, K;
} qpanels_header;
enum { QPANELS_MAGIC = 0x51504e4c, QPANELS_AVX2 = 1, QPANELS_VNNI = 2, QPANELS_HEADER = 64 };

/* The panel layout of the int8 path now, 0 for none. */
static uint32_t qpanels_layout_now(void) {
    const int s8 = anneal_cpu_gemm_s8_isa();
    return s8 == ANNEAL_GEMM_S8_AVX2                                     ? QPANELS_AVX2
           : s8 == ANNEAL_GEMM_S8_AVX512VNNI || s8 == ANNEAL_GEMM_S8_AMX ? QPANELS_VNNI
                                                                         : 0;
}

bool anneal_gemv_qpanels_useful(void) {
    const char *env = getenv("ANNEAL_INT8_PANELS");
    return qpanels_layout_now() != 0 && !(env && !strcmp(env, "0"));
}

/* Room for either layout (the VPDPBUSD one is the larger). */
int64_t anneal_gemv_qpanels_len(int64_t in, int64_t out) {
    const int64_t a = anneal_qpanels_s8_len(out, in), v = anneal_qpanels_vnni_len(out, in);
    return QPANELS_HEADER + (a > v ? a : v);
}

void anneal_gemv_pack_qpanels(const int8_t *w, int64_t in, int64_t out, int8_t *dst) {
    const qpanels_header h = {.magic = QPANELS_MAGIC, .layout = qpanels_layout_now(), .N = out, .K = in};
    memset(dst, 0, QPANELS_HEADER);
    memcpy(dst, &h, sizeof h);
    if (h.layout == QPANELS_VNNI) anneal_qpanels_vnni_pack(w, out, in, dst + QPANELS_HEADER);
    else if (h.layout == QPANELS_AVX2) anneal_qpanels_s8_pack(w, out, in, dst + QPANELS_HEADER);
}

/* a's panel copy when it is in `layout` for a's shape, else NULL. */
static const int8_t *panels_in(const anneal_cpu_qmatmul_args *a, uint32_t layout) {
    if (!a->wpanels) return NULL;
    qpanels_header h;
    memcpy(&h, a->wpanels, sizeof h);
    return h.magic == QPANELS_MAGIC && h.layout == layout && h.N == a->N && h.K == a->K ? a->wpanels + QPANELS_HEADER
                                                                                         : NULL;
}

/* The VPDPBUSD panel product of q's rows (qpanels_avx512vnni.c) over xu, the quantized
 * rows laid out Kq = anneal_qpanels_vnni_kq(K) apart (q->xq is not read): each row offset
 * to u8 in place (xq + 128) and padded to Kq; then each thread takes a range of groups of
 * 3 panels (48 outputs) and, for each block of rows small enough to stay in L1 (about
 * 16 KiB, at least one tile's 8 rows), runs all its groups, the panels from L2. Blocks
 * of 256 KiB of rows (x from L2 against panels in L1) ran at about half the speed on
 * GPT-2 124M's 768-wide products (a Xeon with AVX-512 VNNI: 67-79 G MAC/s a core
 * against 125, bench/bench_qmatmul.c). */
static void vnni_panels_product(const anneal_qrows_s8_args *q, const int8_t *panels, uint8_t *xu) {
    const int64_t M = q->M, K = q->K, Kq = anneal_qpanels_vnni_kq(K), np = (q->N + 15) / 16, ng = (np + 2) / 3;
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) {
        uint8_t *u = xu + m * Kq;
        for (int64_t k = 0; k < K; k++) u[k] ^= 0x80u;
        for (int64_t k = K; k < Kq; k++) u[k] = 0x80u;
    }
    int64_t mb = (int64_t)(16 * 1024) / Kq;
    mb = mb < 8 ? 8 : mb & ~(int64_t)7;
#pragma omp parallel if (q->N * K * M > 65536)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t g0 = ng * t / nt, g1 = ng * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = m0 + mb < M ? m0 + mb : M;
            for (int64_t g = g0; g < g1; g++)
                anneal_qpanels_s8_avx512vnni(q, panels, xu, m0, m1, g * 3, g * 3 + 3 < np ? g * 3 + 3 : np);
        }
    }
}

/* Rows of x up to which dynamic and static products take the few-rows kernel on AVX2
 * (anneal_qrows_s8_avx2): decoding and serving steps; more rows, the blocked one. */
enum { QROWS_MAX = 32 };

int anneal_cpu_qmatmul(const anneal_cpu_qmatmul_args *a) {
    const int64_t M = a->M, N = a->N, K = a->K;
    if (M <= 0 || N <= 0) return 0;
    if (a->mode == ANNEAL_CPU_QUANT_WEIGHT_ONLY) {
        anneal_cpu_qmatmul_args b = *a;
        float *xr = NULL;
        if (a->compute == ANNEAL_BF16) { /* the activations' bf16 rounding */
            if (!(xr = malloc((size_t)(M * K) * sizeof *xr))) return -1;
            for (int64_t i = 0; i < M * K; i++) {
                uint32_t u;
                memcpy(&u, &a->x[i], 4);
                u = anneal_gemm_round_bf16_bits(u);
                memcpy(&xr[i], &u, 4);
            }
            b.x = xr;
        }
        if (M < 8) {
            weight_only_rows(&b);
        } else {
            float *wf = malloc((size_t)(N * K) * sizeof *wf);
            if (!wf) {
                free(xr);
                return -1;
            }
            anneal_cpu_dequantize_s8(N, K, a->group, a->w, a->wscale, wf);
            anneal_gemm_epilogue ep = {.bias = a->bias};
            /* f32 products of the (bf16-rounded) x and the dequantized W, as the few-rows path:
             * the bf16 GEMM would round w * scale to bf16 as well */
            anneal_cpu_gemm(ANNEAL_F32, false, true, M, N, K, 1.0f, b.x, K, wf, K, 0.0f, a->y, N, &ep);
            free(wf);
        }
        free(xr);
        return 0;
    }
    /* AVX2: the fused passes, no int32 workspace: few rows (decode, serving steps) stream
     * the weight once, many rows (prompts) the blocked GEMM. With VNNI or AMX up to
     * QROWS_MAX rows the VPDPBUSD few-rows pass (qrows_avx512vnni.c: no int32 workspace or
     * second pass, and A offset once per call instead of once per 4 weight rows; a GPT-2
     * 124M int8 decode step on a Xeon 5.8-6.1 ms against 7.1-10.4 on the GEMM), from 2
     * rows over a panel copy the VPDPBUSD panel kernel; more rows there the panel kernel
     * over a copy packed for the call. */
    const int s8 = anneal_cpu_gemm_s8_isa();
    const bool vnni = s8 == ANNEAL_GEMM_S8_AVX512VNNI || s8 == ANNEAL_GEMM_S8_AMX;
    /* a VPDPBUSD panel copy: 2 or more rows take it; without one, more than QROWS_MAX rows
     * pack the weight for this call (a copy of N K bytes against the product's M N K). On
     * AMX CPUs too: the AMX-INT8 GEMM (anneal_cpu_gemm_s8's tiles, B packed per call, A
     * tiles read in place) lost to these panels on the one AMX machine measured (GPT-2
     * 124M, 512-token prompts, 2 threads, alternated: median 1,410 against 1,703 tok/s;
     * bench/results/h200-host-2026-11-30) */
    const int8_t *vpanels = vnni && M >= 2 ? panels_in(a, QPANELS_VNNI) : NULL;
    int8_t *vpacked = NULL;
    if (!vpanels && vnni && M > QROWS_MAX &&
        (vpacked = alloc64((size_t)anneal_qpanels_vnni_len(N, K))))
        anneal_qpanels_vnni_pack(a->w, N, K, vpacked), vpanels = vpacked;
    const bool rows = s8 == ANNEAL_GEMM_S8_AVX2 || (vnni && M <= QROWS_MAX) || vpanels;
    /* the quantized rows: Kq apart for the VPDPBUSD panels (offset in place there) */
    const int64_t ldq = vpanels ? anneal_qpanels_vnni_kq(K) : K;
    int8_t *xq = rows ? alloc64((size_t)(M * ldq)) : malloc((size_t)(M * K));
    float *sx = malloc((size_t)M * sizeof *sx);
    int32_t *acc = rows ? NULL : malloc((size_t)(M * N) * sizeof *acc);
    if (!xq || !sx || (!rows && !acc)) {
        free(xq), free(sx), free(acc), free(vpacked);
        return -1;
    }
    if (rows) { /* the activations row by row in AVX2 (the same bits as below) */
#pragma omp parallel for schedule(static) if (M * K > 65536)
        for (int64_t m = 0; m < M; m++) {
            sx[m] = a->act_scale;
            anneal_quantize_row_s8_avx2(K, a->x + m * K, a->mode == ANNEAL_CPU_QUANT_DYNAMIC ? 0.0f : a->act_scale,
                                        xq + m * ldq, &sx[m]);
        }
    } else if (a->mode == ANNEAL_CPU_QUANT_DYNAMIC) {
        anneal_cpu_quantize_s8(M, K, 0, a->x, xq, sx);
    } else {
        anneal_cpu_quantize_s8_fixed(M * K, a->x, a->act_scale, xq);
        for (int64_t m = 0; m < M; m++) sx[m] = a->act_scale;
    }
    if (rows) {
        anneal_qrows_s8_args q = {.M = M, .N = N, .K = K, .xq = xq, .sx = sx, .w = a->w, .wscale = a->wscale,
                                  .bias = a->bias, .y = a->y};
        /* 2+ rows over a panel copy (the decode engine's serving steps and prompt chunks):
         * the panel kernel, same bits; without memory for its x16, the kernels below */
        const int64_t Kp = (K + 1) & ~(int64_t)1;
        const int8_t *apanels = s8 == ANNEAL_GEMM_S8_AVX2 && M >= 2 ? panels_in(a, QPANELS_AVX2) : NULL;
        int16_t *x16p = apanels ? alloc64((size_t)(M * Kp) * sizeof *x16p) : NULL;
        if (vpanels) {
            vnni_panels_product(&q, vpanels, (uint8_t *)xq);
            free(xq), free(sx), free(vpacked);
            return 0;
        } else if (x16p) {
            for (int64_t m = 0; m < M; m++)
                for (int64_t k = 0; k < Kp; k++) x16p[m * Kp + k] = k < K ? xq[m * K + k] : 0;
            const int64_t np = (N + 15) / 16;
#pragma omp parallel for schedule(static) if (N * K * M > 65536)
            for (int64_t p = 0; p < np; p++) anneal_qpanels_s8_avx2(&q, apanels, x16p, p, p + 1);
            free(x16p);
        } else if (s8 != ANNEAL_GEMM_S8_AVX2) { /* VNNI (or AMX) CPU, M <= QROWS_MAX */
            uint8_t *xu = (uint8_t *)xq; /* offset in place: xq is not read again */
            for (int64_t i = 0; i < M * K; i++) xu[i] ^= 0x80u; /* xq + 128 as u8 */
            const int64_t nb = (N + 15) / 16;                   /* 16 weight rows per item */
#pragma omp parallel for schedule(static) if (N * K * M > 65536)
            for (int64_t b = 0; b < nb; b++)
                anneal_qrows_s8_avx512vnni(&q, xu, b * 16, b * 16 + 16 < N ? b * 16 + 16 : N);
        } else if (M <= QROWS_MAX) {
            const int64_t nb = (N + 15) / 16; /* 16 weight rows per item */
            /* 2+ rows (serving steps, short prompts): the int16 kernel, same bits, while the
             * widened rows stay in L1 (K <= 1024: GPT-2 124M's 768-wide products; its
             * 3072-wide projection ran slower from L2). One row (decoding) stays on the sign
             * trick here, although the int16 kernel over 3 zero rows was faster there too
             * (one GPT-2 124M step's products 27-38% less time on Zen 3). */
            const int64_t M4 = (M + 3) & ~(int64_t)3; /* zero rows up to a multiple of 4 */
            int16_t *x16 = M >= 2 && K <= 1024 ? alloc64((size_t)(M4 * K) * sizeof *x16) : NULL;
            for (int64_t i = 0; x16 && i < M4 * K; i++) x16[i] = i < M * K ? xq[i] : 0;
#pragma omp parallel for schedule(static) if (N * K * M > 65536)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t n1 = b * 16 + 16 < N ? b * 16 + 16 : N;
                if (x16) anneal_qrows_s8_wide_avx2(&q, x16, b * 16, n1);
                else anneal_qrows_s8_avx2(&q, b * 16, n1);
            }
            free(x16);
        } else { /* each thread a contiguous range of rows (whole groups of 4) */
#pragma omp parallel
            {
                const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num(), g = (M + 3) / 4;
                const int64_t r0 = g * t / nt * 4, r1 = g * (t + 1) / nt * 4 < M ? g * (t + 1) / nt * 4 : M;
                if (r0 < r1) anneal_qgemm_s8_avx2(&q, r0, r1);
            }
        }
        free(xq), free(sx);
        return 0;
    }
    anneal_cpu_gemm_s8(M, N, K, xq, K, a->w, K, acc, N);
#pragma omp parallel for schedule(static) if (M * N > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++)
            a->y[m * N + n] = (float)acc[m * N + n] * (sx[m] * a->wscale[n]) + (a->bias ? a->bias[n] : 0.0f);
    free(xq), free(sx), free(acc);
    return 0;
}
