/* Token shards: writer/reader round trips (u16, u32, empty, large multi-buffer
 * appends) checked byte by byte against the layout of docs/FORMATS.md built
 * independently here; every reader error on hand-made files (foreign, truncated,
 * oversized, corrupted tokens, corrupted header, wrong version, bad fields, id >= vocab,
 * all with valid checksums where the test is about something else); writer atomicity. */
#include "anneal/shard.h"
#include "test.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------- test helpers */

static char g_dir[64];

/* A scratch directory for this test binary. */
static const char *tmpdir(void) {
    if (!g_dir[0]) {
        strcpy(g_dir, "/tmp/anneal_test_shard_XXXXXX");
        if (!mkdtemp(g_dir)) {
            perror("mkdtemp");
            exit(1);
        }
    }
    return g_dir;
}

static const char *tpath(const char *name) {
    static char bufs[4][256];
    static int k;
    char *b = bufs[k++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", tmpdir(), name);
    return b;
}

static void rm_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[512];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(dir);
}

/* Count of entries in the scratch directory whose name contains ".tmp.". */
static int count_temporaries(void) {
    DIR *d = opendir(tmpdir());
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, ".tmp.")) n++;
    if (d) closedir(d);
    return n;
}

/* Reference FNV-1a 64. */
static uint64_t ref_fnv(const unsigned char *p, size_t n) {
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint64_t get_le(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* A hand-built shard image (FORMATS.md layout) with correct checksums unless the
 * caller edits it afterwards. *size set; caller frees. */
typedef struct {
    uint32_t version, header_size, token_bytes, vocab, reserved;
    int32_t eot;
    uint64_t fingerprint;
} hdr_spec;

static unsigned char *build_shard(hdr_spec h, const uint32_t *ids, size_t n, size_t *size) {
    *size = 64 + n * h.token_bytes;
    unsigned char *b = calloc(1, *size);
    memcpy(b, "ANNLTOK1", 8);
    put_le(b + 8, h.version, 4);
    put_le(b + 12, h.header_size, 4);
    put_le(b + 16, h.token_bytes, 4);
    put_le(b + 20, h.vocab, 4);
    put_le(b + 24, (uint32_t)h.eot, 4);
    put_le(b + 28, h.reserved, 4);
    put_le(b + 32, n, 8);
    put_le(b + 40, h.fingerprint, 8);
    for (size_t i = 0; i < n; i++) put_le(b + 64 + i * h.token_bytes, ids[i], (int)h.token_bytes);
    put_le(b + 48, ref_fnv(b + 64, n * h.token_bytes), 8);
    put_le(b + 56, ref_fnv(b, 56), 8);
    return b;
}

/* Recomputes the header checksum after an edit of bytes 0..55. */
static void reseal_header(unsigned char *b) { put_le(b + 56, ref_fnv(b, 56), 8); }

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(1);
    }
    if (n) fwrite(p, 1, n, f);
    fclose(f);
}

static unsigned char *read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    *n = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

/* Opening path must fail with code and a message naming the file and containing what. */
static void expect_open_error(const char *path, anneal_status code, const char *what, int line) {
    anneal_clear_error();
    anneal_shard *s = (anneal_shard *)0x1;
    anneal_status st = anneal_shard_open(path, true, &s);
    const char *msg = anneal_last_error();
    if (st != code) anneal_test_fail(__FILE__, line, "status %s, expected %s (%s)", anneal_status_name(st),
                                     anneal_status_name(code), msg);
    if (s != NULL) anneal_test_fail(__FILE__, line, "out not NULL on failure");
    if (!strstr(msg, what)) anneal_test_fail(__FILE__, line, "message '%s' lacks '%s'", msg, what);
    if (!strstr(msg, path)) anneal_test_fail(__FILE__, line, "message '%s' does not name %s", msg, path);
    anneal_shard_close(st == ANNEAL_OK ? s : NULL);
    anneal_clear_error();
}
#define EXPECT_OPEN_ERROR(path, code, what) expect_open_error((path), (code), (what), __LINE__)

