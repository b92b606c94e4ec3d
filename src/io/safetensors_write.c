/* safetensors writer: validates the entries, lays the data out in the order given,
 * emits the JSON header (padded with spaces so the data section starts at a
 * multiple of 8 bytes) and writes the file atomically through core/fs.c. */
#include "anneal/io.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "anneal/fs.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "anneal's safetensors writer assumes a little-endian host"
#endif

/* safetensors dtype strings, indexed by anneal_dtype. */
static const char *const st_dtype_str[ANNEAL_DTYPE_COUNT] = {
    [ANNEAL_F32] = "F32", [ANNEAL_BF16] = "BF16", [ANNEAL_F16] = "F16", [ANNEAL_I32] = "I32",
    [ANNEAL_I64] = "I64", [ANNEAL_U16] = "U16",   [ANNEAL_U8] = "U8",   [ANNEAL_I8] = "I8",
};

/* A growable byte buffer for the header; `failed` latches an allocation failure. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool failed;
} sbuf;

/* Appends n bytes. */
static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->failed) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (b->len + n + 1 > cap) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->failed = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

/* Appends formatted text (short pieces only: numbers and punctuation). */
static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) {
        b->failed = true;
        return;
    }
    sb_put(b, tmp, (size_t)n);
}

/* Appends s as a JSON string literal (UTF-8 passed through, controls escaped). */
static void sb_json_str(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            char esc[2] = {'\\', (char)*c};
            sb_put(b, esc, 2);
        } else if (*c < 0x20) {
            sb_printf(b, "\\u%04x", *c);
        } else {
            sb_put(b, (const char *)c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

/* True when s is well-formed UTF-8 (no overlongs, surrogates or code points > U+10FFFF). */
static bool utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        int n;
        unsigned cp;
        if (c < 0x80) {
            p++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1, cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2, cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3, cp = c & 0x07;
        } else {
            return false;
        }
        for (int i = 1; i <= n; i++) {
            if ((p[i] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (p[i] & 0x3F);
        }
        static const unsigned min_cp[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        p += n + 1;
    }
    return true;
}

/* Checks one entry and computes its byte size. */
static anneal_status check_entry(const char *path, int i, const anneal_st_write_entry *e,
                                 uint64_t *nbytes, bool fetching) {
    if (!e->name || !utf8_valid(e->name))
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: entry %d: name is NULL or not UTF-8", path, i);
    if (strcmp(e->name, "__metadata__") == 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: entry %d: '__metadata__' is reserved", path, i);
    if ((int)e->dtype < 0 || e->dtype >= ANNEAL_DTYPE_COUNT || !st_dtype_str[e->dtype])
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: entry '%s': invalid dtype %d (%s) for safetensors",
                                path, e->name, (int)e->dtype, anneal_dtype_name(e->dtype));
    if (e->ndim < 0 || e->ndim > ANNEAL_MAX_DIMS || (e->ndim > 0 && !e->shape))
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: entry '%s': bad ndim %d or NULL shape", path,
                                e->name, e->ndim);
    uint64_t n = 1;
    bool overflow = false, zero = false;
    for (int d = 0; d < e->ndim; d++) {
        if (e->shape[d] < 0)
            return anneal_set_error(ANNEAL_ERR_ARG, "%s: entry '%s': negative dim %lld", path,
                                    e->name, (long long)e->shape[d]);
        if (e->shape[d] == 0) zero = true;
        if (__builtin_mul_overflow(n, (uint64_t)e->shape[d], &n)) overflow = true;
    }
    if (zero) {
        n = 0;
        overflow = false;
    }
    if (overflow || __builtin_mul_overflow(n, (uint64_t)anneal_dtype_size(e->dtype), nbytes))
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: entry '%s': shape too large", path, e->name);
    if (*nbytes > 0 && !e->data && !fetching)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: entry '%s': NULL data", path, e->name);
    return ANNEAL_OK;
}

/* qsort comparison of two C strings held by pointer. */
static int cmp_str_ptr(const void *pa, const void *pb) {
    return strcmp(*(const char *const *)pa, *(const char *const *)pb);
}

/* Returns the first name that appears twice among n names, or NULL. */
static const char *find_duplicate(const char **names, int n) {
    qsort(names, (size_t)n, sizeof(char *), cmp_str_ptr);
    for (int i = 1; i < n; i++)
        if (strcmp(names[i - 1], names[i]) == 0) return names[i];
    return NULL;
}

/* Validates all inputs; fills sizes[n]. */
static anneal_status check_inputs(const char *path, int n, const anneal_st_write_entry *entries,
                                  int n_meta, const char *const *keys, const char *const *values,
                                  uint64_t *sizes, bool fetching) {
    for (int i = 0; i < n; i++) {
        anneal_status s = check_entry(path, i, &entries[i], &sizes[i], fetching);
        if (s != ANNEAL_OK) return s;
    }
    for (int i = 0; i < n_meta; i++)
        if (!keys[i] || !values[i] || !utf8_valid(keys[i]) || !utf8_valid(values[i]))
            return anneal_set_error(ANNEAL_ERR_ARG, "%s: metadata %d: NULL or not UTF-8", path, i);
    int m = n > n_meta ? n : n_meta;
    const char **names = malloc(((size_t)m + 1) * sizeof(char *));
    if (!names) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; i < n; i++) names[i] = entries[i].name;
    const char *dup = find_duplicate(names, n);
    anneal_status s = ANNEAL_OK;
    if (dup) {
        s = anneal_set_error(ANNEAL_ERR_ARG, "%s: duplicate tensor name '%s'", path, dup);
    } else {
        for (int i = 0; i < n_meta; i++) names[i] = keys[i];
        dup = find_duplicate(names, n_meta);
        if (dup) s = anneal_set_error(ANNEAL_ERR_ARG, "%s: duplicate metadata key '%s'", path, dup);
    }
    free(names);
    return s;
}

/* Builds the padded JSON header into b; data offsets follow the order of entries. */
static void build_header(sbuf *b, int n, const anneal_st_write_entry *entries, const uint64_t *sizes,
                         int n_meta, const char *const *keys, const char *const *values) {
    sb_put(b, "{", 1);
    bool first = true;
    if (n_meta > 0) {
        sb_put(b, "\"__metadata__\":{", 16);
        for (int i = 0; i < n_meta; i++) {
            if (i) sb_put(b, ",", 1);
            sb_json_str(b, keys[i]);
            sb_put(b, ":", 1);
            sb_json_str(b, values[i]);
        }
        sb_put(b, "}", 1);
        first = false;
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const anneal_st_write_entry *e = &entries[i];
        if (!first) sb_put(b, ",", 1);
        first = false;
        sb_json_str(b, e->name);
        sb_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_str[e->dtype]);
        for (int d = 0; d < e->ndim; d++) sb_printf(b, d ? ",%lld" : "%lld", (long long)e->shape[d]);
        sb_printf(b, "],\"data_offsets\":[%llu,", (unsigned long long)off);
        off += sizes[i];
        sb_printf(b, "%llu]}", (unsigned long long)off);
    }
    sb_put(b, "}", 1);
    /* Pad with spaces so 8 + header length is a multiple of 8 (aligned data section). */
    while (!b->failed && b->len % 8 != 0) sb_put(b, " ", 1);
}

