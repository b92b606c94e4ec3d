/* Bad tokenizer files: each gives a clear error naming the file and the problem (and
 * the line, key or id), never a crash, and no tokenizer. Files are small GPT-2-style
 * vocabularies written here: the 256 bytes (ids 0..255 in byte order), "ab" = 256,
 * "abc" = 257, "<|endoftext|>" = 258; merges "a b", "ab c". */
#include "anneal/tokenizer.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[256];

static const char *path_of(const char *name) {
    static char bufs[4][512];
    static int k;
    char *b = bufs[k++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", dir, name);
    return b;
}

static void put(const char *name, const char *s) {
    FILE *f = fopen(path_of(name), "wb");
    if (!f) return;
    fwrite(s, 1, strlen(s), f);
    fclose(f);
}

/* GPT-2's byte -> code point, as UTF-8 JSON-escaped text in out. */
static void byte_key(int b, char *out) {
    int n = 0, cp = -1;
    for (int x = 0; x < 256; x++) {
        bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
        int c = printable ? x : 256 + n++;
        if (x == b) cp = c;
    }
    if (cp == '"' || cp == '\\') sprintf(out, "\\%c", cp);
    else if (cp < 0x80) sprintf(out, "%c", cp);
    else sprintf(out, "%c%c", 0xC0 | cp >> 6, 0x80 | (cp & 0x3F));
}

/* encoder.json text: bytes (skipping byte `skip`, renumbered densely), then `tail`. */
static char *encoder_text(int skip, const char *tail) {
    char *s = malloc(16384);
    size_t n = 0;
    int id = 0;
    n += (size_t)sprintf(s + n, "{");
    for (int b = 0; b < 256; b++) {
        if (b == skip) continue;
        char k[8];
        byte_key(b, k);
        n += (size_t)sprintf(s + n, "%s\"%s\": %d", id ? ", " : "", k, id);
        id++;
    }
    sprintf(s + n, "%s}", tail);
    return s;
}

static const char *good_tail = ", \"ab\": 256, \"abc\": 257, \"<|endoftext|>\": 258";
static const char *good_bpe = "#version: 0.2\na b\nab c\n";

static void write_good(void) {
    char *e = encoder_text(-1, good_tail);
    put("encoder.json", e);
    free(e);
    put("vocab.bpe", good_bpe);
}

static anneal_status load_pair(anneal_tokenizer **t) {
    *t = (anneal_tokenizer *)(uintptr_t)1; /* must come back NULL on failure */
    anneal_clear_error();
    return anneal_tokenizer_load_gpt2(path_of("encoder.json"), path_of("vocab.bpe"), t);
}

/* Checks a failure: the code, no tokenizer, and each of the words in the message. */
#define EXPECT_FAIL(st, code, tok, ...)                                                                      \
    do {                                                                                                     \
        anneal_status _s = (st);                                                                             \
        CHECK(_s == (code), "status %s, want %s (%s)", anneal_status_name(_s), anneal_status_name(code),     \
              anneal_last_error());                                                                          \
        CHECK((tok) == NULL, "a tokenizer came back from a failed load");                                    \
        const char *_words[] = {__VA_ARGS__};                                                                \
        for (size_t _i = 0; _i < sizeof _words / sizeof *_words; _i++)                                       \
            CHECK(strstr(anneal_last_error(), _words[_i]) != NULL, "message \"%s\" lacks \"%s\"",            \
                  anneal_last_error(), _words[_i]);                                                          \
        if (_s == ANNEAL_OK) anneal_tokenizer_free(tok);                                                     \
        anneal_clear_error();                                                                                \
    } while (0)

TEST(good_files_load) {
    write_good();
    anneal_tokenizer *t;
    REQUIRE(load_pair(&t) == ANNEAL_OK);
    CHECK_TRUE(anneal_tokenizer_vocab_size(t) == 259 && anneal_tokenizer_eot(t) == 258);
    anneal_ids ids = {0};
    REQUIRE(anneal_tokenizer_encode(t, "abc ab", 6, false, &ids) == ANNEAL_OK);
    CHECK(ids.n == 3 && ids.ids[0] == 257 && ids.ids[1] == ' ' && ids.ids[2] == 256, "%zu ids", ids.n);
    anneal_ids_free(&ids);
    anneal_tokenizer_free(t);
    /* a directory with both files resolves */
    REQUIRE(anneal_tokenizer_load(dir, &t) == ANNEAL_OK);
    anneal_tokenizer_free(t);
}

TEST(missing_files) {
    write_good();
    anneal_tokenizer *t;
    unlink(path_of("vocab.bpe"));
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_IO, t, "vocab.bpe", "cannot open");
    write_good();
    unlink(path_of("encoder.json"));
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_IO, t, "encoder.json", "cannot open");
    mkdir(path_of("encoder.json"), 0777); /* a directory where a file should be */
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_IO, t, "encoder.json", "not a regular file");
    rmdir(path_of("encoder.json"));
    t = NULL;
    EXPECT_FAIL(anneal_tokenizer_load("/nonexistent/anneal/tok", &t), ANNEAL_ERR_IO, t, "/nonexistent/anneal/tok");
    unlink(path_of("vocab.bpe"));
    EXPECT_FAIL(anneal_tokenizer_load(dir, &t), ANNEAL_ERR_IO, t, dir, "neither");
    setenv("ANNEAL_GPT2_DIR", dir, 1);
    EXPECT_FAIL(anneal_tokenizer_load("gpt2", &t), ANNEAL_ERR_IO, t, "ANNEAL_GPT2_DIR", dir);
    unsetenv("ANNEAL_GPT2_DIR");
}

