/* LoRA adapters on dense layers (src/nn/lora.c): which layers anneal_lora_apply
 * targets and what it registers (PEFT names, shapes, B zero, A within kaiming-uniform's
 * bound, everything else frozen), the forward against its definition (base + scale *
 * (x A^T) B^T, with each fused activation unfused correctly), finite-difference
 * gradients of x, A and B in both weight layouts, dropout on the adapter input only
 * while training, bf16 frozen weights (the same bits as f32 ones at compute bf16), the
 * optimizer leaving frozen parameters alone (no state), GPT-2's recompute modes giving
 * the adapters the same gradients, and the errors (unknown
 * target named, bad rank/alpha/dropout, adapters twice). */
#include "blocks_util.h"
#include "test.h"

#define REQUIRE_MSG(c) do { if (!(c)) { anneal_test_fail(__FILE__, __LINE__, "%s: %s", #c, anneal_last_error()); return; } } while (0)

static const anneal_nn_ctx k_f32 = {.compute = ANNEAL_F32, .training = false};

/* A GPT-2-like layer: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (Conv1D layout). */
typedef struct toy {
    anneal_params *ps;
    anneal_nn_dense c_attn, a_proj, c_fc, m_proj;
} toy;

static bool toy_new(toy *t, anneal_weight_layout layout) {
    t->ps = anneal_params_new();
    return t->ps && anneal_nn_dense_create(&t->c_attn, t->ps, "transformer.h.0.attn.c_attn", 6, 18, layout, true) == 0 &&
           anneal_nn_dense_create(&t->a_proj, t->ps, "transformer.h.0.attn.c_proj", 6, 6, layout, true) == 0 &&
           anneal_nn_dense_create(&t->c_fc, t->ps, "transformer.h.0.mlp.c_fc", 6, 24, layout, true) == 0 &&
           anneal_nn_dense_create(&t->m_proj, t->ps, "transformer.h.0.mlp.c_proj", 24, 6, layout, true) == 0;
}

TEST(apply_targets_by_last_component) {
    toy t;
    REQUIRE(toy_new(&t, ANNEAL_WEIGHT_IN_OUT));
    CHECK_TRUE(t.ps->n_dense == 4 && !strcmp(t.ps->dense[2].prefix, "transformer.h.0.mlp.c_fc"));
    int n_base = t.ps->n;
    anneal_manual_seed(5);
    const char *targets[] = {"c_attn", "c_proj"};
    anneal_lora_config c = {.rank = 4, .alpha = 8, .targets = targets, .n_targets = 2};
    REQUIRE(anneal_lora_apply(t.ps, &c) == ANNEAL_OK);
    CHECK(anneal_lora_count(t.ps) == 3, "adapters on %d layers", anneal_lora_count(t.ps));
    CHECK_TRUE(t.c_attn.lora && t.a_proj.lora && t.m_proj.lora && !t.c_fc.lora);
    CHECK_TRUE(t.ps->n == n_base + 6);
    for (int i = 0; i < t.ps->n; i++) {
        const anneal_param *p = &t.ps->items[i];
        bool adapter = strstr(p->name, ".lora_") != NULL;
        CHECK(p->trainable == adapter && p->tensor->requires_grad == adapter, "%s trainable %d", p->name, p->trainable);
    }
    anneal_param *a = anneal_params_find(t.ps, "transformer.h.0.attn.c_attn.lora_A.weight");
    anneal_param *b = anneal_params_find(t.ps, "transformer.h.0.attn.c_attn.lora_B.weight");
    REQUIRE(a && b && a->tensor == t.c_attn.lora->a && b->tensor == t.c_attn.lora->b);
    CHECK_TRUE(a->tensor->shape[0] == 4 && a->tensor->shape[1] == 6 && b->tensor->shape[0] == 18 &&
               b->tensor->shape[1] == 4);
    CHECK_TRUE(t.c_attn.lora->scale == 2.0f && t.c_attn.lora->rank == 4);
    double amax = 0, bmax = 0;
    for (int i = 0; i < 24; i++) amax = fmax(amax, fabs(anneal_item_at(a->tensor, i)));
    for (int i = 0; i < 72; i++) bmax = fmax(bmax, fabs(anneal_item_at(b->tensor, i)));
    CHECK(amax > 0.1 && amax <= 1.0 / sqrt(6.0), "A within +-1/sqrt(in): max %g", amax);
    CHECK(bmax == 0.0, "B starts at zero: max %g", bmax);
    CHECK_TRUE(anneal_params_numel_trainable(t.ps) == 2 * (4 * 6 + 18 * 4) - 4 * 6 - 18 * 4 + (4 * 6 + 6 * 4) +
                                                          (4 * 24 + 6 * 4));
    CHECK_TRUE(!strcmp(t.ps->lora.targets, "c_attn,c_proj") && t.ps->lora.rank == 4);
    /* the same seed gives the same A (drawn from the global generator) */
    toy u;
    REQUIRE(toy_new(&u, ANNEAL_WEIGHT_IN_OUT));
    anneal_manual_seed(5);
    REQUIRE(anneal_lora_apply(u.ps, &c) == ANNEAL_OK);
    CHECK_TRUE(bu_same_bits(u.c_attn.lora->a, t.c_attn.lora->a) && bu_same_bits(u.m_proj.lora->a, t.m_proj.lora->a));
    /* twice is refused */
    anneal_clear_error();
    CHECK_TRUE(anneal_lora_apply(t.ps, &c) == ANNEAL_ERR_STATE);
    anneal_clear_error();
    anneal_params_free(t.ps);
    anneal_params_free(u.ps);
}

