/* Flash-style scaled-dot-product attention on the CPU (forward and backward).
 *
 * Forward: for each (b, h) and tile of BQ query rows, walk tiles of BK keys
 * (stopping at the last key any row of the tile may see when causal), compute the
 * scaled scores of the tile, update an online softmax (running max m, running sum l,
 * rescaling the output accumulator) and accumulate P @ V. At the end o = acc / l and
 * lse = m + log(l). Nothing larger than a tile is ever allocated.
 *
 * Backward (FlashAttention-2 style): one task per (b, key/value head), which walks the
 * query heads of its group in ascending order (one query head when Hkv == H). For each
 * query head, key tile and query tile that sees it, recompute S = scale * Q K^T,
 * P = exp(S - lse), then
 *   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - Dvec),  dQ += scale dS K,  dK += scale dS^T Q
 * with Dvec_i = dO_i . o_i. dq, dk, dv are accumulated in place (zeroed first) in a
 * fixed order, so results do not depend on the thread count; dk and dv of a key/value
 * head sum the contributions of its query heads in that order (no atomics).
 *
 * Grouped-query attention (Hkv < H): query head h reads key/value head h / (H / Hkv);
 * the forward's tasks are unchanged (each query head's rows are computed exactly as
 * with that key/value head repeated), so its bits equal those of multi-head attention
 * on the repeated k and v.
 *
 * Rows that see no key at all (causal with Tq > Tk, or Tk == 0) get o = 0 and
 * lse = -inf, and zero gradients. If per-thread scratch cannot be allocated the
 * affected outputs are filled with NaN (errors propagate like NaN; nothing aborts).
 *
 * ISA: the small GEMMs and the exponentials have AVX-512 and AVX2 + FMA intrinsics
 * paths (attention_avx2.c; chosen at run time) and a portable C path (auto-vectorised,
 * cloned per ISA by ANNEAL_VEC_CLONES). ANNEAL_ISA (anneal_cpu_isa_limit), read at every
 * call, caps the choice (the tests use it).
 *
 * Precision: this file is the f32 attention (f32 operands and accumulation), used for
 * compute = ANNEAL_F32 and ANNEAL_F16 alike (f16 attention would bring no speed: f16
 * GEMMs run the f32 kernel too). compute = ANNEAL_BF16 goes to attention_bf16.c. */
#include "anneal/core.h"
#include "cpu/attention_internal.h"
#include "cpu/vec_math.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ATTN_HAVE_X86 1
#else
#define ATTN_HAVE_X86 0
#endif

enum { BQ = ANNEAL_ATTN_BQ, BK = ANNEAL_ATTN_BK }; /* query / key tile sizes */
typedef anneal_attn_isa attn_isa;

/* ------------------------------------------------------------ portable path */

/* Portable GEMM: one C row at a time, inner loop over contiguous N (auto-vectorised,
 * cloned per ISA). */
ANNEAL_VEC_CLONES
static void gemm_portable(int M, int N, int K, const float *A, int64_t a_rs, int64_t a_cs,
                          const float *B, int64_t ldb, float *C, int64_t ldc, bool accumulate) {
    for (int i = 0; i < M; i++) {
        float *restrict c = C + (int64_t)i * ldc;
        if (!accumulate)
            for (int j = 0; j < N; j++) c[j] = 0.0f;
        for (int k = 0; k < K; k++) {
            const float a = A[(int64_t)i * a_rs + (int64_t)k * a_cs];
            const float *restrict b = B + (int64_t)k * ldb;
            for (int j = 0; j < N; j++) c[j] += a * b[j];
        }
    }
}

/* The exponentials vectorise (anneal_vexpf); the sum uses 16 fixed lanes so its
 * order, hence its bits, do not depend on the clone. */
ANNEAL_VEC_CLONES
static float exp_row_portable(float *x, int n, float a, float b) {
    for (int j = 0; j < n; j++) x[j] = anneal_vexpf(a * x[j] - b);
    float lanes[ANNEAL_VEC_LANES] = {0};
    int j = 0;
    for (; j + ANNEAL_VEC_LANES <= n; j += ANNEAL_VEC_LANES)
        for (int l = 0; l < ANNEAL_VEC_LANES; l++) lanes[l] += x[j + l];
    for (int l = 0; j + l < n; l++) lanes[l] += x[j + l];
    float sum = 0.0f;
    for (int l = 0; l < ANNEAL_VEC_LANES; l++) sum += lanes[l];
    return sum;
}

