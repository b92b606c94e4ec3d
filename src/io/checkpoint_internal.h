/* Internals shared by the checkpoint files: the host snapshot a checkpoint is written
 * from (so the synchronous and the background writer run the same code), the writer,
 * and small helpers (whole-file reads, FNV-1a of a file, exact JSON numbers, recursive
 * removal). */
#ifndef ANNEAL_IO_CHECKPOINT_INTERNAL_H
#define ANNEAL_IO_CHECKPOINT_INTERNAL_H

#include <cjson/cJSON.h>

#include "anneal/checkpoint.h"
#include "anneal/io.h"

/* state.json "format_version" this build writes (and the newest it reads). */
#define ANNEAL_CKPT_FORMAT_VERSION 1

/* One tensor copied to host memory as f32, row-major. */
typedef struct anneal_ckpt_buf {
    char *name; /* safetensors entry name (owned) */
    int ndim;
    int64_t shape[ANNEAL_MAX_DIMS];
    float *data; /* nbytes of f32 (owned, malloc'd) */
    size_t nbytes;
} anneal_ckpt_buf;

/* Everything a checkpoint holds, detached from the model and optimizer: taking it is
 * the only part of a save the training loop waits for. */
typedef struct anneal_ckpt_snapshot {
    anneal_model_config model_cfg;
    anneal_train_state st;
    char *config_json;         /* trainer config (owned), NULL for none */
    int n_model, cap_model;
    anneal_ckpt_buf *model;    /* n_model (cap_model allocated): what hf_export put, in order */
    int n_params;              /* the model's parameters (the optimizer's state is per parameter; LoRA: the trainable ones) */
    char **param_names;        /* n_params, registration order (owned) */
    bool has_opt;
    anneal_optim_config opt_cfg;
    int64_t opt_step_count;
    int n_state;               /* state tensors per parameter: 2 AdamW, 1 SGD+momentum, 0 */
    const char *state_names[2];
    anneal_ckpt_buf *state;    /* n_params * n_state, parameter-major */
    int64_t *param_steps;      /* n_params */
    const struct anneal_tokenizer *tokenizer; /* written as tokenizer.json + tokenizer_config.json; not owned, NULL: none */
    /* LoRA: the model file is the adapters (PEFT keys), the optimizer state the trainable parameters' */
    bool lora;
    char *lora_config_json;    /* adapter_config.json text (owned) */
    /* a buffer whose data is NULL is fetched when written (anneal_checkpoint_save_parts) */
    anneal_st_fetch_fn fetch;
    void *fetch_ctx;
} anneal_ckpt_snapshot;

/* Fills s from the model, optimizer (may be NULL), state and config text (may be
 * NULL; otherwise it must be a JSON object). Buffers already in s are reused when the
 * sizes match (the background writer keeps one snapshot alive across saves), so a
 * repeated snapshot is a plain copy. On failure s is left valid for release. */
anneal_status anneal_ckpt_snapshot_take(anneal_ckpt_snapshot *s, const anneal_model *m,
                                        const anneal_optimizer *opt, const anneal_train_state *st,
                                        const char *config_json);
/* Frees every buffer and zeroes s. */
void anneal_ckpt_snapshot_release(anneal_ckpt_snapshot *s);
/* Writes checkpoint ckpt_<step> of s into run_dir (temp dir, fsync, rename, latest,
 * prune to keep). Plain C and POSIX only: safe on a background thread. */
anneal_status anneal_ckpt_write(const char *run_dir, int keep, const anneal_ckpt_snapshot *s);

/* --- checkpoint_part.c: reads of part of a checkpoint (a --pp stage's tensors) */
/* True when some parameter of m has no storage (a pipeline stage's model). */
bool anneal_ckpt_held_only(const anneal_model *m);
/* The model file st (already checked against m's export by name and shape) into the
 * parameters of m that hold storage, each read by its name (the architectures export
 * their parameters under their own names; anything else is refused). */
anneal_status anneal_ckpt_import_held(anneal_model *m, const anneal_safetensors *st);

/* "ckpt_%08lld" of step into buf. */
void anneal_ckpt_dir_name(int64_t step, char *buf, size_t n);
/* Step of a directory name "ckpt_<digits>", or -1 when name is not one. */
int64_t anneal_ckpt_parse_dir_name(const char *name);

/* Reads a whole file (at most max_bytes) into a NUL-terminated malloc'd buffer. */
anneal_status anneal_ckpt_read_file(const char *path, size_t max_bytes, char **out, size_t *len);
/* Size and FNV-1a 64 of a file's bytes. */
anneal_status anneal_ckpt_hash_file(const char *path, uint64_t *bytes, uint64_t *fnv);
/* Removes path and, for a directory, everything below it (best effort, no error
 * recorded); true when nothing is left. */
bool anneal_ckpt_remove_tree(const char *path);

/* Exact JSON numbers: a non-negative integer as a raw JSON number when v <= 2^53, else as a
 * decimal string (cJSON parses numbers into doubles); reading accepts both forms. */
cJSON *anneal_ckpt_json_u64(uint64_t v);
bool anneal_ckpt_json_get_u64(const cJSON *item, uint64_t *out);
/* Shortest decimal text that reads back as the same float / double (raw JSON number). */
cJSON *anneal_ckpt_json_float(float v);
cJSON *anneal_ckpt_json_double(double v);
void anneal_ckpt_fmt_float(char *buf, size_t n, float v);

#endif
