/* Reads a quantized model directory (docs/FORMATS.md, "Quantized model directories"),
 * validating the record and every tensor before the model is built: each
 * listed dense layer first gets its int8 weight and scales (anneal_nn_quant_attach,
 * which makes its f32 weight stride-0 zeros), then the unquantized tensors go through
 * the architecture's hf_import (the listed weights handed back as they are), and, in a
 * format_version 2 directory, the lm head its int8 weight (anneal_nn_quant_head_attach). */
#include "anneal/io.h"
#include "checkpoint_internal.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The directory of path (itself when a directory) into dir, and the weights file. */
static anneal_status locate(const char *path, char *dir, size_t dn, char *weights, size_t wn) {
    struct stat sb;
    if (stat(path, &sb) != 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: no such file or directory", path);
    if (S_ISDIR(sb.st_mode)) {
        if ((size_t)snprintf(dir, dn, "%s", path) >= dn || (size_t)snprintf(weights, wn, "%s/model.safetensors", path) >= wn)
            return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", path);
        return ANNEAL_OK;
    }
    if ((size_t)snprintf(weights, wn, "%s", path) >= wn || (size_t)snprintf(dir, dn, "%s", path) >= dn)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else snprintf(dir, dn, ".");
    return ANNEAL_OK;
}

/* config.json of dir parsed (NULL + error). */
static cJSON *read_config(const char *dir, char *cfgp, size_t n) {
    snprintf(cfgp, n, "%s/config.json", dir);
    char *text = NULL;
    if (anneal_ckpt_read_file(cfgp, 1 << 20, &text, NULL) != ANNEAL_OK) return NULL;
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object", cfgp);
        return NULL;
    }
    return j;
}

bool anneal_quant_dir_is_quantized(const char *path) {
    char dir[PATH_MAX], w[PATH_MAX + 32], cfgp[PATH_MAX + 32];
    struct stat sb;
    if (!path || locate(path, dir, sizeof dir, w, sizeof w) != ANNEAL_OK) return false;
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    if (stat(cfgp, &sb) != 0) return false;
    cJSON *j = read_config(dir, cfgp, sizeof cfgp);
    if (!j) {
        anneal_clear_error();
        return false;
    }
    bool q = cJSON_GetObjectItemCaseSensitive(j, "quantization_config") != NULL;
    cJSON_Delete(j);
    return q;
}

/* The record, checked. */
typedef struct record {
    anneal_quant_mode mode;
    int64_t group;
    const cJSON *modules;
    bool head;                  /* format_version 2: an int8 lm head */
    anneal_quant_mode head_mode;
} record;

