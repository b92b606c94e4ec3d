/* The decode GEMV (decode_kernels.h) against a double-precision reference and against
 * the GEMM of anneal_dense: both layouts, f32 and bf16 weights, 1..16 rows, sizes with
 * tails, bias and the GELU epilogue; results independent of the thread count.
 *
 * The bound: each output is one f32 sum of `in` products (fused multiply-adds; the
 * (out, in) kernel in 16 partial sums added at the end), so against the exact sum of
 * the same products its error is within the recursive-summation bound
 * (in + 16) * 2^-24 * sum_k |x_k w_k| (+ one rounding of the bias add). The GEMM sums in
 * another order within the same bound, so the two differ by at most twice that. */
#include "anneal/anneal.h"
#include "anneal/decode_kernels.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((double)(*s >> 40) / (double)(1ULL << 24) * 2.0 - 1.0);
}

/* Checks anneal_gemv on one shape; returns false after reporting a failure. */
static bool check_shape(int64_t in, int64_t out, int64_t n, bool out_in, bool bf16, bool bias, uint64_t seed) {
    uint64_t s = seed;
    float *x = malloc(sizeof(float) * (size_t)(n * in)), *wf = malloc(sizeof(float) * (size_t)(in * out));
    uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)(in * out));
    float *b = malloc(sizeof(float) * (size_t)out), *y = malloc(sizeof(float) * (size_t)(n * out));
    float *y1 = malloc(sizeof(float) * (size_t)(n * out));
    if (!x || !wf || !wb || !b || !y || !y1) {
        anneal_test_fail(__FILE__, __LINE__, "out of memory");
        return false;
    }
    for (int64_t i = 0; i < n * in; i++) x[i] = frand(&s);
    for (int64_t i = 0; i < in * out; i++) {
        wf[i] = frand(&s);
        wb[i] = anneal_f32_to_bf16(wf[i]);
        if (bf16) wf[i] = anneal_bf16_to_f32(wb[i]); /* the values the kernel reads */
    }
    for (int64_t j = 0; j < out; j++) b[j] = frand(&s);
    anneal_gemv_weight w = {.w = bf16 ? (const void *)wb : (const void *)wf, .dtype = bf16 ? ANNEAL_BF16 : ANNEAL_F32,
                            .out_in = out_in, .in = in, .out = out, .bias = bias ? b : NULL};
    anneal_set_num_threads(2);
    anneal_gemv(&w, x, in, n, y, out, ANNEAL_GEMV_NONE);
    anneal_set_num_threads(1);
    anneal_gemv(&w, x, in, n, y1, out, ANNEAL_GEMV_NONE);
    anneal_set_num_threads(2);
    bool ok = true;
    if (memcmp(y, y1, sizeof(float) * (size_t)(n * out))) {
        anneal_test_fail(__FILE__, __LINE__, "in %lld out %lld n %lld: 1 and 2 threads differ", (long long)in,
                         (long long)out, (long long)n);
        ok = false;
    }
    /* the GEMM of the tensor path on the same (widened) weights */
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *xt = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){n, in}, x);
    anneal_tensor *wt = anneal_from_data(ANNEAL_F32, 2, out_in ? (int64_t[]){out, in} : (int64_t[]){in, out}, wf);
    anneal_tensor *bt = bias ? anneal_from_data(ANNEAL_F32, 1, (int64_t[]){out}, b) : NULL;
    anneal_dense_opts o = {.layout = out_in ? ANNEAL_WEIGHT_OUT_IN : ANNEAL_WEIGHT_IN_OUT};
    anneal_tensor *g = anneal_dense(xt, wt, bt, &o);
    const float *G = g ? anneal_data(g) : NULL;
    if (!G) ok = false;
    for (int64_t r = 0; r < n && ok; r++)
        for (int64_t j = 0; j < out && ok; j++) {
            double ref = bias ? b[j] : 0.0, mag = bias ? fabs(b[j]) : 0.0;
            for (int64_t k = 0; k < in; k++) {
                double wv = out_in ? wf[j * in + k] : wf[k * out + j];
                ref += (double)x[r * in + k] * wv;
                mag += fabs((double)x[r * in + k] * wv);
            }
            double bound = (double)(in + 17) * ldexp(1.0, -24) * mag;
            double e = fabs(y[r * out + j] - ref), eg = fabs(y[r * out + j] - G[r * out + j]);
            if (e > bound || eg > 2 * bound) {
                anneal_test_fail(__FILE__, __LINE__,
                                 "in %lld out %lld n %lld %s %s: y[%lld,%lld] %.9g, exact %.9g (bound %.3g), GEMM %.9g",
                                 (long long)in, (long long)out, (long long)n, out_in ? "out_in" : "in_out",
                                 bf16 ? "bf16" : "f32", (long long)r, (long long)j, y[r * out + j], ref, bound,
                                 G[r * out + j]);
                ok = false;
            }
        }
    anneal_scope_close(sc);
    free(x), free(wf), free(wb), free(b), free(y), free(y1);
    return ok;
}

