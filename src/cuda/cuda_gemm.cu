/* The CUDA backend's matrix products: the matmul slot and anneal_cuda_gemm_f32, one path.
 *
 * Layouts. Every product goes to cuBLASLt (column-major) by the transpose trick: the
 * row-major C (M x N, row stride ldc) is the column-major C^T (N x M, ld ldc), and
 * C^T = op(B)^T op(A)^T, so cuBLASLt's A is our B and its B is our A, with m = N, n = M,
 * k = K:
 *   our B stored K x N (ld ldb): column-major N x K, ld ldb, op N;
 *   our B stored N x K (trans_b): column-major K x N, ld ldb, op T;
 *   our A stored M x K (ld lda): column-major K x M, ld lda, op N;
 *   our A stored K x M (trans_a): column-major M x K, ld lda, op T;
 *   C: column-major N x M, ld ldc, C == D (in place; beta == 0 passes beta 0).
 * A batch is one strided-batched call (BATCH_COUNT, STRIDED_BATCH_OFFSET; a stride of 0
 * broadcasts an input). A shared output (stride_c == 0, batch > 1) runs as batch calls of
 * one product in stream order: the CPU's sequential meaning. Where cuBLASLt's heuristic
 * finds no algorithm (a broadcast batch it declines, odd alignment), the batch is retried
 * one product at a time, and a product it still declines runs on a small tiled kernel of
 * this file (same rounding, f32 accumulation).
 *
 * Precision. F32: f32 operands, CUBLAS_COMPUTE_32F (no TF32), or
 * CUBLAS_COMPUTE_32F_FAST_TF32 when the context allows TF32. BF16 / F16: the f32 operands
 * are rounded to nearest even (__float2bfloat16_rn, __float2half_rn: f16 overflows to inf)
 * into dense scratch buffers (ANNEAL_CUDA_SCRATCH_GEMM_A / _B) with the same logical
 * layout (row stride padded to a multiple of 8 elements; a broadcast operand converted
 * once), then 16-bit A/B, f32 C/D, CUBLAS_COMPUTE_32F.
 *
 * Fused epilogues. At bf16 / f16 compute with beta == 0 and a 16-byte aligned bias, BIAS,
 * BIAS_GELU (GELU_BIAS) and BIAS_GELU with aux_out (GELU_AUX_BIAS: aux = the GELU input,
 * ldc a multiple of 8) run as cuBLASLt's epilogue in the product itself (bias per row of
 * cuBLASLt's column-major D = per column j of our C; GELU the tanh form, its own exp/tanh,
 * so last bits differ from the CPU's; see fusable_epilogue). Anything cuBLASLt refuses
 * (heuristic or call) runs the path below; the plan key holds the epilogue. Operands that
 * are dense round as one flat float4 array, ones whose widths are multiples of 4 by float4
 * rows (the same bits). ANNEAL_CUDA_GEMM_FUSED=0 (read on each call) turns all of this off.
 *
 * Other epilogues are not cuBLASLt's: after the product, one elementwise kernel over C adds the
 * bias, stores the pre-activation (aux_out) and applies tanh-GELU or SiLU times aux_in, in
 * the CPU's operation order (gemm_precision.c; rounded operations, no FMA contraction;
 * expf is CUDA's, so the last bit may differ from the CPU's exp). BSUM's column sums read
 * the f32 B as given, before the product: each column summed in f32 over fixed chunks of
 * 512 rows in ascending k, then the chunk sums in ascending order (no atomics; the shape
 * depends on K only; for K <= 512 exactly the CPU's sequential sum, beyond it a
 * deterministic chunked one: the one-thread-per-column sequential sum left a GPT-2 bias
 * gradient (K = B*T rows) on a few dozen warps for milliseconds). K == 0 or alpha == 0:
 * C = beta * C (beta == 0 writes zeros, never reading C), then the epilogue, as the CPU.
 *
 * Plans. One cublasLtHandle_t (ctx->cublaslt), one 32 MiB device workspace and a table of
 * plans (matmul descriptor, layouts, the heuristic's algorithm) keyed by the whole
 * shape/layout/type/alignment tuple hang on ctx->gemm_state: a steady-state step makes no
 * heuristic query, and a key always runs the same algorithm (cuBLASLt is bit-reproducible
 * run to run on the same GPU with the same algorithm). */
#include "cuda_internal.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr size_t kWorkspaceBytes = (size_t)32 << 20;
constexpr int kPlanSlots = 512;        /* open addressing, power of two */
constexpr int kPlanMax = 384;          /* flushed when this many are held */
constexpr int kRoundNone = 0, kRoundBf16 = 1, kRoundF16 = 2;

/* Everything a cuBLASLt plan depends on, in cuBLASLt's (column-major) terms. Zeroed
 * before it is filled so that memcmp compares it. */
struct plan_key {
    int64_t m, n, k;
    int64_t lda, ldb, ldc;
    int64_t sa, sb, sc;
    int64_t ld_aux;                      /* fused GELU's aux ld (0: no aux) */
    int32_t batch, ta, tb, ab_type, compute, align_a, align_b, align_c;
    int32_t epi, align_bias, align_aux; /* the fused cuBLASLt epilogue (0: none) and its pointers' alignment */
};

/* A cuBLASLt epilogue to fuse into one product (batch 1, beta 0, 16-bit compute): epi is
 * a cublasLtEpilogue_t (BIAS, GELU_BIAS or GELU_AUX_BIAS), bias the f32 bias (N), aux the
 * f32 pre-activation output with ld aux_ld (GELU_AUX_BIAS only). */
struct fused_epi {
    uint32_t epi;
    const float *bias;
    float *aux;
    int64_t aux_ld;
};

/* A cached plan: descriptors and the algorithm (or none: the heuristic found nothing). */
struct plan {
    plan_key key;
    int used;
    int has_algo;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    size_t ws;
};

/* What hangs on ctx->gemm_state. */
struct gemm_state {
    void *workspace;
    int count;
    plan slots[kPlanSlots];
};

/* One operand as cuBLASLt reads it: pointer, element type, row stride, batch stride. */
struct operand {
    const void *p;
    cudaDataType_t type;
    size_t esize;
    int64_t ld, stride;
};

/* The row-major problem after validation (see anneal_matmul_desc). */
struct problem {
    int64_t batch, M, N, K;
    bool ta, tb;
    int64_t lda, ldb, ldc, sa, sb, sc;
    float alpha, beta;
    anneal_dtype compute;
};

