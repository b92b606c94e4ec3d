/* Exact resume with mixed precision, through the binary on real text: for --dtype bf16
 * and fp16, 16 straight steps vs 7 steps (--stop-at 7) + --resume + 9 give
 * bit-identical losses at every step and byte-identical model and optimizer files.
 * The fp16 runs start at a loss scale of 2^26 with --scale-growth-interval 3, so the
 * scaler backs off (the first steps overflow) and grows during the run and is
 * mid-count (growth tracker != 0) when the run stops: only a restored scaler state
 * reproduces the logged scales.
 * Also: resuming at another --dtype is allowed and said in the start line, and a
 * checkpoint written before mixed precision existed (state.json without "dtype" and
 * "loss_scaler") still resumes, as fp32 with a fresh scaler. anneal eval and generate
 * accept --dtype; an unknown precision is a usage error (exit 2) everywhere. */
#include "test.h"
#include "train/train_util.h"

static char args[4096];

/* Each step's loss and (fp16) loss scale (0 when not logged) from a run directory's log;
 * the last record of a step wins. Returns the highest step. */
static int read_run(const char *run, double *loss, double *scale, int n) {
    char p[700];
    snprintf(p, sizeof p, "%s/log.jsonl", run);
    const int hi = tu_read_losses(p, loss, NULL, n);
    return tu_read_steps(p, "loss_scale", 0.0, scale, NULL, NULL, n) == hi ? hi : 0;
}

/* Straight vs stopped + resumed at one dtype; extra: more flags for both. */
static void straight_vs_resumed(const char *dir, const char *data, const char *dtype, const char *extra) {
    char out[600];
    snprintf(out, sizeof out, "%s/out.txt", dir);
    char common[1024];
    snprintf(common, sizeof common,
             "train --model tiny --steps 16 --batch 4 --seq 32 --lr 3e-3 --warmup 3 --dropout 0.1 --seed 7 --threads 2 "
             "--eval-every 5 --eval-batches 2 --ckpt-every 4 --keep 2 --peak-gflops 100 --dtype %s %s --data %s",
             dtype, extra, data);
    snprintf(args, sizeof args, "%s --out %s/%s_straight", common, dir, dtype);
    int rc = tu_run_anneal(args, out, 0);
    REQUIRE(rc == 0);
    snprintf(args, sizeof args, "%s --out %s/%s_split --stop-at 7", common, dir, dtype);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(tu_slurp(out), "stopped at step 7"), "exit %d: %s", rc, tu_slurp(out));
    if (!strcmp(dtype, "fp16")) {
        /* the state at the interruption is mid-count (pruned by --keep after the resume) */
        char st[800];
        snprintf(st, sizeof st, "%s/%s_split/ckpt_00000007/state.json", dir, dtype);
        const char *js = tu_slurp(st);
        CHECK(strstr(js, "\"dtype\":\t\"fp16\"") && strstr(js, "\"loss_scaler\""), "state.json: %s", js);
        CHECK(strstr(js, "\"growth_tracker\":\t0") == NULL, "the scaler was not mid-count at step 7: %s", js);
    }
    /* the resume inherits every setting, --dtype included */
    snprintf(args, sizeof args, "train --resume %s/%s_split", dir, dtype);
    rc = tu_run_anneal(args, out, 0);
    const char *txt = tu_slurp(out);
    CHECK(rc == 0 && strstr(txt, "resumed from") && strstr(txt, "step    16/16"), "exit %d: %s", rc, txt);
    CHECK(strstr(txt, "note: the checkpoint was trained with") == NULL, "same dtype, yet: %s", txt);
    if (!strcmp(dtype, "fp16"))
        CHECK(strstr(txt, "from the checkpoint") != NULL, "the scaler state should come from the checkpoint: %s", txt);
    double la[16], lb[16], sa[16], sb[16];
    char ra[700], rb[700];
    snprintf(ra, sizeof ra, "%s/%s_straight", dir, dtype);
    snprintf(rb, sizeof rb, "%s/%s_split", dir, dtype);
    REQUIRE(read_run(ra, la, sa, 16) == 16 && read_run(rb, lb, sb, 16) == 16);
    int same = 0;
    for (int i = 0; i < 16; i++) {
        CHECK(la[i] == lb[i] && sa[i] == sb[i], "%s step %d: straight loss %.17g scale %g, resumed %.17g scale %g", dtype,
              i + 1, la[i], sa[i], lb[i], sb[i]);
        same += la[i] == lb[i];
    }
    const char *files[] = {"model.safetensors", "optimizer.safetensors"};
    for (int k = 0; k < 2; k++) {
        char fa[800], fb[800];
        snprintf(fa, sizeof fa, "%s/ckpt_00000016/%s", ra, files[k]);
        snprintf(fb, sizeof fb, "%s/ckpt_00000016/%s", rb, files[k]);
        CHECK(tu_files_equal(fa, fb), "%s: %s differs between the straight and the resumed run", dtype, files[k]);
    }
    printf("    %s: %d/16 step losses bit-identical", dtype, same);
    if (!strcmp(dtype, "fp16")) {
        int changes = 0;
        for (int i = 1; i < 16; i++) changes += sa[i] != sa[i - 1];
        printf("; loss scale %g -> %g (%d changes)", sa[0], sa[15], changes);
        CHECK(changes >= 3, "the fp16 scale changed only %d times: the test would not see a lost scaler state", changes);
    }
    printf("\n");
}

