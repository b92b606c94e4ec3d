/* The int8 ops: anneal_quantize_s8 equals PyTorch's symmetric per-channel quantization
 * (torch.ao PerChannelMinMaxObserver over [-127, 127] + torch.quantize_per_channel) bit
 * for bit, per row and per group (tests/fixtures/quant.safetensors, made by
 * tests/fixtures/gen_quant.py); anneal_qlinear against anneal_linear on the dequantized
 * weight; and every argument check of both. */
#include "anneal/anneal.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static anneal_tensor *rn(int ndim, const int64_t *shape) { return anneal_randn(ANNEAL_F32, ndim, shape, 0.0f, 1.0f); }

static anneal_tensor *load(const anneal_safetensors *st, const char *name, anneal_dtype dt) {
    return anneal_safetensors_load(st, name, dt);
}

/* Elements of two tensors (same numel) that differ, read as doubles. */
static int64_t n_diff(const anneal_tensor *a, const anneal_tensor *b) {
    int64_t n = anneal_numel(a), d = 0;
    for (int64_t i = 0; i < n; i++) d += anneal_item_at(a, i) != anneal_item_at(b, i);
    return d;
}

TEST(quantize_matches_pytorch_per_channel_and_per_group) {
    anneal_safetensors *st = NULL;
    REQUIRE(anneal_safetensors_open("tests/fixtures/quant.safetensors", &st) == ANNEAL_OK);
    int cases = atoi(anneal_safetensors_meta(st, "cases"));
    REQUIRE(cases >= 4);
    int checked = 0;
    for (int k = 0; k < cases; k++) {
        anneal_scope *sc = anneal_scope_open();
        char name[64], gkey[64];
        snprintf(name, sizeof name, "c%d.x", k);
        anneal_tensor *x = load(st, name, ANNEAL_F32), *s = NULL;
        anneal_tensor *q = anneal_quantize_s8(x, 0, &s);
        REQUIRE(q && s);
        snprintf(name, sizeof name, "c%d.q", k);
        anneal_tensor *wq = load(st, name, ANNEAL_I8);
        snprintf(name, sizeof name, "c%d.scale", k);
        anneal_tensor *ws = load(st, name, ANNEAL_F32);
        CHECK(n_diff(q, wq) == 0, "case %d per row: %lld int8 values differ from torch", k, (long long)n_diff(q, wq));
        CHECK(anneal_same_shape(s, ws) && n_diff(s, ws) == 0, "case %d per row: scales differ", k);
        checked++;
        snprintf(gkey, sizeof gkey, "c%d.groups", k);
        const char *groups = anneal_safetensors_meta(st, gkey);
        for (const char *p = groups; p && *p;) {
            int g = atoi(p);
            anneal_tensor *gs = NULL, *gq = anneal_quantize_s8(x, g, &gs);
            REQUIRE(gq && gs);
            snprintf(name, sizeof name, "c%d.q_g%d", k, g);
            anneal_tensor *tq = load(st, name, ANNEAL_I8);
            snprintf(name, sizeof name, "c%d.scale_g%d", k, g);
            anneal_tensor *ts = load(st, name, ANNEAL_F32);
            CHECK(n_diff(gq, tq) == 0, "case %d group %d: %lld values differ", k, g, (long long)n_diff(gq, tq));
            CHECK(anneal_same_shape(gs, ts) && n_diff(gs, ts) == 0, "case %d group %d: scales differ", k, g);
            checked++;
            p = strchr(p, ',');
            if (p) p++;
        }
        anneal_scope_close(sc);
    }
    printf("  %d quantizations equal torch's\n", checked);
    anneal_safetensors_close(st);
}

