/* PEFT adapter directories (src/io/peft.c) and `anneal lora merge`, proven with peft
 * 0.10 itself (tests/fixtures/peft_gpt2.py in the .venv of scripts/pyenv.sh) on a
 * random GPT-2 that transformers saved:
 *   - an adapter PEFT made (random A and B) loads into anneal and gives PEFT's logits;
 *   - the adapter anneal saves loads with PeftModel.from_pretrained on the same base and
 *     gives anneal's logits; merge_and_unload() too;
 *   - `anneal lora merge` writes a model transformers loads with those logits;
 * all fp32 within 1e-4 of the largest logit; the same for a Llama (GQA, untied head) with
 * adapters on q/k/v/o and on all seven projections. And without Python: save/load round trip,
 * and the bad input (unknown peft_type, r that does not match the tensors, a missing
 * tensor, a target the model lacks, a tensor no layer owns, malformed JSON, a regex
 * target_modules, rslora). */
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "anneal/anneal.h"
#include "anneal/fs.h"
#include "test.h"

#define B_ 2
#define T_ 7

static char g_dir[64];

static const char *tmp_path(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

/* Runs the fixture script with args; true on exit 0. */
static bool py(const char *python, const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd %s && %s %s %s > %s/py.log 2>&1", g_dir, python,
             anneal_test_path("tests/fixtures/peft_gpt2.py"), args, g_dir);
    int rc = system(cmd);
    if (rc != 0) {
        snprintf(cmd, sizeof cmd, "tail -5 %s/py.log", g_dir);
        if (system(cmd) != 0) return false;
    }
    return rc == 0;
}

static void write_ids(void) {
    int32_t ids[B_ * T_];
    for (int i = 0; i < B_ * T_; i++) ids[i] = (int32_t)((i * 37 + 5) % 101);
    anneal_st_write_entry e = {"ids", ANNEAL_I32, 2, (int64_t[]){B_, T_}, ids};
    anneal_safetensors_write(tmp_path("ids.safetensors"), 1, &e, 0, NULL, NULL);
}

/* The model of an HF directory (config.json + model.safetensors). */
static anneal_model *load_hf(const char *dir) {
    char p[600];
    anneal_model_config cfg;
    snprintf(p, sizeof p, "%s/config.json", dir);
    if (anneal_model_config_from_hf_file(p, &cfg) != ANNEAL_OK) return NULL;
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    if (m && anneal_model_load_safetensors(m, p) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    return m;
}

/* anneal's logits of the ids (host copy, B_*T_*V floats). */
static float *logits_of(anneal_model *m, int64_t V) {
    anneal_scope *s = anneal_scope_open();
    int32_t ids[B_ * T_];
    for (int i = 0; i < B_ * T_; i++) ids[i] = (int32_t)((i * 37 + 5) % 101);
    anneal_tensor *t = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B_, T_}, ids);
    anneal_tensor *l = anneal_model_logits(m, t);
    float *h = malloc((size_t)(B_ * T_ * V) * sizeof *h);
    if (!l || !h || anneal_numel(l) != B_ * T_ * V || anneal_to_f32_buffer(l, h) != ANNEAL_OK) {
        free(h);
        h = NULL;
    }
    anneal_scope_close(s);
    return h;
}

/* Tensor `name` of a safetensors file as f32 (malloc'd), n elements expected. */
static float *read_tensor(const char *path, const char *name, int64_t n) {
    anneal_safetensors *st = NULL;
    if (anneal_safetensors_open(path, &st) != ANNEAL_OK) return NULL;
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *t = anneal_safetensors_load(st, name, ANNEAL_F32);
    float *h = t && anneal_numel(t) == n ? malloc((size_t)n * sizeof *h) : NULL;
    if (h && anneal_to_f32_buffer(t, h) != ANNEAL_OK) {
        free(h);
        h = NULL;
    }
    anneal_scope_close(s);
    anneal_safetensors_close(st);
    return h;
}

