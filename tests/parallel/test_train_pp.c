/* `mpirun -np N anneal train --pp P` end to end, through the CLI: pipeline-parallel
 * training (blocks split into P stages, --accum micro-batches scheduled 1F1B) gives the
 * loss trajectory and parameters of one process with the same --accum, alone (pp 2 at
 * 2 ranks) and combined with data parallelism (pp 2 x dp 2 at 4 ranks, ZeRO 0-2 over
 * the replicas); checkpoints
 * move between layouts (pp 2 -> 1 and 1 -> 2); the rank layout and the bubble fraction
 * are printed and logged; layouts that cannot work end with clear messages. Each rank
 * holds only its stage's parameters: the memory record's parameter, gradient and
 * optimizer bytes are its stage's parameters (counted from their names) x 4, 4 and 8.
 * --tp 2 x --pp 2 (4 ranks, and x 2 replicas with ZeRO 1/2 at 8) trains as one process
 * within the tolerances below, and resumes to and from one process. Samples run through
 * the stages and give one process's text; --init (Hugging Face or checkpoint) and
 * --tp x --pp setup allocate only the stage; a streamed checkpoint failing midway
 * (the fault shim on rank 0) leaves the previous one intact and nothing partial.
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

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>

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

/* Elements of the parameters rank (tp rank tpr of stage `stage` of `n`) holds by the
 * layout's rule, counted from parameter names (not from the trainer's ownership table):
 * block l's parameters in stage floor(l n / L)'s blocks, the token (and GPT-2's position)
 * embedding on stage 0, the final norm and head on stage n-1, GPT-2's tied wte on both;
 * sizes of a model made with the tensor-parallel shard config when tp > 1. */
static int64_t stage_numel(const char *preset, int tp, int tpr, int stage, int n) {
    anneal_model_config cfg;
    if (!anneal_model_preset(preset, &cfg)) return -1;
    if (tp > 1) cfg.tp_size = tp, cfg.tp_rank = tpr;
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (!m) return -1;
    int L = cfg.n_layer, first = stage * L / n, last = (stage + 1) * L / n;
    int64_t sum = 0;
    for (int i = 0; i < m->params->n; i++) {
        const char *name = m->params->items[i].name;
        int l = -1;
        bool mine;
        if (sscanf(name, "transformer.h.%d.", &l) == 1 || sscanf(name, "model.layers.%d.", &l) == 1)
            mine = l >= first && l < last;
        else if (strstr(name, "wte")) mine = stage == 0 || stage == n - 1;
        else if (strstr(name, "wpe") || strstr(name, "embed_tokens")) mine = stage == 0;
        else mine = stage == n - 1; /* ln_f, model.norm, lm_head */
        if (mine) sum += anneal_numel(m->params->items[i].tensor);
    }
    anneal_model_free(m);
    return sum;
}

/* The last "memory" record of run's log: rank r's MiB of parameters, gradients and
 * optimizer state (false when absent). */
static bool logged_memory(const char *run, int r, double mib[3]) {
    char path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath(run));
    FILE *f = fopen(path, "r");
    bool got = false;
    char line[16384];
    static const char *const keys[] = {"param_mib", "grad_mib", "optim_mib"};
    while (f && fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "memory")) {
            const cJSON *e = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "ranks"), r);
            got = e != NULL;
            for (int k = 0; k < 3 && got; k++) {
                const cJSON *v = cJSON_GetObjectItemCaseSensitive(e, keys[k]);
                got = cJSON_IsNumber(v);
                if (got) mib[k] = v->valuedouble;
            }
        }
        cJSON_Delete(o);
    }
    if (f) fclose(f);
    return got;
}

/* The val loss of run's last "eval" record (NAN when none). */
static double last_val_loss(const char *run) {
    char path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath(run));
    FILE *f = fopen(path, "r");
    double v = NAN;
    char line[16384];
    while (f && fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        const cJSON *vl = cJSON_GetObjectItemCaseSensitive(o, "val_loss");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "eval") && cJSON_IsNumber(vl)) v = vl->valuedouble;
        cJSON_Delete(o);
    }
    if (f) fclose(f);
    return v;
}

/* The final evaluation (through the stages: no rank gathers another's parameters) gives
 * one process's val loss within LOSS_RTOL (GPT-2's tied sum moves the weights by that). */
static void check_val_loss(const char *run, const char *ref) {
    double a = last_val_loss(run), b = last_val_loss(ref);
    printf("    %s vs %s: val loss %.9g vs %.9g\n", run, ref, a, b);
    CHECK(fabs(a - b) <= LOSS_RTOL * fabs(b), "%s: val loss %.9g, %s %.9g", run, a, ref, b);
}

/* Each rank's reported steady-state memory (the last record: the peak over the steps)
 * is its stage's parameters x 4 bytes (f32), gradients x 4 and AdamW's two moments x 8
 * (dp 1: no sync buckets; with replicas only the parameters are checked); and a stage
 * holds less than the whole model. */
static void check_memory(const char *run, const char *preset, int tp, int pp, int world, bool all3) {
    int64_t whole = stage_numel(preset, 1, 0, 0, 1);
    for (int r = 0; r < world; r++) {
        double mib[3] = {NAN, NAN, NAN};
        int64_t n = stage_numel(preset, tp, r % tp, r / tp % pp, pp);
        CHECK(logged_memory(run, r, mib), "%s: no memory record for rank %d", run, r);
        double want[3] = {n * 4.0 / 1048576.0, n * 4.0 / 1048576.0, n * 8.0 / 1048576.0};
        if (all3)
            printf("    %s rank %d: parameters %.6f MiB (formula %.6f), gradients %.6f (%.6f), optimizer %.6f (%.6f); "
                   "%.0f%% of the whole model's parameters\n", run, r, mib[0], want[0], mib[1], want[1], mib[2],
                   want[2], 100.0 * (double)n / (double)whole);
        else /* the sync's buckets and ZeRO's shards change the other two */
            printf("    %s rank %d: parameters %.6f MiB (formula %.6f); %.0f%% of the whole model's parameters\n", run,
                   r, mib[0], want[0], 100.0 * (double)n / (double)whole);
        for (int k = 0; k < (all3 ? 3 : 1); k++)
            CHECK(fabs(mib[k] - want[k]) <= 1e-6 * want[k], "%s rank %d: memory category %d is %.6f MiB, the formula "
                  "%.6f", run, r, k, mib[k], want[k]);
        CHECK(n < whole, "%s rank %d holds %lld of the model's %lld parameters", run, r, (long long)n, (long long)whole);
    }
}

