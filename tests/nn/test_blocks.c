/* The nn blocks models are built from: the parameters each registers (Hugging Face
 * names under a prefix, layouts, weight-decay flags), forwards equal to the ops they
 * stand for (bit for bit), finite-difference gradient checks on tiny shapes (dense in
 * both layouts with and without bias and with each fused activation, the norms, both
 * MLPs, attention from a packed or three projections), the KV cache (its bookkeeping
 * and errors, and a cached forward in chunks equal to the full forward's rows), and
 * creation errors. Grouped-query heads and RoPE are in test_blocks_gqa_rope.c. */
#include "blocks_util.h"
#include "test.h"

static const anneal_nn_ctx k_f32 = {.compute = ANNEAL_F32, .training = false};

/* ------------------------------------------------------------------ dense */

TEST(dense_registers_hf_names_and_layouts) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_nn_dense a, b;
    REQUIRE(anneal_nn_dense_create(&a, ps, "h.0.mlp.c_fc", 4, 6, ANNEAL_WEIGHT_IN_OUT, true) == ANNEAL_OK);
    REQUIRE(anneal_nn_dense_create(&b, ps, "model.layers.0.self_attn.q_proj", 4, 6, ANNEAL_WEIGHT_OUT_IN, false) ==
            ANNEAL_OK);
    CHECK(ps->n == 3, "registered %d", ps->n);
    CHECK_TRUE(!strcmp(ps->items[0].name, "h.0.mlp.c_fc.weight") && ps->items[0].decay);
    CHECK_TRUE(!strcmp(ps->items[1].name, "h.0.mlp.c_fc.bias") && !ps->items[1].decay);
    CHECK_TRUE(!strcmp(ps->items[2].name, "model.layers.0.self_attn.q_proj.weight") && ps->items[2].decay);
    CHECK_TRUE(a.weight->shape[0] == 4 && a.weight->shape[1] == 6 && a.bias && a.bias->shape[0] == 6);
    CHECK_TRUE(b.weight->shape[0] == 6 && b.weight->shape[1] == 4 && b.bias == NULL);
    /* a duplicate name and bad sizes are refused */
    anneal_nn_dense c;
    anneal_clear_error();
    CHECK_TRUE(anneal_nn_dense_create(&c, ps, "h.0.mlp.c_fc", 4, 6, ANNEAL_WEIGHT_IN_OUT, true) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_nn_dense_create(&c, ps, "x", 0, 6, ANNEAL_WEIGHT_IN_OUT, true) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_params_free(ps);
}

typedef struct dense_case {
    anneal_nn_dense *d;
    anneal_activation act;
} dense_case;

/* inputs: x, then (SILU_MUL) the multiplier; the parameters are perturbed in place. */
static anneal_tensor *f_dense(void *ctx, anneal_tensor *const *in) {
    const dense_case *c = ctx;
    return anneal_nn_dense_forward_act(c->d, &k_f32, in[0], c->act, c->act == ANNEAL_ACT_SILU_MUL ? in[1] : NULL);
}

