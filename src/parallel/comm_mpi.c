/* The MPI communicator (OpenMPI here; nothing OpenMPI-specific is used). Every
 * collective is started non-blocking (MPI_Iallreduce, MPI_Ireduce_scatter_block,
 * MPI_Iallgather) and the blocking calls are start + wait, so both give the same
 * algorithm and the same bits. bf16 reductions are staged in f32: converted, summed in
 * f32 by MPI_SUM and rounded once when the request finishes (a bf16 MPI_Op would round
 * after every pairwise add). MPI_ERRORS_RETURN turns transport failures into
 * ANNEAL_ERR_IO with MPI's own message instead of killing the process. */
#ifdef ANNEAL_HAVE_MPI
#include "parallel/comm_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Handles alive in this process; MPI_Finalize runs when the last one goes and we were
 * the ones who initialised MPI. */
static int g_users;
static bool g_we_initialised;
static char g_dummy[16]; /* a valid address for zero-count buffers */

/* ANNEAL_ERR_IO naming the call and MPI's error text. */
static anneal_status mpi_error(int rc, const char *what) {
    char msg[MPI_MAX_ERROR_STRING + 1];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = snprintf(msg, sizeof msg, "error %d", rc);
    msg[len < (int)sizeof msg ? len : (int)sizeof msg - 1] = 0;
    return anneal_set_error(ANNEAL_ERR_IO, "MPI %s failed: %s (a peer process may have died)", what, msg);
}

#define MPI_TRY(call, what) do { int _rc = (call); if (_rc != MPI_SUCCESS) return mpi_error(_rc, what); } while (0)

/* The MPI type moving one element of dt (16-bit floats travel as raw uint16). */
static MPI_Datatype mpi_type(anneal_dtype dt) {
    switch (dt) {
    case ANNEAL_F32: return MPI_FLOAT;
    case ANNEAL_BF16: case ANNEAL_F16: case ANNEAL_U16: return MPI_UINT16_T;
    case ANNEAL_I32: return MPI_INT32_T;
    case ANNEAL_I64: return MPI_INT64_T;
    case ANNEAL_U8: return MPI_UINT8_T;
    case ANNEAL_I8: return MPI_INT8_T;
    default: return MPI_BYTE;
    }
}

static void *nz(void *p) { return p ? p : g_dummy; }

/* MPI_Init_thread (FUNNELED: only the thread that called init talks MPI; the OpenMP
 * workers never do), MPI_ERRORS_RETURN, a private duplicate of MPI_COMM_WORLD, and
 * the local rank from the shared-memory split. */
anneal_comm *anneal_comm_mpi_init(void) {
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (finalized) {
        anneal_set_error(ANNEAL_ERR_STATE, "MPI was already finalised in this process (it cannot start twice)");
        return NULL;
    }
    /* ANNEAL_DDP_PROGRESS=thread: the gradient sync drives MPI from a progress thread
     * (serialised by its mutex), which needs SERIALIZED; MULTIPLE is asked for. */
    const char *prog = getenv("ANNEAL_DDP_PROGRESS");
    bool want_threads = prog && strcmp(prog, "thread") == 0;
    int provided = MPI_THREAD_FUNNELED;
    if (inited) MPI_Query_thread(&provided);
    if (!inited) {
        int rc = MPI_Init_thread(NULL, NULL, want_threads ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) {
            mpi_error(rc, "MPI_Init_thread");
            return NULL;
        }
        g_we_initialised = true;
        if (provided < MPI_THREAD_FUNNELED) {
            anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "this MPI gives thread level %d, anneal needs FUNNELED",
                             provided);
            return NULL;
        }
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    anneal_comm *c = calloc(1, sizeof *c);
    if (!c) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a communicator");
        return NULL;
    }
    c->mpi = true;
    c->threads_ok = want_threads && provided >= MPI_THREAD_SERIALIZED;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c->comm);
    if (rc != MPI_SUCCESS) {
        mpi_error(rc, "MPI_Comm_dup");
        free(c);
        return NULL;
    }
    MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(c->comm, &c->rank);
    MPI_Comm_size(c->comm, &c->size);
    MPI_Comm node;
    if (MPI_Comm_split_type(c->comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_rank(node, &c->local_rank);
        MPI_Comm_size(node, &c->local_size);
        MPI_Comm_free(&node);
    } else {
        const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK"), *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        c->local_rank = lr ? atoi(lr) : 0;
        c->local_size = ls ? atoi(ls) : 1;
    }
    g_users++;
    return c;
}

