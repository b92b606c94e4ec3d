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
 * A prefill (anneal_decode_engine_prefill) runs the same pass on a prompt's rows, all of
 * one slot at consecutive positions, in chunks of up to 256 rows: the chunk's keys and
 * values are stored first, then it attends causally (to the slot's earlier positions
 * and to the rows before it) through the chunk path of anneal_decode_attention, and
 * only the prompt's last row goes through the lm head.
 *
 * State kept in the cache (anneal_kv_cache_set_aux), made on the first step: the
 * workspace for `slots` rows (activations, attention scratch of max_len per row and
 * head) and the plan's block array, so a step allocates nothing. Under bf16 compute
 * (anneal_model_set_compute) the engine reads bf16 copies of the f32 weight matrices
 * (packed in panels of 16 output columns: anneal_gemv_pack_panels_bf16),
 * made on the cache's first step and kept with it (they reflect the weights at that
 * moment); bf16 weights (a frozen model converted with anneal_params_replace) are read
 * as they are. Dynamic and static int8 weights get int8 copies packed in panels of 16
 * rows (anneal_gemv_pack_qpanels) once a call has 2 or more rows, where the CPU runs
 * that kernel: serving steps and prompt chunks read them, same bits as the row layout. */
#include "decode_engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A packed copy of one weight matrix: bf16 panels of an f32 one, or int8 panels of an
 * int8 one. */
typedef struct weight_copy {
    const void *src;
    void *data;
} weight_copy;