TEST(dense_forward_is_the_op_and_gradients_check) {
    anneal_scope *s = anneal_scope_open();
    for (int layout = 0; layout < 2; layout++)
        for (int bias = 0; bias < 2; bias++)
            for (int act = 0; act < 3; act++) {
                anneal_params *ps = anneal_params_new();
                anneal_nn_dense d;
                REQUIRE(anneal_nn_dense_create(&d, ps, "d", 4, 5, (anneal_weight_layout)layout, bias) == ANNEAL_OK);
                bu_randomize(ps, 3 + (uint64_t)(layout * 6 + bias * 3 + act));
                anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 11, true);
                anneal_tensor *mul = anneal_test_rand(3, (int64_t[]){2, 3, 5}, -1, 1, 12, true);
                /* the op it stands for, bit for bit */
                anneal_tensor *want = layout == ANNEAL_WEIGHT_IN_OUT ? anneal_conv1d(x, d.weight, d.bias)
                                                                     : anneal_linear(x, d.weight, d.bias);
                if (act == ANNEAL_ACT_GELU_TANH) want = anneal_gelu(want, true);
                if (act == ANNEAL_ACT_SILU_MUL) want = anneal_mul(anneal_silu(want), mul);
                anneal_tensor *got = anneal_nn_dense_forward_act(&d, &k_f32, x, (anneal_activation)act,
                                                                 act == ANNEAL_ACT_SILU_MUL ? mul : NULL);
                double diff = bu_max_diff(got, want);
                /* the fused epilogues may round differently from the separate ops */
                CHECK(diff <= (act == ANNEAL_ACT_NONE ? 0.0 : 1e-5), "layout %d bias %d act %d: differs by %g",
                      layout, bias, act, diff);
                dense_case c = {&d, (anneal_activation)act};
                if (act == ANNEAL_ACT_SILU_MUL) {
                    anneal_tensor *in[4] = {x, mul, d.weight, d.bias};
                    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.14% of it (AVX-512, avx2, portable) */
                    CHECK_GRAD(f_dense, &c, bias ? 4 : 3, in, 1e-2, 4e-5, 4e-4);
                } else {
                    anneal_tensor *in[3] = {x, d.weight, d.bias};
                    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.25% of it (AVX-512, avx2, portable) */
                    CHECK_GRAD(f_dense, &c, bias ? 3 : 2, in, 1e-2, 1e-4, 1e-3);
                }
                anneal_params_free(ps);
            }
    anneal_scope_close(s);
}

/* ------------------------------------------------------- norms, embedding */

typedef struct norm_case {
    anneal_nn_layer_norm *ln;
    anneal_nn_rms_norm *rms;
} norm_case;

static anneal_tensor *f_norm(void *ctx, anneal_tensor *const *in) {
    const norm_case *c = ctx;
    return c->ln ? anneal_nn_layer_norm_forward(c->ln, in[0]) : anneal_nn_rms_norm_forward(c->rms, in[0]);
}

static anneal_tensor *f_add_ln(void *ctx, anneal_tensor *const *in) {
    anneal_tensor *sum;
    anneal_tensor *h = anneal_nn_add_layer_norm(ctx, in[0], in[1], &sum);
    return anneal_add(h, anneal_scale(sum, 0.5f));
}

