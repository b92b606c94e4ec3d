/* Checked JSON: cJSON parses, then anneal refuses what cJSON lets through but a
 * settings file must not hold: a second copy of a key (cJSON's lookup would take the
 * first, a loop over the children every copy), a key with \u0000 (cut short at the
 * NUL, so it matches a real key), and text after the document. Every reader of a
 * settings or metadata file (config.json, --config-file, state.json, prepare.json,
 * tokenizer files, adapter_config.json) goes through here. */
#include "anneal/parse.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* 1-based line and column of byte `at` of text. */
static void line_col(const char *text, size_t at, int *line, int *col) {
    *line = 1, *col = 1;
    for (size_t i = 0; i < at; i++) {
        if (text[i] == '\n') (*line)++, *col = 1;
        else (*col)++;
    }
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static bool is_hex_zero4(const char *p, const char *end) {
    return end - p >= 4 && p[0] == '0' && p[1] == '0' && p[2] == '0' && p[3] == '0';
}

/* Finds a key (a string followed by ':') with the escape \u0000 in the raw text of a
 * document cJSON accepted; its text is copied (escapes as written) into key. */
static bool find_nul_key(const char *text, size_t len, char *key, size_t key_n, size_t *at) {
    const char *p = text, *end = text + len;
    while (p < end) {
        if (*p != '"') {
            p++;
            continue;
        }
        const char *start = ++p;
        bool nul = false;
        while (p < end && *p != '"') {
            if (*p == '\\' && p + 1 < end) {
                if (p[1] == 'u' && is_hex_zero4(p + 2, end)) nul = true;
                p += 2;
            } else {
                p++;
            }
        }
        const char *close = p;
        if (p < end) p++;
        if (!nul) continue;
        const char *q = p;
        while (q < end && is_space(*q)) q++;
        if (q < end && *q == ':') {
            size_t n = (size_t)(close - start);
            if (n >= key_n) n = key_n - 1;
            memcpy(key, start, n);
            key[n] = '\0';
            *at = (size_t)(start - text);
            return true;
        }
    }
    return false;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* First key that occurs twice in any object of the tree (NULL: none); *oom on failure. */
static const char *find_duplicate(const cJSON *node, bool *oom) {
    for (; node; node = node->next) {
        if (cJSON_IsObject(node)) {
            size_t n = 0;
            for (const cJSON *c = node->child; c; c = c->next) n++;
            if (n > 1) {
                const char **keys = malloc(n * sizeof *keys);
                if (!keys) {
                    *oom = true;
                    return NULL;
                }
                size_t k = 0;
                for (const cJSON *c = node->child; c; c = c->next) keys[k++] = c->string ? c->string : "";
                qsort(keys, n, sizeof *keys, cmp_str);
                const char *dup = NULL;
                for (size_t i = 1; i < n && !dup; i++)
                    if (!strcmp(keys[i - 1], keys[i])) dup = keys[i];
                free(keys);
                if (dup) return dup;
            }
        }
        if (node->child) {
            const char *d = find_duplicate(node->child, oom);
            if (d || *oom) return d;
        }
    }
    return NULL;
}

anneal_status anneal_json_parse(const char *text, size_t len, const char *what, cJSON **out) {
    *out = NULL;
    if (!what) what = "JSON";
    if (!text) return anneal_set_error(ANNEAL_ERR_ARG, "%s: no text", what);
    size_t first = 0;
    while (first < len && is_space(text[first])) first++;
    if (first == len) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: empty (no JSON document)", what);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, false);
    size_t at = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
    int line, col;
    if (!root) {
        line_col(text, at, &line, &col);
        size_t last = len;
        while (last > 0 && is_space(text[last - 1])) last--;
        bool cut = at >= len || (text[last - 1] != '}' && text[last - 1] != ']');
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: invalid JSON at line %d, column %d%s", what, line, col,
                                cut ? " (the text ends early: truncated?)" : "");
    }
    while (at < len && (is_space(text[at]) || text[at] == '\0')) at++;
    if (at < len) {
        cJSON_Delete(root);
        line_col(text, at, &line, &col);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: unexpected text after the JSON document at line %d, column %d",
                                what, line, col);
    }
    char key[80];
    size_t kat;
    if (find_nul_key(text, len, key, sizeof key, &kat)) {
        cJSON_Delete(root);
        line_col(text, kat, &line, &col);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: key \"%s\" (line %d) contains \\u0000: refused", what, key, line);
    }
    bool oom = false;
    const char *dup = find_duplicate(root, &oom);
    if (oom || dup) {
        anneal_status st = oom ? anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory checking keys", what)
                               : anneal_set_error(ANNEAL_ERR_FORMAT, "%s: duplicate key \"%.200s\"", what, dup);
        cJSON_Delete(root);
        return st;
    }
    *out = root;
    return ANNEAL_OK;
}

anneal_status anneal_read_text_file(const char *path, size_t max_bytes, char **text, size_t *len) {
    *text = NULL;
    if (len) *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        bool dir = S_ISDIR(sb.st_mode);
        fclose(f);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: %s", path, dir ? "is a directory, not a file" : "not a regular file");
    }
    if ((uint64_t)sb.st_size > max_bytes) {
        fclose(f);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: %lld bytes, more than the %zu this file may have", path,
                                (long long)sb.st_size, max_bytes);
    }
    /* read to the end (the size may change under us): never more than max_bytes */
    size_t cap = (size_t)sb.st_size + 1, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        fclose(f);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    for (;;) {
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (n < cap) break;
        if (cap > max_bytes) {
            free(buf);
            fclose(f);
            return anneal_set_error(ANNEAL_ERR_IO, "%s: more than the %zu bytes this file may have", path, max_bytes);
        }
        size_t nc = cap * 2;
        char *g = realloc(buf, nc + 1);
        if (!g) {
            free(buf);
            fclose(f);
            return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
        }
        buf = g, cap = nc;
    }
    bool err = ferror(f) != 0;
    int e = errno;
    fclose(f);
    if (err) {
        free(buf);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: read failed: %s", path, strerror(e));
    }
    buf[n] = '\0';
    *text = buf;
    if (len) *len = n;
    return ANNEAL_OK;
}

anneal_status anneal_json_read_file(const char *path, size_t max_bytes, cJSON **out) {
    *out = NULL;
    char *text;
    size_t n;
    anneal_status st = anneal_read_text_file(path, max_bytes, &text, &n);
    if (st != ANNEAL_OK) return st;
    st = anneal_json_parse(text, n, path, out);
    free(text);
    return st;
}
