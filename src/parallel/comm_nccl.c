/* The communicator over NCCL, for buffers in GPU memory: the same calls as the MPI one
 * (comm.c checks the arguments and dispatches here when c->nccl), each queued on the
 * communicator's own CUDA stream. A blocking call waits for its stream; a _start call
 * records an event that anneal_comm_wait synchronises and anneal_comm_test queries.
 * Bootstrapped over a host communicator: rank 0 of it makes the ncclUniqueId, which
 * is broadcast to the others (anneal_comm_nccl_bootstrap_id), then every rank joins
 * with ncclCommInitRank on its device.
 *
 * Built when CMake finds nccl.h and libnccl with the CUDA toolkit (ANNEAL_HAVE_NCCL);
 * otherwise the functions say so. NOTE: ncclCommInitRank and the collectives have never
 * run: the machines this was written on have no GPU. The bootstrap (the id, broadcast
 * over MPI) runs without one and is tested (tests/parallel/test_comm_nccl.c); the GPU
 * part of that test runs wherever a GPU exists. */
#include "parallel/comm_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef ANNEAL_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

bool anneal_comm_nccl_available(void) {
#ifdef ANNEAL_HAVE_NCCL
    return true;
#else
    return false;
#endif
}

#ifndef ANNEAL_HAVE_NCCL

anneal_status anneal_comm_nccl_bootstrap_id(anneal_comm *host, void *id, size_t n) {
    (void)host, (void)id, (void)n;
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "NCCL: this anneal was built without NCCL (no nccl.h / libnccl "
                                                    "found with the CUDA toolkit)");
}

anneal_comm *anneal_comm_nccl_new(anneal_comm *host, int device) {
    (void)host, (void)device;
    anneal_comm_nccl_bootstrap_id(NULL, NULL, 0);
    return NULL;
}

#else

/* An anneal_status naming the call and NCCL's message (and its last error, when set). */
static anneal_status nccl_fail(ncclResult_t r, const anneal_comm *c, const char *what) {
    const char *last = c && c->nccl_comm ? ncclGetLastError((ncclComm_t)c->nccl_comm) : NULL;
    return anneal_set_error(r == ncclInvalidArgument || r == ncclInvalidUsage ? ANNEAL_ERR_ARG : ANNEAL_ERR_IO,
                            "NCCL %s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "",
                            last ? last : "");
}

static anneal_status cuda_fail(cudaError_t e, const char *what) {
    return anneal_set_error(ANNEAL_ERR_DEVICE, "NCCL communicator, %s: %s (%s)", what, cudaGetErrorString(e),
                            cudaGetErrorName(e));
}

/* NCCL's name for an anneal dtype; false when NCCL has none. */
static bool nccl_dtype(anneal_dtype dt, int *out) {
    switch (dt) {
    case ANNEAL_F32: *out = ncclFloat32; return true;
    case ANNEAL_BF16: *out = ncclBfloat16; return true;
    case ANNEAL_F16: *out = ncclFloat16; return true;
    case ANNEAL_I32: *out = ncclInt32; return true;
    case ANNEAL_I8: *out = ncclInt8; return true;
    default: return false;
    }
}

/* NCCL's reduction for a sum or a mean (ncclAvg: NCCL's own division). */
static int nccl_op(anneal_reduce_op op) { return op == ANNEAL_REDUCE_MEAN ? ncclAvg : ncclSum; }

anneal_status anneal_comm_nccl_bootstrap_id(anneal_comm *host, void *id, size_t n) {
    if (!host || !id || n != sizeof(ncclUniqueId))
        return anneal_set_error(ANNEAL_ERR_ARG, "NCCL bootstrap: want a host communicator and %zu bytes for the id",
                                sizeof(ncclUniqueId));
    memset(id, 0, n);
    anneal_status st = ANNEAL_OK;
    int ok = 1;
    if (anneal_comm_rank(host) == 0) {
        ncclResult_t r = ncclGetUniqueId((ncclUniqueId *)id);
        if (r != ncclSuccess) {
            st = nccl_fail(r, NULL, "ncclGetUniqueId");
            ok = 0;
        }
    }
    /* every rank learns whether rank 0 has an id, then the id (as 4-byte words) */
    anneal_status b = anneal_comm_broadcast(host, &ok, 1, ANNEAL_I32, 0);
    if (b != ANNEAL_OK) return b;
    if (!ok) return st != ANNEAL_OK ? st : anneal_set_error(ANNEAL_ERR_IO, "NCCL bootstrap: rank 0 has no NCCL id");
    return anneal_comm_broadcast(host, id, (int64_t)(n / 4), ANNEAL_I32, 0);
}

