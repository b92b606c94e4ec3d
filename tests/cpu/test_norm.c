/* LayerNorm and RMSNorm kernels against double-precision references written here
 * (forward values, statistics, dx, dw, db), central finite differences of every
 * gradient, NULL outputs, and bitwise determinism of dw/db across thread counts. */
#include "cpu/cpu_kernels.h"
#include "test.h"

#include <omp.h>


/* ------------------------------------------------------ double references */

typedef struct {
    float *y, *mean, *rstd, *dx, *dw, *db; /* the reference rounded to float */
} ref_out;

static void ref_free(ref_out *r) {
    free(r->y), free(r->mean), free(r->rstd), free(r->dx), free(r->dw), free(r->db);
}

/* LayerNorm (rms = false) or RMSNorm (rms = true) forward and backward in double. */
static ref_out ref_norm(bool rms, int64_t N, int64_t C, const float *x, const float *w,
                        const float *b, float eps, const float *dy) {
    ref_out o = {anneal_test_nan_buf(N * C), anneal_test_nan_buf(N), anneal_test_nan_buf(N), anneal_test_nan_buf(N * C), anneal_test_nan_buf(C), anneal_test_nan_buf(C)};
    double *dw = calloc((size_t)C, sizeof *dw), *db = calloc((size_t)C, sizeof *db);
    for (int64_t i = 0; i < N; i++) {
        const float *xr = x + i * C, *dyr = dy + i * C;
        double m = 0, v = 0;
        if (!rms) {
            for (int64_t c = 0; c < C; c++) m += xr[c];
            m /= (double)C;
        }
        for (int64_t c = 0; c < C; c++) v += (xr[c] - m) * (xr[c] - m);
        v /= (double)C;
        double r = 1.0 / sqrt(v + eps);
        double sg = 0, sgx = 0;
        for (int64_t c = 0; c < C; c++) {
            double xh = (xr[c] - m) * r, g = (double)dyr[c] * w[c];
            o.y[i * C + c] = (float)(xh * w[c] + (b && !rms ? b[c] : 0.0));
            sg += g, sgx += g * xh;
            dw[c] += dyr[c] * xh;
            db[c] += dyr[c];
        }
        for (int64_t c = 0; c < C; c++) {
            double xh = (xr[c] - m) * r, g = (double)dyr[c] * w[c];
            /* LayerNorm: rstd*(g - mean(g) - xhat*mean(g*xhat)); RMSNorm: rstd*(g - xhat*mean(g*xhat)) */
            o.dx[i * C + c] = (float)(r * (g - (rms ? 0.0 : sg / C) - xh * sgx / C));
        }
        o.mean[i] = (float)m;
        o.rstd[i] = (float)r;
    }
    for (int64_t c = 0; c < C; c++) o.dw[c] = (float)dw[c], o.db[c] = (float)db[c];
    free(dw), free(db);
    return o;
}

/* ------------------------------------------------------------ helpers */

static void fwd(bool rms, int64_t N, int64_t C, const float *x, const float *w, const float *b,
                float eps, float *y, float *mean, float *rstd) {
    if (rms) anneal_cpu_rms_norm_fwd(N, C, x, w, eps, y, rstd);
    else anneal_cpu_layer_norm_fwd(N, C, x, w, b, eps, y, mean, rstd);
}
static void bwd(bool rms, int64_t N, int64_t C, const float *x, const float *w, const float *mean,
                const float *rstd, const float *dy, float *dx, float *dw, float *db) {
    if (rms) anneal_cpu_rms_norm_bwd(N, C, x, w, rstd, dy, dx, dw);
    else anneal_cpu_layer_norm_bwd(N, C, x, w, mean, rstd, dy, dx, dw, db);
}

/* One shape against the double reference. Inputs x ~ offset + U(-2, 2), w ~ U(0.5, 1.5),
 * b, dy ~ U(-1, 1). Tolerances (abs + rel): y, dx 2e-5 + 1e-5, plus 4e-8*offset abs (the
 * float rounding of the stored mean, ulp(offset)/2); mean 1e-6 rel; rstd 2e-6 rel;
 * dw sqrt(N) times the abs part of y (xhat carries the stored mean's rounding) and
 * db 1e-5*sqrt(N), both + 1e-5 rel (double accumulation of float products). */
