/* Byte-level BPE training (anneal_bpe_train, see tokenizer.h and bpe_train.h).
 *
 * The corpus is reduced to its distinct pre-tokenised pieces with counts
 * (bpe_train_count.c); each piece becomes a word, an array of token ids that starts as
 * its bytes (ids 0..255 are the bytes in GPT-2's order: the order of their
 * bytes_to_unicode code points, so a trained vocabulary starts exactly like GPT-2's).
 * The count of a pair (x, y) is the sum over words of word count x adjacent (x, y)
 * positions. A max-heap holds (count, pair) entries; each step pops the best pair,
 * rewrites only the words that hold it (an index pair -> word ids), and adjusts the
 * counts of the neighbouring pairs incrementally — nothing is ever recounted.
 *
 * Order of merges (deterministic): highest count first; equal counts are broken by
 * the pair's token byte strings, the left token's bytes first, then the right token's,
 * each compared as unsigned bytes with a proper prefix first (memcmp order). So with
 * counts tied, ("a","b") comes before ("a","c") and ("ab","c") before ("b","a").
 *
 * Lazy heap: a merge only ever lowers the counts of pairs that existed before it; the
 * pairs it raises all hold the new token and are new, so they are pushed once after
 * the merge with their final counts. A popped entry whose count is stale is pushed
 * again with the current count; since every entry's count is >= its pair's current
 * count, the first entry popped with an up-to-date count is the true maximum.
 *
 * A pair whose merged bytes already form a token (("ab","c") and ("a","bc") both give
 * "abc") is not merged (blocked for good): every merge creates a new token, token
 * 256 + r comes from merge r, and no two tokens have the same bytes — which is what
 * GPT-2-style loaders (encoder.json keys, tiktoken's rank check) require. */
#include "bpe_train.h"
#include "anneal/fs.h"
#include "tokenizer_internal.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* --------------------------------------------------------------- state */

typedef struct pair_rec {
    int32_t a, b;     /* left and right token ids */
    int64_t count;    /* sum over words of word count x adjacent (a, b) positions */
    int32_t *words;   /* ids of the words (a, b) has appeared in (may hold stale ones) */
    int32_t nw, capw;
    int32_t fresh;    /* merge index at which it was last queued to be pushed, or -1 */
    bool blocked;     /* its merged bytes already form a token: never merged */
} pair_rec;

typedef struct heap_entry {
    int64_t count;
    int32_t pair;
} heap_entry;

typedef struct trainer {
    /* tokens */
    char *tok_bytes;
    size_t tok_bytes_len, tok_bytes_cap;
    size_t *tok_off;
    uint32_t *tok_len;
    size_t tok_off_cap, tok_len_cap;
    int32_t n_tokens;
    int32_t *tok_map;        /* open addressing: token ids by bytes, -1 empty */
    size_t tok_map_cap;
    /* words */
    int32_t *sym;            /* all words' symbols */
    size_t *w_off;
    int32_t *w_len;
    int64_t *w_count;
    int32_t *w_stamp;        /* last merge that rewrote the word */
    int32_t n_words;
    /* pairs */
    pair_rec *pairs;
    int32_t n_pairs, pairs_cap;
    uint64_t *pmap_key;      /* open addressing: (a << 32 | b) -> pairs index */
    int32_t *pmap_val;
    size_t pmap_cap;
    /* heap of pair entries, and the pairs to push after the current merge */
    heap_entry *heap;
    size_t heap_n, heap_cap;
    int32_t *fresh;
    size_t fresh_n, fresh_cap;
    /* merges */
    int32_t (*merges)[2];
    int32_t n_merges, merges_cap;
} trainer;

static anneal_status oom(void) {
    return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer train: out of memory");
}

/* Grows *p (elements of size sz) to hold at least need elements; false when out of memory. */
static bool grow(void **p, size_t *cap, size_t need, size_t sz) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * sz);
    if (!q) return false;
    *p = q;
    *cap = c;
    return true;
}

