/* The CPU backend table: maps the descriptors ops build (anneal_matmul_desc,
 * anneal_attention_desc) and tensor arguments onto the raw kernels of cpu_kernels.h,
 * and registers itself (anneal_cpu_backend_register, listed in
 * src/backends/registry.c). Memory is host memory, so copies to and from the host are
 * memcpy, every slot runs synchronously (synchronize has nothing to wait for and no
 * deferred error), and the device-side scalars of the loss slots (counts, upstream
 * gradients) are read directly. The CPU has no state: ctx is NULL. */
#include "anneal/decode_kernels.h"
#include "cpu_backend.h"
#include "cpu_kernels.h"
#include "fused.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define F(t) ((float *)((t) ? anneal_data(t) : NULL))

/* ------------------------------------------------------ memory, streams */

/* Host blocks are 64-byte aligned addresses inside a malloc or calloc allocation whose
 * own pointer sits just below them, so one free serves both. */
enum { HOST_PAD = 63 + sizeof(void *) };

static void *aligned_in(void *raw) {
    if (!raw) return NULL;
    uintptr_t a = ((uintptr_t)raw + sizeof(void *) + 63) & ~(uintptr_t)63;
    ((void **)a)[-1] = raw;
    return (void *)a;
}

static void *cpu_alloc(void *ctx, size_t n) { return aligned_in(malloc((n ? n : 1) + HOST_PAD)); }

/* calloc: glibc hands a large request fresh pages from the system without writing them
 * (they are zero already), so they stay untouched, and not resident, until used. */
static void *cpu_alloc_zeroed(void *ctx, size_t n) { return aligned_in(calloc(1, (n ? n : 1) + HOST_PAD)); }

static void cpu_free(void *ctx, void *p) {
    if (p) free(((void **)p)[-1]);
}

static anneal_status cpu_memcpy(void *ctx, void *dst, const void *src, size_t n) {
    if (n) memcpy(dst, src, n);
    return ANNEAL_OK;
}

static anneal_status cpu_synchronize(void *ctx) { return ANNEAL_OK; }

/* The value of a device scalar (0-dim) of the CPU: its first element. */
static double scalar_f32(const anneal_tensor *s) { return s ? (double)*(const float *)anneal_data(s) : 1.0; }
static int64_t scalar_i64(const anneal_tensor *c) { return *(const int64_t *)anneal_data(c); }

/* What the CPU kernels cannot do: storage other than f32 outside copies and fills, a
 * matmul epilogue over a batch (the GEMM's epilogue is per product), a compute
 * precision other than f32/bf16/f16, a key/value head count that does not divide the
 * query heads, an unknown rotary scaling. */
static bool cpu_supports_op(void *ctx, const anneal_op_query *q) {
    switch (q->kind) {
    case ANNEAL_OP_COPY:
    case ANNEAL_OP_FILL: return true;
    case ANNEAL_OP_CHECK_INDEX: return q->dtype == ANNEAL_I32;
    default: break;
    }
    if (q->dtype != ANNEAL_F32) return false;
    if (q->kind == ANNEAL_OP_MATMUL && q->matmul) {
        const anneal_matmul_desc *d = q->matmul;
        if (d->compute != ANNEAL_F32 && d->compute != ANNEAL_BF16 && d->compute != ANNEAL_F16) return false;
        if ((unsigned)d->epilogue >= ANNEAL_EPILOGUE_COUNT) return false;
        if (d->epilogue != ANNEAL_EPILOGUE_NONE && d->batch > 1) return false;
    }
    if (q->kind == ANNEAL_OP_ATTENTION && q->attention) {
        const anneal_attention_desc *d = q->attention;
        if (d->Hkv <= 0 || d->Hq % d->Hkv) return false;
    }
    if (q->rope && (unsigned)q->rope->scaling > ANNEAL_ROPE_SCALING_LLAMA3) return false;
    return true;
}

/* -------------------------------------------------------- elementwise */

static anneal_status cpu_copy(void *ctx, anneal_tensor *dst, const anneal_tensor *src) {
    return anneal_cpu_copy(dst, src);
}

