/* anneal lora merge --base DIR --adapter DIR --out DIR: reads a Hugging Face model
 * directory (config.json + model.safetensors; any registered architecture), applies
 * the PEFT adapter directory to it (validated), folds the adapters into the base
 * weights (W += alpha/r * B A; Conv1D layouts transposed) and writes the merged model
 * as a Hugging Face directory (config.json + model.safetensors) that transformers
 * loads: what PEFT's merge_and_unload().save_pretrained() gives. */
#include "anneal/anneal.h"
#include "anneal/fs.h"
#include "args.h"
#include "commands.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* "<dir>/<name>" into buf; false when it does not fit. */
static bool join(char *buf, size_t n, const char *dir, const char *name) {
    int k = snprintf(buf, n, "%s/%s", dir, name);
    return k >= 0 && (size_t)k < n;
}

/* The merge; errors recorded. */
static anneal_status merge(const char *base, const char *adapter, const char *out) {
    char path[4096];
    anneal_model_config cfg;
    if (!join(path, sizeof path, base, "config.json"))
        return anneal_set_error(ANNEAL_ERR_ARG, "--base: path too long");
    anneal_status s = anneal_model_config_from_hf_file(path, &cfg);
    if (s != ANNEAL_OK) return s;
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (!m) return anneal_last_status();
    if (!join(path, sizeof path, base, "model.safetensors")) s = anneal_set_error(ANNEAL_ERR_ARG, "--base: path too long");
    if (s == ANNEAL_OK) s = anneal_model_load_safetensors(m, path);
    if (s == ANNEAL_OK) s = anneal_peft_load(adapter, m->params, ANNEAL_F32);
    if (s == ANNEAL_OK) s = anneal_lora_merge(m->params);
    if (s == ANNEAL_OK && mkdir(out, 0777) != 0 && errno != EEXIST)
        s = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create directory: %s", out, strerror(errno));
    if (s == ANNEAL_OK && !join(path, sizeof path, out, "model.safetensors"))
        s = anneal_set_error(ANNEAL_ERR_ARG, "--out: path too long");
    if (s == ANNEAL_OK) s = anneal_model_save_safetensors(m, path);
    if (s == ANNEAL_OK) {
        char *json = anneal_model_config_to_hf_json(&m->cfg);
        if (!json) s = anneal_last_status();
        else if (!join(path, sizeof path, out, "config.json")) s = anneal_set_error(ANNEAL_ERR_ARG, "--out: path too long");
        else s = anneal_write_file_atomic(path, json, strlen(json));
        free(json);
    }
    anneal_model_free(m);
    return s;
}

int anneal_cmd_lora(int argc, char **argv) {
    static const char *summary = "lora merge --base DIR --adapter DIR --out DIR: fold a PEFT LoRA adapter into its "
                                 "base model and write a Hugging Face model directory";
    if (argc < 1 || strcmp(argv[0], "merge") != 0) {
        fprintf(stderr, "anneal lora: expected the subcommand merge\nusage: anneal %s\n", summary);
        return 2;
    }
    const char *base = NULL, *adapter = NULL, *out = NULL;
    cli_flag flags[] = {
        {"base", ARG_STRING, "the base model: a Hugging Face directory (config.json, model.safetensors)", &base, false},
        {"adapter", ARG_STRING, "the PEFT adapter directory (adapter_config.json, adapter_model.safetensors)", &adapter,
         false},
        {"out", ARG_STRING, "where to write the merged model (created if missing)", &out, false},
    };
    int nf = (int)(sizeof flags / sizeof *flags);
    if (!cli_parse("lora merge", argc - 1, argv + 1, flags, nf)) return 2;
    if (!base || !adapter || !out) {
        fprintf(stderr, "anneal lora merge: --base, --adapter and --out are required\n");
        cli_usage("lora merge", summary, flags, nf);
        return 2;
    }
    if (merge(base, adapter, out) != ANNEAL_OK) {
        fprintf(stderr, "anneal lora merge: %s\n", anneal_last_error());
        return 1;
    }
    printf("merged %s into %s: %s\n", adapter, base, out);
    return 0;
}