TEST(norms_and_embedding) {
    anneal_scope *s = anneal_scope_open();
    anneal_params *ps = anneal_params_new();
    anneal_nn_layer_norm ln, ln_nb;
    anneal_nn_rms_norm rms;
    anneal_nn_embedding emb;
    REQUIRE(anneal_nn_layer_norm_create(&ln, ps, "transformer.ln_f", 6, 1e-5f, true) == ANNEAL_OK);
    REQUIRE(anneal_nn_layer_norm_create(&ln_nb, ps, "ln_nb", 6, 1e-5f, false) == ANNEAL_OK);
    REQUIRE(anneal_nn_rms_norm_create(&rms, ps, "model.norm", 6, 1e-6f) == ANNEAL_OK);
    REQUIRE(anneal_nn_embedding_create(&emb, ps, "model.embed_tokens", 10, 6) == ANNEAL_OK);
    CHECK(ps->n == 5, "registered %d", ps->n);
    static const char *names[] = {"transformer.ln_f.weight", "transformer.ln_f.bias", "ln_nb.weight",
                                  "model.norm.weight", "model.embed_tokens.weight"};
    for (int i = 0; i < 5 && i < ps->n; i++)
        CHECK(!strcmp(ps->items[i].name, names[i]) && !ps->items[i].decay, "%d: %s", i, ps->items[i].name);
    CHECK_TRUE(ln_nb.bias == NULL && emb.weight->shape[0] == 10 && emb.weight->shape[1] == 6);
    bu_randomize(ps, 5);
    anneal_tensor *x = anneal_test_rand(2, (int64_t[]){3, 6}, -1, 1, 21, true);
    anneal_tensor *r = anneal_test_rand(2, (int64_t[]){3, 6}, -1, 1, 22, true);
    CHECK_TRUE(bu_same_bits(anneal_nn_layer_norm_forward(&ln, x), anneal_layer_norm(x, ln.weight, ln.bias, 1e-5f)));
    CHECK_TRUE(bu_same_bits(anneal_nn_rms_norm_forward(&rms, x), anneal_rms_norm(x, rms.weight, 1e-6f)));
    anneal_tensor *sum, *sum2;
    anneal_tensor *h = anneal_nn_add_layer_norm(&ln, x, r, &sum);
    anneal_tensor *h2 = anneal_add_layer_norm(x, r, ln.weight, ln.bias, 1e-5f, &sum2);
    CHECK_TRUE(bu_same_bits(h, h2) && bu_same_bits(sum, sum2));
    int32_t idv[4] = {0, 9, 3, 3};
    anneal_tensor *ids = anneal_from_data(ANNEAL_I32, 1, (int64_t[]){4}, idv);
    CHECK_TRUE(bu_same_bits(anneal_nn_embedding_forward(&emb, ids), anneal_embedding(ids, emb.weight)));
    norm_case c1 = {&ln, NULL}, c2 = {&ln_nb, NULL}, c3 = {NULL, &rms};
    anneal_tensor *i1[3] = {x, ln.weight, ln.bias}, *i2[2] = {x, ln_nb.weight}, *i3[2] = {x, rms.weight};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.19% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_norm, &c1, 3, i1, 1e-2, 4e-5, 4e-4);
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.55% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_norm, &c2, 2, i2, 1e-2, 2e-4, 2e-3);
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.2% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_norm, &c3, 2, i3, 1e-2, 1e-4, 1e-3);
    anneal_tensor *i4[4] = {x, r, ln.weight, ln.bias};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.097% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_add_ln, &ln, 4, i4, 1e-2, 2e-5, 2e-4);
    anneal_params_free(ps);
    anneal_scope_close(s);
}

/* -------------------------------------------------------------------- MLP */

static anneal_tensor *f_mlp(void *ctx, anneal_tensor *const *in) { return anneal_nn_mlp_forward(ctx, &k_f32, in[0]); }

TEST(mlp_gelu_and_swiglu) {
    anneal_scope *s = anneal_scope_open();
    anneal_params *ps = anneal_params_new();
    anneal_nn_mlp g, w;
    REQUIRE(anneal_nn_mlp_create_gelu(&g, ps, "transformer.h.0.mlp", 4, 8, ANNEAL_WEIGHT_IN_OUT, true, "c_fc",
                                      "c_proj") == ANNEAL_OK);
    REQUIRE(anneal_nn_mlp_create_swiglu(&w, ps, "model.layers.0.mlp", 4, 6, ANNEAL_WEIGHT_OUT_IN, false) == ANNEAL_OK);
    static const char *names[] = {"transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias",
                                  "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias",
                                  "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight"};
    CHECK(ps->n == 7, "registered %d", ps->n);
    for (int i = 0; i < 7 && i < ps->n; i++) CHECK(!strcmp(ps->items[i].name, names[i]), "%d: %s", i, ps->items[i].name);
    CHECK_TRUE(w.gate.weight->shape[0] == 6 && w.gate.weight->shape[1] == 4 && w.down.weight->shape[0] == 4);
    bu_randomize(ps, 9);
    anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 31, true);
    /* GPT-2's: proj(gelu_tanh(fc x)); Llama's: down(silu(gate x) * up x) */
    anneal_tensor *want_g = anneal_conv1d(anneal_conv1d_gelu(x, g.fc.weight, g.fc.bias), g.proj.weight, g.proj.bias);
    CHECK_TRUE(bu_same_bits(anneal_nn_mlp_forward(&g, &k_f32, x), want_g));
    anneal_tensor *want_w = anneal_linear(anneal_mul(anneal_silu(anneal_linear(x, w.gate.weight, NULL)),
                                                     anneal_linear(x, w.up.weight, NULL)),
                                          w.down.weight, NULL);
    double d = bu_max_diff(anneal_nn_mlp_forward(&w, &k_f32, x), want_w);
    CHECK(d <= 1e-5, "swiglu differs by %g", d);
    anneal_tensor *ig[5] = {x, g.fc.weight, g.fc.bias, g.proj.weight, g.proj.bias};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.32% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_mlp, &g, 5, ig, 1e-2, 1e-4, 1e-3);
    anneal_tensor *iw[4] = {x, w.gate.weight, w.up.weight, w.down.weight};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.11% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_mlp, &w, 4, iw, 1e-2, 4e-5, 4e-4);
    anneal_params_free(ps);
    anneal_scope_close(s);
}

