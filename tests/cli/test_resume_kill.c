/* kill -9 at many moments of a real run, also in the middle of writing a checkpoint:
 * a run checkpointing every step is started, killed (when a .tmp_ckpt_ directory
 * appears, when the `latest` pointer is being replaced, after some steps, during
 * setup), checked (the newest complete checkpoint resolves and validates), and
 * resumed again, until a resume finishes. The result must equal a run that was
 * never killed: every step's loss bit for bit and the final model byte for byte. */
#include "test.h"
#include "train/train_util.h"

#include <dirent.h>

static char args[4096];

/* True when run has an entry whose name starts with prefix and, if pid > 0, ends
 * with "_<pid>" or ".<pid>" (a temporary of that process, not one a killed run left). */
static bool has_entry(const char *run, const char *prefix, pid_t pid) {
    DIR *d = opendir(run);
    if (!d) return false;
    bool found = false;
    struct dirent *e;
    size_t k = strlen(prefix);
    char tail[32];
    snprintf(tail, sizeof tail, "%ld", (long)pid);
    size_t tl = strlen(tail);
    while (!found && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        found = strncmp(e->d_name, prefix, k) == 0 &&
                (pid <= 0 || (n > tl + 1 && !strcmp(e->d_name + n - tl, tail) &&
                              (e->d_name[n - tl - 1] == '_' || e->d_name[n - tl - 1] == '.')));
    }
    closedir(d);
    return found;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* How a kill is triggered. */
typedef enum { AT_TMP_DIR, AT_LATEST_TMP, AT_STEPS, AT_DELAY } trigger;

/* Starts the run (a resume when a checkpoint exists), kills it at the trigger;
 * returns true if it was killed (false: it finished first). */
static bool start_and_kill(const char *common, const char *run, trigger how, int arg, const char *out) {
    char ck[1024];
    bool resume = anneal_checkpoint_resolve(run, ck, sizeof ck) == ANNEAL_OK;
    anneal_clear_error();
    if (resume) snprintf(args, sizeof args, "train --resume %s", run);
    else snprintf(args, sizeof args, "%s --out %s", common, run);
    char *argv[64];
    int n = 0;
    argv[n++] = getenv("ANNEAL_BIN");
    for (char *tok = strtok(args, " "); tok && n < 63; tok = strtok(NULL, " ")) argv[n++] = tok;
    argv[n] = NULL;
    char logp[700];
    snprintf(logp, sizeof logp, "%s/log.jsonl", run);
    int steps0 = tu_count_records(logp, "step");
    pid_t pid = tu_spawn(argv, out, 0);
    if (pid <= 0) return false;
    double t0 = now_ms();
    bool fire = false;
    while (!fire && now_ms() - t0 < 3000) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return false; /* finished before the trigger */
        switch (how) {
        case AT_TMP_DIR: fire = has_entry(run, ".tmp_ckpt_", pid); break;
        case AT_LATEST_TMP: fire = has_entry(run, "latest.tmp.", pid); break;
        case AT_STEPS: fire = tu_count_records(logp, "step") >= steps0 + arg; break;
        case AT_DELAY: fire = now_ms() - t0 >= arg; break;
        }
        if (!fire && how != AT_DELAY) tu_sleep_ms(0);
    }
    if (how == AT_TMP_DIR && arg > 0) tu_sleep_ms(arg);
    kill(pid, SIGKILL);
    bool killed = tu_wait(pid) == 128 + SIGKILL;
    printf("    %s at %.0f ms%s, after step %d\n", resume ? "resume killed" : "run killed", now_ms() - t0,
           fire ? "" : " (trigger not seen: timed out)", tu_count_records(logp, "step"));
    return killed;
}