static anneal_status cpu_fill(void *ctx, anneal_tensor *dst, double value) { return anneal_cpu_fill(dst, value); }

static anneal_status cpu_binary(void *ctx, anneal_binary_op op, anneal_tensor *out, const anneal_tensor *a,
                                const anneal_tensor *b) {
    return anneal_cpu_binary(op, out, a, b);
}

static anneal_status cpu_unary(void *ctx, anneal_unary_op op, anneal_tensor *out, const anneal_tensor *x,
                               float alpha) {
    return anneal_cpu_unary(op, out, x, alpha);
}

static anneal_status cpu_unary_bwd(void *ctx, anneal_unary_op op, anneal_tensor *dx, const anneal_tensor *x,
                                   const anneal_tensor *dy, float alpha) {
    return anneal_cpu_unary_bwd(op, dx, x, dy, alpha);
}

/* x *= (float)(s * f) (see the slot): the SCALE kernel, an f32 multiply per element. */
static anneal_status cpu_scale_by(void *ctx, anneal_tensor *x, const anneal_tensor *s,
                                  const anneal_tensor *count, double factor) {
    int64_t n = count ? scalar_i64(count) : 0;
    double f = n ? factor / (double)n : factor;
    float c = (float)(scalar_f32(s) * f);
    if (c == 1.0f) return ANNEAL_OK;
    return anneal_cpu_unary(ANNEAL_UNARY_SCALE, x, x, c);
}

static anneal_status cpu_reduce_sum(void *ctx, anneal_tensor *out, const anneal_tensor *x) {
    return anneal_cpu_reduce_sum(out, x);
}

static anneal_status cpu_sum_squares(void *ctx, anneal_tensor *out, int64_t index, const anneal_tensor *x) {
    ((double *)anneal_data(out))[index] = anneal_cpu_sum_squares(anneal_numel(x), F(x));
    return ANNEAL_OK;
}

/* ------------------------------------------------------------- matmul */

/* The descriptor's epilogue as the GEMM kernel's (batch 1). */
static anneal_status gemm_epilogue(const anneal_matmul_desc *d, anneal_gemm_epilogue *ep) {
    *ep = (anneal_gemm_epilogue){0};
    switch (d->epilogue) {
    case ANNEAL_EPILOGUE_NONE: return ANNEAL_OK;
    case ANNEAL_EPILOGUE_BIAS:
        if (!d->bias) break;
        ep->bias = F(d->bias);
        return ANNEAL_OK;
    case ANNEAL_EPILOGUE_BIAS_GELU:
        ep->bias = F(d->bias);
        ep->gelu_tanh = true;
        ep->pre = F(d->aux_out);
        return ANNEAL_OK;
    case ANNEAL_EPILOGUE_BSUM:
        if (!d->bsum) break;
        ep->b_colsum = F(d->bsum);
        return ANNEAL_OK;
    case ANNEAL_EPILOGUE_SILU_MUL:
        if (!d->aux_in) break;
        ep->bias = F(d->bias);
        ep->silu_mul = F(d->aux_in);
        ep->pre = F(d->aux_out);
        return ANNEAL_OK;
    default: break;
    }
    return anneal_set_error(ANNEAL_ERR_ARG, "cpu matmul: epilogue %d without its operand", (int)d->epilogue);
}