/* The compute's name in messages: f32, tf32, bf16, f16. */
const char *compute_name(anneal_dtype compute, bool tf32) {
    if (compute == ANNEAL_BF16) return "bf16";
    if (compute == ANNEAL_F16) return "f16";
    return tf32 ? "tf32" : "f32";
}

/* Records a failed cuBLASLt call as ANNEAL_ERR_DEVICE (ANNEAL_ERR_OOM when it ran out of
 * memory) naming the function, the status and the product; returns it. */
anneal_status lt_error(const char *func, cublasStatus_t s, const problem *p, bool tf32) {
    return anneal_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? ANNEAL_ERR_OOM : ANNEAL_ERR_DEVICE,
                            "cuda matmul: %s: %s (M=%lld, N=%lld, K=%lld, batch=%lld, compute=%s)", func,
                            cublasLtGetStatusName(s), (long long)p->M, (long long)p->N, (long long)p->K,
                            (long long)p->batch, compute_name(p->compute, tf32));
}

/* The largest power of two (at most 16) dividing the address of every matrix of the
 * batch: base and, when it moves, the batch stride in bytes. Capped at 16 (what
 * vectorised loads and TMA need) rather than cuBLASLt's default 256 so that the key,
 * hence the algorithm, hence the bits, do not depend on where the allocator placed a
 * block (it promises 64 bytes). */
int32_t alignment_of(const void *p, int64_t stride_bytes, int64_t batch) {
    uint64_t a = (uint64_t)(uintptr_t)p | 16u;
    if (batch > 1 && stride_bytes != 0) a |= (uint64_t)stride_bytes;
    return (int32_t)(a & (~a + 1)); /* lowest set bit */
}

/* Destroys a plan's descriptors and frees its slot. */
void plan_clear(plan *pl) {
    if (!pl->used) return;
    if (pl->op) cublasLtMatmulDescDestroy(pl->op);
    if (pl->la) cublasLtMatrixLayoutDestroy(pl->la);
    if (pl->lb) cublasLtMatrixLayoutDestroy(pl->lb);
    if (pl->lc) cublasLtMatrixLayoutDestroy(pl->lc);
    memset(pl, 0, sizeof *pl);
}

/* The context's handle and gemm state, created on first use (handle, workspace, empty
 * plan table). ANNEAL_OK or the error recorded. */
anneal_status state_get(anneal_cuda_ctx *c, gemm_state **out) {
    if (!c->cublaslt) {
        cublasLtHandle_t h = NULL;
        cublasStatus_t s = cublasLtCreate(&h);
        if (s != CUBLAS_STATUS_SUCCESS)
            return anneal_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? ANNEAL_ERR_OOM : ANNEAL_ERR_DEVICE,
                                    "cuda matmul: cublasLtCreate: %s", cublasLtGetStatusName(s));
        c->cublaslt = (void *)h;
    }
    if (!c->gemm_state) {
        gemm_state *st = (gemm_state *)calloc(1, sizeof(gemm_state));
        if (!st) return anneal_set_error(ANNEAL_ERR_OOM, "cuda matmul: no host memory for the plan table");
        anneal_status s = anneal_cuda_check(cudaMalloc(&st->workspace, kWorkspaceBytes), "matmul workspace");
        if (s != ANNEAL_OK) {
            free(st);
            return s;
        }
        c->gemm_state = st;
    }
    *out = (gemm_state *)c->gemm_state;
    return ANNEAL_OK;
}

/* FNV-1a of the key's bytes. */
uint64_t key_hash(const plan_key *k) {
    const unsigned char *b = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Sets one attribute of a layout / descriptor / preference; the first failure wins. */
#define LT_TRY(call, name)                                                                          \
    do {                                                                                            \
        cublasStatus_t s_ = (call);                                                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                          \
            fail = name;                                                                            \
            status = s_;                                                                            \
            goto done;                                                                              \
        }                                                                                           \
    } while (0)

/* Sets the fused epilogue of key k (k->epi != 0) on descriptor op: the epilogue, the bias
 * pointer and, for GELU_AUX_BIAS, the aux pointer and ld (the pointers are set again before
 * every call; the heuristic reads their alignment). True when cuBLASLt accepted all. */
bool set_fused(cublasLtMatmulDesc_t op, const plan_key *k, const fused_epi *fe) {
    uint32_t epi = (uint32_t)k->epi;
    const void *bias = fe->bias;
    if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) != CUBLAS_STATUS_SUCCESS)
        return false;
    if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) !=
        CUBLAS_STATUS_SUCCESS)
        return false;
    if (k->ld_aux) {
        void *aux = fe->aux;
        int64_t ld = k->ld_aux;
        if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux) !=
            CUBLAS_STATUS_SUCCESS)
            return false;
        if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld) !=
            CUBLAS_STATUS_SUCCESS)
            return false;
    }
    return true;
}

/* Builds the plan of key k into pl: descriptor, layouts, one heuristic query. A heuristic
 * that finds nothing (NOT_SUPPORTED or no result) leaves has_algo 0, which is not an
 * error; any other failure is, and clears pl. A fused key (k->epi != 0, fe its operands)
 * that cuBLASLt refuses in any way also leaves has_algo 0: the caller runs the unfused
 * path. */
