/* Data loader: B windows of T+1 tokens per batch from memory-mapped token shards
 * concatenated in name order, in a per-epoch Feistel permutation (permutation.h) or
 * in order, split across ranks, with an exact cursor and an optional prefetch thread.
 *
 * Positions. The global window sequence is epoch after epoch of W windows. The loader
 * keeps (epoch, index) = the global position of the first window of its next step
 * (the same on every rank) and the step count; a step reads global positions
 * (epoch, index) + rank*B + b for b in [0, B) and then moves (epoch, index) on by
 * B*world. Started at 0 this is g = step*B*world + rank*B + b. Because the cursor
 * stores the position rather than only the step, a run resumed with another B or
 * world continues exactly where the data stopped (no window skipped or repeated).
 *
 * Cost. Opening verifies every shard's checksum (and every id): one sequential read
 * of all the token bytes, about 1.3 s per GB from page cache on a 2-core box, which
 * catches corruption before training rather than as a wrong batch hours later. A
 * batch costs B binary searches over the shard index (log #shards) and B*(T+1)
 * token reads: nothing scales with N. Shuffled order costs O(1) memory (no table).
 *
 * Prefetch. A pthread fills one of two staging buffers with the batch at the cursor
 * while the caller trains; next() waits for it, hands the worker the following batch
 * (into the other buffer) and copies the ready one out. Jobs carry a generation
 * number so set_cursor simply posts a new job and a stale result is dropped. The
 * loader is used from one thread at a time (the worker is internal). */
#include "anneal/trace.h"
#include "anneal/loader.h"
#include "anneal/shard.h"
#include "data/permutation.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct anneal_loader {
    anneal_loader_config cfg;
    anneal_shard **shards; /* n_shards open shards in concatenation order */
    size_t n_shards;
    uint64_t *start;   /* n_shards + 1: start[i] = tokens before shard i; start[n] = N */
    uint64_t n_tokens; /* N */
    uint64_t windows;  /* W = floor((N - 1) / T) */
    uint64_t fingerprint;
    uint32_t vocab_size;
    size_t batch_elems; /* B * T */
    /* cursor (caller's thread only) */
    uint64_t epoch, index, step;

    /* prefetch: every field below is guarded by mu, except buf contents (see header) */
    bool threaded;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* worker waits for a job or quit */
    pthread_cond_t done_cv; /* next() waits for the current job */
    bool quit;
    bool pending;     /* a job is posted and not yet taken */
    uint64_t job_gen; /* generation of the latest posted job */
    uint64_t job_epoch, job_index;
    int job_slot;                         /* buffer the latest posted job fills */
    bool ready;                           /* the latest posted job is done (filling cannot fail) */
    int32_t *buf_ids[2], *buf_targets[2]; /* B*T each */
};

/* ------------------------------------------------------------ positions */

/* (epoch, index) + off in the global sequence of W-window epochs. */
static void advance(uint64_t W, uint64_t *epoch, uint64_t *index, uint64_t off) {
    uint64_t q = off / W, r = off % W;
    uint64_t i = *index + r; /* < 2W: no overflow for any realistic W (< 2^63) */
    if (i >= W) {
        i -= W;
        q++;
    }
    *index = i;
    *epoch += q;
}

/* Copies tokens [pos, pos + n) of the concatenated shards into out (pos + n <= N),
 * crossing shard boundaries (including empty shards) as needed. */
