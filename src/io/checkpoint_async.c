/* Background checkpoint writer. save() copies the tensors into host buffers that the
 * checkpointer keeps across saves (after the first save this is a plain memcpy, the
 * only time training waits), then a pthread runs the same writer as the synchronous
 * save on that snapshot. One write at a time: save() and wait() join the previous
 * one first. The thread blocks every signal, so SIGINT/SIGTERM reach the training
 * thread, and hands its error (thread-local in anneal) back through the struct. */
#include "anneal/trace.h"
#include "anneal/tokenizer.h"
#include "io/checkpoint_internal.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct anneal_checkpointer {
    char *run_dir;
    int keep;
    anneal_ckpt_snapshot snap; /* owned by the thread while `running` */
    pthread_t thread;
    bool running;
    anneal_status status; /* result of the last write, set by the thread */
    char *message;        /* its error message (malloc'd), NULL when OK */
    const anneal_tokenizer *tok; /* carried by every checkpoint (not owned) */
    int64_t span_t0;             /* the write's span start, taken when save() launches it */
};

anneal_checkpointer *anneal_checkpointer_new(const char *run_dir, int keep) {
    if (!run_dir || !*run_dir) {
        anneal_set_error(ANNEAL_ERR_ARG, "checkpointer: empty run directory");
        return NULL;
    }
    anneal_checkpointer *c = calloc(1, sizeof *c);
    size_t n = strlen(run_dir) + 1;
    if (c) c->run_dir = malloc(n);
    if (!c || !c->run_dir) {
        free(c);
        anneal_set_error(ANNEAL_ERR_OOM, "checkpointer: out of memory");
        return NULL;
    }
    memcpy(c->run_dir, run_dir, n);
    c->keep = keep;
    return c;
}

void anneal_checkpointer_set_tokenizer(anneal_checkpointer *c, const anneal_tokenizer *tok) {
    if (!c) return;
    anneal_checkpointer_wait(c); /* the write in flight keeps the tokenizer it started with */
    c->tok = tok;
}

/* Runs the writer; records its status and message for the waiting thread. */
static void record_result(anneal_checkpointer *c, anneal_status s) {
    c->status = s;
    c->message = NULL;
    if (s != ANNEAL_OK && asprintf(&c->message, "checkpoint step %lld: %s", (long long)c->snap.st.step,
                                   anneal_last_error()) < 0)
        c->message = NULL;
    anneal_clear_error();
}

static void *writer_main(void *arg) {
    anneal_checkpointer *c = arg;
    anneal_trace_thread_name("checkpoint writer");
    /* the span starts at the launch (save() took t0 on the training thread), so whether a
     * write is profiled does not depend on when this thread gets a core */
    record_result(c, anneal_ckpt_write(c->run_dir, c->keep, &c->snap));
    anneal_span_end(ANNEAL_SPAN_CHECKPOINT, "checkpoint write", c->span_t0, 0, 0);
    return NULL;
}

/* Joins the write in flight (if any) and returns its status, re-recording its error
 * on the calling thread. */
anneal_status anneal_checkpointer_wait(anneal_checkpointer *c) {
    if (!c) return anneal_set_error(ANNEAL_ERR_ARG, "checkpointer: NULL");
    if (!c->running) return ANNEAL_OK;
    pthread_join(c->thread, NULL);
    c->running = false;
    anneal_status s = c->status;
    if (s != ANNEAL_OK) anneal_set_error(s, "%s", c->message ? c->message : "checkpoint write failed");
    free(c->message);
    c->message = NULL;
    c->status = ANNEAL_OK;
    return s;
}

/* Waits for the previous write, snapshots, starts the next write. Returns the
 * snapshot's error if it failed (nothing is written then), else the previous write's
 * status (an error there does not stop this save). */
anneal_status anneal_checkpointer_save(anneal_checkpointer *c, const anneal_model *m, const anneal_optimizer *opt,
                                       const anneal_train_state *st, const char *config_json) {
    if (!c) return anneal_set_error(ANNEAL_ERR_ARG, "checkpointer: NULL");
    anneal_status prev = anneal_checkpointer_wait(c);
    char *prev_msg = NULL;
    if (prev != ANNEAL_OK) { /* keep its message past the snapshot's own error handling */
        const char *e = anneal_last_error();
        size_t n = strlen(e) + 1;
        if ((prev_msg = malloc(n))) memcpy(prev_msg, e, n);
        anneal_clear_error();
    }
    int64_t span_t0 = anneal_span_begin();
    anneal_status r = anneal_ckpt_snapshot_take(&c->snap, m, opt, st, config_json);
    anneal_span_end(ANNEAL_SPAN_CHECKPOINT, "checkpoint snapshot", span_t0, 0, 0);
    c->snap.tokenizer = c->tok;
    if (r == ANNEAL_OK) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        c->span_t0 = anneal_span_begin();
        int rc = pthread_create(&c->thread, NULL, writer_main, c);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc == 0) c->running = true;
        else r = anneal_ckpt_write(c->run_dir, c->keep, &c->snap); /* no thread: write here */
    }
    if (r == ANNEAL_OK && prev != ANNEAL_OK) {
        anneal_set_error(prev, "%s", prev_msg ? prev_msg : "previous checkpoint write failed");
        r = prev;
    }
    free(prev_msg);
    return r;
}

void anneal_checkpointer_free(anneal_checkpointer *c) {
    if (!c) return;
    if (c->running) {
        pthread_join(c->thread, NULL);
        c->running = false;
    }
    free(c->message);
    anneal_ckpt_snapshot_release(&c->snap);
    free(c->run_dir);
    free(c);
}
