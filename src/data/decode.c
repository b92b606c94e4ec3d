/* Decoding ids to bytes: whole arrays, and a streaming decoder that holds back the
 * start of a UTF-8 character until its last byte has arrived. */
#include "tokenizer_impl.h"

#include <stdlib.h>

anneal_status anneal_tokenizer_decode(const anneal_tokenizer *tok, const int32_t *ids, size_t n,
                                      char **text, size_t *len) {
    if (text) *text = NULL;
    if (len) *len = 0;
    if (!tok || !text || !len || (!ids && n)) return anneal_set_error(ANNEAL_ERR_ARG, "decode: NULL argument");
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->n_vocab)
            return anneal_set_error(ANNEAL_ERR_ARG,
                                    "decode: id %d at position %zu is out of range (the vocabulary has "
                                    "%d ids: 0..%d)",
                                    (int)ids[i], i, (int)tok->n_vocab, (int)tok->n_vocab - 1);
        size_t l;
        tok_dec_bytes(tok, ids[i], &l);
        total += l;
    }
    char *out = malloc(total + 1);
    if (!out) return anneal_set_error(ANNEAL_ERR_OOM, "decode: out of memory (%zu bytes)", total + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l;
        const char *b = tok_dec_bytes(tok, ids[i], &l);
        if (i == 0 && tok->dec_strip_space && l && b[0] == ' ') { /* the decoder's Strip / Metaspace */
            b++;
            l--;
        }
        memcpy(out + o, b, l);
        o += l;
    }
    out[o] = 0;
    *text = out;
    *len = o;
    return ANNEAL_OK;
}

void anneal_stream_decoder_init(anneal_stream_decoder *d, const anneal_tokenizer *tok) {
    if (!d) return;
    memset(d, 0, sizeof *d);
    d->tok = tok;
}

/* Length of the UTF-8 sequence that lead byte c starts (0 if c cannot start one) and
 * the range its second byte must lie in (which excludes overlongs, surrogates and code
 * points above U+10FFFF). */
static int utf8_lead(unsigned c, unsigned *lo, unsigned *hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c == 0xE0) { *lo = 0xA0; return 3; }
    if (c == 0xED) { *hi = 0x9F; return 3; }
    if (c >= 0xE1 && c <= 0xEF) return 3;
    if (c == 0xF0) { *lo = 0x90; return 4; }
    if (c == 0xF4) { *hi = 0x8F; return 4; }
    if (c >= 0xF1 && c <= 0xF3) return 4;
    return 0;
}

anneal_status anneal_stream_decoder_push(anneal_stream_decoder *d, int32_t id, char *out,
                                         size_t out_cap, size_t *out_len) {
    if (out_len) *out_len = 0;
    if (!d || !d->tok || !out || !out_len)
        return anneal_set_error(ANNEAL_ERR_ARG, "stream decode: NULL argument");
    const anneal_tokenizer *t = d->tok;
    if (id < 0 || id >= t->n_vocab)
        return anneal_set_error(ANNEAL_ERR_ARG, "stream decode: id %d is out of range (the vocabulary has %d ids)",
                                (int)id, (int)t->n_vocab);
    size_t n;
    const char *b = tok_dec_bytes(t, id, &n);
    size_t total = (size_t)d->n_pending + n;
    if (out_cap < total)
        return anneal_set_error(ANNEAL_ERR_ARG, "stream decode: output buffer of %zu bytes is too small for id %d "
                                "(needs %zu)", out_cap, (int)id, total);
    /* out = pending + token bytes, then compacted in place to what can be shown */
    unsigned char *u = (unsigned char *)out;
    memcpy(u, d->pending, (size_t)d->n_pending);
    memcpy(u + d->n_pending, b, n);
    d->n_pending = 0;
    size_t i = 0, o = 0;
    while (i < total) {
        unsigned c = u[i], lo, hi;
        int k = c < 0x80 ? 1 : utf8_lead(c, &lo, &hi);
        if (k <= 1) { /* ASCII, or a byte that starts nothing: passed through */
            u[o++] = (unsigned char)c;
            i++;
            continue;
        }
        int j = 1;
        while (j < k && i + (size_t)j < total) {
            unsigned x = u[i + (size_t)j];
            if (j == 1 ? (x < lo || x > hi) : (x & 0xC0) != 0x80) break;
            j++;
        }
        if (j == k) { /* a whole character */
            memmove(u + o, u + i, (size_t)k);
            o += (size_t)k;
            i += (size_t)k;
        } else if (i + (size_t)j == total) { /* a valid start cut by the end: hold it */
            d->n_pending = (int)(total - i);
            memcpy(d->pending, u + i, (size_t)d->n_pending);
            break;
        } else { /* broken sequence: the lead byte goes out alone */
            u[o++] = (unsigned char)c;
            i++;
        }
    }
    *out_len = o;
    return ANNEAL_OK;
}

size_t anneal_stream_decoder_flush(anneal_stream_decoder *d, char *out, size_t out_cap) {
    if (!d || !out) return 0;
    size_t n = (size_t)d->n_pending < out_cap ? (size_t)d->n_pending : out_cap;
    memcpy(out, d->pending, n);
    memmove(d->pending, d->pending + n, (size_t)d->n_pending - n);
    d->n_pending -= (int)n;
    return n;
}
