/* What the architectures' decode plans share (decode_engine.h): a dense layer's weight as
 * the GEMV kernels read it. Its own file so that gpt2.c and llama.c, which the engine
 * calls for their plans, do not call back into the engine. */
#include "decode_engine.h"

bool anneal_decode_dense(const anneal_nn_dense *d, anneal_gemv_weight *w) {
    /* LoRA and int8 layers (whose weight is a zero view) take the tensor forward */
    if (!d || !d->weight || d->lora || d->quant) return false;
    if (!anneal_is_contiguous(d->weight) || d->weight->device != ANNEAL_CPU) return false;
    if (d->weight->dtype != ANNEAL_F32 && d->weight->dtype != ANNEAL_BF16) return false;
    if (d->bias && (d->bias->dtype != ANNEAL_F32 || !anneal_is_contiguous(d->bias))) return false;
    *w = (anneal_gemv_weight){.w = anneal_data(d->weight), .dtype = d->weight->dtype,
                              .out_in = d->layout == ANNEAL_WEIGHT_OUT_IN, .in = d->in, .out = d->out,
                              .bias = d->bias ? anneal_data(d->bias) : NULL};
    return true;
}