/* One GEMM (batch 1, with its epilogue) or a batch of them (no epilogue). */
static anneal_status cpu_matmul(void *ctx, const anneal_matmul_desc *d, anneal_tensor *c, const anneal_tensor *a,
                                const anneal_tensor *b) {
    if (d->batch == 1) {
        anneal_gemm_epilogue ep;
        anneal_status s = gemm_epilogue(d, &ep);
        if (s != ANNEAL_OK) return s;
        anneal_cpu_gemm((int)d->compute, d->trans_a, d->trans_b, d->M, d->N, d->K, d->alpha, F(a), d->lda, F(b),
                        d->ldb, d->beta, F(c), d->ldc, d->epilogue == ANNEAL_EPILOGUE_NONE ? NULL : &ep);
        return ANNEAL_OK;
    }
    if (d->epilogue != ANNEAL_EPILOGUE_NONE)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cpu matmul: epilogues apply to a single product, not a batch of %lld",
                                (long long)d->batch);
    anneal_cpu_gemm_batched((int)d->compute, d->batch, d->trans_a, d->trans_b, d->M, d->N, d->K, d->alpha, F(a), d->lda,
                            d->stride_a, F(b), d->ldb, d->stride_b, d->beta, F(c), d->ldc, d->stride_c);
    return ANNEAL_OK;
}

/* -------------------------------------------------------------- int8 */

static anneal_status cpu_quantize_s8(void *ctx, anneal_tensor *q, anneal_tensor *scales, const anneal_tensor *x,
                                     int64_t group) {
    int64_t cols = x->ndim ? x->shape[x->ndim - 1] : 1, rows = cols ? anneal_numel(x) / cols : 0;
    anneal_cpu_quantize_s8(rows, cols, group, F(x), (int8_t *)anneal_data(q), F(scales));
    return ANNEAL_OK;
}

static anneal_status cpu_qmatmul(void *ctx, const anneal_qmatmul_desc *d, anneal_tensor *y, const anneal_tensor *x,
                                 const anneal_tensor *wq, const anneal_tensor *wscale, const anneal_tensor *bias) {
    static const int modes[] = {[ANNEAL_QUANT_WEIGHT_ONLY] = ANNEAL_CPU_QUANT_WEIGHT_ONLY,
                                [ANNEAL_QUANT_DYNAMIC] = ANNEAL_CPU_QUANT_DYNAMIC,
                                [ANNEAL_QUANT_STATIC] = ANNEAL_CPU_QUANT_STATIC};
    if (d->mode < ANNEAL_QUANT_WEIGHT_ONLY || d->mode > ANNEAL_QUANT_STATIC)
        return anneal_set_error(ANNEAL_ERR_ARG, "cpu qmatmul: unknown quantization mode %d", (int)d->mode);
    anneal_cpu_qmatmul_args a = {.mode = modes[d->mode], .compute = (int)d->compute, .M = x->shape[0],
                                 .N = wq->shape[0], .K = wq->shape[1], .group = d->group, .x = F(x),
                                 .w = (const int8_t *)anneal_data(wq), .wscale = F(wscale), .bias = F(bias),
                                 .act_scale = d->act_scale, .y = F(y)};
    if (anneal_cpu_qmatmul(&a) != 0)
        return anneal_set_error(ANNEAL_ERR_OOM, "cpu qmatmul: no memory for the workspace of a (%lld x %lld x %lld) product",
                                (long long)a.M, (long long)a.N, (long long)a.K);
    return ANNEAL_OK;
}

static anneal_status cpu_panels_matmul(void *ctx, anneal_tensor *y, const anneal_tensor *x,
                                       const anneal_tensor *panels, const anneal_tensor *bias) {
    const int64_t M = x->shape[0], K = x->shape[1], N = y->shape[1];
    const anneal_gemv_weight w = {.w = anneal_data(panels), .dtype = ANNEAL_BF16, .in = K, .out = N,
                                  .bias = bias ? F(bias) : NULL, .bf16_panels = true};
    /* rows in pieces, so each pass over the weights serves many rows from cache */
    enum { ROWS = 128 };
    for (int64_t r = 0; r < M; r += ROWS)
        anneal_gemv(&w, F(x) + r * K, K, M - r < ROWS ? M - r : ROWS, F(y) + r * N, N, ANNEAL_GEMV_NONE);
    return ANNEAL_OK;
}

/* ----------------------------------------------------------- row ops */

/* Rows of the last dim: (N, C) view of a contiguous tensor. */
static void rows_cols(const anneal_tensor *x, int64_t *N, int64_t *C) {
    *C = x->ndim ? x->shape[x->ndim - 1] : 1;
    *N = *C ? anneal_numel(x) / *C : 0;
}

