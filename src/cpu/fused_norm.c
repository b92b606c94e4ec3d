/* Residual add + LayerNorm in one pass over memory. Rows go in small blocks (about
 * 16 KiB per array): the block's s = x + r is written and, while it is still in L1/L2,
 * normalised by the plain LayerNorm kernel; the backward likewise adds ds to the
 * block's LayerNorm dx while it is in cache. Reusing the plain kernels on each block
 * keeps the results bitwise equal to add followed by layer_norm (and their backward),
 * at any thread count. */
#include "cpu/fused.h"
#include "cpu/cpu_kernels.h"

#define BLOCK_FLOATS 4096      /* floats per array in one row block (16 KiB) */
#define FUSED_PARALLEL_MIN 16384 /* N*C below which one thread does the whole call */

/* Rows per block for rows of C floats (at least 1). */
static int64_t block_rows(int64_t C) { return C >= BLOCK_FLOATS ? 1 : BLOCK_FLOATS / (C > 0 ? C : 1); }

/* s = x + r, y = LayerNorm(s; w, b), mean/rstd (N); x, r, s, y (N, C). */
anneal_status anneal_cpu_add_layer_norm_fwd(anneal_tensor *s, anneal_tensor *y, anneal_tensor *mean,
                                            anneal_tensor *rstd, const anneal_tensor *x,
                                            const anneal_tensor *r, const anneal_tensor *w,
                                            const anneal_tensor *b, float eps) {
    int64_t C = x->ndim ? x->shape[x->ndim - 1] : 1;
    int64_t N = C ? anneal_numel(x) / C : 0, rb = block_rows(C), nblk = (N + rb - 1) / rb;
    const float *px = anneal_data(x), *pr = anneal_data(r), *pw = anneal_data(w);
    const float *pb = b ? anneal_data(b) : NULL;
    float *ps = anneal_data(s), *py = anneal_data(y), *pm = anneal_data(mean), *pq = anneal_data(rstd);
#pragma omp parallel for schedule(static) if (N * C >= FUSED_PARALLEL_MIN)
    for (int64_t k = 0; k < nblk; k++) {
        int64_t i0 = k * rb, n = N - i0 < rb ? N - i0 : rb;
        const float *xb = px + i0 * C, *rbp = pr + i0 * C;
        float *sb = ps + i0 * C;
        for (int64_t j = 0; j < n * C; j++) sb[j] = xb[j] + rbp[j];
        anneal_cpu_layer_norm_fwd(n, C, sb, pw, pb, eps, py + i0 * C, pm + i0, pq + i0);
    }
    return ANNEAL_OK;
}

/* dx = LayerNorm dx of dy at s (+ ds); dw/db as the plain kernel (column blocks, rows
 * in order). Any output may be NULL. */
anneal_status anneal_cpu_add_layer_norm_bwd(anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                            const anneal_tensor *s, const anneal_tensor *w,
                                            const anneal_tensor *mean, const anneal_tensor *rstd,
                                            const anneal_tensor *dy, const anneal_tensor *ds) {
    int64_t C = s->ndim ? s->shape[s->ndim - 1] : 1;
    int64_t N = C ? anneal_numel(s) / C : 0, rb = block_rows(C), nblk = (N + rb - 1) / rb;
    const float *px = anneal_data(s), *pw = anneal_data(w), *pm = anneal_data(mean),
                *pq = anneal_data(rstd), *pdy = anneal_data(dy);
    const float *pds = ds ? anneal_data(ds) : NULL;
    if (dx) {
        float *pdx = anneal_data(dx);
#pragma omp parallel for schedule(static) if (N * C >= FUSED_PARALLEL_MIN)
        for (int64_t k = 0; k < nblk; k++) {
            int64_t i0 = k * rb, n = N - i0 < rb ? N - i0 : rb;
            float *d = pdx + i0 * C;
            anneal_cpu_layer_norm_bwd(n, C, px + i0 * C, pw, pm + i0, pq + i0, pdy + i0 * C, d, NULL,
                                      NULL);
            if (pds) {
                const float *g = pds + i0 * C;
                for (int64_t j = 0; j < n * C; j++) d[j] += g[j];
            }
        }
    }
    if (dw || db)
        anneal_cpu_layer_norm_bwd(N, C, px, pw, pm, pq, pdy, NULL, dw ? anneal_data(dw) : NULL,
                                  db ? anneal_data(db) : NULL);
    return ANNEAL_OK;
}
