/* Pointwise activations: GELU (exact erf form and PyTorch's tanh approximation)
 * and SiLU, forward and backward, over flat float arrays. Each kernel splits the
 * array into fixed blocks for OpenMP; the per-block loops are branch-free and use
 * anneal_vexpf so gcc vectorises them (one clone per ISA). Outputs may equal inputs
 * (in place), but must not partially overlap them. */
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#define PW_BLOCK 8192        /* elements per OpenMP work item */
#define PW_PARALLEL_MIN 32768 /* below this, threads cost more than they save */

#define GELU_SQRT_2_OVER_PI 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_KAPPA 0.044715f
#define GELU_SQRT1_2 0.7071067811865476f        /* 1/sqrt(2) */
#define GELU_INV_SQRT_2PI 0.3989422804014327f   /* 1/sqrt(2*pi) */
#define GELU_Z_MAX 13.0f /* cap on |x|/sqrt2: erfc(13) ~ 1e-75 is 0 in float */

/* ------------------------------------------------------------ exact GELU */

/* The Numerical Recipes erfc fit: erfc(z) = t*exp(-z^2 + P(t)), t = 1/(1 + z/2),
 * fractional error < 1.2e-7 for every z >= 0. Returns P(t). */
ANNEAL_INLINE float erfc_poly(float t) {
    float p = 0.17087277f;
    p = p * t + -0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t + -1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t + -0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    return p * t + -1.26551223f;
}

/* Pieces of Phi(x) = 0.5*(1 + erf(x/sqrt2)), the standard normal CDF, for
 * z = |x|/sqrt2 (capped at 13). e^(-z^2) = e^(-x^2/2) is formed from x itself, not
 * from the rounded z: x = xh + xl with xh keeping 12 mantissa bits, so xh*xh is
 * exact and e^(-x^2/2) = e^(-xh^2/2) * e^(-xl*(x+xh)/2) carries no rounding error in
 * its large exponent; that keeps Phi's relative accuracy in the left tail.
 * Writes e^(-xh^2/2) and -xl*(x+xh)/2 (the density needs both) and returns Phi(x). */
ANNEAL_INLINE float gelu_cdf(float x, float *e_hi, float *e_lo) {
    float ax = anneal_vsel(x < 0.0f, -x, x);
    ax = anneal_vsel(ax < GELU_Z_MAX * 1.41421356f, ax, GELU_Z_MAX * 1.41421356f); /* NaN -> cap */
    float xh = anneal_bits_to_float(anneal_float_to_bits(ax) & (int32_t)0xFFFFF000);
    float lo = -0.5f * ((ax - xh) * (ax + xh));
    float z = ax * GELU_SQRT1_2;
    float t = 1.0f / (1.0f + 0.5f * z);
    float eh = anneal_vexpf(-0.5f * (xh * xh));
    float half_erfc = 0.5f * t * eh * anneal_vexpf(lo + erfc_poly(t));
    *e_hi = eh;
    *e_lo = lo;
    return anneal_vsel(x < 0.0f, half_erfc, 1.0f - half_erfc);
}

ANNEAL_VEC_CLONES
static void gelu_erf_fwd_block(int64_t n, const float *restrict x, float *restrict y) {
    for (int64_t i = 0; i < n; i++) {
        float eh, lo;
        float xi = x[i];
        y[i] = xi * gelu_cdf(xi, &eh, &lo);
    }
}

/* d/dx x*Phi(x) = Phi(x) + x*phi(x), phi(x) = e^(-x^2/2)/sqrt(2*pi). */
ANNEAL_VEC_CLONES
static void gelu_erf_bwd_block(int64_t n, const float *restrict x, const float *restrict dy,
                               float *restrict dx) {
    for (int64_t i = 0; i < n; i++) {
        float eh, lo;
        float xi = x[i];
        float cdf = gelu_cdf(xi, &eh, &lo);
        float pdf = eh * anneal_vexpf(lo) * GELU_INV_SQRT_2PI;
        dx[i] = dy[i] * (cdf + xi * pdf);
    }
}

/* ------------------------------------------------------------- tanh GELU */

/* 0.5*x*(1 + tanh(u)) = x * sigmoid(2u) = x / (1 + e^(-2u)), u = sqrt(2/pi)*(x + k*x^3).
 * The sigmoid form has no cancellation for negative x, where 1 + tanh(u) would. */
