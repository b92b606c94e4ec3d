/* The CUDA backend's host-side controls: which GPUs there are, which one this process
 * uses, and TF32. The backend itself is the table registered on ANNEAL_CUDA
 * (backend.h); tensors reach it with anneal_empty_on(ANNEAL_CUDA, ...) or
 * anneal_to_device. In a build without CUDA every function answers "not built". */
#ifndef ANNEAL_CUDA_H
#define ANNEAL_CUDA_H

#include "anneal/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* True when this build has the CUDA backend compiled in. */
bool anneal_cuda_built(void);

/* The number of usable GPUs; 0 when there is none, with the reason (no driver, no
 * device, not built) written into why (NUL-terminated, may be NULL). Does not pick a
 * device or create a context beyond what the CUDA runtime does to count. */
int anneal_cuda_device_count(char *why, size_t why_len);

typedef struct anneal_cuda_device_info {
    int ordinal;
    char name[256];
    int cc_major, cc_minor;      /* compute capability */
    int sm_count;
    int64_t total_bytes, free_bytes;
    int driver_version;          /* CUDA's encoding: 1000 * major + 10 * minor */
    int runtime_version;
} anneal_cuda_device_info;

/* Fills *out for GPU `ordinal`. ANNEAL_ERR_DEVICE with the reason when it does not exist. */
anneal_status anneal_cuda_device_info_get(int ordinal, anneal_cuda_device_info *out);

/* Chooses the GPU that ANNEAL_CUDA means for this process (default 0). Only before the
 * device's first use: ANNEAL_ERR_STATE afterwards for another ordinal, ANNEAL_ERR_DEVICE
 * when it does not exist. */
anneal_status anneal_cuda_select(int ordinal);

/* Lets f32 matrix products use TF32 tensor cores (off by default, for parity with the
 * CPU backend within 1e-5). */
void anneal_cuda_set_tf32(bool on);

#ifdef __cplusplus
}
#endif
#endif
