/* Dense weights packed as bf16 panels for inference (anneal_params_pack_bf16, the
 * panels_linear op, the decode engine reading the panels):
 * - the engine's logits (prefill, decode steps of two slots) are bit for bit those of
 *   the unpacked model at bf16 compute, whose engine packs the same panels itself;
 * - the f32 weights' memory is given back: the allocator's live bytes drop by exactly
 *   the released f32 weights minus the panels;
 * - the tensor path (anneal_model_logits) runs on the panels, within the bf16 bound of
 *   the unpacked model's;
 * - panels_linear against a double reference over the bf16-rounded weights (the f32
 *   summation bound), equal to the engine's GEMV, and its bad inputs;
 * - what needs the float weights refuses a packed model with a clear error: backward,
 *   checkpoints, Hugging Face / GGUF / ONNX export, LoRA, int8 quantization.
 * GPT-2 ("tiny", biases) and llama-tiny (GQA, RoPE, q/k/v biases). */
#include "anneal/anneal.h"
#include "anneal/decode_kernels.h"
#include "models/decode_engine.h"
#include "slots_fixture.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { PROMPT = 9, STEPS = 3, MAXV = 512 };

/* Slot 0 gets a prompt of PROMPT ids, slot 1 one of 5, then STEPS decode steps of both
 * slots; every logits row, in order, into out ((2 + 2 * STEPS) x V). */
static void engine_run(anneal_model *m, float *out) {
    const int64_t V = m->cfg.vocab_size;
    uint64_t r = 71;
    int32_t a[PROMPT + STEPS], b[5 + STEPS];
    for (int i = 0; i < PROMPT + STEPS; i++) a[i] = lcg_id(&r, (int)V);
    for (int i = 0; i < 5 + STEPS; i++) b[i] = lcg_id(&r, (int)V);
    anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 2, 32);
    REQUIRE(kv);
    anneal_scope *sc = anneal_scope_open();
    anneal_no_grad_begin();
    const int64_t steps0 = anneal_decode_engine_steps(), prefills0 = anneal_decode_engine_prefills();
    anneal_tensor *l0 = anneal_model_prefill_slot(m, kv, 0, a, PROMPT);
    anneal_tensor *l1 = anneal_model_prefill_slot(m, kv, 1, b, 5);
    REQUIRE(l0 && l1);
    memcpy(out, anneal_data(l0), (size_t)V * sizeof(float));
    memcpy(out + V, anneal_data(l1), (size_t)V * sizeof(float));
    for (int k = 0; k < STEPS; k++) {
        const int64_t sl[2] = {0, 1};
        const int32_t ids[2] = {a[PROMPT + k], b[5 + k]};
        anneal_tensor *d = anneal_model_decode_slots(m, kv, sl, ids, 2);
        REQUIRE(d);
        memcpy(out + (2 + 2 * k) * V, anneal_data(d), (size_t)(2 * V) * sizeof(float));
    }
    CHECK(anneal_decode_engine_prefills() == prefills0 + 2 && anneal_decode_engine_steps() == steps0 + STEPS,
          "%s: the engine ran %lld prefills and %lld steps, not 2 and %d", m->cfg.arch,
          (long long)(anneal_decode_engine_prefills() - prefills0), (long long)(anneal_decode_engine_steps() - steps0),
          STEPS);
    anneal_no_grad_end();
    anneal_scope_close(sc);
    anneal_kv_cache_free(kv);
}

/* The bytes packing should give back: per packed layer its f32 weight, less its panels
 * and the one-float zero that stands in for the weight. Counted before packing. */
static int64_t expected_drop(const anneal_params *ps, int *layers) {
    int64_t drop = 0;
    *layers = 0;
    for (int i = 0; i < ps->n_dense; i++) {
        const anneal_nn_dense *d = ps->dense[i].dense;
        if (anneal_nn_quant_skips(ps->dense[i].prefix)) continue;
        drop += 4 * d->in * d->out - 2 * anneal_gemv_panels_bf16_len(d->in, d->out) - 4;
        (*layers)++;
    }
    return drop;
}

