/* Tests of the AMX-BF16 GEMM kernel (src/cpu/gemm_amx.c). On every CPU its C model of
 * the tile registers runs through the whole GEMM driver (packing, depth blocks, edge
 * tiles, the epilogue, B packed whole, threads): within the summation bound of the exact
 * product of the rounded operands (test_gemm_precision.c's top says why that bound is
 * rigorous), bit-identical where the driver promises it, and with Intel's pseudo-code
 * arithmetic exactly. The tile unit itself runs the same checks where the CPU has AMX;
 * elsewhere that test skips, saying so. */
#include "anneal/backend.h"
#include "gemm_check.h"

#include <omp.h>

/* Runs fn with every bf16 product on isa, then restores the normal choice. */
static void with_bf16_isa(const anneal_gemm_isa *isa, void (*fn)(const char *)) {
    REQUIRE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO) == 0);
    anneal_cpu_gemm_set_bf16_isa(isa);
    anneal_cpu_paths_reset();
    fn(isa->name);
    anneal_cpu_gemm_set_bf16_isa(NULL);
}

/* The bound on SHAPES (every transpose, alpha, beta, padded strides, depths over several
 * blocks), random shapes, and K == 1 exactly; the GEMM path records "amx". */
static void amx_bound(const char *name) {
    CHECK(strcmp(anneal_cpu_gemm_kernel_name(ANNEAL_BF16), name) == 0, "bf16 kernel %s, not %s",
          anneal_cpu_gemm_kernel_name(ANNEAL_BF16), name);
    const bool sanitized = anneal_test_sanitized();
    int64_t bad = 0;
    for (int c = 0; c < NSHAPES; c++) {
        if (sanitized && SHAPES[c][0] * SHAPES[c][1] * SHAPES[c][2] > 100000) continue;
        for (int t = 0; t < 4; t++) {
            const float beta = (c + t) % 3 == 0 ? 0.0f : (c + t) % 3 == 1 ? 1.0f : -0.5f;
            prob p = make_prob(t >> 1, t & 1, SHAPES[c][0], SHAPES[c][1], SHAPES[c][2], c % 2 ? 1.0f : -1.5f, beta,
                               (c + t) % 3);
            float *C = run_gemm(&p, ANNEAL_BF16, NULL);
            bad += count_outside_bound(&p, ANNEAL_BF16, C, name);
            free(C);
            free_prob(&p);
        }
    }
    for (int r = 0; r < (sanitized ? 4 : 12); r++) {
        const int t = (int)irand(0, 3);
        prob p = make_prob(t >> 1, t & 1, irand(2, 70), irand(1, 90), irand(1, 140), 1.0f, r % 2 ? 1.0f : 0.0f,
                           irand(0, 3));
        float *C = run_gemm(&p, ANNEAL_BF16, NULL);
        bad += count_outside_bound(&p, ANNEAL_BF16, C, name);
        free(C);
        free_prob(&p);
    }
    prob p = make_prob(false, false, 19, 45, 1, 2.0f, 0.0f, 0);
    float *C = run_gemm(&p, ANNEAL_BF16, NULL);
    for (int64_t i = 0; i < p.M; i++)
        for (int64_t j = 0; j < p.N; j++)
            if (!bits_equal(C[i * p.ldc + j], 2.0f * anneal_gemm_round_bf16(p.A[i]) * anneal_gemm_round_bf16(p.B[j])))
                bad++;
    free(C);
    free_prob(&p);
    CHECK(bad == 0, "%s: %lld elements out of bound", name, (long long)bad);
    CHECK(anneal_cpu_paths_taken(ANNEAL_CPU_OP_GEMM_BF16) & ANNEAL_CPU_PATH_AMX, "%s: the amx path was not recorded",
          name);
}

/* Fused epilogue = the product then the epilogue by hand; B packed whole = B packed per
 * call; 1 thread = 2 threads: all bit for bit. */
