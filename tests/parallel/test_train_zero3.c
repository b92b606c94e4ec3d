/* `mpirun -np N anneal train --zero 3` end to end, through the CLI: parameters sharded
 * too (src/parallel/zero3.c) give the single-process run's losses and parameters at 2
 * and 4 ranks (GPT-2 and Llama), and ZeRO-2's at the same world size; checkpoints move
 * between world sizes (4 -> 2 -> 1 ranks and 1 -> 2); the per-rank peak of parameter
 * and gradient bytes stays within the ZeRO-3 formula; settings ZeRO-3 cannot run with
 * are refused with a message.
 *
 * Tolerances: those of test_train_dist.c, for the same reason. 2 or 4 ranks x batch B/W
 * and 1 rank x batch B compute the same sums in another order (the loss mean of each
 * slice, the mean over ranks in MPI's reduction, the gradient norm over shards), a few
 * ulps that AdamW's normalised step carries on: LOSS_RTOL 1e-6 on every step's loss,
 * PARAM_L2_RTOL 1e-5 on the parameter vector, PARAM_ATOL 1e-4 on any element (1/30 of
 * one step's lr). A missing or stale gathered block, a wrong shard or a gradient lost in
 * a bucket moves losses in the 2nd-4th digit. One rank with --zero 3 runs the single
 * process's arithmetic (the reduce-scatter of one rank is a copy, the step updates the
 * same elements): its losses must be bit-identical. ZeRO-3 against ZeRO-2 at the same
 * world size does the same arithmetic except that ZeRO-3's buckets end at block
 * boundaries (other bucket sizes for MPI's reduce-scatter and the shard norm): held to
 * the single-process tolerances, and the output says whether they were bit-identical.
 *
 * Memory (an 8-block GPT-2, C = 64, where blocks are most of the model): with P the
 * parameter count, R the parameters outside the blocks (embeddings, final norm; kept
 * gathered), B one block's, W ranks, 4-byte floats:
 *   parameters <= P/W + R + 2B + 2 ceil(B/W) + 64 W   (the shard, the resident ones, the
 *                 block running and the one prefetched, their two all-gather send
 *                 buffers, and the padding of chunk * W per bucket)
 *   gradients  <= P/W + R + 2B   (the gradient shard, the resident ones' .grad for the
 *                 whole backward, the block being differentiated, one block of slack for
 *                 the engine's accumulation)
 * and below ZeRO-2's parameters (the whole model on every rank) at 4 ranks.
 *
 * Needs mpirun (Debian openmpi-bin): skipped with a message without it. */
#include "test.h"
#include "parallel/train_runs.h"
#include "train/train_util.h"

#include <errno.h>

#define LOSS_RTOL 1e-6
#define PARAM_L2_RTOL 1e-5
#define PARAM_ATOL 1e-4
#define RUN_TIMEOUT_S 120.0

static const char *bin;
static char work[256];
static int steps = 20;
static char mpi_env[256];
static char mpi2[512], mpi4[512];
static char common[1024];

/* path = work/name. */
static const char *wpath(const char *name) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", work, name);
    return buf[k];
}

/* `launcher anneal train <args> --out work/<run>`; the exit code (the output is printed
 * when it is not 0). */
static int train_args(const char *launcher, const char *run, const char *args) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s --out %s", launcher, bin, args, wpath(run));
    snprintf(out, sizeof out, "%s.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) printf("---- %s ----\n%s----\n", out, tu_slurp(out));
    return rc;
}

/* train_args with <common> <extra> (a flag given twice: the last one counts). */
static int train(const char *launcher, const char *run, const char *extra) {
    char args[2048];
    snprintf(args, sizeof args, "%s %s", common, extra);
    return train_args(launcher, run, args);
}

/* A resume of work/<run> (output in work/<run>.resume<k>.out). */
static int resume(const char *launcher, const char *run, const char *extra, int k) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train --resume %s %s", launcher, bin, wpath(run), extra);
    snprintf(out, sizeof out, "%s.resume%d.out", wpath(run), k);
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) printf("---- %s ----\n%s----\n", out, tu_slurp(out));
    return rc;
}

static int losses_of(const char *run, double *l) {
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run));
    for (int i = 0; i < 64; i++) l[i] = NAN;
    return tu_read_losses(p, l, NULL, 64);
}

/* The newest checkpoints of run and ref hold the same parameters within the
 * tolerances; exact: bit for bit. */
