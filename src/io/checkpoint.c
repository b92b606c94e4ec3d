/* Writing checkpoints. A save is two halves: a snapshot (tensors copied to host
 * buffers, state and config copied) and a writer that turns a snapshot into
 * "<run_dir>/ckpt_<step>". The synchronous save runs both on the caller's thread;
 * the background checkpointer (checkpoint_async.c) runs the writer on its thread, so
 * both produce the same bytes.
 *
 * Crash safety: every file goes into "<run_dir>/.tmp_ckpt_<step>_<pid>" (each written
 * to a temporary, fsync'ed and renamed by core/fs.c), the directory is fsync'ed and
 * renamed to its final name, run_dir is fsync'ed, and only then is "latest" replaced
 * atomically. A crash before that rename leaves a stale temporary directory (removed
 * by the next save) and the previous checkpoint in place; a crash after it leaves a
 * complete new checkpoint. Layout: docs/FORMATS.md "Checkpoints". */
#include "anneal/tokenizer.h"
#include "anneal/parse.h"
#include "io/checkpoint_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "anneal/backend.h"
#include "anneal/io.h"
#include "anneal/fs.h"
#include "anneal/peft.h"

/* ------------------------------------------------------------------ snapshot */

/* Duplicates s (NULL on OOM). */
static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Makes b a buffer named `name` shaped like t, reusing its allocation when the size
 * is unchanged. */
static anneal_status buf_fit(anneal_ckpt_buf *b, const char *name, const anneal_tensor *t) {
    if (!b->name || strcmp(b->name, name) != 0) {
        char *n = dup_str(name);
        if (!n) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
        free(b->name);
        b->name = n;
    }
    b->ndim = t->ndim;
    memcpy(b->shape, t->shape, sizeof b->shape);
    size_t nbytes = (size_t)anneal_numel(t) * sizeof(float);
    if (!b->data || b->nbytes != nbytes) {
        free(b->data);
        b->data = malloc(nbytes ? nbytes : 1);
        b->nbytes = nbytes;
        if (!b->data)
            return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory for a %zu-byte snapshot of %s",
                                    nbytes, name);
    }
    return ANNEAL_OK;
}

/* Copies t into b->data as f32: one device-to-host copy for a contiguous f32 tensor
 * (the common case: the training stall is a memcpy), else a converting copy. */
static anneal_status copy_to_host(const anneal_tensor *t, anneal_ckpt_buf *b) {
    if (t->dtype == ANNEAL_F32 && anneal_is_contiguous(t)) {
        const anneal_backend *be = anneal_backend_get(t->device);
        if (!be) return anneal_last_status();
        anneal_status s = be->copy_to_host(be->ctx, b->data, anneal_data(t), b->nbytes);
        return s == ANNEAL_OK ? be->synchronize(be->ctx) : s;
    }
    return anneal_to_f32_buffer(t, b->data);
}

static void free_bufs(anneal_ckpt_buf *b, int n) {
    for (int i = 0; b && i < n; i++) {
        free(b[i].name);
        free(b[i].data);
    }
    free(b);
}

void anneal_ckpt_snapshot_release(anneal_ckpt_snapshot *s) {
    if (!s) return;
    free(s->config_json);
    free(s->lora_config_json);
    free_bufs(s->model, s->cap_model);
    free_bufs(s->state, s->n_params * s->n_state);
    free(s->param_steps);
    for (int i = 0; s->param_names && i < s->n_params; i++) free(s->param_names[i]);
    free(s->param_names);
    memset(s, 0, sizeof *s);
}

/* Resizes the optimizer arrays for n parameters and k state tensors each, keeping the
 * existing buffers when the counts are unchanged. */
