/* attention and causal (packed qkv) attention ops: values against naive double loops
 * (causal and not, Tq < Tk, strided and permuted inputs), the promised output layout,
 * no copies of head views, gradients against finite differences, causal attention
 * against attention on explicit split/permute views, the compute precision (a value
 * given to the forward, kept for the backward), and error paths. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

/* Tolerance for f32 flash attention against the double reference with |q|,|k|,|v| <= 1
 * and D <= 16: softmax weights and sums are accurate to a few ulp: 2e-5 abs, 1e-4 rel. */
#define ATOL 2e-5
#define RTOL 1e-4

static float *values(const anneal_tensor *t) {
    int64_t n = anneal_numel(t);
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    if (p && anneal_to_f32_buffer(t, p) != ANNEAL_OK) {
        free(p);
        return NULL;
    }
    return p;
}

/* Naive attention in double on row-major (B, H, T, D) values: query i sees key j when
 * !causal or j <= i + (Tk - Tq) (bottom-right aligned). out (B, H, Tq, D). */
static void ref_attention(const float *q, const float *k, const float *v, int64_t B, int64_t H,
                          int64_t Tq, int64_t Tk, int64_t D, bool causal, double scale, float *out) {
    double *p = malloc((size_t)Tk * sizeof *p);
    for (int64_t bh = 0; bh < B * H; bh++)
        for (int64_t i = 0; i < Tq; i++) {
            const float *qi = q + (bh * Tq + i) * D;
            int64_t last = causal ? i + (Tk - Tq) : Tk - 1;
            double mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j <= last && j < Tk; j++) {
                double s = 0;
                for (int64_t c = 0; c < D; c++) s += (double)qi[c] * k[(bh * Tk + j) * D + c];
                p[j] = s * scale;
                if (p[j] > mx) mx = p[j];
            }
            for (int64_t j = 0; j <= last && j < Tk; j++) sum += (p[j] = exp(p[j] - mx));
            for (int64_t c = 0; c < D; c++) {
                double o = 0;
                for (int64_t j = 0; j <= last && j < Tk; j++) o += p[j] * v[(bh * Tk + j) * D + c];
                out[(bh * Tq + i) * D + c] = (float)(sum > 0 ? o / sum : 0.0);
            }
        }
    free(p);
}

/* Checks o == attention(q, k, v) against the reference (all (B, H, T, D), any strides). */
static void check_attention(anneal_tensor *q, anneal_tensor *k, anneal_tensor *v, anneal_tensor *o,
                            bool causal, double scale, const char *what) {
    CHECK(o != NULL, "%s: attention failed: %s", what, anneal_last_error());
    if (!o) return;
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], D = q->shape[3], Tk = k->shape[2];
    CHECK(o->ndim == 4 && o->shape[0] == B && o->shape[1] == H && o->shape[2] == Tq && o->shape[3] == D,
          "%s: output shape", what);
    float *vq = values(q), *vk = values(k), *vv = values(v), *got = values(o);
    float *ref = malloc((size_t)(B * H * Tq * D) * sizeof *ref);
    ref_attention(vq, vk, vv, B, H, Tq, Tk, D, causal, scale, ref);
    int64_t w = 0;
    double r = anneal_test_close_ratio(got, ref, B * H * Tq * D, ATOL, RTOL, &w);
    CHECK(r <= 1.0, "%s: element %lld: %.9g vs %.9g", what, (long long)w, got[w], ref[w]);
    free(vq);
    free(vk);
    free(vv);
    free(got);
    free(ref);
}

static anneal_tensor *rand4(int64_t B, int64_t H, int64_t T, int64_t D, uint64_t seed, bool grad) {
    return anneal_test_rand(4, (int64_t[]){B, H, T, D}, -1, 1, seed, grad);
}

