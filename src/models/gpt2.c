/* GPT-2, written with the nn blocks and read top to bottom: token + position
 * embeddings, N pre-LN blocks (attention then MLP, each added to the residual stream),
 * final LayerNorm, lm head tied to the token embedding. Parameter names and layouts
 * are Hugging Face's (Conv1D weights (in, out)), so weights load and save without
 * renaming or transposing. The config.json and weight translation is gpt2_hf.c. */
#include "anneal/autograd.h"
#include "anneal/gpt2.h"
#include "decode_engine.h"
#include "gpt2_hf.h"
#include "models_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ config */

static const char *const gpt2_preset_names[] = {"tiny", "d6", "124M", "350M", "774M", "1.5B", NULL};

bool anneal_gpt2_preset(const char *name, anneal_model_config *out) {
    static const struct {
        const char *name, *alias;
        int L, H, C, V, ctx;
    } presets[] = {
        {"tiny", NULL, 2, 4, 64, 512, 256},
        {"d6", NULL, 6, 6, 384, 50257, 1024},
        {"124M", "gpt2", 12, 12, 768, 50257, 1024},
        {"350M", "gpt2-medium", 24, 16, 1024, 50257, 1024},
        {"774M", "gpt2-large", 36, 20, 1280, 50257, 1024},
        {"1.5B", "gpt2-xl", 48, 25, 1600, 50257, 1024},
    };
    for (size_t i = 0; name && i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(name, presets[i].name) && (!presets[i].alias || strcmp(name, presets[i].alias))) continue;
        memset(out, 0, sizeof *out);
        snprintf(out->arch, sizeof out->arch, "gpt2");
        out->n_layer = presets[i].L;
        out->n_head = presets[i].H;
        out->n_embd = presets[i].C;
        out->vocab_size = presets[i].V;
        out->n_ctx = presets[i].ctx;
        out->norm_eps = 1e-5f;
        return true;
    }
    return false;
}

anneal_status anneal_gpt2_config_check(const anneal_model_config *c) {
    if (!c) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: NULL config");
    if (c->arch[0] && strcmp(c->arch, "gpt2"))
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: the config is of architecture '%.32s'", c->arch);
    if (c->n_layer <= 0 || c->n_head <= 0 || c->n_embd <= 0 || c->vocab_size <= 0 || c->n_ctx <= 0)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "gpt2: sizes must be positive (n_layer %d, n_head %d, n_embd %d, "
                                "vocab_size %d, n_ctx %d)",
                                c->n_layer, c->n_head, c->n_embd, c->vocab_size, c->n_ctx);
    if (c->n_embd % c->n_head)
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: n_embd %d is not divisible by n_head %d",
                                c->n_embd, c->n_head);
    if (!(c->dropout >= 0.0f && c->dropout < 1.0f))
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: dropout %g is outside [0, 1)", (double)c->dropout);
    if ((unsigned)c->recompute > ANNEAL_RECOMPUTE_ATTN)
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: unknown recompute mode %d", (int)c->recompute);
    if (!(c->norm_eps > 0.0f))
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: norm_eps must be positive");
    /* what GPT-2 does not have: grouped-query attention, another MLP width, RoPE */
    if (c->n_kv_head && c->n_kv_head != c->n_head)
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: n_kv_head %d must be 0 or n_head %d", c->n_kv_head, c->n_head);
    if (c->n_ff && c->n_ff != 4 * c->n_embd)
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: n_ff %d must be 0 or 4 * n_embd (%d)", c->n_ff, 4 * c->n_embd);
    if (c->rope_theta != 0.0f || c->rope.scaling != ANNEAL_ROPE_SCALING_NONE)
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: rotary embeddings are not part of GPT-2 (rope_theta %g)",
                                (double)c->rope_theta);
    if (c->tp_size > 1 && (c->n_head % c->tp_size || c->tp_rank < 0 || c->tp_rank >= c->tp_size))
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: n_head %d is not divisible by --tp %d (tensor parallelism splits "
                                "the attention heads evenly over the ranks of a group)", c->n_head, c->tp_size);
    if (c->qkv_bias || c->out_bias || (c->hf_model_type[0] && strcmp(c->hf_model_type, "gpt2")))
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: qkv_bias, out_bias and hf_model_type '%.32s' are Llama-family "
                                "settings", c->hf_model_type);
    return ANNEAL_OK;
}

