/* GPT-2 byte-level BPE: reference ids from the JS gpt-3-encoder, a naive encoder.py-style
 * BPE written here as the independent reference for the merge loop, special tokens,
 * decode and streaming decode round trips, tokenizer.json loading (both merge layouts,
 * and one built here from GPT-2's files), the file writer, fingerprints and
 * multithreaded encoding. */
#include "anneal/tokenizer.h"
#include "data/pretokenize.h"
#include "data/tokenizer_internal.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------ helpers */

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)len + 1);
    if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[len] = 0;
    *n = (size_t)len;
    return b;
}

static bool write_all(const char *path, const char *s, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(s, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* GPT-2's files as the repository ships them (data/gpt2, the same bytes as
 * ../shared/data/gpt2). */
static const char *gpt2_dir(void) { return anneal_test_path("data/gpt2"); }

/* Loads GPT-2 from data/gpt2; NULL after recording a test failure (the files ship in
 * the repository, so a load error is a bug): callers just return. */
static anneal_tokenizer *load_gpt2_shared(void) {
    char e[4200], v[4200];
    snprintf(e, sizeof e, "%s/encoder.json", gpt2_dir());
    snprintf(v, sizeof v, "%s/vocab.bpe", gpt2_dir());
    anneal_tokenizer *t = NULL;
    if (anneal_tokenizer_load_gpt2(e, v, &t) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "loading %s: %s", e, anneal_last_error());
        return NULL;
    }
    return t;
}

/* The reference texts and ids in ../shared/data/tokenizer are not in the repository:
 * `make test` expects ../shared beside the checkout. */
#define SKIP_NO_SHARED(what) SKIP_PROMISED("%s not found (make test expects ../shared beside the checkout)", what)

/* Strict UTF-8 check written here (not the library's). */
static bool utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        int k;
        unsigned cp;
        if (c < 0x80) { i++; continue; }
        else if ((c & 0xE0) == 0xC0) { k = 1; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { k = 2; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { k = 3; cp = c & 0x07; }
        else return false;
        if (i + (size_t)k >= n) return false;
        for (int j = 1; j <= k; j++) {
            if ((s[i + (size_t)j] & 0xC0) != 0x80) return false;
            cp = cp << 6 | (s[i + (size_t)j] & 0x3F);
        }
        static const unsigned min[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < min[k] || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return false;
        i += (size_t)k + 1;
    }
    return true;
}

/* GPT-2's bytes_to_unicode, written out as encoder.py does it. */
static void byte_table(unsigned cp[256]) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        cp[b] = printable ? (unsigned)b : 256u + (unsigned)n++;
    }
}

/* UTF-8 text -> bytes through the inverse byte table; returns length or -1. */
static long unmap(const char *s, unsigned char *out) {
    unsigned cp[256];
    byte_table(cp);
    long o = 0;
    const unsigned char *u = (const unsigned char *)s;
    while (*u) {
        unsigned c;
        if (*u < 0x80) c = *u++;
        else if ((*u & 0xE0) == 0xC0) { c = (unsigned)(u[0] & 0x1F) << 6 | (u[1] & 0x3F); u += 2; }
        else return -1;
        int b = -1;
        for (int k = 0; k < 256; k++)
            if (cp[k] == c) b = k;
        if (b < 0) return -1;
        out[o++] = (unsigned char)b;
    }
    return o;
}

/* --------------------------------------------- naive GPT-2 BPE (encoder.py) */

/* A byte string key: (len, bytes); merges keyed by left + 0xFF-free separator trick:
 * we key on "len(left) as 2 bytes + left + right". */
typedef struct { char *k; size_t n; int v; } kv;
static int kv_cmp(const void *a, const void *b) {
    const kv *x = a, *y = b;
    size_t m = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->k, y->k, m);
    return c ? c : (x->n < y->n ? -1 : x->n > y->n);
}
static int kv_find(const kv *t, size_t n, const char *k, size_t kn) {
    kv key = {(char *)k, kn, 0};
    const kv *f = bsearch(&key, t, n, sizeof *t, kv_cmp);
    return f ? f->v : -1;
}

typedef struct { kv *ranks, *vocab; size_t n_ranks, n_vocab; } naive_bpe;

static bool naive_load(naive_bpe *nb) {
    char p[4200];
    size_t n;
    snprintf(p, sizeof p, "%s/encoder.json", gpt2_dir());
    char *ej = read_all(p, &n);
    snprintf(p, sizeof p, "%s/vocab.bpe", gpt2_dir());
    char *vb = read_all(p, &n);
    if (!ej || !vb) { free(ej); free(vb); return false; }
    cJSON *root = cJSON_Parse(ej);
    nb->n_vocab = (size_t)cJSON_GetArraySize(root);
    nb->vocab = calloc(nb->n_vocab, sizeof *nb->vocab);
    size_t i = 0;
    for (cJSON *it = root->child; it; it = it->next, i++) {
        unsigned char buf[512];
        long l = unmap(it->string, buf);
        if (l < 0) { l = (long)strlen(it->string); memcpy(buf, it->string, (size_t)l); }
        nb->vocab[i].k = malloc((size_t)l);
        memcpy(nb->vocab[i].k, buf, (size_t)l);
        nb->vocab[i].n = (size_t)l;
        nb->vocab[i].v = it->valueint;
    }
    cJSON_Delete(root);
    qsort(nb->vocab, nb->n_vocab, sizeof *nb->vocab, kv_cmp);
    nb->ranks = calloc(60000, sizeof *nb->ranks);
    nb->n_ranks = 0;
    char *save = NULL;
    int line = 0;
    for (char *l = strtok_r(vb, "\n", &save); l; l = strtok_r(NULL, "\n", &save), line++) {
        if (line == 0) continue; /* #version */
        char *sp = strchr(l, ' ');
        *sp = 0;
        unsigned char a[512], b[512];
        long la = unmap(l, a), lb = unmap(sp + 1, b);
        kv *r = &nb->ranks[nb->n_ranks];
        r->n = 2 + (size_t)la + (size_t)lb;
        r->k = malloc(r->n);
        r->k[0] = (char)(la >> 8);
        r->k[1] = (char)la;
        memcpy(r->k + 2, a, (size_t)la);
        memcpy(r->k + 2 + la, b, (size_t)lb);
        r->v = line - 1;
        nb->n_ranks++;
    }
    qsort(nb->ranks, nb->n_ranks, sizeof *nb->ranks, kv_cmp);
    free(ej);
    free(vb);
    return true;
}