void anneal_comm_mpi_free(anneal_comm *c) {
    MPI_Comm_free(&c->comm);
    free(c);
    if (--g_users == 0 && g_we_initialised) {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Finalize();
    }
}

/* Blocking calls are the non-blocking ones waited for. */
static anneal_status finish(anneal_comm_request *r, anneal_comm_request **req) {
    if (req) {
        *req = r;
        return ANNEAL_OK;
    }
    return anneal_comm_wait(r);
}

/* Frees a request whose start failed. */
static anneal_status fail(anneal_comm_request *r, int rc, const char *what) {
    free(r->tmp_in);
    free(r->tmp_out);
    free(r);
    return mpi_error(rc, what);
}

static anneal_comm_request *new_req(anneal_comm *c, int64_t n_in, int64_t n_out) {
    anneal_comm_request *r = anneal_comm_request_new(c);
    if (!r) return NULL;
    r->done = false;
    if (n_in >= 0 && !(r->tmp_in = malloc((size_t)(n_in > 0 ? n_in : 1) * sizeof(float)))) goto oom;
    if (n_out >= 0 && !(r->tmp_out = malloc((size_t)(n_out > 0 ? n_out : 1) * sizeof(float)))) goto oom;
    return r;
oom:
    free(r->tmp_in);
    free(r);
    anneal_set_error(ANNEAL_ERR_OOM, "out of memory staging a bf16 reduction");
    return NULL;
}

anneal_status anneal_comm_mpi_allreduce(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                        anneal_reduce_op op, anneal_comm_request **req) {
    bool bf16 = dt == ANNEAL_BF16;
    anneal_comm_request *r = new_req(c, -1, bf16 ? count : -1);
    if (!r) return anneal_last_status();
    r->out = buf;
    r->count = count;
    r->mean = op == ANNEAL_REDUCE_MEAN;
    float *work = buf;
    if (bf16) {
        anneal_comm_bf16_to_f32(buf, r->tmp_out, count);
        work = r->tmp_out;
        r->post = COMM_POST_TO_BF16;
    } else if (r->mean) {
        r->post = COMM_POST_DIV_F32;
    }
    int rc = MPI_Iallreduce(MPI_IN_PLACE, nz(work), (int)count, MPI_FLOAT, MPI_SUM, c->comm, &r->req);
    if (rc != MPI_SUCCESS) return fail(r, rc, "MPI_Iallreduce");
    return finish(r, req);
}

anneal_status anneal_comm_mpi_reduce_scatter(anneal_comm *c, const void *send, void *recv, int64_t count,
                                             anneal_dtype dt, anneal_reduce_op op, anneal_comm_request **req) {
    bool bf16 = dt == ANNEAL_BF16;
    anneal_comm_request *r = new_req(c, bf16 ? count * c->size : -1, bf16 ? count : -1);
    if (!r) return anneal_last_status();
    r->out = recv;
    r->count = count;
    r->mean = op == ANNEAL_REDUCE_MEAN;
    const void *in = send;
    void *out = recv;
    if (bf16) {
        anneal_comm_bf16_to_f32(send, r->tmp_in, count * c->size);
        in = r->tmp_in;
        out = r->tmp_out;
        r->post = COMM_POST_TO_BF16;
    } else if (r->mean) {
        r->post = COMM_POST_DIV_F32;
    }
    /* send == recv: MPI's in-place form (input in recv, result at its start). */
    const void *sb = in == out ? MPI_IN_PLACE : nz((void *)in);
    int rc = MPI_Ireduce_scatter_block(sb, nz(out), (int)count, MPI_FLOAT, MPI_SUM, c->comm, &r->req);
    if (rc != MPI_SUCCESS) return fail(r, rc, "MPI_Ireduce_scatter_block");
    return finish(r, req);
}

