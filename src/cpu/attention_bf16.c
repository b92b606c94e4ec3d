/* bf16 attention on the CPU: the flash-style attention of attention.c with every tile
 * product on bf16 operands and f32 accumulation (compute = ANNEAL_BF16), plus the
 * fallback that runs it on the f32 tile code.
 *
 * Arithmetic (r() rounds an f32 to bf16, nearest even, as anneal_gemm_round_bf16; "."
 * is a product accumulated in f32 over exact products of bf16 values):
 *   forward, per query row i and key tile t (running max m, sum l, accumulator acc):
 *     s_j   = r(q_i) . r(k_j)                       (raw score, f32)
 *     m'    = max(m, scale * max_j s_j);  alpha = exp(m - m')
 *     p_j   = exp(scale * s_j - m')                 (f32, masked keys 0)
 *     l     = alpha l + sum_j p_j;  acc = alpha acc + r(p) . r(V_t);  m = m'
 *     o_i   = acc / l,  lse_i = m + log(l)          (f32)
 *   so the probabilities that meet V are rounded before normalisation, relative to the
 *   running max of their tile (online softmax), and l sums the unrounded p.
 *   backward, per key tile and query tile:
 *     P     = exp(scale * r(Q) . r(K)^T - lse)      (f32, normalised)
 *     dP    = r(dO) . r(V)^T,  Dvec_i = dO_i . o_i  (Dvec in double, from f32 dO and o)
 *     dS    = P * (dP - Dvec)                       (f32, unscaled)
 *     dV   += r(P)^T . r(dO),  dQ += r(dS) . r(K),  dK += r(dS)^T . r(Q)
 *   and at the end dQ *= scale, dK *= scale (f32; with grouped-query attention dK is
 *   scaled once, after the sum over the query heads of its group).
 * Each tile product has one rounding per product added (exact bf16 products, f32 sums),
 * so against the exact product of the rounded operands its error is within the
 * recursive-summation bound depth * 2^-24 * sum |a b|; the bf16 roundings of p and dS
 * (relative error <= u = 2^-8 each) dominate.
 *
 * Two implementations: attention_avx512bf16.c (VDPBF16PS on operands converted to bf16
 * once per task) where anneal_cpu_bf16_dot_preferred() (the CPU has AVX512-BF16, the ISA
 * limit, read at every call, allows it, and VDPBF16PS is not the slower unit, as it is on
 * Intel cores); otherwise the code below, which rounds the operands to bf16
 * (kept as f32) and runs the f32 tile kernels of attention.c (AVX-512 or portable). Both
 * round the same operands to the same values; they differ only in the order of the f32
 * sums inside a tile product (VDPBF16PS adds depth pairs), and in that VDPBF16PS treats
 * subnormal operands and results as zero. Tasks and reduction orders are those of the
 * f32 kernel, so results do not depend on the thread count. */
#include "anneal/backend.h"
#include "cpu/attention_internal.h"
#include "cpu/gemm_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { BQ = ANNEAL_ATTN_BQ, BK = ANNEAL_ATTN_BK };

/* True when the AVX512-BF16 kernels should run. */
static bool use_avx512bf16(void) {
    return anneal_cpu_bf16_dot_preferred();
}

/* dst[j*ldd + c] = r(src[j*lds + c]) for j < n, c < D. */
static void round_rows(const float *src, int64_t lds, int n, int64_t D, float *dst, int64_t ldd) {
    for (int j = 0; j < n; j++)
        anneal_gemm_round_array(D, src + (int64_t)j * lds, dst + (int64_t)j * ldd,
                                ANNEAL_GEMM_ROUND_BF16);
}

/* dst[c*BK + j] = r(src[j*ld + c]) for j < n, c < D: a rounded (D x BK) transpose. */
static void round_pack_t(const float *src, int64_t ld, int n, int64_t D, float *dst) {
    for (int j = 0; j < n; j++) {
        const float *s = src + (int64_t)j * ld;
        for (int64_t c = 0; c < D; c++) dst[c * BK + j] = anneal_gemm_round_bf16(s[c]);
    }
}

/* -------------------------------------------------------------------- forward */

/* One (b, h, query tile), rows [q0, q0+nq), on the f32 tile kernels. ws holds Qr (BQ x D),
 * KT (D x BK), S (BQ x BK), Vr (BK x D), acc (BQ x D), m (BQ), l (BQ). */
