/* The Llama architecture on its own: presets, config.json both ways (every model_type,
 * rope scaling, biases, tying) and its refusals (malformed and unsupported settings
 * named), weight import refusals (missing, unknown, misshapen tensors, an untied
 * head under a tied config; the model left untouched), the KV-cache forward equal to
 * the full forward's rows (GQA, MQA, rope scaling), generation, recompute modes giving
 * bit-identical gradients, FLOPs and parameter counts, and `anneal train --model
 * llama-tiny` with --synthetic and with --data end to end, then `anneal generate` and
 * `anneal eval` on its checkpoint. */
#include <unistd.h>

#include "llama_fixture.h"

static char g_tmp[64];

static const char *tmp_path(const char *name) { return llama_fx_join(g_tmp, name); }

static void write_text(const char *p, const char *txt) {
    FILE *f = fopen(p, "wb");
    if (f) {
        fputs(txt, f);
        fclose(f);
    }
}

static bool contains(const char *s, const char *sub) { return s && strstr(s, sub) != NULL; }

/* llama-tiny with the changes a test wants. */
static anneal_model_config tiny(void) {
    anneal_model_config c;
    memset(&c, 0, sizeof c);
    anneal_model_preset("llama-tiny", &c);
    return c;
}

/* ----------------------------------------------------------------- presets */

TEST(presets_are_listed_and_valid) {
    char names[512];
    anneal_model_preset_names(names, sizeof names);
    CHECK(contains(names, "llama-tiny") && contains(names, "llama-125M"), "%s", names);
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-125M", &c));
    CHECK_TRUE(!strcmp(c.arch, "llama") && c.n_layer == 12 && c.n_embd == 768 && c.n_head == 12 && c.n_kv_head == 4 &&
               c.vocab_size == 32000);
    CHECK(anneal_model_config_check(&c) == ANNEAL_OK, "%s", anneal_last_error());
    /* count: 2 x 32000 x 768 (embedding, untied head) + 12 x (768 x (768 + 2 x 256 + 768) + 3 x 768 x 2048 + 2 x 768)
     * + 768 */
    int64_t want = 2LL * 32000 * 768 + 12LL * (768LL * (768 + 2 * 256 + 768) + 3LL * 768 * 2048 + 2 * 768) + 768;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(m);
    CHECK(anneal_model_num_params(m) == want, "%lld params, want %lld", (long long)anneal_model_num_params(m),
          (long long)want);
    /* FLOPs per token at T = 256: 6 x (matmul weights: layers + head) + 12 L T C */
    double mm = 12.0 * (768.0 * (768 + 2 * 256 + 768) + 3.0 * 768 * 2048) + 32000.0 * 768;
    double flops = 6.0 * mm + 12.0 * 12 * 256 * 768;
    CHECK_NEAR(anneal_model_flops_per_token(m, 256), flops, flops * 1e-12);
    anneal_model_free(m);
}

/* ------------------------------------------------------------------ config */

/* config_to_hf then config_from_hf gives the same config back. */
static void round_trip(const anneal_model_config *w, const char *what, const char *expect1, const char *expect2) {
    char *hf = anneal_model_config_to_hf_json(w);
    CHECK(hf, "%s: %s", what, anneal_last_error());
    if (!hf) return;
    CHECK(contains(hf, expect1) && contains(hf, expect2), "%s: %s", what, hf);
    anneal_model_config c;
    memset(&c, 0x5a, sizeof c);
    anneal_status s = anneal_model_config_from_hf_json(hf, what, &c);
    CHECK(s == ANNEAL_OK, "%s: %s\n%s", what, anneal_last_error(), hf);
    CHECK(s != ANNEAL_OK || memcmp(&c, w, sizeof c) == 0,
          "%s: round trip differs (L%d H%d Hkv%d C%d F%d V%d ctx%d eps %g theta %g scaling %d factor %g tie %d "
          "qkv %d out %d type %s)",
          what, c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.n_ff, c.vocab_size, c.n_ctx, (double)c.norm_eps,
          (double)c.rope_theta, (int)c.rope.scaling, (double)c.rope.factor, c.tie_embeddings, c.qkv_bias, c.out_bias,
          c.hf_model_type);
    free(hf);
}

