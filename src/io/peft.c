/* LoRA adapters as PEFT directories: adapter_config.json + adapter_model.safetensors,
 * written the way peft 0.10's save_pretrained writes them (keys
 * "base_model.model.<module>.lora_A.weight" / ".lora_B.weight", the adapter name
 * removed) and read back with every field and tensor checked. Layout in
 * docs/FORMATS.md "PEFT adapters". */
#include "anneal/peft.h"
#include "anneal/parse.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "anneal/fs.h"

#define PEFT_KEY_PREFIX "base_model.model."

void anneal_peft_config_free(anneal_peft_config *c) {
    if (!c) return;
    for (int i = 0; i < c->n_targets; i++) free(c->targets[i]);
    free(c->targets);
    c->targets = NULL;
    c->n_targets = 0;
}

/* "<dir>/<name>" into buf (ANNEAL_ERR_ARG when too long). */
static anneal_status path_in(char *buf, size_t n, const char *dir, const char *name) {
    int k = snprintf(buf, n, "%s/%s", dir, name);
    if (k < 0 || (size_t)k >= n) return anneal_set_error(ANNEAL_ERR_ARG, "peft: path %s/%s is too long", dir, name);
    return ANNEAL_OK;
}

/* Whole file as a NUL-terminated string (malloc'd), at most 16 MiB. */
static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n < 0 || n > (16L << 20) || fseek(f, 0, SEEK_SET) != 0) {
        anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a readable file of at most 16 MiB", path);
    } else if (!(buf = malloc((size_t)n + 1))) {
        anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    } else if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        anneal_set_error(ANNEAL_ERR_IO, "%s: read failed", path);
        free(buf);
        buf = NULL;
    } else {
        buf[n] = '\0';
    }
    fclose(f);
    return buf;
}

/* A field that must be absent, null, false, or an empty object/list/string. */
static bool unset(const cJSON *v) {
    return !v || cJSON_IsNull(v) || cJSON_IsFalse(v) || ((cJSON_IsObject(v) || cJSON_IsArray(v)) && !v->child) ||
           (cJSON_IsString(v) && !v->valuestring[0]);
}

static anneal_status parse_config(const char *path, const cJSON *j, anneal_peft_config *c) {
    if (!cJSON_IsObject(j)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object", path);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "peft_type");
    if (!cJSON_IsString(v))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: peft_type is missing or not a string", path);
    if (strcmp(v->valuestring, "LORA") != 0)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: peft_type \"%s\" is not supported (only \"LORA\")", path,
                                v->valuestring);
    v = cJSON_GetObjectItemCaseSensitive(j, "r");
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 1 || v->valuedouble > 65536)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: r must be an integer in [1, 65536]", path);
    c->rank = (int)v->valuedouble;
    v = cJSON_GetObjectItemCaseSensitive(j, "lora_alpha");
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0) || !isfinite(v->valuedouble))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: lora_alpha must be a positive number", path);
    c->alpha = (float)v->valuedouble;
    v = cJSON_GetObjectItemCaseSensitive(j, "lora_dropout");
    c->dropout = 0.0f;
    if (v && !cJSON_IsNull(v)) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble < 1))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: lora_dropout must be a number in [0, 1)", path);
        c->dropout = (float)v->valuedouble;
    }
    v = cJSON_GetObjectItemCaseSensitive(j, "fan_in_fan_out");
    if (v && !cJSON_IsBool(v)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: fan_in_fan_out must be a boolean", path);
    c->fan_in_fan_out = cJSON_IsTrue(v);
    v = cJSON_GetObjectItemCaseSensitive(j, "bias");
    if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && strcmp(v->valuestring, "none") == 0))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: bias must be \"none\" (trained biases are not supported)",
                                path);
    static const char *const unsupported[] = {"use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                                              "layers_to_transform", "modules_to_save", "megatron_config"};
    for (size_t i = 0; i < sizeof unsupported / sizeof *unsupported; i++)
        if (!unset(cJSON_GetObjectItemCaseSensitive(j, unsupported[i])))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: %s is not supported", path, unsupported[i]);
    v = cJSON_GetObjectItemCaseSensitive(j, "target_modules");
    if (cJSON_IsString(v))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: target_modules as a regular expression (\"%s\") is not "
                                "supported: give a list of module names", path, v->valuestring);
    int n = cJSON_GetArraySize(v);
    if (!cJSON_IsArray(v) || n == 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: target_modules must be a non-empty list of names", path);
    if (!(c->targets = calloc((size_t)n, sizeof *c->targets))) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsString(e) || !e->valuestring[0] || strchr(e->valuestring, '.'))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: target_modules holds something that is not a module name",
                                    path);
        if (!(c->targets[c->n_targets++] = strdup(e->valuestring)))
            return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    v = cJSON_GetObjectItemCaseSensitive(j, "base_model_name_or_path");
    if (cJSON_IsString(v)) snprintf(c->base_model, sizeof c->base_model, "%s", v->valuestring);
    return ANNEAL_OK;
}

