/* Tensor parallelism's pieces (src/parallel/tp.c, the tensor-parallel GPT-2 blocks):
 * f and g forward and backward; the slicing of a packed [q | k | v] projection and its
 * gather back; a column-parallel dense layer followed by a row-parallel one (f, the
 * shards, g) against the unsharded pair; and a whole tiny GPT-2 sharded over the world
 * against the unsharded model: loss and every gradient.
 *
 * Runs at world 1 (the single-process communicator: f and g are identities, the shards
 * the whole) and under mpirun -np 2 (dist_test.h). Tolerances: the row-parallel product
 * sums each output over half the inner dimension on each rank and adds the halves (g),
 * a float sum in another order than the unsharded GEMM's: a few ulps of the largest
 * partial sums. Outputs and gradients are held to 1e-5 absolute + 1e-4 relative
 * (values are O(0.1..10)); an off-by-one shard, a wrong packing or a missing reduce
 * is off by O(1). */
#include "dist_test.h"

#include "anneal/gpt2.h"

#include <math.h>
#include <string.h>

#define ATOL 1e-5
#define RTOL 1e-4

/* g: the sum over ranks forward, the identity backward; f: the identity forward, the
 * gradient summed over ranks backward. */
TEST(f_and_g_values) {
    int r = dt_rank(), w = dt_world();
    float tri = (float)(w * (w + 1)) / 2.0f; /* sum over ranks of (rank + 1) */
    anneal_scope *sc = anneal_scope_open();
    float base[3] = {1.0f, -2.0f, 0.5f}, xs[3];
    for (int i = 0; i < 3; i++) xs[i] = base[i] * (float)(r + 1);
    anneal_tensor *x = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){3}, xs);
    REQUIRE(x && anneal_set_requires_grad(x, true) == ANNEAL_OK);
    /* g */
    anneal_tensor *y = anneal_tp_reduce_out(g_comm, x);
    REQUIRE(y);
    for (int i = 0; i < 3; i++) CHECK(anneal_item_at(y, i) == base[i] * tri, "g forward [%d] = %g", i, anneal_item_at(y, i));
    float ws[3] = {3.0f, 4.0f, 5.0f};
    anneal_tensor *wt = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){3}, ws);
    REQUIRE(anneal_backward(anneal_sum(anneal_mul(y, wt))) == ANNEAL_OK);
    for (int i = 0; i < 3; i++) CHECK(anneal_item_at(x->grad, i) == ws[i], "g backward [%d]", i);
    /* f */
    anneal_grad_clear(x);
    anneal_tensor *z = anneal_tp_copy_in(g_comm, x);
    REQUIRE(z);
    for (int i = 0; i < 3; i++) CHECK(anneal_item_at(z, i) == xs[i], "f forward [%d]", i);
    anneal_tensor *k = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){3}, (float[]){(float)(r + 1), (float)(r + 1), 1.0f});
    REQUIRE(anneal_backward(anneal_sum(anneal_mul(z, k))) == ANNEAL_OK);
    CHECK(anneal_item_at(x->grad, 0) == tri && anneal_item_at(x->grad, 1) == tri, "f backward: %g",
          anneal_item_at(x->grad, 0));
    CHECK(anneal_item_at(x->grad, 2) == (float)w, "f backward [2] = %g", anneal_item_at(x->grad, 2));
    anneal_scope_close(sc);
}

/* A packed (2, 6) [q | k | v] weight: rank r of W holds columns r of each third; the
 * gather gives the whole back. */
