/* Elementwise ops, broadcasting, views and reductions: values against direct
 * computation and gradients against finite differences. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

static anneal_tensor *f_add(void *c, anneal_tensor *const *x) { (void)c; return anneal_add(x[0], x[1]); }
static anneal_tensor *f_sub(void *c, anneal_tensor *const *x) { (void)c; return anneal_sub(x[0], x[1]); }
static anneal_tensor *f_mul(void *c, anneal_tensor *const *x) { (void)c; return anneal_mul(x[0], x[1]); }
static anneal_tensor *f_div(void *c, anneal_tensor *const *x) { (void)c; return anneal_div(x[0], x[1]); }

TEST(broadcast_values) {
    anneal_scope *s = anneal_scope_open();
    float a[6] = {1, 2, 3, 4, 5, 6}, b[3] = {10, 20, 30};
    anneal_tensor *ta = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){2, 3}, a);
    anneal_tensor *tb = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){3}, b);
    anneal_tensor *c = anneal_add(ta, tb);
    REQUIRE(c);
    CHECK(c->ndim == 2 && c->shape[0] == 2 && c->shape[1] == 3, "shape");
    for (int i = 0; i < 6; i++) CHECK_NEAR(anneal_item_at(c, i), a[i] + b[i % 3], 0);
    /* column broadcast (2,1) * (1,3) -> (2,3) */
    anneal_tensor *col = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){2, 1}, (float[]){2, -1});
    anneal_tensor *row = anneal_reshape(tb, 2, (int64_t[]){1, 3});
    anneal_tensor *p = anneal_mul(col, row);
    REQUIRE(p);
    for (int i = 0; i < 6; i++) CHECK_NEAR(anneal_item_at(p, i), (i < 3 ? 2 : -1) * b[i % 3], 0);
    anneal_tensor *d = anneal_div(ta, anneal_sub(tb, anneal_scale(tb, 0.5f)));
    for (int i = 0; i < 6; i++) CHECK_NEAR(anneal_item_at(d, i), a[i] / (b[i % 3] * 0.5f), 1e-6);
    anneal_scope_close(s);
}

TEST(broadcast_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){2, 3});
    anneal_tensor *b = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){4});
    anneal_clear_error();
    CHECK_TRUE(anneal_add(a, b) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_SHAPE);
    CHECK(strstr(anneal_last_error(), "broadcast") != NULL, "message: %s", anneal_last_error());
    /* NULL propagates without replacing the first error */
    CHECK_TRUE(anneal_mul(anneal_add(a, b), a) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    anneal_tensor *i = anneal_zeros(ANNEAL_I32, 1, (int64_t[]){3});
    CHECK_TRUE(anneal_add(a, i) == NULL && anneal_last_status() == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    anneal_scope_close(s);
}

TEST(binary_gradients_broadcast) {
    anneal_scope *s = anneal_scope_open();
    anneal_gc_fn fns[4] = {f_add, f_sub, f_mul, f_div};
    for (int k = 0; k < 4; k++) {
        anneal_tensor *x[2] = {anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 1 + k, true),
                               anneal_test_rand(2, (int64_t[]){3, 1}, 0.5f, 1.5f, 7 + k, true)};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 1.2% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(fns[k], NULL, 2, x, 1e-2, 2e-4, 2e-3);
        /* the other way round (denominators kept away from zero for div) */
        anneal_tensor *y[2] = {anneal_test_rand(2, (int64_t[]){3, 1}, -1, 1, 17 + k, true),
                               anneal_test_rand(3, (int64_t[]){2, 3, 4}, 0.5f, 1.5f, 19 + k, true)};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 2.5% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(fns[k], NULL, 2, y, 1e-2, 5e-4, 5e-3);
    }
    anneal_scope_close(s);
}

static anneal_tensor *f_trans_mul(void *c, anneal_tensor *const *x) {
    (void)c;
    return anneal_mul(anneal_transpose(x[0], 0, 1), x[1]);
}

TEST(noncontiguous_gradients) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x[2] = {anneal_test_rand(2, (int64_t[]){4, 3}, -1, 1, 3, true),
                           anneal_test_rand(2, (int64_t[]){3, 4}, -1, 1, 4, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.026% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_trans_mul, NULL, 2, x, 1e-2, 1e-5, 1e-4);
    anneal_scope_close(s);
}

