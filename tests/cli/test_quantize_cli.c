/* `anneal quantize` end to end through the built binary (ANNEAL_BIN): bad flags name the
 * flag; a preset quantized in every mode (static calibrated on token shards) is read by
 * `anneal eval --ckpt Q` and `--model Q` with a loss near the float model's (the lm head
 * int8, format_version 2, unless --head f32); `anneal
 * train --init Q` is refused with a message; the quantized directory is refused as an
 * --out that is not empty. */
#include "anneal/anneal.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmpdir[256], errpath[300];
static char out[1 << 16], err[1 << 14];

static int run(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>'%s'", getenv("ANNEAL_BIN"), args, errpath);
    FILE *f = popen(cmd, "r");
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

static bool make_tmpdir(void) {
    if (tmpdir[0]) return true;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_quant_cli_XXXXXX");
    if (!mkdtemp(tmpdir)) return false;
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", tmpdir);
    return true;
}

TEST(bad_flags_name_the_flag) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    REQUIRE(make_tmpdir());
    struct { const char *args, *expect; int rc; } cases[] = {
        {"quantize --bogus 1", "--bogus", 2},
        {"quantize --out q --mode dynamic", "--ckpt", 2},
        {"quantize --model tiny --mode dynamic", "--out", 2},
        {"quantize --model tiny --out q", "--mode", 2},
        {"quantize --model tiny --out q --mode int4", "--mode", 2},
        {"quantize --model tiny --out q --mode weight-only --group 48", "--group", 2},
        {"quantize --model tiny --out q --mode dynamic --group 32", "--group", 2},
        {"quantize --model tiny --out q --mode static", "--calib-data", 2},
        {"quantize --model tiny --out q --mode dynamic --calib-data d", "--calib-data", 2},
        {"quantize --model tiny --out q --mode static --calib-data d --calib-method median", "--calib-method", 2},
        {"quantize --model tiny --out q --mode static --calib-data d --percentile 0", "--percentile", 2},
        {"quantize --model tiny --out q --mode static --calib-data d --calib-batches 0", "--calib-batches", 2},
        {"quantize --ckpt /nonexistent/run --out q --mode dynamic", "--ckpt", 1},
        {"quantize --model tiny --out q --mode dynamic --head bf16", "--head", 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = run(cases[i].args);
        CHECK(rc == cases[i].rc, "'%s': exit %d, want %d (%s)", cases[i].args, rc, cases[i].rc, err);
        CHECK(strstr(err, cases[i].expect) != NULL, "'%s': message does not name %s: %s", cases[i].args,
              cases[i].expect, err);
    }
    CHECK(run("quantize --help") == 0 && strstr(out, "--calib-method"), "help");
}

/* A shard of n random ids below vocab. */
static bool write_shard(const char *path, int n, int vocab, uint64_t seed) {
    anneal_shard_writer *w = NULL;
    if (anneal_shard_writer_open(path, (uint32_t)vocab, 0, 0x1234, &w) != ANNEAL_OK) return false;
    uint64_t s = seed;
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        int32_t id = (int32_t)((s >> 33) % (uint64_t)vocab);
        if (anneal_shard_writer_append(w, &id, 1) != ANNEAL_OK) {
            anneal_shard_writer_abort(w);
            return false;
        }
    }
    return anneal_shard_writer_finish(w) == ANNEAL_OK;
}

static double eval_loss(const char *flag, const char *model, const char *data) {
    char args[2048];
    snprintf(args, sizeof args, "eval --%s '%s' --data '%s' --batch 4 --seq 32 --threads 2", flag, model, data);
    double loss = NAN, ppl;
    long long tokens;
    if (run(args) != 0 || sscanf(out, "loss %lf ppl %lf tokens %lld", &loss, &ppl, &tokens) != 3) {
        fprintf(stderr, "  eval %s: %s\n", model, err);
        return NAN;
    }
    return loss;
}

