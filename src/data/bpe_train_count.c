/* Counting the distinct pre-tokenised pieces of a corpus for the BPE trainer (see
 * bpe_train.h): files are streamed in blocks cut at safe points, the blocks split into
 * segments that OpenMP threads pre-tokenise into per-thread hash maps (piece bytes ->
 * count), and the maps are summed at the end. Counts are exact integers, so the result
 * does not depend on the thread count or the schedule. */
#include "bpe_train.h"
#include "pretokenize.h"

#include <errno.h>
#include <fcntl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    DEFAULT_BLOCK = 8 << 20, /* bytes read per block (grown if it holds no safe cut) */
    SEGMENT = 1 << 20,       /* bytes per parallel work item */
};

/* ------------------------------------------------------------ piece map */

typedef struct piece_entry {
    uint64_t hash;
    size_t off;     /* into the map's arena */
    uint32_t len;
    int64_t count;
} piece_entry;

/* Hash map piece bytes -> count: open addressing over 8-byte slots (the hash's high 32
 * bits, then entry index + 1; 0 = empty) so the probed table stays small and cached;
 * entries in insertion order, keys in one arena. */
typedef struct piece_map {
    uint64_t *slots;
    size_t cap;      /* power of two, > 2 * n */
    piece_entry *ent;
    size_t n, ent_cap;
    char *arena;
    size_t arena_len, arena_cap;
} piece_map;

/* 64-bit hash of n bytes (8 bytes at a time, murmur-style finaliser). */
static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    const uint64_t k1 = 0x9E3779B97F4A7C15ull, k2 = 0xC2B2AE3D27D4EB4Full;
    uint64_t h = k1 ^ ((uint64_t)n * k2);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h ^= v * k2;
        h = ((h << 31) | (h >> 33)) * k1;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i); /* inlined, unlike memcpy(n) */
    h ^= v * k2 + n;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

/* Doubles the slot table (rehashing by the stored hashes). */
static bool map_grow(piece_map *m) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    uint64_t *s = calloc(cap, sizeof *s);
    if (!s) return false;
    for (size_t k = 0; k < m->n; k++) {
        uint64_t h = m->ent[k].hash;
        size_t j = h & (cap - 1);
        while (s[j]) j = (j + 1) & (cap - 1);
        s[j] = (h >> 32 << 32) | (k + 1);
    }
    free(m->slots);
    m->slots = s;
    m->cap = cap;
    return true;
}

/* memcmp(a, b, n) == 0, inlined for the short keys that dominate. */
static inline bool same_bytes(const char *a, const char *b, size_t n) {
    while (n >= 8) {
        uint64_t x, y;
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        if (x != y) return false;
        a += 8;
        b += 8;
        n -= 8;
    }
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) return false;
    return true;
}

/* Adds count c to piece p[0..n) (hash h), inserting it if new. False when out of memory. */
static bool map_add(piece_map *m, const char *p, uint32_t n, uint64_t h, int64_t c) {
    if ((m->n + 1) * 2 > m->cap && !map_grow(m)) return false;
    size_t mask = m->cap - 1, i = h & mask;
    uint64_t tag = h >> 32;
    for (uint64_t v; (v = m->slots[i]) != 0; i = (i + 1) & mask) {
        if (v >> 32 != tag) continue;
        piece_entry *e = &m->ent[(uint32_t)v - 1];
        if (e->len == n && same_bytes(m->arena + e->off, p, n)) {
            e->count += c;
            return true;
        }
    }
    if (m->n >= UINT32_MAX - 1) return false;
    if (m->n == m->ent_cap) {
        size_t cap = m->ent_cap ? m->ent_cap * 2 : 1024;
        piece_entry *e = realloc(m->ent, cap * sizeof *e);
        if (!e) return false;
        m->ent = e;
        m->ent_cap = cap;
    }
    if (m->arena_len + n > m->arena_cap) {
        size_t cap = m->arena_cap ? m->arena_cap * 2 : 1 << 16;
        while (cap < m->arena_len + n) cap *= 2;
        char *a = realloc(m->arena, cap);
        if (!a) return false;
        m->arena = a;
        m->arena_cap = cap;
    }
    memcpy(m->arena + m->arena_len, p, n);
    m->ent[m->n] = (piece_entry){h, m->arena_len, n, c};
    m->slots[i] = (tag << 32) | (m->n + 1);
    m->arena_len += n;
    m->n++;
    return true;
}

