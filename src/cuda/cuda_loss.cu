/* The CUDA backend's embedding and loss slots: check_index (asynchronous: the first bad
 * id is found on the device and reported by synchronize), embedding forward and
 * backward (deterministic: a stable radix sort of (id, position) pairs, then each
 * weight row sums its positions' gradient rows in position order), cross-entropy
 * forward (one block per row, max-subtracted logsumexp summed in double) and backward
 * (the scale read on the device), the kept-row mean and the chunked linear
 * cross-entropy (logits of a chunk of rows through the workspace; at f32 dlogits in
 * place and the dh and dw products through anneal_cuda_gemm_f32; at bf16/f16 w and h
 * rounded once per call, each chunk's dlogits written once in 16 bits by the row kernel,
 * every product on 16-bit operands through anneal_cuda_gemm16: see lce_16_path;
 * ANNEAL_CUDA_LCE_F32_PATH=1 switches back to the f32 path). No floating-point atomics:
 * every reduction is a fixed tree over a fixed launch shape. Kernels never read outside
 * their tensors, even for an id the (asynchronous) check has not reported yet. */
#include "cuda_internal.h"

#include "cuda_gemm_bf16.h"

#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int kThreads = 256;        /* elementwise and grid-stride kernels */
constexpr int kRowThreads = 256;     /* one block per row */
constexpr int64_t kMaxBlocks = 4096; /* grid-stride beyond this */

/* Blocks for n elements with kThreads each (at least 1, capped for grid-stride). */
unsigned grid_for(int64_t n) {
    int64_t blocks = (n + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocks) blocks = kMaxBlocks;
    return (unsigned)(blocks < 1 ? 1 : blocks);
}

/* ------------------------------------------------------- block reductions */

/* The block's maximum (fmaxf, order-free), the same value in every thread. blockDim.x
 * a multiple of 32, at most 1024; sh holds 32 floats. */
__device__ float block_max(float v, float *sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads(); /* sh may still be read by an earlier call */
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    float r = sh[0];
    for (int k = 1; k < nw; k++) r = fmaxf(r, sh[k]);
    return r;
}

/* The block's sum in double by a fixed tree (a fixed butterfly per warp, then the
 * warps' sums in warp order), the same value in every thread. sh holds 32 doubles. */
__device__ double block_sum(double v, double *sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    double r = sh[0];
    for (int k = 1; k < nw; k++) r += sh[k];
    return r;
}

/* ------------------------------------------------------------ check_index */

/* One check's device record: the first bad element as (flat index << 32) | (uint32)
 * value, by atomicMin (the index decides; it is unique). kNoBad when none. */
constexpr unsigned long long kNoBad = ~0ull;
constexpr int kMaxChecks = 1024; /* pending checks before check_index drains the stream */

/* A queued check: what the message needs, and where its record is. */
struct index_check {
    char op[64];
    char what[32];
    int ndim;
    int64_t shape[ANNEAL_MAX_DIMS];
    int64_t n;
    bool has_ignore;
    int32_t ignore_index;
    cudaStream_t stream;
};

/* c->index_state: the pending checks (record k is check k's). */
struct index_state {
    unsigned long long *records; /* kMaxChecks device words, allocated once */
    unsigned long long host[kMaxChecks];
    index_check pending[kMaxChecks];
    int npending;
};

/* records[0] = min over bad elements of (i << 32 | ids[i]); *count (when given) += the
 * kept elements (integer atomics: the sum is exact whatever the order). */
__global__ void check_index_kernel(const int32_t *ids, int64_t len, int64_t n, int has_ignore, int32_t ignore,
                                   unsigned long long *record, unsigned long long *count) {
    unsigned long long kept = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (int64_t)gridDim.x * blockDim.x) {
        int32_t t = ids[i];
        if (has_ignore && t == ignore) continue;
        if (t < 0 || (int64_t)t >= n) atomicMin(record, ((unsigned long long)i << 32) | (unsigned)t);
        else kept++;
    }
    if (count) {
        for (int o = 16; o > 0; o >>= 1) kept += __shfl_down_sync(0xffffffffu, kept, o);
        if ((threadIdx.x & 31) == 0 && kept) atomicAdd(count, kept);
    }
}

