/* Vectorisable float math for the CPU kernels: an expf and a branch-free select
 * that gcc -O3 turns into SIMD code without -ffast-math, plus the attribute that
 * compiles a hot function once per ISA (AVX-512, AVX2, baseline) and picks one at
 * load time. Every function here is exact IEEE arithmetic in a fixed order, so
 * the clones give the same bits (C11 mode keeps -ffp-contract=off: no FMA fusion). */
#ifndef ANNEAL_CPU_VEC_MATH_H
#define ANNEAL_CPU_VEC_MATH_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* Runtime ISA dispatch for a hot loop: gcc on x86-64 builds one clone per target
 * and an ifunc resolver. Elsewhere the plain function. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ANNEAL_VEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ANNEAL_VEC_CLONES
#endif

/* Width of the manual accumulators used for float row sums: a fixed 16 lanes keeps
 * the summation order (hence the bits) independent of the vector ISA. */
#define ANNEAL_VEC_LANES 16

static inline float anneal_bits_to_float(int32_t i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

static inline int32_t anneal_float_to_bits(float f) {
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i;
}

/* c ? a : b computed with integer masks, both arms evaluated. A float ternary whose
 * arm does arithmetic is not if-converted under -ftrapping-math (gcc's default), so
 * the loop would stay scalar; this form vectorises on every ISA. */
static inline float anneal_vsel(bool c, float a, float b) {
    int32_t m = -(int32_t)c;
    int32_t r = (anneal_float_to_bits(a) & m) | (anneal_float_to_bits(b) & ~m);
    return anneal_bits_to_float(r);
}

/* e^x for every float x, within 2 ulp of the exact value for normal results:
 * x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite two-part ln2), e^r by the Cephes
 * degree-7 polynomial, and 2^n applied as two factors 2^(n/2) * 2^(n - n/2) so
 * that denormal results and overflow to +inf come out right. exp(-inf) = 0,
 * exp(+inf) = +inf, NaN stays NaN. */
static inline float anneal_vexpf(float x) {
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

#endif
