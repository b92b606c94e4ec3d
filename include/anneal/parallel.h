/* anneal parallel: processes working on one training run. A communicator over MPI (CPU
 * processes launched by mpirun/srun) or a single-process stand-in when MPI is absent
 * (same calls, world size 1), and data-parallel gradient synchronisation: buckets of
 * gradients hung on the autograd engine's grad-ready hook, all-reduced (DDP) or
 * reduce-scattered to their owner rank (ZeRO), overlapping the rest of backward.
 * The NCCL communicator (anneal_comm_nccl_new) implements the same calls for buffers in
 * GPU memory. */
#ifndef ANNEAL_PARALLEL_H
#define ANNEAL_PARALLEL_H

#include "anneal/model.h"
#include "anneal/nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --------------------------------------------------------------- communicator */

typedef struct anneal_comm anneal_comm;
typedef struct anneal_comm_request anneal_comm_request;

typedef enum anneal_reduce_op { ANNEAL_REDUCE_SUM, ANNEAL_REDUCE_MEAN } anneal_reduce_op;

/* Joins the job this process was launched in: MPI when the build has it and the
 * environment says a launcher started us (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK,
 * SLURM_NTASKS under srun ...), the single-process communicator otherwise. Call once,
 * before any other thread is started. NULL + error on failure. */
anneal_comm *anneal_comm_init(void);
/* Leaves the job (MPI_Finalize when MPI was used) and frees c. */
void anneal_comm_free(anneal_comm *c);

/* True when this build has the NCCL communicator (CUDA builds where CMake found NCCL). */
bool anneal_comm_nccl_available(void);
/* A communicator over NCCL on CUDA device `device` with host's ranks and size: every
 * rank of host must call it (rank 0's ncclUniqueId is broadcast over host). Its
 * collectives take buffers in GPU memory and run on its own stream: blocking calls wait
 * for it, _start calls return a request whose wait synchronises an event. Sums and
 * means are NCCL's (ncclSum, ncclAvg; bf16 reduced as NCCL reduces it); send/receive
 * ignore tags (pairs match in call order). NULL + error (NCCL's or CUDA's message) on
 * failure, or when the build has no NCCL. Free it before host. Never run yet: written
 * and compiled without a GPU. */
anneal_comm *anneal_comm_nccl_new(anneal_comm *host, int device);
/* The bootstrap alone: rank 0 of host makes an ncclUniqueId, every rank receives its n
 * bytes in id (n must be sizeof(ncclUniqueId), 128). Runs without a GPU. */
anneal_status anneal_comm_nccl_bootstrap_id(anneal_comm *host, void *id, size_t n);
int anneal_comm_rank(const anneal_comm *c);
int anneal_comm_size(const anneal_comm *c);
/* Rank among the processes on this host (for thread pinning / GPU choice). */
int anneal_comm_local_rank(const anneal_comm *c);
/* Number of ranks of this job on this host (1 for the single-process communicator). */
int anneal_comm_local_size(const anneal_comm *c);
/* "mpi" or "single". */
const char *anneal_comm_backend(const anneal_comm *c);
/* True when this build can talk MPI. */
bool anneal_comm_mpi_available(void);

/* Collectives. Every rank must make the same calls in the same order with the same
 * counts and dtypes. dtype: ANNEAL_F32 or ANNEAL_BF16 for reductions (bf16 sums are
 * accumulated in f32 and rounded once), any dtype for gather/broadcast. Results are
 * identical on every rank (each rank receives the same reduced bits). Errors (a peer
 * that died, a transport failure) come back as ANNEAL_ERR_IO with MPI's message. */
anneal_status anneal_comm_allreduce(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                    anneal_reduce_op op);
/* recv (count) = this rank's block of the reduction of send (count * size): rank r
 * receives elements [r*count, (r+1)*count). */
anneal_status anneal_comm_reduce_scatter(anneal_comm *c, const void *send, void *recv, int64_t count,
                                         anneal_dtype dt, anneal_reduce_op op);
/* recv (count * size) = every rank's send (count), in rank order. */
anneal_status anneal_comm_all_gather(anneal_comm *c, const void *send, void *recv, int64_t count,
                                     anneal_dtype dt);
