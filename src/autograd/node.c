/* Tape nodes: recording an op's backward function, its input edges and the
 * tensors it saves; reference counting that frees the graph when the last tensor
 * produced by it goes away. Grad mode (no-grad scopes) lives here too. */
#include "anneal/autograd.h"
#include "autograd_internal.h"

#include <stdlib.h>
#include <string.h>

static _Thread_local int g_no_grad_depth;
static _Thread_local anneal_saved_pack_fn g_pack;
static _Thread_local anneal_saved_unpack_fn g_unpack;
static _Thread_local void *g_saved_user;
static _Thread_local int g_saved_paused;
static uint64_t g_next_seq = 1;

bool anneal_grad_enabled(void) { return g_no_grad_depth == 0; }
void anneal_no_grad_begin(void) { g_no_grad_depth++; }
void anneal_no_grad_end(void) {
    if (g_no_grad_depth > 0) g_no_grad_depth--;
}

bool anneal_any_requires_grad(int n, anneal_tensor *const *inputs) {
    if (!anneal_grad_enabled()) return false;
    for (int i = 0; i < n; i++)
        if (inputs[i] && inputs[i]->requires_grad) return true;
    return false;
}

static void node_free(anneal_node *node) {
    for (int i = 0; i < node->n_inputs; i++) {
        if (node->inputs[i].fn) anneal_node_release(node->inputs[i].fn);
        if (node->inputs[i].leaf) anneal_release(node->inputs[i].leaf);
    }
    for (int i = 0; i < node->n_saved; i++) anneal_release(node->saved[i]);
    for (int i = 0; i < node->n_outputs; i++) anneal_release(node->grad_buf[i]);
    for (int i = 0; i < node->n_extra_leaves; i++) anneal_release(node->extra_leaves[i]);
    if (node->ctx_free) node->ctx_free(node->ctx);
    anneal_pool_free(node->extra_leaves); /* from the pool (checkpoint.c) */
    anneal_pool_free(node->grad_buf);
    anneal_pool_free(node->inputs);
    anneal_pool_free(node);
}

void anneal_node_retain(anneal_node *node) {
    if (node) node->refcount++;
}

/* Frees the node when its last reference goes, releasing its inputs (recursively). */
void anneal_node_release(anneal_node *node) {
    if (!node || --node->refcount > 0) return;
    node_free(node);
}

static void release_hook(struct anneal_node *n) { anneal_node_release(n); }

anneal_node *anneal_record(const char *name, anneal_backward_fn fn, int n_in,
                           anneal_tensor *const *inputs, int n_out, anneal_tensor *const *outputs) {
    if (!anneal_any_requires_grad(n_in, inputs)) return NULL;
    anneal_set_node_release_hook(release_hook);
    /* From the small-object pool: a steady-state step reuses last step's nodes. */
    anneal_node *node = anneal_pool_alloc(sizeof *node);
    anneal_edge *edges = anneal_pool_calloc((size_t)(n_in ? n_in : 1), sizeof *edges);
    anneal_tensor **bufs = anneal_pool_calloc((size_t)(n_out ? n_out : 1), sizeof *bufs);
    if (!node || !edges || !bufs) {
        anneal_pool_free(node);
        anneal_pool_free(edges);
        anneal_pool_free(bufs);
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory recording %s", name);
        return NULL;
    }
    node->name = name;
    node->backward = fn;
    node->refcount = 0;
    node->seq = g_next_seq++;
    node->n_inputs = n_in;
    node->n_outputs = n_out;
    node->inputs = edges;
    node->grad_buf = bufs;
    for (int i = 0; i < n_in; i++) {
        anneal_tensor *t = inputs[i];
        if (!t || !t->requires_grad) continue;
        edges[i].needs_grad = true;
        edges[i].ndim = t->ndim;
        memcpy(edges[i].shape, t->shape, sizeof t->shape);
        if (t->grad_fn) {
            edges[i].fn = t->grad_fn;
            edges[i].output = t->grad_fn_output;
            anneal_node_retain(t->grad_fn);
        } else {
            edges[i].leaf = anneal_retain(t);
        }
    }
    for (int i = 0; i < n_out; i++) {
        anneal_tensor *o = outputs[i];
        if (!o) continue;
        o->requires_grad = true;
        o->grad_fn = node;
        o->grad_fn_output = i;
        anneal_node_retain(node);
    }
    return node;
}

int anneal_node_save(anneal_node *node, const anneal_tensor *t) {
    if (!node || !t) return -1;
    if (node->n_saved >= ANNEAL_NODE_MAX_SAVED) {
        anneal_set_error(ANNEAL_ERR_STATE, "%s saves more than %d tensors", node->name,
                         ANNEAL_NODE_MAX_SAVED);
        return -1;
    }
    /* A detached alias: owned by the node, not by any scope, no grad_fn (no cycles). */
    anneal_scope_enter(NULL);
    anneal_tensor *a = anneal_detach(t);
    anneal_scope_leave();
    if (!a) return -1;
    node->saved[node->n_saved] = a;
    if (g_pack && !g_saved_paused) g_pack(a, g_saved_user);
    return node->n_saved++;
}

void anneal_set_saved_tensor_hooks(anneal_saved_pack_fn pack, anneal_saved_unpack_fn unpack, void *user) {
    g_pack = pack;
    g_unpack = unpack;
    g_saved_user = user;
}

void anneal_saved_hooks_pause(bool pause) {
    g_saved_paused += pause ? 1 : (g_saved_paused > 0 ? -1 : 0);
}

anneal_status anneal_saved_unpack_all(anneal_node *node) {
    for (int i = 0; g_unpack && i < node->n_saved; i++) {
        anneal_tensor *use = NULL;
        anneal_status s = g_unpack(node->saved[i], &use, g_saved_user);
        if (s != ANNEAL_OK) return s;
        if (use) {
            anneal_release(node->saved[i]);
            node->saved[i] = use;
        }
    }
    return ANNEAL_OK;
}

bool anneal_node_input_needs_grad(const anneal_node *node, int i) {
    return node && i >= 0 && i < node->n_inputs && node->inputs[i].needs_grad;
}
