/* The Prometheus endpoint (see anneal/telemetry.h): GET /metrics in the text
 * exposition format 0.0.4, served by a libmicrohttpd thread from figures the trainer
 * updates under a mutex. Counters, gauges and a step-time histogram, all named
 * anneal_* with base units (_seconds, _bytes, _total). */
#include "anneal/telemetry.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Upper bounds of the step-time histogram, in seconds (+Inf is implied). */
static const double step_buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
#define N_BUCKETS ((int)(sizeof step_buckets / sizeof step_buckets[0]))
#define MAX_RANKS 4096

struct anneal_metrics {
    struct MHD_Daemon *daemon;
    int port;
    pthread_mutex_t mu;
    double steps, tokens, samples, skipped, evals;
    double samples_per_step; /* batch x accum, from the start record */
    double loss, val_loss, lr, grad_norm, tokens_per_s, mfu, memory_bytes, loss_scale, total_steps;
    uint64_t bucket_counts[N_BUCKETS + 1];
    double step_seconds_sum;
    uint64_t step_seconds_count;
    int world;
    double *rank_seconds;
};

/* A growing text buffer. */
typedef struct text {
    char *s;
    size_t n, cap;
    bool oom;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
    if (t->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(t->s + t->n, t->cap - t->n, fmt, ap);
        va_end(ap);
        if (k < 0) {
            t->oom = true;
            return;
        }
        if ((size_t)k < t->cap - t->n) {
            t->n += (size_t)k;
            return;
        }
        size_t cap = (t->cap + (size_t)k + 1) * 2;
        char *s = realloc(t->s, cap);
        if (!s) {
            t->oom = true;
            return;
        }
        t->s = s;
        t->cap = cap;
    }
}

/* A value as Prometheus writes it (NaN, +Inf, -Inf spelled its way). */
static const char *fmt_value(double x, char *b, size_t n) {
    if (isnan(x)) snprintf(b, n, "NaN");
    else if (isinf(x)) snprintf(b, n, x > 0 ? "+Inf" : "-Inf");
    else {
        snprintf(b, n, "%.15g", x); /* the shortest of the two that reads back exactly */
        if (strtod(b, NULL) != x) snprintf(b, n, "%.17g", x);
    }
    return b;
}

static void metric(text *t, const char *name, const char *type, const char *help, double v) {
    char b[40];
    put(t, "# HELP %s %s\n# TYPE %s %s\n%s %s\n", name, help, name, type, name, fmt_value(v, b, sizeof b));
}

