/* Hugging Face model directories out: config.json, generation_config.json and the
 * weights as transformers' save_pretrained writes them (one model.safetensors, or
 * model-0000k-of-0000n.safetensors shards + model.safetensors.index.json, cut where
 * transformers' shard_checkpoint cuts), stored as f32, bf16 or f16 (round to nearest
 * even), and the tokenizer's files. A directory is written whole under a temporary
 * name and renamed into place, so a failed or interrupted export leaves nothing that
 * looks complete. */
#include "anneal/fs.h"
#include "anneal/io.h"
#include "anneal/tokenizer.h"
#include "checkpoint_internal.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *torch_dtype(anneal_dtype dt) {
    return dt == ANNEAL_BF16 ? "bfloat16" : dt == ANNEAL_F16 ? "float16" : "float32";
}

/* Writes text to dir/name atomically. */
static anneal_status write_text(const char *dir, const char *name, const char *text) {
    char path[PATH_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    return anneal_write_file_atomic(path, text, strlen(text));
}

/* Prints j (formatted, newline-terminated) to dir/name atomically. */
static anneal_status write_json(const char *dir, const char *name, const cJSON *j) {
    char *text = cJSON_Print(j);
    size_t n = text ? strlen(text) : 0;
    char *t2 = text ? realloc(text, n + 2) : NULL;
    if (!t2) {
        free(text);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s/%s: out of memory", dir, name);
    }
    t2[n] = '\n';
    t2[n + 1] = '\0';
    anneal_status r = write_text(dir, name, t2);
    free(t2);
    return r;
}

/* The config text with "torch_dtype" set to dt, edited as text so the architecture's
 * formatting survives (transformers checks types: rope_scaling's factor must stay a
 * float like 2.0, which a cJSON round trip would print as 2). malloc'd, NULL + error. */
static char *with_torch_dtype(const char *text, const cJSON *j, anneal_dtype dt, const char *dir) {
    const char *want = torch_dtype(dt);
    size_t n = strlen(text), w = strlen(want);
    char *out = malloc(n + w + 64);
    if (!out) {
        anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
        return NULL;
    }
    const cJSON *td = cJSON_GetObjectItemCaseSensitive(j, "torch_dtype");
    const char *key = td ? strstr(text, "\"torch_dtype\"") : NULL;
    const char *q1 = key && cJSON_IsString(td) ? strchr(key + 13, '"') : NULL;
    const char *q2 = q1 ? strchr(q1 + 1, '"') : NULL;
    if (q2 && (size_t)(q2 - q1 - 1) == strlen(td->valuestring) && !strncmp(q1 + 1, td->valuestring, (size_t)(q2 - q1 - 1))) {
        snprintf(out, n + w + 64, "%.*s%s%s", (int)(q1 + 1 - text), text, want, q2);
        return out;
    }
    if (td) { /* present but not a plain string: refuse rather than write two keys */
        free(out);
        anneal_set_error(ANNEAL_ERR_FORMAT, "%s: config.json's torch_dtype is not a string", dir);
        return NULL;
    }
    const char *end = strrchr(text, '}');
    const char *last = end;
    while (last > text && (last[-1] == ' ' || last[-1] == '\n' || last[-1] == '\t' || last[-1] == '\r')) last--;
    bool empty = last > text && last[-1] == '{';
    snprintf(out, n + w + 64, "%.*s%s\n  \"torch_dtype\": \"%s\"\n%s", (int)(last - text), text, empty ? "" : ",", want, end);
    return out;
}

/* config.json (torch_dtype set to the stored dtype) and generation_config.json (the
 * config's bos/eos ids, as transformers derives it from a model config). */
static anneal_status write_configs(const char *dir, const anneal_model_config *cfg, anneal_dtype dt) {
    char *text = anneal_model_config_to_hf_json(cfg);
    if (!text) return anneal_last_status();
    cJSON *j = cJSON_Parse(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        free(text);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the %s architecture's config_to_hf is not a JSON object", dir,
                                cfg->arch);
    }
    char *edited = with_torch_dtype(text, j, dt, dir);
    free(text);
    anneal_status r = edited ? write_text(dir, "config.json", edited) : anneal_last_status();
    free(edited);
    cJSON *g = r == ANNEAL_OK ? cJSON_CreateObject() : NULL;
    if (r == ANNEAL_OK && !g) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
    if (r == ANNEAL_OK) {
        cJSON_AddBoolToObject(g, "_from_model_config", true);
        static const char *const keys[] = {"bos_token_id", "eos_token_id", "pad_token_id"};
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, keys[i]);
            if (v && !cJSON_IsNull(v)) cJSON_AddItemToObject(g, keys[i], cJSON_Duplicate(v, true));
        }
        cJSON_AddStringToObject(g, "transformers_version", "4.39.3");
        r = write_json(dir, "generation_config.json", g);
    }
    cJSON_Delete(g);
    cJSON_Delete(j);
    return r;
}

