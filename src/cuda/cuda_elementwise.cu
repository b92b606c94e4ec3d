/* The CUDA backend's elementwise slots: copy (converting, any strides), fill, binary,
 * unary and its backward, scale_by, reduce_sum and sum_squares.
 *
 * Each slot does the CPU backend's arithmetic (src/cpu/elementwise.c, pointwise.c,
 * adamw.c, src/core/dtype.c): the same float operations in the same order, each rounded
 * on its own (the __f*_rn / __d*_rn intrinsics keep nvcc from fusing a multiply and an
 * add into an FMA), the CPU's own expf polynomial and the CPU's dtype conversions bit
 * for bit, so elementwise f32 results have the CPU's bits. Reductions accumulate in
 * double over a fixed tree whose shape depends on the tensor shapes only, never on the
 * GPU or on scheduling: the same inputs give the same bits on every call. */
#include "cuda_internal.h"

#include <stdint.h>
#include <string.h>

/* The per-element functions are __host__ __device__: a host build can compare them with
 * the CPU backend's code. */
#define HD static __host__ __device__ __forceinline__

namespace {

constexpr int kThreads = 256;          /* every kernel here: block_sum relies on it */
constexpr int kMaxDims = ANNEAL_MAX_DIMS;
constexpr int64_t kReduceThreads = 262144; /* reduce_sum: partial sums wanted in pass 1 */
constexpr int64_t kReduceMinRun = 16;      /* and at least this many elements in each */
constexpr int64_t kSumSqMaxBlocks = 1024;  /* sum_squares: at most this many partials */
constexpr int64_t kSumSqPerThread = 16;    /* and about this many elements per thread */

/* A strided view for kernels: element i, row-major over shape, is at sum(idx[d] *
 * strides[d]) elements from the first. Passed to kernels by value. */
struct view {
    int ndim;
    int64_t shape[kMaxDims];
    int64_t strides[kMaxDims];
};

} // namespace

/* Every function below is static: internal linkage. (Kernels stay out of the anonymous
 * namespace: nvcc gives the host-side launch wrappers of a kernel declared there external linkage.) */

/* The offset of row-major element i of v (v.ndim >= 1). */
HD int64_t view_offset(const view &v, int64_t i) {
    int64_t off = 0;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int d = kMaxDims - 1; d >= 1; d--) {
        if (d < v.ndim) {
            int64_t s = v.shape[d];
            int64_t q = i / s;
            off += (i - q * s) * v.strides[d];
            i = q;
        }
    }
    return off + i * v.strides[0];
}

/* Writes into out[0..n_ops) the views of a shape shared by n_ops operands, collapsed as
 * the CPU's strided iterator does: size-1 dims dropped, a dim merged into the one before
 * it when every operand's strides allow. Row-major element order is kept, so element i
 * of every view is the same element of the shape. Returns the number of elements. */
static int64_t collapse(int ndim, const int64_t *shape, int n_ops, const int64_t *const *strides, view *out) {
    int nd = 0;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue;
        if (nd > 0) {
            bool merge = true;
            for (int o = 0; o < n_ops; o++)
                if (out[o].strides[nd - 1] != strides[o][d] * shape[d]) merge = false;
            if (merge) {
                for (int o = 0; o < n_ops; o++) {
                    out[o].shape[nd - 1] *= shape[d];
                    out[o].strides[nd - 1] = strides[o][d];
                }
                continue;
            }
        }
        for (int o = 0; o < n_ops; o++) {
            out[o].shape[nd] = shape[d];
            out[o].strides[nd] = strides[o][d];
        }
        nd++;
    }
    if (nd == 0) { /* a scalar (all dims 1) */
        for (int o = 0; o < n_ops; o++) {
            out[o].shape[0] = 1;
            out[o].strides[0] = 0;
        }
        nd = 1;
    }
    for (int o = 0; o < n_ops; o++) {
        out[o].ndim = nd;
        for (int d = nd; d < kMaxDims; d++) {
            out[o].shape[d] = 1;
            out[o].strides[d] = 0;
        }
    }
    return n;
}

/* True when v addresses its elements one after another (unit stride, no gaps). */
static bool view_unit(const view &v) { return v.ndim == 1 && (v.strides[0] == 1 || v.shape[0] == 1); }

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Blocks for a grid-stride loop over n items (n > 0): enough to fill the GPU, no more. */
static unsigned grid_for(const anneal_cuda_ctx *c, int64_t n) {
    int64_t cap = (int64_t)(c->prop.multiProcessorCount > 0 ? c->prop.multiProcessorCount : 132) * 32;
    int64_t b = ceil_div(n, kThreads);
    return (unsigned)(b < cap ? b : cap);
}

