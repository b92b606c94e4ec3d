/* Tests of anneal_cpu_gemm / anneal_cpu_gemm_batched at bf16 and f16 operand precision and
 * of the fused epilogue, on every GEMM kernel this CPU can run (portable, AVX2, AVX-512, and
 * the AVX512-BF16 kernel).
 *
 * What is compared, and with what tolerance:
 * - Operand rounding (scalar and vectorised) against hand-checked values and against
 *   each other: exact.
 * - f16 on any kernel, and bf16 on the f32 kernels (no AVX512-BF16, or it forbidden):
 *   the operands are rounded while packing and the f32 kernel runs on them; products of
 *   rounded values are exact in f32 (11- or 8-bit mantissas), so the result must be
 *   bit-identical to anneal_cpu_sgemm on explicitly rounded copies of A and B.
 * - bf16 on the AVX512-BF16 kernel: VDPBF16PS sums bf16 pairs into f32 with its own
 *   rounding (at most one rounding per exact product added, DAZ/FTZ below 2^-126, see
 *   gemm_avx512bf16.c). Against the exact (double) sum over the rounded operands each
 *   element must satisfy
 *     |c - ref| <= (K + 4) * 2^-24 * (|alpha| * sum_k |a_k b_k| + |beta c0|) + 1e-30,
 *   the worst-case bound of f32 recursive summation (K - 1 additions, the alpha scaling,
 *   the beta term and the final rounding), rigorous for any order and pairing. Operands
 *   are drawn in [-1, 1), so nothing is subnormal and the flushes never act. Rounding the
 *   operands wrongly (e.g. truncating) moves results by ~2^-9 relative per product, far
 *   outside this bound. The same bound checks the single-row (M == 1) path, which sums in
 *   a different order than the packed kernels.
 * - The epilogue: bit-identical to the product without it followed by the bias add and
 *   anneal_cpu_gelu_fwd(tanh) (the fused GELU promises the same arithmetic).
 * - Threads: same bits for 1 and 2 threads.
 * The AMX kernel's tests are in test_gemm_amx.c. */
#include "anneal/backend.h"
#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "gemm_check.h"
#include "test.h"

#include <float.h>
#include <omp.h>

/* ------------------------------------------------------------ rounding */

