/* The serve layer: an OpenAI-compatible HTTP server over a model and its tokenizer
 * (`anneal serve`). One engine thread runs continuous batching: every pass over the
 * model advances all running requests together through the model's slots API and
 * carries the next chunk of the prompts of requests that took a free slot. HTTP (libmicrohttpd, one
 * thread per connection) parses and validates requests, tokenizes them, and waits on
 * the engine's output.
 *
 * The request validation is a pure function (anneal_serve_request_parse) so it can be
 * fuzzed and tested without a model. */
#ifndef ANNEAL_SERVE_H
#define ANNEAL_SERVE_H

#include "anneal/core.h"
#include "anneal/model.h"
#include "anneal/tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ requests */

typedef enum anneal_serve_kind {
    ANNEAL_SERVE_COMPLETION = 0, /* POST /v1/completions: "prompt" */
    ANNEAL_SERVE_CHAT = 1,       /* POST /v1/chat/completions: "messages" */
} anneal_serve_kind;

/* What a request may ask for at most (the validator's bounds). */
typedef struct anneal_serve_limits {
    int64_t max_tokens;       /* largest max_tokens accepted (the server's --max-tokens) */
    int max_stop;             /* most stop strings (OpenAI: 4) */
    size_t max_stop_bytes;    /* longest stop string in bytes */
    int max_messages;         /* most chat messages */
    int max_prompt_ids;       /* most token ids in an id-list prompt */
} anneal_serve_limits;

#define ANNEAL_SERVE_MAX_STOP 4

/* A validated request. Strings are malloc'd and owned (anneal_serve_request_free). */
typedef struct anneal_serve_request {
    anneal_serve_kind kind;
    char *model;                 /* "model" (NULL: absent) */
    char *prompt;                /* completions: the prompt text (NULL when ids are given) */
    int32_t *prompt_ids;         /* completions: a prompt given as token ids (else NULL) */
    int64_t n_prompt_ids;
    anneal_chat_message *messages; /* chat: role and content strings owned here */
    int n_messages;
    int64_t max_tokens;          /* -1: not given (the server picks) */
    double temperature;          /* [0, 2], default 1 */
    double top_p;                /* (0, 1], default 1 */
    bool has_seed;
    uint64_t seed;
    bool stream;
    bool include_usage;          /* stream_options.include_usage */
    int n_stop;
    char *stop[ANNEAL_SERVE_MAX_STOP]; /* non-empty strings */
} anneal_serve_request;

/* A rejected request: the HTTP status and OpenAI's error fields. */
typedef struct anneal_serve_error {
    int http_status;    /* 400 */
    char type[48];      /* "invalid_request_error" */
    char param[64];     /* the field at fault ("temperature", "messages[2].role"; "" none) */
    char code[48];      /* "" or e.g. "model_not_found" */
    char message[512];
} anneal_serve_error;

/* The default bounds (max_tokens 4096, 4 stop strings of 256 bytes, 4096 messages,
 * 1 << 20 prompt ids). */
anneal_serve_limits anneal_serve_limits_default(void);

/* Parses and validates one request body of len bytes (any bytes: not NUL-terminated,
 * possibly malformed) for endpoint kind. On success fills *out (free it with
 * anneal_serve_request_free) and returns ANNEAL_OK; otherwise fills *err (the
 * field named in param and message) and returns ANNEAL_ERR_ARG, *out zeroed. Checks:
 * JSON object; types; unknown fields; n == 1 (and best_of 1); temperature in [0, 2];
 * top_p in (0, 1]; 1 <= max_tokens <= lim->max_tokens; stop a string or a list of up
 * to lim->max_stop non-empty strings of at most lim->max_stop_bytes; fields that
 * would change results and are not implemented (logprobs, echo, suffix, logit_bias,
 * penalties, tools, response_format) are refused unless given at their neutral
 * value. Pure: no global state, no model, no output. */
anneal_status anneal_serve_request_parse(const char *body, size_t len, anneal_serve_kind kind,
                                         const anneal_serve_limits *lim, anneal_serve_request *out,
                                         anneal_serve_error *err);
void anneal_serve_request_free(anneal_serve_request *r);

/* OpenAI's error body for err: {"error": {"message", "type", "param", "code"}} (malloc'd). */
char *anneal_serve_error_json(const anneal_serve_error *err);

/* ------------------------------------------------------------ stop strings */

/* Finds where generated text must stop or how much of it may be shown. text[0..len)
 * is everything generated so far, shown the bytes already sent. If a stop string
 * occurs in text starting at or after shown, returns true and *cut = its start (the
 * text to return is text[0..*cut)). Otherwise returns false and *safe = the end of the
 * longest prefix that no stop string could still extend into (text past *safe is the
 * start of a possible stop string and is held back); *safe >= shown. */
bool anneal_serve_stop_scan(const char *text, size_t len, size_t shown, char *const *stop, int n_stop,
                            size_t *cut, size_t *safe);

/* ------------------------------------------------------------ the server */

typedef struct anneal_serve_config {
    const char *host;          /* address to bind (default "127.0.0.1") */
    int port;                  /* 0: an ephemeral port (anneal_server_port says which) */
    const char *model_name;    /* the id /v1/models lists and requests must name */
    int slots;                 /* requests decoded together (KV-cache slots) */
    int queue;                 /* requests waiting for a slot before 429 */
    int max_connections;       /* concurrent HTTP connections */
    size_t max_body;           /* request body bytes before 413 */
    int64_t max_tokens;        /* largest max_tokens; also the default of a chat request */
    double request_timeout_s;  /* deadline of a request from its arrival */
    int step_delay_ms;         /* test aid: sleep before each decode step (0: none) */
    int64_t prefill_chunk;     /* prompt rows per pass over the model, over all new prompts (0: 256) */
} anneal_serve_config;

typedef struct anneal_server anneal_server;

/* Starts serving model (with tokenizer tok; both borrowed until anneal_server_free)
 * on cfg->host:cfg->port: the engine thread and the HTTP daemon. Errors: a bad config
 * (ANNEAL_ERR_ARG naming the field), a port that cannot be bound (ANNEAL_ERR_IO). */
anneal_status anneal_server_start(anneal_model *model, anneal_tokenizer *tok, const anneal_serve_config *cfg,
                                  anneal_server **out);
/* The port the server listens on. */
int anneal_server_port(const anneal_server *s);
/* Graceful stop: refuses new requests (503), lets running and queued ones finish for
 * up to grace_s seconds, then cuts the rest (finish_reason "length" for running ones,
 * an error for queued ones), stops HTTP and the engine, and frees everything. */
void anneal_server_stop(anneal_server *s, double grace_s);

#ifdef __cplusplus
}
#endif
#endif
