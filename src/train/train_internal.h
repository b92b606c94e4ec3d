/* Internals of the training loop, shared by the files of src/train: the batch
 * sources, the trainer's state, and the pieces the loop is made of. */
#ifndef ANNEAL_TRAIN_INTERNAL_H
#define ANNEAL_TRAIN_INTERNAL_H

#include "anneal/autograd.h"
#include "anneal/checkpoint.h"
#include "anneal/data.h"
#include "anneal/io.h"
#include "anneal/model.h"
#include "anneal/ops.h"
#include "anneal/optim.h"
#include "anneal/parallel.h"
#include "anneal/obs.h"
#include "anneal/telemetry.h"
#include "anneal/train.h"

#include <limits.h>

/* Where batches come from: token shards through the loader, or the synthetic Markov
 * chain (each token has 4 possible successors, so the best loss is ln 4), whose
 * batch g is a pure function of (seed, stream, g) and whose cursor is just g. */
typedef struct train_source {
    anneal_loader *loader; /* NULL: synthetic */
    uint64_t seed, stream; /* synthetic: stream 0 train, 1 val */
    int32_t vocab;
    int64_t B, T;          /* B: this rank's rows per batch */
    int rank, world;       /* global row of (batch n, row b): n*B*world + rank*B + b */
    uint64_t served;       /* synthetic: batches served */
    uint64_t row;          /* synthetic: global row of the next batch's first row (the cursor's index) */
} train_source;

/* B is the per-rank batch (the global one over world). */
anneal_status anneal_train_source_open_loader(train_source *s, const char *dir, const char *split, int64_t B, int64_t T,
                                       uint64_t seed, bool shuffle, bool prefetch, int rank, int world);
void anneal_train_source_open_synthetic(train_source *s, int64_t B, int64_t T, uint64_t seed, uint64_t stream, int32_t vocab,
                                 int rank, int world);
/* Fills ids and targets (B*T each). */
anneal_status anneal_train_source_next(train_source *s, int32_t *ids, int32_t *targets);
anneal_loader_cursor anneal_train_source_get_cursor(const train_source *s);
anneal_status anneal_train_source_set_cursor(train_source *s, anneal_loader_cursor c);
/* Windows of T tokens in one epoch (synthetic: unbounded, UINT64_MAX). */
uint64_t anneal_train_source_windows(const train_source *s);
void anneal_train_source_close(train_source *s);

