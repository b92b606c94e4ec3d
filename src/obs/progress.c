/* The progress display: a line per training step, rewritten in place on a terminal
 * ('\r' + erase to end of line) or printed every N steps otherwise; notes (eval
 * results, samples) are permanent lines between them. */
#include "anneal/obs.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

struct anneal_progress {
    FILE *out;
    bool live;
    int64_t every;
    bool line_open; /* a live line is on screen without its newline */
};

size_t anneal_progress_format(const anneal_step_stats *s, char *buf, size_t n) {
    char tps[32], eta[32];
    int k = snprintf(buf, n, "step %5lld/%lld  loss %.4f  lr %.2e  norm %.3f  %s tok/s", (long long)s->step,
                     (long long)s->total, s->loss, s->lr, s->grad_norm,
                     anneal_format_count(s->tokens_per_s, tps, sizeof tps));
    size_t len = k < 0 ? 0 : (size_t)k < n ? (size_t)k : n - 1;
    if (len < n && isfinite(s->mfu)) {
        k = snprintf(buf + len, n - len, "  MFU %.1f%%", 100.0 * s->mfu);
        len += k < 0 ? 0 : (size_t)k < n - len ? (size_t)k : n - len - 1;
    }
    if (len < n) {
        k = snprintf(buf + len, n - len, "  %.1f ms", s->ms);
        len += k < 0 ? 0 : (size_t)k < n - len ? (size_t)k : n - len - 1;
    }
    if (len < n && s->mem_bytes > 0) {
        char mb[32];
        k = snprintf(buf + len, n - len, "  mem %sB peak", anneal_format_count(s->mem_bytes, mb, sizeof mb));
        len += k < 0 ? 0 : (size_t)k < n - len ? (size_t)k : n - len - 1;
    }
    if (len < n && isfinite(s->eta_s)) {
        k = snprintf(buf + len, n - len, "  ETA %s", anneal_format_duration(s->eta_s, eta, sizeof eta));
        len += k < 0 ? 0 : (size_t)k < n - len ? (size_t)k : n - len - 1;
    }
    if (len < n && s->skipped) {
        k = snprintf(buf + len, n - len, "  [skipped: non-finite]");
        len += k < 0 ? 0 : (size_t)k < n - len ? (size_t)k : n - len - 1;
    }
    return len;
}

anneal_progress *anneal_progress_new(FILE *out, bool live, int64_t every) {
    anneal_progress *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->out = out;
    p->live = live;
    p->every = every > 0 ? every : 1;
    return p;
}

void anneal_progress_step(anneal_progress *p, const anneal_step_stats *s) {
    if (!p || !p->out) return;
    char line[256];
    anneal_progress_format(s, line, sizeof line);
    if (p->live) {
        /* a line wider than the terminal would wrap, and '\r' would only rewrite its tail */
        struct winsize ws;
        if (ioctl(fileno(p->out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20 && strlen(line) >= ws.ws_col)
            line[ws.ws_col - 1] = '\0';
        fprintf(p->out, "\r%s\033[K", line);
        p->line_open = true;
    } else if (s->step % p->every == 0 || s->step == s->total || s->step == 1 || s->skipped) {
        fprintf(p->out, "%s\n", line);
    }
    fflush(p->out);
}

void anneal_progress_note(anneal_progress *p, const char *fmt, ...) {
    if (!p || !p->out) return;
    if (p->line_open) {
        fputc('\n', p->out);
        p->line_open = false;
    }
    va_list ap;
    va_start(ap, fmt);
    vfprintf(p->out, fmt, ap);
    va_end(ap);
    fputc('\n', p->out);
    fflush(p->out);
}

void anneal_progress_free(anneal_progress *p) {
    if (!p) return;
    if (p->line_open && p->out) {
        fputc('\n', p->out);
        fflush(p->out);
    }
    free(p);
}