static void check_same_params(const char *run, const char *ref, bool exact) {
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
        printf("    %s vs %s: parameters differ by %.3g relative (L2; tolerance %.0e), %.3g at most (tolerance %.0e)%s\n",
               run, ref, rel, PARAM_L2_RTOL, worst, PARAM_ATOL, worst == 0 ? ": bit-identical" : "");
        if (exact) CHECK(worst == 0, "parameters of %s and %s differ (by %.3g at most), want bit-identical", run, ref, worst);
        CHECK(rel <= PARAM_L2_RTOL, "parameters of %s and %s differ by %.3g (relative L2)", run, ref, rel);
        CHECK_ALLCLOSE(a, b, na, PARAM_ATOL, 0.0);
    }
    anneal_clear_error();
    free(a);
    free(b);
}

/* Every step's loss of run matches ref's within LOSS_RTOL (exact: bit for bit). */
static void check_same_losses(const char *run, const char *ref, bool exact) {
    double a[64], b[64];
    int ha = losses_of(run, a), hb = losses_of(ref, b);
    CHECK(ha == steps && hb == steps, "%s has %d steps, %s %d: want %d", run, ha, ref, hb, steps);
    double worst = 0;
    for (int i = 0; i < steps; i++) {
        double d = fabs(a[i] - b[i]) / fabs(b[i]);
        if (!(d <= worst)) worst = d;
    }
    printf("    %s vs %s: max relative loss difference %.3g over %d steps (tolerance %s); loss %.5f -> %.5f\n", run, ref,
           worst, steps, exact ? "0" : "1e-6", b[0], b[steps - 1]);
    CHECK(worst <= (exact ? 0.0 : LOSS_RTOL), "losses of %s and %s differ by %.3g relative", run, ref, worst);
}

#define NEED_MPI() do { if (!tr_have_mpirun()) SKIP_PROMISED("mpirun not found (bootstrap installs openmpi-bin)"); } while (0)

/* One process (the reference), ZeRO-3 at 1, 2 and 4 ranks (and 4 with small buckets),
 * ZeRO-2 at 2 and 4. */
TEST(zero3_matches_single_process) {
    NEED_MPI();
    REQUIRE(train("", "single", "") == 0);
    REQUIRE(train("", "z3w1", "--zero 3") == 0);
    REQUIRE(train(mpi2, "z3w2", "--zero 3") == 0);
    REQUIRE(train(mpi4, "z3w4", "--zero 3") == 0);
    REQUIRE(train(mpi2, "z2w2", "--zero 2") == 0);
    REQUIRE(train(mpi4, "z2w4", "--zero 2") == 0);
    /* 50 KB buckets: a block spans several buckets (several all-gathers per block) */
    REQUIRE(train(mpi4, "z3w4b", "--zero 3 --bucket-mb 0.05") == 0);
    check_same_losses("z3w1", "single", true);
    check_same_params("z3w1", "single", true);
    check_same_losses("z3w2", "single", false);
    check_same_params("z3w2", "single", false);
    check_same_losses("z3w4", "single", false);
    check_same_params("z3w4", "single", false);
    check_same_losses("z3w4b", "single", false);
    check_same_params("z3w4b", "single", false);
    check_same_losses("z3w2", "z2w2", false);
    check_same_params("z3w2", "z2w2", false);
    check_same_losses("z3w4", "z2w4", false);
    check_same_params("z3w4", "z2w4", false);
    const char *o = tu_slurp(wpath("z3w4.out"));
    CHECK(o && strstr(o, "distributed: 4 ranks (mpi), ZeRO stage 3") != NULL, "start line: %s", o ? o : "");
}

/* Llama (RMSNorm, SwiGLU, RoPE, an untied lm head outside the blocks) at 2 ranks. */
TEST(zero3_llama_matches_single_process) {
    NEED_MPI();
    REQUIRE(train("", "llama1", "--model llama-tiny") == 0);
    REQUIRE(train(mpi2, "llama3", "--model llama-tiny --zero 3") == 0);
    check_same_losses("llama3", "llama1", false);
    check_same_params("llama3", "llama1", false);
}

/* 4 ranks stopped at a third of the run, resumed on 2 ranks to two thirds, then on one
 * process; and one process without ZeRO stopped halfway, resumed on 2 ranks with
 * --zero 3: both end where the uninterrupted single process does. */
TEST(zero3_elastic_resume) {
    NEED_MPI();
    char extra[128];
    snprintf(extra, sizeof extra, "--zero 3 --stop-at %d", steps / 3);
    REQUIRE(train(mpi4, "e421", extra) == 0);
    snprintf(extra, sizeof extra, "--stop-at %d", 2 * steps / 3);
    REQUIRE(resume(mpi2, "e421", extra, 1) == 0);
    REQUIRE(resume("", "e421", "", 2) == 0);
    check_same_losses("e421", "single", false);
    check_same_params("e421", "single", false);
    const char *o = tu_slurp(wpath("e421.resume1.out"));
    CHECK(o && strstr(o, "resumed from") && strstr(o, "2 ranks (mpi), ZeRO stage 3"), "resume output: %s", o ? o : "");

    snprintf(extra, sizeof extra, "--stop-at %d", steps / 2);
    REQUIRE(train("", "e12", extra) == 0);
    REQUIRE(resume(mpi2, "e12", "--zero 3", 1) == 0);
    check_same_losses("e12", "single", false);
    check_same_params("e12", "single", false);
}