anneal_status anneal_peft_read_config(const char *dir, anneal_peft_config *out) {
    if (!dir || !out) return anneal_set_error(ANNEAL_ERR_ARG, "peft: NULL directory or config");
    *out = (anneal_peft_config){0};
    char path[4096];
    anneal_status s = path_in(path, sizeof path, dir, "adapter_config.json");
    if (s != ANNEAL_OK) return s;
    char *text = read_text(path);
    if (!text) return anneal_last_status();
    cJSON *j = NULL;
    s = anneal_json_parse(text, strlen(text), path, &j);
    free(text);
    if (s != ANNEAL_OK) return s;
    s = parse_config(path, j, out);
    cJSON_Delete(j);
    if (s != ANNEAL_OK) anneal_peft_config_free(out);
    return s;
}

/* ------------------------------------------------------------------- save */

static anneal_status make_dir(const char *dir) {
    struct stat sb;
    if (mkdir(dir, 0777) == 0) return anneal_fsync_parent_dir(dir);
    if (errno == EEXIST && stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode)) return ANNEAL_OK;
    return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create the adapter directory: %s", dir, strerror(errno));
}

char *anneal_peft_config_json(const anneal_params_lora *lora, const char *base_model, bool fan_in_fan_out) {
    cJSON *j = cJSON_CreateObject(), *t = cJSON_CreateArray();
    if (!j || !t || !lora) {
        cJSON_Delete(j);
        cJSON_Delete(t);
        anneal_set_error(ANNEAL_ERR_OOM, "peft: out of memory");
        return NULL;
    }
    cJSON_AddStringToObject(j, "peft_type", "LORA");
    cJSON_AddStringToObject(j, "task_type", "CAUSAL_LM");
    if (base_model) cJSON_AddStringToObject(j, "base_model_name_or_path", base_model);
    else cJSON_AddNullToObject(j, "base_model_name_or_path");
    cJSON_AddNumberToObject(j, "r", lora->rank);
    cJSON_AddNumberToObject(j, "lora_alpha", lora->alpha);
    cJSON_AddNumberToObject(j, "lora_dropout", lora->dropout);
    const char *p = lora->targets;
    while (p && *p) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(n < 255 ? n : 255), p);
        cJSON_AddItemToArray(t, cJSON_CreateString(name));
        p += n + (comma != NULL);
    }
    cJSON_AddItemToObject(j, "target_modules", t);
    cJSON_AddBoolToObject(j, "fan_in_fan_out", fan_in_fan_out);
    cJSON_AddStringToObject(j, "bias", "none");
    cJSON_AddBoolToObject(j, "inference_mode", true);
    cJSON_AddTrueToObject(j, "init_lora_weights");
    cJSON_AddNullToObject(j, "modules_to_save");
    cJSON_AddBoolToObject(j, "use_rslora", false);
    cJSON_AddBoolToObject(j, "use_dora", false);
    char *txt = cJSON_Print(j);
    cJSON_Delete(j);
    if (!txt) anneal_set_error(ANNEAL_ERR_OOM, "peft: out of memory");
    return txt;
}

bool anneal_peft_fan_in_fan_out(const anneal_params *ps) {
    for (int i = 0; ps && i < ps->n_dense; i++)
        if (ps->dense[i].dense->lora && ps->dense[i].dense->layout == ANNEAL_WEIGHT_IN_OUT) return true;
    return false;
}

