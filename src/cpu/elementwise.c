/* CPU elementwise kernels on strided tensors: copy with dtype conversion, fill,
 * broadcasting binary arithmetic, scalar unary ops and reductions. */
#include "cpu_backend.h"
#include "cpu_kernels.h"
#include "strided.h"
#include "vec_math.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Rows per OpenMP task are coarse enough that tiny tensors stay single-threaded. */
#define PAR_MIN_ELEMS 32768

static double load_as_double(const void *base, anneal_dtype dt, int64_t i) {
    switch (dt) {
    case ANNEAL_F32: return ((const float *)base)[i];
    case ANNEAL_BF16: return anneal_bf16_to_f32(((const uint16_t *)base)[i]);
    case ANNEAL_F16: return anneal_f16_to_f32(((const uint16_t *)base)[i]);
    case ANNEAL_I32: return ((const int32_t *)base)[i];
    case ANNEAL_I64: return (double)((const int64_t *)base)[i];
    case ANNEAL_U16: return ((const uint16_t *)base)[i];
    case ANNEAL_U8: return ((const uint8_t *)base)[i];
    case ANNEAL_I8: return ((const int8_t *)base)[i];
    case ANNEAL_F64: return ((const double *)base)[i];
    default: return 0;
    }
}

static void store_double(void *base, anneal_dtype dt, int64_t i, double v) {
    switch (dt) {
    case ANNEAL_F32: ((float *)base)[i] = (float)v; break;
    case ANNEAL_BF16: ((uint16_t *)base)[i] = anneal_f32_to_bf16((float)v); break;
    case ANNEAL_F16: ((uint16_t *)base)[i] = anneal_f32_to_f16((float)v); break;
    /* integer targets truncate toward zero like a C cast */
    case ANNEAL_I32: ((int32_t *)base)[i] = (int32_t)v; break;
    case ANNEAL_I64: ((int64_t *)base)[i] = (int64_t)v; break;
    case ANNEAL_U16: ((uint16_t *)base)[i] = (uint16_t)v; break;
    case ANNEAL_U8: ((uint8_t *)base)[i] = (uint8_t)v; break;
    case ANNEAL_I8: ((int8_t *)base)[i] = (int8_t)v; break;
    case ANNEAL_F64: ((double *)base)[i] = v; break;
    default: break;
    }
}

static bool is_int(anneal_dtype dt) { return !anneal_dtype_is_float(dt) && dt != ANNEAL_F64; }

static int64_t load_as_i64(const void *base, anneal_dtype dt, int64_t i) {
    if (dt == ANNEAL_I64) return ((const int64_t *)base)[i];
    return (int64_t)load_as_double(base, dt, i);
}

static void store_i64(void *base, anneal_dtype dt, int64_t i, int64_t v) {
    if (dt == ANNEAL_I64) ((int64_t *)base)[i] = v;
    else store_double(base, dt, i, (double)v);
}

/* o[k] = bf16(x[k]) for n floats, the bits of anneal_f32_to_bf16 (branch-free; cloned
 * for AVX-512 and AVX2: the baseline build's SSE2 loop ran saved activations' roundings
 * at about 11 GB/s on a Xeon). */
ANNEAL_VEC_CLONES
static void bf16_from_f32_row(int64_t n, uint16_t *restrict o, const float *restrict x) {
    for (int64_t k = 0; k < n; k++) {
        uint32_t u;
        memcpy(&u, &x[k], 4);
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, q = (u >> 16) | 0x40u;
        o[k] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? q : r);
    }
}

/* o[k] = x[k] widened from bf16 to f32 (exact), n values. */
ANNEAL_VEC_CLONES
static void f32_from_bf16_row(int64_t n, uint32_t *restrict o, const uint16_t *restrict x) {
    for (int64_t k = 0; k < n; k++) o[k] = (uint32_t)x[k] << 16;
}

