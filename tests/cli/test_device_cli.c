/* --device through the built binary (ANNEAL_BIN, set by ctest): train, eval, generate
 * and serve read it with the one parser; a name that is not a device, or a GPU this
 * machine or build cannot give (cuda:99; cuda without a GPU), is a usage error (exit 2)
 * naming the flag and saying why (not built, no GPU, no such GPU); --config-file's
 * "device" reads the same; `anneal train --help` documents it; --device cpu trains and
 * the start record names the device. */
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

static char buf[1 << 16], args[4096];

/* True when the message says why a GPU cannot be had: not built, or no (such) GPU. */
static bool says_why(const char *msg) {
    return strstr(msg, "no CUDA backend") || strstr(msg, "no usable GPU") || strstr(msg, "no GPU") ||
           strstr(msg, "no such GPU");
}

TEST(bad_devices_are_usage_errors) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *dir = tu_mkdtemp("devcli");
    REQUIRE(dir);
    snprintf(args, sizeof args, "train --synthetic --steps 1 --device bogus --out %s/a", dir);
    int rc = run(args, buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "--device") && strstr(buf, "bogus") && strstr(buf, "cpu, cuda, cuda:N"), "exit %d: %s",
          rc, buf);
    snprintf(args, sizeof args, "train --synthetic --steps 1 --device cuda:99 --out %s/b", dir);
    rc = run(args, buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "--device") && strstr(buf, "cuda:99") && says_why(buf), "exit %d: %s", rc, buf);
    snprintf(args, sizeof args, "train --synthetic --steps 1 --device cuda:x --out %s/c", dir);
    rc = run(args, buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "--device cuda:x"), "exit %d: %s", rc, buf);
    /* a refused run leaves nothing behind */
    char p[600];
    snprintf(p, sizeof p, "%s/b", dir);
    CHECK(access(p, F_OK) != 0, "%s was created", p);
    /* the config file's key */
    snprintf(p, sizeof p, "%s/cfg.json", dir);
    FILE *f = fopen(p, "w");
    REQUIRE(f);
    fputs("{\"synthetic\": true, \"steps\": 1, \"device\": \"nope\"}\n", f);
    fclose(f);
    snprintf(args, sizeof args, "train --config-file %s --out %s/d", p, dir);
    rc = run(args, buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "cfg.json") && strstr(buf, "--device") && strstr(buf, "nope"), "exit %d: %s", rc,
          buf);
    /* eval, generate, serve */
    snprintf(args, sizeof args, "eval --model tiny --data %s --device cuda:99", dir);
    rc = run(args, buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "anneal eval: --device") && says_why(buf), "exit %d: %s", rc, buf);
    rc = run("generate --model tiny --device bogus --max-tokens 1", buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "anneal generate: --device") && strstr(buf, "bogus"), "exit %d: %s", rc, buf);
    rc = run("generate --model tiny --device cuda:99 --max-tokens 1", buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "anneal generate: --device") && says_why(buf), "exit %d: %s", rc, buf);
    rc = run("serve --model tiny --device cuda --port 0", buf, sizeof buf);
    CHECK(rc == 2 && strstr(buf, "anneal serve: --device"), "exit %d: %s", rc, buf);
    tu_rmrf(dir);
}

TEST(help_documents_and_cpu_runs) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    int rc = run("train --help", buf, sizeof buf);
    CHECK(rc == 0 && strstr(buf, "--device S") && strstr(buf, "cuda:N"), "exit %d: %s", rc, buf);
    rc = run("generate --help", buf, sizeof buf);
    CHECK(rc == 0 && strstr(buf, "--device"), "exit %d: %s", rc, buf);
    rc = run("eval --help", buf, sizeof buf);
    CHECK(rc == 0 && strstr(buf, "--device"), "exit %d: %s", rc, buf);
    const char *dir = tu_mkdtemp("devcli_cpu");
    REQUIRE(dir);
    snprintf(args, sizeof args,
             "train --synthetic --steps 2 --batch 2 --seq 16 --threads 2 --peak-gflops 100 --eval-batches 1 "
             "--device cpu --out %s/run", dir);
    rc = run(args, buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    char p[600];
    snprintf(p, sizeof p, "%s/run/log.jsonl", dir);
    const char *log = tu_slurp(p);
    CHECK(strstr(log, "\"device\":\"cpu\""), "%s", log);
    /* --device is not a setting the checkpoint keeps */
    snprintf(p, sizeof p, "%s/run/ckpt_00000002/state.json", dir);
    const char *state = tu_slurp(p);
    CHECK(state[0] && !strstr(state, "\"device\""), "%s", state);
    tu_rmrf(dir);
}

int main(void) {
    RUN(bad_devices_are_usage_errors);
    RUN(help_documents_and_cpu_runs);
    return anneal_test_summary();
}
