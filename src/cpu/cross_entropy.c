/* Cross-entropy of logits rows against integer targets, forward (per-row loss and
 * logsumexp) and backward (softmax minus one-hot, scaled). The forward reads each
 * row once: it walks the V logits in L1-sized blocks with an online logsumexp
 * (running max, running sum rescaled when the max grows), so a 50257-wide row is
 * not streamed from memory twice. Rows split across OpenMP threads; sums use 16
 * fixed lanes and fixed blocks, so results do not depend on the ISA or thread count. */
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define CE_BLOCK 2048          /* logits per online-logsumexp block (8 KiB, stays in L1) */
#define CE_PARALLEL_MIN 16384  /* N*V below which one thread does the whole call */

/* One kept row: lse = m + log(s) with m the row max and s = sum(exp(x - m)), built
 * block by block; loss = (m - x[t]) + log(s) in double, so a large max does not cost
 * the loss its precision. */
ANNEAL_VEC_CLONES
static void ce_fwd_row(int64_t V, const float *restrict x, int32_t t, float *loss, float *lse) {
    float m = -__builtin_inff();
    double s = 0.0;
    float e[CE_BLOCK];
    for (int64_t c0 = 0; c0 < V; c0 += CE_BLOCK) {
        int64_t n = V - c0 < CE_BLOCK ? V - c0 : CE_BLOCK;
        const float *xb = x + c0;
        float bm = anneal_max(n, xb);
        if (bm == -__builtin_inff()) continue; /* all -inf: adds exp(-inf) = 0 */
        if (bm > m) {
            s *= exp((double)m - (double)bm); /* 0 when m is still -inf */
            m = bm;
        }
        for (int64_t c = 0; c < n; c++) e[c] = anneal_vexpf(xb[c] - m);
        s += anneal_sum16(n, e);
    }
    double ls = log(s);
    *lse = (float)((double)m + ls);
    *loss = (float)(((double)m - (double)x[t]) + ls);
}

/* One kept row: d = scale * (exp(x - lse) - onehot(t)). */
ANNEAL_VEC_CLONES
static void ce_bwd_row(int64_t V, const float *restrict x, int32_t t, float lse, float scale,
                       float *restrict d) {
    for (int64_t c = 0; c < V; c++) d[c] = scale * anneal_vexpf(x[c] - lse);
    d[t] = scale * (anneal_vexpf(x[t] - lse) - 1.0f);
}

/* Row i of the forward; an ignored row gets loss 0 and lse 0. */
static inline void ce_fwd_one(int64_t i, int64_t V, const float *logits, const int32_t *targets,
                              int32_t ignore_index, float *loss, float *lse) {
    if (targets[i] == ignore_index) {
        loss[i] = 0.0f;
        lse[i] = 0.0f;
    } else {
        ce_fwd_row(V, logits + i * V, targets[i], loss + i, lse + i);
    }
}

/* Per-row loss and logsumexp; ignored rows get loss 0 and lse 0. Small calls, and
 * calls from inside a parallel region (the fused lm-head loss runs it row by row),
 * open no region: libgomp allocates a team for every one-thread or nested region. */
void anneal_cpu_cross_entropy_fwd(int64_t N, int64_t V, const float *logits,
                                  const int32_t *targets, int32_t ignore_index, float *loss,
                                  float *lse) {
    if (N * V < CE_PARALLEL_MIN || omp_in_parallel()) {
        for (int64_t i = 0; i < N; i++) ce_fwd_one(i, V, logits, targets, ignore_index, loss, lse);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) ce_fwd_one(i, V, logits, targets, ignore_index, loss, lse);
}

/* dlogits = scale * (softmax - onehot) for kept rows, zeros for ignored rows. */
void anneal_cpu_cross_entropy_bwd(int64_t N, int64_t V, const float *logits,
                                  const int32_t *targets, int32_t ignore_index, const float *lse,
                                  float scale, float *dlogits) {
#pragma omp parallel for schedule(static) if (N * V >= CE_PARALLEL_MIN)
    for (int64_t i = 0; i < N; i++) {
        if (targets[i] == ignore_index)
            memset(dlogits + i * V, 0, (size_t)V * sizeof *dlogits);
        else
            ce_bwd_row(V, logits + i * V, targets[i], lse[i], scale, dlogits + i * V);
    }
}
