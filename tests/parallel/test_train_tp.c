/* `mpirun -np N anneal train --tp T` end to end, through the CLI: tensor parallelism
 * (--tp 2 at 2 ranks) and tensor x data parallelism (--tp 2 at 4 ranks: two replicas)
 * give the one-process run's losses and parameters; a checkpoint written at --tp 2
 * resumes at --tp 1 on one process and one written by one process resumes at --tp 2
 * (layout-independent checkpoints: the shards gathered, sliced again on load); a
 * rank's parameter memory at --tp 2 is below data parallelism's; bad layouts (--tp not
 * dividing the world, heads not divisible by --tp, --tp with --zero) end with clear
 * messages; samples under --tp (the group runs each token's forward on its shards, the
 * vocabulary-split logits gathered, tp rank 0 samples: src/train/split_sample.c) are one
 * process's texts.
 *
 * Tolerances (the same as tests/parallel/test_train_dist.c, where they are derived):
 * the row-parallel projections add each output's two half-sums over the group (g)
 * instead of one GEMM's sum, the gradient of a column-parallel input is the sum of the
 * ranks' parts (f), and the clipping norm adds the shards' squares in another order:
 * float sums in another order, a few ulps per step, grown by AdamW's normalisation
 * over 20 steps exactly as data parallelism's are. Measured here: losses within 8e-8
 * relative (one ulp of the logged f32 loss on a few steps). A wrong shard, a missing
 * all-reduce or a replicated gradient counted twice changes losses in the 2nd-4th
 * digit. */
#include "test.h"
#include "parallel/train_runs.h"
#include "train/train_util.h"

#include <dirent.h>
#include <errno.h>

#define LOSS_RTOL 1e-6
#define PARAM_L2_RTOL 1e-5
#define PARAM_ATOL 1e-4
#define RUN_TIMEOUT_S 90.0

static const char *bin;
static char work[256];  /* scratch directory of this test run */
static int steps = 20;  /* steps of the compared runs (fewer under ASan) */
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


#define NEED_MPI() do { if (!tr_have_mpirun()) SKIP_PROMISED("mpirun not found (bootstrap installs openmpi-bin)"); } while (0)

/* "mpirun -np N ..." */
static const char *mpi_np(int n) {
    static char buf[4][600];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "mpirun -np %d --allow-run-as-root --oversubscribe %s", n, mpi_env);
    return buf[k];
}

/* The "parameters X MiB" of rank 0 at start in a run's output (NAN when absent). */
static double param_mib(const char *run) {
    char out[600];
    snprintf(out, sizeof out, "%s.out", wpath(run));
    const char *o = tu_slurp(out), *p = o ? strstr(o, "memory at start, rank 0: parameters ") : NULL;
    double v = NAN;
    if (p) sscanf(p, "memory at start, rank 0: parameters %lf", &v);
    return v;
}

/* param_mib of rank `rank` in the first "memory" record of a run's log (NAN when absent). */
static double logged_param_mib(const char *run, int rank) {
    char path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath(run));
    FILE *f = fopen(path, "r");
    double v = NAN;
    char line[8192];
    while (f && isnan(v) && fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "memory")) {
            const cJSON *r = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "ranks"), rank);
            const cJSON *p = cJSON_GetObjectItemCaseSensitive(r, "param_mib");
            if (cJSON_IsNumber(p)) v = p->valuedouble;
        }
        cJSON_Delete(o);
    }
    if (f) fclose(f);
    return v;
}

/* MiB of one rank's shard model of GPT-2 tiny (V 512, C 64, n_ctx 256, 2 layers) at
 * --tp N (vocabulary split): whole on every rank wpe (n_ctx C), per layer ln_1, ln_2 (2C
 * each) and the two c_proj biases (C each), ln_f (2C); 1/N each of wte (V C), c_attn
 * (3C^2 + 3C), attn c_proj (C^2), c_fc (4C^2 + 4C) and mlp c_proj (4C^2) per layer. */
