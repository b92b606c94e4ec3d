/* The int8 GEMM on AMX-INT8 tiles (TDPBSSD: signed bytes by signed bytes, groups of four
 * products added into int32), for gemm_int8.c's driver from 32 rows of A on: blocks of
 * 32 rows by 32 outputs in four 16 x 16 int32 tiles (the body: gemm_amx_s8_kernel.h).
 * Integer sums, so exact like every other path (the int32 lanes wrap; callers keep
 * K <= 65536, where the true sums fit).
 *
 * The tests run the same body over the C model of the tiles on every CPU, bit for bit
 * against the reference loop, and the tile unit where the CPU has it (it passed on the
 * GPU machine's AMX host, 2026-11-30). There it was slower than quant_int8.c's VPDPBUSD
 * panels on GPT-2 124M prompts: B is packed per call and A's tiles are read in place, a
 * row every K bytes (the bf16 kernel's first layout had the same fault). */
#include "cpu/gemm_amx_tiles.h"
#include "cpu/gemm_int8_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- the tile unit */

static _Thread_local bool tiles_configured;

#define AMX_S8_NAME anneal_gemm_s8_block_amx
#define AMX_S8_ATTR ANNEAL_AMX_TARGET
#define AMX_TILES_BEGIN() anneal_amx_tiles_begin(&tiles_configured)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define AMX_DP(c, a, b) _tile_dpbssd(c, a, b)
#define AMX_STORE(t, p, stride) _tile_stored(t, p, stride)
#include "cpu/gemm_amx_s8_kernel.h"
#undef AMX_S8_NAME
#undef AMX_S8_ATTR
#undef AMX_TILES_BEGIN
#undef AMX_ZERO
#undef AMX_LOAD
#undef AMX_DP
#undef AMX_STORE

/* ---------------------------------------------------------------- the model */

/* TDPBSSD c, a, b: for each of the 16 x 16 int32 elements of c, the 64 products of its
 * a row's bytes and its b column's bytes (column n: bytes 4n .. 4n + 3 of each b row),
 * signed, added with wrap-around. */
static void model_dp(anneal_amx_model_tile *c, const anneal_amx_model_tile *a, const anneal_amx_model_tile *b) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            uint32_t s = (uint32_t)c->i[m][n];
            for (int q = 0; q < 16; q++)
                for (int i = 0; i < 4; i++) s += (uint32_t)((int32_t)a->b[m][4 * q + i] * (int32_t)b->b[q][4 * n + i]);
            c->i[m][n] = (int32_t)s;
        }
}

#define AMX_S8_NAME anneal_gemm_s8_block_amx_model
#define AMX_S8_ATTR
#define AMX_TILES_BEGIN() anneal_amx_model_tile tmm[8]
#define AMX_ZERO(t) memset(&tmm[t], 0, sizeof tmm[t])
#define AMX_LOAD(t, p, stride) anneal_amx_model_load(&tmm[t], p, stride)
#define AMX_DP(c, a, b) model_dp(&tmm[c], &tmm[a], &tmm[b])
#define AMX_STORE(t, p, stride) anneal_amx_model_store(&tmm[t], p, stride)
#include "cpu/gemm_amx_s8_kernel.h"
