/* The profiler's views of core's spans (anneal/profile.h): the per-op table with its
 * forward/backward split, and the Chrome trace JSON. */
#include "anneal/fs.h"
#include "anneal/profile.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* Orders rows by total time, largest first, then by name. */
static int cmp_row(const void *x, const void *y) {
    const anneal_profile_row *a = x, *b = y;
    if (a->total_ms != b->total_ms) return a->total_ms > b->total_ms ? -1 : 1;
    int c = strcmp(a->name, b->name);
    return c ? c : (int)a->backward - (int)b->backward;
}

anneal_status anneal_profile_table(const anneal_span *spans, int64_t n, anneal_profile_row **rows, int *nrows,
                                   double *step_ms, int64_t *steps) {
    *rows = NULL;
    *nrows = 0;
    *step_ms = 0;
    *steps = 0;
    int cap = 0, nr = 0;
    anneal_profile_row *r = NULL;
    for (int64_t i = 0; i < n; i++) {
        const anneal_span *s = &spans[i];
        if (s->cat == ANNEAL_SPAN_STEP && !strcmp(s->name, "step")) {
            *step_ms += (double)s->dur_ns / 1e6;
            ++*steps;
        }
        if (s->cat != ANNEAL_SPAN_OP) continue;
        int k = 0;
        while (k < nr && !(r[k].backward == s->backward && !strcmp(r[k].name, s->name))) k++;
        if (k == nr) {
            if (nr == cap) {
                int nc = cap ? 2 * cap : 32;
                anneal_profile_row *g = realloc(r, (size_t)nc * sizeof *g);
                if (!g) {
                    free(r);
                    return anneal_set_error(ANNEAL_ERR_OOM, "profile: out of memory for the op table");
                }
                r = g;
                cap = nc;
            }
            r[nr++] = (anneal_profile_row){.name = s->name, .backward = s->backward};
        }
        r[k].calls++;
        r[k].total_ms += (double)s->dur_ns / 1e6;
        r[k].flops += s->flops;
        r[k].bytes += s->bytes;
    }
    for (int k = 0; k < nr; k++) {
        r[k].mean_ms = r[k].total_ms / (double)r[k].calls;
        r[k].pct_of_step = *step_ms > 0 ? 100.0 * r[k].total_ms / *step_ms : 0;
        double sec = r[k].total_ms / 1e3;
        r[k].gflops = sec > 0 && r[k].flops > 0 ? r[k].flops / sec / 1e9 : 0;
        r[k].gbps = sec > 0 && r[k].bytes > 0 ? r[k].bytes / sec / 1e9 : 0;
    }
    if (nr) qsort(r, (size_t)nr, sizeof *r, cmp_row);
    *rows = r;
    *nrows = nr;
    return ANNEAL_OK;
}

/* Total time of the spans of category cat named name (NULL: any name). */
static double spans_ms(const anneal_span *spans, int64_t n, int cat, const char *name) {
    double ms = 0;
    for (int64_t i = 0; i < n; i++)
        if (spans[i].cat == cat && (!name || !strcmp(spans[i].name, name))) ms += (double)spans[i].dur_ns / 1e6;
    return ms;
}

