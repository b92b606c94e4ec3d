/* The int8 GEMM's reference block in plain C: one int32 dot product per element (the
 * portable path of gemm_int8.c, and the AMX kernel's way out when it has no memory to
 * pack B). Exact (the int32 sums wrap). */
#include "gemm_int8_internal.h"

void anneal_gemm_s8_block_portable(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A,
                                   int64_t lda, const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *b = B + n * ldb;
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *a = A + m * lda;
            uint32_t s = 0;
            for (int64_t k = 0; k < K; k++) s += (uint32_t)((int32_t)a[k] * (int32_t)b[k]);
            C[m * ldc + n] = (int32_t)s;
        }
    }
}