static double tiny_shard_mib(int N) {
    double V = 512, C = 64, ctx = 256, L = 2;
    double whole = ctx * C + L * 6 * C + 2 * C, split = V * C + L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C);
    return (whole + split / N) * 4 / 1048576.0;
}

/* --tp 2 on 2 ranks = one process: losses, parameters; the layout printed; half the
 * blocks' parameters per rank. */
TEST(tp2_matches_single_process) {
    NEED_MPI();
    REQUIRE(train("", "single", "") == 0);
    REQUIRE(train(mpi_np(2), "tp2", "--tp 2") == 0);
    check_same_losses("tp2", "single", 0, steps);
    check_same_params("tp2", "single");
    const char *o = tu_slurp(wpath("tp2.out"));
    CHECK(strstr(o, "parallel layout: 2 ranks = tensor-parallel 2 x data-parallel 1") != NULL, "layout: %s", o);
    CHECK(strstr(o, "vocabulary split") != NULL, "vocabulary: %s", o);
    REQUIRE(train(mpi_np(2), "ddp", "") == 0);
    double a = param_mib("tp2"), b = param_mib("ddp");
    printf("    parameters of rank 0: %.2f MiB at --tp 2, %.2f MiB data-parallel\n", a, b);
    /* blocks and token embedding halved, positions and norms whole: 0.50 here (0.67 if
     * the vocabulary were not split) */
    CHECK(a < 0.6 * b, "--tp 2 holds %.2f MiB of parameters per rank, data parallelism %.2f", a, b);
    double want = tiny_shard_mib(2);
    for (int r = 0; r < 2; r++) {
        double got = logged_param_mib("tp2", r);
        printf("    rank %d: parameters %.6f MiB logged, %.6f MiB by the formula\n", r, got, want);
        CHECK(fabs(got - want) <= 1e-6 * want + 1e-7, "rank %d holds %.6f MiB of parameters, the formula %.6f", r, got,
              want);
    }
}

/* --tp 2 x 2 replicas on 4 ranks = one process. */
TEST(tp2_dp2_matches_single_process) {
    NEED_MPI();
    REQUIRE(train(mpi_np(4), "tp2dp2", "--tp 2") == 0);
    check_same_losses("tp2dp2", "single", 0, steps);
    check_same_params("tp2dp2", "single");
    const char *o = tu_slurp(wpath("tp2dp2.out"));
    CHECK(strstr(o, "tensor-parallel 2 x data-parallel 2") != NULL, "layout: %s", o);
    CHECK(strstr(o, "per-rank batch 4 (global 8)") != NULL, "the replicas split the batch: %s", o);
}

/* --tp 2 x 2 replicas with ZeRO-1 and ZeRO-2 over the replicas = one process; and a
 * ZeRO-2 checkpoint (the moments gathered over the replicas, then over the group)
 * resumes on one process. */
TEST(tp2_zero_matches_single_process) {
    NEED_MPI();
    REQUIRE(train(mpi_np(4), "tpz1", "--tp 2 --zero 1") == 0);
    check_same_losses("tpz1", "single", 0, steps);
    check_same_params("tpz1", "single");
    char stop[64];
    snprintf(stop, sizeof stop, "--tp 2 --zero 2 --stop-at %d", steps / 2);
    REQUIRE(train(mpi_np(4), "tpz2", stop) == 0);
    REQUIRE(resume("", "tpz2", "--tp 1 --zero 0") == 0);
    check_same_losses("tpz2", "single", 0, steps);
    check_same_params("tpz2", "single");
}

/* Llama tiny (GQA 4/2, SwiGLU, untied head) at --tp 2 = one process. */
TEST(llama_tp2_matches_single_process) {
    NEED_MPI();
    REQUIRE(train("", "lsingle", "--model llama-tiny") == 0);
    REQUIRE(train(mpi_np(2), "ltp2", "--model llama-tiny --tp 2") == 0);
    check_same_losses("ltp2", "lsingle", 0, steps);
    check_same_params("ltp2", "lsingle");
}