TEST(config_round_trips_every_model_type) {
    anneal_model_config w = tiny();
    round_trip(&w, "llama-tiny", "\"LlamaForCausalLM\"", "\"rope_scaling\": null");
    w.qkv_bias = w.out_bias = true, w.tie_embeddings = true, w.n_kv_head = 1, w.norm_eps = 1e-6f;
    w.rope_theta = w.rope.theta = 500000.0f;
    w.rope.scaling = ANNEAL_ROPE_SCALING_LLAMA3, w.rope.factor = 8.0f, w.rope.low_freq_factor = 1.0f;
    w.rope.high_freq_factor = 4.0f, w.rope.original_max_pos = 8192;
    round_trip(&w, "llama3", "\"rope_type\": \"llama3\"", "\"attention_bias\": true");
    w = tiny();
    snprintf(w.hf_model_type, sizeof w.hf_model_type, "qwen2");
    w.qkv_bias = true, w.rope_theta = w.rope.theta = 1e6f;
    w.rope.scaling = ANNEAL_ROPE_SCALING_LINEAR, w.rope.factor = 2.5f;
    round_trip(&w, "qwen2", "\"Qwen2ForCausalLM\"", "\"type\": \"linear\"");
    w = tiny();
    snprintf(w.hf_model_type, sizeof w.hf_model_type, "mistral");
    w.n_kv_head = 4, w.tie_embeddings = true;
    round_trip(&w, "mistral", "\"MistralForCausalLM\"", "\"sliding_window\": null");
}

