/* Prompt and decode speed of a model directory (float or anneal-int8, anything
 * anneal_model_load_hf reads), batch 1, through the slots API that `anneal generate` and
 * `anneal serve` use: the prefill of a P-token prompt (anneal_model_prefill_slot: one
 * batched forward, only the last row through the lm head), then N tokens one at a time
 * (greedy; anneal_model_decode_slots: the decode engine). KV cache f32 unless KV says
 * bf16 or int8. Best of R runs. Prints one line:
 *   prefill_tok_s X decode_tok_s Y
 * Built and run by bench/quant_speed.py:
 *   gcc -O2 -std=c11 -D_GNU_SOURCE -Iinclude bench/bench_quant.c build/libanneal.a \
 *       $(pkg-config --libs libcjson libpcre2-8 libprotobuf-c libmicrohttpd cairo) -fopenmp -lm -lpthread
 *   ./bench_quant DIR [P] [N] [threads] [R] [KV] */
#include "anneal/anneal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_quant DIR [P] [N] [threads] [R] [f32|bf16|int8]\n");
        return 2;
    }
    int P = argc > 2 ? atoi(argv[2]) : 512, N = argc > 3 ? atoi(argv[3]) : 64;
    int threads = argc > 4 ? atoi(argv[4]) : 2, R = argc > 5 ? atoi(argv[5]) : 3;
    anneal_set_num_threads(threads);
    anneal_model *m = NULL;
    if (anneal_model_load_hf(argv[1], ANNEAL_CPU, &m) != ANNEAL_OK) {
        fprintf(stderr, "bench_quant: %s: %s\n", argv[1], anneal_last_error());
        return 1;
    }
    const char *kvs = argc > 6 ? argv[6] : "f32";
    anneal_dtype kvd = !strcmp(kvs, "bf16") ? ANNEAL_BF16 : !strcmp(kvs, "int8") ? ANNEAL_I8 : ANNEAL_F32;
    if (anneal_model_set_kv_dtype(m, kvd) != ANNEAL_OK) return fprintf(stderr, "bench_quant: %s\n", anneal_last_error()), 1;
    if (P < 1 || N < 1 || P + N > m->cfg.n_ctx) {
        fprintf(stderr, "bench_quant: P + N must be in [2, n_ctx %lld]\n", (long long)m->cfg.n_ctx);
        return 2;
    }
    int32_t *ids = malloc((size_t)P * sizeof *ids);
    uint64_t s = 42;
    for (int i = 0; i < P; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = (int32_t)((s >> 33) % (uint64_t)m->cfg.vocab_size);
    }
    double best_p = 1e30, best_d = 1e30;
    for (int r = 0; r < R; r++) {
        anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 1, P + N);
        if (!kv) return fprintf(stderr, "bench_quant: %s\n", anneal_last_error()), 1;
        anneal_scope *sc = anneal_scope_open();
        double t0 = now_s();
        anneal_tensor *l = anneal_model_prefill_slot(m, kv, 0, ids, P);
        if (!l) return fprintf(stderr, "bench_quant: prefill: %s\n", anneal_last_error()), 1;
        double t1 = now_s();
        int64_t V = m->cfg.vocab_size;
        for (int t = 0; t < N; t++) {
            int32_t next = 0;
            float best = -1e30f;
            for (int64_t v = 0; v < V; v++) { /* greedy */
                float x = (float)anneal_item_at(l, v);
                if (x > best) best = x, next = (int32_t)v;
            }
            anneal_scope *st = anneal_scope_open();
            l = anneal_model_decode_slots(m, kv, (const int64_t[]){0}, &next, 1);
            if (!l) return fprintf(stderr, "bench_quant: decode: %s\n", anneal_last_error()), 1;
            anneal_keep(l, sc);
            anneal_scope_close(st);
        }
        double t2 = now_s();
        anneal_scope_close(sc);
        anneal_kv_cache_free(kv);
        best_p = t1 - t0 < best_p ? t1 - t0 : best_p;
        best_d = t2 - t1 < best_d ? t2 - t1 : best_d;
    }
    printf("prefill_tok_s %.2f decode_tok_s %.2f\n", P / best_p, N / best_d);
    free(ids);
    anneal_model_free(m);
    return 0;
}
