/* The GGUF reader: maps the file and parses the header, the metadata and the tensor
 * table with a cursor that checks every read against the end of the file, so a count
 * or a length is bounded by the bytes left before anything is allocated for it; then
 * checks every tensor's type, shape, size, offset and alignment against the data
 * section. Values stay in the mapping (anneal_gguf_kv points into it). */
#include "anneal/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct cursor {
    const uint8_t *p;
    uint64_t pos, size;
    const char *what;
} cursor;

#define FMT_ERR(c, ...) anneal_set_error(ANNEAL_ERR_FORMAT, __VA_ARGS__)

/* Takes n bytes at the cursor (false, error naming `field`, when fewer are left). */
static bool take(cursor *c, uint64_t n, const uint8_t **at, const char *field) {
    if (n > c->size - c->pos) {
        FMT_ERR(c, "%s: truncated: %s needs %llu bytes at offset %llu but the file has %llu", c->what, field,
                (unsigned long long)n, (unsigned long long)c->pos, (unsigned long long)c->size);
        return false;
    }
    *at = c->p + c->pos;
    c->pos += n;
    return true;
}

/* Reads a little-endian u32 (false, error naming field, past the end). */
static bool rd_u32(cursor *c, uint32_t *v, const char *field) {
    const uint8_t *at;
    if (!take(c, 4, &at, field)) return false;
    memcpy(v, at, 4);
    return true;
}

/* Reads a little-endian u64 (false, error naming field, past the end). */
static bool rd_u64(cursor *c, uint64_t *v, const char *field) {
    const uint8_t *at;
    if (!take(c, 8, &at, field)) return false;
    memcpy(v, at, 8);
    return true;
}

/* Reads a GGUF string (u64 length + bytes), its length bounded by the bytes left. */
static bool rd_str(cursor *c, anneal_gguf_str *s, const char *field) {
    uint64_t n;
    const uint8_t *at;
    if (!rd_u64(c, &n, field) || !take(c, n, &at, field)) return false;
    s->s = (const char *)at;
    s->n = n;
    return true;
}

