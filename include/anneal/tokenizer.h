/* anneal tokenizer: BPE as GPT-2 and Hugging Face tokenizers encode. Byte-level BPE
 * (GPT-2's encoder.json + vocab.bpe, or a tokenizer.json with the ByteLevel
 * pre-tokenizer or a Split regex such as Llama 3's and Qwen2's, run through PCRE2 with
 * Unicode properties) and SentencePiece-style BPE with byte fallback (Llama 2, Mistral,
 * TinyLlama: the metaspace, "<0xNN>" tokens); added / special tokens matched before
 * pre-tokenisation; BOS/EOS and the chat template from tokenizer_config.json. Written
 * back as tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer
 * loads. And a byte-level BPE trainer. */
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
/* Loads a Hugging Face tokenizer.json (and tokenizer_config.json from the same
 * directory, when there is one) whose model is BPE: byte-level (pre_tokenizer
 * ByteLevel, or Sequence[Split(Regex), ByteLevel(use_regex false)]) or
 * SentencePiece-style (byte_fallback, normalizer Sequence[Prepend("▁"), Replace(" ",
 * "▁")] or a Metaspace pre-tokenizer); merges as "a b" strings or ["a", "b"] pairs;
 * ignore_merges; added_tokens with content, special, single_word, lstrip, rstrip,
 * normalized. BOS/EOS from tokenizer_config.json (bos_token, eos_token,
 * add_bos_token) or the TemplateProcessing post-processor; chat_template kept. Other
 * models (WordPiece, Unigram), normalizers, pre-tokenizers and decoders are
 * ANNEAL_ERR_UNSUPPORTED naming the file and what was found; malformed files
 * ANNEAL_ERR_FORMAT naming the file and the entry. */
anneal_status anneal_tokenizer_load_hf(const char *tokenizer_json, anneal_tokenizer **out);
/* Resolves a --tokenizer argument: "gpt2" (GPT-2's files, searched in $ANNEAL_GPT2_DIR,
 * then data/gpt2 under the source tree and ../shared/data/gpt2), a directory holding
 * tokenizer.json (a Hugging Face model directory, an anneal checkpoint or tokenizer
 * directory; tokenizer_config.json beside it is read too) or encoder.json + vocab.bpe,
 * or a tokenizer.json path. */
anneal_status anneal_tokenizer_load(const char *spec, anneal_tokenizer **out);
void anneal_tokenizer_free(anneal_tokenizer *tok);

/* Writes dir/tokenizer.json and dir/tokenizer_config.json (each atomically; dir is
 * created if missing) that transformers' AutoTokenizer.from_pretrained(dir) and
 * tokenizers' Tokenizer.from_file load and encode to the same ids as anneal. A
 * tokenizer loaded from a tokenizer.json gets that file back unchanged (and its
 * tokenizer_config.json, special_tokens_map.json and tokenizer.model, where it had
 * them); one from GPT-2's files or the trainer gets a tokenizer.json generated from its
 * vocabulary and merges and a PreTrainedTokenizerFast tokenizer_config.json. */
anneal_status anneal_tokenizer_save_hf(const anneal_tokenizer *tok, const char *dir);

/* A tokenizer as GGUF's tokenizer.ggml.* keys hold it (llama.cpp's vocabulary):
 * byte-level BPE with GPT-2's pre-tokenizer (model "gpt2", pre "gpt-2") or Llama 3's
 * with ignore_merges (pre "llama-bpe"), and
 * SentencePiece-style BPE with Llama 2's normalizer and byte fallback (model "llama", pre
 * "default", scores = -rank of the merge that makes the token, merges kept too). Others
 * are ANNEAL_ERR_UNSUPPORTED naming what they are. */
typedef struct anneal_tokenizer_gguf {
    const char *model;        /* tokenizer.ggml.model: "gpt2" or "llama" */
    const char *pre;          /* tokenizer.ggml.pre: "gpt-2", "llama-bpe", "default" */
    int32_t n_tokens;
    const char *const *tokens;/* "gpt2": byte-level strings ("\u0120the"); "llama": pieces ("\u2581the",
                                 "<0x0A>"); added tokens as their text */
    const size_t *token_len;
    const int32_t *token_type;/* 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte */
    const float *scores;      /* "llama" (NULL otherwise) */
    int32_t n_merges;
    const char *const *merges;/* "left right" */
    const size_t *merge_len;
    int32_t bos, eos, unk;    /* -1: none */
    int add_bos;              /* -1: not said, 0, 1 */
    const char *chat_template;/* NULL: none */
    void *owned;              /* what anneal_tokenizer_to_gguf allocated */
} anneal_tokenizer_gguf;