static void copy_tokens(const anneal_loader *l, uint64_t pos, uint64_t n, int32_t *out) {
    /* largest i with start[i] <= pos; then start[i+1] > pos since pos < N */
    size_t lo = 0, hi = l->n_shards; /* answer in [lo, hi) */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (l->start[mid] <= pos)
            lo = mid;
        else
            hi = mid;
    }
    size_t i = lo;
    while (n > 0) {
        const anneal_shard *s = l->shards[i];
        uint64_t off = pos - l->start[i], avail = s->info.n_tokens - off;
        uint64_t take = n < avail ? n : avail;
        if (s->info.token_bytes == 2) {
            const uint16_t *src = (const uint16_t *)s->tokens + off;
            for (uint64_t k = 0; k < take; k++) out[k] = (int32_t)src[k];
        } else {
            const uint32_t *src = (const uint32_t *)s->tokens + off;
            for (uint64_t k = 0; k < take; k++) out[k] = (int32_t)src[k];
        }
        out += take;
        pos += take;
        n -= take;
        i++;
    }
}

/* Fills the batch whose first global window (over all ranks) is (epoch, index):
 * rows b in [0, B) are global positions + rank*B + b. Reads only immutable state,
 * so the prefetch worker may run it. */
static void fill_batch(const anneal_loader *l, uint64_t epoch, uint64_t index, int32_t *ids,
                       int32_t *targets) {
    const uint64_t W = l->windows, T = (uint64_t)l->cfg.seq, B = (uint64_t)l->cfg.batch;
    uint64_t e = epoch, i = index;
    advance(W, &e, &i, (uint64_t)l->cfg.rank * B);
    anneal_perm perm;
    bool have_perm = false;
    for (uint64_t b = 0; b < B; b++) {
        uint64_t w = i;
        if (l->cfg.shuffle) {
            if (!have_perm || perm.epoch != e) {
                anneal_perm_init(&perm, W, l->cfg.seed, e);
                have_perm = true;
            }
            w = anneal_perm_apply(&perm, i);
        }
        int32_t *row_ids = ids + b * T, *row_tg = targets + b * T;
        copy_tokens(l, w * T, T, row_ids); /* tokens [wT, wT+T) */
        if (T > 1) memcpy(row_tg, row_ids + 1, (T - 1) * sizeof(int32_t));
        copy_tokens(l, w * T + T, 1, row_tg + T - 1); /* token wT+T */
        advance(W, &e, &i, 1);
    }
}

/* ------------------------------------------------------------- prefetch */

/* The worker: takes the latest job, fills its buffer outside the lock, publishes it
 * if no newer job was posted meanwhile. */
static void *prefetch_main(void *arg) {
    anneal_loader *l = arg;
    anneal_trace_thread_name("loader prefetch");
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->quit && !l->pending) pthread_cond_wait(&l->work_cv, &l->mu);
        if (l->quit) break;
        uint64_t gen = l->job_gen, e = l->job_epoch, i = l->job_index;
        int slot = l->job_slot;
        l->pending = false;
        pthread_mutex_unlock(&l->mu);
        int64_t span_t0 = anneal_span_begin();
        fill_batch(l, e, i, l->buf_ids[slot], l->buf_targets[slot]);
        anneal_span_end(ANNEAL_SPAN_LOADER, "prefetch batch", span_t0, 0, (double)l->batch_elems * 8.0);
        pthread_mutex_lock(&l->mu);
        if (gen == l->job_gen) {
            l->ready = true;
            pthread_cond_broadcast(&l->done_cv);
        }
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* Posts the batch at the current cursor as the worker's next job (caller holds mu). */
static void post_job_locked(anneal_loader *l) {
    l->job_gen++;
    l->job_epoch = l->epoch;
    l->job_index = l->index;
    l->job_slot ^= 1; /* never the buffer the caller may still be copying from */
    l->pending = true;
    l->ready = false;
    pthread_cond_signal(&l->work_cv);
}