anneal_status anneal_peft_save(const char *dir, const anneal_params *ps, const char *base_model) {
    if (!dir || !ps) return anneal_set_error(ANNEAL_ERR_ARG, "peft save: NULL directory or parameter set");
    int n = anneal_lora_count(ps);
    if (n == 0) return anneal_set_error(ANNEAL_ERR_STATE, "peft save %s: the model has no adapters", dir);
    anneal_status s = make_dir(dir);
    if (s != ANNEAL_OK) return s;
    anneal_st_write_entry *e = calloc((size_t)(2 * n), sizeof *e);
    char **names = calloc((size_t)(2 * n), sizeof *names);
    float **bufs = calloc((size_t)(2 * n), sizeof *bufs);
    if (!e || !names || !bufs) s = anneal_set_error(ANNEAL_ERR_OOM, "peft save %s: out of memory", dir);
    int k = 0;
    for (int i = 0; i < ps->n_dense && s == ANNEAL_OK; i++) {
        const anneal_nn_dense *d = ps->dense[i].dense;
        if (!d->lora) continue;
        const anneal_tensor *t[2] = {d->lora->a, d->lora->b};
        for (int ab = 0; ab < 2 && s == ANNEAL_OK; ab++, k++) {
            if (asprintf(&names[k], PEFT_KEY_PREFIX "%s.lora_%c.weight", ps->dense[i].prefix, ab ? 'B' : 'A') < 0) {
                names[k] = NULL;
                s = anneal_set_error(ANNEAL_ERR_OOM, "peft save %s: out of memory", dir);
                break;
            }
            if (!(bufs[k] = malloc((size_t)anneal_numel(t[ab]) * sizeof(float)))) {
                s = anneal_set_error(ANNEAL_ERR_OOM, "peft save %s: out of memory", dir);
                break;
            }
            s = anneal_to_f32_buffer(t[ab], bufs[k]);
            e[k] = (anneal_st_write_entry){names[k], ANNEAL_F32, 2, t[ab]->shape, bufs[k]};
        }
    }
    char path[4096];
    if (s == ANNEAL_OK && (s = path_in(path, sizeof path, dir, "adapter_model.safetensors")) == ANNEAL_OK) {
        const char *mk[] = {"format"}, *mv[] = {"pt"};
        s = anneal_safetensors_write(path, k, e, 1, mk, mv);
    }
    if (s == ANNEAL_OK && (s = path_in(path, sizeof path, dir, "adapter_config.json")) == ANNEAL_OK) {
        char *txt = anneal_peft_config_json(&ps->lora, base_model, anneal_peft_fan_in_fan_out(ps));
        s = txt ? anneal_write_file_atomic(path, txt, strlen(txt)) : anneal_last_status();
        free(txt);
    }
    for (int i = 0; names && i < 2 * n; i++) free(names[i]);
    for (int i = 0; bufs && i < 2 * n; i++) free(bufs[i]);
    free(names);
    free(bufs);
    free(e);
    return s;
}

/* ------------------------------------------------------------------- load */

/* The config agrees with the adapters ps has already. */
static anneal_status check_same(const char *dir, const anneal_params *ps, const anneal_peft_config *c) {
    if (c->rank != ps->lora.rank || c->alpha != ps->lora.alpha)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: adapter r %d / lora_alpha %g differ from the model's adapters "
                                "(r %d, alpha %g)", dir, c->rank, (double)c->alpha, ps->lora.rank, (double)ps->lora.alpha);
    for (int i = 0; i < ps->n_dense; i++) {
        if (!ps->dense[i].dense->lora) continue;
        const char *last = strrchr(ps->dense[i].prefix, '.');
        last = last ? last + 1 : ps->dense[i].prefix;
        bool in = false;
        for (int t = 0; t < c->n_targets && !in; t++) in = strcmp(c->targets[t], last) == 0;
        if (!in)
            return anneal_set_error(ANNEAL_ERR_ARG, "%s: target_modules does not name %s, which the model adapts", dir,
                                    last);
    }
    return ANNEAL_OK;
}

/* Before any adapter is made from the config: the file holds adapters of rank r (every
 * "*.lora_A.weight" 2-D with r rows, every "*.lora_B.weight" 2-D with r columns, at least
 * one of each), so the rank the config asks for, and with it what the adapters
 * allocate, is bounded by the file itself (issue 16: sizes from a header are checked
 * before allocation). */
static anneal_status check_file_rank(const char *path, const anneal_safetensors *st, int r) {
    int na = 0, nb = 0;
    for (int i = 0; i < st->n_entries; i++) {
        const anneal_st_entry *e = &st->entries[i];
        size_t n = strlen(e->name);
        bool a = n >= 14 && !strcmp(e->name + n - 14, ".lora_A.weight");
        bool b = n >= 14 && !strcmp(e->name + n - 14, ".lora_B.weight");
        if (!a && !b) continue;
        na += a, nb += b;
        if (e->ndim != 2 || e->shape[a ? 0 : 1] != r)
            return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: tensor %s is not of rank r = %d (adapter_config.json): "
                                    "%d dims, %lld x %lld",
                                    path, e->name, r, e->ndim, (long long)e->shape[0],
                                    (long long)(e->ndim > 1 ? e->shape[1] : 0));
    }
    if (na == 0 || nb == 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no lora_A and lora_B adapter tensors in the file", path);
    return ANNEAL_OK;
}

