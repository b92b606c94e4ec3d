/* The dynamic loss scaler against PyTorch's GradScaler semantics (torch 1.13,
 * torch/cuda/amp/grad_scaler.py and the _amp_update_scale_ kernel in
 * aten/src/ATen/native/cuda/AmpKernels.cu):
 *   - defaults: init_scale 2^16, growth_factor 2, backoff_factor 0.5, growth_interval 2000;
 *   - update(found_inf): scale *= backoff, tracker = 0;
 *   - update(clean): tracker + 1; when that reaches growth_interval the scale is
 *     multiplied by growth_factor (only if the product is a finite f32) and tracker = 0;
 *   - unscale_: inv_scale = float(1 / double(scale)); each value is checked for
 *     NaN/Inf before it is multiplied; every gradient is unscaled even when one
 *     holds an Inf.
 * The expected sequences below are written out by hand from those rules. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

#include <float.h>

/* One step of a scripted sequence: the event and the state expected after it. */
typedef struct scripted {
    bool inf;
    float scale;
    int64_t tracker;
} scripted;

TEST(defaults_are_gradscalers) {
    anneal_loss_scaler_config c = anneal_loss_scaler_defaults();
    CHECK_TRUE(c.init_scale == 65536.0 && c.growth_factor == 2.0 && c.backoff_factor == 0.5 &&
               c.growth_interval == 2000 && c.dynamic);
    anneal_loss_scaler s;
    REQUIRE(anneal_loss_scaler_init(&s, c) == ANNEAL_OK);
    CHECK_TRUE(s.scale == 65536.0f && s.growth_tracker == 0);
    /* 1999 clean steps keep the scale; the 2000th doubles it */
    for (int i = 0; i < 1999; i++) anneal_loss_scaler_update(&s, false);
    CHECK(s.scale == 65536.0f && s.growth_tracker == 1999, "after 1999 clean steps: scale %g tracker %lld",
          (double)s.scale, (long long)s.growth_tracker);
    anneal_loss_scaler_update(&s, false);
    CHECK(s.scale == 131072.0f && s.growth_tracker == 0, "after 2000 clean steps: scale %g tracker %lld",
          (double)s.scale, (long long)s.growth_tracker);
}

TEST(state_machine_sequence) {
    anneal_loss_scaler_config c = anneal_loss_scaler_defaults();
    c.growth_interval = 3;
    anneal_loss_scaler s;
    REQUIRE(anneal_loss_scaler_init(&s, c) == ANNEAL_OK);
    /* C = clean step, I = a NaN/Inf gradient (step skipped) */
    static const scripted seq[] = {
        {false, 65536, 1},  {false, 65536, 2},  {false, 131072, 0}, /* C C C: grows on the 3rd */
        {true, 65536, 0},                                           /* I: backs off */
        {false, 65536, 1},  {false, 65536, 2},                      /* C C */
        {true, 32768, 0},   {true, 16384, 0},                       /* I I: the tracker restarts */
        {false, 16384, 1},  {false, 16384, 2},  {false, 32768, 0},  /* C C C */
        {false, 32768, 1},  {false, 32768, 2},  {false, 65536, 0},  /* C C C */
        {false, 65536, 1},  {true, 32768, 0},                       /* C I: a partial run is lost */
    };
    for (size_t i = 0; i < sizeof seq / sizeof seq[0]; i++) {
        anneal_loss_scaler_update(&s, seq[i].inf);
        CHECK(s.scale == seq[i].scale && s.growth_tracker == seq[i].tracker,
              "event %zu (%s): scale %g tracker %lld, expected %g and %lld", i, seq[i].inf ? "inf" : "clean",
              (double)s.scale, (long long)s.growth_tracker, (double)seq[i].scale, (long long)seq[i].tracker);
    }
}