#define GRID_STRIDE(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* Float and double arithmetic, one IEEE operation each, rounded to nearest: on the
 * device the _rn intrinsics (never contracted into an FMA), on the host (x86-64 SSE, no
 * FMA: a host build checks these functions against the CPU's code) the operators. */
HD float rn_fmul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
HD float rn_fadd(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
HD float rn_fsub(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
HD float rn_fdiv(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
HD double rn_dadd(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
HD double rn_dmul(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
HD double rn_ddiv(double a, double b) {
#ifdef __CUDA_ARCH__
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}
HD float rn_d2f(double v) {
#ifdef __CUDA_ARCH__
    return __double2float_rn(v);
#else
    return (float)v;
#endif
}
HD double rn_ll2d(long long v) {
#ifdef __CUDA_ARCH__
    return __ll2double_rn(v);
#else
    return (double)v;
#endif
}
HD float bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}
HD uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

/* --------------------------------------------------------------- dtypes */

/* src/core/dtype.c's conversions, bit for bit (NaN payloads included). */
HD float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

HD uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

HD float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        float v = rn_fmul((float)man, 1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

HD uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;
    if (a >= 0x477ff000u) return sign | 0x7c00u;
    if (a < 0x38800000u) {
        float v = rn_fmul(bits_f32(a), 16777216.0f);
        uint32_t m = (uint32_t)v;
        float rem = rn_fsub(v, (float)m);
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
        return sign | (uint16_t)m;
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)((r - (112u << 23)) >> 13);
}

/* double -> int32/int64 as x86-64's cvttsd2si does it (the CPU backend's C casts):
 * truncation toward zero, the minimum value for NaN and out-of-range values. The
 * narrower integer types keep the low bits of the int32 (what gcc emits for them). */
HD int32_t d2i32(double v) {
    return (v > -2147483649.0 && v < 2147483648.0) ? (int32_t)v : INT32_MIN;
}

HD int64_t d2i64(double v) {
    return (v >= -9223372036854775808.0 && v < 9223372036854775808.0) ? (int64_t)v : INT64_MIN;
}

/* The CPU's load_as_double: element i of base (dtype dt) as a double. */
HD double load_d(const void *base, int dt, int64_t i) {
    switch (dt) {
    case ANNEAL_F32: return (double)((const float *)base)[i];
    case ANNEAL_BF16: return (double)bf16_to_f32(((const uint16_t *)base)[i]);
    case ANNEAL_F16: return (double)f16_to_f32(((const uint16_t *)base)[i]);
    case ANNEAL_I32: return (double)((const int32_t *)base)[i];
    case ANNEAL_I64: return rn_ll2d(((const long long *)base)[i]);
    case ANNEAL_U16: return (double)((const uint16_t *)base)[i];
    case ANNEAL_U8: return (double)((const uint8_t *)base)[i];
    case ANNEAL_I8: return (double)((const int8_t *)base)[i];
    case ANNEAL_F64: return ((const double *)base)[i];
    default: return 0.0;
    }
}

/* The CPU's store_double: floats round (f32 first, then bf16/f16 to nearest even),
 * integers truncate toward zero. */
HD void store_d(void *base, int dt, int64_t i, double v) {
    switch (dt) {
    case ANNEAL_F32: ((float *)base)[i] = rn_d2f(v); break;
    case ANNEAL_BF16: ((uint16_t *)base)[i] = f32_to_bf16(rn_d2f(v)); break;
    case ANNEAL_F16: ((uint16_t *)base)[i] = f32_to_f16(rn_d2f(v)); break;
    case ANNEAL_I32: ((int32_t *)base)[i] = d2i32(v); break;
    case ANNEAL_I64: ((long long *)base)[i] = (long long)d2i64(v); break;
    case ANNEAL_U16: ((uint16_t *)base)[i] = (uint16_t)(uint32_t)d2i32(v); break;
    case ANNEAL_U8: ((uint8_t *)base)[i] = (uint8_t)(uint32_t)d2i32(v); break;
    case ANNEAL_I8: ((int8_t *)base)[i] = (int8_t)(uint8_t)(uint32_t)d2i32(v); break;
    case ANNEAL_F64: ((double *)base)[i] = v; break;
    default: break;
    }
}

/* The CPU's integer-to-integer path: through int64 (exact), I64 stored as is, the others
 * through store_d. */
HD int64_t load_i64(const void *base, int dt, int64_t i) {
    if (dt == ANNEAL_I64) return ((const long long *)base)[i];
    return (int64_t)load_d(base, dt, i);
}

HD void store_i64(void *base, int dt, int64_t i, int64_t v) {
    if (dt == ANNEAL_I64) ((long long *)base)[i] = (long long)v;
    else store_d(base, dt, i, rn_ll2d((long long)v));
}

static bool dtype_is_int(anneal_dtype dt) {
    return dt == ANNEAL_I32 || dt == ANNEAL_I64 || dt == ANNEAL_U16 || dt == ANNEAL_U8 || dt == ANNEAL_I8;
}

/* ----------------------------------------------------------- copy, fill */

/* dst = src for same-dtype elements of T's size (a bit copy, like the CPU's memcpy). */
template <typename T>
static __global__ void copy_same_kernel(view dv, view sv, int64_t n, T *dst, const T *src) {
    GRID_STRIDE(i, n) dst[view_offset(dv, i)] = src[view_offset(sv, i)];
}

/* dst = src converting between dtypes (ints: the integer path; else through double). */
HD void copy_convert_item(const view &dv, const view &sv, int64_t i, void *dst, int dd, const void *src, int sd,
                          bool ints) {
    int64_t od = view_offset(dv, i), os = view_offset(sv, i);
    if (ints) store_i64(dst, dd, od, load_i64(src, sd, os));
    else store_d(dst, dd, od, load_d(src, sd, os));
}

static __global__ void copy_convert_kernel(view dv, view sv, int64_t n, void *dst, int dd, const void *src, int sd,
                                    bool ints) {
    GRID_STRIDE(i, n) copy_convert_item(dv, sv, i, dst, dd, src, sd, ints);
}

/* Every element of the view = bits. */
template <typename T>
static __global__ void fill_kernel(view v, int64_t n, T *dst, T bits) {
    GRID_STRIDE(i, n) dst[view_offset(v, i)] = bits;
}

/* Queues the same-dtype strided copy for element size esz. */
static anneal_status launch_copy_same(anneal_cuda_ctx *c, const view &dv, const view &sv, int64_t n, size_t esz,
                               void *dst, const void *src) {
    unsigned g = grid_for(c, n);
    switch (esz) {
    case 1: copy_same_kernel<uint8_t><<<g, kThreads, 0, c->stream>>>(dv, sv, n, (uint8_t *)dst, (const uint8_t *)src); break;
    case 2: copy_same_kernel<uint16_t><<<g, kThreads, 0, c->stream>>>(dv, sv, n, (uint16_t *)dst, (const uint16_t *)src); break;
    case 4: copy_same_kernel<uint32_t><<<g, kThreads, 0, c->stream>>>(dv, sv, n, (uint32_t *)dst, (const uint32_t *)src); break;
    case 8: copy_same_kernel<unsigned long long><<<g, kThreads, 0, c->stream>>>(dv, sv, n, (unsigned long long *)dst, (const unsigned long long *)src); break;
    default: return anneal_set_error(ANNEAL_ERR_ARG, "cuda copy: element size %zu", esz);
    }
    return anneal_cuda_launch_check("copy");
}

/* dst = src (same shape): a device-to-device memcpy when both are contiguous in the
 * same dtype (through scratch when they partly overlap, as memmove), else one strided
 * kernel. */
static anneal_status cuda_copy(void *ctx, anneal_tensor *dst, const anneal_tensor *src) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (dst->ndim > kMaxDims || src->ndim != dst->ndim)
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda copy: %d-dim into %d-dim", src->ndim, dst->ndim);
    if ((unsigned)dst->dtype >= ANNEAL_DTYPE_COUNT || (unsigned)src->dtype >= ANNEAL_DTYPE_COUNT)
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda copy: invalid dtype");
    int64_t n = anneal_numel(dst);
    if (n == 0) return ANNEAL_OK;
    size_t esz = anneal_dtype_size(dst->dtype);
    char *d = (char *)anneal_data(dst);
    const char *s = (const char *)anneal_data(src);
    if (dst->dtype == src->dtype && anneal_is_contiguous(dst) && anneal_is_contiguous(src)) {
        size_t bytes = (size_t)n * esz;
        if (d == s) return ANNEAL_OK;
        if (d + bytes <= s || s + bytes <= d)
            return anneal_cuda_check(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, c->stream), "copy");
        void *tmp = anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_MISC, bytes);
        if (!tmp) return anneal_last_status();
        st = anneal_cuda_check(cudaMemcpyAsync(tmp, s, bytes, cudaMemcpyDeviceToDevice, c->stream), "copy");
        if (st != ANNEAL_OK) return st;
        return anneal_cuda_check(cudaMemcpyAsync(d, tmp, bytes, cudaMemcpyDeviceToDevice, c->stream), "copy");
    }
    view v[2];
    const int64_t *strides[2] = {dst->strides, src->strides};
    collapse(dst->ndim, dst->shape, 2, strides, v);
    if (dst->dtype == src->dtype) return launch_copy_same(c, v[0], v[1], n, esz, d, s);
    bool ints = dtype_is_int(dst->dtype) && dtype_is_int(src->dtype);
    copy_convert_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>(v[0], v[1], n, d, (int)dst->dtype, s,
                                                                     (int)src->dtype, ints);
    return anneal_cuda_launch_check("copy");
}

/* The bits the CPU's store_double writes for value in dtype dt (host side: the same C
 * casts and conversions as src/cpu/elementwise.c). */
static uint64_t fill_bits(anneal_dtype dt, double value) {
    uint64_t bits = 0;
    switch (dt) {
    case ANNEAL_F32: { float f = (float)value; memcpy(&bits, &f, 4); break; }
    case ANNEAL_BF16: bits = anneal_f32_to_bf16((float)value); break;
    case ANNEAL_F16: bits = anneal_f32_to_f16((float)value); break;
    case ANNEAL_I32: { int32_t x = (int32_t)value; memcpy(&bits, &x, 4); break; }
    case ANNEAL_I64: { int64_t x = (int64_t)value; memcpy(&bits, &x, 8); break; }
    case ANNEAL_U16: bits = (uint16_t)value; break;
    case ANNEAL_U8: bits = (uint8_t)value; break;
    case ANNEAL_I8: { int8_t x = (int8_t)value; memcpy(&bits, &x, 1); break; }
    case ANNEAL_F64: memcpy(&bits, &value, 8); break;
    default: break;
    }
    return bits;
}

/* Every element of dst = value: cudaMemsetAsync where the bytes allow it (contiguous,
 * a zero or one-byte pattern), else a strided kernel writing the converted bits. */
static anneal_status cuda_fill(void *ctx, anneal_tensor *dst, double value) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (dst->ndim > kMaxDims) return anneal_set_error(ANNEAL_ERR_ARG, "cuda fill: %d dims", dst->ndim);
    if ((unsigned)dst->dtype >= ANNEAL_DTYPE_COUNT) return anneal_set_error(ANNEAL_ERR_ARG, "cuda fill: invalid dtype");
    int64_t n = anneal_numel(dst);
    if (n == 0) return ANNEAL_OK;
    size_t esz = anneal_dtype_size(dst->dtype);
    uint64_t bits = fill_bits(dst->dtype, value);
    void *d = anneal_data(dst);
    if (anneal_is_contiguous(dst) && (bits == 0 || esz == 1))
        return anneal_cuda_check(cudaMemsetAsync(d, (int)(bits & 0xff), (size_t)n * esz, c->stream), "fill");
    view v;
    const int64_t *strides[1] = {dst->strides};
    collapse(dst->ndim, dst->shape, 1, strides, &v);
    unsigned g = grid_for(c, n);
    switch (esz) {
    case 1: fill_kernel<uint8_t><<<g, kThreads, 0, c->stream>>>(v, n, (uint8_t *)d, (uint8_t)bits); break;
    case 2: fill_kernel<uint16_t><<<g, kThreads, 0, c->stream>>>(v, n, (uint16_t *)d, (uint16_t)bits); break;
    case 4: fill_kernel<uint32_t><<<g, kThreads, 0, c->stream>>>(v, n, (uint32_t *)d, (uint32_t)bits); break;
    case 8: fill_kernel<unsigned long long><<<g, kThreads, 0, c->stream>>>(v, n, (unsigned long long *)d, (unsigned long long)bits); break;
    default: return anneal_set_error(ANNEAL_ERR_ARG, "cuda fill: element size %zu", esz);
    }
    return anneal_cuda_launch_check("fill");
}

/* --------------------------------------------------------------- binary */

HD float binary_apply(int op, float x, float y) {
    switch (op) {
    case ANNEAL_ADD: return rn_fadd(x, y);
    case ANNEAL_SUB: return rn_fsub(x, y);
    case ANNEAL_MUL: return rn_fmul(x, y);
    default: return rn_fdiv(x, y);
    }
}

/* out[i] = a[i] op b[i], all three contiguous (out may be a). */
static __global__ void binary_contig_kernel(int op, int64_t n, float *out, const float *a, const float *b) {
    GRID_STRIDE(i, n) out[i] = binary_apply(op, a[i], b[i]);
}

/* out[i] = a op b at row-major element i, a and b strided (0 where broadcast). */
static __global__ void binary_strided_kernel(int op, view av, view bv, int64_t n, float *out, const float *a,
                                      const float *b) {
    GRID_STRIDE(i, n) out[i] = binary_apply(op, a[view_offset(av, i)], b[view_offset(bv, i)]);
}

/* out = a op b in f32 (out contiguous; out may alias a). */
static anneal_status cuda_binary(void *ctx, anneal_binary_op op, anneal_tensor *out, const anneal_tensor *a,
                          const anneal_tensor *b) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (out->ndim > kMaxDims || a->ndim != out->ndim || b->ndim != out->ndim)
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda binary: operands of different ranks");
    if ((unsigned)op > (unsigned)ANNEAL_DIV) return anneal_set_error(ANNEAL_ERR_ARG, "cuda binary: unknown op %d", (int)op);
    int64_t n = anneal_numel(out);
    if (n == 0) return ANNEAL_OK;
    view v[2];
    const int64_t *strides[2] = {a->strides, b->strides};
    collapse(out->ndim, out->shape, 2, strides, v);
    float *o = (float *)anneal_data(out);
    const float *pa = (const float *)anneal_data(a), *pb = (const float *)anneal_data(b);
    if (view_unit(v[0]) && view_unit(v[1]))
        binary_contig_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>((int)op, n, o, pa, pb);
    else
        binary_strided_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>((int)op, v[0], v[1], n, o, pa, pb);
    return anneal_cuda_launch_check("binary");
}