/* max |a - b| / max |b|. */
static double rel_diff(const float *a, const float *b, int64_t n) {
    double d = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return m > 0 ? d / m : d;
}

TEST(peft_adapter_loads_into_anneal) {
    const char *python = anneal_test_python("torch,transformers,peft");
    if (!python) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    REQUIRE(py(python, "base base") && py(python, "random_adapter base peft_ad c_attn,c_proj,c_fc"));
    REQUIRE(py(python, "logits base peft_ad ids.safetensors peft_logits.safetensors"));
    anneal_model *m = load_hf(tmp_path("base"));
    REQUIRE(m);
    anneal_status s = anneal_peft_load(tmp_path("peft_ad"), m->params, ANNEAL_F32);
    CHECK(s == ANNEAL_OK, "load: %s", anneal_last_error());
    CHECK_TRUE(anneal_lora_count(m->params) == 8 && m->params->lora.rank == 4 && m->params->lora.alpha == 8.0f);
    int64_t V = m->cfg.vocab_size, n = B_ * T_ * V;
    float *got = logits_of(m, V), *want = read_tensor(tmp_path("peft_logits.safetensors"), "logits", n);
    REQUIRE(got && want);
    double d = rel_diff(got, want, n);
    printf("    PEFT-made adapter: anneal vs PEFT logits, max diff / max |logit| = %.3g\n", d);
    CHECK(d <= 1e-4, "logits differ by %g relative", d);
    free(got);
    free(want);
    anneal_model_free(m);
}

TEST(anneal_adapter_loads_into_peft_and_merges) {
    const char *python = anneal_test_python("torch,transformers,peft");
    if (!python) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP("ANNEAL_BIN not set (run through ctest)");
    struct stat sb;
    if (stat(tmp_path("base/model.safetensors"), &sb) != 0) REQUIRE(py(python, "base base"));
    anneal_model *m = load_hf(tmp_path("base"));
    REQUIRE(m);
    anneal_manual_seed(3);
    const char *tg[] = {"c_attn", "c_fc", "c_proj"};
    anneal_lora_config c = {.rank = 4, .alpha = 8, .targets = tg, .n_targets = 3};
    REQUIRE(anneal_lora_apply(m->params, &c) == ANNEAL_OK);
    for (int i = 0; i < m->params->n_dense; i++)
        if (m->params->dense[i].lora) anneal_init_normal_(m->params->dense[i].lora->b, 0.0f, 0.1f); /* B != 0 */
    int64_t V = m->cfg.vocab_size, n = B_ * T_ * V;
    float *got = logits_of(m, V);
    REQUIRE(got);
    CHECK(anneal_peft_save(tmp_path("anneal_ad"), m->params, tmp_path("base")) == ANNEAL_OK, "save: %s",
          anneal_last_error());
    REQUIRE(py(python, "logits base anneal_ad ids.safetensors anneal_ad_logits.safetensors"));
    float *peft = read_tensor(tmp_path("anneal_ad_logits.safetensors"), "logits", n);
    float *merged = read_tensor(tmp_path("anneal_ad_logits.safetensors"), "merged", n);
    REQUIRE(peft && merged);
    double d1 = rel_diff(got, peft, n), d2 = rel_diff(got, merged, n);
    printf("    anneal-saved adapter in PEFT: %.3g, after merge_and_unload: %.3g (relative)\n", d1, d2);
    CHECK(d1 <= 1e-4 && d2 <= 1e-4, "PEFT logits differ by %g, merged by %g", d1, d2);
    /* anneal lora merge -> transformers */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s lora merge --base %s --adapter %s --out %s > %s/merge.log 2>&1", bin,
             tmp_path("base"), tmp_path("anneal_ad"), tmp_path("merged"), g_dir);
    CHECK(system(cmd) == 0, "anneal lora merge failed (%s/merge.log)", g_dir);
    REQUIRE(py(python, "hf_logits merged ids.safetensors merged_logits.safetensors"));
    float *hf = read_tensor(tmp_path("merged_logits.safetensors"), "logits", n);
    REQUIRE(hf);
    double d3 = rel_diff(hf, got, n), d4 = rel_diff(hf, merged, n);
    printf("    anneal lora merge in transformers: %.3g vs anneal, %.3g vs PEFT's merge (relative)\n", d3, d4);
    CHECK(d3 <= 1e-4 && d4 <= 1e-4, "merged model differs by %g / %g", d3, d4);
    /* and in anneal itself: merging in place keeps the logits and drops the adapters */
    REQUIRE(anneal_lora_merge(m->params) == ANNEAL_OK);
    CHECK_TRUE(anneal_lora_count(m->params) == 0 && anneal_params_find(m->params, "transformer.h.0.attn.c_attn.lora_A.weight") == NULL);
    float *again = logits_of(m, V);
    REQUIRE(again);
    CHECK(rel_diff(again, got, n) <= 1e-5, "in-place merge differs by %g", rel_diff(again, got, n));
    free(again);
    free(hf);
    free(got);
    free(peft);
    free(merged);
    anneal_model_free(m);
}

