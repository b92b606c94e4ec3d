/* safetensors reader: maps a file read-only, validates its JSON header with cJSON
 * (dtypes, shapes, offsets, sizes, overlaps, duplicates, metadata) and hands out
 * entries, raw bytes and tensors converted between float dtypes.
 * File layout: u64 little-endian header length N | N bytes of JSON | data section. */
#include "anneal/io.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "anneal's safetensors reader assumes a little-endian host"
#endif

/* Headers above this are treated as corrupt rather than allocated. */
#define ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000)
/* Largest integer a JSON number (a double in cJSON) holds exactly. */
#define ST_MAX_JSON_INT 9007199254740992.0

/* The public struct plus a name index for anneal_safetensors_find. */
typedef struct st_impl {
    anneal_safetensors pub;
    int *by_name; /* entry indices sorted by name (n_entries) */
} st_impl;

static const struct {
    const char *name;
    anneal_dtype dtype;
} st_dtypes[] = {
    {"F32", ANNEAL_F32}, {"BF16", ANNEAL_BF16}, {"F16", ANNEAL_F16}, {"I32", ANNEAL_I32},
    {"I64", ANNEAL_I64}, {"U16", ANNEAL_U16},   {"U8", ANNEAL_U8},   {"I8", ANNEAL_I8},
};

/* Duplicates s, or NULL when out of memory. */
static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Reads a JSON number that must be a non-negative integer exactly representable. */
static bool json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return false;
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > ST_MAX_JSON_INT || d != (double)(uint64_t)d) return false;
    *out = (uint64_t)d;
    return true;
}

/* Parses one tensor entry {dtype, shape, data_offsets}; checks size against data_size. */
static anneal_status parse_entry(const char *path, const cJSON *j, uint64_t data_size,
                                 anneal_st_entry *e) {
    const char *name = j->string;
    if (!cJSON_IsObject(j))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: entry '%s' is not a JSON object", path,
                                name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(j, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(j, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(j, "data_offsets");
    if (!cJSON_IsString(jd))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: entry '%s': missing or non-string dtype",
                                path, name);
    int found = -1;
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(jd->valuestring, st_dtypes[i].name) == 0) found = (int)i;
    if (found < 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: entry '%s': unsupported dtype '%s'", path,
                                name, jd->valuestring);
    e->dtype = st_dtypes[found].dtype;

    if (!cJSON_IsArray(js))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: entry '%s': missing or non-array shape",
                                path, name);
    int ndim = cJSON_GetArraySize(js);
    if (ndim > ANNEAL_MAX_DIMS)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: entry '%s': %d dims (at most %d)", path,
                                name, ndim, ANNEAL_MAX_DIMS);
    e->ndim = ndim;
    uint64_t numel = 1;
    bool overflow = false;
    int d = 0;
    for (const cJSON *jv = js->child; jv; jv = jv->next, d++) {
        uint64_t v;
        if (!json_uint(jv, &v))
            return anneal_set_error(ANNEAL_ERR_FORMAT,
                                    "%s: entry '%s': dim %d is not a non-negative integer", path,
                                    name, d);
        e->shape[d] = (int64_t)v;
        if (__builtin_mul_overflow(numel, v, &numel)) overflow = true;
    }
    for (; d < ANNEAL_MAX_DIMS; d++) e->shape[d] = 0;
    /* A zero dim makes numel 0 even when the other dims overflowed. */
    for (int i = 0; i < ndim; i++) {
        if (e->shape[i] == 0) {
            overflow = false;
            numel = 0;
        }
    }
    uint64_t nbytes;
    if (overflow || numel > (uint64_t)INT64_MAX ||
        __builtin_mul_overflow(numel, (uint64_t)anneal_dtype_size(e->dtype), &nbytes))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: entry '%s': shape too large (overflow)",
                                path, name);

    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_uint(jo->child, &e->begin) ||
        !json_uint(jo->child->next, &e->end))
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: entry '%s': data_offsets must be [begin, end] of "
                                "non-negative integers",
                                path, name);
    if (e->begin > e->end)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: entry '%s': data_offsets begin %llu > end %llu", path, name,
                                (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > data_size)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: entry '%s': data_offsets end %llu beyond the data section "
                                "(%llu bytes; file truncated?)",
                                path, name, (unsigned long long)e->end,
                                (unsigned long long)data_size);
    if (e->end - e->begin != nbytes)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: entry '%s': %llu data bytes but dtype x shape needs %llu",
                                path, name, (unsigned long long)(e->end - e->begin),
                                (unsigned long long)nbytes);
    return ANNEAL_OK;
}

