/* Cross-entropy kernels against a double-precision reference written here: loss, lse
 * and dlogits over vocab sizes around the 2048-logit block and V = 50257, ignored
 * rows (including all rows ignored), logits of magnitude 1e4 and -inf, a central
 * finite-difference check, and bitwise determinism across thread counts. */
#include "cpu/cpu_kernels.h"
#include "test.h"

#include <omp.h>

#define IGNORE (-100)


/* Double reference: loss, lse and dlogits = scale*(softmax - onehot) (0 when ignored). */
static void ref_ce(int64_t N, int64_t V, const float *x, const int32_t *t, float scale,
                   float *loss, float *lse, float *d) {
    for (int64_t i = 0; i < N; i++) {
        const float *r = x + i * V;
        if (t[i] == IGNORE) {
            loss[i] = 0.0f, lse[i] = 0.0f;
            for (int64_t c = 0; c < V; c++) d[i * V + c] = 0.0f;
            continue;
        }
        double m = -INFINITY, s = 0;
        for (int64_t c = 0; c < V; c++) m = r[c] > m ? r[c] : m;
        for (int64_t c = 0; c < V; c++) s += exp((double)r[c] - m);
        double l = m + log(s);
        loss[i] = (float)((m - r[t[i]]) + log(s));
        lse[i] = (float)l;
        for (int64_t c = 0; c < V; c++)
            d[i * V + c] = (float)(scale * (exp((double)r[c] - m) / s - (c == t[i] ? 1.0 : 0.0)));
    }
}

/* Runs forward and backward for one input and compares with the reference.
 * Tolerances: loss 1e-6 abs + 1e-6 rel; lse 1e-6 abs + 1e-6 rel; dlogits 1e-9*|scale|
 * abs + d_rtol rel (the kernel exponentiates x - lse with lse rounded to float, so the
 * probabilities carry a relative error of ulp(lse)/2: 3e-6 suffices for |lse| < 64). */
static void check_ce(const char *what, int64_t N, int64_t V, const float *x, const int32_t *t,
                     float scale, double d_rtol) {
    float *loss = anneal_test_nan_buf(N), *lse = anneal_test_nan_buf(N), *d = anneal_test_nan_buf(N * V);
    float *rl = anneal_test_nan_buf(N), *rlse = anneal_test_nan_buf(N), *rd = anneal_test_nan_buf(N * V);
    anneal_cpu_cross_entropy_fwd(N, V, x, t, IGNORE, loss, lse);
    anneal_cpu_cross_entropy_bwd(N, V, x, t, IGNORE, lse, scale, d);
    ref_ce(N, V, x, t, scale, rl, rlse, rd);
    int64_t w = 0;
    double r = anneal_test_close_ratio(loss, rl, N, 1e-6, 1e-6, &w);
    CHECK(r <= 1.0, "%s N=%lld V=%lld: loss[%lld] %.9g vs %.9g", what, (long long)N, (long long)V,
          (long long)w, loss[w], rl[w]);
    bool lse_ok = true;
    for (int64_t i = 0; i < N; i++)
        lse_ok = lse_ok && isfinite(lse[i]) &&
                 (t[i] == IGNORE || fabs(lse[i] - rlse[i]) <= 1e-6 + 1e-6 * fabs(rlse[i]));
    CHECK(lse_ok, "%s N=%lld V=%lld: lse mismatch", what, (long long)N, (long long)V);
    r = anneal_test_close_ratio(d, rd, N * V, 1e-9 * fabs(scale), d_rtol, &w);
    CHECK(r <= 1.0, "%s N=%lld V=%lld: dlogits[%lld] %.9g vs %.9g (ratio %g)", what, (long long)N,
          (long long)V, (long long)w, d[w], rd[w], r);
    free(loss), free(lse), free(d), free(rl), free(rlse), free(rd);
}

static int32_t *rand_targets(int64_t N, int64_t V, double p_ignore) {
    int32_t *t = malloc((size_t)N * sizeof *t);
    for (int64_t i = 0; i < N; i++)
        t[i] = anneal_test_urand(0, 1) < p_ignore ? IGNORE : (int32_t)(anneal_test_next_u64() % (uint64_t)V);
    return t;
}

