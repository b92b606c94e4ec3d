/* The model interface: the registry of architectures (the library's own from
 * registry.c, added on first use, and any registered by the application), configs
 * from and to Hugging Face config.json dispatching on "model_type", and the
 * anneal_model_* wrappers every consumer calls (argument checks, then the
 * architecture's op). */
#include "models_internal.h"
#include "anneal/parse.h"

#include "anneal/autograd.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* -------------------------------------------------------------- registry */

#define MAX_ARCHS 64

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const anneal_model_arch *g_archs[MAX_ARCHS];
static int g_n;

/* Adds a (under the lock); ANNEAL_ERR_ARG for a duplicate name or model_type. */
static anneal_status add_locked(const anneal_model_arch *a) {
    for (int i = 0; i < g_n; i++) {
        if (!strcmp(g_archs[i]->name, a->name))
            return anneal_set_error(ANNEAL_ERR_ARG, "model registry: architecture '%s' is already registered", a->name);
        for (const char *const *t = a->hf_model_types; t && *t; t++)
            for (const char *const *u = g_archs[i]->hf_model_types; u && *u; u++)
                if (!strcmp(*t, *u))
                    return anneal_set_error(ANNEAL_ERR_ARG,
                                            "model registry: model_type \"%s\" of '%s' is already read by '%s'", *t,
                                            a->name, g_archs[i]->name);
    }
    if (g_n == MAX_ARCHS)
        return anneal_set_error(ANNEAL_ERR_OOM, "model registry: more than %d architectures", MAX_ARCHS);
    g_archs[g_n++] = a;
    return ANNEAL_OK;
}

static void add_builtins(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; anneal_builtin_archs[i]; i++) add_locked(anneal_builtin_archs[i]);
    pthread_mutex_unlock(&g_lock);
}

anneal_status anneal_model_arch_register(const anneal_model_arch *a) {
    if (!a || !a->name || !a->name[0] || strlen(a->name) >= ANNEAL_ARCH_NAME_MAX || !a->create || !a->config_check ||
        !a->config_from_hf || !a->config_to_hf)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "model registry: an architecture needs a name (< %d bytes), create, config_check, "
                                "config_from_hf and config_to_hf",
                                ANNEAL_ARCH_NAME_MAX);
    pthread_once(&g_once, add_builtins);
    pthread_mutex_lock(&g_lock);
    anneal_status s = add_locked(a);
    pthread_mutex_unlock(&g_lock);
    return s;
}

const anneal_model_arch *const *anneal_model_archs(int *n) {
    pthread_once(&g_once, add_builtins);
    pthread_mutex_lock(&g_lock);
    if (n) *n = g_n;
    pthread_mutex_unlock(&g_lock);
    return g_archs;
}

const anneal_model_arch *anneal_model_arch_find(const char *name) {
    int n;
    const anneal_model_arch *const *a = anneal_model_archs(&n);
    for (int i = 0; name && i < n; i++)
        if (!strcmp(a[i]->name, name)) return a[i];
    return NULL;
}

const anneal_model_arch *anneal_model_arch_for_hf(const char *model_type) {
    int n;
    const anneal_model_arch *const *a = anneal_model_archs(&n);
    for (int i = 0; model_type && i < n; i++)
        for (const char *const *t = a[i]->hf_model_types; t && *t; t++)
            if (!strcmp(*t, model_type)) return a[i];
    return NULL;
}

/* Appends s to a ", "-separated list in buf. */
static void list_add(char *buf, size_t n, const char *s) {
    size_t used = strlen(buf);
    if (used < n) snprintf(buf + used, n - used, "%s%s", used ? ", " : "", s);
}

/* The model_types every architecture reads ("gpt2, llama"). */
static const char *known_types(char *buf, size_t n) {
    int k;
    const anneal_model_arch *const *a = anneal_model_archs(&k);
    buf[0] = '\0';
    for (int i = 0; i < k; i++)
        for (const char *const *t = a[i]->hf_model_types; t && *t; t++) list_add(buf, n, *t);
    return buf;
}

/* The architecture names ("gpt2, llama"). */
static const char *known_archs(char *buf, size_t n) {
    int k;
    const anneal_model_arch *const *a = anneal_model_archs(&k);
    buf[0] = '\0';
    for (int i = 0; i < k; i++) list_add(buf, n, a[i]->name);
    return buf;
}