static void naive_free(naive_bpe *nb) {
    for (size_t i = 0; i < nb->n_vocab; i++) free(nb->vocab[i].k);
    for (size_t i = 0; i < nb->n_ranks; i++) free(nb->ranks[i].k);
    free(nb->vocab);
    free(nb->ranks);
}

static int naive_rank(const naive_bpe *nb, const char *a, size_t la, const char *b, size_t lb) {
    char key[4096];
    if (2 + la + lb > sizeof key) return -1;
    key[0] = (char)(la >> 8);
    key[1] = (char)la;
    memcpy(key + 2, a, la);
    memcpy(key + 2 + la, b, lb);
    return kv_find(nb->ranks, nb->n_ranks, key, 2 + la + lb);
}

/* encoder.py's bpe(): repeatedly take the lowest-ranked pair and merge every
 * occurrence of it, left to right. Appends ids; returns how many. */
static size_t naive_encode_piece(const naive_bpe *nb, const char *p, size_t n, int32_t *ids) {
    size_t *st = malloc(n * sizeof *st), *ln = malloc(n * sizeof *ln), m = n; /* parts: offsets+lengths */
    for (size_t i = 0; i < n; i++) { st[i] = i; ln[i] = 1; }
    for (;;) {
        int best = -1;
        size_t bi = 0;
        for (size_t i = 0; i + 1 < m; i++) {
            int r = naive_rank(nb, p + st[i], ln[i], p + st[i + 1], ln[i + 1]);
            if (r >= 0 && (best < 0 || r < best)) { best = r; bi = i; }
        }
        if (best < 0) break;
        size_t la = ln[bi], lb = ln[bi + 1];
        char first[4096], second[4096];
        memcpy(first, p + st[bi], la);
        memcpy(second, p + st[bi + 1], lb);
        size_t o = 0;
        for (size_t i = 0; i < m;) {
            if (i + 1 < m && ln[i] == la && ln[i + 1] == lb && !memcmp(p + st[i], first, la) &&
                !memcmp(p + st[i + 1], second, lb)) {
                st[o] = st[i]; ln[o] = la + lb; o++; i += 2;
            } else {
                st[o] = st[i]; ln[o] = ln[i]; o++; i++;
            }
        }
        m = o;
    }
    for (size_t i = 0; i < m; i++) ids[i] = kv_find(nb->vocab, nb->n_vocab, p + st[i], ln[i]);
    free(st);
    free(ln);
    return m;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* ------------------------------------------------------------------ tests */

TEST(byte_table_matches_gpt2) {
    unsigned cp[256];
    byte_table(cp);
    for (int b = 0; b < 256; b++) {
        CHECK(anneal_bpe_byte_to_cp((uint8_t)b) == cp[b], "byte %d -> U+%04X, want U+%04X", b,
              anneal_bpe_byte_to_cp((uint8_t)b), cp[b]);
        CHECK(anneal_bpe_cp_to_byte(cp[b]) == b, "U+%04X -> %d", cp[b], anneal_bpe_cp_to_byte(cp[b]));
    }
    CHECK_TRUE(anneal_bpe_byte_to_cp(' ') == 0x120 && anneal_bpe_byte_to_cp('\n') == 0x10A);
    CHECK_TRUE(anneal_bpe_cp_to_byte(0x144) == -1 && anneal_bpe_cp_to_byte(0x20) == -1);
    unsigned char all[256];
    for (int b = 0; b < 256; b++) all[b] = (unsigned char)b;
    char s[512], back[256];
    size_t n = anneal_bpe_bytes_to_str(all, 256, s), m = 0;
    CHECK_TRUE(anneal_bpe_str_to_bytes(s, n, back, &m) && m == 256 && !memcmp(back, all, 256));
    CHECK_TRUE(!anneal_bpe_str_to_bytes("a b", 3, back, &m)); /* ' ' is not in the table */
}

/* Encodes a reference text and compares with the reference ids (u16 LE). */
static void check_reference(const char *name) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    char p[4200];
    size_t n, m;
    snprintf(p, sizeof p, "%s", anneal_test_path("../shared/data/tokenizer/"));
    char tp[4300], rp[4300];
    snprintf(tp, sizeof tp, "%s%s.txt", p, name);
    snprintf(rp, sizeof rp, "%s%s.gpt2.u16", p, name);
    char *text = read_all(tp, &n), *ref = read_all(rp, &m);
    if (!text || !ref) {
        free(text);
        free(ref);
        anneal_tokenizer_free(t);
        SKIP_NO_SHARED(tp);
    }
    anneal_ids ids = {0};
    REQUIRE(anneal_tokenizer_encode(t, text, n, false, &ids) == ANNEAL_OK);
    CHECK(ids.n == m / 2, "%s: %zu ids, reference has %zu", name, ids.n, m / 2);
    size_t bad = 0;
    for (size_t i = 0; i < ids.n && i < m / 2; i++) {
        int32_t r = (int32_t)((unsigned char)ref[2 * i] | (unsigned char)ref[2 * i + 1] << 8);
        if (ids.ids[i] != r && bad++ < 5) CHECK(false, "%s: id %zu is %d, reference %d", name, i, ids.ids[i], r);
    }
    CHECK(bad == 0, "%s: %zu ids differ", name, bad);
    /* and back */
    char *dec;
    size_t dn;
    REQUIRE(anneal_tokenizer_decode(t, ids.ids, ids.n, &dec, &dn) == ANNEAL_OK);
    CHECK_TRUE(dn == n && !memcmp(dec, text, n));
    free(dec);
    anneal_ids_free(&ids);
    free(text);
    free(ref);
    anneal_tokenizer_free(t);
}

