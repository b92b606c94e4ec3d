/* anneal command-line tool: dispatches to subcommands. */
#include "anneal/anneal.h"
#include "commands.h"

#include <stdio.h>
#include <string.h>

static void usage(void) {
    printf("anneal %s: train and run GPT-2 style language models\n\n"
           "usage: anneal COMMAND [flags]   (anneal COMMAND --help for its flags)\n\n"
           "commands:\n"
           "  train      train a GPT-2 model (now: on synthetic tokens)\n"
           "  prepare    turn text files into token shards\n"
           "  tokenize   text on stdin -> ids (--decode: ids -> text)\n"
           "  tokenizer  tokenizer train: learn a byte-level BPE vocabulary\n"
           "  generate   continue a prompt with a trained model (streamed text)\n"
           "  eval       loss and perplexity of a checkpoint on token shards\n"
           "  inspect    describe a shard file\n"
           "  info       version, CPU features, threads\n",
           anneal_version());
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "train")) return anneal_cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "info")) return anneal_cmd_info(argc - 2, argv + 2);
    if (!strcmp(cmd, "prepare")) return anneal_cmd_prepare(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenize")) return anneal_cmd_tokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenizer")) return anneal_cmd_tokenizer(argc - 2, argv + 2);
    if (!strcmp(cmd, "inspect")) return anneal_cmd_inspect(argc - 2, argv + 2);
    if (!strcmp(cmd, "generate")) return anneal_cmd_generate(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return anneal_cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("anneal %s\n", anneal_version());
        return 0;
    }
    fprintf(stderr, "anneal: unknown command '%s' (try anneal --help)\n", cmd);
    return 2;
}
