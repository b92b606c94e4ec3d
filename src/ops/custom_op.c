/* Ops defined outside the library (include/anneal/custom_op.h): a registry of
 * validated definitions by name, and the generic op that runs one: device check,
 * kernel choice by device, shape rule, output allocation, forward kernel, and an
 * autograd node whose backward allocates the input gradients and calls the
 * definition's backward kernel with the tensors it asked to keep. */
#include "anneal/custom_op.h"
#include "ops_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MAXT ANNEAL_CUSTOM_OP_MAX_TENSORS

struct anneal_custom_op {
    anneal_custom_op_def def; /* def.name points to name */
    char name[ANNEAL_CUSTOM_OP_NAME_MAX + 1];
};

/* Registered ops: never freed (handles stay valid for the process's life). */
static anneal_custom_op **g_ops;
static int g_n_ops, g_cap_ops;
static pthread_mutex_t g_ops_lock = PTHREAD_MUTEX_INITIALIZER;

/* The op called name (lock held), or NULL. */
static anneal_custom_op *find_locked(const char *name) {
    for (int i = 0; i < g_n_ops; i++)
        if (!strcmp(g_ops[i]->name, name)) return g_ops[i];
    return NULL;
}

/* ANNEAL_OK when def can be registered; otherwise ANNEAL_ERR_ARG naming the field. */
static anneal_status validate(const anneal_custom_op_def *d) {
    const char *fn = "anneal_custom_op_register";
    if (!d) return anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL definition", fn);
    size_t len = d->name ? strlen(d->name) : 0;
    if (len == 0 || len > ANNEAL_CUSTOM_OP_NAME_MAX)
        return d->name ? anneal_set_error(ANNEAL_ERR_ARG, "%s: the op's name must be 1..%d bytes, got %zu", fn,
                                          ANNEAL_CUSTOM_OP_NAME_MAX, len)
                       : anneal_set_error(ANNEAL_ERR_ARG, "%s: the op's name must be 1..%d bytes, got NULL", fn,
                                          ANNEAL_CUSTOM_OP_NAME_MAX);
    const char *op = d->name;
    if (d->version < 1 || d->version > ANNEAL_CUSTOM_OP_VERSION)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: op '%s' is written for definition version %d; this build knows 1..%d",
                                fn, op, d->version, ANNEAL_CUSTOM_OP_VERSION);
    if (d->n_inputs < 1 || d->n_inputs > MAXT || d->n_outputs < 1 || d->n_outputs > MAXT)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: op '%s' has %d inputs and %d outputs; each must be 1..%d", fn, op,
                                d->n_inputs, d->n_outputs, MAXT);
    uint32_t in_mask = (uint32_t)((1u << d->n_inputs) - 1), out_mask = (uint32_t)((1u << d->n_outputs) - 1);
    const char *bad_mask = (d->differentiable & ~in_mask) ? "differentiable"
                         : (d->save_inputs & ~in_mask)    ? "save_inputs"
                         : (d->save_outputs & ~out_mask)  ? "save_outputs"
                                                          : NULL;
    if (bad_mask)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: op '%s': %s names a tensor the op does not have", fn, op, bad_mask);
    if (d->param_size > ANNEAL_CUSTOM_OP_MAX_PARAM_BYTES)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: op '%s': a parameter block of %zu bytes is over the %d allowed", fn,
                                op, d->param_size, ANNEAL_CUSTOM_OP_MAX_PARAM_BYTES);
    if (!d->shape) return anneal_set_error(ANNEAL_ERR_ARG, "%s: op '%s' has no shape rule", fn, op);
    if (!d->kernels[ANNEAL_CPU].forward)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: op '%s' has no CPU kernel (kernels[ANNEAL_CPU].forward)", fn, op);
    for (int dev = 0; dev < ANNEAL_DEVICE_COUNT; dev++) {
        const anneal_custom_kernel *k = &d->kernels[dev];
        if (!k->forward && (k->backward || k->supports))
            return anneal_set_error(ANNEAL_ERR_ARG, "%s: op '%s': the kernel of device %d has no forward", fn, op, dev);
        if (k->forward && d->differentiable && !k->backward)
            return anneal_set_error(ANNEAL_ERR_ARG,
                                    "%s: op '%s' has differentiable inputs but the kernel of device %d has no backward",
                                    fn, op, dev);
    }
    return ANNEAL_OK;
}

