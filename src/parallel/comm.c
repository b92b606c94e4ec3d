/* The communicator's public face and the single-process stand-in (a world of one:
 * reductions are the identity, gathers a copy). Picks MPI or the stand-in from the
 * launcher's environment, checks every collective's arguments the same way for both,
 * and dispatches. Requests carry a post step (mean division, bf16 rounding) that runs
 * once their transport is done, so blocking and non-blocking calls give the same bits. */
#include "parallel/comm_internal.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* True when this build can talk MPI. */
bool anneal_comm_mpi_available(void) {
#ifdef ANNEAL_HAVE_MPI
    return true;
#else
    return false;
#endif
}

/* The number of processes a launcher says it started (0: no launcher seen). Knows
 * OpenMPI's mpirun, PMI/PMIx launchers (MPICH's hydra, srun --mpi=pmix) and Slurm. */
static int launcher_world(void) {
    static const char *size_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"};
    for (size_t i = 0; i < sizeof size_vars / sizeof *size_vars; i++) {
        const char *v = getenv(size_vars[i]);
        if (v && *v) {
            int n = atoi(v);
            /* SLURM_NTASKS is also set in a batch script outside srun: only trust it
             * inside a job step. */
            if (i == 2 && !getenv("SLURM_STEP_ID")) continue;
            return n > 0 ? n : 1;
        }
    }
    if (getenv("PMIX_RANK")) return 1; /* PMIx gives no size variable; MPI will tell */
    return 0;
}

/* Joins the launcher's job over MPI, or makes a world of one when no launcher started
 * us. A launcher asking for several processes in a build without MPI is an error
 * (every process would think it is rank 0 and write the same files). */
anneal_comm *anneal_comm_init(void) {
    int world = launcher_world();
    if (world > 0 && anneal_comm_mpi_available()) {
#ifdef ANNEAL_HAVE_MPI
        return anneal_comm_mpi_init();
#endif
    }
    if (world > 1) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                         "launched as one of %d processes, but this anneal was built without MPI "
                         "(install libopenmpi-dev and rebuild)", world);
        return NULL;
    }
    anneal_comm *c = calloc(1, sizeof *c);
    if (!c) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a communicator");
        return NULL;
    }
    c->size = 1;
    return c;
}

/* Leaves the job and frees c. */
void anneal_comm_free(anneal_comm *c) {
    if (!c) return;
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) {
        anneal_comm_nccl_free(c);
        return;
    }
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) {
        anneal_comm_mpi_free(c);
        return;
    }
#endif
    free(c);
}

bool anneal_comm_threads_ok(const anneal_comm *c) { return c && c->threads_ok; }
bool anneal_comm_request_done(const anneal_comm_request *r) { return !r || r->done; }

int anneal_comm_rank(const anneal_comm *c) { return c ? c->rank : 0; }
int anneal_comm_size(const anneal_comm *c) { return c ? c->size : 1; }
int anneal_comm_local_rank(const anneal_comm *c) { return c ? c->local_rank : 0; }
int anneal_comm_local_size(const anneal_comm *c) { return c && c->local_size > 0 ? c->local_size : 1; }
const char *anneal_comm_backend(const anneal_comm *c) { return c && c->nccl ? "nccl" : c && c->mpi ? "mpi" : "single"; }

/* Common checks; `reduce` restricts dtypes to f32/bf16. MPI counts are ints: the
 * elements moved by one call (count * size for the gathered side) must fit. */
anneal_device anneal_comm_device(const anneal_comm *c) { return c && c->nccl ? ANNEAL_CUDA : ANNEAL_CPU; }

