/* The caching allocator for tensor storage. A block freed by the last tensor that
 * used it goes to a free list of its size class instead of back to the system, and
 * the next request of that class takes it: a training step that makes the same
 * shapes every step stops allocating after the first one. Statistics: live bytes
 * (what tensors asked for), reserved bytes (blocks held: live ones + the cache),
 * their peaks, and how many blocks came from the system. An optional cap on live
 * bytes exercises out-of-memory paths; the cache is emptied before it would push
 * the reserved bytes past the cap, and whenever the system refuses a block. */
#include "anneal/backend.h"
#include "core_internal.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* Size classes: multiples of 64 bytes up to 4 KiB (64 classes), then 8 steps per
 * doubling (a block is at most 12.5% larger than the request) up to 2^48 bytes. */
#define SMALL_LIMIT 4096
#define N_CLASSES (64 + 36 * 8)

typedef struct {
    pthread_mutex_t lock;
    anneal_storage *free_list[N_CLASSES]; /* cached blocks, linked through _next_free */
    int64_t live, peak, reserved, peak_reserved, cached;
    int64_t n_allocs, n_system, limit;
    int64_t live_cat[ANNEAL_MEM_CATEGORY_COUNT]; /* live split by anneal_mem_category */
    int64_t peak_cat[ANNEAL_MEM_CATEGORY_COUNT]; /* that split when live last reached peak */
    int64_t max_cat[ANNEAL_MEM_CATEGORY_COUNT];  /* each category's own highest live bytes */
} device_pool;

static _Thread_local int t_category; /* ANNEAL_MEM_ACTIVATIONS */

#define POOL {.lock = PTHREAD_MUTEX_INITIALIZER}
_Static_assert(ANNEAL_DEVICE_COUNT == 8, "one pool initializer per device id");
static device_pool g_pool[ANNEAL_DEVICE_COUNT] = {POOL, POOL, POOL, POOL, POOL, POOL, POOL, POOL};
#undef POOL

/* Class index of a request and the block size that class hands out. */
static int size_class(size_t n, size_t *block) {
    if (n <= SMALL_LIMIT) {
        size_t k = n ? (n + 63) / 64 : 1; /* 1..64 */
        *block = k * 64;
        return (int)k - 1;
    }
    int p = 63 - __builtin_clzll((unsigned long long)(n - 1)); /* 2^p < n <= 2^(p+1), p >= 12 */
    size_t step = (size_t)1 << (p - 2);                         /* (2^(p+1) - 2^p) / 4 ... */
    step >>= 1;                                                 /* ... / 8: 8 steps per doubling */
    size_t k = (n - ((size_t)1 << p) + step - 1) / step;        /* 1..8 */
    *block = ((size_t)1 << p) + k * step;
    int idx = 64 + (p - 12) * 8 + (int)k - 1;
    return idx < N_CLASSES ? idx : -1;
}

/* Host memory (the CPU's) is poisoned for AddressSanitizer while cached; other
 * devices' addresses are not the host's to poison. */
#define HOST_POISON(d, p, n) do { if ((d) == ANNEAL_CPU) POISON(p, n); } while (0)
#define HOST_UNPOISON(d, p, n) do { if ((d) == ANNEAL_CPU) UNPOISON(p, n); } while (0)

/* Frees every cached block of pool `dp` (lock held); returns the bytes given back. */
static int64_t drain_locked(device_pool *dp, const anneal_backend *be) {
    int64_t freed = 0;
    for (int c = 0; c < N_CLASSES; c++) {
        while (dp->free_list[c]) {
            anneal_storage *st = dp->free_list[c];
            dp->free_list[c] = st->_next_free;
            HOST_UNPOISON(st->device, st->data, st->_block);
            if (be) be->free(be->ctx, st->data);
            freed += (int64_t)st->_block;
            free(st);
        }
    }
    dp->reserved -= freed;
    dp->cached -= freed;
    return freed;
}

/* Records ANNEAL_ERR_OOM with the message fmt followed by the live bytes of device d
 * by category, the cache, and the flags that lower the peak, so every out-of-memory
 * error says where memory went (called without the pool's lock). */