/* "[i, j, k]": the multi-index of row-major position pos in shape (the CPU's index_str). */
const char *index_str(int ndim, const int64_t *shape, int64_t pos, char *buf, size_t n) {
    int64_t idx[ANNEAL_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        idx[d] = shape[d] ? pos % shape[d] : 0;
        pos = shape[d] ? pos / shape[d] : 0;
    }
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", d ? ", " : "", (long long)idx[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

/* The state, created on first use (NULL with the error recorded on failure). */
index_state *get_index_state(anneal_cuda_ctx *c) {
    if (c->index_state) return (index_state *)c->index_state;
    index_state *st = (index_state *)calloc(1, sizeof *st);
    if (!st) {
        anneal_set_error(ANNEAL_ERR_OOM, "cuda check_index: out of host memory");
        return NULL;
    }
    if (anneal_cuda_check(cudaMalloc((void **)&st->records, kMaxChecks * sizeof(unsigned long long)),
                          "check_index") != ANNEAL_OK) {
        free(st);
        return NULL;
    }
    c->index_state = st;
    return st;
}

/* Every element of ids is ignore_index (has_ignore) or in [0, n): queued; a bad one is
 * reported by synchronize (anneal_cuda_index_checks_collect). count (I64 0-dim) gets
 * the kept elements. */
anneal_status cuda_check_index(void *ctx, const char *op, const char *what, const anneal_tensor *ids, int64_t n,
                               bool has_ignore, int32_t ignore_index, anneal_tensor *count) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t len = anneal_numel(ids);
    if (len >= (int64_t)0xFFFFFFFF)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: %lld %s values are more than the CUDA index check handles (2^32 - 1)",
                                op, (long long)len, what);
    unsigned long long *cnt = count ? (unsigned long long *)anneal_data(count) : NULL;
    if (cnt && (st = anneal_cuda_check(cudaMemsetAsync(cnt, 0, sizeof *cnt, c->stream), "check_index")) != ANNEAL_OK)
        return st;
    if (len == 0) return ANNEAL_OK;
    index_state *s = get_index_state(c);
    if (!s) return anneal_last_status();
    if (s->npending == kMaxChecks) {
        /* the records are all in use: drain and report what is pending */
        if ((st = anneal_cuda_check(cudaStreamSynchronize(c->stream), "check_index")) != ANNEAL_OK) return st;
        if ((st = anneal_cuda_index_checks_collect(c)) != ANNEAL_OK) return st;
    }
    int k = s->npending;
    unsigned long long *rec = s->records + k;
    if ((st = anneal_cuda_check(cudaMemsetAsync(rec, 0xFF, sizeof *rec, c->stream), "check_index")) != ANNEAL_OK)
        return st;
    check_index_kernel<<<grid_for(len), kThreads, 0, c->stream>>>((const int32_t *)anneal_data(ids), len, n,
                                                                  has_ignore ? 1 : 0, ignore_index, rec, cnt);
    if ((st = anneal_cuda_launch_check("check_index")) != ANNEAL_OK) return st;
    index_check *q = &s->pending[k];
    snprintf(q->op, sizeof q->op, "%s", op ? op : "");
    snprintf(q->what, sizeof q->what, "%s", what ? what : "");
    q->ndim = ids->ndim;
    for (int d = 0; d < ids->ndim; d++) q->shape[d] = ids->shape[d];
    q->n = n;
    q->has_ignore = has_ignore;
    q->ignore_index = ignore_index;
    q->stream = c->stream;
    s->npending = k + 1;
    return ANNEAL_OK;
}

/* ------------------------------------------------------------- embedding */

/* y[i, :] = w[ids[i], :]; an id outside [0, V) (reported by check_index) gives zeros. */
__global__ void embedding_fwd_kernel(float *y, const int32_t *ids, const float *w, int64_t N, int64_t C, int64_t V) {
    int64_t total = N * C;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = e / C, j = e - i * C;
        int32_t id = ids[i];
        y[e] = (id >= 0 && (int64_t)id < V) ? w[(int64_t)id * C + j] : 0.0f;
    }
}

/* y (N, C) = w[ids]. */
anneal_status cuda_embedding_fwd(void *ctx, anneal_tensor *y, const anneal_tensor *ids, const anneal_tensor *w) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N = anneal_numel(ids), V = w->shape[0], C = w->shape[1];
    if (N * C == 0) return ANNEAL_OK;
    embedding_fwd_kernel<<<grid_for(N * C), kThreads, 0, c->stream>>>(
        (float *)anneal_data(y), (const int32_t *)anneal_data(ids), (const float *)anneal_data(w), N, C, V);
    return anneal_cuda_launch_check("embedding_fwd");
}

/* keys[i] = ids[i] (V for an id outside [0, V): sorted last, summed nowhere), vals[i] = i. */
__global__ void embedding_keys_kernel(unsigned *keys, int *vals, const int32_t *ids, int64_t N, int64_t V) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (int64_t)gridDim.x * blockDim.x) {
        int32_t id = ids[i];
        keys[i] = (id >= 0 && (int64_t)id < V) ? (unsigned)id : (unsigned)V;
        vals[i] = (int)i;
    }
}

/* row_start[v] = the first k with keys[k] >= v (lower bound), v in [0, V]. */
__global__ void embedding_rows_kernel(int *row_start, const unsigned *keys, int64_t N, int64_t V) {
    for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v <= V; v += (int64_t)gridDim.x * blockDim.x) {
        int64_t lo = 0, hi = N;
        while (lo < hi) {
            int64_t mid = (lo + hi) / 2;
            if ((int64_t)keys[mid] < v) lo = mid + 1;
            else hi = mid;
        }
        row_start[v] = (int)lo;
    }
}

/* dw[v, :] = 0 + the dy rows of v's positions in ascending position order (the CPU's
 * zero-then-add order). One block per weight row (grid-stride over rows). */
__global__ void embedding_bwd_kernel(float *dw, const float *dy, const int *row_start, const int *pos, int64_t V,
                                     int64_t C) {
    for (int64_t v = blockIdx.x; v < V; v += gridDim.x) {
        int s = row_start[v], e = row_start[v + 1];
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            float acc = 0.0f;
            for (int k = s; k < e; k++) acc = __fadd_rn(acc, dy[(int64_t)pos[k] * C + j]);
            dw[v * C + j] = acc;
        }
    }
}