/* Hand-checked roundings: ties to even, overflow, NaN, subnormals. */
TEST(rounding_scalar) {
    /* bf16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1 (even);
     * 1 + 3*2^-8 ties between 1 + 2^-7 and 1 + 2^-6 -> 1 + 2^-6 (even). */
    CHECK_TRUE(anneal_gemm_round_bf16(1.0f + 0x1p-8f) == 1.0f);
    CHECK_TRUE(anneal_gemm_round_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);
    CHECK_TRUE(anneal_gemm_round_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
    CHECK_TRUE(anneal_gemm_round_bf16(-3.0f) == -3.0f);
    CHECK_TRUE(isinf(anneal_gemm_round_bf16(FLT_MAX)) && anneal_gemm_round_bf16(FLT_MAX) > 0);
    CHECK_TRUE(isinf(anneal_gemm_round_bf16(-INFINITY)));
    CHECK_TRUE(isnan(anneal_gemm_round_bf16(NAN)));
    uint32_t snan_bits = 0x7f800001u; /* a NaN whose payload is only in the low bits */
    float snan;
    memcpy(&snan, &snan_bits, 4);
    CHECK_TRUE(isnan(anneal_gemm_round_bf16(snan)));
    CHECK_TRUE(anneal_gemm_round_bf16(0x1p-130f) == 0x1p-130f); /* bf16 subnormal, kept */
    /* f16 keeps 11 significant bits, max 65504, overflow to inf from 65520 up. */
    CHECK_TRUE(anneal_gemm_round_f16(1.0f + 0x1p-11f) == 1.0f);
    CHECK_TRUE(anneal_gemm_round_f16(1.0f + 3 * 0x1p-11f) == 1.0f + 0x1p-9f);
    CHECK_TRUE(anneal_gemm_round_f16(65504.0f) == 65504.0f);
    CHECK_TRUE(anneal_gemm_round_f16(65519.0f) == 65504.0f);
    CHECK_TRUE(isinf(anneal_gemm_round_f16(65520.0f)) && anneal_gemm_round_f16(-65520.0f) < 0);
    CHECK_TRUE(isinf(anneal_gemm_round_f16(1e10f)));
    CHECK_TRUE(anneal_gemm_round_f16(0x1p-24f) == 0x1p-24f); /* smallest f16 subnormal */
    CHECK_TRUE(anneal_gemm_round_f16(0x1p-26f) == 0.0f);
    CHECK_TRUE(anneal_gemm_round_f16(3 * 0x1p-25f) == 0x1p-23f); /* tie -> even */
    CHECK_TRUE(isnan(anneal_gemm_round_f16(NAN)));
}

/* anneal_gemm_round_array (vectorised) and the packers agree bit for bit with the scalar
 * rounding, on random values over many binades and on special values. The packers are
 * checked through 1 x 1 x 1 products with alpha 1: the product x * 1 is the rounded x. */
TEST(rounding_vector_matches_scalar) {
    const int64_t n = 4099;
    float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)(urand() * 4294967296.0);
        memcpy(&x[i], &u, 4); /* every bit pattern: NaNs, infs, subnormals, huge */
    }
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MAX, 65520.0f, 65519.0f,
                             0x1p-24f, 0x1p-26f, 0x1p-130f, 1.0f + 0x1p-8f, 1.0f + 0x1p-11f};
    memcpy(x, special, sizeof special);
    for (int r = ANNEAL_GEMM_ROUND_BF16; r <= ANNEAL_GEMM_ROUND_F16; r++) {
        anneal_gemm_round_array(n, x, y, r);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++) {
            float e = anneal_gemm_round(x[i], r);
            if (!(bits_equal(y[i], e) || (isnan(y[i]) && isnan(e)))) {
                if (!bad) anneal_test_fail(__FILE__, __LINE__, "round %d of %a: %a, expected %a", r,
                                           x[i], y[i], e);
                bad++;
            }
        }
        CHECK(bad == 0, "round_array mode %d: %lld differ", r, (long long)bad);
    }
    /* The packers: x * 1.0 through every f32 kernel at f16 and bf16 (finite values only,
     * bf16 kernel excluded: it flushes bf16 subnormals to zero by design). */
    anneal_cpu_gemm_allow_bf16_kernel(false);
    int isas[3], nisa = isa_list(isas);
    const float one = 1.0f;
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int compute = ANNEAL_BF16; compute <= ANNEAL_F16; compute++) {
            int64_t bad = 0;
            for (int64_t i = 0; i < n; i++) {
                if (!isfinite(x[i])) continue;
                /* a 2 x 1 product packs x through the A packer, a 1 x 2 one through B. */
                float a2[2] = {x[i], x[i]}, c2[2];
                anneal_cpu_gemm(compute, false, false, 2, 1, 1, 1.0f, a2, 1, &one, 1, 0.0f, c2, 1,
                                NULL);
                float e = anneal_gemm_round(x[i], compute == ANNEAL_BF16 ? ANNEAL_GEMM_ROUND_BF16
                                                                          : ANNEAL_GEMM_ROUND_F16);
                if (!bits_equal(c2[0], e) && !(c2[0] == 0 && e == 0)) {
                    if (!bad) anneal_test_fail(__FILE__, __LINE__, "%s %s pack of %a: %a, expected %a",
                                               anneal_cpu_sgemm_isa_name(), anneal_dtype_name(compute),
                                               x[i], c2[0], e);
                    bad++;
                }
            }
            CHECK(bad == 0, "%s %s: %lld packed values differ", anneal_cpu_sgemm_isa_name(),
                  anneal_dtype_name(compute), (long long)bad);
        }
    }
    anneal_cpu_gemm_allow_bf16_kernel(true);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
    free(x);
    free(y);
}

/* ------------------------------------------------------------ products */

/* f16 everywhere, and bf16 on the f32 kernels: bit-identical to anneal_cpu_sgemm on rounded
 * copies of the operands (all transposes, alpha/beta, padded leading dims). */
