/* BPE trainer: the merges of a hand-worked example (tie-break included), agreement with
 * a naive recount-everything trainer on random corpora, piece counting that does not
 * depend on block size or threads, byte-identical output across runs and thread
 * counts, the files loading back (GPT-2 and Hugging Face layouts) with
 * decode(encode(x)) == x, errors, and the KJV corpus. */
#include "test.h"

#include "anneal/anneal.h"
#include "data/bpe_train.h"
#include "data/pretokenize.h"

#include <cjson/cJSON.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------ helpers */

static char g_dir[256];

/* A fresh temporary directory for this test run (created once). */
static const char *tmp_dir(void) {
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof g_dir, "/tmp/anneal_bpe_train_XXXXXX");
        if (!mkdtemp(g_dir)) g_dir[0] = 0;
    }
    return g_dir;
}

/* tmp_dir()/name (rotating static buffers). */
static const char *tmp_path(const char *name) {
    static char buf[8][512];
    static int k;
    char *b = buf[k++ & 7];
    snprintf(b, 512, "%s/%s", tmp_dir(), name);
    return b;
}

static bool write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* Whole file, malloc'd and NUL-terminated; NULL if unreadable. */
static char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *d = malloc((size_t)sz + 1);
    if (d && fread(d, 1, (size_t)sz, f) != (size_t)sz) {
        free(d);
        d = NULL;
    }
    fclose(f);
    if (d) {
        d[sz] = 0;
        if (n) *n = (size_t)sz;
    }
    return d;
}