/* ---------------------------------------------------------------- unary */

/* src/cpu/pointwise.c's constants. */
#define GELU_SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_KAPPA 0.044715f
#define GELU_SQRT1_2 0.7071067811865476f
#define GELU_INV_SQRT_2PI 0.3989422804014327f
#define GELU_Z_MAX 13.0f


/* src/cpu/vec_math.h's anneal_vexpf, operation for operation. */
HD float vexpf(float x) {
    float xk = x > -105.0f ? x : -105.0f; /* NaN -> -105, restored at the end */
    xk = xk < 89.0f ? xk : 89.0f;
    float nf = rn_fsub(rn_fadd(rn_fmul(xk, 1.44269504088896341f), 12582912.0f), 12582912.0f);
    int32_t n = (int32_t)nf;
    float r = rn_fsub(xk, rn_fmul(nf, 0.693359375f));
    r = rn_fsub(r, rn_fmul(nf, -2.12194440e-4f));
    float p = 1.9875691500e-4f;
    p = rn_fadd(rn_fmul(p, r), 1.3981999507e-3f);
    p = rn_fadd(rn_fmul(p, r), 8.3334519073e-3f);
    p = rn_fadd(rn_fmul(p, r), 4.1665795894e-2f);
    p = rn_fadd(rn_fmul(p, r), 1.6666665459e-1f);
    p = rn_fadd(rn_fmul(p, r), 5.0000001201e-1f);
    p = rn_fadd(rn_fadd(rn_fmul(p, rn_fmul(r, r)), r), 1.0f);
    int32_t h = n >> 1;
    float s1 = bits_f32((uint32_t)(h + 127) << 23);
    float s2 = bits_f32((uint32_t)(n - h + 127) << 23);
    float res = rn_fmul(rn_fmul(p, s1), s2);
    return x == x ? res : x;
}

