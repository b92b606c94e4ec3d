/* Data-parallel gradient synchronisation.
 *
 * Layout. The flat parameter space is every parameter concatenated in registration
 * order. Buckets are runs of consecutive parameters taken from the end (backward
 * produces the last parameters' gradients first), each about bucket_bytes; bucket k's
 * flat buffer holds its parameters in registration order, so it is one contiguous
 * range [start, start + n) of the flat space.
 *
 * Stage 0 (DDP): each bucket buffer is all-reduced (mean) and copied back into .grad.
 * Stages 1-2 (ZeRO): each bucket is padded to chunk * world elements (chunk =
 * ceil(n / world)) and reduce-scattered: rank r owns bucket-local elements
 * [r*chunk, (r+1)*chunk) that are real (the padding is zeros at the end of the last
 * ranks' chunks). The rank's shard is the concatenation, in bucket order, of its real
 * chunk elements; anneal_ddp_shard_pieces splits it at parameter boundaries. Stage 2
 * frees each .grad as soon as it has been copied into its bucket, and bucket buffers
 * of stages 1-2 live only while their collective is in flight. Stage 3 is stage 2 with
 * buckets cut at cfg.groups boundaries (a transformer block each) and the parameter
 * values kept in a shard of zero3.c's (anneal_ddp_set_param_shard).
 *
 * Overlap. With cfg.overlap, begin_backward(sync) installs the autograd grad-ready
 * hook: when the last parameter of a bucket is ready, the bucket is copied and its
 * non-blocking collective started. Collectives are started strictly in bucket order
 * (a bucket that fills early waits for its predecessors), so every rank issues the
 * same sequence even if backward's timing differs. OpenMPI's non-blocking collectives
 * advance only inside MPI calls, so something must call MPI while backward computes:
 *  - default (polling): every hook call (once per parameter) tests all in-flight
 *    requests. No extra thread, MPI_THREAD_FUNNELED. With shared-memory single-copy
 *    (vader + CMA, OpenMPI's default where ptrace is allowed) a few tests move a whole
 *    message, so this hides most of the waiting; without it (copy-in/copy-out
 *    fragments) progress is coarse.
 *  - ANNEAL_DDP_PROGRESS=thread: a progress thread tests the requests every ~50 us
 *    during backward (MPI_THREAD_MULTIPLE asked at init; all MPI calls made between
 *    begin_backward and finish hold d->mu). It needs a spare core: with ranks x
 *    threads = cores it steals time from backward.
 * Either way the copies MPI does on the CPU still cost CPU time; only waiting is
 * hidden. Figures: bench/bench_ddp.c.
 *
 * Devices. The parameters' device is the tensors' (all on one). Bucket buffers and the
 * shard are tensors on it, filled and emptied through its backend's copy on views
 * (each gradient lands in its bucket by a converting copy); only the collectives see
 * raw addresses, so the communicator must address that device's memory: MPI moves
 * host memory, and parameters elsewhere are refused at anneal_ddp_new. */

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "anneal/trace.h"
#include "parallel/comm_internal.h"

#include "anneal/autograd.h"
#include "anneal/backend.h"

typedef struct ddp_bucket {
    int lo, hi;          /* parameters lo..hi (inclusive, registration indices) */
    int64_t start, n;    /* flat range */
    int64_t chunk;       /* stages 1-2: elements per rank, ceil(n / world) */
    int64_t shard_off, shard_len; /* this rank's real chunk elements inside the shard */
    int pending;         /* parameters whose gradient is not ready yet (this backward) */
    bool launched, completed;
    anneal_tensor *buf;  /* f32, stage 0: n (kept); stages 1-2: chunk * world (while in flight) */
    anneal_tensor *recv; /* f32, stages 1-2: chunk */
    anneal_comm_request *req;
    int64_t span_t0;     /* profiler: launch time (0: not recording) */
} ddp_bucket;

typedef struct ptr_index {
    const anneal_tensor *t;
    int i;
} ptr_index;

struct anneal_ddp {
    anneal_comm *c;
    anneal_params *ps;
    anneal_ddp_config cfg;
    anneal_device dev;    /* the parameters' device */
    const anneal_backend *be;
    int n;                /* parameters covered (registered when d was made) */
    int64_t total;        /* flat elements */
    int64_t *offset;      /* flat offset of each parameter */
    int *bucket_of;
    bool *ready;
    ddp_bucket *b;
    int nb;
    int next_launch;      /* buckets < next_launch have been started */
    ptr_index *lookup;    /* sorted by tensor address, for the hook */
    anneal_ddp_piece *pieces;
    int n_pieces;
    int64_t shard_numel;
    anneal_tensor *shard_grad; /* stages 1-2 */
    bool armed;           /* hook installed for a synchronising backward */
    bool synced;
    anneal_status err;    /* first failure inside the hook, reported by finish */
    int64_t bucket_live;  /* bytes of bucket buffers held now */
    int64_t state_bytes;
    anneal_ddp_comm_hook hook; /* replaces the buckets' collectives (powersgd.c) */
    void *hook_user;
    anneal_tensor *param_shard; /* stage 3: the parameters' shard (zero3.c), not owned */
    anneal_status (*param_gather)(void *user); /* stage 3: anneal_ddp_gather_params */
    void *param_gather_user;
    double *param_ss;     /* anneal_ddp_set_full_norm: each parameter's sum of squares from the agreed buckets */
    bool keep_full_grads; /* anneal_ddp_set_keep_full_grads: the agreed gradients into .grad too */
    /* ANNEAL_DDP_PROGRESS=thread: a thread tests the in-flight requests during backward
     * instead of the hook; every MPI call between begin_backward and finish happens
     * under mu (so MPI_THREAD_SERIALIZED is enough). */
    bool use_thread, thread_on, thread_stop;
    pthread_t thread;
    pthread_mutex_t mu;
    char thread_msg[512]; /* the progress thread's error (errors are per thread) */
};