/* The weights, streamed from hf_export: each tensor is converted to the stored dtype as
 * it arrives and joins the current shard; a shard is written (under a temporary name
 * "shard-0000k.safetensors") as soon as the next tensor would take it past the size,
 * the cut transformers' shard_checkpoint makes (a new shard when the next tensor would
 * take the current, non-empty one past the maximum). So the host holds one shard, not
 * the model. finish() names the shards as transformers does and writes the index. */
typedef struct shard_writer {
    const char *dir;
    anneal_dtype dt;
    uint64_t max;
    int n_shards;             /* shards written */
    int n, cap;               /* tensors of the current shard */
    anneal_st_write_entry *e;
    int64_t (*shapes)[ANNEAL_MAX_DIMS];
    uint64_t bytes, total;
    int n_all, cap_all;       /* every tensor so far: name and shard */
    char **names;
    int *shard_of;
} shard_writer;

static void shard_free_current(shard_writer *w) {
    for (int i = 0; i < w->n; i++) free((void *)w->e[i].data);
    w->n = 0;
    w->bytes = 0;
}

static anneal_status shard_flush(shard_writer *w) {
    char path[PATH_MAX];
    const char *k[] = {"format"}, *v[] = {"pt"};
    if ((size_t)snprintf(path, sizeof path, "%s/shard-%05d.safetensors", w->dir, w->n_shards) >= sizeof path)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", w->dir);
    anneal_status r = anneal_safetensors_write(path, w->n, w->e, 1, k, v);
    shard_free_current(w);
    if (r == ANNEAL_OK) w->n_shards++;
    return r;
}

static anneal_status shard_put(void *ctx, const char *name, const anneal_tensor *t) {
    shard_writer *w = ctx;
    int64_t n = anneal_numel(t);
    uint64_t size = (uint64_t)n * anneal_dtype_size(w->dt);
    anneal_status r = ANNEAL_OK;
    if (w->max && w->n > 0 && w->bytes + size > w->max && (r = shard_flush(w)) != ANNEAL_OK) return r;
    if (w->n == w->cap) {
        int cap = w->cap ? 2 * w->cap : 64;
        anneal_st_write_entry *e = realloc(w->e, (size_t)cap * sizeof *e);
        if (e) w->e = e;
        int64_t(*sh)[ANNEAL_MAX_DIMS] = e ? realloc(w->shapes, (size_t)cap * sizeof *sh) : NULL;
        if (!sh) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", w->dir);
        w->shapes = sh;
        w->cap = cap;
        for (int i = 0; i < w->n; i++) w->e[i].shape = w->shapes[i];
    }
    if (w->n_all == w->cap_all) {
        int cap = w->cap_all ? 2 * w->cap_all : 64;
        char **names = realloc(w->names, (size_t)cap * sizeof *names);
        if (names) w->names = names;
        int *so = names ? realloc(w->shard_of, (size_t)cap * sizeof *so) : NULL;
        if (!so) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", w->dir);
        w->shard_of = so;
        w->cap_all = cap;
    }
    float *f = malloc((size_t)(n ? n : 1) * sizeof *f);
    char *nm = strdup(name);
    if (!f || !nm) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory for %s", w->dir, name);
    if (r == ANNEAL_OK) r = anneal_to_f32_buffer(t, f);
    void *data = f;
    if (r == ANNEAL_OK && w->dt != ANNEAL_F32) {
        uint16_t *h = malloc((size_t)(n ? n : 1) * sizeof *h);
        if (!h) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory for %s", w->dir, name);
        for (int64_t i = 0; h && i < n; i++) h[i] = w->dt == ANNEAL_BF16 ? anneal_f32_to_bf16(f[i]) : anneal_f32_to_f16(f[i]);
        free(f);
        f = NULL;
        data = h;
    }
    if (r != ANNEAL_OK) {
        free(data);
        free(nm);
        return r;
    }
    memcpy(w->shapes[w->n], t->shape, sizeof w->shapes[w->n]);
    w->names[w->n_all] = nm;
    w->shard_of[w->n_all++] = w->n_shards;
    w->e[w->n] = (anneal_st_write_entry){nm, w->dt, t->ndim, w->shapes[w->n], data};
    w->n++;
    w->bytes += size;
    w->total += size;
    return ANNEAL_OK;
}

