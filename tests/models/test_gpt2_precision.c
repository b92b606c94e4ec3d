/* GPT-2 with bf16 and f16 matmuls (anneal_model_set_compute) against PyTorch, on the
 * fixture of test_gpt2.c (tests/fixtures/gpt2_tiny.safetensors: weights, batch, fp32
 * logits, loss and gradients) and tests/fixtures/gpt2_tiny_precision.safetensors
 * (gen_gpt2_precision.py: a float64 GPT-2 that rounds both operands of every GEMM,
 * forward and backward, to bf16 / f16, and PyTorch's CPU autocast loss).
 *
 * Unit roundoff: a format with p significand bits (the implicit one included) rounds
 * to nearest with relative error at most u = 2^-p: bf16 p = 8, u = 2^-8 = 3.9e-3 (the
 * spacing just above 1.0 is 2^-7); f16 p = 11, u = 2^-11 = 4.9e-4; f32 u = 2^-24.
 *
 * 1. Against the rounded reference (the exact semantics anneal promises: at bf16 every
 *    GEMM's operands and the tile products of the bf16 attention, P and dS included, are
 *    rounded; at f16 the GEMMs only). anneal's f32 values differ from the float64
 *    reference's by a few f32 ulps, and an element that lies that close to a rounding
 *    boundary of the format rounds the other way (a "flip": one element moves by one
 *    bf16/f16 spacing). Flips are rare in bf16 (spacing 2^-7: probability ~1e-5 per
 *    rounded element) but not in f16 (2^-10: ~1e-3).
 *      bf16: a flip in a GEMM operand stays in its position (row), but one in an
 *            attention operand (a key, a value, a probability) moves the logits of the
 *            later positions of its sequence too, by up to ~1e-3 relative: on this batch
 *            two flips leave 14 of the 128 positions 4e-6..2e-3 away (normwise logits
 *            2.8e-4, late gradients 5e-4 from the reference), while every other position
 *            matches within 1.3e-7. So the check is per position. A position is clean
 *            when its logits are within CLEAN_TOL = 1e-6 of the reference (normwise over
 *            the vocabulary: 8x the f32 noise of an unflipped position, below what a flip
 *            reaching the logits does); at least half the positions must be clean (~0.02
 *            flips per position: measured 114 of 128). For each clean position with a
 *            target, the late gradients (ln_f, the last block's ln_2 and MLP, computed
 *            before the backward pass reaches any attention) of its own loss term (other
 *            targets ignored, scaled by 1 / the batch's count) are compared with that
 *            position's term of the reference (the fixture's bf16.late.* factors: those
 *            layers act on each position alone, so the late gradients are sums of
 *            per-position terms): at least 3/4 of the terms must be within 5e-5 normwise
 *            (the tolerance the whole batch had before the attention was rounded, when
 *            flips stayed local; measured: all but 1 of 109 within 1.1e-5 on AVX-512,
 *            all but 2 with ANNEAL_CPU_ISA=avx2 or portable: a flip in the backward pass
 *            moves its term by up to ~2e-3, and the gradients of the whole batch, sums of
 *            cancelling terms, by ~2e-4). Loss 1e-5 relative (also anneal_gpt2_loss,
 *            whose lm head + cross-entropy are fused).
 *      f16:  the loss within 1e-5 relative only (flips put the f16 logits ~1e-4 away,
 *            as far as the mistakes below; f16 is covered by part 2).
 *    The fixture records how far (normwise, whole batch) the same model lands when only
 *    ONE operand of each GEMM is rounded, when nothing is, and (logits) when the GEMMs are
 *    rounded but attention is not (anneal's earlier f32 attention): the test asserts
 *    these are >= 20x the tolerance, and that each leaves at most 1/8 of the positions'
 *    logits within 5e-5 (hence within CLEAN_TOL) and at most 1/8 of the loss terms' late
 *    gradients within 5e-5 (measured: 0, 0 and 4 of 128 positions and of 123 terms: a
 *    rounding mistake moves every position), so any of these mistakes fails here.
 * 2. Against the fp32 PyTorch reference, the normwise relative error
 *    ||x - x_fp32|| / ||x_fp32|| of the logits and of every gradient must look like
 *    rounding at that format: between u/4 and 4u. Each GEMM output carries at most
 *    2u relative error per product (two rounded operands, f32 accumulation); the
 *    roundings are independent, so along the 4L+1 = 9 GEMMs of this model they add
 *    in quadrature (measured: 0.8u for the logits, 0.7u-1.5u for gradients, for both
 *    formats). Rounding at the wrong format (f16 in a bf16 run: 8x less), accumulating
 *    in bf16 (~sqrt(K) u), or not rounding at all (~2^-24) falls outside. The errors
 *    of the two formats must also be in the ratio of their u (2^3 = 8; asserted in
 *    [4, 16]), and bf16 results must differ from fp32 ones (the path is taken).
 *    The loss averages 123 positions' errors: |loss - loss_fp32| <= u/4 relative.
 * 3. PyTorch's torch.autocast("cpu", bfloat16) loss (which also rounds GEMM outputs
 *    and attention to bf16): anneal's bf16 loss within 1e-4 relative (measured 1e-7). */
