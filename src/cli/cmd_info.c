/* anneal info: version, CPU features the kernels use, thread count. */
#include "anneal/anneal.h"
#include "commands.h"

#include <stdio.h>

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
    printf("backends: cpu%s\n", "");
    return 0;
}
