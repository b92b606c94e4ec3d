/* Encoding: special-token splitting, GPT-2 pre-tokenisation (pretokenize.c), then per
 * piece a per-thread cache (piece bytes -> ids) in front of the BPE merge.
 *
 * The merge applies, among adjacent pairs, the one of lowest merge rank (leftmost on a
 * tie) until no pair has a merge: Hugging Face's order, and for GPT-2's files the same
 * result as encoder.py's "merge every occurrence of the best pair" (a merge's result only
 * takes part in merges of higher rank). Short pieces scan an array (O(n^2), n <= 48),
 * longer ones use a linked list and a binary heap of (rank, position), O(n log n).
 * Nothing is malloc'ed per piece: the scratch buffers live in the thread's cache.
 *
 * Thread safety: the tokenizer's tables are read-only after loading; each thread that
 * encodes gets its own cache (a pthread key per tokenizer), so threads never share
 * mutable state. A cache is bounded (1M entries / 64 MiB, then it starts over) and is
 * freed when its thread exits or by anneal_tokenizer_free, which must come after every
 * thread has finished encoding with the tokenizer. */
#include "tokenizer_impl.h"

#include <stdlib.h>

#define SMALL_PIECE 48              /* pieces up to this many bytes use the array scan */
#define CACHE_MAX_KEY 256           /* longer pieces are not cached */
#define CACHE_MAX_SLOTS (1u << 21)  /* at most 1M entries (half load) ... */
#define CACHE_MAX_ARENA (64u << 20) /* ... and 64 MiB of records, then the cache starts over */
#define SCRATCH_KEEP (1u << 16)     /* scratch for longer pieces is freed after use */

/* A thread's encode state for one tokenizer. slots: open addressing, each slot
 * (tag << 32 | record offset), 0 = empty. A record at arena + offset (4-aligned):
 * u32 key length, u32 id count, the key bytes padded to 4, the ids. */
typedef struct tok_cache {
    anneal_tokenizer *tok;
    struct tok_cache *prev, *next;
    uint64_t *slots;
    uint64_t mask;
    size_t count;
    char *arena;
    size_t arena_len, arena_cap;
    /* BPE scratch, n entries each (heap: 3n) */
    int32_t *ids, *ranks, *link_prev, *link_next;
    uint64_t *heap;
    size_t scratch_cap;
} tok_cache;

static bool cache_init(tok_cache *c, anneal_tokenizer *t) {
    memset(c, 0, sizeof *c);
    c->tok = t;
    c->mask = (1u << 14) - 1;
    c->slots = calloc(c->mask + 1, sizeof *c->slots);
    c->arena_cap = 1u << 18;
    c->arena = malloc(c->arena_cap);
    c->arena_len = 8; /* offset 0 means "empty" */
    if (!c->slots || !c->arena) {
        free(c->slots);
        free(c->arena);
        return false;
    }
    return true;
}

static void cache_release(tok_cache *c) {
    free(c->slots);
    free(c->arena);
    free(c->ids);
    free(c->ranks);
    free(c->link_prev);
    free(c->link_next);
    free(c->heap);
}

/* Thread exit: unlink this thread's cache from its tokenizer and free it. */
static void cache_destroy(void *p) {
    tok_cache *c = p;
    anneal_tokenizer *t = c->tok;
    pthread_mutex_lock(&t->mu);
    if (c->prev) c->prev->next = c->next;
    else t->caches = c->next;
    if (c->next) c->next->prev = c->prev;
    pthread_mutex_unlock(&t->mu);
    cache_release(c);
    free(c);
}

void anneal_tok_caches_init(anneal_tokenizer *t) {
    t->key_ok = pthread_key_create(&t->key, cache_destroy) == 0;
}

void anneal_tok_caches_free(anneal_tokenizer *t) {
    if (t->key_ok) pthread_key_delete(t->key); /* no destructor runs after this */
    t->key_ok = false;
    pthread_mutex_lock(&t->mu);
    tok_cache *c = t->caches;
    t->caches = NULL;
    pthread_mutex_unlock(&t->mu);
    while (c) {
        tok_cache *n = c->next;
        cache_release(c);
        free(c);
        c = n;
    }
}

/* This thread's cache for t (created on first use), or NULL (then the caller uses a
 * cache of its own for the call). */
