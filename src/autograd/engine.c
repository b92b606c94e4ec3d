/* The backward engine: walks the nodes reachable from a root in reverse creation
 * order (a topological order of a define-by-run graph), calls each node's backward
 * function, accumulates input gradients into producer nodes' buffers or into leaf
 * .grad, fires grad-ready hooks, and frees saved tensors as it goes. */
#include "anneal/autograd.h"
#include "anneal/backend.h"
#include "anneal/trace.h"
#include "autograd_internal.h"

#include <stdlib.h>
#include <string.h>

static _Thread_local anneal_grad_ready_fn g_hook;
static _Thread_local void *g_hook_user;
static _Thread_local int g_nested; /* > 0 inside a recompute region's inner backward */
static uint64_t g_visit_epoch;

void anneal_set_grad_ready_hook(anneal_grad_ready_fn fn, void *user) {
    g_hook = fn;
    g_hook_user = user;
}

void anneal_grad_clear(anneal_tensor *t) {
    if (t && t->grad) {
        anneal_release(t->grad);
        t->grad = NULL;
    }
}

typedef struct {
    anneal_node **items;
    int64_t n, cap;
} node_list;

static bool list_push(node_list *l, anneal_node *n) {
    if (l->n == l->cap) {
        int64_t cap = l->cap ? l->cap * 2 : 256;
        anneal_node **it = realloc(l->items, (size_t)cap * sizeof *it);
        if (!it) return false;
        l->items = it;
        l->cap = cap;
    }
    l->items[l->n++] = n;
    return true;
}

/* Sorts nodes by seq, newest first, in place (heapsort: no allocation, unlike qsort,
 * which may malloc a scratch buffer). Seqs are unique, so the order is total. */
static void sift_down(anneal_node **a, int64_t i, int64_t n) {
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && a[c + 1]->seq < a[c]->seq) c++; /* min-heap: smallest seq at the top */
        if (a[i]->seq <= a[c]->seq) return;
        anneal_node *t = a[i];
        a[i] = a[c];
        a[c] = t;
        i = c;
    }
}

static void sort_by_seq_desc(anneal_node **a, int64_t n) {
    for (int64_t i = n / 2 - 1; i >= 0; i--) sift_down(a, i, n);
    for (int64_t end = n - 1; end > 0; end--) { /* move the smallest to the back */
        anneal_node *t = a[0];
        a[0] = a[end];
        a[end] = t;
        sift_down(a, 0, end);
    }
}

/* Collects every node reachable from root (iterative DFS) into out, using stack
 * as the work list; both keep their capacity for the next backward. */
static bool collect(anneal_node *root, node_list *out, node_list *stack) {
    uint64_t epoch = ++g_visit_epoch;
    stack->n = 0;
    out->n = 0;
    bool ok = list_push(stack, root);
    root->visit = epoch;
    while (ok && stack->n) {
        anneal_node *n = stack->items[--stack->n];
        ok = list_push(out, n);
        for (int i = 0; ok && i < n->n_inputs; i++) {
            anneal_node *p = n->inputs[i].fn;
            if (p && p->visit != epoch) {
                p->visit = epoch;
                ok = list_push(stack, p);
            }
        }
    }
    if (!ok) anneal_set_error(ANNEAL_ERR_OOM, "out of memory walking the autograd graph");
    return ok;
}

/* Work lists kept between backward calls, one pair per nesting depth (a recompute
 * region's replay runs a backward inside a backward), so a steady-state step
 * allocates none; deeper nesting uses lists of its own. */
#define MAX_NEST 8
static _Thread_local node_list g_order[MAX_NEST], g_work[MAX_NEST];
static _Thread_local int g_depth;

/* acc = acc + g for a node buffer (new tensor; acc and g may alias other grads). */
static anneal_tensor *add_grads(anneal_tensor *acc, anneal_tensor *g) {
    const anneal_backend *be = anneal_backend_get(acc->device);
    if (!be) return NULL;
    anneal_scope_enter(NULL);
    anneal_tensor *sum = anneal_empty_on(acc->device, acc->dtype, acc->ndim, acc->shape);
    anneal_scope_leave();
    if (!sum) return NULL;
    if (be->binary(be->ctx, ANNEAL_ADD, sum, acc, g) != ANNEAL_OK) {
        anneal_release(sum);
        return NULL;
    }
    return sum;
}

