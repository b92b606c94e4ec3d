/* ZeRO stages 1 and 2 against DDP (stage 0 with the plain optimizer) on a tiny GPT-2.
 *
 * Exactness: a ZeRO rank reduces the same per-element sums as DDP's all-reduce (with
 * two ranks one f32 addition, order-free) and updates its slice with the same
 * elementwise kernels, so without clipping the parameters must match DDP bit for
 * bit (world <= 2). With clipping the global norm is summed per shard and then across
 * ranks instead of per parameter, so it, the clip coefficient and the parameters may
 * differ in the last bits: tolerance ZERO_TOL relative to the largest parameter. The
 * comparison with one process running the whole batch uses the same tolerance (only
 * summation order differs: see test_ddp.c). */
#include "dist_model.h"

#define ZERO_TOL 1e-6
#define STEPS 4

typedef struct run {
    anneal_model *m;
    anneal_ddp *d;   /* NULL: one process, whole batch */
    anneal_optimizer *o;
    double loss;     /* last step's loss over the whole batch (mean over ranks) */
} run;

static void run_free(run *r) {
    anneal_optimizer_free(r->o);
    anneal_ddp_free(r->d);
    anneal_model_free(r->m);
    memset(r, 0, sizeof *r);
}

/* stage -1: single process without a sync; 0: DDP + plain optimizer; 1-2: ZeRO. */
static bool run_new(run *r, int stage, int64_t bucket_bytes, anneal_optim_config oc) {
    memset(r, 0, sizeof *r);
    r->m = dm_model(stage < 0 || dt_rank() == 0 ? 1 : 9);
    if (!r->m) return false;
    if (stage >= 0) {
        anneal_ddp_config c = anneal_ddp_defaults();
        c.zero_stage = stage;
        c.bucket_bytes = bucket_bytes;
        r->d = anneal_ddp_new(g_comm, r->m->params, c);
        if (!r->d || anneal_ddp_broadcast_params(r->d) != ANNEAL_OK) return false;
    }
    r->o = stage > 0 ? anneal_optimizer_new_zero(r->m->params, oc, r->d) : anneal_optimizer_new(r->m->params, oc);
    return r->o != NULL;
}

/* One training step on batch `step` (this rank's rows, or all rows without a sync)
 * in `accum` micro-steps (only the last one synchronises). */
static bool run_step_accum(run *r, int step, double lr, float clip, int accum) {
    dm_batch(1000 + (uint64_t)step);
    anneal_params_zero_grad(r->m->params);
    int rows = r->d ? DM_B / dt_world() : DM_B, r0 = r->d ? dt_rank() * rows : 0;
    float loss = 0;
    for (int k = 0; k < accum; k++) {
        if (r->d && anneal_ddp_begin_backward(r->d, k == accum - 1) != ANNEAL_OK) return false;
        loss += (float)dm_backward(r->m, r0 + k * rows / accum, rows / accum);
    }
    loss /= (float)accum;
    if (isnan(loss)) return false;
    if (r->d && anneal_comm_allreduce(g_comm, &loss, 1, ANNEAL_F32, ANNEAL_REDUCE_MEAN) != ANNEAL_OK) return false;
    r->loss = loss;
    if (r->d) {
        if (anneal_ddp_finish(r->d) != ANNEAL_OK) return false;
        if (clip > 0 && anneal_ddp_clip_grad_norm(r->d, clip, NULL) != ANNEAL_OK) return false;
    } else if (clip > 0 && anneal_clip_grad_norm(r->m->params, clip, NULL) != ANNEAL_OK) {
        return false;
    }
    return anneal_optimizer_step(r->o, lr) == ANNEAL_OK;
}

static bool run_step(run *r, int step, double lr, float clip) { return run_step_accum(r, step, lr, clip, 1); }

static double param_err(const run *a, const run *b) {
    float *x = dm_flat(a->m->params, false), *y = dm_flat(b->m->params, false);
    double e = dm_rel_err(x, y, anneal_params_numel(a->m->params));
    free(x);
    free(y);
    return e;
}

static anneal_optim_config adamw_cfg(void) {
    anneal_optim_config c = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    c.weight_decay = 0.1;
    return c;
}

static anneal_optim_config sgd_cfg(void) {
    anneal_optim_config c = anneal_optim_defaults(ANNEAL_OPTIM_SGD);
    c.momentum = 0.9;
    c.nesterov = true;
    c.weight_decay = 0.01;
    return c;
}

