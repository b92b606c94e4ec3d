/* Fault injection by LD_PRELOAD (issue 16): makes the Nth file operation of a process
 * fail with a chosen errno, so a test can sweep every N of a checkpoint write or a
 * `prepare` and check that each ends with a clear error and leaves nothing half-written
 * that a reader would take as complete. A shim rather than a hook in the fs layer
 * (anneal/fs.h): it sees every write of the process, also one that does not go
 * through the fs helpers, and the library carries no test code.
 *
 * Counted: open/openat/creat (only for writing), write/pwrite, fsync/fdatasync,
 * rename/renameat, mkdir, ftruncate; on paths containing ANNEAL_FAULT_PATH (a
 * substring; unset: every path) and not ANNEAL_FAULT_SKIP, and on the descriptors
 * opened for such paths. Counting starts at the first counted path that contains
 * ANNEAL_FAULT_ARM (unset: at once).
 *   ANNEAL_FAULT_AT=N     fail the Nth counted operation (0 or unset: only count)
 *   ANNEAL_FAULT_ERRNO    ENOSPC (default), EIO, EACCES, ENOMEM, EROFS
 *   ANNEAL_FAULT_STICKY=1 every counted operation from the Nth on fails (a disk that
 *                         stays full)
 *   ANNEAL_FAULT_REPORT   file that gets "<count> <failed op or ->" at exit
 *   ANNEAL_FAULT_TRACE=1  each counted operation on stderr
 * Built without sanitizers as a shared object (a sanitized program runs it with
 * ASAN_OPTIONS=verify_asan_link_order=0). Compiled again with FAULT_MALLOC
 * (libanneal_fault_malloc.so, for programs without a sanitizer's allocator), malloc,
 * calloc and realloc of every thread count too once armed (ENOMEM, NULL).
 * Test code: names need no anneal_ prefix. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <pthread.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_FD 65536

static atomic_long counted;
static atomic_int armed = -1;
static long fail_at = -1;
static int fail_errno = ENOSPC, sticky, trace;
static const char *want_path, *skip_path, *arm_path;
static unsigned char tracked[MAX_FD];
static char failed_op[64] = "-";
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void report(void) {
    const char *p = getenv("ANNEAL_FAULT_REPORT");
    if (!p) return;
    int (*real_open)(const char *, int, ...) = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open");
    ssize_t (*real_write)(int, const void *, size_t) = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    int fd = real_open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    char b[128];
    int n = snprintf(b, sizeof b, "%ld %s\n", atomic_load(&counted), failed_op);
    if (real_write(fd, b, (size_t)n) < 0) {
    }
    close(fd);
}

static void init(void) {
    const char *v = getenv("ANNEAL_FAULT_AT");
    fail_at = v && atol(v) > 0 ? atol(v) : -1;
    want_path = getenv("ANNEAL_FAULT_PATH");
    skip_path = getenv("ANNEAL_FAULT_SKIP");
    arm_path = getenv("ANNEAL_FAULT_ARM");
    sticky = getenv("ANNEAL_FAULT_STICKY") && atoi(getenv("ANNEAL_FAULT_STICKY"));
    trace = getenv("ANNEAL_FAULT_TRACE") && atoi(getenv("ANNEAL_FAULT_TRACE"));
    const char *e = getenv("ANNEAL_FAULT_ERRNO");
    if (e && !strcmp(e, "EIO")) fail_errno = EIO;
    else if (e && !strcmp(e, "EACCES")) fail_errno = EACCES;
    else if (e && !strcmp(e, "ENOMEM")) fail_errno = ENOMEM;
    else if (e && !strcmp(e, "EROFS")) fail_errno = EROFS;
    atomic_store(&armed, arm_path && *arm_path ? 0 : 1);
    atexit(report);
}

#define INIT() pthread_once(&once, init)

static int path_counted(const char *p) {
    if (!p) return 0;
    if (want_path && *want_path && !strstr(p, want_path)) return 0;
    if (skip_path && *skip_path && strstr(p, skip_path)) return 0;
    if (atomic_load(&armed) == 0 && strstr(p, arm_path)) atomic_store(&armed, 1);
    return atomic_load(&armed) == 1;
}

/* Counts one operation; true when it is the one to fail. */
static int hit(const char *op, const char *what) {
    long n = atomic_fetch_add(&counted, 1) + 1;
    int fail = fail_at > 0 && (n == fail_at || (sticky && n > fail_at));
    if (trace) fprintf(stderr, "[fault] %ld %s %s%s\n", n, op, what ? what : "", fail ? " FAILS" : "");
    if (fail && n == fail_at) snprintf(failed_op, sizeof failed_op, "%s", op);
    return fail;
}

