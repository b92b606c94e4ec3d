/* The checked parsers of include/anneal/parse.h (JSON documents, decimal numbers) and
 * the stale-temporary helpers of fs.h: what each accepts, what each refuses and what
 * the message says. */
#include "anneal/fs.h"
#include "anneal/parse.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* Parses text; expects failure whose message has `want` (NULL: expects success). */
static void expect_json(const char *text, const char *want) {
    cJSON *j = (cJSON *)1;
    anneal_clear_error();
    anneal_status st = anneal_json_parse(text, strlen(text), "t.json", &j);
    if (!want) {
        CHECK(st == ANNEAL_OK && j, "%s: %s", text, anneal_last_error());
    } else {
        CHECK(st == ANNEAL_ERR_FORMAT && !j && strstr(anneal_last_error(), want) && strstr(anneal_last_error(), "t.json"),
              "%s: status %d, message '%s' (want '%s')", text, (int)st, anneal_last_error(), want);
    }
    cJSON_Delete(st == ANNEAL_OK ? j : NULL);
    anneal_clear_error();
}

TEST(json_documents) {
    expect_json("{\"a\": 1, \"b\": [1, {\"c\": 2, \"d\": 3}]}  \n", NULL);
    expect_json("[1, 2]", NULL);
    expect_json("{\"a\": 1, \"a\": 2}", "duplicate key \"a\"");
    expect_json("{\"x\": {\"k\": 1, \"j\": 0, \"k\": 2}}", "duplicate key \"k\"");        /* nested */
    expect_json("[{\"q\": 1}, {\"q\": 1, \"r\": 2, \"q\": 3}]", "duplicate key \"q\""); /* in an array */
    expect_json("{\"a\": 1, \"\\u0061\": 2}", "duplicate key \"a\"");                     /* the same key, escaped */
    expect_json("{\"a\": {\"b\": 1}, \"b\": {\"a\": 1}}", NULL);                           /* same names, other objects */
    expect_json("{\"lr\\u0000garbage\": 0.5}", "contains \\u0000");
    expect_json("{\"x\": {\"lr\\u0000\" : 1}}", "\"lr\\u0000\"");
    expect_json("{\"s\": \"a\\u0000b\"}", NULL);      /* a value may hold it: only keys are matched */
    expect_json("{\"a\\\\u0000\": 1}", NULL);          /* an escaped backslash, then the text u0000 */
    expect_json("{\"a\": 1} x", "unexpected text after the JSON document at line 1, column 10");
    expect_json("{\"a\": 1}{}", "after the JSON document");
    expect_json("", "empty");
    expect_json("   \n ", "empty");
    expect_json("{\"a\":\n 1,", "line 2");
    expect_json("{\"a\": 1,", "truncated");
    expect_json("{\"a\": tru}", "invalid JSON at line 1");
    /* many keys (a tokenizer's vocabulary): sorted, not quadratic */
    size_t n = 60000, cap = n * 16 + 16, k = 0;
    char *big = malloc(cap);
    REQUIRE(big);
    big[k++] = '{';
    for (size_t i = 0; i < n; i++) k += (size_t)snprintf(big + k, cap - k, "%s\"t%zu\":%zu", i ? "," : "", i, i);
    big[k++] = '}';
    big[k] = '\0';
    cJSON *j = NULL;
    CHECK(anneal_json_parse(big, k, "big", &j) == ANNEAL_OK, "%s", anneal_last_error());
    cJSON_Delete(j);
    k -= 1;
    k += (size_t)snprintf(big + k, cap - k, ",\"t59999\":1}");
    CHECK(anneal_json_parse(big, k, "big", &j) == ANNEAL_ERR_FORMAT && strstr(anneal_last_error(), "\"t59999\""), "%s",
          anneal_last_error());
    anneal_clear_error();
    free(big);
}

