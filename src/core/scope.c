/* Scopes: a per-thread stack of tensor owners. A scope holds one reference to
 * each tensor created while it is current and releases them all when closed.
 * Freed scopes keep their item arrays and wait on a free list for reuse, so the
 * many short scopes of a training step (the step's, each backward node's) make
 * no malloc once the first step has sized them. */
#include "core_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

struct anneal_scope {
    anneal_tensor **items; /* creation order; NULL where a tensor left the scope */
    int64_t n, cap, live;
};

#define MAX_DEPTH 256
#define MAX_CACHED 64
static _Thread_local anneal_scope *g_stack[MAX_DEPTH];
static _Thread_local int g_depth;

struct scope_cache {
    pthread_mutex_t lock;
    anneal_scope *items[MAX_CACHED];
    int n;
};
static struct scope_cache g_cache = {.lock = PTHREAD_MUTEX_INITIALIZER};

anneal_scope *anneal_scope_new(void) {
    anneal_scope *s = NULL;
    pthread_mutex_lock(&g_cache.lock);
    if (g_cache.n > 0) s = g_cache.items[--g_cache.n];
    pthread_mutex_unlock(&g_cache.lock);
    if (s) return s; /* n and live are 0, items keeps its capacity */
    s = calloc(1, sizeof *s);
    if (!s) anneal_set_error(ANNEAL_ERR_OOM, "out of memory creating a scope");
    return s;
}

/* Returns an emptied scope to the cache (or frees it when the cache is full). */
static void scope_recycle(anneal_scope *s) {
    s->n = 0;
    s->live = 0;
    pthread_mutex_lock(&g_cache.lock);
    if (g_cache.n < MAX_CACHED) {
        g_cache.items[g_cache.n++] = s;
        s = NULL;
    }
    pthread_mutex_unlock(&g_cache.lock);
    if (s) {
        free(s->items);
        free(s);
    }
}

void anneal_scope_release_cache(void) {
    pthread_mutex_lock(&g_cache.lock);
    while (g_cache.n > 0) {
        anneal_scope *s = g_cache.items[--g_cache.n];
        free(s->items);
        free(s);
    }
    pthread_mutex_unlock(&g_cache.lock);
}

void anneal_scope_enter(anneal_scope *s) {
    if (g_depth >= MAX_DEPTH) {
        /* Internal invariant: scopes nest shallowly; deeper nesting is a bug. */
        fprintf(stderr, "anneal: scope stack overflow (depth %d)\n", g_depth);
        abort();
    }
    g_stack[g_depth++] = s;
}

void anneal_scope_leave(void) {
    if (g_depth > 0) g_depth--;
}

anneal_scope *anneal_scope_current(void) { return g_depth > 0 ? g_stack[g_depth - 1] : NULL; }

anneal_scope *anneal_scope_open(void) {
    anneal_scope *s = anneal_scope_new();
    if (s) anneal_scope_enter(s);
    return s;
}

void anneal_scope_free(anneal_scope *s) {
    if (!s) return;
    /* Release in reverse creation order: later tensors may view earlier ones. */
    for (int64_t i = s->n - 1; i >= 0; i--) {
        anneal_tensor *t = s->items[i];
        if (!t) continue;
        s->items[i] = NULL;
        t->_scope = NULL;
        anneal_release(t);
    }
    scope_recycle(s);
}

void anneal_scope_close(anneal_scope *s) {
    if (!s) return;
    if (anneal_scope_current() == s && g_depth > 0) g_depth--;
    else {
        /* Not on top: remove it from wherever it sits so the stack stays valid. */
        for (int i = g_depth - 1; i >= 0; i--)
            if (g_stack[i] == s) {
                for (int j = i; j < g_depth - 1; j++) g_stack[j] = g_stack[j + 1];
                g_depth--;
                break;
            }
    }
    anneal_scope_free(s);
}

static bool scope_push(anneal_scope *s, anneal_tensor *t) {
    if (s->n == s->cap) {
        int64_t cap = s->cap ? s->cap * 2 : 64;
        anneal_tensor **it = realloc(s->items, (size_t)cap * sizeof *it);
        if (!it) return false;
        s->items = it;
        s->cap = cap;
    }
    t->_scope = s;
    t->_scope_slot = s->n;
    s->items[s->n++] = t;
    s->live++;
    return true;
}

void anneal_scope_register(anneal_tensor *t) {
    anneal_scope *s = anneal_scope_current();
    if (!s || !t) return;
    if (!scope_push(s, t)) {
        /* Could not record ownership: the caller gets the reference instead. */
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory registering a tensor in its scope");
    }
}

void anneal_scope_forget(anneal_tensor *t) {
    anneal_scope *s = t->_scope;
    if (!s) return;
    if (t->_scope_slot < s->n && s->items[t->_scope_slot] == t) {
        s->items[t->_scope_slot] = NULL;
        s->live--;
    }
    t->_scope = NULL;
}

anneal_tensor *anneal_keep(anneal_tensor *t, anneal_scope *dst) {
    if (!t) return NULL;
    if (t->_scope == dst) return t;
    anneal_scope_forget(t);
    if (dst && !scope_push(dst, t)) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory moving a tensor between scopes");
        return NULL;
    }
    return t;
}

anneal_tensor *anneal_scope_adopt(anneal_tensor *t) { return anneal_keep(t, anneal_scope_current()); }

int64_t anneal_scope_count(const anneal_scope *s) { return s ? s->live : 0; }