/* ZeRO-1/2 x AdamW/SGD x bucket sizes x clip on/off against DDP, and DDP against the
 * whole batch in one process. */
TEST(zero_matches_ddp) {
    const double lr = 1e-2;
    /* Under ASan (~10x slower): 2 steps and only the many-buckets layout. */
    const int steps = anneal_test_sanitized() ? 2 : STEPS;
    const int bi0 = anneal_test_sanitized() ? 1 : 0;
    for (int kind = 0; kind < 2; kind++) {
        anneal_optim_config oc = kind == 0 ? adamw_cfg() : sgd_cfg();
        for (int clip_on = 0; clip_on < 2; clip_on++) {
            float clip = clip_on ? 0.05f : 0.0f; /* 0.05: below the tiny model's gradient norm, so it clips */
            run ref = {0}, one = {0};
            bool ok = run_new(&ref, 0, 25 << 20, oc) && run_new(&one, -1, 0, oc);
            double el = 0;
            for (int s = 0; s < steps && ok; s++) {
                ok = run_step(&ref, s, lr, clip) && run_step(&one, s, lr, clip);
                el = fmax(el, fabs(ref.loss - one.loss) / fabs(one.loss));
            }
            CHECK(ok, "reference runs failed: %s", anneal_last_error());
            double e1 = ok ? param_err(&ref, &one) : 1;
            if (dt_rank() == 0)
                printf("    %s clip %s: DDP vs one process: losses %.3g, parameters %.3g\n", kind ? "SGD" : "AdamW",
                       clip_on ? "on" : "off", el, e1);
            CHECK(el <= ZERO_TOL, "DDP vs one process: losses differ by %.3g", el);
            /* SGD's update is linear in the gradient, so the parameters inherit the
             * gradients' 1e-7-level differences. AdamW divides by sqrt(v) + eps: for
             * entries whose gradient is nearly zero a last-bit difference can change
             * the update by up to lr, so its parameters are compared through the
             * losses above only. */
            if (kind == 1) CHECK(e1 <= ZERO_TOL, "DDP vs one process: parameters differ by %.3g", e1);
            for (int stage = 1; stage <= 2 && ok; stage++)
                for (int bi = bi0; bi < 2; bi++) {
                    int64_t bucket = bi == 0 ? 25 << 20 : 1000; /* one bucket / ~one per parameter */
                    run z = {0};
                    bool zok = run_new(&z, stage, bucket, oc);
                    for (int s = 0; s < steps && zok; s++) {
                        zok = run_step(&z, s, lr, clip);
                        if (zok && stage == 2) {
                            int held = 0;
                            for (int i = 0; i < z.m->params->n; i++) held += z.m->params->items[i].tensor->grad != NULL;
                            CHECK(held == 0, "stage 2 kept %d full gradients", held);
                        }
                    }
                    CHECK(zok, "ZeRO-%d run failed: %s", stage, anneal_last_error());
                    double e = zok ? param_err(&z, &ref) : 1;
                    if (dt_rank() == 0)
                        printf("    %s clip %s ZeRO-%d bucket %lld: vs DDP %.3g\n", kind ? "SGD" : "AdamW",
                               clip_on ? "on" : "off", stage, (long long)bucket, e);
                    if (clip_on || dt_world() > 2) CHECK(e <= ZERO_TOL, "ZeRO-%d vs DDP: %.3g", stage, e);
                    else CHECK(e == 0, "ZeRO-%d vs DDP without clipping must be bit-identical: %.3g", stage, e);
                    CHECK_TRUE(anneal_optimizer_step_count(z.o) == steps);
                    run_free(&z);
                }
            run_free(&ref);
            run_free(&one);
        }
    }
}

/* Per-rank optimizer state is the shard: the shards of all ranks tile the flat
 * parameter space exactly once, and the state bytes are 1/W of the plain optimizer's
 * (up to the padding of a bucket to a multiple of W). */
