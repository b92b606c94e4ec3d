/* anneal_add_layer_norm (residual add + LayerNorm in one pass, two outputs): both
 * outputs and every gradient bitwise equal to add followed by layer_norm (the kernel
 * runs the same per-row arithmetic), gradients through y only, s only and both against
 * finite differences, optional weight/bias, a recompute region around it, and the
 * shape errors. No GEMM is involved, so the matmul dtype does not apply. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

static float *host(anneal_tensor *t) {
    if (!t) return NULL;
    float *b = malloc((size_t)anneal_numel(t) * sizeof *b + 4);
    anneal_to_f32_buffer(t, b);
    return b;
}

static bool same_bits(const float *a, const float *b, int64_t n, const char *what) {
    if (!a || !b) return false;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float))) {
            anneal_test_fail(__FILE__, __LINE__, "%s[%lld]: %.9g vs %.9g", what, (long long)i,
                             (double)a[i], (double)b[i]);
            return false;
        }
    return true;
}

/* L = sum(y * Ry) + sum(f(s) * Rs) with s also used downstream (as the residual stream
 * is); returns y, s and the gradients of x, r, w, b. */
typedef struct {
    float *y, *s, *g[4];
} out4;

static out4 run(bool fused, anneal_tensor *const *in, anneal_tensor *Ry, anneal_tensor *Rs) {
    out4 o = {0};
    for (int i = 0; i < 4; i++) anneal_grad_clear(in[i]);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *s = NULL, *y;
    if (fused) {
        y = anneal_add_layer_norm(in[0], in[1], in[2], in[3], 1e-5f, &s);
    } else {
        s = anneal_add(in[0], in[1]);
        y = anneal_layer_norm(s, in[2], in[3], 1e-5f);
    }
    anneal_tensor *L = anneal_add(anneal_sum(anneal_mul(y, Ry)), anneal_sum(anneal_mul(s, Rs)));
    if (L && anneal_backward(L) == ANNEAL_OK) {
        o.y = host(y), o.s = host(s);
        for (int i = 0; i < 4; i++) o.g[i] = host(in[i]->grad);
    }
    anneal_scope_close(sc);
    return o;
}

TEST(add_layer_norm_bitwise_matches_unfused) {
    anneal_scope *sc = anneal_scope_open();
    int64_t shapes[3][3] = {{2, 5, 37}, {4, 64, 64}, {1, 3, 1000}}; /* C above the 4096-float block too */
    for (int k = 0; k < 3; k++) {
        int64_t *sh = shapes[k], C = sh[2], n = sh[0] * sh[1] * C;
        anneal_tensor *in[4] = {anneal_test_rand(3, sh, -2, 2, 10 + k, true),
                                anneal_test_rand(3, sh, -1, 1, 20 + k, true),
                                anneal_test_rand(1, &C, 0.5f, 1.5f, 30 + k, true),
                                anneal_test_rand(1, &C, -1, 1, 40 + k, true)};
        anneal_tensor *Ry = anneal_test_rand(3, sh, -1, 1, 50 + k, false);
        anneal_tensor *Rs = anneal_test_rand(3, sh, -1, 1, 60 + k, false);
        out4 f = run(true, in, Ry, Rs), u = run(false, in, Ry, Rs);
        REQUIRE(f.y && u.y);
        same_bits(f.y, u.y, n, "y");
        same_bits(f.s, u.s, n, "s");
        same_bits(f.g[0], u.g[0], n, "dx");
        same_bits(f.g[1], u.g[1], n, "dr");
        same_bits(f.g[2], u.g[2], C, "dw");
        same_bits(f.g[3], u.g[3], C, "db");
        free(f.y), free(f.s), free(u.y), free(u.s);
        for (int i = 0; i < 4; i++) free(f.g[i]), free(u.g[i]);
    }
    anneal_scope_close(sc);
}

/* which: 0 = y only, 1 = s only, 2 = y + 0.7 s (both uses of s); nw: no weight/bias. */
typedef struct {
    int which;
    bool no_params;
} gc_case;

static anneal_tensor *f_aln(void *ctx, anneal_tensor *const *in) {
    const gc_case *c = ctx;
    anneal_tensor *s;
    anneal_tensor *y = anneal_add_layer_norm(in[0], in[1], c->no_params ? NULL : in[2],
                                             c->no_params ? NULL : in[3], 1e-5f, &s);
    if (c->which == 0) return y;
    if (c->which == 1) return anneal_mul(s, s); /* nonlinear in s so the check means something */
    return anneal_add(y, anneal_scale(anneal_mul(s, s), 0.7f));
}

