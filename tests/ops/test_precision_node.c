/* The compute precision is a value an op gets and records on its autograd node; the
 * backward's products run at it with nothing set anywhere else. A forward at bf16 gives
 * gradients equal, bit for bit, to the bf16 products written out by hand (dA = dC B^T,
 * dB = A^T dC; dx = dy W^T, dW = x^T dy), and different from the f32 ones (a negative
 * control: the recorded value reaches the kernels). */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

#include <string.h>

static float *host(const anneal_tensor *t) {
    float *b = malloc((size_t)anneal_numel(t) * sizeof *b + 4);
    anneal_to_f32_buffer(t, b);
    return b;
}

static bool same(const anneal_tensor *a, const anneal_tensor *b) {
    float *x = host(a), *y = host(b);
    bool eq = anneal_numel(a) == anneal_numel(b) && !memcmp(x, y, (size_t)anneal_numel(a) * sizeof(float));
    free(x), free(y);
    return eq;
}

/* The product by hand, without autograd. */
static anneal_tensor *mm(anneal_tensor *a, anneal_tensor *b, anneal_dtype dt) {
    anneal_no_grad_begin();
    anneal_tensor *c = anneal_matmul_ex(a, b, dt);
    anneal_no_grad_end();
    return c;
}

TEST(matmul_backward_runs_at_the_recorded_precision) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = anneal_test_rand(2, (int64_t[]){19, 33}, -1, 1, 1, true);
    anneal_tensor *b = anneal_test_rand(2, (int64_t[]){33, 21}, -1, 1, 2, true);
    anneal_tensor *G = anneal_test_rand(2, (int64_t[]){19, 21}, -1, 1, 3, false);
    anneal_tensor *L = anneal_sum(anneal_mul(anneal_matmul_ex(a, b, ANNEAL_BF16), G));
    REQUIRE(L && anneal_backward(L) == ANNEAL_OK);
    anneal_tensor *at = anneal_transpose(a, 0, 1), *bt = anneal_transpose(b, 0, 1);
    CHECK(same(a->grad, mm(G, bt, ANNEAL_BF16)), "dA is not the bf16 product dC B^T");
    CHECK(same(b->grad, mm(at, G, ANNEAL_BF16)), "dB is not the bf16 product A^T dC");
    CHECK(!same(a->grad, mm(G, bt, ANNEAL_F32)) && !same(b->grad, mm(at, G, ANNEAL_F32)),
          "the bf16 gradients equal the f32 products: the precision did not reach the backward");
    anneal_scope_close(s);
}

TEST(dense_backward_runs_at_the_recorded_precision) {
    anneal_scope *s = anneal_scope_open();
    const int64_t R = 26, K = 40, N = 30;
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){R, K}, -1, 1, 4, true);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){K, N}, -1, 1, 5, true);
    anneal_tensor *b = anneal_test_rand(1, &N, -1, 1, 6, true);
    anneal_tensor *G = anneal_test_rand(2, (int64_t[]){R, N}, -1, 1, 7, false);
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_IN_OUT, .compute = ANNEAL_BF16};
    anneal_tensor *L = anneal_sum(anneal_mul(anneal_dense(x, w, b, &o), G));
    REQUIRE(L && anneal_backward(L) == ANNEAL_OK);
    anneal_tensor *xt = anneal_transpose(x, 0, 1), *wt = anneal_transpose(w, 0, 1);
    CHECK(same(x->grad, mm(G, wt, ANNEAL_BF16)), "dx is not the bf16 product dy W^T");
    CHECK(same(w->grad, mm(xt, G, ANNEAL_BF16)), "dW is not the bf16 product x^T dy");
    CHECK(!same(x->grad, mm(G, wt, ANNEAL_F32)) && !same(w->grad, mm(xt, G, ANNEAL_F32)),
          "the bf16 gradients equal the f32 products");
    anneal_scope_close(s);
}

/* Gradients of q, k, v (concatenated) of sum(attention(q, k, v) * G) at `dt`. */
static float *attention_grads(anneal_dtype dt) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x[3];
    for (int i = 0; i < 3; i++) x[i] = anneal_test_rand(4, (int64_t[]){1, 2, 70, 16}, -1, 1, 10 + (uint64_t)i, true);
    anneal_attention_opts o = {.causal = true, .compute = dt};
    anneal_tensor *y = anneal_attention_ex(x[0], x[1], x[2], &o);
    anneal_tensor *G = anneal_test_rand(4, (int64_t[]){1, 2, 70, 16}, -1, 1, 13, false);
    anneal_tensor *L = anneal_sum(anneal_mul(y, G));
    float *g = malloc(3 * 2240 * sizeof *g);
    if (!L || anneal_backward(L) != ANNEAL_OK) {
        free(g);
        g = NULL;
    } else {
        for (int i = 0; i < 3; i++) anneal_to_f32_buffer(x[i]->grad, g + i * 2240);
    }
    anneal_scope_close(s);
    return g;
}

TEST(attention_backward_runs_at_the_recorded_precision) {
    float *b1 = attention_grads(ANNEAL_BF16), *b2 = attention_grads(ANNEAL_BF16), *f = attention_grads(ANNEAL_F32);
    REQUIRE(b1 && b2 && f);
    CHECK(!memcmp(b1, b2, 3 * 2240 * sizeof(float)), "bf16 attention gradients are not reproducible");
    CHECK(memcmp(b1, f, 3 * 2240 * sizeof(float)) != 0, "bf16 attention gradients equal the f32 ones");
    free(b1), free(b2), free(f);
}

int main(void) {
    RUN(matmul_backward_runs_at_the_recorded_precision);
    RUN(dense_backward_runs_at_the_recorded_precision);
    RUN(attention_backward_runs_at_the_recorded_precision);
    return anneal_test_summary();
}
