/* The model interface proved by a second architecture that only this file knows: a
 * toy language model (token embedding -> dense head with bias, logits of a token
 * depend on that token alone) with its own made-up Hugging Face model_type
 * "toy-bigram", registered at run time. It trains through anneal_train_run (--config
 * pointing at its config.json, synthetic tokens), checkpoints, resumes to the same
 * losses as a straight run, loads back through the registry, evaluates with
 * anneal_model_evaluate and generates with anneal_model_generate. Also the registry's
 * lookups and refusals and the shared evaluation's treatment of a partial batch. */
#include "anneal/anneal.h"
#include "io/checkpoint_internal.h"
#include "test.h"
#include "train/train_util.h"

#include <cjson/cJSON.h>
#include <math.h>

/* ----------------------------------------------------- the toy architecture */

typedef struct toy {
    anneal_model base;
    anneal_nn_embedding embed; /* toy.embed (vocab, hidden) */
    anneal_nn_dense head;      /* toy.head (vocab, hidden) + bias */
} toy;

static anneal_status toy_check(const anneal_model_config *c) {
    if (c->vocab_size <= 0 || c->n_embd <= 0 || c->n_ctx <= 0 || c->n_layer != 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "toy: vocab_size, hidden_size, n_ctx positive, no layers");
    return ANNEAL_OK;
}

static anneal_status toy_from_hf(const char *json, const char *source, anneal_model_config *out) {
    cJSON *j = cJSON_Parse(json);
    const cJSON *v = cJSON_GetObjectItem(j, "vocab_size"), *h = cJSON_GetObjectItem(j, "hidden_size"),
                *n = cJSON_GetObjectItem(j, "max_position_embeddings");
    bool ok = cJSON_IsNumber(v) && cJSON_IsNumber(h) && cJSON_IsNumber(n);
    if (ok) {
        memset(out, 0, sizeof *out);
        snprintf(out->arch, sizeof out->arch, "toy");
        out->vocab_size = v->valueint, out->n_embd = h->valueint, out->n_ctx = n->valueint;
    }
    cJSON_Delete(j);
    return ok ? toy_check(out) : anneal_set_error(ANNEAL_ERR_FORMAT, "%s: a toy config needs three sizes", source);
}

static char *toy_to_hf(const anneal_model_config *c) {
    char *s = NULL;
    if (asprintf(&s, "{\"model_type\": \"toy-bigram\", \"architectures\": [\"ToyBigram\"], \"vocab_size\": %d, "
                     "\"hidden_size\": %d, \"max_position_embeddings\": %d}\n",
                 c->vocab_size, c->n_embd, c->n_ctx) < 0)
        return NULL;
    return s;
}

static void toy_free(anneal_model *m) {
    if (m) anneal_params_free(m->params);
    free(m);
}

static anneal_status toy_init(anneal_model *m, uint64_t seed) {
    toy *t = (toy *)m;
    anneal_manual_seed(seed);
    anneal_status s = anneal_init_normal_(t->embed.weight, 0.0f, 0.5f);
    return s == ANNEAL_OK ? anneal_init_normal_(t->head.weight, 0.0f, 0.5f) : s;
}

static anneal_tensor *toy_logits(anneal_model *m, anneal_tensor *ids) {
    toy *t = (toy *)m;
    return anneal_nn_dense_forward(&t->head, &m->ctx, anneal_nn_embedding_forward(&t->embed, ids));
}

static anneal_tensor *toy_loss(anneal_model *m, anneal_tensor *ids, anneal_tensor *targets) {
    return anneal_cross_entropy(toy_logits(m, ids), targets, -100);
}

static anneal_kv_cache *toy_kv_new(anneal_model *m, int64_t batch, int64_t max_len) {
    return anneal_kv_cache_new(m->device, 0, batch, 1, 1, max_len, m); /* no attention: positions only */
}

