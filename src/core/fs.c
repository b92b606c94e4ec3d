/* Complete writes and atomic file replacement (temp + fsync + rename + dir fsync). */
#include "anneal/fs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Duplicates s, or NULL when out of memory. */
static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Writes everything, looping over short writes and EINTR. */
anneal_status anneal_write_all(int fd, const void *buf, size_t n, const char *what) {
    const char *p = buf;
    while (n > 0) {
        /* Chunks of at most 1 GiB: Linux caps a single write near 2 GiB anyway. */
        size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
        ssize_t w = write(fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return anneal_set_error(ANNEAL_ERR_IO, "%s: write failed: %s", what, strerror(errno));
        }
        if (w == 0)
            return anneal_set_error(ANNEAL_ERR_IO, "%s: write made no progress", what);
        p += w;
        n -= (size_t)w;
    }
    return ANNEAL_OK;
}

/* Opens "<path>.tmp.<pid>" for writing; fills af. */
anneal_status anneal_atomic_open(anneal_atomic_file *af, const char *path) {
    af->fd = -1;
    af->path = NULL;
    af->tmp_path = NULL;
    if (!path || !*path) return anneal_set_error(ANNEAL_ERR_ARG, "atomic write: empty path");
    size_t n = strlen(path) + 32;
    af->path = dup_str(path);
    af->tmp_path = malloc(n);
    if (!af->path || !af->tmp_path) {
        free(af->path); /* not abort(): tmp_path holds no name yet */
        free(af->tmp_path);
        af->path = af->tmp_path = NULL;
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    snprintf(af->tmp_path, n, "%s.tmp.%ld", path, (long)getpid());
    do {
        af->fd = open(af->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    } while (af->fd < 0 && errno == EINTR);
    if (af->fd < 0) {
        int e = errno;
        free(af->path);
        free(af->tmp_path);
        af->path = af->tmp_path = NULL;
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create temporary file: %s", path,
                                strerror(e));
    }
    return ANNEAL_OK;
}

/* Appends to the temporary. */
anneal_status anneal_atomic_write(anneal_atomic_file *af, const void *buf, size_t n) {
    if (af->fd < 0) return anneal_set_error(ANNEAL_ERR_STATE, "atomic write: file not open");
    return anneal_write_all(af->fd, buf, n, af->path);
}

/* Closes and unlinks the temporary, frees the names. */
void anneal_atomic_abort(anneal_atomic_file *af) {
    if (!af) return;
    if (af->fd >= 0) close(af->fd);
    af->fd = -1;
    if (af->tmp_path) unlink(af->tmp_path);
    free(af->tmp_path);
    free(af->path);
    af->tmp_path = af->path = NULL;
}

/* fsync of the containing directory; EINVAL (unsupported) is not an error. */
anneal_status anneal_fsync_parent_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash) {
        dir = dup_str(".");
    } else if (slash == path) {
        dir = dup_str("/");
    } else {
        size_t n = (size_t)(slash - path);
        dir = malloc(n + 1);
        if (dir) {
            memcpy(dir, path, n);
            dir[n] = '\0';
        }
    }
    if (!dir) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        free(dir);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open directory to fsync: %s", path,
                                strerror(e));
    }
    anneal_status st = ANNEAL_OK;
    if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS)
        st = anneal_set_error(ANNEAL_ERR_IO, "%s: fsync of directory %s failed: %s", path, dir,
                              strerror(errno));
    close(fd);
    free(dir);
    return st;
}

/* fsync + close + rename + dir fsync; removes the temporary on any failure before rename. */
anneal_status anneal_atomic_commit(anneal_atomic_file *af) {
    if (af->fd < 0) {
        anneal_atomic_abort(af);
        return anneal_set_error(ANNEAL_ERR_STATE, "atomic write: file not open");
    }
    if (fsync(af->fd) != 0) {
        anneal_status st = anneal_set_error(ANNEAL_ERR_IO, "%s: fsync failed: %s", af->path,
                                            strerror(errno));
        anneal_atomic_abort(af);
        return st;
    }
    int rc = close(af->fd);
    af->fd = -1;
    if (rc != 0) {
        anneal_status st = anneal_set_error(ANNEAL_ERR_IO, "%s: close failed: %s", af->path,
                                            strerror(errno));
        anneal_atomic_abort(af);
        return st;
    }
    if (rename(af->tmp_path, af->path) != 0) {
        anneal_status st = anneal_set_error(ANNEAL_ERR_IO, "%s: rename from %s failed: %s",
                                            af->path, af->tmp_path, strerror(errno));
        anneal_atomic_abort(af);
        return st;
    }
    /* The temporary is now the destination: do not unlink it on the way out. */
    free(af->tmp_path);
    af->tmp_path = NULL;
    anneal_status st = anneal_fsync_parent_dir(af->path);
    anneal_atomic_abort(af);
    return st;
}

/* One-shot atomic write of a buffer. */
anneal_status anneal_write_file_atomic(const char *path, const void *data, size_t n) {
    anneal_atomic_file af;
    anneal_status st = anneal_atomic_open(&af, path);
    if (st != ANNEAL_OK) return st;
    st = anneal_atomic_write(&af, data, n);
    if (st != ANNEAL_OK) {
        anneal_atomic_abort(&af);
        return st;
    }
    return anneal_atomic_commit(&af);
}