typedef struct engine {
    const anneal_model *model;
    int64_t slots, max_len;
    int64_t rows;      /* rows the workspace holds: the slots, or a prefill chunk if more */
    int64_t plan_C, plan_W, plan_A, plan_F; /* row widths: model, q|k|v, attention, MLP */
    int64_t *row_slot; /* (rows) a prefill chunk's slot per row */
    int64_t *row_last; /* (slots) an extend's last row of each entry */
    float *kvs;        /* a prefill's attention scratch (anneal_decode_attn.kv_scratch), made on first use */
    int64_t kvs_floats;
    anneal_decode_plan plan;
    anneal_decode_block_plan *blocks;
    float *x, *h, *qkv, *att, *a, *f, *u, *scratch;
    int64_t *pos;
    anneal_dtype compute;
    weight_copy *copies;
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
    free(e->row_slot);
    free(e->row_last);
    free(e->kvs);
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
/* The activation buffers of e for R rows (the old ones freed; their contents are not
 * kept); false when out of memory (e->rows then 0: the caller gives up the engine). */
static bool workspace(engine *e, int64_t R) {
    const int64_t C = e->plan_C, W = e->plan_W, A = e->plan_A, F = e->plan_F;
    float **bufs[7] = {&e->x, &e->h, &e->qkv, &e->att, &e->a, &e->f, &e->u};
    const int64_t widths[7] = {C, C, W, A, C, F, F};
    for (int i = 0; i < 7; i++) {
        free(*bufs[i]);
        *bufs[i] = fbuf(R * widths[i]);
    }
    free(e->pos);
    free(e->row_slot);
    e->pos = calloc((size_t)R, sizeof *e->pos);
    e->row_slot = calloc((size_t)R, sizeof *e->row_slot);
    bool ok = e->pos && e->row_slot;
    for (int i = 0; i < 7; i++) ok = ok && *bufs[i];
    e->rows = ok ? R : 0;
    return ok;
}

/* The engine of kv for m, made on first use with a workspace for the cache's slots (NULL
 * without an error: out of memory is reported by the caller's fallback path). */
static engine *engine_get(anneal_model *m, anneal_kv_cache *kv) {
    engine *e = anneal_kv_cache_aux(kv);
    if (e && e->model == m) return e;
    const anneal_model_config *c = &m->cfg;
    int64_t S = anneal_kv_cache_slots(kv), M = anneal_kv_cache_max_len(kv);
    int64_t Hq = c->n_head, Hkv = c->n_kv_head ? c->n_kv_head : c->n_head, D = c->n_embd / c->n_head;
    e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->model = m;
    e->slots = S;
    e->max_len = M;
    e->plan_C = c->n_embd;
    e->plan_W = (Hq + 2 * Hkv) * D;
    e->plan_A = Hq * D;
    e->plan_F = c->n_ff ? c->n_ff : 4 * (int64_t)c->n_embd;
    e->blocks = calloc((size_t)c->n_layer, sizeof *e->blocks);
    e->scratch = fbuf(S * Hq * M); /* rows one at a time: the steps' slots (a prefill's chunk attends as a run) */
    e->row_last = calloc((size_t)S, sizeof *e->row_last);
    if (!e->blocks || !e->scratch || !e->row_last || !workspace(e, S)) {
        engine_free(e);
        return NULL;
    }
    anneal_kv_cache_set_aux(kv, e, engine_free);
    return e;
}

/* Readies e for a prefill: the workspace grown to a chunk of rows (up to PREFILL_ROWS,
 * fewer where the chunk's activations would pass PREFILL_BYTES; ANNEAL_PREFILL_ROWS
 * overrides, for tests and tuning) plus one row per slot (a mixed pass) and the chunk attention's scratch
 * (anneal_decode_attn.kv_scratch: the keys and values widened, max_len positions). Done
 * once per cache; false when out of memory. */
static bool prefill_ready(engine *e) {
    if (e->kvs) return true;
    enum { PREFILL_ROWS = 256 };
    const int64_t PREFILL_BYTES = (int64_t)64 << 20;
    const int64_t row_bytes = (int64_t)sizeof(float) * (3 * e->plan_C + e->plan_W + e->plan_A + 2 * e->plan_F);
    int64_t R = PREFILL_BYTES / row_bytes;
    R = R > PREFILL_ROWS ? PREFILL_ROWS : R < 1 ? 1 : R;
    const char *env = getenv("ANNEAL_PREFILL_ROWS");
    if (env && atoll(env) > 0) R = atoll(env);
    R += e->slots; /* a mixed pass: a chunk of prompt rows beside one row per slot */
    if (R != e->rows && !workspace(e, R)) return false;
    const anneal_decode_plan *p = &e->plan;
    int64_t nf = p->Hq * e->rows + 2 * p->Hkv * e->max_len * p->D;
    e->kvs = fbuf(nf);
    e->kvs_floats = e->kvs ? nf : 0;
    return e->kvs != NULL;
}

static _Atomic int64_t qpanel_copies;

int64_t anneal_decode_engine_qpanel_copies(void) { return qpanel_copies; }

/* The copy of src in e, or NULL. */
static void *copy_of(const engine *e, const void *src) {
    for (int i = 0; i < e->n_copies; i++)
        if (e->copies[i].src == src) return e->copies[i].data;
    return NULL;
}

/* Keeps data (bytes allocated by the caller) as the copy of src; false (data freed) when
 * out of memory. */
static bool keep_copy(engine *e, const void *src, void *data) {
    if (e->n_copies == e->cap_copies) {
        int cap = e->cap_copies ? 2 * e->cap_copies : 32;
        weight_copy *nc = realloc(e->copies, (size_t)cap * sizeof *nc);
        if (!nc) {
            free(data);
            return false;
        }
        e->copies = nc;
        e->cap_copies = cap;
    }
    e->copies[e->n_copies++] = (weight_copy){.src = src, .data = data};
    return true;
}

/* The bf16 copy of f32 matrix w (made on first use), packed in panels of 16 output
 * columns (anneal_gemv_pack_panels_bf16, from either source layout): the panel GEMM reads
 * a thread's range as one linear stream for one row and register-blocks 6 rows x 16
 * columns for many, each output one FMA chain in k order, so a row's logits do not
 * depend on how many rows share the step; false when out of memory. */
static bool to_bf16(engine *e, anneal_gemv_weight *w) {
    if (w->dtype == ANNEAL_I8) w->qcompute = ANNEAL_BF16; /* weight-only rounds x, as the tensor path */
    if (!w->w || w->dtype != ANNEAL_F32) return true;
    void *data = copy_of(e, w->w);
    if (!data) {
        const size_t bytes = (size_t)anneal_gemv_panels_bf16_len(w->in, w->out) * sizeof(uint16_t);
        if (!(data = aligned_alloc(64, (bytes + 63) & ~(size_t)63))) return false;
        anneal_gemv_pack_panels_bf16(w->w, w->out_in, w->in, w->out, data);
        if (!keep_copy(e, w->w, data)) return false;
    }
    w->w = data;
    w->dtype = ANNEAL_BF16;
    w->bf16_panels = true;
    return true;
}

/* For a dynamic or static int8 weight where the int8 panel kernel runs
 * (anneal_gemv_qpanels_useful): its copy in panels of 16 rows (made on first use), which
 * a product of 2 or more rows reads at two to three times the row kernels' speed with
 * the same bits. Made only once a call has 2 or more rows (a batch-1 decoder never pays
 * its memory); false when out of memory. */
static bool to_qpanels(engine *e, anneal_gemv_weight *w) {
    if (!w->w || w->dtype != ANNEAL_I8 || (w->qmode != ANNEAL_QUANT_DYNAMIC && w->qmode != ANNEAL_QUANT_STATIC) ||
        !anneal_gemv_qpanels_useful())
        return true;
    if ((w->qpanels = copy_of(e, w->w))) return true;
    const size_t bytes = (size_t)anneal_gemv_qpanels_len(w->in, w->out);
    int8_t *data = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!data) return false;
    anneal_gemv_pack_qpanels(w->w, w->in, w->out, data);
    if (!keep_copy(e, w->w, data)) return false;
    qpanel_copies++;
    w->qpanels = data;
    return true;
}

