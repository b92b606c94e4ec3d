/* Reading checkpoints: resolving a run or checkpoint directory, validating state.json
 * and the sizes and FNV-1a checksums of the files it lists, checking the tensors
 * against the model (and optimizer) before anything is written, then restoring
 * parameters, optimizer state and the train state. Layout: docs/FORMATS.md. */
#include "io/checkpoint_internal.h"
#include "anneal/parse.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "anneal/io.h"
#include "anneal/peft.h"

/* ------------------------------------------------------------------ resolve */

/* True when dir/state.json is a regular file (a checkpoint is complete once its
 * directory has its final name, and state.json is written last). */
static bool has_state(const char *dir) {
    char p[4096];
    struct stat sb;
    if ((size_t)snprintf(p, sizeof p, "%s/state.json", dir) >= sizeof p) return false;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Copies "<dir>/<name>" (or dir alone when name is NULL) into out. */
static anneal_status put_path(char *out, size_t out_len, const char *dir, const char *name) {
    int n = name ? snprintf(out, out_len, "%s/%s", dir, name) : snprintf(out, out_len, "%s", dir);
    if (n < 0 || (size_t)n >= out_len)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path longer than the %zu-byte buffer", dir, out_len);
    return ANNEAL_OK;
}

/* Highest-step "ckpt_*" directory of run_dir holding a state.json, or -1. */
static int64_t newest_complete(const char *run_dir) {
    DIR *d = opendir(run_dir);
    if (!d) return -1;
    int64_t best = -1;
    char p[4096];
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t s = anneal_ckpt_parse_dir_name(e->d_name);
        if (s <= best) continue;
        if ((size_t)snprintf(p, sizeof p, "%s/%s", run_dir, e->d_name) < sizeof p && has_state(p)) best = s;
    }
    closedir(d);
    return best;
}

anneal_status anneal_checkpoint_resolve(const char *path, char *out, size_t out_len) {
    if (!path || !*path || !out || !out_len) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: empty path");
    struct stat sb;
    if (stat(path, &sb) != 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: %s", path, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: not a checkpoint or run directory", path);
    if (has_state(path)) return put_path(out, out_len, path, NULL);
    char latest[4096];
    if ((size_t)snprintf(latest, sizeof latest, "%s/latest", path) >= sizeof latest)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", path);
    char *txt = NULL;
    if (stat(latest, &sb) == 0) {
        anneal_status r = anneal_ckpt_read_file(latest, 4096, &txt, NULL);
        if (r != ANNEAL_OK) return r;
        size_t n = strlen(txt);
        while (n && (txt[n - 1] == '\n' || txt[n - 1] == '\r' || txt[n - 1] == ' ')) txt[--n] = '\0';
        if (anneal_ckpt_parse_dir_name(txt) < 0) {
            free(txt);
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: does not name a ckpt_<step> directory", latest);
        }
        char dir[4096];
        bool ok = (size_t)snprintf(dir, sizeof dir, "%s/%s", path, txt) < sizeof dir && has_state(dir);
        if (ok) {
            anneal_status r2 = put_path(out, out_len, path, txt);
            free(txt);
            return r2;
        }
        free(txt);
        /* Dangling (a crash while replacing a same-step checkpoint, or deleted by
         * hand): fall back to the newest complete checkpoint below. */
    }
    int64_t best = newest_complete(path);
    if (best < 0)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: no checkpoint here (no usable 'latest' and no ckpt_* directory "
                                "with a state.json)", path);
    char name[64];
    anneal_ckpt_dir_name(best, name, sizeof name);
    return put_path(out, out_len, path, name);
}

/* ---------------------------------------------------------------- state.json */

/* Non-negative integer field key of obj (JSON number or decimal string). */
static anneal_status get_u64(const char *file, const cJSON *obj, const char *key, uint64_t max, uint64_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || !anneal_ckpt_json_get_u64(v, out) || *out > max)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" is missing or not a non-negative integer", file, key);
    return ANNEAL_OK;
}

