/* Picking the next token from logits: greedy argmax, or temperature, top-k, top-p
 * (nucleus) and one draw by inverse CDF with a uniform from Philox(seed, position).
 * The id depends only on the logits, the config and the position: no hidden state,
 * so a generation replays exactly and any position can be re-drawn on its own.
 * Candidates are ordered by (logit descending, id ascending), a total order, so ties
 * and truncation boundaries are deterministic; many of them (a wide nucleus, a large
 * top-k) by a stable radix sort that gives qsort's order in a few passes over them. */
#include "anneal/model.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The whole-vocabulary weight loop compiled for AVX2 and the baseline, picked at load
 * time; C11 mode keeps -ffp-contract=off, so both clones give the same bits. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SAMPLE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SAMPLE_CLONES
#endif

/* exp(x) for finite x <= 0 in plain IEEE double operations (so the loop below
 * vectorizes and every ISA gives the same bits), within a few ulp of libm: x = k ln2 + r
 * with |r| <= ln2 / 2 (k by the 1.5 * 2^52 rounding shift, ln2 split so k * ln2_hi is
 * exact), a degree-13 Taylor polynomial in r, times 2^k built from k's bits. Below -708
 * (exp under 2^-1021, nothing next to a weight sum of at least 1) it is 0. */
static inline __attribute__((always_inline)) double exp_nonpos(double x) {
    const double shift = 0x1.8p52, ln2_hi = 0x1.62e42fee00000p-1, ln2_lo = 0x1.a39ef35793c76p-33;
    const bool tiny = x < -708.0;
    const double xc = tiny ? -708.0 : x;
    const double kd = xc * 0x1.71547652b82fep0 + shift;
    uint64_t kb, sb;
    memcpy(&kb, &kd, sizeof kb);
    const double k = kd - shift, r = (xc - k * ln2_hi) - k * ln2_lo;
    double p = 1.0 / 6227020800.0; /* 1 / 13! */
    static const double inv_fact[13] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                        1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,     1.0 / 120.0,
                                        1.0 / 24.0,        1.0 / 6.0,        0.5,             1.0,
                                        1.0};
#pragma GCC unroll 13
    for (int i = 0; i < 13; i++) p = p * r + inv_fact[i];
    sb = (kb - 0x4338000000000000ull + 1023u) << 52; /* kb's low bits hold k: 2^k */
    double scale;
    memcpy(&scale, &sb, sizeof scale);
    return tiny ? 0.0 : p * scale;
}

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

/* The radix key of a candidate's logit (never NaN): keys ascend as logits descend, both
 * zeros one key (they compare equal). */
static inline uint32_t desc_key(float l) {
    if (l == 0.0f) l = 0.0f;
    uint32_t b;
    memcpy(&b, &l, sizeof b);
    b = b & 0x80000000u ? ~b : b | 0x80000000u; /* ascending with the float */
    return ~b;
}

#define RADIX_BITS 11
#define RADIX_SIZE (1 << RADIX_BITS)

/* Sorts c[0..n) (ids below V) into before()'s order by stable LSD radix passes of 11
 * bits: over the ids first unless in_id_order, then over the keys; false (c untouched)
 * when out of memory. */
static bool radix_sort(cand *c, int64_t n, int64_t V, bool in_id_order) {
    cand *tmp = malloc((size_t)n * sizeof *tmp);
    size_t *count = malloc(RADIX_SIZE * sizeof *count);
    if (!tmp || !count) {
        free(tmp);
        free(count);
        return false;
    }
    int id_passes = 0;
    if (!in_id_order)
        while (id_passes < 3 && ((V - 1) >> (RADIX_BITS * id_passes)) > 0) id_passes++;
    cand *src = c, *dst = tmp;
    for (int pass = 0; pass < id_passes + 3; pass++) {
        const bool by_id = pass < id_passes;
        const int shift = RADIX_BITS * (by_id ? pass : pass - id_passes);
        memset(count, 0, RADIX_SIZE * sizeof *count);
        for (int64_t i = 0; i < n; i++)
            count[((by_id ? (uint32_t)src[i].id : desc_key(src[i].logit)) >> shift) & (RADIX_SIZE - 1)]++;
        size_t at = 0;
        for (int b = 0; b < RADIX_SIZE; b++) {
            size_t k = count[b];
            count[b] = at;
            at += k;
        }
        for (int64_t i = 0; i < n; i++)
            dst[count[((by_id ? (uint32_t)src[i].id : desc_key(src[i].logit)) >> shift) & (RADIX_SIZE - 1)]++] =
                src[i];
        cand *t = src;
        src = dst;
        dst = t;
    }
    if (src != c) memcpy(c, src, (size_t)n * sizeof *c);
    free(tmp);
    free(count);
    return true;
}

