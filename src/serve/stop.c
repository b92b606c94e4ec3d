/* Stop strings over streamed text: where the text ends, and how much of it may be sent
 * before a stop string that might still be forming (held back, never sent, so the
 * client never sees any part of a stop string). */
#include "anneal/serve.h"

#include <string.h>

/* First occurrence of needle (nlen > 0) in hay[from..len), or len when none. */
static size_t find(const char *hay, size_t len, size_t from, const char *needle, size_t nlen) {
    for (size_t i = from; i + nlen <= len; i++)
        if (hay[i] == needle[0] && !memcmp(hay + i, needle, nlen)) return i;
    return len;
}

bool anneal_serve_stop_scan(const char *text, size_t len, size_t shown, char *const *stop, int n_stop,
                            size_t *cut, size_t *safe) {
    if (shown > len) shown = len;
    size_t best = len;
    for (int k = 0; k < n_stop; k++) {
        size_t n = strlen(stop[k]);
        if (n == 0) continue;
        size_t at = find(text, len, shown, stop[k], n);
        if (at < best) best = at;
    }
    if (best < len) {
        *cut = best;
        *safe = best;
        return true;
    }
    /* hold back the longest tail of text that is a proper prefix of some stop string */
    size_t hold = 0;
    for (int k = 0; k < n_stop; k++) {
        size_t n = strlen(stop[k]);
        if (n == 0) continue;
        size_t most = n - 1 < len - shown ? n - 1 : len - shown;
        for (size_t h = most; h > hold; h--)
            if (!memcmp(text + len - h, stop[k], h)) {
                hold = h;
                break;
            }
    }
    *cut = len;
    *safe = len - hold;
    return false;
}
