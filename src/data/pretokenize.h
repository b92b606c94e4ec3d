/* GPT-2 pre-tokenisation: splits text into the pieces BPE merges never cross, with
 * GPT-2's pattern through PCRE2 (UTF + Unicode properties, JIT-compiled). Shared by the
 * encoder and the BPE trainer so both split text identically. */
#ifndef ANNEAL_DATA_PRETOKENIZE_H
#define ANNEAL_DATA_PRETOKENIZE_H

#include "anneal/core.h"

#include <stddef.h>

/* GPT-2's pre-tokenisation regex,
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * with \s spelled out as JavaScript's (the reference encoder, gpt-3-encoder, runs it as a
 * JS regex with the u flag): tab, LF, VT, FF, CR, space, U+00A0, U+1680, U+2000-U+200A,
 * U+2028, U+2029, U+202F, U+205F, U+3000, U+FEFF. PCRE2's own \s differs: it adds U+0085
 * and U+180E and lacks U+FEFF (a byte order mark), which changes the pieces. \S is
 * [^ANNEAL_JS_SPACE]. */
#define ANNEAL_JS_SPACE "\\t\\n\\x{0B}\\f\\r \\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}\\x{FEFF}"
#define ANNEAL_GPT2_PATTERN                                                                     \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" ANNEAL_JS_SPACE "\\p{L}\\p{N}]+|[" ANNEAL_JS_SPACE \
    "]+(?![^" ANNEAL_JS_SPACE "])|[" ANNEAL_JS_SPACE "]+"

typedef struct anneal_pretokenizer anneal_pretokenizer;

/* Compiles the GPT-2 pattern (NULL + error if PCRE2 fails). Safe to share across threads. */
anneal_pretokenizer *anneal_pretokenizer_new(void);
/* Compiles another pattern (PCRE2 syntax, UTF + UCP); errors name `what`. */
anneal_pretokenizer *anneal_pretokenizer_new_pattern(const char *pattern, const char *what);
void anneal_pretokenizer_free(anneal_pretokenizer *p);

/* Unicode White_Space, what Oniguruma's and Rust's \s match (Hugging Face tokenizers
 * runs Split and ByteLevel regexes with Oniguruma). */
#define ANNEAL_HF_SPACE "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
/* GPT-2's pattern as tokenizers' ByteLevel pre-tokenizer runs it (Oniguruma's \s). */
#define ANNEAL_GPT2_HF_PATTERN "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

/* Rewrites a Hugging Face (Oniguruma) regex for PCRE2: \s and \S become explicit
 * White_Space classes (PCRE2's own \s differs from Oniguruma's). Returns a malloc'd
 * pattern, or NULL with *why set (\S inside a character class, out of memory). */
char *anneal_hf_regex_to_pcre(const char *onig, const char **why);

/* Called for each piece in order; return false to stop early. */
typedef bool (*anneal_piece_fn)(const char *piece, size_t len, void *user);

/* Splits text[0..len) into pieces that tile it exactly, in order: the pattern's
 * matches, and, between them, any bytes the pattern cannot match (invalid UTF-8 is one
 * piece per maximal invalid run), so every byte belongs to exactly one piece. */
anneal_status anneal_pretokenize(const anneal_pretokenizer *p, const char *text, size_t len,
                                 anneal_piece_fn fn, void *user);

#endif