static anneal_tensor *f_unary(void *c, anneal_tensor *const *x) {
    switch (*(int *)c) {
    case 0: return anneal_scale(x[0], -2.5f);
    case 1: return anneal_add_scalar(x[0], 3.0f);
    case 2: return anneal_gelu(x[0], true);
    case 3: return anneal_gelu(x[0], false);
    default: return anneal_silu(x[0]);
    }
}

TEST(unary_gradients) {
    anneal_scope *s = anneal_scope_open();
    for (int k = 0; k < 5; k++) {
        anneal_tensor *x[1] = {anneal_test_rand(2, (int64_t[]){5, 7}, -3, 3, 11 + k, true)};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.68% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_unary, &k, 1, x, 1e-2, 1e-4, 1e-3);
    }
    anneal_scope_close(s);
}

static anneal_tensor *f_reduce(void *c, anneal_tensor *const *x) {
    switch (*(int *)c) {
    case 0: return anneal_sum(x[0]);
    case 1: return anneal_mean(x[0]);
    case 2: return anneal_sum_dim(x[0], 1, false);
    case 3: return anneal_mean_dim(x[0], -1, true);
    default: return anneal_sum_dim(anneal_permute(x[0], (int[]){2, 0, 1}), 0, false);
    }
}

TEST(reduce_values_and_gradients) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 5, true);
    anneal_tensor *sum = anneal_sum(x), *m1 = anneal_sum_dim(x, 1, false);
    double ref = 0;
    for (int i = 0; i < 24; i++) ref += anneal_item_at(x, i);
    CHECK_NEAR(anneal_item(sum), ref, 1e-5);
    CHECK(m1->ndim == 2 && m1->shape[0] == 2 && m1->shape[1] == 4, "sum_dim shape");
    for (int b = 0; b < 2; b++)
        for (int k = 0; k < 4; k++) {
            double r = 0;
            for (int j = 0; j < 3; j++) r += anneal_item_at(x, b * 12 + j * 4 + k);
            CHECK_NEAR(anneal_item_at(m1, b * 4 + k), r, 1e-5);
        }
    for (int k = 0; k < 5; k++) {
        anneal_tensor *in[1] = {x};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.079% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_reduce, &k, 1, in, 1e-2, 1e-5, 1e-4);
    }
    anneal_scope_close(s);
}

/* Summing leading dims of a contiguous tensor (the bias-gradient shape) takes a
 * streaming path; it must give the bits of the general path, which a permuted copy
 * (reduced dim last) takes, and match a double reference. */
TEST(leading_reduction_matches_general_path) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(3, (int64_t[]){37, 5, 300}, -1, 1, 11, false);
    anneal_tensor *fast = anneal_sum_dim(x, 0, false);                                   /* (5, 300) */
    anneal_tensor *xt = anneal_contiguous(anneal_permute(x, (int[]){1, 2, 0}));          /* (5, 300, 37) */
    anneal_tensor *slow = anneal_sum_dim(xt, 2, false);
    REQUIRE(fast && slow);
    int64_t n = anneal_numel(fast);
    CHECK(memcmp(anneal_data(fast), anneal_data(slow), (size_t)n * sizeof(float)) == 0,
          "leading-dim sums differ from the general path");
    for (int64_t k = 0; k < n; k += 97) {
        double r = 0;
        for (int64_t i = 0; i < 37; i++) r += anneal_item_at(x, i * n + k);
        CHECK_NEAR(anneal_item_at(fast, k), r, 1e-5);
    }
    anneal_scope_close(s);
}

static anneal_tensor *f_views(void *c, anneal_tensor *const *x) {
    (void)c;
    anneal_tensor *parts[2];
    if (anneal_split(x[0], 1, 2, (int64_t[]){1, 3}, parts) != ANNEAL_OK) return NULL;
    anneal_tensor *r = anneal_reshape(anneal_transpose(parts[1], 0, 1), 1, (int64_t[]){-1});
    anneal_tensor *n = anneal_narrow(r, 0, 2, 4);
    anneal_tensor *cat = anneal_cat(3, (anneal_tensor *[]){n, anneal_reshape(parts[0], 1, (int64_t[]){2}), x[1]}, 0);
    return anneal_mul(cat, cat);
}

TEST(view_gradients) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x[2] = {anneal_test_rand(2, (int64_t[]){2, 4}, -1, 1, 8, true),
                           anneal_test_rand(1, (int64_t[]){3}, -1, 1, 9, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.012% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_views, NULL, 2, x, 1e-2, 1e-5, 1e-4);
    anneal_scope_close(s);
}

