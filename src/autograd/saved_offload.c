/* Activation offload (--offload activations) for CPU runs: the tensors nodes save for
 * backward move, between forward and backward, to the memory tier below RAM, a file
 * on disk, through the saved-tensor hooks (node.c).
 *
 * Forward: pack queues each saved activation storage of at least min_bytes (CPU, the
 * allocator's activations category: never parameters, gradients or tiny tensors; one
 * entry per storage, so views share it). Queued bytes beyond a window of the largest
 * storage this forward saved so far are evicted oldest first: the storage's bytes are
 * pwritten to the file (page aligned, appended) and anneal_storage_evict points the
 * storage at the file's shared mapping and gives its block back to the allocator, so
 * live activation bytes drop while every view keeps working (an op that still reads
 * or writes it goes through the mapping, coherent with the file). The window keeps
 * what the next ops read in memory; the last activations of the forward are never
 * evicted (backward needs them first).
 *
 * Backward: unpack gives a node, for each saved tensor whose storage is evicted, a
 * fresh allocator copy of the span its view covers (pread from the file), released
 * after the node's backward; the storage itself stays evicted. Before reading, the
 * ranges of the records evicted just before this one (the nodes backward reaches
 * next) are announced with posix_fadvise(WILLNEED), so the kernel reads them ahead.
 * Values are never changed: losses and gradients are bit-identical.
 *
 * The file (mkstemp in dir, unlinked at once: nothing is left however the process
 * ends) grows as needed inside one reserved address range (file pages mapped with
 * MAP_FIXED, space allocated with posix_fallocate so a full disk is an error, not a
 * SIGBUS); once a backward has run, the next pack drops the records whose tensors are
 * gone and the append point goes back to the end of the last live one, so each step
 * reuses the file from the start. The bytes stay in the page cache until the kernel
 * writes them back and reclaims them: what leaves this process is anonymous memory.
 * A write that fails (a full disk) leaves that tensor in memory and fails the next
 * backward with the error.
 *
 * Not here: a writer or prefetch thread (evictions are synchronous pwrites, read-ahead
 * is the kernel's); GPU tensors (the GPU version is pinned host memory copied on a
 * stream of its own; refused by the trainer). */
#include "anneal/autograd.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    anneal_tensor *t; /* a retained alias of the evicted storage */
    int64_t off, len; /* its bytes in the file */
} record;

struct anneal_act_offload {
    int fd;
    char *base;            /* reserved address range; [0, mapped) maps the file */
    size_t reserved, mapped;
    int64_t min_bytes;
    anneal_tensor **pend;  /* queued, not evicted yet (retained aliases), oldest first */
    int n_pend, cap_pend;
    int64_t pend_bytes, largest;
    record *recs;          /* evicted, in file order (= eviction order) */
    int n_recs, cap_recs;
    int64_t end;           /* append point */
    bool in_backward;      /* unpack ran since the last pack */
    int prefetch_lo;       /* records [prefetch_lo, n_recs) were announced this backward */
    anneal_status err;     /* a failed eviction, reported by the next unpack */
    char errmsg[PATH_MAX + 512];
    char dir[PATH_MAX];
    bool installed;
    anneal_act_offload_stats st;
};

