/* The gradient norm's pieces stay on the device: the backend's sum_squares writes each
 * gradient's sum of squares (in double) into its element of one F64 tensor, one copy to
 * the host and one synchronisation per device bring them all back, and the total is
 * added in registration order in double: the same bits as summing one gradient at a
 * time (the arithmetic before), with strided gradients, missing ones, gradients on two
 * devices, and the loss scaler's overflow check on the same path. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "backend_clone.h"
#include "test.h"

#include <math.h>
#include <string.h>

#define EXT ANNEAL_DEVICE_EXT

static anneal_backend g_ext;
static int g_syncs, g_to_host;

static anneal_status ext_sync(void *ctx) {
    g_syncs++;
    return ANNEAL_OK;
}

static anneal_status ext_to_host(void *ctx, void *dst, const void *src, size_t n) {
    g_to_host++;
    memcpy(dst, src, n);
    return ANNEAL_OK;
}

/* A second device made of the CPU's slots (host memory) that counts synchronisations
 * and copies to the host. */
static bool ext_register(void) {
    if (!anneal_test_cpu_clone(&g_ext, "counting", EXT)) return false;
    g_ext.synchronize = ext_sync;
    g_ext.copy_to_host = ext_to_host;
    return anneal_backend_register(&g_ext) == ANNEAL_OK;
}

TEST(sum_squares_writes_its_element) {
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    anneal_scope *s = anneal_scope_open();
    const int64_t n = 1000;
    anneal_tensor *x = anneal_test_rand(1, &n, -3, 3, 5, false);
    anneal_tensor *acc = anneal_empty(ANNEAL_F64, 1, (int64_t[]){4});
    REQUIRE(x && acc && be->fill(be->ctx, acc, -1.0) == ANNEAL_OK);
    REQUIRE(be->sum_squares(be->ctx, acc, 2, x) == ANNEAL_OK);
    float v[1000];
    REQUIRE(anneal_to_f32_buffer(x, v) == ANNEAL_OK);
    double ref = 0;
    for (int i = 0; i < n; i++) ref += (double)v[i] * v[i];
    CHECK(fabs(anneal_item_at(acc, 2) - ref) <= 1e-12 * ref, "%.17g vs %.17g", anneal_item_at(acc, 2), ref);
    CHECK_TRUE(anneal_item_at(acc, 0) == -1.0 && anneal_item_at(acc, 1) == -1.0 && anneal_item_at(acc, 3) == -1.0);
    anneal_scope_close(s);
}

/* A parameter set with grads: p0 (40, 30) contiguous, p1 none, p2 a transposed view,
 * p3 (7), the given ones on device dev2 (others on the CPU). */
static anneal_params *make(anneal_device dev2, bool *on2) {
    anneal_params *ps = anneal_params_new();
    const char *names[4] = {"p0", "p1", "p2", "p3"};
    int64_t shapes[4][2] = {{40, 30}, {5, 5}, {30, 20}, {7, 1}};
    for (int i = 0; i < 4; i++) {
        anneal_tensor *p = anneal_params_create(ps, names[i], i == 3 ? 1 : 2, shapes[i], true);
        if (!p || i == 1) continue;
        anneal_scope *tmp = anneal_scope_open();
        anneal_tensor *g = anneal_test_rand(p->ndim, p->shape, -2, 2, 100 + (uint64_t)i, false);
        anneal_device d = on2[i] ? dev2 : ANNEAL_CPU;
        if (i == 2) { /* a strided gradient: the transpose of a (20, 30) tensor */
            anneal_tensor *t = anneal_test_rand(2, (int64_t[]){20, 30}, -2, 2, 102, false);
            g = anneal_transpose(anneal_to_device(t, d), 0, 1);
        } else {
            g = anneal_to_device(g, d);
        }
        anneal_keep(g, NULL); /* owned by the parameter from here on */
        anneal_scope_close(tmp);
        p->grad = g;
    }
    return ps;
}

