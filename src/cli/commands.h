/* Entry points of the anneal subcommands: each takes the arguments after its name
 * and returns the process exit code (0 ok, 1 failure, 2 usage error). */
#ifndef ANNEAL_CLI_COMMANDS_H
#define ANNEAL_CLI_COMMANDS_H

int anneal_cmd_train(int argc, char **argv);
int anneal_cmd_info(int argc, char **argv);
int anneal_cmd_tokenize(int argc, char **argv);      /* cmd_tokenize.c */
int anneal_cmd_tokenizer(int argc, char **argv);     /* cmd_tokenizer.c: "tokenizer train" */
int anneal_cmd_prepare(int argc, char **argv);       /* cmd_prepare.c */
int anneal_cmd_inspect(int argc, char **argv);       /* cmd_inspect.c */

#endif