/* ------------------------------------------------------------------ create */

static const anneal_model_ops gpt2_ops;

/* Tensor parallelism splits the vocabulary too (the token embedding's rows, the lm
 * head's columns) when it divides evenly; otherwise both stay whole on every rank. */
static bool vocab_parallel(const anneal_model_config *c) {
    return c->tp_size > 1 && !c->tp_vocab_whole && c->vocab_size % c->tp_size == 0;
}

/* Registers every parameter in Hugging Face's order: wte, wpe, each block (ln_1,
 * attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj; weight then bias), ln_f. */
static anneal_model *gpt2_create(const anneal_model_config *cfg, anneal_device dev) {
    anneal_gpt2 *m = calloc(1, sizeof *m);
    if (!m || !(m->blocks = calloc((size_t)cfg->n_layer, sizeof *m->blocks)) ||
        !(m->base.params = anneal_params_new_on(dev))) {
        if (m) free(m->blocks);
        free(m);
        anneal_set_error(ANNEAL_ERR_OOM, "gpt2: out of memory");
        return NULL;
    }
    m->base.ops = &gpt2_ops;
    m->base.cfg = *cfg;
    snprintf(m->base.cfg.arch, sizeof m->base.cfg.arch, "gpt2");
    m->base.device = dev;
    anneal_params *ps = m->base.params;
    int64_t C = cfg->n_embd;
    float eps = cfg->norm_eps;
    int64_t vocab_rows = vocab_parallel(cfg) ? cfg->vocab_size / cfg->tp_size : cfg->vocab_size;
    anneal_status s = anneal_nn_embedding_create(&m->wte, ps, "transformer.wte", vocab_rows, C);
    if (s == ANNEAL_OK) s = anneal_nn_embedding_create(&m->wpe, ps, "transformer.wpe", cfg->n_ctx, C);
    /* tensor parallelism: this rank's heads (c_attn's columns, c_proj's rows) and MLP width */
    int tp = cfg->tp_size > 1 ? cfg->tp_size : 1;
    anneal_nn_attention_config ac = {.n_embd = C, .n_head = cfg->n_head / tp, .head_dim = C / cfg->n_head,
                                     .layout = ANNEAL_WEIGHT_IN_OUT, .qkv_bias = true, .out_bias = true,
                                     .qkv_name = "c_attn", .out_name = "c_proj"};
    for (int l = 0; l < cfg->n_layer && s == ANNEAL_OK; l++) {
        anneal_gpt2_block *b = &m->blocks[l];
        b->model = m;
        b->layer = l;
        char p[96], q[112];
        snprintf(p, sizeof p, "transformer.h.%d", l);
        snprintf(q, sizeof q, "%s.ln_1", p);
        s = anneal_nn_layer_norm_create(&b->ln_1, ps, q, C, eps, true);
        snprintf(q, sizeof q, "%s.attn", p);
        if (s == ANNEAL_OK) s = anneal_nn_attention_create(&b->attn, ps, q, &ac);
        snprintf(q, sizeof q, "%s.ln_2", p);
        if (s == ANNEAL_OK) s = anneal_nn_layer_norm_create(&b->ln_2, ps, q, C, eps, true);
        snprintf(q, sizeof q, "%s.mlp", p);
        if (s == ANNEAL_OK)
            s = anneal_nn_mlp_create_gelu(&b->mlp, ps, q, C, 4 * C / tp, ANNEAL_WEIGHT_IN_OUT, true, "c_fc", "c_proj");
    }
    if (s == ANNEAL_OK) s = anneal_nn_layer_norm_create(&m->ln_f, ps, "transformer.ln_f", C, eps, true);
    if (s != ANNEAL_OK) {
        anneal_gpt2_free(m);
        return NULL;
    }
    return &m->base;
}

anneal_gpt2 *anneal_gpt2_new(const anneal_model_config *cfg) {
    if (!cfg) {
        anneal_set_error(ANNEAL_ERR_ARG, "gpt2: NULL config");
        return NULL;
    }
    anneal_model_config c = *cfg;
    if (!c.arch[0]) snprintf(c.arch, sizeof c.arch, "gpt2");
    if (anneal_gpt2_config_check(&c) != ANNEAL_OK) return NULL;
    return (anneal_gpt2 *)anneal_model_new(&c, ANNEAL_CPU);
}

