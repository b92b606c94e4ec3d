/* LoRA fine-tuning in the trainer (src/train/lora.c, the LoRA side of the checkpoint
 * code):
 *   - a LoRA run stopped and resumed gives bit-identical losses to an uninterrupted one
 *     (model and adapter dropout on; fp32 and bf16, where the frozen dense weights are
 *     stored in bf16), and its checkpoints hold only what changes: the adapters as a
 *     PEFT directory, the optimizer state of the adapters, the base's path and
 *     fingerprint (no model.safetensors);
 *   - the base reference: a LoRA checkpoint loads without a trainer (generate, eval) by
 *     reading its base from the recorded path, --init of one continues its adapters on
 *     the same base; once the base's weights changed, resume and that load refuse it; a
 *     target the model lacks is a usage error naming it;
 *   - on real text (KJV, a 512-id BPE), the first 20 steps of a LoRA run from a random
 *     transformers GPT-2 (c_attn, c_proj, c_fc) or Llama (q/k/v/o_proj) and a PEFT-initialised adapter (--lora-init) match PEFT's own
 *     training of the same adapter on the same batches with torch.optim.AdamW (dropout
 *     off, constant lr, no clipping, no weight decay): every loss within 1e-4 relative. */
#include "anneal/anneal.h"
#include "test.h"
#include "train_util.h"

/* Runs a training config given as flag/value pairs through the library; its status. */
static anneal_status run_cfg(const char *const (*kv)[2], int n, anneal_train_result *r) {
    anneal_train_config c;
    anneal_train_config_init(&c);
    for (int i = 0; i < n; i++)
        if (anneal_train_config_set(&c, kv[i][0], kv[i][1]) != ANNEAL_OK) {
            anneal_train_config_free(&c);
            return anneal_last_status();
        }
    FILE *devnull = fopen("/dev/null", "w");
    anneal_status st = anneal_train_run(&c, devnull, r);
    fclose(devnull);
    anneal_train_config_free(&c);
    return st;
}

/* A LoRA checkpoint into a plain model of its base's config (what generate and eval do):
 * the status, and the number of adapted layers. */
static anneal_status load_plain(const char *ckpt, int *n_adapted) {
    anneal_model_config mc;
    anneal_status st = anneal_checkpoint_read_config(ckpt, &mc, NULL);
    anneal_model *m = st == ANNEAL_OK ? anneal_model_new(&mc, ANNEAL_CPU) : NULL;
    anneal_train_state ts;
    if (m) st = anneal_checkpoint_load(ckpt, m, NULL, &ts);
    *n_adapted = m ? anneal_lora_count(m->params) : 0;
    anneal_model_free(m);
    return m ? st : anneal_last_status();
}