TEST(attention_values) {
    anneal_scope *s = anneal_scope_open();
    struct { int64_t B, H, Tq, Tk, D; bool causal; float scale; } cases[] = {
        {2, 3, 6, 6, 8, false, 0.0f},
        {2, 3, 6, 6, 8, true, 0.0f},
        {1, 2, 5, 9, 4, false, 0.0f}, /* Tq < Tk */
        {1, 2, 3, 8, 4, true, 0.7f},  /* Tq < Tk causal (bottom-right), explicit scale */
        {1, 1, 70, 70, 16, true, 0.0f}, /* more than one 64-row tile */
    };
    for (int i = 0; i < 5; i++) {
        anneal_tensor *q = rand4(cases[i].B, cases[i].H, cases[i].Tq, cases[i].D, 200 + i, false);
        anneal_tensor *k = rand4(cases[i].B, cases[i].H, cases[i].Tk, cases[i].D, 210 + i, false);
        anneal_tensor *v = rand4(cases[i].B, cases[i].H, cases[i].Tk, cases[i].D, 220 + i, false);
        anneal_tensor *o = anneal_attention(q, k, v, cases[i].causal, cases[i].scale);
        double scale = cases[i].scale > 0 ? cases[i].scale : 1.0 / sqrt((double)cases[i].D);
        char what[32];
        snprintf(what, sizeof what, "case %d", i);
        check_attention(q, k, v, o, cases[i].causal, scale, what);
        /* The promised layout: (B, H, Tq, D) view of (B, Tq, H, D) storage. */
        REQUIRE(o);
        int64_t H = cases[i].H, Tq = cases[i].Tq, D = cases[i].D;
        CHECK(o->strides[0] == Tq * H * D && o->strides[1] == D && o->strides[2] == H * D && o->strides[3] == 1,
              "case %d: output strides", i);
        CHECK(anneal_is_contiguous(anneal_transpose(o, 1, 2)), "case %d: transpose(1, 2) is contiguous", i);
    }
    anneal_scope_close(s);
}

TEST(attention_strided_inputs) {
    anneal_scope *s = anneal_scope_open();
    const int64_t B = 2, H = 2, T = 5, D = 4;
    /* Heads as permuted views of (B, T, H, D) tensors: no copies (2 allocations: o, lse). */
    anneal_tensor *qs = anneal_test_rand(4, (int64_t[]){B, T, H, D}, -1, 1, 230, true);
    anneal_tensor *ks = anneal_test_rand(4, (int64_t[]){B, T, H, D}, -1, 1, 231, true);
    anneal_tensor *vs = anneal_test_rand(4, (int64_t[]){B, T, H, D}, -1, 1, 232, true);
    anneal_tensor *q = anneal_transpose(qs, 1, 2), *k = anneal_transpose(ks, 1, 2), *v = anneal_transpose(vs, 1, 2);
    int64_t before = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    anneal_tensor *o = anneal_attention(q, k, v, true, 0.0f);
    int64_t after = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    CHECK(after - before == 2, "permuted heads: %lld allocations, want 2 (o and lse)", (long long)(after - before));
    check_attention(q, k, v, o, true, 0.5, "permuted heads");
    /* A last dim with stride 2 (not allowed by the kernel): copied, same values. */
    anneal_tensor *wide = rand4(B, H, T, 2 * D, 233, false);
    anneal_tensor *q2 = anneal_alias(wide, 4, (int64_t[]){B, H, T, D},
                                     (int64_t[]){H * T * 2 * D, T * 2 * D, 2 * D, 2}, 1);
    check_attention(q2, k, v, anneal_attention(q2, k, v, false, 0.0f), false, 0.5, "stride-2 last dim");
    /* Broadcast (stride 0) heads of k and v, as grouped-query attention makes them. */
    anneal_tensor *k1 = rand4(B, 1, T, D, 234, false), *v1 = rand4(B, 1, T, D, 235, false);
    anneal_tensor *kx = anneal_alias(k1, 4, (int64_t[]){B, H, T, D}, (int64_t[]){T * D, 0, D, 1}, 0);
    anneal_tensor *vx = anneal_alias(v1, 4, (int64_t[]){B, H, T, D}, (int64_t[]){T * D, 0, D, 1}, 0);
    check_attention(q, kx, vx, anneal_attention(q, kx, vx, true, 0.0f), true, 0.5, "broadcast kv heads");
    anneal_scope_close(s);
}

/* ctx: {causal, mode}; mode 0: contiguous leaves; 1: heads permuted from (B, T, H, D)
 * leaves and output merged back (dout arrives in o's own layout); 2: q given as the
 * transpose of a (B, H, D, T) leaf (last-dim stride != 1: copied); 3: q a narrow view
 * (unit last stride but gaps between rows: not a dense layout). */
