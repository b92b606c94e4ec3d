/* Issue 16's defects 1, 3, 5, 6 and 7, through the binary (and the library where a
 * file has no command of its own): shards without prepare.json are refused, the
 * tokenizer prepare.json names is found from any directory (and messages say where a
 * path came from), an interrupted prepare's temporaries are removed by the next one,
 * every JSON settings file refuses duplicate keys and \u0000 in keys, numbers must be
 * decimal, and the messages of issue 16 say the real problem first.
 * Each check failed against the code before the fix (run with ANNEAL_BIN pointing at
 * that build). Small generated text and a 300-id tokenizer keep it to seconds. */
#include "test.h"
#include "train/train_util.h"

#include <dirent.h>
#include <limits.h>

static char D[256];     /* scratch directory */
static char out[600];   /* output of the last command */
static bool ready;

#define OUTPUT tu_slurp(out)

/* Runs `sh -c "cd CWD && ANNEAL ARGS"` (stdout + stderr to `out`); the exit code. */
static int run_in(const char *cwd, const char *args) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s > '%s' 2>&1", cwd, getenv("ANNEAL_BIN"), args, out);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

static bool exists(const char *p) { return access(p, F_OK) == 0; }

/* A deterministic text of n bytes from a few words, so the tokenizer and shards are small. */
static void write_corpus(const char *path, size_t n, uint64_t seed) {
    static const char *words[] = {"the", "light", "and", "darkness", "was", "upon", "face", "of", "waters",
                                  "god", "said", "let", "there", "be", "firmament", "evening", "morning", "day"};
    FILE *f = fopen(path, "w");
    if (!f) return;
    size_t k = 0;
    while (k < n) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        const char *w = words[(seed >> 33) % (sizeof words / sizeof *words)];
        k += (size_t)fprintf(f, "%s%s", w, (seed >> 20) % 9 == 0 ? ".\n" : " ");
    }
    fclose(f);
}

/* D/c.txt, D/tok (300 ids), D/data (prepared from D with the relative path "tok"). */
TEST(setup) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *d = tu_mkdtemp("harden");
    REQUIRE(d);
    snprintf(D, sizeof D, "%s", d);
    snprintf(out, sizeof out, "%s/out.txt", D);
    char p[512];
    snprintf(p, sizeof p, "%s/c.txt", D);
    write_corpus(p, 60000, 1);
    REQUIRE(run_in(D, "tokenizer train --vocab-size 300 --input c.txt --out tok --threads 1") == 0);
    int rc = run_in(D, "prepare --tokenizer tok --input c.txt --out data --val-fraction 0.1 --threads 1");
    CHECK(rc == 0, "prepare: exit %d: %s", rc, OUTPUT);
    ready = rc == 0;
}

/* Defect 3: prepare.json stores the tokenizer's path absolute (FORMATS.md). */
TEST(prepare_json_stores_the_resolved_tokenizer) {
    char p[512], want[PATH_MAX], tok[600];
    snprintf(p, sizeof p, "%s/data/prepare.json", D);
    snprintf(tok, sizeof tok, "%s/tok", D);
    REQUIRE(realpath(tok, want));
    char needle[PATH_MAX + 16];
    snprintf(needle, sizeof needle, "\"spec\":\t\"%s\"", want);
    CHECK(strstr(tu_slurp(p), needle), "%s lacks %s: %s", p, needle, tu_slurp(p));
}

/* Defect 3: training from another directory keeps samples on, and generate --ckpt
 * from another directory finds the tokenizer. */
TEST(training_from_elsewhere_keeps_samples) {
    char a[2048];
    snprintf(a, sizeof a,
             "train --data %s/data --model tiny --steps 2 --batch 2 --seq 32 --sample-every 2 --sample-tokens 4 "
             "--eval-batches 1 --threads 1 --peak-gflops 100 --out %s/run1",
             D, D);
    int rc = run_in("/", a);
    CHECK(rc == 0 && strstr(OUTPUT, "--- sample at step 2") && !strstr(OUTPUT, "samples are off"), "exit %d: %s", rc,
          OUTPUT);
    snprintf(a, sizeof a, "generate --ckpt %s/run1 --prompt the --max-tokens 4 --threads 1", D);
    rc = run_in("/", a);
    CHECK(rc == 0, "generate from /: exit %d: %s", rc, OUTPUT);
}

/* Defect 3: a prepare.json of an earlier version (a relative path, as typed) is still
 * read: inside the data directory when the tokenizer is there, else relative to the
 * current directory; a failure names prepare.json, not a --tokenizer never passed. */
