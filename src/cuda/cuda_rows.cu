/* The CUDA backend's row slots: LayerNorm, residual add + LayerNorm, RMSNorm and
 * (log-)softmax over the last dim, forward and backward, and the rotary embedding.
 *
 * Bit-parity with the CPU kernels (src/cpu/norm.c, softmax.c, fused_norm.c, rope.c):
 * the CPU sums a row in 16 fixed lanes (element c in lane c % 16, each lane in
 * ascending c) and combines the lanes by a fixed pairwise tree; here a row belongs to
 * one half-warp, lane j sums the same elements in the same order, and shuffles xor 8,
 * 4, 2, 1 reproduce that tree. Every float operation is an explicit round-to-nearest
 * intrinsic (__fadd_rn, __fmul_rn, ...), which nvcc never fuses into an FMA, as the
 * CPU (C11, -ffp-contract=off) does not; exp is the CPU's own polynomial, and the
 * weight/bias gradients use the CPU's fixed 64-row float partials with double totals
 * (two passes through scratch, no atomics). So the norms and softmax give the CPU's
 * bits; only logf (log-softmax) and the rotary cos/sin come from a different library
 * (correctly rounded here, within an ulp of glibc). */
#include "cuda_internal.h"

#include <math.h>

namespace {

constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int ROW_THREADS = 256;                      /* 16 rows (half-warps) per block */
constexpr int ROWS_PER_BLOCK = ROW_THREADS / 16;
constexpr int PARAM_ROW_CHUNK = 64;                   /* the CPU's PARAM_ROW_CHUNK */
constexpr int PARAM_THREADS = 256;

/* ---------------------------------------------------------------- helpers */

/* The sum of v over the 16 lanes of this half-warp, as the CPU's anneal_v16f_sum tree
 * ((l0+l8)+(l4+l12))... in its exact order; every lane gets the result. All 32 lanes
 * of the warp must call it. */
__device__ __forceinline__ float half_warp_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, 8));
    v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, 4));
    v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, 2));
    v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return v;
}

/* A float's bits as an int that orders like the float (the CPU's anneal_float_order). */
__device__ __forceinline__ int float_order(float f) {
    int b = __float_as_int(f);
    return b ^ (-(int)((unsigned)b >> 31) & 0x7FFFFFFF);
}

__device__ __forceinline__ float float_from_order(int m) {
    return __int_as_float(m ^ (-(int)((unsigned)m >> 31) & 0x7FFFFFFF));
}

/* e^x exactly as the CPU's anneal_vexpf (Cody-Waite reduction, Cephes polynomial, two
 * power-of-two factors), operation by operation without FMA: the same bits. */
__device__ __forceinline__ float cpu_expf(float x) {
    float xk = x > -105.0f ? x : -105.0f; /* NaN goes to the low end, restored below */
    xk = xk < 89.0f ? xk : 89.0f;
    float nf = __fsub_rn(__fadd_rn(__fmul_rn(xk, 1.44269504088896341f), 12582912.0f), 12582912.0f);
    int n = (int)nf;
    float r = __fsub_rn(xk, __fmul_rn(nf, 0.693359375f));
    r = __fsub_rn(r, __fmul_rn(nf, -2.12194440e-4f));
    float p = 1.9875691500e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999507e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.3334519073e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665795894e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665459e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 5.0000001201e-1f);
    p = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    int h = n >> 1;
    float s1 = __int_as_float((h + 127) << 23);
    float s2 = __int_as_float((n - h + 127) << 23);
    float res = __fmul_rn(__fmul_rn(p, s1), s2);
    return x == x ? res : x;
}

/* The row of this half-warp and the lane in it; rows past N get C = 0 (no elements)
 * but still take part in the shuffles. */
struct row_ctx {
    int64_t row;
    int lane;
    bool valid;
};

__device__ __forceinline__ row_ctx row_of_thread(int64_t N) {
    row_ctx r;
    r.row = (int64_t)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 16;
    r.lane = (int)(threadIdx.x & 15);
    r.valid = r.row < N;
    return r;
}

/* --------------------------------------------------------------- LayerNorm */