/* Llama (GQA 4/2, untied head): a PEFT adapter on q/k/v/o loads into anneal, and
 * anneal's adapter on every projection loads into PEFT and merges, as for GPT-2. */
TEST(llama_adapters_both_ways) {
    const char *python = anneal_test_python("torch,transformers,peft");
    if (!python) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP("ANNEAL_BIN not set (run through ctest)");
    REQUIRE(py(python, "llama llama") && py(python, "random_adapter llama llama_peft q_proj,k_proj,v_proj,o_proj"));
    REQUIRE(py(python, "logits llama llama_peft ids.safetensors llama_peft_logits.safetensors"));
    anneal_model *m = load_hf(tmp_path("llama"));
    REQUIRE(m);
    CHECK(anneal_peft_load(tmp_path("llama_peft"), m->params, ANNEAL_F32) == ANNEAL_OK, "load: %s", anneal_last_error());
    CHECK_TRUE(anneal_lora_count(m->params) == 8);
    int64_t V = m->cfg.vocab_size, n = B_ * T_ * V;
    float *got = logits_of(m, V), *want = read_tensor(tmp_path("llama_peft_logits.safetensors"), "logits", n);
    REQUIRE(got && want);
    double d = rel_diff(got, want, n);
    printf("    Llama, PEFT-made q/k/v/o adapter: anneal vs PEFT logits %.3g (relative)\n", d);
    CHECK(d <= 1e-4, "logits differ by %g relative", d);
    free(got);
    free(want);
    anneal_model_free(m);
    /* anneal's adapter on all seven projections */
    REQUIRE((m = load_hf(tmp_path("llama"))));
    anneal_manual_seed(4);
    const char *tg[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    anneal_lora_config c = {.rank = 4, .alpha = 8, .targets = tg, .n_targets = 7};
    REQUIRE(anneal_lora_apply(m->params, &c) == ANNEAL_OK);
    CHECK_TRUE(anneal_lora_count(m->params) == 14);
    for (int i = 0; i < m->params->n_dense; i++)
        if (m->params->dense[i].lora) anneal_init_normal_(m->params->dense[i].lora->b, 0.0f, 0.1f);
    got = logits_of(m, V);
    REQUIRE(got);
    REQUIRE(anneal_peft_save(tmp_path("llama_anneal"), m->params, tmp_path("llama")) == ANNEAL_OK);
    anneal_peft_config pc;
    REQUIRE(anneal_peft_read_config(tmp_path("llama_anneal"), &pc) == ANNEAL_OK);
    CHECK_TRUE(!pc.fan_in_fan_out && pc.n_targets == 7);
    anneal_peft_config_free(&pc);
    REQUIRE(py(python, "logits llama llama_anneal ids.safetensors llama_anneal_logits.safetensors"));
    float *peft = read_tensor(tmp_path("llama_anneal_logits.safetensors"), "logits", n);
    float *merged = read_tensor(tmp_path("llama_anneal_logits.safetensors"), "merged", n);
    REQUIRE(peft && merged);
    double d1 = rel_diff(got, peft, n), d2 = rel_diff(got, merged, n);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s lora merge --base %s --adapter %s --out %s > %s/merge.log 2>&1", bin,
             tmp_path("llama"), tmp_path("llama_anneal"), tmp_path("llama_merged"), g_dir);
    CHECK(system(cmd) == 0, "anneal lora merge failed (%s/merge.log)", g_dir);
    REQUIRE(py(python, "hf_logits llama_merged ids.safetensors llama_merged_logits.safetensors"));
    float *hf = read_tensor(tmp_path("llama_merged_logits.safetensors"), "logits", n);
    REQUIRE(hf);
    double d3 = rel_diff(hf, merged, n);
    printf("    Llama, anneal adapter on 7 projections: PEFT %.3g, merge_and_unload %.3g, anneal lora merge in "
           "transformers %.3g (relative)\n", d1, d2, d3);
    CHECK(d1 <= 1e-4 && d2 <= 1e-4 && d3 <= 1e-4, "differences %g %g %g", d1, d2, d3);
    /* the output head is not a target */
    anneal_model *m2 = load_hf(tmp_path("llama"));
    const char *head[] = {"lm_head"};
    anneal_lora_config hc = {.rank = 2, .alpha = 2, .targets = head, .n_targets = 1};
    anneal_clear_error();
    CHECK(anneal_lora_apply(m2->params, &hc) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "lm_head"), "%s",
          anneal_last_error());
    anneal_clear_error();
    anneal_model_free(m2);
    free(got);
    free(peft);
    free(merged);
    free(hf);
    anneal_model_free(m);
}