TEST(bad_json) {
    write_good();
    anneal_tokenizer *t;
    put("encoder.json", "{\"a\": 0,,}");
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, "encoder.json", "invalid JSON", "line 1");
    put("encoder.json", "");
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, "encoder.json", "empty");
    put("encoder.json", "[0, 1, 2]");
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, "encoder.json", "object");
    /* truncated: the first half of a good file */
    char *e = encoder_text(-1, good_tail);
    e[strlen(e) / 2] = 0;
    put("encoder.json", e);
    free(e);
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, "encoder.json", "invalid JSON", "truncated");
}

TEST(bad_ids) {
    write_good();
    anneal_tokenizer *t;
    struct { const char *tail, *word; } cases[] = {
        {", \"ab\": 256.5, \"abc\": 257, \"<|endoftext|>\": 258", "\"ab\" has id 256.5"},
        {", \"ab\": \"256\", \"abc\": 257, \"<|endoftext|>\": 258", "not a number"},
        {", \"ab\": -1, \"abc\": 257, \"<|endoftext|>\": 258", "\"ab\" has id -1"},
        {", \"ab\": 256, \"abc\": 256, \"<|endoftext|>\": 258", "used twice"},
        {", \"ab\": 256, \"abc\": 300, \"<|endoftext|>\": 258", "id 257 is missing"},
        {", \"ab\": 256, \"abc\": 257, \"<|endoftext|>\": 258, \"ab\": 259", "duplicate key \"ab\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *e = encoder_text(-1, cases[i].tail);
        put("encoder.json", e);
        free(e);
        EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, "encoder.json", cases[i].word);
    }
    /* no token for byte 'A' (0x41) */
    char *e = encoder_text('A', ", \"ab\": 255, \"abc\": 256, \"<|endoftext|>\": 257");
    put("encoder.json", e);
    free(e);
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, "encoder.json", "byte 0x41");
    /* a key outside the byte table (a raw space) */
    e = encoder_text(-1, ", \"a b\": 256, \"abc\": 257, \"<|endoftext|>\": 258");
    put("encoder.json", e);
    free(e);
    EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, "encoder.json", "\"a b\"", "byte-level");
}

