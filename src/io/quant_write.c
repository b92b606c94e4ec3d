/* Writes a quantized model directory (docs/FORMATS.md, "Quantized model directories"):
 * config.json (the architecture's config_to_hf plus a "quantization_config" record),
 * model.safetensors (every tensor hf_export puts, f32, except each quantized layer's
 * weight, replaced by "<prefix>.qweight" I8 (out, in), "<prefix>.weight_scale" F32 and,
 * static, "<prefix>.input_scale" F32 (1); an int8 lm head as "lm_head.qweight" and
 * "lm_head.weight_scale", format_version 2), and the tokenizer's files. Written whole into
 * "<dir>.tmp.<pid>", fsync'ed and renamed: a failure leaves nothing that looks complete. */
#include "anneal/fs.h"
#include "anneal/io.h"
#include "anneal/tokenizer.h"
#include "checkpoint_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* What goes into model.safetensors: host copies in the order they came. */
typedef struct qentry {
    char *name;
    anneal_dtype dtype;
    int ndim;
    int64_t shape[ANNEAL_MAX_DIMS];
    void *data;
} qentry;

typedef struct qsink {
    const anneal_params *ps;
    int n, cap;
    qentry *e;
} qsink;

/* True when name is "<prefix>.weight" of a quantized dense layer (not written as f32). */
static bool is_quantized_weight(const anneal_params *ps, const char *name) {
    for (int i = 0; i < ps->n_dense; i++) {
        const anneal_params_dense *pd = &ps->dense[i];
        size_t n = strlen(pd->prefix);
        if (pd->quant && pd->quant->active && strncmp(name, pd->prefix, n) == 0 && strcmp(name + n, ".weight") == 0)
            return true;
    }
    return false;
}

/* Appends a host copy of t (f32, or i8 as it is) under name. */
static anneal_status add_entry(qsink *s, const char *name, const anneal_tensor *t) {
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 64;
        qentry *e = realloc(s->e, (size_t)cap * sizeof *e);
        if (!e) return anneal_set_error(ANNEAL_ERR_OOM, "quantized model: out of memory");
        s->e = e, s->cap = cap;
    }
    qentry *q = &s->e[s->n];
    *q = (qentry){.name = strdup(name), .dtype = t->dtype == ANNEAL_I8 ? ANNEAL_I8 : ANNEAL_F32, .ndim = t->ndim};
    memcpy(q->shape, t->shape, (size_t)t->ndim * sizeof *q->shape);
    int64_t n = anneal_numel(t);
    q->data = malloc((size_t)(n ? n : 1) * (q->dtype == ANNEAL_I8 ? 1 : 4));
    if (!q->name || !q->data) {
        free(q->name), free(q->data);
        return anneal_set_error(ANNEAL_ERR_OOM, "quantized model: out of memory for %s", name);
    }
    s->n++;
    if (q->dtype == ANNEAL_F32) return anneal_to_f32_buffer(t, q->data);
    /* int8: contiguous (made so by the quantizer); copied through the device's backend */
    const anneal_backend *be = anneal_backend_get(t->device);
    if (!be) return anneal_last_status();
    if (be->copy_to_host(be->ctx, q->data, (const char *)anneal_data(t), (size_t)n) != ANNEAL_OK)
        return anneal_last_status();
    return be->synchronize(be->ctx);
}

/* The sink hf_export writes to: every tensor but the quantized layers' float weights. */
static anneal_status sink_put(void *ctx, const char *name, const anneal_tensor *t) {
    qsink *s = ctx;
    return is_quantized_weight(s->ps, name) ? ANNEAL_OK : add_entry(s, name, t);
}

/* Frees the gathered copies. */
static void qsink_free(qsink *s) {
    for (int i = 0; i < s->n; i++) free(s->e[i].name), free(s->e[i].data);
    free(s->e);
}

/* "<prefix><suffix>" into buf (false when it does not fit). */
static bool cat_name(char *buf, size_t n, const char *prefix, const char *suffix) {
    int k = snprintf(buf, n, "%s%s", prefix, suffix);
    return k >= 0 && (size_t)k < n;
}

/* The quantized layers' tensors, and their names into the record's modules array. */
static anneal_status add_quantized(qsink *s, cJSON *modules) {
    const anneal_params *ps = s->ps;
    for (int i = 0; i < ps->n_dense; i++) {
        const anneal_params_dense *pd = &ps->dense[i];
        const anneal_nn_quant *q = pd->quant;
        if (!q || !q->active) continue;
        char name[512];
        anneal_status r = ANNEAL_OK;
        if (!cat_name(name, sizeof name, pd->prefix, ".qweight"))
            return anneal_set_error(ANNEAL_ERR_ARG, "quantized model: name %s too long", pd->prefix);
        if ((r = add_entry(s, name, q->weight)) != ANNEAL_OK) return r;
        cat_name(name, sizeof name, pd->prefix, ".weight_scale");
        if ((r = add_entry(s, name, q->scale)) != ANNEAL_OK) return r;
        if (q->mode == ANNEAL_QUANT_STATIC) {
            anneal_scope *sc = anneal_scope_open();
            anneal_tensor *a = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){1}, &q->act_scale);
            cat_name(name, sizeof name, pd->prefix, ".input_scale");
            r = a ? add_entry(s, name, a) : anneal_last_status();
            anneal_scope_close(sc);
            if (r != ANNEAL_OK) return r;
        }
        cJSON_AddItemToArray(modules, cJSON_CreateString(pd->prefix));
    }
    if (ps->head) { /* the int8 lm head (format_version 2) */
        anneal_status r = add_entry(s, "lm_head.qweight", ps->head->weight);
        return r == ANNEAL_OK ? add_entry(s, "lm_head.weight_scale", ps->head->scale) : r;
    }
    return ANNEAL_OK;
}

