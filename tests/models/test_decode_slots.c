/* The slots API (continuous batching): prefill and decode steps over ragged slots equal
 * the full forward of each sequence alone (GPT-2, and llama-tiny with GQA, RoPE at each
 * slot's own positions and q/k/v biases), slots are reused after a reset, bf16 and int8
 * KV caches stay within a stated bound of the f32 one, bad arguments are refused with
 * the cache unchanged. */
#include "anneal/anneal.h"
#include "models/decode_engine.h"
#include "slots_fixture.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { S = 3, TMAX = 24 };

/* Runs a ragged schedule over S slots: prefill slot s with pre[s] ids, then decode
 * steps over changing subsets, checking every row against the sequences' full logits
 * (f32 cache: within tol relative to the logits' scale) or recording the worst relative
 * error in *worst. Slot 1 is reset and reused half-way with a new sequence. */
static void run_schedule_ex(anneal_model *m, anneal_dtype kv_dtype, double tol, double *worst, bool engine) {
    int64_t V = m->cfg.vocab_size;
    static int32_t seq[S + 1][TMAX];
    static float full[S + 1][TMAX * 512];
    REQUIRE(V <= 512);
    uint64_t r = 17;
    for (int s = 0; s <= S; s++) {
        for (int t = 0; t < TMAX; t++) seq[s][t] = lcg_id(&r, (int)V);
        REQUIRE(full_logits(m, seq[s], TMAX, full[s]));
    }
    REQUIRE(anneal_model_set_kv_dtype(m, kv_dtype) == ANNEAL_OK);
    anneal_kv_cache *kv = anneal_model_kv_cache_new(m, S, 32);
    REQUIRE(kv);
    anneal_model_set_kv_dtype(m, ANNEAL_F32);
    anneal_scope *sc = anneal_scope_open();
    const int pre[S] = {5, 1, 9};
    int which[S] = {0, 1, 2}; /* the sequence each slot holds */
    int pos[S];
    double w = 0;
    for (int s = 0; s < S; s++) {
        anneal_tensor *lg = anneal_model_prefill_slot(m, kv, s, seq[s], pre[s]);
        REQUIRE(lg);
        CHECK(lg->ndim == 2 && lg->shape[0] == 1 && lg->shape[1] == V, "prefill logits shape");
        double e = rel_err(anneal_data(lg), full[s] + (pre[s] - 1) * V, V);
        w = fmax(w, e);
        CHECK(e <= tol, "prefill slot %d: rel err %g > %g", s, e, tol);
        pos[s] = pre[s];
        CHECK(anneal_kv_cache_slot_len(kv, s) == pre[s], "slot %d len", s);
    }
    /* subsets of the slots, in varying order */
    const int64_t steps[][S + 1] = {{3, 0, 1, 2}, {2, 2, 0}, {1, 1}, {3, 2, 1, 0}, {2, 1, 2}, {3, 1, 0, 2},
                                    {1, 0},       {3, 0, 2, 1}, {2, 0, 1}};
    int nsteps = (int)(sizeof steps / sizeof steps[0]);
    int64_t engine0 = anneal_decode_engine_steps();
    for (int k = 0; k < nsteps; k++) {
        if (k == 5) { /* reuse slot 1 for another sequence */
            anneal_kv_cache_slot_reset(kv, 1);
            CHECK(anneal_kv_cache_slot_len(kv, 1) == 0, "reset slot");
            which[1] = S;
            anneal_tensor *lg = anneal_model_prefill_slot(m, kv, 1, seq[S], 4);
            REQUIRE(lg);
            double e = rel_err(anneal_data(lg), full[S] + 3 * V, V);
            w = fmax(w, e);
            CHECK(e <= tol, "prefill of a reused slot: rel err %g", e);
            pos[1] = 4;
        }
        int64_t n = steps[k][0];
        const int64_t *sl = &steps[k][1];
        int32_t ids[S];
        for (int i = 0; i < n; i++) ids[i] = seq[which[sl[i]]][pos[sl[i]]];
        anneal_tensor *lg = anneal_model_decode_slots(m, kv, sl, ids, n);
        REQUIRE(lg);
        CHECK(lg->ndim == 2 && lg->shape[0] == n && lg->shape[1] == V, "decode logits shape");
        const float *L = anneal_data(lg);
        for (int i = 0; i < n; i++) {
            int s = (int)sl[i];
            double e = rel_err(L + i * V, full[which[s]] + pos[s] * V, V);
            w = fmax(w, e);
            CHECK(e <= tol, "step %d row %d (slot %d pos %d): rel err %g > %g", k, i, s, pos[s], e, tol);
            pos[s]++;
            CHECK(anneal_kv_cache_slot_len(kv, s) == pos[s], "slot %d len %lld", s,
                  (long long)anneal_kv_cache_slot_len(kv, s));
        }
    }
    CHECK(anneal_decode_engine_steps() == engine0 + (engine ? nsteps : 0), "the decode engine ran %lld of %d steps",
          (long long)(anneal_decode_engine_steps() - engine0), nsteps);
    if (worst) *worst = w;
    if (getenv("ANNEAL_TEST_VERBOSE"))
        printf("%s kv %s: worst rel err %.3g\n", m->cfg.arch, anneal_dtype_name(kv_dtype), w);
    anneal_scope_close(sc);
    anneal_kv_cache_free(kv);
}

