/* What a training forward keeps for backward (issue 17's "bf16 activations"): each
 * block's forward runs in a scope of its own (intermediates no node saved are freed when
 * the block returns), and at bf16 compute the activations that backward reads only as
 * bf16 GEMM / attention-tile operands are saved as bf16 (src/ops/saved_bf16.c), and the
 * projection after a GELU layer recomputes its input from that layer's saved
 * pre-activation instead of keeping it (dense.c's gelu_source). All three
 * change lifetimes and storage, never arithmetic: losses and every gradient must keep
 * their bits against the old behaviour (the test switches), for GPT-2 (packed attention,
 * GELU MLP) and Llama (separate q/k/v with RoPE and GQA, SwiGLU), in every recompute
 * mode; and the activation bytes must drop by the amounts the saved sets predict. */
#include "anneal/anneal.h"
#include "cpu/gemm_internal.h"
#include "models/models_internal.h"
#include "ops/ops_internal.h"
#include "test.h"

#include <stdlib.h>

typedef struct {
    float loss;
    int64_t kept; /* activation bytes alive after the forward (what backward will read) */
    int64_t peak; /* peak live activation bytes over forward + backward, above the start */
    float **grads;
    int n;
} result;

typedef struct {
    const char *arch;
    anneal_dtype compute;
    bool scopes, bf16_saves;
    anneal_recompute_mode recompute;
    bool gelu_resave; /* the dense after a GELU one saves its pre (dense.c's gelu_source) */
} setup;

static const int64_t B = 4, T = 64, V = 512;

