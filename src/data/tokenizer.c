/* Tokenizer tables: GPT-2's byte <-> unicode mapping, building a tokenizer from tokens
 * and merges (vocab map, pair map, specials, fingerprint), accessors, id arrays, and the
 * writer of encoder.json / vocab.bpe / tokenizer.json. */
#include "tokenizer_impl.h"

#include "anneal/fs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------- ids */

anneal_status anneal_ids_push(anneal_ids *v, int32_t id) {
    if (!v) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ids_push: NULL array");
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->ids, cap * sizeof *p);
        if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "token ids: out of memory (%zu ids)", cap);
        v->ids = p;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
    return ANNEAL_OK;
}

void anneal_ids_free(anneal_ids *v) {
    if (!v) return;
    free(v->ids);
    v->ids = NULL;
    v->n = v->cap = 0;
}

/* ------------------------------------------------- byte <-> unicode (GPT-2) */

/* The 68 bytes that are not shown as themselves: 0..32, 127..160 and 173, in order,
 * become U+0100 + k. */
uint32_t anneal_bpe_byte_to_cp(uint8_t b) {
    if (b <= 32) return 256u + b;
    if (b >= 127 && b <= 160) return 256u + 33u + (uint32_t)(b - 127);
    if (b == 173) return 256u + 67u;
    return b;
}

int anneal_bpe_cp_to_byte(uint32_t cp) {
    if (cp < 256) {
        if (cp <= 32 || (cp >= 127 && cp <= 160) || cp == 173) return -1;
        return (int)cp;
    }
    uint32_t k = cp - 256;
    if (k < 33) return (int)k;
    if (k < 67) return (int)(127 + k - 33);
    if (k == 67) return 173;
    return -1;
}

