/* The CUDA backend's attention slots: flash-style scaled-dot-product attention
 * (forward and backward) on CUDA cores, never holding a Tq x Tk matrix in memory.
 *
 * Layout and arithmetic follow the CPU kernels (src/cpu/attention.c, attention_bf16.c):
 *
 * Forward: one thread block per (b, query head h, tile of 64 query rows). It walks the
 * key tiles (64 keys) up to the last key any row of its tile sees, computes the tile of
 * scores, updates an online softmax per row (running max m, sum l, f32) and accumulates
 * P V into an f32 accumulator; at the end o = acc / l, lse = m + log(l). A row that sees
 * no key gets o = 0 and lse = -inf.
 *   F32 (also F16): s = (scale q) . k, p = exp(s - m).
 *   BF16: s = r(q) . r(k), p = exp(scale s - m), acc += r(p) . r(v) (l sums unrounded p),
 *   r() rounding to bf16 (nearest even); products accumulate in f32.
 *
 * Backward (deterministic, no atomics), three kernels:
 *   1. Dvec_i = dO_i . o_i (in double, from the f32 tensors), into scratch.
 *   2. dK, dV: one block per (b, key/value head, tile of 64 keys); it walks the query heads
 *      of its group in ascending order and, for each, the query tiles that see its keys:
 *      P = exp(scale Q K^T - lse), dP = dO V^T, dS = P (dP - Dvec);
 *      dV += P^T dO, dK += dS^T Q (registers, fixed order).
 *   3. dQ: one block per (b, h, tile of 64 query rows), walking its visible key tiles:
 *      dQ += dS K.
 *   F32: dS carries the factor scale. BF16: Q, K, V, dO, P and dS are rounded to bf16 as
 *   product operands, dS is unscaled and dQ, dK are multiplied by scale at the end (dK
 *   after the sum over its group), as attention_bf16.c does.
 *
 * Two implementations, same tasks, same rounding points, same reduction structure:
 * - CUDA cores (every compute; f32 FMAs): 256 threads per block, thread (ty, tx) =
 *   (tid / 16, tid % 16) owns the elements of rows ty + 16 r and columns tx + 16 c of each
 *   tile product. Tiles live in shared memory as f32 with an odd row stride (D_MAX + 1,
 *   64 + 1), so row-wise and column-wise reads are free of bank conflicts.
 * - Tensor cores (BF16 only, the default for it; ANNEAL_CUDA_ATTN_MMA=0 at call time picks
 *   the CUDA-core kernels instead): mma.sync m16n8k16 bf16 -> f32, 4 warps per block, each
 *   warp owning 16 rows of the block's tile (query rows in the forward and dQ, key rows in
 *   dK/dV); tiles in shared memory as bf16 (row-major and, where a product needs it,
 *   transposed), P and dS passed from the accumulators to the next product in registers.
 *   Only the order of the f32 sums inside a product differs from the CUDA-core kernels.
 * - Fast tensor-core kernels (BF16, D <= 64, 16-byte aligned rows: the default where they
 *   apply; ANNEAL_CUDA_ATTN_FAST=0 at call time picks the mma kernels above): the same
 *   fragments and the same order of every sum as the mma kernels (bit-identical results),
 *   with the streamed tiles staged as f32 by cp.async one tile ahead and converted to bf16
 *   once, mma operands fed by ldmatrix (.trans instead of transposed copies), 128 query rows
 *   per block in the forward and dQ, and warps skipping the key tiles they cannot see.
 * D up to 128 (two instantiations: D <= 64 and D <= 128). */
#include "cuda_internal.h"

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

constexpr int NT = 256; /* threads per block */

/* Number of keys query row i sees: Tk, or i + (Tk - Tq) + 1 clamped to [0, Tk]. */
__host__ __device__ inline int64_t attn_visible(const anneal_attention_desc &d, int64_t i) {
    if (!d.causal) return d.Tk;
    int64_t n = i + (d.Tk - d.Tq) + 1;
    return n < 0 ? 0 : n > d.Tk ? d.Tk : n;
}

/* Columns of row i of the key tile starting at k0 with nk keys that row i sees. */
__host__ __device__ inline int attn_row_keys(const anneal_attention_desc &d, int64_t i, int64_t k0,
                                             int nk) {
    int64_t nv = attn_visible(d, i) - k0;
    return nv < 0 ? 0 : nv > nk ? nk : (int)nv;
}

/* x rounded to bf16 (nearest even) and back when BF, else x. */
template <bool BF> __device__ __forceinline__ float attn_op(float x) {
    if (BF) return __bfloat162float(__float2bfloat16_rn(x));
    return x;
}

/* Warp-wide max / sum over all 32 lanes (fixed butterfly: same bits on every call). */
__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ double warp_sum_d(double x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* dst[r * (DMAX+1) + c] = op(mul * src[r * st + c]) for r < n, c < D; 0 for the other
 * r < ROWS, c < DMAX. All threads of the block take part (no barrier inside). */
template <int ROWS, int DMAX, bool BF>
__device__ __forceinline__ void load_tile(float *dst, const float *src, int64_t st, int n, int D,
                                          float mul) {
    constexpr int LD = DMAX + 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r = warp; r < ROWS; r += NT / 32) {
        for (int c = lane; c < DMAX; c += 32) {
            float x = 0.0f;
            if (r < n && c < D) x = attn_op<BF>(mul * src[(int64_t)r * st + c]);
            dst[r * LD + c] = x;
        }
    }
}

/* Shared memory bytes of each kernel (see the carving at the top of each). */
template <int DMAX> __host__ __device__ constexpr size_t fwd_smem() {
    return sizeof(float) * (size_t)(3 * 64 * (DMAX + 1) + 64 * 65 + 3 * 64);
}
template <int DMAX> __host__ __device__ constexpr int dq_bk() { return DMAX > 64 ? 32 : 64; }
template <int DMAX> __host__ __device__ constexpr size_t dq_smem() {
    return sizeof(float) *
           (size_t)(2 * 64 * (DMAX + 1) + 2 * dq_bk<DMAX>() * (DMAX + 1) + 64 * (dq_bk<DMAX>() + 1) + 2 * 64);
}
template <int DMAX> __host__ __device__ constexpr int dkv_bq() { return DMAX > 64 ? 32 : 64; }
template <int DMAX> __host__ __device__ constexpr size_t dkv_smem() {
    return sizeof(float) *
           (size_t)(2 * 64 * (DMAX + 1) + 2 * dkv_bq<DMAX>() * (DMAX + 1) + 2 * dkv_bq<DMAX>() * 65 +
                    2 * dkv_bq<DMAX>());
}

/* Forward: block = (b, h, query tile); grid = B * Hq * ntiles, the heaviest (last) causal
 * tiles first. Writes o rows and lse of its tile. */
template <int DMAX, bool BF>
__global__ void __launch_bounds__(NT) attn_fwd_kernel(const anneal_attention_desc d, const float *__restrict__ q,
                                                      const float *__restrict__ k, const float *__restrict__ v,
                                                      float *__restrict__ o, float *__restrict__ lse, int ntiles) {
    constexpr int BQ = 64, BK = 64, LD = DMAX + 1, LS = BK + 1;
    constexpr int RI = BQ / 16, RJ = BK / 16, RC = DMAX / 16, JW = BK / 32;
    extern __shared__ float smem[];
    float *Qs = smem, *Ks = Qs + BQ * LD, *Vs = Ks + BK * LD, *Ss = Vs + BK * LD;
    float *sm_m = Ss + BQ * LS, *sm_l = sm_m + BQ, *sm_a = sm_l + BQ;

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4, lane = tid & 31, warp = tid >> 5;
    const int64_t bh = (int64_t)blockIdx.x / ntiles;
    const int tile = ntiles - 1 - (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bh / d.Hq, h = bh % d.Hq, g = h / (d.Hq / d.Hkv);
    const int64_t q0 = (int64_t)tile * BQ;
    const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
    const int D = (int)d.D;
    const float *qb = q + b * d.q_sb + h * d.q_sh + q0 * d.q_st;
    const float *kb = k + b * d.k_sb + g * d.k_sh;
    const float *vb = v + b * d.v_sb + g * d.v_sh;
    float *ob = o + b * d.o_sb + h * d.o_sh + q0 * d.o_st;
    float *lb = lse + bh * d.Tq + q0;
    const float sscale = BF ? d.scale : 1.0f; /* F32 scales q at load instead */

    load_tile<BQ, DMAX, BF>(Qs, qb, d.q_st, nq, D, BF ? 1.0f : d.scale);
    for (int i = tid; i < BQ; i += NT) {
        sm_m[i] = -INFINITY;
        sm_l[i] = 0.0f;
        sm_a[i] = 1.0f;
    }
    float acc[RI][RC];
#pragma unroll
    for (int r = 0; r < RI; r++)
#pragma unroll
        for (int c = 0; c < RC; c++) acc[r][c] = 0.0f;

    const int64_t kend = attn_visible(d, q0 + nq - 1); /* keys seen by the tile's last row */
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = (int)(kend - k0 < BK ? kend - k0 : BK);
        __syncthreads(); /* the previous tile's readers are done */
        load_tile<BK, DMAX, BF>(Ks, kb + k0 * d.k_st, d.k_st, nk, D, 1.0f);
        load_tile<BK, DMAX, BF>(Vs, vb + k0 * d.v_st, d.v_st, nk, D, 1.0f);
        __syncthreads();

        /* S = Q K^T (raw scores of the tile) */
        float s[RI][RJ];
#pragma unroll
        for (int r = 0; r < RI; r++)
#pragma unroll
            for (int c = 0; c < RJ; c++) s[r][c] = 0.0f;
        for (int e = 0; e < D; e++) {
            float a[RI], bb[RJ];
#pragma unroll
            for (int r = 0; r < RI; r++) a[r] = Qs[(ty + 16 * r) * LD + e];
#pragma unroll
            for (int c = 0; c < RJ; c++) bb[c] = Ks[(tx + 16 * c) * LD + e];
#pragma unroll
            for (int r = 0; r < RI; r++)
#pragma unroll
                for (int c = 0; c < RJ; c++) s[r][c] = fmaf(a[r], bb[c], s[r][c]);
        }
#pragma unroll
        for (int r = 0; r < RI; r++)
#pragma unroll
            for (int c = 0; c < RJ; c++) Ss[(ty + 16 * r) * LS + tx + 16 * c] = s[r][c];
        __syncthreads();

        /* Online softmax, one warp per row: p = exp(sscale s - m') (0 where masked). */
        for (int i = warp; i < BQ; i += NT / 32) {
            float *srow = Ss + i * LS;
            const int nv = i < nq ? attn_row_keys(d, q0 + i, k0, nk) : 0;
            float x[JW];
            float mx = -INFINITY;
#pragma unroll
            for (int t = 0; t < JW; t++) {
                const int j = lane + 32 * t;
                x[t] = srow[j];
                if (j < nv) mx = fmaxf(mx, x[t]);
            }
            if (nv > 0) { /* uniform over the warp */
                mx = warp_max(mx);
                const float mold = sm_m[i];
                const float mnew = fmaxf(mold, sscale * mx);
                const float alpha = expf(mold - mnew); /* 0 on the first tile (m = -inf) */
                float sum = 0.0f;
#pragma unroll
                for (int t = 0; t < JW; t++) {
                    const int j = lane + 32 * t;
                    const float p = j < nv ? expf(sscale * x[t] - mnew) : 0.0f;
                    sum += p;
                    srow[j] = attn_op<BF>(p);
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    sm_l[i] = sm_l[i] * alpha + sum;
                    sm_m[i] = mnew;
                    sm_a[i] = alpha;
                }
            } else {
#pragma unroll
                for (int t = 0; t < JW; t++) srow[lane + 32 * t] = 0.0f;
                if (lane == 0) sm_a[i] = 1.0f;
            }
        }
        __syncthreads();

        /* acc = alpha acc + P V */
#pragma unroll
        for (int r = 0; r < RI; r++) {
            const float alpha = sm_a[ty + 16 * r];
#pragma unroll
            for (int c = 0; c < RC; c++) acc[r][c] *= alpha;
        }
        for (int j = 0; j < nk; j++) {
            float a[RI], bv[RC];
#pragma unroll
            for (int r = 0; r < RI; r++) a[r] = Ss[(ty + 16 * r) * LS + j];
#pragma unroll
            for (int c = 0; c < RC; c++) bv[c] = Vs[j * LD + tx + 16 * c];
#pragma unroll
            for (int r = 0; r < RI; r++)
#pragma unroll
                for (int c = 0; c < RC; c++) acc[r][c] = fmaf(a[r], bv[c], acc[r][c]);
        }
    }
    __syncthreads(); /* m, l final (and initialised when no key tile ran) */

#pragma unroll
    for (int r = 0; r < RI; r++) {
        const int i = ty + 16 * r;
        if (i >= nq) continue;
        const float l = sm_l[i], m = sm_m[i];
        const bool seen = l > 0.0f || l != l;
        const float inv = 1.0f / l;
        float *orow = ob + (int64_t)i * d.o_st;
#pragma unroll
        for (int c = 0; c < RC; c++) {
            const int col = tx + 16 * c;
            if (col < D) orow[col] = seen ? acc[r][c] * inv : 0.0f;
        }
        if (tx == 0) lb[i] = seen ? m + logf(l) : -INFINITY;
    }
}

