/* anneal_linear_cross_entropy (lm head + softmax + cross-entropy in row chunks):
 * loss and gradients of h and w against cross_entropy(linear(h, w)) in f32 (tight)
 * and at the bf16 matmul precision (against the unfused op at bf16, and against the
 * exact loss with a bf16 bound), over several chunks with ignored rows, the upstream
 * gradient scale, all rows ignored, finite-difference gradient checks, bitwise
 * repeatability, the memory claim (no (N, V) buffer: allocator peak far below N*V*4
 * bytes while the unfused path goes above it), and the argument errors. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

#include <math.h>

#define IGN (-100)

static float *host(anneal_tensor *t) {
    if (!t) return NULL;
    float *b = malloc((size_t)anneal_numel(t) * sizeof *b + 4);
    anneal_to_f32_buffer(t, b);
    return b;
}

/* Targets (N): a deterministic spread over [0, V) with every 7th row ignored. */
static anneal_tensor *make_targets(int ndim, const int64_t *shape, int64_t V, uint64_t seed) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    int32_t *t = malloc((size_t)(n + 1) * sizeof *t);
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = i % 7 == 3 ? IGN : (int32_t)((z >> 33) % (uint64_t)V);
    }
    anneal_tensor *tt = anneal_from_data(ANNEAL_I32, ndim, shape, t);
    free(t);
    return tt;
}

typedef struct {
    double loss;
    float *gh, *gw;
} ce_out;

/* Loss and the gradients of dloss * loss, fused or through full logits. */
/* The compute precision the ops below run at (a value handed to each op). */
static anneal_dtype g_compute = ANNEAL_F32;

static ce_out run(bool fused, anneal_tensor *h, anneal_tensor *w, anneal_tensor *t, float dloss) {
    ce_out o = {NAN, NULL, NULL};
    anneal_grad_clear(h), anneal_grad_clear(w);
    anneal_scope *s = anneal_scope_open();
    anneal_dense_opts lin = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = g_compute};
    anneal_tensor *L = fused ? anneal_linear_cross_entropy_ex(h, w, t, IGN, g_compute)
                             : anneal_cross_entropy(anneal_dense(h, w, NULL, &lin), t, IGN);
    if (L && anneal_backward_grad(L, anneal_scalar(dloss)) == ANNEAL_OK) {
        o.loss = anneal_item(L);
        o.gh = host(h->grad);
        o.gw = host(w->grad);
    }
    anneal_scope_close(s);
    return o;
}

/* N rows of C against V classes: fused vs unfused at g_compute. Both
 * compute each row's logits with the same operand rounding and f32 accumulation; the
 * fused dw sums its chunks in order (beta = 1) where the unfused GEMM sums all rows at
 * once, and the loss mean is the same double sum: loss rtol 1e-6; gradients atol 1e-6
 * (they are O(1/count) ~ 1e-2), rtol 1e-4. */
static void compare_unfused(int64_t B, int64_t T, int64_t C, int64_t V, float dloss, uint64_t seed) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *h = anneal_test_rand(3, (int64_t[]){B, T, C}, -1, 1, seed, true);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){V, C}, -0.5f, 0.5f, seed + 1, true);
    anneal_tensor *t = make_targets(2, (int64_t[]){B, T}, V, seed + 2);
    ce_out f = run(true, h, w, t, dloss), u = run(false, h, w, t, dloss);
    REQUIRE(f.gh && u.gh && f.gw && u.gw);
    CHECK_NEAR(f.loss, u.loss, 1e-6 * fabs(u.loss));
    CHECK_ALLCLOSE(f.gh, u.gh, B * T * C, 1e-6, 1e-4);
    CHECK_ALLCLOSE(f.gw, u.gw, V * C, 1e-6, 1e-4);
    free(f.gh), free(f.gw), free(u.gh), free(u.gw);
    anneal_scope_close(s);
}

TEST(linear_ce_matches_unfused_f32) {
    g_compute = ANNEAL_F32;
    compare_unfused(1, 5, 8, 11, 1.0f, 1);      /* one chunk smaller than the minimum */
    compare_unfused(4, 75, 32, 97, 1.0f, 10);   /* 300 rows: 4 chunks of 75 */
    compare_unfused(2, 70, 48, 300, 2.5f, 20);  /* upstream gradient != 1; 140 rows: 4 chunks of 35 */
}

TEST(linear_ce_matches_unfused_bf16) {
    g_compute = ANNEAL_BF16;
    compare_unfused(4, 75, 32, 97, 1.0f, 30);
    compare_unfused(2, 64, 48, 300, 0.5f, 40);
    g_compute = ANNEAL_F32;
}

