/* PowerSGD gradient compression (Vogels, Karimireddy, Jaggi 2019) as a communication
 * hook on the data-parallel buckets of ddp.c, computing what PyTorch's powerSGD_hook
 * computes (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, torch 1.13:
 * use_error_feedback and warm_start on, orthogonalization_epsilon 0,
 * batch_tensors_with_same_shape off). For bucket k on every rank, in bucket order:
 *
 *   buf += e_k;  cp = buf
 *   tensors split: gradient viewed as shape[0] x rest (n x m), r = min(n, m, rank);
 *     compressed when (n + m) * r * min_compression_rate < n * m, else "uncompressed"
 *   uncompressed ones: concatenated, all-reduce(sum) / world, copied back
 *   compressed ones, in PyTorch's order (grouped by shape, first appearance first):
 *     Q orthogonalized (Gram-Schmidt), P = M Q, all-reduce(P), P orthogonalized,
 *     Q = M^T P, all-reduce(Q) / world, M = P Q^T (written into buf)
 *   e_k = cp - buf
 *
 * Q stays for the next step (warm start). The first Q of a bucket comes from a normal
 * distribution (splitmix64 + Box-Muller) seeded by (seed, bucket): identical on every
 * rank, not the numpy/torch generator PyTorch uses (parity tests set Q explicitly).
 * The first warmup_steps synchronisations are plain all-reduces (PyTorch's
 * start_powerSGD_iter). Differences from PyTorch: torch 1.13 orthogonalizes by QR
 * (Householder) when rank > 2; the resulting columns can differ in sign from
 * Gram-Schmidt's, which leaves P Q^T unchanged. A column of zeros (a matrix that got no
 * gradient anywhere) stays zero here where PyTorch's division by a zero norm gives NaN.
 *
 * State file (anneal_powersgd_save), little-endian as the host writes it:
 *   "ANPSGD01" | u32 world | u32 rank of the writer | u32 approximation rank |
 *   u32 buckets | i64 steps | i64 total_bytes | i64 total_bytes_uncompressed |
 *   per bucket: i64 numel | i64 q_numel | u32 has_state | u32 0 |
 *   then for each bucket with has_state: numel f32 error, q_numel f32 Q. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "anneal/fs.h"
#include "parallel/comm_internal.h"

typedef struct psgd_mat {
    int param;
    int64_t off;     /* first element in the bucket */
    int64_t n, m;    /* rows (shape[0]), columns (the rest) */
    int r;
    int64_t p_off, q_off;
} psgd_mat;

typedef struct psgd_bucket {
    int64_t numel;
    psgd_mat *mats; /* compressed, in PyTorch's P/Q memory order */
    int n_mats;
    int *plain;     /* uncompressed parameters, in bucket order */
    int64_t *plain_off; /* their first elements in the bucket */
    int n_plain;
    int64_t plain_numel, p_numel, q_numel;
    float *err, *q, *p, *cp, *plain_buf;
    bool has_state; /* Q and error exist (after the first compressed step or a load) */
} psgd_bucket;

struct anneal_powersgd {
    anneal_ddp *d;
    anneal_powersgd_config cfg;
    int nb;
    psgd_bucket *b;
    anneal_powersgd_stats st;
    int64_t step_bytes, step_bytes_plain; /* this synchronisation so far */
};

anneal_powersgd_config anneal_powersgd_defaults(void) {
    anneal_powersgd_config c = {.rank = 1, .warmup_steps = 10, .seed = 0, .min_compression_rate = 2.0};
    return c;
}

/* splitmix64: the next 64 random bits of *s. */
static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* n standard normal floats from the generator *s (Box-Muller on 53-bit uniforms). */
static void fill_normal(float *x, int64_t n, uint64_t *s) {
    for (int64_t i = 0; i < n; i += 2) {
        double u1 = ((double)(splitmix(s) >> 11) + 1.0) / 9007199254740993.0; /* (0, 1] */
        double u2 = (double)(splitmix(s) >> 11) / 9007199254740992.0;
        double rad = sqrt(-2.0 * log(u1));
        x[i] = (float)(rad * cos(6.283185307179586 * u2));
        if (i + 1 < n) x[i + 1] = (float)(rad * sin(6.283185307179586 * u2));
    }
}