anneal_status anneal_comm_broadcast(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int root);
anneal_status anneal_comm_barrier(anneal_comm *c);

/* Non-blocking variants: start the collective and return a request; the buffers must
 * stay untouched until anneal_comm_wait returns. */
anneal_status anneal_comm_allreduce_start(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt,
                                          anneal_reduce_op op, anneal_comm_request **req);
anneal_status anneal_comm_reduce_scatter_start(anneal_comm *c, const void *send, void *recv, int64_t count,
                                               anneal_dtype dt, anneal_reduce_op op,
                                               anneal_comm_request **req);
anneal_status anneal_comm_all_gather_start(anneal_comm *c, const void *send, void *recv, int64_t count,
                                           anneal_dtype dt, anneal_comm_request **req);
/* Waits for req to finish and frees it (NULL: nothing to wait for). */
anneal_status anneal_comm_wait(anneal_comm_request *req);
/* Sets *done when req has finished (it must still be waited for). Lets progress happen. */
anneal_status anneal_comm_test(anneal_comm_request *req, bool *done);

/* A new communicator of the ranks of c that passed the same color, ranked by key (ties
 * by their rank in c): the groups of a parallel layout (tensor-, pipeline- and
 * data-parallel). Every rank of c must call it. Free it with anneal_comm_free before c.
 * The single-process communicator splits into another world of one. NULL + error on
 * failure. */
anneal_comm *anneal_comm_split(anneal_comm *c, int color, int key);

/* Point to point (pipeline stages): send count elements of dt to rank dst of c, or
 * receive them from rank src, matched by tag (0 <= tag < 32768). The blocking calls
 * return when buf may be reused; the _start variants return a request to wait for, and
 * buf must stay untouched until then. A world of one has no peer: an error. */
anneal_status anneal_comm_send(anneal_comm *c, const void *buf, int64_t count, anneal_dtype dt, int dst, int tag);
anneal_status anneal_comm_recv(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int src, int tag);
anneal_status anneal_comm_send_start(anneal_comm *c, const void *buf, int64_t count, anneal_dtype dt, int dst,
                                     int tag, anneal_comm_request **req);
anneal_status anneal_comm_recv_start(anneal_comm *c, void *buf, int64_t count, anneal_dtype dt, int src,
                                     int tag, anneal_comm_request **req);

/* Ends the whole job now (MPI_Abort) after printing msg on this rank's stderr; used
 * when a rank fails alone so the others do not wait forever. Does not return. */
void anneal_comm_abort(anneal_comm *c, int code, const char *msg);

/* ----------------------------------------------------------- gradient sync */

/* Data-parallel gradient synchronisation of a parameter set. Gradients are grouped
 * into buckets of about bucket_bytes, filled in reverse registration order (the order
 * backward produces them); when the last gradient of a bucket is ready, its collective
 * starts at once (overlap) or, with overlap off, all collectives run in anneal_ddp_finish.
 *
 * zero_stage 0 (DDP): every rank ends with the mean gradient of every parameter in
 *   its .grad.
 * zero_stage 1 and 2: gradients are reduce-scattered: each rank ends with the mean
 *   gradient of its own shard only (anneal_ddp_shard_*); stage 2 drops each full .grad
 *   as soon as its bucket has been reduced, so a rank never holds all gradients at once.
 *   The optimizer state is sharded the same way (anneal_optimizer_new_zero). */
typedef struct anneal_ddp_config {
    int64_t bucket_bytes; /* default 25 MiB */
    bool overlap;         /* default true */
    int zero_stage;       /* 0, 1, 2, or 3 (stage 2's gradients, parameters sharded by
                             anneal_zero3: see below) */
    const int *groups;    /* NULL, or a group id per parameter: a bucket never holds two
                             groups (ZeRO-3's blocks); read by anneal_ddp_new only */
} anneal_ddp_config;

anneal_ddp_config anneal_ddp_defaults(void);

typedef struct anneal_ddp anneal_ddp;

