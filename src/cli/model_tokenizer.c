/* The tokenizer that goes with a model a command loaded (generate, serve, export): the
 * --tokenizer the user gave, else the tokenizer.json a checkpoint or an int8 model
 * directory carries, else the one its training run used; and the messages that say
 * where a tokenizer spec came from, so none names a flag the user did not pass. */
#include "anneal/anneal.h"
#include "commands.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The tokenizer a training run used (malloc'd, or NULL): its --tokenizer, else the one
 * its data directory's prepare.json names (a relative path there is tried both as
 * given and inside the data directory). */
char *anneal_cli_run_tokenizer(const cJSON *config, char *from, size_t from_n) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(config, "tokenizer");
    if (cJSON_IsString(t) && *t->valuestring) {
        snprintf(from, from_n, "the training run's --tokenizer");
        return strdup(t->valuestring);
    }
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(config, "data");
    if (!cJSON_IsString(d)) return NULL;
    char *spec = NULL;
    if (anneal_prepare_tokenizer_spec(d->valuestring, &spec) != ANNEAL_OK) anneal_clear_error(); /* none known */
    snprintf(from, from_n, "prepare.json of %s", d->valuestring);
    return spec;
}

void anneal_cli_tokenizer_error(const char *cmd, const char *spec, const char *from, const char *msg) {
    if (!from || !*from || !strcmp(from, "--tokenizer")) fprintf(stderr, "anneal %s: --tokenizer %s: %s\n", cmd, spec, msg);
    else fprintf(stderr, "anneal %s: tokenizer %s (from %s): %s\n", cmd, spec, from, msg);
}

/* dir/tokenizer.json exists: dir (malloc'd), else NULL. */
static char *dir_with_tokenizer(const char *dir) {
    char tj[PATH_MAX + 16];
    snprintf(tj, sizeof tj, "%s/tokenizer.json", dir);
    return access(tj, F_OK) == 0 ? strdup(dir) : NULL;
}

int anneal_cli_model_tokenizer(const char *cmd, const char *ckpt, const char *tok_spec, const char *model_tok,
                               const char *config_text, uint64_t fingerprint, struct anneal_tokenizer **out) {
    *out = NULL;
    cJSON *config = NULL;
    if (config_text && anneal_json_parse(config_text, strlen(config_text), "the checkpoint's trainer config", &config) !=
                           ANNEAL_OK) {
        fprintf(stderr, "anneal %s: %s\n", cmd, anneal_last_error());
        return 1;
    }
    char from[PATH_MAX + 64] = "--tokenizer";
    char *owned = NULL;
    if (!tok_spec) {
        snprintf(from, sizeof from, "the model's tokenizer.json");
        if (ckpt) { /* a checkpoint (or an int8 model directory) carries its tokenizer.json */
            char dir[PATH_MAX];
            if (anneal_quant_dir_is_quantized(ckpt)) owned = dir_with_tokenizer(ckpt);
            else if (anneal_checkpoint_resolve(ckpt, dir, sizeof dir) == ANNEAL_OK) owned = dir_with_tokenizer(dir);
            else anneal_clear_error();
        }
        if (!owned && model_tok) owned = strdup(model_tok);
        if (!owned) owned = anneal_cli_run_tokenizer(config, from, sizeof from);
        tok_spec = owned;
    }
    cJSON_Delete(config);
    int rc = 0;
    if (!tok_spec) {
        fprintf(stderr, "anneal %s: --tokenizer is required (the model names none): gpt2, a directory or "
                        "tokenizer.json\n", cmd);
        return 2;
    }
    if (anneal_cli_tokenizer_load(tok_spec, out) != ANNEAL_OK) {
        anneal_cli_tokenizer_error(cmd, tok_spec, from, anneal_last_error());
        rc = 1;
    } else if (fingerprint && anneal_tokenizer_fingerprint(*out) != fingerprint) {
        char msg[256];
        snprintf(msg, sizeof msg, "fingerprint %016llx does not match the checkpoint's %016llx (the model was trained "
                 "on ids of another tokenizer)", (unsigned long long)anneal_tokenizer_fingerprint(*out),
                 (unsigned long long)fingerprint);
        anneal_cli_tokenizer_error(cmd, tok_spec, from, msg);
        anneal_tokenizer_free(*out);
        *out = NULL;
        rc = 2;
    }
    free(owned);
    return rc;
}
