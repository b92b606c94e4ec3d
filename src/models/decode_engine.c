/* The decode engine: a model's decode step for n cache slots (model.h's
 * anneal_model_decode_slots) as one pass over its weights.
 *
 * Per step: the n new tokens' embeddings (plus learned positions at each slot's own
 * position), then per layer norm -> q/k/v GEMV -> RoPE, cache store and attention over
 * the slot's positions in the cache's dtype (decode_kernels.h) -> output GEMV ->
 * residual -> norm -> MLP GEMVs (GELU tanh, or SiLU(gate) * up) -> residual; final norm,
 * lm head GEMV straight into the caller's logits. Each weight matrix is read once per
 * step for all n rows; the norms and activations are the tensor path's CPU kernels.
 *
 * State kept in the cache (anneal_kv_cache_set_aux), made on the first step: the
 * workspace for `slots` rows (activations, attention scratch of max_len per row and
 * head) and the plan's block array, so a step allocates nothing. Under bf16 compute
 * (anneal_model_set_compute) the engine reads bf16 copies of the f32 weight matrices
 * (transposed to (out, in), the layout the GEMV streams fastest, in pair order),
 * made on the cache's first step and kept with it (they reflect the weights at that
 * moment); bf16 weights (a frozen model converted with anneal_params_replace) are read
 * as they are. */
#include "decode_engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A bf16 copy of one f32 weight matrix. */
typedef struct bf16_copy {
    const void *src;
    uint16_t *data;
} bf16_copy;

typedef struct engine {
    const anneal_model *model;
    int64_t slots, max_len;
    anneal_decode_plan plan;
    anneal_decode_block_plan *blocks;
    float *x, *h, *qkv, *att, *a, *f, *u, *scratch;
    int64_t *pos;
    anneal_dtype compute;
    bf16_copy *copies;
    int n_copies, cap_copies;
} engine;

static void engine_free(void *p) {
    engine *e = p;
    if (!e) return;
    for (int i = 0; i < e->n_copies; i++) free(e->copies[i].data);
    free(e->copies);
    free(e->blocks);
    free(e->x);
    free(e->h);
    free(e->qkv);
    free(e->att);
    free(e->a);
    free(e->f);
    free(e->u);
    free(e->scratch);
    free(e->pos);
    free(e);
}

/* The architecture's plan filler, or NULL. */
static bool (*plan_fn(const anneal_model *m))(anneal_model *, anneal_decode_plan *) {
    if (!strcmp(m->cfg.arch, "gpt2")) return anneal_gpt2_decode_plan;
    if (!strcmp(m->cfg.arch, "llama")) return anneal_llama_decode_plan;
    return NULL;
}

/* n floats, 64-byte aligned (NULL on failure). */
static float *fbuf(int64_t n) {
    size_t bytes = ((size_t)(n > 0 ? n : 1) * sizeof(float) + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes);
}

/* The engine of kv for m, made on first use (NULL without an error: out of memory is
 * reported by the caller's fallback path). */
static engine *engine_get(anneal_model *m, anneal_kv_cache *kv) {
    engine *e = anneal_kv_cache_aux(kv);
    if (e && e->model == m) return e;
    const anneal_model_config *c = &m->cfg;
    int64_t S = anneal_kv_cache_slots(kv), M = anneal_kv_cache_max_len(kv);
    int64_t Hq = c->n_head, Hkv = c->n_kv_head ? c->n_kv_head : c->n_head, D = c->n_embd / c->n_head;
    int64_t F = c->n_ff ? c->n_ff : 4 * (int64_t)c->n_embd, C = c->n_embd;
    int64_t W = (Hq + 2 * Hkv) * D;
    e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->model = m;
    e->slots = S;
    e->max_len = M;
    e->blocks = calloc((size_t)c->n_layer, sizeof *e->blocks);
    e->x = fbuf(S * C);
    e->h = fbuf(S * C);
    e->qkv = fbuf(S * W);
    e->att = fbuf(S * Hq * D);
    e->a = fbuf(S * C);
    e->f = fbuf(S * F);
    e->u = fbuf(S * F);
    e->scratch = fbuf(S * Hq * M);
    e->pos = calloc((size_t)S, sizeof *e->pos);
    if (!e->blocks || !e->x || !e->h || !e->qkv || !e->att || !e->a || !e->f || !e->u || !e->scratch || !e->pos) {
        engine_free(e);
        return NULL;
    }
    anneal_kv_cache_set_aux(kv, e, engine_free);
    return e;
}

