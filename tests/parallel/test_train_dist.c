/* `mpirun -np N anneal train` end to end, through the CLI: data-parallel and ZeRO
 * training give the results of one process (synthetic tokens and real shards, with
 * evaluation), checkpoints move between world sizes (2 -> 1 and 1 -> 2, re-sharding the
 * ZeRO optimizer state), a stop signal to one rank stops every rank with a checkpoint,
 * and broken jobs (a rank killed, ranks started with other settings or another build,
 * a rank without its data, a batch that does not split) end with clear messages
 * instead of hanging. A last test runs the two ranks in two network namespaces joined
 * by a veth pair, over TCP, like two hosts: data parallelism and each layout of the
 * parallel stack (--pp 2, --tp 2, --zero 3, and --deterministic, bit-identical to one
 * process).
 *
 * Every process is started in its own process group with a time limit, and killed
 * (the whole group) when it runs over: a hang fails the test, never the suite.
 *
 * Tolerances. 2 ranks x batch B/2 and 1 rank x batch B compute the same sums in a
 * different order: the cross-entropy mean of each half, the mean of the two halves'
 * gradients and losses (an MPI reduction), the gradient norm over shards. A float sum
 * in another order differs by a few ulps (~1e-7 relative); AdamW then divides by
 * sqrt(v) + eps, which can grow a difference where v is tiny, so 20 steps of training
 * drift slightly apart: where a gradient element is a near-cancelling sum, its few-ulp
 * absolute error is a large relative one, and AdamW's normalised step turns it into a
 * parameter change of a fraction of lr. Measured (tiny model, lr 3e-3, 10-20 steps):
 * losses within 8e-8 relative; parameters within 3e-6 relative (L2 norm of the
 * difference over the norm of the parameters) and 2.1e-5 absolute at worst, single
 * elements. The checks: LOSS_RTOL = 1e-6 on every step's loss, PARAM_L2_RTOL = 1e-5 on
 * the whole parameter vector and PARAM_ATOL = 1e-4 (1/30 of one step's lr) on any one
 * element. A wrong batch split, a missing gradient bucket, a wrong ZeRO shard or a lost
 * optimizer state change losses in the 2nd-4th digit and parameters by ~lr. ZeRO-1/2
 * and DDP happen to agree bit for bit; they are held to the same tolerances.
 *
 * Needs mpirun (Debian openmpi-bin): skipped with a message without it. Under ASan
 * (anneal_test_sanitized) only the DDP-vs-single, ZeRO, elastic and bad-launch tests
 * run, on 8 steps instead of 20: each sanitized rank is ~10x slower. */
#include "test.h"
#include "parallel/train_runs.h"
#include "train/train_util.h"

#include <dirent.h>
#include <sched.h>
#include <errno.h>

#define LOSS_RTOL 1e-6
#define PARAM_L2_RTOL 1e-5
#define PARAM_ATOL 1e-4
#define RUN_TIMEOUT_S 90.0

static const char *bin;
static char work[256];  /* scratch directory of this test run */
static int steps = 20;  /* steps of the compared runs (fewer under ASan) */
static char mpi[512];   /* "mpirun -np 2 ..." prefix */
static char mpi_env[256]; /* its options for the ranks' environment */
static char common[1024];

static void dump(const char *out) { printf("---- %s ----\n%s----\n", out, tu_slurp(out)); }

/* path = work/name. */
static const char *wpath(const char *name) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", work, name);
    return buf[k];
}

/* One run: `launcher train <common> <extra> --out work/<run>`; returns the exit code. */
static int train(const char *launcher, const char *run, const char *extra) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s %s --out %s", launcher, bin, common, extra, wpath(run));
    char out[600];
    snprintf(out, sizeof out, "%s.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) dump(out);
    return rc;
}

/* A resume of work/<run>. */
static int resume(const char *launcher, const char *run, const char *extra) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec %s %s train --resume %s %s", launcher, bin, wpath(run), extra);
    char out[600];
    snprintf(out, sizeof out, "%s.resume.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) dump(out);
    return rc;
}

