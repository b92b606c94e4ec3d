/* Internals of the byte-level BPE trainer (bpe_train.c, bpe_train_count.c): counting
 * the distinct pre-tokenised pieces of a corpus and learning the merges (the public
 * entry points anneal_bpe_train and anneal_bpe_train_ex are in tokenizer.h). */
#ifndef ANNEAL_DATA_BPE_TRAIN_H
#define ANNEAL_DATA_BPE_TRAIN_H

#include "anneal/tokenizer.h"

#include <stddef.h>
#include <stdint.h>

/* The distinct pieces of a corpus with their counts: piece i is
 * bytes[off[i] .. off[i] + len[i]) and occurs count[i] times. The order of the pieces
 * is unspecified (it may depend on the thread count); the trainer does not depend on
 * it. */
typedef struct anneal_piece_counts {
    char *bytes;
    size_t *off;
    uint32_t *len;
    int64_t *count;
    size_t n;              /* distinct pieces */
    uint64_t total_bytes;  /* bytes read from all files */
    uint64_t total_pieces; /* pieces counted (with multiplicity) */
} anneal_piece_counts;

/* Streams each file in blocks of about block_bytes (0: the default, several MiB;
 * memory O(distinct pieces + one block)), splits the text with GPT-2's
 * pre-tokenisation and counts every distinct piece, on n_threads OpenMP threads (<= 0:
 * anneal_get_num_threads()). Pieces never span two files. Blocks are cut only where
 * the pre-tokenisation of the parts equals that of the whole (see is_safe_cut), so the
 * counts are exactly those of pre-tokenising each whole file, whatever the block size
 * and thread count (a stretch with no safe cut grows the block). Errors
 * (ANNEAL_ERR_IO) name the file. */
anneal_status anneal_bpe_count_pieces(const char *const *files, int n_files, int n_threads,
                                      size_t block_bytes, anneal_piece_counts *out);
void anneal_piece_counts_free(anneal_piece_counts *pc);

/* The learned vocabulary in memory (no files): token i has bytes
 * bytes[off[i] .. off[i] + len[i]) for i < n_tokens (256 byte tokens in GPT-2's order,
 * then one per merge); merges[r] = {left, right} creates token 256 + r. */
typedef struct anneal_bpe_model {
    char *bytes;
    size_t *off;
    uint32_t *len;
    int32_t n_tokens;
    int32_t (*merges)[2];
    int32_t n_merges;
} anneal_bpe_model;

/* Learns up to max_merges merges from counted pieces (the core of the trainer; used
 * by the tests to check merges without files). */
anneal_status anneal_bpe_learn(const anneal_piece_counts *pc, int32_t max_merges,
                               anneal_bpe_model *out, anneal_bpe_train_stats *stats,
                               const anneal_bpe_train_opts *opts);
void anneal_bpe_model_free(anneal_bpe_model *m);

#endif
