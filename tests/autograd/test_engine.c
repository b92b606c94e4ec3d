/* The autograd engine: accumulation, shared inputs, no-grad, freeing the graph,
 * grad-ready hooks, errors, and recompute regions (activation checkpointing). */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

static anneal_tensor *leaf(float v0, float v1, float v2) {
    anneal_tensor *t = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){3}, (float[]){v0, v1, v2});
    anneal_set_requires_grad(t, true);
    return t;
}

TEST(shared_input_and_accumulation) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = leaf(1, 2, 3);
    /* y = sum(x*x + 3x) -> dy/dx = 2x + 3 */
    anneal_tensor *y = anneal_sum(anneal_add(anneal_mul(x, x), anneal_scale(x, 3)));
    REQUIRE(anneal_backward(y) == ANNEAL_OK);
    for (int i = 0; i < 3; i++) CHECK_NEAR(anneal_item_at(x->grad, i), 2 * (i + 1) + 3, 1e-6);
    /* a second forward/backward accumulates */
    anneal_tensor *z = anneal_sum(anneal_scale(x, 10));
    REQUIRE(anneal_backward(z) == ANNEAL_OK);
    for (int i = 0; i < 3; i++) CHECK_NEAR(anneal_item_at(x->grad, i), 2 * (i + 1) + 13, 1e-6);
    anneal_grad_clear(x);
    CHECK_TRUE(x->grad == NULL);
    anneal_scope_close(s);
}

TEST(backward_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = leaf(1, 2, 3);
    anneal_tensor *y = anneal_mul(x, x);
    anneal_clear_error();
    CHECK_TRUE(anneal_backward(y) == ANNEAL_ERR_SHAPE); /* not a scalar */
    anneal_clear_error();
    anneal_tensor *l = anneal_sum(y);
    CHECK_TRUE(anneal_backward(l) == ANNEAL_OK);
    CHECK_TRUE(anneal_backward(l) == ANNEAL_ERR_STATE); /* graph already freed */
    CHECK(strstr(anneal_last_error(), "second time") != NULL, "%s", anneal_last_error());
    anneal_clear_error();
    anneal_tensor *c = anneal_sum(anneal_from_data(ANNEAL_F32, 1, (int64_t[]){2}, (float[]){1, 2}));
    CHECK_TRUE(anneal_backward(c) == ANNEAL_ERR_STATE); /* nothing requires grad */
    anneal_clear_error();
    CHECK_TRUE(anneal_backward(NULL) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_scope_close(s);
}

TEST(no_grad_records_nothing) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = leaf(1, 2, 3);
    anneal_no_grad_begin();
    anneal_tensor *y = anneal_mul(x, x);
    anneal_no_grad_end();
    CHECK_TRUE(!y->requires_grad && y->grad_fn == NULL);
    anneal_tensor *z = anneal_mul(x, x);
    CHECK_TRUE(z->requires_grad && z->grad_fn != NULL);
    anneal_scope_close(s);
}

TEST(graph_memory_is_released) {
    int64_t live0 = anneal_memory_stats_get(ANNEAL_CPU).live_bytes;
    anneal_scope *params = anneal_scope_open();
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){64, 64}, -1, 1, 1, true);
    anneal_scope *step = anneal_scope_open();
    anneal_tensor *h = w;
    for (int i = 0; i < 2000; i++) h = anneal_gelu(anneal_add(h, w), true); /* deep chain */
    REQUIRE(anneal_backward(anneal_mean(h)) == ANNEAL_OK);
    anneal_scope_close(step);
    /* only w and its grad remain */
    CHECK(anneal_memory_stats_get(ANNEAL_CPU).live_bytes - live0 == 2 * 64 * 64 * 4, "live %lld",
          (long long)(anneal_memory_stats_get(ANNEAL_CPU).live_bytes - live0));
    anneal_scope_close(params);
    CHECK_TRUE(anneal_memory_stats_get(ANNEAL_CPU).live_bytes == live0);
}

typedef struct {
    int calls[4];
    double grad_at_call[4];
    anneal_tensor *leaves[4];
    int order[8], n;
} hook_log;

static void on_ready(anneal_tensor *t, void *user) {
    hook_log *h = user;
    for (int i = 0; i < 4; i++)
        if (h->leaves[i] == t) {
            h->calls[i]++;
            h->grad_at_call[i] = t->grad ? anneal_item_at(t->grad, 0) : NAN;
            h->order[h->n++] = i;
        }
}

TEST(grad_ready_hook_fires_after_last_contribution) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = leaf(1, 1, 1), *b = leaf(2, 2, 2), *c = leaf(3, 3, 3);
    hook_log log = {.leaves = {a, b, c, NULL}};
    anneal_set_grad_ready_hook(on_ready, &log);
    /* a used first and last; b in the middle; c only at the end */
    anneal_tensor *h = anneal_mul(a, b);
    h = anneal_add(h, anneal_scale(b, 2));
    h = anneal_mul(h, anneal_add(a, c));
    REQUIRE(anneal_backward(anneal_sum(h)) == ANNEAL_OK);
    anneal_set_grad_ready_hook(NULL, NULL);
    for (int i = 0; i < 3; i++) CHECK(log.calls[i] == 1, "leaf %d hook called %d times", i, log.calls[i]);
    for (int i = 0; i < 3; i++)
        CHECK_NEAR(log.grad_at_call[i], anneal_item_at(log.leaves[i]->grad, 0), 0);
    /* c's only use is the last op: it is ready first */
    CHECK_TRUE(log.n == 3 && log.order[0] == 2);
    anneal_scope_close(s);
}