/* Bytes rounded up to 256 (scratch sub-buffer alignment). */
size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* dw (V, C) = the scatter-add of dy rows by id, rows in order (overwritten). */
anneal_status cuda_embedding_bwd(void *ctx, anneal_tensor *dw, const anneal_tensor *ids, const anneal_tensor *dy) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N = anneal_numel(ids), V = dw->shape[0], C = dw->shape[1];
    float *pdw = (float *)anneal_data(dw);
    if (V * C == 0) return ANNEAL_OK;
    if (N == 0)
        return anneal_cuda_check(cudaMemsetAsync(pdw, 0, (size_t)(V * C) * sizeof(float), c->stream),
                                 "embedding_bwd");
    if (N > (int64_t)0x7FFFFFFF || V >= (int64_t)0x7FFFFFFF)
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda embedding_bwd: %lld ids or %lld rows are too many",
                                (long long)N, (long long)V);
    int end_bit = 1;
    while (end_bit < 32 && ((uint64_t)1 << end_bit) <= (uint64_t)V) end_bit++; /* keys in [0, V] */
    size_t temp_bytes = 0;
    if ((st = anneal_cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, (const unsigned *)nullptr,
                                                                (unsigned *)nullptr, (const int *)nullptr,
                                                                (int *)nullptr, (int)N, 0, end_bit, c->stream),
                                "embedding_bwd")) != ANNEAL_OK)
        return st;
    size_t kb = align256((size_t)N * sizeof(unsigned)), rb = align256((size_t)(V + 1) * sizeof(int));
    char *base = (char *)anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_SORT, 4 * kb + rb + temp_bytes);
    if (!base) return anneal_last_status();
    unsigned *keys_in = (unsigned *)base, *keys_out = (unsigned *)(base + kb);
    int *vals_in = (int *)(base + 2 * kb), *vals_out = (int *)(base + 3 * kb);
    int *row_start = (int *)(base + 4 * kb);
    void *temp = base + 4 * kb + rb;
    embedding_keys_kernel<<<grid_for(N), kThreads, 0, c->stream>>>(keys_in, vals_in,
                                                                   (const int32_t *)anneal_data(ids), N, V);
    if ((st = anneal_cuda_launch_check("embedding_bwd")) != ANNEAL_OK) return st;
    /* LSD radix sort is stable and vals_in ascends: each id's positions stay ascending */
    if ((st = anneal_cuda_check(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in,
                                                                vals_out, (int)N, 0, end_bit, c->stream),
                                "embedding_bwd")) != ANNEAL_OK)
        return st;
    embedding_rows_kernel<<<grid_for(V + 1), kThreads, 0, c->stream>>>(row_start, keys_out, N, V);
    if ((st = anneal_cuda_launch_check("embedding_bwd")) != ANNEAL_OK) return st;
    int64_t blocks = V < 65535 ? V : 65535;
    int threads = C >= 256 ? 256 : (int)((C + 31) / 32 * 32);
    embedding_bwd_kernel<<<(unsigned)blocks, threads, 0, c->stream>>>(pdw, (const float *)anneal_data(dy), row_start,
                                                                     vals_out, V, C);
    return anneal_cuda_launch_check("embedding_bwd");
}

/* ---------------------------------------------------------- cross-entropy */

/* One row's loss and logsumexp in one read of the row: each thread keeps an online
 * (max m_k, sum s_k of expf(x - m_k) in double, rescaled when m_k grows); the block
 * then takes m = the row max and s = the sum of s_k * exp(m_k - m) in double by a fixed
 * tree. -inf logits add nothing (s = 0 when every logit is -inf, as the CPU skips all
 * -inf blocks). lse = (float)(m + log s), loss = (float)((m - xt) + log s) in double.
 * Every thread of the block calls it; all get the same results. */
__device__ void ce_row(const float *x, int64_t V, float xt, float *loss, float *lse) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    float mk = -INFINITY;
    double sk = 0.0;
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
        float xc = x[c];
        if (xc > mk) {
            sk = sk * (double)expf(mk - xc) + 1.0; /* 0 * 0 + 1 while mk is -inf */
            mk = xc;
        } else if (xc != -INFINITY) {
            sk += (double)expf(xc - mk); /* NaN logits make the row NaN, as on the CPU */
        }
    }
    float m = block_max(mk, shf);
    double part = mk == -INFINITY ? 0.0 : sk * exp((double)mk - (double)m);
    double s = block_sum(part, shd);
    double ls = log(s);
    *lse = (float)((double)m + ls);
    *loss = (float)(((double)m - (double)xt) + ls);
}

/* loss[i], lse[i] of row i (one block per row); ignored rows get 0 and 0. A target
 * outside [0, V) (reported by check_index) reads no logit: its loss is NaN. */