static void fwd_tile(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa, const float *q,
                     const float *k, const float *v, float *o, float *lse, int64_t q0, int nq,
                     float *ws) {
    const int64_t D = d->D;
    float *Qr = ws, *KT = Qr + BQ * D, *S = KT + D * BK, *Vr = S + BQ * BK, *acc = Vr + BK * D;
    float *m = acc + BQ * D, *l = m + BQ;

    round_rows(q + q0 * d->q_st, d->q_st, nq, D, Qr, D);
    for (int i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)(nq * D));

    const int64_t kend = anneal_attn_visible(d, q0 + nq - 1); /* keys seen by the last row */
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int nk = kend - k0 < BK ? (int)(kend - k0) : BK;
        round_pack_t(k + k0 * d->k_st, d->k_st, nk, D, KT);
        isa->gemm(nq, nk, (int)D, Qr, D, 1, KT, BK, S, BK, false); /* S = r(Q) r(K)^T */
        anneal_attn_bf16_online_softmax(d, isa, S, q0, nq, k0, nk, m, l, acc);
        for (int i = 0; i < nq; i++) /* r(p); masked keys are 0 and stay 0 */
            anneal_gemm_round_array(nk, S + i * BK, S + i * BK, ANNEAL_GEMM_ROUND_BF16);
        round_rows(v + k0 * d->v_st, d->v_st, nk, D, Vr, D);
        isa->gemm(nq, (int)D, nk, S, BK, 1, Vr, D, acc, D, true); /* acc += r(P) r(V) */
    }

    anneal_attn_finish_rows(d, o, lse, q0, nq, acc, m, l);
}

void anneal_attn_bf16_online_softmax(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa,
                                     float *S, int64_t q0, int nq, int64_t k0, int nk, float *m,
                                     float *l, float *acc) {
    const int64_t D = d->D;
    for (int i = 0; i < nq; i++) {
        float *s = S + i * BK;
        const int nv = anneal_attn_row_keys(d, q0 + i, k0, nk);
        for (int j = nv; j < nk; j++) s[j] = 0.0f; /* masked: P = 0 */
        if (nv == 0) continue;
        const float mnew = fmaxf(m[i], d->scale * isa->row_max(s, nv));
        const float alpha = expf(m[i] - mnew); /* 0 on the first tile (m = -inf) */
        l[i] = l[i] * alpha + isa->exp_row(s, nv, d->scale, mnew);
        m[i] = mnew;
        if (alpha != 1.0f) {
            float *a = acc + i * D;
            for (int64_t c = 0; c < D; c++) a[c] *= alpha;
        }
    }
}

void anneal_attn_bf16_fwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                          const float *v, float *o, float *lse) {
    const int64_t B = d->B, H = d->H, Tq = d->Tq, D = d->D;
    if (B <= 0 || H <= 0 || Tq <= 0 || D < 0) return;
    if (use_avx512bf16()) {
        anneal_cpu_path_note(ANNEAL_CPU_OP_ATTN_BF16, ANNEAL_CPU_PATH_AVX512BF16);
        anneal_attn_avx512bf16_fwd(d, q, k, v, o, lse);
        return;
    }
    /* as the f32 kernel: (b, h, query tile) tasks, each row produced by one task */
    const size_t ws_floats = (size_t)(2 * BQ * D + 2 * D * BK + BQ * BK + 2 * BQ);
    anneal_attn_run_fwd(d, anneal_attn_pick_isa(ANNEAL_CPU_OP_ATTN_BF16), q, k, v, o, lse, ws_floats, fwd_tile);
}

/* ------------------------------------------------------------------- backward */

/* One query head (b, h) on the f32 tile kernels: pointers offset to this batch and head
 * (k, v, dk, dv to its key/value head); overwrites dq, adds to dk (unscaled) and dv. ws holds
 * KT, VT (D x BK each, rounded), Kr (BK x D), Qr, dOr (BQ x D each), P, dS (BQ x BK each),
 * Dvec (BQ). */