/* qsort comparison of two C strings held by pointer. */
static int cmp_str_ptr(const void *pa, const void *pb) {
    return strcmp(*(char *const *)pa, *(char *const *)pb);
}

/* Parses the "__metadata__" object: every value a string. */
static anneal_status parse_metadata(const char *path, const cJSON *j, anneal_safetensors *st) {
    if (!cJSON_IsObject(j))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: __metadata__ is not a JSON object", path);
    int n = cJSON_GetArraySize(j);
    st->metadata_keys = calloc((size_t)n + 1, sizeof(char *));
    st->metadata_values = calloc((size_t)n + 1, sizeof(char *));
    if (!st->metadata_keys || !st->metadata_values)
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    for (const cJSON *m = j->child; m; m = m->next) {
        if (!cJSON_IsString(m))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: __metadata__ value of '%s' is not a string",
                                    path, m->string);
        st->metadata_keys[st->n_metadata] = dup_str(m->string);
        st->metadata_values[st->n_metadata] = dup_str(m->valuestring);
        st->n_metadata++;
        if (!st->metadata_keys[st->n_metadata - 1] || !st->metadata_values[st->n_metadata - 1])
            return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    /* Duplicate keys (cJSON keeps them all): sort a copy of the key pointers. */
    char **keys = malloc(((size_t)n + 1) * sizeof(char *));
    if (!keys) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    memcpy(keys, st->metadata_keys, (size_t)n * sizeof(char *));
    qsort(keys, (size_t)n, sizeof(char *), cmp_str_ptr);
    anneal_status s = ANNEAL_OK;
    for (int i = 1; i < n && s == ANNEAL_OK; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: duplicate __metadata__ key '%s'", path,
                                 keys[i]);
    free(keys);
    return s;
}

/* Order of entries in the file: by begin, then end, then name (names are unique). */
static int cmp_offsets(const void *pa, const void *pb) {
    const anneal_st_entry *a = pa, *b = pb;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    if (a->end != b->end) return a->end < b->end ? -1 : 1;
    return strcmp(a->name, b->name);
}

/* Order of entry indices by name; ctx is the entry array (for qsort_r). */
static int cmp_by_name(const void *pa, const void *pb, void *ctx) {
    const anneal_st_entry *entries = ctx;
    return strcmp(entries[*(const int *)pa].name, entries[*(const int *)pb].name);
}

/* Fills st from the parsed JSON root: entries, metadata, order and checks. */
static anneal_status parse_header(const char *path, const cJSON *root, st_impl *impl) {
    anneal_safetensors *st = &impl->pub;
    if (!cJSON_IsObject(root))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: header is not a JSON object", path);
    int n = cJSON_GetArraySize(root);
    st->entries = calloc((size_t)n + 1, sizeof(anneal_st_entry));
    if (!st->entries) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    bool seen_meta = false;
    for (const cJSON *j = root->child; j; j = j->next) {
        if (strcmp(j->string, "__metadata__") == 0) {
            if (seen_meta)
                return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: duplicate __metadata__", path);
            seen_meta = true;
            anneal_status s = parse_metadata(path, j, st);
            if (s != ANNEAL_OK) return s;
            continue;
        }
        anneal_st_entry *e = &st->entries[st->n_entries];
        anneal_status s = parse_entry(path, j, st->data_size, e);
        if (s != ANNEAL_OK) return s;
        e->name = dup_str(j->string);
        if (!e->name) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
        st->n_entries++;
    }

    /* Duplicate names: cJSON keeps every member, so sort an index by name. */
    impl->by_name = malloc(((size_t)st->n_entries + 1) * sizeof(int));
    if (!impl->by_name) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    qsort(st->entries, (size_t)st->n_entries, sizeof(anneal_st_entry), cmp_offsets);
    for (int i = 0; i < st->n_entries; i++) impl->by_name[i] = i;
    qsort_r(impl->by_name, (size_t)st->n_entries, sizeof(int), cmp_by_name, st->entries);
    for (int i = 1; i < st->n_entries; i++) {
        const char *a = st->entries[impl->by_name[i - 1]].name;
        if (strcmp(a, st->entries[impl->by_name[i]].name) == 0)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: duplicate tensor name '%s'", path, a);
    }

    /* Overlaps: in offset order each non-empty range starts at or after the previous end. */
    const anneal_st_entry *prev = NULL;
    for (int i = 0; i < st->n_entries; i++) {
        const anneal_st_entry *e = &st->entries[i];
        if (e->begin == e->end) continue;
        if (prev && e->begin < prev->end)
            return anneal_set_error(ANNEAL_ERR_FORMAT,
                                    "%s: entries '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap",
                                    path, prev->name, (unsigned long long)prev->begin,
                                    (unsigned long long)prev->end, e->name,
                                    (unsigned long long)e->begin, (unsigned long long)e->end);
        prev = e;
    }
    return ANNEAL_OK;
}

