/* Tests of the CPU SGEMM (anneal_cpu_sgemm, anneal_cpu_sgemm_batched) against a naive
 * double-precision reference, on every micro-kernel the CPU can run (portable, AVX2,
 * AVX-512). bf16/f16 precision and the epilogue: test_gemm_precision.c.
 *
 * Tolerance: each element must satisfy
 *   |c - ref| <= 1e-5 * sqrt(K + 1) * (|alpha| * sum_k |a_ik * b_kj| + |beta * c0_ij|)
 * i.e. relative to the magnitude of the terms summed (the scale fp32 rounding errors grow
 * with), so sign cancellations cannot make a correct result look wrong, while a missing,
 * doubled or misplaced term (an error of order scale / K or more) still fails. */
#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "test.h"

#include <omp.h>

/* ------------------------------------------------------------ helpers */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

/* Uniform in [0, 1). */
static double urand(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static int64_t irand(int64_t lo, int64_t hi) { return lo + (int64_t)(urand() * (double)(hi - lo + 1)); }

/* n floats in [-1, 1), or NaN everywhere when nan_fill. malloc(0)-safe. */
static float *rand_buf(int64_t n, bool nan_fill) {
    float *x = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = nan_fill ? NAN : (float)(2.0 * urand() - 1.0);
    return x;
}

/* Reference: ref = alpha * op(A) @ op(B) + beta * C0 in double, and the error scale of
 * each element (|alpha| * sum |a*b| + |beta * c0|). beta == 0 ignores C0 (may be NaN). */
static void reference(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                      const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                      const float *C0, int64_t ldc, double *ref, double *scale) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0, sa = 0;
            for (int64_t k = 0; k < K; k++) {
                double a = ta ? A[k * lda + i] : A[i * lda + k];
                double b = tb ? B[j * ldb + k] : B[k * ldb + j];
                s += a * b;
                sa += fabs(a * b);
            }
            double c0 = beta == 0.0f ? 0.0 : (double)beta * C0[i * ldc + j];
            ref[i * N + j] = alpha * s + c0;
            scale[i * N + j] = fabs((double)alpha) * sa + fabs(c0);
        }
}

/* Number of elements of C (M x N inside ldc) out of tolerance; reports the first. Also
 * checks that the padding columns N..ldc-1 still hold their sentinel. */
static int64_t count_bad(const char *what, int64_t M, int64_t N, int64_t K, const float *C,
                         int64_t ldc, const double *ref, const double *scale) {
    const double tol = 1e-5 * sqrt((double)K + 1.0);
    int64_t bad = 0;
    for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < N; j++) {
            double c = C[i * ldc + j], r = ref[i * N + j];
            double lim = tol * scale[i * N + j] + 1e-30;
            if (!(fabs(c - r) <= lim)) {
                if (!bad)
                    anneal_test_fail(__FILE__, __LINE__,
                                     "%s M=%lld N=%lld K=%lld: C[%lld,%lld] = %.9g, ref %.9g "
                                     "(tol %.3g)", what, (long long)M, (long long)N,
                                     (long long)K, (long long)i, (long long)j, c, r, lim);
                bad++;
            }
        }
        for (int64_t j = N; j < ldc; j++)
            if (C[i * ldc + j] != 1234.5f) {
                if (!bad)
                    anneal_test_fail(__FILE__, __LINE__, "%s: padding C[%lld,%lld] overwritten",
                                     what, (long long)i, (long long)j);
                bad++;
            }
    }
    return bad;
}

/* Runs one product with random operands (leading dims padded by `pad` NaN columns) and
 * checks it against the reference. Returns the number of bad elements. */
