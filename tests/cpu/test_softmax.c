/* Softmax and log-softmax kernels against double-precision references written here,
 * central finite differences of the backward, large-magnitude logits, C = 1, and
 * bitwise determinism across thread counts. */
#include "cpu/cpu_kernels.h"
#include "test.h"

#include <omp.h>


/* Double reference: y (softmax or log-softmax) and dx for upstream dy, from x. */
static void ref_softmax(int64_t N, int64_t C, const float *x, const float *dy, bool is_log, float *y,
                        float *dx) {
    double *p = malloc((size_t)C * sizeof *p);
    for (int64_t i = 0; i < N; i++) {
        const float *xr = x + i * C, *dyr = dy + i * C;
        double m = -INFINITY, s = 0, sdy = 0, sdyp = 0;
        for (int64_t c = 0; c < C; c++) m = xr[c] > m ? xr[c] : m;
        for (int64_t c = 0; c < C; c++) s += exp((double)xr[c] - m);
        for (int64_t c = 0; c < C; c++) {
            p[c] = exp((double)xr[c] - m) / s;
            y[i * C + c] = (float)(is_log ? (double)xr[c] - m - log(s) : p[c]);
            sdy += dyr[c];
            sdyp += dyr[c] * p[c];
        }
        for (int64_t c = 0; c < C; c++)
            dx[i * C + c] = (float)(is_log ? dyr[c] - p[c] * sdy : p[c] * (dyr[c] - sdyp));
    }
    free(p);
}

/* Forward then backward (from the kernel's own y) against the reference.
 * Tolerances: softmax y 1e-9 abs + 2e-6 rel; log-softmax y 1e-6 abs + 1e-6 rel
 * (log(sum) is rounded at its magnitude); dx 1e-7 abs + 1e-5 rel. */
static void check_shape(int64_t N, int64_t C, float lo, float hi) {
    anneal_test_rng_state = (uint64_t)(N * 31 + C);
    float *x = anneal_test_rand_buf(N * C, lo, hi), *dy = anneal_test_rand_buf(N * C, -1, 1);
    float *y = anneal_test_nan_buf(N * C), *dx = anneal_test_nan_buf(N * C), *ry = anneal_test_nan_buf(N * C), *rdx = anneal_test_nan_buf(N * C);
    for (int is_log = 0; is_log < 2; is_log++) {
        anneal_cpu_softmax_fwd(N, C, x, y, is_log);
        anneal_cpu_softmax_bwd(N, C, y, dy, dx, is_log);
        ref_softmax(N, C, x, dy, is_log, ry, rdx);
        int64_t w = 0;
        double r = is_log ? anneal_test_close_ratio(y, ry, N * C, 1e-6, 1e-6, &w)
                       : anneal_test_close_ratio(y, ry, N * C, 1e-9, 2e-6, &w);
        CHECK(r <= 1.0, "%s N=%lld C=%lld x in [%g, %g]: y ratio %g at %lld: %.9g vs %.9g",
              is_log ? "log_softmax" : "softmax", (long long)N, (long long)C, lo, hi, r,
              (long long)w, y[w], ry[w]);
        r = anneal_test_close_ratio(dx, rdx, N * C, 1e-7, 1e-5, &w);
        CHECK(r <= 1.0, "%s N=%lld C=%lld: dx ratio %g at %lld: %.9g vs %.9g",
              is_log ? "log_softmax" : "softmax", (long long)N, (long long)C, r, (long long)w, dx[w],
              rdx[w]);
    }
    free(x), free(dy), free(y), free(dx), free(ry), free(rdx);
}

/* Single row/column, C around the 16 lanes, C not a multiple of 16, a vocab-sized row,
 * sizes below and above the threading cutoff. */
