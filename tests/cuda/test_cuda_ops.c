/* Every slot of the CUDA table against the CPU table (the reference), called directly
 * with the same descriptors on the same random inputs: elementwise, matmul (every
 * transpose, batched with broadcast strides, each epilogue, f32/bf16/f16 compute, sizes
 * that are no tile's multiple), the row ops, rope, attention (causal or not, GQA, Tq !=
 * Tk, Tq = 1, strided views as the ops make them), index checks, embedding, losses,
 * dropout, randn and AdamW.
 *
 * The log is the point: one line per check,
 *   CHECK <op> <case> max_abs <e> max_rel <e> tol <t> PASS|FAIL
 * where max_rel is |gpu - cpu| / max(|cpu|, rms(cpu)) (relative to the element, floored
 * at the tensor's RMS so cancellation does not divide by ~0). A slot the CUDA table lacks
 * or declines (supports_op) prints "UNSUPPORTED <op> <case>" and is counted apart (not a
 * pass). A failed check does not stop the run; the counts come at the end and a failure
 * or an unsupported kernel fails the test.
 *
 * Tolerances: f32 paths 1e-5 (TF32 off; the same algorithm up to summation order);
 * bf16 compute 2^-7 (two bf16 ulps of the output's scale: both devices round the same
 * operands the same way, so only the order of f32 accumulation and an exp/tanh ulp that
 * flips a bf16 rounding differ); f16 2^-9. Wider where the reason is known: rope 1e-4
 * (an ulp of inv_freq at position ~1000), a sum of 2^20 values 1e-4, dropout's y 1e-6.
 * Bitwise where the contract says so (dropout masks, elementwise arithmetic, copies,
 * adamw_multi vs adamw, check_index's count, status and message).
 * Groups can be picked: cuda_test_cuda_ops matmul attention (names as in main()).
 *
 * Without a GPU (or in a build without CUDA) the test skips with the CUDA runtime's
 * reason: a plain skip, since no setup can give a machine a GPU. */
#include "anneal/anneal.h"
#include "anneal/backend.h"
#include "anneal/cuda.h"
#include "backends/emu_backend.h"
#include "test.h"

/* The device under test: CUDA, or with ANNEAL_CUDA_TEST_DEVICE=emu the emulated second
 * device of tests/backends (the CPU's kernels behind memory the host cannot touch), which
 * checks this test itself on a machine without a GPU: every check must pass there. */
static anneal_device GDEV = ANNEAL_CUDA;

#include <math.h>

/* ------------------------------------------------------------ bookkeeping */

static const anneal_backend *BE[2]; /* [0] the CPU (reference), [1] CUDA */
static int dv;                      /* which device a T() argument names while a slot runs */
static int n_checks, n_pass, n_fail, n_unsupported, n_callfail;

/* One operand on both devices: t[0] on the CPU, t[1] on the GPU. */
typedef struct pr {
    anneal_tensor *t[2];
} pr;
static const pr NONE = {{NULL, NULL}};
#define T(p) ((p).t[dv])

static void line_fail(void) { anneal_test_fail(__FILE__, __LINE__, "see the FAIL line above"); }

/* A query for supports_op. */
static bool gpu_supports(anneal_op_kind kind, anneal_dtype dt, const anneal_matmul_desc *m,
                         const anneal_attention_desc *a, const anneal_rope_desc *r) {
    anneal_op_query q = {.kind = kind, .dtype = dt, .matmul = m, .attention = a, .rope = r};
    return anneal_backend_supports(BE[1], &q);
}

static bool unsupported(const char *op, const char *info) {
    printf("UNSUPPORTED %s %s\n", op, info);
    fflush(stdout);
    n_unsupported++;
    return false;
}

/* True when the GPU has the slot and accepts the query; else prints UNSUPPORTED. */
static bool have(const char *op, const char *info, bool slot_present, anneal_op_kind kind, anneal_dtype dt,
                 const anneal_matmul_desc *m, const anneal_attention_desc *a, const anneal_rope_desc *r) {
    if (!slot_present || !gpu_supports(kind, dt, m, a, r)) return unsupported(op, info);
    return true;
}

static void call_failed(const char *op, const char *info, anneal_status s) {
    printf("CHECK %-24s %-52s call failed on %s: %s: %s  FAIL\n", op, info, dv ? "cuda" : "cpu",
           anneal_status_name(s), anneal_last_error());
    fflush(stdout);
    n_checks++, n_fail++, n_callfail++;
    line_fail();
    anneal_clear_error();
}

/* Runs `slot` on the CPU, then on the GPU (followed by a synchronize, so a deferred
 * error lands here); ok = both returned ANNEAL_OK. */
#define CALL2(ok, op, info, slot, ...)                                                        \
    do {                                                                                      \
        (ok) = true;                                                                          \
        for (dv = 0; dv < 2 && (ok); dv++) {                                                  \
            const anneal_backend *be_ = BE[dv];                                               \
            anneal_clear_error();                                                             \
            anneal_status s_ = be_->slot(be_->ctx, __VA_ARGS__);                              \
            if (s_ == ANNEAL_OK && dv == 1) s_ = be_->synchronize(be_->ctx);                  \
            if (s_ != ANNEAL_OK) {                                                            \
                call_failed(op, info, s_);                                                    \
                (ok) = false;                                                                 \
            }                                                                                 \
        }                                                                                     \
        dv = 0;                                                                               \
    } while (0)

/* ------------------------------------------------------------ tensors */

static double elem(const void *base, anneal_dtype dt, int64_t i) {
    switch (dt) {
    case ANNEAL_F32: return ((const float *)base)[i];
    case ANNEAL_BF16: return anneal_bf16_to_f32(((const uint16_t *)base)[i]);
    case ANNEAL_F16: return anneal_f16_to_f32(((const uint16_t *)base)[i]);
    case ANNEAL_I32: return ((const int32_t *)base)[i];
    case ANNEAL_I64: return (double)((const int64_t *)base)[i];
    case ANNEAL_U16: return ((const uint16_t *)base)[i];
    case ANNEAL_U8: return ((const uint8_t *)base)[i];
    case ANNEAL_I8: return ((const int8_t *)base)[i];
    case ANNEAL_F64: return ((const double *)base)[i];
    default: return NAN;
    }
}

/* The elements of t (any device, any strides) in row-major order as doubles, read with
 * raw copies only (no kernel of the device under test is involved). malloc'd. */
static double *values(const anneal_tensor *t, int64_t *n_out) {
    int64_t n = anneal_numel(t);
    *n_out = n;
    double *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    size_t nb = t->storage->nbytes;
    void *raw = malloc(nb ? nb : 1);
    if (!out || !raw) abort();
    if (t->device == ANNEAL_CPU) {
        memcpy(raw, t->storage->data, nb);
    } else {
        const anneal_backend *be = anneal_backend_get(t->device);
        if (be->copy_to_host(be->ctx, raw, t->storage->data, nb) != ANNEAL_OK ||
            be->synchronize(be->ctx) != ANNEAL_OK) {
            printf("  (reading a %s tensor back failed: %s)\n", anneal_device_name(t->device), anneal_last_error());
            anneal_clear_error();
            for (int64_t i = 0; i < n; i++) out[i] = NAN;
            free(raw);
            return out;
        }
    }
    int64_t idx[ANNEAL_MAX_DIMS] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t off = t->offset;
        for (int d = 0; d < t->ndim; d++) off += idx[d] * t->strides[d];
        out[i] = elem(raw, t->dtype, off);
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
    free(raw);
    return out;
}

static void sync_gpu(void) {
    if (BE[1]->synchronize(BE[1]->ctx) != ANNEAL_OK) {
        printf("  (cuda synchronize: %s)\n", anneal_last_error());
        anneal_clear_error();
    }
}

/* Both devices from the same host bytes (contiguous, dtype dt). */
static pr from_host(anneal_dtype dt, int ndim, const int64_t *shape, const void *data) {
    pr p;
    p.t[0] = anneal_from_data(dt, ndim, shape, data);
    p.t[1] = anneal_from_data_on(GDEV, dt, ndim, shape, data);
    sync_gpu();
    if (!p.t[0] || !p.t[1]) {
        printf("  (allocation failed: %s)\n", anneal_last_error());
        abort();
    }
    return p;
}

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

/* Uniform random f32 in [lo, hi). */
static pr rnd(int ndim, const int64_t *shape, float lo, float hi) {
    float *h = anneal_test_rand_buf(numel_of(ndim, shape), lo, hi);
    pr p = from_host(ANNEAL_F32, ndim, shape, h);
    free(h);
    return p;
}

/* An output: NaN-filled f32 (so "overwrites every element" is checked), zeros for
 * other dtypes. */
static pr out_like(anneal_dtype dt, int ndim, const int64_t *shape) {
    int64_t n = numel_of(ndim, shape);
    size_t esz = anneal_dtype_size(dt);
    void *h = calloc((size_t)(n ? n : 1), esz);
    if (dt == ANNEAL_F32)
        for (int64_t i = 0; i < n; i++) ((float *)h)[i] = NAN;
    if (dt == ANNEAL_F64)
        for (int64_t i = 0; i < n; i++) ((double *)h)[i] = NAN;
    pr p = from_host(dt, ndim, shape, h);
    free(h);
    return p;
}

/* A view of base's storage on both devices. */
static pr view(pr base, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset) {
    pr p;
    for (int d = 0; d < 2; d++) p.t[d] = anneal_alias(base.t[d], ndim, shape, strides, offset);
    if (!p.t[0] || !p.t[1]) {
        printf("  (view failed: %s)\n", anneal_last_error());
        abort();
    }
    return p;
}

/* f32 values converted (on the CPU) into dtype dt, the same bytes uploaded to the GPU. */
static pr convert(pr f, anneal_dtype dt) {
    anneal_tensor *c = anneal_empty_on(ANNEAL_CPU, dt, f.t[0]->ndim, f.t[0]->shape);
    if (!c || BE[0]->copy(BE[0]->ctx, c, f.t[0]) != ANNEAL_OK) abort();
    return from_host(dt, c->ndim, c->shape, anneal_data(c));
}

static pr i32s(int ndim, const int64_t *shape, const int32_t *v) { return from_host(ANNEAL_I32, ndim, shape, v); }
static pr i64_scalar(int64_t v) { return from_host(ANNEAL_I64, 0, NULL, &v); }
static pr f32_scalar(float v) { return from_host(ANNEAL_F32, 0, NULL, &v); }

/* -------------------------------------------------------------- comparing */

