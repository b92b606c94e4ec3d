/* GELU (erf and tanh forms) and SiLU kernels against double-precision references
 * written here, central finite differences of each backward, special values, and
 * bitwise agreement between the vector loop, the scalar tail, in-place use and
 * thread counts. */
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"
#include "test.h"

#include <omp.h>

#define SQRT_2_OVER_PI 0.79788456080286535588
#define INV_SQRT_2PI 0.39894228040143267794


/* ---------------------------------------------------- double references */

static double ref_gelu_erf(double x) { return x * 0.5 * erfc(-x / sqrt(2.0)); }
static double ref_gelu_erf_d(double x) {
    return 0.5 * erfc(-x / sqrt(2.0)) + x * exp(-0.5 * x * x) * INV_SQRT_2PI;
}
/* 0.5*x*(1+tanh(u)) written as x*sigmoid(2u): the same function, exact in double
 * also where 1 + tanh(u) would cancel. */
static double ref_gelu_tanh(double x) {
    double u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    return x / (1.0 + exp(-2.0 * u));
}
static double ref_gelu_tanh_d(double x) {
    double u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    double du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
    double t = tanh(u);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
}
static double ref_silu(double x) { return x / (1.0 + exp(-x)); }
static double ref_silu_d(double x) {
    double s = 1.0 / (1.0 + exp(-x));
    return s * (1.0 + x * (1.0 - s));
}

enum { GELU_ERF, GELU_TANH, SILU, NKIND };
static const char *kind_name[NKIND] = {"gelu_erf", "gelu_tanh", "silu"};

static void fwd(int kind, int64_t n, const float *x, float *y) {
    if (kind == SILU) anneal_cpu_silu_fwd(n, x, y);
    else anneal_cpu_gelu_fwd(n, x, y, kind == GELU_TANH);
}
static void bwd(int kind, int64_t n, const float *x, const float *dy, float *dx) {
    if (kind == SILU) anneal_cpu_silu_bwd(n, x, dy, dx);
    else anneal_cpu_gelu_bwd(n, x, dy, dx, kind == GELU_TANH);
}
static double ref_f(int kind, double x) {
    return kind == GELU_ERF ? ref_gelu_erf(x) : kind == GELU_TANH ? ref_gelu_tanh(x) : ref_silu(x);
}
static double ref_d(int kind, double x) {
    return kind == GELU_ERF ? ref_gelu_erf_d(x)
         : kind == GELU_TANH ? ref_gelu_tanh_d(x) : ref_silu_d(x);
}

/* Forward tolerance, relative to the exact value: 1e-6 for the erf form and SiLU.
 * The tanh form's exponent 2u grows like x^3 and is rounded in float, so its bound
 * is 1e-6*(1+|x|) (the result's own conditioning is of that order); beyond |x| = 8 its
 * values are below 1e-20 and only an absolute 1e-20 is asked. */
static double fwd_tol(int kind, double x, double ref) {
    if (kind == GELU_TANH) return 1e-20 + 1e-6 * (1.0 + fabs(x)) * fabs(ref);
    return 1e-30 + 1e-6 * fabs(ref);
}

/* Grid over [-12, 12] (n not a multiple of 16, above the parallel threshold): forward
 * and backward (dy = 1) against the double references. Backward tolerance is
 * 1e-7*(1+|x|) absolute + 1e-6 relative: the derivatives cross zero, where only an
 * absolute bound is meaningful. */
TEST(matches_double_reference_on_grid) {
    int64_t n = 100003;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    float *dy = malloc(n * sizeof *dy), *dx = malloc(n * sizeof *dx);
    REQUIRE(x && y && dy && dx);
    for (int64_t i = 0; i < n; i++) {
        x[i] = (float)(-12.0 + 24.0 * (double)i / (double)(n - 1));
        dy[i] = 1.0f;
    }
    for (int k = 0; k < NKIND; k++) {
        fwd(k, n, x, y);
        bwd(k, n, x, dy, dx);
        int64_t bad_f = 0, bad_b = 0, first_f = -1, first_b = -1;
        for (int64_t i = 0; i < n; i++) {
            double rf = ref_f(k, x[i]), rd = ref_d(k, x[i]);
            if (!(fabs(y[i] - rf) <= fwd_tol(k, x[i], rf)) && bad_f++ == 0) first_f = i;
            if (!(fabs(dx[i] - rd) <= 1e-7 * (1.0 + fabs(x[i])) + 1e-6 * fabs(rd)) && bad_b++ == 0)
                first_b = i;
        }
        CHECK(bad_f == 0, "%s fwd: %lld bad, first x=%.9g y=%.9g ref=%.9g", kind_name[k],
              (long long)bad_f, first_f < 0 ? 0.0 : x[first_f], first_f < 0 ? 0.0 : y[first_f],
              first_f < 0 ? 0.0 : ref_f(k, x[first_f]));
        CHECK(bad_b == 0, "%s bwd: %lld bad, first x=%.9g dx=%.9g ref=%.9g", kind_name[k],
              (long long)bad_b, first_b < 0 ? 0.0 : x[first_b], first_b < 0 ? 0.0 : dx[first_b],
              first_b < 0 ? 0.0 : ref_d(k, x[first_b]));
    }
    free(x), free(y), free(dy), free(dx);
}

