/* The int8 product of a serving step (8 or more rows: one per running request) is the
 * per-request product, bit for bit: anneal_qrows_s8_wide_avx2 (int16 kernel) against
 * anneal_qrows_s8_avx2 (the sign-trick kernel decoding uses) on shapes with K and N
 * tails, M from 1 to 33 (8-row and 4-row blocks, the last over zero padding), weights with -128; and anneal_cpu_qmatmul (dynamic and static)
 * on 16 rows against each row alone; the driver on 1 to 33 and 130 rows against a scalar
 * reference, with and without the panel copy of the weight (the decode engine's kernel
 * from 2 rows, in this CPU's layout: anneal_qpanels_s8_avx2, also against the sign trick
 * on every shape above, or the VPDPBUSD one, anneal_qpanels_s8_avx512vnni, against it on
 * shapes of its own), and with copies its kernel must not read (another layout, another
 * shape). */
#include "anneal/decode_kernels.h"
#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_int8_internal.h"
#include "test.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 7;
static uint32_t next(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 33);
}

/* Positive activation and weight scales and a small bias, as a quantizer would give. */
static void random_scales(int64_t M, int64_t N, float *sx, float *ws, float *bias) {
    for (int64_t i = 0; i < M; i++) sx[i] = (float)(next() % 1000 + 1) * 1e-4f;
    for (int64_t i = 0; i < N; i++) ws[i] = (float)(next() % 1000 + 1) * 1e-5f, bias[i] = (float)next() * 1e-9f;
}

TEST(wide_kernel_equals_the_sign_trick_kernel) {
    if (!anneal_cpu_has_avx2()) SKIP("no AVX2");
    static const int64_t shapes[][3] = {{8, 16, 32},   {16, 37, 768}, {9, 50, 40},    {15, 33, 3072},
                                        {12, 20, 64},  {15, 19, 768}, {14, 3, 48},    {16, 64, 776},
                                        {24, 17, 17},  {33, 48, 96},  {31, 5, 1},     {2, 40, 768},
                                        {3, 21, 50},   {5, 16, 768},  {1, 9, 768},    {16, 19, 3072},
                                        {32, 13, 1043}, {7, 9, 1025}, {33, 11, 2050}, {2, 17, 1536}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        int8_t *xq = malloc((size_t)(M * K)), *w = malloc((size_t)(N * K));
        int16_t *x16 = calloc((size_t)(((M + 3) & ~3) * K), sizeof *x16); /* zero rows to a multiple of 4 */
        float *sx = malloc((size_t)M * sizeof *sx), *ws = malloc((size_t)N * sizeof *ws), *bias = malloc((size_t)N * 4);
        float *y0 = malloc((size_t)(M * N) * 4), *y1 = malloc((size_t)(M * N) * 4);
        const int64_t Kp = (K + 1) & ~(int64_t)1, np = (N + 15) / 16;
        int8_t *panels = malloc((size_t)anneal_qpanels_s8_len(N, K));
        int16_t *x16p = malloc((size_t)(M * Kp) * sizeof *x16p);
        REQUIRE(xq && w && x16 && sx && ws && bias && y0 && y1 && panels && x16p);
        CHECK(anneal_qpanels_s8_len(N, K) == np * 16 * Kp, "panel bytes");
        for (int64_t i = 0; i < M * K; i++) x16[i] = xq[i] = (int8_t)((int)(next() % 255) - 127);
        for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)((int)(next() % 256) - 128); /* -128 included */
        if (K >= 2) w[0] = -128, w[1] = -128, xq[0] = x16[0] = -127, xq[1] = x16[1] = -127; /* the largest pair sum */
        for (int64_t k = 0; k < K; k++) w[(N - 1) * K + k] = -128, xq[(M - 1) * K + k] = -127; /* the largest sum */
        for (int64_t k = 0; k < K; k++) x16[(M - 1) * K + k] = -127;
        anneal_qpanels_s8_pack(w, N, K, panels);
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < Kp; k++) /* the even pad (odd K) meets the panels' zero weights */
                x16p[m * Kp + k] = k < K ? xq[m * K + k] : 777;
        random_scales(M, N, sx, ws, bias);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            anneal_qrows_s8_args q = {.M = M, .N = N, .K = K, .xq = xq, .sx = sx, .w = w, .wscale = ws,
                                      .bias = with_bias ? bias : NULL, .y = y0};
            anneal_qrows_s8_avx2(&q, 0, N);
            q.y = y1;
            /* two ranges, as the threads split the weight rows */
            anneal_qrows_s8_wide_avx2(&q, x16, 0, N / 2);
            anneal_qrows_s8_wide_avx2(&q, x16, N / 2, N);
            CHECK(!memcmp(y0, y1, (size_t)(M * N) * 4), "M %lld N %lld K %lld bias %d: bits differ", (long long)M,
                  (long long)N, (long long)K, with_bias);
            memset(y1, 0xff, (size_t)(M * N) * 4);
            anneal_qpanels_s8_avx2(&q, panels, x16p, 0, np / 2); /* two ranges of panels, as the threads */
            anneal_qpanels_s8_avx2(&q, panels, x16p, np / 2, np);
            CHECK(!memcmp(y0, y1, (size_t)(M * N) * 4), "panels: M %lld N %lld K %lld bias %d: bits differ",
                  (long long)M, (long long)N, (long long)K, with_bias);
        }
        free(xq), free(w), free(x16), free(sx), free(ws), free(bias), free(y0), free(y1), free(panels), free(x16p);
    }
}