static anneal_status snapshot_arrays(anneal_ckpt_snapshot *s, int n, int k) {
    if (s->state && s->n_params == n && s->n_state == k) return ANNEAL_OK;
    free_bufs(s->state, s->n_params * s->n_state);
    free(s->param_steps);
    for (int i = 0; s->param_names && i < s->n_params; i++) free(s->param_names[i]);
    free(s->param_names);
    s->state = calloc((size_t)n * (size_t)k + 1, sizeof *s->state);
    s->param_steps = calloc((size_t)n + 1, sizeof *s->param_steps);
    s->param_names = calloc((size_t)n + 1, sizeof *s->param_names);
    s->n_params = n;
    s->n_state = k;
    if (!s->state || !s->param_steps || !s->param_names) {
        free(s->state);
        free(s->param_steps);
        free(s->param_names);
        s->state = NULL;
        s->param_steps = NULL;
        s->param_names = NULL;
        s->n_params = s->n_state = 0;
        return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    }
    return ANNEAL_OK;
}

/* The sink hf_export writes a snapshot's model tensors through: buffer i (reused from
 * the last snapshot when it fits) gets the i-th tensor put. */
typedef struct snapshot_sink {
    anneal_ckpt_snapshot *s;
    int i;
} snapshot_sink;

static anneal_status snapshot_put(void *ctx, const char *name, const anneal_tensor *t) {
    snapshot_sink *k = ctx;
    anneal_ckpt_snapshot *s = k->s;
    if (k->i == s->cap_model) {
        int cap = s->cap_model ? 2 * s->cap_model : 64;
        anneal_ckpt_buf *b = realloc(s->model, (size_t)cap * sizeof *b);
        if (!b) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
        memset(b + s->cap_model, 0, (size_t)(cap - s->cap_model) * sizeof *b);
        s->model = b;
        s->cap_model = cap;
    }
    anneal_ckpt_buf *b = &s->model[k->i];
    anneal_status r = buf_fit(b, name, t);
    if (r == ANNEAL_OK) r = copy_to_host(t, b);
    if (r == ANNEAL_OK) s->n_model = ++k->i;
    return r;
}

/* Checks the plain fields of a train state. */
static anneal_status check_train_state(const anneal_train_state *st) {
    if (!st) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: NULL train state");
    if (st->step < 0 || st->tokens < 0 || st->skipped_steps < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: negative step (%lld), tokens (%lld) or skipped steps (%lld)",
                                (long long)st->step, (long long)st->tokens, (long long)st->skipped_steps);
    if (st->dtype != ANNEAL_F32 && st->dtype != ANNEAL_BF16 && st->dtype != ANNEAL_F16)
        return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: train dtype %s is not f32, bf16 or f16",
                                anneal_dtype_name(st->dtype));
    if (!(st->loss_scale >= 0) || !isfinite(st->loss_scale) || st->loss_scale_growth_tracker < 0 ||
        st->overflow_steps < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: bad loss scaler state (scale %g, tracker %lld, overflow "
                                "steps %lld)", (double)st->loss_scale, (long long)st->loss_scale_growth_tracker,
                                (long long)st->overflow_steps);
    return ANNEAL_OK;
}

