/* GPT-2's Hugging Face interchange: config.json <-> anneal_model_config, and weights
 * from a transformers state dict (GPT2LMHeadModel keys "transformer.h.0...." with an
 * optional "lm_head.weight", or GPT2Model keys "h.0...."), ignoring the causal-mask
 * buffers older transformers versions saved ("h.N.attn.bias", "h.N.attn.masked_bias").
 * Everything is validated before a parameter is written. */
#include "gpt2_hf.h"
#include "anneal/parse.h"
#include "models_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ config */

/* Integer field `key` in [1, INT32_MAX]; absent -> *present = false. */
static anneal_status get_pos_int(const char *path, const cJSON *j, const char *key, int *out, bool *present) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    *present = v != NULL && !cJSON_IsNull(v);
    if (!*present) return ANNEAL_OK;
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d >= 1 && d <= 2147483647.0) || d != floor(d))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" must be a positive integer", path, key);
    *out = (int)d;
    return ANNEAL_OK;
}

/* Number field `key` in [lo, hi); absent -> def. */
static anneal_status get_num(const char *path, const cJSON *j, const char *key, double lo, double hi,
                             double def, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v)) {
        *out = def;
        return ANNEAL_OK;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d >= lo && d < hi))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" must be a number in [%g, %g)", path, key, lo, hi);
    *out = d;
    return ANNEAL_OK;
}

/* Boolean field: must be `want` when present (else the architecture differs). */
static anneal_status require_bool(const char *path, const cJSON *j, const char *key, bool want) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v)) return ANNEAL_OK;
    if (!cJSON_IsBool(v)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" must be true or false", path, key);
    if (cJSON_IsTrue(v) != want)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: \"%s\": %s is not supported (anneal's GPT-2 needs %s)",
                                path, key, want ? "false" : "true", want ? "true" : "false");
    return ANNEAL_OK;
}

/* Checks the parsed config object and fills cfg. */
static anneal_status parse_hf_config(const char *path, const cJSON *j, anneal_model_config *cfg) {
    if (!cJSON_IsObject(j)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object", path);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(j, "model_type");
    if (mt && !cJSON_IsNull(mt)) {
        if (!cJSON_IsString(mt)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"model_type\" must be a string", path);
        if (strcmp(mt->valuestring, "gpt2") != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: model_type \"%s\" is not GPT-2's (\"gpt2\")", path,
                                    mt->valuestring);
    }
    anneal_model_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.arch, sizeof c.arch, "gpt2");
    static const char *required[] = {"n_layer", "n_head", "n_embd", "vocab_size"};
    int *dst[] = {&c.n_layer, &c.n_head, &c.n_embd, &c.vocab_size};
    anneal_status r;
    bool present;
    for (int i = 0; i < 4; i++) {
        if ((r = get_pos_int(path, j, required[i], dst[i], &present)) != ANNEAL_OK) return r;
        if (!present) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: missing \"%s\"", path, required[i]);
    }
    /* n_positions sizes wpe; old configs also carry n_ctx (the same number). */
    int n_pos = 0, n_ctx = 0;
    bool has_pos, has_ctx;
    if ((r = get_pos_int(path, j, "n_positions", &n_pos, &has_pos)) != ANNEAL_OK) return r;
    if ((r = get_pos_int(path, j, "n_ctx", &n_ctx, &has_ctx)) != ANNEAL_OK) return r;
    if (!has_pos && !has_ctx) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: missing \"n_ctx\" and \"n_positions\"", path);
    if (has_pos && has_ctx && n_pos != n_ctx)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: n_ctx %d differs from n_positions %d", path, n_ctx, n_pos);
    c.n_ctx = has_ctx ? n_ctx : n_pos;
    if (c.n_embd % c.n_head)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: n_embd %d is not divisible by n_head %d", path, c.n_embd, c.n_head);
    const cJSON *inner = cJSON_GetObjectItemCaseSensitive(j, "n_inner");
    if (inner && !cJSON_IsNull(inner) && !(cJSON_IsNumber(inner) && inner->valuedouble == 4.0 * c.n_embd))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: n_inner must be null or 4 * n_embd (%d)", path, 4 * c.n_embd);
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(j, "activation_function");
    if (act && !cJSON_IsNull(act)) {
        if (!cJSON_IsString(act))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"activation_function\" must be a string", path);
        if (strcmp(act->valuestring, "gelu_new") != 0 && strcmp(act->valuestring, "gelu_pytorch_tanh") != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: activation_function \"%s\" is not supported (gelu_new or gelu_pytorch_tanh)",
                                    path, act->valuestring);
    }
    if ((r = require_bool(path, j, "tie_word_embeddings", true)) != ANNEAL_OK ||
        (r = require_bool(path, j, "scale_attn_weights", true)) != ANNEAL_OK ||
        (r = require_bool(path, j, "scale_attn_by_inverse_layer_idx", false)) != ANNEAL_OK ||
        (r = require_bool(path, j, "add_cross_attention", false)) != ANNEAL_OK)
        return r;
    /* Missing values take transformers' GPT2Config defaults. */
    double eps = 0, resid = 0, embd = 0, attn = 0;
    if ((r = get_num(path, j, "layer_norm_epsilon", 1e-30, 1.0, 1e-5, &eps)) != ANNEAL_OK ||
        (r = get_num(path, j, "resid_pdrop", 0.0, 1.0, 0.1, &resid)) != ANNEAL_OK ||
        (r = get_num(path, j, "embd_pdrop", 0.0, 1.0, 0.1, &embd)) != ANNEAL_OK ||
        (r = get_num(path, j, "attn_pdrop", 0.0, 1.0, 0.1, &attn)) != ANNEAL_OK)
        return r;
    /* One dropout rate serves embeddings and residual branches in anneal. */
    if ((float)embd != (float)resid)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: embd_pdrop %g differs from resid_pdrop %g", path, embd, resid);
    c.dropout = (float)resid;
    c.norm_eps = (float)eps;
    c.recompute = ANNEAL_RECOMPUTE_NONE;
    *cfg = c; /* the registry checks it with the architecture's config_check */
    return ANNEAL_OK;
}

