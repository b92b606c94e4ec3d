/* Per-thread error status: the first error since the last clear wins, so a chain
 * of ops that returns NULL reports the failure that started it. */
#include "anneal/core.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local anneal_status g_status = ANNEAL_OK;
static _Thread_local char g_message[1024];

anneal_status anneal_set_error(anneal_status code, const char *fmt, ...) {
    if (code == ANNEAL_OK) return code;
    if (g_status != ANNEAL_OK) return code;
    g_status = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_message, sizeof g_message, fmt, ap);
    va_end(ap);
    return code;
}

anneal_status anneal_last_status(void) { return g_status; }

const char *anneal_last_error(void) { return g_status == ANNEAL_OK ? "" : g_message; }

void anneal_clear_error(void) {
    g_status = ANNEAL_OK;
    g_message[0] = '\0';
}

const char *anneal_status_name(anneal_status s) {
    switch (s) {
    case ANNEAL_OK: return "ANNEAL_OK";
    case ANNEAL_ERR_ARG: return "ANNEAL_ERR_ARG";
    case ANNEAL_ERR_SHAPE: return "ANNEAL_ERR_SHAPE";
    case ANNEAL_ERR_DTYPE: return "ANNEAL_ERR_DTYPE";
    case ANNEAL_ERR_DEVICE: return "ANNEAL_ERR_DEVICE";
    case ANNEAL_ERR_OOM: return "ANNEAL_ERR_OOM";
    case ANNEAL_ERR_IO: return "ANNEAL_ERR_IO";
    case ANNEAL_ERR_FORMAT: return "ANNEAL_ERR_FORMAT";
    case ANNEAL_ERR_STATE: return "ANNEAL_ERR_STATE";
    case ANNEAL_ERR_UNSUPPORTED: return "ANNEAL_ERR_UNSUPPORTED";
    case ANNEAL_ERR_NUMERIC: return "ANNEAL_ERR_NUMERIC";
    case ANNEAL_ERR_INTERRUPTED: return "ANNEAL_ERR_INTERRUPTED";
    }
    return "ANNEAL_ERR_?";
}

const char *anneal_version(void) { return ANNEAL_VERSION; }
