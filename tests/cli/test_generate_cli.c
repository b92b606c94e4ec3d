/* `anneal generate` and `anneal eval` end to end through the built binary (ANNEAL_BIN,
 * set by ctest): bad flags name the flag; text generated from a checkpoint made here
 * equals the same generation run in this process, decoded; seeds reproduce; a
 * checkpoint of another tokenizer is refused; eval's loss equals a window-by-window
 * loss computed here, and mismatching shards are refused. */
#include "anneal/anneal.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmpdir[256], errpath[300];

/* Runs "$ANNEAL_BIN args": stdout into out (*n bytes), stderr into err; returns the
 * exit code. */
static int run(const char *args, char *out, size_t cap, size_t *n, char *err, size_t errcap) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>'%s'", getenv("ANNEAL_BIN"), args, errpath);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t got = fread(out, 1, cap - 1, f);
    out[got] = '\0';
    if (n) *n = got;
    int st = pclose(f);
    FILE *e = fopen(errpath, "rb");
    size_t ge = e ? fread(err, 1, errcap - 1, e) : 0;
    err[ge] = '\0';
    if (e) fclose(e);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static char out[1 << 16], out2[1 << 16], err[1 << 14];

static bool make_tmpdir(void) {
    if (tmpdir[0]) return true;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_gen_cli_XXXXXX");
    if (!mkdtemp(tmpdir)) return false;
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", tmpdir);
    return true;
}

TEST(bad_flags_name_the_flag) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    REQUIRE(make_tmpdir());
    struct { const char *args, *expect; int rc; } cases[] = {
        {"generate --bogus 1", "--bogus", 2},
        {"generate --ckpt x --max-tokens abc", "--max-tokens", 2},
        {"generate --ckpt x --max-tokens -3", "--max-tokens", 2},
        {"generate --ckpt x --top-p 1.5", "--top-p", 2},
        {"generate --ckpt x --top-p 0", "--top-p", 2},
        {"generate --ckpt x --top-k -1", "--top-k", 2},
        {"generate --ckpt x --temperature -0.5", "--temperature", 2},
        {"generate --ckpt x --seed -1", "--seed", 2},
        {"generate --ckpt x --kv-dtype f16", "--kv-dtype", 2},
        {"generate --ckpt x --kv-dtype q4", "--kv-dtype", 2},
        {"generate --prompt hi", "--ckpt", 2},
        {"generate --ckpt x --hf-model y", "--hf-model", 2},
        {"generate --hf-model y.safetensors", "--hf-config", 2},
        {"generate --ckpt /nonexistent/anneal_run --tokenizer gpt2", "--ckpt", 1},
        {"generate --hf-model /nonexistent/m.safetensors --hf-config /nonexistent/config.json", "--hf-config", 1},
        {"eval --data x", "--ckpt", 2},
        {"eval --ckpt x", "--data", 2},
        {"eval --ckpt x --data y --batch 0", "--batch", 2},
        {"eval --ckpt x --data y --seq -4", "--seq", 2},
        {"eval --ckpt x --data y --split test", "--split", 2},
        {"eval --ckpt x --data y --max-batches -1", "--max-batches", 2},
        {"eval --ckpt /nonexistent/anneal_run --data y", "--ckpt", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = run(cases[i].args, out, sizeof out, NULL, err, sizeof err);
        CHECK(rc == cases[i].rc, "'%s': exit %d, want %d (%s)", cases[i].args, rc, cases[i].rc, err);
        CHECK(strstr(err, cases[i].expect) != NULL, "'%s': message does not name %s: %s", cases[i].args,
              cases[i].expect, err);
    }
    CHECK(run("generate --help", out, sizeof out, NULL, err, sizeof err) == 0 && strstr(out, "--top-p"), "help");
    CHECK(run("eval --help", out, sizeof out, NULL, err, sizeof err) == 0 && strstr(out, "--max-batches"), "help");
}

/* ------------------------------------------------ a checkpoint made here */

static anneal_tokenizer *tok;
static anneal_model *model;
static char run_dir[400], bad_run_dir[400];
static uint64_t fp;

static bool setup_done;
static char setup_err[1024];

static const char *setup_once(void);