static size_t page_size(void) {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

static int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static int64_t thread_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Only this thread's aliases are retained; a storage is gone for everyone else when
 * the alias we hold is its only tensor and holds its only reference. */
static bool only_ours(const anneal_tensor *t) { return t->refcount == 1 && t->storage->refcount == 1; }

/* Remembers the first failure (the tensor stays in memory); the next unpack returns it. */
static void fail(anneal_act_offload *o, const char *what, int e) {
    if (o->err != ANNEAL_OK) return;
    o->err = e == ENOMEM ? ANNEAL_ERR_OOM : ANNEAL_ERR_IO;
    snprintf(o->errmsg, sizeof o->errmsg, "--offload activations: %s in %s (%s)", what, o->dir, strerror(e));
}

/* Makes the file and its mapping at least `need` bytes long. */
static bool grow(anneal_act_offload *o, int64_t need) {
    if ((size_t)need <= o->mapped) return true;
    size_t pg = page_size();
    size_t want = (size_t)round_up(need, (int64_t)pg);
    size_t dbl = o->mapped * 2, floor = (size_t)4 << 20;
    if (want < dbl) want = dbl;
    if (want < floor) want = floor;
    if (want > o->reserved) want = (size_t)round_up(need, (int64_t)pg);
    if (want > o->reserved) {
        fail(o, "the activation file would pass the reserved address range", ENOMEM);
        return false;
    }
    if (ftruncate(o->fd, (off_t)want) != 0) {
        fail(o, "cannot grow the activation file", errno);
        return false;
    }
    int e = posix_fallocate(o->fd, (off_t)o->mapped, (off_t)(want - o->mapped));
    if (e != 0 && e != EOPNOTSUPP && e != EINVAL) {
        if (ftruncate(o->fd, (off_t)o->mapped) != 0) { /* the old size is all we map */ }
        fail(o, "no room to grow the activation file", e);
        return false;
    }
    void *m = mmap(o->base + o->mapped, want - o->mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, o->fd,
                   (off_t)o->mapped);
    if (m == MAP_FAILED) {
        fail(o, "cannot map the activation file", errno);
        return false;
    }
    o->mapped = want;
    if ((int64_t)want > o->st.file_bytes) o->st.file_bytes = (int64_t)want;
    return true;
}

static bool write_all(int fd, const char *p, int64_t n, int64_t off) {
    while (n > 0) {
        ssize_t k = pwrite(fd, p, (size_t)n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k == 0) errno = EIO;
            return false;
        }
        p += k, n -= k, off += k;
    }
    return true;
}

static bool read_all(int fd, char *p, int64_t n, int64_t off) {
    while (n > 0) {
        ssize_t k = pread(fd, p, (size_t)n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k == 0) errno = EIO;
            return false;
        }
        p += k, n -= k, off += k;
    }
    return true;
}

/* Moves queued alias t's storage into the file (or lets it go when nobody else holds
 * it); consumes the queue's reference. */
static void evict(anneal_act_offload *o, anneal_tensor *t) {
    anneal_storage *s = t->storage;
    if (only_ours(t) || o->err != ANNEAL_OK || !anneal_storage_evictable(s)) {
        anneal_release(t);
        return;
    }
    int64_t len = (int64_t)s->nbytes, off = round_up(o->end, (int64_t)page_size());
    if (o->n_recs == o->cap_recs) {
        int cap = o->cap_recs ? 2 * o->cap_recs : 256;
        record *r = realloc(o->recs, (size_t)cap * sizeof *r);
        if (!r) {
            fail(o, "out of memory for the record list", ENOMEM);
            anneal_release(t);
            return;
        }
        o->recs = r;
        o->cap_recs = cap;
    }
    if (!grow(o, off + len)) {
        anneal_release(t);
        return;
    }
    if (!write_all(o->fd, s->data, len, off)) {
        fail(o, "cannot write the activation file", errno);
        anneal_release(t);
        return;
    }
    if (anneal_storage_evict(s, o->base + off) != ANNEAL_OK) { /* cannot happen: checked above */
        anneal_release(t);
        return;
    }
    o->recs[o->n_recs++] = (record){t, off, len};
    o->end = off + len;
    o->st.evicted_bytes += len;
    o->st.n_evicted++;
}

/* After a backward: drops the records whose tensors are gone (the last reference is
 * ours) and moves the append point back to the end of the last live one. */
static void sweep(anneal_act_offload *o) {
    int k = 0;
    for (int i = 0; i < o->n_recs; i++) {
        if (only_ours(o->recs[i].t)) anneal_release(o->recs[i].t);
        else o->recs[k++] = o->recs[i];
    }
    o->n_recs = k;
    o->end = k ? o->recs[k - 1].off + o->recs[k - 1].len : 0;
    /* pages that forward read through the mapping leave this process's resident set
     * (they stay in the page cache and the file) */
    size_t from = (size_t)round_up(o->end, (int64_t)page_size());
    if (from < o->mapped) madvise(o->base + from, o->mapped - from, MADV_DONTNEED);
}

static void drop_pending(anneal_act_offload *o) {
    for (int i = 0; i < o->n_pend; i++) anneal_release(o->pend[i]);
    o->n_pend = 0;
    o->pend_bytes = 0;
}