anneal_status anneal_custom_op_register(const anneal_custom_op_def *def, const anneal_custom_op **out) {
    anneal_status s = validate(def);
    if (s != ANNEAL_OK) return s;
    anneal_custom_op *op = calloc(1, sizeof *op);
    if (!op) return anneal_set_error(ANNEAL_ERR_OOM, "anneal_custom_op_register: out of memory for op '%s'", def->name);
    op->def = *def;
    strcpy(op->name, def->name);
    op->def.name = op->name;
    pthread_mutex_lock(&g_ops_lock);
    if (find_locked(op->name)) {
        pthread_mutex_unlock(&g_ops_lock);
        free(op);
        return anneal_set_error(ANNEAL_ERR_STATE, "anneal_custom_op_register: an op named '%s' is already registered",
                                def->name);
    }
    if (g_n_ops == g_cap_ops) {
        int cap = g_cap_ops ? 2 * g_cap_ops : 16;
        anneal_custom_op **ops = realloc(g_ops, (size_t)cap * sizeof *ops);
        if (!ops) {
            pthread_mutex_unlock(&g_ops_lock);
            free(op);
            return anneal_set_error(ANNEAL_ERR_OOM, "anneal_custom_op_register: out of memory for op '%s'", def->name);
        }
        g_ops = ops;
        g_cap_ops = cap;
    }
    g_ops[g_n_ops++] = op;
    pthread_mutex_unlock(&g_ops_lock);
    if (out) *out = op;
    return ANNEAL_OK;
}

const anneal_custom_op *anneal_custom_op_find(const char *name) {
    if (!name) return NULL;
    pthread_mutex_lock(&g_ops_lock);
    const anneal_custom_op *op = find_locked(name);
    pthread_mutex_unlock(&g_ops_lock);
    return op;
}

const anneal_custom_op_def *anneal_custom_op_definition(const anneal_custom_op *op) { return op ? &op->def : NULL; }

/* ------------------------------------------------------------------ a call */

/* What a recorded call keeps for its backward (from the small-object pool, the
 * parameter block appended). Saved tensors are detached aliases owned here, released
 * once the backward has run (or with the node). */
typedef struct node_ctx {
    const anneal_custom_op *op;
    anneal_device device;
    anneal_dtype in_dtype[MAXT];
    anneal_tensor *saved_in[MAXT], *saved_out[MAXT];
    size_t param_size;
    unsigned char params[]; /* param_size bytes */
} node_ctx;

static void release_saved(node_ctx *nc) {
    for (int i = 0; i < MAXT; i++) {
        anneal_release(nc->saved_in[i]);
        anneal_release(nc->saved_out[i]);
        nc->saved_in[i] = nc->saved_out[i] = NULL;
    }
}

static void node_ctx_free(void *p) {
    if (!p) return;
    release_saved(p);
    anneal_pool_free(p);
}

static anneal_custom_ctx call_ctx(const anneal_custom_op_def *d, anneal_device dev, const anneal_backend *be,
                                  const void *params) {
    return (anneal_custom_ctx){.name = d->name, .device = dev, .backend = be,
                               .params = d->param_size ? params : NULL, .param_size = d->param_size,
                               .n_inputs = d->n_inputs, .n_outputs = d->n_outputs, .user = d->user};
}

/* A kernel's status as the op reports it: a failure keeps the error the kernel
 * recorded, or gets a generic message when it recorded none. */
