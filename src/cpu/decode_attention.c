/* Attention of a decode step (decode_kernels.h): one new token per cache slot, the
 * cache read in its stored dtype (f32, bf16 widened on the fly, int8 times its per
 * position scale), no dequantized copy.
 *
 * For row i (slot s, position p = pos[i]) the new key and value are rotated (keys, with
 * RoPE; the same anneal_cpu_rope as the tensor path, so the rotation is bit for bit the
 * one prefill applies) and stored at position p; then every query head computes its
 * scores against positions [0, p] into a scratch row, the softmax (max subtracted, f32
 * exp sums in position order) and the weighted sum of the values. Work items are
 * (row, head) pairs split between the OpenMP threads; each output is computed by one
 * item, so the bits do not depend on the thread count. The dot products and the value
 * accumulation are plain loops that GCC vectorizes, compiled twice (AVX-512 and the
 * baseline) and picked at load time. */
#include "anneal/decode_kernels.h"
#include "cpu/cpu_kernels.h"

#include <math.h>
#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DK_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define DK_CLONES
#endif

DK_CLONES static float dot_f32(const float *q, const float *k, int64_t D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; d++) s += q[d] * k[d];
    return s;
}

DK_CLONES static float dot_bf16(const float *q, const uint16_t *k, int64_t D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; d++) {
        union {
            uint32_t u;
            float f;
        } c = {.u = (uint32_t)k[d] << 16};
        s += q[d] * c.f;
    }
    return s;
}

DK_CLONES static float dot_i8(const float *q, const int8_t *k, int64_t D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; d++) s += q[d] * (float)k[d];
    return s;
}

DK_CLONES static void axpy_f32(float *o, float a, const float *v, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) o[d] += a * v[d];
}

DK_CLONES static void axpy_bf16(float *o, float a, const uint16_t *v, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) {
        union {
            uint32_t u;
            float f;
        } c = {.u = (uint32_t)v[d] << 16};
        o[d] += a * c.f;
    }
}

DK_CLONES static void axpy_i8(float *o, float a, const int8_t *v, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) o[d] += a * (float)v[d];
}

/* Rotates the H heads of one row (H * D floats) to position pos. */
static void rope_row(const anneal_rope_desc *r, float *x, int64_t H, int64_t D, int64_t pos) {
    static const int scaling[] = {ANNEAL_CPU_ROPE_NONE, ANNEAL_CPU_ROPE_LINEAR, ANNEAL_CPU_ROPE_LLAMA3};
    anneal_cpu_rope_desc d = {.B = 1, .H = H, .T = 1, .D = D, .sb = H * D, .sh = D, .st = D, .theta = r->theta,
                              .scaling = scaling[r->scaling], .factor = r->factor,
                              .low_freq_factor = r->low_freq_factor, .high_freq_factor = r->high_freq_factor,
                              .original_max_pos = r->original_max_pos};
    anneal_cpu_rope(&d, x, pos, false);
}

/* Stores one head's new key or value row x (D) at cache row `row` in the cache's dtype. */
static void store_row(const anneal_decode_attn *a, void *cache, float *scales, int64_t row, const float *x) {
    int64_t D = a->D;
    if (a->dtype == ANNEAL_F32) {
        float *dst = (float *)cache + row * D;
        for (int64_t d = 0; d < D; d++) dst[d] = x[d];
    } else if (a->dtype == ANNEAL_BF16) {
        uint16_t *dst = (uint16_t *)cache + row * D;
        for (int64_t d = 0; d < D; d++) dst[d] = anneal_f32_to_bf16(x[d]);
    } else {
        anneal_kv_quantize_row_i8(x, D, (int8_t *)cache + row * D, scales + row);
    }
}

/* Query head h of row i against its slot's positions [0, pos[i]]. */
static void attend(const anneal_decode_attn *a, int64_t i, int64_t h) {
    const int64_t D = a->D, M = a->max_len, L = a->pos[i] + 1;
    const int64_t kvh = h / (a->Hq / a->Hkv);
    const int64_t base = (a->slots[i] * a->Hkv + kvh) * M;
    const float *q = a->q + i * a->ld_qkv + h * D;
    float *sc = a->scratch + (i * a->Hq + h) * M;
    float *o = a->out + i * a->ld_out + h * D;
    const float scale = 1.0f / sqrtf((float)D);
    float mx = -INFINITY;
    for (int64_t p = 0; p < L; p++) {
        float s;
        if (a->dtype == ANNEAL_F32)
            s = dot_f32(q, (const float *)a->kc + (base + p) * D, D);
        else if (a->dtype == ANNEAL_BF16)
            s = dot_bf16(q, (const uint16_t *)a->kc + (base + p) * D, D);
        else
            s = dot_i8(q, (const int8_t *)a->kc + (base + p) * D, D) * a->k_scale[base + p];
        sc[p] = s * scale;
        mx = sc[p] > mx ? sc[p] : mx;
    }
    float sum = 0.0f;
    for (int64_t p = 0; p < L; p++) {
        sc[p] = expf(sc[p] - mx);
        sum += sc[p];
    }
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t p = 0; p < L; p++) {
        float w = sc[p] * inv;
        if (a->dtype == ANNEAL_F32)
            axpy_f32(o, w, (const float *)a->vc + (base + p) * D, D);
        else if (a->dtype == ANNEAL_BF16)
            axpy_bf16(o, w, (const uint16_t *)a->vc + (base + p) * D, D);
        else
            axpy_i8(o, w * a->v_scale[base + p], (const int8_t *)a->vc + (base + p) * D, D);
    }
}

void anneal_decode_attention(const anneal_decode_attn *a) {
    if (!a || a->n <= 0 || a->Hq <= 0 || a->Hkv <= 0 || a->D <= 0) return;
    const int64_t D = a->D, Hkv = a->Hkv, M = a->max_len;
    for (int64_t i = 0; i < a->n; i++) {
        float *q = a->q + i * a->ld_qkv, *k = a->k + i * a->ld_qkv, *v = a->v + i * a->ld_qkv;
        if (a->rope) {
            rope_row(a->rope, q, a->Hq, D, a->pos[i]);
            rope_row(a->rope, k, Hkv, D, a->pos[i]);
        }
        for (int64_t h = 0; h < Hkv; h++) {
            int64_t row = (a->slots[i] * Hkv + h) * M + a->pos[i];
            store_row(a, a->kc, a->k_scale, row, k + h * D);
            store_row(a, a->vc, a->v_scale, row, v + h * D);
        }
    }
    const int64_t items = a->n * a->Hq;
    int64_t work = 0;
    for (int64_t i = 0; i < a->n; i++) work += (a->pos[i] + 1) * a->Hq * D;
#pragma omp parallel for schedule(static) if (items > 1 && work >= 32768)
    for (int64_t it = 0; it < items; it++) attend(a, it / a->Hq, it % a->Hq);
}