anneal_status plan_build(anneal_cuda_ctx *c, plan *pl, const plan_key *k, const problem *p, bool tf32,
                         const fused_epi *fe) {
    cublasLtHandle_t h = (cublasLtHandle_t)c->cublaslt;
    const char *fail = NULL;
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulPreference_t pref = NULL;
    cublasOperation_t ta = (cublasOperation_t)k->ta, tb = (cublasOperation_t)k->tb;
    cudaDataType_t ab = (cudaDataType_t)k->ab_type;
    uint64_t ws = kWorkspaceBytes;
    uint32_t al_a = (uint32_t)k->align_a, al_b = (uint32_t)k->align_b, al_c = (uint32_t)k->align_c;
    cublasLtMatmulHeuristicResult_t res;
    int returned = 0;
    memset(pl, 0, sizeof *pl);
    pl->key = *k;
    pl->used = 1;
    LT_TRY(cublasLtMatmulDescCreate(&pl->op, (cublasComputeType_t)k->compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
    LT_TRY(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
           "cublasLtMatmulDescSetAttribute");
    LT_TRY(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
           "cublasLtMatmulDescSetAttribute");
    /* A (m x k after op): stored k x m when transposed. B (k x n): stored n x k when transposed. */
    LT_TRY(cublasLtMatrixLayoutCreate(&pl->la, ab, ta == CUBLAS_OP_N ? (uint64_t)k->m : (uint64_t)k->k,
                                      ta == CUBLAS_OP_N ? (uint64_t)k->k : (uint64_t)k->m, k->lda),
           "cublasLtMatrixLayoutCreate");
    LT_TRY(cublasLtMatrixLayoutCreate(&pl->lb, ab, tb == CUBLAS_OP_N ? (uint64_t)k->k : (uint64_t)k->n,
                                      tb == CUBLAS_OP_N ? (uint64_t)k->n : (uint64_t)k->k, k->ldb),
           "cublasLtMatrixLayoutCreate");
    LT_TRY(cublasLtMatrixLayoutCreate(&pl->lc, CUDA_R_32F, (uint64_t)k->m, (uint64_t)k->n, k->ldc),
           "cublasLtMatrixLayoutCreate");
    if (k->batch > 1) {
        int32_t nb = k->batch;
        int64_t sa = k->sa, sb = k->sb, sc = k->sc;
        LT_TRY(cublasLtMatrixLayoutSetAttribute(pl->la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb),
               "cublasLtMatrixLayoutSetAttribute");
        LT_TRY(cublasLtMatrixLayoutSetAttribute(pl->lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb),
               "cublasLtMatrixLayoutSetAttribute");
        LT_TRY(cublasLtMatrixLayoutSetAttribute(pl->lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb),
               "cublasLtMatrixLayoutSetAttribute");
        LT_TRY(cublasLtMatrixLayoutSetAttribute(pl->la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sa, sizeof sa),
               "cublasLtMatrixLayoutSetAttribute");
        LT_TRY(cublasLtMatrixLayoutSetAttribute(pl->lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sb, sizeof sb),
               "cublasLtMatrixLayoutSetAttribute");
        LT_TRY(cublasLtMatrixLayoutSetAttribute(pl->lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sc, sizeof sc),
               "cublasLtMatrixLayoutSetAttribute");
    }
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
           "cublasLtMatmulPreferenceSetAttribute");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a),
           "cublasLtMatmulPreferenceSetAttribute");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b),
           "cublasLtMatmulPreferenceSetAttribute");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c),
           "cublasLtMatmulPreferenceSetAttribute");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c),
           "cublasLtMatmulPreferenceSetAttribute");
    if (k->epi != 0 && !set_fused(pl->op, k, fe)) {
        pl->has_algo = 0; /* cuBLASLt refused the epilogue: unfused path */
        goto done;
    }
    memset(&res, 0, sizeof res);
    status = cublasLtMatmulAlgoGetHeuristic(h, pl->op, pl->la, pl->lb, pl->lc, pl->lc, pref, 1, &res, &returned);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && returned < 1) ||
        (k->epi != 0 && status != CUBLAS_STATUS_SUCCESS) ||
        (status == CUBLAS_STATUS_SUCCESS && res.state != CUBLAS_STATUS_SUCCESS) ||
        (status == CUBLAS_STATUS_INVALID_VALUE && k->batch > 1 && (k->sa == 0 || k->sb == 0))) {
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
        plan_clear(pl);
        return lt_error(fail, status, p, tf32);
    }
    return ANNEAL_OK;
}
#undef LT_TRY

/* The plan of key k: the cached one, or a new one built (flushing the table when full). */
anneal_status plan_get(anneal_cuda_ctx *c, gemm_state *st, const plan_key *k, const problem *p, bool tf32,
                       const fused_epi *fe, plan **out) {
    if (st->count >= kPlanMax) {
        for (int i = 0; i < kPlanSlots; i++) plan_clear(&st->slots[i]);
        st->count = 0;
    }
    uint64_t h = key_hash(k);
    for (int probe = 0; probe < kPlanSlots; probe++) {
        plan *pl = &st->slots[(h + (uint64_t)probe) & (kPlanSlots - 1)];
        if (pl->used && memcmp(&pl->key, k, sizeof *k) == 0) {
            *out = pl;
            return ANNEAL_OK;
        }
        if (!pl->used) {
            anneal_status s = plan_build(c, pl, k, p, tf32, fe);
            if (s != ANNEAL_OK) return s;
            st->count++;
            *out = pl;
            return ANNEAL_OK;
        }
    }
    return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda matmul: plan table full"); /* unreachable: flushed above */
}

/* One cuBLASLt call over `batch` products of p's shape on operands a (our A) and b (our
 * B), C at C with batch stride sc, with cuBLASLt's epilogue fe when fe (batch 1). *no_algo
 * is set (nothing queued) when cuBLASLt has no algorithm for it, or refused the fused
 * epilogue. */