TEST(json_files) {
    char dir[] = "/tmp/anneal_parse_XXXXXX";
    REQUIRE(mkdtemp(dir));
    char p[128];
    cJSON *j = NULL;
    snprintf(p, sizeof p, "%s/missing.json", dir);
    CHECK(anneal_json_read_file(p, 1 << 20, &j) == ANNEAL_ERR_IO && strstr(anneal_last_error(), "No such file") &&
              strstr(anneal_last_error(), p),
          "%s", anneal_last_error());
    anneal_clear_error();
    CHECK(anneal_json_read_file(dir, 1 << 20, &j) == ANNEAL_ERR_IO && strstr(anneal_last_error(), "is a directory"), "%s",
          anneal_last_error());
    anneal_clear_error();
    snprintf(p, sizeof p, "%s/a.json", dir);
    FILE *f = fopen(p, "w");
    REQUIRE(f);
    fputs("{\"k\": [1, 2, 3]}\n", f);
    fclose(f);
    CHECK(anneal_json_read_file(p, 1 << 20, &j) == ANNEAL_OK && cJSON_IsObject(j), "%s", anneal_last_error());
    cJSON_Delete(j);
    CHECK(anneal_json_read_file(p, 8, &j) == ANNEAL_ERR_IO && !j && strstr(anneal_last_error(), "more than"), "%s",
          anneal_last_error());
    anneal_clear_error();
    char *text = NULL;
    size_t len = 0;
    CHECK(anneal_read_text_file(p, 1 << 20, &text, &len) == ANNEAL_OK && len == 17 && text[len] == '\0', "%zu", len);
    free(text);
    unlink(p);
    rmdir(dir);
}

TEST(decimal_numbers) {
    static const struct { const char *s; anneal_number_parse want; int64_t v; } ints[] = {
        {"0", ANNEAL_NUMBER_OK, 0}, {"17", ANNEAL_NUMBER_OK, 17}, {"-3", ANNEAL_NUMBER_OK, -3}, {"+5", ANNEAL_NUMBER_OK, 5},
        {"9223372036854775807", ANNEAL_NUMBER_OK, INT64_MAX}, {"99999999999999999999", ANNEAL_NUMBER_RANGE, 0},
        {"-99999999999999999999", ANNEAL_NUMBER_RANGE, 0}, {"0x10", ANNEAL_NUMBER_MALFORMED, 0},
        {"010", ANNEAL_NUMBER_MALFORMED, 0}, {"", ANNEAL_NUMBER_MALFORMED, 0}, {" 1", ANNEAL_NUMBER_MALFORMED, 0},
        {"1 ", ANNEAL_NUMBER_MALFORMED, 0}, {"1e3", ANNEAL_NUMBER_MALFORMED, 0}, {"-", ANNEAL_NUMBER_MALFORMED, 0},
        {"1.0", ANNEAL_NUMBER_MALFORMED, 0},
    };
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) {
        int64_t v = -12345;
        anneal_number_parse r = anneal_parse_decimal_i64(ints[i].s, &v);
        CHECK(r == ints[i].want && (r != ANNEAL_NUMBER_OK || v == ints[i].v), "'%s': %d (%lld)", ints[i].s, (int)r,
              (long long)v);
    }
    static const struct { const char *s; anneal_number_parse want; double v; } fl[] = {
        {"1e-3", ANNEAL_NUMBER_OK, 1e-3}, {"0.5", ANNEAL_NUMBER_OK, 0.5}, {".5", ANNEAL_NUMBER_OK, 0.5},
        {"5.", ANNEAL_NUMBER_OK, 5.0}, {"-2E+2", ANNEAL_NUMBER_OK, -200.0}, {"3", ANNEAL_NUMBER_OK, 3.0},
        {"0", ANNEAL_NUMBER_OK, 0.0}, {"4.9e-320", ANNEAL_NUMBER_OK, 4.9e-320}, {"0e999", ANNEAL_NUMBER_OK, 0.0},
        {"1e999", ANNEAL_NUMBER_RANGE, 0}, {"-1e999", ANNEAL_NUMBER_RANGE, 0}, {"1e-999", ANNEAL_NUMBER_RANGE, 0},
        {"0x10", ANNEAL_NUMBER_MALFORMED, 0}, {"0x1p3", ANNEAL_NUMBER_MALFORMED, 0}, {"inf", ANNEAL_NUMBER_MALFORMED, 0},
        {"-infinity", ANNEAL_NUMBER_MALFORMED, 0}, {"nan", ANNEAL_NUMBER_MALFORMED, 0}, {"NAN", ANNEAL_NUMBER_MALFORMED, 0},
        {"010", ANNEAL_NUMBER_MALFORMED, 0}, {".", ANNEAL_NUMBER_MALFORMED, 0}, {"1e", ANNEAL_NUMBER_MALFORMED, 0},
        {"1e+", ANNEAL_NUMBER_MALFORMED, 0}, {"", ANNEAL_NUMBER_MALFORMED, 0}, {" 1", ANNEAL_NUMBER_MALFORMED, 0},
        {"1,5", ANNEAL_NUMBER_MALFORMED, 0},
    };
    for (size_t i = 0; i < sizeof fl / sizeof *fl; i++) {
        double v = -12345;
        anneal_number_parse r = anneal_parse_decimal_f64(fl[i].s, &v);
        CHECK(r == fl[i].want && (r != ANNEAL_NUMBER_OK || v == fl[i].v), "'%s': %d (%g)", fl[i].s, (int)r, v);
    }
}