anneal_status anneal_ckpt_snapshot_take(anneal_ckpt_snapshot *s, const anneal_model *m,
                                        const anneal_optimizer *opt, const anneal_train_state *st,
                                        const char *config_json) {
    if (!s || !m) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: NULL model");
    anneal_status r = anneal_params_require_float(m->params, "checkpoint");
    if (r == ANNEAL_OK) r = check_train_state(st);
    if (r != ANNEAL_OK) return r;
    free(s->config_json);
    s->config_json = NULL;
    if (config_json) {
        cJSON *c = NULL; /* nothing after the object, no duplicate keys */
        if (anneal_json_parse(config_json, strlen(config_json), "checkpoint: the trainer config", &c) != ANNEAL_OK) {
            char msg[512]; /* the caller's argument: ANNEAL_ERR_ARG */
            snprintf(msg, sizeof msg, "%s", anneal_last_error());
            anneal_clear_error();
            return anneal_set_error(ANNEAL_ERR_ARG, "%s", msg);
        }
        bool obj = cJSON_IsObject(c);
        cJSON_Delete(c);
        if (!obj) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: the trainer config is not a JSON object");
        if (!(s->config_json = dup_str(config_json))) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    }
    s->model_cfg = m->cfg;
    s->st = *st;
    /* the model file: what the architecture exports (GPT-2: every parameter, in order) */
    snapshot_sink sink_ctx = {s, 0};
    anneal_tensor_sink sink = {.ctx = &sink_ctx, .put = snapshot_put};
    s->n_model = 0;
    const anneal_params *ps = m->params;
    free(s->lora_config_json);
    s->lora_config_json = NULL;
    s->lora = anneal_lora_count(ps) > 0;
    char name[640];
    if (s->lora) {
        /* only what changes: the trainable parameters (the adapters) under PEFT's keys */
        s->lora_config_json = anneal_peft_config_json(&ps->lora, st->lora_base[0] ? st->lora_base : NULL,
                                                      anneal_peft_fan_in_fan_out(ps));
        if (!s->lora_config_json) return anneal_last_status();
        for (int i = 0; i < ps->n && r == ANNEAL_OK; i++) {
            if (!ps->items[i].trainable) continue;
            snprintf(name, sizeof name, ANNEAL_PEFT_KEY_PREFIX "%s", ps->items[i].name);
            r = snapshot_put(&sink_ctx, name, ps->items[i].tensor);
        }
    } else {
        r = anneal_model_hf_export(m, &sink);
    }
    if (r != ANNEAL_OK) return r;
    int k = 0, n_kept = 0;
    for (int i = 0; i < ps->n; i++) n_kept += ps->items[i].trainable || !s->lora;
    s->has_opt = opt != NULL;
    if (opt) {
        s->opt_cfg = anneal_optimizer_config(opt);
        s->opt_step_count = anneal_optimizer_step_count(opt);
        if (s->opt_cfg.kind == ANNEAL_OPTIM_ADAMW) {
            s->state_names[0] = "exp_avg";
            s->state_names[1] = "exp_avg_sq";
            k = 2;
        } else if (s->opt_cfg.momentum != 0) {
            s->state_names[0] = "momentum";
            k = 1;
        }
    }
    if ((r = snapshot_arrays(s, n_kept, k)) != ANNEAL_OK) return r;
    for (int i = 0, q = -1; i < ps->n; i++) {
        const anneal_param *p = &ps->items[i];
        if (s->lora && !p->trainable) continue; /* frozen: no state, not in the checkpoint */
        q++;
        if (!s->param_names[q] || strcmp(s->param_names[q], p->name)) {
            char *nm = dup_str(p->name);
            if (!nm) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
            free(s->param_names[q]);
            s->param_names[q] = nm;
        }
        s->param_steps[q] = 0;
        if (!opt) continue;
        if ((s->param_steps[q] = anneal_optimizer_param_steps(opt, i)) < 0) return anneal_last_status();
        for (int j = 0; j < k; j++) {
            anneal_ckpt_buf *b = &s->state[q * k + j];
            snprintf(name, sizeof name, "%s.%s", p->name, s->state_names[j]);
            if ((r = buf_fit(b, name, p->tensor)) != ANNEAL_OK) return r;
            anneal_tensor *t = anneal_optimizer_state(opt, i, s->state_names[j]);
            if (!t) { /* never updated: lazily-created state would start as zeros */
                memset(b->data, 0, b->nbytes);
                continue;
            }
            if (!anneal_same_shape(t, p->tensor)) {
                char b1[96], b2[96];
                return anneal_set_error(ANNEAL_ERR_SHAPE, "checkpoint: optimizer state %s has shape %s, parameter %s",
                                        name, anneal_shape_str(t, b1, sizeof b1), anneal_shape_str(p->tensor, b2, sizeof b2));
            }
            if ((r = copy_to_host(t, b)) != ANNEAL_OK) return r;
        }
    }
    return ANNEAL_OK;
}

/* -------------------------------------------------------------------- writer */

/* "<a>/<b>" (malloc'd) or NULL + ANNEAL_ERR_OOM. */
static char *join(const char *a, const char *b) {
    char *p = NULL;
    if (asprintf(&p, "%s/%s", a, b) < 0) {
        anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
        return NULL;
    }
    return p;
}