/* The last "memory" record of run's log taken "at start" (after setup, before the first
 * step: for a resume, the resumed run's): rank r's measured peaks of the allocator's
 * parameter and optimizer-state categories since the process started, in MiB. */
static bool start_peaks(const char *run, int r, double *param_peak, double *optim_peak) {
    char path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath(run));
    return tr_memory_peaks(path, "at start", r, param_peak, optim_peak);
}

/* Setup (and a resume) allocate only the stage's parameters: each rank's peak of
 * parameter bytes up to the first step is its stage's parameters x 4 (counted from
 * the names, stage_numel), below the whole model's; the optimizer state's peak is
 * the stage's AdamW moments (x 8) after a resume (read for the stage only), none on a
 * fresh start (made at the first step). Before the stage-only setup every rank built
 * the whole model (and a resume the whole optimizer state) first: peak = whole. */
static void check_setup_peak(const char *run, const char *preset, int pp, int world, bool resumed) {
    int64_t whole = stage_numel(preset, 1, 0, 0, 1);
    for (int r = 0; r < world; r++) {
        double pk = NAN, ok = NAN;
        int64_t n = stage_numel(preset, 1, 0, r % pp, pp);
        double want = n * 4.0 / 1048576.0, want_opt = resumed ? n * 8.0 / 1048576.0 : 0.0;
        CHECK(start_peaks(run, r, &pk, &ok), "%s: no measured peaks at start for rank %d", run, r);
        printf("    %s rank %d at start: parameter peak %.6f MiB (stage %.6f, whole model %.6f), optimizer peak %.6f MiB "
               "(want %.6f)\n", run, r, pk, want, whole * 4.0 / 1048576.0, ok, want_opt);
        CHECK(fabs(pk - want) <= 1e-6 * want, "%s rank %d: parameter peak %.6f MiB during setup, the stage's %.6f", run, r,
              pk, want);
        CHECK(pk < whole * 4.0 / 1048576.0, "%s rank %d: parameter peak %.6f MiB is the whole model's", run, r, pk);
        CHECK(fabs(ok - want_opt) <= 1e-6 * want_opt, "%s rank %d: optimizer-state peak %.6f MiB during setup, want %.6f",
              run, r, ok, want_opt);
    }
}

/* The peak of parameter elements while a --tp x --pp rank cuts its shards: the stage's
 * whole-width parameters (stage_numel's rule) are all held, then in registration order
 * each one's shard is made and the whole-width tensor dropped (tp.c's make_shards), so
 * the peak is the largest of (whole-width not yet cut + shards made so far). -1 when a
 * model cannot be made. */
static int64_t cut_peak(const char *preset, int tp, int tpr, int stage, int n) {
    anneal_model_config cfg, sc;
    if (!anneal_model_preset(preset, &cfg)) return -1;
    sc = cfg;
    sc.tp_size = tp, sc.tp_rank = tpr;
    anneal_model *w = anneal_model_new(&cfg, ANNEAL_CPU), *s = anneal_model_new(&sc, ANNEAL_CPU);
    if (!w || !s || w->params->n != s->params->n) {
        anneal_model_free(w);
        anneal_model_free(s);
        return -1;
    }
    int L = cfg.n_layer, first = stage * L / n, last = (stage + 1) * L / n;
    int64_t wide = stage_numel(preset, 1, 0, stage, n), held = wide, peak = wide;
    for (int i = 0; i < w->params->n; i++) {
        const char *name = w->params->items[i].name;
        int l = -1;
        bool mine;
        if (sscanf(name, "transformer.h.%d.", &l) == 1 || sscanf(name, "model.layers.%d.", &l) == 1)
            mine = l >= first && l < last;
        else if (strstr(name, "wte")) mine = stage == 0 || stage == n - 1;
        else if (strstr(name, "wpe") || strstr(name, "embed_tokens")) mine = stage == 0;
        else mine = stage == n - 1;
        if (!mine) continue;
        held += anneal_numel(s->params->items[i].tensor);
        if (held > peak) peak = held;
        held -= anneal_numel(w->params->items[i].tensor);
    }
    anneal_model_free(w);
    anneal_model_free(s);
    return peak;
}

/* --tp x --pp setup builds the stage's whole-width parameters only (pp_setup.c) and
 * cuts the rank's shards of those alone, dropping each whole-width tensor once cut
 * (tp.c's make_shards): each rank's parameter peak up to the first step is cut_peak's,
 * below the stage's whole-width plus shard parameters. Before, every rank built the
 * whole model and then the whole shard model: peak = whole + shard model. */
static void check_setup_peak_tp(const char *run, const char *preset, int tp, int pp, int world, bool resumed) {
    for (int r = 0; r < world; r++) {
        double pk = NAN, ok = NAN;
        int stage = r / tp % pp;
        int64_t wide = stage_numel(preset, 1, 0, stage, pp), shard = stage_numel(preset, tp, r % tp, stage, pp);
        int64_t before = stage_numel(preset, 1, 0, 0, 1) + stage_numel(preset, tp, r % tp, 0, 1);
        int64_t peak = cut_peak(preset, tp, r % tp, stage, pp);
        double want = (double)peak * 4.0 / 1048576.0;
        CHECK(peak > 0 && start_peaks(run, r, &pk, &ok), "%s: no measured peaks at start for rank %d", run, r);
        printf("    %s rank %d at start: parameter peak %.6f MiB (want %.6f: stage %.6f whole-width, %.6f shard; whole "
               "model + shard model %.6f)\n", run, r, pk, want, wide * 4.0 / 1048576.0, shard * 4.0 / 1048576.0,
               before * 4.0 / 1048576.0);
        CHECK(fabs(pk - want) <= 1e-6 * want, "%s rank %d: parameter peak %.6f MiB during setup, want %.6f", run, r, pk,
              want);
        CHECK(peak < wide + shard && peak < before, "%s rank %d: cutting peak %lld elements", run, r, (long long)peak);
        /* a resume reads the stage's whole-width AdamW state and slices it into the
         * shard's (pp_setup.c): both held at once, nothing of another stage */
        double want_opt = resumed ? (double)(wide + shard) * 8.0 / 1048576.0 : 0.0;
        printf("    %s rank %d at start: optimizer peak %.6f MiB (want %.6f)\n", run, r, ok, want_opt);
        CHECK(fabs(ok - want_opt) <= 1e-6 * want_opt, "%s rank %d: optimizer-state peak %.6f MiB during setup, want "
              "%.6f", run, r, ok, want_opt);
    }
}

