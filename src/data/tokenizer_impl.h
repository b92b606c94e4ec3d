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
    anneal_pretokenizer *pre;

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

/* bpe_encode.c: the per-thread caches' key (anneal_tok_caches_init, from anneal_tok_finish; without
 * a key encode still works, with a cache per call) and their release. */
void anneal_tok_caches_init(anneal_tokenizer *t);
void anneal_tok_caches_free(anneal_tokenizer *t);

#endif
