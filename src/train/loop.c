/* The training loop: one step is K micro-batches of forward + backward (the loss of
 * each scaled by 1/K, so the gradient is that of the mean loss), the global gradient
 * norm (clipped), and an AdamW update at the scheduled learning rate, unless the loss
 * or the norm is not finite: then the update is skipped and counted, and too many in
 * a row stop the run.
 *
 * Exact resume: the only randomness is the data order (the loader, whose cursor is
 * checkpointed) and dropout, which draws from the global Philox generator set at
 * every step start to (seed, (step + 1) * 2^40): a pure function of the step, so a
 * resumed run draws the same masks as a straight one whatever happened in between
 * (evaluation, sampling, a different process). */
#include "anneal/cuda.h"
#include "anneal/trace.h"
#include "train_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

/* What one step did. */
typedef struct step_out {
    double loss, lr;
    float norm;
    bool skipped;
    bool overflow;    /* fp16: gradients overflowed at loss_scale (skipped, not a bad step) */
    float loss_scale; /* fp16: the scale this step ran with (0: no scaler) */
} step_out;


/* The mean of the K micro-batch losses kept on the device: one read for the step (a
 * sum in micro-batch order, in double, as the losses were produced). */
static anneal_status read_losses(trainer *t, double *mean) {
    int64_t K = t->cfg.accum;
    anneal_status st;
    if (K == 1) {
        st = anneal_to_f32_buffer(t->losses[0], t->host_losses);
    } else {
        anneal_scope *s = anneal_scope_open();
        for (int64_t k = 0; k < K; k++) t->losses[k] = anneal_reshape(t->losses[k], 1, (int64_t[]){1});
        anneal_tensor *all = anneal_cat((int)K, t->losses, 0);
        st = all ? anneal_to_f32_buffer(all, t->host_losses) : anneal_last_status();
        anneal_scope_close(s);
    }
    double sum = 0;
    for (int64_t k = 0; k < K; k++) sum += (double)t->host_losses[k];
    *mean = sum / (double)K;
    return st;
}

static anneal_status optimizer_phase(trainer *t, step_out *o);

/* --deterministic: the micro-batches of deterministic.c, then the same second half. */
static anneal_status det_step(trainer *t, int64_t step, step_out *o) {
    anneal_status st = anneal_train_det_micro_batches(t, step, &o->loss);
    if (st != ANNEAL_OK) return st;
    o->lr = anneal_schedule_lr(&t->sch, step);
    return optimizer_phase(t, o);
}

static anneal_status run_step(trainer *t, int64_t step, step_out *o) {
    const anneal_train_config *c = &t->cfg;
    if (c->deterministic && !t->pp) return det_step(t, step, o); /* --pp: pipeline.c calls deterministic.c */
    anneal_rng_state rs = {(uint64_t)c->seed, (uint64_t)(step + 1) << 40};
    anneal_rng_set(rs);
    anneal_model_set_training(t->model, true);
    anneal_params_zero_grad(t->model->params);
    bool inject = anneal_train_inject_nan(t, step + 1);
    if (t->pp) { /* --pp: the micro-batches pipelined 1F1B over the stages, and the update (pipeline.c) */
        o->overflow = false;
        o->loss_scale = 0;
        o->lr = anneal_schedule_lr(&t->sch, step);
        anneal_status ps =
            anneal_train_pp_step(t, step, inject, o->lr, &o->loss, &o->norm, &o->skipped, &o->overflow, &o->loss_scale);
        anneal_train_dist_note_memory(t); /* the stage's steady state, at every replica count */
        return ps;
    }
    bool ddp = anneal_train_dist_active(t);
    anneal_device dev = anneal_model_device(t->model);
    int64_t shape[2] = {t->local_batch, c->seq};
    anneal_scope *step_scope = anneal_scope_open(); /* holds the micro-batches' losses */
    anneal_status st = ANNEAL_OK;
    bool abandoned = false;
    for (int64_t k = 0; k < c->accum && st == ANNEAL_OK; k++) {
        if (k > 0) {
            /* a stop request between micro-batches abandons the step (no update): with a
             * long --accum a step can take minutes. The ranks agree, as at a step's end. */
            bool stop = anneal_train_stop_requested(NULL);
            if ((st = anneal_train_dist_any(t, &stop)) != ANNEAL_OK) break;
            if (stop) {
                abandoned = true;
                break;
            }
        }
        /* distributed: gradients are communicated on the last micro-step only */
        if (ddp && (st = anneal_ddp_begin_backward(t->ddp, k == c->accum - 1)) != ANNEAL_OK) break;
        anneal_scope *s = anneal_scope_open();
        /* the batch is made on the host and uploaded to the model's device; a queued copy
         * reads its host buffer until the device's next synchronize (the loss read at the
         * step's end), so each micro-batch has a buffer of its own, or, when the step's
         * batches do not fit (setup), the one buffer is refilled after a synchronize */
        int64_t slot = t->host_bufs > 1 ? k : 0;
        int32_t *h_ids = t->host_ids + slot * shape[0] * shape[1], *h_tg = t->host_tg + slot * shape[0] * shape[1];
        if (k > 0 && t->host_bufs == 1 && dev != ANNEAL_CPU) st = anneal_device_synchronize(dev);
        int64_t span_t0 = anneal_span_begin();
        if (st == ANNEAL_OK) st = anneal_train_source_next(&t->train, h_ids, h_tg);
        anneal_span_end(ANNEAL_SPAN_LOADER, "next batch", span_t0, 0, 0);
        if (st == ANNEAL_OK) {
            anneal_tensor *ids = anneal_from_data_on(dev, ANNEAL_I32, 2, shape, h_ids);
            anneal_tensor *tg = anneal_from_data_on(dev, ANNEAL_I32, 2, shape, h_tg);
            span_t0 = anneal_span_begin();
            anneal_tensor *loss = anneal_model_loss(t->model, ids, tg);
            anneal_span_end(ANNEAL_SPAN_STEP, "forward", span_t0, 0, 0);
            if (inject) loss = anneal_scale(loss, NAN); /* test hook: a non-finite loss and gradient */
            anneal_tensor *obj = c->accum > 1 ? anneal_scale(loss, 1.0f / (float)c->accum) : loss;
            obj = anneal_train_scale_loss(t, obj); /* fp16: loss * scale (precision.c) */
            span_t0 = anneal_span_begin();
            st = obj ? anneal_backward(obj) : anneal_last_status();
            anneal_span_end(ANNEAL_SPAN_STEP, "backward", span_t0, 0, 0);
            /* kept (without its graph) until every micro-batch is done: read once below */
            if (st == ANNEAL_OK) t->losses[k] = anneal_keep(anneal_detach(loss), step_scope);
        }
        anneal_scope_close(s);
    }
    if (st == ANNEAL_OK && !abandoned) st = read_losses(t, &o->loss);
    anneal_scope_close(step_scope);
    if (abandoned) {
        anneal_params_zero_grad(t->model->params);
        return ANNEAL_ERR_INTERRUPTED; /* the caller ends the run as after a step's stop */
    }
    if (st != ANNEAL_OK) return st;
    o->lr = anneal_schedule_lr(&t->sch, step);
    int64_t span_t0 = anneal_span_begin(); /* gradient sync (DDP), norm, clipping, update */
    st = optimizer_phase(t, o);
    anneal_span_end(ANNEAL_SPAN_STEP, "optimizer", span_t0, 0, 0);
    return st;
}