__global__ void ce_fwd_kernel(float *loss, float *lse, const float *logits, const int32_t *targets, int32_t ignore,
                              int64_t V) {
    int64_t i = blockIdx.x;
    int32_t t = targets[i];
    if (t == ignore) {
        if (threadIdx.x == 0) loss[i] = 0.0f, lse[i] = 0.0f;
        return;
    }
    const float *x = logits + i * V;
    float xt = (t >= 0 && (int64_t)t < V) ? x[t] : NAN;
    float l, e;
    ce_row(x, V, xt, &l, &e);
    if (threadIdx.x == 0) loss[i] = l, lse[i] = e;
}

/* Rows of a 2-D-or-more tensor: the product of all dims but the last. */
void rows_cols(const anneal_tensor *x, int64_t *N, int64_t *C) {
    *C = x->ndim ? x->shape[x->ndim - 1] : 1;
    *N = *C ? anneal_numel(x) / *C : 0;
}

/* Per-row loss and lse of logits (N, V) against targets (N). */
anneal_status cuda_cross_entropy_fwd(void *ctx, anneal_tensor *loss, anneal_tensor *lse, const anneal_tensor *logits,
                                     const anneal_tensor *targets, int32_t ignore_index) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, V;
    rows_cols(logits, &N, &V);
    if (N == 0) return ANNEAL_OK;
    if (N > (int64_t)0x7FFFFFFF) return anneal_set_error(ANNEAL_ERR_ARG, "cuda cross_entropy: too many rows");
    ce_fwd_kernel<<<(unsigned)N, kRowThreads, 0, c->stream>>>((float *)anneal_data(loss), (float *)anneal_data(lse),
                                                             (const float *)anneal_data(logits),
                                                             (const int32_t *)anneal_data(targets), ignore_index, V);
    return anneal_cuda_launch_check("cross_entropy_fwd");
}

/* d[c] = g * expf(x[c] - lse), and g * (expf(x[t] - lse) - 1) at the target (the CPU's
 * ce_bwd_row); each element read and written by one thread, so d may be x. */
__device__ void dlogits_row(float *d, const float *x, int64_t V, int32_t t, float lse, float g) {
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
        float e = expf(x[c] - lse);
        d[c] = c == t ? __fmul_rn(g, e - 1.0f) : __fmul_rn(g, e);
    }
}

/* The CE backward scale: (float)(s / count) in double, s = 1 when absent, 0 when count is 0. */
__device__ float ce_scale(const float *s, const int64_t *count) {
    int64_t n = *count;
    double sv = s ? (double)*s : 1.0;
    return n ? (float)(sv / (double)n) : 0.0f;
}

/* Row i of dlogits (one block per row); ignored rows (and a target outside [0, V))
 * get zeros. */
__global__ void ce_bwd_kernel(float *dlogits, const float *logits, const int32_t *targets, const float *lse,
                              int32_t ignore, const float *s, const int64_t *count, int64_t V) {
    int64_t i = blockIdx.x;
    int32_t t = targets[i];
    float *d = dlogits + i * V;
    if (t == ignore || t < 0 || (int64_t)t >= V) {
        for (int64_t c = threadIdx.x; c < V; c += blockDim.x) d[c] = 0.0f;
        return;
    }
    dlogits_row(d, logits + i * V, V, t, lse[i], ce_scale(s, count));
}

/* dlogits = (s / count) * (softmax - onehot) on kept rows, 0 on ignored ones. */
anneal_status cuda_cross_entropy_bwd(void *ctx, anneal_tensor *dlogits, const anneal_tensor *logits,
                                     const anneal_tensor *targets, const anneal_tensor *lse, int32_t ignore_index,
                                     const anneal_tensor *s, const anneal_tensor *count) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (!count) return anneal_set_error(ANNEAL_ERR_ARG, "cuda cross_entropy_bwd: count is required");
    int64_t N, V;
    rows_cols(logits, &N, &V);
    if (N == 0 || V == 0) return ANNEAL_OK;
    if (N > (int64_t)0x7FFFFFFF) return anneal_set_error(ANNEAL_ERR_ARG, "cuda cross_entropy: too many rows");
    ce_bwd_kernel<<<(unsigned)N, kRowThreads, 0, c->stream>>>(
        (float *)anneal_data(dlogits), (const float *)anneal_data(logits), (const int32_t *)anneal_data(targets),
        (const float *)anneal_data(lse), ignore_index, s ? (const float *)anneal_data(s) : NULL,
        (const int64_t *)anneal_data(count), V);
    return anneal_cuda_launch_check("cross_entropy_bwd");
}

/* ------------------------------------------------------------- loss_mean */

constexpr int kMeanThreads = 1024;

/* out = (float)(sum in double of kept rows / count): one block, thread k sums rows
 * k, k + 1024, ... in order, then the fixed tree of block_sum. */
__global__ void loss_mean_kernel(float *out, const float *rows, const int32_t *targets, int32_t ignore, int64_t N,
                                 const int64_t *count) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
        if (targets[i] != ignore) s += (double)rows[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) {
        int64_t n = *count;
        *out = (float)(n ? s / (double)n : 0.0);
    }
}

