/* The CPU backend's dispatch, explained: for each kernel family the path the next call
 * takes on this CPU under the ISA limit (ANNEAL_ISA), and the reason, for `anneal info`
 * and the training log's start record. It asks the same selectors the kernels ask, so
 * the report cannot disagree with what runs. */
#include "anneal/backend.h"
#include "anneal/core.h"
#include "anneal/decode_kernels.h"
#include "cpu/attention_internal.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_int8_internal.h"
#include "cpu/gemm_internal.h"

#include <stdio.h>
#include <string.h>

/* Why a path of `level` (needing CPU feature `feature`, present or not) is not taken:
 * the CPU lacks it, or the ISA limit is below it. Empty when it is taken. */
static const char *blocked(int level, bool present, const char *feature, char *buf, size_t n) {
    if (!present) snprintf(buf, n, "no %s on this CPU", feature);
    else if (anneal_cpu_isa_limit() < level)
        snprintf(buf, n, "%s held back by ANNEAL_ISA=%s", feature, anneal_cpu_isa_level_name(anneal_cpu_isa_limit()));
    else buf[0] = 0;
    return buf;
}

/* Why bf16 products do not run VDPBF16PS (anneal_cpu_bf16_dot_preferred is false). */
static const char *bf16_dot_why(char *buf, size_t n) {
    blocked(ANNEAL_ISA_AVX512BF16, anneal_cpu_has_avx512() && anneal_cpu_has_avx512bf16(), "AVX512-BF16", buf, n);
    if (!buf[0])
        snprintf(buf, n, "VDPBF16PS runs at half the f32 FMA rate on Intel cores; ANNEAL_ISA=avx512bf16 forces it");
    return buf;
}

static void row(anneal_cpu_kernel_info *rows, int max, int *k, const char *family, const char *path,
                const char *fmt, const char *a, const char *b) {
    if (*k < max) {
        rows[*k].family = family;
        rows[*k].path = path;
        snprintf(rows[*k].why, sizeof rows[*k].why, fmt, a, b);
    }
    (*k)++;
}

