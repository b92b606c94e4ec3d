/* anneal train: the training loop behind `anneal train`. A run reads token shards
 * (or synthetic tokens), trains a model of any registered architecture (through the
 * model interface, model.h) with AdamW, gradient accumulation,
 * clipping and an LR schedule, evaluates and samples now and then, writes JSON-lines
 * logs and crash-safe checkpoints on a background thread, and resumes bit for bit.
 *
 * Settings are named exactly like the command-line flags ("batch", "min-lr", ...):
 * anneal_train_config_set parses one flag value, anneal_train_config_apply_json a
 * JSON object of them (a --config-file, or the config saved in a checkpoint), so the
 * CLI, config files and resume all validate the same way. Log schema and run
 * directory layout: docs/FORMATS.md. */
#ifndef ANNEAL_TRAIN_H
#define ANNEAL_TRAIN_H

#include "anneal/checkpoint.h"

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every setting of a run. Strings are owned (malloc'd) by the config; NULL = unset. */
typedef struct anneal_train_config {
    /* model */
    char *model;              /* preset name of any architecture ("tiny", "d6", "124M", ...) */
    char *config;             /* Hugging Face config.json of any registered model_type */
    char *init;               /* initial weights: HF safetensors or a checkpoint */
    /* data */
    char *data;               /* directory of train_*.bin / val_*.bin (+ prepare.json) */
    char *tokenizer;          /* for samples; default: the one prepare.json names */
    bool synthetic;           /* synthetic Markov-chain tokens instead of --data */
    int64_t batch, seq, accum; /* B, T, K micro-batches per step */
    int64_t steps, tokens;    /* length: steps, or tokens (steps = ceil(tokens / (K*B*T))) */
    bool shuffle;
    /* optimisation */
    double lr, min_lr;        /* min_lr < 0: lr / 10 */
    int64_t warmup;
    char *schedule;           /* constant | cosine | linear | wsd */
    double weight_decay, beta1, beta2, eps, clip;
    double dropout;           /* < 0: the model config's (0 for presets) */
    int64_t seed, threads;
    char *device;             /* where the model trains: cpu (NULL), cuda, cuda:N, or a registered backend's name */
    char *recompute;          /* activation recomputation: none | attn | block (NULL: none) */
    bool pin_threads;         /* pin each OpenMP worker to one CPU */
    /* precision */
    char *dtype;              /* matmul precision: fp32 | bf16 | fp16 (NULL: fp32) */
    char *loss_scale;         /* fp16: "dynamic" (NULL) or a static scale */
    double loss_scale_init;   /* fp16 dynamic scaling: the starting scale */
    int64_t scale_growth_interval; /* fp16 dynamic scaling: clean steps before the scale doubles */
    /* evaluation and samples */
    int64_t eval_every, eval_batches;
    int64_t sample_every, sample_tokens;
    double sample_temperature;
    char *sample_prompt;      /* NULL: start from the end-of-text token */
    /* run directory, checkpoints, logs */
    int64_t ckpt_every, keep;
    char *out;                /* run directory; NULL: runs/<timestamp> */
    bool resume;              /* continue the run in resume_dir (or out) */
    char *resume_dir;
    int64_t stop_at;          /* stop (checkpointed, like an interruption) after this step; 0 = off */
    char *log_jsonl;          /* extra copy of the JSON-lines log */
    bool tensorboard;         /* TensorBoard event files (src/obs/tensorboard.c) */
    char *tensorboard_dir;    /* their directory; NULL: <run>/tensorboard */
    int64_t metrics_port;     /* Prometheus /metrics on this port (0: off) */
    char *metrics_addr;       /* the address it listens on (NULL: 127.0.0.1) */
    int64_t max_bad_steps;    /* stop after this many non-finite steps in a row */
    int64_t max_ckpt_failures; /* stop after this many failed checkpoint writes in a row */
    double peak_gflops;       /* MFU denominator; <= 0: measured at start */
    /* LoRA fine-tuning (src/train/lora.c): the base frozen, adapters trained */
    int64_t lora_rank;        /* 0: off (every parameter trained) */
    double lora_alpha;        /* scale = alpha / rank; 0: alpha = rank */
    char *lora_targets;       /* comma-separated module names; NULL: the architecture's default */
    double lora_dropout;      /* on the adapters' input */
    char *lora_init;          /* a PEFT adapter directory the adapters start from */
    int64_t log_every;        /* plain-text progress every N steps (not a terminal) */
    int64_t profile;          /* profile steps profile..profile+profile_steps-1 (1-based); 0 = off */
    int64_t profile_steps;    /* how many steps the profile covers */
    bool memory_report;       /* print the memory breakdown by category after the first step and at the end */
    double memory_limit_mb;   /* tensor bytes the steps may hold (MiB); beyond: out of memory; 0 = none */
    /* distributed (mpirun -np N anneal train): --batch is the global batch */
    int64_t zero;             /* ZeRO stage 0 (DDP), 1 or 2 */
    int64_t pp;               /* pipeline stages (src/train/pipeline.c); 1: none */
    double bucket_mb;         /* gradient bucket size in MiB */
    bool overlap;             /* all-reduce buckets during backward */
    char *grad_compress;      /* "none" (NULL) or "powersgd" (src/parallel/powersgd.c) */
    int64_t powersgd_rank;    /* PowerSGD approximation rank */
    int64_t powersgd_warmup_steps; /* uncompressed steps before PowerSGD starts */
    char *offload;            /* "none" (NULL), "optimizer" (src/optim/offload.c), "activations"
                                 (src/autograd/saved_offload.c), or "optimizer,activations" */
    char *offload_dir;        /* where the offload file goes; NULL: the run directory */
    bool deterministic;       /* losses bit-identical for any world size (src/train/deterministic.c) */
    int64_t tp;               /* tensor parallelism: ranks per group sharing each layer (1: none; src/train/tp.c) */
} anneal_train_config;

/* The defaults (documented by anneal_train_options). */
void anneal_train_config_init(anneal_train_config *c);
/* Frees the strings (the struct itself is the caller's). */
void anneal_train_config_free(anneal_train_config *c);
/* Deep copy into *dst (which is overwritten, not freed). */
anneal_status anneal_train_config_copy(anneal_train_config *dst, const anneal_train_config *src);

/* One setting as a flag: name (without "--"), the kind of value, help text. */
typedef enum anneal_opt_kind {
    ANNEAL_OPT_INT,
    ANNEAL_OPT_FLOAT,
    ANNEAL_OPT_STRING,
    ANNEAL_OPT_ONOFF,     /* on|off; a bare flag means on */
    ANNEAL_OPT_OPTSTRING, /* a bare flag or a value (--resume [DIR]) */
} anneal_opt_kind;

typedef struct anneal_train_option {
    const char *name;
    anneal_opt_kind kind;
    const char *help;
} anneal_train_option;

/* The table of settings, in help order; *n set to its length. */
const anneal_train_option *anneal_train_options(int *n);
/* The option called name, or NULL. */
const anneal_train_option *anneal_train_option_find(const char *name);
/* Parses value (NULL for a bare flag) into setting `name` with its range check.
 * Errors are ANNEAL_ERR_ARG with a message naming the flag: "--steps: ...". */
anneal_status anneal_train_config_set(anneal_train_config *c, const char *name, const char *value);
/* The one place that says which precisions anneal trains, evaluates and generates
 * with: a --dtype name anneal_dtype_parse reads as f32, bf16 or f16 ("fp32", "bf16",
 * "fp16", "float32", ...); false (nothing written) for any other (fp8, f64, i32). */
bool anneal_train_dtype_parse(const char *name, anneal_dtype *out);
/* The one reader of a --device value (train, eval, generate): "cpu" (or NULL),
 * "cuda" (the CUDA backend's GPU, 0 unless chosen), "cuda:N" (GPU N), or the name of
 * a backend registered from outside the library ("emu" in the tests). Syntax only:
 * *ordinal is N of cuda:N, else -1. ANNEAL_ERR_ARG naming --device otherwise. */
anneal_status anneal_train_device_parse(const char *name, anneal_device *dev, int *ordinal);
/* The same, and the device made ready for use: cuda:N chooses GPU N for this process
 * (anneal_cuda_select), and a device that cannot be used is ANNEAL_ERR_ARG naming
 * --device and saying why (this build has no CUDA backend, no GPU, no such GPU, a GPU
 * already chosen). *out is set on success only. */
anneal_status anneal_train_device_resolve(const char *name, anneal_device *out);
/* Applies a JSON object whose keys are setting names (numbers, strings, true/false,
 * null = leave unset). `source` names the file in errors. Keys listed in skip (NULL-
 * terminated, may be NULL) are ignored; unknown keys are errors. */
anneal_status anneal_train_config_apply_json(anneal_train_config *c, const char *json,
                                             const char *source, const char *const *skip);
/* The config as a JSON object with the setting names as keys (malloc'd text). */
char *anneal_train_config_to_json(const anneal_train_config *c);

/* Asks a running anneal_train_run to stop after the current step, save a checkpoint
 * and return (async-signal-safe: for SIGINT/SIGTERM handlers). */
void anneal_train_request_stop(int signo);

/* What a run did. */
typedef struct anneal_train_result {
    int64_t steps_done;       /* optimizer steps completed in total (incl. before a resume) */
    int64_t tokens;           /* training tokens consumed in total */
    int64_t skipped_steps;    /* non-finite steps skipped (total) */
    double train_loss;        /* loss of the last step (NaN if none ran) */
    double val_loss;          /* last validation loss (NaN if none) */
    double seconds;           /* wall time of this invocation */
    bool interrupted;         /* stopped by anneal_train_request_stop (or a signal's handler) */
    int signal;               /* the signal of that request (0: none or a request without one) */
    bool usage_error;         /* the failure is a bad setting (CLI exit code 2) */
    char run_dir[4096];       /* where logs and checkpoints went */
} anneal_train_result;

/* Runs training as configured, printing progress to `out` (a live line when it is a
 * terminal). Returns ANNEAL_OK after the last step or an interruption (with the final
 * checkpoint written); an error otherwise, with anneal_last_error() saying what. */
anneal_status anneal_train_run(const anneal_train_config *cfg, FILE *out, anneal_train_result *res);
/* The same as one rank of a distributed job over comm (NULL: a single process, as
 * anneal_train_run). Every rank calls it with the same settings; --batch is split over
 * the ranks, rank 0 prints to `out`, writes the logs and the checkpoints; a setting,
 * version or setup failure on any rank ends every rank with an error (no hang). */
typedef struct anneal_comm anneal_comm;
anneal_status anneal_train_run_comm(const anneal_train_config *cfg, anneal_comm *comm, FILE *out,
                                    anneal_train_result *res);

/* Finds the checkpoint a resume would continue from (the run directory resume_dir,
 * else out, or a checkpoint directory) and returns the trainer config saved in it
 * (malloc'd JSON text, may be NULL for a checkpoint saved without one), so a resumed
 * run inherits its settings before command-line flags override them. */
anneal_status anneal_train_resume_config(const anneal_train_config *c, char *ckpt_dir, size_t ckpt_dir_len,
                                         char **config_json);

/* Settings that a resumed run does not inherit from the saved config (where it runs,
 * where it logs, how it was started; the model's shape comes from the checkpoint's
 * config.json unless --model/--config are given again): NULL-terminated. */
extern const char *const anneal_train_resume_skip[];

#ifdef __cplusplus
}
#endif
#endif