/* Hex string (1..16 digits) field. */
static anneal_status get_hex(const char *file, const cJSON *obj, const char *key, uint64_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    const char *s = cJSON_IsString(v) ? v->valuestring : NULL;
    size_t n = s ? strlen(s) : 0;
    bool ok = n >= 1 && n <= 16 && strspn(s, "0123456789abcdefABCDEF") == n;
    if (!ok) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" is missing or not a hex string", file, key);
    *out = strtoull(s, NULL, 16);
    return ANNEAL_OK;
}

/* Object field (may not be absent). */
static const cJSON *get_obj(const char *file, const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsObject(v)) anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%s\" is missing or not an object", file, key);
    return cJSON_IsObject(v) ? v : NULL;
}

/* The train state stored in state.json. */
static anneal_status parse_train_state(const char *file, const cJSON *j, anneal_train_state *st) {
    uint64_t step, tokens, skipped;
    anneal_status r;
    if ((r = get_u64(file, j, "step", INT64_MAX, &step)) || (r = get_u64(file, j, "tokens", INT64_MAX, &tokens)) ||
        (r = get_u64(file, j, "skipped_steps", INT64_MAX, &skipped)) ||
        (r = get_hex(file, j, "tokenizer_fingerprint", &st->tokenizer_fingerprint)))
        return r;
    const cJSON *rng = get_obj(file, j, "rng"), *cur = get_obj(file, j, "cursor");
    if (!rng || !cur) return anneal_last_status();
    if ((r = get_u64(file, rng, "seed", UINT64_MAX, &st->rng.seed)) ||
        (r = get_u64(file, rng, "offset", UINT64_MAX, &st->rng.offset)) ||
        (r = get_u64(file, cur, "epoch", UINT64_MAX, &st->cursor.epoch)) ||
        (r = get_u64(file, cur, "index", UINT64_MAX, &st->cursor.index)) ||
        (r = get_u64(file, cur, "step", UINT64_MAX, &st->cursor.step)))
        return r;
    const cJSON *bv = cJSON_GetObjectItemCaseSensitive(j, "best_val_loss");
    if (cJSON_IsNumber(bv)) st->best_val_loss = bv->valuedouble;
    else if (!bv || cJSON_IsNull(bv)) st->best_val_loss = NAN;
    else return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"best_val_loss\" must be a number or null", file);
    st->step = (int64_t)step;
    st->tokens = (int64_t)tokens;
    st->skipped_steps = (int64_t)skipped;
    /* mixed precision: absent in checkpoints written before it (fp32, no scaler state) */
    st->dtype = ANNEAL_F32;
    st->loss_scale = 0;
    st->loss_scale_growth_tracker = st->overflow_steps = 0;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(j, "dtype");
    if (dt && !(cJSON_IsString(dt) && anneal_dtype_parse(dt->valuestring, &st->dtype) &&
                (st->dtype == ANNEAL_F32 || st->dtype == ANNEAL_BF16 || st->dtype == ANNEAL_F16)))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"dtype\" must be \"fp32\", \"bf16\" or \"fp16\"", file);
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(j, "loss_scaler");
    if (ls) {
        uint64_t tracker, overflow;
        if (!cJSON_IsObject(ls))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"loss_scaler\" is not an object", file);
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(ls, "scale");
        double scale = cJSON_IsNumber(sc) ? sc->valuedouble : -1;
        if (!(scale >= 0) || !isfinite((float)scale))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"loss_scaler.scale\" is missing or not a finite number >= 0",
                                    file);
        if ((r = get_u64(file, ls, "growth_tracker", INT64_MAX, &tracker)) ||
            (r = get_u64(file, ls, "overflow_steps", INT64_MAX, &overflow)))
            return r;
        st->loss_scale = (float)scale;
        st->loss_scale_growth_tracker = (int64_t)tracker;
        st->overflow_steps = (int64_t)overflow;
    }
    /* LoRA: the base the adapters belong to */
    st->lora_base_fingerprint = 0;
    st->lora_base[0] = '\0';
    const cJSON *lora = cJSON_GetObjectItemCaseSensitive(j, "lora");
    if (lora) {
        const cJSON *base = cJSON_GetObjectItemCaseSensitive(lora, "base");
        if (!cJSON_IsObject(lora) || !cJSON_IsString(base) || strlen(base->valuestring) >= sizeof st->lora_base)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"lora\" must be an object with a \"base\" path", file);
        if ((r = get_hex(file, lora, "base_fingerprint", &st->lora_base_fingerprint)) != ANNEAL_OK) return r;
        if (!st->lora_base_fingerprint)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"lora.base_fingerprint\" is zero", file);
        snprintf(st->lora_base, sizeof st->lora_base, "%s", base->valuestring);
    }
    return ANNEAL_OK;
}