/* pointwise.c's erfc_poly. */
HD float erfc_poly(float t) {
    float p = 0.17087277f;
    p = rn_fadd(rn_fmul(p, t), -0.82215223f);
    p = rn_fadd(rn_fmul(p, t), 1.48851587f);
    p = rn_fadd(rn_fmul(p, t), -1.13520398f);
    p = rn_fadd(rn_fmul(p, t), 0.27886807f);
    p = rn_fadd(rn_fmul(p, t), -0.18628806f);
    p = rn_fadd(rn_fmul(p, t), 0.09678418f);
    p = rn_fadd(rn_fmul(p, t), 0.37409196f);
    p = rn_fadd(rn_fmul(p, t), 1.00002368f);
    return rn_fadd(rn_fmul(p, t), -1.26551223f);
}

/* pointwise.c's gelu_cdf: Phi(x), with e^(-xh^2/2) and -xl*(x+xh)/2 for the density. */
HD float gelu_cdf(float x, float *e_hi, float *e_lo) {
    float ax = x < 0.0f ? -x : x;
    float cap = rn_fmul(GELU_Z_MAX, 1.41421356f);
    ax = ax < cap ? ax : cap; /* NaN -> cap */
    float xh = bits_f32((uint32_t)f32_bits(ax) & 0xFFFFF000u);
    float lo = rn_fmul(-0.5f, rn_fmul(rn_fsub(ax, xh), rn_fadd(ax, xh)));
    float z = rn_fmul(ax, GELU_SQRT1_2);
    float t = rn_fdiv(1.0f, rn_fadd(1.0f, rn_fmul(0.5f, z)));
    float eh = vexpf(rn_fmul(-0.5f, rn_fmul(xh, xh)));
    float half_erfc = rn_fmul(rn_fmul(rn_fmul(0.5f, t), eh), vexpf(rn_fadd(lo, erfc_poly(t))));
    *e_hi = eh;
    *e_lo = lo;
    return x < 0.0f ? half_erfc : rn_fsub(1.0f, half_erfc);
}

