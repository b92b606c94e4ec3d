/* anneal serve: flags, the model and its tokenizer, then the server of src/serve/
 * until SIGINT or SIGTERM (a graceful stop: running requests finish within --grace). */
#include "anneal/anneal.h"
#include "anneal/serve.h"
#include "args.h"
#include "commands.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop_signal = 0;

static void on_signal(int sig) { stop_signal = sig; }

#define USAGE_ERR(...) (fprintf(stderr, "anneal serve: " __VA_ARGS__), fputc('\n', stderr), 2)

/* The last path component of p without trailing slashes, into buf. */
static const char *base_name(const char *p, char *buf, size_t n) {
    snprintf(buf, n, "%s", p);
    size_t len = strlen(buf);
    while (len > 1 && buf[len - 1] == '/') buf[--len] = '\0';
    const char *slash = strrchr(buf, '/');
    return slash ? slash + 1 : buf;
}

int anneal_cmd_serve(int argc, char **argv) {
    const char *ckpt = NULL, *model_arg = NULL, *tok_spec = NULL, *host = "127.0.0.1", *dtype = "fp32", *kv_dtype_arg = "f32",
               *model_name = NULL, *device = "cpu";
    int64_t port = 8000, slots = 16, queue = 64, max_conn = 256, max_body = 1 << 20, max_tokens = 0, threads = 0,
            step_delay = 0, prefill_chunk = 256;
    double timeout = 600, grace = 10;
    bool help = false;
    cli_flag flags[] = {
        {"ckpt", ARG_STRING, "checkpoint directory, or a run directory (its latest checkpoint)", &ckpt, 0},
        {"model", ARG_STRING, "instead of --ckpt: a Hugging Face model directory, a checkpoint or run directory, or a "
                              "preset (random weights)", &model_arg, 0},
        {"tokenizer", ARG_STRING, "gpt2, a tokenizer directory or tokenizer.json (default: the model's, else the "
                                  "training run's)", &tok_spec, 0},
        {"host", ARG_STRING, "address to listen on (default 127.0.0.1: this machine only)", &host, 0},
        {"port", ARG_INT, "TCP port (default 8000; 0: any free port, printed at start)", &port, 0},
        {"model-name", ARG_STRING, "the model id clients name and /v1/models lists (default: the directory's name "
                                   "or the preset)", &model_name, 0},
        {"slots", ARG_INT, "requests decoded together in each step (default 16)", &slots, 0},
        {"queue", ARG_INT, "requests waiting for a slot before 429 (default 64)", &queue, 0},
        {"max-connections", ARG_INT, "concurrent HTTP connections (default 256)", &max_conn, 0},
        {"max-body", ARG_INT, "largest request body in bytes before 413 (default 1048576)", &max_body, 0},
        {"max-tokens", ARG_INT, "largest max_tokens of a request, and a chat request's default (default: the "
                                "model's context)", &max_tokens, 0},
        {"request-timeout", ARG_FLOAT, "seconds a request may take from arrival; then it ends (finish_reason "
                                       "\"length\", or 504 while still queued) (default 600)", &timeout, 0},
        {"grace", ARG_FLOAT, "on SIGINT/SIGTERM, seconds running requests get to finish before they are cut "
                             "(default 10)", &grace, 0},
        {"threads", ARG_INT, "CPU threads (default: all cores)", &threads, 0},
        {"dtype", ARG_STRING, "matmul precision: fp32, bf16 or fp16 (default fp32)", &dtype, 0},
        {"kv-dtype", ARG_STRING, "KV cache storage: f32, bf16 or int8 (default f32)", &kv_dtype_arg, 0},
        {"device", ARG_STRING, "where the model runs: cpu only for now (the server's batched decoding is not "
                               "built for GPUs yet)", &device, 0},
        {"prefill-chunk", ARG_INT, "prompt tokens per pass over the model, over all new prompts: a longer prompt "
                                   "is prefilled over several passes while the running requests keep stepping "
                                   "(default 256)", &prefill_chunk, 0},
        {"step-delay-ms", ARG_INT, "test aid: sleep this long before each decode step (default 0)", &step_delay, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("serve", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("serve", "Serves a model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions "
                           "(streaming or not), /v1/models, /health, /metrics.", flags, nf);
        return 0;
    }
    if ((ckpt != NULL) + (model_arg != NULL) != 1) return USAGE_ERR("give one of --ckpt DIR or --model DIR|PRESET");
    if (port < 0 || port > 65535) return USAGE_ERR("--port: %lld is out of range [0, 65535]", (long long)port);
    if (slots < 1 || slots > 4096) return USAGE_ERR("--slots: %lld must be in [1, 4096]", (long long)slots);
    if (prefill_chunk < 1 || prefill_chunk > 1000000)
        return USAGE_ERR("--prefill-chunk: %lld must be in [1, 1000000]", (long long)prefill_chunk);
    if (queue < 1 || queue > 1000000) return USAGE_ERR("--queue: %lld must be in [1, 1000000]", (long long)queue);
    if (max_conn < 1 || max_conn > 100000) return USAGE_ERR("--max-connections: %lld must be in [1, 100000]", (long long)max_conn);
    if (max_body < 64 || max_body > (1LL << 30)) return USAGE_ERR("--max-body: %lld must be in [64, 2^30]", (long long)max_body);
    if (max_tokens < 0 || max_tokens > INT32_MAX) return USAGE_ERR("--max-tokens: %lld is out of range", (long long)max_tokens);
    if (!(timeout > 0 && timeout <= 86400)) return USAGE_ERR("--request-timeout: %g must be in (0, 86400]", timeout);
    if (!(grace >= 0 && grace <= 3600)) return USAGE_ERR("--grace: %g must be in [0, 3600]", grace);
    if (threads < 0 || threads > 4096) return USAGE_ERR("--threads: %lld is out of range", (long long)threads);
    if (step_delay < 0 || step_delay > 10000) return USAGE_ERR("--step-delay-ms: %lld must be in [0, 10000]", (long long)step_delay);
    if (threads > 0) anneal_set_num_threads((int)threads);
    anneal_dtype compute;
    if (anneal_cli_parse_dtype("serve", dtype, &compute)) return 2;
    anneal_dtype kv_dtype;
    if (anneal_cli_parse_kv_dtype("serve", kv_dtype_arg, &kv_dtype)) return 2;
    anneal_device dev;
    if (anneal_cli_parse_device("serve", device, &dev)) return 2;
    if (dev != ANNEAL_CPU)
        return USAGE_ERR("--device %s: serve runs on the CPU only for now (its batched decoding is not built for "
                         "other devices yet); anneal generate --device %s runs one prompt there", device, device);

    anneal_model *m = NULL;
    anneal_train_state st = {0};
    char *config_text = NULL, *model_tok = NULL;
    int rc = ckpt ? anneal_cli_load_checkpoint("serve", ckpt, &m, &st, &config_text)
                  : anneal_cli_load_model("serve", "model", model_arg, &m, &st, &config_text, &model_tok);
    if (rc) return rc;
    anneal_model_set_compute(m, compute);
    anneal_model_set_kv_dtype(m, kv_dtype);
    if (anneal_cli_pack_bf16("serve", m)) {
        anneal_model_free(m);
        free(config_text);
        free(model_tok);
        return 1;
    }
    anneal_tokenizer *tok = NULL;
    anneal_server *srv = NULL;
    rc = anneal_cli_model_tokenizer("serve", ckpt, tok_spec, model_tok, config_text, st.tokenizer_fingerprint, &tok);
    free(config_text);
    if (rc) goto done;
    rc = 1;
    char namebuf[PATH_MAX];
    anneal_serve_config cfg = {
        .host = host, .port = (int)port,
        .model_name = model_name ? model_name : base_name(ckpt ? ckpt : model_arg, namebuf, sizeof namebuf),
        .slots = (int)slots, .queue = (int)queue, .max_connections = (int)max_conn, .max_body = (size_t)max_body,
        .max_tokens = max_tokens ? max_tokens : m->cfg.n_ctx, .request_timeout_s = timeout,
        .step_delay_ms = (int)step_delay, .prefill_chunk = prefill_chunk};
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (anneal_server_start(m, tok, &cfg, &srv) != ANNEAL_OK) {
        fprintf(stderr, "anneal serve: %s\n", anneal_last_error());
        goto done;
    }
    fprintf(stderr, "anneal serve: listening on http://%s:%d (model \"%s\", %d slots, queue %d, context %d, KV cache "
                    "%s %.1f MiB)\n", host, anneal_server_port(srv), cfg.model_name, cfg.slots, cfg.queue, m->cfg.n_ctx,
            anneal_dtype_name(kv_dtype), (double)anneal_cli_kv_cache_bytes(m, cfg.slots, m->cfg.n_ctx, kv_dtype) / (1 << 20));
    fflush(stderr);
    while (!stop_signal) nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
    fprintf(stderr, "anneal serve: %s: stopping (running requests get up to %g s)\n",
            stop_signal == SIGINT ? "SIGINT" : "SIGTERM", grace);
    anneal_server_stop(srv, grace);
    fprintf(stderr, "anneal serve: stopped\n");
    rc = 0;
done:
    free(model_tok);
    anneal_tokenizer_free(tok);
    anneal_model_free(m);
    return rc;
}
