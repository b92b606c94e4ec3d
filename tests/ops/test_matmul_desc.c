/* The matmul descriptors ops build (src/ops/gemm.c), seen by a recording backend (the
 * CPU's slots on a second device whose matmul slot notes every descriptor): batch dims
 * folded into the rows when the right operand is shared, one batched call for uniform
 * batch strides (broadcast operands at stride 0), one call per batch element otherwise;
 * transposed views handed over in place (trans flags and leading dims, no copy); values
 * against a double reference; and each epilogue of the dense layer against the unfused
 * ops: BIAS, BIAS_GELU and SILU_MUL against a backend that declines epilogues (close;
 * SILU_MUL bit-identical), the pre-activation bit-identical to the BIAS product, BSUM's column sums bit-identical to
 * f32 additions in ascending k and its product bit-identical to the plain one. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "backend_clone.h"
#include "test.h"

#include <math.h>
#include <string.h>

#define EXT ANNEAL_DEVICE_EXT
#define MAX_SEEN 64

static anneal_backend g_rec;
static anneal_matmul_desc g_seen[MAX_SEEN];
static const void *g_seen_a[MAX_SEEN];
static int g_n_seen;
static bool g_no_epilogues;

static anneal_status rec_matmul(void *ctx, const anneal_matmul_desc *d, anneal_tensor *c, const anneal_tensor *a,
                                const anneal_tensor *b) {
    if (g_n_seen < MAX_SEEN) {
        g_seen_a[g_n_seen] = anneal_data(a);
        g_seen[g_n_seen++] = *d;
    }
    const anneal_backend *cpu = anneal_backend_get(ANNEAL_CPU);
    return cpu->matmul(cpu->ctx, d, c, a, b);
}

static bool rec_supports(void *ctx, const anneal_op_query *q) {
    if (g_no_epilogues && q->matmul && q->matmul->epilogue != ANNEAL_EPILOGUE_NONE) return false;
    const anneal_backend *cpu = anneal_backend_get(ANNEAL_CPU);
    return cpu->supports_op(cpu->ctx, q);
}

static bool rec_register(void) {
    if (!anneal_test_cpu_clone(&g_rec, "recorder", EXT)) return false;
    g_rec.matmul = rec_matmul;
    g_rec.supports_op = rec_supports;
    return anneal_backend_register(&g_rec) == ANNEAL_OK;
}

static float *host(const anneal_tensor *t) {
    float *b = malloc((size_t)anneal_numel(t) * sizeof *b + 4);
    anneal_to_f32_buffer(t, b);
    return b;
}

/* Random f32 tensor on the recording device. */
static anneal_tensor *rnd(int nd, const int64_t *shape, uint64_t seed) {
    return anneal_to_device(anneal_test_rand(nd, shape, -1, 1, seed, false), EXT);
}

/* Element (i, j) of the last two dims of t at flat batch index bi, broadcasting t's
 * batch dims against c's (aligned from the right). */
static double at(const float *v, const anneal_tensor *t, const anneal_tensor *c, int64_t bi, int64_t i, int64_t j) {
    int nd = c->ndim, nb = nd - 2;
    int64_t off = 0, r = bi, rowstride = t->shape[t->ndim - 1] * t->shape[t->ndim - 2];
    int64_t tb[ANNEAL_MAX_DIMS], tstride = rowstride;
    for (int k = t->ndim - 3; k >= 0; k--) tb[k] = tstride, tstride *= t->shape[k];
    for (int k = nb - 1; k >= 0; k--) {
        int64_t idx = r % c->shape[k];
        r /= c->shape[k];
        int kt = k - (nd - t->ndim);
        if (kt >= 0 && t->shape[kt] != 1) off += idx * tb[kt];
    }
    return v[off + i * t->shape[t->ndim - 1] + j];
}

/* c = a @ b (contiguous a, b given as values) against a double loop. */
static void check_values(const anneal_tensor *c, const anneal_tensor *a, const anneal_tensor *b, const char *what) {
    float *cv = host(c), *av = host(a), *bv = host(b);
    int64_t M = c->shape[c->ndim - 2], N = c->shape[c->ndim - 1], K = a->shape[a->ndim - 1];
    int64_t MN = M * N, batch = anneal_numel(c) / (MN > 0 ? MN : 1);
    double worst = 0;
    for (int64_t bi = 0; bi < batch; bi++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double ref = 0;
                for (int64_t k = 0; k < K; k++) ref += at(av, a, c, bi, i, k) * at(bv, b, c, bi, k, j);
                double e = fabs(cv[(bi * M + i) * N + j] - ref);
                if (e > worst) worst = e;
            }
    CHECK(worst <= 1e-5, "%s: worst error %g", what, worst);
    free(cv), free(av), free(bv);
}

