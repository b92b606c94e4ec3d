/* The engine: one thread that owns the model and runs continuous batching. Between
 * passes it drops requests whose client left or whose deadline passed and moves queued
 * requests into free KV-cache slots; each pass over the model then advances every
 * running request by one token and carries the next chunk of the prompts not yet in the
 * cache (up to --prefill-chunk rows in all: a long prompt is prefilled over several
 * passes instead of stalling the running streams). Model work runs outside the lock; the HTTP side only
 * ever waits on a job's condition and reads its text under the lock. */
#include "serve_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct anneal_serve_engine {
    anneal_model *m;
    const anneal_tokenizer *tok;
    anneal_serve_metrics *metrics;
    anneal_serve_batch *batch;
    int slots, qcap, step_delay_ms;
    int64_t prefill_chunk; /* prompt rows per pass over the model, over all prompts */
    int threads; /* the creating thread's OpenMP thread count (--threads) */
    int32_t eot, tok_vocab;
    int64_t V, max_len;
    pthread_mutex_t mu;
    pthread_cond_t work; /* a job arrived, a job was cancelled, or stop was asked */
    pthread_cond_t idle; /* the engine ran out of work */
    pthread_t thread;
    bool started, stopping, cut, quit;
    anneal_serve_job **queue; /* FIFO ring of qcap */
    int qhead, qlen;
    anneal_serve_job **running; /* by slot, NULL when free */
    int n_running;
    float *logits; /* slots x V */
    char *tmp;     /* the stream decoder's output */
    size_t tmp_cap;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

anneal_serve_job *anneal_serve_job_new(int32_t *ids, int64_t n_ids) {
    anneal_serve_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->refs = 1;
    j->ids = ids;
    j->n_ids = n_ids;
    j->slot = -1;
    pthread_cond_init(&j->cv, NULL);
    return j;
}

/* Drops one reference under the lock; frees the job with the last. */
static void unref_locked(anneal_serve_job *j) {
    if (--j->refs > 0) return;
    pthread_cond_destroy(&j->cv);
    for (int i = 0; i < j->n_stop; i++) free(j->stop[i]);
    free(j->ids);
    free(j->text);
    free(j);
}

void anneal_serve_job_release(anneal_serve_engine *e, anneal_serve_job *j) {
    if (!j) return;
    if (!e) { /* never submitted */
        unref_locked(j);
        return;
    }
    pthread_mutex_lock(&e->mu);
    unref_locked(j);
    pthread_mutex_unlock(&e->mu);
}

void anneal_serve_job_cancel(anneal_serve_engine *e, anneal_serve_job *j) {
    pthread_mutex_lock(&e->mu);
    if (j->state != ANNEAL_JOB_DONE) {
        j->cancelled = true;
        pthread_cond_signal(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
}

pthread_mutex_t *anneal_serve_engine_lock(anneal_serve_engine *e) { return &e->mu; }

void anneal_serve_job_wait(anneal_serve_engine *e, anneal_serve_job *j, int ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)ms * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&j->cv, &e->mu, &ts);
}

void anneal_serve_engine_load(anneal_serve_engine *e, int *queued, int *running) {
    pthread_mutex_lock(&e->mu);
    *queued = e->qlen;
    *running = e->n_running;
    pthread_mutex_unlock(&e->mu);
}

