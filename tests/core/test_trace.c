/* The span tracer: off records nothing; on, spans carry their name, category, work
 * and thread, nest on one thread (the outer span encloses the inner and sorts first),
 * each thread gets its own track (with its name), the backward flag follows
 * enter/leave, named tracks take spans from any thread, and reset forgets all. An op
 * run with the tracer on records an op span with its FLOPs, inside the autograd span
 * of its backward node. */
#include "anneal/anneal.h"
#include "test.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void spin_us(int us) {
    int64_t t0 = anneal_trace_now_ns();
    while (anneal_trace_now_ns() - t0 < (int64_t)us * 1000) {
    }
}

/* Finds the first collected span named name (NULL if none). */
static const anneal_span *find(const anneal_span *s, int64_t n, const char *name) {
    for (int64_t i = 0; i < n; i++)
        if (!strcmp(s[i].name, name)) return &s[i];
    return NULL;
}

TEST(trace_off_records_nothing) {
    anneal_trace_enable(false);
    anneal_trace_reset();
    int64_t t0 = anneal_span_begin();
    CHECK(t0 == 0, "begin while off returned %lld", (long long)t0);
    anneal_span_end(ANNEAL_SPAN_OP, "x", t0, 1, 2);
    anneal_span *s;
    int64_t n = anneal_trace_collect(&s);
    CHECK(n == 0 && s == NULL, "%lld spans recorded while off", (long long)n);
    free(s);
}

TEST(trace_spans_nest_on_one_thread) {
    anneal_trace_reset();
    anneal_trace_enable(true);
    anneal_trace_thread_name("main");
    int64_t outer = anneal_span_begin();
    spin_us(50);
    int64_t inner = anneal_span_begin();
    spin_us(50);
    anneal_span_end(ANNEAL_SPAN_OP, "inner", inner, 1000, 0);
    anneal_trace_backward_enter();
    int64_t b = anneal_span_begin();
    anneal_span_end(ANNEAL_SPAN_OP, "in_backward", b, 0, 64);
    anneal_trace_backward_leave();
    spin_us(50);
    anneal_span_end(ANNEAL_SPAN_STEP, "outer", outer, 0, 0);
    anneal_trace_enable(false);
    anneal_span *s;
    int64_t n = anneal_trace_collect(&s);
    REQUIRE(n == 3);
    CHECK(!strcmp(s[0].name, "outer"), "first span %s (the enclosing one sorts first)", s[0].name);
    const anneal_span *o = find(s, n, "outer"), *i = find(s, n, "inner"), *bw = find(s, n, "in_backward");
    REQUIRE(o && i && bw);
    CHECK(i->start_ns >= o->start_ns && i->start_ns + i->dur_ns <= o->start_ns + o->dur_ns, "inner not inside outer");
    CHECK(i->dur_ns >= 50000, "inner lasted %lld ns", (long long)i->dur_ns);
    CHECK(o->cat == ANNEAL_SPAN_STEP && i->cat == ANNEAL_SPAN_OP, "categories");
    CHECK(i->flops == 1000 && bw->bytes == 64, "work");
    CHECK(!i->backward && bw->backward && !o->backward, "backward flags");
    CHECK(o->tid == i->tid && !strcmp(anneal_trace_thread_label(o->tid), "main"), "%s",
          anneal_trace_thread_label(o->tid));
    free(s);
}

static void *worker(void *arg) {
    anneal_trace_thread_name((const char *)arg);
    for (int k = 0; k < 5000; k++) { /* more than a chunk: the buffer grows */
        int64_t t0 = anneal_span_begin();
        anneal_span_end(ANNEAL_SPAN_LOADER, "work", t0, 0, 0);
    }
    anneal_span_record_track("shared track", ANNEAL_SPAN_COMM, "bucket", anneal_span_begin(), 0, 8);
    return NULL;
}