void anneal_gpt2_free(anneal_gpt2 *m) {
    if (!m) return;
    anneal_params_free(m->base.params);
    free(m->blocks);
    free(m);
}

anneal_status anneal_gpt2_init(anneal_gpt2 *m, uint64_t seed) {
    if (!m) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2_init: NULL model");
    anneal_manual_seed(seed);
    int L = m->base.cfg.n_layer;
    float std = 0.02f, proj_std = 0.02f / sqrtf(2.0f * (float)L);
    anneal_status s = anneal_init_normal_(m->wte.weight, 0.0f, std);
    if (s == ANNEAL_OK) s = anneal_init_normal_(m->wpe.weight, 0.0f, std);
    for (int l = 0; l < L && s == ANNEAL_OK; l++) {
        anneal_gpt2_block *b = &m->blocks[l];
        /* biases are already zero */
        anneal_tensor *ones[2] = {b->ln_1.weight, b->ln_2.weight};
        for (int i = 0; i < 2 && s == ANNEAL_OK; i++) s = anneal_init_fill_(ones[i], 1.0f);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->attn.qkv.weight, 0.0f, std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->attn.out.weight, 0.0f, proj_std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->mlp.fc.weight, 0.0f, std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->mlp.proj.weight, 0.0f, proj_std);
    }
    if (s == ANNEAL_OK) s = anneal_init_fill_(m->ln_f.weight, 1.0f);
    return s;
}

/* ----------------------------------------------------------------- forward */

/* qkv projection + causal attention of one block (ctx): in[0] = ln_1 output (B,T,C) ->
 * (B,T,C) before c_proj. Also the recompute region of ANNEAL_RECOMPUTE_ATTN. */
static anneal_tensor *attn_core(void *ctx, anneal_tensor *const *in) {
    const anneal_gpt2_block *b = ctx;
    return anneal_nn_attention_core(&b->attn, &b->model->base.ctx, in[0], NULL, 0);
}

/* A row-parallel projection under tensor parallelism: this rank's rows of the weight,
 * the partial products summed over the group (g), the bias added once after the sum. */
static anneal_tensor *row_parallel(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x) {
    anneal_dense_opts o = {.layout = d->layout, .compute = ctx->compute};
    anneal_tensor *y = ctx->tp->reduce_out(ctx->tp->user, anneal_dense(x, d->weight, NULL, &o));
    return d->bias ? anneal_add(y, d->bias) : y;
}

/* y + the layer's bias (if any). */
static anneal_tensor *plus_bias(anneal_tensor *y, const anneal_nn_dense *d) { return d->bias ? anneal_add(y, d->bias) : y; }

/* The block under --deterministic (ctx.deterministic, any tp_size): every projection
 * through ctx.tp's det_col / det_row in this rank's heads as chunks (parallel's
 * tp_det.c), so one process and every --tp layout give the same bits. det_attn_core:
 * the qkv projection and attention (ctx = the block; ANNEAL_RECOMPUTE_ATTN's region). */
static anneal_tensor *det_attn_core(void *ctx, anneal_tensor *const *in) {
    const anneal_gpt2_block *b = ctx;
    const anneal_nn_ctx *c = &b->model->base.ctx;
    const anneal_nn_dense *qkv = &b->attn.qkv;
    int H = b->attn.n_head;
    anneal_attention_opts ao = {.causal = true, .compute = c->compute};
    return anneal_attention_packed(c->tp->det_col(c->tp->user, in[0], qkv->weight, qkv->bias, qkv->layout, 3, H,
                                                  c->compute), H, H, &ao);
}

static anneal_tensor *block_forward_det(const anneal_gpt2_block *b, anneal_tensor *x) {
    const anneal_model *m = &b->model->base;
    const anneal_nn_ctx *ctx = &m->ctx;
    const anneal_nn_tp *tp = ctx->tp;
    const anneal_nn_dense *out = &b->attn.out, *fc = &b->mlp.fc, *proj = &b->mlp.proj;
    int H = b->attn.n_head;
    anneal_tensor *h = anneal_nn_layer_norm_forward(&b->ln_1, x);
    h = m->cfg.recompute == ANNEAL_RECOMPUTE_ATTN ? anneal_checkpoint(det_attn_core, (void *)b, 1, &h)
                                                  : det_attn_core((void *)b, &h);
    h = tp->det_row(tp->user, h, out->weight, out->layout, H, ctx->compute);
    anneal_tensor *s, *a = anneal_dropout(plus_bias(h, out), m->cfg.dropout, ctx->training);
    h = anneal_gelu(tp->det_col(tp->user, anneal_nn_add_layer_norm(&b->ln_2, x, a, &s), fc->weight, fc->bias,
                                fc->layout, 1, H, ctx->compute), true);
    h = tp->det_row(tp->user, h, proj->weight, proj->layout, H, ctx->compute);
    return anneal_add(s, anneal_dropout(plus_bias(h, proj), m->cfg.dropout, ctx->training));
}

