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
 * item, so the bits do not depend on the thread count. With AVX2 + FMA and D a multiple
 * of 8, explicit kernels (attend_avx2: 4 positions' scores at a time, the output row in
 * registers); otherwise the dot products and the value accumulation are plain loops
 * that GCC vectorizes, compiled twice (AVX-512 and the baseline) and picked at load
 * time. A prompt's chunk (rows of one slot at consecutive positions, with kv_scratch
 * given) instead attends through the tensor path's flash kernel over the slot's keys
 * and values widened once to f32 (attend_run). */
#include "anneal/decode_kernels.h"
#include "cpu/cpu_kernels.h"

#include <math.h>
#include <omp.h>
#include <string.h>

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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DA_AVX2 __attribute__((target("avx2,fma")))
#define DA_INLINE static inline __attribute__((always_inline))

/* 8 cache values at p (element i of 8) widened to f32: f32, bf16 (bits shifted up,
 * exact) or int8 (exact). */
DA_AVX2 DA_INLINE __m256 da_load8(const void *p, int64_t i, anneal_dtype dt) {
    if (dt == ANNEAL_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    if (dt == ANNEAL_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    return _mm256_loadu_ps((const float *)p + i);
}

/* The 8-lane sums of a, b, c, d as 4 floats (lanes 0..3). */
DA_AVX2 DA_INLINE __m128 da_hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d), t = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* attend() in AVX2 + FMA for D a multiple of 8 (DT: the cache's dtype, a constant at
 * every call): scores 4 positions at a time (4 independent accumulators per dimension
 * chunk, summed together), exp and the sum in position order, then the weighted values
 * with the output row held in registers, 64 dimensions (8 vectors) at a time. */
DA_AVX2 DA_INLINE void attend_avx2(const anneal_decode_attn *a, int64_t it, int64_t next, const anneal_dtype DT) {
    const int64_t i = it / a->Hq, h = it % a->Hq;
    const int64_t D = a->D, M = a->max_len, L = a->pos[i] + 1;
    const int64_t kvh = h / (a->Hq / a->Hkv);
    const int64_t base = (a->slots[i] * a->Hkv + kvh) * M;
    const float *q = a->q + i * a->ld_qkv + h * D;
    float *sc = a->scratch + (i * a->Hq + h) * M;
    float *o = a->out + i * a->ld_out + h * D;
    const size_t es = DT == ANNEAL_F32 ? 4 : DT == ANNEAL_BF16 ? 2 : 1;
    const char *kc = (const char *)a->kc + (size_t)(base * D) * es, *vc = (const char *)a->vc + (size_t)(base * D) * es;
    const float scale = 1.0f / sqrtf((float)D);
    const size_t rowb = (size_t)D * es; /* bytes of one cached position */
    int64_t p = 0;
    for (; p + 4 <= L; p += 4) {
        /* the values of these positions into L2 while the keys are scored: the value pass
         * then reads from L2 instead of starting a second stream from memory */
        for (size_t off = 0; off < 4 * rowb; off += 64) _mm_prefetch(vc + (size_t)p * rowb + off, _MM_HINT_T1);
        __m256 acc[4];
        for (int u = 0; u < 4; u++) acc[u] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int u = 0; u < 4; u++) acc[u] = _mm256_fmadd_ps(qv, da_load8(kc, (p + u) * D + d, DT), acc[u]);
        }
        __m128 s4 = da_hsum4(acc[0], acc[1], acc[2], acc[3]);
        if (DT == ANNEAL_I8) s4 = _mm_mul_ps(s4, _mm_loadu_ps(a->k_scale + base + p));
        _mm_storeu_ps(sc + p, _mm_mul_ps(s4, _mm_set1_ps(scale)));
    }
    for (; p < L; p++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), da_load8(kc, p * D + d, DT), acc);
        float s = _mm_cvtss_f32(da_hsum4(acc, acc, acc, acc));
        if (DT == ANNEAL_I8) s *= a->k_scale[base + p];
        sc[p] = s * scale;
    }
    float mx = -INFINITY;
    for (p = 0; p < L; p++) mx = sc[p] > mx ? sc[p] : mx;
    float sum = 0.0f;
    for (p = 0; p < L; p++) {
        sc[p] = expf(sc[p] - mx);
        sum += sc[p];
    }
    const float inv = 1.0f / sum;
    /* the keys of the thread's next item (next >= 0) into L2 while the values are read,
     * one position's row per position here: its score pass then starts from L2 */
    const char *nk = NULL;
    int64_t nL = 0;
    if (next >= 0) {
        const int64_t i2 = next / a->Hq, h2 = next % a->Hq;
        nk = (const char *)a->kc + (size_t)(((a->slots[i2] * a->Hkv + h2 / (a->Hq / a->Hkv)) * M) * D) * es;
        nL = a->pos[i2] + 1;
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nv = (int)((D - d0 < 64 ? D - d0 : 64) / 8);
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (p = 0; p < L; p++) {
            if (d0 == 0 && p < nL)
                for (size_t off = 0; off < rowb; off += 64) _mm_prefetch(nk + (size_t)p * rowb + off, _MM_HINT_T1);
            float wp = sc[p] * inv;
            if (DT == ANNEAL_I8) wp *= a->v_scale[base + p];
            const __m256 w = _mm256_set1_ps(wp);
            if (nv == 8) /* the common head sizes (64, 128): a fixed count the compiler unrolls */
                for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(w, da_load8(vc, p * D + d0 + 8 * c, DT), acc[c]);
            else
                for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(w, da_load8(vc, p * D + d0 + 8 * c, DT), acc[c]);
        }
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
    }
}

