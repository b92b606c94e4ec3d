/* `mpirun -np N anneal train --pp P` end to end, through the CLI: pipeline-parallel
 * training (blocks split into P stages, --accum micro-batches scheduled 1F1B) gives the
 * loss trajectory and parameters of one process with the same --accum, alone (pp 2 at
 * 2 ranks) and combined with data parallelism (pp 2 x dp 2 at 4 ranks, ZeRO 0-2 over
 * the replicas); checkpoints
 * move between layouts (pp 2 -> 1 and 1 -> 2); the rank layout and the bubble fraction
 * are printed and logged; layouts that cannot work end with clear messages.
 *
 * Tolerances, and where a run is bit for bit. A pipeline stage runs the same ops on the
 * same values as the whole model does (the stage boundary is a copy of the hidden state
 * and of its gradient), micro-batches are accumulated in the same order, the gradient
 * norm is summed over parameters in registration order from the same per-parameter sums
 * of squares, and the losses are averaged in double in micro-batch order on the last
 * stage. So a model without shared tensors (llama-tiny: untied head) is bit-identical:
 * losses and every parameter after 20 steps, asserted with ==. GPT-2 ties wte to the
 * head: one process adds each micro-batch's head and embedding gradients into wte.grad
 * in turn, while the pipeline sums the embedding part on the first stage and the head
 * part on the last and then adds the two (Megatron's embedding all-reduce), a float sum
 * in another order (a few ulps), which AdamW grows as test_train_dist.c explains; so
 * GPT-2 is held to test_train_dist.c's tolerances (LOSS_RTOL 1e-6 per step, parameters
 * PARAM_L2_RTOL 1e-5 relative L2 and PARAM_ATOL 1e-4 per element), and its first step's
 * loss (computed before any update) must be exact at dp 1. With dp 2 the DDP mean over
 * replicas adds the reordering test_train_dist.c measures for DDP. A wrong stage split,
 * a lost activation or gradient message, a missing tied-gradient sum or a lost optimizer
 * state changes losses in the 2nd-4th digit.
 *
 * Needs mpirun (Debian openmpi-bin): skipped with a message without it. Every process
 * runs in its own process group with a time limit (a hang fails the test). Under ASan
 * (anneal_test_sanitized) the runs take 6 steps and the bit-identity, 3/4-stage and ZeRO
 * tests are left to the Release build (time: the full set took 7 minutes here). */
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

static const char *wpath(const char *name) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", work, name);
    return buf[k];
}

static void dump(const char *out) { printf("---- %s ----\n%s----\n", out, tu_slurp(out)); }

/* The model flag of a run: --model tiny unless extra names one. */
static const char *model_of(const char *extra) {
    return strstr(extra, "--model") || strstr(extra, "--config") ? "" : "--model tiny";
}

/* `launcher anneal train <common> <extra> --out work/<run>`: the exit code. */
static int train(const char *launcher, const char *run, const char *extra) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s %s %s --out %s", launcher, bin, common, model_of(extra), extra,
             wpath(run));
    snprintf(out, sizeof out, "%s.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) dump(out);
    return rc;
}

static int resume(const char *launcher, const char *run, const char *extra) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train --resume %s %s", launcher, bin, wpath(run), extra);
    snprintf(out, sizeof out, "%s.resume.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) dump(out);
    return rc;
}

static int losses_of(const char *run, double *l) {
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run));
    for (int i = 0; i < 64; i++) l[i] = NAN;
    return tu_read_losses(p, l, NULL, 64);
}

/* The newest checkpoints of run and ref hold the same parameters: bit for bit (exact),
 * or within PARAM_L2_RTOL (as a vector) and PARAM_ATOL (each element). */
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
        printf("    %s vs %s: parameters differ by %.3g relative (L2), %.3g at most%s\n", run, ref, rel, worst,
               exact ? " (must be 0)" : "");
        if (exact) CHECK(memcmp(a, b, (size_t)na * sizeof *a) == 0, "parameters of %s and %s are not bit-identical", run, ref);
        CHECK(rel <= PARAM_L2_RTOL, "parameters of %s and %s differ by %.3g (relative L2)", run, ref, rel);
        CHECK_ALLCLOSE(a, b, na, PARAM_ATOL, 0.0);
    }
    anneal_clear_error();
    free(a);
    free(b);
}

