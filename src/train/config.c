/* Training settings: defaults, the table of flags (name, kind, range, help), parsing
 * of one value, JSON objects of them (config files, the config saved in checkpoints)
 * and back. One table serves the CLI, --config-file and resume, so every path
 * validates a value the same way and names the flag in the error. */
#include "anneal/parse.h"
#include "anneal/train.h"
#include "train_internal.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* A setting: where it lives in the config and what values it accepts. */
typedef struct option_def {
    anneal_train_option opt;
    size_t offset;      /* of the field in anneal_train_config */
    double lo, hi;      /* numeric range (inclusive lo; hi inclusive unless hi_open) */
    bool lo_open, hi_open;
    const char *clears; /* a setting this one replaces (--steps vs --tokens) */
} option_def;

#define OFF(f) offsetof(anneal_train_config, f)
#define BIG 9.2e18

static const option_def defs[] = {
    {{"model", ANNEAL_OPT_STRING, "preset: tiny, d6, 124M, 350M, 774M, 1.5B, llama-tiny, llama-125M (default tiny; with --data the "
      "vocabulary is the data's), or a Hugging Face model directory to start from (as --init DIR)"}, OFF(model), 0, 0, 0, 0, "config"},
    {{"config", ANNEAL_OPT_STRING, "Hugging Face config.json instead of a preset (its model_type picks the "
      "architecture: gpt2, llama, mistral, qwen2)"}, OFF(config), 0, 0, 0, 0, "model"},
    {{"init", ANNEAL_OPT_STRING, "start from weights: a Hugging Face model directory (config.json + model.safetensors "
      "or a sharded index), a .safetensors file (config.json beside it), or a checkpoint"}, OFF(init), 0, 0, 0, 0, NULL},
    {{"data", ANNEAL_OPT_STRING, "directory of token shards from anneal prepare (train_*.bin, val_*.bin)"}, OFF(data), 0, 0, 0, 0, NULL},
    {{"tokenizer", ANNEAL_OPT_STRING, "tokenizer for samples (default: the one DATA/prepare.json names)"}, OFF(tokenizer), 0, 0, 0, 0, NULL},
    {{"synthetic", ANNEAL_OPT_ONOFF, "train on synthetic Markov-chain tokens instead of --data"}, OFF(synthetic), 0, 0, 0, 0, NULL},
    {{"batch", ANNEAL_OPT_INT, "sequences per micro-batch B (default 8)"}, OFF(batch), 1, 1 << 20, 0, 0, NULL},
    {{"seq", ANNEAL_OPT_INT, "sequence length T, at most the model's n_ctx (default 64)"}, OFF(seq), 1, 1 << 20, 0, 0, NULL},
    {{"accum", ANNEAL_OPT_INT, "gradient accumulation: micro-batches per step K, loss averaged (default 1)"}, OFF(accum), 1, 1 << 20, 0, 0, NULL},
    {{"steps", ANNEAL_OPT_INT, "optimizer steps (default 100)"}, OFF(steps), 1, BIG, 0, 0, "tokens"},
    {{"tokens", ANNEAL_OPT_INT, "train on this many tokens instead of --steps"}, OFF(tokens), 1, BIG, 0, 0, "steps"},
    {{"shuffle", ANNEAL_OPT_ONOFF, "visit windows in a seeded random order per epoch (default on)"}, OFF(shuffle), 0, 0, 0, 0, NULL},
    {{"lr", ANNEAL_OPT_FLOAT, "peak learning rate (default 1e-3)"}, OFF(lr), 0, 10, 1, 0, NULL},
    {{"min-lr", ANNEAL_OPT_FLOAT, "final learning rate of the decay (default lr/10)"}, OFF(min_lr), 0, 10, 0, 0, NULL},
    {{"warmup", ANNEAL_OPT_INT, "linear warmup steps (default 10)"}, OFF(warmup), 0, BIG, 0, 0, NULL},
    {{"schedule", ANNEAL_OPT_STRING, "constant, cosine, linear or wsd (default cosine)"}, OFF(schedule), 0, 0, 0, 0, NULL},
    {{"weight-decay", ANNEAL_OPT_FLOAT, "AdamW weight decay on matmul weights (default 0.1)"}, OFF(weight_decay), 0, 1e3, 0, 0, NULL},
    {{"beta1", ANNEAL_OPT_FLOAT, "AdamW beta1 (default 0.9)"}, OFF(beta1), 0, 1, 0, 1, NULL},
    {{"beta2", ANNEAL_OPT_FLOAT, "AdamW beta2 (default 0.95)"}, OFF(beta2), 0, 1, 0, 1, NULL},
    {{"eps", ANNEAL_OPT_FLOAT, "AdamW epsilon (default 1e-8)"}, OFF(eps), 0, 1, 1, 0, NULL},
    {{"clip", ANNEAL_OPT_FLOAT, "global gradient-norm clip, 0 = off (default 1.0)"}, OFF(clip), 0, 1e9, 0, 0, NULL},
    {{"dropout", ANNEAL_OPT_FLOAT, "dropout probability (default 0; with --config: the config's)"}, OFF(dropout), 0, 1, 0, 1, NULL},
    {{"seed", ANNEAL_OPT_INT, "seed for init, data order and dropout (default 1337)"}, OFF(seed), 0, BIG, 0, 0, NULL},
    {{"device", ANNEAL_OPT_STRING, "where the model trains, evaluates and samples: cpu, cuda (GPU 0) or cuda:N (GPU N); "
      "checkpoints are the same files on every device, so a run resumes on another (default cpu)"}, OFF(device), 0, 0, 0, 0, NULL},
    {{"threads", ANNEAL_OPT_INT, "CPU threads, 0 = all cores (default 0)"}, OFF(threads), 0, 4096, 0, 0, NULL},
    {{"recompute", ANNEAL_OPT_STRING, "activation recomputation in backward: none, attn (qkv + attention) or block "
      "(whole blocks); on = block, off = none (default none)"}, OFF(recompute), 0, 0, 0, 0, NULL},
    {{"pin-threads", ANNEAL_OPT_ONOFF, "pin each worker thread to one CPU of the allowed set (default off)"}, OFF(pin_threads), 0, 0, 0, 0, NULL},
    {{"dtype", ANNEAL_OPT_STRING, "matmul precision: fp32, bf16 or fp16; weights, optimizer, norms, softmax and loss "
      "stay fp32 (default fp32)"}, OFF(dtype), 0, 0, 0, 0, NULL},
    {{"loss-scale", ANNEAL_OPT_STRING, "fp16 only: dynamic (from --loss-scale-init, x2 after --scale-growth-interval clean steps, "
      "x0.5 and skip the step on overflow) or a static scale N (default dynamic)"}, OFF(loss_scale), 0, 0, 0, 0, NULL},
    {{"loss-scale-init", ANNEAL_OPT_FLOAT, "fp16 dynamic loss scale: the starting scale (default 65536 = 2^16)"},
     OFF(loss_scale_init), 0, 3.4e38, 1, 0, NULL},
    {{"scale-growth-interval", ANNEAL_OPT_INT, "fp16 dynamic loss scale: clean steps before it doubles (default 2000)"},
     OFF(scale_growth_interval), 1, 2147483647.0, 0, 0, NULL},
    {{"eval-every", ANNEAL_OPT_INT, "validation loss every N steps, 0 = only at the end (default 0)"}, OFF(eval_every), 0, BIG, 0, 0, NULL},
    {{"eval-batches", ANNEAL_OPT_INT, "batches of the val split per evaluation, 0 = no evaluation (default 20)"}, OFF(eval_batches), 0, 1 << 24, 0, 0, NULL},
    {{"sample-every", ANNEAL_OPT_INT, "print a generated text every N steps and at the end, 0 = never (default 0)"}, OFF(sample_every), 0, BIG, 0, 0, NULL},
    {{"sample-tokens", ANNEAL_OPT_INT, "tokens per sample (default 64)"}, OFF(sample_tokens), 1, 1 << 20, 0, 0, NULL},
    {{"sample-temperature", ANNEAL_OPT_FLOAT, "sampling temperature, 0 = greedy (default 0.8; top-k 40, seed --seed)"}, OFF(sample_temperature), 0, 100, 0, 0, NULL},
    {{"sample-prompt", ANNEAL_OPT_STRING, "prompt text for samples (default: a new document)"}, OFF(sample_prompt), 0, 0, 0, 0, NULL},
    {{"ckpt-every", ANNEAL_OPT_INT, "checkpoint every N steps (and always at the end), 0 = only at the end (default 250)"}, OFF(ckpt_every), 0, BIG, 0, 0, NULL},
    {{"keep", ANNEAL_OPT_INT, "checkpoints to keep, 0 = all (default 3)"}, OFF(keep), 0, 1 << 30, 0, 0, NULL},
    {{"out", ANNEAL_OPT_STRING, "run directory for checkpoints and log.jsonl (default runs/<timestamp>)"}, OFF(out), 0, 0, 0, 0, NULL},
    {{"resume", ANNEAL_OPT_OPTSTRING, "continue the run in DIR (a run directory or a checkpoint; default --out)"}, OFF(resume), 0, 0, 0, 0, NULL},
    {{"stop-at", ANNEAL_OPT_INT, "stop once step N is done, with a checkpoint, as an interruption would (the schedule "
      "still spans --steps; for time-sliced jobs), 0 = off"}, OFF(stop_at), 0, BIG, 0, 0, NULL},
    {{"log-jsonl", ANNEAL_OPT_STRING, "also append the JSON-lines log to FILE"}, OFF(log_jsonl), 0, 0, 0, 0, NULL},
    {{"tensorboard", ANNEAL_OPT_OPTSTRING, "write TensorBoard event files (scalars, samples, settings) into DIR "
      "(default <run>/tensorboard)"}, OFF(tensorboard), 0, 0, 0, 0, NULL},
    {{"metrics-port", ANNEAL_OPT_INT, "serve Prometheus metrics at http://ADDR:PORT/metrics while training, 0 = off "
      "(default 0)"}, OFF(metrics_port), 0, 65535, 0, 0, NULL},
    {{"metrics-addr", ANNEAL_OPT_STRING, "address --metrics-port listens on (default 127.0.0.1, loopback only)"},
     OFF(metrics_addr), 0, 0, 0, 0, NULL},
    {{"max-bad-steps", ANNEAL_OPT_INT, "stop after N non-finite (NaN/Inf) steps in a row; they are skipped (default 5)"}, OFF(max_bad_steps), 1, 1 << 30, 0, 0, NULL},
    {{"max-ckpt-failures", ANNEAL_OPT_INT, "stop after N checkpoint writes in a row failed (a full disk, a read-only "
      "directory), keeping the last complete checkpoint (default 3)"}, OFF(max_ckpt_failures), 1, 1 << 30, 0, 0, NULL},
    {{"peak-gflops", ANNEAL_OPT_FLOAT, "peak GFLOP/s for the MFU figure (default: measured by an FMA microbenchmark)"}, OFF(peak_gflops), 0, 1e12, 0, 0, NULL},
    {{"log-every", ANNEAL_OPT_INT, "plain progress line every N steps when not on a terminal (default 1)"}, OFF(log_every), 1, BIG, 0, 0, NULL},
    {{"profile", ANNEAL_OPT_INT, "profile steps N..N+K-1 (K: --profile-steps): a per-op table at the end and a Chrome "
      "trace (Perfetto, chrome://tracing) in the run directory; 0 = off"}, OFF(profile), 0, BIG, 0, 0, NULL},
    {{"profile-steps", ANNEAL_OPT_INT, "steps --profile covers (default 3)"}, OFF(profile_steps), 1, 1 << 20, 0, 0, NULL},
    {{"memory-report", ANNEAL_OPT_ONOFF, "print memory by category (parameters, gradients, optimizer state, "
      "activations, workspace, cache) after the first step and at the end"}, OFF(memory_report), 0, 0, 0, 0, NULL},
    {{"memory-limit", ANNEAL_OPT_FLOAT, "fail a step that would hold more than this many MiB of tensors (an "
      "out-of-memory error with the breakdown), 0 = none"}, OFF(memory_limit_mb), 0, 1e12, 0, 0, NULL},
    {{"lora-rank", ANNEAL_OPT_INT, "LoRA fine-tuning: adapters of rank R on --lora-targets, the base frozen (bf16 "
      "with --dtype bf16); 0 = train every parameter (default 0)"}, OFF(lora_rank), 0, 65536, 0, 0, NULL},
    {{"lora-alpha", ANNEAL_OPT_FLOAT, "LoRA: scale = alpha / rank (default: alpha = rank)"}, OFF(lora_alpha), 0, 1e6, 0, 0, NULL},
    {{"lora-targets", ANNEAL_OPT_STRING, "LoRA: comma-separated names of the layers to adapt (q_proj,k_proj,v_proj,o_proj,"
      "gate_proj,up_proj,down_proj; GPT-2: c_attn,c_proj,c_fc; default q_proj,v_proj, GPT-2 c_attn)"}, OFF(lora_targets), 0, 0, 0, 0, NULL},
    {{"lora-dropout", ANNEAL_OPT_FLOAT, "LoRA: dropout on the adapters' input (default 0)"}, OFF(lora_dropout), 0, 1, 0, 1, NULL},
    {{"lora-init", ANNEAL_OPT_STRING, "LoRA: start the adapters from a PEFT adapter directory (adapter_config.json + "
      "adapter_model.safetensors; its r, alpha, targets unless given)"}, OFF(lora_init), 0, 0, 0, 0, NULL},
    {{"zero", ANNEAL_OPT_INT, "distributed: ZeRO stage, 0 = DDP, 1 = shard optimizer state, 2 = also gradients, 3 = also "
      "parameters (needs --recompute block) (default 0)"}, OFF(zero), 0, 3, 0, 0, NULL},
    {{"pp", ANNEAL_OPT_INT, "distributed: pipeline stages N, blocks split into N contiguous stages scheduled 1F1B "
      "over the --accum micro-batches (>= N); ranks / N data-parallel replicas (default 1)"}, OFF(pp), 1, 4096, 0, 0, NULL},
    {{"tp", ANNEAL_OPT_INT, "distributed: tensor parallelism, ranks sharing each layer's heads and MLP width "
      "(Megatron-style); the world is tp x data-parallel replicas (default 1)"}, OFF(tp), 1, 65536, 0, 0, NULL},
    {{"bucket-mb", ANNEAL_OPT_FLOAT, "distributed: gradient bucket size in MiB (default 25)"}, OFF(bucket_mb), 0, 1e6, 1, 0, NULL},
    {{"overlap", ANNEAL_OPT_ONOFF, "distributed: all-reduce gradient buckets during backward (default on)"}, OFF(overlap), 0, 0, 0, 0, NULL},
    {{"grad-compress", ANNEAL_OPT_STRING, "distributed: gradient compression, none or powersgd (low-rank PowerSGD with "
      "error feedback; default none)"}, OFF(grad_compress), 0, 0, 0, 0, NULL},
    {{"powersgd-rank", ANNEAL_OPT_INT, "PowerSGD: approximation rank of each gradient matrix (default 1)"},
     OFF(powersgd_rank), 1, 65536, 0, 0, NULL},
    {{"powersgd-warmup-steps", ANNEAL_OPT_INT, "PowerSGD: plain all-reduce for the first N steps (default 10)"},
     OFF(powersgd_warmup_steps), 0, BIG, 0, 0, NULL},
    {{"offload", ANNEAL_OPT_STRING, "move state to memory-mapped files (--offload-dir) instead of RAM: none, optimizer "
      "(AdamW's state, stepped in chunks), activations (saved for backward), or optimizer,activations (default none)"},
     OFF(offload), 0, 0, 0, 0, NULL},
    {{"offload-dir", ANNEAL_OPT_STRING, "directory of the --offload files, on fast disk (default the run directory)"},
     OFF(offload_dir), 0, 0, 0, 0, NULL},
    {{"deterministic", ANNEAL_OPT_ONOFF, "losses and parameters bit-identical whatever the number of ranks: a step is "
      "--accum micro-batches of --batch rows, rank r of W runs accum/W of them (a power of two), gradients and losses "
      "summed in one fixed binary tree; CPU, also --zero 1-3, --pp (x replicas) and --tp, no --grad-compress; same "
      "--threads per rank (default off)"},
     OFF(deterministic), 0, 0, 0, 0, NULL},
};
#define N_DEFS ((int)(sizeof defs / sizeof defs[0]))