TEST(kill_at_many_moments_then_resume_equals_straight) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    TU_DIR_AND_DATA(dir, data, "kill");
    char common[2048], out[600], straight[600], run[600];
    enum { STEPS = 24 };
    snprintf(common, sizeof common,
             "train --model tiny --data %s --steps %d --batch 8 --seq 64 --lr 3e-3 --warmup 5 --dropout 0.1 "
             "--threads 2 --ckpt-every 1 --keep 2 --eval-every 8 --eval-batches 2 --peak-gflops 100",
             data, STEPS);
    snprintf(out, sizeof out, "%s/out.txt", dir);
    snprintf(straight, sizeof straight, "%s/straight", dir);
    snprintf(run, sizeof run, "%s/killed", dir);
    snprintf(args, sizeof args, "%s --out %s --ckpt-every 0", common, straight); /* same steps, one checkpoint */
    REQUIRE(tu_run_anneal(args, out, 0) == 0);

    struct { trigger how; int arg; const char *what; } plan[] = {
        {AT_DELAY, 5, "during setup"},
        {AT_TMP_DIR, 0, "as a checkpoint directory appears"},
        {AT_STEPS, 3, "after 3 more steps"},
        {AT_TMP_DIR, 2, "2 ms into a checkpoint write"},
        {AT_LATEST_TMP, 0, "while latest is replaced"},
        {AT_TMP_DIR, 0, "as a checkpoint directory appears"},
        {AT_STEPS, 1, "after 1 more step"},
        {AT_TMP_DIR, 1, "1 ms into a checkpoint write"},
    };
    int killed = 0;
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        char ck[1024];
        bool had = anneal_checkpoint_resolve(run, ck, sizeof ck) == ANNEAL_OK;
        anneal_clear_error();
        bool k = start_and_kill(common, run, plan[i].how, plan[i].arg, out);
        killed += k;
        /* whatever moment it died at, the newest complete checkpoint validates, and
         * once there was one there always is one */
        if (anneal_checkpoint_resolve(run, ck, sizeof ck) == ANNEAL_OK) {
            anneal_model_config mc;
            char *cfg = NULL;
            CHECK(anneal_checkpoint_read_config(ck, &mc, &cfg) == ANNEAL_OK, "kill %s: %s does not validate: %s",
                  plan[i].what, ck, anneal_last_error());
            free(cfg);
        } else {
            CHECK(!had, "kill %zu (%s): no checkpoint resolves any more: %s", i, plan[i].what, anneal_last_error());
        }
        anneal_clear_error();
        if (!k) break; /* the run finished */
    }
    /* the last resume runs to the end */
    snprintf(args, sizeof args, "train --resume %s --ckpt-every 0", run);
    int rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0, "final resume: exit %d: %s", rc, tu_slurp(out));

    double a[STEPS], b[STEPS];
    char la[700], lb[700];
    snprintf(la, sizeof la, "%s/log.jsonl", straight);
    snprintf(lb, sizeof lb, "%s/log.jsonl", run);
    REQUIRE(tu_read_losses(la, a, NULL, STEPS) == STEPS && tu_read_losses(lb, b, NULL, STEPS) == STEPS);
    for (int i = 0; i < STEPS; i++) CHECK(a[i] == b[i], "step %d: %.17g vs %.17g", i + 1, a[i], b[i]);
    char ma[700], mb[700];
    snprintf(ma, sizeof ma, "%s/ckpt_%08d/model.safetensors", straight, STEPS);
    snprintf(mb, sizeof mb, "%s/ckpt_%08d/model.safetensors", run, STEPS);
    CHECK(tu_files_equal(ma, mb), "final models differ");
    /* no temporary is left behind once a run has finished cleanly */
    CHECK_TRUE(!has_entry(run, ".tmp_ckpt_", 0));
    printf("    killed %d times; resumed run equals the straight one\n", killed);
    CHECK(killed >= 4, "only %d kills landed before the run finished", killed);
    tu_rmrf(dir);
}

int main(void) {
    RUN(kill_at_many_moments_then_resume_equals_straight);
    return anneal_test_summary();
}