/* The second half of a step: gradients synchronised (distributed), their norm, the
 * update unless anything is not finite. */
static anneal_status optimizer_phase(trainer *t, step_out *o) {
    const anneal_train_config *c = &t->cfg;
    bool ddp = anneal_train_dist_active(t);
    anneal_status st;
    float norm = NAN;
    if (ddp) {
        /* the mean gradient over ranks, its global norm, and the mean loss: the same on
         * every rank, so every rank takes the same branch below */
        if ((st = anneal_ddp_finish(t->ddp)) != ANNEAL_OK) return st;
        anneal_train_dist_note_memory(t);
        if (!c->deterministic && (st = anneal_train_dist_mean(t, &o->loss)) != ANNEAL_OK) return st; /* det: combined */
        /* fp16: gradients * 1/scale, overflow check, scaler update (precision.c) */
        if ((st = anneal_train_unscale_grads(t, o->loss, &o->overflow, &o->loss_scale)) != ANNEAL_OK) return st;
        st = anneal_train_tp_active(t) ? anneal_train_tp_clip(t, c->clip > 0 ? (float)c->clip : 0.0f, &norm) /* tp.c */
                                       : anneal_ddp_clip_grad_norm(t->ddp, c->clip > 0 ? (float)c->clip : 0.0f, &norm);
    } else {
        /* fp16: gradients * 1/scale, overflow check, scaler update (precision.c) */
        if ((st = anneal_train_unscale_grads(t, o->loss, &o->overflow, &o->loss_scale)) != ANNEAL_OK) return st;
        st = c->clip > 0 ? anneal_clip_grad_norm(t->model->params, (float)c->clip, &norm)
                         : anneal_grad_norm(t->model->params, &norm);
    }
    if (st != ANNEAL_OK) return st;
    o->norm = norm;
    o->skipped = !isfinite(o->loss) || !isfinite(norm) || o->overflow; /* fp16: an overflow on any rank */
    /* PowerSGD: a non-finite gradient went into the error feedback and Q (every rank
     * sees the same global norm, so every rank resets) */
    if (o->skipped && t->psgd) anneal_powersgd_reset(t->psgd);
    if (!o->skipped) st = anneal_optimizer_step(t->opt, o->lr);
    anneal_params_zero_grad(t->model->params);
    return st;
}

/* Counts a failed checkpoint of `step` and logs a "checkpoint_failed" record with
 * the error (the current one, which stays recorded). */
static void note_ckpt_failure(trainer *t, int64_t step) {
    t->ckpt_failures++;
    t->ckpt_good = false;
    size_t n = strlen(t->ckpt_fail_steps);
    if (t->ckpt_fail_row++ == 0) n = 0, t->ckpt_fail_steps[0] = '\0';
    if (n + 24 < sizeof t->ckpt_fail_steps)
        snprintf(t->ckpt_fail_steps + n, sizeof t->ckpt_fail_steps - n, "%s%lld", n ? ", " : "", (long long)step);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "checkpoint_failed");
    cJSON_AddNumberToObject(o, "step", (double)step);
    cJSON_AddStringToObject(o, "error", anneal_last_error());
    cJSON_AddNumberToObject(o, "failures_in_a_row", t->ckpt_fail_row);
    char msg[1024]; /* logging must not replace the error being reported */
    snprintf(msg, sizeof msg, "%s", anneal_last_error());
    anneal_status code = anneal_last_status();
    anneal_clear_error();
    anneal_train_log_json(t, o);
    anneal_clear_error();
    anneal_set_error(code ? code : ANNEAL_ERR_IO, "%s", msg);
}

/* Waits for the checkpoint write in flight; a failure is counted, logged and, unless
 * the caller reports it itself (report false), printed as a warning; a write that
 * completed ends a series of failures. */
