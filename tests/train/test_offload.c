/* `anneal train --offload optimizer` (src/optim/offload.c, src/train/offload.c): AdamW's
 * state in a memory-mapped file gives the losses of the in-memory optimizer bit for bit,
 * a resume from a mid-run checkpoint continues bit for bit, the resident set during
 * the steps is lower by a good part of the state, the file is gone after the run, and
 * bad settings (a missing or non-directory --offload-dir, unknown values) end with
 * clear errors (--offload activations: test_offload_activations.c).
 *
 * RSS check: a 4-layer, 384-wide GPT-2 with a 4096 vocabulary (8.7M parameters, 67 MiB
 * of AdamW state). Offloaded, the state is resident only for the chunk being stepped
 * and the one read ahead (16 MiB each): measured 157 MiB vs 113 MiB resident after a
 * step (44 MiB, 0.65 of the state). Check: at least 0.3 of the state's bytes lower.
 * Not under ASan (shadow memory); there the trajectories are 6 steps. */
#include "test.h"
#include "train_util.h"

#include <dirent.h>

static const char *bin;
static char work[256];
static char common[512];
static int steps = 20, half = 10; /* fewer under ASan */

static const char *wpath(const char *name) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", work, name);
    return buf[k];
}

/* anneal train <args>, output in work/<name>.out; the exit code. */
static int run(const char *name, const char *args) {
    char out[600];
    snprintf(out, sizeof out, "%s.out", wpath(name));
    int rc = tu_run_anneal(args, out, 0);
    if (rc != 0) printf("---- %s ----\n%s----\n", out, tu_slurp(out));
    return rc;
}


/* No file of the offload tier is left in dir. */
static bool no_offload_file(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return true;
    bool clean = true;
    for (struct dirent *e; (e = readdir(d));)
        if (strstr(e->d_name, "anneal_optimizer_state")) clean = false;
    closedir(d);
    return clean;
}

TEST(offload_is_bit_identical_and_resumes_exactly) {
    char args[2048];
    snprintf(args, sizeof args, "%s --out %s", common, wpath("plain"));
    REQUIRE(run("plain", args) == 0);
    snprintf(args, sizeof args, "%s --offload optimizer --out %s", common, wpath("off"));
    REQUIRE(run("off", args) == 0);
    const char *o = tu_slurp(wpath("off.out"));
    CHECK(o && strstr(o, "optimizer state offloaded:"), "no offload note: %s", o);
    CHECK(no_offload_file(wpath("off")), "the offload file was left in the run directory");
    double a[64], b[64], c[64];
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath("plain"));
    REQUIRE(tu_read_losses(p, a, NULL, 64) == steps);
    snprintf(p, sizeof p, "%s/log.jsonl", wpath("off"));
    REQUIRE(tu_read_losses(p, b, NULL, 64) == steps);
    for (int i = 0; i < steps; i++) CHECK(a[i] == b[i], "step %d: %.9g offloaded, %.9g in memory", i + 1, b[i], a[i]);
    /* the checkpoints hold the same optimizer state: their files are identical */
    char f1[700], f2[700];
    snprintf(f1, sizeof f1, "%s/ckpt_%08d/optimizer.safetensors", wpath("plain"), steps);
    snprintf(f2, sizeof f2, "%s/ckpt_%08d/optimizer.safetensors", wpath("off"), steps);
    if (access(f1, F_OK) == 0) CHECK(tu_files_equal(f1, f2), "optimizer state of the checkpoints differs");
    /* resume from the mid-run checkpoint of the offloaded run: the rest bit for bit */
    snprintf(args, sizeof args, "train --resume %s/ckpt_%08d --out %s", wpath("off"), half, wpath("resumed"));
    REQUIRE(run("resumed", args) == 0);
    o = tu_slurp(wpath("resumed.out"));
    CHECK(o && strstr(o, "optimizer state offloaded:"), "the resume did not offload: %s", o);
    snprintf(p, sizeof p, "%s/log.jsonl", wpath("resumed"));
    for (int i = 0; i < 64; i++) c[i] = NAN;
    REQUIRE(tu_read_losses(p, c, NULL, 64) == steps);
    for (int i = half; i < steps; i++) CHECK(c[i] == a[i], "step %d after the resume: %.9g, %.9g in one run", i + 1, c[i], a[i]);
}

/* The largest "rss_bytes" of a run's step records. */
static double max_rss(const char *run_name) {
    double v[64];
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", wpath(run_name));
    int n = tu_read_steps(p, "rss_bytes", NAN, v, "skipped", NULL, 64);
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, v[i]);
    return m;
}

