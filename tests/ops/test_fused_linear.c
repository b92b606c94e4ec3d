/* anneal_conv1d_gelu (fc + bias + tanh-GELU in one GEMM epilogue): values and all
 * gradients against the unfused gelu(conv1d(x, w, b)) in f32 (tight) and at the bf16
 * matmul precision (against the unfused op at bf16, tight, and against an f32 double
 * reference with a bf16 bound), finite-difference gradient checks (bias or not, 3-D and
 * transposed x), and the shape errors. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

#include <math.h>

static float *host(anneal_tensor *t) {
    if (!t) return NULL;
    float *b = malloc((size_t)anneal_numel(t) * sizeof *b + 4);
    anneal_to_f32_buffer(t, b);
    return b;
}

/* The compute precision the ops below run at (a value handed to each op). */
static anneal_dtype g_compute = ANNEAL_F32;

/* conv1d (+ tanh-GELU fused when gelu) at g_compute. */
static anneal_tensor *conv1d_at(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, bool gelu) {
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_IN_OUT, .act = gelu ? ANNEAL_ACT_GELU_TANH : ANNEAL_ACT_NONE,
                           .compute = g_compute};
    return anneal_dense(x, w, b, &o);
}

typedef struct {
    float *y, *gx, *gw, *gb;
} run_out;

static void run_free(run_out *r) { free(r->y), free(r->gx), free(r->gw), free(r->gb); }

/* y and the gradients of sum(y * R) for the fused op or the unfused pair. */
static run_out run(bool fused, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, anneal_tensor *R) {
    run_out o = {0};
    anneal_grad_clear(x), anneal_grad_clear(w);
    if (b) anneal_grad_clear(b);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *y = fused ? conv1d_at(x, w, b, true) : anneal_gelu(conv1d_at(x, w, b, false), true);
    anneal_tensor *L = anneal_sum(anneal_mul(y, R));
    if (L && anneal_backward(L) == ANNEAL_OK) {
        o.y = host(y);
        o.gx = host(x->grad);
        o.gw = host(w->grad);
        o.gb = b ? host(b->grad) : NULL;
    }
    anneal_scope_close(s);
    return o;
}

/* Fused vs unfused at g_compute: both round the operands the same way
 * and accumulate in f32, so only the order of the bias add / GELU formula rounding can
 * differ: a few ulp (atol 1e-6 on O(1) values, rtol 1e-5). Gradients: dw and dx are
 * the same GEMMs on dpre, which differs by a few ulp: atol 1e-5, rtol 1e-4. */
static void compare_unfused(int64_t R0, int64_t R1, int64_t K, int64_t N, bool bias, uint64_t seed) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(3, (int64_t[]){R0, R1, K}, -1, 1, seed, true);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){K, N}, -0.5f, 0.5f, seed + 1, true);
    anneal_tensor *b = bias ? anneal_test_rand(1, &N, -1, 1, seed + 2, true) : NULL;
    anneal_tensor *Rt = anneal_test_rand(3, (int64_t[]){R0, R1, N}, -1, 1, seed + 3, false);
    run_out f = run(true, x, w, b, Rt), u = run(false, x, w, b, Rt);
    REQUIRE(f.y && u.y);
    int64_t ny = R0 * R1 * N;
    CHECK_ALLCLOSE(f.y, u.y, ny, 1e-6, 1e-5);
    CHECK_ALLCLOSE(f.gx, u.gx, R0 * R1 * K, 1e-5, 1e-4);
    CHECK_ALLCLOSE(f.gw, u.gw, K * N, 1e-5, 1e-4);
    if (bias) CHECK_ALLCLOSE(f.gb, u.gb, N, 1e-5, 1e-4);
    run_free(&f), run_free(&u);
    anneal_scope_close(s);
}

TEST(conv1d_gelu_matches_unfused_f32) {
    g_compute = ANNEAL_F32;
    compare_unfused(2, 7, 24, 40, true, 10);
    compare_unfused(3, 5, 17, 33, false, 20); /* sizes off the 16-lane grid, no bias */
    compare_unfused(4, 64, 64, 256, true, 30); /* a GPT-2-like fc: (256 rows, 64) -> 256 */
}

TEST(conv1d_gelu_matches_unfused_bf16) {
    g_compute = ANNEAL_BF16;
    compare_unfused(2, 7, 24, 40, true, 40);
    compare_unfused(4, 64, 64, 256, true, 50);
    g_compute = ANNEAL_F32;
}

/* bf16 forward against the exact f32 value in double. bf16 keeps 8 significant bits,
 * so rounding an operand costs at most u = 2^-8 relative, and each product is off by
 * at most (1 + u)^2 - 1 < 7.9e-3 of |x_k w_k|: |pre_bf16 - pre| <= 7.9e-3 *
 * sum_k |x_k w_k| (+ f32 accumulation, 1e-5); gelu_tanh is 1.13-Lipschitz, so the
 * bound on y is 1.13x that. The result must also differ from the f32 one somewhere
 * (the bf16 path really ran). */