anneal_status anneal_gpt2_config_from_hf(const char *json, const char *source, anneal_model_config *out) {
    if (!json || !out) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2 config: NULL argument");
    if (!source) source = "config.json";
    cJSON *j = NULL;
    if (anneal_json_parse(json, strlen(json), source, &j) != ANNEAL_OK) return anneal_last_status();
    anneal_status r = parse_hf_config(source, j, out);
    cJSON_Delete(j);
    return r;
}

/* Shortest decimal text that reads back as the same float. */
static void fmt_float(char *buf, size_t n, float v) {
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, n, "%.*g", p, (double)v);
        if ((float)strtod(buf, NULL) == v) return;
    }
}

/* transformers' GPT2Config keys (sorted, 2-space indent, as save_pretrained writes
 * them); attn_pdrop carries the same rate although anneal does not drop attention
 * probabilities. */
char *anneal_gpt2_config_to_hf(const anneal_model_config *c) {
    if (!c) {
        anneal_set_error(ANNEAL_ERR_ARG, "gpt2 config: NULL argument");
        return NULL;
    }
    char drop[32], eps[32];
    fmt_float(drop, sizeof drop, c->dropout);
    fmt_float(eps, sizeof eps, c->norm_eps);
    char *txt = NULL;
    int n = asprintf(&txt,
                     "{\n"
                     "  \"activation_function\": \"gelu_new\",\n"
                     "  \"architectures\": [\n    \"GPT2LMHeadModel\"\n  ],\n"
                     "  \"attn_pdrop\": %s,\n"
                     "  \"embd_pdrop\": %s,\n"
                     "  \"layer_norm_epsilon\": %s,\n"
                     "  \"model_type\": \"gpt2\",\n"
                     "  \"n_ctx\": %d,\n"
                     "  \"n_embd\": %d,\n"
                     "  \"n_head\": %d,\n"
                     "  \"n_layer\": %d,\n"
                     "  \"n_positions\": %d,\n"
                     "  \"resid_pdrop\": %s,\n"
                     "  \"tie_word_embeddings\": true,\n"
                     "  \"torch_dtype\": \"float32\",\n"
                     "  \"vocab_size\": %d\n"
                     "}\n",
                     drop, drop, eps, c->n_ctx, c->n_embd, c->n_head, c->n_layer, c->n_ctx, drop, c->vocab_size);
    if (n < 0) {
        anneal_set_error(ANNEAL_ERR_OOM, "gpt2 config: out of memory");
        return NULL;
    }
    return txt;
}

