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
 *            reaching the logits does); at least 7/8 of the positions must be clean
 *            (~0.02 flips per position: measured 114 of 128 on every ISA). For each clean
 *            position with a target, the late gradients (ln_f, the last block's ln_2 and
 *            MLP, computed before the backward pass reaches any attention) of its own loss
 *            term (other targets ignored, scaled by 1 / the batch's count) are compared
 *            with that position's term of the reference (the fixture's <kind>.late.*
 *            factors: those layers act on each position alone, so the late gradients are
 *            sums of per-position terms): all but at most 4 of the terms must be within
 *            LATE_TOL = 5e-5 normwise (measured: all but 1 of 109 within 1.1e-5 on
 *            AVX-512, all but 2 with ANNEAL_CPU_ISA=avx2 or portable: a flip in the
 *            backward pass moves its term by up to ~2e-3, and the gradients of the whole
 *            batch, sums of cancelling terms, by ~2e-4). Loss 1e-5 relative (also
 *            anneal_gpt2_loss, whose lm head + cross-entropy are fused).
 *      f16:  the same per position: flips are ~100x likelier, so at least 3/8 of the
 *            positions clean (measured 54 and 57 of 128) and all but at most 8 of their
 *            late-gradient terms within LATE_TOL (measured 4 off of 53 and of 56).
 *    Controls, computed here by anneal (not read from the fixture): the same model at
 *    the other two precisions (f32: nothing rounded; the other format: rounding at the
 *    wrong spacing) must leave at most 1/8 of the positions clean (measured 0 for each)
 *    and none of the first 8 late-gradient terms within LATE_TOL (measured >= 4.1e-3
 *    for bf16, >= 4.9e-4 for f16), so such a mistake fails here. (The generator asserts
 *    its own one-operand and f32-attention controls.)
 * 2. Against the fp32 PyTorch reference, the normwise relative error
 *    ||x - x_fp32|| / ||x_fp32|| of the logits and of every gradient must look like
 *    rounding at that format: between u/2 and 2u. Each GEMM output carries at most
 *    2u relative error per product (two rounded operands, f32 accumulation); the
 *    roundings are independent, so along the 4L+1 = 9 GEMMs of this model they add
 *    in quadrature (measured: 0.77u for the logits, 0.70u-1.58u for gradients, for both
 *    formats). Rounding at the wrong format (f16 in a bf16 run: 8x less), accumulating
 *    in bf16 (~sqrt(K) u), or not rounding at all (~2^-24) falls outside. The errors
 *    of the two formats must also be in the ratio of their u (2^3 = 8; measured 7.98,
 *    asserted in [7, 9]), and bf16 results must differ from fp32 ones (the path is
 *    taken). The loss averages 123 positions' errors: |loss - loss_fp32| <= u/50
 *    relative (measured 0.0011u bf16, 0.0019u f16).
 * 3. PyTorch's torch.autocast("cpu", bfloat16) loss (which also rounds GEMM outputs
 *    and attention to bf16): anneal's bf16 loss within 1e-5 relative (measured 9.2e-7;
 *    was 1e-4). */
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
/* Late gradients of one loss term (normwise), see part 1: worst measured on a clean
 * position 1.12e-5 (bf16); 5e-5 is kept (10x would loosen it). */
