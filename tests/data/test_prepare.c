/* `anneal prepare` and `anneal inspect` through the CLI binary (ANNEAL_BIN; skipped
 * when unset) plus the chunk-cut rule of src/data/prepare.c:
 * - decoded shard tokens equal the input files, each preceded by the end-of-text id,
 *   and equal the tokenizer's encoding of each whole file (chunking changes nothing);
 * - shards are byte-identical for --threads 1 and 2 and for different chunk sizes;
 * - the val split is the end of the input, about the requested fraction, nothing lost;
 * - shard rollover at --shard-tokens, prepare.json, stale shard removal, stdin input;
 * - flag errors exit 2 naming the flag, missing inputs exit 1 naming the file;
 * - inspect: header fields, --ids, --head, foreign/corrupted files. */
#include "anneal/data.h"
#include "anneal/prepare.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---------------------------------------------------------- helpers */

static char g_dir[64];

static const char *tmpdir(void) {
    if (!g_dir[0]) {
        strcpy(g_dir, "/tmp/anneal_test_prepare_XXXXXX");
        if (!mkdtemp(g_dir)) {
            perror("mkdtemp");
            exit(1);
        }
    }
    return g_dir;
}

/* "<tmpdir>/<name>" in a buffer of its own (1024 of them: enough for this file). */
static const char *tpath(const char *name) {
    static char bufs[1024][512];
    static int k;
    char *b = bufs[k++ & 1023];
    snprintf(b, sizeof bufs[0], "%s/%s", tmpdir(), name);
    return b;
}

static void write_file(const char *path, const char *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(1);
    }
    if (n) fwrite(data, 1, n, f);
    fclose(f);
}

static char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    *n = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    b[*n] = '\0';
    fclose(f);
    return b;
}

static bool files_equal(const char *a, const char *b) {
    size_t na, nb;
    char *x = read_file(a, &na), *y = read_file(b, &nb);
    bool eq = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return eq;
}

static bool exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static const char *bin(void) { return getenv("ANNEAL_BIN"); }

/* Runs "$ANNEAL_BIN <args>" (a shell fragment) with stdout/stderr captured into
 * g_out/g_err; returns the exit code. */
static char *g_out, *g_err;
static int run(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int run(const char *fmt, ...) {
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s %s >%s 2>%s", bin(), args, tpath("stdout.txt"), tpath("stderr.txt"));
    int rc = system(cmd);
    free(g_out);
    free(g_err);
    size_t n;
    g_out = read_file(tpath("stdout.txt"), &n);
    g_err = read_file(tpath("stderr.txt"), &n);
    if (!g_out) g_out = calloc(1, 1);
    if (!g_err) g_err = calloc(1, 1);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[1024];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) rm_tree(p);
        else unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

/* Deterministic prose of about n bytes: ASCII and non-ASCII words, punctuation,
 * newlines, blank lines, runs of spaces, tabs, digits. */
static char *make_text(size_t n, uint64_t seed, size_t *len) {
    static const char *words[] = {"the", "and", "of", "beginning", "God", "created", "heaven", "earth",
                                  "naïve", "café", "Straße", "Ελληνικά", "русский", "日本語", "it's",
                                  "don't", "3.14159", "2026", "x", "I", "'ll", "--", "(see", "below)"};
    static const char *seps[] = {" ", " ", " ", " ", " ", ", ", ". ", "\n", "\n\n", "  ", "\t", " \n",
                                 ";\n", "\n\n\n", ": "};
    char *b = malloc(n + 64);
    size_t o = 0;
    while (o < n) {
        const char *w = words[lcg(&seed) % (sizeof words / sizeof *words)];
        const char *s = seps[lcg(&seed) % (sizeof seps / sizeof *seps)];
        size_t lw = strlen(w), ls = strlen(s);
        memcpy(b + o, w, lw);
        o += lw;
        memcpy(b + o, s, ls);
        o += ls;
    }
    b[o] = '\0';
    *len = o;
    return b;
}

static anneal_tokenizer *g_tok;
static char g_tok_err[512];

/* GPT-2's tokenizer through the library, or NULL with the error in g_tok_err: its
 * files ship in data/gpt2, so the caller fails (NEED_GPT2). */
static anneal_tokenizer *gpt2(void) {
    if (!g_tok) {
        if (anneal_tokenizer_load("gpt2", &g_tok) != ANNEAL_OK) {
            g_tok = NULL;
            snprintf(g_tok_err, sizeof g_tok_err, "%s", anneal_last_error());
            anneal_clear_error();
        }
    }
    return g_tok;
}

/* All ids of the shards <dir>/<split>_NNNNNN.bin in order; *n set. */
static int32_t *split_ids(const char *dir, const char *split, size_t *n, int *n_shards) {
    int32_t *ids = NULL;
    *n = 0;
    int k = 0;
    for (;; k++) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s_%06d.bin", dir, split, k);
        if (!exists(p)) break;
        anneal_shard *s = NULL;
        if (anneal_shard_open(p, true, &s) != ANNEAL_OK) {
            anneal_test_fail(__FILE__, __LINE__, "%s", anneal_last_error());
            anneal_clear_error();
            break;
        }
        ids = realloc(ids, (*n + s->info.n_tokens + 1) * sizeof *ids);
        for (uint64_t i = 0; i < s->info.n_tokens; i++) ids[(*n)++] = (int32_t)anneal_shard_token(s, i);
        anneal_shard_close(s);
    }
    if (n_shards) *n_shards = k;
    return ids;
}

