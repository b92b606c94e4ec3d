/* The ops a Llama-style model needs beyond GPT-2's, against PyTorch
 * (tests/fixtures/ops_llama.safetensors, gen_ops_llama.py) and finite differences:
 * anneal_dense with the SiLU-times-multiplier activation (SwiGLU's gate times the up
 * projection), grouped-query attention (Hq = 2 Hkv; PyTorch's reference repeats k and v
 * per group), the rotary embedding op (no scaling and Llama 3's), attention with RoPE
 * (queries and keys rotated at their positions, inputs left as they were), and
 * self-attention from a packed qkv projection with fewer key/value heads. Values and
 * gradients are f32 computations against float64 references: atol 2e-5, rtol 1e-4. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "test.h"

#include <math.h>
#include <string.h>

#define ATOL 2e-5
#define RTOL 1e-4

static anneal_safetensors *g_st;

static anneal_tensor *fx(const char *name, bool grad) {
    anneal_tensor *t = anneal_safetensors_load(g_st, name, ANNEAL_F32);
    if (t && grad) anneal_set_requires_grad(t, true);
    return t;
}

static float *host(const anneal_tensor *t) {
    if (!t) return NULL;
    float *b = malloc((size_t)anneal_numel(t) * sizeof *b + 4);
    anneal_to_f32_buffer(t, b);
    return b;
}

/* t against the fixture entry `name` (same element count). */
static void check_against(const anneal_tensor *t, const char *name) {
    anneal_tensor *ref = fx(name, false);
    CHECK(t && ref && anneal_numel(t) == anneal_numel(ref), "%s: missing or wrong size", name);
    if (!t || !ref || anneal_numel(t) != anneal_numel(ref)) return;
    float *a = host(t), *b = host(ref);
    int64_t w = 0;
    double r = anneal_test_close_ratio(a, b, anneal_numel(t), ATOL, RTOL, &w);
    CHECK(r <= 1.0, "%s: worst index %lld: %.9g vs %.9g", name, (long long)w, (double)a[w], (double)b[w]);
    free(a), free(b);
}

/* sum(y * G) backward. */
static bool backward_with(anneal_tensor *y, const char *g) {
    anneal_tensor *L = anneal_sum(anneal_mul(y, fx(g, false)));
    return L && anneal_backward(L) == ANNEAL_OK;
}

static const anneal_rope_desc k_rope = {.theta = 10000.0f};
static const anneal_rope_desc k_llama3 = {.theta = 10000.0f, .scaling = ANNEAL_ROPE_SCALING_LLAMA3, .factor = 8.0f,
                                          .low_freq_factor = 1.0f, .high_freq_factor = 4.0f, .original_max_pos = 16};

/* -------------------------------------------------------------- SwiGLU */

TEST(swiglu_matches_pytorch) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = fx("swiglu.x", true), *w = fx("swiglu.w", true), *b = fx("swiglu.b", true);
    anneal_tensor *mul = fx("swiglu.mul", true);
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .act = ANNEAL_ACT_SILU_MUL, .mul = mul};
    anneal_tensor *y = anneal_dense(x, w, b, &o);
    REQUIRE(y && backward_with(y, "swiglu.g"));
    check_against(y, "swiglu.y");
    check_against(x->grad, "swiglu.grad.x");
    check_against(w->grad, "swiglu.grad.w");
    check_against(b->grad, "swiglu.grad.b");
    check_against(mul->grad, "swiglu.grad.mul");
    /* the same layer with W given as (in, out): the same numbers */
    anneal_tensor *wt = anneal_contiguous(anneal_transpose(fx("swiglu.w", false), 0, 1));
    o.layout = ANNEAL_WEIGHT_IN_OUT;
    check_against(anneal_dense(x, wt, b, &o), "swiglu.y");
    anneal_scope_close(s);
}

typedef struct {
    anneal_weight_layout layout;
    bool bias, transpose; /* transpose: the x and mul leaves are (K, R) / (N, R), the op sees them transposed */
} swiglu_case;

static anneal_tensor *f_swiglu(void *ctx, anneal_tensor *const *in) {
    const swiglu_case *c = ctx;
    anneal_tensor *x = c->transpose ? anneal_transpose(in[0], 0, 1) : in[0];
    anneal_tensor *m = c->transpose ? anneal_transpose(in[2], 0, 1) : in[2];
    anneal_dense_opts o = {.layout = c->layout, .act = ANNEAL_ACT_SILU_MUL, .mul = m};
    return anneal_dense(x, in[1], c->bias ? in[3] : NULL, &o);
}