/* ------------------------------------------------------------ without Python */

static anneal_model *tiny(void) {
    anneal_model_config c = {.n_layer = 2, .n_head = 2, .n_embd = 8, .vocab_size = 11, .n_ctx = 8, .norm_eps = 1e-5f};
    snprintf(c.arch, sizeof c.arch, "gpt2");
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (m) anneal_model_init(m, 1);
    return m;
}

static void write_text(const char *path, const char *text) { anneal_write_file_atomic(path, text, strlen(text)); }

/* Loads dir into a fresh tiny model; the status, the message in msg. */
static anneal_status try_load(const char *dir, char *msg, size_t n) {
    anneal_model *m = tiny();
    anneal_clear_error();
    anneal_status s = anneal_peft_load(dir, m->params, ANNEAL_F32);
    snprintf(msg, n, "%s", anneal_last_error());
    anneal_clear_error();
    anneal_model_free(m);
    return s;
}

static const char *k_cfg_fmt = "{\"peft_type\": \"%s\", \"r\": %d, \"lora_alpha\": 16, \"lora_dropout\": 0.0, "
                               "\"target_modules\": %s, \"bias\": \"none\", \"fan_in_fan_out\": true%s}";

typedef struct bad_case {
    const char *name, *cfg, *want;
    anneal_status status;
} bad_case;

