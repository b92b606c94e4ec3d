/* The small-object pool: tensor headers, storage records, scopes, tape nodes and
 * their per-node arrays, op contexts. Freed objects go to a free list of their size
 * class and are handed out again (zero-filled), so a steady-state training step
 * makes no malloc for its bookkeeping. Each object carries a 16-byte header with its
 * class; objects over the largest class go straight to malloc/free. */
#include "core_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>


/* Classes: 16-byte steps up to 1 KiB (64 classes), then powers of two up to 1 MiB. */
#define N_FINE 64
#define N_CLASSES (N_FINE + 10)
#define HUGE_CLASS 0xffffu
#define HEADER 16

typedef struct pool_header {
    union {
        struct pool_header *next; /* while free */
        uint32_t cls;             /* while in use */
    } u;
    uint32_t cls_copy; /* the class, kept while free too */
    uint32_t magic;
} pool_header;
_Static_assert(sizeof(pool_header) <= HEADER, "pool header must fit 16 bytes");

#define MAGIC_LIVE 0x616e6e6cu /* "annl" */
#define MAGIC_FREE 0x66726565u /* "free" */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pool_header *g_free[N_CLASSES];
static int64_t g_system; /* objects that came from malloc */

static size_t class_bytes(int c) {
    return c < N_FINE ? (size_t)(c + 1) * 16 : (size_t)2048 << (c - N_FINE);
}

static int class_of(size_t n) {
    if (n <= (size_t)N_FINE * 16) return n ? (int)((n + 15) / 16) - 1 : 0;
    for (int c = N_FINE; c < N_CLASSES; c++)
        if (n <= class_bytes(c)) return c;
    return -1;
}

void *anneal_pool_alloc(size_t n) {
    int c = class_of(n);
    pool_header *h = NULL;
    if (c >= 0) {
        pthread_mutex_lock(&g_lock);
        h = g_free[c];
        if (h) {
            UNPOISON(h, HEADER + class_bytes(c));
            g_free[c] = h->u.next;
        } else {
            g_system++;
        }
        pthread_mutex_unlock(&g_lock);
        if (!h) h = malloc(HEADER + class_bytes(c));
        if (!h) return NULL;
        memset((char *)h + HEADER, 0, n);
    } else {
        h = calloc(1, HEADER + n);
        if (!h) return NULL;
        pthread_mutex_lock(&g_lock);
        g_system++;
        pthread_mutex_unlock(&g_lock);
    }
    h->u.cls = c >= 0 ? (uint32_t)c : HUGE_CLASS;
    h->cls_copy = h->u.cls;
    h->magic = MAGIC_LIVE;
    return (char *)h + HEADER;
}

void *anneal_pool_calloc(size_t count, size_t size) {
    if (size && count > SIZE_MAX / size) return NULL;
    return anneal_pool_alloc(count * size);
}

void anneal_pool_free(void *p) {
    if (!p) return;
    pool_header *h = (pool_header *)((char *)p - HEADER);
    if (h->magic != MAGIC_LIVE) abort(); /* internal invariant: double free or foreign pointer */
    uint32_t c = h->cls_copy;
    h->magic = MAGIC_FREE;
    if (c == HUGE_CLASS) {
        free(h);
        return;
    }
    pthread_mutex_lock(&g_lock);
    h->u.next = g_free[c];
    g_free[c] = h;
    POISON((char *)h + HEADER, class_bytes((int)c));
    pthread_mutex_unlock(&g_lock);
}

int64_t anneal_pool_system_allocs(void) {
    pthread_mutex_lock(&g_lock);
    int64_t n = g_system;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int64_t anneal_pool_release(void) {
    int64_t freed = 0;
    pthread_mutex_lock(&g_lock);
    for (int c = 0; c < N_CLASSES; c++) {
        while (g_free[c]) {
            pool_header *h = g_free[c];
            UNPOISON(h, HEADER + class_bytes(c));
            g_free[c] = h->u.next;
            freed += (int64_t)(HEADER + class_bytes(c));
            free(h);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return freed;
}
