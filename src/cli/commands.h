/* Entry points of the anneal subcommands: each takes the arguments after its name
 * and returns the process exit code (0 ok, 1 failure, 2 usage error). */
#ifndef ANNEAL_CLI_COMMANDS_H
#define ANNEAL_CLI_COMMANDS_H

int anneal_cmd_train(int argc, char **argv);
int anneal_cmd_info(int argc, char **argv);

#endif