/* ------------------------------------------- BF16 forward on tensor cores (mma.sync) */
#ifndef ANNEAL_ATTN_EMU
/* c += a (16x16 bf16, row-major fragment) * b (16x8 bf16, col-major fragment), f32:
 * mma.sync m16n8k16. Fragments (g = lane / 4, t = lane % 4; the lower index of a pair in
 * the low half): a0 (row g, cols 2t, 2t+1), a1 (row g+8, same), a2 (row g, cols 2t+8, +9),
 * a3 (row g+8, same); b0 (rows 2t, 2t+1, col g), b1 (rows 2t+8, +9, col g); c0, c1 (row g,
 * cols 2t, 2t+1), c2, c3 (row g+8). */
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* The bf16 bits of x (nearest even). */
__device__ __forceinline__ uint16_t bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
#endif

/* lo, hi rounded to bf16 and packed (lo in the low half). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)bf16_bits(lo) | ((uint32_t)bf16_bits(hi) << 16);
}
/* The 32 bits at p (two bf16; p 4-byte aligned). */
__device__ __forceinline__ uint32_t ld32(const uint16_t *p) { return *reinterpret_cast<const uint32_t *>(p); }

constexpr int NT_MMA = 128; /* 4 warps, 16 query rows each */
template <int DMAX> __host__ __device__ constexpr size_t fwd_mma_smem() {
    return sizeof(uint16_t) * (size_t)(2 * 64 * (DMAX + 8) + DMAX * (64 + 8));
}

/* One row's online-softmax step over a key tile on the mma accumulators: x holds the raw
 * scores of the row's columns 8 nb + 2 t + e (the 4 lanes of a group hold the row), nv
 * the columns it sees. Updates m, l (identical in the 4 lanes), leaves p = exp(scale x -
 * m') in x (0 where masked) and returns alpha = exp(m - m'). All lanes must call it. */
template <int NB>
__device__ __forceinline__ float mma_softmax_row(float (&x)[NB][2], int nv, int t4, float scale, float &m,
                                                 float &l) {
    float mx = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int e = 0; e < 2; e++)
            if (nb * 8 + 2 * t4 + e < nv) mx = fmaxf(mx, x[nb][e]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = nv > 0 ? fmaxf(m, scale * mx) : m;
    const float alpha = nv > 0 ? expf(m - mnew) : 1.0f; /* 0 on the first tile (m = -inf) */
    float sum = 0.0f;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float p = nb * 8 + 2 * t4 + e < nv ? expf(scale * x[nb][e] - mnew) : 0.0f;
            x[nb][e] = p;
            sum += p;
        }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l = l * alpha + sum;
    m = mnew;
    return alpha;
}

/* BF16 forward on tensor cores, same arithmetic as attn_fwd_kernel<., true> (s = r(q) . r(k),
 * p = exp(scale s - m'), l sums unrounded p, acc += r(p) . r(v)) up to the order of the
 * f32 sums. Block = (b, h, 64 query rows), 4 warps of 16 rows; key tiles of 64 in shared
 * memory as bf16 (K row-major, V transposed). */
template <int DMAX>
__global__ void __launch_bounds__(NT_MMA) attn_fwd_mma_kernel(const anneal_attention_desc d, const float *__restrict__ q,
                                                              const float *__restrict__ k, const float *__restrict__ v,
                                                              float *__restrict__ o, float *__restrict__ lse,
                                                              int ntiles) {
    constexpr int BQ = 64, BK = 64, LDH = DMAX + 8, LDV = BK + 8, KS = DMAX / 16, NB = BK / 8, ND = DMAX / 8;
    extern __shared__ float smem[];
    uint16_t *Qh = reinterpret_cast<uint16_t *>(smem), *Kh = Qh + BQ * LDH, *Vt = Kh + BK * LDH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int64_t bh = (int64_t)blockIdx.x / ntiles;
    const int tile = ntiles - 1 - (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bh / d.Hq, h = bh % d.Hq, gk = h / (d.Hq / d.Hkv);
    const int64_t q0 = (int64_t)tile * BQ;
    const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
    const int D = (int)d.D;
    const float *qb = q + b * d.q_sb + h * d.q_sh + q0 * d.q_st;
    const float *kb = k + b * d.k_sb + gk * d.k_sh;
    const float *vb = v + b * d.v_sb + gk * d.v_sh;
    const float scale = d.scale;

    for (int idx = tid; idx < BQ * DMAX; idx += NT_MMA) {
        const int r = idx / DMAX, c = idx % DMAX;
        Qh[r * LDH + c] = bf16_bits(r < nq && c < D ? qb[(int64_t)r * d.q_st + c] : 0.0f);
    }
    __syncthreads();
    const int r0 = warp * 16 + g, r1 = r0 + 8; /* this lane's two rows */
    uint32_t qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        const int c0 = ks * 16 + 2 * t4;
        qa[ks][0] = ld32(Qh + r0 * LDH + c0);
        qa[ks][1] = ld32(Qh + r1 * LDH + c0);
        qa[ks][2] = ld32(Qh + r0 * LDH + c0 + 8);
        qa[ks][3] = ld32(Qh + r1 * LDH + c0 + 8);
    }
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    float acc[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;

    const int64_t kend = attn_visible(d, q0 + nq - 1);
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = (int)(kend - k0 < BK ? kend - k0 : BK);
        __syncthreads(); /* the previous tile's readers are done */
        for (int idx = tid; idx < BK * DMAX; idx += NT_MMA) {
            const int r = idx / DMAX, c = idx % DMAX;
            const bool in = r < nk && c < D;
            Kh[r * LDH + c] = bf16_bits(in ? kb[(k0 + r) * d.k_st + c] : 0.0f);
            Vt[c * LDV + r] = bf16_bits(in ? vb[(k0 + r) * d.v_st + c] : 0.0f);
        }
        __syncthreads();

        /* S = r(Q) r(K)^T: rows r0 (s[.][0..1]) and r1 (s[.][2..3]) */
        float s[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[nb][e] = 0.0f;
            const uint16_t *kr = Kh + (nb * 8 + g) * LDH + 2 * t4;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) mma_bf16(s[nb], qa[ks], ld32(kr + ks * 16), ld32(kr + ks * 16 + 8));
        }
        float x0[NB][2], x1[NB][2];
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            x0[nb][0] = s[nb][0];
            x0[nb][1] = s[nb][1];
            x1[nb][0] = s[nb][2];
            x1[nb][1] = s[nb][3];
        }
        const int nv0 = r0 < nq ? attn_row_keys(d, q0 + r0, k0, nk) : 0;
        const int nv1 = r1 < nq ? attn_row_keys(d, q0 + r1, k0, nk) : 0;
        const float a0 = mma_softmax_row<NB>(x0, nv0, t4, scale, m0, l0);
        const float a1 = mma_softmax_row<NB>(x1, nv1, t4, scale, m1, l1);
#pragma unroll
        for (int n = 0; n < ND; n++) {
            acc[n][0] *= a0;
            acc[n][1] *= a0;
            acc[n][2] *= a1;
            acc[n][3] *= a1;
        }
        /* acc += r(P) r(V) */
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t pa[4];
            pa[0] = pack_bf16(x0[2 * kk][0], x0[2 * kk][1]);
            pa[1] = pack_bf16(x1[2 * kk][0], x1[2 * kk][1]);
            pa[2] = pack_bf16(x0[2 * kk + 1][0], x0[2 * kk + 1][1]);
            pa[3] = pack_bf16(x1[2 * kk + 1][0], x1[2 * kk + 1][1]);
#pragma unroll
            for (int n = 0; n < ND; n++) {
                const uint16_t *vr = Vt + (n * 8 + g) * LDV + kk * 16 + 2 * t4;
                mma_bf16(acc[n], pa, ld32(vr), ld32(vr + 8));
            }
        }
    }

    float *ob = o + b * d.o_sb + h * d.o_sh + q0 * d.o_st;
    float *lb = lse + bh * d.Tq + q0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int i = half ? r1 : r0;
        if (i >= nq) continue;
        const float l = half ? l1 : l0, m = half ? m1 : m0;
        const bool seen = l > 0.0f || l != l;
        const float inv = 1.0f / l;
        float *orow = ob + (int64_t)i * d.o_st;
#pragma unroll
        for (int n = 0; n < ND; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = n * 8 + 2 * t4 + e;
                if (col < D) orow[col] = seen ? acc[n][2 * half + e] * inv : 0.0f;
            }
        if (t4 == 0) lb[i] = seen ? m + logf(l) : -INFINITY;
    }
}

/* ------------------------------------------ BF16 backward on tensor cores (mma.sync) */

/* a = the A fragment of rows base[0..16) (row stride LDH, bf16), k columns ks*16.. */
template <int LDH>
__device__ __forceinline__ void lda_frag(uint32_t (&a)[4], const uint16_t *base, int ks, int g, int t4) {
    const uint16_t *p0 = base + g * LDH + ks * 16 + 2 * t4, *p1 = p0 + 8 * LDH;
    a[0] = ld32(p0);
    a[1] = ld32(p1);
    a[2] = ld32(p0 + 8);
    a[3] = ld32(p1 + 8);
}

/* rm[r*(DMAX+8) + c] = bf16(src[r*st + c]) for r < n, c < D (0 for the other r < ROWS,
 * c < DMAX) and, when tr, its transpose tr[c*(ROWS+8) + r]. All threads take part. */
template <int ROWS, int DMAX>
__device__ __forceinline__ void load_bf16_tile(uint16_t *rm, uint16_t *tr, const float *src, int64_t st, int n,
                                               int D) {
    for (int idx = threadIdx.x; idx < ROWS * DMAX; idx += NT_MMA) {
        const int r = idx / DMAX, c = idx % DMAX;
        const uint16_t x = bf16_bits(r < n && c < D ? src[(int64_t)r * st + c] : 0.0f);
        rm[r * (DMAX + 8) + c] = x;
        if (tr) tr[c * (ROWS + 8) + r] = x;
    }
}

