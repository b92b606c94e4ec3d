/* anneal export: writes a model (a checkpoint, a run's latest, or a Hugging Face
 * directory to re-shard or convert) in another format: --format hf, a Hugging Face
 * model directory (anneal_model_save_hf) that transformers' from_pretrained loads;
 * --format gguf, one GGUF file (anneal_model_save_gguf) that llama.cpp loads;
 * --format onnx, one ONNX file of the forward graph (anneal_model_save_onnx) that
 * onnxruntime runs. */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define USAGE_ERR(...) (fprintf(stderr, "anneal export: " __VA_ARGS__), fputc('\n', stderr), 2)

/* A size as transformers' convert_file_size_to_int reads it: bytes, or a number with
 * KB/MB/GB/TB (powers of 10) or KiB/MiB/GiB/TiB (powers of 2); a lowercase final "b"
 * after a decimal unit means bits ("5Gb" = 625 MB). False for anything else or 0. */
static bool parse_size(const char *s, uint64_t *out) {
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || s[0] == '-') return false;
    static const struct {
        const char *unit;
        uint64_t mul;
    } units[] = {{"", 1},         {"B", 1},          {"KB", 1000ULL},     {"MB", 1000000ULL},
                 {"GB", 1000000000ULL}, {"TB", 1000000000000ULL}, {"KIB", 1ULL << 10}, {"MIB", 1ULL << 20},
                 {"GIB", 1ULL << 30},   {"TIB", 1ULL << 40}};
    char up[8];
    size_t n = strlen(end);
    if (n >= sizeof up) return false;
    for (size_t i = 0; i < n; i++) up[i] = (char)toupper((unsigned char)end[i]);
    up[n] = '\0';
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(up, units[i].unit)) continue;
        uint64_t r;
        if (__builtin_mul_overflow((uint64_t)v, units[i].mul, &r)) return false;
        if (n == 2 && end[1] == 'b') r /= 8; /* "Gb": bits */
        *out = r;
        return r > 0;
    }
    return false;
}