TEST(reference_sample) { check_reference("sample"); }
TEST(reference_kjv_head) { check_reference("kjv_head"); }

/* Ids from the reference (gpt-3-encoder's algorithm run in Node 20: JS regex with the u
 * flag) for characters where PCRE2's \s differs from JS's (U+0085, U+180E, U+FEFF) and
 * other whitespace, marks and number forms. */
static const struct { const char *text; int32_t ids[16]; } js_cases[] = {
    {"\x61\x20\xc2\x85\x62", {64, 1587, 227, 65}},
    {"\x61\x20\xef\xbb\xbf\x62", {64, 220, 171, 119, 123, 65}},
    {"\xef\xbb\xbf\x48\x65\x6c\x6c\x6f\x20\x77\x6f\x72\x6c\x64", {171, 119, 123, 15496, 995}},
    {"\x78\x20\xe1\xa0\x8e\x20\x79", {87, 28053, 254, 236, 331}},
    {"\x61\xc2\xa0\x20\x62\x20\xc2\xa0", {64, 1849, 275, 5624}},
    {"\x77\x6f\x72\x64\xe3\x80\x80\xe3\x80\x80\x77\x6f\x72\x64", {4775, 5099, 222, 5099, 222, 4775}},
    {"\x31\xe2\x80\xa8\xe2\x80\xa9\x20\x32", {16, 447, 101, 447, 102, 362}},
    {"\x74\x61\x62\x09\x20\x09\x65\x6e\x64\x20\xe2\x81\x9f\xe2\x80\xaf", {8658, 197, 220, 197, 437, 2343, 223, 253, 447, 107}},
    {"\x3c\x7c\x65\x6e\x64\x6f\x66\x74\x65\x78\x74\x7c\x3e", {27, 91, 437, 1659, 5239, 91, 29}},
    {"\x48\x65\x6c\x6c\x6f\x3c\x7c\x65\x6e\x64\x6f\x66\x74\x65\x78\x74\x7c\x3e\x20\x57\x6f\x72\x6c\x64",
     {15496, 27, 91, 437, 1659, 5239, 91, 29, 2159}},
    {"\x27\x73\x20\x27\x53\x20\x27\x27\x27\x20\x27\x6c\x6c\x27\x56\x45", {338, 705, 50, 705, 7061, 705, 297, 6, 6089}},
    {"\x0d\x0a\x0d\x0a\x20\x20\x0a\x20\x78", {201, 198, 201, 198, 220, 220, 198, 2124}},
    {"\xc7\x85\x20\xe2\x85\xab\x20\xc2\xb2\x20\xc2\xbd\x20\xd9\xa3",
     {131, 227, 2343, 227, 104, 1587, 110, 25208, 18923, 96}},
    {"\x1c\x1f\x20\xe2\x80\x8b\x20\x78", {216, 219, 20126, 2124}},
};

TEST(js_whitespace_and_classes) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    for (size_t c = 0; c < sizeof js_cases / sizeof *js_cases; c++) {
        anneal_ids ids = {0};
        REQUIRE(anneal_tokenizer_encode(t, js_cases[c].text, strlen(js_cases[c].text), false, &ids) == ANNEAL_OK);
        size_t want = 0;
        while (want < 16 && js_cases[c].ids[want]) want++;
        bool same = ids.n == want;
        for (size_t i = 0; same && i < want; i++) same = ids.ids[i] == js_cases[c].ids[i];
        CHECK(same, "case %zu: %zu ids (first %d), reference %zu (first %d)", c, ids.n, ids.n ? ids.ids[0] : -1,
              want, js_cases[c].ids[0]);
        anneal_ids_free(&ids);
    }
    anneal_tokenizer_free(t);
}

typedef struct { size_t starts[64]; size_t n; } pieces;
static bool collect(const char *p, size_t n, void *u) {
    pieces *ps = u;
    if (ps->n < 64) ps->starts[ps->n] = n;
    ps->n++;
    return true;
}

TEST(pretokenize_js_space) {
    /* "a \u0085b": U+0085 is no JS space, so " \u0085" is one symbol piece (PCRE2's \s
     * would give " ", "\u0085"); "a \uFEFFb": U+FEFF is a JS space: " ", "\uFEFF" */
    anneal_pretokenizer *p = anneal_pretokenizer_new();
    REQUIRE(p != NULL);
    pieces ps = {{0}, 0};
    REQUIRE(anneal_pretokenize(p, "a \xc2\x85" "b", 5, collect, &ps) == ANNEAL_OK);
    CHECK(ps.n == 3 && ps.starts[1] == 3, "U+0085: %zu pieces", ps.n);
    ps.n = 0;
    REQUIRE(anneal_pretokenize(p, "a \xef\xbb\xbf" "b", 6, collect, &ps) == ANNEAL_OK);
    CHECK(ps.n == 4 && ps.starts[1] == 1 && ps.starts[2] == 3, "U+FEFF: %zu pieces", ps.n);
    ps.n = 0;
    REQUIRE(anneal_pretokenize(p, "x \xe1\xa0\x8e y", 7, collect, &ps) == ANNEAL_OK);
    CHECK(ps.n == 3 && ps.starts[1] == 4, "U+180E: %zu pieces", ps.n);
    anneal_pretokenizer_free(p);
}