anneal_ddp_config anneal_ddp_defaults(void) {
    anneal_ddp_config c = {.bucket_bytes = 25 << 20, .overlap = true, .zero_stage = 0};
    return c;
}

static void stop_thread(anneal_ddp *d);
static anneal_status sums_of_squares(const anneal_ddp *d, int n, const anneal_tensor *const *ts, double *out);

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const ptr_index *)a)->t, y = (uintptr_t)((const ptr_index *)b)->t;
    return x < y ? -1 : x > y;
}

static int find_param(const anneal_ddp *d, const anneal_tensor *t) {
    ptr_index key = {t, 0};
    const ptr_index *hit = bsearch(&key, d->lookup, (size_t)d->n, sizeof key, cmp_ptr);
    return hit ? hit->i : -1;
}

static int64_t numel_of(const anneal_ddp *d, int i) {
    return (i + 1 < d->n ? d->offset[i + 1] : d->total) - d->offset[i];
}

/* A caller-owned view of elements [off, off + numel of shape) of the flat f32 t,
 * shaped (ndim, shape) contiguously (a parameter's slice of a bucket or the shard). */
static anneal_tensor *view(const anneal_tensor *t, int64_t off, int ndim, const int64_t *shape) {
    int64_t strides[ANNEAL_MAX_DIMS], st = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        strides[i] = st;
        st *= shape[i];
    }
    anneal_scope_enter(NULL);
    anneal_tensor *v = anneal_alias(t, ndim, shape, strides, t->offset + off);
    anneal_scope_leave();
    return v;
}

/* A caller-owned 1-D view of len elements of t from element off. */
static anneal_tensor *flat(const anneal_tensor *t, int64_t off, int64_t len) { return view(t, off, 1, &len); }

/* dst = src through the backend (converting, any strides), the views released after. */
static anneal_status copy_release(const anneal_ddp *d, anneal_tensor *dst, anneal_tensor *src) {
    anneal_status s = dst && src ? d->be->copy(d->be->ctx, dst, src) : anneal_last_status();
    anneal_release(dst);
    anneal_release(src);
    return s;
}

/* A caller-owned flat f32 buffer of n elements on the parameters' device. */
static anneal_tensor *new_buffer(const anneal_ddp *d, int64_t n) {
    anneal_scope_enter(NULL);
    anneal_tensor *t = anneal_empty_on(d->dev, ANNEAL_F32, 1, &n);
    anneal_scope_leave();
    return t;
}

/* The host address of a buffer for the communicator (the device is host memory: see
 * anneal_ddp_new); the backend's queued work on it is finished first. */
static float *comm_ptr(const anneal_ddp *d, const anneal_tensor *t) { return t ? anneal_data(t) : NULL; }

/* Buckets from the last parameter backwards; a bucket closes when the next parameter
 * would take it past bucket_bytes (a larger parameter gets a bucket of its own). */
static bool make_buckets(anneal_ddp *d) {
    d->b = calloc((size_t)(d->n > 0 ? d->n : 1), sizeof *d->b);
    if (!d->b) return false;
    int world = anneal_comm_size(d->c), rank = anneal_comm_rank(d->c);
    int64_t shard = 0;
    for (int hi = d->n - 1; hi >= 0;) {
        int lo = hi;
        int64_t bytes = numel_of(d, hi) * 4;
        while (lo > 0 && bytes + numel_of(d, lo - 1) * 4 <= d->cfg.bucket_bytes &&
               (!d->cfg.groups || d->cfg.groups[lo - 1] == d->cfg.groups[hi]))
            bytes += numel_of(d, --lo) * 4;
        ddp_bucket *b = &d->b[d->nb];
        b->lo = lo;
        b->hi = hi;
        b->start = d->offset[lo];
        b->n = d->offset[hi] + numel_of(d, hi) - b->start;
        b->chunk = (b->n + world - 1) / world;
        int64_t a = (int64_t)rank * b->chunk, e = a + b->chunk < b->n ? a + b->chunk : b->n;
        b->shard_off = shard;
        b->shard_len = e > a ? e - a : 0;
        shard += b->shard_len;
        for (int p = lo; p <= hi; p++) d->bucket_of[p] = d->nb;
        d->nb++;
        hi = lo - 1;
    }
    d->shard_numel = d->cfg.zero_stage > 0 ? shard : 0;
    return true;
}

/* The pieces of this rank's shard: its chunk of every bucket cut at parameter
 * boundaries, in shard order. */
static bool make_pieces(anneal_ddp *d) {
    if (d->cfg.zero_stage == 0) return true;
    d->pieces = calloc((size_t)(d->n > 0 ? d->n : 1) + (size_t)d->nb, sizeof *d->pieces);
    if (!d->pieces) return false;
    int rank = anneal_comm_rank(d->c);
    for (int k = 0; k < d->nb; k++) {
        ddp_bucket *b = &d->b[k];
        int64_t a = b->start + (int64_t)rank * b->chunk, e = a + b->shard_len;
        for (int p = b->lo; p <= b->hi && a < e; p++) {
            int64_t ps = d->offset[p], pe = ps + numel_of(d, p);
            int64_t s = a > ps ? a : ps, t = e < pe ? e : pe;
            if (t <= s) continue;
            d->pieces[d->n_pieces++] = (anneal_ddp_piece){
                .param = p, .offset = s - ps, .len = t - s, .shard_offset = b->shard_off + (s - (b->start + (int64_t)rank * b->chunk))};
        }
    }
    return true;
}

