/* Faults a training run meets, through the binary: missing or corrupt data, a
 * corrupt --init file, a corrupt or incompatible checkpoint, an unwritable --out, a
 * full disk while checkpointing (RLIMIT_FSIZE), non-finite losses (the
 * ANNEAL_TEST_INJECT_NAN hook), and SIGINT/SIGTERM: each ends with a clear message
 * and the right exit code, and leaves every complete checkpoint usable. */
#include "test.h"
#include <dirent.h>
#include "train/train_util.h"

static char args[4096], out[600];

/* Milliseconds on the monotonic clock. */
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}
static const char *dir, *data;
static const char *tiny = "train --model tiny --batch 4 --seq 32 --lr 3e-3 --threads 2 --peak-gflops 100 "
                          "--eval-batches 2";

/* Runs "tiny-args extra", returns the exit code; output in `out`. */
static int run_tiny(const char *extra, long fsize_limit) {
    snprintf(args, sizeof args, "%s %s", tiny, extra);
    return tu_run_anneal(args, out, fsize_limit);
}

#define OUTPUT tu_slurp(out)

TEST(missing_or_corrupt_data) {
    char extra[1400];
    snprintf(extra, sizeof extra, "--steps 2 --data %s/nope --out %s/r1", dir, dir);
    int rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "--data") && strstr(OUTPUT, "/nope") && strstr(OUTPUT, "no such directory"),
          "exit %d: %s", rc, OUTPUT);
    /* nothing is left behind by a run refused at setup */
    char p[800];
    snprintf(p, sizeof p, "%s/r1", dir);
    CHECK_TRUE(access(p, F_OK) != 0);
    /* a directory without train shards */
    snprintf(extra, sizeof extra, "--steps 2 --data %s --out %s/r1", dir, dir);
    rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "train_*.bin"), "exit %d: %s", rc, OUTPUT);
    /* a corrupt shard: one token byte changed */
    char bad[600], cmd[2400];
    snprintf(bad, sizeof bad, "%s/baddata", dir);
    snprintf(cmd, sizeof cmd, "cp -r %s %s", data, bad);
    REQUIRE(system(cmd) == 0);
    snprintf(p, sizeof p, "%s/train_000000.bin", bad);
    FILE *f = fopen(p, "r+b");
    REQUIRE(f);
    fseek(f, 1000, SEEK_SET);
    int c = fgetc(f);
    fseek(f, 1000, SEEK_SET);
    fputc(c ^ 0x01, f);
    fclose(f);
    snprintf(extra, sizeof extra, "--steps 2 --data %s --out %s/r1", bad, dir);
    rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "train_000000.bin") && strstr(OUTPUT, "checksum"), "exit %d: %s", rc, OUTPUT);
    /* a truncated shard */
    REQUIRE(truncate(p, 500) == 0);
    rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "train_000000.bin"), "exit %d: %s", rc, OUTPUT);
}

TEST(corrupt_init_file) {
    char p[700], extra[1600];
    snprintf(p, sizeof p, "%s/garbage.safetensors", dir);
    FILE *f = fopen(p, "wb");
    REQUIRE(f);
    fputs("this is not a safetensors file at all, not even close", f);
    fclose(f);
    snprintf(extra, sizeof extra, "--steps 2 --data %s --init %s --out %s/r2", data, p, dir);
    int rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "--init") && strstr(OUTPUT, "garbage.safetensors"), "exit %d: %s", rc, OUTPUT);
    snprintf(extra, sizeof extra, "--steps 2 --data %s --init %s/missing.safetensors --out %s/r2", data, dir, dir);
    rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "missing.safetensors"), "exit %d: %s", rc, OUTPUT);
}

