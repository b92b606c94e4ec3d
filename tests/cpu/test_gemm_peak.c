/* Tests of anneal_peak_gflops_measure_dtype (src/obs/peak.c), the ceiling bench_gemm and
 * MFU quote GEMM speeds against: the right microbenchmark for each dtype, and sane figures.
 * No timing assertions beyond "a working loop": the bounds are orders of magnitude wide. */
#include "anneal/obs.h"
#include "cpu/gemm_internal.h"
#include "test.h"

/* bf16 uses the VDPBF16PS microbenchmark exactly when the CPU has AVX512-BF16, else the FMA
 * one (and says so); f32 and f16 always the FMA one, the same kernel as
 * anneal_peak_gflops_measure. Every figure is that of a working loop. */
TEST(peak_by_dtype) {
    const char *isa32 = NULL, *isa_plain = NULL, *isabf = NULL, *isa16 = NULL;
    const double g32 = anneal_peak_gflops_measure_dtype(1, 0.01, ANNEAL_F32, &isa32);
    const double gplain = anneal_peak_gflops_measure(1, 0.01, &isa_plain);
    const double gbf = anneal_peak_gflops_measure_dtype(1, 0.01, ANNEAL_BF16, &isabf);
    const double g16 = anneal_peak_gflops_measure_dtype(1, 0.01, ANNEAL_F16, &isa16);
    /* any working loop does far more than 0.1 GFLOP/s and far less than 10 TFLOP/s per thread */
    CHECK(g32 > 0.1 && g32 < 1e4, "f32 peak %g", g32);
    CHECK(gplain > 0.1 && gplain < 1e4, "peak %g", gplain);
    CHECK(gbf > 0.1 && gbf < 1e4, "bf16 peak %g", gbf);
    CHECK(g16 > 0.1 && g16 < 1e4, "f16 peak %g", g16);
    REQUIRE(isa32 && isa_plain && isabf && isa16);
    CHECK(strcmp(isa32, isa_plain) == 0 && strcmp(isa16, isa_plain) == 0, "%s / %s / %s", isa32,
          isa16, isa_plain);
    if (anneal_cpu_has_avx512bf16())
        CHECK(strcmp(isabf, "avx512bf16 dot-product") == 0, "bf16 kernel %s", isabf);
    else
        CHECK(strncmp(isabf, "no avx512bf16: ", 15) == 0, "bf16 kernel %s", isabf);
    /* A NULL isa is allowed, and threads <= 0 means all threads. */
    CHECK_TRUE(anneal_peak_gflops_measure_dtype(0, 0.005, ANNEAL_BF16, NULL) > 0.1);
}

int main(void) {
    RUN(peak_by_dtype);
    return anneal_test_summary();
}
