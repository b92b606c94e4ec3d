/* The tokenizer's private layout, shared by tokenizer.c (building from tables),
 * tokenizer_load.c (file formats), bpe_encode.c and decode.c. Not for the trainer:
 * it uses tokenizer_internal.h. */
#ifndef ANNEAL_DATA_TOKENIZER_IMPL_H
#define ANNEAL_DATA_TOKENIZER_IMPL_H

#include "pretokenize.h"
#include "tokenizer_internal.h"

#include <pthread.h>
#include <string.h>

/* One merge: (left, right) -> merged, with its rank as the index in tok->merges. */
typedef struct tok_merge {
    int32_t left, right, merged;
} tok_merge;

/* Slot of the pair map: key = left << 32 | right (UINT64_MAX = empty). */
typedef struct tok_pair_slot {
    uint64_t key;
    int32_t rank, merged;
} tok_pair_slot;

struct tok_cache; /* per-thread encode state, bpe_encode.c */

/* How a piece becomes the first symbols BPE merges: byte-level BPE (GPT-2, Llama 3,
 * Qwen2) starts from one token per byte; SentencePiece-style BPE (Llama 2, Mistral)
 * from one token per UTF-8 character, with "<0xNN>" tokens (byte fallback) or the
 * unknown token for characters that are not in the vocabulary. */
enum { TOK_BYTE_LEVEL = 0, TOK_SENTENCEPIECE = 1 };

/* An added token (Hugging Face added_tokens): matched in the text before
 * pre-tokenisation. norm[] holds its content as the normalizer makes it (what a
 * normalized token is matched against); flags as tokenizers defines them. */
typedef struct tok_added {
    int32_t id;
    bool special, single_word, lstrip, rstrip, normalized;
    char *norm;     /* normalized content (malloc'd; for !normalized, the content) */
    size_t norm_len;
} tok_added;

/* SentencePiece-style text handling (model->kind == TOK_SENTENCEPIECE or a
 * normalizer/pre-tokenizer that uses the metaspace). */
typedef struct tok_sp {
    bool norm_nfc;          /* normalizer NFC (Qwen2), applied first */
    bool norm_prepend;      /* normalizer Prepend("▁"): each segment gets a leading ▁ */
    bool norm_replace;      /* normalizer Replace(" ", "▁") */
    bool meta;              /* Metaspace pre-tokenizer */
    int meta_prepend;       /* 0 never, 1 always, 2 first (only the text's first segment) */
    bool meta_split;        /* split into words before each ▁ */
    bool byte_fallback;
    int32_t byte_tok[256];  /* id of "<0xNN>", -1 if absent */
    int32_t unk;            /* unk_token id, -1 if none */
    bool fuse_unk;
    bool word_split;        /* no token has a ▁ after another character, and ▁ is a token: BPE
                             * never merges across "x|▁", so a segment may be cut there into
                             * cacheable pieces with the same result */
} tok_sp;

struct anneal_tokenizer {
    int32_t n_vocab;
    char *bytes;          /* bytes of every token, concatenated in id order */
    size_t bytes_len, bytes_cap;
    uint64_t *off;        /* [n_vocab + 1]: token i is bytes[off[i] .. off[i+1]) */
    size_t off_cap;
    int32_t byte_id[256]; /* id of each single-byte token */
    int32_t *vmap;        /* open addressing, token bytes -> id, -1 = empty */
    uint64_t vmap_mask;

    tok_merge *merges;    /* [n_merges], index = rank */
    int32_t n_merges, merges_cap;
    tok_pair_slot *pairs; /* (left, right) -> (rank, merged) */
    uint64_t pairs_mask;