/* A tiny random model with GPT-2's vocabulary, saved as a checkpoint whose state
 * records GPT-2's tokenizer fingerprint (and a second one recording another); made once.
 * NULL, or what failed: the tokenizer ships in data/gpt2 and the rest is the library's,
 * so the callers fail the test (TEST_FAIL), never skip it. */
static const char *setup(void) {
    if (!setup_done) {
        setup_done = true;
        const char *e = setup_once();
        if (e) snprintf(setup_err, sizeof setup_err, "setup: %s", e);
    }
    return setup_err[0] ? setup_err : NULL;
}

static const char *setup_once(void) {
    if (!make_tmpdir()) return "cannot make a temporary directory";
    if (anneal_tokenizer_load("gpt2", &tok) != ANNEAL_OK) return anneal_last_error();
    fp = anneal_tokenizer_fingerprint(tok);
    anneal_model_config c = {.arch = "gpt2", .n_layer = 2, .n_head = 2, .n_embd = 32,
                             .vocab_size = anneal_tokenizer_vocab_size(tok), .n_ctx = 64, .dropout = 0.0f,
                             .norm_eps = 1e-5f};
    model = anneal_model_new(&c, ANNEAL_CPU);
    if (!model || anneal_model_init(model, 5) != ANNEAL_OK) return anneal_last_error();
    /* a sharper output distribution than the init's near-uniform one */
    anneal_scope *sc = anneal_scope_open();
    anneal_init_normal_(anneal_params_find(model->params, "transformer.wte.weight")->tensor, 0.0f, 0.3f);
    anneal_scope_close(sc);
    anneal_train_state st = {.step = 3, .tokens = 100, .tokenizer_fingerprint = fp, .best_val_loss = NAN};
    snprintf(run_dir, sizeof run_dir, "%s/run", tmpdir);
    snprintf(bad_run_dir, sizeof bad_run_dir, "%s/run_other_tok", tmpdir);
    if (anneal_checkpoint_save(run_dir, model, NULL, &st, "{\"batch\": 4, \"seq\": 32}", 0) != ANNEAL_OK)
        return anneal_last_error();
    st.tokenizer_fingerprint = fp ^ 0x1234;
    if (anneal_checkpoint_save(bad_run_dir, model, NULL, &st, "{}", 0) != ANNEAL_OK) return anneal_last_error();
    return NULL;
}

typedef struct collected {
    anneal_ids ids;
} collected;

static bool collect(int32_t id, void *user) { return anneal_ids_push(&((collected *)user)->ids, id) == ANNEAL_OK; }

TEST(generate_streams_the_same_text_as_in_process_generation) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    const char *prompt = "The quick brown fox";
    char args[1024];
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --prompt '%s' --max-tokens 30 --seed 7 "
                                "--temperature 0.9 --top-k 40 --top-p 0.9 --threads 1", run_dir, prompt);
    size_t n = 0;
    int rc = run(args, out, sizeof out, &n, err, sizeof err);
    REQUIRE(rc == 0);
    CHECK(strstr(err, "tokens/s") != NULL, "no summary on stderr: %s", err);
    /* the same generation here */
    anneal_set_num_threads(1);
    anneal_ids p = {0};
    REQUIRE(anneal_tokenizer_encode(tok, prompt, strlen(prompt), false, &p) == ANNEAL_OK);
    anneal_sampler_config sc = {.temperature = 0.9f, .top_k = 40, .top_p = 0.9f, .seed = 7};
    collected got = {{0}};
    REQUIRE(anneal_model_generate(model, p.ids, (int64_t)p.n, 30, &sc, anneal_tokenizer_eot(tok), collect, &got) ==
            ANNEAL_OK);
    char *text = NULL;
    size_t len = 0;
    REQUIRE(anneal_tokenizer_decode(tok, got.ids.ids, got.ids.n, &text, &len) == ANNEAL_OK);
    size_t pl = strlen(prompt);
    CHECK(got.ids.n > 0, "nothing generated");
    CHECK(n == pl + len + 1, "output has %zu bytes, want %zu + %zu + newline", n, pl, len);
    CHECK(n >= pl && !memcmp(out, prompt, pl), "output does not start with the prompt: %s", out);
    CHECK(n == pl + len + 1 && !memcmp(out + pl, text, len) && out[n - 1] == '\n',
          "streamed text differs from the decoded in-process generation:\n%s\nvs\n%s", out + pl, text);
    free(text);
    anneal_ids_free(&got.ids);
    anneal_ids_free(&p);
}