static int64_t check_one(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                         float beta, int64_t pad, bool nan_c) {
    const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
    const int64_t arows = ta ? K : M, brows = tb ? N : K;
    float *A = rand_buf(arows * lda, false), *B = rand_buf(brows * ldb, false);
    float *C = rand_buf(M * ldc, nan_c && beta == 0.0f);
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = N; j < ldc; j++) C[i * ldc + j] = 1234.5f;
    /* NaN in the leading-dim padding of A and B: any read of it into a used lane shows. */
    for (int64_t r = 0; r < arows; r++)
        for (int64_t j = lda - pad; j < lda; j++) A[r * lda + j] = NAN;
    for (int64_t r = 0; r < brows; r++)
        for (int64_t j = ldb - pad; j < ldb; j++) B[r * ldb + j] = NAN;
    double *ref = malloc(sizeof(double) * (size_t)(M * N > 0 ? M * N : 1));
    double *scale = malloc(sizeof(double) * (size_t)(M * N > 0 ? M * N : 1));
    reference(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ref, scale);
    anneal_cpu_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    char what[96];
    snprintf(what, sizeof what, "%s %c%c alpha=%g beta=%g pad=%lld", anneal_cpu_sgemm_isa_name(),
             ta ? 'T' : 'N', tb ? 'T' : 'N', alpha, beta, (long long)pad);
    int64_t bad = count_bad(what, M, N, K, C, ldc, ref, scale);
    free(A);
    free(B);
    free(C);
    free(ref);
    free(scale);
    return bad;
}

/* The ISAs this CPU can run: portable always, AVX2 and AVX-512 when present. */
static int isa_list(int *isas) {
    int n = 0;
    isas[n++] = ANNEAL_GEMM_ISA_PORTABLE;
    if (anneal_cpu_has_avx2()) isas[n++] = ANNEAL_GEMM_ISA_AVX2;
    if (anneal_cpu_has_avx512()) isas[n++] = ANNEAL_GEMM_ISA_AVX512;
    return n;
}

/* ------------------------------------------------------------ tests */

/* The automatic choice is the best ISA the CPU has (AVX-512, else AVX2, else portable)
 * unless ANNEAL_CPU_ISA says otherwise, and the override works. */
TEST(isa_dispatch) {
    REQUIRE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO) == 0);
    const char *env = getenv("ANNEAL_CPU_ISA");
    const char *best = anneal_cpu_has_avx512() ? "avx512" : anneal_cpu_has_avx2() ? "avx2" : "portable";
    if (env && strcmp(env, "portable") == 0) best = "portable";
    if (env && strcmp(env, "avx2") == 0 && anneal_cpu_has_avx2()) best = "avx2";
    CHECK(strcmp(anneal_cpu_sgemm_isa_name(), best) == 0, "auto ISA is %s, expected %s",
          anneal_cpu_sgemm_isa_name(), best);
    CHECK_TRUE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_PORTABLE) == 0);
    CHECK(strcmp(anneal_cpu_sgemm_isa_name(), "portable") == 0, "%s", anneal_cpu_sgemm_isa_name());
    CHECK_TRUE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AVX2) == (anneal_cpu_has_avx2() ? 0 : -1));
    if (anneal_cpu_has_avx2())
        CHECK(strcmp(anneal_cpu_sgemm_isa_name(), "avx2") == 0, "%s", anneal_cpu_sgemm_isa_name());
    CHECK_TRUE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AVX512) == (anneal_cpu_has_avx512() ? 0 : -1));
    CHECK_TRUE(anneal_cpu_sgemm_set_isa(42) == -1);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* All transposes, edge sizes (0, 1, odd, around the tile sizes) and random sizes. */