static anneal_status cpu_layer_norm_fwd(void *ctx, anneal_tensor *y, anneal_tensor *mean, anneal_tensor *rstd,
                                        const anneal_tensor *x, const anneal_tensor *w, const anneal_tensor *b,
                                        float eps) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_layer_norm_fwd(N, C, F(x), F(w), F(b), eps, F(y), F(mean), F(rstd));
    return ANNEAL_OK;
}

static anneal_status cpu_layer_norm_bwd(void *ctx, anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                        const anneal_tensor *x, const anneal_tensor *w, const anneal_tensor *mean,
                                        const anneal_tensor *rstd, const anneal_tensor *dy) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_layer_norm_bwd(N, C, F(x), F(w), F(mean), F(rstd), F(dy), F(dx), F(dw), F(db));
    return ANNEAL_OK;
}

static anneal_status cpu_add_layer_norm_fwd(void *ctx, anneal_tensor *s, anneal_tensor *y, anneal_tensor *mean,
                                            anneal_tensor *rstd, const anneal_tensor *x, const anneal_tensor *r,
                                            const anneal_tensor *w, const anneal_tensor *b, float eps) {
    return anneal_cpu_add_layer_norm_fwd(s, y, mean, rstd, x, r, w, b, eps);
}

static anneal_status cpu_add_layer_norm_bwd(void *ctx, anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                            const anneal_tensor *s, const anneal_tensor *w,
                                            const anneal_tensor *mean, const anneal_tensor *rstd,
                                            const anneal_tensor *dy, const anneal_tensor *ds) {
    return anneal_cpu_add_layer_norm_bwd(dx, dw, db, s, w, mean, rstd, dy, ds);
}

static anneal_status cpu_rms_norm_fwd(void *ctx, anneal_tensor *y, anneal_tensor *rstd, const anneal_tensor *x,
                                      const anneal_tensor *w, float eps) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_rms_norm_fwd(N, C, F(x), F(w), eps, F(y), F(rstd));
    return ANNEAL_OK;
}

static anneal_status cpu_rms_norm_bwd(void *ctx, anneal_tensor *dx, anneal_tensor *dw, const anneal_tensor *x,
                                      const anneal_tensor *w, const anneal_tensor *rstd, const anneal_tensor *dy) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_rms_norm_bwd(N, C, F(x), F(w), F(rstd), F(dy), F(dx), F(dw));
    return ANNEAL_OK;
}

static anneal_status cpu_softmax_fwd(void *ctx, anneal_tensor *y, const anneal_tensor *x, bool log) {
    int64_t N, C;
    rows_cols(x, &N, &C);
    anneal_cpu_softmax_fwd(N, C, F(x), F(y), log);
    return ANNEAL_OK;
}

static anneal_status cpu_softmax_bwd(void *ctx, anneal_tensor *dx, const anneal_tensor *y, const anneal_tensor *dy,
                                     bool log) {
    int64_t N, C;
    rows_cols(y, &N, &C);
    anneal_cpu_softmax_bwd(N, C, F(y), F(dy), F(dx), log);
    return ANNEAL_OK;
}

/* ---------------------------------------------------------- attention */

/* The kernel's descriptor from the op's (the same strides and head counts). */
static anneal_status attn_desc(anneal_cpu_attn_desc *c, const anneal_attention_desc *d) {
    if (d->Hkv <= 0 || d->Hq % d->Hkv)
        return anneal_set_error(ANNEAL_ERR_ARG, "cpu attention: %lld query heads over %lld key/value heads",
                                (long long)d->Hq, (long long)d->Hkv);
    *c = (anneal_cpu_attn_desc){
        .B = d->B, .H = d->Hq, .Hkv = d->Hkv, .Tq = d->Tq, .Tk = d->Tk, .D = d->D,
        .q_sb = d->q_sb, .q_sh = d->q_sh, .q_st = d->q_st,
        .k_sb = d->k_sb, .k_sh = d->k_sh, .k_st = d->k_st,
        .v_sb = d->v_sb, .v_sh = d->v_sh, .v_st = d->v_st,
        .o_sb = d->o_sb, .o_sh = d->o_sh, .o_st = d->o_st,
        .scale = d->scale, .causal = d->causal};
    return ANNEAL_OK;
}

