/* matmul, linear and conv1d: values against naive double loops (every transpose
 * combination through views, broadcast batch dims both ways, biases, 3-D inputs),
 * gradients against finite differences, the no-copy promise for transposed views,
 * and error paths. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

/* Tolerances: f32 GEMM against a double reference with |values| <= 1 and K <= 70
 * accumulates at most ~K * 2^-24 * K relative error; 1e-4 abs + 1e-4 rel is loose
 * enough for any summation order and tight enough to catch a wrong element. */
#define ATOL 1e-4
#define RTOL 1e-4

/* Row-major f32 copy of t's elements (malloc'd). */
static float *values(const anneal_tensor *t) {
    int64_t n = anneal_numel(t);
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    if (p && anneal_to_f32_buffer(t, p) != ANNEAL_OK) {
        free(p);
        return NULL;
    }
    return p;
}

/* Naive batched matmul in double with NumPy broadcasting of leading dims; writes the
 * result (as f32) into c, whose shape (cnd dims) the caller computed. */
static void ref_matmul(const anneal_tensor *a, const anneal_tensor *b, const anneal_tensor *c, float *out) {
    float *va = values(a), *vb = values(b);
    int cnd = c->ndim, nb = cnd - 2;
    int64_t M = c->shape[cnd - 2], N = c->shape[cnd - 1], K = a->shape[a->ndim - 1];
    int64_t batch = 1;
    for (int d = 0; d < nb; d++) batch *= c->shape[d];
    for (int64_t i = 0; i < batch; i++) {
        /* Offsets of batch i in a and b (row-major, broadcast dims index 0). */
        int64_t oa = 0, ob = 0, sa = M * K, sb = K * N, r = i;
        for (int d = nb - 1; d >= 0; d--) {
            int64_t idx = r % c->shape[d];
            r /= c->shape[d];
            int da = d - (cnd - a->ndim), db = d - (cnd - b->ndim);
            if (da >= 0) {
                oa += (a->shape[da] == 1 ? 0 : idx) * sa;
                sa *= a->shape[da];
            }
            if (db >= 0) {
                ob += (b->shape[db] == 1 ? 0 : idx) * sb;
                sb *= b->shape[db];
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += (double)va[oa + m * K + k] * vb[ob + k * N + n];
                out[i * M * N + m * N + n] = (float)s;
            }
    }
    free(va);
    free(vb);
}

/* Checks c == a @ b elementwise against the naive reference. */
static void check_matmul(anneal_tensor *a, anneal_tensor *b, anneal_tensor *c, const char *what) {
    CHECK(c != NULL, "%s: matmul failed: %s", what, anneal_last_error());
    if (!c) return;
    int64_t n = anneal_numel(c);
    float *ref = malloc((size_t)n * sizeof *ref), *got = values(c);
    ref_matmul(a, b, c, ref);
    int64_t w = 0;
    double r = anneal_test_close_ratio(got, ref, n, ATOL, RTOL, &w);
    CHECK(r <= 1.0, "%s: element %lld: %.9g vs %.9g", what, (long long)w, got[w], ref[w]);
    free(ref);
    free(got);
}

/* A (rows, cols) operand: random, either stored that way or as the transpose of a
 * (cols, rows) tensor (a strided view), with optional leading batch dims. */
static anneal_tensor *operand(int nb, const int64_t *batch, int64_t rows, int64_t cols, bool trans,
                              uint64_t seed, bool grad) {
    int64_t shape[ANNEAL_MAX_DIMS];
    for (int i = 0; i < nb; i++) shape[i] = batch[i];
    shape[nb] = trans ? cols : rows;
    shape[nb + 1] = trans ? rows : cols;
    anneal_tensor *t = anneal_test_rand(nb + 2, shape, -1, 1, seed, grad);
    return trans ? anneal_transpose(t, -1, -2) : t;
}

TEST(matmul_values_all_transposes) {
    anneal_scope *s = anneal_scope_open();
    /* Small and blocked-size shapes, 2-D and batched. */
    const int64_t dims[3][3] = {{5, 7, 6}, {33, 70, 17}, {1, 9, 1}};
    for (int z = 0; z < 3; z++)
        for (int nb = 0; nb < 2; nb++)
            for (int ta = 0; ta < 2; ta++)
                for (int tb = 0; tb < 2; tb++) {
                    int64_t M = dims[z][0], K = dims[z][1], N = dims[z][2], batch[1] = {3};
                    anneal_tensor *a = operand(nb, batch, M, K, ta, 10 + ta, false);
                    anneal_tensor *b = operand(nb, batch, K, N, tb, 20 + tb, false);
                    anneal_tensor *c = anneal_matmul(a, b);
                    char what[96];
                    snprintf(what, sizeof what, "M%lld K%lld N%lld batch %d ta %d tb %d", (long long)M,
                             (long long)K, (long long)N, nb, ta, tb);
                    REQUIRE(c);
                    CHECK(c->ndim == nb + 2 && c->shape[nb] == M && c->shape[nb + 1] == N, "%s: shape", what);
                    CHECK(anneal_is_contiguous(c), "%s: output contiguous", what);
                    check_matmul(a, b, c, what);
                }
    anneal_scope_close(s);
}

TEST(matmul_values_broadcast_batch) {
    anneal_scope *s = anneal_scope_open();
    struct { int na; int64_t as[4]; int nbd; int64_t bs[4]; int nc; int64_t cs[4]; } cases[] = {
        {4, {2, 3, 4, 5}, 2, {5, 6}, 4, {2, 3, 4, 6}},    /* batched a, 2-D b */
        {2, {4, 5}, 3, {3, 5, 6}, 3, {3, 4, 6}},          /* 2-D a, batched b */
        {4, {2, 1, 4, 5}, 3, {3, 5, 6}, 4, {2, 3, 4, 6}}, /* both broadcast */
        {3, {1, 4, 5}, 3, {2, 5, 6}, 3, {2, 4, 6}},       /* size-1 batch dim of a */
        {3, {2, 4, 5}, 3, {1, 5, 6}, 3, {2, 4, 6}},       /* size-1 batch dim of b */
    };
    for (int i = 0; i < 5; i++) {
        anneal_tensor *a = anneal_test_rand(cases[i].na, cases[i].as, -1, 1, 30 + i, false);
        anneal_tensor *b = anneal_test_rand(cases[i].nbd, cases[i].bs, -1, 1, 40 + i, false);
        anneal_tensor *c = anneal_matmul(a, b);
        REQUIRE(c);
        bool shape_ok = c->ndim == cases[i].nc;
        for (int d = 0; shape_ok && d < c->ndim; d++) shape_ok = c->shape[d] == cases[i].cs[d];
        char buf[64];
        CHECK(shape_ok, "case %d: shape %s", i, anneal_shape_str(c, buf, sizeof buf));
        char what[32];
        snprintf(what, sizeof what, "broadcast case %d", i);
        if (shape_ok) check_matmul(a, b, c, what);
    }
    /* A transposed batched view against a broadcast one. */
    anneal_tensor *a = operand(2, (int64_t[]){2, 3}, 4, 5, true, 50, false);
    anneal_tensor *b = operand(1, (int64_t[]){3}, 5, 6, true, 51, false);
    check_matmul(a, b, anneal_matmul(a, b), "transposed broadcast");
    anneal_scope_close(s);
}

TEST(matmul_transposed_view_is_not_copied) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = operand(1, (int64_t[]){2}, 8, 16, true, 60, true);  /* (2, 8, 16) view */
    anneal_tensor *b = operand(0, NULL, 16, 12, true, 61, true);           /* (16, 12) view */
    REQUIRE(a && b);
    CHECK(!anneal_is_contiguous(a) && !anneal_is_contiguous(b), "operands are strided views");
    int64_t before = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    anneal_tensor *c = anneal_matmul(a, b); /* records a node too: saving allocates nothing */
    int64_t after = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    CHECK(after - before == 1, "matmul of transposed views made %lld allocations, want 1 (the output)",
          (long long)(after - before));
    check_matmul(a, b, c, "transposed views");
    /* A view with no unit stride in its last two dims is copied first (2 allocations)
     * and still gives the right values. */
    anneal_tensor *wide = anneal_test_rand(2, (int64_t[]){6, 10}, -1, 1, 62, false);
    anneal_tensor *odd = anneal_alias(wide, 2, (int64_t[]){6, 5}, (int64_t[]){10, 2}, 0);
    anneal_tensor *m = anneal_test_rand(2, (int64_t[]){5, 3}, -1, 1, 63, false);
    before = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    anneal_tensor *c2 = anneal_matmul(odd, m);
    after = anneal_memory_stats_get(ANNEAL_CPU).n_allocs;
    CHECK(after - before == 2, "stride-2 operand: %lld allocations, want 2", (long long)(after - before));
    check_matmul(odd, m, c2, "stride-2 operand");
    anneal_scope_close(s);
}

