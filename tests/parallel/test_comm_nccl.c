/* The NCCL communicator (src/parallel/comm_nccl.c), in one process and under mpirun -np 2.
 * Without a GPU only the bootstrap runs: rank 0's ncclUniqueId reaches every rank over
 * the host communicator, byte for byte, and bad arguments are refused. Where there is a
 * GPU per rank, every collective runs on device buffers (through the CUDA backend's
 * table) against the values the host communicator gives; elsewhere that test skips,
 * saying why. A build without NCCL skips both. */
#include "anneal/backend.h"
#include "anneal/cuda.h"
#include "dist_test.h"

#include <string.h>

TEST(bootstrap_id) {
    if (!anneal_comm_nccl_available()) SKIP("this build has no NCCL (a CPU build, or no libnccl with the toolkit)");
    unsigned char id[128], all[4 * 128];
    CHECK_TRUE(anneal_comm_nccl_bootstrap_id(g_comm, id, sizeof id) == ANNEAL_OK);
    int nonzero = 0;
    for (int i = 0; i < 128; i++) nonzero += id[i] != 0;
    CHECK(nonzero > 0, "rank %d: the id is all zeros", dt_rank());
    /* every rank holds rank 0's bytes */
    REQUIRE(dt_world() <= 4);
    REQUIRE(anneal_comm_all_gather(g_comm, id, all, 32, ANNEAL_I32) == ANNEAL_OK);
    for (int r = 1; r < dt_world(); r++)
        CHECK(memcmp(all, all + 128 * r, 128) == 0, "rank %d's id differs from rank 0's", r);
    CHECK_TRUE(anneal_comm_nccl_bootstrap_id(g_comm, id, 5) == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_comm_nccl_bootstrap_id(NULL, id, sizeof id) == ANNEAL_ERR_ARG);
    anneal_clear_error();
}

/* Host values x (n floats) into GPU memory, or back. */
static void *to_gpu(const anneal_backend *b, const float *x, int64_t n) {
    void *d = b->alloc(b->ctx, (size_t)n * sizeof(float));
    if (d && b->copy_from_host(b->ctx, d, x, (size_t)n * sizeof(float)) != ANNEAL_OK) return NULL;
    return d && b->synchronize(b->ctx) == ANNEAL_OK ? d : NULL;
}
static bool from_gpu(const anneal_backend *b, float *x, const void *d, int64_t n) {
    return b->copy_to_host(b->ctx, x, d, (size_t)n * sizeof(float)) == ANNEAL_OK && b->synchronize(b->ctx) == ANNEAL_OK;
}

TEST(collectives_on_gpu) {
    if (!anneal_comm_nccl_available()) SKIP("this build has no NCCL");
    char why[256] = "";
    int gpus = anneal_cuda_device_count(why, sizeof why);
    /* the same decision on every rank, so no rank waits in a collective alone */
    bool enough = dt_all(gpus >= anneal_comm_local_size(g_comm));
    if (!enough)
        SKIP("NCCL needs a GPU per rank: %d here for %d local ranks (%s)", gpus > 0 ? gpus : 0,
             anneal_comm_local_size(g_comm), why[0] ? why : "no GPU");
    const anneal_backend *b = anneal_backend_get(ANNEAL_CUDA);
    REQUIRE(b);
    anneal_comm *nc = anneal_comm_nccl_new(g_comm, anneal_comm_local_rank(g_comm));
    REQUIRE(nc);
    CHECK_TRUE(!strcmp(anneal_comm_backend(nc), "nccl") && anneal_comm_size(nc) == dt_world() &&
               anneal_comm_rank(nc) == dt_rank());
    enum { N = 1000 };
    const int w = dt_world(), r = dt_rank();
    float x[N * 4], y[N * 4], want[N * 4];
    for (int i = 0; i < N; i++) x[i] = (float)(i % 17) * 0.25f + (float)r; /* exact sums */
    /* all-reduce, sum and mean, blocking and not */
    void *d = to_gpu(b, x, N);
    REQUIRE(d);
    CHECK_TRUE(anneal_comm_allreduce(nc, d, N, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_OK && from_gpu(b, y, d, N));
    memcpy(want, x, sizeof(float) * N);
    REQUIRE(anneal_comm_allreduce(g_comm, want, N, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_OK);
    CHECK(memcmp(y, want, sizeof(float) * N) == 0, "rank %d: NCCL's sum differs from MPI's", r);
    anneal_comm_request *q = NULL;
    CHECK_TRUE(anneal_comm_allreduce_start(nc, d, N, ANNEAL_F32, ANNEAL_REDUCE_MEAN, &q) == ANNEAL_OK);
    CHECK_TRUE(anneal_comm_wait(q) == ANNEAL_OK && from_gpu(b, y, d, N));
    for (int i = 0; i < N; i++) CHECK(y[i] == want[i] / (float)w || fabsf(y[i] - want[i] / (float)w) <= 1e-6f * fabsf(want[i]),
                                     "mean[%d] = %g, want %g", i, y[i], want[i] / (float)w);
    /* all-gather: rank k's block at k * N */
    void *g = b->alloc(b->ctx, sizeof(float) * N * (size_t)w);
    void *s = to_gpu(b, x, N);
    REQUIRE(g && s);
    CHECK_TRUE(anneal_comm_all_gather(nc, s, g, N, ANNEAL_F32) == ANNEAL_OK && from_gpu(b, y, g, (int64_t)N * w));
    REQUIRE(anneal_comm_all_gather(g_comm, x, want, N, ANNEAL_F32) == ANNEAL_OK);
    CHECK(memcmp(y, want, sizeof(float) * N * (size_t)w) == 0, "rank %d: NCCL's all-gather differs", r);
    /* reduce-scatter of the gathered buffer: the sum of everyone's block r */
    void *o = b->alloc(b->ctx, sizeof(float) * N);
    REQUIRE(o);
    CHECK_TRUE(anneal_comm_reduce_scatter(nc, g, o, N, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_OK &&
               from_gpu(b, y, o, N));
    float rs[N];
    REQUIRE(anneal_comm_reduce_scatter(g_comm, want, rs, N, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_OK);
    CHECK(memcmp(y, rs, sizeof rs) == 0, "rank %d: NCCL's reduce-scatter differs", r);
    /* broadcast from the last rank */
    CHECK_TRUE(anneal_comm_broadcast(nc, s, N, ANNEAL_F32, w - 1) == ANNEAL_OK && from_gpu(b, y, s, N));
    for (int i = 0; i < N; i++) CHECK(y[i] == (float)(i % 17) * 0.25f + (float)(w - 1), "broadcast[%d] = %g", i, y[i]);
    CHECK_TRUE(anneal_comm_barrier(nc) == ANNEAL_OK);
    b->free(b->ctx, d);
    b->free(b->ctx, g);
    b->free(b->ctx, s);
    b->free(b->ctx, o);
    anneal_comm_free(nc);
}

static void run_all(void) {
    RUN(bootstrap_id);
    RUN(collectives_on_gpu);
}

int main(void) { return dt_main(run_all); }