/* V = 1, small V, V a multiple of / one past the 2048 block, GPT-2's 50257 at small N,
 * sizes across the threading cutoff; about a quarter of the rows ignored. */
TEST(matches_reference) {
    static const int64_t shapes[][2] = {{1, 1},    {4, 1},     {3, 7},     {5, 33},  {4, 2048},
                                        {3, 2049}, {2, 50257}, {37, 1000}, {64, 300}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t N = shapes[s][0], V = shapes[s][1];
        anneal_test_rng_state = (uint64_t)(N * 7919 + V);
        float *x = anneal_test_rand_buf(N * V, -5, 5);
        int32_t *t = rand_targets(N, V, 0.25);
        check_ce("uniform[-5,5]", N, V, x, t, 1.0f / (float)N, 3e-6);
        free(x), free(t);
    }
    anneal_test_rng_state = 1;
    float *x = anneal_test_rand_buf(6 * 5000, -30, 30);
    int32_t *t = rand_targets(6, 5000, 0.0);
    check_ce("uniform[-30,30]", 6, 5000, x, t, 2.5f, 3e-6);
    free(x), free(t);
}

/* Every row ignored: losses 0, lse finite, dlogits all zero (they start as NaN). */
TEST(all_rows_ignored) {
    enum { N = 5, V = 3000 };
    anneal_test_rng_state = 2;
    float *x = anneal_test_rand_buf(N * V, -5, 5), *d = anneal_test_nan_buf(N * V), loss[N], lse[N];
    int32_t t[N] = {IGNORE, IGNORE, IGNORE, IGNORE, IGNORE};
    anneal_cpu_cross_entropy_fwd(N, V, x, t, IGNORE, loss, lse);
    anneal_cpu_cross_entropy_bwd(N, V, x, t, IGNORE, lse, 0.2f, d);
    for (int i = 0; i < N; i++) CHECK(loss[i] == 0.0f && isfinite(lse[i]), "row %d", i);
    bool zero = true;
    for (int64_t i = 0; i < N * V; i++) zero = zero && d[i] == 0.0f;
    CHECK(zero, "dlogits of ignored rows are not all zero");
    free(x), free(d);
}

/* Logits of +-1e4 (exp of the differences underflows) give finite, correct losses; the
 * backward keeps a relative error of ulp(lse)/2 <= 5e-4 from the float lse, so its
 * tolerance here is 1e-3 relative. A target at -1e4 next to a max of 1e4 has loss
 * 2e4 + log(count of maxima). */
TEST(large_magnitude_logits) {
    enum { N = 4, V = 4099 };
    anneal_test_rng_state = 3;
    float *x = malloc(N * V * sizeof *x);
    for (int64_t i = 0; i < N * V; i++) x[i] = anneal_test_urand(0, 1) < 0.5f ? -1e4f : 1e4f;
    int32_t t[N];
    for (int i = 0; i < N; i++) t[i] = (int32_t)(anneal_test_next_u64() % V);
    x[1 * V + 5] = 3e4f; /* row 1 has one dominant logit */
    t[1] = 5;
    x[2 * V + 7] = -1e4f, t[2] = 7;
    check_ce("+-1e4", N, V, x, t, 1.0f, 1e-3);
    float loss[N], lse[N];
    anneal_cpu_cross_entropy_fwd(N, V, x, t, IGNORE, loss, lse);
    CHECK_TRUE(loss[1] == 0.0f);
    int64_t count = 0;
    for (int64_t c = 0; c < V; c++) count += x[2 * V + c] == 1e4f;
    CHECK_NEAR(loss[2], 2e4 + log((double)count), 2e-3);
    free(x);
}

/* -inf logits (masked vocabulary), including whole leading blocks of them: finite
 * loss, zero gradient on the masked entries. */