size_t anneal_bpe_bytes_to_str(const void *bytes, size_t n, char *out) {
    const unsigned char *b = bytes;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = anneal_bpe_byte_to_cp(b[i]);
        if (cp < 0x80) {
            out[o++] = (char)cp;
        } else { /* cp < 0x800: two bytes */
            out[o++] = (char)(0xC0 | (cp >> 6));
            out[o++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    return o;
}

/* Decodes one UTF-8 code point at s[*i] (strict); -1 if invalid. */
static int32_t utf8_next(const unsigned char *s, size_t n, size_t *i) {
    size_t p = *i;
    unsigned c = s[p];
    if (c < 0x80) {
        *i = p + 1;
        return (int32_t)c;
    }
    int k;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) { k = 1; cp = c & 0x1F; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { k = 2; cp = c & 0x0F; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { k = 3; cp = c & 0x07; min = 0x10000; }
    else return -1;
    if (n - p <= (size_t)k) return -1;
    for (int j = 1; j <= k; j++) {
        unsigned d = s[p + (size_t)j];
        if ((d & 0xC0) != 0x80) return -1;
        cp = cp << 6 | (d & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return -1;
    *i = p + (size_t)k + 1;
    return (int32_t)cp;
}

bool anneal_utf8_valid(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        if (utf8_next(u, n, &i) < 0) return false;
    }
    return true;
}

bool anneal_bpe_str_to_bytes(const char *s, size_t n, char *out, size_t *out_len) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, o = 0;
    while (i < n) {
        int32_t cp = utf8_next(u, n, &i);
        if (cp < 0) return false;
        int b = anneal_bpe_cp_to_byte((uint32_t)cp);
        if (b < 0) return false;
        out[o++] = (char)b;
    }
    *out_len = o;
    return true;
}

/* ------------------------------------------------------------- byte buffer */

/* Makes room for n more bytes plus a NUL. */
static anneal_status strbuf_reserve(anneal_strbuf *b, size_t n) {
    if (b->len + n + 1 <= b->cap) return ANNEAL_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory (buffer of %zu bytes)", cap);
    b->data = p;
    b->cap = cap;
    return ANNEAL_OK;
}

anneal_status anneal_strbuf_append(anneal_strbuf *b, const void *p, size_t n) {
    anneal_status s = strbuf_reserve(b, n);
    if (s) return s;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return ANNEAL_OK;
}

anneal_status anneal_strbuf_puts(anneal_strbuf *b, const char *s) {
    return anneal_strbuf_append(b, s, strlen(s));
}

anneal_status anneal_strbuf_printf(anneal_strbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return anneal_set_error(ANNEAL_ERR_ARG, "strbuf_printf: bad format");
    anneal_status s = strbuf_reserve(b, (size_t)n);
    if (s) return s;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return ANNEAL_OK;
}

anneal_status anneal_strbuf_json_string(anneal_strbuf *b, const char *s, size_t n) {
    anneal_status st = strbuf_reserve(b, 6 * n + 2);
    if (st) return st;
    char *o = b->data + b->len;
    *o++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            *o++ = '\\';
            *o++ = (char)c;
        } else if (c < 0x20 || c == 0x7F) {
            o += sprintf(o, "\\u%04x", c);
        } else {
            *o++ = (char)c;
        }
    }
    *o++ = '"';
    *o = 0;
    b->len = (size_t)(o - b->data);
    return ANNEAL_OK;
}

void anneal_strbuf_free(anneal_strbuf *b) {
    if (!b) return;
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* ---------------------------------------------------------------- building */

anneal_tokenizer *anneal_tok_new(void) {
    anneal_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->vmap_mask = 1023;
    t->vmap = malloc((t->vmap_mask + 1) * sizeof *t->vmap);
    t->off_cap = 1024;
    t->off = malloc(t->off_cap * sizeof *t->off);
    t->pairs_mask = 1023;
    t->pairs = malloc((t->pairs_mask + 1) * sizeof *t->pairs);
    if (!t->vmap || !t->off || !t->pairs) {
        free(t->vmap);
        free(t->off);
        free(t->pairs);
        free(t);
        return NULL;
    }
    memset(t->vmap, 0xFF, (t->vmap_mask + 1) * sizeof *t->vmap);
    for (uint64_t i = 0; i <= t->pairs_mask; i++) t->pairs[i].key = UINT64_MAX;
    t->off[0] = 0;
    for (int b = 0; b < 256; b++) t->byte_id[b] = -1;
    t->eot = -1;
    t->bos = t->eos = -1;
    t->sp.unk = -1;
    for (int b = 0; b < 256; b++) t->sp.byte_tok[b] = -1;
    pthread_mutex_init(&t->mu, NULL);
    return t;
}

/* Places id in the vocab map (no duplicate check). */
static void vmap_place(int32_t *map, uint64_t mask, const anneal_tokenizer *t, int32_t id) {
    size_t len;
    const char *b = tok_bytes(t, id, &len);
    uint64_t i = tok_hash(b, len) & mask;
    while (map[i] >= 0) i = (i + 1) & mask;
    map[i] = id;
}

anneal_status anneal_tok_add_token(anneal_tokenizer *t, const char *bytes, size_t n, int32_t *dup) {
    *dup = -1;
    if (t->n_vocab == INT32_MAX - 1) return anneal_set_error(ANNEAL_ERR_FORMAT, "too many tokens");
    int32_t prev = anneal_tok_lookup(t, bytes, n);
    if (prev >= 0) {
        *dup = prev;
        return ANNEAL_ERR_FORMAT;
    }
    /* grow: the byte arena, the offsets and (at half load) the map */
    if (t->bytes_len + n > t->bytes_cap) {
        size_t cap = t->bytes_cap ? t->bytes_cap : 4096;
        while (cap < t->bytes_len + n) cap *= 2;
        char *p = realloc(t->bytes, cap);
        if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer: out of memory");
        t->bytes = p;
        t->bytes_cap = cap;
    }
    int32_t id = t->n_vocab;
    if ((size_t)id + 2 > t->off_cap) {
        size_t cap = t->off_cap < 1024 ? 1024 : t->off_cap * 2;
        uint64_t *p = realloc(t->off, cap * sizeof *p);
        if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer: out of memory");
        t->off = p;
        t->off_cap = cap;
    }
    if (n) memcpy(t->bytes + t->bytes_len, bytes, n);
    t->bytes_len += n;
    t->off[id + 1] = t->bytes_len;
    t->n_vocab = id + 1;
    if ((uint64_t)t->n_vocab * 2 > t->vmap_mask + 1) {
        uint64_t mask = t->vmap_mask * 2 + 1;
        int32_t *map = malloc((mask + 1) * sizeof *map);
        if (!map) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer: out of memory");
        memset(map, 0xFF, (mask + 1) * sizeof *map);
        for (int32_t i = 0; i < id; i++) vmap_place(map, mask, t, i);
        free(t->vmap);
        t->vmap = map;
        t->vmap_mask = mask;
    }
    vmap_place(t->vmap, t->vmap_mask, t, id);
    if (n == 1) t->byte_id[(unsigned char)bytes[0]] = id;
    return ANNEAL_OK;
}

/* Places a pair in the pair map (no duplicate check). */
static void pairs_place(tok_pair_slot *map, uint64_t mask, uint64_t key, int32_t rank, int32_t merged) {
    uint64_t i = (key * 0x9E3779B97F4A7C15ull) >> 20 & mask;
    while (map[i].key != UINT64_MAX) i = (i + 1) & mask;
    map[i].key = key;
    map[i].rank = rank;
    map[i].merged = merged;
}

anneal_status anneal_tok_add_merge(anneal_tokenizer *t, int32_t left, int32_t right, int32_t *merged,
                            int *why) {
    *why = 0;
    size_t la, lb;
    const char *a = tok_bytes(t, left, &la);
    const char *b = tok_bytes(t, right, &lb);
    char small[256];
    char *cat = la + lb <= sizeof small ? small : malloc(la + lb);
    if (!cat) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer: out of memory");
    memcpy(cat, a, la);
    memcpy(cat + la, b, lb);
    int32_t m = anneal_tok_lookup(t, cat, la + lb);
    if (cat != small) free(cat);
    if (m < 0) {
        *why = 1;
        return ANNEAL_ERR_FORMAT;
    }
    int32_t prev_merged, prev = tok_pair_rank(t, left, right, &prev_merged);
    if (prev >= 0) {
        *why = 2;
        *merged = prev;
        return ANNEAL_ERR_FORMAT;
    }
    if (t->n_merges == t->merges_cap) {
        int32_t cap = t->merges_cap ? t->merges_cap * 2 : 1024;
        tok_merge *p = realloc(t->merges, (size_t)cap * sizeof *p);
        if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer: out of memory");
        t->merges = p;
        t->merges_cap = cap;
    }
    int32_t rank = t->n_merges++;
    t->merges[rank] = (tok_merge){left, right, m};
    if ((uint64_t)t->n_merges * 2 > t->pairs_mask + 1) {
        uint64_t mask = t->pairs_mask * 2 + 1;
        tok_pair_slot *map = malloc((mask + 1) * sizeof *map);
        if (!map) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer: out of memory");
        for (uint64_t i = 0; i <= mask; i++) map[i].key = UINT64_MAX;
        for (int32_t r = 0; r < rank; r++) {
            const tok_merge *g = &t->merges[r];
            pairs_place(map, mask, (uint64_t)(uint32_t)g->left << 32 | (uint32_t)g->right, r, g->merged);
        }
        free(t->pairs);
        t->pairs = map;
        t->pairs_mask = mask;
    }
    pairs_place(t->pairs, t->pairs_mask, (uint64_t)(uint32_t)left << 32 | (uint32_t)right, rank, m);
    *merged = m;
    return ANNEAL_OK;
}

/* FNV-1a 64 step over n bytes. */
static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001B3ull;
    }
    return h;
}