static bool same_file(const char *a, const char *b) {
    size_t na, nb;
    char *x = read_file(a, &na), *y = read_file(b, &nb);
    bool same = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

static uint64_t rng_state;
static uint32_t rnd(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The merges of model m as "left right" byte strings (raw bytes) into out[r]. */
static void merge_str(const anneal_bpe_model *m, int32_t r, char *out, size_t cap) {
    int32_t a = m->merges[r][0], b = m->merges[r][1];
    snprintf(out, cap, "%.*s %.*s", (int)m->len[a], m->bytes + m->off[a], (int)m->len[b], m->bytes + m->off[b]);
}

/* Trains on text (written to a file) up to max_merges merges; true on success. */
static bool learn_text(const char *text, size_t n, int32_t max_merges, anneal_bpe_model *m) {
    const char *path = tmp_path("learn.txt");
    if (!write_file(path, text, n)) return false;
    anneal_piece_counts pc;
    if (anneal_bpe_count_pieces(&path, 1, 1, 0, &pc) != ANNEAL_OK) return false;
    anneal_status s = anneal_bpe_learn(&pc, max_merges, m, NULL, NULL);
    anneal_piece_counts_free(&pc);
    return s == ANNEAL_OK;
}

/* ------------------------------------------------------- hand example */

/* Words (pieces of >= 2 bytes; "\n" pieces have 1 byte and hold no pair):
 *   low x5, lower x2, newest x6, widest x3.
 * Pair counts: l o 7, o w 7, w e 2+6=8, e r 2, n e 6, e w 6, e s 6+3=9, s t 9, w i 3,
 *   i d 3, d e 3.
 * 1. "e s" (9; ties with "s t" 9, and "e" < "s")  -> newest: n e w es t, widest: w i d es t
 *    now w e 2, w es 6, s t 0, es t 9, d e 0, d es 3
 * 2. "es t" (9)                                    -> n e w est, w i d est
 * 3. "l o" (7; ties with "o w", "l" < "o")         -> lo w, lo w e r
 * 4. "lo w" (7)
 * 5. "e w" (6; ties with "n e" and "w est": "e" < "n" < "w") -> n ew est
 * 6. "ew est" (6; ties with "n ew": "ew" < "n")    -> n ewest
 * 7. "n ewest" (6)
 * 8. "d est" (3; ties with "i d", "w i": "d" < "i" < "w") */
TEST(hand_worked_example) {
    char text[256] = "";
    for (int i = 0; i < 5; i++) strcat(text, "low\n");
    for (int i = 0; i < 2; i++) strcat(text, "lower\n");
    for (int i = 0; i < 6; i++) strcat(text, "newest\n");
    for (int i = 0; i < 3; i++) strcat(text, "widest\n");
    anneal_bpe_model m;
    REQUIRE(learn_text(text, strlen(text), 8, &m));
    static const char *want[] = {"e s", "es t", "l o", "lo w", "e w", "ew est", "n ewest", "d est"};
    CHECK(m.n_merges == 8, "%d merges", (int)m.n_merges);
    for (int32_t r = 0; r < m.n_merges && r < 8; r++) {
        char got[64];
        merge_str(&m, r, got, sizeof got);
        CHECK(!strcmp(got, want[r]), "merge %d: '%s', want '%s'", (int)r, got, want[r]);
        CHECK(m.n_tokens == 256 + m.n_merges, "tokens %d", (int)m.n_tokens);
    }
    anneal_bpe_model_free(&m);

    /* The same through files: vocab.bpe lists the merges in order (byte-level form:
     * these are all printable ASCII, so unchanged) and encoder.json gives id 256 + r. */
    const char *in = tmp_path("hand.txt"), *dir = tmp_path("hand_tok");
    REQUIRE(write_file(in, text, strlen(text)));
    REQUIRE(anneal_bpe_train(&in, 1, 256 + 8 + 1, dir) == ANNEAL_OK);
    char p[600];
    snprintf(p, sizeof p, "%s/vocab.bpe", dir);
    char *bpe = read_file(p, NULL);
    REQUIRE(bpe);
    CHECK(!strcmp(bpe, "#version: 0.2\ne s\nes t\nl o\nlo w\ne w\new est\nn ewest\nd est\n"), "vocab.bpe:\n%s", bpe);
    free(bpe);
    snprintf(p, sizeof p, "%s/encoder.json", dir);
    char *enc = read_file(p, NULL);
    REQUIRE(enc);
    cJSON *j = cJSON_Parse(enc);
    REQUIRE(j);
    CHECK(cJSON_GetArraySize(j) == 265, "%d entries", cJSON_GetArraySize(j));
    cJSON *e;
    CHECK((e = cJSON_GetObjectItemCaseSensitive(j, "es")) && e->valueint == 256, "es");
    CHECK((e = cJSON_GetObjectItemCaseSensitive(j, "newest")) && e->valueint == 262, "newest");
    CHECK((e = cJSON_GetObjectItemCaseSensitive(j, "dest")) && e->valueint == 263, "dest");
    CHECK((e = cJSON_GetObjectItemCaseSensitive(j, "<|endoftext|>")) && e->valueint == 264, "eot");
    CHECK((e = cJSON_GetObjectItemCaseSensitive(j, "!")) && e->valueint == 0, "'!' is id 0 as in GPT-2");
    CHECK((e = cJSON_GetObjectItemCaseSensitive(j, "\xc4\xa0")) && e->valueint == 220, "' ' (U+0120) is 220");
    cJSON_Delete(j);
    free(enc);
    /* tokenizer.json: Hugging Face's layout with the same vocabulary and merges */
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    char *hf = read_file(p, NULL);
    REQUIRE(hf);
    j = cJSON_Parse(hf);
    REQUIRE(j);
    cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    cJSON *pre = cJSON_GetObjectItemCaseSensitive(j, "pre_tokenizer");
    cJSON *added = cJSON_GetObjectItemCaseSensitive(j, "added_tokens");
    REQUIRE(model && pre && cJSON_IsArray(added));
    CHECK(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(model, "type")) &&
          !strcmp(cJSON_GetObjectItemCaseSensitive(model, "type")->valuestring, "BPE"), "model.type");
    /* GPT-2's regex as anneal runs it (a Split), then ByteLevel without a regex of its own */
    cJSON *steps = cJSON_GetObjectItemCaseSensitive(pre, "pretokenizers");
    cJSON *split = cJSON_GetArrayItem(steps, 0), *bl = cJSON_GetArrayItem(steps, 1);
    CHECK(cJSON_GetArraySize(steps) == 2 && split && bl &&
          !strcmp(cJSON_GetObjectItemCaseSensitive(split, "type")->valuestring, "Split") &&
          !strcmp(cJSON_GetObjectItemCaseSensitive(bl, "type")->valuestring, "ByteLevel") &&
          cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(bl, "use_regex")), "pre_tokenizer: Split then ByteLevel");
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(model, "vocab")) == 265, "model.vocab size");
    cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    CHECK(cJSON_GetArraySize(merges) == 8 && cJSON_IsString(cJSON_GetArrayItem(merges, 5)) &&
          !strcmp(cJSON_GetArrayItem(merges, 5)->valuestring, "ew est"), "model.merges");
    cJSON *a0 = cJSON_GetArrayItem(added, 0);
    CHECK(cJSON_GetArraySize(added) == 1 && a0 && cJSON_GetObjectItemCaseSensitive(a0, "id") &&
          cJSON_GetObjectItemCaseSensitive(a0, "id")->valueint == 264 &&
          cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(a0, "special")) &&
          !strcmp(cJSON_GetObjectItemCaseSensitive(a0, "content")->valuestring, "<|endoftext|>"), "added_tokens");
    cJSON_Delete(j);
    free(hf);
}

/* "aaaaa" (one piece): a a 4 -> merge 1 "a a": the word becomes aa aa a (left to right,
 * non-overlapping), pairs (aa, aa) 1 and (aa, a) 1; tie: left tokens equal, right "a" <
 * "aa" -> merge 2 "aa a": aa aaa; merge 3 "aa aaa"; then the word is one token and the
 * merges run out: a vocabulary of 256 + 3 + 1 whatever size was asked. */