/* Gram-Schmidt on the columns of the rows x cols row-major a (cols <= rows), as
 * PyTorch's _orthogonalize_gram_schmidt: each column divided by its norm (a zero
 * column stays zero), then its projection removed from the later columns. */
static void orthogonalize(float *a, int64_t rows, int cols) {
    for (int i = 0; i < cols; i++) {
        double ss = 0;
        for (int64_t k = 0; k < rows; k++) ss += (double)a[k * cols + i] * a[k * cols + i];
        float norm = (float)sqrt(ss);
        for (int64_t k = 0; k < rows; k++) a[k * cols + i] = norm > 0 ? a[k * cols + i] / norm : 0.0f;
        for (int j = i + 1; j < cols; j++) {
            double dot = 0;
            for (int64_t k = 0; k < rows; k++) dot += (double)a[k * cols + i] * a[k * cols + j];
            float fd = (float)dot;
            for (int64_t k = 0; k < rows; k++) a[k * cols + j] -= fd * a[k * cols + i];
        }
    }
}

/* p (n x r) = m (n x cols) q (cols x r), all row-major. */
static void mat_mq(const float *m, const float *q, float *p, int64_t n, int64_t cols, int r) {
    for (int64_t i = 0; i < n; i++) {
        float *pi = p + i * r;
        for (int c = 0; c < r; c++) pi[c] = 0.0f;
        const float *mi = m + i * cols;
        for (int64_t j = 0; j < cols; j++) {
            float a = mi[j];
            const float *qj = q + j * r;
            for (int c = 0; c < r; c++) pi[c] += a * qj[c];
        }
    }
}

/* q (cols x r) = m^T p. */
static void mat_mtp(const float *m, const float *p, float *q, int64_t n, int64_t cols, int r) {
    memset(q, 0, (size_t)(cols * r) * sizeof *q);
    for (int64_t i = 0; i < n; i++) {
        const float *mi = m + i * cols, *pi = p + i * r;
        for (int64_t j = 0; j < cols; j++) {
            float a = mi[j];
            float *qj = q + j * r;
            for (int c = 0; c < r; c++) qj[c] += a * pi[c];
        }
    }
}

/* m (n x cols) = p q^T. */
static void mat_pqt(const float *p, const float *q, float *m, int64_t n, int64_t cols, int r) {
    for (int64_t i = 0; i < n; i++) {
        const float *pi = p + i * r;
        for (int64_t j = 0; j < cols; j++) {
            const float *qj = q + j * r;
            float acc = 0.0f;
            for (int c = 0; c < r; c++) acc += pi[c] * qj[c];
            m[i * cols + j] = acc;
        }
    }
}

static void free_bucket(psgd_bucket *b) {
    free(b->mats);
    free(b->plain);
    free(b->plain_off);
    free(b->err);
    free(b->q);
    free(b->p);
    free(b->cp);
    free(b->plain_buf);
}

void anneal_powersgd_free(anneal_powersgd *p) {
    if (!p) return;
    if (p->d) anneal_ddp_set_comm_hook(p->d, NULL, NULL);
    for (int k = 0; k < p->nb; k++) free_bucket(&p->b[k]);
    free(p->b);
    free(p);
}

