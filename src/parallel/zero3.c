/* ZeRO-3 (fully sharded parameters) on top of a stage-3 gradient sync.
 *
 * Layout. The sync's buckets never hold two groups (anneal_zero3_groups: one group per
 * transformer block, -1 for the parameters outside them), so a block is a run of whole
 * buckets. Rank r owns chunk r of every bucket (the sync's shard layout, ddp.c); the
 * parameter shard `shard` holds the values of those elements and is what the ZeRO
 * optimizer updates (anneal_ddp_param_shard). Gathering bucket k is one all-gather of
 * every rank's chunk into a flat buffer of chunk * world floats, and the bucket's
 * parameter tensors are then pointed into that buffer (anneal_tensor_set_storage: no
 * unpacking copy). Releasing it takes the storage away from the tensors again and drops
 * zero3's reference: tensors that backward saved (aliases of the parameters) keep the
 * buffer alive until the block's backward is done, then it goes back to the allocator.
 *
 * Schedule (the model's block hook, called around each block's forward and around its
 * recompute in backward): before block l, its buckets are gathered (or the prefetch
 * started earlier is waited for), then the next block's all-gather is started
 * (l + 1 while the blocks go up, l - 1 while backward comes down); after block l, its
 * buckets are released, except after the last block's forward with grad mode on:
 * backward replays that block first, so it stays for it. At most two blocks are gathered
 * at once, plus what backward's saved tensors still hold of the block being
 * differentiated. The parameters outside
 * the blocks stay gathered and are refreshed from the shard after every optimizer step
 * (anneal_ddp_gather_params calls gather_resident).
 *
 * Every rank makes the same hook calls in the same order (the same model, the same
 * steps), so every rank issues the same all-gathers in the same order, interleaved
 * with the sync's reduce-scatters in the same way. */
#include <stdlib.h>
#include <string.h>

#include "anneal/autograd.h"
#include "anneal/backend.h"
#include "anneal/parallel.h"

typedef struct z3_bucket {
    int lo, hi;         /* parameters (registration indices) */
    int group;          /* block index, -1 outside the blocks */
    int64_t start, n;   /* flat range */
    int64_t chunk;      /* elements per rank */
    int64_t shard_off, shard_len; /* this rank's real elements in the shard */
    anneal_tensor *full; /* chunk * world floats the parameters view (NULL: released) */
    anneal_tensor *send; /* chunk floats, while the all-gather is in flight */
    anneal_comm_request *req;
} z3_bucket;

struct anneal_zero3 {
    anneal_ddp *d;
    anneal_model *m;
    anneal_comm *c;
    anneal_device dev;
    const anneal_backend *be;
    int world, rank, n_layer;
    int64_t *offset;  /* flat offset of each parameter */
    z3_bucket *b;
    int nb;
    anneal_tensor *shard; /* the rank's parameter values, shard layout (NULL: empty shard) */
    int64_t shard_numel;
    bool pinned;      /* anneal_zero3_gather_all: everything stays gathered */
    int last_layer;   /* the block the hook last entered (-1: none yet) */
    bool kept_last;   /* the last block stayed gathered after its forward, for backward */
    int64_t peak;     /* most parameter bytes seen live at zero3's allocations */
    int64_t block_max;
};

/* The first all-digit dot-separated part of name, or -1. */
static int block_of(const char *name) {
    for (const char *p = name; p && *p;) {
        const char *e = strchr(p, '.');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        bool digits = n > 0 && n < 9;
        for (size_t i = 0; i < n && digits; i++) digits = p[i] >= '0' && p[i] <= '9';
        if (digits) return atoi(p);
        p = e ? e + 1 : NULL;
    }
    return -1;
}

int *anneal_zero3_groups(const anneal_model *m) {
    if (!m || !m->params) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_zero3_groups: NULL model");
        return NULL;
    }
    int *g = malloc((size_t)(m->params->n > 0 ? m->params->n : 1) * sizeof *g);
    if (!g) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory for the ZeRO-3 groups");
        return NULL;
    }
    for (int i = 0; i < m->params->n; i++) g[i] = block_of(m->params->items[i].name);
    return g;
}

/* The live bytes of the device's parameter category, kept as the peak when higher. */
static void note_peak(anneal_zero3 *z) {
    int64_t p = anneal_memory_categories_get(z->dev).live[ANNEAL_MEM_PARAMETERS];
    if (p > z->peak) z->peak = p;
}

