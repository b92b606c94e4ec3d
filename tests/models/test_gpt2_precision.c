/* GPT-2 with bf16 and f16 matmuls (anneal_set_matmul_dtype) against PyTorch, on the
 * fixture of test_gpt2.c (tests/fixtures/gpt2_tiny.safetensors: weights, batch, fp32
 * logits, loss and gradients) and tests/fixtures/gpt2_tiny_precision.safetensors
 * (gen_gpt2_precision.py: a float64 GPT-2 that rounds both operands of every GEMM,
 * forward and backward, to bf16 / f16, and PyTorch's CPU autocast loss).
 *
 * Unit roundoff: a format with p significand bits (the implicit one included) rounds
 * to nearest with relative error at most u = 2^-p: bf16 p = 8, u = 2^-8 = 3.9e-3 (the
 * spacing just above 1.0 is 2^-7); f16 p = 11, u = 2^-11 = 4.9e-4; f32 u = 2^-24.
 *
 * 1. Against the rounded reference (the exact semantics anneal promises). anneal's f32
 *    values differ from the float64 reference's by a few f32 ulps, and an element that
 *    lies that close to a rounding boundary of the format rounds the other way (a
 *    "flip": one element moves by one bf16/f16 spacing). Flips are rare in bf16 (spacing
 *    2^-7: probability ~1e-5 per rounded element) but not in f16 (2^-10: ~1e-3), and
 *    once the backward pass has gone through an attention block their effects add up
 *    to the size of a rounding mistake. So the comparison is normwise
 *    (||x - ref|| / ||ref||) and covers the logits and the gradients computed before
 *    the backward pass reaches the last block's attention (ln_f, the last block's
 *    ln_2 and MLP):
 *      bf16: logits and those gradients within 5e-5 (measured <= 4e-6); loss 1e-5
 *            relative (also anneal_gpt2_loss, whose lm head + cross-entropy are fused).
 *      f16:  the loss within 1e-5 relative only (flips put the f16 logits ~1e-4 away,
 *            as far as the mistakes below; f16 is covered by part 2).
 *    The fixture records how far (normwise) the same model lands when only ONE operand
 *    of each GEMM is rounded, or none (bf16: >= 2e-3 for the logits and every late
 *    gradient); the test asserts these are >= 20x the bf16 tolerance, so either
 *    mistake fails here.
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
static bool run_at(const anneal_safetensors *st, anneal_dtype dt, result *r) {
    memset(r, 0, sizeof *r);
    anneal_gpt2_config cfg = {.n_layer = meta_int(st, "n_layer"), .n_head = meta_int(st, "n_head"),
                              .n_embd = meta_int(st, "n_embd"), .vocab_size = meta_int(st, "vocab_size"),
                              .n_ctx = meta_int(st, "n_ctx"), .dropout = 0.0f, .ln_eps = 1e-5f};
    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    if (!m || anneal_params_load(m->params, st, "") != ANNEAL_OK || m->params->n > 64) {
        anneal_gpt2_free(m);
        return false;
    }
    anneal_dtype prev = anneal_get_matmul_dtype();
    bool ok = anneal_set_matmul_dtype(dt) == ANNEAL_OK;
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *ids = anneal_safetensors_load(st, "input_ids", ANNEAL_I32);
    anneal_tensor *tg = anneal_safetensors_load(st, "targets", ANNEAL_I32);
    anneal_tensor *logits = ok ? anneal_gpt2_forward(m, ids) : NULL;
    anneal_tensor *loss = anneal_cross_entropy(logits, tg, -100);
    ok = loss && anneal_backward(loss) == ANNEAL_OK;
    anneal_no_grad_begin();
    anneal_tensor *fused = ok ? anneal_gpt2_loss(m, ids, tg) : NULL;
    anneal_no_grad_end();
    ok = ok && fused;
    if (ok) {
        r->fused_loss = anneal_item(fused);
        r->logits = tensor_f32(logits);
        r->n_logits = anneal_numel(logits);
        r->loss = anneal_item(loss);
        r->n_params = m->params->n;
        for (int i = 0; i < m->params->n && ok; i++) {
            anneal_param *p = &m->params->items[i];
            snprintf(r->names[i], sizeof r->names[i], "%s", p->name);
            ok = p->tensor->grad != NULL;
            if (ok) r->grads[i] = tensor_f32(p->tensor->grad), r->n_grad[i] = anneal_numel(p->tensor->grad);
        }
    }
    anneal_scope_close(s);
    anneal_set_matmul_dtype(prev);
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

/* The gradients the backward pass computes before it reaches the last block's
 * attention (see part 1 above). */