anneal_tensor *anneal_gpt2_block_forward(const anneal_gpt2_block *b, anneal_tensor *x, anneal_kv_cache *kv) {
    if (!b) return NULL;
    const anneal_model *m = &b->model->base;
    const anneal_nn_ctx *ctx = &m->ctx;
    if (!kv && ctx->deterministic && ctx->tp && ctx->tp->det_row) return block_forward_det(b, x);
    float p = m->cfg.dropout;
    bool train = ctx->training;
    /* tensor parallelism: f before the column-parallel c_attn / c_fc, g after the
     * row-parallel c_projs (Megatron-LM's two all-reduces per block, each way) */
    const anneal_nn_tp *tp = m->cfg.tp_size > 1 ? ctx->tp : NULL;
    if (m->cfg.tp_size > 1 && !tp) {
        anneal_set_error(ANNEAL_ERR_STATE, "gpt2: a tensor-parallel model (tp_size %d) runs without its group (ctx.tp)",
                         m->cfg.tp_size);
        return NULL;
    }
    /* attention: LN -> qkv (B,T,3C) -> causal attention (B,T,C) -> c_proj -> dropout;
     * in attn recompute mode the qkv GEMM + attention are replayed in backward */
    anneal_tensor *h = anneal_nn_layer_norm_forward(&b->ln_1, x);
    if (tp) h = tp->copy_in(tp->user, h);
    anneal_tensor *att = kv ? anneal_nn_attention_core(&b->attn, ctx, h, kv, b->layer)
                         : m->cfg.recompute == ANNEAL_RECOMPUTE_ATTN ? anneal_checkpoint(attn_core, (void *)b, 1, &h)
                                                                     : attn_core((void *)b, &h);
    anneal_tensor *a = anneal_dropout(tp ? row_parallel(&b->attn.out, ctx, att)
                                         : anneal_nn_attention_out(&b->attn, ctx, att), p, train);
    /* residual add + ln_2 in one pass: s = x + a (the residual stream), h = LN(s) */
    anneal_tensor *s;
    h = anneal_nn_add_layer_norm(&b->ln_2, x, a, &s);
    /* MLP: c_fc + GELU(tanh) fused (B,T,4C) -> c_proj (B,T,C) -> dropout -> residual */
    anneal_tensor *f = NULL;
    if (tp) f = row_parallel(&b->mlp.proj, ctx, anneal_nn_dense_forward_act(&b->mlp.fc, ctx, tp->copy_in(tp->user, h),
                                                                             ANNEAL_ACT_GELU_TANH, NULL));
    anneal_tensor *o = anneal_dropout(tp ? f : anneal_nn_mlp_forward(&b->mlp, ctx, h), p, train);
    return anneal_add(s, o);
}

/* One block between the model's block hook calls (ZeRO-3 gathers its parameters). */
static anneal_tensor *hooked_block_run(const void *blk, anneal_tensor *x, anneal_kv_cache *kv) {
    const anneal_gpt2_block *b = blk;
    if (anneal_model_block_enter(&b->model->base, b->layer) != ANNEAL_OK) return NULL;
    return anneal_model_block_leave(&b->model->base, b->layer, anneal_gpt2_block_forward(b, x, kv));
}

/* hooked_block_run in a scope of its own (block_scope.c). */
static anneal_tensor *hooked_block(const anneal_gpt2_block *b, anneal_tensor *x, anneal_kv_cache *kv) {
    return anneal_model_scoped_block(hooked_block_run, b, x, kv);
}

/* One training block as a recompute region (ctx is the block). x: (B, T, C). */
static anneal_tensor *block_region(void *ctx, anneal_tensor *const *in) { return hooked_block(ctx, in[0], NULL); }

/* Final hidden states (B, T, C) of ids (B, T): positions [0, T), or with a cache the
 * positions after the cached ones (attention over the cache). */
