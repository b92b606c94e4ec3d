/* Token shards (layout in docs/FORMATS.md): a 64-byte little-endian header, then
 * n_tokens ids of 2 or 4 bytes. The reader maps the file and validates every field;
 * the writer streams ids into a temporary and publishes it atomically. */
#include "anneal/shard.h"

#include "anneal/fs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHARD_HEADER_SIZE 64
#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL

/* ------------------------------------------------------------- helpers */

/* FNV-1a 64 of n bytes, continuing from hash h (start with FNV_OFFSET). */
static uint64_t fnv1a(uint64_t h, const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= FNV_PRIME;
    }
    return h;
}

static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static void wr32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void wr64(unsigned char *p, uint64_t v) {
    wr32(p, (uint32_t)v);
    wr32(p + 4, (uint32_t)(v >> 32));
}

/* The token width the format requires for a vocabulary: ids < 65536 fit u16. */
static uint32_t width_for_vocab(uint32_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

/* Serialises a header into h[64] (header checksum included). */
static void encode_header(unsigned char *h, const anneal_shard_info *in) {
    memset(h, 0, SHARD_HEADER_SIZE);
    memcpy(h, ANNEAL_SHARD_MAGIC, 8);
    wr32(h + 8, in->version);
    wr32(h + 12, SHARD_HEADER_SIZE);
    wr32(h + 16, in->token_bytes);
    wr32(h + 20, in->vocab_size);
    wr32(h + 24, (uint32_t)in->eot);
    wr32(h + 28, 0);
    wr64(h + 32, in->n_tokens);
    wr64(h + 40, in->tokenizer_fingerprint);
    wr64(h + 48, in->checksum);
    wr64(h + 56, fnv1a(FNV_OFFSET, h, 56));
}

/* Writes the first bytes of a foreign file as "ab\x00..." into out (for error messages). */
static void escape_bytes(const unsigned char *p, size_t n, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i++) {
        if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '"' && p[i] != '\\') out[o++] = (char)p[i];
        else o += (size_t)snprintf(out + o, cap - o, "\\x%02x", p[i]);
    }
    out[o] = '\0';
}

/* -------------------------------------------------------------- reader */

/* Validates header h (the file has size bytes) into *info; errors name path. */
static anneal_status parse_header(const char *path, const unsigned char *h, uint64_t size,
                                  anneal_shard_info *info) {
    if (size < 8 || memcmp(h, ANNEAL_SHARD_MAGIC, 8) != 0) {
        char got[64];
        escape_bytes(h, size < 8 ? (size_t)size : 8, got, sizeof got);
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: not an anneal shard (magic \"%s\", expected \"%s\")", path, got,
                                ANNEAL_SHARD_MAGIC);
    }
    if (size < SHARD_HEADER_SIZE)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: truncated shard: file has %llu bytes, the header alone is %d", path,
                                (unsigned long long)size, SHARD_HEADER_SIZE);
    info->version = rd32(h + 8);
    if (info->version != ANNEAL_SHARD_VERSION)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: unsupported shard version %u (this build reads version %d)", path,
                                info->version, ANNEAL_SHARD_VERSION);
    uint32_t header_size = rd32(h + 12);
    if (header_size != SHARD_HEADER_SIZE)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: bad header size %u (expected %d)", path,
                                header_size, SHARD_HEADER_SIZE);
    uint64_t want = rd64(h + 56), got = fnv1a(FNV_OFFSET, h, 56);
    if (want != got)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: header corrupted (header checksum 0x%016llx, computed 0x%016llx)",
                                path, (unsigned long long)want, (unsigned long long)got);
    info->token_bytes = rd32(h + 16);
    info->vocab_size = rd32(h + 20);
    info->eot = (int32_t)rd32(h + 24);
    info->n_tokens = rd64(h + 32);
    info->tokenizer_fingerprint = rd64(h + 40);
    info->checksum = rd64(h + 48);
    if (info->vocab_size == 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: vocab_size is 0", path);
    if (info->token_bytes != width_for_vocab(info->vocab_size))
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: token_bytes %u does not match vocab_size %u (expected %u)", path,
                                info->token_bytes, info->vocab_size, width_for_vocab(info->vocab_size));
    if (info->eot < -1 || (info->eot >= 0 && (uint32_t)info->eot >= info->vocab_size))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: eot id %d outside the vocabulary (vocab_size %u)",
                                path, info->eot, info->vocab_size);
    if (rd32(h + 28) != 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: reserved header field is %u, expected 0", path,
                                rd32(h + 28));
    uint64_t max_tokens = (UINT64_MAX - SHARD_HEADER_SIZE) / info->token_bytes;
    uint64_t expect = info->n_tokens > max_tokens ? UINT64_MAX
                                                  : SHARD_HEADER_SIZE + info->n_tokens * info->token_bytes;
    if (size != expect)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: %s shard: file has %llu bytes, header says %llu (%llu tokens of %u bytes + %d)",
                                path, size < expect ? "truncated" : "oversized", (unsigned long long)size,
                                (unsigned long long)expect, (unsigned long long)info->n_tokens,
                                info->token_bytes, SHARD_HEADER_SIZE);
    return ANNEAL_OK;
}

