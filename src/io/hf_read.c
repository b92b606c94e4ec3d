/* Hugging Face weights as a model-interface tensor source: one model.safetensors, or a
 * sharded set named by model.safetensors.index.json. Every shard is memory-mapped
 * (anneal_safetensors_open), so a tensor is converted to f32 straight from the page
 * cache when the architecture's hf_import asks for it: nothing is read up front and
 * only one converted tensor at a time lives beside the model. The index is validated
 * before any tensor is read: weight_map entries are strings naming files inside the
 * model directory (no absolute path, no "..", no symlink out of it), every shard
 * opens, every tensor the index names is in its shard, no tensor is named twice or
 * sits in a shard the index does not name for it. PyTorch pickles (pytorch_model.bin)
 * are refused with how to convert them. */
#include "anneal/io.h"
#include "anneal/parse.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HF_INDEX_MAX_BYTES ((size_t)256 << 20)

static const char HF_CONVERT_HINT[] =
    "anneal reads only safetensors weights: convert it with transformers, e.g. python -c \"from transformers "
    "import AutoModelForCausalLM as M; M.from_pretrained('IN').save_pretrained('OUT', safe_serialization=True)\"";

/* One tensor of the set: its shard and entry. */
typedef struct hf_slot {
    const char *name; /* the entry's name (owned by the shard) */
    int shard;
    const anneal_st_entry *entry;
} hf_slot;

struct anneal_hf_weights {
    anneal_tensor_source src;
    char *what;  /* the index or the single file: names the set in errors */
    int n_shards;
    anneal_safetensors **shards;
    int n;
    hf_slot *slots;     /* sorted by name */
    const char **names; /* in index (or file) order */
};

static bool is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static bool exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int cmp_slot(const void *a, const void *b) {
    return strcmp(((const hf_slot *)a)->name, ((const hf_slot *)b)->name);
}

static const hf_slot *find_slot(const anneal_hf_weights *w, const char *name) {
    hf_slot key = {.name = name};
    return bsearch(&key, w->slots, (size_t)w->n, sizeof *w->slots, cmp_slot);
}

static bool src_info(void *ctx, const char *name, anneal_dtype *dtype, int *ndim, int64_t *shape) {
    const hf_slot *s = find_slot(ctx, name);
    if (!s) return false;
    *dtype = s->entry->dtype;
    *ndim = s->entry->ndim;
    memcpy(shape, s->entry->shape, (size_t)s->entry->ndim * sizeof *shape);
    return true;
}

static anneal_tensor *src_get(void *ctx, const char *name) {
    const anneal_hf_weights *w = ctx;
    const hf_slot *s = find_slot(w, name);
    return s ? anneal_safetensors_load(w->shards[s->shard], name, ANNEAL_F32) : NULL;
}

void anneal_hf_weights_close(anneal_hf_weights *w) {
    if (!w) return;
    for (int i = 0; i < w->n_shards; i++) anneal_safetensors_close(w->shards[i]);
    free(w->shards);
    free(w->slots);
    free(w->names);
    free(w->what);
    free(w);
}

const anneal_tensor_source *anneal_hf_weights_source(const anneal_hf_weights *w) { return w ? &w->src : NULL; }

/* Tells a PyTorch pickle or zip archive, or JSON, from a safetensors file by its first
 * bytes: a safetensors file starts with a header length that fits the file followed by
 * '{'; anything else that looks like a zip ("PK\3\4") or a pickle (0x80, protocol
 * 2-5) or JSON gets an error saying what it is. ANNEAL_OK otherwise (the safetensors
 * reader then names the problem). */