/* mkdir -p: creates dir and its missing parents (0777 & umask). */
static anneal_status make_dirs(const char *dir) {
    char *p = dup_str(dir);
    if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    anneal_status s = ANNEAL_OK;
    size_t n = strlen(p);
    for (size_t i = 1; i <= n && s == ANNEAL_OK; i++) {
        if (p[i] != '/' && p[i] != '\0') continue;
        char c = p[i];
        p[i] = '\0';
        struct stat sb;
        if (mkdir(p, 0777) != 0) {
            int e = errno;
            if (e != EEXIST)
                s = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create directory %s: %s", dir, p, strerror(e));
            else if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode))
                s = anneal_set_error(ANNEAL_ERR_IO, "%s: %s exists and is not a directory", dir, p);
        }
        p[i] = c;
    }
    free(p);
    return s;
}

/* Removes what a crashed or failed save left in run_dir: ".tmp_ckpt_*" and
 * ".trash_ckpt_*" directories and other processes' "latest.tmp.<pid>" files. */
static void remove_stale(const char *run_dir) {
    DIR *d = opendir(run_dir);
    if (!d) return;
    char own[64];
    snprintf(own, sizeof own, "latest.tmp.%ld", (long)getpid());
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        bool stale = strncmp(n, ".tmp_ckpt_", 10) == 0 || strncmp(n, ".trash_ckpt_", 12) == 0 ||
                     (strncmp(n, "latest.tmp.", 11) == 0 && strcmp(n, own) != 0);
        if (!stale) continue;
        char *p = join(run_dir, n);
        if (!p) {
            anneal_clear_error();
            break;
        }
        anneal_ckpt_remove_tree(p);
        free(p);
    }
    closedir(d);
}

/* Renames path to a unique ".trash_<name>_<pid>" in run_dir, then removes it, so a
 * crash mid-removal never leaves a half-deleted "ckpt_*". */
static void discard_dir(const char *run_dir, const char *name) {
    char *from = join(run_dir, name), *to = NULL;
    if (from && asprintf(&to, "%s/.trash_%s_%ld", run_dir, name, (long)getpid()) >= 0) {
        if (rename(from, to) == 0) anneal_ckpt_remove_tree(to);
        else anneal_ckpt_remove_tree(from);
    }
    free(from);
    free(to);
}

/* fsync of a directory itself (EINVAL/EROFS: file system cannot; not an error). */
static anneal_status fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open directory: %s", dir, strerror(errno));
    anneal_status s = ANNEAL_OK;
    if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS)
        s = anneal_set_error(ANNEAL_ERR_IO, "%s: fsync failed: %s", dir, strerror(errno));
    close(fd);
    return s;
}

/* model.safetensors: the exported tensors, f32, HF names, metadata {"format": "pt"}
 * (which transformers requires of a PyTorch safetensors file). */
static anneal_status write_model(const char *path, const anneal_ckpt_snapshot *s) {
    anneal_st_write_entry *e = calloc((size_t)s->n_model + 1, sizeof *e);
    if (!e) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; i < s->n_model; i++)
        e[i] = (anneal_st_write_entry){s->model[i].name, ANNEAL_F32, s->model[i].ndim,
                                       s->model[i].shape, s->model[i].data};
    const char *k[] = {"format"}, *v[] = {"pt"};
    anneal_status r = anneal_safetensors_write_fetch(path, s->n_model, e, 1, k, v, s->fetch, s->fetch_ctx);
    free(e);
    return r;
}

/* Adds item to o under key; false (item freed) when item is NULL or the add failed: a
 * key lost to a failed allocation must fail the write, not leave a state.json without
 * it that the checkpoint then calls complete (found by tests/fault). */
static bool put(cJSON *o, const char *key, cJSON *item) {
    if (!item) return false;
    if (!cJSON_AddItemToObject(o, key, item)) {
        cJSON_Delete(item);
        return false;
    }
    return true;
}