/* Writes ids (as int32) with the writer in appends of varying sizes. */
static anneal_status write_with_writer(const char *path, uint32_t vocab, int32_t eot, uint64_t fp,
                                       const int32_t *ids, size_t n) {
    anneal_shard_writer *w = NULL;
    anneal_status s = anneal_shard_writer_open(path, vocab, eot, fp, &w);
    if (s != ANNEAL_OK) return s;
    size_t i = 0, step = 1;
    while (i < n) {
        size_t k = n - i < step ? n - i : step;
        s = anneal_shard_writer_append(w, ids + i, k);
        if (s != ANNEAL_OK) {
            anneal_shard_writer_abort(w);
            return s;
        }
        i += k;
        step = step * 3 + 1; /* 1, 4, 13, 40, ... crosses the writer's buffer unevenly */
    }
    return anneal_shard_writer_finish(w);
}

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

/* Round trip of n random ids below vocab; checks every header byte and id. */
static void round_trip(uint32_t vocab, size_t n, uint32_t expect_width) {
    const char *path = tpath("rt.bin");
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    uint64_t seed = vocab * 31u + n;
    for (size_t i = 0; i < n; i++) ids[i] = (int32_t)(lcg(&seed) % vocab);
    if (n > 2) {
        ids[0] = 0;
        ids[1] = (int32_t)vocab - 1; /* the extremes survive the width */
    }
    int32_t eot = (int32_t)vocab - 1;
    uint64_t fp = 0x0123456789abcdefULL ^ vocab;
    anneal_clear_error();
    REQUIRE(write_with_writer(path, vocab, eot, fp, ids, n) == ANNEAL_OK);
    CHECK(count_temporaries() == 0, "temporary left behind");

    /* The bytes on disk, against the documented layout. */
    size_t sz = 0;
    unsigned char *b = read_bytes(path, &sz);
    REQUIRE(b);
    CHECK(sz == 64 + n * expect_width, "file size %zu, expected %zu", sz, 64 + n * expect_width);
    CHECK(!memcmp(b, "ANNLTOK1", 8), "magic");
    CHECK(get_le(b + 8, 4) == 1, "version");
    CHECK(get_le(b + 12, 4) == 64, "header_size");
    CHECK(get_le(b + 16, 4) == expect_width, "token_bytes %llu", (unsigned long long)get_le(b + 16, 4));
    CHECK(get_le(b + 20, 4) == vocab, "vocab_size");
    CHECK((int32_t)get_le(b + 24, 4) == eot, "eot");
    CHECK(get_le(b + 28, 4) == 0, "reserved");
    CHECK(get_le(b + 32, 8) == n, "n_tokens");
    CHECK(get_le(b + 40, 8) == fp, "fingerprint");
    CHECK(get_le(b + 48, 8) == ref_fnv(b + 64, sz - 64), "checksum");
    CHECK(get_le(b + 56, 8) == ref_fnv(b, 56), "header checksum");
    size_t bad = n;
    for (size_t i = 0; i < n && 64 + i * expect_width < sz; i++)
        if (get_le(b + 64 + i * expect_width, (int)expect_width) != (uint64_t)ids[i]) {
            bad = i;
            break;
        }
    CHECK(bad == n, "raw id %zu differs", bad);
    free(b);

    /* And through the reader. */
    anneal_shard *s = NULL;
    REQUIRE(anneal_shard_open(path, true, &s) == ANNEAL_OK);
    CHECK(s->info.version == 1 && s->info.token_bytes == expect_width && s->info.n_tokens == n &&
              s->info.vocab_size == vocab && s->info.eot == eot && s->info.tokenizer_fingerprint == fp,
          "info fields");
    CHECK(!strcmp(s->path, path), "path copied");
    bad = n;
    for (size_t i = 0; i < n; i++)
        if (anneal_shard_token(s, i) != (uint32_t)ids[i]) {
            bad = i;
            break;
        }
    CHECK(bad == n, "reader id %zu differs", bad);
    anneal_shard_close(s);
    free(ids);
}

/* ----------------------------------------------------------------- tests */

TEST(round_trip_u16) { round_trip(50257, 10007, 2); }
TEST(round_trip_u32) { round_trip(100277, 10007, 4); }
TEST(width_boundary) {
    round_trip(65536, 300, 2); /* id 65535 still fits u16 */
    round_trip(65537, 300, 4);
    round_trip(1, 5, 2);       /* a one-id vocabulary */
}
TEST(large_multi_buffer) { round_trip(200000, 700001, 4); } /* 2.8 MB: several writer buffers */