#define NEED_BIN() do { if (!bin()) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)"); } while (0)
#define NEED_GPT2() do { if (!gpt2()) TEST_FAIL("anneal_tokenizer_load(\"gpt2\") (data/gpt2): %s", g_tok_err); } while (0)

/* ---------------------------------------------------------- find_cut (library) */

TEST(cut_rule) {
    bool forced;
    const char *a = "hello world again";
    CHECK(anneal_prepare_find_cut(a, strlen(a), 14, false, &forced) == 11 && !forced, "before ' again'");
    CHECK(anneal_prepare_find_cut(a, strlen(a), 11, false, &forced) == 11 && !forced, "target itself");
    CHECK(anneal_prepare_find_cut(a, strlen(a), 10, false, &forced) == 5 && !forced, "before ' world'");
    const char *b = "ab\ncd\n\nef\t\ngh";
    /* "ab\n|cd" is safe (graphic, newline, graphic); "\n\n|ef" and "\t\n|gh" are not. */
    CHECK(anneal_prepare_find_cut(b, strlen(b), 12, false, &forced) == 3 && !forced, "newline rule");
    const char *c = "x  y";
    CHECK(anneal_prepare_find_cut(c, strlen(c), 3, false, &forced) == 1 && !forced, "only the first space");
    const char *u = "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"; /* éééé: no safe point */
    size_t k = anneal_prepare_find_cut(u, 8, 5, false, &forced);
    CHECK(forced && k == 4, "forced cut moves back to a character start: %zu", k);
    CHECK(anneal_prepare_find_cut(u, 8, 8, false, &forced) == 8 && !forced, "target >= len takes all");
    const char *d = "ab\ncd efg";
    CHECK(anneal_prepare_find_cut(d, strlen(d), 7, true, &forced) == 5 && !forced, "space_only skips newline");
    const char *e = "\xc3\xa9 \xc3\xa9xyz";
    CHECK(anneal_prepare_find_cut(e, strlen(e), 5, true, &forced) == 2 && forced, "space_only forced at a space");
    CHECK(anneal_prepare_find_cut(u, 8, 5, true, &forced) == 0 && forced, "space_only with no space: 0");
}

/* ---------------------------------------------------------- prepare */