void anneal_ddp_free(anneal_ddp *d) {
    if (!d) return;
    if (d->armed) anneal_set_grad_ready_hook(NULL, NULL);
    stop_thread(d);
    pthread_mutex_destroy(&d->mu);
    for (int k = 0; k < d->nb; k++) {
        anneal_comm_wait(d->b[k].req); /* never leave MPI writing into freed memory */
        anneal_release(d->b[k].buf);
        anneal_release(d->b[k].recv);
    }
    if (d->shard_grad) anneal_release(d->shard_grad);
    free(d->b);
    free(d->offset);
    free(d->bucket_of);
    free(d->ready);
    free(d->lookup);
    free(d->pieces);
    free(d->param_ss);
    free(d);
}

/* Checks the parameters (f32, contiguous, on one device whose memory the communicator
 * moves: MPI's is host memory) and builds the buckets and this rank's shard. */
anneal_ddp *anneal_ddp_new(anneal_comm *c, anneal_params *ps, anneal_ddp_config cfg) {
    if (!c || !ps) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_new: NULL communicator or parameter set");
        return NULL;
    }
    if (cfg.zero_stage < 0 || cfg.zero_stage > 3) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_new: zero stage %d (must be 0, 1, 2 or 3)", cfg.zero_stage);
        return NULL;
    }
    if (cfg.bucket_bytes <= 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_new: bucket size %lld bytes (must be > 0)",
                         (long long)cfg.bucket_bytes);
        return NULL;
    }
    anneal_device dev = anneal_comm_device(c);
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *t = ps->items[i].tensor;
        if (t->dtype != ANNEAL_F32 || !anneal_is_contiguous(t)) {
            anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_new: parameter '%s' must be a contiguous f32 tensor",
                             ps->items[i].name);
            return NULL;
        }
        if (t->device != dev) {
            anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                             "anneal_ddp_new: the MPI communicator works on host memory (%s); parameter '%s' and its "
                             "gradient are on %s (a communicator for that device, e.g. NCCL for CUDA, is not built)",
                             anneal_device_name(dev), ps->items[i].name, anneal_device_name(t->device));
            return NULL;
        }
    }
    const anneal_backend *be = anneal_backend_get(dev);
    if (!be) return NULL;
    anneal_ddp *d = calloc(1, sizeof *d);
    if (!d) goto oom;
    pthread_mutex_init(&d->mu, NULL);
    d->c = c;
    d->ps = ps;
    d->cfg = cfg;
    d->dev = dev;
    d->be = be;
    const char *prog = getenv("ANNEAL_DDP_PROGRESS");
    /* (stage 3: zero3.c's all-gathers run on the caller's thread during backward) */
    d->use_thread = prog && strcmp(prog, "thread") == 0 && anneal_comm_threads_ok(c) && cfg.zero_stage < 3;
    d->n = ps->n;
    size_t n1 = (size_t)(d->n > 0 ? d->n : 1);
    d->offset = calloc(n1, sizeof *d->offset);
    d->bucket_of = calloc(n1, sizeof *d->bucket_of);
    d->ready = calloc(n1, sizeof *d->ready);
    d->lookup = calloc(n1, sizeof *d->lookup);
    if (!d->offset || !d->bucket_of || !d->ready || !d->lookup) goto oom;
    for (int i = 0; i < d->n; i++) {
        d->offset[i] = d->total;
        d->total += anneal_numel(ps->items[i].tensor);
        d->lookup[i] = (ptr_index){ps->items[i].tensor, i};
    }
    qsort(d->lookup, (size_t)d->n, sizeof *d->lookup, cmp_ptr);
    if (!make_buckets(d) || !make_pieces(d)) goto oom;
    if (d->shard_numel > 0) {
        d->shard_grad = new_buffer(d, d->shard_numel);
        if (!d->shard_grad || be->fill(be->ctx, d->shard_grad, 0.0) != ANNEAL_OK) {
            anneal_ddp_free(d);
            return NULL;
        }
    }
    return d;
oom:
    anneal_ddp_free(d);
    anneal_set_error(ANNEAL_ERR_OOM, "out of memory setting up gradient buckets");
    return NULL;
}

/* Every parameter gets rank 0's values. */
anneal_status anneal_ddp_broadcast_params(anneal_ddp *d) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_broadcast_params: NULL sync");
    anneal_status s = d->be->synchronize(d->be->ctx);
    for (int i = 0; i < d->n && s == ANNEAL_OK; i++)
        s = anneal_comm_broadcast(d->c, comm_ptr(d, d->ps->items[i].tensor), numel_of(d, i), ANNEAL_F32, 0);
    return s;
}

static anneal_status note_err(anneal_ddp *d, anneal_status s) {
    if (s != ANNEAL_OK && d->err == ANNEAL_OK) d->err = s;
    return s;
}

/* Copies bucket k's gradients (missing ones as zeros) into its buffer through the
 * backend (a converting copy onto the parameter's slice of the bucket) and starts
 * (overlap) or runs its collective. */
