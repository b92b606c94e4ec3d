/* `anneal prepare`: text -> token shards (see prepare.h, docs/FORMATS.md).
 *
 * Shape of the pipeline, one batch at a time on the calling thread:
 *   read up to K chunks (each <= chunk_bytes, cut at safe points, never across files)
 *   -> encode the K chunks in parallel (OpenMP, dynamic schedule, one shared tokenizer)
 *   -> append their ids in chunk order (EOT before each document) to the train or val
 *      shard sink.
 * Chunk boundaries and the train/val split depend only on the input bytes, so the
 * shards are identical for any thread count; memory is K chunks whatever the input size. */
#include "anneal/prepare.h"
#include "tokenizer_impl.h"

#include "anneal/shard.h"
#include "anneal/fs.h"
#include "anneal/parse.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ERR_MSG_CAP 512

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------ safe cuts */

/* A printable ASCII byte other than space: never whitespace, never part of a
 * multi-byte character. */
static inline bool graphic(unsigned char c) { return c > 0x20 && c < 0x7f; }

/* Whether cutting text before position p (1 <= p, t[p] readable) cannot change GPT-2
 * pre-tokenisation: "x| " (a graphic byte, then a space: the space starts a new piece)
 * or "x\n|y" (a newline between graphic bytes is a piece of its own). Every piece that
 * contains whitespace either starts with a space or is whitespace only, so no piece
 * spans these points; the pattern's one lookahead, (?!\S) after a whitespace run, never
 * looks across them; and the pattern has no lookbehind, so matching after the cut
 * starts exactly as it would in the whole text. */
static inline bool safe_cut(const unsigned char *t, size_t p) {
    if (t[p] == ' ') return graphic(t[p - 1]);
    return p >= 2 && t[p - 1] == '\n' && graphic(t[p - 2]) && graphic(t[p]);
}

size_t anneal_prepare_find_cut(const char *text, size_t len, size_t target, bool space_only,
                               bool *forced) {
    const unsigned char *t = (const unsigned char *)text;
    *forced = false;
    if (target >= len) return len;
    for (size_t p = target; p >= 1; p--)
        if (space_only ? t[p] == ' ' && graphic(t[p - 1]) : safe_cut(t, p))
            return p;
    *forced = true;
    if (space_only) { /* the next chunk must start with a space (see prepare.h) */
        for (size_t p = target; p >= 1; p--)
            if (t[p] == ' ') return p;
        return 0;
    }
    /* No safe point in the whole chunk: cut at a character start so UTF-8 stays whole. */
    size_t p = target;
    for (int k = 0; k < 3 && p > 1 && (t[p] & 0xC0) == 0x80; k++) p--;
    return (t[p] & 0xC0) == 0x80 ? target : p;
}

/* --------------------------------------------------------------- inputs */

typedef struct input {
    const char *name;   /* as given ("-" for stdin) */
    int fd;             /* -1 until opened; stdin is spooled to an unlinked temporary */
    uint64_t size;      /* bytes, fixed at the start */
    uint64_t base;      /* offset of its first byte in the concatenated input */
} input;

/* Copies stdin into an unlinked temporary in dir (so its size is known and the split
 * can be placed); returns the descriptor, rewound, or -1 with the error set. */
static int spool_stdin(const char *dir, uint64_t *size) {
    char path[4096];
    snprintf(path, sizeof path, "%s/.stdin.tmp.%ld", dir, (long)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create a temporary for stdin: %s", path, strerror(errno));
        return -1;
    }
    unlink(path);
    char *buf = malloc(1 << 20);
    if (!buf) {
        close(fd);
        anneal_set_error(ANNEAL_ERR_OOM, "stdin: out of memory");
        return -1;
    }
    uint64_t total = 0;
    for (;;) {
        ssize_t r = read(STDIN_FILENO, buf, 1 << 20);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            anneal_set_error(ANNEAL_ERR_IO, "stdin: read failed: %s", strerror(errno));
            break;
        }
        if (r == 0) {
            free(buf);
            *size = total;
            if (lseek(fd, 0, SEEK_SET) != 0) {
                anneal_set_error(ANNEAL_ERR_IO, "stdin spool: seek failed: %s", strerror(errno));
                close(fd);
                return -1;
            }
            return fd;
        }
        if (anneal_write_all(fd, buf, (size_t)r, "stdin spool") != ANNEAL_OK) break;
        total += (uint64_t)r;
    }
    free(buf);
    close(fd);
    return -1;
}

