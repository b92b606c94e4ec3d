/* anneal train: flag parsing and wiring for the training loop (src/train). Settings
 * come in layers, later ones winning: defaults, then (with --resume) the settings
 * saved in the checkpoint, then --config-file (a JSON object whose keys are the flag
 * names), then the command line. The first SIGINT/SIGTERM stops the run within
 * moments wherever it is (between micro-batches, in setup's loops, in evaluation):
 * with a step done since the last checkpoint it writes one, and the exit status is 0
 * when a checkpoint to resume from exists, 128 + the signal when the run stopped
 * before it had anything to save; a second signal exits at once with 128 + the signal
 * (docs/ARCHITECTURE.md, "Stopping a run"). */
#include "anneal/anneal.h"
#include "anneal/train.h"
#include "commands.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* "rank R: " in front of this process's messages in a job of several ranks. */
static char rank_prefix[32] = "";

/* One flag from the command line. */
typedef struct flag_kv {
    const char *name; /* points into argv, not NUL-terminated at '=' */
    size_t name_len;
    const char *value; /* NULL for a bare flag */
} flag_kv;

static void on_signal(int signo) {
    static const char msg[] = "\nanneal train: stopping (a checkpoint if a step completed since the last one; "
                              "signal again to quit at once)\n";
    static const char again[] = "\nanneal train: second signal: exiting now\n";
    if (anneal_interrupt_pending()) { /* the second one: no cleanup, the last complete checkpoint stays */
        ssize_t w = write(STDERR_FILENO, again, sizeof again - 1);
        (void)w;
        _exit(128 + signo);
    }
    anneal_train_request_stop(signo);
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
}

static void usage(void) {
    int n;
    const anneal_train_option *o = anneal_train_options(&n);
    printf("usage: anneal train --data DIR [flags]   |   anneal train --synthetic [flags]\n"
           "Trains a language model (GPT-2, or any architecture --config names): progress per step, val loss, samples, checkpoints and a JSON-lines log\n"
           "in the run directory; --resume continues a run exactly where it stopped.\n\nflags:\n");
    for (int i = 0; i < n; i++) {
        const char *arg = o[i].kind == ANNEAL_OPT_INT      ? " N"
                        : o[i].kind == ANNEAL_OPT_FLOAT    ? " X"
                        : o[i].kind == ANNEAL_OPT_STRING   ? " S"
                        : o[i].kind == ANNEAL_OPT_ONOFF    ? " [on|off]"
                                                           : " [DIR]";
        char left[64];
        snprintf(left, sizeof left, "--%s%s", o[i].name, arg);
        printf("  %-24s %s\n", left, o[i].help);
    }
    printf("  %-24s %s\n", "--config-file FILE", "JSON object of settings named like the flags (flags override it)");
    printf("  %-24s %s\n", "--help", "show this help");
}

/* Applies the command-line flags to c. */
static bool apply_flags(anneal_train_config *c, const flag_kv *kv, int n) {
    for (int i = 0; i < n; i++) {
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)kv[i].name_len, kv[i].name);
        if (anneal_train_config_set(c, name, kv[i].value) != ANNEAL_OK) {
            fprintf(stderr, "%sanneal train: %s\n", rank_prefix, anneal_last_error());
            anneal_clear_error();
            return false;
        }
    }
    return true;
}

/* Applies the JSON text of a settings layer. */
static bool apply_json(anneal_train_config *c, const char *json, const char *source, const char *const *skip) {
    if (anneal_train_config_apply_json(c, json, source, skip) != ANNEAL_OK) {
        fprintf(stderr, "%sanneal train: %s\n", rank_prefix, anneal_last_error());
        anneal_clear_error();
        return false;
    }
    return true;
}

