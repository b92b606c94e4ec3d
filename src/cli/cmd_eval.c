/* anneal eval: loss and perplexity of a model (a checkpoint, a Hugging Face model
 * directory, a preset) on token shards. Every window of T+1 tokens of the split is
 * read once, in order (the loader without shuffling); the last, partial batch counts
 * only its real rows. Prints "loss X ppl Y tokens Z" on stdout (with --json one object
 * {"loss", "ppl", "tokens", "batches"}): the mean next-token cross-entropy over Z
 * predicted tokens and exp of it. */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define USAGE_ERR(...) (fprintf(stderr, "anneal eval: " __VA_ARGS__), fputc('\n', stderr), 2)

/* An integer setting of the checkpoint's training run (fallback if absent). */
static int64_t config_int(const cJSON *config, const char *key, int64_t fallback) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(config, key);
    return cJSON_IsNumber(v) && v->valuedouble >= 1 ? (int64_t)v->valuedouble : fallback;
}

/* The batches of an evaluation: the loader's windows in order, the last batch real
 * only up to rows_last (the rest of its rows wrap around to the first windows). */
typedef struct eval_source {
    anneal_loader *l;
    int64_t batch, n, rows_last;
} eval_source;

static anneal_status next_batch(void *user, int64_t i, int32_t *ids, int32_t *targets, int64_t *rows) {
    eval_source *e = user;
    *rows = i == e->n - 1 ? e->rows_last : e->batch;
    return anneal_loader_next(e->l, ids, targets);
}

/* True when the flag called name was given. */
static bool given(const cli_flag *flags, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(flags[i].name, name)) return flags[i].seen;
    return false;
}