/* The architecture of cfg, or NULL + ANNEAL_ERR_ARG naming the ones there are. */
static const anneal_model_arch *arch_of(const anneal_model_config *cfg, const char *what) {
    if (!cfg) {
        anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL config", what);
        return NULL;
    }
    const anneal_model_arch *a = anneal_model_arch_find(cfg->arch);
    if (!a) {
        char known[256];
        anneal_set_error(ANNEAL_ERR_ARG, "%s: unknown architecture '%.32s' (known: %s)", what, cfg->arch,
                         known_archs(known, sizeof known));
    }
    return a;
}

bool anneal_model_preset(const char *name, anneal_model_config *out) {
    int n;
    const anneal_model_arch *const *a = anneal_model_archs(&n);
    for (int i = 0; name && i < n; i++)
        if (a[i]->preset && a[i]->preset(name, out)) {
            if (!out->arch[0]) snprintf(out->arch, sizeof out->arch, "%s", a[i]->name);
            return true;
        }
    return false;
}

const char *anneal_model_preset_names(char *buf, size_t n) {
    int k;
    const anneal_model_arch *const *a = anneal_model_archs(&k);
    if (!buf || !n) return buf;
    buf[0] = '\0';
    for (int i = 0; i < k; i++)
        for (const char *const *p = a[i]->preset_names; p && *p; p++) list_add(buf, n, *p);
    return buf;
}

/* ---------------------------------------------------------------- configs */

bool anneal_recompute_parse(const char *s, anneal_recompute_mode *out) {
    static const struct {
        const char *name;
        anneal_recompute_mode mode;
    } names[] = {{"none", ANNEAL_RECOMPUTE_NONE}, {"off", ANNEAL_RECOMPUTE_NONE},
                 {"attn", ANNEAL_RECOMPUTE_ATTN}, {"block", ANNEAL_RECOMPUTE_BLOCK},
                 {"on", ANNEAL_RECOMPUTE_BLOCK}};
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].mode;
            return true;
        }
    return false;
}

const char *anneal_recompute_name(anneal_recompute_mode m) {
    switch (m) {
    case ANNEAL_RECOMPUTE_NONE: return "none";
    case ANNEAL_RECOMPUTE_BLOCK: return "block";
    case ANNEAL_RECOMPUTE_ATTN: return "attn";
    }
    return "?";
}

anneal_status anneal_model_config_from_hf_json(const char *json, const char *source, anneal_model_config *out) {
    if (!json || !out) return anneal_set_error(ANNEAL_ERR_ARG, "model config: NULL argument");
    if (!source) source = "config.json";
    cJSON *j = NULL;
    if (anneal_json_parse(json, strlen(json), source, &j) != ANNEAL_OK) return anneal_last_status();
    anneal_status r = ANNEAL_OK;
    const anneal_model_arch *a = NULL;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(j, "model_type");
    char known[256];
    if (!cJSON_IsObject(j))
        r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object", source);
    else if (mt && !cJSON_IsNull(mt) && !cJSON_IsString(mt))
        r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"model_type\" must be a string", source);
    else if (!(a = anneal_model_arch_for_hf(cJSON_IsString(mt) ? mt->valuestring : "gpt2")))
        r = anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: model_type \"%s\" is not supported (known: %s)", source,
                             cJSON_IsString(mt) ? mt->valuestring : "gpt2", known_types(known, sizeof known));
    cJSON_Delete(j);
    if (r != ANNEAL_OK) return r;
    anneal_model_config c;
    memset(&c, 0, sizeof c);
    if ((r = a->config_from_hf(json, source, &c)) != ANNEAL_OK) return r;
    snprintf(c.arch, sizeof c.arch, "%s", a->name);
    if ((r = a->config_check(&c)) != ANNEAL_OK) return r;
    *out = c;
    return ANNEAL_OK;
}

anneal_status anneal_model_config_from_hf_file(const char *path, anneal_model_config *out) {
    if (!path || !out) return anneal_set_error(ANNEAL_ERR_ARG, "model config: NULL argument");
    FILE *f = fopen(path, "rb");
    if (!f) return anneal_set_error(ANNEAL_ERR_IO, "%s: %s", path, strerror(errno));
    enum { MAX = 1 << 20 };
    char *txt = malloc(MAX + 1);
    size_t n = txt ? fread(txt, 1, MAX + 1, f) : 0;
    bool err = ferror(f);
    fclose(f);
    anneal_status r = ANNEAL_OK;
    if (!txt) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    else if (err) r = anneal_set_error(ANNEAL_ERR_IO, "%s: read error", path);
    else if (n > MAX) r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: larger than %d bytes: not a config.json", path, MAX);
    if (r == ANNEAL_OK) {
        txt[n] = '\0';
        if (strlen(txt) != n) r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not valid JSON (a NUL byte)", path);
    }
    if (r == ANNEAL_OK) r = anneal_model_config_from_hf_json(txt, path, out);
    free(txt);
    return r;
}