#include "anneal/anneal.h"
#include "test.h"

#include "gpt2_fixture.h"

#include <stdlib.h>

#define U_BF16 0.00390625        /* 2^-8 */


#define U_F16 0.00048828125      /* 2^-11 */
/* A position is clean (no flip reached its logits) when its logits are within this of
 * the rounded reference (normwise over the vocabulary): positions without a flip match
 * within 1.3e-7 (f32 noise, measured), flipped ones are 4e-6..2e-3 away. See part 1. */
#define CLEAN_TOL 1e-6

static anneal_safetensors *open_file(const char *rel) {
    anneal_safetensors *st = NULL;
    if (anneal_safetensors_open(anneal_test_path(rel), &st) != ANNEAL_OK) {
        anneal_test_fail(__FILE__, __LINE__, "cannot open %s: %s", rel, anneal_last_error());
        return NULL;
    }
    return st;
}

static int meta_int(const anneal_safetensors *st, const char *k) {
    const char *v = anneal_safetensors_meta(st, k);
    return v ? atoi(v) : -1;
}

static double meta_double(const anneal_safetensors *st, const char *k) {
    const char *v = anneal_safetensors_meta(st, k);
    return v ? atof(v) : NAN;
}


/* What one forward + backward at a matmul dtype produced. */
typedef struct result {
    float *logits;
    int64_t n_logits;
    double loss;
    double fused_loss; /* anneal_gpt2_loss: lm head + cross-entropy fused, no grad */
    int n_params;
    char names[64][128];
    float *grads[64];
    int64_t n_grad[64];
} result;

static void result_free(result *r) {
    free(r->logits);
    for (int i = 0; i < r->n_params; i++) free(r->grads[i]);
    memset(r, 0, sizeof *r);
}

/* Logits, loss and gradients of the fixture model on the fixture batch with every
 * GEMM at matmul dtype dt (the thread's setting restored after). */
static bool run_at_targets(const anneal_safetensors *st, anneal_dtype dt, const int32_t *targets, float loss_scale,
                           result *r);
static bool run_at(const anneal_safetensors *st, anneal_dtype dt, result *r) {
    return run_at_targets(st, dt, NULL, 1.0f, r);
}

/* run_at with the fixture's targets replaced by `targets` (B*T of them; NULL: the
 * fixture's) and the loss multiplied by loss_scale before the backward pass. */
