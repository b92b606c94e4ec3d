/* Registry of per-device kernel tables. The built-in CPU backend registers itself
 * on first use; this is the one place core names a backend. */
#include "anneal/backend.h"

void anneal_cpu_backend_init(void); /* src/cpu/cpu_backend.c */

static const anneal_backend *g_backends[ANNEAL_DEVICE_COUNT];

void anneal_backend_register(const anneal_backend *b) {
    if (b && (unsigned)b->device < ANNEAL_DEVICE_COUNT) g_backends[b->device] = b;
}

const anneal_backend *anneal_backend_get(anneal_device d) {
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) {
        anneal_set_error(ANNEAL_ERR_DEVICE, "invalid device %d", (int)d);
        return NULL;
    }
    if (!g_backends[d] && d == ANNEAL_CPU) anneal_cpu_backend_init();
    if (!g_backends[d]) {
        anneal_set_error(ANNEAL_ERR_DEVICE, "no %s backend in this build", anneal_device_name(d));
        return NULL;
    }
    return g_backends[d];
}
