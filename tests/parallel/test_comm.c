/* The communicator's collectives against expectations every rank computes locally:
 * each rank's input is a deterministic function of (rank, index, tag), so any rank can
 * build every rank's input and reduce it itself in rank order. Runs with world 1 (the
 * single-process communicator) and again under mpirun with worlds 2, 3 and 4 (dist_test.h).
 *
 * Tolerance: with two ranks a sum is one f32 addition (a + b == b + a exactly), and a
 * mean divides it by 2 (exact), so results must match bit for bit; a world larger
 * than 2 may associate the sum differently from rank order, so there the check is
 * 1e-6 relative. bf16: the f32 sum is rounded once, so the expectation rounds the f32
 * rank-order sum once. */
#include "dist_test.h"

#include <stdint.h>

/* A float in [-1, 1) from (rank, i, tag) (splitmix64). */
static float val(int rank, int64_t i, int tag) {
    uint64_t z = (uint64_t)rank * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull + (uint64_t)tag * 0x94D049BB133111EBull + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)((double)(z >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

/* The reduction of element i over all ranks, in rank order, as f32. */
static float expect_sum(int64_t i, int tag, bool mean, bool bf16_in) {
    float s = 0;
    for (int r = 0; r < dt_world(); r++) {
        float v = val(r, i, tag);
        if (bf16_in) v = anneal_bf16_to_f32(anneal_f32_to_bf16(v));
        s += v;
    }
    return mean ? s / (float)dt_world() : s;
}

static bool close_enough(float got, float want) {
    if (dt_world() <= 2) return memcmp(&got, &want, sizeof got) == 0;
    return fabsf(got - want) <= 1e-6f * fmaxf(1.0f, fabsf(want));
}

static const int64_t COUNTS[] = {0, 1, 7, 1000, 4099};
#define N_COUNTS (int)(sizeof COUNTS / sizeof *COUNTS)

TEST(world_info) {
    CHECK_TRUE(dt_world() >= 1);
    CHECK_TRUE(dt_rank() >= 0 && dt_rank() < dt_world());
    CHECK_TRUE(anneal_comm_local_rank(g_comm) >= 0 && anneal_comm_local_rank(g_comm) < dt_world());
    const char *be = anneal_comm_backend(g_comm);
    CHECK(strcmp(be, dt_under_launcher() ? "mpi" : "single") == 0, "backend %s", be);
    CHECK_TRUE(anneal_comm_barrier(g_comm) == ANNEAL_OK);
}

/* f32 and bf16 all-reduce, sum and mean, blocking, over odd and zero counts. */
TEST(allreduce) {
    for (int ci = 0; ci < N_COUNTS; ci++) {
        int64_t n = COUNTS[ci];
        for (int mean = 0; mean < 2; mean++) {
            anneal_reduce_op op = mean ? ANNEAL_REDUCE_MEAN : ANNEAL_REDUCE_SUM;
            int tag = (int)(ci * 4 + mean);
            float *f = malloc((size_t)(n + 1) * sizeof *f);
            uint16_t *h = malloc((size_t)(n + 1) * sizeof *h);
            for (int64_t i = 0; i < n; i++) {
                f[i] = val(dt_rank(), i, tag);
                h[i] = anneal_f32_to_bf16(val(dt_rank(), i, tag));
            }
            CHECK_TRUE(anneal_comm_allreduce(g_comm, f, n, ANNEAL_F32, op) == ANNEAL_OK);
            CHECK_TRUE(anneal_comm_allreduce(g_comm, h, n, ANNEAL_BF16, op) == ANNEAL_OK);
            int bad = 0, bad16 = 0;
            for (int64_t i = 0; i < n; i++) {
                if (!close_enough(f[i], expect_sum(i, tag, mean, false))) bad++;
                uint16_t want = anneal_f32_to_bf16(expect_sum(i, tag, mean, true));
                if (dt_world() <= 2 ? h[i] != want
                                    : fabsf(anneal_bf16_to_f32(h[i]) - anneal_bf16_to_f32(want)) >
                                          1e-2f * fmaxf(1.0f, fabsf(anneal_bf16_to_f32(want))))
                    bad16++;
            }
            CHECK(bad == 0 && bad16 == 0, "count %lld %s: %d f32 and %d bf16 mismatches", (long long)n,
                  mean ? "mean" : "sum", bad, bad16);
            free(f);
            free(h);
        }
    }
}

TEST(reduce_scatter) {
    int W = dt_world(), r = dt_rank();
    for (int ci = 0; ci < N_COUNTS; ci++) {
        int64_t n = COUNTS[ci];
        for (int mean = 0; mean < 2; mean++) {
            anneal_reduce_op op = mean ? ANNEAL_REDUCE_MEAN : ANNEAL_REDUCE_SUM;
            int tag = 100 + (int)(ci * 4 + mean);
            float *send = malloc((size_t)(n * W + 1) * sizeof *send), *recv = malloc((size_t)(n + 1) * sizeof *recv);
            uint16_t *s16 = malloc((size_t)(n * W + 1) * sizeof *s16), *r16 = malloc((size_t)(n + 1) * sizeof *r16);
            for (int64_t i = 0; i < n * W; i++) {
                send[i] = val(r, i, tag);
                s16[i] = anneal_f32_to_bf16(send[i]);
            }
            CHECK_TRUE(anneal_comm_reduce_scatter(g_comm, send, recv, n, ANNEAL_F32, op) == ANNEAL_OK);
            CHECK_TRUE(anneal_comm_reduce_scatter(g_comm, s16, r16, n, ANNEAL_BF16, op) == ANNEAL_OK);
            int bad = 0;
            for (int64_t i = 0; i < n; i++) {
                int64_t gi = (int64_t)r * n + i; /* this rank's block of the reduction */
                if (!close_enough(recv[i], expect_sum(gi, tag, mean, false))) bad++;
                if (dt_world() <= 2 && r16[i] != anneal_f32_to_bf16(expect_sum(gi, tag, mean, true))) bad++;
            }
            CHECK(bad == 0, "count %lld %s: %d mismatches", (long long)n, mean ? "mean" : "sum", bad);
            free(send);
            free(recv);
            free(s16);
            free(r16);
        }
    }
}

/* Any dtype: f32, bf16 (raw 16-bit) and i32, gathered in rank order. */
TEST(all_gather) {
    int W = dt_world(), r = dt_rank();
    for (int ci = 0; ci < N_COUNTS; ci++) {
        int64_t n = COUNTS[ci];
        float *f = malloc((size_t)(n + 1) * sizeof *f), *fa = malloc((size_t)(n * W + 1) * sizeof *fa);
        uint16_t *h = malloc((size_t)(n + 1) * sizeof *h), *ha = malloc((size_t)(n * W + 1) * sizeof *ha);
        int32_t *k = malloc((size_t)(n + 1) * sizeof *k), *ka = malloc((size_t)(n * W + 1) * sizeof *ka);
        for (int64_t i = 0; i < n; i++) {
            f[i] = val(r, i, 200);
            h[i] = anneal_f32_to_bf16(f[i]);
            k[i] = (int32_t)(r * 100000 + i);
        }
        CHECK_TRUE(anneal_comm_all_gather(g_comm, f, fa, n, ANNEAL_F32) == ANNEAL_OK);
        CHECK_TRUE(anneal_comm_all_gather(g_comm, h, ha, n, ANNEAL_BF16) == ANNEAL_OK);
        CHECK_TRUE(anneal_comm_all_gather(g_comm, k, ka, n, ANNEAL_I32) == ANNEAL_OK);
        int bad = 0;
        for (int q = 0; q < W; q++)
            for (int64_t i = 0; i < n; i++) {
                float want = val(q, i, 200);
                if (memcmp(&fa[q * n + i], &want, 4) != 0) bad++;
                if (ha[q * n + i] != anneal_f32_to_bf16(want)) bad++;
                if (ka[q * n + i] != (int32_t)(q * 100000 + i)) bad++;
            }
        CHECK(bad == 0, "count %lld: %d mismatches", (long long)n, bad);
        free(f), free(fa), free(h), free(ha), free(k), free(ka);
    }
}

TEST(broadcast) {
    int W = dt_world(), r = dt_rank();
    for (int root = 0; root < W; root++) { /* every root: with W > 2 some are neither first nor last */
        for (int ci = 0; ci < N_COUNTS; ci++) {
            int64_t n = COUNTS[ci];
            float *f = malloc((size_t)(n + 1) * sizeof *f);
            uint8_t *b = malloc((size_t)(n + 1));
            for (int64_t i = 0; i < n; i++) {
                f[i] = val(r, i, 300);
                b[i] = (uint8_t)(r * 7 + i);
            }
            CHECK_TRUE(anneal_comm_broadcast(g_comm, f, n, ANNEAL_F32, root) == ANNEAL_OK);
            CHECK_TRUE(anneal_comm_broadcast(g_comm, b, n, ANNEAL_U8, root) == ANNEAL_OK);
            int bad = 0;
            for (int64_t i = 0; i < n; i++) {
                float want = val(root, i, 300);
                if (memcmp(&f[i], &want, 4) != 0 || b[i] != (uint8_t)(root * 7 + i)) bad++;
            }
            CHECK(bad == 0, "root %d count %lld: %d mismatches", root, (long long)n, bad);
            free(f);
            free(b);
        }
    }
}

/* Several non-blocking collectives in flight at once, driven by test, then waited:
 * same bits as the blocking calls. */
TEST(non_blocking) {
    int W = dt_world(), r = dt_rank();
    const int64_t n = 3001;
    float *a = malloc(n * sizeof *a), *a_ref = malloc(n * sizeof *a_ref);
    uint16_t *h = malloc(n * sizeof *h), *h_ref = malloc(n * sizeof *h_ref);
    float *rs_in = malloc((size_t)(n * W) * sizeof *rs_in), *rs_out = malloc(n * sizeof *rs_out),
          *rs_ref = malloc(n * sizeof *rs_ref);
    float *ag = malloc((size_t)(n * W) * sizeof *ag), *ag_ref = malloc((size_t)(n * W) * sizeof *ag_ref);
    for (int64_t i = 0; i < n; i++) {
        a[i] = a_ref[i] = val(r, i, 400);
        h[i] = h_ref[i] = anneal_f32_to_bf16(val(r, i, 401));
    }
    for (int64_t i = 0; i < n * W; i++) rs_in[i] = val(r, i, 402);
    CHECK_TRUE(anneal_comm_allreduce(g_comm, a_ref, n, ANNEAL_F32, ANNEAL_REDUCE_MEAN) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_allreduce(g_comm, h_ref, n, ANNEAL_BF16, ANNEAL_REDUCE_SUM) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_reduce_scatter(g_comm, rs_in, rs_ref, n, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_all_gather(g_comm, a, ag_ref, n, ANNEAL_F32) == ANNEAL_OK);
    anneal_comm_request *q[4] = {0};
    CHECK_TRUE(anneal_comm_all_gather_start(g_comm, a, ag, n, ANNEAL_F32, &q[3]) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_reduce_scatter_start(g_comm, rs_in, rs_out, n, ANNEAL_F32, ANNEAL_REDUCE_SUM, &q[2]) ==
               ANNEAL_OK);
    /* a is read by the all-gather in flight: the all-reduce works on a copy. */
    float *a2 = malloc(n * sizeof *a2);
    memcpy(a2, a, n * sizeof *a2);
    CHECK_TRUE(anneal_comm_allreduce_start(g_comm, a2, n, ANNEAL_F32, ANNEAL_REDUCE_MEAN, &q[0]) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_allreduce_start(g_comm, h, n, ANNEAL_BF16, ANNEAL_REDUCE_SUM, &q[1]) == ANNEAL_OK);
    int spins = 0;
    for (bool all = false; !all && spins < 10000000; spins++) {
        all = true;
        for (int k = 0; k < 4; k++) {
            bool done = false;
            CHECK_TRUE(anneal_comm_test(q[k], &done) == ANNEAL_OK);
            all &= done;
        }
    }
    for (int k = 0; k < 4; k++) CHECK_TRUE(anneal_comm_wait(q[k]) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_wait(NULL) == ANNEAL_OK);
    CHECK_TRUE(memcmp(a2, a_ref, n * sizeof *a2) == 0);
    CHECK_TRUE(memcmp(h, h_ref, n * sizeof *h) == 0);
    CHECK_TRUE(memcmp(rs_out, rs_ref, n * sizeof *rs_out) == 0);
    CHECK_TRUE(memcmp(ag, ag_ref, (size_t)(n * W) * sizeof *ag) == 0);
    /* And against the local expectation. */
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!close_enough(a2[i], expect_sum(i, 400, true, false))) bad++;
    CHECK(bad == 0, "%d mismatches", bad);
    /* A zero-count non-blocking call still completes. */
    anneal_comm_request *z = NULL;
    CHECK_TRUE(anneal_comm_allreduce_start(g_comm, NULL, 0, ANNEAL_F32, ANNEAL_REDUCE_SUM, &z) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_wait(z) == ANNEAL_OK);
    free(a), free(a_ref), free(a2), free(h), free(h_ref), free(rs_in), free(rs_out), free(rs_ref), free(ag), free(ag_ref);
}

/* Bad arguments are caught before any transport (so all ranks fail alike, no hang). */
/* Split by parity: the sub-worlds have the right sizes and ranks, and an all-reduce in
 * one sums only its own members. */
TEST(split) {
    int w = dt_world(), r = dt_rank();
    anneal_comm *sub = anneal_comm_split(g_comm, r % 2, -r); /* key -r: reversed order */
    CHECK(sub != NULL, "split: %s", anneal_last_error());
    if (!sub) return;
    int members = (w + 1 - r % 2) / 2; /* ranks with the same parity */
    CHECK(anneal_comm_size(sub) == members, "sub size %d, want %d", anneal_comm_size(sub), members);
    /* reversed key: the highest rank of the color is rank 0 of the sub-world */
    int above = 0;
    for (int q = r + 1; q < w; q++) above += q % 2 == r % 2;
    CHECK(anneal_comm_rank(sub) == above, "sub rank %d, want %d", anneal_comm_rank(sub), above);
    float v = (float)(r + 1), want = 0;
    for (int q = 0; q < w; q++) if (q % 2 == r % 2) want += (float)(q + 1);
    CHECK_TRUE(anneal_comm_allreduce(sub, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_OK);
    CHECK(v == want, "sub all-reduce %g, want %g", v, want);
    anneal_comm_free(sub);
    CHECK_TRUE(anneal_comm_split(g_comm, -1, 0) == NULL);
}

/* A ring: each rank sends its values to the next and receives the previous rank's, with
 * the blocking calls and the non-blocking ones; a world of one has no peer. */
TEST(send_recv) {
    int w = dt_world(), r = dt_rank();
    if (w == 1) {
        float x = 1;
        CHECK_TRUE(anneal_comm_send(g_comm, &x, 1, ANNEAL_F32, 0, 0) == ANNEAL_ERR_ARG);
        CHECK_TRUE(anneal_comm_recv(g_comm, &x, 1, ANNEAL_F32, 0, 0) == ANNEAL_ERR_ARG);
        return;
    }
    enum { N = 1037 };
    float out[N], in[N];
    for (int i = 0; i < N; i++) out[i] = (float)(r * 10000 + i);
    int next = (r + 1) % w, prev = (r + w - 1) % w;
    anneal_comm_request *rr = NULL, *sr = NULL;
    CHECK_TRUE(anneal_comm_recv_start(g_comm, in, N, ANNEAL_F32, prev, 7, &rr) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_send_start(g_comm, out, N, ANNEAL_F32, next, 7, &sr) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_wait(sr) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_wait(rr) == ANNEAL_OK);
    bool ok = true;
    for (int i = 0; i < N; i++) ok &= in[i] == (float)(prev * 10000 + i);
    CHECK(ok, "ring (non-blocking): wrong values from rank %d", prev);
    /* blocking: even ranks send first, odd ranks receive first (no deadlock for any w) */
    int32_t a = r, b = -1;
    if (r % 2 == 0) {
        if (r + 1 < w) CHECK_TRUE(anneal_comm_send(g_comm, &a, 1, ANNEAL_I32, r + 1, 3) == ANNEAL_OK);
        if (r + 1 < w) CHECK_TRUE(anneal_comm_recv(g_comm, &b, 1, ANNEAL_I32, r + 1, 4) == ANNEAL_OK);
        if (r + 1 < w) CHECK(b == r + 1, "got %d from %d", (int)b, r + 1);
    } else {
        CHECK_TRUE(anneal_comm_recv(g_comm, &b, 1, ANNEAL_I32, r - 1, 3) == ANNEAL_OK);
        CHECK_TRUE(anneal_comm_send(g_comm, &a, 1, ANNEAL_I32, r - 1, 4) == ANNEAL_OK);
        CHECK(b == r - 1, "got %d from %d", (int)b, r - 1);
    }
    CHECK_TRUE(anneal_comm_send(g_comm, &a, 1, ANNEAL_I32, r, 0) == ANNEAL_ERR_ARG);    /* itself */
    CHECK_TRUE(anneal_comm_send(g_comm, &a, 1, ANNEAL_I32, next, 40000) == ANNEAL_ERR_ARG); /* tag */
}

TEST(argument_errors) {
    float x[4] = {0};
    anneal_clear_error();
    CHECK_TRUE(anneal_comm_allreduce(g_comm, x, 4, ANNEAL_I32, ANNEAL_REDUCE_SUM) == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_comm_allreduce(g_comm, x, -1, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_comm_broadcast(g_comm, x, 4, ANNEAL_F32, dt_world()) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "root") != NULL, "%s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_comm_allreduce(NULL, x, 4, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_comm_allreduce_start(g_comm, x, 4, ANNEAL_F32, ANNEAL_REDUCE_SUM, NULL) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_comm_reduce_scatter(g_comm, x, NULL, 4, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(strcmp(anneal_comm_backend(g_comm), "mpi") != 0 || anneal_comm_mpi_available());
}

static void run_all(void) {
    RUN(world_info);
    RUN(allreduce);
    RUN(reduce_scatter);
    RUN(all_gather);
    RUN(broadcast);
    RUN(non_blocking);
    RUN(split);
    RUN(send_recv);
    RUN(argument_errors);
}

/* 3 and 4 ranks run the world > 2 branches: sums whose association MPI chooses, a
 * broadcast root in the middle of the ranks' order. */
int main(void) {
    static const int worlds[] = {2, 3, 4};
    return dt_main_worlds(run_all, worlds, 3, false);
}
