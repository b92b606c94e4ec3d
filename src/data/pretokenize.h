/* GPT-2 pre-tokenisation: splits text into the pieces BPE merges never cross, with
 * GPT-2's pattern through PCRE2 (UTF + Unicode properties, JIT-compiled). Shared by the
 * encoder and the BPE trainer so both split text identically. */
#ifndef ANNEAL_DATA_PRETOKENIZE_H
#define ANNEAL_DATA_PRETOKENIZE_H

#include "anneal/core.h"

#include <stddef.h>

/* GPT-2's pre-tokenisation regex. */
#define ANNEAL_GPT2_PATTERN \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

typedef struct anneal_pretokenizer anneal_pretokenizer;

/* Compiles the GPT-2 pattern (NULL + error if PCRE2 fails). Safe to share across threads. */
anneal_pretokenizer *anneal_pretokenizer_new(void);
void anneal_pretokenizer_free(anneal_pretokenizer *p);

/* Called for each piece in order; return false to stop early. */
typedef bool (*anneal_piece_fn)(const char *piece, size_t len, void *user);

/* Splits text[0..len) into pieces that tile it exactly, in order: the pattern's
 * matches, and, between them, any bytes the pattern cannot match (invalid UTF-8 is one
 * piece per maximal invalid run), so every byte belongs to exactly one piece. */
anneal_status anneal_pretokenize(const anneal_pretokenizer *p, const char *text, size_t len,
                                 anneal_piece_fn fn, void *user);

#endif
