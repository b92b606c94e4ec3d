/* The server's figures in the Prometheus text format 0.0.4: requests by endpoint and
 * status, tokens in and out, queue depth and running slots, and histograms of the time
 * to the first token and of the time between tokens. Updated under a mutex. */
#include "serve_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const double ttft_buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double tok_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
#define N_TTFT ((int)(sizeof ttft_buckets / sizeof ttft_buckets[0]))
#define N_TOK ((int)(sizeof tok_buckets / sizeof tok_buckets[0]))
#define MAX_CODES 24

typedef struct histogram {
    uint64_t counts[16]; /* per bucket (not cumulative), the last one +Inf */
    double sum;
    uint64_t n;
} histogram;

struct anneal_serve_metrics {
    pthread_mutex_t mu;
    int codes[MAX_CODES], n_codes;
    uint64_t requests[ANNEAL_EP_COUNT][MAX_CODES];
    uint64_t prompt_tokens, completion_tokens;
    histogram ttft, tok;
    uint64_t steps, step_rows, prefills, prefill_rows;
    double phase_s[ANNEAL_SERVE_PHASES];
    int threads;
};

static const char *const phase_names[ANNEAL_SERVE_PHASES] = {"prefill", "decode", "sample", "text", "mixed"};

static const char *const ep_names[ANNEAL_EP_COUNT] = {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                                      "/health", "/metrics", "other"};

anneal_serve_metrics *anneal_serve_metrics_new(void) {
    anneal_serve_metrics *m = calloc(1, sizeof *m);
    if (m) pthread_mutex_init(&m->mu, NULL);
    return m;
}

void anneal_serve_metrics_free(anneal_serve_metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void anneal_serve_metrics_request(anneal_serve_metrics *m, anneal_serve_endpoint ep, int status) {
    if (!m || ep < 0 || ep >= ANNEAL_EP_COUNT) return;
    pthread_mutex_lock(&m->mu);
    int k = 0;
    while (k < m->n_codes && m->codes[k] != status) k++;
    if (k == m->n_codes && m->n_codes < MAX_CODES) m->codes[m->n_codes++] = status;
    if (k < m->n_codes) m->requests[ep][k]++;
    pthread_mutex_unlock(&m->mu);
}

void anneal_serve_metrics_tokens(anneal_serve_metrics *m, int64_t prompt, int64_t completion) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    m->prompt_tokens += (uint64_t)(prompt > 0 ? prompt : 0);
    m->completion_tokens += (uint64_t)(completion > 0 ? completion : 0);
    pthread_mutex_unlock(&m->mu);
}

static void observe(anneal_serve_metrics *m, histogram *h, const double *b, int nb, double s) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    int k = 0;
    while (k < nb && s > b[k]) k++;
    h->counts[k]++;
    h->sum += s;
    h->n++;
    pthread_mutex_unlock(&m->mu);
}

void anneal_serve_metrics_ttft(anneal_serve_metrics *m, double s) { observe(m, &m->ttft, ttft_buckets, N_TTFT, s); }
void anneal_serve_metrics_token_latency(anneal_serve_metrics *m, double s) {
    observe(m, &m->tok, tok_buckets, N_TOK, s);
}

/* A growing text buffer. */
typedef struct text {
    char *s;
    size_t n, cap;
    bool oom;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
    while (!t->oom) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(t->s ? t->s + t->n : NULL, t->s ? t->cap - t->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) t->oom = true;
        else if (t->s && (size_t)k < t->cap - t->n) {
            t->n += (size_t)k;
            return;
        } else {
            size_t cap = (t->cap + (size_t)k + 1) * 2;
            char *s = realloc(t->s, cap);
            if (!s) t->oom = true;
            else {
                t->s = s;
                t->cap = cap;
            }
        }
    }
}

/* One metric without labels: its HELP and TYPE lines and its value. */
static void put_value(text *t, const char *name, const char *type, const char *help, unsigned long long v) {
    put(t, "# HELP %s %s\n# TYPE %s %s\n%s %llu\n", name, help, name, type, name, v);
}

