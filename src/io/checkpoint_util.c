/* Small helpers for checkpoints: directory names, whole-file reads, FNV-1a 64 of a
 * file, recursive removal, and JSON numbers that survive cJSON's doubles exactly. */
#include "io/checkpoint_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull
#define EXACT_INT_MAX 9007199254740992.0 /* 2^53: every integer up to it is a double */

void anneal_ckpt_dir_name(int64_t step, char *buf, size_t n) {
    snprintf(buf, n, "ckpt_%08lld", (long long)step);
}

/* "ckpt_" followed by 1..18 digits only. */
int64_t anneal_ckpt_parse_dir_name(const char *name) {
    if (strncmp(name, "ckpt_", 5) != 0) return -1;
    const char *p = name + 5;
    size_t n = strlen(p);
    if (n == 0 || n > 18) return -1;
    int64_t v = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

/* read() loop into a buffer grown to the file's size (files may change under us, so
 * the size is only a hint). */
anneal_status anneal_ckpt_read_file(const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    int fd;
    do fd = open(path, O_RDONLY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: not a regular file", path);
    }
    if ((uint64_t)sb.st_size > max_bytes) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: file too large (%lld bytes, limit %zu)", path,
                                (long long)sb.st_size, max_bytes);
    }
    size_t cap = (size_t)sb.st_size + 1, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    for (;;) {
        if (n == cap) {
            if (cap > max_bytes) {
                free(buf);
                close(fd);
                return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: file too large (limit %zu)", path, max_bytes);
            }
            char *nb = realloc(buf, 2 * cap + 1);
            if (!nb) {
                free(buf);
                close(fd);
                return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
            }
            buf = nb;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            free(buf);
            close(fd);
            return anneal_set_error(ANNEAL_ERR_IO, "%s: read failed: %s", path, strerror(e));
        }
        if (r == 0) break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    *out = buf;
    if (len) *len = n;
    return ANNEAL_OK;
}

/* Reads the file in 4 MiB chunks; FNV-1a over every byte (a serial chain, about a
 * byte per few cycles: ~1.5 s for a 124M model's weights plus moments). */
anneal_status anneal_ckpt_hash_file(const char *path, uint64_t *bytes, uint64_t *fnv) {
    int fd;
    do fd = open(path, O_RDONLY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    enum { CHUNK = 4 << 20 };
    unsigned char *buf = malloc(CHUNK);
    if (!buf) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    uint64_t h = FNV_OFFSET, total = 0;
    anneal_status s = ANNEAL_OK;
    for (;;) {
        ssize_t r = read(fd, buf, CHUNK);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            s = anneal_set_error(ANNEAL_ERR_IO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
        if (r == 0) break;
        for (ssize_t i = 0; i < r; i++) h = (h ^ buf[i]) * FNV_PRIME;
        total += (uint64_t)r;
    }
    free(buf);
    close(fd);
    if (s == ANNEAL_OK) {
        *bytes = total;
        *fnv = h;
    }
    return s;
}

/* nftw callback: remove each entry after its children (FTW_DEPTH). */
static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    remove(path);
    return 0;
}

bool anneal_ckpt_remove_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return errno == ENOENT;
    if (S_ISDIR(sb.st_mode)) nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    else unlink(path);
    return lstat(path, &sb) != 0 && errno == ENOENT;
}

cJSON *anneal_ckpt_json_u64(uint64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRIu64, v);
    return v <= (uint64_t)1 << 53 ? cJSON_CreateRaw(buf) : cJSON_CreateString(buf);
}

/* A non-negative integral number <= 2^53, or a string of decimal digits <= UINT64_MAX. */
bool anneal_ckpt_json_get_u64(const cJSON *item, uint64_t *out) {
    if (cJSON_IsNumber(item)) {
        double d = item->valuedouble;
        if (!(d >= 0 && d <= EXACT_INT_MAX) || d != (double)(uint64_t)d) return false;
        *out = (uint64_t)d;
        return true;
    }
    if (cJSON_IsString(item) && item->valuestring[0]) {
        uint64_t v = 0;
        for (const char *p = item->valuestring; *p; p++) {
            if (*p < '0' || *p > '9') return false;
            unsigned dgt = (unsigned)(*p - '0');
            if (v > (UINT64_MAX - dgt) / 10) return false;
            v = v * 10 + dgt;
        }
        *out = v;
        return true;
    }
    return false;
}

void anneal_ckpt_fmt_float(char *buf, size_t n, float v) {
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, n, "%.*g", p, (double)v);
        if ((float)strtod(buf, NULL) == v) return;
    }
}

cJSON *anneal_ckpt_json_float(float v) {
    if (!(v == v) || v - v != 0) return cJSON_CreateNull(); /* NaN / inf: not JSON */
    char buf[32];
    anneal_ckpt_fmt_float(buf, sizeof buf, v);
    return cJSON_CreateRaw(buf);
}

cJSON *anneal_ckpt_json_double(double v) {
    if (!(v == v) || v - v != 0) return cJSON_CreateNull();
    char buf[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, v);
        if (strtod(buf, NULL) == v) break;
    }
    return cJSON_CreateRaw(buf);
}
