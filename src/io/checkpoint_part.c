/* Reading part of a checkpoint: a pipeline stage (--pp) holds only its own parameters
 * (the others have no storage), so a resume reads only their tensors from
 * model.safetensors and only their optimizer state from optimizer.safetensors. The
 * files are the ones a single process writes and reads (docs/FORMATS.md); the
 * safetensors reader maps the file and validates every entry's offsets when it opens
 * it, and anneal_checkpoint_load has checked state.json, the checksums and that the
 * model file holds exactly the model's tensors before anything here runs, so a read
 * by name only touches the pages of the tensors it reads. */
#include "io/checkpoint_internal.h"

#include <stdio.h>
#include <string.h>

bool anneal_ckpt_held_only(const anneal_model *m) {
    for (int i = 0; m && i < m->params->n; i++)
        if (!m->params->items[i].tensor->storage) return true;
    return false;
}

/* True when the entry has t's shape. */
static bool same_shape(const anneal_st_entry *e, const anneal_tensor *t) {
    if (e->ndim != t->ndim) return false;
    for (int d = 0; d < e->ndim; d++)
        if (e->shape[d] != t->shape[d]) return false;
    return true;
}

anneal_status anneal_ckpt_import_held(anneal_model *m, const anneal_safetensors *st) {
    const anneal_params *ps = m->params;
    /* every held parameter's entry first (name, shape, a float), then the copies */
    for (int i = 0; i < ps->n; i++) {
        const anneal_param *p = &ps->items[i];
        if (!p->tensor->storage) continue;
        const anneal_st_entry *e = anneal_safetensors_find(st, p->name);
        if (!e)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: no tensor named as parameter %s: this architecture's "
                                    "checkpoint cannot be read one stage at a time", st->path, p->name);
        if (!same_shape(e, p->tensor) || !anneal_dtype_is_float(e->dtype)) {
            char a[128];
            return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: %s is %s of %d dims, the parameter %s", st->path, p->name,
                                    anneal_dtype_name(e->dtype), e->ndim, anneal_shape_str(p->tensor, a, sizeof a));
        }
    }
    anneal_status r = ANNEAL_OK;
    for (int i = 0; r == ANNEAL_OK && i < ps->n; i++) {
        anneal_tensor *dst = ps->items[i].tensor;
        if (!dst->storage) continue;
        if ((r = anneal_interrupt_check("loading the weights")) != ANNEAL_OK) break;
        const anneal_st_entry *e = anneal_safetensors_find(st, ps->items[i].name);
        if (e->dtype == ANNEAL_F32 && dst->dtype == ANNEAL_F32 && dst->device == ANNEAL_CPU && anneal_is_contiguous(dst)) {
            /* straight from the mapping (the entry's size was checked at open): no buffer */
            memcpy(anneal_data(dst), anneal_safetensors_data(st, e), (size_t)(e->end - e->begin));
            continue;
        }
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *src = anneal_safetensors_load(st, ps->items[i].name, ANNEAL_F32);
        r = src ? anneal_copy_(dst, src) : anneal_last_status();
        anneal_scope_close(sc);
    }
    return r;
}