/* Compares the GPU's result with the CPU's (see the header for max_rel); tol 0 asks for
 * identical values (NaN matching NaN). Prints one line; returns pass. */
static bool cmp(const char *op, const char *info, pr x, double tol) {
    int64_t n0, n1;
    double *c = values(x.t[0], &n0), *g = values(x.t[1], &n1);
    double rms = 0, max_abs = 0, max_rel = 0;
    int64_t worst = 0;
    bool bad = n0 != n1;
    for (int64_t i = 0; i < n0; i++)
        if (isfinite(c[i])) rms += c[i] * c[i];
    rms = n0 ? sqrt(rms / (double)n0) : 0;
    for (int64_t i = 0; i < n0 && !bad; i++) {
        bool same_special = (isnan(c[i]) && isnan(g[i])) || (isinf(c[i]) && c[i] == g[i]);
        if (same_special) continue;
        if (!isfinite(c[i]) || !isfinite(g[i])) {
            if (!bad) worst = i;
            bad = true;
            max_abs = max_rel = INFINITY;
            break;
        }
        double d = fabs(g[i] - c[i]);
        double r = d / fmax(fmax(fabs(c[i]), rms), 1e-30);
        if (d > max_abs) max_abs = d;
        if (r > max_rel) max_rel = r, worst = i;
    }
    bool pass = !bad && (tol == 0 ? max_abs == 0 : max_rel <= tol);
    printf("CHECK %-24s %-52s %-5s max_abs %.3e max_rel %.3e tol %.1e  %s", op, info,
           anneal_dtype_name(x.t[0]->dtype), max_abs, max_rel, tol, pass ? "PASS" : "FAIL");
    if (!pass && n0 == n1 && n0 > 0)
        printf("  [worst %lld of %lld: gpu %.9g cpu %.9g]", (long long)worst, (long long)n0, g[worst], c[worst]);
    if (n0 != n1) printf("  [numel %lld vs %lld]", (long long)n1, (long long)n0);
    printf("\n");
    fflush(stdout);
    n_checks++;
    if (pass) n_pass++;
    else {
        n_fail++;
        line_fail();
    }
    free(c);
    free(g);
    return pass;
}

static const double TOL_F32 = 1e-5;
static const double TOL_BF16 = 1.0 / 128; /* 2^-7: two bf16 ulps */
static const double TOL_F16 = 1.0 / 512;  /* 2^-9: two f16 ulps */

static double tol_of(anneal_dtype compute) {
    return compute == ANNEAL_BF16 ? TOL_BF16 : compute == ANNEAL_F16 ? TOL_F16 : TOL_F32;
}

/* ------------------------------------------------------------ elementwise */

TEST(elementwise) {
    anneal_scope *sc = anneal_scope_open();
    char info[160];
    bool ok;
    const int64_t shapes[][2] = {{1, 1}, {7, 33}, {129, 1000}};
    for (int si = 0; si < 3; si++) {
        int64_t R = shapes[si][0], C = shapes[si][1];
        pr base = rnd(2, (int64_t[]){C, R}, -2, 2);
        pr tr = view(base, 2, (int64_t[]){R, C}, (int64_t[]){1, R}, 0); /* transposed */
        /* copy: strided f32 -> contiguous, and conversions both ways */
        const anneal_dtype dts[] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_F16};
        for (int a = 0; a < 3; a++)
            for (int b = 0; b < 3; b++) {
                snprintf(info, sizeof info, "(%lld, %lld) transposed %s -> %s", (long long)R, (long long)C,
                         anneal_dtype_name(dts[a]), anneal_dtype_name(dts[b]));
                if (!have("copy", info, BE[1]->copy != NULL, ANNEAL_OP_COPY, dts[b], NULL, NULL, NULL)) continue;
                pr src = tr;
                if (dts[a] != ANNEAL_F32) { /* a transposed view of converted values */
                    pr sb = convert(base, dts[a]);
                    src = view(sb, 2, (int64_t[]){R, C}, (int64_t[]){1, R}, 0);
                }
                pr dst = out_like(dts[b], 2, (int64_t[]){R, C});
                CALL2(ok, "copy", info, copy, T(dst), T(src));
                if (ok) cmp("copy", info, dst, 0);
            }
        {
            pr i = convert(rnd(2, (int64_t[]){R, C}, -100, 100), ANNEAL_I32), o = out_like(ANNEAL_F32, 2, (int64_t[]){R, C});
            snprintf(info, sizeof info, "(%lld, %lld) i32 -> f32", (long long)R, (long long)C);
            if (have("copy", info, BE[1]->copy != NULL, ANNEAL_OP_COPY, ANNEAL_F32, NULL, NULL, NULL)) {
                CALL2(ok, "copy", info, copy, T(o), T(i));
                if (ok) cmp("copy", info, o, 0);
            }
        }
        /* fill: a strided bf16 view and an f32 tensor */
        for (int k = 0; k < 2; k++) {
            anneal_dtype dt = k ? ANNEAL_BF16 : ANNEAL_F32;
            pr t = convert(base, dt);
            pr v = view(t, 2, (int64_t[]){R, C}, (int64_t[]){1, R}, 0);
            snprintf(info, sizeof info, "(%lld, %lld) transposed view", (long long)R, (long long)C);
            if (!have("fill", info, BE[1]->fill != NULL, ANNEAL_OP_FILL, dt, NULL, NULL, NULL)) continue;
            CALL2(ok, "fill", info, fill, T(v), -1.25);
            if (ok) cmp("fill", info, t, 0);
        }
        /* binary: a transposed, b broadcast over rows; and in place (out = a) */
        pr brow = rnd(2, (int64_t[]){1, C}, 0.5f, 2.0f);
        pr bb = view(brow, 2, (int64_t[]){R, C}, (int64_t[]){0, 1}, 0);
        const char *bn[] = {"add", "sub", "mul", "div"};
        for (int op = 0; op < 4; op++) {
            snprintf(info, sizeof info, "%s (%lld, %lld) a^T, b row-broadcast", bn[op], (long long)R, (long long)C);
            if (!have("binary", info, BE[1]->binary != NULL, ANNEAL_OP_BINARY, ANNEAL_F32, NULL, NULL, NULL)) continue;
            pr o = out_like(ANNEAL_F32, 2, (int64_t[]){R, C});
            CALL2(ok, "binary", info, binary, (anneal_binary_op)op, T(o), T(tr), T(bb));
            if (ok) cmp("binary", info, o, op == 3 ? TOL_F32 : 0);
            pr a = rnd(2, (int64_t[]){R, C}, -2, 2);
            snprintf(info, sizeof info, "%s (%lld, %lld) in place out = a", bn[op], (long long)R, (long long)C);
            CALL2(ok, "binary", info, binary, (anneal_binary_op)op, T(a), T(a), T(tr));
            if (ok) cmp("binary", info, a, op == 3 ? TOL_F32 : 0);
        }
        /* unary and its backward */
        const char *un[] = {"scale", "add_scalar", "gelu_tanh", "gelu_erf", "silu"};
        pr dy = rnd(2, (int64_t[]){R, C}, -1, 1);
        pr x = rnd(2, (int64_t[]){R, C}, -4, 4);
        for (int op = 0; op < 5; op++) {
            snprintf(info, sizeof info, "%s (%lld, %lld) alpha 0.7", un[op], (long long)R, (long long)C);
            if (have("unary", info, BE[1]->unary != NULL, ANNEAL_OP_UNARY, ANNEAL_F32, NULL, NULL, NULL)) {
                pr o = out_like(ANNEAL_F32, 2, (int64_t[]){R, C});
                CALL2(ok, "unary", info, unary, (anneal_unary_op)op, T(o), T(x), 0.7f);
                if (ok) cmp("unary", info, o, op < 2 ? 0 : TOL_F32);
            }
            if (have("unary_bwd", info, BE[1]->unary_bwd != NULL, ANNEAL_OP_UNARY, ANNEAL_F32, NULL, NULL, NULL)) {
                pr o = out_like(ANNEAL_F32, 2, (int64_t[]){R, C});
                CALL2(ok, "unary_bwd", info, unary_bwd, (anneal_unary_op)op, T(o), T(x), T(dy), 0.7f);
                if (ok) cmp("unary_bwd", info, o, op < 2 ? 0 : TOL_F32);
            }
        }
        /* scale_by: s and count on the device, each optional */
        for (int k = 0; k < 4; k++) {
            pr xs = rnd(2, (int64_t[]){R, C}, -2, 2);
            pr s = (k & 1) ? f32_scalar(2.5f) : NONE, cnt = (k & 2) ? i64_scalar(7) : NONE;
            snprintf(info, sizeof info, "(%lld, %lld) s %s count %s factor 3", (long long)R, (long long)C,
                     (k & 1) ? "2.5" : "NULL", (k & 2) ? "7" : "NULL");
            if (!have("scale_by", info, BE[1]->scale_by != NULL, ANNEAL_OP_SCALE_BY, ANNEAL_F32, NULL, NULL, NULL))
                continue;
            CALL2(ok, "scale_by", info, scale_by, T(xs), T(s), T(cnt), 3.0);
            if (ok) cmp("scale_by", info, xs, 0);
        }
    }
    /* reduce_sum over each pattern of dims, from a transposed view */
    {
        int64_t A = 7, Bd = 33, Cd = 129;
        pr base = rnd(3, (int64_t[]){Cd, Bd, A}, -1, 1);
        pr x = view(base, 3, (int64_t[]){A, Bd, Cd}, (int64_t[]){1, A, A * Bd}, 0);
        for (int mask = 1; mask < 8; mask++) {
            int64_t os[3] = {mask & 4 ? 1 : A, mask & 2 ? 1 : Bd, mask & 1 ? 1 : Cd};
            snprintf(info, sizeof info, "(%lld, %lld, %lld) transposed -> (%lld, %lld, %lld)", (long long)A,
                     (long long)Bd, (long long)Cd, (long long)os[0], (long long)os[1], (long long)os[2]);
            if (!have("reduce_sum", info, BE[1]->reduce_sum != NULL, ANNEAL_OP_REDUCE_SUM, ANNEAL_F32, NULL, NULL, NULL))
                continue;
            pr o = out_like(ANNEAL_F32, 3, os);
            CALL2(ok, "reduce_sum", info, reduce_sum, T(o), T(x));
            if (ok) cmp("reduce_sum", info, o, TOL_F32);
        }
        int64_t big = 1 << 20;
        pr xb = rnd(1, &big, -1, 1);
        pr o = out_like(ANNEAL_F32, 1, (int64_t[]){1});
        snprintf(info, sizeof info, "(%lld) -> (1)", (long long)big);
        if (have("reduce_sum", info, BE[1]->reduce_sum != NULL, ANNEAL_OP_REDUCE_SUM, ANNEAL_F32, NULL, NULL, NULL)) {
            CALL2(ok, "reduce_sum", info, reduce_sum, T(o), T(xb));
            if (ok) cmp("reduce_sum", info, o, 1e-4);
        }
    }
    /* sum_squares into slot 2 of an f64 vector (the others untouched) */
    {
        const int64_t ns[] = {1, 1000, 100003, 1 << 22};
        for (int k = 0; k < 4; k++) {
            pr x = rnd(1, &ns[k], -1, 1);
            double init[4] = {1, 2, 3, 4};
            pr o = from_host(ANNEAL_F64, 1, (int64_t[]){4}, init);
            snprintf(info, sizeof info, "(%lld) into out[2]", (long long)ns[k]);
            if (!have("sum_squares", info, BE[1]->sum_squares != NULL, ANNEAL_OP_SUM_SQUARES, ANNEAL_F32, NULL, NULL,
                      NULL))
                continue;
            CALL2(ok, "sum_squares", info, sum_squares, T(o), 2, T(x));
            if (ok) cmp("sum_squares", info, o, 1e-10);
        }
    }
    anneal_scope_close(sc);
}

