/* Optimizer-state offload (--offload optimizer): AdamW's exp_avg and exp_avg_sq live in
 * a memory-mapped file (the memory tier below RAM for CPU runs) instead of allocator
 * tensors. The file is created in the directory given (mkstemp, then unlinked at once,
 * so nothing is left behind however the process ends), sized for every trainable
 * parameter's two state arrays: parameter i's exp_avg at float offset off[i], its
 * exp_avg_sq right after it.
 *
 * A step goes over the parameters with a gradient in chunks of about chunk_bytes of
 * state: before a chunk is updated the next one is announced (madvise WILLNEED, the
 * kernel reads it ahead), the chunk is updated by the backend's adamw_multi (the same
 * one-pass kernel the plain optimizer uses, bit-identical to it element by element),
 * and the chunk is dropped from this process's resident set (madvise DONTNEED on a
 * shared file mapping: the pages stay in the page cache / file, the next access maps
 * them again), so the resident state is about two chunks. Parameters, gradients and
 * the update arithmetic are untouched: losses are bit-identical to the plain AdamW.
 *
 * State tensors (anneal_optimizer_state, for checkpoints and resume) exist only between
 * anneal_optimizer_offload_gather (file -> tensors) and anneal_optimizer_offload_scatter
 * (tensors -> file, tensors freed), as ZeRO's full state does.
 * Limits: AdamW on CPU parameters only (the GPU path, pinned host memory on a stream,
 * comes with the CUDA backend); not combined with ZeRO. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "anneal/backend.h"
#include "optim/optim_internal.h"

typedef struct offload_state {
    float *base;       /* the mapping */
    size_t bytes;      /* its length */
    int64_t *off;      /* per parameter: float offset of exp_avg (-1: frozen) */
    int n;
    int64_t chunk_bytes;
    char path[4096];   /* the file's name when it was made (unlinked since) */
    anneal_adamw_group *groups;
} offload_state;

static void offload_free(void *p) {
    offload_state *s = p;
    if (!s) return;
    if (s->base) munmap(s->base, s->bytes);
    free(s->off);
    free(s->groups);
    free(s);
}

static anneal_status offload_step(anneal_optimizer *o, double lr);
static anneal_status offload_init_state(anneal_optimizer *o);

static const anneal_optimizer_variant k_offload_variant = {
    .name = "offload", .step = offload_step, .init_state = offload_init_state, .free_state = offload_free};

static offload_state *state_of(const anneal_optimizer *o) {
    return o ? anneal_optimizer_variant_state(o, &k_offload_variant) : NULL;
}

