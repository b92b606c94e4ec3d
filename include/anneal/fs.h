/* File-system helpers of core (the data and io layers write their files through
 * them): complete writes that survive EINTR and short writes, and atomic replacement
 * of a file (write "<path>.tmp.<pid>", fsync, rename over <path>, fsync the
 * directory) so that a crash or an error leaves either the old file or the new one,
 * never a torn mix. Every failure is recorded with
 * anneal_set_error(ANNEAL_ERR_IO, "<path>: ...") and returned. */
#ifndef ANNEAL_FS_H
#define ANNEAL_FS_H

#include <stdbool.h>
#include <stddef.h>

#include "anneal/core.h"

/* An atomic write in progress. Zero-initialise or fill with anneal_atomic_open. */
typedef struct anneal_atomic_file {
    int fd;          /* open descriptor of the temporary, -1 when closed */
    char *path;      /* final destination (owned copy) */
    char *tmp_path;  /* "<path>.tmp.<pid>" (owned) */
} anneal_atomic_file;

/* Writes all n bytes of buf to fd, retrying on EINTR and short writes.
 * `what` names the file in the error message. */
anneal_status anneal_write_all(int fd, const void *buf, size_t n, const char *what);

/* Creates (truncating) the temporary "<path>.tmp.<pid>" for an atomic write of path.
 * On failure nothing is left behind and af is safe to abort. */
anneal_status anneal_atomic_open(anneal_atomic_file *af, const char *path);
/* Appends n bytes to the temporary. On failure the caller must still call
 * anneal_atomic_abort (which removes the temporary). */
anneal_status anneal_atomic_write(anneal_atomic_file *af, const void *buf, size_t n);
/* fsyncs and closes the temporary, renames it over the destination and fsyncs the
 * directory. On failure before the rename the temporary is removed and the old
 * destination is untouched. Always releases af's resources. */
anneal_status anneal_atomic_commit(anneal_atomic_file *af);
/* Closes and removes the temporary and frees af's resources (idempotent). */
void anneal_atomic_abort(anneal_atomic_file *af);

/* Atomically replaces path with the n bytes at data (open + write + commit). */
anneal_status anneal_write_file_atomic(const char *path, const void *data, size_t n);
/* fsyncs the directory that contains path (so a rename into it is durable).
 * File systems that cannot fsync a directory (EINVAL) count as success. */
anneal_status anneal_fsync_parent_dir(const char *path);

/* Leftovers of interrupted atomic writes (src/core/fs_stale.c). */
/* True when name is "<base>.tmp.<pid>" (pid: 1-9 decimal digits, no leading zero):
 * *base_len is the length of <base>. */
bool anneal_tmp_name_parse(const char *name, size_t *base_len, long *pid);
/* True when no process has this pid (kill(pid, 0) fails with ESRCH); false for our own
 * pid and for a live process of another user. */
bool anneal_pid_is_dead(long pid);
/* Removes the regular files "<base>.tmp.<pid>" in dir whose <base> ours() accepts and
 * whose pid is dead (a live pid keeps its file: a concurrent writer, or a reused pid
 * whose file a later run removes). Returns how many were removed. */
int anneal_remove_stale_tmp_files(const char *dir, bool (*ours)(const char *base, size_t base_len));

#endif