static bool run_at_targets(const anneal_safetensors *st, anneal_dtype dt, const int32_t *targets, float loss_scale,
                           result *r) {
    memset(r, 0, sizeof *r);
    anneal_model_config cfg = {.n_layer = meta_int(st, "n_layer"), .n_head = meta_int(st, "n_head"),
                              .n_embd = meta_int(st, "n_embd"), .vocab_size = meta_int(st, "vocab_size"),
                              .n_ctx = meta_int(st, "n_ctx"), .dropout = 0.0f, .norm_eps = 1e-5f};
    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    if (!m || anneal_params_load(m->base.params, st, "") != ANNEAL_OK || m->base.params->n > 64) {
        anneal_gpt2_free(m);
        return false;
    }
    bool ok = anneal_model_set_compute(&m->base, dt) == ANNEAL_OK;
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *ids = anneal_safetensors_load(st, "input_ids", ANNEAL_I32);
    anneal_tensor *tg = anneal_safetensors_load(st, "targets", ANNEAL_I32);
    if (tg && targets) tg = anneal_from_data(ANNEAL_I32, tg->ndim, tg->shape, targets);
    anneal_tensor *logits = ok ? anneal_gpt2_forward(m, ids) : NULL;
    anneal_tensor *loss = anneal_cross_entropy(logits, tg, -100);
    anneal_tensor *scaled = loss_scale != 1.0f ? anneal_scale(loss, loss_scale) : loss;
    ok = scaled && anneal_backward(scaled) == ANNEAL_OK;
    anneal_no_grad_begin();
    anneal_tensor *fused = ok ? anneal_gpt2_loss(m, ids, tg) : NULL;
    anneal_no_grad_end();
    ok = ok && fused;
    if (ok) {
        r->fused_loss = anneal_item(fused);
        r->logits = tensor_f32(logits);
        r->n_logits = anneal_numel(logits);
        r->loss = anneal_item(loss);
        r->n_params = m->base.params->n;
        for (int i = 0; i < m->base.params->n && ok; i++) {
            anneal_param *p = &m->base.params->items[i];
            snprintf(r->names[i], sizeof r->names[i], "%s", p->name);
            ok = p->tensor->grad != NULL;
            if (ok) r->grads[i] = tensor_f32(p->tensor->grad), r->n_grad[i] = anneal_numel(p->tensor->grad);
        }
    }
    anneal_scope_close(s);
    anneal_gpt2_free(m);
    return ok;
}