TEST(zero_tokens) {
    const char *path = tpath("empty.bin");
    anneal_shard_writer *w = NULL;
    REQUIRE(anneal_shard_writer_open(path, 50257, -1, 7, &w) == ANNEAL_OK);
    REQUIRE(anneal_shard_writer_append(w, NULL, 0) == ANNEAL_OK);
    REQUIRE(anneal_shard_writer_finish(w) == ANNEAL_OK);
    size_t sz = 0;
    unsigned char *b = read_bytes(path, &sz);
    REQUIRE(b);
    CHECK(sz == 64, "size %zu", sz);
    CHECK(get_le(b + 48, 8) == 14695981039346656037ULL, "empty checksum is the FNV offset basis");
    free(b);
    anneal_shard *s = NULL;
    REQUIRE(anneal_shard_open(path, true, &s) == ANNEAL_OK);
    CHECK(s->info.n_tokens == 0 && s->info.eot == -1 && s->info.tokenizer_fingerprint == 7, "fields");
    anneal_shard_close(s);
}

TEST(foreign_and_missing_files) {
    const char *p = tpath("foreign.txt");
    const char *text = "Hello, world! This is plainly a text file and not a shard at all.\n";
    write_bytes(p, text, strlen(text));
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "not an anneal shard");
    unsigned char st[80] = {0x50, 0, 0, 0, 0, 0, 0, 0, '{', '"'}; /* a safetensors prefix */
    write_bytes(p, st, sizeof st);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "not an anneal shard (magic \"P\\x00");
    write_bytes(p, "", 0);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "not an anneal shard");
    write_bytes(p, "ANNL", 4);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "not an anneal shard");
    EXPECT_OPEN_ERROR(tpath("does_not_exist.bin"), ANNEAL_ERR_IO, "cannot open");
    EXPECT_OPEN_ERROR(tmpdir(), ANNEAL_ERR_IO, "not a regular file");
}

TEST(truncated_and_oversized) {
    uint32_t ids[100];
    for (int i = 0; i < 100; i++) ids[i] = (uint32_t)(i * 37 % 1000);
    size_t sz;
    unsigned char *b = build_shard((hdr_spec){1, 64, 2, 1000, 0, 999, 42}, ids, 100, &sz);
    const char *p = tpath("trunc.bin");
    write_bytes(p, b, sz);
    anneal_shard *s = NULL;
    REQUIRE(anneal_shard_open(p, true, &s) == ANNEAL_OK); /* the hand-made file is valid */
    CHECK(s->info.n_tokens == 100 && anneal_shard_token(s, 99) == ids[99], "hand-made contents");
    anneal_shard_close(s);
    size_t cuts[] = {8, 20, 63, 64, 65, 64 + 100, sz - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        write_bytes(p, b, cuts[k]);
        EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "truncated");
        if (cuts[k] >= 64) {
            char want[64];
            snprintf(want, sizeof want, "file has %zu bytes, header says %zu", cuts[k], sz);
            EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, want);
        }
    }
    unsigned char *big = calloc(1, sz + 3);
    memcpy(big, b, sz);
    write_bytes(p, big, sz + 3);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "oversized");
    free(big);
    free(b);
}

TEST(corrupted_tokens_and_header) {
    uint32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = (uint32_t)(i * 2); /* even ids: flipping bit 0 stays < vocab */
    size_t sz;
    unsigned char *b = build_shard((hdr_spec){1, 64, 2, 50257, 0, 50256, 99}, ids, 64, &sz);
    const char *p = tpath("corrupt.bin");
    b[64 + 2 * 17] ^= 1; /* token 17: 34 -> 35 */
    write_bytes(p, b, sz);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "corrupted");
    anneal_shard *s = NULL;
    CHECK(anneal_shard_open(p, false, &s) == ANNEAL_OK, "verify_checksum=false skips the checksum");
    if (s) CHECK(anneal_shard_token(s, 17) == 35, "the flipped id is visible");
    anneal_shard_close(s);
    b[64 + 2 * 17] ^= 1;
    int offsets[] = {20, 24, 32, 40, 47, 52, 56, 63}; /* vocab, eot, n_tokens, fp, checksum, header ck */
    for (size_t k = 0; k < sizeof offsets / sizeof offsets[0]; k++) {
        b[offsets[k]] ^= 0x10;
        write_bytes(p, b, sz);
        EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "header corrupted");
        b[offsets[k]] ^= 0x10;
    }
    write_bytes(p, b, sz);
    s = NULL;
    CHECK(anneal_shard_open(p, true, &s) == ANNEAL_OK, "restored file opens again");
    anneal_shard_close(s);
    free(b);
}

