/* `anneal train` and `anneal info` end to end through the built binary (ANNEAL_BIN,
 * set by ctest): the synthetic run's loss falls, runs are reproducible, the progress
 * output and the JSON-lines log have their documented fields, --config-file layers
 * under flags, and bad flags are errors that name the flag (exit 2). */
#include "test.h"
#include "train/train_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Runs "$ANNEAL_BIN args" capturing stdout+stderr into out; returns the exit code. */
static int run(const char *args, char *out, size_t cap) {
    const char *bin = getenv("ANNEAL_BIN");
    static char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' %.4000s 2>&1", bin, args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static char buf[1 << 16], buf2[1 << 16], args[4096];

/* The "  train loss X (first step of this run Y)" line of the summary. */
static bool final_losses(const char *out, double *first, double *last) {
    const char *d = strstr(out, "train loss ");
    return d && sscanf(d, "train loss %lf (first step of this run %lf)", last, first) == 2;
}

TEST(synthetic_training_loss_falls) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *dir = tu_mkdtemp("cli");
    REQUIRE(dir);
    snprintf(args, sizeof args,
             "train --synthetic --model tiny --steps 40 --batch 8 --seq 32 --lr 1e-2 --warmup 5 --threads 2 "
             "--eval-every 20 --eval-batches 4 --out %s/run",
             dir);
    int rc = run(args, buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    double a, b;
    REQUIRE(final_losses(buf, &a, &b));
    /* ln(512) = 6.24 at init; 40 steps reach ~5.15 (the floor is ln 4 = 1.39) */
    CHECK(a > 6.0 && a < 6.5, "initial loss %g", a);
    CHECK(b < 5.5, "loss after 40 steps %g", b);
    /* progress lines carry every figure; the summary has time, tokens, losses, memory */
    CHECK(strstr(buf, "step    40/40  loss ") && strstr(buf, " lr ") && strstr(buf, " norm ") &&
              strstr(buf, " tok/s") && strstr(buf, "MFU ") && strstr(buf, " ms") && strstr(buf, "ETA "),
          "%s", buf);
    CHECK(strstr(buf, "step 20: val loss ") && strstr(buf, "done: 40 steps") && strstr(buf, "val loss ") &&
              strstr(buf, "peak memory: tensors ") && strstr(buf, "RSS ") && strstr(buf, "MFU against "),
          "%s", buf);
    /* the log: a step record with the documented fields for every step */
    char logp[400];
    snprintf(logp, sizeof logp, "%s/run/log.jsonl", dir);
    FILE *f = fopen(logp, "r");
    REQUIRE(f);
    int steps = 0, evals = 0, summaries = 0;
    char line[1 << 14];
    while (fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        CHECK(o != NULL, "not JSON: %s", line);
        const char *ty = cJSON_GetStringValue(cJSON_GetObjectItem(o, "type"));
        if (ty && !strcmp(ty, "step")) {
            const char *keys[] = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "ms", "tokens"};
            for (int k = 0; k < 8; k++) CHECK(cJSON_IsNumber(cJSON_GetObjectItem(o, keys[k])), "step lacks %s", keys[k]);
            steps++;
        } else if (ty && !strcmp(ty, "start")) {
            /* the CPU and the kernel path of each family, as anneal info reports them */
            cJSON *cpu = cJSON_GetObjectItem(o, "cpu"), *k = cJSON_GetObjectItem(cpu, "kernels");
            const char *gemm = cJSON_GetStringValue(cJSON_GetObjectItem(k, "gemm f32"));
            CHECK(cJSON_GetStringValue(cJSON_GetObjectItem(cpu, "model")) && gemm &&
                      cJSON_GetStringValue(cJSON_GetObjectItem(k, "attention bf16")) &&
                      !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(cpu, "isa_limit")), "best"),
                  "start record's cpu: %s", line);
        } else if (ty && !strcmp(ty, "eval")) {
            CHECK_TRUE(cJSON_IsNumber(cJSON_GetObjectItem(o, "step")) && cJSON_IsNumber(cJSON_GetObjectItem(o, "val_loss")));
            evals++;
        } else if (ty && !strcmp(ty, "summary")) {
            const char *keys[] = {"seconds", "tokens", "train_loss", "val_loss", "peak_tensor_bytes", "peak_rss_bytes"};
            for (int k = 0; k < 6; k++) CHECK(cJSON_IsNumber(cJSON_GetObjectItem(o, keys[k])), "summary lacks %s", keys[k]);
            summaries++;
        }
        cJSON_Delete(o);
    }
    fclose(f);
    CHECK(steps == 40 && evals == 2 && summaries == 1, "%d steps, %d evals, %d summaries", steps, evals, summaries);
    tu_rmrf(dir);
}

