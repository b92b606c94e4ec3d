/* Optimizers and clipping: AdamW and SGD (momentum, Nesterov, weight decay) against
 * double-precision reference loops written here, with per-parameter step counts
 * (a parameter without a gradient is skipped), lazily created state, strided
 * gradients and parameters registered late; error paths that must leave the model
 * untouched; global-norm clipping (norm value, exact scaling, NaN/Inf handling);
 * and a replay of a PyTorch 1.13 AdamW + clip_grad_norm_ run
 * (optim_fixture.safetensors, written by gen_optim_fixture.py). */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

/* ------------------------------------------------------------------ helpers */

/* Deterministic values in [-1, 1) (64-bit LCG, top bits). */
static uint64_t g_lcg = 88172645463325252ull;
static float frand(void) {
    g_lcg = g_lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_lcg >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

/* Gives a 2-D t (R, C) a non-contiguous gradient: a transposed view of a (C, R)
 * buffer, holding vals in t's row-major order. */
static void set_grad_strided(anneal_tensor *t, const float *vals) {
    int64_t R = t->shape[0], C = t->shape[1];
    float *buf = malloc((size_t)(R * C) * sizeof *buf);
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < C; j++) buf[j * R + i] = vals[i * C + j];
    anneal_scope_enter(NULL);
    anneal_tensor *base = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){C, R}, buf);
    anneal_tensor *g = anneal_alias(base, 2, (int64_t[]){R, C}, (int64_t[]){1, R}, 0);
    anneal_scope_leave();
    anneal_release(base); /* the view keeps the storage */
    free(buf);
    anneal_grad_clear(t);
    t->grad = g;
}

static void set_data(anneal_tensor *t, const float *vals) {
    memcpy(anneal_data(t), vals, (size_t)anneal_numel(t) * sizeof(float));
}

static void to_float(const double *d, float *f, int n) {
    for (int i = 0; i < n; i++) f[i] = (float)d[i];
}

/* ---------------------------------------------------------------- AdamW */

#define NP 3
static const int k_numel[NP] = {15, 7, 4};
static const bool k_decay[NP] = {true, false, true};

/* Double-precision AdamW (torch.optim.AdamW formulas) for one parameter. */
typedef struct {
    double p[16], m[16], v[16];
    int steps;
} ref_adam;

static void ref_adamw_step(ref_adam *r, int n, const float *g, double lr, double b1, double b2,
                           double eps, double wd) {
    r->steps++;
    double bc1 = 1 - pow(b1, r->steps), bc2 = 1 - pow(b2, r->steps);
    for (int i = 0; i < n; i++) {
        r->p[i] *= 1 - lr * wd;
        r->m[i] = b1 * r->m[i] + (1 - b1) * g[i];
        r->v[i] = b2 * r->v[i] + (1 - b2) * (double)g[i] * g[i];
        r->p[i] -= lr / bc1 * r->m[i] / (sqrt(r->v[i]) / sqrt(bc2) + eps);
    }
}