static tok_cache *cache_get(const anneal_tokenizer *tc) {
    anneal_tokenizer *t = (anneal_tokenizer *)tc; /* the cache list is guarded by mu */
    if (!t->key_ok) return NULL;
    tok_cache *c = pthread_getspecific(t->key);
    if (c) return c;
    c = malloc(sizeof *c);
    if (!c) return NULL;
    if (!cache_init(c, t)) {
        free(c);
        return NULL;
    }
    if (pthread_setspecific(t->key, c) != 0) {
        cache_release(c);
        free(c);
        return NULL;
    }
    pthread_mutex_lock(&t->mu);
    c->next = t->caches;
    if (t->caches) t->caches->prev = c;
    t->caches = c;
    pthread_mutex_unlock(&t->mu);
    return c;
}

/* Grows the BPE scratch to n entries. */
static bool scratch_reserve(tok_cache *c, size_t n) {
    if (n <= c->scratch_cap) return true;
    size_t cap = c->scratch_cap ? c->scratch_cap : 256;
    while (cap < n) cap *= 2;
    int32_t *a = realloc(c->ids, cap * sizeof *a);
    if (a) c->ids = a;
    int32_t *b = realloc(c->ranks, cap * sizeof *b);
    if (b) c->ranks = b;
    int32_t *p = realloc(c->link_prev, cap * sizeof *p);
    if (p) c->link_prev = p;
    int32_t *q = realloc(c->link_next, cap * sizeof *q);
    if (q) c->link_next = q;
    uint64_t *h = realloc(c->heap, 3 * cap * sizeof *h); /* n - 1 pairs + 2 per merge */
    if (h) c->heap = h;
    if (!a || !b || !p || !q || !h) return false;
    c->scratch_cap = cap;
    return true;
}

static const uint32_t *cache_find(const tok_cache *c, const char *p, size_t n, uint64_t h,
                                  uint32_t *n_ids) {
    uint32_t tag = (uint32_t)(h >> 32);
    uint64_t i = h & c->mask;
    for (;;) {
        uint64_t s = c->slots[i];
        if (!s) return NULL;
        if ((uint32_t)(s >> 32) == tag) {
            const uint32_t *rec = (const uint32_t *)(c->arena + (uint32_t)s);
            if (rec[0] == n && memcmp(rec + 2, p, n) == 0) {
                *n_ids = rec[1];
                return rec + 2 + (n + 3) / 4;
            }
        }
        i = (i + 1) & c->mask;
    }
}

/* Empties the cache (keeps its memory). */
static void cache_clear(tok_cache *c) {
    memset(c->slots, 0, (c->mask + 1) * sizeof *c->slots);
    c->count = 0;
    c->arena_len = 8;
}

/* Remembers piece -> ids (best effort: on any failure the cache just misses later). */
static void cache_put(tok_cache *c, const char *p, size_t n, uint64_t h, const int32_t *ids,
                      size_t n_ids) {
    size_t rec = 8 + (n + 3) / 4 * 4 + n_ids * 4;
    if (c->arena_len + rec > CACHE_MAX_ARENA) cache_clear(c);
    if (c->arena_len + rec > c->arena_cap) {
        size_t cap = c->arena_cap * 2;
        while (cap < c->arena_len + rec) cap *= 2;
        char *a = realloc(c->arena, cap);
        if (!a) return;
        c->arena = a;
        c->arena_cap = cap;
    }
    if ((c->count + 1) * 2 > c->mask + 1) {
        if ((c->mask + 1) * 2 > CACHE_MAX_SLOTS) {
            cache_clear(c);
        } else {
            uint64_t mask = c->mask * 2 + 1;
            uint64_t *slots = calloc(mask + 1, sizeof *slots);
            if (!slots) return;
            for (uint64_t i = 0; i <= c->mask; i++) {
                uint64_t s = c->slots[i];
                if (!s) continue;
                const uint32_t *r = (const uint32_t *)(c->arena + (uint32_t)s);
                uint64_t j = tok_hash(r + 2, r[0]) & mask;
                while (slots[j]) j = (j + 1) & mask;
                slots[j] = s;
            }
            free(c->slots);
            c->slots = slots;
            c->mask = mask;
        }
    }
    uint32_t off = (uint32_t)c->arena_len;
    uint32_t *r = (uint32_t *)(c->arena + off);
    r[0] = (uint32_t)n;
    r[1] = (uint32_t)n_ids;
    memcpy(r + 2, p, n);
    memcpy(r + 2 + (n + 3) / 4, ids, n_ids * 4);
    c->arena_len += rec;
    uint64_t i = h & c->mask;
    while (c->slots[i]) i = (i + 1) & c->mask;
    c->slots[i] = (uint64_t)(uint32_t)(h >> 32) << 32 | off;
    c->count++;
}