static anneal_tensor *toy_cached(anneal_model *m, anneal_kv_cache *kv, anneal_tensor *ids, int64_t rows) {
    anneal_tensor *lg = toy_logits(m, ids);
    return lg && rows < lg->shape[1] ? anneal_narrow(lg, 1, lg->shape[1] - rows, rows) : lg;
}

static double toy_flops(const anneal_model *m, int64_t T) { return 6.0 * (double)anneal_model_num_params(m); }

static anneal_status toy_import(anneal_model *m, const anneal_tensor_source *src) {
    if (src->n != m->params->n) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %d tensors", src->what, src->n);
    for (int i = 0; i < m->params->n; i++) {
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *t = src->get(src->ctx, m->params->items[i].name);
        anneal_status r = t && anneal_same_shape(t, m->params->items[i].tensor)
                              ? anneal_copy_(m->params->items[i].tensor, t)
                              : anneal_set_error(ANNEAL_ERR_FORMAT, "%s: bad %s", src->what, m->params->items[i].name);
        anneal_scope_close(s);
        if (r != ANNEAL_OK) return r;
    }
    return ANNEAL_OK;
}

static anneal_status toy_export(const anneal_model *m, const anneal_tensor_sink *sink) {
    anneal_status r = ANNEAL_OK;
    for (int i = 0; i < m->params->n && r == ANNEAL_OK; i++)
        r = sink->put(sink->ctx, m->params->items[i].name, m->params->items[i].tensor);
    return r;
}

static const anneal_model_ops toy_ops = {toy_free,   toy_init,  toy_loss,   toy_logits, toy_kv_new,
                                         toy_cached, toy_flops, toy_import, toy_export, NULL, NULL, NULL};

static anneal_model *toy_create(const anneal_model_config *c, anneal_device dev) {
    toy *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->base = (anneal_model){.ops = &toy_ops, .cfg = *c, .device = dev, .params = anneal_params_new_on(dev)};
    if (!t->base.params || anneal_nn_embedding_create(&t->embed, t->base.params, "toy.embed", c->vocab_size, c->n_embd) ||
        anneal_nn_dense_create(&t->head, t->base.params, "toy.head", c->n_embd, c->vocab_size, ANNEAL_WEIGHT_OUT_IN,
                               true)) {
        toy_free(&t->base);
        return NULL;
    }
    return &t->base;
}

static const char *const toy_types[] = {"toy-bigram", NULL};
static const char *const toy_presets[] = {"toy-small", NULL};

static bool toy_preset(const char *name, anneal_model_config *out) {
    if (strcmp(name, "toy-small")) return false;
    memset(out, 0, sizeof *out);
    snprintf(out->arch, sizeof out->arch, "toy");
    out->vocab_size = 64, out->n_embd = 16, out->n_ctx = 32;
    return true;
}

static const anneal_model_arch toy_arch = {"toy",      toy_types,  "ToyBigram", toy_preset, toy_presets,
                                           toy_check,  toy_from_hf, toy_to_hf,  toy_create, NULL /* no GGUF */};

/* ------------------------------------------------------------------ tests */

static FILE *devnull;

