/* Deterministic reduction: sums in one fixed binary tree, whatever the number of ranks.
 *
 * The tree. The sum of leaves x_0 .. x_{M-1} is pairwise summation with a stack (a
 * binary counter): leaf j is pushed at level 0, and while the two top entries have the
 * same level they are replaced by (below + top) one level up; at the end the entries
 * left (complete subtrees of decreasing size, bottom to top) are folded from the top,
 * below + top. Every node is left + right with the left subtree the earlier leaves.
 * For M a power of two this is the complete binary tree.
 *
 * Why it splits over ranks. When M = W * 2^k and rank r holds the leaves
 * [r * 2^k, (r+1) * 2^k), its own stack ends with exactly one entry: the complete
 * subtree of its block, the same node the full tree has. Above level k the full tree's
 * stack sees one level-k entry per block, in block order: it is the same algorithm
 * run on the W block sums. So "each rank's tree over its block, then the tree over the
 * W block sums" performs exactly the additions of the tree over all M leaves, in the
 * same order, and gives the same bits for every W (tests/parallel/test_det_reduce.c).
 *
 * Across ranks every rank computes the tree over the block sums itself, from bit-exact
 * copies: MPI_Allreduce is not used, since its order depends on the world size, the
 * algorithm MPI picks and the message size. W a power of two: a butterfly (log2 W
 * exchanges of n floats with rank r ^ 2^k, each side adding lower + upper group), n
 * floats of scratch; other W: an all-gather (W x n received and held) and the tree on
 * every rank. */
#include "anneal/parallel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LEVELS 64

/* ------------------------------------------------------------ the local tree */

struct anneal_det_tree {
    int64_t n;               /* floats per leaf */
    float *buf[MAX_LEVELS];  /* stack entries (allocated on first use, kept) */
    int level[MAX_LEVELS];
    int depth;
    int64_t leaves;          /* pushed since the last finish */
};

anneal_det_tree *anneal_det_tree_new(int64_t n) {
    if (n < 0) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_det_tree_new: %lld floats per leaf", (long long)n);
        return NULL;
    }
    anneal_det_tree *t = calloc(1, sizeof *t);
    if (!t) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory for a deterministic sum");
        return NULL;
    }
    t->n = n;
    return t;
}

void anneal_det_tree_free(anneal_det_tree *t) {
    if (!t) return;
    for (int i = 0; i < MAX_LEVELS; i++) free(t->buf[i]);
    free(t);
}

/* a[i] = a[i] + b[i]: left + right, one rounding per element. */
static void add_into(float *restrict a, const float *restrict b, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = a[i] + b[i];
}

/* Merges the two top entries while they have the same level. */
static void carry(anneal_det_tree *t) {
    while (t->depth >= 2 && t->level[t->depth - 1] == t->level[t->depth - 2]) {
        add_into(t->buf[t->depth - 2], t->buf[t->depth - 1], t->n);
        t->level[t->depth - 2]++;
        t->depth--;
    }
}

anneal_status anneal_det_tree_push(anneal_det_tree *t, const float *x) {
    if (!t || (!x && t->n > 0)) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_det_tree_push: NULL argument");
    if (t->depth > 0 && t->level[t->depth - 1] == 0) {
        /* the top is a lone leaf: top + x is the level-1 node, no copy of x needed */
        add_into(t->buf[t->depth - 1], x, t->n);
        t->level[t->depth - 1] = 1;
        carry(t);
    } else {
        if (t->depth == MAX_LEVELS) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_det_tree_push: too many leaves");
        float **slot = &t->buf[t->depth];
        if (!*slot && !(*slot = malloc((size_t)(t->n > 0 ? t->n : 1) * sizeof(float))))
            return anneal_set_error(ANNEAL_ERR_OOM, "out of memory for a deterministic sum (%lld floats)",
                                    (long long)t->n);
        if (t->n > 0) memcpy(*slot, x, (size_t)t->n * sizeof(float));
        t->level[t->depth++] = 0;
    }
    t->leaves++;
    return ANNEAL_OK;
}