TEST(repeated_byte_and_running_out) {
    const char *in = tmp_path("aaaaa.txt"), *dir = tmp_path("aaaaa_tok");
    REQUIRE(write_file(in, "aaaaa", 5));
    anneal_bpe_train_stats st;
    REQUIRE(anneal_bpe_train_ex(&in, 1, 1000, dir, NULL, &st) == ANNEAL_OK);
    CHECK(st.n_merges == 3 && st.vocab_size == 260, "%d merges, vocab %d", (int)st.n_merges, (int)st.vocab_size);
    char p[600];
    snprintf(p, sizeof p, "%s/vocab.bpe", dir);
    char *bpe = read_file(p, NULL);
    REQUIRE(bpe);
    CHECK(!strcmp(bpe, "#version: 0.2\na a\naa a\naa aaa\n"), "vocab.bpe:\n%s", bpe);
    free(bpe);
    anneal_tokenizer *tok = NULL;
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    REQUIRE(anneal_tokenizer_load_hf(p, &tok) == ANNEAL_OK);
    CHECK(anneal_tokenizer_vocab_size(tok) == 260 && anneal_tokenizer_eot(tok) == 259, "vocab %d eot %d",
          (int)anneal_tokenizer_vocab_size(tok), (int)anneal_tokenizer_eot(tok));
    anneal_ids ids = {0};
    REQUIRE(anneal_tokenizer_encode(tok, "aaaaa", 5, false, &ids) == ANNEAL_OK);
    CHECK(ids.n == 1 && ids.ids[0] == 258, "aaaaa -> %zu ids, first %d", ids.n, ids.n ? (int)ids.ids[0] : -1);
    anneal_ids_free(&ids);
    anneal_tokenizer_free(tok);
}

/* ------------------------------------------------ naive reference trainer */

enum { NAIVE_MAX_TOK = 256 + 200, NAIVE_MAX_LEN = 64 };

typedef struct naive {
    char tok[NAIVE_MAX_TOK][NAIVE_MAX_LEN * 2];
    int tok_len[NAIVE_MAX_TOK];
    int n_tok;
    int (*words)[NAIVE_MAX_LEN]; /* every piece occurrence is its own word */
    int *wlen;
    int n_words, cap_words;
    int64_t count[NAIVE_MAX_TOK][NAIVE_MAX_TOK];
} naive;

static bool naive_piece(const char *piece, size_t len, void *user) {
    naive *nv = user;
    if (len < 2) return true;
    if (len > NAIVE_MAX_LEN) len = NAIVE_MAX_LEN; /* test corpora keep pieces short */
    if (nv->n_words == nv->cap_words) {
        nv->cap_words = nv->cap_words ? nv->cap_words * 2 : 256;
        nv->words = realloc(nv->words, (size_t)nv->cap_words * sizeof *nv->words);
        nv->wlen = realloc(nv->wlen, (size_t)nv->cap_words * sizeof *nv->wlen);
    }
    int w = nv->n_words++;
    nv->wlen[w] = (int)len;
    for (size_t i = 0; i < len; i++) {
        /* token id of a byte: its rank among GPT-2's code points */
        int b = (unsigned char)piece[i], id = 0;
        for (int k = 0; k < nv->n_tok && k < 256; k++)
            if (nv->tok_len[k] == 1 && (unsigned char)nv->tok[k][0] == b) id = k;
        nv->words[w][i] = id;
    }
    return true;
}

static int naive_cmp_tok(const naive *nv, int x, int y) {
    int lx = nv->tok_len[x], ly = nv->tok_len[y];
    int c = memcmp(nv->tok[x], nv->tok[y], (size_t)(lx < ly ? lx : ly));
    return c ? c : (lx > ly) - (lx < ly);
}

/* Trains by recounting every pair over every word occurrence at each step, with the
 * documented order (count desc, then left bytes, then right bytes) and skipping pairs
 * whose merged bytes already form a token. Appends merges as token-id pairs. */
