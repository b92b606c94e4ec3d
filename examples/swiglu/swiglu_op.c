/* The SwiGLU custom op (swiglu_op.h): shape rule and CPU kernels.
 *
 * Forward y = silu(a) * b with silu(a) = a / (1 + e^-a) (PyTorch's formula);
 * backward, with s = sigmoid(a): da = dy * b * s * (1 + a * (1 - s)), db = dy * silu(a).
 * Elementwise work split by OpenMP into static chunks: each element is computed by
 * the same arithmetic whichever thread does it, so results do not depend on the
 * thread count. */
#include "swiglu_op.h"

#include <math.h>

/* Elements below which the kernels stay on one thread. */
#define PARALLEL_MIN 32768

/* y: a's shape and f32; a and b must be f32 with the same shape. */
static anneal_status swiglu_shape(const anneal_custom_ctx *c, const anneal_tensor *const *in,
                                  anneal_custom_out_spec *out) {
    const anneal_tensor *a = in[0], *b = in[1];
    if (a->dtype != ANNEAL_F32 || b->dtype != ANNEAL_F32)
        return anneal_set_error(ANNEAL_ERR_DTYPE, "%s: a and b must be f32, got %s and %s", c->name,
                                anneal_dtype_name(a->dtype), anneal_dtype_name(b->dtype));
    if (!anneal_same_shape(a, b)) {
        char sa[128], sb[128];
        return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: a %s and b %s must have the same shape", c->name,
                                anneal_shape_str(a, sa, sizeof sa), anneal_shape_str(b, sb, sizeof sb));
    }
    out[0].dtype = ANNEAL_F32;
    out[0].ndim = a->ndim;
    for (int i = 0; i < a->ndim; i++) out[0].shape[i] = a->shape[i];
    return ANNEAL_OK;
}

static anneal_status swiglu_forward_cpu(const anneal_custom_ctx *c, const anneal_tensor *const *in,
                                        anneal_tensor *const *out) {
    const float *a = anneal_data(in[0]), *b = anneal_data(in[1]);
    float *y = anneal_data(out[0]);
    int64_t n = anneal_numel(out[0]);
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) y[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
    return ANNEAL_OK;
}

/* grad_outputs[0] is never NULL here: the op has one output, and the engine calls a
 * backward only when some output received a gradient. */
static anneal_status swiglu_backward_cpu(const anneal_custom_ctx *c, anneal_tensor *const *grad_in,
                                         const anneal_tensor *const *in, const anneal_tensor *const *out,
                                         const anneal_tensor *const *grad_out) {
    const float *a = anneal_data(in[0]), *b = anneal_data(in[1]), *dy = anneal_data(grad_out[0]);
    float *da = grad_in[0] ? anneal_data(grad_in[0]) : NULL, *db = grad_in[1] ? anneal_data(grad_in[1]) : NULL;
    int64_t n = anneal_numel(in[0]);
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float e = expf(-a[i]), s = 1.0f / (1.0f + e);
        if (da) da[i] = dy[i] * b[i] * (s * (1.0f + a[i] * (1.0f - s)));
        if (db) db[i] = dy[i] * (a[i] / (1.0f + e));
    }
    return ANNEAL_OK;
}

static const anneal_custom_op_def k_swiglu = {
    .version = ANNEAL_CUSTOM_OP_VERSION,
    .name = "swiglu",
    .n_inputs = 2,
    .n_outputs = 1,
    .shape = swiglu_shape,
    .differentiable = 0x3, /* a and b */
    .save_inputs = 0x3,    /* the backward reads a and b */
    .kernels = {[ANNEAL_CPU] = {.forward = swiglu_forward_cpu, .backward = swiglu_backward_cpu}},
};

static const anneal_custom_op *g_swiglu;

const anneal_custom_op_def *swiglu_definition(void) { return &k_swiglu; }

anneal_status swiglu_register(void) {
    if (g_swiglu) return ANNEAL_OK;
    return anneal_custom_op_register(&k_swiglu, &g_swiglu);
}

anneal_tensor *swiglu(anneal_tensor *a, anneal_tensor *b) {
    anneal_tensor *in[2] = {a, b};
    return anneal_custom_op_call(g_swiglu, in, NULL);
}