void anneal_profile_print(FILE *out, const anneal_span *spans, int64_t n, double peak_gflops, double peak_gbps,
                          int max_rows) {
    anneal_profile_row *r;
    int nr;
    double step_ms;
    int64_t steps;
    if (anneal_profile_table(spans, n, &r, &nr, &step_ms, &steps) != ANNEAL_OK) {
        fprintf(out, "profile: %s\n", anneal_last_error());
        anneal_clear_error();
        return;
    }
    fprintf(out, "profile: %lld step%s, %.1f ms in steps (%.1f ms each)\n", (long long)steps, steps == 1 ? "" : "s",
            step_ms, steps ? step_ms / (double)steps : 0.0);
    fprintf(out, "  %-24s %-4s %7s %10s %9s %7s %14s %7s\n", "op", "pass", "calls", "total ms", "mean ms", "% step",
            "rate", "% peak");
    double fwd = 0, bwd = 0;
    for (int k = 0; k < nr; k++) {
        if (r[k].backward) bwd += r[k].total_ms;
        else fwd += r[k].total_ms;
        if (max_rows > 0 && k >= max_rows) continue;
        char rate[32] = "-", pk[16] = "-";
        if (r[k].gflops > 0) {
            snprintf(rate, sizeof rate, "%.1f GFLOP/s", r[k].gflops);
            if (peak_gflops > 0) snprintf(pk, sizeof pk, "%.1f", 100.0 * r[k].gflops / peak_gflops);
        } else if (r[k].gbps > 0) {
            snprintf(rate, sizeof rate, "%.2f GB/s", r[k].gbps);
            if (peak_gbps > 0) snprintf(pk, sizeof pk, "%.1f", 100.0 * r[k].gbps / peak_gbps);
        }
        fprintf(out, "  %-24.24s %-4s %7lld %10.2f %9.3f %7.1f %14s %7s\n", r[k].name, r[k].backward ? "bwd" : "fwd",
                (long long)r[k].calls, r[k].total_ms, r[k].mean_ms, r[k].pct_of_step, rate, pk);
    }
    if (max_rows > 0 && nr > max_rows) fprintf(out, "  ... %d more rows\n", nr - max_rows);
    double pct = step_ms > 0 ? 100.0 / step_ms : 0;
    fprintf(out, "  ops: forward %.2f ms (%.1f%%), backward %.2f ms (%.1f%%), outside ops %.2f ms (%.1f%%)\n", fwd,
            fwd * pct, bwd, bwd * pct, step_ms - fwd - bwd, (step_ms - fwd - bwd) * pct);
    double ph_f = spans_ms(spans, n, ANNEAL_SPAN_STEP, "forward"), ph_b = spans_ms(spans, n, ANNEAL_SPAN_STEP, "backward");
    double ph_o = spans_ms(spans, n, ANNEAL_SPAN_STEP, "optimizer");
    double comm = spans_ms(spans, n, ANNEAL_SPAN_COMM, NULL), load = spans_ms(spans, n, ANNEAL_SPAN_LOADER, NULL);
    fprintf(out, "  phases: forward %.2f ms, backward %.2f ms, optimizer %.2f ms, loader %.2f ms, communication %.2f ms\n",
            ph_f, ph_b, ph_o, load, comm);
    if (peak_gflops > 0 || peak_gbps > 0)
        fprintf(out, "  peaks: %.1f GFLOP/s, %.1f GB/s (measured on this machine)\n", peak_gflops, peak_gbps);
    free(r);
}

/* ---------------------------------------------------------- Chrome trace */

typedef struct {
    anneal_atomic_file af;
    char buf[1 << 16];
    size_t len;
    anneal_status st;
} writer;

static void flush_w(writer *w) {
    if (w->st == ANNEAL_OK && w->len) w->st = anneal_atomic_write(&w->af, w->buf, w->len);
    w->len = 0;
}

