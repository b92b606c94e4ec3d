/* int8 quantization ops: symmetric quantization of a tensor's rows (or groups of a
 * row), and the quantized dense product y = x W^T + b with an int8 weight (weight-only,
 * dynamic or static; see anneal_qmatmul_desc). Inference only: the product has no
 * backward, and an input that wants a gradient is an error (a quantized model is not
 * trained). Dispatch through the backend's quantize_s8 and qmatmul slots (table version 2). */
#include "ops_internal.h"

#include <stdio.h>

/* The backend of t when it has the slot, else NULL and ANNEAL_ERR_UNSUPPORTED. */
#define QUANT_BACKEND(op, be, t, slot)                                                                         \
    do {                                                                                                         \
        anneal_tensor *in_[1] = {(t)};                                                                           \
        (be) = anneal_ops_backend(op, 1, in_);                                                                   \
        if ((be) && !ANNEAL_BACKEND_SLOT((be), slot, 2)) {                                                      \
            anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: the %s backend has no int8 kernels (%s)", op, (be)->name, \
                             #slot);                                                                             \
            (be) = NULL;                                                                                         \
        }                                                                                                        \
    } while (0)

anneal_tensor *anneal_quantize_s8(anneal_tensor *x, int64_t group, anneal_tensor **scales) {
    const char *op = "quantize_s8";
    if (scales) *scales = NULL;
    if (!x) return NULL;
    if (!scales) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: scales must not be NULL", op);
        return NULL;
    }
    if (!anneal_ops_require_f32(op, "x", x)) return NULL;
    if (x->ndim < 1 || x->ndim > 7) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x must have 1 to 7 dims, has %d", op, x->ndim);
        return NULL;
    }
    const int64_t cols = x->shape[x->ndim - 1];
    if (group < 0 || (group > 0 && (cols == 0 || cols % group))) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: group size %lld does not divide the last dim %lld", op,
                         (long long)group, (long long)cols);
        return NULL;
    }
    const anneal_backend *be;
    QUANT_BACKEND(op, be, x, quantize_s8);
    anneal_tensor *xc = be ? anneal_ops_contiguous_raw(x) : NULL;
    if (!xc) return NULL;
    int64_t sshape[8];
    int sn = x->ndim - 1;
    for (int i = 0; i < sn; i++) sshape[i] = x->shape[i];
    if (group > 0) sshape[sn++] = cols / group;
    anneal_tensor *q = anneal_empty_on(x->device, ANNEAL_I8, x->ndim, x->shape);
    anneal_tensor *s = q ? anneal_empty_on(x->device, ANNEAL_F32, sn, sshape) : NULL;
    if (!s || be->quantize_s8(be->ctx, q, s, xc, group) != ANNEAL_OK) return NULL;
    *scales = s;
    return q;
}

/* Checks wq (N, K) i8, wscale f32 (N) or (N, K / group), bias (N), the descriptor. */
static bool check_weight(const char *op, const anneal_tensor *wq, const anneal_tensor *ws, const anneal_tensor *b,
                         const anneal_qmatmul_desc *d) {
    if (d->mode != ANNEAL_QUANT_WEIGHT_ONLY && d->mode != ANNEAL_QUANT_DYNAMIC && d->mode != ANNEAL_QUANT_STATIC) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: unknown quantization mode %d", op, (int)d->mode);
        return false;
    }
    if (wq->dtype != ANNEAL_I8 || wq->ndim != 2) {
        anneal_set_error(ANNEAL_ERR_DTYPE, "%s: the weight must be a 2-D int8 tensor (%s, %d dims)", op,
                         anneal_dtype_name(wq->dtype), wq->ndim);
        return false;
    }
    const int64_t N = wq->shape[0], K = wq->shape[1];
    if (d->group < 0 || (d->group > 0 && K % d->group)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: group size %lld does not divide in-features %lld", op,
                         (long long)d->group, (long long)K);
        return false;
    }
    if (d->mode != ANNEAL_QUANT_WEIGHT_ONLY && d->group) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: group-wise scales are for weight-only quantization (mode %d)", op,
                         (int)d->mode);
        return false;
    }
    if (d->mode != ANNEAL_QUANT_WEIGHT_ONLY && K > 65536) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: in-features %lld > 65536: the int32 sums could overflow", op,
                         (long long)K);
        return false;
    }
    if (d->mode == ANNEAL_QUANT_WEIGHT_ONLY && d->compute != ANNEAL_F32 && d->compute != ANNEAL_BF16) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: weight-only products run at f32 or bf16, not %s", op,
                         anneal_dtype_name(d->compute));
        return false;
    }
    if (d->mode == ANNEAL_QUANT_STATIC && !(d->act_scale > 0.0f && d->act_scale < 3.0e38f)) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: the static activation scale must be positive and finite (%g)", op,
                         (double)d->act_scale);
        return false;
    }
    const bool per_group = d->group > 0;
    if (ws->dtype != ANNEAL_F32 || ws->ndim != (per_group ? 2 : 1) || ws->shape[0] != N ||
        (per_group && ws->shape[1] != K / d->group)) {
        char want[64];
        if (per_group) snprintf(want, sizeof want, "(%lld, %lld)", (long long)N, (long long)(K / d->group));
        else snprintf(want, sizeof want, "(%lld)", (long long)N);
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the weight scales must be f32 %s", op, want);
        return false;
    }
    if (b && (b->dtype != ANNEAL_F32 || b->ndim != 1 || b->shape[0] != N)) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the bias must be f32 (%lld)", op, (long long)N);
        return false;
    }
    return true;
}

