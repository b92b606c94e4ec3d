/* Hugging Face model directories both ways, proven by transformers itself (the .venv
 * clients; tests/fixtures/hf_dirs.py):
 * - transformers -> anneal: GPT-2 directories written by save_pretrained (one f32 file,
 *   f32 sharded with an index, bf16 sharded, f16), Llama (GQA, untied head, linear rope
 *   scaling; f32 and bf16 sharded) and Qwen2 (q/k/v biases, sharded) give transformers' logits on fixed
 *   tokens (<= 1e-4 relative) through anneal_model_load_hf, and `anneal eval --model DIR
 *   --json` gives transformers' mean loss over the same windows and the same count;
 * - anneal -> transformers: a checkpoint after a few training steps and `anneal export
 *   --format hf` (fp32, bf16 sharded, fp16) load in AutoModelForCausalLM.from_pretrained
 *   with no missing, unexpected or mismatched keys and give anneal's logits and loss;
 *   both carry the training run's tokenizer, which AutoTokenizer.from_pretrained loads
 *   and which encodes a text to anneal's ids. */
#include "anneal/anneal.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define T 16
#define N_IDS (4 * T + 1)
#define VOCAB 301

static char tmpdir[256];
static const char *py;
static int32_t ids[N_IDS];
static char out[1 << 16], err[1 << 16];

/* Runs a shell command, stdout into out, stderr into err; returns the exit code. */
static int sh(const char *cmd) {
    char full[8192], errpath[400];
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", tmpdir);
    snprintf(full, sizeof full, "%s 2>'%s'", cmd, errpath);
    FILE *f = popen(full, "r");
    if (!f) return -1;
    size_t got = fread(out, 1, sizeof out - 1, f);
    out[got] = '\0';
    int st = pclose(f);
    FILE *e = fopen(errpath, "rb");
    size_t ge = e ? fread(err, 1, sizeof err - 1, e) : 0;
    err[ge] = '\0';
    if (e) fclose(e);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* "$ANNEAL_BIN args". */
static int anneal_cli(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s", getenv("ANNEAL_BIN"), args);
    return sh(cmd);
}

/* A val shard of ids in tmpdir/<name>, marked as made by the tokenizer fp. */
static bool write_shard(const char *name, uint64_t fp) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/%s/val_000000.bin", tmpdir, name);
    anneal_shard_writer *w = NULL;
    if (anneal_shard_writer_open(p, VOCAB, -1, fp, &w) != ANNEAL_OK) return false;
    if (anneal_shard_writer_append(w, ids, N_IDS) != ANNEAL_OK) return false;
    if (anneal_shard_writer_finish(w) != ANNEAL_OK) return false;
    /* the manifest anneal prepare writes last (eval refuses a directory without one) */
    snprintf(p, sizeof p, "%s/%s/prepare.json", tmpdir, name);
    FILE *mf = fopen(p, "w");
    if (!mf) return false;
    fputs("{\"format\": \"anneal-prepare\", \"version\": 1}\n", mf);
    return fclose(mf) == 0;
}

/* The ids of the windows and a val shard of them under tmpdir/data. */
static bool setup(void) {
    if (tmpdir[0]) return true;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_hf_dirs_XXXXXX");
    if (!mkdtemp(tmpdir)) return false;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < N_IDS; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % VOCAB);
    }
    char p[512];
    snprintf(p, sizeof p, "%s/ids.bin", tmpdir);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(ids, sizeof ids[0], N_IDS, f) != N_IDS) return false;
    fclose(f);
    return write_shard("data", 0);
}

/* What transformers says about a model directory. */
typedef struct hf_view {
    cJSON *json;
    float *logits; /* (1, T, V) */
    int64_t n;
} hf_view;

static void hf_view_free(hf_view *v) {
    cJSON_Delete(v->json);
    free(v->logits);
}