/* The last memory record of run's log (after the final checkpoint): rank r's measured
 * peaks over the whole run of the parameter and optimizer-state categories, MiB. */
static bool end_peaks(const char *run, int r, double *param_peak, double *optim_peak) {
    char path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath(run));
    return tr_memory_peaks(path, NULL, r, param_peak, optim_peak);
}

/* Over a whole run with its final checkpoint (written by rank 0 one tensor at a time,
 * each fetched from its stage: pp_ckpt.c), rank r (r >= from) never held more
 * parameters than its stage's (x 4 bytes) nor more optimizer state than the stage's
 * AdamW moments (x 8). Before, the checkpoint gave every rank the whole model and rank 0
 * the whole optimizer state. */
static void check_run_peak(const char *run, const char *preset, int pp, int world, int from) {
    int64_t whole = stage_numel(preset, 1, 0, 0, 1);
    for (int r = from; r < world; r++) {
        double pk = NAN, ok = NAN;
        int64_t n = stage_numel(preset, 1, 0, r % pp, pp);
        double want = n * 4.0 / 1048576.0;
        CHECK(end_peaks(run, r, &pk, &ok), "%s: no measured peaks for rank %d", run, r);
        printf("    %s rank %d over the run: parameter peak %.6f MiB (stage %.6f, whole model %.6f), optimizer peak "
               "%.6f MiB (stage %.6f)\n", run, r, pk, want, whole * 4.0 / 1048576.0, ok, 2 * want);
        CHECK(fabs(pk - want) <= 1e-6 * want, "%s rank %d: parameter peak %.6f MiB over the run, the stage's %.6f", run,
              r, pk, want);
        CHECK(fabs(ok - 2 * want) <= 1e-6 * want, "%s rank %d: optimizer-state peak %.6f MiB over the run, the stage's "
              "%.6f", run, r, ok, 2 * want);
    }
}

/* The newest checkpoints of run and ref have byte-identical model and optimizer files. */
static void check_same_files(const char *run, const char *ref) {
    static const char *const files[] = {"model.safetensors", "optimizer.safetensors"};
    char a[1024], b[1024];
    REQUIRE(anneal_checkpoint_resolve(wpath(run), a, sizeof a) == ANNEAL_OK);
    REQUIRE(anneal_checkpoint_resolve(wpath(ref), b, sizeof b) == ANNEAL_OK);
    for (int k = 0; k < 2; k++) {
        char pa[1200], pb[1200];
        snprintf(pa, sizeof pa, "%s/%s", a, files[k]);
        snprintf(pb, sizeof pb, "%s/%s", b, files[k]);
        size_t na = 0, nb = 0;
        char *x = tr_read_all(pa, &na), *y = tr_read_all(pb, &nb);
        CHECK(x && y && na == nb && memcmp(x, y, na) == 0, "%s of %s (%zu bytes) and %s (%zu bytes) differ", files[k],
              run, na, ref, nb);
        free(x);
        free(y);
    }
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
    check_memory("pp2", "tiny", 1, 2, 2, true);
    check_setup_peak("pp2", "tiny", 2, 2, false);
    check_run_peak("pp2", "tiny", 2, 2, 0);
    check_val_loss("pp2", "single");
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
    check_setup_peak("llama_pp2", "llama-tiny", 2, 2, false); /* the stage's tensors alone got the init's bits */
    check_run_peak("llama_pp2", "llama-tiny", 2, 2, 0);
    check_same_files("llama_pp2", "llama_single"); /* the streamed checkpoint is one process's, byte for byte */
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
    check_memory("pp2dp2", "tiny", 1, 2, 4, false);
}

/* --tp 2 x --pp 2 at 4 ranks (ranks 0-1 stage 0, 2-3 stage 1; tensor-parallel pairs of
 * consecutive ranks) = one process within float tolerance (the row-parallel sums and
 * the tied wte's sum reorder float additions; the first step is no longer exact: the
 * tensor-parallel all-reduces add partial products in another order); the layout
 * printed and stored; each rank holds its stage's tensor-parallel shard only. */
TEST(tp2_pp2_matches_single_process) {
    NEED_MPI();
    REQUIRE(train(mpi4, "tp2pp2", "--tp 2 --pp 2") == 0);
    check_same_losses("tp2pp2", "single", steps, false);
    check_same_params("tp2pp2", "single", false);
    const char *o = tu_slurp(wpath("tp2pp2.out"));
    CHECK(strstr(o, "parallel layout: 4 ranks = tensor-parallel 2 x pipeline 2 x data-parallel 1") != NULL,
          "layout: %s", o);
    CHECK(strstr(o, "rank 1: stage 0 (blocks 0-0, embedding), tp rank 1, replica 0") != NULL, "layout: %s", o);
    CHECK(strstr(o, "rank 2: stage 1 (blocks 1-1, final norm + head), tp rank 0, replica 0") != NULL, "layout: %s", o);
    CHECK(strstr(o, "vocabulary split") != NULL, "the vocabulary is split over the tensor-parallel pairs: %s", o);
    check_bubble("tp2pp2", 1.0 / 5.0);
    check_memory("tp2pp2", "tiny", 2, 2, 4, true);
    check_setup_peak_tp("tp2pp2", "tiny", 2, 2, 4, false);
    check_val_loss("tp2pp2", "single");
    char ck[1024];
    REQUIRE(anneal_checkpoint_resolve(wpath("tp2pp2"), ck, sizeof ck) == ANNEAL_OK);
    anneal_model_config mc;
    char *json = NULL;
    REQUIRE(anneal_checkpoint_read_config(ck, &mc, &json) == ANNEAL_OK);
    CHECK(json && strstr(json, "\"pp\":2") && strstr(json, "\"tp\":2"), "the checkpoint's config: %s",
          json ? json : "(none)");
    free(json);
}