/* Sync of ps over c (both must outlive it). Every parameter must be f32 contiguous. */
anneal_ddp *anneal_ddp_new(anneal_comm *c, anneal_params *ps, anneal_ddp_config cfg);
void anneal_ddp_free(anneal_ddp *d);
/* Overwrites every parameter with rank 0's values (start of a run). */
anneal_status anneal_ddp_broadcast_params(anneal_ddp *d);
/* Before a micro-step's backward: installs the grad-ready hook. sync false (gradient
 * accumulation, not the last micro-step): gradients only accumulate locally, nothing is
 * communicated. */
anneal_status anneal_ddp_begin_backward(anneal_ddp *d, bool sync);
/* After the last micro-step's backward: waits for (or, without overlap, runs) every
 * bucket's collective, removes the hook and leaves the synchronised gradients (stage 0:
 * in .grad; stages 1-2: in the shard). Parameters that got no gradient anywhere count
 * as zero gradients. */
anneal_status anneal_ddp_finish(anneal_ddp *d);
/* Global L2 norm of the synchronised gradients (all ranks get the same value); with
 * max_norm > 0 scales them by PyTorch's clip coefficient when it is < 1. Non-finite
 * norm: reported, nothing scaled. */
anneal_status anneal_ddp_clip_grad_norm(anneal_ddp *d, float max_norm, float *norm_out);
/* Multiplies the synchronised gradients by s (loss-scaler unscale). */
anneal_status anneal_ddp_scale_grads(anneal_ddp *d, float s);

/* This rank's shard, for stages 1-2: n elements of the flat parameter space (all
 * parameters concatenated in registration order), made of `pieces` runs. */
typedef struct anneal_ddp_piece {
    int param;       /* index in ps */
    int64_t offset;  /* first element inside that parameter */
    int64_t len;
    int64_t shard_offset; /* where the run sits in the rank's shard */
} anneal_ddp_piece;
int64_t anneal_ddp_shard_numel(const anneal_ddp *d);
const anneal_ddp_piece *anneal_ddp_shard_pieces(const anneal_ddp *d, int *n);
/* The rank's mean-gradient shard (shard_numel floats), valid after anneal_ddp_finish. */
float *anneal_ddp_shard_grad(anneal_ddp *d);
/* After each rank has written its updated shard into the parameters (by the pieces),
 * all-gathers so every rank holds every updated parameter. */
anneal_status anneal_ddp_gather_params(anneal_ddp *d);
/* Per-rank bytes held now for parameters, gradients (.grad tensors and the stage 1-2
 * shard), bucket buffers (separate from grad_bytes) and optimizer state, for reports. */
typedef struct anneal_ddp_memory {
    int64_t param_bytes, grad_bytes, bucket_bytes;
    int64_t state_bytes; /* optimizer state of the ZeRO optimizer made on d (0 without one) */
} anneal_ddp_memory;
anneal_ddp_memory anneal_ddp_memory_get(const anneal_ddp *d);
anneal_comm *anneal_ddp_comm(const anneal_ddp *d);

/* ------------------------------------------- for sharded optimizers (ZeRO) */

/* What an optimizer that keeps only this rank's shard of the state (optim's
 * anneal_optimizer_new_zero) needs from the gradient sync. */
/* The ZeRO stage d was made with. */
int anneal_ddp_stage(const anneal_ddp *d);
/* The parameter set d synchronises. */
anneal_params *anneal_ddp_params(const anneal_ddp *d);
/* The rank's mean-gradient shard as a 1-D f32 tensor of shard_numel elements (NULL
 * when the shard is empty); owned by d. */
anneal_tensor *anneal_ddp_shard_grad_tensor(anneal_ddp *d);
/* True once anneal_ddp_finish has left synchronised gradients (cleared by the next
 * synchronising anneal_ddp_begin_backward). */
bool anneal_ddp_synced(const anneal_ddp *d);
/* Collective: every rank's shard (a 1-D f32 tensor in shard layout, shard_numel long,
 * on the parameters' device; NULL when the shard is empty) is gathered into the full
 * tensors dst[i] (parameter i's shape, f32, on that device) for every parameter. */
anneal_status anneal_ddp_gather_shard(anneal_ddp *d, const anneal_tensor *shard, anneal_tensor *const *dst);
/* Optimizer-state bytes a ZeRO optimizer holds for d (reported in the memory figures). */
void anneal_ddp_set_state_bytes(anneal_ddp *d, int64_t bytes);
/* Stage 3: the parameters' values live in shard (shard layout, shard_numel floats): the
 * ZeRO optimizer updates it instead of the parameter tensors, and anneal_ddp_gather_params
 * calls gather(user). Set by anneal_zero3_new (NULL, NULL, NULL: unset). */