/* Real text with a tokenizer: evaluation, samples (every rank gathers the parameters
 * for rank 0's generation, then releases them) and checkpoints every 5 steps in the
 * middle of the run leave training on its course: the losses and validation losses of
 * 2 ranks with --zero 3 are the single process's. */
TEST(zero3_eval_samples_checkpoints) {
    NEED_MPI();
    TU_DIR_AND_DATA(dir, data, "zero3_data");
    char extra[2048];
    snprintf(extra, sizeof extra, "%s --data %s --eval-every 5 --eval-batches 2 --sample-every 5 --sample-tokens 8 "
             "--ckpt-every 5", common + strlen("--synthetic "), data);
    int a = train_args("", "text1", extra), b = train_args(mpi2, "text3", strcat(extra, " --zero 3"));
    tu_rmrf(dir);
    REQUIRE(a == 0 && b == 0);
    check_same_losses("text3", "text1", false);
    check_same_params("text3", "text1", false);
    const char *o = tu_slurp(wpath("text3.out"));
    char last[64];
    snprintf(last, sizeof last, "--- sample at step %d", steps);
    CHECK(o && strstr(o, "--- sample at step 5") && strstr(o, last) && strstr(o, "val loss"), "output: %s", o ? o : "");
    int want_samples = steps / 5 + (steps % 5 != 0); /* every 5 steps and at the end */
    char p1[600], p3[600];
    snprintf(p1, sizeof p1, "%s/log.jsonl", wpath("text1"));
    snprintf(p3, sizeof p3, "%s/log.jsonl", wpath("text3"));
    CHECK(tu_count_records(p3, "sample") == want_samples && tu_count_records(p3, "eval") == tu_count_records(p1, "eval"),
          "%d samples, %d evaluations (single process: %d)", tu_count_records(p3, "sample"), tu_count_records(p3, "eval"),
          tu_count_records(p1, "eval"));
}

/* The "peak in a step" memory record of a run's log: param_mib and grad_mib of each
 * rank (n ranks). */
static int peak_memory(const char *run, double *param, double *grad, int max) {
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run));
    const char *text = tu_slurp(p), *line = NULL;
    for (const char *q = text; q && (q = strstr(q, "\"when\":\"peak in a step\"")); q++) line = q;
    int n = 0;
    for (const char *q = line; q && n < max && (q = strstr(q, "\"param_mib\":")); n++) {
        if (sscanf(q, "\"param_mib\":%lf,\"grad_mib\":%lf", &param[n], &grad[n]) != 2) break;
        q++;
    }
    return n;
}

/* 8 blocks of C = 64 (blocks are 95% of the parameters): at 2 and 4 ranks every rank's
 * peak parameter and gradient bytes are within the formula of the file comment, and
 * below ZeRO-2's parameters at 4 ranks. */