TEST(growth_stops_at_the_f32_range_and_static_never_changes) {
    anneal_loss_scaler_config c = anneal_loss_scaler_defaults();
    c.growth_interval = 2;
    anneal_loss_scaler s;
    REQUIRE(anneal_loss_scaler_init(&s, c) == ANNEAL_OK);
    float big = ldexpf(1.0f, 127); /* 2^128 is not a finite f32 */
    REQUIRE(anneal_loss_scaler_set_state(&s, big, 1) == ANNEAL_OK);
    anneal_loss_scaler_update(&s, false);
    CHECK(s.scale == big && s.growth_tracker == 0, "at 2^127: scale %g tracker %lld (must stay, tracker reset)",
          (double)s.scale, (long long)s.growth_tracker);
    /* a tracker restored above a smaller interval grows at the next clean step */
    REQUIRE(anneal_loss_scaler_set_state(&s, 1024.0f, 7) == ANNEAL_OK);
    anneal_loss_scaler_update(&s, false);
    CHECK_TRUE(s.scale == 2048.0f && s.growth_tracker == 0);

    anneal_loss_scaler_config st = anneal_loss_scaler_defaults();
    st.dynamic = false;
    st.init_scale = 1.0;
    REQUIRE(anneal_loss_scaler_init(&s, st) == ANNEAL_OK);
    for (int i = 0; i < 5000; i++) anneal_loss_scaler_update(&s, i % 7 == 0);
    CHECK_TRUE(s.scale == 1.0f && s.growth_tracker == 0);
}