char *anneal_model_config_to_hf_json(const anneal_model_config *cfg) {
    const anneal_model_arch *a = arch_of(cfg, "model config");
    return a && a->config_check(cfg) == ANNEAL_OK ? a->config_to_hf(cfg) : NULL;
}

anneal_status anneal_model_config_check(const anneal_model_config *cfg) {
    const anneal_model_arch *a = arch_of(cfg, "model config");
    return a ? a->config_check(cfg) : anneal_last_status();
}

/* ----------------------------------------------------------------- models */

anneal_model *anneal_model_new(const anneal_model_config *cfg, anneal_device dev) {
    const anneal_model_arch *a = arch_of(cfg, "model");
    if (!a || a->config_check(cfg) != ANNEAL_OK) return NULL;
    anneal_model *m = a->create(cfg, dev);
    if (m) m->arch = a;
    return m;
}

void anneal_model_free(anneal_model *m) {
    if (m) m->ops->free(m);
}

anneal_status anneal_model_init(anneal_model *m, uint64_t seed) {
    return m ? m->ops->init(m, seed) : anneal_set_error(ANNEAL_ERR_ARG, "model init: NULL model");
}

anneal_tensor *anneal_model_loss(anneal_model *m, anneal_tensor *ids, anneal_tensor *targets) {
    return m && ids && targets ? m->ops->loss(m, ids, targets) : NULL;
}

anneal_tensor *anneal_model_logits(anneal_model *m, anneal_tensor *ids) {
    return m && ids ? m->ops->logits(m, ids) : NULL;
}

int64_t anneal_model_num_params(const anneal_model *m) { return m ? anneal_params_numel(m->params) : 0; }

double anneal_model_flops_per_token(const anneal_model *m, int64_t T) {
    return m ? m->ops->flops_per_token(m, T) : 0.0;
}

anneal_device anneal_model_device(const anneal_model *m) { return m ? m->device : ANNEAL_CPU; }

anneal_status anneal_model_set_compute(anneal_model *m, anneal_dtype compute) {
    if (!m) return anneal_set_error(ANNEAL_ERR_ARG, "model: NULL model");
    if (compute != ANNEAL_F32 && compute != ANNEAL_BF16 && compute != ANNEAL_F16)
        return anneal_set_error(ANNEAL_ERR_ARG, "model: compute precision %s is not f32, bf16 or f16",
                                anneal_dtype_name(compute));
    m->ctx.compute = compute;
    return ANNEAL_OK;
}

anneal_status anneal_model_set_kv_dtype(anneal_model *m, anneal_dtype kv_dtype) {
    if (!m) return anneal_set_error(ANNEAL_ERR_ARG, "model: NULL model");
    if (kv_dtype != ANNEAL_F32 && kv_dtype != ANNEAL_BF16 && kv_dtype != ANNEAL_I8)
        return anneal_set_error(ANNEAL_ERR_ARG, "model: KV cache dtype %s is not f32, bf16 or int8",
                                anneal_dtype_name(kv_dtype));
    m->ctx.kv_dtype = kv_dtype;
    return ANNEAL_OK;
}

anneal_status anneal_model_block_enter(const anneal_model *m, int layer) {
    return m && m->block_hook ? m->block_hook(m->block_hook_user, layer, true) : ANNEAL_OK;
}

anneal_tensor *anneal_model_block_leave(const anneal_model *m, int layer, anneal_tensor *y) {
    if (!m || !m->block_hook) return y;
    return m->block_hook(m->block_hook_user, layer, false) == ANNEAL_OK ? y : NULL;
}

void anneal_model_set_training(anneal_model *m, bool training) {
    if (m) m->ctx.training = training;
}

anneal_status anneal_model_hf_import(anneal_model *m, const anneal_tensor_source *src) {
    if (!m || !src) return anneal_set_error(ANNEAL_ERR_ARG, "model import: NULL argument");
    if (!m->ops->hf_import)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: architecture %s has no Hugging Face import", src->what,
                                m->cfg.arch);
    return m->ops->hf_import(m, src);
}

