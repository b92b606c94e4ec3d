/* Hugging Face GPT-2 import: config.json parsing (types, values, defaults, n_ctx /
 * n_positions, unsupported architectures) and the writer's round trip; weights as
 * transformers writes them (fixture hf_gpt2_tiny/, made by transformers itself in
 * tests/fixtures/gen_hf_gpt2.py: GPT2LMHeadModel.save_pretrained with "transformer." keys
 * and no lm_head.weight; GPT2Model.save_pretrained without the prefix; the state dict of
 * older versions with the tied lm_head.weight and the attn.bias / attn.masked_bias
 * buffers) load and give the logits transformers computed; malformed files (untied
 * head, unknown, missing or duplicated tensors, wrong shapes) are refused with the
 * tensor named and the model left untouched. */
#include <unistd.h>

#include "anneal/anneal.h"
#include "io/checkpoint_internal.h"
#include "test.h"

static char g_dir[64];

static const char *fixture(const char *name) {
    static char bufs[4][1024];
    static int next;
    char *b = bufs[next++ & 3];
    snprintf(b, sizeof bufs[0], "%s", anneal_test_path("tests/fixtures/hf_gpt2_tiny"));
    size_t n = strlen(b);
    snprintf(b + n, sizeof bufs[0] - n, "/%s", name);
    return b;
}