static anneal_status wait_checkpoint(trainer *t, bool report) {
    anneal_status st = anneal_checkpointer_wait(t->ckpt);
    bool pending = t->ckpt_pending;
    t->ckpt_pending = false;
    if (st == ANNEAL_OK && pending) t->ckpt_fail_row = 0;
    if (st != ANNEAL_OK) {
        note_ckpt_failure(t, t->last_ckpt_step);
        if (report) {
            anneal_progress_note(t->prog, "warning: the checkpoint of step %lld failed: %s", (long long)t->last_ckpt_step,
                                 anneal_last_error());
            anneal_clear_error();
        }
    }
    return st;
}

/* ANNEAL_ERR_IO (and the message) once --max-ckpt-failures checkpoints in a row failed. */
static anneal_status too_many_ckpt_failures(trainer *t) {
    if (t->ckpt_fail_row < t->cfg.max_ckpt_failures) return ANNEAL_OK;
    char ck[PATH_MAX];
    bool have = anneal_checkpoint_resolve(t->run_dir, ck, sizeof ck) == ANNEAL_OK;
    anneal_clear_error();
    return anneal_set_error(ANNEAL_ERR_IO,
                            "%d checkpoint write%s in a row failed (step%s %s): stopping at step %lld "
                            "(--max-ckpt-failures %lld); the newest complete checkpoint is %s",
                            t->ckpt_fail_row, t->ckpt_fail_row == 1 ? "" : "s", t->ckpt_fail_row == 1 ? "" : "s",
                            t->ckpt_fail_steps, (long long)t->st.step,
                            (long long)t->cfg.max_ckpt_failures, have ? ck : "none");
}

/* Starts a checkpoint of the current state on the background writer and logs how
 * long the loop waited (the previous write, if still running, plus the snapshot).
 * Returns an error (the run stops) once --max-ckpt-failures writes in a row failed. */
static anneal_status save_checkpoint(trainer *t) {
    double t0 = anneal_train_now_ms();
    wait_checkpoint(t, true);
    anneal_status too_many = too_many_ckpt_failures(t);
    if (too_many != ANNEAL_OK) return too_many;
    double t1 = anneal_train_now_ms();
    /* distributed: every rank takes part in assembling the (ZeRO) optimizer state, rank
     * 0 alone snapshots and writes the world-size independent checkpoint */
    /* --tp (tp_ckpt.c) and --pp (pp_ckpt.c): rank 0 writes tensor by tensor, fetching them */
    bool tp_streamed = anneal_train_tp_ckpt_streamed(t), streamed = tp_streamed || anneal_train_pp_ckpt_streamed(t);
    anneal_status st = tp_streamed ? anneal_train_tp_ckpt_save(t)
                       : streamed  ? anneal_train_pp_ckpt_save(t)
                                   : anneal_train_dist_fatal(t, anneal_train_dist_ckpt_begin(t));
    if (st == ANNEAL_OK && t->rank == 0 && !streamed)
        st = anneal_checkpointer_save(t->ckpt, t->model, t->opt, &t->st, t->config_json);
    anneal_status se = streamed ? (st == ANNEAL_OK ? anneal_train_dist_save_powersgd(t) : ANNEAL_OK)
                                : anneal_train_dist_fatal(t, anneal_train_dist_ckpt_end(t));
    if (st == ANNEAL_OK) st = se;
    double t2 = anneal_train_now_ms();
    t->last_ckpt_step = t->st.step;
    t->ckpt_good = st == ANNEAL_OK; /* so far: the write itself is checked by the next wait */
    t->ckpt_pending = st == ANNEAL_OK && t->rank == 0;
    if (st != ANNEAL_OK) {
        note_ckpt_failure(t, t->st.step);
        anneal_progress_note(t->prog, "warning: the checkpoint of step %lld failed: %s", (long long)t->st.step,
                             anneal_last_error());
        anneal_clear_error();
        return too_many_ckpt_failures(t);
    }
    cJSON *o = cJSON_CreateObject();
    char name[64];
    snprintf(name, sizeof name, "ckpt_%08lld", (long long)t->st.step);
    cJSON_AddStringToObject(o, "type", "checkpoint");
    cJSON_AddNumberToObject(o, "step", (double)t->st.step);
    cJSON_AddStringToObject(o, "dir", name);
    cJSON_AddNumberToObject(o, "stall_ms", t2 - t0);
    cJSON_AddNumberToObject(o, "snapshot_ms", t2 - t1);
    anneal_train_log_json(t, o);
    return ANNEAL_OK;
}

static void log_eval(trainer *t, double val) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "eval");
    cJSON_AddNumberToObject(o, "step", (double)t->st.step);
    cJSON_AddNumberToObject(o, "val_loss", val);
    cJSON_AddNumberToObject(o, "batches", (double)t->eval_batches);
    anneal_train_log_json(t, o);
}

/* Evaluates, prints and logs; returns the status of the evaluation. */
static anneal_status do_eval(trainer *t, double *val) {
    double t0 = anneal_train_now_ms();
    anneal_status st = anneal_train_evaluate(t, val);
    if (st != ANNEAL_OK) return st;
    if (isfinite(*val) && !(*val >= t->st.best_val_loss)) t->st.best_val_loss = *val;
    anneal_progress_note(t->prog, "step %lld: val loss %.4f (%lld batches, %.1f s)", (long long)t->st.step, *val,
                         (long long)t->eval_batches, (anneal_train_now_ms() - t0) / 1e3);
    log_eval(t, *val);
    return ANNEAL_OK;
}