TEST(config_refusals_name_the_key) {
    static const char *base = "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 32, "
                              "\"intermediate_size\": 40, \"vocab_size\": 50, \"max_position_embeddings\": 64";
    static const struct {
        const char *text; /* "%s" is replaced by base */
        anneal_status want;
        const char *msg;
    } cases[] = {
        {"{\"model_type\": \"llama\", %s}", ANNEAL_OK, NULL},
        {"{\"model_type\": \"mistral\", %s, \"num_key_value_heads\": 2, \"sliding_window\": 64}", ANNEAL_OK, NULL},
        {"{\"model_type\": \"qwen2\", %s, \"sliding_window\": 8, \"use_sliding_window\": false}", ANNEAL_OK, NULL},
        {"{\"model_type\": \"gemma\", %s}", ANNEAL_ERR_UNSUPPORTED, "model_type \"gemma\" is not supported"},
        {"{\"model_type\": \"llama\", %s, \"hidden_act\": \"gelu\"}", ANNEAL_ERR_UNSUPPORTED, "hidden_act \"gelu\""},
        {"{\"model_type\": \"llama\", %s, \"mlp_bias\": true}", ANNEAL_ERR_UNSUPPORTED, "mlp_bias"},
        {"{\"model_type\": \"llama\", %s, \"head_dim\": 16}", ANNEAL_ERR_UNSUPPORTED, "head_dim"},
        {"{\"model_type\": \"llama\", %s, \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}}",
         ANNEAL_ERR_UNSUPPORTED, "rope_scaling type \"dynamic\""},
        {"{\"model_type\": \"llama\", %s, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2.0}}",
         ANNEAL_ERR_UNSUPPORTED, "\"yarn\""},
        {"{\"model_type\": \"llama\", %s, \"rope_scaling\": {\"type\": \"linear\"}}", ANNEAL_ERR_FORMAT, "factor"},
        {"{\"model_type\": \"llama\", %s, \"rope_scaling\": {\"type\": \"linear\", \"factor\": -1}}", ANNEAL_ERR_FORMAT,
         "rope_scaling.factor"},
        {"{\"model_type\": \"llama\", %s, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}}",
         ANNEAL_ERR_FORMAT, "low_freq_factor"},
        {"{\"model_type\": \"llama\", %s, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
         "\"low_freq_factor\": 4.0, \"high_freq_factor\": 1.0, \"original_max_position_embeddings\": 64}}",
         ANNEAL_ERR_FORMAT, "high_freq_factor"},
        {"{\"model_type\": \"llama\", %s, \"rope_scaling\": 3}", ANNEAL_ERR_FORMAT, "rope_scaling"},
        {"{\"model_type\": \"mistral\", %s, \"num_key_value_heads\": 2, \"sliding_window\": 16}", ANNEAL_ERR_UNSUPPORTED, "sliding_window 16"},
        {"{\"model_type\": \"qwen2\", %s, \"sliding_window\": 16, \"use_sliding_window\": true}", ANNEAL_ERR_UNSUPPORTED,
         "sliding_window 16"},
        {"{\"model_type\": \"mistral\", %s, \"num_key_value_heads\": 2, \"attention_bias\": true}", ANNEAL_ERR_UNSUPPORTED, "attention_bias"},
        {"{\"model_type\": \"llama\", %s, \"num_key_value_heads\": 3}", ANNEAL_ERR_FORMAT, "num_key_value_heads 3"},
        {"{\"model_type\": \"llama\", %s, \"num_key_value_heads\": 0}", ANNEAL_ERR_FORMAT, "num_key_value_heads"},
        {"{\"model_type\": \"llama\", %s, \"rms_norm_eps\": \"x\"}", ANNEAL_ERR_FORMAT, "rms_norm_eps"},
        {"{\"model_type\": \"llama\", %s, \"rope_theta\": 0}", ANNEAL_ERR_FORMAT, "rope_theta"},
        {"{\"model_type\": \"llama\", %s, \"tie_word_embeddings\": 1}", ANNEAL_ERR_FORMAT, "tie_word_embeddings"},
        {"{\"model_type\": \"llama\", \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 32, "
         "\"vocab_size\": 50}",
         ANNEAL_ERR_FORMAT, "missing \"intermediate_size\""},
        {"{\"model_type\": \"llama\", \"num_hidden_layers\": 2, \"num_attention_heads\": 5, \"hidden_size\": 32, "
         "\"intermediate_size\": 40, \"vocab_size\": 50}",
         ANNEAL_ERR_FORMAT, "not divisible"},
        {"{\"model_type\": \"llama\", \"num_hidden_layers\": 2.5, \"num_attention_heads\": 4, \"hidden_size\": 32, "
         "\"intermediate_size\": 40, \"vocab_size\": 50}",
         ANNEAL_ERR_FORMAT, "num_hidden_layers"},
        {"{\"model_type\": \"llama\", %s", ANNEAL_ERR_FORMAT, "invalid JSON"},
    };
    const char *p = tmp_path("cfg.json");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char txt[2048];
        snprintf(txt, sizeof txt, cases[i].text, base);
        write_text(p, txt);
        anneal_model_config c;
        anneal_status s = anneal_model_config_from_hf_file(p, &c);
        if (cases[i].want == ANNEAL_OK)
            CHECK(s == ANNEAL_OK && c.n_layer == 2 && c.n_ff == 40 && c.n_ctx == 64, "case %zu: %s", i,
                  anneal_last_error());
        else
            CHECK(s == cases[i].want && contains(anneal_last_error(), cases[i].msg) && contains(anneal_last_error(), p),
                  "case %zu (%s): %s: %s", i, txt, anneal_status_name(s), anneal_last_error());
        anneal_clear_error();
    }
}

