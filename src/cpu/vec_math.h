/* Vectorisable float math for the CPU kernels, written so gcc -O3 emits SIMD code
 * without -ffast-math: an expf, a branch-free select, a 16-lane float vector for
 * row sums, an ordered-integer max; plus the attribute that compiles a hot function
 * once per ISA (AVX-512, AVX2+FMA, baseline SSE2) and picks one at load time.
 * Everything here is IEEE arithmetic in a fixed order, so every clone (and every
 * thread count) gives the same bits; C11 mode keeps -ffp-contract=off, so no FMA
 * fusion happens unless the source calls fmaf. */
#ifndef ANNEAL_CPU_VEC_MATH_H
#define ANNEAL_CPU_VEC_MATH_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* Runtime ISA dispatch for a hot loop: gcc on x86-64 builds one clone per target
 * (AVX-512; AVX2+FMA, i.e. x86-64-v3; baseline SSE2) and an ifunc resolver.
 * Elsewhere the plain function. FMA is only used where the source says fmaf. */
#ifndef ANNEAL_VEC_CLONES /* -DANNEAL_VEC_CLONES= builds one baseline version */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ANNEAL_VEC_CLONES \
    __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define ANNEAL_VEC_CLONES
#endif
#endif

/* For helpers called from cloned functions: a plain static inline callee may be left
 * out of line, compiled for the baseline ISA, when its caller is an AVX-512 clone. */
#define ANNEAL_INLINE static inline __attribute__((always_inline))

/* Width of the accumulators used for float row sums: a fixed 16 lanes keeps the
 * summation order (hence the bits) independent of the vector ISA. */
#define ANNEAL_VEC_LANES 16

/* 16 floats as one GNU C vector: arithmetic on it is lane-wise and gcc lowers it to
 * one AVX-512 register, two AVX2 or four SSE registers, so a reduction written with
 * it has the same bits on every ISA and keeps its accumulators in registers (a
 * float[16] accumulator loop gets shuffled or spilled by the auto-vectoriser).
 * Vectors are never passed to or returned from functions by value (that ABI differs
 * with and without AVX-512, and gcc warns): loads and splats are expressions. */
typedef float anneal_v16f __attribute__((vector_size(ANNEAL_VEC_LANES * sizeof(float))));
/* The same with float alignment, for loads from any float pointer. */
typedef float anneal_v16f_u
    __attribute__((vector_size(ANNEAL_VEC_LANES * sizeof(float)), aligned(4), may_alias));

/* 16 floats from p (no alignment needed), and all lanes x. */
#define ANNEAL_V16F_LOAD(p) (*(const anneal_v16f_u *)(const void *)(p))
#define ANNEAL_V16F_SPLAT(x) ((anneal_v16f){0} + (float)(x))

