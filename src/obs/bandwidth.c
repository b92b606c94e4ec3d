/* The memory bandwidth the profiler's GB/s figures are quoted against: a copy of a
 * buffer much larger than the caches (read + write counted), best of a few rounds, in
 * parallel over `threads` OpenMP threads. */
#include "anneal/obs.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

double anneal_peak_bandwidth_measure(int threads, double seconds) {
    const size_t n = (size_t)64 << 20; /* 64 MiB each way */
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        free(a);
        free(b);
        return 0;
    }
    memset(a, 1, n);
    memset(b, 2, n);
    if (threads < 1) threads = 1;
    double best = 0, t_end = now_s() + (seconds > 0 ? seconds : 0.2);
    int rounds = 0;
    do {
        double t0 = now_s();
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int c = 0; c < 64; c++) memcpy(b + (size_t)c * (n / 64), a + (size_t)c * (n / 64), n / 64);
        double dt = now_s() - t0;
        if (dt > 0 && 2.0 * (double)n / dt > best) best = 2.0 * (double)n / dt;
        a[rounds % n] ^= b[(rounds * 7) % n]; /* keep the copies observable */
    } while (++rounds < 3 || now_s() < t_end);
    free(a);
    free(b);
    return best / 1e9;
}