/* Checks one "files" entry: the file exists with the recorded size and checksum. */
static anneal_status verify_file(const char *dir, const char *state_path, const cJSON *f) {
    const char *name = f->string;
    if (!name || !*name || strchr(name, '/') || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: bad file name \"%s\" in \"files\"", state_path, name ? name : "");
    uint64_t want_bytes, want_hash, bytes, hash;
    anneal_status r;
    if (!cJSON_IsObject(f) || (r = get_u64(state_path, f, "bytes", UINT64_MAX, &want_bytes)) ||
        (r = get_hex(state_path, f, "fnv1a64", &want_hash)))
        return cJSON_IsObject(f) ? anneal_last_status()
                                 : anneal_set_error(ANNEAL_ERR_FORMAT, "%s: files.%s is not an object", state_path, name);
    char p[4096];
    if ((size_t)snprintf(p, sizeof p, "%s/%s", dir, name) >= sizeof p)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    struct stat sb;
    if (stat(p, &sb) != 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: missing (listed in state.json): incomplete or corrupt checkpoint", p);
    if ((uint64_t)sb.st_size != want_bytes)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %lld bytes, state.json records %" PRIu64 ": truncated or corrupt",
                                p, (long long)sb.st_size, want_bytes);
    if ((r = anneal_ckpt_hash_file(p, &bytes, &hash)) != ANNEAL_OK) return r;
    if (bytes != want_bytes || hash != want_hash)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: checksum mismatch (fnv1a64 %016" PRIx64 ", state.json records %016" PRIx64
                                "): corrupt", p, hash, want_hash);
    return ANNEAL_OK;
}

/* Reads dir/state.json, checks its format, version and fields and every listed
 * file. *out is the parsed document (caller deletes); *ts its train state. */
static anneal_status open_checkpoint(const char *dir, cJSON **out, anneal_train_state *ts) {
    *out = NULL;
    if (!dir || !*dir) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: empty path");
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/state.json", dir) >= sizeof path)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    char *txt = NULL;
    anneal_status r = anneal_ckpt_read_file(path, 64u << 20, &txt, NULL);
    if (r != ANNEAL_OK) return r;
    cJSON *j = NULL;
    r = anneal_json_parse(txt, strlen(txt), path, &j);
    free(txt);
    if (r != ANNEAL_OK) return anneal_last_status();
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a valid JSON object (corrupt checkpoint)", path);
    }
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(j, "format");
    uint64_t version = 0;
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "anneal-checkpoint") != 0)
        r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"format\" is not \"anneal-checkpoint\"", path);
    else if ((r = get_u64(path, j, "format_version", UINT32_MAX, &version)) == ANNEAL_OK &&
             (version < 1 || version > ANNEAL_CKPT_FORMAT_VERSION))
        r = anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: format_version %" PRIu64 " (this anneal reads 1 to %d)", path,
                             version, ANNEAL_CKPT_FORMAT_VERSION);
    anneal_train_state unused;
    if (r == ANNEAL_OK) r = parse_train_state(path, j, ts ? ts : &unused);
    const cJSON *files = r == ANNEAL_OK ? get_obj(path, j, "files") : NULL;
    if (r == ANNEAL_OK && !files) r = anneal_last_status();
    static const char *const required[] = {"model.safetensors", "config.json"};
    static const char *const lora_required[] = {"adapter_model.safetensors", "config.json", "adapter_config.json"};
    bool lora = cJSON_GetObjectItemCaseSensitive(j, "lora") != NULL;
    for (int i = 0; r == ANNEAL_OK && i < (lora ? 3 : 2); i++)
        if (lora && !cJSON_GetObjectItemCaseSensitive(files, lora_required[i]))
            r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"files\" does not list %s", path, lora_required[i]);
        else if (!lora && !cJSON_GetObjectItemCaseSensitive(files, required[i]))
            r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"files\" does not list %s", path, required[i]);
    const cJSON *f;
    if (r == ANNEAL_OK) cJSON_ArrayForEach(f, files) {
            if ((r = verify_file(dir, path, f)) != ANNEAL_OK) break;
        }
    if (r != ANNEAL_OK) {
        cJSON_Delete(j);
        return r;
    }
    *out = j;
    return ANNEAL_OK;
}

