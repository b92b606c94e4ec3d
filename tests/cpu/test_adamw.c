/* AdamW step and sum of squares. AdamW runs several steps against (1) a double
 * reference of the same update and (2) a scalar float replica of PyTorch 1.13's
 * op sequence, which it must match bit for bit; weight decay 0 and non-zero,
 * assorted gradient scales, odd sizes, thread counts. Sum of squares against a
 * long double sum, bitwise the same for 1 and 2 threads. */
#include "cpu/cpu_kernels.h"
#include "test.h"

#include <omp.h>

/* Gradients spanning 1e-6 .. 10 in magnitude, both signs, some exact zeros. */
static float rand_grad(void) {
    float mag = powf(10.0f, anneal_test_urand(-6.0f, 1.0f));
    float u = anneal_test_urand(0, 1);
    return u < 0.02f ? 0.0f : (u < 0.51f ? -mag : mag);
}

typedef struct {
    double lr, beta1, beta2, eps, wd; /* as a Python config would hold them */
} hparams;

/* (1) The AdamW update in double, the state kept in double. m_abs is m's recurrence
 * on |g|: the scale of m's rounding error when gradient signs cancel. */
static void ref_step_double(int64_t n, double *p, const float *g, double *m, double *v,
                            double *m_abs, hparams h, int t) {
    double bc1 = 1.0 - pow(h.beta1, t), bc2 = 1.0 - pow(h.beta2, t);
    for (int64_t i = 0; i < n; i++) {
        p[i] *= 1.0 - h.lr * h.wd;
        m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
        m_abs[i] = h.beta1 * m_abs[i] + (1.0 - h.beta1) * fabs(g[i]);
        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * (double)g[i] * g[i];
        p[i] -= h.lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + h.eps);
    }
}

/* (2) PyTorch 1.13 _single_tensor_adamw, one tensor op at a time, each rounded to
 * float as its CPU kernel does (Python scalars are doubles narrowed to float; add_
 * with alpha and addcmul_ end in a fused multiply-add on AVX2/AVX-512 builds). */
static void ref_step_torch(int64_t n, float *p, const float *g, float *m, float *v, hparams h,
                           int t) {
    double bc1 = 1.0 - pow(h.beta1, t), bc2 = 1.0 - pow(h.beta2, t);
    float decay = (float)(1.0 - h.lr * h.wd), b1 = (float)h.beta1, b2 = (float)h.beta2;
    float a1 = (float)(1.0 - h.beta1), a2 = (float)(1.0 - h.beta2);
    float bc2s = (float)sqrt(bc2), eps = (float)h.eps, neg_step = (float)-(h.lr / bc1);
    for (int64_t i = 0; i < n; i++) {
        p[i] = p[i] * decay;                             /* param.mul_(1 - lr*wd) */
        m[i] = fmaf(g[i], a1, m[i] * b1);                /* exp_avg.mul_(b1).add_(g, alpha) */
        v[i] = fmaf(a2 * g[i], g[i], v[i] * b2);         /* exp_avg_sq.mul_(b2).addcmul_ */
        float denom = sqrtf(v[i]) / bc2s + eps;          /* (sqrt() / bc2_sqrt).add_(eps) */
        p[i] = p[i] + neg_step * m[i] / denom;           /* addcdiv_(m, denom, -step) */
    }
}

/* Distance in units in the last place between two finite floats of the same sign. */
static int64_t ulp_diff(float a, float b) {
    int32_t ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    return ia > ib ? (int64_t)ia - ib : (int64_t)ib - ia;
}

/* Runs `steps` steps of the kernel and both references on n parameters.
 * Against the PyTorch replica: m and v identical bits; p within max_ulp ulps (the
 * kernel gets PyTorch's double hyperparameters and bias corrections, so 0 is expected).
 * Against the double reference: p 2e-6 abs + 1e-6 rel, m 1e-6 * m_abs, v 1e-6 rel
 * (a few float roundings per step). */
