/* LayerNorm and RMSNorm ops: values against naive double-precision loops, gradients
 * of x, weight and bias against finite differences (contiguous, transposed and 3-D
 * x; optional weight/bias left out), and the shape/dtype error paths. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

/* Reference LayerNorm / RMSNorm of row-major x (N, C) in double; w/b may be NULL. */
static void ref_norm(bool rms, int64_t N, int64_t C, const float *x, const float *w, const float *b,
                     double eps, double *y) {
    for (int64_t i = 0; i < N; i++) {
        const float *r = x + i * C;
        double mean = 0, var = 0;
        if (!rms) {
            for (int64_t c = 0; c < C; c++) mean += r[c];
            mean /= (double)C;
        }
        for (int64_t c = 0; c < C; c++) var += (r[c] - mean) * (r[c] - mean);
        var /= (double)C;
        double rstd = 1.0 / sqrt(var + eps);
        for (int64_t c = 0; c < C; c++)
            y[i * C + c] = (r[c] - mean) * rstd * (w ? w[c] : 1.0) + (b ? b[c] : 0.0);
    }
}

/* Compares op output y (any layout) with the reference on x's row-major values. */
static void check_norm_values(bool rms, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                              float eps, double tol) {
    int64_t n = anneal_numel(x), C = x->shape[x->ndim - 1];
    float *xv = malloc((size_t)n * sizeof *xv), *wv = NULL, *bv = NULL;
    double *ref = malloc((size_t)n * sizeof *ref);
    anneal_to_f32_buffer(x, xv);
    if (w) anneal_to_f32_buffer(w, wv = malloc((size_t)C * sizeof *wv));
    if (b) anneal_to_f32_buffer(b, bv = malloc((size_t)C * sizeof *bv));
    ref_norm(rms, n / C, C, xv, wv, bv, eps, ref);
    anneal_tensor *y = rms ? anneal_rms_norm(x, w, eps) : anneal_layer_norm(x, w, b, eps);
    CHECK(y != NULL, "norm failed: %s", anneal_last_error());
    if (y) {
        CHECK_TRUE(anneal_same_shape(y, x));
        /* f32 kernel vs double reference on O(1) outputs: tol absolute + relative. */
        float *yv = malloc((size_t)n * sizeof *yv), *rf = malloc((size_t)n * sizeof *rf);
        anneal_to_f32_buffer(y, yv);
        for (int64_t i = 0; i < n; i++) rf[i] = (float)ref[i];
        CHECK_ALLCLOSE(yv, rf, n, tol, tol);
        free(yv);
        free(rf);
    }
    free(xv);
    free(wv);
    free(bv);
    free(ref);
}

TEST(layer_norm_values) {
    anneal_scope *s = anneal_scope_open();
    int64_t C = 37; /* not a multiple of the kernel's 16 lanes */
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){5, C}, -2, 3, 1, false);
    anneal_tensor *w = anneal_test_rand(1, &C, 0.5f, 1.5f, 2, false);
    anneal_tensor *b = anneal_test_rand(1, &C, -1, 1, 3, false);
    check_norm_values(false, x, w, b, 1e-5f, 2e-5);
    check_norm_values(false, x, w, NULL, 1e-5f, 2e-5);
    check_norm_values(false, x, NULL, b, 1e-5f, 2e-5);
    check_norm_values(false, x, NULL, NULL, 1e-5f, 2e-5);
    /* 3-D x and a transposed (non-contiguous) x */
    anneal_tensor *x3 = anneal_test_rand(3, (int64_t[]){2, 3, C}, -1, 1, 4, false);
    check_norm_values(false, x3, w, b, 1e-5f, 2e-5);
    anneal_tensor *xt = anneal_transpose(anneal_test_rand(2, (int64_t[]){C, 6}, -1, 1, 5, false), 0, 1);
    REQUIRE(xt && !anneal_is_contiguous(xt));
    check_norm_values(false, xt, w, b, 1e-5f, 2e-5);
    /* A large common offset (mean 1000) must not destroy the variance. The f32 mean
     * alone is off by up to half an ulp of 1000 (3e-5), times rstd ~1.7: tolerance 2e-4
     * (a naive one-pass E[x^2]-E[x]^2 would be off by O(1)). */
    anneal_tensor *xo = anneal_add_scalar(anneal_test_rand(2, (int64_t[]){4, C}, -1, 1, 6, false), 1000.0f);
    check_norm_values(false, xo, w, b, 1e-5f, 2e-4);
    anneal_scope_close(s);
}