/* One row per half-warp: the CPU's corrected two-pass mean and biased variance
 * (ln_fwd_row), y = (x - mean) * rstd * w (+ b). ADD: the row is s = x + r, written to
 * s first. mean/rstd may be NULL (not written). */
template <bool ADD>
__global__ void ln_fwd_kernel(int64_t N, int64_t C, const float *__restrict__ x, const float *__restrict__ res,
                              float *s, const float *__restrict__ w, const float *__restrict__ b, float eps,
                              float *__restrict__ y, float *__restrict__ mean, float *__restrict__ rstd) {
    row_ctx rc = row_of_thread(N);
    const int64_t n = rc.valid ? C : 0;
    const int64_t base = rc.valid ? rc.row * C : 0;
    const float fC = (float)C;
    float acc = 0.0f;
    if (ADD) {
        for (int64_t c = rc.lane; c < n; c += 16) {
            float v = __fadd_rn(x[base + c], res[base + c]);
            s[base + c] = v;
            acc = __fadd_rn(acc, v);
        }
    } else {
        for (int64_t c = rc.lane; c < n; c += 16) acc = __fadd_rn(acc, x[base + c]);
    }
    const float *src = ADD ? s : x; /* this thread's own writes to s are visible to it */
    const float m0 = __fdiv_rn(half_warp_sum(acc), fC);
    float accd = 0.0f, accq = 0.0f;
    for (int64_t c = rc.lane; c < n; c += 16) {
        float d = __fsub_rn(src[base + c], m0);
        accd = __fadd_rn(accd, d);
        accq = __fadd_rn(accq, __fmul_rn(d, d));
    }
    const float sd = half_warp_sum(accd);
    const float sdd = half_warp_sum(accq);
    const float m = __fadd_rn(m0, __fdiv_rn(sd, fC));
    float var = __fdiv_rn(__fsub_rn(sdd, __fmul_rn(sd, __fdiv_rn(sd, fC))), fC);
    var = var > 0.0f ? var : 0.0f;
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
    if (b) {
        for (int64_t c = rc.lane; c < n; c += 16)
            y[base + c] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(src[base + c], m), r), w[c]), b[c]);
    } else {
        for (int64_t c = rc.lane; c < n; c += 16)
            y[base + c] = __fmul_rn(__fmul_rn(__fsub_rn(src[base + c], m), r), w[c]);
    }
    if (rc.valid && rc.lane == 0) {
        if (mean) mean[rc.row] = m;
        if (rstd) rstd[rc.row] = r;
    }
}

/* One row of dx per half-warp (the CPU's ln_bwd_row): with xhat = (x - mean) * rstd and
 * g = dy * w, dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), plus ds when given. */
__global__ void ln_bwd_dx_kernel(int64_t N, int64_t C, const float *__restrict__ x, const float *__restrict__ w,
                                 const float *__restrict__ mean, const float *__restrict__ rstd,
                                 const float *__restrict__ dy, const float *__restrict__ ds,
                                 float *__restrict__ dx) {
    row_ctx rc = row_of_thread(N);
    const int64_t n = rc.valid ? C : 0;
    const int64_t base = rc.valid ? rc.row * C : 0;
    const float m = rc.valid ? mean[rc.row] : 0.0f, r = rc.valid ? rstd[rc.row] : 0.0f;
    float acc_g = 0.0f, acc_gx = 0.0f;
    for (int64_t c = rc.lane; c < n; c += 16) {
        float g = __fmul_rn(dy[base + c], w[c]);
        acc_g = __fadd_rn(acc_g, g);
        acc_gx = __fadd_rn(acc_gx, __fmul_rn(g, __fmul_rn(__fsub_rn(x[base + c], m), r)));
    }
    const float fC = (float)C;
    const float mg = __fdiv_rn(half_warp_sum(acc_g), fC);
    const float mgx = __fdiv_rn(half_warp_sum(acc_gx), fC);
    for (int64_t c = rc.lane; c < n; c += 16) {
        float xhat = __fmul_rn(__fsub_rn(x[base + c], m), r);
        float d = __fmul_rn(r, __fsub_rn(__fsub_rn(__fmul_rn(dy[base + c], w[c]), mg), __fmul_rn(xhat, mgx)));
        if (ds) d = __fadd_rn(d, ds[base + c]);
        dx[base + c] = d;
    }
}

