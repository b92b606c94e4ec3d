/* The int8 product of a serving step or a prompt chunk in the decode engine (2 or more
 * rows) over weights packed in panels of 16 output rows (gemm_int8_internal.h): the same
 * int32 sums and epilogue as anneal_qrows_s8_avx2, so the same bits, at two to three
 * times its speed from 8 rows up on Zen 3 (bench/bench_qrows.c).
 *
 * Layout: panel p holds output rows 16p .. 16p + 15 (the last panel zero-padded) over
 * Kp = K rounded up to even; for each pair of k values (k, k + 1), 32 bytes: the pair of
 * rows 16p .. 16p + 7 (w[n][k], w[n][k + 1] for each n in turn), then that of rows
 * 16p + 8 .. 16p + 15. Widened to int16 (vpmovsxbw), a pair's 16 bytes are one register
 * whose vpmaddwd with x's pair (x[k], x[k + 1]) broadcast gives 8 outputs' products in
 * 8 int32 lanes: no horizontal sums, 12 accumulators for 6 rows x 16 outputs, each
 * weight load used by 6 rows. The int32 sums are exact (at most K * 127 * 128 in
 * magnitude), so their order does not matter. */
#include "gemm_int8_internal.h"

#include <immintrin.h>
#include <string.h>

#define AVX2_TARGET __attribute__((target("avx2")))

int64_t anneal_qpanels_s8_len(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * ((K + 1) & ~(int64_t)1); }

void anneal_qpanels_s8_pack(const int8_t *w, int64_t N, int64_t K, int8_t *dst) {
    const int64_t Kp = (K + 1) & ~(int64_t)1, np = (N + 15) / 16;
    for (int64_t p = 0; p < np; p++) {
        int8_t *d = dst + p * 16 * Kp;
        for (int64_t k = 0; k < Kp; k += 2)
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 8; i++) {
                    const int64_t n = p * 16 + h * 8 + i;
                    *d++ = n < N && k < K ? w[n * K + k] : 0;
                    *d++ = n < N && k + 1 < K ? w[n * K + k + 1] : 0;
                }
    }
}

/* Row i (< R) of the tile, half h: x's pair at k broadcast, its products with w (the
 * half's 8 outputs) into accumulator c<i><h>. */
#define ROW(i, h)                                                                                  \
    if (R > (i)) {                                                                                 \
        __m256i xv;                                                                                \
        /* a broadcast load gcc neither hoists nor shares between the halves (it spilled     \
         * accumulators when it did) */                                                            \
        __asm__ volatile("vpbroadcastd %1, %0" : "=x"(xv) : "m"(*(const int32_t *)(a + (i) * Kp + k))); \
        c##i##h = _mm256_add_epi32(c##i##h, _mm256_madd_epi16(w, xv));                             \
    }

/* Rows m .. m + R - 1 (R 1 to 6, a constant) of x16 by panel p: 2 * R int32 accumulators
 * in registers over the Kp / 2 pairs, then the epilogue for the panel's real outputs. */
AVX2_TARGET static inline __attribute__((always_inline)) void tile(const anneal_qrows_s8_args *q, const int8_t *panel,
                                                                   const int16_t *x16, int64_t Kp, int64_t m,
                                                                   const int R, int64_t n0) {
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
            c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const int16_t *a = x16 + m * Kp;
    for (int64_t k = 0; k < Kp; k += 2) {
        /* one half's weights live at a time: 12 accumulators, w, the broadcast and a product */
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(panel + k * 16)));
        ROW(0, 0)
        ROW(1, 0)
        ROW(2, 0)
        ROW(3, 0)
        ROW(4, 0)
        ROW(5, 0)
        w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(panel + k * 16 + 16)));
        ROW(0, 1)
        ROW(1, 1)
        ROW(2, 1)
        ROW(3, 1)
        ROW(4, 1)
        ROW(5, 1)
    }
    const __m256i c[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    const int64_t nv = q->N - n0 < 16 ? q->N - n0 : 16;
    for (int i = 0; i < R; i++) {
        int32_t s[16];
        _mm256_storeu_si256((__m256i *)s, c[i][0]);
        _mm256_storeu_si256((__m256i *)(s + 8), c[i][1]);
        const int64_t mm = m + i;
        float *y = q->y + mm * q->N + n0;
        for (int64_t j = 0; j < nv; j++)
            y[j] = (float)s[j] * (q->sx[mm] * q->wscale[n0 + j]) + (q->bias ? q->bias[n0 + j] : 0.0f);
    }
}

/* See gemm_int8_internal.h. For each panel, every 6 rows, the last 1 to 5 in one tile. */
AVX2_TARGET void anneal_qpanels_s8_avx2(const anneal_qrows_s8_args *q, const int8_t *panels, const int16_t *x16,
                                        int64_t p0, int64_t p1) {
    const int64_t Kp = (q->K + 1) & ~(int64_t)1, M = q->M;
    for (int64_t p = p0; p < p1; p++) {
        const int8_t *panel = panels + p * 16 * Kp;
        int64_t m = 0;
        for (; m + 6 <= M; m += 6) tile(q, panel, x16, Kp, m, 6, p * 16);
        switch (M - m) {
        case 5: tile(q, panel, x16, Kp, m, 5, p * 16); break;
        case 4: tile(q, panel, x16, Kp, m, 4, p * 16); break;
        case 3: tile(q, panel, x16, Kp, m, 3, p * 16); break;
        case 2: tile(q, panel, x16, Kp, m, 2, p * 16); break;
        case 1: tile(q, panel, x16, Kp, m, 1, p * 16); break;
        default: break;
        }
    }
}
