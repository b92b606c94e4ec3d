/* Implementation of the minimal test harness in test.h. */
#include "test.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int anneal_test_failures, anneal_test_passed, anneal_test_failed, anneal_test_skipped;
const char *anneal_test_current = "";
bool anneal_test_was_skipped;

void anneal_test_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "  FAIL %s (%s:%d): ", anneal_test_current, file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    anneal_test_failures++;
}

void anneal_test_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("  SKIP %s: ", anneal_test_current);
    vprintf(fmt, ap);
    putchar('\n');
    va_end(ap);
    anneal_test_was_skipped = true;
}

void anneal_test_skip_promised(const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *strict = getenv("ANNEAL_TEST_STRICT");
    if (strict && strcmp(strict, "1") == 0)
        anneal_test_fail(__FILE__, __LINE__, "%s (ANNEAL_TEST_STRICT=1: make test promises it)", msg);
    else
        anneal_test_skip("%s", msg);
}

const char *anneal_test_python(const char *modules) {
    static char checked[8][256];
    static bool ok[8];
    static int n_checked;
    const char *py = getenv("ANNEAL_PYTHON");
    if (!py || !*py || access(py, X_OK) != 0) return NULL;
    for (int i = 0; i < n_checked; i++)
        if (strcmp(checked[i], modules) == 0) return ok[i] ? py : NULL;
    char cmd[1024], list[256];
    snprintf(list, sizeof list, "%s", modules);
    snprintf(cmd, sizeof cmd, "'%s' -c 'import %s' >/dev/null 2>&1", py, list);
    bool good = system(cmd) == 0;
    if (n_checked < 8) {
        snprintf(checked[n_checked], sizeof checked[0], "%s", modules);
        ok[n_checked++] = good;
    }
    return good ? py : NULL;
}

/* ANNEAL_TEST_ONLY=a,b,c (a developer's filter, never set by the suite): only the tests
 * named there run; the others are left out of the counts, as if absent. */
static bool selected(const char *name) {
    const char *only = getenv("ANNEAL_TEST_ONLY");
    if (!only || !*only) return true;
    size_t n = strlen(name);
    for (const char *p = only; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0) return true;
        p = e ? e + 1 : p + len;
    }
    return false;
}

void anneal_test_run(const char *name, void (*fn)(void)) {
    if (!selected(name)) return;
    anneal_test_current = name;
    anneal_test_failures = 0;
    anneal_test_was_skipped = false;
    fn();
    if (anneal_test_failures) {
        anneal_test_failed++;
        printf("  failed  %s\n", name);
    } else if (anneal_test_was_skipped) {
        anneal_test_skipped++;
    } else {
        anneal_test_passed++;
        printf("  ok      %s\n", name);
    }
    fflush(stdout);
}

int anneal_test_summary(void) {
    printf("%d passed, %d failed, %d skipped\n", anneal_test_passed, anneal_test_failed,
           anneal_test_skipped);
    fflush(stdout);
    /* 77: ctest's SKIP_RETURN_CODE (CMakeLists.txt), so a skip shows as "Skipped" there. */
    return anneal_test_failed ? 1 : anneal_test_skipped ? ANNEAL_TEST_SKIP_CODE : 0;
}

const char *anneal_test_path(const char *rel) {
    static char bufs[4][4096];
    static int next;
    const char *root = getenv("ANNEAL_SOURCE_DIR");
    char *b = bufs[next++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", root ? root : ".", rel);
    return b;
}

double anneal_test_close_ratio(const float *a, const float *b, int64_t n, double atol, double rtol,
                               int64_t *worst) {
    double w = 0;
    *worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double r = d / (atol + rtol * fabs((double)b[i]));
        if (isnan(a[i]) != isnan(b[i]) || isinf(a[i]) != isinf(b[i])) r = INFINITY;
        if (r > w || r != r) {
            w = r != r ? INFINITY : r;
            *worst = i;
        }
    }
    return w;
}

uint64_t anneal_test_rng_state;

uint64_t anneal_test_next_u64(void) {
    uint64_t z = (anneal_test_rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float anneal_test_urand(float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(anneal_test_next_u64() >> 40) / (double)(1ull << 24));
}

float *anneal_test_rand_buf(int64_t n, float lo, float hi) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    for (int64_t i = 0; p && i < n; i++) p[i] = anneal_test_urand(lo, hi);
    return p;
}

float *anneal_test_nan_buf(int64_t n) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    for (int64_t i = 0; p && i < n; i++) p[i] = NAN;
    return p;
}

bool anneal_test_sanitized(void) {
    const char *s = getenv("ANNEAL_TEST_SANITIZED");
    return s && s[0] == '1';
}