static anneal_status do_sample(trainer *t) {
    if ((t->pp || anneal_train_tp_active(t)) && t->rank != 0) {
        /* --pp: every stage runs its blocks for rank 0's sample; --tp: the group runs the
         * forward on its shards (split_sample.c) */
        char *discard = NULL;
        anneal_status ps = anneal_train_sample(t, &discard);
        free(discard);
        return ps;
    }
    anneal_status st = ANNEAL_OK;
    /* --zero 3: every rank gathers the parameters for rank 0's sample, and releases them */
    st = anneal_train_dist_full_params(t, true);
    if (st == ANNEAL_OK && t->rank != 0) return anneal_train_dist_full_params(t, false);
    char *text = NULL;
    if (st == ANNEAL_OK) st = anneal_train_sample(t, &text);
    anneal_status sr = anneal_train_dist_full_params(t, false);
    if (st == ANNEAL_OK) st = sr;
    if (st != ANNEAL_OK || !text) {
        free(text);
        return st;
    }
    anneal_progress_note(t->prog, "--- sample at step %lld (temperature %g) ---\n%s\n---", (long long)t->st.step,
                         t->cfg.sample_temperature, text);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "sample");
    cJSON_AddNumberToObject(o, "step", (double)t->st.step);
    cJSON_AddStringToObject(o, "text", text);
    anneal_train_log_json(t, o);
    free(text);
    return ANNEAL_OK;
}

static void log_step(trainer *t, const step_out *so, const anneal_step_stats *ps) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "step");
    cJSON_AddNumberToObject(o, "step", (double)ps->step);
    cJSON_AddNumberToObject(o, "loss", so->loss);
    cJSON_AddNumberToObject(o, "lr", so->lr);
    cJSON_AddNumberToObject(o, "grad_norm", (double)so->norm);
    cJSON_AddNumberToObject(o, "tokens_per_s", ps->tokens_per_s);
    cJSON_AddNumberToObject(o, "mfu", ps->mfu);
    cJSON_AddNumberToObject(o, "ms", ps->ms);
    cJSON_AddNumberToObject(o, "cpu_ms", ps->cpu_ms);
    cJSON_AddNumberToObject(o, "tokens", (double)t->st.tokens);
    /* allocator bytes held on the model's device (tensors + cache) */
    cJSON_AddNumberToObject(o, "memory_bytes", (double)anneal_memory_stats_get(anneal_model_device(t->model)).reserved_bytes);
    cJSON_AddBoolToObject(o, "skipped", so->skipped);
    anneal_train_dist_log_bytes(t, o, false); /* PowerSGD: bytes on the wire */
    anneal_train_pp_log_step(t, o);           /* --pp: the measured and ideal bubble */
    cJSON_AddNumberToObject(o, "rss_bytes", (double)anneal_train_rss_bytes()); /* resident now (offload.c) */
    if (so->loss_scale > 0) { /* fp16 */
        cJSON_AddNumberToObject(o, "loss_scale", (double)so->loss_scale);
        cJSON_AddBoolToObject(o, "overflow", so->overflow);
    }
    anneal_train_log_json(t, o);
}

/* A step that beat the ceiling (MFU above 100%) shows the start-up peak measurement was
 * disturbed: a single process whose peak was measured measures again, for longer, keeps
 * the higher figure and recomputes the step's MFU against it. A figure that still gives
 * MFU above 100% (a --peak-gflops below the machine's rate, or a distributed run, whose
 * ranks would all have to measure again together) is said once. */
static void check_peak(trainer *t, anneal_step_stats *ps) {
    if (!(ps->mfu > 1.0) || t->peak_checked) return;
    t->peak_checked = true;
    double old = t->peak_gflops;
    if (t->peak_source == t->peak_source_buf && !strncmp(t->peak_source, "measured", 8) && t->world <= 1) {
        const char *isa = "?";
        int th = anneal_get_num_threads();
        double g = anneal_peak_gflops_measure_dtype(th, 0.25, t->dtype, &isa);
        if (g > old) {
            t->peak_gflops = g;
            snprintf(t->peak_source_buf, sizeof t->peak_source_buf, "re-measured: %s microbenchmark, %d threads", isa, th);
            ps->mfu *= old / g;
        }
        anneal_progress_note(t->prog, "step %lld: MFU above 100%% against the start-up ceiling %.1f GFLOP/s: measured "
                                      "again, %.1f GFLOP/s; MFU now against %.1f GFLOP/s",
                             (long long)ps->step, old, g, t->peak_gflops);
    }
    if (ps->mfu > 1.0)
        anneal_progress_note(t->prog, "step %lld: MFU %.0f%% is above 100%%: the ceiling %.1f GFLOP/s (%s) is below "
                                      "what the step achieved",
                             (long long)ps->step, 100.0 * ps->mfu, t->peak_gflops, t->peak_source);
}