/* eps 1e-2 on O(1) inputs, atol 2e-3 and rtol 1e-2, as the layer_norm op's test. */
TEST(add_layer_norm_gradients) {
    anneal_scope *sc = anneal_scope_open();
    int64_t sh[3] = {2, 3, 7}, C = 7;
    anneal_tensor *in[4] = {anneal_test_rand(3, sh, -2, 2, 70, true),
                            anneal_test_rand(3, sh, -1, 1, 71, true),
                            anneal_test_rand(1, &C, 0.5f, 1.5f, 72, true),
                            anneal_test_rand(1, &C, -1, 1, 73, true)};
    for (int which = 0; which < 3; which++) {
        gc_case c = {which, false};
        /* tolerance was atol 2e-3 rtol 1e-2; worst measured 1.6% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_aln, &c, which == 1 ? 2 : 4, in, 1e-2, 4e-4, 2e-3); /* s only: w, b get none */
    }
    gc_case np = {2, true};
    /* tolerance was atol 2e-3 rtol 1e-2; worst measured 0.4% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_aln, &np, 2, in, 1e-2, 1e-4, 5e-4);
    /* only one of x, r requires grad */
    anneal_tensor *in2[4] = {anneal_test_rand(3, sh, -2, 2, 74, true),
                             anneal_test_rand(3, sh, -1, 1, 75, false), in[2], in[3]};
    gc_case c2 = {2, false};
    /* tolerance was atol 2e-3 rtol 1e-2; worst measured 1.1% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_aln, &c2, 4, in2, 1e-2, 4e-4, 2e-3);
    anneal_scope_close(sc);
}

/* Inside an activation checkpoint the op is recomputed in backward: gradients must be
 * bitwise those of the plain run. */
static anneal_tensor *region(void *ctx, anneal_tensor *const *in) {
    anneal_tensor *s;
    anneal_tensor *y = anneal_add_layer_norm(in[0], in[1], in[2], in[3], 1e-5f, &s);
    return anneal_add(anneal_mul(y, y), s);
}

TEST(add_layer_norm_in_checkpoint) {
    anneal_scope *sc = anneal_scope_open();
    int64_t sh[2] = {6, 40}, C = 40, n = 240;
    anneal_tensor *in[4] = {anneal_test_rand(2, sh, -2, 2, 80, true),
                            anneal_test_rand(2, sh, -1, 1, 81, true),
                            anneal_test_rand(1, &C, 0.5f, 1.5f, 82, true),
                            anneal_test_rand(1, &C, -1, 1, 83, true)};
    float *g[2][4];
    for (int ck = 0; ck < 2; ck++) {
        for (int i = 0; i < 4; i++) anneal_grad_clear(in[i]);
        anneal_tensor *o = ck ? anneal_checkpoint(region, NULL, 4, in) : region(NULL, in);
        REQUIRE(o && anneal_backward(anneal_sum(o)) == ANNEAL_OK);
        for (int i = 0; i < 4; i++) g[ck][i] = host(in[i]->grad);
    }
    same_bits(g[0][0], g[1][0], n, "dx");
    same_bits(g[0][1], g[1][1], n, "dr");
    same_bits(g[0][2], g[1][2], C, "dw");
    same_bits(g[0][3], g[1][3], C, "db");
    for (int ck = 0; ck < 2; ck++)
        for (int i = 0; i < 4; i++) free(g[ck][i]);
    anneal_scope_close(sc);
}

TEST(add_layer_norm_errors) {
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){3, 5}, -1, 1, 90, false);
    anneal_tensor *r = anneal_test_rand(2, (int64_t[]){1, 5}, -1, 1, 91, false);
    anneal_tensor *s = x;
    CHECK_TRUE(anneal_add_layer_norm(x, r, NULL, NULL, 1e-5f, &s) == NULL);
    CHECK_TRUE(s == NULL);
    CHECK(anneal_last_status() == ANNEAL_ERR_SHAPE && strstr(anneal_last_error(), "no broadcasting"),
          "got: %s", anneal_last_error());
    anneal_clear_error();
    anneal_tensor *w = anneal_test_rand(1, (int64_t[]){4}, -1, 1, 92, false);
    CHECK_TRUE(anneal_add_layer_norm(x, x, w, NULL, 1e-5f, &s) == NULL);
    CHECK(anneal_last_status() == ANNEAL_ERR_SHAPE && strstr(anneal_last_error(), "weight"), "got: %s",
          anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_add_layer_norm(x, x, NULL, NULL, 1e-5f, NULL) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_scope_close(sc);
}

int main(void) {
    RUN(add_layer_norm_bitwise_matches_unfused);
    RUN(add_layer_norm_gradients);
    RUN(add_layer_norm_in_checkpoint);
    RUN(add_layer_norm_errors);
    return anneal_test_summary();
}