static uint64_t hash_bytes(const char *p, size_t n) { /* FNV-1a: token strings are short */
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

/* ---------------------------------------------------------------- tokens */

static const char *tok_ptr(const trainer *t, int32_t id) { return t->tok_bytes + t->tok_off[id]; }

/* Slot in tok_map of the token with bytes p[0..n), or of the empty slot where it goes. */
static size_t tok_slot(const trainer *t, const char *p, size_t n) {
    size_t mask = t->tok_map_cap - 1, i = hash_bytes(p, n) & mask;
    for (;;) {
        int32_t id = t->tok_map[i];
        if (id < 0 || (t->tok_len[id] == n && !memcmp(tok_ptr(t, id), p, n))) return i;
        i = (i + 1) & mask;
    }
}

/* Appends a token with bytes p[0..n) (p not inside tok_bytes); returns its id or -1. */
static int32_t tok_add(trainer *t, const char *p, size_t n) {
    if (t->n_tokens == INT32_MAX) return -1;
    if ((size_t)(t->n_tokens + 1) * 2 > t->tok_map_cap) {
        size_t cap = t->tok_map_cap ? t->tok_map_cap * 2 : 1024;
        int32_t *m = malloc(cap * sizeof *m);
        if (!m) return -1;
        for (size_t i = 0; i < cap; i++) m[i] = -1;
        free(t->tok_map);
        t->tok_map = m;
        t->tok_map_cap = cap;
        for (int32_t id = 0; id < t->n_tokens; id++)
            t->tok_map[tok_slot(t, tok_ptr(t, id), t->tok_len[id])] = id;
    }
    if (!grow((void **)&t->tok_off, &t->tok_off_cap, (size_t)t->n_tokens + 1, sizeof *t->tok_off) ||
        !grow((void **)&t->tok_len, &t->tok_len_cap, (size_t)t->n_tokens + 1, sizeof *t->tok_len) ||
        !grow((void **)&t->tok_bytes, &t->tok_bytes_cap, t->tok_bytes_len + n, 1))
        return -1;
    memcpy(t->tok_bytes + t->tok_bytes_len, p, n);
    int32_t id = t->n_tokens++;
    t->tok_off[id] = t->tok_bytes_len;
    t->tok_len[id] = (uint32_t)n;
    t->tok_bytes_len += n;
    t->tok_map[tok_slot(t, tok_ptr(t, id), n)] = id;
    return id;
}

/* memcmp order of two tokens' bytes (a proper prefix first). */
static int tok_cmp(const trainer *t, int32_t x, int32_t y) {
    if (x == y) return 0;
    uint32_t lx = t->tok_len[x], ly = t->tok_len[y];
    int c = memcmp(tok_ptr(t, x), tok_ptr(t, y), lx < ly ? lx : ly);
    return c ? c : (lx > ly) - (lx < ly);
}

/* ----------------------------------------------------------------- pairs */

/* Index of pair (a, b), added with count 0 when new; -1 when out of memory. */
static int32_t pair_get(trainer *t, int32_t a, int32_t b) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    if ((size_t)(t->n_pairs + 1) * 2 > t->pmap_cap) {
        size_t cap = t->pmap_cap ? t->pmap_cap * 2 : 1 << 16;
        uint64_t *k = malloc(cap * sizeof *k);
        int32_t *v = malloc(cap * sizeof *v);
        if (!k || !v) {
            free(k);
            free(v);
            return -1;
        }
        memset(k, 0xff, cap * sizeof *k);
        for (size_t i = 0; i < t->pmap_cap; i++) {
            if (t->pmap_key[i] == UINT64_MAX) continue;
            size_t j = hash_u64(t->pmap_key[i]) & (cap - 1);
            while (k[j] != UINT64_MAX) j = (j + 1) & (cap - 1);
            k[j] = t->pmap_key[i];
            v[j] = t->pmap_val[i];
        }
        free(t->pmap_key);
        free(t->pmap_val);
        t->pmap_key = k;
        t->pmap_val = v;
        t->pmap_cap = cap;
    }
    size_t mask = t->pmap_cap - 1, i = hash_u64(key) & mask;
    while (t->pmap_key[i] != UINT64_MAX) {
        if (t->pmap_key[i] == key) return t->pmap_val[i];
        i = (i + 1) & mask;
    }
    if (t->n_pairs == INT32_MAX) return -1;
    size_t cap = (size_t)t->pairs_cap;
    if (!grow((void **)&t->pairs, &cap, (size_t)t->n_pairs + 1, sizeof *t->pairs)) return -1;
    t->pairs_cap = (int32_t)(cap < INT32_MAX ? cap : INT32_MAX);
    int32_t id = t->n_pairs++;
    t->pairs[id] = (pair_rec){a, b, 0, NULL, 0, 0, -1, false};
    t->pmap_key[i] = key;
    t->pmap_val[i] = id;
    return id;
}

