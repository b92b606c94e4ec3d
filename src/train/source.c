/* Batch sources for the trainer: token shards through the loader, or synthetic
 * tokens from a fixed random sparse Markov chain (each token has 4 possible
 * successors, so the loss must fall from ln(vocab) toward ln 4 ~ 1.39: a quick check
 * of the whole engine without data files). */
#include "train_internal.h"

#include <string.h>

anneal_status anneal_train_source_open_loader(train_source *s, const char *dir, const char *split, int64_t B, int64_t T,
                                       uint64_t seed, bool shuffle, bool prefetch, int rank, int world) {
    memset(s, 0, sizeof *s);
    s->B = B;
    s->T = T;
    s->rank = rank;
    s->world = world;
    anneal_loader_config lc = {.batch = B, .seq = T, .seed = seed, .shuffle = shuffle, .rank = rank, .world = world,
                               .prefetch = prefetch};
    anneal_status st = anneal_loader_open(dir, split, &lc, &s->loader);
    if (st == ANNEAL_OK) s->vocab = (int32_t)anneal_loader_vocab_size(s->loader);
    return st;
}

void anneal_train_source_open_synthetic(train_source *s, int64_t B, int64_t T, uint64_t seed, uint64_t stream, int32_t vocab,
                                 int rank, int world) {
    memset(s, 0, sizeof *s);
    s->B = B;
    s->T = T;
    s->rank = rank;
    s->world = world;
    s->seed = seed;
    s->stream = stream;
    s->vocab = vocab;
}

/* Successor j (0..3) of token t in the chain: fixed by the seed alone, so train and
 * val streams follow the same chain. */
static int32_t successor(uint64_t seed, int32_t t, uint32_t j, int32_t vocab) {
    uint32_t r[4];
    anneal_philox4x32(seed ^ 0x5eedULL, 7, (uint64_t)t, r);
    return (int32_t)(r[j & 3] % (uint32_t)vocab);
}

/* Row g of the stream: a random start token, then T random successor choices. */
static void synthetic_row(const train_source *s, uint64_t g, int32_t *ids, int32_t *targets) {
    uint32_t r[4];
    uint64_t key = s->seed + s->stream * 0x9E3779B97F4A7C15ULL;
    anneal_philox4x32(key, 11, g, r);
    int32_t tok = (int32_t)(r[0] % (uint32_t)s->vocab);
    for (int64_t t = 0; t <= s->T; t++) {
        if (t < s->T) ids[t] = tok;
        if (t > 0) targets[t - 1] = tok;
        anneal_philox4x32(key, 12, g * (uint64_t)(s->T + 1) + (uint64_t)t, r);
        tok = successor(s->seed, tok, r[0], s->vocab);
    }
}

anneal_status anneal_train_source_next(train_source *s, int32_t *ids, int32_t *targets) {
    if (s->loader) return anneal_loader_next(s->loader, ids, targets);
    /* the global row sequence, split like the loader's: the same rows for any world size */
    uint64_t first = s->row + (uint64_t)s->rank * (uint64_t)s->B;
    for (int64_t b = 0; b < s->B; b++) synthetic_row(s, first + (uint64_t)b, ids + b * s->T, targets + b * s->T);
    s->served++;
    s->row += (uint64_t)s->B * (uint64_t)s->world;
    return ANNEAL_OK;
}

anneal_loader_cursor anneal_train_source_get_cursor(const train_source *s) {
    if (s->loader) return anneal_loader_get_cursor(s->loader);
    anneal_loader_cursor c = {.epoch = 0, .index = s->row, .step = s->served};
    return c;
}

anneal_status anneal_train_source_set_cursor(train_source *s, anneal_loader_cursor c) {
    if (s->loader) return anneal_loader_set_cursor(s->loader, c);
    s->served = c.step;
    s->row = c.index; /* the position, like the loader's: another batch or world size goes on from it */
    return ANNEAL_OK;
}

uint64_t anneal_train_source_windows(const train_source *s) {
    return s->loader ? anneal_loader_windows(s->loader) : UINT64_MAX;
}

void anneal_train_source_close(train_source *s) {
    anneal_loader_free(s->loader);
    memset(s, 0, sizeof *s);
}