/* ----------------------------------------------------------------- RMSNorm */

/* One row per half-warp (the CPU's rms_fwd_row): rstd = 1/sqrt(mean(x^2) + eps),
 * y = x * rstd * w. rstd may be NULL. */
__global__ void rms_fwd_kernel(int64_t N, int64_t C, const float *__restrict__ x, const float *__restrict__ w,
                               float eps, float *__restrict__ y, float *__restrict__ rstd) {
    row_ctx rc = row_of_thread(N);
    const int64_t n = rc.valid ? C : 0;
    const int64_t base = rc.valid ? rc.row * C : 0;
    float acc = 0.0f;
    for (int64_t c = rc.lane; c < n; c += 16) {
        float v = x[base + c];
        acc = __fadd_rn(acc, __fmul_rn(v, v));
    }
    const float ms = __fdiv_rn(half_warp_sum(acc), (float)C);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    for (int64_t c = rc.lane; c < n; c += 16) y[base + c] = __fmul_rn(__fmul_rn(x[base + c], r), w[c]);
    if (rc.valid && rc.lane == 0 && rstd) rstd[rc.row] = r;
}

/* One row of dx per half-warp (the CPU's rms_bwd_row): with g = dy * w,
 * dx = rstd * (g - x * rstd^2 * mean(g * x)). */
__global__ void rms_bwd_dx_kernel(int64_t N, int64_t C, const float *__restrict__ x, const float *__restrict__ w,
                                  const float *__restrict__ rstd, const float *__restrict__ dy,
                                  float *__restrict__ dx) {
    row_ctx rc = row_of_thread(N);
    const int64_t n = rc.valid ? C : 0;
    const int64_t base = rc.valid ? rc.row * C : 0;
    const float r = rc.valid ? rstd[rc.row] : 0.0f;
    float acc = 0.0f;
    for (int64_t c = rc.lane; c < n; c += 16)
        acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(dy[base + c], w[c]), x[base + c]));
    const float k = __fmul_rn(__fmul_rn(r, r), __fdiv_rn(half_warp_sum(acc), (float)C));
    for (int64_t c = rc.lane; c < n; c += 16)
        dx[base + c] = __fmul_rn(r, __fsub_rn(__fmul_rn(dy[base + c], w[c]), __fmul_rn(x[base + c], k)));
}

/* ------------------------------------------------- weight / bias gradients */

/* First pass of the parameter gradients: for row chunk k = blockIdx.x (rows
 * [64k, 64k + 64)) and column c, the float sums over the chunk's rows in order of
 * dy * ((x - mean) * rstd) into pw[k * C + c] and of dy into pb (LayerNorm, the CPU's
 * ln_param_cols), or of dy * (x * rstd) into pw (RMS: mean NULL, pb NULL). */
__global__ void param_partial_kernel(int64_t N, int64_t C, const float *__restrict__ x,
                                     const float *__restrict__ mean, const float *__restrict__ rstd,
                                     const float *__restrict__ dy, float *__restrict__ pw,
                                     float *__restrict__ pb) {
    const int64_t c = (int64_t)blockIdx.y * PARAM_THREADS + threadIdx.x;
    if (c >= C) return;
    const int64_t k = blockIdx.x, i0 = k * PARAM_ROW_CHUNK;
    const int64_t i1 = N - i0 < PARAM_ROW_CHUNK ? N : i0 + PARAM_ROW_CHUNK;
    float aw = 0.0f, ab = 0.0f;
    if (mean) {
        for (int64_t i = i0; i < i1; i++) {
            const float m = mean[i], r = rstd[i], d = dy[i * C + c];
            aw = __fadd_rn(aw, __fmul_rn(d, __fmul_rn(__fsub_rn(x[i * C + c], m), r)));
            ab = __fadd_rn(ab, d);
        }
    } else {
        for (int64_t i = i0; i < i1; i++) {
            const float r = rstd[i];
            aw = __fadd_rn(aw, __fmul_rn(dy[i * C + c], __fmul_rn(x[i * C + c], r)));
        }
    }
    if (pw) pw[k * C + c] = aw;
    if (pb) pb[k * C + c] = ab;
}