static bool is_late(const char *name) {
    static const char *late[] = {"transformer.ln_f.weight", "transformer.ln_f.bias",
                                 "transformer.h.1.ln_2.weight", "transformer.h.1.ln_2.bias",
                                 "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.bias",
                                 "transformer.h.1.mlp.c_proj.weight", "transformer.h.1.mlp.c_proj.bias"};
    for (size_t i = 0; i < sizeof late / sizeof late[0]; i++)
        if (!strcmp(name, late[i])) return true;
    return false;
}

/* Part 1: anneal at dtype `kind` ("bf16"/"f16") against the rounded reference:
 * normwise errors of the logits and the late gradients at most tol, the loss within
 * 1e-5 relative, and the recorded controls at least min_control * tol away. */
static void check_against_rounded(anneal_dtype dt, const char *kind, double tol, double min_control) {
    anneal_safetensors *st = open_file("tests/fixtures/gpt2_tiny.safetensors");
    anneal_safetensors *px = open_file("tests/fixtures/gpt2_tiny_precision.safetensors");
    REQUIRE(st && px);
    result r;
    REQUIRE(run_at(st, dt, &r));
    char name[256];
    int64_t n = 0;
    snprintf(name, sizeof name, "%s.logits", kind);
    float *ref = entry_f32(px, name, &n);
    REQUIRE(ref && n == r.n_logits);
    double e_logits = rel_norm_err(r.logits, ref, n);
    CHECK(e_logits <= tol, "%s logits: normwise error %.3g vs the rounded reference (tolerance %.3g)", kind, e_logits,
          tol);
    free(ref);
    snprintf(name, sizeof name, "%s.loss", kind);
    ref = entry_f32(px, name, &n);
    REQUIRE(ref);
    CHECK(fabs(r.loss - ref[0]) <= 1e-5 * fabs(ref[0]), "%s loss %.8f vs rounded reference %.8f", kind, r.loss, ref[0]);
    CHECK(fabs(r.fused_loss - ref[0]) <= 1e-5 * fabs(ref[0]), "%s fused loss %.8f vs rounded reference %.8f", kind,
          r.fused_loss, ref[0]);
    free(ref);
    double worst_g = 0;
    int n_late = 0;
    for (int i = 0; i < r.n_params; i++) {
        if (!is_late(r.names[i])) continue;
        n_late++;
        snprintf(name, sizeof name, "%s.grad.%s", kind, r.names[i]);
        ref = entry_f32(px, name, &n);
        REQUIRE(ref && n == r.n_grad[i]);
        double e = rel_norm_err(r.grads[i], ref, n);
        CHECK(e <= tol, "%s grad %s: normwise error %.3g vs the rounded reference (tolerance %.3g)", kind, r.names[i], e,
              tol);
        if (e > worst_g) worst_g = e;
        free(ref);
    }
    CHECK(n_late == 8, "%d late gradients found, expected 8", n_late);
    printf("  %s vs rounded reference: normwise logits %.3g, late gradients up to %.3g (tolerance %.3g)\n", kind,
           e_logits, worst_g, tol);
    const char *ctrls[4] = {"one_operand_logits", "one_operand_late_grads", "unrounded_logits", "unrounded_late_grads"};
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof name, "%s.%s", kind, ctrls[i]);
        double x = meta_double(px, name);
        CHECK(x >= min_control * tol, "%s: the %s control is only %.3g away (tolerance %.3g): the test could not tell",
              kind, ctrls[i], x, tol);
    }
    result_free(&r);
    anneal_safetensors_close(st);
    anneal_safetensors_close(px);
}

TEST(bf16_matches_the_rounded_reference) { check_against_rounded(ANNEAL_BF16, "bf16", 5e-5, 20.0); }
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

TEST(matmul_dtype_is_thread_state_and_checked) {
    CHECK_TRUE(anneal_get_matmul_dtype() == ANNEAL_F32);
    anneal_clear_error();
    CHECK_TRUE(anneal_set_matmul_dtype(ANNEAL_I32) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_get_matmul_dtype() == ANNEAL_F32);
}

int main(void) {
    RUN(matmul_dtype_is_thread_state_and_checked);
    RUN(bf16_matches_the_rounded_reference);
    RUN(f16_loss_matches_the_rounded_reference);
    RUN(error_against_fp32_is_the_formats_rounding);
    RUN(bf16_loss_close_to_pytorch_autocast);
    return anneal_test_summary();
}
