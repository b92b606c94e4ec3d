/* What every architecture's Hugging Face import and export do the same way: name lists
 * for errors, "are these two tensors equal" (tied heads), shapes and dtypes of the
 * matched tensors, the missing ones, the copy into the parameters, and the export of
 * parameters already named as transformers names them. Each architecture keeps its own name mapping
 * (gpt2_hf.c, llama_hf.c). */
#include "models_internal.h"

#include <stdio.h>
#include <string.h>

void anneal_hf_name_list_add(char *buf, size_t n, int *count, const char *name) {
    if (*count < 5) {
        size_t used = strlen(buf);
        snprintf(buf + used, n - used, "%s%s", *count ? ", " : "", name);
    }
    (*count)++;
}

void anneal_hf_name_list_finish(char *buf, size_t n, int count) {
    if (count > 5) {
        size_t used = strlen(buf);
        snprintf(buf + used, n - used, " (and %d more)", count - 5);
    }
}

anneal_status anneal_hf_same_as_f32(const anneal_tensor_source *src, const char *a, const char *b, bool *same) {
    *same = false;
    anneal_dtype da, db;
    int na, nb;
    int64_t sa[ANNEAL_MAX_DIMS], sb[ANNEAL_MAX_DIMS];
    if (!src->info(src->ctx, a, &da, &na, sa) || !src->info(src->ctx, b, &db, &nb, sb) || na != nb ||
        memcmp(sa, sb, (size_t)na * sizeof *sa) != 0 || !anneal_dtype_is_float(da) || !anneal_dtype_is_float(db))
        return ANNEAL_OK;
    anneal_tensor *x = src->get(src->ctx, a);
    if (!x) return anneal_last_status();
    anneal_tensor *y = src->get(src->ctx, b);
    if (!y) return anneal_last_status();
    *same = memcmp(anneal_data(x), anneal_data(y), (size_t)anneal_numel(x) * sizeof(float)) == 0;
    return ANNEAL_OK;
}

anneal_status anneal_hf_check_entries(const anneal_model *m, const anneal_tensor_source *src, const char **seen) {
    const anneal_params *ps = m->params;
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *t = ps->items[i].tensor;
        anneal_dtype dt;
        int nd;
        int64_t sh[ANNEAL_MAX_DIMS];
        if (!src->info(src->ctx, seen[i], &dt, &nd, sh))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no tensor for parameter %s", src->what, ps->items[i].name);
        bool same = nd == t->ndim;
        for (int d = 0; same && d < nd; d++) same = sh[d] == t->shape[d];
        if (!same) {
            char a[128], b[128];
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s has shape %s, the model expects %s", src->what, seen[i],
                                    anneal_dims_str(nd, sh, a, sizeof a), anneal_shape_str(t, b, sizeof b));
        }
        if (!anneal_dtype_is_float(dt))
            return anneal_set_error(ANNEAL_ERR_DTYPE, "%s: %s is %s, expected a float dtype", src->what, seen[i],
                                    anneal_dtype_name(dt));
    }
    return ANNEAL_OK;
}

anneal_status anneal_hf_check_missing(const anneal_model *m, const anneal_tensor_source *src, const char **seen) {
    const anneal_params *ps = m->params;
    char missing[1024] = "";
    int n_missing = 0;
    for (int i = 0; i < ps->n; i++)
        if (!seen[i]) anneal_hf_name_list_add(missing, sizeof missing, &n_missing, ps->items[i].name);
    if (n_missing) {
        anneal_hf_name_list_finish(missing, sizeof missing, n_missing);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: missing %d tensor(s): %s", src->what, n_missing, missing);
    }
    return ANNEAL_OK;
}

anneal_status anneal_hf_load_matched(anneal_model *m, const anneal_tensor_source *src, const char **seen) {
    anneal_status r = anneal_hf_check_entries(m, src, seen); /* every tensor, before any parameter is written */
    const anneal_params *ps = m->params;
    for (int i = 0; r == ANNEAL_OK && i < ps->n; i++) {
        if ((r = anneal_interrupt_check("loading the weights")) != ANNEAL_OK) break;
        anneal_tensor *p = ps->items[i].tensor;
        if (!p->storage) continue; /* a --pp stage's model: only the tensors it holds are read */
        anneal_scope *sc = anneal_scope_open();
        /* the read's f32 conversion is a temporary, not a parameter (the trainer's memory record) */
        anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_ACTIVATIONS);
        anneal_tensor *t = anneal_to_device(src->get(src->ctx, seen[i]), p->device);
        anneal_memory_category_set(mc);
        r = t == p ? ANNEAL_OK /* the source handed the parameter back: nothing to copy (quant_read.c) */
          : t ? anneal_copy_(p, t)
          : anneal_last_status() != ANNEAL_OK ? anneal_last_status()
                                              : anneal_set_error(ANNEAL_ERR_FORMAT, "%s: cannot read %s", src->what, seen[i]);
        anneal_scope_close(sc);
        /* the temporary back to the system now, not into the allocator's cache: kept,
         * one block per tensor size stayed resident beside the model (GPT-2 124M's
         * embedding alone is 154 MB), and the load's peak held them all */
        anneal_memory_release_cache(p->device);
    }
    return r;
}

anneal_status anneal_hf_export_params(const anneal_model *m, const anneal_tensor_sink *sink) {
    const anneal_params *ps = m->params;
    anneal_status r = ANNEAL_OK;
    for (int i = 0; i < ps->n && r == ANNEAL_OK; i++) r = sink->put(sink->ctx, ps->items[i].name, ps->items[i].tensor);
    return r;
}