/* The bucket of a key: its top 11 bits (buckets in logit order, highest first). */
static inline uint32_t bucket_of(float l) { return desc_key(l) >> (32 - RADIX_BITS); }

/* Fills c with the best min(k, n_valid) candidates in order (k <= 0: all those in
 * buckets up to cap); returns how many. A heap of the k best so far makes this
 * O(V log k), not a sort of all V. */
static int64_t candidates(const float *x, int64_t V, int64_t k, uint32_t cap, cand *c) {
    int64_t n = 0;
    bool heap = k > 0 && k < V;
    for (int64_t i = 0; i < V; i++) {
        float l = x[i];
        if (!valid(l) || (!heap && bucket_of(clamp_inf(l)) > cap)) continue;
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
    /* many: radix passes (the candidates are in id order unless they went through the heap) */
    if (n < 2048 || !radix_sort(c, n, V, !heap)) qsort(c, (size_t)n, sizeof *c, cmp_cand);
    return n;
}

/* The last of the leading buckets (bucket_of) that hold want of the weights w, plus a
 * margin for the order of the sum and one non-empty bucket more: the candidates up to
 * it are a prefix of the order that contains the nucleus (the last bucket when out of
 * memory). A wide nucleus (a flat distribution) then takes one ordering of those, not
 * a top-64, a top-1024 and then all of them. */
static uint32_t nucleus_bucket(const float *x, int64_t V, const double *w, double want) {
    double *mass = calloc(RADIX_SIZE, sizeof *mass);
    int64_t *count = calloc(RADIX_SIZE, sizeof *count);
    if (!mass || !count) {
        free(mass);
        free(count);
        return RADIX_SIZE - 1;
    }
    for (int64_t i = 0; i < V; i++)
        if (valid(x[i])) {
            const uint32_t b = bucket_of(clamp_inf(x[i]));
            mass[b] += w[i];
            count[b]++;
        }
    double cum = 0.0;
    int b = 0;
    for (; b < RADIX_SIZE && cum < want * (1.0 + 1e-9); b++) cum += mass[b];
    while (b < RADIX_SIZE - 1 && count[b] == 0) b++;
    free(mass);
    free(count);
    return (uint32_t)(b < RADIX_SIZE ? b : RADIX_SIZE - 1);
}

/* The unnormalised weight exp((logit - max) / T) of a valid logit. */
static inline __attribute__((always_inline)) double weight(float l, double lmax, double inv_t) {
    return exp_nonpos(((double)clamp_inf(l) - lmax) * inv_t);
}

/* Four doubles, four 64-bit integers, four floats: GNU C vectors, lowered to one AVX2
 * register or two SSE2 ones; lane-wise IEEE operations, the same bits either way. */
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* Lane-wise m ? a : b (m: all ones or all zeros per lane). */
#define SEL(m, a, b) ((v4d)(((v4i)(a) & (m)) | ((v4i)(b) & ~(m))))

/* *y = exp_nonpos of the four lanes of *x: the same operations, selects by lane masks
 * (vectors pass by pointer: their by-value ABI differs with and without AVX). */
static inline __attribute__((always_inline)) void exp_nonpos4(const v4d *x, v4d *y) {
    const v4d shift = {0x1.8p52, 0x1.8p52, 0x1.8p52, 0x1.8p52}, lo = {-708.0, -708.0, -708.0, -708.0};
    const v4i tiny = *x < lo;
    const v4d xc = SEL(tiny, lo, *x);
    const v4d kd = xc * 0x1.71547652b82fep0 + shift;
    const v4d k = kd - shift, r = (xc - k * 0x1.62e42fee00000p-1) - k * 0x1.a39ef35793c76p-33;
    static const double inv_fact[13] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                        1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,     1.0 / 120.0,
                                        1.0 / 24.0,        1.0 / 6.0,        0.5,             1.0,
                                        1.0};
    v4d p = r * 0.0 + 1.0 / 6227020800.0;
#pragma GCC unroll 13
    for (int i = 0; i < 13; i++) p = p * r + inv_fact[i];
    const v4i sb = ((v4i)kd - 0x4338000000000000ll + 1023) << 52;
    const v4d e = p * (v4d)sb;
    *y = (v4d)((v4i)e & ~tiny);
}