static int naive_train(naive *nv, const char *text, size_t n, int max_merges, int (*merges)[2]) {
    /* byte tokens in GPT-2 order: printable ranges first, then the rest ascending */
    nv->n_tok = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int b = 0; b < 256; b++) {
            bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
            if (printable == (pass == 0)) {
                nv->tok[nv->n_tok][0] = (char)b;
                nv->tok_len[nv->n_tok++] = 1;
            }
        }
    anneal_pretokenizer *pt = anneal_pretokenizer_new();
    anneal_pretokenize(pt, text, n, naive_piece, nv);
    anneal_pretokenizer_free(pt);
    int nm = 0;
    while (nm < max_merges) {
        memset(nv->count, 0, sizeof nv->count);
        for (int w = 0; w < nv->n_words; w++)
            for (int i = 0; i + 1 < nv->wlen[w]; i++) nv->count[nv->words[w][i]][nv->words[w][i + 1]]++;
        int ba = -1, bb = -1;
        for (int a = 0; a < nv->n_tok; a++)
            for (int b = 0; b < nv->n_tok; b++) {
                int64_t c = nv->count[a][b];
                if (c == 0) continue;
                /* skip pairs whose bytes already form a token */
                int la = nv->tok_len[a], lb = nv->tok_len[b];
                bool dup = false;
                for (int t = 0; t < nv->n_tok && !dup; t++)
                    dup = nv->tok_len[t] == la + lb && !memcmp(nv->tok[t], nv->tok[a], (size_t)la) &&
                          !memcmp(nv->tok[t] + la, nv->tok[b], (size_t)lb);
                if (dup) continue;
                if (ba < 0) { ba = a; bb = b; continue; }
                int64_t cb = nv->count[ba][bb];
                int ca = naive_cmp_tok(nv, a, ba);
                if (c > cb || (c == cb && (ca < 0 || (ca == 0 && naive_cmp_tok(nv, b, bb) < 0)))) {
                    ba = a;
                    bb = b;
                }
            }
        if (ba < 0) break;
        int x = nv->n_tok++;
        memcpy(nv->tok[x], nv->tok[ba], (size_t)nv->tok_len[ba]);
        memcpy(nv->tok[x] + nv->tok_len[ba], nv->tok[bb], (size_t)nv->tok_len[bb]);
        nv->tok_len[x] = nv->tok_len[ba] + nv->tok_len[bb];
        merges[nm][0] = ba;
        merges[nm][1] = bb;
        nm++;
        for (int w = 0; w < nv->n_words; w++) {
            int j = 0, *s = nv->words[w];
            for (int i = 0; i < nv->wlen[w];) {
                if (i + 1 < nv->wlen[w] && s[i] == ba && s[i + 1] == bb) {
                    s[j++] = x;
                    i += 2;
                } else {
                    s[j++] = s[i++];
                }
            }
            nv->wlen[w] = j;
        }
    }
    return nm;
}

/* Random text over a small alphabet (many ties, and merged strings that collide, such
 * as "ab"+"c" and "a"+"bc"), with spaces, newlines, punctuation and some UTF-8. */
static char *random_text(uint64_t seed, size_t n_words, size_t *len) {
    static const char *alpha[] = {"a", "b", "c", "a", "b", "\xc3\xa9", "1", "."};
    rng_state = seed * 0x9E3779B97F4A7C15ull + 1;
    char *t = malloc(n_words * 12 + 1);
    size_t k = 0;
    for (size_t w = 0; w < n_words; w++) {
        int l = 1 + (int)(rnd() % 6);
        for (int i = 0; i < l; i++) {
            const char *s = alpha[rnd() % 8];
            size_t sl = strlen(s);
            memcpy(t + k, s, sl);
            k += sl;
        }
        t[k++] = rnd() % 7 == 0 ? '\n' : ' ';
    }
    t[k] = 0;
    *len = k;
    return t;
}

TEST(matches_naive_recounting_trainer) {
    static naive nv; /* large: keep it off the stack */
    static int want[200][2];
    for (uint64_t seed = 1; seed <= 4; seed++) {
        size_t n;
        char *text = random_text(seed, 400 + 300 * seed, &n);
        memset(&nv, 0, sizeof nv);
        int nm = naive_train(&nv, text, n, 150, want);
        anneal_bpe_model m;
        REQUIRE(learn_text(text, n, 150, &m));
        CHECK(m.n_merges == nm, "seed %d: %d merges, naive %d", (int)seed, (int)m.n_merges, nm);
        for (int r = 0; r < nm && r < m.n_merges; r++) {
            /* compare as bytes: both number tokens 256 + r in merge order */
            if (m.merges[r][0] != want[r][0] || m.merges[r][1] != want[r][1]) {
                char got[256];
                merge_str(&m, r, got, sizeof got);
                CHECK(false, "seed %d merge %d: '%s' ids (%d,%d), naive (%d,%d)", (int)seed, r, got,
                      (int)m.merges[r][0], (int)m.merges[r][1], want[r][0], want[r][1]);
                break;
            }
        }
        anneal_bpe_model_free(&m);
        free(nv.words);
        free(nv.wlen);
        free(text);
    }
}

/* ------------------------------------------------------ piece counting */

typedef struct piece_list {
    char **p;
    size_t *len;
    size_t n, cap;
} piece_list;

static bool collect_piece(const char *piece, size_t len, void *user) {
    piece_list *l = user;
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 256;
        l->p = realloc(l->p, l->cap * sizeof *l->p);
        l->len = realloc(l->len, l->cap * sizeof *l->len);
    }
    l->p[l->n] = malloc(len ? len : 1);
    memcpy(l->p[l->n], piece, len);
    l->len[l->n++] = len;
    return true;
}

typedef struct piece_ref {
    const char *p;
    size_t len;
} piece_ref;