/* The losses of steps [0, to) of run match ref's: exactly, or within LOSS_RTOL. */
static void check_same_losses(const char *run, const char *ref, int to, bool exact) {
    double a[64], b[64];
    int ha = losses_of(run, a), hb = losses_of(ref, b);
    CHECK(ha >= to && hb >= to, "%s has %d steps, %s %d: want %d", run, ha, ref, hb, to);
    double worst = 0;
    int differ = 0;
    for (int i = 0; i < to; i++) {
        double d = fabs(a[i] - b[i]) / fabs(b[i]);
        if (!(d <= worst)) worst = d;
        differ += a[i] != b[i];
    }
    printf("    %s vs %s: %d steps, max relative loss difference %.3g, %d step(s) not bit-identical; loss %.5f -> %.5f\n",
           run, ref, to, worst, differ, b[0], b[to - 1]);
    if (exact) CHECK(differ == 0, "losses of %s and %s: %d steps not bit-identical", run, ref, differ);
    CHECK(worst <= LOSS_RTOL, "losses of %s and %s differ by %.3g relative", run, ref, worst);
}

/* Every step record of run has a measured bubble in [0, 1] and the ideal one. */
static void check_bubble(const char *run, double ideal) {
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run));
    double b[64], id[64];
    int n = tu_read_steps(p, "pp_bubble", NAN, b, NULL, NULL, 64);
    tu_read_steps(p, "pp_bubble_ideal", NAN, id, NULL, NULL, 64);
    CHECK(n == steps, "%s: %d step records", run, n);
    double sum = 0;
    for (int i = 0; i < n; i++) {
        CHECK(b[i] >= 0 && b[i] <= 1, "%s step %d: pp_bubble %g", run, i + 1, b[i]);
        CHECK(fabs(id[i] - ideal) < 1e-12, "%s step %d: pp_bubble_ideal %g, want %g", run, i + 1, id[i], ideal);
        sum += b[i];
    }
    printf("    %s: measured bubble %.3f on average (ideal %.3f; oversubscribed ranks wait longer)\n", run,
           n ? sum / n : NAN, ideal);
}

#define NEED_MPI() do { if (!tr_have_mpirun()) SKIP_PROMISED("mpirun not found (bootstrap installs openmpi-bin)"); } while (0)

/* pp 2 at 2 ranks = 1 process with the same --accum (GPT-2: tolerance, first step exact). */
TEST(pp2_matches_single_process) {
    NEED_MPI();
    REQUIRE(train("", "single", "") == 0);
    REQUIRE(train(mpi2, "pp2", "--pp 2") == 0);
    check_same_losses("pp2", "single", steps, false);
    double a[64], b[64];
    losses_of("pp2", a);
    losses_of("single", b);
    CHECK(a[0] == b[0], "first step's loss %.17g vs %.17g: the same weights and data must give the same bits", a[0],
          b[0]);
    check_same_params("pp2", "single", false);
    const char *o = tu_slurp(wpath("pp2.out"));
    CHECK(strstr(o, "pipeline: 2 stages x 1 data-parallel replica, 4 micro-batches per step scheduled 1F1B, ideal "
                    "bubble (N-1)/(M+N-1) = 0.200") != NULL, "start lines: %s", o);
    CHECK(strstr(o, "rank 0: stage 0 (blocks 0-0, embedding), replica 0") != NULL, "layout: %s", o);
    CHECK(strstr(o, "rank 1: stage 1 (blocks 1-1, final norm + head), replica 0") != NULL, "layout: %s", o);
    check_bubble("pp2", 1.0 / 5.0);
    CHECK(strstr(o, "pipeline bubble: ") != NULL && strstr(o, "ideal (N-1)/(M+N-1) = 0.200)") != NULL,
          "the summary's bubble line: %s", o);
    /* the layout is stored with the checkpoint (its trainer config) */
    char ck[1024];
    REQUIRE(anneal_checkpoint_resolve(wpath("pp2"), ck, sizeof ck) == ANNEAL_OK);
    anneal_model_config mc;
    char *json = NULL;
    REQUIRE(anneal_checkpoint_read_config(ck, &mc, &json) == ANNEAL_OK);
    CHECK(json && strstr(json, "\"pp\":2") != NULL, "the checkpoint's config: %s", json ? json : "(none)");
    free(json);
}

/* An untied model (llama-tiny) gives the very same bits through the pipeline. */
TEST(pp2_untied_model_is_bit_identical) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    REQUIRE(train("", "llama_single", "--model llama-tiny") == 0);
    REQUIRE(train(mpi2, "llama_pp2", "--model llama-tiny --pp 2") == 0);
    check_same_losses("llama_pp2", "llama_single", steps, true);
    check_same_params("llama_pp2", "llama_single", true);
}