static anneal_status launch(anneal_ddp *d, int k) {
    ddp_bucket *b = &d->b[k];
    const anneal_backend *be = d->be;
    int world = anneal_comm_size(d->c);
    int64_t nbuf = d->cfg.zero_stage == 0 ? b->n : b->chunk * world;
    b->span_t0 = anneal_span_begin();
    if (!b->buf) {
        if (!(b->buf = new_buffer(d, nbuf))) return anneal_last_status();
        d->bucket_live += nbuf * 4;
    }
    for (int p = b->lo; p <= b->hi; p++) {
        anneal_tensor *t = d->ps->items[p].tensor;
        anneal_tensor *slot = view(b->buf, d->offset[p] - b->start, t->ndim, t->shape);
        anneal_status s;
        if (t->grad) {
            s = copy_release(d, slot, anneal_retain(t->grad));
            if (s == ANNEAL_OK && d->cfg.zero_stage >= 2) anneal_grad_clear(t);
        } else {
            s = slot ? be->fill(be->ctx, slot, 0.0) : anneal_last_status();
            anneal_release(slot);
        }
        if (s != ANNEAL_OK) return s;
    }
    b->launched = true;
    if (d->hook) return be->synchronize(be->ctx); /* the hook runs in anneal_ddp_finish */
    if (d->cfg.zero_stage == 0) {
        anneal_status s = be->synchronize(be->ctx);
        if (s != ANNEAL_OK) return s;
        float *buf = comm_ptr(d, b->buf);
        if (d->cfg.overlap) return anneal_comm_allreduce_start(d->c, buf, b->n, ANNEAL_F32, ANNEAL_REDUCE_MEAN, &b->req);
        return anneal_comm_allreduce(d->c, buf, b->n, ANNEAL_F32, ANNEAL_REDUCE_MEAN);
    }
    if (nbuf > b->n) {
        anneal_tensor *pad = flat(b->buf, b->n, nbuf - b->n);
        anneal_status s = pad ? be->fill(be->ctx, pad, 0.0) : anneal_last_status();
        anneal_release(pad);
        if (s != ANNEAL_OK) return s;
    }
    if (!b->recv && !(b->recv = new_buffer(d, b->chunk))) return anneal_last_status();
    d->bucket_live += b->chunk * 4;
    anneal_status s = be->synchronize(be->ctx);
    if (s != ANNEAL_OK) return s;
    float *send = comm_ptr(d, b->buf), *recv = comm_ptr(d, b->recv);
    if (d->cfg.overlap)
        return anneal_comm_reduce_scatter_start(d->c, send, recv, b->chunk, ANNEAL_F32, ANNEAL_REDUCE_MEAN, &b->req);
    return anneal_comm_reduce_scatter(d->c, send, recv, b->chunk, ANNEAL_F32, ANNEAL_REDUCE_MEAN);
}

/* A new (caller-owned, tensor-owned) f32 gradient for parameter t, as the engine
 * makes them. */
static anneal_tensor *new_grad(anneal_tensor *t) {
    anneal_scope_enter(NULL);
    anneal_tensor *g = anneal_empty_on(t->device, ANNEAL_F32, t->ndim, t->shape);
    anneal_scope_leave();
    if (g) t->grad = g;
    return g;
}

/* After bucket k's collective: stage 0 copies the mean back into .grad (creating
 * missing ones; a converting copy into any dtype and strides); stages 1-2 keep the
 * rank's real chunk in the shard and free the buffers. */
static anneal_status complete(anneal_ddp *d, int k) {
    ddp_bucket *b = &d->b[k];
    b->completed = true;
    /* profiler: the bucket from launch until its completion was seen, on its own track */
    anneal_span_record_track("communication", ANNEAL_SPAN_COMM, d->cfg.zero_stage == 0 ? "all-reduce bucket" :
                             "reduce-scatter bucket", b->span_t0, 0, (double)b->n * 4.0);
    b->span_t0 = 0;
    if (d->cfg.zero_stage == 0) {
        for (int p = b->lo; p <= b->hi; p++) {
            anneal_tensor *t = d->ps->items[p].tensor;
            if (!t->grad && !new_grad(t)) return anneal_last_status();
            anneal_tensor *src = view(b->buf, d->offset[p] - b->start, t->ndim, t->shape);
            anneal_status s = copy_release(d, anneal_retain(t->grad), src);
            if (s != ANNEAL_OK) return s;
        }
        return ANNEAL_OK;
    }
    /* with a hook the whole agreed bucket is in buf: the rank's chunk starts at rank * chunk */
    const anneal_tensor *from = d->hook ? b->buf : b->recv;
    int64_t from_off = d->hook ? (int64_t)anneal_comm_rank(d->c) * b->chunk : 0;
    /* anneal_ddp_set_full_norm: the whole agreed bucket is here, so each parameter's sum
     * of squares is taken from its whole gradient (the same on every rank) */
    for (int p = b->lo; d->param_ss && d->hook && p <= b->hi; p++) {
        const anneal_tensor *t = d->ps->items[p].tensor;
        anneal_tensor *v = view(b->buf, d->offset[p] - b->start, t->ndim, t->shape);
        anneal_status s = v ? sums_of_squares(d, 1, (const anneal_tensor *const *)&v, &d->param_ss[p]) : anneal_last_status();
        anneal_release(v);
        if (s != ANNEAL_OK) return s;
    }
    for (int p = b->lo; d->keep_full_grads && d->hook && p <= b->hi; p++) { /* the whole agreed gradient */
        anneal_tensor *t = d->ps->items[p].tensor;
        if (!t->grad && !new_grad(t)) return anneal_last_status();
        anneal_status s = copy_release(d, anneal_retain(t->grad), view(b->buf, d->offset[p] - b->start, t->ndim, t->shape));
        if (s != ANNEAL_OK) return s;
    }
    if (b->shard_len > 0) {
        anneal_status s = copy_release(d, flat(d->shard_grad, b->shard_off, b->shard_len),
                                       flat(from, from_off, b->shard_len));
        if (s != ANNEAL_OK) return s;
    }
    d->bucket_live -= (b->chunk * anneal_comm_size(d->c) + (b->recv ? b->chunk : 0)) * 4;
    anneal_release(b->buf);
    anneal_release(b->recv);
    b->buf = b->recv = NULL;
    return ANNEAL_OK;
}