/* Llama tiny (untied head, GQA) at --tp 2 x --pp 2: the pipeline adds nothing to the
 * tensor-parallel run's float order (no tied tensor), so its parameters after 20 steps
 * are bit-identical to --tp 2 alone at 2 ranks (==); the logged losses match within
 * LOSS_RTOL only (--tp alone reports the mean through the sync's f32 all-reduce, the
 * pipeline its double mean), and are one process's within LOSS_RTOL. Its parameters
 * are not held to PARAM_L2_RTOL against one process: --tp 2 alone (this accumulation,
 * 20 steps) already differs by 1.4e-5 relative L2, 2.7e-4 at most (an embedding row
 * with tiny gradients, which AdamW's normalisation amplifies); that is tensor
 * parallelism's own reordering (test_train_tp.c), not the pipeline's. */
TEST(llama_tp2_pp2_matches_tp2) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    if (access(wpath("llama_single"), F_OK) != 0) /* pp2_untied_model_is_bit_identical made it */
        REQUIRE(train("", "llama_single", "--model llama-tiny") == 0);
    REQUIRE(train(mpi2, "llama_tp2", "--model llama-tiny --tp 2") == 0);
    REQUIRE(train(mpi4, "llama_tp2pp2", "--model llama-tiny --tp 2 --pp 2") == 0);
    check_same_losses("llama_tp2pp2", "llama_tp2", steps, false);
    check_same_params("llama_tp2pp2", "llama_tp2", true);
    check_same_losses("llama_tp2pp2", "llama_single", steps, false);
    check_memory("llama_tp2pp2", "llama-tiny", 2, 2, 4, true);
}

/* The three together at 8 ranks: --tp 2 x --pp 2 x 2 replicas, ZeRO 1 and 2 over the
 * replicas of each stage and tp index = one process within the tolerances. */
TEST(tp2_pp2_dp2_zero_matches_single_process) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    char mpi8[512];
    snprintf(mpi8, sizeof mpi8, "mpirun -np 8 --allow-run-as-root --oversubscribe %s", mpi_env);
    REQUIRE(train(mpi8, "tpppz1", "--tp 2 --pp 2 --zero 1") == 0);
    REQUIRE(train(mpi8, "tpppz2", "--tp 2 --pp 2 --zero 2") == 0);
    check_same_losses("tpppz1", "single", steps, false);
    check_same_params("tpppz1", "single", false);
    check_same_losses("tpppz2", "single", steps, false);
    check_same_params("tpppz2", "single", false);
    const char *o = tu_slurp(wpath("tpppz1.out"));
    CHECK(strstr(o, "parallel layout: 8 ranks = tensor-parallel 2 x pipeline 2 x data-parallel 2") != NULL,
          "layout: %s", o);
    CHECK(strstr(o, "rank 5: stage 0 (blocks 0-0, embedding), tp rank 1, replica 1") != NULL, "layout: %s", o);
    check_memory("tpppz1", "tiny", 2, 2, 8, false);
}

/* Every "text" ("sample") or "val_loss" ("eval") of run's log, joined with '|'. */
static void log_values(const char *run, const char *type, char *out, size_t n) {
    char path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath(run));
    tr_log_values(path, type, out, n);
}

/* Real text with a tokenizer, llama-tiny (bit-identical through the pipeline):
 * evaluations (through the stages, the last one's double mean broadcast), samples
 * (through the stages too: each token's forward goes stage to stage, the last samples
 * and broadcasts the id, split_sample.c) and checkpoints every 5 steps in the middle of a
 * --pp 2 run leave training on its course, and give the very values of one process: the
 * same losses, sample texts, parameters and val losses (==); and no rank ever held more
 * parameters than its stage's (before, rank 0 gathered the whole model to sample). */
TEST(pp2_eval_samples_checkpoints) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    TU_DIR_AND_DATA(dir, data, "pp_data");
    char extra[2048];
    snprintf(extra, sizeof extra, "--data %s --model llama-tiny --eval-every 5 --eval-batches 2 --sample-every 5 "
             "--sample-tokens 8 --ckpt-every 5", data);
    int rc[2];
    for (int k = 0; k < 2; k++) {
        char cmd[4096], out[600];
        snprintf(cmd, sizeof cmd, "exec %s %s train %s %s%s --out %s", k ? mpi2 : "", bin, common + strlen("--synthetic "),
                 extra, k ? " --pp 2" : "", wpath(k ? "text_pp2" : "text1"));
        snprintf(out, sizeof out, "%s.out", wpath(k ? "text_pp2" : "text1"));
        rc[k] = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
        if (rc[k] != 0) dump(out);
    }
    tu_rmrf(dir);
    REQUIRE(rc[0] == 0 && rc[1] == 0);
    check_same_losses("text_pp2", "text1", steps, true);
    check_same_params("text_pp2", "text1", true);
    static char a[8192], b[8192];
    log_values("text_pp2", "sample", a, sizeof a);
    log_values("text1", "sample", b, sizeof b);
    printf("    sample records: %s\n", a);
    CHECK(a[0] && !strcmp(a, b), "samples of --pp 2: %s; one process: %s", a, b);
    log_values("text_pp2", "eval", a, sizeof a);
    log_values("text1", "eval", b, sizeof b);
    printf("    eval records: %s (one process: %s)\n", a, b);
    int n = 0;
    for (char *p = a, *q = b; *p && *q; n++) {
        double x = strtod(p, &p), y = strtod(q, &q);
        CHECK(x == y, "evaluation %d: val loss %.17g, one process %.17g", n + 1, x, y);
        p += *p == '|', q += *q == '|';
    }
    CHECK(n == steps / 5, "%d evaluations, want %d", n, steps / 5);
    check_run_peak("text_pp2", "llama-tiny", 2, 2, 0);
}

/* Samples through 4 stages (two middle stages receive and send the window's hidden
 * state): a 4-block untied Llama, one block per stage, samples the text one process
 * samples; at pp 2 x 2 replicas every sample is printed (no rank waits); at tp 2 x pp 2
 * (each stage's group runs its blocks on its shards, the last stage's logits gathered
 * over the vocabulary, its tp rank 0 samples for both pipelines) the text is one
 * process's too. */