static void put_histogram(text *t, const char *name, const char *help, const histogram *h, const double *b, int nb) {
    put(t, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int k = 0; k < nb; k++) {
        cum += h->counts[k];
        put(t, "%s_bucket{le=\"%g\"} %llu\n", name, b[k], (unsigned long long)cum);
    }
    cum += h->counts[nb];
    put(t, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.9g\n%s_count %llu\n", name, (unsigned long long)cum, name, h->sum,
        name, (unsigned long long)h->n);
}

void anneal_serve_metrics_threads(anneal_serve_metrics *m, int threads) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    m->threads = threads;
    pthread_mutex_unlock(&m->mu);
}

void anneal_serve_metrics_engine(anneal_serve_metrics *m, int64_t step_rows, int64_t prefills, int64_t prefill_rows,
                                 const double phase_s[ANNEAL_SERVE_PHASES]) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    m->steps += step_rows > 0;
    m->step_rows += (uint64_t)(step_rows > 0 ? step_rows : 0);
    m->prefills += (uint64_t)(prefills > 0 ? prefills : 0);
    m->prefill_rows += (uint64_t)(prefill_rows > 0 ? prefill_rows : 0);
    for (int k = 0; k < ANNEAL_SERVE_PHASES; k++) m->phase_s[k] += phase_s[k];
    pthread_mutex_unlock(&m->mu);
}

char *anneal_serve_metrics_text(anneal_serve_metrics *m, int queue_depth, int running, int slots) {
    text t = {0};
    pthread_mutex_lock(&m->mu);
    put(&t, "# HELP anneal_serve_requests_total HTTP requests answered, by endpoint and status code.\n"
            "# TYPE anneal_serve_requests_total counter\n");
    for (int ep = 0; ep < ANNEAL_EP_COUNT; ep++)
        for (int k = 0; k < m->n_codes; k++)
            if (m->requests[ep][k])
                put(&t, "anneal_serve_requests_total{endpoint=\"%s\",status=\"%d\"} %llu\n", ep_names[ep], m->codes[k],
                    (unsigned long long)m->requests[ep][k]);
    put_value(&t, "anneal_serve_prompt_tokens_total", "counter", "Prompt tokens of the requests that ran.",
              m->prompt_tokens);
    put_value(&t, "anneal_serve_completion_tokens_total", "counter", "Tokens generated.", m->completion_tokens);
    put_value(&t, "anneal_serve_queue_depth", "gauge", "Requests waiting for a slot.", (unsigned long long)queue_depth);
    put_value(&t, "anneal_serve_running", "gauge", "Requests in a slot (decoded together each step).",
              (unsigned long long)running);
    put_value(&t, "anneal_serve_slots", "gauge", "Slots (the most requests decoded together).",
              (unsigned long long)slots);
    put_value(&t, "anneal_serve_threads", "gauge", "OpenMP threads of the engine's model work.",
              (unsigned long long)m->threads);
    put_value(&t, "anneal_serve_decode_steps_total", "counter", "Decode steps run (all running requests together).",
              m->steps);
    put_value(&t, "anneal_serve_decode_rows_total", "counter", "Rows (one per running request) of the decode steps.",
              m->step_rows);
    put_value(&t, "anneal_serve_prefills_total", "counter", "Prefill passes over the weights.", m->prefills);
    put_value(&t, "anneal_serve_prefill_rows_total", "counter", "Prompt tokens through the prefill passes.",
              m->prefill_rows);
    put(&t, "# HELP anneal_serve_engine_seconds_total Wall seconds of the engine thread by phase.\n"
            "# TYPE anneal_serve_engine_seconds_total counter\n");
    for (int k = 0; k < ANNEAL_SERVE_PHASES; k++)
        put(&t, "anneal_serve_engine_seconds_total{phase=\"%s\"} %.6f\n", phase_names[k], m->phase_s[k]);
    put_histogram(&t, "anneal_serve_time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
                  &m->ttft, ttft_buckets, N_TTFT);
    put_histogram(&t, "anneal_serve_time_per_output_token_seconds", "Seconds between two tokens of a request.", &m->tok,
                  tok_buckets, N_TOK);
    pthread_mutex_unlock(&m->mu);
    if (t.oom) {
        free(t.s);
        return NULL;
    }
    return t.s;
}