TEST(documents_round_trip) {
    NEED_BIN();
    NEED_GPT2();
    anneal_tokenizer *tok = gpt2();
    int32_t eot = anneal_tokenizer_eot(tok);
    REQUIRE(eot == 50256);
    /* Documents: prose; prose with the special string and invalid UTF-8 (encoded as
     * plain bytes); empty; a long run of CJK with no safe cut (forced cuts). */
    size_t l0, l1;
    char *d0 = make_text(20000, 1, &l0);
    char *d1 = make_text(5000, 2, &l1);
    const char *extra = " <|endoftext|> is text here \xff\xfe\x80 bad bytes\n";
    d1 = realloc(d1, l1 + strlen(extra) + 1);
    memcpy(d1 + l1, extra, strlen(extra) + 1);
    l1 += strlen(extra);
    size_t l3 = 0;
    char *d3 = malloc(3 * 400 + 1);
    for (int i = 0; i < 400; i++, l3 += 3) memcpy(d3 + l3, "\xe4\xb8\xad", 3); /* 中 x 400 */
    const char *docs[4] = {d0, d1, "", d3};
    size_t lens[4] = {l0, l1, 0, l3};
    for (int i = 0; i < 4; i++) {
        char name[32];
        snprintf(name, sizeof name, "doc%d.txt", i);
        write_file(tpath(name), docs[i], lens[i]);
    }
    const char *out = tpath("rt");
    int rc = run("prepare --tokenizer gpt2 --input %s %s %s %s --out %s --val-fraction 0 --chunk-bytes 256 --threads 2",
                 tpath("doc0.txt"), tpath("doc1.txt"), tpath("doc2.txt"), tpath("doc3.txt"), out);
    REQUIRE(rc == 0 || (printf("%s%s", g_out, g_err), 0));
    CHECK(strstr(g_out, "from 4 documents") != NULL, "summary: %s", g_out);
    CHECK(!exists(tpath("rt/val_000000.bin")), "no val shard with --val-fraction 0");
    size_t n;
    int32_t *ids = split_ids(out, "train", &n, NULL);
    REQUIRE(ids && n > 0);
    /* Segment at the EOTs (the input text never yields the EOT id: specials are text). */
    size_t starts[8], n_docs = 0;
    for (size_t i = 0; i < n; i++)
        if (ids[i] == eot && n_docs < 8) starts[n_docs++] = i;
    REQUIRE(n_docs == 4);
    CHECK(starts[0] == 0, "the stream starts with EOT");
    for (size_t k = 0; k < 4; k++) {
        size_t a = starts[k] + 1, b = k + 1 < 4 ? starts[k + 1] : n;
        char *text = NULL;
        size_t len = 0;
        REQUIRE(anneal_tokenizer_decode(tok, ids + a, b - a, &text, &len) == ANNEAL_OK);
        CHECK(len == lens[k] && (!len || !memcmp(text, docs[k], len)), "document %zu does not round-trip (%zu vs %zu bytes)",
              k, len, lens[k]);
        free(text);
        if (k == 3) continue; /* forced cuts may tokenize differently; round trip is what counts */
        anneal_ids whole = {0};
        REQUIRE(anneal_tokenizer_encode(tok, docs[k], lens[k], false, &whole) == ANNEAL_OK);
        CHECK(whole.n == b - a && (!whole.n || !memcmp(whole.ids, ids + a, whole.n * sizeof(int32_t))),
              "document %zu: chunked ids differ from whole-document encoding (%zu vs %zu ids)", k, b - a, whole.n);
        anneal_ids_free(&whole);
    }
    CHECK(strstr(g_out, "no safe point") != NULL, "the CJK run forced cuts and the summary says so: %s", g_out);
    free(ids);
    free(d0);
    free(d1);
    free(d3);
}