static void map_free(piece_map *m) {
    free(m->slots);
    free(m->ent);
    free(m->arena);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------ safe cuts */

/* True if text may be cut just before t[p] (0 < p < len) without changing its
 * pre-tokenisation: t[p] is ASCII whitespace and the character ending at t[p-1] is
 * certainly not whitespace (an ASCII byte 0x21..0x7E, or a byte >= 0x80 that does not
 * end the UTF-8 of a Unicode space: U+0085, U+00A0 (C2 xx) and the 3-byte spaces
 * U+1680, U+180E, U+2000..U+205F, U+3000 are excluded conservatively as E1..E3
 * followed by 80, 81, 9A or A0).
 * Why that is exact: no alternative of GPT-2's pattern matches a non-space character
 * followed by whitespace (only the \s alternatives hold whitespace, and those hold
 * nothing else), so no piece crosses p; the pattern has no look-behind, so the pieces
 * from p on depend only on the text from p on; the one look-ahead, \s+(?!\S), only
 * looks past the end of a whitespace run, which cannot end at p; and t[p] is ASCII, so
 * UTF-8 validity on either side is unchanged. */
static bool is_safe_cut(const unsigned char *t, size_t p) {
    unsigned char c = t[p], x = t[p - 1];
    if (c != ' ' && c != '\n' && c != '\t' && c != '\r') return false;
    if (x <= 0x20 || x == 0x7f) return false;
    if (x < 0x80) return true;
    if (p >= 2 && t[p - 2] == 0xC2) return false;
    if (p >= 3 && t[p - 3] >= 0xE1 && t[p - 3] <= 0xE3 &&
        (t[p - 2] == 0x80 || t[p - 2] == 0x81 || t[p - 2] == 0x9A || t[p - 2] == 0xA0))
        return false;
    return true;
}

/* The last safe cut in (lo, hi], or 0 if none. */
static size_t last_cut(const unsigned char *t, size_t lo, size_t hi) {
    for (size_t p = hi; p > lo; p--)
        if (is_safe_cut(t, p)) return p;
    return 0;
}

/* --------------------------------------------------------------- counting */

typedef struct piece_sink {
    piece_map *map;
    bool oom, too_long;
} piece_sink;

/* anneal_piece_fn: counts one piece into the sink's map. */
static bool sink_piece(const char *piece, size_t len, void *user) {
    piece_sink *s = user;
    if (len > UINT32_MAX) {
        s->too_long = true;
        return false;
    }
    if (!map_add(s->map, piece, (uint32_t)len, hash_bytes((const unsigned char *)piece, len), 1)) {
        s->oom = true;
        return false;
    }
    return true;
}

typedef struct count_ctx {
    const anneal_pretokenizer *pt;
    piece_map *maps;  /* one per thread */
    int n_threads;
    size_t *bounds;   /* segment boundaries of the current block */
    size_t bounds_cap;
} count_ctx;

/* Pre-tokenises buf[0..len) (which ends at a safe cut or at the end of a file) and
 * counts its pieces: segments of ~SEGMENT bytes cut at safe points, one OpenMP work
 * item each, counted into the running thread's map. path names the file in errors. */
static anneal_status count_block(count_ctx *cx, const char *buf, size_t len, const char *path) {
    size_t want = len / SEGMENT + 1;
    if (want + 1 > cx->bounds_cap) {
        size_t *b = realloc(cx->bounds, (want + 1) * sizeof *b);
        if (!b) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer train: out of memory");
        cx->bounds = b;
        cx->bounds_cap = want + 1;
    }
    size_t nb = 0;
    cx->bounds[nb++] = 0;
    size_t step = len / want;
    for (size_t k = 1; k < want; k++) {
        /* Look back at most one segment so a block without cuts costs O(len), not more. */
        size_t lo = cx->bounds[nb - 1] > (k - 1) * step ? cx->bounds[nb - 1] : (k - 1) * step;
        size_t cut = last_cut((const unsigned char *)buf, lo, k * step);
        if (cut) cx->bounds[nb++] = cut;
    }
    cx->bounds[nb] = len;
    int n_seg = (int)nb;
    anneal_status first = ANNEAL_OK;
    char msg[512] = "";
    int first_seg = n_seg;
#pragma omp parallel for schedule(dynamic, 1) num_threads(cx->n_threads)
    for (int s = 0; s < n_seg; s++) {
        piece_sink sink = {&cx->maps[omp_get_thread_num()], false, false};
        size_t lo = cx->bounds[s], hi = cx->bounds[s + 1];
        anneal_status st = anneal_pretokenize(cx->pt, buf + lo, hi - lo, sink_piece, &sink);
        if (st == ANNEAL_OK && sink.oom) st = anneal_set_error(ANNEAL_ERR_OOM, "out of memory counting pieces");
        if (st == ANNEAL_OK && sink.too_long) st = anneal_set_error(ANNEAL_ERR_FORMAT, "a piece longer than 4 GiB");
        if (st != ANNEAL_OK) {
            /* Errors are thread-local: carry the first (by segment) to the caller. */
#pragma omp critical(anneal_bpe_count_err)
            if (s < first_seg) {
                first_seg = s;
                first = st;
                snprintf(msg, sizeof msg, "%s", anneal_last_error());
            }
            anneal_clear_error();
        }
    }
    if (first != ANNEAL_OK) return anneal_set_error(first, "%s: %s", path, msg);
    return ANNEAL_OK;
}

/* Streams one file through count_block; (*buf, *cap) is the growable block buffer. */
static anneal_status count_file(count_ctx *cx, const char *path, char **buf, size_t *cap,
                                uint64_t *total_bytes) {
    int fd;
    do fd = open(path, O_RDONLY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    anneal_status st = ANNEAL_OK;
    size_t len = 0;
    bool eof = false;
    while (!eof || len > 0) {
        while (!eof && len < *cap) {
            ssize_t r = read(fd, *buf + len, *cap - len);
            if (r < 0) {
                if (errno == EINTR) continue;
                st = anneal_set_error(ANNEAL_ERR_IO, "%s: read failed: %s", path, strerror(errno));
                goto done;
            }
            if (r == 0) eof = true;
            len += (size_t)r;
            *total_bytes += (uint64_t)r;
        }
        size_t end = eof ? len : last_cut((const unsigned char *)*buf, 0, len - 1);
        if (!end) { /* no safe cut in a full block: grow it and read on */
            char *b = realloc(*buf, *cap * 2);
            if (!b) {
                st = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory (%zu bytes without a safe "
                                      "place to cut the text)", path, *cap);
                goto done;
            }
            *buf = b;
            *cap *= 2;
            continue;
        }
        st = count_block(cx, *buf, end, path);
        if (st != ANNEAL_OK) goto done;
        memmove(*buf, *buf + end, len - end);
        len -= end;
    }
done:
    close(fd);
    return st;
}

void anneal_piece_counts_free(anneal_piece_counts *pc) {
    if (!pc) return;
    free(pc->bytes);
    free(pc->off);
    free(pc->len);
    free(pc->count);
    memset(pc, 0, sizeof *pc);
}

/* Sums maps[1..n) into maps[0] and flattens it into out (taking its arena). */
static anneal_status flatten(piece_map *maps, int n, anneal_piece_counts *out) {
    piece_map *m0 = &maps[0];
    for (int t = 1; t < n; t++) {
        piece_map *m = &maps[t];
        for (size_t k = 0; k < m->n; k++) {
            piece_entry *e = &m->ent[k];
            if (!map_add(m0, m->arena + e->off, e->len, e->hash, e->count))
                return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer train: out of memory");
        }
        map_free(m);
    }
    size_t k = m0->n ? m0->n : 1;
    out->off = malloc(k * sizeof *out->off);
    out->len = malloc(k * sizeof *out->len);
    out->count = malloc(k * sizeof *out->count);
    if (!out->off || !out->len || !out->count)
        return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer train: out of memory");
    for (size_t j = 0; j < m0->n; j++) {
        out->off[j] = m0->ent[j].off;
        out->len[j] = m0->ent[j].len;
        out->count[j] = m0->ent[j].count;
        out->total_pieces += (uint64_t)m0->ent[j].count;
    }
    out->n = m0->n;
    out->bytes = m0->arena;
    m0->arena = NULL;
    return ANNEAL_OK;
}

anneal_status anneal_bpe_count_pieces(const char *const *files, int n_files, int n_threads,
                                      size_t block_bytes, anneal_piece_counts *out) {
    if (!out) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer train: NULL output");
    memset(out, 0, sizeof *out);
    if (!files || n_files <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer train: no input files");
    /* Check every input before the long part starts. */
    for (int i = 0; i < n_files; i++) {
        struct stat st;
        if (!files[i]) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer train: input %d is NULL", i);
        if (stat(files[i], &st) != 0)
            return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", files[i], strerror(errno));
        if (S_ISDIR(st.st_mode))
            return anneal_set_error(ANNEAL_ERR_IO, "%s: is a directory, not a text file", files[i]);
        if (access(files[i], R_OK) != 0)
            return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot read: %s", files[i], strerror(errno));
    }
    if (n_threads <= 0) n_threads = anneal_get_num_threads();
    size_t cap = block_bytes ? block_bytes : DEFAULT_BLOCK;
    if (cap < 16) cap = 16;
    count_ctx cx = {0};
    cx.n_threads = n_threads;
    cx.pt = anneal_pretokenizer_new();
    cx.maps = calloc((size_t)n_threads, sizeof *cx.maps);
    char *buf = malloc(cap);
    anneal_status st = ANNEAL_OK;
    if (!cx.pt) st = anneal_last_status();
    else if (!cx.maps || !buf) st = anneal_set_error(ANNEAL_ERR_OOM, "tokenizer train: out of memory");
    for (int i = 0; st == ANNEAL_OK && i < n_files; i++)
        st = count_file(&cx, files[i], &buf, &cap, &out->total_bytes);
    if (st == ANNEAL_OK) st = flatten(cx.maps, n_threads, out);
    if (cx.maps)
        for (int t = 0; t < n_threads; t++) map_free(&cx.maps[t]);
    free(cx.maps);
    free(cx.bounds);
    free(buf);
    anneal_pretokenizer_free((anneal_pretokenizer *)cx.pt);
    if (st != ANNEAL_OK) {
        uint64_t tb = out->total_bytes;
        anneal_piece_counts_free(out);
        out->total_bytes = tb;
    }
    return st;
}
