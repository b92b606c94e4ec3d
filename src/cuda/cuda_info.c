/* anneal/cuda.h for a build with the CUDA backend: GPUs, the device choice, TF32. */
#include "anneal/cuda.h"
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

bool anneal_cuda_built(void) { return true; }

int anneal_cuda_device_count(char *why, size_t why_len) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (why && why_len) snprintf(why, why_len, "no usable GPU (%s: %s)", cudaGetErrorName(e), cudaGetErrorString(e));
        cudaGetLastError();
        return 0;
    }
    if (n == 0 && why && why_len) snprintf(why, why_len, "no GPU found by the CUDA runtime");
    return n;
}

anneal_status anneal_cuda_device_info_get(int ordinal, anneal_cuda_device_info *out) {
    if (!out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_cuda_device_info_get: out is NULL");
    memset(out, 0, sizeof *out);
    char why[256] = "";
    int n = anneal_cuda_device_count(why, sizeof why);
    if (ordinal < 0 || ordinal >= n)
        return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda:%d: %s", ordinal,
                                n == 0 ? why : "no such GPU on this machine");
    struct cudaDeviceProp p;
    anneal_status st = anneal_cuda_check(cudaGetDeviceProperties(&p, ordinal), "cudaGetDeviceProperties");
    if (st != ANNEAL_OK) return st;
    out->ordinal = ordinal;
    snprintf(out->name, sizeof out->name, "%s", p.name);
    out->cc_major = p.major;
    out->cc_minor = p.minor;
    out->sm_count = p.multiProcessorCount;
    out->total_bytes = (int64_t)p.totalGlobalMem;
    cudaDriverGetVersion(&out->driver_version);
    cudaRuntimeGetVersion(&out->runtime_version);
    /* free memory needs a context on that device: the current one's only */
    anneal_cuda_ctx *c = anneal_cuda_context();
    if (c->initialized == 1 && c->ordinal == ordinal) {
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) out->free_bytes = (int64_t)fr;
    }
    cudaGetLastError();
    return ANNEAL_OK;
}

anneal_status anneal_cuda_select(int ordinal) {
    anneal_cuda_ctx *c = anneal_cuda_context();
    if (ordinal < 0) return anneal_set_error(ANNEAL_ERR_ARG, "cuda:%d: a device ordinal is >= 0", ordinal);
    if (c->initialized == 1 && c->ordinal != ordinal)
        return anneal_set_error(ANNEAL_ERR_STATE, "cuda:%d: this process already uses cuda:%d (one GPU per process)",
                                ordinal, c->ordinal);
    char why[256] = "";
    int n = anneal_cuda_device_count(why, sizeof why);
    if (ordinal >= n)
        return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda:%d: %s", ordinal,
                                n == 0 ? why : "no such GPU on this machine");
    c->ordinal = ordinal;
    if (c->initialized == -1) c->initialized = 0; /* a new choice may succeed where the last failed */
    return ANNEAL_OK;
}

void anneal_cuda_set_tf32(bool on) { anneal_cuda_context()->allow_tf32 = on ? 1 : 0; }
