/* lm head + softmax + cross-entropy in row chunks (as the Liger kernel does): for
 * each chunk of rows, logits = h_chunk @ w^T go into a (rows, V) workspace, the plain
 * cross-entropy kernel gives each row's loss and logsumexp, and when gradients are
 * wanted the workspace is overwritten in place with dlogits = scale*(softmax - onehot)
 * and consumed right away: dh_chunk = dlogits @ w and dw += dlogits^T @ h_chunk. No
 * (N, V) logits or logits-gradient buffer exists. Chunks run in order and every GEMM
 * and row loop is deterministic, so results do not depend on timing.
 *
 * With more than one chunk, w is packed for the GEMM kernel once per call (as w^T for the
 * logits, and as w for dh) instead of once per chunk and GEMM: the packed copies (V x C
 * each, at the compute precision's element size) live in a scope of their own and go back
 * to the caching allocator at the end. The products give the same bits either way. */
#include "cpu/fused.h"
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include "anneal/core.h"

#include <string.h>

#define ROW_PARALLEL_MIN 16384 /* rows*V below which one thread does a chunk's row loop */

/* One kept row in place: x (V logits) becomes scale * (exp(x - lse) - onehot(t)),
 * the same arithmetic as the plain cross-entropy backward. */
ANNEAL_VEC_CLONES
static void dlogits_row(int64_t V, float *restrict x, int32_t t, float lse, float scale) {
    float xt = x[t];
    for (int64_t c = 0; c < V; c++) x[c] = scale * anneal_vexpf(x[c] - lse);
    x[t] = scale * (anneal_vexpf(xt - lse) - 1.0f);
}

/* See the backend slot: per-row loss/lse, and dh (N, C) / dw (V, C) when non-NULL. */
anneal_status anneal_cpu_linear_cross_entropy(anneal_tensor *loss, anneal_tensor *lse,
                                              anneal_tensor *dh, anneal_tensor *dw,
                                              anneal_tensor *work, const anneal_tensor *h,
                                              const anneal_tensor *w, const anneal_tensor *targets,
                                              int32_t ignore_index, float scale,
                                              anneal_dtype compute) {
    int64_t N = loss->shape[0], V = w->shape[0], C = w->shape[1], CH = work->shape[0];
    const float *ph = anneal_data(h), *pw = anneal_data(w);
    const int32_t *pt = anneal_data(targets);
    float *pl = anneal_data(loss), *plse = anneal_data(lse), *buf = anneal_data(work);
    float *pdh = dh ? anneal_data(dh) : NULL, *pdw = dw ? anneal_data(dw) : NULL;
    int cd = (int)compute;
    int64_t ldc = C > 0 ? C : 1, ldv = V > 0 ? V : 1;
    if (pdw && (N == 0 || C == 0)) memset(pdw, 0, (size_t)(V * C) * sizeof *pdw);
    if (pdh && C == 0) return ANNEAL_OK;
    /* w packed once for all chunks (wt: w^T for the logits, wn: w for dh), when it pays */
    const void *wt = NULL, *wn = NULL;
    anneal_scope *packs = NULL;
    const bool clean = anneal_last_status() == ANNEAL_OK;
    if (N > CH && V > 0 && C > 0 && (packs = anneal_scope_new()) != NULL) {
        anneal_scope_enter(packs);
        int64_t nt = (int64_t)((anneal_cpu_gemm_packed_b_size(cd, C, V) + 3) / 4);
        anneal_tensor *t = anneal_empty_on(w->device, ANNEAL_F32, 1, &nt);
        if (t) anneal_cpu_gemm_pack_b(cd, true, C, V, pw, ldc, anneal_data(t)), wt = anneal_data(t);
        if (pdh) {
            int64_t nn = (int64_t)((anneal_cpu_gemm_packed_b_size(cd, V, C) + 3) / 4);
            anneal_tensor *u = anneal_empty_on(w->device, ANNEAL_F32, 1, &nn);
            if (u) anneal_cpu_gemm_pack_b(cd, false, V, C, pw, ldc, anneal_data(u)), wn = anneal_data(u);
        }
        anneal_scope_leave();
    }
    if (clean && anneal_last_status() != ANNEAL_OK)
        anneal_clear_error(); /* no room for a packed copy: the chunks pack w themselves */
    for (int64_t r0 = 0; r0 < N; r0 += CH) {
        int64_t n = N - r0 < CH ? N - r0 : CH;
        const float *hc = ph + r0 * C;
        /* logits (n, V) = h_chunk (n, C) @ w^T */
        if (wt) anneal_cpu_gemm_packed(cd, false, n, V, C, 1.0f, hc, ldc, wt, 0.0f, buf, ldv, NULL);
        else anneal_cpu_gemm(cd, false, true, n, V, C, 1.0f, hc, ldc, pw, ldc, 0.0f, buf, ldv, NULL);
        if (!pdh && !pdw) {
            anneal_cpu_cross_entropy_fwd(n, V, buf, pt + r0, ignore_index, pl + r0, plse + r0);
            continue;
        }
        /* Row by row, so each row is turned into dlogits while it is still in cache
         * (the plain kernel on one row: a nested OpenMP region runs on one thread). */
#pragma omp parallel for schedule(static) if (n * V >= ROW_PARALLEL_MIN)
        for (int64_t i = 0; i < n; i++) {
            float *row = buf + i * V;
            int64_t g = r0 + i;
            anneal_cpu_cross_entropy_fwd(1, V, row, pt + g, ignore_index, pl + g, plse + g);
            if (pt[g] == ignore_index) memset(row, 0, (size_t)V * sizeof *row);
            else dlogits_row(V, row, pt[g], plse[g], scale);
        }
        /* dh_chunk (n, C) = dlogits (n, V) @ w (V, C) */
        if (pdh && wn) anneal_cpu_gemm_packed(cd, false, n, C, V, 1.0f, buf, ldv, wn, 0.0f,
                                              pdh + r0 * C, ldc, NULL);
        else if (pdh) anneal_cpu_gemm(cd, false, false, n, C, V, 1.0f, buf, ldv, pw, ldc, 0.0f,
                                      pdh + r0 * C, ldc, NULL);
        /* dw (V, C) (+)= dlogits^T (V, n) @ h_chunk (n, C) */
        if (pdw && C > 0) anneal_cpu_gemm(cd, true, false, V, C, n, 1.0f, buf, ldv, hc, ldc,
                                          r0 == 0 ? 0.0f : 1.0f, pdw, ldc, NULL);
    }
    anneal_scope_free(packs);
    return ANNEAL_OK;
}