TEST(bad_merges) {
    anneal_tokenizer *t;
    struct { const char *bpe, *words[3]; } cases[] = {
        {"#version: 0.2\na b\nab zz\n", {"vocab.bpe:3", "\"zz\"", "not a token"}},
        {"#version: 0.2\na b\nb c\nab c\n", {"vocab.bpe:3", "\"bc\"", "merged token"}},
        {"#version: 0.2\na b c\nab c\n", {"vocab.bpe:2", "two tokens", "a b c"}},
        {"#version: 0.2\na b\na b\nab c\n", {"vocab.bpe:3", "repeats merge 0", "a b"}},
        {"#version: 0.2\na b\n", {"vocab.bpe", "\"abc\"", "made by no merge"}},  /* truncated at a line */
        {"#version: 0.2\na b\nab", {"vocab.bpe:3", "two tokens", "\"ab\""}}, /* truncated mid-line */
        {"", {"vocab.bpe", "made by no merge", "\"ab\""}},                     /* empty */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_good();
        put("vocab.bpe", cases[i].bpe);
        EXPECT_FAIL(load_pair(&t), ANNEAL_ERR_FORMAT, t, cases[i].words[0], cases[i].words[1], cases[i].words[2]);
    }
}

/* A tokenizer.json around a model and pre_tokenizer given as JSON text. */
static void put_hf(const char *model, const char *pre, const char *normalizer) {
    char *s = malloc(20000);
    sprintf(s, "{\"version\": \"1.0\", \"added_tokens\": [], \"normalizer\": %s, \"pre_tokenizer\": %s, \"model\": %s}",
            normalizer, pre, model);
    put("tokenizer.json", s);
    free(s);
}

TEST(bad_tokenizer_json) {
    anneal_tokenizer *t = NULL;
    const char *bl = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false}";
    put_hf("{\"type\": \"WordPiece\", \"unk_token\": \"[UNK]\", \"vocab\": {\"[UNK]\": 0}}", bl, "null");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_UNSUPPORTED, t, "tokenizer.json",
                "WordPiece");
    put_hf("{\"type\": \"Unigram\", \"vocab\": []}", bl, "null");
    EXPECT_FAIL(anneal_tokenizer_load(path_of("tokenizer.json"), &t), ANNEAL_ERR_UNSUPPORTED, t, "Unigram");
    /* a tiny BPE that would load, with each unsupported or broken part swapped in */
    char *e = encoder_text(-1, ", \"ab\": 256");
    char *model = malloc(20000);
    sprintf(model, "{\"type\": \"BPE\", \"vocab\": %s, \"merges\": [\"a b\"]}", e);
    put_hf(model, bl, "null");
    REQUIRE(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t) == ANNEAL_OK);
    CHECK_TRUE(anneal_tokenizer_vocab_size(t) == 257 && anneal_tokenizer_eot(t) == -1);
    anneal_tokenizer_free(t);
    t = NULL;
    put_hf(model, bl, "{\"type\": \"NFKC\"}"); /* (NFC is supported) */
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_UNSUPPORTED, t, "normalizer", "NFKC");
    put_hf(model, "{\"type\": \"Whitespace\"}", "null");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_UNSUPPORTED, t, "Whitespace");
    put_hf(model, "null", "null");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_UNSUPPORTED, t, "pre_tokenizer");
    sprintf(model, "{\"type\": \"BPE\", \"vocab\": %s, \"merges\": [\"a b\", 7]}", e);
    put_hf(model, bl, "null");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_FORMAT, t, "tokenizer.json",
                "merges[1]");
    sprintf(model, "{\"type\": \"BPE\", \"vocab\": %s, \"merges\": [[\"a\", \"q\"]]}", e);
    put_hf(model, bl, "null");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_FORMAT, t, "merges[0]",
                "merged token \"aq\"");
    sprintf(model, "{\"type\": \"BPE\", \"vocab\": %s}", e);
    put_hf(model, bl, "null");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_FORMAT, t, "merges");
    put("tokenizer.json", "{\"version\": \"1.0\"}");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_FORMAT, t, "no \"model\"");
    put("tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
    EXPECT_FAIL(anneal_tokenizer_load_hf(path_of("tokenizer.json"), &t), ANNEAL_ERR_FORMAT, t, "invalid JSON");
    free(model);
    free(e);
    unlink(path_of("tokenizer.json"));
}

