/* `anneal train` and `anneal info` end to end through the built binary (ANNEAL_BIN,
 * set by ctest): the synthetic run's loss falls, runs are reproducible, and bad flags
 * are errors that name the flag. */
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Runs "$ANNEAL_BIN args" capturing stdout+stderr into out; returns the exit code. */
static int run(const char *args, char *out, size_t cap) {
    const char *bin = getenv("ANNEAL_BIN");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", bin, args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The loss printed on the "done:" line: "loss A -> B". */
static bool final_losses(const char *out, double *first, double *last) {
    const char *d = strstr(out, "done: loss ");
    return d && sscanf(d, "done: loss %lf -> %lf", first, last) == 2;
}

static char buf[1 << 16], buf2[1 << 16];

TEST(synthetic_training_loss_falls) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    int rc = run("train --model tiny --steps 40 --batch 8 --seq 32 --lr 1e-2 --warmup 5 --threads 2", buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    double a, b;
    REQUIRE(final_losses(buf, &a, &b));
    /* ln(512) = 6.24 at init; 40 steps must get well below it (the floor is ln 4 = 1.39) */
    CHECK(a > 6.0 && a < 6.5, "initial loss %g", a);
    CHECK(b < 4.5, "loss after 40 steps %g", b);
}

TEST(reruns_are_identical) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    const char *args = "train --model tiny --steps 6 --batch 4 --seq 16 --dropout 0.1 --threads 2";
    REQUIRE(run(args, buf, sizeof buf) == 0);
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
}

TEST(bad_flags_name_the_flag) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    struct { const char *args, *expect; int rc; } cases[] = {
        {"train --stpes 3", "--stpes", 2},
        {"train --steps abc", "--steps", 2},
        {"train --steps 0", "--steps", 2},
        {"train --lr -1", "--lr", 2},
        {"train --model gpt5", "--model", 2},
        {"train --schedule zigzag", "--schedule", 2},
        {"train --seq 100000", "--seq", 2},
        {"train --dropout 1.5", "--dropout", 2},
        {"train --steps", "--steps", 2},
        {"frobnicate", "frobnicate", 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = run(cases[i].args, buf, sizeof buf);
        CHECK(rc == cases[i].rc, "'%s': exit %d, want %d", cases[i].args, rc, cases[i].rc);
        CHECK(strstr(buf, cases[i].expect) != NULL, "'%s': message does not name %s: %s", cases[i].args,
              cases[i].expect, buf);
    }
}

TEST(info_and_help) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    CHECK_TRUE(run("info", buf, sizeof buf) == 0 && strstr(buf, "anneal ") && strstr(buf, "threads"));
    CHECK_TRUE(run("train --help", buf, sizeof buf) == 0 && strstr(buf, "--recompute"));
    CHECK_TRUE(run("--help", buf, sizeof buf) == 0 && strstr(buf, "train"));
}

int main(void) {
    RUN(synthetic_training_loss_falls);
    RUN(reruns_are_identical);
    RUN(bad_flags_name_the_flag);
    RUN(info_and_help);
    return anneal_test_summary();
}