static void run_schedule(anneal_model *m, anneal_dtype kv_dtype, double tol, double *worst) {
    run_schedule_ex(m, kv_dtype, tol, worst, true);
}

/* f32: every row within 2e-5 of the full forward relative to the logits' largest
 * magnitude (the engine's GEMV sums in another order than the GEMM: rounding only). */
TEST(gpt2_ragged_slots_equal_full_forward) {
    anneal_clear_error();
    anneal_model *m = make_model("tiny", false, 3);
    REQUIRE(m);
    run_schedule(m, ANNEAL_F32, 2e-5, NULL);
    anneal_model_free(m);
}

TEST(llama_gqa_rope_bias_ragged_slots_equal_full_forward) {
    anneal_clear_error();
    anneal_model *m = make_model("llama-tiny", true, 5);
    REQUIRE(m);
    CHECK(m->cfg.n_kv_head == 2 && m->cfg.n_head == 4, "GQA preset");
    run_schedule(m, ANNEAL_F32, 2e-5, NULL);
    anneal_model_free(m);
}

/* bf16 and int8 caches: within 2% (bf16) and 4% (int8) of the logits' scale of the
 * full f32 forward over the whole schedule. */
TEST(bf16_and_int8_kv_within_bound) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 9);
        REQUIRE(m);
        double wb = 0, wi = 0;
        run_schedule(m, ANNEAL_BF16, 2e-2, &wb);
        run_schedule(m, ANNEAL_I8, 4e-2, &wi);
        CHECK(wb > 0 && wi > 0, "%s: a quantized cache should not be exact (bf16 %g, int8 %g)", presets[p], wb, wi);
        anneal_model_free(m);
    }
}

/* bf16 compute: the engine reads bf16 copies of the weights (activations f32), the full
 * forward rounds both GEMM operands to bf16: within 3e-2 of the logits' scale. f16
 * compute is not the engine's: each slot takes the cached tensor forward, whose f16
 * operand rounding (2^-11) meets the full forward's in other blockings: within 1e-3
 * (measured 1.3e-4). */
TEST(bf16_compute_runs_the_engine_f16_takes_the_tensor_path) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 11);
        REQUIRE(m);
        double w = 0;
        REQUIRE(anneal_model_set_compute(m, ANNEAL_BF16) == ANNEAL_OK);
        run_schedule_ex(m, ANNEAL_F32, 3e-2, &w, true);
        CHECK(w > 0, "bf16 weights should not be exact");
        REQUIRE(anneal_model_set_compute(m, ANNEAL_F16) == ANNEAL_OK);
        run_schedule_ex(m, ANNEAL_F32, 1e-3, NULL, false);
        anneal_model_free(m);
    }
}

/* int8 models (weight-only per channel and per group of 16, dynamic) run the decode
 * engine (the same quantized product as the tensor path) and match the full forward of
 * the same quantized model within 2e-5 of the logits' scale (the GEMV lm head, the
 * attention and the norms sum in other orders; the int8 products are the same kernel). */
TEST(int8_models_run_the_engine) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    const anneal_quant_mode modes[3] = {ANNEAL_QUANT_WEIGHT_ONLY, ANNEAL_QUANT_WEIGHT_ONLY, ANNEAL_QUANT_DYNAMIC};
    const int64_t groups[3] = {0, 16, 0};
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 3; q++) {
            anneal_model *m = make_model(presets[p], p == 1, 21 + (uint64_t)q);
            REQUIRE(m);
            REQUIRE(anneal_nn_quantize(m->params, modes[q], groups[q]) == ANNEAL_OK);
            double w = 0;
            run_schedule_ex(m, ANNEAL_F32, 2e-5, &w, true);
            if (getenv("ANNEAL_TEST_VERBOSE"))
                printf("%s int8 %s group %lld: worst rel err %.3g\n", presets[p], anneal_quant_mode_name(modes[q]),
                       (long long)groups[q], w);
            anneal_model_free(m);
        }
}