TEST(apply_errors) {
    toy t;
    REQUIRE(toy_new(&t, ANNEAL_WEIGHT_OUT_IN));
    const char *bad[] = {"c_attn", "q_proj"};
    anneal_lora_config c = {.rank = 2, .alpha = 4, .targets = bad, .n_targets = 2};
    anneal_clear_error();
    CHECK_TRUE(anneal_lora_apply(t.ps, &c) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "'q_proj'") && strstr(anneal_last_error(), "c_fc"), "message: %s",
          anneal_last_error());
    CHECK_TRUE(anneal_lora_count(t.ps) == 0 && t.ps->items[0].trainable); /* nothing changed */
    const char *ok[] = {"c_fc"};
    anneal_lora_config cases[] = {
        {.rank = 0, .alpha = 4, .targets = ok, .n_targets = 1},
        {.rank = 2, .alpha = 0, .targets = ok, .n_targets = 1},
        {.rank = 2, .alpha = 4, .dropout = 1.0f, .targets = ok, .n_targets = 1},
        {.rank = 2, .alpha = 4, .targets = ok, .n_targets = 0},
        {.rank = 2, .alpha = 4, .targets = ok, .n_targets = 1, .base_dtype = ANNEAL_F16},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        anneal_clear_error();
        CHECK(anneal_lora_apply(t.ps, &cases[i]) == ANNEAL_ERR_ARG, "case %zu accepted", i);
    }
    anneal_clear_error();
    anneal_params_free(t.ps);
}

typedef struct lcase {
    anneal_nn_dense *d;
    anneal_activation act;
} lcase;

static anneal_tensor *f_lora(void *ctx, anneal_tensor *const *in) {
    const lcase *c = ctx;
    return anneal_nn_dense_forward_act(c->d, &k_f32, in[0], c->act, c->act == ANNEAL_ACT_SILU_MUL ? in[1] : NULL);
}

TEST(forward_is_the_definition_and_gradients_check) {
    for (int layout = 0; layout < 2; layout++)
        for (int act = 0; act < 3; act++) {
            anneal_scope *s = anneal_scope_open();
            anneal_params *ps = anneal_params_new();
            anneal_nn_dense d;
            REQUIRE(anneal_nn_dense_create(&d, ps, "m.up_proj", 5, 7, (anneal_weight_layout)layout, true) == 0);
            bu_randomize(ps, 7 + (uint64_t)(layout * 3 + act));
            const char *tg[] = {"up_proj"};
            anneal_lora_config c = {.rank = 3, .alpha = 6, .targets = tg, .n_targets = 1};
            REQUIRE(anneal_lora_apply(ps, &c) == ANNEAL_OK);
            /* B non-zero so every path carries a gradient */
            anneal_copy_(d.lora->b, anneal_test_rand(2, (int64_t[]){7, 3}, -0.5f, 0.5f, 99, false));
            anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 3, 5}, -1, 1, 21, true);
            anneal_tensor *mul = anneal_test_rand(3, (int64_t[]){2, 3, 7}, -1, 1, 22, true);
            anneal_tensor *base = layout == ANNEAL_WEIGHT_IN_OUT ? anneal_conv1d(x, d.weight, d.bias)
                                                                 : anneal_linear(x, d.weight, d.bias);
            anneal_tensor *ad = anneal_scale(anneal_linear(anneal_linear(x, d.lora->a, NULL), d.lora->b, NULL), 2.0f);
            anneal_tensor *want = anneal_add(base, ad);
            if (act == ANNEAL_ACT_GELU_TANH) want = anneal_gelu(want, true);
            if (act == ANNEAL_ACT_SILU_MUL) want = anneal_mul(anneal_silu(want), mul);
            anneal_tensor *got = anneal_nn_dense_forward_act(&d, &k_f32, x, (anneal_activation)act,
                                                             act == ANNEAL_ACT_SILU_MUL ? mul : NULL);
            double diff = bu_max_diff(got, want);
            CHECK(diff <= 1e-6, "layout %d act %d: differs from the definition by %g", layout, act, diff);
            /* the frozen base gets no gradient */
            anneal_backward(anneal_sum(got));
            CHECK_TRUE(d.weight->grad == NULL && d.bias->grad == NULL && d.lora->a->grad && d.lora->b->grad);
            anneal_params_zero_grad(ps);
            lcase lc = {&d, (anneal_activation)act};
            anneal_tensor *in[4] = {x, mul, d.lora->a, d.lora->b};
            if (act == ANNEAL_ACT_SILU_MUL) {
                CHECK_GRAD(f_lora, &lc, 4, in, 1e-2, 2e-3, 2e-2);
            } else {
                anneal_tensor *in3[3] = {x, d.lora->a, d.lora->b};
                CHECK_GRAD(f_lora, &lc, 3, in3, 1e-2, 2e-3, 2e-2);
            }
            anneal_params_free(ps);
            anneal_scope_close(s);
        }
}