TEST(views_share_storage) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 2, false);
    anneal_tensor *t = anneal_transpose(x, 0, 2);
    CHECK_TRUE(t->storage == x->storage && !anneal_is_contiguous(t));
    CHECK_TRUE(t->shape[0] == 4 && t->shape[2] == 2);
    CHECK_NEAR(anneal_item_at(t, 1 * 6 + 2 * 2 + 1), anneal_item_at(x, 1 * 12 + 2 * 4 + 1), 0);
    anneal_tensor *n = anneal_narrow(x, 1, 1, 2);
    CHECK_TRUE(n->storage == x->storage && n->shape[1] == 2);
    CHECK_NEAR(anneal_item_at(n, 0), anneal_item_at(x, 4), 0);
    anneal_tensor *c = anneal_contiguous(t);
    CHECK_TRUE(anneal_is_contiguous(c) && c->storage != x->storage);
    for (int i = 0; i < 24; i++) CHECK_NEAR(anneal_item_at(c, i), anneal_item_at(t, i), 0);
    anneal_tensor *r = anneal_reshape(x, 2, (int64_t[]){6, -1});
    CHECK_TRUE(r && r->storage == x->storage && r->shape[1] == 4);
    anneal_clear_error();
    CHECK_TRUE(anneal_reshape(x, 2, (int64_t[]){5, -1}) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_narrow(x, 2, 3, 2) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_transpose(x, 0, 3) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_scope_close(s);
}

TEST(cast_roundtrip) {
    anneal_scope *s = anneal_scope_open();
    float v[5] = {1.0f, -2.5f, 3.14159f, 65504.0f, 1e-8f};
    anneal_tensor *x = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){5}, v);
    anneal_tensor *h = anneal_cast(x, ANNEAL_F16), *b = anneal_cast(x, ANNEAL_BF16);
    anneal_tensor *i = anneal_cast(x, ANNEAL_I32);
    for (int k = 0; k < 5; k++) {
        CHECK_NEAR(anneal_item_at(h, k), anneal_f16_to_f32(anneal_f32_to_f16(v[k])), 0);
        CHECK_NEAR(anneal_item_at(b, k), anneal_bf16_to_f32(anneal_f32_to_bf16(v[k])), 0);
        CHECK_NEAR(anneal_item_at(i, k), (double)(int32_t)v[k], 0);
    }
    CHECK_NEAR(anneal_item_at(b, 2), 3.140625, 0); /* bf16 keeps 8 bits of mantissa */
    anneal_scope_close(s);
}

/* A large contiguous copy (several MiB: the piecewise multithreaded path, as a gradient
 * landing in a parameter's .grad takes) gives exactly the source, every piece and the
 * ragged last one included, and a leaf's first gradient equals the gradient. */
TEST(large_contiguous_copy) {
    anneal_scope *s = anneal_scope_open();
    const int64_t n = 3 * (1 << 20) + 12345; /* not a whole number of 256 KiB pieces */
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = (float)(i % 9973) * 0.5f - 7.0f;
    anneal_tensor *x = anneal_from_data(ANNEAL_F32, 1, &n, v);
    anneal_tensor *y = anneal_clone(x);
    REQUIRE(y != NULL);
    CHECK(memcmp(anneal_data(y), v, sizeof(float) * (size_t)n) == 0, "clone differs from its source");
    anneal_tensor *w = anneal_from_data(ANNEAL_F32, 1, &n, v);
    anneal_set_requires_grad(w, true);
    anneal_tensor *loss = anneal_sum(anneal_mul(w, x));
    REQUIRE(loss != NULL && anneal_backward(loss) == ANNEAL_OK);
    REQUIRE(w->grad != NULL);
    CHECK(memcmp(anneal_data(w->grad), v, sizeof(float) * (size_t)n) == 0, "d(sum(w*x))/dw != x");
    free(v);
    anneal_scope_close(s);
}

/* Rows longer than a work item (the CPU cuts rows into pieces of 65,536 elements, so
 * that a contiguous tensor, one row after coalescing, spreads over the threads): casts
 * both ways, fill, and binary ops with a broadcast row and a broadcast column, every
 * element against its reference, the ragged last piece of each row included. */
