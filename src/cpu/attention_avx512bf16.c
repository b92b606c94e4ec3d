/* The bf16 attention of attention_bf16.c on AVX512-BF16: every tile product runs on
 * VDPBF16PS (bf16 pairs, exact products, f32 accumulation; see gemm_avx512bf16.c for the
 * instruction's arithmetic: one rounding per product added, odd depth of a pair first,
 * subnormal operands and results treated as zero).
 *
 * Operand layouts (32-bit words, each a pair of bf16; lower half first). For
 * C[i][j] += sum_q A(i, q) . B(q, j) the kernel broadcasts the word A(i, q) and loads 16
 * words of B(q, .); a missing second half (odd depth) is zero:
 *   natural  X[i][w] = (x[i][2w], x[i][2w+1])        A operand with depth along a row;
 *   pairs    X[w][c] = (x[2w][c], x[2w+1][c])        B operand with depth along rows,
 *            and, read with a_rs = 1, the A operand of a transposed product (P^T, dS^T);
 *   words^T  X[w][j] = (x[j][2w], x[j][2w+1])        B operand of a product with x^T.
 * Forward task (b, h), or (b, h, query tile) when there are few heads: each Q tile
 * natural; each key tile's K as words^T and V as pairs once per task; P natural as
 * produced.
 * Backward, per query head (anneal_attn_run_bwd's tasks are (b, key/value head), walking
 * the query heads of the group): Q and dO natural and as pairs once per query head (they
 * meet every key tile); per key tile K, V as words^T and K as pairs; P, dS as pairs and
 * dS natural as produced. Conversions round to nearest even (VCVTNE2PS2BF16) and are done with the
 * GEMM's packing routine (anneal_gemm_isa_avx512bf16.pack) or to_natural below.
 *
 * Compiled with a target attribute; attention_bf16.c calls this only after checking
 * anneal_cpu_has_avx512bf16(). */
#include "cpu/attention_internal.h"
#include "cpu/gemm_avx512_tile.h"
#include "cpu/gemm_internal.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <string.h>

enum { BQ = ANNEAL_ATTN_BQ, BK = ANNEAL_ATTN_BK };

#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define BF_INLINE                                                                                  \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"), always_inline))    \
    static inline


/* Words in the natural layout of a row of n values; columns of a pairs layout of n
 * lanes (a multiple of 16, as the packing routine wants). */
static inline int64_t words(int64_t n) { return (n + 1) / 2; }
static inline int64_t lanes_padded(int64_t n) { return n <= 16 ? 16 : (n + 15) / 16 * 16; }

/* Natural layout: dst[i*ldw + w] = (r(src[i*lds + 2w]), r(src[i*lds + 2w + 1])) for i < n,
 * w < words(D); the missing half of odd D is zero. */
BF_TARGET static void to_natural(const float *src, int64_t lds, int n, int64_t D, int32_t *dst,
                                 int64_t ldw) {
    for (int i = 0; i < n; i++) {
        const float *s = src + (int64_t)i * lds;
        int32_t *t = dst + (int64_t)i * ldw;
        for (int64_t c0 = 0; c0 < D; c0 += 32) {
            const __m512 lo = _mm512_maskz_loadu_ps(anneal_a512_first_lanes(D - c0), s + c0);
            const __m512 hi = _mm512_maskz_loadu_ps(anneal_a512_first_lanes(D - c0 - 16), s + c0 + 16);
            const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            _mm512_mask_storeu_epi32(t + c0 / 2, anneal_a512_first_lanes(words(D - c0)), w);
        }
    }
}

/* Pairs layout of an (n x lanes) row-major block (row stride lds): dst[w*width + c] for
 * w < words(n), c < width (lanes beyond `lanes` zero). */
static inline void to_pairs(const float *src, int64_t lds, int64_t n, int64_t lanes, int width,
                            int32_t *dst) {
    anneal_gemm_isa_avx512bf16.pack(src, lds, true, lanes, width, n, ANNEAL_GEMM_ROUND_BF16, dst);
}

/* words^T layout of n rows of D values (row stride lds): dst[w*BK + j] for w < words(D),
 * j < BK (rows beyond n zero). n <= BK. */
