/* The sampler every served (and generated) token goes through, anneal_sample_logits
 * over the whole vocabulary (temperature, no top-k / top-p), against a reference written
 * with libm's exp and an in-order sum: the sampler's own vectorized exp must pick the same
 * id on draws placed within about 1e-7 (relative) of the boundary between two ids, over
 * NaN, -inf, +inf and underflowing logits in the vector lanes and in the tail, and on the
 * full GPT-2 vocabulary. With top-p and top-k over a wide candidate set (the sampler
 * orders thousands of candidates with a radix sort): each draw is the reference's,
 * which orders them with qsort by (logit descending, id ascending), on logits full of
 * ties, both zeros, infinities and NaNs. */
#include "anneal/model.h"
#include "test.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

/* The sampler's uniform for (seed, position) (sample.c: Philox, stream "samp"). */
static double uniform(uint64_t seed, uint64_t position) {
    uint32_t r[4];
    anneal_philox4x32(seed, 0x73616d70u, position, r);
    uint64_t bits = ((uint64_t)(r[0] >> 5) << 26) | (r[1] >> 6);
    return (double)bits * (1.0 / 9007199254740992.0);
}

static bool ok(float l) { return !isnan(l) && l != -INFINITY; }
static float clampf(float l) { return l == INFINITY ? FLT_MAX : l; }

/* The reference draw; *margin = |target - the nearest cumulative boundary| / total. */
static int32_t reference(const float *x, int64_t V, float T, double u, double *margin) {
    float lmax = -INFINITY;
    for (int64_t i = 0; i < V; i++)
        if (ok(x[i]) && clampf(x[i]) > lmax) lmax = clampf(x[i]);
    const double inv_t = 1.0 / (double)T;
    double total = 0.0;
    for (int64_t i = 0; i < V; i++)
        if (ok(x[i])) total += exp(((double)clampf(x[i]) - lmax) * inv_t);
    double target = u * total, cum = 0.0, best = INFINITY;
    int32_t id = -1, last = 0;
    for (int64_t i = 0; i < V; i++) {
        if (!ok(x[i])) continue;
        last = (int32_t)i;
        cum += exp(((double)clampf(x[i]) - lmax) * inv_t);
        if (fabs(target - cum) < best) best = fabs(target - cum);
        if (id < 0 && target < cum) id = (int32_t)i;
    }
    *margin = best / total;
    return id < 0 ? last : id;
}

/* Draws at positions 0..n of seed with logit d (at index di; the other finite logit 0
 * at index zi) set so that the draw lands next to the boundary between the two ids;
 * every draw whose reference margin exceeds 1e-12 must match. */
static void boundary_draws(float *x, int64_t V, int64_t zi, int64_t di, uint64_t seed, int n) {
    static const float temps[] = {1.0f, 0.5f, 2.0f, 0.7f};
    int agree = 0, tested = 0, first = 0;
    for (int pos = 0; pos < n; pos++) {
        const float T = temps[pos % 4];
        const double u = uniform(seed, (uint64_t)pos);
        if (u < 1e-6 || u > 1.0 - 1e-6) continue;
        x[zi] = 0.0f;
        /* the weight ratio that puts the boundary at u: the first index's share is u */
        x[di] = (float)((double)T * (di > zi ? log((1.0 - u) / u) : log(u / (1.0 - u))));
        anneal_sampler_config c = {.temperature = T, .top_k = 0, .top_p = 1.0f, .seed = seed};
        double margin;
        const int32_t want = reference(x, V, T, u, &margin);
        if (margin < 1e-12) continue;
        const int32_t got = anneal_sample_logits(x, V, &c, (uint64_t)pos);
        tested++;
        agree += got == want;
        first += want == (zi < di ? zi : di);
        if (got != want && tested - agree <= 3)
            CHECK(false, "position %d, T %g, d %.9g: sampled %d, reference %d (margin %.3g)", pos, (double)T,
                  (double)x[di], got, want, margin);
    }
    CHECK(agree == tested && tested > n / 2, "%d of %d draws agree", agree, tested);
    /* the draws really sit on the boundary: either side about equally often */
    CHECK(first > tested / 4 && first < 3 * tested / 4, "%d of %d draws on the first side", first, tested);
}