TEST(bf16_and_fp16_resume_exactly) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    TU_DIR_AND_DATA(dir, data, "resumeprec");
    straight_vs_resumed(dir, data, "bf16", "");
    straight_vs_resumed(dir, data, "fp16", "--loss-scale-init 67108864 --scale-growth-interval 3");

    /* another dtype on resume: allowed, and said */
    char out[600];
    snprintf(out, sizeof out, "%s/out.txt", dir);
    snprintf(args, sizeof args, "train --resume %s/fp16_split --steps 18 --dtype bf16", dir);
    int rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(tu_slurp(out), "note: the checkpoint was trained with --dtype fp16; this run continues "
                                           "with --dtype bf16"), "exit %d: %s", rc, tu_slurp(out));

    /* eval and generate take --dtype too */
    snprintf(args, sizeof args, "eval --ckpt %s/fp16_split --data %s --max-batches 2 --dtype bf16", dir, data);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(tu_slurp(out), "loss "), "eval --dtype bf16: exit %d: %s", rc, tu_slurp(out));
    snprintf(args, sizeof args, "generate --ckpt %s/fp16_split --max-tokens 4 --dtype fp16", dir);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0, "generate --dtype fp16: exit %d: %s", rc, tu_slurp(out));
    snprintf(args, sizeof args, "eval --ckpt %s/fp16_split --data %s --dtype fp8", dir, data);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 2 && strstr(tu_slurp(out), "--dtype: unknown precision 'fp8'"), "eval --dtype fp8: exit %d: %s", rc,
          tu_slurp(out));
    snprintf(args, sizeof args, "train --synthetic --steps 1 --dtype fp8 --out %s/bad", dir);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 2 && strstr(tu_slurp(out), "--dtype: unknown precision 'fp8'"), "train --dtype fp8: exit %d: %s", rc,
          tu_slurp(out));

    /* a checkpoint from before mixed precision: strip "dtype" and "loss_scaler" */
    char st[800], tmp[820];
    snprintf(st, sizeof st, "%s/bf16_split/ckpt_00000016/state.json", dir);
    snprintf(tmp, sizeof tmp, "%s.old", st);
    FILE *in = fopen(st, "r"), *o = fopen(tmp, "w");
    REQUIRE(in && o);
    /* state.json is cJSON_Print output: the top-level "dtype" follows "best_val_loss"
     * (the config object inserted below has a "dtype" key too), and "loss_scaler"
     * is an object over several lines */
    static char line[1 << 16];
    bool skipping = false, after_best = false;
    while (fgets(line, sizeof line, in)) {
        bool drop = skipping || (after_best && strstr(line, "\"dtype\":")) || strstr(line, "\"loss_scaler\":");
        if (strstr(line, "\"loss_scaler\":")) skipping = !strchr(line, '}');
        else if (skipping && strchr(line, '}')) skipping = false;
        after_best = strstr(line, "\"best_val_loss\":") != NULL;
        if (!drop) fputs(line, o);
    }
    fclose(in);
    fclose(o);
    REQUIRE(rename(tmp, st) == 0);
    const char *js = tu_slurp(st);
    CHECK(!strstr(js, "loss_scaler") && strstr(js, "\"config\""), "stripped state.json: %s", js);
    snprintf(args, sizeof args, "train --resume %s/bf16_split --steps 18 --dtype fp16", dir);
    rc = tu_run_anneal(args, out, 0);
    const char *txt = tu_slurp(out);
    CHECK(rc == 0 && strstr(txt, "trained with --dtype fp32; this run continues with --dtype fp16") &&
              strstr(txt, "dynamic loss scale 65536 (x2 after 2000 clean steps"),
          "exit %d: %s", rc, txt);
    tu_rmrf(dir);
}

int main(void) {
    RUN(bf16_and_fp16_resume_exactly);
    return anneal_test_summary();
}