/* A run in progress. */
typedef struct trainer {
    anneal_train_config cfg;   /* resolved copy */
    FILE *out;
    anneal_progress *prog;
    anneal_jsonl *log, *log_extra;
    anneal_tb_writer *tb;      /* --tensorboard (telemetry.c) */
    anneal_metrics *metrics;   /* --metrics-port (telemetry.c) */
    char run_dir[PATH_MAX];
    char resume_ckpt[PATH_MAX]; /* checkpoint a resume starts from ("" for a new run) */
    anneal_model_config mcfg;
    const char *model_source;  /* "preset tiny", "config.json", "checkpoint" ... (for the start line) */
    char model_source_buf[PATH_MAX + 32];
    anneal_model *model;       /* any registered architecture: the loop knows only the interface */
    anneal_device device;      /* where the model lives (--device): batches are uploaded to it */
    int32_t *host_ids, *host_tg; /* micro-batches as the source fills them (host_bufs x local_batch x seq) */
    int64_t host_bufs;         /* accum when the step's batches fit (a device reads each until the
                                * step's synchronize), else 1 (a synchronize before each refill) */
    anneal_tensor **losses;    /* the step's micro-batch losses (accum), read once per step */
    float *host_losses;        /* their values (accum) */
    anneal_optimizer *opt;
    anneal_schedule sch;
    train_source train, val;
    bool has_val;
    char val_note[600];        /* why the val split is unusable (printed after the settings checks) */
    int64_t eval_batches;      /* per evaluation, capped to the val split's size */
    anneal_tokenizer *tok;     /* for samples (NULL: no samples) */
    anneal_checkpointer *ckpt;
    char *config_json;         /* resolved settings, saved in every checkpoint */
    anneal_train_state st;     /* step = steps done */
    int64_t start_step;        /* st.step when this invocation began */
    int64_t total_steps;
    int64_t tokens_per_step;
    uint64_t data_fingerprint; /* 0 for synthetic data */
    double flops_per_token;
    double peak_gflops;
    const char *peak_source;
    char peak_source_buf[96];
    bool peak_checked;         /* a step's MFU above 100% was handled (loop.c's check_peak) */
    char pin_desc[64];        /* --pin-threads: the CPUs in worker order ("0,1"), "" when off */
    int64_t *nan_steps;        /* test hook: 1-based steps whose loss is made NaN */
    int n_nan_steps;
    int64_t *inf_steps;        /* test hook: 1-based steps where rank inf_rank's scaler finds an Inf gradient */
    int n_inf_steps, inf_rank;
    int64_t last_ckpt_step;    /* step of the newest checkpoint started (written or in flight) */
    bool ckpt_good;            /* that checkpoint has not failed (so far) */
    int ckpt_failures;
    int ckpt_fail_row;         /* failed checkpoints since the last one that completed */
    bool ckpt_pending;         /* a write started and not yet waited for */
    char ckpt_fail_steps[160]; /* the steps of those failures, for the message ("6, 8, 10") */
    /* distributed (dist.c): comm NULL or world 1 without ZeRO = the single-process path */
    anneal_comm *comm;
    anneal_ddp *ddp;           /* gradient sync; NULL on the single-process path */
    anneal_powersgd *psgd;     /* --grad-compress powersgd: the sync's comm hook (dist.c) */
    anneal_zero3 *z3;          /* --zero 3: the sharded parameters (dist.c) */
    int rank, world;
    int64_t local_batch;       /* cfg.batch / data_world: this rank's rows per micro-batch */
    int data_rank, data_world; /* this rank's data-parallel replica and their number (--pp: world / pp) */
    struct train_pp *pp;       /* --pp > 1: the pipeline (pipeline.c); NULL otherwise */
    double dist_mem_peak[3];   /* most bytes seen in a step: parameters, gradients, optimizer state */
    /* mixed precision (precision.c) */
    anneal_dtype dtype;              /* matmul precision of the run (the model's compute precision) */
    bool use_scaler;                 /* fp16: loss scaling */
    anneal_loss_scaler scaler;
    anneal_dtype resumed_dtype;      /* precision of the checkpoint resumed from */
    bool scaler_restored;            /* the scaler state came from that checkpoint */
    struct train_profile *prof;      /* --profile: the window's spans (profile.c) */
    struct train_det *det;           /* --deterministic: the micro-batch tree (deterministic.c) */
    struct train_tp *tp;             /* --tp N > 1: the rank groups and shard splits (tp.c) */
    anneal_act_offload *act_offload; /* --offload activations (offload_act.c) */
} trainer;

/* profile.c: --profile N --profile-steps K and --memory-report. before/after_step take
 * the 1-based step; finish prints the op table and the trace's path (and frees). */
void anneal_train_profile_before_step(trainer *t, int64_t step1);
void anneal_train_profile_after_step(trainer *t, int64_t step1);
void anneal_train_profile_finish(trainer *t);
/* Prints the memory breakdown by category ("after step 1", "at end") with --memory-report. */
void anneal_train_memory_report(trainer *t, const char *when);
/* --memory-limit: sets (on) or lifts (off) the cap on the model device's tensor bytes. */
void anneal_train_memory_limit(trainer *t, bool on);

/* setup.c: everything before the first step (config resolution, run directory, data,
 * model, optimizer, resume). Errors are recorded; *usage says a setting is at fault. */