/* Flags in help order, as the public option records. */
static anneal_train_option options[N_DEFS];

const anneal_train_option *anneal_train_options(int *n) {
    for (int i = 0; i < N_DEFS; i++) options[i] = defs[i].opt;
    *n = N_DEFS;
    return options;
}

static const option_def *find_def(const char *name) {
    for (int i = 0; i < N_DEFS; i++)
        if (!strcmp(defs[i].opt.name, name)) return &defs[i];
    return NULL;
}

const anneal_train_option *anneal_train_option_find(const char *name) {
    const option_def *d = name ? find_def(name) : NULL;
    return d ? &d->opt : NULL;
}

const char *const anneal_train_resume_skip[] = {"out", "resume", "log-jsonl", "init", "model", "config", "stop-at",
                                                "tensorboard", "metrics-port", "metrics-addr", "device", NULL};

void anneal_train_config_init(anneal_train_config *c) {
    memset(c, 0, sizeof *c);
    c->batch = 8;
    c->seq = 64;
    c->accum = 1;
    c->pp = 1;
    c->steps = 100;
    c->shuffle = true;
    c->lr = 1e-3;
    c->min_lr = -1;
    c->warmup = 10;
    c->weight_decay = 0.1;
    c->beta1 = 0.9;
    c->beta2 = 0.95;
    c->eps = 1e-8;
    c->clip = 1.0;
    c->dropout = -1;
    c->seed = 1337;
    c->eval_batches = 20;
    c->sample_tokens = 64;
    c->sample_temperature = 0.8;
    c->ckpt_every = 250;
    c->keep = 3;
    c->max_bad_steps = 5;
    c->max_ckpt_failures = 3;
    c->scale_growth_interval = 2000;
    c->loss_scale_init = 65536;
    c->log_every = 1;
    c->profile_steps = 3;
    c->bucket_mb = 25;
    c->tp = 1;
    c->overlap = true;
    c->powersgd_rank = 1;
    c->powersgd_warmup_steps = 10;
}