static anneal_tensor *f_attention(void *c, anneal_tensor *const *x) {
    const int *m = c;
    bool causal = m[0];
    if (m[1] == 1) {
        anneal_tensor *o = anneal_attention(anneal_transpose(x[0], 1, 2), anneal_transpose(x[1], 1, 2),
                                            anneal_transpose(x[2], 1, 2), causal, 0.0f);
        return anneal_transpose(o, 1, 2); /* (B, T, H, D), contiguous */
    }
    anneal_tensor *q = m[1] == 2 ? anneal_transpose(x[0], 2, 3)
                     : m[1] == 3 ? anneal_narrow(x[0], 3, 1, x[1]->shape[3]) : x[0];
    return anneal_attention(q, x[1], x[2], causal, m[1] == 2 ? 0.8f : 0.0f);
}

TEST(attention_gradients) {
    anneal_scope *s = anneal_scope_open();
    /* eps 1e-2 on a smooth function of inputs in [-1, 1]: the central difference error
     * is O(eps^2 * f''') ~ 1e-4, f32 loss rounding ~1e-5 / eps: atol 2e-3, rtol 2e-2. */
    for (int causal = 0; causal < 2; causal++)
        for (int mode = 0; mode < 4; mode++) {
            int ctx[2] = {causal, mode};
            const int64_t B = 1, H = 2, Tq = 4, Tk = mode == 0 ? 6 : 4, D = 3; /* Tq < Tk in mode 0 */
            anneal_tensor *x[3];
            if (mode == 1) {
                x[0] = anneal_test_rand(4, (int64_t[]){B, Tq, H, D}, -1, 1, 240 + causal, true);
                x[1] = anneal_test_rand(4, (int64_t[]){B, Tk, H, D}, -1, 1, 242 + causal, true);
                x[2] = anneal_test_rand(4, (int64_t[]){B, Tk, H, D}, -1, 1, 244 + causal, true);
            } else {
                x[0] = mode == 2 ? anneal_test_rand(4, (int64_t[]){B, H, D, Tq}, -1, 1, 246 + causal, true)
                                 : rand4(B, H, Tq, mode == 3 ? D + 2 : D, 248 + causal, true);
                x[1] = rand4(B, H, Tk, D, 250 + causal, true);
                x[2] = rand4(B, H, Tk, D, 252 + causal, true);
            }
            /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.32% of it (AVX-512, avx2, portable) */
            CHECK_GRAD(f_attention, ctx, 3, x, 1e-2, 1e-4, 1e-3);
        }
    /* Only v trained. */
    int ctx[2] = {1, 0};
    anneal_tensor *y[3] = {rand4(2, 1, 3, 2, 260, false), rand4(2, 1, 3, 2, 261, false),
                           rand4(2, 1, 3, 2, 262, true)};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.021% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_attention, ctx, 3, y, 1e-2, 2e-5, 2e-4);
    CHECK_TRUE(y[0]->grad == NULL && y[1]->grad == NULL);
    anneal_scope_close(s);
}

/* ------------------------------------------------------- causal_attention */

/* GPT-2's causal self-attention from a fused qkv (B, T, 3C): the packed op with as many
 * key/value heads as query heads (what anneal_causal_attention was). */
static anneal_tensor *causal_attention(anneal_tensor *qkv, int n_head) {
    return anneal_attention_packed(qkv, n_head, n_head, &(anneal_attention_opts){.causal = true});
}

/* attention on explicit views: q, k, v = split(qkv) -> (B, T, H, D) -> (B, H, T, D);
 * output transposed back and merged to (B, T, C). */
static anneal_tensor *explicit_causal(anneal_tensor *qkv, int n_head) {
    int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3, D = C / n_head;
    anneal_tensor *parts[3];
    if (anneal_split(qkv, 2, 3, (int64_t[]){C, C, C}, parts) != ANNEAL_OK) return NULL;
    anneal_tensor *h[3];
    for (int i = 0; i < 3; i++)
        h[i] = anneal_transpose(anneal_reshape(parts[i], 4, (int64_t[]){B, T, n_head, D}), 1, 2);
    anneal_tensor *o = anneal_attention(h[0], h[1], h[2], true, 0.0f);
    return anneal_reshape(anneal_transpose(o, 1, 2), 3, (int64_t[]){B, T, C});
}

