/* The Llama family's Hugging Face interchange: config.json (LlamaConfig, MistralConfig,
 * Qwen2Config) <-> anneal_model_config, and weights from / to a transformers state dict
 * ("model.embed_tokens.weight", "model.layers.N.self_attn.q_proj.weight", ...,
 * "model.norm.weight", "lm_head.weight" unless tied).
 *
 * What is read: the sizes, num_key_value_heads (GQA, MQA), rms_norm_eps,
 * max_position_embeddings (n_ctx), rope_theta, rope_scaling of type linear or llama3
 * (the old "type" key or the newer "rope_type"), tie_word_embeddings, Llama's
 * attention_bias (biases on q, k, v and o), Qwen2's q/k/v biases. Refused with
 * ANNEAL_ERR_UNSUPPORTED naming the key: another hidden_act than silu, mlp_bias, a
 * head_dim other than hidden_size / num_attention_heads, other rope_scaling types
 * (dynamic, yarn, ...), a sliding window that is in effect (Mistral's sliding_window,
 * Qwen2's use_sliding_window, below max_position_embeddings), Mistral's
 * attention_bias. attention_dropout is accepted and not applied (anneal's attention
 * has no probability dropout, as GPT-2's attn_pdrop); pretraining_tp only splits
 * transformers' matrix products (the same function) and is ignored. Everything is
 * validated before a parameter is written. */
#include "llama_internal.h"
#include "anneal/parse.h"
#include "models_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *anneal_llama_hf_type(const anneal_model_config *c) {
    return c->hf_model_type[0] ? c->hf_model_type : "llama";
}

/* ------------------------------------------------------------------ config */

/* Present and not null. */
static const cJSON *field(const cJSON *j, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* Integer `key` in [1, INT32_MAX]: required (missing is an error) or def when absent. */
static anneal_status get_int(const char *path, const cJSON *j, const char *key, bool required, int def, int *out) {
    const cJSON *v = field(j, key);
    if (!v) {
        if (required) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: missing \"%s\"", path, key);
        *out = def;
        return ANNEAL_OK;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d >= 1 && d <= 2147483647.0) || d != floor(d))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" must be a positive integer", path, key);
    *out = (int)d;
    return ANNEAL_OK;
}

/* Number `key` of obj in (lo, hi); absent -> def. `what` names obj's key in errors. */
static anneal_status get_num(const char *path, const char *what, const cJSON *j, const char *key, double lo,
                             double hi, double def, double *out) {
    const cJSON *v = field(j, key);
    if (!v) {
        *out = def;
        return ANNEAL_OK;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d > lo && d < hi))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s%s\" must be a number in (%g, %g)", path, what, key, lo, hi);
    *out = d;
    return ANNEAL_OK;
}

/* Boolean `key`; absent -> def. */
static anneal_status get_bool(const char *path, const cJSON *j, const char *key, bool def, bool *out) {
    const cJSON *v = field(j, key);
    if (!v) {
        *out = def;
        return ANNEAL_OK;
    }
    if (!cJSON_IsBool(v)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" must be true or false", path, key);
    *out = cJSON_IsTrue(v);
    return ANNEAL_OK;
}

/* rope_scaling: null, or {"type"/"rope_type": "linear", "factor"} or {..."llama3",
 * "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}. */