/* Records that word w holds pair p (once per word: words are visited one at a time). */
static bool pair_add_word(pair_rec *p, int32_t w) {
    if (p->nw && p->words[p->nw - 1] == w) return true;
    if (p->nw == p->capw) {
        if (p->capw > INT32_MAX / 2) return false;
        int32_t c = p->capw ? p->capw * 2 : 4;
        int32_t *q = realloc(p->words, (size_t)c * sizeof *q);
        if (!q) return false;
        p->words = q;
        p->capw = c;
    }
    p->words[p->nw++] = w;
    return true;
}

/* ------------------------------------------------------------------ heap */

/* True if entry x must come out of the heap before y (see the top comment). */
static bool heap_before(const trainer *t, heap_entry x, heap_entry y) {
    if (x.count != y.count) return x.count > y.count;
    const pair_rec *p = &t->pairs[x.pair], *q = &t->pairs[y.pair];
    int c = tok_cmp(t, p->a, q->a);
    if (c) return c < 0;
    return tok_cmp(t, p->b, q->b) < 0;
}

static void heap_down(trainer *t, size_t i) {
    heap_entry *h = t->heap;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, best = i;
        if (l < t->heap_n && heap_before(t, h[l], h[best])) best = l;
        if (r < t->heap_n && heap_before(t, h[r], h[best])) best = r;
        if (best == i) return;
        heap_entry tmp = h[i];
        h[i] = h[best];
        h[best] = tmp;
        i = best;
    }
}

static bool heap_push(trainer *t, int64_t count, int32_t pair) {
    if (!grow((void **)&t->heap, &t->heap_cap, t->heap_n + 1, sizeof *t->heap)) return false;
    size_t i = t->heap_n++;
    t->heap[i] = (heap_entry){count, pair};
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!heap_before(t, t->heap[i], t->heap[parent])) break;
        heap_entry tmp = t->heap[i];
        t->heap[i] = t->heap[parent];
        t->heap[parent] = tmp;
        i = parent;
    }
    return true;
}

static heap_entry heap_pop(trainer *t) {
    heap_entry top = t->heap[0];
    t->heap[0] = t->heap[--t->heap_n];
    if (t->heap_n) heap_down(t, 0);
    return top;
}

/* --------------------------------------------------------------- merging */

/* Adds delta to the count of pair (x, y) for word w; a raised pair (always one holding
 * the new token) records w and is queued to be pushed after the merge. */
static bool pair_change(trainer *t, int32_t x, int32_t y, int64_t delta, int32_t w, int32_t merge) {
    int32_t id = pair_get(t, x, y);
    if (id < 0) return false;
    pair_rec *p = &t->pairs[id];
    p->count += delta;
    if (delta > 0) {
        if (!pair_add_word(p, w)) return false;
        if (p->fresh != merge) {
            p->fresh = merge;
            if (!grow((void **)&t->fresh, &t->fresh_cap, t->fresh_n + 1, sizeof *t->fresh)) return false;
            t->fresh[t->fresh_n++] = id;
        }
    }
    return true;
}

/* Rewrites word w, replacing each non-overlapping (a, b), left to right, with x, and
 * moves the counts of the neighbouring pairs: for "p a b n" the pairs (p, a) and
 * (b, n) lose the word's count and (p, x), (x, n) gain it (p may be an x written just
 * before, which keeps "a b a b" -> "x x" right). */