static void print_header(trainer *t) {
    const anneal_train_config *c = &t->cfg;
    const anneal_model_config *m = &t->mcfg;
    char b1[32], b2[32];
    anneal_progress_note(t->prog, "model: %s, %d layers, %d heads, %d channels, vocab %d, context %d: %.2fM parameters (%s)%s",
                         m->arch, m->n_layer, m->n_head, m->n_embd, m->vocab_size, m->n_ctx,
                         (double)anneal_model_num_params(t->model) / 1e6, t->model_source,
                         c->init && !c->resume ? ", weights from --init" : "");
    if (c->synthetic)
        anneal_progress_note(t->prog, "data: synthetic Markov chain (4 successors per token: best possible loss ln 4 = 1.386)");
    else
        anneal_progress_note(t->prog, "data: %s: %s windows of %lld tokens%s%s", c->data,
                             anneal_format_count((double)anneal_train_source_windows(&t->train), b1, sizeof b1),
                             (long long)c->seq, t->has_val ? ", val split for evaluation" : ", no val split",
                             c->shuffle ? ", shuffled" : "");
    anneal_progress_note(t->prog,
                         "training: %lld steps of %lld x %lld tokens%s (%s tokens), lr %g %s, warmup %lld, threads %d%s%s%s, recompute %s",
                         (long long)t->total_steps, (long long)c->batch, (long long)c->seq,
                         c->accum > 1 ? " x accum" : "", anneal_format_count((double)t->total_steps * (double)t->tokens_per_step, b2, sizeof b2),
                         c->lr, c->schedule ? c->schedule : "cosine", (long long)c->warmup, anneal_get_num_threads(),
                         t->pin_desc[0] ? " (pinned to CPUs " : "", t->pin_desc, t->pin_desc[0] ? ")" : "",
                         c->recompute ? c->recompute : "none");
    if (c->accum > 1) anneal_progress_note(t->prog, "gradient accumulation: %lld micro-batches per step", (long long)c->accum);
    anneal_progress_note(t->prog, "run directory: %s (checkpoints %s, keep %lld)", t->run_dir,
                         c->ckpt_every > 0 ? "periodic and at the end" : "at the end", (long long)c->keep);
    if (c->ckpt_every > 0) anneal_progress_note(t->prog, "  checkpoint every %lld steps", (long long)c->ckpt_every);
    if (t->device != ANNEAL_CPU) {
        char gpu[320] = "";
        anneal_device dev;
        int ordinal = -1;
        anneal_cuda_device_info info;
        if (t->device == ANNEAL_CUDA && anneal_train_device_parse(c->device, &dev, &ordinal) == ANNEAL_OK &&
            anneal_cuda_device_info_get(ordinal < 0 ? 0 : ordinal, &info) == ANNEAL_OK)
            snprintf(gpu, sizeof gpu, " (GPU %d: %s, %.1f GiB)", info.ordinal, info.name,
                     (double)info.total_bytes / 1073741824.0);
        anneal_clear_error();
        anneal_progress_note(t->prog, "device: %s%s: model, batches, evaluation and samples; checkpoints are the "
                                      "same files as on the CPU", c->device, gpu);
    }
    if (t->peak_gflops > 0) anneal_progress_note(t->prog, "MFU against %.1f GFLOP/s (%s)", t->peak_gflops, t->peak_source);
    else anneal_progress_note(t->prog, "MFU: not reported (peak %s)", t->peak_source);
    if (t->resume_ckpt[0])
        anneal_progress_note(t->prog, "resumed from %s at step %lld", t->resume_ckpt, (long long)t->st.step);
    /* the device is not saved with a run (its checkpoints are the same files anywhere) */
    if (t->resume_ckpt[0] && !c->device && anneal_cuda_device_count(NULL, 0) > 0)
        anneal_progress_note(t->prog, "note: resuming on the CPU: --device is not saved with a run (give --device cuda "
                                      "to resume on a GPU)");
    anneal_train_note_precision(t);
    anneal_train_note_lora(t);
}

static void print_summary(trainer *t, anneal_train_result *res, double first_loss, int signo) {
    char d[32], tk[32], tps[32];
    anneal_memory_stats mem = anneal_memory_stats_get(anneal_model_device(t->model));
    int64_t ran = t->st.step - t->start_step;
    double run_tokens = (double)ran * (double)t->tokens_per_step;
    anneal_progress_note(t->prog, "%s: %lld steps (%lld in this run) in %s, %s tokens, %s tok/s",
                         res->interrupted ? (signo ? "interrupted" : "stopped") : "done", (long long)t->st.step, (long long)ran,
                         anneal_format_duration(res->seconds, d, sizeof d),
                         anneal_format_count((double)t->st.tokens, tk, sizeof tk),
                         anneal_format_count(res->seconds > 0 ? run_tokens / res->seconds : NAN, tps, sizeof tps));
    anneal_progress_note(t->prog, "  train loss %.4f (first step of this run %.4f), val loss %.4f, skipped steps %lld",
                         res->train_loss, first_loss, res->val_loss, (long long)t->st.skipped_steps);
    if (t->use_scaler)
        anneal_progress_note(t->prog, "  fp16 loss scale %g, %lld overflow steps skipped", (double)t->scaler.scale,
                             (long long)t->st.overflow_steps);
    anneal_train_pp_note_summary(t); /* --pp: the measured bubble (pipeline.c) */
    anneal_progress_note(t->prog, "  peak memory%s%s: tensors %.1f MiB, allocator %.1f MiB (tensors + cache), RSS %.1f MiB",
                         t->device != ANNEAL_CPU ? " on " : "", t->device != ANNEAL_CPU ? t->cfg.device : "",
                         (double)mem.peak_bytes / 1048576.0, (double)mem.peak_reserved_bytes / 1048576.0,
                         (double)anneal_peak_rss_bytes() / 1048576.0);
    if (t->last_ckpt_step >= 0 && t->ckpt_good)
        anneal_progress_note(t->prog, "  checkpoint: %s/ckpt_%08lld", t->run_dir, (long long)t->last_ckpt_step);
    if (res->interrupted && signo == 0)
        anneal_progress_note(t->prog, "stopped at step %lld (--stop-at): continue with: anneal train --resume %s",
                             (long long)t->st.step, t->run_dir);
    else if (res->interrupted)
        anneal_progress_note(t->prog, "interrupted by %s: continue with: anneal train --resume %s",
                             signo == SIGTERM ? "SIGTERM" : signo == SIGINT ? "SIGINT" : "a stop request", t->run_dir);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "summary");
    cJSON_AddNumberToObject(o, "step", (double)t->st.step);
    cJSON_AddNumberToObject(o, "steps_this_run", (double)ran);
    cJSON_AddNumberToObject(o, "tokens", (double)t->st.tokens);
    cJSON_AddNumberToObject(o, "seconds", res->seconds);
    cJSON_AddNumberToObject(o, "train_loss", res->train_loss);
    cJSON_AddNumberToObject(o, "val_loss", res->val_loss);
    cJSON_AddNumberToObject(o, "skipped_steps", (double)t->st.skipped_steps);
    if (t->use_scaler) {
        cJSON_AddNumberToObject(o, "overflow_steps", (double)t->st.overflow_steps);
        cJSON_AddNumberToObject(o, "loss_scale", (double)t->scaler.scale);
    }
    cJSON_AddNumberToObject(o, "peak_tensor_bytes", (double)mem.peak_bytes);
    cJSON_AddNumberToObject(o, "peak_allocator_bytes", (double)mem.peak_reserved_bytes);
    cJSON_AddNumberToObject(o, "allocator_system_allocs", (double)mem.n_system_allocs);
    cJSON_AddNumberToObject(o, "peak_rss_bytes", (double)anneal_peak_rss_bytes());
    anneal_train_dist_log_bytes(t, o, true); /* PowerSGD: bytes on the wire, the run's */
    cJSON_AddBoolToObject(o, "interrupted", res->interrupted);
    anneal_train_log_json(t, o);
}