/* Fills e->plan for a call of `rows` rows: the architecture's plan, bf16 copies under
 * bf16 compute, int8 panel copies from 2 rows. False when the engine cannot run the
 * model. */
static bool plan_step(engine *e, anneal_model *m, int64_t rows) {
    bool (*fill)(anneal_model *, anneal_decode_plan *) = plan_fn(m);
    memset(&e->plan, 0, sizeof e->plan);
    e->plan.blocks = e->blocks;
    if (!fill || !fill(m, &e->plan) || !anneal_decode_head(m->params, &e->plan.head)) return false;
    if (m->ctx.compute == ANNEAL_F16) return false; /* f16 products: the tensor path */
    anneal_decode_plan *p = &e->plan;
    if (rows >= 2) {
        bool ok = to_qpanels(e, &p->head);
        for (int l = 0; l < p->n_layer && ok; l++) {
            anneal_decode_block_plan *b = &p->blocks[l];
            anneal_gemv_weight *ws[7] = {&b->q, &b->k, &b->v, &b->o, &b->fc, &b->up, &b->down};
            for (int i = 0; i < 7 && ok; i++) ok = to_qpanels(e, ws[i]);
        }
        if (!ok) return false;
    }
    if (m->ctx.compute != ANNEAL_BF16) return true;
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

static _Atomic int64_t steps_run, prefills_run, extends_run;

int64_t anneal_decode_engine_steps(void) { return steps_run; }

int64_t anneal_decode_engine_prefills(void) { return prefills_run; }

int64_t anneal_decode_engine_extends(void) { return extends_run; }

/* Rows of one engine call (at most e->rows): row i is ids[i] appended to slot slots[i]
 * at position e->pos[i]; rows of one slot come in increasing positions (a prompt's run
 * of positions), so each attends to the rows before it, which are stored into the cache
 * before attention reads it. Logits go to out for the n_out rows listed in out_rows
 * (row r's at out + r' * V for the r'-th entry); the cache's lengths are not advanced
 * here. An error (an int8 product's workspace) before anything is returned. */
static anneal_status forward_rows(engine *e, anneal_kv_cache *kv, const int64_t *slots, const int32_t *ids,
                                  int64_t n, const int64_t *out_rows, int64_t n_out, float *out) {
    const anneal_decode_plan *p = &e->plan;
    const int64_t C = p->C, Hq = p->Hq, Hkv = p->Hkv, D = p->D, F = p->F;
    const int64_t W = (Hq + 2 * Hkv) * D;
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
                                 .ld_out = Hq * D, .scratch = e->scratch, .kv_scratch = e->kvs,
                                 .kv_scratch_floats = e->kvs_floats};
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
    if (n_out == 0) return ANNEAL_OK;
    if (n_out == n) { /* every row: the norm in place of the gather */
        norm(p, n, e->x, p->nf_w, p->nf_b, e->h);
    } else {
        for (int64_t r = 0; r < n_out; r++) memcpy(e->a + r * C, e->x + out_rows[r] * C, (size_t)C * sizeof(float));
        norm(p, n_out, e->a, p->nf_w, p->nf_b, e->h);
    }
    GEMV(&p->head, e->h, C, n_out, out, p->V, ANNEAL_GEMV_NONE);
    return ANNEAL_OK;
}

