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

/* Converts n f32 values to dt (a new buffer; for F32 a copy is not needed: NULL). */
static void *convert(const float *x, int64_t n, anneal_dtype dt) {
    if (dt == ANNEAL_F32) return NULL;
    uint16_t *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    if (!out) return NULL;
    for (int64_t i = 0; i < n; i++) out[i] = dt == ANNEAL_BF16 ? anneal_f32_to_bf16(x[i]) : anneal_f32_to_f16(x[i]);
    return out;
}

static int64_t numel_of(const anneal_st_write_entry *e) {
    int64_t n = 1;
    for (int d = 0; d < e->ndim; d++) n *= e->shape[d];
    return n;
}

/* The weights: shards cut as transformers' shard_checkpoint does (a new shard when
 * the next tensor would take the current, non-empty one past max), then the index. */
static anneal_status write_weights(const char *dir, int n, const anneal_st_write_entry *in, const anneal_hf_save_opts *o) {
    anneal_st_write_entry *e = calloc((size_t)n + 1, sizeof *e);
    void **bufs = calloc((size_t)n + 1, sizeof *bufs);
    int *shard_of = calloc((size_t)n + 1, sizeof *shard_of);
    anneal_status r = e && bufs && shard_of ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
    uint64_t total = 0, block = 0;
    int in_block = 0;
    int n_shards = n ? 1 : 0;
    size_t esz = anneal_dtype_size(o->dtype);
    for (int i = 0; r == ANNEAL_OK && i < n; i++) {
        e[i] = in[i];
        e[i].dtype = o->dtype;
        int64_t ne = numel_of(&in[i]);
        if (o->dtype != ANNEAL_F32) {
            if (!(bufs[i] = convert(in[i].data, ne, o->dtype))) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
            e[i].data = bufs[i];
        }
        uint64_t size = (uint64_t)ne * esz;
        if (o->max_shard_bytes && block + size > o->max_shard_bytes && in_block > 0) n_shards++, block = 0, in_block = 0;
        shard_of[i] = n_shards - 1;
        block += size;
        in_block++;
        total += size;
    }
    const char *k[] = {"format"}, *v[] = {"pt"};
    char name[64], path[PATH_MAX];
    cJSON *index = NULL, *map = NULL;
    if (r == ANNEAL_OK && n_shards > 1) {
        index = cJSON_CreateObject();
        cJSON *meta = cJSON_AddObjectToObject(index, "metadata");
        if (meta) cJSON_AddItemToObject(meta, "total_size", anneal_ckpt_json_u64(total));
        map = cJSON_AddObjectToObject(index, "weight_map");
        if (!index || !meta || !map) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
    }
    for (int s = 0, first = 0; r == ANNEAL_OK && s < n_shards; s++) {
        int last = first;
        while (last < n && shard_of[last] == s) last++;
        if (n_shards == 1) snprintf(name, sizeof name, "model.safetensors");
        else snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
            r = anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
        if (r == ANNEAL_OK) r = anneal_safetensors_write(path, last - first, e + first, 1, k, v);
        for (int i = first; r == ANNEAL_OK && map && i < last; i++)
            if (!cJSON_AddStringToObject(map, e[i].name, name)) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
        first = last;
    }
    if (r == ANNEAL_OK && n_shards == 0) r = anneal_set_error(ANNEAL_ERR_ARG, "%s: the model exported no tensors", dir);
    if (r == ANNEAL_OK && index) {
        /* transformers writes the map sorted by name (json.dumps(sort_keys=True)) */
        int m = cJSON_GetArraySize(map);
        cJSON **items = calloc((size_t)m + 1, sizeof *items);
        if (!items) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", dir);
        int c = 0;
        for (cJSON *it = map->child; items && it; it = it->next) items[c++] = it;
        for (int i = 1; items && i < c; i++)
            for (int j = i; j > 0 && strcmp(items[j - 1]->string, items[j]->string) > 0; j--) {
                cJSON *t = items[j];
                items[j] = items[j - 1];
                items[j - 1] = t;
            }
        for (int i = 0; items && i < c; i++) {
            items[i]->prev = i ? items[i - 1] : items[c - 1];
            items[i]->next = i + 1 < c ? items[i + 1] : NULL;
        }
        if (items && c) map->child = items[0];
        free(items);
        if (r == ANNEAL_OK) r = write_json(dir, "model.safetensors.index.json", index);
    }
    cJSON_Delete(index);
    for (int i = 0; bufs && i < n; i++) free(bufs[i]);
    free(bufs);
    free(shard_of);
    free(e);
    return r;
}

