/* obs: JSON-lines logs append whole lines across reopenings, the progress line
 * (live with '\r' on terminals, every N steps otherwise), formatting helpers, UTF-8
 * repair of generated text, and the FMA peak measurement. */
#include "anneal/obs.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmpdir[256];

static const char *tmp_path(const char *name) {
    static char buf[4][512];
    static int k;
    if (!tmpdir[0]) {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_test_obs_XXXXXX");
        if (!mkdtemp(tmpdir)) return NULL;
    }
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmpdir, name);
    return buf[k];
}

/* Reads a whole file into a static buffer. */
static const char *slurp(const char *path) {
    static char buf[1 << 16];
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

TEST(jsonl_appends_lines) {
    const char *p = tmp_path("log.jsonl");
    unlink(p);
    anneal_jsonl *l = NULL;
    REQUIRE(anneal_jsonl_open(p, &l) == ANNEAL_OK);
    CHECK_TRUE(anneal_jsonl_write(l, "{\"step\":1}") == ANNEAL_OK);
    CHECK_TRUE(anneal_jsonl_write(l, "{\"step\":2}") == ANNEAL_OK);
    /* visible before close: flushed per line */
    CHECK(!strcmp(slurp(p), "{\"step\":1}\n{\"step\":2}\n"), "got '%s'", slurp(p));
    anneal_jsonl_close(l);
    REQUIRE(anneal_jsonl_open(p, &l) == ANNEAL_OK); /* a resume appends */
    CHECK_TRUE(anneal_jsonl_write(l, "{\"step\":3}") == ANNEAL_OK);
    anneal_jsonl_close(l);
    const char *s = slurp(p);
    CHECK(!strcmp(s, "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n"), "got '%s'", s);
    /* an unwritable path is an error naming it */
    anneal_clear_error();
    CHECK_TRUE(anneal_jsonl_open("/nonexistent-dir/x/log.jsonl", &l) == ANNEAL_ERR_IO);
    CHECK(strstr(anneal_last_error(), "/nonexistent-dir/x/log.jsonl") != NULL, "%s", anneal_last_error());
    anneal_clear_error();
    unlink(p);
}

TEST(progress_lines) {
    anneal_step_stats s = {.step = 12, .total = 100, .loss = 4.12345, .lr = 6e-4, .grad_norm = 0.8125,
                           .tokens_per_s = 12345, .mfu = 0.234, .ms = 81.5, .eta_s = 72};
    char line[256];
    anneal_progress_format(&s, line, sizeof line);
    CHECK(strstr(line, "step    12/100") && strstr(line, "loss 4.1235") && strstr(line, "lr 6.00e-04") &&
              strstr(line, "norm 0.812") && strstr(line, "12.3k tok/s") && strstr(line, "MFU 23.4%") &&
              strstr(line, "81.5 ms") && strstr(line, "ETA 1m12s"),
          "line: %s", line);
    s.mfu = NAN;
    s.skipped = true;
    anneal_progress_format(&s, line, sizeof line);
    CHECK(!strstr(line, "MFU") && strstr(line, "skipped"), "line: %s", line);
    /* truncation is safe */
    char small[16];
    size_t n = anneal_progress_format(&s, small, sizeof small);
    CHECK_TRUE(n < sizeof small && strlen(small) == n);

    /* plain mode: every 5th step, the first, the last; notes are lines of their own */
    const char *p = tmp_path("progress.txt");
    FILE *f = fopen(p, "w");
    REQUIRE(f != NULL);
    anneal_progress *pr = anneal_progress_new(f, false, 5);
    s.skipped = false;
    s.total = 10;
    for (int i = 1; i <= 10; i++) {
        s.step = i;
        anneal_progress_step(pr, &s);
        if (i == 3) anneal_progress_note(pr, "note %d", i);
    }
    anneal_progress_free(pr);
    fclose(f);
    const char *out = slurp(p);
    int lines = 0;
    for (const char *q = out; *q; q++) lines += *q == '\n';
    CHECK(lines == 4 && strstr(out, "step     1/10") && strstr(out, "step     5/10") && strstr(out, "step    10/10") &&
              strstr(out, "note 3\n") && !strchr(out, '\r'),
          "plain output:\n%s", out);

    /* live mode: '\r' + erase, a note ends the line first */
    f = fopen(p, "w");
    REQUIRE(f != NULL);
    pr = anneal_progress_new(f, true, 1);
    s.step = 1;
    anneal_progress_step(pr, &s);
    s.step = 2;
    anneal_progress_step(pr, &s);
    anneal_progress_note(pr, "val");
    anneal_progress_free(pr);
    fclose(f);
    out = slurp(p);
    CHECK(out[0] == '\r' && strstr(out, "\033[K\rstep") && strstr(out, "\033[K\nval\n"), "live output: %s", out);
    unlink(p);
}

TEST(formatting) {
    char b[32];
    CHECK(!strcmp(anneal_format_duration(45.24, b, sizeof b), "45.2s"), "%s", b);
    CHECK(!strcmp(anneal_format_duration(185, b, sizeof b), "3m05s"), "%s", b);
    CHECK(!strcmp(anneal_format_duration(7620, b, sizeof b), "2h07m"), "%s", b);
    CHECK(!strcmp(anneal_format_duration(NAN, b, sizeof b), "?"), "%s", b);
    CHECK(!strcmp(anneal_format_count(512, b, sizeof b), "512"), "%s", b);
    CHECK(!strcmp(anneal_format_count(12345, b, sizeof b), "12.3k"), "%s", b);
    CHECK(!strcmp(anneal_format_count(4.56e6, b, sizeof b), "4.56M"), "%s", b);
    CHECK(!strcmp(anneal_format_count(7.891e9, b, sizeof b), "7.89G"), "%s", b);
}

TEST(utf8_repair) {
    char out[64];
    const char ok[] = "In the beginning \xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";
    size_t n = anneal_utf8_sanitize(ok, strlen(ok), out, sizeof out);
    CHECK_TRUE(n == strlen(ok) && !strcmp(out, ok));
    /* a lone continuation byte, a truncated 3-byte char at the end, an overlong form, a surrogate */
    const char bad[] = "a\x80" "b\xC0\xAF" "c\xED\xA0\x80" "d\xE2\x82";
    n = anneal_utf8_sanitize(bad, strlen(bad), out, sizeof out);
    CHECK(strstr(out, "a\xEF\xBF\xBD" "b") && strstr(out, "d\xEF\xBF\xBD") && n == strlen(out), "got %s", out);
    /* the result is valid JSON string content */
    cJSON *s = cJSON_CreateString(out);
    char *js = cJSON_PrintUnformatted(s);
    cJSON *back = cJSON_Parse(js);
    CHECK_TRUE(back && !strcmp(back->valuestring, out));
    cJSON_Delete(back);
    cJSON_Delete(s);
    free(js);
    /* never overflows */
    char tiny[4];
    n = anneal_utf8_sanitize("\xE2\x82\xAC\xE2\x82\xAC", 6, tiny, sizeof tiny);
    CHECK_TRUE(n == 3 && strlen(tiny) == 3);
}

TEST(peak_flops) {
    const char *isa = NULL;
    double g = anneal_peak_gflops_measure(1, 0.01, &isa);
    /* any working FMA loop on any CPU does far more than 0.1 GFLOP/s and far less than 10 TFLOP/s per thread */
    CHECK(g > 0.1 && g < 1e4, "peak %g GFLOP/s", g);
    CHECK_TRUE(isa && strlen(isa) > 0);
    CHECK_TRUE(anneal_peak_rss_bytes() > 0);
}

/* Amdahl's p from wall and CPU time: the ends, known middles, clamping, the undefined
 * cases; and the process CPU clock counts a busy loop. */
TEST(parallel_fraction) {
    CHECK_NEAR(anneal_parallel_fraction(1.0, 2.0, 2), 1.0, 1e-12);
    CHECK_NEAR(anneal_parallel_fraction(1.0, 1.0, 2), 0.0, 1e-12);
    CHECK_NEAR(anneal_parallel_fraction(0.75, 1.0, 2), 0.5, 1e-12);
    CHECK_NEAR(anneal_parallel_fraction(1.5, 10.0, 16), 0.85 / 0.9375, 1e-12);
    CHECK_NEAR(anneal_parallel_fraction(2.0, 1.0, 4), 0.0, 1e-12);  /* CPU below wall: all serial */
    CHECK_NEAR(anneal_parallel_fraction(1.0, 40.0, 16), 1.0, 1e-12); /* above T x wall: spinning */
    CHECK(anneal_parallel_fraction(1.0, 1.0, 1) < 0, "one thread has no parallel fraction");
    CHECK(anneal_parallel_fraction(0.0, 1.0, 2) < 0 && anneal_parallel_fraction(1.0, 0.0, 2) < 0, "zero times");
    const double c0 = anneal_process_cpu_seconds();
    volatile double x = 0;
    for (long i = 0; i < 20000000; i++) x += (double)i * 1e-9;
    const double c1 = anneal_process_cpu_seconds();
    CHECK(c0 >= 0 && c1 > c0 && x > 0, "CPU clock %g -> %g over a busy loop", c0, c1);
}

int main(void) {
    RUN(jsonl_appends_lines);
    RUN(progress_lines);
    RUN(formatting);
    RUN(utf8_repair);
    RUN(peak_flops);
    RUN(parallel_fraction);
    if (tmpdir[0]) rmdir(tmpdir);
    return anneal_test_summary();
}
