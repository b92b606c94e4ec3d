/* The `anneal prepare` pipeline: text files -> train/val token shards (layout and
 * rules in docs/FORMATS.md). Input is cut into chunks at points where GPT-2
 * pre-tokenisation always splits, the chunks are encoded in parallel and written in
 * order, so the shards do not depend on the thread count and memory stays bounded. */
#ifndef ANNEAL_PREPARE_H
#define ANNEAL_PREPARE_H

#include "anneal/tokenizer.h"

#include <stdio.h>

typedef struct anneal_prepare_config {
    const anneal_tokenizer *tok;
    const char *tokenizer_spec;      /* recorded in prepare.json ("gpt2", a path, ...) */
    const char *const *inputs;       /* n_inputs paths; "-" is stdin (at most once) */
    int n_inputs;
    const char *out_dir;             /* created if missing (its parent must exist) */
    double val_fraction;             /* [0, 1): share of input bytes, taken from the end */
    uint64_t shard_tokens;           /* tokens per shard file (> 0) */
    uint64_t chunk_bytes;            /* target chunk size (>= 64; default 1 MiB) */
    int threads;                     /* encoding threads (> 0) */
    FILE *progress;                  /* updating progress line goes here (NULL: none) */
} anneal_prepare_config;

/* One written shard. */
typedef struct anneal_prepare_shard {
    char *path;
    uint64_t tokens;
    bool val;
} anneal_prepare_shard;

typedef struct anneal_prepare_result {
    uint64_t bytes;                  /* input bytes read */
    uint64_t documents;              /* input files (each one document) */
    uint64_t train_tokens, val_tokens;
    uint64_t forced_cuts;            /* chunk cuts made without a safe point (see FORMATS.md) */
    double seconds;
    anneal_prepare_shard *shards;    /* train shards in order, then val shards */
    int n_shards;
    int stale_removed;               /* old <split>_NNNNNN.bin files beyond this run's count */
    int stale_tmp_removed;           /* "*.tmp.<pid>" files of interrupted runs (dead pids) removed */
} anneal_prepare_result;

/* Runs the pipeline and writes DIR/train_NNNNNN.bin, DIR/val_NNNNNN.bin (when
 * val_fraction > 0) and DIR/prepare.json. Errors name the file and problem; on failure
 * the shard being written is removed and prepare.json is absent. */
anneal_status anneal_prepare_run(const anneal_prepare_config *cfg, anneal_prepare_result *res);
void anneal_prepare_result_free(anneal_prepare_result *res);

/* Checks that data_dir is the complete output of anneal prepare: DIR/prepare.json
 * exists (prepare writes it last, so a prepare that was killed leaves none) and is a
 * JSON object. The error names the missing or bad file (ANNEAL_ERR_IO / FORMAT). */
anneal_status anneal_prepare_check_dir(const char *data_dir);

/* The tokenizer DIR/prepare.json names, ready for anneal_tokenizer_load (malloc'd in
 * *spec; NULL when it names none): "gpt2" and absolute paths as stored; a relative
 * path (files of earlier versions) is taken inside the data directory when it exists
 * there, else relative to the current directory as before. Errors name the file. */
anneal_status anneal_prepare_tokenizer_spec(const char *data_dir, char **spec);

/* Length of the first chunk of text[0..len) when aiming at `target` bytes: the last
 * safe cut in (0, target] (see FORMATS.md), else (*forced set) target moved back to a
 * UTF-8 character start. space_only (tokenizers that add a prefix space): only cuts
 * before a space, forced ones at the last space, 0 if the chunk has none. len is the
 * bytes available: target + 1 (one byte of lookahead), or fewer at the end of the input
 * (target >= len returns len). Exposed for tests. */
size_t anneal_prepare_find_cut(const char *text, size_t len, size_t target, bool space_only,
                               bool *forced);

#endif