TEST(bad_arguments_leave_the_cache_unchanged) {
    anneal_clear_error();
    anneal_model *m = make_model("tiny", false, 1), *other = make_model("tiny", false, 2);
    REQUIRE(m && other);
    anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 2, 4);
    REQUIRE(kv);
    anneal_scope *sc = anneal_scope_open();
    const int32_t ids[4] = {1, 2, 3, 4};
    REQUIRE(anneal_model_prefill_slot(m, kv, 0, ids, 3));
    struct {
        const char *what;
        anneal_tensor *got;
    } cases[] = {
        {"slot out of range", anneal_model_decode_slots(m, kv, (int64_t[]){2}, ids, 1)},
        {"negative slot", anneal_model_decode_slots(m, kv, (int64_t[]){-1}, ids, 1)},
        {"repeated slot", anneal_model_decode_slots(m, kv, (int64_t[]){0, 0}, ids, 2)},
        {"n = 0", anneal_model_decode_slots(m, kv, (int64_t[]){0}, ids, 0)},
        {"n > slots", anneal_model_decode_slots(m, kv, (int64_t[]){0, 1, 0}, ids, 3)},
        {"NULL ids", anneal_model_decode_slots(m, kv, (int64_t[]){0}, NULL, 1)},
        {"id out of vocab", anneal_model_decode_slots(m, kv, (int64_t[]){0, 1}, (int32_t[]){1, 512}, 2)},
        {"another model's cache", anneal_model_decode_slots(other, kv, (int64_t[]){0}, ids, 1)},
        {"prefill past max_len", anneal_model_prefill_slot(m, kv, 1, ids, 5)},
        {"prefill slot out of range", anneal_model_prefill_slot(m, kv, 2, ids, 1)},
        {"prefill n = 0", anneal_model_prefill_slot(m, kv, 1, ids, 0)},
        {"prefill bad id", anneal_model_prefill_slot(m, kv, 1, (int32_t[]){-3}, 1)},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK(!cases[i].got, "%s accepted", cases[i].what);
        CHECK(anneal_kv_cache_slot_len(kv, 0) == 3 && anneal_kv_cache_slot_len(kv, 1) == 0, "%s changed the cache",
              cases[i].what);
    }
    anneal_clear_error();
    /* a full slot: slot 0 reaches max_len 4, then one more is refused with both unchanged */
    REQUIRE(anneal_model_decode_slots(m, kv, (int64_t[]){0}, ids, 1));
    CHECK(!anneal_model_decode_slots(m, kv, (int64_t[]){1, 0}, ids, 2) && anneal_last_status() == ANNEAL_ERR_ARG,
          "full slot accepted");
    CHECK(anneal_kv_cache_slot_len(kv, 0) == 4 && anneal_kv_cache_slot_len(kv, 1) == 0, "full slot changed the cache");
    /* ragged slots: the whole-batch path refuses */
    anneal_clear_error();
    CHECK(!anneal_model_forward_cached(m, kv, anneal_zeros(ANNEAL_I32, 2, (int64_t[]){2, 1})) &&
              anneal_last_status() == ANNEAL_ERR_ARG, "ragged whole-batch forward accepted");
    anneal_clear_error();
    CHECK(anneal_model_set_kv_dtype(m, ANNEAL_F16) == ANNEAL_ERR_ARG, "f16 kv dtype accepted");
    anneal_clear_error();
    anneal_scope_close(sc);
    anneal_kv_cache_free(kv);
    anneal_model_free(m);
    anneal_model_free(other);
}

/* The cache reports its bytes by dtype: int8 holds a quarter of f32 plus the scales. */
TEST(cache_bytes_by_dtype) {
    anneal_clear_error();
    anneal_model *m = make_model("tiny", false, 1);
    REQUIRE(m);
    int64_t b[3];
    const anneal_dtype dts[3] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_I8};
    for (int i = 0; i < 3; i++) {
        REQUIRE(anneal_model_set_kv_dtype(m, dts[i]) == ANNEAL_OK);
        anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 2, 16);
        REQUIRE(kv);
        CHECK(anneal_kv_cache_dtype(kv) == dts[i], "dtype");
        b[i] = anneal_kv_cache_bytes(kv);
        anneal_kv_cache_free(kv);
    }
    /* tiny: 2 layers, 4 heads of 16, 2 slots x 16 positions, keys and values */
    int64_t elems = 2 * 2 * 2 * 4 * 16 * 16;
    CHECK(b[0] == elems * 4 && b[1] == elems * 2 && b[2] == elems + 2 * 2 * 2 * 4 * 16 * 4, "bytes %lld %lld %lld",
          (long long)b[0], (long long)b[1], (long long)b[2]);
    anneal_model_free(m);
}

int main(void) {
    RUN(gpt2_ragged_slots_equal_full_forward);
    RUN(llama_gqa_rope_bias_ragged_slots_equal_full_forward);
    RUN(bf16_and_int8_kv_within_bound);
    RUN(bf16_compute_runs_the_engine_f16_takes_the_tensor_path);
    RUN(int8_models_run_the_engine);
    RUN(bad_arguments_leave_the_cache_unchanged);
    RUN(cache_bytes_by_dtype);
    return anneal_test_summary();
}