/* Starts the worker and its first job; on failure the loader runs without prefetch. */
static void prefetch_start(anneal_loader *l) {
    for (int s = 0; s < 2; s++) {
        l->buf_ids[s] = malloc(l->batch_elems * sizeof(int32_t));
        l->buf_targets[s] = malloc(l->batch_elems * sizeof(int32_t));
        if (!l->buf_ids[s] || !l->buf_targets[s]) return; /* freed by anneal_loader_free */
    }
    if (pthread_mutex_init(&l->mu, NULL) != 0) return;
    if (pthread_cond_init(&l->work_cv, NULL) != 0) {
        pthread_mutex_destroy(&l->mu);
        return;
    }
    if (pthread_cond_init(&l->done_cv, NULL) != 0) {
        pthread_cond_destroy(&l->work_cv);
        pthread_mutex_destroy(&l->mu);
        return;
    }
    l->job_slot = 1;
    post_job_locked(l); /* no thread yet: no lock needed */
    if (pthread_create(&l->thread, NULL, prefetch_main, l) != 0) {
        pthread_cond_destroy(&l->done_cv);
        pthread_cond_destroy(&l->work_cv);
        pthread_mutex_destroy(&l->mu);
        return;
    }
    l->threaded = true;
}

/* --------------------------------------------------------------- open */

/* Duplicates s, or NULL when out of memory. */
static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* qsort order of file names: byte order (strcmp), as `ls` in the C locale. */
static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Frees n strings and the array. */
static void free_names(char **names, size_t n) {
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

/* Lists "<dir>/<split>_*.bin" sorted by file name into *out (*n entries, full paths).
 * No match is ANNEAL_ERR_IO naming the directory and the split. */
static anneal_status list_split(const char *dir, const char *split, char ***out, size_t *n) {
    DIR *d = opendir(dir);
    if (!d)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open directory: %s", dir,
                                strerror(errno));
    size_t plen = strlen(split), cap = 0, cnt = 0;
    char **names = NULL;
    struct dirent *ent;
    anneal_status st = ANNEAL_OK;
    while ((ent = readdir(d)) != NULL) {
        const char *nm = ent->d_name;
        size_t len = strlen(nm);
        if (len < plen + 1 + 4 || strncmp(nm, split, plen) != 0 || nm[plen] != '_' ||
            strcmp(nm + len - 4, ".bin") != 0)
            continue;
        if (cnt == cap) {
            size_t nc = cap ? 2 * cap : 16;
            char **nn = realloc(names, nc * sizeof *nn);
            if (!nn) {
                st = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory listing shards", dir);
                break;
            }
            names = nn;
            cap = nc;
        }
        if (!(names[cnt] = dup_str(nm))) {
            st = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory listing shards", dir);
            break;
        }
        cnt++;
    }
    closedir(d);
    if (st == ANNEAL_OK && cnt == 0)
        st = anneal_set_error(ANNEAL_ERR_IO,
                              "%s: no shards for split '%s' (expected files %s_*.bin)", dir, split,
                              split);
    if (st != ANNEAL_OK) {
        free_names(names, cnt);
        return st;
    }
    qsort(names, cnt, sizeof *names, cmp_names);
    size_t dlen = strlen(dir);
    for (size_t i = 0; i < cnt; i++) {
        char *full = malloc(dlen + 1 + strlen(names[i]) + 1);
        if (!full) {
            free_names(names, cnt);
            return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory listing shards", dir);
        }
        sprintf(full, "%s/%s", dir, names[i]);
        free(names[i]);
        names[i] = full;
    }
    *out = names;
    *n = cnt;
    return ANNEAL_OK;
}

/* Checks the configuration: B, T > 0, world >= 1, rank in [0, world), sizes that fit. */
static anneal_status check_config(const anneal_loader_config *c) {
    if (c->batch <= 0 || c->seq <= 0)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "loader: batch (B=%lld) and seq (T=%lld) must be > 0",
                                (long long)c->batch, (long long)c->seq);
    if (c->world < 1 || c->rank < 0 || c->rank >= c->world)
        return anneal_set_error(ANNEAL_ERR_ARG, "loader: rank %d is outside [0, world=%d)", c->rank,
                                c->world);
    if ((uint64_t)c->batch > (uint64_t)INT64_MAX / (uint64_t)c->world ||
        (uint64_t)c->batch > SIZE_MAX / 4 / (uint64_t)c->seq)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "loader: batch B=%lld x seq T=%lld x world %d is too large",
                                (long long)c->batch, (long long)c->seq, c->world);
    return ANNEAL_OK;
}