/* Reads exactly n bytes at the current position of in->fd into dst. */
static anneal_status read_exact(input *in, char *dst, size_t n) {
    while (n > 0) {
        ssize_t r = read(in->fd, dst, n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: read failed: %s", in->name, strerror(errno));
        if (r == 0)
            return anneal_set_error(ANNEAL_ERR_IO, "%s: file shrank while reading (expected %llu bytes)",
                                    in->name, (unsigned long long)in->size);
        dst += r;
        n -= (size_t)r;
    }
    return ANNEAL_OK;
}

/* ---------------------------------------------------------------- chunks */

typedef struct chunk {
    char *text;           /* chunk_bytes capacity */
    size_t len;
    bool doc_start;       /* first chunk of an input: an EOT precedes it */
    bool val;
    anneal_ids ids;
    anneal_status st;
    char err[ERR_MSG_CAP];
} chunk;

/* Splits the inputs into chunks. buf holds the bytes of the current input from file
 * offset `off` that are read but not yet cut (len of them). */
typedef struct chunker {
    input *inputs;
    int n_inputs, cur;    /* current input index */
    char *buf;
    size_t cap, len;
    uint64_t off;         /* file offset of buf[0] within inputs[cur] */
    bool started;         /* inputs[cur] has produced its first chunk */
    size_t chunk_bytes;
    bool split_pending;   /* the train/val split is still ahead */
    uint64_t split_at;    /* global byte offset where val begins (aimed at) */
    bool in_val;
    uint64_t forced_cuts;
    bool space_only;      /* the tokenizer adds a prefix space: chunks must start with ' ' */
    bool strip_space;     /* SentencePiece with a ▁ prefix: a chunk that continues a document is
                           * encoded without its leading space (the prefix ▁ stands for it) */
} chunker;

/* Opens inputs[i] (stdin was spooled at the start). */
static anneal_status open_input(input *in) {
    if (in->fd >= 0) return ANNEAL_OK;
    do {
        in->fd = open(in->name, O_RDONLY | O_CLOEXEC);
    } while (in->fd < 0 && errno == EINTR);
    if (in->fd < 0) return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open: %s", in->name, strerror(errno));
    posix_fadvise(in->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    return ANNEAL_OK;
}

/* Produces the next chunk into c; *got false when every input is done. */
static anneal_status next_chunk(chunker *k, chunk *c, bool *got) {
    *got = false;
    while (k->cur < k->n_inputs) {
        input *in = &k->inputs[k->cur];
        anneal_status s = open_input(in);
        if (s != ANNEAL_OK) return s;
        uint64_t left_in_file = in->size - k->off; /* includes the len buffered bytes */
        if (left_in_file == 0 && k->started) {     /* input finished */
            close(in->fd);
            in->fd = -1;
            k->cur++;
            k->off = 0;
            k->len = 0;
            k->started = false;
            continue;
        }
        /* Where this chunk aims to end, in bytes from buf[0]. */
        uint64_t pos = in->base + k->off;
        bool aim_split = false;
        size_t target = k->chunk_bytes;
        if (k->split_pending && pos >= k->split_at) {
            k->split_pending = false;
            k->in_val = true;
        }
        if (k->split_pending && k->split_at - pos <= target && k->split_at - pos < left_in_file) {
            target = (size_t)(k->split_at - pos);
            aim_split = true;
        }
        /* Fill: the target plus 1 byte of lookahead, or the rest of the file. */
        uint64_t want = (uint64_t)target + 1 < left_in_file ? (uint64_t)target + 1 : left_in_file;
        if (k->len < want) {
            s = read_exact(in, k->buf + k->len, (size_t)(want - k->len));
            if (s != ANNEAL_OK) return s;
            k->len = (size_t)want;
        }
        size_t cut;
        if (target >= left_in_file) {
            cut = k->len; /* the rest of the file */
        } else {
            bool forced = false;
            cut = anneal_prepare_find_cut(k->buf, k->len, target, k->space_only, &forced);
            if (forced) k->forced_cuts++;
            if (cut == 0 && aim_split) { /* space_only: split where the last chunk ended */
                k->split_pending = false;
                k->in_val = true;
                continue;
            }
            if (cut == 0)
                return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                        "%s: no space within %zu bytes after offset %llu: this tokenizer adds a "
                                        "prefix space, so chunks must start at a space (raise --chunk-bytes)",
                                        in->name, target, (unsigned long long)k->off);
        }
        c->len = cut;
        memcpy(c->text, k->buf, cut);
        c->doc_start = !k->started;
        c->val = k->in_val;
        k->started = true;
        memmove(k->buf, k->buf + cut, k->len - cut);
        k->len -= cut;
        k->off += cut;
        if (aim_split) {
            k->split_pending = false;
            k->in_val = true;
        }
        *got = true;
        return ANNEAL_OK;
    }
    return ANNEAL_OK;
}

/* ----------------------------------------------------------------- sinks */

/* Writes one split's token stream into numbered shards of shard_tokens each. */
typedef struct sink {
    const char *split;            /* "train" or "val" */
    const anneal_prepare_config *cfg;
    uint32_t vocab;
    int32_t eot;
    uint64_t fingerprint;
    anneal_shard_writer *w;
    uint64_t in_shard, total;
    int next_index;
    anneal_prepare_result *res;
} sink;

static char *shard_path(const char *dir, const char *split, int index) {
    size_t n = strlen(dir) + strlen(split) + 32;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s_%06d.bin", dir, split, index);
    return p;
}

static anneal_status sink_open_next(sink *s) {
    char *path = shard_path(s->cfg->out_dir, s->split, s->next_index);
    if (!path) return anneal_set_error(ANNEAL_ERR_OOM, "prepare: out of memory");
    anneal_prepare_shard *sh = realloc(s->res->shards, (size_t)(s->res->n_shards + 1) * sizeof *sh);
    if (!sh) {
        free(path);
        return anneal_set_error(ANNEAL_ERR_OOM, "prepare: out of memory");
    }
    s->res->shards = sh;
    anneal_status st = anneal_shard_writer_open(path, s->vocab, s->eot, s->fingerprint, &s->w);
    if (st != ANNEAL_OK) {
        free(path);
        return st;
    }
    sh[s->res->n_shards++] = (anneal_prepare_shard){path, 0, !strcmp(s->split, "val")};
    s->next_index++;
    s->in_shard = 0;
    return ANNEAL_OK;
}

static anneal_status sink_close(sink *s) {
    if (!s->w) return ANNEAL_OK;
    anneal_status st = anneal_shard_writer_finish(s->w);
    s->w = NULL;
    return st;
}

/* Appends n ids, rolling over to a new shard every shard_tokens. */
static anneal_status sink_append(sink *s, const int32_t *ids, size_t n) {
    while (n > 0) {
        if (!s->w) {
            anneal_status st = sink_open_next(s);
            if (st != ANNEAL_OK) return st;
        }
        uint64_t room = s->cfg->shard_tokens - s->in_shard;
        size_t k = (uint64_t)n < room ? n : (size_t)room;
        anneal_status st = anneal_shard_writer_append(s->w, ids, k);
        if (st != ANNEAL_OK) return st;
        s->in_shard += k;
        s->total += k;
        s->res->shards[s->res->n_shards - 1].tokens = s->in_shard;
        ids += k;
        n -= k;
        if (s->in_shard == s->cfg->shard_tokens) {
            st = sink_close(s);
            if (st != ANNEAL_OK) return st;
        }
    }
    return ANNEAL_OK;
}

/* --------------------------------------------------------------- helpers */

/* Removes "<split>_NNNNNN.bin" files in dir with NNNNNN >= keep (an earlier run's extra
 * shards would otherwise be picked up by the loader). Returns how many were removed. */
static int remove_stale(const char *dir, const char *split, int keep) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int removed = 0;
    size_t sl = strlen(split);
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        if (strlen(n) != sl + 1 + 6 + 4 || strncmp(n, split, sl) || n[sl] != '_' || strcmp(n + sl + 7, ".bin"))
            continue;
        int idx = 0;
        bool digits = true;
        for (int i = 0; i < 6; i++) {
            char ch = n[sl + 1 + i];
            if (ch < '0' || ch > '9') digits = false;
            idx = idx * 10 + (ch - '0');
        }
        if (!digits || idx < keep) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, n);
        if (unlink(path) == 0) removed++;
    }
    closedir(d);
    return removed;
}

