/* Storage allocation through the device's backend, with live/peak statistics and an
 * optional cap (to exercise out-of-memory paths in tests). */
#include "anneal/backend.h"
#include "core_internal.h"

#include <stdatomic.h>
#include <stdlib.h>

typedef struct {
    _Atomic int64_t live, peak, n_allocs, limit;
} device_stats;

static device_stats g_stats[ANNEAL_DEVICE_COUNT];

static void note_alloc(device_stats *s, int64_t n) {
    int64_t live = atomic_fetch_add(&s->live, n) + n;
    atomic_fetch_add(&s->n_allocs, 1);
    int64_t peak = atomic_load(&s->peak);
    while (live > peak && !atomic_compare_exchange_weak(&s->peak, &peak, live)) {
    }
}

anneal_storage *anneal_storage_new(anneal_device d, size_t nbytes) {
    const anneal_backend *be = anneal_backend_get(d);
    if (!be) return NULL;
    device_stats *s = &g_stats[d];
    int64_t limit = atomic_load(&s->limit);
    if (limit > 0 && atomic_load(&s->live) + (int64_t)nbytes > limit) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory: %zu bytes on %s exceed the limit of %lld",
                         nbytes, anneal_device_name(d), (long long)limit);
        return NULL;
    }
    anneal_storage *st = malloc(sizeof *st);
    void *p = be->alloc(nbytes ? nbytes : 1);
    if (!st || !p) {
        free(st);
        if (p) be->free(p);
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory allocating %zu bytes on %s", nbytes,
                         anneal_device_name(d));
        return NULL;
    }
    st->data = p;
    st->nbytes = nbytes;
    st->device = d;
    st->refcount = 1;
    note_alloc(s, (int64_t)nbytes);
    return st;
}

void anneal_storage_retain(anneal_storage *s) {
    if (s) s->refcount++;
}

void anneal_storage_release(anneal_storage *s) {
    if (!s || --s->refcount > 0) return;
    const anneal_backend *be = anneal_backend_get(s->device);
    if (be) be->free(s->data);
    atomic_fetch_sub(&g_stats[s->device].live, (int64_t)s->nbytes);
    free(s);
}

anneal_memory_stats anneal_memory_stats_get(anneal_device d) {
    anneal_memory_stats m = {0, 0, 0, 0};
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) return m;
    m.live_bytes = atomic_load(&g_stats[d].live);
    m.peak_bytes = atomic_load(&g_stats[d].peak);
    m.n_allocs = atomic_load(&g_stats[d].n_allocs);
    m.limit_bytes = atomic_load(&g_stats[d].limit);
    return m;
}

void anneal_memory_reset_peak(anneal_device d) {
    if ((unsigned)d < ANNEAL_DEVICE_COUNT) atomic_store(&g_stats[d].peak, atomic_load(&g_stats[d].live));
}

void anneal_memory_set_limit(anneal_device d, int64_t bytes) {
    if ((unsigned)d < ANNEAL_DEVICE_COUNT) atomic_store(&g_stats[d].limit, bytes < 0 ? 0 : bytes);
}