    int32_t *special;     /* ids of the special tokens, longest bytes first */
    int n_special;
    unsigned char *is_special; /* [n_vocab] */
    int32_t eot;
    bool ignore_merges;   /* HF "ignore_merges": a piece that is a token is that token */
    bool add_prefix_space;/* HF ByteLevel add_prefix_space */
    uint64_t fingerprint;
    anneal_pretokenizer *pre; /* NULL: no pre-tokenizer regex (the whole segment is a piece) */
    char *pattern;            /* the PCRE2 pattern of pre (NULL: GPT-2's, as gpt-3-encoder runs it) */
    bool pre_none;            /* no regex split at all (SentencePiece, ByteLevel without regex) */

    int kind;                 /* TOK_BYTE_LEVEL or TOK_SENTENCEPIECE */
    tok_sp sp;
    tok_added *added;         /* added tokens, longest content first */
    int n_added;
    bool any_normalized_added;/* some added token is matched after normalisation */
    char *dec;                /* decoded bytes per id where they differ from bytes (SentencePiece) */
    uint64_t *dec_off;        /* [n_vocab + 1], NULL when dec is NULL */
    bool dec_strip_space;     /* decoding drops one leading space of the first token */
    int32_t bos, eos;         /* from tokenizer_config.json (or the post-processor), -1 if none */
    bool add_bos, add_eos;    /* encode for a model adds them (anneal_tokenizer_encode does not) */
    char *chat_template;      /* tokenizer_config.json's chat_template, NULL if none */
    char *hf_json;            /* the tokenizer.json it was loaded from (save_hf writes it back) */
    size_t hf_json_len;
    char *hf_dir;             /* the directory of that tokenizer.json (save_hf copies the
                               * tokenizer.model and special_tokens_map.json it holds) */
    char *hf_config;          /* the tokenizer_config.json beside it, if any */
    size_t hf_config_len;

    /* Per-thread caches (piece bytes -> ids): found through key, all listed in
     * caches (under mu) so anneal_tokenizer_free releases every one. */
    pthread_key_t key;
    bool key_ok;
    pthread_mutex_t mu;
    struct tok_cache *caches;
};

/* 64-bit hash of n bytes (multiply-xorshift over 8-byte words); used by the vocab map and
 * the encode cache. */
static inline uint64_t tok_hash(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xC2B2AE3D27D4EB4Full);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    if (n) {
        uint64_t w = 0;
        memcpy(&w, s, n);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    return h;
}

static inline const char *tok_bytes(const anneal_tokenizer *t, int32_t id, size_t *len) {
    *len = (size_t)(t->off[id + 1] - t->off[id]);
    return t->bytes + t->off[id];
}

/* The bytes token id decodes to (differs from its model bytes for SentencePiece). */
static inline const char *tok_dec_bytes(const anneal_tokenizer *t, int32_t id, size_t *len) {
    if (!t->dec) return tok_bytes(t, id, len);
    *len = (size_t)(t->dec_off[id + 1] - t->dec_off[id]);
    return t->dec + t->dec_off[id];
}

/* Id of the token whose bytes are s[0..n), -1 if none. */
static inline int32_t anneal_tok_lookup(const anneal_tokenizer *t, const char *s, size_t n) {
    uint64_t i = tok_hash(s, n) & t->vmap_mask;
    for (;;) {
        int32_t id = t->vmap[i];
        if (id < 0) return -1;
        size_t len;
        const char *b = tok_bytes(t, id, &len);
        if (len == n && memcmp(b, s, n) == 0) return id;
        i = (i + 1) & t->vmap_mask;
    }
}

/* Merge (rank, merged id) of the pair (left, right); rank -1 if there is none. */
static inline int32_t tok_pair_rank(const anneal_tokenizer *t, int32_t left, int32_t right,
                                    int32_t *merged) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    uint64_t i = (key * 0x9E3779B97F4A7C15ull) >> 20 & t->pairs_mask;
    for (;;) {
        const tok_pair_slot *s = &t->pairs[i];
        if (s->key == key) {
            *merged = s->merged;
            return s->rank;
        }
        if (s->key == UINT64_MAX) return -1;
        i = (i + 1) & t->pairs_mask;
    }
}

