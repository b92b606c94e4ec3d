/* anneal data loader: batches of B windows of T+1 tokens from token shards, in a
 * seeded per-epoch permutation (or a fixed sequential order), split across ranks,
 * with an exact cursor for checkpoints and a prefetch thread. */
#ifndef ANNEAL_LOADER_H
#define ANNEAL_LOADER_H

#include "anneal/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct anneal_loader_config {
    int64_t batch;     /* B: rows per batch (per rank) */
    int64_t seq;       /* T: targets per row; a row reads T+1 tokens */
    uint64_t seed;     /* permutation seed */
    bool shuffle;      /* false: step s, row b reads the window starting at
                        * ((s*B*world + rank*B + b) * T) mod (W*T) (see anneal_loader_open) */
    int rank, world;   /* this process's share: rank in [0, world) */
    bool prefetch;     /* prepare the next batch on a background thread */
} anneal_loader_config;

/* Where a loader is: enough to continue with the identical next batch. */
typedef struct anneal_loader_cursor {
    uint64_t epoch;    /* epoch of the next step's first global window (same on every rank) */
    uint64_t index;    /* its position in that epoch's order; resuming with another B or
                        * world continues from this data position */
    uint64_t step;     /* batches served so far */
} anneal_loader_cursor;

typedef struct anneal_loader anneal_loader;

/* Opens the shards of `split` ("train" or "val") in dir (files "<split>_*.bin" in name
 * order, as `anneal prepare` writes), or the single shard file when path is a file.
 * Windows: the shards' tokens concatenated (N tokens) give W = floor((N-1)/T) windows;
 * window k reads tokens [k*T, k*T + T] (T+1 tokens; neighbours share one). The global
 * window sequence is epoch after epoch, each epoch visiting all W windows in a Philox
 * permutation of (seed, epoch) when shuffling, in order otherwise; global window g
 * = step*B*world + rank*B + b goes to row b of rank `rank` at step `step`, so the data
 * order does not depend on the number of ranks. All shards must share one tokenizer
 * fingerprint (ANNEAL_ERR_FORMAT otherwise, naming both files). Too few tokens for one
 * window is ANNEAL_ERR_ARG with the counts. */
anneal_status anneal_loader_open(const char *path, const char *split, const anneal_loader_config *cfg,
                                 anneal_loader **out);
void anneal_loader_free(anneal_loader *l);
/* Fills ids and targets (B*T int32 each, row-major: targets[b][t] = ids[b][t+1] of the
 * window). Advances the cursor. */
anneal_status anneal_loader_next(anneal_loader *l, int32_t *ids, int32_t *targets);
anneal_loader_cursor anneal_loader_get_cursor(const anneal_loader *l);
/* Repositions (waits for/drops any prefetched batch); the next batch is the one that
 * followed when the cursor was taken. */
anneal_status anneal_loader_set_cursor(anneal_loader *l, anneal_loader_cursor c);
/* Windows in one epoch (over all ranks) and the tokenizer fingerprint of the shards. */
uint64_t anneal_loader_windows(const anneal_loader *l);
uint64_t anneal_loader_fingerprint(const anneal_loader *l);
uint32_t anneal_loader_vocab_size(const anneal_loader *l);

#ifdef __cplusplus
}
#endif
#endif