static int cmp_piece(const void *x, const void *y) {
    const piece_ref *a = x, *b = y;
    int c = memcmp(a->p, b->p, a->len < b->len ? a->len : b->len);
    return c ? c : (a->len > b->len) - (a->len < b->len);
}

/* Occurrences of piece p[0..n) in pieces counted by anneal_bpe_count_pieces. */
static int64_t count_of(const anneal_piece_counts *pc, const char *p, size_t n) {
    for (size_t i = 0; i < pc->n; i++)
        if (pc->len[i] == n && !memcmp(pc->bytes + pc->off[i], p, n)) return pc->count[i];
    return 0;
}

/* Text with whitespace runs before words, Unicode spaces (U+00A0, U+3000, U+2028),
 * CJK, CRLF, tabs, contractions, digits and invalid UTF-8, cut into tiny blocks: the
 * counts must equal pre-tokenising each whole file. */
TEST(counts_do_not_depend_on_blocks_or_threads) {
    static const char *parts[] = {
        "Hello world", "  ", "   x", "\n\n", "\r\n", "\t", "it's", " they'll", "\xc2\xa0", "\xe3\x80\x80",
        "\xe2\x80\xa8", "\xe4\xb8\xad\xe6\x96\x87", "\xe3\x80\x82", "\n", " 12345", "!!", " ?",
        "\xff\xfe", "\xc3", "\x80\x80", "caf\xc3\xa9", "  \n  ", "end.", " ", "a",
    };
    rng_state = 7;
    size_t cap = 1 << 16, n = 0;
    char *text = malloc(cap);
    while (n < cap - 64) {
        const char *s = parts[rnd() % (sizeof parts / sizeof parts[0])];
        memcpy(text + n, s, strlen(s));
        n += strlen(s);
    }
    /* two files: pieces never span them */
    const char *f[2] = {tmp_path("count_a.txt"), tmp_path("count_b.txt")};
    REQUIRE(write_file(f[0], text, n / 2) && write_file(f[1], text + n / 2, n - n / 2));
    piece_list ref = {0};
    anneal_pretokenizer *pt = anneal_pretokenizer_new();
    REQUIRE(pt);
    anneal_pretokenize(pt, text, n / 2, collect_piece, &ref);
    anneal_pretokenize(pt, text + n / 2, n - n / 2, collect_piece, &ref);
    anneal_pretokenizer_free(pt);
    piece_ref *order = malloc(ref.n * sizeof *order);
    REQUIRE(order);
    for (size_t i = 0; i < ref.n; i++) order[i] = (piece_ref){ref.p[i], ref.len[i]};
    qsort(order, ref.n, sizeof *order, cmp_piece);
    size_t n_distinct = 0;
    for (size_t i = 0; i < ref.n; i++) n_distinct += i == 0 || cmp_piece(&order[i], &order[i - 1]) != 0;
    size_t blocks[] = {16, 64, 1000, 0};
    for (int bi = 0; bi < 4; bi++)
        for (int th = 1; th <= 2; th++) {
            anneal_piece_counts pc;
            REQUIRE(anneal_bpe_count_pieces(f, 2, th, blocks[bi], &pc) == ANNEAL_OK);
            CHECK(pc.total_bytes == n && pc.total_pieces == ref.n, "block %zu threads %d: %llu bytes %llu pieces, want %zu %zu",
                  blocks[bi], th, (unsigned long long)pc.total_bytes, (unsigned long long)pc.total_pieces, n, ref.n);
            /* every distinct reference piece (a run in the sorted list) has its count */
            CHECK(pc.n == n_distinct, "block %zu threads %d: %zu distinct pieces, want %zu", blocks[bi], th, pc.n,
                  n_distinct);
            int bad = 0;
            for (size_t i = 0; i < ref.n && bad < 3;) {
                size_t k = i;
                while (k < ref.n && cmp_piece(&order[k], &order[i]) == 0) k++;
                int64_t got = count_of(&pc, order[i].p, order[i].len);
                if (got != (int64_t)(k - i)) {
                    bad++;
                    CHECK(false, "block %zu threads %d: piece '%.*s' counted %lld, want %zu", blocks[bi], th,
                          (int)order[i].len, order[i].p, (long long)got, k - i);
                }
                i = k;
            }
            anneal_piece_counts_free(&pc);
        }
    for (size_t i = 0; i < ref.n; i++) free(ref.p[i]);
    free(order);
    free(ref.p);
    free(ref.len);
    free(text);
}

/* ----------------------------------------------------- files, determinism */

static const char *FILES[] = {"encoder.json", "vocab.bpe", "tokenizer.json"};

