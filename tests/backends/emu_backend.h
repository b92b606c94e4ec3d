/* "emu": a second device for tests, registered from outside the library on
 * ANNEAL_DEVICE_EXT, whose memory the host cannot touch and whose copies behave like an
 * asynchronous device's.
 *
 * - Its memory is host memory from the CPU table, handed out at a tagged address: the
 *   real pointer with bit 62 flipped, a non-canonical x86-64 address, so any host read
 *   or write through anneal_data() of an emu tensor faults at once (under ASan too: the
 *   shadow of a non-canonical address is non-canonical).
 * - Its slots untag what they receive (shallow copies of the tensors and their storage
 *   records pointing at the real memory, marked as the CPU's) and forward to the CPU
 *   table, so every result is the CPU's, bit for bit.
 * - Copies to the host are queued: the host buffer gets a poison pattern (0xFF bytes:
 *   NaN floats, -1 integers) at once and the values at the next synchronize, so host
 *   code reading a result before synchronising sees garbage. Copies from the host are
 *   done at once and the host buffer is checked, at the next synchronize, to still hold
 *   what was copied (emu_stats.host_reuse counts the buffers refilled too early).
 * - A tensor of another device reaching an emu slot, or an untagged address, counts in
 *   emu_stats.foreign. synchronize counts in emu_stats.syncs.
 * Include once per test program. */
#ifndef ANNEAL_TEST_EMU_BACKEND_H
#define ANNEAL_TEST_EMU_BACKEND_H

#include "anneal/anneal.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EMU ANNEAL_DEVICE_EXT
#define EMU_TAG ((uintptr_t)1 << 62)

static struct {
    const anneal_backend *cpu;
    int64_t calls;      /* kernel slots forwarded to the CPU table */
    int64_t syncs;      /* synchronize calls */
    int64_t foreign;    /* tensors of another device or untagged addresses handed to emu */
    int64_t host_reuse; /* host buffers changed between their upload and the synchronize */
} emu_stats;

/* Host copies waiting for the next synchronize: a result to deliver (to_host) or an
 * uploaded buffer to verify, each with its bytes as the device saw them. */
typedef struct emu_pending {
    void *host, *bytes;
    size_t n;
    bool to_host;
} emu_pending;
static struct {
    pthread_mutex_t lock;
    emu_pending *items;
    int n, cap;
} emu_queue = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void *emu_tag(void *p) { return p ? (void *)((uintptr_t)p ^ EMU_TAG) : NULL; }
static void *emu_untag(const void *p) {
    if (!p) return NULL;
    if (!((uintptr_t)p & EMU_TAG)) {
        emu_stats.foreign++;
        return (void *)p;
    }
    return (void *)((uintptr_t)p ^ EMU_TAG);
}

/* The untagged shallow copies made for one slot call (at most EMU_MAX_ARGS tensors; the
 * same tensor twice gives the same copy, so a kernel sees in-place calls as such). */
#define EMU_MAX_ARGS 12
typedef struct emu_args {
    const anneal_tensor *src[EMU_MAX_ARGS];
    anneal_tensor t[EMU_MAX_ARGS];
    anneal_storage s[EMU_MAX_ARGS];
    int n;
} emu_args;

/* x as the CPU table may see it: the same header and storage record, the storage's data
 * untagged, device CPU, no autograd links. Lives until the slot returns (its refcounts
 * are high: a kernel's temporary alias never frees it). */
static anneal_tensor *emu_u(emu_args *a, const anneal_tensor *x) {
    if (!x) return NULL;
    for (int i = 0; i < a->n; i++)
        if (a->src[i] == x) return &a->t[i];
    if (a->n == EMU_MAX_ARGS) abort(); /* a slot with more tensors than this header knows */
    if (x->device != EMU || x->storage->device != EMU) emu_stats.foreign++;
    int i = a->n++;
    a->src[i] = x;
    a->s[i] = *x->storage;
    a->s[i].data = emu_untag(x->storage->data);
    a->s[i].device = ANNEAL_CPU;
    a->s[i].refcount = 1 << 30;
    a->t[i] = *x;
    a->t[i].storage = &a->s[i];
    a->t[i].device = ANNEAL_CPU;
    a->t[i].refcount = 1 << 30;
    a->t[i].grad = NULL;
    a->t[i].grad_fn = NULL;
    a->t[i].name = NULL;
    a->t[i]._scope = NULL;
    return &a->t[i];
}

/* Forwards slot `f` to the CPU table, arguments untagged with U(). */
#define EMU_FWD(f, ...) do { emu_args a_; a_.n = 0; emu_stats.calls++; \
    return emu_stats.cpu->f(emu_stats.cpu->ctx, __VA_ARGS__); } while (0)