/* Stopped at step 10 under --tp 2, resumed on one process (--tp 1); and the other way. */
TEST(resume_across_layouts) {
    NEED_MPI();
    char stop[64];
    snprintf(stop, sizeof stop, "--tp 2 --stop-at %d", steps / 2);
    REQUIRE(train(mpi_np(2), "r21", stop) == 0);
    REQUIRE(resume("", "r21", "--tp 1") == 0);
    check_same_losses("r21", "single", 0, steps);
    check_same_params("r21", "single");
    snprintf(stop, sizeof stop, "--stop-at %d", steps / 2);
    REQUIRE(train("", "r12", stop) == 0);
    REQUIRE(resume(mpi_np(2), "r12", "--tp 2") == 0);
    check_same_losses("r12", "single", 0, steps);
    check_same_params("r12", "single");
    const char *o = tu_slurp(wpath("r12.resume.out"));
    CHECK(strstr(o, "resumed from") && strstr(o, "tensor-parallel 2"), "resume output: %s", o);
}

/* --tp alone never holds the whole model (pp_setup.c, tp.c's make_shards): the whole
 * one is made without storage and filled a batch of tensors at a time (at most 1/T of
 * its elements, or its largest tensor), each batch cut into this rank's shards and
 * dropped. The allocator's measured peak of parameter bytes during setup is the replay
 * of that rule over the parameter list (whole-width and shard sizes from models made
 * with each config), below the whole model plus the shards it had before; a resume's
 * AdamW state comes in the same batches (x 8 bytes: both moments): the shard state and
 * a batch's whole-width state, plus at most one tensor of the file being converted (the
 * reader copies an entry that is not aligned in the file), below the whole state plus
 * the shards' that a resume held before. *largest: the largest tensor's elements. */
static void replay(const char *preset, int tp, int tpr, int64_t *param_peak, int64_t *optim_peak, int64_t *before,
                   int64_t *largest_out) {
    anneal_model_config cw, cs;
    *param_peak = *optim_peak = *before = -1;
    if (!anneal_model_preset(preset, &cw)) return;
    cs = cw;
    cs.tp_size = tp, cs.tp_rank = tpr;
    anneal_model *w = anneal_model_new(&cw, ANNEAL_CPU), *s = anneal_model_new(&cs, ANNEAL_CPU);
    if (!w || !s || w->params->n != s->params->n) return;
    const int n = w->params->n;
    int64_t total = 0, largest = 0, shards = 0;
    for (int i = 0; i < n; i++) {
        int64_t k = anneal_numel(w->params->items[i].tensor);
        total += k;
        largest = k > largest ? k : largest;
        shards += anneal_numel(s->params->items[i].tensor);
    }
    const int64_t batch = total / tp > largest ? total / tp : largest;
    int64_t held = 0, peak = 0, opeak = 0, shard_state = 0;
    bool *in = calloc((size_t)n, sizeof *in);
    for (int i = 0, filled = 0; i < n; i++) {
        if (!in[i]) { /* a batch from i on */
            for (int64_t e = 0; filled < n; filled++) {
                int64_t k = anneal_numel(w->params->items[filled].tensor);
                if (e > 0 && e + k > batch) break;
                e += k, held += k, in[filled] = true;
            }
            peak = held > peak ? held : peak;
        }
        held += anneal_numel(s->params->items[i].tensor); /* the shard, then the whole-width one dropped */
        peak = held > peak ? held : peak;
        held -= anneal_numel(w->params->items[i].tensor);
    }
    /* the optimizer state: the shard optimizer's moments made whole first, then each batch's */
    shard_state = shards;
    for (int j0 = 0, j1; j0 < n; j0 = j1) {
        int64_t e = anneal_numel(w->params->items[j0].tensor);
        for (j1 = j0 + 1; j1 < n && e + anneal_numel(w->params->items[j1].tensor) <= batch; j1++)
            e += anneal_numel(w->params->items[j1].tensor);
        opeak = shard_state + e > opeak ? shard_state + e : opeak;
    }
    free(in);
    *param_peak = peak;
    *optim_peak = opeak * 2; /* exp_avg and exp_avg_sq */
    *before = total + shards;
    *largest_out = largest;
    anneal_model_free(w);
    anneal_model_free(s);
}