/* ------------------------------------------------------------------ matmul */

static const char *epi_name(anneal_epilogue e) {
    static const char *n[] = {"none", "bias", "bias_gelu", "silu_mul", "bsum"};
    return (unsigned)e < 5 ? n[e] : "?";
}

/* One matmul case on both devices: A, B with row strides padded by 3, C by 1;
 * beta 0 (C NaN) or 0.5 (C random); batch with stride 0 on A or B when bcast_a/b. */
static void mm_case(int64_t batch, int64_t M, int64_t N, int64_t K, bool ta, bool tb, anneal_dtype compute,
                    anneal_epilogue epi, bool bcast_a, bool bcast_b, float beta, bool with_bias) {
    char info[160];
    snprintf(info, sizeof info, "b%lld %lldx%lldx%lld %c%c %s%s%s beta %.1f%s", (long long)batch, (long long)M,
             (long long)N, (long long)K, ta ? 'T' : 'N', tb ? 'T' : 'N', anneal_dtype_name(compute),
             epi ? " epi " : "", epi ? epi_name(epi) : "", (double)beta,
             bcast_a ? " bcastA" : bcast_b ? " bcastB" : "");
    if (epi && !with_bias) strncat(info, " nobias", sizeof info - strlen(info) - 1);
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int64_t lda = ac + 3, ldb = bc + 3, ldc = N + 1;
    int64_t sa = bcast_a ? 0 : ar * lda, sb = bcast_b ? 0 : br * ldb, scs = M * ldc;
    int64_t na = (bcast_a ? 1 : batch) * ar * lda, nb = (bcast_b ? 1 : batch) * br * ldb, nc = batch * M * ldc;
    anneal_matmul_desc d = {.batch = batch, .M = M, .N = N, .K = K, .trans_a = ta, .trans_b = tb, .lda = lda,
                            .ldb = ldb, .ldc = ldc, .stride_a = sa, .stride_b = sb, .stride_c = scs,
                            .alpha = 0.75f, .beta = beta, .compute = compute, .epilogue = epi};
    pr a = rnd(1, &na, -1, 1), b = rnd(1, &nb, -1, 1);
    pr c = beta == 0 ? out_like(ANNEAL_F32, 1, &nc) : rnd(1, &nc, -1, 1);
    pr bias = NONE, aux_in = NONE, aux_out = NONE, bsum = NONE;
    if ((epi == ANNEAL_EPILOGUE_BIAS || epi == ANNEAL_EPILOGUE_BIAS_GELU || epi == ANNEAL_EPILOGUE_SILU_MUL) &&
        with_bias)
        bias = rnd(1, &N, -1, 1);
    if (epi == ANNEAL_EPILOGUE_BIAS_GELU || epi == ANNEAL_EPILOGUE_SILU_MUL) aux_out = out_like(ANNEAL_F32, 1, &nc);
    if (epi == ANNEAL_EPILOGUE_SILU_MUL) aux_in = rnd(1, &nc, -1, 1);
    if (epi == ANNEAL_EPILOGUE_BSUM) bsum = out_like(ANNEAL_F32, 1, &N);
    d.bias = T(bias), d.aux_in = T(aux_in), d.aux_out = T(aux_out), d.bsum = T(bsum);
    if (!have("matmul", info, BE[1]->matmul != NULL, ANNEAL_OP_MATMUL, ANNEAL_F32, &d, NULL, NULL)) return;
    bool ok = true;
    for (dv = 0; dv < 2 && ok; dv++) {
        const anneal_backend *be = BE[dv];
        d.bias = T(bias), d.aux_in = T(aux_in), d.aux_out = T(aux_out), d.bsum = T(bsum);
        anneal_clear_error();
        anneal_status s = be->matmul(be->ctx, &d, T(c), T(a), T(b));
        if (s == ANNEAL_OK && dv == 1) s = be->synchronize(be->ctx);
        if (s != ANNEAL_OK) call_failed("matmul", info, s), ok = false;
    }
    dv = 0;
    if (!ok) return;
    /* C's padding column holds NaN (beta 0) or the old values on both: compared too */
    double tol = tol_of(compute);
    cmp("matmul", info, c, tol);
    if (aux_out.t[0]) cmp("matmul.aux_out", info, aux_out, tol);
    if (bsum.t[0]) cmp("matmul.bsum", info, bsum, TOL_F32);
}

TEST(matmul) {
    anneal_cuda_set_tf32(false);
    anneal_scope *sc = anneal_scope_open();
    const int64_t shapes[][3] = {{1, 1, 1}, {7, 33, 129}, {33, 7, 1000}, {129, 1000, 7}, {1000, 129, 33},
                                 {64, 128, 256}, {1, 1000, 129}};
    const anneal_dtype computes[] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_F16};
    for (int s = 0; s < 7; s++)
        for (int t = 0; t < 4; t++)
            for (int k = 0; k < 3; k++) {
                /* every transpose combination at f32 for every shape; bf16/f16 on a subset */
                if (k > 0 && (s % 2) != (t % 2)) continue;
                mm_case(1, shapes[s][0], shapes[s][1], shapes[s][2], t & 1, t & 2, computes[k], ANNEAL_EPILOGUE_NONE,
                        false, false, (s + t) % 2 ? 0.5f : 0.0f, true);
            }
    /* batched, with either operand broadcast (stride 0) */
    for (int t = 0; t < 4; t++)
        for (int k = 0; k < 2; k++) {
            mm_case(5, 33, 65, 129, t & 1, t & 2, computes[k], ANNEAL_EPILOGUE_NONE, false, false, 0.0f, true);
            mm_case(3, 7, 129, 64, t & 1, t & 2, computes[k], ANNEAL_EPILOGUE_NONE, true, false, 0.5f, true);
            mm_case(4, 129, 33, 7, t & 1, t & 2, computes[k], ANNEAL_EPILOGUE_NONE, false, true, 0.0f, true);
        }
    mm_case(12 * 2, 1, 64, 1000, false, true, ANNEAL_F32, ANNEAL_EPILOGUE_NONE, false, false, 0.0f, true);
    /* epilogues (batch 1), each transpose of the weight-like operand, each compute */
    for (int e = 1; e < ANNEAL_EPILOGUE_COUNT; e++)
        for (int k = 0; k < 3; k++)
            for (int t = 0; t < 4; t++) {
                bool wb = !(t == 3 && e != ANNEAL_EPILOGUE_BIAS); /* bias optional for gelu / silu_mul */
                mm_case(1, t == 1 ? 1 : 129, 33 + 64 * t, 1000 - 200 * t, t & 1, t & 2, computes[k],
                        (anneal_epilogue)e, false, false, t == 2 ? 0.5f : 0.0f, wb);
            }
    /* GPT-2 shapes: qkv forward, its weight gradient with the bias gradient */
    mm_case(1, 1000, 2304, 768, false, true, ANNEAL_BF16, ANNEAL_EPILOGUE_BIAS, false, false, 0.0f, true);
    mm_case(1, 768, 2304, 1000, true, false, ANNEAL_BF16, ANNEAL_EPILOGUE_NONE, false, false, 1.0f, true);
    mm_case(1, 2304, 768, 1000, true, false, ANNEAL_F32, ANNEAL_EPILOGUE_BSUM, false, false, 0.0f, true);
    anneal_scope_close(sc);
}

/* ------------------------------------------------- matmul fast paths (perf-gemm) */

/* One matmul case aimed at the GPU's fast paths (src/cuda/cuda_gemm.cu): A, B and C with
 * row padding pad_a / pad_b / pad_c (0: dense, so bf16/f16 operands round as one flat
 * float4 array; a multiple of 4: float4 rows; else the scalar kernel), beta 0 (C NaN) or
 * 1, the epilogue fused into cuBLASLt where allowed (BIAS, BIAS_GELU with a bias, beta 0,
 * 16-bit compute; aux_out fused when ldc is a multiple of 8) and with
 * ANNEAL_CUDA_GEMM_FUSED=0 (unfused) when env0. batch > 1 only without an epilogue (B
 * broadcast when bcast_b). */