anneal_status anneal_cpu_copy(anneal_tensor *dst, const anneal_tensor *src) {
    int64_t n = anneal_numel(dst);
    if (n == 0) return ANNEAL_OK;
    size_t esz = anneal_dtype_size(dst->dtype);
    if (dst->dtype == src->dtype && anneal_is_contiguous(dst) && anneal_is_contiguous(src)) {
        /* Large copies between disjoint buffers (a gradient landing in a parameter's .grad:
         * the whole model per step) in pieces on all threads; else one memmove. */
        char *d = anneal_data(dst);
        const char *s = anneal_data(src);
        const size_t bytes = (size_t)n * esz, piece = (size_t)1 << 18;
        if (bytes >= 8 * piece && (d + bytes <= s || s + bytes <= d) && !omp_in_parallel()) {
            const int64_t np = (int64_t)((bytes + piece - 1) / piece);
#pragma omp parallel for schedule(static)
            for (int64_t p = 0; p < np; p++) {
                const size_t o = (size_t)p * piece;
                memcpy(d + o, s + o, bytes - o < piece ? bytes - o : piece);
            }
        } else {
            memmove(d, s, bytes);
        }
        return ANNEAL_OK;
    }
    const int64_t *st[2] = {dst->strides, src->strides};
    anneal_strided_iter it;
    anneal_strided_init(&it, dst->ndim, dst->shape, 2, st);
    char *d = anneal_data(dst);
    const char *s = anneal_data(src);
    anneal_dtype dd = dst->dtype, sd = src->dtype;
    bool ints = is_int(dd) && is_int(sd);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
    for (int64_t w = 0; w < anneal_strided_items(&it); w++) {
        int64_t off[2];
        const int64_t len = anneal_strided_item(&it, w, off);
        int64_t sd_ = it.strides[0][it.ndim - 1], ss = it.strides[1][it.ndim - 1];
        if (dd == ANNEAL_F32 && sd == ANNEAL_F32) {
            float *o = (float *)d + off[0];
            const float *i = (const float *)s + off[1];
            for (int64_t k = 0; k < len; k++) o[k * sd_] = i[k * ss];
        } else if (dd == ANNEAL_BF16 && sd == ANNEAL_F32 && sd_ == 1 && ss == 1) {
            /* nearest even, NaN kept quiet: anneal_f32_to_bf16 in a loop that vectorises */
            bf16_from_f32_row(len, (uint16_t *)d + off[0], (const float *)s + off[1]);
        } else if (dd == ANNEAL_F32 && sd == ANNEAL_BF16 && sd_ == 1 && ss == 1) {
            f32_from_bf16_row(len, (uint32_t *)d + off[0], (const uint16_t *)s + off[1]);
        } else if (dd == sd) {
            for (int64_t k = 0; k < len; k++)
                memcpy(d + (off[0] + k * sd_) * (int64_t)esz, s + (off[1] + k * ss) * (int64_t)esz, esz);
        } else if (ints) {
            for (int64_t k = 0; k < len; k++)
                store_i64(d, dd, off[0] + k * sd_, load_as_i64(s, sd, off[1] + k * ss));
        } else {
            for (int64_t k = 0; k < len; k++)
                store_double(d, dd, off[0] + k * sd_, load_as_double(s, sd, off[1] + k * ss));
        }
    }
    return ANNEAL_OK;
}

anneal_status anneal_cpu_fill(anneal_tensor *dst, double value) {
    int64_t n = anneal_numel(dst);
    if (n == 0) return ANNEAL_OK;
    const int64_t *st[1] = {dst->strides};
    anneal_strided_iter it;
    anneal_strided_init(&it, dst->ndim, dst->shape, 1, st);
    char *d = anneal_data(dst);
    anneal_dtype dt = dst->dtype;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
    for (int64_t w = 0; w < anneal_strided_items(&it); w++) {
        int64_t off[1];
        const int64_t len = anneal_strided_item(&it, w, off);
        int64_t s = it.strides[0][it.ndim - 1];
        if (dt == ANNEAL_F32) {
            float *o = (float *)d + off[0];
            for (int64_t k = 0; k < len; k++) o[k * s] = (float)value;
        } else {
            for (int64_t k = 0; k < len; k++) store_double(d, dt, off[0] + k * s, value);
        }
    }
    return ANNEAL_OK;
}

/* One inner row of a binary op; the stride patterns of real models (both unit,
 * one broadcast) get their own loops so they vectorise. */