TEST(old_relative_manifests_and_where_a_path_came_from) {
    char a[2048], p[600], man[600];
    REQUIRE(exists(D) && ready);
    snprintf(a, sizeof a, "cp -r '%s/data' '%s/olddata' && cp -r '%s/tok' '%s/olddata/tokin'", D, D, D, D);
    REQUIRE(system(a) == 0);
    snprintf(man, sizeof man, "%s/olddata/prepare.json", D);
    char *text = strdup(tu_slurp(man)), *s = strstr(text, "\"spec\":\t\"");
    REQUIRE(s);
    char *e = strchr(s + 9, '"');
    REQUIRE(e);
    /* 1. relative to the current directory (the old meaning): "tok" */
    char *t1 = NULL;
    REQUIRE(asprintf(&t1, "%.*s\"spec\":\t\"tok%s", (int)(s - text), text, e) > 0);
    write_file(man, t1);
    free(t1);
    snprintf(a, sizeof a,
             "train --data %s/olddata --model tiny --steps 1 --batch 2 --seq 32 --eval-batches 1 --threads 1 "
             "--peak-gflops 100 --out %s/run2",
             D, D);
    int rc = run_in(D, a); /* from D, where "tok" is */
    CHECK(rc == 0 && !strstr(OUTPUT, "cannot load the tokenizer"), "exit %d: %s", rc, OUTPUT);
    /* the checkpoint's own tokenizer removed: generate falls back to prepare.json */
    snprintf(p, sizeof p, "%s/run2/ckpt_00000001/tokenizer.json", D);
    REQUIRE(unlink(p) == 0);
    snprintf(a, sizeof a, "generate --ckpt %s/run2 --prompt the --max-tokens 4 --threads 1", D);
    rc = run_in("/", a); /* from /, where "tok" is not */
    CHECK(rc != 0 && strstr(OUTPUT, "prepare.json of") && strstr(OUTPUT, "olddata") && !strstr(OUTPUT, "--tokenizer tok"),
          "exit %d: %s", rc, OUTPUT);
    /* 2. inside the data directory: "tokin" */
    REQUIRE(asprintf(&t1, "%.*s\"spec\":\t\"tokin%s", (int)(s - text), text, e) > 0);
    write_file(man, t1);
    free(t1);
    rc = run_in("/", a);
    CHECK(rc == 0, "exit %d: %s", rc, OUTPUT);
    free(text);
}

/* Defect 1: shards whose prepare was killed (no prepare.json) are refused by train and
 * eval, naming the missing file. */
TEST(shards_without_prepare_json_are_refused) {
    char a[2048];
    REQUIRE(ready);
    snprintf(a, sizeof a, "cp -r '%s/data' '%s/killed' && rm '%s/killed/prepare.json'", D, D, D);
    REQUIRE(system(a) == 0);
    snprintf(a, sizeof a, "train --data %s/killed --model tiny --steps 1 --batch 2 --seq 32 --threads 1 --out %s/run3", D,
             D);
    int rc = run_in(D, a);
    CHECK(rc == 1 && strstr(OUTPUT, "--data") && strstr(OUTPUT, "killed/prepare.json") && strstr(OUTPUT, "did not finish"),
          "exit %d: %s", rc, OUTPUT);
    char run3[600];
    snprintf(run3, sizeof run3, "%s/run3", D);
    CHECK_TRUE(!exists(run3));
    snprintf(a, sizeof a, "eval --ckpt %s/run1 --data %s/killed --threads 1", D, D);
    rc = run_in(D, a);
    CHECK(rc == 1 && strstr(OUTPUT, "killed/prepare.json"), "exit %d: %s", rc, OUTPUT);
}

/* Defect 5: a prepare into the same --out removes what an interrupted one left
 * ("<shard>.tmp.<pid>" of a dead pid), keeps a live process's, and never touches
 * files that are not its own. */