TEST(setup_holds_one_batch_of_the_whole_model) {
    NEED_MPI();
    static const struct {
        const char *run, *preset;
        bool resumed;
    } runs[] = {{"tp2", "tiny", false}, {"ltp2", "llama-tiny", false}, {"r12", "tiny", true}};
    for (size_t k = 0; k < sizeof runs / sizeof *runs; k++)
        for (int r = 0; r < 2; r++) {
            int64_t peak, opeak, before, largest;
            replay(runs[k].preset, 2, r, &peak, &opeak, &before, &largest);
            REQUIRE(peak > 0);
            const double mib = 4.0 / 1048576.0;
            double pk = NAN, ok = NAN, want = peak * mib, want_o = runs[k].resumed ? opeak * mib : 0;
            double most_o = runs[k].resumed ? (opeak + largest) * mib : 0, before_o = 2 * before * mib;
            char path[600];
            snprintf(path, sizeof path, "%s/log.jsonl", wpath(runs[k].run));
            CHECK(tr_memory_peaks(path, "at start", r, &pk, &ok), "%s: no memory record at start for rank %d", runs[k].run, r);
            printf("    %s rank %d at start: parameter peak %.6f MiB (replay %.6f; whole model + shards %.6f), "
                   "optimizer peak %.6f (replay %.6f to %.6f; whole + shards %.6f)\n", runs[k].run, r, pk, want,
                   before * mib, ok, want_o, most_o, runs[k].resumed ? before_o : 0);
            CHECK(fabs(pk - want) <= 1e-6 * want, "%s rank %d: parameter peak %.6f MiB during setup, the replay %.6f",
                  runs[k].run, r, pk, want);
            CHECK(ok >= want_o * (1 - 1e-6) && ok <= most_o * (1 + 1e-6) && (!runs[k].resumed || ok < before_o),
                  "%s rank %d: optimizer-state peak %.6f MiB during setup, the replay %.6f to %.6f (whole + shards %.6f)",
                  runs[k].run, r, ok, want_o, most_o, before_o);
            CHECK(peak < before, "%s: the replay's peak %lld elements", runs[k].run, (long long)peak);
        }
}

/* `launcher anneal train <common without --model> --init from --out work/<run>`: the
 * exit code. */
