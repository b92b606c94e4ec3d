/* The GGUF writer: metadata and tensors are gathered in memory (the tensors already
 * in their stored type), then written as version 3 in one pass: header, key/values,
 * tensor infos with offsets aligned to general.alignment, zero padding, data; through
 * the atomic file helpers (temp + fsync + rename). Q8_0 follows llama.cpp's
 * quantize_row_q8_0_ref. */
#include "anneal/fs.h"
#include "anneal/gguf.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct wkv {
    char *key;
    anneal_gguf_vtype type;
    uint8_t *val; /* the value's serialised bytes (after the type) */
    size_t len;
} wkv;

typedef struct wtensor {
    char *name;
    int n_dims;
    int64_t ne[ANNEAL_GGUF_MAX_DIMS];
    anneal_ggml_type type;
    uint8_t *data;
    uint64_t nbytes, offset;
} wtensor;

struct anneal_gguf_writer {
    uint32_t alignment;
    wkv *kv;
    int n_kv, cap_kv;
    wtensor *t;
    int n_t, cap_t;
};

anneal_gguf_writer *anneal_gguf_writer_new(uint32_t alignment) {
    if (alignment && (alignment & (alignment - 1))) {
        anneal_set_error(ANNEAL_ERR_ARG, "gguf writer: alignment %u is not a power of two", (unsigned)alignment);
        return NULL;
    }
    anneal_gguf_writer *w = calloc(1, sizeof *w);
    if (!w) {
        anneal_set_error(ANNEAL_ERR_OOM, "gguf writer: out of memory");
        return NULL;
    }
    w->alignment = alignment ? alignment : ANNEAL_GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void anneal_gguf_writer_free(anneal_gguf_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->n_kv; i++) free(w->kv[i].key), free(w->kv[i].val);
    for (int i = 0; i < w->n_t; i++) free(w->t[i].name), free(w->t[i].data);
    free(w->kv);
    free(w->t);
    free(w);
}

/* Appends key with `len` bytes of serialised value (taken: freed on failure). */
static anneal_status add_kv(anneal_gguf_writer *w, const char *key, anneal_gguf_vtype type, uint8_t *val, size_t len) {
    if (!w || !key || !val) {
        free(val);
        return anneal_set_error(w && key ? ANNEAL_ERR_OOM : ANNEAL_ERR_ARG, "gguf writer: %s",
                                w && key ? "out of memory" : "NULL argument");
    }
    for (int i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kv[i].key, key)) {
            free(val);
            return anneal_set_error(ANNEAL_ERR_ARG, "gguf writer: metadata key %s given twice", key);
        }
    if (w->n_kv == w->cap_kv) {
        int cap = w->cap_kv ? 2 * w->cap_kv : 32;
        wkv *kv = realloc(w->kv, (size_t)cap * sizeof *kv);
        if (!kv) {
            free(val);
            return anneal_set_error(ANNEAL_ERR_OOM, "gguf writer: out of memory");
        }
        w->kv = kv;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k) {
        free(val);
        return anneal_set_error(ANNEAL_ERR_OOM, "gguf writer: out of memory");
    }
    w->kv[w->n_kv++] = (wkv){k, type, val, len};
    return ANNEAL_OK;
}

/* A malloc'd copy of n bytes (NULL when out of memory). */
static uint8_t *dup_bytes(const void *p, size_t n) {
    uint8_t *b = malloc(n ? n : 1);
    if (b && n) memcpy(b, p, n);
    return b;
}

anneal_status anneal_gguf_put_u32(anneal_gguf_writer *w, const char *key, uint32_t v) {
    return add_kv(w, key, ANNEAL_GGUF_UINT32, dup_bytes(&v, 4), 4);
}

anneal_status anneal_gguf_put_i32(anneal_gguf_writer *w, const char *key, int32_t v) {
    return add_kv(w, key, ANNEAL_GGUF_INT32, dup_bytes(&v, 4), 4);
}

anneal_status anneal_gguf_put_f32(anneal_gguf_writer *w, const char *key, float v) {
    return add_kv(w, key, ANNEAL_GGUF_FLOAT32, dup_bytes(&v, 4), 4);
}

anneal_status anneal_gguf_put_bool(anneal_gguf_writer *w, const char *key, bool v) {
    uint8_t b = v;
    return add_kv(w, key, ANNEAL_GGUF_BOOL, dup_bytes(&b, 1), 1);
}

anneal_status anneal_gguf_put_str(anneal_gguf_writer *w, const char *key, const char *s, size_t n) {
    uint8_t *b = malloc(8 + n);
    if (b) {
        uint64_t len = n;
        memcpy(b, &len, 8);
        if (n) memcpy(b + 8, s, n);
    }
    return add_kv(w, key, ANNEAL_GGUF_STRING, b, 8 + n);
}