/* The bf16 loss against the exact loss in double. Each logit is off by at most
 * 7.9e-3 * sum_k |h_k w_k| (two bf16 roundings of at most u = 2^-8 relative each:
 * (1 + u)^2 - 1 < 7.9e-3; plus f32 accumulation);
 * the loss per row (lse - logit[t]) moves by at most twice the largest logit error,
 * so the mean is within 2 * max_row_bound. */
TEST(linear_ce_bf16_bound) {
    anneal_scope *s = anneal_scope_open();
    int64_t N = 200, C = 64, V = 150;
    anneal_tensor *h = anneal_test_rand(2, (int64_t[]){N, C}, -1, 1, 50, false);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){V, C}, -0.5f, 0.5f, 51, false);
    anneal_tensor *t = make_targets(1, &N, V, 52);
    g_compute = ANNEAL_BF16;
    anneal_tensor *L = anneal_linear_cross_entropy_ex(h, w, t, IGN, g_compute);
    g_compute = ANNEAL_F32;
    REQUIRE(L);
    float *hv = host(h), *wv = host(w);
    const int32_t *tv = anneal_data(t);
    double sum = 0, bound = 0;
    int64_t count = 0;
    double *z = malloc((size_t)V * sizeof *z);
    for (int64_t i = 0; i < N; i++) {
        if (tv[i] == IGN) continue;
        double mx = -INFINITY, se = 0;
        for (int64_t v = 0; v < V; v++) {
            double acc = 0, mag = 0;
            for (int64_t k = 0; k < C; k++) {
                acc += (double)hv[i * C + k] * wv[v * C + k];
                mag += fabs((double)hv[i * C + k] * wv[v * C + k]);
            }
            z[v] = acc;
            mx = acc > mx ? acc : mx;
            bound = fmax(bound, 7.9e-3 * mag + 1e-5);
        }
        for (int64_t v = 0; v < V; v++) se += exp(z[v] - mx);
        sum += mx + log(se) - z[tv[i]];
        count++;
    }
    double ref = sum / (double)count;
    anneal_tensor *L32 = anneal_linear_cross_entropy(h, w, t, IGN);
    REQUIRE(L32);
    CHECK(anneal_item(L) != anneal_item(L32), "bf16 loss equals the f32 one (%.9g)", anneal_item(L));
    CHECK(fabs(anneal_item(L) - ref) <= 2 * bound, "bf16 loss %.7g vs %.7g (bound %.3g)",
          anneal_item(L), ref, 2 * bound);
    free(z), free(hv), free(wv);
    anneal_scope_close(s);
}

static double rel_norm_err(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* f16 GEMMs must not underflow the dlogits: with 512 rows over V = 8192 classes a
 * typical probability / n_valid is ~2e-7, deep in f16's subnormals (spacing 6e-8), so
 * rounding (softmax - onehot) / n_valid to f16 would lose up to ~15% of each such
 * term. The dw rows of classes that are nobody's target are made of those terms only,
 * so their normwise error shows it (measured: 1/n_valid scaling gives 3.6e-2). The
 * fused op scales by 2^15 before rounding instead, so those rows, dh and all of dw
 * must be within the normwise error of f16 rounding (u = 2^-11; a product of two
 * rounded operands <= 2u, errors add in quadrature: <= 4u = 2e-3, as
 * test_gpt2_precision's bound) of the f32 ones. */
TEST(linear_ce_f16_gradients_do_not_underflow) {
    anneal_scope *s = anneal_scope_open();
    int64_t N = 512, V = 8192, C = 32;
    if (anneal_test_sanitized()) N /= 2, V /= 2; /* the same underflow, quicker */
    anneal_tensor *h = anneal_test_rand(2, (int64_t[]){N, C}, -1, 1, 55, true);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){V, C}, -0.2f, 0.2f, 56, true);
    anneal_tensor *t = make_targets(1, &N, V, 57);
    ce_out ref = run(true, h, w, t, 1.0f);
    g_compute = ANNEAL_F16;
    ce_out f = run(true, h, w, t, 1.0f);
    g_compute = ANNEAL_F32;
    REQUIRE(ref.gh && f.gh);
    double eh = rel_norm_err(f.gh, ref.gh, N * C), ew = rel_norm_err(f.gw, ref.gw, V * C);
    /* dw rows of classes no row targets, packed */
    const int32_t *tv = anneal_data(t);
    char *is_target = calloc((size_t)V, 1);
    for (int64_t i = 0; i < N; i++)
        if (tv[i] != IGN) is_target[tv[i]] = 1;
    float *a = malloc((size_t)(V * C) * sizeof *a), *b = malloc((size_t)(V * C) * sizeof *b);
    int64_t m = 0;
    for (int64_t v = 0; v < V; v++)
        if (!is_target[v]) {
            memcpy(a + m, f.gw + v * C, (size_t)C * sizeof *a);
            memcpy(b + m, ref.gw + v * C, (size_t)C * sizeof *b);
            m += C;
        }
    double en = rel_norm_err(a, b, m);
    free(is_target), free(a), free(b);
    printf("  f16 normwise error vs f32: dh %.3g, dw %.3g, dw of non-target classes %.3g (bound 2e-3)\n",
           eh, ew, en);
    CHECK(eh <= 2e-3 && ew <= 2e-3 && en <= 2e-3, "f16 dh error %.3g, dw error %.3g, non-target dw %.3g", eh,
          ew, en);
    CHECK(eh > 0 && ew > 0, "f16 gradients equal the f32 ones: the f16 path did not run");
    free(ref.gh), free(ref.gw), free(f.gh), free(f.gw);
    anneal_scope_close(s);
}

