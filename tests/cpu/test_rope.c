/* Tests of the CPU rotary position embedding (src/cpu/rope.c, anneal_cpu_rope):
 * parity with PyTorch running transformers' Llama formulas (tests/fixtures/rope.safetensors,
 * written by tests/fixtures/gen_rope.py: default, linear and llama3 scaling, positions up
 * to 100000), forward then inverse returns the input, the inverse is the transpose
 * (adjoint identity), strided views, odd or empty shapes, and thread-count independence.
 *
 * Tolerance against PyTorch (u = 2^-24, x_i and its rotate_half partner x_p): both sides
 * compute the same float32 operations, so where they agree on inv_freq and on cos/sin the
 * result is bit-identical. What may differ: powf, cosf, sinf (glibc) against PyTorch's
 * SLEEF pow/cos/sin, each within 1 ulp of the true value, so within 2 ulps of each other
 * (2 ulps of a value <= 1 is <= 2u). Then
 *   cos/sin differ by <= 2u, the rotation's own roundings (one per product, one for the
 *   sum) by <= 2u (|x_i| + |x_p|) on each side:  |out - ref| <= 6u (|x_i| + |x_p|);
 *   where inv_freq differs (by <= 1 ulp, asserted: relative 2u), the angle a = pos *
 *   inv_freq moves by <= 4u |a| (the difference and the two roundings of the product), and
 *   cos/sin with it: + 4u |a| (|x_i| + |x_p|).
 * The test prints how many values came out bit-identical to PyTorch. */
#include "anneal/io.h"
#include "cpu/cpu_kernels.h"
#include "test.h"

#include <omp.h>

#define U24 5.9604644775390625e-08 /* 2^-24 */

static const char *FIXTURE = "tests/fixtures/rope.safetensors";

/* ------------------------------------------------------------------ helpers */

/* The F32 tensor `name` of st with n elements, or NULL (a failed check). */
static const float *fixture_f32(const anneal_safetensors *st, const char *name, int64_t n) {
    const anneal_st_entry *e = anneal_safetensors_find(st, name);
    CHECK(e != NULL, "fixture lacks %s", name);
    if (!e) return NULL;
    CHECK(e->dtype == ANNEAL_F32 && (int64_t)(e->end - e->begin) == n * 4,
          "%s: not %lld F32 values", name, (long long)n);
    if (e->dtype != ANNEAL_F32 || (int64_t)(e->end - e->begin) != n * 4) return NULL;
    return anneal_safetensors_data(st, e);
}

static double meta_num(const anneal_safetensors *st, int k, const char *key) {
    char name[64];
    snprintf(name, sizeof name, "c%d.%s", k, key);
    const char *v = anneal_safetensors_meta(st, name);
    CHECK(v != NULL, "fixture metadata lacks %s", name);
    return v ? atof(v) : 0.0;
}

/* A contiguous (B, H, T, D) descriptor. */
static anneal_cpu_rope_desc contiguous(int64_t B, int64_t H, int64_t T, int64_t D) {
    anneal_cpu_rope_desc d = {0};
    d.B = B, d.H = H, d.T = T, d.D = D;
    d.st = D, d.sh = T * D, d.sb = H * T * D;
    d.theta = 10000.0f;
    d.factor = 1.0f, d.low_freq_factor = 1.0f, d.high_freq_factor = 4.0f;
    d.original_max_pos = 8192;
    return d;
}

static float *copy_floats(const float *x, int64_t n) {
    float *y = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    memcpy(y, x, sizeof(float) * (size_t)n);
    return y;
}

/* Distance in ulps between two finite floats of the same sign (large when not). */
static int64_t ulps(float a, float b) {
    if (a == b) return 0;
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    if ((ia < 0) != (ib < 0)) return INT32_MAX;
    return ia > ib ? (int64_t)ia - ib : (int64_t)ib - ia;
}

/* Checks got against want (both (B, H, T, D) contiguous, from input x) within the bound of
 * the file comment; inv_same[i] says whether the two sides' inv_freq[i] agree, inv their
 * value. Returns the number of bit-identical values. */
