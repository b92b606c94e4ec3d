/* LayerNorm and RMSNorm over the last dim C of N rows, forward and backward.
 * Row statistics are float sums over 16 fixed lanes (anneal_v16f: a fixed order, so
 * results do not depend on the vector ISA or the thread count); OpenMP splits rows.
 * The weight and bias gradients are sums over rows: threads split the columns into
 * fixed blocks and each walks every row in order (float partials over fixed 64-row
 * chunks, totals in double), so dw and db are bitwise the same for any thread count
 * and need neither atomics nor scratch. */
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include <math.h>
#include <omp.h>

#define L ANNEAL_VEC_LANES
#define ROW_PARALLEL_MIN 16384 /* N*C below which one thread does the whole call */
#define PARAM_COL_BLOCK 64     /* columns per param-gradient work item (four cache lines) */
#define PARAM_ROW_CHUNK 64     /* rows per float partial of a param gradient */

/* sum((x - m)^2) over C floats; also writes sum(x - m) to *dev_sum if non-NULL. */
ANNEAL_INLINE float row_sum_sq_dev(int64_t C, const float *restrict x, float m, float *dev_sum) {
    anneal_v16f acc = {0}, accd = {0}, vm = ANNEAL_V16F_SPLAT(m);
    int64_t c = 0;
    for (; c + L <= C; c += L) {
        anneal_v16f d = ANNEAL_V16F_LOAD(x + c) - vm;
        accd += d;
        acc += d * d;
    }
    anneal_v16f t;
    anneal_v16f_load_partial(&t, x + c, C - c, m); /* padding lanes: d = 0 */
    t -= vm;
    accd += t;
    acc += t * t;
    if (dev_sum) *dev_sum = anneal_v16f_sum(&accd);
    return anneal_v16f_sum(&acc);
}

/* ---------------------------------------------------------------- LayerNorm */

/* One row: the corrected two-pass mean and (biased) variance (Chan, Golub & LeVeque):
 * with m0 = sum(x)/C and d = x - m0, mean = m0 + sum(d)/C and
 * var = (sum(d^2) - sum(d)^2/C)/C, which removes the rounding error of m0 (large when
 * the row has a large offset); then y = (x - mean)*rstd*w + b. */
ANNEAL_VEC_CLONES
static void ln_fwd_row(int64_t C, const float *restrict x, const float *restrict w,
                       const float *restrict b, float eps, float *restrict y, float *mean_out,
                       float *rstd_out) {
    float m0 = anneal_sum16(C, x) / (float)C;
    float sd;
    float sdd = row_sum_sq_dev(C, x, m0, &sd);
    float m = m0 + sd / (float)C;
    float var = (sdd - sd * (sd / (float)C)) / (float)C;
    var = var > 0.0f ? var : 0.0f;
    float r = 1.0f / sqrtf(var + eps);
    if (b) {
        for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) * r * w[c] + b[c];
    } else {
        for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) * r * w[c];
    }
    *mean_out = m;
    *rstd_out = r;
}

/* One row of dx. With xhat = (x - mean)*rstd and g = dy*w:
 * dx = rstd * (g - mean(g) - xhat * mean(g*xhat)). */
ANNEAL_VEC_CLONES
static void ln_bwd_row(int64_t C, const float *restrict x, const float *restrict w, float m,
                       float r, const float *restrict dy, float *restrict dx) {
    anneal_v16f acc_g = {0}, acc_gx = {0}, vm = ANNEAL_V16F_SPLAT(m), vr = ANNEAL_V16F_SPLAT(r);
    int64_t c = 0;
    for (; c + L <= C; c += L) {
        anneal_v16f g = ANNEAL_V16F_LOAD(dy + c) * ANNEAL_V16F_LOAD(w + c);
        acc_g += g;
        acc_gx += g * ((ANNEAL_V16F_LOAD(x + c) - vm) * vr);
    }
    anneal_v16f tdy, tw, tx; /* padding lanes: g = 0, x - m = 0 */
    anneal_v16f_load_partial(&tdy, dy + c, C - c, 0.0f);
    anneal_v16f_load_partial(&tw, w + c, C - c, 0.0f);
    anneal_v16f_load_partial(&tx, x + c, C - c, m);
    anneal_v16f g = tdy * tw;
    acc_g += g;
    acc_gx += g * ((tx - vm) * vr);
    float mg = anneal_v16f_sum(&acc_g) / (float)C;
    float mgx = anneal_v16f_sum(&acc_gx) / (float)C;
    for (c = 0; c < C; c++) {
        float xhat = (x[c] - m) * r;
        dx[c] = r * (dy[c] * w[c] - mg - xhat * mgx);
    }
}