TEST(small_and_edge_sizes) {
    static const int64_t edge[] = {0, 1, 2, 7, 13, 14, 15, 16, 17, 31, 32, 33, 47};
    const int ne = (int)(sizeof edge / sizeof edge[0]);
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        int64_t bad = 0;
        for (int t = 0; t < 4; t++) {
            bool ta = t >> 1, tb = t & 1;
            for (int i = 0; i < ne; i++)
                for (int j = 0; j < ne; j += 3)
                    bad += check_one(ta, tb, edge[i], edge[j], edge[(i + j) % ne], 1.0f, 0.0f, 0,
                                     false);
            /* ASan (~10x slower): 8 random shapes per transpose instead of 25. */
            for (int r = 0; r < (anneal_test_sanitized() ? 8 : 25); r++)
                bad += check_one(ta, tb, irand(1, 90), irand(1, 90), irand(1, 90), 1.0f, 0.0f,
                                 irand(0, 3), false);
        }
        CHECK(bad == 0, "%lld bad elements (%s)", (long long)bad, anneal_cpu_sgemm_isa_name());
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* Shapes larger than every block (AVX-512: mc 384, nc 3072, kc 256; AVX2: mc 168;
 * portable: mc 256):
 * several row blocks, several column blocks, several depth blocks with ragged ends, with
 * padded leading dims. */
TEST(larger_than_blocks) {
    static const int64_t shapes[][3] = {
        {400, 70, 600}, {2100, 40, 20}, {15, 3100, 270}, {97, 131, 513}, {29, 45, 1}};
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        int64_t bad = 0;
        for (int t = 0; t < 4; t++)
            for (int i = 0; i < 5; i++)
                bad += check_one(t >> 1, t & 1, shapes[i][0], shapes[i][1], shapes[i][2], 1.0f,
                                 0.0f, 5, false);
        CHECK(bad == 0, "%lld bad elements (%s)", (long long)bad, anneal_cpu_sgemm_isa_name());
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* alpha and beta values, including beta == 0 over a NaN-filled C (C must not be read) and
 * K spanning several depth blocks (beta applied once, later blocks accumulate). */
TEST(alpha_beta) {
    static const float alphas[] = {1.0f, -0.5f, 2.5f};
    static const float betas[] = {0.0f, 1.0f, -1.5f, 0.25f};
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        int64_t bad = 0;
        for (int t = 0; t < 4; t++)
            for (int a = 0; a < 3; a++)
                for (int b = 0; b < 4; b++) {
                    bad += check_one(t >> 1, t & 1, 37, 45, 300, alphas[a], betas[b], 3, true);
                    bad += check_one(t >> 1, t & 1, 5, 3, 7, alphas[a], betas[b], 0, true);
                    bad += check_one(t >> 1, t & 1, 1, 300, 70, alphas[a], betas[b], 2, true);
                }
        CHECK(bad == 0, "%lld bad elements (%s)", (long long)bad, anneal_cpu_sgemm_isa_name());
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* K == 0 gives beta * C (zeros for beta == 0 even over NaN); alpha == 0 gives beta * C
 * without using A and B (BLAS convention); M == 0 or N == 0 touches nothing. */
TEST(degenerate) {
    float A[4] = {NAN, NAN, NAN, NAN}, B[4] = {1, 2, 3, 4};
    float C[6] = {1, 2, 3, 4, 5, 6};
    anneal_cpu_sgemm(false, false, 2, 3, 0, 1.0f, A, 1, B, 3, 2.0f, C, 3);
    for (int i = 0; i < 6; i++) CHECK_NEAR(C[i], 2.0 * (i + 1), 0);
    for (int i = 0; i < 6; i++) C[i] = NAN;
    anneal_cpu_sgemm(false, false, 2, 3, 0, 1.0f, A, 1, B, 3, 0.0f, C, 3);
    for (int i = 0; i < 6; i++) CHECK_NEAR(C[i], 0.0, 0);
    for (int i = 0; i < 6; i++) C[i] = (float)i;
    anneal_cpu_sgemm(false, false, 2, 2, 2, 0.0f, A, 2, B, 2, -1.0f, C, 3);
    CHECK_NEAR(C[0], 0.0, 0);
    CHECK_NEAR(C[1], -1.0, 0);
    CHECK_NEAR(C[2], 2.0, 0); /* outside the 2 x 2 product */
    CHECK_NEAR(C[4], -4.0, 0);
    for (int i = 0; i < 6; i++) C[i] = 7.0f;
    anneal_cpu_sgemm(false, false, 0, 3, 2, 1.0f, A, 2, B, 3, 0.0f, C, 3);
    anneal_cpu_sgemm(false, false, 2, 0, 2, 1.0f, A, 2, B, 3, 0.0f, C, 3);
    anneal_cpu_sgemm_batched(0, false, false, 2, 3, 2, 1.0f, A, 2, 0, B, 3, 0, 0.0f, C, 3, 6);
    for (int i = 0; i < 6; i++) CHECK_NEAR(C[i], 7.0, 0);
}

/* Batched products: per-matrix strides, stride 0 broadcasting A or B, padded leading
 * dims, small (runs across threads) and larger (runs in order, threaded inside) cases. */
TEST(batched) {
    static const int64_t cases[][5] = {
        /* batch, M, N, K, broadcast (0 none, 1 A, 2 B) */
        {48, 64, 64, 64, 0}, {6, 33, 17, 20, 1}, {5, 20, 31, 9, 2}, {3, 300, 200, 64, 0},
        {1, 5, 6, 7, 0}};
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int c = 0; c < 5; c++)
            for (int t = 0; t < 4; t++) {
                bool ta = t >> 1, tb = t & 1;
                const int64_t batch = cases[c][0], M = cases[c][1], N = cases[c][2],
                              K = cases[c][3], bc = cases[c][4];
                const int64_t lda = (ta ? M : K) + 1, ldb = (tb ? K : N) + 2, ldc = N + 3;
                const int64_t sa = bc == 1 ? 0 : (ta ? K : M) * lda + 5;
                const int64_t sb = bc == 2 ? 0 : (tb ? N : K) * ldb + 1;
                const int64_t sc = M * ldc + 4;
                float *A = rand_buf(sa * (batch - 1) + (ta ? K : M) * lda, false);
                float *B = rand_buf(sb * (batch - 1) + (tb ? N : K) * ldb, false);
                float *C = rand_buf(sc * batch, false);
                float *C0 = malloc(sizeof(float) * (size_t)(sc * batch));
                for (int64_t b = 0; b < batch; b++)
                    for (int64_t i = 0; i < M; i++)
                        for (int64_t j = N; j < ldc; j++) C[b * sc + i * ldc + j] = 1234.5f;
                memcpy(C0, C, sizeof(float) * (size_t)(sc * batch));
                double *ref = malloc(sizeof(double) * (size_t)(M * N));
                double *scale = malloc(sizeof(double) * (size_t)(M * N));
                anneal_cpu_sgemm_batched(batch, ta, tb, M, N, K, 0.75f, A, lda, sa, B, ldb, sb,
                                         0.5f, C, ldc, sc);
                int64_t bad = 0;
                for (int64_t b = 0; b < batch; b++) {
                    reference(ta, tb, M, N, K, 0.75f, A + b * sa, lda, B + b * sb, ldb, 0.5f,
                              C0 + b * sc, ldc, ref, scale);
                    bad += count_bad("batched", M, N, K, C + b * sc, ldc, ref, scale);
                }
                CHECK(bad == 0, "%s batch=%lld %c%c: %lld bad", anneal_cpu_sgemm_isa_name(),
                      (long long)batch, ta ? 'T' : 'N', tb ? 'T' : 'N', (long long)bad);
                free(A);
                free(B);
                free(C);
                free(C0);
                free(ref);
                free(scale);
            }
    }
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* Same bits with 1, 2 and 3 threads (and the batched path equal to single calls), for
 * shapes that split over N, over M, over several depth blocks with ragged edges, and the
 * single-row (M == 1) path. Row blocks go to whichever thread asks first, so 3 threads on
 * 2 cores also changes which thread computes what from run to run. */
TEST(deterministic_across_threads) {
    static const int64_t shapes[][3] = {
        {300, 700, 530}, {700, 20, 300}, {64, 3100, 100}, {1, 20000, 300}};
    const int saved = omp_get_max_threads();
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        /* ASan: the M == 1 shape and the first one only. */
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 4; t++) {
                if (anneal_test_sanitized() && c != 0 && c != 3) continue;
                bool ta = t >> 1, tb = t & 1;
                const int64_t M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
                const int64_t lda = ta ? M : K, ldb = tb ? K : N;
                float *A = rand_buf(M * K, false), *B = rand_buf(K * N, false);
                float *C1 = rand_buf(M * N, false);
                float *C2 = malloc(sizeof(float) * (size_t)(M * N));
                float *C3 = malloc(sizeof(float) * (size_t)(M * N));
                memcpy(C2, C1, sizeof(float) * (size_t)(M * N));
                memcpy(C3, C1, sizeof(float) * (size_t)(M * N));
                omp_set_num_threads(1);
                anneal_cpu_sgemm(ta, tb, M, N, K, 1.5f, A, lda, B, ldb, 0.5f, C1, N);
                omp_set_num_threads(2);
                anneal_cpu_sgemm(ta, tb, M, N, K, 1.5f, A, lda, B, ldb, 0.5f, C2, N);
                omp_set_num_threads(3);
                anneal_cpu_sgemm(ta, tb, M, N, K, 1.5f, A, lda, B, ldb, 0.5f, C3, N);
                CHECK(memcmp(C1, C2, sizeof(float) * (size_t)(M * N)) == 0 &&
                          memcmp(C1, C3, sizeof(float) * (size_t)(M * N)) == 0,
                      "%s %c%c %lldx%lldx%lld differs between 1, 2 and 3 threads",
                      anneal_cpu_sgemm_isa_name(), ta ? 'T' : 'N', tb ? 'T' : 'N', (long long)M,
                      (long long)N, (long long)K);
                free(A);
                free(B);
                free(C1);
                free(C2);
                free(C3);
            }
        /* 8 small products across threads equal the same products one by one. */
        const int64_t batch = 8, M = 70, N = 50, K = 300;
        float *A = rand_buf(batch * M * K, false), *B = rand_buf(batch * K * N, false);
        float *C1 = malloc(sizeof(float) * (size_t)(batch * M * N));
        float *C2 = malloc(sizeof(float) * (size_t)(batch * M * N));
        omp_set_num_threads(2);
        anneal_cpu_sgemm_batched(batch, false, true, M, N, K, 1.0f, A, K, M * K, B, K, K * N,
                                 0.0f, C1, N, M * N);
        omp_set_num_threads(1);
        for (int64_t b = 0; b < batch; b++)
            anneal_cpu_sgemm(false, true, M, N, K, 1.0f, A + b * M * K, K, B + b * K * N, K, 0.0f,
                             C2 + b * M * N, N);
        CHECK(memcmp(C1, C2, sizeof(float) * (size_t)(batch * M * N)) == 0,
              "%s: batched differs from single calls", anneal_cpu_sgemm_isa_name());
        free(A);
        free(B);
        free(C1);
        free(C2);
    }
    omp_set_num_threads(saved);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* A right operand packed once (anneal_cpu_gemm_pack_b) gives the same bits as the
 * unpacked product, at every compute precision and ISA, both transposes of each operand,
 * with beta and the bias + GELU epilogue, on 1 and 2 threads, for shapes with ragged
 * edges and several depth blocks (K > kc) and column blocks (N > nc), and one with so
 * many column blocks (N > 4 nc) that the row blocks are as tall as the ISA allows (two
 * of them here: M > mc). */
TEST(prepacked_b_matches_unpacked) {
    static const int64_t shapes[][3] = {{37, 70, 45}, {100, 3300, 600}, {300, 40, 1100}, {420, 12400, 24}};
    static const int computes[] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_F16};
    const int saved = omp_get_max_threads();
    int isas[3], nisa = isa_list(isas);
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int c = 0; c < 4; c++) {
            if (anneal_test_sanitized() && (c == 1 || c == 3)) continue; /* ASan: the small shapes */
            const int64_t M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
            for (int p = 0; p < 3; p++)
                for (int t = 0; t < 4; t++) {
                    const bool ta = t >> 1, tb = t & 1;
                    const int cd = computes[p];
                    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
                    float *A = rand_buf(M * K, false), *B = rand_buf(K * N, false);
                    float *bias = rand_buf(N, false), *C0 = rand_buf(M * N, false);
                    float *C1 = malloc(sizeof(float) * (size_t)(M * N));
                    float *C2 = malloc(sizeof(float) * (size_t)(M * N));
                    float *P1 = malloc(sizeof(float) * (size_t)(M * N));
                    float *P2 = malloc(sizeof(float) * (size_t)(M * N));
                    const size_t bytes = anneal_cpu_gemm_packed_b_size(cd, K, N);
                    void *pb = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
                    REQUIRE(pb != NULL);
                    anneal_gemm_epilogue ep = {.bias = bias, .gelu_tanh = (t & 1) != 0};
                    const float beta = (t & 1) ? 0.0f : 0.5f; /* the epilogue, or beta */
                    for (int threads = 1; threads <= 2; threads++) {
                        omp_set_num_threads(threads);
                        memcpy(C1, C0, sizeof(float) * (size_t)(M * N));
                        memcpy(C2, C0, sizeof(float) * (size_t)(M * N));
                        ep.pre = P1;
                        anneal_cpu_gemm(cd, ta, tb, M, N, K, 1.25f, A, lda, B, ldb, beta, C1, N,
                                        beta == 0.0f ? &ep : NULL);
                        memset(pb, 0xff, bytes); /* NaN everywhere: any lane not packed shows */
                        anneal_cpu_gemm_pack_b(cd, tb, K, N, B, ldb, pb);
                        ep.pre = P2;
                        anneal_cpu_gemm_packed(cd, ta, M, N, K, 1.25f, A, lda, pb, beta, C2, N,
                                               beta == 0.0f ? &ep : NULL);
                        CHECK(memcmp(C1, C2, sizeof(float) * (size_t)(M * N)) == 0 &&
                                  (beta != 0.0f ||
                                   memcmp(P1, P2, sizeof(float) * (size_t)(M * N)) == 0),
                              "%s compute %d %c%c %lldx%lldx%lld, %d threads: packed B differs",
                              anneal_cpu_sgemm_isa_name(), cd, ta ? 'T' : 'N', tb ? 'T' : 'N',
                              (long long)M, (long long)N, (long long)K, threads);
                    }
                    free(A);
                    free(B);
                    free(bias);
                    free(C0);
                    free(C1);
                    free(C2);
                    free(P1);
                    free(P2);
                    free(pb);
                }
        }
    }
    CHECK(anneal_cpu_gemm_packed_b_size(ANNEAL_F32, 0, 10) == 0 &&
              anneal_cpu_gemm_packed_b_size(ANNEAL_BF16, 10, 0) == 0,
          "an empty operand packs to 0 bytes");
    omp_set_num_threads(saved);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* The epilogue's B column sums: b_colsum[j] = sum over k of op(B)[k, j], one sequential
 * f32 sum per column (so the bits equal that loop), from the packing path (several depth
 * and column blocks, both layouts of B, 1-3 threads, with and without an epilogue on C),
 * the single-row path, K == 0 and alpha == 0; C itself is unchanged by asking for them. */