TEST(round_trip_and_bad_input) {
    anneal_model *m = tiny();
    REQUIRE(m);
    const char *tg[] = {"c_attn"};
    anneal_lora_config c = {.rank = 2, .alpha = 16, .targets = tg, .n_targets = 1};
    REQUIRE(anneal_lora_apply(m->params, &c) == ANNEAL_OK);
    anneal_init_normal_(m->params->dense[0].lora->b, 0.0f, 1.0f);
    const char *dir = tmp_path("good");
    REQUIRE(anneal_peft_save(dir, m->params, NULL) == ANNEAL_OK);
    /* round trip: a fresh model gets the same adapters */
    anneal_model *m2 = tiny();
    REQUIRE(anneal_peft_load(dir, m2->params, ANNEAL_BF16) == ANNEAL_OK);
    CHECK_TRUE(anneal_lora_count(m2->params) == 2 && m2->params->lora.rank == 2 && m2->params->lora.alpha == 16.0f);
    int64_t nb = anneal_numel(m->params->dense[0].lora->b); /* (3 * 8, 2) */
    REQUIRE(nb == 48 && anneal_numel(m2->params->dense[0].lora->b) == nb);
    float x[48], y[48];
    anneal_to_f32_buffer(m->params->dense[0].lora->b, x);
    anneal_to_f32_buffer(m2->params->dense[0].lora->b, y);
    CHECK_TRUE(memcmp(x, y, sizeof x) == 0);
    CHECK_TRUE(m2->params->dense[0].dense->weight->dtype == ANNEAL_BF16);
    /* loading into a model that has the same adapters works; other adapters are refused */
    CHECK_TRUE(anneal_peft_load(dir, m2->params, ANNEAL_F32) == ANNEAL_OK);
    anneal_model_free(m2);
    anneal_peft_config pc;
    REQUIRE(anneal_peft_read_config(dir, &pc) == ANNEAL_OK);
    CHECK_TRUE(pc.rank == 2 && pc.fan_in_fan_out && pc.n_targets == 1 && !strcmp(pc.targets[0], "c_attn"));
    anneal_peft_config_free(&pc);

    char msg[512], text[1024], bad[600];
    bad_case cases[6];
    snprintf(bad, sizeof bad, "%s", tmp_path("bad"));
    mkdir(bad, 0777);
    char cp[2048];
    snprintf(cp, sizeof cp, "cp %s/adapter_model.safetensors %s/", dir, bad);
    REQUIRE(system(cp) == 0);
    char c0[512], c1[512], c2[512], c3[512], c4[512], c5[512];
    snprintf(c0, sizeof c0, k_cfg_fmt, "PREFIX_TUNING", 2, "[\"c_attn\"]", "");
    snprintf(c1, sizeof c1, k_cfg_fmt, "LORA", 4, "[\"c_attn\"]", "");
    snprintf(c2, sizeof c2, k_cfg_fmt, "LORA", 2, "[\"c_attn\", \"c_fc\"]", "");
    snprintf(c3, sizeof c3, k_cfg_fmt, "LORA", 2, "[\"c_attn\", \"q_proj\"]", "");
    snprintf(c4, sizeof c4, k_cfg_fmt, "LORA", 2, "\".*c_attn\"", "");
    snprintf(c5, sizeof c5, k_cfg_fmt, "LORA", 2, "[\"c_attn\"]", ", \"use_rslora\": true");
    cases[0] = (bad_case){"unknown peft_type", c0, "PREFIX_TUNING", ANNEAL_ERR_UNSUPPORTED};
    cases[1] = (bad_case){"r 4 vs rank-2 tensors", c1, "lora_A.weight", ANNEAL_ERR_SHAPE};
    cases[2] = (bad_case){"missing tensor", c2, "c_fc.lora_A.weight is missing", ANNEAL_ERR_FORMAT};
    cases[3] = (bad_case){"target not in model", c3, "'q_proj'", ANNEAL_ERR_ARG};
    cases[4] = (bad_case){"regex targets", c4, "regular expression", ANNEAL_ERR_UNSUPPORTED};
    cases[5] = (bad_case){"rslora", c5, "use_rslora", ANNEAL_ERR_UNSUPPORTED};
    for (int i = 0; i < 6; i++) {
        snprintf(text, sizeof text, "%s/adapter_config.json", bad);
        write_text(text, cases[i].cfg);
        anneal_status s = try_load(bad, msg, sizeof msg);
        CHECK(s == cases[i].status && strstr(msg, cases[i].want), "%s: status %d, message: %s", cases[i].name, (int)s,
              msg);
    }
    /* malformed JSON, a missing config, a missing weights file */
    snprintf(text, sizeof text, "%s/adapter_config.json", bad);
    write_text(text, "{\"peft_type\": \"LORA\", \"r\": ");
    CHECK(try_load(bad, msg, sizeof msg) == ANNEAL_ERR_FORMAT && strstr(msg, "adapter_config.json"), "%s", msg);
    write_text(text, "{\"peft_type\": \"LORA\", \"r\": 2.5, \"lora_alpha\": 1, \"target_modules\": [\"c_attn\"]}");
    CHECK(try_load(bad, msg, sizeof msg) == ANNEAL_ERR_FORMAT && strstr(msg, "r must be"), "%s", msg);
    CHECK(try_load(tmp_path("nowhere"), msg, sizeof msg) == ANNEAL_ERR_IO && strstr(msg, "nowhere"), "%s", msg);
    write_text(text, c1);
    snprintf(text, sizeof text, "%s/adapter_model.safetensors", bad);
    unlink(text);
    CHECK(try_load(bad, msg, sizeof msg) != ANNEAL_OK && strstr(msg, "adapter_model.safetensors"), "%s", msg);
    /* a tensor no targeted layer owns */
    int64_t shp[2] = {2, 8};
    float z[16] = {0};
    anneal_st_write_entry e[5];
    anneal_safetensors *st = NULL;
    snprintf(cp, sizeof cp, "%s/adapter_model.safetensors", dir);
    REQUIRE(anneal_safetensors_open(cp, &st) == ANNEAL_OK && st->n_entries == 4);
    for (int i = 0; i < 4; i++)
        e[i] = (anneal_st_write_entry){st->entries[i].name, ANNEAL_F32, 2, st->entries[i].shape,
                                       anneal_safetensors_data(st, &st->entries[i])};
    e[4] = (anneal_st_write_entry){"base_model.model.transformer.h.0.mlp.c_fc.lora_A.weight", ANNEAL_F32, 2, shp, z};
    REQUIRE(anneal_safetensors_write(text, 5, e, 0, NULL, NULL) == ANNEAL_OK);
    anneal_safetensors_close(st);
    snprintf(text, sizeof text, "%s/adapter_config.json", bad);
    snprintf(c1, sizeof c1, k_cfg_fmt, "LORA", 2, "[\"c_attn\"]", "");
    write_text(text, c1);
    CHECK(try_load(bad, msg, sizeof msg) == ANNEAL_ERR_FORMAT && strstr(msg, "mlp.c_fc.lora_A.weight is not an adapter"),
          "%s", msg);
    anneal_model_free(m);
}