anneal_status anneal_hf_write_files(const char *dir, const anneal_model_config *cfg, int n,
                                    const anneal_st_write_entry *f32_tensors, const anneal_hf_save_opts *opts) {
    if (!dir || !cfg || !opts || (n > 0 && !f32_tensors))
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_hf_write_files: NULL argument");
    if (opts->dtype != ANNEAL_F32 && opts->dtype != ANNEAL_BF16 && opts->dtype != ANNEAL_F16)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: weights can be stored as f32, bf16 or f16, not %s", dir,
                                anneal_dtype_name(opts->dtype));
    for (int i = 0; i < n; i++)
        if (f32_tensors[i].dtype != ANNEAL_F32)
            return anneal_set_error(ANNEAL_ERR_ARG, "%s: tensor %s is handed over as %s, expected f32", dir,
                                    f32_tensors[i].name, anneal_dtype_name(f32_tensors[i].dtype));
    anneal_status r = write_configs(dir, cfg, opts->dtype);
    if (r == ANNEAL_OK) r = write_weights(dir, n, f32_tensors, opts);
    return r;
}

/* What hf_export puts: host f32 copies in order. */
typedef struct gathered {
    int n, cap;
    anneal_st_write_entry *e;
    int64_t (*shapes)[ANNEAL_MAX_DIMS];
} gathered;

static anneal_status gather_put(void *ctx, const char *name, const anneal_tensor *t) {
    gathered *g = ctx;
    if (g->n == g->cap) {
        int cap = g->cap ? 2 * g->cap : 64;
        anneal_st_write_entry *e = realloc(g->e, (size_t)cap * sizeof *e);
        if (e) g->e = e;
        int64_t(*s)[ANNEAL_MAX_DIMS] = e ? realloc(g->shapes, (size_t)cap * sizeof *s) : NULL;
        if (!s) return anneal_set_error(ANNEAL_ERR_OOM, "model export: out of memory");
        g->shapes = s;
        g->cap = cap;
        for (int i = 0; i < g->n; i++) g->e[i].shape = g->shapes[i]; /* shapes moved */
    }
    int64_t n = anneal_numel(t);
    char *nm = strdup(name);
    float *data = malloc((size_t)(n ? n : 1) * sizeof(float));
    anneal_status r = nm && data ? anneal_to_f32_buffer(t, data)
                                 : anneal_set_error(ANNEAL_ERR_OOM, "model export: out of memory for %s", name);
    if (r != ANNEAL_OK) {
        free(nm);
        free(data);
        return r;
    }
    memcpy(g->shapes[g->n], t->shape, sizeof g->shapes[g->n]);
    g->e[g->n] = (anneal_st_write_entry){nm, ANNEAL_F32, t->ndim, g->shapes[g->n], data};
    g->n++;
    return ANNEAL_OK;
}

static void gather_free(gathered *g) {
    for (int i = 0; i < g->n; i++) free((void *)g->e[i].name), free((void *)g->e[i].data);
    free(g->e);
    free(g->shapes);
}

/* True when dir does not exist or is an empty directory (*exists tells which). */
static anneal_status check_target(const char *dir, bool *exists) {
    struct stat sb;
    *exists = false;
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
    *exists = true;
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

anneal_status anneal_model_save_hf(const anneal_model *m, const char *dir, const anneal_hf_save_opts *opts) {
    if (!m || !dir || !*dir) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_model_save_hf: NULL argument");
    anneal_hf_save_opts o = opts ? *opts : (anneal_hf_save_opts){0};
    char clean[PATH_MAX], tmp[PATH_MAX + 32];
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/') len--;
    if (len >= sizeof clean) return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    memcpy(clean, dir, len);
    clean[len] = '\0';
    bool exists;
    anneal_status r = check_target(clean, &exists);
    if (r != ANNEAL_OK) return r;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", clean, (long)getpid());
    anneal_ckpt_remove_tree(tmp); /* a leftover of a crashed export with this pid */
    gathered g = {0};
    anneal_tensor_sink sink = {.ctx = &g, .put = gather_put};
    r = anneal_model_hf_export(m, &sink);
    if (r == ANNEAL_OK && mkdir(tmp, 0755) != 0) r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    bool made = r == ANNEAL_OK;
    if (r == ANNEAL_OK) r = anneal_hf_write_files(tmp, &m->cfg, g.n, g.e, &o);
    if (r == ANNEAL_OK && o.tokenizer) r = anneal_tokenizer_save_hf(o.tokenizer, tmp);
    if (r == ANNEAL_OK) r = fsync_path(tmp);
    if (r == ANNEAL_OK && rename(tmp, clean) != 0) /* replaces an empty directory */
        r = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot rename %s into place: %s", clean, tmp, strerror(errno));
    if (r == ANNEAL_OK) r = anneal_fsync_parent_dir(clean);
    else if (made) anneal_ckpt_remove_tree(tmp);
    (void)exists;
    gather_free(&g);
    return r;
}