/* w[i] = the weight of logit i, 0 for NaN and -inf; four lanes at a time. */
SAMPLE_CLONES static void weights(const float *logits, int64_t V, double lmax, double inv_t, double *w) {
    const v4d big = {FLT_MAX, FLT_MAX, FLT_MAX, FLT_MAX}, inf = {INFINITY, INFINITY, INFINITY, INFINITY};
    int64_t i = 0;
    for (; i + 4 <= V; i += 4) {
        v4f l;
        memcpy(&l, logits + i, sizeof l);
        const v4d ld = __builtin_convertvector(l, v4d);
        const v4i ok = (ld == ld) & (ld != -inf);
        const v4d lc = SEL(ld == inf, big, ld);
        const v4d x = ((v4d)((v4i)lc & ok) - lmax) * inv_t; /* invalid lanes: any finite x */
        v4d e;
        exp_nonpos4(&x, &e);
        const v4d out = (v4d)((v4i)e & ok);
        memcpy(w + i, &out, sizeof out);
    }
    for (; i < V; i++) w[i] = valid(logits[i]) ? weight(logits[i], lmax, inv_t) : 0.0;
}

/* The sum of w[0..V) in four interleaved lanes (element i in lane i % 4, the lanes added
 * pairwise, then the tail in order): a fixed order, so the same bits on every ISA, and
 * four independent chains of additions rather than one. */
static double sum4(const double *w, int64_t V) {
    v4d acc = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= V; i += 4) {
        v4d x;
        memcpy(&x, w + i, sizeof x);
        acc += x;
    }
    double s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (; i < V; i++) s += w[i];
    return s;
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
        if (w) {
            weights(logits, V, lmax, inv_t, w);
            total = sum4(w, V);
        } else { /* sum4's order, each weight computed on the spot */
            double lane[4] = {0.0, 0.0, 0.0, 0.0};
            int64_t i = 0;
            for (const int64_t full = V - V % 4; i < full; i++)
                lane[i % 4] += valid(logits[i]) ? weight(logits[i], lmax, inv_t) : 0.0;
            total = (lane[0] + lane[1]) + (lane[2] + lane[3]);
            for (; i < V; i++) total += valid(logits[i]) ? weight(logits[i], lmax, inv_t) : 0.0;
        }
        double target = target_u * total;
        int32_t last = 0;
        for (int64_t i = 0; i < V; i++) {
            if (!valid(logits[i])) continue;
            last = (int32_t)i;
            cum += w ? w[i] : weight(logits[i], lmax, inv_t);
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
    /* The candidates in order: the top k, or (nucleus alone) the best 64 if they hold
     * top_p of the whole mass (a peaked distribution), else those of the leading buckets
     * that hold it, which then contain the nucleus. */
    double total = 0.0;
    int64_t k = top_k ? cfg->top_k : 64, n;
    uint32_t cap = RADIX_SIZE - 1;
    if (!top_k) {
        /* p as scratch: the weights (weights() gives weight()'s bits), summed in id order */
        weights(logits, V, lmax, inv_t, p);
        for (int64_t i = 0; i < V; i++)
            if (valid(logits[i])) total += p[i];
    }
    for (;;) {
        n = candidates(logits, V, k < n_valid ? k : 0, cap, c);
        double cum = 0.0;
        for (int64_t i = 0; i < n; i++) cum += p[i] = weight(c[i].logit, lmax, inv_t);
        if (top_k) total = cum;
        if (top_k || n >= n_valid || cum >= (double)cfg->top_p * total) break;
        if (k > 0) { /* a wide nucleus: the leading buckets (p was overwritten: the weights again) */
            weights(logits, V, lmax, inv_t, p);
            cap = nucleus_bucket(logits, V, p, (double)cfg->top_p * total);
            k = 0;
        } else {
            cap = RADIX_SIZE - 1; /* (the bound's margin fell short: all of them) */
        }
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