/* Progress line: MB read, MB/s, tokens, ETA. */
static void show_progress(FILE *f, uint64_t done, uint64_t total, uint64_t tokens, double elapsed) {
    double mb = (double)done / 1e6, rate = elapsed > 0 ? mb / elapsed : 0;
    double eta = rate > 0 ? ((double)(total - done) / 1e6) / rate : 0;
    int pct = total ? (int)(100.0 * (double)done / (double)total) : 100;
    fprintf(f, "\r\033[Kprepare: %3d%%  %.1f / %.1f MB  %.1f MB/s  %.2fM tokens  ETA %d:%02d", pct, mb,
            (double)total / 1e6, rate, (double)tokens / 1e6, (int)eta / 60, (int)eta % 60);
    fflush(f);
}

static char *hex64(uint64_t v, char *buf) {
    snprintf(buf, 19, "0x%016llx", (unsigned long long)v);
    return buf;
}

/* Writes DIR/prepare.json describing the run (atomically). */
static anneal_status write_manifest(const anneal_prepare_config *cfg, const input *inputs,
                                    const anneal_prepare_result *res) {
    char hex[24];
    cJSON *root = cJSON_CreateObject();
    cJSON *tk = cJSON_AddObjectToObject(root, "tokenizer");
    cJSON_AddStringToObject(root, "format", "anneal-prepare");
    cJSON_AddNumberToObject(root, "version", 1);
    /* a path is stored absolute, so the tokenizer is found from any directory (FORMATS.md) */
    char *abs = cfg->tokenizer_spec && strcmp(cfg->tokenizer_spec, "gpt2") ? realpath(cfg->tokenizer_spec, NULL) : NULL;
    cJSON_AddStringToObject(tk, "spec", abs ? abs : cfg->tokenizer_spec ? cfg->tokenizer_spec : "");
    free(abs);
    cJSON_AddStringToObject(tk, "fingerprint", hex64(anneal_tokenizer_fingerprint(cfg->tok), hex));
    cJSON_AddNumberToObject(tk, "vocab_size", anneal_tokenizer_vocab_size(cfg->tok));
    cJSON_AddNumberToObject(tk, "eot", anneal_tokenizer_eot(cfg->tok));
    cJSON_AddNumberToObject(root, "token_bytes", anneal_tokenizer_vocab_size(cfg->tok) <= 65536 ? 2 : 4);
    cJSON_AddNumberToObject(root, "val_fraction", cfg->val_fraction);
    cJSON_AddNumberToObject(root, "shard_tokens", (double)cfg->shard_tokens);
    cJSON_AddNumberToObject(root, "chunk_bytes", (double)cfg->chunk_bytes);
    cJSON_AddNumberToObject(root, "bytes", (double)res->bytes);
    cJSON_AddNumberToObject(root, "documents", (double)res->documents);
    cJSON_AddNumberToObject(root, "train_tokens", (double)res->train_tokens);
    cJSON_AddNumberToObject(root, "val_tokens", (double)res->val_tokens);
    cJSON *ins = cJSON_AddArrayToObject(root, "inputs");
    for (int i = 0; i < cfg->n_inputs; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "path", inputs[i].name);
        cJSON_AddNumberToObject(o, "bytes", (double)inputs[i].size);
        cJSON_AddItemToArray(ins, o);
    }
    cJSON *sh = cJSON_AddArrayToObject(root, "shards");
    for (int i = 0; i < res->n_shards; i++) {
        cJSON *o = cJSON_CreateObject();
        const char *slash = strrchr(res->shards[i].path, '/');
        cJSON_AddStringToObject(o, "file", slash ? slash + 1 : res->shards[i].path);
        cJSON_AddStringToObject(o, "split", res->shards[i].val ? "val" : "train");
        cJSON_AddNumberToObject(o, "tokens", (double)res->shards[i].tokens);
        cJSON_AddItemToArray(sh, o);
    }
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    size_t n = strlen(cfg->out_dir) + 16;
    char *path = malloc(n);
    if (!text || !path) {
        free(text);
        free(path);
        return anneal_set_error(ANNEAL_ERR_OOM, "prepare.json: out of memory");
    }
    snprintf(path, n, "%s/prepare.json", cfg->out_dir);
    size_t len = strlen(text);
    text[len] = '\n'; /* replaces the NUL: the buffer is written by length */
    anneal_status s = anneal_write_file_atomic(path, text, len + 1);
    free(text);
    free(path);
    return s;
}