/* The optimizer config as compact JSON (malloc'd). */
static char *optim_config_json(const anneal_optim_config *c) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    bool ok = put(o, "kind", cJSON_CreateString(c->kind == ANNEAL_OPTIM_ADAMW ? "adamw" : "sgd")) &&
              put(o, "beta1", anneal_ckpt_json_double(c->beta1)) && put(o, "beta2", anneal_ckpt_json_double(c->beta2)) &&
              put(o, "eps", anneal_ckpt_json_double(c->eps)) &&
              put(o, "weight_decay", anneal_ckpt_json_double(c->weight_decay)) &&
              put(o, "momentum", anneal_ckpt_json_double(c->momentum)) &&
              put(o, "nesterov", cJSON_CreateBool(c->nesterov));
    char *txt = ok ? cJSON_PrintUnformatted(o) : NULL; /* NULL: the caller reports out of memory */
    cJSON_Delete(o);
    return txt;
}

/* optimizer.safetensors: "<param>.<state>" f32 tensors, and metadata "format",
 * "optimizer" (config JSON), "step_count" and "<param>.step" (per-parameter counts). */
static anneal_status write_optimizer(const char *path, const anneal_ckpt_snapshot *s) {
    int n = s->n_params, nt = n * s->n_state, nm = 3 + n;
    anneal_st_write_entry *e = calloc((size_t)nt + 1, sizeof *e);
    const char **keys = calloc((size_t)nm, sizeof *keys), **vals = calloc((size_t)nm, sizeof *vals);
    char **owned = calloc((size_t)(2 * n + 2), sizeof *owned);
    char *cfg = optim_config_json(&s->opt_cfg);
    anneal_status r = ANNEAL_OK;
    if (!e || !keys || !vals || !owned || !cfg) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; r == ANNEAL_OK && i < nt; i++)
        e[i] = (anneal_st_write_entry){s->state[i].name, ANNEAL_F32, s->state[i].ndim, s->state[i].shape,
                                       s->state[i].data};
    if (r == ANNEAL_OK) {
        keys[0] = "format", vals[0] = "anneal-optimizer";
        keys[1] = "optimizer", vals[1] = cfg;
        keys[2] = "step_count";
        if (asprintf(&owned[0], "%" PRId64, s->opt_step_count) < 0) owned[0] = NULL;
        vals[2] = owned[0];
        for (int i = 0; i < n; i++) {
            if (asprintf(&owned[1 + 2 * i], "%s.step", s->param_names[i]) < 0) owned[1 + 2 * i] = NULL;
            if (asprintf(&owned[2 + 2 * i], "%" PRId64, s->param_steps[i]) < 0) owned[2 + 2 * i] = NULL;
            keys[3 + i] = owned[1 + 2 * i];
            vals[3 + i] = owned[2 + 2 * i];
        }
        for (int i = 0; i < nm; i++)
            if (!keys[i] || !vals[i]) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    if (r == ANNEAL_OK) r = anneal_safetensors_write_fetch(path, nt, e, nm, keys, vals, s->fetch, s->fetch_ctx);
    for (int i = 0; owned && i < 2 * n + 1; i++) free(owned[i]);
    free(owned);
    free(keys);
    free(vals);
    free(e);
    free(cfg);
    return r;
}

/* Adds {"bytes": N, "fnv1a64": "hex"} of dir/name to files. */
static anneal_status add_file_entry(cJSON *files, const char *dir, const char *name) {
    char *p = join(dir, name);
    if (!p) return anneal_last_status();
    uint64_t bytes = 0, h = 0;
    anneal_status r = anneal_ckpt_hash_file(p, &bytes, &h);
    free(p);
    if (r != ANNEAL_OK) return r;
    char hex[17];
    snprintf(hex, sizeof hex, "%016" PRIx64, h);
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddItemToObject(files, name, o) || !cJSON_AddItemToObject(o, "bytes", anneal_ckpt_json_u64(bytes)) ||
        !cJSON_AddStringToObject(o, "fnv1a64", hex))
        return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    return ANNEAL_OK;
}

