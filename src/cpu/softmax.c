/* Softmax and log-softmax over the last dim C of N rows, forward and backward.
 * Stable: each row is shifted by its max before exp, so logits of any magnitude
 * give finite results (a row holding NaN or +inf gives NaN, as in PyTorch).
 * OpenMP splits rows; row sums use 16 fixed lanes (anneal_v16f), so results do not
 * depend on the vector ISA or the thread count. */
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include <math.h>

#define L ANNEAL_VEC_LANES
#define ROW_PARALLEL_MIN 16384 /* N*C below which one thread does the whole call */
#define EXP_CHUNK 512          /* exps staged per piece when they are only summed */

/* One row: y = exp(x - max) * (1/sum), or log-softmax y = (x - max) - log(sum).
 * The exps are written by a plain elementwise loop (vectorised) and summed after,
 * from L1, in 16 lanes. */
ANNEAL_VEC_CLONES
static void softmax_fwd_row(int64_t C, const float *restrict x, float *restrict y, bool log) {
    float m = anneal_max(C, x);
    if (log) {
        float e[EXP_CHUNK];
        anneal_v16f acc = {0};
        for (int64_t c0 = 0; c0 < C; c0 += EXP_CHUNK) {
            int64_t n = C - c0 < EXP_CHUNK ? C - c0 : EXP_CHUNK;
            for (int64_t c = 0; c < n; c++) e[c] = anneal_vexpf(x[c0 + c] - m);
            anneal_v16f_accumulate(&acc, n, e);
        }
        float ls = logf(anneal_v16f_sum(&acc));
        for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) - ls;
    } else {
        for (int64_t c = 0; c < C; c++) y[c] = anneal_vexpf(x[c] - m);
        float inv = 1.0f / anneal_sum16(C, y);
        for (int64_t c = 0; c < C; c++) y[c] = y[c] * inv;
    }
}

/* One row of dx from y: softmax dx = y*(dy - sum(dy*y)); log-softmax
 * dx = dy - exp(y)*sum(dy). */
ANNEAL_VEC_CLONES
static void softmax_bwd_row(int64_t C, const float *restrict y, const float *restrict dy,
                            float *restrict dx, bool log) {
    if (log) {
        float s = anneal_sum16(C, dy);
        for (int64_t c = 0; c < C; c++) dx[c] = dy[c] - anneal_vexpf(y[c]) * s;
    } else {
        anneal_v16f acc = {0}, tdy, ty;
        int64_t c = 0;
        for (; c + L <= C; c += L) acc += ANNEAL_V16F_LOAD(dy + c) * ANNEAL_V16F_LOAD(y + c);
        anneal_v16f_load_partial(&tdy, dy + c, C - c, 0.0f);
        anneal_v16f_load_partial(&ty, y + c, C - c, 0.0f);
        acc += tdy * ty;
        float s = anneal_v16f_sum(&acc);
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
