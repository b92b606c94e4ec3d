/* Thread count for CPU kernels (OpenMP). */
#include "anneal/core.h"

#include <omp.h>

void anneal_set_num_threads(int n) {
    if (n <= 0) n = omp_get_num_procs();
    omp_set_num_threads(n);
}

int anneal_get_num_threads(void) { return omp_get_max_threads(); }
