/* OpenAI's response shapes: completions and chat completions, whole or as
 * server-sent-event chunks, with usage counts. Text goes out as valid UTF-8 (bytes the
 * tokenizer produced that are not are replaced by U+FFFD). */
#include "serve_internal.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at p (n bytes left), or 0 when invalid. */
static size_t utf8_len(const unsigned char *p, size_t n) {
    unsigned c = p[0];
    size_t k = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
    if (k == 0 || k > n) return 0;
    for (size_t i = 1; i < k; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    if (k == 3 && ((c == 0xE0 && p[1] < 0xA0) || (c == 0xED && p[1] >= 0xA0))) return 0; /* overlong, surrogate */
    if (k == 4 && ((c == 0xF0 && p[1] < 0x90) || (c == 0xF4 && p[1] >= 0x90))) return 0;
    return k;
}

char *anneal_serve_utf8_clean(const char *s, size_t n) {
    char *out = malloc(n * 3 + 1), *o = out;
    if (!out) return NULL;
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = p[i] ? utf8_len(p + i, n - i) : 0;
        if (k) {
            memcpy(o, p + i, k);
            o += k;
            i += k;
        } else { /* an invalid byte, or NUL (cJSON strings end at NUL) */
            memcpy(o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    *o = '\0';
    return out;
}

/* Adds text[0..n) as a string field (cleaned); false when out of memory. */
static bool add_text(cJSON *obj, const char *name, const char *text, size_t n) {
    char *clean = anneal_serve_utf8_clean(text ? text : "", text ? n : 0);
    bool ok = clean && cJSON_AddStringToObject(obj, name, clean);
    free(clean);
    return ok;
}

static cJSON *head(const anneal_serve_reply *r, const char *object) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "id", r->id);
    cJSON_AddStringToObject(root, "object", object);
    cJSON_AddNumberToObject(root, "created", (double)r->created);
    cJSON_AddStringToObject(root, "model", r->model);
    return root;
}

static void add_usage(cJSON *root, const anneal_serve_reply *r) {
    cJSON *u = cJSON_AddObjectToObject(root, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)r->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", (double)r->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(r->prompt_tokens + r->completion_tokens));
}

static char *print(cJSON *root) {
    char *s = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return s;
}

char *anneal_serve_reply_json(const anneal_serve_reply *r, const char *text, size_t n) {
    bool chat = r->kind == ANNEAL_SERVE_CHAT;
    cJSON *root = head(r, chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(root, "choices"), *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    bool ok = true;
    if (chat) {
        cJSON *msg = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(msg, "role", "assistant");
        ok = add_text(msg, "content", text, n);
    } else {
        ok = add_text(c, "text", text, n);
    }
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddStringToObject(c, "finish_reason", r->finish ? r->finish : "length");
    add_usage(root, r);
    if (!ok) {
        cJSON_Delete(root);
        return NULL;
    }
    return print(root);
}

char *anneal_serve_chunk_json(const anneal_serve_reply *r, anneal_serve_chunk what, const char *text, size_t n) {
    bool chat = r->kind == ANNEAL_SERVE_CHAT;
    cJSON *root = head(r, chat ? "chat.completion.chunk" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(root, "choices");
    if (what == ANNEAL_CHUNK_USAGE) {
        add_usage(root, r);
        return print(root);
    }
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    bool ok = true;
    if (chat) {
        cJSON *delta = cJSON_AddObjectToObject(c, "delta");
        if (what == ANNEAL_CHUNK_ROLE) {
            cJSON_AddStringToObject(delta, "role", "assistant");
            cJSON_AddStringToObject(delta, "content", "");
        } else if (what == ANNEAL_CHUNK_TEXT) {
            ok = add_text(delta, "content", text, n);
        }
    } else {
        ok = add_text(c, "text", what == ANNEAL_CHUNK_TEXT ? text : "", what == ANNEAL_CHUNK_TEXT ? n : 0);
    }
    cJSON_AddNullToObject(c, "logprobs");
    if (what == ANNEAL_CHUNK_FINISH) cJSON_AddStringToObject(c, "finish_reason", r->finish ? r->finish : "length");
    else cJSON_AddNullToObject(c, "finish_reason");
    if (r->include_usage) cJSON_AddNullToObject(root, "usage");
    if (!ok) {
        cJSON_Delete(root);
        return NULL;
    }
    return print(root);
}
