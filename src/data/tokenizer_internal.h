/* Helpers shared by the tokenizer (tokenizer*.c, bpe_encode.c, decode.c) and the BPE
 * trainer (bpe_train.c): GPT-2's byte <-> unicode mapping, a growable byte buffer with
 * JSON string escaping, and a writer for encoder.json + vocab.bpe + tokenizer.json.
 * This interface is stable: the trainer builds on it. */
#ifndef ANNEAL_DATA_TOKENIZER_INTERNAL_H
#define ANNEAL_DATA_TOKENIZER_INTERNAL_H

#include "anneal/tokenizer.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------- byte <-> unicode (GPT-2) */

/* GPT-2's bytes_to_unicode(): the printable bytes '!'..'~', 0xA1..0xAC, 0xAE..0xFF stand
 * for themselves; the other 68 bytes, in increasing order, become U+0100, U+0101, ...
 * (so ' ' is U+0120 'Ġ', '\n' is U+010A 'Ċ'). Every code point is < U+0144. */
uint32_t anneal_bpe_byte_to_cp(uint8_t b);
/* The byte that code point cp stands for, or -1 if cp is not in the table. */
int anneal_bpe_cp_to_byte(uint32_t cp);
/* Writes the byte-level string of bytes[0..n) (the UTF-8 of each byte's code point, 1
 * or 2 bytes each) to out, which holds at least 2n bytes; returns its length. */
size_t anneal_bpe_bytes_to_str(const void *bytes, size_t n, char *out);
/* Inverse of anneal_bpe_bytes_to_str: decodes the byte-level string s[0..n) into out
 * (capacity >= n; *out_len set). False if s is not valid UTF-8 or holds a code point
 * outside the table. */
bool anneal_bpe_str_to_bytes(const char *s, size_t n, char *out, size_t *out_len);

/* ------------------------------------------------------------- byte buffer */

/* A growable byte buffer, always NUL-terminated when len > 0 (zero-initialise). */
typedef struct anneal_strbuf {
    char *data;
    size_t len, cap;
} anneal_strbuf;

/* Appends n bytes (ANNEAL_ERR_OOM on failure, the buffer unchanged). */
anneal_status anneal_strbuf_append(anneal_strbuf *b, const void *p, size_t n);
anneal_status anneal_strbuf_puts(anneal_strbuf *b, const char *s);
anneal_status anneal_strbuf_printf(anneal_strbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Appends s[0..n) as a quoted JSON string: '"', '\\' and control bytes escaped, other
 * bytes (UTF-8) copied as they are. */
anneal_status anneal_strbuf_json_string(anneal_strbuf *b, const char *s, size_t n);
void anneal_strbuf_free(anneal_strbuf *b);

/* ------------------------------------------------------ tokenizer files */

/* A byte-level BPE vocabulary as tables: token i has bytes tok[i][0..tok_len[i]);
 * merges[r] = {left id, right id} is the merge of rank r (its result is the token
 * whose bytes are left's + right's); special[0..n_special) are ids of special tokens
 * (such as "<|endoftext|>"), whose bytes are their literal text. */
typedef struct anneal_bpe_tables {
    int32_t n_vocab;
    const char *const *tok;
    const size_t *tok_len;
    int32_t n_merges;
    const int32_t (*merges)[2];
    int n_special;
    const int32_t *special;
} anneal_bpe_tables;

/* Writes encoder.json ({"byte-level string": id, ...} in id order), vocab.bpe
 * ("#version: 0.2" then "left right" per merge in rank order), tokenizer.json
 * (Hugging Face: BPE model, GPT-2's regex as a Split then ByteLevel, ByteLevel decoder,
 * specials as added_tokens) and tokenizer_config.json (PreTrainedTokenizerFast,
 * <|endoftext|> as BOS and EOS) into dir, each atomically (temp + fsync + rename), so
 * that transformers' AutoTokenizer.from_pretrained(dir) loads it. Validates that every
 * special's bytes are valid UTF-8. */
anneal_status anneal_bpe_write_files(const char *dir, const anneal_bpe_tables *t);
/* Appends the tokenizer.json of those tables to out (what anneal_bpe_write_files
 * writes): GPT-2's pre-tokenisation as anneal runs it, as a Split regex followed by
 * ByteLevel, so that Hugging Face tokenizers encodes exactly as anneal does. */
anneal_status anneal_bpe_tokenizer_json(const anneal_bpe_tables *t, anneal_strbuf *out);

/* The tokenizer's tables, as views into it (valid while tok lives). tok and tok_len
 * point to arrays that the function mallocs; the caller frees them with free(). */
anneal_status anneal_tokenizer_tables(const anneal_tokenizer *tok, anneal_bpe_tables *t);
void anneal_bpe_tables_release(anneal_bpe_tables *t);

/* True if s[0..n) is valid UTF-8 (no overlongs, no surrogates, <= U+10FFFF). */
bool anneal_utf8_valid(const char *s, size_t n);

#endif