static void amx_same_bits(const char *name) {
    const int saved = omp_get_max_threads();
    static const int64_t shapes[][3] = {{37, 45, 300}, {70, 40, 1030}, {33, 65, 17}};
    const int nshape = anneal_test_sanitized() ? 1 : 3;
    for (int c = 0; c < nshape; c++)
        for (int t = 0; t < 4; t++) {
            prob p = make_prob(t >> 1, t & 1, shapes[c][0], shapes[c][1], shapes[c][2], 1.25f, t % 2 ? 0.0f : 1.0f, 1);
            char what[96];
            snprintf(what, sizeof what, "%s %c%c %lldx%lldx%lld", name, p.ta ? 'T' : 'N', p.tb ? 'T' : 'N',
                     (long long)p.M, (long long)p.N, (long long)p.K);
            float *bias = rand_buf(p.N), *pre = rand_buf(p.nc), *P = copy_buf(pre, p.nc);
            anneal_gemm_epilogue ep = {bias, true, pre, NULL, NULL};
            omp_set_num_threads(2);
            float *C = run_gemm(&p, ANNEAL_BF16, &ep);
            float *E = run_gemm(&p, ANNEAL_BF16, NULL);
            for (int64_t i = 0; i < p.M; i++) {
                float *row = E + i * p.ldc;
                for (int64_t j = 0; j < p.N; j++) row[j] = row[j] + bias[j];
                memcpy(P + i * p.ldc, row, sizeof(float) * (size_t)p.N);
                anneal_cpu_gelu_fwd(p.N, row, row, true);
            }
            int64_t bad = count_diff(C, E, p.nc, what) + count_diff(pre, P, p.nc, what);
            omp_set_num_threads(1);
            float *C1 = run_gemm(&p, ANNEAL_BF16, NULL);
            omp_set_num_threads(2);
            float *C2 = run_gemm(&p, ANNEAL_BF16, NULL);
            bad += count_diff(C1, C2, p.nc, what);
            if (!p.tb) { /* B packed whole (a weight), then the product over it */
                void *pk = malloc(anneal_cpu_gemm_packed_b_size(ANNEAL_BF16, p.K, p.N));
                anneal_cpu_gemm_pack_b(ANNEAL_BF16, false, p.K, p.N, p.B, p.ldb, pk);
                float *C3 = copy_buf(p.C0, p.nc);
                anneal_cpu_gemm_packed(ANNEAL_BF16, p.ta, p.M, p.N, p.K, p.alpha, p.A, p.lda, pk, p.beta, C3, p.ldc,
                                       NULL);
                bad += count_diff(C3, C2, p.nc, what);
                free(C3);
                free(pk);
            }
            CHECK(bad == 0, "%s: %lld elements differ (epilogue, threads or packed B)", what, (long long)bad);
            free(C);
            free(E);
            free(C1);
            free(C2);
            free(bias);
            free(pre);
            free(P);
            free_prob(&p);
        }
    omp_set_num_threads(saved);
}

TEST(amx_model_within_bound) { with_bf16_isa(&anneal_gemm_isa_amx_model, amx_bound); }
TEST(amx_model_same_bits) { with_bf16_isa(&anneal_gemm_isa_amx_model, amx_same_bits); }

/* The model's arithmetic is Intel's pseudo-code for TDPBF16PS: within a depth pair the
 * even depth is added first (acc 2^30, then -2^30 at depth 2, then 1 at depth 3 gives 1,
 * where adding the odd depth first, as VDPBF16PS does, gives 0), and bf16 subnormal
 * inputs count as zero. 2 x 2 products, so the packed path runs. */
TEST(amx_model_arithmetic) {
    anneal_cpu_gemm_set_bf16_isa(&anneal_gemm_isa_amx_model);
    const float A[2 * 4] = {1, 1, 1, 1, 0x1p-130f, 0, 0, 0}; /* row 1: a bf16 subnormal at depth 0 */
    const float B[4 * 2] = {0x1p30f, 0x1p100f, 0, 0, -0x1p30f, 0, 1, 0};
    float C[4] = {0};
    anneal_cpu_gemm(ANNEAL_BF16, false, false, 2, 2, 4, 1.0f, A, 4, B, 2, 0.0f, C, 2, NULL);
    CHECK(C[0] == 1.0f, "2^30 + 0 - 2^30 + 1 in the pseudo-code's order: %g, expected 1", C[0]);
    CHECK(C[3] == 0.0f, "subnormal x 2^100: %g, expected 0 (inputs below 2^-126 count as zero)", C[3]);
    CHECK(C[1] == 0x1p100f, "1 x 2^100: %g", C[1]);
    anneal_cpu_gemm_set_bf16_isa(NULL);
}

