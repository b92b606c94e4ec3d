/* Tests of the flash-style CPU attention kernels (src/cpu/attention.c) against a
 * naive double-precision reference that builds the full softmax matrix, on
 * contiguous (B, H, T, D), gapped and GPT-2-style interleaved qkv layouts, causal and
 * not, Tq == Tk and Tq != Tk, T across tile boundaries; plus a finite-difference
 * check of the backward, determinism across runs and thread counts, and the same
 * checks on the portable C path (ANNEAL_CPU_ISA=portable).
 *
 * Tolerances (fp32 kernel vs double reference, inputs ~U(-1, 1)):
 *   o:              5e-6 abs + 5e-5 rel
 *   lse:            5e-6 abs + 1e-5 rel (-inf must match exactly)
 *   dq, dk, dv:     1e-5 abs + 1e-4 rel
 *   large logits (scores up to ~60): 1e-4 abs + 1e-3 rel for all
 *   finite differences (central, eps 1e-3 in float): 5e-4 abs + 5e-3 rel */
#include "test.h"

#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"

#include <omp.h>

static const float SENTINEL = 12345.0f;

/* ------------------------------------------------------------------ helpers */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float urand(void) { /* uniform in [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

typedef enum { LAYOUT_CONTIG, LAYOUT_GAPPED, LAYOUT_QKV } layout_kind;

/* Cases are written positionally: {B, H, Tq, Tk, D, causal, scale, layout, amp, Hkv}. */
typedef struct {
    int64_t B, H, Tq, Tk, D;
    bool causal;
    float scale; /* 0 means 1/sqrt(D) */
    layout_kind layout;
    float amp;   /* inputs ~ amp * U(-1, 1); 0 means 1 */
    int64_t Hkv; /* key/value heads (grouped-query attention); 0 means H (and d.Hkv = 0) */
} attn_case;

/* Key/value heads of a descriptor (Hkv, 0 meaning H). */
static int64_t kv_heads(const anneal_cpu_attn_desc *d) { return d->Hkv ? d->Hkv : d->H; }

/* All buffers of one case: inputs (q, k, v, dout), kernel outputs (o, lse, dq, dk, dv)
 * laid out per the case, and compact (B, H, T, D) double references. */
typedef struct {
    anneal_cpu_attn_desc d;
    float *in, *out, *grad; /* owning buffers */
    int64_t n_in, n_out, n_grad;
    const float *q, *k, *v;
    float *o, *dout, *dq, *dk, *dv, *lse;
    float *dout_buf;
    int64_t n_dout;
    double *ro, *rlse, *rdq, *rdk, *rdv;
    int compute; /* precision of the kernel runs (anneal_dtype; ANNEAL_F32 = 0 by default) */
} attn_bufs;

static float *alloc_fill(int64_t n, float val) {
    float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) p[i] = val;
    return p;
}

/* Builds the layout (q, o with H heads; k, v with Hkv). CONTIG: (B, H, T, D). GAPPED:
 * (B, T, H, D+3) with 5 spare elements per batch. QKV: q, k, v interleaved in one
 * (B, T, (H + 2 Hkv) D) buffer (as a fused projection makes them), grads in another, o and
 * dout in (B, T, H D). */
static void bufs_make(attn_bufs *s, const attn_case *c) {
    memset(s, 0, sizeof *s);
    anneal_cpu_attn_desc *d = &s->d;
    d->B = c->B, d->H = c->H, d->Tq = c->Tq, d->Tk = c->Tk, d->D = c->D, d->Hkv = c->Hkv;
    d->causal = c->causal;
    d->scale = c->scale != 0.0f ? c->scale : 1.0f / sqrtf((float)c->D);
    const int64_t B = c->B, H = c->H, Tq = c->Tq, Tk = c->Tk, D = c->D, C = H * D;
    const int64_t Hk = kv_heads(d), Ck = Hk * D;
    const float amp = c->amp != 0.0f ? c->amp : 1.0f;
    int64_t koff = 0, voff = 0, n_qkv = 0, n_o = 0;
    if (c->layout == LAYOUT_CONTIG) {
        d->q_sb = H * Tq * D, d->q_sh = Tq * D, d->q_st = D;
        d->k_sb = Hk * Tk * D, d->k_sh = Tk * D, d->k_st = D;
        d->v_sb = d->k_sb, d->v_sh = d->k_sh, d->v_st = D;
        d->o_sb = d->q_sb, d->o_sh = d->q_sh, d->o_st = D;
        koff = B * H * Tq * D, voff = koff + B * Hk * Tk * D, n_qkv = voff + B * Hk * Tk * D;
        n_o = B * H * Tq * D;
    } else if (c->layout == LAYOUT_GAPPED) {
        const int64_t P = D + 3;
        d->q_st = H * P, d->q_sh = P, d->q_sb = Tq * H * P + 5;
        d->k_st = Hk * P, d->k_sh = P, d->k_sb = Tk * Hk * P + 5;
        d->v_st = d->k_st, d->v_sh = P, d->v_sb = d->k_sb;
        d->o_st = d->q_st, d->o_sh = P, d->o_sb = d->q_sb;
        koff = B * d->q_sb, voff = koff + B * d->k_sb, n_qkv = voff + B * d->k_sb;
        n_o = B * d->o_sb;
    } else { /* QKV: requires Tq == Tk */
        const int64_t T = Tq, W = C + 2 * Ck;
        d->q_st = d->k_st = d->v_st = W;
        d->q_sh = d->k_sh = d->v_sh = D;
        d->q_sb = d->k_sb = d->v_sb = T * W;
        d->o_st = C, d->o_sh = D, d->o_sb = T * C;
        koff = C, voff = C + Ck, n_qkv = B * T * W;
        n_o = B * T * C;
    }
    s->n_in = n_qkv;
    s->in = alloc_fill(n_qkv, 0.0f);
    for (int64_t i = 0; i < n_qkv; i++) s->in[i] = amp * urand();
    s->q = s->in, s->k = s->in + koff, s->v = s->in + voff;
    s->n_grad = n_qkv;
    s->grad = alloc_fill(n_qkv, SENTINEL);
    s->dq = s->grad, s->dk = s->grad + koff, s->dv = s->grad + voff;
    s->n_out = n_o;
    s->out = alloc_fill(n_o, SENTINEL);
    s->o = s->out;
    s->n_dout = n_o;
    s->dout_buf = alloc_fill(n_o, 0.0f);
    for (int64_t i = 0; i < n_o; i++) s->dout_buf[i] = urand();
    s->dout = s->dout_buf;
    s->lse = alloc_fill(B * H * Tq, SENTINEL);
    s->ro = calloc((size_t)(B * H * Tq * D + 1), sizeof(double));
    s->rlse = calloc((size_t)(B * H * Tq + 1), sizeof(double));
    s->rdq = calloc((size_t)(B * H * Tq * D + 1), sizeof(double));
    s->rdk = calloc((size_t)(B * Hk * Tk * D + 1), sizeof(double));
    s->rdv = calloc((size_t)(B * Hk * Tk * D + 1), sizeof(double));
}

static void bufs_free(attn_bufs *s) {
    free(s->in), free(s->out), free(s->grad), free(s->dout_buf), free(s->lse);
    free(s->ro), free(s->rlse), free(s->rdq), free(s->rdk), free(s->rdv);
}

static int64_t ref_visible(const anneal_cpu_attn_desc *d, int64_t i) {
    if (!d->causal) return d->Tk;
    int64_t n = i + d->Tk - d->Tq + 1;
    return n < 0 ? 0 : n > d->Tk ? d->Tk : n;
}

/* Naive double reference: full softmax rows; backward from the math
 * (dS = P * (dP - rowsum(P * dP))). Results in compact (B, H, T, D) for o, lse, dq and
 * (B, Hkv, T, D) for dk, dv (query head h uses key/value head h / (H / Hkv); dk, dv sum
 * over the query heads of a group). */