static anneal_status sniff(const char *path) {
    unsigned char b[9] = {0};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    ssize_t got = fstat(fd, &sb) == 0 ? read(fd, b, sizeof b) : -1;
    close(fd);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | b[i];
    if (got == 9 && b[8] == '{' && hlen <= (uint64_t)sb.st_size - 8) return ANNEAL_OK;
    if ((got >= 4 && !memcmp(b, "PK\3\4", 4)) || (got >= 2 && b[0] == 0x80 && b[1] >= 2 && b[1] <= 5))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s is a PyTorch pickle checkpoint (pytorch_model.bin), not "
                                "safetensors; %s",
                                path, HF_CONVERT_HINT);
    if (got >= 1 && b[0] == '{')
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s is a JSON file, not safetensors weights (a sharded set is read "
                                "from model.safetensors.index.json or its directory)",
                                path);
    return ANNEAL_OK;
}

/* Fills w's source and slot table from its shards, the names in `names` order. */
static anneal_status finish(anneal_hf_weights *w) {
    qsort(w->slots, (size_t)w->n, sizeof *w->slots, cmp_slot);
    for (int i = 1; i < w->n; i++)
        if (!strcmp(w->slots[i - 1].name, w->slots[i].name))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tensor '%s' is listed twice in weight_map", w->what,
                                    w->slots[i].name);
    w->src = (anneal_tensor_source){.ctx = w, .what = w->what, .info = src_info, .get = src_get, .n = w->n,
                                    .names = w->names};
    return ANNEAL_OK;
}

/* A single safetensors file. */
static anneal_status open_single(const char *path, anneal_hf_weights *w) {
    anneal_status r = sniff(path);
    if (r != ANNEAL_OK) return r;
    if (!(w->what = strdup(path)) || !(w->shards = calloc(1, sizeof *w->shards)))
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    if ((r = anneal_safetensors_open(path, &w->shards[0])) != ANNEAL_OK) return r;
    w->n_shards = 1;
    const anneal_safetensors *st = w->shards[0];
    w->slots = calloc((size_t)st->n_entries + 1, sizeof *w->slots);
    w->names = calloc((size_t)st->n_entries + 1, sizeof *w->names);
    if (!w->slots || !w->names) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; i < st->n_entries; i++) {
        w->slots[i] = (hf_slot){st->entries[i].name, 0, &st->entries[i]};
        w->names[i] = st->entries[i].name;
    }
    w->n = st->n_entries;
    return finish(w);
}

/* Checks that shard file `file` of the index at `index` is a relative path that stays
 * inside dir (also after resolving symlinks); writes the joined path into out. */
static anneal_status shard_path(const char *index, const char *dir, const char *file, char *out, size_t n) {
    if (!*file) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: an empty shard file name in weight_map", index);
    if (file[0] == '/')
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: shard '%s' is an absolute path (shards must be files inside %s)",
                                index, file, dir);
    for (const char *p = file; *p;) {
        size_t len = strcspn(p, "/");
        if (len == 2 && !strncmp(p, "..", 2))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: shard '%s' leaves the model directory %s (a '..' component)",
                                    index, file, dir);
        p += len;
        if (*p == '/') p++;
    }
    if ((size_t)snprintf(out, n, "%s/%s", dir, file) >= n)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: shard path '%s' is too long", index, file);
    char rd[PATH_MAX], rf[PATH_MAX];
    if (!realpath(dir, rd)) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot resolve: %s", dir, strerror(errno));
    if (!realpath(out, rf)) return ANNEAL_OK; /* missing: reported with the tensors it should hold */
    size_t l = strlen(rd);
    if (strncmp(rf, rd, l) != 0 || (rf[l] != '/' && !(l == 1 && rd[0] == '/')))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: shard '%s' resolves to %s, outside the model directory %s", index,
                                file, rf, rd);
    return ANNEAL_OK;
}