static int train_init(const char *launcher, const char *run, const char *from) {
    char base[1100], cmd[4096], out[600];
    const char *m = strstr(common, "--model tiny ");
    snprintf(base, sizeof base, "%.*s%s", m ? (int)(m - common) : 0, common, m ? m + strlen("--model tiny ") : common);
    snprintf(cmd, sizeof cmd, "exec %s %s train %s --init %s --out %s", launcher, bin, base, from, wpath(run));
    snprintf(out, sizeof out, "%s.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) dump(out);
    return rc;
}

/* --init at --tp 2 (filled a batch at a time, read only the batch's tensors: above)
 * from a checkpoint and from a Hugging Face directory in 3 safetensors shards (anneal
 * export) trains as one process does from the same weights. */
TEST(init_at_tp2_matches_one_process) {
    NEED_MPI();
    char cmd[2048], out[600];
    snprintf(cmd, sizeof cmd, "exec %s export --ckpt %s --out %s --max-shard-size 120000 --tokenizer none", bin,
             wpath("single"), wpath("hf_single"));
    snprintf(out, sizeof out, "%s.out", wpath("hf_single"));
    REQUIRE(tr_sh_run(cmd, out, RUN_TIMEOUT_S) == 0);
    char idx[600];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", wpath("hf_single"));
    CHECK(tu_slurp(idx) != NULL, "the export is not sharded: %s", tu_slurp(out));
    static const char *const from[2] = {"single", "hf_single"};
    for (int k = 0; k < 2; k++) {
        char one[64], two[64];
        snprintf(one, sizeof one, "init1_%s", from[k]);
        snprintf(two, sizeof two, "init2_%s", from[k]);
        REQUIRE(train_init("", one, wpath(from[k])) == 0);
        REQUIRE(train_init(mpi_np(2), two, wpath(from[k])) == 0);
        check_same_losses(two, one, 0, steps);
        check_same_params(two, one);
    }
}

/* Real text with a tokenizer: samples every 5 steps at --tp 2 (GPT-2 tiny: vocabulary
 * split, so the head's logits are gathered over the group; llama-tiny: GQA, untied
 * head) and at --tp 2 x 2 replicas are the one-process run's texts (the weights agree to
 * float-summation tolerance, the logits to rounding: a draw would have to land within
 * that of a boundary between two tokens), and training goes on within tolerance. A
 * gather that put the ranks' columns in the wrong order changes the texts. */
TEST(tp2_samples_equal_one_process) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    TU_DIR_AND_DATA(dir, data, "tp_data");
    static const char *models[2] = {"tiny", "llama-tiny"};
    for (int mi = 0; mi < 2; mi++) {
        char extra[2048], runs[3][64];
        snprintf(extra, sizeof extra, "--data %s --model %s --sample-every 5 --sample-tokens 8", data,
                 models[mi]);
        static const char *layout[3] = {"", " --tp 2", " --tp 2"};
        int rc[3];
        for (int k = 0; k < 3; k++) {
            char cmd[4096], out[600];
            snprintf(runs[k], sizeof runs[k], "s_%s_%d", models[mi], k);
            snprintf(cmd, sizeof cmd, "exec %s %s train %s %s%s --out %s", k == 0 ? "" : mpi_np(k == 1 ? 2 : 4), bin,
                     common + strlen("--synthetic "), extra, layout[k], wpath(runs[k]));
            snprintf(out, sizeof out, "%s.out", wpath(runs[k]));
            rc[k] = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
            if (rc[k] != 0) dump(out);
        }
        REQUIRE(rc[0] == 0 && rc[1] == 0 && rc[2] == 0);
        static char a[8192], b[8192];
        char path[600];
        snprintf(path, sizeof path, "%s/log.jsonl", wpath(runs[0]));
        tr_log_values(path, "sample", b, sizeof b);
        CHECK(b[0] != '\0', "%s: the one-process run logged no samples", models[mi]);
        for (int k = 1; k < 3; k++) {
            snprintf(path, sizeof path, "%s/log.jsonl", wpath(runs[k]));
            tr_log_values(path, "sample", a, sizeof a);
            printf("    %s %s samples: %s\n", models[mi], k == 1 ? "tp 2" : "tp 2 x dp 2", a);
            CHECK(!strcmp(a, b), "%s: samples of %s: %s; one process: %s", models[mi], layout[k], a, b);
            check_same_losses(runs[k], runs[0], 0, steps);
        }
    }
    tu_rmrf(dir);
}

/* fp16 at --tp 2: the overflow agreed over the group. An Inf put into rank 1's shard
 * gradient alone at steps 4 and 5 (the test hook ANNEAL_TEST_INF_GRAD) skips those
 * steps and halves the scale on both ranks, as the same Inf does in one process: under
 * --deterministic the same bits (losses, scales, parameters); without it the same
 * scales and overflows (the losses then differ by fp16 operand rounding of other
 * summation orders, not compared). */