TEST(packed_slice_and_gather) {
    int r = dt_rank(), w = dt_world();
    anneal_scope *sc = anneal_scope_open();
    int64_t C = 2, third = 2 * w; /* each of q, k, v: 2 columns per rank */
    float *data = malloc((size_t)(C * 3 * third) * sizeof *data);
    for (int64_t i = 0; i < C * 3 * third; i++) data[i] = (float)i;
    anneal_tensor *whole = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){C, 3 * third}, data);
    anneal_tensor *shard = anneal_empty(ANNEAL_F32, 2, (int64_t[]){C, 6});
    anneal_tp_split sp;
    REQUIRE(anneal_tp_split_of("h.0.attn.c_attn.weight", whole, shard, w, &sp) == ANNEAL_OK);
    /* one rank: the shard is the whole (replicated) */
    CHECK(w == 1 ? sp.dim == -1 : sp.dim == 1 && sp.parts == 3, "split dim %d parts %d", sp.dim, sp.parts);
    REQUIRE(anneal_tp_slice(whole, shard, sp, r) == ANNEAL_OK);
    for (int64_t row = 0; row < C; row++)
        for (int64_t j = 0; j < 6; j++) {
            int64_t col = (j / 2) * third + r * 2 + j % 2;
            CHECK(anneal_item_at(shard, row * 6 + j) == data[row * 3 * third + col], "shard (%lld, %lld)",
                  (long long)row, (long long)j);
        }
    anneal_tensor *back = anneal_empty(ANNEAL_F32, 2, (int64_t[]){C, 3 * third});
    REQUIRE(anneal_tp_gather(g_comm, shard, back, sp) == ANNEAL_OK);
    CHECK(memcmp(anneal_data(back), data, (size_t)(C * 3 * third) * sizeof(float)) == 0, "gather != whole");
    /* a plain column split is one part; same shapes are replicated; another size is refused */
    CHECK(anneal_tp_split_of("h.0.mlp.c_fc.weight", whole, shard, w, &sp) == ANNEAL_OK && sp.parts == 1, "c_fc parts");
    CHECK(anneal_tp_split_of("ln.weight", whole, whole, w, &sp) == ANNEAL_OK && sp.dim == -1, "replicated");
    if (w > 1) {
        anneal_tensor *odd = anneal_empty(ANNEAL_F32, 2, (int64_t[]){C, 5});
        CHECK(anneal_tp_split_of("x.weight", whole, odd, w, &sp) == ANNEAL_ERR_SHAPE, "5 of %lld columns accepted",
              (long long)(3 * third));
        anneal_clear_error();
    }
    free(data);
    anneal_scope_close(sc);
}

/* Largest |a - b| beyond ATOL + RTOL |b|, reported. */
static bool close_all(const char *what, const anneal_tensor *a, const anneal_tensor *b) {
    if (!a || !b || anneal_numel(a) != anneal_numel(b)) {
        printf("    %s: missing or of another size\n", what);
        return false;
    }
    double worst = 0;
    bool ok = true;
    for (int64_t i = 0; i < anneal_numel(a); i++) {
        double u = anneal_item_at(a, i), v = anneal_item_at(b, i), d = fabs(u - v);
        if (!(d <= ATOL + RTOL * fabs(v))) ok = false;
        if (!(d <= worst)) worst = d;
    }
    if (!ok) printf("    %s: differs by %.3g\n", what, worst);
    return ok;
}

/* x (B, C) -> f -> column-parallel (C, F/W) + bias shard, GELU -> row-parallel (F/W, C)
 * -> g -> + bias: the unsharded pair's output and gradients (x, both weights' slices,
 * both biases). */
