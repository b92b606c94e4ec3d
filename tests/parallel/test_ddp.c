/* Data-parallel gradient sync (stage 0) on a tiny GPT-2: W ranks each running
 * B/W rows give the gradients of one process running all B rows.
 *
 * Tolerance (DDP_TOL, relative to the largest gradient entry): the per-rank mean
 * losses are averaged by the all-reduce instead of one mean over all rows, and each
 * weight gradient sums its rows in two halves then adds them, so only the summation
 * order differs from the single process; f32 rounding of such reorderings stays
 * around 1e-7 of the gradient's scale. With world 1 the result must be bit-identical.
 * Bucket sizes and overlap on/off change only when the same all-reduces happen, so
 * they must agree bit for bit with each other. */
#include "dist_model.h"

#define DDP_TOL 1e-6

static float *g_ref_grads;   /* whole batch, one process */
static float *g_ref_params;  /* the model's initial parameters (seed 1) */
static int64_t g_numel;
static float g_ref_norm;

static void make_reference(void) {
    dm_batch(42);
    anneal_model *m = dm_model(1);
    if (!m) return;
    g_numel = anneal_params_numel(m->params);
    g_ref_params = dm_flat(m->params, false);
    dm_backward(m, 0, DM_B);
    g_ref_grads = dm_flat(m->params, true);
    anneal_grad_norm(m->params, &g_ref_norm);
    anneal_model_free(m);
}

/* Rank r's model: seed 1 on rank 0, a different seed elsewhere, so the broadcast is
 * what makes them equal. */
static anneal_model *rank_model(void) { return dm_model(dt_rank() == 0 ? 1 : 7); }

/* One synchronised step's gradients for cfg (rows split evenly), malloc'd. */
static float *ddp_grads(anneal_ddp_config cfg, anneal_ddp_memory *mem) {
    anneal_model *m = rank_model();
    anneal_ddp *d = m ? anneal_ddp_new(g_comm, m->params, cfg) : NULL;
    float *g = NULL;
    if (d && anneal_ddp_broadcast_params(d) == ANNEAL_OK) {
        float *p = dm_flat(m->params, false);
        CHECK(memcmp(p, g_ref_params, (size_t)g_numel * 4) == 0, "parameters differ from rank 0's after broadcast");
        free(p);
        int rows = DM_B / dt_world();
        bool ok = anneal_ddp_begin_backward(d, true) == ANNEAL_OK;
        ok = ok && !isnan(dm_backward(m, dt_rank() * rows, rows));
        ok = ok && anneal_ddp_finish(d) == ANNEAL_OK;
        CHECK(ok, "sync failed: %s", anneal_last_error());
        if (mem) *mem = anneal_ddp_memory_get(d);
        if (ok) g = dm_flat(m->params, true);
    } else {
        CHECK(false, "ddp setup failed: %s", anneal_last_error());
    }
    anneal_ddp_free(d);
    anneal_model_free(m);
    return g;
}

TEST(ddp_matches_whole_batch) {
    REQUIRE(g_ref_grads);
    anneal_ddp_config cfgs[4];
    const char *names[4] = {"25 MiB buckets, overlap", "4-byte buckets (one per parameter), overlap",
                            "4 KiB buckets, overlap", "1 GiB bucket, no overlap"};
    for (int k = 0; k < 4; k++) cfgs[k] = anneal_ddp_defaults();
    cfgs[1].bucket_bytes = 4;
    cfgs[2].bucket_bytes = 4096;
    cfgs[3].bucket_bytes = (int64_t)1 << 30;
    cfgs[3].overlap = false;
    float *first = NULL;
    for (int k = 0; k < 4; k++) {
        anneal_ddp_memory mem;
        float *g = ddp_grads(cfgs[k], &mem);
        if (!g) continue;
        double err = dm_rel_err(g, g_ref_grads, g_numel);
        if (dt_rank() == 0) printf("    %s: gradient error vs whole batch %.3g (of max |g|)\n", names[k], err);
        if (dt_world() == 1)
            CHECK(memcmp(g, g_ref_grads, (size_t)g_numel * 4) == 0, "%s: world 1 must be bit-identical", names[k]);
        CHECK(err <= DDP_TOL, "%s: error %.3g > %.1g", names[k], err, DDP_TOL);
        CHECK(mem.param_bytes == g_numel * 4 && mem.grad_bytes == g_numel * 4 && mem.state_bytes == 0,
              "memory %lld %lld", (long long)mem.param_bytes, (long long)mem.grad_bytes);
        CHECK(mem.bucket_bytes == g_numel * 4, "bucket bytes %lld", (long long)mem.bucket_bytes);
        if (!first) first = g;
        else {
            CHECK(memcmp(g, first, (size_t)g_numel * 4) == 0, "%s differs from the first configuration", names[k]);
            free(g);
        }
    }
    free(first);
}

/* Two micro-steps per rank: the first (sync false) communicates nothing and leaves the
 * local gradients; the second synchronises the sum. Each micro-batch loss is a mean
 * over B/(2W) rows, so the accumulated mean is twice the whole-batch gradient (the
 * factor 0.5 below is exact). */
