/* Reading back what anneal prepare wrote: whether a data directory is complete
 * (prepare.json is written last) and the tokenizer its prepare.json names, resolved
 * so that it is found from any working directory. */
#include "anneal/parse.h"
#include "anneal/prepare.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define PREPARE_JSON_MAX (64u << 20)

/* Parses DIR/prepare.json into *root (a JSON object). */
static anneal_status read_manifest(const char *dir, cJSON **root) {
    *root = NULL;
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/prepare.json", dir) >= (int)sizeof path)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: path too long", dir);
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT)
        return anneal_set_error(ANNEAL_ERR_IO,
                                "%s: no prepare.json (%s is missing): the anneal prepare that wrote these shards did not "
                                "finish (run it again into this directory)",
                                dir, path);
    if (anneal_json_read_file(path, PREPARE_JSON_MAX, root) != ANNEAL_OK) return anneal_last_status();
    if (!cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object", path);
    }
    return ANNEAL_OK;
}

anneal_status anneal_prepare_check_dir(const char *data_dir) {
    if (!data_dir) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: no data directory");
    cJSON *root;
    anneal_status st = read_manifest(data_dir, &root);
    cJSON_Delete(root);
    return st;
}

anneal_status anneal_prepare_tokenizer_spec(const char *data_dir, char **spec) {
    *spec = NULL;
    if (!data_dir) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: no data directory");
    cJSON *root;
    anneal_status st = read_manifest(data_dir, &root);
    if (st != ANNEAL_OK) return st;
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "tokenizer"), "spec");
    const char *v = cJSON_IsString(s) && *s->valuestring ? s->valuestring : NULL;
    char inside[PATH_MAX];
    struct stat sb;
    if (v && v[0] != '/' && strcmp(v, "gpt2") && snprintf(inside, sizeof inside, "%s/%s", data_dir, v) < (int)sizeof inside &&
        stat(inside, &sb) == 0)
        v = inside; /* an old manifest's relative path, kept beside the shards */
    if (v && !(*spec = strdup(v))) st = anneal_set_error(ANNEAL_ERR_OOM, "prepare.json: out of memory");
    cJSON_Delete(root);
    return st;
}
