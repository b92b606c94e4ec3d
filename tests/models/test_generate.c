/* Generation: the KV-cached forward equals the full forward, the sampler's greedy,
 * top-k, top-p and temperature behave as specified and its draws follow the
 * distribution, and anneal_gpt2_generate (with the context-overflow rebuild) equals a
 * hand-rolled loop over anneal_gpt2_forward. */
#include "anneal/anneal.h"
#include "test.h"

/* A tiny random GPT-2: 2 layers, 4 heads, 32 channels. */
static anneal_gpt2 *tiny_model(int vocab, int n_ctx, uint64_t seed) {
    anneal_model_config c = {.n_layer = 2, .n_head = 4, .n_embd = 32, .vocab_size = vocab,
                            .n_ctx = n_ctx, .dropout = 0.0f, .norm_eps = 1e-5f};
    anneal_gpt2 *m = anneal_gpt2_new(&c);
    if (m && anneal_gpt2_init(m, seed) != ANNEAL_OK) {
        anneal_gpt2_free(m);
        return NULL;
    }
    /* larger weights than GPT-2's init so the logits are far from uniform */
    anneal_scope *sc = anneal_scope_open();
    for (int l = 0; m && l < c.n_layer; l++) {
        anneal_init_normal_(m->blocks[l].attn.qkv.weight, 0.0f, 0.3f);
        anneal_init_normal_(m->blocks[l].mlp.fc.weight, 0.0f, 0.2f);
    }
    if (m) anneal_init_normal_(m->wte.weight, 0.0f, 0.15f);
    if (m) anneal_init_normal_(m->wpe.weight, 0.0f, 1.0f); /* positions matter: a shifted window shows */
    anneal_scope_close(sc);
    return m;
}

static int32_t lcg_id(uint64_t *s, int V) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int32_t)((*s >> 33) % (uint64_t)V);
}

TEST(cached_forward_matches_full_forward) {
    anneal_clear_error();
    enum { V = 64, B = 2, T = 10 };
    anneal_gpt2 *m = tiny_model(V, 32, 7);
    REQUIRE(m);
    int32_t ids[B * T];
    uint64_t s = 3;
    for (int i = 0; i < B * T; i++) ids[i] = lcg_id(&s, V);
    anneal_scope *sc = anneal_scope_open();
    anneal_no_grad_begin();
    anneal_tensor *full = anneal_gpt2_forward(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, ids));
    anneal_no_grad_end();
    REQUIRE(full);
    const float *F = anneal_data(full);
    anneal_kv_cache *kv = anneal_model_kv_cache_new(&m->base, B, 16);
    REQUIRE(kv);
    const int chunks[] = {5, 1, 1, 3};
    int at = 0;
    for (int c = 0; c < 4; c++) {
        int n = chunks[c];
        int32_t part[B * 5];
        for (int b = 0; b < B; b++)
            for (int t = 0; t < n; t++) part[b * n + t] = ids[b * T + at + t];
        anneal_tensor *pid = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, n}, part);
        int64_t before = anneal_scope_count(sc);
        anneal_tensor *lg = anneal_model_forward_cached(&m->base, kv, pid);
        REQUIRE(lg);
        /* only the logits are added to the caller's scope: intermediates died inside */
        CHECK(anneal_scope_count(sc) == before + 1, "scope grew by %lld", (long long)(anneal_scope_count(sc) - before));
        CHECK(lg->ndim == 3 && lg->shape[0] == B && lg->shape[1] == n && lg->shape[2] == V, "shape");
        CHECK(!lg->requires_grad && !lg->grad_fn, "no autograd");
        float want[B * 5 * 64];
        for (int b = 0; b < B; b++)
            memcpy(want + (size_t)b * n * V, F + ((size_t)b * T + at) * V, sizeof(float) * (size_t)n * V);
        float got[B * 5 * 64];
        REQUIRE(anneal_to_f32_buffer(lg, got) == ANNEAL_OK);
        CHECK_ALLCLOSE(got, want, (int64_t)B * n * V, 1e-5, 0.0);
        at += n;
        CHECK(anneal_kv_cache_len(kv) == at, "cache len %lld", (long long)anneal_kv_cache_len(kv));
    }
    /* past max_len: a shape error, the cache unchanged */
    anneal_clear_error();
    anneal_tensor *too_many = anneal_zeros(ANNEAL_I32, 2, (int64_t[]){B, 7});
    CHECK(anneal_model_forward_cached(&m->base, kv, too_many) == NULL && anneal_last_status() == ANNEAL_ERR_SHAPE,
          "exceeding max_len: %s", anneal_last_error());
    CHECK(anneal_kv_cache_len(kv) == 10, "len after failure");
    /* wrong batch */
    anneal_clear_error();
    CHECK(anneal_model_forward_cached(&m->base, kv, anneal_zeros(ANNEAL_I32, 2, (int64_t[]){1, 1})) == NULL &&
              anneal_last_status() == ANNEAL_ERR_SHAPE, "wrong batch accepted");
    /* reset: the first chunk again gives the first rows again */
    anneal_clear_error();
    anneal_kv_cache_reset(kv);
    CHECK(anneal_kv_cache_len(kv) == 0, "reset");
    int32_t first[B * 2] = {ids[0], ids[1], ids[T], ids[T + 1]};
    anneal_tensor *lg = anneal_model_forward_cached(&m->base, kv, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, 2}, first));
    REQUIRE(lg);
    float got[B * 2 * 64], want[B * 2 * 64];
    REQUIRE(anneal_to_f32_buffer(lg, got) == ANNEAL_OK);
    memcpy(want, F, sizeof(float) * 2 * V);
    memcpy(want + 2 * V, F + (size_t)T * V, sizeof(float) * 2 * V);
    CHECK_ALLCLOSE(got, want, B * 2 * V, 1e-5, 0.0);
    /* max_len beyond n_ctx is refused */
    anneal_clear_error();
    CHECK(anneal_model_kv_cache_new(&m->base, 1, 33) == NULL && anneal_last_status() == ANNEAL_ERR_ARG, "max_len > n_ctx");
    anneal_clear_error();
    anneal_kv_cache_free(kv);
    anneal_scope_close(sc);
    anneal_gpt2_free(m);
}