static const char *scratch(const char *name) {
    static char bufs[4][256];
    static int next;
    char *b = bufs[next++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", g_dir, name);
    return b;
}

static void write_text(const char *p, const char *txt) {
    FILE *f = fopen(p, "wb");
    if (f) {
        fputs(txt, f);
        fclose(f);
    }
}

static bool contains(const char *s, const char *sub) { return s && strstr(s, sub) != NULL; }

static anneal_model_config fixture_cfg(void) {
    return (anneal_model_config){.n_layer = 2, .n_head = 2, .n_embd = 32, .vocab_size = 100, .n_ctx = 16,
                                .dropout = 0.1f, .norm_eps = 1e-5f};
}

/* ------------------------------------------------------------------ config */

TEST(fixture_config_parses) {
    anneal_model_config c;
    memset(&c, 0x5a, sizeof c);
    REQUIRE(anneal_model_config_from_hf_file(fixture("config.json"), &c) == ANNEAL_OK);
    anneal_model_config w = fixture_cfg();
    CHECK(c.n_layer == w.n_layer && c.n_head == w.n_head && c.n_embd == w.n_embd && c.vocab_size == w.vocab_size &&
              c.n_ctx == w.n_ctx && c.dropout == w.dropout && c.norm_eps == w.norm_eps && !c.recompute,
          "got L%d H%d C%d V%d ctx%d drop %g eps %g", c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.n_ctx,
          (double)c.dropout, (double)c.norm_eps);
}

TEST(config_write_read_round_trip) {
    anneal_model_config w;
    memset(&w, 0, sizeof w); /* memcmp below: padding included */
    snprintf(w.arch, sizeof w.arch, "gpt2");
    w.n_layer = 12, w.n_head = 12, w.n_embd = 768, w.vocab_size = 50257, w.n_ctx = 1024;
    w.dropout = 0.05f, w.norm_eps = 1e-6f;
    const char *p = scratch("written.json");
    char *hf = anneal_model_config_to_hf_json(&w);
    REQUIRE(hf);
    write_text(p, hf);
    free(hf);
    anneal_model_config c;
    REQUIRE(anneal_model_config_from_hf_file(p, &c) == ANNEAL_OK);
    CHECK_TRUE(memcmp(&c, &w, offsetof(anneal_model_config, recompute)) == 0 && !c.recompute);
    char *txt = NULL;
    REQUIRE(anneal_ckpt_read_file(p, 1 << 16, &txt, NULL) == ANNEAL_OK);
    CHECK(contains(txt, "\"model_type\": \"gpt2\"") && contains(txt, "\"GPT2LMHeadModel\"") &&
              contains(txt, "\"n_positions\": 1024") && contains(txt, "\"n_ctx\": 1024") &&
              contains(txt, "\"resid_pdrop\": 0.05,") && contains(txt, "\"layer_norm_epsilon\": 1e-06") &&
              contains(txt, "\"activation_function\": \"gelu_new\"") && contains(txt, "\"tie_word_embeddings\": true"),
          "%s", txt);
    free(txt);
    w.n_head = 7; /* 768 % 7 != 0: the writer checks the config */
    CHECK_TRUE(anneal_model_config_to_hf_json(&w) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
}

TEST(config_validation) {
    static const char *base = "\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 100";
    static const struct {
        const char *extra; /* appended after base; NULL: the whole text is `text` */
        const char *text;
        anneal_status want;
        const char *msg;
        int n_ctx; /* expected when want == OK */
    } cases[] = {
        {", \"n_positions\": 16", NULL, ANNEAL_OK, NULL, 16},
        {", \"n_ctx\": 24", NULL, ANNEAL_OK, NULL, 24},
        {", \"n_ctx\": 16, \"n_positions\": 16, \"activation_function\": \"gelu_pytorch_tanh\", \"n_inner\": 128",
         NULL, ANNEAL_OK, NULL, 16},
        {"", NULL, ANNEAL_ERR_FORMAT, "n_positions", 0},
        {", \"n_ctx\": 8, \"n_positions\": 16", NULL, ANNEAL_ERR_UNSUPPORTED, "n_ctx 8 differs", 0},
        {", \"n_positions\": \"16\"", NULL, ANNEAL_ERR_FORMAT, "\"n_positions\" must be a positive integer", 0},
        {", \"n_positions\": 16.5", NULL, ANNEAL_ERR_FORMAT, "\"n_positions\"", 0},
        {", \"n_positions\": 0", NULL, ANNEAL_ERR_FORMAT, "\"n_positions\"", 0},
        {", \"n_positions\": 16, \"activation_function\": \"relu\"", NULL, ANNEAL_ERR_UNSUPPORTED, "\"relu\"", 0},
        {", \"n_positions\": 16, \"activation_function\": 3", NULL, ANNEAL_ERR_FORMAT, "activation_function", 0},
        {", \"n_positions\": 16, \"model_type\": \"gemma\"", NULL, ANNEAL_ERR_UNSUPPORTED, "gemma", 0},
        {", \"n_positions\": 16, \"tie_word_embeddings\": false", NULL, ANNEAL_ERR_UNSUPPORTED, "tie_word_embeddings", 0},
        {", \"n_positions\": 16, \"scale_attn_by_inverse_layer_idx\": true", NULL, ANNEAL_ERR_UNSUPPORTED,
         "scale_attn_by_inverse_layer_idx", 0},
        {", \"n_positions\": 16, \"n_inner\": 64", NULL, ANNEAL_ERR_UNSUPPORTED, "n_inner", 0},
        {", \"n_positions\": 16, \"layer_norm_epsilon\": \"x\"", NULL, ANNEAL_ERR_FORMAT, "layer_norm_epsilon", 0},
        {", \"n_positions\": 16, \"resid_pdrop\": 1.5", NULL, ANNEAL_ERR_FORMAT, "resid_pdrop", 0},
        {", \"n_positions\": 16, \"embd_pdrop\": 0.2", NULL, ANNEAL_ERR_UNSUPPORTED, "embd_pdrop", 0},
        {NULL, "{\"n_layer\": 2, \"n_head\": 4, \"n_embd\": 30, \"vocab_size\": 100, \"n_ctx\": 16}", ANNEAL_ERR_FORMAT,
         "not divisible", 0},
        {NULL, "{\"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 100, \"n_ctx\": 16}", ANNEAL_ERR_FORMAT,
         "missing \"n_layer\"", 0},
        {NULL, "{\"n_layer\": 2,", ANNEAL_ERR_FORMAT, "invalid JSON", 0},
        {NULL, "[1, 2]", ANNEAL_ERR_FORMAT, "not a JSON object", 0},
        {NULL, "{\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 100, \"n_ctx\": 16} x",
         ANNEAL_ERR_FORMAT, "after the JSON document", 0},
    };
    const char *p = scratch("cfg.json");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char txt[1024];
        if (cases[i].extra) snprintf(txt, sizeof txt, "{%s%s}", base, cases[i].extra);
        else snprintf(txt, sizeof txt, "%s", cases[i].text);
        write_text(p, txt);
        anneal_model_config c;
        memset(&c, 0, sizeof c);
        anneal_status s = anneal_model_config_from_hf_file(p, &c);
        if (cases[i].want == ANNEAL_OK) {
            CHECK(s == ANNEAL_OK && c.n_ctx == cases[i].n_ctx && c.n_embd == 32 && c.dropout == 0.1f &&
                      c.norm_eps == 1e-5f,
                  "case %zu: %s %s (n_ctx %d)", i, anneal_status_name(s), anneal_last_error(), c.n_ctx);
        } else {
            CHECK(s == cases[i].want && contains(anneal_last_error(), cases[i].msg) && contains(anneal_last_error(), p),
                  "case %zu (%s): %s: %s", i, txt, anneal_status_name(s), anneal_last_error());
        }
        anneal_clear_error();
    }
    anneal_model_config c;
    CHECK_TRUE(anneal_model_config_from_hf_file(scratch("absent.json"), &c) == ANNEAL_ERR_IO);
    anneal_clear_error();
}

/* ----------------------------------------------------------------- weights */

/* Logits of the fixture's input_ids compared with PyTorch's. */
static void check_logits(anneal_gpt2 *m, const char *what) {
    anneal_safetensors *ref = NULL;
    REQUIRE(anneal_safetensors_open(fixture("reference.safetensors"), &ref) == ANNEAL_OK);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *ids = anneal_safetensors_load(ref, "input_ids", ANNEAL_I32);
    anneal_tensor *want = anneal_safetensors_load(ref, "logits", ANNEAL_F32);
    anneal_no_grad_begin();
    anneal_tensor *got = ids ? anneal_gpt2_forward(m, ids) : NULL;
    anneal_no_grad_end();
    bool ok = got && want && anneal_same_shape(got, want) && anneal_is_contiguous(got);
    CHECK(ok, "%s: forward failed or wrong shape: %s", what, anneal_last_error());
    if (ok) {
        const float *g = anneal_data(got), *w = anneal_data(want);
        CHECK_ALLCLOSE(g, w, anneal_numel(want), 1e-5, 1e-5);
    }
    anneal_scope_close(sc);
    anneal_safetensors_close(ref);
}

static bool params_equal(const anneal_gpt2 *a, const anneal_gpt2 *b) {
    for (int i = 0; i < a->base.params->n; i++) {
        const anneal_tensor *x = a->base.params->items[i].tensor, *y = b->base.params->items[i].tensor;
        if (memcmp(anneal_data(x), anneal_data(y), (size_t)anneal_numel(x) * sizeof(float)) != 0) return false;
    }
    return true;
}

TEST(both_conventions_load_and_match_pytorch) {
    anneal_model_config cfg;
    REQUIRE(anneal_model_config_from_hf_file(fixture("config.json"), &cfg) == ANNEAL_OK);
    anneal_gpt2 *a = anneal_gpt2_new(&cfg), *b = anneal_gpt2_new(&cfg), *c = anneal_gpt2_new(&cfg);
    REQUIRE(a && b && c);
    CHECK(anneal_model_load_safetensors(&a->base, fixture("model.safetensors")) == ANNEAL_OK, "%s", anneal_last_error());
    /* the read's temporaries went back to the system, not into the allocator's cache
     * (where they stayed resident beside the model) */
    CHECK(anneal_memory_stats_get(ANNEAL_CPU).cached_bytes == 0, "%lld bytes of the load's temporaries stayed cached",
          (long long)anneal_memory_stats_get(ANNEAL_CPU).cached_bytes);
    check_logits(a, "GPT2LMHeadModel.save_pretrained file");
    CHECK(anneal_model_load_safetensors(&b->base, fixture("model_noprefix.safetensors")) == ANNEAL_OK, "%s",
          anneal_last_error());
    check_logits(b, "GPT2Model.save_pretrained file");
    CHECK(anneal_model_load_safetensors(&c->base, fixture("model_legacy.safetensors")) == ANNEAL_OK, "%s",
          anneal_last_error());
    check_logits(c, "older transformers' state dict (lm_head.weight, mask buffers)");
    CHECK_TRUE(params_equal(a, b));
    CHECK_TRUE(params_equal(a, c));
    anneal_gpt2_free(a);
    anneal_gpt2_free(b);
    anneal_gpt2_free(c);
}

/* Writes a copy of the fixture's model_legacy.safetensors (it has lm_head.weight) with entry `drop` removed (may be
 * NULL), entry `extra` added (a copy of ln_f.bias, may be NULL) and element 0 of
 * `bump` incremented (may be NULL). */
static bool write_variant(const char *out, const char *drop, const char *extra, const char *bump) {
    anneal_safetensors *st = NULL;
    if (anneal_safetensors_open(fixture("model_legacy.safetensors"), &st) != ANNEAL_OK) return false;
    anneal_st_write_entry *e = calloc((size_t)st->n_entries + 1, sizeof *e);
    float *bumped = NULL;
    int n = 0;
    for (int i = 0; i < st->n_entries; i++) {
        const anneal_st_entry *s = &st->entries[i];
        if (drop && strcmp(s->name, drop) == 0) continue;
        e[n] = (anneal_st_write_entry){s->name, s->dtype, s->ndim, s->shape, anneal_safetensors_data(st, s)};
        if (bump && strcmp(s->name, bump) == 0) {
            size_t bytes = (size_t)(s->end - s->begin);
            bumped = malloc(bytes);
            memcpy(bumped, e[n].data, bytes);
            bumped[0] += 1.0f;
            e[n].data = bumped;
        }
        if (extra && strcmp(s->name, "transformer.ln_f.bias") == 0) {
            e[n + 1] = e[n];
            e[n + 1].name = extra;
            n++;
        }
        n++;
    }
    const char *k[] = {"format"}, *v[] = {"pt"};
    bool ok = anneal_safetensors_write(out, n, e, 1, k, v) == ANNEAL_OK;
    free(bumped);
    free(e);
    anneal_safetensors_close(st);
    return ok;
}

TEST(malformed_weight_files_are_refused) {
    anneal_model_config cfg = fixture_cfg();
    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    REQUIRE(m && anneal_gpt2_init(m, 5) == ANNEAL_OK);
    float wte0 = ((float *)anneal_data(m->wte.weight))[0];
    static const struct {
        const char *drop, *extra, *bump;
        anneal_status want;
        const char *msg1, *msg2;
    } cases[] = {
        {NULL, NULL, "lm_head.weight", ANNEAL_ERR_UNSUPPORTED, "lm_head.weight differs", "transformer.wte.weight"},
        {"transformer.h.1.ln_2.bias", NULL, NULL, ANNEAL_ERR_FORMAT, "missing 1 tensor", "transformer.h.1.ln_2.bias"},
        {NULL, "transformer.h.0.mlp.c_extra.weight", NULL, ANNEAL_ERR_FORMAT, "transformer.h.0.mlp.c_extra.weight",
         "does not have"},
        {NULL, "lm_head.bias", NULL, ANNEAL_ERR_FORMAT, "lm_head.bias", "does not have"},
        {NULL, "ln_f.bias", NULL, ANNEAL_ERR_FORMAT, "both transformer.ln_f.bias and ln_f.bias", "ln_f.bias"},
    };
    const char *p = scratch("variant.safetensors");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        REQUIRE(write_variant(p, cases[i].drop, cases[i].extra, cases[i].bump));
        anneal_status s = anneal_model_load_safetensors(&m->base, p);
        CHECK(s == cases[i].want && contains(anneal_last_error(), cases[i].msg1) &&
                  contains(anneal_last_error(), cases[i].msg2) && contains(anneal_last_error(), p),
              "case %zu: %s: %s", i, anneal_status_name(s), anneal_last_error());
        anneal_clear_error();
        CHECK(((float *)anneal_data(m->wte.weight))[0] == wte0, "case %zu: model modified", i);
    }
    /* lm_head.weight absent (tied, as transformers saves it) is fine. */
    REQUIRE(write_variant(p, "lm_head.weight", NULL, NULL));
    CHECK(anneal_model_load_safetensors(&m->base, p) == ANNEAL_OK, "%s", anneal_last_error());
    check_logits(m, "without lm_head.weight");

    /* Models of another size: the mismatching tensors are named. */
    static const struct {
        int n_layer, vocab;
        const char *msg1, *msg2;
    } sizes[] = {
        {2, 120, "wte.weight has shape (100, 32)", "expects (120, 32)"},
        {3, 100, "missing", "transformer.h.2.ln_1.weight"},
        {1, 100, "12 tensor(s) that a GPT-2 with n_layer 1 does not have", "h.1.attn.c_attn.bias"},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        anneal_model_config c2 = fixture_cfg();
        c2.n_layer = sizes[i].n_layer;
        c2.vocab_size = sizes[i].vocab;
        anneal_gpt2 *o = anneal_gpt2_new(&c2);
        REQUIRE(o);
        anneal_status s = anneal_model_load_safetensors(&o->base, fixture("model_noprefix.safetensors"));
        CHECK(s != ANNEAL_OK && contains(anneal_last_error(), sizes[i].msg1) &&
                  contains(anneal_last_error(), sizes[i].msg2),
              "size case %zu: %s: %s", i, anneal_status_name(s), anneal_last_error());
        anneal_clear_error();
        anneal_gpt2_free(o);
    }
    CHECK_TRUE(anneal_model_load_safetensors(&m->base, scratch("absent.safetensors")) == ANNEAL_ERR_IO);
    anneal_clear_error();
    anneal_gpt2_free(m);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/anneal_hf_test_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    RUN(fixture_config_parses);
    RUN(config_write_read_round_trip);
    RUN(config_validation);
    RUN(both_conventions_load_and_match_pytorch);
    RUN(malformed_weight_files_are_refused);
    anneal_ckpt_remove_tree(g_dir);
    return anneal_test_summary();
}