/* config.json, plus the anneal-only fields of state.json "model". */
static anneal_status model_config(const char *dir, const cJSON *state, anneal_model_config *cfg) {
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/config.json", dir) >= sizeof path)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    anneal_status r = anneal_model_config_from_hf_file(path, cfg);
    if (r != ANNEAL_OK) return r;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(state, "model");
    const cJSON *rc = cJSON_GetObjectItemCaseSensitive(model, "recompute");
    /* "none" | "attn" | "block"; older checkpoints wrote true (block) or false */
    cfg->recompute = cJSON_IsTrue(rc) ? ANNEAL_RECOMPUTE_BLOCK : ANNEAL_RECOMPUTE_NONE;
    if (cJSON_IsString(rc) && !anneal_recompute_parse(rc->valuestring, &cfg->recompute))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: model.recompute '%s' is not none, attn or block", dir,
                                rc->valuestring);
    return ANNEAL_OK;
}

anneal_status anneal_checkpoint_read_config(const char *ckpt_dir, anneal_model_config *model_cfg, char **config_json) {
    if (config_json) *config_json = NULL;
    cJSON *j = NULL;
    anneal_status r = open_checkpoint(ckpt_dir, &j, NULL);
    if (r != ANNEAL_OK) return r;
    if (model_cfg) r = model_config(ckpt_dir, j, model_cfg);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(j, "config");
    if (r == ANNEAL_OK && c && !cJSON_IsNull(c) && !cJSON_IsObject(c))
        r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s/state.json: \"config\" is not an object", ckpt_dir);
    if (r == ANNEAL_OK && config_json && cJSON_IsObject(c) && !(*config_json = cJSON_PrintUnformatted(c)))
        r = anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    cJSON_Delete(j);
    return r;
}

/* -------------------------------------------------------------------- load */

/* "(a, b)" of an entry's shape. */
static const char *entry_shape(const anneal_st_entry *e, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "(");
    for (int d = 0; d < e->ndim && used < n; d++)
        used += (size_t)snprintf(buf + used, n - used, d ? ", %lld" : "%lld", (long long)e->shape[d]);
    if (used < n) snprintf(buf + used, n - used, ")");
    return buf;
}

/* True when the entry has t's shape. */
static bool entry_fits(const anneal_st_entry *e, const anneal_tensor *t) {
    if (e->ndim != t->ndim) return false;
    for (int d = 0; d < e->ndim; d++)
        if (e->shape[d] != t->shape[d]) return false;
    return true;
}

/* The names and shapes m's architecture exports (what its model file holds). */
typedef struct manifest {
    int n, cap;
    char **names;
    int *ndim;
    int64_t (*shape)[ANNEAL_MAX_DIMS];
} manifest;

static anneal_status manifest_put(void *ctx, const char *name, const anneal_tensor *t) {
    manifest *f = ctx;
    if (f->n == f->cap) {
        int cap = f->cap ? 2 * f->cap : 64;
        char **nm = realloc(f->names, (size_t)cap * sizeof *nm);
        if (nm) f->names = nm;
        int *nd = nm ? realloc(f->ndim, (size_t)cap * sizeof *nd) : NULL;
        if (nd) f->ndim = nd;
        int64_t(*sh)[ANNEAL_MAX_DIMS] = nd ? realloc(f->shape, (size_t)cap * sizeof *sh) : NULL;
        if (!sh) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
        f->shape = sh;
        f->cap = cap;
    }
    if (!(f->names[f->n] = strdup(name))) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    f->ndim[f->n] = t->ndim;
    memcpy(f->shape[f->n], t->shape, sizeof f->shape[f->n]);
    f->n++;
    return ANNEAL_OK;
}

static void manifest_free(manifest *f) {
    for (int i = 0; i < f->n; i++) free(f->names[i]);
    free(f->names);
    free(f->ndim);
    free(f->shape);
}

