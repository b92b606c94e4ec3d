/* anneal custom ops: define a differentiable op from outside the library, the
 * counterpart of PyTorch's custom C++/CUDA extensions.
 *
 * An op is a definition (anneal_custom_op_def): a name, how many tensors it takes and
 * gives, a parameter block copied with every call, a shape rule, which inputs are
 * differentiable, which tensors the backward needs, and kernels per device (a forward
 * and a backward over tensors, and an optional supports predicate). The CPU kernel is
 * required; CUDA or any other device (ANNEAL_DEVICE_EXT..) is optional: inputs on a
 * device use that device's kernel, and a device without one, or whose supports
 * declines, is ANNEAL_ERR_UNSUPPORTED naming the op and the device.
 *
 * Register it once (anneal_custom_op_register), then call it like any op
 * (anneal_custom_op_apply / anneal_custom_op_call): the library checks that the inputs
 * share a device, runs the shape rule, allocates the outputs on that device, runs the
 * forward kernel and, when grad mode is on and a differentiable input requires grad,
 * records an autograd node that saves what the backward needs. Backward allocates the
 * input gradients and hands the kernel the saved tensors, the output gradients and the
 * parameters. Errors propagate like NaN: a NULL input gives NULL outputs without work
 * and the first error is kept.
 *
 * What kernels get: every tensor is contiguous (strided inputs are copied first) and on
 * the kernel's device; outputs and input gradients are fresh and uninitialised, so a
 * kernel writes every element. Kernels get the device's backend table (ctx, stream,
 * synchronize, and every built-in kernel): a device kernel enqueues its work on the
 * backend's current stream and need not wait for it. Kernels run with grad mode off and
 * must be deterministic (the same inputs give the same bits). The host may read tensor
 * memory (anneal_data) only in a CPU kernel. An example: examples/swiglu/. */
#ifndef ANNEAL_CUSTOM_OP_H
#define ANNEAL_CUSTOM_OP_H

#include "anneal/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The definition layout this header describes. Fields are only ever appended, each
 * marked with the version that added it; a definition says which version it was
 * written for. */
#define ANNEAL_CUSTOM_OP_VERSION 1
/* Most inputs and most outputs of one op. */
#define ANNEAL_CUSTOM_OP_MAX_TENSORS 8
/* Longest name (bytes, without the terminator) and largest parameter block. */
#define ANNEAL_CUSTOM_OP_NAME_MAX 63
#define ANNEAL_CUSTOM_OP_MAX_PARAM_BYTES 65536

/* What one call of an op is: handed to every function of the definition. */
typedef struct anneal_custom_ctx {
    const char *name;              /* the op's name (for error messages) */
    anneal_device device;          /* where the tensors are */
    const anneal_backend *backend; /* that device's table: backend->ctx, streams, synchronize */
    const void *params;            /* the call's parameter block (NULL when param_size is 0) */
    size_t param_size;
    int n_inputs, n_outputs;
    void *user;                    /* the definition's user pointer */
} anneal_custom_ctx;

/* What the shape rule says of one output. */
typedef struct anneal_custom_out_spec {
    anneal_dtype dtype;
    int ndim;
    int64_t shape[ANNEAL_MAX_DIMS];
} anneal_custom_out_spec;

/* Fills out[0..n_outputs) from the inputs (contiguous, on c->device) and the
 * parameters. Refuses inputs it cannot take by returning an error status, with a
 * message set by anneal_set_error naming the op and the argument (an error returned
 * without one gets a generic message). out arrives zero-filled (dtype ANNEAL_F32). */
typedef anneal_status (*anneal_custom_shape_fn)(const anneal_custom_ctx *c, const anneal_tensor *const *inputs,
                                                anneal_custom_out_spec *out);
/* Writes every element of outputs[0..n_outputs) (fresh, contiguous, of the shape rule's
 * dtypes and shapes) from inputs[0..n_inputs). */
typedef anneal_status (*anneal_custom_forward_fn)(const anneal_custom_ctx *c, const anneal_tensor *const *inputs,
                                                  anneal_tensor *const *outputs);
/* The gradients of the inputs. grad_inputs[i] is a fresh contiguous tensor of input i's
 * shape and dtype to overwrite when input i wants a gradient, NULL otherwise (not
 * differentiable, or not requiring grad). inputs[i] / outputs[j] are the forward's
 * tensors when the definition saves them (save_inputs / save_outputs), NULL otherwise.
 * grad_outputs[j] is the gradient of output j, or NULL when output j received none (it
 * did not reach the loss): treat it as zeros. At least one is non-NULL. */