/* ||a - b|| / ||b|| over n values, in double. */
static double rel_norm_err(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Sum over the rows with keep[row] of the late gradient `which` (0..7: ln_f weight, bias,
 * ln_2 weight, bias, c_fc weight, bias, c_proj weight, bias) from the fixture's per-position
 * factors (gen_gpt2_precision.py: late_factors); n elements written to out (double). */
static bool late_reference(const anneal_safetensors *px, int which, const bool *keep, int64_t rows, double *out,
                           int64_t n) {
    static const char *fac[8][2] = {{"g_f", "xhat_f"}, {"g_f", NULL},        {"g_2", "xhat_2"}, {"g_2", NULL},
                                    {"r_h2", "r_dy_fc"}, {"dy_fc", NULL}, {"r_f", "r_dy_proj"}, {"dy_proj", NULL}};
    char name[128];
    int64_t na = 0, nb = 0;
    snprintf(name, sizeof name, "bf16.late.%s", fac[which][0]);
    float *a = entry_f32(px, name, &na), *b = NULL;
    if (fac[which][1]) {
        snprintf(name, sizeof name, "bf16.late.%s", fac[which][1]);
        b = entry_f32(px, name, &nb);
    }
    const int64_t wa = a ? na / rows : 0, wb = b ? nb / rows : 0;
    const bool outer = which == 4 || which == 6; /* a Conv1D weight: sum of r(x)^T r(dy) */
    bool ok = a && (!fac[which][1] || b) && (outer ? wa * wb == n : wa == n);
    for (int64_t i = 0; ok && i < n; i++) out[i] = 0.0;
    for (int64_t row = 0; ok && row < rows; row++) {
        if (!keep[row]) continue;
        const float *ar = a + row * wa, *br = b ? b + row * wb : NULL;
        if (outer)
            for (int64_t x = 0; x < wa; x++)
                for (int64_t y = 0; y < wb; y++) out[x * wb + y] += (double)ar[x] * br[y];
        else
            for (int64_t x = 0; x < wa; x++) out[x] += br ? (double)ar[x] * br[x] : (double)ar[x];
    }
    free(a), free(b);
    return ok;
}

/* ||a - b|| / ||b|| with a double reference. */
static double rel_norm_err_d(const float *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Part 1 at bf16: anneal against the rounded reference, per position (see the top): at
 * least half the positions clean (logits within CLEAN_TOL), the late gradients of at
 * least 3/4 of their loss terms within tol, the loss within 1e-5 relative, and the recorded controls at least
 * min_control * tol away with at most 1/8 of the positions within tol. */
static void check_bf16_against_rounded(double tol, double min_control) {
    anneal_safetensors *st = open_file("tests/fixtures/gpt2_tiny.safetensors");
    anneal_safetensors *px = open_file("tests/fixtures/gpt2_tiny_precision.safetensors");
    REQUIRE(st && px);
    result r;
    REQUIRE(run_at(st, ANNEAL_BF16, &r));
    int64_t n = 0, nt = 0;
    float *ref = entry_f32(px, "bf16.logits", &n);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *tgt = anneal_safetensors_load(st, "targets", ANNEAL_I32);
    float *tg = tgt ? tensor_f32(tgt) : NULL; /* small integers: exact as f32 */
    nt = tgt ? anneal_numel(tgt) : 0;
    anneal_scope_close(sc);
    REQUIRE(ref && n == r.n_logits && tg && nt > 0 && n % nt == 0);
    const int64_t rows = nt, V = n / nt;
    bool *keep = calloc((size_t)rows, sizeof *keep);
    int32_t *tmask = malloc((size_t)rows * sizeof *tmask);
    int64_t n_clean = 0, kept_all = 0;
    double worst_clean = 0, worst_dirty = 0;
    for (int64_t i = 0; i < rows; i++) {
        const double e = rel_norm_err(r.logits + i * V, ref + i * V, V);
        keep[i] = e <= CLEAN_TOL;
        n_clean += keep[i];
        if (keep[i] && e > worst_clean) worst_clean = e;
        if (!keep[i] && e > worst_dirty) worst_dirty = e;
        const int32_t t = (int32_t)tg[i];
        kept_all += t != -100;
    }
    CHECK(2 * n_clean >= rows, "bf16: only %lld of %lld positions have logits within %.3g of the rounded reference",
          (long long)n_clean, (long long)rows, CLEAN_TOL);
    float *ref_loss = entry_f32(px, "bf16.loss", &n);
    REQUIRE(ref_loss);
    CHECK(fabs(r.loss - ref_loss[0]) <= 1e-5 * fabs(ref_loss[0]), "bf16 loss %.8f vs rounded reference %.8f", r.loss,
          ref_loss[0]);
    CHECK(fabs(r.fused_loss - ref_loss[0]) <= 1e-5 * fabs(ref_loss[0]), "bf16 fused loss %.8f vs rounded reference %.8f",
          r.fused_loss, ref_loss[0]);
    free(ref_loss);

    /* Per clean position with a target: the late gradients of its own loss term (the other
     * targets ignored; scaled by 1 / the batch's count, as the reference factors are)
     * against the reference's contribution of that position. */
    char late[8][128];
    const int L = meta_int(st, "n_layer") - 1;
    snprintf(late[0], 128, "transformer.ln_f.weight");
    snprintf(late[1], 128, "transformer.ln_f.bias");
    snprintf(late[2], 128, "transformer.h.%d.ln_2.weight", L);
    snprintf(late[3], 128, "transformer.h.%d.ln_2.bias", L);
    snprintf(late[4], 128, "transformer.h.%d.mlp.c_fc.weight", L);
    snprintf(late[5], 128, "transformer.h.%d.mlp.c_fc.bias", L);
    snprintf(late[6], 128, "transformer.h.%d.mlp.c_proj.weight", L);
    snprintf(late[7], 128, "transformer.h.%d.mlp.c_proj.bias", L);
    bool *one = calloc((size_t)rows, sizeof *one);
    int64_t n_checked = 0, n_match = 0;
    double worst_match = 0, worst_g = 0;
    const int64_t stride = anneal_test_sanitized() ? 4 : 1; /* a forward + backward each: every 4th under ASan */
    for (int64_t pos = 0; pos < rows; pos += stride) {
        if (!keep[pos] || (int32_t)tg[pos] == -100) continue;
        for (int64_t i = 0; i < rows; i++) tmask[i] = i == pos ? (int32_t)tg[i] : -100, one[i] = i == pos;
        result rm;
        REQUIRE(run_at_targets(st, ANNEAL_BF16, tmask, (float)(1.0 / (double)kept_all), &rm));
        double e_pos = 0;
        for (int w = 0; w < 8; w++) {
            int pi = -1;
            for (int i = 0; i < rm.n_params; i++)
                if (!strcmp(rm.names[i], late[w])) pi = i;
            REQUIRE(pi >= 0);
            double *lref = malloc((size_t)rm.n_grad[pi] * sizeof *lref);
            REQUIRE(late_reference(px, w, one, rows, lref, rm.n_grad[pi]));
            const double e = rel_norm_err_d(rm.grads[pi], lref, rm.n_grad[pi]);
            if (e > e_pos) e_pos = e;
            free(lref);
        }
        result_free(&rm);
        n_checked++;
        if (e_pos <= tol) {
            n_match++;
            if (e_pos > worst_match) worst_match = e_pos;
        }
        if (e_pos > worst_g) worst_g = e_pos;
    }
    CHECK(4 * n_match >= 3 * n_checked,
          "bf16: only %lld of %lld loss terms of clean positions have late gradients within %.3g of the reference",
          (long long)n_match, (long long)n_checked, tol);
    printf("  bf16 vs rounded reference: %lld of %lld positions clean (logits up to %.3g; the others %.3g at most); "
           "late gradients of %lld of their %lld loss terms within %.3g (up to %.3g; all up to %.3g)\n",
           (long long)n_clean, (long long)rows, worst_clean, worst_dirty, (long long)n_match, (long long)n_checked, tol,
           worst_match, worst_g);
    free(one);

    const char *ctrls[5] = {"one_operand_logits", "one_operand_late_grads", "unrounded_logits", "unrounded_late_grads",
                            "attention_f32_logits"};
    char name[256];
    for (int i = 0; i < 5; i++) {
        snprintf(name, sizeof name, "bf16.%s", ctrls[i]);
        double x = meta_double(px, name);
        CHECK(x >= min_control * tol, "bf16: the %s control is only %.3g away (tolerance %.3g): the test could not tell",
              ctrls[i], x, tol);
    }
    const char *pos[3] = {"one_operand", "unrounded", "attention_f32"};
    const int terms = meta_int(px, "bf16.terms");
    CHECK(terms > 0, "fixture lacks bf16.terms");
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "bf16.%s_positions_within_tol", pos[i]);
        int x = meta_int(px, name);
        CHECK(x >= 0 && 8 * (int64_t)x <= rows, "bf16: the %s control leaves %d of %lld positions within tolerance",
              pos[i], x, (long long)rows);
        snprintf(name, sizeof name, "bf16.%s_terms_within_tol", pos[i]);
        x = meta_int(px, name);
        CHECK(x >= 0 && 8 * x <= terms, "bf16: the %s control leaves %d of %d loss terms' late gradients within "
              "tolerance", pos[i], x, terms);
    }
    free(ref), free(tg), free(keep), free(tmask);
    result_free(&r);
    anneal_safetensors_close(st);
    anneal_safetensors_close(px);
}