int anneal_serve_engine_submit(anneal_serve_engine *e, anneal_serve_job *j) {
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (e->stopping) rc = 503;
    else if (e->qlen == e->qcap) rc = 429;
    else {
        j->refs++;
        j->state = ANNEAL_JOB_QUEUED;
        e->queue[(e->qhead + e->qlen++) % e->qcap] = j;
        pthread_cond_signal(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* Ends a job (under the lock): finish reason or error, wakes its waiter, drops the
 * engine's reference, frees its slot. */
static void finish_locked(anneal_serve_engine *e, anneal_serve_job *j, const char *finish, int err_status,
                          const char *err_type, const char *err_msg) {
    j->finish = finish;
    j->err_status = err_status;
    if (err_status) {
        snprintf(j->err_type, sizeof j->err_type, "%s", err_type);
        snprintf(j->err_msg, sizeof j->err_msg, "%s", err_msg);
    }
    j->shown = j->len;
    j->state = ANNEAL_JOB_DONE;
    if (j->slot >= 0) {
        e->running[j->slot] = NULL;
        e->n_running--;
        j->slot = -1;
    }
    anneal_serve_metrics_tokens(e->metrics, j->n_ids, j->n_gen);
    pthread_cond_broadcast(&j->cv);
    unref_locked(j);
}

/* Appends n bytes to the job's text. */
static bool append(anneal_serve_job *j, const char *p, size_t n) {
    if (j->len + n + 1 > j->cap) {
        size_t cap = (j->len + n + 1) * 2;
        char *t = realloc(j->text, cap);
        if (!t) return false;
        j->text = t;
        j->cap = cap;
    }
    memcpy(j->text + j->len, p, n);
    j->len += n;
    j->text[j->len] = '\0';
    return true;
}

/* The decoder's pending bytes into the text; then the final stop-string check (true:
 * a stop string ended the text). */
static bool flush_text(anneal_serve_engine *e, anneal_serve_job *j) {
    size_t n = anneal_stream_decoder_flush(&j->dec, e->tmp, e->tmp_cap);
    append(j, e->tmp, n);
    size_t cut, safe;
    if (!anneal_serve_stop_scan(j->text ? j->text : "", j->len, j->shown, j->stop, j->n_stop, &cut, &safe)) return false;
    j->len = cut;
    return true;
}

/* Takes the token sampled for a running job (under the lock): text, stop strings,
 * limits. */
static void take_token(anneal_serve_engine *e, anneal_serve_job *j, int32_t id, double t) {
    if (j->n_gen == 0) anneal_serve_metrics_ttft(e->metrics, t - j->t_arrival);
    else anneal_serve_metrics_token_latency(e->metrics, t - j->t_last);
    j->t_last = t;
    j->n_gen++;
    j->pos++;
    if (id == e->eot) {
        flush_text(e, j);
        finish_locked(e, j, "stop", 0, NULL, NULL);
        return;
    }
    size_t len = 0;
    const char *bytes = anneal_tokenizer_token_bytes(e->tok, id, &len);
    if (bytes && len + 64 > e->tmp_cap) {
        char *g = realloc(e->tmp, len + 64);
        if (g) {
            e->tmp = g;
            e->tmp_cap = len + 64;
        }
    }
    bool ok;
    if (!bytes || id >= e->tok_vocab || len + 64 > e->tmp_cap ||
        anneal_stream_decoder_push(&j->dec, id, e->tmp, e->tmp_cap, &len) != ANNEAL_OK) {
        anneal_clear_error();
        ok = append(j, "\xEF\xBF\xBD", 3);
    } else {
        ok = append(j, e->tmp, len);
    }
    if (!ok) {
        finish_locked(e, j, NULL, 500, "server_error", "out of memory for the generated text");
        return;
    }
    size_t cut, safe;
    if (anneal_serve_stop_scan(j->text, j->len, j->shown, j->stop, j->n_stop, &cut, &safe)) {
        j->len = cut;
        finish_locked(e, j, "stop", 0, NULL, NULL);
        return;
    }
    j->shown = safe;
    if (j->n_gen >= j->max_tokens || j->pos >= e->max_len) {
        finish_locked(e, j, flush_text(e, j) ? "stop" : "length", 0, NULL, NULL);
        return;
    }
    j->next_id = id;
    pthread_cond_broadcast(&j->cv);
}

/* Drops cancelled and expired jobs, queued or running (under the lock). */
static void sweep_locked(anneal_serve_engine *e, double t) {
    for (int s = 0; s < e->slots; s++) {
        anneal_serve_job *j = e->running[s];
        if (!j) continue;
        if (j->cancelled) finish_locked(e, j, NULL, 499, "cancelled", "the client closed the connection");
        else if (t > j->deadline || e->cut) {
            flush_text(e, j);
            finish_locked(e, j, "length", 0, NULL, NULL); /* cut by the deadline or the stop: a limit */
        }
    }
    int kept = 0;
    for (int i = 0; i < e->qlen; i++) {
        anneal_serve_job *j = e->queue[(e->qhead + i) % e->qcap];
        if (j->cancelled) finish_locked(e, j, NULL, 499, "cancelled", "the client closed the connection");
        else if (t > j->deadline)
            finish_locked(e, j, NULL, 504, "timeout", "the request's deadline (--request-timeout) passed while it waited for a slot");
        else if (e->cut) finish_locked(e, j, NULL, 503, "server_error", "the server is shutting down");
        else e->queue[(e->qhead + kept++) % e->qcap] = j;
    }
    e->qlen = kept;
}

/* The ids of a mixed pass, grown as prompts need. */
typedef struct mix_buf {
    int64_t *slots, *counts; /* (slots) */
    int32_t *ids;
    int64_t cap;
} mix_buf;

/* The running jobs' next ids and the feeding jobs' next prompt chunks (chunk[i] ids of
 * feed[i] from its fed-th; a slot about to take its first chunk emptied first) in one
 * pass over the model (anneal_model_extend_slots): e->logits rows [0, n_step) for
 * step's jobs, then one row per feeding job (its chunk's last id). On failure the error
 * is cleared and nothing advanced (the caller takes the one-by-one path). */
static anneal_status mixed_pass(anneal_serve_engine *e, anneal_serve_job **step, int n_step, anneal_serve_job **feed,
                                const int64_t *chunk, int n_feed, mix_buf *mb) {
    int64_t total = n_step;
    for (int i = 0; i < n_feed; i++) total += chunk[i];
    if (total > mb->cap) {
        int32_t *ids = realloc(mb->ids, (size_t)total * sizeof *ids);
        if (!ids) return ANNEAL_ERR_OOM;
        mb->ids = ids;
        mb->cap = total;
    }
    int64_t k = 0;
    for (int i = 0; i < n_step; i++) {
        mb->slots[i] = step[i]->slot;
        mb->counts[i] = 1;
        mb->ids[k++] = step[i]->next_id;
    }
    for (int i = 0; i < n_feed; i++) {
        anneal_serve_job *j = feed[i];
        if (j->fed == 0) anneal_serve_batch_reset(e->batch, j->slot);
        mb->slots[n_step + i] = j->slot;
        mb->counts[n_step + i] = chunk[i];
        memcpy(mb->ids + k, j->ids + j->fed, (size_t)chunk[i] * sizeof *mb->ids);
        k += chunk[i];
    }
    anneal_status s = anneal_serve_batch_extend(e->batch, mb->slots, mb->ids, mb->counts, n_step + n_feed, e->logits);
    if (s != ANNEAL_OK) anneal_clear_error();
    return s;
}

/* Sleeps the test aid's delay (--step-delay-ms) before a pass that advances running jobs. */
static void step_delay(const anneal_serve_engine *e) {
    if (e->step_delay_ms > 0)
        nanosleep(&(struct timespec){e->step_delay_ms / 1000, (e->step_delay_ms % 1000) * 1000000L}, NULL);
}

static void *engine_main(void *arg) {
    anneal_serve_engine *e = arg;
    /* a new pthread starts from OpenMP's global default, not from the count the creating
     * thread set (--threads): take that count over, and show it in /metrics */
    anneal_set_num_threads(e->threads);
    anneal_serve_metrics_threads(e->metrics, anneal_get_num_threads());
    anneal_serve_job **feed = calloc((size_t)e->slots, sizeof *feed), **step = calloc((size_t)e->slots, sizeof *step);
    int64_t *slot_ids = calloc((size_t)e->slots, sizeof *slot_ids), *chunk = calloc((size_t)e->slots, sizeof *chunk);
    int32_t *ids = calloc((size_t)e->slots, sizeof *ids);
    int32_t *sampled = calloc((size_t)e->slots, sizeof *sampled), *first = calloc((size_t)e->slots, sizeof *first);
    anneal_status *pre_status = calloc((size_t)e->slots, sizeof *pre_status);
    mix_buf mix = {.slots = calloc((size_t)e->slots, sizeof(int64_t)), .counts = calloc((size_t)e->slots, sizeof(int64_t))};
    bool oom = !feed || !step || !slot_ids || !chunk || !ids || !sampled || !first || !pre_status || !mix.slots ||
               !mix.counts;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        sweep_locked(e, now_s());
        if (e->n_running == 0 && e->qlen == 0) {
            pthread_cond_broadcast(&e->idle);
            if (e->quit) break;
            pthread_cond_wait(&e->work, &e->mu);
            continue;
        }
        if (oom) { /* nothing can run: fail every job rather than hang */
            e->cut = true;
            for (int i = 0; i < e->qlen; i++)
                finish_locked(e, e->queue[(e->qhead + i) % e->qcap], NULL, 500, "server_error", "engine out of memory");
            e->qlen = 0;
            continue;
        }
        /* queued jobs take free slots; jobs whose prompt is not all in the cache feed
         * their next chunk (up to --prefill-chunk prompt rows per pass over all of them,
         * the earlier slots first), the others step by one token */
        for (int s = 0; s < e->slots && e->qlen > 0; s++) {
            if (e->running[s]) continue;
            anneal_serve_job *j = e->queue[e->qhead];
            e->qhead = (e->qhead + 1) % e->qcap;
            e->qlen--;
            j->state = ANNEAL_JOB_RUNNING;
            j->slot = s;
            j->pos = j->n_ids;
            j->fed = 0;
            anneal_stream_decoder_init(&j->dec, e->tok);
            e->running[s] = j;
            e->n_running++;
        }
        int n_step = 0, n_feed = 0;
        int64_t budget = e->prefill_chunk;
        for (int s = 0; s < e->slots; s++) {
            anneal_serve_job *j = e->running[s];
            if (!j) continue;
            if (j->fed == j->n_ids) {
                step[n_step++] = j;
            } else if (budget > 0) {
                chunk[n_feed] = j->n_ids - j->fed < budget ? j->n_ids - j->fed : budget;
                budget -= chunk[n_feed];
                feed[n_feed++] = j;
            }
        }
        for (int i = 0; i < n_step; i++) {
            slot_ids[i] = step[i]->slot;
            ids[i] = step[i]->next_id;
        }
        pthread_mutex_unlock(&e->mu);
        /* model work, outside the lock (the jobs stay: only this thread ends them) */
        double ph[ANNEAL_SERVE_PHASES] = {0}, t0 = now_s(), t1; /* wall seconds by phase (/metrics) */
        int64_t prefills = 0, prefill_rows = 0;
        anneal_status ds = ANNEAL_OK;
        if (n_feed > 0 && n_step > 0 && e->step_delay_ms > 0) { /* the test aid delays every decode pass */
            step_delay(e);
            t0 = now_s();
        }
        /* prompt chunks and the running rows in one pass (the model's mixed step); if it
         * fails, each chunk alone and then the step, so a failure is the job's own. A
         * job's first token is drawn from its last chunk's logits. */
        bool mixed = n_feed > 0 && mixed_pass(e, step, n_step, feed, chunk, n_feed, &mix) == ANNEAL_OK;
        if (mixed) {
            t1 = now_s();
            ph[n_step > 0 ? 4 : 0] = t1 - t0; /* mixed, or a pass of prompts alone */
            for (int i = 0; i < n_feed; i++) pre_status[i] = ANNEAL_OK;
            /* the running rows' logits first, then each chunk's last row's */
#pragma omp parallel for schedule(dynamic, 1) if (n_step + n_feed > 1)
            for (int i = 0; i < n_step + n_feed; i++) {
                anneal_serve_job *j = i < n_step ? step[i] : feed[i - n_step];
                if (i >= n_step && j->fed + chunk[i - n_step] < j->n_ids) continue; /* more prompt to come */
                int32_t id = anneal_sample_logits(e->logits + (int64_t)i * e->V, e->V, &j->sampler, (uint64_t)j->pos);
                if (i < n_step) sampled[i] = id;
                else first[i - n_step] = id;
            }
            t0 = t1;
        } else {
            for (int i = 0; i < n_feed; i++) {
                anneal_serve_job *j = feed[i];
                if (j->fed == 0) anneal_serve_batch_reset(e->batch, j->slot);
                pre_status[i] = anneal_serve_batch_prefill(e->batch, j->slot, j->ids + j->fed, chunk[i], e->logits);
                if (pre_status[i] == ANNEAL_OK && j->fed + chunk[i] == j->n_ids)
                    first[i] = anneal_sample_logits(e->logits, e->V, &j->sampler, (uint64_t)j->pos);
            }
            t1 = now_s();
            ph[0] = t1 - t0;
            if (n_step > 0) {
                if (n_feed == 0) {
                    step_delay(e);
                    t1 = now_s(); /* the test aid's sleep is no phase */
                }
                ds = anneal_serve_batch_decode(e->batch, slot_ids, ids, n_step, e->logits);
                t0 = now_s();
                ph[1] = t0 - t1;
                /* each row's draw depends only on its logits, sampler and position: rows in
                 * parallel give the same ids as one after another */
                if (ds == ANNEAL_OK) {
#pragma omp parallel for schedule(dynamic, 1) if (n_step > 1)
                    for (int i = 0; i < n_step; i++)
                        sampled[i] = anneal_sample_logits(e->logits + (int64_t)i * e->V, e->V, &step[i]->sampler,
                                                          (uint64_t)step[i]->pos);
                }
            }
        }
        double t = now_s();
        if (n_step > 0 || mixed) ph[2] = t - t0;
        char msg[200];
        pthread_mutex_lock(&e->mu);
        for (int i = 0; i < n_feed; i++) {
            anneal_serve_job *j = feed[i];
            if (pre_status[i] != ANNEAL_OK) {
                snprintf(msg, sizeof msg, "prefill failed: %s", anneal_last_error());
                anneal_clear_error();
                finish_locked(e, j, NULL, 500, "server_error", msg);
                continue;
            }
            j->fed += chunk[i];
            prefill_rows += chunk[i];
            if (j->fed == j->n_ids) {
                prefills++;
                take_token(e, j, first[i], t);
            }
        }
        if (ds != ANNEAL_OK) {
            snprintf(msg, sizeof msg, "decode step failed: %s", anneal_last_error());
            anneal_clear_error();
        }
        for (int i = 0; i < n_step; i++) {
            anneal_serve_job *j = step[i];
            if (ds != ANNEAL_OK) finish_locked(e, j, NULL, 500, "server_error", msg);
            else take_token(e, j, sampled[i], t);
        }
        ph[3] = now_s() - t;
        anneal_serve_metrics_engine(e->metrics, ds == ANNEAL_OK ? n_step : 0, prefills, prefill_rows, ph);
    }
    pthread_mutex_unlock(&e->mu);
    free(feed);
    free(step);
    free(slot_ids);
    free(chunk);
    free(ids);
    free(sampled);
    free(first);
    free(pre_status);
    free(mix.slots);
    free(mix.counts);
    free(mix.ids);
    return NULL;
}

anneal_serve_engine *anneal_serve_engine_new(anneal_model *m, const anneal_tokenizer *tok,
                                             const anneal_serve_config *cfg, anneal_serve_metrics *metrics) {
    anneal_serve_engine *e = calloc(1, sizeof *e);
    if (!e) {
        anneal_set_error(ANNEAL_ERR_OOM, "serve: out of memory");
        return NULL;
    }
    e->m = m;
    e->tok = tok;
    e->metrics = metrics;
    e->slots = cfg->slots;
    e->qcap = cfg->queue > 0 ? cfg->queue : 1;
    e->step_delay_ms = cfg->step_delay_ms;
    e->prefill_chunk = cfg->prefill_chunk > 0 ? cfg->prefill_chunk : 256;
    e->threads = anneal_get_num_threads();
    e->eot = anneal_tokenizer_eot(tok);
    e->tok_vocab = anneal_tokenizer_vocab_size(tok);
    e->V = m->cfg.vocab_size;
    e->max_len = m->cfg.n_ctx;
    e->tmp_cap = 4096;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->queue = calloc((size_t)e->qcap, sizeof *e->queue);
    e->running = calloc((size_t)e->slots, sizeof *e->running);
    e->logits = malloc((size_t)e->slots * (size_t)e->V * sizeof *e->logits);
    e->tmp = malloc(e->tmp_cap);
    if (!e->queue || !e->running || !e->logits || !e->tmp) {
        anneal_set_error(ANNEAL_ERR_OOM, "serve: out of memory for %d slots", e->slots);
        anneal_serve_engine_free(e);
        return NULL;
    }
    if (!(e->batch = anneal_serve_batch_new(m, e->slots, e->max_len))) {
        anneal_serve_engine_free(e);
        return NULL;
    }
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        anneal_set_error(ANNEAL_ERR_IO, "serve: cannot start the engine thread");
        anneal_serve_engine_free(e);
        return NULL;
    }
    e->started = true;
    return e;
}

void anneal_serve_engine_stop(anneal_serve_engine *e, double grace_s) {
    if (!e) return;
    if (e->started && !e->quit) {
        pthread_mutex_lock(&e->mu);
        e->stopping = true;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double end = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + (grace_s > 0 ? grace_s : 0);
        while (e->n_running + e->qlen > 0) {
            clock_gettime(CLOCK_REALTIME, &ts);
            double nowr = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
            if (nowr >= end) break;
            double until = nowr + 0.05 < end ? nowr + 0.05 : end;
            struct timespec w = {(time_t)until, (long)((until - (double)(time_t)until) * 1e9)};
            pthread_cond_timedwait(&e->idle, &e->mu, &w);
        }
        e->cut = true;
        e->quit = true;
        pthread_cond_signal(&e->work);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
    }
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_mutex_unlock(&e->mu);
}

void anneal_serve_engine_free(anneal_serve_engine *e) {
    if (!e) return;
    anneal_serve_engine_stop(e, 0);
    anneal_serve_batch_free(e->batch);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->idle);
    pthread_mutex_destroy(&e->mu);
    free(e->queue);
    free(e->running);
    free(e->logits);
    free(e->tmp);
    free(e);
}