/* Starts every bucket from next_launch on whose gradients are all ready, in order. */
static void launch_ready(anneal_ddp *d) {
    while (d->err == ANNEAL_OK && d->next_launch < d->nb && d->b[d->next_launch].pending == 0)
        note_err(d, launch(d, d->next_launch++));
}

/* Drives MPI progress: tests each in-flight request and completes finished buckets. */
static void poll(anneal_ddp *d) {
    for (int k = 0; k < d->next_launch && d->err == ANNEAL_OK; k++) {
        ddp_bucket *b = &d->b[k];
        if (!b->req) continue;
        bool done = false;
        if (note_err(d, anneal_comm_test(b->req, &done)) != ANNEAL_OK || !done) continue;
        anneal_comm_request *r = b->req;
        b->req = NULL;
        if (note_err(d, anneal_comm_wait(r)) == ANNEAL_OK) note_err(d, complete(d, k));
    }
}

/* Progress thread: tests every started, unfinished request every ~50 us until told
 * to stop (completion itself is left to anneal_ddp_finish on the caller's thread). */
static void *progress_main(void *arg) {
    anneal_ddp *d = arg;
    const struct timespec nap = {0, 50000};
    for (;;) {
        pthread_mutex_lock(&d->mu);
        bool stop = d->thread_stop;
        for (int k = 0; k < d->next_launch && !stop && d->err == ANNEAL_OK; k++) {
            anneal_comm_request *r = d->b[k].req;
            if (!r || anneal_comm_request_done(r)) continue;
            bool done = false;
            anneal_status s = anneal_comm_test(r, &done);
            if (s != ANNEAL_OK) {
                snprintf(d->thread_msg, sizeof d->thread_msg, "%s", anneal_last_error());
                d->err = s;
            }
        }
        pthread_mutex_unlock(&d->mu);
        if (stop) return NULL;
        nanosleep(&nap, NULL);
    }
}

static void stop_thread(anneal_ddp *d) {
    if (!d->thread_on) return;
    pthread_mutex_lock(&d->mu);
    d->thread_stop = true;
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->thread, NULL);
    d->thread_on = false;
    if (d->err != ANNEAL_OK && d->thread_msg[0]) anneal_set_error(d->err, "%s", d->thread_msg);
    d->thread_msg[0] = 0;
}

/* The grad-ready hook: marks the parameter, launches full buckets, polls (or, with
 * the progress thread, leaves the testing to it). */
static void on_grad_ready(anneal_tensor *leaf, void *user) {
    anneal_ddp *d = user;
    int i = find_param(d, leaf);
    if (i < 0 || d->err != ANNEAL_OK) return;
    if (d->ready[i]) {
        note_err(d, anneal_set_error(ANNEAL_ERR_STATE,
                                     "gradient sync: '%s' got a gradient after its bucket was sent (two backward "
                                     "calls in one synchronising micro-step?)", d->ps->items[i].name));
        return;
    }
    d->ready[i] = true;
    d->b[d->bucket_of[i]].pending--;
    if (d->thread_on) {
        pthread_mutex_lock(&d->mu);
        launch_ready(d);
        pthread_mutex_unlock(&d->mu);
        return;
    }
    launch_ready(d);
    poll(d);
}

/* Forgets the last synchronisation's per-bucket progress. */
static void reset_progress(anneal_ddp *d) {
    for (int k = 0; k < d->nb; k++) {
        ddp_bucket *b = &d->b[k];
        b->pending = b->hi - b->lo + 1;
        b->launched = b->completed = false;
    }
    memset(d->ready, 0, (size_t)(d->n > 0 ? d->n : 1) * sizeof *d->ready);
    d->next_launch = 0;
    d->err = ANNEAL_OK;
}

anneal_status anneal_ddp_begin_backward(anneal_ddp *d, bool sync) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_begin_backward: NULL sync");
    if (d->next_launch > 0)
        return anneal_set_error(ANNEAL_ERR_STATE, "anneal_ddp_begin_backward: the previous synchronising "
                                                  "backward was not finished (call anneal_ddp_finish)");
    reset_progress(d);
    d->synced = false;
    d->armed = sync && d->cfg.overlap;
    anneal_set_grad_ready_hook(d->armed ? on_grad_ready : NULL, d->armed ? d : NULL);
    if (d->armed && d->use_thread) {
        d->thread_stop = false;
        d->thread_msg[0] = 0;
        d->thread_on = pthread_create(&d->thread, NULL, progress_main, d) == 0; /* else: polling */
    }
    return ANNEAL_OK;
}

/* Launches what backward did not, waits for everything in bucket order, removes the
 * hook. On failure the buckets are still drained so no collective is left writing. */
