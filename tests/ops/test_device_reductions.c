/* The device-side pieces the losses and the embedding use instead of reading tensor
 * memory on the host: check_index (the exact error text of each op: value, multi-index
 * position, flat index, V and ignore_index; the kept-row count), loss_mean (the mean over
 * kept rows in double in row order, as the ops took it on the host), scale_by (a factor
 * known on the device), and the device-made tensors arange and to_device. */
#include "anneal/anneal.h"
#include "test.h"

#include <string.h>

static void expect_message(anneal_tensor *r, const char *want, const char *what) {
    CHECK(r == NULL, "%s: expected NULL", what);
    CHECK(anneal_last_status() == ANNEAL_ERR_ARG, "%s: status %s", what, anneal_status_name(anneal_last_status()));
    CHECK(!strcmp(anneal_last_error(), want), "%s: message\n    '%s'\n want '%s'", what, anneal_last_error(), want);
    anneal_clear_error();
}

TEST(check_index_messages) {
    anneal_scope *s = anneal_scope_open();
    anneal_clear_error();
    anneal_tensor *logits = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 3, 5});
    int32_t tv[6] = {0, -100, 4, 1, 2, 7};
    anneal_tensor *t = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){2, 3}, tv);
    expect_message(anneal_cross_entropy(logits, t, -100),
                   "cross_entropy: target 7 at position [1, 2] (flat index 5) is outside [0, V) with V = 5 and is "
                   "not ignore_index (-100)",
                   "cross_entropy");
    anneal_tensor *w = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){5, 4});
    anneal_tensor *h = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 3, 4});
    expect_message(anneal_linear_cross_entropy(h, w, t, -100),
                   "linear_cross_entropy: target 7 at position [1, 2] (flat index 5) is outside [0, V) with V = 5 and "
                   "is not ignore_index (-100)",
                   "linear_cross_entropy");
    /* -100 is a bad target when the ignore index is another value */
    expect_message(anneal_cross_entropy(logits, t, 3),
                   "cross_entropy: target -100 at position [0, 1] (flat index 1) is outside [0, V) with V = 5 and "
                   "is not ignore_index (3)",
                   "ignore 3");
    int32_t iv[4] = {3, 0, 2, -1};
    anneal_tensor *ids = anneal_from_data(ANNEAL_I32, 3, (int64_t[]){1, 2, 2}, iv);
    expect_message(anneal_embedding(ids, w),
                   "embedding: id -1 at position [0, 1, 1] (flat index 3) is outside [0, V) with V = 5", "embedding");
    anneal_scope_close(s);
}

TEST(check_index_counts_kept_rows) {
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    REQUIRE(be && be->check_index);
    anneal_scope *s = anneal_scope_open();
    int32_t tv[7] = {-100, 1, 2, -100, 0, 4, -100};
    anneal_tensor *t = anneal_from_data(ANNEAL_I32, 1, (int64_t[]){7}, tv);
    anneal_tensor *count = anneal_empty(ANNEAL_I64, 0, NULL);
    REQUIRE(be->check_index(be->ctx, "t", "target", t, 5, true, -100, count) == ANNEAL_OK);
    CHECK(anneal_item(count) == 4, "count %g", anneal_item(count));
    REQUIRE(be->check_index(be->ctx, "t", "id", t, 5, true, 2, count) == ANNEAL_ERR_ARG); /* -100 not ignored */
    anneal_clear_error();
    anneal_scope_close(s);
}

