/* The AMX-BF16 micro-kernel's body, included twice by gemm_amx.c: once over the tile
 * unit (TILELOADD / TDPBF16PS / TILESTORED) and once over gemm_amx.c's C model of the
 * eight tile registers, which is what runs on CPUs without AMX (the tests). Before each
 * inclusion gemm_amx.c defines
 *   AMX_KERNEL_NAME, AMX_KERNEL_ATTR     the function's name and attributes,
 *   AMX_TILES_BEGIN()                    the tile configuration (8 tiles of 16 rows x 64 bytes),
 *   AMX_ZERO(t), AMX_LOAD(t, p, stride), AMX_DP(c, a, b), AMX_STORE(t, p, stride)
 *                                        the four tile operations (t, c, a, b literal 0..7).
 * One loop for both, so what the tests check here is the loop the tile unit runs. */

/* C[0:m, 0:n] = alpha * (ap @ bp) + beta * C for a 32 x 32 tile over kc depths (kc a
 * multiple of 32; layout and arithmetic at the top of gemm_amx.c). Tiles 0-3 accumulate
 * the four 16 x 16 quarters of C (0: rows 0-15 x columns 0-15, 1: rows 0-15 x 16-31,
 * 2: rows 16-31 x 0-15, 3: rows 16-31 x 16-31), 4-5 hold A's two row halves and 6-7 B's
 * two column halves for 16 depth pairs. */
AMX_KERNEL_ATTR static void AMX_KERNEL_NAME(int64_t kc, const void *ap_, const void *bp_, float *restrict c,
                                            int64_t ldc, int m, int n, float alpha, float beta) {
    const int32_t *ap = ap_, *bp = bp_;
    const int64_t kq = kc / 2;         /* depth pairs: a multiple of 16 */
    const int64_t a_stride = kq * 4;   /* bytes between rows of the A micro-panel */
    float acc[AMX_MR * AMX_NR] __attribute__((aligned(64)));
    AMX_TILES_BEGIN();
    AMX_ZERO(0);
    AMX_ZERO(1);
    AMX_ZERO(2);
    AMX_ZERO(3);
    for (int64_t q = 0; q < kq; q += 16) {
        AMX_LOAD(4, ap + q, a_stride);
        AMX_LOAD(5, ap + 16 * kq + q, a_stride);
        AMX_LOAD(6, bp + q * AMX_NR, AMX_NR * 4);
        AMX_LOAD(7, bp + q * AMX_NR + 16, AMX_NR * 4);
        AMX_DP(0, 4, 6);
        AMX_DP(1, 4, 7);
        AMX_DP(2, 5, 6);
        AMX_DP(3, 5, 7);
    }
    AMX_STORE(0, acc, AMX_NR * 4);
    AMX_STORE(1, acc + 16, AMX_NR * 4);
    AMX_STORE(2, acc + 16 * AMX_NR, AMX_NR * 4);
    AMX_STORE(3, acc + 16 * AMX_NR + 16, AMX_NR * 4);
    /* C = alpha * acc + beta * C (one fused multiply-add; C not read when beta == 0), the
     * same for every element whatever m and n */
    for (int i = 0; i < m; i++) {
        float *row = c + i * ldc;
        const float *a = acc + i * AMX_NR;
        if (beta == 0.0f)
            for (int j = 0; j < n; j++) row[j] = alpha * a[j];
        else
            for (int j = 0; j < n; j++) row[j] = __builtin_fmaf(beta, row[j], alpha * a[j]);
    }
}
