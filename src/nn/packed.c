/* Dense weights packed as bf16 panels for an inference-only model (anneal_params_pack_bf16,
 * nn.h): the layout the decode engine reads (decode_kernels.h), made once from the f32
 * weight, which is then released; the layer's forward outside the engine is
 * anneal_panels_linear, then its activation as an op of its own. */
#include "anneal/decode_kernels.h"
#include "nn_internal.h"

#include <stdlib.h>

/* d's f32 weight packed into a new bf16 tensor the caller owns (NULL + error). */
static anneal_tensor *pack_one(const anneal_nn_dense *d) {
    const int64_t len = anneal_gemv_panels_bf16_len(d->in, d->out);
    anneal_scope_enter(NULL);
    const anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_PARAMETERS); /* the memory report's */
    anneal_tensor *p = anneal_empty_on(ANNEAL_CPU, ANNEAL_BF16, 1, &len);
    anneal_memory_category_set(mc);
    anneal_scope_leave();
    if (!p) return NULL;
    anneal_gemv_pack_panels_bf16(anneal_data(d->weight), d->layout == ANNEAL_WEIGHT_OUT_IN, d->in, d->out,
                                 anneal_data(p));
    return p;
}

anneal_status anneal_params_pack_bf16(anneal_params *ps) {
    if (!ps) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_params_pack_bf16: NULL parameter set");
    if (ps->packed_bf16) return ANNEAL_OK;
    if (ps->device != ANNEAL_CPU)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "pack bf16: the parameters are on %s (the CPU only)",
                                anneal_device_name(ps->device));
    for (int i = 0; i < ps->n_dense; i++) {
        anneal_params_dense *pd = &ps->dense[i];
        anneal_nn_dense *d = pd->dense;
        /* the lm head stays f32, as under int8: the fused lm-head loss reads it whole */
        if (!d || d->panels || pd->lora || d->lora || pd->quant || d->quant || anneal_nn_quant_skips(pd->prefix))
            continue;
        const anneal_tensor *w = d->weight;
        if (!w || w->dtype != ANNEAL_F32 || w->device != ANNEAL_CPU || !anneal_is_contiguous(w) || !anneal_data(w))
            continue;
        anneal_tensor *p = pack_one(d);
        if (!p) return anneal_last_status();
        anneal_status s = anneal_nn_release_weight(ps, pd);
        if (s != ANNEAL_OK) {
            anneal_release(p);
            return s;
        }
        d->panels = anneal_keep(p, ps->scope); /* the set's now */
        ps->packed_bf16 = true;
        anneal_memory_release_cache(ANNEAL_CPU); /* this layer's f32 weight back to the system now */
    }
    return ANNEAL_OK;
}

anneal_tensor *anneal_nn_packed_forward(const anneal_nn_dense *d, anneal_tensor *x, anneal_activation act,
                                        anneal_tensor *mul) {
    if (act != ANNEAL_ACT_SILU_MUL && mul) {
        anneal_set_error(ANNEAL_ERR_ARG, "nn dense: mul is only for ANNEAL_ACT_SILU_MUL");
        return NULL;
    }
    anneal_tensor *pre = anneal_panels_linear(x, d->panels, d->bias, d->in, d->out);
    return anneal_nn_act_unfused(pre, act, mul);
}
