/* Parameter sets: creation, lookup, duplicate names, ownership by the set's scope,
 * numel, zero_grad, and the initialisers (normal statistics, seeding, the shared
 * RNG stream with anneal_randn, strided and bf16 targets, fill, error paths). */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

TEST(create_find_numel) {
    anneal_scope *outer = anneal_scope_open(); /* parameters must not land here */
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *w = anneal_params_create(ps, "h.0.attn.weight", 2, (int64_t[]){3, 4}, true);
    anneal_tensor *b = anneal_params_create(ps, "h.0.attn.bias", 1, (int64_t[]){4}, false);
    anneal_tensor *s = anneal_params_create(ps, "scalar", 0, NULL, false);
    REQUIRE(w && b && s);
    CHECK(ps->n == 3, "n = %d", ps->n);
    CHECK(anneal_scope_count(outer) == 0, "current scope got %lld tensors", (long long)anneal_scope_count(outer));
    CHECK(anneal_scope_count(ps->scope) == 3, "set scope holds %lld", (long long)anneal_scope_count(ps->scope));
    /* f32, zero-filled, requires_grad, named, decay flag kept, registration order */
    CHECK_TRUE(w->dtype == ANNEAL_F32 && w->requires_grad && w->grad == NULL && w->grad_fn == NULL);
    CHECK_TRUE(w->name && strcmp(w->name, "h.0.attn.weight") == 0);
    for (int i = 0; i < 12; i++) CHECK_TRUE(anneal_item_at(w, i) == 0.0);
    CHECK_TRUE(ps->items[0].tensor == w && ps->items[0].decay);
    CHECK_TRUE(ps->items[1].tensor == b && !ps->items[1].decay);
    CHECK_TRUE(strcmp(ps->items[2].name, "scalar") == 0);
    anneal_param *f = anneal_params_find(ps, "h.0.attn.bias");
    CHECK_TRUE(f && f->tensor == b);
    anneal_clear_error();
    CHECK_TRUE(anneal_params_find(ps, "h.0.attn") == NULL); /* prefix is not a match */
    CHECK_TRUE(anneal_params_find(ps, "missing") == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_OK); /* no error recorded by find */
    CHECK(anneal_params_numel(ps) == 12 + 4 + 1, "numel %lld", (long long)anneal_params_numel(ps));
    /* many parameters: the item array grows and earlier pointers stay valid as tensors */
    char name[32];
    for (int i = 0; i < 40; i++) {
        snprintf(name, sizeof name, "extra.%d", i);
        CHECK_TRUE(anneal_params_create(ps, name, 1, (int64_t[]){2}, false) != NULL);
    }
    CHECK_TRUE(ps->n == 43 && anneal_params_numel(ps) == 17 + 80);
    CHECK_TRUE(anneal_params_find(ps, "extra.39")->tensor == ps->items[42].tensor);
    anneal_params_free(ps);
    anneal_scope_close(outer);
}