TEST(linear_ce_all_ignored) {
    anneal_scope *s = anneal_scope_open();
    int64_t N = 3, C = 4, V = 5;
    anneal_tensor *h = anneal_test_rand(2, (int64_t[]){N, C}, -1, 1, 60, true);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){V, C}, -1, 1, 61, true);
    anneal_tensor *t = anneal_from_data(ANNEAL_I32, 1, &N, (int32_t[]){IGN, IGN, IGN});
    anneal_tensor *L = anneal_linear_cross_entropy(h, w, t, IGN);
    REQUIRE(L);
    CHECK(anneal_item(L) == 0.0, "all-ignored loss %g", anneal_item(L));
    REQUIRE(anneal_backward(L) == ANNEAL_OK && h->grad && w->grad);
    for (int i = 0; i < N * C; i++) CHECK(anneal_item_at(h->grad, i) == 0.0, "dh[%d] = %g", i, anneal_item_at(h->grad, i));
    for (int i = 0; i < V * C; i++) CHECK(anneal_item_at(w->grad, i) == 0.0, "dw[%d] = %g", i, anneal_item_at(w->grad, i));
    anneal_scope_close(s);
}

typedef struct {
    anneal_tensor *targets;
} gc_case;

static anneal_tensor *f_lce(void *ctx, anneal_tensor *const *in) {
    const gc_case *c = ctx;
    return anneal_linear_cross_entropy(in[0], in[1], c->targets, IGN);
}

/* Finite differences with eps 1e-2 on logits of O(1): atol 1e-4 (gradients are
 * O(1/count)), rtol 1e-2, as the cross_entropy op's test. 70 rows make 3 chunks. */
TEST(linear_ce_gradients) {
    anneal_scope *s = anneal_scope_open();
    gc_case c = {make_targets(2, (int64_t[]){2, 3}, 9, 70)};
    anneal_tensor *in[2] = {anneal_test_rand(3, (int64_t[]){2, 3, 5}, -1, 1, 71, true),
                            anneal_test_rand(2, (int64_t[]){9, 5}, -1, 1, 72, true)};
    /* tolerance was atol 1e-4 rtol 1e-2; worst measured 4.7% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_lce, &c, 2, in, 1e-2, 5e-5, 5e-3);
    int64_t N = 70;
    gc_case c2 = {make_targets(1, &N, 6, 73)};
    anneal_tensor *in2[2] = {anneal_test_rand(2, (int64_t[]){N, 3}, -1, 1, 74, true),
                             anneal_test_rand(2, (int64_t[]){6, 3}, -1, 1, 75, true)};
    /* tolerance was atol 1e-4 rtol 1e-2; worst measured 2.8% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_lce, &c2, 2, in2, 1e-2, 5e-5, 5e-3);
    /* only h requires grad (w frozen) */
    anneal_tensor *in3[2] = {in[0], anneal_test_rand(2, (int64_t[]){9, 5}, -1, 1, 76, false)};
    /* tolerance was atol 1e-4 rtol 1e-2; worst measured 4.2% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_lce, &c, 2, in3, 1e-2, 5e-5, 5e-3);
    anneal_scope_close(s);
}

/* Same inputs, same thread count: bitwise the same loss and gradients. */
TEST(linear_ce_repeatable) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *h = anneal_test_rand(2, (int64_t[]){300, 32}, -1, 1, 80, true);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){257, 32}, -1, 1, 81, true);
    anneal_tensor *t = make_targets(1, (int64_t[]){300}, 257, 82);
    ce_out a = run(true, h, w, t, 1.0f), b = run(true, h, w, t, 1.0f);
    REQUIRE(a.gh && b.gh);
    CHECK_TRUE(a.loss == b.loss);
    CHECK_TRUE(!memcmp(a.gh, b.gh, 300 * 32 * sizeof(float)));
    CHECK_TRUE(!memcmp(a.gw, b.gw, 257 * 32 * sizeof(float)));
    free(a.gh), free(a.gw), free(b.gh), free(b.gw);
    anneal_scope_close(s);
}

