/* Stop requests (SIGINT/SIGTERM handlers call anneal_train_request_stop) and the test
 * hooks that make chosen steps non-finite (ANNEAL_TEST_INJECT_NAN), so the skip-and-
 * count path is exercised through the real loop, or one rank's gradient infinite
 * (ANNEAL_TEST_INF_GRAD), so the fp16 scaler's agreement over split parameters is. */
#include "train_internal.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The request lives in core (anneal_interrupt_*), where the loops of the lower layers
 * (model building, loading, evaluation) check it too. */
void anneal_train_request_stop(int signo) { anneal_interrupt_request(signo); }

bool anneal_train_stop_requested(int *signo) {
    int s = anneal_interrupt_pending();
    if (signo) *signo = s;
    return s != 0;
}

void anneal_train_stop_reset(void) { anneal_interrupt_reset(); }

double anneal_train_cpu_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

double anneal_train_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

anneal_status anneal_train_parse_nan_steps(const char *spec, int64_t **steps, int *n) {
    *steps = NULL;
    *n = 0;
    if (!spec || !*spec) return ANNEAL_OK;
    int cap = 0;
    const char *p = spec;
    while (*p) {
        char *end;
        long long a = strtoll(p, &end, 10), b = a;
        if (end == p || a < 1) goto bad;
        p = end;
        if (*p == '-') {
            b = strtoll(p + 1, &end, 10);
            if (end == p + 1 || b < a || b - a > 1000000) goto bad;
            p = end;
        }
        for (long long s = a; s <= b; s++) {
            if (*n == cap) {
                cap = cap ? 2 * cap : 16;
                int64_t *g = realloc(*steps, (size_t)cap * sizeof *g);
                if (!g) {
                    free(*steps), *steps = NULL, *n = 0;
                    return anneal_set_error(ANNEAL_ERR_OOM, "ANNEAL_TEST_INJECT_NAN: out of memory");
                }
                *steps = g;
            }
            (*steps)[(*n)++] = s;
        }
        if (*p == ',') p++;
        else if (*p) goto bad;
    }
    return ANNEAL_OK;
bad:
    free(*steps), *steps = NULL, *n = 0;
    return anneal_set_error(ANNEAL_ERR_ARG, "ANNEAL_TEST_INJECT_NAN: expected steps like \"3,7-9\", got '%s'", spec);
}

bool anneal_train_inject_nan(const trainer *t, int64_t step1) {
    for (int i = 0; i < t->n_nan_steps; i++)
        if (t->nan_steps[i] == step1) return true;
    return false;
}

anneal_status anneal_train_parse_inf_grad(const char *spec, int *rank, int64_t **steps, int *n) {
    *rank = -1;
    *steps = NULL;
    *n = 0;
    if (!spec || !*spec) return ANNEAL_OK;
    char *end;
    long r = strtol(spec, &end, 10);
    if (end == spec || *end != ':' || r < 0 || r > 1000000)
        return anneal_set_error(ANNEAL_ERR_ARG, "ANNEAL_TEST_INF_GRAD: expected RANK:STEPS like \"1:3,7-9\", got '%s'",
                                spec);
    anneal_status st = anneal_train_parse_nan_steps(end + 1, steps, n);
    if (st == ANNEAL_OK) *rank = (int)r;
    return st;
}

void anneal_train_inject_inf_grad(trainer *t, int64_t step1) {
    if (t->rank != t->inf_rank) return;
    bool hit = false;
    for (int i = 0; i < t->n_inf_steps && !hit; i++) hit = t->inf_steps[i] == step1;
    anneal_params *ps = t->model->params;
    for (int i = 0; hit && i < ps->n; i++) {
        anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g || g->device != ANNEAL_CPU || g->dtype != ANNEAL_F32 || anneal_numel(g) < 1) continue;
        ((float *)anneal_data(g))[0] = INFINITY;
        return;
    }
}
