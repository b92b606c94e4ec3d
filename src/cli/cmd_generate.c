/* anneal generate: text from a checkpoint (or Hugging Face weights), streamed
 * to stdout as tokens arrive. The model runs with a KV cache; sampling is
 * temperature, top-k, top-p with a seeded counter-based draw, so a seed reproduces
 * the text exactly. Generation stops at the tokenizer's end-of-text or --max-tokens.
 * Also home of the checkpoint loading `anneal eval` shares. */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int anneal_cli_load_checkpoint(const char *cmd, const char *arg, anneal_model **model,
                               anneal_train_state *st, char **config_json) {
    return anneal_cli_load_checkpoint_on(cmd, arg, ANNEAL_CPU, model, st, config_json);
}

int anneal_cli_parse_device(const char *cmd, const char *name, anneal_device *out) {
    if (anneal_train_device_resolve(name, out) == ANNEAL_OK) return 0;
    fprintf(stderr, "anneal %s: %s\n", cmd, anneal_last_error());
    anneal_clear_error();
    return 2;
}

int anneal_cli_load_checkpoint_on(const char *cmd, const char *arg, anneal_device dev, anneal_model **model,
                                  anneal_train_state *st, char **config_json) {
    char dir[PATH_MAX];
    anneal_model_config cfg;
    *model = NULL;
    *config_json = NULL;
    if (anneal_quant_dir_is_quantized(arg)) { /* an int8 model directory (anneal quantize) */
        if (anneal_model_load_hf(arg, dev, model) == ANNEAL_OK) return 0;
        fprintf(stderr, "anneal %s: --ckpt %s: %s\n", cmd, arg, anneal_last_error());
        return 1;
    }
    if (anneal_checkpoint_resolve(arg, dir, sizeof dir) != ANNEAL_OK ||
        anneal_checkpoint_read_config(dir, &cfg, config_json) != ANNEAL_OK) {
        fprintf(stderr, "anneal %s: --ckpt: %s\n", cmd, anneal_last_error());
        return 1;
    }
    /* on dev: the checkpoint's tensors are copied to it as they are read */
    anneal_model *m = anneal_model_new(&cfg, dev);
    if (!m || anneal_checkpoint_load(dir, m, NULL, st) != ANNEAL_OK) {
        fprintf(stderr, "anneal %s: --ckpt %s: %s\n", cmd, dir, anneal_last_error());
        anneal_model_free(m);
        free(*config_json);
        *config_json = NULL;
        return 1;
    }
    *model = m;
    return 0;
}

int anneal_cli_parse_dtype(const char *cmd, const char *name, anneal_dtype *out) {
    if (anneal_train_dtype_parse(name, out)) return 0;
    fprintf(stderr, "anneal %s: --dtype: unknown precision '%s' (fp32, bf16, fp16)\n", cmd, name);
    return 2;
}

int anneal_cli_pack_bf16(const char *cmd, anneal_model *m) {
    if (m->ctx.compute != ANNEAL_BF16 || anneal_model_device(m) != ANNEAL_CPU) return 0;
    if (anneal_params_pack_bf16(m->params) == ANNEAL_OK) return 0;
    fprintf(stderr, "anneal %s: packing the weights as bf16: %s\n", cmd, anneal_last_error());
    return 1;
}

int anneal_cli_parse_kv_dtype(const char *cmd, const char *name, anneal_dtype *out) {
    if (anneal_dtype_parse(name, out) && (*out == ANNEAL_F32 || *out == ANNEAL_BF16 || *out == ANNEAL_I8)) return 0;
    fprintf(stderr, "anneal %s: --kv-dtype: unknown KV cache dtype '%s' (f32, bf16, int8)\n", cmd, name);
    return 2;
}