void anneal_ddp_set_param_shard(anneal_ddp *d, anneal_tensor *shard, anneal_status (*gather)(void *user), void *user);
/* The stage-3 parameter shard, or NULL. */
anneal_tensor *anneal_ddp_param_shard(const anneal_ddp *d);
/* Stages 1-3 under a comm hook that leaves each whole agreed bucket on every rank
 * (anneal_det_sync): the clipping norm is each parameter's sum of squares added in
 * registration order (stage 0's arithmetic, the same for any world size) instead of the
 * per-rank shard sums. */
anneal_status anneal_ddp_set_full_norm(anneal_ddp *d);
/* After a synchronised step under anneal_ddp_set_full_norm: each parameter's sum of
 * squares (registration order of d's parameters), else NULL. */
const double *anneal_ddp_full_norm_sums(const anneal_ddp *d);
/* Stages 1-2 under such a hook: anneal_ddp_finish also leaves each parameter's whole
 * agreed gradient in its .grad (full-size gradients, as the hook holds them anyway), for
 * a caller that needs whole tensors (tensor parallelism's deterministic norm gathers them
 * over its group); the optimizer still steps the shard. */
anneal_status anneal_ddp_set_keep_full_grads(anneal_ddp *d);

/* ------------------------------------------------ ZeRO-3 (zero3.c) */

/* Parameters sharded too (FSDP). Made on a stage-3 sync whose buckets follow the
 * model's blocks (groups from anneal_zero3_groups): each rank keeps the shard of every
 * parameter (the sync's shard layout, updated by the ZeRO optimizer); a block's
 * parameters exist in full only between the model's block hook calls around its forward
 * (and its recompute in backward: the run needs --recompute block), gathered by one
 * all-gather per bucket, the next block's started while this one computes (prefetch in
 * the direction the blocks run); after the block its parameter tensors have no storage
 * (what backward saved keeps the gathered memory alive until it is done). Parameters
 * outside the blocks (embeddings, final norm, lm head) stay gathered and are refreshed
 * after every step. Every call here is collective unless said otherwise. */
typedef struct anneal_zero3 anneal_zero3;
/* The group of every parameter of m (malloc'd, m->params->n entries): its block's
 * index (the first all-digit part of its name, "transformer.h.3.ln_1.weight" -> 3), or
 * -1 for the parameters outside the blocks. NULL + error when out of memory. */
int *anneal_zero3_groups(const anneal_model *m);
/* Takes over m's parameters: their current (full, identical on every rank) values go
 * into the shard, the blocks' parameters lose their storage, and m's block hook is set.
 * d: a stage-3 sync over m->params made with anneal_zero3_groups(m). */
anneal_zero3 *anneal_zero3_new(anneal_ddp *d, anneal_model *m);
/* Removes the hook and frees the gathered memory and the shard; the blocks' parameters
 * stay without storage unless anneal_zero3_gather_all ran. Not collective. */
void anneal_zero3_free(anneal_zero3 *z);
/* Every parameter in full (checkpoints, samples), until anneal_zero3_release_all. */
anneal_status anneal_zero3_gather_all(anneal_zero3 *z);
anneal_status anneal_zero3_release_all(anneal_zero3 *z);
/* Bytes of parameters: now (shard + what is gathered, as held by zero3) and the most
 * the device's parameter category held at any of zero3's allocations (the peak: only
 * zero3 allocates parameters once it runs). Not collective. */
typedef struct anneal_zero3_memory {
    int64_t shard_bytes, resident_bytes, gathered_bytes, peak_param_bytes;
    int64_t block_bytes_max; /* the largest block, gathered (for the memory formula) */
} anneal_zero3_memory;
anneal_zero3_memory anneal_zero3_memory_get(const anneal_zero3 *z);

/* ------------------------------------------------ communication hooks */

/* A bucket of the sync: parameters first_param..last_param (registration indices), the
 * flat range [start, start + numel) of all parameters concatenated. */