TEST(merge_loop_matches_naive_bpe) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    naive_bpe nb;
    REQUIRE(naive_load(&nb));
    static const char alpha[] = "abcdefghijklmnopqrstuvwxyzeeeeaaaiioonnttss";
    static const char punct[] = "!#$%&()*+,-./:;<=>?@[]^_`{|}~\"";
    char buf[700];
    int32_t want[700];
    int mismatches = 0;
    for (int c = 0; c < 400; c++) {
        /* one piece each: " " + letters (lengths up to 600: the heap path), digits or
         * punctuation */
        size_t n = 0, len = c < 390 ? 1 + rnd() % 40 : 200 + rnd() % 400;
        int kind = (int)(rnd() % 3);
        if (rnd() % 2) buf[n++] = ' ';
        for (size_t i = 0; i < len; i++)
            buf[n++] = kind == 0 ? alpha[rnd() % (sizeof alpha - 1)]
                       : kind == 1 ? (char)('0' + rnd() % 10) : punct[rnd() % (sizeof punct - 1)];
        if (c == 398) { n = 0; for (size_t i = 0; i < 640; i++) buf[n++] = 'a'; }
        if (c == 399) { n = 0; buf[n++] = ' '; for (size_t i = 0; i < 600; i++) buf[n++] = "ab"[i % 2]; }
        anneal_ids ids = {0};
        REQUIRE(anneal_tokenizer_encode(t, buf, n, false, &ids) == ANNEAL_OK);
        size_t k = naive_encode_piece(&nb, buf, n, want);
        bool same = ids.n == k;
        for (size_t i = 0; same && i < k; i++) same = ids.ids[i] == want[i];
        if (!same && mismatches++ < 5)
            CHECK(false, "case %d (%zu bytes \"%.30s\"): %zu ids vs naive %zu", c, n, buf, ids.n, k);
        anneal_ids_free(&ids);
    }
    CHECK(mismatches == 0, "%d pieces differ from encoder.py's algorithm", mismatches);
    naive_free(&nb);
    anneal_tokenizer_free(t);
}

TEST(special_tokens_only_when_allowed) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    CHECK(anneal_tokenizer_eot(t) == 50256, "eot %d", anneal_tokenizer_eot(t));
    CHECK(anneal_tokenizer_vocab_size(t) == 50257, "vocab %d", anneal_tokenizer_vocab_size(t));
    const char *s = "Hello<|endoftext|> World<|endoftext|><|endoftext|>";
    anneal_ids a = {0}, b = {0};
    REQUIRE(anneal_tokenizer_encode(t, s, strlen(s), true, &a) == ANNEAL_OK);
    int32_t want[] = {15496, 50256, 2159, 50256, 50256};
    CHECK(a.n == 5, "%zu ids", a.n);
    for (size_t i = 0; i < a.n && i < 5; i++) CHECK(a.ids[i] == want[i], "id %zu: %d want %d", i, a.ids[i], want[i]);
    REQUIRE(anneal_tokenizer_encode(t, s, strlen(s), false, &b) == ANNEAL_OK);
    for (size_t i = 0; i < b.n; i++) CHECK(b.ids[i] != 50256, "special id at %zu without allow_special", i);
    CHECK(b.n > 10, "%zu ids", b.n);
    char *d;
    size_t dn;
    REQUIRE(anneal_tokenizer_decode(t, a.ids, a.n, &d, &dn) == ANNEAL_OK);
    CHECK_TRUE(dn == strlen(s) && !memcmp(d, s, dn));
    free(d);
    REQUIRE(anneal_tokenizer_decode(t, b.ids, b.n, &d, &dn) == ANNEAL_OK);
    CHECK_TRUE(dn == strlen(s) && !memcmp(d, s, dn));
    free(d);
    anneal_ids_free(&a);
    anneal_ids_free(&b);
    anneal_tokenizer_free(t);
}

/* Feeds ids through the streaming decoder: chunks must concatenate to want, and when
 * want is valid UTF-8 every chunk must be too. */
static void check_stream(const anneal_tokenizer *t, const int32_t *ids, size_t n, const char *want, size_t wn) {
    anneal_stream_decoder d;
    anneal_stream_decoder_init(&d, t);
    bool valid = utf8_ok((const unsigned char *)want, wn);
    char *acc = malloc(wn + 64), chunk[4096];
    size_t an = 0;
    int bad_chunks = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k;
        REQUIRE(anneal_stream_decoder_push(&d, ids[i], chunk, sizeof chunk, &k) == ANNEAL_OK);
        if (valid && !utf8_ok((unsigned char *)chunk, k)) bad_chunks++;
        if (an + k <= wn) memcpy(acc + an, chunk, k);
        an += k;
    }
    size_t k = anneal_stream_decoder_flush(&d, chunk, sizeof chunk);
    if (valid) CHECK(k == 0, "%zu bytes pending at the end of valid text", k);
    if (an + k <= wn) memcpy(acc + an, chunk, k);
    an += k;
    CHECK(bad_chunks == 0, "%d chunks split a UTF-8 character", bad_chunks);
    CHECK(an == wn && !memcmp(acc, want, wn), "stream gave %zu bytes, want %zu", an, wn);
    free(acc);
}

TEST(round_trip_random_bytes) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    static const char *frag[] = {"\xc3\xa9", "\xe4\xb8\xad", "\xf0\x9f\x98\x80", "\xe2\x80\x8d", "\xc3", "\xe4\xb8",
                                 "\xf0\x9f\x98", "\x80", "\xff", "\xed\xa0\x80", "\xc0\xaf", " ", "  ", "\n", "\t",
                                 "'s", "<|endoftext|>", "word", "123"};
    char buf[600];
    for (int c = 0; c < 300; c++) {
        size_t n = 0, len = rnd() % 120;
        for (size_t i = 0; i < len && n < 560; i++) {
            if (rnd() % 3 == 0) {
                buf[n++] = (char)(rnd() % 256); /* any byte, NUL included */
            } else {
                const char *f = frag[rnd() % (sizeof frag / sizeof *frag)];
                size_t fl = strlen(f);
                memcpy(buf + n, f, fl);
                n += fl;
            }
        }
        for (int allow = 0; allow < 2; allow++) {
            anneal_ids ids = {0};
            REQUIRE(anneal_tokenizer_encode(t, buf, n, allow, &ids) == ANNEAL_OK);
            char *d;
            size_t dn;
            REQUIRE(anneal_tokenizer_decode(t, ids.ids, ids.n, &d, &dn) == ANNEAL_OK);
            CHECK(dn == n && !memcmp(d, buf, n), "case %d: decode(encode(x)) != x (%zu vs %zu bytes)", c, dn, n);
            check_stream(t, ids.ids, ids.n, buf, n);
            free(d);
            anneal_ids_free(&ids);
        }
    }
    anneal_tokenizer_free(t);
}