TEST(interrupted_prepare_temporaries_are_removed) {
    char a[2048], dead_p[600], live_p[600], other_p[600], stdin_p[600];
    REQUIRE(ready);
    pid_t child = fork();
    if (child == 0) _exit(0);
    REQUIRE(child > 0);
    REQUIRE(tu_wait(child) == 0); /* its pid is now no process's */
    snprintf(dead_p, sizeof dead_p, "%s/data/train_000005.bin.tmp.%d", D, (int)child);
    snprintf(stdin_p, sizeof stdin_p, "%s/data/.stdin.tmp.%d", D, (int)child);
    snprintf(live_p, sizeof live_p, "%s/data/val_000003.bin.tmp.%d", D, (int)getpid());
    snprintf(other_p, sizeof other_p, "%s/data/notes.txt.tmp.%d", D, (int)child);
    write_file(dead_p, "half a shard");
    write_file(stdin_p, "spooled");
    write_file(live_p, "being written");
    write_file(other_p, "not anneal's");
    snprintf(a, sizeof a, "prepare --tokenizer %s/tok --input %s/c.txt --out %s/data --val-fraction 0.1 --threads 1", D, D,
             D);
    int rc = run_in(D, a);
    CHECK(rc == 0 && strstr(OUTPUT, "interrupted"), "exit %d: %s", rc, OUTPUT);
    CHECK(!exists(dead_p) && !exists(stdin_p), "%s or %s left", dead_p, stdin_p);
    CHECK_TRUE(exists(live_p) && exists(other_p));
    unlink(live_p);
    unlink(other_p);
    /* the same for `anneal tokenizer train --out` and `anneal export --out` (a directory) */
    snprintf(dead_p, sizeof dead_p, "%s/tok/tokenizer.json.tmp.%d", D, (int)child);
    write_file(dead_p, "half a tokenizer");
    REQUIRE(run_in(D, "tokenizer train --vocab-size 300 --input c.txt --out tok --threads 1") == 0);
    CHECK(!exists(dead_p), "%s left", dead_p);
    char exp_tmp[400];
    snprintf(exp_tmp, sizeof exp_tmp, "%s/exported.tmp.%d", D, (int)child);
    mkdir(exp_tmp, 0755);
    snprintf(dead_p, sizeof dead_p, "%s/model.safetensors", exp_tmp);
    write_file(dead_p, "half a model");
    snprintf(a, sizeof a, "export --ckpt %s/run1 --format hf --out %s/exported", D, D);
    rc = run_in(D, a);
    CHECK(rc == 0 && !exists(exp_tmp), "exit %d, %s: %s", rc, exists(exp_tmp) ? "left" : "removed", OUTPUT);
}

/* Defect 6: JSON settings with a key containing \u0000 or a key twice are refused,
 * naming the key, in every file anneal reads; flags take decimal numbers only. */
TEST(json_keys_and_numbers) {
    char a[2048], p[600];
    REQUIRE(ready);
    snprintf(p, sizeof p, "%s/nul.json", D);
    write_file(p, "{\"lr\\u0000garbage\": 0.5}");
    snprintf(a, sizeof a, "train --synthetic --steps 1 --config-file %s --out %s/r_nul", p, D);
    int rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "lr\\u0000garbage") && strstr(OUTPUT, "\\u0000"), "exit %d: %s", rc, OUTPUT);
    snprintf(p, sizeof p, "%s/dup.json", D);
    write_file(p, "{\"lr\": 0.5, \"steps\": 1, \"lr\": 0.1}");
    snprintf(a, sizeof a, "train --synthetic --config-file %s --out %s/r_dup", p, D);
    rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "duplicate key \"lr\""), "exit %d: %s", rc, OUTPUT);
    /* a Hugging Face config.json (which took the first copy) */
    snprintf(p, sizeof p, "%s/config.json", D);
    write_file(p, "{\"model_type\": \"gpt2\", \"n_layer\": 2, \"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 300, "
                  "\"n_positions\": 64, \"n_layer\": 3}");
    snprintf(a, sizeof a, "train --synthetic --steps 1 --config %s --out %s/r_cfg", p, D);
    rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "duplicate key \"n_layer\"") && strstr(OUTPUT, "config.json"), "exit %d: %s", rc,
          OUTPUT);
    /* prepare.json */
    snprintf(a, sizeof a, "cp -r '%s/data' '%s/dupdata'", D, D);
    REQUIRE(system(a) == 0);
    snprintf(p, sizeof p, "%s/dupdata/prepare.json", D);
    write_file(p, "{\"format\": \"anneal-prepare\", \"version\": 1, \"format\": \"x\"}");
    snprintf(a, sizeof a, "train --data %s/dupdata --steps 1 --batch 2 --seq 32 --threads 1 --out %s/r_prep", D, D);
    rc = run_in(D, a);
    CHECK(rc == 1 && strstr(OUTPUT, "dupdata/prepare.json") && strstr(OUTPUT, "duplicate key \"format\""), "exit %d: %s",
          rc, OUTPUT);
    /* a PEFT adapter_config.json */
    char ad[400];
    snprintf(ad, sizeof ad, "%s/adapter", D);
    mkdir(ad, 0755);
    snprintf(p, sizeof p, "%s/adapter_config.json", ad);
    write_file(p, "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"r\": 4, \"target_modules\": [\"c_attn\"]}");
    anneal_peft_config pc;
    anneal_clear_error();
    CHECK(anneal_peft_read_config(ad, &pc) == ANNEAL_ERR_FORMAT && strstr(anneal_last_error(), "duplicate key \"r\"") &&
              strstr(anneal_last_error(), "adapter_config.json"),
          "%s", anneal_last_error());
    anneal_clear_error();
    /* tokenizer_config.json */
    snprintf(a, sizeof a, "cp -r '%s/tok' '%s/duptok'", D, D);
    REQUIRE(system(a) == 0);
    snprintf(p, sizeof p, "%s/duptok/tokenizer_config.json", D);
    write_file(p, "{\"bos_token\": \"<|endoftext|>\", \"bos_token\": \"x\"}");
    snprintf(a, sizeof a, "tokenize --tokenizer %s/duptok/tokenizer.json < /dev/null", D);
    rc = run_in(D, a);
    CHECK(rc != 0 && strstr(OUTPUT, "duplicate key \"bos_token\""), "exit %d: %s", rc, OUTPUT);
    /* numbers: decimal only, a range problem said as such */
    static const struct { const char *flags, *want; } bad[] = {
        {"--lr 0x10", "--lr: expects a decimal number, got '0x10'"},
        {"--lr inf", "--lr: expects a decimal number"},
        {"--lr nan", "--lr: expects a decimal number"},
        {"--lr 1e999", "--lr: 1e999 is out of range"},
        {"--steps 010", "--steps: expects a decimal integer"},
        {"--seed 0x10", "--seed: expects a decimal integer"},
        {"--steps 99999999999999999999", "--steps: 99999999999999999999 is out of range"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(a, sizeof a, "train --synthetic %s --out %s/r_num", bad[i].flags, D);
        rc = run_in(D, a);
        CHECK(rc == 2 && strstr(OUTPUT, bad[i].want), "%s: exit %d: %s", bad[i].flags, rc, OUTPUT);
    }
    snprintf(a, sizeof a, "generate --ckpt %s/run1 --temperature 0x1 --prompt a", D);
    rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "--temperature expects a decimal number"), "exit %d: %s", rc, OUTPUT);
}