TEST(packed_engine_gives_the_unpacked_bits_in_less_memory) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 61 + (uint64_t)p);
        REQUIRE(m && m->cfg.vocab_size <= MAXV);
        const int64_t V = m->cfg.vocab_size, n = (2 + 2 * STEPS) * V;
        REQUIRE(anneal_model_set_compute(m, ANNEAL_BF16) == ANNEAL_OK);
        float *want = malloc((size_t)n * sizeof(float)), *got = malloc((size_t)n * sizeof(float));
        engine_run(m, want);
        anneal_model_free(m);

        m = make_model(presets[p], p == 1, 61 + (uint64_t)p);
        REQUIRE(m && anneal_model_set_compute(m, ANNEAL_BF16) == ANNEAL_OK);
        int layers;
        const int64_t drop = expected_drop(m->params, &layers);
        anneal_memory_release_cache(ANNEAL_CPU);
        const int64_t live0 = anneal_memory_stats_get(ANNEAL_CPU).live_bytes;
        REQUIRE(anneal_params_pack_bf16(m->params) == ANNEAL_OK);
        const int64_t live1 = anneal_memory_stats_get(ANNEAL_CPU).live_bytes;
        CHECK(m->params->packed_bf16, "%s: the set is not marked packed", presets[p]);
        CHECK(layers >= 4 * m->cfg.n_layer && live0 - live1 == drop,
              "%s: %d layers packed, live bytes %lld -> %lld: a drop of %lld, expected %lld", presets[p], layers,
              (long long)live0, (long long)live1, (long long)(live0 - live1), (long long)drop);
        CHECK(anneal_memory_stats_get(ANNEAL_CPU).cached_bytes == 0, "%s: the released weights stayed cached",
              presets[p]);
        REQUIRE(anneal_params_pack_bf16(m->params) == ANNEAL_OK); /* again: nothing to do */
        CHECK(anneal_memory_stats_get(ANNEAL_CPU).live_bytes == live1, "%s: packing twice changed the memory",
              presets[p]);
        engine_run(m, got);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++) bad += memcmp(&got[i], &want[i], sizeof(float)) != 0;
        CHECK(bad == 0, "%s: %lld of %lld logits differ from the unpacked model's engine", presets[p], (long long)bad,
              (long long)n);
        free(want);
        free(got);
        anneal_model_free(m);
    }
}

/* The tensor path (the full forward) of a packed model runs on the panels: within 3e-2
 * of the unpacked model's bf16 forward (the panels' products keep x in f32, the blocked
 * GEMM rounds it; the lm head is the same), and not exactly it. */
TEST(packed_tensor_path_within_bf16_of_the_unpacked) {
    anneal_clear_error();
    const char *presets[2] = {"tiny", "llama-tiny"};
    enum { T = 12 };
    for (int p = 0; p < 2; p++) {
        anneal_model *m = make_model(presets[p], p == 1, 67 + (uint64_t)p);
        REQUIRE(m && m->cfg.vocab_size <= MAXV);
        const int64_t V = m->cfg.vocab_size;
        REQUIRE(anneal_model_set_compute(m, ANNEAL_BF16) == ANNEAL_OK);
        uint64_t r = 5;
        int32_t ids[T];
        for (int i = 0; i < T; i++) ids[i] = lcg_id(&r, (int)V);
        static float want[T * MAXV], got[T * MAXV];
        REQUIRE(full_logits(m, ids, T, want));
        REQUIRE(anneal_params_pack_bf16(m->params) == ANNEAL_OK);
        REQUIRE(full_logits(m, ids, T, got));
        const double e = rel_err(got, want, T * V);
        CHECK(e <= 3e-2 && e > 0, "%s: packed forward rel err %g (want (0, 3e-2])", presets[p], e);
        anneal_model_free(m);
    }
}