ANNEAL_VEC_CLONES
static void gelu_tanh_fwd_block(int64_t n, const float *restrict x, float *restrict y) {
    for (int64_t i = 0; i < n; i++) {
        float xi = x[i];
        float u = GELU_SQRT_2_OVER_PI * (xi + GELU_KAPPA * (xi * xi * xi));
        y[i] = xi / anneal_v1p_expf(-2.0f * u);
    }
}

/* With s = sigmoid(2u) = (1 + tanh u)/2:  d/dx = s + 2*x*s*(1-s)*u'(x),
 * u' = sqrt(2/pi)*(1 + 3k*x^2). 1-s = e*s for e = e^(-2u), or 1 when e overflows. */
ANNEAL_VEC_CLONES
static void gelu_tanh_bwd_block(int64_t n, const float *restrict x, const float *restrict dy,
                                float *restrict dx) {
    for (int64_t i = 0; i < n; i++) {
        float xi = x[i];
        float x2 = xi * xi;
        float u = GELU_SQRT_2_OVER_PI * (xi + GELU_KAPPA * (x2 * xi));
        float du = GELU_SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_KAPPA * x2);
        float e = anneal_vexpf(-2.0f * u);
        float s = 1.0f / (1.0f + e);
        float oms = anneal_vsel(e < __builtin_inff(), e * s, 1.0f);
        dx[i] = dy[i] * (s + 2.0f * xi * s * oms * du);
    }
}

/* ------------------------------------------------------------------ SiLU */

/* x * sigmoid(x) = x / (1 + e^-x), as PyTorch writes it. */
ANNEAL_VEC_CLONES
static void silu_fwd_block(int64_t n, const float *restrict x, float *restrict y) {
    for (int64_t i = 0; i < n; i++) {
        float xi = x[i];
        y[i] = xi / anneal_v1p_expf(-xi);
    }
}

/* d/dx x*s(x) = s*(1 + x*(1 - s)). */
ANNEAL_VEC_CLONES
static void silu_bwd_block(int64_t n, const float *restrict x, const float *restrict dy,
                           float *restrict dx) {
    for (int64_t i = 0; i < n; i++) {
        float xi = x[i];
        float s = 1.0f / anneal_v1p_expf(-xi);
        dx[i] = dy[i] * (s * (1.0f + xi * (1.0f - s)));
    }
}

/* ------------------------------------------------------------ dispatch */

typedef void (*unary_block_fn)(int64_t, const float *, float *);
typedef void (*binary_block_fn)(int64_t, const float *, const float *, float *);

/* Runs f over [0, n) in PW_BLOCK pieces, in parallel when n is large. */
static void run_unary(unary_block_fn f, int64_t n, const float *x, float *y) {
    int64_t nb = (n + PW_BLOCK - 1) / PW_BLOCK;
#pragma omp parallel for schedule(static) if (n >= PW_PARALLEL_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t i0 = b * PW_BLOCK;
        int64_t len = n - i0 < PW_BLOCK ? n - i0 : PW_BLOCK;
        f(len, x + i0, y + i0);
    }
}

static void run_binary(binary_block_fn f, int64_t n, const float *x, const float *dy, float *dx) {
    int64_t nb = (n + PW_BLOCK - 1) / PW_BLOCK;
#pragma omp parallel for schedule(static) if (n >= PW_PARALLEL_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t i0 = b * PW_BLOCK;
        int64_t len = n - i0 < PW_BLOCK ? n - i0 : PW_BLOCK;
        f(len, x + i0, dy + i0, dx + i0);
    }
}

/* y = gelu(x), erf form or tanh approximation. */
void anneal_cpu_gelu_fwd(int64_t n, const float *x, float *y, bool tanh_approx) {
    run_unary(tanh_approx ? gelu_tanh_fwd_block : gelu_erf_fwd_block, n, x, y);
}

/* dx = dy * gelu'(x). */
void anneal_cpu_gelu_bwd(int64_t n, const float *x, const float *dy, float *dx, bool tanh_approx) {
    run_binary(tanh_approx ? gelu_tanh_bwd_block : gelu_erf_bwd_block, n, x, dy, dx);
}

/* y = silu(x). */
void anneal_cpu_silu_fwd(int64_t n, const float *x, float *y) {
    run_unary(silu_fwd_block, n, x, y);
}

/* dx = dy * silu'(x). */
void anneal_cpu_silu_bwd(int64_t n, const float *x, const float *dy, float *dx) {
    run_binary(silu_bwd_block, n, x, dy, dx);
}