anneal_status anneal_train_setup(trainer *t, const anneal_train_config *cfg, FILE *out, bool *usage);
void anneal_train_teardown(trainer *t);
/* Creates the run directory and opens the logs (setup does it itself for one process). */
anneal_status anneal_train_create_run_dir(trainer *t);

/* evaluate.c: mean loss over the val split's first eval_batches batches
 * (anneal_model_evaluate on this rank's rows, then the mean over ranks). */
anneal_status anneal_train_evaluate(trainer *t, double *val_loss);
/* A generated text from the sample prompt (malloc'd, valid UTF-8). */
anneal_status anneal_train_sample(trainer *t, char **text);

/* records.c: JSON-lines records, written to every open log. */
anneal_status anneal_train_log_json(trainer *t, void *cjson_object); /* takes ownership */
/* Writes the "start" record. */
void anneal_train_log_start(trainer *t);

/* telemetry.c: --tensorboard and --metrics-port (rank 0: opened with the logs).
 * Every log record goes to them too (records.c). A sink that fails is closed with a
 * warning: telemetry never stops training. */
anneal_status anneal_train_open_telemetry(trainer *t);
void anneal_train_telemetry_record(trainer *t, const void *cjson_record);
/* Collective when --metrics-port is set in a distributed run (a no-op otherwise): every
 * rank's step time to rank 0's endpoint (anneal_rank_step_duration_seconds). */
anneal_status anneal_train_telemetry_step_times(trainer *t, double ms);
void anneal_train_close_telemetry(trainer *t);

/* lora.c: --lora-rank & co. after the base weights are in place: adds the adapters,
 * freezes the base (bf16 dense weights at --dtype bf16) and records the base (path,
 * fingerprint) in t->st; on the resume of a LoRA checkpoint rebuilds the base from
 * the recorded path, refuses a changed one, and adds the same adapters (the checkpoint
 * then fills them). A no-op for other runs. */
anneal_status anneal_train_setup_lora(trainer *t, bool *usage);
/* The start line's LoRA note (nothing without adapters). */
void anneal_train_note_lora(trainer *t);

/* precision.c: --dtype, --loss-scale. Setup sets the model's compute precision for
 * the run (evaluation and samples included) and the fp16 loss scaler (restored from the
 * checkpoint resumed when it scaled too). */
anneal_status anneal_train_setup_precision(trainer *t, bool *usage);
/* The start line's precision note ("precision: ..."). */
void anneal_train_note_precision(trainer *t);
/* fp16: obj * scale (the loss scaled before backward); otherwise obj itself. */
anneal_tensor *anneal_train_scale_loss(trainer *t, anneal_tensor *obj);
/* fp16, after backward (and the gradient all-reduce) and before the norm: gradients
 * multiplied by 1/scale. With a dynamic scale and a finite loss, NaN/Inf gradients
 * are an overflow (*overflow: the caller skips the update without counting a bad
 * step); the scaler is updated (backoff or growth) and its state copied into t->st.
 * *scale_used: the scale this step ran with (0 without a scaler). Collective over the
 * world with --tp or --pp (the ranks' overflow agreed). */
anneal_status anneal_train_unscale_grads(trainer *t, double loss, bool *overflow, float *scale_used);

/* faults.c: the stop request and the test hooks. */
bool anneal_train_stop_requested(int *signo);
void anneal_train_stop_reset(void);
/* Parses ANNEAL_TEST_INJECT_NAN ("3,7-9": 1-based steps whose loss becomes NaN). */
anneal_status anneal_train_parse_nan_steps(const char *spec, int64_t **steps, int *n);
bool anneal_train_inject_nan(const trainer *t, int64_t step1);
/* The test hook ANNEAL_TEST_INF_GRAD="R:STEPS" (STEPS as ANNEAL_TEST_INJECT_NAN's):
 * rank R's fp16 scaler finds an infinite gradient at those steps, whatever the others
 * hold (the overflow of one shard or stage). Unset or empty: none. */
