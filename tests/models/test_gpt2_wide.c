/* GPT-2 against transformers at GPT-2's real head dimension and a vocabulary above 50k:
 * tests/fixtures/gpt2_wide.safetensors (gen_gpt2_wide.py: GPT2LMHeadModel, 1 layer, 2
 * heads of 64, n_embd 128, vocabulary 50304, batch 2 x 8). The ~6.5M weights are not in
 * the fixture: both sides draw them from the same counter-based generator (splitmix64
 * from the FNV-1a hash of each parameter's name, rounded once to f32). Compared: the loss,
 * every position's logsumexp over all 50304 logits, the logits of 2048 fixed columns,
 * each parameter's full gradient norm and its gradient at up to 2048 fixed elements.
 * Tolerances: about 10x the worst error measured (see each). */
#include "anneal/anneal.h"
#include "gpt2_fixture.h"
#include "test.h"

#include <stdlib.h>

/* Measured on AVX-512 (AVX512-BF16 CPU), ANNEAL_CPU_ISA=avx2 and portable, 1 and 2 threads. */
#define LOSS_RTOL 1e-6  /* relative; measured 0 (the same f32), 1e-6 = 16 f32 ulps */
#define LSE_ATOL 5e-6   /* |logsumexp difference| over the 16 positions; measured 4.7e-7 */
#define LOGIT_ATOL 2e-5 /* max |anneal - transformers| over 16 x 2048 logits; measured 1.73e-6 */
#define NORM_RTOL 2e-6  /* full gradient norms, relative; measured 1.5e-7 */
#define GRAD_TOL 1e-5   /* max |anneal - transformers| / max |transformers| of each parameter's
                           sampled gradient; measured 1.1e-6 */

static uint64_t fnv1a64(const char *s) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001B3ull;
    return h;
}

/* gen_gpt2_wide.py's weights(): scale * uniform[-1, 1), rounded once to f32. */
static void fill(anneal_tensor *t, const char *name) {
    float *p = anneal_data(t);
    const size_t len = strlen(name);
    const bool ln_w = len > 6 && (strstr(name, "ln_1.weight") || strstr(name, "ln_2.weight") || strstr(name, "ln_f.weight"));
    const bool bias = len > 5 && strcmp(name + len - 5, ".bias") == 0;
    const bool wte = strstr(name, "wte.weight") != NULL;
    anneal_test_rng_state = fnv1a64(name);
    for (int64_t i = 0; i < anneal_numel(t); i++) {
        const double u = (double)(anneal_test_next_u64() >> 40) / (double)(1 << 24) * 2.0 - 1.0;
        p[i] = (float)(ln_w ? 1.0 + 0.2 * u : bias ? 0.1 * u : wte ? 0.1 * u : 0.1 * u);
    }
}

static int meta_int(const anneal_safetensors *st, const char *k) {
    const char *v = anneal_safetensors_meta(st, k);
    return v ? atoi(v) : -1;
}

