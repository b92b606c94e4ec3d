/* What the architectures' decode plans share (decode_engine.h): a dense layer's weight as
 * the GEMV kernels read it. Its own file so that gpt2.c and llama.c, which the engine
 * calls for their plans, do not call back into the engine. */
#include "decode_engine.h"

bool anneal_decode_dense(const anneal_nn_dense *d, anneal_gemv_weight *w) {
    /* LoRA layers take the tensor forward */
    if (!d || !d->weight || d->lora) return false;
    if (d->bias && (d->bias->dtype != ANNEAL_F32 || !anneal_is_contiguous(d->bias))) return false;
    const float *bias = d->bias ? anneal_data(d->bias) : NULL;
    if (d->panels) { /* packed for inference (anneal_params_pack_bf16): what the engine's bf16 copies are */
        *w = (anneal_gemv_weight){.w = anneal_data(d->panels), .dtype = ANNEAL_BF16, .in = d->in, .out = d->out,
                                  .bias = bias, .bf16_panels = true};
        return true;
    }
    if (d->quant) { /* int8: the quantized product, as the tensor path runs it */
        const anneal_nn_quant *q = d->quant;
        if (!q->active || !q->weight || !q->scale || q->weight->dtype != ANNEAL_I8 || q->scale->dtype != ANNEAL_F32 ||
            !anneal_is_contiguous(q->weight) || !anneal_is_contiguous(q->scale) || q->weight->device != ANNEAL_CPU ||
            q->weight->ndim != 2 || q->weight->shape[0] != d->out || q->weight->shape[1] != d->in)
            return false;
        *w = (anneal_gemv_weight){.w = anneal_data(q->weight), .dtype = ANNEAL_I8, .out_in = true, .in = d->in,
                                  .out = d->out, .bias = bias, .qmode = q->mode, .qcompute = ANNEAL_F32,
                                  .qgroup = q->group, .qscale = anneal_data(q->scale), .qact_scale = q->act_scale};
        return true;
    }
    if (!anneal_is_contiguous(d->weight) || d->weight->device != ANNEAL_CPU) return false;
    if (d->weight->dtype != ANNEAL_F32 && d->weight->dtype != ANNEAL_BF16) return false;
    *w = (anneal_gemv_weight){.w = anneal_data(d->weight), .dtype = d->weight->dtype,
                              .out_in = d->layout == ANNEAL_WEIGHT_OUT_IN, .in = d->in, .out = d->out, .bias = bias};
    return true;
}

bool anneal_decode_head(const anneal_params *ps, anneal_gemv_weight *w) {
    const anneal_nn_quant *q = ps ? ps->head : NULL;
    if (!q) return true;
    if (!q->active || q->weight->dtype != ANNEAL_I8 || q->scale->dtype != ANNEAL_F32 || q->weight->ndim != 2 ||
        !anneal_is_contiguous(q->weight) || !anneal_is_contiguous(q->scale) || q->weight->device != ANNEAL_CPU ||
        q->weight->shape[0] != w->out || q->weight->shape[1] != w->in)
        return false;
    *w = (anneal_gemv_weight){.w = anneal_data(q->weight), .dtype = ANNEAL_I8, .out_in = true, .in = w->in,
                              .out = w->out, .qmode = q->mode, .qcompute = ANNEAL_F32, .qscale = anneal_data(q->scale)};
    return true;
}