TEST(b_column_sums) {
    static const int64_t shapes[][3] = {{50, 70, 30}, {100, 3300, 1100}, {1, 500, 700},
                                        {20, 30, 0}};
    const int saved = omp_get_max_threads();
    for (int c = 0; c < 4; c++)
        for (int tb = 0; tb < 2; tb++)
            for (int threads = 1; threads <= 3; threads++) {
                const int64_t M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
                if (anneal_test_sanitized() && c == 1 && threads != 2) continue;
                const int64_t ldb = tb ? (K > 0 ? K : 1) : N;
                float *A = rand_buf(M * (K > 0 ? K : 1), false);
                float *B = rand_buf((tb ? N : (K > 0 ? K : 1)) * ldb, false);
                float *bias = rand_buf(N, false);
                float *C1 = malloc(sizeof(float) * (size_t)(M * N));
                float *C2 = malloc(sizeof(float) * (size_t)(M * N));
                float *sum = rand_buf(N, true), *ref = malloc(sizeof(float) * (size_t)N);
                for (int64_t j = 0; j < N; j++) {
                    float t = 0.0f;
                    for (int64_t k = 0; k < K; k++) t += tb ? B[j * ldb + k] : B[k * ldb + j];
                    ref[j] = t;
                }
                omp_set_num_threads(threads);
                const float alpha = c == 0 && tb ? 0.0f : 1.0f;
                anneal_gemm_epilogue e1 = {.bias = c == 1 ? bias : NULL}, e2 = e1;
                e2.b_colsum = sum;
                anneal_cpu_gemm(ANNEAL_BF16, false, tb, M, N, K, alpha, A, K > 0 ? K : 1, B, ldb,
                                0.0f, C1, N, &e1);
                anneal_cpu_gemm(ANNEAL_BF16, false, tb, M, N, K, alpha, A, K > 0 ? K : 1, B, ldb,
                                0.0f, C2, N, &e2);
                CHECK(memcmp(sum, ref, sizeof(float) * (size_t)N) == 0,
                      "%lldx%lldx%lld tb=%d alpha=%g, %d threads: column sums differ from the "
                      "sequential sums", (long long)M, (long long)N, (long long)K, tb, alpha,
                      threads);
                CHECK(memcmp(C1, C2, sizeof(float) * (size_t)(M * N)) == 0,
                      "%lldx%lldx%lld: asking for the column sums changed C", (long long)M,
                      (long long)N, (long long)K);
                free(A);
                free(B);
                free(bias);
                free(C1);
                free(C2);
                free(sum);
                free(ref);
            }
    omp_set_num_threads(saved);
}