static size_t page_size(void) {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

/* madvise over the pages covering [a, a + n) (widened to page boundaries). */
static void advise(void *a, size_t n, int advice) {
    size_t pg = page_size();
    uintptr_t lo = (uintptr_t)a & ~(uintptr_t)(pg - 1), hi = ((uintptr_t)a + n + pg - 1) & ~(uintptr_t)(pg - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, advice);
}

anneal_optimizer *anneal_optimizer_new_offload(anneal_params *ps, anneal_optim_config cfg, const char *dir,
                                               int64_t chunk_bytes) {
    if (!ps || !dir || !*dir) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_optimizer_new_offload: NULL parameter set or directory");
        return NULL;
    }
    if (cfg.kind != ANNEAL_OPTIM_ADAMW) {
        anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--offload optimizer: only AdamW's state is offloaded");
        return NULL;
    }
    for (int i = 0; i < ps->n; i++) {
        const anneal_tensor *t = ps->items[i].tensor;
        if (ps->items[i].trainable && (t->device != ANNEAL_CPU || t->dtype != ANNEAL_F32)) {
            anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--offload optimizer: parameter '%s' is not an f32 CPU tensor "
                             "(the file tier is for CPU runs)", ps->items[i].name);
            return NULL;
        }
    }
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        anneal_set_error(ANNEAL_ERR_IO, "--offload-dir %s: %s", dir, strerror(errno));
        return NULL;
    }
    if (!S_ISDIR(sb.st_mode)) {
        anneal_set_error(ANNEAL_ERR_IO, "--offload-dir %s: not a directory", dir);
        return NULL;
    }
    anneal_optimizer *o = anneal_optimizer_new(ps, cfg);
    offload_state *s = o ? calloc(1, sizeof *s) : NULL;
    if (!s) goto fail;
    s->n = ps->n;
    s->chunk_bytes = chunk_bytes > 0 ? chunk_bytes : (int64_t)16 << 20;
    s->off = malloc((size_t)(ps->n > 0 ? ps->n : 1) * sizeof *s->off);
    s->groups = malloc((size_t)(ps->n > 0 ? ps->n : 1) * sizeof *s->groups);
    if (!s->off || !s->groups) {
        anneal_set_error(ANNEAL_ERR_OOM, "--offload optimizer: out of memory");
        goto fail;
    }
    int64_t total = 0;
    for (int i = 0; i < ps->n; i++) {
        s->off[i] = ps->items[i].trainable ? total : -1;
        if (ps->items[i].trainable) total += 2 * anneal_numel(ps->items[i].tensor);
    }
    s->bytes = (size_t)(total > 0 ? total : 1) * sizeof(float);
    snprintf(s->path, sizeof s->path, "%s/anneal_optimizer_state.XXXXXX", dir);
    int fd = mkstemp(s->path);
    if (fd < 0) {
        anneal_set_error(ANNEAL_ERR_IO, "--offload-dir %s: cannot create the optimizer state file (%s)", dir,
                         strerror(errno));
        goto fail;
    }
    unlink(s->path); /* the mapping keeps it alive; nothing stays on disk after exit */
    if (ftruncate(fd, (off_t)s->bytes) != 0) {
        anneal_set_error(ANNEAL_ERR_IO, "--offload-dir %s: cannot size the optimizer state file to %zu bytes (%s)", dir,
                         s->bytes, strerror(errno));
        close(fd);
        goto fail;
    }
    void *m = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        anneal_set_error(ANNEAL_ERR_IO, "--offload-dir %s: cannot map the optimizer state file (%s)", dir,
                         strerror(errno));
        goto fail;
    }
    s->base = m; /* a new file reads as zeros: the state AdamW starts from */
    anneal_optimizer_set_variant(o, &k_offload_variant, s);
    return o;
fail:
    offload_free(s);
    anneal_optimizer_free(o);
    return NULL;
}

bool anneal_optimizer_is_offloaded(const anneal_optimizer *o) { return state_of(o) != NULL; }

int64_t anneal_optimizer_offload_bytes(const anneal_optimizer *o) {
    const offload_state *s = state_of(o);
    return s ? (int64_t)s->bytes : 0;
}

/* The end of the chunk starting at group a: groups while their state fits chunk_bytes
 * (at least one). */
static int chunk_end(const offload_state *s, int a, int n) {
    int b = a;
    int64_t bytes = 0;
    while (b < n && (b == a || bytes + s->groups[b].numel * 8 <= s->chunk_bytes)) bytes += s->groups[b++].numel * 8;
    return b;
}

/* Runs adamw_multi on groups [a, b), the next chunk's state announced first (read
 * ahead), this chunk's dropped from the resident set after. */
static anneal_status run_chunk(const anneal_backend *be, offload_state *s, int a, int b, int n, double lr,
                               const anneal_optim_config *c) {
    for (int k = b, e = chunk_end(s, b, n); k < e; k++)
        advise(s->groups[k].m, (size_t)s->groups[k].numel * 2 * sizeof(float), MADV_WILLNEED);
    anneal_status st = be->adamw_multi(be->ctx, s->groups + a, b - a, lr, c->beta1, c->beta2, c->eps);
    for (int k = a; k < b; k++) advise(s->groups[k].m, (size_t)s->groups[k].numel * 2 * sizeof(float), MADV_DONTNEED);
    return st;
}

