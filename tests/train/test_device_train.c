/* The trainer on a device other than the CPU: anneal_train_run with --device emu (the
 * test backend of tests/backends/emu_backend.h, whose memory the host cannot touch and
 * whose copies to the host arrive only at a synchronize) next to the same run on the
 * CPU. Gradient accumulation, dropout, evaluation, samples and periodic checkpoints are
 * on. The logged losses, gradient norms, validation losses and samples are identical, and so is
 * every file of every checkpoint; a run started on emu resumes on the CPU, and one
 * started on the CPU resumes on emu, continuing bit for bit. The host never reads emu
 * memory behind the device's back and never refills an uploaded buffer before the
 * synchronize (emu_stats). Bad --device values are usage errors naming the flag. */
#include "anneal/train.h"
#include "backends/emu_backend.h"
#include "test.h"
#include "train_util.h"

#include <dirent.h>
#include <math.h>

enum { STEPS = 6, HALF = 3 };

static FILE *devnull;
static char tokdir[600]; /* a small BPE tokenizer for samples ("" when it could not be made) */

/* Learns a tokenizer of 512 ids (the model's vocabulary) from a small
 * text into dir/tok, for the runs' samples. */
static void make_tokenizer(const char *dir) {
    char text[600];
    snprintf(text, sizeof text, "%s/text.txt", dir);
    FILE *f = fopen(text, "w");
    if (!f) return;
    /* words of random syllables: plenty of pairs to merge */
    static const char *const syl[] = {"an", "ne", "al", "de", "vi", "ce", "ho", "st", "bi", "tu", "ka", "ro",
                                      "mi", "lo", "su", "pe", "ta", "ri", "go", "fu", "ze", "wa", "qi", "yo"};
    uint64_t r = 12345;
    for (int w = 0; w < 40000; w++) {
        int n = 1 + (int)((r >> 33) % 4);
        for (int k = 0; k < n; k++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            fputs(syl[(r >> 33) % (sizeof syl / sizeof syl[0])], f);
        }
        fputc(w % 12 == 11 ? '\n' : ' ', f);
    }
    fclose(f);
    snprintf(tokdir, sizeof tokdir, "%s/tok", dir);
    const char *files[1] = {text};
    anneal_tokenizer *tok = NULL;
    if (anneal_bpe_train(files, 1, 512, tokdir) != ANNEAL_OK || anneal_tokenizer_load(tokdir, &tok) != ANNEAL_OK ||
        anneal_tokenizer_vocab_size(tok) > 512) {
        printf("  no tokenizer of <= 512 ids (%s): samples off\n", anneal_last_error());
        anneal_clear_error();
        tokdir[0] = '\0';
    }
    anneal_tokenizer_free(tok);
}

/* The run's settings: a tiny GPT-2 on synthetic tokens on `device`, run directory out. */
static void config(anneal_train_config *c, const char *out, const char *device) {
    anneal_train_config_init(c);
    char v[32];
    snprintf(v, sizeof v, "%d", STEPS);
    anneal_train_config_set(c, "synthetic", "on");
    anneal_train_config_set(c, "steps", v);
    anneal_train_config_set(c, "batch", "4");
    anneal_train_config_set(c, "seq", "32");
    anneal_train_config_set(c, "accum", "2");
    anneal_train_config_set(c, "dropout", "0.1");
    anneal_train_config_set(c, "lr", "1e-2");
    anneal_train_config_set(c, "warmup", "2");
    anneal_train_config_set(c, "peak-gflops", "100");
    anneal_train_config_set(c, "eval-every", "3");
    anneal_train_config_set(c, "eval-batches", "2");
    anneal_train_config_set(c, "ckpt-every", "3");
    anneal_train_config_set(c, "keep", "0");
    anneal_train_config_set(c, "threads", "2");
    anneal_train_config_set(c, "out", out);
    if (tokdir[0]) {
        anneal_train_config_set(c, "tokenizer", tokdir);
        anneal_train_config_set(c, "sample-every", "3");
        anneal_train_config_set(c, "sample-tokens", "8");
    }
    if (device) REQUIRE(anneal_train_config_set(c, "device", device) == ANNEAL_OK);
}