/* Checks quantization_config of config j (cfgp names it in errors) into *r. */
static anneal_status parse_record(const char *cfgp, const cJSON *j, record *r) {
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(j, "quantization_config");
    if (!cJSON_IsObject(q)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config is not an object", cfgp);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (!cJSON_IsString(m) || strcmp(m->valuestring, ANNEAL_QUANT_METHOD) != 0)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: quantization_config.quant_method %s%s%s is not anneal's \"%s\"",
                                cfgp, cJSON_IsString(m) ? "\"" : "", cJSON_IsString(m) ? m->valuestring : "(missing)",
                                cJSON_IsString(m) ? "\"" : "", ANNEAL_QUANT_METHOD);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(q, "format_version");
    if (!cJSON_IsNumber(v) || (v->valuedouble != 1 && v->valuedouble != 2))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: quantization_config.format_version must be 1 or 2", cfgp);
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(q, "bits");
    if (!cJSON_IsNumber(b) || b->valuedouble != 8)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: quantization_config.bits must be 8", cfgp);
    const cJSON *md = cJSON_GetObjectItemCaseSensitive(q, "mode");
    if (!cJSON_IsString(md) || !anneal_quant_mode_parse(md->valuestring, &r->mode))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.mode %s is not weight-only, dynamic or static",
                                cfgp, cJSON_IsString(md) ? md->valuestring : "(missing or not a string)");
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(q, "group_size");
    if (!cJSON_IsNumber(g) || g->valuedouble < 0 || g->valuedouble > (1 << 30) || g->valuedouble != floor(g->valuedouble))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.group_size must be an integer >= 0", cfgp);
    r->group = (int64_t)g->valuedouble;
    if (r->group && r->mode != ANNEAL_QUANT_WEIGHT_ONLY)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.group_size %lld with mode %s (groups are for weight-only)",
                                cfgp, (long long)r->group, md->valuestring);
    /* version 2: "lm_head" names the int8 head's products (weight-only with a weight-only
     * record, else dynamic); version 1 has a float head and no such key */
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(q, "lm_head");
    r->head = v->valuedouble == 2;
    if (!r->head && h) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.lm_head needs format_version 2", cfgp);
    if (r->head) {
        const anneal_quant_mode want = r->mode == ANNEAL_QUANT_WEIGHT_ONLY ? ANNEAL_QUANT_WEIGHT_ONLY : ANNEAL_QUANT_DYNAMIC;
        if (!cJSON_IsString(h) || !anneal_quant_mode_parse(h->valuestring, &r->head_mode) || r->head_mode != want)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.lm_head must be \"%s\" with mode %s (format_version 2)",
                                    cfgp, anneal_quant_mode_name(want), md->valuestring);
    }
    r->modules = cJSON_GetObjectItemCaseSensitive(q, "modules");
    if (!cJSON_IsArray(r->modules) || cJSON_GetArraySize(r->modules) == 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.modules must be a non-empty array", cfgp);
    const cJSON *e;
    cJSON_ArrayForEach(e, r->modules) {
        if (!cJSON_IsString(e)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.modules holds a non-string", cfgp);
    }
    return ANNEAL_OK;
}

/* ---------------------------------------------------------- the source */

typedef struct qsource {
    anneal_tensor_source src;
    const anneal_safetensors *st;
    const anneal_params *ps;
    const bool *listed; /* per dense layer of ps */
    bool head;          /* lm_head.qweight / weight_scale are the int8 head's */
    const char **names;
    char **owned;       /* the "<prefix>.weight" names made here */
    int n_owned;
} qsource;

/* The listed dense layer whose "<prefix><suffix>" is name, or -1. */
static int listed_layer(const qsource *s, const char *name, const char *suffix) {
    for (int i = 0; i < s->ps->n_dense; i++) {
        size_t n = strlen(s->ps->dense[i].prefix);
        if (s->listed[i] && strncmp(name, s->ps->dense[i].prefix, n) == 0 && strcmp(name + n, suffix) == 0) return i;
    }
    return -1;
}

/* The source's info: a listed layer's weight as f32 of the model's shape, else the file's entry. */
static bool src_info(void *ctx, const char *name, anneal_dtype *dtype, int *ndim, int64_t *shape) {
    const qsource *s = ctx;
    int i = listed_layer(s, name, ".weight");
    if (i >= 0) {
        const anneal_tensor *w = s->ps->dense[i].dense->weight;
        *dtype = ANNEAL_F32;
        *ndim = 2;
        shape[0] = w->shape[0], shape[1] = w->shape[1];
        return true;
    }
    const anneal_st_entry *e = anneal_safetensors_find(s->st, name);
    if (!e) return false;
    *dtype = e->dtype;
    *ndim = e->ndim;
    memcpy(shape, e->shape, (size_t)e->ndim * sizeof *shape);
    return true;
}

/* The source's get: for a listed layer's weight the parameter itself (attach_all made it
 * stride-0 zeros; the import copies nothing onto a tensor handed back to it), else the
 * entry in f32. */
static anneal_tensor *src_get(void *ctx, const char *name) {
    const qsource *s = ctx;
    int i = listed_layer(s, name, ".weight");
    if (i >= 0) return s->ps->dense[i].dense->weight;
    return anneal_safetensors_find(s->st, name) ? anneal_safetensors_load(s->st, name, ANNEAL_F32) : NULL;
}

/* Frees what qsource_init allocated. */
static void qsource_free(qsource *s) {
    for (int i = 0; i < s->n_owned; i++) free(s->owned[i]);
    free(s->owned);
    free(s->names);
}

/* True for a listed layer's qweight, weight_scale or input_scale, and the int8 head's. */
static bool is_quant_tensor(const qsource *s, const char *name) {
    return listed_layer(s, name, ".qweight") >= 0 || listed_layer(s, name, ".weight_scale") >= 0 ||
           listed_layer(s, name, ".input_scale") >= 0 ||
           (s->head && (!strcmp(name, "lm_head.qweight") || !strcmp(name, "lm_head.weight_scale")));
}

/* The source hf_import reads: the file's float tensors and, for each listed layer, its
 * "<prefix>.weight"; refuses a listed layer whose float weight is stored too. */
static anneal_status qsource_init(qsource *s, const anneal_safetensors *st, const anneal_params *ps, const bool *listed,
                                  bool head) {
    *s = (qsource){.st = st, .ps = ps, .listed = listed, .head = head};
    s->names = calloc((size_t)(st->n_entries + ps->n_dense + 1), sizeof *s->names);
    s->owned = calloc((size_t)(ps->n_dense + 1), sizeof *s->owned);
    if (!s->names || !s->owned) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", st->path);
    int n = 0;
    for (int i = 0; i < st->n_entries; i++) {
        const char *nm = st->entries[i].name;
        if (listed_layer(s, nm, ".weight") >= 0)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is stored as float, but its layer is listed as quantized",
                                    st->path, nm);
        if (!is_quant_tensor(s, nm)) s->names[n++] = nm;
    }
    for (int i = 0; i < ps->n_dense; i++) {
        if (!listed[i]) continue;
        size_t len = strlen(ps->dense[i].prefix) + 8;
        char *w = malloc(len);
        if (!w) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", st->path);
        snprintf(w, len, "%s.weight", ps->dense[i].prefix);
        s->owned[s->n_owned++] = w;
        s->names[n++] = w;
    }
    s->src = (anneal_tensor_source){.ctx = s, .what = st->path, .info = src_info, .get = src_get, .n = n, .names = s->names};
    return ANNEAL_OK;
}