TEST(gradient_accumulation) {
    REQUIRE(g_ref_grads);
    anneal_ddp_config cfg = anneal_ddp_defaults();
    cfg.bucket_bytes = 2048;
    anneal_model *m = rank_model();
    anneal_ddp *d = m ? anneal_ddp_new(g_comm, m->params, cfg) : NULL;
    REQUIRE(d);
    CHECK_TRUE(anneal_ddp_broadcast_params(d) == ANNEAL_OK);
    int rows = DM_B / dt_world() / 2, r0 = dt_rank() * 2 * rows;
    /* The local-only gradient of the first micro-batch, from a twin model. */
    anneal_model *twin = dm_model(1);
    REQUIRE(twin);
    dm_backward(twin, r0, rows);
    float *local = dm_flat(twin->params, true);
    anneal_model_free(twin);

    CHECK_TRUE(anneal_ddp_begin_backward(d, false) == ANNEAL_OK);
    CHECK_TRUE(!isnan(dm_backward(m, r0, rows)));
    float *after1 = dm_flat(m->params, true);
    CHECK(memcmp(after1, local, (size_t)g_numel * 4) == 0, "a sync=false micro-step changed the gradients");
    CHECK(anneal_ddp_memory_get(d).bucket_bytes == 0, "a sync=false micro-step allocated buckets");
    CHECK_TRUE(anneal_ddp_begin_backward(d, true) == ANNEAL_OK);
    CHECK_TRUE(!isnan(dm_backward(m, r0 + rows, rows)));
    CHECK_TRUE(anneal_ddp_finish(d) == ANNEAL_OK);
    float *g = dm_flat(m->params, true);
    for (int64_t i = 0; i < g_numel; i++) g[i] *= 0.5f;
    double err = dm_rel_err(g, g_ref_grads, g_numel);
    if (dt_rank() == 0) printf("    accumulated gradient error vs whole batch %.3g\n", err);
    CHECK(err <= DDP_TOL, "error %.3g", err);
    free(local), free(after1), free(g);
    anneal_ddp_free(d);
    anneal_model_free(m);
}

/* Global norm and clipping: the norm of the synchronised gradients equals the
 * whole-batch norm (same tolerance), is bit-identical on every rank, and clipping
 * scales by PyTorch's coefficient. */
TEST(clip_and_scale) {
    REQUIRE(g_ref_grads);
    anneal_model *m = rank_model();
    anneal_ddp *d = m ? anneal_ddp_new(g_comm, m->params, anneal_ddp_defaults()) : NULL;
    REQUIRE(d);
    anneal_clear_error();
    CHECK_TRUE(anneal_ddp_clip_grad_norm(d, 1.0f, NULL) == ANNEAL_ERR_STATE); /* before any sync */
    anneal_clear_error();
    CHECK_TRUE(anneal_ddp_broadcast_params(d) == ANNEAL_OK);
    int rows = DM_B / dt_world();
    CHECK_TRUE(anneal_ddp_begin_backward(d, true) == ANNEAL_OK);
    dm_backward(m, dt_rank() * rows, rows);
    CHECK_TRUE(anneal_ddp_finish(d) == ANNEAL_OK);
    float *before = dm_flat(m->params, true);
    float norm = 0, max_norm = g_ref_norm * 0.25f;
    CHECK_TRUE(anneal_ddp_clip_grad_norm(d, max_norm, &norm) == ANNEAL_OK);
    CHECK(fabs(norm - g_ref_norm) <= DDP_TOL * g_ref_norm, "norm %.9g vs whole batch %.9g", norm, g_ref_norm);
    float all[16] = {0};
    CHECK_TRUE(anneal_comm_all_gather(g_comm, &norm, all, 1, ANNEAL_F32) == ANNEAL_OK);
    for (int r = 0; r < dt_world(); r++) CHECK(memcmp(&all[r], &norm, 4) == 0, "rank %d's norm differs", r);
    float coef = max_norm / (norm + 1e-6f);
    float *after = dm_flat(m->params, true);
    int bad = 0;
    for (int64_t i = 0; i < g_numel; i++)
        if (after[i] != before[i] * coef) bad++;
    CHECK(bad == 0, "%d gradients not scaled by the clip coefficient", bad);
    CHECK_TRUE(anneal_ddp_scale_grads(d, 0.5f) == ANNEAL_OK);
    float *half = dm_flat(m->params, true);
    bad = 0;
    for (int64_t i = 0; i < g_numel; i++)
        if (half[i] != after[i] * 0.5f) bad++;
    CHECK(bad == 0, "%d gradients not scaled", bad);
    free(before), free(after), free(half);
    anneal_ddp_free(d);
    anneal_model_free(m);
}

/* Parameters without any gradient count as zeros: every rank ends with a zero .grad. */
TEST(missing_gradients_are_zero) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *a = anneal_params_create(ps, "a", 1, (int64_t[]){5}, true);
    anneal_tensor *b = anneal_params_create(ps, "b", 1, (int64_t[]){3}, true);
    REQUIRE(a && b);
    anneal_ddp *d = anneal_ddp_new(g_comm, ps, anneal_ddp_defaults());
    REQUIRE(d);
    CHECK_TRUE(anneal_ddp_begin_backward(d, true) == ANNEAL_OK);
    CHECK_TRUE(anneal_ddp_finish(d) == ANNEAL_OK);
    CHECK_TRUE(a->grad && b->grad && anneal_item_at(a->grad, 4) == 0.0 && anneal_item_at(b->grad, 0) == 0.0);
    anneal_ddp_free(d);
    anneal_clear_error();
    anneal_ddp_config bad = anneal_ddp_defaults();
    bad.zero_stage = 4; /* 0-3 */
    CHECK_TRUE(anneal_ddp_new(g_comm, ps, bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_params_free(ps);
}

static void run_all(void) {
    make_reference();
    RUN(ddp_matches_whole_batch);
    RUN(gradient_accumulation);
    RUN(clip_and_scale);
    RUN(missing_gradients_are_zero);
    free(g_ref_grads);
    free(g_ref_params);
}

/* The 2-rank run is repeated with the progress thread (ANNEAL_DDP_PROGRESS=thread). */
int main(void) { return dt_main_ex(run_all, true); }