/* -------------------------------------------------------------- attention */

/* A packed (GPT-2: c_attn, biases, (in, out)) or three-projection (Llama names,
 * (out, in), no biases) attention of n_embd C with H heads. */
static anneal_status make_attention(anneal_nn_attention *a, anneal_params *ps, bool packed, int64_t C, int H,
                                    int Hkv) {
    anneal_nn_attention_config c = {.n_embd = C, .n_head = H, .n_kv_head = Hkv};
    if (packed) {
        c.layout = ANNEAL_WEIGHT_IN_OUT, c.qkv_bias = c.out_bias = true;
        c.qkv_name = "c_attn", c.out_name = "c_proj";
    } else {
        c.layout = ANNEAL_WEIGHT_OUT_IN;
        c.q_name = "q_proj", c.k_name = "k_proj", c.v_name = "v_proj", c.out_name = "o_proj";
    }
    return anneal_nn_attention_create(a, ps, packed ? "attn" : "self_attn", &c);
}

static anneal_tensor *f_attn(void *ctx, anneal_tensor *const *in) {
    return anneal_nn_attention_forward(ctx, &k_f32, in[0], NULL, 0);
}

TEST(attention_names_and_gradients) {
    anneal_scope *s = anneal_scope_open();
    for (int packed = 0; packed < 2; packed++) {
        anneal_params *ps = anneal_params_new();
        anneal_nn_attention a;
        REQUIRE(make_attention(&a, ps, packed, 8, 2, 0) == ANNEAL_OK);
        if (packed) {
            CHECK(ps->n == 4 && !strcmp(ps->items[0].name, "attn.c_attn.weight") &&
                      !strcmp(ps->items[3].name, "attn.c_proj.bias") && a.qkv.weight->shape[1] == 24,
                  "packed: %d parameters", ps->n);
        } else {
            CHECK(ps->n == 4 && !strcmp(ps->items[0].name, "self_attn.q_proj.weight") &&
                      !strcmp(ps->items[2].name, "self_attn.v_proj.weight") &&
                      !strcmp(ps->items[3].name, "self_attn.o_proj.weight") && a.out.bias == NULL,
                  "separate: %d parameters", ps->n);
        }
        bu_randomize(ps, 40 + (uint64_t)packed);
        anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 3, 8}, -1, 1, 41, true);
        anneal_tensor *in[6] = {x};
        int n = 1;
        for (int i = 0; i < ps->n; i++) in[n++] = ps->items[i].tensor;
        /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.68% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_attn, &a, n, in, 1e-2, 2e-4, 2e-3);
        anneal_params_free(ps);
    }
    anneal_scope_close(s);
}

