/* `anneal bench peak` and the training benchmark driver bench/bench_train.py, end to
 * end through the built binary (ANNEAL_BIN, set by ctest). No timing is asserted: the
 * peak must be a positive finite number with a named kernel, bad flags are usage
 * errors, and the driver's quick run on the tiny preset (without PyTorch) must print
 * its documented, well-formed tables. The driver needs python3 (standard library
 * only); where there is none, that test is skipped. */
#include "test.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static char buf[1 << 16];

/* Runs cmd (through the shell) capturing stdout+stderr into out; returns the exit code. */
static int sh(const char *cmd, char *out, size_t cap) {
    static char full[8192];
    snprintf(full, sizeof full, "%.8000s 2>&1", cmd);
    FILE *f = popen(full, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(bench_peak_reports_both_dtypes) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *dts[] = {"fp32", "bf16"};
    for (int i = 0; i < 2; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "'%s' bench peak --dtype %s --threads 2 --seconds 0.05 --json", bin, dts[i]);
        int rc = sh(cmd, buf, sizeof buf);
        CHECK(rc == 0, "exit %d: %s", rc, buf);
        cJSON *o = cJSON_Parse(buf);
        REQUIRE(o != NULL);
        double gf = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "gflops"));
        const char *dt = cJSON_GetStringValue(cJSON_GetObjectItem(o, "dtype"));
        const char *isa = cJSON_GetStringValue(cJSON_GetObjectItem(o, "isa"));
        CHECK(gf > 0 && isfinite(gf), "%s: gflops %g", dts[i], gf);
        CHECK(dt && !strcmp(dt, dts[i]), "%s", buf);
        CHECK(isa && strstr(isa, "microbenchmark"), "%s", buf);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "threads")) == 2, "%s", buf);
        cJSON_Delete(o);
    }
    /* the plain form: one line */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' bench peak --seconds 0.05 --threads 1", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 0 && !strncmp(buf, "peak fp32 ", 10) && strstr(buf, " GFLOP/s ("), "%s", buf);
    /* the ceiling of what may run: under ANNEAL_ISA=portable the scalar kernel, for bf16 too */
    snprintf(cmd, sizeof cmd, "ANNEAL_ISA=portable '%s' bench peak --dtype bf16 --seconds 0.05 --threads 1", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 0 && strstr(buf, "scalar") != NULL, "ANNEAL_ISA=portable: %s", buf);
}

TEST(bench_bad_flags_are_usage_errors) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' bench peak --dtype fp8", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "--dtype fp8"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' bench peak --seconds 0", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "--seconds"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' bench step --dtype fp8", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "--dtype fp8"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' bench nosuch", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "nosuch"), "%s", buf);
}

/* `anneal bench step --dtype`: the model's products run at that precision (the line names
 * the model's compute dtype, read back from the model). */
TEST(bench_step_takes_the_dtype) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *dts[] = {"fp32", "bf16"}, *names[] = {"f32 products", "bf16 products"};
    for (int i = 0; i < 2; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "'%s' bench step --model tiny --batch 2 --seq 16 --steps 1 --warmup 0 --dtype %s", bin,
                 dts[i]);
        int rc = sh(cmd, buf, sizeof buf);
        CHECK(rc == 0 && !strncmp(buf, "step ", 5) && strstr(buf, names[i]), "--dtype %s: exit %d: %s", dts[i], rc, buf);
    }
}

/* The line of out starting with prefix (NULL if none); copies it into line. */
static const char *find_line(const char *out, const char *prefix, char *line, size_t cap) {
    for (const char *p = out; p && *p;) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (!strncmp(p, prefix, strlen(prefix))) {
            snprintf(line, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
            return line;
        }
        p = e ? e + 1 : NULL;
    }
    return NULL;
}

TEST(bench_train_driver_quick_run_is_well_formed) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    if (sh("command -v python3", buf, sizeof buf) != 0) SKIP_PROMISED("no python3 for bench/bench_train.py (bootstrap installs python3)");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "python3 '%s' --quick --configs tiny --torch off --torch2 off --recompute auto --peak-seconds 0.05 "
             "--anneal '%s'",
             anneal_test_path("bench/bench_train.py"), bin);
    int rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    /* header lines: what ran and the PyTorch environment note */
    CHECK(strstr(buf, "unset for the PyTorch processes only") && strstr(buf, "PyTorch (Debian): off"), "%s", buf);
    CHECK(strstr(buf, "### tiny: L=2 H=4 C=64 V=512, B=8 T=64") && strstr(buf, "6N+12LTC"), "%s", buf);
    /* the results table: header, separator, and an anneal fp32 row of 9 cells with
     * numbers (median, range lo-hi, CPU ms, parallel fraction on 2 threads, tok/s, MFU %,
     * RSS) */
    CHECK(strstr(buf, "| variant | ms/step median | range | CPU ms/step | parallel | tok/s | MFU | peak RSS | samples |\n"
                      "|---|---|---|---|---|---|---|---|---|"),
          "%s", buf);
    char line[512];
    REQUIRE(find_line(buf, "| anneal fp32 |", line, sizeof line));
    double med, lo, hi, cpu, par, tok, mfu;
    char rss_unit[8];
    double rss;
    int n = sscanf(line, "| anneal fp32 | %lf | %lf-%lf | %lf | %lf | %lf | %lf%% of fp32 | %lf %3s |", &med, &lo, &hi,
                   &cpu, &par, &tok, &mfu, &rss, rss_unit);
    CHECK(n == 9, "row not parsed (%d fields): %s", n, line);
    if (n == 9) {
        CHECK(med > 0 && lo <= med && med <= hi && cpu > 0 && par >= 0 && par <= 1 && tok > 0 && mfu > 0 && rss > 0, "%s",
              line);
        CHECK(!strcmp(rss_unit, "MiB") || !strcmp(rss_unit, "GiB"), "%s", line);
    }
    CHECK(find_line(buf, "| anneal bf16 |", line, sizeof line) != NULL, "%s", buf);
    CHECK(strstr(buf, "### Goals of issue 5"), "%s", buf);
    /* a recompute table when anneal train has --recompute (it has, in some form) */
    CHECK(strstr(buf, "### Recompute (tiny") && strstr(buf, "| --recompute | ms/step median |"), "%s", buf);
}

int main(void) {
    RUN(bench_peak_reports_both_dtypes);
    RUN(bench_bad_flags_are_usage_errors);
    RUN(bench_step_takes_the_dtype);
    RUN(bench_train_driver_quick_run_is_well_formed);
    return anneal_test_summary();
}