TEST(adamw_matches_reference) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *P[NP] = {
        anneal_params_create(ps, "a.weight", 2, (int64_t[]){3, 5}, k_decay[0]),
        anneal_params_create(ps, "b.bias", 1, (int64_t[]){7}, k_decay[1]),
        anneal_params_create(ps, "c.weight", 2, (int64_t[]){2, 2}, k_decay[2]),
    };
    REQUIRE(P[0] && P[1] && P[2]);
    anneal_optim_config cfg = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    CHECK_TRUE(cfg.beta1 == 0.9 && cfg.beta2 == 0.999 && cfg.eps == 1e-8 && cfg.weight_decay == 0.0);
    cfg.beta2 = 0.95f;
    cfg.weight_decay = 0.1f;
    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    REQUIRE(o);
    ref_adam ref[NP];
    memset(ref, 0, sizeof ref);
    float init[16];
    for (int k = 0; k < NP; k++) {
        for (int i = 0; i < k_numel[k]; i++) init[i] = frand();
        set_data(P[k], init);
        for (int i = 0; i < k_numel[k]; i++) ref[k].p[i] = init[i];
    }
    /* state is lazy */
    CHECK_TRUE(anneal_optimizer_state(o, 0, "exp_avg") == NULL);
    CHECK_TRUE(anneal_optimizer_state(o, 0, "exp_avg_sq") == NULL);
    const float lrs[6] = {1e-3f, 5e-3f, 1e-2f, 1e-2f, 3e-3f, 1e-3f};
    for (int step = 0; step < 6; step++) {
        float g[NP][16], before_b[7];
        for (int k = 0; k < NP; k++)
            for (int i = 0; i < k_numel[k]; i++) g[k][i] = frand() * (k == 1 ? 0.01f : 1.0f);
        anneal_test_set_grad(P[0], g[0]);
        if (step == 2) anneal_grad_clear(P[1]); /* b has no grad: skipped */
        else anneal_test_set_grad(P[1], g[1]);
        if (step == 4) set_grad_strided(P[2], g[2]);
        else anneal_test_set_grad(P[2], g[2]);
        memcpy(before_b, anneal_data(P[1]), sizeof before_b);
        REQUIRE(anneal_optimizer_step(o, lrs[step]) == ANNEAL_OK);
        for (int k = 0; k < NP; k++) {
            if (k == 1 && step == 2) continue;
            ref_adamw_step(&ref[k], k_numel[k], g[k], lrs[step], cfg.beta1, cfg.beta2, cfg.eps,
                           k_decay[k] ? cfg.weight_decay : 0.0);
        }
        if (step == 2)
            CHECK(memcmp(before_b, anneal_data(P[1]), sizeof before_b) == 0, "skipped param changed");
        /* float vs double over a few steps: parameters O(1), updates O(lr); the f32
         * roundings stay below 1e-6 absolute + relative. */
        for (int k = 0; k < NP; k++) {
            float want[16];
            to_float(ref[k].p, want, k_numel[k]);
            CHECK_ALLCLOSE((const float *)anneal_data(P[k]), want, k_numel[k], 1e-6, 1e-6);
        }
    }
    CHECK(anneal_optimizer_step_count(o) == 6, "step count %lld", (long long)anneal_optimizer_step_count(o));
    CHECK_TRUE(ref[1].steps == 5 && ref[0].steps == 6);
    /* moments: m = O(g), v = O(g^2); relative 1e-5 */
    for (int k = 0; k < NP; k++) {
        anneal_tensor *m = anneal_optimizer_state(o, k, "exp_avg");
        anneal_tensor *v = anneal_optimizer_state(o, k, "exp_avg_sq");
        REQUIRE(m && v && anneal_numel(m) == k_numel[k] && anneal_same_shape(m, P[k]));
        float wm[16], wv[16];
        to_float(ref[k].m, wm, k_numel[k]);
        to_float(ref[k].v, wv, k_numel[k]);
        CHECK_ALLCLOSE((const float *)anneal_data(m), wm, k_numel[k], 1e-9, 1e-5);
        CHECK_ALLCLOSE((const float *)anneal_data(v), wv, k_numel[k], 1e-12, 1e-5);
    }
    /* state queries: wrong name for the kind, bad index */
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_state(o, 0, "momentum") == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_state(o, NP, "exp_avg") == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_optimizer_free(o);
    anneal_params_free(ps);
}

/* A step where no parameter has a gradient changes nothing; a parameter registered
 * after the optimizer was made gets state and its own step count 1 on its first update. */