/* out (0-dim) = the mean of the kept rows' losses (0 when count is 0). */
anneal_status cuda_loss_mean(void *ctx, anneal_tensor *out, const anneal_tensor *rows, const anneal_tensor *targets,
                             int32_t ignore_index, const anneal_tensor *count) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (!count) return anneal_set_error(ANNEAL_ERR_ARG, "cuda loss_mean: count is required");
    loss_mean_kernel<<<1, kMeanThreads, 0, c->stream>>>((float *)anneal_data(out), (const float *)anneal_data(rows),
                                                        (const int32_t *)anneal_data(targets), ignore_index,
                                                        anneal_numel(rows), (const int64_t *)anneal_data(count));
    return anneal_cuda_launch_check("loss_mean");
}

/* --------------------------------------------------- linear cross-entropy */

/* Row i of a chunk (one block per row): loss/lse, then, when grad, the row of work
 * turned in place into dlogits = g * (softmax - onehot) (zeros when ignored), g = 1 /
 * count (2^15 at f16; 0 when count is 0 or absent). The target logit is read before
 * the block's first barrier, so no thread has overwritten it yet. */
__global__ void lce_rows_kernel(float *work, float *loss, float *lse, const int32_t *targets, int32_t ignore,
                                int64_t V, int grad, const int64_t *count, int f16) {
    int64_t i = blockIdx.x;
    int32_t t = targets[i];
    float *x = work + i * V;
    bool bad = t < 0 || (int64_t)t >= V;
    if (t == ignore) {
        if (threadIdx.x == 0) loss[i] = 0.0f, lse[i] = 0.0f;
        if (grad)
            for (int64_t c = threadIdx.x; c < V; c += blockDim.x) x[c] = 0.0f;
        return;
    }
    float xt = bad ? NAN : x[t];
    float l, e;
    ce_row(x, V, xt, &l, &e);
    if (threadIdx.x == 0) loss[i] = l, lse[i] = e;
    if (!grad) return;
    __syncthreads(); /* every thread's reads of x are done before any write */
    if (bad) {
        for (int64_t c = threadIdx.x; c < V; c += blockDim.x) x[c] = 0.0f;
        return;
    }
    int64_t n = count ? *count : 0;
    float g = !n ? 0.0f : f16 ? 32768.0f : (float)(1.0 / (double)n);
    dlogits_row(x, x, V, t, e, g);
}

/* A plain (batch 1, epilogue NONE) product descriptor. */
anneal_matmul_desc gemm_desc(int64_t M, int64_t N, int64_t K, bool ta, bool tb, int64_t lda, int64_t ldb,
                             int64_t ldc, float beta, anneal_dtype compute) {
    anneal_matmul_desc d;
    memset(&d, 0, sizeof d);
    d.batch = 1;
    d.M = M, d.N = N, d.K = K;
    d.trans_a = ta, d.trans_b = tb;
    d.lda = lda, d.ldb = ldb, d.ldc = ldc;
    d.alpha = 1.0f, d.beta = beta;
    d.compute = compute;
    d.epilogue = ANNEAL_EPILOGUE_NONE;
    return d;
}

/* The f32 path (and the fallback): chunks of work->shape[0] rows: logits = h_chunk @
 * w^T in work, row losses, and when dh / dw are given dlogits in place, dh_chunk =
 * dlogits @ w, dw (+)= dlogits^T @ h_chunk (dw overwritten by the first chunk), every
 * product through anneal_cuda_gemm_f32 (which rounds its f32 operands at bf16/f16). */
anneal_status lce_f32_path(void *ctx, anneal_tensor *loss, anneal_tensor *lse, anneal_tensor *dh,
                                        anneal_tensor *dw, anneal_tensor *work, const anneal_tensor *h,
                                        const anneal_tensor *w, const anneal_tensor *targets, int32_t ignore_index,
                                        const anneal_tensor *count, anneal_dtype compute) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N = loss->shape[0], V = w->shape[0], C = w->shape[1], CH = work->shape[0];
    const float *ph = (const float *)anneal_data(h), *pw = (const float *)anneal_data(w);
    const int32_t *pt = (const int32_t *)anneal_data(targets);
    float *pl = (float *)anneal_data(loss), *plse = (float *)anneal_data(lse), *buf = (float *)anneal_data(work);
    float *pdh = dh ? (float *)anneal_data(dh) : NULL, *pdw = dw ? (float *)anneal_data(dw) : NULL;
    const int64_t *pc = count ? (const int64_t *)anneal_data(count) : NULL;
    int64_t ldc = C > 0 ? C : 1, ldv = V > 0 ? V : 1;
    bool grad = pdh || pdw;
    if (pdw && (N == 0 || C == 0) && V * C > 0 &&
        (st = anneal_cuda_check(cudaMemsetAsync(pdw, 0, (size_t)(V * C) * sizeof(float), c->stream),
                                "linear_cross_entropy")) != ANNEAL_OK)
        return st;
    if (N == 0 || V == 0) return ANNEAL_OK;
    if (CH <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "cuda linear_cross_entropy: the workspace has no rows");
    if (CH > (int64_t)0x7FFFFFFF) CH = 0x7FFFFFFF;
    for (int64_t r0 = 0; r0 < N; r0 += CH) {
        int64_t n = N - r0 < CH ? N - r0 : CH;
        const float *hc = ph + r0 * C;
        /* logits (n, V) = h_chunk (n, C) @ w^T */
        if (C > 0) {
            anneal_matmul_desc d = gemm_desc(n, V, C, false, true, ldc, ldc, ldv, 0.0f, compute);
            if ((st = anneal_cuda_gemm_f32(c, &d, buf, hc, pw)) != ANNEAL_OK) return st;
        } else if ((st = anneal_cuda_check(cudaMemsetAsync(buf, 0, (size_t)(n * V) * sizeof(float), c->stream),
                                           "linear_cross_entropy")) != ANNEAL_OK) {
            return st;
        }
        lce_rows_kernel<<<(unsigned)n, kRowThreads, 0, c->stream>>>(buf, pl + r0, plse + r0, pt + r0, ignore_index,
                                                                   V, grad ? 1 : 0, pc,
                                                                   compute == ANNEAL_F16 ? 1 : 0);
        if ((st = anneal_cuda_launch_check("linear_cross_entropy")) != ANNEAL_OK) return st;
        if (!grad || C == 0) continue;
        /* dh_chunk (n, C) = dlogits (n, V) @ w (V, C) */
        if (pdh) {
            anneal_matmul_desc d = gemm_desc(n, C, V, false, false, ldv, ldc, ldc, 0.0f, compute);
            if ((st = anneal_cuda_gemm_f32(c, &d, pdh + r0 * C, buf, pw)) != ANNEAL_OK) return st;
        }
        /* dw (V, C) (+)= dlogits^T (V, n) @ h_chunk (n, C) */
        if (pdw) {
            anneal_matmul_desc d = gemm_desc(V, C, n, true, false, ldv, ldc, ldc, r0 == 0 ? 0.0f : 1.0f, compute);
            if ((st = anneal_cuda_gemm_f32(c, &d, pdw, buf, hc)) != ANNEAL_OK) return st;
        }
    }
    return ANNEAL_OK;
}