anneal_status anneal_train_parse_inf_grad(const char *spec, int *rank, int64_t **steps, int *n);
/* Under that hook, at this rank and 1-based step: one element of this rank's first
 * CPU gradient set to +Inf (before the scaler looks). */
void anneal_train_inject_inf_grad(trainer *t, int64_t step1);

/* Milliseconds on the monotonic clock. */
double anneal_train_now_ms(void);
/* CPU time of the whole process (all threads), in ms: a step's cost that other processes
 * holding the cores do not inflate. */
double anneal_train_cpu_ms(void);

/* dist.c: the distributed side of a run. Every function is collective (every rank calls
 * it at the same point) and a no-op on the single-process path unless said otherwise. */
/* Agrees on the outcome of a setup phase: every rank learns whether any failed. A rank
 * that failed keeps its own error; the others get one naming the failed ranks. */
anneal_status anneal_train_dist_agree(trainer *t, anneal_status local, const char *phase);
/* After a successful local setup: checks every rank runs the same anneal version and
 * the same resolved settings, builds the gradient sync (ZeRO optimizer, broadcast of
 * rank 0's parameters, re-sharded optimizer state on resume). */
anneal_status anneal_train_dist_setup(trainer *t, bool *usage);
/* True when the run uses the DDP/ZeRO path. */
bool anneal_train_dist_active(const trainer *t);
/* The mean over ranks of x (every rank gets the same value). */
anneal_status anneal_train_dist_mean(trainer *t, double *x);
/* True on every rank when any rank's flag is set. */
anneal_status anneal_train_dist_any(trainer *t, bool *flag);
/* Brackets a checkpoint snapshot: assembles the full ZeRO optimizer state on every
 * rank (begin) and drops it again (end). */
anneal_status anneal_train_dist_ckpt_begin(trainer *t);
anneal_status anneal_train_dist_ckpt_end(trainer *t);
/* PowerSGD: this rank's error feedback and Q next to the checkpoint just written
 * (every rank; part of anneal_train_dist_ckpt_end, called alone after a streamed one). */
anneal_status anneal_train_dist_save_powersgd(trainer *t);
/* --zero 3: the settings it needs (usage errors otherwise; dist_zero3.c); every
 * parameter in full (on) and back to shards (off), collective, for rank 0's samples
 * (dist.c; a failure ends the job); the most parameter and gradient bytes this rank has
 * held (out[0], out[1]; dist_zero3.c). */
anneal_status anneal_train_zero3_check(trainer *t, bool *usage);
anneal_status anneal_train_dist_full_params(trainer *t, bool on);
void anneal_train_zero3_memory(const trainer *t, double out[2]);
/* Notes this rank's memory in the middle of a step (gradients synchronised, before the
 * update: when it holds the most); not collective. */
void anneal_train_dist_note_memory(trainer *t);
/* Prints (rank 0) every rank's memory for parameters, gradients and optimizer state:
 * now ("at start"), or the peak noted during the steps ("at end"). */
anneal_status anneal_train_dist_report_memory(trainer *t, const char *when);
/* Line for the header: world size, backend, ZeRO stage, buckets, per-rank batch. */
void anneal_train_dist_print_header(trainer *t);
/* --grad-compress powersgd: the step's and the run's bytes handed to all-reduce vs what
 * plain all-reduce would hand, added to a step / summary record (nothing without it). */
void anneal_train_dist_log_bytes(trainer *t, struct cJSON *o, bool summary);

/* --- offload.c */
/* --offload optimizer: replaces the run's AdamW by the file-backed one (moving a
 * resumed state into the file). Collective-safe: no collectives. */
anneal_status anneal_train_setup_offload(trainer *t, bool *usage);
/* The process's resident set size now (bytes; 0 when unknown). */
int64_t anneal_train_rss_bytes(void);

/* --- offload_act.c */
/* --offload's value: a comma list of none, optimizer, activations; does it name what? */
bool anneal_train_offload_valid(const char *list);
bool anneal_train_offload_wants(const char *list, const char *what);
/* --offload activations: saved activations to a file between forward and backward
 * (src/autograd/saved_offload.c), installed on this thread. No collectives. */
