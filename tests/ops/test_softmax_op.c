/* Softmax and log-softmax ops over the last dim: values against naive double loops
 * (including huge logits, transposed and 3-D inputs), finite-difference gradients,
 * and the dtype error path. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

/* Reference (log-)softmax of row-major x (N, C) in double. */
static void ref_softmax(int64_t N, int64_t C, const float *x, bool is_log, double *y) {
    for (int64_t i = 0; i < N; i++) {
        const float *r = x + i * C;
        double m = -INFINITY, s = 0;
        for (int64_t c = 0; c < C; c++) m = r[c] > m ? r[c] : m;
        for (int64_t c = 0; c < C; c++) s += exp(r[c] - m);
        for (int64_t c = 0; c < C; c++)
            y[i * C + c] = is_log ? (r[c] - m) - log(s) : exp(r[c] - m) / s;
    }
}

/* Checks anneal_(log_)softmax(x) against the reference within tol (abs + rel). */
static void check_values(anneal_tensor *x, bool is_log, double tol) {
    int64_t n = anneal_numel(x), C = x->ndim ? x->shape[x->ndim - 1] : 1;
    float *xv = malloc((size_t)n * sizeof *xv), *yv = malloc((size_t)n * sizeof *yv),
          *rf = malloc((size_t)n * sizeof *rf);
    double *ref = malloc((size_t)n * sizeof *ref);
    anneal_to_f32_buffer(x, xv);
    ref_softmax(n / C, C, xv, is_log, ref);
    for (int64_t i = 0; i < n; i++) rf[i] = (float)ref[i];
    anneal_tensor *y = is_log ? anneal_log_softmax(x) : anneal_softmax(x);
    CHECK(y != NULL, "softmax failed: %s", anneal_last_error());
    if (y) {
        CHECK_TRUE(anneal_same_shape(y, x));
        anneal_to_f32_buffer(y, yv);
        bool finite = true;
        for (int64_t i = 0; i < n; i++) finite &= isfinite(yv[i]) != 0;
        CHECK(finite, "non-finite output");
        CHECK_ALLCLOSE(yv, rf, n, tol, tol);
    }
    free(xv);
    free(yv);
    free(rf);
    free(ref);
}

TEST(softmax_values) {
    anneal_scope *s = anneal_scope_open();
    /* C = 53: vector body plus a tail. f32 exp vs double: 1e-6 abs + 1e-5 rel for
     * probabilities, 2e-5 for log-probabilities of magnitude up to ~10. */
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){7, 53}, -5, 5, 1, false);
    check_values(x, false, 1e-5);
    check_values(x, true, 2e-5);
    anneal_tensor *x3 = anneal_test_rand(3, (int64_t[]){2, 3, 17}, -3, 3, 2, false);
    check_values(x3, false, 1e-5);
    check_values(x3, true, 2e-5);
    anneal_tensor *xt = anneal_transpose(anneal_test_rand(2, (int64_t[]){9, 4}, -3, 3, 3, false), 0, 1);
    REQUIRE(xt && !anneal_is_contiguous(xt));
    check_values(xt, false, 1e-5);
    check_values(xt, true, 2e-5);
    /* Huge logits (+-1e4 and a row of one repeated huge value) stay finite: the
     * kernel shifts by the row max. Log-probs of order 1e4: 1e-5 relative. */
    float big[12] = {1e4f, -1e4f, 0, 5e3f, -1e4f, -1e4f, -1e4f, -9999, 1e4f, 1e4f, 1e4f, 1e4f};
    anneal_tensor *xb = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){3, 4}, big);
    check_values(xb, false, 1e-6);
    check_values(xb, true, 1e-5);
    /* rows sum to 1 */
    anneal_tensor *p = anneal_softmax(x);
    REQUIRE(p);
    for (int i = 0; i < 7; i++) {
        double sum = 0;
        for (int c = 0; c < 53; c++) sum += anneal_item_at(p, i * 53 + c);
        CHECK_NEAR(sum, 1.0, 1e-5);
    }
    anneal_scope_close(s);
}

typedef struct sm_case {
    bool is_log, transpose;
} sm_case;

static anneal_tensor *f_softmax(void *ctx, anneal_tensor *const *in) {
    const sm_case *c = ctx;
    anneal_tensor *x = c->transpose ? anneal_transpose(in[0], -1, -2) : in[0];
    return c->is_log ? anneal_log_softmax(x) : anneal_softmax(x);
}

/* Finite differences with eps 1e-2 on inputs in [-2, 2]: atol 1e-3, rtol 1e-2. */
TEST(softmax_gradients) {
    anneal_scope *s = anneal_scope_open();
    for (int k = 0; k < 4; k++) {
        sm_case c = {k & 1, (k & 2) != 0};
        anneal_tensor *x[1] = {anneal_test_rand(2, (int64_t[]){5, 11}, -2, 2, 10 + k, true)};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 1.7% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_softmax, &c, 1, x, 1e-2, 2e-4, 2e-3);
        anneal_tensor *x3[1] = {anneal_test_rand(3, (int64_t[]){2, 3, 6}, -2, 2, 20 + k, true)};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.5% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_softmax, &c, 1, x3, 1e-2, 5e-5, 5e-4);
    }
    anneal_scope_close(s);
}

/* A chain: log_softmax feeding a mean checks the backward with a non-trivial,
 * broadcast (stride-0) incoming gradient; dx must sum to 0 along each row. */
TEST(log_softmax_backward_rows_sum_to_zero) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){4, 9}, -3, 3, 30, true);
    anneal_tensor *loss = anneal_mean(anneal_log_softmax(x));
    REQUIRE(loss && anneal_backward(loss) == ANNEAL_OK && x->grad);
    for (int i = 0; i < 4; i++) {
        double sum = 0;
        for (int c = 0; c < 9; c++) sum += anneal_item_at(x->grad, i * 9 + c);
        CHECK_NEAR(sum, 0.0, 1e-6);
    }
    /* d/dx of mean(log_softmax) = (1 - C * softmax) / (N * C) */
    anneal_tensor *p = anneal_softmax(x);
    for (int j = 0; j < 36; j++)
        CHECK_NEAR(anneal_item_at(x->grad, j), (1.0 - 9.0 * anneal_item_at(p, j)) / 36.0, 1e-6);
    anneal_scope_close(s);
}

TEST(softmax_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *xi = anneal_zeros(ANNEAL_I32, 2, (int64_t[]){2, 3});
    anneal_clear_error();
    CHECK_TRUE(anneal_softmax(xi) == NULL && anneal_last_status() == ANNEAL_ERR_DTYPE);
    CHECK(strstr(anneal_last_error(), "softmax") && strstr(anneal_last_error(), "i32"), "message: %s",
          anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_log_softmax(xi) == NULL && anneal_last_status() == ANNEAL_ERR_DTYPE);
    CHECK(strstr(anneal_last_error(), "log_softmax") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_softmax(NULL) == NULL);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(softmax_values);
    RUN(softmax_gradients);
    RUN(log_softmax_backward_rows_sum_to_zero);
    RUN(softmax_errors);
    return anneal_test_summary();
}