/* The temporaries an interrupted prepare leaves in its --out: "<split>_NNNNNN.bin",
 * "prepare.json" and ".stdin" (the spool of standard input), each + ".tmp.<pid>". */
static bool prepare_owns(const char *base, size_t n) {
    if ((n == 12 && !strncmp(base, "prepare.json", 12)) || (n == 6 && !strncmp(base, ".stdin", 6))) return true;
    size_t sl = n >= 16 && !strncmp(base, "train_", 6) ? 5 : n >= 14 && !strncmp(base, "val_", 4) ? 3 : 0;
    if (!sl || n != sl + 1 + 6 + 4 || strncmp(base + sl + 7, ".bin", 4)) return false;
    for (size_t i = 0; i < 6; i++)
        if (base[sl + 1 + i] < '0' || base[sl + 1 + i] > '9') return false;
    return true;
}

/* Validates cfg, stats every input (so a missing file fails before anything is
 * written) and prepares the output directory. */
static anneal_status setup(const anneal_prepare_config *cfg, input *inputs, uint64_t *total, int *stale_tmp) {
    if (!cfg->tok) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: no tokenizer");
    if (!cfg->out_dir || !*cfg->out_dir) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: no output directory");
    if (cfg->n_inputs <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: no input files");
    if (!(cfg->val_fraction >= 0 && cfg->val_fraction < 1))
        return anneal_set_error(ANNEAL_ERR_ARG, "prepare: val fraction %g outside [0, 1)", cfg->val_fraction);
    if (cfg->shard_tokens == 0) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: shard tokens must be > 0");
    if (cfg->chunk_bytes < 64 || cfg->chunk_bytes > ((uint64_t)1 << 30))
        return anneal_set_error(ANNEAL_ERR_ARG, "prepare: chunk bytes %llu outside [64, 2^30]",
                                (unsigned long long)cfg->chunk_bytes);
    if (cfg->threads <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: threads must be > 0");
    int n_stdin = 0;
    for (int i = 0; i < cfg->n_inputs; i++) {
        inputs[i] = (input){cfg->inputs[i], -1, 0, 0};
        if (!strcmp(cfg->inputs[i], "-")) {
            if (++n_stdin > 1) return anneal_set_error(ANNEAL_ERR_ARG, "prepare: stdin (-) given twice");
            continue;
        }
        struct stat st;
        if (stat(cfg->inputs[i], &st) != 0)
            return anneal_set_error(ANNEAL_ERR_IO, "%s: %s", cfg->inputs[i], strerror(errno));
        if (!S_ISREG(st.st_mode))
            return anneal_set_error(ANNEAL_ERR_IO, "%s: not a regular file", cfg->inputs[i]);
        if (access(cfg->inputs[i], R_OK) != 0)
            return anneal_set_error(ANNEAL_ERR_IO, "%s: %s", cfg->inputs[i], strerror(errno));
        inputs[i].size = (uint64_t)st.st_size;
    }
    if (mkdir(cfg->out_dir, 0777) != 0 && errno != EEXIST)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create output directory: %s", cfg->out_dir,
                                strerror(errno));
    struct stat st;
    if (stat(cfg->out_dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return anneal_set_error(ANNEAL_ERR_IO, "%s: not a directory", cfg->out_dir);
    /* what an interrupted earlier run left half-written (its pid no longer lives) */
    *stale_tmp = anneal_remove_stale_tmp_files(cfg->out_dir, prepare_owns);
    /* An earlier run's manifest would describe shards this run replaces. */
    char path[4096];
    snprintf(path, sizeof path, "%s/prepare.json", cfg->out_dir);
    if (unlink(path) != 0 && errno != ENOENT)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
    for (int i = 0; i < cfg->n_inputs; i++)
        if (!strcmp(cfg->inputs[i], "-")) {
            inputs[i].fd = spool_stdin(cfg->out_dir, &inputs[i].size);
            if (inputs[i].fd < 0) return anneal_last_status() ? anneal_last_status() : ANNEAL_ERR_IO;
        }
    *total = 0;
    for (int i = 0; i < cfg->n_inputs; i++) {
        inputs[i].base = *total;
        *total += inputs[i].size;
    }
    return ANNEAL_OK;
}

/* Whether encode() puts a space before text that does not start with one (Hugging Face
 * ByteLevel add_prefix_space): then "a" and " a" encode alike. Such a prefix belongs at
 * the start of a document only, so later chunks must begin with a space already. */
static anneal_status adds_prefix_space(const anneal_tokenizer *tok, bool *yes) {
    anneal_ids a = {0}, b = {0};
    anneal_status s = anneal_tokenizer_encode(tok, "a", 1, false, &a);
    if (s == ANNEAL_OK) s = anneal_tokenizer_encode(tok, " a", 2, false, &b);
    *yes = s == ANNEAL_OK && a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof *a.ids);
    anneal_ids_free(&a);
    anneal_ids_free(&b);
    return s;
}

/* ------------------------------------------------------------------ run */

anneal_status anneal_prepare_run(const anneal_prepare_config *cfg, anneal_prepare_result *res) {
    memset(res, 0, sizeof *res);
    double t0 = now_s();
    int n_in = cfg->n_inputs > 0 ? cfg->n_inputs : 1;
    input *inputs = calloc((size_t)n_in, sizeof *inputs);
    if (!inputs) return anneal_set_error(ANNEAL_ERR_OOM, "prepare: out of memory");
    for (int i = 0; i < n_in; i++) inputs[i].fd = -1;
    uint64_t total = 0;
    anneal_status st = setup(cfg, inputs, &total, &res->stale_tmp_removed);

    /* Chunks in flight: 4 per thread for load balance, trimmed (not below one per
     * thread) so their text stays under 256 MiB. Memory is about twice that (ids). */
    int K = 4 * (cfg->threads > 0 ? cfg->threads : 1);
    while (K > cfg->threads && (uint64_t)K * cfg->chunk_bytes > ((uint64_t)256 << 20)) K--;
    chunk *chunks = NULL;
    chunker ck = {0};
    sink train = {0}, val = {0};
    if (st == ANNEAL_OK) {
        chunks = calloc((size_t)K, sizeof *chunks);
        ck = (chunker){.inputs = inputs, .n_inputs = cfg->n_inputs, .chunk_bytes = (size_t)cfg->chunk_bytes,
                       .cap = (size_t)cfg->chunk_bytes + 1};
        ck.buf = malloc(ck.cap);
        bool ok = chunks && ck.buf;
        for (int i = 0; ok && i < K; i++) ok = (chunks[i].text = malloc((size_t)cfg->chunk_bytes)) != NULL;
        if (!ok) st = anneal_set_error(ANNEAL_ERR_OOM, "prepare: out of memory for %d chunks", K);
    }
    if (st == ANNEAL_OK) st = adds_prefix_space(cfg->tok, &ck.space_only);
    if (st == ANNEAL_OK) { /* SentencePiece-style BPE: whole segments, so cuts only before a space */
        bool sp_space;
        int32_t crossing;
        anneal_tok_chunking(cfg->tok, &sp_space, &ck.strip_space, &crossing);
        ck.space_only |= sp_space;
        if (crossing >= 0) {
            size_t n;
            const char *b = anneal_tokenizer_token_bytes(cfg->tok, crossing, &n);
            st = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                  "prepare: token %d (\"%.*s\") of the tokenizer joins a word to the space after it, "
                                  "so the text cannot be encoded in chunks exactly",
                                  (int)crossing, (int)(n > 40 ? 40 : n), b);
        }
    }
    if (st == ANNEAL_OK && cfg->val_fraction > 0) {
        /* val = the inputs' last ceil(F * total) bytes (moved back to a safe cut). */
        uint64_t vb = (uint64_t)ceil(cfg->val_fraction * (double)total);
        ck.split_pending = vb > 0;
        ck.split_at = total - (vb < total ? vb : total);
    }
    const int32_t eot = anneal_tokenizer_eot(cfg->tok);
    const uint32_t vocab = (uint32_t)anneal_tokenizer_vocab_size(cfg->tok);
    const uint64_t fp = anneal_tokenizer_fingerprint(cfg->tok);
    train = (sink){"train", cfg, vocab, eot, fp, NULL, 0, 0, 0, res};
    val = (sink){"val", cfg, vocab, eot, fp, NULL, 0, 0, 0, res};
    /* Train shards are listed before val shards in res: val is written into a
     * separate list first and appended at the end. */
    anneal_prepare_result val_res = {0};
    val.res = &val_res;

    double last_shown = 0;
    uint64_t done_bytes = 0;
    bool more = st == ANNEAL_OK;
    while (more) {
        int n = 0;
        while (n < K) {
            bool got = false;
            st = next_chunk(&ck, &chunks[n], &got);
            if (st != ANNEAL_OK || !got) break;
            n++;
        }
        if (st != ANNEAL_OK) break;
        more = n == K;
        /* Encode: each chunk independently; errors are captured per chunk because
         * anneal's error state is per thread. */
#pragma omp parallel for num_threads(cfg->threads) schedule(dynamic, 1)
        for (int i = 0; i < n; i++) {
            chunk *c = &chunks[i];
            c->ids.n = 0;
            anneal_clear_error();
            size_t skip = ck.strip_space && !c->doc_start && c->len && c->text[0] == ' ';
            c->st = anneal_tokenizer_encode(cfg->tok, c->text + skip, c->len - skip, false, &c->ids);
            if (c->st != ANNEAL_OK) snprintf(c->err, sizeof c->err, "%s", anneal_last_error());
        }
        for (int i = 0; i < n && st == ANNEAL_OK; i++) {
            chunk *c = &chunks[i];
            if (c->st != ANNEAL_OK) {
                st = anneal_set_error(c->st, "prepare: encoding failed: %s", c->err);
                break;
            }
            sink *s = c->val ? &val : &train;
            if (c->doc_start) {
                res->documents++;
                if (eot >= 0) st = sink_append(s, &eot, 1);
            }
            if (st == ANNEAL_OK) st = sink_append(s, c->ids.ids, c->ids.n);
            done_bytes += c->len;
        }
        if (st != ANNEAL_OK) break;
        double t = now_s();
        if (cfg->progress && (t - last_shown > 0.2 || !more)) {
            show_progress(cfg->progress, done_bytes, total, train.total + val.total, t - t0);
            last_shown = t;
        }
    }
    if (cfg->progress && last_shown > 0) {
        fputs("\r\033[K", cfg->progress);
        fflush(cfg->progress);
    }
    /* Close the last shards; a split that received no tokens still gets an (empty)
     * first shard so that the directory always has train_000000.bin (and val_000000.bin
     * when a val fraction was asked for). */
    if (st == ANNEAL_OK && train.next_index == 0) st = sink_open_next(&train);
    if (st == ANNEAL_OK) st = sink_close(&train);
    if (st == ANNEAL_OK && cfg->val_fraction > 0 && val.next_index == 0) st = sink_open_next(&val);
    if (st == ANNEAL_OK) st = sink_close(&val);
    if (train.w) anneal_shard_writer_abort(train.w);
    if (val.w) anneal_shard_writer_abort(val.w);
    /* Move the val shards after the train shards in res. */
    if (val_res.n_shards) {
        anneal_prepare_shard *all =
            realloc(res->shards, (size_t)(res->n_shards + val_res.n_shards) * sizeof *all);
        if (all) {
            memcpy(all + res->n_shards, val_res.shards, (size_t)val_res.n_shards * sizeof *all);
            res->shards = all;
            res->n_shards += val_res.n_shards;
            free(val_res.shards);
        } else {
            for (int i = 0; i < val_res.n_shards; i++) free(val_res.shards[i].path);
            free(val_res.shards);
            if (st == ANNEAL_OK) st = anneal_set_error(ANNEAL_ERR_OOM, "prepare: out of memory");
        }
    }
    res->bytes = done_bytes;
    res->train_tokens = train.total;
    res->val_tokens = val.total;
    res->forced_cuts = ck.forced_cuts;
    if (st == ANNEAL_OK) {
        res->stale_removed = remove_stale(cfg->out_dir, "train", train.next_index) +
                             remove_stale(cfg->out_dir, "val", val.next_index);
        st = write_manifest(cfg, inputs, res);
    }
    res->seconds = now_s() - t0;

    for (int i = 0; i < cfg->n_inputs; i++)
        if (inputs[i].fd >= 0) close(inputs[i].fd);
    free(inputs);
    for (int i = 0; chunks && i < K; i++) {
        free(chunks[i].text);
        anneal_ids_free(&chunks[i].ids);
    }
    free(chunks);
    free(ck.buf);
    return st;
}

void anneal_prepare_result_free(anneal_prepare_result *res) {
    if (!res) return;
    for (int i = 0; i < res->n_shards; i++) free(res->shards[i].path);
    free(res->shards);
    memset(res, 0, sizeof *res);
}