/* ------------------------------------------------------------------ sampler */

static anneal_sampler_config scfg(float temp, int k, float p, uint64_t seed) {
    return (anneal_sampler_config){.temperature = temp, .top_k = k, .top_p = p, .seed = seed};
}

TEST(greedy_is_argmax_with_lowest_id_on_ties) {
    const float x[6] = {1.0f, 3.0f, NAN, 3.0f, 2.0f, -INFINITY};
    anneal_sampler_config c = scfg(0.0f, 0, 1.0f, 1);
    for (uint64_t pos = 0; pos < 20; pos++) CHECK(anneal_sample_logits(x, 6, &c, pos) == 1, "greedy");
    c.temperature = -1.0f;
    CHECK(anneal_sample_logits(x, 6, &c, 0) == 1, "negative temperature is greedy");
    const float nan_only[2] = {NAN, NAN};
    CHECK(anneal_sample_logits(nan_only, 2, &c, 0) == 0, "all NaN");
    CHECK(anneal_sample_logits(x, 0, &c, 0) == -1, "V = 0");
}

TEST(top_k_one_and_tiny_top_p_are_argmax) {
    float x[100];
    uint64_t s = 11;
    for (int i = 0; i < 100; i++) x[i] = (float)lcg_id(&s, 1000) / 300.0f;
    int best = 0;
    for (int i = 1; i < 100; i++)
        if (x[i] > x[best]) best = i;
    const float temps[] = {0.1f, 1.0f, 5.0f, 100.0f};
    for (int t = 0; t < 4; t++)
        for (uint64_t pos = 0; pos < 200; pos++) {
            anneal_sampler_config k1 = scfg(temps[t], 1, 1.0f, 5), p0 = scfg(temps[t], 0, 1e-6f, 5);
            CHECK(anneal_sample_logits(x, 100, &k1, pos) == best, "top_k 1 at T %g", (double)temps[t]);
            CHECK(anneal_sample_logits(x, 100, &p0, pos) == best, "top_p tiny at T %g", (double)temps[t]);
        }
}

/* Pearson chi-square of counts against probabilities (cells with p = 0 must be empty). */
static double chi_square(const int *count, const double *p, int V, int n, bool *impossible) {
    double chi = 0.0;
    *impossible = false;
    for (int i = 0; i < V; i++) {
        if (p[i] == 0.0) {
            if (count[i]) *impossible = true;
            continue;
        }
        double e = p[i] * n;
        chi += (count[i] - e) * (count[i] - e) / e;
    }
    return chi;
}

/* Expected distribution in double: softmax(x/T), then the k best (k <= 0: all), then
 * the smallest prefix (by probability, ties by id) reaching top_p; renormalised. */