static int cmp_name_idx(const void *a, const void *b, void *ctx) {
    char **names = ctx;
    return strcmp(names[*(const int *)a], names[*(const int *)b]);
}

/* Writes the last shard, gives the shards their final names and writes the index. */
static anneal_status shard_finish(shard_writer *w) {
    anneal_status r = w->n > 0 || w->n_shards == 0 ? shard_flush(w) : ANNEAL_OK;
    if (r == ANNEAL_OK && w->n_all == 0) r = anneal_set_error(ANNEAL_ERR_ARG, "%s: the model exported no tensors", w->dir);
    char from[PATH_MAX], to[PATH_MAX], name[64];
    for (int s = 0; r == ANNEAL_OK && s < w->n_shards; s++) {
        if (w->n_shards == 1) snprintf(name, sizeof name, "model.safetensors");
        else snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, w->n_shards);
        snprintf(from, sizeof from, "%s/shard-%05d.safetensors", w->dir, s);
        if ((size_t)snprintf(to, sizeof to, "%s/%s", w->dir, name) >= sizeof to || rename(from, to) != 0)
            r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot rename %s to %s: %s", w->dir, from, name, strerror(errno));
    }
    if (r != ANNEAL_OK || w->n_shards < 2) return r;
    /* the index, keys sorted as transformers writes them (json.dumps(sort_keys=True)) */
    int *order = malloc((size_t)w->n_all * sizeof *order);
    cJSON *index = cJSON_CreateObject(), *meta = index ? cJSON_AddObjectToObject(index, "metadata") : NULL;
    cJSON *map = meta ? cJSON_AddObjectToObject(index, "weight_map") : NULL;
    if (!order || !map || !cJSON_AddItemToObject(meta, "total_size", anneal_ckpt_json_u64(w->total)))
        r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", w->dir);
    for (int i = 0; order && i < w->n_all; i++) order[i] = i;
    if (order) qsort_r(order, (size_t)w->n_all, sizeof *order, cmp_name_idx, w->names);
    for (int i = 0; r == ANNEAL_OK && i < w->n_all; i++) {
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", w->shard_of[order[i]] + 1, w->n_shards);
        if (!cJSON_AddStringToObject(map, w->names[order[i]], name)) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", w->dir);
    }
    if (r == ANNEAL_OK) r = write_json(w->dir, "model.safetensors.index.json", index);
    cJSON_Delete(index);
    free(order);
    return r;
}

static void shard_writer_free(shard_writer *w) {
    shard_free_current(w);
    for (int i = 0; i < w->n_all; i++) free(w->names[i]);
    free(w->names);
    free(w->shard_of);
    free(w->e);
    free(w->shapes);
}