/* state.json text (malloc'd, formatted): see docs/FORMATS.md. */
static anneal_status build_state_json(const char *dir, const anneal_ckpt_snapshot *s, char **out) {
    const anneal_train_state *st = &s->st;
    const anneal_model_config *mc = &s->model_cfg;
    cJSON *j = cJSON_CreateObject(), *rng = cJSON_CreateObject(), *cur = cJSON_CreateObject(),
          *model = cJSON_CreateObject(), *files = cJSON_CreateObject();
    char hex[17];
    snprintf(hex, sizeof hex, "%016" PRIx64, st->tokenizer_fingerprint);
    bool ok = j && rng && cur && model && files;
    /* the parts are filled first, then attached to j in the file's key order; what is
     * not attached when something fails is freed on its own */
    bool has_rng = false, has_cur = false, has_model = false, has_files = false;
    ok = ok && put(rng, "seed", anneal_ckpt_json_u64(st->rng.seed)) &&
         put(rng, "offset", anneal_ckpt_json_u64(st->rng.offset)) &&
         put(cur, "epoch", anneal_ckpt_json_u64(st->cursor.epoch)) &&
         put(cur, "index", anneal_ckpt_json_u64(st->cursor.index)) &&
         put(cur, "step", anneal_ckpt_json_u64(st->cursor.step)) &&
         put(model, "n_layer", anneal_ckpt_json_u64((uint64_t)mc->n_layer)) &&
         put(model, "n_head", anneal_ckpt_json_u64((uint64_t)mc->n_head)) &&
         put(model, "n_embd", anneal_ckpt_json_u64((uint64_t)mc->n_embd)) &&
         put(model, "vocab_size", anneal_ckpt_json_u64((uint64_t)mc->vocab_size)) &&
         put(model, "n_ctx", anneal_ckpt_json_u64((uint64_t)mc->n_ctx)) &&
         put(model, "dropout", anneal_ckpt_json_float(mc->dropout)) &&
         put(model, "ln_eps", anneal_ckpt_json_float(mc->norm_eps)) &&
         put(model, "recompute", cJSON_CreateString(anneal_recompute_name(mc->recompute)));
    ok = ok && put(j, "format", cJSON_CreateString("anneal-checkpoint")) &&
         put(j, "format_version", anneal_ckpt_json_u64(ANNEAL_CKPT_FORMAT_VERSION)) &&
         put(j, "anneal_version", cJSON_CreateString(anneal_version())) &&
         put(j, "step", anneal_ckpt_json_u64((uint64_t)st->step)) &&
         put(j, "tokens", anneal_ckpt_json_u64((uint64_t)st->tokens));
    ok = has_rng = ok && cJSON_AddItemToObject(j, "rng", rng); /* j owns it only when added */
    ok = has_cur = ok && cJSON_AddItemToObject(j, "cursor", cur); /* j owns it only when added */
    ok = ok && put(j, "tokenizer_fingerprint", cJSON_CreateString(hex)) &&
         put(j, "skipped_steps", anneal_ckpt_json_u64((uint64_t)st->skipped_steps)) &&
         put(j, "best_val_loss", anneal_ckpt_json_double(st->best_val_loss)) &&
         put(j, "dtype", cJSON_CreateString(anneal_precision_name(st->dtype)));
    cJSON *ls = ok ? cJSON_AddObjectToObject(j, "loss_scaler") : NULL;
    ok = ok && ls && put(ls, "scale", anneal_ckpt_json_float(st->loss_scale)) &&
         put(ls, "growth_tracker", anneal_ckpt_json_u64((uint64_t)st->loss_scale_growth_tracker)) &&
         put(ls, "overflow_steps", anneal_ckpt_json_u64((uint64_t)st->overflow_steps));
    ok = has_model = ok && cJSON_AddItemToObject(j, "model", model); /* j owns it only when added */
    /* The trainer's config text, inserted verbatim (validated as an object when the
     * snapshot was taken). */
    ok = ok && put(j, "config", s->config_json ? cJSON_CreateRaw(s->config_json) : cJSON_CreateNull());
    if (ok && s->lora) { /* the base the adapters belong to */
        cJSON *lora = cJSON_AddObjectToObject(j, "lora");
        char fp[17];
        snprintf(fp, sizeof fp, "%016" PRIx64, st->lora_base_fingerprint);
        ok = lora && put(lora, "base", cJSON_CreateString(st->lora_base)) &&
             put(lora, "base_fingerprint", cJSON_CreateString(fp));
    }
    ok = has_files = ok && cJSON_AddItemToObject(j, "files", files); /* j owns it only when added */
    if (!ok) {
        if (!has_rng) cJSON_Delete(rng);
        if (!has_cur) cJSON_Delete(cur);
        if (!has_model) cJSON_Delete(model);
        if (!has_files) cJSON_Delete(files);
        files = NULL;
    }
    anneal_status r = ok ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    if (r == ANNEAL_OK) r = add_file_entry(files, dir, s->lora ? "adapter_model.safetensors" : "model.safetensors");
    if (r == ANNEAL_OK && s->lora) r = add_file_entry(files, dir, "adapter_config.json");
    if (r == ANNEAL_OK && s->has_opt) r = add_file_entry(files, dir, "optimizer.safetensors");
    if (r == ANNEAL_OK) r = add_file_entry(files, dir, "config.json");
    *out = NULL;
    if (r == ANNEAL_OK) {
        size_t len;
        char *txt = cJSON_Print(j);
        char *with_nl = txt ? malloc((len = strlen(txt)) + 2) : NULL;
        if (with_nl) {
            memcpy(with_nl, txt, len);
            memcpy(with_nl + len, "\n", 2);
        }
        free(txt);
        if (!with_nl) r = anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
        *out = with_nl;
    }
    cJSON_Delete(j);
    return r;
}