TEST(trace_threads_get_their_own_tracks) {
    anneal_trace_reset();
    anneal_trace_enable(true);
    pthread_t th[3];
    const char *names[3] = {"w0", "w1", "w2"};
    for (int i = 0; i < 3; i++) REQUIRE(pthread_create(&th[i], NULL, worker, (void *)names[i]) == 0);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    anneal_trace_enable(false);
    anneal_span *s;
    int64_t n = anneal_trace_collect(&s);
    CHECK(n == 3 * 5000 + 3, "%lld spans", (long long)n);
    int per_tid[64] = {0}, tracks = 0;
    for (int64_t i = 0; i < n; i++) {
        REQUIRE(s[i].tid >= 0 && s[i].tid < 64);
        if (s[i].cat == ANNEAL_SPAN_LOADER) per_tid[s[i].tid]++;
        else tracks++;
        if (i) CHECK(s[i].tid > s[i - 1].tid || (s[i].tid == s[i - 1].tid && s[i].start_ns >= s[i - 1].start_ns),
                     "not sorted at %lld", (long long)i);
    }
    CHECK(tracks == 3, "%d spans on the named track", tracks);
    int seen = 0;
    for (int t = 0; t < 64; t++)
        if (per_tid[t]) {
            CHECK(per_tid[t] == 5000, "tid %d has %d spans", t, per_tid[t]);
            const char *l = anneal_trace_thread_label(t);
            CHECK(l[0] == 'w', "tid %d label %s", t, l);
            seen++;
        }
    CHECK(seen == 3, "%d worker tracks", seen);
    free(s);
    anneal_trace_reset();
    n = anneal_trace_collect(&s);
    CHECK(n == 0, "%lld spans after reset", (long long)n);
    free(s);
}

TEST(trace_op_spans_nest_in_backward_nodes) {
    anneal_trace_reset();
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *a = anneal_randn(ANNEAL_F32, 2, (int64_t[]){8, 16}, 0, 1), *b = anneal_randn(ANNEAL_F32, 2, (int64_t[]){16, 4}, 0, 1);
    REQUIRE(a && b);
    anneal_set_requires_grad(a, true);
    anneal_trace_enable(true);
    anneal_tensor *y = anneal_sum(anneal_matmul(a, b));
    REQUIRE(anneal_backward(y) == ANNEAL_OK);
    anneal_trace_enable(false);
    anneal_span *s;
    int64_t n = anneal_trace_collect(&s);
    const anneal_span *fwd = NULL, *bwd = NULL, *node = NULL;
    for (int64_t i = 0; i < n; i++) {
        if (s[i].cat == ANNEAL_SPAN_OP && !strcmp(s[i].name, "matmul")) {
            if (s[i].backward) bwd = bwd ? bwd : &s[i];
            else fwd = &s[i];
        }
        if (s[i].cat == ANNEAL_SPAN_AUTOGRAD && strcmp(s[i].name, "backward") && bwd == NULL) node = &s[i];
    }
    REQUIRE(fwd && bwd);
    CHECK(fwd->flops == 2.0 * 8 * 16 * 4, "forward matmul flops %g", fwd->flops);
    /* the backward matmul sits inside an autograd node span */
    bool inside = false;
    for (int64_t i = 0; i < n; i++)
        if (s[i].cat == ANNEAL_SPAN_AUTOGRAD && s[i].tid == bwd->tid && s[i].start_ns <= bwd->start_ns &&
            s[i].start_ns + s[i].dur_ns >= bwd->start_ns + bwd->dur_ns && strcmp(s[i].name, "backward"))
            inside = true;
    CHECK(inside, "backward matmul not inside a node span");
    (void)node;
    free(s);
    anneal_trace_reset();
    anneal_scope_close(sc);
}

int main(void) {
    RUN(trace_off_records_nothing);
    RUN(trace_spans_nest_on_one_thread);
    RUN(trace_threads_get_their_own_tracks);
    RUN(trace_op_spans_nest_in_backward_nodes);
    return anneal_test_summary();
}
