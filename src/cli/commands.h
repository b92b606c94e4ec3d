/* Entry points of the anneal subcommands: each takes the arguments after its name
 * and returns the process exit code (0 ok, 1 failure, 2 usage error). */
#ifndef ANNEAL_CLI_COMMANDS_H
#define ANNEAL_CLI_COMMANDS_H

#include "anneal/core.h"

int anneal_cmd_train(int argc, char **argv);
int anneal_cmd_info(int argc, char **argv);
int anneal_cmd_tokenize(int argc, char **argv);      /* cmd_tokenize.c */
int anneal_cmd_tokenizer(int argc, char **argv);     /* cmd_tokenizer.c: "tokenizer train" */
int anneal_cmd_prepare(int argc, char **argv);       /* cmd_prepare.c */
int anneal_cmd_inspect(int argc, char **argv);       /* cmd_inspect.c */
int anneal_cmd_generate(int argc, char **argv);      /* cmd_generate.c */
int anneal_cmd_eval(int argc, char **argv);          /* cmd_eval.c */
int anneal_cmd_bench(int argc, char **argv);         /* cmd_bench.c: "bench peak" */
int anneal_cmd_lora(int argc, char **argv);          /* cmd_lora.c: "lora merge" */

struct anneal_model;
struct anneal_train_state;
/* cmd_generate.c, shared with eval: loads the checkpoint a --ckpt argument names (a
 * checkpoint or run directory; any registered architecture) into a new model, its
 * state and the run's config text (malloc'd, may be NULL). Prints the error naming
 * --ckpt and returns 1 on failure. */
int anneal_cli_load_checkpoint(const char *cmd, const char *arg, struct anneal_model **model,
                               struct anneal_train_state *st, char **config_json);
/* cmd_generate.c, shared with eval: --dtype fp32|bf16|fp16 (anneal_train_dtype_parse)
 * into *out. Prints the error and returns 2 for another name, else 0. */
int anneal_cli_parse_dtype(const char *cmd, const char *name, anneal_dtype *out);

#endif