TEST(output_is_deterministic_and_thread_independent) {
    size_t n;
    char *text = random_text(11, 20000, &n);
    const char *in = tmp_path("det.txt");
    REQUIRE(write_file(in, text, n));
    free(text);
    const char *dirs[3] = {tmp_path("det1"), tmp_path("det2"), tmp_path("det3")};
    anneal_bpe_train_opts o1 = {.n_threads = 1}, o2 = {.n_threads = 2};
    REQUIRE(anneal_bpe_train_ex(&in, 1, 700, dirs[0], &o2, NULL) == ANNEAL_OK);
    REQUIRE(anneal_bpe_train_ex(&in, 1, 700, dirs[1], &o2, NULL) == ANNEAL_OK);
    REQUIRE(anneal_bpe_train_ex(&in, 1, 700, dirs[2], &o1, NULL) == ANNEAL_OK);
    for (int f = 0; f < 3; f++) {
        char a[600], b[600], c[600];
        snprintf(a, sizeof a, "%s/%s", dirs[0], FILES[f]);
        snprintf(b, sizeof b, "%s/%s", dirs[1], FILES[f]);
        snprintf(c, sizeof c, "%s/%s", dirs[2], FILES[f]);
        CHECK(same_file(a, b), "%s differs between two runs", FILES[f]);
        CHECK(same_file(a, c), "%s differs between 1 and 2 threads", FILES[f]);
    }
}

/* Loads dir both ways, checks both agree and that decode(encode(text)) == text; returns
 * the number of ids (0 on failure). */
static size_t check_roundtrip(const char *dir, const char *text, size_t n, int32_t want_vocab) {
    char enc[600], bpe[600], hf[600];
    snprintf(enc, sizeof enc, "%s/encoder.json", dir);
    snprintf(bpe, sizeof bpe, "%s/vocab.bpe", dir);
    snprintf(hf, sizeof hf, "%s/tokenizer.json", dir);
    anneal_tokenizer *g = NULL, *h = NULL;
    anneal_status sg = anneal_tokenizer_load_gpt2(enc, bpe, &g);
    CHECK(sg == ANNEAL_OK, "load_gpt2 %s: %s", dir, anneal_last_error());
    anneal_clear_error();
    anneal_status sh = anneal_tokenizer_load_hf(hf, &h);
    CHECK(sh == ANNEAL_OK, "load_hf %s: %s", dir, anneal_last_error());
    anneal_clear_error();
    size_t result = 0;
    if (g && h) {
        CHECK(anneal_tokenizer_vocab_size(g) == want_vocab && anneal_tokenizer_vocab_size(h) == want_vocab,
              "vocab %d / %d, want %d", (int)anneal_tokenizer_vocab_size(g), (int)anneal_tokenizer_vocab_size(h),
              (int)want_vocab);
        CHECK(anneal_tokenizer_eot(g) == want_vocab - 1 && anneal_tokenizer_eot(h) == want_vocab - 1,
              "eot %d / %d", (int)anneal_tokenizer_eot(g), (int)anneal_tokenizer_eot(h));
        CHECK(anneal_tokenizer_fingerprint(g) == anneal_tokenizer_fingerprint(h), "fingerprints differ");
        anneal_ids a = {0}, b = {0};
        CHECK_TRUE(anneal_tokenizer_encode(g, text, n, false, &a) == ANNEAL_OK);
        CHECK_TRUE(anneal_tokenizer_encode(h, text, n, false, &b) == ANNEAL_OK);
        CHECK(a.n == b.n && (a.n == 0 || !memcmp(a.ids, b.ids, a.n * sizeof *a.ids)), "gpt2 and hf ids differ");
        char *back = NULL;
        size_t bl = 0;
        CHECK_TRUE(anneal_tokenizer_decode(g, a.ids, a.n, &back, &bl) == ANNEAL_OK);
        CHECK(back && bl == n && !memcmp(back, text, n), "decode(encode(x)) != x (%zu vs %zu bytes)", bl, n);
        free(back);
        result = a.n;
        anneal_ids_free(&a);
        anneal_ids_free(&b);
    }
    anneal_tokenizer_free(g);
    anneal_tokenizer_free(h);
    return result;
}