static bool merge_word(trainer *t, int32_t w, int32_t a, int32_t b, int32_t x, int32_t merge) {
    int32_t *s = t->sym + t->w_off[w];
    int32_t n = t->w_len[w], i = 0, j = 0;
    int64_t c = t->w_count[w];
    while (i < n) {
        if (i + 1 < n && s[i] == a && s[i + 1] == b) {
            if (j > 0) {
                if (!(s[j - 1] == a && a == b) && !pair_change(t, s[j - 1], a, -c, w, merge)) return false;
                if (!pair_change(t, s[j - 1], x, c, w, merge)) return false;
            }
            if (i + 2 < n) {
                if (!(s[i + 2] == b && a == b) && !pair_change(t, b, s[i + 2], -c, w, merge)) return false;
                if (!pair_change(t, x, s[i + 2], c, w, merge)) return false;
            }
            s[j++] = x;
            i += 2;
        } else {
            s[j++] = s[i++];
        }
    }
    t->w_len[w] = j;
    return true;
}

static void trainer_free(trainer *t) {
    free(t->tok_bytes);
    free(t->tok_off);
    free(t->tok_len);
    free(t->tok_map);
    free(t->sym);
    free(t->w_off);
    free(t->w_len);
    free(t->w_count);
    free(t->w_stamp);
    if (t->pairs)
        for (int32_t i = 0; i < t->n_pairs; i++) free(t->pairs[i].words);
    free(t->pairs);
    free(t->pmap_key);
    free(t->pmap_val);
    free(t->heap);
    free(t->fresh);
    free(t->merges);
    memset(t, 0, sizeof *t);
}

/* Ids 0..255: the bytes sorted by their GPT-2 byte-level code point (GPT-2's order:
 * '!'..'~', 0xA1..0xAC, 0xAE..0xFF, then the other 68 bytes in increasing order). */
static void gpt2_byte_order(uint8_t order[256]) {
    for (int i = 0; i < 256; i++) order[i] = (uint8_t)i;
    for (int i = 1; i < 256; i++) { /* insertion sort by code point */
        uint8_t v = order[i];
        int j = i;
        while (j > 0 && anneal_bpe_byte_to_cp(order[j - 1]) > anneal_bpe_byte_to_cp(v)) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
}

/* Builds the byte tokens, the words (pieces of >= 2 bytes), the pair counts and index,
 * and the heap. */
static anneal_status trainer_init(trainer *t, const anneal_piece_counts *pc) {
    uint8_t order[256];
    int32_t byte_id[256];
    gpt2_byte_order(order);
    for (int i = 0; i < 256; i++) {
        char c = (char)order[i];
        if (tok_add(t, &c, 1) != i) return oom();
        byte_id[order[i]] = i;
    }
    size_t nw = 0, nsym = 0;
    for (size_t i = 0; i < pc->n; i++)
        if (pc->len[i] >= 2) {
            nw++;
            nsym += pc->len[i];
        }
    if (nw > INT32_MAX)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "tokenizer train: more than 2^31 distinct pieces");
    size_t k = nw ? nw : 1;
    t->sym = malloc((nsym ? nsym : 1) * sizeof *t->sym);
    t->w_off = malloc(k * sizeof *t->w_off);
    t->w_len = malloc(k * sizeof *t->w_len);
    t->w_count = malloc(k * sizeof *t->w_count);
    t->w_stamp = malloc(k * sizeof *t->w_stamp);
    if (!t->sym || !t->w_off || !t->w_len || !t->w_count || !t->w_stamp) return oom();
    size_t at = 0;
    for (size_t i = 0; i < pc->n; i++) {
        if (pc->len[i] < 2) continue;
        int32_t w = t->n_words++;
        const unsigned char *p = (const unsigned char *)pc->bytes + pc->off[i];
        t->w_off[w] = at;
        t->w_len[w] = (int32_t)pc->len[i];
        t->w_count[w] = pc->count[i];
        t->w_stamp[w] = -1;
        for (uint32_t j = 0; j < pc->len[i]; j++) t->sym[at + j] = byte_id[p[j]];
        for (uint32_t j = 0; j + 1 < pc->len[i]; j++) {
            int32_t id = pair_get(t, t->sym[at + j], t->sym[at + j + 1]);
            if (id < 0 || !pair_add_word(&t->pairs[id], w)) return oom();
            t->pairs[id].count += pc->count[i];
        }
        at += pc->len[i];
    }
    for (int32_t i = 0; i < t->n_pairs; i++)
        if (!heap_push(t, t->pairs[i].count, i)) return oom();
    return ANNEAL_OK;
}

