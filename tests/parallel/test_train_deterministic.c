/* `anneal train --deterministic` end to end, through the CLI: one process, and
 * `mpirun -np 1`, `-np 2` and `-np 4` (one thread per rank, --oversubscribe) give the
 * same 20 losses and gradient norms bit for bit (the log's doubles compared as bits,
 * and the losses as f32 bits), and the same final parameters and optimizer state
 * bytes; with dropout on and clipping active, on synthetic tokens and on token shards
 * through the loader (shuffled). A run stopped at step 10 on 4 ranks and resumed on 2
 * ends with the bits of the straight run; 3 and 6 ranks over 6 micro-batches give the
 * one-process bits too; so do --zero 1/2/3 on 2 and 4 ranks, --pp 2 on 2 ranks and
 * --pp 2 x 2 replicas on 4 (GPT-2's tied embedding; llama-tiny), --tp 2 (2 ranks),
 * --tp 2 x dp 2 (4 ranks) on GPT-2 and Llama tiny, --tp 2 x --pp 2 (4 ranks), and resumes between those layouts
 * and one process. Settings it cannot honour are refused with a
 * message that says why, before a run directory is made.
 *
 * Without --deterministic the same layouts differ (printed, not asserted: DDP's
 * tolerances are tests/parallel/test_train_dist.c's business).
 *
 * Every process runs in its own process group with a time limit and is killed (the
 * group) when it runs over. Needs mpirun: skipped with a message without it. */
#include "test.h"
#include "parallel/train_runs.h"
#include "train/train_util.h"

#include <errno.h>

#define RUN_TIMEOUT_S 120.0
#define STEPS 20

static const char *bin;
static char work[256];
static char mpi_env[256];
static char common[1024];

static const char *wpath(const char *name) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", work, name);
    return buf[k];
}

/* The launcher prefix for np ranks ("" for one plain process: np 0). */
static const char *launcher(int np) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    if (np <= 0) buf[k][0] = 0;
    else snprintf(buf[k], sizeof buf[k], "mpirun -np %d --allow-run-as-root --oversubscribe %s", np, mpi_env);
    return buf[k];
}

/* `launcher train <common> <extra> --out work/<run>`: the exit code; the output in
 * work/<run>.out, printed when expect_ok and the run failed. */
static int train(int np, const char *run, const char *extra, bool expect_ok) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s %s --out %s", launcher(np), bin, common, extra, wpath(run));
    snprintf(out, sizeof out, "%s.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0 && expect_ok) printf("---- %s ----\n%s----\n", out, tu_slurp(out));
    return rc;
}

/* `launcher train --resume work/<run> <extra>`: the exit code (output in <run>.resume.out). */
static int resume_ex(int np, const char *run, const char *extra) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train --resume %s %s", launcher(np), bin, wpath(run), extra);
    snprintf(out, sizeof out, "%s.resume.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) printf("---- %s ----\n%s----\n", out, tu_slurp(out));
    return rc;
}

static int resume(int np, const char *run) { return resume_ex(np, run, ""); }

/* The step records' field key of a run, by step (NAN where missing): the highest step. */
static int field_of(const char *run, const char *key, double *v) {
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run));
    for (int i = 0; i < 64; i++) v[i] = NAN;
    return tu_read_steps(p, key, NAN, v, NULL, NULL, 64);
}

/* The val losses of a run's eval records, in order, as logged (up to 16); their count. */
static int val_losses(const char *run, char v[16][64]) {
    char p[600], line[8192];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run));
    FILE *f = fopen(p, "r");
    int n = 0;
    while (f && n < 16 && fgets(line, sizeof line, f)) {
        const char *k = strstr(line, "\"val_loss\":");
        if (!strstr(line, "\"type\":\"eval\"") || !k) continue;
        k += strlen("\"val_loss\":");
        size_t len = strcspn(k, ",}");
        snprintf(v[n++], 64, "%.*s", (int)(len < 63 ? len : 63), k);
    }
    if (f) fclose(f);
    return n;
}