/* Second pass: out[c] = (float) of the double sum of the chunks' partials, chunks in
 * order (the CPU's double totals). 0 when there are no chunks. */
__global__ void param_total_kernel(int64_t nchunks, int64_t C, const float *__restrict__ part,
                                   float *__restrict__ out) {
    const int64_t c = (int64_t)blockIdx.x * PARAM_THREADS + threadIdx.x;
    if (c >= C) return;
    double a = 0.0;
    for (int64_t k = 0; k < nchunks; k++) a += (double)part[k * C + c];
    out[c] = (float)a;
}

/* ----------------------------------------------------------------- Softmax */

/* One row per half-warp (the CPU's softmax_fwd_row): m = max; softmax
 * y = exp(x - m) * (1 / sum), log-softmax y = (x - m) - log(sum). */
__global__ void softmax_fwd_kernel(int64_t N, int64_t C, const float *__restrict__ x, float *__restrict__ y,
                                   bool log_softmax) {
    row_ctx rc = row_of_thread(N);
    const int64_t n = rc.valid ? C : 0;
    const int64_t base = rc.valid ? rc.row * C : 0;
    int mi = float_order(-INFINITY);
    for (int64_t c = rc.lane; c < n; c += 16) mi = max(mi, float_order(x[base + c]));
    mi = max(mi, __shfl_xor_sync(FULL_MASK, mi, 8));
    mi = max(mi, __shfl_xor_sync(FULL_MASK, mi, 4));
    mi = max(mi, __shfl_xor_sync(FULL_MASK, mi, 2));
    mi = max(mi, __shfl_xor_sync(FULL_MASK, mi, 1));
    const float m = float_from_order(mi);
    float acc = 0.0f;
    for (int64_t c = rc.lane; c < n; c += 16) acc = __fadd_rn(acc, cpu_expf(__fsub_rn(x[base + c], m)));
    const float sum = half_warp_sum(acc);
    if (log_softmax) {
        const float ls = (float)log((double)sum); /* correctly rounded; glibc logf is within 1 ulp */
        for (int64_t c = rc.lane; c < n; c += 16) y[base + c] = __fsub_rn(__fsub_rn(x[base + c], m), ls);
    } else {
        const float inv = __fdiv_rn(1.0f, sum);
        for (int64_t c = rc.lane; c < n; c += 16)
            y[base + c] = __fmul_rn(cpu_expf(__fsub_rn(x[base + c], m)), inv);
    }
}

/* One row of dx per half-warp (the CPU's softmax_bwd_row): softmax dx = y * (dy -
 * sum(dy * y)); log-softmax dx = dy - exp(y) * sum(dy). */
__global__ void softmax_bwd_kernel(int64_t N, int64_t C, const float *__restrict__ y, const float *__restrict__ dy,
                                   float *__restrict__ dx, bool log_softmax) {
    row_ctx rc = row_of_thread(N);
    const int64_t n = rc.valid ? C : 0;
    const int64_t base = rc.valid ? rc.row * C : 0;
    float acc = 0.0f;
    if (log_softmax) {
        for (int64_t c = rc.lane; c < n; c += 16) acc = __fadd_rn(acc, dy[base + c]);
    } else {
        for (int64_t c = rc.lane; c < n; c += 16) acc = __fadd_rn(acc, __fmul_rn(dy[base + c], y[base + c]));
    }
    const float s = half_warp_sum(acc);
    if (log_softmax) {
        for (int64_t c = rc.lane; c < n; c += 16)
            dx[base + c] = __fsub_rn(dy[base + c], __fmul_rn(cpu_expf(y[base + c]), s));
    } else {
        for (int64_t c = rc.lane; c < n; c += 16)
            dx[base + c] = __fmul_rn(y[base + c], __fsub_rn(dy[base + c], s));
    }
}