/* Writes every file of the checkpoint into dir (which exists and is empty). */
static anneal_status write_files(const char *dir, const anneal_ckpt_snapshot *s) {
    char *model = join(dir, s->lora ? "adapter_model.safetensors" : "model.safetensors"),
         *optim = join(dir, "optimizer.safetensors"),
         *cfg = join(dir, "config.json"), *state = join(dir, "state.json"), *txt = NULL;
    anneal_status r = model && optim && cfg && state ? ANNEAL_OK : anneal_last_status();
    if (r == ANNEAL_OK) r = write_model(model, s);
    if (r == ANNEAL_OK && s->lora) { /* with adapter_model.safetensors, a PEFT adapter directory */
        char *ac = join(dir, "adapter_config.json");
        r = ac ? anneal_write_file_atomic(ac, s->lora_config_json, strlen(s->lora_config_json)) : anneal_last_status();
        free(ac);
    }
    if (r == ANNEAL_OK && s->has_opt) r = write_optimizer(optim, s);
    if (r == ANNEAL_OK) {
        char *hf = anneal_model_config_to_hf_json(&s->model_cfg);
        r = hf ? anneal_write_file_atomic(cfg, hf, strlen(hf)) : anneal_last_status();
        free(hf);
    }
    if (r == ANNEAL_OK && s->tokenizer) r = anneal_tokenizer_save_hf(s->tokenizer, dir);
    if (r == ANNEAL_OK) r = build_state_json(dir, s, &txt);
    if (r == ANNEAL_OK) r = anneal_write_file_atomic(state, txt, strlen(txt));
    if (r == ANNEAL_OK) r = fsync_dir(dir);
    free(txt);
    free(model);
    free(optim);
    free(cfg);
    free(state);
    return r;
}

/* Moves the finished temporary directory to final. When final exists (a checkpoint of
 * the same step from an earlier run), the two are exchanged atomically where the
 * file system allows (renameat2 RENAME_EXCHANGE), else the old one is renamed aside
 * first; the old one is then removed. */
