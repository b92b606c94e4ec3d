/* The CUDA backend's random slots: dropout (forward and backward) and randn, from the
 * same Philox4x32-10 streams as the CPU (src/core/rng.c, src/cpu/elementwise.c), so a
 * (seed, offset) gives the same masks and normals on both devices:
 *   dropout  element i: word i % 4 of Philox(key seed, counter hi 0, lo offset/4 + i/4);
 *            keep when (float)(word >> 8) * 2^-24 >= p; y = x * (1/(1-p)) (f32)
 *   randn    elements 2j, 2j+1: words 0 and 1 of Philox(seed, hi 1, lo offset/4 + j),
 *            Box-Muller in double as the CPU (log, sqrt, cos, sin rounded to float at
 *            the end; CUDA's double log/cos/sin are within 2 ulp of double, so the
 *            float results match glibc's except in vanishingly rare ties). */
#include "cuda_internal.h"

#include <math.h>

namespace {

constexpr int RNG_THREADS = 256;
constexpr int64_t RNG_MAX_BLOCKS = 65536; /* grid-stride beyond this */

/* Philox4x32-10 exactly as anneal_philox4x32: counter (lo, hi) = words c0..c3, key
 * words k0, k1 bumped after every round. Host and device (a host test can compare it with
 * the library's). */
__host__ __device__ __forceinline__ void philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo,
                                                    uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter_lo, c1 = (uint32_t)(counter_lo >> 32);
    uint32_t c2 = (uint32_t)counter_hi, c3 = (uint32_t)(counter_hi >> 32);
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int r = 0; r < 10; r++) {
        const uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* The CPU's anneal_uniform_from_u32: the top 24 bits as a float in [0, 1) (exact). */
__host__ __device__ __forceinline__ float uniform_from_u32(uint32_t x) {
    return (float)(x >> 8) * (1.0f / 16777216.0f);
}

/* The keep decision of dropout for one Philox word (as the CPU). */
__host__ __device__ __forceinline__ bool dropout_keep(uint32_t word, float p) { return uniform_from_u32(word) >= p; }

/* Round-to-nearest double and float arithmetic that the device compiler may not fuse
 * into an FMA (the CPU's C11 build does not fuse either); plain operators on the host. */
__host__ __device__ __forceinline__ double dadd(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}

__host__ __device__ __forceinline__ double dmul(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

/* Dropout of Philox block blk (elements 4 blk .. 4 blk + 3 below n): word j decides
 * element 4 blk + j; mask[i] = keep, y[i] = keep ? x[i] * scale : 0 (one f32 product). */
__host__ __device__ __forceinline__ void dropout_block(int64_t blk, int64_t n, const float *x, float *y,
                                                       uint8_t *mask, float p, float scale, uint64_t seed,
                                                       uint64_t ctr0) {
    uint32_t r[4];
    philox4x32(seed, 0, ctr0 + (uint64_t)blk, r);
    for (int j = 0; j < 4; j++) {
        const int64_t i = blk * 4 + j;
        if (i >= n) break;
        const bool keep = dropout_keep(r[j], p);
        mask[i] = keep ? 1 : 0;
        y[i] = keep ? x[i] * scale : 0.0f;
    }
}

/* Two normals of Philox block blk (elements 2 blk and 2 blk + 1 below n), Box-Muller in
 * double as the CPU: u1 = ((w0 >> 8) + 1) / 2^24 in (0, 1], u2 = (w1 >> 8) / 2^24,
 * rad = sqrt(-2 log u1), th = 2 pi u2, x = (float)(mean + std * rad * cos th) (sin for
 * the second), each product and sum rounded (no FMA). */
__host__ __device__ __forceinline__ void randn_block(int64_t blk, int64_t n, float *x, double mean, double std,
                                                     uint64_t seed, uint64_t ctr0) {
    uint32_t r[4];
    philox4x32(seed, 1, ctr0 + (uint64_t)blk, r);
    const double u1 = ((double)(r[0] >> 8) + 1.0) / 16777216.0; /* exact */
    const double u2 = (double)(r[1] >> 8) / 16777216.0;          /* exact */
    const double rad = sqrt(dmul(-2.0, log(u1)));
    const double th = dmul(6.283185307179586, u2);
    const double sr = dmul(std, rad);
    x[2 * blk] = (float)dadd(mean, dmul(sr, cos(th)));
    if (2 * blk + 1 < n) x[2 * blk + 1] = (float)dadd(mean, dmul(sr, sin(th)));
}

/* Blocks for n work items (n > 0), capped: kernels loop with a grid stride. */
unsigned grid_for(int64_t n) {
    int64_t b = (n + RNG_THREADS - 1) / RNG_THREADS;
    return (unsigned)(b < RNG_MAX_BLOCKS ? b : RNG_MAX_BLOCKS);
}

/* One Philox block (4 elements) per item (dropout_block). */
__global__ void dropout_fwd_kernel(int64_t n, const float *__restrict__ x, float *__restrict__ y,
                                   uint8_t *__restrict__ mask, float p, float scale, uint64_t seed, uint64_t ctr0) {
    const int64_t nblk = (n + 3) / 4;
    for (int64_t blk = (int64_t)blockIdx.x * RNG_THREADS + threadIdx.x; blk < nblk;
         blk += (int64_t)gridDim.x * RNG_THREADS)
        dropout_block(blk, n, x, y, mask, p, scale, seed, ctr0);
}

/* dx[i] = mask[i] ? dy[i] * scale : 0. */
__global__ void dropout_bwd_kernel(int64_t n, const uint8_t *__restrict__ mask, const float *__restrict__ dy,
                                   float *__restrict__ dx, float scale) {
    for (int64_t i = (int64_t)blockIdx.x * RNG_THREADS + threadIdx.x; i < n; i += (int64_t)gridDim.x * RNG_THREADS)
        dx[i] = mask[i] ? dy[i] * scale : 0.0f;
}

/* Two normals per Philox block (randn_block). */
__global__ void randn_kernel(int64_t n, float *__restrict__ x, double mean, double std, uint64_t seed,
                             uint64_t ctr0) {
    const int64_t nblk = (n + 1) / 2;
    for (int64_t blk = (int64_t)blockIdx.x * RNG_THREADS + threadIdx.x; blk < nblk;
         blk += (int64_t)gridDim.x * RNG_THREADS)
        randn_block(blk, n, x, mean, std, seed, ctr0);
}

/* y = x * mask / (1 - p), mask ~ Bernoulli(1 - p) from Philox(seed, offset/4 + i/4):
 * the CPU's masks, bit for bit. */
anneal_status cuda_dropout_fwd(void *ctx, anneal_tensor *y, anneal_tensor *mask, const anneal_tensor *x, float p,
                               uint64_t seed, uint64_t offset) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    const int64_t n = anneal_numel(x);
    if (n <= 0) return ANNEAL_OK;
    const float scale = 1.0f / (1.0f - p); /* host f32, as the CPU */
    dropout_fwd_kernel<<<grid_for((n + 3) / 4), RNG_THREADS, 0, c->stream>>>(
        n, (const float *)anneal_data(x), (float *)anneal_data(y), (uint8_t *)anneal_data(mask), p, scale, seed,
        offset / 4);
    return anneal_cuda_launch_check("dropout_fwd");
}

/* dx = dy * mask / (1 - p). */
anneal_status cuda_dropout_bwd(void *ctx, anneal_tensor *dx, const anneal_tensor *mask, const anneal_tensor *dy,
                               float p) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    const int64_t n = anneal_numel(dx);
    if (n <= 0) return ANNEAL_OK;
    const float scale = 1.0f / (1.0f - p);
    dropout_bwd_kernel<<<grid_for(n), RNG_THREADS, 0, c->stream>>>(n, (const uint8_t *)anneal_data(mask),
                                                                  (const float *)anneal_data(dy),
                                                                  (float *)anneal_data(dx), scale);
    return anneal_cuda_launch_check("dropout_bwd");
}

/* x = normal(mean, std) from Philox(seed, offset/4 + i/2), Box-Muller as the CPU. */
anneal_status cuda_randn(void *ctx, anneal_tensor *x, float mean, float std, uint64_t seed, uint64_t offset) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    const int64_t n = anneal_numel(x);
    if (n <= 0) return ANNEAL_OK;
    randn_kernel<<<grid_for((n + 1) / 2), RNG_THREADS, 0, c->stream>>>(n, (float *)anneal_data(x), (double)mean,
                                                                      (double)std, seed, offset / 4);
    return anneal_cuda_launch_check("randn");
}

} /* namespace */

/* Fills the random slots: dropout_fwd, dropout_bwd, randn. */
extern "C" void anneal_cuda_table_random(anneal_backend *b) {
    b->dropout_fwd = cuda_dropout_fwd;
    b->dropout_bwd = cuda_dropout_bwd;
    b->randn = cuda_randn;
}

/* f32 tensors (the mask is u8), as the CPU. */
extern "C" bool anneal_cuda_supports_random(const anneal_op_query *q) {
    return (q->kind == ANNEAL_OP_DROPOUT || q->kind == ANNEAL_OP_RANDN) && q->dtype == ANNEAL_F32;
}
