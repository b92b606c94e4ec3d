/* anneal core: status and errors, dtypes, devices, tensors with refcounted
 * storage, scopes that own tensors, allocator statistics, the Philox RNG and
 * threading. Everything else in anneal is built on this header. */
#ifndef ANNEAL_CORE_H
#define ANNEAL_CORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status */

typedef enum anneal_status {
    ANNEAL_OK = 0,
    ANNEAL_ERR_ARG,         /* bad argument (NULL, out of range, bad flag) */
    ANNEAL_ERR_SHAPE,       /* shapes do not fit the operation */
    ANNEAL_ERR_DTYPE,       /* dtype not supported or mismatched */
    ANNEAL_ERR_DEVICE,      /* tensors on different devices, or no backend */
    ANNEAL_ERR_OOM,         /* an allocation failed or exceeded the limit */
    ANNEAL_ERR_IO,          /* a file could not be opened, read or written */
    ANNEAL_ERR_FORMAT,      /* a file's contents are malformed */
    ANNEAL_ERR_STATE,       /* call made in the wrong state (e.g. backward twice) */
    ANNEAL_ERR_UNSUPPORTED, /* a valid request this build cannot do */
    ANNEAL_ERR_NUMERIC,     /* NaN/Inf where a finite value is required */
    ANNEAL_ERR_INTERRUPTED, /* a stop was requested (SIGINT/SIGTERM) while the work ran */
} anneal_status;

/* Records an error for this thread and returns `code`. The first error since the
 * last anneal_clear_error() is kept (later ones are the NULL cascade of the first),
 * so a failing chain of ops reports its cause. */