/* Reads what hf_dirs.py check wrote for tag into v. */
static bool read_view(const char *tag, hf_view *v) {
    memset(v, 0, sizeof *v);
    char p[512];
    snprintf(p, sizeof p, "%s/%s.json", tmpdir, tag);
    FILE *f = fopen(p, "rb");
    if (!f) return false;
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    fclose(f);
    v->json = cJSON_Parse(out);
    snprintf(p, sizeof p, "%s/%s.safetensors", tmpdir, tag);
    anneal_safetensors *st = NULL;
    if (!v->json || anneal_safetensors_open(p, &st) != ANNEAL_OK) return false;
    const anneal_st_entry *e = anneal_safetensors_find(st, "logits");
    bool ok = e && e->dtype == ANNEAL_F32 && e->ndim == 3 && e->shape[1] == T;
    if (ok) {
        v->n = e->shape[0] * e->shape[1] * e->shape[2];
        v->logits = malloc((size_t)v->n * sizeof(float));
        memcpy(v->logits, anneal_safetensors_data(st, e), (size_t)v->n * sizeof(float));
    }
    anneal_safetensors_close(st);
    return ok;
}

/* hf_dirs.py check on n directories in one Python process: loading info, loss and
 * first-window logits of each into v[i]. */
static bool py_check_many(int n, const char *const *dirs, const char *const *tags, hf_view *v) {
    char cmd[8192];
    int o = snprintf(cmd, sizeof cmd, "TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 '%s' '%s/tests/fixtures/hf_dirs.py' check '%s/ids.bin' %d",
                     py, getenv("ANNEAL_SOURCE_DIR") ? getenv("ANNEAL_SOURCE_DIR") : ".", tmpdir, T);
    for (int i = 0; i < n; i++) o += snprintf(cmd + o, sizeof cmd - (size_t)o, " '%s' '%s/%s'", dirs[i], tmpdir, tags[i]);
    if (sh(cmd) != 0) {
        fprintf(stderr, "hf_dirs.py check failed:\n%s\n", err);
        return false;
    }
    bool ok = true;
    for (int i = 0; i < n; i++) ok = read_view(tags[i], &v[i]) && ok;
    return ok;
}

/* The text hf_dirs.py encodes with AutoTokenizer (its TEXT). */
static const char TEXT[] = "Hello world! In the beginning God created the heaven and the earth.\n  1234 caf\xc3\xa9";

/* AutoTokenizer.from_pretrained(dir) loaded and gave anneal's ids for TEXT. */
static void check_tokenizer(const char *dir, const hf_view *v) {
    const cJSON *hf = cJSON_GetObjectItemCaseSensitive(v->json, "text_ids");
    CHECK(cJSON_IsArray(hf), "%s: transformers found no tokenizer", dir);
    anneal_tokenizer *tok = NULL;
    CHECK(anneal_tokenizer_load(dir, &tok) == ANNEAL_OK, "%s: %s", dir, anneal_last_error());
    if (!tok || !cJSON_IsArray(hf)) {
        anneal_tokenizer_free(tok);
        return;
    }
    anneal_ids ids2 = {0};
    REQUIRE(anneal_tokenizer_encode(tok, TEXT, strlen(TEXT), false, &ids2) == ANNEAL_OK);
    CHECK((int)ids2.n == cJSON_GetArraySize(hf), "%s: %zu ids vs AutoTokenizer's %d", dir, ids2.n, cJSON_GetArraySize(hf));
    int i = 0;
    for (const cJSON *x = hf->child; x && i < (int)ids2.n; x = x->next, i++)
        CHECK(x->valueint == ids2.ids[i], "%s: id %d: anneal %d, AutoTokenizer %d", dir, i, ids2.ids[i], x->valueint);
    anneal_ids_free(&ids2);
    anneal_tokenizer_free(tok);
}