/* silu(v) * m by the unfused kernels: anneal_cpu_silu_fwd over the n values, then the
 * product, into out. */
static void silu_then_mul(int64_t n, const float *v, const float *m, float *out) {
    anneal_cpu_silu_fwd(n, v, out);
    for (int64_t j = 0; j < n; j++) out[j] = out[j] * m[j];
}

/* The SiLU-times-multiplier epilogue (SwiGLU's silu(gate) * up) gives the bits of the
 * unfused computation: the same product with only the bias fused, then anneal_cpu_silu_fwd
 * and a multiply; and pre holds the pre-activation (the unfused product). For every ISA
 * and compute precision, anneal_cpu_gemm (blocked and single-row paths, K == 0) and
 * anneal_cpu_gemm_packed, with and without bias and pre, both transposes, beta != 0, C,
 * pre and the multiplier with a padded row stride (padding untouched), edge tiles, several
 * column blocks, 1-3 threads (and the fused result is the same on 1, 2 and 3 threads). */
TEST(silu_mul_epilogue) {
    static const int64_t shapes[][3] = {{1, 70, 45}, {37, 70, 45}, {130, 257, 300},
                                        {5, 3, 0},   {64, 3300, 40}};
    static const int computes[] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_F16};
    const int saved = omp_get_max_threads();
    int isas[3], nisa = isa_list(isas);
    int64_t checked = 0, nonzero = 0, differs_from_plain = 0;
    for (int s = 0; s < nisa; s++) {
        REQUIRE(anneal_cpu_sgemm_set_isa(isas[s]) == 0);
        for (int p = 0; p < 3; p++)
            for (int c = 0; c < 5; c++)
                for (int combo = 0; combo < 4; combo++) {
                    if (anneal_test_sanitized() && c == 4 && combo != 0) continue;
                    const int cd = computes[p];
                    const int64_t M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
                    const int64_t Kd = K > 0 ? K : 1, ldc = N + 3;
                    const bool use_bias = combo & 1, use_pre = combo & 2;
                    const bool ta = (c + combo) & 1, tb = ((c + combo) >> 1) & 1;
                    const int threads = 1 + (c + combo) % 3;
                    const float beta = combo == 1 ? 0.5f : 0.0f;
                    const int64_t lda = ta ? M : Kd, ldb = tb ? Kd : N;
                    float *A = rand_buf(M * Kd, false), *B = rand_buf(Kd * N, false);
                    float *bias = rand_buf(N, false), *mul = rand_buf(M * ldc, false);
                    float *C0 = rand_buf(M * ldc, false);
                    for (int64_t i = 0; i < M * N; i++) mul[i] *= 3.0f;
                    for (int64_t i = 0; i < M; i++)
                        for (int64_t j = N; j < ldc; j++) C0[i * ldc + j] = 1234.5f;
                    float *Cf = malloc(sizeof(float) * (size_t)(M * ldc));
                    float *Cu = malloc(sizeof(float) * (size_t)(M * ldc));
                    float *Pf = malloc(sizeof(float) * (size_t)(M * ldc));
                    float *want = malloc(sizeof(float) * (size_t)(M * ldc));
                    const size_t bytes = anneal_cpu_gemm_packed_b_size(cd, K, N);
                    void *pb = aligned_alloc(64, bytes ? (bytes + 63) & ~(size_t)63 : 64);
                    REQUIRE(pb != NULL);
                    anneal_cpu_gemm_pack_b(cd, tb, K, N, B, ldb, pb);
                    anneal_gemm_epilogue plain = {.bias = use_bias ? bias : NULL};
                    anneal_gemm_epilogue fused = plain;
                    fused.silu_mul = mul;
                    fused.pre = use_pre ? Pf : NULL;
                    for (int path = 0; path < 2; path++) {
                        float *ref = NULL;
                        for (int th = threads; th <= (path == 0 && c == 2 ? 3 : threads); th++) {
                            omp_set_num_threads(th);
                            memcpy(Cf, C0, sizeof(float) * (size_t)(M * ldc));
                            memcpy(Cu, C0, sizeof(float) * (size_t)(M * ldc));
                            memcpy(Pf, C0, sizeof(float) * (size_t)(M * ldc));
                            if (path == 0) {
                                anneal_cpu_gemm(cd, ta, tb, M, N, K, 1.25f, A, lda, B, ldb, beta,
                                                Cu, ldc, &plain);
                                anneal_cpu_gemm(cd, ta, tb, M, N, K, 1.25f, A, lda, B, ldb, beta,
                                                Cf, ldc, &fused);
                            } else {
                                anneal_cpu_gemm_packed(cd, ta, M, N, K, 1.25f, A, lda, pb, beta, Cu,
                                                       ldc, &plain);
                                anneal_cpu_gemm_packed(cd, ta, M, N, K, 1.25f, A, lda, pb, beta, Cf,
                                                       ldc, &fused);
                            }
                            memcpy(want, C0, sizeof(float) * (size_t)(M * ldc));
                            for (int64_t i = 0; i < M; i++)
                                silu_then_mul(N, Cu + i * ldc, mul + i * ldc, want + i * ldc);
                            CHECK(memcmp(Cf, want, sizeof(float) * (size_t)(M * ldc)) == 0,
                                  "%s compute %d %s %c%c %lldx%lldx%lld bias=%d pre=%d beta=%g, %d "
                                  "threads: fused silu*mul differs from silu then mul",
                                  anneal_cpu_sgemm_isa_name(), cd, path ? "packed" : "gemm",
                                  ta ? 'T' : 'N', tb ? 'T' : 'N', (long long)M, (long long)N,
                                  (long long)K, use_bias, use_pre, beta, th);
                            if (use_pre)
                                CHECK(memcmp(Pf, Cu, sizeof(float) * (size_t)(M * ldc)) == 0,
                                      "%s compute %d %s %lldx%lldx%lld: pre is not the "
                                      "pre-activation", anneal_cpu_sgemm_isa_name(), cd,
                                      path ? "packed" : "gemm", (long long)M, (long long)N,
                                      (long long)K);
                            const bool zero = K == 0 && beta == 0.0f && !use_bias; /* C = 0 */
                            for (int64_t i = 0; i < M * ldc && !zero; i++)
                                if (Cf[i] != Cu[i]) {
                                    differs_from_plain++;
                                    break;
                                }
                            nonzero += !zero;
                            if (!ref) {
                                ref = malloc(sizeof(float) * (size_t)(M * ldc));
                                memcpy(ref, Cf, sizeof(float) * (size_t)(M * ldc));
                            } else {
                                CHECK(memcmp(ref, Cf, sizeof(float) * (size_t)(M * ldc)) == 0,
                                      "%s compute %d %lldx%lldx%lld: %d threads differ",
                                      anneal_cpu_sgemm_isa_name(), cd, (long long)M, (long long)N,
                                      (long long)K, th);
                            }
                            checked++;
                        }
                        free(ref);
                    }
                    free(A), free(B), free(bias), free(mul), free(C0), free(Cf), free(Cu);
                    free(Pf), free(want), free(pb);
                }
    }
    /* negative control: the fused epilogue did change C (every product that is not 0) */
    CHECK(differs_from_plain == nonzero && checked > 100,
          "%lld of %lld fused products differ from the plain product", (long long)differs_from_plain,
          (long long)nonzero);
    omp_set_num_threads(saved);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* gelu_tanh and silu_mul are exclusive: with both set, silu_mul is applied (documented). */