static void oom_error(anneal_device d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void oom_error(anneal_device d, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    anneal_memory_categories m = anneal_memory_categories_get(d);
    anneal_memory_stats ms = anneal_memory_stats_get(d);
    if (k > 0 && (size_t)k < sizeof msg)
        k += snprintf(msg + k, sizeof msg - (size_t)k, "; live %.1f MiB:", (double)ms.live_bytes / 1048576.0);
    for (int c = 0; c < ANNEAL_MEM_CATEGORY_COUNT && k > 0 && (size_t)k < sizeof msg; c++)
        k += snprintf(msg + k, sizeof msg - (size_t)k, "%s %s %.1f MiB", c ? "," : "",
                      anneal_memory_category_name((anneal_mem_category)c), (double)m.live[c] / 1048576.0);
    if (k > 0 && (size_t)k < sizeof msg)
        snprintf(msg + k, sizeof msg - (size_t)k, "; cache %.1f MiB (to fit: --recompute block, or a smaller "
                 "--batch with --accum)", (double)ms.cached_bytes / 1048576.0);
    anneal_set_error(ANNEAL_ERR_OOM, "%s", msg);
}

/* anneal_storage_new, and with zero set a block whose bytes are zero when *zeroed says
 * so: a cache miss on a backend with alloc_zeroed (a cached block has been used). */
static anneal_storage *storage_get(anneal_device d, size_t nbytes, bool zero, bool *zeroed) {
    if (zeroed) *zeroed = false;
    const anneal_backend *be = anneal_backend_get(d);
    if (!be) return NULL;
    device_pool *dp = &g_pool[d];
    size_t block;
    int cls = size_class(nbytes, &block);
    if (cls < 0) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory: %zu bytes on %s is beyond any size class",
                         nbytes, anneal_device_name(d));
        return NULL;
    }
    pthread_mutex_lock(&dp->lock);
    if (dp->limit > 0 && dp->live + (int64_t)nbytes > dp->limit) {
        int64_t limit = dp->limit;
        pthread_mutex_unlock(&dp->lock);
        oom_error(d, "out of memory: %zu bytes on %s exceed the limit of %lld", nbytes, anneal_device_name(d),
                  (long long)limit);
        return NULL;
    }
    anneal_storage *st = dp->free_list[cls];
    if (st) {
        dp->free_list[cls] = st->_next_free;
        dp->cached -= (int64_t)block;
        HOST_UNPOISON(d, st->data, block);
    } else {
        /* A miss: keep the reserved bytes under the cap, then ask the system (and on
         * refusal, empty the cache and ask once more). */
        if (dp->limit > 0 && dp->reserved + (int64_t)block > dp->limit) drain_locked(dp, be);
        void *(*get)(void *, size_t) = zero && ANNEAL_BACKEND_SLOT(be, alloc_zeroed, 4) ? be->alloc_zeroed : be->alloc;
        void *p = get(be->ctx, block);
        if (!p && dp->cached) {
            drain_locked(dp, be);
            p = get(be->ctx, block);
        }
        if (p && zeroed) *zeroed = get != be->alloc;
        st = p ? malloc(sizeof *st) : NULL;
        if (!st) {
            if (p) be->free(be->ctx, p);
            pthread_mutex_unlock(&dp->lock);
            oom_error(d, "out of memory allocating %zu bytes on %s", nbytes, anneal_device_name(d));
            return NULL;
        }
        st->data = p;
        st->_block = block;
        st->_class = cls;
        dp->n_system++;
        dp->reserved += (int64_t)block;
        if (dp->reserved > dp->peak_reserved) dp->peak_reserved = dp->reserved;
    }
    st->_next_free = NULL;
    st->nbytes = nbytes;
    st->device = d;
    st->refcount = 1;
    st->_category = t_category;
    dp->live_cat[t_category] += (int64_t)nbytes;
    if (dp->live_cat[t_category] > dp->max_cat[t_category]) dp->max_cat[t_category] = dp->live_cat[t_category];
    dp->live += (int64_t)nbytes;
    if (dp->live > dp->peak) {
        dp->peak = dp->live;
        memcpy(dp->peak_cat, dp->live_cat, sizeof dp->peak_cat);
    }
    dp->n_allocs++;
    pthread_mutex_unlock(&dp->lock);
    return st;
}

anneal_storage *anneal_storage_new(anneal_device d, size_t nbytes) { return storage_get(d, nbytes, false, NULL); }

anneal_storage *anneal_storage_new_zeroed(anneal_device d, size_t nbytes, bool *zeroed) {
    return storage_get(d, nbytes, true, zeroed);
}

void anneal_storage_retain(anneal_storage *s) {
    if (s) s->refcount++;
}

void anneal_storage_release(anneal_storage *s) {
    if (!s || --s->refcount > 0) return;
    if (s->_class < 0) { /* evicted: its bytes left the allocator at eviction */
        free(s);
        return;
    }
    device_pool *dp = &g_pool[s->device];
    pthread_mutex_lock(&dp->lock);
    dp->live -= (int64_t)s->nbytes;
    dp->live_cat[s->_category] -= (int64_t)s->nbytes;
    s->_next_free = dp->free_list[s->_class];
    dp->free_list[s->_class] = s;
    dp->cached += (int64_t)s->_block;
    HOST_POISON(s->device, s->data, s->_block);
    pthread_mutex_unlock(&dp->lock);
}

int64_t anneal_memory_release_cache(anneal_device d) {
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) return 0;
    device_pool *dp = &g_pool[d];
    const anneal_backend *be = anneal_backend_get(d);
    pthread_mutex_lock(&dp->lock);
    int64_t freed = drain_locked(dp, be);
    pthread_mutex_unlock(&dp->lock);
    if (d == ANNEAL_CPU) {
        anneal_scope_release_cache();
        freed += anneal_pool_release();
    }
    return freed;
}

