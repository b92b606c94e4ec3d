/* Activation recomputation modes of GPT-2: none, attn (qkv GEMM + attention replayed
 * in backward) and block (whole blocks replayed). With dropout on, every mode must
 * give the same loss and the same gradients to the bit as none (the replay draws the
 * same dropout masks and runs the same kernels on the same inputs), and the peak of
 * live tensor bytes over a forward + backward must order none > attn > block. Also
 * the mode names (on = block, off = none). */
#include "anneal/anneal.h"
#include "test.h"

#include <stdlib.h>

typedef struct {
    double loss;
    int64_t peak; /* live tensor bytes above the level before the step */
    float **grads;
    int n;
} result;

static result run_mode(anneal_recompute_mode mode, int64_t B, int64_t T) {
    result r = {NAN, 0, NULL, 0};
    anneal_model_config cfg = {.n_layer = 3, .n_head = 4, .n_embd = 64, .vocab_size = 512, .n_ctx = 256,
                              .dropout = 0.1f, .norm_eps = 1e-5f, .recompute = mode};
    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    if (!m || anneal_gpt2_init(m, 21) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "model: %s", anneal_last_error());
        anneal_gpt2_free(m);
        return r;
    }
    m->base.ctx.training = true;
    anneal_scope *s = anneal_scope_open();
    int64_t shape[2] = {B, T};
    anneal_tensor *ids = anneal_empty(ANNEAL_I32, 2, shape), *tg = anneal_empty(ANNEAL_I32, 2, shape);
    for (int64_t i = 0; i < B * T; i++) {
        ((int32_t *)anneal_data(ids))[i] = (int32_t)((i * 131 + 7) % 512);
        ((int32_t *)anneal_data(tg))[i] = (int32_t)((i * 71 + 3) % 512);
    }
    anneal_manual_seed(99);
    anneal_memory_reset_peak(ANNEAL_CPU);
    int64_t base = anneal_memory_stats_get(ANNEAL_CPU).live_bytes;
    anneal_tensor *loss = anneal_gpt2_loss(m, ids, tg);
    if (loss && anneal_backward(loss) == ANNEAL_OK) r.loss = anneal_item(loss);
    else anneal_test_fail(__FILE__, __LINE__, "%s: %s", anneal_recompute_name(mode), anneal_last_error());
    r.peak = anneal_memory_stats_get(ANNEAL_CPU).peak_bytes - base;
    anneal_scope_close(s);
    r.n = m->base.params->n;
    r.grads = calloc((size_t)r.n, sizeof *r.grads);
    for (int i = 0; i < r.n; i++) {
        anneal_tensor *g = m->base.params->items[i].tensor->grad;
        if (!g) continue;
        r.grads[i] = malloc((size_t)anneal_numel(g) * sizeof(float));
        memcpy(r.grads[i], anneal_data(g), (size_t)anneal_numel(g) * sizeof(float));
    }
    anneal_gpt2_free(m);
    return r;
}

static void free_result(result *r) {
    for (int i = 0; i < r->n; i++) free(r->grads[i]);
    free(r->grads);
}