TEST(causal_attention_values) {
    anneal_scope *s = anneal_scope_open();
    const int64_t B = 2, T = 7, C = 8, H = 2, D = C / H;
    anneal_tensor *qkv = anneal_test_rand(3, (int64_t[]){B, T, 3 * C}, -1, 1, 270, true);
    int64_t before = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    anneal_tensor *o = causal_attention(qkv, (int)H);
    int64_t after = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    REQUIRE(o);
    CHECK(after - before == 2, "causal_attention: %lld allocations, want 2 (o and lse)", (long long)(after - before));
    CHECK(o->ndim == 3 && o->shape[0] == B && o->shape[1] == T && o->shape[2] == C && anneal_is_contiguous(o),
          "output is a contiguous (B, T, C)");
    /* Reference: split the columns and heads by hand. */
    float *vqkv = values(qkv), *got = values(o);
    float *q = malloc(sizeof(float) * (size_t)(B * H * T * D)), *k = malloc(sizeof(float) * (size_t)(B * H * T * D));
    float *v = malloc(sizeof(float) * (size_t)(B * H * T * D)), *ref = malloc(sizeof(float) * (size_t)(B * H * T * D));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t d = 0; d < D; d++) {
                    int64_t dst = ((b * H + h) * T + t) * D + d, src = (b * T + t) * 3 * C + h * D + d;
                    q[dst] = vqkv[src];
                    k[dst] = vqkv[src + C];
                    v[dst] = vqkv[src + 2 * C];
                }
    ref_attention(q, k, v, B, H, T, T, D, true, 1.0 / sqrt((double)D), ref);
    float *ref_btc = malloc(sizeof(float) * (size_t)(B * T * C));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t d = 0; d < D; d++)
                    ref_btc[(b * T + t) * C + h * D + d] = ref[((b * H + h) * T + t) * D + d];
    CHECK_ALLCLOSE(got, ref_btc, B * T * C, ATOL, RTOL);
    /* Same numbers as attention on explicit split/permute views. */
    anneal_tensor *e = explicit_causal(qkv, (int)H);
    REQUIRE(e);
    float *ve = values(e);
    CHECK(memcmp(got, ve, sizeof(float) * (size_t)(B * T * C)) == 0, "causal_attention differs from attention on split views (want bitwise equal: same kernel, same arithmetic)");
    /* And the same gradients for the same upstream gradient. */
    anneal_tensor *g = anneal_test_rand(3, (int64_t[]){B, T, C}, -1, 1, 271, false);
    REQUIRE(anneal_backward_grad(o, g) == ANNEAL_OK);
    float *g1 = values(qkv->grad);
    anneal_grad_clear(qkv);
    REQUIRE(anneal_backward_grad(e, g) == ANNEAL_OK);
    float *g2 = values(qkv->grad);
    CHECK(memcmp(g1, g2, sizeof(float) * (size_t)(B * T * 3 * C)) == 0, "qkv gradients differ between the two paths (want bitwise equal)");
    free(vqkv); free(got); free(q); free(k); free(v); free(ref); free(ref_btc); free(ve); free(g1); free(g2);
    anneal_scope_close(s);
}

static anneal_tensor *f_causal(void *c, anneal_tensor *const *x) {
    /* mode 1: qkv given as a transposed (non-contiguous) view; 2: output transposed, so
     * the incoming gradient is a strided view. */
    int mode = *(int *)c;
    anneal_tensor *qkv = mode == 1 ? anneal_transpose(x[0], 1, 2) : x[0];
    anneal_tensor *o = causal_attention(qkv, 2);
    return mode == 2 ? anneal_transpose(o, 1, 2) : o;
}

TEST(causal_attention_gradients) {
    anneal_scope *s = anneal_scope_open();
    /* Same tolerances as attention_gradients. */
    int mode = 0;
    anneal_tensor *x[1] = {anneal_test_rand(3, (int64_t[]){2, 7, 24}, -1, 1, 280, true)};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.51% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_causal, &mode, 1, x, 1e-2, 2e-4, 2e-3);
    mode = 1;
    anneal_tensor *y[1] = {anneal_test_rand(3, (int64_t[]){2, 12, 5}, -1, 1, 281, true)};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.18% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_causal, &mode, 1, y, 1e-2, 4e-5, 4e-4);
    mode = 2;
    anneal_tensor *z[1] = {anneal_test_rand(3, (int64_t[]){1, 5, 12}, -1, 1, 282, true)};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.25% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_causal, &mode, 1, z, 1e-2, 1e-4, 1e-3);
    anneal_scope_close(s);
}