TEST(gemv_matches_exact_sum_and_gemm) {
    anneal_clear_error();
    const int64_t shapes[][2] = {{64, 64}, {77, 133}, {768, 197}, {5, 3}, {130, 64 * 3 + 5}, {33, 1}};
    const int64_t rows[] = {1, 2, 3, 4, 5, 16};
    uint64_t seed = 1;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++)
            for (int layout = 0; layout < 2; layout++)
                for (int bf = 0; bf < 2; bf++)
                    if (!check_shape(shapes[si][0], shapes[si][1], rows[ri], layout, bf, (si + ri) % 2 == 0, seed++))
                        return;
}

/* Every x86 path (AVX-512, AVX2, and scalar for W (in, out)) gives the same bits:
 * ANNEAL_CPU_ISA forces the lower ones. A path the CPU lacks is skipped, saying so. */
TEST(gemv_paths_agree_bitwise) {
    const char *best = anneal_gemv_path_name();
    if (strcmp(best, "portable") == 0) {
        anneal_test_skip("this CPU has neither AVX2 nor AVX-512: one path only");
        return;
    }
    /* {40, 4100}: W (in, out) ranges past one strip of columns (4096 / n, 1024 from n = 4) */
    const int64_t shapes[][2] = {{64, 64}, {77, 133}, {768, 197}, {5, 3}, {130, 64 * 3 + 5}, {33, 1}, {23, 9}, {40, 4100}};
    uint64_t s = 77;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int64_t n = 1; n <= 5; n += 2)
            for (int layout = 0; layout < 2; layout++)
                for (int bf = 0; bf < 2; bf++) {
                    int64_t in = shapes[si][0], out = shapes[si][1];
                    float *x = malloc(sizeof(float) * (size_t)(n * in)), *wf = malloc(sizeof(float) * (size_t)(in * out));
                    uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)(in * out));
                    float *b = malloc(sizeof(float) * (size_t)out), *y[3];
                    for (int p = 0; p < 3; p++) y[p] = malloc(sizeof(float) * (size_t)(n * out));
                    for (int64_t i = 0; i < n * in; i++) x[i] = frand(&s);
                    for (int64_t i = 0; i < in * out; i++) wf[i] = frand(&s), wb[i] = anneal_f32_to_bf16(wf[i]);
                    for (int64_t j = 0; j < out; j++) b[j] = frand(&s);
                    anneal_gemv_weight w = {.w = bf ? (const void *)wb : (const void *)wf,
                                            .dtype = bf ? ANNEAL_BF16 : ANNEAL_F32, .out_in = layout, .in = in,
                                            .out = out, .bias = (si + (size_t)n) % 2 ? b : NULL};
                    const char *isa[3] = {NULL, "avx2", "portable"};
                    for (int p = 0; p < 3; p++) {
                        if (isa[p]) setenv("ANNEAL_CPU_ISA", isa[p], 1); else unsetenv("ANNEAL_CPU_ISA");
                        anneal_gemv(&w, x, in, n, y[p], out, ANNEAL_GEMV_NONE);
                    }
                    unsetenv("ANNEAL_CPU_ISA");
                    size_t bytes = sizeof(float) * (size_t)(n * out);
                    CHECK(memcmp(y[0], y[1], bytes) == 0, "%s vs avx2 differ: in %lld out %lld n %lld %s %s", best,
                          (long long)in, (long long)out, (long long)n, layout ? "out_in" : "in_out", bf ? "bf16" : "f32");
                    if (!layout) /* the scalar loop sums W (out, in) in plain k order */
                        CHECK(memcmp(y[0], y[2], bytes) == 0, "%s vs portable differ: in %lld out %lld n %lld %s", best,
                              (long long)in, (long long)out, (long long)n, bf ? "bf16" : "f32");
                    free(x), free(wf), free(wb), free(b);
                    for (int p = 0; p < 3; p++) free(y[p]);
                }
}

/* W (out, in): the many-row tiles (AVX2 from 2 rows), the one-row kernel and bf16 weights
 * in pair order (anneal_gemv_pair_bf16) all compute each output in the same order: for
 * rows 1..33 and shapes whose K and N are not multiples of 8 or 16, each row of an n-row
 * product equals that row computed alone, and paired bf16 equals plain bf16, bit for bit,
 * on every x86 path (the portable loop: paired vs plain). */
