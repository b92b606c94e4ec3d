/* anneal report RUN_DIR: a one-screen summary of a run from its log.jsonl and its
 * checkpoints: settings, time, throughput, losses, bits per byte, checkpoints. */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What the log says. */
typedef struct report {
    cJSON *start;                 /* the first start record (owned) */
    int starts;                   /* invocations (1 + resumes) */
    int64_t steps, tokens, skipped;
    double seconds;               /* wall time of the invocations with a summary */
    double step_ms, step_tokens;  /* sums over step records: mean throughput */
    double mfu_sum;
    int64_t mfu_n;
    double first_loss, last_loss;
    double best_val;
    int64_t best_val_step, evals;
    double peak_rss, peak_alloc;
    bool interrupted;
} report;

static double num(const cJSON *o, const char *k) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(it) ? it->valuedouble : NAN;
}

/* A log's count as int64_t: NaN is -1 (absent), values beyond the range are clamped
 * (a hostile or corrupt log must not make the conversion undefined). */
static int64_t count(double v) {
    if (isnan(v)) return -1;
    if (v >= 9.2e18) return INT64_MAX;
    if (v <= -9.2e18) return INT64_MIN;
    return (int64_t)v;
}

static const char *str(const cJSON *o, const char *k) {
    return cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(o, k));
}

/* Reads the log; a torn last line (a crash) is skipped, a bad line elsewhere is an
 * error naming the file and line. Returns 0 or the exit code. */
static int read_log(const char *path, report *r) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "anneal report: %s: %s (not a run directory?)\n", path, strerror(errno));
        return 1;
    }
    static char line[1 << 20];
    int lineno = 0, rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t n = strlen(line);
        bool whole = n > 0 && line[n - 1] == '\n';
        cJSON *o = cJSON_Parse(line);
        if (!o || !cJSON_IsObject(o)) {
            cJSON_Delete(o);
            if (!whole && feof(f)) break; /* torn last line */
            fprintf(stderr, "anneal report: %s:%d: not a JSON object\n", path, lineno);
            rc = 1;
            break;
        }
        const char *type = str(o, "type");
        if (!type) type = "";
        if (!strcmp(type, "start")) {
            if (!r->start) r->start = cJSON_Duplicate(o, 1);
            r->starts++;
        } else if (!strcmp(type, "step")) {
            double loss = num(o, "loss"), ms = num(o, "ms"), mfu = num(o, "mfu");
            if (isnan(r->first_loss)) r->first_loss = loss;
            r->last_loss = loss;
            double s = num(o, "step"), tk = num(o, "tokens");
            if (isfinite(s)) r->steps = count(s);
            if (isfinite(tk)) r->tokens = count(tk);
            if (isfinite(ms) && ms > 0) {
                r->step_ms += ms;
                double tps = num(o, "tokens_per_s");
                if (isfinite(tps)) r->step_tokens += tps * ms / 1e3;
            }
            if (isfinite(mfu)) r->mfu_sum += mfu, r->mfu_n++;
        } else if (!strcmp(type, "eval")) {
            double v = num(o, "val_loss");
            r->evals++;
            if (isfinite(v) && !(v >= r->best_val)) r->best_val = v, r->best_val_step = count(num(o, "step"));
        } else if (!strcmp(type, "summary")) {
            double s = num(o, "seconds");
            if (isfinite(s)) r->seconds += s;
            double sk = num(o, "skipped_steps");
            if (isfinite(sk)) r->skipped = count(sk);
            r->peak_rss = fmax(r->peak_rss, num(o, "peak_rss_bytes"));
            r->peak_alloc = fmax(r->peak_alloc, num(o, "peak_allocator_bytes"));
            r->interrupted = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "interrupted"));
        }
        cJSON_Delete(o);
    }
    fclose(f);
    if (rc == 0 && !r->start) {
        fprintf(stderr, "anneal report: %s: no start record (not an anneal training log?)\n", path);
        rc = 1;
    }
    return rc;
}

/* Bits per byte of the validation text: the loss in nats per token over ln 2 times
 * tokens per byte, the tokens per byte being the whole prepared corpus's (prepare.json:
 * bytes, train_tokens + val_tokens; the val split is a sample of the same text). NaN
 * when the run's data has no prepare.json (synthetic data). */
static double bits_per_byte(const cJSON *config, double val_loss, char *why, size_t n) {
    const char *data = str(config, "data");
    if (!data) {
        snprintf(why, n, "synthetic data: no text");
        return NAN;
    }
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/prepare.json", data);
    cJSON *p = NULL;
    if (anneal_json_read_file(path, 64u << 20, &p) != ANNEAL_OK) {
        snprintf(why, n, "%s", anneal_last_error());
        anneal_clear_error();
        return NAN;
    }
    double bytes = num(p, "bytes"), tokens = num(p, "train_tokens") + num(p, "val_tokens");
    cJSON_Delete(p);
    if (!(bytes > 0 && tokens > 0)) {
        snprintf(why, n, "%s: no bytes/train_tokens/val_tokens", path);
        return NAN;
    }
    snprintf(why, n, "best val loss; %.3f bytes per token in %s", bytes / tokens, path);
    return val_loss / log(2.0) * tokens / bytes;
}

