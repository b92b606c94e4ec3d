/* `anneal generate --chat`: the prompt becomes a user message in the tokenizer's chat
 * template (here the Llama 3 fixture's), and the streamed reply equals the same
 * generation run in this process from anneal_chat_format's text; a tokenizer without a
 * chat template is refused, saying so. */
#include "anneal/anneal.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmpdir[256], errpath[300];
static char out[1 << 16], err[1 << 14];

/* Runs "$ANNEAL_BIN args": stdout into out, stderr into err; returns the exit code. */
static int run(const char *args, size_t *n) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>'%s'", getenv("ANNEAL_BIN"), args, errpath);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t got = fread(out, 1, sizeof out - 1, f);
    out[got] = '\0';
    if (n) *n = got;
    int st = pclose(f);
    FILE *e = fopen(errpath, "rb");
    size_t ge = e ? fread(err, 1, sizeof err - 1, e) : 0;
    err[ge] = '\0';
    if (e) fclose(e);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static bool collect(int32_t id, void *user) { return anneal_ids_push(user, id) == ANNEAL_OK; }

TEST(chat_reply_equals_in_process_generation) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_gen_chat_XXXXXX");
    REQUIRE(mkdtemp(tmpdir));
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", tmpdir);
    char tokdir[300];
    snprintf(tokdir, sizeof tokdir, "%s", anneal_test_path("tests/fixtures/hf_tokenizers/llama3_bl"));
    anneal_tokenizer *tok = NULL;
    REQUIRE(anneal_tokenizer_load(tokdir, &tok) == ANNEAL_OK);
    anneal_model_config c = {.arch = "gpt2", .n_layer = 1, .n_head = 2, .n_embd = 32,
                             .vocab_size = anneal_tokenizer_vocab_size(tok), .n_ctx = 64, .dropout = 0.0f,
                             .norm_eps = 1e-5f};
    anneal_model *model = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(model && anneal_model_init(model, 5) == ANNEAL_OK);
    anneal_scope *sc = anneal_scope_open();
    anneal_init_normal_(anneal_params_find(model->params, "transformer.wte.weight")->tensor, 0.0f, 0.3f);
    anneal_scope_close(sc);
    anneal_train_state st = {.step = 1, .tokens = 10, .tokenizer_fingerprint = anneal_tokenizer_fingerprint(tok),
                             .best_val_loss = NAN};
    char run_dir[400];
    snprintf(run_dir, sizeof run_dir, "%s/run", tmpdir);
    REQUIRE(anneal_checkpoint_save(run_dir, model, NULL, &st, "{}", 0) == ANNEAL_OK);
    const char *prompt = "In the beginning?";
    char args[2048];
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer '%s' --chat --prompt '%s' --max-tokens 12 "
                                "--seed 3 --temperature 0.9 --threads 1", run_dir, tokdir, prompt);
    size_t n = 0;
    int rc = run(args, &n);
    CHECK(rc == 0, "exit %d: %s", rc, err);
    /* the same here: chat text with its special tokens, no extra BOS */
    anneal_set_num_threads(1);
    anneal_chat_message msg = {"user", prompt};
    char *text = NULL;
    REQUIRE(anneal_chat_format(tok, &msg, 1, true, &text, NULL) == ANNEAL_OK);
    anneal_ids p = {0}, got = {0};
    REQUIRE(anneal_tokenizer_encode(tok, text, strlen(text), true, &p) == ANNEAL_OK);
    CHECK_TRUE(p.n > 0 && p.ids[0] == anneal_tokenizer_bos(tok));
    CHECK_TRUE(p.n > 1 && p.ids[1] == anneal_tokenizer_token_id(tok, "<|start_header_id|>"));
    anneal_sampler_config scfg = {.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 3};
    REQUIRE(anneal_model_generate(model, p.ids, (int64_t)p.n, 12, &scfg, anneal_tokenizer_eot(tok), collect, &got) ==
            ANNEAL_OK);
    char *reply = NULL;
    size_t len = 0;
    REQUIRE(anneal_tokenizer_decode(tok, got.ids, got.n, &reply, &len) == ANNEAL_OK);
    CHECK_TRUE(got.n > 0);
    CHECK(n == len + 1 && !memcmp(out, reply, len), "--chat printed\n%s\nwant the reply only\n%s", out, reply);
    free(reply);
    free(text);
    anneal_ids_free(&p);
    anneal_ids_free(&got);
    /* no chat template: a clear error */
    char plain[300];
    snprintf(plain, sizeof plain, "%s", anneal_test_path("tests/fixtures/hf_tokenizers/gpt2_bl"));
    anneal_tokenizer *t2 = NULL;
    REQUIRE(anneal_tokenizer_load(plain, &t2) == ANNEAL_OK);
    st.tokenizer_fingerprint = anneal_tokenizer_fingerprint(t2);
    anneal_tokenizer_free(t2);
    snprintf(run_dir, sizeof run_dir, "%s/run2", tmpdir);
    REQUIRE(anneal_checkpoint_save(run_dir, model, NULL, &st, "{}", 0) == ANNEAL_OK);
    snprintf(args, sizeof args, "generate --ckpt '%s' --tokenizer '%s' --chat --prompt hi --max-tokens 2", run_dir,
             plain);
    rc = run(args, &n);
    CHECK(rc != 0 && strstr(err, "--chat") && strstr(err, "no chat_template"), "exit %d: %s", rc, err);
    anneal_model_free(model);
    anneal_tokenizer_free(tok);
    snprintf(args, sizeof args, "rm -rf '%s'", tmpdir);
    CHECK_TRUE(system(args) == 0);
}

int main(void) {
    RUN(chat_reply_equals_in_process_generation);
    return anneal_test_summary();
}
