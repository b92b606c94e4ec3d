/* Which CPU kernel paths (ISA per kernel family) run on this machine, printed as a table:
 *   1. the default dispatch must pick the best path the CPU has for every family
 *      (gemm f32/bf16/f16, attention f32/bf16): a failure otherwise, on any machine;
 *   2. every path the CPU can run is run once here (forced with anneal_cpu_sgemm_set_isa,
 *      anneal_cpu_gemm_allow_bf16_kernel and ANNEAL_CPU_ISA; AMX's C model is not a path
 *      of this CPU: test_gemm_amx.c runs it), and a path of an ISA the CPU
 *      has that did not run is a promised skip (a failure under ANNEAL_TEST_STRICT=1);
 *   3. paths of ISAs this CPU lacks cannot run here: the test then ends with a plain SKIP
 *      naming them, so a CI machine without, say, AVX512-BF16 shows that those kernels
 *      went untested there.
 * The record is anneal_cpu_path_note's (src/cpu/cpu_features.c), set by the dispatch. */
#include "anneal/backend.h"
#include "anneal/core.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_internal.h"
#include "test.h"

#include <cpuid.h>
#include <stdlib.h>
#include <string.h>

enum { NISA = 5 };
static const unsigned ISAS[NISA] = {ANNEAL_CPU_PATH_PORTABLE, ANNEAL_CPU_PATH_AVX2, ANNEAL_CPU_PATH_AVX512,
                                    ANNEAL_CPU_PATH_AVX512BF16, ANNEAL_CPU_PATH_AMX};

/* One small product at each precision, and attention forward + backward at f32 and bf16. */
static void run_ops(bool gemms, bool attention) {
    enum { N = 48, B = 1, H = 2, T = 40, D = 16 };
    float *a = anneal_test_rand_buf(N * N, -1, 1), *b = anneal_test_rand_buf(N * N, -1, 1), *c = malloc(N * N * 4);
    static const int dts[3] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_F16};
    for (int i = 0; gemms && i < 3; i++) anneal_cpu_gemm(dts[i], false, false, N, N, N, 1, a, N, b, N, 0, c, N, NULL);
    const int64_t n = B * H * T * D;
    float *q = anneal_test_rand_buf(n, -1, 1), *k = anneal_test_rand_buf(n, -1, 1), *v = anneal_test_rand_buf(n, -1, 1);
    float *o = malloc(n * 4), *lse = malloc(B * H * T * 4), *dout = anneal_test_rand_buf(n, -1, 1);
    float *dq = malloc(n * 4), *dk = malloc(n * 4), *dv = malloc(n * 4);
    anneal_cpu_attn_desc d = {.B = B, .H = H, .Tq = T, .Tk = T, .D = D, .q_sb = H * T * D, .q_sh = T * D, .q_st = D,
                              .k_sb = H * T * D, .k_sh = T * D, .k_st = D, .v_sb = H * T * D, .v_sh = T * D,
                              .v_st = D, .o_sb = H * T * D, .o_sh = T * D, .o_st = D, .scale = 0.25f, .causal = true};
    for (int i = 0; attention && i < 2; i++) {
        anneal_cpu_attention_fwd(&d, q, k, v, o, lse, dts[i]);
        anneal_cpu_attention_bwd(&d, q, k, v, o, dout, lse, dq, dk, dv, dts[i]);
    }
    free(a), free(b), free(c), free(q), free(k), free(v), free(o), free(lse), free(dout), free(dq), free(dk), free(dv);
}

/* The ISAs this CPU has, as path bits. */
static unsigned cpu_isas(void) {
    return ANNEAL_CPU_PATH_PORTABLE | (anneal_cpu_has_avx2() ? ANNEAL_CPU_PATH_AVX2 : 0) |
           (anneal_cpu_has_avx512() ? ANNEAL_CPU_PATH_AVX512 : 0) |
           (anneal_cpu_has_avx512() && anneal_cpu_has_avx512bf16() ? ANNEAL_CPU_PATH_AVX512BF16 : 0) |
           (anneal_cpu_has_avx512() && anneal_cpu_amx_usable() ? ANNEAL_CPU_PATH_AMX : 0);
}