TEST(bad_header_fields) {
    uint32_t ids[4] = {1, 2, 3, 4};
    const char *p = tpath("fields.bin");
    struct {
        hdr_spec h;
        const char *what;
    } cases[] = {
        {{2, 64, 2, 1000, 0, -1, 0}, "unsupported shard version 2"},
        {{0, 64, 2, 1000, 0, -1, 0}, "unsupported shard version 0"},
        {{1, 128, 2, 1000, 0, -1, 0}, "bad header size 128"},
        {{1, 64, 4, 1000, 0, -1, 0}, "token_bytes 4 does not match vocab_size 1000"},
        {{1, 64, 2, 70000, 0, -1, 0}, "token_bytes 2 does not match vocab_size 70000"},
        {{1, 64, 3, 1000, 0, -1, 0}, "token_bytes 3"},
        {{1, 64, 2, 0, 0, -1, 0}, "vocab_size is 0"},
        {{1, 64, 2, 1000, 0, 1000, 0}, "eot id 1000 outside"},
        {{1, 64, 2, 1000, 0, -5, 0}, "eot id -5 outside"},
        {{1, 64, 2, 1000, 7, -1, 0}, "reserved header field is 7"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        size_t sz;
        unsigned char *b = build_shard(cases[k].h, ids, 4, &sz);
        write_bytes(p, b, sz);
        EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, cases[k].what);
        free(b);
    }
    /* n_tokens so large that size arithmetic would overflow. */
    size_t sz;
    unsigned char *b = build_shard((hdr_spec){1, 64, 4, 100000, 0, -1, 0}, ids, 4, &sz);
    put_le(b + 32, UINT64_MAX / 2, 8);
    reseal_header(b);
    write_bytes(p, b, sz);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "truncated");
    free(b);
}

TEST(id_out_of_vocab) {
    uint32_t ids[8] = {0, 5, 999, 1000, 3, 1001, 0, 0}; /* first bad id at index 3 */
    size_t sz;
    unsigned char *b = build_shard((hdr_spec){1, 64, 2, 1000, 0, -1, 0}, ids, 8, &sz);
    const char *p = tpath("oov.bin");
    write_bytes(p, b, sz);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "token id 1000 at index 3 is >= vocab_size 1000");
    anneal_shard *s = NULL; /* ids are checked even without the checksum */
    CHECK(anneal_shard_open(p, false, &s) == ANNEAL_ERR_FORMAT, "unchecked open must still reject");
    anneal_clear_error();
    free(b);
    uint32_t big[3] = {70000, 99999, 100000}; /* u32 shard */
    b = build_shard((hdr_spec){1, 64, 4, 100000, 0, -1, 0}, big, 3, &sz);
    write_bytes(p, b, sz);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "token id 100000 at index 2");
    free(b);
    /* A long u16 shard with the bad id deep inside (past the first scan block). */
    size_t n = 10000;
    uint32_t *many = calloc(n, sizeof *many);
    many[8191] = 4242;
    b = build_shard((hdr_spec){1, 64, 2, 4000, 0, -1, 0}, many, n, &sz);
    write_bytes(p, b, sz);
    EXPECT_OPEN_ERROR(p, ANNEAL_ERR_FORMAT, "token id 4242 at index 8191");
    free(b);
    free(many);
}