/* The string fields, for free and copy. */
static char **string_field(anneal_train_config *c, int i) {
    const option_def *d = &defs[i];
    if (d->opt.kind == ANNEAL_OPT_STRING) return (char **)((char *)c + d->offset);
    return NULL;
}

void anneal_train_config_free(anneal_train_config *c) {
    if (!c) return;
    for (int i = 0; i < N_DEFS; i++) {
        char **s = string_field(c, i);
        if (s) free(*s), *s = NULL;
    }
    free(c->resume_dir), c->resume_dir = NULL;
    free(c->tensorboard_dir), c->tensorboard_dir = NULL;
}

/* strdup that records OOM. */
static anneal_status dup_into(char **dst, const char *s) {
    char *d = s ? strdup(s) : NULL;
    if (s && !d) return anneal_set_error(ANNEAL_ERR_OOM, "train config: out of memory");
    free(*dst);
    *dst = d;
    return ANNEAL_OK;
}

anneal_status anneal_train_config_copy(anneal_train_config *dst, const anneal_train_config *src) {
    *dst = *src;
    for (int i = 0; i < N_DEFS; i++) {
        char **s = string_field(dst, i);
        if (s) *s = NULL;
    }
    dst->resume_dir = NULL;
    dst->tensorboard_dir = NULL;
    for (int i = 0; i < N_DEFS; i++) {
        char **s = string_field(dst, i);
        if (s && dup_into(s, *string_field((anneal_train_config *)src, i)) != ANNEAL_OK) {
            anneal_train_config_free(dst);
            return ANNEAL_ERR_OOM;
        }
    }
    if (dup_into(&dst->resume_dir, src->resume_dir) != ANNEAL_OK ||
        dup_into(&dst->tensorboard_dir, src->tensorboard_dir) != ANNEAL_OK) {
        anneal_train_config_free(dst);
        return ANNEAL_ERR_OOM;
    }
    return ANNEAL_OK;
}