static anneal_tensor *f_matmul(void *c, anneal_tensor *const *x) {
    (void)c;
    return anneal_matmul(x[0], x[1]);
}
static anneal_tensor *f_matmul_tt(void *c, anneal_tensor *const *x) {
    (void)c;
    return anneal_matmul(anneal_transpose(x[0], -1, -2), anneal_transpose(x[1], -1, -2));
}
/* Output transposed: the incoming gradient is a strided (column-major) view. */
static anneal_tensor *f_matmul_out_t(void *c, anneal_tensor *const *x) {
    (void)c;
    return anneal_transpose(anneal_matmul(x[0], anneal_transpose(x[1], -1, -2)), -1, -2);
}

TEST(matmul_gradients) {
    anneal_scope *s = anneal_scope_open();
    /* Gradients are linear in the inputs, so central differences with eps 1e-2 are
     * exact up to f32 rounding of the loss: atol 1e-3, rtol 1e-2. */
    struct { int na; int64_t as[4]; int nbd; int64_t bs[4]; } cases[] = {
        {2, {3, 4}, 2, {4, 5}},
        {3, {2, 3, 4}, 2, {4, 5}},       /* shared b: one folded GEMM for dB */
        {3, {2, 3, 4}, 3, {1, 4, 5}},    /* shared b with a size-1 batch dim */
        {2, {3, 4}, 3, {2, 4, 5}},       /* shared a: dA summed over the batch */
        {4, {2, 1, 3, 4}, 3, {3, 4, 2}}, /* both broadcast */
        {3, {2, 3, 4}, 3, {2, 4, 5}},
    };
    for (int i = 0; i < 6; i++) {
        anneal_tensor *x[2] = {anneal_test_rand(cases[i].na, cases[i].as, -1, 1, 70 + i, true),
                               anneal_test_rand(cases[i].nbd, cases[i].bs, -1, 1, 80 + i, true)};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.41% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_matmul, NULL, 2, x, 1e-2, 5e-5, 5e-4);
    }
    /* Transposed-view inputs, batched and broadcast (x[0] (2, 4, 3) -> (2, 3, 4)). */
    anneal_tensor *t[2] = {anneal_test_rand(3, (int64_t[]){2, 4, 3}, -1, 1, 90, true),
                           anneal_test_rand(2, (int64_t[]){5, 4}, -1, 1, 91, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.36% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_matmul_tt, NULL, 2, t, 1e-2, 5e-5, 5e-4);
    anneal_tensor *u[2] = {anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 92, true),
                           anneal_test_rand(3, (int64_t[]){2, 5, 4}, -1, 1, 93, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.21% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_matmul_out_t, NULL, 2, u, 1e-2, 5e-5, 5e-4);
    /* Only one input wanting a gradient. */
    anneal_tensor *v[2] = {anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 94, false),
                           anneal_test_rand(2, (int64_t[]){4, 5}, -1, 1, 95, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.13% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_matmul, NULL, 2, v, 1e-2, 2e-5, 2e-4);
    CHECK_TRUE(v[0]->grad == NULL);
    anneal_scope_close(s);
}

