/* anneal telemetry (obs layer): what other tools read from a run. TensorBoard event
 * files (TFRecord framing, Event/Summary protobufs via protobuf-c), a Prometheus
 * /metrics endpoint on loopback (libmicrohttpd), and plots of run logs (Cairo).
 * The trainer feeds each JSON-lines record (docs/FORMATS.md, "Training log") to the
 * sinks it has open; the sinks pick the figures they know. */
#ifndef ANNEAL_TELEMETRY_H
#define ANNEAL_TELEMETRY_H

#include "anneal/core.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct cJSON;

/* ------------------------------------------------------------ TFRecord */

/* CRC-32C (Castagnoli) of n bytes, continuing from crc (0 to start). */
uint32_t anneal_crc32c(uint32_t crc, const void *data, size_t n);
/* TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8. */
uint32_t anneal_crc32c_masked(const void *data, size_t n);
/* The 12-byte TFRecord header of a record of n bytes: uint64 length (little endian)
 * then the masked CRC of those 8 bytes. The record is header, data, masked CRC of
 * data (4 bytes, little endian). */
void anneal_tfrecord_header(uint64_t n, unsigned char out[12]);

/* ---------------------------------------------------------- TensorBoard */

typedef struct anneal_tb_writer anneal_tb_writer;

/* Creates dir (and its parents) and a new event file in it
 * (events.out.tfevents.<time>.<host>.<pid>.anneal) whose first record is the
 * file_version event. Each later record goes to the file with one write(2), so a crash
 * loses at most the record being written. */
anneal_status anneal_tb_open(const char *dir, anneal_tb_writer **out);
/* The event file's path. */
const char *anneal_tb_path(const anneal_tb_writer *w);
anneal_status anneal_tb_scalar(anneal_tb_writer *w, const char *tag, int64_t step, double value);
/* A text summary (the TensorBoard text plugin: a DT_STRING tensor of one element). */
anneal_status anneal_tb_text(anneal_tb_writer *w, const char *tag, int64_t step, const char *text);
/* Maps one training-log record to summaries: "step" -> train/loss, train/lr,
 * train/grad_norm, train/loss_scale (fp16), perf/tokens_per_s, perf/mfu,
 * perf/memory_bytes; "eval" -> val/loss; "sample" -> samples (text); "start" -> the
 * run's settings as text ("config"). Other records are ignored. */
anneal_status anneal_tb_record(anneal_tb_writer *w, const struct cJSON *record);
/* fsyncs, closes and frees (NULL is fine). */
void anneal_tb_close(anneal_tb_writer *w);

/* ---------------------------------------------------------- Prometheus */

typedef struct anneal_metrics anneal_metrics;

/* Serves GET /metrics (text exposition format 0.0.4) on addr:port (addr NULL:
 * 127.0.0.1) from a libmicrohttpd thread, at most 8 connections at a time. Port 0
 * picks a free port (anneal_metrics_port tells which). */
anneal_status anneal_metrics_start(const char *addr, int port, anneal_metrics **out);
int anneal_metrics_port(const anneal_metrics *m);
/* Takes the figures of a training-log record ("start", "step", "eval"). Thread safe. */
void anneal_metrics_record(anneal_metrics *m, const struct cJSON *record);
/* Per-rank step time (a distributed run): seconds[r] for r < world. */
void anneal_metrics_rank_step_seconds(anneal_metrics *m, int world, const double *seconds);
/* The exposition text now (malloc'd), as the endpoint serves it. */
char *anneal_metrics_render(anneal_metrics *m);
/* Stops the server and frees (NULL is fine). */
void anneal_metrics_stop(anneal_metrics *m);

/* --------------------------------------------------------------- plots */

typedef struct anneal_plot_options {
    const char *out;   /* FILE.png or FILE.svg */
    int width, height; /* pixels (PNG) or points (SVG); 0: 1200 x 800 */
    bool log_x;
    bool x_tokens;     /* x axis: tokens instead of steps */
} anneal_plot_options;

/* Draws train/val loss, learning rate, tokens/s and memory of the runs (each a run
 * directory with log.jsonl, or a log file) in four panels with a legend naming
 * each run. The format follows the extension of o->out. */
anneal_status anneal_plot_runs(int n_runs, const char *const *runs, const anneal_plot_options *o);
/* Frees Cairo's and fontconfig's process-wide caches (fonts), so a leak checker sees
 * nothing left: call once at the end of a process, when no thread draws any more. */
void anneal_plot_release_caches(void);

#ifdef __cplusplus
}
#endif
#endif
