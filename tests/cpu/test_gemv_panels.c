/* The bf16 panel GEMM (anneal_gemv on .bf16_panels weights, src/cpu/gemv_panels.c):
 * the packing's layout, results against a double-precision reference on shapes whose in
 * and out are not multiples of 8 or 16, and bit-identity: a row of an n-row call equals
 * the row alone, 1 thread equals 2, the portable path and AVX2 equal the default (AVX-512
 * from 3 rows where the CPU has it), bias and GELU included.
 *
 * The bound: each output is one f32 FMA chain over the `in` products (then the bias added
 * once), so against the exact sum of the same products (bf16 weights widened exactly)
 * its error is within the recursive-summation bound (in + 1) * 2^-24 * (sum_k |x_k w_k| +
 * |b|) (we check (in + 2) for the rounding of the reference's own double sum). */
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

/* A random (out, in) f32 weight, its panels, x (n, in) and a bias. */
typedef struct problem {
    int64_t in, out, n;
    float *wf, *x, *b;
    uint16_t *wp;
} problem;

static problem make(int64_t in, int64_t out, int64_t n, uint64_t seed) {
    problem p = {.in = in, .out = out, .n = n};
    uint64_t s = seed;
    p.wf = malloc(sizeof(float) * (size_t)(in * out));
    p.x = malloc(sizeof(float) * (size_t)(n * in));
    p.b = malloc(sizeof(float) * (size_t)out);
    p.wp = aligned_alloc(64, ((size_t)anneal_gemv_panels_bf16_len(in, out) * 2 + 63) & ~(size_t)63);
    for (int64_t i = 0; i < in * out; i++) p.wf[i] = frand(&s);
    for (int64_t i = 0; i < n * in; i++) p.x[i] = frand(&s);
    for (int64_t j = 0; j < out; j++) p.b[j] = frand(&s);
    anneal_gemv_pack_panels_bf16(p.wf, true, in, out, p.wp);
    return p;
}

static void drop(problem *p) { free(p->wf), free(p->x), free(p->b), free(p->wp); }

static anneal_gemv_weight weight(const problem *p, bool bias) {
    return (anneal_gemv_weight){.w = p->wp, .dtype = ANNEAL_BF16, .in = p->in, .out = p->out,
                                .bias = bias ? p->b : NULL, .bf16_panels = true};
}

static void set_isa(const char *isa) {
    if (isa)
        setenv("ANNEAL_CPU_ISA", isa, 1);
    else
        unsetenv("ANNEAL_CPU_ISA");
}

/* Packing: W[j, k] rounded to bf16 at panel j / 16, step k, lane_pos(j % 16); padded
 * columns zero; an (in, out) source packs to the same bytes as its (out, in) transpose. */
TEST(panels_pack_layout) {
    const int64_t shapes[][2] = {{1, 1}, {7, 15}, {33, 17}, {5, 40}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t in = shapes[si][0], out = shapes[si][1], len = anneal_gemv_panels_bf16_len(in, out);
        CHECK(len == (out + 15) / 16 * 16 * in, "len %lld", (long long)len);
        problem p = make(in, out, 1, 3 + si);
        /* rounding: NaN (quieted), infinity, a tie to even (1 + 2^-8 -> 1), one rounding up */
        const float special[] = {NAN, INFINITY, 1.00390625f, 1.01171875f};
        for (int i = 0; i < 4 && i < in * out; i++) p.wf[i * 7 % (in * out)] = special[i];
        anneal_gemv_pack_panels_bf16(p.wf, true, in, out, p.wp);
        float *t = malloc(sizeof(float) * (size_t)(in * out));
        uint16_t *q = malloc(sizeof(uint16_t) * (size_t)len);
        for (int64_t j = 0; j < out; j++)
            for (int64_t k = 0; k < in; k++) t[k * out + j] = p.wf[j * in + k];
        anneal_gemv_pack_panels_bf16(t, false, in, out, q);
        CHECK(memcmp(q, p.wp, sizeof(uint16_t) * (size_t)len) == 0, "in_out and out_in packs differ (%lld x %lld)",
              (long long)in, (long long)out);
        bool ok = true;
        for (int64_t j = 0; j < (out + 15) / 16 * 16 && ok; j++)
            for (int64_t k = 0; k < in && ok; k++) {
                const int c = (int)(j % 16), pos = c < 8 ? 2 * c : 2 * (c - 8) + 1;
                const uint16_t got = p.wp[j / 16 * 16 * in + k * 16 + pos];
                const uint16_t want = j < out ? anneal_f32_to_bf16(p.wf[j * in + k]) : 0;
                ok = got == want;
                CHECK(ok, "W[%lld, %lld] packed as %04x, want %04x", (long long)j, (long long)k, got, want);
            }
        free(t), free(q);
        drop(&p);
    }
}