/* Losses of a run's log: the number of steps seen. */
static int losses_of(const char *run, double *l) {
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run));
    for (int i = 0; i < 64; i++) l[i] = NAN;
    return tu_read_losses(p, l, NULL, 64);
}

/* Largest relative difference of steps [from, to) of two loss curves. */
static double loss_rel_diff(const double *a, const double *b, int from, int to) {
    double worst = 0;
    for (int i = from; i < to; i++) {
        double d = fabs(a[i] - b[i]) / fabs(b[i]);
        if (!(d <= worst)) worst = d; /* NaN wins */
    }
    return worst;
}

/* The newest checkpoints of two runs hold the same parameters within PARAM_L2_RTOL
 * (as a vector) and PARAM_ATOL (each element). */
static void check_same_params(const char *run, const char *ref) {
    int64_t na, nb;
    float *a = tr_ckpt_params(wpath(run), &na), *b = tr_ckpt_params(wpath(ref), &nb);
    CHECK(a && b && na == nb, "parameters of %s (%lld) and %s (%lld): %s", run, (long long)na, ref, (long long)nb,
          anneal_last_error());
    if (a && b && na == nb) {
        double worst = 0, dd = 0, bb = 0;
        for (int64_t i = 0; i < na; i++) {
            double d = (double)a[i] - b[i];
            worst = fmax(worst, fabs(d));
            dd += d * d;
            bb += (double)b[i] * b[i];
        }
        double rel = sqrt(dd / bb);
        printf("    %s vs %s: parameters differ by %.3g relative (L2; tolerance %.0e), %.3g at most (tolerance %.0e)\n",
               run, ref, rel, PARAM_L2_RTOL, worst, PARAM_ATOL);
        CHECK(rel <= PARAM_L2_RTOL, "parameters of %s and %s differ by %.3g (relative L2)", run, ref, rel);
        CHECK_ALLCLOSE(a, b, na, PARAM_ATOL, 0.0);
    }
    anneal_clear_error();
    free(a);
    free(b);
}

/* The losses of steps [from, to) of run match ref's within LOSS_RTOL. */
static void check_same_losses(const char *run, const char *ref, int from, int to) {
    double a[64], b[64];
    int ha = losses_of(run, a), hb = losses_of(ref, b);
    CHECK(ha >= to && hb >= to, "%s has %d steps, %s %d: want %d", run, ha, ref, hb, to);
    double d = loss_rel_diff(a, b, from, to);
    printf("    %s vs %s: steps %d-%d, max relative loss difference %.3g (tolerance %.1g); loss %.5f -> %.5f\n", run,
           ref, from + 1, to, d, LOSS_RTOL, b[from], b[to - 1]);
    CHECK(d <= LOSS_RTOL, "losses of %s and %s differ by %.3g relative", run, ref, d);
}

/* Two runs' logged losses and newest checkpoints' parameters are the same bits. */
static void check_bit_identical(const char *run, const char *ref) {
    double a[64], b[64];
    int ha = losses_of(run, a), hb = losses_of(ref, b);
    CHECK(ha >= steps && ha == hb, "%s has %d steps, %s %d: want %d", run, ha, ref, hb, steps);
    int same = 0;
    for (int i = 0; i < ha && i < hb; i++) same += memcmp(&a[i], &b[i], sizeof a[i]) == 0;
    int64_t na, nb;
    float *pa = tr_ckpt_params(wpath(run), &na), *pb = tr_ckpt_params(wpath(ref), &nb);
    bool params = pa && pb && na == nb && memcmp(pa, pb, (size_t)na * sizeof *pa) == 0;
    printf("    %s vs %s: %d of %d losses and %s parameters bit-identical\n", run, ref, same, ha,
           params ? "all" : "NOT all");
    CHECK(same == ha, "%s and %s: only %d of %d losses are bit-identical", run, ref, same, ha);
    CHECK(params, "parameters of %s and %s are not bit-identical", run, ref);
    free(pa);
    free(pb);
}

#define NEED_MPI() do { if (!tr_have_mpirun()) SKIP_PROMISED("mpirun not found (bootstrap installs openmpi-bin)"); } while (0)