static void put(writer *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(writer *w, const char *fmt, ...) {
    if (sizeof w->buf - w->len < 1024) flush_w(w);
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(w->buf + w->len, sizeof w->buf - w->len, fmt, ap);
    va_end(ap);
    if (k > 0) w->len += (size_t)k < sizeof w->buf - w->len ? (size_t)k : sizeof w->buf - w->len - 1;
}

/* Writes s as a JSON string body (quotes, backslashes and control characters escaped). */
static void put_str(writer *w, const char *s) {
    char tmp[256];
    size_t k = 0;
    for (; *s && k < sizeof tmp - 8; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') tmp[k++] = '\\', tmp[k++] = (char)c;
        else if (c < 0x20) k += (size_t)snprintf(tmp + k, sizeof tmp - k, "\\u%04x", c);
        else tmp[k++] = (char)c;
    }
    tmp[k] = '\0';
    put(w, "\"%s\"", tmp);
}

static const char *cat_name(int cat) {
    static const char *names[ANNEAL_SPAN_CAT_COUNT] = {"op", "autograd", "loader", "checkpoint", "comm", "step"};
    return cat >= 0 && cat < ANNEAL_SPAN_CAT_COUNT ? names[cat] : "other";
}

anneal_status anneal_profile_write_chrome(const char *path, const anneal_span *spans, int64_t n) {
    writer *w = calloc(1, sizeof *w);
    if (!w) return anneal_set_error(ANNEAL_ERR_OOM, "profile: out of memory writing %s", path);
    anneal_status st = anneal_atomic_open(&w->af, path);
    if (st != ANNEAL_OK) {
        free(w);
        return st;
    }
    int64_t t_min = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || spans[i].start_ns < t_min) t_min = spans[i].start_ns;
    put(w, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    put(w, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{\"name\":\"anneal\"}}");
    int nt = anneal_trace_thread_count();
    for (int t = 0; t < nt; t++) {
        put(w, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":", t);
        put_str(w, anneal_trace_thread_label(t));
        put(w, "}},\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,\"args\":{\"sort_index\":%d}}", t, t);
    }
    for (int64_t i = 0; i < n; i++) {
        const anneal_span *s = &spans[i];
        put(w, ",\n{\"name\":");
        put_str(w, s->name ? s->name : "?");
        /* microseconds with ns precision: nested spans keep their order */
        put(w, ",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f", cat_name(s->cat), s->tid,
            (double)(s->start_ns - t_min) / 1e3, (double)s->dur_ns / 1e3);
        if (s->cat == ANNEAL_SPAN_OP || s->flops > 0 || s->bytes > 0)
            put(w, ",\"args\":{\"pass\":\"%s\",\"flops\":%.0f,\"bytes\":%.0f}", s->backward ? "backward" : "forward",
                s->flops, s->bytes);
        put(w, "}");
    }
    put(w, "\n]}\n");
    flush_w(w);
    st = w->st;
    if (st == ANNEAL_OK) st = anneal_atomic_commit(&w->af);
    else anneal_atomic_abort(&w->af);
    free(w);
    return st;
}

/* ------------------------------------------------------- memory report */

/* Appends a formatted piece at buf + *len (never past n - 1). */
static void add(char *buf, size_t n, size_t *len, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void add(char *buf, size_t n, size_t *len, const char *fmt, ...) {
    if (*len + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *len, n - *len, fmt, ap);
    va_end(ap);
    if (k > 0) *len += (size_t)k < n - *len ? (size_t)k : n - *len - 1;
}

size_t anneal_memory_report_format(anneal_device d, const char *indent, char *buf, size_t n) {
    if (!n) return 0;
    anneal_memory_categories m = anneal_memory_categories_get(d);
    anneal_memory_stats ms = anneal_memory_stats_get(d);
    static const anneal_mem_category order[] = {ANNEAL_MEM_PARAMETERS, ANNEAL_MEM_GRADIENTS, ANNEAL_MEM_OPTIMIZER,
                                                ANNEAL_MEM_ACTIVATIONS, ANNEAL_MEM_WORKSPACE};
    size_t len = 0;
    buf[0] = '\0';
    add(buf, n, &len, "%smemory on %s: %.2f MiB live now, %.2f MiB at the peak, %.2f MiB reserved\n", indent,
        anneal_device_name(d), (double)ms.live_bytes / 1048576.0, (double)ms.peak_bytes / 1048576.0,
        (double)ms.reserved_bytes / 1048576.0);
    add(buf, n, &len, "%s  %-16s %14s %14s\n", indent, "category", "now", "at the peak");
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        double v = (double)m.live[order[i]], p = (double)m.at_peak[order[i]];
        add(buf, n, &len, "%s  %-16s %10.2f MiB %10.2f MiB %5.1f%%\n", indent, anneal_memory_category_name(order[i]), v / 1048576.0,
            p / 1048576.0, ms.peak_bytes > 0 ? 100.0 * p / (double)ms.peak_bytes : 0.0);
    }
    add(buf, n, &len, "%s  %-16s %10.2f MiB (freed blocks kept for reuse)\n", indent, "cache", (double)ms.cached_bytes / 1048576.0);
    return len;
}