static uint64_t fnv1a_u32(uint64_t h, uint32_t v) {
    unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    return fnv1a(h, b, 4);
}

/* The fingerprint: FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3) over,
 * for each id 0..n_vocab-1 in order, its byte length as a little-endian u32 followed by
 * its bytes; then, for each merge in rank order, the left and right ids as
 * little-endian u32. Specials are covered through their bytes. */
static uint64_t tok_fingerprint(const anneal_tokenizer *t) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        size_t len;
        const char *b = tok_bytes(t, i, &len);
        h = fnv1a_u32(h, (uint32_t)len);
        h = fnv1a(h, b, len);
    }
    for (int32_t r = 0; r < t->n_merges; r++) {
        h = fnv1a_u32(h, (uint32_t)t->merges[r].left);
        h = fnv1a_u32(h, (uint32_t)t->merges[r].right);
    }
    /* what else changes the ids (absent for GPT-2's files, whose fingerprint stays) */
    if (t->pattern) h = fnv1a(h, t->pattern, strlen(t->pattern) + 1);
    unsigned char flags[12] = {(unsigned char)t->kind, t->pre_none, t->add_prefix_space, t->ignore_merges,
                               t->sp.norm_prepend, t->sp.norm_replace, t->sp.meta, (unsigned char)t->sp.meta_prepend,
                               t->sp.meta_split, t->sp.byte_fallback, t->sp.fuse_unk, t->sp.norm_nfc};
    bool plain = true;
    for (int i = 0; i < 12; i++) plain &= flags[i] == 0;
    if (!plain) h = fnv1a(h, flags, sizeof flags);
    for (int i = 0; i < t->n_added; i++) {
        const tok_added *a = &t->added[i];
        if (a->special && !a->normalized && !a->single_word && !a->lstrip && !a->rstrip) continue;
        unsigned char f[5] = {a->special, a->normalized, a->single_word, a->lstrip, a->rstrip};
        h = fnv1a_u32(h, (uint32_t)a->id);
        h = fnv1a(h, f, 5);
    }
    return h;
}

