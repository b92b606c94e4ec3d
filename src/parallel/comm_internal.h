/* Inside the communicator: the handle and request structs shared by comm.c (argument
 * checks, dispatch) and the two implementations, comm_single.c (world of one) and
 * comm_mpi.c (OpenMPI, built when ANNEAL_HAVE_MPI is defined). */
#ifndef ANNEAL_DIST_COMM_INTERNAL_H
#define ANNEAL_DIST_COMM_INTERNAL_H

#include "anneal/parallel.h"

#ifdef ANNEAL_HAVE_MPI
#include <mpi.h>
#endif

struct anneal_comm {
    bool mpi;              /* false: the single-process stand-in */
    bool nccl;             /* GPU buffers through NCCL (comm_nccl.c) */
    int device;            /* NCCL: the CUDA device */
    void *nccl_comm;       /* NCCL: the ncclComm_t */
    void *stream;          /* NCCL: the cudaStream_t its calls queue on */
    int rank, size, local_rank, local_size;
    bool threads_ok;       /* MPI calls may come from a second thread, one at a time
                            * (ANNEAL_DDP_PROGRESS=thread asked for it at init) */
#ifdef ANNEAL_HAVE_MPI
    MPI_Comm comm;         /* a duplicate of MPI_COMM_WORLD owned by this handle */
#endif
};

/* What anneal_comm_wait does after the transport finished. */
typedef enum comm_post {
    COMM_POST_NONE,
    COMM_POST_DIV_F32,  /* out (f32, count) /= size: the mean of a sum */
    COMM_POST_TO_BF16,  /* out (bf16, count) = round(tmp_out (f32) [/ size]) */
} comm_post;

struct anneal_comm_request {
    anneal_comm *c;
    bool done;            /* transport finished (set by test/wait) */
#ifdef ANNEAL_HAVE_MPI
    MPI_Request req;
#endif
    comm_post post;
    bool mean;            /* COMM_POST_TO_BF16: divide by size before rounding */
    void *out;            /* user result buffer */
    int64_t count;        /* elements of out */
    float *tmp_in, *tmp_out; /* f32 staging of a bf16 reduction (owned) */
    void *event;          /* NCCL: the cudaEvent_t recorded after the call */
};

/* The device whose memory c's collectives read and write: host memory, the CPU's, for
 * the single-process and the MPI communicators (a NCCL one would say CUDA). */
anneal_device anneal_comm_device(const anneal_comm *c);
/* True when c can be driven from a progress thread (see ddp.c). */
bool anneal_comm_threads_ok(const anneal_comm *c);
/* True when the request's transport has finished (after a successful test). */
bool anneal_comm_request_done(const anneal_comm_request *r);

/* Runs the request's post step (mean division, bf16 rounding) and frees its staging. */
void anneal_comm_request_post(anneal_comm_request *r);
/* A request with no transport, already done (single process, zero counts). */
anneal_comm_request *anneal_comm_request_new(anneal_comm *c);

/* bf16 (count) -> f32, and f32 -> bf16 (divided by div first when div != 1). */
void anneal_comm_bf16_to_f32(const uint16_t *in, float *out, int64_t count);
void anneal_comm_f32_to_bf16(const float *in, uint16_t *out, int64_t count, float div);

#ifdef ANNEAL_HAVE_NCCL
/* comm_nccl.c: the NCCL implementation (arguments already checked by comm.c). */
void anneal_comm_nccl_free(anneal_comm *c);
anneal_status anneal_comm_nccl_allreduce(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                         anneal_reduce_op op, anneal_comm_request **req);
anneal_status anneal_comm_nccl_reduce_scatter(anneal_comm *c, const void *send, void *recv, int64_t count,
                                              anneal_dtype dt, anneal_reduce_op op, anneal_comm_request **req);
anneal_status anneal_comm_nccl_all_gather(anneal_comm *c, const void *send, void *recv, int64_t count,
                                          anneal_dtype dt, anneal_comm_request **req);
anneal_status anneal_comm_nccl_broadcast(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int root);
anneal_status anneal_comm_nccl_barrier(anneal_comm *c);
anneal_status anneal_comm_nccl_p2p(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int peer, bool send,
                                   anneal_comm_request **req);
anneal_comm *anneal_comm_nccl_split(anneal_comm *c, int color, int key);
anneal_status anneal_comm_nccl_wait(anneal_comm_request *r);
anneal_status anneal_comm_nccl_test(anneal_comm_request *r, bool *done);
void anneal_comm_nccl_abort(anneal_comm *c);
#endif

#ifdef ANNEAL_HAVE_MPI
anneal_comm *anneal_comm_mpi_init(void);
void anneal_comm_mpi_free(anneal_comm *c);
anneal_status anneal_comm_mpi_allreduce(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                        anneal_reduce_op op, anneal_comm_request **req);
anneal_status anneal_comm_mpi_reduce_scatter(anneal_comm *c, const void *send, void *recv, int64_t count,
                                             anneal_dtype dt, anneal_reduce_op op, anneal_comm_request **req);
anneal_status anneal_comm_mpi_all_gather(anneal_comm *c, const void *send, void *recv, int64_t count,
                                         anneal_dtype dt, anneal_comm_request **req);
anneal_status anneal_comm_mpi_broadcast(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int root);
anneal_status anneal_comm_mpi_barrier(anneal_comm *c);
anneal_status anneal_comm_mpi_wait(anneal_comm_request *r);
anneal_status anneal_comm_mpi_test(anneal_comm_request *r, bool *done);
void anneal_comm_mpi_abort(anneal_comm *c, int code);
anneal_comm *anneal_comm_mpi_split(anneal_comm *c, int color, int key);
anneal_status anneal_comm_mpi_p2p(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int peer, int tag,
                                  bool send, anneal_comm_request **req);
#endif

#endif