static inline void to_words_t(const float *src, int64_t lds, int n, int64_t D, int32_t *dst) {
    anneal_gemm_isa_avx512bf16.pack(src, lds, false, n, BK, D, ANNEAL_GEMM_ROUND_BF16, dst);
}

/* Register tile: MR rows x 16*NV columns of C over kq depth pairs. A(i, q) =
 * A[i*a_rs + q*a_qs]; B(q, .) = B + q*ldb; m0, m1 mask the columns of the two vectors. MR
 * and NV are compile-time constants at every call site (accumulators in registers). */
BF_INLINE void micro(const int MR, const int NV, int64_t kq, const int32_t *A, int64_t a_rs,
                     int64_t a_qs, const int32_t *B, int64_t ldb, float *C, int64_t ldc,
                     __mmask16 m0, __mmask16 m1, bool accumulate) {
    __m512 c[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        c[r][0] = _mm512_setzero_ps();
        c[r][1] = _mm512_setzero_ps();
    }
    for (int64_t q = 0; q < kq; q++) {
        const int32_t *b = B + q * ldb, *a = A + q * a_qs;
        const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, b);
        const __m512bh b1 = NV > 1 ? (__m512bh)_mm512_maskz_loadu_epi32(m1, b + 16)
                                   : (__m512bh)_mm512_setzero_si512();
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32(a[r * a_rs]);
            c[r][0] = _mm512_dpbf16_ps(c[r][0], av, b0);
            if (NV > 1) c[r][1] = _mm512_dpbf16_ps(c[r][1], av, b1);
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

/* C[M x N] (= or +=) sum over kq depth pairs of A(i, q) . B(q, j) (layouts above): panels
 * of 32 columns, register tiles of 8 rows (fewer at the tail). The sum for one element
 * runs over q in order whatever M, N are, so edge tiles give the bits of full ones. */
BF_TARGET static void bf_gemm(int M, int N, int64_t kq, const int32_t *A, int64_t a_rs,
                              int64_t a_qs, const int32_t *B, int64_t ldb, float *C, int64_t ldc,
                              bool accumulate) {
    for (int j0 = 0; j0 < N; j0 += 32) {
        const int nc = N - j0 < 32 ? N - j0 : 32;
        const __mmask16 m0 = anneal_a512_first_lanes(nc), m1 = anneal_a512_first_lanes(nc - 16);
        const int nv = nc > 16 ? 2 : 1;
        for (int i0 = 0; i0 < M; i0 += 8) {
            const int mr = M - i0 < 8 ? M - i0 : 8;
            const int32_t *a = A + (int64_t)i0 * a_rs, *b = B + j0;
            float *c = C + (int64_t)i0 * ldc + j0;
#define BF_MICRO(R, V) micro(R, V, kq, a, a_rs, a_qs, b, ldb, c, ldc, m0, m1, accumulate)
#define BF_CASE(R)                                                                                 \
    case R:                                                                                        \
        if (nv == 2)                                                                               \
            BF_MICRO(R, 2);                                                                        \
        else                                                                                       \
            BF_MICRO(R, 1);                                                                        \
        break
            switch (mr) {
                BF_CASE(1);
                BF_CASE(2);
                BF_CASE(3);
                BF_CASE(4);
                BF_CASE(5);
                BF_CASE(6);
                BF_CASE(7);
                BF_CASE(8);
            }
#undef BF_CASE
#undef BF_MICRO
        }
    }
}

/* Causal tiles that straddle the diagonal: some query rows see only part of the key
 * tile, and the probabilities (and so dS) of the keys they do not see are exact zeros.
 * The products below skip those zeros: they run per block of 8 query (or key) rows, the
 * micro-kernel's height, over only the columns or depth pairs the block needs. What they
 * skip are zero products at the end (or, for gemm_kq, the start) of each sum, so the
 * elements they compute are those of the whole product; elements they do not compute
 * (scores of unseen keys) are overwritten by the masking. Rows see more keys as i grows,
 * so a tile is partial when its first row sees fewer than nk keys. */
static inline bool tile_partial(const anneal_cpu_attn_desc *d, int64_t q0, int64_t k0, int nk) {
    return anneal_attn_row_keys(d, q0, k0, nk) < nk;
}

/* C (nq x nk, queries x keys) = A (natural, query rows, a_rs words apart) . B (words^T
 * of the keys, ldb) over kq pairs; each block of rows gets the columns its last row sees. */
BF_TARGET static void gemm_qk(const anneal_cpu_attn_desc *d, int64_t q0, int nq, int64_t k0,
                              int nk, int64_t kq, const int32_t *A, int64_t a_rs,
                              const int32_t *B, int64_t ldb, float *C, int64_t ldc) {
    if (!tile_partial(d, q0, k0, nk)) {
        bf_gemm(nq, nk, kq, A, a_rs, 1, B, ldb, C, ldc, false);
        return;
    }
    for (int i0 = 0; i0 < nq; i0 += 8) {
        const int mr = nq - i0 < 8 ? nq - i0 : 8;
        const int n = anneal_attn_row_keys(d, q0 + i0 + mr - 1, k0, nk);
        if (n > 0) bf_gemm(mr, n, kq, A + i0 * a_rs, a_rs, 1, B, ldb, C + i0 * ldc, ldc, false);
    }
}

/* C (nq x N, query rows) += A (natural over the keys, ldw words per row) . B (pairs of key
 * rows, ldb); each block of rows runs over the depth pairs of the keys its last row sees. */
BF_TARGET static void gemm_q_keys(const anneal_cpu_attn_desc *d, int64_t q0, int nq, int64_t k0,
                                  int nk, int N, const int32_t *A, int64_t ldw,
                                  const int32_t *B, int64_t ldb, float *C, int64_t ldc) {
    if (!tile_partial(d, q0, k0, nk)) {
        bf_gemm(nq, N, words(nk), A, ldw, 1, B, ldb, C, ldc, true);
        return;
    }
    for (int i0 = 0; i0 < nq; i0 += 8) {
        const int mr = nq - i0 < 8 ? nq - i0 : 8;
        const int64_t kq = words(anneal_attn_row_keys(d, q0 + i0 + mr - 1, k0, nk));
        if (kq > 0) bf_gemm(mr, N, kq, A + i0 * ldw, ldw, 1, B, ldb, C + i0 * ldc, ldc, true);
    }
}

/* C (nk x N, key rows) += A^T . B over the query rows: A(j, q) = Av[j + q*BK] (pairs of P or
 * dS rows), B (pairs of query rows, ldb); each block of keys starts at the depth pair of
 * the first query row that sees its first key. */
BF_TARGET static void gemm_kq(const anneal_cpu_attn_desc *d, int64_t q0, int nq, int64_t k0,
                              int nk, int N, const int32_t *Av, const int32_t *B, int64_t ldb,
                              float *C, int64_t ldc) {
    if (!tile_partial(d, q0, k0, nk)) {
        bf_gemm(nk, N, words(nq), Av, 1, BK, B, ldb, C, ldc, true);
        return;
    }
    for (int j0 = 0; j0 < nk; j0 += 8) {
        const int mr = nk - j0 < 8 ? nk - j0 : 8;
        /* query i sees key k0 + j0 iff i + (Tk - Tq) >= k0 + j0 */
        int64_t first = k0 + j0 - (d->Tk - d->Tq) - q0;
        first = first < 0 ? 0 : first;
        const int64_t qs = first / 2, kq = words(nq) - qs;
        if (kq > 0)
            bf_gemm(mr, N, kq, Av + j0 + qs * BK, 1, BK, B + qs * ldb, ldb, C + j0 * ldc, ldc,
                    true);
    }
}

/* -------------------------------------------------------------------- forward */

/* The converted key tiles of one (b, h): tile t's K as words^T at kt + t*Dw*BK and V as
 * pairs at vv + t*(BK/2)*Dp, the first `done` of them filled, the last one with its first
 * last_nk keys. With cap == 1 the one slot is refilled for every tile (a task of one query
 * tile uses each key tile once). */
typedef struct kv_tiles {
    int32_t *kt, *vv;
    int64_t cap, done;
    int last_nk;
} kv_tiles;

/* Key tile t (keys [t*BK, t*BK + nk)) of c, converted now if not yet with those nk keys.
 * Tiles are first used in order, and a query tile sees every key of each tile before its
 * last one (whole tiles), so only the last converted tile can have been converted with
 * fewer keys than a later query tile sees (causal, Tk - Tq not a multiple of BK): it is
 * converted again with the new nk. So the conversion is always that of exactly nk keys
 * (zero beyond, in particular in the pad of an odd nk), whichever query tile asked first:
 * the bits of the one-query-tile tasks. */
static void kv_get(kv_tiles *c, const anneal_cpu_attn_desc *d, const float *k, const float *v,
                   int64_t t, int nk, const int32_t **kt, const int32_t **vv) {
    const int64_t Dw = words(d->D), Dp = lanes_padded(d->D), slot = c->cap == 1 ? 0 : t;
    int32_t *kts = c->kt + slot * Dw * BK, *vvs = c->vv + slot * (BK / 2) * Dp;
    if (c->cap == 1 || t >= c->done || (t == c->done - 1 && nk != c->last_nk)) {
        to_words_t(k + t * BK * d->k_st, d->k_st, nk, d->D, kts);
        to_pairs(v + t * BK * d->v_st, d->v_st, nk, d->D, (int)Dp, vvs);
        if (c->cap != 1) c->done = t + 1, c->last_nk = nk;
    }
    *kt = kts, *vv = vvs;
}

/* Words of forward scratch for `cap` cached key tiles: Qn (BQ x Dw), Pn (BQ x BK/2), the
 * tiles (cap x (Dw x BK + BK/2 x Dp)), then floats S (BQ x BK), acc (BQ x D), m, l (BQ). */
static size_t fwd_ws_words(int64_t D, int64_t cap) {
    const int64_t Dw = words(D), Dp = lanes_padded(D);
    return (size_t)(BQ * Dw + BQ * BK / 2 + cap * (Dw * BK + BK / 2 * Dp) + BQ * BK + BQ * D +
                    2 * BQ);
}

/* One (b, h, query tile): rows [q0, q0+nq); the arithmetic of attention_bf16.c. ws: the
 * scratch of fwd_ws_words; c: the key tiles (its buffers inside ws). */
BF_TARGET static void fwd_tile(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                               const float *q, const float *k, const float *v, float *o,
                               float *lse, int64_t q0, int nq, float *ws, kv_tiles *c) {
    const int64_t D = d->D, Dw = words(D);
    int32_t *Qn = (int32_t *)ws, *Pn = Qn + BQ * Dw;
    float *S = ws + BQ * Dw + BQ * BK / 2 + c->cap * (Dw * BK + BK / 2 * lanes_padded(D));
    float *acc = S + BQ * BK, *m = acc + BQ * D, *l = m + BQ;

    to_natural(q + q0 * d->q_st, d->q_st, nq, D, Qn, Dw);
    for (int i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)(nq * D));

    const int64_t kend = anneal_attn_visible(d, q0 + nq - 1); /* keys seen by the last row */
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = kend - k0 < BK ? (int)(kend - k0) : BK;
        const int32_t *KTw, *Vv;
        kv_get(c, d, k, v, k0 / BK, nk, &KTw, &Vv);
        gemm_qk(d, q0, nq, k0, nk, Dw, Qn, Dw, KTw, BK, S, BK); /* S = r(Q) r(K)^T */
        anneal_attn_bf16_online_softmax(d, isa, S, q0, nq, k0, nk, m, l, acc);
        to_natural(S, BK, nq, nk, Pn, BK / 2);
        /* acc += r(P) r(V) */
        gemm_q_keys(d, q0, nq, k0, nk, (int)D, Pn, BK / 2, Vv, lanes_padded(D), acc, D);
    }

    anneal_attn_finish_rows(d, o, lse, q0, nq, acc, m, l);
}