static const anneal_tokenizer *g_sort_tok; /* only during anneal_tok_finish's qsort */

/* Longer specials first, so that at one position the longest wins. */
static int special_cmp(const void *pa, const void *pb) {
    size_t la, lb;
    tok_bytes(g_sort_tok, *(const int32_t *)pa, &la);
    tok_bytes(g_sort_tok, *(const int32_t *)pb, &lb);
    if (la != lb) return la > lb ? -1 : 1;
    return *(const int32_t *)pa - *(const int32_t *)pb;
}

/* Added tokens: longer content first (at one position the longest wins), then by id. */
static int added_cmp(const void *pa, const void *pb) {
    const tok_added *a = pa, *b = pb;
    if (a->norm_len != b->norm_len) return a->norm_len > b->norm_len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

anneal_status anneal_tok_added_finish(anneal_tokenizer *t, const char *what) {
    if (!t->added && t->n_special) {
        t->added = calloc((size_t)t->n_special, sizeof *t->added);
        if (!t->added) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
        for (int i = 0; i < t->n_special; i++) {
            tok_added *a = &t->added[t->n_added];
            size_t n;
            const char *b = tok_bytes(t, t->special[i], &n);
            a->id = t->special[i];
            a->special = true;
            a->norm = malloc(n ? n : 1);
            if (!a->norm) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
            memcpy(a->norm, b, n);
            a->norm_len = n;
            t->n_added++;
        }
    }
    t->any_normalized_added = false;
    for (int i = 0; i < t->n_added; i++) t->any_normalized_added |= t->added[i].normalized;
    if (t->n_added) qsort(t->added, (size_t)t->n_added, sizeof *t->added, added_cmp);
    return ANNEAL_OK;
}

anneal_status anneal_tok_finish(anneal_tokenizer *t, const int32_t *special, int n_special,
                         const char *what) {
    for (int b = 0; b < 256 && t->kind == TOK_BYTE_LEVEL; b++)
        if (t->byte_id[b] < 0)
            return anneal_set_error(ANNEAL_ERR_FORMAT,
                                    "%s: the vocabulary has no token for byte 0x%02x "
                                    "(a byte-level BPE needs all 256)",
                                    what, b);
    t->is_special = calloc((size_t)t->n_vocab, 1);
    t->special = malloc((size_t)(n_special > 0 ? n_special : 1) * sizeof *t->special);
    if (!t->is_special || !t->special) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
    t->n_special = 0;
    for (int i = 0; i < n_special; i++) {
        int32_t id = special[i];
        if (id < 0 || id >= t->n_vocab || t->is_special[id] || t->off[id + 1] == t->off[id]) continue;
        t->is_special[id] = 1;
        t->special[t->n_special++] = id;
    }
    /* qsort with a global: anneal_tok_finish runs while loading, before anyone shares t */
    static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&sort_mu);
    g_sort_tok = t;
    qsort(t->special, (size_t)t->n_special, sizeof *t->special, special_cmp);
    g_sort_tok = NULL;
    pthread_mutex_unlock(&sort_mu);
    anneal_status s = anneal_tok_added_finish(t, what);
    if (s) return s;
    static const char *const eot_names[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"};
    t->eot = -1;
    if (t->eos >= 0 && t->eos < t->n_vocab) t->eot = t->eos;
    for (size_t k = 0; k < sizeof eot_names / sizeof *eot_names && t->eot < 0; k++) {
        int32_t id = anneal_tok_lookup(t, eot_names[k], strlen(eot_names[k]));
        if (id >= 0 && t->is_special[id]) t->eot = id;
    }
    if (t->kind == TOK_SENTENCEPIECE) {
        bool space_only, strip;
        int32_t crossing;
        anneal_tok_chunking(t, &space_only, &strip, &crossing);
        t->sp.word_split = crossing < 0 && anneal_tok_lookup(t, "\xE2\x96\x81", 3) >= 0;
    }
    t->fingerprint = tok_fingerprint(t);
    if (!t->pre_none) {
        t->pre = t->pattern ? anneal_pretokenizer_new_pattern(t->pattern, what) : anneal_pretokenizer_new();
        if (!t->pre) return anneal_last_status() ? anneal_last_status() : ANNEAL_ERR_UNSUPPORTED;
    }
    anneal_tok_caches_init(t);
    return ANNEAL_OK;
}

/* ---------------------------------------------------------------- accessors */

void anneal_tokenizer_free(anneal_tokenizer *tok) {
    if (!tok) return;
    anneal_tok_caches_free(tok);
    pthread_mutex_destroy(&tok->mu);
    anneal_pretokenizer_free(tok->pre);
    free(tok->bytes);
    free(tok->off);
    free(tok->vmap);
    free(tok->merges);
    free(tok->pairs);
    free(tok->special);
    free(tok->is_special);
    for (int i = 0; i < tok->n_added; i++) free(tok->added[i].norm);
    free(tok->added);
    free(tok->pattern);
    free(tok->dec);
    free(tok->dec_off);
    free(tok->chat_template);
    free(tok->hf_json);
    free(tok->hf_dir);
    free(tok->hf_config);
    free(tok);
}

int32_t anneal_tokenizer_vocab_size(const anneal_tokenizer *tok) { return tok ? tok->n_vocab : 0; }

int32_t anneal_tokenizer_eot(const anneal_tokenizer *tok) { return tok ? tok->eot : -1; }

uint64_t anneal_tokenizer_fingerprint(const anneal_tokenizer *tok) { return tok ? tok->fingerprint : 0; }

const char *anneal_tokenizer_token_bytes(const anneal_tokenizer *tok, int32_t id, size_t *len) {
    if (!tok || id < 0 || id >= tok->n_vocab) {
        if (len) *len = 0;
        return NULL;
    }
    size_t n;
    const char *b = tok_dec_bytes(tok, id, &n);
    if (len) *len = n;
    return b;
}

void anneal_tok_chunking(const anneal_tokenizer *t, bool *space_only, bool *strip_space, int32_t *crossing) {
    *space_only = *strip_space = false;
    *crossing = -1;
    if (t->kind != TOK_SENTENCEPIECE) return;
    *space_only = true;
    *strip_space = t->sp.norm_prepend || (t->sp.meta && t->sp.meta_prepend != 0);
    for (int32_t id = 0; id < t->n_vocab && *crossing < 0; id++) {
        size_t n;
        const char *b = tok_bytes(t, id, &n);
        if (t->is_special[id]) continue;
        for (size_t i = 1; i + 3 <= n; i++)
            if (memcmp(b + i, "\xE2\x96\x81", 3) == 0 && !(i >= 3 && memcmp(b + i - 3, "\xE2\x96\x81", 3) == 0)) {
                *crossing = id;
                break;
            }
    }
}

int32_t anneal_tokenizer_bos(const anneal_tokenizer *tok) { return tok ? tok->bos : -1; }

bool anneal_tokenizer_adds_bos(const anneal_tokenizer *tok) { return tok && tok->add_bos && tok->bos >= 0; }

const char *anneal_tokenizer_chat_template(const anneal_tokenizer *tok) { return tok ? tok->chat_template : NULL; }

int32_t anneal_tokenizer_token_id(const anneal_tokenizer *tok, const char *text) {
    if (!tok || !text) return -1;
    return anneal_tok_lookup(tok, text, strlen(text));
}

/* ---------------------------------------------------------------- tables */

anneal_status anneal_tokenizer_tables(const anneal_tokenizer *tok, anneal_bpe_tables *t) {
    memset(t, 0, sizeof *t);
    if (!tok) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer tables: NULL tokenizer");
    const char **b = malloc((size_t)tok->n_vocab * sizeof *b);
    size_t *l = malloc((size_t)tok->n_vocab * sizeof *l);
    int32_t(*m)[2] = malloc((size_t)(tok->n_merges ? tok->n_merges : 1) * sizeof *m);
    if (!b || !l || !m) {
        free(b);
        free(l);
        free(m);
        return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer tables: out of memory");
    }
    for (int32_t i = 0; i < tok->n_vocab; i++) b[i] = tok_bytes(tok, i, &l[i]);
    for (int32_t r = 0; r < tok->n_merges; r++) {
        m[r][0] = tok->merges[r].left;
        m[r][1] = tok->merges[r].right;
    }
    t->n_vocab = tok->n_vocab;
    t->tok = b;
    t->tok_len = l;
    t->n_merges = tok->n_merges;
    t->merges = (const int32_t(*)[2])m;
    t->n_special = tok->n_special;
    t->special = tok->special;
    return ANNEAL_OK;
}

void anneal_bpe_tables_release(anneal_bpe_tables *t) {
    if (!t) return;
    free((void *)t->tok);
    free((void *)t->tok_len);
    free((void *)t->merges);
    memset(t, 0, sizeof *t);
}

/* ---------------------------------------------------------------- writing */

/* Appends token id's key: its literal text if special, else its byte-level string. */
static anneal_status put_token_key(anneal_strbuf *b, anneal_strbuf *tmp, const anneal_bpe_tables *t,
                                   const unsigned char *is_special, int32_t id) {
    if (is_special[id]) return anneal_strbuf_json_string(b, t->tok[id], t->tok_len[id]);
    tmp->len = 0;
    anneal_status s = strbuf_reserve(tmp, 2 * t->tok_len[id]);
    if (s) return s;
    size_t n = anneal_bpe_bytes_to_str(t->tok[id], t->tok_len[id], tmp->data);
    return anneal_strbuf_json_string(b, tmp->data, n);
}

/* Appends the merge of rank r as "left right" (byte-level strings, no quotes). */
static anneal_status put_merge(anneal_strbuf *b, const anneal_bpe_tables *t, int32_t r) {
    int32_t l = t->merges[r][0], m = t->merges[r][1];
    anneal_status s = strbuf_reserve(b, 2 * (t->tok_len[l] + t->tok_len[m]) + 1);
    if (s) return s;
    b->len += anneal_bpe_bytes_to_str(t->tok[l], t->tok_len[l], b->data + b->len);
    b->data[b->len++] = ' ';
    b->len += anneal_bpe_bytes_to_str(t->tok[m], t->tok_len[m], b->data + b->len);
    b->data[b->len] = 0;
    return ANNEAL_OK;
}

/* Appends the Hugging Face tokenizer.json of a byte-level BPE to b: GPT-2's
 * pre-tokenisation as anneal runs it (a Split with its regex, then ByteLevel without
 * a regex of its own), specials as special added tokens, the ByteLevel decoder. */
anneal_status anneal_bpe_tokenizer_json(const anneal_bpe_tables *t, anneal_strbuf *out) {
    anneal_strbuf tmp = {0};
    unsigned char *is_special = calloc((size_t)t->n_vocab, 1);
    if (!is_special) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer.json: out of memory");
    for (int i = 0; i < t->n_special; i++)
        if (t->special[i] >= 0 && t->special[i] < t->n_vocab) is_special[t->special[i]] = 1;
    anneal_strbuf b = *out;
    anneal_status s = ANNEAL_OK;
    if (!s) s = anneal_strbuf_puts(&b, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n"
                                       "  \"padding\": null,\n  \"added_tokens\": [");
    for (int i = 0; i < t->n_special && !s; i++) {
        int32_t id = t->special[i];
        s = anneal_strbuf_printf(&b, "%s\n    {\"id\": %d, \"content\": ", i ? "," : "", (int)id);
        if (!s) s = anneal_strbuf_json_string(&b, t->tok[id], t->tok_len[id]);
        if (!s) s = anneal_strbuf_puts(&b, ", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
                                           "\"normalized\": false, \"special\": true}");
    }
    if (!s) s = anneal_strbuf_puts(
        &b, "\n  ],\n  \"normalizer\": null,\n"
            "  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [\n"
            "    {\"type\": \"Split\", \"pattern\": {\"Regex\": ");
    if (!s) s = anneal_strbuf_json_string(&b, ANNEAL_GPT2_PATTERN, strlen(ANNEAL_GPT2_PATTERN));
    if (!s) s = anneal_strbuf_puts(
        &b, "}, \"behavior\": \"Isolated\", \"invert\": false},\n"
            "    {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
            "\"use_regex\": false}]},\n"
            "  \"post_processor\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
            "\"trim_offsets\": false, \"use_regex\": true},\n"
            "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
            "\"trim_offsets\": true, \"use_regex\": true},\n"
            "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n"
            "    \"continuing_subword_prefix\": \"\",\n    \"end_of_word_suffix\": \"\",\n"
            "    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n    \"vocab\": {");
    for (int32_t i = 0; i < t->n_vocab && !s; i++) {
        s = anneal_strbuf_puts(&b, i ? ",\n      " : "\n      ");
        if (!s) s = put_token_key(&b, &tmp, t, is_special, i);
        if (!s) s = anneal_strbuf_printf(&b, ": %d", (int)i);
    }
    if (!s) s = anneal_strbuf_puts(&b, "\n    },\n    \"merges\": [");
    for (int32_t r = 0; r < t->n_merges && !s; r++) {
        s = anneal_strbuf_puts(&b, r ? ",\n      " : "\n      ");
        tmp.len = 0;
        if (!s) s = put_merge(&tmp, t, r);
        if (!s) s = anneal_strbuf_json_string(&b, tmp.data, tmp.len);
    }
    if (!s) s = anneal_strbuf_puts(&b, "\n    ]\n  }\n}\n");
    *out = b;
    anneal_strbuf_free(&tmp);
    free(is_special);
    return s;
}

/* Writes buffer b to dir/name atomically. */
static anneal_status write_in_dir(const char *dir, const char *name, const anneal_strbuf *b) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *path = malloc(n);
    if (!path) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory");
    snprintf(path, n, "%s/%s", dir, name);
    anneal_status s = anneal_write_file_atomic(path, b->data ? b->data : "", b->len);
    free(path);
    return s;
}