TEST(rms_norm_values) {
    anneal_scope *s = anneal_scope_open();
    int64_t C = 40;
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){6, C}, -2, 2, 7, false);
    anneal_tensor *w = anneal_test_rand(1, &C, 0.5f, 1.5f, 8, false);
    check_norm_values(true, x, w, NULL, 1e-6f, 2e-5);
    check_norm_values(true, x, NULL, NULL, 1e-6f, 2e-5);
    anneal_tensor *x3 = anneal_test_rand(3, (int64_t[]){3, 2, C}, -1, 1, 9, false);
    check_norm_values(true, x3, w, NULL, 1e-5f, 2e-5);
    anneal_tensor *xt = anneal_transpose(anneal_test_rand(2, (int64_t[]){C, 5}, -1, 1, 10, false), 0, 1);
    check_norm_values(true, xt, w, NULL, 1e-5f, 2e-5);
    anneal_scope_close(s);
}

/* inputs: x, w, b; ctx selects the variant. */
typedef struct norm_case {
    bool rms, transpose_x, use_w, use_b;
} norm_case;

static anneal_tensor *f_norm(void *ctx, anneal_tensor *const *in) {
    const norm_case *c = ctx;
    anneal_tensor *x = c->transpose_x ? anneal_transpose(in[0], 0, 1) : in[0];
    anneal_tensor *w = c->use_w ? in[1] : NULL, *b = c->use_b ? in[2] : NULL;
    return c->rms ? anneal_rms_norm(x, w, 1e-5f) : anneal_layer_norm(x, w, b, 1e-5f);
}

/* Gradient tolerances: f32 central differences with eps 1e-2 on outputs of O(1):
 * atol 2e-3, rtol 1e-2 (the truncation error of a normalisation is O(eps^2 / var)). */
static void grad_cases(bool rms) {
    int64_t C = 19;
    norm_case cases[] = {
        {rms, false, true, true},  {rms, true, true, true},  {rms, false, false, true},
        {rms, false, true, false}, {rms, false, false, false},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        norm_case *c = &cases[k];
        anneal_tensor *x = c->transpose_x ? anneal_test_rand(2, (int64_t[]){C, 4}, -2, 2, 20 + k, true)
                                          : anneal_test_rand(2, (int64_t[]){4, C}, -2, 2, 20 + k, true);
        anneal_tensor *in[3] = {x, anneal_test_rand(1, &C, 0.5f, 1.5f, 30 + k, c->use_w),
                                anneal_test_rand(1, &C, -1, 1, 40 + k, c->use_b && !rms)};
        /* tolerance was atol 2e-3 rtol 1e-2; worst measured 1.4% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_norm, c, 3, in, 1e-2, 4e-4, 2e-3);
    }
    /* 3-D x */
    norm_case c3 = {rms, false, true, true};
    anneal_tensor *in3[3] = {anneal_test_rand(3, (int64_t[]){2, 3, C}, -2, 2, 50, true),
                             anneal_test_rand(1, &C, 0.5f, 1.5f, 51, true),
                             anneal_test_rand(1, &C, -1, 1, 52, !rms)};
    /* tolerance was atol 2e-3 rtol 1e-2; worst measured 1% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_norm, &c3, 3, in3, 1e-2, 4e-4, 2e-3);
    /* only the parameters want gradients (x constant): dx is not requested */
    anneal_tensor *inp[3] = {anneal_test_rand(2, (int64_t[]){5, C}, -2, 2, 60, false),
                             anneal_test_rand(1, &C, 0.5f, 1.5f, 61, true),
                             anneal_test_rand(1, &C, -1, 1, 62, !rms)};
    /* tolerance was atol 2e-3 rtol 1e-2; worst measured 0.062% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_norm, &c3, 3, inp, 1e-2, 2e-5, 1e-4);
    /* only x wants a gradient */
    anneal_tensor *inx[3] = {anneal_test_rand(2, (int64_t[]){5, C}, -2, 2, 70, true),
                             anneal_test_rand(1, &C, 0.5f, 1.5f, 71, false),
                             anneal_test_rand(1, &C, -1, 1, 72, false)};
    /* tolerance was atol 2e-3 rtol 1e-2; worst measured 1.4% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_norm, &c3, 3, inx, 1e-2, 4e-4, 2e-3);
}

TEST(layer_norm_gradients) {
    anneal_scope *s = anneal_scope_open();
    grad_cases(false);
    anneal_scope_close(s);
}

TEST(rms_norm_gradients) {
    anneal_scope *s = anneal_scope_open();
    grad_cases(true);
    anneal_scope_close(s);
}

/* Wide rows (C = 300 spans several 32-column parameter blocks): with loss = sum(y^2),
 * dy = 2y and dw, db must equal the double sums over rows of dy * xhat and dy. */
TEST(layer_norm_param_grads_wide) {
    anneal_scope *s = anneal_scope_open();
    int64_t N = 9, C = 300;
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){N, C}, -3, 3, 80, true);
    anneal_tensor *w = anneal_test_rand(1, &C, 0.5f, 1.5f, 81, true);
    anneal_tensor *b = anneal_test_rand(1, &C, -1, 1, 82, true);
    anneal_tensor *y = anneal_layer_norm(x, w, b, 1e-5f);
    anneal_tensor *loss = anneal_sum(anneal_mul(y, y)); /* dy = 2y */
    REQUIRE(loss && anneal_backward(loss) == ANNEAL_OK);
    float *xv = malloc((size_t)(N * C) * sizeof *xv), *wv = malloc((size_t)C * sizeof *wv),
          *bv = malloc((size_t)C * sizeof *bv);
    anneal_to_f32_buffer(x, xv);
    anneal_to_f32_buffer(w, wv);
    anneal_to_f32_buffer(b, bv);
    double *xhat = malloc((size_t)(N * C) * sizeof *xhat);
    ref_norm(false, N, C, xv, NULL, NULL, 1e-5, xhat);
    float *dw = malloc((size_t)C * sizeof *dw), *db = malloc((size_t)C * sizeof *db),
          *gw = malloc((size_t)C * sizeof *gw), *gb = malloc((size_t)C * sizeof *gb);
    for (int64_t c = 0; c < C; c++) {
        double sw = 0, sb = 0;
        for (int64_t i = 0; i < N; i++) {
            double dy = 2.0 * (xhat[i * C + c] * wv[c] + bv[c]);
            sw += dy * xhat[i * C + c];
            sb += dy;
        }
        dw[c] = (float)sw;
        db[c] = (float)sb;
    }
    anneal_to_f32_buffer(w->grad, gw);
    anneal_to_f32_buffer(b->grad, gb);
    /* sums of 9 terms of O(1): 1e-4 absolute + relative */
    CHECK_ALLCLOSE(gw, dw, C, 1e-4, 1e-4);
    CHECK_ALLCLOSE(gb, db, C, 1e-4, 1e-4);
    free(xv); free(wv); free(bv); free(xhat); free(dw); free(db); free(gw); free(gb);
    anneal_scope_close(s);
}