/* Query rows per tile of the tensor-core dK/dV kernel, and the shared memory of it and of dQ's. */
template <int DMAX> __host__ __device__ constexpr int dkv_mma_bq() { return DMAX > 64 ? 32 : 64; }
template <int DMAX> __host__ __device__ constexpr size_t dkv_mma_smem() {
    return sizeof(uint16_t) * (size_t)(2 * 64 * (DMAX + 8) + 2 * dkv_mma_bq<DMAX>() * (DMAX + 8) +
                                       2 * DMAX * (dkv_mma_bq<DMAX>() + 8)) +
           sizeof(float) * 2 * dkv_mma_bq<DMAX>();
}
template <int DMAX> __host__ __device__ constexpr size_t dq_mma_smem() {
    return sizeof(uint16_t) * (size_t)(4 * 64 * (DMAX + 8) + DMAX * (64 + 8));
}

/* dK, dV of attn_bwd_dkdv_kernel<., true> on tensor cores: block = (b, key/value head, 64
 * keys), 4 warps of 16 keys; per query head of the group (ascending) and query tile:
 * S^T = r(K) r(Q)^T, dP^T = r(V) r(dO)^T, P^T = exp(scale S^T - lse), dS^T = P^T (dP^T - Dvec),
 * dV += r(P^T) r(dO), dK += r(dS^T) r(Q); dK *= scale at the end. */
template <int DMAX>
__global__ void __launch_bounds__(NT_MMA) attn_bwd_dkdv_mma_kernel(
    const anneal_attention_desc d, const float *__restrict__ q, const float *__restrict__ k,
    const float *__restrict__ v, const float *__restrict__ dout, const float *__restrict__ lse,
    const float *__restrict__ dvec, float *__restrict__ dk, float *__restrict__ dv, int ntiles) {
    constexpr int BK = 64, BQ = dkv_mma_bq<DMAX>(), LDH = DMAX + 8, LDT = BQ + 8;
    constexpr int KS = DMAX / 16, NBQ = BQ / 8, ND = DMAX / 8;
    extern __shared__ float smem[];
    uint16_t *Kh = reinterpret_cast<uint16_t *>(smem), *Vh = Kh + BK * LDH, *Qh = Vh + BK * LDH;
    uint16_t *dOh = Qh + BQ * LDH, *Qt = dOh + BQ * LDH, *dOt = Qt + DMAX * LDT;
    float *sm_lse = reinterpret_cast<float *>(dOt + DMAX * LDT), *sm_dv = sm_lse + BQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int64_t bg = (int64_t)blockIdx.x / ntiles;
    const int tile = (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bg / d.Hkv, gk = bg % d.Hkv, G = d.Hq / d.Hkv;
    const int64_t k0 = (int64_t)tile * BK;
    const int nk = (int)(d.Tk - k0 < BK ? d.Tk - k0 : BK);
    const int D = (int)d.D;
    const float scale = d.scale;
    const int kr0 = warp * 16 + g, kr1 = kr0 + 8; /* this lane's two key rows */

    load_bf16_tile<BK, DMAX>(Kh, nullptr, k + b * d.k_sb + gk * d.k_sh + k0 * d.k_st, d.k_st, nk, D);
    load_bf16_tile<BK, DMAX>(Vh, nullptr, v + b * d.v_sb + gk * d.v_sh + k0 * d.v_st, d.v_st, nk, D);

    float akk[ND][4], avv[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) akk[n][e] = avv[n][e] = 0.0f;

    for (int64_t h = gk * G; h < (gk + 1) * G; h++) {
        const float *qh = q + b * d.q_sb + h * d.q_sh;
        const float *gh = dout + b * d.o_sb + h * d.o_sh;
        const float *lh = lse + (b * d.Hq + h) * d.Tq;
        const float *dh = dvec + (b * d.Hq + h) * d.Tq;
        for (int64_t q0 = 0; q0 < d.Tq; q0 += BQ) {
            const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
            if (attn_visible(d, q0 + nq - 1) <= k0) continue; /* no row of the tile sees a key */
            __syncthreads(); /* the previous tile's readers are done (and K, V loaded) */
            load_bf16_tile<BQ, DMAX>(Qh, Qt, qh + q0 * d.q_st, d.q_st, nq, D);
            load_bf16_tile<BQ, DMAX>(dOh, dOt, gh + q0 * d.o_st, d.o_st, nq, D);
            for (int i = tid; i < BQ; i += NT_MMA) {
                sm_lse[i] = i < nq ? lh[q0 + i] : 0.0f;
                sm_dv[i] = i < nq ? dh[q0 + i] : 0.0f;
            }
            __syncthreads();

            /* S^T, dP^T: rows kr0 (e = 0, 1) and kr1 (e = 2, 3), query columns nb*8 + 2 t4 + e%2 */
            float st[NBQ][4], dpt[NBQ][4];
#pragma unroll
            for (int nb = 0; nb < NBQ; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) st[nb][e] = dpt[nb][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t ak[4], av[4];
                lda_frag<LDH>(ak, Kh + warp * 16 * LDH, ks, g, t4);
                lda_frag<LDH>(av, Vh + warp * 16 * LDH, ks, g, t4);
#pragma unroll
                for (int nb = 0; nb < NBQ; nb++) {
                    const uint16_t *pq = Qh + (nb * 8 + g) * LDH + ks * 16 + 2 * t4;
                    const uint16_t *pg = dOh + (nb * 8 + g) * LDH + ks * 16 + 2 * t4;
                    mma_bf16(st[nb], ak, ld32(pq), ld32(pq + 8));
                    mma_bf16(dpt[nb], av, ld32(pg), ld32(pg + 8));
                }
            }
            /* P^T, dS^T in place (f32), then their bf16 A fragments feed dV and dK */
#pragma unroll
            for (int nb = 0; nb < NBQ; nb++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const int i = nb * 8 + 2 * t4 + c; /* query of columns e = c, c + 2 */
                    const int nv = i < nq ? attn_row_keys(d, q0 + i, k0, nk) : 0;
                    const float li = sm_lse[i], di = sm_dv[i];
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        const int e = c + 2 * hf, kr = hf ? kr1 : kr0;
                        const float p = kr < nv ? expf(scale * st[nb][e] - li) : 0.0f;
                        st[nb][e] = p;
                        dpt[nb][e] = p * (dpt[nb][e] - di);
                    }
                }
#pragma unroll
            for (int kk = 0; kk < BQ / 16; kk++) {
                uint32_t pa[4], sa[4];
                pa[0] = pack_bf16(st[2 * kk][0], st[2 * kk][1]);
                pa[1] = pack_bf16(st[2 * kk][2], st[2 * kk][3]);
                pa[2] = pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]);
                pa[3] = pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3]);
                sa[0] = pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]);
                sa[1] = pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]);
                sa[2] = pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
                sa[3] = pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
                for (int n = 0; n < ND; n++) {
                    const uint16_t *pg = dOt + (n * 8 + g) * LDT + kk * 16 + 2 * t4;
                    const uint16_t *pq = Qt + (n * 8 + g) * LDT + kk * 16 + 2 * t4;
                    mma_bf16(avv[n], pa, ld32(pg), ld32(pg + 8));
                    mma_bf16(akk[n], sa, ld32(pq), ld32(pq + 8));
                }
            }
        }
    }

    float *dkb = dk + b * d.k_sb + gk * d.k_sh + k0 * d.k_st;
    float *dvb = dv + b * d.v_sb + gk * d.v_sh + k0 * d.v_st;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int j = hf ? kr1 : kr0;
        if (j >= nk) continue;
#pragma unroll
        for (int n = 0; n < ND; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int col = n * 8 + 2 * t4 + c;
                if (col >= D) continue;
                dkb[(int64_t)j * d.k_st + col] = akk[n][2 * hf + c] * scale;
                dvb[(int64_t)j * d.v_st + col] = avv[n][2 * hf + c];
            }
    }
}

/* dQ of attn_bwd_dq_kernel<., true> on tensor cores: block = (b, h, 64 query rows), 4 warps
 * of 16 rows; per visible key tile S = r(Q) r(K)^T, dP = r(dO) r(V)^T, dS = P (dP - Dvec),
 * dQ += r(dS) r(K); dQ *= scale at the end. */
template <int DMAX>
__global__ void __launch_bounds__(NT_MMA) attn_bwd_dq_mma_kernel(
    const anneal_attention_desc d, const float *__restrict__ q, const float *__restrict__ k,
    const float *__restrict__ v, const float *__restrict__ dout, const float *__restrict__ lse,
    const float *__restrict__ dvec, float *__restrict__ dq, int ntiles) {
    constexpr int BQ = 64, BK = 64, LDH = DMAX + 8, LDT = BK + 8, KS = DMAX / 16, NB = BK / 8, ND = DMAX / 8;
    extern __shared__ float smem[];
    uint16_t *Qh = reinterpret_cast<uint16_t *>(smem), *dOh = Qh + BQ * LDH, *Kh = dOh + BQ * LDH;
    uint16_t *Vh = Kh + BK * LDH, *Kt = Vh + BK * LDH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int64_t bh = (int64_t)blockIdx.x / ntiles;
    const int tile = ntiles - 1 - (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bh / d.Hq, h = bh % d.Hq, gk = h / (d.Hq / d.Hkv);
    const int64_t q0 = (int64_t)tile * BQ;
    const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
    const int D = (int)d.D;
    const float scale = d.scale;
    const float *kb = k + b * d.k_sb + gk * d.k_sh;
    const float *vb = v + b * d.v_sb + gk * d.v_sh;
    const int r0 = warp * 16 + g, r1 = r0 + 8; /* this lane's two query rows */

    load_bf16_tile<BQ, DMAX>(Qh, nullptr, q + b * d.q_sb + h * d.q_sh + q0 * d.q_st, d.q_st, nq, D);
    load_bf16_tile<BQ, DMAX>(dOh, nullptr, dout + b * d.o_sb + h * d.o_sh + q0 * d.o_st, d.o_st, nq, D);
    const float l0 = r0 < nq ? lse[bh * d.Tq + q0 + r0] : 0.0f, l1 = r1 < nq ? lse[bh * d.Tq + q0 + r1] : 0.0f;
    const float dv0 = r0 < nq ? dvec[bh * d.Tq + q0 + r0] : 0.0f, dv1 = r1 < nq ? dvec[bh * d.Tq + q0 + r1] : 0.0f;

    float acc[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;

    const int64_t kend = attn_visible(d, q0 + nq - 1);
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = (int)(kend - k0 < BK ? kend - k0 : BK);
        __syncthreads(); /* the previous tile's readers are done (and Q, dO loaded) */
        load_bf16_tile<BK, DMAX>(Kh, Kt, kb + k0 * d.k_st, d.k_st, nk, D);
        load_bf16_tile<BK, DMAX>(Vh, nullptr, vb + k0 * d.v_st, d.v_st, nk, D);
        __syncthreads();

        float s[NB][4], dp[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nb][e] = dp[nb][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t aq[4], ag[4];
            lda_frag<LDH>(aq, Qh + warp * 16 * LDH, ks, g, t4);
            lda_frag<LDH>(ag, dOh + warp * 16 * LDH, ks, g, t4);
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                const uint16_t *pk = Kh + (nb * 8 + g) * LDH + ks * 16 + 2 * t4;
                const uint16_t *pv = Vh + (nb * 8 + g) * LDH + ks * 16 + 2 * t4;
                mma_bf16(s[nb], aq, ld32(pk), ld32(pk + 8));
                mma_bf16(dp[nb], ag, ld32(pv), ld32(pv + 8));
            }
        }
        const int nv0 = r0 < nq ? attn_row_keys(d, q0 + r0, k0, nk) : 0;
        const int nv1 = r1 < nq ? attn_row_keys(d, q0 + r1, k0, nk) : 0;
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = nb * 8 + 2 * t4 + (e & 1);
                const bool hi = e >= 2;
                const float p = j < (hi ? nv1 : nv0) ? expf(scale * s[nb][e] - (hi ? l1 : l0)) : 0.0f;
                s[nb][e] = p * (dp[nb][e] - (hi ? dv1 : dv0)); /* dS */
            }
        /* dQ += r(dS) r(K) */
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t sa[4];
            sa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            sa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            sa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            sa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int n = 0; n < ND; n++) {
                const uint16_t *pk = Kt + (n * 8 + g) * LDT + kk * 16 + 2 * t4;
                mma_bf16(acc[n], sa, ld32(pk), ld32(pk + 8));
            }
        }
    }

    float *dqb = dq + b * d.q_sb + h * d.q_sh + q0 * d.q_st;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int i = hf ? r1 : r0;
        if (i >= nq) continue;