/* ------------------------------------------------------------ dense */

/* y = x @ op(w) + b in double; linear: w (out, in), conv1d: w (in, out). */
static void ref_dense(const anneal_tensor *x, const anneal_tensor *w, const anneal_tensor *b,
                      bool linear, float *out) {
    float *vx = values(x), *vw = values(w), *vb = b ? values(b) : NULL;
    int64_t in = x->shape[x->ndim - 1], nout = linear ? w->shape[0] : w->shape[1];
    int64_t R = anneal_numel(x) / in;
    for (int64_t r = 0; r < R; r++)
        for (int64_t o = 0; o < nout; o++) {
            double s = vb ? vb[o] : 0.0;
            for (int64_t i = 0; i < in; i++)
                s += (double)vx[r * in + i] * (linear ? vw[o * in + i] : vw[i * nout + o]);
            out[r * nout + o] = (float)s;
        }
    free(vx);
    free(vw);
    free(vb);
}

static void check_dense(anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, bool linear,
                        const char *what) {
    anneal_tensor *y = linear ? anneal_linear(x, w, b) : anneal_conv1d(x, w, b);
    CHECK(y != NULL, "%s: failed: %s", what, anneal_last_error());
    if (!y) return;
    int64_t nout = linear ? w->shape[0] : w->shape[1];
    bool shape_ok = y->ndim == x->ndim && y->shape[y->ndim - 1] == nout;
    for (int d = 0; shape_ok && d < x->ndim - 1; d++) shape_ok = y->shape[d] == x->shape[d];
    CHECK(shape_ok, "%s: output shape", what);
    if (!shape_ok) return;
    int64_t n = anneal_numel(y);
    float *ref = malloc((size_t)n * sizeof *ref), *got = values(y);
    ref_dense(x, w, b, linear, ref);
    int64_t worst = 0;
    double r = anneal_test_close_ratio(got, ref, n, ATOL, RTOL, &worst);
    CHECK(r <= 1.0, "%s: element %lld: %.9g vs %.9g", what, (long long)worst, got[worst], ref[worst]);
    free(ref);
    free(got);
}