/* x (R, K) @ dequant(W)^T + b with anneal_linear vs anneal_qlinear weight-only. */
TEST(qlinear_weight_only_is_linear_on_the_dequantized_weight) {
    anneal_scope *sc = anneal_scope_open();
    anneal_manual_seed(7);
    static const int64_t groups[] = {0, 32, 64};
    for (int rows = 1; rows <= 12; rows += 11)
        for (size_t gi = 0; gi < 3; gi++) {
            int64_t K = 128, N = 40, g = groups[gi];
            anneal_tensor *w = rn(2, (int64_t[]){N, K}), *x = rn(3, (int64_t[]){1, rows, K});
            anneal_tensor *b = rn(1, &N), *s = NULL;
            anneal_tensor *q = anneal_quantize_s8(w, g, &s);
            REQUIRE(q);
            /* dequantized: q * scale of its group */
            float *wd = malloc((size_t)(N * K) * 4);
            for (int64_t n = 0; n < N; n++)
                for (int64_t k = 0; k < K; k++)
                    wd[n * K + k] = (float)anneal_item_at(q, n * K + k) * (float)anneal_item_at(s, g ? n * (K / g) + k / g : n);
            anneal_tensor *wdt = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){N, K}, wd);
            free(wd);
            anneal_tensor *want = anneal_linear(x, wdt, b);
            anneal_qmatmul_desc d = {.mode = ANNEAL_QUANT_WEIGHT_ONLY, .group = g};
            anneal_tensor *got = anneal_qlinear(x, q, s, b, &d);
            REQUIRE(got && want && anneal_same_shape(got, want));
            double worst = 0;
            for (int64_t i = 0; i < anneal_numel(got); i++)
                worst = fmax(worst, fabs(anneal_item_at(got, i) - anneal_item_at(want, i)));
            /* both f32 sums of 128 products of size ~1: a few ulps of ~10 */
            CHECK(worst < 1e-4, "rows %d group %lld: max difference %.3g", rows, (long long)g, worst);
            /* the quantization error itself: each weight within half a step of the f32 one, so
             * |y_int8 - y_f32| <= sum_k |x_k| * scale(n, k) / 2 (plus f32 rounding) */
            anneal_tensor *f = anneal_linear(x, w, b);
            int over = 0;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t n = 0; n < N; n++) {
                    double bound = 1e-4;
                    for (int64_t k = 0; k < K; k++)
                        bound += 0.5 * fabs(anneal_item_at(x, r * K + k)) * anneal_item_at(s, g ? n * (K / g) + k / g : n);
                    over += fabs(anneal_item_at(got, r * N + n) - anneal_item_at(f, r * N + n)) > bound;
                }
            CHECK(over == 0, "rows %d group %lld: %d outputs off the f32 ones by more than half a step per weight", rows,
                  (long long)g, over);
        }
    anneal_scope_close(sc);
}

TEST(qlinear_and_quantize_refuse_bad_arguments) {
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *x = rn(2, (int64_t[]){3, 64}), *w = rn(2, (int64_t[]){8, 64}), *s = NULL;
    anneal_tensor *q = anneal_quantize_s8(w, 0, &s);
    REQUIRE(q && s);
    struct {
        const char *what, *expect;
        anneal_tensor *w, *s, *b;
        anneal_qmatmul_desc d;
    } cases[] = {
        {"f32 weight", "int8", w, s, NULL, {.mode = ANNEAL_QUANT_DYNAMIC, .group = 0}},
        {"unknown mode", "unknown quantization mode", q, s, NULL, {.mode = (anneal_quant_mode)9, .group = 0}},
        {"group not dividing", "does not divide", q, s, NULL, {.mode = ANNEAL_QUANT_WEIGHT_ONLY, .group = 48}},
        {"group with dynamic", "weight-only", q, s, NULL, {.mode = ANNEAL_QUANT_DYNAMIC, .group = 32}},
        {"scales of a group", "scales must be f32 (8, 2)", q, s, NULL, {.mode = ANNEAL_QUANT_WEIGHT_ONLY, .group = 32}},
        {"bias shape", "bias", q, s, rn(1, (int64_t[]){7}), {.mode = ANNEAL_QUANT_DYNAMIC}},
        {"static without a scale", "static activation scale", q, s, NULL, {.mode = ANNEAL_QUANT_STATIC}},
        {"f16 weight-only", "f32 or bf16", q, s, NULL, {.mode = ANNEAL_QUANT_WEIGHT_ONLY, .compute = ANNEAL_F16}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        anneal_clear_error();
        CHECK(anneal_qlinear(x, cases[i].w, cases[i].s, cases[i].b, &cases[i].d) == NULL, "%s: accepted", cases[i].what);
        CHECK(strstr(anneal_last_error(), cases[i].expect) != NULL, "%s: message '%s' lacks '%s'", cases[i].what,
              anneal_last_error(), cases[i].expect);
    }
    anneal_clear_error();
    CHECK(!anneal_qlinear(rn(2, (int64_t[]){3, 63}), q, s, NULL, &(anneal_qmatmul_desc){.mode = ANNEAL_QUANT_DYNAMIC}) &&
              strstr(anneal_last_error(), "in-features"),
          "wrong in-features: %s", anneal_last_error());
    /* no backward: an input that wants a gradient is refused */
    anneal_tensor *xg = rn(2, (int64_t[]){3, 64});
    anneal_set_requires_grad(xg, true);
    anneal_clear_error();
    CHECK(!anneal_qlinear(xg, q, s, NULL, &(anneal_qmatmul_desc){.mode = ANNEAL_QUANT_DYNAMIC}) &&
              strstr(anneal_last_error(), "no backward"),
          "grad: %s", anneal_last_error());
    anneal_clear_error();
    anneal_tensor *s2 = NULL;
    CHECK(!anneal_quantize_s8(w, 48, &s2) && strstr(anneal_last_error(), "does not divide"), "%s", anneal_last_error());
    anneal_clear_error();
    CHECK(!anneal_quantize_s8(anneal_zeros(ANNEAL_I32, 1, (int64_t[]){4}), 0, &s2), "i32 accepted");
    anneal_clear_error();
    anneal_scope_close(sc);
}

int main(void) {
    RUN(quantize_matches_pytorch_per_channel_and_per_group);
    RUN(qlinear_weight_only_is_linear_on_the_dequantized_weight);
    RUN(qlinear_and_quantize_refuse_bad_arguments);
    return anneal_test_summary();
}