TEST(checkpoint_faults) {
    char extra[1600], run[700], p[800];
    snprintf(run, sizeof run, "%s/r3", dir);
    snprintf(extra, sizeof extra, "--steps 4 --ckpt-every 2 --data %s --out %s", data, run);
    REQUIRE(run_tiny(extra, 0) == 0);
    /* the model of a checkpoint starts a new run through --init (HF names and layout) */
    snprintf(extra, sizeof extra, "--steps 2 --data %s --init %s/ckpt_00000004/model.safetensors --out %s/r3init", data,
             run, dir);
    int rc = run_tiny(extra, 0);
    CHECK(rc == 0 && strstr(OUTPUT, "weights from --init"), "exit %d: %s", rc, OUTPUT);
    /* a shape-changing resume is refused naming both shapes */
    char cfgp[700];
    snprintf(cfgp, sizeof cfgp, "%s/wide.json", dir);
    FILE *f = fopen(cfgp, "w");
    REQUIRE(f);
    fprintf(f, "{\"model_type\": \"gpt2\", \"n_layer\": 2, \"n_head\": 4, \"n_embd\": 128, \"vocab_size\": 512, "
               "\"n_positions\": 256}\n");
    fclose(f);
    snprintf(args, sizeof args, "train --resume %s --config %s --steps 6", run, cfgp);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 2 && strstr(OUTPUT, "cannot change the model's shape") && strstr(OUTPUT, "n_embd 64") &&
              strstr(OUTPUT, "n_embd 128"),
          "exit %d: %s", rc, OUTPUT);
    /* a full disk while checkpointing: the write fails, the run says so and exits 1,
     * and the previous checkpoint stays the latest */
    snprintf(args, sizeof args, "train --resume %s --steps 6", run);
    rc = tu_run_anneal(args, out, 200000);
    CHECK(rc == 1 && strstr(OUTPUT, "checkpoint") && strstr(OUTPUT, "File too large"), "exit %d: %s", rc, OUTPUT);
    char ck[1024];
    CHECK_TRUE(anneal_checkpoint_resolve(run, ck, sizeof ck) == ANNEAL_OK && strstr(ck, "ckpt_00000004"));
    rc = tu_run_anneal(args, out, 0); /* with room again it resumes and finishes */
    CHECK(rc == 0 && strstr(OUTPUT, "step     6/6"), "exit %d: %s", rc, OUTPUT);
    /* a corrupt checkpoint (model bytes changed): resume refuses with the file named */
    snprintf(p, sizeof p, "%s/ckpt_00000006/model.safetensors", run);
    f = fopen(p, "r+b");
    REQUIRE(f);
    fseek(f, -100, SEEK_END);
    fputc(0x5a, f);
    fputc(0xa5, f);
    fclose(f);
    snprintf(args, sizeof args, "train --resume %s --steps 8", run);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "--resume") && strstr(OUTPUT, "model.safetensors"), "exit %d: %s", rc, OUTPUT);
    /* an older checkpoint still resumes */
    snprintf(args, sizeof args, "train --resume %s/ckpt_00000004 --steps 5", run);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(OUTPUT, "step     5/5"), "exit %d: %s", rc, OUTPUT);
    /* a torn state.json */
    snprintf(p, sizeof p, "%s/ckpt_00000005/state.json", run);
    REQUIRE(truncate(p, 20) == 0);
    snprintf(args, sizeof args, "train --resume %s --steps 8", run);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc != 0 && strstr(OUTPUT, "state.json"), "exit %d: %s", rc, OUTPUT);
}

TEST(unwritable_out) {
    char extra[1600];
    /* a path below a regular file cannot be created, even by root */
    snprintf(extra, sizeof extra, "--steps 2 --data %s --out %s/data/train_000000.bin/run", data, dir);
    int rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "--out") && strstr(OUTPUT, "cannot create"), "exit %d: %s", rc, OUTPUT);
}

TEST(non_finite_losses) {
    char extra[1600];
    setenv("ANNEAL_TEST_INJECT_NAN", "2,3", 1);
    snprintf(extra, sizeof extra, "--steps 5 --data %s --out %s/r4", data, dir);
    int rc = run_tiny(extra, 0);
    CHECK(rc == 0 && strstr(OUTPUT, "step 3: loss nan") && strstr(OUTPUT, "update skipped (2 in a row") &&
              strstr(OUTPUT, "skipped steps 2"),
          "exit %d: %s", rc, OUTPUT);
    setenv("ANNEAL_TEST_INJECT_NAN", "2-100", 1);
    snprintf(extra, sizeof extra, "--steps 10 --max-bad-steps 4 --data %s --out %s/r5", data, dir);
    rc = run_tiny(extra, 0);
    CHECK(rc == 1 && strstr(OUTPUT, "4 non-finite steps in a row") && strstr(OUTPUT, "--max-bad-steps 4"),
          "exit %d: %s", rc, OUTPUT);
    unsetenv("ANNEAL_TEST_INJECT_NAN");
}

