/* What the command-line tests of distributed training share (test_train_dist.c and the
 * tests of each parallel layout): shell commands run with a time limit in their own
 * process group, the parameters of a run's newest checkpoint and the sample texts and
 * val losses of a run's log. Header-only, like
 * train/train_util.h, which it builds on. */
#ifndef ANNEAL_TESTS_TRAIN_RUNS_H
#define ANNEAL_TESTS_TRAIN_RUNS_H

#include "train/train_util.h"

#include <cjson/cJSON.h>
#include <errno.h>

/* Monotonic milliseconds. */
static inline double tr_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Starts `sh -c cmd` in a new process group, output to out (-1 when fork fails). */
static inline pid_t tr_sh_start(const char *cmd, const char *out) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    setpgid(0, 0);
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
    }
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
}

/* Waits for pid at most timeout_s: its exit code (128 + signal), or -2 after killing
 * its whole process group on timeout. *secs (may be NULL): how long it took. */
static inline int tr_sh_wait(pid_t pid, double timeout_s, double *secs) {
    double t0 = tr_now_ms();
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            if (secs) *secs = (tr_now_ms() - t0) / 1e3;
            kill(-pid, SIGKILL); /* anything the job left behind in its group */
            return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
        }
        if (r < 0 && errno != EINTR) return -1;
        if (tr_now_ms() - t0 > timeout_s * 1e3) {
            kill(-pid, SIGKILL);
            waitpid(pid, &st, 0);
            if (secs) *secs = (tr_now_ms() - t0) / 1e3;
            return -2;
        }
        tu_sleep_ms(20);
    }
}

/* Runs cmd (shell syntax) with the time limit: as tr_sh_wait, saying so on a timeout. */
static inline int tr_sh_run(const char *cmd, const char *out, double timeout_s) {
    pid_t pid = tr_sh_start(cmd, out);
    if (pid < 0) return -1;
    int rc = tr_sh_wait(pid, timeout_s, NULL);
    if (rc == -2) printf("    TIMEOUT after %.0f s: %s\n", timeout_s, cmd);
    return rc;
}

/* All parameters of the newest checkpoint of run directory dir, concatenated in
 * registration order (malloc'd, *n elements), or NULL. */
static inline float *tr_ckpt_params(const char *dir, int64_t *n) {
    char ck[1024];
    *n = 0;
    if (anneal_checkpoint_resolve(dir, ck, sizeof ck) != ANNEAL_OK) return NULL;
    anneal_model_config mc;
    if (anneal_checkpoint_read_config(ck, &mc, NULL) != ANNEAL_OK) return NULL;
    anneal_model *m = anneal_model_new(&mc, ANNEAL_CPU);
    anneal_train_state st;
    float *out = NULL;
    if (m && anneal_checkpoint_load(ck, m, NULL, &st) == ANNEAL_OK) {
        int64_t total = anneal_params_numel(m->params), k = 0;
        out = malloc((size_t)total * sizeof *out);
        for (int i = 0; out && i < m->params->n; i++) {
            anneal_tensor *t = m->params->items[i].tensor;
            memcpy(out + k, anneal_data(t), (size_t)anneal_numel(t) * sizeof *out);
            k += anneal_numel(t);
        }
        *n = total;
    }
    anneal_model_free(m);
    return out;
}

/* Every "text" (type "sample") or "val_loss" (type "eval") of the JSON-lines log at
 * path, joined with '|' into out (n bytes). */
static inline void tr_log_values(const char *path, const char *type, char *out, size_t n) {
    char line[16384];
    FILE *f = fopen(path, "r");
    size_t k = 0;
    out[0] = '\0';
    while (f && fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, type) && k + 64 < n) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, strcmp(type, "sample") ? "val_loss" : "text");
            if (cJSON_IsString(v)) k += (size_t)snprintf(out + k, n - k, "%.*s|", (int)(n - k - 2), v->valuestring);
            else if (cJSON_IsNumber(v)) k += (size_t)snprintf(out + k, n - k, "%.17g|", v->valuedouble);
            if (k >= n) k = n - 1;
        }
        cJSON_Delete(o);
    }
    if (f) fclose(f);
}

/* Each step record's "loss_scale" of the JSON-lines log at path, followed by "O" when
 * it reports an overflow, joined with '|' into out (n bytes): "65536|131072O|...". */