static bool same_shape(const anneal_tensor *a, const anneal_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

/* Splits bucket k into compressed matrices (grouped by shape in order of first
 * appearance, as PyTorch's shape_to_tensors dict) and uncompressed tensors. */
static bool plan_bucket(anneal_powersgd *p, int k) {
    anneal_ddp_bucket_info bi = anneal_ddp_bucket(p->d, k);
    const anneal_params *ps = anneal_ddp_params(p->d);
    psgd_bucket *b = &p->b[k];
    int np = bi.last_param - bi.first_param + 1;
    b->numel = bi.numel;
    b->mats = calloc((size_t)np, sizeof *b->mats);
    b->plain = calloc((size_t)np, sizeof *b->plain);
    b->plain_off = calloc((size_t)np, sizeof *b->plain_off);
    bool *compress = calloc((size_t)np, sizeof *compress);
    int64_t *off = calloc((size_t)np, sizeof *off);
    if (!b->mats || !b->plain || !b->plain_off || !compress || !off) {
        free(compress);
        free(off);
        return false;
    }
    int64_t at = 0;
    for (int i = 0; i < np; i++) {
        const anneal_tensor *t = ps->items[bi.first_param + i].tensor;
        int64_t numel = anneal_numel(t), n = t->ndim > 0 ? t->shape[0] : 1, m = n > 0 ? numel / n : 0;
        int64_t r = p->cfg.rank < n ? p->cfg.rank : n;
        if (m < r) r = m;
        off[i] = at;
        at += numel;
        compress[i] = numel > 0 && (double)((n + m) * r) * p->cfg.min_compression_rate < (double)(n * m);
        if (!compress[i]) {
            b->plain_off[b->n_plain] = off[i];
            b->plain[b->n_plain++] = bi.first_param + i;
            b->plain_numel += numel;
        }
    }
    bool *done = calloc((size_t)np, sizeof *done);
    if (!done) {
        free(compress);
        free(off);
        return false;
    }
    for (int i = 0; i < np; i++) {
        if (!compress[i] || done[i]) continue;
        const anneal_tensor *ti = ps->items[bi.first_param + i].tensor;
        for (int j = i; j < np; j++) {
            const anneal_tensor *tj = ps->items[bi.first_param + j].tensor;
            if (!compress[j] || done[j] || !same_shape(ti, tj)) continue;
            done[j] = true;
            psgd_mat *mt = &b->mats[b->n_mats++];
            mt->param = bi.first_param + j;
            mt->off = off[j];
            mt->n = tj->shape[0];
            mt->m = anneal_numel(tj) / mt->n;
            mt->r = (int)(p->cfg.rank < mt->n ? (p->cfg.rank < mt->m ? p->cfg.rank : mt->m) : (mt->n < mt->m ? mt->n : mt->m));
            mt->p_off = b->p_numel;
            mt->q_off = b->q_numel;
            b->p_numel += mt->n * mt->r;
            b->q_numel += mt->m * mt->r;
        }
    }
    free(done);
    free(compress);
    free(off);
    size_t n1 = (size_t)(b->numel > 0 ? b->numel : 1);
    b->cp = malloc(n1 * sizeof *b->cp);
    b->p = malloc((size_t)(b->p_numel > 0 ? b->p_numel : 1) * sizeof *b->p);
    b->plain_buf = malloc((size_t)(b->plain_numel > 0 ? b->plain_numel : 1) * sizeof *b->plain_buf);
    return b->cp && b->p && b->plain_buf;
}

/* Error and Q of bucket k allocated (zero error; Q from the seeded generator). */
static bool init_state(anneal_powersgd *p, int k) {
    psgd_bucket *b = &p->b[k];
    if (!b->err) b->err = calloc((size_t)(b->numel > 0 ? b->numel : 1), sizeof *b->err);
    if (!b->q) b->q = calloc((size_t)(b->q_numel > 0 ? b->q_numel : 1), sizeof *b->q);
    if (!b->err || !b->q) return false;
    return true;
}

/* Payload bytes of one all-reduce of n floats. */
static void count(anneal_powersgd *p, int64_t n) { p->step_bytes += n * 4; }

/* Ends a synchronisation after the last bucket: counters moved into the stats. */
static void end_step(anneal_powersgd *p, int k) {
    if (k != p->nb - 1) return;
    p->st.steps++;
    p->st.last_bytes = p->step_bytes;
    p->st.last_bytes_uncompressed = p->step_bytes_plain;
    p->st.total_bytes += p->step_bytes;
    p->st.total_bytes_uncompressed += p->step_bytes_plain;
    p->step_bytes = p->step_bytes_plain = 0;
}

/* sum all-reduce of n floats at x, then / world (PyTorch's div_(world_size)). */
static anneal_status allreduce_mean(anneal_powersgd *p, float *x, int64_t n) {
    if (n == 0) return ANNEAL_OK;
    anneal_comm *c = anneal_ddp_comm(p->d);
    count(p, n);
    anneal_status s = anneal_comm_allreduce(c, x, n, ANNEAL_F32, ANNEAL_REDUCE_SUM);
    float w = (float)anneal_comm_size(c);
    for (int64_t i = 0; i < n && s == ANNEAL_OK; i++) x[i] /= w;
    return s;
}

/* The hook (see the top of the file). */
static anneal_status hook(void *user, anneal_ddp *d, int k, float *buf) {
    anneal_powersgd *p = user;
    psgd_bucket *b = &p->b[k];
    anneal_comm *c = anneal_ddp_comm(d);
    const anneal_params *ps = anneal_ddp_params(d);
    p->step_bytes_plain += b->numel * 4;
    if (p->st.steps < p->cfg.warmup_steps) {
        anneal_status s = allreduce_mean(p, buf, b->numel);
        end_step(p, k);
        return s;
    }
    bool fresh = !b->has_state;
    if (fresh && !init_state(p, k)) return anneal_set_error(ANNEAL_ERR_OOM, "PowerSGD: out of memory for bucket %d", k);
    if (fresh) memset(b->err, 0, (size_t)b->numel * sizeof *b->err); /* after anneal_powersgd_reset */
    for (int64_t i = 0; i < b->numel; i++) buf[i] += b->err[i];
    memcpy(b->cp, buf, (size_t)b->numel * sizeof *buf);
    /* uncompressed tensors: element offsets inside the bucket from the flat layout */
    int64_t at = 0;
    for (int i = 0; i < b->n_plain; i++) {
        const anneal_tensor *t = ps->items[b->plain[i]].tensor;
        int64_t off = b->plain_off[i], n = anneal_numel(t);
        memcpy(b->plain_buf + at, buf + off, (size_t)n * sizeof *buf);
        at += n;
    }
    if (fresh) {
        uint64_t s = p->cfg.seed * 0x9e3779b97f4a7c15ULL + (uint64_t)k + 1;
        fill_normal(b->q, b->q_numel, &s);
    }
    for (int i = 0; i < b->n_mats; i++) {
        const psgd_mat *mt = &b->mats[i];
        orthogonalize(b->q + mt->q_off, mt->m, mt->r);
        mat_mq(buf + mt->off, b->q + mt->q_off, b->p + mt->p_off, mt->n, mt->m, mt->r);
    }
    anneal_status s = allreduce_mean(p, b->plain_buf, b->plain_numel);
    at = 0;
    for (int i = 0; i < b->n_plain && s == ANNEAL_OK; i++) {
        const anneal_tensor *t = ps->items[b->plain[i]].tensor;
        int64_t off = b->plain_off[i], n = anneal_numel(t);
        memcpy(buf + off, b->plain_buf + at, (size_t)n * sizeof *buf);
        at += n;
    }
    if (s == ANNEAL_OK && b->p_numel > 0) {
        count(p, b->p_numel);
        s = anneal_comm_allreduce(c, b->p, b->p_numel, ANNEAL_F32, ANNEAL_REDUCE_SUM);
    }
    for (int i = 0; i < b->n_mats && s == ANNEAL_OK; i++) {
        const psgd_mat *mt = &b->mats[i];
        orthogonalize(b->p + mt->p_off, mt->n, mt->r);
        mat_mtp(buf + mt->off, b->p + mt->p_off, b->q + mt->q_off, mt->n, mt->m, mt->r);
    }
    if (s == ANNEAL_OK) s = allreduce_mean(p, b->q, b->q_numel);
    for (int i = 0; i < b->n_mats && s == ANNEAL_OK; i++) {
        const psgd_mat *mt = &b->mats[i];
        mat_pqt(b->p + mt->p_off, b->q + mt->q_off, buf + mt->off, mt->n, mt->m, mt->r);
    }
    if (s != ANNEAL_OK) return s;
    for (int64_t i = 0; i < b->numel; i++) b->err[i] = b->cp[i] - buf[i];
    b->has_state = true;
    end_step(p, k);
    return ANNEAL_OK;
}

anneal_powersgd *anneal_powersgd_new(anneal_ddp *d, anneal_powersgd_config cfg) {
    if (!d) {
        anneal_set_error(ANNEAL_ERR_ARG, "anneal_powersgd_new: NULL sync");
        return NULL;
    }
    if (cfg.rank < 1) {
        anneal_set_error(ANNEAL_ERR_ARG, "PowerSGD: rank %d (must be >= 1)", cfg.rank);
        return NULL;
    }
    if (cfg.warmup_steps < 0 || !(cfg.min_compression_rate > 0)) {
        anneal_set_error(ANNEAL_ERR_ARG, "PowerSGD: warm-up steps %lld and minimum compression rate %g (must be >= 0 "
                         "and > 0)", (long long)cfg.warmup_steps, cfg.min_compression_rate);
        return NULL;
    }
    anneal_powersgd *p = calloc(1, sizeof *p);
    if (!p) goto oom;
    p->cfg = cfg;
    p->d = d;
    p->nb = anneal_ddp_bucket_count(d);
    p->b = calloc((size_t)(p->nb > 0 ? p->nb : 1), sizeof *p->b);
    if (!p->b) goto oom;
    for (int k = 0; k < p->nb; k++)
        if (!plan_bucket(p, k)) goto oom;
    if (anneal_ddp_set_comm_hook(d, hook, p) != ANNEAL_OK) {
        p->d = NULL; /* the hook in place is someone else's */
        anneal_powersgd_free(p);
        return NULL;
    }
    return p;
oom:
    anneal_powersgd_free(p);
    anneal_set_error(ANNEAL_ERR_OOM, "PowerSGD: out of memory setting up the compression state");
    return NULL;
}

void anneal_powersgd_reset(anneal_powersgd *p) {
    for (int k = 0; p && k < p->nb; k++) p->b[k].has_state = false;
}

anneal_powersgd_stats anneal_powersgd_stats_get(const anneal_powersgd *p) {
    anneal_powersgd_stats s = {0};
    return p ? p->st : s;
}

int64_t anneal_powersgd_memory_bytes(const anneal_powersgd *p) {
    int64_t n = 0;
    for (int k = 0; p && k < p->nb; k++) {
        const psgd_bucket *b = &p->b[k];
        n += b->numel + b->p_numel + b->plain_numel; /* cp, P, uncompressed staging */
        if (b->err) n += b->numel;
        if (b->q) n += b->q_numel;
    }
    return n * (int64_t)sizeof(float);
}

int64_t anneal_powersgd_q_numel(const anneal_powersgd *p, int k) {
    return p && k >= 0 && k < p->nb ? p->b[k].q_numel : 0;
}

anneal_status anneal_powersgd_set_q(anneal_powersgd *p, int k, const float *q, int64_t n) {
    if (!p || k < 0 || k >= p->nb || !q)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_powersgd_set_q: no bucket %d", k);
    if (n != p->b[k].q_numel)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_powersgd_set_q: bucket %d has %lld Q elements, got %lld", k,
                                (long long)p->b[k].q_numel, (long long)n);
    if (!init_state(p, k)) return anneal_set_error(ANNEAL_ERR_OOM, "PowerSGD: out of memory for bucket %d", k);
    memcpy(p->b[k].q, q, (size_t)n * sizeof *q);
    p->b[k].has_state = true;
    return ANNEAL_OK;
}