TEST(swiglu_gradients) {
    anneal_scope *s = anneal_scope_open();
    swiglu_case c1 = {ANNEAL_WEIGHT_OUT_IN, true, false}, c2 = {ANNEAL_WEIGHT_IN_OUT, false, true};
    anneal_tensor *a[4] = {anneal_test_rand(3, (int64_t[]){2, 3, 5}, -1, 1, 1, true),
                           anneal_test_rand(2, (int64_t[]){6, 5}, -1, 1, 2, true),
                           anneal_test_rand(3, (int64_t[]){2, 3, 6}, -1, 1, 3, true),
                           anneal_test_rand(1, (int64_t[]){6}, -1, 1, 4, true)};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.3% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_swiglu, &c1, 4, a, 1e-2, 1e-4, 1e-3);
    anneal_tensor *b[3] = {anneal_test_rand(2, (int64_t[]){5, 7}, -1, 1, 5, true),
                           anneal_test_rand(2, (int64_t[]){5, 4}, -1, 1, 6, true),
                           anneal_test_rand(2, (int64_t[]){4, 7}, -1, 1, 7, true)};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.17% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_swiglu, &c2, 3, b, 1e-2, 4e-5, 4e-4);
    /* errors: the multiplier's shape, and a multiplier without the activation */
    anneal_clear_error();
    anneal_dense_opts bad = {.layout = ANNEAL_WEIGHT_OUT_IN, .act = ANNEAL_ACT_SILU_MUL, .mul = a[1]};
    CHECK_TRUE(anneal_dense(a[0], a[1], NULL, &bad) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    bad.act = ANNEAL_ACT_NONE;
    CHECK_TRUE(anneal_dense(a[0], a[1], NULL, &bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    bad = (anneal_dense_opts){.act = ANNEAL_ACT_SILU_MUL, .mul = NULL}; /* an earlier failure */
    CHECK_TRUE(anneal_dense(a[0], a[1], NULL, &bad) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_scope_close(s);
}

/* ---------------------------------------------------------------- GQA */

TEST(gqa_matches_pytorch) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *q = fx("gqa.q", true), *k = fx("gqa.k", true), *v = fx("gqa.v", true);
    anneal_attention_opts o = {.causal = true};
    anneal_tensor *y = anneal_attention_ex(q, k, v, &o);
    REQUIRE(y && backward_with(y, "gqa.g"));
    check_against(y, "gqa.o");
    check_against(q->grad, "gqa.grad.q");
    check_against(k->grad, "gqa.grad.k");
    check_against(v->grad, "gqa.grad.v");
    anneal_scope_close(s);
}

/* Attention of q against k, v repeated per group (explicit copies): what GQA equals. */
static anneal_tensor *repeat_heads(anneal_tensor *t, int g) {
    int64_t B = t->shape[0], H = t->shape[1], T = t->shape[2], D = t->shape[3];
    anneal_tensor *x = anneal_reshape(t, 5, (int64_t[]){B, H, 1, T, D});
    anneal_tensor *parts[8];
    for (int i = 0; i < g; i++) parts[i] = x;
    return anneal_reshape(anneal_cat(g, parts, 2), 4, (int64_t[]){B, H * g, T, D});
}

typedef struct {
    int groups;
    bool causal, rope;
} gqa_case;

static anneal_tensor *f_gqa(void *ctx, anneal_tensor *const *in) {
    const gqa_case *c = ctx;
    anneal_attention_opts o = {.causal = c->causal, .rope = c->rope ? &k_rope : NULL, .rope_pos0 = 3};
    return anneal_attention_ex(in[0], in[1], in[2], &o);
}

TEST(gqa_equals_repeated_heads_and_gradients) {
    anneal_scope *s = anneal_scope_open();
    for (int groups = 1; groups <= 4; groups *= 2) {
        anneal_tensor *q = anneal_test_rand(4, (int64_t[]){2, 4, 6, 8}, -1, 1, 10, true);
        anneal_tensor *k = anneal_test_rand(4, (int64_t[]){2, 4 / groups, 9, 8}, -1, 1, 11, true);
        anneal_tensor *v = anneal_test_rand(4, (int64_t[]){2, 4 / groups, 9, 8}, -1, 1, 12, true);
        anneal_tensor *y = anneal_attention(q, k, v, true, 0);
        anneal_tensor *r = anneal_attention(q, repeat_heads(k, groups), repeat_heads(v, groups), true, 0);
        REQUIRE(y && r);
        float *a = host(y), *b = host(r);
        CHECK(!memcmp(a, b, (size_t)anneal_numel(y) * sizeof(float)),
              "groups %d: GQA differs from attention on repeated heads (want the same bits)", groups);
        free(a), free(b);
        gqa_case c = {groups, true, false};
        anneal_tensor *in[3] = {q, k, v};
        /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.88% of it (AVX-512, avx2, portable) */
        CHECK_GRAD(f_gqa, &c, 3, in, 1e-2, 2e-4, 2e-3);
    }
    gqa_case mq = {4, false, true}; /* multi-query, not causal, rotary */
    anneal_tensor *in[3] = {anneal_test_rand(4, (int64_t[]){1, 4, 5, 6}, -1, 1, 13, true),
                            anneal_test_rand(4, (int64_t[]){1, 1, 7, 6}, -1, 1, 14, true),
                            anneal_test_rand(4, (int64_t[]){1, 1, 7, 6}, -1, 1, 15, true)};
    /* tolerance was atol 2e-3 rtol 2e-2; worst measured 0.48% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_gqa, &mq, 3, in, 1e-2, 1e-4, 1e-3);
    anneal_scope_close(s);
}

/* --------------------------------------------------------------- RoPE */

TEST(rope_matches_pytorch) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = fx("rope.x", true);
    float *before = host(x);
    anneal_tensor *y = anneal_rope(x, &k_rope, 5);
    REQUIRE(y && backward_with(y, "rope.g"));
    check_against(y, "rope.none.y");
    check_against(x->grad, "rope.none.grad.x");
    check_against(anneal_rope(x, &k_llama3, 5), "rope.llama3.y");
    float *after = host(x);
    CHECK(!memcmp(before, after, (size_t)anneal_numel(x) * sizeof(float)), "rope modified its input");
    free(before), free(after);
    /* errors: an odd head size, a bad base, a negative position */
    anneal_clear_error();
    anneal_tensor *odd = anneal_zeros(ANNEAL_F32, 4, (int64_t[]){1, 1, 2, 5});
    CHECK_TRUE(anneal_rope(odd, &k_rope, 0) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    anneal_rope_desc bad = {.theta = 0};
    CHECK_TRUE(anneal_rope(x, &bad, 0) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_rope(x, &k_rope, -1) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_scope_close(s);
}

/* The op on h1b's kernel fixture (tests/fixtures/rope.safetensors, every scaling,
 * positions up to 100003): its values and its gradient are the backend's rope slot bit
 * for bit (the forward rotation of x, the inverse rotation of the upstream gradient),
 * which tests/cpu/test_rope.c checks against PyTorch. */
TEST(rope_op_is_the_kernel_on_its_fixture) {
    anneal_safetensors *st = NULL;
    REQUIRE(anneal_safetensors_open(anneal_test_path("tests/fixtures/rope.safetensors"), &st) == ANNEAL_OK);
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    const char *ncases = anneal_safetensors_meta(st, "cases");
    int n = ncases ? atoi(ncases) : 0;
    CHECK(n >= 6, "only %d cases", n);
    for (int k = 0; k < n; k++) {
        anneal_scope *s = anneal_scope_open();
        char key[64];
#define META(field) (snprintf(key, sizeof key, "c%d." field, k), anneal_safetensors_meta(st, key))
        const char *sc = META("scaling");
        REQUIRE(sc && META("theta") && META("pos0"));
        anneal_rope_desc r = {.theta = (float)atof(META("theta")),
                              .scaling = !strcmp(sc, "linear")   ? ANNEAL_ROPE_SCALING_LINEAR
                                         : !strcmp(sc, "llama3") ? ANNEAL_ROPE_SCALING_LLAMA3
                                                                 : ANNEAL_ROPE_SCALING_NONE,
                              .factor = (float)atof(META("factor")),
                              .low_freq_factor = (float)atof(META("low_freq_factor")),
                              .high_freq_factor = (float)atof(META("high_freq_factor")),
                              .original_max_pos = atoll(META("original_max_pos"))};
        int64_t pos0 = atoll(META("pos0"));
#undef META
        snprintf(key, sizeof key, "c%d.x", k);
        anneal_tensor *x = anneal_safetensors_load(st, key, ANNEAL_F32);
        snprintf(key, sizeof key, "c%d.g", k);
        anneal_tensor *g = anneal_safetensors_load(st, key, ANNEAL_F32);
        REQUIRE(x && g && anneal_set_requires_grad(x, true) == ANNEAL_OK);
        anneal_tensor *y = anneal_rope(x, &r, pos0);
        anneal_tensor *L = anneal_sum(anneal_mul(y, g));
        REQUIRE(y && L && anneal_backward(L) == ANNEAL_OK);
        anneal_tensor *yk = anneal_clone(anneal_detach(x)), *gk = anneal_clone(g);
        REQUIRE(be->rope(be->ctx, &r, yk, pos0, false) == ANNEAL_OK && be->rope(be->ctx, &r, gk, pos0, true) == ANNEAL_OK);
        float *a = host(y), *b = host(yk), *ga = host(x->grad), *gb = host(gk);
        size_t bytes = (size_t)anneal_numel(x) * sizeof(float);
        CHECK(!memcmp(a, b, bytes), "case %d (%s): the op's rotation is not the kernel's", k, sc);
        CHECK(!memcmp(ga, gb, bytes), "case %d (%s): the op's gradient is not the kernel's inverse", k, sc);
        free(a), free(b), free(ga), free(gb);
        anneal_scope_close(s);
    }
    anneal_safetensors_close(st);
}

static anneal_tensor *f_rope(void *ctx, anneal_tensor *const *in) {
    return anneal_rope(in[0], ctx, 7);
}

TEST(rope_gradients) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x[1] = {anneal_test_rand(4, (int64_t[]){2, 3, 4, 6}, -1, 1, 20, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.053% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_rope, (void *)&k_rope, 1, x, 1e-2, 1e-5, 1e-4);
    anneal_tensor *t[1] = {anneal_test_rand(4, (int64_t[]){2, 4, 3, 8}, -1, 1, 21, true)};
    /* tolerance was atol 1e-3 rtol 1e-2; worst measured 0.17% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_rope, (void *)&k_llama3, 1, t, 1e-2, 2e-5, 2e-4);
    anneal_scope_close(s);
}

TEST(attention_with_rope_matches_pytorch) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *q = fx("gqa.q", true), *k = fx("gqa.k", true), *v = fx("gqa.v", true);
    float *kb = host(k);
    anneal_attention_opts o = {.causal = true, .rope = &k_rope, .rope_pos0 = 5};
    anneal_tensor *y = anneal_attention_ex(q, k, v, &o);
    REQUIRE(y && backward_with(y, "gqa.g"));
    check_against(y, "gqa_rope.o");
    check_against(q->grad, "gqa_rope.grad.q");
    check_against(k->grad, "gqa_rope.grad.k");
    check_against(v->grad, "gqa_rope.grad.v");
    float *ka = host(k);
    CHECK(!memcmp(kb, ka, (size_t)anneal_numel(k) * sizeof(float)), "attention rotated its input k");
    free(kb), free(ka);
    anneal_scope_close(s);
}

TEST(packed_gqa_with_rope_matches_pytorch) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *qkv = fx("packed.qkv", true);
    anneal_attention_opts o = {.causal = true, .rope = &k_rope, .rope_pos0 = 5};
    anneal_tensor *y = anneal_attention_packed(qkv, 4, 2, &o);
    REQUIRE(y && y->ndim == 3 && y->shape[2] == 32 && backward_with(y, "packed.g"));
    check_against(y, "packed.o");
    check_against(qkv->grad, "packed.grad.qkv");
    /* errors of the head counts */
    anneal_clear_error();
    CHECK_TRUE(anneal_attention_packed(qkv, 4, 3, &o) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_attention_packed(qkv, 5, 1, &o) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    if (anneal_safetensors_open(anneal_test_path("tests/fixtures/ops_llama.safetensors"), &g_st) != ANNEAL_OK) {
        fprintf(stderr, "cannot open the fixture: %s\n", anneal_last_error());
        return 1;
    }
    RUN(swiglu_matches_pytorch);
    RUN(swiglu_gradients);
    RUN(gqa_matches_pytorch);
    RUN(gqa_equals_repeated_heads_and_gradients);
    RUN(rope_matches_pytorch);
    RUN(rope_gradients);
    RUN(rope_op_is_the_kernel_on_its_fixture);
    RUN(attention_with_rope_matches_pytorch);
    RUN(packed_gqa_with_rope_matches_pytorch);
    anneal_safetensors_close(g_st);
    return anneal_test_summary();
}