TEST(draws_next_to_a_boundary_match_libm) {
    float x[2];
    boundary_draws(x, 2, 0, 1, 11, 4000);
}

TEST(invalid_and_underflowing_logits_in_lanes_and_tail) {
    /* V = 11: indices 0..7 go through the four-lane loop, 8..10 through the tail */
    float x[11] = {NAN, 0, -INFINITY, -800.0f, -1e30f, NAN, -INFINITY, -2000.0f, -INFINITY, 0, NAN};
    boundary_draws(x, 11, 1, 9, 12, 4000);
    boundary_draws(x, 11, 9, 1, 13, 4000); /* the finite pair the other way round */
    /* +inf counts as FLT_MAX: two of them share the mass, every other weight underflows */
    float y[5] = {-1.0f, INFINITY, 3.0f, NAN, INFINITY};
    anneal_sampler_config c = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 5};
    int bad = 0;
    for (int pos = 0; pos < 1000; pos++) {
        const int32_t want = uniform(5, (uint64_t)pos) * 2.0 < 1.0 ? 1 : 4;
        bad += anneal_sample_logits(y, 5, &c, (uint64_t)pos) != want;
    }
    CHECK(bad == 0, "%d of 1000 draws with two +inf logits differ", bad);
}

TEST(full_vocabulary_matches_libm) {
    const int64_t V = 50257;
    float *x = malloc((size_t)V * sizeof *x);
    REQUIRE(x);
    uint64_t s = 42;
    for (int64_t i = 0; i < V; i++) { /* a spread of logits like a model's: about N(0, 2.5) */
        double a = 0.0;
        for (int k = 0; k < 4; k++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            a += (double)(s >> 11) / 9007199254740992.0 - 0.5;
        }
        x[i] = (float)(a * 4.3);
    }
    int agree = 0, tested = 0;
    for (int pos = 0; pos < 300; pos++) {
        const float T = pos % 2 ? 0.8f : 1.0f;
        anneal_sampler_config c = {.temperature = T, .top_k = 0, .top_p = 1.0f, .seed = 99};
        double margin;
        const int32_t want = reference(x, V, T, uniform(99, (uint64_t)pos), &margin);
        if (margin < 1e-12) continue;
        tested++;
        agree += anneal_sample_logits(x, V, &c, (uint64_t)pos) == want;
    }
    CHECK(agree == tested && tested > 250, "%d of %d draws agree", agree, tested);
    free(x);
}

typedef struct ref_cand {
    float logit;
    int32_t id;
} ref_cand;

static int ref_cmp(const void *pa, const void *pb) {
    const ref_cand *a = pa, *b = pb;
    if (a->logit != b->logit) return a->logit > b->logit ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* The reference top-k / top-p draw: the valid logits in (logit descending, id
 * ascending) order by qsort, the best k (0: all), the smallest prefix whose weight
 * reaches top_p of the whole mass (of the k with top-k), an inverse-CDF draw over it;
 * *margin = the smaller of the cut's and the draw's distance to a boundary / total. */
static int32_t reference_sorted(const float *x, int64_t V, float T, int64_t k, float top_p, double u,
                                double *margin) {
    ref_cand *c = malloc((size_t)V * sizeof *c);
    double *w = malloc((size_t)V * sizeof *w);
    int64_t n = 0;
    float lmax = -INFINITY;
    for (int64_t i = 0; i < V; i++)
        if (ok(x[i])) {
            c[n++] = (ref_cand){clampf(x[i]), (int32_t)i};
            if (clampf(x[i]) > lmax) lmax = clampf(x[i]);
        }
    double total = 0.0; /* the whole mass, in id order (the sampler's order for it) */
    for (int64_t i = 0; i < V; i++)
        if (ok(x[i])) total += exp(((double)clampf(x[i]) - lmax) / (double)T);
    qsort(c, (size_t)n, sizeof *c, ref_cmp);
    if (k > 0 && k < n) n = k;
    double cum = 0.0;
    for (int64_t i = 0; i < n; i++) cum += w[i] = exp(((double)c[i].logit - lmax) / (double)T);
    if (k > 0) total = cum;
    *margin = INFINITY;
    if (top_p < 1.0f) {
        double want = (double)top_p * total;
        int64_t keep = 0;
        cum = 0.0;
        while (keep < n && (keep == 0 || cum < want)) {
            cum += w[keep++];
            if (fabs(cum - want) / total < *margin) *margin = fabs(cum - want) / total;
        }
        n = keep;
        total = cum;
    }
    double target = u * total;
    int32_t id = c[n - 1].id;
    cum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        cum += w[i];
        if (fabs(target - cum) / total < *margin) *margin = fabs(target - cum) / total;
        if (target < cum) {
            id = c[i].id;
            break;
        }
    }
    free(c);
    free(w);
    return id;
}