TEST(identical_for_threads_and_chunk_sizes) {
    NEED_BIN();
    NEED_GPT2();
    /* KJV when `bible` is installed (the real corpus), else 1.5 MB of generated prose. */
    const char *in = tpath("corpus.txt");
    bool kjv = system("command -v bible >/dev/null 2>&1") == 0;
    char cmd[1024];
    if (kjv) {
        snprintf(cmd, sizeof cmd, "bible gen1:1-rev22:21 > %s", in);
        kjv = system(cmd) == 0;
    }
    if (!kjv) {
        size_t l;
        char *t = make_text(1500000, 7, &l);
        write_file(in, t, l);
        free(t);
    }
    const char *dirs[3] = {tpath("t1"), tpath("t2"), tpath("t2small")};
    const char *opts[3] = {"--threads 1", "--threads 2", "--threads 2 --chunk-bytes 4096"};
    for (int i = 0; i < 3; i++) {
        int rc = run("prepare --tokenizer gpt2 --input %s --out %s %s", in, dirs[i], opts[i]);
        REQUIRE(rc == 0 || (printf("%s%s", g_out, g_err), 0));
        printf("    %s (%s): %.*s\n", opts[i], kjv ? "KJV" : "generated", (int)strcspn(g_out, "\n"), g_out);
    }
    for (int i = 1; i < 3; i++)
        for (int s = 0; s < 2; s++) {
            char a[512], b[512];
            snprintf(a, sizeof a, "%s/%s_000000.bin", dirs[0], s ? "val" : "train");
            snprintf(b, sizeof b, "%s/%s_000000.bin", dirs[i], s ? "val" : "train");
            CHECK(files_equal(a, b), "%s differs from %s (%s)", b, a, opts[i]);
        }
    size_t n = 0;
    char *t = read_file(in, &n);
    anneal_ids whole = {0};
    REQUIRE(anneal_tokenizer_encode(gpt2(), t, n, false, &whole) == ANNEAL_OK);
    size_t nt, nv;
    int32_t *tr = split_ids(dirs[0], "train", &nt, NULL), *va = split_ids(dirs[0], "val", &nv, NULL);
    CHECK(nt + nv == whole.n + 1 && tr[0] == 50256, "token count %zu + %zu vs 1 + %zu", nt, nv, whole.n);
    if (nt + nv == whole.n + 1) {
        CHECK(!memcmp(tr + 1, whole.ids, (nt - 1) * sizeof(int32_t)), "train = the start of the whole encoding");
        CHECK(!memcmp(va, whole.ids + nt - 1, nv * sizeof(int32_t)), "val = the rest of the whole encoding");
    }
    free(tr);
    free(va);
    free(t);
    anneal_ids_free(&whole);
}

TEST(val_fraction_shards_and_manifest) {
    NEED_BIN();
    NEED_GPT2();
    size_t l;
    char *text = make_text(200000, 3, &l);
    const char *in = tpath("vf.txt"), *out = tpath("vf");
    write_file(in, text, l);
    int rc = run("prepare --tokenizer gpt2 --input %s --out %s --val-fraction 0.1 --shard-tokens 10000 --threads 2",
                 in, out);
    REQUIRE(rc == 0 || (printf("%s%s", g_out, g_err), 0));
    size_t nt, nv;
    int st, sv;
    int32_t *tr = split_ids(out, "train", &nt, &st), *va = split_ids(out, "val", &nv, &sv);
    double frac = (double)nv / (double)(nt + nv);
    CHECK(frac > 0.08 && frac < 0.12, "val fraction %.4f for 0.1", frac);
    CHECK(st == (int)((nt + 9999) / 10000) && sv == (int)((nv + 9999) / 10000), "%d train, %d val shards", st, sv);
    for (int k = 0; k + 1 < st; k++) { /* every shard but the last is full */
        anneal_shard *s = NULL;
        char p[512];
        snprintf(p, sizeof p, "%s/train_%06d.bin", out, k);
        REQUIRE(anneal_shard_open(p, true, &s) == ANNEAL_OK);
        CHECK(s->info.n_tokens == 10000, "%s has %llu tokens", p, (unsigned long long)s->info.n_tokens);
        CHECK(s->info.tokenizer_fingerprint == anneal_tokenizer_fingerprint(gpt2()) && s->info.eot == 50256 &&
                  s->info.vocab_size == 50257 && s->info.token_bytes == 2, "%s header", p);
        anneal_shard_close(s);
    }
    /* Nothing lost at the split: train then val decodes to EOT + the text. */
    int32_t *all = malloc((nt + nv) * sizeof *all);
    memcpy(all, tr, nt * sizeof *all);
    memcpy(all + nt, va, nv * sizeof *all);
    char *dec = NULL;
    size_t dl = 0;
    REQUIRE(anneal_tokenizer_decode(gpt2(), all + 1, nt + nv - 1, &dec, &dl) == ANNEAL_OK);
    CHECK(all[0] == 50256 && dl == l && !memcmp(dec, text, l), "train + val decode to the input");
    /* The val part is the end of the input: about 10% of its bytes. */
    char *vdec = NULL;
    size_t vl = 0;
    REQUIRE(anneal_tokenizer_decode(gpt2(), va, nv, &vdec, &vl) == ANNEAL_OK);
    CHECK(vl <= l && !memcmp(vdec, text + l - vl, vl), "val decodes to the input's tail");
    CHECK(fabs((double)vl / (double)l - 0.1) < 0.01, "val has %.4f of the bytes", (double)vl / (double)l);
    /* prepare.json */
    size_t jn;
    char *js = read_file(tpath("vf/prepare.json"), &jn);
    REQUIRE(js);
    cJSON *j = cJSON_Parse(js);
    REQUIRE(j);
    char fp[32];
    snprintf(fp, sizeof fp, "0x%016llx", (unsigned long long)anneal_tokenizer_fingerprint(gpt2()));
    cJSON *tk = cJSON_GetObjectItem(j, "tokenizer");
    CHECK(tk && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(tk, "fingerprint")), fp), "fingerprint in json");
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(tk, "spec")), "gpt2"), "spec");
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "train_tokens")) == (double)nt, "train_tokens");
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "val_tokens")) == (double)nv, "val_tokens");
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(j, "shards")) == st + sv, "shard list");
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "bytes")) == (double)l, "bytes");
    cJSON_Delete(j);
    free(js);

    /* A rerun with fewer shards removes the earlier run's extra ones. */
    char last[512];
    snprintf(last, sizeof last, "%s/train_%06d.bin", out, st - 1);
    REQUIRE(exists(last) && st > 2);
    rc = run("prepare --tokenizer gpt2 --input %s --out %s --val-fraction 0.1", in, out);
    REQUIRE(rc == 0);
    CHECK(!exists(last), "stale %s still there", last);
    CHECK(strstr(g_out, "removed") != NULL, "summary mentions the removal: %s", g_out);
    size_t nt2, nv2;
    int st2;
    int32_t *tr2 = split_ids(out, "train", &nt2, &st2), *va2 = split_ids(out, "val", &nv2, NULL);
    CHECK(st2 == 1 && nt2 == nt && nv2 == nv, "same split whatever the shard size");
    CHECK(nt2 == nt && !memcmp(tr2, tr, nt * sizeof *tr), "same train ids");
    free(tr2);
    free(va2);
    free(dec);
    free(vdec);
    free(all);
    free(tr);
    free(va);
    free(text);
}