TEST(config_check_refuses_inconsistent_settings) {
    anneal_model_config c = tiny();
    c.dropout = 0.1f;
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "dropout"));
    anneal_clear_error();
    c = tiny();
    c.n_kv_head = 3;
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "n_kv_head"));
    anneal_clear_error();
    c = tiny();
    c.qkv_bias = true; /* llama: attention_bias covers all four projections */
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "attention_bias"));
    anneal_clear_error();
    c = tiny();
    snprintf(c.hf_model_type, sizeof c.hf_model_type, "qwen2");
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "qwen2"));
    anneal_clear_error();
    c = tiny();
    snprintf(c.hf_model_type, sizeof c.hf_model_type, "phi");
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "phi"));
    anneal_clear_error();
    c = tiny();
    c.rope.scaling = ANNEAL_ROPE_SCALING_LINEAR;
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "factor"));
    anneal_clear_error();
    c = tiny();
    c.n_ff = 0;
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "n_ff"));
    anneal_clear_error();
    /* GPT-2 refuses the Llama fields */
    REQUIRE(anneal_model_preset("tiny", &c));
    c.qkv_bias = true;
    CHECK_TRUE(anneal_model_config_check(&c) == ANNEAL_ERR_ARG && contains(anneal_last_error(), "qkv_bias"));
    anneal_clear_error();
}

/* ----------------------------------------------------------------- weights */

typedef struct mem_sink {
    anneal_st_write_entry e[64];
    char names[64][96];
    int64_t shapes[64][ANNEAL_MAX_DIMS];
    int n;
} mem_sink;

/* Keeps a copy of each exported tensor (the data must outlive put). */
static anneal_status mem_put(void *ctx, const char *name, const anneal_tensor *t) {
    mem_sink *s = ctx;
    if (s->n == 64) return anneal_set_error(ANNEAL_ERR_OOM, "mem_sink full");
    anneal_st_write_entry *e = &s->e[s->n];
    snprintf(s->names[s->n], sizeof s->names[0], "%s", name);
    e->name = s->names[s->n];
    e->dtype = ANNEAL_F32;
    e->ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) s->shapes[s->n][d] = t->shape[d];
    e->shape = s->shapes[s->n];
    size_t bytes = (size_t)anneal_numel(t) * sizeof(float);
    void *copy = malloc(bytes);
    if (!copy) return anneal_set_error(ANNEAL_ERR_OOM, "mem_sink");
    memcpy(copy, anneal_data(t), bytes);
    e->data = copy;
    s->n++;
    return ANNEAL_OK;
}

static void mem_free(mem_sink *s) {
    for (int i = 0; i < s->n; i++) free((void *)s->e[i].data);
    s->n = 0;
}

/* Writes the sink's tensors to path, leaving out `drop`, renaming `rename_from` to
 * `rename_to` and adding `extra` (a copy of the first tensor) when given. */
static bool write_variant(mem_sink *s, const char *path, const char *drop, const char *extra, const char *rename_from,
                          const char *rename_to) {
    anneal_st_write_entry e[66];
    int n = 0;
    for (int i = 0; i < s->n; i++) {
        if (drop && !strcmp(s->e[i].name, drop)) continue;
        e[n] = s->e[i];
        if (rename_from && !strcmp(e[n].name, rename_from)) e[n].name = rename_to;
        n++;
    }
    if (extra) {
        e[n] = s->e[0];
        e[n++].name = extra;
    }
    return anneal_safetensors_write(path, n, e, 0, NULL, NULL) == ANNEAL_OK;
}