static float row_max_portable(const float *x, int n) {
    float m = x[0];
    for (int j = 1; j < n; j++) m = fmaxf(m, x[j]);
    return m;
}

static const attn_isa isa_portable = {gemm_portable, exp_row_portable, row_max_portable};

/* -------------------------------------------------------------- AVX-512 path */
#if ATTN_HAVE_X86
#define AVX512_FN __attribute__((target("avx512f,fma")))
#define AVX512_INLINE __attribute__((target("avx512f,fma"), always_inline)) static inline

/* Register tile of MR rows x 16*NV columns of C, over the full K. m0/m1 mask the
 * columns of the two 16-wide vectors (tails of N). MR, NV are compile-time constants
 * at every call site, so the accumulators live in registers. */
AVX512_INLINE void micro_avx512(const int MR, const int NV, int K, const float *A, int64_t a_rs,
                                int64_t a_cs, const float *B, int64_t ldb, float *C, int64_t ldc,
                                __mmask16 m0, __mmask16 m1, bool accumulate) {
    __m512 c[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        c[r][0] = _mm512_setzero_ps();
        c[r][1] = _mm512_setzero_ps();
    }
    for (int k = 0; k < K; k++) {
        const float *b = B + (int64_t)k * ldb;
        const float *a = A + (int64_t)k * a_cs;
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, b);
        const __m512 b1 = NV > 1 ? _mm512_maskz_loadu_ps(m1, b + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m512 av = _mm512_set1_ps(a[r * a_rs]);
            c[r][0] = _mm512_fmadd_ps(av, b0, c[r][0]);
            if (NV > 1) c[r][1] = _mm512_fmadd_ps(av, b1, c[r][1]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        float *cr = C + (int64_t)r * ldc;
        if (accumulate) c[r][0] = _mm512_add_ps(c[r][0], _mm512_maskz_loadu_ps(m0, cr));
        _mm512_mask_storeu_ps(cr, m0, c[r][0]);
        if (NV > 1) {
            if (accumulate) c[r][1] = _mm512_add_ps(c[r][1], _mm512_maskz_loadu_ps(m1, cr + 16));
            _mm512_mask_storeu_ps(cr + 16, m1, c[r][1]);
        }
    }
}

static inline __mmask16 tail_mask(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* AVX-512 GEMM: panels of 32 columns, register tiles of 8 rows (smaller at the tails). */
AVX512_FN static void gemm_avx512(int M, int N, int K, const float *A, int64_t a_rs, int64_t a_cs,
                                  const float *B, int64_t ldb, float *C, int64_t ldc,
                                  bool accumulate) {
    for (int j0 = 0; j0 < N; j0 += 32) {
        const int nc = N - j0 < 32 ? N - j0 : 32;
        const __mmask16 m0 = tail_mask(nc), m1 = tail_mask(nc - 16);
        const int nv = nc > 16 ? 2 : 1;
        for (int i0 = 0; i0 < M; i0 += 8) {
            const int mr = M - i0 < 8 ? M - i0 : 8;
            const float *a = A + (int64_t)i0 * a_rs;
            const float *b = B + j0;
            float *c = C + (int64_t)i0 * ldc + j0;
#define ATTN_MICRO(R, V) micro_avx512(R, V, K, a, a_rs, a_cs, b, ldb, c, ldc, m0, m1, accumulate)
#define ATTN_CASE(R)                                                                               \
    case R:                                                                                        \
        if (nv == 2)                                                                               \
            ATTN_MICRO(R, 2);                                                                      \
        else                                                                                       \
            ATTN_MICRO(R, 1);                                                                      \
        break
            switch (mr) {
                ATTN_CASE(1);
                ATTN_CASE(2);
                ATTN_CASE(3);
                ATTN_CASE(4);
                ATTN_CASE(5);
                ATTN_CASE(6);
                ATTN_CASE(7);
                ATTN_CASE(8);
            }
#undef ATTN_CASE
#undef ATTN_MICRO
        }
    }
}

/* exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2/2, Cephes degree-6 polynomial for
 * exp(r), then scalef by 2^n (exact, produces subnormals). Relative error ~2 ulp.
 * NaN stays NaN (constants are the first operand of min/max), -inf gives 0. */
AVX512_INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(88.7228394f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

AVX512_FN static float exp_row_avx512(float *x, int n, float a, float b) {
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(n - j);
        __m512 e = exp512(_mm512_fmsub_ps(va, _mm512_maskz_loadu_ps(m, x + j), vb));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(x + j, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

AVX512_FN static float row_max_avx512(const float *x, int n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        m = _mm512_mask_max_ps(m, k, _mm512_maskz_loadu_ps(k, x + j), m);
    }
    return _mm512_reduce_max_ps(m);
}

static const attn_isa isa_avx512 = {gemm_avx512, exp_row_avx512, row_max_avx512};
#endif

/* The kernels for this CPU: AVX-512 when it has it and the ISA limit allows
 * (anneal_cpu_isa_limit), else AVX2 + FMA (attention_avx2.c) likewise, else portable C. Records the path for op
 * (ANNEAL_CPU_OP_ATTN_*: anneal_cpu_path_note). */
const anneal_attn_isa *anneal_attn_pick_isa(int op) {
#if ATTN_HAVE_X86
    if (anneal_cpu_isa_limit() >= ANNEAL_ISA_AVX512 && anneal_cpu_has_avx512()) {
        anneal_cpu_path_note(op, ANNEAL_CPU_PATH_AVX512);
        return &isa_avx512;
    }
    if (anneal_cpu_isa_limit() >= ANNEAL_ISA_AVX2 && anneal_cpu_has_avx2()) {
        anneal_cpu_path_note(op, ANNEAL_CPU_PATH_AVX2);
        return &anneal_attn_isa_avx2;
    }
#endif
    anneal_cpu_path_note(op, ANNEAL_CPU_PATH_PORTABLE);
    return &isa_portable;
}

/* ------------------------------------------------------------ shared helpers */

/* dst[c][j] = src[j*ld + c] for j < n, c < D: a (D x BK) transposed copy of n rows. */
static void attn_pack_t(const float *src, int64_t ld, int n, int64_t D, float *dst) {
    for (int j = 0; j < n; j++) {
        const float *s = src + (int64_t)j * ld;
        for (int64_t c = 0; c < D; c++) dst[c * BK + j] = s[c];
    }
}

/* Frees a worker's workspace when its thread ends (libgomp ends surplus workers when
 * the thread count drops). */
static pthread_key_t ws_key;
static pthread_once_t ws_once = PTHREAD_ONCE_INIT;
static void ws_key_init(void) { pthread_key_create(&ws_key, free); }

/* This thread's workspace of at least nfloats, kept between calls (like the GEMM
 * pack buffers) so a steady-state step does not allocate; NULL when out of memory. */
float *anneal_attn_alloc(size_t nfloats) {
    static _Thread_local float *buf;
    static _Thread_local size_t cap;
    size_t bytes = (nfloats * sizeof(float) + 63) & ~(size_t)63;
    if (bytes > cap) {
        pthread_once(&ws_once, ws_key_init);
        free(buf);
        buf = aligned_alloc(64, bytes ? bytes : 64);
        cap = buf ? bytes : 0;
        pthread_setspecific(ws_key, buf);
    }
    return buf;
}

/* -------------------------------------------------------------------- forward */

/* One (b, h, query tile): rows [q0, q0+nq). ws holds Qs (BQ x D), KT (D x BK),
 * S (BQ x BK), acc (BQ x D), m (BQ), l (BQ). */
static void attn_fwd_tile(const anneal_cpu_attn_desc *d, const attn_isa *isa, const float *q,
                          const float *k, const float *v, float *o, float *lse, int64_t q0, int nq,
                          float *ws) {
    const int64_t D = d->D;
    float *Qs = ws, *KT = Qs + BQ * D, *S = KT + D * BK, *acc = S + BQ * BK;
    float *m = acc + BQ * D, *l = m + BQ;

    for (int i = 0; i < nq; i++) {
        const float *qi = q + (q0 + i) * d->q_st;
        for (int64_t c = 0; c < D; c++) Qs[i * D + c] = d->scale * qi[c];
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(nq * D));

    const int64_t kend = anneal_attn_visible(d, q0 + nq - 1); /* keys seen by the last row */
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = kend - k0 < BK ? (int)(kend - k0) : BK;
        attn_pack_t(k + k0 * d->k_st, d->k_st, nk, D, KT);
        isa->gemm(nq, nk, (int)D, Qs, D, 1, KT, BK, S, BK, false); /* S = Qs K^T */
        for (int i = 0; i < nq; i++) {
            float *s = S + i * BK;
            int64_t nv64 = anneal_attn_visible(d, q0 + i) - k0;
            const int nv = nv64 < 0 ? 0 : nv64 > nk ? nk : (int)nv64;
            for (int j = nv; j < nk; j++) s[j] = 0.0f; /* masked: P = 0 */
            if (nv == 0) continue;
            const float mnew = fmaxf(m[i], isa->row_max(s, nv));
            const float alpha = expf(m[i] - mnew); /* 0 on the first tile (m = -inf) */
            l[i] = l[i] * alpha + isa->exp_row(s, nv, 1.0f, mnew);
            m[i] = mnew;
            if (alpha != 1.0f) {
                float *a = acc + i * D;
                for (int64_t c = 0; c < D; c++) a[c] *= alpha;
            }
        }
        /* acc += P V */
        isa->gemm(nq, (int)D, nk, S, BK, 1, v + k0 * d->v_st, d->v_st, acc, D, true);
    }

    anneal_attn_finish_rows(d, o, lse, q0, nq, acc, m, l);
}

/* n rows of D floats, row stride st, set to x. */
static void fill_rows(float *p, int64_t n, int64_t st, int64_t D, float x) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < D; c++) p[i * st + c] = x;
}

void anneal_attn_run_bwd(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                         const float *q, const float *k, const float *v, const float *o,
                         const float *dout, const float *lse, float *dq, float *dk, float *dv,
                         size_t ws_floats, anneal_attn_bwd_head_fn head, bool scale_dk) {
    const int64_t B = d->B, H = d->H, Hkv = anneal_attn_kv_heads(d), G = H / Hkv;
    const int64_t Tq = d->Tq, Tk = d->Tk, D = d->D;
#pragma omp parallel
    {
        float *ws = anneal_attn_alloc(ws_floats);
        /* One task per (b, key/value head): its dk, dv rows and the dq rows of its query
         * heads are written only by it, in a fixed order (query heads ascending, then
         * tiles), so the bits do not depend on the thread count. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t bg = 0; bg < B * Hkv; bg++) {
            const int64_t b = bg / Hkv, g = bg % Hkv;
            const int64_t ko = b * d->k_sb + g * d->k_sh, vo = b * d->v_sb + g * d->v_sh;
            if (!ws) {
                for (int64_t h = g * G; h < (g + 1) * G; h++)
                    fill_rows(dq + b * d->q_sb + h * d->q_sh, Tq, d->q_st, D, NAN);
                fill_rows(dk + ko, Tk, d->k_st, D, NAN);
                fill_rows(dv + vo, Tk, d->v_st, D, NAN);
                continue;
            }
            fill_rows(dk + ko, Tk, d->k_st, D, 0.0f);
            fill_rows(dv + vo, Tk, d->v_st, D, 0.0f);
            for (int64_t h = g * G; h < (g + 1) * G; h++) {
                const int64_t qo = b * d->q_sb + h * d->q_sh, oo = b * d->o_sb + h * d->o_sh;
                head(d, isa, q + qo, k + ko, v + vo, o + oo, dout + oo, lse + (b * H + h) * Tq,
                     dq + qo, dk + ko, dv + vo, ws);
            }
            if (scale_dk)
                for (int64_t j = 0; j < Tk; j++)
                    for (int64_t c = 0; c < D; c++) dk[ko + j * d->k_st + c] *= d->scale;
        }
        /* ws stays cached for the next call */
    }
}

void anneal_attn_finish_rows(const anneal_cpu_attn_desc *d, float *o, float *lse, int64_t q0,
                             int nq, const float *acc, const float *m, const float *l) {
    const int64_t D = d->D;
    for (int i = 0; i < nq; i++) {
        float *oi = o + (q0 + i) * d->o_st;
        if (l[i] > 0.0f || l[i] != l[i]) {
            const float inv = 1.0f / l[i];
            for (int64_t c = 0; c < D; c++) oi[c] = acc[i * D + c] * inv;
            lse[q0 + i] = m[i] + logf(l[i]);
        } else { /* no visible key */
            for (int64_t c = 0; c < D; c++) oi[c] = 0.0f;
            lse[q0 + i] = -INFINITY;
        }
    }
}

void anneal_attn_fail_fwd(const anneal_cpu_attn_desc *d, float *o, float *lse, int64_t q0,
                          int nq) {
    for (int i = 0; i < nq; i++) {
        for (int64_t c = 0; c < d->D; c++) o[(q0 + i) * d->o_st + c] = NAN;
        lse[q0 + i] = NAN;
    }
}

/* compute == ANNEAL_BF16 runs the bf16 kernels (attention_bf16.c); anything else
 * (f32, and f16, which would gain nothing here: f16 GEMMs run the f32 kernel) runs the
 * f32 tiles below, whose results do not depend on compute. */
void anneal_cpu_attention_fwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                              const float *v, float *o, float *lse, int compute) {
    const int64_t B = d->B, H = d->H, Tq = d->Tq, D = d->D;
    if (B <= 0 || H <= 0 || Tq <= 0 || D < 0) return;
    if (compute == ANNEAL_BF16) {
        anneal_attn_bf16_fwd(d, q, k, v, o, lse);
        return;
    }
    const size_t ws_floats = (size_t)(2 * BQ * D + D * BK + BQ * BK + 2 * BQ);
    anneal_attn_run_fwd(d, anneal_attn_pick_isa(ANNEAL_CPU_OP_ATTN_F32), q, k, v, o, lse, ws_floats,
                        attn_fwd_tile);
}