/* BPE of a short piece: ids[0..n) start as its bytes' ids; returns the merged count. */
static size_t bpe_small(const anneal_tokenizer *t, int32_t *ids, int32_t *ranks, size_t n) {
    int32_t merged[SMALL_PIECE];
    for (size_t i = 0; i + 1 < n; i++) ranks[i] = tok_pair_rank(t, ids[i], ids[i + 1], &merged[i]);
    while (n > 1) {
        size_t best = 0;
        uint32_t best_rank = UINT32_MAX; /* rank -1 (no merge) becomes UINT32_MAX */
        for (size_t i = 0; i + 1 < n; i++)
            if ((uint32_t)ranks[i] < best_rank) {
                best_rank = (uint32_t)ranks[i];
                best = i;
            }
        if (best_rank == UINT32_MAX) break;
        ids[best] = merged[best];
        for (size_t i = best + 1; i + 1 < n; i++) {
            ids[i] = ids[i + 1];
            ranks[i] = ranks[i + 1];
            merged[i] = merged[i + 1];
        }
        n--;
        if (best > 0) ranks[best - 1] = tok_pair_rank(t, ids[best - 1], ids[best], &merged[best - 1]);
        if (best + 1 < n) ranks[best] = tok_pair_rank(t, ids[best], ids[best + 1], &merged[best]);
    }
    return n;
}

/* Min-heap of (rank << 32 | position): the lowest rank, then the leftmost position. */
static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= m) break;
        size_t s = l + 1 < m && h[l + 1] < h[l] ? l + 1 : l;
        if (h[s] >= v) break;
        h[i] = h[s];
        i = s;
    }
    if (m) h[i] = v;
    return top;
}

/* BPE of a long piece with a linked list over ids[0..n) and a heap of candidate merges;
 * stale heap entries (a side merged away, or the pair changed) are skipped when popped.
 * Compacts the result into ids and returns its length. */
static size_t bpe_large(const anneal_tokenizer *t, tok_cache *c, size_t n) {
    int32_t *ids = c->ids, *prv = c->link_prev, *nxt = c->link_next;
    uint64_t *heap = c->heap;
    size_t hn = 0;
    int32_t m;
    for (size_t i = 0; i < n; i++) {
        prv[i] = (int32_t)i - 1;
        nxt[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = tok_pair_rank(t, ids[i], ids[i + 1], &m);
        if (r >= 0) heap_push(heap, &hn, (uint64_t)(uint32_t)r << 32 | i);
    }
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        int32_t rank = (int32_t)(top >> 32), pos = (int32_t)(uint32_t)top;
        if (ids[pos] < 0) continue; /* merged into its left neighbour */
        int32_t right = nxt[pos];
        if (right < 0) continue;
        if (tok_pair_rank(t, ids[pos], ids[right], &m) != rank) continue; /* the pair changed */
        ids[pos] = m;
        ids[right] = -1;
        nxt[pos] = nxt[right];
        if (nxt[pos] >= 0) prv[nxt[pos]] = pos;
        int32_t r;
        if (prv[pos] >= 0 && (r = tok_pair_rank(t, ids[prv[pos]], ids[pos], &m)) >= 0)
            heap_push(heap, &hn, (uint64_t)(uint32_t)r << 32 | (uint32_t)prv[pos]);
        if (nxt[pos] >= 0 && (r = tok_pair_rank(t, ids[pos], ids[nxt[pos]], &m)) >= 0)
            heap_push(heap, &hn, (uint64_t)(uint32_t)r << 32 | (uint32_t)pos);
    }
    size_t k = 0;
    for (int32_t i = 0; i >= 0; i = nxt[i]) ids[k++] = ids[i];
    return k;
}

/* State of one encode call. */
struct anneal_tok_enc {
    const anneal_tokenizer *t;
    tok_cache *c;
    tok_cache local; /* used when the thread has no cache of its own */
    anneal_ids *out;
    anneal_status err;
    bool had_segment; /* a segment has been encoded (Metaspace "first") */
};
typedef struct anneal_tok_enc enc_ctx;