TEST(generate_seed_reproduces_and_changes_the_text) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    char args[1024];
    size_t n1 = 0, n2 = 0;
    /* no --prompt: starts a new document; run directory resolved to its latest */
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --max-tokens 25 --seed 11 --threads 1", run_dir);
    REQUIRE(run(args, out, sizeof out, &n1, err, sizeof err) == 0);
    REQUIRE(run(args, out2, sizeof out2, &n2, err, sizeof err) == 0);
    CHECK(n1 == n2 && !memcmp(out, out2, n1), "same seed, different text:\n%s\nvs\n%s", out, out2);
    CHECK(n1 > 1, "no text");
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --max-tokens 25 --seed 12 --threads 1", run_dir);
    REQUIRE(run(args, out2, sizeof out2, &n2, err, sizeof err) == 0);
    CHECK(n1 != n2 || memcmp(out, out2, n1), "another seed gave the same text");
    /* the checkpoint's model.safetensors + config.json are Hugging Face files: same text */
    snprintf(args, sizeof args, "generate --hf-model '%s/ckpt_00000003/model.safetensors' --hf-config "
             "'%s/ckpt_00000003/config.json' --tokenizer gpt2 --max-tokens 25 --seed 11 --threads 1", run_dir, run_dir);
    int rc = run(args, out2, sizeof out2, &n2, err, sizeof err);
    CHECK(rc == 0 && n1 == n2 && !memcmp(out, out2, n1), "--hf-model: exit %d, text\n%s\nvs\n%s", rc, out2, out);
    /* greedy ignores the seed */
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --prompt hi --max-tokens 10 --temperature 0 --seed 1 --threads 1", run_dir);
    REQUIRE(run(args, out, sizeof out, &n1, err, sizeof err) == 0);
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --prompt hi --max-tokens 10 --temperature 0 --seed 2 --threads 1", run_dir);
    REQUIRE(run(args, out2, sizeof out2, &n2, err, sizeof err) == 0);
    CHECK(n1 == n2 && !memcmp(out, out2, n1), "greedy depends on the seed");
}

/* --kv-dtype bf16 / int8: the text of in-process generation with that cache dtype (the
 * same slots engine), and the summary names the dtype and the cache's size. */
TEST(generate_kv_dtype_matches_in_process_generation) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    const char *names[2] = {"bf16", "int8"};
    const anneal_dtype dts[2] = {ANNEAL_BF16, ANNEAL_I8};
    for (int i = 0; i < 2; i++) {
        char args[1024];
        snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --prompt 'Once upon' --max-tokens 20 "
                                    "--temperature 0 --kv-dtype %s --threads 1", run_dir, names[i]);
        size_t n = 0;
        REQUIRE(run(args, out, sizeof out, &n, err, sizeof err) == 0);
        char want[64];
        snprintf(want, sizeof want, "KV cache %s", anneal_dtype_name(dts[i]));
        CHECK(strstr(err, want) && strstr(err, "MiB"), "summary: %s", err);
        anneal_set_num_threads(1);
        anneal_ids p = {0};
        REQUIRE(anneal_tokenizer_encode(tok, "Once upon", 9, false, &p) == ANNEAL_OK);
        anneal_sampler_config sc = {.temperature = 0.0f};
        collected got = {{0}};
        REQUIRE(anneal_model_set_kv_dtype(model, dts[i]) == ANNEAL_OK);
        anneal_status gs = anneal_model_generate(model, p.ids, (int64_t)p.n, 20, &sc, anneal_tokenizer_eot(tok), collect,
                                                 &got);
        anneal_model_set_kv_dtype(model, ANNEAL_F32);
        REQUIRE(gs == ANNEAL_OK);
        char *text = NULL;
        size_t len = 0;
        REQUIRE(anneal_tokenizer_decode(tok, got.ids.ids, got.ids.n, &text, &len) == ANNEAL_OK);
        CHECK(n == 9 + len + 1 && !memcmp(out + 9, text, len), "%s: CLI text differs:\n%s\nvs\n%s", names[i], out,
              text);
        free(text);
        anneal_ids_free(&got.ids);
        anneal_ids_free(&p);
    }
}

