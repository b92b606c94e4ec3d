/* Embedding op: gathered rows against the weight table, shapes for ids of any rank,
 * the weight gradient with repeated ids (finite differences and an exact
 * scatter-add reference), and the errors for bad ids, dtypes and shapes. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

#define V 10
#define C 7

static anneal_tensor *ids_tensor(int ndim, const int64_t *shape, const int32_t *v) {
    return anneal_from_data(ANNEAL_I32, ndim, shape, v);
}

TEST(embedding_values) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){V, C}, -1, 1, 1, false);
    int32_t idv[6] = {1, 3, 1, 9, 0, 3};
    anneal_tensor *ids = ids_tensor(2, (int64_t[]){2, 3}, idv);
    anneal_tensor *y = anneal_embedding(ids, w);
    REQUIRE(y);
    CHECK(y->ndim == 3 && y->shape[0] == 2 && y->shape[1] == 3 && y->shape[2] == C, "shape");
    /* a gather copies: exact equality */
    for (int i = 0; i < 6; i++)
        for (int c = 0; c < C; c++)
            CHECK_NEAR(anneal_item_at(y, i * C + c), anneal_item_at(w, idv[i] * C + c), 0);
    /* 0-dim ids -> (C) */
    anneal_tensor *one = anneal_embedding(ids_tensor(0, NULL, (int32_t[]){4}), w);
    REQUIRE(one);
    CHECK(one->ndim == 1 && one->shape[0] == C, "0-dim ids shape");
    for (int c = 0; c < C; c++) CHECK_NEAR(anneal_item_at(one, c), anneal_item_at(w, 4 * C + c), 0);
    /* transposed (non-contiguous) ids and a transposed weight */
    anneal_tensor *idt = anneal_transpose(ids, 0, 1); /* (3, 2) */
    anneal_tensor *wt = anneal_transpose(anneal_test_rand(2, (int64_t[]){C, V}, -1, 1, 2, false), 0, 1);
    anneal_tensor *yt = anneal_embedding(idt, wt);
    REQUIRE(yt && !anneal_is_contiguous(idt) && !anneal_is_contiguous(wt));
    CHECK(yt->ndim == 3 && yt->shape[0] == 3 && yt->shape[1] == 2, "transposed shape");
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < C; c++)
                CHECK_NEAR(anneal_item_at(yt, (a * 2 + b) * C + c),
                           anneal_item_at(wt, idv[b * 3 + a] * C + c), 0);
    /* empty ids -> (0, C) */
    anneal_tensor *ye = anneal_embedding(anneal_zeros(ANNEAL_I32, 1, (int64_t[]){0}), w);
    CHECK(ye && ye->ndim == 2 && ye->shape[0] == 0 && ye->shape[1] == C, "empty ids");
    anneal_scope_close(s);
}

typedef struct emb_case {
    anneal_tensor *ids;
    bool transpose_w;
} emb_case;

static anneal_tensor *f_embedding(void *ctx, anneal_tensor *const *in) {
    const emb_case *c = ctx;
    return anneal_embedding(c->ids, c->transpose_w ? anneal_transpose(in[0], 0, 1) : in[0]);
}

/* Repeated ids (1 three times, 3 twice) accumulate; unused rows get 0. The op is
 * linear in w, so finite differences are exact up to f32 rounding: atol 1e-3, rtol 1e-3. */
