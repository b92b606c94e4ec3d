/* Flag parsing for the anneal subcommands: --name value pairs (or --name=value),
 * with typed getters that validate and name the flag in every error. */
#ifndef ANNEAL_CLI_ARGS_H
#define ANNEAL_CLI_ARGS_H

#include <stdbool.h>
#include <stdint.h>

typedef enum { ARG_INT, ARG_FLOAT, ARG_STRING, ARG_BOOL, ARG_LIST } arg_kind;

/* Values of an ARG_LIST flag (every argument after it up to the next --flag) or the
 * positional arguments. Points into argv. */
typedef struct cli_list {
    const char **items;
    int n;
} cli_list;

typedef struct cli_flag {
    const char *name; /* without dashes */
    arg_kind kind;
    const char *help;
    void *dst;        /* int64_t*, double*, const char**, bool*, cli_list* */
    bool seen;
} cli_flag;

/* Parses argv against flags; unknown flags, missing values and bad numbers are
 * errors printed to stderr naming the flag. Returns false on error. */
bool cli_parse(const char *cmd, int argc, char **argv, cli_flag *flags, int n_flags);
/* Like cli_parse, but arguments that are not flags are collected into positional
 * (which the caller frees with free(positional->items)); list flags are allowed. */
bool cli_parse_ex(const char *cmd, int argc, char **argv, cli_flag *flags, int n_flags,
                  cli_list *positional);
/* Prints "usage: anneal CMD [flags]" and each flag's help. */
void cli_usage(const char *cmd, const char *summary, const cli_flag *flags, int n_flags);

#endif