static int64_t check_rotation(const char *what, const anneal_cpu_rope_desc *d, int64_t pos0,
                              const float *x, const float *got, const float *want,
                              const float *inv, const bool *inv_same) {
    const int64_t h = d->D / 2;
    int64_t exact = 0, bad = 0;
    for (int64_t r = 0; r < d->B * d->H; r++)
        for (int64_t t = 0; t < d->T; t++)
            for (int64_t i = 0; i < d->D; i++) {
                const int64_t at = (r * d->T + t) * d->D, pi = i < h ? i + h : i - h;
                const double xs = fabs((double)x[at + i]) + fabs((double)x[at + pi]);
                const double a = fabs((double)(pos0 + t) * inv[i % h]);
                const double tol = xs * (6 * U24 + (inv_same[i % h] ? 0.0 : 4 * U24 * a));
                const double e = fabs((double)got[at + i] - (double)want[at + i]);
                exact += got[at + i] == want[at + i];
                if (!(e <= tol) && bad++ == 0)
                    CHECK(e <= tol, "%s: t %lld dim %lld: %.9g vs PyTorch %.9g (bound %.3g)", what,
                          (long long)t, (long long)i, got[at + i], want[at + i], tol);
            }
    return exact;
}

/* ------------------------------------------------------------------- tests */

/* Each fixture case: inv_freq within 1 ulp, cos and sin (read back by rotating unit
 * vectors) within 2 ulps, the forward against apply_rotary_pos_emb and the inverse against
 * autograd's gradient within the bounds above. */
