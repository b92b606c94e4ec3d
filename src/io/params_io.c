/* Parameter sets to and from safetensors files (Hugging Face names). */
#include "anneal/io.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The entry for a parameter: "<prefix><name>" or the same without "transformer.". */
static const anneal_st_entry *find_entry(const anneal_safetensors *st, const char *prefix,
                                         const char *name) {
    char key[512];
    snprintf(key, sizeof key, "%s%s", prefix, name);
    const anneal_st_entry *e = anneal_safetensors_find(st, key);
    const char *tp = "transformer.";
    if (!e && strncmp(name, tp, strlen(tp)) == 0) {
        snprintf(key, sizeof key, "%s%s", prefix, name + strlen(tp));
        e = anneal_safetensors_find(st, key);
    }
    return e;
}

anneal_status anneal_params_load(anneal_params *ps, const anneal_safetensors *st, const char *prefix) {
    if (!ps || !st) return anneal_set_error(ANNEAL_ERR_ARG, "params_load: NULL argument");
    if (!prefix) prefix = "";
    /* Check everything first so a bad file leaves the parameters untouched. */
    for (int i = 0; i < ps->n; i++) {
        const anneal_param *p = &ps->items[i];
        const anneal_st_entry *e = find_entry(st, prefix, p->name);
        if (!e)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no tensor for parameter %s%s", st->path,
                                    prefix, p->name);
        bool same = e->ndim == p->tensor->ndim;
        for (int d = 0; same && d < e->ndim; d++) same = e->shape[d] == p->tensor->shape[d];
        if (!same) {
            char a[128], b[128];
            size_t used = (size_t)snprintf(a, sizeof a, "(");
            for (int d = 0; d < e->ndim && used < sizeof a; d++)
                used += (size_t)snprintf(a + used, sizeof a - used, d ? ", %lld" : "%lld", (long long)e->shape[d]);
            if (used < sizeof a) snprintf(a + used, sizeof a - used, ")");
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s has shape %s, the model expects %s",
                                    st->path, e->name, a, anneal_shape_str(p->tensor, b, sizeof b));
        }
        if (!anneal_dtype_is_float(e->dtype))
            return anneal_set_error(ANNEAL_ERR_DTYPE, "%s: %s is %s, expected a float dtype", st->path,
                                    e->name, anneal_dtype_name(e->dtype));
    }
    for (int i = 0; i < ps->n; i++) {
        if (anneal_interrupt_check("loading the weights") != ANNEAL_OK) return ANNEAL_ERR_INTERRUPTED;
        const anneal_param *p = &ps->items[i];
        const anneal_st_entry *e = find_entry(st, prefix, p->name);
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *t = anneal_safetensors_load(st, e->name, ANNEAL_F32);
        anneal_status r = t ? anneal_copy_(p->tensor, t) : anneal_last_status();
        anneal_scope_close(s);
        if (r != ANNEAL_OK) return r;
    }
    return ANNEAL_OK;
}

anneal_status anneal_params_save(const anneal_params *ps, const char *path, int n_meta,
                                 const char *const *meta_keys, const char *const *meta_values) {
    if (!ps || !path) return anneal_set_error(ANNEAL_ERR_ARG, "params_save: NULL argument");
    anneal_st_write_entry *ents = calloc((size_t)(ps->n ? ps->n : 1), sizeof *ents);
    if (!ents) return anneal_set_error(ANNEAL_ERR_OOM, "params_save: out of memory");
    anneal_scope *s = anneal_scope_open();
    anneal_status r = ANNEAL_OK;
    for (int i = 0; i < ps->n && r == ANNEAL_OK; i++) {
        anneal_tensor *t = ps->items[i].tensor;
        if (!anneal_is_contiguous(t) || t->device != ANNEAL_CPU) {
            anneal_tensor *c = anneal_empty(t->dtype, t->ndim, t->shape);
            r = c ? anneal_copy_(c, t) : anneal_last_status();
            t = c;
        }
        if (r != ANNEAL_OK) break;
        ents[i] = (anneal_st_write_entry){ps->items[i].name, t->dtype, t->ndim, t->shape, anneal_data(t)};
    }
    if (r == ANNEAL_OK) r = anneal_safetensors_write(path, ps->n, ents, n_meta, meta_keys, meta_values);
    anneal_scope_close(s);
    free(ents);
    return r;
}