TEST(packed_and_separate_projections_agree) {
    anneal_scope *s = anneal_scope_open();
    const int64_t C = 8;
    anneal_params *pp = anneal_params_new(), *sp = anneal_params_new();
    anneal_nn_attention p, q;
    REQUIRE(make_attention(&p, pp, true, C, 2, 0) == ANNEAL_OK);
    anneal_nn_attention_config c = {.n_embd = C, .n_head = 2, .layout = ANNEAL_WEIGHT_IN_OUT, .qkv_bias = true,
                                    .out_bias = true, .q_name = "q", .k_name = "k", .v_name = "v", .out_name = "o"};
    REQUIRE(anneal_nn_attention_create(&q, sp, "a", &c) == ANNEAL_OK);
    bu_randomize(pp, 50);
    /* the separate projections are the packed one's column blocks */
    anneal_nn_dense *parts[3] = {&q.q, &q.k, &q.v};
    for (int i = 0; i < 3; i++) {
        REQUIRE(anneal_copy_(parts[i]->weight, anneal_narrow(p.qkv.weight, 1, i * C, C)) == ANNEAL_OK);
        REQUIRE(anneal_copy_(parts[i]->bias, anneal_narrow(p.qkv.bias, 0, i * C, C)) == ANNEAL_OK);
    }
    REQUIRE(anneal_copy_(q.out.weight, p.out.weight) == ANNEAL_OK && anneal_copy_(q.out.bias, p.out.bias) == ANNEAL_OK);
    anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 5, C}, -1, 1, 51, false);
    double d = bu_max_diff(anneal_nn_attention_forward(&p, &k_f32, x, NULL, 0),
                           anneal_nn_attention_forward(&q, &k_f32, x, NULL, 0));
    CHECK(d <= 1e-6, "packed vs separate: %g", d);
    anneal_params_free(pp);
    anneal_params_free(sp);
    anneal_scope_close(s);
}

/* The rows of a full causal forward over T positions equal a cached forward fed in
 * chunks, for both projection kinds. */
TEST(cached_attention_matches_the_full_forward) {
    anneal_scope *s = anneal_scope_open();
    enum { B = 2, T = 9, C = 8 };
    for (int packed = 0; packed < 2; packed++) {
        anneal_params *ps = anneal_params_new();
        anneal_nn_attention a;
        REQUIRE(make_attention(&a, ps, packed, C, 2, 0) == ANNEAL_OK);
        bu_randomize(ps, 60 + (uint64_t)packed);
        anneal_tensor *x = anneal_test_rand(3, (int64_t[]){B, T, C}, -1, 1, 61, false);
        anneal_no_grad_begin();
        anneal_tensor *full = anneal_nn_attention_forward(&a, &k_f32, x, NULL, 0);
        anneal_kv_cache *kv = anneal_kv_cache_new(ANNEAL_CPU, 1, B, 2, C / 2, 16, &a);
        REQUIRE(full && kv);
        const int chunks[] = {4, 1, 3, 1};
        int at = 0;
        for (int k = 0; k < 4; k++) {
            anneal_tensor *part = anneal_narrow(x, 1, at, chunks[k]);
            anneal_tensor *got = anneal_nn_attention_forward(&a, &k_f32, part, kv, 0);
            REQUIRE(got && anneal_kv_cache_advance(kv, chunks[k]) == ANNEAL_OK);
            double d = bu_max_diff(got, anneal_narrow(full, 1, at, chunks[k]));
            CHECK(d <= 1e-5, "%s chunk %d: %g", packed ? "packed" : "separate", k, d);
            at += chunks[k];
        }
        CHECK_TRUE(anneal_kv_cache_len(kv) == T);
        anneal_no_grad_end();
        anneal_kv_cache_free(kv);
        anneal_params_free(ps);
    }
    anneal_scope_close(s);
}