static void binary_row(anneal_binary_op op, float *restrict o, const float *a, int64_t sa,
                       const float *b, int64_t sb, int64_t n) {
#define LOOP(EXPR)                                                                         \
    if (sa == 1 && sb == 1) { for (int64_t k = 0; k < n; k++) { float x = a[k], y = b[k]; o[k] = EXPR; } } \
    else if (sa == 1 && sb == 0) { float y = b[0]; for (int64_t k = 0; k < n; k++) { float x = a[k]; o[k] = EXPR; } } \
    else if (sa == 0 && sb == 1) { float x = a[0]; for (int64_t k = 0; k < n; k++) { float y = b[k]; o[k] = EXPR; } } \
    else { for (int64_t k = 0; k < n; k++) { float x = a[k * sa], y = b[k * sb]; o[k] = EXPR; } }
    switch (op) {
    case ANNEAL_ADD: LOOP(x + y); break;
    case ANNEAL_SUB: LOOP(x - y); break;
    case ANNEAL_MUL: LOOP(x * y); break;
    case ANNEAL_DIV: LOOP(x / y); break;
    }
#undef LOOP
}

anneal_status anneal_cpu_binary(anneal_binary_op op, anneal_tensor *out, const anneal_tensor *a,
                                const anneal_tensor *b) {
    int64_t n = anneal_numel(out);
    if (n == 0) return ANNEAL_OK;
    const int64_t *st[3] = {out->strides, a->strides, b->strides};
    anneal_strided_iter it;
    anneal_strided_init(&it, out->ndim, out->shape, 3, st);
    float *o = anneal_data(out);
    const float *pa = anneal_data(a), *pb = anneal_data(b);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
    for (int64_t w = 0; w < anneal_strided_items(&it); w++) {
        int64_t off[3];
        const int64_t len = anneal_strided_item(&it, w, off);
        /* out is contiguous, so its inner stride is 1 */
        binary_row(op, o + off[0], pa + off[1], it.strides[1][it.ndim - 1], pb + off[2],
                   it.strides[2][it.ndim - 1], len);
    }
    return ANNEAL_OK;
}

anneal_status anneal_cpu_unary(anneal_unary_op op, anneal_tensor *out, const anneal_tensor *x,
                               float alpha) {
    int64_t n = anneal_numel(out);
    float *o = anneal_data(out); /* may alias x: elementwise, same index */
    const float *in = anneal_data(x);
    switch (op) {
    case ANNEAL_UNARY_SCALE:
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
        for (int64_t i = 0; i < n; i++) o[i] = alpha * in[i];
        break;
    case ANNEAL_UNARY_ADD_SCALAR:
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
        for (int64_t i = 0; i < n; i++) o[i] = in[i] + alpha;
        break;
    case ANNEAL_UNARY_GELU_TANH: anneal_cpu_gelu_fwd(n, in, o, true); break;
    case ANNEAL_UNARY_GELU_ERF: anneal_cpu_gelu_fwd(n, in, o, false); break;
    case ANNEAL_UNARY_SILU: anneal_cpu_silu_fwd(n, in, o); break;
    }
    return ANNEAL_OK;
}

anneal_status anneal_cpu_unary_bwd(anneal_unary_op op, anneal_tensor *dx, const anneal_tensor *x,
                                   const anneal_tensor *dy, float alpha) {
    int64_t n = anneal_numel(dx);
    float *restrict o = anneal_data(dx);
    const float *restrict g = anneal_data(dy);
    const float *in = x ? anneal_data(x) : NULL;
    switch (op) {
    case ANNEAL_UNARY_SCALE:
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
        for (int64_t i = 0; i < n; i++) o[i] = alpha * g[i];
        break;
    case ANNEAL_UNARY_ADD_SCALAR: memmove(o, g, (size_t)n * sizeof(float)); break;
    case ANNEAL_UNARY_GELU_TANH: anneal_cpu_gelu_bwd(n, in, g, o, true); break;
    case ANNEAL_UNARY_GELU_ERF: anneal_cpu_gelu_bwd(n, in, g, o, false); break;
    case ANNEAL_UNARY_SILU: anneal_cpu_silu_bwd(n, in, g, o); break;
    }
    return ANNEAL_OK;
}

