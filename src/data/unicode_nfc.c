/* Unicode NFC (see unicode_nfc.h): UAX #15's algorithm over the generated tables, with
 * Hangul syllables composed and decomposed arithmetically. */
#include "unicode_nfc.h"

#include "unicode_nfc_table.h"

#include <stdlib.h>
#include <string.h>

#define INVALID_BASE 0x80000000u /* a byte that is not UTF-8: 0x80000000 | byte */

enum { S_BASE = 0xAC00, L_BASE = 0x1100, V_BASE = 0x1161, T_BASE = 0x11A7, L_COUNT = 19, V_COUNT = 21,
       T_COUNT = 28, N_COUNT = V_COUNT * T_COUNT, S_COUNT = L_COUNT * N_COUNT };

/* The canonical combining class of cp (0 for starters and invalid bytes). */
static int ccc_of(uint32_t cp) {
    if (cp < 0x300 || cp >= INVALID_BASE) return 0;
    size_t lo = 0, hi = sizeof nfc_ccc / sizeof *nfc_ccc;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        uint32_t c = nfc_ccc[mid] >> 8;
        if (c == cp) return (int)(nfc_ccc[mid] & 0xFF);
        if (c < cp) lo = mid + 1;
        else hi = mid;
    }
    return 0;
}

/* Index of cp's decomposition, -1 if none. */
static int decomp_of(uint32_t cp) {
    size_t lo = 0, hi = sizeof nfc_decomp / sizeof *nfc_decomp;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (nfc_decomp[mid][0] == cp) return (int)mid;
        if (nfc_decomp[mid][0] < cp) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

/* The primary composite of (a, b), 0 if none. */
static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= L_BASE && a < L_BASE + L_COUNT && b >= V_BASE && b < V_BASE + V_COUNT)
        return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    if (a >= S_BASE && a < S_BASE + S_COUNT && (a - S_BASE) % T_COUNT == 0 && b > T_BASE && b < T_BASE + T_COUNT)
        return a + (b - T_BASE);
    size_t lo = 0, hi = sizeof nfc_comp / sizeof *nfc_comp;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const uint32_t *e = nfc_comp[mid];
        if (e[0] == a && e[1] == b) return e[2];
        if (e[0] < a || (e[0] == a && e[1] < b)) lo = mid + 1;
        else hi = mid;
    }
    return 0;
}

/* Decodes one code point at s[*i] (an invalid byte becomes INVALID_BASE | byte). */
static uint32_t next_cp(const unsigned char *s, size_t n, size_t *i) {
    unsigned c = s[*i];
    size_t k = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (k == 1) {
        (*i)++;
        return c;
    }
    if (k == 0 || *i + k > n) {
        (*i)++;
        return INVALID_BASE | c;
    }
    uint32_t cp = c & (k == 2 ? 0x1F : k == 3 ? 0x0F : 0x07);
    for (size_t j = 1; j < k; j++) {
        unsigned d = s[*i + j];
        if ((d & 0xC0) != 0x80) {
            (*i)++;
            return INVALID_BASE | c;
        }
        cp = cp << 6 | (d & 0x3F);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[k] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
        (*i)++;
        return INVALID_BASE | c;
    }
    *i += k;
    return cp;
}

/* Writes cp as UTF-8 (an invalid byte as itself) to o; returns the bytes written. */
static size_t put_cp(unsigned char *o, uint32_t cp) {
    if (cp >= INVALID_BASE) {
        o[0] = (unsigned char)(cp & 0xFF);
        return 1;
    }
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | cp >> 6);
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | cp >> 12);
        o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | cp >> 18);
    o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

anneal_status anneal_nfc(const char *s, size_t n, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    const unsigned char *u = (const unsigned char *)s;
    bool simple = true; /* below U+0300 every character is a starter that nothing before it composes with */
    for (size_t i = 0; i < n && simple; i++) simple = u[i] < 0xCC;
    if (simple) {
        char *c = malloc(n + 1);
        if (!c) return anneal_set_error(ANNEAL_ERR_OOM, "NFC: out of memory");
        memcpy(c, s, n);
        c[n] = 0;
        *out = c;
        *out_len = n;
        return ANNEAL_OK;
    }
    /* decompose: at most 18 code points per input code point (the longest full decomposition) */
    size_t cap = 4 * n + 16, m = 0;
    uint32_t *cps = malloc(cap * sizeof *cps);
    if (!cps) return anneal_set_error(ANNEAL_ERR_OOM, "NFC: out of memory");
    for (size_t i = 0; i < n;) {
        uint32_t cp = next_cp(u, n, &i);
        if (m + 18 > cap) {
            cap *= 2;
            uint32_t *p = realloc(cps, cap * sizeof *p);
            if (!p) {
                free(cps);
                return anneal_set_error(ANNEAL_ERR_OOM, "NFC: out of memory");
            }
            cps = p;
        }
        int d;
        if (cp >= S_BASE && cp < S_BASE + S_COUNT) {
            uint32_t si = cp - S_BASE;
            cps[m++] = L_BASE + si / N_COUNT;
            cps[m++] = V_BASE + si % N_COUNT / T_COUNT;
            if (si % T_COUNT) cps[m++] = T_BASE + si % T_COUNT;
        } else if (cp >= 0xC0 && cp < INVALID_BASE && (d = decomp_of(cp)) >= 0) {
            for (uint32_t k = 0; k < nfc_decomp[d][2]; k++) cps[m++] = nfc_pool[nfc_decomp[d][1] + k];
        } else {
            cps[m++] = cp;
        }
    }
    /* canonical ordering: a stable sort of each run of non-starters by class */
    for (size_t i = 1; i < m; i++) {
        int c = ccc_of(cps[i]);
        if (!c) continue;
        size_t j = i;
        uint32_t v = cps[i];
        while (j > 0 && ccc_of(cps[j - 1]) > c) {
            cps[j] = cps[j - 1];
            j--;
        }
        cps[j] = v;
    }
    /* compose (UAX #15's reference algorithm): a character joins the last starter unless
     * a character of the same or a higher class, or a starter, lies between them */
    size_t w = m ? 1 : 0, starter = 0;
    int last = m ? ccc_of(cps[0]) : 0;
    if (last) last = 256; /* text that starts with a non-starter: nothing composes with it */
    for (size_t i = 1; i < m; i++) {
        uint32_t cp = cps[i];
        int c = ccc_of(cp);
        uint32_t comp = compose(cps[starter], cp);
        if (comp && (last < c || last == 0)) {
            cps[starter] = comp;
            continue;
        }
        if (c == 0) starter = w;
        last = c;
        cps[w++] = cp;
    }
    unsigned char *o = malloc(4 * w + 1);
    if (!o) {
        free(cps);
        return anneal_set_error(ANNEAL_ERR_OOM, "NFC: out of memory");
    }
    size_t on = 0;
    for (size_t i = 0; i < w; i++) on += put_cp(o + on, cps[i]);
    o[on] = 0;
    free(cps);
    *out = (char *)o;
    *out_len = on;
    return ANNEAL_OK;
}
