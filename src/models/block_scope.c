/* Each transformer block's forward in a scope of its own (issue 17): the tensors a block
 * makes belong to the step's scope otherwise, so an intermediate that no backward node
 * saved (the attention projection's output before the residual add, the MLP's output)
 * stayed allocated until the step ended. In its own scope it is freed when the block
 * returns; what backward needs lives on in the nodes' saved aliases, and the block's
 * output moves to the caller's scope. Lifetimes change, arithmetic does not: losses and
 * gradients keep every bit. */
#include "models_internal.h"

static bool g_block_scopes = true; /* test switch: false runs blocks in the caller's scope */

void anneal_model_block_scopes_set(bool on) { g_block_scopes = on; }

anneal_tensor *anneal_model_scoped_block(anneal_model_block_fn fn, const void *block, anneal_tensor *x,
                                         anneal_kv_cache *kv) {
    if (!g_block_scopes) return fn(block, x, kv);
    anneal_scope *outer = anneal_scope_current();
    anneal_scope *s = anneal_scope_open();
    if (!s) return NULL;
    anneal_tensor *y = fn(block, x, kv);
    if (y) y = anneal_keep(y, outer); /* outer NULL (caller-owned mode): the caller gets y */
    anneal_scope_close(s);
    return y;
}