int anneal_cmd_eval(int argc, char **argv) {
    const char *ckpt = NULL, *model_arg = NULL, *data = NULL, *split = "val", *dtype = "fp32", *device = "cpu";
    int64_t batch = 0, seq = 0, max_batches = 0, threads = 0;
    bool help = false, json = false;
    cli_flag flags[] = {
        {"ckpt", ARG_STRING, "checkpoint directory, or a run directory (its latest checkpoint)", &ckpt, 0},
        {"model", ARG_STRING, "instead of --ckpt: a Hugging Face model directory (config.json + model.safetensors "
                              "or a sharded index), a checkpoint or run directory, or a preset (random weights)", &model_arg, 0},
        {"json", ARG_BOOL, "print one JSON object {\"loss\", \"ppl\", \"tokens\", \"batches\"} instead of the text line", &json, 0},
        {"data", ARG_STRING, "directory of shards from anneal prepare, or one shard file", &data, 0},
        {"split", ARG_STRING, "which shards of a directory: val or train (default val)", &split, 0},
        {"batch", ARG_INT, "sequences per batch (default: the run's, else 8)", &batch, 0},
        {"seq", ARG_INT, "tokens per sequence T, at most n_ctx (default: the run's, else min(n_ctx, 256))", &seq, 0},
        {"max-batches", ARG_INT, "evaluate at most this many batches (default 0: every window)", &max_batches, 0},
        {"threads", ARG_INT, "CPU threads (default: all cores)", &threads, 0},
        {"device", ARG_STRING, "where the model runs: cpu, cuda (GPU 0) or cuda:N (default cpu)", &device, 0},
        {"dtype", ARG_STRING, "matmul precision: fp32, bf16 or fp16 (default fp32)", &dtype, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("eval", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("eval", "Loss and perplexity of a model (checkpoint or Hugging Face directory) on token shards.", flags,
                  nf);
        return 0;
    }
    if (!ckpt == !model_arg) return USAGE_ERR("give one of --ckpt DIR or --model DIR|PRESET");
    if (!data) return USAGE_ERR("--data DIR|FILE is required");
    if (strcmp(split, "val") && strcmp(split, "train")) return USAGE_ERR("--split: '%s' is not val or train", split);
    if (given(flags, nf, "batch") && (batch < 1 || batch > (1 << 20))) return USAGE_ERR("--batch: %lld is out of range", (long long)batch);
    if (given(flags, nf, "seq") && seq < 1) return USAGE_ERR("--seq: %lld must be >= 1", (long long)seq);
    if (max_batches < 0) return USAGE_ERR("--max-batches: %lld must be >= 0", (long long)max_batches);
    if (threads < 0 || threads > 4096) return USAGE_ERR("--threads: %lld is out of range", (long long)threads);
    if (threads > 0) anneal_set_num_threads((int)threads);
    anneal_dtype compute;
    if (anneal_cli_parse_dtype("eval", dtype, &compute)) return 2;

    anneal_model *m = NULL;
    anneal_train_state st = {0};
    char *config_text = NULL, *model_tok = NULL;
    anneal_device dev;
    if (anneal_cli_parse_device("eval", device, &dev)) return 2;
    int rc = ckpt ? anneal_cli_load_checkpoint_on("eval", ckpt, dev, &m, &st, &config_text)
                  : anneal_cli_load_model_on("eval", "model", model_arg, dev, &m, &st, &config_text, &model_tok);
    if (rc) return rc;
    anneal_model_set_compute(m, compute);
    cJSON *config = NULL;
    if (config_text && anneal_json_parse(config_text, strlen(config_text), "the checkpoint's trainer config", &config) !=
                           ANNEAL_OK) {
        fprintf(stderr, "anneal eval: %s\n", anneal_last_error());
        free(config_text);
        anneal_model_free(m);
        return 1;
    }
    free(config_text);
    int64_t n_ctx = m->cfg.n_ctx;
    if (!given(flags, nf, "batch")) batch = config_int(config, "batch", 8);
    if (!given(flags, nf, "seq")) {
        seq = config_int(config, "seq", n_ctx < 256 ? n_ctx : 256);
        if (seq > n_ctx) seq = n_ctx;
    }
    cJSON_Delete(config);
    anneal_loader *l = NULL;
    rc = 1;
    if (seq > n_ctx) {
        rc = USAGE_ERR("--seq: %lld is longer than the model's context of %lld", (long long)seq, (long long)n_ctx);
        goto done;
    }
    anneal_loader_config lc = {.batch = batch, .seq = seq, .shuffle = false, .rank = 0, .world = 1, .prefetch = true};
    if (anneal_loader_open(data, split, &lc, &l) != ANNEAL_OK) {
        fprintf(stderr, "anneal eval: --data %s: %s\n", data, anneal_last_error());
        goto done;
    }
    struct stat dsb; /* a directory of shards (not one shard file): complete only with its prepare.json */
    if (stat(data, &dsb) == 0 && S_ISDIR(dsb.st_mode) && anneal_prepare_check_dir(data) != ANNEAL_OK) {
        fprintf(stderr, "anneal eval: --data: %s\n", anneal_last_error());
        goto done;
    }
    uint64_t fp = anneal_loader_fingerprint(l);
    if (st.tokenizer_fingerprint && fp != st.tokenizer_fingerprint) {
        fprintf(stderr,
                "anneal eval: --data %s: tokenizer fingerprint %016llx does not match the checkpoint's %016llx "
                "(the shards were made with another tokenizer)\n",
                data, (unsigned long long)fp, (unsigned long long)st.tokenizer_fingerprint);
        goto done;
    }
    if (model_tok && !st.tokenizer_fingerprint) { /* a model directory's tokenizer.json: the shards should be its ids */
        anneal_tokenizer *tok = NULL;
        if (anneal_cli_tokenizer_load(model_tok, &tok) != ANNEAL_OK) {
            fprintf(stderr, "anneal eval: --model: %s: %s\n", model_tok, anneal_last_error());
            goto done;
        }
        if (anneal_tokenizer_fingerprint(tok) != fp)
            fprintf(stderr, "anneal eval: note: --data %s was made with tokenizer %016llx, the model's %s is %016llx\n",
                    data, (unsigned long long)fp, model_tok, (unsigned long long)anneal_tokenizer_fingerprint(tok));
        anneal_tokenizer_free(tok);
    }
    if (anneal_loader_vocab_size(l) > (uint32_t)m->cfg.vocab_size) {
        fprintf(stderr, "anneal eval: --data %s: vocabulary of %u ids exceeds the model's %d\n", data,
                anneal_loader_vocab_size(l), m->cfg.vocab_size);
        goto done;
    }
    /* every window once: full batches, then the rest in one partial batch */
    uint64_t W = anneal_loader_windows(l);
    int64_t n = (int64_t)(W / (uint64_t)batch), rows_last = batch;
    if (W % (uint64_t)batch) n++, rows_last = (int64_t)(W % (uint64_t)batch);
    if (max_batches > 0 && n > max_batches) n = max_batches, rows_last = batch;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double loss;
    int64_t tokens;
    eval_source src = {l, batch, n, rows_last};
    if (anneal_model_evaluate(m, batch, seq, n, next_batch, &src, &loss, &tokens) != ANNEAL_OK) {
        fprintf(stderr, "anneal eval: %s\n", anneal_last_error());
        goto done;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    if (json && isfinite(loss))
        printf("{\"loss\": %.17g, \"ppl\": %.17g, \"tokens\": %lld, \"batches\": %lld}\n", loss, exp(loss),
               (long long)tokens, (long long)n);
    else if (json) /* JSON has no NaN: a non-finite loss is null */
        printf("{\"loss\": null, \"ppl\": null, \"tokens\": %lld, \"batches\": %lld}\n", (long long)tokens, (long long)n);
    else printf("loss %.4f ppl %.2f tokens %lld\n", loss, exp(loss), (long long)tokens);
    fprintf(stderr, "anneal eval: %lld batches of %lld x %lld from %s (%s), %.2f s (%.0f tokens/s)\n", (long long)n,
            (long long)batch, (long long)seq, data, split, dt, dt > 0 ? (double)tokens / dt : 0.0);
    rc = 0;
done:
    anneal_loader_free(l);
    anneal_model_free(m);
    free(model_tok);
    return rc;
}
