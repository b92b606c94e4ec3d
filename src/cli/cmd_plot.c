/* anneal plot RUN_DIR... : training curves of runs into a PNG or SVG (src/obs/plot.c). */
#include "anneal/anneal.h"
#include "anneal/telemetry.h"
#include "args.h"
#include "commands.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int anneal_cmd_plot(int argc, char **argv) {
    const char *out = NULL, *x = "step";
    int64_t width = 1200, height = 800;
    bool log_x = false, help = false;
    cli_list pos = {0};
    cli_flag flags[] = {
        {"out", ARG_STRING, "image to write: FILE.png or FILE.svg (default RUN_DIR/plot.png)", &out, 0},
        {"x", ARG_STRING, "x axis: step or tokens (default step)", &x, 0},
        {"log-x", ARG_BOOL, "logarithmic x axis", &log_x, 0},
        {"width", ARG_INT, "width in pixels (default 1200)", &width, 0},
        {"height", ARG_INT, "height in pixels (default 800)", &height, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse_ex("plot", argc, argv, flags, nf, &pos)) {
        free(pos.items);
        return 2;
    }
    if (help) {
        cli_usage("plot",
                  "usage: anneal plot RUN_DIR... [--out FILE.png|FILE.svg] [--x step|tokens] [--log-x]\n"
                  "Draws train/val loss, learning rate, tokens/s and memory of one or more runs (their log.jsonl).",
                  flags, nf);
        free(pos.items);
        return 0;
    }
    int rc = 0;
    char def[4096];
    if (pos.n < 1) {
        fprintf(stderr, "anneal plot: expects at least one RUN_DIR\n");
        rc = 2;
    } else if (strcmp(x, "step") && strcmp(x, "tokens")) {
        fprintf(stderr, "anneal plot: --x %s: expects step or tokens\n", x);
        rc = 2;
    } else if (width < 320 || width > 16384 || height < 240 || height > 16384) {
        fprintf(stderr, "anneal plot: --width/--height %lldx%lld: out of range (320x240 to 16384x16384)\n",
                (long long)width, (long long)height);
        rc = 2;
    }
    if (rc == 0) {
        if (!out) {
            snprintf(def, sizeof def, "%s/plot.png", pos.items[0]);
            out = def;
        }
        anneal_plot_options o = {.out = out, .width = (int)width, .height = (int)height, .log_x = log_x,
                                 .x_tokens = !strcmp(x, "tokens")};
        anneal_status st = anneal_plot_runs(pos.n, (const char *const *)pos.items, &o);
        anneal_plot_release_caches(); /* the command ends here */
        if (st != ANNEAL_OK) {
            fprintf(stderr, "anneal plot: %s\n", anneal_last_error());
            rc = st == ANNEAL_ERR_ARG ? 2 : 1;
        } else {
            printf("plot: %s (%d run%s, %lldx%lld)\n", out, pos.n, pos.n == 1 ? "" : "s", (long long)width,
                   (long long)height);
        }
    }
    free(pos.items);
    return rc;
}
