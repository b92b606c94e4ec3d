/* anneal tokenizer: byte-level BPE exactly as GPT-2 encodes (pre-tokenisation with
 * GPT-2's regex through PCRE2 with Unicode properties, byte-to-unicode mapping,
 * merges by rank), loaded from GPT-2's encoder.json + vocab.bpe or a Hugging Face
 * tokenizer.json (BPE model, ByteLevel pre-tokenizer), and a BPE trainer. */
#ifndef ANNEAL_TOKENIZER_H
#define ANNEAL_TOKENIZER_H

#include "anneal/core.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A growable array of token ids. Free with anneal_ids_free. */
typedef struct anneal_ids {
    int32_t *ids;
    size_t n, cap;
} anneal_ids;

/* Appends one id (ANNEAL_ERR_OOM on failure). */
anneal_status anneal_ids_push(anneal_ids *v, int32_t id);
void anneal_ids_free(anneal_ids *v);

typedef struct anneal_tokenizer anneal_tokenizer;

/* Loads GPT-2's files. Validates JSON, ids (dense 0..n-1, no duplicates), merges (each
 * side and the merged token must be in the vocabulary); errors name the file, line and
 * problem. */
anneal_status anneal_tokenizer_load_gpt2(const char *encoder_json, const char *vocab_bpe,
                                         anneal_tokenizer **out);
/* Loads a Hugging Face tokenizer.json whose model is BPE with a ByteLevel
 * pre-tokenizer; merges as "a b" strings or ["a", "b"] pairs; added_tokens become
 * special tokens. Anything else is ANNEAL_ERR_UNSUPPORTED naming what was found. */
anneal_status anneal_tokenizer_load_hf(const char *tokenizer_json, anneal_tokenizer **out);
/* Resolves a --tokenizer argument: "gpt2" (GPT-2's files, searched in $ANNEAL_GPT2_DIR,
 * then data/gpt2 under the source tree and ../shared/data/gpt2), a directory holding
 * tokenizer.json or encoder.json + vocab.bpe, or a tokenizer.json path. */
anneal_status anneal_tokenizer_load(const char *spec, anneal_tokenizer **out);
void anneal_tokenizer_free(anneal_tokenizer *tok);

/* Number of ids (including special tokens). */
int32_t anneal_tokenizer_vocab_size(const anneal_tokenizer *tok);
/* Id of "<|endoftext|>" (or the tokenizer's end-of-text special), -1 if none. */
int32_t anneal_tokenizer_eot(const anneal_tokenizer *tok);
/* 64-bit FNV-1a fingerprint of the vocabulary (bytes of every id in order) and merges:
 * two tokenizers encode identically iff (practically) their fingerprints match. */
uint64_t anneal_tokenizer_fingerprint(const anneal_tokenizer *tok);
/* The bytes of one id (NULL if out of range); *len set. */
const char *anneal_tokenizer_token_bytes(const anneal_tokenizer *tok, int32_t id, size_t *len);

/* Encodes len bytes of text (any bytes: invalid UTF-8 still round-trips) and appends
 * the ids to out. Special tokens such as "<|endoftext|>" are recognised only when
 * allow_special; otherwise they are encoded as ordinary text. Thread-safe: several
 * threads may encode with one tokenizer at once. */
anneal_status anneal_tokenizer_encode(const anneal_tokenizer *tok, const char *text, size_t len,
                                      bool allow_special, anneal_ids *out);
/* Decodes ids to bytes (malloc'd, NUL-terminated, *len excludes the NUL). An id out of
 * range is ANNEAL_ERR_ARG naming the id and its position. */
anneal_status anneal_tokenizer_decode(const anneal_tokenizer *tok, const int32_t *ids, size_t n,
                                      char **text, size_t *len);

/* Streaming decoder: feed ids one at a time, get back only complete UTF-8 characters
 * (bytes of a character split across tokens are held until it is complete; bytes that
 * can never form valid UTF-8 are passed through unchanged so nothing is lost). */
typedef struct anneal_stream_decoder {
    const anneal_tokenizer *tok;
    unsigned char pending[8];
    int n_pending;
} anneal_stream_decoder;

void anneal_stream_decoder_init(anneal_stream_decoder *d, const anneal_tokenizer *tok);
/* Appends the printable bytes for id to out (capacity out_cap >= 64 + the token's
 * length); *out_len set. */
anneal_status anneal_stream_decoder_push(anneal_stream_decoder *d, int32_t id, char *out,
                                         size_t out_cap, size_t *out_len);
/* Emits whatever is still pending (possibly an incomplete character). */
size_t anneal_stream_decoder_flush(anneal_stream_decoder *d, char *out, size_t out_cap);

/* Learns byte-level BPE merges from files (GPT-2 pre-tokenisation, incremental pair
 * counts with a priority queue) until the vocabulary has vocab_size ids (256 bytes +
 * merges + "<|endoftext|>"). Deterministic: ties broken by the pair's byte strings.
 * Writes encoder.json, vocab.bpe and tokenizer.json into out_dir (atomically). */
anneal_status anneal_bpe_train(const char *const *files, int n_files, int32_t vocab_size,
                               const char *out_dir);

/* Progress of a training run (also its final summary). */
typedef struct anneal_bpe_train_stats {
    int phase;               /* 0: corpus counted, 1: merging, 2: files written */
    uint64_t total_bytes;    /* corpus size */
    uint64_t total_pieces;   /* pre-tokenised pieces, with multiplicity */
    size_t distinct_pieces;  /* words the merges run over */
    int32_t n_merges;        /* merges learned so far */
    int32_t vocab_size;      /* 256 + n_merges + 1 ("<|endoftext|>") */
    int64_t last_count;      /* occurrences of the last merged pair */
    double count_seconds;    /* reading + pre-tokenising + counting */
    double merge_seconds;    /* the merge loop */
    double write_seconds;    /* writing the three files */
} anneal_bpe_train_stats;

typedef struct anneal_bpe_train_opts {
    int n_threads;  /* threads for counting (<= 0: anneal_get_num_threads()) */
    /* Called after counting, every progress_every merges (0: never) and at the end. */
    void (*progress)(const anneal_bpe_train_stats *s, void *user);
    void *user;
    int32_t progress_every;
} anneal_bpe_train_opts;

/* anneal_bpe_train with options (NULL: defaults) and the run's statistics (may be
 * NULL). vocab_size < 257 is ANNEAL_ERR_ARG; a corpus with no bytes at all is
 * ANNEAL_ERR_ARG ("no text"); a corpus whose merges run out before vocab_size gives a
 * smaller, still valid vocabulary (stats->vocab_size says how large). */
anneal_status anneal_bpe_train_ex(const char *const *files, int n_files, int32_t vocab_size,
                                  const char *out_dir, const anneal_bpe_train_opts *opts,
                                  anneal_bpe_train_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