TEST(reruns_are_identical) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *dir = tu_mkdtemp("cli");
    REQUIRE(dir);
    const char *common = "train --synthetic --model tiny --steps 6 --batch 4 --seq 16 --dropout 0.1 --threads 2 "
                         "--peak-gflops 100";
    snprintf(args, sizeof args, "%s --out %s/a", common, dir);
    REQUIRE(run(args, buf, sizeof buf) == 0);
    snprintf(args, sizeof args, "%s --out %s/b", common, dir);
    REQUIRE(run(args, buf2, sizeof buf2) == 0);
    /* compare the loss column of every step line */
    const char *p = buf, *q = buf2;
    int steps = 0;
    while ((p = strstr(p, "\nstep ")) && (q = strstr(q, "\nstep "))) {
        double x, y;
        p = strstr(p, " loss "), q = strstr(q, " loss ");
        REQUIRE(p && q);
        CHECK_TRUE(sscanf(p, " loss %lf", &x) == 1 && sscanf(q, " loss %lf", &y) == 1);
        CHECK(x == y, "step %d: %g vs %g", steps, x, y);
        steps++;
    }
    CHECK(steps >= 6, "found %d loss values", steps);
    tu_rmrf(dir);
}

TEST(config_file_layers_under_flags) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *dir = tu_mkdtemp("cli");
    REQUIRE(dir);
    char cf[400];
    snprintf(cf, sizeof cf, "%s/train.json", dir);
    FILE *f = fopen(cf, "w");
    REQUIRE(f);
    fprintf(f, "{\"synthetic\": true, \"steps\": 9, \"batch\": 2, \"seq\": 8, \"lr\": 0.002, \"peak-gflops\": 50,"
               " \"log-every\": 3}\n");
    fclose(f);
    snprintf(args, sizeof args, "train --config-file %s --steps 4 --out %s/run", cf, dir);
    int rc = run(args, buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    /* steps from the flag, batch/seq/lr from the file */
    CHECK(strstr(buf, "4 steps of 2 x 8 tokens") && strstr(buf, "lr 0.002") && strstr(buf, "step     4/4"), "%s", buf);
    /* --log-every 3: steps 1, 3 and the last are printed when not on a terminal */
    CHECK(!strstr(buf, "step     2/4"), "%s", buf);
    /* an unknown key names the file and the key */
    f = fopen(cf, "w");
    REQUIRE(f);
    fprintf(f, "{\"synthetic\": true, \"stepz\": 3}\n");
    fclose(f);
    snprintf(args, sizeof args, "train --config-file %s --out %s/run2", cf, dir);
    rc = run(args, buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "stepz") && strstr(buf, "train.json"), "exit %d: %s", rc, buf);
    tu_rmrf(dir);
}