anneal_comm *anneal_comm_nccl_new(anneal_comm *host, int device) {
    ncclUniqueId id;
    if (anneal_comm_nccl_bootstrap_id(host, &id, sizeof id) != ANNEAL_OK) return NULL;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        cuda_fail(e, "cudaSetDevice");
        return NULL;
    }
    anneal_comm *c = calloc(1, sizeof *c);
    if (!c) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a communicator");
        return NULL;
    }
    c->nccl = true;
    c->rank = anneal_comm_rank(host);
    c->size = anneal_comm_size(host);
    c->local_rank = anneal_comm_local_rank(host);
    c->local_size = anneal_comm_local_size(host);
    c->device = device;
    cudaStream_t s = NULL;
    if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess) {
        cuda_fail(e, "cudaStreamCreate");
        free(c);
        return NULL;
    }
    c->stream = s;
    ncclComm_t nc = NULL;
    ncclResult_t r = ncclCommInitRank(&nc, c->size, id, c->rank);
    if (r != ncclSuccess) {
        nccl_fail(r, NULL, "ncclCommInitRank");
        cudaStreamDestroy(s);
        free(c);
        return NULL;
    }
    c->nccl_comm = nc;
    return c;
}

void anneal_comm_nccl_free(anneal_comm *c) {
    if (c->nccl_comm) ncclCommDestroy((ncclComm_t)c->nccl_comm);
    if (c->stream) cudaStreamDestroy((cudaStream_t)c->stream);
    free(c);
}

/* After a queued call: blocking (req NULL) waits for the stream, else an event marks
 * the call's end in a request. */
static anneal_status finish(anneal_comm *c, anneal_comm_request **req, const char *what) {
    cudaStream_t s = (cudaStream_t)c->stream;
    if (!req) {
        cudaError_t e = cudaStreamSynchronize(s);
        return e == cudaSuccess ? ANNEAL_OK : cuda_fail(e, what);
    }
    anneal_comm_request *r = anneal_comm_request_new(c);
    if (!r) return anneal_last_status();
    cudaEvent_t ev = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(ev, s);
    if (e != cudaSuccess) {
        if (ev) cudaEventDestroy(ev);
        free(r);
        return cuda_fail(e, what);
    }
    r->done = false;
    r->event = ev;
    *req = r;
    return ANNEAL_OK;
}

static anneal_status dtype_of(anneal_dtype dt, ncclDataType_t *t, const char *what) {
    int v = 0;
    if (!nccl_dtype(dt, &v))
        return anneal_set_error(ANNEAL_ERR_DTYPE, "NCCL %s: no NCCL type for %s", what, anneal_dtype_name(dt));
    *t = (ncclDataType_t)v;
    return ANNEAL_OK;
}

anneal_status anneal_comm_nccl_allreduce(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                         anneal_reduce_op op, anneal_comm_request **req) {
    ncclDataType_t t = ncclFloat32;
    anneal_status st = dtype_of(dt, &t, "all-reduce");
    if (st != ANNEAL_OK) return st;
    ncclResult_t r = ncclAllReduce(buf, buf, (size_t)count, t, (ncclRedOp_t)nccl_op(op),
                                   (ncclComm_t)c->nccl_comm, (cudaStream_t)c->stream);
    return r == ncclSuccess ? finish(c, req, "all-reduce") : nccl_fail(r, c, "all-reduce");
}

/* send holds count * size elements, recv gets this rank's count (as the MPI one). */
anneal_status anneal_comm_nccl_reduce_scatter(anneal_comm *c, const void *send, void *recv, int64_t count,
                                              anneal_dtype dt, anneal_reduce_op op, anneal_comm_request **req) {
    ncclDataType_t t = ncclFloat32;
    anneal_status st = dtype_of(dt, &t, "reduce-scatter");
    if (st != ANNEAL_OK) return st;
    ncclResult_t r = ncclReduceScatter(send, recv, (size_t)count, t, (ncclRedOp_t)nccl_op(op),
                                       (ncclComm_t)c->nccl_comm, (cudaStream_t)c->stream);
    return r == ncclSuccess ? finish(c, req, "reduce-scatter") : nccl_fail(r, c, "reduce-scatter");
}

anneal_status anneal_comm_nccl_all_gather(anneal_comm *c, const void *send, void *recv, int64_t count,
                                          anneal_dtype dt, anneal_comm_request **req) {
    ncclDataType_t t = ncclFloat32;
    anneal_status st = dtype_of(dt, &t, "all-gather");
    if (st != ANNEAL_OK) return st;
    ncclResult_t r =
        ncclAllGather(send, recv, (size_t)count, t, (ncclComm_t)c->nccl_comm, (cudaStream_t)c->stream);
    return r == ncclSuccess ? finish(c, req, "all-gather") : nccl_fail(r, c, "all-gather");
}