/* The paths family op has at all (whatever the CPU). */
static unsigned op_paths(int op) {
    switch (op) {
    case ANNEAL_CPU_OP_GEMM_F32:
    case ANNEAL_CPU_OP_GEMM_F16: return ANNEAL_CPU_PATH_PORTABLE | ANNEAL_CPU_PATH_AVX2 | ANNEAL_CPU_PATH_AVX512;
    case ANNEAL_CPU_OP_GEMM_BF16:
        return ANNEAL_CPU_PATH_PORTABLE | ANNEAL_CPU_PATH_AVX2 | ANNEAL_CPU_PATH_AVX512 | ANNEAL_CPU_PATH_AVX512BF16 |
               ANNEAL_CPU_PATH_AMX;
    case ANNEAL_CPU_OP_ATTN_F32: return ANNEAL_CPU_PATH_PORTABLE | ANNEAL_CPU_PATH_AVX2 | ANNEAL_CPU_PATH_AVX512;
    default:
        return ANNEAL_CPU_PATH_PORTABLE | ANNEAL_CPU_PATH_AVX2 | ANNEAL_CPU_PATH_AVX512 | ANNEAL_CPU_PATH_AVX512BF16;
    }
}

/* The path the default dispatch should take for op on a CPU with `has`. */
static unsigned best_path(int op, unsigned has) {
    unsigned usable = op_paths(op) & has;
    /* bf16 products leave VDPBF16PS to the f32 kernels where it is the slower unit */
    if ((op == ANNEAL_CPU_OP_GEMM_BF16 || op == ANNEAL_CPU_OP_ATTN_BF16) && !anneal_cpu_bf16_dot_preferred())
        usable &= ~ANNEAL_CPU_PATH_AVX512BF16;
    for (int i = NISA - 1; i >= 0; i--)
        if (usable & ISAS[i]) return ISAS[i];
    return 0;
}

static void names(unsigned bits, char *out, size_t n) {
    out[0] = 0;
    for (int i = 0; i < NISA; i++)
        if (bits & ISAS[i]) snprintf(out + strlen(out), n - strlen(out), "%s%s", out[0] ? " " : "", anneal_cpu_path_name(ISAS[i]));
    if (!out[0]) snprintf(out, n, "-");
}