void anneal_attn_run_fwd(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                         const float *q, const float *k, const float *v, float *o, float *lse,
                         size_t ws_floats, anneal_attn_fwd_tile_fn tile) {
    const int64_t B = d->B, H = d->H, Tq = d->Tq;
    const int64_t ntiles = (Tq + BQ - 1) / BQ, ntasks = B * H * ntiles;
#pragma omp parallel
    {
        float *ws = anneal_attn_alloc(ws_floats);
        /* Tasks are (b, h, query tile); each output row is produced by one task in a
         * fixed order, so the bits do not depend on the schedule. Causal tiles differ
         * in cost, hence dynamic. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntasks; t++) {
            const int64_t bh = t / ntiles, b = bh / H, h = bh % H;
            const int64_t q0 = (t % ntiles) * BQ;
            const int nq = Tq - q0 < BQ ? (int)(Tq - q0) : BQ;
            float *ob = o + b * d->o_sb + h * d->o_sh;
            float *lb = lse + bh * Tq;
            if (!ws) {
                anneal_attn_fail_fwd(d, ob, lb, q0, nq);
                continue;
            }
            const int64_t g = anneal_attn_kv_head(d, h);
            tile(d, isa, q + b * d->q_sb + h * d->q_sh, k + b * d->k_sb + g * d->k_sh,
                 v + b * d->v_sb + g * d->v_sh, ob, lb, q0, nq, ws);
        }
        /* ws stays cached for the next call */
    }
}

