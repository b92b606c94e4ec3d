/* anneal optim: AdamW and SGD with momentum over an anneal_params set, global
 * gradient-norm clipping, and learning-rate schedules. */
#ifndef ANNEAL_OPTIM_H
#define ANNEAL_OPTIM_H

#include "anneal/nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum anneal_optim_kind { ANNEAL_OPTIM_ADAMW, ANNEAL_OPTIM_SGD } anneal_optim_kind;

typedef struct anneal_optim_config {
    anneal_optim_kind kind;
    /* Doubles, like PyTorch's Python floats, so derived constants (1 - beta1, lr * wd,
     * bias corrections) round exactly as PyTorch's do. */
    double beta1, beta2, eps; /* AdamW (PyTorch defaults 0.9, 0.999, 1e-8) */
    double weight_decay;      /* applied to params with decay == true (decoupled for AdamW) */
    double momentum;          /* SGD */
    bool nesterov;           /* SGD */
} anneal_optim_config;

/* Defaults: AdamW betas (0.9, 0.999), eps 1e-8, weight decay 0.0. */
anneal_optim_config anneal_optim_defaults(anneal_optim_kind kind);

typedef struct anneal_optimizer anneal_optimizer;

/* Optimizer over every parameter of ps (state allocated lazily on the first step). */
anneal_optimizer *anneal_optimizer_new(anneal_params *ps, anneal_optim_config cfg);
void anneal_optimizer_free(anneal_optimizer *o);
/* One update with learning rate lr. Parameters without a gradient, and frozen ones, are skipped
 * (and their step count not advanced), as in PyTorch. */
anneal_status anneal_optimizer_step(anneal_optimizer *o, double lr);
/* Number of steps taken. */
int64_t anneal_optimizer_step_count(const anneal_optimizer *o);
/* State tensor of parameter i: "exp_avg", "exp_avg_sq" (AdamW), "momentum" (SGD), or
 * NULL if not created yet. For checkpoints. */
anneal_tensor *anneal_optimizer_state(const anneal_optimizer *o, int i, const char *which);
/* Creates every missing state tensor (zero-filled) now, so a checkpoint can be restored
 * into them. */
anneal_status anneal_optimizer_init_state(anneal_optimizer *o);
/* Parameter i's own step count (for bias correction) and setters used by resume. */
int64_t anneal_optimizer_param_steps(const anneal_optimizer *o, int i);
anneal_status anneal_optimizer_set_param_steps(anneal_optimizer *o, int i, int64_t steps);
anneal_status anneal_optimizer_set_step_count(anneal_optimizer *o, int64_t n);
/* The configuration the optimizer was made with (checkpoints record it). */
anneal_optim_config anneal_optimizer_config(const anneal_optimizer *o);

/* ZeRO (stages 1-2 of d): an AdamW/SGD whose state covers only this rank's shard of
 * the flat parameter space (anneal_ddp_shard_pieces). A step updates the shard from
 * anneal_ddp_shard_grad, writes it into the parameters and all-gathers them
 * (anneal_ddp_gather_params), so every rank ends with identical parameters. Collective:
 * every rank must call the step. The other optimizer calls work on it too; state
 * tensors (anneal_optimizer_state) exist only between anneal_optimizer_gather_state and
 * anneal_optimizer_scatter_state. */
typedef struct anneal_ddp anneal_ddp;
anneal_optimizer *anneal_optimizer_new_zero(anneal_params *ps, anneal_optim_config cfg, anneal_ddp *d);
/* Collective: assembles the full state tensors on every rank (for a checkpoint that
 * any world size can resume). No-op for a non-sharded optimizer. */
anneal_status anneal_optimizer_gather_state(anneal_optimizer *o);
/* Keeps only this rank's shard of the full state tensors (after a checkpoint was saved
 * or restored into them) and frees the rest. No-op for a non-sharded optimizer. */
anneal_status anneal_optimizer_scatter_state(anneal_optimizer *o);

/* Offload (--offload optimizer, src/optim/offload.c): an AdamW whose exp_avg and
 * exp_avg_sq live in a memory-mapped file created (and unlinked at once) in dir, stepped
 * in chunks of about chunk_bytes of state (<= 0: 16 MiB) with read-ahead of the next
 * chunk and the finished one dropped from the resident set. Bit-identical updates to
 * anneal_optimizer_new's. CPU f32 parameters only. Errors name dir (missing, not a
 * directory, not writable, no space). State tensors (anneal_optimizer_state) exist only
 * between anneal_optimizer_offload_gather and anneal_optimizer_offload_scatter (and
 * after anneal_optimizer_init_state, which gathers). */
anneal_optimizer *anneal_optimizer_new_offload(anneal_params *ps, anneal_optim_config cfg, const char *dir,
                                               int64_t chunk_bytes);
