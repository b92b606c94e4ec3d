/* Encoding a text as Hugging Face tokenizers does: added tokens first (those matched on
 * the raw text, then, in each gap, the normalizer and the added tokens matched on
 * normalized text), then each remaining segment through the pre-tokenizer and BPE
 * (bpe_encode.c). A tokenizer with neither added tokens nor a normalizer (GPT-2's files
 * without specials) goes straight to the pre-tokenizer.
 *
 * Added-token matching follows tokenizers' AddedVocabulary::find_matches: leftmost,
 * longest on a tie, non-overlapping; a single_word token is skipped where a word
 * character touches it; lstrip / rstrip make the token swallow the whitespace before /
 * after it. */
#include "tokenizer_impl.h"
#include "unicode_nfc.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdlib.h>

#define META "\xE2\x96\x81" /* U+2581 '▁' */

/* Decodes the UTF-8 code point at s[i] (a lone byte for invalid input); *n its length. */
static uint32_t cp_at(const unsigned char *s, size_t len, size_t i, size_t *n) {
    unsigned c = s[i];
    size_t k = c < 0x80 ? 1 : c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
    if (i + k > len) k = 1;
    for (size_t j = 1; j < k; j++)
        if ((s[i + j] & 0xC0) != 0x80) k = 1;
    *n = k;
    if (k == 1) return c;
    uint32_t cp = c & (k == 2 ? 0x1F : k == 3 ? 0x0F : 0x07);
    for (size_t j = 1; j < k; j++) cp = cp << 6 | (s[i + j] & 0x3F);
    return cp;
}

/* Start of the code point that ends at s[end) (end > 0). */
static size_t cp_start_before(const unsigned char *s, size_t end) {
    size_t i = end - 1, lim = end >= 4 ? end - 4 : 0;
    while (i > lim && (s[i] & 0xC0) == 0x80) i--;
    size_t n;
    cp_at(s, end, i, &n);
    return i + n == end ? i : end - 1;
}

