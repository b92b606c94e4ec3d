/* `anneal serve` against the real `openai` Python client (tests/serve/openai_check.py):
 * completions and chat, streaming and not, equal to `anneal generate` on the same
 * prompt (greedy and seeded sampling), concurrent requests equal to one at a time,
 * stop strings, 429 when the queue is full, the deadline, a client that disconnects
 * freeing its slot, malformed/oversized/absurd requests (400/413 naming the field),
 * /v1/models, /health, /metrics accepted by `promtool check metrics`, a short load
 * test and a graceful stop on SIGTERM. This file makes the model: a small random GPT-2
 * checkpoint with the Llama 3 fixture tokenizer (it has a chat template). */
#include "anneal/anneal.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

TEST(openai_client_against_serve) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *py = anneal_test_python("openai,httpx");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    if (system("command -v promtool >/dev/null 2>&1") != 0)
        SKIP_PROMISED("needs promtool (the Debian prometheus package; scripts/bootstrap.sh installs it)");
    char tmpdir[256];
    snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_serve_XXXXXX");
    REQUIRE(mkdtemp(tmpdir));
    char tokdir[512];
    snprintf(tokdir, sizeof tokdir, "%s", anneal_test_path("tests/fixtures/hf_tokenizers/llama3_bl"));
    anneal_tokenizer *tok = NULL;
    REQUIRE(anneal_tokenizer_load(tokdir, &tok) == ANNEAL_OK);
    anneal_model_config c = {.arch = "gpt2", .n_layer = 2, .n_head = 2, .n_embd = 32,
                             .vocab_size = anneal_tokenizer_vocab_size(tok), .n_ctx = 256, .dropout = 0.0f,
                             .norm_eps = 1e-5f};
    anneal_model *model = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(model && anneal_model_init(model, 11) == ANNEAL_OK);
    anneal_scope *sc = anneal_scope_open();
    /* a wider embedding so greedy text is not one token repeated */
    anneal_init_normal_(anneal_params_find(model->params, "transformer.wte.weight")->tensor, 0.0f, 0.5f);
    anneal_scope_close(sc);
    anneal_train_state st = {.step = 1, .tokens = 10, .tokenizer_fingerprint = anneal_tokenizer_fingerprint(tok),
                             .best_val_loss = NAN};
    char run_dir[400];
    snprintf(run_dir, sizeof run_dir, "%s/run", tmpdir);
    REQUIRE(anneal_checkpoint_save(run_dir, model, NULL, &st, "{}", 0) == ANNEAL_OK);
    anneal_model_free(model);
    anneal_tokenizer_free(tok);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' '%s' --bin '%s' --ckpt '%s' --tokenizer '%s' %s", py,
             anneal_test_path("tests/serve/openai_check.py"), getenv("ANNEAL_BIN"), run_dir, tokdir,
             anneal_test_sanitized() ? "--sanitized" : "");
    int rc = system(cmd);
    CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "tests/serve/openai_check.py failed (exit %d): see its output above",
          WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    CHECK_TRUE(system(cmd) == 0);
}

int main(void) {
    RUN(openai_client_against_serve);
    return anneal_test_summary();
}
