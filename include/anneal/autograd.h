/* anneal autograd: a define-by-run tape. Ops on tensors that require grad record
 * a node holding the backward function and the tensors it saved; anneal_backward
 * walks the recorded nodes in reverse creation order and accumulates gradients
 * into the leaves' .grad. The engine knows no op by name. */
#ifndef ANNEAL_AUTOGRAD_H
#define ANNEAL_AUTOGRAD_H

#include "anneal/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ANNEAL_NODE_MAX_SAVED 8

typedef struct anneal_node anneal_node;

/* Computes the gradients of a node's inputs. grad_outputs[i] is the gradient of
 * output i, or NULL when that output received none (the engine never calls a node
 * whose outputs all lack a gradient). Set grad_inputs[i] (pre-filled with NULL) for
 * each input that needs one (anneal_node_input_needs_grad); tensors made here belong
 * to a scope the engine closes after accumulating them. Runs with grad mode off. */
typedef anneal_status (*anneal_backward_fn)(anneal_node *node, anneal_tensor *const *grad_outputs,
                                            anneal_tensor **grad_inputs);

/* One input of a node: where its gradient goes. */
typedef struct anneal_edge {
    anneal_node *fn;        /* node that produced the input, or NULL */
    int output;             /* which output of fn */
    anneal_tensor *leaf;    /* the input itself when it is a leaf requiring grad (retained) */
    bool needs_grad;
    int ndim;               /* shape the gradient must have */
    int64_t shape[ANNEAL_MAX_DIMS];
} anneal_edge;

struct anneal_node {
    const char *name;               /* op name, for errors and the profiler */
    anneal_backward_fn backward;
    int refcount;
    uint64_t seq;                   /* creation order: reverse order is a topological order */
    bool released;                  /* saved tensors already freed by a backward */
    int n_inputs, n_outputs;
    anneal_edge *inputs;
    anneal_tensor **grad_buf;       /* per output, gradients accumulated during backward */
    int n_saved;
    anneal_tensor *saved[ANNEAL_NODE_MAX_SAVED]; /* detached aliases (no cycles through grad_fn) */
    double scalars[8];              /* op parameters (eps, p, scale, ...) */
    int64_t ints[8];
    void *ctx;                      /* extra op state, freed with ctx_free */
    void (*ctx_free)(void *ctx);
    int n_extra_leaves;             /* leaves reached inside a recompute region */
    anneal_tensor **extra_leaves;
    uint64_t visit;                 /* engine bookkeeping */
};

/* ------------------------------------------------------------- grad mode */

/* True when ops record nodes (not inside a no-grad scope). */
bool anneal_grad_enabled(void);
/* No-grad scope: ops inside it record nothing. Nests. */
void anneal_no_grad_begin(void);
void anneal_no_grad_end(void);

/* True when grad mode is on and some of the n inputs requires grad. */
bool anneal_any_requires_grad(int n, anneal_tensor *const *inputs);

/* ----------------------------------------------------- recording (for ops) */

/* Records a node named `name` for outputs computed from inputs when
 * anneal_any_requires_grad(inputs); returns NULL (and records nothing) otherwise, or
 * on allocation failure (with the error set). Outputs get requires_grad and grad_fn. */
anneal_node *anneal_record(const char *name, anneal_backward_fn fn, int n_in,
                           anneal_tensor *const *inputs, int n_out, anneal_tensor *const *outputs);
/* Saves a detached alias of t for backward; returns its index or -1 on error. */
int anneal_node_save(anneal_node *node, const anneal_tensor *t);
/* True when input i of the node wants a gradient. */
bool anneal_node_input_needs_grad(const anneal_node *node, int i);
void anneal_node_retain(anneal_node *node);
void anneal_node_release(anneal_node *node);

/* --------------------------------------------------------------- backward */

/* Backpropagates from a scalar: d(loss)/d(loss) = 1. Accumulates into the .grad of
 * every leaf that requires grad and frees the graph's saved tensors (a second
 * backward through the same graph fails with ANNEAL_ERR_STATE). */