TEST(batch_folds_into_rows_when_the_rhs_is_shared) {
    REQUIRE(rec_register());
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = rnd(4, (int64_t[]){2, 3, 5, 4}, 1), *b = rnd(2, (int64_t[]){4, 6}, 2);
    g_n_seen = 0;
    anneal_tensor *c = anneal_matmul(a, b);
    REQUIRE(c && g_n_seen == 1);
    anneal_matmul_desc d = g_seen[0];
    CHECK(d.batch == 1 && d.M == 30 && d.N == 6 && d.K == 4 && !d.trans_a && !d.trans_b && d.lda == 4 &&
              d.ldb == 6 && d.ldc == 6 && d.alpha == 1.0f && d.beta == 0.0f && d.compute == ANNEAL_F32 &&
              d.epilogue == ANNEAL_EPILOGUE_NONE,
          "folded: batch %lld M %lld lda %lld", (long long)d.batch, (long long)d.M, (long long)d.lda);
    check_values(c, a, b, "folded");
    /* the same rows one matrix at a time: the same bits (a row's arithmetic does not
     * depend on the rows next to it) */
    float *cv = host(c);
    anneal_tensor *a2 = anneal_reshape(a, 3, (int64_t[]){6, 5, 4});
    for (int64_t i = 0; i < 6; i++) {
        anneal_tensor *ci = anneal_matmul(anneal_reshape(anneal_narrow(a2, 0, i, 1), 2, (int64_t[]){5, 4}), b);
        float *v = host(ci);
        CHECK(!memcmp(v, cv + i * 30, 30 * sizeof(float)), "matrix %lld differs from its rows in the fold", (long long)i);
        free(v);
    }
    free(cv);
    anneal_scope_close(s);
}

TEST(uniform_batch_strides_make_one_batched_call) {
    REQUIRE(rec_register());
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = rnd(3, (int64_t[]){3, 5, 4}, 3), *b = rnd(3, (int64_t[]){3, 4, 6}, 4);
    g_n_seen = 0;
    anneal_tensor *c = anneal_matmul(a, b);
    REQUIRE(c && g_n_seen == 1);
    anneal_matmul_desc d = g_seen[0];
    CHECK(d.batch == 3 && d.M == 5 && d.stride_a == 20 && d.stride_b == 24 && d.stride_c == 30, "batched %lld %lld %lld",
          (long long)d.stride_a, (long long)d.stride_b, (long long)d.stride_c);
    check_values(c, a, b, "batched");
    /* a broadcast left operand: stride 0 */
    anneal_tensor *a1 = rnd(2, (int64_t[]){5, 4}, 5);
    g_n_seen = 0;
    c = anneal_matmul(a1, b);
    REQUIRE(c && g_n_seen == 1);
    CHECK(g_seen[0].batch == 3 && g_seen[0].stride_a == 0 && g_seen[0].stride_b == 24, "broadcast a: stride %lld",
          (long long)g_seen[0].stride_a);
    check_values(c, a1, b, "broadcast a");
    /* (2, 1, M, K) @ (1, 3, K, N): two broadcast dims; the flattened batch is not one
     * stride per operand, so one product per element */
    anneal_tensor *a4 = rnd(4, (int64_t[]){2, 1, 5, 4}, 6), *b4 = rnd(4, (int64_t[]){1, 3, 4, 6}, 7);
    g_n_seen = 0;
    c = anneal_matmul(a4, b4);
    REQUIRE(c && c->shape[0] == 2 && c->shape[1] == 3);
    CHECK(g_n_seen == 6, "per-element products: %d", g_n_seen);
    for (int i = 0; i < g_n_seen; i++) CHECK_TRUE(g_seen[i].batch == 1 && g_seen[i].M == 5);
    check_values(c, a4, b4, "per element");
    anneal_scope_close(s);
}