/* Runs the config (optionally resuming, optionally stopping after stop_at steps). */
static anneal_status run(const char *out, const char *device, bool resume, int stop_at) {
    anneal_train_config c;
    config(&c, out, device);
    if (resume) anneal_train_config_set(&c, "resume", NULL);
    if (stop_at > 0) {
        char v[32];
        snprintf(v, sizeof v, "%d", stop_at);
        anneal_train_config_set(&c, "stop-at", v);
    }
    anneal_train_result r;
    anneal_status st = anneal_train_run(&c, devnull, &r);
    if (st != ANNEAL_OK) printf("  run on %s: %s\n", device ? device : "cpu", anneal_last_error());
    anneal_train_config_free(&c);
    return st;
}

/* Every field of every step record, in order: loss, grad_norm; and the eval losses. */
typedef struct trace {
    double loss[STEPS], norm[STEPS], val[STEPS];
    char sample[STEPS][512]; /* the sample records' text */
} trace;

static void read_trace(const char *out, trace *tr) {
    char log[600];
    snprintf(log, sizeof log, "%s/log.jsonl", out);
    for (int i = 0; i < STEPS; i++) tr->loss[i] = tr->norm[i] = tr->val[i] = NAN, tr->sample[i][0] = '\0';
    CHECK_TRUE(tu_read_steps(log, "loss", NAN, tr->loss, NULL, NULL, STEPS) == STEPS);
    CHECK_TRUE(tu_read_steps(log, "grad_norm", NAN, tr->norm, NULL, NULL, STEPS) == STEPS);
    FILE *f = fopen(log, "r");
    static char line[1 << 16];
    while (f && fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "eval")) {
            int s = (int)cJSON_GetObjectItemCaseSensitive(o, "step")->valuedouble;
            if (s >= 1 && s <= STEPS) tr->val[s - 1] = cJSON_GetObjectItemCaseSensitive(o, "val_loss")->valuedouble;
        }
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "sample")) {
            int s = (int)cJSON_GetObjectItemCaseSensitive(o, "step")->valuedouble;
            const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, "text");
            if (s >= 1 && s <= STEPS && cJSON_IsString(x))
                snprintf(tr->sample[s - 1], sizeof tr->sample[s - 1], "%s", x->valuestring);
        }
        cJSON_Delete(o);
    }
    if (f) fclose(f);
}

/* Bit-identical traces (NaN where both have none). */
static void check_same_trace(const trace *a, const trace *b, const char *what) {
    for (int i = 0; i < STEPS; i++) {
        CHECK(!memcmp(&a->loss[i], &b->loss[i], sizeof(double)), "%s: step %d loss %.17g vs %.17g", what, i + 1,
              a->loss[i], b->loss[i]);
        CHECK(!memcmp(&a->norm[i], &b->norm[i], sizeof(double)), "%s: step %d grad norm %.17g vs %.17g", what, i + 1,
              a->norm[i], b->norm[i]);
        CHECK((isnan(a->val[i]) && isnan(b->val[i])) || !memcmp(&a->val[i], &b->val[i], sizeof(double)),
              "%s: step %d val loss %.17g vs %.17g", what, i + 1, a->val[i], b->val[i]);
        CHECK(!strcmp(a->sample[i], b->sample[i]), "%s: step %d sample '%s' vs '%s'", what, i + 1, a->sample[i],
              b->sample[i]);
    }
}

/* state.json of a and b equal but for the saved setting "stop-at" (a run stopped with
 * --stop-at saves it; the device is never saved). */
static bool same_state_but_stop_at(const char *fa, const char *fb) {
    const char *ta = tu_slurp(fa);
    cJSON *a = ta ? cJSON_Parse(ta) : NULL;
    const char *tb = tu_slurp(fb);
    cJSON *b = tb ? cJSON_Parse(tb) : NULL;
    cJSON_DeleteItemFromObject(cJSON_GetObjectItemCaseSensitive(a, "config"), "stop-at");
    cJSON_DeleteItemFromObject(cJSON_GetObjectItemCaseSensitive(b, "config"), "stop-at");
    bool eq = a && b && cJSON_Compare(a, b, true);
    cJSON_Delete(a);
    cJSON_Delete(b);
    return eq;
}