/* 2 ranks x B/2 = 1 rank x B: losses and parameters (the reference runs the others
 * compare with). */
TEST(ddp_matches_single_process) {
    NEED_MPI();
    REQUIRE(train("", "single", "") == 0);
    REQUIRE(train(mpi, "ddp", "") == 0);
    check_same_losses("ddp", "single", 0, steps);
    check_same_params("ddp", "single");
    /* rank 0 alone wrote the run: one log, one line per step, a start line with the layout */
    const char *o = tu_slurp(wpath("ddp.out"));
    CHECK(strstr(o, "distributed: 2 ranks (mpi), ZeRO stage 0") != NULL, "start line: %s", o);
    CHECK(strstr(o, "per-rank batch 4 (global 8)") != NULL, "start line: %s", o);
    CHECK(strstr(o, "memory at start, rank 1:") != NULL, "memory report: %s", o);
    CHECK(tu_count_records(wpath("ddp/log.jsonl"), "step") == steps, "one step record per step");
}

/* Without --threads and OMP_NUM_THREADS, unbound ranks share the host's CPUs: each of
 * 2 ranks on this host runs max(1, cpus / 2) threads, not all of them. */
TEST(default_threads_share_the_host) {
    NEED_MPI();
    cpu_set_t mine;
    int online = (int)sysconf(_SC_NPROCESSORS_ONLN), allowed = online;
    if (sched_getaffinity(0, sizeof mine, &mine) == 0) allowed = CPU_COUNT(&mine);
    int want = allowed >= online ? (allowed / 2 > 0 ? allowed / 2 : 1) : allowed;
    char cmd[4096], opts[1024];
    /* the common flags minus --threads 1 */
    snprintf(opts, sizeof opts, "--synthetic --model tiny --batch 8 --seq 32 --steps 1 --dropout 0 --eval-batches 0 "
             "--ckpt-every 0 --peak-gflops 10 --log-every 100");
    snprintf(cmd, sizeof cmd,
             "exec env -u OMP_NUM_THREADS mpirun -np 2 --allow-run-as-root --oversubscribe --bind-to none "
             "--mca btl_vader_single_copy_mechanism none%s %s train %s --out %s",
             anneal_test_sanitized() ? " -x ASAN_OPTIONS=detect_leaks=0" : "", bin, opts, wpath("threads"));
    pid_t pid = tr_sh_start(cmd, wpath("threads.out"));
    int rc = tr_sh_wait(pid, RUN_TIMEOUT_S, NULL);
    const char *o = tu_slurp(wpath("threads.out"));
    CHECK(rc == 0, "exit %d: %s", rc, o);
    char expect[64];
    snprintf(expect, sizeof expect, "%d thread%s per rank", want, want > 1 ? "s" : "");
    CHECK(o && strstr(o, expect) != NULL, "expected \"%s\" in the start line: %s", expect, o ? o : "");
}

/* ZeRO-1 and ZeRO-2 end with DDP's parameters; the optimizer state per rank halves. */
TEST(zero_matches_ddp) {
    NEED_MPI();
    REQUIRE(train(mpi, "zero1", "--zero 1") == 0);
    REQUIRE(train(mpi, "zero2", "--zero 2") == 0);
    check_same_params("zero1", "ddp");
    check_same_params("zero2", "ddp");
    check_same_losses("zero1", "ddp", 0, steps);
    check_same_losses("zero2", "ddp", 0, steps);
    /* memory records: optimizer state of a rank at ZeRO 1 is half of DDP's */
    const char *o0 = tu_slurp(wpath("ddp.out"));
    const char *p0 = strstr(o0, "memory at start, rank 0:");
    char a[256] = "", b[256] = "";
    if (p0) sscanf(p0, "%255[^\n]", a);
    const char *o1 = tu_slurp(wpath("zero1.out"));
    const char *p1 = strstr(o1, "memory at start, rank 0:");
    if (p1) sscanf(p1, "%255[^\n]", b);
    double s0 = NAN, s1 = NAN;
    const char *q0 = strstr(a, "optimizer state "), *q1 = strstr(b, "optimizer state ");
    if (q0) sscanf(q0, "optimizer state %lf", &s0);
    if (q1) sscanf(q1, "optimizer state %lf", &s1);
    printf("    optimizer state of rank 0: %.2f MiB (DDP), %.2f MiB (ZeRO-1)\n", s0, s1);
    CHECK(s1 < 0.6 * s0, "ZeRO-1 optimizer state %.2f MiB is not about half of DDP's %.2f MiB", s1, s0);
}