/* The bf16 copy of f32 matrix w (made on first use), packed in panels of 16 output
 * columns (anneal_gemv_pack_panels_bf16, from either source layout): the panel GEMM reads
 * a thread's range as one linear stream for one row and register-blocks 6 rows x 16
 * columns for many, each output one FMA chain in k order, so a row's logits do not
 * depend on how many rows share the step; false when out of memory. */
static bool to_bf16(engine *e, anneal_gemv_weight *w) {
    if (w->dtype == ANNEAL_I8) w->qcompute = ANNEAL_BF16; /* weight-only rounds x, as the tensor path */
    if (!w->w || w->dtype != ANNEAL_F32) return true;
    for (int i = 0; i < e->n_copies; i++)
        if (e->copies[i].src == w->w) {
            w->w = e->copies[i].data;
            w->dtype = ANNEAL_BF16;
            w->bf16_panels = true;
            return true;
        }
    if (e->n_copies == e->cap_copies) {
        int cap = e->cap_copies ? 2 * e->cap_copies : 32;
        bf16_copy *nc = realloc(e->copies, (size_t)cap * sizeof *nc);
        if (!nc) return false;
        e->copies = nc;
        e->cap_copies = cap;
    }
    const size_t bytes = (size_t)anneal_gemv_panels_bf16_len(w->in, w->out) * sizeof(uint16_t);
    uint16_t *data = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!data) return false;
    anneal_gemv_pack_panels_bf16(w->w, w->out_in, w->in, w->out, data);
    e->copies[e->n_copies++] = (bf16_copy){.src = w->w, .data = data};
    w->w = data;
    w->dtype = ANNEAL_BF16;
    w->bf16_panels = true;
    return true;
}

/* Fills e->plan for this step: the architecture's plan, bf16 copies under bf16 compute.
 * False when the engine cannot run the model. */
static bool plan_step(engine *e, anneal_model *m) {
    bool (*fill)(anneal_model *, anneal_decode_plan *) = plan_fn(m);
    memset(&e->plan, 0, sizeof e->plan);
    e->plan.blocks = e->blocks;
    if (!fill || !fill(m, &e->plan) || !anneal_decode_head(m->params, &e->plan.head)) return false;
    if (m->ctx.compute == ANNEAL_F16) return false; /* f16 products: the tensor path */
    if (m->ctx.compute != ANNEAL_BF16) return true;
    anneal_decode_plan *p = &e->plan;
    bool ok = to_bf16(e, &p->head);
    for (int l = 0; l < p->n_layer && ok; l++) {
        anneal_decode_block_plan *b = &p->blocks[l];
        anneal_gemv_weight *ws[7] = {&b->q, &b->k, &b->v, &b->o, &b->fc, &b->up, &b->down};
        for (int i = 0; i < 7 && ok; i++) ok = to_bf16(e, ws[i]);
    }
    return ok;
}

/* The norm of plan p on n rows of x into y. */
static void norm(const anneal_decode_plan *p, int64_t n, const float *x, const float *w, const float *b, float *y) {
    if (p->rms)
        anneal_decode_rms_norm(n, p->C, x, w, p->eps, y);
    else
        anneal_decode_layer_norm(n, p->C, x, w, b, p->eps, y);
}

/* x[r] += a[r] over n rows of C. */
static void residual(float *x, const float *a, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] += a[i];
}

/* One GEMV of the step; an int8 product that finds no memory for its workspace ends the
 * step with an error before the cache advances (the rows written past the slots' ends
 * are overwritten by the next step). */
#define GEMV(...)                                                                                            \
    do {                                                                                                   \
        if (!anneal_gemv(__VA_ARGS__))                                                                     \
            return anneal_set_error(ANNEAL_ERR_OOM, "decode step: no memory for an int8 product's workspace"); \
    } while (0)