TEST(bad_flags_name_the_flag) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    struct { const char *args, *expect; int rc; } cases[] = {
        {"train --stpes 3", "--stpes", 2},
        {"train --steps abc", "--steps", 2},
        {"train --steps 0", "--steps", 2},
        {"train --lr -1", "--lr", 2},
        {"train --model gpt5", "--model", 2},
        {"train --schedule zigzag", "--schedule", 2},
        {"train --synthetic --seq 100000", "--seq", 2},
        {"train --dropout 1.5", "--dropout", 2},
        {"train --steps", "--steps", 2},
        {"train --shuffle sometimes", "--shuffle", 2},
        {"train --accum 0", "--accum", 2},
        {"train --beta2 1", "--beta2", 2},
        {"train --clip -0.5", "--clip", 2},
        {"train --max-bad-steps 0", "--max-bad-steps", 2},
        {"train --steps 5 --tokens 1000", "--tokens", 2},
        {"train --model tiny --config x.json", "--config", 2},
        {"train --synthetic --steps 3", "done:", 0}, /* sanity: a valid line runs to the end (its run dir is removed below) */
        {"train", "--data", 2},
        {"train --config-file /nonexistent/cfg.json", "--config-file", 2},
        {"train --resume", "--resume", 2},
        {"train stray", "stray", 2},
        {"frobnicate", "frobnicate", 2},
    };
    const char *dir = tu_mkdtemp("cli");
    REQUIRE(dir);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].rc == 0) snprintf(args, sizeof args, "%s --peak-gflops 10 --out %s/ok", cases[i].args, dir);
        else snprintf(args, sizeof args, "%s", cases[i].args);
        int rc = run(args, buf, sizeof buf);
        CHECK(rc == cases[i].rc, "'%s': exit %d, want %d: %s", cases[i].args, rc, cases[i].rc, buf);
        CHECK(strstr(buf, cases[i].expect) != NULL, "'%s': message does not name %s: %s", cases[i].args,
              cases[i].expect, buf);
    }
    tu_rmrf(dir);
}

TEST(info_and_help) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    CHECK_TRUE(run("info", buf, sizeof buf) == 0 && strstr(buf, "anneal ") && strstr(buf, "threads"));
    /* GPUs are listed, or the reason there are none (not built, no driver, no device) */
    CHECK(strstr(buf, "gpus: ") != NULL && (strstr(buf, "gpus: none (") || strstr(buf, "gpu 0: ")),
          "info lacks its gpus part: %s", buf);
    /* the CPU kernel table: every family with its path and reason; ANNEAL_ISA caps the
     * paths, and a value that is no level stops every command with a message */
    CHECK(strstr(buf, "cpu kernels") && strstr(buf, "gemm f32") && strstr(buf, "attention bf16") &&
              strstr(buf, "isa limit: best"),
          "info lacks its kernel table: %s", buf);
    setenv("ANNEAL_ISA", "portable", 1);
    CHECK_TRUE(run("info", buf, sizeof buf) == 0);
    CHECK(strstr(buf, "isa limit: portable") && strstr(buf, "gemm f32        portable") &&
              strstr(buf, "gemv (decode)   portable"),
          "ANNEAL_ISA=portable is not what info reports: %s", buf);
    setenv("ANNEAL_ISA", "avx9", 1);
    CHECK(run("info", buf, sizeof buf) == 2 && strstr(buf, "ANNEAL_ISA=avx9: not an instruction-set level"),
          "a bad ANNEAL_ISA: %s", buf);
    CHECK(run("train --synthetic --steps 1", buf, sizeof buf) == 2 && strstr(buf, "ANNEAL_ISA=avx9"),
          "train with a bad ANNEAL_ISA: %s", buf);
    unsetenv("ANNEAL_ISA");
    CHECK_TRUE(run("train --help", buf, sizeof buf) == 0);
    const char *flags[] = {"--model", "--config", "--init", "--data", "--batch", "--seq", "--accum", "--steps",
                           "--tokens", "--lr", "--min-lr", "--warmup", "--schedule", "--weight-decay", "--beta1",
                           "--beta2", "--eps", "--clip", "--dropout", "--shuffle", "--seed", "--threads",
                           "--eval-every", "--sample-every", "--ckpt-every", "--keep", "--out", "--resume",
                           "--log-jsonl", "--max-bad-steps", "--recompute", "--config-file", "--synthetic"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        CHECK(strstr(buf, flags[i]) != NULL, "help lacks %s", flags[i]);
    CHECK_TRUE(run("--help", buf, sizeof buf) == 0 && strstr(buf, "train"));
}

int main(void) {
    RUN(synthetic_training_loss_falls);
    RUN(reruns_are_identical);
    RUN(config_file_layers_under_flags);
    RUN(bad_flags_name_the_flag);
    RUN(info_and_help);
    return anneal_test_summary();
}