/* The merge loop: up to max_merges merges, fewer when no pair is left. */
static anneal_status trainer_run(trainer *t, int32_t max_merges, anneal_bpe_train_stats *stats,
                                 const anneal_bpe_train_opts *opts) {
    char *cat = NULL;
    size_t cat_cap = 0;
    while (t->n_merges < max_merges && t->heap_n > 0) {
        heap_entry top = heap_pop(t);
        pair_rec *p = &t->pairs[top.pair];
        if (p->blocked || p->count <= 0) continue;
        if (top.count != p->count) { /* stale: re-queue with the current count */
            if (!heap_push(t, p->count, top.pair)) goto fail;
            continue;
        }
        int32_t a = p->a, b = p->b;
        size_t la = t->tok_len[a], lb = t->tok_len[b];
        if (!grow((void **)&cat, &cat_cap, la + lb, 1)) goto fail;
        memcpy(cat, tok_ptr(t, a), la);
        memcpy(cat + la, tok_ptr(t, b), lb);
        if (t->tok_map[tok_slot(t, cat, la + lb)] >= 0) {
            p->blocked = true;
            continue;
        }
        int32_t x = tok_add(t, cat, la + lb);
        size_t mcap = (size_t)t->merges_cap;
        if (x < 0 || !grow((void **)&t->merges, &mcap, (size_t)t->n_merges + 1, sizeof *t->merges))
            goto fail;
        t->merges_cap = (int32_t)(mcap < INT32_MAX ? mcap : INT32_MAX);
        int32_t merge = t->n_merges++;
        t->merges[merge][0] = a;
        t->merges[merge][1] = b;
        /* p's word list is not touched while it is walked: the merge raises only pairs
         * holding x. t->pairs may move (pair_get), so keep the list and index. */
        int32_t *words = t->pairs[top.pair].words, nw = t->pairs[top.pair].nw;
        t->fresh_n = 0;
        for (int32_t k = 0; k < nw; k++) {
            int32_t w = words[k];
            if (t->w_stamp[w] == merge) continue;
            t->w_stamp[w] = merge;
            if (!merge_word(t, w, a, b, x, merge)) goto fail;
        }
        p = &t->pairs[top.pair];
        if (stats) stats->last_count = p->count;
        p->count = 0;
        free(p->words);
        p->words = NULL;
        p->nw = p->capw = 0;
        for (size_t k = 0; k < t->fresh_n; k++) {
            int32_t id = t->fresh[k];
            if (t->pairs[id].count > 0 && !heap_push(t, t->pairs[id].count, id)) goto fail;
        }
        if (stats) {
            stats->phase = 1;
            stats->n_merges = t->n_merges;
            stats->vocab_size = t->n_tokens + 1;
        }
        if (opts && opts->progress && opts->progress_every > 0 && t->n_merges % opts->progress_every == 0)
            opts->progress(stats, opts->user);
    }
    free(cat);
    return ANNEAL_OK;
fail:
    free(cat);
    return oom();
}

void anneal_bpe_model_free(anneal_bpe_model *m) {
    if (!m) return;
    free(m->bytes);
    free(m->off);
    free(m->len);
    free(m->merges);
    memset(m, 0, sizeof *m);
}

anneal_status anneal_bpe_learn(const anneal_piece_counts *pc, int32_t max_merges,
                               anneal_bpe_model *out, anneal_bpe_train_stats *stats,
                               const anneal_bpe_train_opts *opts) {
    if (!pc || !out || max_merges < 0) return anneal_set_error(ANNEAL_ERR_ARG, "bpe learn: bad argument");
    memset(out, 0, sizeof *out);
    anneal_bpe_train_stats local = {0};
    if (!stats) stats = &local;
    trainer t = {0};
    anneal_status st = trainer_init(&t, pc);
    stats->n_merges = 0;
    stats->vocab_size = 257;
    if (st == ANNEAL_OK) st = trainer_run(&t, max_merges, stats, opts);
    if (st != ANNEAL_OK) {
        trainer_free(&t);
        return st;
    }
    out->bytes = t.tok_bytes;
    out->off = t.tok_off;
    out->len = t.tok_len;
    out->n_tokens = t.n_tokens;
    out->merges = t.merges;
    out->n_merges = t.n_merges;
    t.tok_bytes = NULL;
    t.tok_off = NULL;
    t.tok_len = NULL;
    t.merges = NULL;
    trainer_free(&t);
    return ANNEAL_OK;
}