/* --dtype bf16: the CLI packs the dense weights as bf16 panels (anneal_cli_pack_bf16) and
 * its text is that of in-process generation with the unpacked model at bf16 compute
 * (whose decode engine makes the same panels itself): sampled, so every logit counts. */
TEST(generate_bf16_packed_matches_the_unpacked_model) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    const char *prompt = "In the beginning";
    char args[1024];
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --prompt '%s' --max-tokens 30 --seed 3 "
                                "--temperature 0.9 --top-k 0 --top-p 1 --dtype bf16 --threads 1", run_dir, prompt);
    size_t n = 0;
    REQUIRE(run(args, out, sizeof out, &n, err, sizeof err) == 0);
    anneal_set_num_threads(1);
    anneal_ids p = {0};
    REQUIRE(anneal_tokenizer_encode(tok, prompt, strlen(prompt), false, &p) == ANNEAL_OK);
    anneal_sampler_config sc = {.temperature = 0.9f, .top_k = 0, .top_p = 1.0f, .seed = 3};
    collected got = {{0}};
    REQUIRE(anneal_model_set_compute(model, ANNEAL_BF16) == ANNEAL_OK);
    anneal_status gs = anneal_model_generate(model, p.ids, (int64_t)p.n, 30, &sc, anneal_tokenizer_eot(tok), collect, &got);
    anneal_model_set_compute(model, ANNEAL_F32);
    REQUIRE(gs == ANNEAL_OK);
    CHECK(!model->params->packed_bf16, "the in-process model was packed");
    char *text = NULL;
    size_t len = 0;
    REQUIRE(anneal_tokenizer_decode(tok, got.ids.ids, got.ids.n, &text, &len) == ANNEAL_OK);
    const size_t pl = strlen(prompt);
    CHECK(got.ids.n > 0 && n == pl + len + 1 && !memcmp(out + pl, text, len),
          "bf16 CLI text differs from the unpacked model's:\n%s\nvs\n%s", out + (n >= pl ? pl : 0), text);
    free(text);
    anneal_ids_free(&got.ids);
    anneal_ids_free(&p);
}

TEST(generate_refuses_a_checkpoint_of_another_tokenizer) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    char args[1024];
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --prompt hi --max-tokens 5", bad_run_dir);
    int rc = run(args, out, sizeof out, NULL, err, sizeof err);
    CHECK(rc == 2, "exit %d", rc);
    CHECK(strstr(err, "fingerprint") && strstr(err, "--tokenizer"), "message: %s", err);
    /* no tokenizer given and none recorded */
    snprintf(args, sizeof args, "generate --ckpt '%s' --prompt hi", run_dir);
    rc = run(args, out, sizeof out, NULL, err, sizeof err);
    CHECK(rc == 2 && strstr(err, "--tokenizer"), "exit %d: %s", rc, err);
}

TEST(generate_finds_the_tokenizer_of_the_training_data) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    /* a run whose config names a data directory whose prepare.json names gpt2 */
    char prep[400], file[450], config[600], run2[400], args[1024];
    snprintf(prep, sizeof prep, "%s/prep", tmpdir);
    REQUIRE(mkdir(prep, 0755) == 0 || access(prep, F_OK) == 0);
    snprintf(file, sizeof file, "%s/prepare.json", prep);
    FILE *f = fopen(file, "w");
    REQUIRE(f);
    fputs("{\"tokenizer\": {\"spec\": \"gpt2\"}, \"format\": \"anneal-prepare\"}\n", f);
    fclose(f);
    snprintf(config, sizeof config, "{\"data\": \"%s\", \"seq\": 32}", prep);
    snprintf(run2, sizeof run2, "%s/run_prep", tmpdir);
    anneal_train_state st = {.step = 1, .tokenizer_fingerprint = fp, .best_val_loss = NAN};
    REQUIRE(anneal_checkpoint_save(run2, model, NULL, &st, config, 0) == ANNEAL_OK);
    size_t n1 = 0, n2 = 0;
    snprintf(args, sizeof args, "generate --ckpt '%s' --prompt hello --max-tokens 8 --threads 1", run2);
    int rc = run(args, out, sizeof out, &n1, err, sizeof err);
    CHECK(rc == 0, "exit %d: %s", rc, err);
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer gpt2 --prompt hello --max-tokens 8 --threads 1", run2);
    REQUIRE(run(args, out2, sizeof out2, &n2, err, sizeof err) == 0);
    CHECK(n1 == n2 && !memcmp(out, out2, n1), "text differs: %s vs %s", out, out2);
}