static void mmf_case(int64_t batch, int64_t M, int64_t N, int64_t K, bool ta, bool tb, anneal_dtype compute,
                     anneal_epilogue epi, int64_t pad_a, int64_t pad_b, int64_t pad_c, float beta, bool with_bias,
                     bool with_aux, bool bcast_b, bool env0) {
    char info[200];
    snprintf(info, sizeof info, "b%lld %lldx%lldx%lld %c%c %s epi %s pad %lld/%lld/%lld beta %.1f%s%s%s%s",
             (long long)batch, (long long)M, (long long)N, (long long)K, ta ? 'T' : 'N', tb ? 'T' : 'N',
             anneal_dtype_name(compute), epi_name(epi), (long long)pad_a, (long long)pad_b, (long long)pad_c,
             (double)beta, with_bias ? "" : " nobias", with_aux ? " aux" : "", bcast_b ? " bcastB" : "",
             env0 ? " FUSED=0" : "");
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int64_t lda = ac + pad_a, ldb = bc + pad_b, ldc = N + pad_c;
    int64_t sa = ar * lda, sb = bcast_b ? 0 : br * ldb, scs = M * ldc;
    int64_t na = batch * ar * lda, nb = (bcast_b ? 1 : batch) * br * ldb, nc = batch * M * ldc;
    anneal_matmul_desc d = {.batch = batch, .M = M, .N = N, .K = K, .trans_a = ta, .trans_b = tb, .lda = lda,
                            .ldb = ldb, .ldc = ldc, .stride_a = sa, .stride_b = sb, .stride_c = scs,
                            .alpha = 0.75f, .beta = beta, .compute = compute, .epilogue = epi};
    pr a = rnd(1, &na, -1, 1), b = rnd(1, &nb, -1, 1);
    pr c = beta == 0 ? out_like(ANNEAL_F32, 1, &nc) : rnd(1, &nc, -1, 1);
    pr bias = NONE, aux_out = NONE;
    if ((epi == ANNEAL_EPILOGUE_BIAS || epi == ANNEAL_EPILOGUE_BIAS_GELU) && with_bias) bias = rnd(1, &N, -1, 1);
    if (epi == ANNEAL_EPILOGUE_BIAS_GELU && with_aux) aux_out = out_like(ANNEAL_F32, 1, &nc);
    d.bias = T(bias), d.aux_out = T(aux_out);
    if (!have("matmul", info, BE[1]->matmul != NULL, ANNEAL_OP_MATMUL, ANNEAL_F32, &d, NULL, NULL)) return;
    bool ok = true;
    for (dv = 0; dv < 2 && ok; dv++) {
        const anneal_backend *be = BE[dv];
        d.bias = T(bias), d.aux_out = T(aux_out);
        if (dv == 1 && env0) setenv("ANNEAL_CUDA_GEMM_FUSED", "0", 1);
        anneal_clear_error();
        anneal_status s = be->matmul(be->ctx, &d, T(c), T(a), T(b));
        if (s == ANNEAL_OK && dv == 1) s = be->synchronize(be->ctx);
        if (dv == 1 && env0) unsetenv("ANNEAL_CUDA_GEMM_FUSED");
        if (s != ANNEAL_OK) call_failed("matmul", info, s), ok = false;
    }
    dv = 0;
    if (!ok) return;
    double tol = tol_of(compute);
    cmp("matmul", info, c, tol);
    if (aux_out.t[0]) cmp("matmul.aux_out", info, aux_out, tol);
}

/* The fast paths of the matmul slot against the CPU: vectorised operand rounding (dense,
 * float4 rows, scalar; batched, broadcast), cuBLASLt-fused BIAS / GELU_BIAS /
 * GELU_AUX_BIAS, and each case that must fall back (beta 1, no bias, aux_out with ldc not
 * a multiple of 8, f32 compute, ANNEAL_CUDA_GEMM_FUSED=0). Odd shapes included. */
TEST(matmul_fused) {
    anneal_cuda_set_tf32(false);
    anneal_scope *sc = anneal_scope_open();
    const anneal_dtype c16[] = {ANNEAL_BF16, ANNEAL_F16};
    /* operand rounding: dense / float4 rows / scalar, each transpose, plain product */
    const int64_t rs[][3] = {{64, 128, 256}, {33, 40, 72}, {129, 33, 1000}, {8, 1000, 7}};
    for (int s = 0; s < 4; s++)
        for (int t = 0; t < 4; t++)
            for (int pad = 0; pad < 3; pad++) {
                int64_t pd = pad == 0 ? 0 : pad == 1 ? 4 : 3;
                mmf_case(1, rs[s][0], rs[s][1], rs[s][2], t & 1, t & 2, c16[(s + t) % 2], ANNEAL_EPILOGUE_NONE, pd,
                         pd, pad == 1 ? 8 : 1, (t % 2) ? 1.0f : 0.0f, true, false, false, false);
            }
    /* batched dense (flat across the batch) and broadcast B, bf16 and f16 */
    for (int k = 0; k < 2; k++) {
        mmf_case(3, 32, 64, 48, false, true, c16[k], ANNEAL_EPILOGUE_NONE, 0, 0, 0, 0.0f, true, false, false, false);
        mmf_case(4, 17, 24, 40, true, false, c16[k], ANNEAL_EPILOGUE_NONE, 0, 0, 0, 1.0f, true, false, true, false);
        mmf_case(2, 9, 36, 20, false, false, c16[k], ANNEAL_EPILOGUE_NONE, 4, 4, 0, 0.0f, true, false, false, false);
    }
    /* fused epilogues and their fallbacks */
    const int64_t es[][3] = {{256, 768, 768}, {129, 40, 1000}, {7, 33, 129}, {1, 64, 32}, {100, 3072, 64}};
    for (int s = 0; s < 5; s++)
        for (int k = 0; k < 2; k++)
            for (int v = 0; v < 8; v++) {
                /* v: 0 BIAS; 1 GELU+aux; 2 GELU no aux; 3 GELU no bias (unfused); 4 BIAS beta 1
                 * (unfused); 5 GELU+aux beta 1 (unfused); 6 GELU+aux with ldc = N+1 (aux unfused);
                 * 7 GELU+aux with FUSED=0 */
                bool tb = (s + v) % 2 == 0, ta = s == 2 && v < 2;
                anneal_epilogue e = v == 0 || v == 4 ? ANNEAL_EPILOGUE_BIAS : ANNEAL_EPILOGUE_BIAS_GELU;
                bool aux = v == 1 || v == 5 || v == 6 || v == 7;
                int64_t pc = v == 6 ? 1 : 0;
                float beta = (v == 4 || v == 5) ? 1.0f : 0.0f;
                mmf_case(1, es[s][0], es[s][1], es[s][2], ta, tb, c16[k], e, 0, 0, pc, beta, v != 3, aux, false,
                         v == 7);
            }
    /* f32 compute with a bias (never fused), and the GPT-2 fc shape with FUSED=0 and not */
    mmf_case(1, 129, 40, 72, false, true, ANNEAL_F32, ANNEAL_EPILOGUE_BIAS_GELU, 0, 0, 0, 0.0f, true, true, false,
             false);
    for (int env0 = 0; env0 < 2; env0++)
        mmf_case(1, 512, 3072, 768, false, true, ANNEAL_BF16, ANNEAL_EPILOGUE_BIAS_GELU, 0, 0, 0, 0.0f, true, true,
                 false, env0);
    anneal_scope_close(sc);
}

/* ---------------------------------------------------------------- row ops */

TEST(norms_and_softmax) {
    anneal_scope *sc = anneal_scope_open();
    char info[160];
    bool ok;
    const int64_t shapes[][2] = {{1, 1}, {7, 33}, {33, 768}, {1000, 129}, {5, 4097}};
    for (int si = 0; si < 5; si++) {
        int64_t N = shapes[si][0], C = shapes[si][1];
        int64_t sh[2] = {N, C};
        pr x = rnd(2, sh, -3, 3), r = rnd(2, sh, -1, 1), w = rnd(1, &C, 0.5f, 1.5f), b = rnd(1, &C, -0.5f, 0.5f);
        pr dy = rnd(2, sh, -1, 1), ds = rnd(2, sh, -1, 1);
        /* layer_norm */
        snprintf(info, sizeof info, "(%lld, %lld) eps 1e-5", (long long)N, (long long)C);
        if (have("layer_norm_fwd", info, BE[1]->layer_norm_fwd != NULL, ANNEAL_OP_LAYER_NORM, ANNEAL_F32, NULL, NULL,
                 NULL)) {
            pr y = out_like(ANNEAL_F32, 2, sh), mean = out_like(ANNEAL_F32, 1, &N), rstd = out_like(ANNEAL_F32, 1, &N);
            CALL2(ok, "layer_norm_fwd", info, layer_norm_fwd, T(y), T(mean), T(rstd), T(x), T(w), T(b), 1e-5f);
            if (ok) {
                cmp("layer_norm_fwd.y", info, y, TOL_F32);
                cmp("layer_norm_fwd.mean", info, mean, TOL_F32);
                cmp("layer_norm_fwd.rstd", info, rstd, TOL_F32);
            }
            if (ok && have("layer_norm_bwd", info, BE[1]->layer_norm_bwd != NULL, ANNEAL_OP_LAYER_NORM, ANNEAL_F32,
                           NULL, NULL, NULL)) {
                for (int want = 0; want < 2; want++) {
                    pr dx = out_like(ANNEAL_F32, 2, sh), dw = want ? out_like(ANNEAL_F32, 1, &C) : NONE,
                       db = want ? out_like(ANNEAL_F32, 1, &C) : NONE;
                    char i2[200];
                    snprintf(i2, sizeof i2, "%s%s", info, want ? "" : " dw=db=NULL");
                    CALL2(ok, "layer_norm_bwd", i2, layer_norm_bwd, T(dx), T(dw), T(db), T(x), T(w), T(mean), T(rstd),
                          T(dy));
                    if (!ok) continue;
                    cmp("layer_norm_bwd.dx", i2, dx, TOL_F32);
                    if (want) cmp("layer_norm_bwd.dw", i2, dw, TOL_F32), cmp("layer_norm_bwd.db", i2, db, TOL_F32);
                }
            }
        }
        /* add_layer_norm */
        if (have("add_layer_norm_fwd", info, BE[1]->add_layer_norm_fwd != NULL, ANNEAL_OP_ADD_LAYER_NORM, ANNEAL_F32,
                 NULL, NULL, NULL)) {
            pr s = out_like(ANNEAL_F32, 2, sh), y = out_like(ANNEAL_F32, 2, sh), mean = out_like(ANNEAL_F32, 1, &N),
               rstd = out_like(ANNEAL_F32, 1, &N);
            CALL2(ok, "add_layer_norm_fwd", info, add_layer_norm_fwd, T(s), T(y), T(mean), T(rstd), T(x), T(r), T(w),
                  T(b), 1e-5f);
            if (ok) {
                cmp("add_layer_norm_fwd.s", info, s, 0);
                cmp("add_layer_norm_fwd.y", info, y, TOL_F32);
                cmp("add_layer_norm_fwd.mean", info, mean, TOL_F32);
                cmp("add_layer_norm_fwd.rstd", info, rstd, TOL_F32);
            }
            if (ok && have("add_layer_norm_bwd", info, BE[1]->add_layer_norm_bwd != NULL, ANNEAL_OP_ADD_LAYER_NORM,
                           ANNEAL_F32, NULL, NULL, NULL)) {
                for (int k = 0; k < 2; k++) {
                    pr dx = out_like(ANNEAL_F32, 2, sh), dw = out_like(ANNEAL_F32, 1, &C),
                       db = out_like(ANNEAL_F32, 1, &C);
                    pr dsk = k ? ds : NONE;
                    char i2[200];
                    snprintf(i2, sizeof i2, "%s ds %s", info, k ? "given" : "NULL");
                    CALL2(ok, "add_layer_norm_bwd", i2, add_layer_norm_bwd, T(dx), T(dw), T(db), T(s), T(w), T(mean),
                          T(rstd), T(dy), T(dsk));
                    if (!ok) continue;
                    cmp("add_layer_norm_bwd.dx", i2, dx, TOL_F32);
                    cmp("add_layer_norm_bwd.dw", i2, dw, TOL_F32);
                    cmp("add_layer_norm_bwd.db", i2, db, TOL_F32);
                }
            }
        }
        /* rms_norm */
        if (have("rms_norm_fwd", info, BE[1]->rms_norm_fwd != NULL, ANNEAL_OP_RMS_NORM, ANNEAL_F32, NULL, NULL, NULL)) {
            pr y = out_like(ANNEAL_F32, 2, sh), rstd = out_like(ANNEAL_F32, 1, &N);
            CALL2(ok, "rms_norm_fwd", info, rms_norm_fwd, T(y), T(rstd), T(x), T(w), 1e-6f);
            if (ok) cmp("rms_norm_fwd.y", info, y, TOL_F32), cmp("rms_norm_fwd.rstd", info, rstd, TOL_F32);
            if (ok && have("rms_norm_bwd", info, BE[1]->rms_norm_bwd != NULL, ANNEAL_OP_RMS_NORM, ANNEAL_F32, NULL,
                           NULL, NULL)) {
                pr dx = out_like(ANNEAL_F32, 2, sh), dw = out_like(ANNEAL_F32, 1, &C);
                CALL2(ok, "rms_norm_bwd", info, rms_norm_bwd, T(dx), T(dw), T(x), T(w), T(rstd), T(dy));
                if (ok) cmp("rms_norm_bwd.dx", info, dx, TOL_F32), cmp("rms_norm_bwd.dw", info, dw, TOL_F32);
            }
        }
        /* softmax and log-softmax */
        for (int lg = 0; lg < 2; lg++) {
            char i2[200];
            snprintf(i2, sizeof i2, "%s%s", info, lg ? " log" : "");
            if (!have("softmax_fwd", i2, BE[1]->softmax_fwd != NULL, ANNEAL_OP_SOFTMAX, ANNEAL_F32, NULL, NULL, NULL))
                continue;
            pr xs = rnd(2, sh, -10, 10);
            pr y = out_like(ANNEAL_F32, 2, sh);
            CALL2(ok, "softmax_fwd", i2, softmax_fwd, T(y), T(xs), lg);
            if (ok) cmp("softmax_fwd", i2, y, TOL_F32);
            if (!ok || !have("softmax_bwd", i2, BE[1]->softmax_bwd != NULL, ANNEAL_OP_SOFTMAX, ANNEAL_F32, NULL, NULL,
                             NULL))
                continue;
            pr dx = out_like(ANNEAL_F32, 2, sh);
            /* both from the CPU's y so the backward alone is compared */
            pr yc = from_host(ANNEAL_F32, 2, sh, anneal_data(y.t[0]));
            CALL2(ok, "softmax_bwd", i2, softmax_bwd, T(dx), T(yc), T(dy), lg);
            if (ok) cmp("softmax_bwd", i2, dx, TOL_F32);
        }
    }
    anneal_scope_close(sc);
}