TEST(writer_rejects_bad_ids_and_args) {
    const char *p = tpath("bad_ids.bin");
    anneal_shard_writer *w = NULL;
    anneal_clear_error();
    CHECK(anneal_shard_writer_open(p, 0, -1, 0, &w) == ANNEAL_ERR_ARG && !w, "vocab 0");
    anneal_clear_error();
    CHECK(anneal_shard_writer_open(p, 100, 100, 0, &w) == ANNEAL_ERR_ARG && !w, "eot == vocab");
    anneal_clear_error();
    REQUIRE(anneal_shard_writer_open(p, 100, 99, 0, &w) == ANNEAL_OK);
    int32_t good[3] = {1, 2, 3}, bad[3] = {1, 100, 2}, neg[1] = {-1};
    CHECK(anneal_shard_writer_append(w, good, 3) == ANNEAL_OK, "good append");
    CHECK(anneal_shard_writer_append(w, bad, 3) == ANNEAL_ERR_ARG, "id == vocab rejected");
    CHECK(strstr(anneal_last_error(), "id 100 at index 1") != NULL, "message: %s", anneal_last_error());
    anneal_clear_error();
    CHECK(anneal_shard_writer_append(w, neg, 1) == ANNEAL_ERR_ARG, "negative id rejected");
    anneal_clear_error();
    REQUIRE(anneal_shard_writer_finish(w) == ANNEAL_OK); /* rejected appends wrote nothing */
    anneal_shard *s = NULL;
    REQUIRE(anneal_shard_open(p, true, &s) == ANNEAL_OK);
    CHECK(s->info.n_tokens == 3 && anneal_shard_token(s, 2) == 3, "only the good ids");
    anneal_shard_close(s);
    /* A destination directory that does not exist. */
    w = NULL;
    CHECK(anneal_shard_writer_open(tpath("no/such/dir.bin"), 100, -1, 0, &w) == ANNEAL_ERR_IO && !w,
          "missing directory is an IO error");
    anneal_clear_error();
}

TEST(writer_abort_keeps_target) {
    const char *p = tpath("target.bin");
    int32_t a[5] = {1, 2, 3, 4, 5};
    REQUIRE(write_with_writer(p, 1000, -1, 1, a, 5) == ANNEAL_OK);
    size_t n0 = 0;
    unsigned char *before = read_bytes(p, &n0);
    REQUIRE(before);

    anneal_shard_writer *w = NULL;
    REQUIRE(anneal_shard_writer_open(p, 1000, -1, 2, &w) == ANNEAL_OK);
    CHECK(count_temporaries() == 1, "the writer works in a temporary");
    int32_t *many = calloc(600000, sizeof *many); /* more than one buffer reaches the temporary */
    REQUIRE(anneal_shard_writer_append(w, many, 600000) == ANNEAL_OK);
    size_t n1 = 0;
    unsigned char *during = read_bytes(p, &n1);
    CHECK(n1 == n0 && during && !memcmp(before, during, n0), "target untouched while writing");
    free(during);
    anneal_shard_writer_abort(w);
    CHECK(count_temporaries() == 0, "abort removed the temporary");
    unsigned char *after = read_bytes(p, &n1);
    CHECK(after && n1 == n0 && !memcmp(before, after, n0), "abort left the target intact");
    free(after);

    /* finish replaces it. */
    REQUIRE(write_with_writer(p, 1000, -1, 3, many, 1234) == ANNEAL_OK);
    anneal_shard *s = NULL;
    REQUIRE(anneal_shard_open(p, true, &s) == ANNEAL_OK);
    CHECK(s->info.n_tokens == 1234 && s->info.tokenizer_fingerprint == 3, "replaced");
    anneal_shard_close(s);
    CHECK(count_temporaries() == 0, "no temporary after finish");
    free(many);
    free(before);
    anneal_shard_writer_abort(NULL);
    anneal_shard_close(NULL);
}

int main(void) {
    RUN(round_trip_u16);
    RUN(round_trip_u32);
    RUN(width_boundary);
    RUN(large_multi_buffer);
    RUN(zero_tokens);
    RUN(foreign_and_missing_files);
    RUN(truncated_and_oversized);
    RUN(corrupted_tokens_and_header);
    RUN(bad_header_fields);
    RUN(id_out_of_vocab);
    RUN(writer_rejects_bad_ids_and_args);
    RUN(writer_abort_keeps_target);
    int rc = anneal_test_summary();
    rm_dir(g_dir);
    return rc;
}