anneal_status anneal_train_setup_offload_act(trainer *t, bool *usage);
/* Notes what went through the file (rank 0) and removes the offloader. */
void anneal_train_offload_act_free(trainer *t);
void anneal_train_dist_teardown(trainer *t);
/* --- deterministic.c: --deterministic (losses bit-identical for any number of ranks) */
/* The settings it refuses (device, ZeRO, compression, --accum vs the ranks); OK when off. */
anneal_status anneal_train_det_check(trainer *t);
/* Rows per batch of the train source: local_batch, or with --deterministic the rank's
 * accum/world micro-batches of local_batch (= --batch) rows. */
int64_t anneal_train_det_rows(const trainer *t);
/* Installs the ordered cross-rank combine as the gradient sync's comm hook (no-op when off). */
anneal_status anneal_train_det_attach(trainer *t);
/* The start line's note (nothing when off). */
void anneal_train_det_print_header(trainer *t);
/* Bytes it holds: the partial sums, the flat gradient, the sync's gather buffer, the
 * step's rows (counted as gradient memory in the distributed report). */
int64_t anneal_train_det_memory_bytes(const trainer *t);
/* The forward and backward half of a step: the rank's micro-batches, their gradients
 * tree-summed into .grad (the sync is armed to combine the ranks'), *loss the mean
 * loss of the step's M micro-batches (the same bits on every rank and layout). */
anneal_status anneal_train_det_micro_batches(trainer *t, int64_t step, double *loss);
void anneal_train_det_free(trainer *t);
/* --pp under --deterministic: what deterministic.c needs of a pipeline rank (pipeline.c
 * fills it and calls the four functions below; deterministic.c does not call pipeline.c). */
typedef struct anneal_train_det_pp {
    int stage, n;               /* this rank's stage of n */
    anneal_comm *pipe, *data, *embed; /* pipeline, data and tied-embedding groups (embed: NULL if none) */
    anneal_params *view;        /* the stage's parameters (owned and tied) */
    int tied;                   /* view index of the tied embedding (-1: none) */
} anneal_train_det_pp;
/* The stage's tree (over the view) and, with replicas, the data group sync's hook. */
anneal_status anneal_train_det_pp_attach(trainer *t, const anneal_train_det_pp *pp);
/* Micro-batch k (of the replica's accum/replicas) of the step: its rows (*ids, *tg point
 * into the step's, read at k == 0) and its dropout generator. */
anneal_status anneal_train_det_pp_forward(trainer *t, int64_t step, int k, int32_t **ids, int32_t **tg);
/* After micro-batch k's backward on the stage: the tied embedding's head half goes from
 * the last stage to the first, which adds it as one process does; the stage's gradient
 * into its tree. */
anneal_status anneal_train_det_pp_push(trainer *t, int k);
/* The step's end: the trees into .grad, the tied gradient copied to the last stage, the
 * sync armed; *loss from the last stage's losses (host_losses) in the tree's order. */
anneal_status anneal_train_det_pp_finish(trainer *t, int64_t step, double *loss);

/* --- pipeline.c: --pp N (1F1B pipeline stages x data-parallel replicas) */
/* Setup, before the batch split: checks --pp against the world and --accum, sets
 * data_rank / data_world (the replicas). Not collective. */
anneal_status anneal_train_pp_layout(trainer *t, bool *usage);
/* From anneal_train_dist_setup, each agreed there: the settings checked, the groups
 * split and the parameters' owners (build); then the stage's optimizer, DDP/ZeRO over
 * the data group and the broadcast of replica 0's weights (optimizer; a failure there
 * ends the job). Collective. */
