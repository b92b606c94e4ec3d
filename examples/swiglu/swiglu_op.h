/* A fused SwiGLU written as a custom op: y = silu(a) * b elementwise, the gate of a
 * Llama MLP (silu(x W_gate) * (x W_up)) in one pass instead of two, with its own
 * backward. Written against anneal's public headers only. */
#ifndef SWIGLU_OP_H
#define SWIGLU_OP_H

#include "anneal/anneal.h"
#include "anneal/custom_op.h"

/* The definition: inputs a, b (f32, the same shape), output y (f32, that shape); both
 * inputs differentiable; the backward keeps a and b (not y). A CPU kernel only. */
const anneal_custom_op_def *swiglu_definition(void);
/* Registers "swiglu" (once; later calls return ANNEAL_OK). */
anneal_status swiglu_register(void);
/* silu(a) * b through the registered op (NULL + error when not registered, on an input
 * error, or when a and b differ in shape or are not f32). */
anneal_tensor *swiglu(anneal_tensor *a, anneal_tensor *b);

#endif