#define LATE_TOL 5e-5

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
static bool late_reference(const anneal_safetensors *px, const char *kind, int which, const bool *keep, int64_t rows,
                           double *out, int64_t n) {
    static const char *fac[8][2] = {{"g_f", "xhat_f"}, {"g_f", NULL},        {"g_2", "xhat_2"}, {"g_2", NULL},
                                    {"r_h2", "r_dy_fc"}, {"dy_fc", NULL}, {"r_f", "r_dy_proj"}, {"dy_proj", NULL}};
    char name[128];
    int64_t na = 0, nb = 0;
    snprintf(name, sizeof name, "%s.late.%s", kind, fac[which][0]);
    float *a = entry_f32(px, name, &na), *b = NULL;
    if (fac[which][1]) {
        snprintf(name, sizeof name, "%s.late.%s", kind, fac[which][1]);
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

/* Per position: how many of the rows of got (rows x V) are within CLEAN_TOL of ref
 * (normwise over the vocabulary), the worst clean one and the worst other one. */
static int64_t clean_positions(const float *got, const float *ref, int64_t rows, int64_t V, double *worst_clean,
                               double *worst_dirty) {
    int64_t n = 0;
    *worst_clean = *worst_dirty = 0;
    for (int64_t i = 0; i < rows; i++) {
        const double e = rel_norm_err(got + i * V, ref + i * V, V);
        if (e <= CLEAN_TOL) n++, *worst_clean = fmax(*worst_clean, e);
        else *worst_dirty = fmax(*worst_dirty, e);
    }
    return n;
}

/* The late gradients of position pos's own loss term at compute dtype dt (the other
 * targets ignored, scaled by 1 / n_targets as the reference factors are) against that
 * term of the kind's reference: the worst normwise error over the 8 late gradients, or
 * NAN when the run failed. */
static double late_term_error(const anneal_safetensors *st, const anneal_safetensors *px, const char *kind,
                              anneal_dtype dt, const float *tg, int64_t rows, int64_t pos, int64_t n_targets) {
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
    int32_t *tmask = malloc((size_t)rows * sizeof *tmask);
    bool *one = calloc((size_t)rows, sizeof *one);
    for (int64_t i = 0; i < rows; i++) tmask[i] = i == pos ? (int32_t)tg[i] : -100, one[i] = i == pos;
    result rm;
    double e_pos = NAN;
    if (run_at_targets(st, dt, tmask, (float)(1.0 / (double)n_targets), &rm)) {
        e_pos = 0;
        for (int w = 0; w < 8 && !isnan(e_pos); w++) {
            int pi = -1;
            for (int i = 0; i < rm.n_params; i++)
                if (!strcmp(rm.names[i], late[w])) pi = i;
            double *lref = pi >= 0 ? malloc((size_t)rm.n_grad[pi] * sizeof *lref) : NULL;
            if (!lref || !late_reference(px, kind, w, one, rows, lref, rm.n_grad[pi])) e_pos = NAN;
            else e_pos = fmax(e_pos, rel_norm_err_d(rm.grads[pi], lref, rm.n_grad[pi]));
            free(lref);
        }
        result_free(&rm);
    }
    free(tmask);
    free(one);
    return e_pos;
}

/* Part 1 (see the top) at dt (BF16 or F16, fixture prefix kind): anneal against the
 * rounded reference per position. At least min_clean of the positions clean (logits
 * within CLEAN_TOL); the late gradients of the loss terms of the clean positions within
 * LATE_TOL, all but at most max_miss of them; the loss within 1e-5 relative. Controls
 * computed here by anneal itself, so the criteria are shown to discriminate: the same
 * model at the other two precisions (a rounding at the wrong format, or none) must leave
 * at most 1/8 of the positions clean and, on the first 8 positions checked, no late
 * gradient term within LATE_TOL. */
static void check_against_rounded(anneal_dtype dt, const char *kind, int64_t min_clean, int max_miss) {
    anneal_safetensors *st = open_file("tests/fixtures/gpt2_tiny.safetensors");
    anneal_safetensors *px = open_file("tests/fixtures/gpt2_tiny_precision.safetensors");
    REQUIRE(st && px);
    const anneal_dtype ctrl[2] = {ANNEAL_F32, dt == ANNEAL_BF16 ? ANNEAL_F16 : ANNEAL_BF16};
    result r, rc[2];
    REQUIRE(run_at(st, dt, &r));
    REQUIRE(run_at(st, ctrl[0], &rc[0]));
    REQUIRE(run_at(st, ctrl[1], &rc[1]));
    int64_t n = 0, nt = 0;
    char name[256];
    snprintf(name, sizeof name, "%s.logits", kind);
    float *ref = entry_f32(px, name, &n);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *tgt = anneal_safetensors_load(st, "targets", ANNEAL_I32);
    float *tg = tgt ? tensor_f32(tgt) : NULL; /* small integers: exact as f32 */
    nt = tgt ? anneal_numel(tgt) : 0;
    anneal_scope_close(sc);
    REQUIRE(ref && n == r.n_logits && tg && nt > 0 && n % nt == 0);
    const int64_t rows = nt, V = n / nt;
    bool *keep = calloc((size_t)rows, sizeof *keep);
    int64_t n_clean = 0, n_targets = 0, ctrl_clean[2];
    double worst_clean = 0, worst_dirty = 0, wc, wd;
    for (int64_t i = 0; i < rows; i++) {
        const double e = rel_norm_err(r.logits + i * V, ref + i * V, V);
        keep[i] = e <= CLEAN_TOL;
        n_clean += keep[i];
        if (keep[i] && e > worst_clean) worst_clean = e;
        if (!keep[i] && e > worst_dirty) worst_dirty = e;
        n_targets += (int32_t)tg[i] != -100;
    }
    for (int c = 0; c < 2; c++) ctrl_clean[c] = clean_positions(rc[c].logits, ref, rows, V, &wc, &wd);
    CHECK(n_clean >= min_clean, "%s: only %lld of %lld positions have logits within %.3g of the rounded reference",
          kind, (long long)n_clean, (long long)rows, CLEAN_TOL);
    for (int c = 0; c < 2; c++)
        CHECK(8 * ctrl_clean[c] <= rows, "%s: the %s control leaves %lld of %lld positions clean: the test could not "
              "tell", kind, anneal_dtype_name(ctrl[c]), (long long)ctrl_clean[c], (long long)rows);
    snprintf(name, sizeof name, "%s.loss", kind);
    float *ref_loss = entry_f32(px, name, &n);
    REQUIRE(ref_loss);
    CHECK(fabs(r.loss - ref_loss[0]) <= 1e-5 * fabs(ref_loss[0]), "%s loss %.8f vs rounded reference %.8f", kind,
          r.loss, ref_loss[0]);
    CHECK(fabs(r.fused_loss - ref_loss[0]) <= 1e-5 * fabs(ref_loss[0]), "%s fused loss %.8f vs rounded reference %.8f",
          kind, r.fused_loss, ref_loss[0]);
    free(ref_loss);

    /* Per clean position with a target: its own loss term's late gradients. */
    int64_t n_checked = 0, n_match = 0, n_ctrl = 0, ctrl_match = 0;
    double worst_match = 0, worst_g = 0, ctrl_best = INFINITY;
    const int64_t stride = anneal_test_sanitized() ? 4 : 1; /* a forward + backward each: every 4th under ASan */
    for (int64_t pos = 0; pos < rows; pos += stride) {
        if (!keep[pos] || (int32_t)tg[pos] == -100) continue;
        const double e_pos = late_term_error(st, px, kind, dt, tg, rows, pos, n_targets);
        REQUIRE(!isnan(e_pos));
        n_checked++;
        if (e_pos <= LATE_TOL) n_match++, worst_match = fmax(worst_match, e_pos);
        worst_g = fmax(worst_g, e_pos);
        for (int c = 0; c < 2 && n_ctrl < 8; c++) {
            const double ec = late_term_error(st, px, kind, ctrl[c], tg, rows, pos, n_targets);
            REQUIRE(!isnan(ec));
            ctrl_match += ec <= LATE_TOL;
            ctrl_best = fmin(ctrl_best, ec);
        }
        n_ctrl += n_ctrl < 8;
    }
    CHECK(n_checked > 0 && n_match + max_miss >= n_checked,
          "%s: %lld of %lld loss terms of clean positions have late gradients farther than %.3g from the reference",
          kind, (long long)(n_checked - n_match), (long long)n_checked, LATE_TOL);
    CHECK(ctrl_match == 0, "%s: %lld late-gradient terms of the other precisions are within %.3g: the test could not "
          "tell", kind, (long long)ctrl_match, LATE_TOL);
    printf("  %s vs rounded reference: %lld of %lld positions clean (logits up to %.3g; the others %.3g at most; "
           "controls %s %lld, %s %lld clean); late gradients of %lld of their %lld loss terms within %.3g (up to "
           "%.3g; all up to %.3g; controls at least %.3g)\n",
           kind, (long long)n_clean, (long long)rows, worst_clean, worst_dirty, anneal_dtype_name(ctrl[0]),
           (long long)ctrl_clean[0], anneal_dtype_name(ctrl[1]), (long long)ctrl_clean[1], (long long)n_match,
           (long long)n_checked, LATE_TOL, worst_match, worst_g, ctrl_best);
    free(ref), free(tg), free(keep);
    result_free(&r);
    result_free(&rc[0]);
    result_free(&rc[1]);
    anneal_safetensors_close(st);
    anneal_safetensors_close(px);
}

/* bf16: 114 of 128 positions clean on every ISA: at least 7/8 (112); late-gradient
 * terms off: 1 (AVX-512), 2 (avx2, portable) of 109: at most 4. */
TEST(bf16_matches_the_rounded_reference) { check_against_rounded(ANNEAL_BF16, "bf16", 112, 4); }
/* f16: flips are ~100x likelier (spacing 2^-10): 54 (AVX-512) and 57 (portable) of 128
 * positions clean: at least 3/8 (48); the controls leave none. Late-gradient terms off
 * (backward flips): 4 of 53 (AVX-512), 4 of 56 (portable): at most 8. */
TEST(f16_matches_the_rounded_reference) { check_against_rounded(ANNEAL_F16, "f16", 48, 8); }

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
    /* Measured (AVX-512, avx2, portable): bf16 0.765u-1.58u, f16 0.702u-1.48u; logits
     * 0.765u and 0.767u (ratio 7.98); loss 0.0011u (bf16), 0.0019u (f16). Asserted: the
     * window [u/2, 2u] (was [u/4, 4u]), the ratio in [7, 9] (was [4, 16]), the loss within
     * u/50 = 0.02u, about 10x the worst measured (was u/4). */
    CHECK(lo_b >= U_BF16 / 2 && hi_b <= 2 * U_BF16, "bf16: normwise errors %.3g..%.3g outside [u/2, 2u] = [%.3g, %.3g]",
          lo_b, hi_b, U_BF16 / 2, 2 * U_BF16);
    CHECK(lo_h >= U_F16 / 2 && hi_h <= 2 * U_F16, "f16: normwise errors %.3g..%.3g outside [u/2, 2u] = [%.3g, %.3g]",
          lo_h, hi_h, U_F16 / 2, 2 * U_F16);
    CHECK(lg_b / lg_h >= 7 && lg_b / lg_h <= 9, "logit error ratio bf16/f16 %.3g, expected about 8 (2^3)", lg_b / lg_h);
    CHECK(ls_b <= U_BF16 / 50, "bf16 loss relative error %.3g above u/50", ls_b);
    CHECK(ls_h <= U_F16 / 50, "f16 loss relative error %.3g above u/50", ls_h);
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
    CHECK(fabs(r.loss - ac[0]) <= 1e-5 * fabs(ac[0]), "bf16 loss %.8f vs torch autocast %.8f", r.loss, ac[0]);
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
    RUN(f16_matches_the_rounded_reference);
    RUN(error_against_fp32_is_the_formats_rounding);
    RUN(bf16_loss_close_to_pytorch_autocast);
    return anneal_test_summary();
}
