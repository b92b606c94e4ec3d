/* Seeded pseudo-random permutations of [0, n) for the data loader: a Feistel network
 * over the smallest even number of bits covering n, with cycle-walking, its round
 * function drawn from Philox keyed by (seed, epoch). O(1) memory, expected O(1) per
 * lookup, no table, deterministic and independent of threads and ranks. */
#ifndef ANNEAL_DATA_PERMUTATION_H
#define ANNEAL_DATA_PERMUTATION_H

#include "anneal/core.h"

/* One permutation of [0, n) (n >= 1) for one (seed, epoch). Plain value: copy freely. */
typedef struct anneal_perm {
    uint64_t n;         /* size of the permuted range */
    uint64_t key;       /* Philox key derived from the seed */
    uint64_t epoch;     /* Philox counter_hi: a different permutation per epoch */
    int half_bits;      /* h: the Feistel network permutes 2h-bit values, 2^(2h) >= n */
    uint64_t half_mask; /* 2^h - 1 */
} anneal_perm;

/* Sets up the permutation of [0, n) for (seed, epoch); n must be >= 1. */
void anneal_perm_init(anneal_perm *p, uint64_t n, uint64_t seed, uint64_t epoch);
/* The image of x (x < n) under the permutation: a value in [0, n), distinct for
 * distinct x. Expected < 4 Feistel evaluations (the 2h-bit domain is < 4n). */
uint64_t anneal_perm_apply(const anneal_perm *p, uint64_t x);

#endif
