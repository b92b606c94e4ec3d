/* Custom ops (include/anneal/custom_op.h) through the example's fused SwiGLU
 * (examples/swiglu/swiglu_op.c, compiled into this test): its gradient against finite
 * differences (contiguous and strided inputs), parity with anneal_mul(anneal_silu(a), b),
 * NULL propagation, devices (a device without a kernel, a device kernel that is used,
 * a supports predicate that declines, inputs on two devices), registration (duplicates,
 * invalid definitions, a definition without a CPU kernel), the shape rule's errors and
 * bad results, and the backward's contract: output gradients that did not arrive are
 * NULL, unsaved tensors are NULL, the parameter block is the call's copy. */
#include "anneal/anneal.h"
#include "gradcheck.h"
#include "swiglu_op.h"
#include "backend_clone.h"
#include "test.h"

#include <string.h>

#define EXT ANNEAL_DEVICE_EXT

/* ---------------------------------------------------------------- helpers */

/* A second device whose memory is host memory (the CPU's table under another name),
 * so CPU kernels can stand in for a device's kernels. */
static anneal_backend g_ext;
static bool ext_register(void) {
    if (!anneal_test_cpu_clone(&g_ext, "ext", EXT)) return false;
    return anneal_backend_register(&g_ext) == ANNEAL_OK;
}

static anneal_tensor *f_swiglu(void *ctx, anneal_tensor *const *in) { return swiglu(in[0], in[1]); }
/* Strided inputs: a transposed view of a and a column slice of b. */
static anneal_tensor *f_swiglu_strided(void *ctx, anneal_tensor *const *in) {
    return swiglu(anneal_transpose(in[0], 0, 1), anneal_narrow(in[1], 1, 1, 4));
}

static bool message_has(const char *needle) { return strstr(anneal_last_error(), needle) != NULL; }

static void all_f32(const anneal_tensor *t, float *out) {
    if (anneal_to_f32_buffer(t, out) != ANNEAL_OK) memset(out, 0, (size_t)anneal_numel(t) * sizeof *out);
}

/* ------------------------------------------------------------- swiglu */