static void check_run(int64_t n, int steps, hparams h, int64_t max_ulp) {
    anneal_test_rng_state = (uint64_t)n * 13 + (uint64_t)(h.wd * 1000);
    float *p = malloc(n * sizeof *p), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
    float *g = malloc(n * sizeof *g), *tp = malloc(n * sizeof *tp), *tm = calloc(n, sizeof *tm);
    float *tv = calloc(n, sizeof *tv), *f = malloc(n * sizeof *f);
    double *dp = malloc(n * sizeof *dp), *dm = calloc(n, sizeof *dm), *dv = calloc(n, sizeof *dv);
    double *dma = calloc(n, sizeof *dma);
    for (int64_t i = 0; i < n; i++) tp[i] = p[i] = anneal_test_urand(-2, 2), dp[i] = p[i];
    for (int t = 1; t <= steps; t++) {
        for (int64_t i = 0; i < n; i++) g[i] = rand_grad();
        double bc1 = 1.0 - pow(h.beta1, t), bc2 = 1.0 - pow(h.beta2, t);
        anneal_cpu_adamw(n, p, g, m, v, h.lr, h.beta1, h.beta2, h.eps, h.wd, bc1, bc2);
        ref_step_torch(n, tp, g, tm, tv, h, t);
        ref_step_double(n, dp, g, dm, dv, dma, h, t);
    }
    int64_t worst_ulp = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t u = ulp_diff(p[i], tp[i]);
        worst_ulp = u > worst_ulp ? u : worst_ulp;
    }
    CHECK(worst_ulp <= max_ulp, "n=%lld wd=%g steps=%d: p is %lld ulp from the torch replica",
          (long long)n, h.wd, steps, (long long)worst_ulp);
    CHECK(memcmp(m, tm, n * sizeof *m) == 0, "n=%lld: m differs from the torch replica",
          (long long)n);
    CHECK(memcmp(v, tv, n * sizeof *v) == 0, "n=%lld: v differs from the torch replica",
          (long long)n);
    for (int64_t i = 0; i < n; i++) f[i] = (float)dp[i];
    CHECK_ALLCLOSE(p, f, n, 2e-6, 1e-6);
    int64_t bad_m = 0;
    for (int64_t i = 0; i < n; i++) bad_m += !(fabs(m[i] - dm[i]) <= 1e-6 * dma[i] + 1e-30);
    CHECK(bad_m == 0, "n=%lld: %lld m values off the double reference", (long long)n,
          (long long)bad_m);
    for (int64_t i = 0; i < n; i++) f[i] = (float)dv[i];
    CHECK_ALLCLOSE(v, f, n, 1e-30, 1e-6);
    free(p), free(m), free(v), free(g), free(tp), free(tm), free(tv), free(f), free(dp),
        free(dm), free(dv), free(dma);
}

/* Typical GPT-2 and Llama settings, weight decay 0 and non-zero; n = 1, around the
 * 16-lane / 64-element inner pieces, and above the threading cutoff. */
TEST(matches_references) {
    static const int64_t sizes[] = {1, 3, 63, 64, 65, 1000, 40001};
    hparams gpt = {6e-4, 0.9, 0.95, 1e-8, 0.1}, nowd = {1e-3, 0.9, 0.999, 1e-8, 0.0};
    hparams big = {0.01, 0.8, 0.99, 1e-6, 0.5};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        check_run(sizes[k], 7, gpt, 0);
        check_run(sizes[k], 7, nowd, 0);
    }
    check_run(40001, 30, gpt, 0);
    check_run(777, 25, big, 0);
}

/* A zero gradient from a zero state leaves p = p*(1 - lr*wd) exactly (the update is
 * 0/eps = 0); n = 0 touches nothing. */