anneal_status anneal_ddp_finish(anneal_ddp *d) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_finish: NULL sync");
    if (d->armed) anneal_set_grad_ready_hook(NULL, NULL);
    d->armed = false;
    stop_thread(d);
    for (int k = 0; k < d->nb; k++) d->b[k].pending = 0; /* missing gradients count as zeros */
    launch_ready(d);
    for (int k = 0; k < d->nb; k++) {
        ddp_bucket *b = &d->b[k];
        if (b->req) {
            anneal_comm_request *r = b->req;
            b->req = NULL;
            if (note_err(d, anneal_comm_wait(r)) != ANNEAL_OK) continue;
        }
        if (b->launched && !b->completed && d->err == ANNEAL_OK && d->hook)
            note_err(d, d->hook(d->hook_user, d, k, comm_ptr(d, b->buf)));
        if (b->launched && !b->completed && d->err == ANNEAL_OK) note_err(d, complete(d, k));
    }
    anneal_status s = d->err;
    reset_progress(d);
    if (s != ANNEAL_OK) return s;
    d->synced = true;
    return ANNEAL_OK;
}

/* The sums of squares of n tensors (contiguous f32 on the parameters' device; NULL
 * counts as 0) into out[0..n), through one F64 tensor on the device and one copy to
 * the host: the backend's sum_squares, so the same bits as optim's anneal_grad_norm. */
static anneal_status sums_of_squares(const anneal_ddp *d, int n, const anneal_tensor *const *ts, double *out) {
    const anneal_backend *be = d->be;
    int64_t len = n > 0 ? n : 1;
    anneal_scope_enter(NULL);
    anneal_tensor *acc = anneal_empty_on(d->dev, ANNEAL_F64, 1, &len);
    anneal_scope_leave();
    anneal_status s = acc ? ANNEAL_OK : anneal_last_status();
    for (int i = 0; i < n && s == ANNEAL_OK; i++)
        if (ts[i]) s = be->sum_squares(be->ctx, acc, i, ts[i]);
    if (s == ANNEAL_OK) s = be->copy_to_host(be->ctx, out, anneal_data(acc), (size_t)n * sizeof *out);
    if (s == ANNEAL_OK) s = be->synchronize(be->ctx);
    for (int i = 0; i < n; i++)
        if (!ts[i]) out[i] = 0.0;
    anneal_release(acc);
    return s;
}

/* sum of squares of the shard, combined across ranks in rank order (all-gather of the
 * per-rank doubles, then a fixed-order sum: every rank gets the same bits). */
static anneal_status shard_norm(anneal_ddp *d, float *norm) {
    double ss = 0;
    const anneal_tensor *shard = d->shard_grad;
    anneal_status s = shard ? sums_of_squares(d, 1, &shard, &ss) : ANNEAL_OK;
    if (s != ANNEAL_OK) return s;
    int world = anneal_comm_size(d->c);
    double *all = malloc((size_t)world * sizeof *all);
    if (!all) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory for the gradient norm");
    /* 8-byte elements: the doubles travel as raw I64 bits. */
    s = anneal_comm_all_gather(d->c, &ss, all, 1, ANNEAL_I64);
    double total = 0;
    for (int r = 0; r < world && s == ANNEAL_OK; r++) total += all[r];
    free(all);
    *norm = (float)sqrt(total);
    return s;
}

static anneal_status require_synced(const anneal_ddp *d, const char *what) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL sync", what);
    if (!d->synced)
        return anneal_set_error(ANNEAL_ERR_STATE, "%s: gradients are not synchronised (call anneal_ddp_finish)", what);
    return ANNEAL_OK;
}

anneal_status anneal_ddp_scale_grads(anneal_ddp *d, float s) {
    anneal_status st = require_synced(d, "anneal_ddp_scale_grads");
    if (st != ANNEAL_OK) return st;
    const anneal_backend *be = d->be;
    /* scale_by: an f32 multiply per element, as the backend's binary MUL does */
    if (d->cfg.zero_stage > 0) return d->shard_grad ? be->scale_by(be->ctx, d->shard_grad, NULL, NULL, s) : ANNEAL_OK;
    for (int i = 0; i < d->n; i++) {
        anneal_tensor *g = d->ps->items[i].tensor->grad;
        if (!g) continue;
        if (g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "anneal_ddp_scale_grads: grad of '%s' is not contiguous f32",
                                    d->ps->items[i].name);
        if ((st = be->scale_by(be->ctx, g, NULL, NULL, s)) != ANNEAL_OK) return st;
    }
    return ANNEAL_OK;
}

/* Stage 0: every rank holds identical mean gradients in .grad (contiguous f32, made
 * by anneal_ddp_finish): the sum over parameters, in registration order and in double,
 * of each one's sum of squares: the arithmetic of optim's anneal_grad_norm (parallel
 * sits above optim, so it does not call it), hence the same bits on every rank and as
 * one process. */
static anneal_status full_norm(anneal_ddp *d, float *norm) {
    const anneal_tensor **gs = calloc((size_t)(d->n > 0 ? d->n : 1), sizeof *gs);
    double *ss = malloc((size_t)(d->n > 0 ? d->n : 1) * sizeof *ss);
    anneal_status s = gs && ss ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "out of memory for the gradient norm");
    for (int i = 0; i < d->n && s == ANNEAL_OK; i++) {
        const anneal_tensor *g = d->ps->items[i].tensor->grad;
        if (g && (g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g)))
            s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "anneal_ddp_clip_grad_norm: grad of '%s' is not contiguous f32",
                                 d->ps->items[i].name);
        gs[i] = g;
    }
    if (s == ANNEAL_OK) s = sums_of_squares(d, d->n, gs, ss);
    double total = 0;
    for (int i = 0; i < d->n && s == ANNEAL_OK; i++) total += ss[i];
    free(gs);
    free(ss);
    if (s == ANNEAL_OK) *norm = (float)sqrt(total);
    return s;
}