TEST(kernel_paths_of_this_cpu) {
    const unsigned has = cpu_isas();
    unsigned dflt[ANNEAL_CPU_OP_COUNT], all[ANNEAL_CPU_OP_COUNT];
    unsetenv("ANNEAL_CPU_ISA");
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
    anneal_cpu_paths_reset();
    run_ops(true, true);
    for (int op = 0; op < ANNEAL_CPU_OP_COUNT; op++) dflt[op] = anneal_cpu_paths_taken(op);
    /* every path this CPU can run */
    static const int gemm_isas[3] = {ANNEAL_GEMM_ISA_PORTABLE, ANNEAL_GEMM_ISA_AVX2, ANNEAL_GEMM_ISA_AVX512};
    for (int i = 0; i < 3; i++)
        for (int allow = 0; allow < 2; allow++)
            if (anneal_cpu_sgemm_set_isa(gemm_isas[i]) == 0) {
                anneal_cpu_gemm_allow_bf16_kernel(allow);
                run_ops(true, false);
            }
    anneal_cpu_gemm_allow_bf16_kernel(true);
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
    /* VDPBF16PS where AMX (GEMM) or the f32 kernels (Intel cores) take bf16 by default */
    setenv("ANNEAL_CPU_ISA", "avx512bf16", 1);
    run_ops(true, true);
    /* avx2 / avx512: the bf16 fallback on AVX2 / AVX-512 tiles */
    static const char *attn_env[4] = {"portable", "avx2", "avx512", NULL};
    for (int i = 0; i < 4; i++) {
        if (attn_env[i]) setenv("ANNEAL_CPU_ISA", attn_env[i], 1);
        else unsetenv("ANNEAL_CPU_ISA");
        run_ops(false, true);
    }
    unsetenv("ANNEAL_CPU_ISA");
    char hs[96];
    names(has, hs, sizeof hs);
    printf("  this CPU: %s\n  %-15s %-12s %-12s %s\n", hs, "kernels", "default", "should be", "run here");
    unsigned missing = 0, lacking = 0;
    for (int op = 0; op < ANNEAL_CPU_OP_COUNT; op++) {
        all[op] = anneal_cpu_paths_taken(op);
        char d[96], a[96], w[96];
        names(dflt[op], d, sizeof d);
        names(all[op], a, sizeof a);
        names(best_path(op, has), w, sizeof w);
        printf("  %-15s %-12s %-12s %s\n", anneal_cpu_op_name(op), d, w, a);
        CHECK(dflt[op] == best_path(op, has), "%s: the default dispatch ran %s, the best path of this CPU is %s",
              anneal_cpu_op_name(op), d, w);
        missing |= (op_paths(op) & has) & ~all[op];
        lacking |= op_paths(op) & ~has;
    }
    char m[96], l[96];
    names(missing, m, sizeof m);
    names(lacking, l, sizeof l);
    if (missing) SKIP_PROMISED("paths of ISAs this CPU has did not run: %s", m);
    if (lacking) SKIP("this CPU lacks %s: those kernel paths cannot run here", l);
}

/* The ISA level of one path bit. */
static int path_level(unsigned bit) {
    return bit == ANNEAL_CPU_PATH_PORTABLE ? ANNEAL_ISA_PORTABLE
           : bit == ANNEAL_CPU_PATH_AVX2   ? ANNEAL_ISA_AVX2
           : bit == ANNEAL_CPU_PATH_AVX512 ? ANNEAL_ISA_AVX512
           : bit == ANNEAL_CPU_PATH_AMX    ? ANNEAL_ISA_AMX
                                           : ANNEAL_ISA_AVX512BF16;
}

/* Under every ANNEAL_ISA level: no kernel runs a path above the level, each family runs
 * the best path at or below it that the CPU has, and `anneal info`'s report
 * (anneal_cpu_kernel_report) names the path that then runs. */
