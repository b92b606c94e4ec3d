/* The span tracer (include/anneal/trace.h). Each recording thread owns a buffer: a
 * chain of fixed-size chunks it alone appends to, publishing the count with a release
 * store, so a collector on another thread reads only whole spans. Buffers are
 * registered once per thread under a lock and live until the process ends (a thread
 * that exits leaves its spans to be collected); reset empties them. */
#include "anneal/trace.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHUNK 4096

typedef struct chunk {
    anneal_span s[CHUNK];
    _Atomic int n;
    struct chunk *_Atomic next;
} chunk;

typedef struct tbuf {
    chunk *head, *tail;
    int tid;
    char name[32];
    bool track; /* a named track, not a thread's */
    struct tbuf *next;
} tbuf;

volatile bool anneal_trace_flag = false;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static tbuf *g_bufs;
static int g_nthreads;
static _Thread_local tbuf *t_buf;
static _Thread_local int t_backward;
static _Thread_local char t_name[32];

int64_t anneal_trace_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    return ns ? ns : 1;
}

void anneal_trace_enable(bool on) { anneal_trace_flag = on; }

/* This thread's buffer, registered on first use (NULL if out of memory). */
static tbuf *my_buf(void) {
    if (t_buf) return t_buf;
    tbuf *b = calloc(1, sizeof *b);
    chunk *c = b ? calloc(1, sizeof *c) : NULL;
    if (!c) {
        free(b);
        return NULL;
    }
    b->head = b->tail = c;
    memcpy(b->name, t_name, sizeof b->name);
    pthread_mutex_lock(&g_lock);
    b->tid = g_nthreads++;
    b->next = g_bufs;
    g_bufs = b;
    pthread_mutex_unlock(&g_lock);
    return t_buf = b;
}

void anneal_span_record(anneal_span_cat cat, const char *name, int64_t t0, double flops, double bytes) {
    int64_t now = anneal_trace_now_ns();
    tbuf *b = my_buf();
    if (!b) return;
    chunk *c = b->tail;
    int n = atomic_load_explicit(&c->n, memory_order_relaxed);
    if (n == CHUNK) {
        chunk *nc = calloc(1, sizeof *nc);
        if (!nc) return; /* out of memory: the span is dropped, the run goes on */
        atomic_store_explicit(&c->next, nc, memory_order_release);
        b->tail = c = nc;
        n = 0;
    }
    c->s[n] = (anneal_span){.name = name, .start_ns = t0, .dur_ns = now - t0, .flops = flops, .bytes = bytes,
                            .tid = b->tid, .cat = (uint8_t)cat, .backward = t_backward > 0};
    atomic_store_explicit(&c->n, n + 1, memory_order_release);
}

void anneal_span_record_track(const char *track, anneal_span_cat cat, const char *name, int64_t t0, double flops,
                              double bytes) {
    if (!t0) return;
    int64_t now = anneal_trace_now_ns();
    pthread_mutex_lock(&g_lock);
    tbuf *b = g_bufs;
    while (b && !(b->track && !strcmp(b->name, track))) b = b->next;
    if (!b) {
        b = calloc(1, sizeof *b);
        chunk *c = b ? calloc(1, sizeof *c) : NULL;
        if (!c) {
            free(b);
            pthread_mutex_unlock(&g_lock);
            return;
        }
        b->head = b->tail = c;
        b->track = true;
        snprintf(b->name, sizeof b->name, "%s", track);
        b->tid = g_nthreads++;
        b->next = g_bufs;
        g_bufs = b;
    }
    chunk *c = b->tail;
    int n = atomic_load(&c->n);
    if (n == CHUNK) {
        chunk *nc = calloc(1, sizeof *nc);
        if (nc) {
            atomic_store(&c->next, nc);
            b->tail = c = nc;
            n = 0;
        }
    }
    if (n < CHUNK) {
        c->s[n] = (anneal_span){.name = name, .start_ns = t0, .dur_ns = now - t0, .flops = flops, .bytes = bytes,
                                .tid = b->tid, .cat = (uint8_t)cat, .backward = false};
        atomic_store(&c->n, n + 1);
    }
    pthread_mutex_unlock(&g_lock);
}

void anneal_trace_backward_enter(void) { t_backward++; }
void anneal_trace_backward_leave(void) {
    if (t_backward > 0) t_backward--;
}

void anneal_trace_thread_name(const char *name) {
    snprintf(t_name, sizeof t_name, "%s", name ? name : "");
    if (t_buf) {
        pthread_mutex_lock(&g_lock);
        memcpy(t_buf->name, t_name, sizeof t_name);
        pthread_mutex_unlock(&g_lock);
    }
}

void anneal_trace_reset(void) {
    pthread_mutex_lock(&g_lock);
    for (tbuf *b = g_bufs; b; b = b->next) {
        chunk *c = b->head->next;
        while (c) {
            chunk *nx = c->next;
            free(c);
            c = nx;
        }
        b->head->next = NULL;
        atomic_store(&b->head->n, 0);
        b->tail = b->head;
    }
    pthread_mutex_unlock(&g_lock);
}

/* Orders spans by thread, then start, the enclosing (longer) span first. */
static int cmp_span(const void *x, const void *y) {
    const anneal_span *a = x, *b = y;
    if (a->tid != b->tid) return a->tid < b->tid ? -1 : 1;
    if (a->start_ns != b->start_ns) return a->start_ns < b->start_ns ? -1 : 1;
    if (a->dur_ns != b->dur_ns) return a->dur_ns > b->dur_ns ? -1 : 1;
    return 0;
}

int64_t anneal_trace_collect(anneal_span **out) {
    *out = NULL;
    pthread_mutex_lock(&g_lock);
    int64_t total = 0;
    for (tbuf *b = g_bufs; b; b = b->next)
        for (chunk *c = b->head; c; c = atomic_load_explicit(&c->next, memory_order_acquire))
            total += atomic_load_explicit(&c->n, memory_order_acquire);
    anneal_span *v = total ? malloc((size_t)total * sizeof *v) : NULL;
    if (total && !v) {
        pthread_mutex_unlock(&g_lock);
        return -1;
    }
    int64_t k = 0;
    for (tbuf *b = g_bufs; b && k < total; b = b->next)
        for (chunk *c = b->head; c && k < total; c = atomic_load_explicit(&c->next, memory_order_acquire)) {
            int64_t n = atomic_load_explicit(&c->n, memory_order_acquire);
            if (n > total - k) n = total - k;
            memcpy(v + k, c->s, (size_t)n * sizeof *v);
            k += n;
        }
    pthread_mutex_unlock(&g_lock);
    if (k) qsort(v, (size_t)k, sizeof *v, cmp_span);
    *out = v;
    return k;
}

int anneal_trace_thread_count(void) {
    pthread_mutex_lock(&g_lock);
    int n = g_nthreads;
    pthread_mutex_unlock(&g_lock);
    return n;
}

const char *anneal_trace_thread_label(int tid) {
    static _Thread_local char fallback[32];
    const char *r = NULL;
    pthread_mutex_lock(&g_lock);
    for (tbuf *b = g_bufs; b; b = b->next)
        if (b->tid == tid && b->name[0]) r = b->name;
    pthread_mutex_unlock(&g_lock);
    if (r) return r;
    snprintf(fallback, sizeof fallback, "thread %d", tid);
    return fallback;
}
