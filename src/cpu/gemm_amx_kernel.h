/* The AMX-BF16 micro-kernel's body, included twice by gemm_amx.c: once over the tile
 * unit (TILELOADD / TDPBF16PS / TILESTORED) and once over gemm_amx.c's C model of the
 * eight tile registers, which is what runs on CPUs without AMX (the tests). Before each
 * inclusion gemm_amx.c defines
 *   AMX_KERNEL_NAME, AMX_KERNEL_ATTR     the function's name and attributes,
 *   AMX_TILES_BEGIN()                    the tile configuration (8 tiles of 16 rows x 64 bytes),
 *   AMX_ZERO(t), AMX_LOAD(t, p, stride), AMX_DP(c, a, b), AMX_STORE(t, p, stride)
 *                                        the four tile operations (t, c, a, b literal 0..7),
 *   AMX_PREFETCH(p)                      a hint to fetch p's cache line (the model: nothing).
 * One loop for both, so what the tests check here is the loop the tile unit runs. */

/* C[0:m, 0:n] = alpha * (ap @ bp) + beta * C for a 32 x 32 tile over kc depths (kc a
 * multiple of 32; layout and arithmetic at the top of gemm_amx.c). Tiles 0-3 accumulate
 * the four 16 x 16 quarters of C (0: rows 0-15 x columns 0-15, 1: rows 0-15 x 16-31,
 * 2: rows 16-31 x 0-15, 3: rows 16-31 x 16-31), 4-5 hold A's two row halves and 6-7 B's
 * two column halves for 16 depth pairs, each operand tile 1 KiB contiguous in its panel.
 * C's rows are fetched while the tiles work when C is read (beta != 0); a whole tile
 * with alpha 1 and beta 0 is stored straight into C (alpha * acc is acc). */
AMX_KERNEL_ATTR static void AMX_KERNEL_NAME(int64_t kc, const void *ap_, const void *bp_, float *restrict c,
                                            int64_t ldc, int m, int n, float alpha, float beta) {
    const int32_t *ap = ap_, *bp = bp_;
    const int64_t steps = kc / 32; /* 16 depth pairs each: 512 words of A, 512 of B */
    float acc[AMX_MR * AMX_NR] __attribute__((aligned(64)));
    if (beta != 0.0f)
        for (int i = 0; i < m; i++) {
            AMX_PREFETCH(c + i * ldc);
            if (n > 16) AMX_PREFETCH(c + i * ldc + 16);
        }
    AMX_TILES_BEGIN();
    AMX_ZERO(0);
    AMX_ZERO(1);
    AMX_ZERO(2);
    AMX_ZERO(3);
    for (int64_t s = 0; s < steps; s++) {
        AMX_LOAD(4, ap + s * 512, 64);
        AMX_LOAD(5, ap + s * 512 + 256, 64);
        AMX_LOAD(6, bp + s * 512, 64);
        AMX_LOAD(7, bp + s * 512 + 256, 64);
        AMX_DP(0, 4, 6);
        AMX_DP(1, 4, 7);
        AMX_DP(2, 5, 6);
        AMX_DP(3, 5, 7);
    }
    if (m == AMX_MR && n == AMX_NR && alpha == 1.0f && beta == 0.0f) {
        AMX_STORE(0, c, ldc * 4);
        AMX_STORE(1, c + 16, ldc * 4);
        AMX_STORE(2, c + 16 * ldc, ldc * 4);
        AMX_STORE(3, c + 16 * ldc + 16, ldc * 4);
        return;
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
