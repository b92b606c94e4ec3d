/* Flag parsing for the anneal subcommands: --name value pairs (or --name=value),
 * with typed getters that validate and name the flag in every error. */
#ifndef ANNEAL_CLI_ARGS_H
#define ANNEAL_CLI_ARGS_H

#include <stdbool.h>
#include <stdint.h>

typedef enum { ARG_INT, ARG_FLOAT, ARG_STRING, ARG_BOOL } arg_kind;

typedef struct cli_flag {
    const char *name; /* without dashes */
    arg_kind kind;
    const char *help;
    void *dst;        /* int64_t*, double*, const char**, bool* */
    bool seen;
} cli_flag;

/* Parses argv against flags; unknown flags, missing values and bad numbers are
 * errors printed to stderr naming the flag. Returns false on error. */
bool cli_parse(const char *cmd, int argc, char **argv, cli_flag *flags, int n_flags);
/* Prints "usage: anneal CMD [flags]" and each flag's help. */
void cli_usage(const char *cmd, const char *summary, const cli_flag *flags, int n_flags);

#endif
