/* anneal prepare: text files (or stdin) -> train/val token shards + prepare.json.
 * Flag parsing and reporting only; the pipeline is src/data/prepare.c. */
#include "anneal/anneal.h"
#include "anneal/data.h"
#include "args.h"
#include "commands.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* "1234567" -> "1,234,567" into buf. */
static const char *commas(uint64_t v, char *buf) {
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v), o = 0;
    for (int i = 0; i < n; i++) {
        if (i > 0 && (n - i) % 3 == 0) buf[o++] = ',';
        buf[o++] = tmp[i];
    }
    buf[o] = '\0';
    return buf;
}

int anneal_cmd_prepare(int argc, char **argv) {
    const char *tokenizer = NULL, *out = NULL;
    cli_list inputs = {0};
    double val_fraction = 0.005;
    int64_t shard_tokens = 100000000, threads = 0, chunk_bytes = 1 << 20;
    bool help = false;
    cli_flag flags[] = {
        {"tokenizer", ARG_STRING, "gpt2, a directory (tokenizer.json or encoder.json + vocab.bpe) or a tokenizer.json", &tokenizer, 0},
        {"input", ARG_LIST, "text files, each one document (- reads stdin)", &inputs, 0},
        {"out", ARG_STRING, "output directory (created if missing)", &out, 0},
        {"val-fraction", ARG_FLOAT, "share of the input (its last bytes) for val_*.bin, in [0, 1) (default 0.005)", &val_fraction, 0},
        {"shard-tokens", ARG_INT, "tokens per shard file (default 100000000)", &shard_tokens, 0},
        {"threads", ARG_INT, "encoding threads (default: all cores)", &threads, 0},
        {"chunk-bytes", ARG_INT, "bytes per encoding chunk, 64..2^30 (default 1048576)", &chunk_bytes, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("prepare", argc, argv, flags, nf)) {
        free(inputs.items);
        return 2;
    }
    if (help) {
        cli_usage("prepare",
                  "Tokenizes text files into train/val token shards (format: docs/FORMATS.md).\n"
                  "Each input is one document; an end-of-text token precedes every document.",
                  flags, nf);
        free(inputs.items);
        return 0;
    }
    const char *missing = !tokenizer ? "tokenizer" : inputs.n == 0 ? "input" : !out ? "out" : NULL;
    if (missing) {
        fprintf(stderr, "anneal prepare: --%s is required (see anneal prepare --help)\n", missing);
        free(inputs.items);
        return 2;
    }
    struct { const char *flag, *range; bool bad; } checks[] = {
        {"val-fraction", "in [0, 1)", !(val_fraction >= 0 && val_fraction < 1)},
        {"shard-tokens", "> 0", shard_tokens <= 0},
        {"threads", ">= 0", threads < 0 || threads > 4096},
        {"chunk-bytes", "in 64..2^30", chunk_bytes < 64 || chunk_bytes > (1 << 30)},
    };
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++)
        if (checks[i].bad) {
            fprintf(stderr, "anneal prepare: --%s: value out of range (must be %s)\n", checks[i].flag,
                    checks[i].range);
            free(inputs.items);
            return 2;
        }
    int nthreads = threads > 0 ? (int)threads : anneal_get_num_threads();
    if (nthreads < 1) nthreads = 1;

    /* Inputs before the tokenizer: a mistyped path fails at once. */
    for (int i = 0; i < inputs.n; i++) {
        struct stat sb;
        if (strcmp(inputs.items[i], "-") && stat(inputs.items[i], &sb) != 0) {
            fprintf(stderr, "anneal prepare: %s: %s\n", inputs.items[i], strerror(errno));
            free(inputs.items);
            return 1;
        }
    }
    anneal_tokenizer *tok = NULL;
    if (anneal_tokenizer_load(tokenizer, &tok) != ANNEAL_OK) {
        fprintf(stderr, "anneal prepare: %s\n", anneal_last_error());
        free(inputs.items);
        return 1;
    }
    if (anneal_tokenizer_eot(tok) < 0)
        fprintf(stderr, "anneal prepare: note: the tokenizer has no end-of-text token; documents are "
                        "concatenated without a separator\n");
    anneal_prepare_config cfg = {
        .tok = tok,
        .tokenizer_spec = tokenizer,
        .inputs = inputs.items,
        .n_inputs = inputs.n,
        .out_dir = out,
        .val_fraction = val_fraction,
        .shard_tokens = (uint64_t)shard_tokens,
        .chunk_bytes = (uint64_t)chunk_bytes,
        .threads = nthreads,
        .progress = isatty(STDERR_FILENO) ? stderr : NULL,
    };
    anneal_prepare_result res;
    anneal_status st = anneal_prepare_run(&cfg, &res);
    if (st != ANNEAL_OK) {
        fprintf(stderr, "anneal prepare: %s\n", anneal_last_error());
        anneal_prepare_result_free(&res);
        anneal_tokenizer_free(tok);
        free(inputs.items);
        return 1;
    }
    char a[32], b[32], c[32];
    uint64_t tokens = res.train_tokens + res.val_tokens;
    double mb = (double)res.bytes / 1e6;
    printf("prepared %.2f MB from %llu document%s in %.2f s (%.2f MB/s, %d thread%s)\n", mb,
           (unsigned long long)res.documents, res.documents == 1 ? "" : "s", res.seconds,
           res.seconds > 0 ? mb / res.seconds : 0.0, nthreads, nthreads == 1 ? "" : "s");
    printf("tokens: %s (train %s, val %s), %.3f bytes/token\n", commas(tokens, a), commas(res.train_tokens, b),
           commas(res.val_tokens, c), tokens ? (double)res.bytes / (double)tokens : 0.0);
    printf("tokenizer: %s (vocab %d, eot %d, fingerprint 0x%016llx)\n", tokenizer, anneal_tokenizer_vocab_size(tok),
           anneal_tokenizer_eot(tok), (unsigned long long)anneal_tokenizer_fingerprint(tok));
    if (res.forced_cuts)
        printf("note: %llu chunk cut%s had no safe point within --chunk-bytes (see docs/FORMATS.md)\n",
               (unsigned long long)res.forced_cuts, res.forced_cuts == 1 ? "" : "s");
    if (res.stale_tmp_removed)
        printf("removed %d temporary file%s left in %s by an interrupted run\n", res.stale_tmp_removed,
               res.stale_tmp_removed == 1 ? "" : "s", out);
    if (res.stale_removed)
        printf("removed %d shard file%s left in %s by an earlier run\n", res.stale_removed,
               res.stale_removed == 1 ? "" : "s", out);
    printf("shards:\n");
    for (int i = 0; i < res.n_shards; i++)
        printf("  %s  %s tokens\n", res.shards[i].path, commas(res.shards[i].tokens, a));
    printf("  %s/prepare.json\n", out);
    anneal_prepare_result_free(&res);
    anneal_tokenizer_free(tok);
    free(inputs.items);
    return 0;
}