TEST(duplicates_and_errors) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    REQUIRE(anneal_params_create(ps, "a", 1, (int64_t[]){2}, true));
    anneal_clear_error();
    CHECK_TRUE(anneal_params_create(ps, "a", 1, (int64_t[]){3}, false) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "duplicate") && strstr(anneal_last_error(), "'a'"), "message: %s",
          anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(ps->n == 1 && anneal_params_numel(ps) == 2); /* failed create leaves the set as it was */
    CHECK_TRUE(anneal_params_create(ps, NULL, 1, (int64_t[]){2}, true) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_params_create(ps, "", 1, (int64_t[]){2}, true) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_params_create(ps, "neg", 2, (int64_t[]){2, -1}, true) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(ps->n == 1 && anneal_scope_count(ps->scope) == 1);
    CHECK_TRUE(anneal_params_find(ps, "neg") == NULL);
    /* the name that failed can be registered properly afterwards */
    CHECK_TRUE(anneal_params_create(ps, "neg", 1, (int64_t[]){5}, true) != NULL);
    CHECK_TRUE(anneal_params_create(NULL, "x", 1, (int64_t[]){2}, true) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    /* NULL sets are harmless for the queries */
    CHECK_TRUE(anneal_params_numel(NULL) == 0 && anneal_params_find(NULL, "a") == NULL);
    anneal_params_zero_grad(NULL);
    anneal_params_free(NULL);
    anneal_params_free(ps);
}

TEST(zero_grad_and_free_with_grads) {
    anneal_memory_stats before = anneal_memory_stats_get(ANNEAL_CPU);
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *a = anneal_params_create(ps, "a", 1, (int64_t[]){3}, true);
    anneal_tensor *b = anneal_params_create(ps, "b", 2, (int64_t[]){2, 2}, false);
    REQUIRE(a && b);
    anneal_test_set_grad(a, (float[]){1, 2, 3});
    anneal_test_set_grad(b, (float[]){4, 5, 6, 7});
    CHECK_TRUE(a->grad && anneal_item_at(a->grad, 2) == 3.0 && b->grad);
    anneal_params_zero_grad(ps);
    CHECK_TRUE(a->grad == NULL && b->grad == NULL);
    /* a grad produced by a real backward through the ops */
    anneal_scope *step = anneal_scope_open();
    anneal_tensor *loss = anneal_sum(anneal_mul(a, a));
    REQUIRE(loss && anneal_backward(loss) == ANNEAL_OK);
    anneal_scope_close(step);
    CHECK_TRUE(a->grad != NULL && b->grad == NULL);
    anneal_test_set_grad(b, (float[]){1, 1, 1, 1});
    anneal_params_free(ps); /* frees tensors and their grads */
    anneal_memory_stats after = anneal_memory_stats_get(ANNEAL_CPU);
    CHECK(after.live_bytes == before.live_bytes, "live bytes %lld -> %lld", (long long)before.live_bytes,
          (long long)after.live_bytes);
}

/* Mean, standard deviation and fraction within one std of n floats, in double. */
static void stats(const float *x, int64_t n, double mean0, double std0, double *mean, double *std,
                  double *within1) {
    double s = 0, ss = 0;
    int64_t in1 = 0;
    for (int64_t i = 0; i < n; i++) s += x[i];
    *mean = s / (double)n;
    for (int64_t i = 0; i < n; i++) {
        double d = x[i] - *mean;
        ss += d * d;
        if (fabs(x[i] - mean0) <= std0) in1++;
    }
    *std = sqrt(ss / (double)(n - 1));
    *within1 = (double)in1 / (double)n;
}

TEST(init_normal_statistics) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    const int64_t n = 100000;
    anneal_tensor *w = anneal_params_create(ps, "w", 2, (int64_t[]){250, 400}, true);
    REQUIRE(w);
    anneal_manual_seed(1234);
    anneal_rng_state r0 = anneal_rng_get();
    REQUIRE(anneal_init_normal_(w, 0.0f, 0.02f) == ANNEAL_OK);
    /* the generator advanced by 2 counter values per element, like anneal_randn */
    CHECK(anneal_rng_get().offset == r0.offset + 2 * (uint64_t)n, "offset %llu",
          (unsigned long long)anneal_rng_get().offset);
    const float *x = anneal_data(w);
    double mean, sd, w1;
    stats(x, n, 0.0, 0.02, &mean, &sd, &w1);
    /* Standard errors for n = 1e5: mean 0.02/sqrt(n) = 6.3e-5, std 0.02/sqrt(2n) = 4.5e-5,
     * P(|z| <= 1) = 0.6827 with sqrt(p(1-p)/n) = 1.5e-3. Bounds are 5 standard errors. */
    CHECK(fabs(mean) < 3.2e-4, "mean %g", mean);
    CHECK(fabs(sd - 0.02) < 2.3e-4, "std %g", sd);
    CHECK(fabs(w1 - 0.6827) < 7.5e-3, "within 1 std %g", w1);
    bool finite = true, distinct = false;
    for (int64_t i = 0; i < n; i++) finite &= isfinite(x[i]);
    for (int64_t i = 1; i < n; i++) distinct |= x[i] != x[0];
    CHECK_TRUE(finite && distinct);
    /* non-zero mean, other std */
    anneal_tensor *v = anneal_params_create(ps, "v", 1, (int64_t[]){n}, false);
    REQUIRE(v && anneal_init_normal_(v, 1.5f, 3.0f) == ANNEAL_OK);
    stats(anneal_data(v), n, 1.5, 3.0, &mean, &sd, &w1);
    CHECK(fabs(mean - 1.5) < 5 * 3.0 / sqrt((double)n), "mean %g", mean);
    CHECK(fabs(sd - 3.0) < 5 * 3.0 / sqrt(2.0 * (double)n), "std %g", sd);
    /* std 0 gives exactly the mean */
    REQUIRE(anneal_init_normal_(v, -0.25f, 0.0f) == ANNEAL_OK);
    bool all = true;
    for (int64_t i = 0; i < n; i++) all &= ((float *)anneal_data(v))[i] == -0.25f;
    CHECK_TRUE(all);
    anneal_params_free(ps);
}