TEST(matches_pytorch) {
    anneal_safetensors *st = NULL;
    REQUIRE(anneal_safetensors_open(anneal_test_path(FIXTURE), &st) == ANNEAL_OK);
    const char *ncases = anneal_safetensors_meta(st, "cases");
    REQUIRE(ncases != NULL);
    const int n = atoi(ncases);
    CHECK(n >= 6, "only %d cases", n);
    int64_t total = 0, total_exact = 0;
    for (int k = 0; k < n; k++) {
        const int64_t B = (int64_t)meta_num(st, k, "B"), H = (int64_t)meta_num(st, k, "H");
        const int64_t T = (int64_t)meta_num(st, k, "T"), D = (int64_t)meta_num(st, k, "D");
        const int64_t pos0 = (int64_t)meta_num(st, k, "pos0"), h = D / 2, N = B * H * T * D;
        anneal_cpu_rope_desc d = contiguous(B, H, T, D);
        d.theta = (float)meta_num(st, k, "theta");
        char key[64];
        snprintf(key, sizeof key, "c%d.scaling", k);
        const char *sc = anneal_safetensors_meta(st, key);
        REQUIRE(sc != NULL);
        d.scaling = strcmp(sc, "linear") == 0   ? ANNEAL_CPU_ROPE_LINEAR
                    : strcmp(sc, "llama3") == 0 ? ANNEAL_CPU_ROPE_LLAMA3
                                                : ANNEAL_CPU_ROPE_NONE;
        d.factor = (float)meta_num(st, k, "factor");
        d.low_freq_factor = (float)meta_num(st, k, "low_freq_factor");
        d.high_freq_factor = (float)meta_num(st, k, "high_freq_factor");
        d.original_max_pos = (int64_t)meta_num(st, k, "original_max_pos");
        char nm[7][32];
        static const char *parts[7] = {"x", "out", "g", "grad", "inv_freq", "cos", "sin"};
        for (int p = 0; p < 7; p++) snprintf(nm[p], sizeof nm[p], "c%d.%s", k, parts[p]);
        const float *x = fixture_f32(st, nm[0], N), *out = fixture_f32(st, nm[1], N);
        const float *g = fixture_f32(st, nm[2], N), *grad = fixture_f32(st, nm[3], N);
        const float *inv_ref = fixture_f32(st, nm[4], h);
        const float *cos_ref = fixture_f32(st, nm[5], T * D), *sin_ref = fixture_f32(st, nm[6], T * D);
        if (!x || !out || !g || !grad || !inv_ref || !cos_ref || !sin_ref) break;

        /* inv_freq */
        float *inv = malloc(sizeof(float) * (size_t)h);
        bool *same = malloc(sizeof(bool) * (size_t)h);
        anneal_cpu_rope_inv_freq(&d, inv);
        int64_t inv_exact = 0;
        for (int64_t i = 0; i < h; i++) {
            CHECK(ulps(inv[i], inv_ref[i]) <= 1, "case %d: inv_freq[%lld] %.9g vs PyTorch %.9g", k,
                  (long long)i, inv[i], inv_ref[i]);
            same[i] = inv[i] == inv_ref[i];
            inv_exact += same[i];
        }
        /* cos, sin: unit vectors e_i at every position (B = H = 1) */
        anneal_cpu_rope_desc du = d;
        du.B = du.H = 1, du.sb = du.sh = T * D;
        float *e = calloc((size_t)(T * D), sizeof(float));
        int64_t cs_exact = 0;
        for (int64_t i = 0; i < h; i++) {
            memset(e, 0, sizeof(float) * (size_t)(T * D));
            for (int64_t t = 0; t < T; t++) e[t * D + i] = 1.0f;
            anneal_cpu_rope(&du, e, pos0, false);
            for (int64_t t = 0; t < T; t++) {
                const float c = e[t * D + i], s = e[t * D + i + h];
                const float cr = cos_ref[t * D + i], sr = sin_ref[t * D + i];
                CHECK(cos_ref[t * D + i + h] == cr && sin_ref[t * D + i + h] == sr,
                      "case %d: PyTorch's emb is cat(freqs, freqs)", k);
                if (same[i]) {
                    CHECK(ulps(c, cr) <= 2 && ulps(s, sr) <= 2,
                          "case %d t %lld pair %lld: cos %.9g sin %.9g vs PyTorch %.9g %.9g", k,
                          (long long)t, (long long)i, c, s, cr, sr);
                }
                cs_exact += (c == cr) + (s == sr);
            }
        }
        /* the forward and the inverse */
        float *y = copy_floats(x, N), *gi = copy_floats(g, N);
        anneal_cpu_rope(&d, y, pos0, false);
        anneal_cpu_rope(&d, gi, pos0, true);
        const int64_t fe = check_rotation("forward", &d, pos0, x, y, out, inv, same);
        const int64_t be = check_rotation("inverse vs autograd", &d, pos0, g, gi, grad, inv, same);
        printf("  case %d (%s, theta %g, D %lld, positions %lld..%lld): bit-identical to PyTorch: "
               "inv_freq %lld/%lld, cos+sin %lld/%lld, forward %lld/%lld, inverse %lld/%lld\n",
               k, sc, (double)d.theta, (long long)D, (long long)pos0, (long long)(pos0 + T - 1),
               (long long)inv_exact, (long long)h, (long long)cs_exact, (long long)(2 * T * h),
               (long long)fe, (long long)N, (long long)be, (long long)N);
        total += 2 * N, total_exact += fe + be;
        free(inv), free(same), free(e), free(y), free(gi);
    }
    printf("  %lld of %lld rotated values bit-identical to PyTorch\n", (long long)total_exact,
           (long long)total);
    anneal_safetensors_close(st);
}

/* Negative control for the fixture test's pairing and sign: the forward is not the
 * inverse, and adjacent-pair (GPT-J style) rotation would not match: rotating (1, 0, .., 0)
 * moves its value to dim D/2, not dim 1. */
TEST(rotate_half_pairing) {
    anneal_cpu_rope_desc d = contiguous(1, 1, 1, 8);
    float x[8] = {1, 0, 0, 0, 0, 0, 0, 0}, y[8];
    anneal_cpu_rope(&d, x, 1, false);
    CHECK(x[1] == 0.0f && x[4] == sinf(1.0f) && x[0] == cosf(1.0f),
          "x = e_0 at position 1: got %g %g .. %g", x[0], x[1], x[4]);
    memcpy(y, x, sizeof y);
    anneal_cpu_rope(&d, x, 1, false);
    anneal_cpu_rope(&d, y, 1, true);
    CHECK(fabsf(x[0] - cosf(2.0f)) < 1e-6f && fabsf(y[0] - 1.0f) < 1e-6f && fabsf(y[4]) < 1e-6f,
          "two forwards rotate by 2, forward + inverse by 0: %g %g %g", x[0], y[0], y[4]);
}