anneal_status anneal_comm_nccl_broadcast(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int root) {
    ncclDataType_t t = ncclFloat32;
    anneal_status st = dtype_of(dt, &t, "broadcast");
    if (st != ANNEAL_OK) return st;
    ncclResult_t r =
        ncclBroadcast(buf, buf, (size_t)count, t, root, (ncclComm_t)c->nccl_comm, (cudaStream_t)c->stream);
    return r == ncclSuccess ? finish(c, NULL, "broadcast") : nccl_fail(r, c, "broadcast");
}

/* An all-reduce of one float on the device, waited for. */
anneal_status anneal_comm_nccl_barrier(anneal_comm *c) {
    float *one = NULL;
    cudaError_t e = cudaMallocAsync((void **)&one, sizeof *one, (cudaStream_t)c->stream);
    if (e != cudaSuccess) return cuda_fail(e, "barrier");
    cudaMemsetAsync(one, 0, sizeof *one, (cudaStream_t)c->stream);
    anneal_status st = anneal_comm_nccl_allreduce(c, one, 1, ANNEAL_F32, ANNEAL_REDUCE_SUM, NULL);
    cudaFreeAsync(one, (cudaStream_t)c->stream);
    e = cudaStreamSynchronize((cudaStream_t)c->stream);
    return st != ANNEAL_OK ? st : e == cudaSuccess ? ANNEAL_OK : cuda_fail(e, "barrier");
}

anneal_status anneal_comm_nccl_p2p(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int peer, bool send,
                                   anneal_comm_request **req) {
    ncclDataType_t t = ncclFloat32;
    anneal_status st = dtype_of(dt, &t, send ? "send" : "receive");
    if (st != ANNEAL_OK) return st;
    ncclResult_t r = send ? ncclSend(buf, (size_t)count, t, peer, (ncclComm_t)c->nccl_comm, (cudaStream_t)c->stream)
                          : ncclRecv(buf, (size_t)count, t, peer, (ncclComm_t)c->nccl_comm, (cudaStream_t)c->stream);
    return r == ncclSuccess ? finish(c, req, send ? "send" : "receive") : nccl_fail(r, c, send ? "send" : "receive");
}

anneal_comm *anneal_comm_nccl_split(anneal_comm *c, int color, int key) {
    anneal_comm *n = calloc(1, sizeof *n);
    if (!n) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a communicator");
        return NULL;
    }
    ncclComm_t nc = NULL;
    ncclResult_t r = ncclCommSplit((ncclComm_t)c->nccl_comm, color, key, &nc, NULL);
    int rank = 0, size = 1;
    if (r == ncclSuccess) r = ncclCommUserRank(nc, &rank);
    if (r == ncclSuccess) r = ncclCommCount(nc, &size);
    cudaStream_t s = NULL;
    cudaError_t e = r == ncclSuccess ? cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) : cudaSuccess;
    if (r != ncclSuccess || e != cudaSuccess) {
        if (r != ncclSuccess) nccl_fail(r, c, "ncclCommSplit");
        else cuda_fail(e, "cudaStreamCreate");
        if (nc) ncclCommDestroy(nc);
        free(n);
        return NULL;
    }
    n->nccl = true;
    n->nccl_comm = nc;
    n->stream = s;
    n->rank = rank;
    n->size = size;
    n->device = c->device;
    n->local_size = 1;
    return n;
}

anneal_status anneal_comm_nccl_wait(anneal_comm_request *r) {
    cudaEvent_t ev = (cudaEvent_t)r->event;
    cudaError_t e = ev ? cudaEventSynchronize(ev) : cudaSuccess;
    if (ev) cudaEventDestroy(ev);
    r->event = NULL;
    r->done = true;
    return e == cudaSuccess ? ANNEAL_OK : cuda_fail(e, "wait");
}

anneal_status anneal_comm_nccl_test(anneal_comm_request *r, bool *done) {
    cudaError_t e = cudaEventQuery((cudaEvent_t)r->event);
    if (e == cudaErrorNotReady) {
        *done = false;
        return ANNEAL_OK;
    }
    *done = e == cudaSuccess;
    return e == cudaSuccess ? ANNEAL_OK : cuda_fail(e, "test");
}

void anneal_comm_nccl_abort(anneal_comm *c) {
    if (c->nccl_comm) ncclCommAbort((ncclComm_t)c->nccl_comm);
    c->nccl_comm = NULL;
}

#endif