/* Appends n ids to out. */
static bool out_append(enc_ctx *x, const int32_t *ids, size_t n) {
    anneal_ids *o = x->out;
    if (o->n + n > o->cap) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap < o->n + n) cap *= 2;
        int32_t *p = realloc(o->ids, cap * sizeof *p);
        if (!p) {
            x->err = anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory (%zu ids)", cap);
            return false;
        }
        o->ids = p;
        o->cap = cap;
    }
    memcpy(o->ids + o->n, ids, n * sizeof *ids);
    o->n += n;
    return true;
}

anneal_status anneal_tok_enc_emit(anneal_tok_enc *x, const int32_t *ids, size_t n) {
    return out_append(x, ids, n) ? ANNEAL_OK : x->err;
}

/* Length of the UTF-8 character at p[0..n) (1 for a byte that starts none). */
static size_t utf8_char_len(const unsigned char *p, size_t n) {
    unsigned c = p[0];
    size_t k = c < 0x80 ? 1 : c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 && c < 0xE0 ? 2 : 1;
    if (k > n) return 1;
    for (size_t j = 1; j < k; j++)
        if ((p[j] & 0xC0) != 0x80) return 1;
    return k;
}

/* SentencePiece-style first symbols of piece p[0..n): each character's token, else its
 * bytes' "<0xNN>" tokens (byte fallback), else the unknown token (consecutive ones fused
 * if fuse_unk), else nothing (tokenizers drops such a character too). */
static size_t sp_symbols(const anneal_tokenizer *t, const char *p, size_t n, int32_t *ids) {
    const tok_sp *sp = &t->sp;
    size_t k = 0;
    bool last_unk = false;
    for (size_t i = 0; i < n;) {
        size_t cl = utf8_char_len((const unsigned char *)p + i, n - i);
        int32_t id = anneal_tok_lookup(t, p + i, cl);
        if (id >= 0) {
            ids[k++] = id;
            last_unk = false;
        } else {
            bool done = false;
            if (sp->byte_fallback) {
                done = true;
                for (size_t j = 0; j < cl; j++) done &= sp->byte_tok[(unsigned char)p[i + j]] >= 0;
                if (done) {
                    for (size_t j = 0; j < cl; j++) ids[k++] = sp->byte_tok[(unsigned char)p[i + j]];
                    last_unk = false;
                }
            }
            if (!done && sp->unk >= 0) {
                if (!(sp->fuse_unk && last_unk)) ids[k++] = sp->unk;
                last_unk = true;
            }
        }
        i += cl;
    }
    return k;
}

/* Encodes one pre-tokenised piece (pretokenize callback). */
static bool encode_piece(const char *p, size_t n, void *user) {
    enc_ctx *x = user;
    const anneal_tokenizer *t = x->t;
    tok_cache *c = x->c;
    if (n == 1 && t->kind == TOK_BYTE_LEVEL) {
        int32_t id = t->byte_id[(unsigned char)p[0]];
        return out_append(x, &id, 1);
    }
    uint64_t h = 0;
    if (n <= CACHE_MAX_KEY) {
        h = tok_hash(p, n);
        uint32_t k;
        const uint32_t *hit = cache_find(c, p, n, h, &k);
        if (hit) return out_append(x, (const int32_t *)hit, k);
    }
    if (!scratch_reserve(c, n)) {
        x->err = anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory (piece of %zu bytes)", n);
        return false;
    }
    int32_t *ids = c->ids;
    size_t k;
    int32_t whole = t->ignore_merges ? anneal_tok_lookup(t, p, n) : -1;
    if (whole >= 0 && !t->is_special[whole]) {
        ids[0] = whole;
        k = 1;
    } else {
        if (t->kind == TOK_BYTE_LEVEL) {
            for (size_t i = 0; i < n; i++) ids[i] = t->byte_id[(unsigned char)p[i]];
            k = n;
        } else {
            k = sp_symbols(t, p, n, ids);
        }
        k = k <= SMALL_PIECE ? bpe_small(t, ids, c->ranks, k) : bpe_large(t, c, k);
    }
    bool huge = n > SCRATCH_KEEP;
    if (n <= CACHE_MAX_KEY) cache_put(c, p, n, h, ids, k);
    bool ok = out_append(x, ids, k);
    if (huge) { /* do not hold ~40 bytes per byte of a rare huge piece for the thread's life */
        free(c->ids);
        free(c->ranks);
        free(c->link_prev);
        free(c->link_next);
        free(c->heap);
        c->ids = c->ranks = c->link_prev = c->link_next = NULL;
        c->heap = NULL;
        c->scratch_cap = 0;
    }
    return ok;
}