int anneal_cmd_export(int argc, char **argv) {
    const char *ckpt = NULL, *model_arg = NULL, *format = "hf", *out = NULL, *dtype = "fp32", *shard = "5GB",
               *tok_spec = NULL, *gguf_type = "f32";
    int64_t threads = 0;
    bool help = false, onnx_kv = false, onnx_ext = false;
    cli_flag flags[] = {
        {"ckpt", ARG_STRING, "checkpoint directory, or a run directory (its latest checkpoint)", &ckpt, 0},
        {"model", ARG_STRING, "instead of --ckpt: a Hugging Face model directory (to convert or re-shard)", &model_arg, 0},
        {"format", ARG_STRING, "hf: a Hugging Face model directory (default); gguf: one llama.cpp GGUF file; "
                               "onnx: an ONNX file (opset 17, f32 weights: bf16/f16 checkpoints converted)", &format, 0},
        {"gguf-type", ARG_STRING, "--format gguf: type of the 2-D weights, f32, f16, bf16 or q8_0 (default f32; "
                                  "norms and biases stay f32)", &gguf_type, 0},
        {"out", ARG_STRING, "the directory to write (must not exist, or be empty); --format gguf|onnx: the file", &out, 0},
        {"onnx-kv-cache", ARG_BOOL, "onnx: past_key_values.N.key/.value inputs and present.N.* outputs", &onnx_kv, 0},
        {"external-data", ARG_BOOL, "onnx: weights in OUT.data beside the file (automatic above 2 GB)", &onnx_ext, 0},
        {"dtype", ARG_STRING, "stored tensor type: fp32, bf16 or fp16 (default fp32)", &dtype, 0},
        {"max-shard-size", ARG_STRING, "split the weights into shards + model.safetensors.index.json above this size "
                                       "(bytes, or 500MB, 2GB, 1GiB...; default 5GB as transformers)", &shard, 0},
        {"tokenizer", ARG_STRING, "tokenizer to include (tokenizer.json + tokenizer_config.json): gpt2, a directory or "
                                  "tokenizer.json; none for no tokenizer (default: the model's tokenizer.json, else "
                                  "the training run's)", &tok_spec, 0},
        {"threads", ARG_INT, "CPU threads (default: all cores)", &threads, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("export", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("export", "Writes a checkpoint as a Hugging Face model directory (--format hf) or as an ONNX "
                            "file of its forward graph (--format onnx).", flags, nf);
        return 0;
    }
    if (!ckpt == !model_arg) return USAGE_ERR("give one of --ckpt DIR or --model DIR");
    bool gguf = !strcmp(format, "gguf"), onnx = !strcmp(format, "onnx");
    if (strcmp(format, "hf") && !gguf && !onnx)
        return USAGE_ERR("--format: unknown format '%s' (formats: hf, gguf, onnx)", format);
    anneal_gguf_save_opts go = {0};
    static const struct {
        const char *name;
        anneal_ggml_type type;
    } gtypes[] = {{"f32", ANNEAL_GGML_F32}, {"f16", ANNEAL_GGML_F16}, {"bf16", ANNEAL_GGML_BF16}, {"q8_0", ANNEAL_GGML_Q8_0}};
    size_t gt = 0;
    while (gt < 4 && strcmp(gguf_type, gtypes[gt].name)) gt++;
    if (gt == 4) return USAGE_ERR("--gguf-type: unknown type '%s' (f32, f16, bf16, q8_0)", gguf_type);
    go.type = gtypes[gt].type;
    if (!out || !*out) return USAGE_ERR("--out %s is required", gguf || onnx ? "FILE" : "DIR");
    if (!onnx && (onnx_kv || onnx_ext)) return USAGE_ERR("--onnx-kv-cache and --external-data go with --format onnx");
    if (onnx && strcmp(dtype, "fp32") && strcmp(dtype, "f32"))
        return USAGE_ERR("--dtype %s: ONNX exports keep f32 weights (--dtype goes with --format hf)", dtype);
    anneal_hf_save_opts o = {0};
    if (!anneal_train_dtype_parse(dtype, &o.dtype)) return USAGE_ERR("--dtype: unknown type '%s' (fp32, bf16, fp16)", dtype);
    if (!parse_size(shard, &o.max_shard_bytes))
        return USAGE_ERR("--max-shard-size: '%s' is not a size (bytes, or a number with KB, MB, GB, KiB, MiB, GiB)", shard);
    if (threads < 0 || threads > 4096) return USAGE_ERR("--threads: %lld is out of range", (long long)threads);
    if (threads > 0) anneal_set_num_threads((int)threads);

    anneal_model *m = NULL;
    anneal_train_state st = {0};
    char *config_text = NULL, *model_tok = NULL, *run_tok = NULL;
    int rc = anneal_cli_load_model("export", ckpt ? "ckpt" : "model", ckpt ? ckpt : model_arg, &m, &st, &config_text,
                                   &model_tok);
    if (rc) return rc;
    anneal_tokenizer *tok = NULL;
    rc = 1;
    char tok_from[PATH_MAX + 64] = "--tokenizer";
    if (!tok_spec) snprintf(tok_from, sizeof tok_from, "the model's tokenizer.json");
    if (onnx) {
        anneal_onnx_save_opts oo = {.kv_cache = onnx_kv, .external_data = onnx_ext};
        if (anneal_model_save_onnx(m, out, &oo) != ANNEAL_OK) {
            fprintf(stderr, "anneal export: --out %s: %s\n", out, anneal_last_error());
            goto done;
        }
        fprintf(stderr, "anneal export: %s: %s model, %lld parameters, ONNX opset %d, f32 weights%s%s\n", out,
                m->cfg.arch, (long long)anneal_model_num_params(m), ANNEAL_ONNX_OPSET,
                onnx_kv ? ", KV-cache inputs/outputs" : "", onnx_ext ? ", external data in OUT.data" : "");
        rc = 0;
        goto done;
    }
    if (!tok_spec) tok_spec = model_tok;
    if (!tok_spec) {
        cJSON *config = NULL;
        if (config_text && anneal_json_parse(config_text, strlen(config_text), "the checkpoint's trainer config",
                                             &config) != ANNEAL_OK) {
            fprintf(stderr, "anneal export: %s\n", anneal_last_error());
            goto done;
        }
        tok_spec = run_tok = anneal_cli_run_tokenizer(config, tok_from, sizeof tok_from);
        cJSON_Delete(config);
    }
    if (tok_spec && strcmp(tok_spec, "none")) {
        if (anneal_cli_tokenizer_load(tok_spec, &tok) != ANNEAL_OK) {
            anneal_cli_tokenizer_error("export", tok_spec, tok_from, anneal_last_error());
            goto done;
        }
        uint64_t fp = anneal_tokenizer_fingerprint(tok);
        if (st.tokenizer_fingerprint && fp != st.tokenizer_fingerprint) {
            fprintf(stderr, "anneal export: --tokenizer %s: fingerprint %016llx does not match the checkpoint's %016llx "
                            "(the model was trained on ids of another tokenizer)\n",
                    tok_spec, (unsigned long long)fp, (unsigned long long)st.tokenizer_fingerprint);
            rc = 2;
            goto done;
        }
        if (anneal_tokenizer_vocab_size(tok) > m->cfg.vocab_size) {
            fprintf(stderr, "anneal export: --tokenizer %s: %d ids, more than the model's vocabulary of %d\n", tok_spec,
                    anneal_tokenizer_vocab_size(tok), m->cfg.vocab_size);
            rc = 2;
            goto done;
        }
    } else if (!tok_spec) {
        fprintf(stderr, "anneal export: note: no tokenizer known for this model (give --tokenizer): %s gets none\n", out);
    }
    o.tokenizer = go.tokenizer = tok;
    if (gguf) {
        if (anneal_model_save_gguf(m, out, &go) != ANNEAL_OK) {
            fprintf(stderr, "anneal export: --out %s: %s\n", out, anneal_last_error());
            goto done;
        }
        fprintf(stderr, "anneal export: %s: GGUF %s model, %lld parameters, %s weights%s\n", out, m->arch->gguf->name,
                (long long)anneal_model_num_params(m), gguf_type, tok ? ", with its tokenizer" : "");
        rc = 0;
        goto done;
    }
    if (anneal_model_save_hf(m, out, &o) != ANNEAL_OK) {
        fprintf(stderr, "anneal export: --out %s: %s\n", out, anneal_last_error());
        goto done;
    }
    fprintf(stderr, "anneal export: %s: %s model, %lld parameters, %s%s\n", out, m->cfg.arch,
            (long long)anneal_model_num_params(m), anneal_dtype_name(o.dtype), tok ? ", with its tokenizer" : "");
    rc = 0;
done:
    anneal_tokenizer_free(tok);
    anneal_model_free(m);
    free(config_text);
    free(model_tok);
    free(run_tok);
    return rc;
}