/* Random data on every scaling: forward then inverse gives x back to a few ulps (the
 * rotation by c, s then by c, -s is (c^2 + s^2) x plus 6 roundings: |x' - x| <=
 * 10u (|x_i| + |x_p|)); and the inverse is the transpose: <rope(x), y> = <x, rope^-1(y)>
 * (same c and s on both sides, so only the f32 rounding of the outputs separates them:
 * relative 1e-6 of sum |terms| is far above it and far below any wrong sign or pairing). */
TEST(roundtrip_and_adjoint) {
    anneal_test_rng_state = 77;
    static const int64_t shapes[][5] = {{2, 3, 17, 64, 0}, {1, 2, 9, 128, 8100}, {3, 1, 5, 6, 99999}};
    for (int sh = 0; sh < 3; sh++)
        for (int scaling = 0; scaling < 3; scaling++) {
            const int64_t B = shapes[sh][0], H = shapes[sh][1], T = shapes[sh][2], D = shapes[sh][3];
            const int64_t pos0 = shapes[sh][4], N = B * H * T * D, h = D / 2;
            anneal_cpu_rope_desc d = contiguous(B, H, T, D);
            d.scaling = scaling;
            d.theta = scaling == ANNEAL_CPU_ROPE_LLAMA3 ? 500000.0f : 10000.0f;
            d.factor = scaling == ANNEAL_CPU_ROPE_LINEAR ? 4.0f : 8.0f;
            float *x = anneal_test_rand_buf(N, -2.0f, 2.0f), *y = anneal_test_rand_buf(N, -1.0f, 1.0f);
            float *rx = copy_floats(x, N), *ry = copy_floats(y, N), *back = copy_floats(x, N);
            anneal_cpu_rope(&d, rx, pos0, false);
            anneal_cpu_rope(&d, ry, pos0, true);
            anneal_cpu_rope(&d, back, pos0, false);
            anneal_cpu_rope(&d, back, pos0, true);
            double worst = 0, lhs = 0, rhs = 0, mag = 0;
            int64_t moved = 0;
            for (int64_t r = 0; r < N / D; r++)
                for (int64_t i = 0; i < D; i++) {
                    const int64_t k = r * D + i, p = r * D + (i < h ? i + h : i - h);
                    const double tol = 10 * U24 * (fabs((double)x[k]) + fabs((double)x[p]));
                    const double e = fabs((double)back[k] - x[k]) / tol;
                    if (!(e <= worst)) worst = e;
                    lhs += (double)rx[k] * y[k];
                    rhs += (double)x[k] * ry[k];
                    mag += fabs((double)rx[k] * y[k]);
                    moved += rx[k] != x[k];
                }
            CHECK(worst <= 1.0, "shape %d scaling %d: forward + inverse off by %.3g of the bound",
                  sh, scaling, worst);
            CHECK(fabs(lhs - rhs) <= 1e-6 * mag,
                  "shape %d scaling %d: <rope x, y> %.12g vs <x, rope^-1 y> %.12g", sh, scaling, lhs,
                  rhs);
            CHECK(moved > N / 2, "shape %d scaling %d: the rotation left %lld of %lld values", sh,
                  scaling, (long long)(N - moved), (long long)N);
            free(x), free(y), free(rx), free(ry), free(back);
        }
}

/* A strided view (q of a fused (B, T, 3, H, D + 2) buffer) gives the bits of the same
 * rotation on a contiguous copy and writes nothing outside the view. */