/* The VPDPBUSD panel kernel (anneal_qpanels_s8_avx512vnni over anneal_qpanels_vnni_pack)
 * against the sign-trick kernel, bit for bit, on shapes with K off 4 and 64, N off 16
 * and 48, 1 to 40 rows (8-row tiles and every shorter tail) and weights with -128; rows
 * and panels in two ranges each, as the driver's passes and threads split them; the
 * activations' pad past K holds junk (it meets zero weights). */
TEST(vnni_panels_equal_the_sign_trick_kernel) {
    if (!anneal_cpu_has_avx512vnni()) SKIP("no AVX-512 VNNI on this CPU: the VPDPBUSD panel kernel cannot run");
    static const int64_t shapes[][3] = {{8, 16, 32},  {16, 37, 768}, {9, 50, 40},  {15, 33, 3072}, {40, 96, 64},
                                        {1, 49, 768}, {2, 17, 1},    {7, 3, 5},    {23, 100, 1043}, {33, 48, 2050},
                                        {3, 1, 6},    {17, 65, 771}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        const int64_t Kq = anneal_qpanels_vnni_kq(K), np = (N + 15) / 16;
        int8_t *xq = malloc((size_t)(M * K)), *w = malloc((size_t)(N * K));
        int8_t *panels = aligned_alloc(64, (size_t)(anneal_qpanels_vnni_len(N, K) + 63) / 64 * 64);
        uint8_t *xu = malloc((size_t)(M * Kq));
        float *sx = malloc((size_t)M * 4), *ws = malloc((size_t)N * 4), *bias = malloc((size_t)N * 4);
        float *y0 = malloc((size_t)(M * N) * 4), *y1 = malloc((size_t)(M * N) * 4);
        REQUIRE(xq && w && panels && xu && sx && ws && bias && y0 && y1);
        CHECK(Kq % 4 == 0 && Kq >= K && Kq < K + 4, "Kq %lld for K %lld", (long long)Kq, (long long)K);
        CHECK(anneal_qpanels_vnni_len(N, K) == np * (16 * Kq + 64), "panel bytes");
        for (int64_t i = 0; i < M * K; i++) xq[i] = (int8_t)((int)(next() % 255) - 127);
        for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)((int)(next() % 256) - 128); /* -128 included */
        for (int64_t k = 0; k < K; k++) w[(N - 1) * K + k] = -128, xq[(M - 1) * K + k] = -127; /* the largest sum */
        anneal_qpanels_vnni_pack(w, N, K, panels);
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < Kq; k++) xu[m * Kq + k] = k < K ? (uint8_t)xq[m * K + k] ^ 0x80u : (uint8_t)next();
        random_scales(M, N, sx, ws, bias);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            anneal_qrows_s8_args q = {.M = M, .N = N, .K = K, .xq = xq, .sx = sx, .w = w, .wscale = ws,
                                      .bias = with_bias ? bias : NULL, .y = y0};
            anneal_qrows_s8_avx2(&q, 0, N);
            q.y = y1;
            memset(y1, 0xff, (size_t)(M * N) * 4);
            const int64_t mh = M / 2, ph = np / 2;
            anneal_qpanels_s8_avx512vnni(&q, panels, xu, 0, mh, 0, ph);
            anneal_qpanels_s8_avx512vnni(&q, panels, xu, 0, mh, ph, np);
            anneal_qpanels_s8_avx512vnni(&q, panels, xu, mh, M, 0, ph);
            anneal_qpanels_s8_avx512vnni(&q, panels, xu, mh, M, ph, np);
            CHECK(!memcmp(y0, y1, (size_t)(M * N) * 4), "M %lld N %lld K %lld bias %d: bits differ", (long long)M,
                  (long long)N, (long long)K, with_bias);
        }
        free(xq), free(w), free(panels), free(xu), free(sx), free(ws), free(bias), free(y0), free(y1);
    }
}