static anneal_status kernel_status(const char *op, const char *what, anneal_status s) {
    if (s == ANNEAL_OK) return ANNEAL_OK;
    if (anneal_last_status() == ANNEAL_OK)
        anneal_set_error(s, "%s: the %s failed (%s) without a message", op, what, anneal_status_name(s));
    return s;
}

/* d = the gradients of the inputs from the kernel of the forward's device. */
static anneal_status custom_backward(anneal_node *node, anneal_tensor *const *gout, anneal_tensor **gin) {
    node_ctx *nc = node->ctx;
    const anneal_custom_op_def *d = &nc->op->def;
    const anneal_backend *be = anneal_backend_get(nc->device);
    if (!be) return anneal_last_status();
    anneal_tensor *go[MAXT] = {0}, *gi[MAXT] = {0};
    for (int j = 0; j < d->n_outputs; j++)
        if (gout[j] && !(go[j] = anneal_ops_contiguous_raw(gout[j]))) return anneal_last_status();
    for (int i = 0; i < d->n_inputs; i++) {
        if (!anneal_node_input_needs_grad(node, i)) continue;
        const anneal_edge *e = &node->inputs[i];
        if (!(gi[i] = anneal_empty_on(nc->device, nc->in_dtype[i], e->ndim, e->shape))) return anneal_last_status();
    }
    anneal_custom_ctx c = call_ctx(d, nc->device, be, nc->params);
    anneal_status s = d->kernels[nc->device].backward(&c, gi, (const anneal_tensor *const *)nc->saved_in,
                                                      (const anneal_tensor *const *)nc->saved_out,
                                                      (const anneal_tensor *const *)go);
    release_saved(nc); /* one backward per graph: the activations are done */
    s = kernel_status(d->name, "backward kernel", s);
    if (s != ANNEAL_OK) return s;
    for (int i = 0; i < d->n_inputs; i++) gin[i] = gi[i];
    return ANNEAL_OK;
}

/* Records the node of a call when a differentiable input requires grad: edges only to
 * the differentiable inputs (the caller's tensors), the contiguous inputs and the
 * outputs the backward asked for saved, the parameter block copied. False on error. */
static bool record(const anneal_custom_op_def *d, const anneal_custom_op *op, anneal_device dev,
                   anneal_tensor *const *inputs, anneal_tensor *const *in, anneal_tensor *const *out,
                   const void *params) {
    anneal_tensor *edges[MAXT] = {0};
    for (int i = 0; i < d->n_inputs; i++)
        if (d->differentiable >> i & 1u) edges[i] = inputs[i];
    if (!anneal_any_requires_grad(d->n_inputs, edges)) return true;
    node_ctx *nc = anneal_pool_alloc(sizeof *nc + d->param_size);
    if (!nc) {
        anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory recording the op", d->name);
        return false;
    }
    nc->op = op;
    nc->device = dev;
    nc->param_size = d->param_size;
    if (d->param_size) memcpy(nc->params, params, d->param_size);
    anneal_scope_enter(NULL); /* the saved aliases belong to the node */
    bool ok = true;
    for (int i = 0; i < d->n_inputs; i++) {
        nc->in_dtype[i] = inputs[i]->dtype;
        if (ok && (d->save_inputs >> i & 1u)) ok = (nc->saved_in[i] = anneal_detach(in[i])) != NULL;
    }
    for (int j = 0; ok && j < d->n_outputs; j++)
        if (d->save_outputs >> j & 1u) ok = (nc->saved_out[j] = anneal_detach(out[j])) != NULL;
    anneal_scope_leave();
    anneal_node *node = ok ? anneal_record(d->name, custom_backward, d->n_inputs, edges, d->n_outputs, out) : NULL;
    if (!node) {
        node_ctx_free(nc);
        return false;
    }
    node->ctx = nc;
    node->ctx_free = node_ctx_free;
    return true;
}

