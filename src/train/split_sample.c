/* Samples when the model is split over ranks (--pp: pipeline.c; --tp: tp.c), no rank
 * holding more than its part of the parameters. For each new token the window of ids
 * (the prompt and what was generated, at most n_ctx) runs a full-context forward, as
 * evaluation does, and one rank samples the last position's logits with the sampler
 * one process uses (same config, same Philox position) and broadcasts the id, so every
 * rank extends its window alike. When the window passes n_ctx it restarts from the last
 * n_ctx/2 ids, as anneal_model_generate rebuilds its cache, so the context of each
 * token is one process's.
 *
 * --pp: stage to stage: stage 0 embeds the window and runs its blocks, each later stage
 * receives the hidden state (1, w, C), runs its blocks and sends it on, the last stage
 * ends with the final norm and head (the stage forward without targets gives the
 * logits) and samples. --tp: every rank of the group runs the whole forward on its
 * shards (the group's all-reduces inside the blocks), the head's vocabulary columns
 * gathered over the group (ctx.tp's vocab_gather), and tp rank 0 samples. Both: each
 * tensor-parallel index has its own pipeline of stages (pp->pipe), every stage's group
 * runs its blocks on its shards, the last stage's tp rank 0 samples and broadcasts the
 * id over its group, and each of those ranks over its pipeline.
 *
 * Why no KV cache: the models' cached forward (forward_cached, prefill/decode slots, the
 * decode engine) runs the whole model from ids to logits with one cache of every layer
 * and the engine's products know no group; a stage's cached blocks, or sharded cached
 * attention, need new entry points in each architecture. The trainer's samples are
 * short (--sample-tokens, 64 by default, on a small model), so the quadratic cost of
 * recomputing the window is small. The logits differ from the cached path's in rounding
 * only (other matrix-product orders), so the sampled ids, and the text, are one
 * process's unless a draw lands within a rounding error of a boundary between two
 * tokens' probabilities.
 *
 * Only replica 0 generates (rank 0 prints the text); other replicas return at once. A
 * failed forward or message on one rank ends the job (its peers wait in a receive). */
#include "pp_internal.h"

#include <stdlib.h>
#include <string.h>

#define TAG_SAMPLE 32110 /* above the micro-batches' tags (pp_internal.h) and pp_ckpt.c's */

/* Ends the job on a failure inside the sample's collectives and messages. */
static anneal_status fatal(trainer *t, anneal_status st) {
    char msg[1200];
    snprintf(msg, sizeof msg, "rank %d: anneal train: sample across the ranks (%s): %s (ending the job)", t->rank,
             t->pp ? "--pp" : "--tp", anneal_last_error());
    anneal_comm_abort(t->comm, 1, msg);
    return st;
}

/* The logits (V, into logits) of the last position of win[0..w) on the last stage;
 * the other stages run their blocks and pass the hidden state on. */
static anneal_status stage_pass(trainer *t, const int32_t *win, int64_t w, float *buf, float *logits) {
    struct train_pp *pp = t->pp;
    anneal_model *m = t->model;
    int64_t C = t->mcfg.n_embd;
    int64_t ids_shape[2] = {1, w}, act_shape[3] = {1, w, C};
    anneal_scope *sc = anneal_scope_open();
    anneal_status st = ANNEAL_OK;
    anneal_tensor *in = NULL;
    if (pp->stage == 0) in = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, ids_shape, win);
    else if ((in = anneal_empty_on(ANNEAL_CPU, ANNEAL_F32, 3, act_shape)))
        st = anneal_comm_recv(pp->pipe, anneal_data(in), w * C, ANNEAL_F32, pp->stage - 1, TAG_SAMPLE);
    anneal_tensor *out = st == ANNEAL_OK && in ? anneal_model_stage_forward(m, pp->first, pp->last, in, NULL) : NULL;
    if (st == ANNEAL_OK && !out) st = anneal_last_status();
    if (st == ANNEAL_OK && pp->stage == pp->n - 1) { /* (1, w, V): the last row */
        anneal_tensor *row = anneal_narrow(out, 1, w - 1, 1);
        anneal_tensor *c = row ? anneal_contiguous(row) : NULL;
        st = c ? anneal_to_f32_buffer(c, logits) : anneal_last_status();
    } else if (st == ANNEAL_OK) {
        st = anneal_to_f32_buffer(out, buf);
        if (st == ANNEAL_OK) st = anneal_comm_send(pp->pipe, buf, w * C, ANNEAL_F32, pp->stage + 1, TAG_SAMPLE);
    }
    anneal_scope_close(sc);
    return st;
}

/* The logits (V, into logits) of the last position of win[0..w) under --tp, on every
 * rank of the group (each runs the forward on its shards; the head's columns gathered). */
static anneal_status tp_pass(trainer *t, const int32_t *win, int64_t w, float *buf, float *logits) {
    (void)buf;
    int64_t ids_shape[2] = {1, w};
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *ids = anneal_from_data_on(ANNEAL_CPU, ANNEAL_I32, 2, ids_shape, win);
    anneal_tensor *out = ids ? anneal_model_logits(t->model, ids) : NULL; /* (1, w, V) */
    anneal_tensor *row = out ? anneal_narrow(out, 1, w - 1, 1) : NULL;
    anneal_tensor *c = row ? anneal_contiguous(row) : NULL;
    anneal_status st = c ? anneal_to_f32_buffer(c, logits) : anneal_last_status();
    anneal_scope_close(sc);
    return st;
}

