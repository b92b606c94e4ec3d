/* The CUDA backend's AdamW slots: adamw (one parameter) and adamw_multi (many in one
 * pass). Both run the same per-element __device__ function with the float constants
 * formed on the host in double exactly as the CPU kernel (src/cpu/adamw.c, PyTorch
 * 1.13's _single_tensor_adamw) forms them, and every float operation is written with
 * an explicit rounding intrinsic (__fmul_rn, __fdiv_rn, __fadd_rn, __fsqrt_rn, fmaf)
 * so that nvcc contracts nothing the CPU does not: the same operations in the same
 * order, so a parameter's update is bit-identical between the two slots and matches
 * the CPU's. */
#include "cuda_internal.h"

#include <math.h>

namespace {

/* The float scalars of one parameter's step, rounded as PyTorch rounds them. */
struct adamw_scalars {
    float decay;    /* 1 - lr*wd            (param.mul_) */
    float beta1;    /* exp_avg.mul_(beta1) */
    float omb1;     /* 1 - beta1            (add_ alpha) */
    float beta2;    /* exp_avg_sq.mul_(beta2) */
    float omb2;     /* 1 - beta2            (addcmul_ value) */
    float bc2_sqrt; /* sqrt(bc2) */
    float eps;
    float neg_step; /* -lr / bc1            (addcdiv_ value) */
};

/* The constants of one step from the double hyperparameters (host; as the CPU's
 * make_scalars). */
adamw_scalars make_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, double bc1,
                           double bc2) {
    adamw_scalars s;
    s.decay = (float)(1.0 - lr * weight_decay);
    s.beta1 = (float)beta1;
    s.omb1 = (float)(1.0 - beta1);
    s.beta2 = (float)beta2;
    s.omb2 = (float)(1.0 - beta2);
    s.bc2_sqrt = (float)sqrt(bc2);
    s.eps = (float)eps;
    s.neg_step = (float)(-(lr / bc1));
    return s;
}

/* Element i of one parameter, the CPU's adamw_block arithmetic without contraction:
 *   m = fma(omb1, g, m*beta1); v = fma(omb2*g, g, v*beta2);
 *   denom = sqrt(v)/bc2_sqrt + eps; p = p*decay + (neg_step*m)/denom. */
__device__ __forceinline__ void adamw_element(float *p, const float *g, float *m, float *v, int64_t i,
                                              const adamw_scalars &s) {
    float gi = g[i];
    float mi = fmaf(s.omb1, gi, __fmul_rn(m[i], s.beta1));
    float vi = fmaf(__fmul_rn(s.omb2, gi), gi, __fmul_rn(v[i], s.beta2));
    m[i] = mi;
    v[i] = vi;
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    p[i] = __fadd_rn(__fmul_rn(p[i], s.decay), __fdiv_rn(__fmul_rn(s.neg_step, mi), denom));
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192; /* grid-stride beyond this */

/* One parameter: every element once. */
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, adamw_scalars s) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        adamw_element(p, g, m, v, i, s);
}

/* Up to kGroups parameters per launch, passed by value (no host buffer to keep alive,
 * no pageable copy that would wait for the stream): 48 * 80 bytes stays under the
 * classic 4 KiB parameter limit. */
constexpr int kGroups = 48;

struct adamw_batch {
    float *p[kGroups];
    const float *g[kGroups];
    float *m[kGroups];
    float *v[kGroups];
    int64_t start[kGroups + 1]; /* first element of group k in the batch's concatenation */
    adamw_scalars s[kGroups];
    int n;
};

/* The batch's groups seen as one concatenated range; element e belongs to the last
 * group whose start is <= e (binary search over at most kGroups starts). */
__global__ void adamw_multi_kernel(const __grid_constant__ adamw_batch b) {
    int64_t total = b.start[b.n];
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        int lo = 0, hi = b.n - 1; /* the answer is in [lo, hi] */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (b.start[mid] <= e) lo = mid;
            else hi = mid - 1;
        }
        adamw_element(b.p[lo], b.g[lo], b.m[lo], b.v[lo], e - b.start[lo], b.s[lo]);
    }
}

/* Blocks for n elements (at least 1, grid-stride past kMaxBlocks). */
unsigned grid_for(int64_t n) {
    int64_t blocks = (n + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocks) blocks = kMaxBlocks;
    return (unsigned)(blocks < 1 ? 1 : blocks);
}

/* One AdamW step on p with g, m, v (f32 contiguous, same numel), queued on the stream. */
anneal_status cuda_adamw(void *ctx, anneal_tensor *p, const anneal_tensor *g, anneal_tensor *m, anneal_tensor *v,
                         double lr, double beta1, double beta2, double eps, double weight_decay, double bc1,
                         double bc2) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t n = anneal_numel(p);
    if (n <= 0) return ANNEAL_OK;
    adamw_scalars s = make_scalars(lr, beta1, beta2, eps, weight_decay, bc1, bc2);
    adamw_kernel<<<grid_for(n), kThreads, 0, c->stream>>>((float *)anneal_data(p), (const float *)anneal_data(g),
                                                          (float *)anneal_data(m), (float *)anneal_data(v), n, s);
    return anneal_cuda_launch_check("adamw");
}

/* AdamW over n groups (device pointers), kGroups per launch; each element gets
 * adamw_element with its group's scalars, so the result is bit-identical to adamw. */
anneal_status cuda_adamw_multi(void *ctx, const anneal_adamw_group *groups, int n, double lr, double beta1,
                               double beta2, double eps) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    adamw_batch b;
    b.n = 0;
    b.start[0] = 0;
    for (int i = 0; i <= n; i++) {
        if (i < n && groups[i].numel > 0) {
            const anneal_adamw_group *gr = &groups[i];
            int k = b.n++;
            b.p[k] = gr->p;
            b.g[k] = gr->g;
            b.m[k] = gr->m;
            b.v[k] = gr->v;
            b.s[k] = make_scalars(lr, beta1, beta2, eps, gr->weight_decay, gr->bc1, gr->bc2);
            b.start[k + 1] = b.start[k] + gr->numel;
        }
        if (b.n == kGroups || (i == n && b.n > 0)) {
            adamw_multi_kernel<<<grid_for(b.start[b.n]), kThreads, 0, c->stream>>>(b);
            if ((st = anneal_cuda_launch_check("adamw_multi")) != ANNEAL_OK) return st;
            b.n = 0;
        }
    }
    return ANNEAL_OK;
}

} // namespace

/* Fills the adamw and adamw_multi slots. */
extern "C" void anneal_cuda_table_adamw(anneal_backend *b) {
    b->adamw = cuda_adamw;
    b->adamw_multi = cuda_adamw_multi;
}

/* ADAMW on f32 parameters. */
extern "C" bool anneal_cuda_supports_adamw(const anneal_op_query *q) {
    return q->kind == ANNEAL_OP_ADAMW && q->dtype == ANNEAL_F32;
}
