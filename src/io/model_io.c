/* Models from and to safetensors files through the model interface: a tensor source
 * over an open file (for hf_import) and a sink that gathers what hf_export puts (for
 * a file of Hugging Face names). The architecture decides the names; io only reads and
 * writes bytes. */
#include "anneal/io.h"

#include <stdlib.h>
#include <string.h>

static bool st_info(void *ctx, const char *name, anneal_dtype *dtype, int *ndim, int64_t *shape) {
    const anneal_st_entry *e = anneal_safetensors_find(ctx, name);
    if (!e) return false;
    *dtype = e->dtype;
    *ndim = e->ndim;
    memcpy(shape, e->shape, (size_t)e->ndim * sizeof *shape);
    return true;
}

static anneal_tensor *st_get(void *ctx, const char *name) {
    return anneal_safetensors_find(ctx, name) ? anneal_safetensors_load(ctx, name, ANNEAL_F32) : NULL;
}

anneal_status anneal_st_source_init(anneal_st_source *s, const anneal_safetensors *st) {
    if (!s || !st) return anneal_set_error(ANNEAL_ERR_ARG, "safetensors source: NULL argument");
    memset(s, 0, sizeof *s);
    s->names = calloc((size_t)st->n_entries + 1, sizeof *s->names);
    if (!s->names) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", st->path);
    for (int i = 0; i < st->n_entries; i++) s->names[i] = st->entries[i].name;
    s->st = st;
    s->src = (anneal_tensor_source){.ctx = (void *)st, .what = st->path, .info = st_info, .get = st_get,
                                    .n = st->n_entries, .names = s->names};
    return ANNEAL_OK;
}

void anneal_st_source_free(anneal_st_source *s) {
    if (!s) return;
    free(s->names);
    memset(s, 0, sizeof *s);
}

anneal_status anneal_model_load_safetensors(anneal_model *m, const char *path) {
    if (!m || !path) return anneal_set_error(ANNEAL_ERR_ARG, "model weights: NULL argument");
    anneal_safetensors *st = NULL;
    anneal_status r = anneal_safetensors_open(path, &st);
    anneal_st_source src;
    if (r == ANNEAL_OK && (r = anneal_st_source_init(&src, st)) == ANNEAL_OK) {
        r = anneal_model_hf_import(m, &src.src);
        anneal_st_source_free(&src);
    }
    anneal_safetensors_close(st);
    return r;
}

/* What hf_export puts: host f32 copies in the order they came. */
typedef struct gathered {
    char *name;
    int ndim;
    int64_t shape[ANNEAL_MAX_DIMS];
    float *data;
} gathered;

typedef struct gather {
    int n, cap;
    gathered *items;
} gather;

static anneal_status gather_put(void *ctx, const char *name, const anneal_tensor *t) {
    gather *g = ctx;
    if (g->n == g->cap) {
        int cap = g->cap ? 2 * g->cap : 64;
        gathered *items = realloc(g->items, (size_t)cap * sizeof *items);
        if (!items) return anneal_set_error(ANNEAL_ERR_OOM, "model export: out of memory");
        g->items = items;
        g->cap = cap;
    }
    int64_t n = anneal_numel(t);
    gathered *it = &g->items[g->n];
    *it = (gathered){.name = strdup(name), .ndim = t->ndim, .data = malloc((size_t)(n ? n : 1) * sizeof(float))};
    memcpy(it->shape, t->shape, sizeof it->shape);
    anneal_status r = it->name && it->data ? anneal_to_f32_buffer(t, it->data)
                                           : anneal_set_error(ANNEAL_ERR_OOM, "model export: out of memory for %s", name);
    if (r != ANNEAL_OK) {
        free(it->name);
        free(it->data);
        return r;
    }
    g->n++;
    return ANNEAL_OK;
}

anneal_status anneal_model_save_safetensors(const anneal_model *m, const char *path) {
    if (!m || !path) return anneal_set_error(ANNEAL_ERR_ARG, "model save: NULL argument");
    gather g = {0};
    anneal_tensor_sink sink = {.ctx = &g, .put = gather_put};
    anneal_status r = anneal_model_hf_export(m, &sink);
    anneal_st_write_entry *e = r == ANNEAL_OK ? calloc((size_t)g.n + 1, sizeof *e) : NULL;
    if (r == ANNEAL_OK && !e) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; r == ANNEAL_OK && i < g.n; i++)
        e[i] = (anneal_st_write_entry){g.items[i].name, ANNEAL_F32, g.items[i].ndim, g.items[i].shape, g.items[i].data};
    const char *k[] = {"format"}, *v[] = {"pt"};
    if (r == ANNEAL_OK) r = anneal_safetensors_write(path, g.n, e, 1, k, v);
    for (int i = 0; i < g.n; i++) free(g.items[i].name), free(g.items[i].data);
    free(g.items);
    free(e);
    return r;
}