TEST(files_load_and_roundtrip) {
    /* GPT-2's sample text (Unicode, numbers, contractions, odd spacing) when ../shared
     * is there, then random text */
    size_t n, ns = 0, nr;
    char *sample = read_file(anneal_test_path("../shared/data/tokenizer/sample.txt"), &ns);
    char *rand_text = random_text(5, 20000, &nr);
    n = ns + nr;
    char *text = malloc(n + 1);
    REQUIRE(text);
    if (sample) memcpy(text, sample, ns);
    memcpy(text + ns, rand_text, nr + 1);
    free(rand_text);
    const char *in = tmp_path("rt.txt"), *dir = tmp_path("rt_tok");
    REQUIRE(write_file(in, text, n));
    anneal_bpe_train_stats st;
    REQUIRE(anneal_bpe_train_ex(&in, 1, 600, dir, NULL, &st) == ANNEAL_OK);
    CHECK(st.vocab_size == 600, "vocab %d", (int)st.vocab_size);
    size_t ids = check_roundtrip(dir, text, n, st.vocab_size);
    CHECK(ids > 0 && ids * 2 < n, "%zu ids for %zu bytes: want fewer than half as many", ids, n);
    if (sample) CHECK(check_roundtrip(dir, sample, ns, st.vocab_size) > 0, "sample.txt");
    free(sample);
    printf("  trained 600 on %zu bytes: %zu ids (%.2f bytes/id)\n", n, ids, (double)n / (double)(ids ? ids : 1));
    /* the byte tokens are GPT-2's, id for id */
    const char *g2 = anneal_test_path("data/gpt2/encoder.json");
    char *ref = read_file(g2, NULL), p[600];
    snprintf(p, sizeof p, "%s/encoder.json", dir);
    char *mine = read_file(p, NULL);
    CHECK(ref && mine, "cannot read %s or %s", g2, p);
    if (ref && mine) {
        cJSON *a = cJSON_Parse(ref), *b = cJSON_Parse(mine);
        REQUIRE(a && b);
        int mism = 0;
        for (cJSON *e = a->child; e; e = e->next)
            if (e->valueint < 256) {
                cJSON *f = cJSON_GetObjectItemCaseSensitive(b, e->string);
                mism += !f || f->valueint != e->valueint;
            }
        CHECK(mism == 0, "%d byte tokens differ from GPT-2's ids", mism);
        cJSON_Delete(a);
        cJSON_Delete(b);
    }
    free(ref);
    free(mine);
    free(text);
    if (!sample)
        SKIP_PROMISED("ran on random text only: ../shared/data/tokenizer/sample.txt not found (make test expects "
                      "../shared beside the checkout)");
}

TEST(invalid_utf8_trains_and_roundtrips) {
    size_t n;
    char *t = random_text(3, 3000, &n);
    /* sprinkle invalid bytes: lone continuations, truncated sequences, 0xFF */
    rng_state = 99;
    for (int i = 0; i < 300; i++) {
        static const unsigned char bad[] = {0x80, 0xBF, 0xC3, 0xE2, 0xFF, 0xF0, 0xC0};
        t[rnd() % n] = (char)bad[rnd() % sizeof bad];
    }
    const char *in = tmp_path("bad_utf8.txt"), *dir = tmp_path("bad_utf8_tok");
    REQUIRE(write_file(in, t, n));
    anneal_bpe_train_stats st;
    REQUIRE(anneal_bpe_train_ex(&in, 1, 400, dir, NULL, &st) == ANNEAL_OK);
    size_t ids = check_roundtrip(dir, t, n, st.vocab_size);
    CHECK(ids > 0 && ids < n, "%zu ids for %zu bytes", ids, n);
    free(t);
}

TEST(errors) {
    const char *in = tmp_path("err.txt");
    REQUIRE(write_file(in, "some text here", 14));
    anneal_clear_error();
    CHECK_TRUE(anneal_bpe_train(&in, 1, 256, tmp_path("err_tok")) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "257"), "message: %s", anneal_last_error());
    anneal_clear_error();
    const char *files[2] = {in, tmp_path("does_not_exist.txt")};
    CHECK_TRUE(anneal_bpe_train(files, 2, 300, tmp_path("err_tok")) == ANNEAL_ERR_IO);
    CHECK(strstr(anneal_last_error(), "does_not_exist.txt"), "message: %s", anneal_last_error());
    anneal_clear_error();
    const char *d = tmp_dir();
    CHECK_TRUE(anneal_bpe_train(&d, 1, 300, tmp_path("err_tok")) == ANNEAL_ERR_IO);
    CHECK(strstr(anneal_last_error(), "directory"), "message: %s", anneal_last_error());
    anneal_clear_error();
    /* empty input is an error, not a useless 257-token vocabulary */
    const char *empty = tmp_path("empty.txt");
    REQUIRE(write_file(empty, "", 0));
    CHECK_TRUE(anneal_bpe_train(&empty, 1, 300, tmp_path("err_tok")) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "empty"), "message: %s", anneal_last_error());
    anneal_clear_error();
    /* nothing was written by the failed runs */
    struct stat sb;
    CHECK(stat(tmp_path("err_tok"), &sb) != 0, "the failed runs created the output directory");
    /* an output path that cannot be a directory */
    CHECK_TRUE(anneal_bpe_train(&in, 1, 300, in) == ANNEAL_ERR_IO);
    anneal_clear_error();
    /* a single-byte corpus has no pairs: 257 tokens, valid files */
    const char *one = tmp_path("one.txt"), *dir = tmp_path("one_tok");
    REQUIRE(write_file(one, "x", 1));
    anneal_bpe_train_stats st;
    REQUIRE(anneal_bpe_train_ex(&one, 1, 300, dir, NULL, &st) == ANNEAL_OK);
    CHECK(st.vocab_size == 257 && st.n_merges == 0, "vocab %d", (int)st.vocab_size);
    CHECK(check_roundtrip(dir, "x", 1, 257) == 1, "x");
}

/* ------------------------------------------------------------------ KJV */

