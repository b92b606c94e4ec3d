/* Learning-rate schedules: linear warmup followed by constant, cosine, linear or
 * warmup-stable-decay (WSD). Pure functions of the step, computed in double. */
#include "anneal/optim.h"

#include <math.h>
#include <string.h>

/* Fraction (s - start) / len clamped to [0, 1]; a non-positive length is a step
 * from 0 to 1 at `start` (never divides by zero). */
static double progress(int64_t s, int64_t start, int64_t len) {
    if (len <= 0) return s >= start ? 1.0 : 0.0;
    double p = (double)(s - start) / (double)len;
    return p < 0 ? 0 : p > 1 ? 1 : p;
}

/* lr at 0-based step s:
 *   s < warmup:   max_lr * (s + 1) / warmup (warmup <= 0: no warmup);
 *   CONSTANT:     max_lr;
 *   COSINE:       min + 0.5 (max - min) (1 + cos(pi p)), p = (s - warmup) / (total - warmup);
 *   LINEAR:       max + (min - max) p, same p;
 *   WSD:          max until decay_start = total - decay_steps, then
 *                 max + (min - max) (s - decay_start) / decay_steps;
 * with p clamped to [0, 1], so from total_steps on the value is min_lr.
 * Robust to inconsistent settings instead of failing (it returns a number):
 * negative steps count as step 0; total_steps <= warmup_steps (or decay_steps <= 0
 * for WSD) makes the decay zero-length, i.e. min_lr from the end of warmup (WSD:
 * from total_steps) on; a WSD decay that would start inside the warmup starts when
 * the warmup ends and is correspondingly shorter. NULL or an unknown kind returns 0
 * with ANNEAL_ERR_ARG recorded. */
double anneal_schedule_lr(const anneal_schedule *sch, int64_t step) {
    if (!sch) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_schedule_lr: NULL schedule");
        return 0.0;
    }
    double max = sch->max_lr, min = sch->min_lr;
    int64_t s = step < 0 ? 0 : step, warmup = sch->warmup_steps, total = sch->total_steps;
    if (warmup > 0 && s < warmup) return max * (double)(s + 1) / (double)warmup;
    if (warmup < 0) warmup = 0;
    double p;
    switch (sch->kind) {
    case ANNEAL_SCHED_CONSTANT: return max;
    case ANNEAL_SCHED_COSINE:
        p = progress(s, warmup, total - warmup);
        return min + 0.5 * (max - min) * (1.0 + cos(M_PI * p));
    case ANNEAL_SCHED_LINEAR:
        p = progress(s, warmup, total - warmup);
        return max + (min - max) * p;
    case ANNEAL_SCHED_WSD: {
        int64_t decay = sch->decay_steps > 0 ? sch->decay_steps : 0;
        int64_t start = total - decay < warmup ? warmup : total - decay;
        p = progress(s, start, total - start);
        return max + (min - max) * p;
    }
    }
    anneal_set_error(ANNEAL_ERR_ARG, "anneal_schedule_lr: unknown schedule kind %d", (int)sch->kind);
    return 0.0;
}

/* "constant", "cosine", "linear", "wsd" (exact, lower case); false (no error
 * recorded) for anything else or NULL arguments. */
bool anneal_schedule_parse(const char *name, anneal_schedule_kind *out) {
    static const struct {
        const char *name;
        anneal_schedule_kind kind;
    } k_names[] = {{"constant", ANNEAL_SCHED_CONSTANT},
                   {"cosine", ANNEAL_SCHED_COSINE},
                   {"linear", ANNEAL_SCHED_LINEAR},
                   {"wsd", ANNEAL_SCHED_WSD}};
    if (!name || !out) return false;
    for (size_t i = 0; i < sizeof k_names / sizeof k_names[0]; i++)
        if (strcmp(name, k_names[i].name) == 0) {
            *out = k_names[i].kind;
            return true;
        }
    return false;
}