static void reference(attn_bufs *s) {
    const anneal_cpu_attn_desc *d = &s->d;
    const int64_t B = d->B, H = d->H, Tq = d->Tq, Tk = d->Tk, D = d->D, Hk = kv_heads(d);
    double *P = malloc(sizeof(double) * (size_t)(Tk + 1)),
           *dP = malloc(sizeof(double) * (size_t)(Tk + 1));
    memset(s->rdk, 0, sizeof(double) * (size_t)(B * Hk * Tk * D));
    memset(s->rdv, 0, sizeof(double) * (size_t)(B * Hk * Tk * D));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t hk = h / (H / Hk);
            const float *q = s->q + b * d->q_sb + h * d->q_sh,
                        *k = s->k + b * d->k_sb + hk * d->k_sh;
            const float *v = s->v + b * d->v_sb + hk * d->v_sh;
            const float *g = s->dout + b * d->o_sb + h * d->o_sh;
            const int64_t bh = b * H + h, bhk = b * Hk + hk;
            for (int64_t i = 0; i < Tq; i++) {
                const int64_t nv = ref_visible(d, i);
                double *ro = s->ro + (bh * Tq + i) * D, *rdq = s->rdq + (bh * Tq + i) * D;
                for (int64_t c = 0; c < D; c++) ro[c] = rdq[c] = 0.0;
                if (nv == 0) {
                    s->rlse[bh * Tq + i] = -INFINITY;
                    continue;
                }
                double mx = -INFINITY;
                for (int64_t j = 0; j < nv; j++) {
                    double acc = 0;
                    for (int64_t c = 0; c < D; c++)
                        acc += (double)q[i * d->q_st + c] * k[j * d->k_st + c];
                    P[j] = d->scale * acc;
                    if (P[j] > mx) mx = P[j];
                }
                double sum = 0;
                for (int64_t j = 0; j < nv; j++) sum += exp(P[j] - mx);
                const double lse = mx + log(sum);
                s->rlse[bh * Tq + i] = lse;
                for (int64_t j = 0; j < nv; j++) P[j] = exp(P[j] - lse);
                for (int64_t j = 0; j < nv; j++)
                    for (int64_t c = 0; c < D; c++) ro[c] += P[j] * v[j * d->v_st + c];
                double dsum = 0; /* sum_j P dP */
                for (int64_t j = 0; j < nv; j++) {
                    double acc = 0;
                    for (int64_t c = 0; c < D; c++)
                        acc += (double)g[i * d->o_st + c] * v[j * d->v_st + c];
                    dP[j] = acc;
                    dsum += P[j] * acc;
                }
                for (int64_t j = 0; j < nv; j++) {
                    const double ds = P[j] * (dP[j] - dsum);
                    double *rdk = s->rdk + (bhk * Tk + j) * D, *rdv = s->rdv + (bhk * Tk + j) * D;
                    for (int64_t c = 0; c < D; c++) {
                        rdq[c] += d->scale * ds * k[j * d->k_st + c];
                        rdk[c] += d->scale * ds * q[i * d->q_st + c];
                        rdv[c] += P[j] * g[i * d->o_st + c];
                    }
                }
            }
        }
    free(P), free(dP);
}

/* Copies the (B, H, T, D) view at base with strides into compact floats. */
static float *gather(const float *base, int64_t B, int64_t H, int64_t T, int64_t D, int64_t sb,
                     int64_t sh, int64_t st) {
    float *out = alloc_fill(B * H * T * D, 0.0f);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = 0; c < D; c++)
                    out[((b * H + h) * T + t) * D + c] = base[b * sb + h * sh + t * st + c];
    return out;
}

static float *to_float(const double *x, int64_t n) {
    float *out = alloc_fill(n, 0.0f);
    for (int64_t i = 0; i < n; i++) out[i] = (float)x[i];
    return out;
}

/* Number of elements of buf[0..n) outside the views that are no longer SENTINEL. View w
 * is at off[w] with T[w] rows, Hs[w] heads and (batch, head, time) strides str[w], over
 * d->B, D. */
static int64_t count_clobbered(const float *buf, int64_t n, const anneal_cpu_attn_desc *d,
                               int nviews, const int64_t *off, const int64_t *T,
                               const int64_t *Hs, const int64_t (*str)[3]) {
    char *in_view = calloc((size_t)n + 1, 1);
    for (int w = 0; w < nviews; w++)
        for (int64_t b = 0; b < d->B; b++)
            for (int64_t h = 0; h < Hs[w]; h++)
                for (int64_t t = 0; t < T[w]; t++)
                    for (int64_t c = 0; c < d->D; c++)
                        in_view[off[w] + b * str[w][0] + h * str[w][1] + t * str[w][2] + c] = 1;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!in_view[i] && buf[i] != SENTINEL) bad++;
    free(in_view);
    return bad;
}

/* Nothing outside the views of o and of dq, dk, dv was written. */
static void check_views_only(const attn_bufs *s) {
    const anneal_cpu_attn_desc *d = &s->d;
    const int64_t Tq = d->Tq, Tk = d->Tk;
    const int64_t oo[1] = {0}, oT[1] = {Tq}, oH[1] = {d->H};
    const int64_t os[1][3] = {{d->o_sb, d->o_sh, d->o_st}};
    const int64_t go[3] = {0, s->dk - s->grad, s->dv - s->grad}, gT[3] = {Tq, Tk, Tk};
    const int64_t gH[3] = {d->H, kv_heads(d), kv_heads(d)};
    const int64_t gs[3][3] = {
        {d->q_sb, d->q_sh, d->q_st}, {d->k_sb, d->k_sh, d->k_st}, {d->v_sb, d->v_sh, d->v_st}};
    CHECK(count_clobbered(s->out, s->n_out, d, 1, oo, oT, oH, os) == 0,
          "o written outside its view");
    CHECK(count_clobbered(s->grad, s->n_grad, d, 3, go, gT, gH, gs) == 0,
          "grads written outside views");
}

static void run_fwd(attn_bufs *s) {
    anneal_cpu_attention_fwd(&s->d, s->q, s->k, s->v, s->o, s->lse, s->compute);
}
static void run_bwd(attn_bufs *s) {
    anneal_cpu_attention_bwd(&s->d, s->q, s->k, s->v, s->o, s->dout, s->lse, s->dq, s->dk, s->dv,
                             s->compute);
}

/* Runs forward + backward of one case and compares everything with the reference.
 * Returns the number of failed checks (so grid loops can stop early). */
static int check_case(const attn_case *c, double fa, double fr, double ga, double gr) {
    const int before = anneal_test_failures;
    attn_bufs s;
    bufs_make(&s, c);
    const anneal_cpu_attn_desc *d = &s.d;
    const int64_t B = d->B, H = d->H, Tq = d->Tq, Tk = d->Tk, D = d->D, Hk = kv_heads(d);
    run_fwd(&s);
    run_bwd(&s);
    reference(&s);

    float *o = gather(s.o, B, H, Tq, D, d->o_sb, d->o_sh, d->o_st);
    float *dq = gather(s.dq, B, H, Tq, D, d->q_sb, d->q_sh, d->q_st);
    float *dk = gather(s.dk, B, Hk, Tk, D, d->k_sb, d->k_sh, d->k_st);
    float *dv = gather(s.dv, B, Hk, Tk, D, d->v_sb, d->v_sh, d->v_st);
    float *ro = to_float(s.ro, B * H * Tq * D), *rdq = to_float(s.rdq, B * H * Tq * D);
    float *rdk = to_float(s.rdk, B * Hk * Tk * D), *rdv = to_float(s.rdv, B * Hk * Tk * D);
    /* lse: -inf must match exactly, then compare the finite ones. */
    float *lse = alloc_fill(B * H * Tq, 0.0f), *rlse = alloc_fill(B * H * Tq, 0.0f);
    int64_t inf_mismatch = 0;
    for (int64_t i = 0; i < B * H * Tq; i++) {
        const bool ri = isinf(s.rlse[i]), ki = isinf(s.lse[i]) && s.lse[i] < 0;
        if (ri != ki) inf_mismatch++;
        lse[i] = ki ? 0.0f : s.lse[i];
        rlse[i] = ri ? 0.0f : (float)s.rlse[i];
    }
    CHECK(inf_mismatch == 0, "%lld lse rows disagree on -inf", (long long)inf_mismatch);
    CHECK_ALLCLOSE(o, ro, B * H * Tq * D, fa, fr);
    CHECK_ALLCLOSE(lse, rlse, B * H * Tq, fa, fr < 1e-5 ? fr : 1e-5);
    CHECK_ALLCLOSE(dq, rdq, B * H * Tq * D, ga, gr);
    CHECK_ALLCLOSE(dk, rdk, B * Hk * Tk * D, ga, gr);
    CHECK_ALLCLOSE(dv, rdv, B * Hk * Tk * D, ga, gr);

    /* Nothing outside the views is written. */
    check_views_only(&s);

    if (anneal_test_failures != before)
        fprintf(stderr,
                "    case: B=%lld H=%lld Hkv=%lld Tq=%lld Tk=%lld D=%lld causal=%d scale=%g "
                "layout=%d\n",
                (long long)B, (long long)H, (long long)Hk, (long long)Tq, (long long)Tk,
                (long long)D, c->causal, (double)d->scale, (int)c->layout);
    free(o), free(dq), free(dk), free(dv), free(ro), free(rdq), free(rdk), free(rdv);
    free(lse), free(rlse);
    bufs_free(&s);
    return anneal_test_failures - before;
}