anneal_status anneal_set_error(anneal_status code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The first recorded error code of this thread, ANNEAL_OK if none. */
anneal_status anneal_last_status(void);
/* Message of the first recorded error ("" if none). Valid until the next clear. */
const char *anneal_last_error(void);
/* Forgets the recorded error of this thread. */
void anneal_clear_error(void);
/* Short name of a status code ("ANNEAL_ERR_SHAPE"). */
const char *anneal_status_name(anneal_status s);

/* ---------------------------------------------------------------- stop requests */

/* A process-wide stop request (src/core/interrupt.c): a SIGINT/SIGTERM handler records
 * it, and long loops (building and initialising a model, loading weights or a
 * checkpoint, opening shards, evaluation, generation, the trainer's micro-batches)
 * check it and end with ANNEAL_ERR_INTERRUPTED, so a stop takes effect within moments
 * wherever the work is. */
/* Records a stop request: signo > 0 names the signal, anything else means "a stop
 * without a signal" (-1). Async-signal-safe. */
void anneal_interrupt_request(int signo);
/* The pending request: its signal, -1 without one, 0 when none is pending. */
int anneal_interrupt_pending(void);
/* Forgets the pending request. */
void anneal_interrupt_reset(void);
/* ANNEAL_OK when no stop is pending (or checks are held); else records and returns
 * ANNEAL_ERR_INTERRUPTED with "interrupted by SIGTERM while <what>". */
anneal_status anneal_interrupt_check(const char *what);
/* While held (calls nest), anneal_interrupt_check answers ANNEAL_OK and a request stays
 * pending: for work that every rank of a job must finish together (its collectives),
 * where the caller itself decides when to stop. Not for signal handlers. */
void anneal_interrupt_hold(bool on);

/* ---------------------------------------------------------------- dtypes */

typedef enum anneal_dtype {
    ANNEAL_F32 = 0,
    ANNEAL_BF16,
    ANNEAL_F16,
    ANNEAL_I32,
    ANNEAL_I64,
    ANNEAL_U16,
    ANNEAL_U8,
    ANNEAL_I8,
    ANNEAL_F64,             /* device-side accumulators (norm pieces); not a tensor math dtype */
    ANNEAL_DTYPE_COUNT
} anneal_dtype;

/* Bytes per element of `dt` (0 for an invalid dtype). */
size_t anneal_dtype_size(anneal_dtype dt);
/* Lower-case name: "f32", "bf16", ... ("?" for an invalid dtype). */
const char *anneal_dtype_name(anneal_dtype dt);
/* True for f32, bf16, f16. */
bool anneal_dtype_is_float(anneal_dtype dt);
/* The one parser of dtype names: "f32" / "fp32" / "float32" / "float", "bf16" /
 * "bfloat16", "f16" / "fp16" / "float16" / "half", "f64" / "fp64" / "float64" / "double",
 * "i32" / "int32", "i64" / "int64", "u16" / "uint16", "u8" / "uint8", "i8" / "int8".
 * False (nothing written) for anything else. */
bool anneal_dtype_parse(const char *name, anneal_dtype *out);
/* The name of a float dtype as a precision setting spells it ("fp32", "bf16", "fp16",
 * "fp64"); anneal_dtype_name for the others. */
const char *anneal_precision_name(anneal_dtype dt);

/* bf16 <-> f32. f32 -> bf16 rounds to nearest even; NaN stays NaN. */
float anneal_bf16_to_f32(uint16_t h);
uint16_t anneal_f32_to_bf16(float f);
/* IEEE half <-> f32, round to nearest even, with subnormals, inf and NaN. */
float anneal_f16_to_f32(uint16_t h);
uint16_t anneal_f32_to_f16(float f);

/* --------------------------------------------------------------- devices */

/* Where a tensor's memory lives. CPU and CUDA are the library's own; ids from
 * ANNEAL_DEVICE_EXT on are for backends registered from outside the library. */
typedef enum anneal_device {
    ANNEAL_CPU = 0,
    ANNEAL_CUDA = 1,
    ANNEAL_DEVICE_EXT = 2,
    ANNEAL_DEVICE_COUNT = 8
} anneal_device;

/* "cpu", "cuda", or the registered backend's name ("device<N>" when none). */
const char *anneal_device_name(anneal_device d);

/* ------------------------------------------------------------- allocator */

/* Tensor storage comes from a caching allocator: a block freed by its last tensor
 * goes to a free list of its size class (64-byte steps to 4 KiB, then 8 classes per
 * doubling, at most 12.5% over the request) and the next request of that class
 * reuses it, so a training step with the same shapes every step makes no system
 * allocation after the first. Tensor headers, tape nodes and other per-step
 * bookkeeping come from a small-object pool the same way. */
typedef struct anneal_memory_stats {
    int64_t live_bytes;          /* bytes tensors currently hold (as requested) */
    int64_t peak_bytes;          /* highest live_bytes since start or last reset */
    int64_t n_allocs;            /* storage allocations since start (cache hits included) */
    int64_t limit_bytes;         /* allocations beyond this fail with ANNEAL_ERR_OOM (0 = none) */
    int64_t reserved_bytes;      /* blocks held from the system: live blocks + cached_bytes */
    int64_t peak_reserved_bytes; /* highest reserved_bytes since start or last reset */
    int64_t cached_bytes;        /* free blocks kept for reuse */
    int64_t n_system_allocs;     /* blocks taken from the system (cache misses; for the CPU
                                    also the small-object pool's mallocs) */
} anneal_memory_stats;

anneal_memory_stats anneal_memory_stats_get(anneal_device d);
/* Sets peak_bytes to the current live_bytes and peak_reserved_bytes to reserved_bytes. */
void anneal_memory_reset_peak(anneal_device d);
/* Caps live bytes on a device (0 removes the cap); used to test out-of-memory paths.
 * The cache is emptied before a new block would take reserved bytes past the cap. */
void anneal_memory_set_limit(anneal_device d, int64_t bytes);
/* Gives the cached free blocks of device d back to the system (for the CPU also the
 * small-object pool's free objects); returns the bytes released. Live tensors are
 * untouched. */
int64_t anneal_memory_release_cache(anneal_device d);

/* What a tensor's bytes are for: each new storage is charged to the category this
 * thread has set (activations unless set), so the breakdown sums to the live bytes. */
typedef enum anneal_mem_category {
    ANNEAL_MEM_ACTIVATIONS, /* the default: activations, batches, temporaries */
    ANNEAL_MEM_PARAMETERS,
    ANNEAL_MEM_GRADIENTS,
    ANNEAL_MEM_OPTIMIZER,   /* optimizer state (moments) */
    ANNEAL_MEM_WORKSPACE,   /* kernel scratch */
    ANNEAL_MEM_CATEGORY_COUNT
} anneal_mem_category;

/* Sets this thread's category for new storages; returns the previous one (restore it). */
anneal_mem_category anneal_memory_category_set(anneal_mem_category c);
/* "parameters", "gradients", "optimizer state", "activations", "workspace". */
const char *anneal_memory_category_name(anneal_mem_category c);
/* Live bytes of device d per category (they sum to anneal_memory_stats.live_bytes). */
typedef struct anneal_memory_categories {
    int64_t live[ANNEAL_MEM_CATEGORY_COUNT];
    int64_t at_peak[ANNEAL_MEM_CATEGORY_COUNT]; /* the split when live bytes last peaked */
    int64_t peak[ANNEAL_MEM_CATEGORY_COUNT];    /* each category's own highest live bytes (same reset) */
} anneal_memory_categories;
anneal_memory_categories anneal_memory_categories_get(anneal_device d);

/* --------------------------------------------------------------- tensors */

#define ANNEAL_MAX_DIMS 8

/* Refcounted buffer that tensors view. Owned by the allocator of its device. */
typedef struct anneal_storage {
    void *data;
    size_t nbytes;
    anneal_device device;
    int refcount;
    /* allocator bookkeeping, not for users */
    size_t _block;                      /* bytes of the block behind data (its size class) */
    int _class;
    int _category;                      /* anneal_mem_category charged with its bytes */
    struct anneal_storage *_next_free;  /* link while cached */
} anneal_storage;

struct anneal_node;

/* A strided view of a storage. Fields are public for kernels and ops; user code
 * should treat them as read-only and use the functions below. */
typedef struct anneal_tensor {
    anneal_storage *storage;
    int64_t offset; /* in elements from storage->data */
    int64_t shape[ANNEAL_MAX_DIMS];
    int64_t strides[ANNEAL_MAX_DIMS]; /* in elements */
    int ndim;
    anneal_dtype dtype;
    anneal_device device;
    int refcount;
    bool requires_grad;
    struct anneal_tensor *grad;   /* accumulated gradient of a leaf, owned by this tensor */
    struct anneal_node *grad_fn;  /* node that produced this tensor (NULL for leaves) */
    int grad_fn_output;           /* which output of grad_fn this is */
    char *name;                   /* optional, owned */
    /* bookkeeping, not for users */
    struct anneal_scope *_scope;  /* scope holding one reference, or NULL */
    int64_t _scope_slot;
    int32_t _pending;             /* autograd: contributions still expected */
} anneal_tensor;

/* Number of elements (1 for a 0-dim scalar). */
int64_t anneal_numel(const anneal_tensor *t);
/* Size of dimension `dim` (negative counts from the end); -1 if out of range. */
int64_t anneal_size(const anneal_tensor *t, int dim);
/* True when the elements are laid out row-major without gaps. */
bool anneal_is_contiguous(const anneal_tensor *t);
/* Pointer to the first element (storage data + offset). */
void *anneal_data(const anneal_tensor *t);
/* Writes "(2, 3, 4)" into buf; returns buf. anneal_dims_str does it for a shape given
 * as (ndim, shape). */
const char *anneal_dims_str(int ndim, const int64_t *shape, char *buf, size_t n);
const char *anneal_shape_str(const anneal_tensor *t, char *buf, size_t n);
/* True when two tensors have identical shapes. */
bool anneal_same_shape(const anneal_tensor *a, const anneal_tensor *b);

/* New uninitialised contiguous tensor on the default device, owned by the current
 * scope (or by the caller when none is open). NULL + ANNEAL_ERR_OOM / ARG on failure. */
anneal_tensor *anneal_empty(anneal_dtype dt, int ndim, const int64_t *shape);
anneal_tensor *anneal_empty_on(anneal_device dev, anneal_dtype dt, int ndim, const int64_t *shape);
/* New tensor with the shape, dtype and device of `like`. */
anneal_tensor *anneal_empty_like(const anneal_tensor *like);
/* Zero-filled tensor (the device backend's fill). */
anneal_tensor *anneal_zeros(anneal_dtype dt, int ndim, const int64_t *shape);
anneal_tensor *anneal_zeros_like(const anneal_tensor *like);
/* Tensor holding a copy of `data` (ndim/shape, contiguous, of dtype dt) on the CPU. */
anneal_tensor *anneal_from_data(anneal_dtype dt, int ndim, const int64_t *shape, const void *data);
/* The same on device dev: the host data is handed to the device's backend (a queued
 * copy, finished by the next synchronize; data may be reused once this returns only
 * on the CPU, so callers on other devices keep it until they synchronize). */
anneal_tensor *anneal_from_data_on(anneal_device dev, anneal_dtype dt, int ndim, const int64_t *shape,
                                   const void *data);
/* 0-dim f32 scalar. */
anneal_tensor *anneal_scalar(float v);

/* A new tensor struct sharing t's storage with a different shape/strides/offset,
 * without autograd history. The raw building block of views. */
anneal_tensor *anneal_alias(const anneal_tensor *t, int ndim, const int64_t *shape,
                            const int64_t *strides, int64_t offset);
/* Same storage, same layout, no grad_fn and requires_grad false (like torch .detach()). */
anneal_tensor *anneal_detach(const anneal_tensor *t);

/* Copies `src` into `dst` elementwise (any strides, converting dtype). Shapes must match.
 * Goes through the backend of the device; between two devices the elements travel
 * through host memory (both backends' copies, each device synchronised). No autograd. */
anneal_status anneal_copy_(anneal_tensor *dst, const anneal_tensor *src);
/* Copies the elements of t as f32 into out[numel] (row-major order), converting. */
anneal_status anneal_to_f32_buffer(const anneal_tensor *t, float *out);
/* Reads one element as double (row-major linear index); for tests and scalars. */
double anneal_item_at(const anneal_tensor *t, int64_t linear_index);
/* anneal_item_at(t, 0). */
double anneal_item(const anneal_tensor *t);

/* Points t at src's storage (retained) from element `offset` of it on, keeping t's
 * shape, strides and dtype, and drops t's reference to its own storage; src NULL leaves
 * t without storage (its data must not be touched until it gets one again). For
 * parameters whose memory comes and goes (ZeRO-3). src must have t's dtype and device
 * and t's extent must fit inside src's storage. */
anneal_status anneal_tensor_set_storage(anneal_tensor *t, const anneal_tensor *src, int64_t offset);

/* Refcounting. A new tensor has one reference, held by its scope (or the caller). */
anneal_tensor *anneal_retain(anneal_tensor *t);
void anneal_release(anneal_tensor *t);
/* Marks t as a trainable leaf (or not). Fails on a non-float tensor. */
anneal_status anneal_set_requires_grad(anneal_tensor *t, bool on);
/* Sets a copy of name on t; returns t. */
anneal_tensor *anneal_set_name(anneal_tensor *t, const char *name);

/* ---------------------------------------------- bookkeeping for the layers above */

/* The small-object pool: zero-filled objects of up to 1 MiB from size-class
 * free lists, for the bookkeeping a training step makes every step (tensor headers,
 * storage records, scopes, tape nodes and their arrays, op contexts). Free with
 * anneal_pool_free only (it can stand in for free() as a ctx_free). NULL when out of
 * memory (no error recorded: callers name what they were allocating). */
void *anneal_pool_alloc(size_t n);
void *anneal_pool_calloc(size_t count, size_t size);
void anneal_pool_free(void *p);
/* Objects the pool has taken from malloc since start. */
int64_t anneal_pool_system_allocs(void);
/* Frees the pool's cached objects; returns the bytes given back. */
int64_t anneal_pool_release(void);

/* What releasing a tensor does with its grad_fn: the autograd layer installs
 * anneal_node_release here when it records its first node (core knows no nodes). */
void anneal_set_node_release_hook(void (*fn)(struct anneal_node *n));

/* Storage eviction (activation offload, src/autograd/saved_offload.c): an activation
 * storage's bytes move to memory the caller owns (a file mapping) and its block goes
 * back to the allocator's cache, so live bytes drop while every tensor viewing the
 * storage keeps working (reads and writes go to the new memory). */
/* True for a CPU storage of the activations category that holds an allocator block. */
bool anneal_storage_evictable(const anneal_storage *s);
/* True once anneal_storage_evict moved s's bytes out (until anneal_storage_restore). */
bool anneal_storage_evicted(const anneal_storage *s);
/* ext (s->nbytes, already holding s's bytes, kept valid by the caller while s is
 * evicted) becomes s->data; the block returns to the cache. ANNEAL_ERR_ARG when s
 * is not evictable. */
anneal_status anneal_storage_evict(anneal_storage *s, void *ext);
/* Gives an evicted storage a block again, its bytes copied from the evicted memory
 * (no-op for a storage that is not evicted); ANNEAL_ERR_OOM when no block is had. */
anneal_status anneal_storage_restore(anneal_storage *s);

/* ---------------------------------------------------------------- scopes */

/* A scope owns the tensors created while it is the current one. Closing a scope
 * releases them all: model code never frees a tensor. Scopes form a per-thread
 * stack; a scope may be entered again later (parameters live in one long-lived scope). */
typedef struct anneal_scope anneal_scope;

/* Creates a scope and makes it current. */
anneal_scope *anneal_scope_open(void);
/* Leaves (must be current) and frees scope s, releasing every tensor it holds. */
void anneal_scope_close(anneal_scope *s);
/* Creates a detached scope (not current). */
anneal_scope *anneal_scope_new(void);
/* Pushes s (NULL: tensors created are owned by the caller) as the current scope. */
void anneal_scope_enter(anneal_scope *s);
/* Pops the current scope (without freeing it). */
void anneal_scope_leave(void);
/* Releases the tensors of a scope that is not on the stack and frees it. */
void anneal_scope_free(anneal_scope *s);
/* The current scope (NULL when none or caller-owned mode). */
anneal_scope *anneal_scope_current(void);
/* Moves one reference of t into scope dst (e.g. to keep a result after closing the
 * step scope); t is removed from the scope that held it. Returns t. */
anneal_tensor *anneal_keep(anneal_tensor *t, anneal_scope *dst);
/* Gives the tensor to the current scope (used for tensors made in caller-owned mode). */
anneal_tensor *anneal_scope_adopt(anneal_tensor *t);
/* Number of tensors a scope holds (for tests and leak checks). */
int64_t anneal_scope_count(const anneal_scope *s);

/* ------------------------------------------------------------------- RNG */

/* Philox4x32-10: 4 random 32-bit words for (key, counter). Counter-based: the
 * value at any position is independent of how work is split across threads. */
void anneal_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo, uint32_t out[4]);
/* uint32 -> float uniform in [0, 1). */
float anneal_uniform_from_u32(uint32_t x);