TEST(rounded_f32_kernels_exact) {
    anneal_cpu_gemm_allow_bf16_kernel(false);
    int isas[3], nisa = isa_list(isas);
    const bool sanitized = anneal_test_sanitized(); /* ASan: skip the largest shapes */
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int compute = ANNEAL_BF16; compute <= ANNEAL_F16; compute++) {
            int64_t bad = 0;
            for (int c = 0; c < NSHAPES; c++)
                for (int t = 0; t < 4; t++) {
                    if (sanitized && SHAPES[c][0] * SHAPES[c][1] * SHAPES[c][2] > 100000) continue;
                    const float beta = (c + t) % 3 == 0 ? 0.0f : (c + t) % 3 == 1 ? 1.0f : -0.5f;
                    prob p = make_prob(t >> 1, t & 1, SHAPES[c][0], SHAPES[c][1], SHAPES[c][2],
                                       c % 2 ? 1.0f : 0.75f, beta, c % 3);
                    float *C = run_gemm(&p, compute, NULL);
                    float *ar = rounded_copy(compute, p.A, p.na), *br = rounded_copy(compute, p.B, p.nb);
                    float *E = copy_buf(p.C0, p.nc);
                    anneal_cpu_sgemm(p.ta, p.tb, p.M, p.N, p.K, p.alpha, ar, p.lda, br, p.ldb, p.beta,
                                     E, p.ldc);
                    char what[80];
                    snprintf(what, sizeof what, "%s %s %c%c %lldx%lldx%lld",
                             anneal_cpu_sgemm_isa_name(), anneal_dtype_name(compute),
                             p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', (long long)p.M, (long long)p.N,
                             (long long)p.K);
                    bad += count_diff(C, E, p.nc, what);
                    free(C);
                    free(E);
                    free(ar);
                    free(br);
                    free_prob(&p);
                }
            CHECK(bad == 0, "%s %s: %lld elements differ from sgemm on rounded operands",
                  anneal_cpu_sgemm_isa_name(), anneal_dtype_name(compute), (long long)bad);
        }
    }
    anneal_cpu_gemm_allow_bf16_kernel(true);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* Every kernel at every precision within the summation bound of the exact product of the
 * rounded operands (this is the check for the AVX512-BF16 kernel, whose pair sums differ
 * from the f32 kernel's rounding), and K == 1 exactly alpha * round(a) * round(b). */
TEST(bound_against_reference) {
    int isas[3], nisa = isa_list(isas);
    const bool sanitized = anneal_test_sanitized(); /* ASan: skip the largest shapes */
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int compute = ANNEAL_F32; compute <= ANNEAL_F16; compute++) {
            const char *kname = anneal_cpu_gemm_kernel_name(compute);
            int64_t bad = 0;
            for (int c = 0; c < NSHAPES; c++) {
                if (sanitized && SHAPES[c][0] * SHAPES[c][1] * SHAPES[c][2] > 100000) continue;
                for (int t = 0; t < 4; t++) {
                    const float beta = (c + t) % 2 ? 0.0f : 1.0f;
                    prob p = make_prob(t >> 1, t & 1, SHAPES[c][0], SHAPES[c][1], SHAPES[c][2],
                                       c % 2 ? 1.0f : -1.5f, beta, (c + t) % 3);
                    float *C = run_gemm(&p, compute, NULL);
                    char what[64];
                    snprintf(what, sizeof what, "%s %s", kname, anneal_dtype_name(compute));
                    bad += count_outside_bound(&p, compute, C, what);
                    free(C);
                    free_prob(&p);
                }
            }
            /* K == 1: one exact product, then alpha (a power of two: exact). */
            prob p = make_prob(false, false, 19, 45, 1, 2.0f, 0.0f, 0);
            float *C = run_gemm(&p, compute, NULL);
            for (int64_t i = 0; i < p.M; i++)
                for (int64_t j = 0; j < p.N; j++) {
                    float e = 2.0f * round_to(compute, p.A[i]) * round_to(compute, p.B[j]);
                    if (!bits_equal(C[i * p.ldc + j], e)) bad++;
                }
            free(C);
            free_prob(&p);
            CHECK(bad == 0, "%s %s: %lld elements out of bound", kname, anneal_dtype_name(compute),
                  (long long)bad);
        }
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* The AMX kernel, else the AVX512-BF16 kernel, is used for bf16 exactly when the CPU has
 * it (and, for VDPBF16PS, it is the faster unit or ANNEAL_ISA=avx512bf16 forces it) and the
 * f32 choice is AVX-512; f16 never has its own kernel. */
TEST(kernel_selection) {
    REQUIRE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO) == 0);
    const bool avx512 = strcmp(anneal_cpu_sgemm_isa_name(), "avx512") == 0;
    const char *bf = anneal_cpu_gemm_kernel_name(ANNEAL_BF16);
    const bool amx = anneal_cpu_isa_limit() >= ANNEAL_ISA_AMX && anneal_cpu_amx_usable();
    CHECK(strcmp(bf, avx512 && amx                               ? "amx"
                     : avx512 && anneal_cpu_bf16_dot_preferred() ? "avx512bf16"
                                                                  : anneal_cpu_sgemm_isa_name()) == 0,
          "bf16 kernel %s", bf);
    CHECK_TRUE(strcmp(anneal_cpu_gemm_kernel_name(ANNEAL_F16), anneal_cpu_sgemm_isa_name()) == 0);
    CHECK_TRUE(strcmp(anneal_cpu_gemm_kernel_name(ANNEAL_F32), anneal_cpu_sgemm_isa_name()) == 0);
    anneal_cpu_gemm_allow_bf16_kernel(false);
    CHECK_TRUE(strcmp(anneal_cpu_gemm_kernel_name(ANNEAL_BF16), anneal_cpu_sgemm_isa_name()) == 0);
    anneal_cpu_gemm_allow_bf16_kernel(true);
    if (anneal_cpu_has_avx2()) {
        REQUIRE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AVX2) == 0);
        CHECK_TRUE(strcmp(anneal_cpu_gemm_kernel_name(ANNEAL_BF16), "avx2") == 0);
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* ------------------------------------------------------------ epilogue */