TEST(fp16_tp2_agrees_on_overflow) {
    NEED_MPI();
    char two[1024];
    snprintf(two, sizeof two, "%s -x ANNEAL_TEST_INF_GRAD=1:4,5", mpi_np(2));
    const char *one = "env ANNEAL_TEST_INF_GRAD=0:4,5";
    REQUIRE(train(one, "f16", "--dtype fp16 --scale-growth-interval 3 --deterministic") == 0);
    REQUIRE(train(two, "f16tp2", "--tp 2 --dtype fp16 --scale-growth-interval 3 --deterministic") == 0);
    REQUIRE(train(two, "f16tp2nd", "--tp 2 --dtype fp16 --scale-growth-interval 3") == 0);
    char ref[2048], got[2048];
    tr_scale_trace(wpath("f16/log.jsonl"), ref, sizeof ref);
    printf("    one process: loss scales %s\n", ref);
    CHECK(strncmp(ref, "65536|65536|65536|131072O|65536O|32768|", 39) == 0, "one process's scales: %s", ref);
    tr_scale_trace(wpath("f16tp2/log.jsonl"), got, sizeof got);
    CHECK(strcmp(got, ref) == 0, "--tp 2 --deterministic: loss scales %s, one process %s", got, ref);
    tr_scale_trace(wpath("f16tp2nd/log.jsonl"), got, sizeof got);
    CHECK(strcmp(got, ref) == 0, "--tp 2: loss scales %s, one process %s", got, ref);
    double a[64], b[64];
    int na = losses_of("f16tp2", a), nb = losses_of("f16", b);
    CHECK(na == steps && nb == steps && memcmp(a, b, sizeof(double) * (size_t)steps) == 0,
          "--tp 2 --deterministic: losses not one process's bits (%d and %d steps; first %.17g vs %.17g)", na, nb, a[0],
          b[0]);
    int64_t n1, n2;
    float *p1 = tr_ckpt_params(wpath("f16tp2"), &n1), *p2 = tr_ckpt_params(wpath("f16"), &n2);
    CHECK(p1 && p2 && n1 == n2 && memcmp(p1, p2, sizeof(float) * (size_t)n1) == 0,
          "--tp 2 --deterministic: parameters not one process's bits");
    free(p1);
    free(p2);
}

/* --tp 2 with --offload optimizer,activations: each rank's AdamW state over its shards
 * in a file of its own, saved tensors in another; under --deterministic one process's
 * bits, with checkpoints every 7 steps (the state out of the file, gathered into the
 * whole one, put back) and a resume of the offloaded run on one process. */
TEST(tp2_offload_is_one_process) {
    NEED_MPI();
    REQUIRE(train("", "det1", "--deterministic") == 0);
    REQUIRE(train(mpi_np(2), "offtp2", "--tp 2 --offload optimizer,activations --deterministic --ckpt-every 7") == 0);
    char extra[256];
    snprintf(extra, sizeof extra, "--tp 2 --offload optimizer --deterministic --stop-at %d", steps / 2);
    REQUIRE(train(mpi_np(2), "offr", extra) == 0);
    REQUIRE(resume("", "offr", "--tp 1") == 0);
    const char *runs[] = {"offtp2", "offr"};
    for (int i = 0; i < 2; i++) {
        double a[64], b[64];
        int na = losses_of(runs[i], a), nb = losses_of("det1", b);
        CHECK(na == steps && nb == steps && memcmp(a, b, sizeof(double) * (size_t)steps) == 0,
              "%s: losses not one process's bits (%d and %d steps; last %.17g vs %.17g)", runs[i], na, nb,
              a[steps - 1], b[steps - 1]);
        int64_t n1, n2;
        float *p1 = tr_ckpt_params(wpath(runs[i]), &n1), *p2 = tr_ckpt_params(wpath("det1"), &n2);
        CHECK(p1 && p2 && n1 == n2 && memcmp(p1, p2, sizeof(float) * (size_t)n1) == 0,
              "%s: parameters not one process's bits", runs[i]);
        free(p1);
        free(p2);
    }
    const char *o = tu_slurp(wpath("offtp2.out"));
    CHECK(o && strstr(o, "optimizer state offloaded: ") && strstr(o, "activations offloaded:"), "offload notes: %s",
          o ? o : "");
}

/* Byte-identical model and optimizer files of run's checkpoints of steps `at` and
 * ref's. */
static void check_same_ckpt_files(const char *run, const char *ref, const int *at, int n) {
    static const char *const files[] = {"model.safetensors", "optimizer.safetensors"};
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 2; k++) {
            char pa[700], pb[700];
            snprintf(pa, sizeof pa, "%s/ckpt_%08d/%s", wpath(run), at[i], files[k]);
            snprintf(pb, sizeof pb, "%s/ckpt_%08d/%s", wpath(ref), at[i], files[k]);
            size_t na = 0, nb = 0;
            char *x = tr_read_all(pa, &na), *y = tr_read_all(pb, &nb);
            CHECK(x && y && na == nb && memcmp(x, y, na) == 0, "%s: %s of step %d (%zu bytes) differs from %s's (%zu)",
                  run, files[k], at[i], na, ref, nb);
            free(x);
            free(y);
        }
}

