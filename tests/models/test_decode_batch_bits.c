/* A served request's logits do not depend on the batch it shares: under bf16 compute the
 * decode engine reads panel-packed bf16 weights (src/cpu/gemv_panels.c, one FMA chain
 * per output in k order), so slot 0 decoded alone and slot 0 decoded with 2 or 7 other
 * slots (other prompts, other lengths, slot 0 in another row of the step) give the same
 * logits bit for bit, step after step (GPT-2 tiny and llama-tiny). So do int8 models
 * (dynamic, int8 head): from 2 rows the engine reads int8 copies packed in panels
 * (src/cpu/qpanels_avx2.c, or src/cpu/qpanels_avx512vnni.c on VNNI CPUs) with the row
 * kernels' exact int32 sums. */
#include "anneal/anneal.h"
#include "anneal/decode_kernels.h"
#include "models/decode_engine.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { STEPS = 4, PROMPT = 5 };

static int32_t lcg_id(uint64_t *s, int V) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int32_t)((*s >> 33) % (uint64_t)V);
}

/* A random model of preset name (norm weights 1, the rest normal). */
static anneal_model *make_model(const char *preset, uint64_t seed) {
    anneal_model_config c;
    if (!anneal_model_preset(preset, &c)) return NULL;
    c.n_ctx = 64;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (!m) return NULL;
    anneal_manual_seed(seed);
    anneal_scope *sc = anneal_scope_open();
    for (int i = 0; i < m->params->n; i++) {
        anneal_param *p = &m->params->items[i];
        bool norm = strstr(p->name, "norm") || strstr(p->name, "ln_");
        if (norm && p->tensor->ndim == 1 && strstr(p->name, "weight"))
            anneal_init_fill_(p->tensor, 1.0f);
        else
            anneal_init_normal_(p->tensor, 0.0f, p->tensor->ndim == 1 ? 0.1f : 0.2f);
    }
    anneal_scope_close(sc);
    return m;
}

/* Logits of slot 0 over STEPS decode steps, in a cache of `slots` slots where the others
 * hold other prompts and step along; slot 0 is row `row0` of each step. */
static bool run(anneal_model *m, int64_t slots, int64_t row0, const int32_t *prompt, const int32_t *next,
                float *out) {
    const int V = m->cfg.vocab_size;
    anneal_kv_cache *kv = anneal_model_kv_cache_new(m, slots, 32);
    if (!kv) return false;
    anneal_scope *sc = anneal_scope_open();
    bool ok = anneal_model_prefill_slot(m, kv, 0, prompt, PROMPT) != NULL;
    uint64_t s = 1234;
    for (int64_t i = 1; i < slots && ok; i++) {
        int32_t other[PROMPT + 8];
        const int64_t len = 1 + i % (PROMPT + 7);
        for (int64_t t = 0; t < len; t++) other[t] = lcg_id(&s, V);
        ok = anneal_model_prefill_slot(m, kv, i, other, len) != NULL;
    }
    for (int step = 0; step < STEPS && ok; step++) {
        int64_t sl[8];
        int32_t ids[8];
        for (int64_t r = 0, o = 1; r < slots; r++) {
            sl[r] = r == row0 ? 0 : o++;
            ids[r] = r == row0 ? next[step] : lcg_id(&s, V);
        }
        anneal_tensor *lg = anneal_model_decode_slots(m, kv, sl, ids, slots);
        const float *d = lg ? anneal_data(lg) : NULL;
        ok = d != NULL;
        if (ok) memcpy(out + (int64_t)step * V, d + row0 * V, sizeof(float) * (size_t)V);
    }
    anneal_scope_close(sc);
    anneal_kv_cache_free(kv);
    return ok;
}

