/* The parallel fraction of a run (Amdahl's p) from its wall time and its process CPU
 * time: issue 17's "no serial sections in a step". */
#include "anneal/obs.h"

#include <time.h>

double anneal_parallel_fraction(double wall, double cpu, int threads) {
    if (threads < 2 || !(wall > 0) || !(cpu > 0)) return -1.0;
    /* wall = (1 - p) cpu + p cpu / T  =>  p = (1 - wall / cpu) / (1 - 1 / T) */
    const double p = (1.0 - wall / cpu) / (1.0 - 1.0 / (double)threads);
    return p < 0.0 ? 0.0 : p > 1.0 ? 1.0 : p;
}

double anneal_process_cpu_seconds(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return -1.0;
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