TEST(silu_mul_wins_over_gelu) {
    const int64_t M = 9, N = 20, K = 7;
    float *A = rand_buf(M * K, false), *B = rand_buf(K * N, false), *mul = rand_buf(M * N, false);
    float *C1 = malloc(sizeof(float) * (size_t)(M * N)), *C2 = malloc(sizeof(float) * (size_t)(M * N));
    anneal_gemm_epilogue e1 = {.silu_mul = mul}, e2 = {.silu_mul = mul, .gelu_tanh = true};
    anneal_cpu_gemm(ANNEAL_F32, false, false, M, N, K, 1.0f, A, K, B, N, 0.0f, C1, N, &e1);
    anneal_cpu_gemm(ANNEAL_F32, false, false, M, N, K, 1.0f, A, K, B, N, 0.0f, C2, N, &e2);
    CHECK(memcmp(C1, C2, sizeof(float) * (size_t)(M * N)) == 0, "gelu_tanh changed a silu_mul product");
    free(A), free(B), free(mul), free(C1), free(C2);
}

int main(void) {
    RUN(isa_dispatch);
    RUN(small_and_edge_sizes);
    RUN(larger_than_blocks);
    RUN(alpha_beta);
    RUN(degenerate);
    RUN(batched);
    RUN(deterministic_across_threads);
    RUN(prepacked_b_matches_unpacked);
    RUN(b_column_sums);
    RUN(silu_mul_epilogue);
    RUN(silu_mul_wins_over_gelu);
    return anneal_test_summary();
}