static void resume_case(const char *dtype) {
    const char *dir = tu_mkdtemp("lora_resume");
    REQUIRE(dir);
    char a[300], b[300];
    snprintf(a, sizeof a, "%s/straight", dir);
    snprintf(b, sizeof b, "%s/stopped", dir);
    const char *kv[][2] = {{"model", "tiny"}, {"synthetic", "on"}, {"batch", "2"}, {"seq", "16"}, {"steps", "8"},
                           {"lora-rank", "4"}, {"lora-alpha", "8"}, {"lora-targets", "c_attn,c_fc"},
                           {"lora-dropout", "0.1"}, {"dropout", "0.1"}, {"ckpt-every", "0"}, {"eval-batches", "0"},
                           {"peak-gflops", "100"}, {"dtype", dtype}, {"out", a}, {"stop-at", "0"}};
    int n = (int)(sizeof kv / sizeof kv[0]);
    anneal_train_result r;
    REQUIRE(run_cfg(kv, n, &r) == ANNEAL_OK);
    kv[n - 2][1] = b;
    kv[n - 1][1] = "3";
    REQUIRE(run_cfg(kv, n, &r) == ANNEAL_OK && r.steps_done == 3);
    kv[n - 1][1] = "0";
    kv[n - 2][0] = "resume"; /* the same settings, continued */
    anneal_status st = run_cfg(kv, n, &r);
    CHECK(st == ANNEAL_OK && r.steps_done == 8, "resume: %s", anneal_last_error());
    char la[400], lb[400];
    snprintf(la, sizeof la, "%s/log.jsonl", a);
    snprintf(lb, sizeof lb, "%s/log.jsonl", b);
    double x[8], y[8];
    REQUIRE(tu_read_losses(la, x, NULL, 8) == 8 && tu_read_losses(lb, y, NULL, 8) == 8);
    for (int i = 0; i < 8; i++) CHECK(x[i] == y[i], "%s step %d: %.17g vs %.17g after resume", dtype, i + 1, x[i], y[i]);
    CHECK_TRUE(x[7] != x[0]);
    /* what the checkpoint holds */
    char p[500];
    struct stat sb;
    snprintf(p, sizeof p, "%s/ckpt_00000008/model.safetensors", b);
    CHECK(stat(p, &sb) != 0, "%s exists: a LoRA checkpoint holds only what changes", p);
    snprintf(p, sizeof p, "%s/ckpt_00000008/adapter_config.json", b);
    anneal_peft_config pc;
    CHECK_TRUE(anneal_peft_read_config(p, &pc) != ANNEAL_OK); /* a file, not a dir: refused */
    anneal_clear_error();
    snprintf(p, sizeof p, "%s/ckpt_00000008", b);
    REQUIRE(anneal_peft_read_config(p, &pc) == ANNEAL_OK);
    CHECK_TRUE(pc.rank == 4 && pc.alpha == 8.0f && pc.n_targets == 2 && pc.fan_in_fan_out);
    anneal_peft_config_free(&pc);
    anneal_safetensors *st1 = NULL;
    snprintf(p, sizeof p, "%s/ckpt_00000008/optimizer.safetensors", b);
    REQUIRE(anneal_safetensors_open(p, &st1) == ANNEAL_OK);
    CHECK(st1->n_entries == 2 * 2 * 2 * 2, "optimizer state of %d tensors (2 layers x 2 targets x A,B x m,v)",
          st1->n_entries);
    for (int i = 0; i < st1->n_entries; i++) CHECK(strstr(st1->entries[i].name, ".lora_"), "%s", st1->entries[i].name);
    anneal_safetensors_close(st1);
    snprintf(p, sizeof p, "%s/ckpt_00000008/adapter_model.safetensors", b);
    REQUIRE(anneal_safetensors_open(p, &st1) == ANNEAL_OK);
    CHECK_TRUE(st1->n_entries == 8 && anneal_safetensors_find(st1, "base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight"));
    anneal_safetensors_close(st1);
    bool lora = false;
    uint64_t fp = 0;
    char base[64];
    snprintf(p, sizeof p, "%s/ckpt_00000008", b);
    CHECK_TRUE(anneal_checkpoint_lora_base(p, &lora, base, sizeof base, &fp) == ANNEAL_OK && lora && fp && !base[0]);
    int n_ad = -1; /* a seeded base: the architecture's init with the run's seed, then the adapters */
    CHECK(load_plain(p, &n_ad) == ANNEAL_OK && n_ad == 4, "plain load: %s (%d)", anneal_last_error(), n_ad);
    anneal_clear_error();
    printf("    %s: 8 steps straight = 3 + resume 5, bit for bit (last loss %.6f)\n", dtype, y[7]);
    tu_rmrf(dir);
}

TEST(resume_is_bit_identical_and_holds_only_adapters) {
    resume_case("fp32");
    resume_case("bf16");
}