/* -------------------------------------------------------------------- RoPE */

/* inv_freq for up to MAXH pairs, passed by value (kernel parameter space). */
template <int MAXH>
struct inv_freq_table {
    float v[MAXH];
};

constexpr int ROPE_SMALL_H = 128;  /* D <= 256 */
constexpr int ROPE_LARGE_H = 4096; /* D <= 8192 (16 KiB of parameters: sm_70+, CUDA 12.1+) */
constexpr int ROPE_THREADS = 256;
constexpr int ROPE_ROWS_PER_THREAD = 4;

/* float(2 * math.pi), as rope.c */
constexpr float ROPE_TWO_PI_F32 = 6.28318548f;

/* inv_freq[i] for i < D/2, on the host, operation by operation as the CPU's
 * anneal_cpu_rope_inv_freq (f32 powf and divisions; linear divides by factor; llama3
 * as transformers' _compute_llama3_parameters in float32): the same bits. */
void rope_inv_freq(const anneal_rope_desc *d, int64_t D, float *inv_freq) {
    const int64_t half = D / 2;
    const float fD = (float)D;
    const double omp = (double)d->original_max_pos;
    const float low_wavelen = (float)(omp / (double)d->low_freq_factor);
    const float high_wavelen = (float)(omp / (double)d->high_freq_factor);
    const float band = (float)((double)d->high_freq_factor - (double)d->low_freq_factor);
    for (int64_t i = 0; i < half; i++) {
        const float e = (float)(2 * i) / fD;
        float f = 1.0f / powf(d->theta, e);
        if (d->scaling == ANNEAL_ROPE_SCALING_LINEAR) {
            f = f / d->factor;
        } else if (d->scaling == ANNEAL_ROPE_SCALING_LLAMA3) {
            const float wavelen = (1.0f / f) * ROPE_TWO_PI_F32;
            const float fl = wavelen > low_wavelen ? f / d->factor : f;
            const float smooth = ((1.0f / wavelen) * (float)d->original_max_pos - d->low_freq_factor) / band;
            const float smoothed = (1.0f - smooth) * fl / d->factor + smooth * fl;
            const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
            f = medium ? smoothed : fl;
        }
        inv_freq[i] = f;
    }
}

/* Rotates pair i of row (b, h) at time t, for pair index p = t * half + i
 * (blockIdx.x/threadIdx.x) and rows [rows_per * blockIdx.y, +rows_per): angle
 * a = float(pos0 + t) * inv_freq[i], c = cos(a), s = +-sin(a) (rounded from double:
 * correctly rounded, within an ulp of glibc's cosf/sinf), x'[i] = x[i] c - x[i+h] s,
 * x'[i+h] = x[i+h] c + x[i] s, each product and sum rounded (no FMA), as rope.c. */
template <int MAXH>
__global__ void rope_kernel(inv_freq_table<MAXH> inv, float *x, int64_t H, int64_t T, int64_t half, int64_t rows,
                            int64_t rows_per, int64_t sb, int64_t sh, int64_t st, int64_t pos0, bool inverse) {
    const int64_t p = (int64_t)blockIdx.x * ROPE_THREADS + threadIdx.x;
    if (p >= T * half) return;
    const int64_t t = p / half, i = p % half;
    const float a = __fmul_rn((float)(pos0 + t), inv.v[i]);
    double sd, cd;
    sincos((double)a, &sd, &cd);
    const float c = (float)cd;
    const float s = inverse ? -(float)sd : (float)sd;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per;
    const int64_t r1 = rows - r0 < rows_per ? rows : r0 + rows_per;
    for (int64_t r = r0; r < r1; r++) {
        float *row = x + (r / H) * sb + (r % H) * sh + t * st;
        const float lo = row[i], hi = row[i + half];
        row[i] = __fsub_rn(__fmul_rn(lo, c), __fmul_rn(hi, s));
        row[i + half] = __fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, s));
    }
}