#pragma unroll
        for (int n = 0; n < ND; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int col = n * 8 + 2 * t4 + c;
                if (col < D) dqb[(int64_t)i * d.q_st + col] = acc[n][2 * hf + c] * scale;
            }
    }
}

/* ------------------------- BF16 "fast" kernels, D <= 64 (ANNEAL_CUDA_ATTN_FAST=0: off) */
/* Same arithmetic, same rounding points and the same order of every f32 sum as the mma
 * kernels above (bit-identical results), restructured for speed: K/V (forward) tiles are
 * staged as f32 by cp.async while the previous tile is computed, converted to bf16 once into
 * shared memory, and mma operands are fed with ldmatrix (.trans where a product needs the
 * transpose, so no transposed copy is stored); the forward runs 128 query rows (8 warps) per
 * block and a warp skips the key tiles none of its rows sees. Needs D % 4 == 0, every
 * stride a multiple of 4 floats and 16-byte aligned bases (attn_fast_ok). */
#ifndef ANNEAL_ATTN_EMU
/* r[i] = 8x8 bf16 matrix i (ldmatrix.x4): lane L gives the 16-byte aligned address of
 * row L % 8 of matrix L / 8; lane L receives row L / 4, columns 2 (L % 4), +1 (TRANS: the
 * same of the transposed matrix). */
template <bool TRANS> __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
}
/* Queues the copy of 16 bytes global src -> shared dst (both 16-byte aligned). */
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(src) : "memory");
}
/* Closes the group of copies queued by this thread; waits for all of this thread's copies. */
__device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all(void) { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif

constexpr int FAST_LDH = 64 + 8; /* bf16 row stride (144 bytes: ldmatrix rows conflict-free) */
constexpr int FWD_FAST_NW = 8;   /* warps of the fast forward: 128 query rows per block */

/* Queues dst[r * 64 + c] = src[r * st + c] (f32, cp.async) for r < n, c < D; stores 0 for
 * the other r < ROWS, c < 64. All NTH threads take part; no barrier inside. */
template <int ROWS, int NTH>
__device__ __forceinline__ void stage_tile64(float *dst, const float *src, int64_t st, int n, int D) {
    for (int idx = threadIdx.x; idx < ROWS * 16; idx += NTH) {
        const int r = idx >> 4, c = (idx & 15) * 4;
        float *p = dst + r * 64 + c;
        if (r < n && c < D)
            cp_async16(p, src + (int64_t)r * st + c);
        else
            *reinterpret_cast<float4 *>(p) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

/* dst[r * FAST_LDH + c] = bf16(src[r * 64 + c]) for r < ROWS, c < 64 (shared -> shared). */
template <int ROWS, int NTH> __device__ __forceinline__ void cvt_tile64(uint16_t *dst, const float *src) {
    for (int idx = threadIdx.x; idx < ROWS * 16; idx += NTH) {
        const int r = idx >> 4, c = (idx & 15) * 4;
        const float4 x = *reinterpret_cast<const float4 *>(src + r * 64 + c);
        uint2 u;
        u.x = pack_bf16(x.x, x.y);
        u.y = pack_bf16(x.z, x.w);
        *reinterpret_cast<uint2 *>(dst + r * FAST_LDH + c) = u;
    }
}

/* dst[r * FAST_LDH + c] = bf16(src[r * st + c]) for r < n, c < D, 0 for the other r < ROWS,
 * c < 64 (global f32 -> shared bf16, 16-byte loads). */
template <int ROWS, int NTH>
__device__ __forceinline__ void load_tile64_bf16(uint16_t *dst, const float *src, int64_t st, int n, int D) {
    for (int idx = threadIdx.x; idx < ROWS * 16; idx += NTH) {
        const int r = idx >> 4, c = (idx & 15) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < n && c < D) x = *reinterpret_cast<const float4 *>(src + (int64_t)r * st + c);
        uint2 u;
        u.x = pack_bf16(x.x, x.y);
        u.y = pack_bf16(x.z, x.w);
        *reinterpret_cast<uint2 *>(dst + r * FAST_LDH + c) = u;
    }
}

__host__ __device__ constexpr size_t fwd_fast_smem() {
    return sizeof(float) * 2 * 64 * 64 + sizeof(uint16_t) * (size_t)(16 * FWD_FAST_NW + 2 * 64) * FAST_LDH;
}

/* The fast BF16 forward (D <= 64): results bit-identical to attn_fwd_mma_kernel<64>. Block =
 * (b, h, 16 NW query rows), NW warps of 16 rows; K, V tiles of 64 keys staged (f32,
 * cp.async, one tile ahead) and converted to bf16 row-major tiles; ldmatrix feeds K (S = Q
 * K^T) and V (.trans, P V). */
template <int NW>
__global__ void __launch_bounds__(32 * NW, 2)
    attn_fwd_fast_kernel(const anneal_attention_desc d, const float *__restrict__ q, const float *__restrict__ k,
                         const float *__restrict__ v, float *__restrict__ o, float *__restrict__ lse, int ntiles) {
    constexpr int NTH = 32 * NW, BQ = 16 * NW, BK = 64, LDH = FAST_LDH, KS = 4, NB = BK / 8, ND = 8;
    extern __shared__ float smem[];
    float *Kf = smem, *Vf = Kf + BK * 64;
    uint16_t *Qh = reinterpret_cast<uint16_t *>(Vf + BK * 64), *Kh = Qh + BQ * LDH, *Vh = Kh + BK * LDH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int64_t bh = (int64_t)blockIdx.x / ntiles;
    const int tile = ntiles - 1 - (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bh / d.Hq, h = bh % d.Hq, gk = h / (d.Hq / d.Hkv);
    const int64_t q0 = (int64_t)tile * BQ;
    const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
    const int D = (int)d.D;
    const float *kb = k + b * d.k_sb + gk * d.k_sh;
    const float *vb = v + b * d.v_sb + gk * d.v_sh;
    const float scale = d.scale;

    const int64_t kend = attn_visible(d, q0 + nq - 1); /* keys seen by the block's last row */
    if (kend > 0) {
        const int nk = (int)(kend < BK ? kend : BK);
        stage_tile64<BK, NTH>(Kf, kb, d.k_st, nk, D);
        stage_tile64<BK, NTH>(Vf, vb, d.v_st, nk, D);
        cp_async_commit();
    }
    load_tile64_bf16<BQ, NTH>(Qh, q + b * d.q_sb + h * d.q_sh + q0 * d.q_st, d.q_st, nq, D);
    __syncthreads();
    const int r0 = warp * 16 + g, r1 = r0 + 8; /* this lane's two rows */
    uint32_t qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        const int c0 = ks * 16 + 2 * t4;
        qa[ks][0] = ld32(Qh + r0 * LDH + c0);
        qa[ks][1] = ld32(Qh + r1 * LDH + c0);
        qa[ks][2] = ld32(Qh + r0 * LDH + c0 + 8);
        qa[ks][3] = ld32(Qh + r1 * LDH + c0 + 8);
    }
    /* keys seen by this warp's last valid row (0 when it has none) */
    const int wlast = warp * 16 + 15 < nq ? warp * 16 + 15 : nq - 1;
    const int64_t wend = warp * 16 < nq ? attn_visible(d, q0 + wlast) : 0;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    float acc[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;

    /* ldmatrix lane offsets: K as B of S (rows = keys), V as B of P V (rows = keys, .trans) */
    const int lrow = lane & 7, lsel = (lane >> 3) & 1, lmat = lane >> 4;
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = (int)(kend - k0 < BK ? kend - k0 : BK);
        cp_async_wait_all();
        __syncthreads(); /* the staged tile is visible; the previous tile's readers are done */
        cvt_tile64<BK, NTH>(Kh, Kf);
        cvt_tile64<BK, NTH>(Vh, Vf);
        __syncthreads(); /* Kh, Vh ready; the staging buffers are free */
        if (k0 + BK < kend) {
            const int nk2 = (int)(kend - k0 - BK < BK ? kend - k0 - BK : BK);
            stage_tile64<BK, NTH>(Kf, kb + (k0 + BK) * d.k_st, d.k_st, nk2, D);
            stage_tile64<BK, NTH>(Vf, vb + (k0 + BK) * d.v_st, d.v_st, nk2, D);
            cp_async_commit();
        }
        if (k0 >= wend) continue; /* no row of this warp sees a key of the tile (warp-uniform) */

        /* S = r(Q) r(K)^T: rows r0 (s[.][0..1]) and r1 (s[.][2..3]); each s[nb] sums ks in order */
        float s[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nb][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
#pragma unroll
            for (int nb = 0; nb < NB; nb += 2) {
                uint32_t kf[4];
                ldsm_x4<false>(kf, Kh + ((nb + lmat) * 8 + lrow) * LDH + ks * 16 + lsel * 8);
                mma_bf16(s[nb], qa[ks], kf[0], kf[1]);
                mma_bf16(s[nb + 1], qa[ks], kf[2], kf[3]);
            }
        float x0[NB][2], x1[NB][2];
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            x0[nb][0] = s[nb][0];
            x0[nb][1] = s[nb][1];
            x1[nb][0] = s[nb][2];
            x1[nb][1] = s[nb][3];
        }
        const int nv0 = r0 < nq ? attn_row_keys(d, q0 + r0, k0, nk) : 0;
        const int nv1 = r1 < nq ? attn_row_keys(d, q0 + r1, k0, nk) : 0;
        const float a0 = mma_softmax_row<NB>(x0, nv0, t4, scale, m0, l0);
        const float a1 = mma_softmax_row<NB>(x1, nv1, t4, scale, m1, l1);
#pragma unroll
        for (int n = 0; n < ND; n++) {
            acc[n][0] *= a0;
            acc[n][1] *= a0;
            acc[n][2] *= a1;
            acc[n][3] *= a1;
        }
        /* acc += r(P) r(V) */
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t pa[4];
            pa[0] = pack_bf16(x0[2 * kk][0], x0[2 * kk][1]);
            pa[1] = pack_bf16(x1[2 * kk][0], x1[2 * kk][1]);
            pa[2] = pack_bf16(x0[2 * kk + 1][0], x0[2 * kk + 1][1]);
            pa[3] = pack_bf16(x1[2 * kk + 1][0], x1[2 * kk + 1][1]);
#pragma unroll
            for (int n = 0; n < ND; n += 2) {
                uint32_t vf[4];
                ldsm_x4<true>(vf, Vh + (kk * 16 + lsel * 8 + lrow) * LDH + (n + lmat) * 8);
                mma_bf16(acc[n], pa, vf[0], vf[1]);
                mma_bf16(acc[n + 1], pa, vf[2], vf[3]);
            }
        }
    }

    float *ob = o + b * d.o_sb + h * d.o_sh + q0 * d.o_st;
    float *lb = lse + bh * d.Tq + q0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int i = half ? r1 : r0;
        if (i >= nq) continue;
        const float l = half ? l1 : l0, m = half ? m1 : m0;
        const bool seen = l > 0.0f || l != l;
        const float inv = 1.0f / l;
        float *orow = ob + (int64_t)i * d.o_st;
#pragma unroll
        for (int n = 0; n < ND; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = n * 8 + 2 * t4 + e;
                if (col < D) orow[col] = seen ? acc[n][2 * half + e] * inv : 0.0f;
            }
        if (t4 == 0) lb[i] = seen ? m + logf(l) : -INFINITY;
    }
}