TEST(bf16_matches_the_rounded_reference) { check_bf16_against_rounded(5e-5, 20.0); }
TEST(f16_loss_matches_the_rounded_reference) {
    anneal_safetensors *st = open_file("tests/fixtures/gpt2_tiny.safetensors");
    anneal_safetensors *px = open_file("tests/fixtures/gpt2_tiny_precision.safetensors");
    REQUIRE(st && px);
    result r;
    REQUIRE(run_at(st, ANNEAL_F16, &r));
    int64_t n = 0;
    float *ref = entry_f32(px, "f16.loss", &n);
    REQUIRE(ref);
    CHECK(fabs(r.loss - ref[0]) <= 1e-5 * fabs(ref[0]), "f16 loss %.8f vs rounded reference %.8f", r.loss, ref[0]);
    CHECK(fabs(r.fused_loss - ref[0]) <= 1e-5 * fabs(ref[0]), "f16 fused loss %.8f vs rounded reference %.8f",
          r.fused_loss, ref[0]);
    free(ref);
    result_free(&r);
    anneal_safetensors_close(st);
    anneal_safetensors_close(px);
}

/* Largest normwise relative error over the logits and every gradient, and the
 * smallest, against the fp32 PyTorch reference; the loss's relative error. */
static bool errors_vs_fp32(const anneal_safetensors *st, const result *r, double *lo, double *hi, double *logit_e,
                           double *loss_e) {
    int64_t n = 0;
    float *ref = entry_f32(st, "logits", &n);
    if (!ref || n != r->n_logits) return free(ref), false;
    *logit_e = rel_norm_err(r->logits, ref, n);
    *lo = *hi = *logit_e;
    free(ref);
    ref = entry_f32(st, "loss", &n);
    if (!ref) return false;
    *loss_e = fabs(r->loss - ref[0]) / fabs(ref[0]);
    free(ref);
    for (int i = 0; i < r->n_params; i++) {
        char name[256];
        snprintf(name, sizeof name, "grad.%s", r->names[i]);
        ref = entry_f32(st, name, &n);
        if (!ref || n != r->n_grad[i]) return free(ref), false;
        double e = rel_norm_err(r->grads[i], ref, n);
        if (e < *lo) *lo = e;
        if (e > *hi) *hi = e;
        free(ref);
    }
    return true;
}

