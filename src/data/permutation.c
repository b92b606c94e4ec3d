/* Feistel + cycle-walking permutation of [0, n) (see permutation.h).
 * Why not Fisher-Yates: a materialised table costs 8 bytes per window (1 GB for a
 * 10B-token dataset at T=64) and O(W) work at each epoch start; the Feistel network
 * gives any position of any epoch's order directly, which also makes the cursor
 * restore O(1). A balanced Feistel network with random round functions is a
 * permutation of the 2h-bit domain for any round function; cycle-walking (apply again
 * while the value is >= n) restricts it to [0, n) and stays a permutation, because
 * it follows x's cycle to the first element that lies in [0, n). */
#include "data/permutation.h"

/* Feistel rounds. 4 already give a pseudo-random permutation (Luby-Rackoff) with
 * ideal round functions; 6 leave margin since Philox output is masked to h bits. */
#define PERM_ROUNDS 6

/* SplitMix64 finaliser: spreads the user seed over the 64-bit Philox key, so nearby
 * seeds (0, 1, 2...) give unrelated orders and the loader's stream differs from the
 * global RNG's stream for the same seed. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void anneal_perm_init(anneal_perm *p, uint64_t n, uint64_t seed, uint64_t epoch) {
    int bits = 0;
    while (bits < 64 && (n - 1) >> bits) bits++; /* smallest bits with 2^bits >= n */
    p->n = n;
    p->key = mix64(seed ^ 0x6c6f616465722d70ull); /* "loader-p" */
    p->epoch = epoch;
    p->half_bits = (bits + 1) / 2;
    p->half_mask = p->half_bits ? (((uint64_t)1 << p->half_bits) - 1) : 0;
}

/* One pass of the Feistel network over the 2h-bit domain: (L, R) -> (R, L ^ F_r(R)),
 * F_r(R) = Philox(key, (epoch, r << 32 | R)) masked to h bits (R < 2^32 since h <= 32). */
static uint64_t feistel(const anneal_perm *p, uint64_t x) {
    int h = p->half_bits;
    if (h == 0) return 0;
    uint64_t l = x >> h, r = x & p->half_mask;
    for (uint64_t round = 0; round < PERM_ROUNDS; round++) {
        uint32_t out[4];
        anneal_philox4x32(p->key, p->epoch, (round << 32) | r, out);
        uint64_t f = (((uint64_t)out[1] << 32) | out[0]) & p->half_mask;
        uint64_t nl = r;
        r = l ^ f;
        l = nl;
    }
    return (l << h) | r;
}

uint64_t anneal_perm_apply(const anneal_perm *p, uint64_t x) {
    uint64_t y = feistel(p, x);
    while (y >= p->n) y = feistel(p, y);
    return y;
}