/* No missing, unexpected or mismatched keys, no error messages; loaded as class cls. */
static void check_clean_load(const hf_view *v, const char *what, const char *cls) {
    static const char *keys[] = {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"};
    for (int i = 0; i < 4; i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(v->json, keys[i]);
        CHECK(cJSON_IsArray(a) && cJSON_GetArraySize(a) == 0, "%s: transformers reports %s: %s", what, keys[i],
              a ? cJSON_PrintUnformatted(a) : "(absent)");
    }
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(v->json, "class");
    CHECK(cJSON_IsString(c) && !strcmp(c->valuestring, cls), "%s: loaded as %s", what,
          cJSON_IsString(c) ? c->valuestring : "?");
}

/* anneal's logits of the first window's inputs equal transformers'. */
static void check_logits(anneal_model *m, const hf_view *v, const char *what) {
    anneal_scope *sc = anneal_scope_open();
    int64_t shape[2] = {1, T};
    anneal_tensor *x = anneal_from_data(ANNEAL_I32, 2, shape, ids);
    anneal_tensor *lg = anneal_model_logits(m, x);
    REQUIRE(lg);
    int64_t n = anneal_numel(lg);
    CHECK(n == v->n, "%s: %lld logits vs transformers' %lld", what, (long long)n, (long long)v->n);
    float *a = malloc((size_t)n * sizeof(float));
    REQUIRE(anneal_to_f32_buffer(lg, a) == ANNEAL_OK);
    if (n == v->n) CHECK_ALLCLOSE(a, v->logits, n, 1e-5, 1e-4);
    free(a);
    anneal_scope_close(sc);
}

/* `anneal eval --model DIR --json` against transformers' loss and count. */
static void check_eval_json(const char *model, const char *data, const hf_view *v, const char *what) {
    char args[2048];
    snprintf(args, sizeof args, "eval --model '%s' --data '%s/%s' --seq %d --batch 3 --json", model, tmpdir, data, T);
    int rc = anneal_cli(args);
    CHECK(rc == 0, "%s: anneal eval exited %d: %s", what, rc, err);
    cJSON *j = cJSON_Parse(out);
    REQUIRE(j);
    const cJSON *loss = cJSON_GetObjectItemCaseSensitive(j, "loss"), *tokens = cJSON_GetObjectItemCaseSensitive(j, "tokens");
    double want = cJSON_GetObjectItemCaseSensitive(v->json, "loss")->valuedouble;
    CHECK(cJSON_IsNumber(loss) && fabs(loss->valuedouble - want) <= 1e-5 * want, "%s: eval loss %.9g vs transformers %.9g",
          what, cJSON_IsNumber(loss) ? loss->valuedouble : NAN, want);
    CHECK(cJSON_IsNumber(tokens) && tokens->valuedouble == cJSON_GetObjectItemCaseSensitive(v->json, "tokens")->valuedouble,
          "%s: eval counted %s tokens", what, cJSON_PrintUnformatted(j));
    cJSON_Delete(j);
}

static bool make_hf_dirs(void) {
    static int made;
    if (made) return made > 0;
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "TRANSFORMERS_VERBOSITY=error '%s' '%s/tests/fixtures/hf_dirs.py' make '%s/hf'", py,
             getenv("ANNEAL_SOURCE_DIR") ? getenv("ANNEAL_SOURCE_DIR") : ".", tmpdir);
    made = sh(cmd) == 0 ? 1 : -1;
    if (made < 0) fprintf(stderr, "hf_dirs.py make failed:\n%s\n", err);
    return made > 0;
}

TEST(transformers_dirs_load_into_anneal) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    if (!(py = anneal_test_python("torch,transformers,safetensors,numpy")))
        SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    REQUIRE(setup());
    REQUIRE(make_hf_dirs());
    static const struct {
        const char *kind, *cls;
        bool sharded;
    } kinds[] = {
        {"f32", "GPT2LMHeadModel", false},         {"sharded", "GPT2LMHeadModel", true},
        {"bf16", "GPT2LMHeadModel", true},         {"f16", "GPT2LMHeadModel", false},
        {"llama_f32", "LlamaForCausalLM", false},  {"llama_bf16", "LlamaForCausalLM", true},
        {"qwen2", "Qwen2ForCausalLM", true},
    };
    enum { NK = sizeof kinds / sizeof kinds[0] };
    char dirs[NK][512];
    const char *dp[NK], *tags[NK];
    hf_view views[NK];
    for (size_t k = 0; k < NK; k++) {
        snprintf(dirs[k], sizeof dirs[k], "%s/hf/%s", tmpdir, kinds[k].kind);
        dp[k] = dirs[k];
        tags[k] = kinds[k].kind;
    }
    REQUIRE(py_check_many(NK, dp, tags, views));
    for (size_t k = 0; k < NK; k++) {
        const char *dir = dirs[k];
        if (kinds[k].sharded) {
            char idx[4200];
            snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
            CHECK(access(idx, F_OK) == 0, "%s: transformers wrote no index", dir);
        }
        hf_view v = views[k];
        check_clean_load(&v, dir, kinds[k].cls);
        anneal_model *m = NULL;
        CHECK(anneal_model_load_hf(dir, ANNEAL_CPU, &m) == ANNEAL_OK, "%s: %s", dir, anneal_last_error());
        if (m) check_logits(m, &v, dir);
        anneal_model_free(m);
        check_eval_json(dir, "data", &v, dir);
        hf_view_free(&v);
    }
}