/* Tasks: with many heads (B*H >= 4 threads), one per (b, h), walking its query tiles with
 * each key tile converted once (kv_tiles over the whole head); with few, one per (b, h,
 * query tile), converting key tiles as used. Each output row is computed by the same
 * arithmetic either way (the conversion does not depend on who does it), so the bits
 * depend neither on the choice nor on the thread count. */
void anneal_attn_avx512bf16_fwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                                const float *v, float *o, float *lse) {
    const int64_t B = d->B, H = d->H, Tq = d->Tq, D = d->D;
    const anneal_attn_isa *isa = anneal_attn_pick_isa(-1); /* its row helpers; the path is noted by the caller */
    const int64_t ntiles = (Tq + BQ - 1) / BQ;
    const bool per_head = B * H >= 4 * (int64_t)omp_get_max_threads();
    const int64_t per_task = per_head ? ntiles : 1, ntasks = B * H * ntiles / per_task;
    const int64_t cap = per_head ? (anneal_attn_visible(d, Tq - 1) + BK - 1) / BK : 1;
    const size_t ws_words = fwd_ws_words(D, cap > 1 ? cap : 1);

#pragma omp parallel
    {
        float *ws = anneal_attn_alloc(ws_words);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntasks; t++) {
            const int64_t t0 = t * per_task, bh = t0 / ntiles, b = bh / H, h = bh % H;
            float *ob = o + b * d->o_sb + h * d->o_sh, *lb = lse + bh * Tq;
            const int64_t g = anneal_attn_kv_head(d, h); /* its key/value head */
            const float *qb = q + b * d->q_sb + h * d->q_sh, *kb = k + b * d->k_sb + g * d->k_sh;
            const float *vb = v + b * d->v_sb + g * d->v_sh;
            int32_t *tiles = ws ? (int32_t *)ws + BQ * words(D) + BQ * BK / 2 : NULL;
            kv_tiles c = {tiles, tiles ? tiles + (cap > 1 ? cap : 1) * words(D) * BK : NULL,
                          cap > 1 ? cap : 1, 0, 0};
            for (int64_t qt = t0 % ntiles; qt < t0 % ntiles + per_task; qt++) {
                const int64_t q0 = qt * BQ;
                const int nq = Tq - q0 < BQ ? (int)(Tq - q0) : BQ;
                if (!ws)
                    anneal_attn_fail_fwd(d, ob, lb, q0, nq);
                else
                    fwd_tile(d, isa, qb, kb, vb, ob, lb, q0, nq, ws, &c);
            }
        }
    }
}