static anneal_status check_args(const anneal_comm *c, const char *what, const void *a, const void *b,
                                int64_t count, anneal_dtype dt, bool reduce) {
    if (!c) return anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL communicator", what);
    if (count < 0) return anneal_set_error(ANNEAL_ERR_ARG, "%s: negative count %lld", what, (long long)count);
    if ((int)dt < 0 || dt >= ANNEAL_DTYPE_COUNT)
        return anneal_set_error(ANNEAL_ERR_DTYPE, "%s: invalid dtype %d", what, (int)dt);
    if (reduce && dt != ANNEAL_F32 && dt != ANNEAL_BF16)
        return anneal_set_error(ANNEAL_ERR_DTYPE, "%s: reductions take f32 or bf16, not %s", what,
                                anneal_dtype_name(dt));
    if (count > 0 && (!a || !b)) return anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL buffer", what);
    if (count > INT_MAX / (c->size > 0 ? c->size : 1))
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: count %lld x %d ranks is too large for one call", what,
                                (long long)count, c->size);
    return ANNEAL_OK;
}

static anneal_status check_req(anneal_comm_request **req, const char *what) {
    if (!req) return anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL request pointer", what);
    *req = NULL;
    return ANNEAL_OK;
}

/* Single-process results are immediate: a done request keeps the interface uniform. */
static anneal_status single_done(anneal_comm *c, anneal_comm_request **req) {
    if (!req) return ANNEAL_OK;
    *req = anneal_comm_request_new(c);
    return *req ? ANNEAL_OK : anneal_last_status();
}

/* Shared body of the blocking and non-blocking all-reduce (req NULL: blocking). */
static anneal_status allreduce(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                               anneal_reduce_op op, anneal_comm_request **req) {
    anneal_status s = check_args(c, "anneal_comm_allreduce", buf, buf, count, dt, true);
    if (s != ANNEAL_OK) return s;
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) return anneal_comm_nccl_allreduce(c, buf, count, dt, op, req);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) return anneal_comm_mpi_allreduce(c, buf, count, dt, op, req);
#endif
    return single_done(c, req); /* sum or mean over one rank: buf itself */
}

anneal_status anneal_comm_allreduce(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                    anneal_reduce_op op) {
    return allreduce(c, buf, count, dt, op, NULL);
}

anneal_status anneal_comm_allreduce_start(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                          anneal_reduce_op op, anneal_comm_request **req) {
    anneal_status s = check_req(req, "anneal_comm_allreduce_start");
    return s != ANNEAL_OK ? s : allreduce(c, buf, count, dt, op, req);
}

static anneal_status reduce_scatter(anneal_comm *c, const void *send, void *recv, int64_t count,
                                    anneal_dtype dt, anneal_reduce_op op, anneal_comm_request **req) {
    anneal_status s = check_args(c, "anneal_comm_reduce_scatter", send, recv, count, dt, true);
    if (s != ANNEAL_OK) return s;
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) return anneal_comm_nccl_reduce_scatter(c, send, recv, count, dt, op, req);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) return anneal_comm_mpi_reduce_scatter(c, send, recv, count, dt, op, req);
#endif
    if (count > 0 && send != recv) memmove(recv, send, (size_t)count * anneal_dtype_size(dt));
    return single_done(c, req);
}

anneal_status anneal_comm_reduce_scatter(anneal_comm *c, const void *send, void *recv, int64_t count,
                                         anneal_dtype dt, anneal_reduce_op op) {
    return reduce_scatter(c, send, recv, count, dt, op, NULL);
}

anneal_status anneal_comm_reduce_scatter_start(anneal_comm *c, const void *send, void *recv, int64_t count,
                                               anneal_dtype dt, anneal_reduce_op op,
                                               anneal_comm_request **req) {
    anneal_status s = check_req(req, "anneal_comm_reduce_scatter_start");
    return s != ANNEAL_OK ? s : reduce_scatter(c, send, recv, count, dt, op, req);
}