constexpr int DQ_FAST_NW = 8;   /* warps of the fast dQ: 128 query rows per block */
constexpr int DKV_FAST_NW = 4;  /* warps of the fast dK/dV: 64 keys per block */

__host__ __device__ constexpr size_t dq_fast_smem() {
    return sizeof(float) * 2 * 64 * 64 + sizeof(uint16_t) * (size_t)(2 * 16 * DQ_FAST_NW + 2 * 64) * FAST_LDH;
}
__host__ __device__ constexpr size_t dkv_fast_smem() {
    return sizeof(float) * (2 * 64 * 64 + 2 * 64) + sizeof(uint16_t) * (size_t)(2 * 16 * DKV_FAST_NW + 2 * 64) * FAST_LDH;
}

/* The fast dQ (D <= 64): results bit-identical to attn_bwd_dq_mma_kernel<64>. Block = (b, h,
 * 16 NW query rows), NW warps of 16 rows; K, V tiles of 64 keys staged (f32, cp.async, one
 * tile ahead) and converted to bf16 row-major tiles; ldmatrix feeds K, V (S, dP) and K
 * (.trans, dS K). */
template <int NW>
__global__ void __launch_bounds__(32 * NW, 2)
    attn_bwd_dq_fast_kernel(const anneal_attention_desc d, const float *__restrict__ q, const float *__restrict__ k,
                            const float *__restrict__ v, const float *__restrict__ dout,
                            const float *__restrict__ lse, const float *__restrict__ dvec, float *__restrict__ dq,
                            int ntiles) {
    constexpr int NTH = 32 * NW, BQ = 16 * NW, BK = 64, LDH = FAST_LDH, KS = 4, NB = BK / 8, ND = 8;
    extern __shared__ float smem[];
    float *Kf = smem, *Vf = Kf + BK * 64;
    uint16_t *Qh = reinterpret_cast<uint16_t *>(Vf + BK * 64), *dOh = Qh + BQ * LDH, *Kh = dOh + BQ * LDH;
    uint16_t *Vh = Kh + BK * LDH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int64_t bh = (int64_t)blockIdx.x / ntiles;
    const int tile = ntiles - 1 - (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bh / d.Hq, h = bh % d.Hq, gk = h / (d.Hq / d.Hkv);
    const int64_t q0 = (int64_t)tile * BQ;
    const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
    const int D = (int)d.D;
    const float scale = d.scale;
    const float *kb = k + b * d.k_sb + gk * d.k_sh;
    const float *vb = v + b * d.v_sb + gk * d.v_sh;
    const int r0 = warp * 16 + g, r1 = r0 + 8; /* this lane's two query rows */

    const int64_t kend = attn_visible(d, q0 + nq - 1);
    if (kend > 0) {
        const int nk = (int)(kend < BK ? kend : BK);
        stage_tile64<BK, NTH>(Kf, kb, d.k_st, nk, D);
        stage_tile64<BK, NTH>(Vf, vb, d.v_st, nk, D);
        cp_async_commit();
    }
    load_tile64_bf16<BQ, NTH>(Qh, q + b * d.q_sb + h * d.q_sh + q0 * d.q_st, d.q_st, nq, D);
    load_tile64_bf16<BQ, NTH>(dOh, dout + b * d.o_sb + h * d.o_sh + q0 * d.o_st, d.o_st, nq, D);
    const float l0 = r0 < nq ? lse[bh * d.Tq + q0 + r0] : 0.0f, l1 = r1 < nq ? lse[bh * d.Tq + q0 + r1] : 0.0f;
    const float dv0 = r0 < nq ? dvec[bh * d.Tq + q0 + r0] : 0.0f, dv1 = r1 < nq ? dvec[bh * d.Tq + q0 + r1] : 0.0f;
    const int wlast = warp * 16 + 15 < nq ? warp * 16 + 15 : nq - 1;
    const int64_t wend = warp * 16 < nq ? attn_visible(d, q0 + wlast) : 0;

    float acc[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;

    const int lrow = lane & 7, lsel = (lane >> 3) & 1, lmat = lane >> 4;
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = (int)(kend - k0 < BK ? kend - k0 : BK);
        cp_async_wait_all();
        __syncthreads(); /* the staged tile is visible (Q, dO too); the previous tile's readers are done */
        cvt_tile64<BK, NTH>(Kh, Kf);
        cvt_tile64<BK, NTH>(Vh, Vf);
        __syncthreads(); /* Kh, Vh ready; the staging buffers are free */
        if (k0 + BK < kend) {
            const int nk2 = (int)(kend - k0 - BK < BK ? kend - k0 - BK : BK);
            stage_tile64<BK, NTH>(Kf, kb + (k0 + BK) * d.k_st, d.k_st, nk2, D);
            stage_tile64<BK, NTH>(Vf, vb + (k0 + BK) * d.v_st, d.v_st, nk2, D);
            cp_async_commit();
        }
        if (k0 >= wend) continue; /* no row of this warp sees a key of the tile (warp-uniform) */

        float s[NB][4], dp[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nb][e] = dp[nb][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t aq[4], ag[4];
            lda_frag<LDH>(aq, Qh + warp * 16 * LDH, ks, g, t4);
            lda_frag<LDH>(ag, dOh + warp * 16 * LDH, ks, g, t4);
#pragma unroll
            for (int nb = 0; nb < NB; nb += 2) {
                uint32_t kf[4], vf[4];
                ldsm_x4<false>(kf, Kh + ((nb + lmat) * 8 + lrow) * LDH + ks * 16 + lsel * 8);
                ldsm_x4<false>(vf, Vh + ((nb + lmat) * 8 + lrow) * LDH + ks * 16 + lsel * 8);
                mma_bf16(s[nb], aq, kf[0], kf[1]);
                mma_bf16(dp[nb], ag, vf[0], vf[1]);
                mma_bf16(s[nb + 1], aq, kf[2], kf[3]);
                mma_bf16(dp[nb + 1], ag, vf[2], vf[3]);
            }
        }
        const int nv0 = r0 < nq ? attn_row_keys(d, q0 + r0, k0, nk) : 0;
        const int nv1 = r1 < nq ? attn_row_keys(d, q0 + r1, k0, nk) : 0;
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = nb * 8 + 2 * t4 + (e & 1);
                const bool hi = e >= 2;
                const float p = j < (hi ? nv1 : nv0) ? expf(scale * s[nb][e] - (hi ? l1 : l0)) : 0.0f;
                s[nb][e] = p * (dp[nb][e] - (hi ? dv1 : dv0)); /* dS */
            }
        /* dQ += r(dS) r(K) */
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t sa[4];
            sa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            sa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            sa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            sa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int n = 0; n < ND; n += 2) {
                uint32_t kf[4];
                ldsm_x4<true>(kf, Kh + (kk * 16 + lsel * 8 + lrow) * LDH + (n + lmat) * 8);
                mma_bf16(acc[n], sa, kf[0], kf[1]);
                mma_bf16(acc[n + 1], sa, kf[2], kf[3]);
            }
        }
    }

    float *dqb = dq + b * d.q_sb + h * d.q_sh + q0 * d.q_st;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int i = hf ? r1 : r0;
        if (i >= nq) continue;
#pragma unroll
        for (int n = 0; n < ND; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int col = n * 8 + 2 * t4 + c;
                if (col < D) dqb[(int64_t)i * d.q_st + col] = acc[n][2 * hf + c] * scale;
            }
    }
}

/* The fast dK, dV (D <= 64): results bit-identical to attn_bwd_dkdv_mma_kernel<64>. Block =
 * (b, key/value head, 16 NW keys), NW warps of 16 keys; the work items (query head of the
 * group ascending, then the query tiles of 64 rows that see a key of the block, ascending)
 * are staged one ahead: Q, dO tiles as f32 by cp.async (lse, Dvec through a register),
 * converted to bf16 row-major tiles; ldmatrix feeds Q, dO (S^T, dP^T) and, .trans, dO, Q
 * (dV, dK). */
template <int NW>
__global__ void __launch_bounds__(32 * NW)
    attn_bwd_dkdv_fast_kernel(const anneal_attention_desc d, const float *__restrict__ q,
                              const float *__restrict__ k, const float *__restrict__ v,
                              const float *__restrict__ dout, const float *__restrict__ lse,
                              const float *__restrict__ dvec, float *__restrict__ dk, float *__restrict__ dv,
                              int ntiles) {
    constexpr int NTH = 32 * NW, BK = 16 * NW, BQ = 64, LDH = FAST_LDH, KS = 4, NBQ = BQ / 8, ND = 8;
    static_assert(NTH >= 2 * BQ, "lse and Dvec take one thread per value");
    extern __shared__ float smem[];
    float *Qf = smem, *dOf = Qf + BQ * 64, *sm_lse = dOf + BQ * 64, *sm_dv = sm_lse + BQ;
    uint16_t *Kh = reinterpret_cast<uint16_t *>(sm_dv + BQ), *Vh = Kh + BK * LDH, *Qh = Vh + BK * LDH;
    uint16_t *dOh = Qh + BQ * LDH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int64_t bg = (int64_t)blockIdx.x / ntiles;
    const int tile = (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bg / d.Hkv, gk = bg % d.Hkv, G = d.Hq / d.Hkv;
    const int64_t k0 = (int64_t)tile * BK;
    const int nk = (int)(d.Tk - k0 < BK ? d.Tk - k0 : BK);
    const int D = (int)d.D;
    const float scale = d.scale;
    const int kr0 = warp * 16 + g, kr1 = kr0 + 8; /* this lane's two key rows */

    /* query tiles [qt0, ntq) see a key of the block (visible() grows with the row) */
    const int64_t ntq = (d.Tq + BQ - 1) / BQ;
    int64_t qt0 = 0;
    while (qt0 < ntq && attn_visible(d, (qt0 + 1) * BQ < d.Tq ? (qt0 + 1) * BQ - 1 : d.Tq - 1) <= k0) qt0++;
    const int64_t nqt = ntq - qt0, items = G * nqt;

    /* item it: query head gk G + it / nqt, tile qt0 + it % nqt; stage its Q, dO and fetch its lse, Dvec */
    float pre = 0.0f;
    auto stage = [&](int64_t it) {
        const int64_t h = gk * G + it / nqt, q0 = (qt0 + it % nqt) * BQ;
        const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
        stage_tile64<BQ, NTH>(Qf, q + b * d.q_sb + h * d.q_sh + q0 * d.q_st, d.q_st, nq, D);
        stage_tile64<BQ, NTH>(dOf, dout + b * d.o_sb + h * d.o_sh + q0 * d.o_st, d.o_st, nq, D);
        cp_async_commit();
        const int64_t row = (b * d.Hq + h) * d.Tq + q0;
        if (tid < BQ) pre = tid < nq ? lse[row + tid] : 0.0f;
        else if (tid < 2 * BQ) pre = tid - BQ < nq ? dvec[row + tid - BQ] : 0.0f;
    };
    if (items > 0) stage(0);
    load_tile64_bf16<BK, NTH>(Kh, k + b * d.k_sb + gk * d.k_sh + k0 * d.k_st, d.k_st, nk, D);
    load_tile64_bf16<BK, NTH>(Vh, v + b * d.v_sb + gk * d.v_sh + k0 * d.v_st, d.v_st, nk, D);

    float akk[ND][4], avv[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) akk[n][e] = avv[n][e] = 0.0f;

    const int lrow = lane & 7, lsel = (lane >> 3) & 1, lmat = lane >> 4;
    for (int64_t it = 0; it < items; it++) {
        const int64_t q0 = (qt0 + it % nqt) * BQ;
        const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
        cp_async_wait_all();
        __syncthreads(); /* the staged tile is visible (K, V too); the previous tile's readers are done */
        cvt_tile64<BQ, NTH>(Qh, Qf);
        cvt_tile64<BQ, NTH>(dOh, dOf);
        if (tid < BQ) sm_lse[tid] = pre;
        else if (tid < 2 * BQ) sm_dv[tid - BQ] = pre;
        __syncthreads(); /* Qh, dOh, lse, Dvec ready; the staging buffers are free */
        if (it + 1 < items) stage(it + 1);
        /* no row of the tile sees this warp's first key (warp-uniform) */
        if (warp * 16 >= nk || attn_visible(d, q0 + nq - 1) <= k0 + warp * 16) continue;

        /* S^T, dP^T: rows kr0 (e = 0, 1) and kr1 (e = 2, 3), query columns nb*8 + 2 t4 + e%2 */
        float st[NBQ][4], dpt[NBQ][4];
#pragma unroll
        for (int nb = 0; nb < NBQ; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[nb][e] = dpt[nb][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t ak[4], av[4];
            lda_frag<LDH>(ak, Kh + warp * 16 * LDH, ks, g, t4);
            lda_frag<LDH>(av, Vh + warp * 16 * LDH, ks, g, t4);
#pragma unroll
            for (int nb = 0; nb < NBQ; nb += 2) {
                uint32_t qf[4], gf[4];
                ldsm_x4<false>(qf, Qh + ((nb + lmat) * 8 + lrow) * LDH + ks * 16 + lsel * 8);
                ldsm_x4<false>(gf, dOh + ((nb + lmat) * 8 + lrow) * LDH + ks * 16 + lsel * 8);
                mma_bf16(st[nb], ak, qf[0], qf[1]);
                mma_bf16(dpt[nb], av, gf[0], gf[1]);
                mma_bf16(st[nb + 1], ak, qf[2], qf[3]);
                mma_bf16(dpt[nb + 1], av, gf[2], gf[3]);
            }
        }
        /* P^T, dS^T in place (f32), then their bf16 A fragments feed dV and dK */
#pragma unroll
        for (int nb = 0; nb < NBQ; nb++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int i = nb * 8 + 2 * t4 + c; /* query of columns e = c, c + 2 */
                const int nv = i < nq ? attn_row_keys(d, q0 + i, k0, nk) : 0;
                const float li = sm_lse[i], di = sm_dv[i];
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int e = c + 2 * hf, kr = hf ? kr1 : kr0;
                    const float p = kr < nv ? expf(scale * st[nb][e] - li) : 0.0f;
                    st[nb][e] = p;
                    dpt[nb][e] = p * (dpt[nb][e] - di);
                }
            }
#pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) {
            uint32_t pa[4], sa[4];
            pa[0] = pack_bf16(st[2 * kk][0], st[2 * kk][1]);
            pa[1] = pack_bf16(st[2 * kk][2], st[2 * kk][3]);
            pa[2] = pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]);
            pa[3] = pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3]);
            sa[0] = pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]);
            sa[1] = pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]);
            sa[2] = pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
            sa[3] = pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
            for (int n = 0; n < ND; n += 2) {
                uint32_t gf[4], qf[4];
                ldsm_x4<true>(gf, dOh + (kk * 16 + lsel * 8 + lrow) * LDH + (n + lmat) * 8);
                ldsm_x4<true>(qf, Qh + (kk * 16 + lsel * 8 + lrow) * LDH + (n + lmat) * 8);
                mma_bf16(avv[n], pa, gf[0], gf[1]);
                mma_bf16(akk[n], sa, qf[0], qf[1]);
                mma_bf16(avv[n + 1], pa, gf[2], gf[3]);
                mma_bf16(akk[n + 1], sa, qf[2], qf[3]);
            }
        }
    }

    float *dkb = dk + b * d.k_sb + gk * d.k_sh + k0 * d.k_st;
    float *dvb = dv + b * d.v_sb + gk * d.v_sh + k0 * d.v_st;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int j = hf ? kr1 : kr0;
        if (j >= nk) continue;