/* config.json: config_to_hf with the quantization record added. */
static anneal_status write_config(const char *dir, const anneal_model *m, const anneal_quant_save_opts *o,
                                  cJSON *modules) {
    char *text = anneal_model_config_to_hf_json(&m->cfg);
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        cJSON_Delete(modules);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the architecture's config_to_hf is not a JSON object", dir);
    }
    const anneal_params *ps = m->params;
    cJSON *q = cJSON_AddObjectToObject(j, "quantization_config");
    cJSON_AddStringToObject(q, "quant_method", ANNEAL_QUANT_METHOD);
    cJSON_AddNumberToObject(q, "format_version", ps->head ? 2 : 1);
    cJSON_AddStringToObject(q, "mode", anneal_quant_mode_name(ps->quant));
    cJSON_AddNumberToObject(q, "bits", 8);
    cJSON_AddBoolToObject(q, "symmetric", true);
    cJSON_AddNumberToObject(q, "group_size", (double)ps->quant_group);
    cJSON_AddStringToObject(q, "activations", ps->quant == ANNEAL_QUANT_DYNAMIC  ? "per-token"
                                              : ps->quant == ANNEAL_QUANT_STATIC ? "per-tensor-static"
                                                                                 : "float");
    if (ps->quant == ANNEAL_QUANT_STATIC && o && o->calib_method) {
        cJSON *c = cJSON_AddObjectToObject(q, "calibration");
        cJSON_AddStringToObject(c, "method", o->calib_method);
        if (strcmp(o->calib_method, "percentile") == 0) cJSON_AddNumberToObject(c, "percentile", o->percentile);
        cJSON_AddNumberToObject(c, "batches", o->calib_batches);
    }
    cJSON_AddItemToObject(q, "modules", modules);
    if (ps->head) cJSON_AddStringToObject(q, "lm_head", anneal_quant_mode_name(ps->head->mode));
    char *out = cJSON_Print(j);
    cJSON_Delete(j);
    if (!out) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
    char path[PATH_MAX + 128];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t n = strlen(out);
    out[n] = '\n';
    anneal_status r = anneal_write_file_atomic(path, out, n + 1);
    free(out);
    return r;
}

/* model.safetensors of dir from the gathered tensors (atomic). */
static anneal_status write_weights(const char *dir, const qsink *s) {
    anneal_st_write_entry *w = calloc((size_t)(s->n ? s->n : 1), sizeof *w);
    if (!w) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
    for (int i = 0; i < s->n; i++)
        w[i] = (anneal_st_write_entry){.name = s->e[i].name, .dtype = s->e[i].dtype, .ndim = s->e[i].ndim,
                                       .shape = s->e[i].shape, .data = s->e[i].data};
    char path[PATH_MAX + 128];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    const char *k[] = {"format"}, *v[] = {ANNEAL_QUANT_METHOD};
    anneal_status r = anneal_safetensors_write(path, s->n, w, 1, k, v);
    free(w);
    return r;
}

/* dir must not exist, or be an empty directory (it is replaced). */
static anneal_status check_target(const char *dir) {
    struct stat sb;
    if (stat(dir, &sb) != 0) return ANNEAL_OK;
    if (!S_ISDIR(sb.st_mode)) return anneal_set_error(ANNEAL_ERR_ARG, "%s: exists and is not a directory", dir);
    if (rmdir(dir) != 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: exists and is not empty (choose a new --out)", dir);
    return ANNEAL_OK;
}

anneal_status anneal_quant_save(const anneal_model *m, const char *dir, const anneal_quant_save_opts *o) {
    if (!m || !dir || !*dir) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_quant_save: NULL argument");
    if (m->params->quant == ANNEAL_QUANT_NONE)
        return anneal_set_error(ANNEAL_ERR_STATE, "%s: the model is not quantized (anneal_nn_quantize first)", dir);
    char clean[PATH_MAX], tmp[PATH_MAX + 32];
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/') len--;
    if (len >= sizeof clean) return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    memcpy(clean, dir, len);
    clean[len] = '\0';
    anneal_status r = check_target(clean);
    if (r != ANNEAL_OK) return r;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", clean, (long)getpid());
    anneal_ckpt_remove_tree(tmp);
    if (mkdir(tmp, 0755) != 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    qsink s = {.ps = m->params};
    anneal_tensor_sink sink = {.ctx = &s, .put = sink_put};
    cJSON *modules = cJSON_CreateArray();
    anneal_scope *sc = anneal_scope_open();
    r = modules ? anneal_model_hf_export(m, &sink) : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
    anneal_scope_close(sc);
    if (r == ANNEAL_OK) r = add_quantized(&s, modules);
    if (r == ANNEAL_OK) r = write_weights(tmp, &s);
    qsink_free(&s);
    if (r == ANNEAL_OK) r = write_config(tmp, m, o, modules);
    else cJSON_Delete(modules);
    if (r == ANNEAL_OK && o && o->tokenizer) r = anneal_tokenizer_save_hf(o->tokenizer, tmp);
    char probe[PATH_MAX + 64];
    snprintf(probe, sizeof probe, "%s/config.json", tmp);
    if (r == ANNEAL_OK) r = anneal_fsync_parent_dir(probe); /* tmp itself: its entries */
    if (r == ANNEAL_OK && rename(tmp, clean) != 0)
        r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot rename %s into place: %s", clean, tmp, strerror(errno));
    if (r == ANNEAL_OK) r = anneal_fsync_parent_dir(clean);
    else anneal_ckpt_remove_tree(tmp);
    return r;
}