static anneal_status cpu_attention_fwd(void *ctx, const anneal_attention_desc *d, anneal_tensor *o,
                                       anneal_tensor *lse, const anneal_tensor *q, const anneal_tensor *k,
                                       const anneal_tensor *v) {
    anneal_cpu_attn_desc c;
    anneal_status s = attn_desc(&c, d);
    if (s != ANNEAL_OK) return s;
    anneal_cpu_attention_fwd(&c, F(q), F(k), F(v), F(o), F(lse), (int)d->compute);
    return ANNEAL_OK;
}

static anneal_status cpu_attention_bwd(void *ctx, const anneal_attention_desc *d, anneal_tensor *dq,
                                       anneal_tensor *dk, anneal_tensor *dv, const anneal_tensor *q,
                                       const anneal_tensor *k, const anneal_tensor *v, const anneal_tensor *o,
                                       const anneal_tensor *dout, const anneal_tensor *lse) {
    anneal_cpu_attn_desc c;
    anneal_status s = attn_desc(&c, d);
    if (s != ANNEAL_OK) return s;
    anneal_cpu_attention_bwd(&c, F(q), F(k), F(v), F(o), F(dout), F(lse), F(dq), F(dk), F(dv), (int)d->compute);
    return ANNEAL_OK;
}

/* x (B, H, T, D; unit last stride) rotated in place: the kernel's descriptor from
 * x's shape and strides and the op's rotary settings. */
static anneal_status cpu_rope(void *ctx, const anneal_rope_desc *r, anneal_tensor *x, int64_t pos0, bool inverse) {
    static const int scaling[] = {ANNEAL_CPU_ROPE_NONE, ANNEAL_CPU_ROPE_LINEAR, ANNEAL_CPU_ROPE_LLAMA3};
    if ((unsigned)r->scaling > ANNEAL_ROPE_SCALING_LLAMA3 || x->ndim != 4 || (x->shape[3] > 1 && x->strides[3] != 1))
        return anneal_set_error(ANNEAL_ERR_ARG, "cpu rope: needs a (B, H, T, D) view with a unit last stride and a "
                                "known scaling");
    anneal_cpu_rope_desc d = {.B = x->shape[0], .H = x->shape[1], .T = x->shape[2], .D = x->shape[3],
                              .sb = x->strides[0], .sh = x->strides[1], .st = x->strides[2], .theta = r->theta,
                              .scaling = scaling[r->scaling], .factor = r->factor,
                              .low_freq_factor = r->low_freq_factor, .high_freq_factor = r->high_freq_factor,
                              .original_max_pos = r->original_max_pos};
    anneal_cpu_rope(&d, F(x), pos0, inverse);
    return ANNEAL_OK;
}

/* ------------------------------------------------ embedding and losses */