#define META "\xE2\x96\x81" /* U+2581 '▁', SentencePiece's space */

/* Runs the pre-tokenizer's regex (or none) over s[0..n), encoding each piece. */
static anneal_status split_and_encode(enc_ctx *x, const char *s, size_t n) {
    if (!n) return ANNEAL_OK;
    if (!x->t->pre && x->t->sp.word_split) { /* pieces "▁...▁word": the same ids, and cached */
        size_t start = 0;
        for (size_t i = 1; i + 3 <= n; i++)
            if (s[i] == '\xE2' && memcmp(s + i, META, 3) == 0 && !(i >= 3 && memcmp(s + i - 3, META, 3) == 0)) {
                if (!encode_piece(s + start, i - start, x)) return x->err;
                start = i;
                i += 2;
            }
        return encode_piece(s + start, n - start, x) ? ANNEAL_OK : x->err;
    }
    if (!x->t->pre) return encode_piece(s, n, x) ? ANNEAL_OK : x->err;
    anneal_status st = anneal_pretokenize(x->t->pre, s, n, encode_piece, x);
    return st ? st : x->err;
}

/* Metaspace pre-tokenisation of s[0..n): spaces become ▁, a ▁ is prepended as the
 * scheme says, and (split) the text is cut before each ▁. */
static anneal_status metaspace_encode(enc_ctx *x, const char *s, size_t n, bool first) {
    const tok_sp *sp = &x->t->sp;
    size_t spaces = 0;
    for (size_t i = 0; i < n; i++) spaces += s[i] == ' ';
    char *buf = malloc(n + 2 * spaces + 4);
    if (!buf) return anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(buf + o, META, 3);
            o += 3;
        } else {
            buf[o++] = s[i];
        }
    }
    bool prepend = sp->meta_prepend == 1 || (sp->meta_prepend == 2 && first);
    if (prepend && o && !(o >= 3 && memcmp(buf, META, 3) == 0)) {
        memmove(buf + 3, buf, o);
        memcpy(buf, META, 3);
        o += 3;
    }
    anneal_status st = ANNEAL_OK;
    if (!sp->meta_split) {
        st = split_and_encode(x, buf, o);
    } else {
        size_t start = 0;
        for (size_t i = 1; i + 3 <= o && !st; i++)
            if (memcmp(buf + i, META, 3) == 0) {
                st = split_and_encode(x, buf + start, i - start);
                start = i;
                i += 2;
            }
        if (!st) st = split_and_encode(x, buf + start, o - start);
    }
    free(buf);
    return st;
}

anneal_status anneal_tok_encode_segment(anneal_tok_enc *x, const char *text, size_t len) {
    if (!len) return ANNEAL_OK;
    const anneal_tokenizer *t = x->t;
    bool first = !x->had_segment;
    x->had_segment = true;
    if (t->sp.meta) return metaspace_encode(x, text, len, first);
    if (t->add_prefix_space && text[0] != ' ') { /* HF ByteLevel: " " before each segment */
        char *tmp = malloc(len + 1);
        if (!tmp) return anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory");
        tmp[0] = ' ';
        memcpy(tmp + 1, text, len);
        anneal_status s = split_and_encode(x, tmp, len + 1);
        free(tmp);
        return s;
    }
    return split_and_encode(x, text, len);
}

anneal_tok_enc *anneal_tok_enc_begin(const anneal_tokenizer *tok, anneal_ids *out, anneal_status *s) {
    enc_ctx *x = calloc(1, sizeof *x);
    if (!x) {
        *s = anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory");
        return NULL;
    }
    x->t = tok;
    x->out = out;
    x->c = cache_get(tok);
    if (!x->c) {
        if (!cache_init(&x->local, (anneal_tokenizer *)tok)) {
            free(x);
            *s = anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory");
            return NULL;
        }
        x->c = &x->local;
    }
    *s = ANNEAL_OK;
    return x;
}

void anneal_tok_enc_end(anneal_tok_enc *x) {
    if (!x) return;
    if (x->c == &x->local) cache_release(&x->local);
    free(x);
}