/* Index of the first id >= vocab in a token array, or n if none. */
static uint64_t first_bad_id(const void *tokens, uint32_t width, uint64_t n, uint32_t vocab) {
    if (width == 2) {
        const uint16_t *t = tokens;
        if (vocab >= 65536) return n;
        for (uint64_t i0 = 0; i0 < n; i0 += 4096) { /* branch-free scan per block, then locate */
            uint64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
            uint16_t bad = 0;
            for (uint64_t i = i0; i < i1; i++) bad |= (uint16_t)(t[i] >= vocab);
            if (bad)
                for (uint64_t i = i0; i < i1; i++)
                    if (t[i] >= vocab) return i;
        }
    } else {
        const uint32_t *t = tokens;
        for (uint64_t i0 = 0; i0 < n; i0 += 4096) {
            uint64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
            uint32_t bad = 0;
            for (uint64_t i = i0; i < i1; i++) bad |= (uint32_t)(t[i] >= vocab);
            if (bad)
                for (uint64_t i = i0; i < i1; i++)
                    if (t[i] >= vocab) return i;
        }
    }
    return n;
}

anneal_status anneal_shard_open(const char *path, bool verify_checksum, anneal_shard **out) {
    if (!out) return anneal_set_error(ANNEAL_ERR_ARG, "shard open: NULL out");
    *out = NULL;
    if (!path) return anneal_set_error(ANNEAL_ERR_ARG, "shard open: NULL path");
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open shard: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        anneal_status s = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_IO, "%s: not a regular file", path);
    }
    uint64_t size = (uint64_t)st.st_size;
    unsigned char h[SHARD_HEADER_SIZE] = {0};
    size_t hn = size < SHARD_HEADER_SIZE ? (size_t)size : SHARD_HEADER_SIZE, got = 0;
    while (got < hn) {
        /* hn <= sizeof h; the explicit bound keeps gcc 13's -Wstringop-overflow (which
         * cannot see it through the loop) quiet on the GPU machine's compiler */
        size_t want = hn - got < sizeof h - got ? hn - got : sizeof h - got;
        ssize_t r = pread(fd, h + got, want, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            anneal_status s = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot read header: %s", path,
                                               r < 0 ? strerror(errno) : "unexpected end of file");
            close(fd);
            return s;
        }
        got += (size_t)r;
    }
    anneal_shard_info info;
    anneal_status s = parse_header(path, h, size, &info);
    if (s != ANNEAL_OK) {
        close(fd);
        return s;
    }
    if (size > SIZE_MAX) {
        close(fd);
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: shard too large to map", path);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot map %llu bytes: %s", path,
                                (unsigned long long)size, strerror(map_errno));
    const unsigned char *tokens = (const unsigned char *)map + SHARD_HEADER_SIZE;
    size_t tok_bytes = (size_t)info.n_tokens * info.token_bytes;
    if (tok_bytes) madvise(map, (size_t)size, MADV_SEQUENTIAL);
    if (verify_checksum) {
        uint64_t c = fnv1a(FNV_OFFSET, tokens, tok_bytes);
        if (c != info.checksum) {
            munmap(map, (size_t)size);
            return anneal_set_error(ANNEAL_ERR_FORMAT,
                                    "%s: corrupted: token checksum 0x%016llx, header says 0x%016llx", path,
                                    (unsigned long long)c, (unsigned long long)info.checksum);
        }
    }
    uint64_t bad = first_bad_id(tokens, info.token_bytes, info.n_tokens, info.vocab_size);
    if (bad < info.n_tokens) {
        uint32_t id = info.token_bytes == 2 ? ((const uint16_t *)tokens)[bad] : ((const uint32_t *)tokens)[bad];
        munmap(map, (size_t)size);
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token id %u at index %llu is >= vocab_size %u", path,
                                id, (unsigned long long)bad, info.vocab_size);
    }
    if (tok_bytes) madvise(map, (size_t)size, MADV_NORMAL);
    anneal_shard *sh = calloc(1, sizeof *sh);
    size_t plen = strlen(path) + 1;
    char *pcopy = malloc(plen);
    if (!sh || !pcopy) {
        free(sh);
        free(pcopy);
        munmap(map, (size_t)size);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    memcpy(pcopy, path, plen);
    sh->path = pcopy;
    sh->info = info;
    sh->tokens = tokens;
    sh->map = map;
    sh->map_size = (size_t)size;
    *out = sh;
    return ANNEAL_OK;
}

void anneal_shard_close(anneal_shard *s) {
    if (!s) return;
    if (s->map) munmap(s->map, s->map_size);
    free(s->path);
    free(s);
}

/* -------------------------------------------------------------- writer */

#define WRITER_BUF (1u << 20) /* bytes buffered before a write() */

struct anneal_shard_writer {
    anneal_atomic_file af;
    anneal_shard_info info;
    unsigned char *buf; /* WRITER_BUF bytes of packed little-endian ids */
    size_t used;
    uint64_t hash;      /* running FNV-1a of every token byte flushed or buffered */
};