anneal_status anneal_loader_open(const char *path, const char *split,
                                 const anneal_loader_config *cfg, anneal_loader **out) {
    if (!out) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_loader_open: out is NULL");
    *out = NULL;
    if (!path || !cfg)
        return anneal_set_error(ANNEAL_ERR_ARG, "anneal_loader_open: path or cfg is NULL");
    anneal_status st = check_config(cfg);
    if (st) return st;

    struct stat sb;
    if (stat(path, &sb) != 0)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot open data%s%s: %s", path,
                                split ? " for split " : "", split ? split : "", strerror(errno));
    char **files = NULL;
    size_t n_files = 0;
    if (S_ISDIR(sb.st_mode)) {
        if (!split || !*split)
            return anneal_set_error(ANNEAL_ERR_ARG,
                                    "%s: a directory needs a split name (train, val)", path);
        if ((st = list_split(path, split, &files, &n_files))) return st;
    } else {
        files = malloc(sizeof *files);
        if (!files || !(files[0] = dup_str(path))) {
            free(files);
            return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
        }
        n_files = 1;
    }

    anneal_loader *l = calloc(1, sizeof *l);
    if (l) {
        l->shards = calloc(n_files, sizeof *l->shards);
        l->start = calloc(n_files + 1, sizeof *l->start);
    }
    if (!l || !l->shards || !l->start) {
        free_names(files, n_files);
        anneal_loader_free(l);
        return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory opening the loader", path);
    }
    l->cfg = *cfg;
    for (size_t i = 0; i < n_files && st == ANNEAL_OK; i++) {
        if ((st = anneal_interrupt_check("opening the data shards")) != ANNEAL_OK) break;
        if ((st = anneal_shard_open(files[i], true, &l->shards[i]))) break;
        l->n_shards = i + 1;
        const anneal_shard_info *a = &l->shards[0]->info, *b = &l->shards[i]->info;
        if (b->tokenizer_fingerprint != a->tokenizer_fingerprint)
            st = anneal_set_error(ANNEAL_ERR_FORMAT,
                                  "%s: tokenizer fingerprint %016llx differs from %016llx of %s: "
                                  "all shards must come from one tokenizer",
                                  files[i], (unsigned long long)b->tokenizer_fingerprint,
                                  (unsigned long long)a->tokenizer_fingerprint, files[0]);
        else if (b->vocab_size != a->vocab_size)
            st = anneal_set_error(ANNEAL_ERR_FORMAT,
                                  "%s: vocab size %u differs from %u of %s: all shards must come "
                                  "from one tokenizer",
                                  files[i], b->vocab_size, a->vocab_size, files[0]);
        else if (b->vocab_size > (uint32_t)INT32_MAX + 1u)
            st = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                  "%s: vocab size %u does not fit int32 token ids", files[i],
                                  b->vocab_size);
        l->start[i + 1] = l->start[i] + b->n_tokens;
    }
    if (st == ANNEAL_OK) {
        const uint64_t T = (uint64_t)cfg->seq;
        l->n_tokens = l->start[l->n_shards];
        l->fingerprint = l->shards[0]->info.tokenizer_fingerprint;
        l->vocab_size = l->shards[0]->info.vocab_size;
        l->windows = l->n_tokens > 0 ? (l->n_tokens - 1) / T : 0;
        l->batch_elems = (size_t)cfg->batch * (size_t)cfg->seq;
        if (l->windows == 0)
            st = anneal_set_error(
                ANNEAL_ERR_ARG,
                "%s%s%s: %llu tokens in %zu shard(s), but one window of seq T=%lld "
                "needs %llu (T+1)",
                path, split && S_ISDIR(sb.st_mode) ? " split " : "",
                split && S_ISDIR(sb.st_mode) ? split : "", (unsigned long long)l->n_tokens,
                l->n_shards, (long long)cfg->seq, (unsigned long long)(T + 1));
    }
    free_names(files, n_files);
    if (st) {
        anneal_loader_free(l);
        return st;
    }
    if (cfg->prefetch) prefetch_start(l);
    *out = l;
    return ANNEAL_OK;
}

