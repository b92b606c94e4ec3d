/* The deterministic reduction (src/parallel/det_reduce.c): the tree over M leaves gives
 * the same bits when its leaves are split into W blocks of M/W (a power of two) summed
 * by W ranks and the block sums combined - for every valid (M, W), in one process and
 * across real ranks (worlds 1, 2, 3 and 4 under mpirun), through the gradient sync's comm
 * hook on a tiny GPT-2's gradients. The tree is not the naive left-to-right sum: on
 * inputs that make float rounding order-dependent the two differ, so these checks
 * fail if the combine takes another order (tried: summing the gathered blocks left to
 * right fails both cross-rank tests at world 4). OpenMPI's MPI_Allreduce on this host
 * happened to group like the tree at these sizes (recursive doubling), which no MPI
 * promises; the combine does not rely on it. */
#include "dist_model.h"

#include <string.h>

/* Leaf j (n floats): magnitudes from 2^-12 to 2^24 with both signs, so sums round
 * differently in different orders. */
static void leaf(int j, int64_t n, float *x) {
    anneal_test_rng_state = 0x9e3779b97f4a7c15ULL * (uint64_t)(j + 1);
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = anneal_test_next_u64();
        float mant = 1.0f + (float)(r & 0xffffff) / 16777216.0f;
        int e = (int)((r >> 24) % 37) - 12;
        x[i] = ldexpf((r >> 40) & 1 ? -mant : mant, e);
    }
}

/* The tree over leaves first..first+m-1 into out. */
static void tree_of(int first, int m, int64_t n, float *out) {
    anneal_det_tree *t = anneal_det_tree_new(n);
    float *x = malloc((size_t)n * sizeof *x);
    REQUIRE(t && x);
    for (int j = first; j < first + m; j++) {
        leaf(j, n, x);
        REQUIRE(anneal_det_tree_push(t, x) == ANNEAL_OK);
    }
    CHECK(anneal_det_tree_leaves(t) == m, "leaves %lld, want %d", (long long)anneal_det_tree_leaves(t), m);
    REQUIRE(anneal_det_tree_finish(t, out) == ANNEAL_OK);
    anneal_det_tree_free(t);
    free(x);
}

static bool pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

/* {1, 1e8, -1e8, 1} in f32 (ulp of 1e8 = 8): the tree adds (1 + 1e8) + (-1e8 + 1) =
 * 1e8 + -1e8 = 0; left to right ((1 + 1e8) - 1e8) + 1 = 1. Every layout gives 0. */
TEST(hand_computed_case) {
    float v[4] = {1.0f, 1e8f, -1e8f, 1.0f}, out = -1;
    anneal_det_tree *t = anneal_det_tree_new(1);
    REQUIRE(t);
    for (int j = 0; j < 4; j++) REQUIRE(anneal_det_tree_push(t, &v[j]) == ANNEAL_OK);
    REQUIRE(anneal_det_tree_finish(t, &out) == ANNEAL_OK);
    volatile float naive = v[0];
    for (int j = 1; j < 4; j++) naive = naive + v[j];
    CHECK(out == 0.0f && naive == 1.0f, "tree %g (want 0), left to right %g (want 1)", (double)out, (double)naive);
    /* two ranks: {1, 1e8} and {-1e8, 1}, then the tree of the two block sums */
    float blocks[2];
    for (int b = 0; b < 2; b++) {
        REQUIRE(anneal_det_tree_push(t, &v[2 * b]) == ANNEAL_OK);
        REQUIRE(anneal_det_tree_push(t, &v[2 * b + 1]) == ANNEAL_OK);
        REQUIRE(anneal_det_tree_finish(t, &blocks[b]) == ANNEAL_OK);
    }
    anneal_det_combine_blocks(blocks, 2, 1);
    CHECK(blocks[0] == 0.0f, "two blocks: %g, want 0", (double)blocks[0]);
    float four[4] = {1.0f, 1e8f, -1e8f, 1.0f};
    anneal_det_combine_blocks(four, 4, 1);
    CHECK(four[0] == 0.0f, "four blocks: %g, want 0", (double)four[0]);
    /* no leaves: zeros */
    out = 5;
    REQUIRE(anneal_det_tree_finish(t, &out) == ANNEAL_OK);
    CHECK(out == 0.0f, "empty tree gave %g", (double)out);
    anneal_det_tree_free(t);
    double d[4] = {1.0, 1e17, -1e17, 1.0}; /* the same in double (ulp of 1e17 = 16) */
    CHECK(anneal_det_sum_f64(d, 4) == 0.0, "f64 tree %g, want 0", anneal_det_sum_f64(d, 4));
}

/* Every M in 1..16 and every W with M = W * 2^k (and W = 1 for any M): blocks summed
 * on their own and combined = the tree over all M, bit for bit; and for M >= 4 the
 * tree differs from the left-to-right sum somewhere (for M <= 3 the two are the same
 * additions). Doubles likewise. */
