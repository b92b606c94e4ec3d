/* Validation of OpenAI-style request bodies (/v1/completions, /v1/chat/completions):
 * a pure function from bytes to a request or an error naming the field, so it can be
 * fuzzed. Every field is type- and range-checked; unknown fields and fields that
 * would change the result but are not implemented are refused, never ignored. */
#include "anneal/parse.h"
#include "anneal/serve.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

anneal_serve_limits anneal_serve_limits_default(void) {
    return (anneal_serve_limits){.max_tokens = 4096, .max_stop = ANNEAL_SERVE_MAX_STOP, .max_stop_bytes = 256,
                                 .max_messages = 4096, .max_prompt_ids = 1 << 20};
}

/* Fills err (400, invalid_request_error) naming param; returns ANNEAL_ERR_ARG. */
static anneal_status fail(anneal_serve_error *err, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static anneal_status fail(anneal_serve_error *err, const char *param, const char *code, const char *fmt, ...) {
    err->http_status = 400;
    snprintf(err->type, sizeof err->type, "invalid_request_error");
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    snprintf(err->code, sizeof err->code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return ANNEAL_ERR_ARG;
}

/* The JSON type of v in words, for messages. */
static const char *type_name(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "invalid";
}

/* True when v is a number with an integer value in [lo, hi]. */
static bool int_in(const cJSON *v, double lo, double hi) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    return isfinite(d) && d == floor(d) && d >= lo && d <= hi;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

void anneal_serve_request_free(anneal_serve_request *r) {
    if (!r) return;
    free(r->model);
    free(r->prompt);
    free(r->prompt_ids);
    for (int i = 0; i < r->n_messages; i++) {
        free((char *)r->messages[i].role);
        free((char *)r->messages[i].content);
    }
    free(r->messages);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

/* Fields both endpoints accept. */
static const char *const common_fields[] = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", NULL};
static const char *const completion_fields[] = {"prompt", "best_of", "echo", "suffix", NULL};
static const char *const chat_fields[] = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                          "functions", "function_call", "response_format", "parallel_tool_calls",
                                          NULL};

static bool listed(const char *name, const char *const *list) {
    for (; *list; list++)
        if (!strcmp(name, *list)) return true;
    return false;
}

/* The prompt of a completion: a string, a list of one string, or a list of token ids. */
static anneal_status parse_prompt(const cJSON *p, const anneal_serve_limits *lim, anneal_serve_request *out,
                                  anneal_serve_error *err) {
    if (!p || cJSON_IsNull(p)) return fail(err, "prompt", NULL, "'prompt' is required");
    if (cJSON_IsString(p)) return (out->prompt = dup_str(p->valuestring)) ? ANNEAL_OK : fail(err, "prompt", NULL, "out of memory");
    if (!cJSON_IsArray(p)) return fail(err, "prompt", NULL, "'prompt' must be a string or an array, not %s", type_name(p));
    int n = cJSON_GetArraySize(p);
    if (n == 0) return fail(err, "prompt", NULL, "'prompt' is an empty array");
    const cJSON *first = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsString(first)) {
        if (n != 1)
            return fail(err, "prompt", NULL, "'prompt' holds %d prompts: one prompt per request is supported", n);
        return (out->prompt = dup_str(first->valuestring)) ? ANNEAL_OK : fail(err, "prompt", NULL, "out of memory");
    }
    if (cJSON_IsArray(first))
        return fail(err, "prompt", NULL, "'prompt' holds several token lists: one prompt per request is supported");
    if (n > lim->max_prompt_ids)
        return fail(err, "prompt", NULL, "'prompt' has %d token ids (at most %d)", n, lim->max_prompt_ids);
    if (!(out->prompt_ids = malloc((size_t)n * sizeof *out->prompt_ids))) return fail(err, "prompt", NULL, "out of memory");
    int i = 0;
    for (const cJSON *e = p->child; e; e = e->next, i++) {
        if (!int_in(e, 0, INT32_MAX))
            return fail(err, "prompt", NULL, "'prompt'[%d] must be a token id (an integer >= 0), not %s", i,
                        cJSON_IsNumber(e) ? "that number" : type_name(e));
        out->prompt_ids[i] = (int32_t)e->valuedouble;
    }
    out->n_prompt_ids = n;
    return ANNEAL_OK;
}

/* The messages of a chat: [{"role": "system"|"user"|"assistant", "content": string}]. */
static anneal_status parse_messages(const cJSON *ms, const anneal_serve_limits *lim, anneal_serve_request *out,
                                    anneal_serve_error *err) {
    if (!ms || cJSON_IsNull(ms)) return fail(err, "messages", NULL, "'messages' is required");
    if (!cJSON_IsArray(ms)) return fail(err, "messages", NULL, "'messages' must be an array, not %s", type_name(ms));
    int n = cJSON_GetArraySize(ms);
    if (n == 0) return fail(err, "messages", NULL, "'messages' is empty");
    if (n > lim->max_messages) return fail(err, "messages", NULL, "'messages' has %d messages (at most %d)", n, lim->max_messages);
    if (!(out->messages = calloc((size_t)n, sizeof *out->messages))) return fail(err, "messages", NULL, "out of memory");
    int i = 0;
    char param[64];
    for (const cJSON *m = ms->child; m; m = m->next, i++) {
        snprintf(param, sizeof param, "messages[%d]", i);
        if (!cJSON_IsObject(m)) return fail(err, param, NULL, "'%s' must be an object, not %s", param, type_name(m));
        for (const cJSON *f = m->child; f; f = f->next)
            if (strcmp(f->string, "role") && strcmp(f->string, "content") && strcmp(f->string, "name")) {
                snprintf(param, sizeof param, "messages[%d].%.32s", i, f->string);
                return fail(err, param, NULL, "'%s': unsupported field in a message (role, content, name)", param);
            }
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(m, "name");
        snprintf(param, sizeof param, "messages[%d].role", i);
        if (!cJSON_IsString(role)) return fail(err, param, NULL, "'%s' must be a string, not %s", param, role ? type_name(role) : "missing");
        if (strcmp(role->valuestring, "system") && strcmp(role->valuestring, "user") &&
            strcmp(role->valuestring, "assistant"))
            return fail(err, param, NULL, "'%s' must be \"system\", \"user\" or \"assistant\"", param);
        snprintf(param, sizeof param, "messages[%d].content", i);
        if (!cJSON_IsString(content))
            return fail(err, param, NULL, "'%s' must be a string, not %s", param, content ? type_name(content) : "missing");
        snprintf(param, sizeof param, "messages[%d].name", i);
        if (name && !cJSON_IsString(name)) return fail(err, param, NULL, "'%s' must be a string", param);
        out->messages[i].role = dup_str(role->valuestring);
        out->messages[i].content = dup_str(content->valuestring);
        out->n_messages = i + 1;
        if (!out->messages[i].role || !out->messages[i].content) return fail(err, "messages", NULL, "out of memory");
    }
    return ANNEAL_OK;
}

/* "stop": null, a string, or a list of strings. */
static anneal_status parse_stop(const cJSON *s, const anneal_serve_limits *lim, anneal_serve_request *out,
                                anneal_serve_error *err) {
    if (!s || cJSON_IsNull(s)) return ANNEAL_OK;
    int max = lim->max_stop < ANNEAL_SERVE_MAX_STOP ? lim->max_stop : ANNEAL_SERVE_MAX_STOP;
    const cJSON *one = cJSON_IsString(s) ? s : NULL;
    if (!one && !cJSON_IsArray(s))
        return fail(err, "stop", NULL, "'stop' must be a string or an array of strings, not %s", type_name(s));
    int n = one ? 1 : cJSON_GetArraySize(s);
    if (n > max) return fail(err, "stop", NULL, "'stop' has %d strings (at most %d)", n, max);
    const cJSON *e = one ? one : s->child;
    for (int i = 0; i < n; i++, e = e->next) {
        if (!cJSON_IsString(e)) return fail(err, "stop", NULL, "'stop'[%d] must be a string, not %s", i, type_name(e));
        size_t len = strlen(e->valuestring);
        if (len == 0) return fail(err, "stop", NULL, "'stop'[%d] is empty", i);
        if (len > lim->max_stop_bytes)
            return fail(err, "stop", NULL, "'stop'[%d] is %zu bytes long (at most %zu)", i, len, lim->max_stop_bytes);
        if (!(out->stop[i] = dup_str(e->valuestring))) return fail(err, "stop", NULL, "out of memory");
        out->n_stop = i + 1;
    }
    return ANNEAL_OK;
}

/* A field that must be absent, null, or at its neutral value (the one that changes
 * nothing): a number equal to neutral, false, or an empty object/array. */
static anneal_status neutral(const cJSON *root, const char *name, double num, anneal_serve_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v)) return ANNEAL_OK;
    if (cJSON_IsNumber(v) && v->valuedouble == num) return ANNEAL_OK;
    if ((cJSON_IsObject(v) || cJSON_IsArray(v)) && !v->child) return ANNEAL_OK;
    return fail(err, name, "unsupported_parameter", "'%s' is not supported by this server (it would change the result)",
                name);
}