/* The norm (full_norm at stage 0; the shards combined by shard_norm at stages 1-2),
 * then PyTorch's coefficient max_norm / (norm + 1e-6) in f32, applied when < 1 (the
 * same multiply as anneal_ddp_scale_grads). */
anneal_status anneal_ddp_clip_grad_norm(anneal_ddp *d, float max_norm, float *norm_out) {
    anneal_status s = require_synced(d, "anneal_ddp_clip_grad_norm");
    if (s != ANNEAL_OK) return s;
    if (!(max_norm >= 0) && !(max_norm <= 0))
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_clip_grad_norm: invalid max_norm %g", (double)max_norm);
    float norm = 0;
    if (d->cfg.zero_stage > 0 && d->param_ss && d->hook) { /* anneal_ddp_set_full_norm: full_norm's order */
        double total = 0;
        for (int i = 0; i < d->n; i++) total += d->param_ss[i];
        norm = (float)sqrt(total);
    } else if ((s = d->cfg.zero_stage == 0 ? full_norm(d, &norm) : shard_norm(d, &norm)) != ANNEAL_OK) {
        return s;
    }
    if (norm_out) *norm_out = norm;
    if (!isfinite(norm) || !(max_norm > 0)) return ANNEAL_OK;
    float coef = max_norm / (norm + 1e-6f);
    return coef < 1.0f ? anneal_ddp_scale_grads(d, coef) : ANNEAL_OK;
}

int64_t anneal_ddp_shard_numel(const anneal_ddp *d) { return d ? d->shard_numel : 0; }

const anneal_ddp_piece *anneal_ddp_shard_pieces(const anneal_ddp *d, int *n) {
    if (n) *n = d ? d->n_pieces : 0;
    return d ? d->pieces : NULL;
}

float *anneal_ddp_shard_grad(anneal_ddp *d) { return d && d->shard_grad ? comm_ptr(d, d->shard_grad) : NULL; }

/* All-gathers in flight at once while gathering a shard: enough to overlap one
 * bucket's unpacking with the next one's transfer, while the staging stays at two
 * buckets instead of a full copy of the parameters. */
#define GATHER_WINDOW 2

/* Waits for bucket k's all-gather (if started) and unpacks it into dst (backend copies
 * from the gathered buffer onto each parameter's tensor). */
static anneal_status gather_unpack(anneal_ddp *d, int k, anneal_comm_request **req, anneal_tensor **full,
                                   anneal_tensor **send, anneal_tensor *const *dst, anneal_status s) {
    anneal_status w = anneal_comm_wait(req[k]); /* wait even after an error: MPI is writing */
    req[k] = NULL;
    if (s == ANNEAL_OK) s = w;
    ddp_bucket *b = &d->b[k];
    for (int p = b->lo; s == ANNEAL_OK && full[k] && p <= b->hi; p++) {
        anneal_tensor *t = dst[p];
        s = copy_release(d, anneal_retain(t), view(full[k], d->offset[p] - b->start, t->ndim, t->shape));
    }
    anneal_release(full[k]);
    anneal_release(send[k]);
    full[k] = send[k] = NULL;
    return s;
}

/* Gathers shard-layout data from every rank into full per-parameter tensors, bucket by
 * bucket (in bucket order on every rank), GATHER_WINDOW buckets in flight. */
anneal_status anneal_ddp_gather_shard(anneal_ddp *d, const anneal_tensor *shard, anneal_tensor *const *dst) {
    if (!d || d->cfg.zero_stage == 0)
        return anneal_set_error(ANNEAL_ERR_STATE, "gathering a shard needs a ZeRO stage 1-2 sync");
    const anneal_backend *be = d->be;
    int world = anneal_comm_size(d->c);
    anneal_tensor **full = calloc((size_t)d->nb + 1, sizeof *full), **send = calloc((size_t)d->nb + 1, sizeof *send);
    anneal_comm_request **req = calloc((size_t)d->nb + 1, sizeof *req);
    if (!full || !send || !req) {
        free(full), free(send), free(req);
        return anneal_set_error(ANNEAL_ERR_OOM, "out of memory gathering a shard");
    }
    anneal_status s = ANNEAL_OK;
    int next_wait = 0;
    for (int k = 0; k < d->nb && s == ANNEAL_OK; k++) {
        ddp_bucket *b = &d->b[k];
        if (b->chunk > 0) {
            full[k] = new_buffer(d, b->chunk * world);
            send[k] = full[k] ? new_buffer(d, b->chunk) : NULL;
            if (!send[k]) {
                s = anneal_last_status();
                break;
            }
            s = be->fill(be->ctx, send[k], 0.0);
            if (s == ANNEAL_OK && b->shard_len > 0)
                s = copy_release(d, flat(send[k], 0, b->shard_len), flat(shard, b->shard_off, b->shard_len));
            if (s == ANNEAL_OK) s = be->synchronize(be->ctx);
            if (s == ANNEAL_OK)
                s = anneal_comm_all_gather_start(d->c, comm_ptr(d, send[k]), comm_ptr(d, full[k]), b->chunk, ANNEAL_F32,
                                                 &req[k]);
        }
        while (next_wait <= k - GATHER_WINDOW + 1) s = gather_unpack(d, next_wait++, req, full, send, dst, s);
    }
    while (next_wait < d->nb) s = gather_unpack(d, next_wait++, req, full, send, dst, s);
    free(full);
    free(send);
    free(req);
    return s;
}