static anneal_status parse_rope_scaling(const char *path, const cJSON *j, anneal_rope_desc *r) {
    const cJSON *rs = field(j, "rope_scaling");
    if (!rs) return ANNEAL_OK;
    if (!cJSON_IsObject(rs)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"rope_scaling\" must be an object", path);
    const cJSON *t = field(rs, "rope_type");
    if (!t) t = field(rs, "type");
    if (!t || !cJSON_IsString(t))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"rope_scaling\" needs a string \"rope_type\" (or \"type\")",
                                path);
    const char *type = t->valuestring;
    if (!strcmp(type, "default")) return ANNEAL_OK;
    bool linear = !strcmp(type, "linear"), llama3 = !strcmp(type, "llama3");
    if (!linear && !llama3)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: rope_scaling type \"%s\" is not supported (linear or llama3)", path, type);
    double factor = NAN, lo = NAN, hi = NAN;
    anneal_status s = get_num(path, "rope_scaling.", rs, "factor", 0.0, 1e9, NAN, &factor);
    if (s != ANNEAL_OK) return s;
    if (isnan(factor)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"rope_scaling\" needs \"factor\"", path);
    r->factor = (float)factor;
    if (linear) {
        r->scaling = ANNEAL_ROPE_SCALING_LINEAR;
        return ANNEAL_OK;
    }
    r->scaling = ANNEAL_ROPE_SCALING_LLAMA3;
    if (!field(rs, "low_freq_factor") || !field(rs, "high_freq_factor") || !field(rs, "original_max_position_embeddings"))
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: \"rope_scaling\" of type llama3 needs low_freq_factor, high_freq_factor and "
                                "original_max_position_embeddings",
                                path);
    int omp = 0;
    if ((s = get_num(path, "rope_scaling.", rs, "low_freq_factor", 0.0, 1e9, NAN, &lo)) != ANNEAL_OK ||
        (s = get_num(path, "rope_scaling.", rs, "high_freq_factor", 0.0, 1e9, NAN, &hi)) != ANNEAL_OK ||
        (s = get_int(path, rs, "original_max_position_embeddings", true, 0, &omp)) != ANNEAL_OK)
        return s;
    if (isnan(lo) || isnan(hi))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: llama3 \"rope_scaling\" needs low_freq_factor and high_freq_factor",
                                path);
    if (!(hi > lo))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: rope_scaling.high_freq_factor %g must exceed low_freq_factor %g",
                                path, hi, lo);
    r->low_freq_factor = (float)lo;
    r->high_freq_factor = (float)hi;
    r->original_max_pos = omp;
    return ANNEAL_OK;
}

/* Refuses a sliding-window attention that changes anything at n_ctx positions. */
static anneal_status check_sliding_window(const char *path, const cJSON *j, const char *type, int n_ctx) {
    bool use = true;
    anneal_status s;
    if (!strcmp(type, "qwen2") && (s = get_bool(path, j, "use_sliding_window", false, &use)) != ANNEAL_OK) return s;
    const cJSON *w = field(j, "sliding_window");
    if (!use || !w) return ANNEAL_OK;
    int win = 0;
    if ((s = get_int(path, j, "sliding_window", true, 0, &win)) != ANNEAL_OK) return s;
    if (win < n_ctx)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: sliding_window %d is in effect (below max_position_embeddings %d): anneal's "
                                "attention is full causal",
                                path, win, n_ctx);
    return ANNEAL_OK;
}