/* --------------------------------------------------------------------- eval */

/* A shard of n pseudo-random ids below `vocab` (header vocab hdr_vocab, fingerprint f). */
static bool write_shard(const char *path, uint32_t hdr_vocab, uint64_t f, int n, int vocab) {
    anneal_shard_writer *w = NULL;
    if (anneal_shard_writer_open(path, hdr_vocab, anneal_tokenizer_eot(tok), f, &w) != ANNEAL_OK) return false;
    uint64_t s = 17;
    int32_t id;
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        id = (int32_t)((s >> 33) % (uint64_t)vocab);
        if (anneal_shard_writer_append(w, &id, 1) != ANNEAL_OK) {
            anneal_shard_writer_abort(w);
            return false;
        }
    }
    if (anneal_shard_writer_finish(w) != ANNEAL_OK) return false;
    /* the manifest anneal prepare writes last (eval refuses a directory without one) */
    char man[1024];
    snprintf(man, sizeof man, "%s", path);
    char *slash = strrchr(man, '/');
    if (!slash) return false;
    snprintf(slash, sizeof man - (size_t)(slash - man), "/prepare.json");
    FILE *mf = fopen(man, "w");
    if (!mf) return false;
    fputs("{\"format\": \"anneal-prepare\", \"version\": 1}\n", mf);
    return fclose(mf) == 0;
}

/* Mean loss over every window of T+1 tokens of the shard, one window at a time. */
static double reference_loss(const char *path, int T, int64_t *tokens) {
    anneal_shard *sh = NULL;
    if (anneal_shard_open(path, true, &sh) != ANNEAL_OK) return NAN;
    int64_t W = (int64_t)(sh->info.n_tokens - 1) / T;
    double sum = 0;
    int32_t ids[256], tg[256];
    anneal_no_grad_begin();
    for (int64_t w = 0; w < W; w++) {
        for (int t = 0; t < T; t++) {
            ids[t] = (int32_t)anneal_shard_token(sh, (uint64_t)(w * T + t));
            tg[t] = (int32_t)anneal_shard_token(sh, (uint64_t)(w * T + t + 1));
        }
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *l = anneal_model_loss(model, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, T}, ids),
                                             anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, T}, tg));
        sum += l ? anneal_item(l) : NAN;
        anneal_scope_close(sc);
    }
    anneal_no_grad_end();
    anneal_shard_close(sh);
    *tokens = W * T;
    return sum / (double)W;
}