/* The global generator: a seed and an offset that every random op advances by the
 * number of values it used. Saving (seed, offset) and restoring it replays the same
 * random stream (used by checkpoints and recompute regions). */
typedef struct anneal_rng_state {
    uint64_t seed;
    uint64_t offset;
} anneal_rng_state;

void anneal_manual_seed(uint64_t seed);
anneal_rng_state anneal_rng_get(void);
void anneal_rng_set(anneal_rng_state s);
/* Reserves n consecutive counter values and returns the first one. */
uint64_t anneal_rng_reserve(uint64_t n);

/* --------------------------------------------------------------- threads */

/* Sets the number of threads CPU kernels use (<= 0: the OpenMP default). */
void anneal_set_num_threads(int n);
int anneal_get_num_threads(void);
/* Pins OpenMP worker k to the k-th CPU of the process's allowed CPU set (round-robin
 * when there are more workers than CPUs), or with on = false gives every worker the
 * whole allowed set back. Call after anneal_set_num_threads. When desc is given it
 * gets the CPUs in worker order ("0,1") or "off". ANNEAL_ERR_UNSUPPORTED when the
 * system refuses. */
anneal_status anneal_set_thread_pinning(bool on, char *desc, size_t desc_len);

/* Library version string, e.g. "0.1.0". */
const char *anneal_version(void);

#ifdef __cplusplus
}
#endif
#endif
