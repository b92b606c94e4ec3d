/* The one loss-over-batches loop (the trainer's validation, `anneal eval`,
 * benchmarks): dropout off, no autograd, batches built in host buffers and uploaded
 * to the model's device. How a batch counts: its mean loss (over its real targets)
 * weighted by its count of real targets relative to a full batch (batch x seq). Rows
 * past the batch's real rows are ignored (-100), so a last, partial batch counts only
 * what it holds and every real target weighs the same; a run of full batches gives
 * exactly the plain mean of their losses, summed in batch order. */
#include "anneal/autograd.h"
#include "anneal/model.h"

#include <math.h>
#include <stdlib.h>

anneal_status anneal_model_evaluate(anneal_model *m, int64_t batch, int64_t seq, int64_t n, anneal_batch_fn next,
                                    void *user, double *loss, int64_t *tokens) {
    if (loss) *loss = NAN;
    if (tokens) *tokens = 0;
    if (!m || !next || !loss) return anneal_set_error(ANNEAL_ERR_ARG, "evaluate: NULL model, batch source or result");
    if (batch <= 0 || seq <= 0 || n < 0)
        return anneal_set_error(ANNEAL_ERR_ARG, "evaluate: batch %lld and seq %lld must be positive, n %lld >= 0",
                                (long long)batch, (long long)seq, (long long)n);
    int64_t full = batch * seq;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)full), *tg = malloc(sizeof(int32_t) * (size_t)full);
    anneal_status s = ids && tg ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "evaluate: out of memory");
    anneal_device dev = anneal_model_device(m);
    bool was_training = m->ctx.training;
    m->ctx.training = false;
    anneal_no_grad_begin();
    double sum = 0.0, weight = 0.0; /* weight: full batches' worth of targets */
    int64_t count = 0;
    for (int64_t i = 0; i < n && s == ANNEAL_OK; i++) {
        int64_t rows = batch;
        if ((s = anneal_interrupt_check("evaluating")) != ANNEAL_OK) break;
        if ((s = next(user, i, ids, tg, &rows)) != ANNEAL_OK) break;
        if (rows < 0 || rows > batch) {
            s = anneal_set_error(ANNEAL_ERR_ARG, "evaluate: batch %lld has %lld rows (0..%lld)", (long long)i,
                                 (long long)rows, (long long)batch);
            break;
        }
        int64_t real = 0;
        for (int64_t j = 0; j < full; j++) {
            if (j >= rows * seq) tg[j] = -100;
            real += tg[j] != -100;
        }
        if (real == 0) continue; /* nothing to predict: the batch weighs nothing */
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *x = anneal_from_data_on(dev, ANNEAL_I32, 2, (int64_t[]){batch, seq}, ids);
        anneal_tensor *y = anneal_from_data_on(dev, ANNEAL_I32, 2, (int64_t[]){batch, seq}, tg);
        anneal_tensor *ce = anneal_model_loss(m, x, y);
        if (ce) {
            double w = real == full ? 1.0 : (double)real / (double)full;
            sum += real == full ? anneal_item(ce) : anneal_item(ce) * w;
            weight += w;
            count += real;
        } else {
            s = anneal_last_status();
        }
        anneal_scope_close(sc);
    }
    anneal_no_grad_end();
    m->ctx.training = was_training;
    free(ids);
    free(tg);
    if (s != ANNEAL_OK) return s;
    *loss = weight > 0 ? sum / weight : NAN;
    if (tokens) *tokens = count;
    return ANNEAL_OK;
}