static void expected(const float *x, int V, float T, int k, float top_p, double *p) {
    int order[64];
    for (int i = 0; i < V; i++) order[i] = i;
    for (int i = 0; i < V; i++) /* selection sort: descending logit, ascending id */
        for (int j = i + 1; j < V; j++)
            if (x[order[j]] > x[order[i]] || (x[order[j]] == x[order[i]] && order[j] < order[i])) {
                int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    int n = k > 0 && k < V ? k : V;
    double z = 0.0, w[64] = {0};
    for (int i = 0; i < n; i++) z += w[i] = exp((double)x[order[i]] / T);
    int keep = n;
    if (top_p < 1.0f) {
        double cum = 0.0;
        for (keep = 0; keep < n && (keep == 0 || cum < top_p);) cum += w[keep++] / z;
    }
    double zk = 0.0;
    for (int i = 0; i < keep; i++) zk += w[i];
    for (int i = 0; i < V; i++) p[i] = 0.0;
    for (int i = 0; i < keep; i++) p[order[i]] = w[i] / zk;
}

TEST(draws_follow_the_distribution) {
    /* 20000 draws of V = 5 at positions 0..19999. Chi-square with 4 degrees of freedom:
     * 18.47 is its 0.999 quantile, so a correct sampler fails with probability 1e-3
     * (and the draws are deterministic: this either always passes or always fails). */
    const float x[5] = {0.5f, -1.0f, 1.2f, 0.0f, 0.3f};
    const int N = 20000;
    struct { float T; int k; float p; double crit; } cases[] = {
        {1.0f, 0, 1.0f, 18.47},  /* plain softmax, 4 dof */
        {2.0f, 0, 1.0f, 18.47},  /* temperature */
        {0.5f, 0, 1.0f, 18.47},
        {1.0f, 3, 1.0f, 13.82},  /* top-3: 2 dof */
        {1.0f, 0, 0.7f, 13.82},  /* nucleus of 0.7: {2, 0, 4} here, 2 dof */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        double p[5];
        expected(x, 5, cases[c].T, cases[c].k, cases[c].p, p);
        int count[5] = {0};
        anneal_sampler_config sc = scfg(cases[c].T, cases[c].k, cases[c].p, 1234 + c);
        for (int i = 0; i < N; i++) {
            int32_t id = anneal_sample_logits(x, 5, &sc, (uint64_t)i);
            REQUIRE(id >= 0 && id < 5);
            count[id]++;
        }
        bool impossible;
        double chi = chi_square(count, p, 5, N, &impossible);
        CHECK(!impossible, "case %zu: sampled an id outside the kept set", c);
        CHECK(chi < cases[c].crit, "case %zu: chi-square %.2f >= %.2f (counts %d %d %d %d %d)", c, chi,
              cases[c].crit, count[0], count[1], count[2], count[3], count[4]);
        if (c == 4) CHECK(p[1] == 0.0 && p[3] == 0.0 && p[0] > 0.0, "nucleus set as expected");
    }
}

TEST(top_k_never_samples_outside_the_k_best) {
    /* V = 60 near-equal logits, k = 5: the heap selection and the ids it keeps */
    float x[60];
    uint64_t s = 99;
    for (int i = 0; i < 60; i++) x[i] = (float)lcg_id(&s, 1000) / 2000.0f;
    x[17] = x[3]; /* a tie */
    double p[60];
    expected(x, 60, 1.0f, 5, 1.0f, p);
    int count[60] = {0};
    anneal_sampler_config sc = scfg(1.0f, 5, 1.0f, 77);
    for (int i = 0; i < 10000; i++) count[anneal_sample_logits(x, 60, &sc, (uint64_t)i)]++;
    bool impossible;
    double chi = chi_square(count, p, 60, 10000, &impossible);
    CHECK(!impossible, "sampled outside the top 5");
    CHECK(chi < 18.47, "chi-square %.2f over the top 5", chi);
    int kept = 0;
    for (int i = 0; i < 60; i++) kept += count[i] > 0;
    CHECK(kept == 5, "%d distinct ids sampled", kept);
    /* a tie across the boundary keeps the lowest id: top 3 of these is {1, 4, 2} */
    const float y[6] = {1.0f, 4.0f, 2.0f, 2.0f, 3.0f, 2.0f};
    int cy[6] = {0};
    sc = scfg(2.0f, 3, 1.0f, 78);
    for (int i = 0; i < 3000; i++) cy[anneal_sample_logits(y, 6, &sc, (uint64_t)i)]++;
    CHECK(cy[2] > 0 && cy[3] == 0 && cy[5] == 0 && cy[0] == 0, "tie at the top-k boundary: %d %d %d %d",
          cy[0], cy[2], cy[3], cy[5]);
}

static const float *sort_logits;
static int by_logit_then_id(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    if (sort_logits[i] != sort_logits[j]) return sort_logits[i] > sort_logits[j] ? -1 : 1;
    return i - j;
}

TEST(nucleus_over_a_wide_vocabulary) {
    /* V = 6000 flat logits: a nucleus of hundreds of ids, past the sampler's first
     * guesses of its size. Reference: a full sort in double. Every draw must be in the
     * nucleus; grouped by rank into 6 cells of about equal mass, chi-square (5 dof)
     * below its 0.999 quantile 20.52. */
    enum { V = 6000, N = 6000, CELLS = 6 };
    static float x[V];
    static int order[V];
    static double w[V];
    uint64_t s = 4242;
    for (int i = 0; i < V; i++) x[i] = (float)lcg_id(&s, 100000) / 50000.0f, order[i] = i;
    const float temp = 0.7f, top_p = 0.12f;
    sort_logits = x;
    qsort(order, V, sizeof order[0], by_logit_then_id);
    double z = 0;
    for (int i = 0; i < V; i++) z += w[i] = exp((double)x[order[i]] / temp);
    int keep = 0;
    double cum = 0;
    while (keep < V && (keep == 0 || cum < top_p)) cum += w[keep++] / z;
    CHECK(keep > 200 && keep < 1000, "nucleus of %d ids", keep);
    static int rank_of[V];
    for (int i = 0; i < V; i++) rank_of[order[i]] = i;
    int cell_of_rank[V], count[CELLS] = {0};
    double mass[CELLS] = {0}, acc = 0;
    for (int r = 0; r < keep; r++) {
        int cell = (int)(CELLS * acc / cum);
        cell_of_rank[r] = cell > CELLS - 1 ? CELLS - 1 : cell;
        mass[cell_of_rank[r]] += w[r] / z / cum;
        acc += w[r] / z;
    }
    anneal_sampler_config sc = scfg(temp, 0, top_p, 31);
    int outside = 0;
    for (int i = 0; i < N; i++) {
        int id = anneal_sample_logits(x, V, &sc, (uint64_t)i);
        REQUIRE(id >= 0 && id < V);
        if (rank_of[id] >= keep) outside++;
        else count[cell_of_rank[rank_of[id]]]++;
    }
    CHECK(outside == 0, "%d draws outside the nucleus", outside);
    bool impossible;
    double chi = chi_square(count, mass, CELLS, N, &impossible);
    CHECK(chi < 20.52, "chi-square %.2f over %d rank groups", chi, CELLS);
}

TEST(sampling_is_deterministic_per_seed_and_position) {
    float x[50];
    for (int i = 0; i < 50; i++) x[i] = sinf((float)i) * 2.0f;
    anneal_sampler_config a = scfg(1.0f, 40, 0.95f, 5), b = scfg(1.0f, 40, 0.95f, 6);
    int differ = 0;
    for (uint64_t pos = 0; pos < 200; pos++) {
        int32_t i1 = anneal_sample_logits(x, 50, &a, pos), i2 = anneal_sample_logits(x, 50, &a, pos);
        CHECK(i1 == i2, "same seed and position gave %d then %d", i1, i2);
        differ += i1 != anneal_sample_logits(x, 50, &b, pos);
    }
    CHECK(differ > 50, "another seed changed only %d of 200 draws", differ);
}

/* ----------------------------------------------------------------- generate */

typedef struct collect {
    int32_t ids[128];
    int n, stop_after;
} collect;

static bool on_token(int32_t id, void *user) {
    collect *c = user;
    if (c->n < 128) c->ids[c->n++] = id;
    return c->stop_after <= 0 || c->n < c->stop_after;
}

/* The policy by hand with the full forward: the model sees seq[start:], and when that
 * would exceed n_ctx the window restarts from the last n_ctx/2 tokens. */
static int reference(anneal_gpt2 *m, const int32_t *prompt, int n_prompt, int max_new,
                     const anneal_sampler_config *c, int32_t *out) {
    int n_ctx = m->base.cfg.n_ctx, V = m->base.cfg.vocab_size;
    int32_t seq[256];
    memcpy(seq, prompt, sizeof(int32_t) * (size_t)n_prompt);
    int n = n_prompt, start = 0;
    float *row = malloc(sizeof(float) * (size_t)V);
    anneal_no_grad_begin();
    for (int i = 0; i < max_new; i++) {
        if (n - start > n_ctx) start = n - n_ctx / 2;
        anneal_scope *sc = anneal_scope_open();
        anneal_tensor *lg = anneal_gpt2_forward(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){1, n - start}, seq + start));
        bool ok = lg && anneal_to_f32_buffer(anneal_narrow(lg, 1, n - start - 1, 1), row) == ANNEAL_OK;
        anneal_scope_close(sc);
        if (!ok) break;
        out[i] = seq[n] = anneal_sample_logits(row, V, c, (uint64_t)n);
        n++;
    }
    anneal_no_grad_end();
    free(row);
    return n - n_prompt;
}

