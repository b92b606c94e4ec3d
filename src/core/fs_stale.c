/* Leftovers of interrupted atomic writes: "<base>.tmp.<pid>" files (anneal_atomic_open's
 * temporaries) whose writer is gone. A temporary belongs to a dead writer when no
 * process has its pid (kill(pid, 0) fails with ESRCH); a live process with that pid,
 * ours or another user's (EPERM), keeps its file, so a concurrent writer is never
 * robbed and a reused pid only delays the cleanup to a later run. */
#include "anneal/fs.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

bool anneal_tmp_name_parse(const char *name, size_t *base_len, long *pid) {
    const char *t = NULL;
    for (const char *p = strstr(name, ".tmp."); p; p = strstr(p + 1, ".tmp.")) t = p; /* the last one */
    if (!t || t == name) return false;
    const char *d = t + 5;
    size_t nd = strspn(d, "0123456789");
    if (nd == 0 || nd > 9 || d[nd] != '\0' || d[0] == '0') return false;
    long v = 0;
    for (size_t i = 0; i < nd; i++) v = v * 10 + (d[i] - '0');
    if (v <= 0 || v > INT_MAX) return false;
    *base_len = (size_t)(t - name);
    *pid = v;
    return true;
}

bool anneal_pid_is_dead(long pid) {
    if (pid <= 0 || pid == (long)getpid()) return false;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

int anneal_remove_stale_tmp_files(const char *dir, bool (*ours)(const char *base, size_t base_len)) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t bl;
        long pid;
        if (!anneal_tmp_name_parse(e->d_name, &bl, &pid) || !ours(e->d_name, bl) || !anneal_pid_is_dead(pid)) continue;
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
        struct stat sb;
        if (lstat(path, &sb) == 0 && S_ISREG(sb.st_mode) && unlink(path) == 0) removed++;
    }
    closedir(d);
    return removed;
}