/* Against the double-precision sum of the same products, with and without bias. */
TEST(panels_match_exact_sum) {
    const int64_t ins[] = {1, 7, 33, 200, 770}, outs[] = {1, 15, 17, 100, 2305};
    const int64_t rows[] = {1, 2, 3, 5, 6, 7, 13, 33, 130};
    uint64_t seed = 11;
    anneal_set_num_threads(2);
    for (size_t ii = 0; ii < 5; ii++)
        for (size_t oi = 0; oi < 5; oi++)
            for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
                const int64_t in = ins[ii], out = outs[oi], n = rows[ri];
                if (in * out * n > 40000000) continue; /* the reference's time */
                problem p = make(in, out, n, seed++);
                const bool bias = (ii + oi + ri) % 2 == 0;
                anneal_gemv_weight w = weight(&p, bias);
                float *y = malloc(sizeof(float) * (size_t)(n * out));
                CHECK(anneal_gemv(&w, p.x, in, n, y, out, ANNEAL_GEMV_NONE), "gemv failed");
                bool ok = true;
                for (int64_t r = 0; r < n && ok; r++)
                    for (int64_t j = 0; j < out && ok; j++) {
                        double ref = bias ? p.b[j] : 0.0, mag = bias ? fabs(p.b[j]) : 0.0;
                        for (int64_t k = 0; k < in; k++) {
                            double t = (double)p.x[r * in + k] * anneal_bf16_to_f32(anneal_f32_to_bf16(p.wf[j * in + k]));
                            ref += t;
                            mag += fabs(t);
                        }
                        const double bound = (double)(in + 2) * ldexp(1.0, -24) * mag;
                        ok = fabs(y[r * out + j] - ref) <= bound;
                        CHECK(ok, "in %lld out %lld n %lld: y[%lld, %lld] %.9g, exact %.9g (bound %.3g)", (long long)in,
                              (long long)out, (long long)n, (long long)r, (long long)j, y[r * out + j], ref, bound);
                    }
                free(y);
                drop(&p);
                if (!ok) return;
            }
}

/* Row r of an n-row call equals the 1-row call on that row; 2 threads equal 1; on x86
 * the portable path equals AVX2: bit for bit, with bias and GELU. */