/* The KJV text (first max_bytes) into path; false when `bible` is not installed. */
static bool kjv_file(const char *path, size_t max_bytes, size_t *n) {
    if (system("command -v bible >/dev/null 2>&1") != 0) return false;
    char cmd[700];
    snprintf(cmd, sizeof cmd, "bible gen1:1-rev22:21 2>/dev/null | head -c %zu > '%s'", max_bytes, path);
    if (system(cmd) != 0) return false;
    struct stat sb;
    if (stat(path, &sb) != 0 || sb.st_size < 100000) return false;
    *n = (size_t)sb.st_size;
    return true;
}

TEST(kjv_trains) {
    const char *in = tmp_path("kjv.txt"), *dir = tmp_path("kjv_tok");
    size_t n;
    if (!kjv_file(in, 8 << 20, &n)) SKIP_PROMISED("`bible` printed no KJV (bootstrap installs bible-kjv)");
    /* the whole 4.3 MB text: well under a second on 2 cores */
    anneal_bpe_train_stats st;
    double t0 = now_s();
    REQUIRE(anneal_bpe_train_ex(&in, 1, 1024, dir, NULL, &st) == ANNEAL_OK);
    double dt = now_s() - t0;
    printf("  KJV %.2f MB -> vocab 1024 in %.2f s (count %.2f s, merges %.2f s, write %.2f s), "
           "%zu distinct pieces, %d threads\n", (double)n / 1e6, dt, st.count_seconds, st.merge_seconds,
           st.write_seconds, st.distinct_pieces, omp_get_max_threads());
    CHECK(st.vocab_size == 1024, "vocab %d", (int)st.vocab_size);
    char *text = read_file(in, &n);
    REQUIRE(text);
    size_t ids = check_roundtrip(dir, text, n, 1024);
    printf("  KJV: %zu bytes -> %zu ids (%.2f bytes/id)\n", n, ids, (double)n / (double)(ids ? ids : 1));
    /* GPT-2 BPE at 1024 ids gives ~2.9 bytes per id on the KJV text */
    CHECK(ids > 0 && (double)n / (double)ids > 2.5, "%zu ids for %zu bytes", ids, n);
    free(text);
}

/* --------------------------------------------------------------- CLI */

static int run_cli(const char *args, char *out, size_t cap) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", getenv("ANNEAL_BIN"), args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t k = fread(out, 1, cap - 1, f);
    out[k] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(cli_tokenizer_train) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    static char out[1 << 14];
    char args[1500];
    const char *a = tmp_path("cli_a.txt"), *b = tmp_path("cli_b.txt"), *dir = tmp_path("cli_tok/sub");
    REQUIRE(write_file(a, "low lower lowest\n", 17) && write_file(b, "newer wider newest\n", 19));
    snprintf(args, sizeof args, "tokenizer train --vocab-size 270 --input '%s' '%s' --out '%s' --threads 2", a, b, dir);
    int rc = run_cli(args, out, sizeof out);
    CHECK(rc == 0, "exit %d: %s", rc, out);
    CHECK(strstr(out, "vocabulary"), "%s", out);
    char p[600];
    for (int f = 0; f < 3; f++) {
        snprintf(p, sizeof p, "%s/%s", dir, FILES[f]);
        struct stat sb;
        CHECK(stat(p, &sb) == 0 && sb.st_size > 0, "%s missing", p);
    }
    snprintf(args, sizeof args, "tokenizer train --vocab-size 100 --input '%s' --out '%s'", a, dir);
    CHECK((rc = run_cli(args, out, sizeof out)) == 2 && strstr(out, "--vocab-size"), "exit %d: %s", rc, out);
    snprintf(args, sizeof args, "tokenizer train --vocab-size 300 --input '%s' --out '%s'", tmp_path("nope.txt"), dir);
    CHECK((rc = run_cli(args, out, sizeof out)) == 1 && strstr(out, "nope.txt"), "exit %d: %s", rc, out);
    snprintf(args, sizeof args, "tokenizer train --vocab-size 300 --out '%s'", dir);
    CHECK((rc = run_cli(args, out, sizeof out)) == 2 && strstr(out, "--input"), "exit %d: %s", rc, out);
    CHECK((rc = run_cli("tokenizer frobnicate", out, sizeof out)) == 2 && strstr(out, "frobnicate"), "exit %d: %s", rc, out);
}

int main(void) {
    RUN(hand_worked_example);
    RUN(repeated_byte_and_running_out);
    RUN(matches_naive_recounting_trainer);
    RUN(counts_do_not_depend_on_blocks_or_threads);
    RUN(output_is_deterministic_and_thread_independent);
    RUN(files_load_and_roundtrip);
    RUN(invalid_utf8_trains_and_roundtrips);
    RUN(errors);
    RUN(kjv_trains);
    RUN(cli_tokenizer_train);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_dir());
    if (g_dir[0] && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return anneal_test_summary();
}
