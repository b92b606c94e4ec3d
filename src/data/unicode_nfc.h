/* Unicode NFC (canonical decomposition, canonical ordering, canonical composition), the
 * normalizer Qwen2's tokenizer.json names; tables from scripts/gen_unicode_nfc.py. */
#ifndef ANNEAL_DATA_UNICODE_NFC_H
#define ANNEAL_DATA_UNICODE_NFC_H

#include "anneal/core.h"

#include <stddef.h>

/* NFC of s[0..n) into *out (malloc'd, NUL-terminated; *out_len set). Bytes that are not
 * valid UTF-8 pass through unchanged and block composition across them. Text with no
 * code point >= U+0300 is its own NFC (copied as it is). */
anneal_status anneal_nfc(const char *s, size_t n, char **out, size_t *out_len);

#endif