anneal_status anneal_train_pp_build(trainer *t, bool *usage);
anneal_status anneal_train_pp_optimizer(trainer *t);
/* The stage (of n over L blocks) that runs block position l (-1: the embedding, L: the head). */
int anneal_train_pp_stage_of(int l, int n, int L);
/* pp_setup.c: whether this rank builds only its stage's parameters (--pp without LoRA,
 * on the CPU; with --tp, tp.c's make_shards then cuts only the stage's shards), and, after the model was made without storage
 * (anneal_params_defer_storage), the storage of the parameters its stage holds. */
bool anneal_train_pp_stage_only(const trainer *t);
anneal_status anneal_train_pp_hold_stage(trainer *t);
/* pp_setup.c: whether --tp alone builds the whole model without storage and make_shards
 * fills and cuts it a batch of tensors at a time (no LoRA, on the CPU); a batch's size
 * in elements: 1/tp of ps's, or its largest tensor. */
bool anneal_train_tp_by_param(const trainer *t);
int64_t anneal_train_tp_batch_elems(const anneal_params *ps, int tp);
/* pp_setup.c: the weights of m's tensors with storage from the run's source: the
 * resumed checkpoint, or the seeded initialisation then --init (each tensor the bits a
 * whole model gets). */
anneal_status anneal_train_fill_held(trainer *t, anneal_model *m);
/* pp_setup.c: true when an --init path is a checkpoint or run directory (state.json, a
 * latest pointer, or no config.json: the checkpoint code names what is missing), false
 * for a Hugging Face model directory or a weights file. */
bool anneal_train_init_is_checkpoint(const char *p);
/* --tp stage-only resume (--pp) or --tp alone: the AdamW state of the whole-width
 * tensors read from t->resume_ckpt by name, batch_elems elements (one tensor at least)
 * at a time, and this rank's slices of it put into o (over view, the shard parameters),
 * with the step counts. */
anneal_status anneal_train_pp_load_tp_state(trainer *t, const anneal_params *view, anneal_optimizer *o,
                                           int64_t batch_elems);
/* Zeroed storage for a parameter tensor without (charged to the parameters); none if it has. */
anneal_status anneal_train_pp_hold_tensor(anneal_tensor *x);
/* The parameters the optimizer steps with --pp: the stage's view (NULL without --pp). */
anneal_params *anneal_train_pp_opt_params(trainer *t);
/* One step: 1F1B forward/backward (fp16: the loss scaled), tied-embedding sum, the
 * gradients unscaled (fp16: *overflow, *loss_scale as anneal_train_unscale_grads), norm,
 * clipping, update. */
anneal_status anneal_train_pp_step(trainer *t, int64_t step, bool inject, double lr, double *loss, float *norm,
                                   bool *skipped, bool *overflow, float *loss_scale);
/* Collective (--pp only): the val loss of t->eval_batches batches of the val source (at
 * its current cursor) through the stages, no rank gathering another stage's parameters;
 * the mean over replicas as the other layouts take it. */
anneal_status anneal_train_pp_evaluate(trainer *t, double *val_loss);
/* split_sample.c, collective over replica 0's pipeline (other replicas return at once):
 * anneal_model_generate's contract, each token's forward run through the stages and
 * sampled on the last (the id broadcast), no rank holding another stage's parameters. */
anneal_status anneal_train_pp_generate(trainer *t, const int32_t *prompt, int64_t n_prompt, int64_t max_new,
                                       const anneal_sampler_config *cfg, int32_t stop_id, anneal_token_fn on_token,
                                       void *user);
/* split_sample.c, --tp without --pp, collective over replica 0's tensor-parallel group
 * (other replicas return at once): the same contract, each token's forward run by the
 * whole group on its shards, the logits gathered, tp rank 0 sampling (the id broadcast). */
anneal_status anneal_train_tp_generate(trainer *t, const int32_t *prompt, int64_t n_prompt, int64_t max_new,
                                       const anneal_sampler_config *cfg, int32_t stop_id, anneal_token_fn on_token,
                                       void *user);
/* pp_ckpt.c: whether a checkpoint is written without gathering (--pp without --tp), and
 * that write, collective (rank 0 writes, its pipeline's other stages send it each
 * tensor in turn; a failed write is rank 0's error, a failed message ends the job). */