TEST(pp4_samples_through_middle_stages) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    TU_DIR_AND_DATA(dir, data, "pp4_data");
    char cfg[600], extra[2048];
    snprintf(cfg, sizeof cfg, "%s/llama4s.json", work);
    FILE *f = fopen(cfg, "w");
    REQUIRE(f);
    fputs("{\"model_type\": \"llama\", \"num_hidden_layers\": 4, \"num_attention_heads\": 4, "
          "\"num_key_value_heads\": 2, \"hidden_size\": 64, \"intermediate_size\": 128, \"vocab_size\": 512, "
          "\"max_position_embeddings\": 256, \"rms_norm_eps\": 1e-5, \"tie_word_embeddings\": false}\n", f);
    fclose(f);
    snprintf(extra, sizeof extra, "--data %s --config %s --steps %d --sample-every 5 --sample-tokens 12", data, cfg,
             steps / 2);
    int rc[4];
    static const char *const runs[4] = {"s4_single", "s4_pp4", "s4_pp2dp2", "s4_tp2pp2"},
                             *const how[4] = {"", " --pp 4", " --pp 2", " --tp 2 --pp 2"};
    for (int k = 0; k < 4; k++) {
        char cmd[4096], out[600];
        snprintf(cmd, sizeof cmd, "exec %s %s train %s %s%s --out %s", k ? mpi4 : "", bin, common + strlen("--synthetic "),
                 extra, how[k], wpath(runs[k]));
        snprintf(out, sizeof out, "%s.out", wpath(runs[k]));
        rc[k] = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
        if (rc[k] != 0) dump(out);
    }
    tu_rmrf(dir);
    REQUIRE(rc[0] == 0 && rc[1] == 0 && rc[2] == 0 && rc[3] == 0);
    check_same_losses("s4_pp4", "s4_single", steps / 2, true);
    check_same_losses("s4_tp2pp2", "s4_single", steps / 2, false);
    static char a[8192], b[8192];
    log_values("s4_pp4", "sample", a, sizeof a);
    log_values("s4_single", "sample", b, sizeof b);
    printf("    sample records: %s\n", a);
    CHECK(a[0] && !strcmp(a, b), "samples of --pp 4: %s; one process: %s", a, b);
    /* --pp 2 x 2 replicas: replica 0 samples through its stages, replica 1 takes no part
     * (the DDP mean moves the weights by float rounding: the count of samples is checked) */
    log_values("s4_pp2dp2", "sample", a, sizeof a);
    int na = 0, nb = 0;
    for (const char *p = a; *p; p++) na += *p == '|';
    for (const char *p = b; *p; p++) nb += *p == '|';
    CHECK(na == nb && nb == 2, "--pp 2 x 2 replicas: %d samples (%s), one process %d", na, a, nb);
    log_values("s4_tp2pp2", "sample", a, sizeof a);
    printf("    tp 2 x pp 2 sample records: %s\n", a);
    CHECK(!strcmp(a, b), "samples of --tp 2 --pp 2: %s; one process: %s", a, b);
}

/* `launcher anneal train <common> --init from <extra> --out work/<run>` (no --model:
 * the architecture is the source's): the exit code. */
static int train_init(const char *launcher, const char *run, const char *from, const char *extra) {
    char cmd[4096], out[600];
    snprintf(cmd, sizeof cmd, "exec %s %s train %s --init %s %s --out %s", launcher, bin, common, from, extra,
             wpath(run));
    snprintf(out, sizeof out, "%s.out", wpath(run));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) dump(out);
    return rc;
}

/* --init under --pp reads only the stage's tensors (pp_setup.c): from a Hugging Face
 * directory (one process's llama-tiny checkpoint exported with `anneal export`) and from
 * a checkpoint (that run's directory), a --pp 2 run is bit-identical to one process
 * started the same way (llama-tiny: untied), and each rank's parameter peak up to the
 * first step is its stage's (before, every rank built and loaded the whole model). */
TEST(pp2_init_reads_the_stage_only) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time)");
    if (access(wpath("llama_single"), F_OK) != 0) /* pp2_untied_model_is_bit_identical made it */
        REQUIRE(train("", "llama_single", "--model llama-tiny") == 0);
    char cmd[2048], out[600], extra[128];
    snprintf(cmd, sizeof cmd, "exec %s export --ckpt %s --out %s --tokenizer none", bin, wpath("llama_single"),
             wpath("llama_hf"));
    snprintf(out, sizeof out, "%s.out", wpath("llama_hf"));
    int rc = tr_sh_run(cmd, out, RUN_TIMEOUT_S);
    if (rc != 0) dump(out);
    REQUIRE(rc == 0);
    snprintf(extra, sizeof extra, "--steps %d", steps / 2);
    static const char *const from[2] = {"llama_hf", "llama_single"};
    static const char *const one[2] = {"init_hf1", "init_ck1"}, *const two[2] = {"init_hf_pp2", "init_ck_pp2"};
    for (int k = 0; k < 2; k++) {
        REQUIRE(train_init("", one[k], wpath(from[k]), extra) == 0);
        char e2[160];
        snprintf(e2, sizeof e2, "%s --pp 2", extra);
        REQUIRE(train_init(mpi2, two[k], wpath(from[k]), e2) == 0);
        check_same_losses(two[k], one[k], steps / 2, true);
        check_same_params(two[k], one[k], true);
        check_setup_peak(two[k], "llama-tiny", 2, 2, false);
    }
    /* --tp 2 x --pp 2: the stage's whole-width tensors read, the shards cut from them
     * (tp.c); one process's trajectory within the tolerances (tensor parallelism's sums) */
    snprintf(extra, sizeof extra, "--steps %d --tp 2 --pp 2", steps / 2);
    REQUIRE(train_init(mpi4, "init_hf_tp2pp2", wpath("llama_hf"), extra) == 0);
    check_same_losses("init_hf_tp2pp2", "init_hf1", steps / 2, false);
    check_setup_peak_tp("init_hf_tp2pp2", "llama-tiny", 2, 2, 4, false);
    /* and not from a fresh start: the loaded weights (the first loss is the trained model's) */
    double a[64], b[64];
    losses_of("init_hf_pp2", a);
    losses_of("llama_single", b);
    CHECK(a[0] < b[0] - 0.2, "--init's first loss %.5f is not below a fresh model's %.5f", a[0], b[0]);
}

