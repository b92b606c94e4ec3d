/* JSON-lines log files: append-only, one write(2) per record (see obs.h). */
#include "anneal/obs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct anneal_jsonl {
    int fd;
    char *path;
};

anneal_status anneal_jsonl_open(const char *path, anneal_jsonl **out) {
    *out = NULL;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open for appending: %s", path, strerror(errno));
    anneal_jsonl *l = calloc(1, sizeof *l);
    char *p = strdup(path);
    if (!l || !p) {
        close(fd);
        free(l);
        free(p);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    l->fd = fd;
    l->path = p;
    *out = l;
    return ANNEAL_OK;
}

anneal_status anneal_jsonl_write(anneal_jsonl *l, const char *json) {
    if (!l || !json) return anneal_set_error(ANNEAL_ERR_ARG, "jsonl: NULL log or record");
    size_t n = strlen(json);
    char *line = malloc(n + 1);
    if (!line) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", l->path);
    memcpy(line, json, n);
    line[n] = '\n';
    /* one write for the whole line: O_APPEND places it atomically at the end */
    size_t done = 0;
    anneal_status st = ANNEAL_OK;
    while (done < n + 1) {
        ssize_t w = write(l->fd, line + done, n + 1 - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            st = anneal_set_error(ANNEAL_ERR_IO, "%s: write failed: %s", l->path, w < 0 ? strerror(errno) : "no progress");
            break;
        }
        done += (size_t)w;
    }
    free(line);
    return st;
}

void anneal_jsonl_close(anneal_jsonl *l) {
    if (!l) return;
    fsync(l->fd);
    close(l->fd);
    free(l->path);
    free(l);
}