/* `anneal lora`: usage errors exit 2, a merge that cannot be done exits 1 naming why. */
TEST(lora_cli_errors) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP("ANNEAL_BIN not set (run through ctest)");
    char cmd[2048], log[600];
    snprintf(log, sizeof log, "%s/cli.log", g_dir);
    const char *args[] = {"lora", "lora split", "lora merge --base x --adapter y", "lora merge --base x --adapter y --out z --dtype fp8"};
    for (int i = 0; i < 4; i++) {
        snprintf(cmd, sizeof cmd, "%s %s > %s 2>&1", bin, args[i], log);
        int rc = system(cmd);
        CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "'anneal %s' exited %d", args[i], WEXITSTATUS(rc));
    }
    snprintf(cmd, sizeof cmd, "%s lora merge --base %s --adapter %s --out %s > %s 2>&1", bin, tmp_path("nowhere"),
             tmp_path("good"), tmp_path("m_out"), log);
    int rc = system(cmd);
    FILE *f = fopen(log, "r");
    char text[1024] = "";
    if (f) {
        size_t n = fread(text, 1, sizeof text - 1, f);
        text[n] = '\0';
        fclose(f);
    }
    CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 1 && strstr(text, "nowhere"), "exit %d: %s", WEXITSTATUS(rc), text);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/anneal_peft_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    write_ids();
    RUN(round_trip_and_bad_input);
    RUN(lora_cli_errors);
    RUN(peft_adapter_loads_into_anneal);
    RUN(anneal_adapter_loads_into_peft_and_merges);
    RUN(llama_adapters_both_ways);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) return 1;
    return anneal_test_summary();
}