anneal_status anneal_det_tree_finish(anneal_det_tree *t, float *out) {
    if (!t || (!out && t->n > 0)) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_det_tree_finish: NULL argument");
    while (t->depth >= 2) { /* fold what is left from the top: below + top */
        add_into(t->buf[t->depth - 2], t->buf[t->depth - 1], t->n);
        t->depth--;
    }
    if (t->n > 0) {
        if (t->depth == 1) memcpy(out, t->buf[0], (size_t)t->n * sizeof(float));
        else memset(out, 0, (size_t)t->n * sizeof(float));
    }
    t->depth = 0;
    t->leaves = 0;
    return ANNEAL_OK;
}

int64_t anneal_det_tree_leaves(const anneal_det_tree *t) { return t ? t->leaves : 0; }

int64_t anneal_det_tree_memory_bytes(const anneal_det_tree *t) {
    int64_t b = 0;
    for (int i = 0; t && i < MAX_LEVELS; i++) b += t->buf[i] ? t->n * (int64_t)sizeof(float) : 0;
    return b;
}

/* ------------------------------------------------- the tree over blocks in place */

void anneal_det_combine_blocks(float *blocks, int w, int64_t n) {
    int idx[MAX_LEVELS + 1], lev[MAX_LEVELS + 1], depth = 0;
    for (int b = 0; b < w; b++) {
        idx[depth] = b;
        lev[depth++] = 0;
        while (depth >= 2 && lev[depth - 1] == lev[depth - 2]) {
            add_into(blocks + (int64_t)idx[depth - 2] * n, blocks + (int64_t)idx[depth - 1] * n, n);
            lev[depth - 2]++;
            depth--;
        }
    }
    for (; depth >= 2; depth--) add_into(blocks + (int64_t)idx[depth - 2] * n, blocks + (int64_t)idx[depth - 1] * n, n);
    /* the bottom entry is block 0: the result is in place there */
}

double anneal_det_sum_f64(const double *x, int64_t n) {
    double v[MAX_LEVELS + 1];
    int lev[MAX_LEVELS + 1], depth = 0;
    for (int64_t j = 0; j < n; j++) {
        v[depth] = x[j];
        lev[depth++] = 0;
        while (depth >= 2 && lev[depth - 1] == lev[depth - 2]) {
            v[depth - 2] = v[depth - 2] + v[depth - 1];
            lev[depth - 2]++;
            depth--;
        }
    }
    for (; depth >= 2; depth--) v[depth - 2] = v[depth - 2] + v[depth - 1];
    return depth ? v[0] : 0.0;
}

/* ------------------------------------------------------------- across ranks */

#define DET_TAG 31007 /* point-to-point tag of the butterfly (0 <= tag < 32768) */

static bool is_pow2(int w) { return w > 0 && (w & (w - 1)) == 0; }

/* Floats of scratch the combine of n floats needs over w ranks. */
static int64_t scratch_need(int w, int64_t n) { return is_pow2(w) ? n : (int64_t)w * n; }

/* Leaves the tree over every rank's n floats (rank order) in buf, on every rank.
 * W a power of two: a butterfly, log2 W rounds; in round k rank r swaps its group's
 * sum with rank r ^ k's and both compute lower group + upper group (the same operands
 * in the same order: the same bits), which is the complete tree's node over the two
 * groups. Scratch: n floats. Otherwise: all-gather into scratch (W x n) and the tree
 * over the W blocks on every rank. */
static anneal_status gather_combine(anneal_comm *c, float *buf, int64_t n, float *scratch) {
    int w = anneal_comm_size(c), r = anneal_comm_rank(c);
    if (!is_pow2(w)) {
        anneal_status s = anneal_comm_all_gather(c, buf, scratch, n, ANNEAL_F32);
        if (s != ANNEAL_OK) return s;
        anneal_det_combine_blocks(scratch, w, n);
        memcpy(buf, scratch, (size_t)n * sizeof(float));
        return ANNEAL_OK;
    }
    for (int k = 1; k < w; k <<= 1) {
        int peer = r ^ k;
        anneal_comm_request *rq = NULL, *sq = NULL;
        anneal_status s = anneal_comm_recv_start(c, scratch, n, ANNEAL_F32, peer, DET_TAG, &rq);
        if (s == ANNEAL_OK) s = anneal_comm_send_start(c, buf, n, ANNEAL_F32, peer, DET_TAG, &sq);
        anneal_status ws = anneal_comm_wait(sq), wr = anneal_comm_wait(rq); /* never leave MPI writing */
        if (s == ANNEAL_OK) s = ws != ANNEAL_OK ? ws : wr;
        if (s != ANNEAL_OK) return s;
        if (r & k) { /* the peer's group is the left one: buf = peer + buf */
            for (int64_t i = 0; i < n; i++) buf[i] = scratch[i] + buf[i];
        } else {
            add_into(buf, scratch, n);
        }
    }
    return ANNEAL_OK;
}