/* 2 ranks (ZeRO-1) stopped at step 10, resumed on 1 process; 1 process stopped at 10,
 * resumed on 2 ranks (ZeRO-2): both continue the uninterrupted 2-rank run. */
TEST(elastic_resume) {
    NEED_MPI();
    int half = steps / 2;
    char stop[64];
    snprintf(stop, sizeof stop, "--stop-at %d", half);
    char extra[128] = "--zero 1 ";
    strcat(extra, stop);
    REQUIRE(train(mpi, "e21z", extra) == 0);
    REQUIRE(resume("", "e21z", "") == 0);
    check_same_losses("e21z", "ddp", 0, steps);
    check_same_params("e21z", "ddp");
    const char *o = tu_slurp(wpath("e21z.resume.out"));
    CHECK(strstr(o, "resumed from") != NULL, "resume output: %s", o);

    REQUIRE(train("", "e12", stop) == 0);
    REQUIRE(resume(mpi, "e12", "--zero 2") == 0);
    check_same_losses("e12", "ddp", 0, steps);
    check_same_params("e12", "ddp");
}

/* The pid of the rank-`rank` process among mpirun's children. */
static pid_t find_rank(pid_t mpirun, int rank) {
    DIR *d = opendir("/proc");
    pid_t found = -1;
    struct dirent *e;
    char want[64];
    snprintf(want, sizeof want, "OMPI_COMM_WORLD_RANK=%d", rank);
    while (d && found < 0 && (e = readdir(d))) {
        pid_t p = (pid_t)atol(e->d_name);
        if (p <= 0) continue;
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/stat", (int)p);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        int pp = -1;
        char comm[256];
        if (fscanf(f, "%*d (%255[^)]) %*c %d", comm, &pp) != 2) pp = -1;
        fclose(f);
        if (pp != mpirun) continue;
        snprintf(path, sizeof path, "/proc/%d/environ", (int)p);
        f = fopen(path, "rb");
        if (!f) continue;
        static char env[1 << 16];
        size_t n = fread(env, 1, sizeof env - 1, f);
        fclose(f);
        for (size_t i = 0; i < n; i += strlen(env + i) + 1)
            if (!strcmp(env + i, want)) found = p;
    }
    if (d) closedir(d);
    return found;
}

/* kill -9 of rank 1 in the middle of a run: the job ends within seconds with a
 * message, the newest checkpoint loads, and one process resumes from it (for 8 more
 * steps: the run is long so that the kill always lands in the middle). */
