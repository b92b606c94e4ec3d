/* --device: the one reader of a device name for train, eval and generate. "cpu",
 * "cuda" (the CUDA backend's GPU: 0 unless chosen), "cuda:N" (GPU N, chosen with
 * anneal_cuda_select before the GPU's first use), or the name of a backend registered
 * from outside the library (the tests' "emu"). The syntax is checked when the setting
 * is made (anneal_train_config_set), whether the device can be used when a command
 * starts (anneal_train_device_resolve), so a saved or filed setting reads the same. */
#include "anneal/backend.h"
#include "anneal/cuda.h"
#include "anneal/parse.h"
#include "anneal/train.h"

#include <stdio.h>
#include <string.h>

/* The device a backend registered from outside the library calls `name`
 * (ANNEAL_DEVICE_COUNT when none does); the recorded error is left as it was. */
static anneal_device external_named(const char *name) {
    char saved[1024];
    anneal_status code = anneal_last_status();
    snprintf(saved, sizeof saved, "%s", anneal_last_error());
    anneal_device found = ANNEAL_DEVICE_COUNT;
    for (int d = ANNEAL_DEVICE_EXT; d < ANNEAL_DEVICE_COUNT && found == ANNEAL_DEVICE_COUNT; d++) {
        const anneal_backend *b = anneal_backend_get((anneal_device)d);
        if (b && b->name && !strcmp(b->name, name)) found = (anneal_device)d;
    }
    anneal_clear_error();
    if (code != ANNEAL_OK) anneal_set_error(code, "%s", saved);
    return found;
}

anneal_status anneal_train_device_parse(const char *name, anneal_device *dev, int *ordinal) {
    *dev = ANNEAL_CPU;
    *ordinal = -1;
    if (!name || !strcmp(name, "cpu")) return ANNEAL_OK;
    if (!strcmp(name, "cuda")) {
        *dev = ANNEAL_CUDA;
        return ANNEAL_OK;
    }
    if (!strncmp(name, "cuda:", 5)) {
        int64_t n = -1;
        if (anneal_parse_decimal_i64(name + 5, &n) != ANNEAL_NUMBER_OK || n < 0 || n > 4096)
            return anneal_set_error(ANNEAL_ERR_ARG, "--device %s: expects cuda:N with N a GPU number >= 0", name);
        *dev = ANNEAL_CUDA;
        *ordinal = (int)n;
        return ANNEAL_OK;
    }
    anneal_device d = external_named(name);
    if (d == ANNEAL_DEVICE_COUNT)
        return anneal_set_error(ANNEAL_ERR_ARG, "--device: unknown device '%s' (cpu, cuda, cuda:N)", name);
    *dev = d;
    return ANNEAL_OK;
}

anneal_status anneal_train_device_resolve(const char *name, anneal_device *out) {
    int ordinal = -1;
    anneal_device dev;
    if (anneal_train_device_parse(name, &dev, &ordinal) != ANNEAL_OK) return anneal_last_status();
    if (dev == ANNEAL_CUDA) {
        char why[512] = "";
        if (!anneal_cuda_built()) {
            anneal_cuda_device_count(why, sizeof why);
            return anneal_set_error(ANNEAL_ERR_ARG, "--device %s: %s", name, why);
        }
        if (ordinal >= 0) {
            if (anneal_cuda_select(ordinal) != ANNEAL_OK) {
                char msg[1024];
                snprintf(msg, sizeof msg, "%s", anneal_last_error());
                anneal_clear_error();
                return anneal_set_error(ANNEAL_ERR_ARG, "--device: %s", msg);
            }
        } else if (anneal_cuda_device_count(why, sizeof why) <= 0) {
            return anneal_set_error(ANNEAL_ERR_ARG, "--device %s: %s", name, why);
        }
    }
    if (!anneal_backend_get(dev)) { /* a backend that went away, or none in this build */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", anneal_last_error());
        anneal_clear_error();
        return anneal_set_error(ANNEAL_ERR_ARG, "--device %s: %s", name ? name : "cpu", msg);
    }
    *out = dev;
    return ANNEAL_OK;
}