TEST(decode_bad_ids) {
    write_good();
    anneal_tokenizer *t;
    REQUIRE(load_pair(&t) == ANNEAL_OK);
    int32_t ids[] = {1, 2, 259};
    char *text;
    size_t n;
    CHECK_TRUE(anneal_tokenizer_decode(t, ids, 3, &text, &n) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "id 259 at position 2") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    anneal_stream_decoder d;
    anneal_stream_decoder_init(&d, t);
    char out[80];
    CHECK_TRUE(anneal_stream_decoder_push(&d, -1, out, sizeof out, &n) == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_stream_decoder_push(&d, 5, out, 0, &n) == ANNEAL_ERR_ARG); /* no room */
    anneal_clear_error();
    anneal_tokenizer_free(t);
}

/* Runs the CLI: `anneal tokenize ARGS < input`; returns the exit code, stdout and
 * stderr in out/err (static buffers). */
static int run_cli(const char *args, const char *input, char *out, char *err, size_t cap) {
    const char *bin = getenv("ANNEAL_BIN");
    put("cli_in", input);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' tokenize %s < '%s' > '%s' 2> '%s'", bin, args, path_of("cli_in"),
             path_of("cli_out"), path_of("cli_err"));
    int st = system(cmd);
    const char *names[2] = {"cli_out", "cli_err"};
    char *bufs[2] = {out, err};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(path_of(names[i]), "rb");
        size_t n = f ? fread(bufs[i], 1, cap - 1, f) : 0;
        bufs[i][n] = 0;
        if (f) fclose(f);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(cli_tokenize) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin || access(bin, X_OK) != 0) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    write_good();
    char out[4096], err[4096], args[600];
    snprintf(args, sizeof args, "--tokenizer '%s'", dir);
    CHECK(run_cli(args, "abc ab", out, err, sizeof out) == 0, "encode failed: %s", err);
    CHECK(strcmp(out, "257 32 256\n") == 0, "encode printed \"%s\"", out);
    CHECK(run_cli(args, "abc<|endoftext|>", out, err, sizeof out) == 0, "%s", err);
    CHECK(strcmp(out, "257 60 124 101 110 100 111 102 116 101 120 116 124 62\n") == 0, "printed \"%s\"", out);
    snprintf(args, sizeof args, "--tokenizer '%s' --allow-special", dir);
    CHECK(run_cli(args, "abc<|endoftext|>", out, err, sizeof out) == 0, "%s", err);
    CHECK(strcmp(out, "257 258\n") == 0, "--allow-special printed \"%s\"", out);
    snprintf(args, sizeof args, "--tokenizer '%s' --decode", dir);
    CHECK(run_cli(args, "257 32\n256 258\n", out, err, sizeof out) == 0, "decode failed: %s", err);
    CHECK(strcmp(out, "abc ab<|endoftext|>") == 0, "decode printed \"%s\"", out);
    CHECK(run_cli(args, "257 x7 2", out, err, sizeof out) == 1, "a bad id was accepted");
    CHECK(strstr(err, "\"x7\"") && strstr(err, "position 1"), "stderr: %s", err);
    CHECK(run_cli(args, "257 259", out, err, sizeof out) == 1, "an id out of range was accepted");
    CHECK(strstr(err, "259") && strstr(err, "out of range"), "stderr: %s", err);
    CHECK(run_cli("--tokenizer /nonexistent/tok", "x", out, err, sizeof out) == 1, "a missing tokenizer loaded");
    CHECK(strstr(err, "--tokenizer") && strstr(err, "/nonexistent/tok"), "stderr: %s", err);
    CHECK(run_cli("--bogus", "x", out, err, sizeof out) == 2, "an unknown flag was accepted");
    CHECK(strstr(err, "--bogus") != NULL, "stderr: %s", err);
    const char *tmp[] = {"cli_in", "cli_out", "cli_err"};
    for (int i = 0; i < 3; i++) unlink(path_of(tmp[i]));
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/anneal_test_tokfiles_%d", (int)getpid());
    mkdir(dir, 0777);
    RUN(good_files_load);
    RUN(missing_files);
    RUN(bad_json);
    RUN(bad_ids);
    RUN(bad_merges);
    RUN(bad_tokenizer_json);
    RUN(decode_bad_ids);
    RUN(cli_tokenize);
    unlink(path_of("encoder.json"));
    unlink(path_of("vocab.bpe"));
    unlink(path_of("tokenizer.json"));
    rmdir(dir);
    return anneal_test_summary();
}