/* ------------------------------------------------------------------- backward */

/* One query head (b, h): pointers already offset to this batch and head (k, v, dk, dv
 * to its key/value head); overwrites dq, adds to dk and dv. ws holds KT, VT (D x BK
 * each), P, dS (BQ x BK each), Dvec (BQ). */
static void attn_bwd_head(const anneal_cpu_attn_desc *d, const attn_isa *isa, const float *q,
                          const float *k, const float *v, const float *o, const float *dout,
                          const float *lse, float *dq, float *dk, float *dv, float *ws) {
    const int64_t D = d->D, Tq = d->Tq, Tk = d->Tk;
    const float scale = d->scale;
    float *KT = ws, *VT = KT + D * BK, *P = VT + D * BK, *dS = P + BQ * BK, *Dvec = dS + BQ * BK;

    for (int64_t i = 0; i < Tq; i++) memset(dq + i * d->q_st, 0, sizeof(float) * (size_t)D);

    for (int64_t k0 = 0; k0 < Tk; k0 += BK) {
        const int nk = Tk - k0 < BK ? (int)(Tk - k0) : BK;
        const float *kt = k + k0 * d->k_st, *vt = v + k0 * d->v_st;
        float *dkt = dk + k0 * d->k_st, *dvt = dv + k0 * d->v_st; /* zeroed by the caller */
        attn_pack_t(kt, d->k_st, nk, D, KT);
        attn_pack_t(vt, d->v_st, nk, D, VT);

        for (int64_t q0 = 0; q0 < Tq; q0 += BQ) {
            const int nq = Tq - q0 < BQ ? (int)(Tq - q0) : BQ;
            if (anneal_attn_visible(d, q0 + nq - 1) <= k0) continue; /* tile fully masked */
            const float *qt = q + q0 * d->q_st, *dot = dout + q0 * d->o_st;

            /* P = exp(scale * Q K^T - lse), zero where masked. */
            isa->gemm(nq, nk, (int)D, qt, d->q_st, 1, KT, BK, P, BK, false);
            for (int i = 0; i < nq; i++) {
                float *p = P + i * BK;
                int64_t nv64 = anneal_attn_visible(d, q0 + i) - k0;
                const int nv = nv64 < 0 ? 0 : nv64 > nk ? nk : (int)nv64;
                if (nv > 0) isa->exp_row(p, nv, scale, lse[q0 + i]);
                for (int j = nv; j < nk; j++) p[j] = 0.0f;
            }
            /* dV += P^T dO (P read transposed). */
            isa->gemm(nk, (int)D, nq, P, 1, BK, dot, d->o_st, dvt, d->v_st, true);
            /* dP = dO V^T into dS. */
            isa->gemm(nq, nk, (int)D, dot, d->o_st, 1, VT, BK, dS, BK, false);
            /* Dvec_i = dO_i . o_i (double for accuracy; recomputed per tile to keep
             * scratch O(tile)); dS = scale * P * (dP - Dvec). */
            for (int i = 0; i < nq; i++) {
                const float *oi = o + (q0 + i) * d->o_st, *gi = dot + i * d->o_st;
                double acc = 0.0;
                for (int64_t c = 0; c < D; c++) acc += (double)gi[c] * oi[c];
                Dvec[i] = (float)acc;
            }
            for (int i = 0; i < nq; i++) {
                const float *p = P + i * BK;
                float *ds = dS + i * BK;
                const float di = Dvec[i];
                for (int j = 0; j < nk; j++) ds[j] = scale * p[j] * (ds[j] - di);
            }
            /* dQ += dS K ; dK += dS^T Q. */
            isa->gemm(nq, (int)D, nk, dS, BK, 1, kt, d->k_st, dq + q0 * d->q_st, d->q_st, true);
            isa->gemm(nk, (int)D, nq, dS, 1, BK, qt, d->q_st, dkt, d->k_st, true);
        }
    }
}

/* compute as in anneal_cpu_attention_fwd (give the forward's). */
void anneal_cpu_attention_bwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                              const float *v, const float *o, const float *dout, const float *lse,
                              float *dq, float *dk, float *dv, int compute) {
    const int64_t B = d->B, H = d->H, D = d->D;
    if (B <= 0 || H <= 0 || D < 0) return;
    if (compute == ANNEAL_BF16) {
        anneal_attn_bf16_bwd(d, q, k, v, o, dout, lse, dq, dk, dv);
        return;
    }
    const attn_isa *isa = anneal_attn_pick_isa(ANNEAL_CPU_OP_ATTN_F32);
    const size_t ws_floats = (size_t)(2 * D * BK + 2 * BQ * BK + BQ);
    anneal_attn_run_bwd(d, isa, q, k, v, o, dout, lse, dq, dk, dv, ws_floats, attn_bwd_head,
                        false);
}