/* ------------------------------------------------------------------- backward */

/* Words of backward scratch for Tq query rows: Qn, dOn (Tq x Dw each), Qv, dOv
 * (words(Tq) x Dp each), KTw, VTw (Dw x BK each), Kv (BK/2 x Dp), Pv, dSv (BQ/2 x BK
 * each), dSn (BQ x BK/2), then floats P, dS (BQ x BK each), Dvec (Tq). Each part is
 * rounded up to 16 words (64 bytes). */
#define R16(n) (((n) + 15) / 16 * 16)
static size_t bwd_ws_words(int64_t Tq, int64_t D) {
    const int64_t Dw = words(D), Dp = lanes_padded(D);
    return (size_t)(2 * R16(Tq * Dw) + 2 * R16(words(Tq) * Dp) + 2 * R16(Dw * BK) +
                    R16(BK / 2 * Dp) + 3 * R16(BQ * BK / 2) + 2 * BQ * BK + R16(Tq));
}

/* One query head (b, h): pointers offset to this batch and head (k, v, dk, dv to its
 * key/value head); the arithmetic of attention_bf16.c. Overwrites dq, adds to dk
 * (unscaled) and dv. */
BF_TARGET static void bwd_head(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                               const float *q, const float *k, const float *v, const float *o,
                               const float *dout, const float *lse, float *dq, float *dk,
                               float *dv, float *ws) {
    const int64_t D = d->D, Tq = d->Tq, Tk = d->Tk, Dw = words(D), Dp = lanes_padded(D);
    int32_t *Qn = (int32_t *)ws, *dOn = Qn + R16(Tq * Dw), *Qv = dOn + R16(Tq * Dw);
    int32_t *dOv = Qv + R16(words(Tq) * Dp), *KTw = dOv + R16(words(Tq) * Dp);
    int32_t *VTw = KTw + R16(Dw * BK), *Kv = VTw + R16(Dw * BK), *Pv = Kv + R16(BK / 2 * Dp);
    int32_t *dSv = Pv + R16(BQ * BK / 2), *dSn = dSv + R16(BQ * BK / 2);
    float *P = (float *)(dSn + R16(BQ * BK / 2)), *dS = P + BQ * BK, *Dvec = dS + BQ * BK;

    to_natural(q, d->q_st, (int)Tq, D, Qn, Dw);
    to_natural(dout, d->o_st, (int)Tq, D, dOn, Dw);
    to_pairs(q, d->q_st, Tq, D, (int)Dp, Qv);
    to_pairs(dout, d->o_st, Tq, D, (int)Dp, dOv);
    for (int64_t i = 0; i < Tq; i++) { /* Dvec_i = dO_i . o_i in double, as the f32 kernel */
        const float *oi = o + i * d->o_st, *gi = dout + i * d->o_st;
        double acc = 0.0;
        for (int64_t c = 0; c < D; c++) acc += (double)gi[c] * oi[c];
        Dvec[i] = (float)acc;
    }
    for (int64_t i = 0; i < Tq; i++) memset(dq + i * d->q_st, 0, sizeof(float) * (size_t)D);

    for (int64_t k0 = 0; k0 < Tk; k0 += BK) {
        const int nk = Tk - k0 < BK ? (int)(Tk - k0) : BK;
        const float *kt = k + k0 * d->k_st, *vt = v + k0 * d->v_st;
        float *dkt = dk + k0 * d->k_st, *dvt = dv + k0 * d->v_st; /* zeroed by the caller */
        to_words_t(kt, d->k_st, nk, D, KTw);
        to_words_t(vt, d->v_st, nk, D, VTw);
        to_pairs(kt, d->k_st, nk, D, (int)Dp, Kv);

        for (int64_t q0 = 0; q0 < Tq; q0 += BQ) {
            const int nq = Tq - q0 < BQ ? (int)(Tq - q0) : BQ;
            if (anneal_attn_visible(d, q0 + nq - 1) <= k0) continue; /* tile fully masked */
            /* P = exp(scale * r(Q) r(K)^T - lse), zero where masked. */
            gemm_qk(d, q0, nq, k0, nk, Dw, Qn + q0 * Dw, Dw, KTw, BK, P, BK);
            for (int i = 0; i < nq; i++) {
                float *p = P + i * BK;
                const int nv = anneal_attn_row_keys(d, q0 + i, k0, nk);
                if (nv > 0) isa->exp_row(p, nv, d->scale, lse[q0 + i]);
                for (int j = nv; j < nk; j++) p[j] = 0.0f;
            }
            /* dP = r(dO) r(V)^T into dS; dS = P (dP - Dvec). */
            gemm_qk(d, q0, nq, k0, nk, Dw, dOn + q0 * Dw, Dw, VTw, BK, dS, BK);
            for (int i = 0; i < nq; i++) {
                const float *p = P + i * BK, di = Dvec[q0 + i];
                float *ds = dS + i * BK;
                const int nv = anneal_attn_row_keys(d, q0 + i, k0, nk);
                for (int j = 0; j < nv; j++) ds[j] = p[j] * (ds[j] - di);
                for (int j = nv; j < nk; j++) ds[j] = 0.0f; /* P = 0 (dP not computed) */
            }
            to_pairs(P, BK, nq, nk, BK, Pv);
            to_pairs(dS, BK, nq, nk, BK, dSv);
            to_natural(dS, BK, nq, nk, dSn, BK / 2);
            /* dV += r(P)^T r(dO); dK += r(dS)^T r(Q); dQ += r(dS) r(K) (unscaled). */
            const int64_t qw = q0 / 2; /* q0 is even: its pair row */
            gemm_kq(d, q0, nq, k0, nk, (int)D, Pv, dOv + qw * Dp, Dp, dvt, d->v_st);
            gemm_kq(d, q0, nq, k0, nk, (int)D, dSv, Qv + qw * Dp, Dp, dkt, d->k_st);
            gemm_q_keys(d, q0, nq, k0, nk, (int)D, dSn, BK / 2, Kv, Dp, dq + q0 * d->q_st,
                        d->q_st);
        }
    }
    for (int64_t i = 0; i < Tq; i++)
        for (int64_t c = 0; c < D; c++) dq[i * d->q_st + c] *= d->scale;
}

void anneal_attn_avx512bf16_bwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                                const float *v, const float *o, const float *dout,
                                const float *lse, float *dq, float *dk, float *dv) {
    const anneal_attn_isa *isa = anneal_attn_pick_isa(-1); /* its row helpers; the path is noted by the caller */
    const size_t ws_words = bwd_ws_words(d->Tq, d->D);
    anneal_attn_run_bwd(d, isa, q, k, v, o, dout, lse, dq, dk, dv, ws_words, bwd_head, true);
}