TEST(stdin_input) {
    NEED_BIN();
    NEED_GPT2();
    size_t l;
    char *text = make_text(30000, 5, &l);
    const char *in = tpath("stdin.txt");
    write_file(in, text, l);
    free(text);
    REQUIRE(run("prepare --tokenizer gpt2 --input %s --out %s", in, tpath("sf")) == 0);
    REQUIRE(run("prepare --tokenizer gpt2 --input - --out %s < %s", tpath("sp"), in) == 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cat %s | %s prepare --tokenizer gpt2 --input - --out %s >/dev/null", in, bin(),
             tpath("spipe"));
    REQUIRE(system(cmd) == 0);
    CHECK(files_equal(tpath("sf/train_000000.bin"), tpath("sp/train_000000.bin")), "stdin (file) = file");
    CHECK(files_equal(tpath("sf/train_000000.bin"), tpath("spipe/train_000000.bin")), "stdin (pipe) = file");
    CHECK(files_equal(tpath("sf/val_000000.bin"), tpath("spipe/val_000000.bin")), "val too");
    DIR *d = opendir(tpath("spipe"));
    struct dirent *e;
    int stray = 0;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, "tmp")) stray++;
    if (d) closedir(d);
    CHECK(stray == 0, "temporaries left in the output directory");
}

