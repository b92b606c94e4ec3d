/* anneal/cuda.h in a build without the CUDA backend: every answer is "not built". */
#include "anneal/cuda.h"

#ifndef ANNEAL_HAVE_CUDA_BACKEND
#include <stdio.h>
#include <string.h>

static const char *const not_built = "this build of anneal has no CUDA backend (configure with nvcc on the PATH, "
                                     "or -DANNEAL_CUDA=ON)";

bool anneal_cuda_built(void) { return false; }

int anneal_cuda_device_count(char *why, size_t why_len) {
    if (why && why_len) snprintf(why, why_len, "%s", not_built);
    return 0;
}

anneal_status anneal_cuda_device_info_get(int ordinal, anneal_cuda_device_info *out) {
    if (out) memset(out, 0, sizeof *out);
    return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda:%d: %s", ordinal, not_built);
}

anneal_status anneal_cuda_select(int ordinal) {
    return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda:%d: %s", ordinal, not_built);
}

void anneal_cuda_set_tf32(bool on) { (void)on; }
#else
typedef int anneal_cuda_absent_unused; /* the CUDA build defines these in src/cuda/cuda_info.c */
#endif