/* ------------------------------------------------------- compute precision */

/* Forward of attention (which = 0) or causal_attention (1) on fresh inputs (seeded) at
 * matmul precision fwd_dt, backward of sum(o * g) at bwd_dt; o and the input gradients
 * (q, k, v or qkv, concatenated) come back as malloc'd floats. */
static void run_at_precision(int which, anneal_dtype fwd_dt, anneal_dtype bwd_dt, float **o_out,
                             float **g_out, int64_t *n_o, int64_t *n_g) {
    anneal_scope *s = anneal_scope_open();
    const int64_t B = 2, H = 2, T = 70, D = 16; /* T across a 64-key tile */
    anneal_tensor *x[3] = {NULL, NULL, NULL}, *o = NULL;
    anneal_attention_opts opts = {.causal = true, .compute = fwd_dt};
    if (which == 0) {
        for (int i = 0; i < 3; i++) x[i] = rand4(B, H, T, D, 300 + i, true);
        o = anneal_attention_ex(x[0], x[1], x[2], &opts);
    } else {
        x[0] = anneal_test_rand(3, (int64_t[]){B, T, 3 * H * D}, -1, 1, 310, true);
        o = anneal_attention_packed(x[0], (int)H, (int)H, &opts);
    }
    REQUIRE(o);
    (void)bwd_dt; /* the precision is a value of the forward now: nothing to set for backward */
    anneal_tensor *g = anneal_test_rand(o->ndim, o->shape, -1, 1, 320, false);
    REQUIRE(anneal_backward_grad(o, g) == ANNEAL_OK);
    *o_out = values(o);
    *n_o = anneal_numel(o);
    const int nx = which == 0 ? 3 : 1;
    *n_g = 0;
    for (int i = 0; i < nx; i++) *n_g += anneal_numel(x[i]);
    *g_out = malloc((size_t)*n_g * sizeof(float));
    for (int i = 0, off = 0; i < nx; off += (int)anneal_numel(x[i]), i++) {
        float *gi = values(x[i]->grad);
        memcpy(*g_out + off, gi, (size_t)anneal_numel(x[i]) * sizeof(float));
        free(gi);
    }
    anneal_scope_close(s);
}

/* The ops run attention at the compute precision they are given (bf16: bf16 tile
 * operands, see tests/cpu/test_attention.c for the numerics) and the backward at the
 * precision the forward ran at, with nothing set when backward runs: a forward at bf16 gives
 * the same gradient bits with backward at bf16 or f32, and likewise for f32; and bf16
 * results differ from f32 ones (the setting reaches the kernel), by bf16 rounding
 * (normwise below 4u = 2^-6). */
TEST(precision_follows_the_forward) {
    for (int which = 0; which < 2; which++) {
        float *ob, *gbb, *ob2, *gbf, *of, *gff, *of2, *gfb;
        int64_t no, ng;
        run_at_precision(which, ANNEAL_BF16, ANNEAL_BF16, &ob, &gbb, &no, &ng);
        run_at_precision(which, ANNEAL_BF16, ANNEAL_F32, &ob2, &gbf, &no, &ng);
        run_at_precision(which, ANNEAL_F32, ANNEAL_F32, &of, &gff, &no, &ng);
        run_at_precision(which, ANNEAL_F32, ANNEAL_BF16, &of2, &gfb, &no, &ng);
        CHECK(memcmp(gbb, gbf, (size_t)ng * sizeof(float)) == 0,
              "op %d: bf16 forward, f32 backward: gradients differ from an all-bf16 run", which);
        CHECK(memcmp(gff, gfb, (size_t)ng * sizeof(float)) == 0,
              "op %d: f32 forward, bf16 backward: gradients differ from an all-f32 run", which);
        CHECK(memcmp(ob, ob2, (size_t)no * sizeof(float)) == 0 && memcmp(of, of2, (size_t)no * sizeof(float)) == 0,
              "op %d: forward not deterministic", which);
        double num = 0, den = 0, gnum = 0, gden = 0;
        for (int64_t i = 0; i < no; i++) num += ((double)ob[i] - of[i]) * ((double)ob[i] - of[i]), den += (double)of[i] * of[i];
        for (int64_t i = 0; i < ng; i++)
            gnum += ((double)gbb[i] - gff[i]) * ((double)gbb[i] - gff[i]), gden += (double)gff[i] * gff[i];
        const double eo = sqrt(num / den), eg = sqrt(gnum / gden);
        CHECK(eo > 1e-5 && eo < 1.0 / 64, "op %d: bf16 output %.3g (normwise) from f32, want (1e-5, 2^-6)", which, eo);
        CHECK(eg > 1e-5 && eg < 1.0 / 64, "op %d: bf16 gradients %.3g (normwise) from f32, want (1e-5, 2^-6)", which, eg);
        free(ob), free(gbb), free(ob2), free(gbf), free(of), free(gff), free(of2), free(gfb);
    }
}