/* Each rank's pieces are read from its parameters (backend copies into a shard-layout
 * buffer) and gathered into everyone's. */
anneal_status anneal_ddp_gather_params(anneal_ddp *d) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_gather_params: NULL sync");
    if (d->cfg.zero_stage == 0) return ANNEAL_OK; /* every rank updated every parameter */
    if (d->cfg.zero_stage == 3) return d->param_gather ? d->param_gather(d->param_gather_user) : ANNEAL_OK;
    anneal_tensor *shard = new_buffer(d, d->shard_numel > 0 ? d->shard_numel : 1);
    anneal_tensor **dst = malloc((size_t)(d->n > 0 ? d->n : 1) * sizeof *dst);
    if (!shard || !dst) {
        anneal_release(shard);
        free(dst);
        return anneal_set_error(ANNEAL_ERR_OOM, "out of memory gathering parameters");
    }
    anneal_status s = ANNEAL_OK;
    for (int k = 0; k < d->n_pieces && s == ANNEAL_OK; k++) {
        const anneal_ddp_piece *pc = &d->pieces[k];
        s = copy_release(d, flat(shard, pc->shard_offset, pc->len), flat(d->ps->items[pc->param].tensor, pc->offset, pc->len));
    }
    for (int i = 0; i < d->n; i++) dst[i] = d->ps->items[i].tensor;
    if (s == ANNEAL_OK) s = anneal_ddp_gather_shard(d, shard, dst);
    anneal_release(shard);
    free(dst);
    return s;
}

anneal_ddp_memory anneal_ddp_memory_get(const anneal_ddp *d) {
    anneal_ddp_memory m = {0};
    if (!d) return m;
    m.param_bytes = d->total * 4;
    for (int i = 0; i < d->n; i++) {
        const anneal_tensor *g = d->ps->items[i].tensor->grad;
        if (g) m.grad_bytes += anneal_numel(g) * (int64_t)anneal_dtype_size(g->dtype);
    }
    m.grad_bytes += d->shard_numel * 4;
    m.bucket_bytes = d->bucket_live; /* not included in grad_bytes */
    m.state_bytes = d->state_bytes;
    return m;
}

anneal_comm *anneal_ddp_comm(const anneal_ddp *d) { return d ? d->c : NULL; }
int anneal_ddp_stage(const anneal_ddp *d) { return d ? d->cfg.zero_stage : 0; }
anneal_params *anneal_ddp_params(const anneal_ddp *d) { return d ? d->ps : NULL; }
anneal_tensor *anneal_ddp_shard_grad_tensor(anneal_ddp *d) { return d ? d->shard_grad : NULL; }
bool anneal_ddp_synced(const anneal_ddp *d) { return d && d->synced; }
void anneal_ddp_set_state_bytes(anneal_ddp *d, int64_t bytes) {
    if (d) d->state_bytes = bytes;
}

int anneal_ddp_bucket_count(const anneal_ddp *d) { return d ? d->nb : 0; }

anneal_ddp_bucket_info anneal_ddp_bucket(const anneal_ddp *d, int k) {
    anneal_ddp_bucket_info bi = {0};
    if (!d || k < 0 || k >= d->nb) return bi;
    bi.first_param = d->b[k].lo;
    bi.last_param = d->b[k].hi;
    bi.start = d->b[k].start;
    bi.numel = d->b[k].n;
    return bi;
}

/* The hook is read by launch (to skip the collective) and by finish (to run it), so it
 * must not change while a synchronising backward is in progress. */
anneal_status anneal_ddp_set_comm_hook(anneal_ddp *d, anneal_ddp_comm_hook fn, void *user) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_set_comm_hook: NULL sync");
    if (d->armed || d->next_launch > 0)
        return anneal_set_error(ANNEAL_ERR_STATE, "anneal_ddp_set_comm_hook: a synchronising backward is in progress");
    d->hook = fn;
    d->hook_user = fn ? user : NULL;
    return ANNEAL_OK;
}

void anneal_ddp_set_param_shard(anneal_ddp *d, anneal_tensor *shard, anneal_status (*gather)(void *user), void *user) {
    if (!d) return;
    d->param_shard = shard;
    d->param_gather = gather;
    d->param_gather_user = user;
}

anneal_tensor *anneal_ddp_param_shard(const anneal_ddp *d) { return d ? d->param_shard : NULL; }

/* Stages 1-3 with a comm hook that leaves the whole agreed bucket on every rank: the
 * norm is then each parameter's sum of squares (taken in complete) added in
 * registration order, full_norm's arithmetic, instead of the shards' sums. */
anneal_status anneal_ddp_set_full_norm(anneal_ddp *d) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_set_full_norm: NULL sync");
    if (d->cfg.zero_stage == 0 || d->param_ss) return ANNEAL_OK; /* stage 0: full_norm already */
    d->param_ss = calloc((size_t)(d->n > 0 ? d->n : 1), sizeof *d->param_ss);
    return d->param_ss ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "out of memory for the gradient norm");
}

anneal_status anneal_ddp_set_keep_full_grads(anneal_ddp *d) {
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_ddp_set_keep_full_grads: NULL sync");
    d->keep_full_grads = d->cfg.zero_stage > 0;
    return ANNEAL_OK;
}

const double *anneal_ddp_full_norm_sums(const anneal_ddp *d) {
    return d && d->param_ss && d->hook && d->synced ? d->param_ss : NULL;
}