anneal_status lt_matmul(anneal_cuda_ctx *c, gemm_state *st, const problem *p, int64_t batch, const operand *a,
                        const operand *b, float *C, int64_t sc, bool tf32, cublasComputeType_t compute,
                        const fused_epi *fe, bool *no_algo) {
    *no_algo = false;
    if (batch > INT32_MAX) {
        *no_algo = true;
        return ANNEAL_OK;
    }
    plan_key k;
    memset(&k, 0, sizeof k);
    k.m = p->N;
    k.n = p->M;
    k.k = p->K;
    k.lda = b->ld; /* cuBLASLt's A is our B */
    k.ldb = a->ld;
    k.ldc = p->ldc;
    k.batch = (int32_t)batch;
    if (batch > 1) {
        k.sa = b->stride;
        k.sb = a->stride;
        k.sc = sc;
    }
    k.ta = p->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    k.tb = p->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    k.ab_type = (int32_t)a->type;
    k.compute = (int32_t)compute;
    k.align_a = alignment_of(b->p, b->stride * (int64_t)b->esize, batch);
    k.align_b = alignment_of(a->p, a->stride * (int64_t)a->esize, batch);
    k.align_c = alignment_of(C, sc * (int64_t)sizeof(float), batch);
    if (fe) {
        k.epi = (int32_t)fe->epi;
        k.align_bias = alignment_of(fe->bias, 0, 1);
        if (fe->aux) {
            k.ld_aux = fe->aux_ld;
            k.align_aux = alignment_of(fe->aux, 0, 1);
        }
    }
    plan *pl = NULL;
    anneal_status s = plan_get(c, st, &k, p, tf32, fe, &pl);
    if (s != ANNEAL_OK) return s;
    if (!pl->has_algo || (fe && !set_fused(pl->op, &k, fe))) {
        *no_algo = true;
        return ANNEAL_OK;
    }
    float alpha = p->alpha, beta = p->beta;
    cublasStatus_t r = cublasLtMatmul((cublasLtHandle_t)c->cublaslt, pl->op, &alpha, b->p, pl->la, a->p, pl->lb,
                                      &beta, C, pl->lc, C, pl->lc, &pl->algo, st->workspace, pl->ws, c->stream);
    if (r != CUBLAS_STATUS_SUCCESS && fe) {
        pl->has_algo = 0; /* refused at run time: this key goes unfused from now on */
        *no_algo = true;
        return ANNEAL_OK;
    }
    if (r != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmul", r, p, tf32);
    return ANNEAL_OK;
}

/* ------------------------------------------------------------------ kernels */

/* x rounded to the compute precision and back (kRound*). */
template <int R>
__device__ __forceinline__ float round_to(float x) {
    if (R == kRoundBf16) return __bfloat162float(__float2bfloat16_rn(x));
    if (R == kRoundF16) return __half2float(__float2half_rn(x));
    return x;
}

/* *d = x rounded to nearest even bf16 / f16 (f16 overflows to inf, NaN stays NaN). */
__device__ __forceinline__ void store_rounded(__nv_bfloat16 *d, float x) { *d = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_rounded(__half *d, float x) { *d = __float2half_rn(x); }

/* dst (nb matrices of rows x cols, row stride ldd, batch stride sd) = src (row stride
 * lds, batch stride ss) rounded to T (nearest even). Rows over grid y, columns over x. */
template <typename T>
__global__ void convert_kernel(int64_t nb, int64_t rows, int64_t cols, const float *__restrict__ src, int64_t lds,
                               int64_t ss, T *__restrict__ dst, int64_t ldd, int64_t sd) {
    for (int64_t rr = blockIdx.y; rr < nb * rows; rr += gridDim.y) {
        int64_t bi = rr / rows, r = rr - bi * rows;
        const float *s = src + bi * ss + r * lds;
        T *d = dst + bi * sd + r * ldd;
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < cols; j += (int64_t)gridDim.x * blockDim.x) {
            store_rounded(d + j, s[j]);
        }
    }
}

/* d[0..3] = v rounded to nearest even bf16 / f16 (as store_rounded, element by element),
 * one 8-byte store: d must be 8-byte aligned. */
__device__ __forceinline__ void store4_rounded(__nv_bfloat16 *d, float4 v) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const unsigned int *>(&lo);
    u.y = *reinterpret_cast<const unsigned int *>(&hi);
    *reinterpret_cast<uint2 *>(d) = u;
}
__device__ __forceinline__ void store4_rounded(__half *d, float4 v) {
    __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const unsigned int *>(&lo);
    u.y = *reinterpret_cast<const unsigned int *>(&hi);
    *reinterpret_cast<uint2 *>(d) = u;
}

/* dst[4i .. 4i+3] = src[i] rounded to T for i < n4: a dense operand as one flat array
 * (src 16-byte, dst 8-byte aligned). Grid-stride. */
template <typename T>
__global__ void convert_flat_kernel(int64_t n4, const float4 *__restrict__ src, T *__restrict__ dst) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x)
        store4_rounded(dst + 4 * i, src[i]);
}

/* convert_kernel with 4 columns per thread: cols, lds and ss multiples of 4, src 16-byte
 * aligned, ldd a multiple of 8 and dst 16-byte aligned (so every 4-column group is 16-byte
 * aligned in src and 8-byte aligned in dst). Rows over grid y, column groups over x. */
template <typename T>
__global__ void convert_vec_kernel(int64_t nb, int64_t rows, int64_t cols, const float *__restrict__ src, int64_t lds,
                                   int64_t ss, T *__restrict__ dst, int64_t ldd, int64_t sd) {
    const int64_t c4 = cols / 4;
    for (int64_t rr = blockIdx.y; rr < nb * rows; rr += gridDim.y) {
        int64_t bi = rr / rows, r = rr - bi * rows;
        const float4 *s = reinterpret_cast<const float4 *>(src + bi * ss + r * lds);
        T *d = dst + bi * sd + r * ldd;
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < c4; j += (int64_t)gridDim.x * blockDim.x)
            store4_rounded(d + 4 * j, s[j]);
    }
}

/* tanh-GELU as the CPU's epilogue computes it: x / (1 + e^(-2u)), u = sqrt(2/pi) *
 * (x + 0.044715 x^3), every operation rounded on its own (no FMA contraction). */
__device__ __forceinline__ float gelu_tanh(float x) {
    float x3 = __fmul_rn(__fmul_rn(x, x), x);
    float u = __fmul_rn(0.7978845608028654f, __fadd_rn(x, __fmul_rn(0.044715f, x3)));
    return __fdiv_rn(x, __fadd_rn(1.0f, expf(__fmul_rn(-2.0f, u))));
}

/* silu(x) * m as the CPU computes it: x / (1 + e^(-x)), then the product. */
__device__ __forceinline__ float silu_times(float x, float m) {
    return __fmul_rn(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))), m);
}

enum { kActNone = 0, kActGelu = 1, kActSiluMul = 2 };
enum { kScaleKeep = 0, kScaleZero = 1, kScaleBeta = 2 };

/* Over nb matrices of M x N (row stride ldc, batch stride sc): v = C (kept, zeroed
 * without reading, or beta * C), v += bias[j] when bias, then by act: pre = v (when
 * pre), C = gelu(v) or silu(v) * mul[i, j]; C = v otherwise. pre and mul have row
 * stride ldc and belong to batch 1. */
__global__ void epilogue_kernel(int64_t nb, int64_t M, int64_t N, float *C, int64_t ldc, int64_t sc, int scale,
                                float beta, int act, const float *__restrict__ bias, float *pre,
                                const float *__restrict__ mul) {
    for (int64_t rr = blockIdx.y; rr < nb * M; rr += gridDim.y) {
        int64_t bi = rr / M, i = rr - bi * M;
        float *row = C + bi * sc + i * ldc;
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < N; j += (int64_t)gridDim.x * blockDim.x) {
            float v = scale == kScaleZero ? 0.0f : row[j];
            if (scale == kScaleBeta) v = __fmul_rn(beta, v);
            if (bias) v = __fadd_rn(v, bias[j]);
            if (act == kActGelu) {
                if (pre) pre[i * ldc + j] = v;
                v = gelu_tanh(v);
            } else if (act == kActSiluMul) {
                if (pre) pre[i * ldc + j] = v;
                v = silu_times(v, mul[i * ldc + j]);
            }
            row[j] = v;
        }
    }
}

constexpr int64_t kSumChunk = 512; /* rows of op(B) per partial column sum */

/* Partial column sums of op(B): part[c * N + j] = the f32 sum of op(B)[k, j] over the
 * rows k of chunk c ([c * kSumChunk, min(K, (c + 1) * kSumChunk))), added one at a time
 * in ascending k from 0.0f. Columns over x (coalesced when B is row-major K x N), chunks
 * over y (grid-stride in both). */