/* Sum of all elements of a strided f32 tensor: fixed 4096-element chunks summed in
 * double, partials combined in order, so the result does not depend on threads. */
static double sum_all(const anneal_tensor *x) {
    int64_t n = anneal_numel(x);
    const int64_t *st[1] = {x->strides};
    anneal_strided_iter it;
    anneal_strided_init(&it, x->ndim, x->shape, 1, st);
    const float *p = anneal_data(x);
    int64_t total = it.rows * it.inner;
    if (total == 0) return 0.0;
    const int64_t chunk = 4096;
    int64_t n_chunks = (total + chunk - 1) / chunk;
    double partial_small[64];
    double *partials = n_chunks <= 64 ? partial_small : malloc((size_t)n_chunks * sizeof(double));
    if (!partials) { /* fall back to one sequential pass: same chunk order */
        partials = partial_small;
        n_chunks = 0;
        double acc = 0;
        for (int64_t r = 0; r < it.rows; r++) {
            int64_t off[1];
            anneal_strided_row(&it, r, off);
            for (int64_t k = 0; k < it.inner; k++) acc += p[off[0] + k * it.strides[0][it.ndim - 1]];
        }
        return acc;
    }
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
    for (int64_t c = 0; c < n_chunks; c++) {
        double acc = 0;
        int64_t lo = c * chunk, hi = lo + chunk < total ? lo + chunk : total;
        int64_t inner_stride = it.strides[0][it.ndim - 1];
        for (int64_t e = lo; e < hi;) {
            int64_t r = e / it.inner, k = e % it.inner, off[1];
            anneal_strided_row(&it, r, off);
            int64_t stop = it.inner - k < hi - e ? it.inner - k : hi - e;
            const float *row = p + off[0] + k * inner_stride;
            for (int64_t j = 0; j < stop; j++) acc += row[j * inner_stride];
            e += stop;
        }
        partials[c] = acc;
    }
    double s = 0;
    for (int64_t c = 0; c < n_chunks; c++) s += partials[c];
    if (partials != partial_small) free(partials);
    return s;
}

/* When x is contiguous and the reduced dims are exactly its leading ones (bias
 * gradients: (B, T, C) -> C; position-embedding gradients: (B, T, C) -> (T, C)), writes
 * *rows and *cols of the (rows, cols) matrix whose columns are summed and returns true. */
static bool leading_reduction(const anneal_tensor *out, const anneal_tensor *x, int64_t *rows, int64_t *cols) {
    int64_t expect = 1;
    for (int d = x->ndim - 1; d >= 0; d--) {
        if (x->shape[d] != 1 && x->strides[d] != expect) return false;
        expect *= x->shape[d];
    }
    int d = 0;
    *rows = 1;
    while (d < x->ndim && (out->shape[d] == 1 || x->shape[d] == 1)) *rows *= x->shape[d++];
    *cols = 1;
    for (; d < x->ndim; d++) {
        if (out->shape[d] != x->shape[d]) return false;
        *cols *= x->shape[d];
    }
    return true;
}

/* Column sums of a contiguous (rows, cols) matrix: the same arithmetic as the general
 * path below (one double accumulator per output, rows added in order), so the same bits,
 * but streaming rows through a block of accumulators instead of walking each column
 * with a stride. Threads take disjoint column blocks. */