/* Every file of checkpoint `name` of run a equals run b's (and there are some);
 * stopped: b's run was stopped there with --stop-at, which its state.json records. */
static void check_same_ckpt(const char *a, const char *b, const char *name, bool stopped, const char *what) {
    char da[700], db[700];
    snprintf(da, sizeof da, "%s/%s", a, name);
    snprintf(db, sizeof db, "%s/%s", b, name);
    DIR *d = opendir(da);
    CHECK(d != NULL, "%s: no %s", what, da);
    if (!d) return;
    int files = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char fa[1000], fb[1000];
        snprintf(fa, sizeof fa, "%s/%s", da, e->d_name);
        snprintf(fb, sizeof fb, "%s/%s", db, e->d_name);
        bool eq = stopped && !strcmp(e->d_name, "state.json") ? same_state_but_stop_at(fa, fb) : tu_files_equal(fa, fb);
        CHECK(eq, "%s: %s/%s differs", what, name, e->d_name);
        files++;
    }
    closedir(d);
    CHECK(files >= 2, "%s: %d files in %s", what, files, da);
}

/* Runs in dir/run (the same path for every run, so the settings saved in the
 * checkpoints are the same) and moves it to dir/<as>. */
static void park(const char *dir, const char *as) {
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/run", dir);
    snprintf(b, sizeof b, "%s/%s", dir, as);
    REQUIRE(rename(a, b) == 0);
}

TEST(emu_trains_like_the_cpu_and_resumes_across_devices) {
    REQUIRE(emu_register() == ANNEAL_OK);
    const char *dir = tu_mkdtemp("devtrain");
    REQUIRE(dir);
    char out[600], p[700];
    snprintf(out, sizeof out, "%s/run", dir);
    make_tokenizer(dir);

    /* straight runs on each device */
    REQUIRE(run(out, NULL, false, 0) == ANNEAL_OK);
    park(dir, "cpu");
    int64_t calls0 = emu_stats.calls;
    REQUIRE(run(out, "emu", false, 0) == ANNEAL_OK);
    park(dir, "emu");
    CHECK(emu_stats.calls > calls0 + 100, "%lld emu kernel calls: the model did not run on emu",
          (long long)(emu_stats.calls - calls0));
    /* emu started on a device: a run on it resumes on the CPU, and the other way round */
    REQUIRE(run(out, "emu", false, HALF) == ANNEAL_OK);
    REQUIRE(run(out, "cpu", true, 0) == ANNEAL_OK);
    park(dir, "emu_then_cpu");
    REQUIRE(run(out, "cpu", false, HALF) == ANNEAL_OK);
    REQUIRE(run(out, "emu", true, 0) == ANNEAL_OK);
    park(dir, "cpu_then_emu");
    CHECK(emu_stats.foreign == 0, "%lld foreign tensors reached emu", (long long)emu_stats.foreign);
    CHECK(emu_stats.host_reuse == 0, "%lld uploaded host buffers were refilled before the synchronize",
          (long long)emu_stats.host_reuse);

    trace cpu, emu, ec, ce;
    snprintf(p, sizeof p, "%s/cpu", dir);
    read_trace(p, &cpu);
    snprintf(p, sizeof p, "%s/emu", dir);
    read_trace(p, &emu);
    snprintf(p, sizeof p, "%s/emu_then_cpu", dir);
    read_trace(p, &ec);
    snprintf(p, sizeof p, "%s/cpu_then_emu", dir);
    read_trace(p, &ce);
    CHECK(isfinite(cpu.loss[0]) && isfinite(cpu.val[HALF - 1]) && isfinite(cpu.val[STEPS - 1]), "cpu trace %g %g %g",
          cpu.loss[0], cpu.val[HALF - 1], cpu.val[STEPS - 1]);
    CHECK(!tokdir[0] || (cpu.sample[HALF - 1][0] && cpu.sample[STEPS - 1][0]), "no samples logged");
    check_same_trace(&cpu, &emu, "emu vs cpu");
    check_same_trace(&cpu, &ec, "emu then cpu vs cpu");
    check_same_trace(&cpu, &ce, "cpu then emu vs cpu");

    char a[600], b[600];
    snprintf(a, sizeof a, "%s/cpu", dir);
    const char *others[3] = {"emu", "emu_then_cpu", "cpu_then_emu"};
    for (int i = 0; i < 3; i++) {
        snprintf(b, sizeof b, "%s/%s", dir, others[i]);
        check_same_ckpt(a, b, "ckpt_00000003", i > 0, others[i]);
        check_same_ckpt(a, b, "ckpt_00000006", false, others[i]);
    }
    /* the start record names the device */
    snprintf(p, sizeof p, "%s/emu/log.jsonl", dir);
    const char *text = tu_slurp(p);
    CHECK(text && strstr(text, "\"device\":\"emu\""), "no \"device\":\"emu\" in the start record");
    tu_rmrf(dir);
}

