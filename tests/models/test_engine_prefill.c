/* The decode engine's prefill (anneal_decode_engine_prefill): a prompt appended to one
 * slot in chunks (here 4 rows: ANNEAL_PREFILL_ROWS=1 plus one per slot; a prompt of 9 runs as 4 + 4 + 1
 * and a continuation of 6 as 4 + 2), each chunk attending causally within itself and to
 * the slot's earlier positions. Checked against the full forward of each sequence alone:
 * the last prompt row's logits, a continuation prefilled into a slot that already holds
 * positions, and decode steps after it; next to another slot that holds a different
 * sequence (the chunk must not read or write it). GPT-2 and llama-tiny (GQA, RoPE at
 * the slot's own positions, q/k/v biases); f32, bf16 and int8 caches; bf16 compute and
 * int8 models. anneal_model_prefill_slot takes the engine under bf16 compute only. */
#include "anneal/anneal.h"
#include "models/decode_engine.h"
#include "slots_fixture.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { T = 24, PROMPT = 9, MORE = 6 };

/* Slot 0 holds sequence A (prefilled by the tensor path, 5 ids); slot 2 gets sequence B
 * through the engine: PROMPT ids, then MORE ids appended, then 3 decode steps of both
 * slots. Every checked row within tol of the full forward (relative to the logits'
 * largest magnitude); the worst error into *worst. */
static void run(anneal_model *m, anneal_dtype kv_dtype, double tol, double *worst) {
    const int64_t V = m->cfg.vocab_size;
    static int32_t seq[2][T];
    static float full[2][T * 512];
    REQUIRE(V <= 512);
    uint64_t r = 29;
    for (int s = 0; s < 2; s++) {
        for (int t = 0; t < T; t++) seq[s][t] = lcg_id(&r, (int)V);
        REQUIRE(full_logits(m, seq[s], T, full[s]));
    }
    REQUIRE(anneal_model_set_kv_dtype(m, kv_dtype) == ANNEAL_OK);
    anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 3, 32);
    REQUIRE(kv);
    anneal_model_set_kv_dtype(m, ANNEAL_F32);
    anneal_scope *sc = anneal_scope_open();
    double w = 0, e;
    int64_t prefills0 = anneal_decode_engine_prefills();
    /* slot 0 through the tensor path (f32 compute) or whatever the policy takes */
    anneal_tensor *lg = anneal_model_prefill_slot(m, kv, 0, seq[0], 5);
    REQUIRE(lg);
    static float out[512];
    REQUIRE(anneal_decode_engine_prefill(m, kv, 2, seq[1], PROMPT, out) == ANNEAL_OK);
    CHECK(anneal_kv_cache_slot_len(kv, 2) == PROMPT && anneal_kv_cache_slot_len(kv, 0) == 5 &&
              anneal_kv_cache_slot_len(kv, 1) == 0,
          "slot lengths after the prefill: %lld %lld %lld", (long long)anneal_kv_cache_slot_len(kv, 0),
          (long long)anneal_kv_cache_slot_len(kv, 1), (long long)anneal_kv_cache_slot_len(kv, 2));
    e = rel_err(out, full[1] + (PROMPT - 1) * V, V);
    w = fmax(w, e);
    CHECK(e <= tol, "prompt of %d: rel err %g > %g", PROMPT, e, tol);
    REQUIRE(anneal_decode_engine_prefill(m, kv, 2, seq[1] + PROMPT, MORE, out) == ANNEAL_OK);
    CHECK(anneal_kv_cache_slot_len(kv, 2) == PROMPT + MORE, "slot 2 length %lld after the continuation",
          (long long)anneal_kv_cache_slot_len(kv, 2));
    e = rel_err(out, full[1] + (PROMPT + MORE - 1) * V, V);
    w = fmax(w, e);
    CHECK(e <= tol, "continuation: rel err %g > %g", e, tol);
    CHECK(anneal_decode_engine_prefills() == prefills0 + 2 + (m->ctx.compute == ANNEAL_BF16),
          "engine prefills %lld", (long long)(anneal_decode_engine_prefills() - prefills0));
    int pos[2] = {5, PROMPT + MORE};
    for (int k = 0; k < 3; k++) {
        const int64_t sl[2] = {2, 0};
        const int32_t ids[2] = {seq[1][pos[1]], seq[0][pos[0]]};
        anneal_tensor *d = anneal_model_decode_slots(m, kv, sl, ids, 2);
        REQUIRE(d);
        const float *L = anneal_data(d);
        e = fmax(rel_err(L, full[1] + pos[1] * V, V), rel_err(L + V, full[0] + pos[0] * V, V));
        w = fmax(w, e);
        CHECK(e <= tol, "decode step %d after the prefill: rel err %g > %g", k, e, tol);
        pos[0]++, pos[1]++;
    }
    if (getenv("ANNEAL_TEST_VERBOSE"))
        printf("%s compute %s kv %s: worst rel err %.3g\n", m->cfg.arch, anneal_dtype_name(m->ctx.compute),
               anneal_dtype_name(kv_dtype), w);
    if (worst) *worst = w;
    anneal_scope_close(sc);
    anneal_kv_cache_free(kv);
}

