/* The registry of per-device kernel tables. Core knows no backend: backends register
 * themselves (anneal_backend_register), and the library's built-in ones are listed by
 * anneal_backends_register_builtin (src/backends/registry.c), which core calls once, on
 * the first lookup of a device without a table or the first registration. */
#include "anneal/backend.h"

#include <pthread.h>
#include <stdio.h>

static const anneal_backend *g_backends[ANNEAL_DEVICE_COUNT];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_builtin_once = PTHREAD_ONCE_INIT;
/* True on the thread running the built-in registrations (their anneal_backend_register
 * calls must not wait for the pthread_once they run inside). */
static _Thread_local bool g_in_builtin;

static void register_builtin(void) {
    g_in_builtin = true;
    anneal_backends_register_builtin();
    g_in_builtin = false;
}

static void ensure_builtin(void) {
    if (!g_in_builtin) pthread_once(&g_builtin_once, register_builtin);
}

/* The table of device d, or NULL (no lookup of the built-ins, no error). */
static const anneal_backend *table_of(anneal_device d) {
    return (unsigned)d < ANNEAL_DEVICE_COUNT ? __atomic_load_n(&g_backends[d], __ATOMIC_ACQUIRE) : NULL;
}

/* Installs b after checking what every table must have (see backend.h). The built-in
 * tables are registered before the first caller's, so a caller's table replaces a
 * built-in one and never the other way round. */
anneal_status anneal_backend_register(const anneal_backend *b) {
    if (!b) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_backend_register: NULL table");
    const char *name = b->name ? b->name : "(unnamed)";
    if ((unsigned)b->device >= ANNEAL_DEVICE_COUNT)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_backend_register: backend '%s' has device id %d, outside 0..%d",
                                name, (int)b->device, ANNEAL_DEVICE_COUNT - 1);
    if (b->version < 1 || b->version > ANNEAL_BACKEND_VERSION)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "anneal_backend_register: backend '%s' is written for table version %d; this build "
                                "knows versions 1..%d", name, b->version, ANNEAL_BACKEND_VERSION);
    const char *missing = !b->name ? "name" : !b->alloc ? "alloc" : !b->free ? "free"
                        : !b->copy_to_host ? "copy_to_host" : !b->copy_from_host ? "copy_from_host"
                        : !b->synchronize ? "synchronize" : !b->copy ? "copy" : !b->fill ? "fill" : NULL;
    if (missing)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_backend_register: backend '%s' lacks the version 1 essential '%s'",
                                name, missing);
    ensure_builtin();
    pthread_mutex_lock(&g_lock);
    __atomic_store_n(&g_backends[b->device], b, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_lock);
    return ANNEAL_OK;
}

const anneal_backend *anneal_backend_get(anneal_device d) {
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) {
        anneal_set_error(ANNEAL_ERR_DEVICE, "invalid device %d", (int)d);
        return NULL;
    }
    const anneal_backend *b = table_of(d);
    if (b) return b;
    ensure_builtin();
    if ((b = table_of(d))) return b;
    anneal_set_error(ANNEAL_ERR_DEVICE, "no %s backend in this build", anneal_device_name(d));
    return NULL;
}

/* Whether table b has the slot(s) an op of this kind calls. */
static bool has_slot(const anneal_backend *b, anneal_op_kind k) {
    switch (k) {
    case ANNEAL_OP_COPY: return b->copy != NULL;
    case ANNEAL_OP_FILL: return b->fill != NULL;
    case ANNEAL_OP_BINARY: return b->binary != NULL;
    case ANNEAL_OP_UNARY: return b->unary != NULL && b->unary_bwd != NULL;
    case ANNEAL_OP_REDUCE_SUM: return b->reduce_sum != NULL;
    case ANNEAL_OP_MATMUL: return b->matmul != NULL;
    case ANNEAL_OP_LAYER_NORM: return b->layer_norm_fwd && b->layer_norm_bwd;
    case ANNEAL_OP_ADD_LAYER_NORM: return b->add_layer_norm_fwd && b->add_layer_norm_bwd;
    case ANNEAL_OP_RMS_NORM: return b->rms_norm_fwd && b->rms_norm_bwd;
    case ANNEAL_OP_SOFTMAX: return b->softmax_fwd && b->softmax_bwd;
    case ANNEAL_OP_ATTENTION: return b->attention_fwd && b->attention_bwd;
    case ANNEAL_OP_ROPE: return b->rope != NULL;
    case ANNEAL_OP_EMBEDDING: return b->embedding_fwd && b->embedding_bwd;
    case ANNEAL_OP_CROSS_ENTROPY: return b->cross_entropy_fwd && b->cross_entropy_bwd;
    case ANNEAL_OP_LINEAR_CROSS_ENTROPY: return b->linear_cross_entropy != NULL;
    case ANNEAL_OP_DROPOUT: return b->dropout_fwd && b->dropout_bwd;
    case ANNEAL_OP_RANDN: return b->randn != NULL;
    case ANNEAL_OP_ADAMW: return b->adamw != NULL;
    case ANNEAL_OP_SUM_SQUARES: return b->sum_squares != NULL;
    case ANNEAL_OP_CHECK_INDEX: return b->check_index != NULL;
    case ANNEAL_OP_LOSS_MEAN: return b->loss_mean != NULL;
    case ANNEAL_OP_SCALE_BY: return b->scale_by != NULL;
    case ANNEAL_OP_KIND_COUNT: break;
    }
    return false;
}

bool anneal_backend_supports(const anneal_backend *b, const anneal_op_query *q) {
    if (!b || !q || (unsigned)q->kind >= ANNEAL_OP_KIND_COUNT || !has_slot(b, q->kind)) return false;
    return !b->supports_op || b->supports_op(b->ctx, q);
}

anneal_status anneal_device_synchronize(anneal_device d) {
    const anneal_backend *b = anneal_backend_get(d);
    if (!b) return anneal_last_status();
    return b->synchronize(b->ctx);
}

const char *anneal_device_name(anneal_device d) {
    static const char *const names[ANNEAL_DEVICE_COUNT] = {"cpu", "cuda", "device2", "device3",
                                                           "device4", "device5", "device6", "device7"};
    if ((unsigned)d >= ANNEAL_DEVICE_COUNT) return "?";
    const anneal_backend *b = table_of(d);
    return b ? b->name : names[d];
}
