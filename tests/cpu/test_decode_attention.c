/* The decode attention kernels (decode_kernels.h's anneal_decode_attention) against a
 * double-precision reference over the same cache contents: f32, bf16 and int8 caches,
 * head sizes that are and are not multiples of 8 (the AVX2 kernels take D % 8 == 0,
 * 4 positions at a time, the output in 64-dimension chunks: D = 72 and 136 have a short
 * last chunk), lengths 1 to 67 (every tail of the 4-position groups), grouped-query heads,
 * two rows in different slots, and runs of one slot's rows (a prompt's, through the flash
 * kernel) among single rows; every path the CPU has (the default and
 * ANNEAL_CPU_ISA=portable), and the default path with 1 and 2 threads bit for bit.
 *
 * The bound: an output is a softmax-weighted sum of L values computed in f32 from f32
 * scores; each score (a D-term dot product, times 1/sqrt(D)) is within
 * (D + 8) * 2^-24 * sum |q k| of exact, which moves each weight by at most about that
 * much relatively, and the weighted sum adds (L + 8) * 2^-24 * sum |w v|: the check
 * allows 4 * ((D + 8) * max_score_mag + L + 8) * 2^-24 * max |v| plus 1e-6 absolute. */
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

/* Cache value i of a (slots, Hkv, M, D) cache of dtype dt, widened (int8 times its row scale). */
static double cache_at(const void *c, const float *scale, anneal_dtype dt, int64_t row, int64_t D, int64_t d) {
    if (dt == ANNEAL_F32) return ((const float *)c)[row * D + d];
    if (dt == ANNEAL_BF16) return anneal_bf16_to_f32(((const uint16_t *)c)[row * D + d]);
    return (double)((const int8_t *)c)[row * D + d] * scale[row];
}

/* n rows (row i: slot slots[i] at position pos[i]; a slot's rows at consecutive
 * positions form a run) on the current path (threads nt), with the runs through the
 * flash kernel when runs is set (kv_scratch given), checked against the reference; the
 * output is left in *out_copy for the bitwise comparisons. */
static bool run_rows(anneal_dtype dt, int64_t D, int64_t n, const int64_t *slots, const int64_t *pos, bool runs,
                     int nt, uint64_t seed, float *out_copy) {
    const int64_t S = 4, Hq = 4, Hkv = 2, M = 80;
    const size_t es = dt == ANNEAL_F32 ? 4 : dt == ANNEAL_BF16 ? 2 : 1;
    uint64_t s = seed;
    void *kc = calloc((size_t)(S * Hkv * M * D), es), *vc = calloc((size_t)(S * Hkv * M * D), es);
    float *ks = calloc((size_t)(S * Hkv * M), 4), *vs = calloc((size_t)(S * Hkv * M), 4);
    float *qkv = malloc(sizeof(float) * (size_t)(n * (Hq + 2 * Hkv) * D));
    float *out = malloc(sizeof(float) * (size_t)(n * Hq * D)), *scratch = malloc(sizeof(float) * (size_t)(n * Hq * M));
    const int64_t kv_floats = Hq * n + 2 * Hkv * M * D;
    float *kvs = runs ? malloc(sizeof(float) * (size_t)kv_floats) : NULL;
    if (!kc || !vc || !ks || !vs || !qkv || !out || !scratch || (runs && !kvs)) {
        anneal_test_fail(__FILE__, __LINE__, "out of memory");
        return false;
    }
    /* the cache rows before each slot's first new position: random values in the cache's dtype */
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t p = 0; p < pos[i] && (i == 0 || slots[i - 1] != slots[i]); p++) {
                const int64_t row = (slots[i] * Hkv + h) * M + p;
                float kx[160], vx[160];
                for (int64_t d = 0; d < D; d++) kx[d] = 2.0f * frand(&s), vx[d] = frand(&s);
                if (dt == ANNEAL_F32) {
                    memcpy((float *)kc + row * D, kx, sizeof(float) * (size_t)D);
                    memcpy((float *)vc + row * D, vx, sizeof(float) * (size_t)D);
                } else if (dt == ANNEAL_BF16) {
                    for (int64_t d = 0; d < D; d++) {
                        ((uint16_t *)kc)[row * D + d] = anneal_f32_to_bf16(kx[d]);
                        ((uint16_t *)vc)[row * D + d] = anneal_f32_to_bf16(vx[d]);
                    }
                } else {
                    anneal_kv_quantize_row_i8(kx, D, (int8_t *)kc + row * D, ks + row);
                    anneal_kv_quantize_row_i8(vx, D, (int8_t *)vc + row * D, vs + row);
                }
            }
    for (int64_t i = 0; i < n * (Hq + 2 * Hkv) * D; i++) qkv[i] = frand(&s);
    const int64_t ld = (Hq + 2 * Hkv) * D;
    anneal_decode_attn a = {.n = n, .slots = slots, .pos = pos, .q = qkv, .k = qkv + Hq * D, .v = qkv + (Hq + Hkv) * D,
                            .ld_qkv = ld, .Hq = Hq, .Hkv = Hkv, .D = D, .kc = kc, .vc = vc, .k_scale = ks,
                            .v_scale = vs, .dtype = dt, .max_len = M, .out = out, .ld_out = Hq * D,
                            .scratch = scratch, .kv_scratch = kvs, .kv_scratch_floats = runs ? kv_floats : 0};
    anneal_set_num_threads(nt);
    anneal_decode_attention(&a);
    anneal_set_num_threads(2);
    bool ok = true;
    /* the reference over the cache as stored (the new rows included) */
    for (int64_t i = 0; i < n && ok; i++)
        for (int64_t h = 0; h < Hq && ok; h++) {
            const int64_t kvh = h / (Hq / Hkv), base = (slots[i] * Hkv + kvh) * M, L = pos[i] + 1;
            const float *q = qkv + i * ld + h * D;
            double sc[80], mx = -INFINITY, sum = 0, smag = 0, vmax = 0; /* M = 80 positions at most */
            for (int64_t p = 0; p < L; p++) {
                double d0 = 0, mag = 0;
                for (int64_t d = 0; d < D; d++) {
                    double kv = cache_at(kc, ks, dt, base + p, D, d);
                    d0 += q[d] * kv;
                    mag += fabs(q[d] * kv);
                }
                sc[p] = d0 / sqrt((double)D);
                smag = mag > smag ? mag : smag;
                mx = sc[p] > mx ? sc[p] : mx;
            }
            for (int64_t p = 0; p < L; p++) sum += (sc[p] = exp(sc[p] - mx));
            for (int64_t d = 0; d < D && ok; d++) {
                double ref = 0;
                for (int64_t p = 0; p < L; p++) {
                    double v = cache_at(vc, vs, dt, base + p, D, d);
                    ref += sc[p] / sum * v;
                    vmax = fabs(v) > vmax ? fabs(v) : vmax;
                }
                const double bound = 4.0 * ((double)(D + 8) * smag + (double)(L + 8)) * ldexp(1.0, -24) * vmax + 1e-6;
                const double got = out[i * Hq * D + h * D + d];
                if (!(fabs(got - ref) <= bound)) {
                    anneal_test_fail(__FILE__, __LINE__, "%s D %lld L %lld row %lld head %lld dim %lld%s: %.9g, want %.9g (bound %.3g)",
                                     anneal_dtype_name(dt), (long long)D, (long long)L, (long long)i, (long long)h,
                                     (long long)d, runs ? " (runs)" : "", got, ref, bound);
                    ok = false;
                }
            }
        }
    memcpy(out_copy, out, sizeof(float) * (size_t)(n * Hq * D));
    free(kc), free(vc), free(ks), free(vs), free(qkv), free(out), free(scratch), free(kvs);
    return ok;
}