typedef anneal_status (*window_pass)(trainer *t, const int32_t *win, int64_t w, float *buf, float *logits);

/* anneal_model_generate's contract over the window: pass gives the logits on the ranks
 * that have them (with_logits); one of them samples and each id is broadcast over comm
 * from root. Without group, root samples; with group (--tp x --pp: the last stage's
 * tensor-parallel ranks, every one of them with the logits and root of its own comm),
 * group rank 0 samples and broadcasts over group first, so every pipeline takes the same
 * id. buf_floats of scratch for pass. */
static anneal_status window_generate(trainer *t, anneal_comm *comm, int root, anneal_comm *group, bool with_logits,
                                     window_pass pass, int64_t buf_floats, const int32_t *prompt, int64_t n_prompt,
                                     int64_t max_new, const anneal_sampler_config *cfg, int32_t stop_id,
                                     anneal_token_fn on_token, void *user) {
    if (n_prompt <= 0) return anneal_set_error(ANNEAL_ERR_ARG, "sample: the prompt is empty");
    int64_t n_ctx = t->mcfg.n_ctx, keep = n_ctx / 2 > 0 ? n_ctx / 2 : 1, V = t->mcfg.vocab_size;
    bool samples = with_logits && (group ? anneal_comm_rank(group) == 0 : anneal_comm_rank(comm) == root);
    int32_t *win = malloc((size_t)(n_ctx + 1) * sizeof *win);
    float *buf = buf_floats > 0 ? malloc((size_t)buf_floats * sizeof *buf) : NULL;
    float *logits = with_logits ? malloc((size_t)V * sizeof *logits) : NULL;
    if (!win || (buf_floats > 0 && !buf) || (with_logits && !logits)) {
        free(win);
        free(buf);
        free(logits);
        return fatal(t, anneal_set_error(ANNEAL_ERR_OOM, "out of memory"));
    }
    anneal_model *m = t->model;
    bool was_training = m->ctx.training;
    m->ctx.training = false;
    anneal_no_grad_begin();
    int64_t w = n_prompt > n_ctx ? keep : n_prompt;
    memcpy(win, prompt + n_prompt - w, (size_t)w * sizeof *win);
    anneal_status st = ANNEAL_OK;
    bool taking = on_token != NULL; /* every rank stops at the same id: a sink's refusal only stops the calls */
    for (int64_t i = 0, pos = n_prompt; i < max_new && st == ANNEAL_OK; i++, pos++) {
        st = pass(t, win, w, buf, logits);
        int32_t id = 0;
        if (st == ANNEAL_OK && samples) id = anneal_sample_logits(logits, V, cfg, (uint64_t)pos);
        if (st == ANNEAL_OK && group && with_logits) st = anneal_comm_broadcast(group, &id, 1, ANNEAL_I32, 0);
        if (st == ANNEAL_OK) st = anneal_comm_broadcast(comm, &id, 1, ANNEAL_I32, root);
        if (st != ANNEAL_OK || (stop_id >= 0 && id == stop_id)) break;
        if (taking) taking = on_token(id, user);
        win[w++] = id;
        if (w > n_ctx) { /* the context full: the last n_ctx/2 ids, as generate's cache rebuild */
            memmove(win, win + w - keep, (size_t)keep * sizeof *win);
            w = keep;
        }
    }
    anneal_no_grad_end();
    m->ctx.training = was_training;
    free(win);
    free(buf);
    free(logits);
    return st == ANNEAL_OK ? ANNEAL_OK : fatal(t, st);
}

anneal_status anneal_train_pp_generate(trainer *t, const int32_t *prompt, int64_t n_prompt, int64_t max_new,
                                       const anneal_sampler_config *cfg, int32_t stop_id, anneal_token_fn on_token,
                                       void *user) {
    struct train_pp *pp = t->pp;
    if (!pp || pp->replica != 0 || max_new <= 0) return ANNEAL_OK;
    bool last = pp->stage == pp->n - 1;
    anneal_comm *group = pp->tp > 1 ? anneal_train_tp_group(t) : NULL; /* this stage's tensor-parallel ranks */
    return window_generate(t, pp->pipe, pp->n - 1, group, last, stage_pass, t->mcfg.n_ctx * t->mcfg.n_embd, prompt, n_prompt,
                           max_new, cfg, stop_id, on_token, user);
}

anneal_status anneal_train_tp_generate(trainer *t, const int32_t *prompt, int64_t n_prompt, int64_t max_new,
                                       const anneal_sampler_config *cfg, int32_t stop_id, anneal_token_fn on_token,
                                       void *user) {
    anneal_comm *group = anneal_train_tp_group(t);
    if (!group || anneal_train_tp_data_rank(t) != 0 || max_new <= 0) return ANNEAL_OK;
    return window_generate(t, group, 0, NULL, true, tp_pass, 0, prompt, n_prompt, max_new, cfg, stop_id, on_token, user);
}