typedef struct anneal_ddp_bucket_info {
    int first_param, last_param;
    int64_t start, numel;
} anneal_ddp_bucket_info;
int anneal_ddp_bucket_count(const anneal_ddp *d);
/* Bucket k (0 <= k < count; buckets are numbered in the order they are sent). */
anneal_ddp_bucket_info anneal_ddp_bucket(const anneal_ddp *d, int k);

/* A communication hook replaces a bucket's collective: buf holds this rank's gradients
 * of bucket k (numel f32, parameters in registration order, missing ones as zeros); on
 * return it must hold what every rank agrees to use as the synchronised gradient (the
 * mean, or its approximation). The hook is called in anneal_ddp_finish for every bucket
 * in bucket order on every rank (it may call collectives on anneal_ddp_comm(d)). With
 * ZeRO 1/2, each rank then keeps its chunk of buf as its shard. */
typedef anneal_status (*anneal_ddp_comm_hook)(void *user, anneal_ddp *d, int k, float *buf);
/* Installs fn (NULL: plain all-reduce / reduce-scatter again). Not between
 * anneal_ddp_begin_backward and anneal_ddp_finish. */
anneal_status anneal_ddp_set_comm_hook(anneal_ddp *d, anneal_ddp_comm_hook fn, void *user);

/* ----------------------------------------------- PowerSGD (powersgd.c) */

/* Gradient compression of Vogels et al. 2019 as PyTorch's powerSGD_hook computes it
 * (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, warm start and error
 * feedback on, orthogonalization by Gram-Schmidt with epsilon 0, tensors not batched by
 * shape), as a comm hook on the buckets of a sync. Per bucket: buf += error; vectors
 * and matrices not worth compressing ((n + m) * r * min_compression_rate >= n * m, with
 * the gradient viewed as shape[0] x rest and r = min(n, m, rank)) are all-reduced
 * as they are; each other matrix M gives P = M Q, all-reduce(P), P orthogonalized,
 * Q = M^T P, all-reduce(Q) / world, M' = P Q^T; error = (buf before) - buf after.
 * Q is kept (warm start, orthogonalized again before use); the first Q of a bucket is
 * drawn from a normal distribution seeded by (seed, bucket), the same on every rank.
 * The first warmup_steps synchronisations are plain mean all-reduces. */
typedef struct anneal_powersgd_config {
    int rank;                    /* matrix approximation rank, >= 1 */
    int64_t warmup_steps;        /* uncompressed synchronisations first */
    uint64_t seed;               /* of the initial Q */
    double min_compression_rate; /* PyTorch's default 2 */
} anneal_powersgd_config;
anneal_powersgd_config anneal_powersgd_defaults(void);

typedef struct anneal_powersgd anneal_powersgd;
/* Compression state for the buckets of d, installed as d's comm hook. d must outlive it. */
anneal_powersgd *anneal_powersgd_new(anneal_ddp *d, anneal_powersgd_config cfg);
/* Removes the hook and frees the state. */
void anneal_powersgd_free(anneal_powersgd *p);

/* Forgets every bucket's error feedback and Q (the next compressed step starts from a
 * zero error and a fresh seeded Q), e.g. after a step whose gradients were not finite
 * had put Inf/NaN into them. Every rank must call it at the same step. */
void anneal_powersgd_reset(anneal_powersgd *p);
/* Payload bytes this rank handed to all-reduce (not counting the collective's own
 * algorithm factor) and what plain all-reduce of every bucket would have handed. */
typedef struct anneal_powersgd_stats {
    int64_t steps;                   /* synchronisations so far (warm-up included) */
    int64_t last_bytes, last_bytes_uncompressed;   /* the last synchronisation */
    int64_t total_bytes, total_bytes_uncompressed; /* since the start (resumes included) */
} anneal_powersgd_stats;
anneal_powersgd_stats anneal_powersgd_stats_get(const anneal_powersgd *p);

/* Bytes of host memory the compression state holds now (error feedback, P, Q and the
 * per-bucket scratch), for the memory report. */
