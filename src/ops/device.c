/* Tensors made for, or moved to, a device: position ids (arange) and explicit copies
 * between devices (to_device). Host data reaches a device only through its backend's
 * copy_from_host (anneal_from_data_on), never by writing tensor memory. */
#include "ops_internal.h"

#include <pthread.h>
#include <stdlib.h>

/* Ranges inside [0, IOTA_MAX) (every position id of a model with up to 64K positions)
 * are copied from one immutable host table filled once, which outlives any queued copy:
 * no synchronisation and no allocation, so a forward pass does not wait for the device.
 * Other ranges are made in a host buffer released after the device's synchronize (what
 * copy_from_host asks of it). */
#define IOTA_MAX 65536

static int32_t g_iota[IOTA_MAX];
static pthread_once_t g_iota_once = PTHREAD_ONCE_INIT;

static void iota_fill(void) {
    for (int32_t i = 0; i < IOTA_MAX; i++) g_iota[i] = i;
}

anneal_tensor *anneal_arange(anneal_device dev, int64_t start, int64_t n) {
    if (n < 0 || start < INT32_MIN || start > INT32_MAX || (n > 0 && start + (n - 1) > INT32_MAX)) {
        anneal_set_error(ANNEAL_ERR_ARG, "arange: [%lld, %lld + %lld) is not a range of i32 values", (long long)start,
                         (long long)start, (long long)n);
        return NULL;
    }
    if (start >= 0 && start + n <= IOTA_MAX) {
        pthread_once(&g_iota_once, iota_fill);
        return anneal_from_data_on(dev, ANNEAL_I32, 1, &n, g_iota + start);
    }
    int32_t *host = malloc((size_t)(n ? n : 1) * sizeof *host);
    if (!host) {
        anneal_set_error(ANNEAL_ERR_OOM, "arange: out of memory for %lld values", (long long)n);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) host[i] = (int32_t)(start + i);
    anneal_tensor *t = anneal_from_data_on(dev, ANNEAL_I32, 1, &n, host);
    if (t && anneal_device_synchronize(dev) != ANNEAL_OK) t = NULL;
    free(host);
    return t;
}

anneal_tensor *anneal_to_device(anneal_tensor *t, anneal_device dev) {
    if (!t) return NULL;
    if (t->device == dev) return t;
    if (!anneal_backend_get(dev)) return NULL;
    anneal_tensor *out = anneal_empty_on(dev, t->dtype, t->ndim, t->shape);
    if (!out || anneal_copy_(out, t) != ANNEAL_OK) return NULL;
    return out;
}
