/* The backend interface carries a device that is not the CPU: "emu" (emu_backend.h),
 * registered from outside the library, whose memory the host cannot dereference (any
 * host read or write of an emu tensor's memory faults) and whose kernels are the CPU's
 * behind untagging. A GPT-2 made with anneal_model_new(cfg, emu) is initialised, trained
 * (loss, backward, gradient clipping, AdamW, zero_grad; batches uploaded with
 * anneal_from_data_on; dropout on), evaluated, sampled from, checkpointed and loaded
 * back, next to a CPU twin doing the same: losses, gradient norms, the evaluated loss,
 * the generated ids and the checkpoint files must be bit-identical. A training step's
 * synchronisations are counted on the device. */
#include "anneal/anneal.h"
#include "emu_backend.h"
#include "test.h"

#include <math.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

enum { B = 2, T = 32, STEPS = 4, MORE = 2, NEW_IDS = 12 };

/* Batch k of a deterministic token stream (ids in [0, 16): learnable in a few steps;
 * the targets the next ids; the last row's last target ignored). */
static void batch(int64_t k, int V, int32_t *ids, int32_t *tg) {
    uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(k + 1);
    int32_t seq[B * T + 1];
    for (int i = 0; i <= B * T; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        seq[i] = (int32_t)((s >> 33) % (uint64_t)(V < 16 ? V : 16));
    }
    for (int i = 0; i < B * T; i++) {
        ids[i] = seq[i];
        tg[i] = seq[i + 1];
    }
    tg[B * T - 1] = -100;
}

typedef struct run {
    anneal_model *m;
    anneal_optimizer *opt;
    int64_t step;
    anneal_rng_state rng; /* the run's own generator state (dropout), between its steps */
    float loss[STEPS + MORE], norm[STEPS + MORE];
    /* synchronisations of the device during one steady-state step, by phase */
    int64_t sync_forward, sync_loss_read, sync_backward, sync_clip, sync_optim;
} run;

static anneal_model_config tiny_config(void) {
    anneal_model_config cfg;
    anneal_model_preset("tiny", &cfg);
    cfg.dropout = 0.1f; /* the dropout kernels run too, from the same Philox stream */
    return cfg;
}

/* A tiny GPT-2 on dev (recompute mode and matmul precision as given) and its AdamW. */
static bool run_new_ex(run *r, anneal_device dev, anneal_recompute_mode rc, anneal_dtype compute) {
    memset(r, 0, sizeof *r);
    anneal_model_config cfg = tiny_config();
    cfg.recompute = rc;
    r->m = anneal_model_new(&cfg, dev);
    if (!r->m || anneal_model_init(r->m, 1234) != ANNEAL_OK || anneal_model_set_compute(r->m, compute) != ANNEAL_OK)
        return false;
    anneal_optim_config oc = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    oc.weight_decay = 0.1;
    r->opt = anneal_optimizer_new(r->m->params, oc);
    r->rng = anneal_rng_get();
    return r->opt != NULL;
}

static bool run_new(run *r, anneal_device dev) { return run_new_ex(r, dev, ANNEAL_RECOMPUTE_NONE, ANNEAL_F32); }

static void run_free(run *r) {
    anneal_optimizer_free(r->opt);
    anneal_model_free(r->m);
}

/* One training step with the batch of the run's step number; false on an error. */
static bool train_step(run *r) {
    anneal_device dev = anneal_model_device(r->m);
    int V = r->m->cfg.vocab_size;
    int32_t ids[B * T], tg[B * T]; /* kept until the step's synchronisations: a device reads them */
    batch(r->step, V, ids, tg);
    anneal_model_set_training(r->m, true);
    anneal_rng_set(r->rng);
    anneal_scope *s = anneal_scope_open();
    int64_t s0 = emu_stats.syncs;
    anneal_tensor *x = anneal_from_data_on(dev, ANNEAL_I32, 2, (int64_t[]){B, T}, ids);
    anneal_tensor *y = anneal_from_data_on(dev, ANNEAL_I32, 2, (int64_t[]){B, T}, tg);
    anneal_tensor *loss = anneal_model_loss(r->m, x, y);
    int64_t s1 = emu_stats.syncs;
    r->loss[r->step] = loss ? (float)anneal_item(loss) : NAN; /* the logged loss: read on the host */
    int64_t s2 = emu_stats.syncs;
    bool ok = loss && anneal_backward(loss) == ANNEAL_OK;
    int64_t s3 = emu_stats.syncs;
    ok = ok && anneal_clip_grad_norm(r->m->params, 1.0f, &r->norm[r->step]) == ANNEAL_OK;
    int64_t s4 = emu_stats.syncs;
    ok = ok && anneal_optimizer_step(r->opt, 1e-3) == ANNEAL_OK;
    int64_t s5 = emu_stats.syncs;
    anneal_params_zero_grad(r->m->params);
    anneal_scope_close(s);
    r->rng = anneal_rng_get();
    r->sync_forward = s1 - s0, r->sync_loss_read = s2 - s1, r->sync_backward = s3 - s2;
    r->sync_clip = s4 - s3, r->sync_optim = s5 - s4;
    r->step++;
    return ok;
}