#define U(x) emu_u(&a_, (x))
typedef anneal_tensor emu_t;
typedef const anneal_tensor emu_ct;

static void *emu_alloc(void *c, size_t n) { return emu_tag(emu_stats.cpu->alloc(emu_stats.cpu->ctx, n)); }
static void emu_free(void *c, void *p) { emu_stats.cpu->free(emu_stats.cpu->ctx, emu_untag(p)); }
/* Queues host <-> bytes (a copy of src's n bytes) for the next synchronize. */
static anneal_status emu_push(void *host, const void *src, size_t n, bool to_host) {
    void *bytes = malloc(n ? n : 1);
    pthread_mutex_lock(&emu_queue.lock);
    if (bytes && emu_queue.n == emu_queue.cap) {
        int cap = emu_queue.cap ? 2 * emu_queue.cap : 64;
        emu_pending *it = realloc(emu_queue.items, (size_t)cap * sizeof *it);
        if (it) emu_queue.items = it, emu_queue.cap = cap;
    }
    bool ok = bytes && emu_queue.n < emu_queue.cap;
    if (ok) {
        memcpy(bytes, src, n);
        emu_queue.items[emu_queue.n++] = (emu_pending){host, bytes, n, to_host};
    }
    pthread_mutex_unlock(&emu_queue.lock);
    if (!ok) free(bytes);
    return ok ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "emu: out of memory queueing a copy");
}
static anneal_status emu_to_host(void *c, void *host, const void *dev, size_t n) {
    anneal_status s = emu_push(host, emu_untag(dev), n, true);
    if (s == ANNEAL_OK) memset(host, 0xFF, n); /* the values arrive at synchronize */
    return s;
}
static anneal_status emu_from_host(void *c, void *dev, const void *host, size_t n) {
    memcpy(emu_untag(dev), host, n);
    return emu_push((void *)host, host, n, false);
}
static anneal_status emu_sync(void *c) {
    pthread_mutex_lock(&emu_queue.lock);
    emu_stats.syncs++;
    for (int i = 0; i < emu_queue.n; i++) {
        emu_pending *p = &emu_queue.items[i];
        if (p->to_host) memcpy(p->host, p->bytes, p->n);
        else if (memcmp(p->host, p->bytes, p->n)) emu_stats.host_reuse++;
        free(p->bytes);
    }
    emu_queue.n = 0;
    pthread_mutex_unlock(&emu_queue.lock);
    return ANNEAL_OK;
}
static bool emu_supports(void *c, const anneal_op_query *q) {
    return !emu_stats.cpu->supports_op || emu_stats.cpu->supports_op(emu_stats.cpu->ctx, q);
}
static anneal_status emu_copy(void *c, emu_t *d, emu_ct *s) { EMU_FWD(copy, U(d), U(s)); }
static anneal_status emu_fill(void *c, emu_t *d, double v) { EMU_FWD(fill, U(d), v); }
static anneal_status emu_binary(void *c, anneal_binary_op op, emu_t *o, emu_ct *a, emu_ct *b) { EMU_FWD(binary, op, U(o), U(a), U(b)); }
static anneal_status emu_unary(void *c, anneal_unary_op op, emu_t *o, emu_ct *x, float al) { EMU_FWD(unary, op, U(o), U(x), al); }
static anneal_status emu_unary_bwd(void *c, anneal_unary_op op, emu_t *dx, emu_ct *x, emu_ct *dy, float al) {
    EMU_FWD(unary_bwd, op, U(dx), U(x), U(dy), al);
}
static anneal_status emu_scale_by(void *c, emu_t *x, emu_ct *s, emu_ct *n, double f) { EMU_FWD(scale_by, U(x), U(s), U(n), f); }
static anneal_status emu_reduce_sum(void *c, emu_t *o, emu_ct *x) { EMU_FWD(reduce_sum, U(o), U(x)); }
static anneal_status emu_sum_squares(void *c, emu_t *o, int64_t i, emu_ct *x) { EMU_FWD(sum_squares, U(o), i, U(x)); }
static anneal_status emu_matmul(void *c, const anneal_matmul_desc *d, emu_t *C, emu_ct *A, emu_ct *B) {
    emu_args a_;
    a_.n = 0;
    emu_stats.calls++;
    anneal_matmul_desc e = *d;
    e.bias = U(d->bias), e.aux_in = U(d->aux_in), e.aux_out = U(d->aux_out), e.bsum = U(d->bsum);
    return emu_stats.cpu->matmul(emu_stats.cpu->ctx, &e, U(C), U(A), U(B));
}
static anneal_status emu_ln_fwd(void *c, emu_t *y, emu_t *m, emu_t *r, emu_ct *x, emu_ct *w, emu_ct *b, float eps) {
    EMU_FWD(layer_norm_fwd, U(y), U(m), U(r), U(x), U(w), U(b), eps);
}
static anneal_status emu_ln_bwd(void *c, emu_t *dx, emu_t *dw, emu_t *db, emu_ct *x, emu_ct *w, emu_ct *m, emu_ct *r, emu_ct *dy) {
    EMU_FWD(layer_norm_bwd, U(dx), U(dw), U(db), U(x), U(w), U(m), U(r), U(dy));
}
static anneal_status emu_aln_fwd(void *c, emu_t *s, emu_t *y, emu_t *m, emu_t *r, emu_ct *x, emu_ct *res, emu_ct *w, emu_ct *b, float eps) {
    EMU_FWD(add_layer_norm_fwd, U(s), U(y), U(m), U(r), U(x), U(res), U(w), U(b), eps);
}
static anneal_status emu_aln_bwd(void *c, emu_t *dx, emu_t *dw, emu_t *db, emu_ct *s, emu_ct *w, emu_ct *m, emu_ct *r, emu_ct *dy, emu_ct *ds) {
    EMU_FWD(add_layer_norm_bwd, U(dx), U(dw), U(db), U(s), U(w), U(m), U(r), U(dy), U(ds));
}
static anneal_status emu_rms_fwd(void *c, emu_t *y, emu_t *r, emu_ct *x, emu_ct *w, float eps) { EMU_FWD(rms_norm_fwd, U(y), U(r), U(x), U(w), eps); }
static anneal_status emu_rms_bwd(void *c, emu_t *dx, emu_t *dw, emu_ct *x, emu_ct *w, emu_ct *r, emu_ct *dy) {
    EMU_FWD(rms_norm_bwd, U(dx), U(dw), U(x), U(w), U(r), U(dy));
}
static anneal_status emu_softmax_fwd(void *c, emu_t *y, emu_ct *x, bool lg) { EMU_FWD(softmax_fwd, U(y), U(x), lg); }
static anneal_status emu_softmax_bwd(void *c, emu_t *dx, emu_ct *y, emu_ct *dy, bool lg) { EMU_FWD(softmax_bwd, U(dx), U(y), U(dy), lg); }
static anneal_status emu_attn_fwd(void *c, const anneal_attention_desc *d, emu_t *o, emu_t *lse, emu_ct *q, emu_ct *k, emu_ct *v) {
    EMU_FWD(attention_fwd, d, U(o), U(lse), U(q), U(k), U(v));
}
static anneal_status emu_attn_bwd(void *c, const anneal_attention_desc *d, emu_t *dq, emu_t *dk, emu_t *dv, emu_ct *q, emu_ct *k, emu_ct *v,
                                  emu_ct *o, emu_ct *dout, emu_ct *lse) {
    EMU_FWD(attention_bwd, d, U(dq), U(dk), U(dv), U(q), U(k), U(v), U(o), U(dout), U(lse));
}
static anneal_status emu_rope(void *c, const anneal_rope_desc *d, emu_t *x, int64_t p0, bool inv) { EMU_FWD(rope, d, U(x), p0, inv); }
static anneal_status emu_check_index(void *c, const char *op, const char *what, emu_ct *ids, int64_t n, bool hi, int32_t ii,
                                     emu_t *count) {
    EMU_FWD(check_index, op, what, U(ids), n, hi, ii, U(count));
}
static anneal_status emu_emb_fwd(void *c, emu_t *y, emu_ct *ids, emu_ct *w) { EMU_FWD(embedding_fwd, U(y), U(ids), U(w)); }
static anneal_status emu_emb_bwd(void *c, emu_t *dw, emu_ct *ids, emu_ct *dy) { EMU_FWD(embedding_bwd, U(dw), U(ids), U(dy)); }
static anneal_status emu_ce_fwd(void *c, emu_t *loss, emu_t *lse, emu_ct *logits, emu_ct *tg, int32_t ii) {
    EMU_FWD(cross_entropy_fwd, U(loss), U(lse), U(logits), U(tg), ii);
}
static anneal_status emu_ce_bwd(void *c, emu_t *dl, emu_ct *logits, emu_ct *tg, emu_ct *lse, int32_t ii, emu_ct *s, emu_ct *count) {
    EMU_FWD(cross_entropy_bwd, U(dl), U(logits), U(tg), U(lse), ii, U(s), U(count));
}
static anneal_status emu_loss_mean(void *c, emu_t *o, emu_ct *rows, emu_ct *tg, int32_t ii, emu_ct *count) {
    EMU_FWD(loss_mean, U(o), U(rows), U(tg), ii, U(count));
}
static anneal_status emu_lce(void *c, emu_t *loss, emu_t *lse, emu_t *dh, emu_t *dw, emu_t *work, emu_ct *h, emu_ct *w, emu_ct *tg, int32_t ii, emu_ct *count,
                             anneal_dtype cd) {
    EMU_FWD(linear_cross_entropy, U(loss), U(lse), U(dh), U(dw), U(work), U(h), U(w), U(tg), ii, U(count), cd);
}
static anneal_status emu_dropout_fwd(void *c, emu_t *y, emu_t *m, emu_ct *x, float p, uint64_t s, uint64_t o) {
    EMU_FWD(dropout_fwd, U(y), U(m), U(x), p, s, o);
}
static anneal_status emu_dropout_bwd(void *c, emu_t *dx, emu_ct *m, emu_ct *dy, float p) { EMU_FWD(dropout_bwd, U(dx), U(m), U(dy), p); }
static anneal_status emu_randn(void *c, emu_t *x, float mean, float std, uint64_t s, uint64_t o) {
    EMU_FWD(randn, U(x), mean, std, s, o);
}
static anneal_status emu_adamw(void *c, emu_t *p, emu_ct *g, emu_t *m, emu_t *v, double lr, double b1, double b2, double eps, double wd,
                               double bc1, double bc2) {
    EMU_FWD(adamw, U(p), U(g), U(m), U(v), lr, b1, b2, eps, wd, bc1, bc2);
}
/* The groups' pointers are device addresses: untagged into a copy of the array. */
static anneal_status emu_adamw_multi(void *c, const anneal_adamw_group *g, int n, double lr, double b1, double b2,
                                     double eps) {
    emu_stats.calls++;
    anneal_adamw_group *u = malloc((size_t)(n > 0 ? n : 1) * sizeof *u);
    if (!u) return anneal_set_error(ANNEAL_ERR_OOM, "emu: adamw_multi: out of memory");
    for (int i = 0; i < n; i++) {
        u[i] = g[i];
        u[i].p = emu_untag(g[i].p), u[i].g = emu_untag(g[i].g), u[i].m = emu_untag(g[i].m), u[i].v = emu_untag(g[i].v);
    }
    anneal_status s = emu_stats.cpu->adamw_multi(emu_stats.cpu->ctx, u, n, lr, b1, b2, eps);
    free(u);
    return s;
}
#undef U
#undef EMU_FWD