/* Size of a scalar value type (0 for STRING, ARRAY and unknown types). */
static uint64_t scalar_size(uint32_t t) {
    switch (t) {
    case ANNEAL_GGUF_UINT8: case ANNEAL_GGUF_INT8: case ANNEAL_GGUF_BOOL: return 1;
    case ANNEAL_GGUF_UINT16: case ANNEAL_GGUF_INT16: return 2;
    case ANNEAL_GGUF_UINT32: case ANNEAL_GGUF_INT32: case ANNEAL_GGUF_FLOAT32: return 4;
    case ANNEAL_GGUF_UINT64: case ANNEAL_GGUF_INT64: case ANNEAL_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* True for the value types of the format (UINT8 .. FLOAT64). */
static bool known_vtype(uint32_t t) { return t <= ANNEAL_GGUF_FLOAT64; }

const char *anneal_ggml_type_name(anneal_ggml_type t) {
    switch (t) {
    case ANNEAL_GGML_F32: return "f32";
    case ANNEAL_GGML_F16: return "f16";
    case ANNEAL_GGML_BF16: return "bf16";
    case ANNEAL_GGML_Q8_0: return "q8_0";
    default: return "?";
    }
}

bool anneal_gguf_type_nbytes(anneal_ggml_type type, int n_dims, const int64_t *ne, uint64_t *out) {
    uint64_t rows = 1;
    for (int d = 1; d < n_dims; d++)
        if (ne[d] < 0 || __builtin_mul_overflow(rows, (uint64_t)ne[d], &rows)) return false;
    if (n_dims < 1 || ne[0] < 0) return false;
    uint64_t row;
    switch (type) {
    case ANNEAL_GGML_F32: if (__builtin_mul_overflow((uint64_t)ne[0], 4u, &row)) return false; break;
    case ANNEAL_GGML_F16:
    case ANNEAL_GGML_BF16: if (__builtin_mul_overflow((uint64_t)ne[0], 2u, &row)) return false; break;
    case ANNEAL_GGML_Q8_0:
        if (ne[0] % ANNEAL_GGUF_QK8_0) return false;
        row = (uint64_t)ne[0] / ANNEAL_GGUF_QK8_0 * (2 + ANNEAL_GGUF_QK8_0);
        break;
    default: return false;
    }
    return !__builtin_mul_overflow(row, rows, out);
}

/* Reads one metadata value of type t (arrays: one level, elements scalars or strings). */
static bool read_value(cursor *c, anneal_gguf_kv *kv, const char *key) {
    if (!known_vtype(kv->type))
        return FMT_ERR(c, "%s: metadata \"%s\": unknown value type %u", c->what, key, (unsigned)kv->type), false;
    if (kv->type == ANNEAL_GGUF_STRING) return rd_str(c, &kv->str, key);
    if (kv->type != ANNEAL_GGUF_ARRAY) return take(c, scalar_size(kv->type), &kv->val, key);
    uint32_t at;
    if (!rd_u32(c, &at, key) || !rd_u64(c, &kv->arr_n, key)) return false;
    kv->arr_type = (anneal_gguf_vtype)at;
    if (!known_vtype(at) || at == ANNEAL_GGUF_ARRAY)
        return FMT_ERR(c, "%s: metadata \"%s\": array of unsupported type %u", c->what, key, (unsigned)at), false;
    kv->val = c->p + c->pos;
    if (at != ANNEAL_GGUF_STRING) {
        const uint8_t *p;
        uint64_t bytes;
        if (__builtin_mul_overflow(kv->arr_n, scalar_size(at), &bytes))
            return FMT_ERR(c, "%s: metadata \"%s\": %llu elements overflow", c->what, key,
                           (unsigned long long)kv->arr_n), false;
        return take(c, bytes, &p, key);
    }
    /* every string takes at least its 8-byte length: bound the count before allocating */
    if (kv->arr_n > (c->size - c->pos) / 8)
        return FMT_ERR(c, "%s: metadata \"%s\": %llu strings cannot fit in the %llu bytes left", c->what, key,
                       (unsigned long long)kv->arr_n, (unsigned long long)(c->size - c->pos)), false;
    kv->arr_strs = malloc((size_t)(kv->arr_n ? kv->arr_n : 1) * sizeof *kv->arr_strs);
    if (!kv->arr_strs) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", c->what), false;
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        anneal_gguf_str s;
        kv->arr_strs[i] = c->p + c->pos;
        if (!rd_str(c, &s, key)) return false;
    }
    return true;
}

anneal_gguf_str anneal_gguf_array_str(const anneal_gguf_kv *kv, uint64_t i) {
    anneal_gguf_str s = {0};
    if (!kv || !kv->arr_strs || i >= kv->arr_n) return s;
    memcpy(&s.n, kv->arr_strs[i], 8);
    s.s = (const char *)kv->arr_strs[i] + 8;
    return s;
}

/* True when GGUF string a is exactly the C string b. */
static bool str_eq(anneal_gguf_str a, const char *b) { return a.n == strlen(b) && !memcmp(a.s, b, a.n); }

/* qsort order of tensor pointers by data offset. */
static int cmp_offset(const void *a, const void *b) {
    const anneal_gguf_tensor *x = *(anneal_gguf_tensor *const *)a, *y = *(anneal_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Parses the whole file; g->base/size/path are set. */
static anneal_status parse(anneal_gguf *g) {
    cursor c = {.p = g->base, .pos = 0, .size = g->size, .what = g->path};
    const uint8_t *magic;
    if (!take(&c, 4, &magic, "the magic")) return ANNEAL_ERR_FORMAT;
    if (memcmp(magic, "GGUF", 4))
        return FMT_ERR(&c, "%s: not a GGUF file (magic %02x %02x %02x %02x, expected \"GGUF\")", g->path, magic[0],
                       magic[1], magic[2], magic[3]);
    uint64_t nt, nkv;
    if (!rd_u32(&c, &g->version, "the version")) return ANNEAL_ERR_FORMAT;
    if (g->version != 2 && g->version != 3)
        return FMT_ERR(&c, "%s: GGUF version %u is not supported (anneal reads versions 2 and 3)", g->path,
                       (unsigned)g->version);
    if (!rd_u64(&c, &nt, "the tensor count") || !rd_u64(&c, &nkv, "the metadata count")) return ANNEAL_ERR_FORMAT;
    /* a metadata entry takes >= 8 + 4 + 1 bytes, a tensor entry >= 8 + 4 + 8 + 4 + 8 */
    uint64_t left = g->size - c.pos;
    if (nkv > left / 13)
        return FMT_ERR(&c, "%s: %llu metadata entries cannot fit in a file of %llu bytes", g->path,
                       (unsigned long long)nkv, (unsigned long long)g->size);
    if (nt > left / 32)
        return FMT_ERR(&c, "%s: %llu tensors cannot fit in a file of %llu bytes", g->path, (unsigned long long)nt,
                       (unsigned long long)g->size);
    g->kv = calloc((size_t)(nkv ? nkv : 1), sizeof *g->kv);
    g->tensors = calloc((size_t)(nt ? nt : 1), sizeof *g->tensors);
    if (!g->kv || !g->tensors) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", g->path);
    g->alignment = ANNEAL_GGUF_DEFAULT_ALIGNMENT;
    char key[128];
    for (uint64_t i = 0; i < nkv; i++) {
        anneal_gguf_kv *kv = &g->kv[i];
        uint32_t t;
        if (!rd_str(&c, &kv->key, "a metadata key")) return ANNEAL_ERR_FORMAT;
        snprintf(key, sizeof key, "%.*s", (int)(kv->key.n < 100 ? kv->key.n : 100), kv->key.s);
        g->n_kv = (int64_t)i + 1;
        if (!rd_u32(&c, &t, key)) return ANNEAL_ERR_FORMAT;
        kv->type = (anneal_gguf_vtype)t;
        if (!read_value(&c, kv, key)) return anneal_last_status();
        for (uint64_t j = 0; j < i; j++)
            if (g->kv[j].key.n == kv->key.n && !memcmp(g->kv[j].key.s, kv->key.s, kv->key.n))
                return FMT_ERR(&c, "%s: metadata key \"%s\" appears twice", g->path, key);
        if (str_eq(kv->key, "general.alignment")) {
            uint32_t a;
            if (kv->type != ANNEAL_GGUF_UINT32)
                return FMT_ERR(&c, "%s: general.alignment is not a uint32", g->path);
            memcpy(&a, kv->val, 4);
            if (a == 0 || (a & (a - 1)) || a > (1u << 20))
                return FMT_ERR(&c, "%s: general.alignment %u is not a power of two up to 1 MiB", g->path, (unsigned)a);
            g->alignment = a;
        }
    }
    for (uint64_t i = 0; i < nt; i++) {
        anneal_gguf_tensor *t = &g->tensors[i];
        uint32_t nd, ty;
        if (!rd_str(&c, &t->name, "a tensor name")) return ANNEAL_ERR_FORMAT;
        g->n_tensors = (int64_t)i + 1;
        t->cname = malloc(t->name.n + 1);
        if (!t->cname) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", g->path);
        memcpy(t->cname, t->name.s, t->name.n);
        t->cname[t->name.n] = '\0';
        if (strlen(t->cname) != t->name.n || t->name.n == 0 || t->name.n >= 256)
            return FMT_ERR(&c, "%s: tensor %llu has an empty, over-long or NUL-holding name", g->path,
                           (unsigned long long)i);
        if (!rd_u32(&c, &nd, t->cname)) return ANNEAL_ERR_FORMAT;
        if (nd < 1 || nd > ANNEAL_GGUF_MAX_DIMS)
            return FMT_ERR(&c, "%s: tensor %s has %u dimensions (1 to %d allowed)", g->path, t->cname, (unsigned)nd,
                           ANNEAL_GGUF_MAX_DIMS);
        t->n_dims = (int)nd;
        for (uint32_t d = 0; d < nd; d++) {
            uint64_t v;
            if (!rd_u64(&c, &v, t->cname)) return ANNEAL_ERR_FORMAT;
            if (v > (uint64_t)INT64_MAX)
                return FMT_ERR(&c, "%s: tensor %s: dimension %u is %llu", g->path, t->cname, (unsigned)d,
                               (unsigned long long)v);
            t->ne[d] = (int64_t)v;
        }
        for (int d = (int)nd; d < ANNEAL_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        if (!rd_u32(&c, &ty, t->cname) || !rd_u64(&c, &t->offset, t->cname)) return ANNEAL_ERR_FORMAT;
        t->type = (anneal_ggml_type)ty;
        if (!strcmp(anneal_ggml_type_name(t->type), "?"))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: tensor %s has ggml type %u, which anneal does not read (f32, f16, bf16, q8_0)",
                                    g->path, t->cname, (unsigned)ty);
        if (!anneal_gguf_type_nbytes(t->type, t->n_dims, t->ne, &t->nbytes))
            return FMT_ERR(&c, "%s: tensor %s: shape x %s overflows or its rows are not whole blocks", g->path, t->cname,
                           anneal_ggml_type_name(t->type));
        for (uint64_t j = 0; j < i; j++)
            if (!strcmp(g->tensors[j].cname, t->cname))
                return FMT_ERR(&c, "%s: tensor name %s appears twice", g->path, t->cname);
    }
    uint64_t data = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
    if (nt && data > g->size)
        return FMT_ERR(&c, "%s: truncated: the tensor data would start at %llu, past the end (%llu bytes)", g->path,
                       (unsigned long long)data, (unsigned long long)g->size);
    g->data_offset = data;
    uint64_t avail = g->size > data ? g->size - data : 0;
    anneal_gguf_tensor **order = malloc((size_t)(nt ? nt : 1) * sizeof *order);
    if (!order) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", g->path);
    anneal_status r = ANNEAL_OK;
    for (uint64_t i = 0; i < nt && !r; i++) {
        anneal_gguf_tensor *t = &g->tensors[i];
        order[i] = t;
        if (t->offset % g->alignment)
            r = FMT_ERR(&c, "%s: tensor %s: offset %llu is not a multiple of the alignment %u", g->path, t->cname,
                        (unsigned long long)t->offset, (unsigned)g->alignment);
        else if (t->offset > avail || t->nbytes > avail - t->offset)
            r = FMT_ERR(&c, "%s: tensor %s: %llu bytes at offset %llu run past the end of the file (%llu bytes of data)",
                        g->path, t->cname, (unsigned long long)t->nbytes, (unsigned long long)t->offset,
                        (unsigned long long)avail);
        else
            t->data = g->base + data + t->offset;
    }
    if (!r && nt > 1) {
        qsort(order, (size_t)nt, sizeof *order, cmp_offset);
        for (uint64_t i = 1; i < nt && !r; i++)
            if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset)
                r = FMT_ERR(&c, "%s: tensors %s and %s overlap", g->path, order[i - 1]->cname, order[i]->cname);
    }
    free(order);
    return r;
}

/* Parses g; on success hands it to *out, else frees it and returns the error. */
static anneal_status finish_open(anneal_gguf *g, anneal_gguf **out) {
    anneal_status r = parse(g);
    if (r) {
        anneal_gguf_close(g);
        return r;
    }
    *out = g;
    return ANNEAL_OK;
}

anneal_status anneal_gguf_open_memory(const void *data, size_t size, const char *what, anneal_gguf **out) {
    if (out) *out = NULL;
    if (!out || (!data && size)) return anneal_set_error(ANNEAL_ERR_ARG, "gguf: NULL argument");
    anneal_gguf *g = calloc(1, sizeof *g);
    if (!g || !(g->path = strdup(what ? what : "gguf"))) {
        free(g);
        return anneal_set_error(ANNEAL_ERR_OOM, "gguf: out of memory");
    }
    g->base = data;
    g->size = size;
    return finish_open(g, out);
}

anneal_status anneal_gguf_open(const char *path, anneal_gguf **out) {
    if (out) *out = NULL;
    if (!path || !out) return anneal_set_error(ANNEAL_ERR_ARG, "gguf: NULL argument");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: not a regular file", path);
    }
    anneal_gguf *g = calloc(1, sizeof *g);
    if (!g || !(g->path = strdup(path))) {
        close(fd);
        free(g);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    g->size = (uint64_t)sb.st_size;
    if (g->size) {
        void *p = mmap(NULL, (size_t)g->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            anneal_gguf_close(g);
            return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
        }
        g->base = p;
        g->mapped = true;
    }
    close(fd);
    return finish_open(g, out);
}

void anneal_gguf_close(anneal_gguf *g) {
    if (!g) return;
    for (int64_t i = 0; i < g->n_kv; i++) free(g->kv[i].arr_strs);
    for (int64_t i = 0; i < g->n_tensors; i++) free(g->tensors[i].cname);
    free(g->kv);
    free(g->tensors);
    if (g->mapped) munmap((void *)g->base, (size_t)g->size);
    free(g->path);
    free(g);
}

const anneal_gguf_kv *anneal_gguf_find_kv(const anneal_gguf *g, const char *key) {
    for (int64_t i = 0; g && key && i < g->n_kv; i++)
        if (str_eq(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

const anneal_gguf_tensor *anneal_gguf_find_tensor(const anneal_gguf *g, const char *name) {
    for (int64_t i = 0; g && name && i < g->n_tensors; i++)
        if (!strcmp(g->tensors[i].cname, name)) return &g->tensors[i];
    return NULL;
}

bool anneal_gguf_get_int(const anneal_gguf *g, const char *key, int64_t *v) {
    const anneal_gguf_kv *kv = anneal_gguf_find_kv(g, key);
    if (!kv) return false;
    const uint8_t *p = kv->val;
    switch (kv->type) {
    case ANNEAL_GGUF_UINT8: *v = p[0]; return true;
    case ANNEAL_GGUF_INT8: *v = (int8_t)p[0]; return true;
    case ANNEAL_GGUF_UINT16: { uint16_t x; memcpy(&x, p, 2); *v = x; return true; }
    case ANNEAL_GGUF_INT16: { int16_t x; memcpy(&x, p, 2); *v = x; return true; }
    case ANNEAL_GGUF_UINT32: { uint32_t x; memcpy(&x, p, 4); *v = x; return true; }
    case ANNEAL_GGUF_INT32: { int32_t x; memcpy(&x, p, 4); *v = x; return true; }
    case ANNEAL_GGUF_UINT64: { uint64_t x; memcpy(&x, p, 8); if (x > INT64_MAX) return false; *v = (int64_t)x; return true; }
    case ANNEAL_GGUF_INT64: { int64_t x; memcpy(&x, p, 8); *v = x; return true; }
    default: return false;
    }
}

bool anneal_gguf_get_float(const anneal_gguf *g, const char *key, double *v) {
    const anneal_gguf_kv *kv = anneal_gguf_find_kv(g, key);
    if (kv && kv->type == ANNEAL_GGUF_FLOAT32) {
        float f;
        memcpy(&f, kv->val, 4);
        *v = f;
        return true;
    }
    if (kv && kv->type == ANNEAL_GGUF_FLOAT64) {
        memcpy(v, kv->val, 8);
        return true;
    }
    return false;
}

bool anneal_gguf_get_str(const anneal_gguf *g, const char *key, anneal_gguf_str *v) {
    const anneal_gguf_kv *kv = anneal_gguf_find_kv(g, key);
    if (!kv || kv->type != ANNEAL_GGUF_STRING) return false;
    *v = kv->str;
    return true;
}

bool anneal_gguf_get_bool(const anneal_gguf *g, const char *key, bool *v) {
    const anneal_gguf_kv *kv = anneal_gguf_find_kv(g, key);
    if (!kv || kv->type != ANNEAL_GGUF_BOOL) return false;
    *v = kv->val[0] != 0;
    return true;
}

anneal_status anneal_gguf_tensor_to_f32(const anneal_gguf_tensor *t, float *out) {
    uint64_t n = 1;
    for (int d = 0; d < t->n_dims; d++) n *= (uint64_t)t->ne[d];
    const uint8_t *p = t->data;
    switch (t->type) {
    case ANNEAL_GGML_F32: memcpy(out, p, n * 4); break;
    case ANNEAL_GGML_F16:
    case ANNEAL_GGML_BF16:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = t->type == ANNEAL_GGML_F16 ? anneal_f16_to_f32(h) : anneal_bf16_to_f32(h);
        }
        break;
    case ANNEAL_GGML_Q8_0:
        for (uint64_t b = 0; b < n / ANNEAL_GGUF_QK8_0; b++) {
            const uint8_t *blk = p + b * (2 + ANNEAL_GGUF_QK8_0);
            uint16_t h;
            memcpy(&h, blk, 2);
            float d = anneal_f16_to_f32(h);
            for (int j = 0; j < ANNEAL_GGUF_QK8_0; j++) out[b * ANNEAL_GGUF_QK8_0 + j] = d * (float)(int8_t)blk[2 + j];
        }
        break;
    default:
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "gguf: tensor %s: type %u", t->cname, (unsigned)t->type);
    }
    return ANNEAL_OK;
}

bool anneal_gguf_path(const char *path) {
    size_t n = path ? strlen(path) : 0;
    return n > 5 && !strcasecmp(path + n - 5, ".gguf");
}