TEST(generate_matches_hand_rolled_loop_with_context_rebuilds) {
    anneal_clear_error();
    anneal_gpt2 *m = tiny_model(48, 16, 21);
    REQUIRE(m);
    const int32_t prompt[5] = {1, 7, 3, 30, 12};
    anneal_sampler_config cfgs[3] = {scfg(0.0f, 0, 1.0f, 0), scfg(1.0f, 0, 1.0f, 8), scfg(0.9f, 10, 0.9f, 9)};
    for (int c = 0; c < 3; c++) {
        int32_t want[40];
        REQUIRE(reference(m, prompt, 5, 40, &cfgs[c], want) == 40);
        collect got = {.n = 0};
        anneal_status s = anneal_model_generate(&m->base, prompt, 5, 40, &cfgs[c], -1, on_token, &got);
        CHECK(s == ANNEAL_OK, "generate: %s", anneal_last_error());
        REQUIRE(got.n == 40);
        int first_diff = -1;
        for (int i = 0; i < 40 && first_diff < 0; i++)
            if (got.ids[i] != want[i]) first_diff = i;
        CHECK(first_diff < 0, "config %d: token %d differs: %d vs %d", c, first_diff,
              first_diff >= 0 ? got.ids[first_diff] : 0, first_diff >= 0 ? want[first_diff] : 0);
        int distinct = 0;
        for (int i = 0; i < 48; i++) {
            bool seen = false;
            for (int j = 0; j < 40 && !seen; j++) seen = got.ids[j] == i;
            distinct += seen;
        }
        if (c == 1) CHECK(distinct >= 5, "sampling at T=1 produced only %d distinct ids", distinct);

        /* stop_id: generation ends before the first occurrence, which is not passed on */
        int32_t stop = want[9];
        int first = 0;
        while (want[first] != stop) first++;
        collect st = {.n = 0};
        CHECK(anneal_model_generate(&m->base, prompt, 5, 40, &cfgs[c], stop, on_token, &st) == ANNEAL_OK, "stop run");
        CHECK(st.n == first, "stop at %d: got %d tokens, want %d", stop, st.n, first);
        /* on_token returning false stops after that token */
        collect early = {.n = 0, .stop_after = 6};
        CHECK(anneal_model_generate(&m->base, prompt, 5, 40, &cfgs[c], -1, on_token, &early) == ANNEAL_OK, "early");
        CHECK(early.n == 6 && !memcmp(early.ids, want, sizeof(int32_t) * 6), "early stop gave %d tokens", early.n);
    }
    /* a prompt longer than n_ctx starts from its last n_ctx/2 tokens */
    int32_t long_prompt[21];
    uint64_t s = 5;
    for (int i = 0; i < 21; i++) long_prompt[i] = lcg_id(&s, 48);
    int32_t want[12];
    REQUIRE(reference(m, long_prompt, 21, 12, &cfgs[1], want) == 12);
    collect got = {.n = 0};
    CHECK(anneal_model_generate(&m->base, long_prompt, 21, 12, &cfgs[1], -1, on_token, &got) == ANNEAL_OK, "long prompt");
    CHECK(got.n == 12 && !memcmp(got.ids, want, sizeof want), "long prompt differs");
    /* bad arguments */
    anneal_clear_error();
    CHECK(anneal_model_generate(&m->base, prompt, 0, 5, &cfgs[0], -1, on_token, &got) == ANNEAL_ERR_ARG, "empty prompt");
    anneal_clear_error();
    const int32_t bad[2] = {1, 48};
    CHECK(anneal_model_generate(&m->base, bad, 2, 5, &cfgs[0], -1, on_token, &got) != ANNEAL_OK, "id out of range");
    anneal_clear_error();
    anneal_gpt2_free(m);
}

int main(void) {
    RUN(cached_forward_matches_full_forward);
    RUN(greedy_is_argmax_with_lowest_id_on_ties);
    RUN(top_k_one_and_tiny_top_p_are_argmax);
    RUN(draws_follow_the_distribution);
    RUN(top_k_never_samples_outside_the_k_best);
    RUN(nucleus_over_a_wide_vocabulary);
    RUN(sampling_is_deterministic_per_seed_and_position);
    RUN(generate_matches_hand_rolled_loop_with_context_rebuilds);
    return anneal_test_summary();
}