/* Work item `it` (row it / Hq, head it % Hq); `next`: the thread's next item, or -1. */
DA_AVX2 static void attend_avx2_f32(const anneal_decode_attn *a, int64_t it, int64_t next) {
    attend_avx2(a, it, next, ANNEAL_F32);
}
DA_AVX2 static void attend_avx2_bf16(const anneal_decode_attn *a, int64_t it, int64_t next) {
    attend_avx2(a, it, next, ANNEAL_BF16);
}
DA_AVX2 static void attend_avx2_i8(const anneal_decode_attn *a, int64_t it, int64_t next) {
    attend_avx2(a, it, next, ANNEAL_I8);
}

/* True when this call takes the AVX2 kernels: D a multiple of 8, the CPU has AVX2 + FMA
 * and the ISA limit (anneal_cpu_isa_limit, read at every call) allows them. */
static bool use_avx2(const anneal_decode_attn *a) {
    static int has = -1;
    if (has < 0) has = anneal_cpu_has_avx2() && __builtin_cpu_supports("fma");
    return has && a->D % 8 == 0 && anneal_cpu_isa_limit() >= ANNEAL_ISA_AVX2;
}
#endif

/* The f32 value of bf16 bits h (exact). */
static inline float widen_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Rows [0, n) of a, all of one slot at consecutive positions (a prompt's chunk), with
 * a kv_scratch large enough: the slot's keys and values [0, pos[n-1]] widened to f32 (an
 * f32 cache is read in place) and the tensor path's flash attention over them, causal
 * with the chunk's offset (anneal_cpu_attention_fwd, f32 tiles): no per-row pass over
 * the cache. False (nothing done) when the rows are not such a run (n < 2 included). */