/* ------------------------------------ linear cross-entropy, 16-bit operands */

/* x rounded to nearest even into T (__nv_bfloat16 or __half; f16 overflows to inf), as
 * anneal_cuda_gemm_f32 rounds its operands. */
template <typename T> __device__ T round16(float x);
template <> __device__ __nv_bfloat16 round16<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __half round16<__half>(float x) { return __float2half_rn(x); }

/* dst (rows_d, ldd) = src (rows_s, cols_s; row stride lds) rounded to T, zeros beyond
 * src's rows and columns (the padding the 16-bit products read as K). */
template <typename T>
__global__ void round_pad_kernel(T *dst, int64_t rows_d, int64_t ldd, const float *src, int64_t rows_s,
                                 int64_t cols_s, int64_t lds) {
    int64_t total = rows_d * ldd;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = e / ldd, j = e - i * ldd;
        dst[e] = (i < rows_s && j < cols_s) ? round16<T>(src[i * lds + j]) : round16<T>(0.0f);
    }
}

/* Row i of a chunk (one block per row) with logits at x + i * ldx: loss/lse as
 * lce_rows_kernel, then, when grad, row i of d (row stride ldd >= V) = dlogits rounded
 * to T (the very values lce_rows_kernel writes in f32, rounded as the GEMM would round
 * them), zeros on ignored rows and in the padding columns [V, ldd). */
template <typename T>
__global__ void lce_rows16_kernel(T *d, int64_t ldd, const float *logits, int64_t ldx, float *loss, float *lse,
                                  const int32_t *targets, int32_t ignore, int64_t V, int grad, const int64_t *count,
                                  int f16) {
    int64_t i = blockIdx.x;
    int32_t t = targets[i];
    const float *x = logits + i * ldx;
    T *di = d ? d + i * ldd : NULL;
    bool bad = t < 0 || (int64_t)t >= V;
    if (t == ignore) {
        if (threadIdx.x == 0) loss[i] = 0.0f, lse[i] = 0.0f;
        if (grad)
            for (int64_t c = threadIdx.x; c < ldd; c += blockDim.x) di[c] = round16<T>(0.0f);
        return;
    }
    float xt = bad ? NAN : x[t];
    float l, e;
    ce_row(x, V, xt, &l, &e);
    if (threadIdx.x == 0) loss[i] = l, lse[i] = e;
    if (!grad) return;
    if (bad) {
        for (int64_t c = threadIdx.x; c < ldd; c += blockDim.x) di[c] = round16<T>(0.0f);
        return;
    }
    int64_t n = count ? *count : 0;
    float g = !n ? 0.0f : f16 ? 32768.0f : (float)(1.0 / (double)n);
    for (int64_t c = threadIdx.x; c < ldd; c += blockDim.x) {
        float v = 0.0f;
        if (c < V) {
            float ex = expf(x[c] - e);
            v = c == t ? __fmul_rn(g, ex - 1.0f) : __fmul_rn(g, ex); /* dlogits_row's value */
        }
        di[c] = round16<T>(v);
    }
}

/* n rounded up to a multiple of m. */
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

constexpr size_t kLtWorkspace = (size_t)32 << 20; /* cuBLASLt workspace of the 16-bit products */