TEST(init_normal_seeding) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *a = anneal_params_create(ps, "a", 1, (int64_t[]){1001}, true); /* odd size */
    anneal_tensor *b = anneal_params_create(ps, "b", 1, (int64_t[]){1001}, true);
    anneal_tensor *c = anneal_params_create(ps, "c", 1, (int64_t[]){1001}, true);
    REQUIRE(a && b && c);
    anneal_manual_seed(42);
    REQUIRE(anneal_init_normal_(a, 0, 1) == ANNEAL_OK);
    REQUIRE(anneal_init_normal_(c, 0, 1) == ANNEAL_OK); /* next values of the stream */
    anneal_manual_seed(42);
    REQUIRE(anneal_init_normal_(b, 0, 1) == ANNEAL_OK);
    CHECK(memcmp(anneal_data(a), anneal_data(b), 1001 * sizeof(float)) == 0, "same seed, different values");
    int same = 0;
    for (int i = 0; i < 1001; i++) same += ((float *)anneal_data(a))[i] == ((float *)anneal_data(c))[i];
    CHECK(same == 0, "consecutive draws share %d values", same);
    anneal_manual_seed(43);
    REQUIRE(anneal_init_normal_(b, 0, 1) == ANNEAL_OK);
    same = 0;
    for (int i = 0; i < 1001; i++) same += ((float *)anneal_data(a))[i] == ((float *)anneal_data(b))[i];
    CHECK(same == 0, "different seeds share %d values", same);
    /* the same stream as anneal_randn */
    anneal_scope *s = anneal_scope_open();
    anneal_manual_seed(42);
    anneal_tensor *r = anneal_randn(ANNEAL_F32, 1, (int64_t[]){1001}, 0, 1);
    REQUIRE(r);
    CHECK(memcmp(anneal_data(a), anneal_data(r), 1001 * sizeof(float)) == 0, "differs from anneal_randn");
    anneal_scope_close(s);
    anneal_params_free(ps);
}

