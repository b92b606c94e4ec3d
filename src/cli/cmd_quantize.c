/* anneal quantize: a trained model (checkpoint, run or model directory) to an int8
 * model directory (docs/FORMATS.md): weight-only (per output channel or per group of
 * --group in-features), dynamic (int8 weights, per-token int8 activations) or static
 * (int8 weights, per-layer activation scales calibrated on --calib-data batches). */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define USAGE_ERR(...) (fprintf(stderr, "anneal quantize: " __VA_ARGS__), fputc('\n', stderr), 2)

typedef struct calib_source {
    anneal_loader *l;
    int64_t batch;
} calib_source;

/* The evaluation loop's batch callback: the loader's next full batch. */
static anneal_status next_batch(void *user, int64_t i, int32_t *ids, int32_t *targets, int64_t *rows) {
    calib_source *c = user;
    (void)i;
    *rows = c->batch;
    return anneal_loader_next(c->l, ids, targets);
}

/* Runs n batches of the train split of data through m while its dense layers record
 * their inputs, then turns the statistics into scales. Returns 0 or prints and 1. */
static int calibrate(anneal_model *m, const char *data, int64_t n, int64_t batch, int64_t seq,
                     anneal_calib_method method, double pct) {
    anneal_loader *l = NULL;
    anneal_loader_config lc = {.batch = batch, .seq = seq, .shuffle = false, .rank = 0, .world = 1, .prefetch = true};
    if (anneal_loader_open(data, "train", &lc, &l) != ANNEAL_OK) {
        fprintf(stderr, "anneal quantize: --calib-data %s: %s\n", data, anneal_last_error());
        return 1;
    }
    int rc = 1;
    if (anneal_loader_vocab_size(l) > (uint32_t)m->cfg.vocab_size) {
        fprintf(stderr, "anneal quantize: --calib-data %s: vocabulary of %u ids exceeds the model's %d\n", data,
                anneal_loader_vocab_size(l), m->cfg.vocab_size);
        goto done;
    }
    double loss;
    int64_t tokens;
    calib_source src = {l, batch};
    if (anneal_nn_calibrate_begin(m->params) != ANNEAL_OK ||
        anneal_model_evaluate(m, batch, seq, n, next_batch, &src, &loss, &tokens) != ANNEAL_OK ||
        anneal_nn_calibrate_end(m->params, method, pct) != ANNEAL_OK) {
        fprintf(stderr, "anneal quantize: calibration: %s\n", anneal_last_error());
        goto done;
    }
    fprintf(stderr, "anneal quantize: calibrated on %lld batches of %lld x %lld (%lld tokens, loss %.4f)\n",
            (long long)n, (long long)batch, (long long)seq, (long long)tokens, loss);
    rc = 0;
done:
    anneal_loader_free(l);
    return rc;
}

/* The tokenizer directory of a --ckpt argument (its checkpoint holds tokenizer.json). */
static char *ckpt_tokenizer(const char *arg) {
    char dir[PATH_MAX], p[PATH_MAX + 32];
    struct stat sb;
    if (anneal_checkpoint_resolve(arg, dir, sizeof dir) != ANNEAL_OK) {
        anneal_clear_error();
        return NULL;
    }
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    return stat(p, &sb) == 0 ? strdup(dir) : NULL;
}