static void check_shape(bool rms, int64_t N, int64_t C, float offset, float eps) {
    anneal_test_rng_state = (uint64_t)(N * 1000003 + C * 7 + (rms ? 1 : 0));
    float *x = anneal_test_rand_buf(N * C, offset - 2.0f, offset + 2.0f), *w = anneal_test_rand_buf(C, 0.5f, 1.5f);
    float *b = anneal_test_rand_buf(C, -1.0f, 1.0f), *dy = anneal_test_rand_buf(N * C, -1.0f, 1.0f);
    float *y = anneal_test_nan_buf(N * C), *mean = anneal_test_nan_buf(N), *rstd = anneal_test_nan_buf(N), *dx = anneal_test_nan_buf(N * C);
    float *dw = anneal_test_nan_buf(C), *db = anneal_test_nan_buf(C);
    ref_out r = ref_norm(rms, N, C, x, w, b, eps, dy);
    fwd(rms, N, C, x, w, b, eps, y, mean, rstd);
    bwd(rms, N, C, x, w, mean, rstd, dy, dx, dw, db);
    double at = 2e-5 + 4e-8 * fabs(offset);
    const char *name = rms ? "rms" : "layer";
    int64_t worst = 0;
    double ry = anneal_test_close_ratio(y, r.y, N * C, at, 1e-5, &worst);
    CHECK(ry <= 1.0, "%s N=%lld C=%lld: y ratio %g", name, (long long)N, (long long)C, ry);
    if (!rms) CHECK_ALLCLOSE(mean, r.mean, N, 1e-6 * fabs(offset) + 1e-7, 1e-6);
    CHECK_ALLCLOSE(rstd, r.rstd, N, 0.0, 2e-6);
    double rdx = anneal_test_close_ratio(dx, r.dx, N * C, at, 1e-5, &worst);
    CHECK(rdx <= 1.0, "%s N=%lld C=%lld: dx ratio %g at %lld: %g vs %g", name, (long long)N,
          (long long)C, rdx, (long long)worst, dx[worst], r.dx[worst]);
    CHECK_ALLCLOSE(dw, r.dw, C, at * sqrt((double)N), 1e-5);
    if (!rms) CHECK_ALLCLOSE(db, r.db, C, 1e-5 * sqrt((double)N), 1e-5);
    ref_free(&r);
    free(x), free(w), free(b), free(dy), free(y), free(mean), free(rstd), free(dx), free(dw),
        free(db);
}

/* Shapes: single row, single column, C below/at/above 16 lanes, C not a multiple of
 * 16 or of the 64-column gradient block, N past the 64-row gradient chunks, sizes
 * below and above the threading cutoff. */