TEST(bad_flags_and_inputs) {
    NEED_BIN();
    const char *in = tpath("small.txt");
    write_file(in, "Hello there.\n", 13);
    const char *out = tpath("bad");
    struct {
        const char *args, *flag;
    } cases[] = {
        {"--val-fraction 1.5", "--val-fraction"},
        {"--val-fraction -0.1", "--val-fraction"},
        {"--val-fraction abc", "--val-fraction"},
        {"--shard-tokens 0", "--shard-tokens"},
        {"--threads -2", "--threads"},
        {"--chunk-bytes 10", "--chunk-bytes"},
        {"--bogus 1", "--bogus"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int rc = run("prepare --tokenizer gpt2 --input %s --out %s %s", in, out, cases[k].args);
        CHECK(rc == 2, "%s: exit %d", cases[k].args, rc);
        CHECK(strstr(g_err, cases[k].flag) != NULL, "%s: stderr '%s' does not name the flag", cases[k].args, g_err);
    }
    CHECK(run("prepare --tokenizer gpt2 --input %s", in) == 2 && strstr(g_err, "--out"), "missing --out: %s", g_err);
    CHECK(run("prepare --tokenizer gpt2 --out %s", out) == 2 && strstr(g_err, "--input"), "missing --input: %s", g_err);
    CHECK(run("prepare --input %s --out %s", in, out) == 2 && strstr(g_err, "--tokenizer"), "missing --tokenizer");
    CHECK(!exists(out), "nothing created on usage errors");
    /* Missing input: exit 1 naming it, nothing written. */
    const char *missing = tpath("no_such_input.txt");
    int rc = run("prepare --tokenizer gpt2 --input %s %s --out %s", in, missing, out);
    CHECK(rc == 1, "missing input: exit %d", rc);
    CHECK(strstr(g_err, missing) != NULL, "stderr '%s' does not name %s", g_err, missing);
    CHECK(!exists(out), "output directory created despite the missing input");
    NEED_GPT2();
    rc = run("prepare --tokenizer gpt2 --input %s --out %s", tmpdir(), out);
    CHECK(rc == 1 && strstr(g_err, "not a regular file"), "a directory as input: %d %s", rc, g_err);
    rc = run("prepare --tokenizer %s --input %s --out %s", tpath("no_tokenizer_here"), in, out);
    CHECK(rc == 1 && strstr(g_err, "no_tokenizer_here"), "bad tokenizer: %d %s", rc, g_err);
    rc = run("prepare --tokenizer gpt2 --input %s --out %s/a/b", in, tpath("nodir"));
    CHECK(rc == 1 && strstr(g_err, "nodir/a/b"), "uncreatable output: %d %s", rc, g_err);
}

/* A tokenizer.json with add_prefix_space (Hugging Face ByteLevel): chunks must start
 * with a space so the prefix goes only before each document; ids still equal the
 * whole-document encoding with small chunks and a val split. */
TEST(prefix_space_tokenizer) {
    NEED_BIN();
    size_t l0, l1;
    char *d0 = make_text(30000, 11, &l0), *d1 = make_text(3000, 12, &l1);
    write_file(tpath("ps0.txt"), d0, l0);
    write_file(tpath("ps1.txt"), d1, l1);
    const char *files[1] = {tpath("ps0.txt")};
    if (anneal_bpe_train(files, 1, 400, tpath("pstok")) != ANNEAL_OK) TEST_FAIL("anneal_bpe_train: %s", anneal_last_error());
    size_t n;
    char *js = read_file(tpath("pstok/tokenizer.json"), &n);
    REQUIRE(js);
    cJSON *j = cJSON_Parse(js);
    free(js);
    REQUIRE(j && cJSON_GetObjectItem(j, "pre_tokenizer"));
    cJSON *pre = cJSON_GetObjectItem(j, "pre_tokenizer"), *seq = cJSON_GetObjectItem(pre, "pretokenizers");
    if (seq) pre = cJSON_GetArrayItem(seq, cJSON_GetArraySize(seq) - 1); /* Split, then ByteLevel */
    cJSON_ReplaceItemInObject(pre, "add_prefix_space", cJSON_CreateTrue());
    js = cJSON_Print(j);
    cJSON_Delete(j);
    const char *tj = tpath("ps_tokenizer.json");
    write_file(tj, js, strlen(js));
    free(js);
    anneal_tokenizer *tok = NULL;
    REQUIRE(anneal_tokenizer_load(tj, &tok) == ANNEAL_OK);
    anneal_ids a = {0}, b = {0}; /* the premise: "a" is encoded as " a" */
    REQUIRE(anneal_tokenizer_encode(tok, "a", 1, false, &a) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_encode(tok, " a", 2, false, &b) == ANNEAL_OK);
    CHECK(a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof(int32_t)), "tokenizer adds no prefix space");
    anneal_ids_free(&a);
    anneal_ids_free(&b);
    const char *out = tpath("ps");
    int rc = run("prepare --tokenizer %s --input %s %s --out %s --chunk-bytes 200 --val-fraction 0.05", tj,
                 tpath("ps0.txt"), tpath("ps1.txt"), out);
    REQUIRE(rc == 0 || (printf("%s%s", g_out, g_err), 0));
    size_t nt, nv;
    int32_t *tr = split_ids(out, "train", &nt, NULL), *va = split_ids(out, "val", &nv, NULL);
    int32_t *all = malloc((nt + nv + 1) * sizeof *all);
    memcpy(all, tr, nt * sizeof *all);
    memcpy(all + nt, va, nv * sizeof *all);
    int32_t eot = anneal_tokenizer_eot(tok);
    anneal_ids ref = {0};
    const char *docs[2] = {d0, d1};
    size_t lens[2] = {l0, l1};
    for (int k = 0; k < 2; k++) {
        anneal_ids_push(&ref, eot);
        REQUIRE(anneal_tokenizer_encode(tok, docs[k], lens[k], false, &ref) == ANNEAL_OK);
    }
    CHECK(ref.n == nt + nv && !memcmp(ref.ids, all, ref.n * sizeof(int32_t)),
          "chunked ids (%zu) differ from whole-document encoding (%zu)", nt + nv, ref.n);
    CHECK(nv > 0 && nt > 0, "both splits used: %zu %zu", nt, nv);
    anneal_ids_free(&ref);
    anneal_tokenizer_free(tok);
    free(all);
    free(tr);
    free(va);
    free(d0);
    free(d1);
}

