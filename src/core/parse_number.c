/* Decimal numbers of flags and settings: what strtoll/strtod accept beyond plain
 * decimals (0x10, inf, nan, leading spaces) is refused before they are called, and a
 * range problem is told apart from a malformed number. */
#include "anneal/parse.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* Skips digits from p; the count in *n. */
static const char *digits(const char *p, int *n) {
    *n = 0;
    while (is_digit(*p)) p++, (*n)++;
    return p;
}

anneal_number_parse anneal_parse_decimal_i64(const char *s, int64_t *out) {
    if (!s) return ANNEAL_NUMBER_MALFORMED;
    const char *p = s;
    if (*p == '+' || *p == '-') p++;
    int n;
    const char *e = digits(p, &n);
    if (n == 0 || *e) return ANNEAL_NUMBER_MALFORMED;
    if (p[0] == '0' && n > 1) return ANNEAL_NUMBER_MALFORMED; /* 010: octal to C, ten to a person */
    errno = 0;
    char *end = NULL;
    long long x = strtoll(s, &end, 10);
    if (errno == ERANGE) return ANNEAL_NUMBER_RANGE;
    if (errno || *end) return ANNEAL_NUMBER_MALFORMED;
    *out = (int64_t)x;
    return ANNEAL_NUMBER_OK;
}

anneal_number_parse anneal_parse_decimal_f64(const char *s, double *out) {
    if (!s) return ANNEAL_NUMBER_MALFORMED;
    const char *p = s;
    if (*p == '+' || *p == '-') p++;
    int ni, nf = 0, ne;
    const char *q = digits(p, &ni);
    if (ni > 1 && p[0] == '0') return ANNEAL_NUMBER_MALFORMED;
    if (*q == '.') q = digits(q + 1, &nf);
    if (ni + nf == 0) return ANNEAL_NUMBER_MALFORMED;
    bool nonzero = false;
    for (const char *r = p; r < q; r++) nonzero |= *r >= '1' && *r <= '9';
    if (*q == 'e' || *q == 'E') {
        q++;
        if (*q == '+' || *q == '-') q++;
        q = digits(q, &ne);
        if (ne == 0) return ANNEAL_NUMBER_MALFORMED;
    }
    if (*q) return ANNEAL_NUMBER_MALFORMED;
    errno = 0;
    char *end = NULL;
    double x = strtod(s, &end);
    if (*end) return ANNEAL_NUMBER_MALFORMED;
    if (!isfinite(x) || (errno == ERANGE && (fabs(x) > 1 || (nonzero && x == 0)))) return ANNEAL_NUMBER_RANGE;
    *out = x;
    return ANNEAL_NUMBER_OK;
}
