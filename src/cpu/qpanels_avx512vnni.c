/* The int8 product of 2 or more rows (serving steps, prompts) on AVX-512 VNNI over
 * weights packed in panels of 16 output rows: the same int32 sums and epilogue as the
 * other int8 kernels (anneal_qrows_s8_args), so the same bits.
 *
 * Layout (anneal_qpanels_vnni_len bytes, anneal_qpanels_vnni_pack): panel p holds output
 * rows 16p .. 16p + 15 (the last panel zero-padded) over Kq = K rounded up to a multiple
 * of 4 (zero weights past K): for each quad of k values (k .. k + 3), 64 bytes, row
 * 16p + i's four weights at bytes 4i .. 4i + 3, which is VPDPBUSD's layout: one
 * register's product with x's quad broadcast gives the panel's 16 outputs in 16 int32
 * lanes, no horizontal sums. After the Kq / 4 quads, 16 int32: 128 times each row's
 * weight sum (wrapping), the correction below. Panels one after another, each
 * 16 Kq + 64 bytes (a multiple of 64: aligned panels from an aligned start).
 *
 * VPDPBUSD multiplies u8 by s8, so the activations come offset to u8 (xu = xq + 128,
 * rows Kq long, made by the caller) and sum xq w = sum (xq + 128) w - 128 sum w, in
 * wrapping int32: the exact sum whenever it fits in int32, as the reference's. A tile
 * is 8 rows of x by 3 panels (48 outputs): 24 accumulators, 3 weight loads and 8
 * broadcasts per quad for 24 VPDPBUSD. */
#include "gemm_int8_internal.h"

#include <immintrin.h>
#include <string.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

enum { MR = 8, NP = 3 };

int64_t anneal_qpanels_vnni_kq(int64_t K) { return (K + 3) & ~(int64_t)3; }

/* Bytes of one panel. */
static int64_t panel_bytes(int64_t K) { return 16 * anneal_qpanels_vnni_kq(K) + 64; }

int64_t anneal_qpanels_vnni_len(int64_t N, int64_t K) { return (N + 15) / 16 * panel_bytes(K); }

/* Per panel: each whole quad of k one masked gather of the 16 rows' 4 bytes (rows past
 * N zero), the last partial quad (K % 4) byte by byte with zeros past K; the row sums
 * from VPDPBUSD of ones by the packed quads (lane i sums row i's bytes, wrapping), times
 * 128. Panels in parallel (a model's weights pack in tens of milliseconds). */
VNNI_TARGET static void pack_panel(const int8_t *w, int64_t N, int64_t K, int8_t *dst, int64_t p) {
    const int64_t Kq = anneal_qpanels_vnni_kq(K), kfull = K & ~(int64_t)3;
    const int64_t n0 = p * 16, rows = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 live = (__mmask16)((1u << rows) - 1u);
    const __m512i vidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)K));
    const __m512i ones = _mm512_set1_epi8(1);
    const int8_t *base = w + n0 * K;
    int8_t *d = dst + p * panel_bytes(K);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < kfull; k += 4) {
        const __m512i q = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, vidx, base + k, 1);
        _mm512_storeu_si512((void *)(d + k * 16), q);
        sum = _mm512_dpbusd_epi32(sum, ones, q);
    }
    if (kfull < K) { /* the last quad: zeros past K */
        int8_t tail[64] = {0};
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; kfull + j < K; j++) tail[4 * i + j] = base[i * K + kfull + j];
        const __m512i q = _mm512_loadu_si512((const void *)tail);
        _mm512_storeu_si512((void *)(d + kfull * 16), q);
        sum = _mm512_dpbusd_epi32(sum, ones, q);
    }
    _mm512_storeu_si512((void *)(d + 16 * Kq), _mm512_slli_epi32(sum, 7)); /* 128 sum w, wrapping */
}

/* The OpenMP loop outside the target function (clang's outlined bodies do not inherit it). */
void anneal_qpanels_vnni_pack(const int8_t *w, int64_t N, int64_t K, int8_t *dst) {
    const int64_t np = (N + 15) / 16;
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t p = 0; p < np; p++) pack_panel(w, N, K, dst, p);
}

/* Rows m .. m + R - 1 of xu by panels p .. p + P - 1 (R <= MR, P <= NP, constants: the
 * accumulators stay in registers), then the epilogue for the panels' real outputs:
 * y = (float)(acc - corr) * (sx[m] * wscale[n]) + bias[n] (0 without a bias), the
 * reference's operations in its order. */
VNNI_TARGET static inline __attribute__((always_inline)) void tile(const anneal_qrows_s8_args *q, const int8_t *panels,
                                                                   const uint8_t *xu, int64_t Kq, int64_t m,
                                                                   const int R, int64_t p, const int P) {
    const int64_t pb = 16 * Kq + 64;
    const int8_t *w = panels + p * pb;
    const uint8_t *x = xu + m * Kq;
    __m512i c[MR][NP];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < P; j++) c[i][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kq; k += 4) {
        __m512i wv[NP];
        for (int j = 0; j < P; j++) wv[j] = _mm512_loadu_si512((const void *)(w + j * pb + k * 16));
        for (int i = 0; i < R; i++) {
            int32_t quad;
            memcpy(&quad, x + i * Kq + k, sizeof quad);
            const __m512i xb = _mm512_set1_epi32(quad);
            for (int j = 0; j < P; j++) c[i][j] = _mm512_dpbusd_epi32(c[i][j], xb, wv[j]);
        }
    }
    for (int j = 0; j < P; j++) {
        const int64_t n0 = (p + j) * 16, left = q->N - n0;
        const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const __m512i corr = _mm512_loadu_si512((const void *)(w + j * pb + 16 * Kq));
        const __m512 ws = _mm512_maskz_loadu_ps(mk, q->wscale + n0);
        const __m512 bias = q->bias ? _mm512_maskz_loadu_ps(mk, q->bias + n0) : _mm512_setzero_ps();
        for (int i = 0; i < R; i++) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(c[i][j], corr));
            const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(q->sx[m + i]), ws);
            _mm512_mask_storeu_ps(q->y + (m + i) * q->N + n0, mk, _mm512_add_ps(_mm512_mul_ps(f, scale), bias));
        }
    }
}

/* tile() with R and P as constants. */
#define TILE_P(R)                                                                                                  \
    do {                                                                                                           \
        if (P == NP) tile(q, panels, xu, Kq, m, R, p, NP);                                                         \
        else if (P == 2) tile(q, panels, xu, Kq, m, R, p, 2);                                                      \
        else tile(q, panels, xu, Kq, m, R, p, 1);                                                                  \
    } while (0)

VNNI_TARGET void anneal_qpanels_s8_avx512vnni(const anneal_qrows_s8_args *q, const int8_t *panels,
                                              const uint8_t *xu, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    const int64_t Kq = anneal_qpanels_vnni_kq(q->K);
    for (int64_t p = p0; p < p1; p += NP) {
        const int P = p1 - p < NP ? (int)(p1 - p) : NP;
        int64_t m = m0;
        for (; m + MR <= m1; m += MR) TILE_P(MR);
        switch (m1 - m) {
        case 7: TILE_P(7); break;
        case 6: TILE_P(6); break;
        case 5: TILE_P(5); break;
        case 4: TILE_P(4); break;
        case 3: TILE_P(3); break;
        case 2: TILE_P(2); break;
        case 1: TILE_P(1); break;
        default: break;
        }
    }
}
