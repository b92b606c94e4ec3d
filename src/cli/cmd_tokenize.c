/* anneal tokenize: text on stdin -> ids on stdout (one line, space-separated), or with
 * --decode whitespace-separated ids on stdin -> the bytes they stand for. --bench times
 * the encoding (one thread) and reports MB/s on stderr. */
#include "anneal/tokenizer.h"
#include "args.h"
#include "commands.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Reads all of stdin into a malloc'd buffer (NUL-terminated). */
static char *read_stdin(size_t *n) {
    size_t cap = 1 << 16, len = 0;
    char *b = malloc(cap + 1);
    if (!b) return NULL;
    for (;;) {
        size_t got = fread(b + len, 1, cap - len, stdin);
        len += got;
        if (len < cap) {
            if (ferror(stdin)) {
                free(b);
                return NULL;
            }
            if (feof(stdin) || got == 0) break;
            continue;
        }
        char *nb = realloc(b, cap * 2 + 1);
        if (!nb) {
            free(b);
            return NULL;
        }
        b = nb;
        cap *= 2;
    }
    b[len] = 0;
    *n = len;
    return b;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Writes ids as one line of decimal numbers separated by spaces. */
static bool print_ids(const anneal_ids *ids) {
    char buf[1 << 16];
    size_t o = 0;
    for (size_t i = 0; i < ids->n; i++) {
        if (o > sizeof buf - 16) {
            if (fwrite(buf, 1, o, stdout) != o) return false;
            o = 0;
        }
        o += (size_t)snprintf(buf + o, 16, i ? " %d" : "%d", (int)ids->ids[i]);
    }
    buf[o++] = '\n';
    return fwrite(buf, 1, o, stdout) == o && fflush(stdout) == 0;
}

/* Parses whitespace-separated ids; errors name the bad item and its position. */
static int parse_ids(const char *text, size_t n, int32_t vocab, anneal_ids *ids) {
    size_t i = 0;
    while (i < n) {
        while (i < n && (text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r' || text[i] == ','))
            i++;
        if (i >= n) break;
        size_t s = i;
        while (i < n && !(text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r' || text[i] == ','))
            i++;
        long long v = 0;
        bool ok = i - s <= 10;
        for (size_t k = s; ok && k < i; k++) {
            ok = text[k] >= '0' && text[k] <= '9';
            v = v * 10 + (text[k] - '0');
        }
        if (!ok) {
            fprintf(stderr, "anneal tokenize --decode: \"%.*s\" (position %zu) is not an id (a non-negative integer)\n",
                    (int)(i - s > 40 ? 40 : i - s), text + s, ids->n);
            return 1;
        }
        if (v >= vocab) {
            fprintf(stderr, "anneal tokenize --decode: id %lld (position %zu) is out of range: the tokenizer has %d ids "
                    "(0..%d)\n", v, ids->n, (int)vocab, (int)vocab - 1);
            return 1;
        }
        if (anneal_ids_push(ids, (int32_t)v) != ANNEAL_OK) {
            fprintf(stderr, "anneal tokenize --decode: out of memory\n");
            return 1;
        }
    }
    return 0;
}

int anneal_cmd_tokenize(int argc, char **argv) {
    const char *spec = "gpt2";
    bool decode = false, allow_special = false, bench = false, help = false;
    cli_flag flags[] = {
        {"tokenizer", ARG_STRING, "gpt2, a directory (encoder.json + vocab.bpe, or tokenizer.json) or a tokenizer.json (default gpt2)", &spec, 0},
        {"decode", ARG_BOOL, "read whitespace-separated ids and write the text they decode to", &decode, 0},
        {"allow-special", ARG_BOOL, "encode special tokens such as <|endoftext|> as their ids (default: as text)", &allow_special, 0},
        {"bench", ARG_BOOL, "time the encoding on one thread and report MB/s on stderr", &bench, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof *flags);
    if (!cli_parse("tokenize", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("tokenize", "Text on stdin -> token ids on stdout (one line); --decode: ids on stdin -> text.", flags, nf);
        return 0;
    }
    if (decode && bench) {
        fprintf(stderr, "anneal tokenize: --bench times encoding; it does not combine with --decode\n");
        return 2;
    }
    anneal_tokenizer *tok = NULL;
    if (anneal_tokenizer_load(spec, &tok) != ANNEAL_OK) {
        fprintf(stderr, "anneal tokenize --tokenizer: %s\n", anneal_last_error());
        return 1;
    }
    size_t n = 0;
    char *text = read_stdin(&n);
    if (!text) {
        fprintf(stderr, "anneal tokenize: cannot read stdin\n");
        anneal_tokenizer_free(tok);
        return 1;
    }
    int rc = 0;
    anneal_ids ids = {0};
    if (decode) {
        rc = parse_ids(text, n, anneal_tokenizer_vocab_size(tok), &ids);
        char *out = NULL;
        size_t len = 0;
        if (!rc && anneal_tokenizer_decode(tok, ids.ids, ids.n, &out, &len) != ANNEAL_OK) {
            fprintf(stderr, "anneal tokenize --decode: %s\n", anneal_last_error());
            rc = 1;
        }
        if (!rc && (fwrite(out, 1, len, stdout) != len || fflush(stdout) != 0)) {
            fprintf(stderr, "anneal tokenize: cannot write stdout\n");
            rc = 1;
        }
        free(out);
    } else {
        double t0 = now_s();
        anneal_status s = anneal_tokenizer_encode(tok, text, n, allow_special, &ids);
        double cold = now_s() - t0;
        if (s != ANNEAL_OK) {
            fprintf(stderr, "anneal tokenize: %s\n", anneal_last_error());
            rc = 1;
        }
        if (!rc && bench) {
            /* warm: the piece cache already holds this text's pieces */
            double warm = 1e30;
            for (int r = 0; r < 3 && !rc; r++) {
                anneal_ids again = {0};
                t0 = now_s();
                rc = anneal_tokenizer_encode(tok, text, n, allow_special, &again) != ANNEAL_OK;
                double dt = now_s() - t0;
                if (dt < warm) warm = dt;
                if (!rc && (again.n != ids.n || memcmp(again.ids, ids.ids, ids.n * sizeof *ids.ids))) {
                    fprintf(stderr, "anneal tokenize --bench: a repeated encode gave different ids\n");
                    rc = 1;
                }
                anneal_ids_free(&again);
            }
            fprintf(stderr,
                    "anneal tokenize --bench: %zu bytes -> %zu ids, one thread: first encode %.4f s (%.1f MB/s), "
                    "warm cache best of 3 %.4f s (%.1f MB/s)\n",
                    n, ids.n, cold, (double)n / cold / 1e6, warm, (double)n / warm / 1e6);
        }
        if (!rc && !print_ids(&ids)) {
            fprintf(stderr, "anneal tokenize: cannot write stdout\n");
            rc = 1;
        }
    }
    anneal_ids_free(&ids);
    free(text);
    anneal_tokenizer_free(tok);
    return rc;
}
