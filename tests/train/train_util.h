/* Helpers shared by the training tests: temporary directories, a small real-text
 * data set (a BPE tokenizer learned from the KJV excerpt in ../shared, or from the
 * `bible` program's output, and token shards prepared with it), and reading the
 * per-step losses back from a run's log.jsonl. Header-only (static functions). */
#ifndef ANNEAL_TESTS_TRAIN_UTIL_H
#define ANNEAL_TESTS_TRAIN_UTIL_H

#include "anneal/anneal.h"
#include "anneal/prepare.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* A fresh directory /tmp/anneal_<tag>_XXXXXX (static buffer rotation of 4). */
static inline const char *tu_mkdtemp(const char *tag) {
    static char buf[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "/tmp/anneal_%s_XXXXXX", tag);
    return mkdtemp(buf[k]) ? buf[k] : NULL;
}

/* rm -rf dir (test scratch only). */
static inline void tu_rmrf(const char *dir) {
    if (!dir || strncmp(dir, "/tmp/anneal_", 12) != 0) return;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    int r = system(cmd);
    (void)r;
}

/* Path to a text to learn from: ../shared/data/tokenizer/kjv_head.txt (beside the
 * checkout), or the first books of the KJV written by `bible` into dir/kjv.txt. NULL
 * if neither exists (both are things `make test` promises: callers SKIP_PROMISED). */
static inline const char *tu_corpus(const char *dir) {
    static char path[512];
    const char *p = anneal_test_path("../shared/data/tokenizer/kjv_head.txt");
    if (access(p, R_OK) == 0) {
        snprintf(path, sizeof path, "%s", p);
        return path;
    }
    snprintf(path, sizeof path, "%s/kjv.txt", dir);
    char cmd[640];
    snprintf(cmd, sizeof cmd, "bible gen1:1-exo40:38 > '%s' 2>/dev/null", path);
    struct stat sb;
    if (system(cmd) == 0 && stat(path, &sb) == 0 && sb.st_size > 100000) return path;
    return NULL;
}

/* Learns a BPE tokenizer of `vocab` ids from the text file `corpus` into dir/tok and
 * prepares dir/data (train + 10% val). Returns dir/data, or NULL with the reason in why
 * after recording a test failure: the text is there, so a library error is a bug. */
static inline const char *tu_make_data_from(const char *dir, const char *corpus, int vocab, char *why,
                                            size_t why_n) {
    static char data[512];
    char tokdir[512];
    snprintf(tokdir, sizeof tokdir, "%s/tok", dir);
    snprintf(data, sizeof data, "%s/data", dir);
    const char *files[1] = {corpus};
    anneal_tokenizer *tok = NULL;
    if (anneal_bpe_train(files, 1, vocab, tokdir) != ANNEAL_OK || anneal_tokenizer_load(tokdir, &tok) != ANNEAL_OK) {
        snprintf(why, why_n, "tokenizer from %.200s: %.250s", corpus, anneal_last_error());
        anneal_test_fail(__FILE__, __LINE__, "%s", why);
        return NULL;
    }
    anneal_prepare_config pc = {.tok = tok, .tokenizer_spec = tokdir, .inputs = files, .n_inputs = 1,
                                .out_dir = data, .val_fraction = 0.1, .shard_tokens = 1u << 30,
                                .chunk_bytes = 1 << 20, .threads = 2, .progress = NULL};
    anneal_prepare_result res;
    memset(&res, 0, sizeof res);
    anneal_status st = anneal_prepare_run(&pc, &res);
    anneal_prepare_result_free(&res);
    anneal_tokenizer_free(tok);
    if (st != ANNEAL_OK) {
        snprintf(why, why_n, "prepare %.200s: %.250s", corpus, anneal_last_error());
        anneal_test_fail(__FILE__, __LINE__, "%s", why);
        return NULL;
    }
    return data;
}

/* tu_make_data_from on the corpus tu_corpus finds. NULL with the reason in why, and a
 * test failure recorded when the library failed (anneal_test_failures > 0), none when
 * there is no text (the caller's promised skip). */
static inline const char *tu_make_data(const char *dir, int vocab, char *why, size_t why_n) {
    const char *corpus = tu_corpus(dir);
    if (!corpus) {
        snprintf(why, why_n, "no text: neither ../shared/data/tokenizer/kjv_head.txt (make test expects ../shared "
                             "beside the checkout) nor the bible program (bootstrap installs bible-kjv)");
        return NULL;
    }
    return tu_make_data_from(dir, corpus, vocab, why, why_n);
}

