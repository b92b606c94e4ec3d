/* The int8 GEMM (src/cpu/gemm_int8*.c) against a reference loop, bit for bit, on every
 * path this CPU can run (AMX, AVX-512 VNNI, AVX2, portable, and the AMX kernel over its
 * C model of the tiles, which runs everywhere; forced in turn), over odd shapes
 * (M, N, K not multiples of the tiles or of the vector width, K past 64), extreme values
 * (-128 x -128 sums, the +128 offset's correction), a large K, and strided operands; and
 * the quantized product's driver (weight-only few-rows and many-rows paths, dynamic,
 * static) against the formulas it promises. */
#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "cpu/gemm_int8_internal.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 88172645463325252ULL;
static uint32_t next_u32(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static void fill_s8(int8_t *p, int64_t n, int kind) {
    for (int64_t i = 0; i < n; i++)
        p[i] = kind == 1 ? (int8_t)-128 : kind == 2 ? (int8_t)(i % 2 ? 127 : -128) : (int8_t)(next_u32() & 0xff);
}

static void reference(int64_t M, int64_t N, int64_t K, const int8_t *A, int64_t lda, const int8_t *B, int64_t ldb,
                      int32_t *C, int64_t ldc) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            int64_t s = 0;
            for (int64_t k = 0; k < K; k++) s += (int64_t)A[m * lda + k] * B[n * ldb + k];
            C[m * ldc + n] = (int32_t)s;
        }
}

/* One shape on the current path: exact, and C's padding untouched. */
static bool check_shape(int64_t M, int64_t N, int64_t K, int kind, int64_t pad) {
    const int64_t lda = K + pad, ldb = K + 2 * pad, ldc = N + pad;
    int8_t *A = malloc((size_t)(M * lda + 1)), *B = malloc((size_t)(N * ldb + 1));
    int32_t *C = malloc((size_t)(M * ldc + 1) * 4), *R = malloc((size_t)(M * ldc + 1) * 4);
    fill_s8(A, M * lda, kind);
    fill_s8(B, N * ldb, kind == 2 ? 0 : kind);
    for (int64_t i = 0; i < M * ldc; i++) C[i] = R[i] = 0x5a5a5a5a;
    reference(M, N, K, A, lda, B, ldb, R, ldc);
    anneal_cpu_gemm_s8(M, N, K, A, lda, B, ldb, C, ldc);
    bool ok = memcmp(C, R, (size_t)(M * ldc) * 4) == 0;
    if (!ok)
        for (int64_t i = 0; i < M * ldc; i++)
            if (C[i] != R[i]) {
                fprintf(stderr, "  M %lld N %lld K %lld kind %d: C[%lld] = %d, want %d\n", (long long)M, (long long)N,
                        (long long)K, kind, (long long)i, C[i], R[i]);
                break;
            }
    free(A), free(B), free(C), free(R);
    return ok;
}

TEST(gemm_s8_is_exact_on_every_path) {
    enum { NISA = 5 };
    static const int isas[NISA] = {ANNEAL_GEMM_S8_PORTABLE, ANNEAL_GEMM_S8_AVX2, ANNEAL_GEMM_S8_AVX512VNNI,
                                   ANNEAL_GEMM_S8_AMX, ANNEAL_GEMM_S8_AMX_MODEL};
    /* from 32 rows the tile paths: whole tiles, a row tail, outputs not a multiple of 32
     * (or of 16), K not a multiple of 64 (the zero-padded last chunk) or under one chunk */
    static const int64_t shapes[][3] = {{1, 1, 1},   {1, 7, 3},     {3, 5, 17},   {4, 4, 64},  {5, 9, 65},
                                        {1, 33, 127}, {7, 13, 128}, {9, 6, 200},  {2, 1, 1000}, {17, 31, 96},
                                        {1, 768, 768}, {6, 66, 333}, {32, 32, 64}, {33, 17, 5},  {64, 40, 200},
                                        {45, 70, 129}, {96, 1, 64},  {37, 48, 1000}};
    int ran = 0;
    for (int i = 0; i < NISA; i++) {
        if (anneal_cpu_gemm_s8_set_isa(isas[i]) != 0) {
            printf("  %s: not on this CPU\n", anneal_cpu_gemm_s8_isa_name(isas[i]));
            continue;
        }
        REQUIRE(anneal_cpu_gemm_s8_isa() == isas[i]);
        ran++;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int kind = 0; kind < 3; kind++)
                CHECK(check_shape(shapes[s][0], shapes[s][1], shapes[s][2], kind, s % 3),
                      "%s: (%lld, %lld, %lld) kind %d", anneal_cpu_gemm_s8_isa_name(isas[i]), (long long)shapes[s][0],
                      (long long)shapes[s][1], (long long)shapes[s][2], kind);
        /* the largest K the callers allow: all -128 x -128 sums to 2^30 (32 rows: a tile) */
        CHECK(check_shape(2, 5, 65536, 1, 0) && check_shape(32, 3, 65536, 1, 0), "%s: K = 65536",
              anneal_cpu_gemm_s8_isa_name(isas[i]));
        printf("  %s: exact\n", anneal_cpu_gemm_s8_isa_name(isas[i]));
    }
    anneal_cpu_gemm_s8_set_isa(ANNEAL_GEMM_S8_AUTO);
    CHECK(ran >= 2, "no path ran but the portable one and the model");
    if (ran < NISA) SKIP("this CPU lacks some int8 GEMM paths (see above)");
}