/* Prints the run's checkpoints (ckpt_* directories, sorted) and the latest pointer. */
static void print_checkpoints(const char *dir) {
    DIR *d = opendir(dir);
    char names[64][NAME_MAX + 1];
    int n = 0, total = 0;
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)))
            if (!strncmp(e->d_name, "ckpt_", 5) && !strstr(e->d_name, ".tmp")) {
                if (n < 64) snprintf(names[n++], sizeof names[0], "%s", e->d_name);
                total++;
            }
        closedir(d);
    }
    qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    char latest[PATH_MAX];
    bool have = anneal_checkpoint_resolve(dir, latest, sizeof latest) == ANNEAL_OK;
    anneal_clear_error();
    printf("checkpoints: %d", total);
    for (int i = 0; i < n && i < 6; i++) printf("%s%s", i ? ", " : " (", names[i]);
    if (n > 6) printf(", ...");
    printf("%s\n", n ? ")" : "");
    if (have) printf("  latest: %s\n", latest);
}

int anneal_cmd_report(int argc, char **argv) {
    bool help = false;
    cli_list pos = {0};
    cli_flag flags[] = {{"help", ARG_BOOL, "show this help", &help, 0}};
    if (!cli_parse_ex("report", argc, argv, flags, 1, &pos)) {
        free(pos.items);
        return 2;
    }
    if (help || pos.n != 1) {
        if (!help) fprintf(stderr, "anneal report: expects exactly one RUN_DIR (got %d)\n", pos.n);
        cli_usage("report", "usage: anneal report RUN_DIR\nA one-screen summary of a training run.", flags, 1);
        free(pos.items);
        return help ? 0 : 2;
    }
    const char *dir = pos.items[0];
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/log.jsonl", dir);
    report r = {.first_loss = NAN, .last_loss = NAN, .best_val = NAN, .best_val_step = -1};
    int rc = read_log(path, &r);
    if (rc) {
        cJSON_Delete(r.start);
        free(pos.items);
        return rc;
    }
    const cJSON *s = r.start, *m = cJSON_GetObjectItemCaseSensitive(s, "model"),
                *c = cJSON_GetObjectItemCaseSensitive(s, "config");
    char b1[32], b2[32], b3[32];
    printf("run: %s\n", dir);
    printf("started: %s (anneal %s)%s\n", str(s, "time") ? str(s, "time") : "?", str(s, "version") ? str(s, "version") : "?",
           r.starts > 1 ? "" : "");
    if (r.starts > 1) printf("  resumed %d time%s\n", r.starts - 1, r.starts == 2 ? "" : "s");
    printf("model: %g layers, %g heads, %g channels, vocab %g, context %g: %s parameters\n", num(m, "n_layer"),
           num(m, "n_head"), num(m, "n_embd"), num(m, "vocab_size"), num(m, "n_ctx"),
           anneal_format_count(num(m, "params"), b1, sizeof b1));
    printf("data: %s\n", str(c, "data") ? str(c, "data") : "synthetic");
    printf("settings: batch %g x seq %g x accum %g, lr %g (%s, warmup %g), dtype %s, seed %g\n", num(c, "batch"),
           num(c, "seq"), num(c, "accum"), num(c, "lr"), str(c, "schedule") ? str(c, "schedule") : "cosine",
           num(c, "warmup"), str(s, "dtype") ? str(s, "dtype") : "?", num(c, "seed"));
    printf("progress: %lld of %g steps, %s tokens, %lld skipped%s\n", (long long)r.steps, num(s, "total_steps"),
           anneal_format_count((double)r.tokens, b1, sizeof b1), (long long)r.skipped,
           r.interrupted ? " (last invocation interrupted)" : "");
    printf("time: %s in %d invocation%s\n", anneal_format_duration(r.seconds, b2, sizeof b2), r.starts,
           r.starts == 1 ? "" : "s");
    double tps = r.step_ms > 0 ? r.step_tokens / (r.step_ms / 1e3) : NAN;
    printf("throughput: %s tokens/s over the steps, MFU %.1f%% (against %g GFLOP/s, %s)\n",
           anneal_format_count(tps, b3, sizeof b3), r.mfu_n ? 100 * r.mfu_sum / (double)r.mfu_n : NAN,
           num(s, "peak_gflops"), str(s, "peak_source") ? str(s, "peak_source") : "?");
    printf("memory: peak allocator %.1f MiB, peak RSS %.1f MiB\n", r.peak_alloc / 1048576.0, r.peak_rss / 1048576.0);
    printf("train loss: %.4f first, %.4f last\n", r.first_loss, r.last_loss);
    if (r.evals > 0) {
        char why[PATH_MAX + 64];
        double bpb = bits_per_byte(c, r.best_val, why, sizeof why);
        printf("best val loss: %.4f at step %lld (%lld evaluations)\n", r.best_val, (long long)r.best_val_step,
               (long long)r.evals);
        if (isfinite(bpb)) printf("bits per byte (val): %.4f (%s)\n", bpb, why);
        else printf("bits per byte (val): n/a (%s)\n", why);
    } else {
        printf("best val loss: none (no evaluation)\n");
    }
    print_checkpoints(dir);
    cJSON_Delete(r.start);
    free(pos.items);
    return 0;
}