TEST(modes_give_identical_gradients_and_order_memory) {
    /* B=4, T=128 (ASan: T=64, ~10x slower there): qkv (B,T,3C) is 384 KiB a layer */
    int64_t B = 4, T = anneal_test_sanitized() ? 64 : 128;
    if (anneal_test_sanitized()) printf("  ASan build: T=64 instead of 128\n");
    result none = run_mode(ANNEAL_RECOMPUTE_NONE, B, T);
    result attn = run_mode(ANNEAL_RECOMPUTE_ATTN, B, T);
    result block = run_mode(ANNEAL_RECOMPUTE_BLOCK, B, T);
    REQUIRE(none.grads && attn.grads && block.grads);
    CHECK(isfinite(none.loss), "loss %g", none.loss);
    CHECK(attn.loss == none.loss, "attn loss %.9g vs none %.9g", attn.loss, none.loss);
    CHECK(block.loss == none.loss, "block loss %.9g vs none %.9g", block.loss, none.loss);
    anneal_model_config cfg = {.n_layer = 3, .n_head = 4, .n_embd = 64, .vocab_size = 512, .n_ctx = 256,
                              .dropout = 0.1f, .norm_eps = 1e-5f};
    anneal_gpt2 *shape_model = anneal_gpt2_new(&cfg);
    REQUIRE(shape_model);
    for (int i = 0; i < none.n; i++) {
        const anneal_param *pa = &shape_model->base.params->items[i];
        size_t bytes = (size_t)anneal_numel(pa->tensor) * sizeof(float);
        REQUIRE(none.grads[i] && attn.grads[i] && block.grads[i]);
        CHECK(memcmp(none.grads[i], attn.grads[i], bytes) == 0, "%s: attn recompute changed the gradient", pa->name);
        CHECK(memcmp(none.grads[i], block.grads[i], bytes) == 0, "%s: block recompute changed the gradient",
              pa->name);
    }
    anneal_gpt2_free(shape_model);
    printf("  peak live tensor bytes over forward + backward: none %lld, attn %lld (%.0f%%), block %lld (%.0f%%)\n",
           (long long)none.peak, (long long)attn.peak, 100.0 * (double)attn.peak / (double)none.peak,
           (long long)block.peak, 100.0 * (double)block.peak / (double)none.peak);
    CHECK(none.peak > attn.peak, "attn peak %lld should be below none %lld", (long long)attn.peak,
          (long long)none.peak);
    CHECK(attn.peak > block.peak, "block peak %lld should be below attn %lld", (long long)block.peak,
          (long long)attn.peak);
    free_result(&none);
    free_result(&attn);
    free_result(&block);
}

TEST(mode_names) {
    anneal_recompute_mode m;
    CHECK_TRUE(anneal_recompute_parse("none", &m) && m == ANNEAL_RECOMPUTE_NONE);
    CHECK_TRUE(anneal_recompute_parse("off", &m) && m == ANNEAL_RECOMPUTE_NONE);
    CHECK_TRUE(anneal_recompute_parse("attn", &m) && m == ANNEAL_RECOMPUTE_ATTN);
    CHECK_TRUE(anneal_recompute_parse("block", &m) && m == ANNEAL_RECOMPUTE_BLOCK);
    CHECK_TRUE(anneal_recompute_parse("on", &m) && m == ANNEAL_RECOMPUTE_BLOCK);
    CHECK_TRUE(!anneal_recompute_parse("mlp", &m) && !anneal_recompute_parse(NULL, &m));
    CHECK_TRUE(!strcmp(anneal_recompute_name(ANNEAL_RECOMPUTE_ATTN), "attn"));
    anneal_model_config cfg;
    REQUIRE(anneal_gpt2_preset("tiny", &cfg));
    cfg.recompute = (anneal_recompute_mode)7;
    anneal_clear_error();
    CHECK_TRUE(anneal_model_config_check(&cfg) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "recompute") != NULL, "%s", anneal_last_error());
    anneal_clear_error();
    /* the trainer flag: on/off kept, stored by the canonical name, bad modes named */
    anneal_train_config tc;
    anneal_train_config_init(&tc);
    CHECK_TRUE(anneal_train_config_set(&tc, "recompute", "on") == ANNEAL_OK && !strcmp(tc.recompute, "block"));
    CHECK_TRUE(anneal_train_config_set(&tc, "recompute", "attn") == ANNEAL_OK && !strcmp(tc.recompute, "attn"));
    CHECK_TRUE(anneal_train_config_set(&tc, "recompute", "off") == ANNEAL_OK && !strcmp(tc.recompute, "none"));
    CHECK_TRUE(anneal_train_config_set(&tc, "recompute", "sometimes") == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "--recompute") != NULL, "%s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_train_config_apply_json(&tc, "{\"recompute\": true}", "cfg.json", NULL) == ANNEAL_OK &&
               !strcmp(tc.recompute, "block")); /* old config files and checkpoints: true/false */
    anneal_train_config_free(&tc);
}

int main(void) {
    RUN(mode_names);
    RUN(modes_give_identical_gradients_and_order_memory);
    return anneal_test_summary();
}
