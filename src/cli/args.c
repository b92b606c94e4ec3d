/* Flag parsing for subcommands (see args.h). */
#include "args.h"
#include "anneal/parse.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool set_value(const char *cmd, cli_flag *f, const char *v) {
    switch (f->kind) {
    case ARG_INT: {
        int64_t x = 0;
        anneal_number_parse np = anneal_parse_decimal_i64(v, &x);
        if (np != ANNEAL_NUMBER_OK) {
            if (np == ANNEAL_NUMBER_RANGE)
                fprintf(stderr, "anneal %s: --%s: %s is out of range (a 64-bit integer)\n", cmd, f->name, v);
            else
                fprintf(stderr, "anneal %s: --%s expects a decimal integer, got '%s'\n", cmd, f->name, v);
            return false;
        }
        *(int64_t *)f->dst = x;
        break;
    }
    case ARG_FLOAT: {
        double x = 0;
        anneal_number_parse np = anneal_parse_decimal_f64(v, &x);
        if (np != ANNEAL_NUMBER_OK) {
            if (np == ANNEAL_NUMBER_RANGE)
                fprintf(stderr, "anneal %s: --%s: %s is out of range (a finite double)\n", cmd, f->name, v);
            else
                fprintf(stderr, "anneal %s: --%s expects a decimal number, got '%s'\n", cmd, f->name, v);
            return false;
        }
        *(double *)f->dst = x;
        break;
    }
    case ARG_STRING: *(const char **)f->dst = v; break;
    case ARG_LIST: break; /* filled by the caller */
    case ARG_BOOL:
        if (!strcmp(v, "on") || !strcmp(v, "true") || !strcmp(v, "1")) *(bool *)f->dst = true;
        else if (!strcmp(v, "off") || !strcmp(v, "false") || !strcmp(v, "0")) *(bool *)f->dst = false;
        else {
            fprintf(stderr, "anneal %s: --%s expects on or off, got '%s'\n", cmd, f->name, v);
            return false;
        }
        break;
    }
    f->seen = true;
    return true;
}

static bool list_push(cli_list *l, const char *v) {
    const char **it = realloc(l->items, (size_t)(l->n + 1) * sizeof *it);
    if (!it) return false;
    l->items = it;
    l->items[l->n++] = v;
    return true;
}

bool cli_parse(const char *cmd, int argc, char **argv, cli_flag *flags, int n_flags) {
    return cli_parse_ex(cmd, argc, argv, flags, n_flags, NULL);
}

bool cli_parse_ex(const char *cmd, int argc, char **argv, cli_flag *flags, int n_flags,
                  cli_list *positional) {
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || !strcmp(a, "-")) {
            if (positional) {
                if (!list_push(positional, a)) {
                    fprintf(stderr, "anneal %s: out of memory\n", cmd);
                    return false;
                }
                continue;
            }
            fprintf(stderr, "anneal %s: unexpected argument '%s' (flags start with --)\n", cmd, a);
            return false;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        cli_flag *f = NULL;
        for (int k = 0; k < n_flags; k++)
            if (strlen(flags[k].name) == len && !strncmp(flags[k].name, name, len)) f = &flags[k];
        if (!f) {
            fprintf(stderr, "anneal %s: unknown flag --%.*s (see anneal %s --help)\n", cmd, (int)len, name, cmd);
            return false;
        }
        if (f->kind == ARG_LIST) {
            cli_list *l = f->dst;
            if (eq && !list_push(l, eq + 1)) return false;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                if (!list_push(l, argv[++i])) return false;
            if (l->n == 0) {
                fprintf(stderr, "anneal %s: --%s needs at least one value\n", cmd, f->name);
                return false;
            }
            f->seen = true;
            continue;
        }
        const char *v = eq ? eq + 1 : NULL;
        if (!v && f->kind == ARG_BOOL && (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)) v = "on";
        if (!v) {
            if (i + 1 >= argc) {
                fprintf(stderr, "anneal %s: --%s needs a value\n", cmd, f->name);
                return false;
            }
            v = argv[++i];
        }
        if (!set_value(cmd, f, v)) return false;
    }
    return true;
}

void cli_usage(const char *cmd, const char *summary, const cli_flag *flags, int n_flags) {
    printf("usage: anneal %s [flags]\n%s\n\nflags:\n", cmd, summary);
    for (int k = 0; k < n_flags; k++) printf("  --%-16s %s\n", flags[k].name, flags[k].help);
}