int64_t anneal_powersgd_memory_bytes(const anneal_powersgd *p);
/* Elements of bucket k's Q (0 when nothing in it is compressed). */
int64_t anneal_powersgd_q_numel(const anneal_powersgd *p, int k);
/* Sets bucket k's Q (q_numel floats, PyTorch's q_memory layout: matrices grouped by
 * shape in order of first appearance, each m x r row-major) as if left by a previous
 * step (it is orthogonalized before use). For parity tests. */
anneal_status anneal_powersgd_set_q(anneal_powersgd *p, int k, const float *q, int64_t n);
/* Bucket k's Q and error (NULL before its first compressed step). Borrowed. */
const float *anneal_powersgd_q(const anneal_powersgd *p, int k);
const float *anneal_powersgd_error(const anneal_powersgd *p, int k);

/* This rank's state (step count, per bucket error and Q, byte counters) to path
 * (atomic write), and back. Load checks that the file was written by the same rank of
 * the same world size for the same buckets and rank (errors name the file and what
 * differs); the format is described in powersgd.c. */
anneal_status anneal_powersgd_save(const anneal_powersgd *p, const char *path);
anneal_status anneal_powersgd_load(anneal_powersgd *p, const char *path);

/* ------------------------------- deterministic reduction (det_reduce.c) */

/* Sums in one fixed binary tree (pairwise summation by a stack: a node is left + right,
 * the left subtree the earlier leaves; what is left at the end is folded from the top).
 * With M = W * 2^k leaves, the trees of the W blocks of 2^k leaves combined by the tree
 * over the W block sums (anneal_det_combine_blocks, anneal_det_allreduce) perform the
 * same additions in the same order as the tree over all M: the same bits for every W. */
typedef struct anneal_det_tree anneal_det_tree;
/* A tree over leaves of n floats (NULL + error on failure). */
anneal_det_tree *anneal_det_tree_new(int64_t n);
void anneal_det_tree_free(anneal_det_tree *t);
/* Adds the next leaf (copied or summed in; x is not kept). */
anneal_status anneal_det_tree_push(anneal_det_tree *t, const float *x);
/* The tree sum of the leaves pushed since the last finish into out (zeros when none);
 * the tree is empty again (its buffers are kept for the next sum). */
anneal_status anneal_det_tree_finish(anneal_det_tree *t, float *out);
int64_t anneal_det_tree_leaves(const anneal_det_tree *t);
/* Bytes of the partial sums it holds (at most log2(leaves) + 1 leaves' worth, kept). */
int64_t anneal_det_tree_memory_bytes(const anneal_det_tree *t);
/* blocks holds w leaves of n floats one after another: their tree sum into block 0. */
void anneal_det_combine_blocks(float *blocks, int w, int64_t n);
/* The tree sum of n doubles. */
double anneal_det_sum_f64(const double *x, int64_t n);
/* Collective: buf (n floats on every rank) becomes the tree over the ranks' buffers in
 * rank order, the same bits on every rank (a world of 2^k: a butterfly of point-to-point
 * exchanges, tag 31007; otherwise an all-gather and the tree on every rank). */
anneal_status anneal_det_allreduce(anneal_comm *c, float *buf, int64_t n);
/* The same for one double. */
anneal_status anneal_det_allreduce_f64(anneal_comm *c, double *x);
/* The comm hook of a sync d that combines each bucket with anneal_det_allreduce (the
 * tree sum, not the mean: scale before). ZeRO stages 1-3: every rank gets the whole
 * combined bucket and keeps its chunk, and the norm is summed per parameter
 * (anneal_ddp_set_full_norm). Free it before d. */
typedef struct anneal_det_sync anneal_det_sync;
anneal_det_sync *anneal_det_sync_new(anneal_ddp *d);
void anneal_det_sync_free(anneal_det_sync *s);
/* Bytes of its scratch (the largest bucket; x world when the world is not 2^k). */
int64_t anneal_det_sync_memory_bytes(const anneal_det_sync *s);

/* ------------------------------------------------ tensor parallelism (tp.c) */
/* Megatron-LM's f and g over the group c (every rank of c calls them in the same order):
 * f = identity forward, gradient summed over c backward (before a column-parallel
 * projection); g = summed over c forward, identity backward (after a row-parallel one).
 * f32 CPU tensors. */
