/* Validation loss and samples during training. Both run with dropout off and
 * without autograd, and neither touches the training loader or the global RNG, so
 * evaluating or sampling never changes the training trajectory. */
#include "train_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Batch i of an evaluation: the next batch of the val source (always full). */
static anneal_status next_val(void *user, int64_t i, int32_t *ids, int32_t *targets, int64_t *rows) {
    trainer *t = user;
    *rows = t->local_batch;
    return anneal_train_source_next(&t->val, ids, targets);
}

anneal_status anneal_train_evaluate(trainer *t, double *val_loss) {
    *val_loss = NAN;
    if (!t->has_val || t->eval_batches <= 0) return ANNEAL_OK;
    /* every evaluation reads the same batches: the val split from its beginning
     * (synthetic: the val stream from batch 0) */
    anneal_loader_cursor zero = {0, 0, 0};
    anneal_status st = anneal_train_source_set_cursor(&t->val, zero);
    if (st == ANNEAL_OK && t->pp) return anneal_train_pp_evaluate(t, val_loss); /* --pp: through the stages */
    /* distributed: this rank's share of each batch (--deterministic: all of it) */
    if (st == ANNEAL_OK)
        st = anneal_model_evaluate(t->model, t->local_batch, t->cfg.seq, t->eval_batches, next_val, t, val_loss, NULL);
    /* equal shares: the mean of the ranks' means; --deterministic: every rank evaluated
     * the whole batches one process evaluates (W x the work), so its value is already
     * the one-process bits */
    if (st == ANNEAL_OK && !t->cfg.deterministic) st = anneal_train_dist_mean(t, val_loss);
    return st;
}

typedef struct sample_sink {
    anneal_ids ids;
    bool failed;
} sample_sink;

static bool collect(int32_t id, void *user) {
    sample_sink *s = user;
    if (anneal_ids_push(&s->ids, id) != ANNEAL_OK) {
        s->failed = true;
        return false;
    }
    return true;
}

anneal_status anneal_train_sample(trainer *t, char **text) {
    *text = NULL;
    if (!t->tok) return ANNEAL_OK;
    const anneal_train_config *c = &t->cfg;
    int32_t eot = anneal_tokenizer_eot(t->tok);
    anneal_ids prompt = {0};
    anneal_status st = ANNEAL_OK;
    if (c->sample_prompt) st = anneal_tokenizer_encode(t->tok, c->sample_prompt, strlen(c->sample_prompt), false, &prompt);
    else if (eot >= 0) st = anneal_ids_push(&prompt, eot); /* the start of a new document */
    else st = anneal_tokenizer_encode(t->tok, "\n", 1, false, &prompt);
    if (st == ANNEAL_OK && prompt.n == 0) st = anneal_tokenizer_encode(t->tok, "\n", 1, false, &prompt);
    if (st != ANNEAL_OK) {
        anneal_ids_free(&prompt);
        return st;
    }
    /* keep the prompt inside the context with room for the sample */
    int64_t n_prompt = (int64_t)prompt.n, max_new = c->sample_tokens;
    if (max_new > t->mcfg.n_ctx - 1) max_new = t->mcfg.n_ctx - 1;
    int64_t first = n_prompt + max_new > t->mcfg.n_ctx ? n_prompt + max_new - t->mcfg.n_ctx : 0;
    anneal_sampler_config sc = {.temperature = (float)c->sample_temperature, .top_k = 40, .top_p = 1.0f,
                                .seed = (uint64_t)c->seed};
    sample_sink sink = {0};
    if (t->pp)
        st = anneal_train_pp_generate(t, prompt.ids + first, n_prompt - first, max_new, &sc, eot, collect, &sink);
    else if (anneal_train_tp_active(t))
        st = anneal_train_tp_generate(t, prompt.ids + first, n_prompt - first, max_new, &sc, eot, collect, &sink);
    else
        st = anneal_model_generate(t->model, prompt.ids + first, n_prompt - first, max_new, &sc, eot, collect, &sink);
    if (st == ANNEAL_OK && sink.failed) st = anneal_set_error(ANNEAL_ERR_OOM, "sample: out of memory");
    /* the text: the prompt as given (without a leading end-of-text) and what followed */
    char *gen = NULL;
    size_t gen_len = 0;
    if (st == ANNEAL_OK) st = anneal_tokenizer_decode(t->tok, sink.ids.ids, sink.ids.n, &gen, &gen_len);
    if (st == ANNEAL_OK) {
        const char *p = c->sample_prompt ? c->sample_prompt : "";
        size_t pl = strlen(p), cap = 3 * (pl + gen_len) + 1;
        char *joined = malloc(pl + gen_len + 1), *clean = malloc(cap);
        if (!joined || !clean) {
            free(joined);
            free(clean);
            st = anneal_set_error(ANNEAL_ERR_OOM, "sample: out of memory");
        } else {
            memcpy(joined, p, pl);
            memcpy(joined + pl, gen, gen_len);
            anneal_utf8_sanitize(joined, pl + gen_len, clean, cap);
            free(joined);
            *text = clean;
        }
    }
    free(gen);
    anneal_ids_free(&sink.ids);
    anneal_ids_free(&prompt);
    return st;
}