/* The index: weight_map {tensor: shard file}. */
static anneal_status open_index(const char *index, anneal_hf_weights *w) {
    if (!(w->what = strdup(index))) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", index);
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", index);
    char *slash = strrchr(dir, '/');
    if (slash) *(slash == dir ? slash + 1 : slash) = '\0';
    else snprintf(dir, sizeof dir, ".");

    FILE *f = fopen(index, "rb");
    if (!f) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", index, strerror(errno));
    char *text = NULL;
    long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (size >= 0 && (size_t)size <= HF_INDEX_MAX_BYTES && fseek(f, 0, SEEK_SET) == 0 &&
        (text = malloc((size_t)size + 1)))
        text[fread(text, 1, (size_t)size, f)] = '\0';
    fclose(f);
    if (!text) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot read (or larger than %zu bytes)", index, HF_INDEX_MAX_BYTES);
    cJSON *root = NULL;
    anneal_status r = anneal_json_parse(text, strlen(text), index, &root);
    free(text);
    if (r != ANNEAL_OK) return r;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    char **files = NULL; /* distinct shard files, in first-seen order */
    if (!root || !cJSON_IsObject(root)) r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object", index);
    else if (!cJSON_IsObject(map))
        r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no \"weight_map\" object (tensor name -> shard file)", index);
    int n = r == ANNEAL_OK ? cJSON_GetArraySize(map) : 0;
    if (r == ANNEAL_OK && n == 0) r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: weight_map is empty", index);
    if (r == ANNEAL_OK) {
        w->slots = calloc((size_t)n, sizeof *w->slots);
        w->names = calloc((size_t)n, sizeof *w->names);
        files = calloc((size_t)n, sizeof *files);
        w->shards = calloc((size_t)n, sizeof *w->shards);
        if (!w->slots || !w->names || !files || !w->shards) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", index);
    }
    /* the shard files: validated paths, each opened once */
    for (const cJSON *e = r == ANNEAL_OK ? map->child : NULL; e && r == ANNEAL_OK; e = e->next) {
        if (!cJSON_IsString(e)) {
            r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: weight_map entry '%s' is not a file name string", index, e->string);
            break;
        }
        int k = 0;
        while (k < w->n_shards && strcmp(files[k], e->valuestring)) k++;
        if (k == w->n_shards) {
            char path[PATH_MAX];
            if ((r = shard_path(index, dir, e->valuestring, path, sizeof path)) != ANNEAL_OK) break;
            if (!exists(path)) {
                r = anneal_set_error(ANNEAL_ERR_IO, "%s: shard %s (holding '%s') is missing", index, path, e->string);
                break;
            }
            if (!(files[k] = strdup(e->valuestring))) {
                r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", index);
                break;
            }
            w->n_shards++;
            if ((r = sniff(path)) != ANNEAL_OK || (r = anneal_safetensors_open(path, &w->shards[k])) != ANNEAL_OK) break;
        }
        const anneal_st_entry *en = anneal_safetensors_find(w->shards[k], e->string);
        if (!en) {
            r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tensor '%s' is mapped to %s, which does not hold it", index,
                                 e->string, w->shards[k]->path);
            break;
        }
        w->slots[w->n] = (hf_slot){en->name, k, en};
        w->names[w->n++] = en->name;
    }
    if (r == ANNEAL_OK) r = finish(w);
    /* every tensor of every shard is the one the index maps there (no tensor in two shards) */
    for (int k = 0; r == ANNEAL_OK && k < w->n_shards; k++) {
        const anneal_safetensors *st = w->shards[k];
        for (int i = 0; r == ANNEAL_OK && i < st->n_entries; i++) {
            const hf_slot *s = find_slot(w, st->entries[i].name);
            if (!s)
                r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: shard %s holds tensor '%s', which the index does not list",
                                     index, st->path, st->entries[i].name);
            else if (s->shard != k)
                r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tensor '%s' is in two shards, %s and %s (the index maps it "
                                     "to the second)", index, st->entries[i].name, st->path, w->shards[s->shard]->path);
        }
    }
    for (int k = 0; files && k < n; k++) free(files[k]);
    free(files);
    cJSON_Delete(root);
    return r;
}