anneal_status anneal_peft_load(const char *dir, anneal_params *ps, anneal_dtype base_dtype) {
    if (!dir || !ps) return anneal_set_error(ANNEAL_ERR_ARG, "peft load: NULL directory or parameter set");
    anneal_peft_config c;
    anneal_status s = anneal_peft_read_config(dir, &c);
    if (s != ANNEAL_OK) return s;
    char path[4096];
    anneal_safetensors *st = NULL;
    s = path_in(path, sizeof path, dir, "adapter_model.safetensors");
    if (s == ANNEAL_OK) s = anneal_safetensors_open(path, &st);
    if (s == ANNEAL_OK) {
        if (ps->lora.rank > 0) {
            s = check_same(dir, ps, &c);
        } else if ((s = check_file_rank(path, st, c.rank)) == ANNEAL_OK) {
            anneal_lora_config lc = {.rank = c.rank, .alpha = c.alpha, .dropout = c.dropout,
                                     .targets = (const char *const *)c.targets, .n_targets = c.n_targets,
                                     .base_dtype = base_dtype};
            s = anneal_lora_apply(ps, &lc); /* an unknown target: the error names it */
        }
    }
    /* every adapter tensor present with its shape, and nothing else in the file */
    int n_want = 0;
    for (int i = 0; s == ANNEAL_OK && i < ps->n_dense; i++) {
        const anneal_nn_dense *d = ps->dense[i].dense;
        if (!d->lora) continue;
        const anneal_tensor *t[2] = {d->lora->a, d->lora->b};
        for (int ab = 0; ab < 2 && s == ANNEAL_OK; ab++) {
            char key[600];
            snprintf(key, sizeof key, PEFT_KEY_PREFIX "%s.lora_%c.weight", ps->dense[i].prefix, ab ? 'B' : 'A');
            const anneal_st_entry *e = anneal_safetensors_find(st, key);
            n_want++;
            if (!e) {
                s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tensor %s is missing", path, key);
            } else if (!anneal_dtype_is_float(e->dtype) || e->ndim != 2 || e->shape[0] != t[ab]->shape[0] ||
                       e->shape[1] != t[ab]->shape[1]) {
                s = anneal_set_error(ANNEAL_ERR_SHAPE, "%s: tensor %s is %s (%d dims, %lld x %lld) but r = %d of "
                                     "adapter_config.json and the layer (in %lld, out %lld) make it a float (%lld, %lld)",
                                     path, key, anneal_dtype_name(e->dtype), e->ndim, (long long)e->shape[0],
                                     (long long)(e->ndim > 1 ? e->shape[1] : 0), c.rank, (long long)d->in,
                                     (long long)d->out, (long long)t[ab]->shape[0], (long long)t[ab]->shape[1]);
            }
        }
    }
    if (s == ANNEAL_OK && st->n_entries != n_want) {
        for (int i = 0; i < st->n_entries && s == ANNEAL_OK; i++) {
            const char *nm = st->entries[i].name;
            bool known = false;
            size_t np = strlen(PEFT_KEY_PREFIX);
            for (int j = 0; j < ps->n_dense && !known; j++) {
                if (!ps->dense[j].dense->lora || strncmp(nm, PEFT_KEY_PREFIX, np) != 0) continue;
                size_t lp = strlen(ps->dense[j].prefix);
                known = strncmp(nm + np, ps->dense[j].prefix, lp) == 0 &&
                        (!strcmp(nm + np + lp, ".lora_A.weight") || !strcmp(nm + np + lp, ".lora_B.weight"));
            }
            if (!known)
                s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tensor %s is not an adapter of a targeted layer of the model",
                                     path, nm);
        }
    }
    /* all checked: copy */
    for (int i = 0; s == ANNEAL_OK && i < ps->n_dense; i++) {
        const anneal_nn_dense *d = ps->dense[i].dense;
        if (!d->lora) continue;
        anneal_tensor *t[2] = {d->lora->a, d->lora->b};
        for (int ab = 0; ab < 2 && s == ANNEAL_OK; ab++) {
            char key[600];
            snprintf(key, sizeof key, PEFT_KEY_PREFIX "%s.lora_%c.weight", ps->dense[i].prefix, ab ? 'B' : 'A');
            anneal_scope *sc = anneal_scope_open();
            anneal_tensor *src = sc ? anneal_safetensors_load(st, key, ANNEAL_F32) : NULL;
            s = src ? anneal_copy_(t[ab], src) : anneal_last_status();
            if (sc) anneal_scope_close(sc);
        }
    }
    anneal_safetensors_close(st);
    anneal_peft_config_free(&c);
    return s;
}