/* Middle stages (receiving and sending both ways) and an uneven split: a 4-block
 * untied Llama in 4 stages (one block each) and in 3 (blocks 0, 1, 2-3), 6 micro-batches,
 * bit-identical to one process. */
TEST(pp3_pp4_middle_stages_are_bit_identical) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    char cfg[600], extra[1024];
    snprintf(cfg, sizeof cfg, "%s/llama4.json", work);
    FILE *f = fopen(cfg, "w");
    REQUIRE(f);
    fputs("{\"model_type\": \"llama\", \"num_hidden_layers\": 4, \"num_attention_heads\": 4, "
          "\"num_key_value_heads\": 2, \"hidden_size\": 64, \"intermediate_size\": 128, \"vocab_size\": 512, "
          "\"max_position_embeddings\": 256, \"rms_norm_eps\": 1e-5, \"tie_word_embeddings\": false}\n", f);
    fclose(f);
    char mpi3[512];
    snprintf(mpi3, sizeof mpi3, "mpirun -np 3 --allow-run-as-root --oversubscribe %s", mpi_env);
    snprintf(extra, sizeof extra, "--config %s --accum 6 --steps %d", cfg, steps / 2);
    REQUIRE(train("", "l4_single", extra) == 0);
    snprintf(extra, sizeof extra, "--config %s --accum 6 --steps %d --pp 4", cfg, steps / 2);
    REQUIRE(train(mpi4, "l4_pp4", extra) == 0);
    snprintf(extra, sizeof extra, "--config %s --accum 6 --steps %d --pp 3", cfg, steps / 2);
    REQUIRE(train(mpi3, "l4_pp3", extra) == 0);
    check_same_losses("l4_pp4", "l4_single", steps / 2, true);
    check_same_params("l4_pp4", "l4_single", true);
    check_same_losses("l4_pp3", "l4_single", steps / 2, true);
    check_same_params("l4_pp3", "l4_single", true);
    const char *o = tu_slurp(wpath("l4_pp3.out"));
    CHECK(strstr(o, "rank 1: stage 1 (blocks 1-1), replica 0") != NULL, "layout: %s", o);
    CHECK(strstr(o, "rank 2: stage 2 (blocks 2-3, final norm + head), replica 0") != NULL, "layout: %s", o);
    CHECK(strstr(o, "ideal bubble (N-1)/(M+N-1) = 0.250") != NULL, "ideal bubble of 3 stages, 6 micro-batches: %s", o);
}

/* pp 2 x dp 2 at 4 ranks = 1 process (the DDP mean over the 2 replicas reorders sums). */
TEST(pp2_dp2_matches_single_process) {
    NEED_MPI();
    REQUIRE(train(mpi4, "pp2dp2", "--pp 2") == 0);
    check_same_losses("pp2dp2", "single", steps, false);
    check_same_params("pp2dp2", "single", false);
    const char *o = tu_slurp(wpath("pp2dp2.out"));
    CHECK(strstr(o, "pipeline: 2 stages x 2 data-parallel replicas") != NULL, "start lines: %s", o);
    CHECK(strstr(o, "rank 2: stage 0 (blocks 0-0, embedding), replica 1") != NULL, "layout: %s", o);
    CHECK(strstr(o, "rank 3: stage 1 (blocks 1-1, final norm + head), replica 1") != NULL, "layout: %s", o);
    CHECK(strstr(o, "per-rank batch 4 (global 8)") != NULL, "each replica gets half of the batch: %s", o);
    check_bubble("pp2dp2", 1.0 / 5.0);
}

/* pp 2 x dp 2 with the stage's optimizer state (and, ZeRO 2, gradients) sharded over
 * the 2 replicas: the same trajectory; a ZeRO-1 run stopped at half resumes as one
 * process (the sharded state gathered into the checkpoint). */
TEST(pp2_dp2_zero_matches_single_process) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    REQUIRE(train(mpi4, "pp2z1", "--pp 2 --zero 1") == 0);
    REQUIRE(train(mpi4, "pp2z2", "--pp 2 --zero 2") == 0);
    check_same_losses("pp2z1", "single", steps, false);
    check_same_params("pp2z1", "single", false);
    check_same_losses("pp2z2", "single", steps, false);
    check_same_params("pp2z2", "single", false);
    CHECK(strstr(tu_slurp(wpath("pp2z1.out")), "ZeRO stage 1") != NULL, "start line");
    char stop[64];
    snprintf(stop, sizeof stop, "--pp 2 --zero 1 --stop-at %d", steps / 2);
    REQUIRE(train(mpi4, "rz41", stop) == 0);
    REQUIRE(resume("", "rz41", "--pp 1 --zero 0") == 0);
    check_same_losses("rz41", "single", steps, false);
    check_same_params("rz41", "single", false);
}