int anneal_cmd_train(int argc, char **argv) {
    /* join the job first (mpirun/srun; a single process otherwise), before any thread */
    anneal_comm *comm = anneal_comm_init();
    if (!comm) {
        fprintf(stderr, "anneal train: cannot join the distributed job: %s\n", anneal_last_error());
        return 1;
    }
    int world = anneal_comm_size(comm), rank = anneal_comm_rank(comm);
    if (world > 1) snprintf(rank_prefix, sizeof rank_prefix, "rank %d: ", rank);
    bool ran = false; /* failures before the run are this rank's alone */
    flag_kv *kv = calloc((size_t)argc + 1, sizeof *kv);
    if (!kv) anneal_comm_abort(comm, 1, "anneal train: out of memory");
    int n = 0, rc = 2;
    const char *config_file = NULL;
    bool help = false;
    char *file_json = NULL, *saved_json = NULL;
    anneal_train_config cfg;
    anneal_train_config_init(&cfg);

    /* 1. the command line, syntactically: every flag known, values where needed */
    bool seen_steps = false, seen_tokens = false, seen_model = false, seen_config = false;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || !a[2]) {
            fprintf(stderr, "%sanneal train: unexpected argument '%s' (flags start with --; see anneal train --help)\n", rank_prefix, a);
            goto done;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        char nb[64];
        snprintf(nb, sizeof nb, "%.*s", (int)(len < 63 ? len : 63), name);
        if (!strcmp(nb, "help")) {
            help = true;
            continue;
        }
        const char *value = eq ? eq + 1 : NULL;
        const anneal_train_option *o = anneal_train_option_find(nb);
        bool is_cfg_file = !strcmp(nb, "config-file");
        if (!o && !is_cfg_file) {
            fprintf(stderr, "%sanneal train: unknown flag --%.*s (see anneal train --help)\n", rank_prefix, (int)len, name);
            goto done;
        }
        if (!value) {
            const char *next = i + 1 < argc ? argv[i + 1] : NULL;
            bool next_is_value = next && strncmp(next, "--", 2) != 0;
            if (is_cfg_file || o->kind == ANNEAL_OPT_INT || o->kind == ANNEAL_OPT_FLOAT || o->kind == ANNEAL_OPT_STRING) {
                if (!next) {
                    fprintf(stderr, "%sanneal train: --%s needs a value\n", rank_prefix, nb);
                    goto done;
                }
                value = argv[++i]; /* may start with "-" (a negative number is still checked) */
            } else if (next_is_value) {
                value = argv[++i]; /* --shuffle off, --resume DIR (train takes no positional arguments) */
            }
        }
        if (is_cfg_file) {
            config_file = value;
            continue;
        }
        seen_steps |= !strcmp(nb, "steps");
        seen_tokens |= !strcmp(nb, "tokens");
        seen_model |= !strcmp(nb, "model");
        seen_config |= !strcmp(nb, "config");
        kv[n].name = name;
        kv[n].name_len = len;
        kv[n].value = value;
        n++;
    }
    if (help) {
        if (rank == 0) usage();
        rc = 0;
        goto done;
    }
    if (seen_steps && seen_tokens) {
        fprintf(stderr, "%sanneal train: --steps and --tokens: give one of them\n", rank_prefix);
        goto done;
    }
    if (seen_model && seen_config) {
        fprintf(stderr, "%sanneal train: --model and --config: give one of them\n", rank_prefix);
        goto done;
    }
    if (config_file) {
        if (anneal_read_text_file(config_file, 16u << 20, &file_json, NULL) != ANNEAL_OK) {
            fprintf(stderr, "%sanneal train: --config-file %s\n", rank_prefix, anneal_last_error());
            anneal_clear_error();
            goto done;
        }
    }

    /* 2. a probe of the layers above defaults, to learn whether (and where) we resume */
    anneal_train_config probe;
    anneal_train_config_init(&probe);
    char src[4200];
    snprintf(src, sizeof src, "--config-file %s", config_file ? config_file : "");
    bool ok = (!file_json || apply_json(&probe, file_json, src, NULL)) && apply_flags(&probe, kv, n);
    if (ok && probe.resume) {
        char ckpt[4096];
        if (anneal_train_resume_config(&probe, ckpt, sizeof ckpt, &saved_json) != ANNEAL_OK) {
            fprintf(stderr, "%sanneal train: %s\n", rank_prefix, anneal_last_error());
            rc = anneal_last_status() == ANNEAL_ERR_ARG ? 2 : 1;
            anneal_clear_error();
            ok = false;
        }
    }
    anneal_train_config_free(&probe);
    if (!ok) goto done;

    /* 3. the layers for real: saved settings, config file, flags */
    if (saved_json) {
        char what[64];
        snprintf(what, sizeof what, "the checkpoint's saved settings");
        if (!apply_json(&cfg, saved_json, what, anneal_train_resume_skip)) goto done;
    }
    if (file_json && !apply_json(&cfg, file_json, src, NULL)) goto done;
    if (!apply_flags(&cfg, kv, n)) goto done;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    anneal_train_result res;
    ran = true;
    /* rank 0 prints progress; every rank reports its own errors on stderr */
    anneal_status st = anneal_train_run_comm(&cfg, comm, rank == 0 ? stdout : NULL, &res);
    fflush(stdout);
    if (st == ANNEAL_ERR_INTERRUPTED) { /* stopped before there was anything to save */
        fprintf(stderr, "%sanneal train: %s (nothing saved)\n", rank_prefix, anneal_last_error());
        rc = 128 + (res.signal > 0 ? res.signal : SIGTERM);
    } else if (st != ANNEAL_OK) {
        fprintf(stderr, "%sanneal train: %s\n", rank_prefix, anneal_last_error());
        rc = res.usage_error ? 2 : 1;
    } else {
        rc = 0;
    }
done:
    anneal_train_config_free(&cfg);
    free(file_json);
    free(saved_json);
    free(kv);
    if (rc != 0 && !ran && world > 1 && !help) {
        /* the other ranks may already wait in the run's first collective: end the job */
        char msg[64];
        snprintf(msg, sizeof msg, "%sanneal train: ending the job", rank_prefix);
        fflush(stderr);
        anneal_comm_abort(comm, rc, msg);
    }
    anneal_comm_free(comm);
    return rc;
}
