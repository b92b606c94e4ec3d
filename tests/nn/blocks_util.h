/* Helpers of the nn block tests: parameters filled with fixed random values, host
 * copies, and the largest difference of two tensors. Header-only. */
#ifndef ANNEAL_TESTS_NN_BLOCKS_UTIL_H
#define ANNEAL_TESTS_NN_BLOCKS_UTIL_H

#include <math.h>
#include <stdlib.h>

#include "anneal/anneal.h"
#include "gradcheck.h"

/* Every parameter of ps set to uniform values in [-0.5, 0.5) (seeded by its index). */
static inline void bu_randomize(anneal_params *ps, uint64_t seed) {
    for (int i = 0; i < ps->n; i++) {
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *t = ps->items[i].tensor;
        anneal_copy_(t, anneal_test_rand(t->ndim, t->shape, -0.5f, 0.5f, seed * 131 + (uint64_t)i, false));
        anneal_scope_close(s);
    }
}

/* max |a - b| over two tensors of the same numel (INFINITY when either is NULL). */
static inline double bu_max_diff(const anneal_tensor *a, const anneal_tensor *b) {
    if (!a || !b || anneal_numel(a) != anneal_numel(b)) return INFINITY;
    int64_t n = anneal_numel(a);
    float *x = malloc((size_t)n * sizeof *x + 4), *y = malloc((size_t)n * sizeof *y + 4);
    double d = 0;
    if (x && y && anneal_to_f32_buffer(a, x) == ANNEAL_OK && anneal_to_f32_buffer(b, y) == ANNEAL_OK)
        for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)x[i] - (double)y[i]));
    else
        d = INFINITY;
    free(x);
    free(y);
    return d;
}

/* True when a and b hold the same bits (same numel). */
static inline bool bu_same_bits(const anneal_tensor *a, const anneal_tensor *b) { return bu_max_diff(a, b) == 0.0; }

#endif