TEST(bf16_decode_logits_do_not_depend_on_the_batch) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], 41 + (uint64_t)p);
        REQUIRE(m);
        REQUIRE(anneal_model_set_compute(m, ANNEAL_BF16) == ANNEAL_OK);
        const int V = m->cfg.vocab_size;
        uint64_t s = 7;
        int32_t prompt[PROMPT], next[STEPS];
        for (int t = 0; t < PROMPT; t++) prompt[t] = lcg_id(&s, V);
        for (int t = 0; t < STEPS; t++) next[t] = lcg_id(&s, V);
        float *alone = malloc(sizeof(float) * (size_t)(STEPS * V)), *shared = malloc(sizeof(float) * (size_t)(STEPS * V));
        REQUIRE(alone && shared);
        const int64_t before = anneal_decode_engine_steps();
        REQUIRE(run(m, 1, 0, prompt, next, alone));
        CHECK(anneal_decode_engine_steps() - before == STEPS, "%s: the decode engine did not run", presets[p]);
        const int64_t cases[][2] = {{3, 0}, {3, 2}, {8, 5}};
        for (int c = 0; c < 3; c++) {
            REQUIRE(run(m, cases[c][0], cases[c][1], prompt, next, shared));
            for (int step = 0; step < STEPS; step++)
                CHECK(memcmp(alone + step * V, shared + step * V, sizeof(float) * (size_t)V) == 0,
                      "%s: step %d, slot 0 as row %lld of %lld differs from slot 0 alone", presets[p], step,
                      (long long)cases[c][1], (long long)cases[c][0]);
        }
        free(alone), free(shared);
        anneal_model_free(m);
    }
}

TEST(int8_decode_logits_do_not_depend_on_the_batch) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], 43 + (uint64_t)p);
        REQUIRE(m);
        REQUIRE(anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_OK);
        REQUIRE(anneal_model_quantize_head(m) == ANNEAL_OK);
        const int V = m->cfg.vocab_size;
        uint64_t s = 9;
        int32_t prompt[PROMPT], next[STEPS];
        for (int t = 0; t < PROMPT; t++) prompt[t] = lcg_id(&s, V);
        for (int t = 0; t < STEPS; t++) next[t] = lcg_id(&s, V);
        float *alone = malloc(sizeof(float) * (size_t)(STEPS * V)), *shared = malloc(sizeof(float) * (size_t)(STEPS * V));
        REQUIRE(alone && shared);
        const int64_t before = anneal_decode_engine_steps(), copies = anneal_decode_engine_qpanel_copies();
        REQUIRE(run(m, 1, 0, prompt, next, alone));
        CHECK(anneal_decode_engine_steps() - before == STEPS, "%s: the decode engine did not run", presets[p]);
        CHECK(anneal_decode_engine_qpanel_copies() == copies, "%s: batch 1 made panel copies", presets[p]);
        const int64_t cases[][2] = {{3, 0}, {3, 2}, {8, 5}};
        for (int c = 0; c < 3; c++) {
            REQUIRE(run(m, cases[c][0], cases[c][1], prompt, next, shared));
            for (int step = 0; step < STEPS; step++)
                CHECK(memcmp(alone + step * V, shared + step * V, sizeof(float) * (size_t)V) == 0,
                      "%s int8: step %d, slot 0 as row %lld of %lld differs from slot 0 alone", presets[p], step,
                      (long long)cases[c][1], (long long)cases[c][0]);
        }
        if (anneal_gemv_qpanels_useful()) /* the blocks' matrices and the head: at least 5 copies a cache */
            CHECK(anneal_decode_engine_qpanel_copies() - copies >= 5 * 3, "%s: the panel kernel did not run (%lld copies)",
                  presets[p], (long long)(anneal_decode_engine_qpanel_copies() - copies));
        else
            fprintf(stderr, "    (int8 panel kernel not on this CPU's int8 path: the row kernels ran)\n");
        free(alone), free(shared);
        anneal_model_free(m);
    }
}

int main(void) {
    RUN(bf16_decode_logits_do_not_depend_on_the_batch);
    RUN(int8_decode_logits_do_not_depend_on_the_batch);
    return anneal_test_summary();
}