TEST(offload_lowers_resident_memory) {
    char cfg[600], args[2048];
    snprintf(cfg, sizeof cfg, "%s/model.json", work);
    FILE *f = fopen(cfg, "w");
    REQUIRE(f);
    fputs("{\"model_type\": \"gpt2\", \"n_layer\": 4, \"n_head\": 6, \"n_embd\": 384, \"vocab_size\": 4096, "
          "\"n_positions\": 64, \"embd_pdrop\": 0.0, \"resid_pdrop\": 0.0, \"attn_pdrop\": 0.0}\n", f);
    fclose(f);
    const char *b = "train --synthetic --batch 1 --seq 8 --steps 3 --threads 1 --dropout 0 --eval-batches 0 "
                    "--ckpt-every 0 --peak-gflops 10 --log-every 100";
    snprintf(args, sizeof args, "%s --config %s --out %s", b, cfg, wpath("big_plain"));
    REQUIRE(run("big_plain", args) == 0);
    snprintf(args, sizeof args, "%s --config %s --offload optimizer --offload-dir %s --out %s", b, cfg, work,
             wpath("big_off"));
    REQUIRE(run("big_off", args) == 0);
    CHECK(no_offload_file(work), "the offload file was left in --offload-dir");
    double plain = max_rss("big_plain"), off = max_rss("big_off");
    double state = 0;
    const char *o = tu_slurp(wpath("big_off.out"));
    const char *k = o ? strstr(o, "optimizer state offloaded: ") : NULL;
    if (k) state = atof(k + strlen("optimizer state offloaded: ")) * 1048576.0;
    printf("    resident after a step: %.1f MiB in memory, %.1f MiB offloaded (state %.1f MiB)\n", plain / 1048576.0,
           off / 1048576.0, state / 1048576.0);
    CHECK(state > 60e6, "state of %.0f bytes", state);
    CHECK(plain - off >= 0.3 * state, "offloading saved %.1f MiB of %.1f MiB of state", (plain - off) / 1048576.0,
          state / 1048576.0);
}

TEST(bad_offload_settings) {
    char args[2048];
    snprintf(args, sizeof args, "%s --offload optimizer --offload-dir %s/missing --out %s", common, work, wpath("bad1"));
    CHECK(run("bad1", args) != 0, "a missing --offload-dir was accepted");
    const char *o = tu_slurp(wpath("bad1.out"));
    CHECK(o && strstr(o, "--offload-dir") && strstr(o, "missing: No such file or directory"), "%s", o);
    char file[600];
    snprintf(file, sizeof file, "%s/a_file", work);
    FILE *f = fopen(file, "w");
    if (f) fclose(f);
    snprintf(args, sizeof args, "%s --offload optimizer --offload-dir %s --out %s", common, file, wpath("bad2"));
    CHECK(run("bad2", args) != 0, "a file as --offload-dir was accepted");
    o = tu_slurp(wpath("bad2.out"));
    CHECK(o && strstr(o, "a_file: not a directory"), "%s", o);
    snprintf(args, sizeof args, "%s --offload gradients --out %s", common, wpath("bad3"));
    CHECK(run("bad3", args) != 0, "--offload gradients was accepted");
    o = tu_slurp(wpath("bad3.out"));
    CHECK(o && strstr(o, "--offload: 'gradients' is not available"), "%s", o);
    snprintf(args, sizeof args, "%s --offload everything --out %s", common, wpath("bad4"));
    CHECK(run("bad4", args) != 0, "--offload everything was accepted");
}

int main(void) {
    bin = getenv("ANNEAL_BIN");
    if (!bin) {
        printf("ANNEAL_BIN is not set\n");
        return 1;
    }
    const char *d = tu_mkdtemp("offload");
    if (!d) return 1;
    snprintf(work, sizeof work, "%s", d);
    if (anneal_test_sanitized()) steps = 6, half = 3;
    snprintf(common, sizeof common,
             "train --synthetic --model tiny --batch 8 --seq 32 --steps %d --threads 1 --dropout 0 --lr 3e-3 --warmup 2 "
             "--eval-batches 2 --ckpt-every %d --keep 0 --peak-gflops 10 --log-every 100", steps, half);
    RUN(offload_is_bit_identical_and_resumes_exactly);
    /* ASan's shadow memory makes RSS meaningless and the 8.7M-parameter model slow */
    if (!anneal_test_sanitized()) RUN(offload_lowers_resident_memory);
    RUN(bad_offload_settings);
    if (anneal_test_failed == 0) tu_rmrf(work);
    else printf("kept %s for inspection\n", work);
    return anneal_test_summary();
}