/* ------------------------------------------------------------ errors */

static void expect_error(anneal_tensor *r, anneal_status code, const char *substr, const char *what) {
    CHECK(r == NULL, "%s: expected NULL", what);
    CHECK(anneal_last_status() == code, "%s: status %s, want %s", what,
          anneal_status_name(anneal_last_status()), anneal_status_name(code));
    CHECK(strstr(anneal_last_error(), substr) != NULL, "%s: message '%s' lacks '%s'", what,
          anneal_last_error(), substr);
    anneal_clear_error();
}

TEST(errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_clear_error();
    anneal_tensor *q = anneal_zeros(ANNEAL_F32, 4, (int64_t[]){1, 2, 3, 4});
    anneal_tensor *k = anneal_zeros(ANNEAL_F32, 4, (int64_t[]){1, 2, 5, 4});
    anneal_tensor *q3 = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 3, 4});
    expect_error(anneal_attention(q3, k, k, false, 0), ANNEAL_ERR_SHAPE, "4-D", "3-D q");
    anneal_tensor *kd = anneal_zeros(ANNEAL_F32, 4, (int64_t[]){1, 2, 5, 3});
    expect_error(anneal_attention(q, kd, kd, false, 0), ANNEAL_ERR_SHAPE, "(B, H, Tk, D)", "D mismatch");
    anneal_tensor *kh = anneal_zeros(ANNEAL_F32, 4, (int64_t[]){1, 3, 5, 4});
    expect_error(anneal_attention(q, kh, kh, false, 0), ANNEAL_ERR_SHAPE, "(B, H, Tk, D)", "H mismatch");
    anneal_tensor *v6 = anneal_zeros(ANNEAL_F32, 4, (int64_t[]){1, 2, 6, 4});
    expect_error(anneal_attention(q, k, v6, false, 0), ANNEAL_ERR_SHAPE, "(B, H, Tk, D)", "v length");
    anneal_tensor *qi = anneal_zeros(ANNEAL_I32, 4, (int64_t[]){1, 2, 3, 4});
    expect_error(anneal_attention(qi, k, k, false, 0), ANNEAL_ERR_DTYPE, "i32", "i32 q");

    anneal_tensor *qkv = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 4, 24});
    expect_error(causal_attention(qkv, 3), ANNEAL_ERR_SHAPE, "not divisible by n_head", "C % n_head");
    expect_error(causal_attention(qkv, 0), ANNEAL_ERR_ARG, "n_head", "n_head 0");
    expect_error(causal_attention(qkv, -2), ANNEAL_ERR_ARG, "n_head", "n_head < 0");
    expect_error(causal_attention(anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 4, 25}), 1), ANNEAL_ERR_SHAPE,
                 "multiple of 3", "3C");
    expect_error(causal_attention(anneal_zeros(ANNEAL_F32, 2, (int64_t[]){4, 24}), 2), ANNEAL_ERR_SHAPE,
                 "3-D", "2-D qkv");
    expect_error(causal_attention(anneal_zeros(ANNEAL_I32, 3, (int64_t[]){2, 4, 24}), 2), ANNEAL_ERR_DTYPE,
                 "i32", "i32 qkv");
    CHECK_TRUE(causal_attention(NULL, 2) == NULL);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(attention_values);
    RUN(attention_strided_inputs);
    RUN(attention_gradients);
    RUN(causal_attention_values);
    RUN(causal_attention_gradients);
    RUN(precision_follows_the_forward);
    RUN(errors);
    return anneal_test_summary();
}