TEST(import_refuses_bad_weights_and_leaves_the_model) {
    anneal_model_config c = tiny();
    c.n_layer = 1;
    anneal_model *src = anneal_model_new(&c, ANNEAL_CPU), *dst = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(src && dst);
    REQUIRE(anneal_model_init(src, 1) == ANNEAL_OK && anneal_model_init(dst, 2) == ANNEAL_OK);
    mem_sink s = {.n = 0};
    REQUIRE(anneal_model_hf_export(src, &(anneal_tensor_sink){.ctx = &s, .put = mem_put}) == ANNEAL_OK);
    CHECK(s.n == src->params->n && !strcmp(s.e[0].name, "model.embed_tokens.weight") &&
              !strcmp(s.e[1].name, "model.layers.0.self_attn.q_proj.weight") &&
              !strcmp(s.e[s.n - 1].name, "lm_head.weight"),
          "export names: %d, %s .. %s", s.n, s.e[0].name, s.e[s.n - 1].name);
    float before = ((float *)anneal_data(dst->params->items[0].tensor))[0];
    static const struct {
        const char *drop, *extra, *from, *to, *msg;
    } cases[] = {
        {"model.layers.0.mlp.up_proj.weight", NULL, NULL, NULL, "missing 1 tensor(s): model.layers.0.mlp.up_proj.weight"},
        {NULL, "model.layers.1.mlp.up_proj.weight", NULL, NULL, "model.layers.1.mlp.up_proj.weight"},
        {NULL, "model.layers.0.self_attn.q_proj.bias", NULL, NULL, "no q/k/v biases"},
        {NULL, NULL, "model.norm.weight", "model.final_norm.weight", "model.final_norm.weight"},
    };
    const char *p = tmp_path("bad.safetensors");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        REQUIRE(write_variant(&s, p, cases[i].drop, cases[i].extra, cases[i].from, cases[i].to));
        anneal_status st = anneal_model_load_safetensors(dst, p);
        CHECK(st != ANNEAL_OK && contains(anneal_last_error(), cases[i].msg) && contains(anneal_last_error(), p),
              "case %zu: %s: %s", i, anneal_status_name(st), anneal_last_error());
        anneal_clear_error();
        CHECK_TRUE(((float *)anneal_data(dst->params->items[0].tensor))[0] == before);
    }
    /* a misshapen tensor: q_proj stored as (32, 64) */
    s.shapes[1][0] = 32;
    REQUIRE(write_variant(&s, p, NULL, NULL, NULL, NULL));
    s.shapes[1][0] = 64;
    CHECK_TRUE(anneal_model_load_safetensors(dst, p) == ANNEAL_ERR_FORMAT &&
               contains(anneal_last_error(), "model.layers.0.self_attn.q_proj.weight has shape (32, 64)"));
    anneal_clear_error();
    CHECK_TRUE(((float *)anneal_data(dst->params->items[0].tensor))[0] == before);
    /* a tied model refuses an lm_head.weight that is not its embedding, accepts an equal one */
    c.tie_embeddings = true;
    anneal_model *tied = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(tied);
    REQUIRE(write_variant(&s, p, NULL, NULL, NULL, NULL));
    CHECK_TRUE(anneal_model_load_safetensors(tied, p) == ANNEAL_ERR_FORMAT &&
               contains(anneal_last_error(), "lm_head.weight differs"));
    anneal_clear_error();
    REQUIRE(write_variant(&s, p, "lm_head.weight", NULL, NULL, NULL));
    CHECK(anneal_model_load_safetensors(tied, p) == ANNEAL_OK, "%s", anneal_last_error());
    mem_sink t = {.n = 0};
    REQUIRE(anneal_model_hf_export(tied, &(anneal_tensor_sink){.ctx = &t, .put = mem_put}) == ANNEAL_OK);
    CHECK(t.n == s.n - 1 && strcmp(t.e[t.n - 1].name, "lm_head.weight"), "tied export writes no lm_head.weight");
    t.e[t.n] = t.e[0]; /* add lm_head.weight = the embedding: accepted */
    t.e[t.n].name = "lm_head.weight";
    REQUIRE(anneal_safetensors_write(p, t.n + 1, t.e, 0, NULL, NULL) == ANNEAL_OK);
    CHECK(anneal_model_load_safetensors(tied, p) == ANNEAL_OK, "%s", anneal_last_error());
    /* an untied model needs its lm_head.weight */
    REQUIRE(anneal_safetensors_write(p, t.n, t.e, 0, NULL, NULL) == ANNEAL_OK);
    CHECK_TRUE(anneal_model_load_safetensors(dst, p) != ANNEAL_OK && contains(anneal_last_error(), "lm_head.weight"));
    anneal_clear_error();
    mem_free(&t);
    mem_free(&s);
    anneal_model_free(tied);
    anneal_model_free(src);
    anneal_model_free(dst);
}