/* The "summary" record of a run that failed after it started: where it got to and
 * the error ("failed": true). The recorded error is kept. */
static void log_failed_summary(trainer *t, const anneal_train_result *res) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", anneal_last_error());
    anneal_status code = anneal_last_status();
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "summary");
    cJSON_AddNumberToObject(o, "step", (double)t->st.step);
    cJSON_AddNumberToObject(o, "steps_this_run", (double)(t->st.step - t->start_step));
    cJSON_AddNumberToObject(o, "tokens", (double)t->st.tokens);
    cJSON_AddNumberToObject(o, "seconds", res->seconds);
    cJSON_AddNumberToObject(o, "train_loss", res->train_loss);
    cJSON_AddNumberToObject(o, "skipped_steps", (double)t->st.skipped_steps);
    cJSON_AddNumberToObject(o, "checkpoint_failures", t->ckpt_failures);
    cJSON_AddBoolToObject(o, "interrupted", res->interrupted);
    cJSON_AddBoolToObject(o, "failed", true);
    cJSON_AddStringToObject(o, "error", msg);
    anneal_clear_error();
    anneal_train_log_json(t, o);
    anneal_clear_error();
    anneal_set_error(code ? code : ANNEAL_ERR_IO, "%s", msg);
}

/* True (and *st cleared to ANNEAL_OK) when *st says a stop request cut the work
 * short: the run then ends like a stop between steps. */
static bool stop_hit(anneal_status *st) {
    if (*st != ANNEAL_ERR_INTERRUPTED) return false;
    anneal_clear_error();
    *st = ANNEAL_OK;
    return true;
}

/* Re-records the current error with "step N: " in front; out of memory on a GPU also
 * says how much the GPU has (the allocator's message names the request, what the
 * device holds by category, and the flags that lower the peak). */
static anneal_status step_error(const trainer *t, int64_t step1) {
    anneal_status code = anneal_last_status();
    if (code == ANNEAL_OK) code = ANNEAL_ERR_STATE;
    char msg[1024], gpu[400] = "";
    snprintf(msg, sizeof msg, "%s", anneal_last_error());
    anneal_clear_error();
    if (code == ANNEAL_ERR_OOM && t->device == ANNEAL_CUDA) {
        anneal_device dev;
        int ordinal = -1;
        anneal_cuda_device_info info;
        if (anneal_train_device_parse(t->cfg.device, &dev, &ordinal) == ANNEAL_OK &&
            anneal_cuda_device_info_get(ordinal < 0 ? 0 : ordinal, &info) == ANNEAL_OK)
            snprintf(gpu, sizeof gpu, " [--device %s: GPU %d, %s, %.1f GiB, %.1f GiB free]", t->cfg.device, info.ordinal,
                     info.name, (double)info.total_bytes / 1073741824.0, (double)info.free_bytes / 1073741824.0);
        anneal_clear_error();
    }
    return anneal_set_error(code, "step %lld: %s%s", (long long)step1, msg, gpu);
}

anneal_status anneal_train_run(const anneal_train_config *cfg, FILE *out, anneal_train_result *res) {
    return anneal_train_run_comm(cfg, NULL, out, res);
}