/* Maps path, checks the framing, parses and validates the header. */
anneal_status anneal_safetensors_open(const char *path, anneal_safetensors **out) {
    if (!out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_safetensors_open: out is NULL");
    *out = NULL;
    if (!path) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_safetensors_open: path is NULL");

    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: not a regular file", path);
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < 8) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: %llu bytes is too short for a safetensors file (needs >= 8)",
                                path, (unsigned long long)size);
    }
    if (size > (uint64_t)SIZE_MAX) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: file too large to map", path);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: mmap failed: %s", path, strerror(map_errno));

    st_impl *impl = calloc(1, sizeof *impl);
    char *header = NULL;
    cJSON *root = NULL;
    anneal_status s = ANNEAL_OK;
    if (!impl) {
        munmap(map, (size_t)size);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    anneal_safetensors *st = &impl->pub;
    st->map = map;
    st->map_size = (size_t)size;
    st->path = dup_str(path);
    if (!st->path) {
        s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
        goto fail;
    }

    uint64_t hlen;
    memcpy(&hlen, map, 8);
    if (hlen > ST_MAX_HEADER) {
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: header length %llu is absurd (max %llu)", path,
                             (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
        goto fail;
    }
    if (hlen > size - 8) {
        s = anneal_set_error(ANNEAL_ERR_FORMAT,
                             "%s: header length %llu exceeds the file (%llu bytes; truncated?)",
                             path, (unsigned long long)hlen, (unsigned long long)size);
        goto fail;
    }
    st->data = (const uint8_t *)map + 8 + hlen;
    st->data_size = size - 8 - hlen;

    /* cJSON needs a NUL-terminated string; an embedded NUL would hide trailing bytes. */
    const char *hsrc = (const char *)map + 8;
    if (memchr(hsrc, '\0', (size_t)hlen)) {
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: header contains a NUL byte", path);
        goto fail;
    }
    header = malloc((size_t)hlen + 1);
    if (!header) {
        s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory for a %llu-byte header", path,
                             (unsigned long long)hlen);
        goto fail;
    }
    memcpy(header, hsrc, (size_t)hlen);
    header[hlen] = '\0';
    const char *end = NULL;
    root = cJSON_ParseWithOpts(header, &end, 1);
    if (!root) {
        size_t at = end && end >= header && end <= header + hlen ? (size_t)(end - header) : 0;
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: header is not valid JSON (near byte %zu)",
                             path, at);
        goto fail;
    }
    s = parse_header(path, root, impl);
    if (s != ANNEAL_OK) goto fail;
    cJSON_Delete(root);
    free(header);
    *out = st;
    return ANNEAL_OK;

fail:
    cJSON_Delete(root);
    free(header);
    anneal_safetensors_close(st);
    return s;
}

