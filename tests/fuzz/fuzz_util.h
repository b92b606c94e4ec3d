/* Shared helpers of the fuzz harnesses (tests/fuzz/fuzz_*.c, issue 16). Most of
 * anneal's parsers read files, so a harness writes its input into a private scratch
 * directory (under /dev/shm when there is one: no disk traffic) and calls the public
 * API on the path. Inputs that stand for several files are split at FUZZ_SEP.
 * Everything here is static: each harness is its own program. */
#ifndef ANNEAL_FUZZ_UTIL_H
#define ANNEAL_FUZZ_UTIL_H

#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "anneal/core.h"

/* Separates the files of a multi-file input. */
#define FUZZ_SEP "\n-----\n"

static char fuzz_root_[256];

/* Removes the scratch tree (not recursive beyond two levels: harnesses keep it flat). */
static inline void fuzz_rm_tree_(const char *dir, int depth) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        char p[1024];
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            struct stat sb;
            if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode) && depth < 4) fuzz_rm_tree_(p, depth + 1);
            else unlink(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

static inline void fuzz_cleanup_(void) {
    if (fuzz_root_[0]) fuzz_rm_tree_(fuzz_root_, 0);
}

/* The harness's scratch directory (made on the first call, removed at exit). */
static inline const char *fuzz_dir(void) {
    if (!fuzz_root_[0]) {
        struct stat sb;
        const char *base = stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0
                               ? "/dev/shm"
                               : "/tmp";
        snprintf(fuzz_root_, sizeof fuzz_root_, "%s/anneal_fuzz_XXXXXX", base);
        if (!mkdtemp(fuzz_root_)) abort();
        atexit(fuzz_cleanup_);
    }
    return fuzz_root_;
}

/* dir/name in a rotating static buffer. */
static inline const char *fuzz_path(const char *name) {
    static char bufs[8][1024];
    static int next;
    char *b = bufs[next++ & 7];
    if ((size_t)snprintf(b, sizeof bufs[0], "%s/%s", fuzz_dir(), name) >= sizeof bufs[0]) abort();
    return b;
}

/* Writes data to scratch/name (replacing it); returns the path. Aborts on an I/O
 * failure of the scratch directory itself (not a finding of the parser). */
static inline const char *fuzz_write(const char *name, const void *data, size_t size) {
    const char *p = fuzz_path(name);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) abort();
    const char *c = data;
    while (size > 0) {
        ssize_t w = write(fd, c, size);
        if (w <= 0) abort();
        c += w, size -= (size_t)w;
    }
    close(fd);
    return p;
}

/* Removes scratch/name if it is there. */
static inline void fuzz_unlink(const char *name) { unlink(fuzz_path(name)); }

/* Splits data at FUZZ_SEP into at most max parts (the last takes the rest); returns
 * the count. Parts point into data. */
static inline int fuzz_split(const uint8_t *data, size_t size, const uint8_t **part, size_t *len, int max) {
    size_t sl = strlen(FUZZ_SEP);
    int n = 0;
    const uint8_t *p = data, *end = data + size;
    while (n < max - 1) {
        const uint8_t *q = (size_t)(end - p) >= sl ? memmem(p, (size_t)(end - p), FUZZ_SEP, sl) : NULL;
        if (!q) break;
        part[n] = p, len[n] = (size_t)(q - p), n++;
        p = q + sl;
    }
    part[n] = p, len[n] = (size_t)(end - p), n++;
    return n;
}

/* A NUL-terminated copy of data (malloc'd). */
static inline char *fuzz_cstr(const uint8_t *data, size_t size) {
    char *s = malloc(size + 1);
    if (!s) abort();
    memcpy(s, data, size);
    s[size] = 0;
    return s;
}

#endif