static int fd_counted(int fd) { return fd >= 0 && fd < MAX_FD && tracked[fd] && atomic_load(&armed) == 1; }

#define REAL(ret, name, ...) static ret (*real)(__VA_ARGS__); if (!real) real = (ret(*)(__VA_ARGS__))dlsym(RTLD_NEXT, name)

static int open_common(const char *name, int dirfd, const char *path, int flags, mode_t mode, int at) {
    INIT();
    int writing = (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC)) != 0 || (flags & O_DIRECTORY);
    int c = path_counted(path);
    if (c && writing && hit(name, path)) {
        errno = fail_errno;
        return -1;
    }
    int fd;
    if (at) {
        REAL(int, "openat", int, const char *, int, ...);
        fd = real(dirfd, path, flags, mode);
    } else {
        REAL(int, "open", const char *, int, ...);
        fd = real(path, flags, mode);
    }
    if (fd >= 0 && fd < MAX_FD) tracked[fd] = (unsigned char)(c != 0 || (want_path && path && strstr(path, want_path) &&
                                                                         !(skip_path && *skip_path && strstr(path, skip_path))));
    return fd;
}

int open(const char *path, int flags, ...) {
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    return open_common("open", AT_FDCWD, path, flags, mode, 0);
}
int open64(const char *path, int flags, ...) __attribute__((alias("open")));
int openat(int dirfd, const char *path, int flags, ...) {
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    return open_common("openat", dirfd, path, flags, mode, 1);
}
int openat64(int dirfd, const char *path, int flags, ...) __attribute__((alias("openat")));
int creat(const char *path, mode_t mode) { return open(path, O_WRONLY | O_CREAT | O_TRUNC, mode); }

int close(int fd) {
    REAL(int, "close", int);
    if (fd >= 0 && fd < MAX_FD) tracked[fd] = 0;
    return real(fd);
}

ssize_t write(int fd, const void *buf, size_t n) {
    INIT();
    REAL(ssize_t, "write", int, const void *, size_t);
    if (fd_counted(fd) && hit("write", NULL)) {
        errno = fail_errno;
        return -1;
    }
    return real(fd, buf, n);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    INIT();
    REAL(ssize_t, "pwrite", int, const void *, size_t, off_t);
    if (fd_counted(fd) && hit("pwrite", NULL)) {
        errno = fail_errno;
        return -1;
    }
    return real(fd, buf, n, off);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) __attribute__((alias("pwrite")));

int fsync(int fd) {
    INIT();
    REAL(int, "fsync", int);
    if (fd_counted(fd) && hit("fsync", NULL)) {
        errno = fail_errno == ENOSPC ? EIO : fail_errno;
        return -1;
    }
    return real(fd);
}

int fdatasync(int fd) {
    INIT();
    REAL(int, "fdatasync", int);
    if (fd_counted(fd) && hit("fdatasync", NULL)) {
        errno = fail_errno == ENOSPC ? EIO : fail_errno;
        return -1;
    }
    return real(fd);
}

int ftruncate(int fd, off_t len) {
    INIT();
    REAL(int, "ftruncate", int, off_t);
    if (fd_counted(fd) && hit("ftruncate", NULL)) {
        errno = fail_errno;
        return -1;
    }
    return real(fd, len);
}

int rename(const char *a, const char *b) {
    INIT();
    REAL(int, "rename", const char *, const char *);
    if ((path_counted(a) || path_counted(b)) && hit("rename", b)) {
        errno = fail_errno;
        return -1;
    }
    return real(a, b);
}

int renameat(int da, const char *a, int db, const char *b) {
    INIT();
    REAL(int, "renameat", int, const char *, int, const char *);
    if ((path_counted(a) || path_counted(b)) && hit("renameat", b)) {
        errno = fail_errno;
        return -1;
    }
    return real(da, a, db, b);
}

int mkdir(const char *p, mode_t mode) {
    INIT();
    REAL(int, "mkdir", const char *, mode_t);
    if (path_counted(p) && hit("mkdir", p)) {
        errno = fail_errno;
        return -1;
    }
    return real(p, mode);
}

#ifdef FAULT_MALLOC
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static __thread int in_hook; /* the hook's own allocations (stdio of the trace) pass */

/* True when this allocation is the one to fail. */
static int malloc_fails(void) {
    if (in_hook || atomic_load(&armed) != 1) return 0;
    in_hook = 1;
    int f = hit("malloc", NULL);
    in_hook = 0;
    return f;
}

void *malloc(size_t n) {
    if (malloc_fails()) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_malloc(n);
}

void *calloc(size_t a, size_t b) {
    if (malloc_fails()) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_calloc(a, b);
}

void *realloc(void *p, size_t n) {
    if (malloc_fails()) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_realloc(p, n);
}
#endif