TEST(norm_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){3, 4});
    anneal_tensor *w5 = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){5});
    anneal_tensor *w4 = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){4});
    anneal_tensor *w2d = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){1, 4});
    anneal_tensor *wi = anneal_zeros(ANNEAL_I32, 1, (int64_t[]){4});
    anneal_tensor *xi = anneal_zeros(ANNEAL_I32, 2, (int64_t[]){3, 4});
    anneal_clear_error();
    CHECK_TRUE(anneal_layer_norm(x, w5, NULL, 1e-5f) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_SHAPE);
    CHECK(strstr(anneal_last_error(), "weight") && strstr(anneal_last_error(), "(5)"), "message: %s",
          anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_layer_norm(x, w4, w5, 1e-5f) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    CHECK(strstr(anneal_last_error(), "bias") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_layer_norm(x, w2d, NULL, 1e-5f) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_rms_norm(x, w5, 1e-5f) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    CHECK(strstr(anneal_last_error(), "rms_norm") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_layer_norm(xi, w4, NULL, 1e-5f) == NULL && anneal_last_status() == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_rms_norm(x, wi, 1e-5f) == NULL && anneal_last_status() == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_layer_norm(anneal_scalar(1.0f), NULL, NULL, 1e-5f) == NULL &&
               anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    /* a NULL x (an earlier failure) gives NULL */
    CHECK_TRUE(anneal_layer_norm(NULL, w4, NULL, 1e-5f) == NULL);
    CHECK_TRUE(anneal_rms_norm(NULL, NULL, 1e-5f) == NULL);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(layer_norm_values);
    RUN(rms_norm_values);
    RUN(layer_norm_gradients);
    RUN(rms_norm_gradients);
    RUN(layer_norm_param_grads_wide);
    RUN(norm_errors);
    return anneal_test_summary();
}