/* Bytes of a file of the newest checkpoint of a run (malloc'd; NULL if missing). */
static char *ckpt_file(const char *run, const char *name, size_t *n) {
    char ck[1024], p[1200];
    *n = 0;
    if (anneal_checkpoint_resolve(wpath(run), ck, sizeof ck) != ANNEAL_OK) {
        anneal_clear_error();
        return NULL;
    }
    snprintf(p, sizeof p, "%s/%s", ck, name);
    FILE *f = fopen(p, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = len > 0 ? malloc((size_t)len) : NULL;
    if (b && fread(b, 1, (size_t)len, f) != (size_t)len) free(b), b = NULL;
    fclose(f);
    *n = b ? (size_t)len : 0;
    return b;
}

/* run and ref: the same losses and gradient norms on steps 1..STEPS (the doubles'
 * bits, and the losses' f32 bits), the same parameters and AdamW state (file bytes:
 * the safetensors hold the f32 bits). */
static void check_identical_n(const char *run, const char *ref, int steps) {
    double a[64], b[64], na[64], nb[64];
    int ha = field_of(run, "loss", a), hb = field_of(ref, "loss", b);
    field_of(run, "grad_norm", na);
    field_of(ref, "grad_norm", nb);
    CHECK(ha == steps && hb == steps, "%s has %d steps, %s %d: want %d", run, ha, ref, hb, steps);
    int same = 0, same_f32 = 0, same_norm = 0;
    for (int i = 0; i < steps; i++) {
        float fa = (float)a[i], fb = (float)b[i];
        same += memcmp(&a[i], &b[i], sizeof a[i]) == 0 && isfinite(a[i]);
        same_f32 += memcmp(&fa, &fb, sizeof fa) == 0;
        same_norm += memcmp(&na[i], &nb[i], sizeof na[i]) == 0;
    }
    printf("    %s vs %s: %d/%d losses bit-identical (f64), %d/%d as f32, %d/%d gradient norms; loss %.6f -> %.6f\n",
           run, ref, same, steps, same_f32, steps, same_norm, steps, b[0], b[steps - 1]);
    CHECK(same == steps && same_f32 == steps && same_norm == steps, "%s and %s: losses or norms differ", run, ref);
    /* the evaluations: every rank evaluates the whole val batches, so the same bits */
    char va[16][64], vb[16][64];
    int ea = val_losses(run, va), eb = val_losses(ref, vb), esame = 0;
    for (int i = 0; i < ea && i < eb; i++) esame += strcmp(va[i], vb[i]) == 0;
    printf("    %s vs %s: %d/%d val losses identical%s%s\n", run, ref, esame, eb, eb ? ", last " : "", eb ? vb[eb - 1] : "");
    CHECK(ea == eb && esame == eb, "%s and %s: val losses differ (%d and %d evaluations, %d the same)", run, ref, ea, eb,
          esame);
    const char *files[2] = {"model.safetensors", "optimizer.safetensors"};
    for (int k = 0; k < 2; k++) {
        size_t n1, n2;
        char *x = ckpt_file(run, files[k], &n1), *y = ckpt_file(ref, files[k], &n2);
        CHECK(x && y && n1 == n2 && memcmp(x, y, n1) == 0, "%s of %s and %s differ (%zu and %zu bytes)", files[k], run,
              ref, n1, n2);
        free(x);
        free(y);
    }
}

static void check_identical(const char *run, const char *ref) { check_identical_n(run, ref, STEPS); }

#define NEED_MPI() do { if (!tr_have_mpirun()) SKIP_PROMISED("mpirun not found (bootstrap installs openmpi-bin)"); } while (0)

/* Synthetic tokens, 4 micro-batches of 2 rows per step, dropout 0.1, clipping at 1
 * (the norm starts above it): 1 process = mpirun -np 1 = -np 2 = -np 4. */
TEST(bit_identical_for_1_2_4_ranks) {
    NEED_MPI();
    REQUIRE(train(0, "d1", "", true) == 0);
    REQUIRE(train(1, "dm1", "", true) == 0);
    REQUIRE(train(2, "d2", "", true) == 0);
    REQUIRE(train(4, "d4", "", true) == 0);
    check_identical("dm1", "d1");
    check_identical("d2", "d1");
    check_identical("d4", "d1");
    const char *o = tu_slurp(wpath("d4.out"));
    CHECK(strstr(o, "deterministic: 4 micro-batches of 2 rows per step, 1 on each of 4 ranks") != NULL,
          "start line: %s", o);
    double n[64];
    field_of("d1", "grad_norm", n);
    CHECK(n[0] > 1.0, "the first norm %g should be above --clip 1 (clipping exercised)", n[0]);
    /* the contrast: the same layouts without --deterministic (not asserted) */
    char extra[64];
    snprintf(extra, sizeof extra, "--deterministic off --batch 8 --accum 1");
    if (train(0, "n1", extra, true) == 0 && train(2, "n2", extra, true) == 0) {
        double a[64], b[64];
        field_of("n1", "loss", a);
        field_of("n2", "loss", b);
        int same = 0;
        for (int i = 0; i < STEPS; i++) same += memcmp(&a[i], &b[i], sizeof a[i]) == 0;
        printf("    without --deterministic (batch 8 split over the ranks): 1 process vs 2 ranks, %d/%d losses "
               "bit-identical\n", same, STEPS);
    }
}

/* Token shards through the loader (shuffled windows), 8 micro-batches of 1 row:
 * 1 process = -np 2 = -np 4. */
TEST(bit_identical_on_shards) {
    NEED_MPI();
    const char *dir = wpath("shards");
    mkdir(dir, 0755);
    const char *names[2] = {"train_000000.bin", "val_000000.bin"};
    uint64_t s = 777;
    for (int k = 0; k < 2; k++) {
        char p[700];
        snprintf(p, sizeof p, "%s/%s", dir, names[k]);
        anneal_shard_writer *w = NULL;
        REQUIRE(anneal_shard_writer_open(p, 512, 0, 0x1234, &w) == ANNEAL_OK);
        int32_t ids[1024];
        for (int r = 0; r < (k ? 4 : 32); r++) {
            for (int i = 0; i < 1024; i++) {
                s = s * 6364136223846793005ULL + 1442695040888963407ULL;
                ids[i] = (int32_t)((s >> 33) % 512);
            }
            REQUIRE(anneal_shard_writer_append(w, ids, 1024) == ANNEAL_OK);
        }
        REQUIRE(anneal_shard_writer_finish(w) == ANNEAL_OK);
    }
    char p[700];
    snprintf(p, sizeof p, "%s/prepare.json", dir);
    FILE *mf = fopen(p, "w");
    REQUIRE(mf);
    fputs("{\"format\": \"anneal-prepare\", \"version\": 1}\n", mf);
    REQUIRE(fclose(mf) == 0);
    /* --synthetic off: the common flags' --synthetic is replaced by --data */
    char extra[1024];
    snprintf(extra, sizeof extra, "--synthetic off --data %s --batch 1 --accum 8 --eval-batches 2", dir);
    REQUIRE(train(0, "s1", extra, true) == 0);
    REQUIRE(train(2, "s2", extra, true) == 0);
    REQUIRE(train(4, "s4", extra, true) == 0);
    check_identical("s2", "s1");
    check_identical("s4", "s1");
}

/* 4 ranks stopped at step 10, resumed on 2: the straight 1-process run's bits. */
TEST(resume_on_another_world_size) {
    NEED_MPI();
    REQUIRE(train(4, "r42", "--stop-at 10", true) == 0);
    REQUIRE(resume(2, "r42") == 0);
    CHECK(strstr(tu_slurp(wpath("r42.resume.out")), "resumed from") != NULL, "resume output");
    check_identical("r42", "d1");
}

/* ZeRO 1, 2 and 3 (3 with --recompute block) on 2 and 4 ranks: every rank gets the
 * whole tree-summed gradient and keeps its chunk, the norm adds per-parameter sums of
 * squares in one process's order: the one-process bits (d1, without recompute). */
TEST(zero_1_2_3) {
    NEED_MPI();
    static const struct { int np; const char *run, *flags; } runs[] = {
        {2, "z1_2", "--zero 1"}, {4, "z1_4", "--zero 1"}, {2, "z2_2", "--zero 2"},
        {4, "z2_4", "--zero 2"}, {2, "z3_2", "--zero 3 --recompute block"}, {4, "z3_4", "--zero 3 --recompute block"},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        REQUIRE(train(runs[i].np, runs[i].run, runs[i].flags, true) == 0);
        check_identical(runs[i].run, "d1");
    }
}

/* --pp 2 on 2 ranks and --pp 2 x 2 replicas on 4 (also with --zero 1 and 2 over the
 * data groups): GPT-2's tied wte (embedding on the first stage, head on the last) and
 * dropout in every block, the one-process bits; an untied llama-tiny likewise. */
TEST(pipeline_and_pipeline_x_data) {
    NEED_MPI();
    REQUIRE(train(2, "p2", "--pp 2", true) == 0);
    REQUIRE(train(4, "p22", "--pp 2", true) == 0);
    check_identical("p2", "d1");
    check_identical("p22", "d1");
    /* ZeRO 1 and 2 over the pipeline's data groups */
    REQUIRE(train(4, "pz1", "--pp 2 --zero 1", true) == 0);
    REQUIRE(train(4, "pz2", "--pp 2 --zero 2", true) == 0);
    check_identical("pz1", "d1");
    check_identical("pz2", "d1");
    /* the three axes at once: tensor- x pipeline-parallel, 4 ranks */
    REQUIRE(train(4, "tp22", "--tp 2 --pp 2", true) == 0);
    check_identical("tp22", "d1");
    const char *o = tu_slurp(wpath("p22.out"));
    CHECK(strstr(o, "2 on each of 2 data-parallel replicas") != NULL, "start line: %s", o);
    REQUIRE(train(0, "l1", "--model llama-tiny --dropout 0 --steps 6", true) == 0);
    REQUIRE(train(4, "l22", "--model llama-tiny --dropout 0 --steps 6 --pp 2", true) == 0);
    check_identical_n("l22", "l1", 6);
}

/* Saved by one layout, resumed by another: --pp 2 on 2 ranks then one process,
 * --zero 2 on 4 ranks then one process, one process then --pp 2 x 2: the straight
 * run's bits. */
TEST(resume_across_layouts) {
    NEED_MPI();
    REQUIRE(train(2, "rp", "--pp 2 --stop-at 10", true) == 0);
    REQUIRE(resume_ex(0, "rp", "--pp 1") == 0);
    check_identical("rp", "d1");
    REQUIRE(train(4, "rz", "--zero 2 --stop-at 10", true) == 0);
    REQUIRE(resume_ex(0, "rz", "--zero 0") == 0);
    check_identical("rz", "d1");
    REQUIRE(train(0, "r1", "--stop-at 10", true) == 0);
    REQUIRE(resume_ex(4, "r1", "--pp 2") == 0);
    check_identical("r1", "d1");
}

/* W need not be a power of two when M / W is: M = 6 over 3 and 6 ranks (blocks of 2
 * and 1) gives the one-process bits (the tree over 6 leaves: ((x0+x1)+(x2+x3)) + (x4+x5)). */
TEST(three_and_six_ranks) {
    NEED_MPI();
    REQUIRE(train(0, "t1", "--accum 6 --steps 6", true) == 0);
    REQUIRE(train(3, "t3", "--accum 6 --steps 6", true) == 0);
    REQUIRE(train(6, "t6", "--accum 6 --steps 6", true) == 0);
    check_identical_n("t3", "t1", 6);
    check_identical_n("t6", "t1", 6);
}

/* --tp 2 on 2 ranks and --tp 2 x dp 2 on 4 (the blocks' projections in canonical
 * chunks, src/parallel/tp_det.c): GPT-2 tiny (dropout on, vocabulary 512 kept whole
 * under --deterministic) and Llama tiny (GQA 4/2: one key/value head per rank) give the
 * one-process bits; a tp 2 x dp 2 run stopped at step 10 and resumed on tp 2 x dp 1
 * too. */
TEST(tensor_parallel_bit_identical) {
    NEED_MPI();
    REQUIRE(train(0, "tp_ref", "", true) == 0);
    REQUIRE(train(2, "tp2", "--tp 2", true) == 0);
    REQUIRE(train(4, "tp2dp2", "--tp 2", true) == 0);
    check_identical("tp2", "tp_ref");
    check_identical("tp2dp2", "tp_ref");
    const char *o = tu_slurp(wpath("tp2dp2.out"));
    CHECK(strstr(o, "vocabulary whole on every rank (--deterministic)") != NULL &&
              strstr(o, "deterministic: 4 micro-batches of 2 rows per step, 2 on each of 2 data-parallel replicas") != NULL,
          "start lines: %s", o);
    REQUIRE(train(4, "tpr", "--tp 2 --stop-at 10", true) == 0);
    REQUIRE(resume(2, "tpr") == 0);
    check_identical("tpr", "tp_ref");
    const char *llama = "--model llama-tiny --dropout 0";
    char extra[256];
    REQUIRE(train(0, "tpl_ref", llama, true) == 0);
    snprintf(extra, sizeof extra, "%s --tp 2", llama);
    REQUIRE(train(2, "tpl2", extra, true) == 0);
    REQUIRE(train(4, "tpl2dp2", extra, true) == 0);
    check_identical("tpl2", "tpl_ref");
    check_identical("tpl2dp2", "tpl_ref");
}

/* A refused combination: the run fails with msg in its output and makes no run
 * directory. */
static void refused(int np, const char *run, const char *extra, const char *msg) {
    int rc = train(np, run, extra, false);
    char out[600];
    snprintf(out, sizeof out, "%s.out", wpath(run));
    const char *o = tu_slurp(out);
    CHECK(rc != 0 && rc != -2, "%s: exit %d (want a refusal)", extra, rc);
    CHECK(o && strstr(o, msg) != NULL, "%s: want \"%s\" in: %s", extra, msg, o ? o : "");
    struct stat sb;
    CHECK(stat(wpath(run), &sb) != 0, "%s: the refused run made %s", extra, wpath(run));
    if (o) {
        const char *e = strstr(o, "--deterministic");
        printf("    %s (np %d): %.*s\n", extra, np, e ? (int)strcspn(e, "\n") : 0, e ? e : "");
    }
}

TEST(refusals) {
    NEED_MPI();
    refused(4, "bad_ppdiv", "--pp 2 --accum 3", "--accum 3 is not divisible by the 2 data-parallel replicas");
    refused(2, "bad_psgd", "--grad-compress powersgd",
            "--deterministic with --grad-compress powersgd: the compressed gradient is an approximation");
    refused(4, "bad_div", "--accum 2", "--deterministic: --accum 2 is not divisible by the 4 ranks");
    refused(2, "bad_pow2", "--accum 6",
            "--accum 6 over 2 ranks gives 3 micro-batches per rank, which must be a power of two");
    /* one process takes any --accum (no split) */
    REQUIRE(train(0, "ok_acc3", "--accum 3 --steps 2", true) == 0);
}

int main(void) {
    bin = getenv("ANNEAL_BIN");
    if (!bin) {
        printf("ANNEAL_BIN is not set\n");
        return 1;
    }
    if (anneal_test_sanitized()) {
        printf("sanitized build: the 4-rank runs are too slow; skipped\n");
        return ANNEAL_TEST_SKIP_CODE;
    }
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    const char *d = tu_mkdtemp("det");
    if (!d) return 1;
    snprintf(work, sizeof work, "%s", d);
    snprintf(mpi_env, sizeof mpi_env, "--bind-to none -x OMP_NUM_THREADS=1 --mca btl_vader_single_copy_mechanism none");
    snprintf(common, sizeof common,
             "--synthetic --model tiny --batch 2 --accum 4 --seq 32 --steps %d --threads 1 --dropout 0.1 --lr 3e-3 "
             "--warmup 2 --clip 1 --eval-batches 2 --eval-every 10 --ckpt-every 0 --peak-gflops 10 --log-every 100 "
             "--deterministic",
             STEPS);
    RUN(bit_identical_for_1_2_4_ranks);
    RUN(bit_identical_on_shards);
    RUN(resume_on_another_world_size);
    RUN(zero_1_2_3);
    RUN(pipeline_and_pipeline_x_data);
    RUN(resume_across_layouts);
    RUN(three_and_six_ranks);
    RUN(tensor_parallel_bit_identical);
    RUN(refusals);
    if (anneal_test_failed == 0) tu_rmrf(work);
    else printf("kept %s for inspection\n", work);
    return anneal_test_summary();
}
