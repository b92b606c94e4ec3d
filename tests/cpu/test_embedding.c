/* Embedding gather and scatter-add backward: exact row copies, dw against an ordered
 * float reference (bitwise: the kernel promises id order) and a double reference,
 * repeated and unused ids, a central finite-difference check, and bitwise
 * determinism across thread counts. */
#include "cpu/cpu_kernels.h"
#include "test.h"

#include <omp.h>

static int32_t *rand_ids(int64_t n, int64_t V) {
    int32_t *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    for (int64_t i = 0; i < n; i++) p[i] = (int32_t)(anneal_test_next_u64() % (uint64_t)V);
    return p;
}

/* One shape: y rows are bitwise copies; dw equals the float scatter-add done in id
 * order (bitwise) and the double sum within 1e-7*N abs + 1e-6 rel (float accumulation
 * of up to N terms of size <= 1); rows of dw no id points at are 0 even though dw
 * started as NaN. */
static void check_shape(int64_t N, int64_t C, int64_t V) {
    anneal_test_rng_state = (uint64_t)(N * 131 + C * 7 + V);
    int32_t *ids = rand_ids(N, V);
    float *w = anneal_test_rand_buf(V * C, -1, 1), *dy = anneal_test_rand_buf(N * C, -1, 1);
    float *y = malloc((size_t)(N * C) * sizeof *y), *dw = malloc((size_t)(V * C) * sizeof *dw);
    float *ref = calloc((size_t)(V * C), sizeof *ref);
    double *refd = calloc((size_t)(V * C), sizeof *refd);
    for (int64_t i = 0; i < V * C; i++) dw[i] = NAN;
    anneal_cpu_embedding_fwd(N, C, ids, w, y);
    anneal_cpu_embedding_bwd(N, C, V, ids, dy, dw);
    bool rows_ok = true;
    for (int64_t i = 0; i < N; i++)
        rows_ok = rows_ok && memcmp(y + i * C, w + (int64_t)ids[i] * C, C * sizeof *y) == 0;
    CHECK(rows_ok, "N=%lld C=%lld V=%lld: y rows are not copies", (long long)N, (long long)C,
          (long long)V);
    for (int64_t i = 0; i < N; i++)
        for (int64_t c = 0; c < C; c++) {
            ref[ids[i] * C + c] += dy[i * C + c];
            refd[ids[i] * C + c] += dy[i * C + c];
        }
    CHECK(memcmp(dw, ref, (size_t)(V * C) * sizeof *dw) == 0,
          "N=%lld C=%lld V=%lld: dw differs from the id-ordered sum", (long long)N, (long long)C,
          (long long)V);
    for (int64_t i = 0; i < V * C; i++) ref[i] = (float)refd[i];
    CHECK_ALLCLOSE(dw, ref, V * C, 1e-7 * (double)N, 1e-6);
    free(ids), free(w), free(dy), free(y), free(dw), free(ref), free(refd);
}

/* N = 1, C = 1, V = 1, C not a multiple of 16 or of the 64-column block, many
 * repeated ids (N >> V), unused rows (N << V), sizes across the threading cutoff. */
TEST(matches_reference) {
    static const int64_t shapes[][3] = {{1, 1, 1},    {1, 7, 3},     {5, 1, 2},   {16, 16, 4},
                                        {100, 130, 7}, {3, 64, 1000}, {513, 65, 50}, {64, 768, 300},
                                        {2000, 33, 1}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        check_shape(shapes[s][0], shapes[s][1], shapes[s][2]);
}

/* N = 0: dw is still overwritten with zeros. */
TEST(no_ids_zeroes_dw) {
    float dw[12], zero[12] = {0};
    for (int i = 0; i < 12; i++) dw[i] = NAN;
    anneal_cpu_embedding_bwd(0, 4, 3, NULL, NULL, dw);
    CHECK_TRUE(memcmp(dw, zero, sizeof dw) == 0);
}

/* Central differences of L = sum(y * R) on every w element (eps = 1e-3, L in double):
 * the loss is linear in w, so the match is within 1e-4 elementwise (float rounding of
 * the perturbed w only). */
TEST(backward_matches_finite_differences) {
    enum { N = 9, C = 5, V = 4 };
    anneal_test_rng_state = 17;
    int32_t *ids = rand_ids(N, V);
    float *w = anneal_test_rand_buf(V * C, -1, 1), *R = anneal_test_rand_buf(N * C, -1, 1);
    float y[N * C], dw[V * C];
    anneal_cpu_embedding_bwd(N, C, V, ids, R, dw);
    double emax = 0;
    for (int k = 0; k < V * C; k++) {
        float w0 = w[k];
        double L[2];
        for (int s = 0; s < 2; s++) {
            w[k] = s ? w0 - 1e-3f : w0 + 1e-3f;
            anneal_cpu_embedding_fwd(N, C, ids, w, y);
            L[s] = 0;
            for (int i = 0; i < N * C; i++) L[s] += (double)y[i] * R[i];
        }
        double h = (double)(w0 + 1e-3f) - (double)(w0 - 1e-3f);
        w[k] = w0;
        double d = fabs((L[0] - L[1]) / h - dw[k]);
        emax = d > emax ? d : emax;
    }
    CHECK(emax <= 1e-4, "max |num - ana| = %g", emax);
    free(ids), free(w), free(R);
}

/* 1 vs 2 threads: identical dw bits with heavy id repetition. */
TEST(deterministic_across_thread_counts) {
    enum { N = 4096, C = 130, V = 50 };
    anneal_test_rng_state = 23;
    int32_t *ids = rand_ids(N, V);
    float *dy = anneal_test_rand_buf(N * C, -1, 1);
    float *dw[2] = {malloc(V * C * sizeof(float)), malloc(V * C * sizeof(float))};
    int saved = omp_get_max_threads();
    for (int t = 0; t < 2; t++) {
        omp_set_num_threads(t + 1);
        anneal_cpu_embedding_bwd(N, C, V, ids, dy, dw[t]);
    }
    omp_set_num_threads(saved);
    CHECK_TRUE(memcmp(dw[0], dw[1], V * C * sizeof(float)) == 0);
    free(ids), free(dy), free(dw[0]), free(dw[1]);
}

int main(void) {
    RUN(matches_reference);
    RUN(no_ids_zeroes_dw);
    RUN(backward_matches_finite_differences);
    RUN(deterministic_across_thread_counts);
    return anneal_test_summary();
}