__global__ void colsum_partial_kernel(int64_t K, int64_t N, const float *__restrict__ B, int64_t ldb, bool tb,
                                      float *__restrict__ part) {
    const int64_t nchunks = (K + kSumChunk - 1) / kSumChunk;
    for (int64_t ch = blockIdx.y; ch < nchunks; ch += gridDim.y) {
        const int64_t k0 = ch * kSumChunk, k1 = k0 + kSumChunk < K ? k0 + kSumChunk : K;
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < N; j += (int64_t)gridDim.x * blockDim.x) {
            float t = 0.0f;
            if (!tb) {
                const float *p = B + j;
#pragma unroll 8
                for (int64_t k = k0; k < k1; k++) t = __fadd_rn(t, p[k * ldb]);
            } else {
                const float *p = B + j * ldb;
#pragma unroll 8
                for (int64_t k = k0; k < k1; k++) t = __fadd_rn(t, p[k]);
            }
            part[ch * N + j] = t;
        }
    }
}

/* sum[j] = the partial sums of column j added in ascending chunk order from 0.0f. */
__global__ void colsum_final_kernel(int64_t nchunks, int64_t N, const float *__restrict__ part,
                                    float *__restrict__ sum) {
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < N; j += (int64_t)gridDim.x * blockDim.x) {
        float t = 0.0f;
        for (int64_t ch = 0; ch < nchunks; ch++) t = __fadd_rn(t, part[ch * N + j]);
        sum[j] = t;
    }
}

constexpr int kTile = 16;

/* The fallback product: C_b = alpha * op(A_b) @ op(B_b) + beta * C_b for batches
 * [b0, b0 + gridDim.z), operands rounded by R at load, f32 accumulation in ascending k,
 * beta == 0 not reading C. 16 x 16 tiles; tiles over grid x (rows) and y (columns). */
template <int R>
__global__ void fallback_kernel(int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha, const float *A,
                                int64_t lda, int64_t sa, const float *B, int64_t ldb, int64_t sb, float beta, float *C,
                                int64_t ldc, int64_t sc, int64_t b0) {
    __shared__ float As[kTile][kTile + 1], Bs[kTile][kTile + 1];
    const int64_t bi = b0 + blockIdx.z;
    const float *Ab = A + bi * sa, *Bb = B + bi * sb;
    float *Cb = C + bi * sc;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t tiles_m = (M + kTile - 1) / kTile, tiles_n = (N + kTile - 1) / kTile;
    for (int64_t tm = blockIdx.x; tm < tiles_m; tm += gridDim.x) {
        for (int64_t tn = blockIdx.y; tn < tiles_n; tn += gridDim.y) {
            const int64_t i = tm * kTile + ty, j = tn * kTile + tx;
            float acc = 0.0f;
            for (int64_t k0 = 0; k0 < K; k0 += kTile) {
                /* As[ty][tx] = op(A)[tm*16 + ty, k0 + tx]; Bs[ty][tx] = op(B)[k0 + ty, tn*16 + tx] */
                int64_t ai = tm * kTile + ty, ak = k0 + tx;
                float av = 0.0f, bv = 0.0f;
                if (ai < M && ak < K) av = round_to<R>(ta ? Ab[ak * lda + ai] : Ab[ai * lda + ak]);
                int64_t bk = k0 + ty, bj = tn * kTile + tx;
                if (bk < K && bj < N) bv = round_to<R>(tb ? Bb[bj * ldb + bk] : Bb[bk * ldb + bj]);
                As[ty][tx] = av;
                Bs[ty][tx] = bv;
                __syncthreads();
                int64_t kk_end = K - k0 < kTile ? K - k0 : kTile;
                for (int kk = 0; kk < (int)kk_end; kk++) acc = __fadd_rn(acc, __fmul_rn(As[ty][kk], Bs[kk][tx]));
                __syncthreads();
            }
            if (i < M && j < N) {
                float *cp = Cb + i * ldc + j;
                *cp = beta == 0.0f ? alpha * acc : alpha * acc + beta * *cp;
            }
        }
    }
}

/* ------------------------------------------------------------------ drivers */

/* A 2-D launch shape over rows x cols for the row/column kernels above. */
void grid_rows_cols(int64_t rows, int64_t cols, dim3 *grid, dim3 *block) {
    int64_t gx = (cols + 255) / 256;
    if (gx > 64) gx = 64;
    if (gx < 1) gx = 1;
    int64_t gy = rows < 65535 ? rows : 65535;
    if (gy < 1) gy = 1;
    *grid = dim3((unsigned)gx, (unsigned)gy, 1);
    *block = dim3(256, 1, 1);
}

/* Queues the epilogue kernel (see epilogue_kernel). */
anneal_status launch_epilogue(anneal_cuda_ctx *c, int64_t nb, int64_t M, int64_t N, float *C, int64_t ldc,
                              int64_t sc, int scale, float beta, int act, const float *bias, float *pre,
                              const float *mul) {
    if (nb <= 0 || M <= 0 || N <= 0) return ANNEAL_OK;
    dim3 grid, block;
    grid_rows_cols(nb * M, N, &grid, &block);
    epilogue_kernel<<<grid, block, 0, c->stream>>>(nb, M, N, C, ldc, sc, scale, beta, act, bias, pre, mul);
    return anneal_cuda_launch_check("matmul (epilogue)");
}

/* C = beta * C over every product of the batch (the K == 0 / alpha == 0 product): one
 * launch, or, for a shared C, beta applied once per product in order, as the CPU. */
anneal_status scale_c(anneal_cuda_ctx *c, const problem *p, float *C) {
    if (p->beta == 1.0f) return ANNEAL_OK;
    int scale = p->beta == 0.0f ? kScaleZero : kScaleBeta;
    if (p->sc != 0 || p->batch == 1)
        return launch_epilogue(c, p->batch, p->M, p->N, C, p->ldc, p->sc, scale, p->beta, kActNone, NULL, NULL, NULL);
    if (scale == kScaleZero) return launch_epilogue(c, 1, p->M, p->N, C, p->ldc, 0, scale, 0.0f, kActNone, NULL, NULL, NULL);
    for (int64_t i = 0; i < p->batch; i++) {
        anneal_status s = launch_epilogue(c, 1, p->M, p->N, C, p->ldc, 0, scale, p->beta, kActNone, NULL, NULL, NULL);
        if (s != ANNEAL_OK) return s;
    }
    return ANNEAL_OK;
}

