/* GPT-2 pre-tokenisation with PCRE2 (see pretokenize.h). */
#include "pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct anneal_pretokenizer {
    pcre2_code *code;
    bool jit;
};

anneal_pretokenizer *anneal_pretokenizer_new_pattern(const char *pattern, const char *what) {
    anneal_pretokenizer *p = calloc(1, sizeof *p);
    if (!p) {
        anneal_set_error(ANNEAL_ERR_OOM, "pretokenizer: out of memory");
        return NULL;
    }
    int err;
    PCRE2_SIZE off;
    /* MATCH_INVALID_UTF: invalid UTF-8 is allowed in the subject and never matched. */
    p->code = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                            PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, NULL);
    if (!p->code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: PCRE2 cannot compile the pre-tokenizer pattern (at offset %zu): %s",
                         what, (size_t)off, (const char *)msg);
        free(p);
        return NULL;
    }
    p->jit = pcre2_jit_compile(p->code, PCRE2_JIT_COMPLETE) == 0;
    return p;
}

anneal_pretokenizer *anneal_pretokenizer_new(void) {
    return anneal_pretokenizer_new_pattern(ANNEAL_GPT2_PATTERN, "pretokenizer (GPT-2)");
}

char *anneal_hf_regex_to_pcre(const char *onig, const char **why) {
    static const char space[] = ANNEAL_HF_SPACE;
    size_t n = strlen(onig), cap = n * (sizeof space + 4) + 1;
    char *out = malloc(cap), *o = out;
    if (!out) {
        *why = "out of memory";
        return NULL;
    }
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = onig[i];
        if (c == '\\' && i + 1 < n) {
            char d = onig[i + 1];
            if (d == 's' || d == 'S') {
                if (in_class && d == 'S') {
                    free(out);
                    *why = "\\S inside a character class";
                    return NULL;
                }
                o += sprintf(o, in_class ? "%s" : d == 's' ? "[%s]" : "[^%s]", space);
            } else {
                *o++ = c;
                *o++ = d;
            }
            i++;
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = true;
            *o++ = c;
            if (i + 1 < n && onig[i + 1] == '^') *o++ = onig[++i];
            if (i + 1 < n && onig[i + 1] == ']') *o++ = onig[++i]; /* a leading ] is literal */
            continue;
        }
        if (c == '[' && in_class) {
            free(out);
            *why = "a nested character class";
            return NULL;
        }
        if (c == ']' && in_class) in_class = false;
        *o++ = c;
    }
    *o = 0;
    return out;
}

void anneal_pretokenizer_free(anneal_pretokenizer *p) {
    if (!p) return;
    pcre2_code_free(p->code);
    free(p);
}

anneal_status anneal_pretokenize(const anneal_pretokenizer *p, const char *text, size_t len,
                                 anneal_piece_fn fn, void *user) {
    if (!p || (!text && len)) return anneal_set_error(ANNEAL_ERR_ARG, "pretokenize: NULL argument");
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(p->code, NULL);
    if (!md) return anneal_set_error(ANNEAL_ERR_OOM, "pretokenize: out of memory");
    anneal_status s = ANNEAL_OK;
    size_t pos = 0;
    while (pos < len) {
        int rc = p->jit ? pcre2_jit_match(p->code, (PCRE2_SPTR)text, len, pos, 0, md, NULL)
                        : pcre2_match(p->code, (PCRE2_SPTR)text, len, pos, 0, md, NULL);
        size_t start = len, end = len;
        if (rc >= 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            start = ov[0];
            end = ov[1];
        } else if (rc != PCRE2_ERROR_NOMATCH) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "pretokenize: PCRE2 match failed: %s", (const char *)msg);
            break;
        }
        if (start > pos && !fn(text + pos, start - pos, user)) break; /* unmatched (invalid) bytes */
        if (end > start && !fn(text + start, end - start, user)) break;
        pos = end > pos ? end : pos + 1; /* the pattern never matches empty; guard anyway */
    }
    pcre2_match_data_free(md);
    return s;
}