static anneal_tensor *hidden(anneal_gpt2 *m, anneal_tensor *ids, anneal_kv_cache *kv) {
    if (!m || !ids) return NULL;
    const anneal_model_config *cfg = &m->base.cfg;
    if (ids->ndim != 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "gpt2: ids must be (B, T), got %d dims", ids->ndim);
        return NULL;
    }
    int64_t T = ids->shape[1], pos0 = anneal_kv_cache_len(kv);
    if (pos0 + T > cfg->n_ctx) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "gpt2: sequence length %lld exceeds n_ctx %d", (long long)(pos0 + T),
                         cfg->n_ctx);
        return NULL;
    }
    /* token + position embeddings: (B, T, C) + (T, C) */
    anneal_tensor *pos = anneal_arange(m->base.device, pos0, T);
    const anneal_nn_tp *tp = m->base.ctx.tp;
    anneal_tensor *tok = !vocab_parallel(cfg) ? anneal_nn_embedding_forward(&m->wte, ids)
                         : tp ? tp->vocab_embed(tp->user, m->wte.weight, ids, cfg->tp_rank * m->wte.weight->shape[0])
                              : NULL; /* the block reports the missing group */
    anneal_tensor *x = anneal_add(tok, anneal_nn_embedding_forward(&m->wpe, pos));
    x = anneal_dropout(x, cfg->dropout, m->base.ctx.training);
    for (int l = 0; l < cfg->n_layer; l++) {
        anneal_gpt2_block *b = &m->blocks[l];
        x = !kv && cfg->recompute == ANNEAL_RECOMPUTE_BLOCK ? anneal_checkpoint(block_region, b, 1, &x)
                                                            : hooked_block(b, x, kv);
    }
    return anneal_nn_layer_norm_forward(&m->ln_f, x);
}

anneal_tensor *anneal_gpt2_hidden(anneal_gpt2 *m, anneal_tensor *ids) { return hidden(m, ids, NULL); }

/* The tied lm head: logits = h @ wte^T. */
static anneal_tensor *lm_head(anneal_gpt2 *m, anneal_tensor *h) {
    if (vocab_parallel(&m->base.cfg)) { /* this rank's columns, then every rank's (inference) */
        const anneal_nn_tp *tp = m->base.ctx.tp;
        if (!h || !tp || !tp->vocab_gather) {
            if (h) anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "gpt2: the logits of a vocabulary-parallel model (--tp %d) "
                                    "need its group's gather (ctx.tp)", m->base.cfg.tp_size);
            return NULL;
        }
        anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m->base.ctx.compute};
        return tp->vocab_gather(tp->user, anneal_dense(h, m->wte.weight, NULL, &o));
    }
    if (m->base.params->head) return anneal_nn_quant_head_forward(m->base.params, &m->base.ctx, h); /* int8 head */
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m->base.ctx.compute};
    return anneal_dense(h, m->wte.weight, NULL, &o);
}

anneal_tensor *anneal_gpt2_forward(anneal_gpt2 *m, anneal_tensor *ids) {
    anneal_tensor *h = hidden(m, ids, NULL);
    return m ? lm_head(m, h) : NULL;
}

anneal_tensor *anneal_gpt2_loss(anneal_gpt2 *m, anneal_tensor *ids, anneal_tensor *targets) {
    /* lm head + cross-entropy fused in row chunks: no (B, T, V) logits are made */
    anneal_tensor *h = hidden(m, ids, NULL);
    if (m && vocab_parallel(&m->base.cfg) && h) {
        /* this rank's V/N columns of the logits, the softmax's sums over the group */
        const anneal_nn_tp *tp = m->base.ctx.tp;
        anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m->base.ctx.compute};
        anneal_tensor *logits = anneal_dense(tp->copy_in(tp->user, h), m->wte.weight, NULL, &o);
        return tp->vocab_loss(tp->user, logits, targets, m->base.cfg.tp_rank * m->wte.weight->shape[0], -100);
    }
    if (m && m->base.params->head) return anneal_nn_quant_head_loss(m->base.params, &m->base.ctx, h, targets, -100);
    return m ? anneal_linear_cross_entropy_ex(h, m->wte.weight, targets, -100, m->base.ctx.compute) : NULL;
}