TEST(dropout_only_on_the_adapter_while_training) {
    anneal_scope *s = anneal_scope_open();
    anneal_params *ps = anneal_params_new();
    anneal_nn_dense d;
    REQUIRE(anneal_nn_dense_create(&d, ps, "q_proj", 8, 8, ANNEAL_WEIGHT_OUT_IN, false) == 0);
    bu_randomize(ps, 3);
    const char *tg[] = {"q_proj"};
    anneal_lora_config c = {.rank = 2, .alpha = 2, .dropout = 0.5f, .targets = tg, .n_targets = 1};
    REQUIRE(anneal_lora_apply(ps, &c) == ANNEAL_OK);
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){4, 8}, -1, 1, 5, false);
    anneal_tensor *base = anneal_linear(x, d.weight, NULL);
    /* B = 0: the adapter adds nothing, dropout or not */
    anneal_nn_ctx tr = {.compute = ANNEAL_F32, .training = true};
    CHECK_TRUE(bu_same_bits(anneal_nn_dense_forward(&d, &tr, x), base));
    anneal_init_fill_(d.lora->b, 0.25f);
    anneal_tensor *eval1 = anneal_nn_dense_forward(&d, &k_f32, x), *eval2 = anneal_nn_dense_forward(&d, &k_f32, x);
    CHECK_TRUE(bu_same_bits(eval1, eval2)); /* no dropout in eval */
    anneal_manual_seed(1);
    anneal_tensor *t1 = anneal_nn_dense_forward(&d, &tr, x);
    anneal_tensor *t2 = anneal_nn_dense_forward(&d, &tr, x);
    anneal_manual_seed(1);
    anneal_tensor *t3 = anneal_nn_dense_forward(&d, &tr, x);
    CHECK_TRUE(!bu_same_bits(t1, t2) && bu_same_bits(t1, t3) && !bu_same_bits(t1, eval1));
    /* the adapter's input is dropped, the base's is not: base + scale * (drop(x) A^T) B^T */
    anneal_manual_seed(1);
    anneal_tensor *dx = anneal_dropout(x, 0.5f, true);
    anneal_tensor *want = anneal_add(base, anneal_scale(anneal_linear(anneal_linear(dx, d.lora->a, NULL), d.lora->b,
                                                                      NULL), 1.0f));
    CHECK(bu_max_diff(t1, want) <= 1e-6, "differs by %g", bu_max_diff(t1, want));
    anneal_params_free(ps);
    anneal_scope_close(s);
}