TEST(every_layout_gives_the_same_bits) {
    const int64_t n = 257;
    float *full = malloc((size_t)n * sizeof *full), *naive = malloc((size_t)n * sizeof *naive);
    float *x = malloc((size_t)n * sizeof *x), *blocks = malloc(16 * (size_t)n * sizeof *blocks);
    REQUIRE(full && naive && x && blocks);
    int layouts = 0;
    for (int m = 1; m <= 16; m++) {
        tree_of(0, m, n, full);
        for (int j = 0; j < m; j++) {
            leaf(j, n, x);
            for (int64_t i = 0; i < n; i++) naive[i] = j ? naive[i] + x[i] : x[i];
        }
        if (m >= 4) CHECK(memcmp(full, naive, (size_t)n * 4) != 0, "M=%d: the tree equals the naive sum", m);
        for (int w = 1; w <= m; w++) {
            if (m % w || (w > 1 && !pow2(m / w))) continue;
            for (int b = 0; b < w; b++) tree_of(b * (m / w), m / w, n, blocks + (int64_t)b * n);
            anneal_det_combine_blocks(blocks, w, n);
            CHECK(memcmp(blocks, full, (size_t)n * 4) == 0, "M=%d split over W=%d: not the bits of the full tree", m, w);
            /* doubles: element 0 of every leaf as a double */
            double dl[16], bs[16];
            for (int j = 0; j < m; j++) leaf(j, 1, x), dl[j] = (double)x[0] * 1e9 + (double)j * 1e-7;
            for (int b = 0; b < w; b++) bs[b] = anneal_det_sum_f64(dl + b * (m / w), m / w);
            double a = anneal_det_sum_f64(bs, w), want = anneal_det_sum_f64(dl, m);
            CHECK(memcmp(&a, &want, sizeof a) == 0, "f64, M=%d over W=%d: %.17g vs %.17g", m, w, a, want);
            layouts++;
        }
    }
    printf("    %d (M, W) layouts agree bit for bit\n", layouts);
    CHECK(layouts >= 40, "only %d layouts checked", layouts);
    free(full), free(naive), free(x), free(blocks);
}

/* Leaves of the cross-rank tests: 8, or 6 for 3 ranks (a block of 2 per rank). */
static int leaves_for_world(void) { return dt_world() == 3 ? 6 : 8; }

/* Across the ranks of this run (world 1, 2, 3 or 4; 2 and 4 take the butterfly, 3 the
 * all-gather): M leaves, rank r sums its block of M/W, anneal_det_allreduce gives every
 * rank the full tree's bits. */
TEST(allreduce_across_ranks) {
    const int64_t n = 1000;
    const int m = leaves_for_world(), w = dt_world(), per = m / w;
    float *full = malloc((size_t)n * sizeof *full), *mine = malloc((size_t)n * sizeof *mine);
    REQUIRE(full && mine);
    tree_of(0, m, n, full);
    tree_of(dt_rank() * per, per, n, mine);
    CHECK(anneal_det_allreduce(g_comm, mine, n) == ANNEAL_OK, "%s", anneal_last_error());
    CHECK(dt_all(memcmp(mine, full, (size_t)n * 4) == 0), "world %d: the all-reduce is not the full tree", w);
    double dl[8] = {0}, want;
    for (int j = 0; j < m; j++) dl[j] = 1.0 / (j + 3) * (j % 2 ? -1e12 : 1e-3) + j;
    want = anneal_det_sum_f64(dl, m);
    double x = anneal_det_sum_f64(dl + dt_rank() * per, per);
    CHECK(anneal_det_allreduce_f64(g_comm, &x) == ANNEAL_OK, "%s", anneal_last_error());
    CHECK(dt_all(memcmp(&x, &want, sizeof x) == 0), "f64: %.17g vs %.17g", x, want);
    free(full);
    free(mine);
}

/* The comm hook on a tiny GPT-2: M micro-batches of 24/M rows, each rank the tree of its
 * M/W micro-batch gradients in .grad, anneal_ddp_finish with the hook: every rank holds
 * the one-process tree over all 8 micro-batch gradients, bit for bit (bucket sizes
 * from one per parameter to one for all). ZeRO 1 and 2: each rank's shard is its chunk
 * of that tree and the clipping norm is the one-process norm, bit for bit. */
