/* The trainer's profiler and memory report (--profile N --profile-steps K,
 * --memory-report): records core's spans over steps N..N+K-1, writes them as a Chrome
 * trace into the run directory as soon as the window ends and again at the end of the
 * run (with the spans of work that was in flight, such as a checkpoint write), and
 * prints the per-op table at the end; the memory breakdown by category after the
 * first step and at the end. */
#include "anneal/profile.h"
#include "train_internal.h"

#include <omp.h>
#include <stdlib.h>

struct train_profile {
    anneal_span *spans;
    int64_t n;
    int64_t first, last; /* 1-based steps covered */
    char path[PATH_MAX + 32];
    bool written;
};

void anneal_train_profile_before_step(trainer *t, int64_t step1) {
    const anneal_train_config *c = &t->cfg;
    if (c->profile <= 0 || step1 != c->profile || t->prof) return;
    t->prof = calloc(1, sizeof *t->prof);
    if (!t->prof) return;
    t->prof->first = step1;
    anneal_trace_thread_name("main");
    anneal_trace_reset();
    anneal_trace_enable(true);
}

/* Collects the spans and writes the trace (again, with the spans that work in flight
 * at the window's end, such as a checkpoint write, has recorded since). */
static void collect_and_write(trainer *t) {
    struct train_profile *p = t->prof;
    free(p->spans);
    p->spans = NULL;
    p->written = false;
    p->n = anneal_trace_collect(&p->spans);
    if (p->n < 0) {
        p->n = 0;
        anneal_progress_note(t->prog, "warning: profile: out of memory collecting the spans");
        return;
    }
    if (t->world > 1) snprintf(p->path, sizeof p->path, "%s/profile_trace_rank%d.json", t->run_dir, t->rank);
    else snprintf(p->path, sizeof p->path, "%s/profile_trace.json", t->run_dir);
    if (anneal_profile_write_chrome(p->path, p->spans, p->n) != ANNEAL_OK) {
        anneal_progress_note(t->prog, "warning: profile: %s", anneal_last_error());
        anneal_clear_error();
        return;
    }
    p->written = true;
}

/* Ends the window: recording off, the trace written at once (rewritten at the end of
 * the run with what was still in flight). */
static void finish_window(trainer *t, int64_t last) {
    anneal_trace_enable(false);
    t->prof->last = last;
    collect_and_write(t);
}

void anneal_train_profile_after_step(trainer *t, int64_t step1) {
    struct train_profile *p = t->prof;
    if (!p || p->last) return;
    if (step1 >= p->first + t->cfg.profile_steps - 1 || step1 >= t->total_steps) finish_window(t, step1);
}

void anneal_train_profile_finish(trainer *t) {
    struct train_profile *p = t->prof;
    if (!p) {
        if (t->cfg.profile > 0 && t->cfg.profile > t->st.step)
            anneal_progress_note(t->prog, "profile: step %lld was not reached: nothing profiled", (long long)t->cfg.profile);
        return;
    }
    if (!p->last) finish_window(t, t->st.step); /* stopped inside the window */
    else collect_and_write(t);                 /* the background writes are done by now */
    if (p->n > 0 && t->out) {
        anneal_progress_note(t->prog, "profile of steps %lld-%lld:", (long long)p->first, (long long)p->last);
        double gbps = anneal_peak_bandwidth_measure(omp_get_max_threads(), 0.2);
        anneal_profile_print(t->out, p->spans, p->n, t->peak_gflops, gbps, 30);
    }
    if (p->written) anneal_progress_note(t->prog, "profile trace: %s (open in https://ui.perfetto.dev or chrome://tracing)", p->path);
    free(p->spans);
    free(p);
    t->prof = NULL;
}

void anneal_train_memory_report(trainer *t, const char *when) {
    if (!t->cfg.memory_report || !t->out) return;
    char buf[2048];
    anneal_memory_report_format(anneal_model_device(t->model), "  ", buf, sizeof buf);
    anneal_progress_note(t->prog, "memory %s:", when);
    fputs(buf, t->out);
    fflush(t->out);
}

void anneal_train_memory_limit(trainer *t, bool on) {
    if (t->cfg.memory_limit_mb <= 0) return;
    anneal_memory_set_limit(anneal_model_device(t->model), on ? (int64_t)(t->cfg.memory_limit_mb * 1048576.0) : 0);
}
