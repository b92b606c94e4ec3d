/* Reading tokenizer files: a whole file into memory, and JSON with errors that name
 * the file, line and column (shared by the GPT-2 and Hugging Face loaders). */
#include "tokenizer_impl.h"
#include "anneal/parse.h"

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
    /* the checked parser: duplicate keys and \u0000 in keys refused, errors with line/column */
    return anneal_json_parse(buf, len, path, out);
}