TEST(bf16_frozen_weights_equal_f32_at_compute_bf16) {
    anneal_scope *s = anneal_scope_open();
    for (int layout = 0; layout < 2; layout++) {
        toy a, b;
        REQUIRE(toy_new(&a, (anneal_weight_layout)layout) && toy_new(&b, (anneal_weight_layout)layout));
        bu_randomize(a.ps, 4);
        bu_randomize(b.ps, 4);
        const char *tg[] = {"c_attn", "c_fc"};
        anneal_lora_config c = {.rank = 2, .alpha = 4, .targets = tg, .n_targets = 2};
        anneal_manual_seed(9);
        REQUIRE(anneal_lora_apply(a.ps, &c) == ANNEAL_OK);
        c.base_dtype = ANNEAL_BF16;
        anneal_manual_seed(9);
        REQUIRE(anneal_lora_apply(b.ps, &c) == ANNEAL_OK);
        /* every dense weight is bf16 now (blocks and parameters), the rest f32 */
        CHECK_TRUE(b.c_attn.weight->dtype == ANNEAL_BF16 && b.m_proj.weight->dtype == ANNEAL_BF16);
        CHECK_TRUE(anneal_params_find(b.ps, "transformer.h.0.mlp.c_fc.weight")->tensor == b.c_fc.weight);
        CHECK_TRUE(b.c_attn.bias->dtype == ANNEAL_F32 && b.c_attn.lora->a->dtype == ANNEAL_F32);
        anneal_copy_(a.c_fc.lora->b, anneal_test_rand(2, (int64_t[]){24, 2}, -0.5f, 0.5f, 3, false));
        anneal_copy_(b.c_fc.lora->b, a.c_fc.lora->b);
        anneal_nn_ctx bf = {.compute = ANNEAL_BF16};
        anneal_tensor *x = anneal_test_rand(2, (int64_t[]){5, 6}, -1, 1, 8, false);
        anneal_tensor *xa = anneal_detach(x), *xb = anneal_detach(x);
        anneal_set_requires_grad(xa, true);
        anneal_set_requires_grad(xb, true);
        anneal_tensor *ya = anneal_nn_dense_forward_act(&a.c_fc, &bf, xa, ANNEAL_ACT_GELU_TANH, NULL);
        anneal_tensor *yb = anneal_nn_dense_forward_act(&b.c_fc, &bf, xb, ANNEAL_ACT_GELU_TANH, NULL);
        CHECK(bu_same_bits(ya, yb), "layout %d: bf16 storage changed the output by %g", layout, bu_max_diff(ya, yb));
        anneal_tensor *za = anneal_nn_dense_forward(&a.m_proj, &bf, ya), *zb = anneal_nn_dense_forward(&b.m_proj, &bf, yb);
        REQUIRE(anneal_backward(anneal_sum(za)) == ANNEAL_OK && anneal_backward(anneal_sum(zb)) == ANNEAL_OK);
        CHECK_TRUE(bu_same_bits(xa->grad, xb->grad) && bu_same_bits(a.c_fc.lora->a->grad, b.c_fc.lora->a->grad) &&
                   bu_same_bits(a.c_fc.lora->b->grad, b.c_fc.lora->b->grad));
        CHECK_TRUE(b.c_fc.weight->grad == NULL);
        anneal_params_free(a.ps);
        anneal_params_free(b.ps);
    }
    /* a bf16 weight that wants a gradient is refused by the op */
    anneal_tensor *w = anneal_cast(anneal_test_rand(2, (int64_t[]){3, 4}, -1, 1, 2, false), ANNEAL_BF16);
    anneal_set_requires_grad(w, true);
    anneal_clear_error();
    CHECK_TRUE(anneal_linear(anneal_test_rand(2, (int64_t[]){2, 4}, -1, 1, 2, false), w, NULL) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    anneal_scope_close(s);
}

TEST(optimizer_skips_frozen_parameters) {
    anneal_scope *s = anneal_scope_open();
    toy t;
    REQUIRE(toy_new(&t, ANNEAL_WEIGHT_IN_OUT));
    bu_randomize(t.ps, 2);
    const char *tg[] = {"c_fc"};
    anneal_lora_config c = {.rank = 2, .alpha = 2, .targets = tg, .n_targets = 1};
    REQUIRE(anneal_lora_apply(t.ps, &c) == ANNEAL_OK);
    anneal_tensor *w0 = anneal_clone(t.c_fc.weight), *a0 = anneal_clone(t.c_fc.lora->a);
    anneal_optimizer *o = anneal_optimizer_new(t.ps, anneal_optim_defaults(ANNEAL_OPTIM_ADAMW));
    REQUIRE(o && anneal_optimizer_init_state(o) == ANNEAL_OK);
    for (int step = 0; step < 2; step++) {
        anneal_tensor *x = anneal_test_rand(2, (int64_t[]){3, 6}, -1, 1, 40 + (uint64_t)step, false);
        anneal_tensor *y = anneal_nn_dense_forward(&t.m_proj, &k_f32,
                                                   anneal_nn_dense_forward_act(&t.c_fc, &k_f32, x, ANNEAL_ACT_GELU_TANH, NULL));
        anneal_status bs = anneal_backward(anneal_sum(anneal_mul(y, y)));
        REQUIRE_MSG(bs == ANNEAL_OK);
        REQUIRE(anneal_optimizer_step(o, 1e-2) == ANNEAL_OK);
        anneal_params_zero_grad(t.ps);
    }
    for (int i = 0; i < t.ps->n; i++) {
        bool tr = t.ps->items[i].trainable;
        CHECK(tr == (anneal_optimizer_state(o, i, "exp_avg") != NULL), "%s: state %d", t.ps->items[i].name, tr);
        CHECK_TRUE(anneal_optimizer_param_steps(o, i) == (tr ? 2 : 0));
    }
    CHECK_TRUE(bu_same_bits(w0, t.c_fc.weight) && !bu_same_bits(a0, t.c_fc.lora->a));
    anneal_optimizer_free(o);
    anneal_params_free(t.ps);
    anneal_scope_close(s);
}

/* GPT-2 with adapters on every dense layer and dropout on: the gradients of A and B are
 * the same bits with recompute none, attn and block (the regions replay the adapters'
 * dropout masks and reach their leaves). */
TEST(gpt2_recompute_modes_agree_with_adapters) {
    anneal_recompute_mode mode[3] = {ANNEAL_RECOMPUTE_NONE, ANNEAL_RECOMPUTE_ATTN, ANNEAL_RECOMPUTE_BLOCK};
    float *ref = NULL;
    int64_t total = 0;
    for (int k = 0; k < 3; k++) {
        anneal_scope *s = anneal_scope_open();
        anneal_model_config c = {.n_layer = 2, .n_head = 2, .n_embd = 16, .vocab_size = 23, .n_ctx = 8,
                                 .norm_eps = 1e-5f, .dropout = 0.1f, .recompute = mode[k]};
        snprintf(c.arch, sizeof c.arch, "gpt2");
        anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
        REQUIRE(m && anneal_model_init(m, 3) == ANNEAL_OK);
        const char *tg[] = {"c_attn", "c_proj", "c_fc"};
        anneal_lora_config lc = {.rank = 2, .alpha = 4, .dropout = 0.2f, .targets = tg, .n_targets = 3};
        REQUIRE(anneal_lora_apply(m->params, &lc) == ANNEAL_OK);
        for (int i = 0; i < m->params->n_dense; i++)
            if (m->params->dense[i].lora) anneal_init_normal_(m->params->dense[i].lora->b, 0.0f, 0.2f);
        m->ctx.training = true;
        int32_t ids[2 * 8], tgt[2 * 8];
        for (int i = 0; i < 16; i++) ids[i] = (i * 7) % 23, tgt[i] = (i * 5 + 1) % 23;
        anneal_manual_seed(77);
        anneal_tensor *loss = anneal_model_loss(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){2, 8}, ids),
                                                anneal_from_data(ANNEAL_I32, 2, (int64_t[]){2, 8}, tgt));
        REQUIRE(anneal_backward(loss) == ANNEAL_OK);
        int64_t n = 0;
        for (int i = 0; i < m->params->n; i++) {
            const anneal_param *p = &m->params->items[i];
            CHECK(p->trainable == (p->tensor->grad != NULL), "%s: trainable %d, grad %p", p->name, p->trainable,
                  (void *)p->tensor->grad);
            if (p->trainable) n += anneal_numel(p->tensor);
        }
        float *g = malloc((size_t)n * sizeof *g), *w = g;
        for (int i = 0; i < m->params->n; i++) {
            const anneal_param *p = &m->params->items[i];
            if (!p->trainable || !p->tensor->grad) continue;
            anneal_to_f32_buffer(p->tensor->grad, w);
            w += anneal_numel(p->tensor);
        }
        if (k == 0) {
            ref = g;
            total = n;
        } else {
            CHECK(n == total && memcmp(g, ref, (size_t)n * sizeof *g) == 0, "recompute mode %d changed the gradients", k);
            free(g);
        }
        anneal_model_free(m);
        anneal_scope_close(s);
    }
    free(ref);
}

int main(void) {
    RUN(apply_targets_by_last_component);
    RUN(apply_errors);
    RUN(forward_is_the_definition_and_gradients_check);
    RUN(dropout_only_on_the_adapter_while_training);
    RUN(bf16_frozen_weights_equal_f32_at_compute_bf16);
    RUN(optimizer_skips_frozen_parameters);
    RUN(gpt2_recompute_modes_agree_with_adapters);
    return anneal_test_summary();
}
