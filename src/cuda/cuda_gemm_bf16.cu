/* anneal_cuda_gemm16: one cuBLASLt product on 16-bit operands with f32 output, for the
 * backend's composite kernels (see cuda_gemm_bf16.h).
 *
 * Layouts by the transpose trick (as cuda_gemm.cu): the row-major C (M x N, ldc) is the
 * column-major C^T (N x M, ld ldc) = op(B)^T op(A)^T, so cuBLASLt's A is our B and its B
 * is our A, with m = N, n = M, k = K:
 *   our B stored K x N (ldb): column-major N x K, op N; stored N x K (tb): K x N, op T;
 *   our A stored M x K (lda): column-major K x M, op N; stored K x M (ta): M x K, op T.
 * Plans (descriptor, layouts, the heuristic's algorithm) are cached per (shape, layout,
 * type, alignment) key in a small table of this file, with this file's own
 * cublasLtHandle_t (one context per process), so a steady state makes no heuristic query
 * and a key always runs the same algorithm. */
#include "cuda_gemm_bf16.h"

#include <cublasLt.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int kPlans = 64; /* flushed when full */

/* What a plan depends on (zeroed before filling, compared with memcmp). */
struct key16 {
    int64_t m, n, k, lda, ldb, ldc;
    int32_t ta, tb, ab_type, align_a, align_b, align_c;
    int64_t ws;
};

/* A cached plan: descriptors and the algorithm (has_algo 0: the heuristic found none). */
struct plan16 {
    key16 key;
    int used, has_algo;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    size_t ws;
};

/* The file's state: its handle and plans. */
struct state16 {
    cublasLtHandle_t handle;
    int count;
    plan16 plans[kPlans];
};

state16 g_state; /* zero: no handle yet */

/* The largest power of two, at most 16, dividing the address p (pointer alignment the
 * key records, so an algorithm never needs more than the pointer has). */
int32_t align_of(const void *p) {
    uint64_t a = (uint64_t)(uintptr_t)p | 16u;
    return (int32_t)(a & (~a + 1));
}

/* Destroys a plan's descriptors and frees its slot. */
void plan16_clear(plan16 *pl) {
    if (!pl->used) return;
    if (pl->op) cublasLtMatmulDescDestroy(pl->op);
    if (pl->la) cublasLtMatrixLayoutDestroy(pl->la);
    if (pl->lb) cublasLtMatrixLayoutDestroy(pl->lb);
    if (pl->lc) cublasLtMatrixLayoutDestroy(pl->lc);
    memset(pl, 0, sizeof *pl);
}

/* Records a failed cuBLASLt call (OOM or DEVICE) naming the function and the product. */
anneal_status err16(const char *func, cublasStatus_t s, const key16 *k) {
    return anneal_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? ANNEAL_ERR_OOM : ANNEAL_ERR_DEVICE,
                            "cuda gemm16: %s: %s (m=%lld, n=%lld, k=%lld)", func, cublasLtGetStatusName(s),
                            (long long)k->m, (long long)k->n, (long long)k->k);
}

#define TRY16(call, name)                                                                           \
    do {                                                                                            \
        cublasStatus_t s_ = (call);                                                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                          \
            fail = name;                                                                            \
            status = s_;                                                                            \
            goto done;                                                                              \
        }                                                                                           \
    } while (0)

/* Builds the plan of key k into pl (one heuristic query). No algorithm leaves has_algo 0
 * (not an error); any other failure clears pl and is returned. */
