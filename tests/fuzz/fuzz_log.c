/* Fuzzes the readers of a run's training log (docs/FORMATS.md "Training log"):
 * `anneal report RUN_DIR` (src/cli/cmd_report.c, included here: its reader is the
 * command's own) and `anneal plot` (anneal_plot_runs, drawn to an SVG). The input is
 * RUN/log.jsonl. Their output goes to /dev/null. */
#include "cli/args.c"
#include "cli/cmd_report.c"
#include "anneal/telemetry.h"
#include "fuzz/fuzz_util.h"

/* Sends the commands' output to /dev/null and draws one plot, so that fontconfig's
 * process-wide caches exist before the first input (they are not a leak of it). */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    char d[600];
    snprintf(d, sizeof d, "%s/run", fuzz_dir());
    mkdir(d, 0755);
    if (!freopen("/dev/null", "w", stdout)) abort();
    static const char warm[] = "{\"type\":\"start\",\"tokens_per_step\":8}\n{\"type\":\"step\",\"step\":1,\"loss\":2}\n"
                               "{\"type\":\"step\",\"step\":2,\"loss\":1}\n";
    fuzz_write("run/log.jsonl", warm, sizeof warm - 1);
    const char *runs[1] = {fuzz_path("run")};
    anneal_plot_options o = {.out = fuzz_path("plot.svg"), .width = 300, .height = 200};
    (void)anneal_plot_runs(1, runs, &o);
    anneal_clear_error();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write("run/log.jsonl", data, size);
    char *argv[] = {(char *)fuzz_path("run"), NULL};
    FILE *saved = stderr; /* the report's errors are expected: silence them */
    stderr = fopen("/dev/null", "w");
    (void)anneal_cmd_report(1, argv);
    fclose(stderr);
    stderr = saved;
    if (size <= 8192) { /* drawing is slow: the small logs only */
        const char *runs[1] = {fuzz_path("run")};
        anneal_plot_options o = {.out = fuzz_path("plot.svg"), .width = 300, .height = 200};
        (void)anneal_plot_runs(1, runs, &o);
        anneal_clear_error();
    }
    return 0;
}