/* Backward = chain rule of L = sum(y * R), against central differences of the float
 * forward with eps = 1e-3 (each y_i depends on x_i only, so all x move at once).
 * Tolerances: elementwise 1e-3 abs + 1e-2 rel (float rounding of y over 2*eps is
 * ~3e-4 here), and the error norm within 1e-3 of the gradient norm. */
TEST(backward_matches_finite_differences) {
    enum { N = 1001 };
    static float x[N], xp[N], xm[N], yp[N], ym[N], r[N], dx[N], num[N];
    anneal_test_rng_state = 11;
    for (int i = 0; i < N; i++) {
        x[i] = anneal_test_urand(-5.0f, 5.0f);
        r[i] = anneal_test_urand(-1.0f, 1.0f);
        xp[i] = x[i] + 1e-3f;
        xm[i] = x[i] - 1e-3f;
    }
    for (int k = 0; k < NKIND; k++) {
        fwd(k, N, xp, yp);
        fwd(k, N, xm, ym);
        bwd(k, N, x, r, dx);
        double err2 = 0, g2 = 0;
        for (int i = 0; i < N; i++) {
            num[i] = (float)(r[i] * ((double)yp[i] - ym[i]) / ((double)xp[i] - xm[i]));
            err2 += ((double)num[i] - dx[i]) * ((double)num[i] - dx[i]);
            g2 += (double)dx[i] * dx[i];
        }
        CHECK_ALLCLOSE(dx, num, N, 1e-3, 1e-2);
        CHECK(sqrt(err2) <= 1e-3 * sqrt(g2), "%s: |num - ana| = %g, |ana| = %g", kind_name[k],
              sqrt(err2), sqrt(g2));
    }
}

/* Large magnitudes saturate cleanly (no NaN from exp overflow), infinities and NaN
 * behave like the PyTorch formulas. */
TEST(special_values) {
    enum { N = 7 };
    const float x[N] = {1e4f, -1e4f, 100.0f, -100.0f, INFINITY, NAN, -0.0f};
    const float one[N] = {1, 1, 1, 1, 1, 1, 1};
    float y[N], dx[N];
    for (int k = 0; k < NKIND; k++) {
        fwd(k, N, x, y);
        bwd(k, N, x, one, dx);
        CHECK(y[0] == 1e4f && y[2] == 100.0f, "%s: y(1e4)=%g y(100)=%g", kind_name[k], y[0], y[2]);
        CHECK(y[1] == 0.0f && y[3] == 0.0f, "%s: y(-1e4)=%g y(-100)=%g", kind_name[k], y[1], y[3]);
        CHECK(y[4] == INFINITY, "%s: y(inf)=%g", kind_name[k], y[4]);
        CHECK(isnan(y[5]) && isnan(dx[5]), "%s: NaN gave %g, %g", kind_name[k], y[5], dx[5]);
        CHECK(y[6] == 0.0f, "%s: y(-0)=%g", kind_name[k], y[6]);
        CHECK(dx[0] == 1.0f && dx[2] == 1.0f, "%s: dx(1e4)=%g dx(100)=%g", kind_name[k], dx[0],
              dx[2]);
        CHECK(dx[1] == 0.0f && dx[3] == 0.0f, "%s: dx(-1e4)=%g dx(-100)=%g", kind_name[k], dx[1],
              dx[3]);
        CHECK_NEAR(dx[6], 0.5, 1e-7);
    }
}

/* The vector body, the scalar tail (n = 1 calls), in-place use and 1 vs 2 threads
 * all give the same bits. */