/* The BF16/F16 path: w and h rounded ONCE per call into scratch (w16 (Vp, Cp), h16 (N,
 * Cp), zero-padded to multiples of 8 so that every 16-bit operand has 16-byte rows and
 * the padding adds exact zeros), each chunk's dlogits rounded once by the row kernel
 * into d16 (rows, Vp) and fed to both the dh and dw products; 16-bit A/B, f32 C through
 * anneal_cuda_gemm16. The chunk's logits sit in work with a row stride of V rounded up to
 * 4 floats (16-byte rows for the product's output), so a chunk holds rows = work's
 * elements / that stride (one row fewer than work->shape[0] at most, when V % 4 != 0 and
 * rows stay >= 1): a chunking of the rows that depends only on the shapes, dw summed over
 * the chunks in order (deterministic). *fallback is set, with nothing wrong recorded, when
 * cuBLASLt has no algorithm for a product: the caller reruns the call on the f32 path,
 * which overwrites every output. */
template <typename T>
anneal_status lce_16_path(anneal_cuda_ctx *c, anneal_tensor *loss, anneal_tensor *lse, anneal_tensor *dh,
                          anneal_tensor *dw, anneal_tensor *work, const anneal_tensor *h, const anneal_tensor *w,
                          const anneal_tensor *targets, int32_t ignore_index, const anneal_tensor *count,
                          anneal_dtype compute, bool *fallback) {
    anneal_status st;
    *fallback = false;
    int64_t N = loss->shape[0], V = w->shape[0], C = w->shape[1], CH = work->shape[0];
    const float *ph = (const float *)anneal_data(h), *pw = (const float *)anneal_data(w);
    const int32_t *pt = (const int32_t *)anneal_data(targets);
    float *pl = (float *)anneal_data(loss), *plse = (float *)anneal_data(lse), *buf = (float *)anneal_data(work);
    float *pdh = dh ? (float *)anneal_data(dh) : NULL, *pdw = dw ? (float *)anneal_data(dw) : NULL;
    const int64_t *pc = count ? (const int64_t *)anneal_data(count) : NULL;
    bool grad = pdh || pdw;
    int64_t Cp = round_up(C, 8), Vp = round_up(V, 8);
    int64_t ldx = round_up(V, 4), rows = CH * V / ldx;
    if (rows < 1) ldx = V, rows = CH;
    if (rows > N) rows = N;
    if (rows > (int64_t)0x7FFFFFFF) rows = 0x7FFFFFFF;
    size_t b_ws = align256(kLtWorkspace), b_w = align256((size_t)(Vp * Cp) * sizeof(T));
    size_t b_h = align256((size_t)(N * Cp) * sizeof(T)), b_d = grad ? align256((size_t)(rows * Vp) * sizeof(T)) : 0;
    char *base = (char *)anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_LOSS, b_ws + b_w + b_h + b_d);
    if (!base) return anneal_last_status();
    void *ws = base;
    T *w16 = (T *)(base + b_ws), *h16 = (T *)(base + b_ws + b_w), *d16 = grad ? (T *)(base + b_ws + b_w + b_h) : NULL;
    round_pad_kernel<T><<<grid_for(Vp * Cp), kThreads, 0, c->stream>>>(w16, Vp, Cp, pw, V, C, C);
    if ((st = anneal_cuda_launch_check("linear_cross_entropy")) != ANNEAL_OK) return st;
    round_pad_kernel<T><<<grid_for(N * Cp), kThreads, 0, c->stream>>>(h16, N, Cp, ph, N, C, C);
    if ((st = anneal_cuda_launch_check("linear_cross_entropy")) != ANNEAL_OK) return st;
    bool no_algo = false;
    for (int64_t r0 = 0; r0 < N; r0 += rows) {
        int64_t n = N - r0 < rows ? N - r0 : rows;
        const T *hc = h16 + r0 * Cp;
        /* logits (n, V; row stride ldx) = h16_chunk (n, Cp) @ w16[:V]^T */
        if ((st = anneal_cuda_gemm16(c, compute, n, V, Cp, false, true, hc, Cp, w16, Cp, buf, ldx, 0.0f, ws,
                                     kLtWorkspace, &no_algo)) != ANNEAL_OK)
            return st;
        if (no_algo) break;
        lce_rows16_kernel<T><<<(unsigned)n, kRowThreads, 0, c->stream>>>(
            d16, Vp, buf, ldx, pl + r0, plse + r0, pt + r0, ignore_index, V, grad ? 1 : 0, pc,
            compute == ANNEAL_F16 ? 1 : 0);
        if ((st = anneal_cuda_launch_check("linear_cross_entropy")) != ANNEAL_OK) return st;
        if (!grad) continue;
        /* dh_chunk (n, C) = d16 (n, Vp) @ w16 (Vp, C; row stride Cp): the padding is zeros */
        if (pdh) {
            if ((st = anneal_cuda_gemm16(c, compute, n, C, Vp, false, false, d16, Vp, w16, Cp, pdh + r0 * C, C, 0.0f,
                                         ws, kLtWorkspace, &no_algo)) != ANNEAL_OK)
                return st;
            if (no_algo) break;
        }
        /* dw (V, C) (+)= d16^T (V, n) @ h16_chunk (n, C; row stride Cp) */
        if (pdw) {
            if ((st = anneal_cuda_gemm16(c, compute, V, C, n, true, false, d16, Vp, hc, Cp, pdw, C,
                                         r0 == 0 ? 0.0f : 1.0f, ws, kLtWorkspace, &no_algo)) != ANNEAL_OK)
                return st;
            if (no_algo) break;
        }
    }
    *fallback = no_algo;
    return ANNEAL_OK;
}