int64_t anneal_cli_kv_cache_bytes(const anneal_model *m, int64_t slots, int64_t max_len, anneal_dtype kv_dtype) {
    const anneal_model_config *c = &m->cfg;
    int64_t hkv = c->n_kv_head ? c->n_kv_head : c->n_head, D = c->n_embd / c->n_head;
    int64_t rows = 2 * (int64_t)c->n_layer * slots * hkv * max_len;
    return rows * D * (int64_t)anneal_dtype_size(kv_dtype) + (kv_dtype == ANNEAL_I8 ? rows * 4 : 0);
}

/* Loads a Hugging Face model given as --hf-model (a directory or a weights file) with
 * an explicit --hf-config config.json. */
static int load_hf(const char *weights, const char *config, anneal_device dev, anneal_model **model) {
    anneal_model_config cfg;
    *model = NULL;
    if (anneal_model_config_from_hf_file(config, &cfg) != ANNEAL_OK) {
        fprintf(stderr, "anneal generate: --hf-config: %s\n", anneal_last_error());
        return 1;
    }
    anneal_model *m = anneal_model_new(&cfg, dev);
    if (!m || anneal_model_load_hf_weights(m, weights) != ANNEAL_OK) {
        fprintf(stderr, "anneal generate: --hf-model: %s\n", anneal_last_error());
        anneal_model_free(m);
        return 1;
    }
    *model = m;
    return 0;
}

/* Where generated text goes: the streaming decoder and a token count. */
typedef struct sink {
    anneal_stream_decoder dec;
    int32_t vocab; /* the tokenizer's: ids past it (a padded model vocabulary) print U+FFFD */
    char *buf;
    size_t cap;
    int64_t n;
    bool write_failed;
} sink;

static bool emit(const char *p, size_t n, sink *s) {
    if (n && fwrite(p, 1, n, stdout) != n) s->write_failed = true;
    if (fflush(stdout) != 0) s->write_failed = true;
    return !s->write_failed; /* a closed pipe ends generation */
}