/* ------------------------------------------------------------ checks */

/* Entry "<prefix><suffix>" with dtype and shape; errors name the file and the tensor. */
static const anneal_st_entry *want_entry(const anneal_safetensors *st, const char *prefix, const char *suffix,
                                         anneal_dtype dt, int ndim, const int64_t *shape, char *name, size_t nn) {
    snprintf(name, nn, "%s%s", prefix, suffix);
    const anneal_st_entry *e = anneal_safetensors_find(st, name);
    char want[96], got[96];
    if (!e) {
        anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is missing", st->path, name);
        return NULL;
    }
    if (e->dtype != dt || e->ndim != ndim || memcmp(e->shape, shape, (size_t)ndim * sizeof *shape) != 0) {
        anneal_dims_str(ndim, shape, want, sizeof want);
        anneal_dims_str(e->ndim, e->shape, got, sizeof got);
        anneal_set_error(dt == e->dtype ? ANNEAL_ERR_SHAPE : ANNEAL_ERR_DTYPE, "%s: %s must be %s %s, is %s %s", st->path,
                         name, anneal_dtype_name(dt), want, anneal_dtype_name(e->dtype), got);
        return NULL;
    }
    return e;
}

/* Marks the listed layers; every quantizable dense layer must be listed, and only those. */
static anneal_status mark_listed(const char *cfgp, const record *r, const anneal_params *ps, bool *listed) {
    const cJSON *e;
    cJSON_ArrayForEach(e, r->modules) {
        int k = -1;
        for (int i = 0; i < ps->n_dense && k < 0; i++)
            if (strcmp(ps->dense[i].prefix, e->valuestring) == 0) k = i;
        if (k < 0 || anneal_nn_quant_skips(e->valuestring))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.modules names %s, not a quantizable dense layer of the model",
                                    cfgp, e->valuestring);
        if (listed[k]) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: quantization_config.modules lists %s twice", cfgp, e->valuestring);
        listed[k] = true;
    }
    for (int i = 0; i < ps->n_dense; i++)
        if (!listed[i] && !anneal_nn_quant_skips(ps->dense[i].prefix))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: dense layer %s is not in quantization_config.modules", cfgp,
                                    ps->dense[i].prefix);
    return ANNEAL_OK;
}