/* "[lo, hi)"-style text of a numeric range, for messages. */
static const char *range_text(const option_def *d, char *buf, size_t n) {
    if (d->hi >= BIG) snprintf(buf, n, "%s %.10g", d->lo_open ? ">" : ">=", d->lo);
    else snprintf(buf, n, "in %c%.10g, %.10g%c", d->lo_open ? '(' : '[', d->lo, d->hi, d->hi_open ? ')' : ']');
    return buf;
}

static bool in_range(const option_def *d, double x) {
    if (d->lo_open ? !(x > d->lo) : !(x >= d->lo)) return false;
    if (d->hi_open ? !(x < d->hi) : !(x <= d->hi)) return false;
    return true;
}

anneal_status anneal_train_config_set(anneal_train_config *c, const char *name, const char *value) {
    const option_def *d = name ? find_def(name) : NULL;
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "--%s: unknown flag (see anneal train --help)", name ? name : "?");
    void *dst = (char *)c + d->offset;
    char rb[64];
    if (!value && d->opt.kind != ANNEAL_OPT_ONOFF && d->opt.kind != ANNEAL_OPT_OPTSTRING)
        return anneal_set_error(ANNEAL_ERR_ARG, "--%s: needs a value", name);
    switch (d->opt.kind) {
    case ANNEAL_OPT_INT: {
        int64_t x = 0;
        anneal_number_parse np = anneal_parse_decimal_i64(value, &x);
        if (np == ANNEAL_NUMBER_RANGE)
            return anneal_set_error(ANNEAL_ERR_ARG, "--%s: %s is out of range (must be %s)", name, value,
                                    range_text(d, rb, sizeof rb));
        if (np != ANNEAL_NUMBER_OK)
            return anneal_set_error(ANNEAL_ERR_ARG, "--%s: expects a decimal integer, got '%s'", name, value);
        if (!in_range(d, (double)x))
            return anneal_set_error(ANNEAL_ERR_ARG, "--%s: %lld is out of range (must be %s)", name, (long long)x,
                                    range_text(d, rb, sizeof rb));
        *(int64_t *)dst = x;
        break;
    }
    case ANNEAL_OPT_FLOAT: {
        double x = 0;
        anneal_number_parse np = anneal_parse_decimal_f64(value, &x);
        if (np == ANNEAL_NUMBER_RANGE)
            return anneal_set_error(ANNEAL_ERR_ARG, "--%s: %s is out of range (must be %s)", name, value,
                                    range_text(d, rb, sizeof rb));
        if (np != ANNEAL_NUMBER_OK)
            return anneal_set_error(ANNEAL_ERR_ARG, "--%s: expects a decimal number, got '%s'", name, value);
        if (!in_range(d, x))
            return anneal_set_error(ANNEAL_ERR_ARG, "--%s: %g is out of range (must be %s)", name, x,
                                    range_text(d, rb, sizeof rb));
        *(double *)dst = x;
        break;
    }
    case ANNEAL_OPT_ONOFF:
        if (!value || !strcmp(value, "on") || !strcmp(value, "true") || !strcmp(value, "1")) *(bool *)dst = true;
        else if (!strcmp(value, "off") || !strcmp(value, "false") || !strcmp(value, "0")) *(bool *)dst = false;
        else return anneal_set_error(ANNEAL_ERR_ARG, "--%s: expects on or off, got '%s'", name, value);
        break;
    case ANNEAL_OPT_OPTSTRING: /* --resume [DIR], --tensorboard [DIR] */
        if (value && !*value) return anneal_set_error(ANNEAL_ERR_ARG, "--%s: empty directory name", name);
        *(bool *)dst = true;
        if (value && dup_into(!strcmp(name, "tensorboard") ? &c->tensorboard_dir : &c->resume_dir, value) != ANNEAL_OK)
            return ANNEAL_ERR_OOM;
        break;
    case ANNEAL_OPT_STRING:
        if (!*value) return anneal_set_error(ANNEAL_ERR_ARG, "--%s: empty value", name);
        if (!strcmp(name, "model")) {
            anneal_model_config tmp;
            char names[256];
            struct stat sb;
            if (!anneal_model_preset(value, &tmp) && stat(value, &sb) != 0)
                return anneal_set_error(ANNEAL_ERR_ARG, "--model: '%s' is neither a preset (%s) nor a model directory",
                                        value, anneal_model_preset_names(names, sizeof names));
        }
        if (!strcmp(name, "metrics-addr")) { /* a settings error, before anything is created */
            struct in_addr a;
            if (inet_pton(AF_INET, value, &a) != 1)
                return anneal_set_error(ANNEAL_ERR_ARG, "--metrics-addr %s: not an IPv4 address (default 127.0.0.1)", value);
        }
        if (!strcmp(name, "offload") && !anneal_train_offload_valid(value)) /* offload_act.c */
            return anneal_set_error(ANNEAL_ERR_ARG, "--offload: '%s' is not available (none, optimizer, activations, "
                                    "or a comma list: optimizer,activations)", value);
        if (!strcmp(name, "grad-compress") && strcmp(value, "none") && strcmp(value, "powersgd"))
            return anneal_set_error(ANNEAL_ERR_ARG, "--grad-compress: unknown compression '%s' (none, powersgd)", value);
        if (!strcmp(name, "dtype")) { /* stored by its canonical name: float32 -> fp32 */
            anneal_dtype dt;
            if (!anneal_train_dtype_parse(value, &dt))
                return anneal_set_error(ANNEAL_ERR_ARG, "--dtype: unknown precision '%s' (fp32, bf16, fp16)", value);
            value = anneal_precision_name(dt);
        }
        if (!strcmp(name, "loss-scale") && strcmp(value, "dynamic")) {
            double x = 0;
            if (anneal_parse_decimal_f64(value, &x) != ANNEAL_NUMBER_OK || !(x > 0) || !isfinite((float)x) || (float)x <= 0)
                return anneal_set_error(ANNEAL_ERR_ARG, "--loss-scale: expects dynamic or a positive number, got '%s'",
                                        value);
        }
        if (!strcmp(name, "device")) { /* the syntax; whether it can be used: anneal_train_device_resolve */
            anneal_device dev;
            int ordinal;
            if (anneal_train_device_parse(value, &dev, &ordinal) != ANNEAL_OK) return anneal_last_status();
        }
        if (!strcmp(name, "schedule")) {
            anneal_schedule_kind k;
            if (!anneal_schedule_parse(value, &k))
                return anneal_set_error(ANNEAL_ERR_ARG, "--schedule: unknown schedule '%s' (constant, cosine, linear, wsd)",
                                        value);
        }
        if (!strcmp(name, "recompute")) { /* stored by its canonical name: on -> block */
            anneal_recompute_mode m;
            if (!anneal_recompute_parse(value, &m))
                return anneal_set_error(ANNEAL_ERR_ARG, "--recompute: unknown mode '%s' (none, attn, block)", value);
            value = anneal_recompute_name(m);
        }
        if (dup_into((char **)dst, value) != ANNEAL_OK) return ANNEAL_ERR_OOM;
        break;
    }
    /* settings that replace each other: the later one wins */
    if (d->clears) {
        const option_def *o = find_def(d->clears);
        void *odst = (char *)c + o->offset;
        if (o->opt.kind == ANNEAL_OPT_STRING) free(*(char **)odst), *(char **)odst = NULL;
        else if (o->opt.kind == ANNEAL_OPT_INT) *(int64_t *)odst = 0;
    }
    return ANNEAL_OK;
}