/* Checks the parsed config object and fills cfg. */
static anneal_status parse_hf_config(const char *path, const cJSON *j, anneal_model_config *cfg) {
    if (!cJSON_IsObject(j)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object", path);
    const cJSON *mt = field(j, "model_type");
    if (!mt || !cJSON_IsString(mt)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: missing \"model_type\"", path);
    const char *type = mt->valuestring;
    if (strcmp(type, "llama") && strcmp(type, "mistral") && strcmp(type, "qwen2"))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: model_type \"%s\" is not of the Llama family (llama, mistral, qwen2)", path, type);
    anneal_model_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.arch, sizeof c.arch, "llama");
    snprintf(c.hf_model_type, sizeof c.hf_model_type, "%s", type);
    anneal_status s;
    if ((s = get_int(path, j, "num_hidden_layers", true, 0, &c.n_layer)) != ANNEAL_OK ||
        (s = get_int(path, j, "num_attention_heads", true, 0, &c.n_head)) != ANNEAL_OK ||
        (s = get_int(path, j, "hidden_size", true, 0, &c.n_embd)) != ANNEAL_OK ||
        (s = get_int(path, j, "intermediate_size", true, 0, &c.n_ff)) != ANNEAL_OK ||
        (s = get_int(path, j, "vocab_size", true, 0, &c.vocab_size)) != ANNEAL_OK)
        return s;
    /* transformers' defaults where a key may be absent */
    bool mistral = !strcmp(type, "mistral"), qwen2 = !strcmp(type, "qwen2");
    int def_ctx = mistral ? 4096 * 32 : qwen2 ? 32768 : 2048;
    if ((s = get_int(path, j, "num_key_value_heads", false, mistral ? 8 : c.n_head, &c.n_kv_head)) != ANNEAL_OK ||
        (s = get_int(path, j, "max_position_embeddings", false, def_ctx, &c.n_ctx)) != ANNEAL_OK)
        return s;
    if (c.n_embd % c.n_head)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: hidden_size %d is not divisible by num_attention_heads %d", path,
                                c.n_embd, c.n_head);
    if (c.n_head % c.n_kv_head)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d", path,
                                c.n_head, c.n_kv_head);
    const cJSON *hd = field(j, "head_dim");
    if (hd && !(cJSON_IsNumber(hd) && hd->valuedouble == (double)(c.n_embd / c.n_head)))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: head_dim other than hidden_size / num_attention_heads (%d) is not supported", path,
                                c.n_embd / c.n_head);
    static const char *const act_keys[] = {"hidden_act", "hidden_activation"};
    for (int i = 0; i < 2; i++) {
        const cJSON *act = field(j, act_keys[i]);
        if (act && !cJSON_IsString(act))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" must be a string", path, act_keys[i]);
        if (act && strcmp(act->valuestring, "silu"))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: %s \"%s\" is not supported (silu)", path, act_keys[i],
                                    act->valuestring);
    }
    bool attn_bias = false, mlp_bias = false;
    if ((s = get_bool(path, j, "attention_bias", false, &attn_bias)) != ANNEAL_OK ||
        (s = get_bool(path, j, "mlp_bias", false, &mlp_bias)) != ANNEAL_OK ||
        (s = get_bool(path, j, "tie_word_embeddings", false, &c.tie_embeddings)) != ANNEAL_OK)
        return s;
    if (mlp_bias) return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: mlp_bias true is not supported", path);
    if (attn_bias && !strcmp(type, "mistral"))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: attention_bias true is not supported for mistral", path);
    if (qwen2) {
        if (attn_bias)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: attention_bias true is not supported for qwen2 (it has q/k/v biases only)", path);
        c.qkv_bias = true; /* Qwen2Attention: q/k/v with bias, o_proj without */
    } else {
        c.qkv_bias = c.out_bias = attn_bias; /* LlamaAttention: all four or none */
    }
    if ((s = check_sliding_window(path, j, type, c.n_ctx)) != ANNEAL_OK) return s;
    double eps, theta, adrop;
    if ((s = get_num(path, "", j, "rms_norm_eps", 0.0, 1.0, 1e-6, &eps)) != ANNEAL_OK ||
        (s = get_num(path, "", j, "rope_theta", 0.0, 1e30, 10000.0, &theta)) != ANNEAL_OK ||
        (s = get_num(path, "", j, "attention_dropout", -1e-30, 1.0, 0.0, &adrop)) != ANNEAL_OK)
        return s;
    c.norm_eps = (float)eps;
    c.rope_theta = (float)theta;
    c.rope.theta = c.rope_theta;
    if ((s = parse_rope_scaling(path, j, &c.rope)) != ANNEAL_OK) return s;
    c.recompute = ANNEAL_RECOMPUTE_NONE;
    *cfg = c; /* the registry checks it with the architecture's config_check */
    return ANNEAL_OK;
}

anneal_status anneal_llama_config_from_hf(const char *json, const char *source, anneal_model_config *out) {
    if (!json || !out) return anneal_set_error(ANNEAL_ERR_ARG, "llama config: NULL argument");
    if (!source) source = "config.json";
    cJSON *j = NULL;
    if (anneal_json_parse(json, strlen(json), source, &j) != ANNEAL_OK) return anneal_last_status();
    anneal_status r = parse_hf_config(source, j, out);
    cJSON_Delete(j);
    return r;
}

/* Shortest decimal text that reads back as the same float. */
static void fmt_float(char *buf, size_t n, float v) {
    if (v == floorf(v) && fabsf(v) < 1e15f) { /* 10000.0, as Python writes it */
        snprintf(buf, n, "%.1f", (double)v);
        return;
    }
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, n, "%.*g", p, (double)v);
        if ((float)strtod(buf, NULL) == v) break;
    }
    if (!strpbrk(buf, ".eEn")) { /* JSON floats as Python writes them: 10000.0 */
        size_t used = strlen(buf);
        snprintf(buf + used, n - used, ".0");
    }
}

