/* anneal obs: what a run shows and records. The progress line (one live line on a
 * terminal, plain lines otherwise), JSON-lines logs appended and flushed a line at a
 * time, the peak FLOP rate that MFU is measured against (an FMA microbenchmark), peak
 * RSS, and small formatting helpers. */
#ifndef ANNEAL_OBS_H
#define ANNEAL_OBS_H

#include "anneal/core.h"

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ JSON lines */

/* A log file that only grows: each record is one line written with one write(2)
 * to a file opened O_APPEND, so a crash leaves whole lines (at worst a torn last one)
 * and two writers never interleave inside a line. */
typedef struct anneal_jsonl anneal_jsonl;

/* Opens (creating) path for appending. ANNEAL_ERR_IO naming the file on failure. */
anneal_status anneal_jsonl_open(const char *path, anneal_jsonl **out);
/* Appends one JSON object text (must not contain a newline; cJSON_PrintUnformatted
 * output) plus '\n', then flushes it to the kernel. */
anneal_status anneal_jsonl_write(anneal_jsonl *l, const char *json);
/* fsyncs and closes (NULL is fine). */
void anneal_jsonl_close(anneal_jsonl *l);

/* ------------------------------------------------------------- progress */

/* The figures of one training step. */
typedef struct anneal_step_stats {
    int64_t step, total;   /* 1-based step number of total */
    double loss, lr, grad_norm;
    double tokens_per_s;
    double mfu;            /* fraction of peak, NaN if unknown */
    double ms;             /* this step's time */
    double cpu_ms;         /* this step's process CPU time, all threads */
    double eta_s;          /* seconds left, NaN if unknown */
    bool skipped;          /* non-finite: the update was skipped */
    double mem_bytes;      /* peak tensor bytes so far (0: not shown) */
} anneal_step_stats;

/* Formats a step as one line without a newline: "step 12/100  loss 4.1234  lr ..."
 * into buf (always NUL-terminated). Returns the length. */
size_t anneal_progress_format(const anneal_step_stats *s, char *buf, size_t n);

typedef struct anneal_progress anneal_progress;

/* Progress on `out`: live (one line rewritten in place with '\r', for terminals) or
 * plain (a line every `every` steps and at the last). */
anneal_progress *anneal_progress_new(FILE *out, bool live, int64_t every);
void anneal_progress_step(anneal_progress *p, const anneal_step_stats *s);
/* Prints a permanent line (a live line is cleared first and redrawn by the next step). */
void anneal_progress_note(anneal_progress *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Ends a live line with a newline and frees (NULL is fine). */
void anneal_progress_free(anneal_progress *p);

/* ------------------------------------------------------- machine figures */

/* Measures the peak single-precision FLOP rate with `threads` threads each running
 * independent chains of fused multiply-adds (AVX-512 when the CPU has it, else AVX2 +
 * FMA, else scalar) for about `seconds`. Returns GFLOP/s; *isa names the kernel. */
double anneal_peak_gflops_measure(int threads, double seconds, const char **isa);
/* The peak FLOP rate for GEMMs at operand precision dt, measured on what those GEMMs run
 * on: for ANNEAL_BF16 on a CPU with usable AMX tiles, four independent TDPBF16PS; where
 * the bf16 GEMM runs VDPBF16PS (anneal_cpu_bf16_dot_preferred), independent VDPBF16PS
 * chains counted as 4 FLOPs per f32 lane per instruction; otherwise (f32, f16, and bf16
 * on the f32 kernels: Intel cores without AMX, CPUs without AVX512-BF16) the FMA
 * microbenchmark above. Returns GFLOP/s; *isa (if non-NULL) names the kernel. */
double anneal_peak_gflops_measure_dtype(int threads, double seconds, anneal_dtype dt,
                                        const char **isa);
/* Peak resident set size of this process in bytes (getrusage). */
int64_t anneal_peak_rss_bytes(void);
/* CPU time this process has used, all threads (CLOCK_PROCESS_CPUTIME_ID), in seconds;
 * -1 when the clock cannot be read. */
double anneal_process_cpu_seconds(void);
/* Amdahl's parallel fraction p of a run that took `wall` of wall time and `cpu` of
 * process CPU time (any one unit) on `threads` threads, from wall = (1 - p) cpu + p cpu /
 * threads, clamped to [0, 1]; -1 with fewer than 2 threads or a time not above 0. An
 * estimate: it holds when waiting threads sleep (OMP_WAIT_POLICY=passive, the CLI's
 * default) and the machine gives the run its cores; threads idle at a barrier count as
 * serial time, spinning ones as parallel work. */
double anneal_parallel_fraction(double wall, double cpu, int threads);

/* --------------------------------------------------------------- format */

/* "45.2s", "3m05s", "2h07m". Returns buf. */
const char *anneal_format_duration(double seconds, char *buf, size_t n);
/* "512", "12.3k", "4.56M", "7.89G". Returns buf. */
const char *anneal_format_count(double v, char *buf, size_t n);
/* Copies n bytes of text into out (capacity cap, NUL-terminated) replacing every
 * invalid UTF-8 sequence by U+FFFD, so generated text can go into JSON. Returns the
 * length written. */
size_t anneal_utf8_sanitize(const char *in, size_t n, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