/* Stopped at half with --pp 2, resumed with --pp 1 (one process); and the other way
 * round: both continue the single-process run. */
TEST(resume_between_layouts) {
    NEED_MPI();
    char stop[64];
    snprintf(stop, sizeof stop, "--pp 2 --stop-at %d", steps / 2);
    REQUIRE(train(mpi2, "r21", stop) == 0);
    REQUIRE(resume("", "r21", "--pp 1") == 0);
    check_same_losses("r21", "single", steps, false);
    check_same_params("r21", "single", false);
    CHECK(strstr(tu_slurp(wpath("r21.resume.out")), "resumed from") != NULL, "resume output");
    snprintf(stop, sizeof stop, "--stop-at %d", steps / 2);
    REQUIRE(train("", "r12", stop) == 0);
    REQUIRE(resume(mpi2, "r12", "--pp 2") == 0);
    check_same_losses("r12", "single", steps, false);
    check_same_params("r12", "single", false);
    CHECK(strstr(tu_slurp(wpath("r12.resume.out")), "pipeline: 2 stages") != NULL, "the resume runs the pipeline");
}

/* A job whose layout cannot work: refused with a message naming the setting. */
static void refused(const char *launcher, const char *name, const char *extra, const char *want) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s %s %s --out %s", launcher, bin, common, model_of(extra), extra,
             wpath(name));
    char out[600];
    snprintf(out, sizeof out, "%s.out", wpath(name));
    int rc = tr_sh_run(cmd, out, 60.0);
    const char *o = tu_slurp(out);
    CHECK(rc != 0 && rc != -2, "%s: the job must fail (not hang): exit %d", name, rc);
    CHECK(strstr(o, want) != NULL, "%s: expected \"%s\" in: %s", name, want, o);
    CHECK(access(wpath(name), F_OK) != 0, "%s: a refused job left its run directory behind", name);
}

TEST(bad_layouts) {
    NEED_MPI();
    refused(mpi2, "bad_div", "--pp 3 --accum 4", "--pp 3 does not divide the 2 ranks of the job");
    refused("", "bad_one", "--pp 2", "--pp 2 does not divide the 1 rank of the job");
    refused(mpi2, "bad_accum", "--pp 2 --accum 1", "--accum 1 is below --pp 2");
    refused(mpi4, "bad_blocks", "--pp 4", "--pp 4: more pipeline stages than the model's 2 blocks");
    refused(mpi2, "bad_fp16", "--pp 2 --dtype fp16", "--pp 2: not available with the fp16 loss scaler");
}

int main(void) {
    bin = getenv("ANNEAL_BIN");
    if (!bin) {
        printf("ANNEAL_BIN is not set\n");
        return 1;
    }
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    const char *d = tu_mkdtemp("pp");
    if (!d) return 1;
    snprintf(work, sizeof work, "%s", d);
    if (anneal_test_sanitized()) {
        steps = 6;
        printf("sanitized build: %d steps per run (each sanitized rank is ~10x slower)\n", steps);
    }
    /* as test_train_dist.c: no leak checks in the MPI ranks, no CMA single copy */
    snprintf(mpi_env, sizeof mpi_env, "--bind-to none -x OMP_NUM_THREADS=1 --mca btl_vader_single_copy_mechanism none%s",
             anneal_test_sanitized() ? " -x ASAN_OPTIONS=detect_leaks=0" : "");
    snprintf(mpi2, sizeof mpi2, "mpirun -np 2 --allow-run-as-root --oversubscribe %s", mpi_env);
    snprintf(mpi4, sizeof mpi4, "mpirun -np 4 --allow-run-as-root --oversubscribe %s", mpi_env);
    snprintf(common, sizeof common,
             "--synthetic --batch 8 --seq 32 --accum 4 --steps %d --threads 1 --dropout 0 --lr 3e-3 "
             "--warmup 2 --eval-batches 2 --ckpt-every 0 --peak-gflops 10 --log-every 100",
             steps);
    RUN(pp2_matches_single_process);
    RUN(pp2_untied_model_is_bit_identical);
    RUN(pp3_pp4_middle_stages_are_bit_identical);
    RUN(pp2_dp2_matches_single_process);
    RUN(pp2_dp2_zero_matches_single_process);
    RUN(resume_between_layouts);
    RUN(bad_layouts);
    if (anneal_test_failed == 0) tu_rmrf(work);
    else printf("kept %s for inspection\n", work);
    return anneal_test_summary();
}