/* Binary search of the name index. */
const anneal_st_entry *anneal_safetensors_find(const anneal_safetensors *st, const char *name) {
    if (!st || !name) return NULL;
    const st_impl *impl = (const st_impl *)st;
    int lo = 0, hi = st->n_entries - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        const anneal_st_entry *e = &st->entries[impl->by_name[mid]];
        int c = strcmp(name, e->name);
        if (c == 0) return e;
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

/* Bytes of e inside the mapping (possibly unaligned: copy with memcpy). */
const void *anneal_safetensors_data(const anneal_safetensors *st, const anneal_st_entry *e) {
    if (!st || !e) return NULL;
    return st->data + e->begin;
}

/* Linear search of the (small) metadata map. */
const char *anneal_safetensors_meta(const anneal_safetensors *st, const char *key) {
    if (!st || !key) return NULL;
    for (int i = 0; i < st->n_metadata; i++)
        if (strcmp(st->metadata_keys[i], key) == 0) return st->metadata_values[i];
    return NULL;
}

/* Frees everything open() allocated, including on its failure paths. */
void anneal_safetensors_close(anneal_safetensors *st) {
    if (!st) return;
    st_impl *impl = (st_impl *)st;
    if (st->map) munmap(st->map, st->map_size);
    for (int i = 0; i < st->n_entries; i++) free(st->entries[i].name);
    free(st->entries);
    for (int i = 0; i < st->n_metadata; i++) {
        free(st->metadata_keys[i]);
        free(st->metadata_values[i]);
    }
    free(st->metadata_keys);
    free(st->metadata_values);
    free(st->path);
    free(impl->by_name);
    free(impl);
}

/* One element of a float dtype at p (unaligned) as f32. */
static float load_float(anneal_dtype dt, const uint8_t *p) {
    if (dt == ANNEAL_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return dt == ANNEAL_BF16 ? anneal_bf16_to_f32(h) : anneal_f16_to_f32(h);
}

/* Stores f as float dtype dt at p. */
static void store_float(anneal_dtype dt, uint8_t *p, float f) {
    if (dt == ANNEAL_F32) {
        memcpy(p, &f, 4);
        return;
    }
    uint16_t h = dt == ANNEAL_BF16 ? anneal_f32_to_bf16(f) : anneal_f32_to_f16(f);
    memcpy(p, &h, 2);
}

/* Gives back the pages of the mapping that lie wholly inside e's bytes, once they have
 * been copied out: a model loaded tensor by tensor then never holds the file's pages and
 * its own copy of them at once (the mapping is private and read-only, so the kernel
 * reads a page again from the file should anything touch it later). */
static void drop_pages(const anneal_safetensors *st, const anneal_st_entry *e) {
    long ps = sysconf(_SC_PAGESIZE);
    if (ps <= 0) return;
    uintptr_t lo = (uintptr_t)(st->data + e->begin), hi = (uintptr_t)(st->data + e->end);
    uintptr_t a = (lo + (uintptr_t)ps - 1) & ~((uintptr_t)ps - 1), b = hi & ~((uintptr_t)ps - 1);
    if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED);
}

/* New CPU tensor with entry `name`'s data, converted between float dtypes if asked. */
anneal_tensor *anneal_safetensors_load(const anneal_safetensors *st, const char *name,
                                       anneal_dtype want) {
    if (!st || !name) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_safetensors_load: NULL file or name");
        return NULL;
    }
    if ((int)want < 0 || want >= ANNEAL_DTYPE_COUNT) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: load of '%s': invalid dtype %d", st->path, name,
                         (int)want);
        return NULL;
    }
    const anneal_st_entry *e = anneal_safetensors_find(st, name);
    if (!e) {
        anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no tensor named '%s'", st->path, name);
        return NULL;
    }
    if (e->dtype != want && !(anneal_dtype_is_float(e->dtype) && anneal_dtype_is_float(want))) {
        anneal_set_error(ANNEAL_ERR_DTYPE, "%s: tensor '%s' is %s and cannot be loaded as %s",
                         st->path, name, anneal_dtype_name(e->dtype), anneal_dtype_name(want));
        return NULL;
    }
    /* Host memory: the bytes are copied with memcpy (the mapping may be unaligned). */
    anneal_tensor *t = anneal_empty_on(ANNEAL_CPU, want, e->ndim, e->shape);
    if (!t) return NULL;
    const uint8_t *src = anneal_safetensors_data(st, e);
    uint8_t *dst = anneal_data(t);
    if (e->dtype == want) {
        if (e->end > e->begin) memcpy(dst, src, (size_t)(e->end - e->begin));
    } else {
        size_t si = anneal_dtype_size(e->dtype), di = anneal_dtype_size(want);
        uint64_t n = (e->end - e->begin) / si;
        for (uint64_t i = 0; i < n; i++) store_float(want, dst + i * di, load_float(e->dtype, src + i * si));
    }
    drop_pages(st, e);
    return t;
}