/* Stopped at half under --tp 2 --pp 2, resumed on one process; and one process's
 * checkpoint resumed under --tp 2 --pp 2: both continue the single-process run. */
TEST(resume_tp2_pp2_and_one_process) {
    NEED_MPI();
    char stop[64];
    snprintf(stop, sizeof stop, "--tp 2 --pp 2 --stop-at %d", steps / 2);
    REQUIRE(train(mpi4, "rtp1", stop) == 0);
    REQUIRE(resume("", "rtp1", "--tp 1 --pp 1") == 0);
    check_same_losses("rtp1", "single", steps, false);
    check_same_params("rtp1", "single", false);
    snprintf(stop, sizeof stop, "--stop-at %d", steps / 2);
    REQUIRE(train("", "r1tp", stop) == 0);
    REQUIRE(resume(mpi4, "r1tp", "--tp 2 --pp 2") == 0);
    check_same_losses("r1tp", "single", steps, false);
    check_same_params("r1tp", "single", false);
    CHECK(strstr(tu_slurp(wpath("r1tp.resume.out")), "tensor-parallel 2 x pipeline 2") != NULL,
          "the resume runs tp x pp");
    check_setup_peak_tp("r1tp", "tiny", 2, 2, 4, true); /* the stage's tensors and state read, then cut */
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

/* fp16 through the stages: the loss scaled at the last stage, the overflow agreed over
 * the world. An Inf put into the last stage's gradient alone at steps 4 and 5 (the test
 * hook ANNEAL_TEST_INF_GRAD) skips those steps and halves the scale on every rank, as
 * the same Inf does in one process. Under --deterministic (fixed reduction trees) the
 * runs are one process's bit for bit: pp 2, tp 2 x pp 2 (the Inf on the last stage's
 * second tensor-parallel rank) and a pp 2 run stopped at half and resumed on one
 * process (the scale carried by the checkpoint). Without it the scales and overflows
 * are one process's and the losses finite (fp16 operand rounding turns the other
 * summation orders into differences of the order of 2^-11: not compared). */
TEST(fp16_overflow_agreed_over_stages) {
    NEED_MPI();
    const char *fp16 = "--dtype fp16 --scale-growth-interval 3";
    char one[128], two[1024], four[1024], extra[256];
    snprintf(one, sizeof one, "env ANNEAL_TEST_INF_GRAD=0:4,5");
    snprintf(two, sizeof two, "%s -x ANNEAL_TEST_INF_GRAD=1:4,5", mpi2);
    snprintf(four, sizeof four, "%s -x ANNEAL_TEST_INF_GRAD=3:4,5", mpi4);
    snprintf(extra, sizeof extra, "%s --deterministic", fp16);
    REQUIRE(train(one, "f16", extra) == 0);
    REQUIRE(train(one, "f16nd", fp16) == 0);
    snprintf(extra, sizeof extra, "--pp 2 %s --deterministic", fp16);
    REQUIRE(train(two, "f16pp2", extra) == 0);
    snprintf(extra, sizeof extra, "--tp 2 --pp 2 %s --deterministic", fp16);
    REQUIRE(train(four, "f16tp2pp2", extra) == 0);
    snprintf(extra, sizeof extra, "--pp 2 %s --deterministic --stop-at %d", fp16, steps / 2);
    REQUIRE(train(two, "f16r21", extra) == 0);
    REQUIRE(resume(one, "f16r21", "--pp 1") == 0);
    snprintf(extra, sizeof extra, "--tp 2 --pp 2 %s", fp16);
    REQUIRE(train(four, "f16tp2pp2nd", extra) == 0);
    char ref[2048], got[2048], path[600];
    snprintf(path, sizeof path, "%s/log.jsonl", wpath("f16"));
    tr_scale_trace(path, ref, sizeof ref);
    printf("    one process: loss scales %s\n", ref);
    /* 3 clean steps at 2^16, grown; the hook's two overflows back it off twice */
    CHECK(strncmp(ref, "65536|65536|65536|131072O|65536O|32768|", 39) == 0, "one process's scales: %s", ref);
    const char *runs[] = {"f16pp2", "f16tp2pp2", "f16r21", "f16nd", "f16tp2pp2nd"};
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/log.jsonl", wpath(runs[i]));
        tr_scale_trace(path, got, sizeof got);
        CHECK(strcmp(got, ref) == 0, "%s: loss scales %s, one process %s", runs[i], got, ref);
        if (i < 3) {
            check_same_losses(runs[i], "f16", steps, true);
            check_same_params(runs[i], "f16", true);
        }
    }
    double l[64];
    int n = losses_of("f16tp2pp2nd", l), finite = 0;
    for (int i = 0; i < n; i++) finite += isfinite(l[i]) != 0;
    CHECK(n == steps && finite == steps, "f16tp2pp2nd: %d steps, %d finite losses", n, finite);
}

/* --offload through the stages: each rank keeps its stage's AdamW state in a file of its
 * own (--offload optimizer) and every in-flight micro-batch's saved tensors in another
 * (activations). Under --deterministic the runs are one process's bits: pp 2 with both
 * tiers and checkpoints every 7 steps (the state taken out of the file and put back),
 * tp 2 x pp 2 with the optimizer tier, and a pp 2 run with it stopped at half and
 * resumed on one process. */
TEST(offload_through_stages) {
    NEED_MPI();
    REQUIRE(train("", "det1", "--deterministic") == 0);
    REQUIRE(train(mpi2, "offpp2", "--pp 2 --offload optimizer,activations --deterministic --ckpt-every 7") == 0);
    REQUIRE(train(mpi4, "offtp2pp2", "--tp 2 --pp 2 --offload optimizer --deterministic --ckpt-every 7") == 0);
    char extra[256];
    snprintf(extra, sizeof extra, "--pp 2 --offload optimizer --deterministic --stop-at %d", steps / 2);
    REQUIRE(train(mpi2, "offr21", extra) == 0);
    REQUIRE(resume("", "offr21", "--pp 1") == 0);
    const char *runs[] = {"offpp2", "offtp2pp2", "offr21"};
    for (int i = 0; i < 3; i++) {
        check_same_losses(runs[i], "det1", steps, true);
        check_same_params(runs[i], "det1", true);
        char out[600];
        snprintf(out, sizeof out, "%s.out", wpath(runs[i]));
        const char *o = tu_slurp(out);
        CHECK(o && strstr(o, "optimizer state offloaded: ") && strstr(o, "every rank has a file of its own"),
              "%s: no offload note: %s", runs[i], o ? o : "");
    }
    const char *o = tu_slurp(wpath("offpp2.out"));
    CHECK(o && strstr(o, "activations offloaded:"), "offpp2: no activation offload note: %s", o ? o : "");
}