bool anneal_train_pp_ckpt_streamed(const trainer *t);
/* A checkpoint entry's name -> req: [0] the parameter of ps, [1] -1 for the parameter
 * itself or its AdamW moment (0 exp_avg, 1 exp_avg_sq); false when none matches. Used by
 * the streamed writers of pp_ckpt.c and tp_ckpt.c. */
bool anneal_train_ckpt_entry(const anneal_params *ps, const char *name, int64_t req[2]);
anneal_status anneal_train_pp_ckpt_save(trainer *t);
void anneal_train_pp_print_header(trainer *t);
/* The step record's bubble fields (nothing without --pp). */
void anneal_train_pp_log_step(trainer *t, struct cJSON *o);
/* The summary's line: the measured bubble over the run's steps, and the ideal one. */
void anneal_train_pp_note_summary(trainer *t);
void anneal_train_pp_teardown(trainer *t);
/* The memory report's bytes (parameters, gradients, optimizer state) of a --pp rank. */
void anneal_train_pp_memory(trainer *t, double out[3]);
/* Ends the whole job after a failure on this rank alone (world > 1), so no rank waits
 * forever in a collective; returns st otherwise. */
anneal_status anneal_train_dist_fatal(trainer *t, anneal_status st);

/* --- tp.c: --tp N (tensor parallelism); each a no-op, or the plain value, without it */
/* After the world is known: checks the settings, splits the world into tensor- and
 * data-parallel groups (collective) and prints the layout. */
anneal_status anneal_train_tp_begin(trainer *t, bool *usage);
/* After the whole model (and a resumed optimizer) is built: replaces both by this
 * rank's shards. */
anneal_status anneal_train_tp_shard(trainer *t, bool *usage);
bool anneal_train_tp_active(const trainer *t);
/* The data split's rank and world (the replicas: the ranks of a group read the same rows). */
int anneal_train_tp_data_rank(const trainer *t);
int anneal_train_tp_data_world(const trainer *t);
/* The communicator of the gradient sync (the replicas; t->comm without --tp). */
anneal_comm *anneal_train_tp_dp_comm(const trainer *t);
/* The global gradient norm (shards summed over the group, replicated ones once) and the
 * clipping of t->ddp's gradients to max_norm (0: none); after anneal_ddp_finish. */
anneal_status anneal_train_tp_clip(trainer *t, float max_norm, float *norm_out);
/* --- tp_det.c: --deterministic's chunked blocks (any --tp) and the one process's norm */
/* Gives t->model the chunked blocks (ctx.deterministic; one process: the single table). */
anneal_status anneal_train_tp_det_setup(trainer *t, bool *usage);
/* The gradients' squares summed as one process does (sharded ones gathered whole over
 * group, split per parameter), in registration order. Collective over group. */
anneal_status anneal_train_tp_det_sumsq(trainer *t, anneal_comm *group, const anneal_tp_split *split, double *total);
void anneal_train_tp_teardown(trainer *t);
/* --tp with --pp (pipeline.c): the split dimension of model parameter i (-1:
 * replicated, and always without --tp) and the tensor-parallel group (NULL without). */
int anneal_train_tp_split_dim(const trainer *t, int i);
/* The interleaved blocks of that split (3 for a fused q/k/v: each block cut alike; 1 otherwise). */
int anneal_train_tp_split_parts(const trainer *t, int i);
anneal_comm *anneal_train_tp_group(const trainer *t);
/* tp_ckpt.c: whether a checkpoint is written without gathering (every --tp run, under
 * --pp too), and that write, collective (rank 0 writes, the other ranks of replica 0
 * send it each shard in turn; a failed write is rank 0's error, a failed message ends
 * the job). */
bool anneal_train_tp_ckpt_streamed(const trainer *t);
anneal_status anneal_train_tp_ckpt_save(trainer *t);

#endif