/* Checks every quantized tensor of the listed layers before anything is loaded. */
static anneal_status check_tensors(const anneal_safetensors *st, const record *r, const anneal_params *ps,
                                   const bool *listed) {
    char name[512];
    for (int i = 0; i < ps->n_dense; i++) {
        if (!listed[i]) continue;
        const anneal_nn_dense *d = ps->dense[i].dense;
        const char *p = ps->dense[i].prefix;
        if (r->group > 0 && d->in % r->group)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: group_size %lld does not divide the in-features %lld of %s",
                                    st->path, (long long)r->group, (long long)d->in, p);
        int64_t ws[2] = {d->out, d->in}, ss[2] = {d->out, r->group > 0 ? d->in / r->group : 0}, one = 1;
        if (!want_entry(st, p, ".qweight", ANNEAL_I8, 2, ws, name, sizeof name) ||
            !want_entry(st, p, ".weight_scale", ANNEAL_F32, r->group > 0 ? 2 : 1, ss, name, sizeof name))
            return anneal_last_status();
        if (r->mode == ANNEAL_QUANT_STATIC) {
            const anneal_st_entry *e = want_entry(st, p, ".input_scale", ANNEAL_F32, 1, &one, name, sizeof name);
            if (!e) return anneal_last_status();
            float v;
            memcpy(&v, anneal_safetensors_data(st, e), 4);
            if (!(v > 0.0f && v < 3.0e38f))
                return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is %g, not a positive finite scale", st->path, name, (double)v);
        } else {
            snprintf(name, sizeof name, "%s.input_scale", p);
            if (anneal_safetensors_find(st, name))
                return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is for static mode, the record says %s", st->path, name,
                                        anneal_quant_mode_name(r->mode));
        }
    }
    return ANNEAL_OK;
}

/* Loads each listed layer's tensors and attaches them. */
static anneal_status attach_all(const anneal_safetensors *st, const record *r, anneal_params *ps, const bool *listed) {
    char name[512];
    for (int i = 0; i < ps->n_dense; i++) {
        if (!listed[i]) continue;
        const char *p = ps->dense[i].prefix;
        anneal_scope *sc = anneal_scope_open();
        snprintf(name, sizeof name, "%s.qweight", p);
        anneal_tensor *w = anneal_safetensors_load(st, name, ANNEAL_I8);
        snprintf(name, sizeof name, "%s.weight_scale", p);
        anneal_tensor *s = w ? anneal_safetensors_load(st, name, ANNEAL_F32) : NULL;
        float act = 0.0f;
        if (s && r->mode == ANNEAL_QUANT_STATIC) {
            snprintf(name, sizeof name, "%s.input_scale", p);
            memcpy(&act, anneal_safetensors_data(st, anneal_safetensors_find(st, name)), 4);
        }
        anneal_status rs = s ? anneal_nn_quant_attach(ps, &ps->dense[i], r->mode, r->group, w, s, act) : anneal_last_status();
        anneal_scope_close(sc);
        if (rs != ANNEAL_OK) return rs;
    }
    return ANNEAL_OK;
}

/* The int8 head's tensors (version 2): lm_head.qweight I8 (vocab, C) and
 * lm_head.weight_scale F32 (vocab); a version 1 file must have neither. */