/* 1 when ANNEAL_CUDA_LCE_F32_PATH is set to anything but "0": every compute takes the
 * f32 path (the switch back to the previous kernels, should the 16-bit path misbehave). */
bool lce_force_f32_path(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("ANNEAL_CUDA_LCE_F32_PATH");
        v = e && *e && strcmp(e, "0") != 0 ? 1 : 0;
    }
    return v == 1;
}

/* The slot: compute BF16/F16 with C > 0 takes lce_16_path, the rest (and the fallback)
 * lce_f32_path. */
anneal_status cuda_linear_cross_entropy(void *ctx, anneal_tensor *loss, anneal_tensor *lse, anneal_tensor *dh,
                                        anneal_tensor *dw, anneal_tensor *work, const anneal_tensor *h,
                                        const anneal_tensor *w, const anneal_tensor *targets, int32_t ignore_index,
                                        const anneal_tensor *count, anneal_dtype compute) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N = loss->shape[0], V = w->shape[0], C = w->shape[1], CH = work->shape[0];
    if ((compute == ANNEAL_BF16 || compute == ANNEAL_F16) && N > 0 && V > 0 && C > 0 && CH > 0 &&
        !lce_force_f32_path()) {
        bool fallback = false;
        st = compute == ANNEAL_BF16
                 ? lce_16_path<__nv_bfloat16>(c, loss, lse, dh, dw, work, h, w, targets, ignore_index, count, compute,
                                              &fallback)
                 : lce_16_path<__half>(c, loss, lse, dh, dw, work, h, w, targets, ignore_index, count, compute,
                                       &fallback);
        if (st != ANNEAL_OK || !fallback) return st;
    }
    return lce_f32_path(ctx, loss, lse, dh, dw, work, h, w, targets, ignore_index, count, compute);
}
} // namespace

/* The first failed index check since the last call (the stream already drained by
 * synchronize), with the CPU's message, as ANNEAL_ERR_ARG; the pending list is
 * cleared either way. */
extern "C" anneal_status anneal_cuda_index_checks_collect(anneal_cuda_ctx *c) {
    index_state *s = (index_state *)c->index_state;
    if (!s || s->npending == 0) return ANNEAL_OK;
    int np = s->npending;
    s->npending = 0;
    anneal_status st = ANNEAL_OK;
    for (int k = 0; k < np && st == ANNEAL_OK; k++)
        if (s->pending[k].stream != c->stream) /* queued on another stream: drain them all */
            st = anneal_cuda_check(cudaDeviceSynchronize(), "synchronize");
    if (st != ANNEAL_OK) return st;
    st = anneal_cuda_check(cudaMemcpy(s->host, s->records, (size_t)np * sizeof(unsigned long long),
                                      cudaMemcpyDeviceToHost),
                           "synchronize");
    if (st != ANNEAL_OK) return st;
    for (int k = 0; k < np; k++) {
        if (s->host[k] == kNoBad) continue;
        const index_check *q = &s->pending[k];
        int64_t i = (int64_t)(s->host[k] >> 32);
        int32_t value = (int32_t)(uint32_t)(s->host[k] & 0xFFFFFFFFu);
        char pos[160], tail[64] = "";
        if (q->has_ignore) snprintf(tail, sizeof tail, " and is not ignore_index (%d)", (int)q->ignore_index);
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "%s: %s %d at position %s (flat index %lld) is outside [0, V) with V = %lld%s", q->op,
                                q->what, (int)value, index_str(q->ndim, q->shape, i, pos, sizeof pos), (long long)i,
                                (long long)q->n, tail);
    }
    return ANNEAL_OK;
}

/* Fills check_index, embedding_fwd/bwd, cross_entropy_fwd/bwd, loss_mean and
 * linear_cross_entropy. */
extern "C" void anneal_cuda_table_loss(anneal_backend *b) {
    b->check_index = cuda_check_index;
    b->embedding_fwd = cuda_embedding_fwd;
    b->embedding_bwd = cuda_embedding_bwd;
    b->cross_entropy_fwd = cuda_cross_entropy_fwd;
    b->cross_entropy_bwd = cuda_cross_entropy_bwd;
    b->loss_mean = cuda_loss_mean;
    b->linear_cross_entropy = cuda_linear_cross_entropy;
}

/* CHECK_INDEX on i32 ids; the embedding and loss kernels on f32 (linear cross-entropy
 * at any compute anneal_cuda_gemm_f32 takes). */
extern "C" bool anneal_cuda_supports_loss(const anneal_op_query *q) {
    switch (q->kind) {
    case ANNEAL_OP_CHECK_INDEX: return q->dtype == ANNEAL_I32;
    case ANNEAL_OP_EMBEDDING:
    case ANNEAL_OP_CROSS_ENTROPY:
    case ANNEAL_OP_LOSS_MEAN:
    case ANNEAL_OP_LINEAR_CROSS_ENTROPY: return q->dtype == ANNEAL_F32;
    default: return false;
    }
}