TEST(transposed_views_are_read_in_place) {
    REQUIRE(rec_register());
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *at_ = rnd(2, (int64_t[]){4, 5}, 8), *bt = rnd(2, (int64_t[]){6, 4}, 9);
    anneal_tensor *a = anneal_transpose(at_, 0, 1), *b = anneal_transpose(bt, 0, 1); /* (5, 4), (4, 6) */
    g_n_seen = 0;
    anneal_tensor *c = anneal_matmul(a, b);
    REQUIRE(c && g_n_seen == 1);
    anneal_matmul_desc d = g_seen[0];
    CHECK(d.trans_a && d.trans_b && d.lda == 5 && d.ldb == 4 && d.M == 5 && d.N == 6 && d.K == 4,
          "trans %d %d ld %lld %lld", d.trans_a, d.trans_b, (long long)d.lda, (long long)d.ldb);
    CHECK(g_seen_a[0] == anneal_data(at_), "the transposed operand was copied");
    anneal_tensor *ac = anneal_contiguous(a), *bc = anneal_contiguous(b);
    check_values(c, ac, bc, "transposed");
    /* a view with neither last dim of unit stride is copied first (a contiguous operand) */
    anneal_tensor *big = rnd(2, (int64_t[]){10, 8}, 10);
    anneal_tensor *every2 = anneal_alias(big, 2, (int64_t[]){5, 4}, (int64_t[]){16, 2}, big->offset);
    g_n_seen = 0;
    c = anneal_matmul(every2, b);
    REQUIRE(c && g_n_seen == 1);
    CHECK(!g_seen[0].trans_a && g_seen[0].lda == 4 && g_seen_a[0] != anneal_data(big), "strided copy lda %lld",
          (long long)g_seen[0].lda);
    check_values(c, anneal_contiguous(every2), bc, "strided copy");
    anneal_scope_close(s);
}

/* y and the gradients of sum(y * G) of a dense layer on the recording device. */
typedef struct {
    float *y, *gx, *gw, *gb;
} dense_out;

static dense_out run_dense(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, anneal_tensor *G,
                           anneal_activation act, anneal_weight_layout lay, anneal_tensor *mul) {
    dense_out o = {0};
    anneal_grad_clear(x), anneal_grad_clear(w), anneal_grad_clear(b);
    anneal_scope *s = anneal_scope_open();
    anneal_dense_opts opts = {.layout = lay, .act = act, .mul = act == ANNEAL_ACT_SILU_MUL ? mul : NULL};
    anneal_tensor *y = anneal_dense(x, w, b, &opts);
    anneal_tensor *L = anneal_sum(anneal_mul(y, G));
    if (L && anneal_backward(L) == ANNEAL_OK) o.y = host(y), o.gx = host(x->grad), o.gw = host(w->grad), o.gb = host(b->grad);
    anneal_scope_close(s);
    return o;
}

static void dense_free(dense_out *o) { free(o->y), free(o->gx), free(o->gw), free(o->gb); }

/* A leaf on the recording device. */
static anneal_tensor *leaf(int nd, const int64_t *shape, uint64_t seed) {
    anneal_tensor *t = rnd(nd, shape, seed);
    anneal_set_requires_grad(t, true);
    return t;
}

TEST(epilogues_against_unfused_ops) {
    REQUIRE(rec_register());
    anneal_scope *s = anneal_scope_open();
    const int64_t R = 37, K = 24, N = 40;
    anneal_tensor *x = leaf(2, (int64_t[]){R, K}, 20), *b = leaf(1, &N, 22);
    anneal_tensor *G = rnd(2, (int64_t[]){R, N}, 23), *mul = rnd(2, (int64_t[]){R, N}, 24);
    for (int lay = 0; lay < 2; lay++) {
        anneal_tensor *w = lay == ANNEAL_WEIGHT_OUT_IN ? leaf(2, (int64_t[]){N, K}, 21) : leaf(2, (int64_t[]){K, N}, 21);
        for (int act = 0; act < 3; act++) {
            g_no_epilogues = false;
            g_n_seen = 0;
            dense_out f = run_dense(x, w, b, G, (anneal_activation)act, (anneal_weight_layout)lay, mul);
            REQUIRE(f.y && g_n_seen >= 1);
            static const anneal_epilogue wants[3] = {ANNEAL_EPILOGUE_BIAS, ANNEAL_EPILOGUE_BIAS_GELU,
                                                     ANNEAL_EPILOGUE_SILU_MUL};
            anneal_epilogue want = wants[act];
            CHECK(g_seen[0].epilogue == want, "layout %d act %d: forward epilogue %d", lay, act, g_seen[0].epilogue);
            bool bsum = false;
            for (int i = 1; i < g_n_seen; i++) bsum |= g_seen[i].epilogue == ANNEAL_EPILOGUE_BSUM;
            CHECK(bsum == (lay == ANNEAL_WEIGHT_IN_OUT), "layout %d: column sums with dW %d", lay, bsum);
            g_no_epilogues = true; /* the same op, unfused: bias broadcast, GEMM, activation, separate sums */
            g_n_seen = 0;
            dense_out u = run_dense(x, w, b, G, (anneal_activation)act, (anneal_weight_layout)lay, mul);
            REQUIRE(u.y);
            for (int i = 0; i < g_n_seen; i++) CHECK_TRUE(g_seen[i].epilogue == ANNEAL_EPILOGUE_NONE);
            if (act == ANNEAL_ACT_SILU_MUL) /* the epilogue is the SiLU kernel then a multiply: the same bits */
                CHECK(!memcmp(f.y, u.y, (size_t)(R * N) * sizeof(float)) &&
                          !memcmp(f.gx, u.gx, (size_t)(R * K) * sizeof(float)),
                      "layout %d: SILU_MUL epilogue differs from silu then mul", lay);
            CHECK_ALLCLOSE(f.y, u.y, R * N, 1e-6, 1e-5);
            CHECK_ALLCLOSE(f.gx, u.gx, R * K, 1e-5, 1e-4);
            CHECK_ALLCLOSE(f.gw, u.gw, K * N, 1e-5, 1e-4);
            CHECK_ALLCLOSE(f.gb, u.gb, N, 1e-5, 1e-4);
            dense_free(&f), dense_free(&u);
        }
    }
    g_no_epilogues = false;
    anneal_scope_close(s);
}