/* True when the entry has the shape (ndim, shape). */
static bool entry_is(const anneal_st_entry *e, int ndim, const int64_t *shape) {
    if (e->ndim != ndim) return false;
    for (int d = 0; d < ndim; d++)
        if (e->shape[d] != shape[d]) return false;
    return true;
}

/* The file holds exactly what m's architecture exports: every tensor, as a float of
 * the model's shape, and nothing else; same architecture and heads. Errors name the
 * tensor and both shapes. */
static anneal_status check_model_file(const anneal_safetensors *st, const anneal_model *m,
                                      const anneal_model_config *ck) {
    char b1[128], b2[128], cfgs[256];
    snprintf(cfgs, sizeof cfgs, "checkpoint n_layer %d n_embd %d vocab %d n_ctx %d; model %d, %d, %d, %d", ck->n_layer,
             ck->n_embd, ck->vocab_size, ck->n_ctx, m->cfg.n_layer, m->cfg.n_embd, m->cfg.vocab_size, m->cfg.n_ctx);
    if (strcmp(ck->arch, m->cfg.arch))
        return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the checkpoint holds a %s model, the model is %s", st->path,
                                ck->arch, m->cfg.arch);
    if (ck->n_head != m->cfg.n_head)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the checkpoint has n_head %d, the model %d", st->path, ck->n_head,
                                m->cfg.n_head);
    if (ck->n_kv_head != m->cfg.n_kv_head)
        return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the checkpoint has n_kv_head %d, the model %d", st->path,
                                ck->n_kv_head, m->cfg.n_kv_head);
    manifest f = {0};
    anneal_tensor_sink sink = {.ctx = &f, .put = manifest_put};
    anneal_status r = anneal_model_hf_export(m, &sink);
    for (int i = 0; r == ANNEAL_OK && i < f.n; i++) {
        const anneal_st_entry *e = anneal_safetensors_find(st, f.names[i]);
        if (!e)
            r = anneal_set_error(ANNEAL_ERR_SHAPE, "%s: no tensor %s (%s)", st->path, f.names[i], cfgs);
        else if (!entry_is(e, f.ndim[i], f.shape[i]))
            r = anneal_set_error(ANNEAL_ERR_SHAPE, "%s: %s is %s in the checkpoint but %s in the model (%s)", st->path,
                                 f.names[i], entry_shape(e, b1, sizeof b1), anneal_dims_str(f.ndim[i], f.shape[i], b2, sizeof b2),
                                 cfgs);
        else if (!anneal_dtype_is_float(e->dtype))
            r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is %s, not a float dtype", st->path, f.names[i],
                                 anneal_dtype_name(e->dtype));
    }
    for (int i = 0; r == ANNEAL_OK && i < st->n_entries; i++) {
        bool known = false;
        for (int j = 0; j < f.n && !known; j++) known = !strcmp(f.names[j], st->entries[i].name);
        if (!known)
            r = anneal_set_error(ANNEAL_ERR_SHAPE, "%s: %s is in the checkpoint but not in the model (%s)", st->path,
                                 st->entries[i].name, cfgs);
    }
    manifest_free(&f);
    return r;
}

/* Parses a decimal int64 >= 0 from a metadata value. */
static bool parse_count(const char *s, int64_t *out) {
    if (!s || !*s) return false;
    int64_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > (INT64_MAX - 9) / 10) return false;
        v = v * 10 + (*s - '0');
    }
    *out = v;
    return true;
}

/* State tensor names the optimizer keeps per parameter. */
static int state_names(const anneal_optim_config *c, const char **names) {
    if (c->kind == ANNEAL_OPTIM_ADAMW) {
        names[0] = "exp_avg";
        names[1] = "exp_avg_sq";
        return 2;
    }
    if (c->momentum != 0) {
        names[0] = "momentum";
        return 1;
    }
    return 0;
}

/* The optimizer file matches opt: same kind, a step count, and for every parameter
 * its step count and f32 state tensors of the parameter's shape. Fills steps[n]. */