/* leaf->grad += g, allocating a zero-initialised owned buffer on first use. */
static anneal_status accumulate_leaf(anneal_tensor *leaf, anneal_tensor *g) {
    const anneal_backend *be = anneal_backend_get(leaf->device);
    if (!be) return anneal_last_status();
    if (!leaf->grad) {
        anneal_scope_enter(NULL);
        anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_GRADIENTS);
        anneal_tensor *buf = anneal_empty_on(leaf->device, leaf->dtype, leaf->ndim, leaf->shape);
        anneal_memory_category_set(mc);
        anneal_scope_leave();
        if (!buf) return anneal_last_status();
        anneal_status s = be->copy(be->ctx, buf, g);
        if (s != ANNEAL_OK) {
            anneal_release(buf);
            return s;
        }
        leaf->grad = buf;
        return ANNEAL_OK;
    }
    if (leaf->grad->dtype != ANNEAL_F32 || g->dtype != ANNEAL_F32) {
        /* Mixed dtypes: convert g first. */
        anneal_scope_enter(NULL);
        anneal_tensor *c = anneal_empty_on(leaf->device, leaf->grad->dtype, g->ndim, g->shape);
        anneal_scope_leave();
        if (!c) return anneal_last_status();
        anneal_status s = be->copy(be->ctx, c, g);
        if (s == ANNEAL_OK) s = be->binary(be->ctx, ANNEAL_ADD, leaf->grad, leaf->grad, c);
        anneal_release(c);
        return s;
    }
    return be->binary(be->ctx, ANNEAL_ADD, leaf->grad, leaf->grad, g);
}

/* Counts down a leaf's expected contributions (outermost backward only: a nested
 * replay must not disturb the outer counts) and fires the ready hook at zero. */
static void leaf_done(anneal_tensor *leaf) {
    if (g_nested > 0) return;
    if (--leaf->_pending == 0 && g_hook) g_hook(leaf, g_hook_user);
}

static bool shape_matches(const anneal_edge *e, const anneal_tensor *g) {
    if (g->ndim != e->ndim) return false;
    for (int i = 0; i < e->ndim; i++)
        if (g->shape[i] != e->shape[i]) return false;
    return true;
}

/* Runs one node: its backward function, then accumulation of each input grad. */
static anneal_status run_node(anneal_node *node) {
    bool any = false;
    for (int i = 0; i < node->n_outputs; i++) any |= node->grad_buf[i] != NULL;
    anneal_status s = ANNEAL_OK;
    anneal_tensor *small[8] = {0};
    anneal_tensor **gin = node->n_inputs <= 8 ? small : calloc((size_t)node->n_inputs, sizeof *gin);
    if (!gin) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory in backward of %s", node->name);
    anneal_scope *tmp = NULL;
    if (any) {
        if (node->released)
            s = anneal_set_error(ANNEAL_ERR_STATE,
                                 "backward through %s a second time: its saved tensors were freed "
                                 "by the first backward", node->name);
        tmp = anneal_scope_open();
        if (!tmp) s = anneal_last_status();
        if (s == ANNEAL_OK) s = anneal_saved_unpack_all(node); /* saved-tensor hooks (node.c) */
        if (s == ANNEAL_OK) {
            anneal_no_grad_begin();
            int64_t span_t0 = anneal_span_begin(); /* the node's op spans nest inside */
            s = node->backward(node, node->grad_buf, gin);
            anneal_span_end(ANNEAL_SPAN_AUTOGRAD, node->name, span_t0, 0, 0);
            anneal_no_grad_end();
            if (s == ANNEAL_OK && anneal_last_status() != ANNEAL_OK) s = anneal_last_status();
        }
    }
    for (int i = 0; i < node->n_inputs; i++) {
        anneal_edge *e = &node->inputs[i];
        anneal_tensor *g = gin[i];
        if (s == ANNEAL_OK && e->needs_grad && g) {
            if (!shape_matches(e, g)) {
                char buf[128];
                s = anneal_set_error(ANNEAL_ERR_SHAPE, "backward of %s gave input %d a gradient of shape %s",
                                     node->name, i, anneal_shape_str(g, buf, sizeof buf));
            } else if (e->fn) {
                anneal_tensor **slot = &e->fn->grad_buf[e->output];
                if (!*slot) {
                    *slot = anneal_retain(g);
                } else {
                    anneal_tensor *sum = add_grads(*slot, g);
                    if (!sum) s = anneal_last_status();
                    else {
                        anneal_release(*slot);
                        *slot = sum;
                    }
                }
            } else if (e->leaf) {
                s = accumulate_leaf(e->leaf, g);
            }
        }
        if (e->leaf) leaf_done(e->leaf);
    }
    for (int i = 0; i < node->n_extra_leaves; i++) leaf_done(node->extra_leaves[i]);
    if (tmp) anneal_scope_close(tmp);
    if (gin != small) free(gin);
    /* Free the graph as we go: this node's grads and saved activations are done. */
    for (int i = 0; i < node->n_outputs; i++) {
        anneal_release(node->grad_buf[i]);
        node->grad_buf[i] = NULL;
    }
    if (any) {
        for (int i = 0; i < node->n_saved; i++) {
            anneal_release(node->saved[i]);
            node->saved[i] = NULL;
        }
        node->n_saved = 0;
        node->released = true;
    }
    return s;
}