#pragma unroll
        for (int n = 0; n < ND; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int col = n * 8 + 2 * t4 + c;
                if (col >= D) continue;
                dkb[(int64_t)j * d.k_st + col] = akk[n][2 * hf + c] * scale;
                dvb[(int64_t)j * d.v_st + col] = avv[n][2 * hf + c];
            }
    }
}

/* Dvec[(b*Hq + h)*Tq + i] = dO_i . o_i (double accumulation), one warp per row. */
__global__ void __launch_bounds__(NT) attn_dvec_kernel(const anneal_attention_desc d, const float *__restrict__ o,
                                                       const float *__restrict__ dout, float *__restrict__ dvec,
                                                       int64_t rows) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
    if (row >= rows) return; /* whole warps leave together */
    const int64_t bh = row / d.Tq, i = row % d.Tq, b = bh / d.Hq, h = bh % d.Hq;
    const int64_t off = b * d.o_sb + h * d.o_sh + i * d.o_st;
    double acc = 0.0;
    for (int64_t c = lane; c < d.D; c += 32) acc += (double)dout[off + c] * (double)o[off + c];
    acc = warp_sum_d(acc);
    if (lane == 0) dvec[row] = (float)acc;
}

/* dK, dV: block = (b, key/value head g, key tile of 64); grid = B * Hkv * ntiles. Sums the
 * query heads of g in ascending order, query tiles ascending; overwrites its dk, dv rows. */
template <int DMAX, bool BF>
__global__ void __launch_bounds__(NT) attn_bwd_dkdv_kernel(const anneal_attention_desc d, const float *__restrict__ q,
                                                           const float *__restrict__ k, const float *__restrict__ v,
                                                           const float *__restrict__ dout,
                                                           const float *__restrict__ lse,
                                                           const float *__restrict__ dvec, float *__restrict__ dk,
                                                           float *__restrict__ dv, int ntiles) {
    constexpr int BK = 64, BQ = dkv_bq<DMAX>(), LD = DMAX + 1, LS = BK + 1;
    constexpr int RI = BQ / 16, RJ = BK / 16, RK = BK / 16, RC = DMAX / 16;
    extern __shared__ float smem[];
    float *Ks = smem, *Vs = Ks + BK * LD, *Qs = Vs + BK * LD, *dOs = Qs + BQ * LD;
    float *Ps = dOs + BQ * LD, *dSs = Ps + BQ * LS, *sm_lse = dSs + BQ * LS, *sm_dv = sm_lse + BQ;

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int64_t bg = (int64_t)blockIdx.x / ntiles;
    const int tile = (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bg / d.Hkv, g = bg % d.Hkv, G = d.Hq / d.Hkv;
    const int64_t k0 = (int64_t)tile * BK;
    const int nk = (int)(d.Tk - k0 < BK ? d.Tk - k0 : BK);
    const int D = (int)d.D;
    const float scale = d.scale;

    load_tile<BK, DMAX, BF>(Ks, k + b * d.k_sb + g * d.k_sh + k0 * d.k_st, d.k_st, nk, D, 1.0f);
    load_tile<BK, DMAX, BF>(Vs, v + b * d.v_sb + g * d.v_sh + k0 * d.v_st, d.v_st, nk, D, 1.0f);

    float akk[RK][RC], avv[RK][RC];
#pragma unroll
    for (int r = 0; r < RK; r++)
#pragma unroll
        for (int c = 0; c < RC; c++) akk[r][c] = avv[r][c] = 0.0f;

    for (int64_t h = g * G; h < (g + 1) * G; h++) {
        const float *qh = q + b * d.q_sb + h * d.q_sh;
        const float *gh = dout + b * d.o_sb + h * d.o_sh;
        const float *lh = lse + (b * d.Hq + h) * d.Tq;
        const float *dh = dvec + (b * d.Hq + h) * d.Tq;
        for (int64_t q0 = 0; q0 < d.Tq; q0 += BQ) {
            const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
            if (attn_visible(d, q0 + nq - 1) <= k0) continue; /* no row of the tile sees a key */
            __syncthreads(); /* the previous tile's readers are done */
            load_tile<BQ, DMAX, BF>(Qs, qh + q0 * d.q_st, d.q_st, nq, D, 1.0f);
            load_tile<BQ, DMAX, BF>(dOs, gh + q0 * d.o_st, d.o_st, nq, D, 1.0f);
            for (int i = tid; i < BQ; i += NT) {
                sm_lse[i] = i < nq ? lh[q0 + i] : 0.0f;
                sm_dv[i] = i < nq ? dh[q0 + i] : 0.0f;
            }
            __syncthreads();

            /* S = Q K^T, dP = dO V^T; P = exp(scale S - lse), dS = P (dP - Dvec) */
            float s[RI][RJ], dp[RI][RJ];
#pragma unroll
            for (int r = 0; r < RI; r++)
#pragma unroll
                for (int c = 0; c < RJ; c++) s[r][c] = dp[r][c] = 0.0f;
            for (int e = 0; e < D; e++) {
                float a[RI], gg[RI], kk[RJ], vv[RJ];
#pragma unroll
                for (int r = 0; r < RI; r++) {
                    a[r] = Qs[(ty + 16 * r) * LD + e];
                    gg[r] = dOs[(ty + 16 * r) * LD + e];
                }
#pragma unroll
                for (int c = 0; c < RJ; c++) {
                    kk[c] = Ks[(tx + 16 * c) * LD + e];
                    vv[c] = Vs[(tx + 16 * c) * LD + e];
                }
#pragma unroll
                for (int r = 0; r < RI; r++)
#pragma unroll
                    for (int c = 0; c < RJ; c++) {
                        s[r][c] = fmaf(a[r], kk[c], s[r][c]);
                        dp[r][c] = fmaf(gg[r], vv[c], dp[r][c]);
                    }
            }
#pragma unroll
            for (int r = 0; r < RI; r++) {
                const int i = ty + 16 * r;
                const int nv = i < nq ? attn_row_keys(d, q0 + i, k0, nk) : 0;
                const float li = sm_lse[i], di = sm_dv[i];
#pragma unroll
                for (int c = 0; c < RJ; c++) {
                    const int j = tx + 16 * c;
                    const float p = j < nv ? expf(scale * s[r][c] - li) : 0.0f;
                    const float ds = BF ? p * (dp[r][c] - di) : scale * p * (dp[r][c] - di);
                    Ps[i * LS + j] = attn_op<BF>(p);
                    dSs[i * LS + j] = attn_op<BF>(ds);
                }
            }
            __syncthreads();

            /* dV += P^T dO, dK += dS^T Q */
            for (int i = 0; i < nq; i++) {
                float pr[RK], sr[RK], gq[RC], qq[RC];
#pragma unroll
                for (int r = 0; r < RK; r++) {
                    pr[r] = Ps[i * LS + ty + 16 * r];
                    sr[r] = dSs[i * LS + ty + 16 * r];
                }
#pragma unroll
                for (int c = 0; c < RC; c++) {
                    gq[c] = dOs[i * LD + tx + 16 * c];
                    qq[c] = Qs[i * LD + tx + 16 * c];
                }
#pragma unroll
                for (int r = 0; r < RK; r++)
#pragma unroll
                    for (int c = 0; c < RC; c++) {
                        avv[r][c] = fmaf(pr[r], gq[c], avv[r][c]);
                        akk[r][c] = fmaf(sr[r], qq[c], akk[r][c]);
                    }
            }
        }
    }

    const float kscale = BF ? scale : 1.0f;
    float *dkb = dk + b * d.k_sb + g * d.k_sh + k0 * d.k_st;
    float *dvb = dv + b * d.v_sb + g * d.v_sh + k0 * d.v_st;
#pragma unroll
    for (int r = 0; r < RK; r++) {
        const int j = ty + 16 * r;
        if (j >= nk) continue;
#pragma unroll
        for (int c = 0; c < RC; c++) {
            const int col = tx + 16 * c;
            if (col >= D) continue;
            dkb[(int64_t)j * d.k_st + col] = akk[r][c] * kscale;
            dvb[(int64_t)j * d.v_st + col] = avv[r][c];
        }
    }
}

/* dQ: block = (b, h, query tile of 64); grid = B * Hq * ntiles, heaviest tiles first.
 * Walks the key tiles the tile sees, ascending; overwrites its dq rows. */
template <int DMAX, bool BF>
__global__ void __launch_bounds__(NT) attn_bwd_dq_kernel(const anneal_attention_desc d, const float *__restrict__ q,
                                                         const float *__restrict__ k, const float *__restrict__ v,
                                                         const float *__restrict__ dout,
                                                         const float *__restrict__ lse,
                                                         const float *__restrict__ dvec, float *__restrict__ dq,
                                                         int ntiles) {
    constexpr int BQ = 64, BK = dq_bk<DMAX>(), LD = DMAX + 1, LS = BK + 1;
    constexpr int RI = BQ / 16, RJ = BK / 16, RC = DMAX / 16;
    extern __shared__ float smem[];
    float *Qs = smem, *dOs = Qs + BQ * LD, *Ks = dOs + BQ * LD, *Vs = Ks + BK * LD;
    float *dSs = Vs + BK * LD, *sm_lse = dSs + BQ * LS, *sm_dv = sm_lse + BQ;

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int64_t bh = (int64_t)blockIdx.x / ntiles;
    const int tile = ntiles - 1 - (int)((int64_t)blockIdx.x % ntiles);
    const int64_t b = bh / d.Hq, h = bh % d.Hq, g = h / (d.Hq / d.Hkv);
    const int64_t q0 = (int64_t)tile * BQ;
    const int nq = (int)(d.Tq - q0 < BQ ? d.Tq - q0 : BQ);
    const int D = (int)d.D;
    const float scale = d.scale;
    const float *kb = k + b * d.k_sb + g * d.k_sh;
    const float *vb = v + b * d.v_sb + g * d.v_sh;

    load_tile<BQ, DMAX, BF>(Qs, q + b * d.q_sb + h * d.q_sh + q0 * d.q_st, d.q_st, nq, D, 1.0f);
    load_tile<BQ, DMAX, BF>(dOs, dout + b * d.o_sb + h * d.o_sh + q0 * d.o_st, d.o_st, nq, D, 1.0f);
    for (int i = tid; i < BQ; i += NT) {
        sm_lse[i] = i < nq ? lse[bh * d.Tq + q0 + i] : 0.0f;
        sm_dv[i] = i < nq ? dvec[bh * d.Tq + q0 + i] : 0.0f;
    }
    float acc[RI][RC];
#pragma unroll
    for (int r = 0; r < RI; r++)
#pragma unroll
        for (int c = 0; c < RC; c++) acc[r][c] = 0.0f;

    const int64_t kend = attn_visible(d, q0 + nq - 1);
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = (int)(kend - k0 < BK ? kend - k0 : BK);
        __syncthreads();
        load_tile<BK, DMAX, BF>(Ks, kb + k0 * d.k_st, d.k_st, nk, D, 1.0f);
        load_tile<BK, DMAX, BF>(Vs, vb + k0 * d.v_st, d.v_st, nk, D, 1.0f);
        __syncthreads();

        float s[RI][RJ], dp[RI][RJ];
#pragma unroll
        for (int r = 0; r < RI; r++)
#pragma unroll
            for (int c = 0; c < RJ; c++) s[r][c] = dp[r][c] = 0.0f;
        for (int e = 0; e < D; e++) {
            float a[RI], gg[RI], kk[RJ], vv[RJ];
#pragma unroll
            for (int r = 0; r < RI; r++) {
                a[r] = Qs[(ty + 16 * r) * LD + e];
                gg[r] = dOs[(ty + 16 * r) * LD + e];
            }
#pragma unroll
            for (int c = 0; c < RJ; c++) {
                kk[c] = Ks[(tx + 16 * c) * LD + e];
                vv[c] = Vs[(tx + 16 * c) * LD + e];
            }
#pragma unroll
            for (int r = 0; r < RI; r++)
#pragma unroll
                for (int c = 0; c < RJ; c++) {
                    s[r][c] = fmaf(a[r], kk[c], s[r][c]);
                    dp[r][c] = fmaf(gg[r], vv[c], dp[r][c]);
                }
        }
#pragma unroll
        for (int r = 0; r < RI; r++) {
            const int i = ty + 16 * r;
            const int nv = i < nq ? attn_row_keys(d, q0 + i, k0, nk) : 0;
            const float li = sm_lse[i], di = sm_dv[i];
#pragma unroll
            for (int c = 0; c < RJ; c++) {
                const int j = tx + 16 * c;
                const float p = j < nv ? expf(scale * s[r][c] - li) : 0.0f;
                const float ds = BF ? p * (dp[r][c] - di) : scale * p * (dp[r][c] - di);
                dSs[i * LS + j] = attn_op<BF>(ds);
            }
        }
        __syncthreads();

        /* dQ += dS K */
        for (int j = 0; j < nk; j++) {
            float a[RI], kk[RC];
#pragma unroll
            for (int r = 0; r < RI; r++) a[r] = dSs[(ty + 16 * r) * LS + j];
#pragma unroll
            for (int c = 0; c < RC; c++) kk[c] = Ks[j * LD + tx + 16 * c];
#pragma unroll
            for (int r = 0; r < RI; r++)
#pragma unroll
                for (int c = 0; c < RC; c++) acc[r][c] = fmaf(a[r], kk[c], acc[r][c]);
        }
    }

    const float qscale = BF ? scale : 1.0f;
    float *dqb = dq + b * d.q_sb + h * d.q_sh + q0 * d.q_st;
#pragma unroll
    for (int r = 0; r < RI; r++) {
        const int i = ty + 16 * r;
        if (i >= nq) continue;
#pragma unroll
        for (int c = 0; c < RC; c++) {
            const int col = tx + 16 * c;
            if (col < D) dqb[(int64_t)i * d.q_st + col] = acc[r][c] * qscale;
        }
    }
}