/* Sum of the 16 lanes of *v as a fixed pairwise tree. */
ANNEAL_INLINE float anneal_v16f_sum(const anneal_v16f *v) {
    float a[8];
    for (int j = 0; j < 8; j++) a[j] = (*v)[j] + (*v)[j + 8];
    for (int j = 0; j < 4; j++) a[j] = a[j] + a[j + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* *dst = the first n (0 <= n < 16) floats of p, the other lanes `fill`. For loop
 * tails: subscripting a vector variable would push the accumulators to memory. */
ANNEAL_INLINE void anneal_v16f_load_partial(anneal_v16f *dst, const float *p, int64_t n,
                                            float fill) {
    float t[ANNEAL_VEC_LANES];
    for (int j = 0; j < ANNEAL_VEC_LANES; j++) t[j] = fill;
    memcpy(t, p, (size_t)n * sizeof(float));
    memcpy(dst, t, sizeof t);
}

/* *acc += x[0..n) with element i in lane i % 16 (n need not be a multiple of 16, but
 * only the last piece of a longer sum may be short). */
ANNEAL_INLINE void anneal_v16f_accumulate(anneal_v16f *acc, int64_t n, const float *x) {
    anneal_v16f a = *acc, t;
    int64_t i = 0;
    for (; i + ANNEAL_VEC_LANES <= n; i += ANNEAL_VEC_LANES) a += ANNEAL_V16F_LOAD(x + i);
    if (i < n) {
        anneal_v16f_load_partial(&t, x + i, n - i, 0.0f);
        a += t;
    }
    *acc = a;
}

/* sum(x[0..n)) with element i in lane i % 16, lanes combined by anneal_v16f_sum. */
ANNEAL_INLINE float anneal_sum16(int64_t n, const float *x) {
    anneal_v16f acc = {0};
    anneal_v16f_accumulate(&acc, n, x);
    return anneal_v16f_sum(&acc);
}

ANNEAL_INLINE float anneal_bits_to_float(int32_t i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

ANNEAL_INLINE int32_t anneal_float_to_bits(float f) {
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i;
}

/* c ? a : b computed with integer masks, both arms evaluated. A float ternary whose
 * arm does arithmetic is not if-converted under -ftrapping-math (gcc's default), so
 * the loop would stay scalar; this form vectorises on every ISA. */
ANNEAL_INLINE float anneal_vsel(bool c, float a, float b) {
    int32_t m = -(int32_t)c;
    int32_t r = (anneal_float_to_bits(a) & m) | (anneal_float_to_bits(b) & ~m);
    return anneal_bits_to_float(r);
}

/* e^x for every float x, within 2 ulp of the exact value for normal results:
 * x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite two-part ln2), e^r by the Cephes
 * degree-7 polynomial, and 2^n applied as two factors 2^(n/2) * 2^(n - n/2) so
 * that denormal results and overflow to +inf come out right. exp(-inf) = 0,
 * exp(+inf) = +inf, NaN stays NaN. */
ANNEAL_INLINE float anneal_vexpf(float x) {
    /* Clamp (NaN goes to the low end; restored at the end): below -105 the result
     * rounds to 0, above 89 it overflows to inf. */
    float xk = anneal_vsel(x > -105.0f, x, -105.0f);
    xk = anneal_vsel(xk < 89.0f, xk, 89.0f);
    /* n = round(x / ln2) by the 1.5*2^23 trick (exact round-to-nearest for |v| < 2^22). */
    float nf = (xk * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    int32_t n = (int32_t)nf;
    float r = xk - nf * 0.693359375f;  /* ln2 high part: 9 bits, n*hi is exact */
    r = r - nf * -2.12194440e-4f;      /* ln2 - hi */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t h = n >> 1; /* n in [-152, 128]: both halves are normal powers of two */
    float s1 = anneal_bits_to_float((h + 127) << 23);
    float s2 = anneal_bits_to_float((n - h + 127) << 23);
    float res = (p * s1) * s2;
    return anneal_vsel(x == x, res, x);
}

/* 1 + e^x for the sigmoid forms x / (1 + e^-x): x below -87 is taken as -87, where
 * e^x (at most 1.7e-38, the smallest normals) vanishes in 1 + e^x either way, so the
 * result has the bits of 1.0f + anneal_vexpf(x) and no subnormal is ever made (an Intel
 * core takes a microcode assist for each: a tanh-GELU GEMM epilogue over large
 * activations ran at two thirds of its speed). NaN stays NaN. */
ANNEAL_INLINE float anneal_v1p_expf(float x) { return 1.0f + anneal_vexpf(anneal_vsel(x < -87.0f, -87.0f, x)); }

/* A float's bits as an int32 that orders like the float (-0 just below +0; NaNs with
 * the sign bit clear above +inf, with it set below -inf). Integer max reductions
 * vectorise; float ones do not without -ffast-math. */
ANNEAL_INLINE int32_t anneal_float_order(float f) {
    int32_t b = anneal_float_to_bits(f);
    return b ^ (-(int32_t)((uint32_t)b >> 31) & 0x7FFFFFFF);
}

/* max(x[0..n)), -inf for n = 0. A NaN may or may not win (by its sign bit); callers
 * that exponentiate x - max propagate NaN either way. */
ANNEAL_INLINE float anneal_max(int64_t n, const float *x) {
    int32_t m = anneal_float_order(-__builtin_inff());
    for (int64_t i = 0; i < n; i++) {
        int32_t k = anneal_float_order(x[i]);
        m = k > m ? k : m;
    }
    return anneal_bits_to_float(m ^ (-(int32_t)((uint32_t)m >> 31) & 0x7FFFFFFF));
}

#endif