TEST(rank_killed) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: the rank-kill test runs in Release only (time)");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s --steps 3000 --ckpt-every 4 --out %s", mpi, bin, common,
             wpath("kill"));
    const char *out = wpath("kill.out");
    pid_t pid = tr_sh_start(cmd, out);
    REQUIRE(pid > 0);
    const char *log = wpath("kill/log.jsonl");
    double t0 = tr_now_ms();
    while (tu_count_records(log, "step") < 10 && tr_now_ms() - t0 < 60e3) tu_sleep_ms(20);
    pid_t victim = find_rank(pid, 1);
    CHECK(victim > 0, "rank 1 of mpirun %d not found", (int)pid);
    int at = tu_count_records(log, "step");
    if (victim > 0) kill(victim, SIGKILL);
    double secs = 0;
    int rc = tr_sh_wait(pid, 30.0, &secs);
    printf("    rank 1 killed after step %d: mpirun exited %d after %.1f s\n", at, rc, secs);
    CHECK(rc != 0 && rc != -2, "the job must end with an error, not %d (-2: hung)", rc);
    CHECK(secs < 20.0, "the job took %.1f s to end after the kill", secs);
    const char *o = tu_slurp(out);
    CHECK(strstr(o, "rank 1") != NULL && strstr(o, "signal 9") != NULL, "no message naming the dead rank: %s", o);
    /* the newest complete checkpoint loads; one process continues from it */
    int64_t n = 0;
    float *p = tr_ckpt_params(wpath("kill"), &n);
    CHECK(p && n > 0, "newest checkpoint of the killed run does not load: %s", anneal_last_error());
    anneal_clear_error();
    free(p);
    char ck[1024];
    REQUIRE(anneal_checkpoint_resolve(wpath("kill"), ck, sizeof ck) == ANNEAL_OK);
    const char *base = strrchr(ck, '/');
    int ck_step = base ? atoi(base + 6) : 0;
    CHECK(ck_step >= 4 && ck_step % 4 == 0, "newest checkpoint %s", ck);
    char extra[64];
    snprintf(extra, sizeof extra, "--stop-at %d", ck_step + 8);
    REQUIRE(resume("", "kill", extra) == 0);
    CHECK(strstr(tu_slurp(wpath("kill.resume.out")), "resumed from") != NULL, "resume output");
    char lp[600];
    snprintf(lp, sizeof lp, "%s/log.jsonl", wpath("kill"));
    double *all = malloc(4096 * sizeof *all);
    int hi = all ? tu_read_losses(lp, all, NULL, 4096) : 0;
    CHECK(hi == ck_step + 8, "the resumed run reached step %d, want %d", hi, ck_step + 8);
    free(all);
}

/* SIGTERM to one rank only (a scheduler's warning, a user's kill): every rank stops
 * after the same step, rank 0 writes the checkpoint, the job exits 0. */
TEST(signal_to_one_rank_stops_all) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s --steps 3000 --out %s", mpi, bin, common, wpath("sig"));
    pid_t pid = tr_sh_start(cmd, wpath("sig.out"));
    REQUIRE(pid > 0);
    double t0 = tr_now_ms();
    while (tu_count_records(wpath("sig/log.jsonl"), "step") < 5 && tr_now_ms() - t0 < 60e3) tu_sleep_ms(20);
    pid_t r1 = find_rank(pid, 1);
    CHECK(r1 > 0, "rank 1 not found");
    if (r1 > 0) kill(r1, SIGTERM);
    double secs = 0;
    int rc = tr_sh_wait(pid, 30.0, &secs);
    const char *o = tu_slurp(wpath("sig.out"));
    printf("    SIGTERM to rank 1: exit %d after %.1f s\n", rc, secs);
    CHECK(rc == 0, "exit %d: %s", rc, o);
    CHECK(strstr(o, "interrupted by a stop request: continue with: anneal train --resume") != NULL, "output: %s", o);
    int at = tu_count_records(wpath("sig/log.jsonl"), "step");
    char ck[1024], want[64];
    snprintf(want, sizeof want, "ckpt_%08d", at);
    CHECK(anneal_checkpoint_resolve(wpath("sig"), ck, sizeof ck) == ANNEAL_OK && strstr(ck, want) != NULL,
          "newest checkpoint %s, want %s", ck, want);
    anneal_clear_error();
}

/* Runs an MPMD job (two differently started ranks); it must fail within the limit;
 * returns its output. */
static const char *bad_launch(const char *name, const char *rank0, const char *rank1) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "exec mpirun --allow-run-as-root --oversubscribe %s -np 1 %s : -np 1 %s", mpi_env, rank0, rank1);
    const char *out = wpath(name);
    double t0 = tr_now_ms();
    int rc = tr_sh_run(cmd, out, 60.0);
    printf("    %s: exit %d after %.1f s\n", name, rc, (tr_now_ms() - t0) / 1e3);
    CHECK(rc != 0 && rc != -2, "%s: the job must fail (not hang): exit %d", name, rc);
    return tu_slurp(out);
}

/* Ranks started with other settings, another version, without their data, or with a
 * batch that does not split: every job ends with a message saying so. */
