/* anneal tokenizer train: learns a byte-level BPE vocabulary from text files and writes
 * encoder.json, vocab.bpe (GPT-2's layout), tokenizer.json and tokenizer_config.json
 * (Hugging Face's: transformers' AutoTokenizer.from_pretrained(DIR) loads the directory),
 * all loadable with --tokenizer DIR. */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *SUMMARY =
    "Learns byte-level BPE merges (GPT-2 pre-tokenisation) from text files.\n"
    "  anneal tokenizer train --vocab-size N --input FILES... --out DIR [--threads N]\n"
    "The vocabulary is 256 byte tokens (GPT-2's order), N - 257 merges and <|endoftext|> (id N-1);\n"
    "if the text runs out of pairs first, the vocabulary is smaller (reported). Output is\n"
    "deterministic (independent of --threads). DIR gets GPT-2's files (encoder.json, vocab.bpe)\n"
    "and Hugging Face's (tokenizer.json, tokenizer_config.json: AutoTokenizer loads DIR).";

typedef struct progress_state {
    bool tty;
    int32_t target;
} progress_state;

/* Prints counting results once and, on a terminal, a merge counter. */
static void on_progress(const anneal_bpe_train_stats *s, void *user) {
    progress_state *p = user;
    if (s->phase == 0) {
        double mb = (double)s->total_bytes / 1e6;
        fprintf(stderr, "counted %.1f MB in %.2f s (%.1f MB/s): %llu pieces, %zu distinct\n", mb,
                s->count_seconds, s->count_seconds > 0 ? mb / s->count_seconds : 0.0,
                (unsigned long long)s->total_pieces, s->distinct_pieces);
    } else if (p->tty && s->phase == 1) {
        fprintf(stderr, "\rmerges %d / %d (last pair seen %lld times)   ", (int)s->n_merges,
                (int)p->target, (long long)s->last_count);
    }
}

int anneal_cmd_tokenizer(int argc, char **argv) {
    int64_t vocab = 0, threads = 0;
    const char *out = NULL;
    cli_list inputs = {0};
    bool help = false;
    cli_flag flags[] = {
        {"vocab-size", ARG_INT, "vocabulary size N, >= 257 (required)", &vocab, 0},
        {"input", ARG_LIST, "text files to learn from (required)", &inputs, 0},
        {"out", ARG_STRING, "output directory, created if missing (required)", &out, 0},
        {"threads", ARG_INT, "threads for reading and pre-tokenising (default: all cores)", &threads, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (argc < 1 || !strcmp(argv[0], "--help") || !strcmp(argv[0], "-h") || !strcmp(argv[0], "help")) {
        cli_usage("tokenizer train", SUMMARY, flags, nf);
        return argc < 1 ? 2 : 0;
    }
    if (strcmp(argv[0], "train") != 0) {
        fprintf(stderr, "anneal tokenizer: unknown subcommand '%s' (the one there is: train)\n", argv[0]);
        return 2;
    }
    int rc = 2;
    if (!cli_parse("tokenizer train", argc - 1, argv + 1, flags, nf)) goto done;
    if (help) {
        cli_usage("tokenizer train", SUMMARY, flags, nf);
        rc = 0;
        goto done;
    }
    if (!flags[0].seen || !flags[1].seen || !flags[2].seen) {
        fprintf(stderr, "anneal tokenizer train: %s is required (see --help)\n",
                !flags[0].seen ? "--vocab-size" : !flags[1].seen ? "--input" : "--out");
        goto done;
    }
    if (vocab < 257 || vocab > INT32_MAX) {
        fprintf(stderr, "anneal tokenizer train: --vocab-size must be between 257 and %d, got %lld\n",
                INT32_MAX, (long long)vocab);
        goto done;
    }
    if (threads < 0) {
        fprintf(stderr, "anneal tokenizer train: --threads must be >= 0, got %lld\n", (long long)threads);
        goto done;
    }
    if (threads > 0) anneal_set_num_threads((int)threads);
    progress_state ps = {isatty(2) != 0, (int32_t)vocab - 257};
    anneal_bpe_train_opts opts = {.n_threads = (int)threads, .progress = on_progress, .user = &ps,
                                  .progress_every = ps.tty ? 100 : 0};
    anneal_bpe_train_stats st;
    anneal_status s = anneal_bpe_train_ex(inputs.items, inputs.n, (int32_t)vocab, out, &opts, &st);
    if (ps.tty && st.n_merges > 0) fprintf(stderr, "\n");
    if (s != ANNEAL_OK) {
        fprintf(stderr, "anneal tokenizer train: %s\n", anneal_last_error());
        rc = 1;
        goto done;
    }
    double total = st.count_seconds + st.merge_seconds + st.write_seconds;
    printf("vocabulary %d (256 bytes + %d merges + <|endoftext|> = id %d) from %.1f MB in %.2f s "
           "(count %.2f s, merges %.2f s, write %.2f s)\n",
           (int)st.vocab_size, (int)st.n_merges, (int)st.vocab_size - 1, (double)st.total_bytes / 1e6, total,
           st.count_seconds, st.merge_seconds, st.write_seconds);
    if (st.vocab_size < vocab)
        printf("note: the text ran out of pairs to merge: the vocabulary is %d, not %lld\n",
               (int)st.vocab_size, (long long)vocab);
    printf("wrote %s/encoder.json, %s/vocab.bpe, %s/tokenizer.json\n", out, out, out);
    rc = 0;
done:
    free(inputs.items);
    return rc;
}