/* Hugging Face tokenizers of every kind (the fixtures of test_hf_tokenizers.c): ids from
 * parallel chunks equal whole-document encoding. SentencePiece-style BPE runs over whole
 * segments and puts a ▁ before the text, so its chunks start at a space that the ▁
 * stands for. */
TEST(hf_tokenizers_chunk_exactly) {
    NEED_BIN();
    const char *names[] = {"llama2_sp", "mistral_sp", "llama3_bl", "qwen2_nfc"};
    size_t l0, l1;
    char *d0 = read_file(anneal_test_path("tests/fixtures/hf_tokenizers/kjv_excerpt.txt"), &l0);
    REQUIRE(d0);
    char *d1 = make_text(3000, 21, &l1);
    write_file(tpath("hf0.txt"), d0, l0);
    write_file(tpath("hf1.txt"), d1, l1);
    for (int k = 0; k < 4; k++) {
        char dir[300];
        snprintf(dir, sizeof dir, "%s/%s", anneal_test_path("tests/fixtures/hf_tokenizers"), names[k]);
        anneal_tokenizer *tok = NULL;
        REQUIRE(anneal_tokenizer_load(dir, &tok) == ANNEAL_OK);
        char out[300];
        snprintf(out, sizeof out, "%s", tpath(names[k]));
        int rc = run("prepare --tokenizer %s --input %s %s --out %s --chunk-bytes 300 --threads 2 --val-fraction 0.1",
                     dir, tpath("hf0.txt"), tpath("hf1.txt"), out);
        CHECK(rc == 0, "%s: exit %d: %s", names[k], rc, g_err);
        if (rc != 0) {
            anneal_tokenizer_free(tok);
            continue;
        }
        size_t nt, nv;
        int32_t *tr = split_ids(out, "train", &nt, NULL), *va = split_ids(out, "val", &nv, NULL);
        int32_t *all = malloc((nt + nv + 1) * sizeof *all);
        memcpy(all, tr, nt * sizeof *all);
        memcpy(all + nt, va, nv * sizeof *all);
        int32_t eot = anneal_tokenizer_eot(tok);
        anneal_ids ref = {0};
        const char *docs[2] = {d0, d1};
        size_t lens[2] = {l0, l1};
        for (int d = 0; d < 2; d++) {
            if (eot >= 0) anneal_ids_push(&ref, eot);
            REQUIRE(anneal_tokenizer_encode(tok, docs[d], lens[d], false, &ref) == ANNEAL_OK);
        }
        size_t first = ref.n;
        for (size_t i = 0; i < ref.n && i < nt + nv; i++)
            if (ref.ids[i] != all[i]) {
                first = i;
                break;
            }
        CHECK(ref.n == nt + nv && first == ref.n, "%s: chunked ids (%zu) differ from whole-document encoding (%zu) at %zu",
              names[k], nt + nv, ref.n, first);
        anneal_ids_free(&ref);
        anneal_tokenizer_free(tok);
        free(all);
        free(tr);
        free(va);
        rm_tree(out);
    }
    free(d0);
    free(d1);
}