TEST(linear_conv1d_values) {
    anneal_scope *s = anneal_scope_open();
    const int64_t in = 37, out = 19;
    anneal_tensor *x = anneal_test_rand(3, (int64_t[]){2, 5, in}, -1, 1, 100, false);
    anneal_tensor *wl = anneal_test_rand(2, (int64_t[]){out, in}, -1, 1, 101, false);
    anneal_tensor *wc = anneal_test_rand(2, (int64_t[]){in, out}, -1, 1, 102, false);
    anneal_tensor *b = anneal_test_rand(1, (int64_t[]){out}, -1, 1, 103, false);
    for (int lin = 0; lin < 2; lin++) {
        anneal_tensor *w = lin ? wl : wc;
        check_dense(x, w, b, lin, lin ? "linear 3-D bias" : "conv1d 3-D bias");
        check_dense(x, w, NULL, lin, lin ? "linear 3-D no bias" : "conv1d 3-D no bias");
        /* 1-D x, a strided x whose rows do not merge (copied), a transposed weight. */
        anneal_tensor *x1 = anneal_test_rand(1, (int64_t[]){in}, -1, 1, 104, false);
        check_dense(x1, w, b, lin, "1-D x");
        anneal_tensor *xt = anneal_transpose(anneal_test_rand(3, (int64_t[]){5, 2, in}, -1, 1, 105, false), 0, 1);
        check_dense(xt, w, b, lin, "x transposed in its leading dims");
        anneal_tensor *xc = anneal_transpose(anneal_test_rand(2, (int64_t[]){in, 6}, -1, 1, 106, false), 0, 1);
        check_dense(xc, w, NULL, lin, "column-major x");
        anneal_tensor *wt = anneal_transpose(anneal_test_rand(2, (int64_t[]){w->shape[1], w->shape[0]}, -1, 1, 107, false), 0, 1);
        check_dense(x, wt, b, lin, "transposed weight view");
    }
    /* linear(x, w, b) is conv1d(x, w^T, b) bit for bit (same GEMM on the same view). */
    anneal_tensor *y1 = anneal_linear(x, wl, b), *y2 = anneal_conv1d(x, anneal_transpose(wl, 0, 1), b);
    REQUIRE(y1 && y2);
    float *v1 = values(y1), *v2 = values(y2);
    CHECK(memcmp(v1, v2, sizeof(float) * (size_t)anneal_numel(y1)) == 0, "linear != conv1d(w^T)");
    free(v1);
    free(v2);
    anneal_scope_close(s);
}

static anneal_tensor *f_dense(void *c, anneal_tensor *const *x) {
    int mode = *(int *)c; /* bit 0: linear; bit 1: no bias; bit 2: transposed x */
    anneal_tensor *xi = (mode & 4) ? anneal_transpose(x[0], 0, 1) : x[0];
    anneal_tensor *b = (mode & 2) ? NULL : x[2];
    return (mode & 1) ? anneal_linear(xi, x[1], b) : anneal_conv1d(xi, x[1], b);
}