void anneal_loader_free(anneal_loader *l) {
    if (!l) return;
    if (l->threaded) {
        pthread_mutex_lock(&l->mu);
        l->quit = true;
        pthread_cond_broadcast(&l->work_cv);
        pthread_mutex_unlock(&l->mu);
        pthread_join(l->thread, NULL);
        pthread_cond_destroy(&l->done_cv);
        pthread_cond_destroy(&l->work_cv);
        pthread_mutex_destroy(&l->mu);
    }
    for (int s = 0; s < 2; s++) {
        free(l->buf_ids[s]);
        free(l->buf_targets[s]);
    }
    for (size_t i = 0; i < l->n_shards; i++) anneal_shard_close(l->shards[i]);
    free(l->shards);
    free(l->start);
    free(l);
}

/* ------------------------------------------------------------- batches */

anneal_status anneal_loader_next(anneal_loader *l, int32_t *ids, int32_t *targets) {
    if (!l || !ids || !targets)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "anneal_loader_next: loader, ids or targets is NULL");
    const uint64_t stride = (uint64_t)l->cfg.batch * (uint64_t)l->cfg.world;
    if (!l->threaded) {
        fill_batch(l, l->epoch, l->index, ids, targets);
        advance(l->windows, &l->epoch, &l->index, stride);
        l->step++;
        return ANNEAL_OK;
    }
    pthread_mutex_lock(&l->mu);
    while (!l->ready) pthread_cond_wait(&l->done_cv, &l->mu);
    int slot = l->job_slot;
    advance(l->windows, &l->epoch, &l->index, stride);
    l->step++;
    post_job_locked(l); /* fills the other buffer while we copy this one */
    pthread_mutex_unlock(&l->mu);
    memcpy(ids, l->buf_ids[slot], l->batch_elems * sizeof(int32_t));
    memcpy(targets, l->buf_targets[slot], l->batch_elems * sizeof(int32_t));
    return ANNEAL_OK;
}

anneal_loader_cursor anneal_loader_get_cursor(const anneal_loader *l) {
    anneal_loader_cursor c = {0, 0, 0};
    if (l) {
        c.epoch = l->epoch;
        c.index = l->index;
        c.step = l->step;
    }
    return c;
}

anneal_status anneal_loader_set_cursor(anneal_loader *l, anneal_loader_cursor c) {
    if (!l) return anneal_set_error(ANNEAL_ERR_ARG, "anneal_loader_set_cursor: loader is NULL");
    if (c.index >= l->windows)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "loader cursor: index %llu is outside the %llu windows of an epoch "
                                "(was it saved for other data or another seq length?)",
                                (unsigned long long)c.index, (unsigned long long)l->windows);
    if (!l->threaded) {
        l->epoch = c.epoch;
        l->index = c.index;
        l->step = c.step;
        return ANNEAL_OK;
    }
    pthread_mutex_lock(&l->mu);
    l->epoch = c.epoch;
    l->index = c.index;
    l->step = c.step;
    post_job_locked(l); /* a job in flight finishes into the other buffer and is dropped */
    pthread_mutex_unlock(&l->mu);
    return ANNEAL_OK;
}

uint64_t anneal_loader_windows(const anneal_loader *l) { return l ? l->windows : 0; }
uint64_t anneal_loader_fingerprint(const anneal_loader *l) { return l ? l->fingerprint : 0; }
uint32_t anneal_loader_vocab_size(const anneal_loader *l) { return l ? l->vocab_size : 0; }