/* ----------------------------------------------------------------- weights */

/* True for "h.<digits>.attn.bias" / "h.<digits>.attn.masked_bias" (mask buffers). */
static bool is_mask_buffer(const char *key) {
    if (strncmp(key, "h.", 2) != 0) return false;
    const char *p = key + 2;
    if (*p < '0' || *p > '9') return false;
    while (*p >= '0' && *p <= '9') p++;
    return strcmp(p, ".attn.bias") == 0 || strcmp(p, ".attn.masked_bias") == 0;
}

/* Classifies every tensor of src against m's parameters; seen[i] = the source name of
 * parameter i. Errors name the unexpected, duplicated or missing tensors. */
static anneal_status match_entries(const anneal_model *m, const anneal_tensor_source *src, const char **seen,
                                   const char **lm_head) {
    const anneal_params *ps = m->params;
    const char *tp = "transformer.";
    size_t tl = strlen(tp);
    char unknown[1024] = "", key[600];
    int n_unknown = 0;
    *lm_head = NULL;
    for (int i = 0; i < src->n; i++) {
        const char *name = src->names[i];
        const char *base = strncmp(name, tp, tl) == 0 ? name + tl : name;
        if (base == name && strcmp(base, "lm_head.weight") == 0) {
            *lm_head = name;
            continue;
        }
        if (is_mask_buffer(base)) continue;
        snprintf(key, sizeof key, "%s%s", tp, base);
        const anneal_param *p = anneal_params_find(ps, key);
        if (!p) {
            anneal_hf_name_list_add(unknown, sizeof unknown, &n_unknown, name);
            continue;
        }
        int idx = (int)(p - ps->items);
        if (seen[idx])
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: both %s and %s hold parameter %s", src->what, seen[idx], name,
                                    key);
        seen[idx] = name;
    }
    if (n_unknown) {
        anneal_hf_name_list_finish(unknown, sizeof unknown, n_unknown);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %d tensor(s) that a GPT-2 with n_layer %d does not have: %s",
                                src->what, n_unknown, m->cfg.n_layer, unknown);
    }
    return anneal_hf_check_missing(m, src, seen);
}

anneal_status anneal_gpt2_hf_import(anneal_model *m, const anneal_tensor_source *src) {
    if (!m || !src) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2 weights: NULL argument");
    const anneal_params *ps = m->params;
    const char **seen = calloc((size_t)ps->n + 1, sizeof *seen), *lm_head = NULL;
    if (!seen) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", src->what);
    anneal_status r = match_entries(m, src, seen, &lm_head);
    if (r == ANNEAL_OK && lm_head) {
        /* transformers ties lm_head.weight to wte; anneal has no separate head. */
        const char *wte = seen[(int)(anneal_params_find(ps, "transformer.wte.weight") - ps->items)];
        anneal_scope *sc = anneal_scope_open();
        bool same = false;
        r = anneal_hf_same_as_f32(src, lm_head, wte, &same);
        anneal_scope_close(sc);
        if (r == ANNEAL_OK && !same)
            r = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                 "%s: lm_head.weight differs from %s (anneal's GPT-2 ties the lm head to the token embedding)",
                                 src->what, wte);
    }
    if (r == ANNEAL_OK) r = anneal_hf_load_matched(m, src, seen);
    free(seen);
    return r;
}

anneal_status anneal_gpt2_hf_export(const anneal_model *m, const anneal_tensor_sink *sink) {
    if (!m || !sink) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2 export: NULL argument");
    return anneal_hf_export_params(m, sink);
}