static anneal_model *make_model(const setup *su) {
    anneal_model_config cfg;
    if (!strcmp(su->arch, "gpt2")) {
        cfg = (anneal_model_config){.n_layer = 3, .n_head = 4, .n_embd = 64, .vocab_size = (int)V, .n_ctx = 256,
                                    .dropout = 0.1f, .norm_eps = 1e-5f};
        snprintf(cfg.arch, sizeof cfg.arch, "gpt2");
    } else if (!anneal_model_preset("llama-tiny", &cfg)) {
        return NULL;
    }
    cfg.recompute = su->recompute;
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (!m || anneal_model_init(m, 21) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    anneal_model_set_training(m, true);
    anneal_model_set_compute(m, su->compute);
    return m;
}

static int64_t live_activations(void) {
    return anneal_memory_categories_get(ANNEAL_CPU).live[ANNEAL_MEM_ACTIVATIONS];
}

static result run(const setup *su) {
    result r = {NAN, 0, 0, NULL, 0};
    anneal_model_block_scopes_set(su->scopes);
    anneal_ops_bf16_saves_set(su->bf16_saves);
    anneal_ops_gelu_resave_set(su->gelu_resave);
    anneal_model *m = make_model(su);
    if (!m) {
        anneal_test_fail(__FILE__, __LINE__, "model %s: %s", su->arch, anneal_last_error());
        return r;
    }
    anneal_scope *s = anneal_scope_open();
    int64_t shape[2] = {B, T};
    anneal_tensor *ids = anneal_empty(ANNEAL_I32, 2, shape), *tg = anneal_empty(ANNEAL_I32, 2, shape);
    for (int64_t i = 0; i < B * T; i++) {
        ((int32_t *)anneal_data(ids))[i] = (int32_t)((i * 131 + 7) % V);
        ((int32_t *)anneal_data(tg))[i] = (int32_t)((i * 71 + 3) % V);
    }
    anneal_manual_seed(99);
    int64_t base = live_activations();
    anneal_memory_reset_peak(ANNEAL_CPU);
    anneal_tensor *loss = anneal_model_loss(m, ids, tg);
    r.kept = live_activations() - base;
    if (loss && anneal_backward(loss) == ANNEAL_OK) r.loss = anneal_item(loss);
    else anneal_test_fail(__FILE__, __LINE__, "%s: %s", su->arch, anneal_last_error());
    r.peak = anneal_memory_categories_get(ANNEAL_CPU).peak[ANNEAL_MEM_ACTIVATIONS] - base;
    anneal_scope_close(s);
    r.n = m->params->n;
    r.grads = calloc((size_t)r.n, sizeof *r.grads);
    for (int i = 0; i < r.n; i++) {
        anneal_tensor *g = m->params->items[i].tensor->grad;
        if (!g) continue;
        r.grads[i] = malloc((size_t)anneal_numel(g) * sizeof(float));
        memcpy(r.grads[i], anneal_data(g), (size_t)anneal_numel(g) * sizeof(float));
    }
    anneal_model_free(m);
    anneal_model_block_scopes_set(true);
    anneal_ops_bf16_saves_set(true);
    anneal_ops_gelu_resave_set(true);
    return r;
}

static void free_result(result *r) {
    for (int i = 0; i < r->n; i++) free(r->grads[i]);
    free(r->grads);
}

/* Same loss bits, and gradients present in the same places. */
static void check_identical(const char *what, const result *a, const result *b) {
    uint32_t la, lb;
    memcpy(&la, &a->loss, 4);
    memcpy(&lb, &b->loss, 4);
    CHECK(isfinite(a->loss) && la == lb, "%s: loss %.9g vs %.9g", what, (double)a->loss, (double)b->loss);
    REQUIRE(a->grads && b->grads && a->n == b->n);
    int missing = 0;
    for (int i = 0; i < a->n; i++) missing += !a->grads[i] != !b->grads[i];
    CHECK(missing == 0, "%s: %d gradients present in one run only", what, missing);
}

/* check_identical, then every gradient's bits (sizes from a model of the same config). */
static void check_grads(const char *what, const char *arch, const result *a, const result *b) {
    check_identical(what, a, b);
    setup su = {.arch = arch, .compute = ANNEAL_F32};
    anneal_model *m = make_model(&su);
    REQUIRE(m && m->params->n == a->n);
    int bad = 0;
    for (int i = 0; i < a->n; i++) {
        if (!a->grads[i] || !b->grads[i]) continue;
        size_t bytes = (size_t)anneal_numel(m->params->items[i].tensor) * sizeof(float);
        if (memcmp(a->grads[i], b->grads[i], bytes) && bad++ < 3)
            anneal_test_fail(__FILE__, __LINE__, "%s: gradient of %s changed", what, m->params->items[i].name);
    }
    anneal_model_free(m);
}

TEST(block_scopes_keep_fp32_bits_and_free_intermediates) {
    const char *archs[2] = {"gpt2", "llama"};
    for (int a = 0; a < 2; a++) {
        result old = run(&(setup){archs[a], ANNEAL_F32, false, true, ANNEAL_RECOMPUTE_NONE, false});
        result now = run(&(setup){archs[a], ANNEAL_F32, true, true, ANNEAL_RECOMPUTE_NONE, true});
        check_grads(archs[a], archs[a], &old, &now);
        printf("  %s fp32: kept after forward %lld -> %lld bytes (%.0f%%), peak %lld -> %lld\n", archs[a],
               (long long)old.kept, (long long)now.kept, 100.0 * (double)now.kept / (double)old.kept,
               (long long)old.peak, (long long)now.peak);
        /* per block and token, in f32 values: GPT-2 (dropout on) no longer keeps c_proj's
         * output, its dropout, the MLP's output, its dropout (C each) and the GELU output
         * (4C: the MLP's c_proj recomputes it from c_fc's pre-activation); Llama no longer
         * keeps o_proj's and down_proj's outputs (C each) nor the q and k projections
         * (attention saves their rotated copies) */
        int64_t per_token = !strcmp(archs[a], "gpt2") ? 8 * 64 : 64 + 64 + 64 + 32;
        int64_t L = !strcmp(archs[a], "gpt2") ? 3 : 2;
        CHECK(old.kept - now.kept == L * B * T * per_token * 4, "%s: block scopes freed %lld bytes, expected %lld",
              archs[a], (long long)(old.kept - now.kept), (long long)(L * B * T * per_token * 4));
        CHECK(now.kept < old.kept, "%s: block scopes kept %lld bytes, before %lld", archs[a], (long long)now.kept,
              (long long)old.kept);
        CHECK(now.peak <= old.peak, "%s: peak %lld above %lld", archs[a], (long long)now.peak, (long long)old.peak);
        free_result(&old);
        free_result(&now);
    }
}

TEST(bf16_saves_keep_bf16_bits_and_halve_what_they_save) {
    const char *archs[2] = {"gpt2", "llama"};
    for (int a = 0; a < 2; a++) {
        result before = run(&(setup){archs[a], ANNEAL_BF16, false, false, ANNEAL_RECOMPUTE_NONE, false});
        result scoped = run(&(setup){archs[a], ANNEAL_BF16, true, false, ANNEAL_RECOMPUTE_NONE, true});
        result now = run(&(setup){archs[a], ANNEAL_BF16, true, true, ANNEAL_RECOMPUTE_NONE, true});
        result fp32 = run(&(setup){archs[a], ANNEAL_F32, true, true, ANNEAL_RECOMPUTE_NONE, true});
        check_grads(archs[a], archs[a], &before, &now);
        check_grads(archs[a], archs[a], &scoped, &now);
        printf("  %s bf16: kept after forward %lld (before issue 17) -> %lld (scoped) -> %lld (bf16 saves); fp32 "
               "%lld; bf16/fp32 %.3f; peak %lld -> %lld (fp32 %lld)\n",
               archs[a], (long long)before.kept, (long long)scoped.kept, (long long)now.kept, (long long)fp32.kept,
               (double)now.kept / (double)fp32.kept, (long long)before.peak, (long long)now.peak,
               (long long)fp32.peak);
        CHECK(scoped.kept == fp32.kept, "%s: without bf16 saves bf16 keeps %lld bytes, fp32 %lld", archs[a],
              (long long)scoped.kept, (long long)fp32.kept);
        CHECK(now.kept < scoped.kept && now.peak < before.peak, "%s: bf16 saves kept %lld (peak %lld), before %lld (%lld)",
              archs[a], (long long)now.kept, (long long)now.peak, (long long)scoped.kept, (long long)before.peak);
        /* halved per block and token: GPT-2 ln_1's output (C), qkv (3C), ln_2's output
         * (C); Llama the rotated q (Hq*D = C), k and v (Hkv*D each) and down_proj's input
         * (n_ff). What stays f32 (norm inputs, GELU's pre-activation, attention's output,
         * SwiGLU's gate and up) and the parts outside the blocks (embeddings, dropout
         * masks, the lm head's loss) are why the ratio to fp32 stays above 1/2. */
        int64_t halved = !strcmp(archs[a], "gpt2") ? 3 * 5 * 64 : 2 * (176 + 64 + 2 * 32);
        CHECK(scoped.kept - now.kept == B * T * halved * 2, "%s: bf16 saves freed %lld bytes, expected %lld",
              archs[a], (long long)(scoped.kept - now.kept), (long long)(B * T * halved * 2));
        free_result(&before);
        free_result(&scoped);
        free_result(&now);
        free_result(&fp32);
    }
}

TEST(recompute_modes_at_bf16_keep_bits) {
    const char *archs[2] = {"gpt2", "llama"};
    for (int a = 0; a < 2; a++) {
        result none = run(&(setup){archs[a], ANNEAL_BF16, false, false, ANNEAL_RECOMPUTE_NONE, false});
        result attn = run(&(setup){archs[a], ANNEAL_BF16, true, true, ANNEAL_RECOMPUTE_ATTN, true});
        result block = run(&(setup){archs[a], ANNEAL_BF16, true, true, ANNEAL_RECOMPUTE_BLOCK, true});
        check_grads("attn recompute", archs[a], &none, &attn);
        check_grads("block recompute", archs[a], &none, &block);
        CHECK(block.kept < attn.kept, "%s: block recompute keeps %lld, attn %lld", archs[a], (long long)block.kept,
              (long long)attn.kept);
        free_result(&none);
        free_result(&attn);
        free_result(&block);
    }
}

/* The saved copies come from the CPU copy's f32 -> bf16 path (a vectorised row loop):
 * its bits must be anneal_f32_to_bf16's and the GEMM operand rounding's for every kind
 * of value (ties either way, carries into the exponent, overflow to inf, NaNs of both
 * signs, subnormals, zeros), and bf16 -> f32 must give back exactly the rounded value. */
TEST(bf16_copy_rounds_as_the_gemm) {
    enum { N = 1 << 16 };
    anneal_scope *s = anneal_scope_open();
    int64_t n = N;
    anneal_tensor *x = anneal_empty(ANNEAL_F32, 1, &n), *h = anneal_empty(ANNEAL_BF16, 1, &n),
                  *w = anneal_empty(ANNEAL_F32, 1, &n);
    REQUIRE(x && h && w);
    uint32_t *xb = anneal_data(x);
    static const uint32_t special[] = {0x00000000u, 0x80000000u, 0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu,
                                       0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u,
                                       0xff800001u, 0x00000001u, 0x807fffffu, 0x007f8000u, 0x3fffffffu, 0x477fe000u};
    int ns = (int)(sizeof special / sizeof special[0]);
    anneal_test_rng_state = 17;
    for (int i = 0; i < N; i++) xb[i] = i < ns ? special[i] : (uint32_t)anneal_test_next_u64();
    REQUIRE(anneal_copy_(h, x) == ANNEAL_OK && anneal_copy_(w, h) == ANNEAL_OK);
    const uint16_t *hb = anneal_data(h);
    const uint32_t *wb = anneal_data(w);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        float f;
        memcpy(&f, &xb[i], 4);
        uint32_t g = anneal_gemm_round_bf16_bits(xb[i]);
        if ((hb[i] != anneal_f32_to_bf16(f) || wb[i] != g || ((uint32_t)hb[i] << 16) != g) && bad++ < 3)
            anneal_test_fail(__FILE__, __LINE__, "%08x: copy gives %04x (widened %08x), expected %04x / %08x", xb[i],
                             hb[i], wb[i], anneal_f32_to_bf16(f), g);
    }
    anneal_scope_close(s);
}

int main(void) {
    RUN(bf16_copy_rounds_as_the_gemm);
    RUN(block_scopes_keep_fp32_bits_and_free_intermediates);
    RUN(bf16_saves_keep_bf16_bits_and_halve_what_they_save);
    RUN(recompute_modes_at_bf16_keep_bits);
    return anneal_test_summary();
}
