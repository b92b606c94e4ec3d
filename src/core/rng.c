/* Philox4x32-10 counter-based RNG (Salmon et al., SC'11) and the global generator
 * state (seed, offset) that random ops advance. */
#include "anneal/core.h"

static anneal_rng_state g_rng = {0x853c49e6748fea9bULL, 0};

static inline uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t *hi) {
    uint64_t p = (uint64_t)a * b;
    *hi = (uint32_t)(p >> 32);
    return (uint32_t)p;
}

void anneal_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter_lo, c1 = (uint32_t)(counter_lo >> 32);
    uint32_t c2 = (uint32_t)counter_hi, c3 = (uint32_t)(counter_hi >> 32);
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int r = 0; r < 10; r++) {
        uint32_t hi0, hi1;
        uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
        uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
        uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

float anneal_uniform_from_u32(uint32_t x) { return (float)(x >> 8) * (1.0f / 16777216.0f); }

void anneal_manual_seed(uint64_t seed) {
    g_rng.seed = seed;
    g_rng.offset = 0;
}

anneal_rng_state anneal_rng_get(void) { return g_rng; }

void anneal_rng_set(anneal_rng_state s) { g_rng = s; }

uint64_t anneal_rng_reserve(uint64_t n) {
    uint64_t first = g_rng.offset;
    g_rng.offset += (n + 3) & ~(uint64_t)3; /* whole Philox blocks */
    return first;
}