/* True when d is something these kernels compute: a head layout, D <= 128, a compute
 * precision they know, and a grid that fits. */
bool attn_desc_ok(const anneal_attention_desc *d) {
    if (d->B < 0 || d->Hq <= 0 || d->Hkv <= 0 || d->Hq % d->Hkv) return false;
    if (d->Tq < 0 || d->Tk < 0 || d->D < 0 || d->D > 128) return false;
    if (d->compute != ANNEAL_F32 && d->compute != ANNEAL_F16 && d->compute != ANNEAL_BF16) return false;
    /* blocks: B*Hq*ceil(Tq/64) and B*Hkv*ceil(Tk/64) must fit gridDim.x (2^31 - 1) */
    const int64_t lim = 0x7fffffff;
    if (d->B > 0 && (d->Hq > lim / d->B)) return false;
    const int64_t bh = d->B * d->Hq, tq = (d->Tq + 63) / 64, tk = (d->Tk + 63) / 64;
    if (bh > 0 && (tq > lim / bh || tk > lim / bh)) return false;
    return true;
}

/* Sets kernel's dynamic shared memory limit to bytes (above the 48 KiB default). */
template <typename K> anneal_status attn_smem(anneal_cuda_ctx *c, K kernel, size_t bytes, const char *op) {
    if (bytes > c->prop.sharedMemPerBlockOptin)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda %s: needs %zu bytes of shared memory per block", op,
                                bytes);
    return anneal_cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                             op);
}

/* Queues the CUDA-core forward (attn_fwd_kernel). */
template <int DMAX, bool BF>
anneal_status attn_fwd_launch(anneal_cuda_ctx *c, const anneal_attention_desc *d, float *o, float *lse,
                              const float *q, const float *k, const float *v) {
    const int ntiles = (int)((d->Tq + 63) / 64);
    const int64_t blocks = d->B * d->Hq * ntiles;
    const size_t bytes = fwd_smem<DMAX>();
    anneal_status s = attn_smem(c, attn_fwd_kernel<DMAX, BF>, bytes, "attention_fwd");
    if (s != ANNEAL_OK) return s;
    attn_fwd_kernel<DMAX, BF><<<(unsigned)blocks, NT, bytes, c->stream>>>(*d, q, k, v, o, lse, ntiles);
    return anneal_cuda_launch_check("attention_fwd");
}

/* The tensor-core BF16 forward (attn_fwd_mma_kernel). */
template <int DMAX>
anneal_status attn_fwd_mma_launch(anneal_cuda_ctx *c, const anneal_attention_desc *d, float *o, float *lse,
                                  const float *q, const float *k, const float *v) {
    const int ntiles = (int)((d->Tq + 63) / 64);
    const int64_t blocks = d->B * d->Hq * ntiles;
    const size_t bytes = fwd_mma_smem<DMAX>();
    anneal_status s = attn_smem(c, attn_fwd_mma_kernel<DMAX>, bytes, "attention_fwd");
    if (s != ANNEAL_OK) return s;
    attn_fwd_mma_kernel<DMAX><<<(unsigned)blocks, NT_MMA, bytes, c->stream>>>(*d, q, k, v, o, lse, ntiles);
    return anneal_cuda_launch_check("attention_fwd");
}

/* The fast BF16 forward (attn_fwd_fast_kernel; D <= 64, attn_fast_ok). */
anneal_status attn_fwd_fast_launch(anneal_cuda_ctx *c, const anneal_attention_desc *d, float *o, float *lse,
                                   const float *q, const float *k, const float *v) {
    constexpr int BQ = 16 * FWD_FAST_NW;
    const int ntiles = (int)((d->Tq + BQ - 1) / BQ);
    const int64_t blocks = d->B * d->Hq * ntiles;
    const size_t bytes = fwd_fast_smem();
    anneal_status s = attn_smem(c, attn_fwd_fast_kernel<FWD_FAST_NW>, bytes, "attention_fwd");
    if (s != ANNEAL_OK) return s;
    attn_fwd_fast_kernel<FWD_FAST_NW><<<(unsigned)blocks, 32 * FWD_FAST_NW, bytes, c->stream>>>(*d, q, k, v, o, lse,
                                                                                              ntiles);
    return anneal_cuda_launch_check("attention_fwd");
}

/* True unless ANNEAL_CUDA_ATTN_FAST=0: the BF16 attention with D <= 64 runs on the fast
 * kernels where attn_fast_ok allows (else on the mma kernels). */
bool attn_use_fast(void) {
    const char *e = getenv("ANNEAL_CUDA_ATTN_FAST");
    return !(e && e[0] == '0');
}

/* True when the fast kernels can read d's tensors: D <= 64, D and every stride a multiple
 * of 4 floats, and each pointer (p may hold NULLs) 16-byte aligned. */
bool attn_fast_ok(const anneal_attention_desc *d, const float *const *p, int np) {
    if (d->D > 64 || d->D % 4) return false;
    const int64_t st[] = {d->q_sb, d->q_sh, d->q_st, d->k_sb, d->k_sh, d->k_st,
                          d->v_sb, d->v_sh, d->v_st, d->o_sb, d->o_sh, d->o_st};
    for (int64_t x : st)
        if (x % 4) return false;
    for (int i = 0; i < np; i++)
        if ((uintptr_t)p[i] % 16) return false;
    return true;
}

/* True unless ANNEAL_CUDA_ATTN_MMA=0: the BF16 forward runs on tensor cores (else on the
 * CUDA-core kernel, which rounds the same operands). */
bool attn_use_mma(void) {
    const char *e = getenv("ANNEAL_CUDA_ATTN_MMA");
    return !(e && e[0] == '0');
}