/* An array header (element type, count) followed by `bytes` of elements. */
static uint8_t *array_buf(anneal_gguf_vtype et, int64_t n, size_t bytes) {
    uint8_t *b = malloc(12 + bytes);
    if (!b) return NULL;
    uint32_t t = et;
    uint64_t c = (uint64_t)n;
    memcpy(b, &t, 4);
    memcpy(b + 4, &c, 8);
    return b;
}

anneal_status anneal_gguf_put_str_array(anneal_gguf_writer *w, const char *key, int64_t n, const char *const *s,
                                        const size_t *len) {
    size_t bytes = 0;
    for (int64_t i = 0; i < n; i++) bytes += 8 + len[i];
    uint8_t *b = array_buf(ANNEAL_GGUF_STRING, n, bytes);
    size_t at = 12;
    for (int64_t i = 0; b && i < n; i++) {
        uint64_t l = len[i];
        memcpy(b + at, &l, 8);
        if (l) memcpy(b + at + 8, s[i], l);
        at += 8 + l;
    }
    return add_kv(w, key, ANNEAL_GGUF_ARRAY, b, 12 + bytes);
}

anneal_status anneal_gguf_put_i32_array(anneal_gguf_writer *w, const char *key, int64_t n, const int32_t *v) {
    uint8_t *b = array_buf(ANNEAL_GGUF_INT32, n, (size_t)n * 4);
    if (b && n) memcpy(b + 12, v, (size_t)n * 4);
    return add_kv(w, key, ANNEAL_GGUF_ARRAY, b, 12 + (size_t)n * 4);
}

anneal_status anneal_gguf_put_f32_array(anneal_gguf_writer *w, const char *key, int64_t n, const float *v) {
    uint8_t *b = array_buf(ANNEAL_GGUF_FLOAT32, n, (size_t)n * 4);
    if (b && n) memcpy(b + 12, v, (size_t)n * 4);
    return add_kv(w, key, ANNEAL_GGUF_ARRAY, b, 12 + (size_t)n * 4);
}

void anneal_gguf_quantize_q8_0(const float *x, int64_t n, uint8_t *out) {
    for (int64_t b = 0; b < n / ANNEAL_GGUF_QK8_0; b++) {
        const float *v = x + b * ANNEAL_GGUF_QK8_0;
        uint8_t *blk = out + b * (2 + ANNEAL_GGUF_QK8_0);
        float amax = 0.0f;
        for (int j = 0; j < ANNEAL_GGUF_QK8_0; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f;
        const float id = d ? 1.0f / d : 0.0f;
        uint16_t h = anneal_f32_to_f16(d);
        memcpy(blk, &h, 2);
        for (int j = 0; j < ANNEAL_GGUF_QK8_0; j++) blk[2 + j] = (uint8_t)(int8_t)roundf(v[j] * id);
    }
}

anneal_status anneal_gguf_put_tensor(anneal_gguf_writer *w, const char *name, int ndim, const int64_t *shape,
                                     anneal_ggml_type type, const float *data) {
    if (!w || !name || !shape || !data || ndim < 1 || ndim > ANNEAL_GGUF_MAX_DIMS)
        return anneal_set_error(ANNEAL_ERR_ARG, "gguf writer: tensor %s: bad arguments", name ? name : "?");
    wtensor t = {.n_dims = ndim, .type = type};
    for (int d = 0; d < ANNEAL_GGUF_MAX_DIMS; d++) t.ne[d] = d < ndim ? shape[ndim - 1 - d] : 1;
    if (!anneal_gguf_type_nbytes(type, ndim, t.ne, &t.nbytes))
        return anneal_set_error(ANNEAL_ERR_ARG, "gguf writer: tensor %s: %s needs rows that are whole blocks of %d (row of %lld)",
                                name, anneal_ggml_type_name(type), ANNEAL_GGUF_QK8_0, (long long)t.ne[0]);
    for (int i = 0; i < w->n_t; i++)
        if (!strcmp(w->t[i].name, name)) return anneal_set_error(ANNEAL_ERR_ARG, "gguf writer: tensor %s given twice", name);
    if (w->n_t == w->cap_t) {
        int cap = w->cap_t ? 2 * w->cap_t : 64;
        wtensor *nt = realloc(w->t, (size_t)cap * sizeof *nt);
        if (!nt) return anneal_set_error(ANNEAL_ERR_OOM, "gguf writer: out of memory");
        w->t = nt;
        w->cap_t = cap;
    }
    t.name = strdup(name);
    t.data = malloc(t.nbytes ? t.nbytes : 1);
    if (!t.name || !t.data) {
        free(t.name);
        free(t.data);
        return anneal_set_error(ANNEAL_ERR_OOM, "gguf writer: out of memory for %s", name);
    }
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    switch (type) {
    case ANNEAL_GGML_F32: memcpy(t.data, data, (size_t)n * 4); break;
    case ANNEAL_GGML_F16:
    case ANNEAL_GGML_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = type == ANNEAL_GGML_F16 ? anneal_f32_to_f16(data[i]) : anneal_f32_to_bf16(data[i]);
            memcpy(t.data + 2 * i, &h, 2);
        }
        break;
    case ANNEAL_GGML_Q8_0: anneal_gguf_quantize_q8_0(data, n, t.data); break;
    default:
        free(t.name);
        free(t.data);
        return anneal_set_error(ANNEAL_ERR_ARG, "gguf writer: tensor %s: type %u is not written", name, (unsigned)type);
    }
    w->t[w->n_t++] = t;
    return ANNEAL_OK;
}