TEST(gemm_s8_default_is_the_best_path_and_env_forces_lower_ones) {
    anneal_cpu_gemm_s8_set_isa(ANNEAL_GEMM_S8_AUTO);
    unsetenv("ANNEAL_CPU_ISA");
    int best = anneal_cpu_gemm_s8_isa();
    printf("  default: %s\n", anneal_cpu_gemm_s8_isa_name(best));
    CHECK(anneal_cpu_gemm_s8_set_isa(ANNEAL_GEMM_S8_AMX) == 0
              ? best == ANNEAL_GEMM_S8_AMX
              : anneal_cpu_gemm_s8_set_isa(ANNEAL_GEMM_S8_AVX512VNNI) != 0 || best == ANNEAL_GEMM_S8_AVX512VNNI,
          "AMX or VNNI available but not the default (%s)", anneal_cpu_gemm_s8_isa_name(best));
    anneal_cpu_gemm_s8_set_isa(ANNEAL_GEMM_S8_AUTO);
    setenv("ANNEAL_CPU_ISA", "portable", 1);
    CHECK(anneal_cpu_gemm_s8_isa() == ANNEAL_GEMM_S8_PORTABLE, "ANNEAL_CPU_ISA=portable");
    setenv("ANNEAL_CPU_ISA", "avx2", 1);
    CHECK(anneal_cpu_gemm_s8_isa() != ANNEAL_GEMM_S8_AVX512VNNI && anneal_cpu_gemm_s8_isa() != ANNEAL_GEMM_S8_AMX,
          "ANNEAL_CPU_ISA=avx2");
    setenv("ANNEAL_CPU_ISA", "avx512", 1);
    CHECK(anneal_cpu_gemm_s8_isa() != ANNEAL_GEMM_S8_AMX, "ANNEAL_CPU_ISA=avx512");
    unsetenv("ANNEAL_CPU_ISA");
}

/* ----------------------------------------------------- the product driver */

static float randf(void) { return ((float)(next_u32() & 0xffffff) / 16777216.0f - 0.5f) * 4.0f; }

/* Weight-only: y = sum over groups of scale * (f32 sum of x * w), against a double
 * reference (the kernels' f32 sums differ from it by rounding only). */