TEST(layer_norm_matches_reference) {
    static const int64_t shapes[][2] = {{1, 1},  {1, 7},   {3, 16},  {5, 33},
                                        {4, 1},  {37, 100}, {300, 70}, {64, 768}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        check_shape(false, shapes[s][0], shapes[s][1], 0.0f, 1e-5f);
    check_shape(false, 16, 257, 3.0f, 1e-5f);
    check_shape(false, 16, 257, 100.0f, 1e-5f); /* large row offsets: the corrected mean */
    check_shape(false, 4, 3001, 1000.0f, 1e-5f);
    check_shape(false, 8, 64, 0.0f, 0.5f);      /* eps that matters */
}

TEST(rms_norm_matches_reference) {
    static const int64_t shapes[][2] = {{1, 1},  {1, 7},   {3, 16},  {5, 33},
                                        {4, 1},  {37, 100}, {300, 70}, {64, 768}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        check_shape(true, shapes[s][0], shapes[s][1], 0.0f, 1e-6f);
    check_shape(true, 16, 257, 3.0f, 1e-6f);
    check_shape(true, 8, 64, 0.0f, 0.5f);
}

/* A constant row has variance 0: LayerNorm gives y = b exactly, a finite
 * rstd = 1/sqrt(eps) and dx = rstd*(g - mean(g)), g = dy*w. */
TEST(layer_norm_constant_row) {
    enum { C = 19 };
    float x[C], w[C], b[C], dy[C], y[C], dx[C], ref_dx[C], mean, rstd;
    anneal_test_rng_state = 3;
    double mg = 0;
    for (int c = 0; c < C; c++) {
        x[c] = 2.5f, w[c] = anneal_test_urand(0.5f, 1.5f), b[c] = anneal_test_urand(-1, 1), dy[c] = anneal_test_urand(-1, 1);
        mg += (double)dy[c] * w[c] / C;
    }
    anneal_cpu_layer_norm_fwd(1, C, x, w, b, 1e-5f, y, &mean, &rstd);
    anneal_cpu_layer_norm_bwd(1, C, x, w, &mean, &rstd, dy, dx, NULL, NULL);
    CHECK_TRUE(mean == 2.5f);
    CHECK_NEAR(rstd, 1.0 / sqrt(1e-5), 1e-3);
    CHECK(memcmp(y, b, sizeof y) == 0, "y != b");
    for (int c = 0; c < C; c++) ref_dx[c] = (float)(rstd * ((double)dy[c] * w[c] - mg));
    CHECK_ALLCLOSE(dx, ref_dx, C, 1e-4, 1e-5);
}

/* Central differences of L = sum(y * R) (R random, L in double from the float y)
 * with eps = 1e-3 on every element of x, w and b; each analytic gradient must match
 * within 1e-2 of its norm + 1e-4*sqrt(n) (L2 of the difference; the absolute part
 * covers gradients that are ~0, e.g. RMSNorm with C = 1) and 5e-3 elementwise. The
 * float forward limits the differences to ~1e-3 relative here. */
static double loss(bool rms, int64_t N, int64_t C, const float *x, const float *w, const float *b,
                   const float *R, float *y, float *mean, float *rstd) {
    fwd(rms, N, C, x, w, b, 1e-5f, y, mean, rstd);
    double L = 0;
    for (int64_t i = 0; i < N * C; i++) L += (double)y[i] * R[i];
    return L;
}

static void check_fd(const char *what, float *v, int64_t n, const float *ana, bool rms, int64_t N,
                     int64_t C, float *x, float *w, float *b, const float *R, float *y,
                     float *mean, float *rstd) {
    double err2 = 0, g2 = 0, emax = 0;
    for (int64_t i = 0; i < n; i++) {
        float v0 = v[i];
        v[i] = v0 + 1e-3f;
        double h = v[i];
        double lp = loss(rms, N, C, x, w, b, R, y, mean, rstd);
        v[i] = v0 - 1e-3f;
        h -= v[i];
        double lm = loss(rms, N, C, x, w, b, R, y, mean, rstd);
        v[i] = v0;
        double num = (lp - lm) / h, d = num - ana[i];
        err2 += d * d, g2 += (double)ana[i] * ana[i];
        emax = fabs(d) > emax ? fabs(d) : emax;
    }
    CHECK(sqrt(err2) <= 1e-2 * sqrt(g2) + 1e-4 * sqrt((double)n) && emax <= 5e-3,
          "%s %s N=%lld C=%lld: |num-ana| = %g (max %g), |ana| = %g", rms ? "rms" : "layer", what,
          (long long)N, (long long)C, sqrt(err2), emax, sqrt(g2));
}

TEST(backward_matches_finite_differences) {
    static const int64_t shapes[][2] = {{1, 1}, {1, 5}, {3, 37}, {6, 16}};
    for (int rms = 0; rms < 2; rms++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int64_t N = shapes[s][0], C = shapes[s][1];
            anneal_test_rng_state = (uint64_t)(77 + s);
            float *x = anneal_test_rand_buf(N * C, -2.0f, 2.0f), *w = anneal_test_rand_buf(C, 0.5f, 1.5f);
            float *b = anneal_test_rand_buf(C, -1.0f, 1.0f), *R = anneal_test_rand_buf(N * C, -1.0f, 1.0f);
            float *y = anneal_test_nan_buf(N * C), *mean = anneal_test_nan_buf(N), *rstd = anneal_test_nan_buf(N);
            float *dx = anneal_test_nan_buf(N * C), *dw = anneal_test_nan_buf(C), *db = anneal_test_nan_buf(C);
            loss(rms, N, C, x, w, b, R, y, mean, rstd);
            bwd(rms, N, C, x, w, mean, rstd, R, dx, dw, db);
            check_fd("dx", x, N * C, dx, rms, N, C, x, w, b, R, y, mean, rstd);
            check_fd("dw", w, C, dw, rms, N, C, x, w, b, R, y, mean, rstd);
            if (!rms) check_fd("db", b, C, db, rms, N, C, x, w, b, R, y, mean, rstd);
            free(x), free(w), free(b), free(R), free(y), free(mean), free(rstd), free(dx),
                free(dw), free(db);
        }
}

/* Optional outputs: b = NULL is b = 0; dx/dw/db = NULL leave the others unchanged;
 * N = 0 still overwrites dw and db with zeros. */
TEST(optional_outputs) {
    enum { N = 9, C = 45 };
    anneal_test_rng_state = 21;
    float *x = anneal_test_rand_buf(N * C, -2, 2), *w = anneal_test_rand_buf(C, 0.5f, 1.5f), *dy = anneal_test_rand_buf(N * C, -1, 1);
    float zero_b[C] = {0}, y1[N * C], y2[N * C], mean[N], rstd[N];
    anneal_cpu_layer_norm_fwd(N, C, x, w, zero_b, 1e-5f, y1, mean, rstd);
    anneal_cpu_layer_norm_fwd(N, C, x, w, NULL, 1e-5f, y2, mean, rstd);
    CHECK(memcmp(y1, y2, sizeof y1) == 0, "b = NULL differs from b = 0");

    float dx1[N * C], dw1[C], db1[C], dx2[N * C], dw2[C], db2[C];
    anneal_cpu_layer_norm_bwd(N, C, x, w, mean, rstd, dy, dx1, dw1, db1);
    anneal_cpu_layer_norm_bwd(N, C, x, w, mean, rstd, dy, dx2, NULL, NULL);
    anneal_cpu_layer_norm_bwd(N, C, x, w, mean, rstd, dy, NULL, dw2, NULL);
    anneal_cpu_layer_norm_bwd(N, C, x, w, mean, rstd, dy, NULL, NULL, db2);
    CHECK_TRUE(memcmp(dx1, dx2, sizeof dx1) == 0);
    CHECK_TRUE(memcmp(dw1, dw2, sizeof dw1) == 0);
    CHECK_TRUE(memcmp(db1, db2, sizeof db1) == 0);

    anneal_cpu_rms_norm_fwd(N, C, x, w, 1e-6f, y1, rstd);
    anneal_cpu_rms_norm_bwd(N, C, x, w, rstd, dy, dx1, dw1);
    anneal_cpu_rms_norm_bwd(N, C, x, w, rstd, dy, dx2, NULL);
    anneal_cpu_rms_norm_bwd(N, C, x, w, rstd, dy, NULL, dw2);
    CHECK_TRUE(memcmp(dx1, dx2, sizeof dx1) == 0);
    CHECK_TRUE(memcmp(dw1, dw2, sizeof dw1) == 0);

    float *dw0 = anneal_test_nan_buf(C), *db0 = anneal_test_nan_buf(C), zero[C] = {0};
    anneal_cpu_layer_norm_bwd(0, C, x, w, mean, rstd, dy, NULL, dw0, db0);
    CHECK_TRUE(memcmp(dw0, zero, sizeof zero) == 0);
    CHECK_TRUE(memcmp(db0, zero, sizeof zero) == 0);
    free(x), free(w), free(dy), free(dw0), free(db0);
}

/* 1 vs 2 threads give the same bits for y, stats, dx, dw and db (N*C above the
 * threading cutoff, C not a multiple of the column block). */
TEST(deterministic_across_thread_counts) {
    enum { N = 2049, C = 83 };
    anneal_test_rng_state = 99;
    float *x = anneal_test_rand_buf(N * C, -3, 3), *w = anneal_test_rand_buf(C, 0.5f, 1.5f), *b = anneal_test_rand_buf(C, -1, 1);
    float *dy = anneal_test_rand_buf(N * C, -1, 1);
    float *y[2], *mean[2], *rstd[2], *dx[2], *dw[2], *db[2];
    int saved = omp_get_max_threads();
    for (int rms = 0; rms < 2; rms++) {
        for (int t = 0; t < 2; t++) {
            y[t] = anneal_test_nan_buf(N * C), mean[t] = anneal_test_nan_buf(N), rstd[t] = anneal_test_nan_buf(N);
            dx[t] = anneal_test_nan_buf(N * C), dw[t] = anneal_test_nan_buf(C), db[t] = anneal_test_nan_buf(C);
            omp_set_num_threads(t + 1);
            fwd(rms, N, C, x, w, b, 1e-5f, y[t], mean[t], rstd[t]);
            bwd(rms, N, C, x, w, mean[t], rstd[t], dy, dx[t], dw[t], db[t]);
        }
        CHECK_TRUE(memcmp(y[0], y[1], N * C * sizeof(float)) == 0);
        CHECK_TRUE(memcmp(rstd[0], rstd[1], N * sizeof(float)) == 0);
        CHECK_TRUE(memcmp(dx[0], dx[1], N * C * sizeof(float)) == 0);
        CHECK(memcmp(dw[0], dw[1], C * sizeof(float)) == 0, "%s dw differs", rms ? "rms" : "ln");
        if (!rms) {
            CHECK_TRUE(memcmp(mean[0], mean[1], N * sizeof(float)) == 0);
            CHECK(memcmp(db[0], db[1], C * sizeof(float)) == 0, "db differs");
        }
        for (int t = 0; t < 2; t++)
            free(y[t]), free(mean[t]), free(rstd[t]), free(dx[t]), free(dw[t]), free(db[t]);
    }
    omp_set_num_threads(saved);
    free(x), free(w), free(b), free(dy);
}

int main(void) {
    RUN(layer_norm_matches_reference);
    RUN(rms_norm_matches_reference);
    RUN(layer_norm_constant_row);
    RUN(backward_matches_finite_differences);
    RUN(optional_outputs);
    RUN(deterministic_across_thread_counts);
    return anneal_test_summary();
}