/* Checkpoints stream the shards: rank 0 writes the one-process files fetching each
 * tensor's shards from the group when the file reaches it. Under --deterministic the
 * files of steps 7, 14 and 20 are one process's byte for byte: tp 2, tp 2 x 2 replicas
 * (ZeRO 0, 1 and 2: the shards' moments assembled over the replicas first; the norm
 * from the whole agreed gradients, which ZeRO alone would not leave in .grad), tp 2 with
 * the optimizer state offloaded, llama-tiny at tp 2 x pp 2 (GQA shards). Without
 * it, checkpoints add nothing to any rank's measured peaks: over the run the
 * parameters' peak is setup's (one batch of whole tensors) and the optimizer state's its
 * shards' AdamW moments (2 x the shard model), where the gathered checkpoint before
 * made rank 0 hold the whole model's moments too (the optimizer category). */
TEST(checkpoints_stream_the_shards) {
    NEED_MPI();
    const int at[] = {7, 14, 20}, nat = steps >= 20 ? 3 : 0;
    const char *every = "--deterministic --ckpt-every 7 --accum 2"; /* 2 micro-batches: 1 per replica at dp 2 */
    char extra[256];
    REQUIRE(train("", "ck1", every) == 0);
    snprintf(extra, sizeof extra, "--tp 2 %s", every);
    REQUIRE(train(mpi_np(2), "cktp2", extra) == 0);
    REQUIRE(train(mpi_np(4), "cktp2dp2", extra) == 0);
    snprintf(extra, sizeof extra, "--tp 2 --zero 1 %s", every);
    REQUIRE(train(mpi_np(4), "cktp2z1", extra) == 0);
    snprintf(extra, sizeof extra, "--tp 2 --zero 2 %s", every);
    REQUIRE(train(mpi_np(4), "cktp2z2", extra) == 0);
    snprintf(extra, sizeof extra, "--tp 2 --offload optimizer %s", every);
    REQUIRE(train(mpi_np(2), "cktp2off", extra) == 0);
    snprintf(extra, sizeof extra, "--model llama-tiny %s", every);
    REQUIRE(train("", "lck1", extra) == 0);
    snprintf(extra, sizeof extra, "--model llama-tiny --tp 2 --pp 2 %s", every);
    REQUIRE(train(mpi_np(4), "lcktp2pp2", extra) == 0);
    check_same_ckpt_files("cktp2", "ck1", at, nat);
    check_same_ckpt_files("cktp2dp2", "ck1", at, nat);
    check_same_ckpt_files("cktp2z1", "ck1", at, nat);
    check_same_ckpt_files("cktp2z2", "ck1", at, nat);
    check_same_ckpt_files("cktp2off", "ck1", at, nat);
    check_same_ckpt_files("lcktp2pp2", "lck1", at, nat);
    const int last[] = {steps};
    check_same_ckpt_files("cktp2", "ck1", last, 1);
    check_same_ckpt_files("lcktp2pp2", "lck1", last, 1);
    /* the measured peaks of a run with checkpoints (vocabulary split: no --deterministic) */
    REQUIRE(train(mpi_np(2), "ckmem", "--tp 2 --ckpt-every 3") == 0);
    char path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath("ckmem"));
    double shard = tiny_shard_mib(2);
    for (int r = 0; r < 2; r++) {
        double p0 = NAN, o0 = NAN, p1 = NAN, o1 = NAN;
        CHECK(tr_memory_peaks(path, "at start", r, &p0, &o0), "ckmem: no memory record at start for rank %d", r);
        CHECK(tr_memory_peaks(path, NULL, r, &p1, &o1), "ckmem: no memory record for rank %d", r);
        printf("    ckmem rank %d: parameter peak %.6f MiB at start, %.6f over the run; optimizer peak %.6f MiB "
               "over the run (2 x the shard model: %.6f)\n", r, p0, p1, o1, 2 * shard);
        CHECK(p1 == p0, "rank %d: the parameters' peak grew from %.6f MiB (setup) to %.6f over a run with checkpoints",
              r, p0, p1);
        CHECK(fabs(o1 - 2 * shard) <= 1e-6 * shard, "rank %d: optimizer-state peak %.6f MiB, the shards' moments %.6f",
              r, o1, 2 * shard);
    }
}