/* ------------------------------------------------------------ generation */

/* A model with non-trivial norms, GQA or MQA and rope scaling. */
static anneal_model *random_model(int n_kv_head, anneal_rope_scaling scaling, bool tie) {
    anneal_model_config c = tiny();
    c.n_kv_head = n_kv_head, c.tie_embeddings = tie, c.rope.scaling = scaling, c.n_ctx = 64;
    c.rope.factor = 4.0f, c.rope.low_freq_factor = 1.0f, c.rope.high_freq_factor = 4.0f, c.rope.original_max_pos = 32;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (!m || anneal_model_init(m, 3) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "%s", anneal_last_error());
        anneal_model_free(m);
        return NULL;
    }
    anneal_manual_seed(4);
    for (int i = 0; i < m->params->n; i++) {
        anneal_param *p = &m->params->items[i];
        if (strstr(p->name, "norm")) anneal_init_normal_(p->tensor, 1.0f, 0.3f);
        else anneal_init_normal_(p->tensor, 0.0f, 0.2f);
    }
    return m;
}

TEST(kv_cache_rows_equal_the_full_forward) {
    static const struct {
        int hkv;
        anneal_rope_scaling sc;
        bool tie;
    } cases[] = {{2, ANNEAL_ROPE_SCALING_NONE, false}, {1, ANNEAL_ROPE_SCALING_LLAMA3, true},
                 {4, ANNEAL_ROPE_SCALING_LINEAR, false}};
    enum { B = 2, T = 13 };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        anneal_model *m = random_model(cases[k].hkv, cases[k].sc, cases[k].tie);
        if (!m) continue;
        int64_t V = m->cfg.vocab_size;
        anneal_scope *sc = anneal_scope_open();
        int32_t idv[B * T];
        for (int i = 0; i < B * T; i++) idv[i] = (int32_t)((i * 97 + 13) % V);
        anneal_tensor *ids = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, idv);
        anneal_no_grad_begin();
        anneal_tensor *full = anneal_contiguous(anneal_model_logits(m, ids));
        anneal_no_grad_end();
        REQUIRE(full);
        anneal_kv_cache *kv = anneal_model_kv_cache_new(m, B, T);
        REQUIRE(kv);
        /* a prefill of 5, then 1, then 7 positions */
        int64_t pieces[3] = {5, 1, 7}, at = 0;
        double worst = 0;
        for (int p = 0; p < 3; p++) {
            anneal_tensor *part = anneal_contiguous(anneal_narrow(ids, 1, at, pieces[p]));
            anneal_tensor *got = anneal_contiguous(anneal_model_forward_cached(m, kv, part));
            REQUIRE(got && got->shape[1] == pieces[p]);
            for (int b = 0; b < B; b++) {
                const float *g = (const float *)anneal_data(got) + (int64_t)b * pieces[p] * V;
                const float *w = (const float *)anneal_data(full) + ((int64_t)b * T + at) * V;
                double e = llama_fx_rel_err(g, w, pieces[p] * V);
                if (!(e <= worst)) worst = e;
            }
            at += pieces[p];
        }
        CHECK_TRUE(anneal_kv_cache_len(kv) == T);
        /* the same kernels on the same rows: agreement to f32 rounding of the reordered sums */
        CHECK(worst <= 1e-5, "case %zu: cached logits differ from the full forward by %.3g of their scale", k, worst);
        anneal_kv_cache_free(kv);
        anneal_scope_close(sc);
        anneal_model_free(m);
    }
}

static bool count_token(int32_t id, void *user) {
    (void)id;
    ++*(int *)user;
    return true;
}