TEST(zero3_memory_formula) {
    NEED_MPI();
    const int L = 8, C = 64, V = 256, ctx = 64;
    char cfg[600];
    snprintf(cfg, sizeof cfg, "%s/m8.json", work);
    FILE *f = fopen(cfg, "w");
    REQUIRE(f);
    fprintf(f, "{\"model_type\": \"gpt2\", \"n_layer\": %d, \"n_head\": 4, \"n_embd\": %d, \"vocab_size\": %d, "
               "\"n_positions\": %d, \"embd_pdrop\": 0.0, \"resid_pdrop\": 0.0, \"attn_pdrop\": 0.0}\n", L, C, V, ctx);
    fclose(f);
    double R = (double)V * C + (double)ctx * C + 2.0 * C; /* wte, wpe, ln_f */
    double B = 12.0 * C * C + 13.0 * C;                  /* ln_1, c_attn, c_proj, ln_2, c_fc, mlp.c_proj */
    double P = R + L * B;
    char extra[1024];
    double z2_param = NAN;
    for (int zi = 0; zi < 3; zi++) {
        int W = zi == 0 ? 2 : 4, zero = zi == 2 ? 2 : 3;
        char run[32];
        snprintf(run, sizeof run, "mem_w%d_z%d", W, zero);
        snprintf(extra, sizeof extra, "--synthetic --config %s --batch 8 --seq 32 --steps 3 --threads 1 --dropout 0 "
                 "--eval-batches 0 --ckpt-every 0 --peak-gflops 10 --log-every 100 --recompute block --zero %d", cfg, zero);
        REQUIRE(train_args(W == 2 ? mpi2 : mpi4, run, extra) == 0);
        double pm[8], gm[8];
        int n = peak_memory(run, pm, gm, 8);
        CHECK(n == W, "%s: %d ranks in the peak memory record, want %d", run, n, W);
        double mib = 1048576.0 / 4.0; /* floats per MiB */
        double pmax = (P / W + R + 2 * B + 2 * ceil(B / W) + 64.0 * W) / mib;
        double gmax = (P / W + R + 2 * B) / mib;
        for (int r = 0; r < n; r++) {
            if (zero == 2) {
                z2_param = pm[r];
                continue;
            }
            printf("    %s rank %d: parameters %.4f MiB (formula %.4f, whole model %.4f), gradients %.4f MiB "
                   "(formula %.4f)\n", run, r, pm[r], pmax, P / mib, gm[r], gmax);
            CHECK(pm[r] > 0 && pm[r] <= pmax, "%s rank %d: parameter peak %.4f MiB over the formula %.4f", run, r, pm[r],
                  pmax);
            CHECK(gm[r] > 0 && gm[r] <= gmax, "%s rank %d: gradient peak %.4f MiB over the formula %.4f", run, r, gm[r],
                  gmax);
        }
    }
    double pm[8], gm[8];
    int n = peak_memory("mem_w4_z3", pm, gm, 8);
    printf("    4 ranks: parameters %.4f MiB per rank with ZeRO-3, %.4f MiB with ZeRO-2\n", n ? pm[0] : NAN, z2_param);
    CHECK(n > 0 && pm[0] < 0.7 * z2_param, "ZeRO-3 parameters %.4f MiB not well below ZeRO-2's %.4f MiB", pm[0], z2_param);
}

/* What ZeRO-3 cannot run with: a usage error naming the setting. */
TEST(zero3_refused_settings) {
    static const struct {
        const char *extra, *expect;
    } cases[] = {
        {"--zero 3 --recompute none", "--zero 3 needs --recompute block"},
        {"--zero 3 --recompute attn", "--zero 3 needs --recompute block"},
        {"--zero 3 --grad-compress powersgd --powersgd-rank 2", "--zero 3 with --grad-compress powersgd: not available"},
        {"--zero 3 --offload optimizer", "--zero 3 with --offload optimizer: not available"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char run[32];
        snprintf(run, sizeof run, "bad%zu", i);
        char cmd[4096], out[600];
        snprintf(cmd, sizeof cmd, "exec %s train %s %s --out %s", bin, common, cases[i].extra, wpath(run));
        snprintf(out, sizeof out, "%s.out", wpath(run));
        int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
        const char *o = tu_slurp(out);
        CHECK(rc != 0 && o && strstr(o, cases[i].expect), "%s: exit %d, want \"%s\": %s", cases[i].extra, rc,
              cases[i].expect, o ? o : "");
    }
}

int main(void) {
    bin = getenv("ANNEAL_BIN");
    if (!bin) {
        printf("ANNEAL_BIN is not set\n");
        return 1;
    }
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    const char *d = tu_mkdtemp("zero3");
    if (!d) return 1;
    snprintf(work, sizeof work, "%s", d);
    if (anneal_test_sanitized()) steps = 8; /* each sanitized rank is ~10x slower */
    snprintf(mpi_env, sizeof mpi_env, "--bind-to none -x OMP_NUM_THREADS=1 --mca btl_vader_single_copy_mechanism none%s",
             anneal_test_sanitized() ? " -x ASAN_OPTIONS=detect_leaks=0" : "");
    snprintf(mpi2, sizeof mpi2, "mpirun -np 2 --allow-run-as-root --oversubscribe %s", mpi_env);
    snprintf(mpi4, sizeof mpi4, "mpirun -np 4 --allow-run-as-root --oversubscribe %s", mpi_env);
    /* --recompute block in every run: ZeRO-3 needs it, and the references then do the
     * same arithmetic */
    snprintf(common, sizeof common,
             "--synthetic --model tiny --batch 8 --seq 32 --steps %d --threads 1 --dropout 0 --lr 3e-3 --warmup 2 "
             "--eval-batches 2 --ckpt-every 0 --peak-gflops 10 --log-every 100 --recompute block",
             steps);
    RUN(zero3_refused_settings);
    RUN(zero3_matches_single_process);
    RUN(zero3_llama_matches_single_process);
    RUN(zero3_elastic_resume);
    RUN(zero3_eval_samples_checkpoints);
    RUN(zero3_memory_formula);
    if (anneal_test_failed == 0) tu_rmrf(work);
    else printf("kept %s for inspection\n", work);
    return anneal_test_summary();
}