/* PowerSGD over the replicas of --tp 2 x 2: each rank compresses its shards' gradients
 * over its data-parallel group (the low-rank factors of a shard are not the whole
 * matrix's: no one-process equivalent). Warm-up steps as uncompressed, then at least 4x
 * fewer bytes; stopped at half and resumed, the straight run's bits. */
TEST(powersgd_over_tp_replicas) {
    NEED_MPI();
    const char *ps = "--tp 2 --grad-compress powersgd --powersgd-rank 2 --powersgd-warmup-steps 3";
    char extra[256];
    REQUIRE(train(mpi_np(4), "pstp", ps) == 0);
    snprintf(extra, sizeof extra, "%s --stop-at %d --ckpt-every %d", ps, steps / 2, steps / 2);
    REQUIRE(train(mpi_np(4), "pstpr", extra) == 0);
    REQUIRE(resume(mpi_np(4), "pstpr", "") == 0);
    tr_check_powersgd(wpath("pstp/log.jsonl"), wpath("pstpr/log.jsonl"), wpath("tp2dp2/log.jsonl"), steps, 3, LOSS_RTOL);
}

/* A run that must fail with `expect` in its output. */
static void refused(const char *launcher, const char *run, const char *extra, const char *expect) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s %s --out %s", launcher, bin, common, extra, wpath(run));
    snprintf(out, sizeof out, "%s.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    const char *o = tu_slurp(out);
    CHECK(rc != 0 && rc != -2 && o && strstr(o, expect), "%s: exit %d, expected \"%s\" in: %s", run, rc, expect,
          o ? o : "");
}

TEST(bad_layouts) {
    NEED_MPI();
    refused(mpi_np(2), "bad_world", "--tp 3", "--tp 3 does not divide the 2 ranks");
    refused(mpi_np(3), "bad_heads", "--tp 3", "n_head 4 is not divisible by --tp 3");
    refused(mpi_np(2), "bad_lora", "--tp 2 --lora-rank 4", "--tp 2 with --lora-rank: not built");
}

int main(void) {
    bin = getenv("ANNEAL_BIN");
    if (!bin) {
        printf("ANNEAL_BIN is not set\n");
        return 1;
    }
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    const char *d = tu_mkdtemp("tp");
    if (!d) return 1;
    snprintf(work, sizeof work, "%s", d);
    if (anneal_test_sanitized()) steps = 8;
    snprintf(mpi_env, sizeof mpi_env, "--bind-to none -x OMP_NUM_THREADS=1 --mca btl_vader_single_copy_mechanism none%s",
             anneal_test_sanitized() ? " -x ASAN_OPTIONS=detect_leaks=0" : "");
    snprintf(common, sizeof common,
             "--synthetic --model tiny --batch 8 --seq 32 --steps %d --threads 1 --dropout 0 --lr 3e-3 --warmup 2 "
             "--eval-batches 2 --ckpt-every 0 --peak-gflops 10 --log-every 100",
             steps);
    RUN(tp2_matches_single_process);
    RUN(tp2_dp2_matches_single_process);
    RUN(tp2_zero_matches_single_process);
    RUN(llama_tp2_matches_single_process);
    RUN(resume_across_layouts);
    RUN(setup_holds_one_batch_of_the_whole_model);
    RUN(init_at_tp2_matches_one_process);
    RUN(tp2_samples_equal_one_process);
    RUN(fp16_tp2_agrees_on_overflow);
    RUN(tp2_offload_is_one_process);
    RUN(checkpoints_stream_the_shards);
    RUN(powersgd_over_tp_replicas);
    RUN(bad_layouts);
    if (anneal_test_failed == 0) tu_rmrf(work);
    else printf("kept %s for inspection\n", work);
    return anneal_test_summary();
}
