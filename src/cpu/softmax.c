/* Softmax and log-softmax over the last dim C of N rows, forward and backward.
 * Stable: each row is shifted by its max before exp, so logits of any magnitude
 * give finite results (a row holding NaN or +inf gives NaN, as in PyTorch).
 * OpenMP splits rows; row sums use 16 fixed lanes, so results do not depend on the
 * vector ISA or the thread count. */
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include <math.h>

#define L ANNEAL_VEC_LANES
#define ROW_PARALLEL_MIN 16384 /* N*C below which one thread does the whole call */

/* Sum of the 16 lane accumulators as a fixed pairwise tree. */
static inline float lanes_sum(const float *acc) {
    float a[L / 2];
    for (int j = 0; j < L / 2; j++) a[j] = acc[j] + acc[j + L / 2];
    for (int j = 0; j < 4; j++) a[j] = a[j] + a[j + 4];
    return ((a[0] + a[2]) + (a[1] + a[3]));
}

/* max over C floats (NaN entries are skipped here; they reach the output through exp). */
static inline float row_max(int64_t C, const float *restrict x) {
    float acc[L];
    for (int j = 0; j < L; j++) acc[j] = -__builtin_inff();
    int64_t c = 0;
    for (; c + L <= C; c += L)
        for (int j = 0; j < L; j++) acc[j] = x[c + j] > acc[j] ? x[c + j] : acc[j];
    for (int j = 0; c + j < C; j++) acc[j] = x[c + j] > acc[j] ? x[c + j] : acc[j];
    float m = acc[0];
    for (int j = 1; j < L; j++) m = acc[j] > m ? acc[j] : m;
    return m;
}

/* sum(exp(x - m)) over C floats. */
static inline float row_sum_exp(int64_t C, const float *restrict x, float m) {
    float acc[L] = {0};
    int64_t c = 0;
    for (; c + L <= C; c += L)
        for (int j = 0; j < L; j++) acc[j] += anneal_vexpf(x[c + j] - m);
    for (int j = 0; c + j < C; j++) acc[j] += anneal_vexpf(x[c + j] - m);
    return lanes_sum(acc);
}

/* e = exp(x - m) over C floats; returns sum(e) (the same lanes as row_sum_exp). */
static inline float row_store_exp(int64_t C, const float *restrict x, float m,
                                  float *restrict e) {
    float acc[L] = {0};
    int64_t c = 0;
    for (; c + L <= C; c += L)
        for (int j = 0; j < L; j++) {
            float v = anneal_vexpf(x[c + j] - m);
            e[c + j] = v;
            acc[j] += v;
        }
    for (int j = 0; c + j < C; j++) {
        float v = anneal_vexpf(x[c + j] - m);
        e[c + j] = v;
        acc[j] += v;
    }
    return lanes_sum(acc);
}

/* One row: y = exp(x - max) * (1/sum), or log-softmax y = (x - max) - log(sum). */
ANNEAL_VEC_CLONES
static void softmax_fwd_row(int64_t C, const float *restrict x, float *restrict y, bool log) {
    float m = row_max(C, x);
    if (log) {
        float ls = logf(row_sum_exp(C, x, m));
        for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) - ls;
    } else {
        float inv = 1.0f / row_store_exp(C, x, m, y);
        for (int64_t c = 0; c < C; c++) y[c] = y[c] * inv;
    }
}

/* One row of dx from y: softmax dx = y*(dy - sum(dy*y)); log-softmax
 * dx = dy - exp(y)*sum(dy). */
ANNEAL_VEC_CLONES
static void softmax_bwd_row(int64_t C, const float *restrict y, const float *restrict dy,
                            float *restrict dx, bool log) {
    float acc[L] = {0};
    int64_t c = 0;
    if (log) {
        for (; c + L <= C; c += L)
            for (int j = 0; j < L; j++) acc[j] += dy[c + j];
        for (int j = 0; c + j < C; j++) acc[j] += dy[c + j];
        float s = lanes_sum(acc);
        for (c = 0; c < C; c++) dx[c] = dy[c] - anneal_vexpf(y[c]) * s;
    } else {
        for (; c + L <= C; c += L)
            for (int j = 0; j < L; j++) acc[j] += dy[c + j] * y[c + j];
        for (int j = 0; c + j < C; j++) acc[j] += dy[c + j] * y[c + j];
        float s = lanes_sum(acc);
        for (c = 0; c < C; c++) dx[c] = y[c] * (dy[c] - s);
    }
}

/* Softmax (or log-softmax) of each of N rows of C. */
void anneal_cpu_softmax_fwd(int64_t N, int64_t C, const float *x, float *y, bool log) {
#pragma omp parallel for schedule(static) if (N * C >= ROW_PARALLEL_MIN)
    for (int64_t i = 0; i < N; i++) softmax_fwd_row(C, x + i * C, y + i * C, log);
}

/* Gradient of softmax (or log-softmax) from its output y and dy. */
void anneal_cpu_softmax_bwd(int64_t N, int64_t C, const float *y, const float *dy, float *dx,
                            bool log) {
#pragma omp parallel for schedule(static) if (N * C >= ROW_PARALLEL_MIN)
    for (int64_t i = 0; i < N; i++) softmax_bwd_row(C, y + i * C, dy + i * C, dx + i * C, log);
}