/* PowerSGD over the replicas of --pp 2 x 2: each stage compresses its gradients over its
 * data-parallel group, the tied embedding's summed over the first and last stage first
 * (so the compressed gradient is the whole one). Warm-up steps as uncompressed, then at
 * least 4x fewer bytes; stopped at half and resumed, the straight run's bits. */
TEST(powersgd_over_stage_replicas) {
    NEED_MPI();
    const char *ps = "--pp 2 --grad-compress powersgd --powersgd-rank 2 --powersgd-warmup-steps 3";
    char extra[256];
    REQUIRE(train(mpi4, "pspp", ps) == 0);
    snprintf(extra, sizeof extra, "%s --stop-at %d --ckpt-every %d", ps, steps / 2, steps / 2);
    REQUIRE(train(mpi4, "psppr", extra) == 0);
    REQUIRE(resume(mpi4, "psppr", "") == 0);
    char a[600], b[600], c[600];
    snprintf(a, sizeof a, "%s/log.jsonl", wpath("pspp"));
    snprintf(b, sizeof b, "%s/log.jsonl", wpath("psppr"));
    snprintf(c, sizeof c, "%s/log.jsonl", wpath("pp2dp2"));
    tr_check_powersgd(a, b, c, steps, 3, LOSS_RTOL);
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
    check_setup_peak("r12", "tiny", 2, 2, true); /* one process's checkpoint read a stage at a time */
}

/* The fault shim (tests/fault/fault_shim.c) beside the anneal binary, or NULL. */
static const char *fault_shim(void) {
    static char p[1024];
    snprintf(p, sizeof p, "%s", bin);
    char *slash = strrchr(p, '/');
    if (!slash) return NULL;
    snprintf(slash + 1, sizeof p - (size_t)(slash + 1 - p), "libanneal_fault_shim.so");
    return access(p, R_OK) == 0 ? p : NULL;
}

/* `mpirun -np 2 anneal train ... --pp 2 --out work/<run>` with rank 0 alone (the writer
 * of a streamed checkpoint) under the fault shim: counting from the first operation on
 * a path with `arm`, the at-th fails with errno (sticky: and every one after); trace:
 * each counted operation on stderr. The exit code. */
static int train_faulty(const char *run, const char *extra, const char *arm, long at, const char *err, bool sticky,
                        bool trace) {
    char wrap[600], cmd[4096], out[600];
    snprintf(wrap, sizeof wrap, "%s/rank0_shim.sh", work);
    FILE *f = fopen(wrap, "w");
    if (!f) return -1;
    fprintf(f, "#!/bin/sh\nif [ \"$OMPI_COMM_WORLD_RANK\" = 0 ]; then export LD_PRELOAD=%s; fi\nexec \"$@\"\n",
            fault_shim());
    fclose(f);
    chmod(wrap, 0755);
    snprintf(cmd, sizeof cmd, "exec %s -x ANNEAL_FAULT_PATH=%s -x ANNEAL_FAULT_SKIP=log.jsonl -x ANNEAL_FAULT_ARM=%s "
             "-x ANNEAL_FAULT_AT=%ld -x ANNEAL_FAULT_ERRNO=%s -x ANNEAL_FAULT_STICKY=%d -x ANNEAL_FAULT_TRACE=%d %s %s "
             "train %s --model tiny --steps 4 --ckpt-every 2 --pp 2 %s --out %s", mpi2, wpath(run), arm, at, err,
             sticky ? 1 : 0, trace ? 1 : 0, wrap, bin, common, extra, wpath(run));
    snprintf(out, sizeof out, "%s.out", wpath(run));
    return tr_sh_run(cmd, out, RUN_TIMEOUT_S);
}

/* Names in run's directory that start with prefix, joined with ' ' into out. */
static int names_with(const char *run, const char *prefix, char *out, size_t n) {
    DIR *d = opendir(wpath(run));
    int k = 0;
    size_t used = 0;
    out[0] = '\0';
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (!strncmp(e->d_name, prefix, strlen(prefix))) {
            k++;
            used += (size_t)snprintf(out + used, used < n ? n - used : 0, "%s ", e->d_name);
            if (used >= n) used = n - 1;
        }
    if (d) closedir(d);
    return k;
}

/* Checkpoint ckpt_<step> of run and of ref have byte-identical files. */
static void check_same_ckpt(const char *run, const char *ref, int step) {
    static const char *const files[] = {"model.safetensors", "optimizer.safetensors"};
    for (int k = 0; k < 2; k++) {
        char a[1024], b[1024];
        snprintf(a, sizeof a, "%s/ckpt_%08d/%s", wpath(run), step, files[k]);
        snprintf(b, sizeof b, "%s/ckpt_%08d/%s", wpath(ref), step, files[k]);
        size_t na, nb;
        char *x = tr_read_all(a, &na), *y = tr_read_all(b, &nb);
        CHECK(x && y && na == nb && !memcmp(x, y, na), "%s differs from %s (%zu vs %zu bytes)", a, b, na, nb);
        free(x);
        free(y);
    }
}

/* A streamed checkpoint write (rank 0 writing, stage 1 sending its tensors, pp_ckpt.c)
 * that fails midway, injected by the fault shim on rank 0: in the middle of the model
 * file's writes (EIO) and of the optimizer file's (ENOSPC) of the final checkpoint
 * (step 4): the job ends (no rank left waiting) with an error naming the errno, the
 * failed step and the newest complete checkpoint; the step-2 checkpoint is intact (the
 * clean run's bytes, `latest` names it), nothing of step 4 is left (no ckpt_00000004, no
 * .tmp_* directory); a --pp 2 resume from it ends as the clean run (losses ==, the same
 * final checkpoint bytes). And a disk that stays full from the step-2 checkpoint on with
 * --max-ckpt-failures 1 stops the job with that message, leaving no checkpoint at all. */