/* Building, in three steps (each failure recorded with a message naming `what`):
 * anneal_tok_new with an empty vocabulary; anneal_tok_add_token for ids 0, 1, ... in order;
 * anneal_tok_add_merge in rank order (both sides and their concatenation must be tokens);
 * anneal_tok_finish marks the specials and builds the pair map, fingerprint and
 * pre-tokenizer. anneal_tok_add_token returns the id that already has these bytes through
 * *dup (else -1) with ANNEAL_ERR_FORMAT. */
anneal_tokenizer *anneal_tok_new(void);
anneal_status anneal_tok_add_token(anneal_tokenizer *t, const char *bytes, size_t n, int32_t *dup);
/* Adds merge (left, right); *merged set. Fails (ANNEAL_ERR_FORMAT, no message: the
 * loader words it) with *why = 1 if left+right is no token, 2 if the pair repeats an
 * earlier merge (its rank in *merged). */
anneal_status anneal_tok_add_merge(anneal_tokenizer *t, int32_t left, int32_t right, int32_t *merged,
                            int *why);
anneal_status anneal_tok_finish(anneal_tokenizer *t, const int32_t *special, int n_special,
                         const char *what);

/* tokenizer_load.c: reads a whole file (NUL-terminated copy in *buf), errors naming it. */
anneal_status anneal_tok_read_file(const char *path, char **buf, size_t *len);
/* Parses JSON text (a cJSON *, as void * to keep cJSON out of this header); on
 * failure the error names the file, line and column. */
struct cJSON;
anneal_status anneal_tok_parse_json(const char *path, const char *buf, size_t len, struct cJSON **out);

/* tokenizer.c: for prepare's parallel chunks. A SentencePiece-style tokenizer runs BPE
 * over whole segments, so chunks may only start at a space; *strip_space: it also puts
 * a ▁ before the text (Prepend, Metaspace), which stands for a chunk's leading space.
 * *crossing: a model token with a ▁ after another character (it would merge across a
 * word boundary, so no cut is safe), NULL if none. */
void anneal_tok_chunking(const anneal_tokenizer *t, bool *space_only, bool *strip_space, int32_t *crossing);

/* tokenizer.c: sets t->added from t->special (special, not normalized, no stripping)
 * when the loader gave none; sorts added tokens longest first. */
anneal_status anneal_tok_added_finish(anneal_tokenizer *t, const char *what);

/* bpe_encode.c: encodes one (normalized) segment of text that holds no added token:
 * pre-tokenizer, then BPE. The call's first segment is the one Metaspace's "first"
 * scheme prepends ▁ to (tokenizers: the first split that is not an added token). */
typedef struct anneal_tok_enc anneal_tok_enc;
anneal_status anneal_tok_encode_segment(anneal_tok_enc *x, const char *text, size_t len);
/* encode.c: the normalizer (NFC, Prepend("▁"), Replace(" ", "▁")) applied to s[0..n);
 * *out malloc'd. */
anneal_status anneal_tok_normalize(const anneal_tokenizer *t, const char *s, size_t n, char **out, size_t *out_len);
/* Starts / ends an encode call (the thread's cache); out receives the ids. */
anneal_tok_enc *anneal_tok_enc_begin(const anneal_tokenizer *t, anneal_ids *out, anneal_status *s);
void anneal_tok_enc_end(anneal_tok_enc *x);
/* Appends ids to the call's output. */
anneal_status anneal_tok_enc_emit(anneal_tok_enc *x, const int32_t *ids, size_t n);

/* bpe_encode.c: the per-thread caches' key (anneal_tok_caches_init, from anneal_tok_finish; without
 * a key encode still works, with a cache per call) and their release. */
void anneal_tok_caches_init(anneal_tokenizer *t);
void anneal_tok_caches_free(anneal_tokenizer *t);

#endif