TEST(negative_infinite_logits) {
    enum { N = 3, V = 5000 };
    anneal_test_rng_state = 4;
    float *x = anneal_test_rand_buf(N * V, -5, 5);
    for (int64_t c = 0; c < 4500; c++) x[c] = -INFINITY;          /* row 0: first 2 blocks+ */
    for (int64_t c = 0; c < V; c += 3) x[V + c] = -INFINITY;      /* row 1: every third */
    int32_t t[N] = {4600, 1, 17};
    check_ce("-inf", N, V, x, t, 1.0f, 3e-6);
    free(x);
}

/* Central differences of L = scale * sum(loss) (ignored rows contribute 0), eps = 1e-3
 * on every logit, L in double from the float losses: the error norm within 1e-2 of
 * the gradient norm + 1e-4*sqrt(n) and 1e-3 elementwise. */
TEST(backward_matches_finite_differences) {
    enum { N = 4, V = 37 };
    const float scale = 0.7f;
    anneal_test_rng_state = 5;
    float *x = anneal_test_rand_buf(N * V, -3, 3), *d = anneal_test_nan_buf(N * V), loss[N], lse[N];
    int32_t t[N] = {3, IGNORE, 36, 0};
    anneal_cpu_cross_entropy_fwd(N, V, x, t, IGNORE, loss, lse);
    anneal_cpu_cross_entropy_bwd(N, V, x, t, IGNORE, lse, scale, d);
    double err2 = 0, g2 = 0, emax = 0;
    for (int64_t k = 0; k < N * V; k++) {
        float x0 = x[k];
        double Ls[2];
        for (int s = 0; s < 2; s++) {
            x[k] = s ? x0 - 1e-3f : x0 + 1e-3f;
            anneal_cpu_cross_entropy_fwd(N, V, x, t, IGNORE, loss, lse);
            Ls[s] = 0;
            for (int i = 0; i < N; i++) Ls[s] += (double)scale * loss[i];
        }
        double h = (double)(x0 + 1e-3f) - (double)(x0 - 1e-3f);
        x[k] = x0;
        double e = (Ls[0] - Ls[1]) / h - d[k];
        err2 += e * e, g2 += (double)d[k] * d[k];
        emax = fabs(e) > emax ? fabs(e) : emax;
    }
    CHECK(sqrt(err2) <= 1e-2 * sqrt(g2) + 1e-4 * sqrt((double)(N * V)) && emax <= 1e-3,
          "|num-ana| = %g (max %g), |ana| = %g", sqrt(err2), emax, sqrt(g2));
    free(x), free(d);
}

/* 1 vs 2 threads: identical bits for loss, lse and dlogits. */
TEST(deterministic_across_thread_counts) {
    enum { N = 16, V = 5003 };
    anneal_test_rng_state = 6;
    float *x = anneal_test_rand_buf(N * V, -10, 10);
    int32_t *t = rand_targets(N, V, 0.2);
    float loss[2][N], lse[2][N], *d[2] = {anneal_test_nan_buf(N * V), anneal_test_nan_buf(N * V)};
    int saved = omp_get_max_threads();
    for (int k = 0; k < 2; k++) {
        omp_set_num_threads(k + 1);
        anneal_cpu_cross_entropy_fwd(N, V, x, t, IGNORE, loss[k], lse[k]);
        anneal_cpu_cross_entropy_bwd(N, V, x, t, IGNORE, lse[k], 1.0f / N, d[k]);
    }
    omp_set_num_threads(saved);
    CHECK_TRUE(memcmp(loss[0], loss[1], sizeof loss[0]) == 0);
    CHECK_TRUE(memcmp(lse[0], lse[1], sizeof lse[0]) == 0);
    CHECK_TRUE(memcmp(d[0], d[1], N * V * sizeof(float)) == 0);
    free(x), free(t), free(d[0]), free(d[1]);
}

int main(void) {
    RUN(matches_reference);
    RUN(all_rows_ignored);
    RUN(large_magnitude_logits);
    RUN(negative_infinite_logits);
    RUN(backward_matches_finite_differences);
    RUN(deterministic_across_thread_counts);
    return anneal_test_summary();
}