/* One AdamW step over every parameter with a gradient (see the top of the file). */
static anneal_status offload_step(anneal_optimizer *o, double lr) {
    offload_state *s = state_of(o);
    anneal_params *ps = anneal_optimizer_param_set(o);
    anneal_optim_config c = anneal_optimizer_config(o);
    const anneal_backend *be = anneal_backend_get(ANNEAL_CPU);
    if (!be || !be->adamw_multi)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--offload optimizer: the CPU backend has no adamw_multi");
    if (ps->n != s->n)
        return anneal_set_error(ANNEAL_ERR_STATE, "--offload optimizer: parameters were added after it was made");
    int n = 0;
    for (int i = 0; i < ps->n; i++) {
        const anneal_param *pa = &ps->items[i];
        const anneal_tensor *g = pa->tensor->grad;
        if (!g || !pa->trainable) continue;
        if (g->dtype != ANNEAL_F32 || !anneal_is_contiguous(g) || !anneal_same_shape(g, pa->tensor) ||
            g->device != ANNEAL_CPU)
            return anneal_set_error(ANNEAL_ERR_ARG, "--offload optimizer: grad of '%s' must be a contiguous f32 CPU "
                                    "tensor of the parameter's shape", pa->name);
        double t = (double)(anneal_optimizer_param_steps(o, i) + 1);
        float *m = s->base + s->off[i];
        int64_t numel = anneal_numel(pa->tensor);
        /* in double, as PyTorch does with Python floats (as optimizer.c) */
        s->groups[n++] = (anneal_adamw_group){.p = anneal_data(pa->tensor), .g = anneal_data(g), .m = m, .v = m + numel,
                                              .numel = numel, .weight_decay = pa->decay ? c.weight_decay : 0.0,
                                              .bc1 = 1.0 - pow(c.beta1, t), .bc2 = 1.0 - pow(c.beta2, t)};
    }
    anneal_status st = ANNEAL_OK;
    for (int a = 0; a < n && st == ANNEAL_OK;) {
        int b = chunk_end(s, a, n);
        st = run_chunk(be, s, a, b, n, lr, &c);
        a = b;
    }
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++)
        if (ps->items[i].tensor->grad && ps->items[i].trainable)
            st = anneal_optimizer_set_param_steps(o, i, anneal_optimizer_param_steps(o, i) + 1);
    if (st == ANNEAL_OK) st = anneal_optimizer_set_step_count(o, anneal_optimizer_step_count(o) + 1);
    return st;
}

/* State tensors for every trainable parameter, filled from the file (zeros before any
 * step): what anneal_optimizer_init_state promises, for a restore into them. */
static anneal_status offload_init_state(anneal_optimizer *o) { return anneal_optimizer_offload_gather(o); }

anneal_status anneal_optimizer_offload_gather(anneal_optimizer *o) {
    offload_state *s = state_of(o);
    if (!s) return ANNEAL_OK;
    anneal_params *ps = anneal_optimizer_param_set(o);
    for (int i = 0; i < ps->n; i++) {
        if (s->off[i] < 0) continue;
        const anneal_tensor *p = ps->items[i].tensor;
        int64_t numel = anneal_numel(p);
        for (int k = 0; k < 2; k++) {
            anneal_tensor **slot = anneal_optimizer_state_slot(o, i, k);
            if (!slot) return anneal_last_status();
            if (!*slot) {
                anneal_scope_enter(anneal_optimizer_state_scope(o));
                anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_OPTIMIZER);
                *slot = anneal_empty_like(p);
                anneal_memory_category_set(mc);
                anneal_scope_leave();
                if (!*slot) return anneal_last_status();
            }
            memcpy(anneal_data(*slot), s->base + s->off[i] + k * numel, (size_t)numel * sizeof(float));
            advise(s->base + s->off[i] + k * numel, (size_t)numel * sizeof(float), MADV_DONTNEED);
        }
    }
    return ANNEAL_OK;
}

anneal_status anneal_optimizer_offload_scatter(anneal_optimizer *o) {
    offload_state *s = state_of(o);
    if (!s) return ANNEAL_OK;
    anneal_params *ps = anneal_optimizer_param_set(o);
    for (int i = 0; i < ps->n; i++) {
        if (s->off[i] < 0) continue;
        int64_t numel = anneal_numel(ps->items[i].tensor);
        for (int k = 0; k < 2; k++) {
            anneal_tensor **slot = anneal_optimizer_state_slot(o, i, k);
            if (!slot) return anneal_last_status();
            if (!*slot) continue;
            if ((*slot)->dtype != ANNEAL_F32 || !anneal_is_contiguous(*slot) || anneal_numel(*slot) != numel)
                return anneal_set_error(ANNEAL_ERR_STATE, "--offload optimizer: state of '%s' is not a contiguous f32 "
                                        "tensor of the parameter's size", ps->items[i].name);
            memcpy(s->base + s->off[i] + k * numel, anneal_data(*slot), (size_t)numel * sizeof(float));
            advise(s->base + s->off[i] + k * numel, (size_t)numel * sizeof(float), MADV_DONTNEED);
            anneal_tensor *t = anneal_keep(*slot, NULL); /* out of the optimizer's scope ... */
            *slot = NULL;
            anneal_release(t);                          /* ... and gone */
        }
    }
    return ANNEAL_OK;
}
