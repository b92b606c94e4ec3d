/* Pipeline stages of a model (the trainer's --pp, src/train/pipeline.c): the checked
 * entry points of the architectures' stage_forward and param_span slots. */
#include "anneal/model.h"

#include <string.h>

anneal_tensor *anneal_model_stage_forward(anneal_model *m, int first, int last, anneal_tensor *in,
                                          anneal_tensor *targets) {
    if (!m || !in) return NULL;
    if (!m->ops->stage_forward || !m->ops->param_span) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: this architecture cannot be split into pipeline stages",
                         m->cfg.arch);
        return NULL;
    }
    if (first < 0 || last <= first || last > m->cfg.n_layer) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: pipeline stage of blocks [%d, %d) outside the model's %d blocks",
                         m->cfg.arch, first, last, m->cfg.n_layer);
        return NULL;
    }
    return m->ops->stage_forward(m, first, last, in, targets);
}

bool anneal_model_has_stages(const anneal_model *m) {
    return m && m->ops->stage_forward && m->ops->param_span;
}

void anneal_model_param_span(const anneal_model *m, int i, int *first, int *last) {
    *first = -1;
    *last = m ? m->cfg.n_layer : 0;
    if (anneal_model_has_stages(m) && i >= 0 && i < m->params->n) m->ops->param_span(m, i, first, last);
}