TEST(embedding_gradients) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *ids = ids_tensor(2, (int64_t[]){2, 4}, (int32_t[]){1, 3, 1, 9, 1, 3, 0, 0});
    emb_case c = {ids, false};
    anneal_tensor *w[1] = {anneal_test_rand(2, (int64_t[]){V, C}, -1, 1, 3, true)};
    /* tolerance was atol 1e-3 rtol 1e-3; worst measured 0.0042% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_embedding, &c, 1, w, 1e-2, 1e-5, 1e-5);
    emb_case ct = {ids, true};
    anneal_tensor *wt[1] = {anneal_test_rand(2, (int64_t[]){C, V}, -1, 1, 4, true)};
    /* tolerance was atol 1e-3 rtol 1e-3; worst measured 0.0042% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_embedding, &ct, 1, wt, 1e-2, 1e-5, 1e-5);
    anneal_scope_close(s);
}

/* dW against an exact double scatter-add of dy = upstream weights G. */
TEST(embedding_grad_scatter_add) {
    anneal_scope *s = anneal_scope_open();
    int32_t idv[9] = {2, 2, 2, 5, 0, 5, 2, 7, 0};
    anneal_tensor *ids = ids_tensor(2, (int64_t[]){3, 3}, idv);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){V, C}, -1, 1, 5, true);
    anneal_tensor *g = anneal_test_rand(3, (int64_t[]){3, 3, C}, -1, 1, 6, false);
    anneal_tensor *y = anneal_embedding(ids, w);
    REQUIRE(y && anneal_backward_grad(y, g) == ANNEAL_OK && w->grad);
    CHECK_TRUE(!ids->requires_grad && ids->grad == NULL); /* integer ids get no gradient */
    float ref[V * C] = {0}, got[V * C];
    double acc[V * C] = {0};
    for (int i = 0; i < 9; i++)
        for (int c = 0; c < C; c++) acc[idv[i] * C + c] += anneal_item_at(g, i * C + c);
    for (int k = 0; k < V * C; k++) ref[k] = (float)acc[k];
    anneal_to_f32_buffer(w->grad, got);
    /* sums of up to 4 values in [-1, 1] in f32: 1e-6 */
    CHECK_ALLCLOSE(got, ref, V * C, 1e-6, 1e-6);
    anneal_clear_error();
    CHECK_TRUE(anneal_set_requires_grad(ids, true) != ANNEAL_OK); /* ids cannot require grad */
    anneal_clear_error();
    anneal_scope_close(s);
}

TEST(embedding_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *w = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){V, C});
    anneal_clear_error();
    anneal_tensor *neg = ids_tensor(2, (int64_t[]){2, 3}, (int32_t[]){0, 1, 2, 3, 4, -1});
    CHECK_TRUE(anneal_embedding(neg, w) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    const char *m = anneal_last_error();
    CHECK(strstr(m, "id -1") && strstr(m, "[1, 2]") && strstr(m, "V = 10"), "message: %s", m);
    anneal_clear_error();
    anneal_tensor *big = ids_tensor(1, (int64_t[]){4}, (int32_t[]){0, 9, 10, 3});
    CHECK_TRUE(anneal_embedding(big, w) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    m = anneal_last_error();
    CHECK(strstr(m, "id 10") && strstr(m, "[2]") && strstr(m, "V = 10"), "message: %s", m);
    anneal_clear_error();
    /* f32 ids, i32 weight, 1-D weight */
    CHECK_TRUE(anneal_embedding(anneal_zeros(ANNEAL_F32, 1, (int64_t[]){3}), w) == NULL &&
               anneal_last_status() == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    anneal_tensor *ok_ids = ids_tensor(1, (int64_t[]){2}, (int32_t[]){0, 1});
    CHECK_TRUE(anneal_embedding(ok_ids, anneal_zeros(ANNEAL_I32, 2, (int64_t[]){V, C})) == NULL &&
               anneal_last_status() == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_embedding(ok_ids, anneal_zeros(ANNEAL_F32, 1, (int64_t[]){V})) == NULL &&
               anneal_last_status() == ANNEAL_ERR_SHAPE);
    CHECK(strstr(anneal_last_error(), "(V, C)") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_embedding(NULL, w) == NULL);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(embedding_values);
    RUN(embedding_gradients);
    RUN(embedding_grad_scatter_add);
    RUN(embedding_errors);
    return anneal_test_summary();
}
