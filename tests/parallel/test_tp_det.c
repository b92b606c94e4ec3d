/* --deterministic's chunked tensor-parallel projections (src/parallel/tp_det.c):
 * anneal_tp_det_col (a packed [q | k | v] column-parallel projection with bias) and
 * anneal_tp_det_row (a row-parallel one, both weight layouts) on this rank's shard of
 * G = 4 (or 6) chunks, against
 * - the same op over the whole tensors in one process (group NULL, all G chunks): the
 *   output, the input gradient and the weight and bias gradients' slices BIT-identical
 *   (what makes --tp runs equal the one-process run);
 * - the plain dense layer (one GEMM over the whole): within float-summation tolerance
 *   (1e-5 absolute + 1e-4 relative on O(1) values; a wrong chunk, a missing partial or
 *   a misplaced column is off by O(0.1..1)).
 * Runs at world 1 and under mpirun -np 2 (dist_test.h): with 2 ranks each holds 2 of
 * the 4 chunks and the partials travel through the all-gather. */
#include "dist_test.h"

#include <math.h>
#include <string.h>

#define ATOL 1e-5
#define RTOL 1e-4

static bool close_all(const char *what, const anneal_tensor *a, const anneal_tensor *b) {
    if (!a || !b || anneal_numel(a) != anneal_numel(b)) {
        printf("    %s: missing or of another size\n", what);
        return false;
    }
    double worst = 0;
    bool ok = true;
    for (int64_t i = 0; i < anneal_numel(a); i++) {
        double u = anneal_item_at(a, i), v = anneal_item_at(b, i), d = fabs(u - v);
        if (!(d <= ATOL + RTOL * fabs(v))) ok = false;
        if (!(d <= worst)) worst = d;
    }
    if (!ok) printf("    %s: differs by %.3g\n", what, worst);
    return ok;
}

static bool same_bits(const char *what, const anneal_tensor *a, const anneal_tensor *b) {
    bool ok = a && b && anneal_numel(a) == anneal_numel(b) &&
              memcmp(anneal_data(a), anneal_data(b), (size_t)anneal_numel(a) * sizeof(float)) == 0;
    if (!ok) printf("    %s: not bit-identical to the one-process chunked op\n", what);
    return ok;
}

/* This rank's slice of whole along dim in `parts` segments (a fresh tensor). */
static anneal_tensor *slice(anneal_tensor *whole, int dim, int parts) {
    int w = dt_world();
    int64_t shape[ANNEAL_MAX_DIMS];
    memcpy(shape, whole->shape, sizeof(int64_t) * (size_t)whole->ndim);
    shape[dim] /= w;
    anneal_tensor *s = anneal_empty(ANNEAL_F32, whole->ndim, shape);
    anneal_tp_split sp = {.dim = w > 1 ? dim : -1, .parts = parts};
    return s && anneal_tp_slice(whole, s, sp, dt_rank()) == ANNEAL_OK ? s : NULL;
}

/* A leaf copy that requires grad. */
static anneal_tensor *leaf(anneal_tensor *t) {
    anneal_tensor *c = anneal_clone(t);
    return c && anneal_set_requires_grad(c, true) == ANNEAL_OK ? c : NULL;
}

/* x (R, K) through a [q | k | v] projection (K, 3F) + bias, F = G chunks of 3 columns:
 * the shard's op vs the whole op (bits) vs the plain dense (tolerance). G 4 at 2
 * ranks: dx's partials summed per rank (a subtree), then the butterfly; G 6: 3 per
 * rank, every partial gathered. */
static void check_col(int G) {
    int w = dt_world();
    int64_t R = 7, K = 10, F = 3 * G;
    anneal_scope *sc = anneal_scope_open();
    anneal_manual_seed(11); /* the same whole tensors on every rank */
    anneal_tensor *x = anneal_randn(ANNEAL_F32, 2, (int64_t[]){R, K}, 0, 1);
    anneal_tensor *wt = anneal_randn(ANNEAL_F32, 2, (int64_t[]){K, 3 * F}, 0, 0.5f);
    anneal_tensor *b = anneal_randn(ANNEAL_F32, 1, (int64_t[]){3 * F}, 0, 0.5f);
    anneal_tensor *dy = anneal_randn(ANNEAL_F32, 2, (int64_t[]){R, 3 * F}, 0, 1);
    REQUIRE(x && wt && b && dy);
    /* the whole, chunked, in one process */
    anneal_tensor *x1 = leaf(x), *w1 = leaf(wt), *b1 = leaf(b);
    anneal_tensor *y1 = anneal_tp_det_col(NULL, x1, w1, b1, ANNEAL_WEIGHT_IN_OUT, 3, G, ANNEAL_F32);
    REQUIRE(y1 && anneal_backward(anneal_sum(anneal_mul(y1, dy))) == ANNEAL_OK);
    /* plain */
    anneal_tensor *x0 = leaf(x), *w0 = leaf(wt), *b0 = leaf(b);
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_IN_OUT};
    anneal_tensor *y0 = anneal_dense(x0, w0, b0, &o);
    REQUIRE(y0 && anneal_backward(anneal_sum(anneal_mul(y0, dy))) == ANNEAL_OK);
    /* this rank's shard: G / w chunks */
    anneal_tensor *xs = leaf(x), *ws = leaf(slice(wt, 1, 3)), *bs = leaf(slice(b, 0, 3));
    anneal_tensor *ys = anneal_tp_det_col(g_comm, xs, ws, bs, ANNEAL_WEIGHT_IN_OUT, 3, G / w, ANNEAL_F32);
    REQUIRE(ys && anneal_backward(anneal_sum(anneal_mul(ys, slice(dy, 1, 3)))) == ANNEAL_OK);
    bool ok = close_all("y", y1, y0) && close_all("dx", x1->grad, x0->grad) && close_all("dW", w1->grad, w0->grad) &&
              close_all("db", b1->grad, b0->grad);
    ok = same_bits("y shard", ys, slice(y1, 1, 3)) && ok;
    ok = same_bits("dx", xs->grad, x1->grad) && ok;
    ok = same_bits("dW shard", ws->grad, slice(w1->grad, 1, 3)) && ok;
    ok = same_bits("db shard", bs->grad, slice(b1->grad, 0, 3)) && ok;
    CHECK(dt_all(ok), "the chunked column-parallel projection, %d chunks (see above)", G);
    anneal_scope_close(sc);
}

