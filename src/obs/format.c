/* Small formatting helpers for progress and summaries: durations, counts with a
 * k/M/G suffix, and UTF-8 repair so generated text is always valid JSON. */
#include "anneal/obs.h"

#include <math.h>
#include <string.h>

const char *anneal_format_duration(double s, char *buf, size_t n) {
    if (!isfinite(s) || s < 0) snprintf(buf, n, "?");
    else if (s < 60) snprintf(buf, n, "%.1fs", s);
    else if (s < 3600) snprintf(buf, n, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else if (s < 1e7) snprintf(buf, n, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
    else snprintf(buf, n, "%.0fh", s / 3600);
    return buf;
}

const char *anneal_format_count(double v, char *buf, size_t n) {
    if (!isfinite(v)) snprintf(buf, n, "?");
    else if (fabs(v) < 1e3) snprintf(buf, n, "%.0f", v);
    else if (fabs(v) < 1e6) snprintf(buf, n, "%.1fk", v / 1e3);
    else if (fabs(v) < 1e9) snprintf(buf, n, "%.2fM", v / 1e6);
    else snprintf(buf, n, "%.2fG", v / 1e9);
    return buf;
}

/* Length of the valid UTF-8 character at s[0..n) (1-4), or 0 if invalid/incomplete. */
static size_t utf8_char_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) len = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, min = 0x10000;
    else return 0;
    if (n < len) return 0;
    unsigned cp = c & (0x7F >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

size_t anneal_utf8_sanitize(const char *in, size_t n, char *out, size_t cap) {
    static const char repl[] = "\xEF\xBF\xBD"; /* U+FFFD */
    size_t o = 0;
    if (cap == 0) return 0;
    for (size_t i = 0; i < n;) {
        size_t len = utf8_char_len((const unsigned char *)in + i, n - i);
        const char *src = len ? in + i : repl;
        size_t w = len ? len : 3;
        if (o + w >= cap) break;
        memcpy(out + o, src, w);
        o += w;
        i += len ? len : 1;
    }
    out[o] = '\0';
    return o;
}