static bool on_token(int32_t id, void *user) {
    sink *s = user;
    s->n++;
    size_t len = 0;
    const char *bytes = anneal_tokenizer_token_bytes(s->dec.tok, id, &len);
    if (bytes && len + 64 > s->cap) { /* the decoder wants room for the token and pending bytes */
        char *g = realloc(s->buf, len + 64);
        if (!g) return false;
        s->buf = g;
        s->cap = len + 64;
    }
    if (!bytes || id >= s->vocab || anneal_stream_decoder_push(&s->dec, id, s->buf, s->cap, &len) != ANNEAL_OK) {
        anneal_clear_error();
        return emit("\xEF\xBF\xBD", 3, s);
    }
    return emit(s->buf, len, s);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define USAGE_ERR(...) (fprintf(stderr, "anneal generate: " __VA_ARGS__), fputc('\n', stderr), 2)

int anneal_cmd_generate(int argc, char **argv) {
    const char *ckpt = NULL, *model_arg = NULL, *hf_model = NULL, *hf_config = NULL, *tok_spec = NULL, *prompt = NULL, *dtype = "fp32",
               *kv_dtype_arg = "f32", *device = "cpu";
    int64_t max_tokens = 200, top_k = 50, seed = 1337, threads = 0;
    double temperature = 0.8, top_p = 0.95;
    bool help = false, chat = false;
    cli_flag flags[] = {
        {"ckpt", ARG_STRING, "checkpoint directory, or a run directory (its latest checkpoint)", &ckpt, 0},
        {"model", ARG_STRING, "instead of --ckpt: a Hugging Face model directory (config.json + model.safetensors or "
                              "a sharded index), a checkpoint or run directory, or a preset (random weights)", &model_arg, 0},
        {"hf-model", ARG_STRING, "older spelling of --model for Hugging Face weights (a directory or a .safetensors "
                                 "file)", &hf_model, 0},
        {"hf-config", ARG_STRING, "a config.json for --hf-model (default: the one beside the weights)", &hf_config, 0},
        {"tokenizer", ARG_STRING, "gpt2, a tokenizer directory or tokenizer.json (default: the model's tokenizer.json, "
                                  "else the training run's, from its --tokenizer or its data's prepare.json)", &tok_spec, 0},
        {"prompt", ARG_STRING, "text to continue (default: start a new document)", &prompt, 0},
        {"chat", ARG_BOOL, "--prompt is a user message: apply the tokenizer's chat template (Llama 3, ChatML, "
                           "Llama 2, Mistral, Zephyr) and print only the reply", &chat, 0},
        {"max-tokens", ARG_INT, "most tokens to generate (default 200)", &max_tokens, 0},
        {"temperature", ARG_FLOAT, "sampling temperature; 0 picks the most likely token (default 0.8)", &temperature, 0},
        {"top-k", ARG_INT, "sample from the k most likely tokens; 0 = all (default 50)", &top_k, 0},
        {"top-p", ARG_FLOAT, "sample from the smallest set with this probability, in (0, 1] (default 0.95)", &top_p, 0},
        {"seed", ARG_INT, "seed of the draws: the same seed gives the same text (default 1337)", &seed, 0},
        {"threads", ARG_INT, "CPU threads (default: all cores)", &threads, 0},
        {"device", ARG_STRING, "where the model runs: cpu, cuda (GPU 0) or cuda:N (default cpu)", &device, 0},
        {"dtype", ARG_STRING, "matmul precision: fp32, bf16 or fp16 (default fp32)", &dtype, 0},
        {"kv-dtype", ARG_STRING, "KV cache storage: f32, bf16 or int8 (default f32)", &kv_dtype_arg, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("generate", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("generate", "Continues a prompt with a trained model, streaming the text to stdout.", flags, nf);
        return 0;
    }
    if ((ckpt != NULL) + (model_arg != NULL) + (hf_model != NULL) != 1)
        return USAGE_ERR("give one of --ckpt DIR or --model DIR|PRESET (--hf-model is the older spelling of --model)");
    if (hf_config && !hf_model) return USAGE_ERR("--hf-config goes with --hf-model (--model finds config.json itself)");
    if (hf_model && !hf_config && access(hf_model, F_OK) != 0)
        return USAGE_ERR("--hf-model %s: no such file or directory (give a model directory, or weights with --hf-config "
                         "config.json)", hf_model);
    if (max_tokens < 0 || max_tokens > INT32_MAX) return USAGE_ERR("--max-tokens: %lld is out of range", (long long)max_tokens);
    if (temperature < 0) return USAGE_ERR("--temperature: %g must be >= 0", temperature);
    if (top_k < 0 || top_k > INT32_MAX) return USAGE_ERR("--top-k: %lld must be >= 0", (long long)top_k);
    if (!(top_p > 0 && top_p <= 1)) return USAGE_ERR("--top-p: %g must be in (0, 1]", top_p);
    if (seed < 0) return USAGE_ERR("--seed: %lld must be >= 0", (long long)seed);
    if (threads < 0 || threads > 4096) return USAGE_ERR("--threads: %lld is out of range", (long long)threads);
    if (threads > 0) anneal_set_num_threads((int)threads);
    anneal_dtype compute;
    if (anneal_cli_parse_dtype("generate", dtype, &compute)) return 2;
    anneal_dtype kv_dtype;
    if (anneal_cli_parse_kv_dtype("generate", kv_dtype_arg, &kv_dtype)) return 2;

    anneal_device dev;
    if (anneal_cli_parse_device("generate", device, &dev)) return 2;

    anneal_model *m = NULL;
    anneal_train_state st = {0};
    char *config_text = NULL, *model_tok = NULL;
    int rc = ckpt         ? anneal_cli_load_checkpoint_on("generate", ckpt, dev, &m, &st, &config_text)
             : hf_config ? load_hf(hf_model, hf_config, dev, &m)
                         : anneal_cli_load_model_on("generate", model_arg ? "model" : "hf-model",
                                                    model_arg ? model_arg : hf_model, dev, &m, &st, &config_text,
                                                    &model_tok);
    if (rc) return rc;
    anneal_model_set_compute(m, compute);
    anneal_model_set_kv_dtype(m, kv_dtype);
    if (anneal_cli_pack_bf16("generate", m)) {
        anneal_model_free(m);
        free(config_text);
        free(model_tok);
        return 1;
    }
    anneal_tokenizer *tok = NULL;
    anneal_ids ids = {0};
    char *buf = NULL, *chat_text = NULL;
    rc = anneal_cli_model_tokenizer("generate", ckpt, tok_spec, model_tok, config_text, st.tokenizer_fingerprint, &tok);
    free(config_text);
    if (rc) goto done;
    rc = 1;
    int32_t eot = anneal_tokenizer_eot(tok), V = m->cfg.vocab_size;
    const char *text = prompt ? prompt : "";
    if (chat) { /* the template's text holds its special tokens (and BOS) itself */
        anneal_chat_message msg = {"user", text};
        if (anneal_chat_format(tok, &msg, 1, true, &chat_text, NULL) != ANNEAL_OK) {
            fprintf(stderr, "anneal generate: --chat: %s\n", anneal_last_error());
            goto done;
        }
    } else if (anneal_tokenizer_adds_bos(tok) && anneal_ids_push(&ids, anneal_tokenizer_bos(tok)) != ANNEAL_OK) {
        goto done;
    }
    if (anneal_tokenizer_encode(tok, chat ? chat_text : text, strlen(chat ? chat_text : text), chat, &ids) !=
        ANNEAL_OK) {
        fprintf(stderr, "anneal generate: --prompt: %s\n", anneal_last_error());
        goto done;
    }
    if (ids.n == 0) { /* nothing to continue: start a new document */
        if (eot < 0) {
            rc = USAGE_ERR("--prompt: give some text (the tokenizer has no end-of-text token to start from)");
            goto done;
        }
        if (anneal_ids_push(&ids, eot) != ANNEAL_OK) goto done;
    }
    for (size_t i = 0; i < ids.n; i++)
        if (ids.ids[i] < 0 || ids.ids[i] >= V) {
            fprintf(stderr, "anneal generate: --prompt: token id %d is outside the model's vocabulary of %d "
                            "(a tokenizer larger than the model's)\n", ids.ids[i], V);
            goto done;
        }
    sink s = {.vocab = anneal_tokenizer_vocab_size(tok), .cap = 4096};
    if (!(s.buf = malloc(s.cap))) {
        fprintf(stderr, "anneal generate: out of memory\n");
        goto done;
    }
    anneal_stream_decoder_init(&s.dec, tok);
    if (!chat) fputs(text, stdout);
    fflush(stdout);
    anneal_sampler_config sc = {.temperature = (float)temperature, .top_k = (int)top_k, .top_p = (float)top_p,
                                .seed = (uint64_t)seed};
    double t0 = now_s();
    anneal_status gs = anneal_model_generate(m, ids.ids, (int64_t)ids.n, max_tokens, &sc, eot, on_token, &s);
    double dt = now_s() - t0;
    buf = s.buf; /* freed at done */
    size_t tail = anneal_stream_decoder_flush(&s.dec, buf, s.cap);
    if (!s.write_failed) {
        emit(buf, tail, &s);
        emit("\n", 1, &s);
    }
    if (gs != ANNEAL_OK) {
        fprintf(stderr, "anneal generate: %s\n", anneal_last_error());
        goto done;
    }
    fprintf(stderr, "anneal generate: %zu prompt tokens, %lld generated in %.2f s (%.1f tokens/s); KV cache %s, "
            "%.2f MiB\n", ids.n, (long long)s.n, dt, dt > 0 ? (double)s.n / dt : 0.0, anneal_dtype_name(kv_dtype),
            (double)anneal_cli_kv_cache_bytes(m, 1, m->cfg.n_ctx, kv_dtype) / (1024.0 * 1024.0));
    rc = 0;
done:
    free(buf);
    free(chat_text);
    free(model_tok);
    anneal_ids_free(&ids);
    anneal_tokenizer_free(tok);
    anneal_model_free(m);
    return rc;
}