TEST(generation_runs_past_n_ctx) {
    anneal_model *m = random_model(2, ANNEAL_ROPE_SCALING_NONE, false);
    if (!m) return;
    int32_t prompt[3] = {1, 2, 3};
    anneal_sampler_config sc = {.temperature = 0.8f, .top_k = 20, .top_p = 0.9f, .seed = 3};
    int n = 0;
    /* 3 + 80 > n_ctx 64: the cache is rebuilt once on the way */
    CHECK(anneal_model_generate(m, prompt, 3, 80, &sc, -1, count_token, &n) == ANNEAL_OK, "%s", anneal_last_error());
    CHECK(n == 80, "generated %d", n);
    anneal_model_free(m);
}

/* ------------------------------------------------------------- recompute */

/* Loss and gradients of a fixed batch in recompute mode `mode` (malloc'd, params order). */
static float **grads_in_mode(anneal_recompute_mode mode, double *loss, int *n) {
    anneal_model_config c = tiny();
    c.recompute = mode, c.n_layer = 3, c.n_kv_head = 1;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (!m || anneal_model_init(m, 8) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "%s", anneal_last_error());
        anneal_model_free(m);
        return NULL;
    }
    anneal_model_set_training(m, true);
    enum { B = 2, T = 24 };
    anneal_scope *sc = anneal_scope_open();
    int32_t idv[B * T], tgv[B * T];
    for (int i = 0; i < B * T; i++) idv[i] = (i * 31 + 1) % 512, tgv[i] = (i * 17 + 5) % 512;
    tgv[3] = -100;
    anneal_tensor *l = anneal_model_loss(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, idv),
                                         anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, tgv));
    float **g = NULL;
    if (!l || anneal_backward(l) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "%s: %s", anneal_recompute_name(mode), anneal_last_error());
    } else {
        *loss = anneal_item(l);
        *n = m->params->n;
        g = calloc((size_t)*n, sizeof *g);
        for (int i = 0; i < *n; i++) {
            anneal_tensor *t = m->params->items[i].tensor->grad;
            size_t bytes = (size_t)anneal_numel(t) * sizeof(float);
            g[i] = malloc(bytes);
            memcpy(g[i], anneal_data(t), bytes);
        }
    }
    anneal_scope_close(sc);
    anneal_model_free(m);
    return g;
}

TEST(recompute_modes_give_identical_gradients) {
    double l0 = 0, l1 = 0, l2 = 0;
    int n0 = 0, n1 = 0, n2 = 0;
    float **g0 = grads_in_mode(ANNEAL_RECOMPUTE_NONE, &l0, &n0);
    float **g1 = grads_in_mode(ANNEAL_RECOMPUTE_ATTN, &l1, &n1);
    float **g2 = grads_in_mode(ANNEAL_RECOMPUTE_BLOCK, &l2, &n2);
    REQUIRE(g0 && g1 && g2 && n0 == n1 && n0 == n2);
    CHECK(l0 == l1 && l0 == l2, "losses %.9g %.9g %.9g", l0, l1, l2);
    anneal_model_config c = tiny();
    c.n_layer = 3, c.n_kv_head = 1;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(m);
    for (int i = 0; i < n0; i++) {
        size_t bytes = (size_t)anneal_numel(m->params->items[i].tensor) * sizeof(float);
        CHECK(!memcmp(g0[i], g1[i], bytes) && !memcmp(g0[i], g2[i], bytes), "gradient of %s differs",
              m->params->items[i].name);
        free(g0[i]), free(g1[i]), free(g2[i]);
    }
    free(g0), free(g1), free(g2);
    anneal_model_free(m);
}

/* ------------------------------------------------------------------ CLI */

static bool sh(const char *cmd) {
    int rc = system(cmd);
    if (rc != 0) anneal_test_fail(__FILE__, __LINE__, "command failed (%d): %s", rc, cmd);
    return rc == 0;
}

