/* Exact resume through the binary on real text with shuffling and dropout on, with
 * evaluation and samples in between: 20 straight steps vs 10 steps (--stop-at 10)
 * + --resume + 10 give bit-identical losses at every step (compared from log.jsonl)
 * and byte-identical model.safetensors and optimizer.safetensors at the end. Also:
 * resuming from a checkpoint directory, and with a longer schedule. */
#include "test.h"
#include "train/train_util.h"

static char args[4096];

/* Every step's loss of a run directory's log. */
static int losses_of(const char *run, double *l, int n) {
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", run);
    return tu_read_losses(p, l, NULL, n);
}

TEST(twenty_steps_equal_ten_plus_resume_ten) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    TU_DIR_AND_DATA(dir, data, "resume");
    char out[600];
    snprintf(out, sizeof out, "%s/out.txt", dir);
    const char *common = "train --model tiny --steps 20 --batch 4 --seq 32 --lr 3e-3 --warmup 3 --schedule cosine "
                         "--dropout 0.1 --shuffle on --seed 7 --threads 2 --eval-every 4 --eval-batches 3 "
                         "--sample-every 6 --sample-tokens 8 --ckpt-every 3 --keep 2 --peak-gflops 100";
    snprintf(args, sizeof args, "%s --data %s --out %s/straight", common, data, dir);
    int rc = tu_run_anneal(args, out, 0);
    REQUIRE(rc == 0);
    snprintf(args, sizeof args, "%s --data %s --out %s/split --stop-at 10", common, data, dir);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(tu_slurp(out), "stopped at step 10"), "exit %d: %s", rc, tu_slurp(out));
    /* the resume inherits every setting from the checkpoint */
    snprintf(args, sizeof args, "train --resume %s/split", dir);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(tu_slurp(out), "resumed from") && strstr(tu_slurp(out), "step    11/20"), "exit %d: %s",
          rc, tu_slurp(out));

    double a[20], b[20];
    char ra[600], rb[600];
    snprintf(ra, sizeof ra, "%s/straight", dir);
    snprintf(rb, sizeof rb, "%s/split", dir);
    REQUIRE(losses_of(ra, a, 20) == 20 && losses_of(rb, b, 20) == 20);
    int same = 0;
    for (int i = 0; i < 20; i++) {
        CHECK(a[i] == b[i], "step %d: straight %.17g, resumed %.17g", i + 1, a[i], b[i]);
        same += a[i] == b[i];
    }
    const char *files[] = {"model.safetensors", "optimizer.safetensors"};
    for (int k = 0; k < 2; k++) {
        char fa[700], fb[700];
        snprintf(fa, sizeof fa, "%s/ckpt_00000020/%s", ra, files[k]);
        snprintf(fb, sizeof fb, "%s/ckpt_00000020/%s", rb, files[k]);
        CHECK(tu_files_equal(fa, fb), "%s differs between the straight and the resumed run", files[k]);
    }
    printf("    %d/20 step losses bit-identical; final model and optimizer files byte-identical\n", same);

    /* a checkpoint directory as the argument: the run continues in its parent, and a
     * longer schedule is allowed */
    snprintf(args, sizeof args, "train --resume %s/split/ckpt_00000020 --steps 23", dir);
    rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0 && strstr(tu_slurp(out), "step    23/23"), "exit %d: %s", rc, tu_slurp(out));
    char ck[700];
    snprintf(ck, sizeof ck, "%s/split/ckpt_00000023/model.safetensors", dir);
    CHECK_TRUE(access(ck, R_OK) == 0);
    /* --keep 2 pruned the older checkpoints */
    snprintf(ck, sizeof ck, "%s/split/ckpt_00000009", dir);
    CHECK_TRUE(access(ck, F_OK) != 0);
    tu_rmrf(dir);
}

int main(void) {
    RUN(twenty_steps_equal_ten_plus_resume_ten);
    return anneal_test_summary();
}