/* f(x; alpha) of one element, as the CPU's unary kernels compute it. */
HD float unary_apply(int op, float x, float alpha) {
    switch (op) {
    case ANNEAL_UNARY_SCALE: return rn_fmul(alpha, x);
    case ANNEAL_UNARY_ADD_SCALAR: return rn_fadd(x, alpha);
    case ANNEAL_UNARY_GELU_TANH: {
        float u = rn_fmul(GELU_SQRT_2_OVER_PI, rn_fadd(x, rn_fmul(GELU_KAPPA, rn_fmul(rn_fmul(x, x), x))));
        return rn_fdiv(x, rn_fadd(1.0f, vexpf(rn_fmul(-2.0f, u))));
    }
    case ANNEAL_UNARY_GELU_ERF: {
        float eh, lo;
        return rn_fmul(x, gelu_cdf(x, &eh, &lo));
    }
    default: /* SILU */
        return rn_fdiv(x, rn_fadd(1.0f, vexpf(-x)));
    }
}

/* dy * f'(x; alpha) of one element, as the CPU's backward kernels compute it. */
HD float unary_bwd_apply(int op, float x, float g, float alpha) {
    switch (op) {
    case ANNEAL_UNARY_SCALE: return rn_fmul(alpha, g);
    case ANNEAL_UNARY_ADD_SCALAR: return g;
    case ANNEAL_UNARY_GELU_TANH: {
        float x2 = rn_fmul(x, x);
        float u = rn_fmul(GELU_SQRT_2_OVER_PI, rn_fadd(x, rn_fmul(GELU_KAPPA, rn_fmul(x2, x))));
        float du = rn_fmul(GELU_SQRT_2_OVER_PI, rn_fadd(1.0f, rn_fmul(rn_fmul(3.0f, GELU_KAPPA), x2)));
        float e = vexpf(rn_fmul(-2.0f, u));
        float s = rn_fdiv(1.0f, rn_fadd(1.0f, e));
        float oms = e < bits_f32((uint32_t)0x7f800000) ? rn_fmul(e, s) : 1.0f;
        return rn_fmul(g, rn_fadd(s, rn_fmul(rn_fmul(rn_fmul(rn_fmul(2.0f, x), s), oms), du)));
    }
    case ANNEAL_UNARY_GELU_ERF: {
        float eh, lo;
        float cdf = gelu_cdf(x, &eh, &lo);
        float pdf = rn_fmul(rn_fmul(eh, vexpf(lo)), GELU_INV_SQRT_2PI);
        return rn_fmul(g, rn_fadd(cdf, rn_fmul(x, pdf)));
    }
    default: { /* SILU */
        float s = rn_fdiv(1.0f, rn_fadd(1.0f, vexpf(-x)));
        return rn_fmul(g, rn_fmul(s, rn_fadd(1.0f, rn_fmul(x, rn_fsub(1.0f, s)))));
    }
    }
}

