/* anneal info: version, CPU features the kernels use, thread count, backends and GPUs. */
#include "anneal/anneal.h"
#include "commands.h"

#include <stdio.h>
#include <string.h>

/* The GPUs of the CUDA backend, one line each, or why there are none (this build has
 * no CUDA backend, no driver, no device): "gpus: none (<why>)". Never fails. */
static void print_gpus(void) {
    char why[256] = "";
    int n = anneal_cuda_device_count(why, sizeof why);
    if (n <= 0) {
        printf("gpus: none (%s)\n", why[0] ? why : "no GPU found");
        return;
    }
    printf("gpus: %d\n", n);
    for (int i = 0; i < n; i++) {
        anneal_cuda_device_info d;
        if (anneal_cuda_device_info_get(i, &d) != ANNEAL_OK) {
            printf("gpu %d: %s\n", i, anneal_last_error());
            continue;
        }
        printf("gpu %d: %s, compute capability %d.%d, %d SMs, %.1f GiB, driver %d.%d, runtime %d.%d\n", i, d.name,
               d.cc_major, d.cc_minor, d.sm_count, (double)d.total_bytes / (1024.0 * 1024.0 * 1024.0),
               d.driver_version / 1000, d.driver_version % 1000 / 10, d.runtime_version / 1000,
               d.runtime_version % 1000 / 10);
    }
}

int anneal_cmd_info(int argc, char **argv) {
    (void)argv;
    if (argc > 0) {
        fprintf(stderr, "anneal info: takes no arguments\n");
        return 2;
    }
    const char *err = NULL, *limit = anneal_cpu_isa_limit_name(&err);
    if (!limit) {
        fprintf(stderr, "anneal info: %s\n", err);
        return 2;
    }
    printf("anneal %s\n", anneal_version());
    char line[512], model[160];
    anneal_cpu_features_line(line, sizeof line);
    printf("cpu: %s\n", anneal_cpu_model_name(model, sizeof model));
    printf("cpu features: %s\n", line);
    printf("isa limit: %s%s\n", limit, strcmp(limit, "best") ? " (ANNEAL_ISA)" : " (ANNEAL_ISA unset)");
    anneal_cpu_kernel_info rows[16];
    int n = anneal_cpu_kernel_report(rows, 16);
    printf("cpu kernels (the path each family takes here, and why):\n");
    for (int i = 0; i < n && i < 16; i++) printf("  %-15s %-11s %s\n", rows[i].family, rows[i].path, rows[i].why);
    printf("threads: %d\n", anneal_get_num_threads());
    printf("backends: cpu%s\n", anneal_cuda_built() ? ", cuda" : "");
    print_gpus();
    return 0;
}