/* Defect 7: the messages say the real problem (first). */
TEST(messages) {
    char a[2048], p[600];
    REQUIRE(ready);
    snprintf(a, sizeof a, "train --synthetic --config-file /nonexistent/settings.json --out %s/r_m", D);
    int rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "/nonexistent/settings.json") && strstr(OUTPUT, "No such file or directory"),
          "exit %d: %s", rc, OUTPUT);
    snprintf(a, sizeof a, "train --synthetic --config-file %s --out %s/r_m", D, D);
    rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "is a directory"), "exit %d: %s", rc, OUTPUT);
    /* --seq above n_ctx with a val split too small for it: the --seq error, no val note before it */
    snprintf(a, sizeof a, "prepare --tokenizer %s/tok --input %s/c.txt --out %s/smallval --val-fraction 0.002 --threads 1",
             D, D, D);
    REQUIRE(run_in(D, a) == 0);
    snprintf(a, sizeof a, "train --data %s/smallval --model tiny --seq 300 --steps 1 --threads 1 --out %s/r_seq", D, D);
    rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "--seq: 300 is more than the model's n_ctx") && !strstr(OUTPUT, "val split"),
          "exit %d: %s", rc, OUTPUT);
    /* --init from a checkpoint of another tokenizer with the same vocabulary size */
    snprintf(p, sizeof p, "%s/c2.txt", D);
    write_corpus(p, 60000, 99);
    snprintf(a, sizeof a, "cd '%s' && sed 's/the/THE/g; s/a/A/g' c2.txt > c3.txt", D);
    REQUIRE(system(a) == 0);
    REQUIRE(run_in(D, "tokenizer train --vocab-size 300 --input c3.txt --out tok2 --threads 1") == 0);
    REQUIRE(run_in(D, "prepare --tokenizer tok2 --input c3.txt --out data2 --val-fraction 0.1 --threads 1") == 0);
    snprintf(a, sizeof a, "train --init %s/run1 --data %s/data2 --steps 1 --batch 2 --seq 32 --threads 1 --out %s/r_init",
             D, D, D);
    rc = run_in(D, a);
    CHECK(rc == 2 && strstr(OUTPUT, "--init") && strstr(OUTPUT, "tokenizer"), "exit %d: %s", rc, OUTPUT);
    /* the same tokenizer's data is accepted */
    snprintf(a, sizeof a, "train --init %s/run1 --data %s/data --steps 1 --batch 2 --seq 32 --threads 1 --peak-gflops 100 "
                          "--eval-batches 1 --out %s/r_init2",
             D, D, D);
    rc = run_in(D, a);
    CHECK(rc == 0, "exit %d: %s", rc, OUTPUT);
}

int main(void) {
    RUN(setup);
    if (ready) {
        RUN(prepare_json_stores_the_resolved_tokenizer);
        RUN(training_from_elsewhere_keeps_samples);
        RUN(old_relative_manifests_and_where_a_path_came_from);
        RUN(shards_without_prepare_json_are_refused);
        RUN(interrupted_prepare_temporaries_are_removed);
        RUN(json_keys_and_numbers);
        RUN(messages);
    }
    if (D[0]) tu_rmrf(D);
    return anneal_test_summary();
}
