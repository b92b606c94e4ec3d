/* The dense product over a weight packed as bf16 panels (decode_kernels.h's
 * anneal_gemv_pack_panels_bf16 layout): y = x W + b for an inference-only model whose
 * float weights were replaced by their bf16 panels (anneal_params_pack_bf16), so a
 * forward outside the decode engine reads the same weights the engine reads, with its
 * arithmetic. No backward: an input that wants a gradient is an error. Dispatch through
 * the backend's panels_matmul slot (table version 5). */
#include "anneal/decode_kernels.h"
#include "ops_internal.h"

anneal_tensor *anneal_panels_linear(anneal_tensor *x, anneal_tensor *panels, anneal_tensor *bias, int64_t in,
                                    int64_t out) {
    const char *op = "panels_linear";
    if (!x || !panels) return NULL;
    if (!anneal_ops_require_f32(op, "x", x)) return NULL;
    if (in <= 0 || out <= 0 || panels->dtype != ANNEAL_BF16 || panels->ndim != 1 ||
        panels->shape[0] != anneal_gemv_panels_bf16_len(in, out)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the panels of a (%lld in, %lld out) weight are bf16 (%lld), not %s with %d dims",
                         op, (long long)in, (long long)out,
                         (long long)(in > 0 && out > 0 ? anneal_gemv_panels_bf16_len(in, out) : 0),
                         anneal_dtype_name(panels->dtype), panels->ndim);
        return NULL;
    }
    if (bias && (bias->dtype != ANNEAL_F32 || bias->ndim != 1 || bias->shape[0] != out)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the bias must be f32 (%lld)", op, (long long)out);
        return NULL;
    }
    if (x->ndim < 1 || x->ndim > 8 || x->shape[x->ndim - 1] != in) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x's last dim must be the in-features %lld", op, (long long)in);
        return NULL;
    }
    if (anneal_grad_enabled() && (x->requires_grad || x->grad_fn)) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                         "%s: a layer packed as bf16 panels has no backward (the model was packed for inference)", op);
        return NULL;
    }
    anneal_tensor *inputs[3] = {x, panels, bias};
    const anneal_backend *be = anneal_ops_backend(op, bias ? 3 : 2, inputs);
    if (be && !ANNEAL_BACKEND_SLOT(be, panels_matmul, 5)) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: the %s backend has no bf16 panel kernel", op, be->name);
        return NULL;
    }
    anneal_tensor *x2 = be ? anneal_ops_contiguous_raw(x) : NULL;
    anneal_tensor *b2 = x2 && bias ? anneal_ops_contiguous_raw(bias) : NULL;
    if (!x2 || (bias && !b2) || !anneal_is_contiguous(panels)) {
        if (x2 && (!bias || b2)) anneal_set_error(ANNEAL_ERR_ARG, "%s: the panels must be contiguous", op);
        return NULL;
    }
    const int64_t M = anneal_numel(x) / in;
    int64_t shape[8];
    for (int i = 0; i < x->ndim - 1; i++) shape[i] = x->shape[i];
    shape[x->ndim - 1] = out;
    anneal_tensor *y = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, shape);
    anneal_tensor *xf = y ? anneal_alias(x2, 2, (int64_t[]){M, in}, (int64_t[]){in, 1}, x2->offset) : NULL;
    anneal_tensor *yf = xf ? anneal_alias(y, 2, (int64_t[]){M, out}, (int64_t[]){out, 1}, 0) : NULL;
    if (!yf) return NULL;
    if (M == 0) return y;
    int64_t t0 = anneal_span_begin();
    double flops = anneal_trace_enabled() ? 2.0 * (double)M * (double)out * (double)in : 0;
    if (anneal_ops_span_end(op, &t0, flops, 2.0 * (double)(in * out), be->panels_matmul(be->ctx, yf, xf, panels, b2)) !=
        ANNEAL_OK)
        return NULL;
    return y;
}