TEST(bad_launches) {
    NEED_MPI();
    char a[2048], b[2048];
    snprintf(a, sizeof a, "%s train %s --out %s", bin, common, wpath("bad1"));
    snprintf(b, sizeof b, "%s train %s --lr 2e-3 --out %s", bin, common, wpath("bad1"));
    const char *o = bad_launch("mismatch.out", a, b);
    CHECK(strstr(o, "rank 1: anneal train: the settings of this rank differ from rank 0's (--lr 0.002 here, 0.003 on "
                    "rank 0)") != NULL, "config mismatch message: %s", o);
    CHECK(strstr(o, "rank 0: anneal train: stopping: 1 rank(s) were started with other settings") != NULL,
          "rank 0's message: %s", o);
    CHECK(access(wpath("bad1"), F_OK) != 0, "a refused job left its run directory behind");

    snprintf(b, sizeof b, "env ANNEAL_TEST_FAKE_VERSION=0.0.1-other %s train %s --out %s", bin, common, wpath("bad2"));
    snprintf(a, sizeof a, "%s train %s --out %s", bin, common, wpath("bad2"));
    o = bad_launch("version.out", a, b);
    CHECK(strstr(o, "rank 1: anneal train: this rank runs anneal 0.0.1-other but rank 0 runs") != NULL,
          "version mismatch message: %s", o);

    /* rank 1 cannot read its data (as on a host without the shared file system) */
    snprintf(a, sizeof a, "%s train %s --out %s", bin, common, wpath("bad3"));
    snprintf(b, sizeof b, "%s train %s --synthetic off --data %s --out %s", bin, common, wpath("no_such_data"),
             wpath("bad3"));
    o = bad_launch("nodata.out", a, b);
    CHECK(strstr(o, "rank 1: anneal train: --data") != NULL && strstr(o, "no such directory") != NULL,
          "data failure message: %s", o);
    CHECK(strstr(o, "rank 0: anneal train: stopping: setup failed on rank 1") != NULL, "rank 0's message: %s", o);

    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s --batch 7 --out %s", mpi, bin, common, wpath("bad4"));
    int rc = tr_sh_run(cmd, wpath("batch.out"), 60.0);
    o = tu_slurp(wpath("batch.out"));
    CHECK(rc != 0 && rc != -2, "--batch 7 on 2 ranks: exit %d", rc);
    CHECK(strstr(o, "--batch 7 is not divisible by the 2 ranks") != NULL, "batch message: %s", o);
}

/* Real shards (random tokens, shuffled windows): the loader's rank split gives the
 * single-process data order, also for evaluation. */
TEST(shards_match_single_process) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: the shard comparison runs in Release only (time)");
    const char *dir = wpath("shards");
    mkdir(dir, 0755);
    const char *names[2] = {"train_000000.bin", "val_000000.bin"};
    uint64_t s = 12345;
    for (int k = 0; k < 2; k++) {
        char p[700];
        snprintf(p, sizeof p, "%s/%s", dir, names[k]);
        anneal_shard_writer *w = NULL;
        REQUIRE(anneal_shard_writer_open(p, 512, 0, 0x1234, &w) == ANNEAL_OK);
        int32_t ids[1024];
        for (int r = 0; r < (k ? 8 : 64); r++) {
            for (int i = 0; i < 1024; i++) {
                s = s * 6364136223846793005ULL + 1442695040888963407ULL;
                ids[i] = (int32_t)((s >> 33) % 512);
            }
            REQUIRE(anneal_shard_writer_append(w, ids, 1024) == ANNEAL_OK);
        }
        REQUIRE(anneal_shard_writer_finish(w) == ANNEAL_OK);
    }
    {   /* the manifest anneal prepare writes last (train refuses a directory without one) */
        char p[700];
        snprintf(p, sizeof p, "%s/prepare.json", dir);
        FILE *mf = fopen(p, "w");
        REQUIRE(mf);
        fputs("{\"format\": \"anneal-prepare\", \"version\": 1}\n", mf);
        REQUIRE(fclose(mf) == 0);
    }
    char extra[1024];
    snprintf(extra, sizeof extra, "--synthetic off --data %s --steps 10 --eval-every 5 --eval-batches 3", dir);
    REQUIRE(train("", "sh1", extra) == 0);
    REQUIRE(train(mpi, "sh2", extra) == 0);
    check_same_losses("sh2", "sh1", 0, 10);
    check_same_params("sh2", "sh1");
    /* evaluation: the same val loss (split over the ranks, averaged) */
    const char *o1 = strstr(tu_slurp(wpath("sh1.out")), "step 10: val loss");
    char v1[128] = "", v2[128] = "";
    if (o1) sscanf(o1, "step 10: val loss %127s", v1);
    const char *o2 = strstr(tu_slurp(wpath("sh2.out")), "step 10: val loss");
    if (o2) sscanf(o2, "step 10: val loss %127s", v2);
    printf("    val loss at step 10: %s (1 process), %s (2 ranks)\n", v1, v2);
    CHECK(v1[0] && !strcmp(v1, v2), "val loss %s vs %s", v1, v2);
}