static void check_weight_only(int64_t M, int64_t N, int64_t K, int64_t group, int compute) {
    float *x = malloc((size_t)(M * K) * 4), *y = malloc((size_t)(M * N) * 4), *b = malloc((size_t)N * 4);
    int8_t *w = malloc((size_t)(N * K));
    int64_t ng = group ? K / group : 1;
    float *s = malloc((size_t)(N * ng) * 4);
    for (int64_t i = 0; i < M * K; i++) x[i] = randf();
    fill_s8(w, N * K, 0);
    for (int64_t i = 0; i < N * ng; i++) s[i] = 0.01f + (float)(next_u32() % 100) * 1e-4f;
    for (int64_t i = 0; i < N; i++) b[i] = randf();
    anneal_cpu_qmatmul_args a = {.mode = ANNEAL_CPU_QUANT_WEIGHT_ONLY, .compute = compute, .M = M, .N = N, .K = K,
                                 .group = group, .x = x, .w = w, .wscale = s, .bias = b, .y = y};
    REQUIRE(anneal_cpu_qmatmul(&a) == 0);
    double worst = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double r = b[n], mag = fabs(b[n]);
            for (int64_t k = 0; k < K; k++) {
                double xv = x[m * K + k];
                if (compute == ANNEAL_BF16) { /* x rounded to bf16, nearest even */
                    uint32_t u;
                    float f = (float)xv;
                    memcpy(&u, &f, 4);
                    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
                    memcpy(&f, &u, 4);
                    xv = f;
                }
                double t = xv * w[n * K + k] * s[n * ng + (group ? k / group : 0)];
                r += t, mag += fabs(t);
            }
            double e = fabs(y[m * N + n] - r) / (mag + 1e-30);
            worst = e > worst ? e : worst;
        }
    /* f32 accumulation over K terms: relative to the sum of magnitudes, about K * 2^-24 */
    CHECK(worst < 1e-5, "weight-only M %lld N %lld K %lld group %lld compute %d: error %.3g of the magnitude",
          (long long)M, (long long)N, (long long)K, (long long)group, compute, worst);
    free(x), free(y), free(b), free(w), free(s);
}

TEST(weight_only_product_few_and_many_rows) {
    static const int64_t cases[][4] = {{1, 37, 96, 0}, {1, 40, 128, 32}, {3, 17, 256, 64}, {5, 9, 130, 0},
                                       {8, 21, 128, 128}, {19, 33, 64, 32}, {1, 768, 768, 0}};
    for (int isa = 0; isa < 3; isa++) { /* the best path, portable, AVX2 + FMA (where the CPU has it) */
        if (isa == 2 && !anneal_cpu_has_avx2()) continue;
        if (isa) setenv("ANNEAL_CPU_ISA", isa == 1 ? "portable" : "avx2", 1);
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            check_weight_only(cases[i][0], cases[i][1], cases[i][2], cases[i][3], ANNEAL_F32);
            check_weight_only(cases[i][0], cases[i][1], cases[i][2], cases[i][3], ANNEAL_BF16);
        }
    }
    unsetenv("ANNEAL_CPU_ISA");
}

/* Dynamic and static: the quantized activations and y = acc * (sx * sw) + b exactly. */
TEST(dynamic_and_static_products_follow_their_formula) {
    const int64_t M = 5, N = 19, K = 77;
    float x[5 * 77], y[5 * 19], b[19], sw[19], sx[5];
    int8_t w[19 * 77], xq[5 * 77];
    int32_t acc[5 * 19];
    for (int i = 0; i < M * K; i++) x[i] = randf();
    x[3] = 0.0f;
    fill_s8(w, N * K, 0);
    for (int i = 0; i < N; i++) b[i] = randf(), sw[i] = 0.002f * (float)(i + 1);
    for (int mode = ANNEAL_CPU_QUANT_DYNAMIC; mode <= ANNEAL_CPU_QUANT_STATIC; mode++) {
        const float act = 0.0125f;
        anneal_cpu_qmatmul_args a = {.mode = mode, .M = M, .N = N, .K = K, .x = x, .w = w, .wscale = sw, .bias = b,
                                     .act_scale = act, .y = y};
        REQUIRE(anneal_cpu_qmatmul(&a) == 0);
        if (mode == ANNEAL_CPU_QUANT_DYNAMIC) {
            anneal_cpu_quantize_s8(M, K, 0, x, xq, sx);
        } else {
            anneal_cpu_quantize_s8_fixed(M * K, x, act, xq);
            for (int m = 0; m < M; m++) sx[m] = act;
        }
        reference(M, N, K, xq, K, w, K, acc, N);
        int bad = 0;
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) bad += y[m * N + n] != (float)acc[m * N + n] * (sx[m] * sw[n]) + b[n];
        CHECK(bad == 0, "mode %d: %d elements differ from acc * (sx * sw) + b", mode, bad);
    }
    /* per-token scales: amax / 127, and values clamp at +-127 with a static scale */
    anneal_cpu_quantize_s8(1, K, 0, x, xq, sx);
    float amax = 0;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    CHECK(sx[0] == amax / 127.0f, "scale %g, want %g", sx[0], amax / 127.0f);
    float big[3] = {1e6f, -1e6f, 0.5f};
    int8_t qb[3];
    anneal_cpu_quantize_s8_fixed(3, big, 0.01f, qb);
    CHECK(qb[0] == 127 && qb[1] == -127 && qb[2] == 50, "clamp: %d %d %d", qb[0], qb[1], qb[2]);
}