TEST(head_dim_64_and_vocab_50304_match_transformers) {
    anneal_safetensors *st = NULL;
    REQUIRE(anneal_safetensors_open(anneal_test_path("tests/fixtures/gpt2_wide.safetensors"), &st) == ANNEAL_OK);
    anneal_model_config cfg = {.arch = "gpt2", .n_layer = meta_int(st, "n_layer"), .n_head = meta_int(st, "n_head"),
                               .n_embd = meta_int(st, "n_embd"), .vocab_size = meta_int(st, "vocab_size"),
                               .n_ctx = meta_int(st, "n_ctx"), .dropout = 0.0f, .norm_eps = 1e-5f};
    REQUIRE(cfg.n_embd / cfg.n_head == 64 && cfg.vocab_size > 50000);
    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    REQUIRE(m);
    for (int i = 0; i < m->base.params->n; i++) fill(m->base.params->items[i].tensor, m->base.params->items[i].name);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *ids = anneal_safetensors_load(st, "input_ids", ANNEAL_I32);
    anneal_tensor *tg = anneal_safetensors_load(st, "targets", ANNEAL_I32);
    REQUIRE(ids && tg);
    anneal_tensor *logits = anneal_gpt2_forward(m, ids);
    anneal_tensor *loss = anneal_cross_entropy(logits, tg, -100);
    REQUIRE(loss && anneal_backward(loss) == ANNEAL_OK);
    const int64_t V = cfg.vocab_size, rows = anneal_numel(ids);
    float *lg = tensor_f32(logits);
    int64_t n = 0;

    float *ref_loss = entry_f32(st, "loss", &n);
    REQUIRE(ref_loss && n == 1);
    const double loss_e = fabs(anneal_item(loss) - ref_loss[0]) / fabs(ref_loss[0]);
    CHECK(loss_e <= LOSS_RTOL, "loss %.8f vs transformers %.8f", anneal_item(loss), ref_loss[0]);

    /* logsumexp of every position over the whole vocabulary (fixture in f64) */
    anneal_tensor *lse_t = anneal_safetensors_load(st, "lse", ANNEAL_F32);
    REQUIRE(lse_t && anneal_numel(lse_t) == rows);
    double lse_e = 0;
    for (int64_t r = 0; r < rows; r++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t v = 0; v < V; v++) mx = fmax(mx, lg[r * V + v]);
        for (int64_t v = 0; v < V; v++) sum += exp((double)lg[r * V + v] - mx);
        lse_e = fmax(lse_e, fabs(mx + log(sum) - anneal_item_at(lse_t, r)));
    }
    CHECK(lse_e <= LSE_ATOL, "logsumexp over the vocabulary off by %.3g", lse_e);

    /* the logits of the fixed columns */
    anneal_tensor *cols = anneal_safetensors_load(st, "logit_cols", ANNEAL_I32);
    float *ref = entry_f32(st, "logits", &n);
    REQUIRE(cols && ref);
    const int64_t nc = anneal_numel(cols);
    REQUIRE(n == rows * nc);
    float *got = malloc((size_t)n * sizeof *got);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < nc; c++) got[r * nc + c] = lg[r * V + (int64_t)anneal_item_at(cols, c)];
    int64_t w = 0;
    double logit_e = 0;
    for (int64_t k = 0; k < n; k++)
        if (fabs((double)got[k] - ref[k]) > logit_e) logit_e = fabs((double)got[k] - ref[k]), w = k;
    CHECK(logit_e <= LOGIT_ATOL, "logit %lld: %.9g vs transformers %.9g", (long long)w, got[w], ref[w]);
    free(got), free(ref), free(ref_loss), free(lg);

    /* gradients: full norms and fixed samples */
    double norm_e = 0, grad_e = 0;
    for (int i = 0; i < m->base.params->n; i++) {
        const anneal_param *p = &m->base.params->items[i];
        char name[300];
        REQUIRE(p->tensor->grad);
        float *g = tensor_f32(p->tensor->grad);
        double ss = 0;
        for (int64_t k = 0; k < anneal_numel(p->tensor); k++) ss += (double)g[k] * g[k];
        snprintf(name, sizeof name, "grad_norm.%s", p->name);
        anneal_tensor *gn = anneal_safetensors_load(st, name, ANNEAL_F32);
        snprintf(name, sizeof name, "grad_idx.%s", p->name);
        anneal_tensor *gi = anneal_safetensors_load(st, name, ANNEAL_I32);
        snprintf(name, sizeof name, "grad.%s", p->name);
        float *gr = entry_f32(st, name, &n);
        CHECK(gn && gi && gr && anneal_numel(gi) == n, "fixture entries of %s missing", p->name);
        if (gn && gi && gr && anneal_numel(gi) == n) {
            const double en = fabs(sqrt(ss) - anneal_item(gn)) / anneal_item(gn);
            CHECK(en <= NORM_RTOL, "%s: gradient norm %.9g vs transformers %.9g", p->name, sqrt(ss), anneal_item(gn));
            norm_e = fmax(norm_e, en);
            float *gs = malloc((size_t)n * sizeof *gs);
            for (int64_t k = 0; k < n; k++) gs[k] = g[(int64_t)anneal_item_at(gi, k)];
            double md = 0, mb = 0;
            for (int64_t k = 0; k < n; k++) {
                if (fabs((double)gs[k] - gr[k]) > md) md = fabs((double)gs[k] - gr[k]), w = k;
                mb = fmax(mb, fabs((double)gr[k]));
            }
            const double e = mb > 0 ? md / mb : md;
            CHECK(e <= GRAD_TOL, "%s: sampled element %lld: %.9g vs transformers %.9g (%.3g of the largest)", p->name,
                  (long long)w, gs[w], gr[w], e);
            grad_e = fmax(grad_e, e);
            free(gs);
        }
        free(gr);
        free(g);
    }
    printf("  loss %.8f: relative error %.3g; logsumexp %.3g; logits %.3g absolute; gradient samples %.3g of the "
           "largest; gradient norms %.3g relative\n", anneal_item(loss), loss_e, lse_e, logit_e, grad_e, norm_e);
    anneal_scope_close(s);
    anneal_gpt2_free(m);
    anneal_safetensors_close(st);
}

int main(void) {
    RUN(head_dim_64_and_vocab_50304_match_transformers);
    return anneal_test_summary();
}
