/* The int8 lm head of a quantized model (model.h's anneal_model_quantize_head): which
 * f32 tensor is the head (an untied "lm_head.weight", else the tied token embedding),
 * quantized per row by the nn layer (anneal_nn_quantize_head). The models' lm_head and
 * loss read params->head when it is set; the decode engine's plan does too
 * (decode_plan.c's anneal_decode_head). */
#include "models_internal.h"

anneal_status anneal_model_quantize_head(anneal_model *m) {
    if (!m) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_model_quantize_head: NULL model");
    static const char *const names[] = {"lm_head.weight", "transformer.wte.weight", "model.embed_tokens.weight"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        anneal_param *p = anneal_params_find(m->params, names[i]);
        if (p) return anneal_nn_quantize_head(m->params, p->tensor);
    }
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "quantize lm head: model %s has no lm_head.weight or tied embedding",
                            m->cfg.arch);
}