TEST(bad_devices_are_usage_errors_naming_the_flag) {
    anneal_train_config c;
    anneal_train_config_init(&c);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "bogus") == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "--device") && strstr(anneal_last_error(), "bogus"), "%s", anneal_last_error());
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cuda:x") == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cuda:-1") == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cpu") == ANNEAL_OK);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cuda:0") == ANNEAL_OK); /* the syntax; the run checks the GPU */
    /* the device is not saved with the settings: checkpoints are the same files anywhere */
    char *json = anneal_train_config_to_json(&c);
    CHECK(json && !strstr(json, "\"device\""), "%s", json ? json : "(null)");
    free(json);
    /* a config file's "device" reads like the flag */
    CHECK_TRUE(anneal_train_config_apply_json(&c, "{\"device\": \"nope\"}", "cfg.json", NULL) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "cfg.json") && strstr(anneal_last_error(), "--device"), "%s",
          anneal_last_error());
    anneal_clear_error();
    anneal_device dev = ANNEAL_DEVICE_COUNT;
    CHECK_TRUE(anneal_train_device_resolve("cpu", &dev) == ANNEAL_OK && dev == ANNEAL_CPU);
    CHECK_TRUE(anneal_train_device_resolve(NULL, &dev) == ANNEAL_OK && dev == ANNEAL_CPU);
    if (!anneal_cuda_built() || anneal_cuda_device_count(NULL, 0) == 0) {
        /* no GPU here: cuda says why (not built, or no GPU), as a usage error of the run */
        CHECK_TRUE(anneal_train_device_resolve("cuda:99", &dev) == ANNEAL_ERR_ARG);
        CHECK(strstr(anneal_last_error(), "--device") &&
                  (strstr(anneal_last_error(), "no CUDA backend") || strstr(anneal_last_error(), "GPU")),
              "%s", anneal_last_error());
        anneal_clear_error();
        const char *dir = tu_mkdtemp("devtrain_bad");
        REQUIRE(dir);
        char out[600];
        snprintf(out, sizeof out, "%s/run", dir);
        anneal_train_config_free(&c);
        config(&c, out, "cuda");
        anneal_train_result r;
        CHECK_TRUE(anneal_train_run(&c, devnull, &r) == ANNEAL_ERR_ARG && r.usage_error);
        CHECK(strstr(anneal_last_error(), "--device cuda"), "%s", anneal_last_error());
        anneal_clear_error();
        tu_rmrf(dir);
    }
    anneal_train_config_free(&c);
}

int main(void) {
    devnull = fopen("/dev/null", "w");
    RUN(bad_devices_are_usage_errors_naming_the_flag);
    RUN(emu_trains_like_the_cpu_and_resumes_across_devices);
    fclose(devnull);
    return anneal_test_summary();
}