TEST(conv1d_gelu_bf16_bound) {
    anneal_scope *s = anneal_scope_open();
    int64_t R = 50, K = 96, N = 72;
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){R, K}, -1, 1, 60, false);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){K, N}, -0.3f, 0.3f, 61, false);
    anneal_tensor *b = anneal_test_rand(1, &N, -1, 1, 62, false);
    g_compute = ANNEAL_BF16;
    anneal_tensor *y = conv1d_at(x, w, b, true);
    g_compute = ANNEAL_F32;
    anneal_tensor *y32 = conv1d_at(x, w, b, true);
    REQUIRE(y && y32);
    float *xv = host(x), *wv = host(w), *bv = host(b), *yv = host(y), *y32v = host(y32);
    CHECK(memcmp(yv, y32v, (size_t)(R * N) * sizeof(float)) != 0, "bf16 result equals the f32 one");
    free(y32v);
    int bad = 0;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = bv[j], mag = 0;
            for (int64_t k = 0; k < K; k++) {
                acc += (double)xv[i * K + k] * wv[k * N + j];
                mag += fabs((double)xv[i * K + k] * wv[k * N + j]);
            }
            double ref = 0.5 * acc * (1.0 + tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)));
            double tol = 1.13 * (7.9e-3 * mag + 1e-5);
            if (!(fabs(yv[i * N + j] - ref) <= tol) && bad++ < 3)
                CHECK(false, "y[%lld,%lld] = %.7g vs %.7g (tol %.3g)", (long long)i, (long long)j,
                      (double)yv[i * N + j], ref, tol);
        }
    free(xv), free(wv), free(bv), free(yv);
    anneal_scope_close(s);
}

typedef struct {
    bool bias, transpose; /* transpose: the x leaf is (K, R) and the op sees x^T */
} gc_case;

static anneal_tensor *f_fc(void *ctx, anneal_tensor *const *in) {
    const gc_case *c = ctx;
    anneal_tensor *x = c->transpose ? anneal_transpose(in[0], 0, 1) : in[0];
    return anneal_conv1d_gelu(x, in[1], c->bias ? in[2] : NULL);
}

/* Central differences with eps 1e-2 on O(1) inputs: GELU's curvature gives errors
 * ~eps^2 = 1e-4 relative, so atol 1e-3, rtol 1e-2 (as the conv1d test). */
TEST(conv1d_gelu_gradients) {
    anneal_scope *s = anneal_scope_open();
    gc_case c = {true, false};
    anneal_tensor *in[3] = {anneal_test_rand(3, (int64_t[]){2, 3, 5}, -2, 2, 70, true),
                            anneal_test_rand(2, (int64_t[]){5, 6}, -1, 1, 71, true),
                            anneal_test_rand(1, (int64_t[]){6}, -1, 1, 72, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 3.5% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_fc, &c, 3, in, 1e-2, 5e-4, 5e-3);
    gc_case nb = {false, false};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 1.4% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_fc, &nb, 2, in, 1e-2, 2e-4, 2e-3);
    gc_case tr = {true, true};
    anneal_tensor *int_[3] = {anneal_test_rand(2, (int64_t[]){5, 4}, -2, 2, 73, true), in[1], in[2]};
    /* tolerance unchanged (10x the worst would loosen it): worst measured 5% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_fc, &tr, 3, int_, 1e-2, 1e-3, 1e-2);
    anneal_scope_close(s);
}

TEST(conv1d_gelu_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){3, 5}, -1, 1, 80, false);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){4, 6}, -1, 1, 81, false);
    CHECK_TRUE(anneal_conv1d_gelu(x, w, NULL) == NULL);
    CHECK(anneal_last_status() == ANNEAL_ERR_SHAPE && strstr(anneal_last_error(), "conv1d_gelu"),
          "got: %s", anneal_last_error());
    anneal_clear_error();
    anneal_tensor *w2 = anneal_test_rand(2, (int64_t[]){5, 6}, -1, 1, 82, false);
    anneal_tensor *b = anneal_test_rand(1, (int64_t[]){5}, -1, 1, 83, false);
    CHECK_TRUE(anneal_conv1d_gelu(x, w2, b) == NULL);
    CHECK(anneal_last_status() == ANNEAL_ERR_SHAPE && strstr(anneal_last_error(), "bias"), "got: %s",
          anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_conv1d_gelu(NULL, w2, NULL) == NULL);
    CHECK(anneal_last_status() != ANNEAL_OK && strstr(anneal_last_error(), "conv1d_gelu"), "got: %s",
          anneal_last_error());
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(conv1d_gelu_matches_unfused_f32);
    RUN(conv1d_gelu_matches_unfused_bf16);
    RUN(conv1d_gelu_bf16_bound);
    RUN(conv1d_gelu_gradients);
    RUN(conv1d_gelu_errors);
    return anneal_test_summary();
}