anneal_memory_stats anneal_memory_stats_get(anneal_device d) {
    anneal_memory_stats m = {0};
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) return m;
    device_pool *dp = &g_pool[d];
    pthread_mutex_lock(&dp->lock);
    m.live_bytes = dp->live;
    m.peak_bytes = dp->peak;
    m.n_allocs = dp->n_allocs;
    m.limit_bytes = dp->limit;
    m.reserved_bytes = dp->reserved;
    m.peak_reserved_bytes = dp->peak_reserved;
    m.cached_bytes = dp->cached;
    m.n_system_allocs = dp->n_system;
    pthread_mutex_unlock(&dp->lock);
    if (d == ANNEAL_CPU) m.n_system_allocs += anneal_pool_system_allocs();
    return m;
}

void anneal_memory_reset_peak(anneal_device d) {
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) return;
    device_pool *dp = &g_pool[d];
    pthread_mutex_lock(&dp->lock);
    dp->peak = dp->live;
    memcpy(dp->peak_cat, dp->live_cat, sizeof dp->peak_cat);
    memcpy(dp->max_cat, dp->live_cat, sizeof dp->max_cat);
    dp->peak_reserved = dp->reserved;
    pthread_mutex_unlock(&dp->lock);
}

void anneal_memory_set_limit(anneal_device d, int64_t bytes) {
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) return;
    device_pool *dp = &g_pool[d];
    pthread_mutex_lock(&dp->lock);
    dp->limit = bytes < 0 ? 0 : bytes;
    pthread_mutex_unlock(&dp->lock);
}

anneal_mem_category anneal_memory_category_set(anneal_mem_category c) {
    anneal_mem_category prev = (anneal_mem_category)t_category;
    if ((unsigned)c < ANNEAL_MEM_CATEGORY_COUNT) t_category = (int)c;
    return prev;
}

const char *anneal_memory_category_name(anneal_mem_category c) {
    static const char *names[ANNEAL_MEM_CATEGORY_COUNT] = {"activations", "parameters", "gradients",
                                                           "optimizer state", "workspace"};
    return (unsigned)c < ANNEAL_MEM_CATEGORY_COUNT ? names[c] : "?";
}

anneal_memory_categories anneal_memory_categories_get(anneal_device d) {
    anneal_memory_categories m;
    memset(&m, 0, sizeof m);
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) return m;
    device_pool *dp = &g_pool[d];
    pthread_mutex_lock(&dp->lock);
    for (int c = 0; c < ANNEAL_MEM_CATEGORY_COUNT; c++) m.live[c] = dp->live_cat[c], m.at_peak[c] = dp->peak_cat[c], m.peak[c] = dp->max_cat[c];
    pthread_mutex_unlock(&dp->lock);
    return m;
}

/* ------------------------------------------------------------ eviction */

bool anneal_storage_evictable(const anneal_storage *s) {
    return s && s->device == ANNEAL_CPU && s->_class >= 0 && s->_category == ANNEAL_MEM_ACTIVATIONS && s->nbytes > 0;
}

bool anneal_storage_evicted(const anneal_storage *s) { return s && s->_class < 0; }

anneal_status anneal_storage_evict(anneal_storage *s, void *ext) {
    if (!anneal_storage_evictable(s) || !ext)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_storage_evict: not an activation storage on the CPU holding "
                                "a block, or no memory to move it to");
    /* the block goes to the cache under a record of its own; s keeps its identity */
    anneal_storage *blk = malloc(sizeof *blk);
    if (!blk) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory evicting a storage");
    device_pool *dp = &g_pool[s->device];
    pthread_mutex_lock(&dp->lock);
    *blk = *s;
    blk->refcount = 0;
    dp->live -= (int64_t)s->nbytes;
    dp->live_cat[s->_category] -= (int64_t)s->nbytes;
    blk->_next_free = dp->free_list[blk->_class];
    dp->free_list[blk->_class] = blk;
    dp->cached += (int64_t)blk->_block;
    HOST_POISON(blk->device, blk->data, blk->_block);
    s->data = ext;
    s->_class = -1;
    s->_block = 0;
    pthread_mutex_unlock(&dp->lock);
    return ANNEAL_OK;
}

anneal_status anneal_storage_restore(anneal_storage *s) {
    if (!anneal_storage_evicted(s)) return ANNEAL_OK;
    anneal_mem_category mc = anneal_memory_category_set((anneal_mem_category)s->_category);
    anneal_storage *blk = anneal_storage_new(s->device, s->nbytes);
    anneal_memory_category_set(mc);
    if (!blk) return anneal_last_status();
    memcpy(blk->data, s->data, s->nbytes);
    s->data = blk->data;
    s->_block = blk->_block;
    s->_class = blk->_class;
    free(blk); /* its block now belongs to s, already counted live */
    return ANNEAL_OK;
}