#define FA 5e-6
#define FR 5e-5
#define GA 1e-5
#define GR 1e-4

/* ------------------------------------------------------------------- tests */

/* Contiguous (B, H, T, D), causal and not, Tq == Tk and Tq < Tk, T across tile edges. */
TEST(grid_contiguous) {
    static const int64_t T[][2] = {{1, 1},     {7, 7},  {63, 63}, {64, 64},  {65, 65},
                                   {130, 130}, {1, 37}, {5, 37},  {64, 130}, {1, 130}};
    static const int64_t Ds[] = {8, 16, 64};
    for (int causal = 0; causal < 2; causal++)
        for (size_t t = 0; t < sizeof T / sizeof T[0]; t++)
            for (size_t di = 0; di < 3; di++) {
                attn_case c = {2, 2, T[t][0], T[t][1], Ds[di], causal, 0, LAYOUT_CONTIG, 0, 0};
                if (check_case(&c, FA, FR, GA, GR)) return;
            }
}

/* Gapped strides (outputs must not touch the gaps), scale != 1/sqrt(D), odd D. */
TEST(gapped_layout_and_scale) {
    static const attn_case cases[] = {
        {2, 3, 65, 65, 16, true, 0.37f, LAYOUT_GAPPED, 0, 0},
        {2, 3, 5, 37, 8, true, 0.9f, LAYOUT_GAPPED, 0, 0},
        {1, 2, 70, 131, 64, false, 0.05f, LAYOUT_GAPPED, 0, 0},
        {1, 2, 33, 100, 37, true, 0.2f, LAYOUT_GAPPED, 0, 0},
        {1, 1, 20, 20, 1, true, 1.0f, LAYOUT_CONTIG, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (check_case(&cases[i], FA, FR, GA, GR)) return;
}

/* GPT-2's fused qkv: q, k, v interleaved in (B, T, 3C), grads likewise, o in (B, T, C). */
TEST(interleaved_qkv) {
    static const attn_case cases[] = {
        {2, 3, 65, 65, 16, true, 0, LAYOUT_QKV, 0, 0},
        {2, 3, 130, 130, 16, false, 0, LAYOUT_QKV, 0, 0},
        {1, 2, 130, 130, 64, true, 0, LAYOUT_QKV, 0, 0},
        {2, 4, 7, 7, 8, true, 0.6f, LAYOUT_QKV, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (check_case(&cases[i], FA, FR, GA, GR)) return;
}

/* Causal with Tq > Tk: the first Tq - Tk rows see no key: o = 0, lse = -inf, dq = 0
 * (checked through the reference, which defines them so). Tk = 0 likewise. */
TEST(rows_without_keys) {
    static const attn_case cases[] = {
        {2, 2, 9, 4, 8, true, 0, LAYOUT_CONTIG, 0, 0},
        {1, 2, 70, 3, 16, true, 0, LAYOUT_GAPPED, 0, 0},
        {1, 1, 130, 66, 64, true, 0, LAYOUT_CONTIG, 0, 0},
        {1, 2, 3, 0, 8, false, 0, LAYOUT_CONTIG, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (check_case(&cases[i], FA, FR, GA, GR)) return;
    /* Directly: those rows are exactly zero / -inf. */
    attn_bufs s;
    attn_case c = cases[0];
    bufs_make(&s, &c);
    run_fwd(&s);
    run_bwd(&s);
    for (int64_t bh = 0; bh < 4; bh++)
        for (int64_t i = 0; i < 5; i++) {
            CHECK(isinf(s.lse[bh * 9 + i]) && s.lse[bh * 9 + i] < 0, "lse row %lld", (long long)i);
            for (int64_t c2 = 0; c2 < 8; c2++) {
                CHECK_TRUE(s.o[(bh * 9 + i) * 8 + c2] == 0.0f);
                CHECK_TRUE(s.dq[(bh * 9 + i) * 8 + c2] == 0.0f);
            }
        }
    bufs_free(&s);
}

/* Scores up to ~60: the running max changes often and the online rescaling matters. */
TEST(large_logits) {
    static const attn_case cases[] = {
        {1, 2, 130, 130, 64, true, 0.5f, LAYOUT_CONTIG, 4.0f, 0},
        {1, 2, 65, 200, 16, false, 1.0f, LAYOUT_CONTIG, 3.0f, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (check_case(&cases[i], 1e-4, 1e-3, 1e-4, 1e-3)) return;
}

/* L = sum(o * R) with R = dout: central differences of L in q, k, v entries against
 * the analytic dq, dk, dv. stride picks every stride-th entry of each tensor. */
static void fd_check(const attn_case *c, int stride) {
    attn_bufs s;
    bufs_make(&s, c);
    const anneal_cpu_attn_desc *d = &s.d;
    run_fwd(&s);
    run_bwd(&s);
    float *g = malloc(sizeof(float) * (size_t)s.n_grad);
    memcpy(g, s.grad, sizeof(float) * (size_t)s.n_grad);
    const int64_t B = d->B, H = d->H, Tq = d->Tq, Tk = d->Tk, D = d->D;
    const float eps = 1e-3f;
    int64_t checked = 0, n = 0;
    double worst = 0;
    for (int w = 0; w < 3; w++) {
        const int64_t T = w == 0 ? Tq : Tk;
        const float *base = w == 0 ? s.q : w == 1 ? s.k : s.v;
        const int64_t sb = w == 0 ? d->q_sb : w == 1 ? d->k_sb : d->v_sb;
        const int64_t sh = w == 0 ? d->q_sh : w == 1 ? d->k_sh : d->v_sh;
        const int64_t st = w == 0 ? d->q_st : w == 1 ? d->k_st : d->v_st;
        const int64_t Hw = w == 0 ? H : kv_heads(d);
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hw; h++)
                for (int64_t t = 0; t < T; t++)
                    for (int64_t cc = 0; cc < D; cc++, n++) {
                        if (n % stride) continue;
                        const int64_t idx = (base - s.in) + b * sb + h * sh + t * st + cc;
                        const float x0 = s.in[idx], xp = x0 + eps, xm = x0 - eps;
                        double L[2];
                        for (int side = 0; side < 2; side++) {
                            s.in[idx] = side ? xm : xp;
                            run_fwd(&s);
                            double acc = 0;
                            for (int64_t bb = 0; bb < B; bb++)
                                for (int64_t hh = 0; hh < H; hh++)
                                    for (int64_t i = 0; i < Tq; i++)
                                        for (int64_t e = 0; e < D; e++) {
                                            const int64_t oi =
                                                bb * d->o_sb + hh * d->o_sh + i * d->o_st + e;
                                            acc += (double)s.o[oi] * s.dout[oi];
                                        }
                            L[side] = acc;
                        }
                        s.in[idx] = x0;
                        const double fd = (L[0] - L[1]) / ((double)xp - (double)xm);
                        const double an = g[idx - 0]; /* grad buffer mirrors the input layout */
                        const double err = fabs(fd - an) / (5e-4 + 5e-3 * fabs(an));
                        if (err > worst) worst = err;
                        CHECK(err <= 1.0,
                              "tensor %d b%lld h%lld t%lld c%lld: fd %.6g vs analytic %.6g", w,
                              (long long)b, (long long)h, (long long)t, (long long)cc, fd, an);
                        checked++;
                        if (anneal_test_failures > 5) goto done;
                    }
    }
done:
    CHECK(checked > 100, "only %lld entries checked", (long long)checked);
    free(g);
    bufs_free(&s);
}

TEST(finite_differences) {
    const attn_case small = {1, 2, 5, 11, 8, true, 0.7f, LAYOUT_CONTIG, 0, 0};
    fd_check(&small, 1);
    const attn_case tiles = {1, 1, 70, 70, 8, true, 0, LAYOUT_QKV, 0, 0};
    fd_check(&tiles, 7);
}

/* Two runs give identical bits, and so do 1, 2 and 3 threads. */
TEST(determinism) {
    static const attn_case cases[] = {
        {2, 3, 130, 130, 64, true, 0, LAYOUT_QKV, 0, 0},
        {1, 3, 5, 37, 16, true, 0, LAYOUT_CONTIG, 0, 0},
    };
    const int saved = omp_get_max_threads();
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        attn_bufs s;
        bufs_make(&s, &cases[ci]);
        const int64_t nlse = s.d.B * s.d.H * s.d.Tq;
        float *o0 = NULL, *l0 = NULL, *g0 = NULL;
        static const int threads[] = {2, 2, 1, 3};
        for (int r = 0; r < 4; r++) {
            omp_set_num_threads(threads[r]);
            for (int64_t i = 0; i < s.n_grad; i++) s.grad[i] = SENTINEL;
            run_fwd(&s);
            run_bwd(&s);
            if (r == 0) {
                o0 = malloc(sizeof(float) * (size_t)s.n_out);
                l0 = malloc(sizeof(float) * (size_t)nlse);
                g0 = malloc(sizeof(float) * (size_t)s.n_grad);
                memcpy(o0, s.out, sizeof(float) * (size_t)s.n_out);
                memcpy(l0, s.lse, sizeof(float) * (size_t)nlse);
                memcpy(g0, s.grad, sizeof(float) * (size_t)s.n_grad);
                continue;
            }
            CHECK(memcmp(o0, s.out, sizeof(float) * (size_t)s.n_out) == 0,
                  "o differs (run %d, %d threads)", r, threads[r]);
            CHECK(memcmp(l0, s.lse, sizeof(float) * (size_t)nlse) == 0, "lse differs (run %d)", r);
            CHECK(memcmp(g0, s.grad, sizeof(float) * (size_t)s.n_grad) == 0,
                  "grads differ (run %d)", r);
        }
        free(o0), free(l0), free(g0);
        bufs_free(&s);
    }
    omp_set_num_threads(saved);
}

/* The portable C path, forced through ANNEAL_CPU_ISA, against the same reference. */
TEST(portable_path) {
    setenv("ANNEAL_CPU_ISA", "portable", 1);
    static const attn_case cases[] = {
        {2, 2, 130, 130, 64, true, 0, LAYOUT_CONTIG, 0, 0},
        {2, 2, 5, 37, 8, true, 0, LAYOUT_CONTIG, 0, 0},
        {2, 3, 65, 65, 16, false, 0, LAYOUT_QKV, 0, 0},
        {1, 2, 70, 3, 16, true, 0.3f, LAYOUT_GAPPED, 0, 0},
        {1, 2, 1, 63, 37, true, 0, LAYOUT_GAPPED, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (check_case(&cases[i], FA, FR, GA, GR)) break;
    unsetenv("ANNEAL_CPU_ISA");
}

/* ------------------------------------------------------------------ bf16 path
 *
 * compute = ANNEAL_BF16 (attention_bf16.c): every tile product takes bf16-rounded
 * operands and accumulates in f32; the probabilities P (forward: relative to the running
 * max of their key tile, before normalisation; backward: normalised) and dS are rounded
 * to bf16 inside the kernel. Reference: the double-precision attention of r(q), r(k),
 * r(v), r(dout) (r = round to nearest even bf16), without rounding P or dS. With
 * u = 2^-8 (bf16 has 8 significand bits; |r(x) - x| <= u |x|) and P, A the reference's
 * probabilities and A_ic = sum_j P_ij |r(v)_jc|, the kernel's errors are bounded by
 *   o_ic:   u A_ic                   (o = sum_j P_ij (1 + d_j) r(v)_jc with |d_j| <= u: each
 *                                     rounded probability is off by at most u relative;
 *                                     the online rescaling and l are f32)
 *   lse:    none beyond f32          (l sums the unrounded p; q, k are rounded as in the
 *                                     reference, so lse is checked at the f32 tolerance)
 *   Dvec_i = dO_i . o_i uses the f32 dO and the kernel's o: off from the reference's
 *           r(dO)_i . o_i by E_i = 2u(1+u) sum_c |dO_ic| A_ic,
 *   so r(dS_ij) is off by F_ij = u |dS_ij| + (1+u) P_ij E_i, and
 *   dv_jc:  u sum_i P_ij |r(dO)_ic|      dq_ic: scale sum_j F_ij |r(k)_jc|
 *   dk_jc:  scale sum_i F_ij |r(q)_ic|
 * plus the f32 kernel's own tolerances (FA/FR, GA/GR above) for the f32 arithmetic.
 * These are worst-case (all roundings aligned); the observed errors are a fraction of
 * them (printed as "worst ratio"). */
#define U_BF16 0.00390625 /* 2^-8 */

static double rb(float x) { return (double)anneal_gemm_round_bf16(x); }

/* Double reference of the rounded inputs (into s->ro, rlse, rdq, rdk, rdv, compact) and
 * the bounds above (bo, bdq, bdk, bdv, compact like the references). */
static void reference_bf16(attn_bufs *s, double *bo, double *bdq, double *bdk, double *bdv) {
    const anneal_cpu_attn_desc *d = &s->d;
    const int64_t B = d->B, H = d->H, Tq = d->Tq, Tk = d->Tk, D = d->D, Hk = kv_heads(d);
    const double u = U_BF16, sc = d->scale;
    /* the rounded inputs, in the layouts of s->in and s->dout */
    double *inr = malloc(sizeof(double) * (size_t)(s->n_in + 1)),
           *gr_all = malloc(sizeof(double) * (size_t)(s->n_dout + 1));
    for (int64_t i = 0; i < s->n_in; i++) inr[i] = rb(s->in[i]);
    for (int64_t i = 0; i < s->n_dout; i++) gr_all[i] = rb(s->dout[i]);
    double *P = malloc(sizeof(double) * (size_t)(Tk + 1)),
           *dP = malloc(sizeof(double) * (size_t)(Tk + 1)),
           *A = malloc(sizeof(double) * (size_t)(D + 1));
    memset(s->rdk, 0, sizeof(double) * (size_t)(B * Hk * Tk * D));
    memset(s->rdv, 0, sizeof(double) * (size_t)(B * Hk * Tk * D));
    memset(bdk, 0, sizeof(double) * (size_t)(B * Hk * Tk * D));
    memset(bdv, 0, sizeof(double) * (size_t)(B * Hk * Tk * D));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t hk = h / (H / Hk);
            const float *q = s->q + b * d->q_sb + h * d->q_sh,
                        *k = s->k + b * d->k_sb + hk * d->k_sh;
            const float *v = s->v + b * d->v_sb + hk * d->v_sh;
            const float *g = s->dout + b * d->o_sb + h * d->o_sh;
            const double *qR = inr + (q - s->in), *kR = inr + (k - s->in), *vR = inr + (v - s->in);
            const double *gR = gr_all + (g - s->dout);
            const int64_t bh = b * H + h, bhk = b * Hk + hk;
            for (int64_t i = 0; i < Tq; i++) {
                const int64_t nv = ref_visible(d, i), r = bh * Tq + i;
                double *ro = s->ro + r * D, *rdq = s->rdq + r * D;
                double *bo_i = bo + r * D, *bdq_i = bdq + r * D;
                for (int64_t c = 0; c < D; c++) ro[c] = rdq[c] = bo_i[c] = bdq_i[c] = A[c] = 0.0;
                if (nv == 0) {
                    s->rlse[r] = -INFINITY;
                    continue;
                }
                double mx = -INFINITY;
                for (int64_t j = 0; j < nv; j++) {
                    double acc = 0;
                    for (int64_t c = 0; c < D; c++)
                        acc += qR[i * d->q_st + c] * kR[j * d->k_st + c];
                    P[j] = sc * acc;
                    if (P[j] > mx) mx = P[j];
                }
                double sum = 0;
                for (int64_t j = 0; j < nv; j++) sum += exp(P[j] - mx);
                const double lse = mx + log(sum);
                s->rlse[r] = lse;
                for (int64_t j = 0; j < nv; j++) P[j] = exp(P[j] - lse);
                for (int64_t j = 0; j < nv; j++)
                    for (int64_t c = 0; c < D; c++) {
                        const double vr = vR[j * d->v_st + c];
                        ro[c] += P[j] * vr;
                        A[c] += P[j] * fabs(vr);
                    }
                double dsum = 0, E = 0; /* sum_j P dP; the Dvec error bound */
                for (int64_t c = 0; c < D; c++) {
                    bo_i[c] = u * A[c];
                    E += fabs(g[i * d->o_st + c]) * A[c];
                }
                E *= 2 * u * (1 + u);
                for (int64_t j = 0; j < nv; j++) {
                    double acc = 0;
                    for (int64_t c = 0; c < D; c++)
                        acc += gR[i * d->o_st + c] * vR[j * d->v_st + c];
                    dP[j] = acc;
                    dsum += P[j] * acc;
                }
                for (int64_t j = 0; j < nv; j++) {
                    const double ds = P[j] * (dP[j] - dsum), F = u * fabs(ds) + (1 + u) * P[j] * E;
                    double *rdk = s->rdk + (bhk * Tk + j) * D, *rdv = s->rdv + (bhk * Tk + j) * D;
                    double *bdk_j = bdk + (bhk * Tk + j) * D, *bdv_j = bdv + (bhk * Tk + j) * D;
                    for (int64_t c = 0; c < D; c++) {
                        const double kr = kR[j * d->k_st + c], qr = qR[i * d->q_st + c];
                        const double gr = gR[i * d->o_st + c];
                        rdq[c] += sc * ds * kr;
                        rdk[c] += sc * ds * qr;
                        rdv[c] += P[j] * gr;
                        bdq_i[c] += sc * F * fabs(kr);
                        bdk_j[c] += sc * F * fabs(qr);
                        bdv_j[c] += u * P[j] * fabs(gr);
                    }
                }
            }
        }
    free(P), free(dP), free(A), free(inr), free(gr_all);
}

/* |got - ref| <= bound + fa + fr |ref| for all n; returns the worst |got - ref| / (that). */
static double check_bounded(const char *what, const float *got, const double *ref,
                            const double *bound, int64_t n, double fa, double fr) {
    double worst = 0;
    int64_t wi = -1;
    for (int64_t i = 0; i < n; i++) {
        const double t = bound[i] + fa + fr * fabs(ref[i]);
        const double e = fabs((double)got[i] - ref[i]) / t;
        if (!(e <= worst)) worst = e, wi = i; /* NaN counts as worst */
    }
    CHECK(!(worst > 1.0), "%s: index %lld: %.9g vs reference %.9g (bound %.3g + %.2g + %.2g rel)",
          what, (long long)wi, wi >= 0 ? got[wi] : 0.0, wi >= 0 ? ref[wi] : 0.0,
          wi >= 0 ? bound[wi] : 0.0, fa, fr);
    return worst;
}

/* Normwise ||a - b|| / ||b|| in double. */
static double relnorm(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double e = (double)a[i] - (double)b[i];
        num += e * e;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The outputs of one run, gathered compact: o, lse, dq, dk, dv. */
typedef struct {
    float *o, *lse, *dq, *dk, *dv;
    int64_t no, nl, nq, nk;
} attn_out;

static void out_take(attn_out *r, const attn_bufs *s) {
    const anneal_cpu_attn_desc *d = &s->d;
    const int64_t B = d->B, H = d->H, Tq = d->Tq, Tk = d->Tk, D = d->D, Hk = kv_heads(d);
    r->no = r->nq = B * H * Tq * D, r->nk = B * Hk * Tk * D, r->nl = B * H * Tq;
    r->o = gather(s->o, B, H, Tq, D, d->o_sb, d->o_sh, d->o_st);
    r->dq = gather(s->dq, B, H, Tq, D, d->q_sb, d->q_sh, d->q_st);
    r->dk = gather(s->dk, B, Hk, Tk, D, d->k_sb, d->k_sh, d->k_st);
    r->dv = gather(s->dv, B, Hk, Tk, D, d->v_sb, d->v_sh, d->v_st);
    r->lse = alloc_fill(r->nl, 0.0f);
    memcpy(r->lse, s->lse, sizeof(float) * (size_t)r->nl);
}
static void out_free(attn_out *r) {
    free(r->o), free(r->lse), free(r->dq), free(r->dk), free(r->dv);
}

/* Forward + backward of c at compute, with ANNEAL_CPU_ISA = isa (NULL: unset). */
static void seed_case(const attn_case *c) {
    rng_state = 0x9E3779B97F4A7C15ull ^ (uint64_t)(c->Tq * 131 + c->Tk * 7 + c->D);
}

static void run_case(const attn_case *c, int compute, const char *isa, attn_out *r) {
    seed_case(c);
    if (isa) setenv("ANNEAL_CPU_ISA", isa, 1);
    attn_bufs s;
    bufs_make(&s, c);
    s.compute = compute;
    run_fwd(&s);
    run_bwd(&s);
    out_take(r, &s);
    bufs_free(&s);
    if (isa) unsetenv("ANNEAL_CPU_ISA");
}

/* The bf16 kernel (with ANNEAL_CPU_ISA = isa) against the rounded reference within the
 * bounds above; nothing outside the views written; -inf rows of lse kept. Returns the
 * number of failed checks. */
static int check_bf16_case(const attn_case *c, const char *isa, double fa, double fr, double ga,
                           double gr) {
    const int before = anneal_test_failures;
    seed_case(c);
    if (isa) setenv("ANNEAL_CPU_ISA", isa, 1);
    attn_bufs s;
    bufs_make(&s, c);
    s.compute = ANNEAL_BF16;
    const anneal_cpu_attn_desc *d = &s.d;
    const int64_t B = d->B, H = d->H, Tq = d->Tq, Tk = d->Tk, D = d->D, Hk = kv_heads(d);
    run_fwd(&s);
    run_bwd(&s);
    if (isa) unsetenv("ANNEAL_CPU_ISA");
    double *bo = calloc((size_t)(B * H * Tq * D + 1), sizeof(double));
    double *bdq = calloc((size_t)(B * H * Tq * D + 1), sizeof(double));
    double *bdk = calloc((size_t)(B * Hk * Tk * D + 1), sizeof(double));
    double *bdv = calloc((size_t)(B * Hk * Tk * D + 1), sizeof(double));
    double *zero = calloc((size_t)(B * H * Tq + 1), sizeof(double));
    reference_bf16(&s, bo, bdq, bdk, bdv);
    attn_out r;
    out_take(&r, &s);
    int64_t inf_mismatch = 0;
    double *rl = calloc((size_t)(B * H * Tq + 1), sizeof(double));
    for (int64_t i = 0; i < r.nl; i++) {
        const bool ri = isinf(s.rlse[i]), ki = isinf(r.lse[i]) && r.lse[i] < 0;
        if (ri != ki) inf_mismatch++;
        if (ki) r.lse[i] = 0.0f;
        rl[i] = ri ? 0.0 : s.rlse[i];
    }
    CHECK(inf_mismatch == 0, "%lld lse rows disagree on -inf", (long long)inf_mismatch);
    double w[5];
    w[0] = check_bounded("o", r.o, s.ro, bo, r.no, fa, fr);
    w[1] = check_bounded("lse", r.lse, rl, zero, r.nl, fa, fr < 1e-5 ? fr : 1e-5);
    w[2] = check_bounded("dq", r.dq, s.rdq, bdq, r.nq, ga, gr);
    w[3] = check_bounded("dk", r.dk, s.rdk, bdk, r.nk, ga, gr);
    w[4] = check_bounded("dv", r.dv, s.rdv, bdv, r.nk, ga, gr);
    check_views_only(&s);
    printf("    bf16 %s B=%lld H=%lld Tq=%lld Tk=%lld D=%lld causal=%d layout=%d%s: worst ratio "
           "o %.2f lse %.2f dq %.2f dk %.2f dv %.2f\n",
           isa ? isa : "auto", (long long)B, (long long)H, (long long)Tq, (long long)Tk,
           (long long)D, c->causal, (int)c->layout, Hk != H ? " (GQA)" : "", w[0], w[1], w[2],
           w[3], w[4]);
    out_free(&r);
    free(bo), free(bdq), free(bdk), free(bdv), free(zero), free(rl);
    bufs_free(&s);
    return anneal_test_failures - before;
}

static const attn_case bf16_cases[] = {
    {2, 2, 1, 1, 8, true, 0, LAYOUT_CONTIG, 0, 0},
    {2, 2, 63, 63, 64, true, 0, LAYOUT_CONTIG, 0, 0},
    {2, 2, 130, 130, 64, true, 0, LAYOUT_CONTIG, 0, 0},
    {2, 2, 130, 130, 64, false, 0, LAYOUT_CONTIG, 0, 0},
    {2, 2, 5, 37, 16, true, 0, LAYOUT_CONTIG, 0, 0},
    {1, 2, 64, 130, 64, false, 0, LAYOUT_CONTIG, 0, 0},
    {2, 3, 65, 65, 16, true, 0.37f, LAYOUT_GAPPED, 0, 0},
    {1, 2, 70, 131, 64, false, 0.05f, LAYOUT_GAPPED, 0, 0},
    {1, 2, 33, 100, 37, true, 0.2f, LAYOUT_GAPPED, 0, 0},
    {1, 1, 20, 20, 1, true, 1.0f, LAYOUT_CONTIG, 0, 0},
    {2, 3, 130, 130, 16, false, 0, LAYOUT_QKV, 0, 0},
    {1, 2, 130, 130, 64, true, 0, LAYOUT_QKV, 0, 0},
    {2, 2, 9, 4, 8, true, 0, LAYOUT_CONTIG, 0, 0},
    {1, 2, 70, 3, 16, true, 0, LAYOUT_GAPPED, 0, 0},
    {1, 2, 3, 0, 8, false, 0, LAYOUT_CONTIG, 0, 0},
    {1, 2, 131, 67, 33, true, 0, LAYOUT_GAPPED, 0, 0},
};
#define NB16 (sizeof bf16_cases / sizeof bf16_cases[0])

/* Under ASan (slow) the fallback and comparison tests take every third case. */
static size_t case_step(void) { return anneal_test_sanitized() ? 3 : 1; }

/* The bf16 kernel (the AVX512-BF16 one where the CPU has it: ANNEAL_ISA=avx512bf16 forces it
 * also where the default dispatch prefers the fallback, as on Intel cores) within the bounds
 * above: causal and not, T across tile edges, Tq != Tk, rows without keys, strided views;
 * and the default dispatch. */
TEST(bf16_against_rounded_reference) {
    printf("  AVX512-BF16 %s\n", anneal_cpu_has_avx512bf16()
                                      ? "available: the fast path is checked"
                                      : "not available: the fallback runs");
    for (size_t i = 0; i < NB16; i++)
        if (check_bf16_case(&bf16_cases[i], "avx512bf16", FA, FR, GA, GR)) return;
    for (size_t i = 0; i < NB16; i += 2 * case_step())
        if (check_bf16_case(&bf16_cases[i], NULL, FA, FR, GA, GR)) return;
    static const attn_case large[] = {
        {1, 2, 130, 130, 64, true, 0.5f, LAYOUT_CONTIG, 4.0f, 0},
        {1, 2, 65, 200, 16, false, 1.0f, LAYOUT_CONTIG, 3.0f, 0},
    };
    for (size_t i = 0; i < 2; i++)
        if (check_bf16_case(&large[i], "avx512bf16", 1e-4, 1e-3, 1e-4, 1e-3)) return;
}

/* The fallback (bf16-rounded operands on the f32 tiles: AVX-512 ones with
 * ANNEAL_ISA=avx512, portable C with portable) meets the same bounds. */
TEST(bf16_fallback_against_rounded_reference) {
    static const char *isas[] = {"avx512", "portable"};
    for (int t = 0; t < 2; t++)
        for (size_t i = 0; i < NB16; i += (1 + t) * case_step()) /* portable: every other case */
            if (check_bf16_case(&bf16_cases[i], isas[t], FA, FR, GA, GR)) return;
}

/* The AVX512-BF16 kernel against the fallbacks. They round the same operands to the same
 * bf16 values and differ only in the order of the f32 sums inside a tile product (a few
 * f32 ulps, ~1e-7 relative), so a probability or dS rounds to a different bf16 value only
 * when it lies within ~1e-6 relative of a rounding boundary (probability ~1e-6 / 2^-8 ~
 * 3e-4 per element), moving by one bf16 spacing (2u). Normwise that is ~sqrt(3e-4) 2u ~
 * u/30; asserted: <= u/8 for o, dq, dk, dv (a bf16 mistake on either side, e.g. a
 * missing or extra rounding, is ~u/2 or more); lse, whose rounded operands and f32
 * arithmetic agree, at the f32 tolerance. */
TEST(bf16_fast_path_matches_fallback) {
    if (!anneal_cpu_has_avx512bf16())
        SKIP("this CPU has no AVX512-BF16 (avx512_bf16 in /proc/cpuinfo): the fast path cannot run, "
             "both sides would be the fallback");
    static const char *isas[] = {"avx512", "portable"};
    double worst = 0;
    for (size_t i = 0; i < NB16; i += case_step())
        for (int t = 0; t < 2; t++) {
            attn_out a, b;
            run_case(&bf16_cases[i], ANNEAL_BF16, "avx512bf16", &a);
            run_case(&bf16_cases[i], ANNEAL_BF16, isas[t], &b);
            const double e[4] = {relnorm(a.o, b.o, a.no), relnorm(a.dq, b.dq, a.nq),
                                 relnorm(a.dk, b.dk, a.nk), relnorm(a.dv, b.dv, a.nk)};
            for (int j = 0; j < 4; j++) {
                CHECK(e[j] <= U_BF16 / 8,
                      "case %zu vs %s: output %d (o, dq, dk, dv) normwise %.3g > u/8", i, isas[t], j,
                      e[j]);
                if (e[j] > worst) worst = e[j];
            }
            for (int64_t l = 0; l < a.nl; l++) {
                const double dl = fabs((double)a.lse[l] - b.lse[l]);
                const bool same = a.lse[l] == b.lse[l] || dl <= FA + 1e-5 * fabs((double)b.lse[l]);
                if (!same) {
                    CHECK(same, "case %zu vs %s: lse[%lld] %.9g vs %.9g", i, isas[t], (long long)l,
                          a.lse[l], b.lse[l]);
                    break;
                }
            }
            out_free(&a), out_free(&b);
        }
    printf("  fast vs fallback: worst normwise difference %.3g u\n", worst / U_BF16);
}

/* The bf16 results against the f32 ones (the unrounded attention): their normwise
 * distance must be bf16 rounding, between u/16 and 4u. Lower end (negative control): the
 * bf16 path is taken (f32 rounding alone would be ~1e-7 = u/40000). Upper end: each
 * tile product rounds its two operands (<= u relative each), P and dS are rounded once
 * more, and these independent errors add in quadrature along the 2-3 products between
 * an input and an output, with the softmax and dP - Dvec (cancellation) amplifying them
 * a little: a few u at most; a product computed in bf16 arithmetic instead of f32
 * accumulation (~sqrt(K) u), or a wrong operand rounded (f32-sized error in lse), falls
 * outside. Also: f16 precision gives exactly the f32 bits (f16 attention is f32). */
TEST(bf16_versus_f32_and_f16_is_f32) {
    static const attn_case cases[] = {
        {2, 2, 130, 130, 64, true, 0, LAYOUT_QKV, 0, 0},
        {1, 3, 70, 131, 16, false, 0.3f, LAYOUT_GAPPED, 0, 0},
        {2, 2, 5, 37, 64, true, 0, LAYOUT_CONTIG, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        attn_out f, h, b;
        run_case(&cases[i], ANNEAL_F32, NULL, &f);
        run_case(&cases[i], ANNEAL_F16, NULL, &h);
        run_case(&cases[i], ANNEAL_BF16, NULL, &b);
        CHECK(memcmp(f.o, h.o, sizeof(float) * (size_t)f.no) == 0, "f16 o differs from f32");
        CHECK(memcmp(f.lse, h.lse, sizeof(float) * (size_t)f.nl) == 0, "f16 lse differs from f32");
        CHECK(memcmp(f.dq, h.dq, sizeof(float) * (size_t)f.nq) == 0, "f16 dq differs from f32");
        CHECK(memcmp(f.dk, h.dk, sizeof(float) * (size_t)f.nk) == 0, "f16 dk differs from f32");
        CHECK(memcmp(f.dv, h.dv, sizeof(float) * (size_t)f.nk) == 0, "f16 dv differs from f32");
        const double e[4] = {relnorm(b.o, f.o, f.no), relnorm(b.dq, f.dq, f.nq),
                             relnorm(b.dk, f.dk, f.nk), relnorm(b.dv, f.dv, f.nk)};
        for (int j = 0; j < 4; j++)
            CHECK(e[j] >= U_BF16 / 16 && e[j] <= 4 * U_BF16,
                  "case %zu: output %d (o, dq, dk, dv): bf16 vs f32 normwise %.3g u, outside "
                  "[1/16, 4] u",
                  i, j, e[j] / U_BF16);
        printf("  case %zu: bf16 vs f32 normwise o %.3g u, dq %.3g u, dk %.3g u, dv %.3g u, "
               "lse %.3g u\n",
               i, e[0] / U_BF16, e[1] / U_BF16, e[2] / U_BF16, e[3] / U_BF16,
               relnorm(b.lse, f.lse, f.nl) / U_BF16);
        out_free(&f), out_free(&h), out_free(&b);
    }
}

/* bf16 results are bit-identical across runs and 1, 2, 3 threads, on both kernels. */
TEST(bf16_determinism) {
    static const attn_case c = {2, 3, 130, 130, 64, true, 0, LAYOUT_QKV, 0, 0};
    static const char *isas[] = {NULL, "avx512"};
    const int saved = omp_get_max_threads();
    for (int t = 0; t < 2; t++) {
        attn_out r0 = {0};
        static const int threads[] = {2, 2, 1, 3};
        for (int r = 0; r < 4; r++) {
            omp_set_num_threads(threads[r]);
            attn_out x;
            run_case(&c, ANNEAL_BF16, isas[t], &x);
            if (r == 0) {
                r0 = x;
                continue;
            }
            CHECK(memcmp(r0.o, x.o, sizeof(float) * (size_t)x.no) == 0 &&
                      memcmp(r0.lse, x.lse, sizeof(float) * (size_t)x.nl) == 0 &&
                      memcmp(r0.dq, x.dq, sizeof(float) * (size_t)x.nq) == 0 &&
                      memcmp(r0.dk, x.dk, sizeof(float) * (size_t)x.nk) == 0 &&
                      memcmp(r0.dv, x.dv, sizeof(float) * (size_t)x.nk) == 0,
                  "bf16 (%s) results differ on run %d (%d threads)", isas[t] ? isas[t] : "auto", r,
                  threads[r]);
            out_free(&x);
        }
        out_free(&r0);
    }
    omp_set_num_threads(saved);
}

/* ------------------------------------------------------ grouped-query attention
 *
 * q and o have H heads, k and v Hkv (H a multiple of Hkv; Hkv == 1 is multi-query); query
 * head h reads key/value head h / (H / Hkv), and dk, dv of a key/value head are the sums
 * over the query heads of its group. The reference does the same in double, so the
 * tolerances are those of multi-head attention (per dk/dv element the sum has G times the
 * terms; the observed errors stay far inside). */
static const attn_case gqa_cases[] = {
    {2, 4, 70, 70, 16, true, 0, LAYOUT_CONTIG, 0, 2},
    {2, 4, 70, 70, 16, false, 0, LAYOUT_CONTIG, 0, 1},
    {1, 6, 65, 65, 8, true, 0, LAYOUT_QKV, 0, 3},
    {2, 4, 77, 150, 16, true, 0, LAYOUT_GAPPED, 0, 2}, /* KV-cache shape: Tk - Tq = 73 */
    {1, 6, 5, 37, 37, true, 0.3f, LAYOUT_GAPPED, 0, 3},
    {1, 4, 9, 4, 8, true, 0, LAYOUT_CONTIG, 0, 1}, /* the first rows see no key */
    {1, 6, 130, 130, 64, true, 0, LAYOUT_QKV, 0, 2},
    {1, 4, 64, 200, 32, false, 0.2f, LAYOUT_GAPPED, 0, 1},
};
#define NGQA (sizeof gqa_cases / sizeof gqa_cases[0])

/* The f32 kernel with grouped heads against the double reference: causal and not,
 * Tq != Tk, strided views, on the AVX-512 tiles (where the CPU has them) and portable C
 * (the f32 attention has no AVX2 flavour: below avx512 it is portable C). */
TEST(gqa_against_reference) {
    static const char *isas[] = {NULL, "portable"};
    for (int t = 0; t < 2; t++) {
        if (isas[t]) setenv("ANNEAL_CPU_ISA", isas[t], 1);
        for (size_t i = 0; i < NGQA; i++)
            if (check_case(&gqa_cases[i], FA, FR, GA, GR)) break;
        if (isas[t]) unsetenv("ANNEAL_CPU_ISA");
    }
}

/* The bf16 kernels with grouped heads against the rounded reference, within the bounds of
 * the bf16 tests below (derived there; a dk or dv bound sums its group's terms): the
 * AVX512-BF16 kernel (where the CPU has it), and the fallback on AVX-512 and portable tiles. */
TEST(gqa_bf16_against_rounded_reference) {
    static const char *isas[] = {"avx512bf16", "avx512", "portable"};
    for (int t = 0; t < 3; t++)
        for (size_t i = 0; i < NGQA; i += case_step())
            if (check_bf16_case(&gqa_cases[i], isas[t], FA, FR, GA, GR)) return;
}

/* Grouped heads compute each query head exactly as multi-head attention does on k and v
 * with every key/value head repeated for its group: o, lse and dq are bit-identical to
 * that, and dk, dv equal the sums over the group of the repeated run's gradients up to the
 * order of the f32 additions (the kernel accumulates the group in one buffer). Every
 * precision and ISA. */
TEST(gqa_equals_repeated_heads) {
    static const attn_case cases[] = {
        {2, 4, 70, 70, 16, true, 0, LAYOUT_CONTIG, 0, 2},
        {1, 6, 77, 150, 24, true, 0, LAYOUT_CONTIG, 0, 3},
        {2, 3, 33, 33, 8, false, 0, LAYOUT_CONTIG, 0, 1},
    };
    static const struct { int compute; const char *isa; } runs[] = {
        {ANNEAL_F32, NULL}, {ANNEAL_F32, "portable"}, {ANNEAL_BF16, NULL}, {ANNEAL_BF16, "avx512bf16"},
        {ANNEAL_BF16, "avx512"}, {ANNEAL_BF16, "portable"}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
            const attn_case *c = &cases[ci];
            attn_case cm = *c;
            cm.Hkv = 0;
            attn_bufs g, m;
            bufs_make(&g, c);
            bufs_make(&m, &cm);
            const int64_t B = c->B, H = c->H, G = c->H / c->Hkv, Tq = c->Tq, Tk = c->Tk, D = c->D;
            /* the same q and dout; k, v with key/value head h / G repeated (all contiguous) */
            memcpy((float *)m.q, g.q, sizeof(float) * (size_t)(B * H * Tq * D));
            memcpy(m.dout, g.dout, sizeof(float) * (size_t)(B * H * Tq * D));
            for (int64_t b = 0; b < B; b++)
                for (int64_t h = 0; h < H; h++) {
                    const int64_t src = (b * c->Hkv + h / G) * Tk * D, dst = (b * H + h) * Tk * D;
                    memcpy((float *)m.k + dst, g.k + src, sizeof(float) * (size_t)(Tk * D));
                    memcpy((float *)m.v + dst, g.v + src, sizeof(float) * (size_t)(Tk * D));
                }
            g.compute = m.compute = runs[r].compute;
            if (runs[r].isa) setenv("ANNEAL_CPU_ISA", runs[r].isa, 1);
            run_fwd(&g), run_bwd(&g), run_fwd(&m), run_bwd(&m);
            if (runs[r].isa) unsetenv("ANNEAL_CPU_ISA");
            const size_t nq = (size_t)(B * H * Tq * D), nl = (size_t)(B * H * Tq);
            CHECK(memcmp(g.o, m.o, sizeof(float) * nq) == 0, "case %zu run %zu: o differs", ci, r);
            CHECK(memcmp(g.lse, m.lse, sizeof(float) * nl) == 0, "case %zu run %zu: lse", ci, r);
            CHECK(memcmp(g.dq, m.dq, sizeof(float) * nq) == 0, "case %zu run %zu: dq", ci, r);
            const int64_t nk = B * c->Hkv * Tk * D;
            float *sk = alloc_fill(nk, 0.0f), *sv = alloc_fill(nk, 0.0f);
            for (int64_t b = 0; b < B; b++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t e = 0; e < Tk * D; e++) {
                        const int64_t src = (b * H + h) * Tk * D + e;
                        const int64_t dst = (b * c->Hkv + h / G) * Tk * D + e;
                        sk[dst] += m.dk[src], sv[dst] += m.dv[src];
                    }
            CHECK_ALLCLOSE(g.dk, sk, nk, GA, GR);
            CHECK_ALLCLOSE(g.dv, sv, nk, GA, GR);
            free(sk), free(sv);
            bufs_free(&g), bufs_free(&m);
            if (anneal_test_failures) return;
        }
}

/* Hkv == H given explicitly is Hkv == 0 (multi-head), bit for bit, on every path. */
TEST(gqa_hkv_equal_h_is_multi_head) {
    static const attn_case c0 = {2, 3, 70, 70, 16, true, 0, LAYOUT_QKV, 0, 0};
    attn_case c1 = c0;
    c1.Hkv = c0.H;
    static const struct { int compute; const char *isa; } runs[] = {
        {ANNEAL_F32, NULL}, {ANNEAL_F32, "portable"}, {ANNEAL_BF16, NULL},
        {ANNEAL_BF16, "avx512"}, {ANNEAL_BF16, "portable"}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        attn_out a, b;
        run_case(&c0, runs[r].compute, runs[r].isa, &a);
        run_case(&c1, runs[r].compute, runs[r].isa, &b);
        CHECK(memcmp(a.o, b.o, sizeof(float) * (size_t)a.no) == 0 &&
                  memcmp(a.lse, b.lse, sizeof(float) * (size_t)a.nl) == 0 &&
                  memcmp(a.dq, b.dq, sizeof(float) * (size_t)a.nq) == 0 &&
                  memcmp(a.dk, b.dk, sizeof(float) * (size_t)a.nk) == 0 &&
                  memcmp(a.dv, b.dv, sizeof(float) * (size_t)a.nk) == 0,
              "run %zu: Hkv = H differs from Hkv = 0", r);
        out_free(&a), out_free(&b);
    }
}

/* Central differences of sum(o * dout) against dq, dk, dv with grouped heads (dk, dv
 * collect the whole group). */
TEST(gqa_finite_differences) {
    const attn_case c = {1, 4, 5, 11, 8, true, 0.7f, LAYOUT_CONTIG, 0, 2};
    fd_check(&c, 1);
    const attn_case mq = {1, 3, 7, 7, 8, false, 0, LAYOUT_QKV, 0, 1};
    fd_check(&mq, 2);
}

/* Grouped heads give bit-identical results over runs and 1, 2, 3 threads, at f32 and bf16
 * on every kernel. (With B*H = 8 the AVX512-BF16 forward switches from per-head to
 * per-query-tile tasks at 3 threads, so that is compared too.) */
TEST(gqa_determinism) {
    static const attn_case cases[] = {
        {2, 4, 77, 150, 40, true, 0, LAYOUT_CONTIG, 0, 2},
        {1, 6, 130, 130, 16, true, 0, LAYOUT_QKV, 0, 3},
        {2, 4, 70, 70, 8, false, 0, LAYOUT_GAPPED, 0, 1},
    };
    static const struct { int compute; const char *isa; } runs[] = {
        {ANNEAL_F32, NULL}, {ANNEAL_F32, "portable"}, {ANNEAL_BF16, NULL},
        {ANNEAL_BF16, "avx512"}, {ANNEAL_BF16, "portable"}};
    const int saved = omp_get_max_threads();
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
            attn_out r0 = {0};
            static const int threads[] = {2, 2, 1, 3};
            for (int r = 0; r < 4; r++) {
                omp_set_num_threads(threads[r]);
                attn_out x;
                run_case(&cases[ci], runs[k].compute, runs[k].isa, &x);
                if (r == 0) {
                    r0 = x;
                    continue;
                }
                CHECK(memcmp(r0.o, x.o, sizeof(float) * (size_t)x.no) == 0 &&
                          memcmp(r0.lse, x.lse, sizeof(float) * (size_t)x.nl) == 0 &&
                          memcmp(r0.dq, x.dq, sizeof(float) * (size_t)x.nq) == 0 &&
                          memcmp(r0.dk, x.dk, sizeof(float) * (size_t)x.nk) == 0 &&
                          memcmp(r0.dv, x.dv, sizeof(float) * (size_t)x.nk) == 0,
                      "case %zu run %zu: results differ on run %d (%d threads)", ci, k, r,
                      threads[r]);
                out_free(&x);
            }
            out_free(&r0);
        }
    omp_set_num_threads(saved);
}

/* The AVX512-BF16 forward with per-head tasks keeps each key tile converted for the
 * head's later query tiles. Causal with Tk - Tq not a multiple of the tile (a KV cache's
 * chunked prefill), a query tile's last key tile is partial and the next query tile sees
 * more of it: it must be converted again (it once was not, and the keys beyond the first
 * conversion were stale scratch: wrong and thread-count dependent). B*H = 8 makes per-head
 * tasks at 1 and 2 threads. */
TEST(bf16_kv_cache_shape_per_head_tasks) {
    static const attn_case c = {2, 4, 77, 150, 40, true, 0, LAYOUT_CONTIG, 0, 0};
    const int saved = omp_get_max_threads();
    static const int threads[] = {2, 1, 3};
    for (int r = 0; r < 3; r++) {
        omp_set_num_threads(threads[r]);
        if (check_bf16_case(&c, NULL, FA, FR, GA, GR)) break;
    }
    omp_set_num_threads(saved);
}

int main(void) {
    RUN(grid_contiguous);
    RUN(gapped_layout_and_scale);
    RUN(interleaved_qkv);
    RUN(rows_without_keys);
    RUN(large_logits);
    RUN(finite_differences);
    RUN(determinism);
    RUN(portable_path);
    RUN(bf16_against_rounded_reference);
    RUN(bf16_fallback_against_rounded_reference);
    RUN(bf16_fast_path_matches_fallback);
    RUN(bf16_versus_f32_and_f16_is_f32);
    RUN(bf16_determinism);
    RUN(gqa_against_reference);
    RUN(gqa_bf16_against_rounded_reference);
    RUN(gqa_equals_repeated_heads);
    RUN(gqa_hkv_equal_h_is_multi_head);
    RUN(gqa_finite_differences);
    RUN(gqa_determinism);
    RUN(bf16_kv_cache_shape_per_head_tasks);
    return anneal_test_summary();
}