typedef anneal_status (*anneal_custom_backward_fn)(const anneal_custom_ctx *c, anneal_tensor *const *grad_inputs,
                                                   const anneal_tensor *const *inputs,
                                                   const anneal_tensor *const *outputs,
                                                   const anneal_tensor *const *grad_outputs);
/* True when the kernel takes these inputs (dtypes, sizes, alignment); false makes the
 * call ANNEAL_ERR_UNSUPPORTED. Asked before the shape rule, on every call. */
typedef bool (*anneal_custom_supports_fn)(const anneal_custom_ctx *c, const anneal_tensor *const *inputs);

/* The kernels of one device. forward NULL: no kernel for that device. */
typedef struct anneal_custom_kernel {
    anneal_custom_forward_fn forward;
    anneal_custom_backward_fn backward; /* required when the op has a differentiable input */
    anneal_custom_supports_fn supports; /* optional: NULL takes everything */
} anneal_custom_kernel;

/* An op. Fill it with designated initialisers, e.g.
 *   {.version = ANNEAL_CUSTOM_OP_VERSION, .name = "swiglu", .n_inputs = 2, .n_outputs = 1,
 *    .shape = swiglu_shape, .differentiable = 0x3, .save_inputs = 0x3,
 *    .kernels = {[ANNEAL_CPU] = {swiglu_fwd_cpu, swiglu_bwd_cpu, NULL}}}
 * Bit i of a mask stands for input (or output) i. */
typedef struct anneal_custom_op_def {
    /* ---------------------------------------------------------- version 1 */
    int version;                 /* ANNEAL_CUSTOM_OP_VERSION the definition was written for */
    const char *name;            /* unique among custom ops; 1..ANNEAL_CUSTOM_OP_NAME_MAX bytes */
    int n_inputs, n_outputs;     /* 1..ANNEAL_CUSTOM_OP_MAX_TENSORS each */
    size_t param_size;           /* bytes of the parameter block every call passes (0: none) */
    anneal_custom_shape_fn shape; /* required */
    uint32_t differentiable;     /* inputs that can receive a gradient */
    uint32_t save_inputs;        /* inputs the backward reads */
    uint32_t save_outputs;       /* outputs the backward reads */
    anneal_custom_kernel kernels[ANNEAL_DEVICE_COUNT]; /* by device; [ANNEAL_CPU] required */
    void *user;                  /* handed to every function as c->user */
} anneal_custom_op_def;

/* A registered op (the library's copy of the definition). */
typedef struct anneal_custom_op anneal_custom_op;

/* Validates def and registers a copy of it under def->name (the definition and the name
 * are copied; the functions and `user` must outlive the process's use of the op).
 * ANNEAL_ERR_ARG with a message naming the op and the field for: a version outside
 * 1..ANNEAL_CUSTOM_OP_VERSION, a missing or too long name, counts outside
 * 1..ANNEAL_CUSTOM_OP_MAX_TENSORS, masks naming tensors the op does not have, a
 * parameter block over ANNEAL_CUSTOM_OP_MAX_PARAM_BYTES, no shape rule, no CPU forward, a
 * device kernel without forward, or without backward when an input is differentiable.
 * ANNEAL_ERR_STATE when the name is taken. *out (may be NULL) gets the handle. */
anneal_status anneal_custom_op_register(const anneal_custom_op_def *def, const anneal_custom_op **out);
/* The op registered as name, or NULL (no error recorded). */
const anneal_custom_op *anneal_custom_op_find(const char *name);
/* The definition an op was registered with (its name, counts, kernels). */
const anneal_custom_op_def *anneal_custom_op_definition(const anneal_custom_op *op);

/* Runs op on inputs[0..n_inputs) with the parameter block params (param_size bytes,
 * copied: the caller may reuse it at once; NULL when param_size is 0) and writes its
 * outputs (new tensors owned by the current scope) to outputs[0..n_outputs). On any
 * failure every output is NULL and the status is returned: a NULL op or input (an
 * earlier error, kept; ANNEAL_ERR_ARG if none was recorded), inputs on different
 * devices (ANNEAL_ERR_DEVICE), no kernel for the device or supports declining
 * (ANNEAL_ERR_UNSUPPORTED naming the op and the device), the shape rule's error, a bad
 * shape rule result (ANNEAL_ERR_ARG naming the output), or the kernel's error. */
anneal_status anneal_custom_op_apply(const anneal_custom_op *op, anneal_tensor *const *inputs, const void *params,
                                     anneal_tensor **outputs);
/* anneal_custom_op_apply returning output 0 (NULL on failure); the other outputs, if
 * any, stay in the current scope. */
anneal_tensor *anneal_custom_op_call(const anneal_custom_op *op, anneal_tensor *const *inputs, const void *params);

#ifdef __cplusplus
}
#endif
#endif