/* out[i] = f(x[i]) (out may be x). */
static __global__ void unary_kernel(int op, int64_t n, float *out, const float *x, float alpha) {
    GRID_STRIDE(i, n) out[i] = unary_apply(op, x[i], alpha);
}

/* dx[i] = dy[i] * f'(x[i]); x is not read (may be NULL) for SCALE and ADD_SCALAR. */
static __global__ void unary_bwd_kernel(int op, int64_t n, float *dx, const float *x, const float *dy, float alpha) {
    bool need_x = op != ANNEAL_UNARY_SCALE && op != ANNEAL_UNARY_ADD_SCALAR;
    GRID_STRIDE(i, n) dx[i] = unary_bwd_apply(op, need_x ? x[i] : 0.0f, dy[i], alpha);
}

static bool unary_op_known(anneal_unary_op op) { return (unsigned)op <= (unsigned)ANNEAL_UNARY_SILU; }

/* out = f(x; alpha), contiguous f32. */
static anneal_status cuda_unary(void *ctx, anneal_unary_op op, anneal_tensor *out, const anneal_tensor *x, float alpha) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (!unary_op_known(op)) return anneal_set_error(ANNEAL_ERR_ARG, "cuda unary: unknown op %d", (int)op);
    int64_t n = anneal_numel(out);
    if (n == 0) return ANNEAL_OK;
    unary_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>((int)op, n, (float *)anneal_data(out),
                                                             (const float *)anneal_data(x), alpha);
    return anneal_cuda_launch_check("unary");
}

/* dx = dy * f'(x; alpha), contiguous f32. */
static anneal_status cuda_unary_bwd(void *ctx, anneal_unary_op op, anneal_tensor *dx, const anneal_tensor *x,
                             const anneal_tensor *dy, float alpha) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (!unary_op_known(op)) return anneal_set_error(ANNEAL_ERR_ARG, "cuda unary_bwd: unknown op %d", (int)op);
    bool need_x = op != ANNEAL_UNARY_SCALE && op != ANNEAL_UNARY_ADD_SCALAR;
    if (need_x && !x) return anneal_set_error(ANNEAL_ERR_ARG, "cuda unary_bwd: x is NULL");
    int64_t n = anneal_numel(dx);
    if (n == 0) return ANNEAL_OK;
    unary_bwd_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>(
        (int)op, n, (float *)anneal_data(dx), x ? (const float *)anneal_data(x) : nullptr,
        (const float *)anneal_data(dy), alpha);
    return anneal_cuda_launch_check("unary_bwd");
}

/* x *= c, c = (float)(s * f) formed on the device as the CPU forms it on the host
 * (f = factor, or factor / n for a non-zero count n); every thread returns at once
 * when c == 1. */
HD float scale_by_factor(const float *s, const long long *count, double factor) {
    double sv = s ? (double)*s : 1.0;
    long long cn = count ? *count : 0;
    double f = cn ? rn_ddiv(factor, rn_ll2d(cn)) : factor;
    return rn_d2f(rn_dmul(sv, f));
}

static __global__ void scale_by_kernel(int64_t n, float *x, const float *s, const long long *count, double factor) {
    float c = scale_by_factor(s, count, factor);
    if (c == 1.0f) return;
    GRID_STRIDE(i, n) x[i] = rn_fmul(c, x[i]);
}

/* x *= (float)(s * f) without reading s or count on the host. */
static anneal_status cuda_scale_by(void *ctx, anneal_tensor *x, const anneal_tensor *s, const anneal_tensor *count,
                            double factor) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (s && s->dtype != ANNEAL_F32) return anneal_set_error(ANNEAL_ERR_ARG, "cuda scale_by: s is not f32");
    if (count && count->dtype != ANNEAL_I64) return anneal_set_error(ANNEAL_ERR_ARG, "cuda scale_by: count is not i64");
    int64_t n = anneal_numel(x);
    if (n == 0) return ANNEAL_OK;
    scale_by_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>(
        n, (float *)anneal_data(x), s ? (const float *)anneal_data(s) : nullptr,
        count ? (const long long *)anneal_data(count) : nullptr, factor);
    return anneal_cuda_launch_check("scale_by");
}

/* ----------------------------------------------------------- reductions */

/* The sum of every thread's v in the block (kThreads threads, all calling), by a fixed
 * pairwise tree in double. */