TEST(sharded_dense_pair_matches_whole) {
    int r = dt_rank(), w = dt_world();
    int64_t B = 5, C = 8, F = 12 * w;
    anneal_scope *sc = anneal_scope_open();
    anneal_manual_seed(42); /* the same whole tensors on every rank */
    anneal_tensor *x = anneal_randn(ANNEAL_F32, 2, (int64_t[]){B, C}, 0, 1);
    anneal_tensor *w1 = anneal_randn(ANNEAL_F32, 2, (int64_t[]){C, F}, 0, 0.5f);
    anneal_tensor *b1 = anneal_randn(ANNEAL_F32, 1, (int64_t[]){F}, 0, 0.5f);
    anneal_tensor *w2 = anneal_randn(ANNEAL_F32, 2, (int64_t[]){F, C}, 0, 0.5f);
    anneal_tensor *b2 = anneal_randn(ANNEAL_F32, 1, (int64_t[]){C}, 0, 0.5f);
    anneal_tensor *dy = anneal_randn(ANNEAL_F32, 2, (int64_t[]){B, C}, 0, 1);
    anneal_tensor *s1 = anneal_empty(ANNEAL_F32, 2, (int64_t[]){C, F / w});
    anneal_tensor *sb1 = anneal_empty(ANNEAL_F32, 1, (int64_t[]){F / w});
    anneal_tensor *s2 = anneal_empty(ANNEAL_F32, 2, (int64_t[]){F / w, C});
    anneal_tp_split p1, pb1, p2;
    REQUIRE(anneal_tp_split_of("mlp.c_fc.weight", w1, s1, w, &p1) == ANNEAL_OK && p1.dim == (w > 1 ? 1 : -1));
    REQUIRE(anneal_tp_split_of("mlp.c_fc.bias", b1, sb1, w, &pb1) == ANNEAL_OK && pb1.dim == (w > 1 ? 0 : -1));
    REQUIRE(anneal_tp_split_of("mlp.c_proj.weight", w2, s2, w, &p2) == ANNEAL_OK && p2.dim == (w > 1 ? 0 : -1));
    REQUIRE(anneal_tp_slice(w1, s1, p1, r) == ANNEAL_OK && anneal_tp_slice(b1, sb1, pb1, r) == ANNEAL_OK &&
            anneal_tp_slice(w2, s2, p2, r) == ANNEAL_OK);
    anneal_tensor *xs = anneal_clone(x);
    anneal_tensor *b2s = anneal_clone(b2);
    anneal_tensor *leaves[] = {x, w1, b1, w2, b2, xs, s1, sb1, s2, b2s};
    for (int i = 0; i < 10; i++) REQUIRE(anneal_set_requires_grad(leaves[i], true) == ANNEAL_OK);
    anneal_dense_opts o1 = {.layout = ANNEAL_WEIGHT_IN_OUT, .act = ANNEAL_ACT_GELU_TANH};
    anneal_dense_opts o2 = {.layout = ANNEAL_WEIGHT_IN_OUT};
    /* whole */
    anneal_tensor *y = anneal_dense(anneal_dense(x, w1, b1, &o1), w2, b2, &o2);
    REQUIRE(anneal_backward(anneal_sum(anneal_mul(y, dy))) == ANNEAL_OK);
    /* sharded */
    anneal_tensor *h = anneal_dense(anneal_tp_copy_in(g_comm, xs), s1, sb1, &o1);
    anneal_tensor *ys = anneal_add(anneal_tp_reduce_out(g_comm, anneal_dense(h, s2, NULL, &o2)), b2s);
    REQUIRE(anneal_backward(anneal_sum(anneal_mul(ys, dy))) == ANNEAL_OK);
    /* the whole gradients' slices */
    anneal_tensor *g1 = anneal_empty_like(s1), *gb1 = anneal_empty_like(sb1), *g2 = anneal_empty_like(s2);
    REQUIRE(anneal_tp_slice(w1->grad, g1, p1, r) == ANNEAL_OK && anneal_tp_slice(b1->grad, gb1, pb1, r) == ANNEAL_OK &&
            anneal_tp_slice(w2->grad, g2, p2, r) == ANNEAL_OK);
    bool ok = close_all("output", ys, y) && close_all("dx", xs->grad, x->grad) && close_all("dW1 shard", s1->grad, g1) &&
              close_all("db1 shard", sb1->grad, gb1) && close_all("dW2 shard", s2->grad, g2) &&
              close_all("db2", b2s->grad, b2->grad);
    CHECK(dt_all(ok), "the sharded pair differs from the whole (see above)");
    anneal_scope_close(sc);
}

/* A tiny model (preset) sharded over the world: the loss and every parameter's gradient
 * (the shard's slice of the whole model's) match the unsharded model; `expect`
 * parameters are sharded. */