/* The JSON object in file p (NULL if unreadable). */
static cJSON *read_json(const char *p) {
    FILE *f = fopen(p, "rb");
    if (!f) return NULL;
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    fclose(f);
    return cJSON_Parse(out);
}

TEST(export_shards_like_transformers) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    if (!(py = anneal_test_python("torch,transformers,safetensors,numpy")))
        SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    REQUIRE(setup());
    REQUIRE(make_hf_dirs());
    /* the same model, the same size: the same shard names, tensors per shard and total_size */
    static const struct {
        const char *hf, *flags, *out;
    } cases[] = {
        {"sharded", "--dtype fp32 --max-shard-size 40KB", "reshard_f32"},
        {"bf16", "--dtype bf16 --max-shard-size 30KB", "reshard_bf16"},
        {"llama_bf16", "--dtype bf16 --max-shard-size 40KB", "reshard_llama"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[2048], a[600], b[600];
        snprintf(args, sizeof args, "export --model '%s/hf/%s' %s --tokenizer none --out '%s/%s'", tmpdir, cases[i].hf,
                 cases[i].flags, tmpdir, cases[i].out);
        CHECK(anneal_cli(args) == 0, "%s: %s", args, err);
        snprintf(a, sizeof a, "%s/hf/%s/model.safetensors.index.json", tmpdir, cases[i].hf);
        snprintf(b, sizeof b, "%s/%s/model.safetensors.index.json", tmpdir, cases[i].out);
        cJSON *ja = read_json(a), *jb = read_json(b);
        CHECK(ja && jb, "%s / %s unreadable", a, b);
        if (ja && jb) {
            const cJSON *ma = cJSON_GetObjectItemCaseSensitive(ja, "weight_map"), *mb = cJSON_GetObjectItemCaseSensitive(jb, "weight_map");
            CHECK(cJSON_GetArraySize(ma) == cJSON_GetArraySize(mb), "%s: %d vs %d tensors", b, cJSON_GetArraySize(ma),
                  cJSON_GetArraySize(mb));
            for (const cJSON *x = ma ? ma->child : NULL; x; x = x->next) {
                const cJSON *y = cJSON_GetObjectItemCaseSensitive(mb, x->string);
                CHECK(cJSON_IsString(y) && !strcmp(x->valuestring, y->valuestring), "%s: %s in %s, transformers put it in %s", b,
                      x->string, cJSON_IsString(y) ? y->valuestring : "(absent)", x->valuestring);
            }
            const cJSON *ta = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(ja, "metadata"), "total_size");
            const cJSON *tb = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(jb, "metadata"), "total_size");
            CHECK(cJSON_IsNumber(ta) && cJSON_IsNumber(tb) && ta->valuedouble == tb->valuedouble, "%s: total_size differs", b);
        }
        cJSON_Delete(ja);
        cJSON_Delete(jb);
    }
}