anneal_status anneal_hf_weights_open(const char *path, anneal_hf_weights **out) {
    if (!out || !path) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_hf_weights_open: NULL argument");
    *out = NULL;
    char p[PATH_MAX];
    bool sharded = false;
    if (is_dir(path)) {
        static const char *const pt[] = {"pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin"};
        /* transformers' order: the single file first, then the index */
        snprintf(p, sizeof p, "%s/model.safetensors", path);
        if (!exists(p)) {
            snprintf(p, sizeof p, "%s/model.safetensors.index.json", path);
            sharded = exists(p);
        }
        if (!exists(p)) {
            for (size_t i = 0; i < sizeof pt / sizeof pt[0]; i++) {
                snprintf(p, sizeof p, "%s/%s", path, pt[i]);
                if (exists(p))
                    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s holds %s but no model.safetensors: %s", path,
                                            pt[i], HF_CONVERT_HINT);
            }
            return anneal_set_error(ANNEAL_ERR_IO, "%s: no model.safetensors or model.safetensors.index.json in the "
                                    "directory", path);
        }
    } else if (!exists(path)) {
        return anneal_set_error(ANNEAL_ERR_IO, "%s: no such file or directory", path);
    } else {
        if (ends_with(path, ".bin") || ends_with(path, ".bin.index.json") || ends_with(path, ".pt") ||
            ends_with(path, ".pth"))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: a PyTorch checkpoint, not safetensors; %s", path,
                                    HF_CONVERT_HINT);
        snprintf(p, sizeof p, "%s", path);
        sharded = ends_with(path, ".json");
    }
    anneal_hf_weights *w = calloc(1, sizeof *w);
    if (!w) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    anneal_status r = sharded ? open_index(p, w) : open_single(p, w);
    if (r != ANNEAL_OK) {
        anneal_hf_weights_close(w);
        return r;
    }
    *out = w;
    return ANNEAL_OK;
}

anneal_status anneal_hf_config_path(const char *path, char *out, size_t n) {
    if (!path || !out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_hf_config_path: NULL argument");
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    if (!is_dir(path)) {
        char *slash = strrchr(dir, '/');
        if (!slash) snprintf(dir, sizeof dir, ".");
        else *(slash == dir ? slash + 1 : slash) = '\0';
    }
    if ((size_t)snprintf(out, n, "%s/config.json", dir) >= n)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", path);
    if (!exists(out))
        return anneal_set_error(ANNEAL_ERR_IO, "%s: no config.json in %s (a Hugging Face model directory holds "
                                "config.json beside the weights)", path, dir);
    return ANNEAL_OK;
}

anneal_status anneal_model_load_hf(const char *path, anneal_device dev, anneal_model **out) {
    if (!path || !out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_model_load_hf: NULL argument");
    *out = NULL;
    if (anneal_quant_dir_is_quantized(path)) return anneal_quant_load(path, dev, out); /* quant_read.c */
    char cfgp[PATH_MAX + 16];
    anneal_model_config cfg;
    anneal_hf_weights *w = NULL;
    /* the weights first: a pickle-only directory is told to convert, whatever its config */
    anneal_status r = anneal_hf_weights_open(path, &w);
    if (r == ANNEAL_OK) r = anneal_hf_config_path(path, cfgp, sizeof cfgp);
    if (r == ANNEAL_OK) r = anneal_model_config_from_hf_file(cfgp, &cfg);
    anneal_model *m = r == ANNEAL_OK ? anneal_model_new(&cfg, dev) : NULL;
    if (r == ANNEAL_OK && !m) r = anneal_last_status();
    if (r == ANNEAL_OK) r = anneal_model_hf_import(m, anneal_hf_weights_source(w));
    anneal_hf_weights_close(w);
    if (r != ANNEAL_OK) {
        anneal_model_free(m);
        return r;
    }
    *out = m;
    anneal_memory_release_cache(ANNEAL_CPU); /* the load's temporaries (f32 conversions) are not the run's */
    return ANNEAL_OK;
}

anneal_status anneal_model_load_hf_weights(anneal_model *m, const char *path) {
    if (!m || !path) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_model_load_hf_weights: NULL argument");
    anneal_hf_weights *w = NULL;
    anneal_status r = anneal_hf_weights_open(path, &w);
    if (r == ANNEAL_OK) r = anneal_model_hf_import(m, anneal_hf_weights_source(w));
    anneal_hf_weights_close(w);
    return r;
}