TEST(adamw_late_param_and_no_grads) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *a = anneal_params_create(ps, "a", 1, (int64_t[]){4}, false);
    REQUIRE(a);
    set_data(a, (float[]){1, 2, 3, 4});
    anneal_optim_config cfg = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    REQUIRE(o);
    REQUIRE(anneal_optimizer_step(o, 0.1f) == ANNEAL_OK);
    CHECK_TRUE(anneal_item_at(a, 3) == 4.0 && anneal_optimizer_state(o, 0, "exp_avg") == NULL);
    float ga[4] = {0.5f, -1, 2, 0};
    ref_adam ra = {.p = {1, 2, 3, 4}};
    anneal_test_set_grad(a, ga);
    REQUIRE(anneal_optimizer_step(o, 0.1f) == ANNEAL_OK);
    ref_adamw_step(&ra, 4, ga, 0.1f, cfg.beta1, cfg.beta2, cfg.eps, 0);
    anneal_tensor *b = anneal_params_create(ps, "b", 1, (int64_t[]){3}, false);
    REQUIRE(b);
    set_data(b, (float[]){-1, 0, 1});
    float gb[3] = {1, -2, 3e-3f};
    ref_adam rb = {.p = {-1, 0, 1}};
    anneal_test_set_grad(b, gb);
    REQUIRE(anneal_optimizer_step(o, 0.1f) == ANNEAL_OK);
    ref_adamw_step(&ra, 4, ga, 0.1f, cfg.beta1, cfg.beta2, cfg.eps, 0);
    ref_adamw_step(&rb, 3, gb, 0.1f, cfg.beta1, cfg.beta2, cfg.eps, 0);
    float wa[4], wb[3];
    to_float(ra.p, wa, 4);
    to_float(rb.p, wb, 3);
    CHECK_ALLCLOSE((const float *)anneal_data(a), wa, 4, 1e-6, 1e-6);
    CHECK_ALLCLOSE((const float *)anneal_data(b), wb, 3, 1e-6, 1e-6);
    /* first Adam step moves each element by about lr * sign(g) (bias-corrected) */
    CHECK_NEAR(anneal_item_at(b, 0), -1.1, 1e-5);
    CHECK_TRUE(anneal_optimizer_state(o, 1, "exp_avg_sq") != NULL);
    CHECK_TRUE(anneal_optimizer_step_count(o) == 3);
    anneal_optimizer_free(o);
    anneal_params_free(ps);
}

/* ------------------------------------------------------------------ SGD */

/* Double-precision torch.optim.SGD (dampening 0) for one parameter. */
typedef struct {
    double p[16], buf[16];
    int steps;
} ref_sgd;

static void ref_sgd_step(ref_sgd *r, int n, const float *g, double lr, double mom, bool nesterov,
                         double wd) {
    for (int i = 0; i < n; i++) {
        double d = g[i] + wd * r->p[i];
        if (mom != 0) {
            r->buf[i] = r->steps == 0 ? d : mom * r->buf[i] + d;
            d = nesterov ? d + mom * r->buf[i] : r->buf[i];
        }
        r->p[i] -= lr * d;
    }
    r->steps++;
}

static void run_sgd_case(float momentum, bool nesterov, float wd) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *P[NP] = {
        anneal_params_create(ps, "a", 2, (int64_t[]){3, 5}, k_decay[0]),
        anneal_params_create(ps, "b", 1, (int64_t[]){7}, k_decay[1]),
        anneal_params_create(ps, "c", 2, (int64_t[]){2, 2}, k_decay[2]),
    };
    REQUIRE(P[0] && P[1] && P[2]);
    anneal_optim_config cfg = anneal_optim_defaults(ANNEAL_OPTIM_SGD);
    cfg.momentum = momentum;
    cfg.nesterov = nesterov;
    cfg.weight_decay = wd;
    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    REQUIRE(o);
    ref_sgd ref[NP];
    memset(ref, 0, sizeof ref);
    float init[16];
    for (int k = 0; k < NP; k++) {
        for (int i = 0; i < k_numel[k]; i++) init[i] = frand() * 2;
        set_data(P[k], init);
        for (int i = 0; i < k_numel[k]; i++) ref[k].p[i] = init[i];
    }
    const float lrs[5] = {0.1f, 0.05f, 0.2f, 0.1f, 0.01f};
    for (int step = 0; step < 5; step++) {
        float g[NP][16];
        for (int k = 0; k < NP; k++)
            for (int i = 0; i < k_numel[k]; i++) g[k][i] = frand();
        anneal_test_set_grad(P[0], g[0]);
        if (step == 0 || step == 2) anneal_grad_clear(P[1]); /* b's first step is step 1 */
        else anneal_test_set_grad(P[1], g[1]);
        if (step == 3) set_grad_strided(P[2], g[2]);
        else anneal_test_set_grad(P[2], g[2]);
        REQUIRE(anneal_optimizer_step(o, lrs[step]) == ANNEAL_OK);
        for (int k = 0; k < NP; k++) {
            if (k == 1 && (step == 0 || step == 2)) continue;
            ref_sgd_step(&ref[k], k_numel[k], g[k], lrs[step], momentum, nesterov, k_decay[k] ? wd : 0.0);
        }
        /* float vs double, 5 steps of O(0.1 * |g|): 1e-6 absolute + relative */
        for (int k = 0; k < NP; k++) {
            float want[16];
            to_float(ref[k].p, want, k_numel[k]);
            CHECK(anneal_test_close_ratio((const float *)anneal_data(P[k]), want, k_numel[k], 1e-6, 1e-6,
                                          &(int64_t){0}) <= 1,
                  "param %d step %d (momentum %g nesterov %d wd %g)", k, step, (double)momentum, nesterov,
                  (double)wd);
        }
    }
    for (int k = 0; k < NP; k++) {
        anneal_tensor *buf = anneal_optimizer_state(o, k, "momentum");
        if (momentum == 0) {
            CHECK(buf == NULL, "plain SGD keeps no state");
            continue;
        }
        REQUIRE(buf);
        float want[16];
        to_float(ref[k].buf, want, k_numel[k]);
        CHECK_ALLCLOSE((const float *)anneal_data(buf), want, k_numel[k], 1e-6, 1e-6);
    }
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_state(o, 0, "exp_avg") == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_optimizer_free(o);
    anneal_params_free(ps);
}