bool anneal_train_dtype_parse(const char *name, anneal_dtype *out) {
    anneal_dtype dt;
    if (!anneal_dtype_parse(name, &dt) || (dt != ANNEAL_F32 && dt != ANNEAL_BF16 && dt != ANNEAL_F16)) return false;
    *out = dt;
    return true;
}

static bool in_list(const char *const *list, const char *s) {
    for (; list && *list; list++)
        if (!strcmp(*list, s)) return true;
    return false;
}

anneal_status anneal_train_config_apply_json(anneal_train_config *c, const char *json, const char *source,
                                             const char *const *skip) {
    cJSON *root = NULL;
    if (anneal_json_parse(json, json ? strlen(json) : 0, source, &root) != ANNEAL_OK) return anneal_last_status();
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a JSON object of settings (a JSON %s)", source,
                                cJSON_IsArray(root) ? "array" : cJSON_IsString(root) ? "string" : "value");
    }
    anneal_status st = ANNEAL_OK;
    for (cJSON *it = root->child; it && st == ANNEAL_OK; it = it->next) {
        const char *k = it->string;
        if (!k || in_list(skip, k)) continue;
        const option_def *d = find_def(k);
        if (!d) {
            st = anneal_set_error(ANNEAL_ERR_ARG, "%s: unknown setting '%s' (keys are the flag names of anneal train)",
                                  source, k);
            break;
        }
        char num[64];
        const char *v = NULL;
        if (cJSON_IsNull(it)) continue;
        if (cJSON_IsBool(it)) {
            if (d->opt.kind == ANNEAL_OPT_OPTSTRING) {
                *(bool *)((char *)c + d->offset) = cJSON_IsTrue(it);
                continue;
            }
            v = cJSON_IsTrue(it) ? "on" : "off";
        } else if (cJSON_IsNumber(it)) {
            double x = it->valuedouble;
            if (d->opt.kind == ANNEAL_OPT_INT && x == floor(x) && fabs(x) < 9e18) snprintf(num, sizeof num, "%lld", (long long)x);
            else snprintf(num, sizeof num, "%.17g", x);
            v = num;
        } else if (cJSON_IsString(it)) {
            v = it->valuestring;
        } else {
            st = anneal_set_error(ANNEAL_ERR_ARG, "%s: setting '%s' must be a number, string or true/false", source, k);
            break;
        }
        if (anneal_train_config_set(c, k, v) != ANNEAL_OK) {
            /* restate the error with the file name in front */
            char msg[512];
            snprintf(msg, sizeof msg, "%s", anneal_last_error());
            anneal_clear_error();
            st = anneal_set_error(ANNEAL_ERR_ARG, "%s: %s", source, msg);
        }
    }
    cJSON_Delete(root);
    return st;
}

