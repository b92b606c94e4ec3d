/* Internals of the training loop, shared by the files of src/train: the batch
 * sources, the trainer's state, and the pieces the loop is made of. */
#ifndef ANNEAL_TRAIN_INTERNAL_H
#define ANNEAL_TRAIN_INTERNAL_H

#include "anneal/anneal.h"
#include "anneal/obs.h"
#include "anneal/train.h"

#include <limits.h>

/* Where batches come from: token shards through the loader, or the synthetic Markov
 * chain (each token has 4 possible successors, so the best loss is ln 4), whose
 * batch g is a pure function of (seed, stream, g) and whose cursor is just g. */
typedef struct train_source {
    anneal_loader *loader; /* NULL: synthetic */
    uint64_t seed, stream; /* synthetic: stream 0 train, 1 val */
    int32_t vocab;
    int64_t B, T;
    uint64_t served;       /* synthetic: batches served */
} train_source;

anneal_status train_source_open_loader(train_source *s, const char *dir, const char *split, int64_t B, int64_t T,
                                       uint64_t seed, bool shuffle, bool prefetch);
void train_source_open_synthetic(train_source *s, int64_t B, int64_t T, uint64_t seed, uint64_t stream, int32_t vocab);
/* Fills ids and targets (B*T each). */
anneal_status train_source_next(train_source *s, int32_t *ids, int32_t *targets);
anneal_loader_cursor train_source_get_cursor(const train_source *s);
anneal_status train_source_set_cursor(train_source *s, anneal_loader_cursor c);
/* Windows of T tokens in one epoch (synthetic: unbounded, UINT64_MAX). */
uint64_t train_source_windows(const train_source *s);
void train_source_close(train_source *s);

/* A run in progress. */
typedef struct trainer {
    anneal_train_config cfg;   /* resolved copy */
    FILE *out;
    anneal_progress *prog;
    anneal_jsonl *log, *log_extra;
    char run_dir[PATH_MAX];
    char resume_ckpt[PATH_MAX]; /* checkpoint a resume starts from ("" for a new run) */
    anneal_gpt2_config mcfg;
    const char *model_source;  /* "preset tiny", "config.json", "checkpoint" ... (for the start line) */
    char model_source_buf[PATH_MAX + 32];
    anneal_gpt2 *model;
    anneal_optimizer *opt;
    anneal_schedule sch;
    train_source train, val;
    bool has_val;
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
    int64_t *nan_steps;        /* test hook: 1-based steps whose loss is made NaN */
    int n_nan_steps;
    int64_t last_ckpt_step;    /* step of the newest checkpoint started (written or in flight) */
    bool ckpt_good;            /* that checkpoint has not failed (so far) */
    int ckpt_failures;
} trainer;

/* setup.c: everything before the first step (config resolution, run directory, data,
 * model, optimizer, resume). Errors are recorded; *usage says a setting is at fault. */
anneal_status train_setup(trainer *t, const anneal_train_config *cfg, FILE *out, bool *usage);
void train_teardown(trainer *t);

/* evaluate.c: mean loss over the val split's first eval_batches batches. */
anneal_status train_evaluate(trainer *t, double *val_loss);
/* A generated text from the sample prompt (malloc'd, valid UTF-8). */
anneal_status train_sample(trainer *t, char **text);

/* records.c: JSON-lines records, written to every open log. */
anneal_status train_log_json(trainer *t, void *cjson_object); /* takes ownership */
/* Writes the "start" record. */
void train_log_start(trainer *t);

/* faults.c: the stop request and the test hooks. */
bool train_stop_requested(int *signo);
void train_stop_reset(void);
/* Parses ANNEAL_TEST_INJECT_NAN ("3,7-9": 1-based steps whose loss becomes NaN). */
anneal_status train_parse_nan_steps(const char *spec, int64_t **steps, int *n);
bool train_inject_nan(const trainer *t, int64_t step1);

/* Milliseconds on the monotonic clock. */
double train_now_ms(void);

#endif