double anneal_gpt2_flops_per_token(const anneal_gpt2 *m, int64_t T) {
    const anneal_model_config *c = &m->base.cfg;
    return 6.0 * (double)anneal_params_numel(m->base.params) + 12.0 * c->n_layer * (double)T * c->n_embd;
}

/* --------------------------------------------------- the model interface */

static void op_free(anneal_model *m) { anneal_gpt2_free((anneal_gpt2 *)m); }
static anneal_status op_init(anneal_model *m, uint64_t seed) { return anneal_gpt2_init((anneal_gpt2 *)m, seed); }
static anneal_tensor *op_loss(anneal_model *m, anneal_tensor *ids, anneal_tensor *targets) {
    return anneal_gpt2_loss((anneal_gpt2 *)m, ids, targets);
}
static anneal_tensor *op_logits(anneal_model *m, anneal_tensor *ids) {
    return anneal_gpt2_forward((anneal_gpt2 *)m, ids);
}

static anneal_kv_cache *op_kv_cache_new(anneal_model *m, int64_t batch, int64_t max_len) {
    const anneal_model_config *c = &m->cfg;
    int tp = c->tp_size > 1 ? c->tp_size : 1; /* this rank's heads */
    return anneal_kv_cache_new_dtype(m->device, c->n_layer, batch, c->n_head / tp, c->n_embd / c->n_head, max_len,
                                     m->ctx.kv_dtype, m);
}

static anneal_tensor *op_forward_cached(anneal_model *mm, anneal_kv_cache *kv, anneal_tensor *ids, int64_t rows) {
    anneal_gpt2 *m = (anneal_gpt2 *)mm;
    anneal_tensor *h = hidden(m, ids, kv);
    if (h && rows < h->shape[1]) h = anneal_narrow(h, 1, h->shape[1] - rows, rows);
    return lm_head(m, h);
}

/* f32 contiguous CPU data of t, or NULL. */
static const float *f32_data(const anneal_tensor *t) {
    return t && t->dtype == ANNEAL_F32 && t->device == ANNEAL_CPU && anneal_is_contiguous(t) ? anneal_data(t) : NULL;
}

bool anneal_gpt2_decode_plan(anneal_model *mm, anneal_decode_plan *p) {
    anneal_gpt2 *m = (anneal_gpt2 *)mm;
    const anneal_model_config *c = &mm->cfg;
    if (c->tp_size > 1) return false; /* the decode engine runs whole models */
    int64_t C = c->n_embd;
    p->n_layer = c->n_layer;
    p->C = C;
    p->Hq = p->Hkv = c->n_head;
    p->D = C / c->n_head;
    p->F = 4 * C;
    p->V = c->vocab_size;
    p->eps = m->ln_f.eps;
    p->rms = false;
    p->tok_emb = f32_data(m->wte.weight);
    p->pos_emb = f32_data(m->wpe.weight);
    p->rope = NULL;
    p->nf_w = f32_data(m->ln_f.weight);
    p->nf_b = f32_data(m->ln_f.bias);
    p->head = (anneal_gemv_weight){.w = p->tok_emb, .dtype = ANNEAL_F32, .out_in = true, .in = C, .out = p->V};
    bool ok = p->tok_emb && p->pos_emb && p->nf_w && p->nf_b;
    for (int l = 0; l < c->n_layer && ok; l++) {
        const anneal_gpt2_block *b = &m->blocks[l];
        anneal_decode_block_plan *d = &p->blocks[l];
        memset(d, 0, sizeof *d);
        d->n1_w = f32_data(b->ln_1.weight);
        d->n1_b = f32_data(b->ln_1.bias);
        d->n2_w = f32_data(b->ln_2.weight);
        d->n2_b = f32_data(b->ln_2.bias);
        ok = d->n1_w && d->n1_b && d->n2_w && d->n2_b && b->ln_1.eps == p->eps && b->ln_2.eps == p->eps &&
             anneal_decode_dense(&b->attn.qkv, &d->q) && anneal_decode_dense(&b->attn.out, &d->o) &&
             anneal_decode_dense(&b->mlp.fc, &d->fc) && anneal_decode_dense(&b->mlp.proj, &d->down);
    }
    return ok;
}

static double op_flops(const anneal_model *m, int64_t T) {
    return anneal_gpt2_flops_per_token((const anneal_gpt2 *)m, T);
}

/* Pipeline stage of blocks [first, last) (model.h's stage_forward): hidden()'s embedding,
 * blocks and final norm, and loss()'s fused head, split where the stage ends. */