TEST(sixteen_rows_equal_each_row_alone) {
    const int64_t M = 16, N = 200, K = 768; /* the first 3 rows also as a product of their own */
    float *x = malloc((size_t)(M * K) * 4), *wscale = malloc((size_t)N * 4), *bias = malloc((size_t)N * 4);
    float *y = malloc((size_t)(M * N) * 4), *y1 = malloc((size_t)(3 * N) * 4);
    int8_t *w = malloc((size_t)(N * K));
    REQUIRE(x && wscale && bias && y && y1 && w);
    for (int64_t i = 0; i < M * K; i++) x[i] = ((float)(next() % 20001) - 10000.0f) * 1e-4f;
    for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)((int)(next() % 256) - 128);
    for (int64_t i = 0; i < N; i++) wscale[i] = (float)(next() % 1000 + 1) * 1e-5f, bias[i] = (float)next() * 1e-9f;
    static const int modes[] = {ANNEAL_CPU_QUANT_DYNAMIC, ANNEAL_CPU_QUANT_STATIC};
    for (int mi = 0; mi < 2; mi++) {
        anneal_cpu_qmatmul_args a = {.mode = modes[mi], .compute = ANNEAL_F32, .M = M, .N = N, .K = K, .x = x,
                                     .w = w, .wscale = wscale, .bias = bias, .act_scale = 0.01f, .y = y};
        REQUIRE(anneal_cpu_qmatmul(&a) == 0);
        int bad = 0;
        for (int64_t m = 0; m < M; m++) {
            anneal_cpu_qmatmul_args r = a;
            r.M = 1;
            r.x = x + m * K;
            r.y = y1;
            REQUIRE(anneal_cpu_qmatmul(&r) == 0);
            bad += memcmp(y1, y + m * N, (size_t)N * 4) != 0;
        }
        CHECK(bad == 0, "mode %d: %d of 16 rows differ from the row alone", modes[mi], bad);
        anneal_cpu_qmatmul_args three = a;
        three.M = 3;
        three.y = y1;
        REQUIRE(anneal_cpu_qmatmul(&three) == 0);
        CHECK(!memcmp(y1, y, (size_t)(3 * N) * 4), "mode %d: 3 rows differ from the same rows of 16", modes[mi]);
    }
    free(x), free(wscale), free(bias), free(y), free(y1), free(w);
}

/* The driver on every row count 1 to 33 and on 130 (one row, the 8-row, 4-row and padded
 * blocks of the int16 kernel, the sign trick past K = 1024, the blocked pass past 32
 * rows; on a VNNI CPU the panel kernel's blocks of 8 rows at K = 1043 and 2061 and of
 * 16 at K = 768, the last one partial) with K and N off
 * every vector width, dynamic and static, against a scalar reference written here: the
 * quantizer's formula, the int32 sum, the epilogue, bit for bit. On a VNNI CPU also with
 * a copy in the AVX2 layout and one packed for another K, which must be ignored. */