TEST(init_strided_and_bf16) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *p = anneal_params_create(ps, "p", 2, (int64_t[]){3, 4}, true);
    REQUIRE(p);
    anneal_scope *s = anneal_scope_open();
    /* transposed view (4, 3) of p: element (i, j) is p[j, i] */
    anneal_tensor *pt = anneal_alias(p, 2, (int64_t[]){4, 3}, (int64_t[]){1, 4}, 0);
    REQUIRE(pt);
    anneal_manual_seed(7);
    REQUIRE(anneal_init_normal_(pt, 0.5f, 2.0f) == ANNEAL_OK);
    anneal_manual_seed(7);
    anneal_tensor *r = anneal_randn(ANNEAL_F32, 2, (int64_t[]){4, 3}, 0.5f, 2.0f);
    REQUIRE(r);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++)
            CHECK(anneal_item_at(p, j * 4 + i) == anneal_item_at(r, i * 3 + j), "(%d, %d)", i, j);
    /* fill through a strided view: only the viewed column changes */
    anneal_tensor *col = anneal_alias(p, 1, (int64_t[]){3}, (int64_t[]){4}, 1);
    REQUIRE(col && anneal_init_fill_(col, 9.0f) == ANNEAL_OK);
    for (int i = 0; i < 12; i++) {
        if (i % 4 == 1) CHECK(anneal_item_at(p, i) == 9.0, "filled %d", i);
        else CHECK(anneal_item_at(p, i) != 9.0, "untouched %d", i);
    }
    /* bf16 target: the f32 draw rounded to bf16 */
    anneal_tensor *h = anneal_empty(ANNEAL_BF16, 1, (int64_t[]){64});
    REQUIRE(h);
    anneal_manual_seed(9);
    REQUIRE(anneal_init_normal_(h, 0, 1) == ANNEAL_OK);
    anneal_manual_seed(9);
    anneal_tensor *hf = anneal_randn(ANNEAL_F32, 1, (int64_t[]){64}, 0, 1);
    REQUIRE(hf);
    const uint16_t *hb = anneal_data(h);
    const float *hv = anneal_data(hf);
    int bad = 0;
    for (int i = 0; i < 64; i++) bad += hb[i] != anneal_f32_to_bf16(hv[i]);
    CHECK(bad == 0, "%d bf16 values differ", bad);
    REQUIRE(anneal_init_fill_(h, 1.5f) == ANNEAL_OK);
    CHECK_TRUE(anneal_item_at(h, 63) == 1.5);
    /* fill on the parameter itself */
    REQUIRE(anneal_init_fill_(p, -2.0f) == ANNEAL_OK);
    for (int i = 0; i < 12; i++) CHECK_TRUE(anneal_item_at(p, i) == -2.0);
    /* empty tensor: nothing to do, generator untouched */
    anneal_tensor *e = anneal_empty(ANNEAL_F32, 1, (int64_t[]){0});
    anneal_rng_state r0 = anneal_rng_get();
    CHECK_TRUE(anneal_init_normal_(e, 0, 1) == ANNEAL_OK && anneal_rng_get().offset == r0.offset);
    anneal_scope_close(s);
    anneal_params_free(ps);
}

TEST(init_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_clear_error();
    CHECK_TRUE(anneal_init_normal_(NULL, 0, 1) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_init_fill_(NULL, 0) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_tensor *i = anneal_zeros(ANNEAL_I32, 1, (int64_t[]){4});
    CHECK_TRUE(anneal_init_normal_(i, 0, 1) == ANNEAL_ERR_DTYPE);
    CHECK(strstr(anneal_last_error(), "float") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    anneal_tensor *f = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){4});
    CHECK_TRUE(anneal_init_normal_(f, 0, -1) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_init_normal_(f, NAN, 1) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    for (int k = 0; k < 4; k++) CHECK_TRUE(anneal_item_at(f, k) == 0.0); /* untouched */
    /* fill works on integer tensors too */
    CHECK_TRUE(anneal_init_fill_(i, 3.0f) == ANNEAL_OK && anneal_item_at(i, 3) == 3.0);
    anneal_scope_close(s);
}

int main(void) {
    RUN(create_find_numel);
    RUN(duplicates_and_errors);
    RUN(zero_grad_and_free_with_grads);
    RUN(init_normal_statistics);
    RUN(init_normal_seeding);
    RUN(init_strided_and_bf16);
    RUN(init_errors);
    return anneal_test_summary();
}
