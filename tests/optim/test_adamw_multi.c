/* One-pass AdamW (be->adamw_multi) against the per-parameter kernel (be->adamw):
 * bit-identical parameters and moments (memcmp, no tolerance: every element gets
 * the same float operations, only the split across threads differs), for sizes that
 * cut the concatenated range in odd places, per-parameter weight decay and bias
 * corrections, and 1, 2 and 3 threads. Then anneal_optimizer_step (which takes the
 * one-pass path) against a per-parameter reference over 3 steps. */
#include "anneal/anneal.h"
#include "anneal/backend.h"
#include "test.h"

#include <math.h>

#define NP 10
static const int64_t k_sizes[NP] = {1, 7, 63, 64, 65, 8191, 8192, 40000, 100003, 3};

static float *copy_of(const float *x, int64_t n) {
    float *y = malloc((size_t)n * sizeof *y);
    memcpy(y, x, (size_t)n * sizeof *y);
    return y;
}

TEST(multi_matches_per_parameter_bitwise) {
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    REQUIRE(be && be->adamw && be->adamw_multi);
    anneal_test_rng_state = 11;
    float *p[NP], *g[NP], *m[NP], *v[NP];
    for (int i = 0; i < NP; i++) {
        p[i] = anneal_test_rand_buf(k_sizes[i], -1, 1);
        g[i] = anneal_test_rand_buf(k_sizes[i], -0.1f, 0.1f);
        m[i] = anneal_test_rand_buf(k_sizes[i], -0.01f, 0.01f);
        v[i] = anneal_test_rand_buf(k_sizes[i], 0, 1e-3f);
    }
    const double lr = 3e-4, b1 = 0.9, b2 = 0.95, eps = 1e-8;
    for (int threads = 1; threads <= 3; threads++) {
        anneal_set_num_threads(threads);
        float *pa[NP], *ma[NP], *va[NP], *pb[NP], *mb[NP], *vb[NP];
        anneal_adamw_group groups[NP];
        for (int i = 0; i < NP; i++) {
            pa[i] = copy_of(p[i], k_sizes[i]), ma[i] = copy_of(m[i], k_sizes[i]), va[i] = copy_of(v[i], k_sizes[i]);
            pb[i] = copy_of(p[i], k_sizes[i]), mb[i] = copy_of(m[i], k_sizes[i]), vb[i] = copy_of(v[i], k_sizes[i]);
            int64_t t = 1 + i % 4; /* parameters at different step counts */
            double wd = i % 2 ? 0.1 : 0.0;
            double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
            anneal_scope *s = anneal_scope_open();
            anneal_tensor *tp = anneal_empty(ANNEAL_F32, 1, &k_sizes[i]);
            anneal_tensor *tg = anneal_empty(ANNEAL_F32, 1, &k_sizes[i]);
            anneal_tensor *tm = anneal_empty(ANNEAL_F32, 1, &k_sizes[i]);
            anneal_tensor *tv = anneal_empty(ANNEAL_F32, 1, &k_sizes[i]);
            REQUIRE(tp && tg && tm && tv);
            size_t bytes = (size_t)k_sizes[i] * sizeof(float);
            memcpy(anneal_data(tp), pa[i], bytes), memcpy(anneal_data(tg), g[i], bytes);
            memcpy(anneal_data(tm), ma[i], bytes), memcpy(anneal_data(tv), va[i], bytes);
            REQUIRE(be->adamw(be->ctx, tp, tg, tm, tv, lr, b1, b2, eps, wd, bc1, bc2) == ANNEAL_OK);
            memcpy(pa[i], anneal_data(tp), bytes), memcpy(ma[i], anneal_data(tm), bytes);
            memcpy(va[i], anneal_data(tv), bytes);
            anneal_scope_close(s);
            groups[i] = (anneal_adamw_group){.p = pb[i], .g = g[i], .m = mb[i], .v = vb[i], .numel = k_sizes[i],
                                             .weight_decay = wd, .bc1 = bc1, .bc2 = bc2};
        }
        REQUIRE(be->adamw_multi(be->ctx, groups, NP, lr, b1, b2, eps) == ANNEAL_OK);
        for (int i = 0; i < NP; i++) {
            size_t bytes = (size_t)k_sizes[i] * sizeof(float);
            CHECK(memcmp(pa[i], pb[i], bytes) == 0, "%d threads, param %d (%lld): p differs", threads, i,
                  (long long)k_sizes[i]);
            CHECK(memcmp(ma[i], mb[i], bytes) == 0, "%d threads, param %d: m differs", threads, i);
            CHECK(memcmp(va[i], vb[i], bytes) == 0, "%d threads, param %d: v differs", threads, i);
            CHECK(memcmp(pa[i], p[i], bytes) != 0, "param %d was not updated", i);
            free(pa[i]), free(ma[i]), free(va[i]), free(pb[i]), free(mb[i]), free(vb[i]);
        }
    }
    REQUIRE(be->adamw_multi(be->ctx, NULL, 0, lr, b1, b2, eps) == ANNEAL_OK); /* nothing to do */
    for (int i = 0; i < NP; i++) free(p[i]), free(g[i]), free(m[i]), free(v[i]);
    anneal_set_num_threads(2);
}