TEST(column_parallel_packed) { check_col(4); }
TEST(column_parallel_packed_6_chunks) { check_col(6); }

/* x (R, K) through a row-parallel projection, K = G chunks of 5 inputs, in the given
 * layout: the shard's op (this rank's input columns) vs the whole op (bits) vs the
 * plain dense (tolerance). G 4 at 2 ranks: each rank's 2 chunks are a subtree (summed,
 * then the butterfly); G 6: 3 each, every partial gathered. */
static void check_row(anneal_weight_layout layout, int G) {
    int w = dt_world();
    int64_t R = 6, K = 5 * G, N = 9;
    bool io = layout == ANNEAL_WEIGHT_IN_OUT;
    anneal_scope *sc = anneal_scope_open();
    anneal_manual_seed(5);
    anneal_tensor *x = anneal_randn(ANNEAL_F32, 3, (int64_t[]){2, R / 2, K}, 0, 1);
    anneal_tensor *wt = anneal_randn(ANNEAL_F32, 2, io ? (int64_t[]){K, N} : (int64_t[]){N, K}, 0, 0.5f);
    anneal_tensor *dy = anneal_randn(ANNEAL_F32, 3, (int64_t[]){2, R / 2, N}, 0, 1);
    REQUIRE(x && wt && dy);
    anneal_tensor *x1 = leaf(x), *w1 = leaf(wt);
    anneal_tensor *y1 = anneal_tp_det_row(NULL, x1, w1, layout, G, ANNEAL_F32);
    REQUIRE(y1 && anneal_backward(anneal_sum(anneal_mul(y1, dy))) == ANNEAL_OK);
    anneal_tensor *x0 = leaf(x), *w0 = leaf(wt);
    anneal_dense_opts o = {.layout = layout};
    anneal_tensor *y0 = anneal_dense(x0, w0, NULL, &o);
    REQUIRE(y0 && anneal_backward(anneal_sum(anneal_mul(y0, dy))) == ANNEAL_OK);
    anneal_tensor *xs = leaf(slice(x, 2, 1)), *ws = leaf(slice(wt, io ? 0 : 1, 1));
    anneal_tensor *ys = anneal_tp_det_row(g_comm, xs, ws, layout, G / w, ANNEAL_F32);
    REQUIRE(ys && anneal_backward(anneal_sum(anneal_mul(ys, dy))) == ANNEAL_OK);
    bool ok = close_all("y", y1, y0) && close_all("dx", x1->grad, x0->grad) && close_all("dW", w1->grad, w0->grad);
    ok = same_bits("y (replicated)", ys, y1) && ok;
    ok = same_bits("dx shard", xs->grad, slice(x1->grad, 2, 1)) && ok;
    ok = same_bits("dW shard", ws->grad, slice(w1->grad, io ? 0 : 1, 1)) && ok;
    CHECK(dt_all(ok), "the chunked row-parallel projection, layout %s (see above)", io ? "(in, out)" : "(out, in)");
    anneal_scope_close(sc);
}

TEST(row_parallel_in_out) { check_row(ANNEAL_WEIGHT_IN_OUT, 4); }
TEST(row_parallel_out_in_6_chunks) { check_row(ANNEAL_WEIGHT_OUT_IN, 6); }

/* A weight whose split dimension does not cut into the chunks: a shape error naming the op. */
TEST(chunks_must_divide) {
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *x = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){2, 6});
    anneal_tensor *wt = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){6, 5});
    CHECK(!anneal_tp_det_col(NULL, x, wt, NULL, ANNEAL_WEIGHT_IN_OUT, 1, 4, ANNEAL_F32) &&
              strstr(anneal_last_error(), "anneal_tp_det_col"), "got: %s", anneal_last_error());
    anneal_clear_error();
    CHECK(!anneal_tp_det_row(NULL, x, wt, ANNEAL_WEIGHT_IN_OUT, 4, ANNEAL_F32) &&
              strstr(anneal_last_error(), "anneal_tp_det_row"), "got: %s", anneal_last_error());
    anneal_clear_error();
    anneal_scope_close(sc);
}

static void run_all(void) {
    RUN(column_parallel_packed);
    RUN(column_parallel_packed_6_chunks);
    RUN(row_parallel_in_out);
    RUN(row_parallel_out_in_6_chunks);
    RUN(chunks_must_divide);
}

int main(void) { return dt_main(run_all); }