TEST(sgd_plain) { run_sgd_case(0.0f, false, 0.0f); }
TEST(sgd_plain_weight_decay) { run_sgd_case(0.0f, false, 0.05f); }
TEST(sgd_momentum) { run_sgd_case(0.9f, false, 0.01f); }
TEST(sgd_nesterov) { run_sgd_case(0.8f, true, 0.01f); }

/* ---------------------------------------------------------- error paths */

TEST(optimizer_errors) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *a = anneal_params_create(ps, "a", 1, (int64_t[]){4}, true);
    anneal_tensor *b = anneal_params_create(ps, "b", 1, (int64_t[]){3}, true);
    REQUIRE(a && b);
    anneal_optim_config cfg = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_new(NULL, cfg) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_optim_config bad = cfg;
    bad.beta1 = 1.0f;
    CHECK_TRUE(anneal_optimizer_new(ps, bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "betas") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    bad = cfg;
    bad.eps = -1;
    CHECK_TRUE(anneal_optimizer_new(ps, bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    bad = cfg;
    bad.weight_decay = NAN;
    CHECK_TRUE(anneal_optimizer_new(ps, bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    bad = anneal_optim_defaults(ANNEAL_OPTIM_SGD);
    bad.nesterov = true; /* without momentum */
    CHECK_TRUE(anneal_optimizer_new(ps, bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "nesterov") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    bad.kind = (anneal_optim_kind)7;
    bad.nesterov = false;
    CHECK_TRUE(anneal_optimizer_new(ps, bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();

    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    REQUIRE(o);
    set_data(a, (float[]){1, 2, 3, 4});
    anneal_test_set_grad(a, (float[]){1, 1, 1, 1});
    CHECK_TRUE(anneal_optimizer_step(o, NAN) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_step(o, -1e-3f) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_optimizer_step(NULL, 1e-3f) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    /* b's grad has the wrong shape: nothing is updated, not even a (which comes first) */
    anneal_scope_enter(NULL);
    anneal_tensor *wrong = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){5});
    anneal_scope_leave();
    b->grad = wrong;
    CHECK_TRUE(anneal_optimizer_step(o, 1e-2f) == ANNEAL_ERR_SHAPE);
    CHECK(strstr(anneal_last_error(), "'b'") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_item_at(a, 0) == 1.0 && anneal_item_at(a, 3) == 4.0);
    CHECK_TRUE(anneal_optimizer_step_count(o) == 0);
    CHECK_TRUE(anneal_optimizer_state(o, 0, "exp_avg") == NULL); /* no state allocated either */
    anneal_grad_clear(b);
    /* a bf16 grad is rejected the same way */
    anneal_scope_enter(NULL);
    anneal_tensor *h = anneal_zeros(ANNEAL_BF16, 1, (int64_t[]){3});
    anneal_scope_leave();
    b->grad = h;
    CHECK_TRUE(anneal_optimizer_step(o, 1e-2f) == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    anneal_grad_clear(b);
    /* and then a good step works: Adam's first step moves a by lr * sign(g) */
    REQUIRE(anneal_optimizer_step(o, 1e-2f) == ANNEAL_OK);
    CHECK_NEAR(anneal_item_at(a, 0), 1.0 - 1e-2, 1e-6);
    CHECK_TRUE(anneal_optimizer_step_count(o) == 1);
    CHECK_TRUE(anneal_optimizer_step_count(NULL) == 0);
    anneal_optimizer_free(o);
    anneal_optimizer_free(NULL);
    anneal_params_free(ps);
}

/* ------------------------------------------------------------- clipping */

/* Builds a set with grads: a (3, 4) contiguous, b (5) none, c (2, 3) strided, d (1). */
static anneal_params *clip_set(float scale, double *norm_ref) {
    anneal_params *ps = anneal_params_new();
    anneal_tensor *a = anneal_params_create(ps, "a", 2, (int64_t[]){3, 4}, true);
    anneal_params_create(ps, "b", 1, (int64_t[]){5}, false);
    anneal_tensor *c = anneal_params_create(ps, "c", 2, (int64_t[]){2, 3}, true);
    anneal_tensor *d = anneal_params_create(ps, "d", 1, (int64_t[]){1}, false);
    float ga[12], gc[6], gd[1];
    double ss = 0;
    for (int i = 0; i < 12; i++) {
        ga[i] = frand() * scale;
        ss += (double)ga[i] * ga[i];
    }
    for (int i = 0; i < 6; i++) {
        gc[i] = frand() * scale;
        ss += (double)gc[i] * gc[i];
    }
    gd[0] = scale;
    ss += (double)gd[0] * gd[0];
    anneal_test_set_grad(a, ga);
    set_grad_strided(c, gc);
    anneal_test_set_grad(d, gd);
    *norm_ref = sqrt(ss);
    return ps;
}

/* Copies every grad (row-major, f32) into out; returns the count. */
static int grads_of(const anneal_params *ps, float *out) {
    int n = 0;
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g) continue;
        anneal_to_f32_buffer(g, out + n);
        n += (int)anneal_numel(g);
    }
    return n;
}

TEST(clip_above_and_below) {
    double ref;
    anneal_params *ps = clip_set(2.0f, &ref);
    REQUIRE(ps);
    float norm = -1, before[32], after[32];
    REQUIRE(anneal_grad_norm(ps, &norm) == ANNEAL_OK);
    CHECK_NEAR(norm, ref, 1e-6 * ref); /* f32 result of a double sum */
    int n = grads_of(ps, before);
    CHECK_TRUE(n == 19);
    /* above: every grad scaled by coef = max / (norm + 1e-6), each product rounded once */
    float clipped = -1;
    REQUIRE(anneal_clip_grad_norm(ps, 1.0f, &clipped) == ANNEAL_OK);
    CHECK_TRUE(clipped == norm); /* norm before clipping */
    float coef = 1.0f / (norm + 1e-6f);
    REQUIRE(coef < 1);
    grads_of(ps, after);
    int exact = 0;
    for (int i = 0; i < n; i++) exact += after[i] == before[i] * coef;
    CHECK(exact == n, "%d of %d grads scaled exactly by %g", exact, n, (double)coef);
    /* the strided grad stayed a view of its own buffer and was scaled through it */
    const anneal_tensor *gc = ps->items[2].tensor->grad;
    CHECK_TRUE(!anneal_is_contiguous(gc));
    float after_norm;
    REQUIRE(anneal_grad_norm(ps, &after_norm) == ANNEAL_OK);
    CHECK_NEAR(after_norm, 1.0, 1e-5);
    /* below: untouched bit for bit, norm still reported; NULL norm_out is fine */
    float again = -1;
    REQUIRE(anneal_clip_grad_norm(ps, 5.0f, &again) == ANNEAL_OK);
    CHECK_NEAR(again, after_norm, 0);
    REQUIRE(anneal_clip_grad_norm(ps, 5.0f, NULL) == ANNEAL_OK);
    float after2[32];
    grads_of(ps, after2);
    CHECK(memcmp(after, after2, (size_t)n * sizeof(float)) == 0, "grads changed below max_norm");
    anneal_params_free(ps);
}

TEST(clip_non_finite_and_edges) {
    double ref;
    anneal_params *ps = clip_set(1.0f, &ref);
    REQUIRE(ps);
    float before[32], after[32], norm = 0;
    /* a NaN in one grad: the norm is reported as non-finite, grads are left alone */
    ((float *)anneal_data(ps->items[0].tensor->grad))[5] = NAN;
    int n = grads_of(ps, before);
    REQUIRE(anneal_clip_grad_norm(ps, 1e-3f, &norm) == ANNEAL_OK);
    CHECK(isnan(norm), "norm %g", (double)norm);
    grads_of(ps, after);
    CHECK(memcmp(before, after, (size_t)n * sizeof(float)) == 0, "grads changed on a NaN norm");
    /* an Inf: norm +inf, grads untouched */
    ((float *)anneal_data(ps->items[0].tensor->grad))[5] = -INFINITY;
    n = grads_of(ps, before);
    REQUIRE(anneal_clip_grad_norm(ps, 1e-3f, &norm) == ANNEAL_OK);
    CHECK(isinf(norm) && norm > 0, "norm %g", (double)norm);
    grads_of(ps, after);
    CHECK(memcmp(before, after, (size_t)n * sizeof(float)) == 0, "grads changed on an Inf norm");
    /* finite grads whose squares overflow f32 are summed in double: no overflow */
    anneal_params_zero_grad(ps);
    anneal_test_set_grad(ps->items[3].tensor, (float[]){3e30f});
    anneal_test_set_grad(ps->items[1].tensor, (float[]){4e30f, 0, 0, 0, 0});
    REQUIRE(anneal_grad_norm(ps, &norm) == ANNEAL_OK);
    CHECK_NEAR(norm, 5e30, 5e30 * 1e-6);
    REQUIRE(anneal_clip_grad_norm(ps, 1.0f, &norm) == ANNEAL_OK);
    CHECK_NEAR(anneal_item_at(ps->items[3].tensor->grad, 0), 0.6, 1e-6);
    /* no grads at all: norm 0, nothing to do */
    anneal_params_zero_grad(ps);
    REQUIRE(anneal_clip_grad_norm(ps, 1.0f, &norm) == ANNEAL_OK);
    CHECK_TRUE(norm == 0.0f);
    /* argument errors */
    anneal_clear_error();
    CHECK_TRUE(anneal_clip_grad_norm(ps, -1.0f, &norm) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_clip_grad_norm(ps, NAN, &norm) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_clip_grad_norm(NULL, 1.0f, &norm) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_grad_norm(ps, NULL) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_params_free(ps);
}

/* Same grads, same norm regardless of the OpenMP thread count (fixed order). */
TEST(grad_norm_deterministic) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    const int64_t n = 300001;
    anneal_tensor *a = anneal_params_create(ps, "a", 1, (int64_t[]){n}, true);
    anneal_tensor *b = anneal_params_create(ps, "b", 1, (int64_t[]){777}, true);
    REQUIRE(a && b);
    float *g = malloc((size_t)n * sizeof *g);
    double ss = 0;
    for (int64_t i = 0; i < n; i++) {
        g[i] = frand();
        ss += (double)g[i] * g[i];
    }
    anneal_test_set_grad(a, g);
    for (int i = 0; i < 777; i++) {
        g[i] = frand() * 3;
        ss += (double)g[i] * g[i];
    }
    anneal_test_set_grad(b, g);
    free(g);
    float n1, n2, n4;
    int saved = anneal_get_num_threads();
    anneal_set_num_threads(1);
    REQUIRE(anneal_grad_norm(ps, &n1) == ANNEAL_OK);
    anneal_set_num_threads(2);
    REQUIRE(anneal_grad_norm(ps, &n2) == ANNEAL_OK);
    anneal_set_num_threads(4);
    REQUIRE(anneal_grad_norm(ps, &n4) == ANNEAL_OK);
    anneal_set_num_threads(saved);
    CHECK_TRUE(n1 == n2 && n2 == n4);
    CHECK_NEAR(n1, sqrt(ss), 1e-6 * sqrt(ss));
    anneal_params_free(ps);
}

/* ------------------------------------------------------- PyTorch replay */

/* Copies entry `name` (F32) of the fixture into out; false if missing. */
static bool fixture_floats(const anneal_safetensors *st, const char *name, float *out, int64_t n) {
    const anneal_st_entry *e = anneal_safetensors_find(st, name);
    if (!e || e->dtype != ANNEAL_F32 || (int64_t)(e->end - e->begin) != n * 4) return false;
    memcpy(out, anneal_safetensors_data(st, e), (size_t)n * 4);
    return true;
}

/* torch.optim.AdamW (betas (0.9, 0.95), eps 1e-8, wd 0.1 on w, 0 on b) after
 * clip_grad_norm_(1.0), 5 steps, b without a grad at step 2. The CPU AdamW kernel
 * repeats PyTorch's float operations, so the only differences left are the f32
 * rounding of the scalars anneal receives as floats (lr, betas, bias corrections)
 * and the norm's summation order: parameters and norms agree to 1e-6 relative
 * (plus 1e-7 absolute for values near zero), moments to 1e-5 relative. */
TEST(pytorch_adamw_clip_replay) {
    anneal_safetensors *st = NULL;
    const char *path = anneal_test_path("tests/optim/optim_fixture.safetensors");
    REQUIRE(anneal_safetensors_open(path, &st) == ANNEAL_OK);
    const char *sw = anneal_safetensors_meta(st, "steps_w"), *sb = anneal_safetensors_meta(st, "steps_b");
    REQUIRE(sw && sb && atoi(sw) == 5 && atoi(sb) == 4);
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *w = anneal_params_create(ps, "w", 2, (int64_t[]){4, 6}, true);
    anneal_tensor *b = anneal_params_create(ps, "b", 1, (int64_t[]){6}, false);
    REQUIRE(w && b);
    float buf[24], lrs[5], norms[5];
    REQUIRE(fixture_floats(st, "init.w", anneal_data(w), 24));
    REQUIRE(fixture_floats(st, "init.b", anneal_data(b), 6));
    REQUIRE(fixture_floats(st, "lrs", lrs, 5) && fixture_floats(st, "norms", norms, 5));
    anneal_optim_config cfg = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    cfg.beta2 = 0.95f;
    cfg.weight_decay = 0.1f;
    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    REQUIRE(o);
    char name[64];
    int clipped = 0;
    for (int k = 0; k < 5; k++) {
        snprintf(name, sizeof name, "grad.%d.w", k);
        REQUIRE(fixture_floats(st, name, buf, 24));
        anneal_test_set_grad(w, buf);
        snprintf(name, sizeof name, "grad.%d.b", k);
        if (fixture_floats(st, name, buf, 6)) anneal_test_set_grad(b, buf);
        else anneal_grad_clear(b);
        CHECK_TRUE((b->grad == NULL) == (k == 2));
        float norm;
        REQUIRE(anneal_clip_grad_norm(ps, 1.0f, &norm) == ANNEAL_OK);
        CHECK(fabs(norm - norms[k]) <= 1e-6 * norms[k], "step %d norm %.9g vs torch %.9g", k, (double)norm,
              (double)norms[k]);
        clipped += norms[k] > 1.0f;
        REQUIRE(anneal_optimizer_step(o, lrs[k]) == ANNEAL_OK);
        snprintf(name, sizeof name, "after.%d.w", k);
        REQUIRE(fixture_floats(st, name, buf, 24));
        CHECK_ALLCLOSE((const float *)anneal_data(w), buf, 24, 1e-7, 1e-6);
        snprintf(name, sizeof name, "after.%d.b", k);
        REQUIRE(fixture_floats(st, name, buf, 6));
        CHECK_ALLCLOSE((const float *)anneal_data(b), buf, 6, 1e-7, 1e-6);
    }
    CHECK(clipped == 3, "fixture should clip on 3 of 5 steps, got %d", clipped);
    const char *which[2] = {"exp_avg", "exp_avg_sq"};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            anneal_tensor *s = anneal_optimizer_state(o, i, which[j]);
            REQUIRE(s);
            snprintf(name, sizeof name, "%s.%s", which[j], i == 0 ? "w" : "b");
            REQUIRE(fixture_floats(st, name, buf, anneal_numel(s)));
            CHECK_ALLCLOSE((const float *)anneal_data(s), buf, anneal_numel(s), 1e-12, 1e-5);
        }
    anneal_optimizer_free(o);
    anneal_params_free(ps);
    anneal_safetensors_close(st);
}

int main(void) {
    RUN(adamw_matches_reference);
    RUN(adamw_late_param_and_no_grads);
    RUN(sgd_plain);
    RUN(sgd_plain_weight_decay);
    RUN(sgd_momentum);
    RUN(sgd_nesterov);
    RUN(optimizer_errors);
    RUN(clip_above_and_below);
    RUN(clip_non_finite_and_edges);
    RUN(grad_norm_deterministic);
    RUN(pytorch_adamw_clip_replay);
    return anneal_test_summary();
}