TEST(quantized_presets_evaluate_and_refuse_training) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    REQUIRE(make_tmpdir());
    char data[400], p[500], args[2048], q[450];
    snprintf(data, sizeof data, "%s/data", tmpdir);
    REQUIRE(mkdir(data, 0755) == 0);
    snprintf(p, sizeof p, "%s/train_000000.bin", data);
    REQUIRE(write_shard(p, 4000, 512, 5));
    snprintf(p, sizeof p, "%s/val_000000.bin", data);
    REQUIRE(write_shard(p, 2000, 512, 9));
    {   /* the manifest anneal prepare writes last (train/eval refuse a directory without one) */
        snprintf(p, sizeof p, "%s/prepare.json", data);
        FILE *mf = fopen(p, "w");
        REQUIRE(mf);
        fputs("{\"format\": \"anneal-prepare\", \"version\": 1}\n", mf);
        REQUIRE(fclose(mf) == 0);
    }
    /* the float model, saved as a model directory (the preset's seed-1337 weights) */
    char f32[450];
    snprintf(f32, sizeof f32, "%s/f32", tmpdir);
    snprintf(args, sizeof args, "export --model tiny --format hf --out '%s'", f32);
    REQUIRE(run(args) == 0);
    double want = eval_loss("model", f32, data);
    REQUIRE(isfinite(want));
    static const char *modes[][2] = {{"weight-only", ""}, {"weight-only", "--group 32"}, {"dynamic", ""},
                                     {"static", "--calib-method minmax"}, {"static", "--calib-method percentile --percentile 99.9"},
                                     {"dynamic", "--head f32"}, {"weight-only", "--head f32"}};
    for (int i = 0; i < 7; i++) {
        snprintf(q, sizeof q, "%s/q%d", tmpdir, i);
        bool st = !strcmp(modes[i][0], "static");
        snprintf(args, sizeof args, "quantize --model '%s' --out '%s' --mode %s %s %s%s%s --batch 4 --seq 32 --calib-batches 3",
                 f32, q, modes[i][0], modes[i][1], st ? "--calib-data '" : "", st ? data : "", st ? "'" : "");
        int rc = run(args);
        CHECK(rc == 0, "%s: exit %d: %s", args, rc, err);
        if (rc) continue;
        double a = eval_loss("ckpt", q, data), b = eval_loss("model", q, data);
        printf("  %s %s: loss %.5f (f32 %.5f)\n", modes[i][0], modes[i][1], a, want);
        CHECK(a == b, "--ckpt %.9g vs --model %.9g", a, b);
        /* random weights: the loss is ~ln(512); int8 moves it by far less than 1% */
        CHECK(fabs(a - want) < 0.01 * want, "%s: loss %.6g vs f32 %.6g", modes[i][0], a, want);
        /* the lm head: int8 (format_version 2) unless --head f32 (version 1) */
        snprintf(p, sizeof p, "%s/config.json", q);
        FILE *cf = fopen(p, "r");
        size_t n = cf ? fread(out, 1, sizeof out - 1, cf) : 0;
        out[n] = '\0';
        if (cf) fclose(cf);
        bool f32_head = strstr(modes[i][1], "--head f32") != NULL;
        CHECK(strstr(out, f32_head ? "\"format_version\":\t1" : "\"format_version\":\t2") &&
                  (strstr(out, "\"lm_head\":") != NULL) == !f32_head,
              "%s %s: config.json's version / lm_head", modes[i][0], modes[i][1]);
    }
    /* training from a quantized directory is refused, naming why */
    snprintf(q, sizeof q, "%s/q2", tmpdir);
    snprintf(args, sizeof args, "train --init '%s' --synthetic --steps 1 --out '%s/run'", q, tmpdir);
    int rc = run(args);
    CHECK(rc == 2 && strstr(err, "cannot be trained"), "train --init: exit %d: %s", rc, err);
    /* a non-empty --out is refused */
    snprintf(args, sizeof args, "quantize --model tiny --out '%s' --mode dynamic", q);
    rc = run(args);
    CHECK(rc == 1 && strstr(err, "not empty"), "--out over a model: exit %d: %s", rc, err);
    /* quantizing a quantized model is refused */
    snprintf(args, sizeof args, "quantize --model '%s' --out '%s/again' --mode dynamic", q, tmpdir);
    rc = run(args);
    CHECK(rc == 1 && strstr(err, "quantized already"), "twice: exit %d: %s", rc, err);
    snprintf(args, sizeof args, "export --model '%s' --format hf --out '%s/hf'", q, tmpdir);
    rc = run(args);
    CHECK(rc != 0 && strstr(err, "int8"), "export: exit %d: %s", rc, err);
}

int main(void) {
    RUN(bad_flags_name_the_flag);
    RUN(quantized_presets_evaluate_and_refuse_training);
    if (tmpdir[0]) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    }
    return anneal_test_summary();
}
