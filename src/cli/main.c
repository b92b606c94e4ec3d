/* anneal command-line tool: dispatches to subcommands. */
#include "anneal/anneal.h"
#include "commands.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
           "  export     write a checkpoint as a Hugging Face model directory\n"
           "  quantize   int8 quantization of a model (weight-only, dynamic, static)\n"
           "  inspect    describe a shard file\n"
           "  info       version, CPU features, threads\n"
           "  bench      bench peak: measure the peak fp32 / bf16 FLOP rate (MFU ceiling)\n"
           "  lora       lora merge: fold a PEFT LoRA adapter into its base model\n"
           "  plot       training curves of runs (loss, lr, tokens/s, memory) into PNG or SVG\n"
           "  report     one-screen summary of a run directory\n"
           "  serve      OpenAI-compatible HTTP server (completions, chat, streaming, metrics)\n",
           anneal_version());
}

/* OpenMP workers that wait by spinning (libgomp's default) burn CPU time that other
 * processes, and this one's own threads, need: on a busy 2-core machine a training
 * step took 2-2.5x as long as with OMP_WAIT_POLICY=passive and used 2.4x the CPU time
 * (docs/ARCHITECTURE.md, threads); on an idle machine passive costs a few hundred
 * futex wake-ups a step (~0.1%). Token-by-token work is the opposite case: a decode step
 * is ~50 short parallel regions, and waking sleeping workers for each (an IPI in a
 * virtual machine) took half of a GPT-2 124M int8 step on a Xeon (passive 10-13 ms, a
 * 20000-iteration spin 5-7 ms). So generate, serve and bench decode get a bounded spin
 * (GOMP_SPINCOUNT=20000, tens of microseconds, then sleep) and everything else passive.
 * libgomp reads these only when it loads, so when neither OMP_WAIT_POLICY nor
 * GOMP_SPINCOUNT is set the tool sets one and runs itself again, once; setting either
 * variable (e.g. OMP_WAIT_POLICY=active) keeps it. */
static void choose_wait_policy(int argc, char **argv) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || getenv("ANNEAL_NO_REEXEC")) return;
    const char *cmd = argc > 1 ? argv[1] : "";
    const bool tokens = !strcmp(cmd, "generate") || !strcmp(cmd, "serve") ||
                        (!strcmp(cmd, "bench") && argc > 2 && !strcmp(argv[2], "decode"));
    const char *name = tokens ? "GOMP_SPINCOUNT" : "OMP_WAIT_POLICY";
    if (setenv(name, tokens ? "20000" : "passive", 1) != 0) return;
    execv("/proc/self/exe", argv);
    unsetenv(name); /* exec failed: go on with the default policy */
}

int main(int argc, char **argv) {
    choose_wait_policy(argc, argv);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    const char *isa_error = NULL;
    if (!anneal_cpu_isa_limit_name(&isa_error)) { /* a kernel would silently ignore it */
        fprintf(stderr, "anneal: %s\n", isa_error);
        return 2;
    }
    if (!strcmp(cmd, "train")) return anneal_cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "info")) return anneal_cmd_info(argc - 2, argv + 2);
    if (!strcmp(cmd, "prepare")) return anneal_cmd_prepare(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenize")) return anneal_cmd_tokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenizer")) return anneal_cmd_tokenizer(argc - 2, argv + 2);
    if (!strcmp(cmd, "inspect")) return anneal_cmd_inspect(argc - 2, argv + 2);
    if (!strcmp(cmd, "generate")) return anneal_cmd_generate(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return anneal_cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "export")) return anneal_cmd_export(argc - 2, argv + 2);
    if (!strcmp(cmd, "quantize")) return anneal_cmd_quantize(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench")) return anneal_cmd_bench(argc - 2, argv + 2);
    if (!strcmp(cmd, "lora")) return anneal_cmd_lora(argc - 2, argv + 2);
    if (!strcmp(cmd, "plot")) return anneal_cmd_plot(argc - 2, argv + 2);
    if (!strcmp(cmd, "report")) return anneal_cmd_report(argc - 2, argv + 2);
    if (!strcmp(cmd, "serve")) return anneal_cmd_serve(argc - 2, argv + 2);
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("anneal %s\n", anneal_version());
        return 0;
    }
    fprintf(stderr, "anneal: unknown command '%s' (try anneal --help)\n", cmd);
    return 2;
}
