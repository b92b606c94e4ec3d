/* anneal bench: machine figures for benchmarks. `anneal bench peak` measures the
 * peak FLOP rate that MFU is quoted against (anneal_peak_gflops_measure_dtype): fp32
 * with the FMA microbenchmark, bf16 with AVX512-BF16 dot-product chains. On a CPU
 * without AVX512-BF16 (and for fp16) the figure is the FMA one, since those GEMMs run
 * on fp32 FMAs, and the isa says so. bench/bench_train.py calls this so the benchmark
 * measures its own ceiling on the machine it runs on. */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <omp.h>
#include <stdio.h>
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

int anneal_cmd_bench(int argc, char **argv) {
    if (argc < 1 || !strcmp(argv[0], "--help") || !strcmp(argv[0], "-h")) {
        printf("usage: anneal bench peak [flags]   (anneal bench peak --help)\n"
               "  peak   measure the peak fp32 FMA / bf16 dot-product FLOP rate (the MFU ceiling)\n"
               "The training benchmark against PyTorch is bench/bench_train.py (make bench-train).\n");
        return argc < 1 ? 2 : 0;
    }
    if (!strcmp(argv[0], "peak")) return cmd_peak(argc - 1, argv + 1);
    return USAGE_ERR("unknown subcommand '%s' (expected: peak)", argv[0]);
}