TEST(ddp_hook_on_model_gradients) {
    dm_batch(42);
    const int m = leaves_for_world(), rows = DM_B / m, per = m / dt_world();
    anneal_model *ref = dm_model(1);
    REQUIRE(ref);
    int64_t n = anneal_params_numel(ref->params);
    anneal_det_tree *t = anneal_det_tree_new(n);
    float *full = malloc((size_t)n * sizeof *full), *block = malloc((size_t)n * sizeof *block);
    REQUIRE(t && full && block);
    for (int j = 0; j < m; j++) { /* the one-process reference */
        anneal_params_zero_grad(ref->params);
        REQUIRE(!isnan(dm_backward(ref, j * rows, rows)));
        float *g = dm_flat(ref->params, true);
        REQUIRE(anneal_det_tree_push(t, g) == ANNEAL_OK);
        free(g);
    }
    REQUIRE(anneal_det_tree_finish(t, full) == ANNEAL_OK);
    for (int j = dt_rank() * per; j < (dt_rank() + 1) * per; j++) { /* this rank's block */
        anneal_params_zero_grad(ref->params);
        REQUIRE(!isnan(dm_backward(ref, j * rows, rows)));
        float *g = dm_flat(ref->params, true);
        REQUIRE(anneal_det_tree_push(t, g) == ANNEAL_OK);
        free(g);
    }
    REQUIRE(anneal_det_tree_finish(t, block) == ANNEAL_OK);
    int64_t sizes[3] = {4, 4096, (int64_t)1 << 30};
    for (int k = 0; k < 3; k++) {
        anneal_ddp_config cfg = anneal_ddp_defaults();
        cfg.bucket_bytes = sizes[k];
        anneal_ddp *d = anneal_ddp_new(g_comm, ref->params, cfg);
        anneal_det_sync *s = d ? anneal_det_sync_new(d) : NULL;
        REQUIRE(d && s);
        int64_t o = 0; /* .grad = the block sum */
        for (int i = 0; i < ref->params->n; i++) {
            anneal_tensor *p = ref->params->items[i].tensor;
            REQUIRE(p->grad);
            memcpy(anneal_data(p->grad), block + o, (size_t)anneal_numel(p) * 4);
            o += anneal_numel(p);
        }
        bool ok = anneal_ddp_begin_backward(d, true) == ANNEAL_OK && anneal_ddp_finish(d) == ANNEAL_OK;
        CHECK(ok, "sync: %s", anneal_last_error());
        float *g = dm_flat(ref->params, true);
        CHECK(dt_all(memcmp(g, full, (size_t)n * 4) == 0), "bucket %lld B, world %d: not the one-process tree",
              (long long)sizes[k], dt_world());
        free(g);
        anneal_det_sync_free(s);
        anneal_ddp_free(d);
    }
    /* ZeRO 1 and 2: every rank's shard is its chunk of the one-process tree, and the
     * clipping norm is the one-process norm of that tree (per-parameter sums) */
    float want = 0;
    int64_t *poff = malloc((size_t)ref->params->n * sizeof *poff);
    REQUIRE(poff);
    for (int i = 0, o = 0; i < ref->params->n; o += (int)anneal_numel(ref->params->items[i].tensor), i++) {
        poff[i] = o;
        memcpy(anneal_data(ref->params->items[i].tensor->grad), full + o,
               (size_t)anneal_numel(ref->params->items[i].tensor) * 4);
    }
    REQUIRE(anneal_grad_norm(ref->params, &want) == ANNEAL_OK);
    for (int stage = 1; stage <= 2; stage++) {
        anneal_ddp_config z = anneal_ddp_defaults();
        z.zero_stage = stage;
        z.bucket_bytes = 4096;
        anneal_ddp *dz = anneal_ddp_new(g_comm, ref->params, z);
        anneal_det_sync *sz = dz ? anneal_det_sync_new(dz) : NULL;
        REQUIRE(dz && sz);
        anneal_params_zero_grad(ref->params); /* a backward makes every .grad (stage 2 frees them) */
        REQUIRE(!isnan(dm_backward(ref, 0, rows)));
        for (int i = 0; i < ref->params->n; i++) {
            anneal_tensor *p = ref->params->items[i].tensor;
            REQUIRE(p->grad);
            memcpy(anneal_data(p->grad), block + poff[i], (size_t)anneal_numel(p) * 4);
        }
        bool ok = anneal_ddp_begin_backward(dz, true) == ANNEAL_OK && anneal_ddp_finish(dz) == ANNEAL_OK;
        CHECK(ok, "ZeRO-%d sync: %s", stage, anneal_last_error());
        int np = 0;
        const anneal_ddp_piece *pc = anneal_ddp_shard_pieces(dz, &np);
        const float *sh = anneal_ddp_shard_grad(dz);
        bool same = true;
        for (int k = 0; k < np && ok; k++)
            same &= memcmp(sh + pc[k].shard_offset, full + poff[pc[k].param] + pc[k].offset, (size_t)pc[k].len * 4) == 0;
        CHECK(dt_all(same), "ZeRO-%d, world %d: a shard is not the one-process tree's chunk", stage, dt_world());
        float norm = -1;
        CHECK(anneal_ddp_clip_grad_norm(dz, 0.0f, &norm) == ANNEAL_OK, "%s", anneal_last_error());
        CHECK(dt_all(memcmp(&norm, &want, sizeof norm) == 0), "ZeRO-%d, world %d: norm %.9g, one process %.9g", stage,
              dt_world(), (double)norm, (double)want);
        anneal_det_sync_free(sz);
        anneal_ddp_free(dz);
    }
    free(poff);
    anneal_det_tree_free(t);
    free(full);
    free(block);
    anneal_model_free(ref);
}

static void run_all(void) {
    if (dt_rank() == 0 || dt_world() == 1) {
        RUN(hand_computed_case);
        RUN(every_layout_gives_the_same_bits);
    }
    RUN(allreduce_across_ranks);
    RUN(ddp_hook_on_model_gradients);
}

int main(void) {
    static const int worlds[] = {2, 3, 4};
    return dt_main_worlds(run_all, worlds, 3, false);
}