/* Starts a long run, waits for its first step record, sends sig; it must stop with a
 * checkpoint and exit 0, and a resume must finish. */
static void interrupt_with(int sig, const char *name) {
    char run[700], logp[800];
    snprintf(run, sizeof run, "%s/sig_%s", dir, name);
    snprintf(logp, sizeof logp, "%s/log.jsonl", run);
    snprintf(args, sizeof args, "%s --steps 100000 --ckpt-every 0 --data %s --out %s", tiny, data, run);
    char *argv[64];
    int n = 0;
    argv[n++] = getenv("ANNEAL_BIN");
    for (char *tok = strtok(args, " "); tok && n < 63; tok = strtok(NULL, " ")) argv[n++] = tok;
    argv[n] = NULL;
    pid_t pid = tu_spawn(argv, out, 0);
    REQUIRE(pid > 0);
    for (int i = 0; i < 3000 && tu_count_records(logp, "step") < 2; i++) tu_sleep_ms(5);
    kill(pid, sig);
    int rc = tu_wait(pid);
    CHECK(rc == 0 && strstr(OUTPUT, "interrupted by") && strstr(OUTPUT, name) && strstr(OUTPUT, "--resume"),
          "%s: exit %d: %s", name, rc, OUTPUT);
    char ck[1024];
    REQUIRE(anneal_checkpoint_resolve(run, ck, sizeof ck) == ANNEAL_OK);
    double l[64];
    int steps = tu_read_losses(logp, l, NULL, 64);
    CHECK(steps >= 2 && steps < 60, "%d steps before the signal", steps);
    char want[64];
    snprintf(want, sizeof want, "ckpt_%08d", steps);
    CHECK(strstr(ck, want) != NULL, "latest %s, last logged step %d", ck, steps);
    snprintf(args, sizeof args, "train --resume %s --steps %d", run, steps + 3);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(OUTPUT, "done:"), "resume after %s: exit %d: %s", name, rc, OUTPUT);
}

TEST(sigint_and_sigterm) {
    interrupt_with(SIGINT, "SIGINT");
    interrupt_with(SIGTERM, "SIGTERM");
}

/* Issue 16, defect 4: a disk that stays full only warned at each checkpoint, trained
 * to the end and exited 1 with no failure or summary record. Now every failed write
 * is a "checkpoint_failed" record, --max-ckpt-failures N (default 3) failures in a
 * row stop the run with an error naming the newest complete checkpoint, the log ends
 * with a summary record, and that checkpoint still resumes. */
TEST(checkpoint_failures_stop_the_run) {
    char extra[1600], run[700], logp[800];
    snprintf(run, sizeof run, "%s/full", dir);
    snprintf(logp, sizeof logp, "%s/log.jsonl", run);
    snprintf(extra, sizeof extra, "--steps 4 --ckpt-every 2 --data %s --out %s", data, run);
    REQUIRE(run_tiny(extra, 0) == 0);
    int before = tu_count_records(logp, "step");
    snprintf(args, sizeof args, "train --resume %s --steps 40 --ckpt-every 2", run);
    int rc = tu_run_anneal(args, out, 200000); /* files past 200 kB fail: a full disk */
    CHECK(rc == 1 && strstr(OUTPUT, "3 checkpoint writes in a row failed") && strstr(OUTPUT, "--max-ckpt-failures 3") &&
              strstr(OUTPUT, "ckpt_00000004"),
          "exit %d: %s", rc, OUTPUT);
    int steps = tu_count_records(logp, "step") - before;
    CHECK(steps > 0 && steps < 36, "%d steps after the resume", steps);
    CHECK(tu_count_records(logp, "checkpoint_failed") == 3, "%d checkpoint_failed records",
          tu_count_records(logp, "checkpoint_failed"));
    const char *log = tu_slurp(logp), *last = strrchr(log, '{');
    while (last && last > log && last[-1] != '\n') last--; /* the start of the last line */
    CHECK(last && strstr(last, "\"type\":\"summary\"") && strstr(last, "\"failed\":true"), "last record: %s",
          last ? last : "(none)");
    char ck[1024];
    CHECK_TRUE(anneal_checkpoint_resolve(run, ck, sizeof ck) == ANNEAL_OK && strstr(ck, "ckpt_00000004"));
    DIR *d = opendir(run); /* nothing half-written is left */
    REQUIRE(d);
    struct dirent *e;
    while ((e = readdir(d)))
        CHECK(strncmp(e->d_name, ".tmp", 4) != 0 && !strstr(e->d_name, ".tmp."), "left behind: %s", e->d_name);
    closedir(d);
    /* --max-ckpt-failures 1: the first failure stops it */
    snprintf(args, sizeof args, "train --resume %s --steps 40 --ckpt-every 2 --max-ckpt-failures 1", run);
    rc = tu_run_anneal(args, out, 200000);
    CHECK(rc == 1 && strstr(OUTPUT, "1 checkpoint write in a row failed"), "exit %d: %s", rc, OUTPUT);
    /* with room again, the kept checkpoint resumes and the run finishes */
    snprintf(args, sizeof args, "train --resume %s --steps 6", run);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(OUTPUT, "step     6/6"), "exit %d: %s", rc, OUTPUT);
}