/* Two rows in different slots (no runs), the second a few positions shorter. */
static bool run_case(anneal_dtype dt, int64_t D, int64_t L0, int nt, float *out_copy) {
    const int64_t slots[2] = {2, 0}, pos[2] = {L0 - 1, L0 > 3 ? L0 - 3 : 0};
    return run_rows(dt, D, 2, slots, pos, false, nt, (uint64_t)(D * 131 + L0 * 7 + (int64_t)dt), out_copy);
}

TEST(decode_attention_matches_reference_on_every_path) {
    const anneal_dtype dts[3] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_I8};
    const int64_t Ds[] = {8, 12, 24, 64, 72, 136}, Ls[] = {1, 2, 3, 4, 5, 8, 13, 67};
    static float o[3][2 * 4 * 136];
    for (int t = 0; t < 3; t++)
        for (size_t di = 0; di < sizeof Ds / sizeof Ds[0]; di++)
            for (size_t li = 0; li < sizeof Ls / sizeof Ls[0]; li++) {
                unsetenv("ANNEAL_CPU_ISA");
                if (!run_case(dts[t], Ds[di], Ls[li], 2, o[0]) || !run_case(dts[t], Ds[di], Ls[li], 1, o[1])) return;
                CHECK(memcmp(o[0], o[1], sizeof(float) * (size_t)(2 * 4 * Ds[di])) == 0,
                      "%s D %lld L %lld: 1 and 2 threads differ", anneal_dtype_name(dts[t]), (long long)Ds[di],
                      (long long)Ls[li]);
                setenv("ANNEAL_CPU_ISA", "portable", 1);
                bool ok = run_case(dts[t], Ds[di], Ls[li], 2, o[2]);
                unsetenv("ANNEAL_CPU_ISA");
                if (!ok) return;
            }
}

/* A prompt's rows (runs of one slot at consecutive positions) among single rows, in
 * every order: [single, run of 5 starting at 0, single, run of 2 after 60 cached
 * positions] and the runs first; runs through the flash kernel (kv_scratch) against the
 * same reference, the rows between them on the row path; 1 and 2 threads bit for bit. */
TEST(runs_of_a_slots_rows_attend_causally) {
    const anneal_dtype dts[3] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_I8};
    const int64_t Ds[] = {8, 24, 64, 72};
    const int64_t sl_a[6] = {0, 2, 2, 2, 2, 2}, pos_a[6] = {9, 0, 1, 2, 3, 4};
    const int64_t sl_b[6] = {3, 3, 1, 0, 2, 2}, pos_b[6] = {60, 61, 33, 7, 70, 71};
    static float o[2][6 * 4 * 72];
    for (int t = 0; t < 3; t++)
        for (size_t di = 0; di < sizeof Ds / sizeof Ds[0]; di++) {
            uint64_t seed = (uint64_t)(Ds[di] * 17 + t);
            if (!run_rows(dts[t], Ds[di], 6, sl_a, pos_a, true, 2, seed, o[0])) return;
            if (!run_rows(dts[t], Ds[di], 6, sl_b, pos_b, true, 2, seed, o[0]) ||
                !run_rows(dts[t], Ds[di], 6, sl_b, pos_b, true, 1, seed, o[1]))
                return;
            CHECK(memcmp(o[0], o[1], sizeof(float) * (size_t)(6 * 4 * Ds[di])) == 0,
                  "%s D %lld: runs with 1 and 2 threads differ", anneal_dtype_name(dts[t]), (long long)Ds[di]);
        }
}

int main(void) {
    RUN(decode_attention_matches_reference_on_every_path);
    RUN(runs_of_a_slots_rows_attend_causally);
    return anneal_test_summary();
}
