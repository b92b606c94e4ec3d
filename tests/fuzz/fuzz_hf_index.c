/* Fuzzes Hugging Face weights (src/io/hf_read.c, anneal_hf_weights_open): the input is
 * a sharded set, model.safetensors.index.json FUZZ_SEP shard 1 FUZZ_SEP shard 2
 * (model-00001-of-00002.safetensors, model-00002-of-00002.safetensors) in a model
 * directory, beside which lies a valid safetensors file the index may try to reach
 * (../outside.safetensors). A set that opens must name only shards inside the
 * directory (checked on the index here), and every tensor it lists reads back. */
#include <cjson/cJSON.h>

#include "anneal/io.h"
#include "fuzz/fuzz_util.h"

static void setup_once(void) {
    static bool done;
    if (done) return;
    done = true;
    char dir[600];
    snprintf(dir, sizeof dir, "%s/hf", fuzz_dir());
    mkdir(dir, 0755);
    /* a valid file outside the model directory: header {"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} */
    static const char hdr[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    uint8_t buf[8 + sizeof hdr - 1 + 4] = {0};
    uint64_t hl = sizeof hdr - 1;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(hl >> (8 * i));
    memcpy(buf + 8, hdr, sizeof hdr - 1);
    fuzz_write("outside.safetensors", buf, sizeof buf);
}

/* True when s is a relative path with no ".." component. */
static bool stays_inside(const char *s) {
    if (s[0] == '/') return false;
    for (const char *p = s; *p;) {
        size_t len = strcspn(p, "/");
        if (len == 2 && !strncmp(p, "..", 2)) return false;
        p += len;
        if (*p == '/') p++;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup_once();
    const uint8_t *part[3];
    size_t len[3];
    int n = fuzz_split(data, size, part, len, 3);
    const char *index = fuzz_write("hf/model.safetensors.index.json", part[0], len[0]);
    if (n > 1) fuzz_write("hf/model-00001-of-00002.safetensors", part[1], len[1]);
    else fuzz_unlink("hf/model-00001-of-00002.safetensors");
    if (n > 2) fuzz_write("hf/model-00002-of-00002.safetensors", part[2], len[2]);
    else fuzz_unlink("hf/model-00002-of-00002.safetensors");

    anneal_hf_weights *w = NULL;
    if (anneal_hf_weights_open(index, &w) == ANNEAL_OK) {
        char *text = fuzz_cstr(part[0], len[0]);
        cJSON *root = cJSON_Parse(text);
        const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
        for (const cJSON *e = map ? map->child : NULL; e; e = e->next)
            if (cJSON_IsString(e) && !stays_inside(e->valuestring)) abort(); /* escaped the directory */
        cJSON_Delete(root);
        free(text);
        const anneal_tensor_source *src = anneal_hf_weights_source(w);
        anneal_scope *sc = anneal_scope_open();
        for (int i = 0; i < src->n; i++) {
            anneal_dtype dt;
            int nd;
            int64_t shape[ANNEAL_MAX_DIMS];
            if (!src->info(src->ctx, src->names[i], &dt, &nd, shape)) abort();
            (void)src->get(src->ctx, src->names[i]);
            anneal_clear_error();
        }
        anneal_scope_close(sc);
        anneal_hf_weights_close(w);
    }
    anneal_clear_error();
    return 0;
}