anneal_status anneal_comm_mpi_all_gather(anneal_comm *c, const void *send, void *recv, int64_t count,
                                         anneal_dtype dt, anneal_comm_request **req) {
    anneal_comm_request *r = new_req(c, -1, -1);
    if (!r) return anneal_last_status();
    MPI_Datatype t = mpi_type(dt);
    const char *own = (const char *)recv + (size_t)c->rank * (size_t)count * anneal_dtype_size(dt);
    const void *sb = count > 0 && (const char *)send == own ? MPI_IN_PLACE : nz((void *)send);
    int rc = MPI_Iallgather(sb, (int)count, t, nz(recv), (int)count, t, c->comm, &r->req);
    if (rc != MPI_SUCCESS) return fail(r, rc, "MPI_Iallgather");
    return finish(r, req);
}

anneal_status anneal_comm_mpi_broadcast(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int root) {
    MPI_TRY(MPI_Bcast(nz(buf), (int)count, mpi_type(dt), root, c->comm), "MPI_Bcast");
    return ANNEAL_OK;
}

anneal_status anneal_comm_mpi_barrier(anneal_comm *c) {
    MPI_TRY(MPI_Barrier(c->comm), "MPI_Barrier");
    return ANNEAL_OK;
}

/* MPI_Comm_split of c's communicator; the new handle keeps MPI alive like the first. */
anneal_comm *anneal_comm_mpi_split(anneal_comm *c, int color, int key) {
    anneal_comm *n = calloc(1, sizeof *n);
    if (!n) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a communicator");
        return NULL;
    }
    int rc = MPI_Comm_split(c->comm, color, key, &n->comm);
    if (rc != MPI_SUCCESS) {
        mpi_error(rc, "MPI_Comm_split");
        free(n);
        return NULL;
    }
    MPI_Comm_set_errhandler(n->comm, MPI_ERRORS_RETURN);
    n->mpi = true;
    n->threads_ok = c->threads_ok;
    MPI_Comm_rank(n->comm, &n->rank);
    MPI_Comm_size(n->comm, &n->size);
    n->local_rank = c->local_rank;
    n->local_size = c->local_size;
    g_users++;
    return n;
}

/* MPI_Isend / MPI_Irecv (raw elements of dt), waited for unless req is given. */
anneal_status anneal_comm_mpi_p2p(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int peer, int tag,
                                  bool send, anneal_comm_request **req) {
    anneal_comm_request *r = new_req(c, -1, -1);
    if (!r) return anneal_last_status();
    int rc = send ? MPI_Isend(nz(buf), (int)count, mpi_type(dt), peer, tag, c->comm, &r->req)
                  : MPI_Irecv(nz(buf), (int)count, mpi_type(dt), peer, tag, c->comm, &r->req);
    if (rc != MPI_SUCCESS) return fail(r, rc, send ? "MPI_Isend" : "MPI_Irecv");
    return finish(r, req);
}

anneal_status anneal_comm_mpi_wait(anneal_comm_request *r) {
    int rc = MPI_Wait(&r->req, MPI_STATUS_IGNORE);
    r->done = true;
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Wait");
    return ANNEAL_OK;
}

anneal_status anneal_comm_mpi_test(anneal_comm_request *r, bool *done) {
    int flag = 0;
    int rc = MPI_Test(&r->req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
        r->done = true;
        return mpi_error(rc, "MPI_Test");
    }
    if (flag) r->done = true;
    *done = r->done;
    return ANNEAL_OK;
}

void anneal_comm_mpi_abort(anneal_comm *c, int code) {
    MPI_Abort(c->comm, code ? code : 1);
    exit(code ? code : 1);
}

#else
/* Built without MPI: comm.c provides the single-process communicator only. */
typedef int anneal_comm_mpi_unused;
#endif
