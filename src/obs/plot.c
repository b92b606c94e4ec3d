/* anneal plot (see anneal/telemetry.h): training curves of one or more runs drawn with
 * Cairo into PNG or SVG. Four panels (loss with train solid and validation dashed,
 * learning rate, tokens/s, memory) share the x axis (step or tokens, linear or log);
 * one colour per run, named in the legend. The image is written whole with the atomic
 * file helpers. */
#include "anneal/fs.h"
#include "anneal/telemetry.h"

#include <cairo-svg.h>
#include <cairo.h>
#include <cjson/cJSON.h>
#include <fontconfig/fontconfig.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

/* One series: parallel arrays of x (step, tokens) and y. */
typedef struct series {
    double *step, *tokens, *y;
    int n, cap;
} series;

enum { S_LOSS, S_VAL, S_LR, S_TPS, S_MEM, N_SERIES };

typedef struct run {
    char name[128];
    series s[N_SERIES];
} run;

static bool push(series *s, double step, double tokens, double y) {
    if (!isfinite(y)) return true;
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 256;
        double *a = realloc(s->step, (size_t)cap * sizeof *a);
        if (a) s->step = a;
        double *b = a ? realloc(s->tokens, (size_t)cap * sizeof *b) : NULL;
        if (b) s->tokens = b;
        double *c = b ? realloc(s->y, (size_t)cap * sizeof *c) : NULL;
        if (!c) return false;
        s->y = c;
        s->cap = cap;
    }
    s->step[s->n] = step, s->tokens[s->n] = tokens, s->y[s->n] = y;
    s->n++;
    return true;
}

static double num(const cJSON *o, const char *k) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(it) ? it->valuedouble : NAN;
}

static void run_free(run *r) {
    for (int i = 0; i < N_SERIES; i++) free(r->s[i].step), free(r->s[i].tokens), free(r->s[i].y);
}

/* Reads a run directory's log.jsonl (or a log file) into r. */
static anneal_status load_run(const char *arg, run *r) {
    char path[PATH_MAX];
    struct stat sb;
    if (stat(arg, &sb) != 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: %s", arg, strerror(errno));
    if (S_ISDIR(sb.st_mode)) snprintf(path, sizeof path, "%s/log.jsonl", arg);
    else snprintf(path, sizeof path, "%s", arg);
    /* the name: the run directory's last component */
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", arg);
    size_t L = strlen(tmp);
    while (L > 1 && tmp[L - 1] == '/') tmp[--L] = 0;
    const char *slash = strrchr(tmp, '/');
    const char *base = slash ? slash + 1 : tmp;
    size_t bl = strlen(base) < sizeof r->name - 1 ? strlen(base) : sizeof r->name - 1;
    memcpy(r->name, base, bl); /* a long name is cut for the legend */
    r->name[bl] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s (not a run directory?)", path, strerror(errno));
    size_t cap = 1 << 16;
    char *line = malloc(cap);
    double tokens_per_step = NAN;
    int lineno = 0, records = 0;
    anneal_status st = ANNEAL_OK;
    while (line && st == ANNEAL_OK) {
        size_t n = 0;
        int c;
        while ((c = fgetc(f)) != EOF && c != '\n') {
            if (n + 1 >= cap) {
                char *l2 = realloc(line, cap * 2);
                if (!l2) { st = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path); break; }
                line = l2, cap *= 2;
            }
            line[n++] = (char)c;
        }
        if (st != ANNEAL_OK || (c == EOF && n == 0)) break;
        line[n] = 0;
        lineno++;
        cJSON *o = cJSON_Parse(line);
        if (!o) {
            if (c == EOF) break; /* a torn last line of a crashed run */
            st = anneal_set_error(ANNEAL_ERR_FORMAT, "%s:%d: not a JSON object", path, lineno);
            break;
        }
        const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(o, "type"));
        double step = num(o, "step");
        if (type && !strcmp(type, "start")) {
            tokens_per_step = num(o, "tokens_per_step");
        } else if (type && !strcmp(type, "step") && isfinite(step)) {
            double tk = num(o, "tokens");
            if (!isfinite(tk)) tk = step * tokens_per_step;
            bool ok = push(&r->s[S_LOSS], step, tk, num(o, "loss")) && push(&r->s[S_LR], step, tk, num(o, "lr")) &&
                      push(&r->s[S_TPS], step, tk, num(o, "tokens_per_s")) &&
                      push(&r->s[S_MEM], step, tk, num(o, "memory_bytes") / 1048576.0);
            if (!ok) st = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
            records++;
        } else if (type && !strcmp(type, "eval") && isfinite(step)) {
            if (!push(&r->s[S_VAL], step, step * tokens_per_step, num(o, "val_loss")))
                st = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
            records++;
        }
        cJSON_Delete(o);
    }
    if (!line) st = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    free(line);
    fclose(f);
    if (st == ANNEAL_OK && records == 0)
        st = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no step or eval records to plot", path);
    return st;
}