bool anneal_optimizer_is_offloaded(const anneal_optimizer *o);
/* Bytes of the state file (0 for an optimizer that is not offloaded). */
int64_t anneal_optimizer_offload_bytes(const anneal_optimizer *o);
/* File -> state tensors (made when missing). No-op when not offloaded. */
anneal_status anneal_optimizer_offload_gather(anneal_optimizer *o);
/* State tensors -> file, the tensors freed. No-op when not offloaded. */
anneal_status anneal_optimizer_offload_scatter(anneal_optimizer *o);

/* Scales all gradients so their global L2 norm is at most max_norm (PyTorch's
 * clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1). Writes the norm
 * before clipping to *norm_out (may be NULL). Deterministic (fixed summation order).
 * A non-finite norm is reported in *norm_out and gradients are left unscaled. */
anneal_status anneal_clip_grad_norm(anneal_params *ps, float max_norm, float *norm_out);
/* The global L2 norm of all gradients (without clipping). */
anneal_status anneal_grad_norm(const anneal_params *ps, float *norm_out);

/* ------------------------------------------------ loss scaling (fp16 training)
 * PyTorch's torch.cuda.amp.GradScaler: the loss is multiplied by `scale` before
 * backward so that small gradients survive f16's range (smallest subnormal 2^-24);
 * the gradients are multiplied by 1/scale before clipping and the update. A step
 * whose scaled gradients hold a NaN/Inf is skipped and the scale multiplied by
 * backoff_factor (tracker reset); after growth_interval clean steps in a row the scale
 * is multiplied by growth_factor (unless that overflows f32) and the tracker reset.
 * The scale is an f32 value, as GradScaler's _scale tensor is. */
typedef struct anneal_loss_scaler_config {
    double init_scale;       /* 65536 (2^16) */
    double growth_factor;    /* 2.0 (> 1) */
    double backoff_factor;   /* 0.5 (in (0, 1)) */
    int64_t growth_interval; /* 2000 clean steps (>= 1) */
    bool dynamic;            /* true; false: the scale stays init_scale (a static scale) */
} anneal_loss_scaler_config;

typedef struct anneal_loss_scaler {
    anneal_loss_scaler_config cfg;
    float scale;            /* current scale */
    int64_t growth_tracker; /* clean steps in a row since the scale last changed */
} anneal_loss_scaler;

/* GradScaler's defaults: 2^16, x2 every 2000 clean steps, x0.5 on overflow, dynamic. */
anneal_loss_scaler_config anneal_loss_scaler_defaults(void);
/* Validates cfg (ANNEAL_ERR_ARG naming the field) and starts at init_scale, tracker 0. */
anneal_status anneal_loss_scaler_init(anneal_loss_scaler *s, anneal_loss_scaler_config cfg);
/* Checks every gradient of ps for NaN/Inf (*found_inf) and multiplies each by
 * 1/scale (computed in double, rounded to f32, as GradScaler.unscale_ does), in
 * place. Gradients must be f32; parameters without a gradient are skipped. */
anneal_status anneal_loss_scaler_unscale(const anneal_loss_scaler *s, anneal_params *ps, bool *found_inf);
/* The end of a step (GradScaler.update; torch's _amp_update_scale_): found_inf backs
 * off and resets the tracker; otherwise the tracker counts the clean step and, on
 * reaching growth_interval, the scale grows (if the result is finite) and the tracker
 * resets. A static scaler does nothing. */
void anneal_loss_scaler_update(anneal_loss_scaler *s, bool found_inf);
/* Restores the state saved in a checkpoint (scale finite and > 0, tracker >= 0). */
anneal_status anneal_loss_scaler_set_state(anneal_loss_scaler *s, float scale, int64_t growth_tracker);

typedef enum anneal_schedule_kind {
    ANNEAL_SCHED_CONSTANT, /* warmup then max_lr */
    ANNEAL_SCHED_COSINE,   /* warmup then cosine from max_lr to min_lr at total_steps */
    ANNEAL_SCHED_LINEAR,   /* warmup then linear from max_lr to min_lr at total_steps */
    ANNEAL_SCHED_WSD,      /* warmup, stable at max_lr, then linear decay to min_lr over decay_steps */
} anneal_schedule_kind;

typedef struct anneal_schedule {
    anneal_schedule_kind kind;
    double max_lr, min_lr;
    int64_t warmup_steps; /* lr(s) = max_lr * (s + 1) / warmup_steps for s < warmup_steps */
    int64_t total_steps;
    int64_t decay_steps;  /* WSD only: length of the final decay */
} anneal_schedule;

/* Learning rate for step s (0-based). Past total_steps the schedule stays at its end value. */
double anneal_schedule_lr(const anneal_schedule *sch, int64_t step);
/* Parses "constant", "cosine", "linear", "wsd"; false if unknown. */
bool anneal_schedule_parse(const char *name, anneal_schedule_kind *out);

#ifdef __cplusplus
}
#endif
#endif