/* The tensor-core BF16 backward: Dvec, then attn_bwd_dkdv_mma_kernel and attn_bwd_dq_mma_kernel. */
template <int DMAX>
anneal_status attn_bwd_mma_launch(anneal_cuda_ctx *c, const anneal_attention_desc *d, float *dq, float *dk, float *dv,
                                  const float *q, const float *k, const float *v, const float *o, const float *dout,
                                  const float *lse, float *dvec) {
    const int64_t rows = d->B * d->Hq * d->Tq;
    anneal_status s = ANNEAL_OK;
    if (rows > 0) {
        attn_dvec_kernel<<<(unsigned)((rows + NT / 32 - 1) / (NT / 32)), NT, 0, c->stream>>>(*d, o, dout, dvec,
                                                                                           rows);
        s = anneal_cuda_launch_check("attention_bwd");
        if (s != ANNEAL_OK) return s;
    }
    if (d->Tk > 0) {
        const int ntk = (int)((d->Tk + 63) / 64);
        const size_t bytes = dkv_mma_smem<DMAX>();
        s = attn_smem(c, attn_bwd_dkdv_mma_kernel<DMAX>, bytes, "attention_bwd");
        if (s != ANNEAL_OK) return s;
        attn_bwd_dkdv_mma_kernel<DMAX><<<(unsigned)(d->B * d->Hkv * ntk), NT_MMA, bytes, c->stream>>>(
            *d, q, k, v, dout, lse, dvec, dk, dv, ntk);
        s = anneal_cuda_launch_check("attention_bwd");
        if (s != ANNEAL_OK) return s;
    }
    if (rows == 0) return ANNEAL_OK;
    const int ntq = (int)((d->Tq + 63) / 64);
    const size_t bytes = dq_mma_smem<DMAX>();
    s = attn_smem(c, attn_bwd_dq_mma_kernel<DMAX>, bytes, "attention_bwd");
    if (s != ANNEAL_OK) return s;
    attn_bwd_dq_mma_kernel<DMAX><<<(unsigned)(d->B * d->Hq * ntq), NT_MMA, bytes, c->stream>>>(*d, q, k, v, dout, lse,
                                                                                               dvec, dq, ntq);
    return anneal_cuda_launch_check("attention_bwd");
}

/* The fast BF16 backward (D <= 64, attn_fast_ok): Dvec, then attn_bwd_dkdv_fast_kernel and
 * attn_bwd_dq_fast_kernel. */
anneal_status attn_bwd_fast_launch(anneal_cuda_ctx *c, const anneal_attention_desc *d, float *dq, float *dk,
                                   float *dv, const float *q, const float *k, const float *v, const float *o,
                                   const float *dout, const float *lse, float *dvec) {
    const int64_t rows = d->B * d->Hq * d->Tq;
    anneal_status s = ANNEAL_OK;
    if (rows > 0) {
        attn_dvec_kernel<<<(unsigned)((rows + NT / 32 - 1) / (NT / 32)), NT, 0, c->stream>>>(*d, o, dout, dvec,
                                                                                           rows);
        s = anneal_cuda_launch_check("attention_bwd");
        if (s != ANNEAL_OK) return s;
    }
    if (d->Tk > 0) {
        constexpr int BK = 16 * DKV_FAST_NW;
        const int ntk = (int)((d->Tk + BK - 1) / BK);
        const size_t bytes = dkv_fast_smem();
        s = attn_smem(c, attn_bwd_dkdv_fast_kernel<DKV_FAST_NW>, bytes, "attention_bwd");
        if (s != ANNEAL_OK) return s;
        attn_bwd_dkdv_fast_kernel<DKV_FAST_NW><<<(unsigned)(d->B * d->Hkv * ntk), 32 * DKV_FAST_NW, bytes,
                                                 c->stream>>>(*d, q, k, v, dout, lse, dvec, dk, dv, ntk);
        s = anneal_cuda_launch_check("attention_bwd");
        if (s != ANNEAL_OK) return s;
    }
    if (rows == 0) return ANNEAL_OK;
    constexpr int BQ = 16 * DQ_FAST_NW;
    const int ntq = (int)((d->Tq + BQ - 1) / BQ);
    const size_t bytes = dq_fast_smem();
    s = attn_smem(c, attn_bwd_dq_fast_kernel<DQ_FAST_NW>, bytes, "attention_bwd");
    if (s != ANNEAL_OK) return s;
    attn_bwd_dq_fast_kernel<DQ_FAST_NW><<<(unsigned)(d->B * d->Hq * ntq), 32 * DQ_FAST_NW, bytes, c->stream>>>(
        *d, q, k, v, dout, lse, dvec, dq, ntq);
    return anneal_cuda_launch_check("attention_bwd");
}

/* Queues the CUDA-core backward: Dvec, dK/dV, dQ. */
template <int DMAX, bool BF>
anneal_status attn_bwd_launch(anneal_cuda_ctx *c, const anneal_attention_desc *d, float *dq, float *dk, float *dv,
                              const float *q, const float *k, const float *v, const float *o, const float *dout,
                              const float *lse, float *dvec) {
    const int64_t rows = d->B * d->Hq * d->Tq;
    anneal_status s = ANNEAL_OK;
    if (rows > 0) {
        attn_dvec_kernel<<<(unsigned)((rows + NT / 32 - 1) / (NT / 32)), NT, 0, c->stream>>>(*d, o, dout, dvec,
                                                                                           rows);
        s = anneal_cuda_launch_check("attention_bwd");
        if (s != ANNEAL_OK) return s;
    }

    if (d->Tk > 0) {
        const int ntk = (int)((d->Tk + 63) / 64);
        const size_t bytes = dkv_smem<DMAX>();
        s = attn_smem(c, attn_bwd_dkdv_kernel<DMAX, BF>, bytes, "attention_bwd");
        if (s != ANNEAL_OK) return s;
        attn_bwd_dkdv_kernel<DMAX, BF><<<(unsigned)(d->B * d->Hkv * ntk), NT, bytes, c->stream>>>(
            *d, q, k, v, dout, lse, dvec, dk, dv, ntk);
        s = anneal_cuda_launch_check("attention_bwd");
        if (s != ANNEAL_OK) return s;
    }

    if (rows == 0) return ANNEAL_OK;
    const int ntq = (int)((d->Tq + 63) / 64);
    const size_t bytes = dq_smem<DMAX>();
    s = attn_smem(c, attn_bwd_dq_kernel<DMAX, BF>, bytes, "attention_bwd");
    if (s != ANNEAL_OK) return s;
    attn_bwd_dq_kernel<DMAX, BF><<<(unsigned)(d->B * d->Hq * ntq), NT, bytes, c->stream>>>(*d, q, k, v, dout, lse,
                                                                                           dvec, dq, ntq);
    return anneal_cuda_launch_check("attention_bwd");
}

#define ATTN_F(t) ((float *)((t) ? anneal_data(t) : NULL))

/* o, lse of d (see anneal_attention_desc), queued on the context's stream. */
anneal_status cuda_attention_fwd(void *ctx, const anneal_attention_desc *d, anneal_tensor *o, anneal_tensor *lse,
                                 const anneal_tensor *q, const anneal_tensor *k, const anneal_tensor *v) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status s = anneal_cuda_ensure(c);
    if (s != ANNEAL_OK) return s;
    if (!attn_desc_ok(d))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda attention_fwd: unsupported layout (Hq %lld, Hkv %lld, D %lld)",
                                (long long)d->Hq, (long long)d->Hkv, (long long)d->D);
    if (d->B == 0 || d->Tq == 0) return ANNEAL_OK;
    float *po = ATTN_F(o), *pl = ATTN_F(lse);
    const float *pq = ATTN_F(q), *pk = ATTN_F(k), *pv = ATTN_F(v);
    const bool bf = d->compute == ANNEAL_BF16;
    const float *fp[] = {po, pq, pk, pv};
    if (bf && attn_use_mma() && attn_use_fast() && attn_fast_ok(d, fp, 4))
        return attn_fwd_fast_launch(c, d, po, pl, pq, pk, pv);
    if (bf && attn_use_mma())
        return d->D <= 64 ? attn_fwd_mma_launch<64>(c, d, po, pl, pq, pk, pv)
                          : attn_fwd_mma_launch<128>(c, d, po, pl, pq, pk, pv);
    if (d->D <= 64)
        return bf ? attn_fwd_launch<64, true>(c, d, po, pl, pq, pk, pv)
                  : attn_fwd_launch<64, false>(c, d, po, pl, pq, pk, pv);
    return bf ? attn_fwd_launch<128, true>(c, d, po, pl, pq, pk, pv)
              : attn_fwd_launch<128, false>(c, d, po, pl, pq, pk, pv);
}

/* dq, dk, dv of d (overwritten), queued on the context's stream; Dvec in the ATTN scratch. */
anneal_status cuda_attention_bwd(void *ctx, const anneal_attention_desc *d, anneal_tensor *dq, anneal_tensor *dk,
                                 anneal_tensor *dv, const anneal_tensor *q, const anneal_tensor *k,
                                 const anneal_tensor *v, const anneal_tensor *o, const anneal_tensor *dout,
                                 const anneal_tensor *lse) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status s = anneal_cuda_ensure(c);
    if (s != ANNEAL_OK) return s;
    if (!attn_desc_ok(d))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda attention_bwd: unsupported layout (Hq %lld, Hkv %lld, D %lld)",
                                (long long)d->Hq, (long long)d->Hkv, (long long)d->D);
    if (d->B == 0) return ANNEAL_OK;
    const int64_t rows = d->B * d->Hq * d->Tq;
    float *dvec = NULL; /* unused when there is no query row (dk = dv = 0) */
    if (rows > 0) {
        dvec = (float *)anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_ATTN, sizeof(float) * (size_t)rows);
        if (!dvec) return anneal_last_status();
    }
    float *pdq = ATTN_F(dq), *pdk = ATTN_F(dk), *pdv = ATTN_F(dv);
    const float *pq = ATTN_F(q), *pk = ATTN_F(k), *pv = ATTN_F(v), *po = ATTN_F(o), *pg = ATTN_F(dout),
                *pl = ATTN_F(lse);
    const bool bf = d->compute == ANNEAL_BF16;
    const float *fp[] = {pdq, pdk, pdv, pq, pk, pv, po, pg};
    if (bf && attn_use_mma() && attn_use_fast() && attn_fast_ok(d, fp, 8))
        return attn_bwd_fast_launch(c, d, pdq, pdk, pdv, pq, pk, pv, po, pg, pl, dvec);
    if (bf && attn_use_mma())
        return d->D <= 64 ? attn_bwd_mma_launch<64>(c, d, pdq, pdk, pdv, pq, pk, pv, po, pg, pl, dvec)
                          : attn_bwd_mma_launch<128>(c, d, pdq, pdk, pdv, pq, pk, pv, po, pg, pl, dvec);
    if (d->D <= 64)
        return bf ? attn_bwd_launch<64, true>(c, d, pdq, pdk, pdv, pq, pk, pv, po, pg, pl, dvec)
                  : attn_bwd_launch<64, false>(c, d, pdq, pdk, pdv, pq, pk, pv, po, pg, pl, dvec);
    return bf ? attn_bwd_launch<128, true>(c, d, pdq, pdk, pdv, pq, pk, pv, po, pg, pl, dvec)
              : attn_bwd_launch<128, false>(c, d, pdq, pdk, pdv, pq, pk, pv, po, pg, pl, dvec);
}

#undef ATTN_F

} // namespace

/* Fills the attention slots of the CUDA table. */
extern "C" void anneal_cuda_table_attention(anneal_backend *b) {
    b->attention_fwd = cuda_attention_fwd;
    b->attention_bwd = cuda_attention_bwd;
}

/* True for attention these kernels compute: f32 tensors, Hkv dividing Hq, D <= 128,
 * compute F32, F16 (run as f32) or BF16. */
extern "C" bool anneal_cuda_supports_attention(const anneal_op_query *q) {
    if (q->kind != ANNEAL_OP_ATTENTION) return false;
    if (q->dtype != ANNEAL_F32) return false;
    if (!q->attention) return true; /* no layout to judge yet */
    return attn_desc_ok(q->attention);
}