TEST(registry_finds_refuses_and_names_the_known_types) {
    CHECK_TRUE(anneal_model_arch_find("gpt2") == &anneal_gpt2_arch);
    CHECK_TRUE(anneal_model_arch_for_hf("gpt2") == &anneal_gpt2_arch);
    CHECK_TRUE(anneal_model_arch_find("toy") == NULL && anneal_model_arch_for_hf("toy-bigram") == NULL);
    int n0 = 0;
    anneal_model_archs(&n0);
    REQUIRE(anneal_model_arch_register(&toy_arch) == ANNEAL_OK);
    int n1 = 0;
    const anneal_model_arch *const *all = anneal_model_archs(&n1);
    CHECK_TRUE(n1 == n0 + 1 && all[n1 - 1] == &toy_arch && all[0] == &anneal_gpt2_arch);
    CHECK_TRUE(anneal_model_arch_find("toy") == &toy_arch && anneal_model_arch_for_hf("toy-bigram") == &toy_arch);
    /* a second registration of the name, or of a model_type another reads, is refused */
    anneal_clear_error();
    CHECK_TRUE(anneal_model_arch_register(&toy_arch) == ANNEAL_ERR_ARG && strstr(anneal_last_error(), "toy"));
    anneal_model_arch thief = toy_arch;
    thief.name = "thief";
    thief.hf_model_types = (const char *const[]){"gpt2", NULL};
    anneal_clear_error();
    CHECK_TRUE(anneal_model_arch_register(&thief) == ANNEAL_ERR_ARG && strstr(anneal_last_error(), "gpt2"));
    anneal_clear_error();
    CHECK_TRUE(anneal_model_arch_register(NULL) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    /* presets of every architecture */
    anneal_model_config c;
    CHECK_TRUE(anneal_model_preset("toy-small", &c) && !strcmp(c.arch, "toy") && c.vocab_size == 64);
    CHECK_TRUE(anneal_model_preset("124M", &c) && !strcmp(c.arch, "gpt2") && c.n_layer == 12);
    CHECK_TRUE(!anneal_model_preset("nope", &c));
    char names[256];
    CHECK(strstr(anneal_model_preset_names(names, sizeof names), "tiny") && strstr(names, "toy-small"), "%s", names);
    /* configs dispatch on model_type (absent: gpt2); an unknown one names the file and the types */
    CHECK_TRUE(anneal_model_config_from_hf_json("{\"model_type\": \"toy-bigram\", \"vocab_size\": 10, \"hidden_size\": "
                                                "4, \"max_position_embeddings\": 8}", "a.json", &c) == ANNEAL_OK &&
               !strcmp(c.arch, "toy") && c.vocab_size == 10);
    CHECK_TRUE(anneal_model_config_from_hf_json("{\"n_layer\": 1, \"n_head\": 1, \"n_embd\": 4, \"vocab_size\": 10, "
                                                "\"n_positions\": 8}", "b.json", &c) == ANNEAL_OK &&
               !strcmp(c.arch, "gpt2"));
    anneal_clear_error();
    anneal_status s = anneal_model_config_from_hf_json("{\"model_type\": \"mystery\"}", "dir/config.json", &c);
    const char *e = anneal_last_error();
    CHECK(s == ANNEAL_ERR_UNSUPPORTED && strstr(e, "dir/config.json") && strstr(e, "mystery") && strstr(e, "gpt2") &&
              strstr(e, "toy-bigram"),
          "%s: %s", anneal_status_name(s), e);
    anneal_clear_error();
    c.arch[0] = 'x';
    CHECK_TRUE(anneal_model_new(&c, ANNEAL_CPU) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
}

/* A synthetic run of the toy model from its config.json. */
static void toy_run_config(anneal_train_config *c, const char *cfg, const char *out, int steps) {
    anneal_train_config_init(c);
    char v[32];
    snprintf(v, sizeof v, "%d", steps);
    if (cfg) anneal_train_config_set(c, "config", cfg); /* NULL: the model from the checkpoint resumed */
    anneal_train_config_set(c, "synthetic", "on");
    anneal_train_config_set(c, "steps", v);
    anneal_train_config_set(c, "batch", "4");
    anneal_train_config_set(c, "seq", "16");
    anneal_train_config_set(c, "lr", "3e-2");
    anneal_train_config_set(c, "warmup", "2");
    anneal_train_config_set(c, "peak-gflops", "100");
    anneal_train_config_set(c, "eval-batches", "2");
    anneal_train_config_set(c, "eval-every", "4");
    anneal_train_config_set(c, "ckpt-every", "4");
    anneal_train_config_set(c, "out", out);
}

static const char *path_in(const char *dir, const char *name) {
    static char bufs[4][1200];
    static int k;
    char *b = bufs[k++ & 3];
    int n = snprintf(b, sizeof bufs[0], "%s/%s", dir, name);
    if (n < 0 || n >= (int)sizeof bufs[0]) b[0] = '\0';
    return b;
}

typedef struct synth {
    int64_t batch, seq;
    uint64_t seed;
} synth;

/* Batch i of fixed pseudo-random tokens (the last batch has 3 real rows of 4). */
static anneal_status synth_batch(void *user, int64_t i, int32_t *ids, int32_t *tg, int64_t *rows) {
    synth *s = user;
    uint64_t x = s->seed + (uint64_t)i * 7919;
    for (int64_t j = 0; j < s->batch * s->seq; j++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[j] = (int32_t)((x >> 33) % 64);
        tg[j] = (int32_t)((x >> 17) % 64);
    }
    if (i == 2) *rows = 3;
    return ANNEAL_OK;
}

static bool collect(int32_t id, void *user) {
    int32_t *out = user;
    out[out[0] + 1] = id;
    out[0]++;
    return true;
}

TEST(a_second_architecture_trains_resumes_evaluates_and_generates) {
    /* registered by the test before: its failure is this one's too */
    REQUIRE(anneal_model_arch_find("toy"));
    const char *dir = tu_mkdtemp("toy_arch");
    REQUIRE(dir);
    const char *cfg = path_in(dir, "config.json");
    FILE *f = fopen(cfg, "w");
    REQUIRE(f);
    fputs("{\"model_type\": \"toy-bigram\", \"vocab_size\": 64, \"hidden_size\": 16, \"max_position_embeddings\": 32}",
          f);
    fclose(f);
    /* a straight run of 8 steps, and one stopped at 4 and resumed */
    char straight[1200], split[1200];
    snprintf(straight, sizeof straight, "%s", path_in(dir, "straight"));
    snprintf(split, sizeof split, "%s", path_in(dir, "split"));
    anneal_train_config c;
    anneal_train_result r;
    toy_run_config(&c, cfg, straight, 8);
    anneal_status st = anneal_train_run(&c, devnull, &r);
    CHECK(st == ANNEAL_OK && r.steps_done == 8, "straight: %s", anneal_last_error());
    anneal_train_config_free(&c);
    toy_run_config(&c, cfg, split, 8);
    anneal_train_config_set(&c, "stop-at", "4");
    st = anneal_train_run(&c, devnull, &r);
    CHECK(st == ANNEAL_OK && r.interrupted && r.steps_done == 4, "split: %s", anneal_last_error());
    anneal_train_config_free(&c);
    /* the resume names no model: the toy comes from the checkpoint's config.json */
    toy_run_config(&c, NULL, split, 8);
    anneal_train_config_set(&c, "resume", NULL);
    st = anneal_train_run(&c, devnull, &r);
    CHECK(st == ANNEAL_OK && r.steps_done == 8 && !r.interrupted, "resume: %s", anneal_last_error());
    anneal_train_config_free(&c);
    double a[8], b[8];
    REQUIRE(tu_read_losses(path_in(straight, "log.jsonl"), a, NULL, 8) == 8);
    REQUIRE(tu_read_losses(path_in(split, "log.jsonl"), b, NULL, 8) == 8);
    for (int i = 0; i < 8; i++) CHECK(a[i] == b[i], "step %d: %.17g straight, %.17g resumed", i + 1, a[i], b[i]);
    CHECK(a[7] < a[0], "the loss did not fall: %g -> %g", a[0], a[7]);

    /* the checkpoint is the toy's own export + config.json, read back through the registry */
    char ck[1024];
    REQUIRE(anneal_checkpoint_resolve(straight, ck, sizeof ck) == ANNEAL_OK);
    char *txt = NULL;
    REQUIRE(anneal_ckpt_read_file(path_in(ck, "config.json"), 1 << 16, &txt, NULL) == ANNEAL_OK);
    CHECK(strstr(txt, "\"toy-bigram\"") != NULL, "%s", txt);
    free(txt);
    anneal_model_config mc;
    REQUIRE(anneal_checkpoint_read_config(ck, &mc, NULL) == ANNEAL_OK);
    CHECK_TRUE(!strcmp(mc.arch, "toy") && mc.vocab_size == 64 && mc.n_embd == 16);
    anneal_model *m = anneal_model_new(&mc, ANNEAL_CPU);
    REQUIRE(m && m->arch == &toy_arch);
    REQUIRE(anneal_checkpoint_load(ck, m, NULL, NULL) == ANNEAL_OK);

    /* evaluate: the mean of the per-batch means, the partial batch weighted by its 3 of 4
     * rows; what lies in the ignored rows does not matter */
    synth sy = {4, 8, 5};
    double loss = NAN;
    int64_t tokens = 0;
    REQUIRE(anneal_model_evaluate(m, 4, 8, 3, synth_batch, &sy, &loss, &tokens) == ANNEAL_OK);
    double sum = 0, w = 0;
    int32_t ids[32], tg[32];
    anneal_no_grad_begin();
    for (int64_t i = 0; i < 3; i++) {
        int64_t rows = 4;
        synth_batch(&sy, i, ids, tg, &rows);
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *l = anneal_model_loss(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){rows, 8}, ids),
                                             anneal_from_data(ANNEAL_I32, 2, (int64_t[]){rows, 8}, tg));
        sum += anneal_item(l) * (double)rows / 4.0, w += (double)rows / 4.0;
        anneal_scope_close(sc);
    }
    anneal_no_grad_end();
    CHECK(tokens == 2 * 32 + 24, "tokens %lld", (long long)tokens);
    CHECK(fabs(loss - sum / w) <= 1e-6 * fabs(loss), "evaluate %.9g, by hand %.9g", loss, sum / w);
    /* two full batches: exactly the plain mean of their losses */
    double loss2;
    REQUIRE(anneal_model_evaluate(m, 4, 8, 2, synth_batch, &sy, &loss2, NULL) == ANNEAL_OK);
    double l0, l1;
    for (int64_t i = 0; i < 2; i++) {
        int64_t rows = 4;
        synth_batch(&sy, i, ids, tg, &rows);
        anneal_scope *sc = anneal_scope_open();
        anneal_no_grad_begin();
        anneal_tensor *l = anneal_model_loss(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){4, 8}, ids),
                                             anneal_from_data(ANNEAL_I32, 2, (int64_t[]){4, 8}, tg));
        anneal_no_grad_end();
        *(i ? &l1 : &l0) = anneal_item(l);
        anneal_scope_close(sc);
    }
    CHECK(loss2 == (l0 + l1) / 2, "full batches: %.17g vs %.17g", loss2, (l0 + l1) / 2);

    /* greedy generation: each token is the argmax of the last token's logits */
    int32_t got[12] = {0}, prompt[2] = {5, 9};
    anneal_sampler_config sc = {.temperature = 0.0f, .top_p = 1.0f};
    REQUIRE(anneal_model_generate(m, prompt, 2, 10, &sc, -1, collect, got) == ANNEAL_OK);
    CHECK_TRUE(got[0] == 10);
    int32_t last = 9;
    float row[64];
    for (int i = 0; i < 10; i++) {
        anneal_scope *s2 = anneal_scope_open();
        anneal_no_grad_begin();
        anneal_tensor *lg = anneal_model_logits(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, 1}, &last));
        anneal_no_grad_end();
        REQUIRE(lg && anneal_to_f32_buffer(lg, row) == ANNEAL_OK);
        anneal_scope_close(s2);
        int32_t want = (int32_t)(anneal_sample_logits(row, 64, &sc, 0));
        CHECK(got[i + 1] == want, "token %d: %d, want %d", i, got[i + 1], want);
        last = want;
    }
    anneal_model_free(m);
    tu_rmrf(dir);
}

int main(void) {
    devnull = fopen("/dev/null", "w");
    RUN(registry_finds_refuses_and_names_the_known_types);
    RUN(a_second_architecture_trains_resumes_evaluates_and_generates);
    fclose(devnull);
    return anneal_test_summary();
}
