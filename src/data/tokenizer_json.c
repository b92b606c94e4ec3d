/* Reading tokenizer files: a whole file into memory, and JSON with errors that name
 * the file, line and column (shared by the GPT-2 and Hugging Face loaders). */
#include "tokenizer_impl.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

/* Reads a whole file (NUL-terminated copy in *buf). */
anneal_status anneal_tok_read_file(const char *path, char **buf, size_t *len) {
    *buf = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: not a regular file", path);
    }
    size_t n = (size_t)st.st_size;
    char *b = malloc(n + 1);
    if (!b) {
        fclose(f);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory reading %zu bytes", path, n);
    }
    size_t got = fread(b, 1, n, f);
    int err = ferror(f);
    fclose(f);
    if (err || got != n) {
        free(b);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: read failed (%zu of %zu bytes)", path, got, n);
    }
    b[n] = 0;
    *buf = b;
    *len = n;
    return ANNEAL_OK;
}

/* Parses JSON text; on failure the error names the file, line and column. */
anneal_status anneal_tok_parse_json(const char *path, const char *buf, size_t len, cJSON **out) {
    *out = NULL;
    if (len == 0) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the file is empty", path);
    const char *end = NULL;
    *out = cJSON_ParseWithLengthOpts(buf, len, &end, false);
    if (*out) return ANNEAL_OK;
    size_t at = end && end >= buf && end <= buf + len ? (size_t)(end - buf) : 0;
    int line = 1, col = 1;
    for (size_t i = 0; i < at; i++) {
        if (buf[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    size_t last = len; /* a document that does not end in } or ] was probably cut short */
    while (last > 0 && (buf[last - 1] == ' ' || buf[last - 1] == '\n' || buf[last - 1] == '\r' || buf[last - 1] == '\t'))
        last--;
    bool cut = at >= len || last == 0 || (buf[last - 1] != '}' && buf[last - 1] != ']');
    return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: invalid JSON at line %d, column %d%s", path, line, col,
                            cut ? " (the file ends early: truncated?)" : "");
}