/* Two "hosts": two network namespaces joined by a veth pair, one rank in each,
 * mpirun over TCP with a hostfile; the result matches the single-namespace run. */
static void netns_cleanup(void) {
    int r = system("ip netns del anneal_h7a 2>/dev/null; ip netns del anneal_h7b 2>/dev/null");
    (void)r;
}

TEST(two_hosts_over_tcp) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: the two-host run is Release only (time)");
    if (geteuid() != 0) SKIP("network namespaces need root, and this test runs as uid %d", (int)geteuid());
    if (system("command -v ip >/dev/null 2>&1") != 0) SKIP_PROMISED("no `ip` command (bootstrap installs iproute2)");
    netns_cleanup();
    if (system("ip netns add anneal_h7a 2>/dev/null && ip netns add anneal_h7b 2>/dev/null") != 0) {
        netns_cleanup();
        SKIP("`ip netns add` is refused here (a container without CAP_SYS_ADMIN?)");
    }
    int r = system("ip link add anneal_va type veth peer name anneal_vb && "
                   "ip link set anneal_va netns anneal_h7a && ip link set anneal_vb netns anneal_h7b && "
                   "ip -n anneal_h7a addr add 10.231.7.1/24 dev anneal_va && "
                   "ip -n anneal_h7b addr add 10.231.7.2/24 dev anneal_vb && "
                   "ip -n anneal_h7a link set anneal_va up && ip -n anneal_h7b link set anneal_vb up && "
                   "ip -n anneal_h7a link set lo up && ip -n anneal_h7b link set lo up");
    if (r != 0) {
        netns_cleanup();
        SKIP("`ip link add ... type veth` is refused here (no veth support in this kernel or container)");
    }
    /* the rsh agent: "agent [-options] HOST COMMAND..." runs COMMAND in HOST's namespace
     * (with its own host name, so the two look like two machines to OpenMPI) */
    char agent[600], hosts[600]; /* wpath's buffers rotate: keep these two */
    snprintf(agent, sizeof agent, "%s", wpath("rsh_agent.sh"));
    snprintf(hosts, sizeof hosts, "%s", wpath("hostfile"));
    FILE *f = fopen(agent, "w");
    REQUIRE(f);
    fprintf(f, "#!/bin/sh\n"
               "while [ $# -gt 0 ]; do case \"$1\" in -*) shift;; *) break;; esac; done\n"
               "host=$1; shift\n"
               "case \"$host\" in 10.231.7.2) ns=anneal_h7b;; *) ns=anneal_h7a;; esac\n"
               "exec ip netns exec \"$ns\" unshare --uts sh -c \"hostname $ns; $*\"\n");
    fclose(f);
    chmod(agent, 0755);
    f = fopen(hosts, "w");
    REQUIRE(f);
    fprintf(f, "10.231.7.1 slots=1\n10.231.7.2 slots=1\n");
    fclose(f);
    /* every layout over the same link, one rank per host: plain DDP, then the layouts
     * of the parallel stack; each against its single-namespace reference */
    static const struct {
        const char *run, *flags, *ref, *ref_launcher, *ref_flags;
        bool exact; /* bit-identical (--deterministic), else within the float tolerances */
    } runs[] = {
        {"hosts2", "", "ddp", NULL, NULL, false},
        {"hosts2pp", "--pp 2 --accum 2", "single_accum2", "", "--accum 2", false},
        {"hosts2tp", "--tp 2", "single", NULL, NULL, false},
        {"hosts2z3", "--zero 3 --recompute block", "ddp", NULL, NULL, false},
        {"hosts2det", "--deterministic --accum 2", "single_det", "", "--deterministic --accum 2", true},
    };
    int n = (int)(sizeof runs / sizeof runs[0]), rc[8];
    char cmd[4096], out[600];
    for (int i = 0; i < n; i++) {
        snprintf(cmd, sizeof cmd,
                 "exec ip netns exec anneal_h7a unshare --uts sh -c 'hostname anneal_h7a; exec mpirun "
                 "--allow-run-as-root -np 2 --hostfile %s --mca plm_rsh_agent %s --mca btl self,tcp --mca "
                 "btl_tcp_if_include 10.231.7.0/24 --mca oob_tcp_if_include 10.231.7.0/24 %s -x PATH %s train %s %s "
                 "--out %s'",
                 hosts, agent, mpi_env, bin, common, runs[i].flags, wpath(runs[i].run));
        snprintf(out, sizeof out, "%s.out", wpath(runs[i].run));
        rc[i] = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
        if (rc[i] != 0) dump(out);
    }
    netns_cleanup();
    const char *o = tu_slurp(wpath("hosts2.out"));
    CHECK(strstr(o, "distributed: 2 ranks (mpi)") != NULL, "output: %s", o);
    for (int i = 0; i < n; i++) {
        CHECK(rc[i] == 0, "%s (%s) over TCP exited with %d", runs[i].run, runs[i].flags, rc[i]);
        if (rc[i] != 0) continue;
        if (runs[i].ref_launcher) REQUIRE(train(runs[i].ref_launcher, runs[i].ref, runs[i].ref_flags) == 0);
        if (runs[i].exact) {
            check_bit_identical(runs[i].run, runs[i].ref);
        } else {
            check_same_losses(runs[i].run, runs[i].ref, 0, steps);
            check_same_params(runs[i].run, runs[i].ref);
        }
    }
}