template <int MAXH>
anneal_status rope_launch(anneal_cuda_ctx *c, const anneal_rope_desc *d, anneal_tensor *x, int64_t pos0,
                          bool inverse) {
    const int64_t B = x->shape[0], H = x->shape[1], T = x->shape[2], D = x->shape[3], half = D / 2;
    inv_freq_table<MAXH> inv;
    for (int i = 0; i < MAXH; i++) inv.v[i] = 0.0f;
    rope_inv_freq(d, D, inv.v);
    const int64_t rows = B * H;
    int64_t rows_per = ROPE_ROWS_PER_THREAD;
    if ((rows + rows_per - 1) / rows_per > 65535) rows_per = (rows + 65534) / 65535;
    const int64_t gy = (rows + rows_per - 1) / rows_per;
    const int64_t gx = (T * half + ROPE_THREADS - 1) / ROPE_THREADS;
    if (gx > 0x7fffffff)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda rope: %lld positions x %lld pairs is too many",
                                (long long)T, (long long)half);
    rope_kernel<MAXH><<<dim3((unsigned)gx, (unsigned)gy), ROPE_THREADS, 0, c->stream>>>(
        inv, (float *)anneal_data(x), H, T, half, rows, rows_per, x->strides[0], x->strides[1], x->strides[2], pos0,
        inverse);
    return anneal_cuda_launch_check("rope");
}

/* ------------------------------------------------------------------- slots */

/* The (N, C) rows of the last dim of x (C = 1 and N = 1 for a 0-dim tensor). */
void rows_cols(const anneal_tensor *x, int64_t *N, int64_t *C) {
    *C = x->ndim ? x->shape[x->ndim - 1] : 1;
    *N = *C ? anneal_numel(x) / *C : 0;
}

float *F(const anneal_tensor *t) { return t ? (float *)anneal_data(t) : NULL; }

/* Blocks for N rows of one half-warp each (N > 0). */
unsigned row_blocks(int64_t N) { return (unsigned)((N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK); }

/* The weight (and bias) gradients of N rows of C: the CPU's chunked sums through
 * REDUCE scratch (nchunks x C floats per output) and one total kernel per output.
 * mean NULL: RMS (dw = sum dy * x * rstd). dw, db may each be NULL. */
anneal_status param_grads(anneal_cuda_ctx *c, const char *op, int64_t N, int64_t C, const float *x,
                          const float *mean, const float *rstd, const float *dy, float *dw, float *db) {
    if ((!dw && !db) || C == 0) return ANNEAL_OK;
    const int64_t nchunks = (N + PARAM_ROW_CHUNK - 1) / PARAM_ROW_CHUNK;
    const int64_t cblocks = (C + PARAM_THREADS - 1) / PARAM_THREADS;
    if (cblocks > 65535 || nchunks > 0x7fffffff)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda %s: %lld rows of %lld are too many for the "
                                "parameter gradient kernel", op, (long long)N, (long long)C);
    float *pw = NULL, *pb = NULL;
    if (nchunks > 0) {
        const size_t per = (size_t)nchunks * (size_t)C;
        float *part = (float *)anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_REDUCE,
                                                   per * sizeof(float) * ((dw ? 1 : 0) + (db ? 1 : 0)));
        if (!part) return anneal_set_error(ANNEAL_ERR_OOM, "cuda %s: no memory for the gradient partials", op);
        pw = dw ? part : NULL;
        pb = db ? (dw ? part + per : part) : NULL;
        param_partial_kernel<<<dim3((unsigned)nchunks, (unsigned)cblocks), PARAM_THREADS, 0, c->stream>>>(
            N, C, x, mean, rstd, dy, pw, pb);
        anneal_status st = anneal_cuda_launch_check(op);
        if (st != ANNEAL_OK) return st;
    }
    const unsigned tb = (unsigned)cblocks;
    if (dw) {
        param_total_kernel<<<tb, PARAM_THREADS, 0, c->stream>>>(nchunks, C, pw, dw);
        anneal_status st = anneal_cuda_launch_check(op);
        if (st != ANNEAL_OK) return st;
    }
    if (db) {
        param_total_kernel<<<tb, PARAM_THREADS, 0, c->stream>>>(nchunks, C, pb, db);
        anneal_status st = anneal_cuda_launch_check(op);
        if (st != ANNEAL_OK) return st;
    }
    return ANNEAL_OK;
}