/* The shape rule's result checked: known dtypes, ranks in 0..ANNEAL_MAX_DIMS, sizes >= 0. */
static bool check_specs(const anneal_custom_op_def *d, const anneal_custom_out_spec *spec) {
    for (int j = 0; j < d->n_outputs; j++) {
        const anneal_custom_out_spec *o = &spec[j];
        bool ok = (unsigned)o->dtype < ANNEAL_DTYPE_COUNT && o->ndim >= 0 && o->ndim <= ANNEAL_MAX_DIMS;
        for (int k = 0; ok && k < o->ndim; k++) ok = o->shape[k] >= 0;
        if (!ok) {
            anneal_set_error(ANNEAL_ERR_ARG,
                             "%s: the shape rule gave output %d an invalid result (dtype %d, rank %d, or a negative "
                             "size)", d->name, j, (int)o->dtype, o->ndim);
            return false;
        }
    }
    return true;
}

anneal_status anneal_custom_op_apply(const anneal_custom_op *op, anneal_tensor *const *inputs, const void *params,
                                     anneal_tensor **outputs) {
    if (!outputs) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_custom_op_apply: NULL outputs array");
    if (!op) {
        outputs[0] = NULL;
        if (anneal_last_status() == ANNEAL_OK)
            anneal_set_error(ANNEAL_ERR_ARG, "anneal_custom_op_apply: NULL op (not registered?)");
        return anneal_last_status();
    }
    const anneal_custom_op_def *d = &op->def;
    for (int j = 0; j < d->n_outputs; j++) outputs[j] = NULL;
    if (!inputs) return anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL inputs array", d->name);
    if (d->param_size && !params)
        return anneal_set_error(ANNEAL_ERR_ARG, "%s: NULL parameter block (%zu bytes expected)", d->name, d->param_size);
    const anneal_backend *be = anneal_ops_backend(d->name, d->n_inputs, inputs);
    if (!be) return anneal_last_status();
    anneal_device dev = inputs[0]->device;
    const anneal_custom_kernel *k = &d->kernels[dev];
    if (!k->forward)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: the custom op has no kernel for device %s (%d)", d->name,
                                anneal_device_name(dev), (int)dev);
    anneal_tensor *in[MAXT] = {0}, *out[MAXT] = {0};
    for (int i = 0; i < d->n_inputs; i++)
        if (!(in[i] = anneal_ops_contiguous_raw(inputs[i]))) return anneal_last_status();
    anneal_custom_ctx c = call_ctx(d, dev, be, params);
    const anneal_tensor *const *cin = (const anneal_tensor *const *)in;
    if (k->supports && !k->supports(&c, cin))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: the custom op's kernel for device %s (%d) declines these inputs",
                                d->name, anneal_device_name(dev), (int)dev);
    anneal_custom_out_spec spec[MAXT];
    memset(spec, 0, sizeof spec);
    anneal_status s = kernel_status(d->name, "shape rule", d->shape(&c, cin, spec));
    if (s != ANNEAL_OK) return s;
    if (!check_specs(d, spec)) return anneal_last_status();
    for (int j = 0; j < d->n_outputs; j++)
        if (!(out[j] = anneal_empty_on(dev, spec[j].dtype, spec[j].ndim, spec[j].shape))) return anneal_last_status();
    anneal_no_grad_begin(); /* ops a kernel calls record nothing */
    s = k->forward(&c, cin, out);
    anneal_no_grad_end();
    if ((s = kernel_status(d->name, "forward kernel", s)) != ANNEAL_OK) return s;
    if (!record(d, op, dev, inputs, in, out, params)) return anneal_last_status();
    for (int j = 0; j < d->n_outputs; j++) outputs[j] = out[j];
    return ANNEAL_OK;
}

anneal_tensor *anneal_custom_op_call(const anneal_custom_op *op, anneal_tensor *const *inputs, const void *params) {
    anneal_tensor *out[MAXT] = {0};
    anneal_custom_op_apply(op, inputs, params, out);
    return out[0];
}