TEST(strided_view) {
    anneal_test_rng_state = 5;
    const int64_t B = 2, T = 11, H = 3, D = 32, P = D + 2;
    const int64_t n = B * T * 3 * H * P;
    float *buf = anneal_test_rand_buf(n, -1.0f, 1.0f), *orig = copy_floats(buf, n);
    anneal_cpu_rope_desc v = contiguous(B, H, T, D), c = contiguous(B, H, T, D);
    v.st = 3 * H * P, v.sh = P, v.sb = T * 3 * H * P;
    v.scaling = c.scaling = ANNEAL_CPU_ROPE_LLAMA3;
    v.theta = c.theta = 500000.0f;
    v.factor = c.factor = 8.0f;
    float *x = malloc(sizeof(float) * (size_t)(B * H * T * D));
    for (int64_t b = 0; b < B; b++)
        for (int64_t hh = 0; hh < H; hh++)
            for (int64_t t = 0; t < T; t++)
                memcpy(x + ((b * H + hh) * T + t) * D, buf + b * v.sb + hh * v.sh + t * v.st,
                       sizeof(float) * (size_t)D);
    for (int inverse = 0; inverse < 2; inverse++) {
        anneal_cpu_rope(&v, buf, 4321, inverse);
        anneal_cpu_rope(&c, x, 4321, inverse);
    }
    anneal_cpu_rope(&v, buf, 17, false);
    anneal_cpu_rope(&c, x, 17, false);
    char *in_view = calloc((size_t)n, 1);
    int64_t diff = 0, outside = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t hh = 0; hh < H; hh++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < D; i++) {
                    const int64_t at = b * v.sb + hh * v.sh + t * v.st + i;
                    in_view[at] = 1;
                    diff += buf[at] != x[((b * H + hh) * T + t) * D + i];
                }
    for (int64_t i = 0; i < n; i++) outside += !in_view[i] && buf[i] != orig[i];
    CHECK(diff == 0, "%lld values of the strided view differ from the contiguous run", (long long)diff);
    CHECK(outside == 0, "%lld values outside the view changed", (long long)outside);
    free(buf), free(orig), free(x), free(in_view);
}

/* Nothing happens for T == 0 or an odd D (the op rejects those; the kernel must not
 * write), and D == 2 (one pair) works. */
TEST(degenerate_shapes) {
    float x[6] = {1, 2, 3, 4, 5, 6};
    anneal_cpu_rope_desc d = contiguous(1, 1, 2, 3);
    anneal_cpu_rope(&d, x, 5, false);
    CHECK(x[0] == 1 && x[5] == 6, "odd D wrote");
    d = contiguous(1, 1, 0, 6);
    anneal_cpu_rope(&d, x, 5, false);
    CHECK(x[0] == 1 && x[5] == 6, "T = 0 wrote");
    d = contiguous(1, 1, 3, 2);
    anneal_cpu_rope(&d, x, 0, false);
    CHECK(x[0] == 1 && x[1] == 2, "position 0 must be the identity");
    CHECK(x[2] == 3 * cosf(1.0f) - 4 * sinf(1.0f) && x[3] == 4 * cosf(1.0f) + 3 * sinf(1.0f),
          "D = 2 at position 1: %g %g", x[2], x[3]);
}

/* 1, 2 and 3 threads (and repeated runs) give the same bits, for a shape large enough
 * to run in parallel, forward and inverse, with more pairs than one work item takes. */
TEST(thread_count_independence) {
    anneal_test_rng_state = 9;
    const int64_t B = 2, H = 4, T = 40, D = 256, N = B * H * T * D;
    anneal_cpu_rope_desc d = contiguous(B, H, T, D);
    d.scaling = ANNEAL_CPU_ROPE_LLAMA3;
    d.theta = 500000.0f, d.factor = 8.0f;
    float *x = anneal_test_rand_buf(N, -1.0f, 1.0f), *ref = NULL;
    const int saved = omp_get_max_threads();
    static const int threads[] = {2, 1, 3, 2};
    for (int r = 0; r < 4; r++) {
        omp_set_num_threads(threads[r]);
        float *y = copy_floats(x, N);
        anneal_cpu_rope(&d, y, 1234, false);
        anneal_cpu_rope(&d, y, 77, true);
        if (!ref) {
            ref = y;
            continue;
        }
        CHECK(memcmp(ref, y, sizeof(float) * (size_t)N) == 0, "%d threads differ", threads[r]);
        free(y);
    }
    omp_set_num_threads(saved);
    free(x), free(ref);
}

int main(void) {
    RUN(matches_pytorch);
    RUN(rotate_half_pairing);
    RUN(roundtrip_and_adjoint);
    RUN(strided_view);
    RUN(degenerate_shapes);
    RUN(thread_count_independence);
    return anneal_test_summary();
}