TEST(optimizer_step_matches_per_parameter_reference) {
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    REQUIRE(be);
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_test_rng_state = 5;
    float *ref_p[NP], *ref_m[NP], *ref_v[NP];
    for (int i = 0; i < NP; i++) {
        char name[32];
        snprintf(name, sizeof name, "w%d", i);
        anneal_tensor *t = anneal_params_create(ps, name, 1, &k_sizes[i], i % 3 == 0);
        REQUIRE(t);
        float *init = anneal_test_rand_buf(k_sizes[i], -1, 1);
        memcpy(anneal_data(t), init, (size_t)k_sizes[i] * sizeof(float));
        ref_p[i] = init;
        ref_m[i] = calloc((size_t)k_sizes[i], sizeof(float));
        ref_v[i] = calloc((size_t)k_sizes[i], sizeof(float));
    }
    anneal_optim_config cfg = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    cfg.weight_decay = 0.1;
    cfg.beta2 = 0.95;
    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    REQUIRE(o);
    for (int step = 1; step <= 3; step++) {
        double lr = 1e-3 * step;
        for (int i = 0; i < NP; i++) {
            if (step == 2 && i == 4) continue; /* no grad: skipped, its step count stays */
            anneal_tensor *p = ps->items[i].tensor;
            float *gb = anneal_test_rand_buf(k_sizes[i], -0.5f, 0.5f);
            anneal_scope_enter(NULL);
            p->grad = anneal_from_data(ANNEAL_F32, 1, &k_sizes[i], gb);
            anneal_scope_leave();
            REQUIRE(p->grad);
            /* the reference: the per-parameter kernel on host copies */
            int64_t t = anneal_optimizer_param_steps(o, i) + 1;
            anneal_adamw_group one = {.p = ref_p[i], .g = gb, .m = ref_m[i], .v = ref_v[i], .numel = k_sizes[i],
                                      .weight_decay = i % 3 == 0 ? 0.1 : 0.0,
                                      .bc1 = 1.0 - pow(cfg.beta1, (double)t), .bc2 = 1.0 - pow(cfg.beta2, (double)t)};
            anneal_scope *s = anneal_scope_open();
            anneal_tensor *tp = anneal_from_data(ANNEAL_F32, 1, &k_sizes[i], one.p);
            anneal_tensor *tg = anneal_from_data(ANNEAL_F32, 1, &k_sizes[i], one.g);
            anneal_tensor *tm = anneal_from_data(ANNEAL_F32, 1, &k_sizes[i], one.m);
            anneal_tensor *tv = anneal_from_data(ANNEAL_F32, 1, &k_sizes[i], one.v);
            REQUIRE(be->adamw(be->ctx, tp, tg, tm, tv, lr, cfg.beta1, cfg.beta2, cfg.eps, one.weight_decay, one.bc1,
                              one.bc2) == ANNEAL_OK);
            size_t bytes = (size_t)k_sizes[i] * sizeof(float);
            memcpy(ref_p[i], anneal_data(tp), bytes), memcpy(ref_m[i], anneal_data(tm), bytes);
            memcpy(ref_v[i], anneal_data(tv), bytes);
            anneal_scope_close(s);
            free(gb);
        }
        REQUIRE(anneal_optimizer_step(o, lr) == ANNEAL_OK);
        anneal_params_zero_grad(ps);
    }
    for (int i = 0; i < NP; i++) {
        size_t bytes = (size_t)k_sizes[i] * sizeof(float);
        CHECK(memcmp(anneal_data(ps->items[i].tensor), ref_p[i], bytes) == 0, "param %d differs", i);
        CHECK(memcmp(anneal_data(anneal_optimizer_state(o, i, "exp_avg")), ref_m[i], bytes) == 0, "m %d differs", i);
        CHECK(memcmp(anneal_data(anneal_optimizer_state(o, i, "exp_avg_sq")), ref_v[i], bytes) == 0, "v %d", i);
        CHECK_TRUE(anneal_optimizer_param_steps(o, i) == (i == 4 ? 2 : 3));
        free(ref_p[i]), free(ref_m[i]), free(ref_v[i]);
    }
    anneal_optimizer_free(o);
    anneal_params_free(ps);
}

int main(void) {
    RUN(multi_matches_per_parameter_bitwise);
    RUN(optimizer_step_matches_per_parameter_reference);
    return anneal_test_summary();
}