/* ---------------------------------------------------------- inspect */

TEST(inspect_command) {
    NEED_BIN();
    /* A shard made by the library writer, so this runs without the GPT-2 files. */
    const char *p = tpath("insp.bin");
    anneal_shard_writer *w = NULL;
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = i % 7 == 0 ? 99 : i * 2;
    REQUIRE(anneal_shard_writer_open(p, 100, 99, 0xfeedbeefcafe1234ULL, &w) == ANNEAL_OK);
    REQUIRE(anneal_shard_writer_append(w, ids, 40) == ANNEAL_OK);
    REQUIRE(anneal_shard_writer_finish(w) == ANNEAL_OK);
    int rc = run("inspect %s", p);
    CHECK(rc == 0, "exit %d: %s", rc, g_err);
    const char *want[] = {"tokens: 40", "vocab size: 100", "eot: 99 (6 in this shard)", "token bytes: 2",
                          "0xfeedbeefcafe1234", "(verified)", "version 1", "first 16 ids: 99 2 4 6 8 10 12 99 16"};
    for (size_t k = 0; k < sizeof want / sizeof *want; k++)
        CHECK(strstr(g_out, want[k]) != NULL, "inspect output lacks '%s':\n%s", want[k], g_out);
    rc = run("inspect %s --ids", p);
    char expect[512] = "";
    for (int i = 0; i < 40; i++) snprintf(expect + strlen(expect), sizeof expect - strlen(expect), i ? " %d" : "%d", ids[i]);
    strcat(expect, "\n");
    CHECK(rc == 0 && !strcmp(g_out, expect), "--ids:\n%s\nexpected\n%s", g_out, expect);
    rc = run("inspect --head 3 %s", p);
    CHECK(rc == 0 && strstr(g_out, "first 3 ids: 99 2 4\n"), "--head 3:\n%s", g_out);
    /* Foreign, corrupted, missing, usage. */
    const char *txt = tpath("plain.txt");
    write_file(txt, "just some text\n", 15);
    rc = run("inspect %s", txt);
    CHECK(rc == 1 && strstr(g_err, "not an anneal shard") && strstr(g_err, txt), "foreign: %d %s", rc, g_err);
    size_t n;
    char *b = read_file(p, &n);
    b[64 + 5] ^= 0x01;
    write_file(tpath("bad.bin"), b, n);
    free(b);
    rc = run("inspect %s", tpath("bad.bin"));
    CHECK(rc == 1 && strstr(g_err, "corrupted"), "corrupted: %d %s", rc, g_err);
    rc = run("inspect %s", tpath("nothing.bin"));
    CHECK(rc == 1 && strstr(g_err, "nothing.bin"), "missing: %d %s", rc, g_err);
    CHECK(run("inspect") == 2, "no file: usage error");
    CHECK(run("inspect %s --head -1", p) == 2 && strstr(g_err, "--head"), "bad --head");
    CHECK(run("inspect %s --nope", p) == 2 && strstr(g_err, "--nope"), "unknown flag");
}

int main(void) {
    RUN(cut_rule);
    RUN(documents_round_trip);
    RUN(identical_for_threads_and_chunk_sizes);
    RUN(val_fraction_shards_and_manifest);
    RUN(stdin_input);
    RUN(bad_flags_and_inputs);
    RUN(prefix_space_tokenizer);
    RUN(hf_tokenizers_chunk_exactly);
    RUN(inspect_command);
    int rc = anneal_test_summary();
    anneal_tokenizer_free(g_tok);
    free(g_out);
    free(g_err);
    rm_tree(g_dir);
    return rc;
}
