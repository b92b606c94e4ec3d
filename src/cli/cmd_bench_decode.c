/* anneal bench decode: prompt processing and token-by-token decoding speed of a model,
 * with the memory traffic a decode step needs against the machine's measured bandwidth.
 *
 * After a warm-up (a short prefill and one step on slot 0, then emptied), B slots of one
 * KV cache each get a random prompt of --prompt-len ids (prefill, timed
 * as a whole: prompt tok/s; with --prompt-rounds R the prompts are prefilled R times,
 * the slots emptied between, and the median round counts), then --gen decode steps run all B slots at once (the
 * slots API, greedy: each step feeds the argmax of the last), each step timed; the
 * figures are the median step's. Bytes per step = the weight matrices as the decode
 * engine reads them (f32, or bf16 under --dtype bf16 or for bf16 weights; the lm head
 * included, embedding rows not) + the KV cache rows attended at the median step's
 * positions (B slots, keys and values, int8 scales included). */
#include "anneal/anneal.h"
#include "anneal/profile.h"
#include "args.h"
#include "commands.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define USAGE_ERR(...) (fprintf(stderr, "anneal bench decode: " __VA_ARGS__), fputc('\n', stderr), 2)

/* The variable's value, or "" when unset (the OpenMP wait settings the run had). */
static const char *env_or_empty(const char *name) {
    const char *v = getenv(name);
    return v ? v : "";
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* CPU seconds of the whole process (every thread): beside the wall time, it tells a
 * step that waited for a shared machine from one that worked. */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Bytes of the weight matrices one decode step streams: every 2-D parameter but the
 * position embedding (one row read) and an untied token embedding (rows read), at 2
 * bytes under bf16 compute or for bf16 weights, else 4; an int8 layer at 1 byte per
 * weight plus its f32 scales (an int8 lm head too, in place of the f32 table); a layer
 * packed as bf16 panels (anneal_params_pack_bf16) at its panels' bytes. */
static int64_t weight_bytes(const anneal_model *m) {
    bool tied = anneal_params_find(m->params, "lm_head.weight") == NULL;
    int64_t total = 0;
    for (int i = 0; i < m->params->n; i++) {
        const anneal_param *p = &m->params->items[i];
        if (p->tensor->ndim != 2 || strstr(p->name, "wpe")) continue;
        if (!tied && strstr(p->name, "embed_tokens")) continue;
        if (m->params->head && (!strcmp(p->name, "lm_head.weight") || (tied && strstr(p->name, "wte")) ||
                                (tied && strstr(p->name, "embed_tokens"))))
            continue; /* the int8 head is read instead (below); the f32 table only for its rows */
        if (p->tensor->strides[0] == 0 && p->tensor->strides[1] == 0) continue; /* an int8 or packed layer's zero view */
        int64_t es = p->tensor->dtype == ANNEAL_BF16 || m->ctx.compute == ANNEAL_BF16 ? 2 : 4;
        total += anneal_numel(p->tensor) * es;
    }
    /* int8 layers: their int8 weight and f32 scales, what a decode step reads instead;
     * packed layers: their bf16 panels (the output columns padded to 16) */
    for (int i = 0; i < m->params->n_dense; i++) {
        const anneal_nn_quant *q = m->params->dense[i].quant;
        if (q && q->active && q->weight && q->scale) total += anneal_numel(q->weight) + 4 * anneal_numel(q->scale);
        const anneal_nn_dense *d = m->params->dense[i].dense;
        if (d && d->panels) total += 2 * anneal_numel(d->panels);
    }
    if (m->params->head) total += anneal_numel(m->params->head->weight) + 4 * anneal_numel(m->params->head->scale);
    return total;
}

/* The argmax of V logits. */
static int32_t argmax(const float *x, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    return (int32_t)best;
}

int anneal_cmd_bench_decode(int argc, char **argv) {
    const char *model_arg = NULL, *ckpt = NULL, *dtype = "fp32", *kv_arg = "f32";
    int64_t prompt_len = 512, gen = 128, batch = 1, threads = 0, prompt_rounds = 1;
    bool json = false, help = false;
    cli_flag flags[] = {
        {"model", ARG_STRING, "a preset (random weights), a Hugging Face model directory or a checkpoint", &model_arg, 0},
        {"ckpt", ARG_STRING, "instead of --model: a checkpoint or run directory", &ckpt, 0},
        {"prompt-len", ARG_INT, "prompt ids per slot (default 512)", &prompt_len, 0},
        {"gen", ARG_INT, "decode steps (default 128)", &gen, 0},
        {"prompt-rounds", ARG_INT, "prefill the prompts this many times (the slots emptied between): prompt tok/s "
                                   "is the median round's (default 1)", &prompt_rounds, 0},
        {"dtype", ARG_STRING, "matmul precision: fp32 or bf16 (default fp32)", &dtype, 0},
        {"kv-dtype", ARG_STRING, "KV cache storage: f32, bf16 or int8 (default f32)", &kv_arg, 0},
        {"batch", ARG_INT, "slots decoded together (default 1)", &batch, 0},
        {"threads", ARG_INT, "CPU threads (default: all cores)", &threads, 0},
        {"json", ARG_BOOL, "print one JSON object", &json, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("bench decode", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("bench decode", "Times prompt processing and decode steps; GB/s streamed per step against the "
                                  "measured bandwidth, peak RSS.", flags, nf);
        return 0;
    }
    if ((model_arg != NULL) + (ckpt != NULL) != 1) return USAGE_ERR("give one of --model PRESET|DIR or --ckpt RUN");
    if (prompt_len < 1 || prompt_len > 1 << 20) return USAGE_ERR("--prompt-len %lld: expected >= 1", (long long)prompt_len);
    if (prompt_rounds < 1 || prompt_rounds > 1000)
        return USAGE_ERR("--prompt-rounds %lld: expected 1 to 1000", (long long)prompt_rounds);
    if (gen < 1 || gen > 1 << 20) return USAGE_ERR("--gen %lld: expected >= 1", (long long)gen);
    if (batch < 1 || batch > 1024) return USAGE_ERR("--batch %lld: expected 1..1024", (long long)batch);
    if (threads < 0 || threads > 4096) return USAGE_ERR("--threads %lld: expected 0..4096", (long long)threads);
    anneal_dtype compute, kv_dtype;
    if (anneal_cli_parse_dtype("bench decode", dtype, &compute)) return 2;
    if (compute == ANNEAL_F16) return USAGE_ERR("--dtype %s: expected fp32 or bf16", dtype);
    if (anneal_cli_parse_kv_dtype("bench decode", kv_arg, &kv_dtype)) return 2;
    if (threads > 0) anneal_set_num_threads((int)threads);
    int nt = anneal_get_num_threads();

    anneal_model *m = NULL;
    anneal_train_state st = {0};
    char *config_text = NULL;
    int rc = ckpt ? anneal_cli_load_checkpoint("bench decode", ckpt, &m, &st, &config_text)
                  : anneal_cli_load_model("bench decode", "model", model_arg, &m, &st, &config_text, NULL);
    free(config_text);
    if (rc) return rc;
    int64_t len = prompt_len + gen;
    if (len > m->cfg.n_ctx) {
        rc = USAGE_ERR("--prompt-len %lld + --gen %lld exceed the model's n_ctx %d", (long long)prompt_len,
                       (long long)gen, m->cfg.n_ctx);
        anneal_model_free(m);
        return rc;
    }
    anneal_model_set_compute(m, compute);
    anneal_model_set_kv_dtype(m, kv_dtype);
    if (anneal_cli_pack_bf16("bench decode", m)) {
        anneal_model_free(m);
        return 1;
    }
    int64_t V = m->cfg.vocab_size;
    int32_t *prompt = malloc((size_t)prompt_len * sizeof *prompt), *ids = malloc((size_t)batch * sizeof *ids);
    int64_t *slots = malloc((size_t)batch * sizeof *slots);
    double *step_s = malloc((size_t)gen * sizeof *step_s), *step_cpu = malloc((size_t)gen * sizeof *step_cpu);
    anneal_kv_cache *kv = prompt && ids && slots && step_s && step_cpu ? anneal_model_kv_cache_new(m, batch, len) : NULL;
    if (!kv) {
        fprintf(stderr, "anneal bench decode: %s\n", anneal_last_error()[0] ? anneal_last_error() : "out of memory");
        rc = 1;
        goto done;
    }
    uint64_t rng = 7;
    double prefill_s = 0;
    { /* warm-up: a short prefill and one decode step on slot 0 (first-touch of the weights), then empty it */
        anneal_scope *sc = anneal_scope_open();
        int32_t w[8] = {0};
        int64_t s0 = 0;
        bool ok = anneal_model_prefill_slot(m, kv, 0, w, prompt_len < 8 ? prompt_len : 8) &&
                  anneal_model_decode_slots(m, kv, &s0, w, 1);
        anneal_scope_close(sc);
        anneal_kv_cache_slot_reset(kv, 0);
        if (!ok) {
            fprintf(stderr, "anneal bench decode: warm-up: %s\n", anneal_last_error());
            rc = 1;
            goto done;
        }
    }
    double *round_s = calloc((size_t)prompt_rounds, sizeof *round_s);
    if (!round_s) {
        rc = 1;
        goto done;
    }
    for (int64_t r = 0; r < prompt_rounds; r++) { /* the same prompts each round; the last one's stay */
        rng = 7;
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t i = 0; i < prompt_len; i++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                prompt[i] = (int32_t)((rng >> 33) % (uint64_t)V);
            }
            anneal_scope *sc = anneal_scope_open();
            double t0 = now_s();
            anneal_tensor *lg = anneal_model_prefill_slot(m, kv, b, prompt, prompt_len);
            round_s[r] += now_s() - t0;
            if (lg) ids[b] = argmax(anneal_data(lg), V);
            anneal_scope_close(sc);
            if (!lg) {
                fprintf(stderr, "anneal bench decode: prefill: %s\n", anneal_last_error());
                free(round_s);
                rc = 1;
                goto done;
            }
            slots[b] = b;
            if (r + 1 < prompt_rounds) anneal_kv_cache_slot_reset(kv, b);
        }
    }
    qsort(round_s, (size_t)prompt_rounds, sizeof *round_s, cmp_double);
    prefill_s = round_s[prompt_rounds / 2];
    free(round_s);
    for (int64_t s = 0; s < gen; s++) {
        anneal_scope *sc = anneal_scope_open();
        double t0 = now_s(), c0 = cpu_s();
        anneal_tensor *lg = anneal_model_decode_slots(m, kv, slots, ids, batch);
        step_s[s] = now_s() - t0;
        step_cpu[s] = cpu_s() - c0;
        for (int64_t b = 0; lg && b < batch; b++) ids[b] = argmax((const float *)anneal_data(lg) + b * V, V);
        anneal_scope_close(sc);
        if (!lg) {
            fprintf(stderr, "anneal bench decode: decode step %lld: %s\n", (long long)s, anneal_last_error());
            rc = 1;
            goto done;
        }
    }
    double *srt = malloc((size_t)gen * sizeof *srt);
    if (!srt) {
        rc = 1;
        goto done;
    }
    memcpy(srt, step_s, (size_t)gen * sizeof *srt);
    qsort(srt, (size_t)gen, sizeof *srt, cmp_double);
    double med = srt[gen / 2];
    memcpy(srt, step_cpu, (size_t)gen * sizeof *srt);
    qsort(srt, (size_t)gen, sizeof *srt, cmp_double);
    double med_cpu = srt[gen / 2];
    free(srt);
    /* the median step attends to about prompt_len + gen / 2 positions per slot */
    int64_t mid = prompt_len + gen / 2;
    int64_t wbytes = weight_bytes(m), cbytes = anneal_cli_kv_cache_bytes(m, batch, mid, kv_dtype);
    int64_t cache_total = anneal_kv_cache_bytes(kv);
    double gbs = (double)(wbytes + cbytes) / med / 1e9;
    /* peak RSS before the bandwidth microbenchmark's buffers */
    double rss_mib = (double)anneal_peak_rss_bytes() / (1024.0 * 1024.0);
    double bw = anneal_peak_bandwidth_measure(nt, 0.3);
    double prompt_tps = (double)(batch * prompt_len) / prefill_s, decode_tps = (double)batch / med;
    const char *name = model_arg ? model_arg : ckpt;
    if (json) {
        printf("{\"model\":\"%s\",\"arch\":\"%s\",\"dtype\":\"%s\",\"kv_dtype\":\"%s\",\"batch\":%lld,\"threads\":%d,"
               "\"prompt_len\":%lld,\"gen\":%lld,\"prompt_tok_s\":%.2f,\"decode_tok_s\":%.2f,"
               "\"decode_ms_per_step\":%.4f,\"decode_cpu_ms_per_step\":%.4f,"
               "\"weight_bytes\":%lld,\"kv_bytes_per_step\":%lld,\"kv_cache_bytes\":%lld,\"gb_s\":%.3f,"
               "\"bandwidth_gb_s\":%.3f,\"bandwidth_fraction\":%.4f,\"peak_rss_mib\":%.1f,"
               "\"omp_wait_policy\":\"%.32s\",\"gomp_spincount\":\"%.32s\"}\n",
               name, m->cfg.arch, anneal_precision_name(compute), anneal_dtype_name(kv_dtype), (long long)batch, nt,
               (long long)prompt_len, (long long)gen, prompt_tps, decode_tps, med * 1e3, med_cpu * 1e3, (long long)wbytes,
               (long long)cbytes, (long long)cache_total, gbs, bw, bw > 0 ? gbs / bw : 0.0, rss_mib,
               env_or_empty("OMP_WAIT_POLICY"), env_or_empty("GOMP_SPINCOUNT"));
    } else {
        printf("decode %s (%s, %s weights, %s KV, batch %lld, %d threads)\n", name, m->cfg.arch,
               anneal_precision_name(compute), anneal_dtype_name(kv_dtype), (long long)batch, nt);
        printf("  prompt   %lld tokens x %lld: %.1f tok/s\n", (long long)prompt_len, (long long)batch, prompt_tps);
        printf("  decode   %lld steps: median %.3f ms/step (CPU time of all threads %.3f ms), %.1f tok/s\n",
               (long long)gen, med * 1e3, med_cpu * 1e3, decode_tps);
        printf("  traffic  %.1f MB weights + %.1f MB KV per step = %.2f GB/s (measured bandwidth %.2f GB/s: %.0f%%)\n",
               wbytes / 1e6, cbytes / 1e6, gbs, bw, bw > 0 ? 100.0 * gbs / bw : 0.0);
        printf("  memory   KV cache %.2f MiB, peak RSS %.1f MiB\n", cache_total / (1024.0 * 1024.0), rss_mib);
    }
done:
    anneal_kv_cache_free(kv);
    free(prompt);
    free(ids);
    free(slots);
    free(step_s);
    free(step_cpu);
    anneal_model_free(m);
    return rc;
}