/* f32 compute, f32 cache: the engine's GEMV and the chunk's flash attention sum in
 * other orders than the full forward: within 2e-5 (rounding only). */
TEST(f32_prefill_in_chunks_equals_the_full_forward) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 41 + (uint64_t)p);
        REQUIRE(m);
        run(m, ANNEAL_F32, 2e-5, NULL);
        anneal_model_free(m);
    }
}

/* bf16 and int8 caches: the chunk reads its own keys and values back from the cache in
 * the stored dtype (as decode steps do): within 2% (bf16) and 4% (int8), and not exact. */
TEST(bf16_and_int8_caches_within_bound) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 43 + (uint64_t)p);
        REQUIRE(m);
        double wb = 0, wi = 0;
        run(m, ANNEAL_BF16, 2e-2, &wb);
        run(m, ANNEAL_I8, 4e-2, &wi);
        CHECK(wb > 0 && wi > 0, "%s: a quantized cache should not be exact (bf16 %g, int8 %g)", presets[p], wb, wi);
        anneal_model_free(m);
    }
}

/* bf16 compute (bf16 weight copies, f32 activations, against the full forward's bf16
 * operands): within 3e-2, as the decode steps; anneal_model_prefill_slot takes the
 * engine (run() counts it). int8 models: the same quantized product as the tensor
 * path, within 2e-5. */
TEST(bf16_compute_and_int8_models) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 47 + (uint64_t)p);
        REQUIRE(m);
        REQUIRE(anneal_model_set_compute(m, ANNEAL_BF16) == ANNEAL_OK);
        double w = 0;
        run(m, ANNEAL_F32, 3e-2, &w);
        CHECK(w > 0, "bf16 weights should not be exact");
        anneal_model_free(m);
        m = make_model(presets[p], p == 1, 53 + (uint64_t)p);
        REQUIRE(m);
        REQUIRE(anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_OK);
        run(m, ANNEAL_F32, 2e-5, NULL);
        anneal_model_free(m);
    }
}

/* anneal_model_extend_slots: running rows and new prompts in one call. With chunks of
 * 4 rows, a call of 1 + 3 rows is one engine pass; a call of 1 + 1 + 6 rows does not fit
 * and takes the one-by-one path. Both give every entry's last logits as the full
 * forward (f32, within 2e-5), for GPT-2 and llama-tiny; bad calls leave the cache as it
 * was. */