static void pack_impl(anneal_act_offload *o, anneal_tensor *saved) {
    if (o->in_backward) { /* a new forward: last backward's records may be gone */
        o->in_backward = false;
        o->largest = 0; /* the window follows this forward's storages */
        sweep(o);
    }
    anneal_storage *s = saved->storage;
    if (saved->device != ANNEAL_CPU || !anneal_storage_evictable(s) || (int64_t)s->nbytes < o->min_bytes) return;
    int k = 0; /* one entry per storage; entries nobody else holds any more leave */
    bool dup = false;
    for (int i = 0; i < o->n_pend; i++) {
        anneal_tensor *p = o->pend[i];
        dup |= p->storage == s;
        if (only_ours(p)) {
            o->pend_bytes -= (int64_t)p->storage->nbytes;
            anneal_release(p);
        } else {
            o->pend[k++] = p;
        }
    }
    o->n_pend = k;
    if (dup) return;
    if (o->n_pend == o->cap_pend) {
        int cap = o->cap_pend ? 2 * o->cap_pend : 64;
        anneal_tensor **p = realloc(o->pend, (size_t)cap * sizeof *p);
        if (!p) return; /* stays in memory */
        o->pend = p;
        o->cap_pend = cap;
    }
    o->pend[o->n_pend++] = anneal_retain(saved);
    o->pend_bytes += (int64_t)s->nbytes;
    if ((int64_t)s->nbytes > o->largest) o->largest = (int64_t)s->nbytes;
    int64_t window = o->largest;
    int n = 0;
    while (n < o->n_pend - 1 && o->pend_bytes > window) {
        o->pend_bytes -= (int64_t)o->pend[n]->storage->nbytes;
        evict(o, o->pend[n++]);
    }
    if (n) {
        memmove(o->pend, o->pend + n, (size_t)(o->n_pend - n) * sizeof *o->pend);
        o->n_pend -= n;
    }
}

/* Index of the record whose file range starts at off (records are in file order). */
static int find_record(const anneal_act_offload *o, int64_t off) {
    int lo = 0, hi = o->n_recs - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (o->recs[mid].off == off) return mid;
        if (o->recs[mid].off < off) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* Announces the records backward reaches after record i (those evicted before it),
 * up to about max(8 MiB, 2 x record i) ahead of what was announced already. */
static void prefetch(anneal_act_offload *o, int i) {
    int64_t budget = 2 * o->recs[i].len;
    if (budget < ((int64_t)8 << 20)) budget = (int64_t)8 << 20;
    int j = i < o->prefetch_lo ? i : o->prefetch_lo;
    int64_t ahead = 0;
    for (int k = j; k < i; k++) ahead += o->recs[k].len; /* announced, not read yet */
    while (j > 0 && ahead < budget) {
        j--;
        ahead += o->recs[j].len;
        (void)posix_fadvise(o->fd, (off_t)o->recs[j].off, (off_t)o->recs[j].len, POSIX_FADV_WILLNEED);
        o->st.prefetched_bytes += o->recs[j].len;
    }
    if (j < o->prefetch_lo) o->prefetch_lo = j;
}

static anneal_status unpack_impl(anneal_act_offload *o, anneal_tensor *saved, anneal_tensor **use) {
    if (!o->in_backward) { /* the forward is over: what is still queued stays in memory */
        o->in_backward = true;
        o->st.resident_bytes = o->pend_bytes;
        drop_pending(o);
        o->prefetch_lo = o->n_recs;
    }
    if (o->err != ANNEAL_OK) {
        anneal_status e = o->err;
        o->err = ANNEAL_OK;
        return anneal_set_error(e, "%s", o->errmsg);
    }
    anneal_storage *s = saved->storage;
    if (!anneal_storage_evicted(s)) return ANNEAL_OK;
    int64_t off = (char *)s->data - o->base;
    int i = off >= 0 && (size_t)off < o->mapped ? find_record(o, off) : -1;
    if (i < 0) return ANNEAL_OK; /* evicted by someone else: read where it is */
    int64_t lo = saved->offset, hi = saved->offset;
    for (int d = 0; d < saved->ndim; d++) {
        if (saved->shape[d] == 0) return ANNEAL_OK;
        int64_t span = (saved->shape[d] - 1) * saved->strides[d];
        if (span < 0) lo += span;
        else hi += span;
    }
    prefetch(o, i);
    int64_t esz = (int64_t)anneal_dtype_size(saved->dtype), n = hi - lo + 1;
    anneal_scope_enter(NULL);
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_ACTIVATIONS);
    anneal_tensor *buf = anneal_empty_on(ANNEAL_CPU, saved->dtype, 1, &n);
    anneal_memory_category_set(mc);
    anneal_tensor *v = NULL;
    anneal_status st = ANNEAL_OK;
    if (!buf) st = anneal_last_status();
    else if (!read_all(o->fd, anneal_data(buf), n * esz, off + lo * esz))
        st = anneal_set_error(ANNEAL_ERR_IO, "--offload activations: cannot read the activation file in %s (%s)", o->dir,
                              strerror(errno));
    else if (!(v = anneal_alias(buf, saved->ndim, saved->shape, saved->strides, saved->offset - lo)))
        st = anneal_last_status();
    anneal_release(buf);
    anneal_scope_leave();
    if (st != ANNEAL_OK) return st;
    o->st.restored_bytes += n * esz;
    o->st.n_restored++;
    *use = v;
    return ANNEAL_OK;
}