TEST(zero_gradient_and_empty) {
    enum { N = 33 };
    float p[N], g[N] = {0}, m[N] = {0}, v[N] = {0}, want[N];
    anneal_test_rng_state = 4;
    for (int i = 0; i < N; i++) p[i] = anneal_test_urand(-1, 1), want[i] = p[i] * (float)(1.0 - 1e-3 * 0.1);
    anneal_cpu_adamw(N, p, g, m, v, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f);
    CHECK(memcmp(p, want, sizeof p) == 0, "p != p*(1 - lr*wd)");
    float one = 1.0f;
    anneal_cpu_adamw(0, &one, NULL, NULL, NULL, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f);
    CHECK_TRUE(one == 1.0f);
}

/* 1 vs 2 threads: identical p, m, v. */
TEST(adamw_deterministic_across_thread_counts) {
    enum { N = 100003 };
    float *p[2], *m[2], *v[2], *g = malloc(N * sizeof *g);
    anneal_test_rng_state = 6;
    for (int i = 0; i < N; i++) g[i] = rand_grad();
    int saved = omp_get_max_threads();
    for (int k = 0; k < 2; k++) {
        p[k] = malloc(N * sizeof(float)), m[k] = calloc(N, sizeof(float));
        v[k] = calloc(N, sizeof(float));
        for (int i = 0; i < N; i++) p[k][i] = (float)i / N;
        omp_set_num_threads(k + 1);
        for (int t = 1; t <= 3; t++)
            anneal_cpu_adamw(N, p[k], g, m[k], v[k], 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                             (float)(1 - pow(0.9, t)), (float)(1 - pow(0.95, t)));
    }
    omp_set_num_threads(saved);
    CHECK_TRUE(memcmp(p[0], p[1], N * sizeof(float)) == 0);
    CHECK_TRUE(memcmp(m[0], m[1], N * sizeof(float)) == 0);
    CHECK_TRUE(memcmp(v[0], v[1], N * sizeof(float)) == 0);
    for (int k = 0; k < 2; k++) free(p[k]), free(m[k]), free(v[k]);
    free(g);
}

/* Sum of squares vs a long double sum (relative 1e-12: double accumulation of exact
 * float squares), for n = 0, 1, odd sizes, one past a 65536 chunk, and beyond
 * 256 * 65536 where the chunk size grows with n; bitwise equal for 1 and 2 threads. */
TEST(sum_squares_matches_reference) {
    static const int64_t sizes[] = {0, 1, 7, 17, 65536, 65537, 1000003, 17000001};
    int saved = omp_get_max_threads();
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int64_t n = sizes[k];
        float *x = malloc((size_t)(n > 0 ? n : 1) * sizeof *x);
        anneal_test_rng_state = 100 + k;
        long double ref = 0;
        for (int64_t i = 0; i < n; i++) {
            x[i] = anneal_test_urand(-3, 3);
            ref += (long double)x[i] * x[i];
        }
        omp_set_num_threads(2);
        double s2 = anneal_cpu_sum_squares(n, x);
        omp_set_num_threads(1);
        double s1 = anneal_cpu_sum_squares(n, x);
        CHECK(fabs(s2 - (double)ref) <= 1e-12 * (double)ref, "n=%lld: %.17g vs %.17Lg",
              (long long)n, s2, ref);
        CHECK(memcmp(&s1, &s2, sizeof s1) == 0, "n=%lld: 1 vs 2 threads %.17g vs %.17g",
              (long long)n, s1, s2);
        free(x);
    }
    omp_set_num_threads(saved);
    float big[3] = {1e20f, -1e20f, 3.0f}; /* squares beyond float range stay finite in double */
    CHECK_NEAR(anneal_cpu_sum_squares(3, big), 2.0 * (double)big[0] * (double)big[0] + 9.0, 1e26);
}

int main(void) {
    RUN(matches_references);
    RUN(zero_gradient_and_empty);
    RUN(adamw_deterministic_across_thread_counts);
    RUN(sum_squares_matches_reference);
    return anneal_test_summary();
}