anneal_status anneal_backward_internal(anneal_tensor *out, anneal_tensor *grad, bool nested) {
    if (!out || !grad) return anneal_set_error(ANNEAL_ERR_ARG, "backward: NULL tensor");
    if (!out->requires_grad)
        return anneal_set_error(ANNEAL_ERR_STATE, "backward on a tensor that does not require grad");
    if (!anneal_same_shape(out, grad)) {
        char a[128], b[128];
        return anneal_set_error(ANNEAL_ERR_SHAPE, "backward: gradient %s for output %s",
                                anneal_shape_str(grad, a, sizeof a), anneal_shape_str(out, b, sizeof b));
    }
    if (!out->grad_fn) { /* a leaf: its gradient is grad itself */
        anneal_status s = accumulate_leaf(out, grad);
        if (s == ANNEAL_OK && !nested && g_hook) g_hook(out, g_hook_user);
        return s;
    }
    node_list own_order = {0}, own_work = {0};
    int depth = g_depth;
    node_list *order = depth < MAX_NEST ? &g_order[depth] : &own_order;
    node_list *work = depth < MAX_NEST ? &g_work[depth] : &own_work;
    if (!collect(out->grad_fn, order, work)) {
        free(own_order.items);
        free(own_work.items);
        return anneal_last_status();
    }
    node_list nodes = *order; /* the walk below only reads the list */
    sort_by_seq_desc(nodes.items, nodes.n);
    g_depth++;
    /* Count each leaf's contributions so the ready hook fires after the last one. */
    for (int64_t k = 0; k < nodes.n && !nested; k++) {
        anneal_node *n = nodes.items[k];
        for (int i = 0; i < n->n_inputs; i++)
            if (n->inputs[i].leaf) n->inputs[i].leaf->_pending = 0;
        for (int i = 0; i < n->n_extra_leaves; i++) n->extra_leaves[i]->_pending = 0;
    }
    for (int64_t k = 0; k < nodes.n && !nested; k++) {
        anneal_node *n = nodes.items[k];
        for (int i = 0; i < n->n_inputs; i++)
            if (n->inputs[i].leaf) n->inputs[i].leaf->_pending++;
        for (int i = 0; i < n->n_extra_leaves; i++) n->extra_leaves[i]->_pending++;
    }
    /* Keep every node alive while we walk, even if a tensor holding it goes away. */
    for (int64_t k = 0; k < nodes.n; k++) anneal_node_retain(nodes.items[k]);
    anneal_node *root = out->grad_fn;
    anneal_tensor **slot = &root->grad_buf[out->grad_fn_output];
    anneal_status s = ANNEAL_OK;
    if (*slot) {
        anneal_tensor *sum = add_grads(*slot, grad);
        if (!sum) s = anneal_last_status();
        else {
            anneal_release(*slot);
            *slot = sum;
        }
    } else {
        *slot = anneal_retain(grad);
    }
    if (nested) g_nested++;
    anneal_trace_backward_enter(); /* op spans from here on count as backward */
    int64_t span_t0 = nested ? 0 : anneal_span_begin();
    anneal_saved_hooks_pause(true); /* a recompute region's replay saves for itself */
    for (int64_t k = 0; k < nodes.n && s == ANNEAL_OK; k++) s = run_node(nodes.items[k]);
    anneal_saved_hooks_pause(false);
    anneal_span_end(ANNEAL_SPAN_AUTOGRAD, "backward", span_t0, 0, 0);
    anneal_trace_backward_leave();
    if (nested) g_nested--;
    for (int64_t k = 0; k < nodes.n; k++) {
        anneal_node *n = nodes.items[k];
        for (int i = 0; i < n->n_outputs; i++) { /* on error, drop pending grads */
            anneal_release(n->grad_buf[i]);
            n->grad_buf[i] = NULL;
        }
        anneal_node_release(n);
    }
    g_depth--;
    order->n = 0;
    free(own_order.items);
    free(own_work.items);
    return s;
}

anneal_status anneal_backward_grad(anneal_tensor *out, anneal_tensor *grad) {
    return anneal_backward_internal(out, grad, false);
}

anneal_status anneal_backward(anneal_tensor *loss) {
    if (!loss) return anneal_set_error(ANNEAL_ERR_ARG, "backward: NULL loss (an earlier op failed: %s)",
                                       anneal_last_error());
    if (anneal_numel(loss) != 1) {
        char b[128];
        return anneal_set_error(ANNEAL_ERR_SHAPE, "backward needs a scalar loss, got shape %s",
                                anneal_shape_str(loss, b, sizeof b));
    }
    anneal_scope_enter(NULL);
    anneal_tensor *one = anneal_empty_on(loss->device, loss->dtype, loss->ndim, loss->shape);
    anneal_scope_leave();
    if (!one) return anneal_last_status();
    const anneal_backend *be = anneal_backend_get(loss->device);
    anneal_status s = be ? be->fill(be->ctx, one, 1.0) : anneal_last_status();
    if (s == ANNEAL_OK) s = anneal_backward_internal(loss, one, false);
    anneal_release(one);
    return s;
}
