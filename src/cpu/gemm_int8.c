/* The int8 x int8 -> int32 GEMM of dynamic and static quantization: C = A B^T with A
 * the quantized activations (M x K) and B the quantized weight in (out, in) layout
 * (N x K). Exact: every path gives the int32 sum of a reference loop (the tests compare
 * bit for bit). Runtime dispatch: AVX-512 VNNI (gemm_int8_avx512vnni.c), AVX2
 * (gemm_int8_avx2.c), portable C here, and from 32 rows AMX-INT8 tiles (gemm_amx_s8.c;
 * exact on AMX hardware too, where quant_int8.c's panels beat them); ANNEAL_ISA=portable|avx2|avx512 (read at every call)
 * or anneal_cpu_gemm_s8_set_isa forces a lower one.
 * Threads take blocks of 4 rows of B (N), so each weight row is read from memory once
 * per call and every A row is reused from cache: the decode case (M = 1) streams the
 * int8 weight once. Every C element is computed by one thread in a fixed order. */
#include "anneal/backend.h"
#include "cpu_kernels.h"
#include "gemm_int8_internal.h"
#include "gemm_internal.h"

#include <omp.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static atomic_int forced_isa = ANNEAL_GEMM_S8_AUTO;

/* True when the CPU can run isa. */
static bool isa_available(int isa) {
    return isa == ANNEAL_GEMM_S8_PORTABLE || isa == ANNEAL_GEMM_S8_AMX_MODEL ||
           (isa == ANNEAL_GEMM_S8_AVX2 && anneal_cpu_has_avx2()) ||
           (isa == ANNEAL_GEMM_S8_AVX512VNNI && anneal_cpu_has_avx512vnni()) ||
           (isa == ANNEAL_GEMM_S8_AMX && anneal_cpu_has_avx512vnni() && anneal_cpu_amx_usable());
}

int anneal_cpu_gemm_s8_set_isa(int isa) {
    if (isa != ANNEAL_GEMM_S8_AUTO && !isa_available(isa)) return -1;
    atomic_store_explicit(&forced_isa, isa, memory_order_relaxed);
    return 0;
}

int anneal_cpu_gemm_s8_isa(void) {
    int f = atomic_load_explicit(&forced_isa, memory_order_relaxed);
    if (f != ANNEAL_GEMM_S8_AUTO) return f;
    const int limit = anneal_cpu_isa_limit();
    if (limit >= ANNEAL_ISA_AMX && isa_available(ANNEAL_GEMM_S8_AMX)) return ANNEAL_GEMM_S8_AMX;
    if (limit >= ANNEAL_ISA_AVX512 && anneal_cpu_has_avx512vnni()) return ANNEAL_GEMM_S8_AVX512VNNI;
    if (limit >= ANNEAL_ISA_AVX2 && anneal_cpu_has_avx2()) return ANNEAL_GEMM_S8_AVX2;
    return ANNEAL_GEMM_S8_PORTABLE;
}

const char *anneal_cpu_gemm_s8_isa_name(int isa) {
    return isa == ANNEAL_GEMM_S8_AMX          ? "amx"
           : isa == ANNEAL_GEMM_S8_AMX_MODEL ? "amx-model"
           : isa == ANNEAL_GEMM_S8_AVX512VNNI ? "avx512vnni"
           : isa == ANNEAL_GEMM_S8_AVX2     ? "avx2"
           : isa == ANNEAL_GEMM_S8_PORTABLE ? "portable"
                                            : "?";
}

void anneal_cpu_gemm_s8(int64_t M, int64_t N, int64_t K, const int8_t *A, int64_t lda, const int8_t *B, int64_t ldb,
                        int32_t *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        for (int64_t m = 0; m < M; m++) memset(C + m * ldc, 0, (size_t)N * sizeof *C);
        return;
    }
    const int isa = anneal_cpu_gemm_s8_isa();
    const bool tiles = isa == ANNEAL_GEMM_S8_AMX || isa == ANNEAL_GEMM_S8_AMX_MODEL;
    /* with tiles: the kernel of the rows that fill no tile */
    anneal_gemm_s8_block_fn fn = isa == ANNEAL_GEMM_S8_AVX512VNNI || isa == ANNEAL_GEMM_S8_AMX
                                     ? anneal_gemm_s8_block_avx512vnni
                                 : isa == ANNEAL_GEMM_S8_AVX2 || (tiles && anneal_cpu_has_avx2()) ? anneal_gemm_s8_block_avx2
                                                                                                  : anneal_gemm_s8_block_portable;
    if (tiles && M >= 32) {
        /* blocks of 32 outputs, each one pass of the tile kernel over the whole tiles of
         * A's rows, then the rows left over by fn */
        anneal_gemm_s8_block_fn amx =
            isa == ANNEAL_GEMM_S8_AMX ? anneal_gemm_s8_block_amx : anneal_gemm_s8_block_amx_model;
        const int64_t mt = M / 32 * 32, nb32 = (N + 31) / 32;
#pragma omp parallel for schedule(static) if (nb32 * M * K > 65536)
        for (int64_t nb = 0; nb < nb32; nb++) {
            const int64_t n0 = nb * 32, n1 = n0 + 32 < N ? n0 + 32 : N;
            amx(0, mt, n0, n1, K, A, lda, B, ldb, C, ldc);
            if (mt < M) fn(mt, M, n0, n1, K, A, lda, B, ldb, C, ldc);
        }
        return;
    }
    const int64_t nblocks = (N + 3) / 4;
    /* rows of A per pass: what stays in L2 beside the weight rows (about 256 KiB) */
    int64_t mb = (int64_t)(256 * 1024) / (K > 0 ? K : 1);
    mb = mb < 4 ? 4 : mb > M ? M : (mb & ~(int64_t)3);
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t m1 = m0 + mb < M ? m0 + mb : M;
#pragma omp parallel for schedule(static) if (nblocks * (m1 - m0) * K > 65536)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const int64_t n0 = nb * 4, n1 = n0 + 4 < N ? n0 + 4 : N;
            fn(m0, m1, n0, n1, K, A, lda, B, ldb, C, ldc);
        }
    }
}