static _Atomic int64_t steps_run;

int64_t anneal_decode_engine_steps(void) { return steps_run; }

anneal_status anneal_decode_engine_step(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                        const int32_t *ids, int64_t n, float *out) {
    if (m->device != ANNEAL_CPU || !plan_fn(m)) return ANNEAL_ERR_UNSUPPORTED;
    engine *e = engine_get(m, kv);
    if (!e || !plan_step(e, m)) return ANNEAL_ERR_UNSUPPORTED;
    const anneal_decode_plan *p = &e->plan;
    const int64_t C = p->C, Hq = p->Hq, Hkv = p->Hkv, D = p->D, F = p->F;
    const int64_t W = (Hq + 2 * Hkv) * D;
    for (int64_t i = 0; i < n; i++) e->pos[i] = anneal_kv_cache_slot_len(kv, slots[i]);
    /* embeddings (+ learned positions) */
    for (int64_t i = 0; i < n; i++) {
        const float *t = p->tok_emb + (int64_t)ids[i] * C;
        float *x = e->x + i * C;
        if (p->pos_emb) {
            const float *q = p->pos_emb + e->pos[i] * C;
            for (int64_t c = 0; c < C; c++) x[c] = t[c] + q[c];
        } else {
            memcpy(x, t, (size_t)C * sizeof *x);
        }
    }
    for (int l = 0; l < p->n_layer; l++) {
        const anneal_decode_block_plan *b = &p->blocks[l];
        anneal_kv_cache_layer cl;
        if (anneal_kv_cache_raw(kv, l, &cl) != ANNEAL_OK) return anneal_last_status();
        norm(p, n, e->x, b->n1_w, b->n1_b, e->h);
        if (b->k.w) {
            GEMV(&b->q, e->h, C, n, e->qkv, W, ANNEAL_GEMV_NONE);
            GEMV(&b->k, e->h, C, n, e->qkv + Hq * D, W, ANNEAL_GEMV_NONE);
            GEMV(&b->v, e->h, C, n, e->qkv + (Hq + Hkv) * D, W, ANNEAL_GEMV_NONE);
        } else {
            GEMV(&b->q, e->h, C, n, e->qkv, W, ANNEAL_GEMV_NONE);
        }
        anneal_decode_attn at = {.n = n, .slots = slots, .pos = e->pos, .q = e->qkv, .k = e->qkv + Hq * D,
                                 .v = e->qkv + (Hq + Hkv) * D, .ld_qkv = W, .Hq = Hq, .Hkv = Hkv, .D = D,
                                 .rope = p->rope, .kc = cl.k, .vc = cl.v, .k_scale = cl.k_scale,
                                 .v_scale = cl.v_scale, .dtype = cl.dtype, .max_len = cl.max_len, .out = e->att,
                                 .ld_out = Hq * D, .scratch = e->scratch};
        anneal_decode_attention(&at);
        GEMV(&b->o, e->att, Hq * D, n, e->a, C, ANNEAL_GEMV_NONE);
        residual(e->x, e->a, n * C);
        norm(p, n, e->x, b->n2_w, b->n2_b, e->h);
        GEMV(&b->fc, e->h, C, n, e->f, F, ANNEAL_GEMV_NONE);
        if (b->up.w) {
            GEMV(&b->up, e->h, C, n, e->u, F, ANNEAL_GEMV_NONE);
            anneal_decode_silu_mul(n * F, e->f, e->u);
        } else {
            anneal_decode_gelu_tanh(n * F, e->f);
        }
        GEMV(&b->down, e->f, F, n, e->a, C, ANNEAL_GEMV_NONE);
        residual(e->x, e->a, n * C);
    }
    norm(p, n, e->x, p->nf_w, p->nf_b, e->h);
    GEMV(&p->head, e->h, C, n, out, p->V, ANNEAL_GEMV_NONE);
    for (int64_t i = 0; i < n; i++) anneal_kv_cache_slot_advance(kv, slots[i], 1);
    steps_run++;
    return ANNEAL_OK;
}