TEST(linear_conv1d_gradients) {
    anneal_scope *s = anneal_scope_open();
    /* Linear in every input: atol 1e-3, rtol 1e-2 as for matmul. */
    for (int mode = 0; mode < 8; mode++) {
        bool lin = mode & 1;
        int64_t in = 4, out = 3;
        int64_t wshape[2] = {lin ? out : in, lin ? in : out};
        anneal_tensor *x[3] = {
            anneal_test_rand(3, (mode & 4) ? (int64_t[]){3, 2, in} : (int64_t[]){2, 3, in}, -1, 1, 110 + mode, true),
            anneal_test_rand(2, wshape, -1, 1, 120 + mode, true),
            anneal_test_rand(1, (int64_t[]){out}, -1, 1, 130 + mode, true)};
        /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.76% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_dense, &mode, (mode & 2) ? 2 : 3, x, 1e-2, 1e-4, 1e-3);
    }
    /* Weight frozen, bias and x trained. */
    int mode = 1;
    anneal_tensor *y[3] = {anneal_test_rand(3, (int64_t[]){2, 3, 4}, -1, 1, 140, true),
                           anneal_test_rand(2, (int64_t[]){3, 4}, -1, 1, 141, false),
                           anneal_test_rand(1, (int64_t[]){3}, -1, 1, 142, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.28% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_dense, &mode, 3, y, 1e-2, 5e-5, 5e-4);
    CHECK_TRUE(y[1]->grad == NULL);
    anneal_scope_close(s);
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
    anneal_tensor *a = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){3, 4});
    anneal_tensor *b = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){5, 6});
    expect_error(anneal_matmul(a, b), ANNEAL_ERR_SHAPE, "inner dims differ", "K mismatch");
    anneal_tensor *v = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){4});
    expect_error(anneal_matmul(a, v), ANNEAL_ERR_SHAPE, "at least 2 dims", "1-D b");
    expect_error(anneal_matmul(v, a), ANNEAL_ERR_SHAPE, "at least 2 dims", "1-D a");
    anneal_tensor *a3 = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 3, 4});
    anneal_tensor *b3 = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){3, 4, 5});
    expect_error(anneal_matmul(a3, b3), ANNEAL_ERR_SHAPE, "do not broadcast", "batch mismatch");
    anneal_tensor *ai = anneal_zeros(ANNEAL_I32, 2, (int64_t[]){3, 4});
    expect_error(anneal_matmul(ai, anneal_zeros(ANNEAL_F32, 2, (int64_t[]){4, 2})), ANNEAL_ERR_DTYPE,
                 "i32", "i32 input");
    /* NULL input: NULL back, first error kept. */
    expect_error(anneal_matmul(a, b), ANNEAL_ERR_SHAPE, "inner", "setup");
    CHECK_TRUE(anneal_matmul(a, b) == NULL);
    CHECK_TRUE(anneal_matmul(NULL, a) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();

    anneal_tensor *x = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 3, 4});
    anneal_tensor *wl = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){5, 4});
    expect_error(anneal_linear(x, anneal_zeros(ANNEAL_F32, 2, (int64_t[]){4, 5}), NULL), ANNEAL_ERR_SHAPE,
                 "features", "linear in mismatch");
    expect_error(anneal_conv1d(x, wl, NULL), ANNEAL_ERR_SHAPE, "features", "conv1d in mismatch");
    expect_error(anneal_linear(x, v, NULL), ANNEAL_ERR_SHAPE, "2-D", "1-D weight");
    expect_error(anneal_linear(x, wl, anneal_zeros(ANNEAL_F32, 1, (int64_t[]){4})), ANNEAL_ERR_SHAPE,
                 "bias", "bias size");
    expect_error(anneal_linear(anneal_scalar(1.0f), wl, NULL), ANNEAL_ERR_SHAPE, "0-dim", "0-dim x");
    expect_error(anneal_linear(anneal_zeros(ANNEAL_I32, 2, (int64_t[]){2, 4}), wl, NULL), ANNEAL_ERR_DTYPE,
                 "i32", "i32 x");
    anneal_scope_close(s);
}

int main(void) {
    RUN(matmul_values_all_transposes);
    RUN(matmul_values_broadcast_batch);
    RUN(matmul_transposed_view_is_not_copied);
    RUN(matmul_gradients);
    RUN(linear_conv1d_values);
    RUN(linear_conv1d_gradients);
    RUN(errors);
    return anneal_test_summary();
}