static void bwd_head(const anneal_cpu_attn_desc *d, const anneal_attn_isa *isa, const float *q,
                     const float *k, const float *v, const float *o, const float *dout,
                     const float *lse, float *dq, float *dk, float *dv, float *ws) {
    const int64_t D = d->D, Tq = d->Tq, Tk = d->Tk;
    float *KT = ws, *VT = KT + D * BK, *Kr = VT + D * BK, *Qr = Kr + BK * D, *dOr = Qr + BQ * D;
    float *P = dOr + BQ * D, *dS = P + BQ * BK, *Dvec = dS + BQ * BK;

    for (int64_t i = 0; i < Tq; i++) memset(dq + i * d->q_st, 0, sizeof(float) * (size_t)D);

    for (int64_t k0 = 0; k0 < Tk; k0 += BK) {
        const int nk = Tk - k0 < BK ? (int)(Tk - k0) : BK;
        const float *kt = k + k0 * d->k_st, *vt = v + k0 * d->v_st;
        float *dkt = dk + k0 * d->k_st, *dvt = dv + k0 * d->v_st; /* zeroed by the caller */
        round_pack_t(kt, d->k_st, nk, D, KT);
        round_pack_t(vt, d->v_st, nk, D, VT);
        round_rows(kt, d->k_st, nk, D, Kr, D);

        for (int64_t q0 = 0; q0 < Tq; q0 += BQ) {
            const int nq = Tq - q0 < BQ ? (int)(Tq - q0) : BQ;
            if (anneal_attn_visible(d, q0 + nq - 1) <= k0) continue; /* tile fully masked */
            const float *dot = dout + q0 * d->o_st;
            round_rows(q + q0 * d->q_st, d->q_st, nq, D, Qr, D);
            round_rows(dot, d->o_st, nq, D, dOr, D);

            /* P = exp(scale * r(Q) r(K)^T - lse), zero where masked. */
            isa->gemm(nq, nk, (int)D, Qr, D, 1, KT, BK, P, BK, false);
            for (int i = 0; i < nq; i++) {
                float *p = P + i * BK;
                const int nv = anneal_attn_row_keys(d, q0 + i, k0, nk);
                if (nv > 0) isa->exp_row(p, nv, d->scale, lse[q0 + i]);
                for (int j = nv; j < nk; j++) p[j] = 0.0f;
            }
            /* dP = r(dO) r(V)^T into dS; Dvec_i = dO_i . o_i; dS = P (dP - Dvec). */
            isa->gemm(nq, nk, (int)D, dOr, D, 1, VT, BK, dS, BK, false);
            for (int i = 0; i < nq; i++) {
                const float *oi = o + (q0 + i) * d->o_st, *gi = dot + i * d->o_st;
                double acc = 0.0;
                for (int64_t c = 0; c < D; c++) acc += (double)gi[c] * oi[c];
                Dvec[i] = (float)acc;
            }
            for (int i = 0; i < nq; i++) {
                float *p = P + i * BK, *ds = dS + i * BK;
                const float di = Dvec[i];
                for (int j = 0; j < nk; j++) ds[j] = p[j] * (ds[j] - di);
                anneal_gemm_round_array(nk, p, p, ANNEAL_GEMM_ROUND_BF16);
                anneal_gemm_round_array(nk, ds, ds, ANNEAL_GEMM_ROUND_BF16);
            }
            /* dV += r(P)^T r(dO); dQ += r(dS) r(K); dK += r(dS)^T r(Q) (unscaled). */
            isa->gemm(nk, (int)D, nq, P, 1, BK, dOr, D, dvt, d->v_st, true);
            isa->gemm(nq, (int)D, nk, dS, BK, 1, Kr, D, dq + q0 * d->q_st, d->q_st, true);
            isa->gemm(nk, (int)D, nq, dS, 1, BK, Qr, D, dkt, d->k_st, true);
        }
    }
    for (int64_t i = 0; i < Tq; i++)
        for (int64_t c = 0; c < D; c++) dq[i * d->q_st + c] *= d->scale;
}

void anneal_attn_bf16_bwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                          const float *v, const float *o, const float *dout, const float *lse,
                          float *dq, float *dk, float *dv) {
    const int64_t B = d->B, H = d->H, D = d->D;
    if (B <= 0 || H <= 0 || D < 0) return;
    if (use_avx512bf16()) {
        anneal_cpu_path_note(ANNEAL_CPU_OP_ATTN_BF16, ANNEAL_CPU_PATH_AVX512BF16);
        anneal_attn_avx512bf16_bwd(d, q, k, v, o, dout, lse, dq, dk, dv);
        return;
    }
    const anneal_attn_isa *isa = anneal_attn_pick_isa(ANNEAL_CPU_OP_ATTN_BF16);
    const size_t ws_floats = (size_t)(3 * D * BK + 2 * BQ * D + 2 * BQ * BK + BQ);
    anneal_attn_run_bwd(d, isa, q, k, v, o, dout, lse, dq, dk, dv, ws_floats, bwd_head, true);
}