/* ----------------------------------------------------------------- files */

/* mkdir -p dir. */
static anneal_status make_dirs(const char *dir) {
    size_t n = strlen(dir);
    char *p = malloc(n + 1);
    if (!p) return oom();
    memcpy(p, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (p[i] != '/' && p[i] != '\0') continue;
        char c = p[i];
        p[i] = '\0';
        if (mkdir(p, 0777) != 0 && errno != EEXIST) {
            anneal_status s = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create directory: %s", p, strerror(errno));
            free(p);
            return s;
        }
        p[i] = c;
    }
    free(p);
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return anneal_set_error(ANNEAL_ERR_IO, "%s: not a directory", dir);
    return ANNEAL_OK;
}

/* Writes the model plus "<|endoftext|>" (the last id) into dir. */
static anneal_status write_model(const anneal_bpe_model *m, const char *dir) {
    static const char eot[] = "<|endoftext|>";
    int32_t n = m->n_tokens + 1;
    const char **tok = malloc((size_t)n * sizeof *tok);
    size_t *len = malloc((size_t)n * sizeof *len);
    if (!tok || !len) {
        free(tok);
        free(len);
        return oom();
    }
    for (int32_t i = 0; i < m->n_tokens; i++) {
        tok[i] = m->bytes + m->off[i];
        len[i] = m->len[i];
    }
    tok[n - 1] = eot;
    len[n - 1] = sizeof eot - 1;
    int32_t special = n - 1;
    anneal_bpe_tables tables = {
        .n_vocab = n, .tok = tok, .tok_len = len, .n_merges = m->n_merges,
        .merges = (const int32_t(*)[2])m->merges, .n_special = 1, .special = &special,
    };
    anneal_status st = make_dirs(dir);
    if (st == ANNEAL_OK) st = anneal_bpe_write_files(dir, &tables);
    free(tok);
    free(len);
    return st;
}

anneal_status anneal_bpe_train_ex(const char *const *files, int n_files, int32_t vocab_size,
                                  const char *out_dir, const anneal_bpe_train_opts *opts,
                                  anneal_bpe_train_stats *stats) {
    anneal_bpe_train_stats local = {0};
    if (!stats) stats = &local;
    memset(stats, 0, sizeof *stats);
    if (vocab_size < 257)
        return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer train: vocab size %d is too small (at least 257: "
                                "256 bytes + <|endoftext|>)", (int)vocab_size);
    if (!out_dir || !*out_dir) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer train: no output directory");
    if (!files || n_files <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer train: no input files");
    double t0 = now_s();
    anneal_piece_counts pc;
    anneal_status st = anneal_bpe_count_pieces(files, n_files, opts ? opts->n_threads : 0, 0, &pc);
    if (st != ANNEAL_OK) return st;
    stats->total_bytes = pc.total_bytes;
    stats->total_pieces = pc.total_pieces;
    stats->distinct_pieces = pc.n;
    stats->vocab_size = 257;
    stats->count_seconds = now_s() - t0;
    if (pc.total_bytes == 0) {
        anneal_piece_counts_free(&pc);
        return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer train: no text: %s",
                                n_files > 1 ? "the input files are all empty" : "the input file is empty");
    }
    if (opts && opts->progress) opts->progress(stats, opts->user);
    double t1 = now_s();
    anneal_bpe_model m;
    st = anneal_bpe_learn(&pc, vocab_size - 257, &m, stats, opts);
    anneal_piece_counts_free(&pc);
    if (st != ANNEAL_OK) return st;
    stats->merge_seconds = now_s() - t1;
    double t2 = now_s();
    st = write_model(&m, out_dir);
    stats->write_seconds = now_s() - t2;
    stats->phase = 2;
    anneal_bpe_model_free(&m);
    if (st == ANNEAL_OK && opts && opts->progress) opts->progress(stats, opts->user);
    return st;
}

anneal_status anneal_bpe_train(const char *const *files, int n_files, int32_t vocab_size,
                               const char *out_dir) {
    return anneal_bpe_train_ex(files, n_files, vocab_size, out_dir, NULL, NULL);
}