/* Appends formatted text to *buf (grown with realloc); false on OOM. */
static bool append(char **buf, size_t *len, size_t *cap, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static bool append(char **buf, size_t *len, size_t *cap, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) return false;
    if (*len + (size_t)n + 1 > *cap) {
        size_t nc = (*cap ? *cap * 2 : 1024) + (size_t)n;
        char *b = realloc(*buf, nc);
        if (!b) return false;
        *buf = b;
        *cap = nc;
    }
    memcpy(*buf + *len, tmp, (size_t)n + 1);
    *len += (size_t)n;
    return true;
}

/* The keys transformers 4.39's save_pretrained writes for the model_type (sorted,
 * 2-space indent); linear rope scaling in the {"factor", "type"} form 4.39 reads,
 * llama3 in the newer {"rope_type", ...} form (transformers >= 4.43). */
char *anneal_llama_config_to_hf(const anneal_model_config *c) {
    if (!c) {
        anneal_set_error(ANNEAL_ERR_ARG, "llama config: NULL argument");
        return NULL;
    }
    const char *type = anneal_llama_hf_type(c);
    bool mistral = !strcmp(type, "mistral"), qwen2 = !strcmp(type, "qwen2");
    const char *archname = mistral ? "MistralForCausalLM" : qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM";
    char eps[32], theta[32], f[32], lo[32], hi[32];
    fmt_float(eps, sizeof eps, c->norm_eps);
    fmt_float(theta, sizeof theta, c->rope_theta);
    char *b = NULL;
    size_t len = 0, cap = 0;
    bool ok = append(&b, &len, &cap, "{\n  \"architectures\": [\n    \"%s\"\n  ],\n", archname);
    if (!mistral && !qwen2) ok = ok && append(&b, &len, &cap, "  \"attention_bias\": %s,\n", c->qkv_bias ? "true" : "false");
    ok = ok && append(&b, &len, &cap,
                      "  \"attention_dropout\": 0.0,\n"
                      "  \"hidden_act\": \"silu\",\n"
                      "  \"hidden_size\": %d,\n"
                      "  \"initializer_range\": 0.02,\n"
                      "  \"intermediate_size\": %d,\n"
                      "  \"max_position_embeddings\": %d,\n",
                      c->n_embd, c->n_ff, c->n_ctx);
    if (qwen2) ok = ok && append(&b, &len, &cap, "  \"max_window_layers\": %d,\n", c->n_layer);
    ok = ok && append(&b, &len, &cap,
                      "  \"model_type\": \"%s\",\n"
                      "  \"num_attention_heads\": %d,\n"
                      "  \"num_hidden_layers\": %d,\n"
                      "  \"num_key_value_heads\": %d,\n",
                      type, c->n_head, c->n_layer, c->n_kv_head ? c->n_kv_head : c->n_head);
    if (!mistral && !qwen2) ok = ok && append(&b, &len, &cap, "  \"pretraining_tp\": 1,\n");
    ok = ok && append(&b, &len, &cap, "  \"rms_norm_eps\": %s,\n", eps);
    const anneal_rope_desc *r = &c->rope;
    fmt_float(f, sizeof f, r->factor);
    if (r->scaling == ANNEAL_ROPE_SCALING_LINEAR) {
        ok = ok && append(&b, &len, &cap, "  \"rope_scaling\": {\n    \"factor\": %s,\n    \"type\": \"linear\"\n  },\n", f);
    } else if (r->scaling == ANNEAL_ROPE_SCALING_LLAMA3) {
        fmt_float(lo, sizeof lo, r->low_freq_factor);
        fmt_float(hi, sizeof hi, r->high_freq_factor);
        ok = ok && append(&b, &len, &cap,
                          "  \"rope_scaling\": {\n    \"factor\": %s,\n    \"high_freq_factor\": %s,\n"
                          "    \"low_freq_factor\": %s,\n    \"original_max_position_embeddings\": %lld,\n"
                          "    \"rope_type\": \"llama3\"\n  },\n",
                          f, hi, lo, (long long)r->original_max_pos);
    } else {
        ok = ok && append(&b, &len, &cap, "  \"rope_scaling\": null,\n");
    }
    ok = ok && append(&b, &len, &cap, "  \"rope_theta\": %s,\n", theta);
    if (mistral) ok = ok && append(&b, &len, &cap, "  \"sliding_window\": null,\n");
    if (qwen2) ok = ok && append(&b, &len, &cap, "  \"sliding_window\": %d,\n", c->n_ctx);
    ok = ok && append(&b, &len, &cap,
                      "  \"tie_word_embeddings\": %s,\n"
                      "  \"torch_dtype\": \"float32\",\n"
                      "  \"use_cache\": true,\n",
                      c->tie_embeddings ? "true" : "false");
    if (qwen2) ok = ok && append(&b, &len, &cap, "  \"use_sliding_window\": false,\n");
    ok = ok && append(&b, &len, &cap, "  \"vocab_size\": %d\n}\n", c->vocab_size);
    if (!ok) {
        free(b);
        anneal_set_error(ANNEAL_ERR_OOM, "llama config: out of memory");
        return NULL;
    }
    return b;
}

