/* Minimal test harness: every test file defines tests with TEST(name) and
 * lists them in main() through RUN(name). A failing CHECK records the failure
 * (file, line, message) and the test goes on, so one run shows every problem.
 *
 * Three outcomes, and which to use:
 * - a library call that fails is a failure (REQUIRE, CHECK, TEST_FAIL), never a skip;
 * - something `make test` sets up but is absent here (../shared, the Python clients,
 *   mpirun, ANNEAL_BIN outside ctest) is SKIP_PROMISED: a failure under
 *   ANNEAL_TEST_STRICT=1 (.ci/run), a skip otherwise;
 * - SKIP only for what this machine lacks and no setup can give it (an ISA, root,
 *   the sanitized build's time budget), saying what.
 * main() ends with `return anneal_test_summary();`: exit 1 when a test failed, 77
 * (ctest's SKIP_RETURN_CODE, set for every test in CMakeLists.txt) when none failed and
 * any skipped, so ctest lists it as "Skipped" instead of "Passed". */
#ifndef ANNEAL_TEST_H
#define ANNEAL_TEST_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern int anneal_test_failures;   /* failures in the current test */
extern int anneal_test_passed, anneal_test_failed, anneal_test_skipped;
extern const char *anneal_test_current;

void anneal_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void anneal_test_run(const char *name, void (*fn)(void));
/* Prints the counts; returns 1 if any test failed, else ANNEAL_TEST_SKIP_CODE if any
 * skipped, else 0. */
int anneal_test_summary(void);
#define ANNEAL_TEST_SKIP_CODE 77
/* Marks the current test skipped with a reason printed to stdout. */
void anneal_test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern bool anneal_test_was_skipped;
/* Marks the current test skipped for lack of something `make test` promises to set up
 * (../shared beside the checkout, the Python clients of scripts/pyenv.sh, mpirun):
 * a failure instead when ANNEAL_TEST_STRICT=1 (CI), a skip otherwise. */
void anneal_test_skip_promised(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The Python of scripts/pyenv.sh (ANNEAL_PYTHON) if it imports every module of the
 * comma-separated list (checked once per list), else NULL: callers skip with
 * SKIP_PROMISED("... needs the Python clients (make test sets them up)"). */
const char *anneal_test_python(const char *modules);
/* Path of a file in the source tree (ANNEAL_SOURCE_DIR or "."); static buffer rotation of 4. */
const char *anneal_test_path(const char *rel);
/* True in the ASan/UBSan build (ANNEAL_TEST_SANITIZED=1), where code runs ~10x slower:
 * long tests shrink their sizes there (saying so), never their tolerances. */
bool anneal_test_sanitized(void);
/* Largest |a-b| / (atol + rtol*|b|) over n floats; <= 1 means close. Reports the worst index. */
double anneal_test_close_ratio(const float *a, const float *b, int64_t n, double atol, double rtol,
                               int64_t *worst);

/* Test random numbers: splitmix64 over a global state tests seed by assignment. */
extern uint64_t anneal_test_rng_state;
uint64_t anneal_test_next_u64(void);
/* Uniform in [lo, hi) (24-bit resolution). */
float anneal_test_urand(float lo, float hi);
/* malloc'd buffers (at least 1 element): uniform values, or NaN (to check "overwrites"). */
float *anneal_test_rand_buf(int64_t n, float lo, float hi);
float *anneal_test_nan_buf(int64_t n);

#define TEST(name) static void name(void)
#define RUN(name) anneal_test_run(#name, name)
#define SKIP(...) do { anneal_test_skip(__VA_ARGS__); return; } while (0)
#define SKIP_PROMISED(...) do { anneal_test_skip_promised(__VA_ARGS__); return; } while (0)
/* Records a failure with the message and ends the test (a setup step that failed). */
#define TEST_FAIL(...) do { anneal_test_fail(__FILE__, __LINE__, __VA_ARGS__); return; } while (0)

#define CHECK(cond, ...) do { if (!(cond)) { \
    anneal_test_fail(__FILE__, __LINE__, "CHECK(%s) failed", #cond); \
    anneal_test_fail(__FILE__, __LINE__, __VA_ARGS__); } } while (0)
#define CHECK_TRUE(cond) do { if (!(cond)) \
    anneal_test_fail(__FILE__, __LINE__, "CHECK(%s) failed", #cond); } while (0)
#define REQUIRE(cond) do { if (!(cond)) { \
    anneal_test_fail(__FILE__, __LINE__, "REQUIRE(%s) failed", #cond); return; } } while (0)
#define CHECK_NEAR(a, b, tol) do { double _a = (a), _b = (b); \
    if (!(fabs(_a - _b) <= (tol)) ) anneal_test_fail(__FILE__, __LINE__, \
        "CHECK_NEAR(%s, %s): %.9g vs %.9g (tol %.3g)", #a, #b, _a, _b, (double)(tol)); } while (0)
/* Elementwise closeness of two float arrays: |a-b| <= atol + rtol*|b|. */
#define CHECK_ALLCLOSE(a, b, n, atol, rtol) do { int64_t _w = 0; \
    double _r = anneal_test_close_ratio((a), (b), (n), (atol), (rtol), &_w); \
    if (!(_r <= 1.0)) anneal_test_fail(__FILE__, __LINE__, \
        "CHECK_ALLCLOSE(%s, %s): worst index %lld: %.9g vs %.9g (atol %.2g rtol %.2g)", \
        #a, #b, (long long)_w, (double)(a)[_w], (double)(b)[_w], (double)(atol), (double)(rtol)); \
    } while (0)

#endif