/* Waits at most `seconds` for pid: its exit code (tu_wait's), or -1 after killing it
 * with SIGKILL when it is still running then. *secs: how long it took. */
static int wait_bounded(pid_t pid, double seconds, double *secs) {
    double t0 = now_ms();
    for (;;) {
        int st = 0;
        pid_t w = waitpid(pid, &st, WNOHANG);
        *secs = (now_ms() - t0) / 1e3;
        if (w == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
        if (*secs > seconds) {
            kill(pid, SIGKILL);
            tu_wait(pid);
            return -1;
        }
        tu_sleep_ms(10);
    }
}

/* Spawns anneal with the space-separated args (no quoting), output to `out`. */
static pid_t spawn_anneal(const char *fmt_args) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s", fmt_args);
    char *argv[64];
    int n = 0;
    argv[n++] = getenv("ANNEAL_BIN");
    for (char *tok = strtok(buf, " "); tok && n < 63; tok = strtok(NULL, " ")) argv[n++] = tok;
    argv[n] = NULL;
    return tu_spawn(argv, out, 0);
}

/* The bound on how long a stop may take after the signal: far below the 17 s (and
 * the minutes) of issue 16's reproductions, generous for a loaded machine and ASan. */
#define STOP_BOUND_S 8.0

/* Issue 16, defect 2: `timeout 2 anneal train --synthetic --model tiny --steps 3
 * --accum 3000` exited after 17 s (the signal waited for the step's 3000
 * micro-batches). Now the step is abandoned between micro-batches: with no step done
 * there is nothing to save (exit 128 + SIGTERM); with a step done it is checkpointed
 * (exit 0) and the run resumes from it. */
TEST(stop_signal_between_micro_batches) {
    char run[700], logp[800], a[2000];
    snprintf(run, sizeof run, "%s/accum", dir);
    snprintf(logp, sizeof logp, "%s/log.jsonl", run);
    snprintf(a, sizeof a, "train --synthetic --model tiny --steps 3 --accum 3000 --threads 2 --peak-gflops 100 --out %s", run);
    pid_t pid = spawn_anneal(a);
    REQUIRE(pid > 0);
    for (int i = 0; i < 12000 && tu_count_records(logp, "start") < 1; i++) tu_sleep_ms(5);
    tu_sleep_ms(300); /* inside the first step's micro-batches */
    kill(pid, SIGTERM);
    double secs = 0;
    int rc = wait_bounded(pid, STOP_BOUND_S, &secs);
    printf("    SIGTERM during --accum 3000, no step done: exit %d after %.2f s\n", rc, secs);
    CHECK(rc == 128 + SIGTERM && strstr(OUTPUT, "interrupted by SIGTERM before the first step ended"),
          "exit %d after %.1f s: %s", rc, secs, OUTPUT);
    char ck[1024];
    CHECK_TRUE(anneal_checkpoint_resolve(run, ck, sizeof ck) != ANNEAL_OK);
    anneal_clear_error();
    /* a step done: the signal lands in a later step's micro-batches, the checkpoint is of the last whole step */
    snprintf(run, sizeof run, "%s/accum2", dir);
    snprintf(logp, sizeof logp, "%s/log.jsonl", run);
    snprintf(a, sizeof a, "train --synthetic --model tiny --steps 1000 --accum 60 --threads 2 --peak-gflops 100 "
                          "--ckpt-every 0 --out %s", run);
    pid = spawn_anneal(a);
    REQUIRE(pid > 0);
    for (int i = 0; i < 24000 && tu_count_records(logp, "step") < 1; i++) tu_sleep_ms(5);
    kill(pid, SIGTERM);
    rc = wait_bounded(pid, STOP_BOUND_S, &secs);
    printf("    SIGTERM during --accum 60 after a step: exit %d after %.2f s\n", rc, secs);
    CHECK(rc == 0 && strstr(OUTPUT, "interrupted by SIGTERM"), "exit %d after %.1f s: %s", rc, secs, OUTPUT);
    int steps = tu_count_records(logp, "step");
    char want[64];
    snprintf(want, sizeof want, "ckpt_%08d", steps);
    CHECK(steps >= 1 && anneal_checkpoint_resolve(run, ck, sizeof ck) == ANNEAL_OK && strstr(ck, want),
          "%d steps logged, latest %s", steps, ck);
    anneal_clear_error();
}