TEST(kv_cache_bookkeeping_and_errors) {
    anneal_scope *s = anneal_scope_open();
    int owner;
    anneal_kv_cache *kv = anneal_kv_cache_new(ANNEAL_CPU, 2, 1, 2, 4, 6, &owner);
    REQUIRE(kv);
    CHECK_TRUE(anneal_kv_cache_len(kv) == 0 && anneal_kv_cache_batch(kv) == 1 && anneal_kv_cache_max_len(kv) == 6 &&
               anneal_kv_cache_owner(kv) == &owner);
    anneal_tensor *k = anneal_test_rand(4, (int64_t[]){1, 2, 4, 4}, -1, 1, 70, false);
    anneal_tensor *v = anneal_test_rand(4, (int64_t[]){1, 2, 4, 4}, -1, 1, 71, false);
    REQUIRE(anneal_kv_cache_write(kv, 1, k, v) == ANNEAL_OK);
    CHECK_TRUE(anneal_kv_cache_len(kv) == 0); /* the model advances once every layer is written */
    REQUIRE(anneal_kv_cache_advance(kv, 4) == ANNEAL_OK);
    anneal_tensor *ks = anneal_kv_cache_keys(kv, 1, 4), *vs = anneal_kv_cache_values(kv, 1, 4);
    CHECK_TRUE(ks && ks->shape[2] == 4 && bu_same_bits(ks, k) && bu_same_bits(vs, v));
    /* past max_len, other shapes, a layer out of range: refused, nothing moves */
    anneal_clear_error();
    CHECK_TRUE(anneal_kv_cache_write(kv, 0, k, v) == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    anneal_tensor *bad = anneal_test_rand(4, (int64_t[]){1, 3, 1, 4}, -1, 1, 72, false);
    CHECK_TRUE(anneal_kv_cache_write(kv, 0, bad, bad) == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_kv_cache_write(kv, 2, k, v) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_kv_cache_advance(kv, 3) == ANNEAL_ERR_SHAPE && anneal_kv_cache_len(kv) == 4);
    anneal_clear_error();
    anneal_kv_cache_reset(kv);
    CHECK_TRUE(anneal_kv_cache_len(kv) == 0);
    anneal_kv_cache_free(kv);
    CHECK_TRUE(anneal_kv_cache_new(ANNEAL_CPU, 1, 0, 2, 4, 6, NULL) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_kv_cache *none = anneal_kv_cache_new(ANNEAL_CPU, 0, 1, 1, 1, 3, NULL); /* no layers: positions only */
    CHECK_TRUE(none && anneal_kv_cache_advance(none, 3) == ANNEAL_OK && anneal_kv_cache_len(none) == 3);
    anneal_kv_cache_free(none);
    anneal_kv_cache_free(NULL);
    anneal_scope_close(s);
}

TEST(attention_create_errors) {
    anneal_params *ps = anneal_params_new();
    anneal_nn_attention a;
    anneal_nn_attention_config c = {.n_embd = 8, .n_head = 4, .n_kv_head = 3, .qkv_name = "c_attn", .out_name = "o"};
    anneal_clear_error();
    CHECK_TRUE(anneal_nn_attention_create(&a, ps, "a", &c) == ANNEAL_ERR_ARG); /* 4 heads over 3 kv heads */
    c.n_kv_head = 0, c.n_embd = 10;
    anneal_clear_error();
    CHECK_TRUE(anneal_nn_attention_create(&a, ps, "b", &c) == ANNEAL_ERR_ARG); /* 10 over 4 heads */
    c.n_embd = 8, c.qkv_name = NULL;
    anneal_clear_error();
    CHECK_TRUE(anneal_nn_attention_create(&a, ps, "c", &c) == ANNEAL_ERR_ARG && strstr(anneal_last_error(), "name"));
    anneal_clear_error();
    anneal_params_free(ps);
}

int main(void) {
    RUN(dense_registers_hf_names_and_layouts);
    RUN(dense_forward_is_the_op_and_gradients_check);
    RUN(norms_and_embedding);
    RUN(mlp_gelu_and_swiglu);
    RUN(attention_names_and_gradients);
    RUN(packed_and_separate_projections_agree);
    RUN(cached_attention_matches_the_full_forward);
    RUN(kv_cache_bookkeeping_and_errors);
    RUN(attention_create_errors);
    return anneal_test_summary();
}
