/* Checked parsing of text that users and files hand to anneal: JSON documents (every
 * settings or metadata file anneal reads goes through anneal_json_parse, so each
 * refuses the same things the same way) and decimal numbers of flags and settings. */
#ifndef ANNEAL_PARSE_H
#define ANNEAL_PARSE_H

#include <stddef.h>
#include <stdint.h>

#include "anneal/core.h"

struct cJSON; /* <cjson/cJSON.h> */

/* Parses len bytes of text as one JSON document and checks it: a syntax error names
 * the line and column (and says when the text ends early), text after the document
 * (other than whitespace) is refused, an object with the same key twice is refused
 * naming the key, and a key containing \u0000 (which cJSON would cut short, so that
 * "lr\u0000x" matched "lr") is refused. `what` names the source in every message
 * ("config.json of DIR", a path). *out (cJSON_Delete it) is NULL on failure; the
 * error is ANNEAL_ERR_FORMAT. */
anneal_status anneal_json_parse(const char *text, size_t len, const char *what, struct cJSON **out);

/* Reads a whole regular file of at most max_bytes and parses it with
 * anneal_json_parse (what = path). A missing or unreadable file says why (strerror),
 * a directory says it is a directory (ANNEAL_ERR_IO); *out NULL on failure. */
anneal_status anneal_json_read_file(const char *path, size_t max_bytes, struct cJSON **out);

/* Reads a whole regular file of at most max_bytes into a malloc'd NUL-terminated
 * buffer (*len bytes before the NUL). Errors as anneal_json_read_file's. */
anneal_status anneal_read_text_file(const char *path, size_t max_bytes, char **text, size_t *len);

/* Outcomes of the decimal number parsers. */
typedef enum anneal_number_parse {
    ANNEAL_NUMBER_OK = 0,
    ANNEAL_NUMBER_MALFORMED, /* not a plain decimal number (hex, octal-looking 010, inf, nan, junk, empty) */
    ANNEAL_NUMBER_RANGE,     /* decimal, but outside what the type holds */
} anneal_number_parse;

/* The whole of s as a decimal integer: an optional sign and digits, no leading zero
 * before another digit (010 is refused rather than read as 8 or 10), no spaces. */
anneal_number_parse anneal_parse_decimal_i64(const char *s, int64_t *out);
/* The whole of s as a finite decimal number: [sign] digits [. digits] [e [sign]
 * digits] (".5" and "5." too); hex floats, inf and nan are malformed, a value that
 * overflows (or underflows to 0 from a non-zero) a double is out of range. */
anneal_number_parse anneal_parse_decimal_f64(const char *s, double *out);

#endif
