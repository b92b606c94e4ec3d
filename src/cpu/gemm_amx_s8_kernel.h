/* The AMX-INT8 block kernel's body, included twice by gemm_amx_s8.c: over the tile unit
 * (TDPBSSD) and over the C model of the tiles (tests on CPUs without AMX). Before each
 * inclusion: AMX_S8_NAME, AMX_S8_ATTR, AMX_TILES_BEGIN(), AMX_ZERO(t), AMX_LOAD(t, p,
 * stride), AMX_DP(c, a, b), AMX_STORE(t, p, stride) (t, c, a, b literal 0..7).
 *
 * C[m, n] = sum_k A[m, k] B[n, k] for rows [m0, m1) (whole tiles: a multiple of 32) by
 * outputs [n0, n1) (at most 32), exact in int32 (wrapping). B's block is packed first
 * into tile columns (word (q, j) = the four bytes B[n0 + 16 t + j][4q .. 4q + 3], zero
 * past K and n1); A is read in place, 64 bytes of K per tile row, except a last partial
 * chunk, copied zero-padded. Tiles 0-3 accumulate the 2 x 2 quarters of a 32 x 32 block
 * of C, 4-5 hold A's two row halves, 6-7 B's two column halves. */
AMX_S8_ATTR void AMX_S8_NAME(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const int8_t *A,
                                    int64_t lda, const int8_t *B, int64_t ldb, int32_t *C, int64_t ldc) {
    const int64_t kc = (K + 63) / 64, kq = kc * 16; /* 64-byte chunks of K; quads of K */
    uint32_t *bp = malloc((size_t)(2 * kq * 16) * sizeof *bp);
    if (!bp) {
        anneal_gemm_s8_block_portable(m0, m1, n0, n1, K, A, lda, B, ldb, C, ldc); /* no memory to pack B */
        return;
    }
    for (int t = 0; t < 2; t++)
        for (int j = 0; j < 16; j++) {
            const int64_t n = n0 + 16 * t + j;
            uint32_t *w = bp + t * kq * 16 + j;
            const int64_t full = n < n1 ? K / 4 : 0; /* quads wholly inside K */
            for (int64_t q = 0; q < full; q++) memcpy(&w[q * 16], B + n * ldb + 4 * q, 4);
            for (int64_t q = full; q < kq; q++) { /* the last part quad, then zeros */
                uint8_t v[4] = {0, 0, 0, 0};
                for (int i = 0; i < 4; i++)
                    if (n < n1 && 4 * q + i < K) v[i] = (uint8_t)B[n * ldb + 4 * q + i];
                memcpy(&w[q * 16], v, 4);
            }
        }
    int8_t tail[32 * 64];
    int32_t acc[32 * 32] __attribute__((aligned(64)));
    AMX_TILES_BEGIN();
    for (int64_t m = m0; m < m1; m += 32) {
        AMX_ZERO(0);
        AMX_ZERO(1);
        AMX_ZERO(2);
        AMX_ZERO(3);
        for (int64_t c = 0; c < kc; c++) {
            const int8_t *a = A + m * lda + 64 * c;
            int64_t as = lda;
            if (64 * c + 64 > K) { /* the last, partial chunk: zero-padded rows */
                const int64_t nk = K - 64 * c;
                memset(tail, 0, sizeof tail);
                for (int r = 0; r < 32; r++) memcpy(tail + r * 64, A + (m + r) * lda + 64 * c, (size_t)nk);
                a = tail;
                as = 64;
            }
            AMX_LOAD(4, a, as);
            AMX_LOAD(5, a + 16 * as, as);
            AMX_LOAD(6, bp + c * 16 * 16, 64);
            AMX_LOAD(7, bp + kq * 16 + c * 16 * 16, 64);
            AMX_DP(0, 4, 6);
            AMX_DP(1, 4, 7);
            AMX_DP(2, 5, 6);
            AMX_DP(3, 5, 7);
        }
        AMX_STORE(0, acc, 128);
        AMX_STORE(1, acc + 16, 128);
        AMX_STORE(2, acc + 16 * 32, 128);
        AMX_STORE(3, acc + 16 * 32 + 16, 128);
        for (int r = 0; r < 32; r++) memcpy(C + (m + r) * ldc + n0, acc + r * 32, (size_t)(n1 - n0) * sizeof *C);
    }
    free(bp);
}