static bool attend_run(const anneal_decode_attn *a) {
    const int64_t n = a->n, D = a->D, Hkv = a->Hkv, Hq = a->Hq, M = a->max_len;
    if (n < 2 || !a->kv_scratch) return false;
    const int64_t Tk = a->pos[n - 1] + 1;
    const bool in_place = a->dtype == ANNEAL_F32;
    if (a->kv_scratch_floats < Hq * n + (in_place ? 0 : 2 * Hkv * Tk * D)) return false;
    float *lse = a->kv_scratch, *kw = lse + Hq * n, *vw = kw + Hkv * Tk * D;
    const int64_t base = a->slots[0] * Hkv * M; /* the slot's first cache row */
    int64_t k_sh = M * D;
    const float *k = (const float *)a->kc + base * D, *v = (const float *)a->vc + base * D;
    if (!in_place) {
#pragma omp parallel for schedule(static) if (Hkv * Tk * D >= 65536)
        for (int64_t hp = 0; hp < Hkv * Tk; hp++) {
            const int64_t h = hp / Tk, p = hp % Tk, row = base + h * M + p;
            float *kd = kw + hp * D, *vd = vw + hp * D;
            if (a->dtype == ANNEAL_BF16) {
                const uint16_t *ks = (const uint16_t *)a->kc + row * D, *vs = (const uint16_t *)a->vc + row * D;
                for (int64_t d = 0; d < D; d++) kd[d] = widen_bf16(ks[d]), vd[d] = widen_bf16(vs[d]);
            } else {
                const int8_t *ks = (const int8_t *)a->kc + row * D, *vs = (const int8_t *)a->vc + row * D;
                const float fk = a->k_scale[row], fv = a->v_scale[row];
                for (int64_t d = 0; d < D; d++) kd[d] = (float)ks[d] * fk, vd[d] = (float)vs[d] * fv;
            }
        }
        k = kw, v = vw, k_sh = Tk * D;
    }
    anneal_cpu_attn_desc d = {.B = 1, .H = Hq, .Tq = n, .Tk = Tk, .D = D,
                              .q_sb = 0, .q_sh = D, .q_st = a->ld_qkv,
                              .k_sb = 0, .k_sh = k_sh, .k_st = D,
                              .v_sb = 0, .v_sh = k_sh, .v_st = D,
                              .o_sb = 0, .o_sh = D, .o_st = a->ld_out,
                              .scale = 1.0f / sqrtf((float)D), .causal = true, .Hkv = Hkv};
    anneal_cpu_attention_fwd(&d, a->q, k, v, a->out, lse, ANNEAL_F32);
    return true;
}

/* Rows [0, n) of a attended one at a time: work items are (row, head) pairs. */
static void attend_rows(const anneal_decode_attn *a) {
    const int64_t D = a->D;
    const int64_t items = a->n * a->Hq;
    int64_t work = 0;
    for (int64_t i = 0; i < a->n; i++) work += (a->pos[i] + 1) * a->Hq * D;
#if defined(__x86_64__) && defined(__GNUC__)
    if (use_avx2(a)) {
        void (*fn)(const anneal_decode_attn *, int64_t, int64_t) = a->dtype == ANNEAL_F32    ? attend_avx2_f32
                                                                   : a->dtype == ANNEAL_BF16 ? attend_avx2_bf16
                                                                                             : attend_avx2_i8;
        /* each thread a contiguous range of items (it prefetches its next item's keys) */
#pragma omp parallel if (items > 1 && work >= 32768)
        {
            const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t i0 = items * t / nt, i1 = items * (t + 1) / nt;
            for (int64_t it = i0; it < i1; it++) fn(a, it, it + 1 < i1 ? it + 1 : -1);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (items > 1 && work >= 32768)
    for (int64_t it = 0; it < items; it++) attend(a, it / a->Hq, it % a->Hq);
}

/* Whether row i of a starts a run (the next row is the same slot's next position) that
 * attend_run takes. */
static bool starts_run(const anneal_decode_attn *a, int64_t i) {
    return a->kv_scratch && i + 1 < a->n && a->slots[i + 1] == a->slots[i] && a->pos[i + 1] == a->pos[i] + 1;
}

/* Rows [i0, i1) of a as a descriptor of their own. */
static anneal_decode_attn rows_of(const anneal_decode_attn *a, int64_t i0, int64_t i1) {
    anneal_decode_attn b = *a;
    b.n = i1 - i0;
    b.slots += i0;
    b.pos += i0;
    b.q += i0 * a->ld_qkv;
    b.k += i0 * a->ld_qkv;
    b.v += i0 * a->ld_qkv;
    b.out += i0 * a->ld_out;
    return b;
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
    /* every key and value is stored: runs (a prompt's rows) through the flash kernel,
     * the rows between them one at a time */
    for (int64_t i0 = 0; i0 < a->n;) {
        int64_t i1 = i0 + 1;
        if (starts_run(a, i0)) {
            while (i1 < a->n && a->slots[i1] == a->slots[i0] && a->pos[i1] == a->pos[i1 - 1] + 1) i1++;
            anneal_decode_attn r = rows_of(a, i0, i1);
            if (attend_run(&r)) {
                i0 = i1;
                continue;
            }
        } else {
            while (i1 < a->n && !starts_run(a, i1)) i1++;
        }
        anneal_decode_attn r = rows_of(a, i0, i1);
        attend_rows(&r);
        i0 = i1;
    }
}