char *anneal_metrics_render(anneal_metrics *m) {
    text t = {0};
    t.cap = 4096;
    t.s = malloc(t.cap);
    if (!t.s) return NULL;
    t.s[0] = 0;
    char b[40];
    pthread_mutex_lock(&m->mu);
    metric(&t, "anneal_steps_total", "counter", "Optimizer steps done (a resumed run counts its earlier steps).", m->steps);
    metric(&t, "anneal_tokens_total", "counter", "Training tokens consumed.", m->tokens);
    metric(&t, "anneal_samples_total", "counter", "Training sequences consumed (batch x accumulation per step).", m->samples);
    metric(&t, "anneal_skipped_steps_total", "counter", "Steps whose update was skipped (non-finite loss or gradient).",
           m->skipped);
    metric(&t, "anneal_evaluations_total", "counter", "Validation evaluations done.", m->evals);
    metric(&t, "anneal_planned_steps", "gauge", "Optimizer steps the run is set to do.", m->total_steps);
    metric(&t, "anneal_train_loss", "gauge", "Training loss of the last step (nats per token).", m->loss);
    metric(&t, "anneal_val_loss", "gauge", "Last validation loss (nats per token).", m->val_loss);
    metric(&t, "anneal_learning_rate", "gauge", "Learning rate of the last step.", m->lr);
    metric(&t, "anneal_grad_norm", "gauge", "Global gradient norm of the last step (before clipping).", m->grad_norm);
    metric(&t, "anneal_loss_scale", "gauge", "fp16 loss scale of the last step (NaN without one).", m->loss_scale);
    metric(&t, "anneal_tokens_per_second", "gauge", "Training throughput of the last step.", m->tokens_per_s);
    metric(&t, "anneal_mfu_ratio", "gauge", "Model FLOPs utilisation of the last step (0..1).", m->mfu);
    metric(&t, "anneal_memory_bytes", "gauge", "Allocator bytes held on the model's device (tensors and cache).",
           m->memory_bytes);
    put(&t, "# HELP anneal_step_duration_seconds Wall time of an optimizer step.\n"
            "# TYPE anneal_step_duration_seconds histogram\n");
    uint64_t cum = 0;
    for (int i = 0; i < N_BUCKETS; i++) {
        cum += m->bucket_counts[i];
        put(&t, "anneal_step_duration_seconds_bucket{le=\"%s\"} %llu\n", fmt_value(step_buckets[i], b, sizeof b),
            (unsigned long long)cum);
    }
    cum += m->bucket_counts[N_BUCKETS];
    put(&t, "anneal_step_duration_seconds_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    put(&t, "anneal_step_duration_seconds_sum %s\n", fmt_value(m->step_seconds_sum, b, sizeof b));
    put(&t, "anneal_step_duration_seconds_count %llu\n", (unsigned long long)m->step_seconds_count);
    if (m->world > 0 && m->rank_seconds) {
        put(&t, "# HELP anneal_rank_step_duration_seconds Wall time of the last step on each rank.\n"
                "# TYPE anneal_rank_step_duration_seconds gauge\n");
        for (int r = 0; r < m->world; r++)
            put(&t, "anneal_rank_step_duration_seconds{rank=\"%d\"} %s\n", r, fmt_value(m->rank_seconds[r], b, sizeof b));
    }
    pthread_mutex_unlock(&m->mu);
    if (t.oom) {
        free(t.s);
        return NULL;
    }
    return t.s;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                              const char *version, const char *upload_data, size_t *upload_size, void **con_cls) {
    anneal_metrics *m = cls;
    struct MHD_Response *resp;
    unsigned code;
    if (strcmp(method, "GET") && strcmp(method, "HEAD")) {
        static const char msg[] = "only GET\n";
        resp = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
        code = MHD_HTTP_METHOD_NOT_ALLOWED;
    } else if (strcmp(url, "/metrics")) {
        static const char msg[] = "not found: the metrics are at /metrics\n";
        resp = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
        code = MHD_HTTP_NOT_FOUND;
    } else {
        char *body = anneal_metrics_render(m);
        if (!body) return MHD_NO;
        resp = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
        if (!resp) free(body);
        code = MHD_HTTP_OK;
        if (resp) MHD_add_response_header(resp, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
    }
    if (!resp) return MHD_NO;
    enum MHD_Result r = MHD_queue_response(conn, code, resp);
    MHD_destroy_response(resp);
    return r;
}

anneal_status anneal_metrics_start(const char *addr, int port, anneal_metrics **out) {
    *out = NULL;
    if (port < 0 || port > 65535) return anneal_set_error(ANNEAL_ERR_ARG, "--metrics-port %d: not a port (0..65535)", port);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    const char *a = addr ? addr : "127.0.0.1";
    if (inet_pton(AF_INET, a, &sa.sin_addr) != 1)
        return anneal_set_error(ANNEAL_ERR_ARG, "--metrics-addr %s: not an IPv4 address", a);
    anneal_metrics *m = calloc(1, sizeof *m);
    if (!m) return anneal_set_error(ANNEAL_ERR_OOM, "metrics: out of memory");
    pthread_mutex_init(&m->mu, NULL);
    m->loss = m->val_loss = m->lr = m->grad_norm = m->tokens_per_s = m->mfu = m->memory_bytes = m->loss_scale = NAN;
    m->total_steps = NAN;
    m->samples_per_step = NAN;
    m->daemon = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, 0, NULL, NULL, handle, m,
                                 MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT, (unsigned)8,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (!m->daemon) {
        pthread_mutex_destroy(&m->mu);
        free(m);
        return anneal_set_error(ANNEAL_ERR_IO, "--metrics-port %d: cannot listen on %s:%d (in use?)", port, a, port);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(m->daemon, MHD_DAEMON_INFO_BIND_PORT);
    m->port = info ? (int)info->port : port;
    *out = m;
    return ANNEAL_OK;
}

int anneal_metrics_port(const anneal_metrics *m) { return m ? m->port : 0; }

static double num(const cJSON *o, const char *k) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(it) ? it->valuedouble : NAN;
}

void anneal_metrics_record(anneal_metrics *m, const cJSON *r) {
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(r, "type");
    if (!m || !cJSON_IsString(ty)) return;
    const char *type = ty->valuestring;
    pthread_mutex_lock(&m->mu);
    if (!strcmp(type, "start")) {
        const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(r, "config");
        double b = num(cfg, "batch"), k = num(cfg, "accum");
        m->samples_per_step = (isfinite(b) ? b : NAN) * (isfinite(k) ? k : 1);
        m->total_steps = num(r, "total_steps");
        double s = num(r, "step"), tps = num(r, "tokens_per_step");
        if (isfinite(s)) {
            m->steps = s;
            if (isfinite(tps)) m->tokens = s * tps;
            if (isfinite(m->samples_per_step)) m->samples = s * m->samples_per_step;
        }
    } else if (!strcmp(type, "step")) {
        double s = num(r, "step"), tk = num(r, "tokens"), ms = num(r, "ms");
        if (isfinite(s)) m->steps = s;
        if (isfinite(tk)) m->tokens = tk;
        if (isfinite(m->samples_per_step)) m->samples += m->samples_per_step;
        const cJSON *sk = cJSON_GetObjectItemCaseSensitive(r, "skipped");
        if (cJSON_IsTrue(sk)) m->skipped += 1;
        m->loss = num(r, "loss");
        m->lr = num(r, "lr");
        m->grad_norm = num(r, "grad_norm");
        m->tokens_per_s = num(r, "tokens_per_s");
        m->mfu = num(r, "mfu");
        m->memory_bytes = num(r, "memory_bytes");
        m->loss_scale = num(r, "loss_scale");
        if (isfinite(ms) && ms >= 0) {
            double sec = ms / 1e3;
            int i = 0;
            while (i < N_BUCKETS && sec > step_buckets[i]) i++;
            m->bucket_counts[i]++;
            m->step_seconds_sum += sec;
            m->step_seconds_count++;
        }
    } else if (!strcmp(type, "eval")) {
        m->val_loss = num(r, "val_loss");
        m->evals += 1;
    }
    pthread_mutex_unlock(&m->mu);
}

void anneal_metrics_rank_step_seconds(anneal_metrics *m, int world, const double *seconds) {
    if (!m || world <= 0 || world > MAX_RANKS) return;
    pthread_mutex_lock(&m->mu);
    if (m->world != world) {
        double *p = realloc(m->rank_seconds, (size_t)world * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&m->mu);
            return;
        }
        m->rank_seconds = p;
        m->world = world;
    }
    memcpy(m->rank_seconds, seconds, (size_t)world * sizeof *seconds);
    pthread_mutex_unlock(&m->mu);
}

void anneal_metrics_stop(anneal_metrics *m) {
    if (!m) return;
    if (m->daemon) MHD_stop_daemon(m->daemon);
    pthread_mutex_destroy(&m->mu);
    free(m->rank_seconds);
    free(m);
}