/* The fallback product over batches [b0, b0 + nb) (f32 originals, rounded in the kernel). */
anneal_status fallback(anneal_cuda_ctx *c, const problem *p, const float *A, const float *B, float *C, int64_t b0,
                       int64_t nb) {
    for (int64_t done = 0; done < nb;) {
        int64_t z = nb - done < 65535 ? nb - done : 65535;
        int64_t tm = (p->M + kTile - 1) / kTile, tn = (p->N + kTile - 1) / kTile;
        dim3 grid((unsigned)(tm < 65535 ? tm : 65535), (unsigned)(tn < 65535 ? tn : 65535), (unsigned)z);
        dim3 block(kTile, kTile, 1);
        if (p->compute == ANNEAL_BF16)
            fallback_kernel<kRoundBf16><<<grid, block, 0, c->stream>>>(p->M, p->N, p->K, p->ta, p->tb, p->alpha, A,
                                                                       p->lda, p->sa, B, p->ldb, p->sb, p->beta, C,
                                                                       p->ldc, p->sc, b0 + done);
        else if (p->compute == ANNEAL_F16)
            fallback_kernel<kRoundF16><<<grid, block, 0, c->stream>>>(p->M, p->N, p->K, p->ta, p->tb, p->alpha, A,
                                                                      p->lda, p->sa, B, p->ldb, p->sb, p->beta, C,
                                                                      p->ldc, p->sc, b0 + done);
        else
            fallback_kernel<kRoundNone><<<grid, block, 0, c->stream>>>(p->M, p->N, p->K, p->ta, p->tb, p->alpha, A,
                                                                       p->lda, p->sa, B, p->ldb, p->sb, p->beta, C,
                                                                       p->ldc, p->sc, b0 + done);
        anneal_status s = anneal_cuda_launch_check("matmul (fallback)");
        if (s != ANNEAL_OK) return s;
        done += z;
    }
    return ANNEAL_OK;
}

/* False when ANNEAL_CUDA_GEMM_FUSED=0: every product then takes the original path (scalar
 * operand rounding, the epilogue kernel after the product), read on every call so that a
 * failing fused path can be switched off without a rebuild (and tests can compare both). */
bool fast_paths_enabled(void) {
    const char *e = getenv("ANNEAL_CUDA_GEMM_FUSED");
    return !(e && e[0] == '0' && e[1] == '\0');
}

/* The f32 operand X (stored rows x cols, row stride ld, batch stride stride, batch nb)
 * rounded to the 16-bit compute type into scratch `id`: dense rows padded to a multiple of
 * 8 elements, one matrix when the stride is 0. *out describes it. With fast: a dense
 * operand (ld == cols, cols a multiple of 8, matrices back to back) rounds as one flat
 * float4 array, one whose cols, ld and stride are multiples of 4 by float4 rows; the same
 * bits as the scalar kernel, which takes the rest. */
anneal_status convert_operand(anneal_cuda_ctx *c, anneal_cuda_scratch_id id, anneal_dtype compute, const float *X,
                              int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t nb, bool fast,
                              operand *out) {
    int64_t n = stride == 0 ? 1 : nb;
    int64_t ldd = (cols + 7) & ~(int64_t)7;
    int64_t sd = stride == 0 ? 0 : rows * ldd;
    size_t bytes = (size_t)(n * rows * ldd) * 2;
    void *dst = anneal_cuda_scratch(c, id, bytes);
    if (!dst) return anneal_last_status(); /* recorded by anneal_cuda_scratch */
    const bool aligned = ((uintptr_t)X & 15u) == 0 && ((uintptr_t)dst & 15u) == 0;
    const bool dense = fast && aligned && ld == cols && cols % 8 == 0 && (n == 1 || stride == rows * cols);
    const bool vec = fast && aligned && cols % 4 == 0 && ld % 4 == 0 && (n == 1 || stride % 4 == 0);
    dim3 grid, block;
    if (dense) {
        const int64_t n4 = n * rows * cols / 4;
        int64_t blocks = (n4 + 255) / 256;
        if (blocks > 4096) blocks = 4096;
        if (blocks < 1) blocks = 1;
        if (compute == ANNEAL_BF16) {
            convert_flat_kernel<__nv_bfloat16><<<(unsigned)blocks, 256, 0, c->stream>>>(
                n4, reinterpret_cast<const float4 *>(X), (__nv_bfloat16 *)dst);
            out->type = CUDA_R_16BF;
        } else {
            convert_flat_kernel<__half><<<(unsigned)blocks, 256, 0, c->stream>>>(
                n4, reinterpret_cast<const float4 *>(X), (__half *)dst);
            out->type = CUDA_R_16F;
        }
    } else if (vec) {
        grid_rows_cols(n * rows, cols / 4, &grid, &block);
        if (compute == ANNEAL_BF16) {
            convert_vec_kernel<__nv_bfloat16><<<grid, block, 0, c->stream>>>(n, rows, cols, X, ld, stride,
                                                                             (__nv_bfloat16 *)dst, ldd, sd);
            out->type = CUDA_R_16BF;
        } else {
            convert_vec_kernel<__half><<<grid, block, 0, c->stream>>>(n, rows, cols, X, ld, stride, (__half *)dst,
                                                                      ldd, sd);
            out->type = CUDA_R_16F;
        }
    } else if (compute == ANNEAL_BF16) {
        grid_rows_cols(n * rows, cols, &grid, &block);
        convert_kernel<__nv_bfloat16><<<grid, block, 0, c->stream>>>(n, rows, cols, X, ld, stride,
                                                                     (__nv_bfloat16 *)dst, ldd, sd);
        out->type = CUDA_R_16BF;
    } else {
        grid_rows_cols(n * rows, cols, &grid, &block);
        convert_kernel<__half><<<grid, block, 0, c->stream>>>(n, rows, cols, X, ld, stride, (__half *)dst, ldd, sd);
        out->type = CUDA_R_16F;
    }
    anneal_status s = anneal_cuda_launch_check("matmul (operand rounding)");
    if (s != ANNEAL_OK) return s;
    out->p = dst;
    out->esize = 2;
    out->ld = ldd;
    out->stride = sd;
    return ANNEAL_OK;
}

/* The product of p (batch, M, N > 0) without epilogue: C_i = alpha op(A_i) op(B_i) +
 * beta C_i, through cuBLASLt where it has an algorithm, else the fallback kernel. With fe
 * (batch 1, K > 0, alpha != 0, 16-bit compute: the caller checks) cuBLASLt is first asked
 * for the product with that epilogue fused; *fused_done says whether it ran (else the
 * plain product ran and the caller applies its epilogue). */
