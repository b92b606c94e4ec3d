/* Picking the next token from logits: greedy argmax, or temperature, top-k, top-p
 * (nucleus) and one draw by inverse CDF with a uniform from Philox(seed, position).
 * The id depends only on the logits, the config and the position: no hidden state,
 * so a generation replays exactly and any position can be re-drawn on its own.
 * Candidates are ordered by (logit descending, id ascending), a total order, so ties
 * and truncation boundaries are deterministic. */
#include "anneal/model.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

typedef struct cand {
    float logit;
    int32_t id;
} cand;

/* True when a comes before b: higher logit, then lower id. */
static bool before(const cand *a, const cand *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cmp_cand(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

/* Index of the largest logit, the lowest id among equals; NaN never wins (0 if all NaN). */
static int32_t argmax(const float *x, int64_t V) {
    int64_t best = -1;
    for (int64_t i = 0; i < V; i++)
        if (!isnan(x[i]) && (best < 0 || x[i] > x[best])) best = i;
    return best < 0 ? 0 : (int32_t)best;
}

/* NaN and -inf logits are never candidates; +inf counts as FLT_MAX. */
static inline bool valid(float l) { return !isnan(l) && l != -INFINITY; }
static inline float clamp_inf(float l) { return l == INFINITY ? FLT_MAX : l; }

/* Sift-down in a heap of k candidates whose root is the one that comes last. */
static void sift_down(cand *h, int64_t k, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && before(&h[w], &h[l])) w = l;
        if (r < k && before(&h[w], &h[r])) w = r;
        if (w == i) return;
        cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* Fills c with the best min(k, n_valid) candidates in order (k <= 0: all); returns
 * how many. A heap
 * of the k best so far makes this O(V log k), not a sort of all V. */
static int64_t candidates(const float *x, int64_t V, int64_t k, cand *c) {
    int64_t n = 0;
    bool heap = k > 0 && k < V;
    for (int64_t i = 0; i < V; i++) {
        float l = x[i];
        if (!valid(l)) continue;
        cand e = {clamp_inf(l), (int32_t)i};
        if (!heap || n < k) {
            c[n++] = e;
            if (heap && n == k)
                for (int64_t j = k / 2; j-- > 0;) sift_down(c, k, j);
        } else if (before(&e, &c[0])) {
            c[0] = e; /* replaces the worst of the k best so far */
            sift_down(c, k, 0);
        }
    }
    qsort(c, (size_t)n, sizeof *c, cmp_cand);
    return n;
}

/* A uniform double in [0, 1) with 53 random bits from Philox(seed, position). */
static double uniform(uint64_t seed, uint64_t position) {
    uint32_t r[4];
    anneal_philox4x32(seed, 0x73616d70u /* "samp": a stream of its own */, position, r);
    uint64_t bits = ((uint64_t)(r[0] >> 5) << 26) | (r[1] >> 6);
    return (double)bits * (1.0 / 9007199254740992.0);
}

int32_t anneal_sample_logits(const float *logits, int64_t V, const anneal_sampler_config *cfg,
                             uint64_t position) {
    if (!logits || V <= 0 || !cfg) return -1;
    if (!(cfg->temperature > 0.0f) || cfg->top_k == 1) return argmax(logits, V);
    float lmax = -INFINITY;
    int64_t n_valid = 0;
    for (int64_t i = 0; i < V; i++)
        if (valid(logits[i])) {
            n_valid++;
            if (clamp_inf(logits[i]) > lmax) lmax = clamp_inf(logits[i]);
        }
    if (n_valid == 0) return argmax(logits, V);
    /* weights exp((logit - max) / T): softmax(logit / T) before normalising */
    const double inv_t = 1.0 / (double)cfg->temperature;
    const bool top_k = cfg->top_k > 0 && cfg->top_k < n_valid, nucleus = cfg->top_p < 1.0f;
    const double target_u = uniform(cfg->seed, position);
    if (!top_k && !nucleus) { /* the whole distribution: no ordering needed, walk the ids */
        double total = 0.0, cum = 0.0;
        double *w = malloc((size_t)V * sizeof *w); /* each weight computed once (NULL: twice) */
        for (int64_t i = 0; i < V; i++) {
            double e = valid(logits[i]) ? exp(((double)clamp_inf(logits[i]) - lmax) * inv_t) : 0.0;
            if (w) w[i] = e;
            if (valid(logits[i])) total += e;
        }
        double target = target_u * total;
        int32_t last = 0;
        for (int64_t i = 0; i < V; i++) {
            if (!valid(logits[i])) continue;
            last = (int32_t)i;
            cum += w ? w[i] : exp(((double)clamp_inf(logits[i]) - lmax) * inv_t);
            if (target < cum) break;
        }
        free(w);
        return last;
    }
    cand *c = malloc((size_t)V * sizeof *c);
    double *p = malloc((size_t)V * sizeof *p);
    if (!c || !p) { /* no room to sample: the most likely id is still a sensible answer */
        free(c);
        free(p);
        return argmax(logits, V);
    }
    /* The candidates in order: the top k, or (nucleus alone) the best k for a k grown
     * until they hold top_p of the whole mass, which then contains the nucleus. */
    double total = 0.0;
    if (!top_k)
        for (int64_t i = 0; i < V; i++)
            if (valid(logits[i])) total += exp(((double)clamp_inf(logits[i]) - lmax) * inv_t);
    int64_t k = top_k ? cfg->top_k : 64, n;
    for (;;) {
        n = candidates(logits, V, k < n_valid ? k : 0, c);
        double cum = 0.0;
        for (int64_t i = 0; i < n; i++) cum += p[i] = exp(((double)c[i].logit - lmax) * inv_t);
        if (top_k) total = cum;
        if (top_k || n >= n_valid || cum >= (double)cfg->top_p * total) break;
        k = k * 16 < n_valid / 4 ? k * 16 : n_valid; /* a wide nucleus: sort them all */
    }
    /* nucleus: the smallest prefix whose probability reaches top_p (at least one) */
    if (nucleus) {
        double want = (double)cfg->top_p * total, cum = 0.0;
        int64_t keep = 0;
        while (keep < n && (keep == 0 || cum < want)) cum += p[keep++];
        n = keep;
        total = cum;
    }
    /* inverse CDF of the renormalised distribution */
    double target = target_u * total, cum = 0.0;
    int32_t id = c[n - 1].id;
    for (int64_t i = 0; i < n; i++) {
        cum += p[i];
        if (target < cum) {
            id = c[i].id;
            break;
        }
    }
    free(c);
    free(p);
    return id;
}