TEST(stream_decoder_sample) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    size_t n;
    char *text = read_all(anneal_test_path("../shared/data/tokenizer/sample.txt"), &n);
    if (!text) { anneal_tokenizer_free(t); SKIP_NO_SHARED("../shared/data/tokenizer/sample.txt"); }
    anneal_ids ids = {0};
    REQUIRE(anneal_tokenizer_encode(t, text, n, false, &ids) == ANNEAL_OK);
    /* the emoji are split across tokens: a per-token decode would show broken bytes */
    int split = 0;
    for (size_t i = 0; i < ids.n; i++) {
        size_t l;
        const char *b = anneal_tokenizer_token_bytes(t, ids.ids[i], &l);
        split += !utf8_ok((const unsigned char *)b, l);
    }
    CHECK(split > 0, "sample.txt should have tokens that split a character");
    check_stream(t, ids.ids, ids.n, text, n);
    /* a held incomplete character comes out on flush */
    anneal_stream_decoder d;
    anneal_stream_decoder_init(&d, t);
    int32_t lead = -1;
    for (int32_t id = 0; id < anneal_tokenizer_vocab_size(t) && lead < 0; id++) {
        size_t l;
        const char *b = anneal_tokenizer_token_bytes(t, id, &l);
        if (l == 1 && (unsigned char)b[0] == 0xF0) lead = id;
    }
    char out[128];
    size_t k = 99;
    REQUIRE(anneal_stream_decoder_push(&d, lead, out, sizeof out, &k) == ANNEAL_OK);
    CHECK(k == 0, "a lone lead byte was emitted (%zu)", k);
    CHECK_TRUE(anneal_stream_decoder_flush(&d, out, sizeof out) == 1 && (unsigned char)out[0] == 0xF0);
    CHECK(anneal_stream_decoder_push(&d, 1 << 30, out, sizeof out, &k) == ANNEAL_ERR_ARG, "bad id accepted");
    CHECK(strstr(anneal_last_error(), "1073741824") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    anneal_ids_free(&ids);
    free(text);
    anneal_tokenizer_free(t);
}

TEST(round_trip_kjv) {
    FILE *f = popen("bible gen1:1-rev22:21 2>/dev/null", "r");
    if (!f) SKIP_PROMISED("cannot run `bible` (bootstrap installs bible-kjv)");
    size_t cap = 1 << 20, n = 0;
    char *text = malloc(cap);
    size_t got;
    while ((got = fread(text + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) text = realloc(text, cap *= 2);
    }
    pclose(f);
    if (n < 1000000) {
        free(text);
        SKIP_PROMISED("`bible` printed no KJV (bootstrap installs bible-kjv)");
    }
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) { free(text); return; }
    anneal_ids ids = {0};
    REQUIRE(anneal_tokenizer_encode(t, text, n, false, &ids) == ANNEAL_OK);
    CHECK(ids.n > 900000 && ids.n < 1300000, "%zu ids for %zu bytes", ids.n, n);
    char *d;
    size_t dn;
    REQUIRE(anneal_tokenizer_decode(t, ids.ids, ids.n, &d, &dn) == ANNEAL_OK);
    CHECK(dn == n && !memcmp(d, text, n), "KJV round trip: %zu vs %zu bytes", dn, n);
    check_stream(t, ids.ids, ids.n, text, n);
    free(d);
    anneal_ids_free(&ids);
    anneal_tokenizer_free(t);
    free(text);
}

TEST(decode_out_of_range) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    int32_t ids[] = {15496, 50257, 2};
    char *d = (char *)1;
    size_t dn = 7;
    CHECK(anneal_tokenizer_decode(t, ids, 3, &d, &dn) == ANNEAL_ERR_ARG, "out of range id accepted");
    CHECK_TRUE(d == NULL && dn == 0);
    CHECK(strstr(anneal_last_error(), "50257") && strstr(anneal_last_error(), "position 1"), "message: %s",
          anneal_last_error());
    anneal_clear_error();
    ids[1] = -3;
    CHECK_TRUE(anneal_tokenizer_decode(t, ids, 3, &d, &dn) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "-3") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_tokenizer_token_bytes(t, 50257, &dn) == NULL);
    anneal_tokenizer_free(t);
}

/* Writes a tiny tokenizer.json: the 256 bytes (ids 0..255 in byte order), merges
 * a+b, ab+c, b+c, " "+a, then <|endoftext|>; merges_as_pairs picks the layout. */