anneal_status product(anneal_cuda_ctx *c, const problem *p, float *C, const float *A, const float *B,
                      const fused_epi *fe = NULL, bool *fused_done = NULL) {
    if (fused_done) *fused_done = false;
    if (p->K <= 0 || p->alpha == 0.0f) return scale_c(c, p, C);
    const bool fast = fast_paths_enabled();
    gemm_state *st = NULL;
    anneal_status s = state_get(c, &st);
    if (s != ANNEAL_OK) return s;
    const bool tf32 = p->compute == ANNEAL_F32 && c->allow_tf32;
    const cublasComputeType_t ct = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    operand a, b;
    if (p->compute == ANNEAL_F32) {
        a = operand{A, CUDA_R_32F, 4, p->lda, p->sa};
        b = operand{B, CUDA_R_32F, 4, p->ldb, p->sb};
    } else {
        s = convert_operand(c, ANNEAL_CUDA_SCRATCH_GEMM_A, p->compute, A, p->ta ? p->K : p->M, p->ta ? p->M : p->K,
                            p->lda, p->sa, p->batch, fast, &a);
        if (s != ANNEAL_OK) return s;
        s = convert_operand(c, ANNEAL_CUDA_SCRATCH_GEMM_B, p->compute, B, p->tb ? p->N : p->K, p->tb ? p->K : p->N,
                            p->ldb, p->sb, p->batch, fast, &b);
        if (s != ANNEAL_OK) return s;
    }
    bool no_algo = false;
    if (fe && fast && p->batch == 1 && p->compute != ANNEAL_F32) {
        s = lt_matmul(c, st, p, 1, &a, &b, C, 0, tf32, ct, fe, &no_algo);
        if (s != ANNEAL_OK) return s;
        if (!no_algo) {
            if (fused_done) *fused_done = true;
            return ANNEAL_OK;
        }
    }
    if (p->batch == 1 || p->sc != 0) {
        s = lt_matmul(c, st, p, p->batch, &a, &b, C, p->sc, tf32, ct, NULL, &no_algo);
        if (s != ANNEAL_OK || !no_algo) return s;
        if (p->batch == 1) return fallback(c, p, A, B, C, 0, 1);
    }
    /* One product at a time, in order (a shared C, or a batch cuBLASLt declined). */
    for (int64_t i = 0; i < p->batch; i++) {
        operand ai = a, bi = b;
        ai.p = (const char *)a.p + (size_t)(i * a.stride) * a.esize;
        bi.p = (const char *)b.p + (size_t)(i * b.stride) * b.esize;
        s = lt_matmul(c, st, p, 1, &ai, &bi, C + i * p->sc, 0, tf32, ct, NULL, &no_algo);
        if (s == ANNEAL_OK && no_algo) s = fallback(c, p, A, B, C, i, 1);
        if (s != ANNEAL_OK) return s;
    }
    return ANNEAL_OK;
}

/* sum[j] = the column sums of op(B) as given (f32), zeros when K == 0: partial sums of
 * fixed chunks of kSumChunk rows in ascending k, then the partials in ascending order
 * (with one chunk, K <= kSumChunk, exactly the CPU's sequential sum). The chunking
 * depends on K only, so the bits do not depend on the GPU. */
anneal_status column_sums(anneal_cuda_ctx *c, const problem *p, const float *B, float *sum) {
    const int64_t nchunks = p->K > 0 ? (p->K + kSumChunk - 1) / kSumChunk : 0;
    int64_t bx = (p->N + 255) / 256;
    if (bx > 65535) bx = 65535;
    float *part = sum; /* nchunks <= 1: the partial is the sum (0.0f + t == t but for -0) */
    if (nchunks > 1) {
        part = (float *)anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_GEMM_C, (size_t)(nchunks * p->N) * sizeof(float));
        if (!part) return anneal_last_status();
    }
    if (nchunks == 0) {
        /* K == 0: zeros (the final kernel over no chunks) */
        colsum_final_kernel<<<(unsigned)bx, 256, 0, c->stream>>>(0, p->N, NULL, sum);
        return anneal_cuda_launch_check("matmul (bsum)");
    }
    dim3 grid((unsigned)bx, (unsigned)(nchunks < 65535 ? nchunks : 65535), 1);
    colsum_partial_kernel<<<grid, 256, 0, c->stream>>>(p->K, p->N, B, p->ldb, p->tb, part);
    anneal_status s = anneal_cuda_launch_check("matmul (bsum)");
    if (s != ANNEAL_OK || nchunks == 1) return s;
    colsum_final_kernel<<<(unsigned)bx, 256, 0, c->stream>>>(nchunks, p->N, part, sum);
    return anneal_cuda_launch_check("matmul (bsum)");
}

/* The descriptor's shape as a problem; ANNEAL_ERR_ARG / UNSUPPORTED for what it cannot be. */
anneal_status problem_of(const anneal_matmul_desc *d, problem *p) {
    if (d->compute != ANNEAL_F32 && d->compute != ANNEAL_BF16 && d->compute != ANNEAL_F16)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda matmul: compute dtype %d (f32, bf16 or f16 only)",
                                (int)d->compute);
    if (d->batch < 0 || d->M < 0 || d->N < 0 || d->K < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda matmul: negative size (batch %lld, M %lld, N %lld, K %lld)",
                                (long long)d->batch, (long long)d->M, (long long)d->N, (long long)d->K);
    *p = problem{d->batch, d->M,        d->N,        d->K,        d->trans_a, d->trans_b, d->lda,   d->ldb,
                 d->ldc,   d->stride_a, d->stride_b, d->stride_c, d->alpha,   d->beta,    d->compute};
    return ANNEAL_OK;
}

/* Whether epilogue e of p (batch 1, M, N > 0) can be cuBLASLt's, and if so *fe. cuBLASLt
 * computes D = epilogue(alpha * acc + beta * C) with the f32 bias (D's type) per row of
 * its column-major D, i.e. per column j of our row-major C, added before the activation,
 * and with GELU_AUX_BIAS stores the activation's input (our pre) in aux with ld aux_ld
 * (elements of D's type, f32). Fused only where that is surely our contract and what
 * the tests check at 2^-7: 16-bit compute, K > 0, alpha != 0, beta == 0 (C not read), a
 * bias (16-byte aligned), for GELU the tanh form (cuBLASLt's, as GPT-2 / llm.c use it)
 * and aux_out with ldc a multiple of 8 (cuBLASLt's rule), 16-byte aligned and not C. Never with
 * ANNEAL_CUDA_GEMM_FUSED=0. */