TEST(anneal_checkpoints_and_exports_load_in_transformers) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    if (!(py = anneal_test_python("torch,transformers,safetensors,numpy")))
        SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    REQUIRE(setup());
    REQUIRE(make_hf_dirs());
    char args[2048], ck[512];
    /* text, a 300-id tokenizer trained on it (the model has 301 ids) and its shards */
    char p[600];
    snprintf(p, sizeof p, "%s/text.txt", tmpdir);
    FILE *f = fopen(p, "wb");
    REQUIRE(f);
    static const char *words[] = {"the", "LORD", "said", "unto", "Moses,", "and", "God", "created", "heaven", "earth.\n"};
    uint64_t x = 7;
    for (int i = 0; i < 6000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        fprintf(f, "%s ", words[x % 10]);
    }
    fclose(f);
    snprintf(args, sizeof args, "tokenizer train --vocab-size 300 --input '%s/text.txt' --out '%s/tok' --threads 1", tmpdir,
             tmpdir);
    REQUIRE(anneal_cli(args) == 0 || (fprintf(stderr, "%s\n", err), 0));
    snprintf(args, sizeof args, "prepare --tokenizer '%s/tok' --input '%s/text.txt' --out '%s/kdata' --val-fraction 0.1 --threads 1",
             tmpdir, tmpdir, tmpdir);
    REQUIRE(anneal_cli(args) == 0 || (fprintf(stderr, "%s\n", err), 0));
    /* a few steps from transformers' weights (odd sizes, non-zero biases), so every tensor moved */
    snprintf(args, sizeof args,
             "train --model '%s/hf/f32' --data '%s/kdata' --steps 3 --batch 2 --seq %d --lr 1e-2 --warmup 0 --seed 7 "
             "--eval-every 0 --out '%s/run'",
             tmpdir, tmpdir, T, tmpdir);
    int rc = anneal_cli(args);
    REQUIRE(rc == 0 || (fprintf(stderr, "%s\n", err), 0));
    snprintf(ck, sizeof ck, "%s/run/ckpt_00000003", tmpdir);
    anneal_model_config cfg;
    REQUIRE(anneal_checkpoint_read_config(ck, &cfg, NULL) == ANNEAL_OK);
    /* the eval windows again, as shards of the run's tokenizer (eval checks the fingerprint) */
    anneal_tokenizer *tok = NULL;
    snprintf(p, sizeof p, "%s/tok", tmpdir);
    REQUIRE(anneal_tokenizer_load(p, &tok) == ANNEAL_OK);
    REQUIRE(write_shard("data2", anneal_tokenizer_fingerprint(tok)));
    anneal_tokenizer_free(tok);
    anneal_model *trained = anneal_model_new(&cfg, ANNEAL_CPU);
    anneal_train_state st;
    REQUIRE(trained && anneal_checkpoint_load(ck, trained, NULL, &st) == ANNEAL_OK);

    struct {
        const char *name, *flags;
        bool sharded;
    } exports[] = {
        {"exp_fp32", "--dtype fp32", false},
        {"exp_bf16", "--dtype bf16 --max-shard-size 30KB", true},
        {"exp_fp16", "--dtype fp16 --max-shard-size 1GB", false},
    };
    char edirs[3][512];
    const char *dp[4] = {ck}, *tags[4] = {"ckpt"};
    hf_view views[4];
    for (int i = 0; i < 3; i++) {
        snprintf(edirs[i], sizeof edirs[i], "%s/%s", tmpdir, exports[i].name);
        snprintf(args, sizeof args, "export --ckpt '%s/run' --format hf --out '%s' %s", tmpdir, edirs[i], exports[i].flags);
        rc = anneal_cli(args);
        CHECK(rc == 0, "%s: exit %d: %s", args, rc, err);
        dp[i + 1] = edirs[i];
        tags[i + 1] = exports[i].name;
    }
    REQUIRE(py_check_many(4, dp, tags, views));
    hf_view v = views[0];
    check_clean_load(&v, "checkpoint", "GPT2LMHeadModel");
    check_tokenizer(ck, &v);
    check_logits(trained, &v, "checkpoint");
    check_eval_json(ck, "data2", &v, "checkpoint");
    hf_view_free(&v);

    for (int i = 0; i < 3; i++) {
        const char *dir = edirs[i];
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
        CHECK((access(p, F_OK) == 0) == exports[i].sharded, "%s: index present: %d", dir, access(p, F_OK) == 0);
        snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
        if (exports[i].sharded) CHECK(access(p, F_OK) != 0, "%s: 30KB shards should be more than two", dir);
        v = views[i + 1];
        check_clean_load(&v, dir, "GPT2LMHeadModel");
        check_tokenizer(dir, &v);
        /* the stored weights (rounded for bf16/fp16) read back by anneal give transformers' logits */
        anneal_model *m = NULL;
        CHECK(anneal_model_load_hf(dir, ANNEAL_CPU, &m) == ANNEAL_OK, "%s: %s", dir, anneal_last_error());
        if (m) check_logits(m, &v, dir);
        if (i == 0) check_logits(trained, &v, "fp32 export vs the trained model");
        anneal_model_free(m);
        check_eval_json(dir, "data2", &v, dir);
        hf_view_free(&v);
    }
    /* generate finds the tokenizer in the exported directory and in the checkpoint by itself */
    static char text_ck[sizeof out];
    snprintf(args, sizeof args, "generate --ckpt '%s/run' --prompt 'the LORD' --max-tokens 6 --temperature 0", tmpdir);
    CHECK(anneal_cli(args) == 0, "%s: %s", args, err);
    snprintf(text_ck, sizeof text_ck, "%s", out);
    snprintf(args, sizeof args, "generate --model '%s' --prompt 'the LORD' --max-tokens 6 --temperature 0", edirs[0]);
    CHECK(anneal_cli(args) == 0, "%s: %s", args, err);
    CHECK(!strcmp(out, text_ck) && strlen(out) > strlen("the LORD"), "export generates '%s', the checkpoint '%s'", out, text_ck);
    anneal_model_free(trained);
}