TEST(driver_equals_the_scalar_reference_on_1_to_33_rows) {
    static const int64_t shapes[][2] = {{11, 40}, {13, 1043}, {5, 2061}, {53, 768}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t N = shapes[s][0], K = shapes[s][1], MM = 130;
        float *x = malloc((size_t)(MM * K) * 4), *ws = malloc((size_t)N * 4), *bias = malloc((size_t)N * 4);
        float *y = malloc((size_t)(MM * N) * 4), *r = malloc((size_t)(MM * N) * 4), *sx = malloc((size_t)MM * 4);
        int8_t *w = malloc((size_t)(N * K)), *xq = malloc((size_t)(MM * K));
        int8_t *panels = malloc((size_t)anneal_gemv_qpanels_len(K, N)), *other = NULL;
        REQUIRE(x && ws && bias && y && r && sx && w && xq && panels);
        for (int64_t i = 0; i < MM * K; i++) x[i] = ((float)(next() % 20001) - 10000.0f) * 1e-3f;
        for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)((int)(next() % 256) - 128);
        for (int64_t i = 0; i < N; i++) ws[i] = (float)(next() % 1000 + 1) * 1e-5f, bias[i] = (float)next() * 1e-9f;
        anneal_gemv_pack_qpanels(w, K, N, panels);
        /* a copy in the other layout (made while the int8 path was forced to AVX2, read by
         * the VNNI path) and one of another shape: their kernels must not read them */
        const int s8 = anneal_cpu_gemm_s8_isa();
        if (s8 == ANNEAL_GEMM_S8_AVX512VNNI && (other = malloc((size_t)anneal_gemv_qpanels_len(K, N + 1)))) {
            REQUIRE(anneal_cpu_gemm_s8_set_isa(ANNEAL_GEMM_S8_AVX2) == 0);
            anneal_gemv_pack_qpanels(w, K, N, other);
            REQUIRE(anneal_cpu_gemm_s8_set_isa(ANNEAL_GEMM_S8_AUTO) == 0);
        }
        for (int mode = 0; mode < 8; mode++) { /* 0, 1 dynamic, static; 2, 3 the same with panels; 4, 5 with
                                                * the other layout's; 6, 7 with another shape's */
            if (mode >= 4 && !other) continue;
            if (mode == 6) anneal_gemv_pack_qpanels(w, K - 1, N, other); /* the first K - 1 of each row */
            const float act = 0.07f; /* static: some values clamp at +-127 */
            for (int64_t m = 0; m < MM; m++) { /* the reference quantizer, row by row */
                float amax = 0.0f;
                for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[m * K + k]));
                sx[m] = mode % 2 == 0 ? fmaxf(amax / 127.0f, FLT_EPSILON) : act;
                for (int64_t k = 0; k < K; k++) {
                    float q = nearbyintf(x[m * K + k] / sx[m]);
                    xq[m * K + k] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
                }
            }
            for (int64_t m = 0; m < MM; m++)
                for (int64_t n = 0; n < N; n++) {
                    int32_t acc = 0;
                    for (int64_t k = 0; k < K; k++) acc += (int32_t)xq[m * K + k] * (int32_t)w[n * K + k];
                    volatile float scale = sx[m] * ws[n], prod = (float)acc * scale; /* no contraction */
                    r[m * N + n] = prod + bias[n];
                }
            int bad = 0;
            for (int64_t M = 1; M <= MM; M = M < 33 ? M + 1 : M == 33 ? MM : MM + 1) {
                anneal_cpu_qmatmul_args a = {.mode = mode % 2 == 0 ? ANNEAL_CPU_QUANT_DYNAMIC : ANNEAL_CPU_QUANT_STATIC,
                                             .compute = ANNEAL_F32, .M = M, .N = N, .K = K, .x = x, .w = w,
                                             .wscale = ws, .bias = bias, .act_scale = act, .y = y,
                                             .wpanels = mode >= 4 ? other : mode >= 2 ? panels : NULL};
                REQUIRE(anneal_cpu_qmatmul(&a) == 0);
                if (memcmp(y, r, (size_t)(M * N) * 4)) {
                    if (!bad) fprintf(stderr, "    N %lld K %lld mode %d: %lld rows differ\n", (long long)N, (long long)K, mode, (long long)M);
                    bad++;
                }
            }
            CHECK(bad == 0, "N %lld K %lld mode %d: %d row counts differ from the reference", (long long)N,
                  (long long)K, mode, bad);
        }
        free(x), free(ws), free(bias), free(y), free(r), free(sx), free(w), free(xq), free(panels), free(other);
    }
}

int main(void) {
    RUN(wide_kernel_equals_the_sign_trick_kernel);
    RUN(vnni_panels_equal_the_sign_trick_kernel);
    RUN(driver_equals_the_scalar_reference_on_1_to_33_rows);
    RUN(sixteen_rows_equal_each_row_alone);
    return anneal_test_summary();
}