anneal_status anneal_model_hf_export(const anneal_model *m, const anneal_tensor_sink *sink) {
    if (!m || !sink) return anneal_set_error(ANNEAL_ERR_ARG, "model export: NULL argument");
    if (!m->ops->hf_export)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "architecture %s has no Hugging Face export", m->cfg.arch);
    return m->ops->hf_export(m, sink);
}

anneal_status anneal_model_onnx_graph(const anneal_model *m, anneal_onnx_graph *g, bool kv_cache) {
    if (!m || !g) return anneal_set_error(ANNEAL_ERR_ARG, "onnx export: NULL argument");
    if (anneal_params_require_float(m->params, "onnx export") != ANNEAL_OK) return anneal_last_status();
    if (!m->ops->onnx_graph)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "onnx export: architecture %s has no ONNX exporter",
                                m->cfg.arch);
    if (g->status != ANNEAL_OK) return g->status;
    anneal_scope *sc = anneal_scope_open(); /* temporaries (rope tables) die here; g holds its own */
    anneal_status s = m->ops->onnx_graph(m, g, kv_cache);
    anneal_scope_close(sc);
    if (s == ANNEAL_OK && g->status != ANNEAL_OK) s = g->status;
    return s;
}

/* ------------------------------------------------------------- generation */

anneal_kv_cache *anneal_model_kv_cache_new(anneal_model *m, int64_t batch, int64_t max_len) {
    if (!m) {
        anneal_set_error(ANNEAL_ERR_ARG, "kv_cache: NULL model");
        return NULL;
    }
    if (batch <= 0 || max_len <= 0 || max_len > m->cfg.n_ctx) {
        anneal_set_error(ANNEAL_ERR_ARG, "kv_cache: batch %lld must be positive and max_len %lld in [1, n_ctx %d]",
                         (long long)batch, (long long)max_len, m->cfg.n_ctx);
        return NULL;
    }
    return m->ops->kv_cache_new(m, batch, max_len);
}

anneal_tensor *anneal_model_forward_cached_last(anneal_model *m, anneal_kv_cache *kv, anneal_tensor *ids,
                                                int64_t rows) {
    if (!m || !kv || !ids) {
        if (!ids) return NULL; /* an upstream error is already recorded */
        anneal_set_error(ANNEAL_ERR_ARG, "model_forward_cached: NULL model or cache");
        return NULL;
    }
    if (anneal_kv_cache_owner(kv) != m) {
        anneal_set_error(ANNEAL_ERR_ARG, "model_forward_cached: the cache was made for another model");
        return NULL;
    }
    if (!anneal_kv_cache_uniform(kv)) {
        anneal_set_error(ANNEAL_ERR_ARG, "model_forward_cached: the cache's slots hold different lengths "
                                         "(use anneal_model_prefill_slot / anneal_model_decode_slots)");
        return NULL;
    }
    char s[64];
    int64_t B = anneal_kv_cache_batch(kv), len = anneal_kv_cache_len(kv), max_len = anneal_kv_cache_max_len(kv);
    if (ids->ndim != 2 || ids->dtype != ANNEAL_I32 || ids->shape[0] != B || ids->shape[1] <= 0) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "model_forward_cached: ids must be i32 (B = %lld, T_new >= 1), got %s",
                         (long long)B, anneal_shape_str(ids, s, sizeof s));
        return NULL;
    }
    int64_t T = ids->shape[1];
    if (len + T > max_len) {
        anneal_set_error(ANNEAL_ERR_SHAPE,
                         "model_forward_cached: %lld cached + %lld new positions exceed the cache's max_len %lld",
                         (long long)len, (long long)T, (long long)max_len);
        return NULL;
    }
    if (rows <= 0 || rows > T) rows = T;
    /* every intermediate in a scope closed here; the logits go to the caller's */
    anneal_scope *outer = anneal_scope_current();
    anneal_no_grad_begin();
    anneal_scope *tmp = anneal_scope_open();
    bool training = m->ctx.training;
    m->ctx.training = false; /* generation never uses dropout */
    anneal_tensor *logits = m->ops->forward_cached(m, kv, ids, rows);
    m->ctx.training = training;
    if (logits && anneal_kv_cache_advance(kv, T) != ANNEAL_OK) logits = NULL;
    if (logits) anneal_keep(logits, outer);
    anneal_scope_close(tmp);
    anneal_no_grad_end();
    return logits;
}

anneal_tensor *anneal_model_forward_cached(anneal_model *m, anneal_kv_cache *kv, anneal_tensor *ids) {
    return anneal_model_forward_cached_last(m, kv, ids, 0);
}