/* Appends bytes to the file being written (the atomic helpers name the file in errors). */
static anneal_status put(anneal_atomic_file *af, const void *p, size_t n) { return anneal_atomic_write(af, p, n); }

/* Appends a little-endian u32. */
static anneal_status put_u32(anneal_atomic_file *af, uint32_t v) { return put(af, &v, 4); }
/* Appends a little-endian u64. */
static anneal_status put_u64(anneal_atomic_file *af, uint64_t v) { return put(af, &v, 8); }

/* Appends a GGUF string: u64 length, bytes. */
static anneal_status put_string(anneal_atomic_file *af, const char *s) {
    size_t n = strlen(s);
    anneal_status r = put_u64(af, n);
    return r ? r : put(af, s, n);
}

/* Appends zeros until *pos is a multiple of align (*pos advanced). */
static anneal_status pad_to(anneal_atomic_file *af, uint64_t *pos, uint32_t align) {
    static const uint8_t zeros[256];
    uint64_t target = (*pos + align - 1) / align * align;
    anneal_status r = ANNEAL_OK;
    while (!r && *pos < target) {
        uint64_t k = target - *pos < sizeof zeros ? target - *pos : sizeof zeros;
        r = put(af, zeros, (size_t)k);
        *pos += k;
    }
    return r;
}

anneal_status anneal_gguf_writer_save(anneal_gguf_writer *w, const char *path) {
    if (!w || !path) return anneal_set_error(ANNEAL_ERR_ARG, "gguf writer: NULL argument");
    if (w->alignment != ANNEAL_GGUF_DEFAULT_ALIGNMENT) {
        bool have = false;
        for (int i = 0; i < w->n_kv; i++) have |= !strcmp(w->kv[i].key, "general.alignment");
        if (!have) {
            anneal_status r = anneal_gguf_put_u32(w, "general.alignment", w->alignment);
            if (r) return r;
        }
    }
    uint64_t off = 0;
    for (int i = 0; i < w->n_t; i++) {
        off = (off + w->alignment - 1) / w->alignment * w->alignment;
        w->t[i].offset = off;
        off += w->t[i].nbytes;
    }
    anneal_atomic_file af = {.fd = -1};
    anneal_status r = anneal_atomic_open(&af, path);
    if (r) return r;
    uint64_t pos = 0;
    r = put(&af, "GGUF", 4);
    if (!r) r = put_u32(&af, 3);
    if (!r) r = put_u64(&af, (uint64_t)w->n_t);
    if (!r) r = put_u64(&af, (uint64_t)w->n_kv);
    pos = 24;
    for (int i = 0; !r && i < w->n_kv; i++) {
        r = put_string(&af, w->kv[i].key);
        if (!r) r = put_u32(&af, w->kv[i].type);
        if (!r) r = put(&af, w->kv[i].val, w->kv[i].len);
        pos += 8 + strlen(w->kv[i].key) + 4 + w->kv[i].len;
    }
    for (int i = 0; !r && i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        r = put_string(&af, t->name);
        if (!r) r = put_u32(&af, (uint32_t)t->n_dims);
        for (int d = 0; !r && d < t->n_dims; d++) r = put_u64(&af, (uint64_t)t->ne[d]);
        if (!r) r = put_u32(&af, (uint32_t)t->type);
        if (!r) r = put_u64(&af, t->offset);
        pos += 8 + strlen(t->name) + 4 + 8 * (uint64_t)t->n_dims + 4 + 8;
    }
    if (!r) r = pad_to(&af, &pos, w->alignment);
    uint64_t data0 = pos;
    for (int i = 0; !r && i < w->n_t; i++) {
        uint64_t rel = pos - data0;
        if (rel < w->t[i].offset) {
            pos = data0 + rel;
            r = pad_to(&af, &pos, w->alignment);
        }
        if (!r) r = put(&af, w->t[i].data, (size_t)w->t[i].nbytes);
        pos += w->t[i].nbytes;
    }
    if (!r && w->n_t) r = pad_to(&af, &pos, w->alignment);
    if (r) {
        anneal_atomic_abort(&af);
        return r;
    }
    return anneal_atomic_commit(&af);
}
