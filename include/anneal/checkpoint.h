/* anneal checkpoints: a directory per checkpoint holding the model as its architecture
 * exports it to Hugging Face (model.safetensors + config.json, loadable by
 * transformers; read back through the model registry, so a checkpoint of any
 * registered architecture loads), the
 * optimizer state (optimizer.safetensors) and state.json (step, RNG, loader cursor,
 * tokenizer fingerprint, trainer config, anneal version, checksums of the tensor files).
 * Written to a temporary directory, fsync'ed, renamed; a `latest` pointer is replaced
 * atomically last; older checkpoints are pruned to `keep`. A crash at any moment leaves
 * the previous checkpoint loadable. Layout in docs/FORMATS.md. */
#ifndef ANNEAL_CHECKPOINT_H
#define ANNEAL_CHECKPOINT_H

#include "anneal/loader.h"
#include "anneal/model.h"
#include "anneal/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Everything besides tensors that a resumed run needs to continue bit for bit. */
typedef struct anneal_train_state {
    int64_t step;                   /* optimizer steps completed */
    int64_t tokens;                 /* training tokens consumed */
    anneal_rng_state rng;           /* global generator after the last step */
    anneal_loader_cursor cursor;    /* training loader position after the last step */
    uint64_t tokenizer_fingerprint; /* of the data the run trains on (0 if none) */
    int64_t skipped_steps;          /* updates skipped for non-finite loss/gradients */
    double best_val_loss;           /* NaN if never evaluated */
    /* Mixed precision (zero in checkpoints written before it existed): */
    anneal_dtype dtype;             /* matmul precision trained with: F32, BF16 or F16 */
    float loss_scale;               /* f16 loss scaler's scale after the last step; 0: none recorded */
    int64_t loss_scale_growth_tracker; /* its clean steps in a row */
    int64_t overflow_steps;         /* f16 steps skipped for a gradient overflow (not in skipped_steps) */
    /* LoRA (a model with frozen parameters): the base the adapters belong to */
    uint64_t lora_base_fingerprint; /* anneal_params_fingerprint of the base weights; 0: not a LoRA run */
    char lora_base[1024];           /* where the base weights came from ("": the architecture's init) */
} anneal_train_state;

/* Writes checkpoint "<run_dir>/ckpt_<step, 8 digits>" synchronously: model, optimizer
 * (may be NULL), state and the trainer's config (a JSON object text, stored verbatim in
 * state.json under "config"). Then points run_dir/latest at it and prunes all but the
 * newest `keep` (keep <= 0 keeps all). Errors (unwritable directory, full disk) leave
 * existing checkpoints and `latest` untouched. */
anneal_status anneal_checkpoint_save(const char *run_dir, const anneal_model *m,
                                     const anneal_optimizer *opt, const anneal_train_state *st,
                                     const char *config_json, int keep);

/* Background writer: save() snapshots the tensors into host buffers (the only time the
 * caller waits) and returns; a thread writes the files. At most one write is in flight:
 * save() first waits for the previous one. */
typedef struct anneal_checkpointer anneal_checkpointer;
anneal_checkpointer *anneal_checkpointer_new(const char *run_dir, int keep);
anneal_status anneal_checkpointer_save(anneal_checkpointer *c, const anneal_model *m,
                                       const anneal_optimizer *opt, const anneal_train_state *st,
                                       const char *config_json);
/* The tokenizer every later checkpoint of c carries as tokenizer.json +
 * tokenizer_config.json (anneal_tokenizer_save_hf), so that
 * AutoTokenizer.from_pretrained(checkpoint) works; NULL: none. Not copied: it must stay
 * alive and unchanged until the checkpointer is freed or set again (the background
 * writer reads it). */
struct anneal_tokenizer;
void anneal_checkpointer_set_tokenizer(anneal_checkpointer *c, const struct anneal_tokenizer *tok);
/* Waits for the write in flight; returns its status (ANNEAL_OK if none). */
anneal_status anneal_checkpointer_wait(anneal_checkpointer *c);
/* Waits, then frees. */
void anneal_checkpointer_free(anneal_checkpointer *c);