TEST(base_reference_is_checked) {
    const char *dir = tu_mkdtemp("lora_base");
    REQUIRE(dir);
    char base[300], run[300], out[400], cont[300];
    snprintf(base, sizeof base, "%s/base", dir);
    snprintf(run, sizeof run, "%s/lora", dir);
    snprintf(out, sizeof out, "%s/out", dir);
    snprintf(cont, sizeof cont, "%s/cont", dir);
    anneal_train_result r;
    const char *b1[][2] = {{"model", "tiny"}, {"synthetic", "on"}, {"batch", "2"}, {"seq", "16"}, {"steps", "2"},
                           {"stop-at", "1"}, {"eval-batches", "0"}, {"peak-gflops", "100"}, {"out", base}};
    REQUIRE(run_cfg(b1, 9, &r) == ANNEAL_OK);
    const char *l1[][2] = {{"init", base}, {"synthetic", "on"}, {"batch", "2"}, {"seq", "16"}, {"steps", "4"},
                           {"stop-at", "2"}, {"lora-rank", "2"}, {"eval-batches", "0"}, {"peak-gflops", "100"},
                           {"out", run}};
    REQUIRE(run_cfg(l1, 10, &r) == ANNEAL_OK);
    char ck[400];
    snprintf(ck, sizeof ck, "%s/ckpt_00000002", run);
    /* without a trainer (generate, eval): the base from its path, then the adapters */
    int n = -1;
    anneal_status st = load_plain(ck, &n);
    CHECK(st == ANNEAL_OK && n == 2, "plain load: %s (%d adapted)", anneal_last_error(), n);
    anneal_clear_error();
    /* --init of a LoRA checkpoint continues its adapters in a new run, on the same base */
    const char *c1[][2] = {{"init", ck}, {"synthetic", "on"}, {"batch", "2"}, {"seq", "16"}, {"steps", "2"},
                           {"eval-batches", "0"}, {"peak-gflops", "100"}, {"out", cont}};
    st = run_cfg(c1, 8, &r);
    CHECK(st == ANNEAL_OK, "--init of a LoRA checkpoint: %s", anneal_last_error());
    anneal_clear_error();
    bool la = false, lb = false;
    uint64_t fa = 0, fb = 0;
    char pa[1024], pb[1024], ck2[400];
    snprintf(ck2, sizeof ck2, "%s/ckpt_00000002", cont);
    CHECK_TRUE(anneal_checkpoint_lora_base(ck, &la, pa, sizeof pa, &fa) == ANNEAL_OK &&
               anneal_checkpoint_lora_base(ck2, &lb, pb, sizeof pb, &fb) == ANNEAL_OK && la && lb && fa == fb &&
               !strcmp(pa, pb) && strstr(pa, "/base"));
    anneal_clear_error();
    const char *c2[][2] = {{"init", ck}, {"synthetic", "on"}, {"steps", "1"}, {"lora-rank", "4"},
                           {"eval-batches", "0"}, {"out", out}};
    CHECK(run_cfg(c2, 6, &r) != ANNEAL_OK && r.usage_error && strstr(anneal_last_error(), "LoRA checkpoint"), "%s",
          anneal_last_error());
    anneal_clear_error();
    /* the base moves on a step: its latest checkpoint is other weights */
    b1[5][1] = "0";
    b1[8][0] = "resume";
    REQUIRE(run_cfg(b1, 9, &r) == ANNEAL_OK && r.steps_done == 2);
    l1[5][1] = "0";
    l1[9][0] = "resume";
    l1[0][0] = "synthetic", l1[0][1] = "on";
    anneal_clear_error();
    CHECK(run_cfg(l1, 10, &r) != ANNEAL_OK && strstr(anneal_last_error(), "changed"), "resume on a changed base: %s",
          anneal_last_error());
    anneal_clear_error();
    CHECK(load_plain(ck, &n) != ANNEAL_OK && strstr(anneal_last_error(), "changed"), "plain load on a changed base: %s",
          anneal_last_error());
    anneal_clear_error();
    /* an unknown target */
    const char *l4[][2] = {{"model", "tiny"}, {"synthetic", "on"}, {"steps", "1"}, {"lora-rank", "2"},
                           {"lora-targets", "c_attn,q_proj"}, {"eval-batches", "0"}, {"out", out}};
    CHECK(run_cfg(l4, 7, &r) != ANNEAL_OK && r.usage_error && strstr(anneal_last_error(), "'q_proj'"), "%s",
          anneal_last_error());
    anneal_clear_error();
    tu_rmrf(dir);
}

/* ---------------------------------------------------------------- PEFT */

static bool py(const char *python, const char *dir, const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd %s && %s %s %s > %s/py.log 2>&1", dir, python,
             anneal_test_path("tests/fixtures/peft_gpt2.py"), args, dir);
    int rc = system(cmd);
    if (rc != 0) {
        snprintf(cmd, sizeof cmd, "tail -15 %s/py.log", dir);
        if (system(cmd) != 0) return false;
    }
    return rc == 0;
}

#define STEPS 20
#define B_ 2
#define T_ 32

