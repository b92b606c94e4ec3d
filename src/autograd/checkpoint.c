/* Recompute regions (activation checkpointing). Forward runs the region once,
 * notes which trainable leaves it touches, and keeps only its inputs and output;
 * backward replays the region with the saved RNG state (same dropout masks) and
 * backpropagates through the replay with a nested engine call. */
#include "anneal/autograd.h"
#include "autograd_internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    anneal_region_fn fn;
    void *user;
    anneal_rng_state rng; /* generator state when the region started */
    int n_in;
} region_ctx;

/* Grow-only scratch arrays kept by this thread between calls, so a steady-state
 * step's recompute regions allocate nothing once the first step has sized them. */
typedef struct {
    void **items;
    int n, cap;
} scratch;
static _Thread_local scratch g_stack, g_seen, g_found;

static bool scratch_push(scratch *a, void *v) {
    if (a->n == a->cap) {
        int cap = a->cap ? a->cap * 2 : 64;
        void **p = realloc(a->items, (size_t)cap * sizeof *p);
        if (!p) return false;
        a->items = p;
        a->cap = cap;
    }
    a->items[a->n++] = v;
    return true;
}

static bool scratch_has(const scratch *a, const void *v) {
    for (int i = 0; i < a->n; i++)
        if (a->items[i] == v) return true;
    return false;
}

/* Leaves reachable from out's graph, excluding the region's own input aliases: a
 * pool-allocated array of retained tensors (the node's extra_leaves). */
static anneal_status region_leaves(anneal_tensor *out, int n_in, anneal_tensor *const *aliases,
                                   anneal_tensor ***leaves, int *n_leaves) {
    *leaves = NULL;
    *n_leaves = 0;
    if (!out->grad_fn) return ANNEAL_OK;
    g_stack.n = g_seen.n = g_found.n = 0;
    bool ok = scratch_push(&g_stack, out->grad_fn) && scratch_push(&g_seen, out->grad_fn);
    while (ok && g_stack.n) {
        anneal_node *n = g_stack.items[--g_stack.n];
        for (int i = 0; ok && i < n->n_inputs; i++) {
            anneal_edge *e = &n->inputs[i];
            if (e->fn) {
                if (!scratch_has(&g_seen, e->fn)) ok = scratch_push(&g_seen, e->fn) && scratch_push(&g_stack, e->fn);
            } else if (e->leaf) {
                bool skip = scratch_has(&g_found, e->leaf);
                for (int j = 0; j < n_in && !skip; j++) skip = aliases[j] == e->leaf;
                if (!skip) ok = scratch_push(&g_found, e->leaf);
            }
        }
    }
    anneal_tensor **found = NULL;
    if (ok && g_found.n) {
        found = anneal_pool_calloc((size_t)g_found.n, sizeof *found);
        ok = found != NULL;
    }
    if (!ok) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory in checkpoint");
    for (int i = 0; i < g_found.n; i++) found[i] = anneal_retain(g_found.items[i]);
    *leaves = found;
    *n_leaves = g_found.n;
    return ANNEAL_OK;
}

static anneal_status region_backward(anneal_node *node, anneal_tensor *const *grad_out,
                                     anneal_tensor **grad_in) {
    region_ctx *rc = node->ctx;
    anneal_rng_state now = anneal_rng_get();
    anneal_rng_set(rc->rng);
    anneal_scope *inner = anneal_scope_open();
    if (!inner) return anneal_last_status();
    anneal_tensor *xs[64];
    anneal_status s = ANNEAL_OK;
    for (int i = 0; i < rc->n_in; i++) {
        xs[i] = anneal_detach(node->saved[i]);
        if (xs[i] && anneal_node_input_needs_grad(node, i)) anneal_set_requires_grad(xs[i], true);
    }
    /* Replay with grad on; the engine runs backward functions with grad off. */
    anneal_tensor *out = NULL;
    int depth = 0;
    while (!anneal_grad_enabled()) { anneal_no_grad_end(); depth++; }
    out = rc->fn(rc->user, xs);
    for (int i = 0; i < depth; i++) anneal_no_grad_begin();
    anneal_rng_set(now);
    if (!out) s = anneal_last_status() != ANNEAL_OK ? anneal_last_status()
                  : anneal_set_error(ANNEAL_ERR_STATE, "recompute region returned NULL");
    if (s == ANNEAL_OK && out->requires_grad) s = anneal_backward_internal(out, grad_out[0], true);
    if (s == ANNEAL_OK) {
        anneal_scope *outer = NULL;
        anneal_scope_leave();
        outer = anneal_scope_current();
        anneal_scope_enter(inner);
        for (int i = 0; i < rc->n_in; i++) {
            if (xs[i] && xs[i]->grad) {
                /* xs[i] owns its grad; the engine's scope gets a second reference */
                grad_in[i] = anneal_keep(anneal_retain(xs[i]->grad), outer);
            }
        }
    }
    anneal_scope_close(inner);
    return s;
}

anneal_tensor *anneal_checkpoint(anneal_region_fn fn, void *user, int n_in,
                                 anneal_tensor *const *inputs) {
    for (int i = 0; i < n_in; i++)
        if (!inputs[i]) return NULL;
    if (!fn || n_in < 0 || n_in > 64) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_checkpoint: bad region (fn %p, %d inputs)",
                         (void *)(uintptr_t)fn, n_in);
        return NULL;
    }
    if (!anneal_any_requires_grad(n_in, inputs)) return fn(user, inputs);
    region_ctx *rc = anneal_pool_alloc(sizeof *rc); /* pooled: reused by the next step */
    if (!rc) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory in checkpoint");
        return NULL;
    }
    rc->fn = fn;
    rc->user = user;
    rc->rng = anneal_rng_get();
    rc->n_in = n_in;
    anneal_scope *outer = anneal_scope_current();
    anneal_scope *inner = anneal_scope_open();
    anneal_tensor *xs[64];
    for (int i = 0; i < n_in; i++) {
        xs[i] = anneal_detach(inputs[i]);
        if (xs[i] && inputs[i]->requires_grad) anneal_set_requires_grad(xs[i], true);
    }
    anneal_saved_hooks_pause(true); /* the inner saves die with the region */
    anneal_tensor *out = fn(user, xs);
    anneal_saved_hooks_pause(false);
    anneal_tensor **leaves = NULL;
    int n_leaves = 0;
    anneal_tensor *result = NULL;
    if (out && region_leaves(out, n_in, xs, &leaves, &n_leaves) == ANNEAL_OK) {
        anneal_scope_leave();
        anneal_scope_enter(outer);
        result = anneal_detach(out); /* shares the output storage, drops the inner graph */
        anneal_scope_leave();
        anneal_scope_enter(inner);
    }
    anneal_scope_close(inner); /* frees every inner activation */
    if (!result) {
        for (int i = 0; i < n_leaves; i++) anneal_release(leaves[i]);
        anneal_pool_free(leaves);
        anneal_pool_free(rc);
        return NULL;
    }
    anneal_node *node = anneal_record("checkpoint", region_backward, n_in, inputs, 1, &result);
    if (!node) {
        for (int i = 0; i < n_leaves; i++) anneal_release(leaves[i]);
        anneal_pool_free(leaves);
        anneal_pool_free(rc);
        return NULL;
    }
    node->ctx = rc;
    node->ctx_free = anneal_pool_free;
    node->extra_leaves = leaves;
    node->n_extra_leaves = n_leaves;
    for (int i = 0; i < n_in; i++) anneal_node_save(node, inputs[i]);
    return result;
}