/* Resolves a --resume / --init argument to a checkpoint directory: a checkpoint
 * directory itself, or a run directory (its `latest`). Fails with a clear message if
 * neither holds a complete checkpoint. */
anneal_status anneal_checkpoint_resolve(const char *path, char *out, size_t out_len);
/* Reads the checkpoint's model config (config.json through the registry, whose
 * model_type picks the architecture; recompute from state.json) and trainer config
 * text (malloc'd; may be NULL). Validates state.json and the checksums of the tensor
 * files. */
anneal_status anneal_checkpoint_read_config(const char *ckpt_dir, anneal_model_config *model_cfg,
                                            char **config_json);
/* A checkpoint of a LoRA run holds only what changes: the adapters as a PEFT directory
 * (adapter_config.json + adapter_model.safetensors, loadable by PeftModel.from_pretrained
 * on the base), the optimizer state of the trainable parameters, config.json of the
 * base and, in state.json "lora", the base's path and fingerprint. *is_lora says
 * whether ckpt_dir is one; base (n bytes) and *fingerprint get the reference. */
anneal_status anneal_checkpoint_lora_base(const char *ckpt_dir, bool *is_lora, char *base, size_t n,
                                          uint64_t *fingerprint);
/* Loads parameters into m (the file must hold exactly what m's architecture exports,
 * shapes equal: an incompatible model is refused with the mismatching tensor named;
 * then its hf_import reads it), optimizer state into opt (may be NULL) and *st. A LoRA
 * checkpoint loads into a model with the same adapters (anneal_peft_load: the base
 * weights are the caller's), the optimizer state of its trainable parameters only; or,
 * without an optimizer, into a plain model of the base's config: the base is read from
 * the recorded path (or made by the architecture's init with the run's seed), checked
 * against the recorded fingerprint, and the adapters added (generate, eval, --init). */
anneal_status anneal_checkpoint_load(const char *ckpt_dir, anneal_model *m, anneal_optimizer *opt,
                                     anneal_train_state *st);
/* The optimizer state of the parameters in ps (some of the checkpointed model's, under
 * the same names: a pipeline stage's) into opt, an optimizer over ps: only their tensors
 * are read from optimizer.safetensors (the reader checks every entry's offsets when it
 * opens the file), each checked as anneal_checkpoint_load checks them (kind, step
 * counts, f32 of the parameter's shape). State.json's checksums are
 * anneal_checkpoint_load's to check. */
/* A checkpoint of a model held in parts (a pipeline's stages, --pp): what the writer
 * takes beside the model, whose parameters without storage are elsewhere. AdamW only. */
typedef struct anneal_checkpoint_parts {
    anneal_optim_config opt_cfg;
    int64_t opt_step_count;
    const int64_t *param_steps;    /* per model parameter */
    anneal_tensor *const *state;   /* per model parameter x 2 (exp_avg, exp_avg_sq): here, or NULL: elsewhere */
    /* the f32 bytes of entry `name` (a parameter's, or "<parameter>.<state>") that is not
     * here, when the writer reaches it: *data valid until the next call */
    anneal_status (*fetch)(void *ctx, const char *name, const void **data);
    void *fetch_ctx;
    const struct anneal_tokenizer *tokenizer; /* written with it, or NULL */
} anneal_checkpoint_parts;

/* Writes checkpoint ckpt_<st->step> of run_dir as anneal_checkpoint_save does (the same
 * files, the same format: any layout reads it), synchronously, one tensor in memory at
 * a time: the model's parameters with storage and the state tensors given are written
 * from where they are, every other tensor fetched when its turn in the file comes. The
 * architecture must export its parameters themselves (GPT-2, Llama). */
anneal_status anneal_checkpoint_save_parts(const char *run_dir, int keep, const anneal_model *m,
                                           const anneal_checkpoint_parts *parts, const anneal_train_state *st,
                                           const char *config_json);

anneal_status anneal_checkpoint_load_optimizer_part(const char *ckpt_dir, anneal_params *ps, anneal_optimizer *opt);

#ifdef __cplusplus
}
#endif
#endif