bool fusable_epilogue(const problem *p, anneal_epilogue e, const float *C, const float *bias, float *aux,
                      fused_epi *fe) {
    if (e != ANNEAL_EPILOGUE_BIAS && e != ANNEAL_EPILOGUE_BIAS_GELU) return false;
    if (p->compute != ANNEAL_BF16 && p->compute != ANNEAL_F16) return false;
    if (p->batch != 1 || p->K <= 0 || p->alpha == 0.0f || p->beta != 0.0f) return false;
    if (!bias || ((uintptr_t)bias & 15u) != 0) return false;
    if (!fast_paths_enabled()) return false;
    fe->bias = bias;
    fe->aux = NULL;
    fe->aux_ld = 0;
    if (e == ANNEAL_EPILOGUE_BIAS) {
        fe->epi = CUBLASLT_EPILOGUE_BIAS;
    } else if (!aux) {
        fe->epi = CUBLASLT_EPILOGUE_GELU_BIAS;
    } else {
        if (p->ldc % 8 != 0 || ((uintptr_t)aux & 15u) != 0 || aux == C) return false;
        fe->epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
        fe->aux = aux;
        fe->aux_ld = p->ldc;
    }
    return true;
}

/* The matmul slot (see anneal_matmul_desc): the product, then the epilogue (batch 1). */
anneal_status cuda_matmul(void *ctx, const anneal_matmul_desc *d, anneal_tensor *c_t, const anneal_tensor *a_t,
                          const anneal_tensor *b_t) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status s = anneal_cuda_ensure(c);
    if (s != ANNEAL_OK) return s;
    if (a_t->dtype != ANNEAL_F32 || b_t->dtype != ANNEAL_F32 || c_t->dtype != ANNEAL_F32)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda matmul: f32 tensors only");
    problem p = {};
    s = problem_of(d, &p);
    if (s != ANNEAL_OK) return s;
    float *C = (float *)anneal_data(c_t);
    const float *A = (const float *)anneal_data(a_t), *B = (const float *)anneal_data(b_t);
    if ((unsigned)d->epilogue >= ANNEAL_EPILOGUE_COUNT)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda matmul: unknown epilogue %d", (int)d->epilogue);
    if (d->epilogue == ANNEAL_EPILOGUE_NONE || p.batch != 1) {
        if (d->epilogue != ANNEAL_EPILOGUE_NONE)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "cuda matmul: epilogues apply to a single product, not a batch of %lld",
                                    (long long)p.batch);
        if (p.batch == 0 || p.M == 0 || p.N == 0) return ANNEAL_OK;
        return product(c, &p, C, A, B);
    }
    /* batch 1 with an epilogue: its operands as the CPU requires them */
    const anneal_epilogue e = d->epilogue;
    if ((e == ANNEAL_EPILOGUE_BIAS && !d->bias) || (e == ANNEAL_EPILOGUE_SILU_MUL && !d->aux_in) ||
        (e == ANNEAL_EPILOGUE_BSUM && !d->bsum))
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda matmul: epilogue %d without its operand", (int)e);
    const anneal_tensor *ts[4] = {d->bias, d->aux_in, d->aux_out, d->bsum};
    for (int i = 0; i < 4; i++)
        if (ts[i] && ts[i]->dtype != ANNEAL_F32)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda matmul: f32 epilogue operands only");
    if (p.N == 0) return ANNEAL_OK;
    if (e == ANNEAL_EPILOGUE_BSUM) {
        s = column_sums(c, &p, B, (float *)anneal_data(d->bsum));
        if (s != ANNEAL_OK) return s;
    }
    if (p.M == 0) return ANNEAL_OK;
    const float *bias = d->bias ? (const float *)anneal_data(d->bias) : NULL;
    /* BIAS and BIAS_GELU with a bias fuse into cuBLASLt (see fusable_epilogue) */
    fused_epi fe;
    bool fused_done = false;
    const bool fuse = fusable_epilogue(&p, e, C, bias, d->aux_out ? (float *)anneal_data(d->aux_out) : NULL, &fe);
    s = product(c, &p, C, A, B, fuse ? &fe : NULL, &fused_done);
    if (s != ANNEAL_OK || e == ANNEAL_EPILOGUE_BSUM || fused_done) return s;
    float *pre = NULL;
    const float *mul = NULL;
    int act = kActNone;
    if (e == ANNEAL_EPILOGUE_BIAS_GELU) {
        act = kActGelu;
        pre = d->aux_out ? (float *)anneal_data(d->aux_out) : NULL;
    } else if (e == ANNEAL_EPILOGUE_SILU_MUL) {
        act = kActSiluMul;
        pre = d->aux_out ? (float *)anneal_data(d->aux_out) : NULL;
        mul = (const float *)anneal_data(d->aux_in);
    }
    if (act == kActNone && !bias) return ANNEAL_OK;
    return launch_epilogue(c, 1, p.M, p.N, C, p.ldc, 0, kScaleKeep, 1.0f, act, bias, pre, mul);
}

} // namespace

/* Fills the matmul slot. */
extern "C" void anneal_cuda_table_gemm(anneal_backend *b) { b->matmul = cuda_matmul; }

/* True for f32 tensors, compute f32 / bf16 / f16, a known epilogue, and an epilogue only
 * on a single product: what cuda_matmul runs. */
extern "C" bool anneal_cuda_supports_gemm(const anneal_op_query *q) {
    if (q->dtype != ANNEAL_F32) return false;
    const anneal_matmul_desc *d = q->matmul;
    if (!d) return true;
    if (d->compute != ANNEAL_F32 && d->compute != ANNEAL_BF16 && d->compute != ANNEAL_F16) return false;
    if ((unsigned)d->epilogue >= ANNEAL_EPILOGUE_COUNT) return false;
    if (d->epilogue != ANNEAL_EPILOGUE_NONE && d->batch > 1) return false;
    return true;
}

/* C = alpha op(A) op(B) + beta C on raw f32 device pointers laid out by d (its epilogue
 * ignored): the matmul slot's product path. */
extern "C" anneal_status anneal_cuda_gemm_f32(anneal_cuda_ctx *c, const anneal_matmul_desc *d, float *C,
                                              const float *A, const float *B) {
    anneal_status s = anneal_cuda_ensure(c);
    if (s != ANNEAL_OK) return s;
    problem p = {};
    s = problem_of(d, &p);
    if (s != ANNEAL_OK) return s;
    if (p.batch == 0 || p.M == 0 || p.N == 0) return ANNEAL_OK;
    return product(c, &p, C, A, B);
}