/* loss_mean: (float)(sum in double, row order, kept rows / count); the op's loss is it. */
TEST(loss_mean_is_the_host_arithmetic) {
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    anneal_scope *s = anneal_scope_open();
    const int64_t N = 9;
    float rows[9] = {0.1f, 1e7f, 3.25f, -0.3f, 1e-8f, 7.0f, 2.5f, 1.0f / 3.0f, 11.0f};
    int32_t tv[9] = {0, 1, -100, 2, 3, -100, 1, 0, 2};
    double sum = 0;
    int64_t kept = 0;
    for (int64_t i = 0; i < N; i++)
        if (tv[i] != -100) sum += (double)rows[i], kept++;
    float want = (float)(sum / (double)kept);
    anneal_tensor *r = anneal_from_data(ANNEAL_F32, 1, &N, rows), *t = anneal_from_data(ANNEAL_I32, 1, &N, tv);
    anneal_tensor *count = anneal_empty(ANNEAL_I64, 0, NULL), *out = anneal_empty(ANNEAL_F32, 0, NULL);
    REQUIRE(be->check_index(be->ctx, "t", "target", t, 5, true, -100, count) == ANNEAL_OK);
    REQUIRE(be->loss_mean(be->ctx, out, r, t, -100, count) == ANNEAL_OK);
    CHECK((float)anneal_item(out) == want, "%.9g vs %.9g", anneal_item(out), (double)want);
    /* everything ignored: 0, not NaN */
    int32_t all[9] = {-100, -100, -100, -100, -100, -100, -100, -100, -100};
    anneal_tensor *ti = anneal_from_data(ANNEAL_I32, 1, &N, all);
    REQUIRE(be->check_index(be->ctx, "t", "target", ti, 5, true, -100, count) == ANNEAL_OK);
    REQUIRE(be->loss_mean(be->ctx, out, r, ti, -100, count) == ANNEAL_OK);
    CHECK_TRUE(anneal_item(out) == 0.0);
    anneal_scope_close(s);
}

/* scale_by: x *= (float)(s * f), f = factor (/ count when given and not 0); no-op at 1. */
TEST(scale_by_uses_device_scalars) {
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    anneal_scope *s = anneal_scope_open();
    float xv[5] = {1, -2, 3.5f, 1e-3f, 0};
    anneal_tensor *x = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){5}, xv);
    anneal_tensor *sc = anneal_scalar(2.5f);
    int64_t n = 7;
    anneal_tensor *count = anneal_from_data(ANNEAL_I64, 0, NULL, &n);
    REQUIRE(be->scale_by(be->ctx, x, sc, count, 1.0 / 32768.0) == ANNEAL_OK);
    float c = (float)(2.5 * ((1.0 / 32768.0) / 7.0)), got[5];
    CHECK_TRUE(c == (float)(2.5 * (1.0 / (7.0 * 32768.0)))); /* the f16 loss factor, either way */
    REQUIRE(anneal_to_f32_buffer(x, got) == ANNEAL_OK);
    for (int i = 0; i < 5; i++) CHECK(got[i] == c * xv[i], "[%d] %g vs %g", i, (double)got[i], (double)(c * xv[i]));
    REQUIRE(be->scale_by(be->ctx, x, NULL, NULL, 4.0) == ANNEAL_OK);
    float again[5];
    REQUIRE(anneal_to_f32_buffer(x, again) == ANNEAL_OK);
    for (int i = 0; i < 5; i++) CHECK_TRUE(again[i] == 4.0f * got[i]);
    anneal_scope_close(s);
}

TEST(arange_values_and_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = anneal_arange(ANNEAL_CPU, 5, 4);
    REQUIRE(a && a->dtype == ANNEAL_I32 && a->ndim == 1 && a->shape[0] == 4);
    for (int i = 0; i < 4; i++) CHECK_TRUE(anneal_item_at(a, i) == 5 + i);
    anneal_tensor *e = anneal_arange(ANNEAL_CPU, 0, 0);
    CHECK_TRUE(e && anneal_numel(e) == 0);
    anneal_tensor *big = anneal_arange(ANNEAL_CPU, 100, 5000); /* beyond the stack buffer */
    REQUIRE(big);
    CHECK_TRUE(anneal_item_at(big, 4999) == 5099);
    anneal_clear_error();
    CHECK_TRUE(anneal_arange(ANNEAL_CPU, 0, -1) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_arange(ANNEAL_CPU, INT32_MAX, 2) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_arange(ANNEAL_CPU, INT32_MAX, 1) != NULL);
    CHECK_TRUE(anneal_arange((anneal_device)7, 0, 3) == NULL && anneal_last_status() == ANNEAL_ERR_DEVICE);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(check_index_messages);
    RUN(check_index_counts_kept_rows);
    RUN(loss_mean_is_the_host_arithmetic);
    RUN(scale_by_uses_device_scalars);
    RUN(arange_values_and_errors);
    return anneal_test_summary();
}