/* Unicode White_Space (what Rust's \s and str::trim use). */
static bool is_space_cp(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

static pcre2_code *g_word;
static pthread_once_t g_word_once = PTHREAD_ONCE_INIT;

/* Compiles the word-character class once (NULL on failure: then nothing is a word). */
static void word_init(void) {
    int err;
    PCRE2_SIZE off;
    g_word = pcre2_compile((PCRE2_SPTR) "^[\\p{L}\\p{N}\\p{M}\\p{Pc}]", PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                           &err, &off, NULL);
}

/* Rust regex's Unicode \w, for the code point c. */
static bool is_word_cp(uint32_t c) {
    if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    pthread_once(&g_word_once, word_init);
    if (!g_word) return false;
    unsigned char u[4];
    size_t n;
    if (c < 0x800) { u[0] = (unsigned char)(0xC0 | c >> 6); u[1] = (unsigned char)(0x80 | (c & 0x3F)); n = 2; }
    else if (c < 0x10000) { u[0] = (unsigned char)(0xE0 | c >> 12); u[1] = (unsigned char)(0x80 | (c >> 6 & 0x3F)); u[2] = (unsigned char)(0x80 | (c & 0x3F)); n = 3; }
    else { u[0] = (unsigned char)(0xF0 | c >> 18); u[1] = (unsigned char)(0x80 | (c >> 12 & 0x3F)); u[2] = (unsigned char)(0x80 | (c >> 6 & 0x3F)); u[3] = (unsigned char)(0x80 | (c & 0x3F)); n = 4; }
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return false;
    int rc = pcre2_match(g_word, u, n, 0, PCRE2_NO_UTF_CHECK, md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

/* Where the segment ends up: either straight to the pre-tokenizer (normalized pass),
 * or normalized and split again on the normalized added tokens. */
typedef struct split_ctx {
    const anneal_tokenizer *t;
    anneal_tok_enc *x;
    bool allow_special;
} split_ctx;

static anneal_status raw_gap(split_ctx *c, const char *s, size_t n, size_t off);

/* Splits s[0..n) on the added tokens of one pass (normalized or not) that are active,
 * emitting each token's id and handing each gap to the pass's next stage. */
static anneal_status split_added(split_ctx *c, const char *s, size_t n, size_t base, bool normalized_pass) {
    const anneal_tokenizer *t = c->t;
    const unsigned char *u = (const unsigned char *)s;
    size_t stack_next[32], *next = stack_next;
    int na = t->n_added;
    if (na > 32 && !(next = malloc((size_t)na * sizeof *next)))
        return anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory");
    for (int k = 0; k < na; k++) {
        const tok_added *a = &t->added[k];
        bool on = a->normalized == normalized_pass && (c->allow_special || !a->special);
        next[k] = on ? 0 : SIZE_MAX; /* 0: to be searched */
        if (on) {
            const char *f = memmem(s, n, a->norm, a->norm_len);
            next[k] = f ? (size_t)(f - s) : n;
        }
    }
    anneal_status st = ANNEAL_OK;
    size_t search = 0, done = 0; /* done: end of what has been emitted */
    while (!st) {
        int best = -1;
        size_t at = n;
        for (int k = 0; k < na; k++) {
            if (next[k] == SIZE_MAX) continue;
            if (next[k] < search) {
                const tok_added *a = &t->added[k];
                const char *f = search <= n ? memmem(s + search, n - search, a->norm, a->norm_len) : NULL;
                next[k] = f ? (size_t)(f - s) : n;
            }
            if (next[k] < at) { /* sorted longest first: on a tie the longest wins */
                at = next[k];
                best = k;
            }
        }
        if (best < 0) break;
        const tok_added *a = &t->added[best];
        size_t start = at, stop = at + a->norm_len, cl;
        search = stop;
        if (a->single_word) {
            bool before = start > 0 && is_word_cp(cp_at(u, n, cp_start_before(u, start), &cl));
            bool after = stop < n && is_word_cp(cp_at(u, n, stop, &cl));
            if (before || after) continue;
        }
        if (a->lstrip) {
            while (start > done) {
                size_t p = cp_start_before(u, start);
                if (!is_space_cp(cp_at(u, n, p, &cl))) break;
                start = p;
            }
        }
        if (a->rstrip) /* the next search still starts at the token's end, as tokenizers' does */
            while (stop < n && is_space_cp(cp_at(u, n, stop, &cl))) stop += cl;
        if (start > done)
            st = normalized_pass ? anneal_tok_encode_segment(c->x, s + done, start - done)
                                 : raw_gap(c, s + done, start - done, base + done);
        if (!st) st = anneal_tok_enc_emit(c->x, &a->id, 1);
        if (stop > done) done = stop;
    }
    if (!st && done < n)
        st = normalized_pass ? anneal_tok_encode_segment(c->x, s + done, n - done)
                             : raw_gap(c, s + done, n - done, base + done);
    if (next != stack_next) free(next);
    return st;
}

anneal_status anneal_tok_normalize(const anneal_tokenizer *t, const char *s, size_t n, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    char *nfc = NULL;
    if (t->sp.norm_nfc) {
        size_t nn;
        anneal_status st = anneal_nfc(s, n, &nfc, &nn);
        if (st) return st;
        if (!t->sp.norm_prepend && !t->sp.norm_replace) {
            *out = nfc;
            *out_len = nn;
            return ANNEAL_OK;
        }
        s = nfc;
        n = nn;
    }
    size_t spaces = 0;
    for (size_t i = 0; i < n; i++) spaces += s[i] == ' ';
    char *b = malloc(n + 2 * spaces + 4);
    if (!b) {
        free(nfc);
        return anneal_set_error(ANNEAL_ERR_OOM, "encode: out of memory");
    }
    size_t o = 0;
    if (t->sp.norm_prepend && n) {
        memcpy(b, META, 3);
        o = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ' && t->sp.norm_replace) {
            memcpy(b + o, META, 3);
            o += 3;
        } else {
            b[o++] = s[i];
        }
    }
    free(nfc);
    *out = b;
    *out_len = o;
    return ANNEAL_OK;
}

/* A gap of the raw text: normalize it, then split it on the normalized added tokens. */
static anneal_status raw_gap(split_ctx *c, const char *s, size_t n, size_t off) {
    const anneal_tokenizer *t = c->t;
    bool normalizes = t->sp.norm_nfc || t->sp.norm_prepend || t->sp.norm_replace;
    if (!normalizes) {
        if (!t->any_normalized_added) return anneal_tok_encode_segment(c->x, s, n);
        return split_added(c, s, n, off, true);
    }
    char *b;
    size_t bn;
    anneal_status st = anneal_tok_normalize(t, s, n, &b, &bn);
    if (st) return st;
    st = t->any_normalized_added ? split_added(c, b, bn, off, true) : anneal_tok_encode_segment(c->x, b, bn);
    free(b);
    return st;
}

anneal_status anneal_tokenizer_encode(const anneal_tokenizer *tok, const char *text, size_t len,
                                      bool allow_special, anneal_ids *out) {
    if (!tok || !out || (!text && len)) return anneal_set_error(ANNEAL_ERR_ARG, "encode: NULL argument");
    anneal_status st;
    anneal_tok_enc *x = anneal_tok_enc_begin(tok, out, &st);
    if (!x) return st;
    split_ctx c = {tok, x, allow_special};
    if (!len) {
    } else if (tok->n_added == 0) {
        st = raw_gap(&c, text, len, 0);
    } else {
        st = split_added(&c, text, len, 0, false);
    }
    anneal_tok_enc_end(x);
    return st;
}