/* OK when dir does not exist or is an empty directory. */
static anneal_status check_target(const char *dir) {
    struct stat sb;
    if (lstat(dir, &sb) != 0) {
        if (errno == ENOENT) return ANNEAL_OK;
        return anneal_set_error(ANNEAL_ERR_IO, "%s: %s", dir, strerror(errno));
    }
    if (!S_ISDIR(sb.st_mode)) return anneal_set_error(ANNEAL_ERR_IO, "%s exists and is not a directory", dir);
    DIR *d = opendir(dir);
    if (!d) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", dir, strerror(errno));
    struct dirent *de;
    bool empty = true;
    while (empty && (de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) empty = false;
    closedir(d);
    if (!empty)
        return anneal_set_error(ANNEAL_ERR_IO, "%s exists and is not empty: export writes a new directory (remove it "
                                "or choose another --out)", dir);
    return ANNEAL_OK;
}

static anneal_status fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    int rc = fsync(fd), e = errno;
    close(fd);
    if (rc != 0 && e != EINVAL) return anneal_set_error(ANNEAL_ERR_IO, "%s: fsync failed: %s", path, strerror(e));
    return ANNEAL_OK;
}

/* Removes "<clean>.tmp.<pid>" directories that exports killed mid-way left beside
 * clean (their pid no live process; a live one may be exporting right now). */
static void remove_dead_exports(const char *clean) {
    char parent[PATH_MAX];
    const char *slash = strrchr(clean, '/'), *base = slash ? slash + 1 : clean;
    if (!slash) snprintf(parent, sizeof parent, ".");
    else if (slash == clean) snprintf(parent, sizeof parent, "/");
    else snprintf(parent, sizeof parent, "%.*s", (int)(slash - clean), clean);
    size_t bl0 = strlen(base);
    DIR *d = opendir(parent);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t bl;
        long pid;
        if (!anneal_tmp_name_parse(e->d_name, &bl, &pid) || bl != bl0 || strncmp(e->d_name, base, bl) ||
            !anneal_pid_is_dead(pid))
            continue;
        char p[PATH_MAX + 300];
        snprintf(p, sizeof p, "%s/%s", parent, e->d_name);
        anneal_ckpt_remove_tree(p);
    }
    closedir(d);
}

anneal_status anneal_model_save_hf(const anneal_model *m, const char *dir, const anneal_hf_save_opts *opts) {
    if (!m || !dir || !*dir) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_model_save_hf: NULL argument");
    anneal_hf_save_opts o = opts ? *opts : (anneal_hf_save_opts){0};
    if (anneal_params_require_float(m->params, dir) != ANNEAL_OK) return anneal_last_status();
    if (m->params && m->params->quant != ANNEAL_QUANT_NONE)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: the model is int8 quantized: a Hugging Face directory holds "
                                "float weights (export the float model it was quantized from)", dir);
    if (o.dtype != ANNEAL_F32 && o.dtype != ANNEAL_BF16 && o.dtype != ANNEAL_F16)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: weights can be stored as f32, bf16 or f16, not %s", dir,
                                anneal_dtype_name(o.dtype));
    char clean[PATH_MAX], tmp[PATH_MAX + 32];
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/') len--;
    if (len >= sizeof clean) return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    memcpy(clean, dir, len);
    clean[len] = '\0';
    anneal_status r = check_target(clean);
    if (r != ANNEAL_OK) return r;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", clean, (long)getpid());
    anneal_ckpt_remove_tree(tmp); /* a leftover of a crashed export with this pid */
    remove_dead_exports(clean);  /* and of other exports killed mid-way */
    if (mkdir(tmp, 0755) != 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    shard_writer w = {.dir = tmp, .dt = o.dtype, .max = o.max_shard_bytes};
    anneal_tensor_sink sink = {.ctx = &w, .put = shard_put};
    r = write_configs(tmp, &m->cfg, o.dtype);
    if (r == ANNEAL_OK) r = anneal_model_hf_export(m, &sink);
    if (r == ANNEAL_OK) r = shard_finish(&w);
    shard_writer_free(&w);
    if (r == ANNEAL_OK && o.tokenizer) r = anneal_tokenizer_save_hf(o.tokenizer, tmp);
    if (r == ANNEAL_OK) r = fsync_path(tmp);
    if (r == ANNEAL_OK && rename(tmp, clean) != 0) /* replaces an empty directory */
        r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot rename %s into place: %s", clean, tmp, strerror(errno));
    if (r == ANNEAL_OK) r = anneal_fsync_parent_dir(clean);
    else anneal_ckpt_remove_tree(tmp);
    return r;
}