/* The fused passes of dynamic products (AVX2: up to 32 rows the few-rows one, more the
 * blocked one; both vpmaddubsw on |w| and the sign-moved activations) against acc * (sx *
 * sw) + b bit for bit: rows 1 to 33 and past (every tail of the 3-row groups, odd weight
 * rows, a weight block boundary at K = 1000: 130 rows per block), K below, at and past the
 * 32-value step with tails, weights of -128 and +127 extremes against activations
 * quantized to +-127 (the largest int16 pair sums the kernel can make), on AVX2 forced
 * (skipped without it) and on the default path (on a VNNI CPU up to 32 rows the VPDPBUSD
 * pass of qrows_avx512vnni.c: its u8 offset and row-sum correction at the same extremes). */
TEST(few_rows_dynamic_product_is_exact_at_extremes) {
    if (!anneal_cpu_has_avx512vnni())
        printf("  the VPDPBUSD few-rows pass cannot run here (no AVX512-VNNI): the default path is AVX2\n");
    static const int64_t shapes[][3] = {{1, 50, 768},  {2, 9, 32},    {3, 17, 77},  {4, 64, 31},
                                        {16, 21, 200}, {17, 5, 96},   {32, 13, 65}, {33, 7, 64},
                                        {34, 1, 33},   {35, 131, 1000}, {64, 6, 768}, {97, 3, 5}};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 0 && !anneal_cpu_has_avx2()) {
            printf("  SKIP avx2 forced: the CPU has no AVX2\n");
            continue;
        }
        if (pass == 0) setenv("ANNEAL_CPU_ISA", "avx2", 1);
        for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
            for (int kind = 0; kind < 3; kind++) {
                const int64_t M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
                float *x = malloc((size_t)(M * K) * 4), *y = malloc((size_t)(M * N) * 4), *b = malloc((size_t)N * 4);
                float *sw = malloc((size_t)N * 4), *sx = malloc((size_t)M * 4);
                int8_t *w = malloc((size_t)(N * K)), *xq = malloc((size_t)(M * K));
                int32_t *acc = malloc((size_t)(M * N) * 4);
                REQUIRE(x && y && b && sw && sx && w && xq && acc);
                /* kind 1: every weight -128 and x at +-amax (q = +-127); kind 2: alternating
                 * 127 / -128 weights and x of alternating sign */
                for (int64_t i = 0; i < M * K; i++)
                    x[i] = kind == 0 ? randf() : kind == 1 ? (i % 3 ? 1.0f : -1.0f) : (i % 2 ? -2.0f : 2.0f);
                fill_s8(w, N * K, kind);
                for (int64_t i = 0; i < N; i++) b[i] = randf(), sw[i] = 0.001f * (float)(i + 1);
                anneal_cpu_qmatmul_args a = {.mode = ANNEAL_CPU_QUANT_DYNAMIC, .M = M, .N = N, .K = K, .x = x, .w = w,
                                             .wscale = sw, .bias = kind == 1 ? NULL : b, .y = y};
                REQUIRE(anneal_cpu_qmatmul(&a) == 0);
                anneal_cpu_quantize_s8(M, K, 0, x, xq, sx);
                reference(M, N, K, xq, K, w, K, acc, N);
                int bad = 0;
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = 0; n < N; n++)
                        bad += y[m * N + n] != (float)acc[m * N + n] * (sx[m] * sw[n]) + (kind == 1 ? 0.0f : b[n]);
                CHECK(bad == 0, "%s M %lld N %lld K %lld kind %d: %d elements differ", pass ? "default" : "avx2",
                      (long long)M, (long long)N, (long long)K, kind, bad);
                free(x), free(y), free(b), free(sw), free(sx), free(w), free(xq), free(acc);
            }
        }
        unsetenv("ANNEAL_CPU_ISA");
    }
}

int main(void) {
    RUN(gemm_s8_is_exact_on_every_path);
    RUN(gemm_s8_default_is_the_best_path_and_env_forces_lower_ones);
    RUN(weight_only_product_few_and_many_rows);
    RUN(dynamic_and_static_products_follow_their_formula);
    RUN(few_rows_dynamic_product_is_exact_at_extremes);
    return anneal_test_summary();
}