/* Tick spacing for about 5 ticks over [lo, hi]: 1, 2 or 5 times a power of ten. */
static double nice_step(double lo, double hi) {
    double raw = (hi - lo) / 5;
    if (!(raw > 0)) return 1;
    double p = pow(10, floor(log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
}

/* A number for a tick label: 12k, 1.5M, 3e-04. */
static void tick_label(double v, char *b, size_t n) {
    double a = fabs(v);
    if (a == 0) snprintf(b, n, "0");
    else if (a >= 1e9) snprintf(b, n, "%gG", v / 1e9);
    else if (a >= 1e6) snprintf(b, n, "%gM", v / 1e6);
    else if (a >= 1e4) snprintf(b, n, "%gk", v / 1e3);
    else if (a < 1e-4) snprintf(b, n, "%.1e", v);
    else snprintf(b, n, "%g", v);
}

static const double palette[][3] = {{0.12, 0.47, 0.71}, {1.00, 0.50, 0.05}, {0.17, 0.63, 0.17}, {0.84, 0.15, 0.16},
                                    {0.58, 0.40, 0.74}, {0.55, 0.34, 0.29}, {0.89, 0.47, 0.76}, {0.50, 0.50, 0.50}};
#define N_COLORS ((int)(sizeof palette / sizeof palette[0]))

typedef struct panel {
    double x0, y0, w, h;          /* the plot area */
    double xlo, xhi, ylo, yhi;    /* data range (log10 of x when log_x) */
    bool log_x;
} panel;

static double px(const panel *p, double x) {
    if (p->log_x) x = log10(x);
    return p->x0 + (x - p->xlo) / (p->xhi - p->xlo) * p->w;
}
static double py(const panel *p, double y) { return p->y0 + p->h - (y - p->ylo) / (p->yhi - p->ylo) * p->h; }

/* Draws one panel: frame, grid, ticks, title, the series of every run. */
static void draw_panel(cairo_t *cr, panel *p, const char *title, const char *xlabel, const run *runs, int n_runs,
                       const int *which, int n_which, bool x_tokens) {
    double xlo = DBL_MAX, xhi = -DBL_MAX, ylo = DBL_MAX, yhi = -DBL_MAX;
    for (int r = 0; r < n_runs; r++)
        for (int k = 0; k < n_which; k++) {
            const series *s = &runs[r].s[which[k]];
            for (int i = 0; i < s->n; i++) {
                double x = x_tokens ? s->tokens[i] : s->step[i];
                if (!isfinite(x) || (p->log_x && x <= 0)) continue;
                if (p->log_x) x = log10(x);
                xlo = fmin(xlo, x), xhi = fmax(xhi, x), ylo = fmin(ylo, s->y[i]), yhi = fmax(yhi, s->y[i]);
            }
        }
    bool empty = xlo > xhi;
    if (empty) xlo = 0, xhi = 1, ylo = 0, yhi = 1;
    if (xhi - xlo < 1e-12) xhi = xlo + 1;
    double pad = (yhi - ylo) * 0.05;
    if (pad < 1e-12) pad = fabs(yhi) * 0.05 + 1e-9;
    p->xlo = xlo, p->xhi = xhi, p->ylo = ylo - pad, p->yhi = yhi + pad;

    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_rectangle(cr, p->x0, p->y0, p->w, p->h);
    cairo_fill(cr);
    cairo_set_font_size(cr, 11);
    cairo_set_line_width(cr, 1);
    char b[32];
    cairo_text_extents_t te;
    /* y ticks and grid */
    double ys = nice_step(p->ylo, p->yhi);
    for (double v = ceil(p->ylo / ys) * ys; v <= p->yhi; v += ys) {
        double y = py(p, v);
        cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
        cairo_move_to(cr, p->x0, y), cairo_line_to(cr, p->x0 + p->w, y), cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        tick_label(fabs(v) < ys * 1e-6 ? 0 : v, b, sizeof b);
        cairo_text_extents(cr, b, &te);
        cairo_move_to(cr, p->x0 - te.x_advance - 5, y + 4), cairo_show_text(cr, b);
    }
    /* x ticks: decades on a log axis */
    double xs = p->log_x ? 1 : nice_step(p->xlo, p->xhi);
    for (double v = ceil(p->xlo / xs) * xs; v <= p->xhi + 1e-9; v += xs) {
        double x = p->x0 + (v - p->xlo) / (p->xhi - p->xlo) * p->w;
        cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
        cairo_move_to(cr, x, p->y0), cairo_line_to(cr, x, p->y0 + p->h), cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        tick_label(p->log_x ? pow(10, v) : v, b, sizeof b);
        cairo_text_extents(cr, b, &te);
        cairo_move_to(cr, x - te.x_advance / 2, p->y0 + p->h + 15), cairo_show_text(cr, b);
    }
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    cairo_rectangle(cr, p->x0, p->y0, p->w, p->h);
    cairo_stroke(cr);
    cairo_set_font_size(cr, 13);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_text_extents(cr, title, &te);
    cairo_move_to(cr, p->x0 + p->w / 2 - te.x_advance / 2, p->y0 - 8), cairo_show_text(cr, title);
    cairo_set_font_size(cr, 11);
    cairo_text_extents(cr, xlabel, &te);
    cairo_move_to(cr, p->x0 + p->w / 2 - te.x_advance / 2, p->y0 + p->h + 30), cairo_show_text(cr, xlabel);
    if (empty) {
        cairo_move_to(cr, p->x0 + p->w / 2 - 20, p->y0 + p->h / 2), cairo_show_text(cr, "no data");
        return;
    }
    /* the curves, clipped to the plot area */
    cairo_save(cr);
    cairo_rectangle(cr, p->x0, p->y0, p->w, p->h);
    cairo_clip(cr);
    cairo_set_line_width(cr, 1.6);
    for (int r = 0; r < n_runs; r++)
        for (int k = 0; k < n_which; k++) {
            const series *s = &runs[r].s[which[k]];
            const double *c = palette[r % N_COLORS];
            cairo_set_source_rgb(cr, c[0], c[1], c[2]);
            bool val = which[k] == S_VAL;
            double dash[] = {6, 4};
            cairo_set_dash(cr, dash, val ? 2 : 0, 0);
            bool started = false;
            for (int i = 0; i < s->n; i++) {
                double x = x_tokens ? s->tokens[i] : s->step[i];
                if (!isfinite(x) || (p->log_x && x <= 0)) continue;
                if (started) cairo_line_to(cr, px(p, x), py(p, s->y[i]));
                else cairo_move_to(cr, px(p, x), py(p, s->y[i])), started = true;
            }
            cairo_stroke(cr);
            if (val) /* markers at the evaluations */
                for (int i = 0; i < s->n; i++) {
                    double x = x_tokens ? s->tokens[i] : s->step[i];
                    if (!isfinite(x) || (p->log_x && x <= 0)) continue;
                    cairo_arc(cr, px(p, x), py(p, s->y[i]), 3, 0, 2 * M_PI);
                    cairo_fill(cr);
                }
            cairo_set_dash(cr, NULL, 0, 0);
        }
    cairo_restore(cr);
}

/* The figure on any surface of w x h. */
static void draw(cairo_surface_t *surf, double W, double H, const run *runs, int n_runs, const anneal_plot_options *o) {
    cairo_t *cr = cairo_create(surf);
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_source_rgb(cr, 0.97, 0.97, 0.97);
    cairo_paint(cr);
    /* legend: a row at the top, one entry per run (plus the line styles of the loss) */
    double lx = 20, ly = 22;
    cairo_set_font_size(cr, 12);
    cairo_text_extents_t te;
    for (int r = 0; r < n_runs; r++) {
        const double *c = palette[r % N_COLORS];
        cairo_set_source_rgb(cr, c[0], c[1], c[2]);
        cairo_set_line_width(cr, 3);
        cairo_move_to(cr, lx, ly - 4), cairo_line_to(cr, lx + 22, ly - 4), cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0, 0, 0);
        cairo_move_to(cr, lx + 28, ly), cairo_show_text(cr, runs[r].name);
        cairo_text_extents(cr, runs[r].name, &te);
        lx += 28 + te.x_advance + 24;
    }
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    const char *styles = "loss: solid = train, dashed with dots = validation";
    cairo_text_extents(cr, styles, &te);
    cairo_move_to(cr, W - te.x_advance - 20, ly), cairo_show_text(cr, styles);
    const char *xlabel = o->x_tokens ? (o->log_x ? "tokens (log)" : "tokens") : (o->log_x ? "step (log)" : "step");
    double top = 60, left = 70, gapx = 80, gapy = 70, bottom = 45, right = 20;
    double pw = (W - left - right - gapx) / 2, ph = (H - top - bottom - gapy) / 2;
    static const char *titles[] = {"loss (nats/token)", "learning rate", "throughput (tokens/s)", "memory (MiB)"};
    int loss[] = {S_LOSS, S_VAL}, lr[] = {S_LR}, tps[] = {S_TPS}, mem[] = {S_MEM};
    const int *which[] = {loss, lr, tps, mem};
    int nw[] = {2, 1, 1, 1};
    for (int i = 0; i < 4; i++) {
        panel p = {.x0 = left + (i % 2) * (pw + gapx), .y0 = top + (i / 2) * (ph + gapy), .w = pw, .h = ph,
                   .log_x = o->log_x};
        draw_panel(cr, &p, titles[i], xlabel, runs, n_runs, which[i], nw[i], o->x_tokens);
    }
    cairo_destroy(cr);
}

/* Cairo's stream writer into a growing buffer. */
typedef struct membuf {
    unsigned char *p;
    size_t n, cap;
    bool oom;
} membuf;

static cairo_status_t mem_write(void *closure, const unsigned char *data, unsigned int len) {
    membuf *m = closure;
    if (m->n + len > m->cap) {
        size_t cap = (m->n + len) * 2;
        unsigned char *p = realloc(m->p, cap);
        if (!p) {
            m->oom = true;
            return CAIRO_STATUS_WRITE_ERROR;
        }
        m->p = p, m->cap = cap;
    }
    memcpy(m->p + m->n, data, len);
    m->n += len;
    return CAIRO_STATUS_SUCCESS;
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcasecmp(s + a - b, suf);
}

anneal_status anneal_plot_runs(int n_runs, const char *const *paths, const anneal_plot_options *o) {
    if (n_runs <= 0 || !paths) return anneal_set_error(ANNEAL_ERR_ARG, "plot: no run directories");
    if (!o || !o->out) return anneal_set_error(ANNEAL_ERR_ARG, "plot: --out FILE.png or FILE.svg is needed");
    bool svg = ends_with(o->out, ".svg");
    if (!svg && !ends_with(o->out, ".png"))
        return anneal_set_error(ANNEAL_ERR_ARG, "--out %s: the format follows the extension: .png or .svg", o->out);
    int W = o->width > 0 ? o->width : 1200, H = o->height > 0 ? o->height : 800;
    if (W < 320 || H < 240 || W > 16384 || H > 16384)
        return anneal_set_error(ANNEAL_ERR_ARG, "plot: size %dx%d out of range (320x240 to 16384x16384)", W, H);
    run *runs = calloc((size_t)n_runs, sizeof *runs);
    if (!runs) return anneal_set_error(ANNEAL_ERR_OOM, "plot: out of memory");
    anneal_status st = ANNEAL_OK;
    for (int i = 0; i < n_runs && st == ANNEAL_OK; i++) st = load_run(paths[i], &runs[i]);
    membuf mb = {0};
    if (st == ANNEAL_OK) {
        cairo_surface_t *surf = svg ? cairo_svg_surface_create_for_stream(mem_write, &mb, W, H)
                                    : cairo_image_surface_create(CAIRO_FORMAT_RGB24, W, H);
        draw(surf, W, H, runs, n_runs, o);
        if (!svg && cairo_surface_status(surf) == CAIRO_STATUS_SUCCESS)
            cairo_surface_write_to_png_stream(surf, mem_write, &mb);
        cairo_surface_finish(surf);
        cairo_status_t cs = cairo_surface_status(surf);
        cairo_surface_destroy(surf);
        if (cs != CAIRO_STATUS_SUCCESS || mb.oom)
            st = anneal_set_error(ANNEAL_ERR_IO, "plot %s: cairo: %s", o->out,
                                  mb.oom ? "out of memory" : cairo_status_to_string(cs));
        else st = anneal_write_file_atomic(o->out, mb.p, mb.n);
    }
    free(mb.p);
    for (int i = 0; i < n_runs; i++) run_free(&runs[i]);
    free(runs);
    return st;
}

void anneal_plot_release_caches(void) {
    cairo_debug_reset_static_data();
    FcFini();
}