static anneal_status check_head(const anneal_safetensors *st, const record *r, const anneal_model *m) {
    char name[64];
    if (!r->head) {
        if (anneal_safetensors_find(st, "lm_head.qweight") || anneal_safetensors_find(st, "lm_head.weight_scale"))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: lm_head.qweight is stored, but format_version 1 has a float head",
                                    st->path);
        return ANNEAL_OK;
    }
    int64_t ws[2] = {m->cfg.vocab_size, m->cfg.n_embd}, ss[1] = {m->cfg.vocab_size};
    if (!want_entry(st, "lm_head", ".qweight", ANNEAL_I8, 2, ws, name, sizeof name) ||
        !want_entry(st, "lm_head", ".weight_scale", ANNEAL_F32, 1, ss, name, sizeof name))
        return anneal_last_status();
    return ANNEAL_OK;
}

/* Loads and attaches the int8 head (checked by check_head). */
static anneal_status attach_head(const anneal_safetensors *st, const record *r, anneal_params *ps) {
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *w = anneal_safetensors_load(st, "lm_head.qweight", ANNEAL_I8);
    anneal_tensor *s = w ? anneal_safetensors_load(st, "lm_head.weight_scale", ANNEAL_F32) : NULL;
    anneal_status rs = s ? anneal_nn_quant_head_attach(ps, r->head_mode, w, s) : anneal_last_status();
    anneal_scope_close(sc);
    return rs;
}

anneal_status anneal_quant_load(const char *path, anneal_device dev, anneal_model **out) {
    if (!path || !out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_quant_load: NULL argument");
    *out = NULL;
    char dir[PATH_MAX], wpath[PATH_MAX + 32], cfgp[PATH_MAX + 32];
    anneal_status r = locate(path, dir, sizeof dir, wpath, sizeof wpath);
    if (r != ANNEAL_OK) return r;
    cJSON *j = read_config(dir, cfgp, sizeof cfgp);
    if (!j) return anneal_last_status();
    record rec;
    anneal_model_config cfg;
    anneal_safetensors *st = NULL;
    anneal_model *m = NULL;
    bool *listed = NULL;
    qsource src = {0};
    r = parse_record(cfgp, j, &rec);
    if (r == ANNEAL_OK) r = anneal_model_config_from_hf_file(cfgp, &cfg);
    if (r == ANNEAL_OK) r = anneal_safetensors_open(wpath, &st);
    /* the layers and the quantized tensors' shapes checked on a model without storage
     * first: a config.json with sizes the weights do not have allocates nothing */
    anneal_params_defer_storage(true);
    if (r == ANNEAL_OK && !(m = anneal_model_new(&cfg, dev))) r = anneal_last_status();
    anneal_params_defer_storage(false);
    if (r == ANNEAL_OK && !(listed = calloc((size_t)m->params->n_dense + 1, sizeof *listed)))
        r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    if (r == ANNEAL_OK) r = mark_listed(cfgp, &rec, m->params, listed);
    if (r == ANNEAL_OK) r = check_tensors(st, &rec, m->params, listed);
    if (r == ANNEAL_OK) r = check_head(st, &rec, m);
    anneal_model_free(m); /* then the model itself (the same layers, so the same list) */
    m = NULL;
    if (r == ANNEAL_OK && !(m = anneal_model_new(&cfg, dev))) r = anneal_last_status();
    if (r == ANNEAL_OK) r = qsource_init(&src, st, m->params, listed, rec.head);
    /* the int8 layers first: their f32 weights give way to stride-0 zeros before the import
     * would write (and so touch) 4 bytes a weight that nothing reads */
    if (r == ANNEAL_OK) r = attach_all(st, &rec, m->params, listed);
    if (r == ANNEAL_OK) anneal_memory_release_cache(ANNEAL_CPU); /* those f32 blocks go back now */
    if (r == ANNEAL_OK) r = anneal_model_hf_import(m, &src.src);
    if (r == ANNEAL_OK && rec.head) r = attach_head(st, &rec, m->params);
    qsource_free(&src);
    free(listed);
    anneal_safetensors_close(st);
    cJSON_Delete(j);
    if (r != ANNEAL_OK) {
        anneal_model_free(m);
        return r;
    }
    *out = m;
    anneal_memory_release_cache(ANNEAL_CPU); /* the load's temporaries (f32 conversions, zeros) */
    return ANNEAL_OK;
}