anneal_tensor *anneal_tp_copy_in(anneal_comm *c, anneal_tensor *x);
anneal_tensor *anneal_tp_reduce_out(anneal_comm *c, anneal_tensor *x);
/* The vocabulary split over c: this rank holds rows [lo, lo + weight rows) of the token
 * embedding. The lookup of i32 CPU ids summed over c (ids outside give zeros); and the
 * mean cross-entropy of this rank's columns (..., V/N) of the logits against targets
 * (...) over the whole vocabulary (targets == ignore_index skipped; all skipped: 0),
 * whose backward is local. Collective over c. */
anneal_tensor *anneal_tp_vocab_embedding(anneal_comm *c, anneal_tensor *weight, anneal_tensor *ids, int64_t lo);
anneal_tensor *anneal_tp_vocab_cross_entropy(anneal_comm *c, anneal_tensor *logits, anneal_tensor *targets, int64_t lo,
                                             int32_t ignore_index);
/* The whole (..., V) logits from this rank's columns (..., V/N) of f32 CPU logits and
 * the other ranks', rank r's at columns [r V/N, (r + 1) V/N): an all-gather over c, the
 * same bits on every rank. A new tensor outside autograd (samples, evaluation of
 * logits); every rank of c calls it with the same shape. */
anneal_tensor *anneal_tp_vocab_gather(anneal_comm *c, anneal_tensor *logits);
/* --deterministic (tp_det.c): a column-parallel projection x W + b whose outputs (in
 * `parts` segments, [q | k | v]: 3) this rank holds `chunks` of the group's canonical
 * chunks of, and a row-parallel one x W over this rank's `chunks` input chunks, every
 * GEMM per chunk; what a GEMM sums across chunks (the row-parallel forward, the
 * column-parallel input gradient) is all-gathered per chunk and added in one fixed
 * tree: the same bits on every layout of the G chunks. c NULL: one process (all G).
 * Collective over c. f32 CPU tensors. */
anneal_tensor *anneal_tp_det_col(anneal_comm *c, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                                 anneal_weight_layout layout, int parts, int chunks, anneal_dtype compute);
anneal_tensor *anneal_tp_det_row(anneal_comm *c, anneal_tensor *x, anneal_tensor *w, anneal_weight_layout layout,
                                 int chunks, anneal_dtype compute);
/* The table of a single-process --deterministic run: rank 0 of 1, det_col/det_row only. */
const anneal_nn_tp *anneal_tp_nn_single(void);
/* The group a tensor-parallel model runs with: ctx.tp = anneal_tp_nn(tp). group is not
 * owned (free it after the tp). */
typedef struct anneal_tp anneal_tp;
anneal_tp *anneal_tp_new(anneal_comm *group);
void anneal_tp_free(anneal_tp *tp);
const anneal_nn_tp *anneal_tp_nn(const anneal_tp *tp);
anneal_comm *anneal_tp_comm(const anneal_tp *tp);
/* How a parameter is split: along dim (-1: replicated) in `parts` segments, each split
 * evenly over the ranks (GPT-2's packed c_attn [q | k | v]: 3). */
typedef struct anneal_tp_split {
    int dim, parts;
} anneal_tp_split;
/* The split of parameter `name` from its whole and shard shapes (size ranks); a shape
 * that is no 1/size shard along one dimension is ANNEAL_ERR_SHAPE. */
anneal_status anneal_tp_split_of(const char *name, const anneal_tensor *whole, const anneal_tensor *shard, int size,
                                 anneal_tp_split *out);
/* Copies rank's part of whole into shard (f32 contiguous CPU tensors). */
anneal_status anneal_tp_slice(const anneal_tensor *whole, anneal_tensor *shard, anneal_tp_split sp, int rank);
/* Copies shard, rank's part, into its place in whole (f32 contiguous CPU tensors): the
 * inverse of anneal_tp_slice. A replicated parameter (sp.dim < 0) is copied whole. */
anneal_status anneal_tp_place(const anneal_tensor *shard, anneal_tensor *whole, anneal_tp_split sp, int rank);
/* Collective over c: every rank's shard into whole (each rank gets all of it). */
anneal_status anneal_tp_gather(anneal_comm *c, const anneal_tensor *shard, anneal_tensor *whole, anneal_tp_split sp);

#ifdef __cplusplus
}
#endif
#endif