/* A caller-owned flat f32 buffer of n elements charged to the parameters. */
static anneal_tensor *new_buffer(anneal_zero3 *z, int64_t n) {
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_PARAMETERS);
    anneal_scope_enter(NULL);
    anneal_tensor *t = anneal_empty_on(z->dev, ANNEAL_F32, 1, &n);
    anneal_scope_leave();
    anneal_memory_category_set(mc);
    note_peak(z);
    return t;
}

/* A caller-owned 1-D view of len elements of t from element off. */
static anneal_tensor *flat(const anneal_tensor *t, int64_t off, int64_t len) {
    anneal_scope_enter(NULL);
    anneal_tensor *v = anneal_alias(t, 1, &len, (int64_t[]){1}, t->offset + off);
    anneal_scope_leave();
    return v;
}

/* dst = src through the backend, both views released after. */
static anneal_status copy_release(anneal_zero3 *z, anneal_tensor *dst, anneal_tensor *src) {
    anneal_status s = dst && src ? z->be->copy(z->be->ctx, dst, src) : anneal_last_status();
    anneal_release(dst);
    anneal_release(src);
    return s;
}

/* Starts bucket k's all-gather (nothing when one is in flight): into its buffer when it
 * has one (a refresh in place), else into a new one. */
static anneal_status start(anneal_zero3 *z, int k) {
    z3_bucket *b = &z->b[k];
    if (b->req || b->chunk == 0) return ANNEAL_OK;
    if (!b->full && !(b->full = new_buffer(z, b->chunk * z->world))) return anneal_last_status();
    if (!(b->send = new_buffer(z, b->chunk))) return anneal_last_status();
    anneal_status s = ANNEAL_OK;
    if (b->shard_len < b->chunk) s = z->be->fill(z->be->ctx, b->send, 0.0); /* the padding */
    if (s == ANNEAL_OK && b->shard_len > 0)
        s = copy_release(z, flat(b->send, 0, b->shard_len), flat(z->shard, b->shard_off, b->shard_len));
    if (s == ANNEAL_OK) s = z->be->synchronize(z->be->ctx);
    if (s == ANNEAL_OK)
        s = anneal_comm_all_gather_start(z->c, anneal_data(b->send), anneal_data(b->full), b->chunk, ANNEAL_F32, &b->req);
    if (s != ANNEAL_OK) {
        anneal_release(b->send);
        b->send = NULL;
    }
    return s;
}

/* Waits for bucket k's all-gather (if any) and points its parameters into the buffer. */
static anneal_status finish(anneal_zero3 *z, int k) {
    z3_bucket *b = &z->b[k];
    if (!b->req) return ANNEAL_OK;
    anneal_status s = anneal_comm_wait(b->req);
    b->req = NULL;
    anneal_release(b->send);
    b->send = NULL;
    for (int p = b->lo; p <= b->hi && s == ANNEAL_OK; p++)
        s = anneal_tensor_set_storage(z->m->params->items[p].tensor, b->full, z->offset[p] - b->start);
    return s;
}

/* Takes the storage away from bucket k's parameters and drops the buffer. */
static anneal_status release(anneal_zero3 *z, int k) {
    z3_bucket *b = &z->b[k];
    anneal_status s = finish(z, k);
    for (int p = b->lo; p <= b->hi; p++) {
        anneal_status r = anneal_tensor_set_storage(z->m->params->items[p].tensor, NULL, 0);
        if (s == ANNEAL_OK) s = r;
    }
    anneal_release(b->full);
    b->full = NULL;
    return s;
}

/* Starts every bucket of group g (wait: and waits for them). */
static anneal_status gather_group(anneal_zero3 *z, int g, bool wait) {
    anneal_status s = ANNEAL_OK;
    for (int k = 0; k < z->nb && s == ANNEAL_OK; k++)
        if (z->b[k].group == g && (!z->b[k].full || z->b[k].req)) s = start(z, k);
    for (int k = 0; k < z->nb && s == ANNEAL_OK && wait; k++)
        if (z->b[k].group == g) s = finish(z, k);
    return s;
}

