/* Generation speed for a model preset (default GPT-2 124M, random weights): prefill of a
 * P-token prompt, then N tokens one at a time with the KV cache, against the same N
 * tokens by recomputing the whole sequence each time (no cache); and the sampler's
 * cost per token over GPT-2's 50257 logits (flat ones from random weights, the worst
 * case for top-p alone, and peaked ones).
 * Build and run (from the repository root, after make build):
 *   cmake --build build --target bench_generate && build/bench_generate [preset] [P] [N] [threads] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "anneal/anneal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "bench_generate: %s: %s\n", what, anneal_last_error());
    exit(1);
}

int main(int argc, char **argv) {
    const char *preset = argc > 1 ? argv[1] : "124M";
    int P = argc > 2 ? atoi(argv[2]) : 16, N = argc > 3 ? atoi(argv[3]) : 32;
    int threads = argc > 4 ? atoi(argv[4]) : 2;
    anneal_set_num_threads(threads);
    anneal_model_config cfg;
    if (!anneal_model_preset(preset, &cfg)) die("unknown preset");
    if (P + N > cfg.n_ctx) die("P + N exceeds n_ctx");
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (!m || anneal_model_init(m, 1) != ANNEAL_OK) die("model");
    int V = cfg.vocab_size;
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)(P + N));
    float *row = malloc(sizeof(float) * (size_t)V);
    for (int i = 0; i < P; i++) seq[i] = (i * 7919) % V;
    anneal_sampler_config sc = {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f, .seed = 1};
    anneal_no_grad_begin();

    /* cached: prefill, then one token per step */
    anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 1, P + N);
    if (!kv) die("cache");
    double t0 = now_s(), t_prefill = 0;
    for (int i = 0; i <= N - 1; i++) {
        int n_in = i == 0 ? P : 1;
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *lg = anneal_model_forward_cached(
            m, kv, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, n_in}, seq + (i == 0 ? 0 : P + i - 1)));
        if (!lg || anneal_to_f32_buffer(anneal_narrow(lg, 1, n_in - 1, 1), row) != ANNEAL_OK) die("cached");
        anneal_scope_close(s);
        seq[P + i] = anneal_sample_logits(row, V, &sc, (uint64_t)(P + i));
        if (i == 0) t_prefill = now_s() - t0;
    }
    double t_cached = now_s() - t0 - t_prefill;
    anneal_kv_cache_free(kv);

    /* uncached: the whole sequence again for every token */
    t0 = now_s();
    for (int i = 1; i < N; i++) {
        int n_in = P + i;
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *lg = anneal_model_logits(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, n_in}, seq));
        if (!lg || anneal_to_f32_buffer(anneal_narrow(lg, 1, n_in - 1, 1), row) != ANNEAL_OK) die("full");
        anneal_scope_close(s);
    }
    double t_full = now_s() - t0;
    anneal_no_grad_end();

    /* the sampler alone */
    int reps = 200;
    double ts[3];
    anneal_sampler_config cs[3] = {{0.8f, 50, 0.95f, 1}, {0.8f, 0, 0.95f, 1}, {1.0f, 0, 1.0f, 1}};
    for (int c = 0; c < 3; c++) {
        t0 = now_s();
        for (int r = 0; r < reps; r++) (void)anneal_sample_logits(row, V, &cs[c], (uint64_t)r);
        ts[c] = (now_s() - t0) / reps;
    }
    /* a peaked distribution, as a trained model gives (random weights give a flat one) */
    for (int i = 0; i < V; i++) row[i] *= 40.0f;
    t0 = now_s();
    for (int r = 0; r < reps; r++) (void)anneal_sample_logits(row, V, &cs[1], (uint64_t)r);
    double t_peaked = (now_s() - t0) / reps;
    printf("%s %s, %d threads, prompt %d, %d new tokens\n", cfg.arch, preset, threads, P, N);
    printf("  prefill (%d tokens): %.1f ms\n", P, 1e3 * t_prefill);
    printf("  decode with KV cache: %.1f ms/token (%.1f tokens/s)\n", 1e3 * t_cached / (N - 1), (N - 1) / t_cached);
    printf("  decode recomputing the prefix: %.1f ms/token (%.1f tokens/s)\n", 1e3 * t_full / (N - 1),
           (N - 1) / t_full);
    printf("  sampler per token: top-k 50 + top-p %.2f ms, top-p only %.2f ms, no truncation %.2f ms\n",
           1e3 * ts[0], 1e3 * ts[1], 1e3 * ts[2]);
    printf("  sampler, top-p only, peaked logits (x40): %.2f ms\n", 1e3 * t_peaked);
    free(seq);
    free(row);
    anneal_model_free(m);
    return 0;
}