const float *anneal_powersgd_q(const anneal_powersgd *p, int k) {
    return p && k >= 0 && k < p->nb && p->b[k].has_state ? p->b[k].q : NULL;
}

const float *anneal_powersgd_error(const anneal_powersgd *p, int k) {
    return p && k >= 0 && k < p->nb && p->b[k].has_state ? p->b[k].err : NULL;
}

/* ------------------------------------------------------------- state file */

#define PSGD_MAGIC "ANPSGD01"

typedef struct psgd_header {
    char magic[8];
    uint32_t world, rank, approx_rank, buckets;
    int64_t steps, total_bytes, total_bytes_uncompressed;
} psgd_header;

typedef struct psgd_bucket_header {
    int64_t numel, q_numel;
    uint32_t has_state, zero;
} psgd_bucket_header;

anneal_status anneal_powersgd_save(const anneal_powersgd *p, const char *path) {
    if (!p || !path) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_powersgd_save: NULL state or path");
    anneal_comm *c = anneal_ddp_comm(p->d);
    psgd_header h = {.world = (uint32_t)anneal_comm_size(c), .rank = (uint32_t)anneal_comm_rank(c),
                     .approx_rank = (uint32_t)p->cfg.rank, .buckets = (uint32_t)p->nb, .steps = p->st.steps,
                     .total_bytes = p->st.total_bytes, .total_bytes_uncompressed = p->st.total_bytes_uncompressed};
    memcpy(h.magic, PSGD_MAGIC, 8);
    anneal_atomic_file af;
    anneal_status s = anneal_atomic_open(&af, path);
    if (s != ANNEAL_OK) return s;
    s = anneal_atomic_write(&af, &h, sizeof h);
    for (int k = 0; k < p->nb && s == ANNEAL_OK; k++) {
        psgd_bucket_header bh = {p->b[k].numel, p->b[k].q_numel, p->b[k].has_state ? 1u : 0u, 0};
        s = anneal_atomic_write(&af, &bh, sizeof bh);
    }
    for (int k = 0; k < p->nb && s == ANNEAL_OK; k++) {
        const psgd_bucket *b = &p->b[k];
        if (!b->has_state) continue;
        s = anneal_atomic_write(&af, b->err, (size_t)b->numel * sizeof(float));
        if (s == ANNEAL_OK) s = anneal_atomic_write(&af, b->q, (size_t)b->q_numel * sizeof(float));
    }
    if (s != ANNEAL_OK) {
        anneal_atomic_abort(&af);
        return s;
    }
    return anneal_atomic_commit(&af);
}