TEST(rope) {
    anneal_scope *sc = anneal_scope_open();
    char info[200];
    bool ok;
    const anneal_rope_desc descs[3] = {
        {.theta = 10000.0f, .scaling = ANNEAL_ROPE_SCALING_NONE},
        {.theta = 10000.0f, .scaling = ANNEAL_ROPE_SCALING_LINEAR, .factor = 4.0f},
        {.theta = 500000.0f, .scaling = ANNEAL_ROPE_SCALING_LLAMA3, .factor = 8.0f, .low_freq_factor = 1.0f,
         .high_freq_factor = 4.0f, .original_max_pos = 8192},
    };
    const char *names[3] = {"none", "linear", "llama3"};
    const int64_t Ds[3] = {64, 128, 6};
    for (int k = 0; k < 3; k++)
        for (int di = 0; di < 3; di++)
            for (int inv = 0; inv < 2; inv++) {
                int64_t Bn = 2, H = 3, Tn = 77, D = Ds[di];
                /* a (B, T, H, D) buffer seen as (B, H, T, D), as the attention op's heads are */
                pr base = rnd(4, (int64_t[]){Bn, Tn, H, D}, -1, 1);
                pr x = view(base, 4, (int64_t[]){Bn, H, Tn, D}, (int64_t[]){Tn * H * D, D, H * D, 1}, 0);
                snprintf(info, sizeof info, "%s (%lld, %lld, %lld, %lld) strided pos0 1000%s", names[k], (long long)Bn,
                         (long long)H, (long long)Tn, (long long)D, inv ? " inverse" : "");
                if (!have("rope", info, BE[1]->rope != NULL, ANNEAL_OP_ROPE, ANNEAL_F32, NULL, NULL, &descs[k]))
                    continue;
                CALL2(ok, "rope", info, rope, &descs[k], T(x), 1000, inv);
                /* 1e-4: an ulp of inv_freq (powf) times a position near 1000 moves the
                 * angle by ~6e-5 rad; a wrong pairing or scaling is O(1) */
                if (ok) cmp("rope", info, base, 1e-4);
            }
    anneal_scope_close(sc);
}

/* -------------------------------------------------------------- attention */

typedef struct attn_case {
    int64_t B, Hq, Hkv, Tq, Tk, D;
    bool causal, packed; /* packed: q, k, v are head views of one (B, T, (Hq + 2 Hkv) D) projection */
    anneal_dtype compute;
} attn_case;

static void attn_run(attn_case a) {
    char info[200];
    snprintf(info, sizeof info, "B%lld Hq%lld Hkv%lld Tq%lld Tk%lld D%lld %s%s %s", (long long)a.B, (long long)a.Hq,
             (long long)a.Hkv, (long long)a.Tq, (long long)a.Tk, (long long)a.D, a.causal ? "causal" : "full",
             a.packed ? " packed" : " (B,T,H,D) views", anneal_dtype_name(a.compute));
    int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, Tq = a.Tq, Tk = a.Tk, D = a.D;
    pr q, k, v, o, dq, dk, dv_, dout;
    pr gq, gk, gv; /* the gradient buffers' storages (compared whole) */
    int64_t W = (Hq + 2 * Hkv) * D;
    if (a.packed) { /* self-attention: Tq == Tk */
        pr qkv = rnd(3, (int64_t[]){B, Tq, W}, -1, 1);
        q = view(qkv, 4, (int64_t[]){B, Hq, Tq, D}, (int64_t[]){Tq * W, D, W, 1}, 0);
        k = view(qkv, 4, (int64_t[]){B, Hkv, Tk, D}, (int64_t[]){Tk * W, D, W, 1}, Hq * D);
        v = view(qkv, 4, (int64_t[]){B, Hkv, Tk, D}, (int64_t[]){Tk * W, D, W, 1}, (Hq + Hkv) * D);
        gq = out_like(ANNEAL_F32, 3, (int64_t[]){B, Tq, W});
        dq = view(gq, 4, (int64_t[]){B, Hq, Tq, D}, (int64_t[]){Tq * W, D, W, 1}, 0);
        dk = view(gq, 4, (int64_t[]){B, Hkv, Tk, D}, (int64_t[]){Tk * W, D, W, 1}, Hq * D);
        dv_ = view(gq, 4, (int64_t[]){B, Hkv, Tk, D}, (int64_t[]){Tk * W, D, W, 1}, (Hq + Hkv) * D);
        gk = gv = NONE;
    } else { /* (B, T, H, D) storages seen as (B, H, T, D) */
        pr qb = rnd(4, (int64_t[]){B, Tq, Hq, D}, -1, 1), kb = rnd(4, (int64_t[]){B, Tk, Hkv, D}, -1, 1),
           vb = rnd(4, (int64_t[]){B, Tk, Hkv, D}, -1, 1);
        int64_t qs[4] = {Tq * Hq * D, D, Hq * D, 1}, ks[4] = {Tk * Hkv * D, D, Hkv * D, 1};
        q = view(qb, 4, (int64_t[]){B, Hq, Tq, D}, qs, 0);
        k = view(kb, 4, (int64_t[]){B, Hkv, Tk, D}, ks, 0);
        v = view(vb, 4, (int64_t[]){B, Hkv, Tk, D}, ks, 0);
        gq = out_like(ANNEAL_F32, 4, (int64_t[]){B, Tq, Hq, D});
        gk = out_like(ANNEAL_F32, 4, (int64_t[]){B, Tk, Hkv, D});
        gv = out_like(ANNEAL_F32, 4, (int64_t[]){B, Tk, Hkv, D});
        dq = view(gq, 4, (int64_t[]){B, Hq, Tq, D}, qs, 0);
        dk = view(gk, 4, (int64_t[]){B, Hkv, Tk, D}, ks, 0);
        dv_ = view(gv, 4, (int64_t[]){B, Hkv, Tk, D}, ks, 0);
    }
    pr ob = out_like(ANNEAL_F32, 4, (int64_t[]){B, Tq, Hq, D});
    int64_t os[4] = {Tq * Hq * D, D, Hq * D, 1};
    o = view(ob, 4, (int64_t[]){B, Hq, Tq, D}, os, 0);
    pr dob = rnd(4, (int64_t[]){B, Tq, Hq, D}, -1, 1);
    dout = view(dob, 4, (int64_t[]){B, Hq, Tq, D}, os, 0);
    pr lse = out_like(ANNEAL_F32, 3, (int64_t[]){B, Hq, Tq});
    anneal_attention_desc d = {.B = B, .Hq = Hq, .Hkv = Hkv, .Tq = Tq, .Tk = Tk, .D = D,
                               .q_sb = q.t[0]->strides[0], .q_sh = q.t[0]->strides[1], .q_st = q.t[0]->strides[2],
                               .k_sb = k.t[0]->strides[0], .k_sh = k.t[0]->strides[1], .k_st = k.t[0]->strides[2],
                               .v_sb = v.t[0]->strides[0], .v_sh = v.t[0]->strides[1], .v_st = v.t[0]->strides[2],
                               .o_sb = os[0], .o_sh = os[1], .o_st = os[2],
                               .scale = 1.0f / sqrtf((float)D), .causal = a.causal, .compute = a.compute};
    if (!have("attention_fwd", info, BE[1]->attention_fwd != NULL, ANNEAL_OP_ATTENTION, ANNEAL_F32, NULL, &d, NULL))
        return;
    bool ok;
    double tol = a.compute == ANNEAL_BF16 ? TOL_BF16 : TOL_F32;
    CALL2(ok, "attention_fwd", info, attention_fwd, &d, T(o), T(lse), T(q), T(k), T(v));
    if (!ok) return;
    cmp("attention_fwd.o", info, ob, tol);
    cmp("attention_fwd.lse", info, lse, tol);
    if (!BE[1]->attention_bwd) {
        unsupported("attention_bwd", info);
        return;
    }
    /* the backward from the CPU's o and lse on both devices */
    pr oc = from_host(ANNEAL_F32, 4, (int64_t[]){B, Tq, Hq, D}, anneal_data(ob.t[0]));
    pr o2 = view(oc, 4, (int64_t[]){B, Hq, Tq, D}, os, 0);
    pr lc = from_host(ANNEAL_F32, 3, (int64_t[]){B, Hq, Tq}, anneal_data(lse.t[0]));
    CALL2(ok, "attention_bwd", info, attention_bwd, &d, T(dq), T(dk), T(dv_), T(q), T(k), T(v), T(o2), T(dout), T(lc));
    if (!ok) return;
    if (a.packed) {
        cmp("attention_bwd.dqkv", info, gq, tol);
    } else {
        cmp("attention_bwd.dq", info, gq, tol);
        cmp("attention_bwd.dk", info, gk, tol);
        cmp("attention_bwd.dv", info, gv, tol);
    }
}