static inline void tr_scale_trace(const char *path, char *out, size_t n) {
    char line[16384];
    FILE *f = fopen(path, "r");
    size_t k = 0;
    out[0] = '\0';
    while (f && fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "loss_scale");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "step") && cJSON_IsNumber(s) && k + 32 < n)
            k += (size_t)snprintf(out + k, n - k, "%.9g%s|", s->valuedouble,
                                  cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "overflow")) ? "O" : "");
        cJSON_Delete(o);
    }
    if (f) fclose(f);
}

/* The last "memory" record of the log at path (taken `when`, e.g. "at start": after
 * setup, before the first step, for a resume the resumed run's; NULL: any): rank r's
 * measured peaks of the allocator's parameter and optimizer-state categories since the
 * process started, MiB. */
static inline bool tr_memory_peaks(const char *path, const char *when, int r, double *param_peak,
                                   double *optim_peak) {
    char line[16384];
    FILE *f = fopen(path, "r");
    bool got = false;
    while (f && fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type"), *w = cJSON_GetObjectItemCaseSensitive(o, "when");
        if (cJSON_IsString(ty) && !strcmp(ty->valuestring, "memory") &&
            (!when || (cJSON_IsString(w) && !strcmp(w->valuestring, when)))) {
            const cJSON *e = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "ranks"), r);
            const cJSON *p = cJSON_GetObjectItemCaseSensitive(e, "param_peak_mib");
            const cJSON *q = cJSON_GetObjectItemCaseSensitive(e, "optim_peak_mib");
            got = cJSON_IsNumber(p) && cJSON_IsNumber(q);
            if (got) *param_peak = p->valuedouble, *optim_peak = q->valuedouble;
        }
        cJSON_Delete(o);
    }
    if (f) fclose(f);
    return got;
}

/* The whole of file path (malloc'd; NULL when unreadable), its size in *n. */
static inline char *tr_read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    *n = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = len >= 0 ? malloc((size_t)len + 1) : NULL;
    if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = b ? (size_t)len : 0;
    return b;
}

/* PowerSGD under a model-parallel layout (run, with `warmup` plain steps first, and
 * resumed, a copy of it stopped at half and resumed in the same layout; plain, the same
 * layout uncompressed): the warm-up steps and the first compressed step's loss (computed
 * before its update) are plain's within rtol, every later step hands all-reduce at least
 * 4x fewer bytes than uncompressed, and the resumed run is the straight one's bits (each
 * rank's error feedback and Q saved next to the checkpoint). */
static inline void tr_check_powersgd(const char *run, const char *resumed, const char *plain, int steps, int warmup,
                                     double rtol) {
    double a[64], b[64], r[64], bytes[64], full[64];
    int na = tu_read_losses(run, a, NULL, 64), nb = tu_read_losses(plain, b, NULL, 64),
        nr = tu_read_losses(resumed, r, NULL, 64);
    CHECK(na == steps && nb == steps && nr == steps, "steps: %d compressed, %d plain, %d resumed (want %d)", na, nb,
          nr, steps);
    if (na != steps || nb != steps || nr != steps) return;
    for (int i = 0; i <= warmup && i < steps; i++)
        CHECK(fabs(a[i] - b[i]) <= rtol * fabs(b[i]), "step %d (warm-up): loss %.9g, uncompressed %.9g", i + 1, a[i], b[i]);
    CHECK(memcmp(a, r, sizeof(double) * (size_t)steps) == 0, "the resumed run's losses are not the straight run's bits");
    REQUIRE(tu_read_steps(run, "comm_bytes", NAN, bytes, "skipped", NULL, 64) == steps);
    REQUIRE(tu_read_steps(run, "comm_bytes_uncompressed", NAN, full, "skipped", NULL, 64) == steps);
    double worst = 0;
    for (int i = warmup; i < steps; i++) worst = fmax(worst, bytes[i] / full[i]);
    printf("    PowerSGD: steps 1-%d plain, then all-reduce bytes at most %.3f of uncompressed; loss %.5f -> %.5f "
           "(uncompressed %.5f -> %.5f)\n", warmup, worst, a[0], a[steps - 1], b[0], b[steps - 1]);
    CHECK(worst > 0 && worst <= 0.25, "compressed steps hand all-reduce %.3f of the uncompressed bytes", worst);
}

/* True when mpirun is on the PATH. */
static inline bool tr_have_mpirun(void) { return system("command -v mpirun >/dev/null 2>&1") == 0; }

#endif