/* With an epilogue (bias, GELU, pre, each combination) C equals the plain product followed
 * by the bias add and anneal_cpu_gelu_fwd(tanh), bit for bit, and pre the pre-activation;
 * the padding of C and pre stays untouched. Every kernel and precision, including M == 1,
 * K == 0 and K spanning several depth blocks. */
TEST(epilogue_fused_matches_unfused) {
    static const int64_t shapes[][3] = {{37, 45, 300}, {8, 64, 1100}, {1, 77, 50}, {5, 9, 0},
                                        {130, 33, 17}};
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int compute = ANNEAL_F32; compute <= ANNEAL_F16; compute++)
            for (int c = 0; c < 5; c++)
                for (int v = 1; v < 8; v++) { /* bit 0 bias, bit 1 gelu, bit 2 pre */
                    const bool use_bias = v & 1, gelu = v & 2, use_pre = v & 4;
                    if (use_pre && !gelu) continue;
                    const int t = (c + v) % 4;
                    prob p = make_prob(t >> 1, t & 1, shapes[c][0], shapes[c][1], shapes[c][2],
                                       1.25f, v % 2 ? 0.0f : 1.0f, 2);
                    float *bias = rand_buf(p.N);
                    float *pre = rand_buf(p.nc), *pre0 = copy_buf(pre, p.nc);
                    for (int64_t i = 0; i < p.N; i++) bias[i] *= 3.0f;
                    anneal_gemm_epilogue ep = {use_bias ? bias : NULL, gelu, use_pre ? pre : NULL, NULL,
                                               NULL};
                    float *C = run_gemm(&p, compute, &ep);
                    /* Expected: the product, then the epilogue by hand row by row. */
                    float *E = run_gemm(&p, compute, NULL);
                    float *P = copy_buf(pre0, p.nc);
                    for (int64_t i = 0; i < p.M; i++) {
                        float *row = E + i * p.ldc;
                        if (use_bias)
                            for (int64_t j = 0; j < p.N; j++) row[j] = row[j] + bias[j];
                        if (gelu) {
                            if (use_pre) memcpy(P + i * p.ldc, row, sizeof(float) * (size_t)p.N);
                            anneal_cpu_gelu_fwd(p.N, row, row, true);
                        }
                    }
                    char what[96];
                    snprintf(what, sizeof what, "%s %s %lldx%lldx%lld bias=%d gelu=%d pre=%d",
                             anneal_cpu_gemm_kernel_name(compute), anneal_dtype_name(compute),
                             (long long)p.M, (long long)p.N, (long long)p.K, use_bias, gelu,
                             use_pre);
                    int64_t bad = count_diff(C, E, p.nc, what) + count_diff(pre, P, p.nc, what);
                    CHECK(bad == 0, "%s: %lld differ", what, (long long)bad);
                    free(C);
                    free(E);
                    free(P);
                    free(bias);
                    free(pre);
                    free(pre0);
                    free_prob(&p);
                }
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* ------------------------------------------------------------ batched, threads */