static void loss_curve(const char *python, const char *top, const char *data, const char *kind, const char *targets,
                       bool check_learns) {
    char dir[400];
    snprintf(dir, sizeof dir, "%s/%s", top, kind);
    REQUIRE(mkdir(dir, 0777) == 0);
    char src[600];
    snprintf(src, sizeof src, "%s base 512", kind);
    REQUIRE(py(python, dir, src));
    snprintf(src, sizeof src, "init_adapter base init %s", targets);
    REQUIRE(py(python, dir, src));
    /* the batches the trainer reads (--shuffle off): the same loader */
    anneal_loader *l = NULL;
    anneal_loader_config lc = {.batch = B_, .seq = T_, .seed = 1, .shuffle = false, .rank = 0, .world = 1};
    REQUIRE(anneal_loader_open(data, "train", &lc, &l) == ANNEAL_OK);
    static int32_t ids[STEPS * B_ * T_], tg[STEPS * B_ * T_];
    for (int s = 0; s < STEPS; s++) REQUIRE(anneal_loader_next(l, ids + s * B_ * T_, tg + s * B_ * T_) == ANNEAL_OK);
    anneal_loader_free(l);
    char p[700], q[600], r_[600];
    snprintf(p, sizeof p, "%s/batches.safetensors", dir);
    int64_t shape[3] = {STEPS, B_, T_};
    anneal_st_write_entry e[2] = {{"ids", ANNEAL_I32, 3, shape, ids}, {"targets", ANNEAL_I32, 3, shape, tg}};
    REQUIRE(anneal_safetensors_write(p, 2, e, 0, NULL, NULL) == ANNEAL_OK);
    snprintf(q, sizeof q, "train base init batches.safetensors peft_losses.safetensors %d 1e-3", STEPS);
    REQUIRE(py(python, dir, q));
    /* anneal: the same base, adapter, batches and optimizer */
    /* GPT-2 starts from the model directory (--model DIR), Llama from its weights file (--init FILE) */
    bool as_dir = !strcmp(kind, "base");
    snprintf(p, sizeof p, as_dir ? "%s/base" : "%s/base/model.safetensors", dir);
    snprintf(q, sizeof q, "%s/init", dir);
    snprintf(r_, sizeof r_, "%s/run", dir);
    char steps[16];
    snprintf(steps, sizeof steps, "%d", STEPS);
    const char *kv[][2] = {{as_dir ? "model" : "init", p}, {"data", data}, {"lora-init", q}, {"batch", "2"}, {"seq", "32"},
                           {"steps", steps}, {"lr", "1e-3"}, {"warmup", "0"}, {"schedule", "constant"},
                           {"weight-decay", "0"}, {"beta1", "0.9"}, {"beta2", "0.999"}, {"eps", "1e-8"}, {"clip", "0"},
                           {"dropout", "0"}, {"shuffle", "off"}, {"eval-batches", "0"}, {"ckpt-every", "0"},
                           {"peak-gflops", "100"}, {"out", r_}};
    anneal_train_result res;
    anneal_status st = run_cfg(kv, (int)(sizeof kv / sizeof kv[0]), &res);
    REQUIRE(st == ANNEAL_OK);
    double mine[STEPS];
    snprintf(p, sizeof p, "%s/log.jsonl", r_);
    REQUIRE(tu_read_losses(p, mine, NULL, STEPS) == STEPS);
    snprintf(p, sizeof p, "%s/peft_losses.safetensors", dir);
    anneal_safetensors *sf = NULL;
    REQUIRE(anneal_safetensors_open(p, &sf) == ANNEAL_OK);
    const anneal_st_entry *le = anneal_safetensors_find(sf, "losses");
    REQUIRE(le && le->dtype == ANNEAL_F32 && le->shape[0] == STEPS);
    const float *theirs = anneal_safetensors_data(sf, le);
    double worst = 0;
    for (int i = 0; i < STEPS; i++) {
        double d = fabs(mine[i] - theirs[i]) / fabs(theirs[i]);
        worst = fmax(worst, d);
        CHECK(d <= 1e-4, "step %d: anneal %.9g, PEFT %.9g (relative %.3g)", i + 1, mine[i], theirs[i], d);
    }
    printf("    %s, 20 LoRA steps (%s) on KJV: loss %.5f -> %.5f (PEFT %.5f -> %.5f), worst relative difference %.3g\n",
           kind, targets, mine[0], mine[STEPS - 1], theirs[0], theirs[STEPS - 1], worst);
    CHECK(!check_learns || mine[STEPS - 1] < mine[0] - 0.05, "the adapters learn: %g -> %g", mine[0], mine[STEPS - 1]);
    anneal_safetensors_close(sf);
}

TEST(loss_curve_matches_peft) {
    const char *python = anneal_test_python("torch,transformers,peft");
    if (!python) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    TU_DIR_AND_DATA(dir, data, "lora_peft");
    loss_curve(python, dir, data, "base", "c_attn,c_proj,c_fc", true);
    /* attention adapters alone on a random Llama barely move its loss in 20 steps: the
     * match is the point */
    loss_curve(python, dir, data, "llama", "q_proj,k_proj,v_proj,o_proj", false);
    tu_rmrf(dir);
}

int main(void) {
    RUN(resume_is_bit_identical_and_holds_only_adapters);
    RUN(base_reference_is_checked);
    RUN(loss_curve_matches_peft);
    return anneal_test_summary();
}
