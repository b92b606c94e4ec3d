/* anneal trace: the span tracer the profiler reads. A span is a named interval on one
 * thread (op, autograd node, loader batch, checkpoint write, all-reduce bucket, step),
 * with optional FLOPs and bytes. Recording is off by default; off, a span costs one
 * load and branch of a global flag. On, each thread appends to its own buffer (no
 * locks on the hot path; a thread's first span registers its buffer once). */
#ifndef ANNEAL_TRACE_H
#define ANNEAL_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum anneal_span_cat {
    ANNEAL_SPAN_OP,         /* one op's kernel(s) */
    ANNEAL_SPAN_AUTOGRAD,   /* one backward node (its op spans nest inside) */
    ANNEAL_SPAN_LOADER,     /* making a batch */
    ANNEAL_SPAN_CHECKPOINT, /* snapshot / background write */
    ANNEAL_SPAN_COMM,       /* a collective (all-reduce bucket) */
    ANNEAL_SPAN_STEP,       /* a training step, and its phases (forward, backward, optimizer) */
    ANNEAL_SPAN_CAT_COUNT
} anneal_span_cat;

/* One recorded span. name has static lifetime (a literal or a node's name). */
typedef struct anneal_span {
    const char *name;
    int64_t start_ns, dur_ns; /* CLOCK_MONOTONIC */
    double flops, bytes;      /* work done (0: not counted) */
    int32_t tid;              /* the tracer's thread number, 0 = first thread to record */
    uint8_t cat;              /* anneal_span_cat */
    bool backward;            /* recorded inside a backward pass (the forward/backward split) */
} anneal_span;

extern volatile bool anneal_trace_flag; /* read through the inline functions below */

/* Nanoseconds of CLOCK_MONOTONIC (never 0). */
int64_t anneal_trace_now_ns(void);
/* Turns recording on or off (spans in flight when turned on are not recorded). */
void anneal_trace_enable(bool on);
static inline bool anneal_trace_enabled(void) { return anneal_trace_flag; }
/* Forgets every recorded span (call with recording off and no span in flight). */
void anneal_trace_reset(void);

/* Starts a span: its start time when recording, else 0 (and the end does nothing). */
static inline int64_t anneal_span_begin(void) { return anneal_trace_flag ? anneal_trace_now_ns() : 0; }
void anneal_span_record(anneal_span_cat cat, const char *name, int64_t t0, double flops, double bytes);
/* Ends a span begun at t0 (anneal_span_begin) and records it on this thread. */
static inline void anneal_span_end(anneal_span_cat cat, const char *name, int64_t t0, double flops, double bytes) {
    if (t0) anneal_span_record(cat, name, t0, flops, bytes);
}

/* Records a span begun at t0 on the named track (not a thread: work in flight, such
 * as a collective from its launch until its completion is seen). Takes a lock. */
void anneal_span_record_track(const char *track, anneal_span_cat cat, const char *name, int64_t t0, double flops,
                              double bytes);

/* Marks this thread as running a backward pass (nests); op spans recorded meanwhile
 * are flagged backward. */
void anneal_trace_backward_enter(void);
void anneal_trace_backward_leave(void);
/* Names this thread's track ("main", "checkpoint-writer"); name is copied. */
void anneal_trace_thread_name(const char *name);

/* Copies every recorded span into a malloc'd array sorted by (tid, start, longest
 * first); *out = NULL when none. Returns the count (-1 if out of memory). */
int64_t anneal_trace_collect(anneal_span **out);
/* Threads that recorded: their count, and the name of thread number tid ("thread N"
 * when unnamed; valid until the next reset). */
int anneal_trace_thread_count(void);
const char *anneal_trace_thread_label(int tid);

#ifdef __cplusplus
}
#endif
#endif