/* dw[c0:c0+n] = sum over rows of dy*xhat, db likewise of dy, rows in order: float
 * partial sums over PARAM_ROW_CHUNK rows (fixed boundaries), added into double
 * totals. Either output may be NULL. */
ANNEAL_VEC_CLONES
static void ln_param_cols(int64_t N, int64_t C, int64_t c0, int64_t n, const float *restrict x,
                          const float *restrict mean, const float *restrict rstd,
                          const float *restrict dy, float *restrict dw, float *restrict db) {
    double aw[PARAM_COL_BLOCK] = {0}, ab[PARAM_COL_BLOCK] = {0};
    for (int64_t i0 = 0; i0 < N; i0 += PARAM_ROW_CHUNK) {
        int64_t i1 = N - i0 < PARAM_ROW_CHUNK ? N : i0 + PARAM_ROW_CHUNK;
        float pw[PARAM_COL_BLOCK] = {0}, pb[PARAM_COL_BLOCK] = {0};
        for (int64_t i = i0; i < i1; i++) {
            const float *xr = x + i * C + c0, *dyr = dy + i * C + c0;
            float m = mean[i], r = rstd[i];
            for (int64_t j = 0; j < n; j++) {
                pw[j] += dyr[j] * ((xr[j] - m) * r);
                pb[j] += dyr[j];
            }
        }
        for (int64_t j = 0; j < n; j++) aw[j] += pw[j], ab[j] += pb[j];
    }
    for (int64_t j = 0; j < n; j++) {
        if (dw) dw[c0 + j] = (float)aw[j];
        if (db) db[c0 + j] = (float)ab[j];
    }
}

/* LayerNorm forward over N rows of C; writes y, mean, rstd. b may be NULL. Small calls
 * and calls from inside a parallel region (the fused add+LayerNorm runs it on row
 * blocks) open no region: libgomp allocates a team for every nested or one-thread one. */
void anneal_cpu_layer_norm_fwd(int64_t N, int64_t C, const float *x, const float *w,
                               const float *b, float eps, float *y, float *mean, float *rstd) {
    if (N * C < ROW_PARALLEL_MIN || omp_in_parallel()) {
        for (int64_t i = 0; i < N; i++) ln_fwd_row(C, x + i * C, w, b, eps, y + i * C, mean + i, rstd + i);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++)
        ln_fwd_row(C, x + i * C, w, b, eps, y + i * C, mean + i, rstd + i);
}

/* LayerNorm backward: dx per row, dw/db per column block; any output may be NULL. */
void anneal_cpu_layer_norm_bwd(int64_t N, int64_t C, const float *x, const float *w,
                               const float *mean, const float *rstd, const float *dy, float *dx,
                               float *dw, float *db) {
    int64_t nblk = (C + PARAM_COL_BLOCK - 1) / PARAM_COL_BLOCK;
    bool params = dw || db;
    if (N * C < ROW_PARALLEL_MIN || omp_in_parallel()) { /* the same work, no region (as forward) */
        for (int64_t i = 0; dx && i < N; i++)
            ln_bwd_row(C, x + i * C, w, mean[i], rstd[i], dy + i * C, dx + i * C);
        for (int64_t k = 0; params && k < nblk; k++) {
            int64_t c0 = k * PARAM_COL_BLOCK;
            ln_param_cols(N, C, c0, C - c0 < PARAM_COL_BLOCK ? C - c0 : PARAM_COL_BLOCK, x, mean, rstd, dy, dw,
                          db);
        }
        return;
    }
#pragma omp parallel
    {
        if (dx) {
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < N; i++)
                ln_bwd_row(C, x + i * C, w, mean[i], rstd[i], dy + i * C, dx + i * C);
        }
        if (params) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < nblk; k++) {
                int64_t c0 = k * PARAM_COL_BLOCK;
                int64_t n = C - c0 < PARAM_COL_BLOCK ? C - c0 : PARAM_COL_BLOCK;
                ln_param_cols(N, C, c0, n, x, mean, rstd, dy, dw, db);
            }
        }
    }
}