TEST(shard_layout_and_memory) {
    run z;
    REQUIRE(run_new(&z, 2, 25 << 20, adamw_cfg()));
    int64_t total = anneal_params_numel(z.m->params), shard = anneal_ddp_shard_numel(z.d);
    float *cover = calloc((size_t)total, sizeof *cover);
    int np = 0;
    const anneal_ddp_piece *pc = anneal_ddp_shard_pieces(z.d, &np);
    int64_t sum_len = 0, off[64] = {0};
    for (int i = 0; i < z.m->params->n && i < 64; i++)
        off[i] = i ? off[i - 1] + anneal_numel(z.m->params->items[i - 1].tensor) : 0;
    for (int k = 0; k < np; k++) {
        for (int64_t j = 0; j < pc[k].len; j++) cover[off[pc[k].param] + pc[k].offset + j] += 1;
        CHECK_TRUE(pc[k].shard_offset == sum_len); /* one bucket: pieces are consecutive */
        sum_len += pc[k].len;
    }
    CHECK_TRUE(sum_len == shard);
    CHECK_TRUE(anneal_comm_allreduce(g_comm, cover, total, ANNEAL_F32, ANNEAL_REDUCE_SUM) == ANNEAL_OK);
    int64_t bad = 0;
    for (int64_t i = 0; i < total; i++) bad += cover[i] != 1.0f;
    CHECK(bad == 0, "%lld elements not owned by exactly one rank", (long long)bad);
    free(cover);
    anneal_ddp_memory mem = anneal_ddp_memory_get(z.d);
    int W = dt_world();
    int64_t plain = 2 * 4 * total; /* exp_avg + exp_avg_sq of every parameter */
    CHECK(mem.state_bytes == 8 * shard && mem.state_bytes <= 8 * ((total + W - 1) / W),
          "state %lld bytes, plain optimizer %lld, world %d", (long long)mem.state_bytes, (long long)plain, W);
    if (dt_rank() == 0)
        printf("    per-rank optimizer state: %lld bytes (plain optimizer %lld, world %d)\n",
               (long long)mem.state_bytes, (long long)plain, W);
    /* After a step, stage 2 holds no full gradient: only the shard. */
    REQUIRE(run_step(&z, 0, 1e-3, 0));
    mem = anneal_ddp_memory_get(z.d);
    CHECK(mem.grad_bytes == 4 * shard && mem.bucket_bytes == 0, "grad %lld bucket %lld", (long long)mem.grad_bytes,
          (long long)mem.bucket_bytes);
    run_free(&z);
}

/* gather_state gives the full state tensors DDP's optimizer has (bit-identical);
 * scatter_state drops them; a new ZeRO optimizer on a different bucket layout
 * restored from full tensors continues exactly like the original (checkpoints do
 * not depend on the layout or world size). */
TEST(gather_scatter_state) {
    const double lr = 3e-3;
    run ref = {0}, z = {0}, c = {0};
    REQUIRE(run_new(&ref, 0, 25 << 20, adamw_cfg()));
    REQUIRE(run_new(&z, 1, 4096, adamw_cfg()));
    bool ok = true;
    for (int s = 0; s < 2 && ok; s++) ok = run_step(&ref, s, lr, 0) && run_step(&z, s, lr, 0);
    REQUIRE(ok);
    CHECK_TRUE(anneal_optimizer_state(z.o, 0, "exp_avg") == NULL); /* only the shard exists */
    CHECK_TRUE(anneal_optimizer_gather_state(z.o) == ANNEAL_OK);
    int n = ref.m->params->n, bad = 0;
    for (int i = 0; i < n; i++) {
        CHECK_TRUE(anneal_optimizer_param_steps(z.o, i) == anneal_optimizer_param_steps(ref.o, i));
        for (int k = 0; k < 2; k++) {
            const char *w = k ? "exp_avg_sq" : "exp_avg";
            anneal_tensor *a = anneal_optimizer_state(z.o, i, w), *b = anneal_optimizer_state(ref.o, i, w);
            if (!a || !b || memcmp(anneal_data(a), anneal_data(b), (size_t)anneal_numel(b) * 4) != 0) bad++;
        }
    }
    CHECK(bad == 0 || dt_world() > 2, "%d gathered state tensors differ from DDP's", bad);
    CHECK_TRUE(anneal_optimizer_scatter_state(z.o) == ANNEAL_OK);
    CHECK_TRUE(anneal_optimizer_state(z.o, 0, "exp_avg") == NULL);
    CHECK_TRUE(anneal_optimizer_gather_state(NULL) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_gather_state(ref.o) == ANNEAL_OK); /* no-op for a plain optimizer */

    /* "Resume" into stage 2 with one bucket per parameter, from ref's full state. */
    REQUIRE(run_new(&c, 2, 1000, adamw_cfg()));
    float *p = dm_flat(ref.m->params, false);
    for (int i = 0, o = 0; i < n; o += (int)anneal_numel(c.m->params->items[i].tensor), i++)
        memcpy(anneal_data(c.m->params->items[i].tensor), p + o, (size_t)anneal_numel(c.m->params->items[i].tensor) * 4);
    free(p);
    CHECK_TRUE(anneal_optimizer_init_state(c.o) == ANNEAL_OK);
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < 2; k++) {
            const char *w = k ? "exp_avg_sq" : "exp_avg";
            anneal_tensor *dst = anneal_optimizer_state(c.o, i, w), *src = anneal_optimizer_state(ref.o, i, w);
            REQUIRE(dst && src);
            memcpy(anneal_data(dst), anneal_data(src), (size_t)anneal_numel(src) * 4);
        }
        anneal_optimizer_set_param_steps(c.o, i, anneal_optimizer_param_steps(ref.o, i));
    }
    anneal_optimizer_set_step_count(c.o, anneal_optimizer_step_count(ref.o));
    CHECK_TRUE(anneal_optimizer_scatter_state(c.o) == ANNEAL_OK);
    for (int s = 2; s < 4 && ok; s++) ok = run_step(&ref, s, lr, 0) && run_step(&z, s, lr, 0) && run_step(&c, s, lr, 0);
    CHECK_TRUE(ok);
    double ez = param_err(&z, &ref), ec = param_err(&c, &ref);
    if (dt_rank() == 0) printf("    after the round trip: ZeRO-1 vs DDP %.3g, restored ZeRO-2 vs DDP %.3g\n", ez, ec);
    CHECK(dt_world() > 2 ? ez <= ZERO_TOL && ec <= ZERO_TOL : ez == 0 && ec == 0, "%.3g %.3g", ez, ec);
    run_free(&ref);
    run_free(&z);
    run_free(&c);
}