anneal_status anneal_train_run_comm(const anneal_train_config *cfg, anneal_comm *comm, FILE *out,
                                    anneal_train_result *res) {
    memset(res, 0, sizeof *res);
    res->train_loss = res->val_loss = NAN;
    double t_start = anneal_train_now_ms();
    trainer *t = calloc(1, sizeof *t);
    if (!t) return anneal_set_error(ANNEAL_ERR_OOM, "train: out of memory");
    bool usage = false;
    t->comm = comm;
    anneal_status fail = anneal_train_setup(t, cfg, out, &usage);
    t->comm = comm; /* also when setup failed early */
    if (comm) t->rank = anneal_comm_rank(comm), t->world = anneal_comm_size(comm);
    /* distributed: no rank goes on unless every rank's setup worked */
    fail = anneal_train_dist_agree(t, fail, "setup");
    if (fail == ANNEAL_OK) fail = anneal_train_dist_setup(t, &usage);
    if (fail == ANNEAL_OK) fail = anneal_train_dist_agree(t, anneal_train_setup_offload(t, &usage), "--offload");
    if (fail == ANNEAL_OK) fail = anneal_train_dist_agree(t, anneal_train_setup_offload_act(t, &usage), "--offload");
    snprintf(res->run_dir, sizeof res->run_dir, "%s", t->run_dir);
    if (fail != ANNEAL_OK) {
        res->usage_error = usage;
        if (fail == ANNEAL_ERR_INTERRUPTED) { /* a stop during setup: nothing to save */
            res->interrupted = true;
            res->signal = anneal_interrupt_pending() > 0 ? anneal_interrupt_pending() : 0;
        }
        anneal_train_stop_reset();
        anneal_train_dist_teardown(t);
        anneal_train_teardown(t);
        free(t);
        return fail;
    }
    /* distributed: evaluation and samples run to their end on every rank (their
     * collectives must match); the ranks agree on a stop between micro-batches */
    bool hold = t->world > 1;
    if (hold) anneal_interrupt_hold(true);
    print_header(t);
    anneal_train_memory_limit(t, true); /* --memory-limit (profile.c) */
    anneal_train_dist_print_header(t);
    anneal_train_det_print_header(t);
    anneal_train_log_start(t);
    if ((fail = anneal_train_dist_report_memory(t, "at start")) != ANNEAL_OK) fail = anneal_train_dist_fatal(t, fail);
    if (t->st.step >= t->total_steps)
        anneal_progress_note(t->prog, "nothing to do: the run has %lld of %lld steps (raise --steps to go on)",
                             (long long)t->st.step, (long long)t->total_steps);

    const anneal_train_config *c = &t->cfg;
    double first_loss = NAN, last_loss = NAN, val = NAN, first_end = 0;
    int64_t last_eval_step = -1, last_sample_step = -1, ran = 0;
    int bad_in_row = 0, signo = 0;
    bool interrupted = false;
    for (int64_t step = t->st.step; step < t->total_steps; step++) {
        anneal_train_profile_before_step(t, step + 1); /* --profile (profile.c) */
        double t0 = anneal_train_now_ms(), c0 = anneal_train_cpu_ms();
        int64_t span_t0 = anneal_span_begin();
        step_out so;
        anneal_status rs = run_step(t, step, &so);
        anneal_span_end(ANNEAL_SPAN_STEP, "step", span_t0, 0, 0);
        if (stop_hit(&rs)) { /* between micro-batches: the step is abandoned */
            anneal_train_stop_requested(&signo);
            if (!signo) signo = -1;
            interrupted = true;
            break;
        }
        if (rs != ANNEAL_OK) {
            fail = anneal_train_dist_fatal(t, step_error(t, step + 1));
            break;
        }
        double now = anneal_train_now_ms(), ms = now - t0, cpu_ms = anneal_train_cpu_ms() - c0;
        t->st.step = step + 1;
        t->st.tokens += t->tokens_per_step;
        t->st.rng = anneal_rng_get();
        t->st.cursor = anneal_train_source_get_cursor(&t->train);
        if (so.overflow) t->st.overflow_steps++; /* fp16: the loss scaler handles it, not a bad step */
        else if (so.skipped) t->st.skipped_steps++, bad_in_row++;
        else bad_in_row = 0;
        if (++ran == 1) first_end = now, first_loss = so.loss;
        last_loss = so.loss;

        anneal_step_stats ps = {.step = step + 1, .total = t->total_steps, .loss = so.loss, .lr = so.lr,
                                .grad_norm = so.norm, .ms = ms, .cpu_ms = cpu_ms, .skipped = so.skipped};
        ps.tokens_per_s = (double)t->tokens_per_step / (ms / 1e3);
        ps.mem_bytes = (double)anneal_memory_stats_get(anneal_model_device(t->model)).peak_bytes;
        ps.mfu = t->peak_gflops > 0 ? t->flops_per_token * ps.tokens_per_s / (t->peak_gflops * 1e9) : NAN;
        check_peak(t, &ps);
        /* ETA from the average wall time per step since the first (which warms up) */
        double avg_ms = ran > 1 ? (now - first_end) / (double)(ran - 1) : ms;
        ps.eta_s = avg_ms * (double)(t->total_steps - t->st.step) / 1e3;
        anneal_progress_step(t->prog, &ps);
        if ((fail = anneal_train_dist_fatal(t, anneal_train_telemetry_step_times(t, ms))) != ANNEAL_OK) break;
        log_step(t, &so, &ps);
        anneal_train_profile_after_step(t, step + 1);
        if (ran == 1) anneal_train_memory_report(t, "after the first step");
        if (so.overflow) {
            anneal_progress_note(t->prog, "step %lld: fp16 gradient overflow at loss scale %g: update skipped, scale now %g",
                                 (long long)t->st.step, (double)so.loss_scale, (double)t->scaler.scale);
        } else if (so.skipped) {
            anneal_progress_note(t->prog,
                                 "step %lld: loss %g, gradient norm %g: not finite, update skipped (%d in a row; "
                                 "--max-bad-steps %lld)",
                                 (long long)t->st.step, so.loss, (double)so.norm, bad_in_row, (long long)c->max_bad_steps);
            if (bad_in_row >= c->max_bad_steps) {
                fail = anneal_set_error(ANNEAL_ERR_NUMERIC,
                                        "%d non-finite steps in a row (steps %lld-%lld): stopping (--max-bad-steps %lld)",
                                        bad_in_row, (long long)(t->st.step - bad_in_row + 1), (long long)t->st.step,
                                        (long long)c->max_bad_steps);
                break;
            }
        }
        bool last = t->st.step == t->total_steps;
        if (c->eval_every > 0 && t->st.step % c->eval_every == 0 && t->has_val && t->eval_batches > 0) {
            anneal_status es = do_eval(t, &val);
            if (stop_hit(&es)) {
                anneal_train_stop_requested(&signo);
                interrupted = true;
                break;
            }
            if ((fail = anneal_train_dist_fatal(t, es)) != ANNEAL_OK) break;
            last_eval_step = t->st.step;
        }
        if (c->sample_every > 0 && t->st.step % c->sample_every == 0 && t->tok) {
            anneal_status ss = do_sample(t);
            if (stop_hit(&ss)) {
                anneal_train_stop_requested(&signo);
                interrupted = true;
                break;
            }
            if ((fail = ss) != ANNEAL_OK) break;
            last_sample_step = t->st.step;
        }
        /* a signal may reach one rank only: the ranks stop together or not at all */
        bool stop = anneal_train_stop_requested(&signo);
        if ((fail = anneal_train_dist_fatal(t, anneal_train_dist_any(t, &stop))) != ANNEAL_OK) break;
        if (stop && !signo) signo = -1; /* the signal reached another rank */
        if ((stop || (c->stop_at > 0 && t->st.step >= c->stop_at)) && !last) {
            interrupted = true;
            break;
        }
        if (c->ckpt_every > 0 && t->st.step % c->ckpt_every == 0 && !last &&
            (fail = anneal_train_dist_fatal(t, save_checkpoint(t))) != ANNEAL_OK)
            break;
    }

    if (fail == ANNEAL_OK) {
        /* the end: evaluation and sample at the final step, then the final checkpoint */
        if (!interrupted && ran > 0 && t->has_val && t->eval_batches > 0 && last_eval_step != t->st.step) {
            fail = do_eval(t, &val);
            if (stop_hit(&fail)) anneal_train_stop_requested(&signo), interrupted = true;
            fail = anneal_train_dist_fatal(t, fail);
        }
        if (fail == ANNEAL_OK && !interrupted && ran > 0 && c->sample_every > 0 && t->tok &&
            last_sample_step != t->st.step) {
            fail = do_sample(t);
            if (stop_hit(&fail)) anneal_train_stop_requested(&signo), interrupted = true;
        }
        /* a checkpoint when a step completed since the last one (a stop before any step of
         * a new run has nothing to save; a resume's checkpoint is still the latest) */
        if (fail == ANNEAL_OK && t->last_ckpt_step != t->st.step && ran > 0) fail = save_checkpoint(t);
        if (fail == ANNEAL_OK && interrupted && ran == 0 && !t->resume_ckpt[0])
            fail = anneal_set_error(ANNEAL_ERR_INTERRUPTED, "interrupted by %s before the first step ended",
                                    signo == SIGTERM ? "SIGTERM" : signo == SIGINT ? "SIGINT" : "a stop request");
    }
    /* every write must be complete (or known to have failed) before we report; an
     * earlier failure keeps its message */
    char failmsg[1024] = "";
    if (fail != ANNEAL_OK) {
        snprintf(failmsg, sizeof failmsg, "%s", anneal_last_error());
        anneal_clear_error();
    }
    anneal_status cw = wait_checkpoint(t, false);
    if (cw != ANNEAL_OK || (t->last_ckpt_step == t->st.step && !t->ckpt_good)) {
        char msg[1024], ck[PATH_MAX];
        snprintf(msg, sizeof msg, "%s", cw != ANNEAL_OK ? anneal_last_error() : "see the warning above");
        anneal_clear_error();
        bool have = anneal_checkpoint_resolve(t->run_dir, ck, sizeof ck) == ANNEAL_OK;
        anneal_clear_error();
        char tail[PATH_MAX + 64];
        snprintf(tail, sizeof tail, "; the newest complete checkpoint is %s", have ? ck : "none");
        if (fail == ANNEAL_OK)
            fail = anneal_set_error(ANNEAL_ERR_IO, "the checkpoint of step %lld failed: %s%s", (long long)t->last_ckpt_step,
                                    msg, tail);
        else
            anneal_progress_note(t->prog, "warning: the checkpoint of step %lld failed: %s%s", (long long)t->last_ckpt_step,
                                 msg, tail);
    }
    if (failmsg[0]) {
        anneal_clear_error();
        anneal_set_error(fail, "%s", failmsg);
    }

    res->steps_done = t->st.step;
    res->tokens = t->st.tokens;
    res->skipped_steps = t->st.skipped_steps;
    res->train_loss = last_loss;
    res->val_loss = val;
    res->interrupted = interrupted;
    res->signal = signo > 0 ? signo : 0;
    res->seconds = (anneal_train_now_ms() - t_start) / 1e3;
    /* every rank gets here (a failure on one rank alone ended the job): collective */
    anneal_status mr = anneal_train_dist_report_memory(t, "at end");
    if (mr != ANNEAL_OK && fail == ANNEAL_OK) fail = mr;
    anneal_train_profile_finish(t);
    anneal_train_memory_limit(t, false);
    anneal_train_memory_report(t, "at the end");
    if (fail == ANNEAL_OK) print_summary(t, res, first_loss, signo);
    else if (t->log) log_failed_summary(t, res); /* a run that started ends its log with a summary too */
    anneal_train_stop_reset();
    if (hold) anneal_interrupt_hold(false);
    anneal_train_dist_teardown(t);
    anneal_train_teardown(t);
    free(t);
    return fail;
}