static __device__ double block_sum(double v) {
    __shared__ double sh[kThreads];
    sh[threadIdx.x] = v;
    __syncthreads();
#pragma unroll
    for (int w = kThreads / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] = rn_dadd(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

/* reduce_sum pass 1: item t is (output o, run s); it sums in order, in double, the
 * reduced elements s, s + S, s + 2S, ... of output o. With S == 1 that is the whole sum,
 * written to out[o] as f32; else it goes to part[s * n_out + o]. s_fast numbers the
 * items run-major (t = o * S + s) so that a warp reads consecutive elements when the
 * reduced dim is the contiguous one, else output-major (t = s * n_out + o). */
HD void reduce_pass1_item(const view &kv, const view &rv, int64_t n_out, int64_t n_red, int64_t S, bool s_fast,
                          const float *x, double *part, float *out, int64_t t) {
    int64_t o = s_fast ? t / S : t % n_out;
    int64_t s = s_fast ? t % S : t / n_out;
    const float *base = x + view_offset(kv, o);
    double acc = 0.0;
    for (int64_t r = s; r < n_red; r += S) acc = rn_dadd(acc, (double)base[view_offset(rv, r)]);
    if (S == 1) out[o] = rn_d2f(acc);
    else part[s * n_out + o] = acc;
}

static __global__ void reduce_pass1_kernel(view kv, view rv, int64_t n_out, int64_t n_red, int64_t S, bool s_fast,
                                    const float *x, double *part, float *out) {
    GRID_STRIDE(t, n_out * S) reduce_pass1_item(kv, rv, n_out, n_red, S, s_fast, x, part, out, t);
}

/* reduce_sum pass 2, few runs: one thread per output adds its S partials in order. */
static __global__ void reduce_pass2_seq_kernel(int64_t n_out, int64_t S, const double *part, float *out) {
    GRID_STRIDE(o, n_out) {
        double acc = 0.0;
        for (int64_t s = 0; s < S; s++) acc = rn_dadd(acc, part[s * n_out + o]);
        out[o] = rn_d2f(acc);
    }
}

/* reduce_sum pass 2, many runs: one block per output; thread j adds partials j, j +
 * kThreads, ... in order, then block_sum. */
static __global__ void reduce_pass2_block_kernel(int64_t n_out, int64_t S, const double *part, float *out) {
    for (int64_t o = blockIdx.x; o < n_out; o += gridDim.x) {
        double acc = 0.0;
        for (int64_t s = threadIdx.x; s < S; s += kThreads) acc = rn_dadd(acc, part[s * n_out + o]);
        double total = block_sum(acc);
        if (threadIdx.x == 0) out[o] = rn_d2f(total);
    }
}

/* How reduce_sum splits its work: x seen as kept dims (kv, n_out outputs) times reduced
 * dims (rv, n_red each); S runs per output (1: no second pass); s_fast as in
 * reduce_pass1_item. Depends on the shapes and strides only. */
namespace {
struct reduce_plan {
    view kv, rv;
    int64_t n_out, n_red, S;
    bool s_fast;
};
} // namespace

static void reduce_plan_make(const anneal_tensor *out, const anneal_tensor *x, reduce_plan *p) {
    int64_t kshape[kMaxDims], kstride[kMaxDims], rshape[kMaxDims], rstride[kMaxDims];
    int nk = 0, nr = 0;
    for (int d = 0; d < x->ndim; d++) {
        if (out->shape[d] == 1 && x->shape[d] != 1) {
            rshape[nr] = x->shape[d];
            rstride[nr++] = x->strides[d];
        } else {
            kshape[nk] = x->shape[d];
            kstride[nk++] = x->strides[d];
        }
    }
    const int64_t *ks[1] = {kstride}, *rs[1] = {rstride};
    p->n_out = collapse(nk, kshape, 1, ks, &p->kv);
    p->n_red = collapse(nr, rshape, 1, rs, &p->rv);
    p->S = 1;
    if (p->n_red > 1 && p->n_out > 0) {
        p->S = ceil_div(kReduceThreads, p->n_out);
        int64_t cap = ceil_div(p->n_red, kReduceMinRun);
        if (p->S > cap) p->S = cap;
        if (p->S < 1) p->S = 1;
    }
    p->s_fast = p->n_red > 1 && p->rv.strides[p->rv.ndim - 1] == 1;
}

/* out = the sum of x over the dims where out has size 1 and x does not. Two passes when
 * the reduced elements are many (partials in ANNEAL_CUDA_SCRATCH_REDUCE): a bias
 * gradient (65536, C) -> (1, C) is C * ~340 runs of ~190 rows, then C sums of ~340. The
 * tree depends on the shapes only. */
static anneal_status cuda_reduce_sum(void *ctx, anneal_tensor *out, const anneal_tensor *x) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (x->ndim > kMaxDims || out->ndim != x->ndim)
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda reduce_sum: out has %d dims, x %d", out->ndim, x->ndim);
    if (anneal_numel(out) == 0) return ANNEAL_OK;
    reduce_plan p;
    reduce_plan_make(out, x, &p);
    const view &kv = p.kv, &rv = p.rv;
    const int64_t n_out = p.n_out, n_red = p.n_red, S = p.S;
    const bool s_fast = p.s_fast;
    float *o = (float *)anneal_data(out);
    const float *px = (const float *)anneal_data(x);
    double *part = nullptr;
    if (S > 1) {
        part = (double *)anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_REDUCE, (size_t)(n_out * S) * sizeof(double));
        if (!part) return anneal_last_status();
    }
    reduce_pass1_kernel<<<grid_for(c, n_out * S), kThreads, 0, c->stream>>>(kv, rv, n_out, n_red, S, s_fast, px,
                                                                            part, o);
    st = anneal_cuda_launch_check("reduce_sum");
    if (st != ANNEAL_OK || S == 1) return st;
    if (S <= 32) {
        reduce_pass2_seq_kernel<<<grid_for(c, n_out), kThreads, 0, c->stream>>>(n_out, S, part, o);
    } else {
        int64_t cap = (int64_t)(c->prop.multiProcessorCount > 0 ? c->prop.multiProcessorCount : 132) * 16;
        unsigned g = (unsigned)(n_out < cap ? n_out : cap);
        reduce_pass2_block_kernel<<<g, kThreads, 0, c->stream>>>(n_out, S, part, o);
    }
    return anneal_cuda_launch_check("reduce_sum");
}