int main(void) {
    bin = getenv("ANNEAL_BIN");
    if (!bin) {
        printf("ANNEAL_BIN is not set\n");
        return 1;
    }
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    const char *d = tu_mkdtemp("dist");
    if (!d) return 1;
    snprintf(work, sizeof work, "%s", d);
    if (anneal_test_sanitized()) {
        steps = 8;
        printf("sanitized build: %d steps per run and a reduced set of tests (each sanitized rank is ~10x slower)\n",
               steps);
    }
    /* OpenMPI's own allocations look like leaks to LeakSanitizer: off for the MPI ranks
     * (the single-process runs keep leak checking); vader's single-copy mechanism (CMA)
     * needs ptrace rights that containers often lack */
    snprintf(mpi_env, sizeof mpi_env, "--bind-to none -x OMP_NUM_THREADS=1 --mca btl_vader_single_copy_mechanism none%s",
             anneal_test_sanitized() ? " -x ASAN_OPTIONS=detect_leaks=0" : "");
    snprintf(mpi, sizeof mpi, "mpirun -np 2 --allow-run-as-root --oversubscribe %s", mpi_env);
    snprintf(common, sizeof common,
             "--synthetic --model tiny --batch 8 --seq 32 --steps %d --threads 1 --dropout 0 --lr 3e-3 --warmup 2 "
             "--eval-batches 2 --ckpt-every 0 --peak-gflops 10 --log-every 100",
             steps);
    RUN(ddp_matches_single_process);
    RUN(zero_matches_ddp);
    RUN(default_threads_share_the_host);
    RUN(elastic_resume);
    RUN(rank_killed);
    RUN(signal_to_one_rank_stops_all);
    RUN(bad_launches);
    RUN(shards_match_single_process);
    RUN(two_hosts_over_tcp);
    netns_cleanup();
    if (anneal_test_failed == 0) tu_rmrf(work);
    else printf("kept %s for inspection\n", work);
    return anneal_test_summary();
}