char *anneal_train_config_to_json(const anneal_train_config *c) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    for (int i = 0; i < N_DEFS; i++) {
        const option_def *d = &defs[i];
        const void *src = (const char *)c + d->offset;
        const char *k = d->opt.name;
        switch (d->opt.kind) {
        case ANNEAL_OPT_INT:
            if (!strcmp(k, "tokens") && *(const int64_t *)src == 0) break;
            if (!strcmp(k, "steps") && c->tokens > 0) break;
            cJSON_AddNumberToObject(root, k, (double)*(const int64_t *)src);
            break;
        case ANNEAL_OPT_FLOAT: {
            double x = *(const double *)src;
            if ((!strcmp(k, "min-lr") || !strcmp(k, "dropout")) && x < 0) break; /* "unset" */
            cJSON_AddNumberToObject(root, k, x);
            break;
        }
        case ANNEAL_OPT_ONOFF: cJSON_AddBoolToObject(root, k, *(const bool *)src); break;
        case ANNEAL_OPT_STRING:
            /* where a run trains is not a setting of its result: checkpoints are the same
             * files on every device (the start record names the device) */
            if (!strcmp(k, "device")) break;
            if (*(char *const *)src) cJSON_AddStringToObject(root, k, *(char *const *)src);
            else if (!strcmp(k, "schedule")) cJSON_AddStringToObject(root, k, "cosine");
            else if (!strcmp(k, "dtype")) cJSON_AddStringToObject(root, k, anneal_precision_name(ANNEAL_F32));
            break;
        case ANNEAL_OPT_OPTSTRING: break; /* where a run came from is not a setting of it */
        }
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}
