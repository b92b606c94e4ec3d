/* A second device for tests: the CPU's table under another name and device id (its
 * memory is host memory), whose slots a test overrides (to count synchronisations,
 * record descriptors, decline ops) before registering it. */
#ifndef ANNEAL_TESTS_BACKEND_CLONE_H
#define ANNEAL_TESTS_BACKEND_CLONE_H

#include "anneal/backend.h"

/* *dst = the CPU table named `name` on device dev; false when there is no CPU table. */
static inline bool anneal_test_cpu_clone(anneal_backend *dst, const char *name, anneal_device dev) {
    const anneal_backend *cpu = anneal_backend_get(ANNEAL_CPU);
    if (!cpu) return false;
    *dst = *cpu;
    dst->name = name;
    dst->device = dev;
    return true;
}

#endif