/* Fills *out from tok (arrays malloc'd; release with anneal_tokenizer_gguf_free). */
anneal_status anneal_tokenizer_to_gguf(const anneal_tokenizer *tok, anneal_tokenizer_gguf *out);
void anneal_tokenizer_gguf_free(anneal_tokenizer_gguf *v);
/* Builds a tokenizer from GGUF's vocabulary; errors name `what` (the file) and the token
 * or merge at fault. */
anneal_status anneal_tokenizer_from_gguf(const anneal_tokenizer_gguf *v, const char *what, anneal_tokenizer **out);

/* Number of ids (including special tokens). */
int32_t anneal_tokenizer_vocab_size(const anneal_tokenizer *tok);
/* Id of "<|endoftext|>" (or the tokenizer's end-of-text special), -1 if none. */
int32_t anneal_tokenizer_eot(const anneal_tokenizer *tok);
/* Beginning-of-sequence id (tokenizer_config.json's bos_token), -1 if none. */
int32_t anneal_tokenizer_bos(const anneal_tokenizer *tok);
/* True if text for the model starts with BOS (add_bos_token, or a post-processor
 * that adds it); anneal_tokenizer_encode never adds it itself. */
bool anneal_tokenizer_adds_bos(const anneal_tokenizer *tok);
/* The chat_template of tokenizer_config.json (NULL if none). */
const char *anneal_tokenizer_chat_template(const anneal_tokenizer *tok);
/* Id of the token whose text is exactly `text` (an added token such as "<|eot_id|>"),
 * -1 if none. */
int32_t anneal_tokenizer_token_id(const anneal_tokenizer *tok, const char *text);
/* 64-bit FNV-1a fingerprint of the vocabulary (bytes of every id in order) and merges:
 * two tokenizers encode identically iff (practically) their fingerprints match. */
uint64_t anneal_tokenizer_fingerprint(const anneal_tokenizer *tok);
/* The bytes of one id (NULL if out of range); *len set. */
const char *anneal_tokenizer_token_bytes(const anneal_tokenizer *tok, int32_t id, size_t *len);

/* Encodes len bytes of text (any bytes: invalid UTF-8 still round-trips) and appends
 * the ids to out. Special tokens such as "<|endoftext|>" are recognised only when
 * allow_special; otherwise they are encoded as ordinary text (added tokens that are
 * not special are always recognised, as in tokenizers). No BOS is added (see
 * anneal_tokenizer_adds_bos). Thread-safe: several threads may encode with one
 * tokenizer at once. */
anneal_status anneal_tokenizer_encode(const anneal_tokenizer *tok, const char *text, size_t len,
                                      bool allow_special, anneal_ids *out);
/* Decodes ids to bytes (malloc'd, NUL-terminated, *len excludes the NUL). An id out of
 * range is ANNEAL_ERR_ARG naming the id and its position. */
anneal_status anneal_tokenizer_decode(const anneal_tokenizer *tok, const int32_t *ids, size_t n,
                                      char **text, size_t *len);

/* One message of a conversation. */
typedef struct anneal_chat_message {
    const char *role;    /* "system", "user" or "assistant" */
    const char *content;
} anneal_chat_message;

/* Formats a conversation as the tokenizer's chat template does (transformers'
 * apply_chat_template(tokenize=False)), for the templates anneal recognises by their
 * signature: Llama 3 (<|start_header_id|>), ChatML (<|im_start|>, Qwen2), Llama 2 /
 * Mistral ([INST]) and Zephyr (<|user|>). add_generation_prompt appends the opening of
 * the assistant's turn. *text is malloc'd and NUL-terminated. No chat template, or one
 * anneal does not recognise, is ANNEAL_ERR_UNSUPPORTED saying so (never a guess); a
 * conversation the template itself rejects (roles out of order) is ANNEAL_ERR_ARG. */
anneal_status anneal_chat_format(const anneal_tokenizer *tok, const anneal_chat_message *msgs, size_t n,
                                 bool add_generation_prompt, char **text, size_t *len);

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