/* The model's block hook (see the file comment). */
static anneal_status block_hook(void *user, int l, bool before) {
    anneal_zero3 *z = user;
    if (z->pinned) return ANNEAL_OK;
    if (!before) {
        /* the last block's training forward: backward replays it first, so it stays */
        if (l == z->n_layer - 1 && !z->kept_last && anneal_grad_enabled()) {
            z->kept_last = true;
            return ANNEAL_OK;
        }
        z->kept_last = false;
        anneal_status s = ANNEAL_OK;
        for (int k = 0; k < z->nb; k++)
            if (z->b[k].group == l) {
                anneal_status r = release(z, k);
                if (s == ANNEAL_OK) s = r;
            }
        return s;
    }
    anneal_status s = gather_group(z, l, true);
    /* backward replays the blocks downwards (the last block right after its forward);
     * a forward goes upwards from block 0 */
    int prev = z->last_layer, next = -1;
    if (l == prev - 1 || (l == prev && l > 0)) next = l - 1;
    else if (l == 0 || l == prev + 1) next = l + 1;
    if (s == ANNEAL_OK && next >= 0 && next < z->n_layer) s = gather_group(z, next, false);
    z->last_layer = l;
    return s;
}

/* After an optimizer step: every gathered bucket (the resident ones; all of them when
 * pinned) is refreshed from the updated shard, in place. */
static anneal_status gather_resident(void *user) {
    anneal_zero3 *z = user;
    anneal_status s = ANNEAL_OK;
    for (int k = 0; k < z->nb && s == ANNEAL_OK; k++)
        if (z->b[k].full) s = start(z, k);
    for (int k = 0; k < z->nb; k++) {
        anneal_status r = finish(z, k); /* wait for every started one, even after an error */
        if (s == ANNEAL_OK) s = r;
    }
    return s;
}

/* This rank's pieces of the parameter tensors (which must hold storage) into the shard. */
static anneal_status pieces_to_shard(anneal_zero3 *z) {
    int np = 0;
    const anneal_ddp_piece *pcs = anneal_ddp_shard_pieces(z->d, &np);
    anneal_status s = ANNEAL_OK;
    for (int k = 0; k < np && s == ANNEAL_OK; k++) {
        const anneal_tensor *t = z->m->params->items[pcs[k].param].tensor;
        if (!t->storage)
            return anneal_set_error(ANNEAL_ERR_STATE, "ZeRO-3: parameter '%s' is not gathered",
                                    z->m->params->items[pcs[k].param].name);
        s = copy_release(z, flat(z->shard, pcs[k].shard_offset, pcs[k].len), flat(t, pcs[k].offset, pcs[k].len));
    }
    return s == ANNEAL_OK ? z->be->synchronize(z->be->ctx) : s;
}

anneal_zero3 *anneal_zero3_new(anneal_ddp *d, anneal_model *m) {
    if (!d || !m || anneal_ddp_stage(d) != 3 || anneal_ddp_params(d) != m->params) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_zero3_new: needs a stage-3 gradient sync over the model's parameters");
        return NULL;
    }
    anneal_params *ps = m->params;
    int *groups = anneal_zero3_groups(m);
    anneal_zero3 *z = groups ? calloc(1, sizeof *z) : NULL;
    if (z) {
        z->offset = calloc((size_t)(ps->n > 0 ? ps->n : 1), sizeof *z->offset);
        z->b = calloc((size_t)(anneal_ddp_bucket_count(d) > 0 ? anneal_ddp_bucket_count(d) : 1), sizeof *z->b);
    }
    if (!z || !z->offset || !z->b) {
        if (z) free(z->offset), free(z->b);
        free(z);
        free(groups);
        if (groups) anneal_set_error(ANNEAL_ERR_OOM, "out of memory setting up ZeRO-3");
        return NULL;
    }
    z->d = d;
    z->m = m;
    z->c = anneal_ddp_comm(d);
    z->dev = m->device;
    z->be = anneal_backend_get(z->dev);
    z->world = anneal_comm_size(z->c);
    z->rank = anneal_comm_rank(z->c);
    z->n_layer = m->cfg.n_layer;
    z->last_layer = -1;
    z->nb = anneal_ddp_bucket_count(d);
    anneal_status s = z->be ? ANNEAL_OK : anneal_last_status();
    for (int i = 1; i < ps->n; i++) z->offset[i] = z->offset[i - 1] + anneal_numel(ps->items[i - 1].tensor);
    int64_t shard = 0;
    for (int k = 0; k < z->nb && s == ANNEAL_OK; k++) {
        anneal_ddp_bucket_info bi = anneal_ddp_bucket(d, k);
        z3_bucket *b = &z->b[k];
        b->lo = bi.first_param;
        b->hi = bi.last_param;
        b->group = groups[b->lo];
        b->start = bi.start;
        b->n = bi.numel;
        b->chunk = (b->n + z->world - 1) / z->world;
        int64_t a = (int64_t)z->rank * b->chunk, e = a + b->chunk < b->n ? a + b->chunk : b->n;
        b->shard_off = shard;
        b->shard_len = e > a ? e - a : 0;
        shard += b->shard_len;
        for (int p = b->lo; p <= b->hi; p++)
            if (groups[p] != b->group || ps->items[p].tensor->dtype != ANNEAL_F32)
                s = anneal_set_error(ANNEAL_ERR_ARG, "anneal_zero3_new: the sync's bucket %d holds parameters of two "
                                                     "blocks (make it with groups from anneal_zero3_groups)", k);
    }
    free(groups);
    z->shard_numel = shard;
    if (s == ANNEAL_OK && shard != anneal_ddp_shard_numel(d))
        s = anneal_set_error(ANNEAL_ERR_STATE, "anneal_zero3_new: shard of %lld elements, the sync's has %lld",
                             (long long)shard, (long long)anneal_ddp_shard_numel(d));
    if (s == ANNEAL_OK && shard > 0 && !(z->shard = new_buffer(z, shard))) s = anneal_last_status();
    if (s == ANNEAL_OK && z->shard) s = pieces_to_shard(z);
    /* collective from here on: every rank takes the same path (same model, same sync) */
    for (int k = 0; k < z->nb; k++) {
        anneal_status r = ANNEAL_OK;
        if (z->b[k].group < 0) {
            if (s == ANNEAL_OK) r = start(z, k);
            anneal_status w = finish(z, k);
            if (r == ANNEAL_OK) r = w;
        } else if (s == ANNEAL_OK) {
            r = release(z, k);
        }
        if (s == ANNEAL_OK) s = r;
    }
    for (int g = 0; g < z->n_layer; g++) {
        int64_t bytes = 0;
        for (int k = 0; k < z->nb; k++)
            if (z->b[k].group == g) bytes += z->b[k].chunk * z->world * 4;
        if (bytes > z->block_max) z->block_max = bytes;
    }
    if (s != ANNEAL_OK) {
        anneal_zero3_free(z);
        return NULL;
    }
    z->peak = 0;
    note_peak(z); /* from here on: the model's own full copy is gone */
    anneal_ddp_set_param_shard(d, z->shard, gather_resident, z);
    m->block_hook = block_hook;
    m->block_hook_user = z;
    return z;
}