/* Frees w's memory (the temporary must already be committed or aborted). */
static void writer_free(anneal_shard_writer *w) {
    free(w->buf);
    free(w);
}

anneal_status anneal_shard_writer_open(const char *path, uint32_t vocab_size, int32_t eot,
                                       uint64_t tokenizer_fingerprint, anneal_shard_writer **out) {
    if (!out) return anneal_set_error(ANNEAL_ERR_ARG, "shard writer: NULL out");
    *out = NULL;
    if (!path) return anneal_set_error(ANNEAL_ERR_ARG, "shard writer: NULL path");
    if (vocab_size == 0) return anneal_set_error(ANNEAL_ERR_ARG, "%s: shard writer: vocab_size is 0", path);
    if (eot < -1 || (eot >= 0 && (uint32_t)eot >= vocab_size))
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: shard writer: eot %d outside the vocabulary (vocab_size %u)",
                                path, eot, vocab_size);
    anneal_shard_writer *w = calloc(1, sizeof *w);
    if (w) w->buf = malloc(WRITER_BUF);
    if (!w || !w->buf) {
        if (w) writer_free(w);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: shard writer: out of memory", path);
    }
    w->info.version = ANNEAL_SHARD_VERSION;
    w->info.token_bytes = width_for_vocab(vocab_size);
    w->info.vocab_size = vocab_size;
    w->info.eot = eot;
    w->info.tokenizer_fingerprint = tokenizer_fingerprint;
    w->hash = FNV_OFFSET;
    anneal_status s = anneal_atomic_open(&w->af, path);
    if (s != ANNEAL_OK) {
        writer_free(w);
        return s;
    }
    /* Placeholder header (zeros: an interrupted temporary is never a valid shard). */
    unsigned char zero[SHARD_HEADER_SIZE] = {0};
    s = anneal_atomic_write(&w->af, zero, sizeof zero);
    if (s != ANNEAL_OK) {
        anneal_atomic_abort(&w->af);
        writer_free(w);
        return s;
    }
    *out = w;
    return ANNEAL_OK;
}

/* Writes the buffered bytes to the temporary. */
static anneal_status writer_flush(anneal_shard_writer *w) {
    if (!w->used) return ANNEAL_OK;
    anneal_status s = anneal_atomic_write(&w->af, w->buf, w->used);
    w->used = 0;
    return s;
}

anneal_status anneal_shard_writer_append(anneal_shard_writer *w, const int32_t *ids, size_t n) {
    if (!w) return anneal_set_error(ANNEAL_ERR_ARG, "shard writer: NULL writer");
    if (!ids && n) return anneal_set_error(ANNEAL_ERR_ARG, "%s: shard writer: NULL ids", w->af.path);
    const uint32_t width = w->info.token_bytes, vocab = w->info.vocab_size;
    /* Validate the whole call first so a rejected append writes nothing. */
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= vocab)
            return anneal_set_error(ANNEAL_ERR_ARG,
                                    "%s: shard writer: id %d at index %zu of this append is outside the vocabulary (vocab_size %u)",
                                    w->af.path, ids[i], i, vocab);
    size_t i = 0;
    while (i < n) {
        size_t room = (WRITER_BUF - w->used) / width;
        if (room == 0) {
            anneal_status s = writer_flush(w);
            if (s != ANNEAL_OK) return s;
            continue;
        }
        size_t k = n - i < room ? n - i : room;
        unsigned char *p = w->buf + w->used;
        if (width == 2)
            for (size_t j = 0; j < k; j++) {
                uint32_t v = (uint32_t)ids[i + j];
                p[2 * j] = (unsigned char)v;
                p[2 * j + 1] = (unsigned char)(v >> 8);
            }
        else
            for (size_t j = 0; j < k; j++) wr32(p + 4 * j, (uint32_t)ids[i + j]);
        w->hash = fnv1a(w->hash, p, k * width);
        w->used += k * width;
        w->info.n_tokens += k;
        i += k;
    }
    return ANNEAL_OK;
}

anneal_status anneal_shard_writer_finish(anneal_shard_writer *w) {
    if (!w) return anneal_set_error(ANNEAL_ERR_ARG, "shard writer: NULL writer");
    anneal_status s = writer_flush(w);
    if (s == ANNEAL_OK) {
        w->info.checksum = w->hash;
        unsigned char h[SHARD_HEADER_SIZE];
        encode_header(h, &w->info);
        size_t done = 0;
        while (done < sizeof h) {
            ssize_t r = pwrite(w->af.fd, h + done, sizeof h - done, (off_t)done);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                s = anneal_set_error(ANNEAL_ERR_IO, "%s: writing the shard header failed: %s", w->af.path,
                                     r < 0 ? strerror(errno) : "no progress");
                break;
            }
            done += (size_t)r;
        }
    }
    if (s == ANNEAL_OK) s = anneal_atomic_commit(&w->af); /* fsync, rename, fsync dir */
    else anneal_atomic_abort(&w->af);
    writer_free(w);
    return s;
}

void anneal_shard_writer_abort(anneal_shard_writer *w) {
    if (!w) return;
    anneal_atomic_abort(&w->af);
    writer_free(w);
}