static anneal_status publish_dir(const char *run_dir, const char *tmp, const char *final, const char *name) {
    struct stat sb;
    if (lstat(final, &sb) != 0) {
        if (rename(tmp, final) != 0)
            return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot rename %s into place: %s", final, tmp, strerror(errno));
        return ANNEAL_OK;
    }
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, final, RENAME_EXCHANGE) == 0) {
        anneal_ckpt_remove_tree(tmp); /* now holds the old checkpoint */
        return ANNEAL_OK;
    }
    char *aside = NULL;
    if (asprintf(&aside, "%s/.trash_%s_%ld", run_dir, name, (long)getpid()) < 0)
        return anneal_set_error(ANNEAL_ERR_OOM, "checkpoint: out of memory");
    anneal_status r = ANNEAL_OK;
    if (rename(final, aside) != 0)
        r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot move the existing checkpoint aside: %s", final, strerror(errno));
    else if (rename(tmp, final) != 0) {
        r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot rename %s into place: %s", final, tmp, strerror(errno));
        rename(aside, final); /* put the old one back */
    } else {
        anneal_ckpt_remove_tree(aside);
    }
    free(aside);
    return r;
}

/* qsort: steps in decreasing order. */
static int cmp_step_desc(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Removes ckpt_* directories beyond the `keep` highest steps, never `latest` (the one
 * just written). Best effort: failures here do not fail the save. */
static void prune(const char *run_dir, int keep, int64_t latest) {
    if (keep <= 0) return;
    DIR *d = opendir(run_dir);
    if (!d) return;
    int64_t *steps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t s = anneal_ckpt_parse_dir_name(e->d_name);
        if (s < 0) continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 16;
            int64_t *ns = realloc(steps, nc * sizeof *ns);
            if (!ns) break;
            steps = ns;
            cap = nc;
        }
        steps[n++] = s;
    }
    closedir(d);
    if (steps) qsort(steps, n, sizeof *steps, cmp_step_desc);
    char name[64];
    for (size_t i = (size_t)keep; i < n; i++) {
        if (steps[i] == latest) continue;
        anneal_ckpt_dir_name(steps[i], name, sizeof name);
        discard_dir(run_dir, name);
    }
    free(steps);
}

anneal_status anneal_ckpt_write(const char *run_dir, int keep, const anneal_ckpt_snapshot *s) {
    if (!run_dir || !*run_dir || !s) return anneal_set_error(ANNEAL_ERR_ARG, "checkpoint: empty run directory");
    anneal_status r = make_dirs(run_dir);
    if (r != ANNEAL_OK) return r;
    remove_stale(run_dir);
    char name[64], tmp_name[96];
    anneal_ckpt_dir_name(s->st.step, name, sizeof name);
    snprintf(tmp_name, sizeof tmp_name, ".tmp_%s_%ld", name, (long)getpid());
    char *tmp = join(run_dir, tmp_name), *final = join(run_dir, name), *latest = join(run_dir, "latest");
    if (!tmp || !final || !latest) {
        r = anneal_last_status();
        goto done;
    }
    if (mkdir(tmp, 0777) != 0) {
        r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create the checkpoint directory %s: %s", run_dir, tmp_name,
                             strerror(errno));
        goto done;
    }
    if ((r = write_files(tmp, s)) != ANNEAL_OK || (r = publish_dir(run_dir, tmp, final, name)) != ANNEAL_OK) {
        anneal_ckpt_remove_tree(tmp);
        goto done;
    }
    /* The new directory is in place; make the rename durable before pointing at it. */
    char pointer[80];
    snprintf(pointer, sizeof pointer, "%s\n", name);
    if ((r = fsync_dir(run_dir)) != ANNEAL_OK ||
        (r = anneal_write_file_atomic(latest, pointer, strlen(pointer))) != ANNEAL_OK) {
        goto done; /* latest still names the previous checkpoint, which is untouched */
    }
    prune(run_dir, keep, s->st.step);
done:
    free(tmp);
    free(final);
    free(latest);
    return r;
}

/* ---------------------------------------------------------------- sync save */

anneal_status anneal_checkpoint_save(const char *run_dir, const anneal_model *m, const anneal_optimizer *opt,
                                     const anneal_train_state *st, const char *config_json, int keep) {
    anneal_ckpt_snapshot s;
    memset(&s, 0, sizeof s);
    anneal_status r = anneal_ckpt_snapshot_take(&s, m, opt, st, config_json);
    if (r == ANNEAL_OK) r = anneal_ckpt_write(run_dir, keep, &s);
    anneal_ckpt_snapshot_release(&s);
    return r;
}