anneal_status anneal_det_allreduce(anneal_comm *c, float *buf, int64_t n) {
    if (!c || (!buf && n > 0)) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_det_allreduce: NULL argument");
    int w = anneal_comm_size(c);
    if (w == 1 || n == 0) return ANNEAL_OK;
    float *scratch = malloc((size_t)scratch_need(w, n) * sizeof(float));
    if (!scratch) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory for a deterministic all-reduce");
    anneal_status s = gather_combine(c, buf, n, scratch);
    free(scratch);
    return s;
}

anneal_status anneal_det_allreduce_f64(anneal_comm *c, double *x) {
    if (!c || !x) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_det_allreduce_f64: NULL argument");
    int w = anneal_comm_size(c);
    if (w == 1) return ANNEAL_OK;
    double *all = malloc((size_t)w * sizeof *all);
    if (!all) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory for a deterministic all-reduce");
    /* 8-byte elements: the doubles travel as raw I64 bits */
    anneal_status s = anneal_comm_all_gather(c, x, all, 1, ANNEAL_I64);
    if (s == ANNEAL_OK) *x = anneal_det_sum_f64(all, w);
    free(all);
    return s;
}

/* ------------------------------------------------------- the sync's comm hook */

struct anneal_det_sync {
    anneal_ddp *d;
    float *scratch; /* world x the largest bucket, kept between steps */
    int64_t cap;
};

/* Bucket k: the tree over the ranks' buffers, in rank order, identical on every rank. */
static anneal_status det_hook(void *user, anneal_ddp *d, int k, float *buf) {
    anneal_det_sync *s = user;
    anneal_comm *c = anneal_ddp_comm(d);
    int64_t n = anneal_ddp_bucket(d, k).numel, need = scratch_need(anneal_comm_size(c), n);
    if (anneal_comm_size(c) == 1 || n == 0) return ANNEAL_OK;
    if (need > s->cap) {
        float *p = realloc(s->scratch, (size_t)need * sizeof(float));
        if (!p) return anneal_set_error(ANNEAL_ERR_OOM, "out of memory for a deterministic all-reduce");
        s->scratch = p;
        s->cap = need;
    }
    return gather_combine(c, buf, n, s->scratch);
}

anneal_det_sync *anneal_det_sync_new(anneal_ddp *d) {
    if (!d) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_det_sync_new: NULL sync");
        return NULL;
    }
    /* ZeRO 1-3: the hook leaves the whole combined bucket on every rank (the rank keeps
     * its chunk), so the norm can be summed per parameter, as at stage 0 */
    if (anneal_ddp_set_full_norm(d) != ANNEAL_OK) return NULL;
    anneal_det_sync *s = calloc(1, sizeof *s);
    if (!s) {
        anneal_set_error(ANNEAL_ERR_OOM, "out of memory for the deterministic gradient sync");
        return NULL;
    }
    s->d = d;
    if (anneal_ddp_set_comm_hook(d, det_hook, s) != ANNEAL_OK) {
        free(s);
        return NULL;
    }
    return s;
}

void anneal_det_sync_free(anneal_det_sync *s) {
    if (!s) return;
    /* removing the hook fails only in the middle of a sync (then d is being torn down
     * too): the error being reported is kept */
    anneal_status code = anneal_last_status();
    char keep[1024];
    snprintf(keep, sizeof keep, "%s", anneal_last_error());
    if (anneal_ddp_set_comm_hook(s->d, NULL, NULL) != ANNEAL_OK) {
        anneal_clear_error();
        if (code != ANNEAL_OK) anneal_set_error(code, "%s", keep);
    }
    free(s->scratch);
    free(s);
}

int64_t anneal_det_sync_memory_bytes(const anneal_det_sync *s) { return s ? s->cap * (int64_t)sizeof(float) : 0; }