static bool write_tiny_hf(const char *path, bool merges_as_pairs, const char *pre_tokenizer, const char *extra) {
    anneal_strbuf b = {0};
    unsigned cp[256];
    byte_table(cp);
    anneal_strbuf_puts(&b, "{\"version\": \"1.0\", \"added_tokens\": [{\"id\": 262, \"content\": \"<|endoftext|>\", "
                           "\"special\": true}], \"normalizer\": null, \"pre_tokenizer\": ");
    anneal_strbuf_puts(&b, pre_tokenizer);
    anneal_strbuf_puts(&b, ", \"model\": {\"type\": \"BPE\", \"dropout\": null, \"continuing_subword_prefix\": \"\", ");
    anneal_strbuf_puts(&b, extra);
    anneal_strbuf_puts(&b, "\"vocab\": {");
    for (int i = 0; i < 256; i++) {
        char u[8];
        int k = cp[i] < 0x80 ? snprintf(u, sizeof u, "%c", (char)cp[i])
                             : snprintf(u, sizeof u, "%c%c", (char)(0xC0 | cp[i] >> 6), (char)(0x80 | (cp[i] & 0x3F)));
        if (i) anneal_strbuf_puts(&b, ", ");
        anneal_strbuf_json_string(&b, u, (size_t)k);
        anneal_strbuf_printf(&b, ": %d", i);
    }
    anneal_strbuf_puts(&b, ", \"ab\": 256, \"abc\": 257, \"bc\": 258, \"\\u0120a\": 259, \"\\u0120ab\": 260, "
                           "\"cc\": 261, \"<|endoftext|>\": 262}, \"merges\": ");
    anneal_strbuf_puts(&b, merges_as_pairs
                               ? "[[\"a\", \"b\"], [\"ab\", \"c\"], [\"b\", \"c\"], [\"\\u0120\", \"a\"], [\"\\u0120a\", \"b\"], [\"c\", \"c\"]]}}"
                               : "[\"a b\", \"ab c\", \"b c\", \"\\u0120 a\", \"\\u0120a b\", \"c c\"]}}");
    bool ok = write_all(path, b.data, b.len);
    anneal_strbuf_free(&b);
    return ok;
}

static void tmp_path(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "/tmp/anneal_test_tok_%d_%s", (int)getpid(), name);
}

static void encode_str(const anneal_tokenizer *t, const char *s, bool allow, anneal_ids *ids) {
    ids->n = 0;
    if (anneal_tokenizer_encode(t, s, strlen(s), allow, ids) != ANNEAL_OK) ids->n = 0;
}

TEST(hf_tiny_both_layouts) {
    char p1[256], p2[256], p3[256];
    tmp_path(p1, sizeof p1, "strings.json");
    tmp_path(p2, sizeof p2, "pairs.json");
    tmp_path(p3, sizeof p3, "seq.json");
    const char *bl = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": true}";
    const char *seq = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"ByteLevel\", \"add_prefix_space\": false}]}";
    REQUIRE(write_tiny_hf(p1, false, bl, ""));
    REQUIRE(write_tiny_hf(p2, true, bl, ""));
    REQUIRE(write_tiny_hf(p3, true, seq, ""));
    anneal_tokenizer *a = NULL, *b = NULL, *c = NULL;
    REQUIRE(anneal_tokenizer_load_hf(p1, &a) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_load_hf(p2, &b) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_load(p3, &c) == ANNEAL_OK);
    CHECK_TRUE(anneal_tokenizer_vocab_size(a) == 263 && anneal_tokenizer_eot(a) == 262);
    CHECK_TRUE(anneal_tokenizer_fingerprint(a) == anneal_tokenizer_fingerprint(b));
    CHECK_TRUE(anneal_tokenizer_fingerprint(a) == anneal_tokenizer_fingerprint(c));
    /* hand-derived: "abc" -> a+b (rank 0) then ab+c -> abc; "bcc": b+c (rank 2) before
     * c+c (rank 5) -> bc, c; " abab": a+b (rank 0) twice before " "+a (rank 3), and
     * " "+ab is no merge -> " ", ab, ab; " ac" -> " a", c */
    static const struct { const char *s; bool allow; int32_t ids[6]; size_t n; } cases[] = {
        {"abc", false, {257}, 1},
        {"bcc", false, {258, 'c'}, 2},
        {" abab", false, {' ', 256, 256}, 3},
        {" ac", false, {259, 'c'}, 2},
        {"abc<|endoftext|>cc", true, {257, 262, 261}, 3},
        {"x<|endoftext|>", false, {'x', '<', '|', 'e', 'n', 'd'}, 14},
    };
    anneal_tokenizer *toks[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        anneal_ids ids = {0};
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            encode_str(toks[k], cases[i].s, cases[i].allow, &ids);
            bool same = ids.n == cases[i].n;
            for (size_t j = 0; same && j < cases[i].n && j < 6; j++) same = ids.ids[j] == cases[i].ids[j];
            CHECK(same, "tokenizer %d, \"%s\": %zu ids (first %d)", k, cases[i].s, ids.n, ids.n ? ids.ids[0] : -1);
        }
        anneal_ids_free(&ids);
    }
    anneal_tokenizer_free(a);
    anneal_tokenizer_free(b);
    anneal_tokenizer_free(c);
    /* options: add_prefix_space puts " " before text; ignore_merges takes whole tokens */
    const char *blp = "{\"type\": \"ByteLevel\", \"add_prefix_space\": true}";
    REQUIRE(write_tiny_hf(p1, false, blp, "\"ignore_merges\": true, "));
    REQUIRE(anneal_tokenizer_load_hf(p1, &a) == ANNEAL_OK);
    anneal_ids ids = {0};
    encode_str(a, "ab", false, &ids);
    CHECK(ids.n == 1 && ids.ids[0] == 260, "add_prefix_space: %zu ids (first %d)", ids.n, ids.n ? ids.ids[0] : -1);
    anneal_ids_free(&ids);
    anneal_tokenizer_free(a);
    unlink(p1);
    unlink(p2);
    unlink(p3);
}

/* Builds a tokenizer.json from GPT-2's encoder.json + vocab.bpe (with cJSON, here) in
 * the layout Hugging Face writes for gpt2. */