/* BIAS_GELU's pre-activation is the BIAS product (same GEMM, same epilogue order), and
 * BSUM leaves the product as the plain one and sums op(B)'s columns as f32 additions in
 * ascending k: bit for bit, through the backend slot. */
TEST(epilogue_bits) {
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    anneal_scope *s = anneal_scope_open();
    const int64_t M = 33, K = 70, N = 45;
    anneal_tensor *a = anneal_test_rand(2, (int64_t[]){M, K}, -1, 1, 30, false);
    anneal_tensor *w = anneal_test_rand(2, (int64_t[]){K, N}, -1, 1, 31, false);
    anneal_tensor *bias = anneal_test_rand(1, &N, -1, 1, 32, false);
    anneal_tensor *c1 = anneal_empty(ANNEAL_F32, 2, (int64_t[]){M, N}), *c2 = anneal_empty_like(c1);
    anneal_tensor *pre = anneal_empty_like(c1), *c3 = anneal_empty_like(c1), *c4 = anneal_empty_like(c1);
    anneal_tensor *bsum = anneal_empty(ANNEAL_F32, 1, &N);
    anneal_matmul_desc d = {.batch = 1, .M = M, .N = N, .K = K, .lda = K, .ldb = N, .ldc = N, .alpha = 1.0f,
                            .compute = ANNEAL_F32};
    d.epilogue = ANNEAL_EPILOGUE_BIAS, d.bias = bias;
    REQUIRE(be->matmul(be->ctx, &d, c1, a, w) == ANNEAL_OK);
    d.epilogue = ANNEAL_EPILOGUE_BIAS_GELU, d.aux_out = pre;
    REQUIRE(be->matmul(be->ctx, &d, c2, a, w) == ANNEAL_OK);
    d.epilogue = ANNEAL_EPILOGUE_NONE, d.bias = NULL, d.aux_out = NULL;
    REQUIRE(be->matmul(be->ctx, &d, c3, a, w) == ANNEAL_OK);
    d.epilogue = ANNEAL_EPILOGUE_BSUM, d.bsum = bsum;
    REQUIRE(be->matmul(be->ctx, &d, c4, a, w) == ANNEAL_OK);
    float *v1 = host(c1), *vp = host(pre), *v3 = host(c3), *v4 = host(c4), *vs = host(bsum), *vw = host(w);
    float *v2 = host(c2), *gl = host(c1);
    CHECK(!memcmp(v1, vp, (size_t)(M * N) * sizeof(float)), "the pre-activation differs from the BIAS product");
    CHECK(!memcmp(v3, v4, (size_t)(M * N) * sizeof(float)), "BSUM changed the product");
    int bad = 0;
    for (int64_t j = 0; j < N; j++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc += vw[k * N + j];
        bad += acc != vs[j];
    }
    CHECK(bad == 0, "%d column sums differ from ascending f32 additions", bad);
    /* and the GELU of the pre-activation, as the unary op computes it (close) */
    anneal_tensor *g = anneal_gelu(pre, true);
    free(gl);
    gl = host(g);
    CHECK_ALLCLOSE(v2, gl, M * N, 1e-6, 1e-6);
    free(v1), free(vp), free(v3), free(v4), free(vs), free(vw), free(v2), free(gl);
    anneal_scope_close(s);
}

int main(void) {
    RUN(batch_folds_into_rows_when_the_rhs_is_shared);
    RUN(uniform_batch_strides_make_one_batched_call);
    RUN(transposed_views_are_read_in_place);
    RUN(epilogues_against_unfused_ops);
    RUN(epilogue_bits);
    return anneal_test_summary();
}