/* Issue 16, defect 2: a config of 65,536 layers under `timeout 120` was still
 * allocating 10 minutes later. The stop request is checked while the parameters are
 * created and initialised: the run ends at once, nothing written, exit 128 + SIGTERM.
 * A second signal exits at once with 128 + its number. */
TEST(stop_signal_during_setup) {
    char cfgp[700], run[700], a[2000];
    snprintf(cfgp, sizeof cfgp, "%s/deep.json", dir);
    FILE *f = fopen(cfgp, "w");
    REQUIRE(f);
    fprintf(f, "{\"model_type\": \"gpt2\", \"n_layer\": 65536, \"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 512, "
               "\"n_positions\": 64}\n");
    fclose(f);
    snprintf(run, sizeof run, "%s/deep", dir);
    snprintf(a, sizeof a, "train --synthetic --config %s --steps 3 --seq 32 --batch 2 --threads 2 --out %s", cfgp, run);
    pid_t pid = spawn_anneal(a);
    REQUIRE(pid > 0);
    tu_sleep_ms(1500); /* building the model */
    kill(pid, SIGTERM);
    double secs = 0;
    int rc = wait_bounded(pid, STOP_BOUND_S, &secs);
    printf("    SIGTERM while building a 65536-layer model: exit %d after %.2f s\n", rc, secs);
    CHECK(rc == 128 + SIGTERM && strstr(OUTPUT, "interrupted by SIGTERM while"), "exit %d after %.1f s: %s", rc, secs,
          OUTPUT);
    CHECK_TRUE(access(run, F_OK) != 0); /* refused in setup: nothing left behind */
    /* two signals in a row: the second ends the process at once */
    pid = spawn_anneal(a);
    REQUIRE(pid > 0);
    tu_sleep_ms(1500);
    kill(pid, SIGINT);
    kill(pid, SIGINT);
    rc = wait_bounded(pid, STOP_BOUND_S, &secs);
    CHECK(rc == 128 + SIGINT, "exit %d after %.1f s: %s", rc, secs, OUTPUT);
}

/* The run directory and its data for every test: a failure when the library cannot
 * make it, a promised skip without ANNEAL_BIN or text. */
TEST(setup_data) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    dir = tu_mkdtemp("faults");
    REQUIRE(dir);
    char why[1024];
    data = tu_make_data(dir, 512, why, sizeof why);
    if (!data && !anneal_test_failures) SKIP_PROMISED("%s", why);
}

int main(void) {
    RUN(setup_data);
    if (!data) {
        tu_rmrf(dir);
        return anneal_test_summary();
    }
    snprintf(out, sizeof out, "%s/out.txt", dir);
    RUN(missing_or_corrupt_data);
    RUN(corrupt_init_file);
    RUN(checkpoint_faults);
    RUN(unwritable_out);
    RUN(non_finite_losses);
    RUN(sigint_and_sigterm);
    RUN(checkpoint_failures_stop_the_run);
    RUN(stop_signal_between_micro_batches);
    RUN(stop_signal_during_setup);
    tu_rmrf(dir);
    return anneal_test_summary();
}