anneal_status anneal_backward(anneal_tensor *loss);
/* Backpropagates from any tensor given its gradient (same shape). */
anneal_status anneal_backward_grad(anneal_tensor *out, anneal_tensor *grad);

/* Called once per leaf during backward, right after its last gradient
 * contribution of that backward has been accumulated into leaf->grad. */
typedef void (*anneal_grad_ready_fn)(anneal_tensor *leaf, void *user);
/* Installs the hook for this thread (NULL removes it). */
void anneal_set_grad_ready_hook(anneal_grad_ready_fn fn, void *user);

/* Drops t's accumulated gradient (like PyTorch's zero_grad(set_to_none=True)). */
void anneal_grad_clear(anneal_tensor *t);

/* ---------------------------------------------------- saved-tensor hooks */

/* Like PyTorch's torch.autograd.graph.saved_tensors_hooks: pack sees every tensor a
 * node saves outside backward and outside a recompute region's forward (the detached
 * alias the node holds; pack may retain it); before a node's backward runs, unpack is
 * asked for each of its saved tensors and may set *use to a tensor to read instead
 * (a reference handed to the node, released after its backward; same shape, strides
 * and values). An unpack error fails that backward. */
typedef void (*anneal_saved_pack_fn)(anneal_tensor *saved, void *user);
typedef anneal_status (*anneal_saved_unpack_fn)(anneal_tensor *saved, anneal_tensor **use, void *user);
/* Installs the pair for this thread (NULL, NULL: saved tensors are kept as they are). */
void anneal_set_saved_tensor_hooks(anneal_saved_pack_fn pack, anneal_saved_unpack_fn unpack, void *user);

/* Activation offload to the memory tier below (CPU runs; src/autograd/saved_offload.c):
 * saved activations of at least min_bytes are written, a few nodes after they were
 * saved, to an unlinked file in dir, and their storages evicted (live bytes drop; the
 * storage reads from the file's mapping meanwhile); a node's backward gets a copy read
 * back from the file, the next nodes' ranges read ahead. Values are untouched: losses
 * and gradients are bit-identical. The file space is reused once the tensors are gone. */
typedef struct anneal_act_offload anneal_act_offload;
typedef struct anneal_act_offload_stats {
    int64_t evicted_bytes;   /* bytes written to the file since creation */
    int64_t restored_bytes;  /* bytes read back for backward since creation */
    int64_t n_evicted, n_restored;
    int64_t prefetched_bytes; /* file bytes announced for read-ahead (WILLNEED) */
    int64_t hook_ns;          /* this thread's CPU time inside pack and unpack (writes, reads) */
    int64_t file_bytes;      /* the file's size now (its largest use so far) */
    int64_t resident_bytes;  /* activation bytes saved for backward still in memory when the
                                last backward began */
} anneal_act_offload_stats;
/* A file in dir (must exist and be writable; ANNEAL_ERR_IO otherwise). min_bytes <= 0:
 * 64 KiB. Not installed yet. */
anneal_act_offload *anneal_act_offload_new(const char *dir, int64_t min_bytes);
/* Installs (or, on NULL, removes) o's hooks on this thread. */
void anneal_act_offload_install(anneal_act_offload *o);
anneal_act_offload_stats anneal_act_offload_stats_get(const anneal_act_offload *o);
/* Uninstalls, brings back into memory any evicted storage still alive, closes the
 * file (already unlinked). */
void anneal_act_offload_free(anneal_act_offload *o);

/* ------------------------------------------------- recompute regions */

/* A region computes one tensor from its inputs using public ops. */
typedef anneal_tensor *(*anneal_region_fn)(void *ctx, anneal_tensor *const *inputs);

/* Activation checkpoint: runs fn(ctx, inputs) and keeps only its inputs and output;
 * its inner activations are freed right away and recomputed during backward, with
 * the RNG replayed so dropout masks are identical. Without grad it is a plain call.
 * ctx must stay valid until backward. */
anneal_tensor *anneal_checkpoint(anneal_region_fn fn, void *ctx, int n_in,
                                 anneal_tensor *const *inputs);

#ifdef __cplusplus
}
#endif
#endif
