/* The HTTP side of `anneal serve` (libmicrohttpd, one thread per connection): routing,
 * body limits, validation, tokenization and context checks, submission to the engine,
 * and the replies, whole or streamed as server-sent events. A handler waiting for the
 * engine watches its socket, so a client that leaves (streaming or not) cancels its
 * request and frees its slot at the next step. */
#include "serve_internal.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

struct anneal_server {
    struct MHD_Daemon *daemon;
    int port;
    anneal_model *model;
    anneal_tokenizer *tok;
    anneal_serve_config cfg;
    char *host, *model_name;
    anneal_serve_limits lim;
    anneal_serve_engine *engine;
    anneal_serve_metrics *metrics;
    atomic_bool stopping;
    atomic_int in_flight;         /* requests between their headers and their completion */
    atomic_uint_fast64_t counter; /* request ids and default seeds */
    long long created;            /* Unix seconds at start (/v1/models) */
};

/* The body of one connection's request. */
typedef struct conn {
    char *body;
    size_t len, cap;
    bool too_big;
} conn;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t splitmix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Queues a response with body (taken: freed by MHD) and counts it. */
static enum MHD_Result reply(anneal_server *s, struct MHD_Connection *c, anneal_serve_endpoint ep, int status,
                             const char *type, char *body) {
    if (!body) {
        status = 500;
        type = "application/json";
        const char *oom = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        body = strdup(oom);
        if (!body) return MHD_NO;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    anneal_serve_metrics_request(s->metrics, ep, status);
    return ok;
}

static enum MHD_Result reply_error(anneal_server *s, struct MHD_Connection *c, anneal_serve_endpoint ep, int status,
                                   const char *type, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
static enum MHD_Result reply_error(anneal_server *s, struct MHD_Connection *c, anneal_serve_endpoint ep, int status,
                                   const char *type, const char *param, const char *code, const char *fmt, ...) {
    anneal_serve_error e = {.http_status = status};
    snprintf(e.type, sizeof e.type, "%s", type);
    snprintf(e.param, sizeof e.param, "%s", param ? param : "");
    snprintf(e.code, sizeof e.code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    return reply(s, c, ep, status, "application/json", anneal_serve_error_json(&e));
}

/* True when the client of c has closed its side of the connection. */
static bool client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return true;
    char b;
    return (p.revents & POLLIN) && recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

/* Waits until the job leaves the queue (until_done: until it is done); false when the
 * client left first (the job is then cancelled). */
static bool wait_job(anneal_server *s, struct MHD_Connection *c, anneal_serve_job *j, bool until_done) {
    pthread_mutex_t *mu = anneal_serve_engine_lock(s->engine);
    for (;;) {
        pthread_mutex_lock(mu);
        bool ready = until_done ? j->state == ANNEAL_JOB_DONE : j->state != ANNEAL_JOB_QUEUED;
        if (!ready) anneal_serve_job_wait(s->engine, j, 50);
        ready = until_done ? j->state == ANNEAL_JOB_DONE : j->state != ANNEAL_JOB_QUEUED;
        pthread_mutex_unlock(mu);
        if (ready) return true;
        if (client_gone(c)) {
            anneal_serve_job_cancel(s->engine, j);
            return false;
        }
    }
}

/* ------------------------------------------------------------ streaming */

typedef struct stream {
    anneal_server *s;
    struct MHD_Connection *c;
    anneal_serve_job *j;
    anneal_serve_reply r;
    size_t sent;  /* bytes of the job's text sent */
    int phase;    /* 0: role chunk (chat), 1: text, 2: usage, 3: [DONE], 4: end */
    char *out;    /* pending bytes of the SSE stream */
    size_t out_len, out_pos;
    int status;   /* what the metrics count */
} stream;

/* Appends "data: json\n\n" to the pending bytes (json taken). */
static bool sse(stream *st, char *json) {
    if (!json) return false;
    size_t n = strlen(json), need = st->out_len + n + 8;
    char *o = realloc(st->out, need);
    if (!o) {
        free(json);
        return false;
    }
    st->out = o;
    memcpy(o + st->out_len, "data: ", 6);
    memcpy(o + st->out_len + 6, json, n);
    memcpy(o + st->out_len + 6 + n, "\n\n", 2);
    st->out_len += n + 8;
    free(json);
    return true;
}

/* Fills the pending bytes with what the job has made since the last call; blocks
 * (watching the socket) until there is something. false: the stream ends with an error. */
static bool produce(stream *st) {
    anneal_server *s = st->s;
    anneal_serve_job *j = st->j;
    pthread_mutex_t *mu = anneal_serve_engine_lock(s->engine);
    while (st->out_len == st->out_pos && st->phase < 4) {
        st->out_len = st->out_pos = 0;
        if (st->phase == 0) {
            st->phase = 1;
            if (st->r.kind == ANNEAL_SERVE_CHAT && !sse(st, anneal_serve_chunk_json(&st->r, ANNEAL_CHUNK_ROLE, NULL, 0)))
                return false;
            continue;
        }
        if (st->phase == 2) {
            st->phase = 3;
            if (st->r.include_usage && !sse(st, anneal_serve_chunk_json(&st->r, ANNEAL_CHUNK_USAGE, NULL, 0))) return false;
            continue;
        }
        if (st->phase == 3) {
            st->phase = 4;
            const char *done = "data: [DONE]\n\n";
            if (!(st->out = realloc(st->out, strlen(done)))) return false;
            memcpy(st->out, done, strlen(done));
            st->out_len = strlen(done);
            continue;
        }
        pthread_mutex_lock(mu);
        if (j->shown == st->sent && j->state != ANNEAL_JOB_DONE) anneal_serve_job_wait(s->engine, j, 50);
        size_t shown = j->shown;
        bool done = j->state == ANNEAL_JOB_DONE;
        char *piece = NULL;
        size_t n = shown > st->sent ? shown - st->sent : 0;
        if (n && (piece = malloc(n))) memcpy(piece, j->text + st->sent, n);
        if (done) {
            st->r.finish = j->finish;
            st->r.completion_tokens = j->n_gen;
        }
        int err = j->err_status;
        char etype[32], emsg[200];
        snprintf(etype, sizeof etype, "%s", j->err_type);
        snprintf(emsg, sizeof emsg, "%s", j->err_msg);
        pthread_mutex_unlock(mu);
        if (n && !piece) return false;
        if (n) {
            bool ok = sse(st, anneal_serve_chunk_json(&st->r, ANNEAL_CHUNK_TEXT, piece, n));
            free(piece);
            if (!ok) return false;
            st->sent = shown;
        }
        if (done) {
            if (err) {
                st->status = err;
                anneal_serve_error e = {.http_status = err};
                snprintf(e.type, sizeof e.type, "%s", etype);
                snprintf(e.message, sizeof e.message, "%s", emsg);
                if (!sse(st, anneal_serve_error_json(&e))) return false;
                st->phase = 3;
            } else {
                if (!sse(st, anneal_serve_chunk_json(&st->r, ANNEAL_CHUNK_FINISH, NULL, 0))) return false;
                st->phase = 2;
            }
        } else if (!n && client_gone(st->c)) {
            return false;
        }
    }
    return true;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream *st = cls;
    if (!produce(st)) {
        anneal_serve_job_cancel(st->s->engine, st->j);
        st->status = 499;
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    if (st->out_pos == st->out_len) return MHD_CONTENT_READER_END_OF_STREAM;
    size_t n = st->out_len - st->out_pos < max ? st->out_len - st->out_pos : max;
    memcpy(buf, st->out + st->out_pos, n);
    st->out_pos += n;
    return (ssize_t)n;
}

static void stream_free(void *cls) {
    stream *st = cls;
    anneal_serve_job_cancel(st->s->engine, st->j); /* a no-op when done */
    anneal_serve_metrics_request(st->s->metrics, st->r.kind == ANNEAL_SERVE_CHAT ? ANNEAL_EP_CHAT : ANNEAL_EP_COMPLETIONS,
                                 st->status);
    anneal_serve_job_release(st->s->engine, st->j);
    free(st->out);
    free(st);
}

/* ------------------------------------------------------------ generation */

/* The prompt's ids (malloc'd into *ids) from a validated request; an error reply's
 * status (with *err filled) otherwise. */
static int tokenize(anneal_server *s, const anneal_serve_request *q, int32_t **ids_out, int64_t *n_out,
                    anneal_serve_error *err) {
    anneal_ids ids = {0};
    int32_t V = s->model->cfg.vocab_size, eot = anneal_tokenizer_eot(s->tok);
    const char *param = q->kind == ANNEAL_SERVE_CHAT ? "messages" : "prompt";
    *ids_out = NULL;
    *n_out = 0;
    err->http_status = 400;
    snprintf(err->type, sizeof err->type, "invalid_request_error");
    snprintf(err->param, sizeof err->param, "%s", param);
    if (q->prompt_ids) {
        for (int64_t i = 0; i < q->n_prompt_ids; i++)
            if (q->prompt_ids[i] >= V) {
                snprintf(err->message, sizeof err->message, "'prompt'[%lld] = %d is outside the model's vocabulary of %d",
                         (long long)i, q->prompt_ids[i], V);
                return 400;
            }
        if (!(*ids_out = malloc((size_t)q->n_prompt_ids * sizeof **ids_out))) goto oom;
        memcpy(*ids_out, q->prompt_ids, (size_t)q->n_prompt_ids * sizeof **ids_out);
        *n_out = q->n_prompt_ids;
        return 0;
    }
    char *chat_text = NULL;
    if (q->kind == ANNEAL_SERVE_CHAT) {
        if (anneal_chat_format(s->tok, q->messages, (size_t)q->n_messages, true, &chat_text, NULL) != ANNEAL_OK) {
            snprintf(err->message, sizeof err->message, "%s", anneal_last_error());
            anneal_clear_error();
            return 400;
        }
    } else if (anneal_tokenizer_adds_bos(s->tok) && anneal_ids_push(&ids, anneal_tokenizer_bos(s->tok)) != ANNEAL_OK) {
        goto oom;
    }
    const char *text = chat_text ? chat_text : q->prompt;
    anneal_status st = anneal_tokenizer_encode(s->tok, text, strlen(text), chat_text != NULL, &ids);
    free(chat_text);
    if (st != ANNEAL_OK) {
        snprintf(err->message, sizeof err->message, "%s", anneal_last_error());
        anneal_clear_error();
        anneal_ids_free(&ids);
        return 400;
    }
    if (ids.n == 0) { /* nothing to continue: start a new document, as generate does */
        if (eot < 0) {
            snprintf(err->message, sizeof err->message, "'prompt' is empty (the tokenizer has no end-of-text token to start from)");
            return 400;
        }
        if (anneal_ids_push(&ids, eot) != ANNEAL_OK) goto oom;
    }
    for (size_t i = 0; i < ids.n; i++)
        if (ids.ids[i] < 0 || ids.ids[i] >= V) {
            snprintf(err->message, sizeof err->message, "token id %d of the prompt is outside the model's vocabulary of %d",
                     ids.ids[i], V);
            anneal_ids_free(&ids);
            return 400;
        }
    *ids_out = ids.ids; /* taken */
    *n_out = (int64_t)ids.n;
    return 0;
oom:
    anneal_ids_free(&ids);
    err->http_status = 500;
    snprintf(err->type, sizeof err->type, "server_error");
    snprintf(err->message, sizeof err->message, "out of memory");
    return 500;
}

static enum MHD_Result generate(anneal_server *s, struct MHD_Connection *c, anneal_serve_kind kind, conn *cn) {
    anneal_serve_endpoint ep = kind == ANNEAL_SERVE_CHAT ? ANNEAL_EP_CHAT : ANNEAL_EP_COMPLETIONS;
    double t_arrival = now_s();
    if (cn->too_big)
        return reply_error(s, c, ep, 413, "invalid_request_error", NULL, "request_too_large",
                           "the request body is larger than the limit of %zu bytes (--max-body)", s->cfg.max_body);
    if (atomic_load(&s->stopping))
        return reply_error(s, c, ep, 503, "server_error", NULL, NULL, "the server is shutting down");
    anneal_serve_request q;
    anneal_serve_error err;
    if (anneal_serve_request_parse(cn->body, cn->len, kind, &s->lim, &q, &err) != ANNEAL_OK)
        return reply(s, c, ep, err.http_status, "application/json", anneal_serve_error_json(&err));
    if (q.model && strcmp(q.model, s->model_name)) {
        enum MHD_Result r = reply_error(s, c, ep, 400, "invalid_request_error", "model", "model_not_found",
                                        "The model '%.200s' does not exist: this server serves '%.200s'", q.model,
                                        s->model_name);
        anneal_serve_request_free(&q);
        return r;
    }
    int32_t *ids = NULL;
    int64_t n_ids = 0;
    int rc = tokenize(s, &q, &ids, &n_ids, &err);
    if (rc) {
        anneal_serve_request_free(&q);
        return reply(s, c, ep, rc, "application/json", anneal_serve_error_json(&err));
    }
    int64_t n_ctx = s->model->cfg.n_ctx;
    int64_t max_tokens = q.max_tokens > 0 ? q.max_tokens
                         : kind == ANNEAL_SERVE_CHAT ? (n_ctx - n_ids < s->cfg.max_tokens ? n_ctx - n_ids : s->cfg.max_tokens)
                                                     : 16;
    if (n_ids >= n_ctx || n_ids + max_tokens > n_ctx) {
        free(ids);
        enum MHD_Result r = reply_error(
            s, c, ep, 400, "invalid_request_error", n_ids >= n_ctx ? (kind == ANNEAL_SERVE_CHAT ? "messages" : "prompt") : "max_tokens",
            "context_length_exceeded",
            "This model's maximum context length is %lld tokens. However, you requested %lld tokens (%lld in the %s, "
            "%lld in the completion). Please reduce the length of the %s or the completion.",
            (long long)n_ctx, (long long)(n_ids + max_tokens), (long long)n_ids,
            kind == ANNEAL_SERVE_CHAT ? "messages" : "prompt", (long long)max_tokens,
            kind == ANNEAL_SERVE_CHAT ? "messages" : "prompt");
        anneal_serve_request_free(&q);
        return r;
    }
    anneal_serve_job *j = anneal_serve_job_new(ids, n_ids);
    if (!j) {
        free(ids);
        anneal_serve_request_free(&q);
        return reply(s, c, ep, 500, "application/json", NULL);
    }
    uint64_t k = atomic_fetch_add(&s->counter, 1);
    j->max_tokens = max_tokens;
    j->sampler = (anneal_sampler_config){.temperature = (float)q.temperature, .top_k = 0, .top_p = (float)q.top_p,
                                         .seed = q.has_seed ? q.seed : splitmix(k ^ (uint64_t)(t_arrival * 1e9))};
    for (int i = 0; i < q.n_stop; i++) j->stop[i] = q.stop[i];
    j->n_stop = q.n_stop;
    q.n_stop = 0; /* moved */
    j->t_arrival = t_arrival;
    j->deadline = t_arrival + s->cfg.request_timeout_s;
    anneal_serve_reply r = {.kind = kind, .created = (long long)time(NULL), .model = s->model_name,
                            .prompt_tokens = n_ids, .include_usage = q.include_usage};
    snprintf(r.id, sizeof r.id, "%s-%016llx", kind == ANNEAL_SERVE_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)splitmix(k + 0x5eed));
    bool streaming = q.stream;
    anneal_serve_request_free(&q);
    rc = anneal_serve_engine_submit(s->engine, j);
    if (rc) {
        anneal_serve_job_release(NULL, j);
        return rc == 429 ? reply_error(s, c, ep, 429, "rate_limit_exceeded", NULL, "queue_full",
                                       "the server is busy: every slot is running and the queue of %d is full; retry later",
                                       s->cfg.queue)
                         : reply_error(s, c, ep, 503, "server_error", NULL, NULL, "the server is shutting down");
    }
    if (!wait_job(s, c, j, !streaming)) {
        anneal_serve_job_release(s->engine, j);
        anneal_serve_metrics_request(s->metrics, ep, 499);
        return MHD_NO; /* the client is gone: close */
    }
    pthread_mutex_t *mu = anneal_serve_engine_lock(s->engine);
    pthread_mutex_lock(mu);
    int err_status = j->state == ANNEAL_JOB_DONE ? j->err_status : 0;
    char etype[32], emsg[200];
    snprintf(etype, sizeof etype, "%s", j->err_type);
    snprintf(emsg, sizeof emsg, "%s", j->err_msg);
    pthread_mutex_unlock(mu);
    if (err_status) {
        anneal_serve_job_release(s->engine, j);
        return reply_error(s, c, ep, err_status, etype, NULL, NULL, "%s", emsg);
    }
    if (!streaming) {
        pthread_mutex_lock(mu);
        r.finish = j->finish;
        r.completion_tokens = j->n_gen;
        char *body = anneal_serve_reply_json(&r, j->text, j->len);
        pthread_mutex_unlock(mu);
        anneal_serve_job_release(s->engine, j);
        return reply(s, c, ep, 200, "application/json", body);
    }
    stream *st = calloc(1, sizeof *st);
    if (!st) {
        anneal_serve_job_cancel(s->engine, j);
        anneal_serve_job_release(s->engine, j);
        return reply(s, c, ep, 500, "application/json", NULL);
    }
    *st = (stream){.s = s, .c = c, .j = j, .r = r, .status = 200};
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, st, stream_free);
    if (!resp) {
        stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    enum MHD_Result ok = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    return ok;
}

/* ------------------------------------------------------------ routing */

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    anneal_server *s = cls;
    bool post = !strcmp(method, "POST"), get = !strcmp(method, "GET");
    if (!*con_cls) { /* the headers: start the body */
        conn *cn = calloc(1, sizeof *cn);
        if (!cn) return MHD_NO;
        *con_cls = cn;
        atomic_fetch_add(&s->in_flight, 1);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (post && cl && strtoull(cl, NULL, 10) > s->cfg.max_body) cn->too_big = true;
        return MHD_YES;
    }
    conn *cn = *con_cls;
    if (*upload_size) {
        if (!cn->too_big && cn->len + *upload_size > s->cfg.max_body) {
            cn->too_big = true;
            free(cn->body);
            cn->body = NULL;
            cn->len = cn->cap = 0;
        }
        if (!cn->too_big) {
            if (cn->len + *upload_size > cn->cap) {
                size_t cap = (cn->len + *upload_size) * 2;
                if (cap > s->cfg.max_body) cap = s->cfg.max_body;
                char *b = realloc(cn->body, cap);
                if (!b) return MHD_NO;
                cn->body = b;
                cn->cap = cap;
            }
            memcpy(cn->body + cn->len, upload, *upload_size);
            cn->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (!strcmp(url, "/v1/completions") || !strcmp(url, "/v1/chat/completions")) {
        bool chat = !strcmp(url, "/v1/chat/completions");
        if (!post)
            return reply_error(s, c, chat ? ANNEAL_EP_CHAT : ANNEAL_EP_COMPLETIONS, 405, "invalid_request_error", NULL,
                               NULL, "%s takes POST, not %s", url, method);
        return generate(s, c, chat ? ANNEAL_SERVE_CHAT : ANNEAL_SERVE_COMPLETION, cn);
    }
    if (!strcmp(url, "/health")) {
        bool stopping = atomic_load(&s->stopping);
        return reply(s, c, ANNEAL_EP_HEALTH, stopping ? 503 : 200, "application/json",
                     strdup(stopping ? "{\"status\":\"stopping\"}" : "{\"status\":\"ok\"}"));
    }
    if (!get && (!strcmp(url, "/metrics") || !strcmp(url, "/v1/models")))
        return reply_error(s, c, !strcmp(url, "/metrics") ? ANNEAL_EP_METRICS : ANNEAL_EP_MODELS, 405,
                           "invalid_request_error", NULL, NULL, "%s takes GET, not %s", url, method);
    if (!strcmp(url, "/metrics")) {
        int queued, running;
        anneal_serve_engine_load(s->engine, &queued, &running);
        /* this request counts itself once answered; the text shows the ones before it */
        return reply(s, c, ANNEAL_EP_METRICS, 200, "text/plain; version=0.0.4; charset=utf-8",
                     anneal_serve_metrics_text(s->metrics, queued, running, s->cfg.slots));
    }
    if (!strcmp(url, "/v1/models")) {
        cJSON *root = cJSON_CreateObject(), *m = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "object", "list");
        cJSON_AddItemToArray(cJSON_AddArrayToObject(root, "data"), m);
        cJSON_AddStringToObject(m, "id", s->model_name);
        cJSON_AddStringToObject(m, "object", "model");
        cJSON_AddNumberToObject(m, "created", (double)s->created);
        cJSON_AddStringToObject(m, "owned_by", "anneal");
        char *body = cJSON_PrintUnformatted(root);
        cJSON_Delete(root);
        return reply(s, c, ANNEAL_EP_MODELS, 200, "application/json", body);
    }
    return reply_error(s, c, ANNEAL_EP_OTHER, 404, "invalid_request_error", NULL, NULL, "no such endpoint: %s %.200s",
                       method, url);
}

static void request_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode t) {
    (void)c;
    (void)t;
    anneal_server *s = cls;
    conn *cn = *con_cls;
    if (cn) {
        free(cn->body);
        atomic_fetch_sub(&s->in_flight, 1);
    }
    free(cn);
    *con_cls = NULL;
}

/* ------------------------------------------------------------ start and stop */

anneal_status anneal_server_start(anneal_model *model, anneal_tokenizer *tok, const anneal_serve_config *cfg,
                                  anneal_server **out) {
    *out = NULL;
    if (!model || !tok || !cfg) return anneal_set_error(ANNEAL_ERR_ARG, "serve: NULL model, tokenizer or config");
    if (cfg->slots < 1 || cfg->slots > 4096) return anneal_set_error(ANNEAL_ERR_ARG, "serve: --slots %d must be in [1, 4096]", cfg->slots);
    if (cfg->queue < 1 || cfg->queue > 1000000) return anneal_set_error(ANNEAL_ERR_ARG, "serve: --queue %d must be in [1, 10^6]", cfg->queue);
    if (cfg->port < 0 || cfg->port > 65535) return anneal_set_error(ANNEAL_ERR_ARG, "serve: --port %d is out of range", cfg->port);
    if (cfg->max_tokens < 1) return anneal_set_error(ANNEAL_ERR_ARG, "serve: --max-tokens must be >= 1");
    if (!(cfg->request_timeout_s > 0)) return anneal_set_error(ANNEAL_ERR_ARG, "serve: --request-timeout must be > 0");
    if (cfg->max_body < 64) return anneal_set_error(ANNEAL_ERR_ARG, "serve: --max-body must be >= 64 bytes");
    if (cfg->max_connections < 1) return anneal_set_error(ANNEAL_ERR_ARG, "serve: --max-connections must be >= 1");
    const char *host = cfg->host ? cfg->host : "127.0.0.1";
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)cfg->port)};
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)cfg->port)};
    bool v6 = false;
    if (inet_pton(AF_INET, host, &a4.sin_addr) != 1) {
        if (inet_pton(AF_INET6, host, &a6.sin6_addr) != 1)
            return anneal_set_error(ANNEAL_ERR_ARG, "serve: --host '%s' is not an IPv4 or IPv6 address", host);
        v6 = true;
    }
    anneal_server *s = calloc(1, sizeof *s);
    if (!s) return anneal_set_error(ANNEAL_ERR_OOM, "serve: out of memory");
    s->model = model;
    s->tok = tok;
    s->cfg = *cfg;
    s->host = strdup(host);
    s->model_name = strdup(cfg->model_name ? cfg->model_name : "anneal");
    s->cfg.host = s->host;
    s->cfg.model_name = s->model_name;
    s->lim = anneal_serve_limits_default();
    s->lim.max_tokens = cfg->max_tokens;
    s->created = (long long)time(NULL);
    atomic_init(&s->stopping, false);
    atomic_init(&s->in_flight, 0);
    atomic_init(&s->counter, (uint64_t)time(NULL));
    if (!s->host || !s->model_name || !(s->metrics = anneal_serve_metrics_new())) {
        anneal_server_stop(s, 0);
        return anneal_set_error(ANNEAL_ERR_OOM, "serve: out of memory");
    }
    if (!(s->engine = anneal_serve_engine_new(model, tok, &s->cfg, s->metrics))) {
        anneal_status st = anneal_last_status();
        anneal_server_stop(s, 0);
        return st;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | (v6 ? MHD_USE_IPv6 : 0);
    s->daemon = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, handle, s, MHD_OPTION_SOCK_ADDR,
                                 v6 ? (struct sockaddr *)&a6 : (struct sockaddr *)&a4, MHD_OPTION_CONNECTION_LIMIT,
                                 (unsigned)cfg->max_connections, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)60,
                                 MHD_OPTION_NOTIFY_COMPLETED, request_done, s, MHD_OPTION_END);
    if (!s->daemon) {
        anneal_server_stop(s, 0);
        return anneal_set_error(ANNEAL_ERR_IO, "serve: cannot listen on %s:%d (in use, or not an address of this machine)",
                                host, cfg->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    *out = s;
    return ANNEAL_OK;
}

int anneal_server_port(const anneal_server *s) { return s ? s->port : -1; }

void anneal_server_stop(anneal_server *s, double grace_s) {
    if (!s) return;
    atomic_store(&s->stopping, true);
    anneal_serve_engine_stop(s->engine, grace_s); /* in-flight requests finish or are cut */
    /* the responses of finished or cut requests (a stream's last chunk and [DONE]) still
     * have to reach their clients: MHD_stop_daemon closes connections where they are, so
     * wait for the requests to complete first (bounded: a stalled client cannot hold it) */
    for (int i = 0; s->daemon && i < 200 && atomic_load(&s->in_flight) > 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (s->daemon) MHD_stop_daemon(s->daemon); /* waits for the connections' threads */
    anneal_serve_engine_free(s->engine);
    anneal_serve_metrics_free(s->metrics);
    free(s->host);
    free(s->model_name);
    free(s);
}