/* Reads "type":"step" records of a log (the last record of a step wins, as after a
 * resume): vals[step-1] = the numeric field key, or `missing` where a record lacks it,
 * and (when flags is non-NULL) flags[step-1] = whether the field flag_key is true.
 * Returns the highest step seen. */
static inline int tu_read_steps(const char *log_path, const char *key, double missing,
                                double *vals, const char *flag_key, bool *flags, int max_steps) {
    FILE *f = fopen(log_path, "r");
    if (!f) return 0;
    static char line[1 << 16];
    int hi = 0;
    while (fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "step")) {
            int s = (int)cJSON_GetObjectItemCaseSensitive(o, "step")->valuedouble;
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
            if (s >= 1 && s <= max_steps) {
                vals[s - 1] = cJSON_IsNumber(v) ? v->valuedouble : missing;
                if (flags) flags[s - 1] = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, flag_key));
                if (s > hi) hi = s;
            }
        }
        cJSON_Delete(o);
    }
    fclose(f);
    return hi;
}

/* losses[step-1] = each step's loss (NaN where not logged), and skipped[step-1] =
 * whether it was skipped (skipped may be NULL); returns the highest step seen. */
static inline int tu_read_losses(const char *log_path, double *losses, bool *skipped, int max_steps) {
    return tu_read_steps(log_path, "loss", NAN, losses, "skipped", skipped, max_steps);
}

/* In a TEST: declares `dir` (a fresh temporary directory named after tag) and `data`
 * (token shards of real text in it, tu_make_data); when there is no text, a promised
 * skip saying why; when the tokenizer trainer or prepare failed, a failure (tu_make_data
 * recorded it). Either way dir is removed and the test ends. */
#define TU_DIR_AND_DATA(dir, data, tag)                                      \
    const char *dir = tu_mkdtemp(tag);                                       \
    REQUIRE(dir);                                                            \
    char dir##_why[1024];                                                    \
    const char *data = tu_make_data(dir, 512, dir##_why, sizeof dir##_why); \
    if (!data) {                                                             \
        tu_rmrf(dir);                                                        \
        if (anneal_test_failures) return;                                    \
        SKIP_PROMISED("%s", dir##_why);                                      \
    }

/* Counts the records of a type in a log. */
static inline int tu_count_records(const char *log_path, const char *type) {
    FILE *f = fopen(log_path, "r");
    if (!f) return 0;
    static char line[1 << 16];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        n += cJSON_IsString(ty) && !strcmp(ty->valuestring, type);
        cJSON_Delete(o);
    }
    fclose(f);
    return n;
}

/* Whole-file comparison. */
static inline bool tu_files_equal(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    bool eq = fa && fb;
    while (eq) {
        int x = fgetc(fa), y = fgetc(fb);
        if (x != y) eq = false;
        if (x == EOF || y == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return eq;
}

/* Starts argv (argv[0] is the program) with stdout and stderr to out_path; with
 * fsize_limit > 0 the child cannot write files larger than that (writes fail with
 * EFBIG, like a full disk). Returns the pid (-1 on failure). */
static inline pid_t tu_spawn(char *const argv[], const char *out_path, long fsize_limit) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
    }
    if (fsize_limit > 0) {
        struct rlimit rl = {(rlim_t)fsize_limit, (rlim_t)fsize_limit};
        setrlimit(RLIMIT_FSIZE, &rl);
        signal(SIGXFSZ, SIG_IGN);
    }
    execv(argv[0], argv);
    _exit(127);
}

/* Waits for pid: its exit code, or 128 + the signal that ended it. */
static inline int tu_wait(pid_t pid) {
    int st = 0;
    if (waitpid(pid, &st, 0) != pid) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
}

/* Runs a space-separated command line (no quoting; paths without spaces) of the
 * anneal binary, output to out_path; returns the exit code. */
static inline int tu_run_anneal(const char *args, const char *out_path, long fsize_limit) {
    static char buf[4096];
    char *argv[64];
    int n = 0;
    argv[n++] = (char *)getenv("ANNEAL_BIN");
    snprintf(buf, sizeof buf, "%s", args);
    for (char *tok = strtok(buf, " "); tok && n < 63; tok = strtok(NULL, " ")) argv[n++] = tok;
    argv[n] = NULL;
    pid_t pid = tu_spawn(argv, out_path, fsize_limit);
    return pid > 0 ? tu_wait(pid) : -1;
}

/* Reads a whole (small) file into a static buffer ("" if missing). */
static inline const char *tu_slurp(const char *path) {
    static char buf[1 << 17];
    buf[0] = '\0';
    FILE *f = fopen(path, "rb");
    if (!f) return buf;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Sleeps ms milliseconds. */
static inline void tu_sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

#endif
