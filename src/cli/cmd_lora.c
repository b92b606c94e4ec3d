/* anneal lora merge --base DIR --adapter DIR --out DIR: reads a Hugging Face model
 * directory (config.json + model.safetensors; any registered architecture), applies
 * the PEFT adapter directory to it (validated), folds the adapters into the base
 * weights (W += alpha/r * B A; Conv1D layouts transposed) and writes the merged model
 * as a Hugging Face directory (anneal_model_save_hf: config.json, the weights, the
 * base's tokenizer files) that transformers loads: what PEFT's
 * merge_and_unload().save_pretrained() gives. */
#include "anneal/anneal.h"
#include "anneal/fs.h"
#include "args.h"
#include "commands.h"

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
static anneal_status merge(const char *base, const char *adapter, const char *out, anneal_dtype dtype) {
    anneal_model *m = NULL;
    anneal_tokenizer *tok = NULL;
    char tp[4096];
    struct stat sb;
    anneal_status s = anneal_model_load_hf(base, ANNEAL_CPU, &m);
    if (s == ANNEAL_OK) s = anneal_peft_load(adapter, m->params, ANNEAL_F32);
    if (s == ANNEAL_OK) s = anneal_lora_merge(m->params);
    /* the base's tokenizer travels with the merged model */
    if (s == ANNEAL_OK && join(tp, sizeof tp, base, "tokenizer.json") && stat(tp, &sb) == 0)
        s = anneal_tokenizer_load(base, &tok);
    if (s == ANNEAL_OK) {
        anneal_hf_save_opts o = {.dtype = dtype, .tokenizer = tok};
        s = anneal_model_save_hf(m, out, &o);
    }
    anneal_tokenizer_free(tok);
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
    const char *base = NULL, *adapter = NULL, *out = NULL, *dtype = NULL;
    cli_flag flags[] = {
        {"base", ARG_STRING, "the base model: a Hugging Face directory (config.json, model.safetensors)", &base, false},
        {"adapter", ARG_STRING, "the PEFT adapter directory (adapter_config.json, adapter_model.safetensors)", &adapter,
         false},
        {"out", ARG_STRING, "the merged model's directory (must not exist or be empty; written whole, then renamed)",
         &out, false},
        {"dtype", ARG_STRING, "tensors stored as fp32 (default), bf16 or fp16", &dtype, false},
    };
    int nf = (int)(sizeof flags / sizeof *flags);
    if (!cli_parse("lora merge", argc - 1, argv + 1, flags, nf)) return 2;
    if (!base || !adapter || !out) {
        fprintf(stderr, "anneal lora merge: --base, --adapter and --out are required\n");
        cli_usage("lora merge", summary, flags, nf);
        return 2;
    }
    anneal_dtype dt = ANNEAL_F32;
    if (dtype && anneal_cli_parse_dtype("lora merge", dtype, &dt) != 0) return 2;
    if (merge(base, adapter, out, dt) != ANNEAL_OK) {
        fprintf(stderr, "anneal lora merge: %s\n", anneal_last_error());
        return 1;
    }
    printf("merged %s into %s: %s\n", adapter, base, out);
    return 0;
}