/* The tile unit's packers (AVX-512, VCVTNE2PS2BF16) write the model's panels bit for bit:
 * A and B layouts, both source orders, lanes and depths around the tile edges, and
 * values that round oddly (ties, NaN, infinities, signed zeros, f32 subnormals, the
 * largest of which would round up to a normal bf16). Runs wherever AVX512-BF16 does. */
TEST(amx_packers_match_model) {
    if (!anneal_cpu_has_avx512bf16()) SKIP("this CPU has no AVX512-BF16: the tile unit's packers cannot run here");
    static const float odd[] = {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-9f, -(1.0f + 0x1p-7f + 0x1p-8f),
                                0x1p-130f, -0x1p-140f, 0x1.fffffcp-127f, 3e38f, -3.4e38f};
    uint32_t qnan = 0x7fc00001u, snan = 0x7f800001u, inf = 0x7f800000u;
    const int64_t lanes_set[] = {1, 15, 16, 17, 32, 33, 70}, kc_set[] = {1, 2, 31, 32, 33, 64, 100};
    int64_t bad = 0;
    for (int li = 0; li < 7; li++)
        for (int ki = 0; ki < 7; ki++) {
            const int64_t lanes = lanes_set[li], kc = kc_set[ki], stride = (lanes > kc ? lanes : kc) + 3;
            const int64_t n = stride * stride;
            float *src = rand_buf(n);
            for (int64_t i = 0; i < n; i += 7) src[i] = odd[(i / 7) % 10];
            memcpy(&src[5 % n], &qnan, 4);
            memcpy(&src[11 % n], &snan, 4);
            memcpy(&src[13 % n], &inf, 4);
            const int64_t npan = (lanes + 31) / 32, kq = (kc + 31) / 32 * 16;
            const size_t bytes = (size_t)(npan * 32 * kq) * 4;
            uint8_t *got = malloc(bytes), *want = malloc(bytes);
            for (int a = 0; a < 2; a++)
                for (int contig = 0; contig < 2; contig++) {
                    anneal_gemm_pack vec = a ? anneal_gemm_isa_amx.pack_a : anneal_gemm_isa_amx.pack;
                    anneal_gemm_pack ref = a ? anneal_gemm_isa_amx_model.pack_a : anneal_gemm_isa_amx_model.pack;
                    memset(got, 0xa5, bytes);
                    memset(want, 0x5a, bytes);
                    vec(src, stride, contig, lanes, 32, kc, ANNEAL_GEMM_ROUND_BF16, got);
                    ref(src, stride, contig, lanes, 32, kc, ANNEAL_GEMM_ROUND_BF16, want);
                    if (memcmp(got, want, bytes) != 0) {
                        bad++;
                        if (bad <= 5)
                            printf("    %s panel, %s, lanes %lld, kc %lld: the packers differ\n", a ? "A" : "B",
                                   contig ? "lanes contiguous" : "depths contiguous", (long long)lanes, (long long)kc);
                    }
                }
            free(got);
            free(want);
            free(src);
        }
    CHECK(bad == 0, "%lld packings differ from the model's", (long long)bad);
}

/* The tile unit itself, where the CPU has it: chosen for bf16 by default, the same bound,
 * the same bits across threads, epilogue and packed B, and within the bound of the model. */
TEST(amx_tile_unit) {
    if (!anneal_cpu_amx_usable())
        SKIP("this CPU has no AMX-BF16 (or Linux refused the tile state): the tile-unit kernel did not run; "
             "its C model ran above");
    REQUIRE(anneal_cpu_sgemm_set_isa(ANNEAL_GEMM_ISA_AUTO) == 0);
    CHECK(strcmp(anneal_cpu_gemm_kernel_name(ANNEAL_BF16), "amx") == 0, "default bf16 kernel %s",
          anneal_cpu_gemm_kernel_name(ANNEAL_BF16));
    with_bf16_isa(&anneal_gemm_isa_amx, amx_bound);
    with_bf16_isa(&anneal_gemm_isa_amx, amx_same_bits);
}

int main(void) {
    RUN(amx_model_within_bound);
    RUN(amx_model_same_bits);
    RUN(amx_model_arithmetic);
    RUN(amx_packers_match_model);
    RUN(amx_tile_unit);
    return anneal_test_summary();
}