anneal_status anneal_safetensors_write(const char *path, int n, const anneal_st_write_entry *entries,
                                       int n_meta, const char *const *meta_keys,
                                       const char *const *meta_values) {
    return anneal_safetensors_write_fetch(path, n, entries, n_meta, meta_keys, meta_values, NULL, NULL);
}

/* Validate, build the header, then stream header and data into an atomic temp file
 * (an entry without data from fetch, when it is written). */
anneal_status anneal_safetensors_write_fetch(const char *path, int n, const anneal_st_write_entry *entries,
                                             int n_meta, const char *const *meta_keys,
                                             const char *const *meta_values, anneal_st_fetch_fn fetch,
                                             void *fetch_ctx) {
    if (!path || !*path) return anneal_set_error(ANNEAL_ERR_ARG, "safetensors write: empty path");
    if (n < 0 || (n > 0 && !entries) || n_meta < 0 || (n_meta > 0 && (!meta_keys || !meta_values)))
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: bad entry or metadata arrays (n=%d, n_meta=%d)",
                                path, n, n_meta);
    uint64_t *sizes = calloc((size_t)n + 1, sizeof(uint64_t));
    if (!sizes) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    anneal_status s = check_inputs(path, n, entries, n_meta, meta_keys, meta_values, sizes, fetch != NULL);
    uint64_t total = 0;
    for (int i = 0; s == ANNEAL_OK && i < n; i++)
        if (__builtin_add_overflow(total, sizes[i], &total))
            s = anneal_set_error(ANNEAL_ERR_ARG, "%s: total data size overflows", path);
    sbuf hdr = {0};
    if (s == ANNEAL_OK) {
        build_header(&hdr, n, entries, sizes, n_meta, meta_keys, meta_values);
        if (hdr.failed) s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory for the header", path);
    }
    if (s != ANNEAL_OK) {
        free(hdr.p);
        free(sizes);
        return s;
    }

    anneal_atomic_file af;
    s = anneal_atomic_open(&af, path);
    if (s == ANNEAL_OK) {
        uint8_t len_le[8];
        uint64_t hlen = hdr.len;
        memcpy(len_le, &hlen, 8); /* little-endian host */
        s = anneal_atomic_write(&af, len_le, 8);
        if (s == ANNEAL_OK) s = anneal_atomic_write(&af, hdr.p, hdr.len);
        for (int i = 0; s == ANNEAL_OK && i < n; i++) {
            if (sizes[i] == 0) continue;
            const void *data = entries[i].data;
            if (!data) s = fetch(fetch_ctx, &entries[i], &data);
            if (s == ANNEAL_OK) s = anneal_atomic_write(&af, data, (size_t)sizes[i]);
        }
        if (s == ANNEAL_OK) s = anneal_atomic_commit(&af);
        else anneal_atomic_abort(&af);
    }
    free(hdr.p);
    free(sizes);
    return s;
}