TEST(extend_slots_mixes_prompts_and_steps) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 59 + (uint64_t)p);
        REQUIRE(m);
        const int64_t V = m->cfg.vocab_size;
        static int32_t seq[3][T];
        static float full[3][T * 512];
        REQUIRE(V <= 512);
        uint64_t r = 31;
        for (int s = 0; s < 3; s++) {
            for (int t = 0; t < T; t++) seq[s][t] = lcg_id(&r, (int)V);
            REQUIRE(full_logits(m, seq[s], T, full[s]));
        }
        anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 3, 32);
        REQUIRE(kv);
        anneal_scope *sc = anneal_scope_open();
        REQUIRE(anneal_model_prefill_slot(m, kv, 0, seq[0], 5));
        /* slot 0 steps (1 id) while slot 2 takes a prompt of 3: 4 rows, one pass */
        int64_t ext0 = anneal_decode_engine_extends();
        int32_t ids1[4] = {seq[0][5], seq[2][0], seq[2][1], seq[2][2]};
        anneal_tensor *lg = anneal_model_extend_slots(m, kv, (int64_t[]){0, 2}, ids1, (int64_t[]){1, 3}, 2);
        REQUIRE(lg);
        CHECK(lg->shape[0] == 2 && lg->shape[1] == V, "logits shape");
        CHECK(anneal_decode_engine_extends() == ext0 + 1, "4 rows should be one engine pass");
        double e0 = rel_err(anneal_data(lg), full[0] + 5 * V, V);
        double e2 = rel_err((const float *)anneal_data(lg) + V, full[2] + 2 * V, V);
        CHECK(e0 <= 2e-5 && e2 <= 2e-5, "%s one pass: rel err %g (step) %g (prompt)", presets[p], e0, e2);
        /* bad calls: nothing changes */
        int32_t bad[3] = {seq[0][6], seq[1][0], seq[1][1]};
        CHECK(!anneal_model_extend_slots(m, kv, (int64_t[]){0, 0}, bad, (int64_t[]){1, 1}, 2), "a slot twice");
        CHECK(!anneal_model_extend_slots(m, kv, (int64_t[]){0, 1}, bad, (int64_t[]){1, 0}, 2), "a count of 0");
        CHECK(!anneal_model_extend_slots(m, kv, (int64_t[]){1}, bad, (int64_t[]){33}, 1), "past max_len (32)");
        bad[2] = (int32_t)V;
        CHECK(!anneal_model_extend_slots(m, kv, (int64_t[]){0, 1}, bad, (int64_t[]){1, 2}, 2), "an id past the vocabulary");
        CHECK(anneal_last_status() == ANNEAL_ERR_ARG, "bad calls are ANNEAL_ERR_ARG");
        anneal_clear_error();
        CHECK(anneal_kv_cache_slot_len(kv, 0) == 6 && anneal_kv_cache_slot_len(kv, 1) == 0 &&
                  anneal_kv_cache_slot_len(kv, 2) == 3,
              "bad calls changed the cache");
        /* 1 + 1 + 6 rows: more than a chunk, one by one */
        int32_t ids2[8] = {seq[2][3], seq[0][6], seq[1][0], seq[1][1], seq[1][2], seq[1][3], seq[1][4], seq[1][5]};
        ext0 = anneal_decode_engine_extends();
        lg = anneal_model_extend_slots(m, kv, (int64_t[]){2, 0, 1}, ids2, (int64_t[]){1, 1, 6}, 3);
        REQUIRE(lg);
        CHECK(anneal_decode_engine_extends() == ext0, "8 rows do not fit a chunk of 4");
        const float *L = anneal_data(lg);
        double e = fmax(fmax(rel_err(L, full[2] + 3 * V, V), rel_err(L + V, full[0] + 6 * V, V)),
                        rel_err(L + 2 * V, full[1] + 5 * V, V));
        CHECK(e <= 2e-5, "%s one by one: rel err %g", presets[p], e);
        CHECK(anneal_kv_cache_slot_len(kv, 0) == 7 && anneal_kv_cache_slot_len(kv, 1) == 6 &&
                  anneal_kv_cache_slot_len(kv, 2) == 4,
              "lengths after the second call");
        anneal_scope_close(sc);
        anneal_kv_cache_free(kv);
        anneal_model_free(m);
    }
}

int main(void) {
    /* chunks of 1 + 3 = 4 rows (ANNEAL_PREFILL_ROWS plus one per slot of the 3-slot caches),
     * read when a cache's engine is made */
    setenv("ANNEAL_PREFILL_ROWS", "1", 1);
    RUN(f32_prefill_in_chunks_equals_the_full_forward);
    RUN(bf16_and_int8_caches_within_bound);
    RUN(bf16_compute_and_int8_models);
    RUN(extend_slots_mixes_prompts_and_steps);
    return anneal_test_summary();
}