anneal_tensor *anneal_qlinear(anneal_tensor *x, anneal_tensor *wq, anneal_tensor *wscale, anneal_tensor *bias,
                              const anneal_qmatmul_desc *d) {
    const char *op = "qlinear";
    if (!x || !wq || !wscale || !d) {
        if (x && wq && wscale) anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL descriptor", op);
        return NULL;
    }
    if (!anneal_ops_require_f32(op, "x", x) || !check_weight(op, wq, wscale, bias, d)) return NULL;
    if (anneal_grad_enabled() && (x->requires_grad || x->grad_fn)) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                         "%s: a quantized dense layer has no backward (quantized models run inference only)", op);
        return NULL;
    }
    const int64_t N = wq->shape[0], K = wq->shape[1];
    if (x->ndim < 1 || x->shape[x->ndim - 1] != K) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: x's last dim must be the in-features %lld", op, (long long)K);
        return NULL;
    }
    anneal_tensor *in[4] = {x, wq, wscale, bias};
    const anneal_backend *be = anneal_ops_backend(op, bias ? 4 : 3, in);
    if (be && !ANNEAL_BACKEND_SLOT(be, qmatmul, 2)) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: the %s backend has no int8 kernels", op, be->name);
        return NULL;
    }
    anneal_tensor *x2 = be ? anneal_ops_contiguous_raw(x) : NULL;
    anneal_tensor *w2 = x2 ? anneal_ops_contiguous_raw(wq) : NULL;
    anneal_tensor *s2 = w2 ? anneal_ops_contiguous_raw(wscale) : NULL;
    anneal_tensor *b2 = s2 && bias ? anneal_ops_contiguous_raw(bias) : NULL;
    if (!s2 || (bias && !b2)) return NULL;
    const int64_t M = anneal_numel(x) / (K ? K : 1);
    int64_t shape[8];
    for (int i = 0; i < x->ndim - 1; i++) shape[i] = x->shape[i];
    shape[x->ndim - 1] = N;
    anneal_tensor *y = anneal_empty_on(x->device, ANNEAL_F32, x->ndim, shape);
    anneal_tensor *xf = y ? anneal_alias(x2, 2, (int64_t[]){M, K}, (int64_t[]){K, 1}, x2->offset) : NULL;
    anneal_tensor *yf = xf ? anneal_alias(y, 2, (int64_t[]){M, N}, (int64_t[]){N, 1}, 0) : NULL;
    if (!yf) return NULL;
    int64_t t0 = anneal_span_begin();
    double flops = anneal_trace_enabled() ? 2.0 * (double)M * (double)N * (double)K : 0;
    if (anneal_ops_span_end(op, &t0, flops, (double)(N * K), be->qmatmul(be->ctx, d, yf, xf, w2, s2, b2)) != ANNEAL_OK)
        return NULL;
    return y;
}