/* ------------------------------------------------------------------ RMSNorm */

/* One row: rstd = 1/sqrt(mean(x^2) + eps), y = x*rstd*w. */
ANNEAL_VEC_CLONES
static void rms_fwd_row(int64_t C, const float *restrict x, const float *restrict w, float eps,
                        float *restrict y, float *rstd_out) {
    float ms = row_sum_sq_dev(C, x, 0.0f, NULL) / (float)C;
    float r = 1.0f / sqrtf(ms + eps);
    for (int64_t c = 0; c < C; c++) y[c] = x[c] * r * w[c];
    *rstd_out = r;
}

/* One row of dx. With g = dy*w: dx = rstd * (g - x * rstd^2 * mean(g*x)). */
ANNEAL_VEC_CLONES
static void rms_bwd_row(int64_t C, const float *restrict x, const float *restrict w, float r,
                        const float *restrict dy, float *restrict dx) {
    anneal_v16f acc = {0};
    int64_t c = 0;
    for (; c + L <= C; c += L)
        acc += ANNEAL_V16F_LOAD(dy + c) * ANNEAL_V16F_LOAD(w + c) * ANNEAL_V16F_LOAD(x + c);
    anneal_v16f tdy, tw, tx; /* padding lanes add 0 */
    anneal_v16f_load_partial(&tdy, dy + c, C - c, 0.0f);
    anneal_v16f_load_partial(&tw, w + c, C - c, 0.0f);
    anneal_v16f_load_partial(&tx, x + c, C - c, 0.0f);
    acc += tdy * tw * tx;
    float k = r * r * (anneal_v16f_sum(&acc) / (float)C);
    for (c = 0; c < C; c++) dx[c] = r * (dy[c] * w[c] - x[c] * k);
}

/* dw[c0:c0+n] = sum over rows of dy*x*rstd, rows in order, chunked like ln_param_cols. */
ANNEAL_VEC_CLONES
static void rms_param_cols(int64_t N, int64_t C, int64_t c0, int64_t n, const float *restrict x,
                           const float *restrict rstd, const float *restrict dy,
                           float *restrict dw) {
    double aw[PARAM_COL_BLOCK] = {0};
    for (int64_t i0 = 0; i0 < N; i0 += PARAM_ROW_CHUNK) {
        int64_t i1 = N - i0 < PARAM_ROW_CHUNK ? N : i0 + PARAM_ROW_CHUNK;
        float pw[PARAM_COL_BLOCK] = {0};
        for (int64_t i = i0; i < i1; i++) {
            const float *xr = x + i * C + c0, *dyr = dy + i * C + c0;
            float r = rstd[i];
            for (int64_t j = 0; j < n; j++) pw[j] += dyr[j] * (xr[j] * r);
        }
        for (int64_t j = 0; j < n; j++) aw[j] += pw[j];
    }
    for (int64_t j = 0; j < n; j++) dw[c0 + j] = (float)aw[j];
}

/* RMSNorm forward over N rows of C; writes y and rstd. */
void anneal_cpu_rms_norm_fwd(int64_t N, int64_t C, const float *x, const float *w, float eps,
                             float *y, float *rstd) {
#pragma omp parallel for schedule(static) if (N * C >= ROW_PARALLEL_MIN)
    for (int64_t i = 0; i < N; i++) rms_fwd_row(C, x + i * C, w, eps, y + i * C, rstd + i);
}

/* RMSNorm backward: dx per row, dw per column block; either output may be NULL. */
void anneal_cpu_rms_norm_bwd(int64_t N, int64_t C, const float *x, const float *w,
                             const float *rstd, const float *dy, float *dx, float *dw) {
    int64_t nblk = (C + PARAM_COL_BLOCK - 1) / PARAM_COL_BLOCK;
#pragma omp parallel if (N * C >= ROW_PARALLEL_MIN)
    {
        if (dx) {
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < N; i++)
                rms_bwd_row(C, x + i * C, w, rstd[i], dy + i * C, dx + i * C);
        }
        if (dw) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < nblk; k++) {
                int64_t c0 = k * PARAM_COL_BLOCK;
                int64_t n = C - c0 < PARAM_COL_BLOCK ? C - c0 : PARAM_COL_BLOCK;
                rms_param_cols(N, C, c0, n, x, rstd, dy, dw);
            }
        }
    }
}
