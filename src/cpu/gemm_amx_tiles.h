/* What the AMX kernels share (gemm_amx.c: bf16, gemm_amx_s8.c: int8): the tile
 * configuration they all use (eight tiles of 16 rows x 64 bytes, loaded once per thread
 * in each file), and the C model of the tile registers that the tests run on CPUs
 * without AMX (loads, stores; each file models its own dot-product instruction). */
#ifndef ANNEAL_CPU_GEMM_AMX_TILES_H
#define ANNEAL_CPU_GEMM_AMX_TILES_H

#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define ANNEAL_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,fma")))

/* LDTILECFG's 64-byte operand: palette 1, then per tile its bytes per row and rows. */
typedef struct anneal_amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} anneal_amx_config;

/* Every tile 16 rows x 64 bytes, the only shape the kernels use. */
static inline anneal_amx_config anneal_amx_full_tiles(void) {
    anneal_amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    return cfg;
}

/* Loads the configuration unless this thread has (*done: the including file's own
 * thread-local flag; the tile configuration is per-thread state). */
ANNEAL_AMX_TARGET static inline __attribute__((always_inline)) void anneal_amx_tiles_begin(bool *done) {
    if (!*done) {
        const anneal_amx_config cfg = anneal_amx_full_tiles();
        _tile_loadconfig(&cfg);
        *done = true;
    }
}

/* One tile register of the model: 16 rows of 64 bytes. */
typedef struct anneal_amx_model_tile {
    union {
        float f[16][16];
        int32_t i[16][16];
        uint32_t w[16][16];
        int8_t b[16][64];
    };
} anneal_amx_model_tile;

static inline void anneal_amx_model_load(anneal_amx_model_tile *t, const void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy(t->w[r], (const char *)p + r * stride, 64);
}

static inline void anneal_amx_model_store(const anneal_amx_model_tile *t, void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((char *)p + r * stride, t->w[r], 64);
}

#endif