TEST(attention) {
    anneal_scope *sc = anneal_scope_open();
    const attn_case cases[] = {
        /* GPT-2-like: packed qkv, causal, T a multiple of 64 and not */
        {2, 12, 12, 128, 128, 64, true, true, ANNEAL_F32},
        {2, 4, 4, 100, 100, 64, true, true, ANNEAL_F32},
        {2, 4, 4, 100, 100, 64, true, true, ANNEAL_BF16},
        {1, 2, 2, 1, 1, 64, true, true, ANNEAL_F32},
        {1, 2, 2, 257, 257, 128, true, true, ANNEAL_BF16},
        {1, 2, 2, 257, 257, 128, false, true, ANNEAL_F32},
        /* GQA / MQA, Tq != Tk (a KV cache: bottom-right causal), Tq = 1 */
        {2, 8, 2, 33, 97, 64, true, false, ANNEAL_F32},
        {2, 8, 2, 33, 97, 64, false, false, ANNEAL_F32},
        {1, 8, 1, 1, 200, 128, true, false, ANNEAL_F32},
        {1, 8, 1, 1, 200, 128, true, false, ANNEAL_BF16},
        {2, 6, 3, 65, 65, 128, true, false, ANNEAL_BF16},
        {1, 4, 2, 70, 7, 64, false, false, ANNEAL_F32},
        {1, 12, 12, 1024, 1024, 64, true, true, ANNEAL_BF16},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) attn_run(cases[i]);
    anneal_scope_close(sc);
}

/* The fast BF16 attention kernels (D <= 64, 16-byte aligned rows: 128-row query tiles,
 * cp.async staging, ldmatrix): long and odd T, GQA, Tq != Tk both ways, D < 64; then a
 * D that is no multiple of 4 (the mma kernels) and one case with ANNEAL_CUDA_ATTN_FAST=0. */
TEST(attention_fast) {
    anneal_scope *sc = anneal_scope_open();
    const attn_case cases[] = {
        {2, 12, 12, 1024, 1024, 64, true, true, ANNEAL_BF16},
        {1, 4, 4, 333, 333, 64, true, true, ANNEAL_BF16},
        {1, 4, 4, 257, 257, 48, false, true, ANNEAL_BF16},
        {2, 8, 2, 33, 97, 64, true, false, ANNEAL_BF16},
        {1, 4, 2, 200, 70, 64, true, false, ANNEAL_BF16},
        {1, 4, 2, 130, 300, 32, false, false, ANNEAL_BF16},
        {1, 2, 1, 1, 77, 64, true, false, ANNEAL_BF16},
        {1, 2, 2, 70, 70, 62, true, true, ANNEAL_BF16},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) attn_run(cases[i]);
    setenv("ANNEAL_CUDA_ATTN_FAST", "0", 1);
    attn_run((attn_case){1, 4, 4, 333, 333, 64, true, true, ANNEAL_BF16});
    unsetenv("ANNEAL_CUDA_ATTN_FAST");
    anneal_scope_close(sc);
}

/* ----------------------------------------------------- index checks, losses */

TEST(check_index) {
    anneal_scope *sc = anneal_scope_open();
    if (!BE[1]->check_index ||
        !gpu_supports(ANNEAL_OP_CHECK_INDEX, ANNEAL_I32, NULL, NULL, NULL)) {
        unsupported("check_index", "");
        anneal_scope_close(sc);
        return;
    }
    int32_t ids[3 * 5];
    for (int i = 0; i < 15; i++) ids[i] = (i * 7) % 50;
    ids[4] = -100;
    const struct {
        int bad_at;
        int32_t bad;
        bool ign;
    } cases[] = {{-1, 0, true}, {-1, 0, false}, {7, 50, true}, {7, -3, false}, {4, 0, false}, {12, 1 << 30, true}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int32_t v[15];
        memcpy(v, ids, sizeof v);
        if (cases[c].bad_at >= 0 && cases[c].bad_at != 4) v[cases[c].bad_at] = cases[c].bad;
        /* case {4, 0, false}: -100 at [0, 4] without ignore_index is the bad one */
        if (cases[c].bad_at >= 0 && cases[c].bad_at < 12) v[13] = 99; /* a second bad one later: the first is named */
        pr t = i32s(2, (int64_t[]){3, 5}, v);
        pr cnt = i64_scalar(-1);
        anneal_status st[2];
        char msg[2][512];
        for (dv = 0; dv < 2; dv++) {
            anneal_clear_error();
            st[dv] = BE[dv]->check_index(BE[dv]->ctx, "embedding", "id", T(t), 50, cases[c].ign, -100, T(cnt));
            if (dv == 1) {
                anneal_status s2 = BE[1]->synchronize(BE[1]->ctx);
                if (st[1] == ANNEAL_OK) st[1] = s2;
            }
            snprintf(msg[dv], sizeof msg[dv], "%s", st[dv] == ANNEAL_OK ? "" : anneal_last_error());
        }
        dv = 0;
        anneal_clear_error();
        /* the deferred error must not linger into the next synchronize */
        anneal_status again = BE[1]->synchronize(BE[1]->ctx);
        anneal_clear_error();
        char info[96];
        snprintf(info, sizeof info, "(3, 5) case %zu%s", c, cases[c].ign ? " ignore -100" : "");
        bool pass = st[0] == st[1] && !strcmp(msg[0], msg[1]) && again == ANNEAL_OK;
        printf("CHECK %-24s %-52s status %s / %s  %s\n", "check_index", info, anneal_status_name(st[1]),
               anneal_status_name(st[0]), pass ? "PASS" : "FAIL");
        if (!pass)
            printf("  gpu: \"%s\"\n  cpu: \"%s\"\n  next synchronize: %s\n", msg[1], msg[0], anneal_status_name(again));
        n_checks++;
        if (pass) n_pass++;
        else n_fail++, line_fail();
        if (st[0] == ANNEAL_OK) cmp("check_index.count", info, cnt, 0);
    }
    anneal_scope_close(sc);
}

static void make_targets(int32_t *t, int64_t N, int64_t V, int every_ignored) {
    for (int64_t i = 0; i < N; i++)
        t[i] = every_ignored && i % every_ignored == 1 ? -100 : (int32_t)(anneal_test_next_u64() % (uint64_t)V);
}

static int64_t kept(const int32_t *t, int64_t N) {
    int64_t n = 0;
    for (int64_t i = 0; i < N; i++) n += t[i] != -100;
    return n;
}