static anneal_status check_optimizer_file(const anneal_safetensors *st, const anneal_model *m,
                                          const anneal_optimizer *opt, int64_t *steps, int64_t *step_count) {
    const char *fmt = anneal_safetensors_meta(st, "format");
    if (!fmt || strcmp(fmt, "anneal-optimizer") != 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata \"format\" is not \"anneal-optimizer\"", st->path);
    anneal_optim_config oc = anneal_optimizer_config(opt);
    const char *want = oc.kind == ANNEAL_OPTIM_ADAMW ? "adamw" : "sgd";
    const char *meta = anneal_safetensors_meta(st, "optimizer");
    cJSON *cj = NULL;
    if (meta && anneal_json_parse(meta, strlen(meta), st->path, &cj) != ANNEAL_OK) return anneal_last_status();
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(cj, "kind");
    anneal_status r = ANNEAL_OK;
    if (!cJSON_IsString(kind))
        r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata \"optimizer\" lacks a \"kind\"", st->path);
    else if (strcmp(kind->valuestring, want) != 0)
        r = anneal_set_error(ANNEAL_ERR_ARG, "%s: the checkpoint's optimizer is %s, this run uses %s", st->path,
                             kind->valuestring, want);
    cJSON_Delete(cj);
    if (r != ANNEAL_OK) return r;
    if (!parse_count(anneal_safetensors_meta(st, "step_count"), step_count))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata \"step_count\" missing or invalid", st->path);
    const char *names[2];
    int k = state_names(&oc, names);
    char key[640], b1[128], b2[128];
    for (int i = 0; i < m->params->n; i++) {
        const anneal_param *p = &m->params->items[i];
        if (!p->trainable) continue; /* frozen (LoRA's base): no state */
        snprintf(key, sizeof key, "%s.step", p->name);
        if (!parse_count(anneal_safetensors_meta(st, key), &steps[i]))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata \"%s\" missing or invalid", st->path, key);
        for (int j = 0; j < k; j++) {
            snprintf(key, sizeof key, "%s.%s", p->name, names[j]);
            const anneal_st_entry *e = anneal_safetensors_find(st, key);
            if (!e) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no optimizer state %s", st->path, key);
            if (!entry_fits(e, p->tensor) || e->dtype != ANNEAL_F32)
                return anneal_set_error(ANNEAL_ERR_SHAPE, "%s: %s is %s %s, the parameter is f32 %s", st->path, key,
                                        anneal_dtype_name(e->dtype), entry_shape(e, b1, sizeof b1),
                                        anneal_shape_str(p->tensor, b2, sizeof b2));
        }
    }
    return ANNEAL_OK;
}

/* Copies the checked optimizer state into opt (creating its tensors first). */
static anneal_status restore_optimizer(const anneal_safetensors *st, const anneal_model *m, anneal_optimizer *opt,
                                       const int64_t *steps, int64_t step_count) {
    anneal_status r = anneal_optimizer_init_state(opt);
    anneal_optim_config oc = anneal_optimizer_config(opt);
    const char *names[2];
    int k = state_names(&oc, names);
    char key[640];
    for (int i = 0; r == ANNEAL_OK && i < m->params->n; i++) {
        if (!m->params->items[i].trainable) continue;
        if ((r = anneal_interrupt_check("loading the optimizer state")) != ANNEAL_OK) break;
        for (int j = 0; r == ANNEAL_OK && j < k; j++) {
            snprintf(key, sizeof key, "%s.%s", m->params->items[i].name, names[j]);
            anneal_tensor *dst = anneal_optimizer_state(opt, i, names[j]);
            if (!dst) return anneal_last_status();
            anneal_scope *sc = anneal_scope_open();
            anneal_tensor *src = anneal_safetensors_load(st, key, ANNEAL_F32);
            r = src ? anneal_copy_(dst, src) : anneal_last_status();
            anneal_scope_close(sc);
        }
        if (r == ANNEAL_OK) r = anneal_optimizer_set_param_steps(opt, i, steps[i]);
    }
    if (r == ANNEAL_OK) r = anneal_optimizer_set_step_count(opt, step_count);
    return r;
}

/* The model of a LoRA checkpoint without a trainer around it: the base weights from the
 * recorded path (a checkpoint, a Hugging Face directory or weights file), or the
 * architecture's init with the run's seed when there was none; refused when their
 * fingerprint is not the recorded one; then the adapters (adapter_config.json's settings,
 * the base frozen). */