/* LayerNorm forward of x's rows into y, mean, rstd (b may be NULL): the CPU's bits. */
anneal_status cuda_layer_norm_fwd(void *ctx, anneal_tensor *y, anneal_tensor *mean, anneal_tensor *rstd,
                                  const anneal_tensor *x, const anneal_tensor *w, const anneal_tensor *b, float eps) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(x, &N, &C);
    if (N == 0) return ANNEAL_OK;
    ln_fwd_kernel<false><<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(x), NULL, NULL, F(w), F(b), eps, F(y),
                                                                        F(mean), F(rstd));
    return anneal_cuda_launch_check("layer_norm_fwd");
}

/* LayerNorm backward: dx per row, dw/db by chunked column sums; each may be NULL. */
anneal_status cuda_layer_norm_bwd(void *ctx, anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                  const anneal_tensor *x, const anneal_tensor *w, const anneal_tensor *mean,
                                  const anneal_tensor *rstd, const anneal_tensor *dy) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(x, &N, &C);
    if (dx && N > 0) {
        ln_bwd_dx_kernel<<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(x), F(w), F(mean), F(rstd), F(dy),
                                                                        NULL, F(dx));
        st = anneal_cuda_launch_check("layer_norm_bwd");
        if (st != ANNEAL_OK) return st;
    }
    return param_grads(c, "layer_norm_bwd", N, C, F(x), F(mean), F(rstd), F(dy), F(dw), F(db));
}

/* s = x + r and LayerNorm(s) in one pass (the CPU's bits for add then layer_norm). */
anneal_status cuda_add_layer_norm_fwd(void *ctx, anneal_tensor *s, anneal_tensor *y, anneal_tensor *mean,
                                      anneal_tensor *rstd, const anneal_tensor *x, const anneal_tensor *r,
                                      const anneal_tensor *w, const anneal_tensor *b, float eps) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(x, &N, &C);
    if (N == 0) return ANNEAL_OK;
    ln_fwd_kernel<true><<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(x), F(r), F(s), F(w), F(b), eps, F(y),
                                                                       F(mean), F(rstd));
    return anneal_cuda_launch_check("add_layer_norm_fwd");
}

/* LayerNorm backward at s, dx += ds (ds may be NULL); dx, dw, db may each be NULL. */
anneal_status cuda_add_layer_norm_bwd(void *ctx, anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                      const anneal_tensor *s, const anneal_tensor *w, const anneal_tensor *mean,
                                      const anneal_tensor *rstd, const anneal_tensor *dy, const anneal_tensor *ds) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(s, &N, &C);
    if (dx && N > 0) {
        ln_bwd_dx_kernel<<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(s), F(w), F(mean), F(rstd), F(dy),
                                                                        F(ds), F(dx));
        st = anneal_cuda_launch_check("add_layer_norm_bwd");
        if (st != ANNEAL_OK) return st;
    }
    return param_grads(c, "add_layer_norm_bwd", N, C, F(s), F(mean), F(rstd), F(dy), F(dw), F(db));
}

/* RMSNorm forward of x's rows into y and rstd: the CPU's bits. */
anneal_status cuda_rms_norm_fwd(void *ctx, anneal_tensor *y, anneal_tensor *rstd, const anneal_tensor *x,
                                const anneal_tensor *w, float eps) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(x, &N, &C);
    if (N == 0) return ANNEAL_OK;
    rms_fwd_kernel<<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(x), F(w), eps, F(y), F(rstd));
    return anneal_cuda_launch_check("rms_norm_fwd");
}

/* RMSNorm backward: dx per row, dw by chunked column sums; either may be NULL. */
anneal_status cuda_rms_norm_bwd(void *ctx, anneal_tensor *dx, anneal_tensor *dw, const anneal_tensor *x,
                                const anneal_tensor *w, const anneal_tensor *rstd, const anneal_tensor *dy) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(x, &N, &C);
    if (dx && N > 0) {
        rms_bwd_dx_kernel<<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(x), F(w), F(rstd), F(dy), F(dx));
        st = anneal_cuda_launch_check("rms_norm_bwd");
        if (st != ANNEAL_OK) return st;
    }
    return param_grads(c, "rms_norm_bwd", N, C, F(x), NULL, F(rstd), F(dy), F(dw), NULL);
}