TEST(pp2_failed_streamed_checkpoint) {
    NEED_MPI();
    if (anneal_test_sanitized()) SKIP("sanitized build: Release only (time; LD_PRELOAD under ASan)");
    if (!fault_shim()) SKIP("no libanneal_fault_shim.so beside ANNEAL_BIN (the build makes it)");
    REQUIRE(train(mpi2, "ckf_clean", "--steps 4 --ckpt-every 2 --pp 2") == 0);
    /* counting: where the model and optimizer files of the step-4 checkpoint are written */
    REQUIRE(train_faulty("ckf_count", "", "ckpt_00000004", 0, "EIO", false, true) == 0);
    const char *t = tu_slurp(wpath("ckf_count.out"));
    long first[2] = {0, 0}, last[2] = {0, 0};
    int file = -1;
    for (const char *q = strstr(t, "[fault] "); q; q = strstr(q + 1, "[fault] ")) {
        long k = atol(q + 8);
        const char *op = strchr(q + 8, ' ');
        if (!op) break;
        op++;
        if (!strncmp(op, "open ", 5)) {
            const char *eol = strchr(op, '\n');
            const char *m = strstr(op, "model.safetensors.tmp"), *o = strstr(op, "optimizer.safetensors.tmp");
            file = m && (!eol || m < eol) ? 0 : o && (!eol || o < eol) ? 1 : -1;
        } else if (!strncmp(op, "write", 5) && file >= 0) {
            if (!first[file]) first[file] = k;
            last[file] = k;
        } else if (strncmp(op, "write", 5)) {
            file = -1;
        }
    }
    printf("    step-4 checkpoint: model file writes %ld-%ld, optimizer file writes %ld-%ld\n", first[0], last[0],
           first[1], last[1]);
    REQUIRE(first[0] > 0 && last[0] - first[0] >= 4 && first[1] > 0 && last[1] - first[1] >= 4);
    static const char *const errs[2] = {"EIO", "ENOSPC"}, *const texts[2] = {"Input/output error",
                                                                               "No space left on device"};
    static const char *const runs[2] = {"ckf_model", "ckf_optim"};
    for (int k = 0; k < 2; k++) {
        long at = (first[k] + last[k]) / 2;
        int rc = train_faulty(runs[k], "", "ckpt_00000004", at, errs[k], false, false);
        char outp[700];
        snprintf(outp, sizeof outp, "%s.out", wpath(runs[k]));
        const char *o = tu_slurp(outp);
        printf("    %s: write %ld of the step-4 checkpoint fails with %s: exit %d\n", runs[k], at, errs[k], rc);
        CHECK(rc > 0 && rc < 128, "%s: the job must fail with an error (not crash or hang): exit %d: %s", runs[k], rc, o);
        CHECK(strstr(o, "the checkpoint of step 4 failed") && strstr(o, texts[k]) &&
              strstr(o, "the newest complete checkpoint is") && strstr(o, "ckpt_00000002"),
              "%s: no clear error: %s", runs[k], o);
        char names[1024];
        CHECK(names_with(runs[k], ".tmp", names, sizeof names) == 0, "%s: left behind: %s", runs[k], names);
        CHECK(names_with(runs[k], "ckpt_00000004", names, sizeof names) == 0, "%s: left behind: %s", runs[k], names);
        char ck[1024];
        REQUIRE(anneal_checkpoint_resolve(wpath(runs[k]), ck, sizeof ck) == ANNEAL_OK);
        CHECK(strstr(ck, "ckpt_00000002") != NULL, "%s: latest is %s", runs[k], ck);
        check_same_ckpt(runs[k], "ckf_clean", 2);
        REQUIRE(resume(mpi2, runs[k], "--pp 2") == 0);
        check_same_losses(runs[k], "ckf_clean", 4, true);
        check_same_files(runs[k], "ckf_clean");
    }
    /* a disk that stays full from the first checkpoint on, --max-ckpt-failures 1 */
    int rc = train_faulty("ckf_full", "--max-ckpt-failures 1", "ckpt_00000002", 5, "ENOSPC", true, false);
    const char *o = tu_slurp(wpath("ckf_full.out"));
    CHECK(rc > 0 && rc < 128, "ckf_full: exit %d: %s", rc, o);
    CHECK(strstr(o, "No space left on device") && strstr(o, "1 checkpoint write in a row failed (step 2)") &&
          strstr(o, "the newest complete checkpoint is none"), "ckf_full: no clear error: %s", o);
    char names[1024];
    CHECK(names_with("ckf_full", ".tmp", names, sizeof names) == 0 &&
          names_with("ckf_full", "ckpt_", names, sizeof names) == 0, "ckf_full: left behind: %s", names);
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
    refused(mpi2, "bad_psgd", "--pp 2 --grad-compress powersgd", "this job has none (start a multiple of 4 ranks");
    refused(mpi4, "bad_psgd16", "--pp 2 --grad-compress powersgd --dtype fp16", "not available with the fp16 loss scaler");
    refused(mpi2, "bad_tppp", "--tp 2 --pp 2", "--tp 2 x --pp 2 = 4 does not divide the 2 ranks of the job");
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
    RUN(tp2_pp2_matches_single_process);
    RUN(llama_tp2_pp2_matches_tp2);
    RUN(tp2_pp2_dp2_zero_matches_single_process);
    RUN(resume_tp2_pp2_and_one_process);
    RUN(resume_between_layouts);
    RUN(pp2_eval_samples_checkpoints);
    RUN(pp4_samples_through_middle_stages);
    RUN(pp2_init_reads_the_stage_only);
    RUN(pp2_failed_streamed_checkpoint);
    RUN(fp16_overflow_agreed_over_stages);
    RUN(offload_through_stages);
    RUN(powersgd_over_stage_replicas);
    RUN(bad_layouts);
    if (anneal_test_failed == 0) tu_rmrf(work);
    else printf("kept %s for inspection\n", work);
    return anneal_test_summary();
}