/* Allocator peak above what was live before, for loss + backward. */
static int64_t peak_of(bool fused, anneal_tensor *h, anneal_tensor *w, anneal_tensor *t) {
    anneal_grad_clear(h), anneal_grad_clear(w);
    anneal_scope *s = anneal_scope_open();
    int64_t live0 = anneal_memory_stats_get(ANNEAL_CPU).live_bytes;
    anneal_memory_reset_peak(ANNEAL_CPU);
    anneal_dense_opts lin = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = g_compute};
    anneal_tensor *L = fused ? anneal_linear_cross_entropy_ex(h, w, t, IGN, g_compute)
                             : anneal_cross_entropy(anneal_dense(h, w, NULL, &lin), t, IGN);
    bool ok = L && anneal_backward(L) == ANNEAL_OK;
    int64_t peak = anneal_memory_stats_get(ANNEAL_CPU).peak_bytes - live0;
    anneal_scope_close(s);
    return ok ? peak : -1;
}

/* (N = 512, V = 8192, C = 32): full logits are N*V*4 = 16 MiB. The fused path holds a
 * 128-row workspace (4 MiB = 1/4 of the logits) plus dh (64 KiB) and dw (1 MiB, which
 * scales with V*C, not N*V; in backward the engine copies it into w.grad): its peak
 * must stay below half the logits and below a quarter of the unfused peak, which
 * holds logits and dlogits (> N*V*4). Under the sanitizers V is halved to keep the
 * GEMMs quick (the workspace and dw stay the same fractions of the logits). */
TEST(linear_ce_peak_memory) {
    anneal_scope *s = anneal_scope_open();
    int64_t N = 512, V = 8192, C = 32;
    if (anneal_test_sanitized()) V /= 2;
    anneal_tensor *h = anneal_test_rand(2, (int64_t[]){N, C}, -1, 1, 90, true);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){V, C}, -0.2f, 0.2f, 91, true);
    anneal_tensor *t = make_targets(1, &N, V, 92);
    int64_t logits = N * V * (int64_t)sizeof(float);
    int64_t pf = peak_of(true, h, w, t), pu = peak_of(false, h, w, t);
    REQUIRE(pf >= 0 && pu >= 0);
    printf("  peak above live: fused %.2f MiB, unfused %.2f MiB, N*V*4 = %.2f MiB\n", pf / 1048576.0,
           pu / 1048576.0, logits / 1048576.0);
    CHECK(pf < logits / 2 && 4 * pf < pu, "fused peak %lld bytes is not far below N*V*4 = %lld (unfused %lld)",
          (long long)pf, (long long)logits, (long long)pu);
    CHECK(pu > logits, "unfused peak %lld bytes should exceed N*V*4 = %lld", (long long)pu,
          (long long)logits);
    anneal_scope_close(s);
}

TEST(linear_ce_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *h = anneal_test_rand(2, (int64_t[]){3, 4}, -1, 1, 100, false);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){5, 4}, -1, 1, 101, false);
    anneal_tensor *t = anneal_from_data(ANNEAL_I32, 1, (int64_t[]){3}, (int32_t[]){1, 5, 0});
    CHECK_TRUE(anneal_linear_cross_entropy(h, w, t, IGN) == NULL);
    CHECK(anneal_last_status() == ANNEAL_ERR_ARG && strstr(anneal_last_error(), "target 5"), "got: %s",
          anneal_last_error());
    anneal_clear_error();
    anneal_tensor *w2 = anneal_test_rand(2, (int64_t[]){5, 3}, -1, 1, 102, false);
    CHECK_TRUE(anneal_linear_cross_entropy(h, w2, t, IGN) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    anneal_tensor *t2 = anneal_from_data(ANNEAL_I32, 1, (int64_t[]){2}, (int32_t[]){1, 0});
    CHECK_TRUE(anneal_linear_cross_entropy(h, w, t2, IGN) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(linear_ce_matches_unfused_f32);
    RUN(linear_ce_matches_unfused_bf16);
    RUN(linear_ce_bf16_bound);
    RUN(linear_ce_f16_gradients_do_not_underflow);
    RUN(linear_ce_all_ignored);
    RUN(linear_ce_gradients);
    RUN(linear_ce_repeatable);
    RUN(linear_ce_peak_memory);
    RUN(linear_ce_errors);
    return anneal_test_summary();
}
