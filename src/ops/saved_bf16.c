/* bf16 storage of saved activations (issue 17's "bf16 activations"). At compute bf16
 * the CPU backend's GEMMs and attention tiles round their operands to bf16 (nearest
 * even, NaN kept quiet) before any arithmetic. An activation that an op's backward reads
 * ONLY as such an operand (a dense layer's x, used by dW = x^T dy; attention's q, k, v)
 * can therefore be saved as its bf16 rounding: widened back to f32 (exact) for the
 * backward, it rounds to the same bf16 values, so the gradients keep every bit while
 * the saved bytes halve. What backward reads in f32 (norm inputs, GELU's pre-activation,
 * attention's output for its D term) stays f32. Only the CPU is known to round this way,
 * so other devices save f32 as before. */
#include "ops_internal.h"

static bool g_bf16_saves = true;   /* test switch: false saves f32 as before issue 17 */
static bool g_gelu_resave = true;  /* test switch of dense.c's gelu_source */

void anneal_ops_bf16_saves_set(bool on) { g_bf16_saves = on; }
void anneal_ops_gelu_resave_set(bool on) { g_gelu_resave = on; }
bool anneal_ops_gelu_resave_on(void) { return g_gelu_resave; }

bool anneal_ops_bf16_save_ok(const anneal_tensor *t, anneal_dtype compute) {
    return g_bf16_saves && t && compute == ANNEAL_BF16 && t->device == ANNEAL_CPU && t->dtype == ANNEAL_F32 &&
           anneal_grad_enabled() && anneal_numel(t) > 0;
}

/* A new tensor of dtype dt with t's shape, and t's strides when t's layout is dense
 * (else contiguous), in the current scope. */
static anneal_tensor *empty_in_layout(const anneal_tensor *t, anneal_dtype dt) {
    return anneal_ops_dense_layout(t) ? anneal_ops_empty_with_strides(t, dt)
                                      : anneal_empty_on(t->device, dt, t->ndim, t->shape);
}

/* t converted to dt in t's layout (see empty_in_layout), or NULL with the error. */
static anneal_tensor *convert(const anneal_backend *be, anneal_tensor *t, anneal_dtype dt) {
    anneal_tensor *c = empty_in_layout(t, dt);
    if (!c) return NULL;
    int64_t span_t0 = anneal_span_begin();
    return anneal_ops_span_end("saved_bf16", &span_t0, 0, anneal_ops_span_bytes(t), be->copy(be->ctx, c, t)) ==
                   ANNEAL_OK
               ? c
               : NULL;
}

anneal_tensor *anneal_ops_bf16_save_copy(const anneal_backend *be, anneal_tensor *t) {
    return t ? convert(be, t, ANNEAL_BF16) : NULL;
}

anneal_tensor *anneal_ops_saved_f32(const anneal_backend *be, anneal_tensor *t) {
    if (!t || t->dtype == ANNEAL_F32) return t;
    return convert(be, t, ANNEAL_F32);
}
