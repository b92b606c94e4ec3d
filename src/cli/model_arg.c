/* One way to name a model on the command line (--model of eval, generate, export):
 * a checkpoint or run directory, a Hugging Face model directory (config.json + model.safetensors or a
 * sharded set), a weights file with config.json beside it, or a preset name (random
 * weights from a seed). Also finds the tokenizer that travels with the model. */
#include "anneal/anneal.h"
#include "commands.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static bool path_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0;
}

static bool path_is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* True when dir looks like a checkpoint or a run directory rather than a model
 * directory: state.json, a latest pointer, or no config.json. */
static bool looks_like_checkpoint(const char *dir) {
    char p[PATH_MAX + 32];
    snprintf(p, sizeof p, "%s/state.json", dir);
    if (path_exists(p)) return true;
    snprintf(p, sizeof p, "%s/latest", dir);
    if (path_exists(p)) return true;
    snprintf(p, sizeof p, "%s/config.json", dir);
    return !path_exists(p);
}

int anneal_cli_load_model(const char *cmd, const char *flag, const char *arg, anneal_model **model,
                          anneal_train_state *st, char **config_json, char **tokenizer_path) {
    return anneal_cli_load_model_on(cmd, flag, arg, ANNEAL_CPU, model, st, config_json, tokenizer_path);
}

int anneal_cli_load_model_on(const char *cmd, const char *flag, const char *arg, anneal_device dev,
                             anneal_model **model, anneal_train_state *st, char **config_json,
                             char **tokenizer_path) {
    *model = NULL;
    *config_json = NULL;
    if (tokenizer_path) *tokenizer_path = NULL;
    char dir[PATH_MAX];
    if (path_is_dir(arg) && looks_like_checkpoint(arg)) {
        if (anneal_checkpoint_resolve(arg, dir, sizeof dir) != ANNEAL_OK) {
            fprintf(stderr, "anneal %s: --%s %s: not a Hugging Face model directory (no config.json) and %s\n", cmd, flag,
                    arg, anneal_last_error());
            return 1;
        }
        int rc = anneal_cli_load_checkpoint_on(cmd, dir, dev, model, st, config_json);
        if (rc) return rc;
    } else if (anneal_gguf_path(arg) && path_exists(arg)) {
        anneal_tokenizer *tok = NULL;
        if (anneal_model_load_gguf(arg, dev, model, tokenizer_path ? &tok : NULL) != ANNEAL_OK) {
            fprintf(stderr, "anneal %s: --%s %s: %s\n", cmd, flag, arg, anneal_last_error());
            return 1;
        }
        /* the file holds the tokenizer: anneal_cli_tokenizer_load reads it from there */
        if (tok) *tokenizer_path = strdup(arg);
        anneal_tokenizer_free(tok);
        return 0;
    } else if (path_exists(arg)) {
        if (anneal_model_load_hf(arg, dev, model) != ANNEAL_OK) {
            fprintf(stderr, "anneal %s: --%s %s: %s\n", cmd, flag, arg, anneal_last_error());
            return 1;
        }
        snprintf(dir, sizeof dir, "%s", arg);
        if (!path_is_dir(arg)) {
            char *slash = strrchr(dir, '/');
            if (slash) *slash = '\0';
            else snprintf(dir, sizeof dir, ".");
        }
    } else {
        anneal_model_config cfg;
        char names[256];
        if (!anneal_model_preset(arg, &cfg)) {
            fprintf(stderr, "anneal %s: --%s %s: no such directory or file, and not a preset (%s)\n", cmd, flag, arg,
                    anneal_model_preset_names(names, sizeof names));
            return 2;
        }
        anneal_model *m = anneal_model_new(&cfg, dev);
        if (!m || anneal_model_init(m, 1337) != ANNEAL_OK) {
            fprintf(stderr, "anneal %s: --%s %s: %s\n", cmd, flag, arg, anneal_last_error());
            anneal_model_free(m);
            return 1;
        }
        fprintf(stderr, "anneal %s: --%s %s: a preset, so random weights (seed 1337)\n", cmd, flag, arg);
        *model = m;
        return 0;
    }
    char tp[PATH_MAX + 32];
    snprintf(tp, sizeof tp, "%s/tokenizer.json", dir);
    /* the directory, so its tokenizer_config.json (special tokens, chat template) comes too */
    if (tokenizer_path && path_exists(tp)) *tokenizer_path = strdup(dir);
    return 0;
}

int anneal_cli_tokenizer_load(const char *spec, anneal_tokenizer **tok) {
    anneal_status r = anneal_gguf_path(spec) ? anneal_gguf_load_tokenizer(spec, tok) : anneal_tokenizer_load(spec, tok);
    if (r == ANNEAL_OK && !*tok) r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the GGUF file holds no tokenizer", spec);
    return r;
}