void anneal_zero3_free(anneal_zero3 *z) {
    if (!z) return;
    if (z->m && z->m->block_hook_user == z) {
        z->m->block_hook = NULL;
        z->m->block_hook_user = NULL;
    }
    if (anneal_ddp_param_shard(z->d) == z->shard) anneal_ddp_set_param_shard(z->d, NULL, NULL, NULL);
    for (int k = 0; k < z->nb; k++) {
        anneal_comm_wait(z->b[k].req); /* never leave MPI writing into freed memory */
        anneal_release(z->b[k].send);
        anneal_release(z->b[k].full); /* parameters still pointing into it keep it */
    }
    anneal_release(z->shard);
    free(z->offset);
    free(z->b);
    free(z);
}

anneal_status anneal_zero3_gather_all(anneal_zero3 *z) {
    if (!z) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_zero3_gather_all: NULL");
    anneal_status s = ANNEAL_OK;
    for (int k = 0; k < z->nb && s == ANNEAL_OK; k++)
        if (!z->b[k].full) s = start(z, k);
    for (int k = 0; k < z->nb; k++) {
        anneal_status r = finish(z, k);
        if (s == ANNEAL_OK) s = r;
    }
    if (s == ANNEAL_OK) z->pinned = true;
    return s;
}

anneal_status anneal_zero3_release_all(anneal_zero3 *z) {
    if (!z) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_zero3_release_all: NULL");
    z->pinned = false;
    z->kept_last = false;
    anneal_status s = ANNEAL_OK;
    for (int k = 0; k < z->nb; k++) {
        if (z->b[k].group < 0) continue;
        anneal_status r = release(z, k);
        if (s == ANNEAL_OK) s = r;
    }
    return s;
}

anneal_zero3_memory anneal_zero3_memory_get(const anneal_zero3 *z) {
    anneal_zero3_memory mm = {0};
    if (!z) return mm;
    mm.shard_bytes = z->shard_numel * 4;
    for (int k = 0; k < z->nb; k++) {
        if (!z->b[k].full) continue;
        int64_t bytes = z->b[k].chunk * z->world * 4;
        if (z->b[k].group < 0) mm.resident_bytes += bytes;
        else mm.gathered_bytes += bytes;
    }
    mm.peak_param_bytes = z->peak;
    mm.block_bytes_max = z->block_max;
    return mm;
}