static const anneal_backend emu_table = {
    .version = ANNEAL_BACKEND_VERSION, .name = "emu", .device = EMU,
    .alloc = emu_alloc, .free = emu_free, .copy_to_host = emu_to_host, .copy_from_host = emu_from_host,
    .synchronize = emu_sync, .supports_op = emu_supports,
    .copy = emu_copy, .fill = emu_fill, .binary = emu_binary, .unary = emu_unary, .unary_bwd = emu_unary_bwd,
    .scale_by = emu_scale_by, .reduce_sum = emu_reduce_sum, .sum_squares = emu_sum_squares, .matmul = emu_matmul,
    .layer_norm_fwd = emu_ln_fwd, .layer_norm_bwd = emu_ln_bwd, .add_layer_norm_fwd = emu_aln_fwd,
    .add_layer_norm_bwd = emu_aln_bwd, .rms_norm_fwd = emu_rms_fwd, .rms_norm_bwd = emu_rms_bwd,
    .softmax_fwd = emu_softmax_fwd, .softmax_bwd = emu_softmax_bwd, .attention_fwd = emu_attn_fwd,
    .attention_bwd = emu_attn_bwd, .rope = emu_rope, .check_index = emu_check_index, .embedding_fwd = emu_emb_fwd,
    .embedding_bwd = emu_emb_bwd, .cross_entropy_fwd = emu_ce_fwd, .cross_entropy_bwd = emu_ce_bwd,
    .loss_mean = emu_loss_mean, .linear_cross_entropy = emu_lce, .dropout_fwd = emu_dropout_fwd,
    .dropout_bwd = emu_dropout_bwd, .randn = emu_randn, .adamw = emu_adamw, .adamw_multi = emu_adamw_multi,
};

/* Registers emu on ANNEAL_DEVICE_EXT (once; later calls return ANNEAL_OK). */
static anneal_status emu_register(void) {
    if (emu_stats.cpu) return ANNEAL_OK;
    if (!(emu_stats.cpu = anneal_backend_get(ANNEAL_CPU))) return anneal_last_status();
    return anneal_backend_register(&emu_table);
}

#endif
