/* LayerNorm and RMSNorm over the last dim C of N rows, forward and backward.
 * Row statistics are float sums over 16 fixed lanes (a fixed order, so results do
 * not depend on the vector ISA or the thread count); OpenMP splits rows. The weight
 * and bias gradients are sums over rows: threads split the columns into fixed
 * blocks and each walks every row in order, accumulating in double, so dw and db
 * are bitwise the same for any thread count and need neither atomics nor scratch. */
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include <math.h>

#define L ANNEAL_VEC_LANES
#define ROW_PARALLEL_MIN 16384 /* N*C below which one thread does the whole call */
#define PARAM_COL_BLOCK 32     /* columns per param-gradient work item (two cache lines) */

/* Sum of the 16 lane accumulators as a fixed pairwise tree. */
static inline float lanes_sum(const float *acc) {
    float a[L / 2];
    for (int j = 0; j < L / 2; j++) a[j] = acc[j] + acc[j + L / 2];
    for (int j = 0; j < 4; j++) a[j] = a[j] + a[j + 4];
    return ((a[0] + a[2]) + (a[1] + a[3]));
}

/* sum(x) over C floats, 16 interleaved partial sums. */
static inline float row_sum(int64_t C, const float *restrict x) {
    float acc[L] = {0};
    int64_t c = 0;
    for (; c + L <= C; c += L)
        for (int j = 0; j < L; j++) acc[j] += x[c + j];
    for (int j = 0; c + j < C; j++) acc[j] += x[c + j];
    return lanes_sum(acc);
}

/* sum((x - m)^2) over C floats; also writes sum(x - m) to *dev_sum if non-NULL. */
static inline float row_sum_sq_dev(int64_t C, const float *restrict x, float m, float *dev_sum) {
    float acc[L] = {0}, accd[L] = {0};
    int64_t c = 0;
    for (; c + L <= C; c += L)
        for (int j = 0; j < L; j++) {
            float d = x[c + j] - m;
            accd[j] += d;
            acc[j] += d * d;
        }
    for (int j = 0; c + j < C; j++) {
        float d = x[c + j] - m;
        accd[j] += d;
        acc[j] += d * d;
    }
    if (dev_sum) *dev_sum = lanes_sum(accd);
    return lanes_sum(acc);
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
    float m0 = row_sum(C, x) / (float)C;
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
    float acc_g[L] = {0}, acc_gx[L] = {0};
    int64_t c = 0;
    for (; c + L <= C; c += L)
        for (int j = 0; j < L; j++) {
            float g = dy[c + j] * w[c + j];
            acc_g[j] += g;
            acc_gx[j] += g * ((x[c + j] - m) * r);
        }
    for (int j = 0; c + j < C; j++) {
        float g = dy[c + j] * w[c + j];
        acc_g[j] += g;
        acc_gx[j] += g * ((x[c + j] - m) * r);
    }
    float mg = lanes_sum(acc_g) / (float)C;
    float mgx = lanes_sum(acc_gx) / (float)C;
    for (c = 0; c < C; c++) {
        float xhat = (x[c] - m) * r;
        dx[c] = r * (dy[c] * w[c] - mg - xhat * mgx);
    }
}

/* dw[c0:c0+n] = sum over rows of dy*xhat, db likewise of dy; double accumulators,
 * rows in order. Either output may be NULL. */
ANNEAL_VEC_CLONES
static void ln_param_cols(int64_t N, int64_t C, int64_t c0, int64_t n, const float *restrict x,
                          const float *restrict mean, const float *restrict rstd,
                          const float *restrict dy, float *restrict dw, float *restrict db) {
    double aw[PARAM_COL_BLOCK] = {0}, ab[PARAM_COL_BLOCK] = {0};
    for (int64_t i = 0; i < N; i++) {
        const float *xr = x + i * C + c0, *dyr = dy + i * C + c0;
        float m = mean[i], r = rstd[i];
        for (int64_t j = 0; j < n; j++) {
            aw[j] += (double)dyr[j] * (double)((xr[j] - m) * r);
            ab[j] += (double)dyr[j];
        }
    }
    for (int64_t j = 0; j < n; j++) {
        if (dw) dw[c0 + j] = (float)aw[j];
        if (db) db[c0 + j] = (float)ab[j];
    }
}

/* LayerNorm forward over N rows of C; writes y, mean, rstd. b may be NULL. */
void anneal_cpu_layer_norm_fwd(int64_t N, int64_t C, const float *x, const float *w,
                               const float *b, float eps, float *y, float *mean, float *rstd) {
#pragma omp parallel for schedule(static) if (N * C >= ROW_PARALLEL_MIN)
    for (int64_t i = 0; i < N; i++)
        ln_fwd_row(C, x + i * C, w, b, eps, y + i * C, mean + i, rstd + i);
}

/* LayerNorm backward: dx per row, dw/db per column block; any output may be NULL. */
void anneal_cpu_layer_norm_bwd(int64_t N, int64_t C, const float *x, const float *w,
                               const float *mean, const float *rstd, const float *dy, float *dx,
                               float *dw, float *db) {
    int64_t nblk = (C + PARAM_COL_BLOCK - 1) / PARAM_COL_BLOCK;
    bool params = dw || db;
#pragma omp parallel if (N * C >= ROW_PARALLEL_MIN)
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
    float acc[L] = {0};
    int64_t c = 0;
    for (; c + L <= C; c += L)
        for (int j = 0; j < L; j++) acc[j] += dy[c + j] * w[c + j] * x[c + j];
    for (int j = 0; c + j < C; j++) acc[j] += dy[c + j] * w[c + j] * x[c + j];
    float k = r * r * (lanes_sum(acc) / (float)C);
    for (c = 0; c < C; c++) dx[c] = r * (dy[c] * w[c] - x[c] * k);
}

/* dw[c0:c0+n] = sum over rows of dy*x*rstd, double accumulators, rows in order. */
ANNEAL_VEC_CLONES
static void rms_param_cols(int64_t N, int64_t C, int64_t c0, int64_t n, const float *restrict x,
                           const float *restrict rstd, const float *restrict dy,
                           float *restrict dw) {
    double aw[PARAM_COL_BLOCK] = {0};
    for (int64_t i = 0; i < N; i++) {
        const float *xr = x + i * C + c0, *dyr = dy + i * C + c0;
        float r = rstd[i];
        for (int64_t j = 0; j < n; j++) aw[j] += (double)dyr[j] * (double)(xr[j] * r);
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