anneal_status anneal_decode_engine_step(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                        const int32_t *ids, int64_t n, float *out) {
    if (m->device != ANNEAL_CPU || !plan_fn(m)) return ANNEAL_ERR_UNSUPPORTED;
    engine *e = engine_get(m, kv);
    if (!e || n > e->rows || !plan_step(e, m, n)) return ANNEAL_ERR_UNSUPPORTED;
    for (int64_t i = 0; i < n; i++) e->pos[i] = anneal_kv_cache_slot_len(kv, slots[i]);
    anneal_status s = forward_rows(e, kv, slots, ids, n, NULL, n, out);
    if (s != ANNEAL_OK) return s;
    for (int64_t i = 0; i < n; i++) anneal_kv_cache_slot_advance(kv, slots[i], 1);
    steps_run++;
    return ANNEAL_OK;
}

anneal_status anneal_decode_engine_extend(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                          const int32_t *ids, const int64_t *counts, int64_t n, float *out) {
    if (m->device != ANNEAL_CPU || !plan_fn(m)) return ANNEAL_ERR_UNSUPPORTED;
    engine *e = engine_get(m, kv);
    int64_t rows = 0;
    for (int64_t i = 0; i < n; i++) rows += counts[i];
    if (!e || !plan_step(e, m, rows) || !prefill_ready(e)) return ANNEAL_ERR_UNSUPPORTED;
    if (rows > e->rows || n > e->slots) return ANNEAL_ERR_UNSUPPORTED;
    int64_t *last = e->row_last;
    for (int64_t i = 0, r = 0; i < n; i++) {
        int64_t len = anneal_kv_cache_slot_len(kv, slots[i]);
        for (int64_t j = 0; j < counts[i]; j++, r++) e->row_slot[r] = slots[i], e->pos[r] = len + j;
        last[i] = r - 1;
    }
    anneal_status s = forward_rows(e, kv, e->row_slot, ids, rows, last, n, out);
    if (s != ANNEAL_OK) return s;
    for (int64_t i = 0; i < n; i++) anneal_kv_cache_slot_advance(kv, slots[i], counts[i]);
    extends_run++;
    return ANNEAL_OK;
}

anneal_status anneal_decode_engine_prefill(anneal_model *m, anneal_kv_cache *kv, int64_t slot, const int32_t *ids,
                                           int64_t n, float *out) {
    if (m->device != ANNEAL_CPU || !plan_fn(m)) return ANNEAL_ERR_UNSUPPORTED;
    engine *e = engine_get(m, kv);
    if (!e || !plan_step(e, m, n)) return ANNEAL_ERR_UNSUPPORTED;
    if (!prefill_ready(e)) return ANNEAL_ERR_UNSUPPORTED;
    const int64_t len0 = anneal_kv_cache_slot_len(kv, slot);
    for (int64_t i = 0; i < e->rows; i++) e->row_slot[i] = slot;
    for (int64_t done = 0; done < n;) {
        int64_t k = n - done < e->rows ? n - done : e->rows;
        for (int64_t i = 0; i < k; i++) e->pos[i] = len0 + done + i;
        bool last = done + k == n;
        int64_t last_row = k - 1;
        /* a chunk before the last wants no logits: its head product is skipped */
        anneal_status s = forward_rows(e, kv, e->row_slot, ids + done, k, &last_row, last ? 1 : 0, out);
        if (s != ANNEAL_OK) { /* the chunks before advanced the slot: take them back */
            anneal_kv_cache_slot_reset(kv, slot);
            if (len0) anneal_kv_cache_slot_advance(kv, slot, len0);
            return s;
        }
        anneal_kv_cache_slot_advance(kv, slot, k);
        done += k;
    }
    prefills_run++;
    return ANNEAL_OK;
}
