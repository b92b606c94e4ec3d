/* Threads for CPU kernels (OpenMP): the thread count and pinning each worker to one
 * CPU. (The guard that keeps one-thread parallel regions from allocating is opt-in:
 * src/core/omp_fastpath.c.) */
#include "anneal/core.h"

#include <omp.h>
#include <sched.h>
#include <stdio.h>

void anneal_set_num_threads(int n) {
    if (n <= 0) n = omp_get_num_procs();
    omp_set_num_threads(n);
}

int anneal_get_num_threads(void) { return omp_get_max_threads(); }

/* Pins OpenMP worker k (of the full team) to the k-th CPU of the process's allowed
 * set (sched_getaffinity), so the OS does not migrate workers between cores and
 * each keeps its caches. With more workers than allowed CPUs the CPUs are reused
 * round-robin. Runs one parallel region: each worker pins itself (pinning is per
 * thread and libgomp keeps its workers for later regions). Writes the CPU list,
 * e.g. "0,1", into desc when given. */
anneal_status anneal_set_thread_pinning(bool on, char *desc, size_t desc_len) {
    static cpu_set_t allowed; /* the process's set, read before the first pinning */
    static bool have_allowed;
    if (desc && desc_len) desc[0] = '\0';
    if (!have_allowed) {
        if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "thread pinning: sched_getaffinity failed");
        have_allowed = true;
    }
    int cpus[CPU_SETSIZE], ncpu = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed)) cpus[ncpu++] = c;
    if (ncpu == 0) return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "thread pinning: no allowed CPU");
    int failures = 0, nt = omp_get_max_threads();
#pragma omp parallel num_threads(nt) reduction(+ : failures)
    {
        cpu_set_t one;
        if (on) {
            CPU_ZERO(&one);
            CPU_SET(cpus[omp_get_thread_num() % ncpu], &one);
        } else {
            one = allowed; /* back to the whole allowed set */
        }
        if (sched_setaffinity(0, sizeof one, &one) != 0) failures++;
    }
    if (failures) return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "thread pinning: sched_setaffinity failed for %d "
                                          "of %d threads", failures, nt);
    if (desc && desc_len) {
        size_t used = 0;
        for (int k = 0; k < (on ? nt : 0) && used + 1 < desc_len; k++) {
            int w = snprintf(desc + used, desc_len - used, k ? ",%d" : "%d", cpus[k % ncpu]);
            if (w < 0) break;
            used += (size_t)w;
        }
        if (!on) snprintf(desc, desc_len, "off");
    }
    return ANNEAL_OK;
}