static anneal_status load_lora_base(const char *ckpt_dir, const cJSON *j, const anneal_train_state *ts,
                                    anneal_model *m) {
    anneal_status r;
    const char *base = ts->lora_base;
    char ck[4096];
    struct stat sb;
    if (!base[0]) {
        const cJSON *seed = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "config"), "seed");
        if (!cJSON_IsNumber(seed) || seed->valuedouble < 0)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: a LoRA checkpoint of a seeded base without the run's seed",
                                    ckpt_dir);
        r = anneal_model_init(m, (uint64_t)seed->valuedouble);
    } else if (stat(base, &sb) == 0 && S_ISDIR(sb.st_mode) &&
               anneal_checkpoint_resolve(base, ck, sizeof ck) == ANNEAL_OK) {
        anneal_train_state tmp;
        r = anneal_checkpoint_load(ck, m, NULL, &tmp);
    } else {
        anneal_clear_error(); /* not a checkpoint: a Hugging Face directory or weights file */
        r = anneal_model_load_hf_weights(m, base);
    }
    if (r != ANNEAL_OK)
        return anneal_set_error(r, "%s: its LoRA base %s: %s", ckpt_dir, base[0] ? base : "(seeded init)",
                                anneal_last_error());
    uint64_t fp = anneal_params_fingerprint(m->params, false);
    if (fp != ts->lora_base_fingerprint)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: the base weights of %s changed since the adapters were trained "
                                "(fingerprint %016" PRIx64 ", the checkpoint's %016" PRIx64 ")", ckpt_dir,
                                base[0] ? base : "the seeded init", fp, ts->lora_base_fingerprint);
    return anneal_peft_load(ckpt_dir, m->params, ANNEAL_F32);
}

anneal_status anneal_checkpoint_load(const char *ckpt_dir, anneal_model *m, anneal_optimizer *opt,
                                     anneal_train_state *st) {
    if (!m) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint load: NULL model");
    cJSON *j = NULL;
    anneal_train_state ts;
    memset(&ts, 0, sizeof ts);
    anneal_status r = open_checkpoint(ckpt_dir, &j, &ts);
    if (r != ANNEAL_OK) return r;
    char model_path[4096], opt_path[4096];
    snprintf(model_path, sizeof model_path, "%s/model.safetensors", ckpt_dir);
    snprintf(opt_path, sizeof opt_path, "%s/optimizer.safetensors", ckpt_dir);
    anneal_model_config ck;
    anneal_safetensors *mst = NULL, *ost = NULL;
    int64_t *steps = calloc((size_t)m->params->n + 1, sizeof *steps), step_count = 0;
    if (!steps) r = anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    if (r == ANNEAL_OK) r = model_config(ckpt_dir, j, &ck);
    bool lora = ts.lora_base_fingerprint != 0;
    /* a LoRA checkpoint into a plain model (generate, eval, --init): base, then adapters */
    bool with_base = r == ANNEAL_OK && lora && !opt && anneal_lora_count(m->params) == 0;
    if (with_base) r = load_lora_base(ckpt_dir, j, &ts, m);
    if (r == ANNEAL_OK && !with_base && lora != (anneal_lora_count(m->params) > 0))
        r = lora ? anneal_set_error(ANNEAL_ERR_ARG, "%s: a LoRA checkpoint (adapters of the base %s): it loads into a model "
                                    "with the same adapters (resume it with --resume; to run or export the result, "
                                    "fold it into its base with anneal lora merge --base BASE --adapter %s --out DIR)",
                                    ckpt_dir, ts.lora_base[0] ? ts.lora_base : "of the architecture's seeded init",
                                    ckpt_dir)
                 : anneal_set_error(ANNEAL_ERR_ARG, "%s: not a LoRA checkpoint, but the model has LoRA adapters", ckpt_dir);
    if (r == ANNEAL_OK && !lora) r = anneal_safetensors_open(model_path, &mst);
    if (r == ANNEAL_OK && !lora) r = check_model_file(mst, m, &ck);
    if (r == ANNEAL_OK && lora && strcmp(ck.arch, m->cfg.arch))
        r = anneal_set_error(ANNEAL_ERR_SHAPE, "%s: the checkpoint holds adapters of a %s model, the model is %s",
                             ckpt_dir, ck.arch, m->cfg.arch);
    if (r == ANNEAL_OK && opt) {
        const cJSON *files = cJSON_GetObjectItemCaseSensitive(j, "files");
        if (!cJSON_GetObjectItemCaseSensitive(files, "optimizer.safetensors"))
            r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the checkpoint has no optimizer state (saved without one)",
                                 ckpt_dir);
        if (r == ANNEAL_OK) r = anneal_safetensors_open(opt_path, &ost);
        if (r == ANNEAL_OK) r = check_optimizer_file(ost, m, opt, steps, &step_count);
    }
    /* Everything checked: restore (the architecture reads its own export; LoRA: the
     * adapters, checked tensor by tensor before any is written, then the state) */
    anneal_st_source src;
    if (r == ANNEAL_OK && lora && !with_base) r = anneal_peft_load(ckpt_dir, m->params, ANNEAL_F32);
    if (r == ANNEAL_OK && !lora && (r = anneal_st_source_init(&src, mst)) == ANNEAL_OK) {
        /* parameters without storage (a --pp stage's others): only the held ones read */
        r = anneal_ckpt_held_only(m) ? anneal_ckpt_import_held(m, mst) : anneal_model_hf_import(m, &src.src);
        anneal_st_source_free(&src);
    }
    if (r == ANNEAL_OK && opt) r = restore_optimizer(ost, m, opt, steps, step_count);
    if (r == ANNEAL_OK && st) *st = ts;
    anneal_safetensors_close(mst);
    anneal_safetensors_close(ost);
    free(steps);
    cJSON_Delete(j);
    return r;
}