static anneal_status parse_fields(const cJSON *root, anneal_serve_kind kind, const anneal_serve_limits *lim,
                                  anneal_serve_request *out, anneal_serve_error *err) {
    for (const cJSON *f = root->child; f; f = f->next) {
        if (!listed(f->string, common_fields) &&
            !listed(f->string, kind == ANNEAL_SERVE_CHAT ? chat_fields : completion_fields)) {
            char param[64];
            snprintf(param, sizeof param, "%.63s", f->string);
            return fail(err, param, "unknown_parameter", "Unrecognized request argument supplied: %.200s", f->string);
        }
    }
    anneal_status s;
    const cJSON *v;
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "model")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsString(v)) return fail(err, "model", NULL, "'model' must be a string, not %s", type_name(v));
        if (!(out->model = dup_str(v->valuestring))) return fail(err, "model", NULL, "out of memory");
    }
    if (kind == ANNEAL_SERVE_CHAT) {
        if ((s = parse_messages(cJSON_GetObjectItemCaseSensitive(root, "messages"), lim, out, err))) return s;
    } else if ((s = parse_prompt(cJSON_GetObjectItemCaseSensitive(root, "prompt"), lim, out, err))) {
        return s;
    }
    out->max_tokens = -1;
    const char *mt_names[2] = {"max_tokens", "max_completion_tokens"};
    for (int k = 0; k < (kind == ANNEAL_SERVE_CHAT ? 2 : 1); k++) {
        if (!(v = cJSON_GetObjectItemCaseSensitive(root, mt_names[k])) || cJSON_IsNull(v)) continue;
        if (!cJSON_IsNumber(v)) return fail(err, mt_names[k], NULL, "'%s' must be an integer, not %s", mt_names[k], type_name(v));
        if (!int_in(v, 1, (double)lim->max_tokens))
            return fail(err, mt_names[k], NULL, "'%s' is %.17g: it must be an integer in [1, %lld]", mt_names[k],
                        v->valuedouble, (long long)lim->max_tokens);
        out->max_tokens = (int64_t)v->valuedouble;
    }
    out->temperature = 1.0;
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "temperature")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsNumber(v)) return fail(err, "temperature", NULL, "'temperature' must be a number, not %s", type_name(v));
        if (!(v->valuedouble >= 0 && v->valuedouble <= 2))
            return fail(err, "temperature", NULL, "'temperature' is %.17g: it must be in [0, 2]", v->valuedouble);
        out->temperature = v->valuedouble;
    }
    out->top_p = 1.0;
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "top_p")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsNumber(v)) return fail(err, "top_p", NULL, "'top_p' must be a number, not %s", type_name(v));
        if (!(v->valuedouble > 0 && v->valuedouble <= 1))
            return fail(err, "top_p", NULL, "'top_p' is %.17g: it must be in (0, 1]", v->valuedouble);
        out->top_p = v->valuedouble;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "n")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsNumber(v)) return fail(err, "n", NULL, "'n' must be an integer, not %s", type_name(v));
        if (v->valuedouble != 1) return fail(err, "n", NULL, "'n' is %.17g: only n = 1 is supported", v->valuedouble);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "stream")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsBool(v)) return fail(err, "stream", NULL, "'stream' must be a boolean, not %s", type_name(v));
        out->stream = cJSON_IsTrue(v);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "stream_options")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsObject(v)) return fail(err, "stream_options", NULL, "'stream_options' must be an object, not %s", type_name(v));
        if (!out->stream) return fail(err, "stream_options", NULL, "'stream_options' is only allowed when 'stream' is true");
        for (const cJSON *f = v->child; f; f = f->next) {
            if (strcmp(f->string, "include_usage"))
                return fail(err, "stream_options", NULL, "'stream_options': unknown field '%.100s'", f->string);
            if (!cJSON_IsBool(f)) return fail(err, "stream_options.include_usage", NULL, "'stream_options.include_usage' must be a boolean");
            out->include_usage = cJSON_IsTrue(f);
        }
    }
    if ((s = parse_stop(cJSON_GetObjectItemCaseSensitive(root, "stop"), lim, out, err))) return s;
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "seed")) && !cJSON_IsNull(v)) {
        /* integers OpenAI accepts: int64 (doubles represent them to 2^53 exactly) */
        if (!int_in(v, -9223372036854775808.0, 9223372036854774784.0))
            return fail(err, "seed", NULL, "'seed' must be an integer, not %s", cJSON_IsNumber(v) ? "that number" : type_name(v));
        out->has_seed = true;
        out->seed = (uint64_t)(int64_t)v->valuedouble;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "user")) && !cJSON_IsNull(v) && !cJSON_IsString(v))
        return fail(err, "user", NULL, "'user' must be a string, not %s", type_name(v));
    static const char *const zero_fields[] = {"presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                                              "echo", "suffix", "top_logprobs", "tools", "tool_choice", "functions",
                                              "function_call", "response_format", "parallel_tool_calls", NULL};
    for (const char *const *z = zero_fields; *z; z++)
        if ((s = neutral(root, *z, 0, err))) return s;
    if ((s = neutral(root, "best_of", 1, err))) return s;
    return ANNEAL_OK;
}