TEST(embedding_and_losses) {
    anneal_scope *sc = anneal_scope_open();
    char info[200];
    bool ok;
    /* embedding: repeated ids (a deterministic backward must add rows in order) */
    {
        const int64_t cfg[][3] = {{1, 1, 1}, {1000, 50, 33}, {4096, 1000, 768}, {7, 50257, 129}};
        for (int c = 0; c < 4; c++) {
            int64_t N = cfg[c][0], V = cfg[c][1], C = cfg[c][2];
            int32_t *ids = malloc((size_t)N * sizeof *ids);
            for (int64_t i = 0; i < N; i++) ids[i] = (int32_t)(anneal_test_next_u64() % (uint64_t)(V < 20 ? V : 20));
            pr id = i32s(1, &N, ids);
            free(ids);
            pr w = rnd(2, (int64_t[]){V, C}, -1, 1), dy = rnd(2, (int64_t[]){N, C}, -1, 1);
            snprintf(info, sizeof info, "N %lld V %lld C %lld (ids repeat)", (long long)N, (long long)V, (long long)C);
            if (have("embedding_fwd", info, BE[1]->embedding_fwd != NULL, ANNEAL_OP_EMBEDDING, ANNEAL_F32, NULL, NULL,
                     NULL)) {
                pr y = out_like(ANNEAL_F32, 2, (int64_t[]){N, C});
                CALL2(ok, "embedding_fwd", info, embedding_fwd, T(y), T(id), T(w));
                if (ok) cmp("embedding_fwd", info, y, 0);
            }
            if (have("embedding_bwd", info, BE[1]->embedding_bwd != NULL, ANNEAL_OP_EMBEDDING, ANNEAL_F32, NULL, NULL,
                     NULL)) {
                pr dw = out_like(ANNEAL_F32, 2, (int64_t[]){V, C});
                CALL2(ok, "embedding_bwd", info, embedding_bwd, T(dw), T(id), T(dy));
                if (ok) cmp("embedding_bwd", info, dw, TOL_F32);
            }
        }
    }
    /* cross-entropy with ignored rows, loss_mean */
    {
        const int64_t cfg[][2] = {{1, 1}, {7, 33}, {33, 1000}, {1000, 129}, {7, 50257}, {64, 50304}};
        for (int c = 0; c < 6; c++) {
            int64_t N = cfg[c][0], V = cfg[c][1];
            int32_t *tg = malloc((size_t)N * sizeof *tg);
            make_targets(tg, N, V, N > 1 ? 3 : 0);
            int64_t nk = kept(tg, N);
            pr t = i32s(1, &N, tg);
            free(tg);
            pr logits = rnd(2, (int64_t[]){N, V}, -8, 8);
            pr cnt = i64_scalar(nk), s = f32_scalar(1.3f);
            snprintf(info, sizeof info, "N %lld V %lld, %lld rows kept", (long long)N, (long long)V, (long long)nk);
            if (!have("cross_entropy_fwd", info, BE[1]->cross_entropy_fwd != NULL, ANNEAL_OP_CROSS_ENTROPY, ANNEAL_F32,
                      NULL, NULL, NULL))
                continue;
            pr loss = out_like(ANNEAL_F32, 1, &N), lse = out_like(ANNEAL_F32, 1, &N);
            CALL2(ok, "cross_entropy_fwd", info, cross_entropy_fwd, T(loss), T(lse), T(logits), T(t), -100);
            if (!ok) continue;
            cmp("cross_entropy_fwd.loss", info, loss, TOL_F32);
            cmp("cross_entropy_fwd.lse", info, lse, TOL_F32);
            pr lc = from_host(ANNEAL_F32, 1, &N, anneal_data(lse.t[0]));
            if (have("cross_entropy_bwd", info, BE[1]->cross_entropy_bwd != NULL, ANNEAL_OP_CROSS_ENTROPY, ANNEAL_F32,
                     NULL, NULL, NULL)) {
                pr dl = out_like(ANNEAL_F32, 2, (int64_t[]){N, V});
                CALL2(ok, "cross_entropy_bwd", info, cross_entropy_bwd, T(dl), T(logits), T(t), T(lc), -100, T(s),
                      T(cnt));
                if (ok) cmp("cross_entropy_bwd", info, dl, TOL_F32);
            }
            if (have("loss_mean", info, BE[1]->loss_mean != NULL, ANNEAL_OP_LOSS_MEAN, ANNEAL_F32, NULL, NULL, NULL)) {
                pr rows = from_host(ANNEAL_F32, 1, &N, anneal_data(loss.t[0]));
                pr m = out_like(ANNEAL_F32, 0, NULL);
                CALL2(ok, "loss_mean", info, loss_mean, T(m), T(rows), T(t), -100, T(cnt));
                if (ok) cmp("loss_mean", info, m, 0);
            }
        }
        /* every row ignored: count 0 gives 0 */
        int32_t all[5] = {-100, -100, -100, -100, -100};
        pr t = i32s(1, (int64_t[]){5}, all), rows = rnd(1, (int64_t[]){5}, 0, 5), cnt = i64_scalar(0);
        if (have("loss_mean", "all ignored", BE[1]->loss_mean != NULL, ANNEAL_OP_LOSS_MEAN, ANNEAL_F32, NULL, NULL,
                 NULL)) {
            pr m = out_like(ANNEAL_F32, 0, NULL);
            CALL2(ok, "loss_mean", "N 5 all ignored, count 0", loss_mean, T(m), T(rows), T(t), -100, T(cnt));
            if (ok) cmp("loss_mean", "N 5 all ignored, count 0", m, 0);
        }
    }
    /* linear cross-entropy in chunks (N not a multiple of the chunk), with and without
     * the gradients, each compute */
    {
        const int64_t cfg[][4] = {{37, 1000, 64, 16}, {300, 2000, 128, 128}, {5, 50257, 48, 4}};
        const anneal_dtype computes[] = {ANNEAL_F32, ANNEAL_BF16, ANNEAL_F16};
        for (int c = 0; c < 3; c++)
            for (int k = 0; k < 3; k++)
                for (int grads = 0; grads < 2; grads++) {
                    int64_t N = cfg[c][0], V = cfg[c][1], C = cfg[c][2], rows = cfg[c][3];
                    int32_t *tg = malloc((size_t)N * sizeof *tg);
                    make_targets(tg, N, V, 4);
                    int64_t nk = kept(tg, N);
                    pr t = i32s(1, &N, tg);
                    free(tg);
                    pr h = rnd(2, (int64_t[]){N, C}, -1, 1), w = rnd(2, (int64_t[]){V, C}, -0.2f, 0.2f);
                    pr cnt = i64_scalar(nk);
                    pr loss = out_like(ANNEAL_F32, 1, &N), lse = out_like(ANNEAL_F32, 1, &N);
                    pr work = out_like(ANNEAL_F32, 2, (int64_t[]){rows, V});
                    pr dh = grads ? out_like(ANNEAL_F32, 2, (int64_t[]){N, C}) : NONE;
                    pr dw = grads ? out_like(ANNEAL_F32, 2, (int64_t[]){V, C}) : NONE;
                    snprintf(info, sizeof info, "N %lld V %lld C %lld chunk %lld %s%s", (long long)N, (long long)V,
                             (long long)C, (long long)rows, anneal_dtype_name(computes[k]), grads ? " +grads" : "");
                    anneal_matmul_desc md = {.batch = 1, .compute = computes[k]};
                    if (!have("linear_cross_entropy", info, BE[1]->linear_cross_entropy != NULL,
                              ANNEAL_OP_LINEAR_CROSS_ENTROPY, ANNEAL_F32, &md, NULL, NULL))
                        continue;
                    CALL2(ok, "linear_cross_entropy", info, linear_cross_entropy, T(loss), T(lse), T(dh), T(dw),
                          T(work), T(h), T(w), T(t), -100, T(cnt), computes[k]);
                    if (!ok) continue;
                    double tol = tol_of(computes[k]);
                    cmp("linear_ce.loss", info, loss, tol);
                    cmp("linear_ce.lse", info, lse, tol);
                    if (grads) cmp("linear_ce.dh", info, dh, tol), cmp("linear_ce.dw", info, dw, tol);
                }
    }
    anneal_scope_close(sc);
}

/* ------------------------------------- linear cross-entropy, big chunks */

/* The 16-bit path of the CUDA linear cross-entropy (w and h rounded once per call, the
 * dlogits rounded once per chunk, the chunk's logits at a 16-byte row stride) against the
 * CPU: several chunks and one chunk (work rows > N: the chunk holds every row), V and C
 * no multiple of 4 or 8 (the zero padding), V a multiple of 8, one-row chunks (the
 * unpadded stride), ignored rows, bf16 and f16, with and without the gradients; and the
 * same call twice gives the same bits (deterministic). */
TEST(linear_ce_chunks) {
    anneal_scope *sc = anneal_scope_open();
    char info[200];
    bool ok;
    /* N, V, C, work rows */
    const int64_t cfg[][4] = {{600, 50257, 72, 256}, {600, 50257, 72, 601}, {257, 4096, 64, 257},
                              {300, 2003, 100, 64},  {37, 1001, 40, 1},     {1000, 8191, 768, 333}};
    const anneal_dtype computes[] = {ANNEAL_BF16, ANNEAL_F16};
    for (int c = 0; c < 6; c++)
        for (int k = 0; k < 2; k++)
            for (int grads = 0; grads < 2; grads++) {
                int64_t N = cfg[c][0], V = cfg[c][1], C = cfg[c][2], rows = cfg[c][3];
                if (c == 5 && (k == 1 || !grads)) continue; /* the big one once */
                int32_t *tg = malloc((size_t)N * sizeof *tg);
                make_targets(tg, N, V, 4);
                int64_t nk = kept(tg, N);
                pr t = i32s(1, &N, tg);
                free(tg);
                pr h = rnd(2, (int64_t[]){N, C}, -1, 1), w = rnd(2, (int64_t[]){V, C}, -0.2f, 0.2f);
                pr cnt = i64_scalar(nk);
                pr loss = out_like(ANNEAL_F32, 1, &N), lse = out_like(ANNEAL_F32, 1, &N);
                pr work = out_like(ANNEAL_F32, 2, (int64_t[]){rows, V});
                pr dh = grads ? out_like(ANNEAL_F32, 2, (int64_t[]){N, C}) : NONE;
                pr dw = grads ? out_like(ANNEAL_F32, 2, (int64_t[]){V, C}) : NONE;
                snprintf(info, sizeof info, "N %lld V %lld C %lld work %lld %s%s", (long long)N, (long long)V,
                         (long long)C, (long long)rows, anneal_dtype_name(computes[k]), grads ? " +grads" : "");
                anneal_matmul_desc md = {.batch = 1, .compute = computes[k]};
                if (!have("linear_cross_entropy", info, BE[1]->linear_cross_entropy != NULL,
                          ANNEAL_OP_LINEAR_CROSS_ENTROPY, ANNEAL_F32, &md, NULL, NULL))
                    continue;
                CALL2(ok, "linear_cross_entropy", info, linear_cross_entropy, T(loss), T(lse), T(dh), T(dw), T(work),
                      T(h), T(w), T(t), -100, T(cnt), computes[k]);
                if (!ok) continue;
                double tol = tol_of(computes[k]);
                cmp("linear_ce_chunks.loss", info, loss, tol);
                cmp("linear_ce_chunks.lse", info, lse, tol);
                if (grads) cmp("linear_ce_chunks.dh", info, dh, tol), cmp("linear_ce_chunks.dw", info, dw, tol);
                if (!grads || c != 0) continue;
                /* again on the device: the same bits */
                pr dh2 = out_like(ANNEAL_F32, 2, (int64_t[]){N, C}), dw2 = out_like(ANNEAL_F32, 2, (int64_t[]){V, C});
                pr loss2 = out_like(ANNEAL_F32, 1, &N), lse2 = out_like(ANNEAL_F32, 1, &N);
                dv = 1;
                anneal_status s2 = BE[1]->linear_cross_entropy(BE[1]->ctx, T(loss2), T(lse2), T(dh2), T(dw2), T(work),
                                                               T(h), T(w), T(t), -100, T(cnt), computes[k]);
                if (s2 == ANNEAL_OK) s2 = BE[1]->synchronize(BE[1]->ctx);
                dv = 0;
                if (s2 != ANNEAL_OK) {
                    dv = 1;
                    call_failed("linear_cross_entropy", info, s2);
                    dv = 0;
                    continue;
                }
                /* the CPU side of the pairs holds the first GPU run's results */
                pr pairs[4][2] = {{dh, dh2}, {dw, dw2}, {loss, loss2}, {lse, lse2}};
                const char *nm[4] = {"dh", "dw", "loss", "lse"};
                for (int q = 0; q < 4; q++) {
                    int64_t n1, n2;
                    double *a = values(pairs[q][0].t[1], &n1), *b = values(pairs[q][1].t[1], &n2);
                    bool same = n1 == n2;
                    for (int64_t i = 0; same && i < n1; i++) same = memcmp(&a[i], &b[i], sizeof a[i]) == 0;
                    printf("CHECK %-24s %-52s rerun identical: %s\n", "linear_ce_chunks.repeat", nm[q],
                           same ? "PASS" : "FAIL");
                    n_checks++;
                    if (same) n_pass++;
                    else n_fail++, line_fail();
                    free(a);
                    free(b);
                }
            }
    anneal_scope_close(sc);
}