static void check_sharded_model(const char *preset, int expect) {
    int r = dt_rank(), w = dt_world();
    anneal_model_config cfg;
    REQUIRE(anneal_model_preset(preset, &cfg));
    anneal_model *whole = anneal_model_new(&cfg, ANNEAL_CPU);
    REQUIRE(whole && anneal_model_init(whole, 7) == ANNEAL_OK);
    anneal_model_config lc = cfg;
    lc.tp_size = w;
    lc.tp_rank = r;
    anneal_model *part = anneal_model_new(&lc, ANNEAL_CPU);
    anneal_tp *tp = anneal_tp_new(g_comm);
    REQUIRE(part && tp);
    part->ctx.tp = anneal_tp_nn(tp);
    anneal_params *ps = part->params;
    anneal_tp_split *sp = calloc((size_t)ps->n, sizeof *sp);
    int sharded = 0;
    for (int i = 0; i < ps->n; i++) {
        anneal_param *wp = anneal_params_find(whole->params, ps->items[i].name);
        REQUIRE(wp && anneal_tp_split_of(ps->items[i].name, wp->tensor, ps->items[i].tensor, w, &sp[i]) == ANNEAL_OK);
        REQUIRE(anneal_tp_slice(wp->tensor, ps->items[i].tensor, sp[i], r) == ANNEAL_OK);
        sharded += sp[i].dim >= 0;
    }
    CHECK(w == 1 || sharded == expect, "%s: %d sharded parameters, expected %d", preset, sharded, expect);
    anneal_scope *sc = anneal_scope_open();
    int64_t B = 2, T = 16;
    int32_t ids[32], tg[32];
    for (int i = 0; i < B * T; i++) ids[i] = (i * 37 + 11) % cfg.vocab_size, tg[i] = (i * 53 + 5) % cfg.vocab_size;
    tg[3] = tg[20] = -100; /* ignored targets */
    anneal_tensor *ti = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, ids);
    anneal_tensor *tt = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, tg);
    anneal_tensor *lw = anneal_model_loss(whole, ti, tt), *lp = anneal_model_loss(part, ti, tt);
    REQUIRE(lw && lp && anneal_backward(lw) == ANNEAL_OK && anneal_backward(lp) == ANNEAL_OK);
    double a = anneal_item(lp), b = anneal_item(lw);
    printf("    %s, rank %d: loss %.7f (sharded over %d) vs %.7f (whole)\n", preset, r, a, w, b);
    bool ok = fabs(a - b) <= 1e-6 * fabs(b);
    for (int i = 0; i < ps->n; i++) {
        anneal_param *wp = anneal_params_find(whole->params, ps->items[i].name);
        anneal_tensor *g = anneal_empty_like(ps->items[i].tensor);
        REQUIRE(anneal_tp_slice(wp->tensor->grad, g, sp[i], r) == ANNEAL_OK);
        if (!close_all(ps->items[i].name, ps->items[i].tensor->grad, g)) ok = false;
    }
    CHECK(dt_all(ok), "the sharded GPT-2 differs from the whole one (see above)");
    anneal_scope_close(sc);
    free(sp);
    anneal_model_free(part);
    anneal_model_free(whole);
    anneal_tp_free(tp);
}

/* GPT-2 tiny (2 layers, 4 heads, C 64, vocabulary 512): per block c_attn weight and
 * bias, attn c_proj weight, c_fc weight and bias, mlp c_proj weight; and the token
 * embedding (the vocabulary split). */
TEST(sharded_gpt2_matches_whole) { check_sharded_model("tiny", 6 * 2 + 1); }

/* Llama tiny (2 layers, GQA 4/2 heads, SwiGLU 176, untied head): per layer q, k, v, o,
 * gate, up, down; the embedding and the lm head. */
TEST(sharded_llama_matches_whole) { check_sharded_model("llama-tiny", 7 * 2 + 2); }

/* n_head not divisible by the group: a clear error at creation. */
TEST(heads_not_divisible) {
    anneal_model_config cfg;
    REQUIRE(anneal_gpt2_preset("tiny", &cfg));
    cfg.tp_size = 3; /* 4 heads */
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    CHECK(!m && strstr(anneal_last_error(), "n_head 4 is not divisible by --tp 3"), "got: %s", anneal_last_error());
    anneal_clear_error();
    anneal_model_free(m);
}

static void run_all(void) {
    RUN(f_and_g_values);
    RUN(packed_slice_and_gather);
    RUN(sharded_dense_pair_matches_whole);
    RUN(sharded_gpt2_matches_whole);
    RUN(sharded_llama_matches_whole);
    RUN(heads_not_divisible);
}

int main(void) { return dt_main(run_all); }