/* sum_squares pass 1: block b's thread j adds x[i]^2 in double for i = b * kThreads + j
 * + k * gridDim.x * kThreads in order; block_sum; dst[b] = the block's sum. */
static __global__ void sumsq_pass1_kernel(int64_t n, const float *x, double *dst) {
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)x[i];
        acc = rn_dadd(acc, rn_dmul(v, v));
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) dst[blockIdx.x] = total;
}

/* sum_squares pass 2: one block adds the g partials (thread j: j, j + kThreads, ...),
 * then block_sum into *dst. */
static __global__ void sumsq_pass2_kernel(int64_t g, const double *part, double *dst) {
    double acc = 0.0;
    for (int64_t s = threadIdx.x; s < g; s += kThreads) acc = rn_dadd(acc, part[s]);
    double total = block_sum(acc);
    if (threadIdx.x == 0) *dst = total;
}

/* out[index] = the sum of squares of x (contiguous f32) in double; the block count, and
 * so the tree, depends on numel only. */
static anneal_status cuda_sum_squares(void *ctx, anneal_tensor *out, int64_t index, const anneal_tensor *x) {
    anneal_cuda_ctx *c = (anneal_cuda_ctx *)ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    if (out->dtype != ANNEAL_F64 || index < 0 || index >= anneal_numel(out))
        return anneal_set_error(ANNEAL_ERR_ARG, "cuda sum_squares: element %lld of an f64 output of %lld",
                                (long long)index, (long long)anneal_numel(out));
    int64_t n = anneal_numel(x);
    double *dst = (double *)anneal_data(out) + index;
    int64_t g = ceil_div(n, kThreads * kSumSqPerThread);
    if (g > kSumSqMaxBlocks) g = kSumSqMaxBlocks;
    if (g < 1) g = 1;
    const float *px = (const float *)anneal_data(x);
    if (g == 1) {
        sumsq_pass1_kernel<<<1, kThreads, 0, c->stream>>>(n, px, dst);
        return anneal_cuda_launch_check("sum_squares");
    }
    double *part = (double *)anneal_cuda_scratch(c, ANNEAL_CUDA_SCRATCH_REDUCE, (size_t)g * sizeof(double));
    if (!part) return anneal_last_status();
    sumsq_pass1_kernel<<<(unsigned)g, kThreads, 0, c->stream>>>(n, px, part);
    st = anneal_cuda_launch_check("sum_squares");
    if (st != ANNEAL_OK) return st;
    sumsq_pass2_kernel<<<1, kThreads, 0, c->stream>>>(g, part, dst);
    return anneal_cuda_launch_check("sum_squares");
}

/* Fills the elementwise slots: copy, fill, binary, unary, unary_bwd, scale_by,
 * reduce_sum, sum_squares. */
extern "C" void anneal_cuda_table_elementwise(anneal_backend *b) {
    b->copy = cuda_copy;
    b->fill = cuda_fill;
    b->binary = cuda_binary;
    b->unary = cuda_unary;
    b->unary_bwd = cuda_unary_bwd;
    b->scale_by = cuda_scale_by;
    b->reduce_sum = cuda_reduce_sum;
    b->sum_squares = cuda_sum_squares;
}

/* COPY and FILL: every dtype (any strides, converting copies). BINARY, UNARY (and its
 * backward), REDUCE_SUM, SUM_SQUARES (x f32, out f64) and SCALE_BY: f32 storage only,
 * like the CPU. */
extern "C" bool anneal_cuda_supports_elementwise(const anneal_op_query *q) {
    switch (q->kind) {
    case ANNEAL_OP_COPY:
    case ANNEAL_OP_FILL: return (unsigned)q->dtype < (unsigned)ANNEAL_DTYPE_COUNT;
    case ANNEAL_OP_BINARY:
    case ANNEAL_OP_UNARY:
    case ANNEAL_OP_REDUCE_SUM:
    case ANNEAL_OP_SUM_SQUARES:
    case ANNEAL_OP_SCALE_BY: return q->dtype == ANNEAL_F32;
    default: return false;
    }
}