/* Gradient accumulation (2 micro-steps, only the last synchronises): ZeRO-1/2 hold
 * full local gradients until the last micro-step and still match DDP bit for bit. */
TEST(accumulation) {
    run ref = {0}, z1 = {0}, z2 = {0};
    bool ok = run_new(&ref, 0, 25 << 20, adamw_cfg()) && run_new(&z1, 1, 2000, adamw_cfg()) &&
              run_new(&z2, 2, 2000, adamw_cfg());
    for (int s = 0; s < 2 && ok; s++)
        ok = run_step_accum(&ref, s, 1e-2, 0, 2) && run_step_accum(&z1, s, 1e-2, 0, 2) &&
             run_step_accum(&z2, s, 1e-2, 0, 2);
    CHECK(ok, "%s", anneal_last_error());
    double e1 = ok ? param_err(&z1, &ref) : 1, e2 = ok ? param_err(&z2, &ref) : 1;
    CHECK(dt_world() > 2 ? e1 <= ZERO_TOL && e2 <= ZERO_TOL : e1 == 0 && e2 == 0, "ZeRO-1 %.3g, ZeRO-2 %.3g", e1, e2);
    run_free(&ref);
    run_free(&z1);
    run_free(&z2);
}

TEST(errors) {
    anneal_model *m = dm_model(1);
    REQUIRE(m);
    anneal_ddp *d0 = anneal_ddp_new(g_comm, m->params, anneal_ddp_defaults());
    REQUIRE(d0);
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_new_zero(m->params, adamw_cfg(), d0) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_ddp_config c = anneal_ddp_defaults();
    c.zero_stage = 1;
    anneal_ddp *d1 = anneal_ddp_new(g_comm, m->params, c);
    anneal_optimizer *o = anneal_optimizer_new_zero(m->params, adamw_cfg(), d1);
    REQUIRE(o);
    CHECK_TRUE(anneal_optimizer_step(o, 1e-3) == ANNEAL_ERR_STATE); /* no synchronised gradients yet */
    anneal_clear_error();
    anneal_optimizer_free(o);
    anneal_ddp_free(d1);
    anneal_ddp_free(d0);
    anneal_model_free(m);
}

static void run_all(void) {
    RUN(zero_matches_ddp);
    RUN(shard_layout_and_memory);
    RUN(gather_scatter_state);
    RUN(accumulation);
    RUN(errors);
}

/* 3 and 4 ranks: shards that do not divide the buckets evenly, the norm summed over more
 * than two shards, and the world > 2 tolerances above. */
int main(void) {
    static const int worlds[] = {2, 3, 4};
    return dt_main_worlds(run_all, worlds, 3, false);
}