int anneal_cpu_kernel_report(anneal_cpu_kernel_info *rows, int max) {
    char b1[96], b2[96];
    int k = 0;
    const bool amx = anneal_cpu_has_amx();
    const char *amx_why = !amx ? "" : anneal_cpu_isa_limit() < ANNEAL_ISA_AMX ? " (AMX capped by ANNEAL_ISA)"
                                                                              : " (AMX present but Linux refused the tile state)";
    /* f32 GEMM: AVX-512F > AVX2+FMA+F16C > portable */
    const char *f32 = anneal_cpu_sgemm_isa_name();
    const char *why512 = blocked(ANNEAL_ISA_AVX512, anneal_cpu_has_avx512(), "AVX-512F", b1, sizeof b1);
    if (!strcmp(f32, "avx512")) row(rows, max, &k, "gemm f32", f32, "AVX-512F FMA micro-kernel%s%s", "", "");
    else if (!strcmp(f32, "avx2"))
        row(rows, max, &k, "gemm f32", f32, "AVX2+FMA micro-kernel (%s)%s", why512, "");
    else
        row(rows, max, &k, "gemm f32", f32, "compiler-vectorised C (%s; %s)", why512,
            blocked(ANNEAL_ISA_AVX2, anneal_cpu_has_avx2(), "AVX2+FMA+F16C", b2, sizeof b2));
    /* bf16 GEMM: AMX tiles > VDPBF16PS > the f32 kernel on operands rounded to bf16 while packing */
    const char *bf = anneal_cpu_gemm_kernel_name(ANNEAL_BF16);
    if (!strcmp(bf, "amx")) row(rows, max, &k, "gemm bf16", bf, "AMX tiles, TDPBF16PS 32 x 32 micro-kernel%s%s", "", "");
    else if (!strcmp(bf, "avx512bf16"))
        row(rows, max, &k, "gemm bf16", bf, "VDPBF16PS micro-kernel%s%s", amx ? amx_why : " (no AMX)", "");
    else
        row(rows, max, &k, "gemm bf16", bf, "the f32 kernel on operands rounded to bf16 while packing (%s)%s",
            bf16_dot_why(b1, sizeof b1), "");
    row(rows, max, &k, "gemm f16", anneal_cpu_gemm_kernel_name(ANNEAL_F16),
        "the f32 kernel on operands rounded to f16 while packing (no AVX512-FP16 kernel)%s%s", "", "");
    /* int8 GEMM */
    int s8 = anneal_cpu_gemm_s8_isa();
    const char *s8n = anneal_cpu_gemm_s8_isa_name(s8);
    if (s8 == ANNEAL_GEMM_S8_AMX)
        row(rows, max, &k, "gemm int8", s8n,
            "quantized linears: VPDPBUSD (1 row the few-rows pass, from 2 rows 16-output panels: faster than the "
            "tiles on the AMX machine measured); the int8 GEMM: AMX tiles, TDPBSSD 32 x 32 blocks from 32 rows%s%s",
            "", "");
    else if (s8 == ANNEAL_GEMM_S8_AVX512VNNI)
        row(rows, max, &k, "gemm int8", s8n,
            "VPDPBUSD: 1 row the few-rows pass, from 2 rows 16-output panels (the decode engine's copy, or packed "
            "for the call past 32 rows)%s%s",
            amx_why, "");
    else
        row(rows, max, &k, "gemm int8", s8n, "%s (%s)", s8 == ANNEAL_GEMM_S8_AVX2 ? "AVX2 VPMADDWD kernel" : "C",
            s8 == ANNEAL_GEMM_S8_AVX2 ? blocked(ANNEAL_ISA_AVX512, anneal_cpu_has_avx512vnni(), "AVX512-VNNI", b1, sizeof b1)
                                      : blocked(ANNEAL_ISA_AVX2, anneal_cpu_has_avx2(), "AVX2", b1, sizeof b1));
    /* decode GEMV */
    const char *gv = anneal_gemv_path_name();
    if (!strcmp(gv, "avx512")) row(rows, max, &k, "gemv (decode)", gv, "AVX-512 rows, weights streamed once%s%s", "", "");
    else if (!strcmp(gv, "avx2"))
        row(rows, max, &k, "gemv (decode)", gv, "AVX2+FMA rows, weights streamed once (%s)%s",
            blocked(ANNEAL_ISA_AVX512, anneal_cpu_has_avx512(), "AVX-512", b1, sizeof b1), "");
    else
        row(rows, max, &k, "gemv (decode)", gv, "C rows (%s)%s",
            blocked(ANNEAL_ISA_AVX2, anneal_cpu_has_avx2(), "AVX2+FMA", b1, sizeof b1), "");
    /* attention: AVX-512 tile kernels, else AVX2 + FMA ones, else portable C */
    const int limit = anneal_cpu_isa_limit();
    const bool a512 = limit >= ANNEAL_ISA_AVX512 && anneal_cpu_has_avx512();
    const bool a2 = !a512 && limit >= ANNEAL_ISA_AVX2 && anneal_cpu_has_avx2();
    const char *attn = a512 ? "avx512" : a2 ? "avx2" : "portable";
    if (a512) row(rows, max, &k, "attention f32", attn, "AVX-512 tile kernels%s%s", "", "");
    else if (a2)
        row(rows, max, &k, "attention f32", attn, "AVX2+FMA tile kernels (%s)%s",
            blocked(ANNEAL_ISA_AVX512, anneal_cpu_has_avx512(), "AVX-512F", b1, sizeof b1), "");
    else
        row(rows, max, &k, "attention f32", attn, "compiler-vectorised C tiles (%s)%s",
            blocked(ANNEAL_ISA_AVX2, anneal_cpu_has_avx2(), "AVX2+FMA", b1, sizeof b1), "");
    if (anneal_cpu_bf16_dot_preferred())
        row(rows, max, &k, "attention bf16", "avx512bf16", "VDPBF16PS tile products%s%s", "", "");
    else
        row(rows, max, &k, "attention bf16", attn, "operands rounded to bf16 on the f32 tile kernels (%s)%s",
            bf16_dot_why(b2, sizeof b2), "");
    return k;
}

const char *anneal_cpu_model_name(char *buf, size_t n) {
    snprintf(buf, n, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return buf;
    char l[512];
    while (fgets(l, sizeof l, f)) {
        const char *c = strchr(l, ':');
        if (strncmp(l, "model name", 10) == 0 && c) {
            snprintf(buf, n, "%s", c[1] == ' ' ? c + 2 : c + 1);
            buf[strcspn(buf, "\n")] = 0;
            break;
        }
    }
    fclose(f);
    return buf;
}

void anneal_cpu_features_line(char *buf, size_t n) {
    __builtin_cpu_init();
    snprintf(buf, n,
             "avx2 %s, fma %s, avx512f %s, avx512bw %s, avx512vl %s, avx512vnni %s, avx512bf16 %s, avx512fp16 %s, "
             "amx-bf16/int8 %s",
             __builtin_cpu_supports("avx2") ? "yes" : "no", __builtin_cpu_supports("fma") ? "yes" : "no",
             __builtin_cpu_supports("avx512f") ? "yes" : "no", __builtin_cpu_supports("avx512bw") ? "yes" : "no",
             __builtin_cpu_supports("avx512vl") ? "yes" : "no", anneal_cpu_has_avx512vnni() ? "yes" : "no",
             anneal_cpu_has_avx512bf16() ? "yes" : "no",
#if defined(__GNUC__) && __GNUC__ >= 12
             __builtin_cpu_supports("avx512fp16") ? "yes" : "no",
#else
             "?",
#endif
             anneal_cpu_has_amx() ? "yes" : "no");
}

const char *anneal_cpu_isa_limit_name(const char **error) {
    const char *e = anneal_cpu_isa_env_error();
    if (error) *error = e;
    return e ? NULL : anneal_cpu_isa_level_name(anneal_cpu_isa_limit());
}