static anneal_status all_gather(anneal_comm *c, const void *send, void *recv, int64_t count,
                                anneal_dtype dt, anneal_comm_request **req) {
    anneal_status s = check_args(c, "anneal_comm_all_gather", send, recv, count, dt, false);
    if (s != ANNEAL_OK) return s;
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) return anneal_comm_nccl_all_gather(c, send, recv, count, dt, req);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) return anneal_comm_mpi_all_gather(c, send, recv, count, dt, req);
#endif
    if (count > 0 && send != recv) memmove(recv, send, (size_t)count * anneal_dtype_size(dt));
    return single_done(c, req);
}

anneal_status anneal_comm_all_gather(anneal_comm *c, const void *send, void *recv, int64_t count,
                                     anneal_dtype dt) {
    return all_gather(c, send, recv, count, dt, NULL);
}

anneal_status anneal_comm_all_gather_start(anneal_comm *c, const void *send, void *recv, int64_t count,
                                           anneal_dtype dt, anneal_comm_request **req) {
    anneal_status s = check_req(req, "anneal_comm_all_gather_start");
    return s != ANNEAL_OK ? s : all_gather(c, send, recv, count, dt, req);
}

/* root's buf is copied into every rank's buf. */
anneal_status anneal_comm_broadcast(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int root) {
    anneal_status s = check_args(c, "anneal_comm_broadcast", buf, buf, count, dt, false);
    if (s != ANNEAL_OK) return s;
    if (root < 0 || root >= c->size)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_comm_broadcast: root %d outside a world of %d", root,
                                c->size);
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) return anneal_comm_nccl_broadcast(c, buf, count, dt, root);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) return anneal_comm_mpi_broadcast(c, buf, count, dt, root);
#endif
    return ANNEAL_OK;
}

anneal_status anneal_comm_barrier(anneal_comm *c) {
    if (!c) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_comm_barrier: NULL communicator");
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) return anneal_comm_nccl_barrier(c);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) return anneal_comm_mpi_barrier(c);
#endif
    return ANNEAL_OK;
}

/* The ranks of c with the same color, ranked by key (see parallel.h). */
anneal_comm *anneal_comm_split(anneal_comm *c, int color, int key) {
    if (!c) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_comm_split: NULL communicator");
        return NULL;
    }
    if (color < 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_comm_split: negative color %d", color);
        return NULL;
    }
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) return anneal_comm_nccl_split(c, color, key);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) return anneal_comm_mpi_split(c, color, key);
#endif
    anneal_comm *n = calloc(1, sizeof *n);
    if (!n) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a communicator");
        return NULL;
    }
    n->size = 1;
    n->local_size = 1;
    return n;
}

/* Shared checks and dispatch of the point-to-point calls (req NULL: blocking). */
static anneal_status p2p(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int peer, int tag, bool send,
                         anneal_comm_request **req) {
    const char *what = send ? "anneal_comm_send" : "anneal_comm_recv";
    anneal_status s = check_args(c, what, buf, buf, count, dt, false);
    if (s != ANNEAL_OK) return s;
    if (peer < 0 || peer >= c->size || peer == c->rank)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: peer %d is not another rank of a world of %d (this is rank %d)",
                                what, peer, c->size, c->rank);
    if (tag < 0 || tag >= 32768) return anneal_set_error(ANNEAL_ERR_ARG, "%s: tag %d outside [0, 32768)", what, tag);
#ifdef ANNEAL_HAVE_NCCL
    if (c->nccl) return anneal_comm_nccl_p2p(c, buf, count, dt, peer, send, req); /* NCCL has no tags: in order */
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c->mpi) return anneal_comm_mpi_p2p(c, buf, count, dt, peer, tag, send, req);
#endif
    (void)req;
    return anneal_set_error(ANNEAL_ERR_STATE, "%s: no MPI in this communicator", what);
}

anneal_status anneal_comm_send(anneal_comm *c, const void *buf, int64_t count, anneal_dtype dt, int dst, int tag) {
    return p2p(c, (void *)buf, count, dt, dst, tag, true, NULL);
}

anneal_status anneal_comm_recv(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int src, int tag) {
    return p2p(c, buf, count, dt, src, tag, false, NULL);
}