TEST(matches_reference) {
    static const int64_t shapes[][2] = {{1, 1},   {5, 1},    {1, 7},   {3, 16},   {5, 33},
                                        {37, 100}, {300, 70}, {64, 1024}, {2, 50257}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        check_shape(shapes[s][0], shapes[s][1], -5.0f, 5.0f);
    check_shape(4, 257, -30.0f, 30.0f); /* many probabilities underflow toward 0 */
}

/* Logits of magnitude 1e4 (differences far beyond exp's range) stay finite and exact:
 * entries equal to the row max share the mass, all others are 0 (-2e4 in log space). */
TEST(large_magnitude_logits) {
    enum { N = 3, C = 37 };
    float x[N * C], y[N * C], dy[N * C], dx[N * C], ry[N * C], rdx[N * C];
    anneal_test_rng_state = 8;
    for (int i = 0; i < N * C; i++) {
        x[i] = anneal_test_urand(0, 1) < 0.5f ? -1e4f : 1e4f;
        dy[i] = anneal_test_urand(-1, 1);
    }
    x[C] = 3e4f; /* one dominant entry in row 1 */
    for (int is_log = 0; is_log < 2; is_log++) {
        anneal_cpu_softmax_fwd(N, C, x, y, is_log);
        anneal_cpu_softmax_bwd(N, C, y, dy, dx, is_log);
        ref_softmax(N, C, x, dy, is_log, ry, rdx);
        bool finite = true;
        for (int i = 0; i < N * C; i++) finite = finite && isfinite(y[i]) && isfinite(dx[i]);
        CHECK(finite, "%s: non-finite output", is_log ? "log_softmax" : "softmax");
        CHECK_ALLCLOSE(y, ry, N * C, 1e-6, 1e-6);
        CHECK_ALLCLOSE(dx, rdx, N * C, 1e-7, 1e-5);
    }
    CHECK_TRUE(y[C] == 0.0f); /* log-softmax of the dominant entry */
}

/* C = 1: softmax is 1, log-softmax 0, and both gradients 0. */
TEST(single_column) {
    float x[3] = {-7.0f, 0.0f, 1e4f}, dy[3] = {1.0f, -2.0f, 0.5f}, y[3], dx[3];
    anneal_cpu_softmax_fwd(3, 1, x, y, false);
    anneal_cpu_softmax_bwd(3, 1, y, dy, dx, false);
    for (int i = 0; i < 3; i++) CHECK(y[i] == 1.0f && dx[i] == 0.0f, "row %d: %g %g", i, y[i], dx[i]);
    anneal_cpu_softmax_fwd(3, 1, x, y, true);
    anneal_cpu_softmax_bwd(3, 1, y, dy, dx, true);
    for (int i = 0; i < 3; i++) CHECK(y[i] == 0.0f && dx[i] == 0.0f, "row %d: %g %g", i, y[i], dx[i]);
}

/* Central differences of L = sum(y * R) (L in double from the float y), eps = 1e-3 on
 * every x; the error norm must be within 1e-2 of the gradient norm + 1e-4*sqrt(n),
 * and within 2e-3 elementwise. */
TEST(backward_matches_finite_differences) {
    static const int64_t shapes[][2] = {{1, 2}, {3, 37}, {2, 16}};
    for (int is_log = 0; is_log < 2; is_log++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int64_t N = shapes[s][0], C = shapes[s][1], n = N * C;
            anneal_test_rng_state = 40 + s;
            float *x = anneal_test_rand_buf(n, -3, 3), *R = anneal_test_rand_buf(n, -1, 1), *y = anneal_test_nan_buf(n);
            float *dx = anneal_test_nan_buf(n);
            anneal_cpu_softmax_fwd(N, C, x, y, is_log);
            anneal_cpu_softmax_bwd(N, C, y, R, dx, is_log);
            double err2 = 0, g2 = 0, emax = 0;
            for (int64_t i = 0; i < n; i++) {
                float x0 = x[i];
                double L[2];
                for (int k = 0; k < 2; k++) {
                    x[i] = k ? x0 - 1e-3f : x0 + 1e-3f;
                    anneal_cpu_softmax_fwd(N, C, x, y, is_log);
                    L[k] = 0;
                    for (int64_t j = 0; j < n; j++) L[k] += (double)y[j] * R[j];
                }
                double h = (double)(x0 + 1e-3f) - (double)(x0 - 1e-3f);
                x[i] = x0;
                double d = (L[0] - L[1]) / h - dx[i];
                err2 += d * d, g2 += (double)dx[i] * dx[i];
                emax = fabs(d) > emax ? fabs(d) : emax;
            }
            CHECK(sqrt(err2) <= 1e-2 * sqrt(g2) + 1e-4 * sqrt((double)n) && emax <= 2e-3,
                  "%s N=%lld C=%lld: |num-ana| = %g (max %g), |ana| = %g",
                  is_log ? "log_softmax" : "softmax", (long long)N, (long long)C, sqrt(err2), emax,
                  sqrt(g2));
            free(x), free(R), free(y), free(dx);
        }
}

/* 1 vs 2 threads: identical bits (N*C above the threading cutoff). */
TEST(deterministic_across_thread_counts) {
    enum { N = 97, C = 1001 };
    anneal_test_rng_state = 5;
    float *x = anneal_test_rand_buf(N * C, -8, 8), *dy = anneal_test_rand_buf(N * C, -1, 1);
    float *y[2] = {anneal_test_nan_buf(N * C), anneal_test_nan_buf(N * C)}, *dx[2] = {anneal_test_nan_buf(N * C), anneal_test_nan_buf(N * C)};
    int saved = omp_get_max_threads();
    for (int is_log = 0; is_log < 2; is_log++) {
        for (int t = 0; t < 2; t++) {
            omp_set_num_threads(t + 1);
            anneal_cpu_softmax_fwd(N, C, x, y[t], is_log);
            anneal_cpu_softmax_bwd(N, C, y[t], dy, dx[t], is_log);
        }
        CHECK_TRUE(memcmp(y[0], y[1], N * C * sizeof(float)) == 0);
        CHECK_TRUE(memcmp(dx[0], dx[1], N * C * sizeof(float)) == 0);
    }
    omp_set_num_threads(saved);
    free(x), free(dy), free(y[0]), free(y[1]), free(dx[0]), free(dx[1]);
}

int main(void) {
    RUN(matches_reference);
    RUN(large_magnitude_logits);
    RUN(single_column);
    RUN(backward_matches_finite_differences);
    RUN(deterministic_across_thread_counts);
    return anneal_test_summary();
}