TEST(cli_trains_llama_tiny_and_generates) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP("ANNEAL_BIN is not set (run through ctest)");
    char cmd[4096];
    /* --synthetic: the loss must fall on the synthetic task */
    snprintf(cmd, sizeof cmd,
             "%s train --model llama-tiny --synthetic --steps 30 --batch 4 --seq 32 --lr 3e-3 --threads 2 "
             "--out %s/syn > %s/syn.log 2>&1 || (cat %s/syn.log; false)",
             bin, g_tmp, g_tmp, g_tmp);
    if (!sh(cmd)) return;
    char log[8192] = "";
    FILE *lf = fopen(tmp_path("syn.log"), "r");
    REQUIRE(lf);
    size_t ln = fread(log, 1, sizeof log - 1, lf);
    fclose(lf);
    log[ln] = '\0';
    const char *at = strstr(log, "train loss ");
    double last = NAN, first = NAN;
    CHECK(at && sscanf(at, "train loss %lf (first step of this run %lf)", &last, &first) == 2 && last < first - 0.2,
          "synthetic loss did not fall: %.4f -> %.4f\n%s", first, last, log);
    /* --data: a few documents prepared with GPT-2's tokenizer (the preset takes its vocabulary) */
    FILE *f = fopen(tmp_path("text.txt"), "w");
    REQUIRE(f);
    for (int i = 0; i < 200; i++)
        fprintf(f, "In the beginning %d was the word, and the word was with the llama number %d.\n", i, i * 7);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "%s prepare --tokenizer gpt2 --input %s/text.txt --out %s/data --val-fraction 0.1 --threads 1 "
             "> %s/prep.log 2>&1 || (cat %s/prep.log; false)",
             bin, g_tmp, g_tmp, g_tmp, g_tmp);
    if (!sh(cmd)) return;
    snprintf(cmd, sizeof cmd,
             "%s train --model llama-tiny --data %s/data --tokenizer gpt2 --steps 4 --batch 2 --seq 32 --threads 2 "
             "--dtype bf16 --recompute attn --out %s/real > %s/real.log 2>&1 || (cat %s/real.log; false)",
             bin, g_tmp, g_tmp, g_tmp, g_tmp);
    if (!sh(cmd)) return;
    snprintf(cmd, sizeof cmd,
             "%s generate --ckpt %s/real --tokenizer gpt2 --prompt 'In the beginning' --max-tokens 12 --threads 1 "
             "> %s/gen.txt 2> %s/gen.err || (cat %s/gen.err; false)",
             bin, g_tmp, g_tmp, g_tmp, g_tmp);
    if (!sh(cmd)) return;
    char out[4096] = "";
    f = fopen(tmp_path("gen.txt"), "r");
    REQUIRE(f);
    size_t n = fread(out, 1, sizeof out - 1, f);
    fclose(f);
    out[n] = '\0';
    CHECK(!strncmp(out, "In the beginning", 16) && n > 17, "generated: %s", out);
    snprintf(cmd, sizeof cmd,
             "%s eval --ckpt %s/real --data %s/data --batch 2 --seq 32 --threads 1 > %s/eval.txt 2>&1 || "
             "(cat %s/eval.txt; false)",
             bin, g_tmp, g_tmp, g_tmp, g_tmp);
    if (!sh(cmd)) return;
    /* the checkpoint's config.json says what it is */
    anneal_model_config c;
    char ck[256];
    snprintf(ck, sizeof ck, "%s/real/ckpt_00000004/config.json", g_tmp);
    CHECK(anneal_model_config_from_hf_file(ck, &c) == ANNEAL_OK && !strcmp(c.arch, "llama") && c.vocab_size == 50257,
          "%s", anneal_last_error());
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/anneal_llama_XXXXXX");
    if (!mkdtemp(g_tmp)) return 1;
    RUN(presets_are_listed_and_valid);
    RUN(config_round_trips_every_model_type);
    RUN(config_refusals_name_the_key);
    RUN(config_check_refuses_inconsistent_settings);
    RUN(import_refuses_bad_weights_and_leaves_the_model);
    RUN(kv_cache_rows_equal_the_full_forward);
    RUN(generation_runs_past_n_ctx);
    RUN(recompute_modes_give_identical_gradients);
    RUN(cli_trains_llama_tiny_and_generates);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_tmp);
    return anneal_test_summary();
}