TEST(wide_nucleus_and_top_k_match_a_sorted_reference) {
    const int64_t V = 50257;
    float *x = malloc((size_t)V * sizeof *x);
    REQUIRE(x);
    uint64_t s = 7;
    for (int64_t i = 0; i < V; i++) { /* flat: 64 distinct values (ties everywhere) */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const int v = (int)(s >> 58);
        x[i] = v == 0 ? (i % 2 ? -0.0f : 0.0f) : (float)(v - 32) * 0.03125f;
        if (i % 997 == 5) x[i] = NAN;
        if (i % 1009 == 6) x[i] = -INFINITY;
    }
    x[40000] = 0.5f; /* +inf at the end */
    static const struct {
        float T, top_p;
        int64_t k;
    } runs[] = {{1.0f, 0.9f, 0}, {0.7f, 0.5f, 0}, {2.0f, 0.95f, 0}, {1.0f, 1.0f, 3000}, {1.0f, 0.8f, 20000}};
    int tested = 0, agree = 0;
    for (size_t r = 0; r < sizeof runs / sizeof *runs; r++)
        for (int pos = 0; pos < 40; pos++) {
            anneal_sampler_config c = {.temperature = runs[r].T, .top_k = (int)runs[r].k, .top_p = runs[r].top_p,
                                       .seed = 11 + r};
            double margin;
            const int32_t want =
                reference_sorted(x, V, runs[r].T, runs[r].k, runs[r].top_p, uniform(11 + r, (uint64_t)pos), &margin);
            if (margin < 1e-12) continue;
            const int32_t got = anneal_sample_logits(x, V, &c, (uint64_t)pos);
            tested++;
            agree += got == want;
            if (got != want && tested - agree <= 3)
                CHECK(false, "run %zu position %d: sampled %d, reference %d (margin %.3g)", r, pos, got, want, margin);
        }
    printf("    %d of %d draws agree (the rest within 1e-12 of a boundary)\n", agree, tested);
    CHECK(agree == tested && tested > 150, "%d of %d draws agree", agree, tested);
    /* +inf (clamped to FLT_MAX) holds all the mass: every draw is it */
    x[40000] = INFINITY;
    anneal_sampler_config c = {.temperature = 1.0f, .top_k = 0, .top_p = 0.9f, .seed = 3};
    for (int pos = 0; pos < 5; pos++) CHECK(anneal_sample_logits(x, V, &c, (uint64_t)pos) == 40000, "+inf not drawn");
    free(x);
}

int main(void) {
    RUN(draws_next_to_a_boundary_match_libm);
    RUN(invalid_and_underflowing_logits_in_lanes_and_tail);
    RUN(full_vocabulary_matches_libm);
    RUN(wide_nucleus_and_top_k_match_a_sorted_reference);
    return anneal_test_summary();
}