static void pack(anneal_tensor *saved, void *user) {
    anneal_act_offload *o = user;
    int64_t t0 = thread_ns();
    pack_impl(o, saved);
    o->st.hook_ns += thread_ns() - t0;
}

static anneal_status unpack(anneal_tensor *saved, anneal_tensor **use, void *user) {
    anneal_act_offload *o = user;
    int64_t t0 = thread_ns();
    anneal_status st = unpack_impl(o, saved, use);
    o->st.hook_ns += thread_ns() - t0;
    return st;
}

anneal_act_offload *anneal_act_offload_new(const char *dir, int64_t min_bytes) {
    if (!dir || !*dir) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_act_offload_new: no directory");
        return NULL;
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
    anneal_act_offload *o = calloc(1, sizeof *o);
    if (!o) {
        anneal_set_error(ANNEAL_ERR_OOM, "--offload activations: out of memory");
        return NULL;
    }
    o->fd = -1;
    o->min_bytes = min_bytes > 0 ? min_bytes : (int64_t)64 << 10;
    snprintf(o->dir, sizeof o->dir, "%s", dir);
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/anneal_activations.XXXXXX", dir);
    o->fd = mkostemp(path, O_CLOEXEC);
    if (o->fd < 0) {
        anneal_set_error(ANNEAL_ERR_IO, "--offload-dir %s: cannot create the activation file (%s)", dir,
                         strerror(errno));
        free(o);
        return NULL;
    }
    unlink(path); /* the descriptor keeps it; nothing stays on disk after exit */
    /* address space only: file pages are mapped into it as the file grows */
    for (size_t r = (size_t)1 << 40; r >= ((size_t)1 << 30) && !o->base; r /= 2) {
        void *m = mmap(NULL, r, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m != MAP_FAILED) o->base = m, o->reserved = r;
    }
    if (!o->base) {
        anneal_set_error(ANNEAL_ERR_OOM, "--offload activations: cannot reserve address space for the file's mapping");
        close(o->fd);
        free(o);
        return NULL;
    }
    return o;
}

void anneal_act_offload_install(anneal_act_offload *o) {
    if (o) anneal_set_saved_tensor_hooks(pack, unpack, o);
    else anneal_set_saved_tensor_hooks(NULL, NULL, NULL);
    if (o) o->installed = true;
}

anneal_act_offload_stats anneal_act_offload_stats_get(const anneal_act_offload *o) {
    anneal_act_offload_stats z = {0};
    return o ? o->st : z;
}

void anneal_act_offload_free(anneal_act_offload *o) {
    if (!o) return;
    if (o->installed) anneal_set_saved_tensor_hooks(NULL, NULL, NULL);
    drop_pending(o);
    bool keep_map = false;
    for (int i = 0; i < o->n_recs; i++) {
        anneal_tensor *t = o->recs[i].t;
        /* still viewed by someone: back into memory before the mapping goes */
        if (!only_ours(t) && anneal_storage_restore(t->storage) != ANNEAL_OK) keep_map = true;
        anneal_release(t);
    }
    if (!keep_map) munmap(o->base, o->reserved); /* else leaked rather than left dangling */
    close(o->fd);
    free(o->pend);
    free(o->recs);
    free(o);
}