/* panels_linear over both source layouts: within the f32 summation bound of the double
 * product over the bf16-rounded weights, bit for bit the GEMV the engine runs, bias
 * added; leading dims folded (x (2, 3, K)). */
TEST(panels_linear_against_reference) {
    anneal_clear_error();
    enum { K = 37, N = 50, M = 6 };
    uint64_t r = 99;
    float w[K * N], x[M * K], b[N];
    for (int i = 0; i < K * N; i++) w[i] = (float)((int)lcg_id(&r, 2001) - 1000) / 997.0f;
    for (int i = 0; i < M * K; i++) x[i] = (float)((int)lcg_id(&r, 2001) - 1000) / 613.0f;
    for (int i = 0; i < N; i++) b[i] = (float)((int)lcg_id(&r, 201) - 100) / 50.0f;
    for (int out_in = 0; out_in < 2; out_in++) {
        const int64_t len = anneal_gemv_panels_bf16_len(K, N);
        uint16_t *pk = malloc((size_t)len * 2);
        anneal_gemv_pack_panels_bf16(w, out_in, K, N, pk); /* w read as (N, K) or (K, N) */
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *tp = anneal_from_data(ANNEAL_BF16, 1, &len, pk);
        anneal_tensor *tx = anneal_from_data(ANNEAL_F32, 3, (int64_t[]){2, 3, K}, x);
        anneal_tensor *tb = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){N}, b);
        anneal_tensor *y = anneal_panels_linear(tx, tp, tb, K, N);
        REQUIRE(y && y->ndim == 3 && y->shape[2] == N);
        const float *Y = anneal_data(y);
        static float g[M * N];
        anneal_gemv_weight gw = {.w = pk, .dtype = ANNEAL_BF16, .in = K, .out = N, .bias = b, .bf16_panels = true};
        REQUIRE(anneal_gemv(&gw, x, K, M, g, N, ANNEAL_GEMV_NONE));
        int64_t bad = 0, diff = 0;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double s = b[j], sa = fabs(b[j]);
                for (int k = 0; k < K; k++) {
                    float wv = out_in ? w[j * K + k] : w[k * N + j];
                    uint32_t u;
                    memcpy(&u, &wv, 4);
                    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; /* bf16, nearest even */
                    memcpy(&wv, &u, 4);
                    s += (double)x[i * K + k] * wv;
                    sa += fabs((double)x[i * K + k] * wv);
                }
                bad += !(fabs(Y[i * N + j] - s) <= (K + 2) * 0x1p-24 * sa + 1e-30);
                diff += memcmp(&Y[i * N + j], &g[i * N + j], 4) != 0;
            }
        CHECK(bad == 0, "layout %s: %lld outputs outside the bound", out_in ? "(out, in)" : "(in, out)", (long long)bad);
        CHECK(diff == 0, "layout %s: %lld outputs differ from the engine's GEMV", out_in ? "(out, in)" : "(in, out)",
              (long long)diff);
        /* bad inputs */
        anneal_tensor *short_p = anneal_from_data(ANNEAL_BF16, 1, (int64_t[]){len - 1}, pk);
        CHECK(!anneal_panels_linear(tx, short_p, tb, K, N) && anneal_last_status() == ANNEAL_ERR_SHAPE,
              "panels of the wrong length: %s", anneal_last_error());
        anneal_clear_error();
        CHECK(!anneal_panels_linear(tx, tp, tb, K + 1, N) && anneal_last_status() == ANNEAL_ERR_SHAPE,
              "x of the wrong width: %s", anneal_last_error());
        anneal_clear_error();
        anneal_tensor *bad_b = anneal_from_data(ANNEAL_F32, 1, (int64_t[]){N - 1}, b);
        CHECK(!anneal_panels_linear(tx, tp, bad_b, K, N) && anneal_last_status() == ANNEAL_ERR_SHAPE,
              "a bias of the wrong length: %s", anneal_last_error());
        anneal_clear_error();
        REQUIRE(anneal_set_requires_grad(tx, true) == ANNEAL_OK);
        CHECK(!anneal_panels_linear(tx, tp, tb, K, N) && anneal_last_status() == ANNEAL_ERR_UNSUPPORTED &&
                  strstr(anneal_last_error(), "no backward"),
              "an x that wants a gradient: %s", anneal_last_error());
        anneal_clear_error();
        anneal_scope_close(sc);
        free(pk);
    }
}