static bool build_gpt2_tokenizer_json(const char *out, bool pairs) {
    char p[4200];
    size_t n;
    snprintf(p, sizeof p, "%s/encoder.json", gpt2_dir());
    char *ej = read_all(p, &n);
    snprintf(p, sizeof p, "%s/vocab.bpe", gpt2_dir());
    char *vb = read_all(p, &n);
    if (!ej || !vb) { free(ej); free(vb); return false; }
    cJSON *vocab = cJSON_Parse(ej);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "version", "1.0");
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    cJSON *eot = cJSON_CreateObject();
    cJSON_AddNumberToObject(eot, "id", 50256);
    cJSON_AddStringToObject(eot, "content", "<|endoftext|>");
    cJSON_AddBoolToObject(eot, "special", true);
    cJSON_AddItemToArray(added, eot);
    cJSON_AddNullToObject(root, "normalizer");
    cJSON *pre = cJSON_AddObjectToObject(root, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "ByteLevel");
    cJSON_AddBoolToObject(pre, "add_prefix_space", false);
    cJSON_AddBoolToObject(pre, "trim_offsets", true);
    cJSON_AddBoolToObject(pre, "use_regex", true);
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddStringToObject(model, "continuing_subword_prefix", "");
    cJSON_AddStringToObject(model, "end_of_word_suffix", "");
    cJSON_AddBoolToObject(model, "byte_fallback", false);
    cJSON_AddItemToObject(model, "vocab", vocab);
    cJSON *merges = cJSON_AddArrayToObject(model, "merges");
    char *save = NULL;
    int line = 0;
    for (char *l = strtok_r(vb, "\n", &save); l; l = strtok_r(NULL, "\n", &save), line++) {
        if (line == 0) continue;
        if (pairs) {
            char *sp = strchr(l, ' ');
            *sp = 0;
            const char *two[2] = {l, sp + 1};
            cJSON_AddItemToArray(merges, cJSON_CreateStringArray(two, 2));
        } else {
            cJSON_AddItemToArray(merges, cJSON_CreateString(l));
        }
    }
    char *txt = cJSON_PrintUnformatted(root);
    bool ok = txt && write_all(out, txt, strlen(txt));
    free(txt);
    cJSON_Delete(root);
    free(ej);
    free(vb);
    return ok;
}

TEST(hf_json_from_gpt2_files_encodes_identically) {
    anneal_tokenizer *g = load_gpt2_shared();
    if (!g) return;
    size_t n;
    char *text = read_all(anneal_test_path("../shared/data/tokenizer/sample.txt"), &n);
    if (!text) { anneal_tokenizer_free(g); SKIP_NO_SHARED("../shared/data/tokenizer/sample.txt"); }
    anneal_ids want = {0};
    REQUIRE(anneal_tokenizer_encode(g, text, n, false, &want) == ANNEAL_OK);
    for (int pairs = 0; pairs < 2; pairs++) {
        char p[256];
        tmp_path(p, sizeof p, "gpt2_tokenizer.json");
        REQUIRE(build_gpt2_tokenizer_json(p, pairs));
        anneal_tokenizer *h = NULL;
        REQUIRE(anneal_tokenizer_load_hf(p, &h) == ANNEAL_OK);
        CHECK_TRUE(anneal_tokenizer_vocab_size(h) == 50257 && anneal_tokenizer_eot(h) == 50256);
        /* tokenizers runs ByteLevel's regex with Oniguruma's \s (U+0085 is a space, U+FEFF is
         * not; gpt-3-encoder the other way round): the same ids on this text, yet not one
         * tokenizer, so the fingerprints differ */
        CHECK(anneal_tokenizer_fingerprint(h) != anneal_tokenizer_fingerprint(g), "fingerprints equal (pairs %d)", pairs);
        anneal_ids got = {0};
        REQUIRE(anneal_tokenizer_encode(h, text, n, false, &got) == ANNEAL_OK);
        CHECK_TRUE(got.n == want.n && !memcmp(got.ids, want.ids, want.n * sizeof *want.ids));
        anneal_ids_free(&got);
        anneal_tokenizer_free(h);
        unlink(p);
    }
    anneal_ids_free(&want);
    free(text);
    anneal_tokenizer_free(g);
}