TEST(eval_prints_the_loss_over_every_window) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    int V = model->cfg.vocab_size;
    char dir[400], shard[450], args[2048];
    snprintf(dir, sizeof dir, "%s/data", tmpdir);
    REQUIRE(mkdir(dir, 0755) == 0 || access(dir, F_OK) == 0);
    snprintf(shard, sizeof shard, "%s/val_000000.bin", dir);
    REQUIRE(write_shard(shard, (uint32_t)V, fp, 3000, 2000));
    int64_t want_tokens = 0;
    anneal_set_num_threads(1);
    double want = reference_loss(shard, 32, &want_tokens);
    REQUIRE(isfinite(want) && want_tokens == 93 * 32);
    /* 93 windows in batches of 4: 23 full batches and one of a single window */
    snprintf(args, sizeof args, "eval --ckpt '%s' --data '%s' --batch 4 --seq 32 --threads 1", run_dir, shard);
    int rc = run(args, out, sizeof out, NULL, err, sizeof err);
    REQUIRE(rc == 0);
    double loss = NAN, ppl = NAN;
    long long tokens = 0;
    REQUIRE(sscanf(out, "loss %lf ppl %lf tokens %lld", &loss, &ppl, &tokens) == 3);
    CHECK(tokens == want_tokens, "tokens %lld, want %lld", tokens, (long long)want_tokens);
    CHECK_NEAR(loss, want, 1e-3);
    CHECK_NEAR(ppl, exp(loss), 0.01 * exp(loss) + 0.01);
    /* the directory form with the default split (val), the run's batch and seq (4, 32) */
    snprintf(args, sizeof args, "eval --ckpt '%s' --data '%s' --threads 1", run_dir, dir);
    REQUIRE(run(args, out2, sizeof out2, NULL, err, sizeof err) == 0);
    CHECK(!strcmp(out, out2), "directory form: %s vs %s", out2, out);
    /* --max-batches */
    snprintf(args, sizeof args, "eval --ckpt '%s' --data '%s' --batch 4 --seq 32 --max-batches 2 --threads 1", run_dir, shard);
    REQUIRE(run(args, out, sizeof out, NULL, err, sizeof err) == 0);
    CHECK(sscanf(out, "loss %lf ppl %lf tokens %lld", &loss, &ppl, &tokens) == 3 && tokens == 256, "%s", out);
    CHECK(isfinite(loss), "loss %g", loss);
    /* --seq beyond n_ctx */
    snprintf(args, sizeof args, "eval --ckpt '%s' --data '%s' --seq 65", run_dir, shard);
    rc = run(args, out, sizeof out, NULL, err, sizeof err);
    CHECK(rc == 2 && strstr(err, "--seq"), "exit %d: %s", rc, err);
}

TEST(eval_refuses_shards_of_another_tokenizer_or_a_larger_vocabulary) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *why = setup();
    if (why) TEST_FAIL("%s", why);
    int V = model->cfg.vocab_size;
    char shard[450], args[2048];
    snprintf(shard, sizeof shard, "%s/other_tok.bin", tmpdir);
    REQUIRE(write_shard(shard, (uint32_t)V, fp ^ 99, 500, 100));
    snprintf(args, sizeof args, "eval --ckpt '%s' --data '%s' --batch 2 --seq 16", run_dir, shard);
    int rc = run(args, out, sizeof out, NULL, err, sizeof err);
    CHECK(rc == 1 && strstr(err, "fingerprint") && strstr(err, "--data"), "exit %d: %s", rc, err);
    snprintf(shard, sizeof shard, "%s/big_vocab.bin", tmpdir);
    REQUIRE(write_shard(shard, (uint32_t)V + 10, fp, 500, 100));
    snprintf(args, sizeof args, "eval --ckpt '%s' --data '%s' --batch 2 --seq 16", run_dir, shard);
    rc = run(args, out, sizeof out, NULL, err, sizeof err);
    CHECK(rc == 1 && strstr(err, "vocabulary"), "exit %d: %s", rc, err);
    /* too few tokens for one window */
    snprintf(shard, sizeof shard, "%s/tiny.bin", tmpdir);
    REQUIRE(write_shard(shard, (uint32_t)V, fp, 10, 100));
    snprintf(args, sizeof args, "eval --ckpt '%s' --data '%s' --seq 32", run_dir, shard);
    rc = run(args, out, sizeof out, NULL, err, sizeof err);
    CHECK(rc == 1 && strstr(err, "--data"), "exit %d: %s", rc, err);
}

int main(void) {
    RUN(bad_flags_name_the_flag);
    RUN(generate_streams_the_same_text_as_in_process_generation);
    RUN(generate_seed_reproduces_and_changes_the_text);
    RUN(generate_kv_dtype_matches_in_process_generation);
    RUN(generate_bf16_packed_matches_the_unpacked_model);
    RUN(generate_refuses_a_checkpoint_of_another_tokenizer);
    RUN(generate_finds_the_tokenizer_of_the_training_data);
    RUN(eval_prints_the_loss_over_every_window);
    RUN(eval_refuses_shards_of_another_tokenizer_or_a_larger_vocabulary);
    int rc = anneal_test_summary();
    anneal_model_free(model);
    anneal_tokenizer_free(tok);
    if (tmpdir[0]) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    }
    return rc;
}
