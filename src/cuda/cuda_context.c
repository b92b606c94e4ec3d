/* The CUDA backend's context and the helpers every part uses: first-use
 * initialisation, CUDA errors as anneal_status, scratch buffers (cuda_internal.h). */
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

static anneal_cuda_ctx g_ctx = {.ordinal = 0};
static __thread int t_current = -1; /* the ordinal made current on this thread */

anneal_cuda_ctx *anneal_cuda_context(void) { return &g_ctx; }

/* ANNEAL_OK for cudaSuccess; otherwise the CUDA message, named by op. */
anneal_status anneal_cuda_check(cudaError_t e, const char *op) {
    if (e == cudaSuccess) return ANNEAL_OK;
    return anneal_set_error(e == cudaErrorMemoryAllocation ? ANNEAL_ERR_OOM : ANNEAL_ERR_DEVICE, "cuda %s: %s: %s",
                            op, cudaGetErrorName(e), cudaGetErrorString(e));
}

anneal_status anneal_cuda_launch_check(const char *op) { return anneal_cuda_check(cudaGetLastError(), op); }

/* First use: the device, its properties and the backend's own stream; later calls make
 * the device current on the calling thread (CUDA's current device is per thread). */
anneal_status anneal_cuda_ensure(anneal_cuda_ctx *c) {
    if (c->initialized == 1) {
        if (t_current != c->ordinal) {
            cudaError_t e = cudaSetDevice(c->ordinal);
            if (e != cudaSuccess) return anneal_cuda_check(e, "cudaSetDevice");
            t_current = c->ordinal;
        }
        return ANNEAL_OK;
    }
    if (c->initialized == -1) return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda: %s", c->init_error);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n == 0) e = cudaErrorNoDevice;
    if (e == cudaSuccess && c->ordinal >= n) {
        snprintf(c->init_error, sizeof c->init_error, "device cuda:%d asked for, but this machine has %d GPU%s",
                 c->ordinal, n, n == 1 ? "" : "s");
        c->initialized = -1;
        return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda: %s", c->init_error);
    }
    if (e == cudaSuccess) e = cudaSetDevice(c->ordinal);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&c->prop, c->ordinal);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->main_stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        snprintf(c->init_error, sizeof c->init_error, "no usable GPU (%s: %s)", cudaGetErrorName(e),
                 cudaGetErrorString(e));
        c->initialized = -1;
        cudaGetLastError();
        return anneal_set_error(ANNEAL_ERR_DEVICE, "cuda: %s", c->init_error);
    }
    c->stream = c->main_stream;
    t_current = c->ordinal;
    c->initialized = 1;
    return ANNEAL_OK;
}

void *anneal_cuda_scratch(anneal_cuda_ctx *c, anneal_cuda_scratch_id id, size_t nbytes) {
    if (nbytes == 0) nbytes = 1;
    if (c->scratch_bytes[id] >= nbytes) return c->scratch[id];
    size_t want = nbytes + nbytes / 4;
    if (c->scratch[id]) {
        /* the buffer may still be read by queued work: free it after the stream drains */
        cudaStreamSynchronize(c->stream);
        cudaFree(c->scratch[id]);
        c->scratch[id] = NULL;
        c->scratch_bytes[id] = 0;
    }
    void *p = NULL;
    if (anneal_cuda_check(cudaMalloc(&p, want), "scratch") != ANNEAL_OK) return NULL;
    c->scratch[id] = p;
    c->scratch_bytes[id] = want;
    return p;
}