TEST(swiglu_gradcheck) {
    REQUIRE(swiglu_register() == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *in[2] = {anneal_test_rand(2, (int64_t[]){3, 5}, -3, 3, 1, true),
                            anneal_test_rand(2, (int64_t[]){3, 5}, -2, 2, 2, true)};
    /* tolerance was atol 1e-4 rtol 1e-2; worst measured 0.6% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_swiglu, NULL, 2, in, 1e-2, 1e-5, 1e-3);
    anneal_tensor *st[2] = {anneal_test_rand(2, (int64_t[]){4, 3}, -3, 3, 3, true),
                            anneal_test_rand(2, (int64_t[]){3, 6}, -2, 2, 4, true)};
    /* tolerance was atol 1e-4 rtol 1e-2; worst measured 2.1% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_swiglu_strided, NULL, 2, st, 1e-2, 5e-5, 5e-3);
    /* only one input wants a gradient: the other gets none */
    anneal_tensor *half[2] = {anneal_test_rand(1, (int64_t[]){7}, -3, 3, 5, true),
                              anneal_test_rand(1, (int64_t[]){7}, -2, 2, 6, false)};
    /* tolerance was atol 1e-4 rtol 1e-2; worst measured 0.27% of it (AVX-512, avx2, portable) */
    CHECK_GRAD(f_swiglu, NULL, 2, half, 1e-2, 5e-6, 5e-4);
    CHECK_TRUE(half[1]->grad == NULL);
    anneal_scope_close(s);
}

/* The fused op and the composition of built-in ops agree to float rounding (their exp
 * functions may differ in the last bit). */
TEST(swiglu_matches_builtin_ops) {
    REQUIRE(swiglu_register() == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    const int64_t shape[2] = {40, 1000}; /* 40000 elements: the kernels' parallel path */
    anneal_tensor *a = anneal_test_rand(2, shape, -8, 8, 11, true), *b = anneal_test_rand(2, shape, -2, 2, 12, true);
    anneal_tensor *R = anneal_test_rand(2, shape, -1, 1, 13, false);
    REQUIRE(a && b && R);
    enum { N = 40000 };
    static float y[2][N], da[2][N], db[2][N];
    for (int k = 0; k < 2; k++) {
        anneal_grad_clear(a);
        anneal_grad_clear(b);
        anneal_tensor *out = k ? swiglu(a, b) : anneal_mul(anneal_silu(a), b);
        REQUIRE(out && anneal_backward(anneal_sum(anneal_mul(out, R))) == ANNEAL_OK);
        all_f32(out, y[k]);
        all_f32(a->grad, da[k]);
        all_f32(b->grad, db[k]);
    }
    CHECK_ALLCLOSE(y[1], y[0], N, 1e-7, 2e-6);
    CHECK_ALLCLOSE(da[1], da[0], N, 1e-7, 2e-6);
    CHECK_ALLCLOSE(db[1], db[0], N, 1e-7, 2e-6);
    /* and a clear mismatch is caught (negative control of the comparison) */
    y[1][123] *= 1.001f;
    int64_t worst;
    CHECK_TRUE(anneal_test_close_ratio(y[1], y[0], N, 1e-7, 2e-6, &worst) > 1.0 && worst == 123);
    anneal_scope_close(s);
}

TEST(swiglu_no_node_without_grad) {
    REQUIRE(swiglu_register() == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = anneal_test_rand(1, (int64_t[]){6}, -1, 1, 1, true), *b = anneal_test_rand(1, (int64_t[]){6}, -1, 1, 2, false);
    anneal_no_grad_begin();
    anneal_tensor *y = swiglu(a, b);
    anneal_no_grad_end();
    CHECK_TRUE(y && y->grad_fn == NULL && !y->requires_grad);
    anneal_tensor *c = anneal_test_rand(1, (int64_t[]){6}, -1, 1, 3, false);
    y = swiglu(c, b);
    CHECK_TRUE(y && y->grad_fn == NULL);
    y = swiglu(a, b);
    CHECK_TRUE(y && y->grad_fn && !strcmp(y->grad_fn->name, "swiglu"));
    anneal_scope_close(s);
}

TEST(null_propagates_and_first_error_is_kept) {
    REQUIRE(swiglu_register() == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *b = anneal_test_rand(1, (int64_t[]){4}, -1, 1, 1, false);
    anneal_clear_error();
    CHECK_TRUE(swiglu(NULL, b) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    /* an earlier failure (a shape error) flows through the op untouched */
    anneal_tensor *bad = anneal_matmul(b, anneal_test_rand(2, (int64_t[]){3, 2}, -1, 1, 2, false));
    CHECK_TRUE(bad == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    char first[512];
    snprintf(first, sizeof first, "%s", anneal_last_error());
    anneal_tensor *y = anneal_sum(swiglu(bad, b));
    CHECK_TRUE(y == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE && !strcmp(anneal_last_error(), first));
    anneal_clear_error();
    /* the op handle itself: an unregistered name gives NULL, and calling it fails cleanly */
    const anneal_custom_op *none = anneal_custom_op_find("no_such_op");
    CHECK_TRUE(none == NULL);
    CHECK_TRUE(anneal_custom_op_call(none, (anneal_tensor *[]){b, b}, NULL) == NULL &&
               anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_scope_close(s);
}

/* The shape rule's own errors reach the caller with its messages. */
TEST(swiglu_shape_rule_errors) {
    REQUIRE(swiglu_register() == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_clear_error();
    anneal_tensor *a = anneal_test_rand(1, (int64_t[]){4}, -1, 1, 1, false), *b = anneal_test_rand(1, (int64_t[]){5}, -1, 1, 2, false);
    CHECK_TRUE(swiglu(a, b) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    CHECK(message_has("swiglu: a (4) and b (5) must have the same shape"), "%s", anneal_last_error());
    anneal_clear_error();
    int32_t ids[4] = {0};
    anneal_tensor *i = anneal_from_data(ANNEAL_I32, 1, (int64_t[]){4}, ids);
    CHECK_TRUE(swiglu(a, i) == NULL && anneal_last_status() == ANNEAL_ERR_DTYPE);
    CHECK(message_has("swiglu: a and b must be f32, got f32 and i32"), "%s", anneal_last_error());
    anneal_clear_error();
    anneal_scope_close(s);
}

/* --------------------------------------------------------------- devices */

TEST(device_without_kernel_is_unsupported) {
    REQUIRE(swiglu_register() == ANNEAL_OK && ext_register());
    anneal_scope *s = anneal_scope_open();
    anneal_clear_error();
    anneal_tensor *a = anneal_test_rand(1, (int64_t[]){4}, -1, 1, 1, false), *b = anneal_test_rand(1, (int64_t[]){4}, -1, 1, 2, false);
    anneal_tensor *ae = anneal_to_device(a, EXT), *be = anneal_to_device(b, EXT);
    REQUIRE(ae && be);
    CHECK_TRUE(swiglu(ae, be) == NULL && anneal_last_status() == ANNEAL_ERR_UNSUPPORTED);
    CHECK(message_has("swiglu") && message_has("no kernel for device ext (2)"), "%s", anneal_last_error());
    anneal_clear_error();
    /* inputs on two devices */
    CHECK_TRUE(swiglu(a, be) == NULL && anneal_last_status() == ANNEAL_ERR_DEVICE);
    CHECK(message_has("swiglu: inputs on cpu and ext"), "%s", anneal_last_error());
    anneal_clear_error();
    anneal_scope_close(s);
}

/* A device kernel: the swiglu definition with the EXT device's entry, counting calls
 * (its memory is host memory here, so it can run the CPU kernels) and declining inputs
 * over 100 elements. */
static int g_ext_fwd, g_ext_bwd;
static anneal_custom_forward_fn g_cpu_fwd;
static anneal_custom_backward_fn g_cpu_bwd;
static anneal_status ext_fwd(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    g_ext_fwd += c->backend == &g_ext && c->device == EXT && in[0]->device == EXT && out[0]->device == EXT;
    return g_cpu_fwd(c, in, out);
}
static anneal_status ext_bwd(const anneal_custom_ctx *c, anneal_tensor *const *gi, const anneal_tensor *const *in,
                             const anneal_tensor *const *out, const anneal_tensor *const *go) {
    g_ext_bwd += c->backend == &g_ext && go[0]->device == EXT && (!gi[0] || gi[0]->device == EXT);
    return g_cpu_bwd(c, gi, in, out, go);
}
static bool ext_supports(const anneal_custom_ctx *c, const anneal_tensor *const *in) { return anneal_numel(in[0]) <= 100; }

TEST(device_kernel_is_used_and_may_decline) {
    REQUIRE(ext_register());
    anneal_custom_op_def d = *swiglu_definition();
    d.name = "swiglu_ext";
    g_cpu_fwd = d.kernels[ANNEAL_CPU].forward;
    g_cpu_bwd = d.kernels[ANNEAL_CPU].backward;
    d.kernels[EXT] = (anneal_custom_kernel){ext_fwd, ext_bwd, ext_supports};
    const anneal_custom_op *op;
    REQUIRE(anneal_custom_op_register(&d, &op) == ANNEAL_OK);
    CHECK_TRUE(anneal_custom_op_find("swiglu_ext") == op && anneal_custom_op_definition(op)->n_inputs == 2);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *a = anneal_test_rand(1, (int64_t[]){9}, -2, 2, 1, true), *b = anneal_test_rand(1, (int64_t[]){9}, -2, 2, 2, false);
    anneal_tensor *y_cpu = anneal_custom_op_call(op, (anneal_tensor *[]){a, b}, NULL);
    REQUIRE(y_cpu && anneal_backward(anneal_sum(y_cpu)) == ANNEAL_OK);
    float want_y[9], want_da[9], got_y[9], got_da[9];
    all_f32(y_cpu, want_y);
    all_f32(a->grad, want_da);
    CHECK_TRUE(g_ext_fwd == 0 && g_ext_bwd == 0); /* CPU inputs: the CPU kernel */
    anneal_tensor *ae = anneal_to_device(a, EXT), *be = anneal_to_device(b, EXT);
    REQUIRE(ae && be && anneal_set_requires_grad(ae, true) == ANNEAL_OK);
    anneal_tensor *y = anneal_custom_op_call(op, (anneal_tensor *[]){ae, be}, NULL);
    REQUIRE(y && y->device == EXT && anneal_backward(anneal_sum(y)) == ANNEAL_OK);
    CHECK(g_ext_fwd == 1 && g_ext_bwd == 1, "device kernel calls: forward %d backward %d", g_ext_fwd, g_ext_bwd);
    REQUIRE(ae->grad && ae->grad->device == EXT);
    all_f32(y, got_y);
    all_f32(ae->grad, got_da);
    CHECK_TRUE(!memcmp(got_y, want_y, sizeof got_y) && !memcmp(got_da, want_da, sizeof got_da));
    /* the kernel declines large inputs */
    anneal_clear_error();
    anneal_tensor *big = anneal_zeros_like(anneal_to_device(anneal_test_rand(1, (int64_t[]){101}, -1, 1, 3, false), EXT));
    CHECK_TRUE(anneal_custom_op_call(op, (anneal_tensor *[]){big, big}, NULL) == NULL &&
               anneal_last_status() == ANNEAL_ERR_UNSUPPORTED);
    CHECK(message_has("swiglu_ext") && message_has("device ext (2) declines"), "%s", anneal_last_error());
    anneal_clear_error();
    anneal_scope_close(s);
}

/* ---------------------------------------------------------- registration */

static anneal_status shape_like_input(const anneal_custom_ctx *c, const anneal_tensor *const *in,
                                      anneal_custom_out_spec *out) {
    for (int j = 0; j < c->n_outputs; j++) {
        out[j].dtype = in[0]->dtype;
        out[j].ndim = in[0]->ndim;
        memcpy(out[j].shape, in[0]->shape, sizeof in[0]->shape);
    }
    return ANNEAL_OK;
}
static anneal_status fwd_noop(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    return ANNEAL_OK;
}
static anneal_status bwd_noop(const anneal_custom_ctx *c, anneal_tensor *const *gi, const anneal_tensor *const *in,
                              const anneal_tensor *const *out, const anneal_tensor *const *go) {
    return ANNEAL_OK;
}

static anneal_custom_op_def valid_def(const char *name) {
    return (anneal_custom_op_def){.version = ANNEAL_CUSTOM_OP_VERSION, .name = name, .n_inputs = 1, .n_outputs = 1,
                                  .shape = shape_like_input, .differentiable = 1,
                                  .kernels = {[ANNEAL_CPU] = {fwd_noop, bwd_noop, NULL}}};
}

/* def is refused with ANNEAL_ERR_ARG and a message holding `words`; the name stays free. */
static void expect_refused(const anneal_custom_op_def *def, const char *words) {
    anneal_clear_error();
    CHECK(anneal_custom_op_register(def, NULL) == ANNEAL_ERR_ARG, "'%s': %s", words, anneal_last_error());
    CHECK(message_has(words), "message '%s' lacks '%s'", anneal_last_error(), words);
    CHECK_TRUE(!def || !def->name || anneal_custom_op_find(def->name) == NULL);
    anneal_clear_error();
}

TEST(registration_validates_and_refuses_duplicates) {
    REQUIRE(swiglu_register() == ANNEAL_OK);
    anneal_clear_error();
    CHECK_TRUE(anneal_custom_op_register(swiglu_definition(), NULL) == ANNEAL_ERR_STATE);
    CHECK(message_has("an op named 'swiglu' is already registered"), "%s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(swiglu_register() == ANNEAL_OK); /* the example's own guard */

    anneal_custom_op_def d = valid_def("no_cpu");
    d.kernels[ANNEAL_CPU] = (anneal_custom_kernel){0};
    d.kernels[ANNEAL_CUDA] = (anneal_custom_kernel){fwd_noop, bwd_noop, NULL};
    expect_refused(&d, "op 'no_cpu' has no CPU kernel");
    d = valid_def("no_bwd");
    d.kernels[ANNEAL_CPU].backward = NULL;
    expect_refused(&d, "op 'no_bwd' has differentiable inputs but the kernel of device 0 has no backward");
    d.differentiable = 0; /* an op without gradients needs no backward */
    anneal_clear_error();
    CHECK(anneal_custom_op_register(&d, NULL) == ANNEAL_OK, "%s", anneal_last_error());
    d = valid_def("v0");
    d.version = 0;
    expect_refused(&d, "op 'v0' is written for definition version 0");
    d.version = ANNEAL_CUSTOM_OP_VERSION + 1;
    expect_refused(&d, "is written for definition version");
    d = valid_def("counts");
    d.n_outputs = ANNEAL_CUSTOM_OP_MAX_TENSORS + 1;
    expect_refused(&d, "op 'counts' has 1 inputs and 9 outputs");
    d = valid_def("mask");
    d.differentiable = 0x2;
    expect_refused(&d, "op 'mask': differentiable names a tensor");
    d = valid_def("mask");
    d.save_outputs = 0x4;
    expect_refused(&d, "op 'mask': save_outputs names a tensor");
    d = valid_def("noshape");
    d.shape = NULL;
    expect_refused(&d, "op 'noshape' has no shape rule");
    d = valid_def("params");
    d.param_size = ANNEAL_CUSTOM_OP_MAX_PARAM_BYTES + 1;
    expect_refused(&d, "parameter block of 65537 bytes");
    d = valid_def("half");
    d.kernels[ANNEAL_CUDA].backward = bwd_noop;
    expect_refused(&d, "op 'half': the kernel of device 1 has no forward");
    d = valid_def("");
    expect_refused(&d, "name must be 1..63 bytes");
    d = valid_def(NULL);
    expect_refused(&d, "got NULL");
    expect_refused(NULL, "NULL definition");
}

/* A shape rule that returns an impossible result, per call parameter. */
static anneal_status shape_bad(const anneal_custom_ctx *c, const anneal_tensor *const *in,
                               anneal_custom_out_spec *out) {
    int what = *(const int *)c->params;
    out[0].ndim = 1;
    out[0].shape[0] = 3;
    if (what == 0) out[0].ndim = ANNEAL_MAX_DIMS + 1;
    if (what == 1) out[0].shape[0] = -2;
    if (what == 2) out[0].dtype = ANNEAL_DTYPE_COUNT;
    if (what == 3) return ANNEAL_ERR_SHAPE; /* an error without a message */
    return ANNEAL_OK;
}

TEST(bad_shape_rule_results_are_errors) {
    anneal_custom_op_def d = valid_def("bad_shape");
    d.shape = shape_bad;
    d.param_size = sizeof(int);
    const anneal_custom_op *op;
    REQUIRE(anneal_custom_op_register(&d, &op) == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(1, (int64_t[]){3}, -1, 1, 1, true);
    for (int what = 0; what < 3; what++) {
        anneal_clear_error();
        anneal_tensor *out[1] = {x};
        CHECK(anneal_custom_op_apply(op, &x, &what, out) == ANNEAL_ERR_ARG && out[0] == NULL, "case %d", what);
        CHECK(message_has("bad_shape: the shape rule gave output 0 an invalid result"), "case %d: %s", what,
              anneal_last_error());
    }
    anneal_clear_error();
    int what = 3;
    CHECK_TRUE(anneal_custom_op_call(op, &x, &what) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE);
    CHECK(message_has("bad_shape: the shape rule failed (ANNEAL_ERR_SHAPE) without a message"), "%s",
          anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_custom_op_call(op, &x, NULL) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    CHECK(message_has("bad_shape: NULL parameter block (4 bytes expected)"), "%s", anneal_last_error());
    anneal_clear_error();
    what = 4;
    CHECK_TRUE(anneal_custom_op_call(op, &x, &what) != NULL);
    anneal_scope_close(s);
}

/* ------------------------------------------- the backward's contract */

/* "scale2": y0 = k * x, y1 = 2k * x for the parameter k; saves nothing. Its backward
 * records what it was handed. */
static struct {
    int calls;
    bool saw_null_g1, saw_null_saved;
    float k;
} g_scale2;

static anneal_status scale2_fwd(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    float k = *(const float *)c->params;
    const float *x = anneal_data(in[0]);
    float *y0 = anneal_data(out[0]), *y1 = anneal_data(out[1]);
    for (int64_t i = 0; i < anneal_numel(in[0]); i++) {
        y0[i] = k * x[i];
        y1[i] = 2 * k * x[i];
    }
    return ANNEAL_OK;
}

static anneal_status scale2_bwd(const anneal_custom_ctx *c, anneal_tensor *const *gi, const anneal_tensor *const *in,
                                const anneal_tensor *const *out, const anneal_tensor *const *go) {
    float k = *(const float *)c->params;
    g_scale2.calls++;
    g_scale2.k = k;
    g_scale2.saw_null_g1 = go[1] == NULL;
    g_scale2.saw_null_saved = in[0] == NULL && out[0] == NULL && out[1] == NULL;
    float *dx = anneal_data(gi[0]);
    int64_t n = anneal_numel(gi[0]);
    for (int64_t i = 0; i < n; i++) dx[i] = 0;
    for (int j = 0; j < 2; j++) { /* a missing output gradient counts as zeros */
        if (!go[j]) continue;
        const float *g = anneal_data(go[j]);
        for (int64_t i = 0; i < n; i++) dx[i] += (j ? 2 * k : k) * g[i];
    }
    return ANNEAL_OK;
}

TEST(backward_gets_null_for_missing_grads_and_unsaved_tensors) {
    anneal_custom_op_def d = valid_def("scale2");
    d.n_outputs = 2;
    d.param_size = sizeof(float);
    d.kernels[ANNEAL_CPU] = (anneal_custom_kernel){scale2_fwd, scale2_bwd, NULL};
    const anneal_custom_op *op;
    REQUIRE(anneal_custom_op_register(&d, &op) == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(1, (int64_t[]){5}, -1, 1, 1, true);
    float k = 3.0f;
    anneal_tensor *y[2];
    REQUIRE(anneal_custom_op_apply(op, &x, &k, y) == ANNEAL_OK && y[0] && y[1]);
    CHECK_TRUE(y[0]->grad_fn == y[1]->grad_fn && y[1]->grad_fn_output == 1);
    k = 100.0f; /* the call copied its parameters */
    memset(&g_scale2, 0, sizeof g_scale2);
    REQUIRE(anneal_backward(anneal_sum(y[0])) == ANNEAL_OK); /* only y0 reaches the loss */
    CHECK_TRUE(g_scale2.calls == 1 && g_scale2.k == 3.0f && g_scale2.saw_null_g1 && g_scale2.saw_null_saved);
    for (int i = 0; i < 5; i++) CHECK_TRUE(anneal_item_at(x->grad, i) == 3.0);
    /* both outputs used: both gradients arrive */
    anneal_grad_clear(x);
    k = 0.5f;
    REQUIRE(anneal_custom_op_apply(op, &x, &k, y) == ANNEAL_OK);
    memset(&g_scale2, 0, sizeof g_scale2);
    REQUIRE(anneal_backward(anneal_add(anneal_sum(y[0]), anneal_sum(y[1]))) == ANNEAL_OK);
    CHECK_TRUE(g_scale2.calls == 1 && !g_scale2.saw_null_g1);
    for (int i = 0; i < 5; i++) CHECK_TRUE(anneal_item_at(x->grad, i) == 1.5);
    /* a second backward through the same graph is refused, as for built-in ops */
    anneal_clear_error();
    REQUIRE(anneal_custom_op_apply(op, &x, &k, y) == ANNEAL_OK);
    anneal_tensor *loss = anneal_sum(y[0]);
    REQUIRE(anneal_backward(loss) == ANNEAL_OK);
    CHECK_TRUE(anneal_backward(loss) == ANNEAL_ERR_STATE);
    anneal_clear_error();
    anneal_scope_close(s);
}

/* A kernel's error reaches the caller (with a generic message when it set none). */
static anneal_status fwd_fails(const anneal_custom_ctx *c, const anneal_tensor *const *in, anneal_tensor *const *out) {
    return ANNEAL_ERR_NUMERIC;
}

TEST(kernel_errors_propagate) {
    anneal_custom_op_def d = valid_def("fails");
    d.kernels[ANNEAL_CPU].forward = fwd_fails;
    const anneal_custom_op *op;
    REQUIRE(anneal_custom_op_register(&d, &op) == ANNEAL_OK);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_test_rand(1, (int64_t[]){5}, -1, 1, 1, true);
    anneal_clear_error();
    CHECK_TRUE(anneal_sum(anneal_custom_op_call(op, &x, NULL)) == NULL && anneal_last_status() == ANNEAL_ERR_NUMERIC);
    CHECK(message_has("fails: the forward kernel failed (ANNEAL_ERR_NUMERIC) without a message"), "%s",
          anneal_last_error());
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(swiglu_gradcheck);
    RUN(swiglu_matches_builtin_ops);
    RUN(swiglu_no_node_without_grad);
    RUN(null_propagates_and_first_error_is_kept);
    RUN(swiglu_shape_rule_errors);
    RUN(device_without_kernel_is_unsupported);
    RUN(device_kernel_is_used_and_may_decline);
    RUN(registration_validates_and_refuses_duplicates);
    RUN(bad_shape_rule_results_are_errors);
    RUN(backward_gets_null_for_missing_grads_and_unsaved_tensors);
    RUN(kernel_errors_propagate);
    return anneal_test_summary();
}