/* "[i, j, k]": the multi-index of row-major position pos in t's shape. */
static const char *index_str(const anneal_tensor *t, int64_t pos, char *buf, size_t n) {
    int64_t idx[ANNEAL_MAX_DIMS];
    for (int d = t->ndim - 1; d >= 0; d--) {
        idx[d] = t->shape[d] ? pos % t->shape[d] : 0;
        pos = t->shape[d] ? pos / t->shape[d] : 0;
    }
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < t->ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", d ? ", " : "", (long long)idx[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

/* Validates at once (see the slot for the message); count gets the kept elements. */
static anneal_status cpu_check_index(void *ctx, const char *op, const char *what, const anneal_tensor *ids,
                                     int64_t n, bool has_ignore, int32_t ignore_index, anneal_tensor *count) {
    const int32_t *t = anneal_data(ids);
    int64_t len = anneal_numel(ids), kept = 0;
    for (int64_t i = 0; i < len; i++) {
        if (has_ignore && t[i] == ignore_index) continue;
        if (t[i] < 0 || t[i] >= n) {
            char pos[160], tail[64] = "";
            if (has_ignore) snprintf(tail, sizeof tail, " and is not ignore_index (%d)", (int)ignore_index);
            return anneal_set_error(ANNEAL_ERR_ARG,
                                    "%s: %s %d at position %s (flat index %lld) is outside [0, V) with V = %lld%s", op,
                                    what, (int)t[i], index_str(ids, i, pos, sizeof pos), (long long)i, (long long)n,
                                    tail);
        }
        kept++;
    }
    if (count) *(int64_t *)anneal_data(count) = kept;
    return ANNEAL_OK;
}

static anneal_status cpu_embedding_fwd(void *ctx, anneal_tensor *y, const anneal_tensor *ids,
                                       const anneal_tensor *w) {
    anneal_cpu_embedding_fwd(anneal_numel(ids), w->shape[1], anneal_data(ids), F(w), F(y));
    return ANNEAL_OK;
}

static anneal_status cpu_embedding_bwd(void *ctx, anneal_tensor *dw, const anneal_tensor *ids,
                                       const anneal_tensor *dy) {
    anneal_cpu_embedding_bwd(anneal_numel(ids), dw->shape[1], dw->shape[0], anneal_data(ids), F(dy), F(dw));
    return ANNEAL_OK;
}

static anneal_status cpu_cross_entropy_fwd(void *ctx, anneal_tensor *loss, anneal_tensor *lse,
                                           const anneal_tensor *logits, const anneal_tensor *targets,
                                           int32_t ignore_index) {
    int64_t N, V;
    rows_cols(logits, &N, &V);
    anneal_cpu_cross_entropy_fwd(N, V, F(logits), anneal_data(targets), ignore_index, F(loss), F(lse));
    return ANNEAL_OK;
}

static anneal_status cpu_cross_entropy_bwd(void *ctx, anneal_tensor *dlogits, const anneal_tensor *logits,
                                           const anneal_tensor *targets, const anneal_tensor *lse,
                                           int32_t ignore_index, const anneal_tensor *s,
                                           const anneal_tensor *count) {
    int64_t N, V, n = scalar_i64(count);
    rows_cols(logits, &N, &V);
    float scale = n ? (float)(scalar_f32(s) / (double)n) : 0.0f;
    anneal_cpu_cross_entropy_bwd(N, V, F(logits), anneal_data(targets), ignore_index, F(lse), scale, F(dlogits));
    return ANNEAL_OK;
}

/* The mean over kept rows, summed in double in row order. */
static anneal_status cpu_loss_mean(void *ctx, anneal_tensor *out, const anneal_tensor *rows,
                                   const anneal_tensor *targets, int32_t ignore_index, const anneal_tensor *count) {
    const float *l = anneal_data(rows);
    const int32_t *t = anneal_data(targets);
    int64_t N = anneal_numel(rows), n = scalar_i64(count);
    double sum = 0.0;
    for (int64_t i = 0; i < N; i++)
        if (t[i] != ignore_index) sum += (double)l[i];
    *(float *)anneal_data(out) = (float)(n ? sum / (double)n : 0.0);
    return ANNEAL_OK;
}

/* g = 1/count, or 2^15 at f16 (see the slot). */
static anneal_status cpu_linear_cross_entropy(void *ctx, anneal_tensor *loss, anneal_tensor *lse, anneal_tensor *dh,
                                              anneal_tensor *dw, anneal_tensor *work, const anneal_tensor *h,
                                              const anneal_tensor *w, const anneal_tensor *targets,
                                              int32_t ignore_index, const anneal_tensor *count,
                                              anneal_dtype compute) {
    int64_t n = count ? scalar_i64(count) : 0;
    float g = !n ? 0.0f : compute == ANNEAL_F16 ? 32768.0f : (float)(1.0 / (double)n);
    return anneal_cpu_linear_cross_entropy(loss, lse, dh, dw, work, h, w, targets, ignore_index, g, compute);
}

/* ---------------------------------------------- randomness, optimizer */

static anneal_status cpu_dropout_fwd(void *ctx, anneal_tensor *y, anneal_tensor *mask, const anneal_tensor *x,
                                     float p, uint64_t seed, uint64_t offset) {
    return anneal_cpu_dropout_fwd(y, mask, x, p, seed, offset);
}

static anneal_status cpu_dropout_bwd(void *ctx, anneal_tensor *dx, const anneal_tensor *mask,
                                     const anneal_tensor *dy, float p) {
    return anneal_cpu_dropout_bwd(dx, mask, dy, p);
}

static anneal_status cpu_randn(void *ctx, anneal_tensor *x, float mean, float std, uint64_t seed,
                               uint64_t offset) {
    return anneal_cpu_randn(x, mean, std, seed, offset);
}

static anneal_status cpu_adamw(void *ctx, anneal_tensor *p, const anneal_tensor *g, anneal_tensor *m,
                               anneal_tensor *v, double lr, double beta1, double beta2, double eps,
                               double weight_decay, double bc1, double bc2) {
    anneal_cpu_adamw(anneal_numel(p), F(p), F(g), F(m), F(v), lr, beta1, beta2, eps, weight_decay, bc1, bc2);
    return ANNEAL_OK;
}

static anneal_status cpu_adamw_multi(void *ctx, const anneal_adamw_group *groups, int n, double lr, double beta1,
                                     double beta2, double eps) {
    anneal_cpu_adamw_multi(groups, n, lr, beta1, beta2, eps);
    return ANNEAL_OK;
}

#undef F

static const anneal_backend k_cpu_backend = {
    .version = ANNEAL_BACKEND_VERSION,
    .name = "cpu",
    .device = ANNEAL_CPU,
    .ctx = NULL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_to_host = cpu_memcpy,
    .copy_from_host = cpu_memcpy,
    .synchronize = cpu_synchronize,
    .supports_op = cpu_supports_op,
    /* one implicit stream: stream_* and event_* stay NULL */
    .copy = cpu_copy,
    .fill = cpu_fill,
    .binary = cpu_binary,
    .unary = cpu_unary,
    .unary_bwd = cpu_unary_bwd,
    .scale_by = cpu_scale_by,
    .reduce_sum = cpu_reduce_sum,
    .sum_squares = cpu_sum_squares,
    .matmul = cpu_matmul,
    .layer_norm_fwd = cpu_layer_norm_fwd,
    .layer_norm_bwd = cpu_layer_norm_bwd,
    .add_layer_norm_fwd = cpu_add_layer_norm_fwd,
    .add_layer_norm_bwd = cpu_add_layer_norm_bwd,
    .rms_norm_fwd = cpu_rms_norm_fwd,
    .rms_norm_bwd = cpu_rms_norm_bwd,
    .softmax_fwd = cpu_softmax_fwd,
    .softmax_bwd = cpu_softmax_bwd,
    .attention_fwd = cpu_attention_fwd,
    .attention_bwd = cpu_attention_bwd,
    .rope = cpu_rope,
    .check_index = cpu_check_index,
    .embedding_fwd = cpu_embedding_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .cross_entropy_fwd = cpu_cross_entropy_fwd,
    .cross_entropy_bwd = cpu_cross_entropy_bwd,
    .loss_mean = cpu_loss_mean,
    .linear_cross_entropy = cpu_linear_cross_entropy,
    .dropout_fwd = cpu_dropout_fwd,
    .dropout_bwd = cpu_dropout_bwd,
    .randn = cpu_randn,
    .adamw = cpu_adamw,
    .adamw_multi = cpu_adamw_multi,
    .quantize_s8 = cpu_quantize_s8,
    .qmatmul = cpu_qmatmul,
    .alloc_zeroed = cpu_alloc_zeroed,
    .panels_matmul = cpu_panels_matmul,
};

anneal_status anneal_cpu_backend_register(void) { return anneal_backend_register(&k_cpu_backend); }
