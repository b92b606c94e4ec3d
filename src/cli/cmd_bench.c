/* anneal bench: machine figures for benchmarks. `anneal bench peak` measures the
 * peak FLOP rate that MFU is quoted against (anneal_peak_gflops_measure_dtype): fp32
 * with the FMA microbenchmark, bf16 with AVX512-BF16 dot-product chains. On a CPU
 * without AVX512-BF16 (and for fp16) the figure is the FMA one, since those GEMMs run
 * on fp32 FMAs, and the isa says so. bench/bench_train.py calls this so the benchmark
 * measures its own ceiling on the machine it runs on. */
#include "anneal/anneal.h"
#include "anneal/profile.h"
#include "args.h"
#include "commands.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define USAGE_ERR(...) (fprintf(stderr, "anneal bench: " __VA_ARGS__), fputc('\n', stderr), 2)

/* anneal bench peak [--dtype fp32|bf16|fp16] [--threads N] [--seconds S] [--json]: one line,
 * "peak fp32 452.1 GFLOP/s (avx512 fma microbenchmark, 2 threads)", or a JSON object
 * {"dtype","gflops","isa","threads","seconds"} with --json. */
static int cmd_peak(int argc, char **argv) {
    const char *dtype = "fp32";
    int64_t threads = 0;
    double seconds = 1.0;
    bool json = false, help = false;
    cli_flag flags[] = {
        {"dtype", ARG_STRING, "GEMM operand precision: fp32, bf16 (AVX512-BF16 dot products) or fp16 (default fp32)",
         &dtype, false},
        {"threads", ARG_INT, "threads, 0 = all cores (default 0)", &threads, false},
        {"seconds", ARG_FLOAT, "measuring time per repetition (default 1)", &seconds, false},
        {"json", ARG_BOOL, "print one JSON object instead of a line", &json, false},
        {"help", ARG_BOOL, "show this help", &help, false},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("bench peak", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("bench peak", "Measures the peak fp32 FMA or bf16 dot-product FLOP rate (the MFU ceiling).", flags, nf);
        return 0;
    }
    anneal_dtype dt;
    if (!anneal_train_dtype_parse(dtype, &dt)) return USAGE_ERR("--dtype %s: expected fp32, bf16 or fp16", dtype);
    if (threads < 0 || threads > 4096) return USAGE_ERR("--threads %lld: expected 0..4096", (long long)threads);
    if (!(seconds > 0 && seconds <= 60)) return USAGE_ERR("--seconds %g: expected more than 0, at most 60", seconds);
    int nt = threads > 0 ? (int)threads : omp_get_max_threads();
    const char *isa = NULL;
    double gf = anneal_peak_gflops_measure_dtype(nt, seconds, dt, &isa);
    if (json)
        printf("{\"dtype\":\"%s\",\"gflops\":%.1f,\"isa\":\"%s microbenchmark\",\"threads\":%d,\"seconds\":%g}\n",
               anneal_precision_name(dt),
               gf, isa, nt, seconds);
    else
        printf("peak %s %.1f GFLOP/s (%s microbenchmark, %d threads)\n", anneal_precision_name(dt), gf, isa, nt);
    return 0;
}

/* One training step (forward, backward, AdamW) on random tokens, timed by the caller. */
static anneal_status bench_one_step(anneal_model *m, anneal_optimizer *opt, int64_t B, int64_t T, uint64_t *rng,
                                    int32_t *ids, int32_t *tg) {
    int64_t V = m->cfg.vocab_size;
    for (int64_t i = 0; i < B * T; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((*rng >> 33) % (uint64_t)V);
        tg[i] = (int32_t)((*rng >> 13) % (uint64_t)V);
    }
    int64_t span_t0 = anneal_span_begin();
    anneal_params_zero_grad(m->params);
    anneal_scope *s = anneal_scope_open();
    int64_t shape[2] = {B, T};
    anneal_tensor *x = anneal_from_data(ANNEAL_I32, 2, shape, ids), *y = anneal_from_data(ANNEAL_I32, 2, shape, tg);
    int64_t t_f = anneal_span_begin();
    anneal_tensor *loss = x && y ? anneal_model_loss(m, x, y) : NULL;
    anneal_span_end(ANNEAL_SPAN_STEP, "forward", t_f, 0, 0);
    int64_t t_b = anneal_span_begin();
    anneal_status st = loss ? anneal_backward(loss) : anneal_last_status();
    anneal_span_end(ANNEAL_SPAN_STEP, "backward", t_b, 0, 0);
    anneal_scope_close(s);
    int64_t t_o = anneal_span_begin();
    if (st == ANNEAL_OK) st = anneal_optimizer_step(opt, 1e-4);
    anneal_span_end(ANNEAL_SPAN_STEP, "optimizer", t_o, 0, 0);
    anneal_span_end(ANNEAL_SPAN_STEP, "step", span_t0, 0, 0);
    return st;
}

/* anneal bench step [--model P] [--batch B] [--seq T] [--steps N] [--warmup W] [--dtype D]
 * [--profile] [--trace FILE]: times N training steps of a preset after W warm-up steps ("step 12.3
 * ms, 41.2k tok/s"); --profile records them and prints the per-op table, and writes the
 * Chrome trace to FILE (default bench_step_trace.json). */
static int cmd_step(int argc, char **argv) {
    const char *model = "tiny", *trace = "bench_step_trace.json", *dtype = "fp32";
    int64_t batch = 8, seq = 64, steps = 5, warmup = 2;
    bool profile = false, help = false;
    cli_flag flags[] = {
        {"model", ARG_STRING, "preset (default tiny)", &model, false},
        {"batch", ARG_INT, "sequences per step (default 8)", &batch, false},
        {"seq", ARG_INT, "sequence length (default 64)", &seq, false},
        {"steps", ARG_INT, "timed steps (default 5)", &steps, false},
        {"warmup", ARG_INT, "untimed steps first (default 2)", &warmup, false},
        {"dtype", ARG_STRING, "matmul precision: fp32, bf16 or fp16 (default fp32; fp16 without loss scaling)", &dtype,
         false},
        {"profile", ARG_BOOL, "record the timed steps: per-op table and a Chrome trace", &profile, false},
        {"trace", ARG_STRING, "--profile: the Chrome trace file (default bench_step_trace.json)", &trace, false},
        {"help", ARG_BOOL, "show this help", &help, false},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("bench step", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("bench step", "Times training steps of a preset on random tokens; --profile adds the per-op table and a trace.",
                  flags, nf);
        return 0;
    }
    if (batch < 1 || batch > 4096) return USAGE_ERR("--batch %lld: expected 1..4096", (long long)batch);
    if (steps < 1 || steps > 100000) return USAGE_ERR("--steps %lld: expected 1..100000", (long long)steps);
    if (warmup < 0 || warmup > 100000) return USAGE_ERR("--warmup %lld: expected 0..100000", (long long)warmup);
    anneal_dtype compute;
    if (!anneal_train_dtype_parse(dtype, &compute)) return USAGE_ERR("--dtype %s: expected fp32, bf16 or fp16", dtype);
    anneal_model_config mc;
    if (!anneal_model_preset(model, &mc)) {
        char names[512];
        return USAGE_ERR("--model %s: expected a preset (%s)", model, anneal_model_preset_names(names, sizeof names));
    }
    if (seq < 1 || seq > mc.n_ctx) return USAGE_ERR("--seq %lld: expected 1..%lld (the model's n_ctx)", (long long)seq,
                                                 (long long)mc.n_ctx);
    anneal_model *m = anneal_model_new(&mc, ANNEAL_CPU);
    anneal_optimizer *opt = m && anneal_model_init(m, 1) == ANNEAL_OK
                                ? anneal_optimizer_new(m->params, anneal_optim_defaults(ANNEAL_OPTIM_ADAMW))
                                : NULL;
    int32_t *ids = malloc((size_t)(batch * seq) * sizeof *ids), *tg = malloc((size_t)(batch * seq) * sizeof *tg);
    int rc = 0;
    if (!opt || !ids || !tg) {
        fprintf(stderr, "anneal bench step: %s\n", anneal_last_error()[0] ? anneal_last_error() : "out of memory");
        rc = 1;
        goto done;
    }
    anneal_model_set_training(m, true);
    anneal_model_set_compute(m, compute);
    uint64_t rng = 1;
    anneal_status st = ANNEAL_OK;
    for (int64_t i = 0; i < warmup && st == ANNEAL_OK; i++) st = bench_one_step(m, opt, batch, seq, &rng, ids, tg);
    if (profile) {
        anneal_trace_thread_name("main");
        anneal_trace_reset();
        anneal_trace_enable(true);
    }
    double t0 = (double)anneal_trace_now_ns(), c0 = anneal_process_cpu_seconds();
    for (int64_t i = 0; i < steps && st == ANNEAL_OK; i++) st = bench_one_step(m, opt, batch, seq, &rng, ids, tg);
    double ms = ((double)anneal_trace_now_ns() - t0) / 1e6 / (double)steps;
    double cpu_ms = (anneal_process_cpu_seconds() - c0) * 1e3 / (double)steps;
    anneal_trace_enable(false);
    if (st != ANNEAL_OK) {
        fprintf(stderr, "anneal bench step: %s\n", anneal_last_error());
        rc = 1;
        goto done;
    }
    char tps[32];
    printf("step %.2f ms, %s tok/s (%s, %s products, batch %lld, seq %lld, %lld steps after %lld warm-up)\n", ms,
           anneal_format_count((double)(batch * seq) / (ms / 1e3), tps, sizeof tps), model,
           anneal_dtype_name(m->ctx.compute), (long long)batch,
           (long long)seq, (long long)steps, (long long)warmup);
    const int nthreads = omp_get_max_threads();
    const double pf = anneal_parallel_fraction(ms, cpu_ms, nthreads);
    if (pf >= 0)
        printf("parallel fraction %.3f (Amdahl, from %.1f CPU ms per %.1f wall ms a step on %d threads; waiting "
               "threads asleep)\n",
               pf, cpu_ms, ms, nthreads);
    if (profile) {
        anneal_span *sp;
        int64_t n = anneal_trace_collect(&sp);
        const int nt = nthreads;
        /* % peak against what the step's products run on (AMX tiles for bf16 where present) */
        anneal_profile_print(stdout, sp, n > 0 ? n : 0, anneal_peak_gflops_measure_dtype(nt, 0.2, m->ctx.compute, NULL),
                             anneal_peak_bandwidth_measure(nt, 0.2), 0);
        if (anneal_profile_write_chrome(trace, sp, n > 0 ? n : 0) != ANNEAL_OK) {
            fprintf(stderr, "anneal bench step: %s\n", anneal_last_error());
            rc = 1;
        } else {
            printf("trace: %s\n", trace);
        }
        free(sp);
    }
done:
    free(ids);
    free(tg);
    anneal_optimizer_free(opt);
    anneal_model_free(m);
    return rc;
}

int anneal_cmd_bench(int argc, char **argv) {
    if (argc < 1 || !strcmp(argv[0], "--help") || !strcmp(argv[0], "-h")) {
        printf("usage: anneal bench peak|step|decode [flags]   (anneal bench peak --help)\n"
               "  peak   measure the peak fp32 FMA / bf16 dot-product FLOP rate (the MFU ceiling)\n"
               "  step   time training steps of a preset; --profile: per-op table and Chrome trace\n"
               "  decode time prompt processing and decode steps; GB/s against the measured bandwidth\n"
               "The training benchmark against PyTorch is bench/bench_train.py (make bench-train).\n");
        return argc < 1 ? 2 : 0;
    }
    if (!strcmp(argv[0], "peak")) return cmd_peak(argc - 1, argv + 1);
    if (!strcmp(argv[0], "step")) return cmd_step(argc - 1, argv + 1);
    if (!strcmp(argv[0], "decode")) return anneal_cmd_bench_decode(argc - 1, argv + 1);
    return USAGE_ERR("unknown subcommand '%s' (expected: peak, step, decode)", argv[0]);
}
