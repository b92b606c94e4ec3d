/* anneal info: version, CPU features the kernels use, thread count, backends and GPUs. */
#include "anneal/anneal.h"
#include "commands.h"

#include <stdio.h>

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
    __builtin_cpu_init();
    printf("anneal %s\n", anneal_version());
    printf("cpu: avx2 %s, avx512f %s, avx512bf16 %s\n", __builtin_cpu_supports("avx2") ? "yes" : "no",
           __builtin_cpu_supports("avx512f") ? "yes" : "no",
           __builtin_cpu_supports("avx512bf16") ? "yes" : "no");
    printf("threads: %d\n", anneal_get_num_threads());
    printf("backends: cpu%s\n", anneal_cuda_built() ? ", cuda" : "");
    print_gpus();
    return 0;
}