TEST(isa_limit_and_report) {
    static const char *levels[] = {"portable", "avx2", "avx512", "avx512bf16", "amx", NULL};
    static const char *families[ANNEAL_CPU_OP_COUNT] = {"gemm f32", "gemm bf16", "gemm f16", "attention f32",
                                                        "attention bf16"};
    const unsigned has = cpu_isas();
    for (int li = 0; li < 6; li++) {
        if (levels[li]) setenv("ANNEAL_ISA", levels[li], 1);
        else unsetenv("ANNEAL_ISA");
        const int limit = anneal_cpu_isa_limit();
        CHECK(levels[li] ? !strcmp(anneal_cpu_isa_level_name(limit), levels[li]) : limit == ANNEAL_ISA_BEST,
              "ANNEAL_ISA=%s read as %s", levels[li] ? levels[li] : "(unset)", anneal_cpu_isa_level_name(limit));
        anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
        anneal_cpu_kernel_info rows[16];
        int n = anneal_cpu_kernel_report(rows, 16);
        anneal_cpu_paths_reset();
        run_ops(true, true);
        for (int op = 0; op < ANNEAL_CPU_OP_COUNT; op++) {
            const unsigned ran = anneal_cpu_paths_taken(op);
            unsigned allowed = 0;
            for (int i = 0; i < NISA; i++)
                if (path_level(ISAS[i]) <= limit) allowed |= ISAS[i];
            const unsigned want = best_path(op, has & allowed);
            char r[96], w[96];
            names(ran, r, sizeof r);
            names(want, w, sizeof w);
            CHECK(ran == want, "ANNEAL_ISA=%s, %s: ran %s, the best path at or below the limit is %s",
                  levels[li] ? levels[li] : "(unset)", families[op], r, w);
            const char *said = NULL;
            for (int i = 0; i < n && i < 16; i++)
                if (!strcmp(rows[i].family, families[op])) said = rows[i].path;
            CHECK(said && !strcmp(said, r), "ANNEAL_ISA=%s, %s: the report says %s, %s ran",
                  levels[li] ? levels[li] : "(unset)", families[op], said ? said : "nothing", r);
        }
        if (!levels[li])
            for (int i = 0; i < n && i < 16; i++) printf("  %-15s %-11s %s\n", rows[i].family, rows[i].path, rows[i].why);
    }
    setenv("ANNEAL_ISA", "avx3", 1);
    CHECK(anneal_cpu_isa_env_error() != NULL && strstr(anneal_cpu_isa_env_error(), "ANNEAL_ISA=avx3"),
          "an unknown level is reported: %s", anneal_cpu_isa_env_error() ? anneal_cpu_isa_env_error() : "(nothing)");
    unsetenv("ANNEAL_ISA");
    setenv("ANNEAL_CPU_ISA", "portable", 1); /* the older name still works */
    CHECK(anneal_cpu_isa_limit() == ANNEAL_ISA_PORTABLE, "ANNEAL_CPU_ISA=portable read as %d", anneal_cpu_isa_limit());
    unsetenv("ANNEAL_CPU_ISA");
    CHECK(anneal_cpu_isa_env_error() == NULL, "no variable, no error");
    anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO);
}

/* The CPU's vendor string from CPUID leaf 0 into v (13 bytes). */
static void cpu_vendor(char v[13]) {
    unsigned a, b, c, d;
    memset(v, 0, 13);
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    memcpy(v, &b, 4), memcpy(v + 4, &d, 4), memcpy(v + 8, &c, 4);
}

/* bf16 products take VDPBF16PS by default except on Intel cores (where it runs at half the
 * f32 FMA rate), always when ANNEAL_ISA=avx512bf16 names it, and never below that level or
 * without the instructions. */
TEST(bf16_dot_preference) {
    char vendor[13];
    cpu_vendor(vendor);
    const bool has = anneal_cpu_has_avx512() && anneal_cpu_has_avx512bf16();
    const bool intel = strcmp(vendor, "GenuineIntel") == 0;
    static const char *levels[] = {"portable", "avx2", "avx512", "avx512bf16", "amx", NULL};
    for (int li = 0; li < 6; li++) {
        if (levels[li]) setenv("ANNEAL_ISA", levels[li], 1);
        else unsetenv("ANNEAL_ISA");
        const bool forced = li == 3, open = li >= 4; /* avx512bf16 named; amx or unset */
        const bool want = has && (forced || (open && !intel));
        CHECK(anneal_cpu_bf16_dot_preferred() == want, "vendor %s, ANNEAL_ISA=%s: VDPBF16PS preferred %d, want %d",
              vendor, levels[li] ? levels[li] : "(unset)", anneal_cpu_bf16_dot_preferred(), want);
    }
    unsetenv("ANNEAL_ISA");
    printf("  vendor %s, AVX512-BF16 %s: bf16 products on %s by default\n", vendor, has ? "yes" : "no",
           anneal_cpu_bf16_dot_preferred() ? "VDPBF16PS" : "the f32 kernels");
    if (!has) SKIP("this CPU has no AVX512-BF16: only the 'never' half of the rule can be seen here");
}

int main(void) {
    RUN(bf16_dot_preference);
    RUN(isa_limit_and_report);
    RUN(kernel_paths_of_this_cpu);
    return anneal_test_summary();
}