/* The files anneal_bpe_write_files writes (their "<name>.tmp.<pid>" temporaries of a
 * dead run are removed first). */
static bool bpe_files_own(const char *base, size_t n) {
    static const char *const names[] = {"encoder.json", "vocab.bpe", "tokenizer.json", "tokenizer_config.json"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (strlen(names[i]) == n && !strncmp(base, names[i], n)) return true;
    return false;
}

anneal_status anneal_bpe_write_files(const char *dir, const anneal_bpe_tables *t) {
    if (!dir || !t || t->n_vocab <= 0 || !t->tok || !t->tok_len || (t->n_merges && !t->merges))
        return anneal_set_error(ANNEAL_ERR_ARG, "write tokenizer files: bad arguments");
    anneal_remove_stale_tmp_files(dir, bpe_files_own); /* an interrupted earlier run's */
    for (int32_t r = 0; r < t->n_merges; r++)
        for (int k = 0; k < 2; k++)
            if (t->merges[r][k] < 0 || t->merges[r][k] >= t->n_vocab)
                return anneal_set_error(ANNEAL_ERR_ARG, "write tokenizer files: merge %d names id %d of %d",
                                        (int)r, (int)t->merges[r][k], (int)t->n_vocab);
    unsigned char *is_special = calloc((size_t)t->n_vocab, 1);
    if (!is_special) return anneal_set_error(ANNEAL_ERR_OOM, "write tokenizer files: out of memory");
    for (int i = 0; i < t->n_special; i++) {
        int32_t id = t->special[i];
        if (id < 0 || id >= t->n_vocab || !anneal_utf8_valid(t->tok[id], t->tok_len[id])) {
            free(is_special);
            return anneal_set_error(ANNEAL_ERR_ARG,
                                    "write tokenizer files: special id %d is out of range or not UTF-8",
                                    (int)id);
        }
        is_special[id] = 1;
    }
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        int e = errno;
        free(is_special);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create directory: %s", dir, strerror(e));
    }
    anneal_strbuf b = {0}, tmp = {0};
    anneal_status s = ANNEAL_OK;
    /* encoder.json: one line, like GPT-2's */
    s = anneal_strbuf_puts(&b, "{");
    for (int32_t i = 0; i < t->n_vocab && !s; i++) {
        if (i) s = anneal_strbuf_puts(&b, ", ");
        if (!s) s = put_token_key(&b, &tmp, t, is_special, i);
        if (!s) s = anneal_strbuf_printf(&b, ": %d", (int)i);
    }
    if (!s) s = anneal_strbuf_puts(&b, "}");
    if (!s) s = write_in_dir(dir, "encoder.json", &b);
    /* vocab.bpe */
    b.len = 0;
    if (!s) s = anneal_strbuf_puts(&b, "#version: 0.2\n");
    for (int32_t r = 0; r < t->n_merges && !s; r++) {
        s = put_merge(&b, t, r);
        if (!s) s = anneal_strbuf_puts(&b, "\n");
    }
    if (!s) s = write_in_dir(dir, "vocab.bpe", &b);
    /* tokenizer.json (Hugging Face tokenizers' layout) */
    b.len = 0;
    if (!s) s = anneal_bpe_tokenizer_json(t, &b);
    if (!s) s = write_in_dir(dir, "tokenizer.json", &b);
    /* tokenizer_config.json: what AutoTokenizer.from_pretrained(dir) needs besides */
    b.len = 0;
    int32_t eot = t->n_special ? t->special[0] : -1;
    for (int i = 0; i < t->n_special; i++)
        if (t->tok_len[t->special[i]] == 13 && memcmp(t->tok[t->special[i]], "<|endoftext|>", 13) == 0)
            eot = t->special[i];
    if (!s) s = anneal_strbuf_puts(&b, "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n"
                                       "  \"clean_up_tokenization_spaces\": false");
    for (int k = 0; k < 2 && !s; k++) {
        s = anneal_strbuf_printf(&b, ",\n  \"%s\": ", k ? "eos_token" : "bos_token");
        if (!s && eot < 0) s = anneal_strbuf_puts(&b, "null");
        else if (!s) s = anneal_strbuf_json_string(&b, t->tok[eot], t->tok_len[eot]);
    }
    if (!s) s = anneal_strbuf_puts(&b, ",\n  \"add_bos_token\": false,\n  \"add_eos_token\": false\n}\n");
    if (!s) s = write_in_dir(dir, "tokenizer_config.json", &b);
    anneal_strbuf_free(&b);
    anneal_strbuf_free(&tmp);
    free(is_special);
    return s;
}