anneal_status anneal_serve_request_parse(const char *body, size_t len, anneal_serve_kind kind,
                                         const anneal_serve_limits *lim, anneal_serve_request *out,
                                         anneal_serve_error *err) {
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    anneal_serve_limits def = anneal_serve_limits_default();
    if (!lim) lim = &def;
    if (!body || len == 0) return fail(err, NULL, NULL, "the request body is empty: send a JSON object");
    /* the project's checked parser: duplicate keys and keys with \u0000 are refused as in
     * every settings file, a syntax error names its line and column */
    cJSON *root = NULL;
    if (anneal_json_parse(body, len, "the request body", &root) != ANNEAL_OK)
        return fail(err, NULL, NULL, "%s", anneal_last_error());
    anneal_status s;
    if (!cJSON_IsObject(root)) {
        s = fail(err, NULL, NULL, "the request body must be a JSON object, not %s", type_name(root));
    } else {
        out->kind = kind;
        s = parse_fields(root, kind, lim, out, err);
    }
    cJSON_Delete(root);
    if (s != ANNEAL_OK) anneal_serve_request_free(out);
    return s;
}

char *anneal_serve_error_json(const anneal_serve_error *err) {
    cJSON *root = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(e, "message", err->message);
    cJSON_AddStringToObject(e, "type", err->type[0] ? err->type : "invalid_request_error");
    if (err->param[0]) cJSON_AddStringToObject(e, "param", err->param);
    else cJSON_AddNullToObject(e, "param");
    if (err->code[0]) cJSON_AddStringToObject(e, "code", err->code);
    else cJSON_AddNullToObject(e, "code");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}