TEST(gemv_rows_and_pairs_agree_bitwise) {
    const int64_t shapes[][2] = {{77, 133}, {768, 50}, {16, 7}, {15, 9}, {31, 3}, {40, 1}, {100, 37}, {8, 16}};
    const char *isa[3] = {NULL, "avx2", "portable"};
    uint64_t s = 91;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int64_t n = 1; n <= 33; n += (si % 2 ? 1 : 4)) {
            const int64_t in = shapes[si][0], out = shapes[si][1];
            float *x = malloc(sizeof(float) * (size_t)(n * in)), *wf = malloc(sizeof(float) * (size_t)(in * out));
            uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)(in * out)), *wp = malloc(sizeof(uint16_t) * (size_t)(in * out));
            float *b = malloc(sizeof(float) * (size_t)out), *y = malloc(sizeof(float) * (size_t)(n * out));
            float *yp = malloc(sizeof(float) * (size_t)(n * out)), *y1 = malloc(sizeof(float) * (size_t)out);
            for (int64_t i = 0; i < n * in; i++) x[i] = frand(&s);
            for (int64_t i = 0; i < in * out; i++) wf[i] = frand(&s), wb[i] = wp[i] = anneal_f32_to_bf16(wf[i]);
            for (int64_t j = 0; j < out; j++) b[j] = frand(&s);
            anneal_gemv_pair_bf16(wp, out, in);
            for (int p = 0; p < 3; p++) {
                if (isa[p]) setenv("ANNEAL_CPU_ISA", isa[p], 1); else unsetenv("ANNEAL_CPU_ISA");
                for (int bf = 0; bf < 2; bf++) {
                    anneal_gemv_weight w = {.w = bf ? (const void *)wb : (const void *)wf,
                                            .dtype = bf ? ANNEAL_BF16 : ANNEAL_F32, .out_in = true, .in = in,
                                            .out = out, .bias = (n + (int64_t)si) % 2 ? b : NULL};
                    anneal_gemv(&w, x, in, n, y, out, ANNEAL_GEMV_NONE);
                    bool same = true;
                    for (int64_t r = 0; r < n && same; r++) {
                        anneal_gemv(&w, x + r * in, in, 1, y1, out, ANNEAL_GEMV_NONE);
                        same = memcmp(y1, y + r * out, sizeof(float) * (size_t)out) == 0;
                    }
                    CHECK(same, "%s: row alone vs in %lld rows differ: in %lld out %lld %s", isa[p] ? isa[p] : "best",
                          (long long)n, (long long)in, (long long)out, bf ? "bf16" : "f32");
                    if (!bf) continue;
                    anneal_gemv_weight wq = w;
                    wq.w = wp;
                    wq.bf16_pairs = true;
                    anneal_gemv(&wq, x, in, n, yp, out, ANNEAL_GEMV_NONE);
                    CHECK(memcmp(y, yp, sizeof(float) * (size_t)(n * out)) == 0,
                          "%s: paired vs plain bf16 differ: in %lld out %lld n %lld", isa[p] ? isa[p] : "best",
                          (long long)in, (long long)out, (long long)n);
                }
            }
            unsetenv("ANNEAL_CPU_ISA");
            free(x), free(wf), free(wb), free(wp), free(b), free(y), free(yp), free(y1);
        }
}

/* The GELU epilogue is the tanh GELU of the plain result. */
TEST(gemv_gelu_epilogue) {
    enum { IN = 40, OUT = 70, N = 3 };
    uint64_t s = 5;
    float x[N * IN], w[IN * OUT], y[N * OUT], g[N * OUT];
    for (int i = 0; i < N * IN; i++) x[i] = frand(&s);
    for (int i = 0; i < IN * OUT; i++) w[i] = frand(&s);
    anneal_gemv_weight wt = {.w = w, .dtype = ANNEAL_F32, .out_in = false, .in = IN, .out = OUT};
    anneal_gemv(&wt, x, IN, N, y, OUT, ANNEAL_GEMV_NONE);
    anneal_gemv(&wt, x, IN, N, g, OUT, ANNEAL_GEMV_GELU_TANH);
    for (int i = 0; i < N * OUT; i++) {
        double v = y[i], want = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
        CHECK(fabs(g[i] - want) <= 1e-6 * (1.0 + fabs(want)), "gelu at %d: %g vs %g", i, g[i], want);
    }
}

/* int8 rows: scale = max|x| / 127, |x - q scale| <= scale / 2, zero rows give zero. */
TEST(int8_row_quantization) {
    float x[64], z[8] = {0};
    int8_t q[64];
    float sc;
    uint64_t s = 9;
    for (int i = 0; i < 64; i++) x[i] = frand(&s) * 3.0f;
    anneal_kv_quantize_row_i8(x, 64, q, &sc);
    float mx = 0;
    for (int i = 0; i < 64; i++) mx = fmaxf(mx, fabsf(x[i]));
    CHECK_NEAR(sc, mx / 127.0f, 1e-9);
    for (int i = 0; i < 64; i++) CHECK(fabsf(x[i] - q[i] * sc) <= sc * 0.5f * 1.0001f, "row value %d", i);
    anneal_kv_quantize_row_i8(z, 8, q, &sc);
    CHECK(sc == 0.0f && q[0] == 0 && q[7] == 0, "zero row");
}

int main(void) {
    RUN(gemv_matches_exact_sum_and_gemm);
    RUN(gemv_paths_agree_bitwise);
    RUN(gemv_rows_and_pairs_agree_bitwise);
    RUN(gemv_gelu_epilogue);
    RUN(int8_row_quantization);
    return anneal_test_summary();
}