/* Softmax / log-softmax of each row of x into y: the CPU's bits (log: up to an ulp of
 * the log of the row sum). */
anneal_status cuda_softmax_fwd(void *ctx, anneal_tensor *y, const anneal_tensor *x, bool log) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(x, &N, &C);
    if (N == 0) return ANNEAL_OK;
    softmax_fwd_kernel<<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(x), F(y), log);
    return anneal_cuda_launch_check("softmax_fwd");
}

/* Softmax / log-softmax backward from the output y: the CPU's bits. */
anneal_status cuda_softmax_bwd(void *ctx, anneal_tensor *dx, const anneal_tensor *y, const anneal_tensor *dy,
                               bool log) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    int64_t N, C;
    rows_cols(y, &N, &C);
    if (N == 0) return ANNEAL_OK;
    softmax_bwd_kernel<<<row_blocks(N), ROW_THREADS, 0, c->stream>>>(N, C, F(y), F(dy), F(dx), log);
    return anneal_cuda_launch_check("softmax_bwd");
}

/* In-place rotary embedding of x (B, H, T, D; unit last stride), positions pos0 + t,
 * inverse rotating by the negative angle; D up to 8192. */
anneal_status cuda_rope(void *ctx, const anneal_rope_desc *d, anneal_tensor *x, int64_t pos0, bool inverse) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if ((unsigned)d->scaling > ANNEAL_ROPE_SCALING_LLAMA3 || x->ndim != 4 || (x->shape[3] > 1 && x->strides[3] != 1))
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda rope: needs a (B, H, T, D) view with a unit last stride and "
                                "a known scaling");
    const int64_t B = x->shape[0], H = x->shape[1], T = x->shape[2], D = x->shape[3], half = D / 2;
    if (B <= 0 || H <= 0 || T <= 0 || half <= 0 || D % 2 != 0) return ANNEAL_OK; /* as the CPU: nothing to do */
    if (half <= ROPE_SMALL_H) return rope_launch<ROPE_SMALL_H>(c, d, x, pos0, inverse);
    if (half <= ROPE_LARGE_H) return rope_launch<ROPE_LARGE_H>(c, d, x, pos0, inverse);
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda rope: head size %lld is over 8192", (long long)D);
}

} /* namespace */

/* Fills the row slots: layer_norm, add_layer_norm, rms_norm, softmax (fwd/bwd), rope. */
extern "C" void anneal_cuda_table_rows(anneal_backend *b) {
    b->layer_norm_fwd = cuda_layer_norm_fwd;
    b->layer_norm_bwd = cuda_layer_norm_bwd;
    b->add_layer_norm_fwd = cuda_add_layer_norm_fwd;
    b->add_layer_norm_bwd = cuda_add_layer_norm_bwd;
    b->rms_norm_fwd = cuda_rms_norm_fwd;
    b->rms_norm_bwd = cuda_rms_norm_bwd;
    b->softmax_fwd = cuda_softmax_fwd;
    b->softmax_bwd = cuda_softmax_bwd;
    b->rope = cuda_rope;
}

/* f32 storage only (as the CPU), and a known rotary scaling. */
extern "C" bool anneal_cuda_supports_rows(const anneal_op_query *q) {
    switch (q->kind) {
    case ANNEAL_OP_LAYER_NORM: case ANNEAL_OP_ADD_LAYER_NORM: case ANNEAL_OP_RMS_NORM: case ANNEAL_OP_SOFTMAX:
        return q->dtype == ANNEAL_F32;
    case ANNEAL_OP_ROPE:
        return q->dtype == ANNEAL_F32 && (!q->rope || (unsigned)q->rope->scaling <= ANNEAL_ROPE_SCALING_LLAMA3);
    default:
        return false;
    }
}