/* The arithmetic of the norm one gradient at a time, through its own F64 scalar. */
static float reference_norm(const anneal_params *ps) {
    double total = 0;
    for (int i = 0; i < ps->n; i++) {
        anneal_tensor *g = ps->items[i].tensor->grad;
        if (!g) continue;
        const anneal_backend *be = anneal_backend_get(g->device);
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *c = anneal_empty_on(g->device, ANNEAL_F32, g->ndim, g->shape);
        anneal_tensor *acc = anneal_empty_on(g->device, ANNEAL_F64, 1, (int64_t[]){1});
        be->copy(be->ctx, c, g);
        be->sum_squares(be->ctx, acc, 0, c);
        total += anneal_item(acc);
        anneal_scope_close(s);
    }
    return (float)sqrt(total);
}

TEST(grad_norm_same_bits_one_sync_per_device) {
    REQUIRE(ext_register());
    bool none[4] = {false, false, false, false}, some[4] = {true, false, false, true},
         all[4] = {true, true, true, true};
    bool *cases[3] = {none, some, all};
    float norms[3];
    for (int k = 0; k < 3; k++) {
        anneal_params *ps = make(EXT, cases[k]);
        REQUIRE(ps);
        float want = reference_norm(ps), got = -1;
        g_syncs = g_to_host = 0;
        REQUIRE(anneal_grad_norm(ps, &got) == ANNEAL_OK);
        CHECK(got == want, "case %d: %.9g vs %.9g", k, (double)got, (double)want);
        int want_syncs = k == 0 ? 0 : 1; /* the extension device's: one each, whatever its count of grads */
        CHECK(g_syncs == want_syncs && g_to_host == want_syncs, "case %d: %d syncs, %d copies to the host", k, g_syncs,
              g_to_host);
        norms[k] = got;
        /* clipping to half the norm: every grad scaled by the same coefficient */
        float before = got;
        REQUIRE(anneal_clip_grad_norm(ps, before / 2, &got) == ANNEAL_OK && got == before);
        REQUIRE(anneal_grad_norm(ps, &got) == ANNEAL_OK);
        CHECK(fabs(got - before / 2) <= 1e-5 * before, "case %d: clipped norm %g", k, (double)got);
        anneal_params_free(ps);
    }
    CHECK(norms[0] == norms[1] && norms[1] == norms[2], "the device holding a gradient changed the norm");
}

TEST(scaler_finds_overflow_on_the_device) {
    REQUIRE(ext_register());
    bool all[4] = {true, true, true, true};
    anneal_params *ps = make(EXT, all);
    REQUIRE(ps);
    anneal_loss_scaler sc;
    anneal_loss_scaler_config c = anneal_loss_scaler_defaults();
    c.init_scale = 4.0;
    REQUIRE(anneal_loss_scaler_init(&sc, c) == ANNEAL_OK);
    float before[7], after[7];
    REQUIRE(anneal_to_f32_buffer(ps->items[3].tensor->grad, before) == ANNEAL_OK);
    bool inf = true;
    g_syncs = 0;
    REQUIRE(anneal_loss_scaler_unscale(&sc, ps, &inf) == ANNEAL_OK);
    CHECK_TRUE(!inf && g_syncs == 1);
    REQUIRE(anneal_to_f32_buffer(ps->items[3].tensor->grad, after) == ANNEAL_OK);
    for (int i = 0; i < 7; i++) CHECK_TRUE(after[i] == 0.25f * before[i]);
    /* one NaN in one gradient is found */
    anneal_scope *s = anneal_scope_open();
    float nanv = NAN;
    anneal_tensor *nan1 = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){1}, &nanv);
    anneal_tensor *g0 = ps->items[0].tensor->grad;
    REQUIRE(anneal_copy_(anneal_narrow(anneal_reshape(g0, 1, (int64_t[]){1200}), 0, 17, 1), nan1) == ANNEAL_OK);
    REQUIRE(anneal_loss_scaler_unscale(&sc, ps, &inf) == ANNEAL_OK);
    CHECK_TRUE(inf);
    anneal_scope_close(s);
    anneal_params_free(ps);
}

int main(void) {
    RUN(sum_squares_writes_its_element);
    RUN(grad_norm_same_bits_one_sync_per_device);
    RUN(scaler_finds_overflow_on_the_device);
    return anneal_test_summary();
}
