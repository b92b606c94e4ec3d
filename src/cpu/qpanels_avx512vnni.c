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

/* Row by row, each quad a 4-byte copy (a model's weights pack in a fraction of a second:
 * a copy is made when a decode engine first needs it). Panels in parallel. */
void anneal_qpanels_vnni_pack(const int8_t *w, int64_t N, int64_t K, int8_t *dst) {
    const int64_t Kq = anneal_qpanels_vnni_kq(K), np = (N + 15) / 16, kfull = K & ~(int64_t)3;
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t p = 0; p < np; p++) {
        int8_t *d = dst + p * panel_bytes(K);
        int32_t corr[16];
        for (int64_t i = 0; i < 16; i++) {
            const int64_t n = p * 16 + i;
            uint32_t s = 0;
            if (n >= N) { /* padding rows: zero weights */
                for (int64_t k = 0; k < Kq; k += 4) memset(d + k * 16 + 4 * i, 0, 4);
                corr[i] = 0;
                continue;
            }
            const int8_t *row = w + n * K;
            for (int64_t k = 0; k < kfull; k += 4) memcpy(d + k * 16 + 4 * i, row + k, 4);
            if (kfull < K) { /* the last quad: zeros past K */
                int8_t q[4] = {0};
                memcpy(q, row + kfull, (size_t)(K - kfull));
                memcpy(d + kfull * 16 + 4 * i, q, 4);
            }
            for (int64_t k = 0; k < K; k++) s += (uint32_t)(int32_t)row[k];
            corr[i] = (int32_t)(128u * s);
        }
        memcpy(d + 16 * Kq, corr, sizeof corr);
    }
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
