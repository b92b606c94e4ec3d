/* Mixed precision in the trainer (--dtype, --loss-scale, --scale-growth-interval),
 * autocast-like: parameters, gradients, optimizer state, norms, softmax and the loss
 * stay f32; the operands of every GEMM are rounded to bf16 or f16 (the model's compute
 * precision, set for the whole run, so evaluation and samples run at it too; each op
 * records it for its backward) and accumulated in f32. f16's range needs loss scaling: the loss is multiplied by the
 * scale before backward and the gradients by 1/scale after it (and after the
 * gradient all-reduce), before the norm and clipping. With a dynamic scale, NaN/Inf
 * gradients under a finite loss are an overflow: the update is skipped, the scale
 * backs off, and the step is not counted toward --max-bad-steps. With --tp or --pp each
 * rank holds other gradients (shards, stages): the overflow is agreed over the world
 * (one scalar per step) so every rank skips, backs off or grows at once. The scaler's state
 * rides in every checkpoint so a resumed run scales exactly as a straight one. */
#include "train_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

anneal_status anneal_train_setup_precision(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    t->dtype = ANNEAL_F32;
    if (c->dtype && !anneal_train_dtype_parse(c->dtype, &t->dtype)) { /* checked when it was set */
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--dtype: unknown precision '%s' (fp32, bf16, fp16)", c->dtype);
    }
    bool dynamic = !c->loss_scale || !strcmp(c->loss_scale, "dynamic");
    t->use_scaler = t->dtype == ANNEAL_F16;
    if (!t->use_scaler && !dynamic)
        anneal_progress_note(t->prog, "note: --loss-scale %s applies to --dtype fp16 only: ignored", c->loss_scale);
    if (t->use_scaler && c->zero >= 2) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--dtype fp16 with --zero %lld: loss scaling of sharded gradients is not "
                                "supported yet (use --zero 0 or 1, or --dtype bf16, which needs no scaler)",
                                (long long)c->zero);
    }
    anneal_loss_scaler_config sc = anneal_loss_scaler_defaults();
    sc.growth_interval = c->scale_growth_interval;
    sc.init_scale = c->loss_scale_init;
    if (!dynamic) {
        sc.dynamic = false;
        sc.init_scale = strtod(c->loss_scale, NULL); /* validated by anneal_train_config_set */
    }
    if (anneal_loss_scaler_init(&t->scaler, sc) != ANNEAL_OK) {
        *usage = true;
        return anneal_last_status();
    }
    t->resumed_dtype = t->resume_ckpt[0] ? t->st.dtype : t->dtype;
    if (t->use_scaler && dynamic && t->resume_ckpt[0] && t->st.dtype == ANNEAL_F16 && t->st.loss_scale > 0) {
        if (anneal_loss_scaler_set_state(&t->scaler, t->st.loss_scale, t->st.loss_scale_growth_tracker) != ANNEAL_OK)
            return anneal_last_status();
        t->scaler_restored = true;
    }
    t->st.dtype = t->dtype;
    t->st.loss_scale = t->use_scaler ? t->scaler.scale : 0.0f;
    t->st.loss_scale_growth_tracker = t->use_scaler ? t->scaler.growth_tracker : 0;
    return anneal_model_set_compute(t->model, t->dtype);
}

void anneal_train_note_precision(trainer *t) {
    if (t->resume_ckpt[0] && t->resumed_dtype != t->dtype)
        anneal_progress_note(t->prog, "note: the checkpoint was trained with --dtype %s; this run continues with --dtype %s",
                             anneal_precision_name(t->resumed_dtype), anneal_precision_name(t->dtype));
    if (t->dtype == ANNEAL_F32) {
        anneal_progress_note(t->prog, "precision: fp32");
        return;
    }
    anneal_progress_note(t->prog, "precision: %s matmul operands, fp32 accumulation; fp32 weights, optimizer, norms, "
                         "softmax and loss", anneal_precision_name(t->dtype));
    if (!t->use_scaler) return;
    const anneal_loss_scaler *s = &t->scaler;
    if (!s->cfg.dynamic)
        anneal_progress_note(t->prog, "  static loss scale %g", (double)s->scale);
    else if (t->scaler_restored)
        anneal_progress_note(t->prog, "  dynamic loss scale %g from the checkpoint (%lld clean steps; x2 after %lld, x0.5 "
                             "and skip on overflow)", (double)s->scale, (long long)s->growth_tracker,
                             (long long)s->cfg.growth_interval);
    else
        anneal_progress_note(t->prog, "  dynamic loss scale %g (x2 after %lld clean steps, x0.5 and skip on overflow)",
                             (double)s->scale, (long long)s->cfg.growth_interval);
}

anneal_tensor *anneal_train_scale_loss(trainer *t, anneal_tensor *obj) {
    if (!t->use_scaler || !obj) return obj;
    return anneal_scale(obj, t->scaler.scale);
}

anneal_status anneal_train_unscale_grads(trainer *t, double loss, bool *overflow, float *scale_used) {
    *overflow = false;
    *scale_used = 0;
    if (!t->use_scaler) return ANNEAL_OK;
    *scale_used = t->scaler.scale;
    bool found_inf = false;
    anneal_train_inject_inf_grad(t, t->st.step + 1); /* test hook (faults.c) */
    anneal_status st = anneal_loss_scaler_unscale(&t->scaler, t->model->params, &found_inf);
    if (st != ANNEAL_OK) return st;
    if (t->tp || t->pp) { /* split parameters: every rank skips, backs off or grows together */
        float any = found_inf ? 1.0f : 0.0f;
        if ((st = anneal_comm_allreduce(t->comm, &any, 1, ANNEAL_F32, ANNEAL_REDUCE_SUM)) != ANNEAL_OK) return st;
        found_inf = any > 0;
    }
    /* a non-finite loss is not the scale's doing: a bad step, the scaler untouched */
    if (isfinite(loss)) {
        *overflow = found_inf && t->scaler.cfg.dynamic;
        anneal_loss_scaler_update(&t->scaler, found_inf);
    }
    t->st.loss_scale = t->scaler.scale;
    t->st.loss_scale_growth_tracker = t->scaler.growth_tracker;
    return ANNEAL_OK;
}