/* What needs the float weights refuses a packed model, naming the packing; nothing is
 * written. */
TEST(packed_model_refuses_what_needs_float_weights) {
    anneal_clear_error();
    anneal_model *m = make_model("tiny", false, 73);
    REQUIRE(m && anneal_model_set_compute(m, ANNEAL_BF16) == ANNEAL_OK);
    REQUIRE(anneal_params_pack_bf16(m->params) == ANNEAL_OK);
    char dir[] = "/tmp/anneal_packed_XXXXXX";
    REQUIRE(mkdtemp(dir));
    char path[256];
    /* training: the loss's backward */
    anneal_model_set_training(m, true);
    anneal_scope *sc = anneal_scope_open();
    int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    anneal_tensor *x = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, 8}, ids);
    anneal_tensor *loss = anneal_model_loss(m, x, x);
    CHECK(!loss && strstr(anneal_last_error(), "no backward"), "training a packed model: %s",
          loss ? "a loss" : anneal_last_error());
    anneal_scope_close(sc);
    anneal_clear_error();
    anneal_model_set_training(m, false);
    /* checkpoints and exports */
    anneal_train_state st = {0};
    snprintf(path, sizeof path, "%s/run", dir);
    CHECK(anneal_checkpoint_save(path, m, NULL, &st, NULL, 1) == ANNEAL_ERR_UNSUPPORTED &&
              strstr(anneal_last_error(), "packed as bf16"),
          "checkpoint: %s", anneal_last_error());
    anneal_clear_error();
    snprintf(path, sizeof path, "%s/hf", dir);
    CHECK(anneal_model_save_hf(m, path, NULL) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "packed as bf16"),
          "hf export: %s", anneal_last_error());
    anneal_clear_error();
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    CHECK(anneal_model_save_gguf(m, path, NULL) == ANNEAL_ERR_UNSUPPORTED &&
              strstr(anneal_last_error(), "packed as bf16"),
          "gguf export: %s", anneal_last_error());
    anneal_clear_error();
    snprintf(path, sizeof path, "%s/m.onnx", dir);
    CHECK(anneal_model_save_onnx(m, path, NULL) == ANNEAL_ERR_UNSUPPORTED &&
              strstr(anneal_last_error(), "packed as bf16"),
          "onnx export: %s", anneal_last_error());
    anneal_clear_error();
    /* adapters and int8 */
    static const char *const targets[1] = {"c_attn"};
    anneal_lora_config lc = {.rank = 4, .alpha = 8, .n_targets = 1, .targets = targets};
    CHECK(anneal_lora_apply(m->params, &lc) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "packed as bf16"),
          "lora: %s", anneal_last_error());
    anneal_clear_error();
    CHECK(anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_ERR_UNSUPPORTED &&
              strstr(anneal_last_error(), "packed as bf16"),
          "quantize: %s", anneal_last_error());
    anneal_clear_error();
    /* nothing was written */
    char cmd[300];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A %s)\"", dir);
    CHECK(system(cmd) == 0, "files were written into %s", dir);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    (void)!system(cmd);
    anneal_model_free(m);
}

int main(void) {
    RUN(packed_engine_gives_the_unpacked_bits_in_less_memory);
    RUN(packed_tensor_path_within_bf16_of_the_unpacked);
    RUN(panels_linear_against_reference);
    RUN(packed_model_refuses_what_needs_float_weights);
    return anneal_test_summary();
}