/* ----------------------------------------------------------------- weights */

/* True for "model.layers.<digits>.self_attn.rotary_emb.inv_freq", a buffer older
 * transformers versions saved (recomputed from the config, so ignored). */
static bool is_rotary_buffer(const char *key) {
    const char *pre = "model.layers.";
    if (strncmp(key, pre, strlen(pre)) != 0) return false;
    const char *p = key + strlen(pre);
    if (*p < '0' || *p > '9') return false;
    while (*p >= '0' && *p <= '9') p++;
    return strcmp(p, ".self_attn.rotary_emb.inv_freq") == 0;
}

/* Matches every tensor of src to m's parameters (seen[i] = the source name of
 * parameter i); *tied_head = a "lm_head.weight" of a tied model. Errors name the
 * unexpected and missing tensors. */
static anneal_status match_entries(const anneal_model *m, const anneal_tensor_source *src, const char **seen,
                                   const char **tied_head) {
    const anneal_params *ps = m->params;
    char unknown[1024] = "";
    int n_unknown = 0;
    *tied_head = NULL;
    for (int i = 0; i < src->n; i++) {
        const char *name = src->names[i];
        if (m->cfg.tie_embeddings && !strcmp(name, "lm_head.weight")) {
            *tied_head = name;
            continue;
        }
        if (is_rotary_buffer(name)) continue;
        const anneal_param *p = anneal_params_find(ps, name);
        if (!p) {
            anneal_hf_name_list_add(unknown, sizeof unknown, &n_unknown, name);
            continue;
        }
        seen[p - ps->items] = name;
    }
    if (n_unknown) {
        anneal_hf_name_list_finish(unknown, sizeof unknown, n_unknown);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %d tensor(s) that this %s model (n_layer %d%s%s) does not have: %s",
                                src->what, n_unknown, anneal_llama_hf_type(&m->cfg), m->cfg.n_layer,
                                m->cfg.qkv_bias ? ", q/k/v biases" : ", no q/k/v biases",
                                m->cfg.tie_embeddings ? ", tied lm head" : "", unknown);
    }
    return anneal_hf_check_missing(m, src, seen);
}

anneal_status anneal_llama_hf_import(anneal_model *m, const anneal_tensor_source *src) {
    if (!m || !src) return anneal_set_error(ANNEAL_ERR_ARG, "llama weights: NULL argument");
    const anneal_params *ps = m->params;
    const char **seen = calloc((size_t)ps->n + 1, sizeof *seen), *tied_head = NULL;
    if (!seen) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", src->what);
    anneal_status r = match_entries(m, src, seen, &tied_head);
    if (r == ANNEAL_OK && tied_head) {
        /* a tied model's lm_head.weight is the embedding (transformers ties them) */
        anneal_scope *sc = anneal_scope_open();
        bool same = false;
        r = anneal_hf_same_as_f32(src, tied_head, "model.embed_tokens.weight", &same);
        anneal_scope_close(sc);
        if (r == ANNEAL_OK && !same)
            r = anneal_set_error(ANNEAL_ERR_FORMAT,
                                 "%s: lm_head.weight differs from model.embed_tokens.weight but the config ties them "
                                 "(tie_word_embeddings)",
                                 src->what);
    }
    if (r == ANNEAL_OK) r = anneal_hf_load_matched(m, src, seen);
    free(seen);
    return r;
}

anneal_status anneal_llama_hf_export(const anneal_model *m, const anneal_tensor_sink *sink) {
    if (!m || !sink) return anneal_set_error(ANNEAL_ERR_ARG, "llama export: NULL argument");
    return anneal_hf_export_params(m, sink);
}