TEST(write_files_reload) {
    anneal_tokenizer *g = load_gpt2_shared();
    if (!g) return;
    char dir[256];
    tmp_path(dir, sizeof dir, "written");
    anneal_bpe_tables tb;
    REQUIRE(anneal_tokenizer_tables(g, &tb) == ANNEAL_OK);
    REQUIRE(anneal_bpe_write_files(dir, &tb) == ANNEAL_OK);
    anneal_bpe_tables_release(&tb);
    char p[512], q[512];
    snprintf(p, sizeof p, "%s/encoder.json", dir);
    snprintf(q, sizeof q, "%s/vocab.bpe", dir);
    anneal_tokenizer *a = NULL, *b = NULL, *c = NULL;
    REQUIRE(anneal_tokenizer_load_gpt2(p, q, &a) == ANNEAL_OK);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    REQUIRE(anneal_tokenizer_load_hf(p, &b) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_load(dir, &c) == ANNEAL_OK);
    uint64_t fp = anneal_tokenizer_fingerprint(g);
    CHECK_TRUE(anneal_tokenizer_fingerprint(a) == fp && anneal_tokenizer_fingerprint(b) == fp &&
               anneal_tokenizer_fingerprint(c) == fp);
    CHECK_TRUE(anneal_tokenizer_eot(b) == 50256);
    /* the vocab.bpe written is GPT-2's byte for byte */
    size_t n1, n2;
    char *orig, *mine;
    snprintf(q, sizeof q, "%s/vocab.bpe", gpt2_dir());
    orig = read_all(q, &n1);
    snprintf(q, sizeof q, "%s/vocab.bpe", dir);
    mine = read_all(q, &n2);
    CHECK_TRUE(orig && mine && n1 == n2 && !memcmp(orig, mine, n1));
    free(orig);
    free(mine);
    anneal_tokenizer_free(a);
    anneal_tokenizer_free(b);
    anneal_tokenizer_free(c);
    anneal_tokenizer_free(g);
    const char *names[] = {"encoder.json", "vocab.bpe", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
}

TEST(fingerprint_definition) {
    anneal_tokenizer *g = load_gpt2_shared();
    if (!g) return;
    /* FNV-1a 64 over (u32 LE length + bytes) per id, then (u32 LE left, right) per merge */
    uint64_t h = 0xCBF29CE484222325ull;
#define FNV_BYTE(x) (h = (h ^ (unsigned char)(x)) * 0x100000001B3ull)
    for (int32_t i = 0; i < anneal_tokenizer_vocab_size(g); i++) {
        size_t l;
        const char *b = anneal_tokenizer_token_bytes(g, i, &l);
        for (int k = 0; k < 4; k++) FNV_BYTE(l >> (8 * k));
        for (size_t k = 0; k < l; k++) FNV_BYTE(b[k]);
    }
    anneal_bpe_tables tb;
    REQUIRE(anneal_tokenizer_tables(g, &tb) == ANNEAL_OK);
    CHECK(tb.n_merges == 50000, "%d merges", tb.n_merges);
    for (int32_t r = 0; r < tb.n_merges; r++)
        for (int s = 0; s < 2; s++)
            for (int k = 0; k < 4; k++) FNV_BYTE((uint32_t)tb.merges[r][s] >> (8 * k));
#undef FNV_BYTE
    anneal_bpe_tables_release(&tb);
    CHECK(h == anneal_tokenizer_fingerprint(g), "fingerprint %016llx, recomputed %016llx",
          (unsigned long long)anneal_tokenizer_fingerprint(g), (unsigned long long)h);
    anneal_tokenizer_free(g);
}

TEST(encode_from_threads) {
    anneal_tokenizer *t = load_gpt2_shared();
    if (!t) return;
    size_t n;
    char *text = read_all(anneal_test_path("../shared/data/tokenizer/kjv_head.txt"), &n);
    if (!text) { anneal_tokenizer_free(t); SKIP_NO_SHARED("../shared/data/tokenizer/kjv_head.txt"); }
    enum { CHUNKS = 32 };
    anneal_ids par[CHUNKS], ser[CHUNKS];
    memset(par, 0, sizeof par);
    memset(ser, 0, sizeof ser);
    size_t step = n / CHUNKS;
    int fails = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(4) reduction(+ : fails)
    for (int c = 0; c < CHUNKS; c++) {
        size_t a = (size_t)c * step, b = c == CHUNKS - 1 ? n : a + step;
        fails += anneal_tokenizer_encode(t, text + a, b - a, c % 2, &par[c]) != ANNEAL_OK;
    }
    CHECK(fails == 0, "%d parallel encodes failed", fails);
    anneal_tokenizer *fresh = load_gpt2_shared();
    for (int c = 0; c < CHUNKS; c++) {
        size_t a = (size_t)c * step, b = c == CHUNKS - 1 ? n : a + step;
        REQUIRE(anneal_tokenizer_encode(fresh, text + a, b - a, c % 2, &ser[c]) == ANNEAL_OK);
        CHECK(par[c].n == ser[c].n && !memcmp(par[c].ids, ser[c].ids, ser[c].n * 4), "chunk %d differs", c);
        anneal_ids_free(&par[c]);
        anneal_ids_free(&ser[c]);
    }
    anneal_tokenizer_free(fresh);
    anneal_tokenizer_free(t);
    free(text);
}

TEST(resolve_gpt2_spec) {
    char e[4200];
    snprintf(e, sizeof e, "%s/encoder.json", gpt2_dir());
    REQUIRE(access(e, R_OK) == 0);
    setenv("ANNEAL_GPT2_DIR", gpt2_dir(), 1);
    anneal_tokenizer *t = NULL;
    CHECK(anneal_tokenizer_load("gpt2", &t) == ANNEAL_OK, "%s", anneal_last_error());
    CHECK_TRUE(t && anneal_tokenizer_vocab_size(t) == 50257);
    anneal_tokenizer_free(t);
    t = NULL;
    CHECK(anneal_tokenizer_load(gpt2_dir(), &t) == ANNEAL_OK, "%s", anneal_last_error());
    anneal_tokenizer_free(t);
    unsetenv("ANNEAL_GPT2_DIR");
    /* ../shared's copy (what the reference ids were made with) is the same tokenizer */
    char se[4200], sv[4200];
    snprintf(se, sizeof se, "%s", anneal_test_path("../shared/data/gpt2/encoder.json"));
    snprintf(sv, sizeof sv, "%s", anneal_test_path("../shared/data/gpt2/vocab.bpe"));
    anneal_tokenizer *r = NULL, *s = load_gpt2_shared();
    if (!s) return;
    if (access(se, R_OK) != 0) {
        anneal_tokenizer_free(s);
        SKIP_NO_SHARED(se);
    }
    REQUIRE(anneal_tokenizer_load_gpt2(se, sv, &r) == ANNEAL_OK);
    CHECK_TRUE(anneal_tokenizer_fingerprint(r) == anneal_tokenizer_fingerprint(s));
    anneal_tokenizer_free(r);
    anneal_tokenizer_free(s);
}

int main(void) {
    RUN(byte_table_matches_gpt2);
    RUN(reference_sample);
    RUN(reference_kjv_head);
    RUN(js_whitespace_and_classes);
    RUN(pretokenize_js_space);
    RUN(merge_loop_matches_naive_bpe);
    RUN(special_tokens_only_when_allowed);
    RUN(round_trip_random_bytes);
    RUN(stream_decoder_sample);
    RUN(round_trip_kjv);
    RUN(decode_out_of_range);
    RUN(hf_tiny_both_layouts);
    RUN(hf_json_from_gpt2_files_encodes_identically);
    RUN(write_files_reload);
    RUN(fingerprint_definition);
    RUN(encode_from_threads);
    RUN(resolve_gpt2_spec);
    return anneal_test_summary();
}