static bool prepare_like(const char *base, size_t n) { return n == 16 && !strncmp(base, "train_000001.bin", 16); }

TEST(stale_temporaries) {
    size_t bl = 0;
    long pid = 0;
    CHECK_TRUE(anneal_tmp_name_parse("train_000001.bin.tmp.4242", &bl, &pid) && bl == 16 && pid == 4242);
    CHECK_TRUE(anneal_tmp_name_parse("a.tmp.b.tmp.7", &bl, &pid) && bl == 7 && pid == 7);
    CHECK_TRUE(!anneal_tmp_name_parse("x.tmp.", &bl, &pid) && !anneal_tmp_name_parse("x.tmp.0", &bl, &pid) &&
               !anneal_tmp_name_parse("x.tmp.012", &bl, &pid) && !anneal_tmp_name_parse("x.tmp.12a", &bl, &pid) &&
               !anneal_tmp_name_parse(".tmp.12", &bl, &pid) && !anneal_tmp_name_parse("x.tmp.1234567890", &bl, &pid));
    CHECK_TRUE(!anneal_pid_is_dead((long)getpid()) && !anneal_pid_is_dead(1) && !anneal_pid_is_dead(0));
    pid_t child = fork();
    if (child == 0) _exit(0);
    REQUIRE(child > 0);
    waitpid(child, NULL, 0);
    CHECK_TRUE(anneal_pid_is_dead((long)child));
    char dir[] = "/tmp/anneal_stale_XXXXXX";
    REQUIRE(mkdtemp(dir));
    char dead[128], live[128], other[128], sub[128];
    snprintf(dead, sizeof dead, "%s/train_000001.bin.tmp.%d", dir, (int)child);
    snprintf(live, sizeof live, "%s/train_000001.bin.tmp.%d", dir, (int)getpid());
    snprintf(other, sizeof other, "%s/train_000002.bin.tmp.%d", dir, (int)child);
    snprintf(sub, sizeof sub, "%s/d", dir);
    FILE *f;
    const char *files[] = {dead, live, other};
    for (int i = 0; i < 3; i++) {
        REQUIRE((f = fopen(files[i], "w")));
        fclose(f);
    }
    CHECK(anneal_remove_stale_tmp_files(dir, prepare_like) == 1, "removed count");
    CHECK_TRUE(access(dead, F_OK) != 0 && access(live, F_OK) == 0 && access(other, F_OK) == 0);
    CHECK_TRUE(anneal_remove_stale_tmp_files("/nonexistent/dir", prepare_like) == 0);
    unlink(live);
    unlink(other);
    rmdir(dir);
}

TEST(interrupt_requests) {
    anneal_interrupt_reset();
    CHECK_TRUE(anneal_interrupt_pending() == 0 && anneal_interrupt_check("x") == ANNEAL_OK);
    anneal_interrupt_request(15);
    CHECK(anneal_interrupt_check("building it") == ANNEAL_ERR_INTERRUPTED &&
              strstr(anneal_last_error(), "interrupted by SIGTERM while building it"),
          "%s", anneal_last_error());
    anneal_clear_error();
    anneal_interrupt_hold(true);
    CHECK_TRUE(anneal_interrupt_check("held") == ANNEAL_OK && anneal_interrupt_pending() == 15);
    anneal_interrupt_hold(false);
    CHECK_TRUE(anneal_interrupt_check("released") == ANNEAL_ERR_INTERRUPTED);
    anneal_clear_error();
    anneal_interrupt_reset();
    anneal_interrupt_request(0);
    CHECK_TRUE(anneal_interrupt_pending() == -1);
    anneal_interrupt_reset();
}

int main(void) {
    RUN(json_documents);
    RUN(json_files);
    RUN(decimal_numbers);
    RUN(stale_temporaries);
    RUN(interrupt_requests);
    return anneal_test_summary();
}
