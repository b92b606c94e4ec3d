/* anneal profile: what the profiler shows from core's spans (anneal/trace.h): a per-op
 * table (calls, total and mean time, share of the step, achieved GFLOP/s or GB/s and
 * their fraction of the machine's measured peaks, forward/backward split), a Chrome
 * trace JSON (Trace Event Format; loads in Perfetto and chrome://tracing), and the
 * memory breakdown by category that --memory-report and out-of-memory errors print. */
#ifndef ANNEAL_PROFILE_H
#define ANNEAL_PROFILE_H

#include "anneal/core.h"
#include "anneal/trace.h"

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One row of the op table: the op spans of one name, in forward or in backward. */
typedef struct anneal_profile_row {
    const char *name;
    bool backward;
    int64_t calls;
    double total_ms, mean_ms;
    double pct_of_step;     /* total_ms over the step spans' total, in percent */
    double flops, bytes;    /* summed work (0: not counted) */
    double gflops, gbps;    /* achieved rates (0: not counted) */
} anneal_profile_row;

/* The table of spans[0..n): rows (malloc'd, sorted by total time, largest first),
 * the summed time of the step spans (*step_ms, 0 if none) and their count (*steps).
 * ANNEAL_ERR_OOM if out of memory. */
anneal_status anneal_profile_table(const anneal_span *spans, int64_t n, anneal_profile_row **rows, int *nrows,
                                   double *step_ms, int64_t *steps);

/* Prints the table (at most max_rows rows, 0 = all) with the forward/backward split
 * and, where peak_gflops / peak_gbps are > 0, each rate's share of the peak. */
void anneal_profile_print(FILE *out, const anneal_span *spans, int64_t n, double peak_gflops, double peak_gbps,
                          int max_rows);

/* Writes spans[0..n) as a Chrome trace (a JSON object with "traceEvents": "X" complete
 * events in microseconds, one tid per tracer thread, process and thread name metadata,
 * FLOPs/bytes in args) to path atomically (temp file + fsync + rename). */
anneal_status anneal_profile_write_chrome(const char *path, const anneal_span *spans, int64_t n);

/* Peak memory bandwidth in GB/s (read + write of a large copy, best of rounds over
 * about `seconds`, `threads` threads). 0 if the buffers cannot be had. */
double anneal_peak_bandwidth_measure(int threads, double seconds);

/* The memory breakdown of device d (anneal_memory_categories_get) as lines, prefixed by
 * indent, into buf (always NUL-terminated); returns the length. */
size_t anneal_memory_report_format(anneal_device d, const char *indent, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