/* Reads exactly n bytes or records why not. */
static anneal_status read_exact(FILE *f, void *buf, size_t n, const char *path, const char *what) {
    if (n && fread(buf, 1, n, f) != n)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "PowerSGD state %s: truncated (reading %s)", path, what);
    return ANNEAL_OK;
}

/* Checks everything before changing p: a bad file leaves the state as it was. */
anneal_status anneal_powersgd_load(anneal_powersgd *p, const char *path) {
    if (!p || !path) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_powersgd_load: NULL state or path");
    FILE *f = fopen(path, "rb");
    if (!f) return anneal_set_error(ANNEAL_ERR_IO, "PowerSGD state %s: cannot open (%s)", path, strerror(errno));
    anneal_comm *c = anneal_ddp_comm(p->d);
    psgd_header h;
    psgd_bucket_header *bh = calloc((size_t)(p->nb > 0 ? p->nb : 1), sizeof *bh);
    float **err = calloc((size_t)(p->nb > 0 ? p->nb : 1), sizeof *err), **q = calloc((size_t)(p->nb > 0 ? p->nb : 1), sizeof *q);
    anneal_status s = bh && err && q ? read_exact(f, &h, sizeof h, path, "the header")
                                     : anneal_set_error(ANNEAL_ERR_OOM, "PowerSGD state %s: out of memory", path);
    if (s == ANNEAL_OK && memcmp(h.magic, PSGD_MAGIC, 8) != 0)
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "PowerSGD state %s: not a PowerSGD state file (bad magic)", path);
    if (s == ANNEAL_OK && (h.world != (uint32_t)anneal_comm_size(c) || h.rank != (uint32_t)anneal_comm_rank(c)))
        s = anneal_set_error(ANNEAL_ERR_STATE, "PowerSGD state %s: written by rank %u of %u, this is rank %d of %d (the "
                             "error feedback is per rank: resume with the same number of ranks)", path, h.rank, h.world,
                             anneal_comm_rank(c), anneal_comm_size(c));
    if (s == ANNEAL_OK && h.approx_rank != (uint32_t)p->cfg.rank)
        s = anneal_set_error(ANNEAL_ERR_STATE, "PowerSGD state %s: written with --powersgd-rank %u, this run has %d", path,
                             h.approx_rank, p->cfg.rank);
    if (s == ANNEAL_OK && h.buckets != (uint32_t)p->nb)
        s = anneal_set_error(ANNEAL_ERR_STATE, "PowerSGD state %s: %u gradient buckets, this run has %d (same model and "
                             "--bucket-mb needed)", path, h.buckets, p->nb);
    if (s == ANNEAL_OK && (h.steps < 0 || h.total_bytes < 0 || h.total_bytes_uncompressed < 0))
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "PowerSGD state %s: negative counters", path);
    for (int k = 0; k < p->nb && s == ANNEAL_OK; k++) {
        s = read_exact(f, &bh[k], sizeof bh[k], path, "a bucket header");
        if (s == ANNEAL_OK && (bh[k].numel != p->b[k].numel || bh[k].q_numel != p->b[k].q_numel || bh[k].has_state > 1))
            s = anneal_set_error(ANNEAL_ERR_STATE, "PowerSGD state %s: bucket %d has %lld elements and %lld Q elements, "
                                 "this run %lld and %lld (same model and --bucket-mb needed)", path, k,
                                 (long long)bh[k].numel, (long long)bh[k].q_numel, (long long)p->b[k].numel,
                                 (long long)p->b[k].q_numel);
    }
    for (int k = 0; k < p->nb && s == ANNEAL_OK; k++) {
        if (!bh[k].has_state) continue;
        err[k] = malloc((size_t)(bh[k].numel > 0 ? bh[k].numel : 1) * sizeof(float));
        q[k] = malloc((size_t)(bh[k].q_numel > 0 ? bh[k].q_numel : 1) * sizeof(float));
        if (!err[k] || !q[k]) s = anneal_set_error(ANNEAL_ERR_OOM, "PowerSGD state %s: out of memory", path);
        if (s == ANNEAL_OK) s = read_exact(f, err[k], (size_t)bh[k].numel * sizeof(float), path, "an error buffer");
        if (s == ANNEAL_OK) s = read_exact(f, q[k], (size_t)bh[k].q_numel * sizeof(float), path, "a Q buffer");
    }
    if (s == ANNEAL_OK && fgetc(f) != EOF)
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "PowerSGD state %s: trailing bytes after the last bucket", path);
    fclose(f);
    for (int k = 0; k < p->nb && s == ANNEAL_OK; k++) {
        psgd_bucket *b = &p->b[k];
        free(b->err);
        free(b->q);
        b->err = err[k];
        b->q = q[k];
        err[k] = q[k] = NULL;
        b->has_state = bh[k].has_state != 0;
    }
    if (s == ANNEAL_OK) {
        p->st = (anneal_powersgd_stats){.steps = h.steps, .total_bytes = h.total_bytes,
                                        .total_bytes_uncompressed = h.total_bytes_uncompressed};
        p->step_bytes = p->step_bytes_plain = 0;
    }
    for (int k = 0; k < p->nb; k++) {
        if (err) free(err[k]);
        if (q) free(q[k]);
    }
    free(err);
    free(q);
    free(bh);
    return s;
}