anneal_status anneal_comm_send_start(anneal_comm *c, const void *buf, int64_t count, anneal_dtype dt, int dst,
                                     int tag, anneal_comm_request **req) {
    anneal_status s = check_req(req, "anneal_comm_send_start");
    return s != ANNEAL_OK ? s : p2p(c, (void *)buf, count, dt, dst, tag, true, req);
}

anneal_status anneal_comm_recv_start(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int src,
                                     int tag, anneal_comm_request **req) {
    anneal_status s = check_req(req, "anneal_comm_recv_start");
    return s != ANNEAL_OK ? s : p2p(c, buf, count, dt, src, tag, false, req);
}

/* Waits for req (transport, then the post step) and frees it. */
anneal_status anneal_comm_wait(anneal_comm_request *req) {
    if (!req) return ANNEAL_OK;
    anneal_status s = ANNEAL_OK;
#ifdef ANNEAL_HAVE_NCCL
    if (req->c->nccl && !req->done) s = anneal_comm_nccl_wait(req);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (req->c->mpi && !req->done) s = anneal_comm_mpi_wait(req);
#endif
    if (s == ANNEAL_OK) anneal_comm_request_post(req);
    free(req->tmp_in);
    free(req->tmp_out);
    free(req);
    return s;
}

/* *done = transport finished; drives MPI progress. */
anneal_status anneal_comm_test(anneal_comm_request *req, bool *done) {
    if (!req || !done) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_comm_test: NULL argument");
#ifdef ANNEAL_HAVE_NCCL
    if (req->c->nccl && !req->done) return anneal_comm_nccl_test(req, done);
#endif
#ifdef ANNEAL_HAVE_MPI
    if (req->c->mpi && !req->done) return anneal_comm_mpi_test(req, done);
#endif
    *done = true;
    return ANNEAL_OK;
}

/* Prints msg and ends every process of the job. */
void anneal_comm_abort(anneal_comm *c, int code, const char *msg) {
    fprintf(stderr, "anneal: rank %d: %s\n", c ? c->rank : 0, msg ? msg : "aborting");
    fflush(stderr);
    fflush(stdout);
#ifdef ANNEAL_HAVE_NCCL
    if (c && c->nccl) anneal_comm_nccl_abort(c); /* then exit: the host communicator's job ends */
#endif
#ifdef ANNEAL_HAVE_MPI
    if (c && c->mpi) anneal_comm_mpi_abort(c, code);
#endif
    exit(code ? code : 1);
}

anneal_comm_request *anneal_comm_request_new(anneal_comm *c) {
    anneal_comm_request *r = calloc(1, sizeof *r);
    if (!r) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory for a communication request");
        return NULL;
    }
    r->c = c;
    r->done = true;
    return r;
}

void anneal_comm_bf16_to_f32(const uint16_t *in, float *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = anneal_bf16_to_f32(in[i]);
}

void anneal_comm_f32_to_bf16(const float *in, uint16_t *out, int64_t count, float div) {
    if (div != 1.0f)
        for (int64_t i = 0; i < count; i++) out[i] = anneal_f32_to_bf16(in[i] / div);
    else
        for (int64_t i = 0; i < count; i++) out[i] = anneal_f32_to_bf16(in[i]);
}

/* Mean: the f32 sum divided by the world size (a division, not a multiplication by
 * 1/size, so a power-of-two world gives the exact mean of the sum). bf16: rounded
 * once from the f32 result. */
void anneal_comm_request_post(anneal_comm_request *r) {
    float div = (float)r->c->size;
    if (r->post == COMM_POST_DIV_F32 && div != 1.0f) {
        float *o = r->out;
        for (int64_t i = 0; i < r->count; i++) o[i] /= div;
    } else if (r->post == COMM_POST_TO_BF16) {
        anneal_comm_f32_to_bf16(r->tmp_out, r->out, r->count, r->mean ? div : 1.0f);
    }
    r->post = COMM_POST_NONE;
}