static void column_sums(int64_t rows, int64_t cols, const float *p, float *o) {
    enum { BLOCK = 256 };
    int64_t n_blocks = (cols + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (rows * cols >= PAR_MIN_ELEMS)
    for (int64_t b = 0; b < n_blocks; b++) {
        int64_t c0 = b * BLOCK, w = cols - c0 < BLOCK ? cols - c0 : BLOCK;
        double acc[BLOCK];
        for (int64_t j = 0; j < w; j++) acc[j] = 0;
        for (int64_t r = 0; r < rows; r++) {
            const float *row = p + r * cols + c0;
            for (int64_t j = 0; j < w; j++) acc[j] += row[j];
        }
        for (int64_t j = 0; j < w; j++) o[c0 + j] = (float)acc[j];
    }
}

anneal_status anneal_cpu_reduce_sum(anneal_tensor *out, const anneal_tensor *x) {
    int64_t n_out = anneal_numel(out);
    float *o = anneal_data(out);
    if (n_out == 1) {
        o[0] = (float)sum_all(x);
        return ANNEAL_OK;
    }
    int64_t rows, cols;
    if (leading_reduction(out, x, &rows, &cols) && cols == n_out) {
        column_sums(rows, cols, anneal_data(x), o);
        return ANNEAL_OK;
    }
    /* Kept dims index the output; reduced dims are walked in order for each output. */
    int kept[ANNEAL_MAX_DIMS], red[ANNEAL_MAX_DIMS], nk = 0, nr = 0;
    for (int d = 0; d < x->ndim; d++) {
        if (out->shape[d] == 1 && x->shape[d] != 1) red[nr++] = d;
        else kept[nk++] = d;
    }
    int64_t n_red = 1;
    for (int i = 0; i < nr; i++) n_red *= x->shape[red[i]];
    const float *p = anneal_data(x);
    int64_t work = n_out * n_red;
#pragma omp parallel for schedule(static) if (work >= PAR_MIN_ELEMS)
    for (int64_t oi = 0; oi < n_out; oi++) {
        int64_t base = 0, rem = oi;
        for (int i = nk - 1; i >= 0; i--) {
            int d = kept[i];
            base += (rem % x->shape[d]) * x->strides[d];
            rem /= x->shape[d];
        }
        double acc = 0;
        for (int64_t ri = 0; ri < n_red; ri++) {
            int64_t off = base, r = ri;
            for (int i = nr - 1; i >= 0; i--) {
                int d = red[i];
                off += (r % x->shape[d]) * x->strides[d];
                r /= x->shape[d];
            }
            acc += p[off];
        }
        o[oi] = (float)acc;
    }
    return ANNEAL_OK;
}

anneal_status anneal_cpu_dropout_fwd(anneal_tensor *y, anneal_tensor *mask, const anneal_tensor *x,
                                     float p, uint64_t seed, uint64_t offset) {
    int64_t n = anneal_numel(x);
    const float *in = anneal_data(x);
    float *out = anneal_data(y);
    uint8_t *m = anneal_data(mask);
    float keep_scale = 1.0f / (1.0f - p);
    /* threshold on 24-bit uniforms: keep when u >= p */
    int64_t n_blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        uint32_t r[4];
        anneal_philox4x32(seed, 0, offset / 4 + (uint64_t)blk, r);
        for (int j = 0; j < 4; j++) {
            int64_t i = blk * 4 + j;
            if (i >= n) break;
            uint8_t keep = anneal_uniform_from_u32(r[j]) >= p;
            m[i] = keep;
            out[i] = keep ? in[i] * keep_scale : 0.0f;
        }
    }
    return ANNEAL_OK;
}

anneal_status anneal_cpu_dropout_bwd(anneal_tensor *dx, const anneal_tensor *mask,
                                     const anneal_tensor *dy, float p) {
    int64_t n = anneal_numel(dx);
    const uint8_t *m = anneal_data(mask);
    const float *g = anneal_data(dy);
    float *o = anneal_data(dx);
    float keep_scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) o[i] = m[i] ? g[i] * keep_scale : 0.0f;
    return ANNEAL_OK;
}

anneal_status anneal_cpu_randn(anneal_tensor *x, float mean, float std, uint64_t seed,
                               uint64_t offset) {
    int64_t n = anneal_numel(x);
    float *o = anneal_data(x);
    /* Each Philox block of 4 words gives 2 normals (Box-Muller). */
    int64_t n_blocks = (n + 1) / 2;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS)
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        uint32_t r[4];
        anneal_philox4x32(seed, 1, offset / 4 + (uint64_t)blk, r);
        double u1 = ((double)(r[0] >> 8) + 1.0) / 16777216.0; /* (0, 1] */
        double u2 = (double)(r[1] >> 8) / 16777216.0;
        double rad = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
        o[2 * blk] = (float)(mean + std * rad * cos(th));
        if (2 * blk + 1 < n) o[2 * blk + 1] = (float)(mean + std * rad * sin(th));
    }
    return ANNEAL_OK;
}