TEST(llama_checkpoint_and_bf16_shards_load_in_transformers) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    if (!(py = anneal_test_python("torch,transformers,safetensors,numpy")))
        SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    REQUIRE(setup());
    REQUIRE(make_hf_dirs());
    char args[2048], ck[512], dir[512];
    snprintf(args, sizeof args,
             "train --model '%s/hf/llama_f32' --synthetic --steps 2 --batch 2 --seq %d --lr 1e-2 --warmup 0 --seed 3 "
             "--out '%s/run_llama'",
             tmpdir, T, tmpdir);
    REQUIRE(anneal_cli(args) == 0 || (fprintf(stderr, "%s\n", err), 0));
    snprintf(ck, sizeof ck, "%s/run_llama/ckpt_00000002", tmpdir);
    anneal_model *trained = NULL;
    REQUIRE(anneal_model_load_hf(ck, ANNEAL_CPU, &trained) == ANNEAL_OK);
    snprintf(dir, sizeof dir, "%s/exp_llama_bf16", tmpdir);
    snprintf(args, sizeof args, "export --ckpt '%s/run_llama' --dtype bf16 --max-shard-size 30KB --out '%s'", tmpdir, dir);
    CHECK(anneal_cli(args) == 0, "%s: %s", args, err);
    char idx[600];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    CHECK(access(idx, F_OK) == 0, "%s: not sharded", dir);
    hf_view views[2];
    REQUIRE(py_check_many(2, (const char *[]){ck, dir}, (const char *[]){"llama_ckpt", "llama_exp"}, views));
    hf_view v = views[0];
    check_clean_load(&v, "llama checkpoint", "LlamaForCausalLM");
    check_logits(trained, &v, "llama checkpoint");
    hf_view_free(&v);
    v = views[1];
    check_clean_load(&v, dir, "LlamaForCausalLM");
    anneal_model *m = NULL;
    CHECK(anneal_model_load_hf(dir, ANNEAL_CPU, &m) == ANNEAL_OK, "%s: %s", dir, anneal_last_error());
    if (m) check_logits(m, &v, dir);
    anneal_model_free(m);
    hf_view_free(&v);
    anneal_model_free(trained);
}

int main(void) {
    RUN(transformers_dirs_load_into_anneal);
    RUN(export_shards_like_transformers);
    RUN(anneal_checkpoints_and_exports_load_in_transformers);
    RUN(llama_checkpoint_and_bf16_shards_load_in_transformers);
    int rc = anneal_test_summary();
    if (tmpdir[0]) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    }
    return rc;
}