TEST(long_rows_in_pieces) {
    anneal_scope *s = anneal_scope_open();
    const int64_t R = 2, C = 150001, n = R * C;
    float *v = malloc(sizeof(float) * (size_t)n), *w = malloc(sizeof(float) * (size_t)C);
    for (int64_t i = 0; i < n; i++) v[i] = (float)((i * 7919) % 100003) * 1.0001e-3f - 50.0f;
    for (int64_t j = 0; j < C; j++) w[j] = (float)(j % 97) * 0.25f + 1.0f;
    float col[2] = {3.0f, -0.5f};
    anneal_tensor *x = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){R, C}, v);
    anneal_tensor *row = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){1, C}, w);
    anneal_tensor *cl = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){R, 1}, col);
    anneal_tensor *b = anneal_cast(x, ANNEAL_BF16), *back = anneal_cast(b, ANNEAL_F32);
    anneal_tensor *full = anneal_full(ANNEAL_F32, 2, (int64_t[]){R, C}, 2.5);
    anneal_tensor *sum = anneal_add(x, row), *prod = anneal_mul(x, cl);
    REQUIRE(b && back && full && sum && prod);
    const uint16_t *pb = anneal_data(b);
    const float *pback = anneal_data(back), *pfull = anneal_data(full), *psum = anneal_data(sum),
                *pprod = anneal_data(prod);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = i / C, j = i % C;
        const uint16_t h = anneal_f32_to_bf16(v[i]);
        bad += pb[i] != h;
        bad += pback[i] != anneal_bf16_to_f32(h);
        bad += pfull[i] != 2.5f;
        bad += psum[i] != v[i] + w[j];
        bad += pprod[i] != v[i] * col[r];
    }
    CHECK(bad == 0, "%lld elements differ from the reference", (long long)bad);
    free(v);
    free(w);
    anneal_scope_close(s);
}

TEST(dropout_deterministic) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_full(ANNEAL_F32, 1, (int64_t[]){100000}, 1.0);
    anneal_manual_seed(42);
    anneal_tensor *a = anneal_dropout(x, 0.25f, true);
    anneal_set_num_threads(1);
    anneal_manual_seed(42);
    anneal_tensor *b = anneal_dropout(x, 0.25f, true);
    anneal_set_num_threads(2);
    anneal_tensor *c = anneal_dropout(x, 0.25f, true); /* generator advanced: new mask */
    int64_t kept = 0, same = 0, diff = 0;
    for (int64_t i = 0; i < 100000; i++) {
        float va = (float)anneal_item_at(a, i), vb = (float)anneal_item_at(b, i), vc = (float)anneal_item_at(c, i);
        kept += va != 0;
        same += va == vb;
        diff += va != vc;
        CHECK_TRUE(va == 0.0f || fabsf(va - 1.0f / 0.75f) < 1e-6f);
    }
    CHECK(same == 100000, "same seed, different threads: %lld of 100000 equal", (long long)same);
    CHECK(fabs(kept / 100000.0 - 0.75) < 0.01, "kept fraction %g", kept / 100000.0);
    CHECK(diff > 10000, "the next call must draw a new mask (%lld differ)", (long long)diff);
    CHECK_TRUE(anneal_dropout(x, 0.5f, false) == x);
    anneal_clear_error();
    CHECK_TRUE(anneal_dropout(x, 1.0f, true) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_scope_close(s);
}

static anneal_tensor *f_dropout(void *c, anneal_tensor *const *x) {
    anneal_manual_seed(7); /* same mask on every evaluation */
    (void)c;
    return anneal_dropout(x[0], 0.3f, true);
}

TEST(dropout_gradient) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x[1] = {anneal_test_rand(2, (int64_t[]){6, 9}, -1, 1, 3, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.025% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_dropout, NULL, 1, x, 1e-2, 1e-5, 1e-4);
    anneal_scope_close(s);
}

int main(void) {
    RUN(broadcast_values);
    RUN(broadcast_errors);
    RUN(binary_gradients_broadcast);
    RUN(noncontiguous_gradients);
    RUN(unary_gradients);
    RUN(reduce_values_and_gradients);
    RUN(leading_reduction_matches_general_path);
    RUN(view_gradients);
    RUN(views_share_storage);
    RUN(cast_roundtrip);
    RUN(large_contiguous_copy);
    RUN(long_rows_in_pieces);
    RUN(dropout_deterministic);
    RUN(dropout_gradient);
    return anneal_test_summary();
}
