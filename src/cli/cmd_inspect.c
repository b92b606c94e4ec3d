/* anneal inspect FILE: describes an anneal file. The kind is recognised from the
 * first bytes (a table of probes), so other formats (safetensors, checkpoints) are one
 * more entry in `kinds`. Today: token shards. */
#include "anneal/anneal.h"
#include "anneal/data.h"
#include "args.h"
#include "commands.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct inspect_opts {
    bool ids;      /* print every id (only the ids, one line) */
    int64_t head;  /* how many leading ids the description shows */
} inspect_opts;

/* Prints ids [0, n) of s space-separated on one line, through a large buffer. */
static void print_ids(const anneal_shard *s, uint64_t n) {
    char buf[1 << 16];
    size_t used = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (used > sizeof buf - 16) {
            fwrite(buf, 1, used, stdout);
            used = 0;
        }
        used += (size_t)snprintf(buf + used, sizeof buf - used, i ? " %u" : "%u", anneal_shard_token(s, i));
    }
    fwrite(buf, 1, used, stdout);
    putchar('\n');
}

/* A token shard: header fields, verified checksum, document count, first ids. */
static int inspect_shard(const char *path, const inspect_opts *o) {
    anneal_shard *s = NULL;
    if (anneal_shard_open(path, true, &s) != ANNEAL_OK) {
        fprintf(stderr, "anneal inspect: %s\n", anneal_last_error());
        return 1;
    }
    const anneal_shard_info *in = &s->info;
    if (o->ids) {
        print_ids(s, in->n_tokens);
        anneal_shard_close(s);
        return 0;
    }
    uint64_t docs = 0;
    if (in->eot >= 0)
        for (uint64_t i = 0; i < in->n_tokens; i++) docs += anneal_shard_token(s, i) == (uint32_t)in->eot;
    printf("file: %s\n", path);
    printf("kind: anneal token shard (%s), version %u\n", ANNEAL_SHARD_MAGIC, in->version);
    printf("token bytes: %u (%s ids)\n", in->token_bytes, in->token_bytes == 2 ? "u16" : "u32");
    printf("vocab size: %u\n", in->vocab_size);
    if (in->eot >= 0) printf("eot: %d (%llu in this shard)\n", in->eot, (unsigned long long)docs);
    else printf("eot: none\n");
    printf("tokens: %llu\n", (unsigned long long)in->n_tokens);
    printf("tokenizer fingerprint: 0x%016llx\n", (unsigned long long)in->tokenizer_fingerprint);
    printf("checksum: 0x%016llx (verified)\n", (unsigned long long)in->checksum);
    uint64_t head = (uint64_t)o->head < in->n_tokens ? (uint64_t)o->head : in->n_tokens;
    printf("first %llu ids: ", (unsigned long long)head);
    print_ids(s, head);
    anneal_shard_close(s);
    return 0;
}

/* Recognised kinds: magic prefix -> describer. */
static const struct {
    const char *magic;
    size_t len;
    int (*inspect)(const char *path, const inspect_opts *o);
} kinds[] = {
    {ANNEAL_SHARD_MAGIC, 8, inspect_shard},
};

int anneal_cmd_inspect(int argc, char **argv) {
    inspect_opts o = {false, 16};
    bool help = false;
    cli_list pos = {0};
    cli_flag flags[] = {
        {"ids", ARG_BOOL, "print every token id on one line (and nothing else)", &o.ids, 0},
        {"head", ARG_INT, "how many leading ids to show (default 16)", &o.head, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse_ex("inspect", argc, argv, flags, nf, &pos)) {
        free(pos.items);
        return 2;
    }
    if (help) {
        cli_usage("inspect", "usage: anneal inspect FILE [--ids] [--head N]\nDescribes a token shard.", flags,
                  nf);
        free(pos.items);
        return 0;
    }
    if (pos.n != 1 || o.head < 0) {
        if (pos.n != 1) fprintf(stderr, "anneal inspect: expects exactly one FILE (got %d)\n", pos.n);
        else fprintf(stderr, "anneal inspect: --head: value out of range (must be >= 0)\n");
        free(pos.items);
        return 2;
    }
    const char *path = pos.items[0];
    free(pos.items);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "anneal inspect: %s: %s\n", path, strerror(errno));
        return 1;
    }
    unsigned char head[16] = {0};
    size_t got = fread(head, 1, sizeof head, f);
    fclose(f);
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
        if (got >= kinds[k].len && !memcmp(head, kinds[k].magic, kinds[k].len)) return kinds[k].inspect(path, &o);
    /* Unknown: the shard reader names what it found. */
    return inspect_shard(path, &o);
}