anneal_status plan16_build(plan16 *pl, const key16 *k) {
    const char *fail = NULL;
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulPreference_t pref = NULL;
    cublasOperation_t ta = (cublasOperation_t)k->ta, tb = (cublasOperation_t)k->tb;
    cudaDataType_t ab = (cudaDataType_t)k->ab_type;
    uint64_t ws = (uint64_t)k->ws;
    uint32_t al_a = (uint32_t)k->align_a, al_b = (uint32_t)k->align_b, al_c = (uint32_t)k->align_c;
    cublasLtMatmulHeuristicResult_t res;
    int returned = 0;
    memset(pl, 0, sizeof *pl);
    pl->key = *k;
    pl->used = 1;
    TRY16(cublasLtMatmulDescCreate(&pl->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    TRY16(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
          "cublasLtMatmulDescSetAttribute");
    TRY16(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
          "cublasLtMatmulDescSetAttribute");
    /* A (m x k after op): stored k x m when transposed. B (k x n): stored n x k when transposed. */
    TRY16(cublasLtMatrixLayoutCreate(&pl->la, ab, ta == CUBLAS_OP_N ? (uint64_t)k->m : (uint64_t)k->k,
                                     ta == CUBLAS_OP_N ? (uint64_t)k->k : (uint64_t)k->m, k->lda),
          "cublasLtMatrixLayoutCreate");
    TRY16(cublasLtMatrixLayoutCreate(&pl->lb, ab, tb == CUBLAS_OP_N ? (uint64_t)k->k : (uint64_t)k->n,
                                     tb == CUBLAS_OP_N ? (uint64_t)k->n : (uint64_t)k->k, k->ldb),
          "cublasLtMatrixLayoutCreate");
    TRY16(cublasLtMatrixLayoutCreate(&pl->lc, CUDA_R_32F, (uint64_t)k->m, (uint64_t)k->n, k->ldc),
          "cublasLtMatrixLayoutCreate");
    TRY16(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    TRY16(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
          "cublasLtMatmulPreferenceSetAttribute");
    TRY16(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a),
          "cublasLtMatmulPreferenceSetAttribute");
    TRY16(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b),
          "cublasLtMatmulPreferenceSetAttribute");
    TRY16(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c),
          "cublasLtMatmulPreferenceSetAttribute");
    TRY16(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c),
          "cublasLtMatmulPreferenceSetAttribute");
    memset(&res, 0, sizeof res);
    status = cublasLtMatmulAlgoGetHeuristic(g_state.handle, pl->op, pl->la, pl->lb, pl->lc, pl->lc, pref, 1, &res,
                                            &returned);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && returned < 1) ||
        (status == CUBLAS_STATUS_SUCCESS && res.state != CUBLAS_STATUS_SUCCESS)) {
        status = CUBLAS_STATUS_SUCCESS; /* no algorithm: the caller falls back */
        pl->has_algo = 0;
    } else if (status != CUBLAS_STATUS_SUCCESS) {
        fail = "cublasLtMatmulAlgoGetHeuristic";
    } else {
        pl->algo = res.algo;
        pl->ws = res.workspaceSize;
        pl->has_algo = 1;
    }
done:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (fail) {
        key16 kk = *k;
        plan16_clear(pl);
        return err16(fail, status, &kk);
    }
    return ANNEAL_OK;
}
#undef TRY16

/* The plan of key k: cached, or built (the table flushed when full). */
anneal_status plan16_get(const key16 *k, plan16 **out) {
    for (int i = 0; i < kPlans; i++)
        if (g_state.plans[i].used && memcmp(&g_state.plans[i].key, k, sizeof *k) == 0) {
            *out = &g_state.plans[i];
            return ANNEAL_OK;
        }
    if (g_state.count >= kPlans) {
        for (int i = 0; i < kPlans; i++) plan16_clear(&g_state.plans[i]);
        g_state.count = 0;
    }
    for (int i = 0; i < kPlans; i++)
        if (!g_state.plans[i].used) {
            anneal_status s = plan16_build(&g_state.plans[i], k);
            if (s != ANNEAL_OK) return s;
            g_state.count++;
            *out = &g_state.plans[i];
            return ANNEAL_OK;
        }
    return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda gemm16: plan table full"); /* unreachable */
}

} // namespace

extern "C" anneal_status anneal_cuda_gemm16(anneal_cuda_ctx *c, anneal_dtype ab, int64_t M, int64_t N, int64_t K,
                                            bool ta, bool tb, const void *A, int64_t lda, const void *B,
                                            int64_t ldb, float *C, int64_t ldc, float beta, void *ws,
                                            size_t ws_bytes, bool *no_algo) {
    *no_algo = false;
    if (M <= 0 || N <= 0 || K <= 0 || (ab != ANNEAL_BF16 && ab != ANNEAL_F16)) {
        *no_algo = true; /* not this function's case: the caller takes another path */
        return ANNEAL_OK;
    }
    if (!g_state.handle) {
        cublasLtHandle_t h = NULL;
        cublasStatus_t s = cublasLtCreate(&h);
        if (s != CUBLAS_STATUS_SUCCESS)
            return anneal_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? ANNEAL_ERR_OOM : ANNEAL_ERR_DEVICE,
                                    "cuda gemm16: cublasLtCreate: %s", cublasLtGetStatusName(s));
        g_state.handle = h;
    }
    key16 k;
    memset(&k, 0, sizeof k);
    k.m = N;
    k.n = M;
    k.k = K;
    k.lda = ldb; /* cuBLASLt's A is our B */
    k.ldb = lda;
    k.ldc = ldc;
    k.ta = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    k.tb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    k.ab_type = ab == ANNEAL_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    k.align_a = align_of(B);
    k.align_b = align_of(A);
    k.align_c = align_of(C);
    k.ws = (int64_t)ws_bytes;
    plan16 *pl = NULL;
    anneal_status st = plan16_get(&k, &pl);
    if (st != ANNEAL_OK) return st;
    if (!pl->has_algo) {
        *no_algo = true;
        return ANNEAL_OK;
    }
    float alpha = 1.0f;
    cublasStatus_t r = cublasLtMatmul(g_state.handle, pl->op, &alpha, B, pl->la, A, pl->lb, &beta, C, pl->lc, C,
                                      pl->lc, &pl->algo, ws, pl->ws, c->stream);
    if (r != CUBLAS_STATUS_SUCCESS) return err16("cublasLtMatmul", r, &k);
    return ANNEAL_OK;
}