TEST(panels_bitwise_rows_threads_paths) {
    const int64_t shapes[][2] = {{7, 17}, {33, 100}, {200, 15}, {770, 2305}, {1, 33}, {64, 48}};
    int64_t rows[40];
    int nrows = 0;
    for (int64_t n = 1; n <= 33; n++) rows[nrows++] = n;
    rows[nrows++] = 64, rows[nrows++] = 100, rows[nrows++] = 130;
    uint64_t seed = 101;
    const bool x86 = strcmp(anneal_gemv_path_name(), "portable") != 0;
    if (!x86) anneal_test_skip("no AVX2 here: portable vs AVX2 not compared (rows and threads still are)");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int ri = 0; ri < nrows; ri++) {
            const int64_t in = shapes[si][0], out = shapes[si][1], n = rows[ri];
            if (si == 3 && n % 8 != 1 && n != 130 && n != 16 && n != 64) continue; /* the big shape: some n */
            problem p = make(in, out, n, seed++);
            const int act = (si + (size_t)n) % 3 == 0 ? ANNEAL_GEMV_GELU_TANH : ANNEAL_GEMV_NONE;
            anneal_gemv_weight w = weight(&p, (si + (size_t)n) % 2 == 0);
            const size_t bytes = sizeof(float) * (size_t)(n * out);
            float *y2 = malloc(bytes), *y1 = malloc(bytes), *yp = malloc(bytes), *yr = malloc(sizeof(float) * (size_t)out);
            set_isa(NULL);
            anneal_set_num_threads(2);
            anneal_gemv(&w, p.x, in, n, y2, out, act);
            anneal_set_num_threads(1);
            anneal_gemv(&w, p.x, in, n, y1, out, act);
            anneal_set_num_threads(2);
            CHECK(memcmp(y1, y2, bytes) == 0, "1 vs 2 threads differ: in %lld out %lld n %lld", (long long)in,
                  (long long)out, (long long)n);
            bool same = true;
            for (int64_t r = 0; r < n && same; r++) {
                anneal_gemv(&w, p.x + r * in, in, 1, yr, out, act);
                same = memcmp(yr, y2 + r * out, sizeof(float) * (size_t)out) == 0;
                CHECK(same, "row %lld alone vs in %lld rows differ: in %lld out %lld", (long long)r, (long long)n,
                      (long long)in, (long long)out);
            }
            if (x86) { /* AVX2 forced against the default (AVX-512 from 3 rows where the CPU has it) */
                set_isa("avx2");
                anneal_gemv(&w, p.x, in, n, yp, out, act);
                set_isa(NULL);
                CHECK(memcmp(yp, y2, bytes) == 0, "avx2 vs the default path differ: in %lld out %lld n %lld",
                      (long long)in, (long long)out, (long long)n);
            }
            if (x86 && (si != 3 || n <= 17)) { /* the portable loop is slow: the big shape for a few n */
                set_isa("portable");
                anneal_gemv(&w, p.x, in, n, yp, out, act);
                set_isa(NULL);
                CHECK(memcmp(yp, y2, bytes) == 0, "portable vs avx2 differ: in %lld out %lld n %lld", (long long)in,
                      (long long)out, (long long)n);
            }
            free(y2), free(y1), free(yp), free(yr);
            drop(&p);
        }
}

/* The GELU epilogue is the tanh GELU of the plain result (plus bias). */
TEST(panels_bias_gelu) {
    problem p = make(40, 70, 9, 5);
    anneal_gemv_weight w = weight(&p, true);
    float y[9 * 70], g[9 * 70];
    anneal_gemv(&w, p.x, 40, 9, y, 70, ANNEAL_GEMV_NONE);
    anneal_gemv(&w, p.x, 40, 9, g, 70, ANNEAL_GEMV_GELU_TANH);
    anneal_gemv_weight wn = weight(&p, false);
    float z[9 * 70];
    anneal_gemv(&wn, p.x, 40, 9, z, 70, ANNEAL_GEMV_NONE);
    for (int i = 0; i < 9 * 70; i++) {
        double v = y[i], want = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
        CHECK(fabs(g[i] - want) <= 1e-6 * (1.0 + fabs(want)), "gelu at %d: %g vs %g", i, g[i], want);
        CHECK(y[i] == z[i] + p.b[i % 70], "bias at %d: %.9g vs %.9g + %.9g", i, y[i], z[i], p.b[i % 70]);
    }
    drop(&p);
}

int main(void) {
    RUN(panels_pack_layout);
    RUN(panels_match_exact_sum);
    RUN(panels_bitwise_rows_threads_paths);
    RUN(panels_bias_gelu);
    return anneal_test_summary();
}