TEST(error_against_fp32_is_the_formats_rounding) {
    anneal_safetensors *st = open_file("tests/fixtures/gpt2_tiny.safetensors");
    REQUIRE(st);
    result rb, rh, rf;
    REQUIRE(run_at(st, ANNEAL_BF16, &rb));
    REQUIRE(run_at(st, ANNEAL_F16, &rh));
    REQUIRE(run_at(st, ANNEAL_F32, &rf));
    double lo_b, hi_b, lg_b, ls_b, lo_h, hi_h, lg_h, ls_h;
    REQUIRE(errors_vs_fp32(st, &rb, &lo_b, &hi_b, &lg_b, &ls_b));
    REQUIRE(errors_vs_fp32(st, &rh, &lo_h, &hi_h, &lg_h, &ls_h));
    printf("  normwise error vs fp32: bf16 %.3g-%.3g u (logits %.3g u, loss %.3g u); f16 %.3g-%.3g u (logits %.3g u, "
           "loss %.3g u)\n", lo_b / U_BF16, hi_b / U_BF16, lg_b / U_BF16, ls_b / U_BF16, lo_h / U_F16, hi_h / U_F16,
           lg_h / U_F16, ls_h / U_F16);
    CHECK(lo_b >= U_BF16 / 4 && hi_b <= 4 * U_BF16, "bf16: normwise errors %.3g..%.3g outside [u/4, 4u] = [%.3g, %.3g]",
          lo_b, hi_b, U_BF16 / 4, 4 * U_BF16);
    CHECK(lo_h >= U_F16 / 4 && hi_h <= 4 * U_F16, "f16: normwise errors %.3g..%.3g outside [u/4, 4u] = [%.3g, %.3g]",
          lo_h, hi_h, U_F16 / 4, 4 * U_F16);
    CHECK(lg_b / lg_h >= 4 && lg_b / lg_h <= 16, "logit error ratio bf16/f16 %.3g, expected about 8 (2^3)", lg_b / lg_h);
    CHECK(ls_b <= U_BF16 / 4, "bf16 loss relative error %.3g above u/4", ls_b);
    CHECK(ls_h <= U_F16 / 4, "f16 loss relative error %.3g above u/4", ls_h);
    /* the bf16 path is really taken: results differ from anneal's own fp32 ones */
    int64_t differ = 0;
    for (int64_t i = 0; i < rb.n_logits; i++) differ += rb.logits[i] != rf.logits[i];
    CHECK(differ > rb.n_logits / 2, "only %lld of %lld bf16 logits differ from fp32", (long long)differ,
          (long long)rb.n_logits);
    CHECK(rb.loss != rf.loss, "bf16 loss equals the fp32 loss %.9g", rf.loss);
    for (int i = 0; i < rb.n_params; i++)
        CHECK(memcmp(rb.grads[i], rf.grads[i], (size_t)rb.n_grad[i] * sizeof(float)) != 0,
              "bf16 gradient of %s equals the fp32 one", rb.names[i]);
    result_free(&rb);
    result_free(&rh);
    result_free(&rf);
    anneal_safetensors_close(st);
}