/* The optimizer file st's state of the parameters of ps (names as the model's) into opt
 * (an optimizer over ps), checked as anneal_checkpoint_load checks it. */
static anneal_status optimizer_part(const anneal_safetensors *st, anneal_params *ps, anneal_optimizer *opt) {
    anneal_model shell; /* check_optimizer_file and restore_optimizer read m->params only */
    memset(&shell, 0, sizeof shell);
    shell.params = ps;
    int64_t *steps = calloc((size_t)ps->n + 1, sizeof *steps), step_count = 0;
    if (!steps) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    anneal_status r = check_optimizer_file(st, &shell, opt, steps, &step_count);
    if (r == ANNEAL_OK) r = restore_optimizer(st, &shell, opt, steps, step_count);
    free(steps);
    return r;
}

anneal_status anneal_checkpoint_load_optimizer_part(const char *ckpt_dir, anneal_params *ps, anneal_optimizer *opt) {
    if (!ckpt_dir || !ps || !opt) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: NULL argument");
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/optimizer.safetensors", ckpt_dir) >= sizeof path)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", ckpt_dir);
    struct stat sb;
    if (stat(path, &sb) != 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the checkpoint has no optimizer state (saved without one): %s",
                                ckpt_dir, strerror(errno));
    anneal_safetensors *st = NULL;
    anneal_status r = anneal_safetensors_open(path, &st);
    if (r == ANNEAL_OK) r = optimizer_part(st, ps, opt);
    anneal_safetensors_close(st);
    return r;
}

anneal_status anneal_checkpoint_lora_base(const char *ckpt_dir, bool *is_lora, char *base, size_t n,
                                          uint64_t *fingerprint) {
    cJSON *j = NULL;
    anneal_train_state ts;
    memset(&ts, 0, sizeof ts);
    anneal_status r = open_checkpoint(ckpt_dir, &j, &ts);
    cJSON_Delete(j);
    if (r != ANNEAL_OK) return r;
    if (is_lora) *is_lora = ts.lora_base_fingerprint != 0;
    if (fingerprint) *fingerprint = ts.lora_base_fingerprint;
    if (base && n) {
        if (strlen(ts.lora_base) >= n) return anneal_set_error(ANNEAL_ERR_ARG, "%s: the base path is too long", ckpt_dir);
        snprintf(base, n, "%s", ts.lora_base);
    }
    return ANNEAL_OK;
}
