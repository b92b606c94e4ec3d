/* Embedding lookup (row gather) and its backward (scatter-add of gradient rows by
 * id). The backward is deterministic without atomics: threads split the columns
 * into fixed blocks and each walks the ids in order, so every dw element is the
 * same ordered sum for any thread count. */
#include "cpu/cpu_kernels.h"

#include <string.h>

#define EMB_COL_BLOCK 64           /* columns per backward work item (four cache lines) */
#define EMB_ZERO_BLOCK (1 << 16)   /* floats per zeroing work item */
#define EMB_PARALLEL_MIN 32768     /* elements below which one thread does the call */

/* y[i, :] = w[ids[i], :]. */
void anneal_cpu_embedding_fwd(int64_t N, int64_t C, const int32_t *ids, const float *w, float *y) {
#pragma omp parallel for schedule(static) if (N * C >= EMB_PARALLEL_MIN)
    for (int64_t i = 0; i < N; i++)
        memcpy(y + i * C, w + (int64_t)ids[i] * C, (size_t)C * sizeof *y);
}

/* dw[v, c0:c0+n] += dy[i, c0:c0+n] for every i with ids[i] == v, i ascending. */
static void scatter_cols(int64_t N, int64_t C, int64_t c0, int64_t n, const int32_t *ids,
                         const float *restrict dy, float *restrict dw) {
    for (int64_t i = 0; i < N; i++) {
        const float *src = dy + i * C + c0;
        float *dst = dw + (int64_t)ids[i] * C + c0;
        for (int64_t j = 0; j < n; j++) dst[j] += src[j];
    }
}

/* dw (V x C) = 0, then the scatter-add of the dy rows by id. */
void anneal_cpu_embedding_bwd(int64_t N, int64_t C, int64_t V, const int32_t *ids,
                              const float *dy, float *dw) {
    int64_t total = V * C;
    int64_t nzero = (total + EMB_ZERO_BLOCK - 1) / EMB_ZERO_BLOCK;
    int64_t nblk = (C + EMB_COL_BLOCK - 1) / EMB_COL_BLOCK;
#pragma omp parallel if (total + N * C >= EMB_PARALLEL_MIN)
    {
#pragma omp for schedule(static)
        for (int64_t k = 0; k < nzero; k++) {
            int64_t i0 = k * EMB_ZERO_BLOCK;
            int64_t len = total - i0 < EMB_ZERO_BLOCK ? total - i0 : EMB_ZERO_BLOCK;
            memset(dw + i0, 0, (size_t)len * sizeof *dw);
        }
        /* the implicit barrier above: every row is zero before any thread adds */
#pragma omp for schedule(static)
        for (int64_t k = 0; k < nblk; k++) {
            int64_t c0 = k * EMB_COL_BLOCK;
            int64_t n = C - c0 < EMB_COL_BLOCK ? C - c0 : EMB_COL_BLOCK;
            scatter_cols(N, C, c0, n, ids, dy, dw);
        }
    }
}