TEST(config_and_state_errors) {
    anneal_loss_scaler s;
    anneal_loss_scaler_config c = anneal_loss_scaler_defaults();
    anneal_clear_error();
    c.init_scale = 0;
    CHECK_TRUE(anneal_loss_scaler_init(&s, c) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "init_scale") != NULL, "%s", anneal_last_error());
    anneal_clear_error();
    c.init_scale = 1e39; /* not a finite f32 */
    CHECK_TRUE(anneal_loss_scaler_init(&s, c) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    c = anneal_loss_scaler_defaults();
    c.growth_factor = 1.0;
    CHECK_TRUE(anneal_loss_scaler_init(&s, c) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    c = anneal_loss_scaler_defaults();
    c.backoff_factor = 1.0;
    CHECK_TRUE(anneal_loss_scaler_init(&s, c) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    c = anneal_loss_scaler_defaults();
    c.growth_interval = 0;
    CHECK_TRUE(anneal_loss_scaler_init(&s, c) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "growth_interval") != NULL, "%s", anneal_last_error());
    anneal_clear_error();
    REQUIRE(anneal_loss_scaler_init(&s, anneal_loss_scaler_defaults()) == ANNEAL_OK);
    CHECK_TRUE(anneal_loss_scaler_set_state(&s, 0.0f, 0) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_loss_scaler_set_state(&s, INFINITY, 0) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_loss_scaler_set_state(&s, 8.0f, -1) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(s.scale == 65536.0f && s.growth_tracker == 0); /* refused states change nothing */
}

TEST(unscale_multiplies_by_the_f32_inverse_and_finds_inf) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *a = anneal_params_create(ps, "a", 2, (int64_t[]){2, 3}, true);
    anneal_tensor *b = anneal_params_create(ps, "b", 1, (int64_t[]){4}, false);
    anneal_tensor *c = anneal_params_create(ps, "c", 1, (int64_t[]){2}, false); /* no grad: skipped */
    REQUIRE(a && b && c);
    const float ga[6] = {1.0f, -3.0f, 0.5f, 1e-3f, 7.25f, 0.0f}, gb[4] = {2.0f, 1e30f, -1e-30f, 3.0f};
    anneal_loss_scaler s;
    anneal_loss_scaler_config cfg = anneal_loss_scaler_defaults();
    cfg.init_scale = 3.0; /* not a power of two: the inverse is rounded */
    REQUIRE(anneal_loss_scaler_init(&s, cfg) == ANNEAL_OK);
    anneal_test_set_grad(a, ga);
    anneal_test_set_grad(b, gb);
    bool inf = true;
    REQUIRE(anneal_loss_scaler_unscale(&s, ps, &inf) == ANNEAL_OK);
    CHECK_TRUE(!inf);
    float inv = (float)(1.0 / 3.0);
    const float *ra = anneal_data(a->grad), *rb = anneal_data(b->grad);
    for (int i = 0; i < 6; i++) CHECK(ra[i] == ga[i] * inv, "a[%d] %.9g vs %.9g", i, ra[i], ga[i] * inv);
    for (int i = 0; i < 4; i++) CHECK(rb[i] == gb[i] * inv, "b[%d] %.9g vs %.9g", i, rb[i], gb[i] * inv);
    CHECK_TRUE(c->grad == NULL);

    /* an Inf in the first grad: found, and the other grads are still unscaled */
    const float ga2[6] = {1.0f, INFINITY, 2.0f, 4.0f, 8.0f, 16.0f};
    REQUIRE(anneal_loss_scaler_set_state(&s, 65536.0f, 0) == ANNEAL_OK);
    anneal_test_set_grad(a, ga2);
    anneal_test_set_grad(b, gb);
    REQUIRE(anneal_loss_scaler_unscale(&s, ps, &inf) == ANNEAL_OK);
    CHECK_TRUE(inf);
    rb = anneal_data(b->grad);
    CHECK_TRUE(rb[0] == 2.0f / 65536.0f && rb[3] == 3.0f / 65536.0f);
    /* a NaN in the last grad */
    const float gb2[4] = {1.0f, NAN, 0.0f, 0.0f};
    anneal_test_set_grad(a, ga);
    anneal_test_set_grad(b, gb2);
    REQUIRE(anneal_loss_scaler_unscale(&s, ps, &inf) == ANNEAL_OK);
    CHECK_TRUE(inf);
    /* a scale of 1 leaves the values alone */
    REQUIRE(anneal_loss_scaler_set_state(&s, 1.0f, 0) == ANNEAL_OK);
    anneal_test_set_grad(a, ga);
    anneal_test_set_grad(b, gb);
    REQUIRE(anneal_loss_scaler_unscale(&s, ps, &inf) == ANNEAL_OK);
    CHECK_TRUE(!inf && memcmp(anneal_data(a->grad), ga, sizeof ga) == 0);
    anneal_params_free(ps);
}

TEST(unscale_strided_gradient) {
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps);
    anneal_tensor *w = anneal_params_create(ps, "w", 2, (int64_t[]){2, 3}, true);
    REQUIRE(w);
    /* a transposed view of a (3, 2) buffer: w.grad[i][j] = buf[j][i] */
    const float buf[6] = {1, 4, 2, 5, 3, 6};
    anneal_scope_enter(NULL);
    anneal_tensor *base = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){3, 2}, buf);
    anneal_tensor *g = anneal_alias(base, 2, (int64_t[]){2, 3}, (int64_t[]){1, 2}, 0);
    anneal_scope_leave();
    anneal_release(base);
    anneal_grad_clear(w);
    w->grad = g;
    anneal_loss_scaler s;
    anneal_loss_scaler_config cfg = anneal_loss_scaler_defaults();
    cfg.init_scale = 4.0;
    REQUIRE(anneal_loss_scaler_init(&s, cfg) == ANNEAL_OK);
    bool inf = true;
    REQUIRE(anneal_loss_scaler_unscale(&s, ps, &inf) == ANNEAL_OK);
    CHECK_TRUE(!inf);
    float out[6];
    anneal_to_f32_buffer(w->grad, out);
    for (int i = 0; i < 6; i++) CHECK(out[i] == (float)(i + 1) / 4.0f, "w.grad[%d] = %g", i, (double)out[i]);
    anneal_params_free(ps);
}

int main(void) {
    RUN(defaults_are_gradscalers);
    RUN(state_machine_sequence);
    RUN(growth_stops_at_the_f32_range_and_static_never_changes);
    RUN(config_and_state_errors);
    RUN(unscale_multiplies_by_the_f32_inverse_and_finds_inf);
    RUN(unscale_strided_gradient);
    return anneal_test_summary();
}
