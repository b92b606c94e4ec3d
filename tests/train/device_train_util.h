/* Helpers of the trainer's device tests (test_device_train.c: emu, test_device_cuda.c:
 * a GPU): one small synthetic run's settings on a device, running it (resuming,
 * stopping), reading back its logged losses, norms, validation losses and samples,
 * comparing checkpoints file by file. Header-only (static functions). */
#ifndef ANNEAL_TESTS_DEVICE_TRAIN_UTIL_H
#define ANNEAL_TESTS_DEVICE_TRAIN_UTIL_H

#include "anneal/train.h"
#include "test.h"
#include "train_util.h"

#include <dirent.h>
#include <math.h>

enum { STEPS = 6, HALF = 3 };

static FILE *devnull; /* opened by main */
static char tokdir[600]; /* a small BPE tokenizer for samples ("" when it could not be made) */

/* Learns a tokenizer of 512 ids (the model's vocabulary) from a small
 * text into dir/tok, for the runs' samples. */
static inline void make_tokenizer(const char *dir) {
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
static inline void config(anneal_train_config *c, const char *out, const char *device) {
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
static inline anneal_status run(const char *out, const char *device, bool resume, int stop_at) {
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

static inline void read_trace(const char *out, trace *tr) {
    char log[1024];
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
static inline void check_same_trace(const trace *a, const trace *b, const char *what) {
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
static inline bool same_state_but_stop_at(const char *fa, const char *fb) {
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
static inline void check_same_ckpt(const char *a, const char *b, const char *name, bool stopped, const char *what) {
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
static inline void park(const char *dir, const char *as) {
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/run", dir);
    snprintf(b, sizeof b, "%s/%s", dir, as);
    REQUIRE(rename(a, b) == 0);
}

#endif
