/* anneal token shards: one file of token ids with a small validated header
 * (layout in docs/FORMATS.md), written atomically, read through mmap. */
#ifndef ANNEAL_SHARD_H
#define ANNEAL_SHARD_H

#include "anneal/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ANNEAL_SHARD_MAGIC "ANNLTOK1" /* 8 bytes at offset 0 */
#define ANNEAL_SHARD_VERSION 1

/* The header fields of a shard. */
typedef struct anneal_shard_info {
    uint32_t version;
    uint32_t token_bytes;        /* 2 (u16 ids, vocab <= 65536) or 4 (u32 ids) */
    uint64_t n_tokens;
    uint32_t vocab_size;
    int32_t eot;                 /* end-of-text id separating documents, -1 if none */
    uint64_t tokenizer_fingerprint;
    uint64_t checksum;           /* FNV-1a 64 of the token bytes */
} anneal_shard_info;

/* An open, validated, memory-mapped shard. */
typedef struct anneal_shard {
    char *path;
    anneal_shard_info info;
    const void *tokens;          /* n_tokens ids of info.token_bytes each */
    void *map;
    size_t map_size;
} anneal_shard;

/* Opens and validates a shard: magic (a foreign file is named as such), version,
 * header size, token width, file size == header + n_tokens * width (truncation),
 * checksum (corruption; verify_checksum false skips that full read for speed),
 * every id < vocab_size. Errors name the file and the problem. */
anneal_status anneal_shard_open(const char *path, bool verify_checksum, anneal_shard **out);
void anneal_shard_close(anneal_shard *s);
/* Token i as a 32-bit id (no bounds check; i < n_tokens). */
static inline uint32_t anneal_shard_token(const anneal_shard *s, uint64_t i) {
    return s->info.token_bytes == 2 ? ((const uint16_t *)s->tokens)[i] : ((const uint32_t *)s->tokens)[i];
}

/* Incremental writer (finish and abort free w, whatever the outcome): tokens are
 * appended (buffered) to "<path>.tmp.<pid>"; finish
 * writes the header (count, checksum), fsyncs and renames to path. abort (or a failed
 * finish) removes the temporary; an existing file at path is untouched until rename. */
typedef struct anneal_shard_writer anneal_shard_writer;
anneal_status anneal_shard_writer_open(const char *path, uint32_t vocab_size, int32_t eot,
                                       uint64_t tokenizer_fingerprint, anneal_shard_writer **out);
anneal_status anneal_shard_writer_append(anneal_shard_writer *w, const int32_t *ids, size_t n);
anneal_status anneal_shard_writer_finish(anneal_shard_writer *w);
void anneal_shard_writer_abort(anneal_shard_writer *w);

#ifdef __cplusplus
}
#endif
#endif