TEST(bitwise_consistent_across_paths) {
    int64_t n = 70001;
    float *x = malloc(n * sizeof *x), *dy = malloc(n * sizeof *dy), *a = malloc(n * sizeof *a);
    float *b = malloc(n * sizeof *b);
    REQUIRE(x && dy && a && b);
    anneal_test_rng_state = 5;
    for (int64_t i = 0; i < n; i++) {
        x[i] = anneal_test_urand(-10.0f, 10.0f);
        dy[i] = anneal_test_urand(-2.0f, 2.0f);
    }
    int saved = omp_get_max_threads();
    for (int k = 0; k < NKIND; k++) {
        omp_set_num_threads(2);
        fwd(k, n, x, a);
        for (int64_t i = 0; i < 1000; i++) fwd(k, 1, x + i, b + i);
        CHECK(memcmp(a, b, 1000 * sizeof *a) == 0, "%s fwd: vector and scalar paths differ",
              kind_name[k]);
        memcpy(b, x, n * sizeof *b);
        fwd(k, n, b, b);
        CHECK(memcmp(a, b, n * sizeof *a) == 0, "%s fwd: in-place differs", kind_name[k]);
        omp_set_num_threads(1);
        fwd(k, n, x, b);
        CHECK(memcmp(a, b, n * sizeof *a) == 0, "%s fwd: 1 vs 2 threads differ", kind_name[k]);

        omp_set_num_threads(2);
        bwd(k, n, x, dy, a);
        for (int64_t i = 0; i < 1000; i++) bwd(k, 1, x + i, dy + i, b + i);
        CHECK(memcmp(a, b, 1000 * sizeof *a) == 0, "%s bwd: vector and scalar paths differ",
              kind_name[k]);
        omp_set_num_threads(1);
        bwd(k, n, x, dy, b);
        CHECK(memcmp(a, b, n * sizeof *a) == 0, "%s bwd: 1 vs 2 threads differ", kind_name[k]);
    }
    omp_set_num_threads(saved);
    free(x), free(dy), free(a), free(b);
}

/* The sigmoid forms take e^t for t >= -87 only (anneal_v1p_expf: no subnormal, which an
 * Intel core turns into a microcode assist): tanh-GELU forward and SiLU forward and
 * backward still give the bits of the plain formulas over anneal_vexpf, t below -87
 * included (activations up to +-300, where e^t is subnormal or 0). */
TEST(sigmoid_forms_keep_the_plain_formulas_bits) {
    enum { N = 60001 };
    float *x = malloc(N * sizeof *x), *dy = malloc(N * sizeof *dy), *y = malloc(N * sizeof *y);
    REQUIRE(x && dy && y);
    for (int64_t i = 0; i < N; i++) x[i] = -300.0f + 600.0f * (float)i / (float)(N - 1), dy[i] = 0.75f;
    int bad = 0;
    anneal_cpu_gelu_fwd(N, x, y, true);
    for (int64_t i = 0; i < N; i++) {
        volatile float u = 0.7978845608028654f * (x[i] + 0.044715f * (x[i] * x[i] * x[i]));
        volatile float e = anneal_vexpf(-2.0f * u), d = 1.0f + e, want = x[i] / d;
        bad += memcmp(&y[i], (const float *)&want, 4) != 0;
    }
    CHECK(bad == 0, "tanh-GELU forward: %d of %d differ from x / (1 + vexpf(-2u))", bad, N);
    bad = 0;
    anneal_cpu_silu_fwd(N, x, y);
    for (int64_t i = 0; i < N; i++) {
        volatile float e = anneal_vexpf(-x[i]), d = 1.0f + e, want = x[i] / d;
        bad += memcmp(&y[i], (const float *)&want, 4) != 0;
    }
    CHECK(bad == 0, "SiLU forward: %d of %d differ from x / (1 + vexpf(-x))", bad, N);
    bad = 0;
    anneal_cpu_silu_bwd(N, x, dy, y);
    for (int64_t i = 0; i < N; i++) {
        volatile float e = anneal_vexpf(-x[i]), d = 1.0f + e, sg = 1.0f / d, om = 1.0f - sg, t = x[i] * om,
                       q = 1.0f + t, r = sg * q, want = dy[i] * r;
        bad += memcmp(&y[i], (const float *)&want, 4) != 0;
    }
    CHECK(bad == 0, "SiLU backward: %d of %d differ from the plain formula", bad, N);
    free(x), free(dy), free(y);
}

/* n = 0 touches nothing. */
TEST(empty_input) {
    float y = 42.0f;
    anneal_cpu_gelu_fwd(0, NULL, &y, false);
    anneal_cpu_silu_bwd(0, NULL, NULL, &y);
    CHECK_TRUE(y == 42.0f);
}

int main(void) {
    RUN(matches_double_reference_on_grid);
    RUN(backward_matches_finite_differences);
    RUN(special_values);
    RUN(bitwise_consistent_across_paths);
    RUN(sigmoid_forms_keep_the_plain_formulas_bits);
    RUN(empty_input);
    return anneal_test_summary();
}