int anneal_cmd_quantize(int argc, char **argv) {
    const char *ckpt = NULL, *model_arg = NULL, *out = NULL, *mode_s = NULL, *calib = NULL, *method_s = "minmax", *head_s = "int8";
    int64_t group = 0, calib_batches = 8, batch = 8, seq = 0, threads = 0;
    double pct = 99.99;
    bool help = false;
    cli_flag flags[] = {
        {"ckpt", ARG_STRING, "checkpoint directory, or a run directory (its latest checkpoint)", &ckpt, 0},
        {"model", ARG_STRING, "instead of --ckpt: a Hugging Face model directory or a checkpoint/run directory", &model_arg, 0},
        {"out", ARG_STRING, "the quantized model directory to write (must not exist, or be empty)", &out, 0},
        {"mode", ARG_STRING, "weight-only, dynamic or static", &mode_s, 0},
        {"group", ARG_INT, "weight-only: scales per group of 32, 64 or 128 in-features (default 0: per output channel)", &group, 0},
        {"calib-data", ARG_STRING, "static: directory of token shards from anneal prepare (its train split is used)", &calib, 0},
        {"calib-batches", ARG_INT, "static: batches to calibrate on (default 8)", &calib_batches, 0},
        {"calib-method", ARG_STRING, "static: minmax or percentile (default minmax)", &method_s, 0},
        {"percentile", ARG_FLOAT, "static, percentile: the percentile of |x| taken as the range (default 99.99)", &pct, 0},
        {"batch", ARG_INT, "static: sequences per calibration batch (default 8)", &batch, 0},
        {"seq", ARG_INT, "static: tokens per calibration sequence (default min(n_ctx, 256))", &seq, 0},
        {"head", ARG_STRING, "the lm head: int8 (per row; dynamic products unless --mode weight-only) or f32 (default int8)", &head_s, 0},
        {"threads", ARG_INT, "CPU threads (default: all cores)", &threads, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("quantize", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("quantize", "Quantize a trained model to int8 (weight-only, dynamic or static) as a model directory.",
                  flags, nf);
        return 0;
    }
    if (!ckpt == !model_arg) return USAGE_ERR("give one of --ckpt DIR or --model DIR");
    if (!out) return USAGE_ERR("--out DIR is required");
    anneal_quant_mode mode;
    if (!mode_s) return USAGE_ERR("--mode weight-only|dynamic|static is required");
    if (!anneal_quant_mode_parse(mode_s, &mode))
        return USAGE_ERR("--mode: '%s' is not weight-only, dynamic or static", mode_s);
    if (group != 0 && group != 32 && group != 64 && group != 128)
        return USAGE_ERR("--group: %lld is not 0 (per output channel), 32, 64 or 128", (long long)group);
    if (group && mode != ANNEAL_QUANT_WEIGHT_ONLY)
        return USAGE_ERR("--group is for --mode weight-only (%s uses one scale per output channel)", mode_s);
    anneal_calib_method method;
    if (!strcmp(method_s, "minmax")) method = ANNEAL_CALIB_MINMAX;
    else if (!strcmp(method_s, "percentile")) method = ANNEAL_CALIB_PERCENTILE;
    else return USAGE_ERR("--calib-method: '%s' is not minmax or percentile", method_s);
    if (mode == ANNEAL_QUANT_STATIC && !calib) return USAGE_ERR("--mode static needs --calib-data DIR");
    if (mode != ANNEAL_QUANT_STATIC && calib) return USAGE_ERR("--calib-data is for --mode static");
    if (calib_batches < 1 || calib_batches > (1 << 20)) return USAGE_ERR("--calib-batches: %lld is out of range", (long long)calib_batches);
    if (batch < 1 || batch > (1 << 16)) return USAGE_ERR("--batch: %lld is out of range", (long long)batch);
    if (!(pct > 0.0 && pct <= 100.0)) return USAGE_ERR("--percentile: %g is not in (0, 100]", pct);
    if (strcmp(head_s, "int8") && strcmp(head_s, "f32")) return USAGE_ERR("--head: '%s' is not int8 or f32", head_s);
    if (threads < 0 || threads > 4096) return USAGE_ERR("--threads: %lld is out of range", (long long)threads);
    if (threads > 0) anneal_set_num_threads((int)threads);

    anneal_model *m = NULL;
    anneal_train_state st = {0};
    char *config_text = NULL, *tok_dir = NULL;
    int rc = ckpt ? anneal_cli_load_checkpoint("quantize", ckpt, &m, &st, &config_text)
                  : anneal_cli_load_model("quantize", "model", model_arg, &m, &st, &config_text, &tok_dir);
    free(config_text);
    if (rc) return rc;
    if (ckpt) tok_dir = ckpt_tokenizer(ckpt);
    anneal_tokenizer *tok = NULL;
    rc = 1;
    if (m->params->quant != ANNEAL_QUANT_NONE) {
        fprintf(stderr, "anneal quantize: the model is quantized already (%s)\n", anneal_quant_mode_name(m->params->quant));
        goto done;
    }
    if (tok_dir && anneal_tokenizer_load(tok_dir, &tok) != ANNEAL_OK) {
        fprintf(stderr, "anneal quantize: the model's tokenizer %s: %s\n", tok_dir, anneal_last_error());
        goto done;
    }
    if (mode == ANNEAL_QUANT_STATIC) {
        if (!seq) seq = m->cfg.n_ctx < 256 ? m->cfg.n_ctx : 256;
        if (seq < 1 || seq > m->cfg.n_ctx) {
            rc = USAGE_ERR("--seq: %lld is not in [1, n_ctx %lld]", (long long)seq, (long long)m->cfg.n_ctx);
            goto done;
        }
        if (calibrate(m, calib, calib_batches, batch, seq, method, pct)) goto done;
    }
    if (anneal_nn_quantize(m->params, mode, group) != ANNEAL_OK ||
        (!strcmp(head_s, "int8") && anneal_model_quantize_head(m) != ANNEAL_OK)) {
        fprintf(stderr, "anneal quantize: %s\n", anneal_last_error());
        goto done;
    }
    anneal_quant_save_opts so = {.tokenizer = tok, .calib_method = mode == ANNEAL_QUANT_STATIC ? method_s : NULL,
                                 .percentile = pct, .calib_batches = (int)calib_batches};
    if (anneal_quant_save(m, out, &so) != ANNEAL_OK) {
        fprintf(stderr, "anneal quantize: --out %s: %s\n", out, anneal_last_error());
        goto done;
    }
    fprintf(stderr, "anneal quantize: wrote %s (%s%s, lm head %s)\n", out, mode_s,
            group ? (group == 32 ? ", group 32" : group == 64 ? ", group 64" : ", group 128") : "", head_s);
    rc = 0;
done:
    anneal_tokenizer_free(tok);
    free(tok_dir);
    anneal_model_free(m);
    return rc;
}