TEST(bf16_loss_close_to_pytorch_autocast) {
    anneal_safetensors *st = open_file("tests/fixtures/gpt2_tiny.safetensors");
    anneal_safetensors *px = open_file("tests/fixtures/gpt2_tiny_precision.safetensors");
    REQUIRE(st && px);
    result r;
    REQUIRE(run_at(st, ANNEAL_BF16, &r));
    int64_t n = 0;
    float *ac = entry_f32(px, "autocast_bf16.loss", &n);
    REQUIRE(ac);
    CHECK(fabs(r.loss - ac[0]) <= 1e-4 * fabs(ac[0]), "bf16 loss %.8f vs torch autocast %.8f", r.loss, ac[0]);
    printf("  bf16 loss %.8f, torch autocast bf16 %.8f\n", r.loss, ac[0]);
    free(ac);
    result_free(&r);
    anneal_safetensors_close(st);
    anneal_safetensors_close(px);
}

/* The compute precision is the model's value (f32 by default), checked when set. */
TEST(compute_precision_is_a_value_and_checked) {
    anneal_model_config cfg;
    REQUIRE(anneal_gpt2_preset("tiny", &cfg));
    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    REQUIRE(m);
    CHECK_TRUE(m->base.ctx.compute == ANNEAL_F32);
    anneal_clear_error();
    CHECK_TRUE(anneal_model_set_compute(&m->base, ANNEAL_I32) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(m->base.ctx.compute == ANNEAL_F32);
    CHECK_TRUE(anneal_model_set_compute(&m->base, ANNEAL_BF16) == ANNEAL_OK && m->base.ctx.compute == ANNEAL_BF16);
    anneal_gpt2_free(m);
}

int main(void) {
    RUN(compute_precision_is_a_value_and_checked);
    RUN(bf16_matches_the_rounded_reference);
    RUN(f16_loss_matches_the_rounded_reference);
    RUN(error_against_fp32_is_the_formats_rounding);
    RUN(bf16_loss_close_to_pytorch_autocast);
    return anneal_test_summary();
}