/* region: gelu(x * w1) * w2 + dropout(x) */
typedef struct {
    anneal_tensor *w1, *w2;
    int runs;
} region;

static anneal_tensor *region_fn(void *ctx, anneal_tensor *const *in) {
    region *r = ctx;
    r->runs++;
    anneal_tensor *h = anneal_gelu(anneal_mul(in[0], r->w1), true);
    return anneal_add(anneal_mul(h, r->w2), anneal_dropout(in[0], 0.3f, true));
}

static anneal_tensor *with_region(void *ctx, anneal_tensor *const *in) {
    anneal_manual_seed(5);
    anneal_tensor *y = anneal_checkpoint(region_fn, ctx, 1, in);
    return anneal_scale(y, 2.0f);
}

static anneal_tensor *without_region(void *ctx, anneal_tensor *const *in) {
    anneal_manual_seed(5);
    return anneal_scale(region_fn(ctx, in), 2.0f);
}

TEST(checkpoint_matches_plain_and_frees_activations) {
    anneal_scope *s = anneal_scope_open();
    region r = {anneal_test_rand(2, (int64_t[]){4, 8}, -1, 1, 2, true),
                anneal_test_rand(1, (int64_t[]){8}, -1, 1, 3, true), 0};
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){4, 8}, -1, 1, 4, true);
    /* plain */
    anneal_scope *a = anneal_scope_open();
    REQUIRE(anneal_backward(anneal_sum(without_region(&r, &x))) == ANNEAL_OK);
    int64_t plain_count = anneal_scope_count(a);
    anneal_scope_close(a);
    float gx[32], gw1[32], gw2[8];
    anneal_to_f32_buffer(x->grad, gx);
    anneal_to_f32_buffer(r.w1->grad, gw1);
    anneal_to_f32_buffer(r.w2->grad, gw2);
    anneal_grad_clear(x);
    anneal_grad_clear(r.w1);
    anneal_grad_clear(r.w2);
    /* checkpointed: forward keeps fewer tensors, backward runs the region again */
    hook_log log = {.leaves = {x, r.w1, r.w2, NULL}};
    anneal_set_grad_ready_hook(on_ready, &log);
    r.runs = 0;
    anneal_scope *b = anneal_scope_open();
    anneal_tensor *loss = anneal_sum(with_region(&r, &x));
    int64_t ckpt_count = anneal_scope_count(b);
    CHECK(r.runs == 1, "region ran %d times in forward", r.runs);
    REQUIRE(anneal_backward(loss) == ANNEAL_OK);
    CHECK(r.runs == 2, "region must be recomputed once in backward (ran %d)", r.runs);
    anneal_scope_close(b);
    anneal_set_grad_ready_hook(NULL, NULL);
    CHECK(ckpt_count < plain_count, "checkpoint keeps %lld tensors, plain %lld", (long long)ckpt_count,
          (long long)plain_count);
    float cx[32], cw1[32], cw2[8];
    anneal_to_f32_buffer(x->grad, cx);
    anneal_to_f32_buffer(r.w1->grad, cw1);
    anneal_to_f32_buffer(r.w2->grad, cw2);
    CHECK(memcmp(gx, cx, sizeof gx) == 0, "input grad differs under checkpointing");
    CHECK(memcmp(gw1, cw1, sizeof gw1) == 0, "w1 grad differs under checkpointing");
    CHECK(memcmp(gw2, cw2, sizeof gw2) == 0, "w2 grad differs under checkpointing");
    for (int i = 0; i < 3; i++) CHECK(log.calls[i] == 1, "leaf %d ready hook called %d times", i, log.calls[i]);
    anneal_scope_close(s);
}

TEST(checkpoint_gradcheck) {
    anneal_scope *s = anneal_scope_open();
    region r = {anneal_test_rand(2, (int64_t[]){3, 5}, -1, 1, 6, true),
                anneal_test_rand(1, (int64_t[]){5}, -1, 1, 7, true), 0};
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){3, 5}, -1, 1, 8, true);
    /* w1 and w2 are used inside the region through ctx; listing them as inputs makes
     * the checker perturb them too (the region only receives in[0]) */
    anneal_tensor *in[3] = {x, r.w1, r.w2};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.19% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(with_region, &r, 3, in, 1e-2, 2e-5, 2e-4);
    anneal_scope_close(s);
}

int main(void) {
    RUN(shared_input_and_accumulation);
    RUN(backward_errors);
    RUN(no_grad_records_nothing);
    RUN(graph_memory_is_released);
    RUN(grad_ready_hook_fires_after_last_contribution);
    RUN(checkpoint_matches_plain_and_frees_activations);
    RUN(checkpoint_gradcheck);
    return anneal_test_summary();
}