/* ------------------------------------------------------------ randomness */

TEST(dropout_and_randn) {
    anneal_scope *sc = anneal_scope_open();
    char info[200];
    bool ok;
    const int64_t ns[] = {1, 7, 1000 * 33, (1 << 20) + 3};
    const uint64_t offsets[] = {0, 17, 4, 1ull << 33};
    for (int k = 0; k < 4; k++) {
        int64_t n = ns[k];
        pr x = rnd(1, &n, -2, 2);
        float p = k == 0 ? 0.5f : 0.1f + 0.1f * (float)k;
        snprintf(info, sizeof info, "(%lld) p %.1f seed 1234 offset %llu", (long long)n, (double)p,
                 (unsigned long long)offsets[k]);
        if (have("dropout_fwd", info, BE[1]->dropout_fwd != NULL, ANNEAL_OP_DROPOUT, ANNEAL_F32, NULL, NULL, NULL)) {
            pr y = out_like(ANNEAL_F32, 1, &n), mask = out_like(ANNEAL_U8, 1, &n);
            CALL2(ok, "dropout_fwd", info, dropout_fwd, T(y), T(mask), T(x), p, 1234, offsets[k]);
            if (ok) {
                cmp("dropout_fwd.mask", info, mask, 0);
                cmp("dropout_fwd.y", info, y, 1e-6); /* x * (1 / (1 - p)) or x / (1 - p): an ulp */
            }
            if (ok && have("dropout_bwd", info, BE[1]->dropout_bwd != NULL, ANNEAL_OP_DROPOUT, ANNEAL_F32, NULL, NULL,
                           NULL)) {
                pr mc = from_host(ANNEAL_U8, 1, &n, anneal_data(mask.t[0]));
                pr dx = out_like(ANNEAL_F32, 1, &n);
                CALL2(ok, "dropout_bwd", info, dropout_bwd, T(dx), T(mc), T(x), p);
                if (ok) cmp("dropout_bwd", info, dx, 1e-6);
            }
        }
        snprintf(info, sizeof info, "(%lld) mean 0.5 std 2 seed 7 offset %llu", (long long)n,
                 (unsigned long long)offsets[k]);
        if (have("randn", info, BE[1]->randn != NULL, ANNEAL_OP_RANDN, ANNEAL_F32, NULL, NULL, NULL)) {
            pr r = out_like(ANNEAL_F32, 1, &n);
            CALL2(ok, "randn", info, randn, T(r), 0.5f, 2.0f, 7, offsets[k]);
            if (!ok) continue;
            /* the same Box-Muller of the same Philox words: equal within a few ulps (GPU
             * logf/sinf/cosf are within 2 ulps of the CPU's libm); a different stream
             * would give O(1) differences */
            cmp("randn", info, r, 1e-5);
            if (n >= 1000) {
                int64_t m;
                double *g = values(r.t[1], &m), mean = 0, var = 0;
                for (int64_t i = 0; i < m; i++) mean += g[i];
                mean /= (double)m;
                for (int64_t i = 0; i < m; i++) var += (g[i] - mean) * (g[i] - mean);
                double sd = sqrt(var / (double)m);
                bool pass = fabs(mean - 0.5) < 6 * 2 / sqrt((double)m) && fabs(sd - 2) < 0.05;
                printf("CHECK %-24s %-52s mean %.4f std %.4f (want 0.5, 2)  %s\n", "randn.distribution", info, mean, sd,
                       pass ? "PASS" : "FAIL");
                n_checks++;
                if (pass) n_pass++;
                else n_fail++, line_fail();
                free(g);
            }
        }
    }
    anneal_scope_close(sc);
}

/* -------------------------------------------------------------- optimizer */

TEST(adamw) {
    anneal_scope *sc = anneal_scope_open();
    char info[200];
    bool ok;
    const int64_t ns[3] = {1, 1000 * 33, (1 << 20) + 5};
    pr p[3], g[3], m[3], v[3];
    const double lr = 6e-4, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    const int step = 3;
    const double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
    for (int k = 0; k < 3; k++) {
        p[k] = rnd(1, &ns[k], -1, 1), g[k] = rnd(1, &ns[k], -0.1f, 0.1f), m[k] = rnd(1, &ns[k], -0.01f, 0.01f);
        v[k] = rnd(1, &ns[k], 0, 1e-4f);
    }
    /* copies of the starting state for adamw_multi (GPU only) */
    pr p2[3], m2[3], v2[3];
    for (int k = 0; k < 3; k++) {
        p2[k] = from_host(ANNEAL_F32, 1, &ns[k], anneal_data(p[k].t[0]));
        m2[k] = from_host(ANNEAL_F32, 1, &ns[k], anneal_data(m[k].t[0]));
        v2[k] = from_host(ANNEAL_F32, 1, &ns[k], anneal_data(v[k].t[0]));
    }
    for (int k = 0; k < 3; k++) {
        snprintf(info, sizeof info, "(%lld) lr 6e-4 betas 0.9/0.95 wd 0.1 step 3", (long long)ns[k]);
        if (!have("adamw", info, BE[1]->adamw != NULL, ANNEAL_OP_ADAMW, ANNEAL_F32, NULL, NULL, NULL)) continue;
        double w = k == 1 ? 0.0 : wd;
        CALL2(ok, "adamw", info, adamw, T(p[k]), T(g[k]), T(m[k]), T(v[k]), lr, b1, b2, eps, w, bc1, bc2);
        if (!ok) continue;
        cmp("adamw.p", info, p[k], TOL_F32);
        cmp("adamw.m", info, m[k], TOL_F32);
        cmp("adamw.v", info, v[k], TOL_F32);
    }
    if (!BE[1]->adamw_multi) {
        unsupported("adamw_multi", "(optional slot absent)");
    } else if (BE[1]->adamw) {
        anneal_adamw_group grp[3];
        for (int k = 0; k < 3; k++)
            grp[k] = (anneal_adamw_group){.p = anneal_data(p2[k].t[1]), .g = anneal_data(g[k].t[1]),
                                          .m = anneal_data(m2[k].t[1]), .v = anneal_data(v2[k].t[1]), .numel = ns[k],
                                          .weight_decay = k == 1 ? 0.0 : wd, .bc1 = bc1, .bc2 = bc2};
        anneal_clear_error();
        anneal_status s = BE[1]->adamw_multi(BE[1]->ctx, grp, 3, lr, b1, b2, eps);
        if (s == ANNEAL_OK) s = BE[1]->synchronize(BE[1]->ctx);
        if (s != ANNEAL_OK) {
            dv = 1;
            call_failed("adamw_multi", "3 groups", s);
            dv = 0;
        } else {
            /* bitwise against the GPU's own adamw (the contract), compared on the GPU side:
             * put the multi results in the CPU slot of a pair */
            for (int k = 0; k < 3; k++) {
                pr pairs[3][2] = {{p[k], p2[k]}, {m[k], m2[k]}, {v[k], v2[k]}};
                const char *nm[3] = {"adamw_multi.p", "adamw_multi.m", "adamw_multi.v"};
                for (int j = 0; j < 3; j++) {
                    pr x = {{pairs[j][0].t[1], pairs[j][1].t[1]}}; /* [0] adamw on cuda, [1] adamw_multi */
                    snprintf(info, sizeof info, "group %d (%lld) vs cuda adamw, bitwise", k, (long long)ns[k]);
                    cmp(nm[j], info, x, 0);
                }
            }
        }
    }
    anneal_scope_close(sc);
}

/* ------------------------------------------------------------------ main */

TEST(summary) {
    printf("SUMMARY checks %d: %d passed, %d failed (%d calls failed), %d unsupported\n", n_checks, n_pass, n_fail,
           n_callfail, n_unsupported);
    if (n_unsupported) anneal_test_fail(__FILE__, __LINE__, "%d kernels are missing (UNSUPPORTED lines)", n_unsupported);
}

static char g_why[512];
TEST(no_gpu) { SKIP("no GPU: %s", g_why); }

/* Runs the group named name unless argv names others (test_cuda_ops matmul attention). */
static int g_argc;
static char **g_argv;
static bool wanted(const char *name) {
    if (g_argc < 2) return true;
    for (int i = 1; i < g_argc; i++)
        if (!strcmp(g_argv[i], name)) return true;
    return false;
}
#define RUN_IF(name) do { if (wanted(#name)) RUN(name); } while (0)

int main(int argc, char **argv) {
    g_argc = argc, g_argv = argv;
    anneal_test_rng_state = 0x5EED;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *self = getenv("ANNEAL_CUDA_TEST_DEVICE");
    if (self && !strcmp(self, "emu")) {
        if (emu_register() != ANNEAL_OK) return 1;
        GDEV = EMU;
        printf("device under test: emu (the test's self-check: every check must pass)\n");
    } else if (anneal_cuda_device_count(g_why, sizeof g_why) <= 0) {
        RUN(no_gpu);
        return anneal_test_summary();
    }
    anneal_cuda_device_info info;
    if (anneal_cuda_device_info_get(0, &info) == ANNEAL_OK)
        printf("GPU 0: %s, sm_%d%d, %d SMs, %.1f GiB, driver %d, runtime %d\n", info.name, info.cc_major,
               info.cc_minor, info.sm_count, (double)info.total_bytes / (1 << 30), info.driver_version,
               info.runtime_version);
    BE[0] = anneal_backend_get(ANNEAL_CPU);
    BE[1] = anneal_backend_get(GDEV);
    if (!BE[0] || !BE[1]) {
        printf("no backend table: %s\n", anneal_last_error());
        return 1;
    }
    anneal_cuda_set_tf32(false);
    RUN_IF(elementwise);
    RUN_IF(matmul);
    RUN_IF(matmul_fused);
    RUN_IF(norms_and_softmax);
    RUN_IF(rope);
    RUN_IF(attention);
    RUN_IF(attention_fast);
    RUN_IF(check_index);
    RUN_IF(embedding_and_losses);
    RUN_IF(linear_ce_chunks);
    RUN_IF(dropout_and_randn);
    RUN_IF(adamw);
    RUN(summary);
    return anneal_test_summary();
}