/* Batched at bf16/f16 equals the single products (run across threads and in order). */
TEST(batched_matches_single) {
    static const int64_t cases[][4] = {{48, 64, 64, 64}, {3, 200, 150, 70}, {5, 1, 40, 33}};
    int isas[3], nisa = isa_list(isas);
    const int saved = omp_get_max_threads();
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int compute = ANNEAL_BF16; compute <= ANNEAL_F16; compute++)
            for (int c = 0; c < 3; c++)
                for (int t = 0; t < 4; t++) {
                    const bool ta = t >> 1, tb = t & 1;
                    const int64_t batch = cases[c][0], M = cases[c][1], N = cases[c][2],
                                  K = cases[c][3];
                    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
                    float *A = rand_buf(batch * M * K), *B = rand_buf(batch * K * N);
                    float *C1 = rand_buf(batch * M * N), *C2 = copy_buf(C1, batch * M * N);
                    omp_set_num_threads(2);
                    anneal_cpu_gemm_batched(compute, batch, ta, tb, M, N, K, 0.5f, A, lda, M * K, B,
                                            ldb, K * N, 1.0f, C1, N, M * N);
                    omp_set_num_threads(1);
                    for (int64_t b = 0; b < batch; b++)
                        anneal_cpu_gemm(compute, ta, tb, M, N, K, 0.5f, A + b * M * K, lda,
                                        B + b * K * N, ldb, 1.0f, C2 + b * M * N, N, NULL);
                    CHECK(memcmp(C1, C2, sizeof(float) * (size_t)(batch * M * N)) == 0,
                          "%s %s batch %lld %c%c: batched differs from single calls",
                          anneal_cpu_gemm_kernel_name(compute), anneal_dtype_name(compute),
                          (long long)batch, ta ? 'T' : 'N', tb ? 'T' : 'N');
                    free(A);
                    free(B);
                    free(C1);
                    free(C2);
                }
    }
    omp_set_num_threads(saved);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* Same bits with 1 and 2 threads at every precision and kernel, with the epilogue on, for
 * shapes split over N, over M, over several depth blocks, and the M == 1 path. */
TEST(deterministic_across_threads) {
    static const int64_t shapes[][3] = {{300, 700, 530}, {700, 40, 1030}, {1, 5000, 300}};
    const int saved = omp_get_max_threads();
    const int nshape = anneal_test_sanitized() ? 1 : 3; /* ASan: the first shape only */
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int compute = ANNEAL_BF16; compute <= ANNEAL_F16; compute++)
            for (int c = 0; c < nshape; c++)
                for (int t = 0; t < 4; t++) {
                    prob p = make_prob(t >> 1, t & 1, shapes[c][0], shapes[c][1], shapes[c][2],
                                       1.5f, 0.5f, 1);
                    float *bias = rand_buf(p.N), *pre1 = rand_buf(p.nc), *pre2 = copy_buf(pre1, p.nc);
                    anneal_gemm_epilogue e1 = {bias, true, pre1, NULL, NULL};
                    anneal_gemm_epilogue e2 = {bias, true, pre2, NULL, NULL};
                    omp_set_num_threads(1);
                    float *C1 = run_gemm(&p, compute, &e1);
                    omp_set_num_threads(2);
                    float *C2 = run_gemm(&p, compute, &e2);
                    CHECK(memcmp(C1, C2, sizeof(float) * (size_t)p.nc) == 0 &&
                              memcmp(pre1, pre2, sizeof(float) * (size_t)p.nc) == 0,
                          "%s %s %c%c %lldx%lldx%lld differs between 1 and 2 threads",
                          anneal_cpu_gemm_kernel_name(compute), anneal_dtype_name(compute),
                          p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', (long long)p.M, (long long)p.N,
                          (long long)p.K);
                    free(C1);
                    free(C2);
                    free(bias);
                    free(pre1);
                    free(pre2);
                    free_prob(&p);
                }
    }
    omp_set_num_threads(saved);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* Random shapes at random transposes on every kernel and precision, within the bound. */
TEST(random_shapes) {
    int isas[3], nisa = isa_list(isas);
    const int reps = anneal_test_sanitized() ? 4 : 12; /* ASan: fewer shapes */
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int compute = ANNEAL_BF16; compute <= ANNEAL_F16; compute++) {
            int64_t bad = 0;
            for (int r = 0; r < reps; r++) {
                const int t = (int)irand(0, 3);
                prob p = make_prob(t >> 1, t & 1, irand(1, 70), irand(1, 90), irand(1, 140), 1.0f,
                                   r % 2 ? 1.0f : 0.0f, irand(0, 3));
                float *C = run_gemm(&p, compute, NULL);
                bad += count_outside_bound(&p, compute, C, anneal_cpu_gemm_kernel_name(compute));
                free(C);
                free_prob(&p);
            }
            CHECK(bad == 0, "%s %s: %lld out of bound", anneal_cpu_gemm_kernel_name(compute),
                  anneal_dtype_name(compute), (long long)bad);
        }
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}


int main(void) {
    RUN(rounding_scalar);
    RUN(rounding_vector_matches_scalar);
    RUN(rounded_f32_kernels_exact);
    RUN(bound_against_reference);
    RUN(kernel_selection);
    RUN(epilogue_fused_matches_unfused);
    RUN(batched_matches_single);
    RUN(deterministic_across_threads);
    RUN(random_shapes);
    return anneal_test_summary();
}