static anneal_tensor *op_stage_forward(anneal_model *mm, int first, int last, anneal_tensor *in, anneal_tensor *targets) {
    anneal_gpt2 *m = (anneal_gpt2 *)mm;
    const anneal_model_config *cfg = &mm->cfg;
    anneal_tensor *x = in;
    if (first == 0) {
        if (in->ndim != 2 || in->shape[1] > cfg->n_ctx) {
            anneal_set_error(ANNEAL_ERR_SHAPE, "gpt2: stage ids must be (B, T <= n_ctx %d)", cfg->n_ctx);
            return NULL;
        }
        anneal_tensor *pos = anneal_arange(mm->device, 0, in->shape[1]);
        const anneal_nn_tp *tp = mm->ctx.tp; /* --tp with --pp: hidden()'s vocabulary-parallel lookup */
        anneal_tensor *tok = !vocab_parallel(cfg) ? anneal_nn_embedding_forward(&m->wte, in)
                             : tp ? tp->vocab_embed(tp->user, m->wte.weight, in, cfg->tp_rank * m->wte.weight->shape[0])
                                  : NULL;
        x = anneal_add(tok, anneal_nn_embedding_forward(&m->wpe, pos));
        x = anneal_dropout(x, cfg->dropout, mm->ctx.training);
    }
    for (int l = first; l < last; l++)
        x = cfg->recompute == ANNEAL_RECOMPUTE_BLOCK ? anneal_checkpoint(block_region, &m->blocks[l], 1, &x)
                                                     : hooked_block(&m->blocks[l], x, NULL);
    if (last < cfg->n_layer) return x;
    anneal_tensor *h = anneal_nn_layer_norm_forward(&m->ln_f, x);
    if (!targets) return lm_head(m, h); /* no targets: the logits (the pipeline's samples) */
    if (vocab_parallel(cfg) && mm->ctx.tp) { /* --tp with --pp: as anneal_gpt2_loss */
        const anneal_nn_tp *tp = mm->ctx.tp;
        anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = mm->ctx.compute};
        anneal_tensor *logits = anneal_dense(tp->copy_in(tp->user, h), m->wte.weight, NULL, &o);
        return tp->vocab_loss(tp->user, logits, targets, cfg->tp_rank * m->wte.weight->shape[0], -100);
    }
    return anneal_linear_cross_entropy_ex(h, m->wte.weight, targets, -100, mm->ctx.compute);
}

/* Where parameter i is used (model.h's param_span): wte by the embedding and the tied
 * head, wpe by the embedding, transformer.h.<l>.* by block l, ln_f after the blocks. */
static void op_param_span(const anneal_model *mm, int i, int *first, int *last) {
    const anneal_gpt2 *m = (const anneal_gpt2 *)mm;
    const anneal_tensor *t = mm->params->items[i].tensor;
    int L = mm->cfg.n_layer, l = -1;
    if (t == m->wte.weight) *first = -1, *last = L;
    else if (t == m->wpe.weight) *first = *last = -1;
    else if (sscanf(mm->params->items[i].name, "transformer.h.%d.", &l) == 1 && l >= 0 && l < L) *first = *last = l;
    else *first = *last = L;
}

static const anneal_model_ops gpt2_ops = {
    .free = op_free,
    .init = op_init,
    .loss = op_loss,
    .logits = op_logits,
    .kv_cache_new = op_kv_cache_new,
    .forward_cached = op_forward_cached,
    .flops_per_token = op_flops,
    .hf_import = anneal_gpt2_hf_import,
    .hf_export = anneal_gpt2_hf_export,
    .onnx_graph = anneal_gpt2_onnx_graph,
    .stage_forward = op_stage_forward,
    .param_span = op_param_span,
};

static const char *const gpt2_hf_types[] = {"gpt2", NULL};

const anneal_model_arch anneal_gpt2_arch = {
    .name = "gpt2",
    .hf_model_types = gpt2_hf_types,
    .hf_architecture = "GPT2LMHeadModel",
    .preset = anneal_gpt2_preset,
    .preset_names = gpt2_preset_names,
    .config_check = anneal_gpt2_config_check,
    .config_from_hf = anneal_gpt2_config_from_hf,
    .config_to_hf = anneal_gpt2_config_to_hf,
    .create = gpt2_create,
    .gguf = &anneal_gpt2_gguf,
};