/* The evaluation's batches: numbers 100.. of the stream, the third one partial. */
static anneal_status eval_batch(void *user, int64_t i, int32_t *ids, int32_t *tg, int64_t *rows) {
    batch(100 + i, *(const int *)user, ids, tg);
    *rows = i == 2 ? 1 : B;
    return ANNEAL_OK;
}

static bool collect(int32_t id, void *user) {
    int32_t *out = user;
    out[++out[0]] = id;
    return true;
}

/* Bytes of a file (malloc'd, *n set), or NULL. */
static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc(len > 0 ? (size_t)len : 1);
    *n = p && len >= 0 ? fread(p, 1, (size_t)len, f) : 0;
    fclose(f);
    return p;
}

static bool same_file(const char *dir_a, const char *dir_b, const char *name) {
    char pa[1024], pb[1024];
    snprintf(pa, sizeof pa, "%s/%s", dir_a, name);
    snprintf(pb, sizeof pb, "%s/%s", dir_b, name);
    size_t na = 0, nb = 0;
    unsigned char *a = slurp(pa, &na), *b = slurp(pb, &nb);
    bool same = a && b && na == nb && na > 0 && !memcmp(a, b, na);
    free(a);
    free(b);
    return same;
}

static void rm_rf(const char *dir) {
    char cmd[1100];
    if (strncmp(dir, "/tmp/anneal_", 12)) return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* The tag really keeps the host out: writing through an emu tensor's address faults
 * (checked in a child process). */
TEST(emu_memory_is_not_host_memory) {
    REQUIRE(emu_register() == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *t = anneal_zeros_like(anneal_empty_on(EMU, ANNEAL_F32, 1, (int64_t[]){4}));
    REQUIRE(t && t->device == EMU && ((uintptr_t)anneal_data(t) & EMU_TAG));
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); /* no sanitizer report: just die */
        signal(SIGBUS, SIG_DFL);
        *(volatile float *)anneal_data(t) = 1.0f; /* must fault */
        _exit(0);
    }
    int status = 0;
    REQUIRE(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECK(WIFSIGNALED(status), "a host write to emu memory did not fault (status %d)", status);
    /* values go through the backend's copies */
    float v[4] = {1, 2, 3, 4}, back[4];
    anneal_tensor *u = anneal_from_data_on(EMU, ANNEAL_F32, 1, (int64_t[]){4}, v);
    REQUIRE(u && anneal_to_f32_buffer(anneal_add(u, u), back) == ANNEAL_OK);
    for (int i = 0; i < 4; i++) CHECK_TRUE(back[i] == 2 * v[i]);
    CHECK_TRUE(!strcmp(anneal_device_name(EMU), "emu"));
    anneal_scope_close(s);
}

/* The emu copies catch what an asynchronous device punishes: a result read before the
 * synchronize, an uploaded host buffer refilled before it (negative controls of the
 * checks the GPT-2 test relies on); position ids need no synchronisation. */
TEST(emu_copies_behave_like_an_async_device) {
    REQUIRE(emu_register() == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    float v[3] = {1.5f, -2, 8};
    anneal_tensor *t = anneal_from_data_on(EMU, ANNEAL_F32, 1, (int64_t[]){3}, v);
    REQUIRE(t);
    float out[3] = {0, 0, 0};
    REQUIRE(emu_table.copy_to_host(NULL, out, anneal_data(t), sizeof out) == ANNEAL_OK);
    CHECK_TRUE(isnan(out[0]) && isnan(out[2])); /* not there before the synchronize */
    REQUIRE(anneal_device_synchronize(EMU) == ANNEAL_OK);
    CHECK_TRUE(out[0] == 1.5f && out[1] == -2 && out[2] == 8);
    int64_t reuse = emu_stats.host_reuse;
    int32_t buf[4] = {1, 2, 3, 4};
    REQUIRE(anneal_from_data_on(EMU, ANNEAL_I32, 1, (int64_t[]){4}, buf));
    buf[2] = 7; /* refilled while the upload may still read it */
    REQUIRE(anneal_device_synchronize(EMU) == ANNEAL_OK);
    CHECK_TRUE(emu_stats.host_reuse == reuse + 1);
    emu_stats.host_reuse = reuse;
    /* position ids: from the library's immutable table without a synchronisation, other
     * ranges through a buffer freed after one */
    int64_t syncs = emu_stats.syncs;
    anneal_tensor *pos = anneal_arange(EMU, 5, 100), *neg = anneal_arange(EMU, -3, 5);
    REQUIRE(pos && neg);
    CHECK(emu_stats.syncs == syncs + 1, "%lld synchronisations", (long long)(emu_stats.syncs - syncs));
    CHECK_TRUE(anneal_item_at(pos, 0) == 5 && anneal_item_at(pos, 99) == 104);
    CHECK_TRUE(anneal_item_at(neg, 0) == -3 && anneal_item_at(neg, 4) == 1);
    CHECK_TRUE(emu_stats.host_reuse == reuse);
    anneal_scope_close(s);
}

/* Recompute regions (RNG replay) and bf16 products on the device: the CPU's bits. */
TEST(recompute_and_bf16_on_the_second_device) {
    REQUIRE(emu_register() == ANNEAL_OK);
    const anneal_recompute_mode modes[2] = {ANNEAL_RECOMPUTE_BLOCK, ANNEAL_RECOMPUTE_ATTN};
    for (int k = 0; k < 2; k++) {
        run cpu, emu;
        REQUIRE(run_new_ex(&cpu, ANNEAL_CPU, modes[k], ANNEAL_BF16) && run_new_ex(&emu, EMU, modes[k], ANNEAL_BF16));
        for (int i = 0; i < 2; i++) {
            REQUIRE(train_step(&cpu));
            CHECK(train_step(&emu), "%s", anneal_last_error());
            CHECK(cpu.loss[i] == emu.loss[i] && cpu.norm[i] == emu.norm[i], "%s step %d: loss %.9g / %.9g",
                  anneal_recompute_name(modes[k]), i, (double)cpu.loss[i], (double)emu.loss[i]);
        }
        run_free(&emu);
        run_free(&cpu);
    }
}

TEST(gpt2_on_a_second_device_is_the_cpu_bit_for_bit) {
    REQUIRE(emu_register() == ANNEAL_OK);
    emu_stats.foreign = emu_stats.host_reuse = emu_stats.calls = 0;
    anneal_clear_error();
    run cpu, emu;
    REQUIRE(run_new(&cpu, ANNEAL_CPU));
    REQUIRE(run_new(&emu, EMU));
    REQUIRE(emu.m->device == EMU && emu.m->params->items[0].tensor->device == EMU);

    /* training */
    for (int k = 0; k < STEPS; k++) {
        REQUIRE(train_step(&cpu));
        CHECK(train_step(&emu), "emu step %d: %s", k, anneal_last_error());
        CHECK(cpu.loss[k] == emu.loss[k] && cpu.norm[k] == emu.norm[k], "step %d: loss %.9g / %.9g, norm %.9g / %.9g",
              k, (double)cpu.loss[k], (double)emu.loss[k], (double)cpu.norm[k], (double)emu.norm[k]);
    }
    CHECK(cpu.loss[STEPS - 1] < cpu.loss[0], "the loss did not fall: %g -> %g", (double)cpu.loss[0],
          (double)cpu.loss[STEPS - 1]);
    CHECK(emu_stats.calls > 100, "only %lld kernels ran on emu", (long long)emu_stats.calls);
    /* Synchronisations of a steady-state step on the device: two, the logged loss (one
     * per step) and the gradient norm's one copy of every sum of squares (clipping needs
     * the norm on the host); none in the forward (position ids come from an immutable
     * host table), the backward or the optimizer. */
    printf("  emu step syncs: forward %lld, loss read %lld, backward %lld, clip %lld, optimizer %lld\n",
           (long long)emu.sync_forward, (long long)emu.sync_loss_read, (long long)emu.sync_backward,
           (long long)emu.sync_clip, (long long)emu.sync_optim);
    CHECK_TRUE(emu.sync_forward == 0 && emu.sync_loss_read == 1 && emu.sync_backward == 0 && emu.sync_clip == 1 &&
               emu.sync_optim == 0);

    /* evaluation */
    int V = cpu.m->cfg.vocab_size;
    double le[2];
    int64_t tokens[2];
    run *both[2] = {&cpu, &emu};
    for (int d = 0; d < 2; d++)
        CHECK(anneal_model_evaluate(both[d]->m, B, T, 3, eval_batch, &V, &le[d], &tokens[d]) == ANNEAL_OK, "evaluate %d: %s",
              d, anneal_last_error());
    CHECK(le[0] == le[1] && tokens[0] == tokens[1] && tokens[0] == 2 * B * T + T - 2, "eval: %.17g / %.17g, %lld / %lld",
          le[0], le[1], (long long)tokens[0], (long long)tokens[1]);

    /* generation (sampled: temperature, top-k, top-p) */
    int32_t gen[2][NEW_IDS + 1];
    const int32_t prompt[5] = {1, 7, 42, 3, 99};
    anneal_sampler_config sc = {.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = 5};
    for (int d = 0; d < 2; d++) {
        gen[d][0] = 0;
        CHECK(anneal_model_generate(both[d]->m, prompt, 5, NEW_IDS, &sc, -1, collect, gen[d]) == ANNEAL_OK,
              "generate %d: %s", d, anneal_last_error());
    }
    CHECK_TRUE(gen[0][0] == NEW_IDS && !memcmp(gen[0], gen[1], sizeof gen[0]));

    /* checkpoints: the same files from both devices; the emu one loads into a fresh emu
     * model and optimizer that continue exactly as the originals */
    char dirs[2][64];
    char ck[2][1024];
    for (int d = 0; d < 2; d++) {
        snprintf(dirs[d], sizeof dirs[d], "/tmp/anneal_second_device_XXXXXX");
        REQUIRE(mkdtemp(dirs[d]));
        anneal_train_state st = {.step = STEPS, .rng = both[d]->rng, .best_val_loss = NAN, .dtype = ANNEAL_F32};
        CHECK(anneal_checkpoint_save(dirs[d], both[d]->m, both[d]->opt, &st, "{}", 0) == ANNEAL_OK, "save %d: %s", d,
              anneal_last_error());
        REQUIRE(anneal_checkpoint_resolve(dirs[d], ck[d], sizeof ck[d]) == ANNEAL_OK);
    }
    CHECK_TRUE(same_file(ck[0], ck[1], "model.safetensors") && same_file(ck[0], ck[1], "optimizer.safetensors"));
    run loaded;
    REQUIRE(run_new(&loaded, EMU));
    anneal_train_state st;
    CHECK(anneal_checkpoint_load(ck[1], loaded.m, loaded.opt, &st) == ANNEAL_OK, "load: %s", anneal_last_error());
    CHECK_TRUE(st.step == STEPS && st.rng.seed == emu.rng.seed && st.rng.offset == emu.rng.offset);
    loaded.step = STEPS;
    loaded.rng = st.rng;
    run *cont[3] = {&cpu, &emu, &loaded};
    for (int d = 0; d < 3; d++)
        for (int k = 0; k < MORE; k++) CHECK(train_step(cont[d]), "continue %d: %s", d, anneal_last_error());
    for (int k = STEPS; k < STEPS + MORE; k++)
        CHECK(cpu.loss[k] == emu.loss[k] && emu.loss[k] == loaded.loss[k] && cpu.norm[k] == loaded.norm[k],
              "step %d: cpu %.9g, emu %.9g, loaded %.9g", k, (double)cpu.loss[k], (double)emu.loss[k],
              (double)loaded.loss[k]);
    CHECK(emu_stats.foreign == 0, "%lld host tensors or addresses reached the emu backend", (long long)emu_stats.foreign);
    CHECK(emu_stats.host_reuse == 0, "%lld host buffers were changed before the synchronize that ends their upload",
          (long long)emu_stats.host_reuse);
    run_free(&loaded);
    run_free(&emu);
    run_free(&cpu);
    for (int d = 0; d < 2; d++) rm_rf(dirs[d]);
}

/* Nothing is left on the device, and its cached blocks go back (the leak checker cannot
 * see a block through its tagged address, so they must not outlive the program). */
TEST(nothing_left_on_the_device) {
    anneal_memory_stats st = anneal_memory_stats_get(EMU);
    CHECK(st.live_bytes == 0, "%lld bytes still live on emu", (long long)st.live_bytes);
    anneal_memory_release_cache(EMU);
    CHECK_TRUE(anneal_memory_stats_get(EMU).reserved_bytes == 0);
}

int main(void) {
    RUN(emu_memory_is_not_host_memory);
    RUN(emu_copies_behave_like_an_async_device);
    RUN(recompute_and_bf16_on_the_second_device);
    RUN(gpt2_on_a_second_device_is_the_cpu_bit_for_bit);
    RUN(nothing_left_on_the_device);
    return anneal_test_summary();
}
