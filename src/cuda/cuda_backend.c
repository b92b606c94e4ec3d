/* The CUDA backend's table: context, memory, copies, streams and events, and the
 * registration that the library's backend registry calls. The kernels live in the
 * other files of this folder, each filling its slots (cuda_internal.h). */
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- memory */

static void *cuda_alloc(void *ctx, size_t nbytes) {
    anneal_cuda_ctx *c = ctx;
    if (anneal_cuda_ensure(c) != ANNEAL_OK) return NULL;
    void *p = NULL;
    if (cudaMalloc(&p, nbytes ? nbytes : 1) != cudaSuccess) {
        cudaGetLastError(); /* the caching allocator reports the failure */
        return NULL;
    }
    return p;
}

static void cuda_free(void *ctx, void *p) {
    anneal_cuda_ctx *c = ctx;
    if (!p || anneal_cuda_ensure(c) != ANNEAL_OK) return;
    cudaFree(p);
}

static anneal_status cuda_copy_to_host(void *ctx, void *host_dst, const void *dev_src, size_t nbytes) {
    anneal_cuda_ctx *c = ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK || nbytes == 0) return st;
    return anneal_cuda_check(cudaMemcpyAsync(host_dst, dev_src, nbytes, cudaMemcpyDeviceToHost, c->stream),
                             "copy_to_host");
}

static anneal_status cuda_copy_from_host(void *ctx, void *dev_dst, const void *host_src, size_t nbytes) {
    anneal_cuda_ctx *c = ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK || nbytes == 0) return st;
    return anneal_cuda_check(cudaMemcpyAsync(dev_dst, host_src, nbytes, cudaMemcpyHostToDevice, c->stream),
                             "copy_from_host");
}

/* Drains the current stream; the first deferred error: a device fault, else a failed
 * index check. */
static anneal_status cuda_synchronize(void *ctx) {
    anneal_cuda_ctx *c = ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    st = anneal_cuda_check(cudaStreamSynchronize(c->stream), "synchronize");
    if (st != ANNEAL_OK) return st;
    return anneal_cuda_index_checks_collect(c);
}

/* ---------------------------------------------------------- streams, events */

static anneal_stream *cuda_stream_new(void *ctx) {
    anneal_cuda_ctx *c = ctx;
    if (anneal_cuda_ensure(c) != ANNEAL_OK) return NULL;
    cudaStream_t s = NULL;
    if (anneal_cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream_new") != ANNEAL_OK)
        return NULL;
    return (anneal_stream *)s;
}

static void cuda_stream_free(void *ctx, anneal_stream *s) {
    anneal_cuda_ctx *c = ctx;
    if (!s) return;
    if ((cudaStream_t)s == c->stream) c->stream = c->main_stream;
    cudaStreamDestroy((cudaStream_t)s);
}

static anneal_status cuda_stream_set(void *ctx, anneal_stream *s) {
    anneal_cuda_ctx *c = ctx;
    anneal_status st = anneal_cuda_ensure(c);
    if (st != ANNEAL_OK) return st;
    c->stream = s ? (cudaStream_t)s : c->main_stream;
    return ANNEAL_OK;
}

static anneal_event *cuda_event_record(void *ctx) {
    anneal_cuda_ctx *c = ctx;
    if (anneal_cuda_ensure(c) != ANNEAL_OK) return NULL;
    cudaEvent_t e = NULL;
    if (anneal_cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event_record") != ANNEAL_OK)
        return NULL;
    if (anneal_cuda_check(cudaEventRecord(e, c->stream), "event_record") != ANNEAL_OK) {
        cudaEventDestroy(e);
        return NULL;
    }
    return (anneal_event *)e;
}

static anneal_status cuda_event_wait(void *ctx, anneal_event *e) {
    anneal_cuda_ctx *c = ctx;
    if (!e) return ANNEAL_OK;
    return anneal_cuda_check(cudaStreamWaitEvent(c->stream, (cudaEvent_t)e, 0), "event_wait");
}

static void cuda_event_free(void *ctx, anneal_event *e) {
    (void)ctx;
    if (e) cudaEventDestroy((cudaEvent_t)e);
}

/* ----------------------------------------------------------- supports_op */

static bool cuda_supports_op(void *ctx, const anneal_op_query *q) {
    (void)ctx;
    switch (q->kind) {
    case ANNEAL_OP_COPY: case ANNEAL_OP_FILL: case ANNEAL_OP_BINARY: case ANNEAL_OP_UNARY:
    case ANNEAL_OP_REDUCE_SUM: case ANNEAL_OP_SUM_SQUARES: case ANNEAL_OP_SCALE_BY:
        return anneal_cuda_supports_elementwise(q);
    case ANNEAL_OP_MATMUL:
        return anneal_cuda_supports_gemm(q);
    case ANNEAL_OP_LAYER_NORM: case ANNEAL_OP_ADD_LAYER_NORM: case ANNEAL_OP_RMS_NORM: case ANNEAL_OP_SOFTMAX:
    case ANNEAL_OP_ROPE:
        return anneal_cuda_supports_rows(q);
    case ANNEAL_OP_DROPOUT: case ANNEAL_OP_RANDN:
        return anneal_cuda_supports_random(q);
    case ANNEAL_OP_ATTENTION:
        return anneal_cuda_supports_attention(q);
    case ANNEAL_OP_EMBEDDING: case ANNEAL_OP_CROSS_ENTROPY: case ANNEAL_OP_LINEAR_CROSS_ENTROPY:
    case ANNEAL_OP_CHECK_INDEX: case ANNEAL_OP_LOSS_MEAN:
        return anneal_cuda_supports_loss(q);
    case ANNEAL_OP_ADAMW:
        return anneal_cuda_supports_adamw(q);
    default:
        return false;
    }
}

/* ---------------------------------------------------------- registration */

static anneal_backend g_table;

/* Registers the CUDA table on ANNEAL_CUDA. Cheap and always successful: the GPU is
 * looked for on first use (anneal_cuda_ensure), so a build with CUDA runs on machines
 * without one, and a CPU-only run never initialises the driver. */
anneal_status anneal_cuda_backend_register(void) {
    anneal_backend *b = &g_table;
    memset(b, 0, sizeof *b);
    b->version = ANNEAL_BACKEND_VERSION;
    /* chunked ops: big chunks (linear cross-entropy: 2 GiB of f32 logits, plus half that
     * in its 16-bit dlogits scratch; a GPT-2 step's 32768 x 50257 logits in 4 chunks) */
    b->workspace_bytes = (int64_t)2 << 30;
    b->name = "cuda";
    b->device = ANNEAL_CUDA;
    b->ctx = anneal_cuda_context();
    b->alloc = cuda_alloc;
    b->free = cuda_free;
    b->copy_to_host = cuda_copy_to_host;
    b->copy_from_host = cuda_copy_from_host;
    b->synchronize = cuda_synchronize;
    b->supports_op = cuda_supports_op;
    b->stream_new = cuda_stream_new;
    b->stream_free = cuda_stream_free;
    b->stream_set = cuda_stream_set;
    b->event_record = cuda_event_record;
    b->event_wait = cuda_event_wait;
    b->event_free = cuda_event_free;
    anneal_cuda_table_elementwise(b);
    anneal_cuda_table_gemm(b);
    anneal_cuda_table_rows(b);
    anneal_cuda_table_random(b);
    anneal_cuda_table_attention(b);
    anneal_cuda_table_loss(b);
    anneal_cuda_table_adamw(b);
    return anneal_backend_register(b);
}
