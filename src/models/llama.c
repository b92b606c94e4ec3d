/* The Llama family (Llama 2/3, Mistral, Qwen2), written with the nn blocks and read top
 * to bottom as transformers' LlamaForCausalLM: token embedding, N pre-norm decoder
 * layers (RMSNorm -> q/k/v projections -> rotary embedding -> grouped-query causal
 * attention -> o_proj -> residual; RMSNorm -> SwiGLU MLP -> residual), final RMSNorm,
 * lm head (tied to the embedding or its own matrix). No biases, but Qwen2's q/k/v
 * biases and Llama's attention_bias. Parameter names and layouts are Hugging Face's
 * (torch Linear weights (out, in)), so weights load and save without renaming or
 * transposing; the config.json and weight translation is llama_hf.c. */
#include "anneal/autograd.h"
#include "decode_engine.h"
#include "llama_internal.h"
#include "models_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ config */

static const char *const llama_preset_names[] = {"llama-tiny", "llama-125M", NULL};

/* Fills *out with a named preset: llama-tiny (tests, demos: 2 layers of 64, GQA 4/2)
 * and llama-125M (12 layers of 768, GQA 12/4, SwiGLU 2048, 32000 ids: the benchmark's).
 * False for another name. */
static bool llama_preset(const char *name, anneal_model_config *out) {
    static const struct {
        const char *name;
        int L, H, Hkv, C, F, V, ctx;
    } presets[] = {
        {"llama-tiny", 2, 4, 2, 64, 176, 512, 256},
        {"llama-125M", 12, 12, 4, 768, 2048, 32000, 1024},
    };
    for (size_t i = 0; name && i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(name, presets[i].name)) continue;
        memset(out, 0, sizeof *out);
        snprintf(out->arch, sizeof out->arch, "llama");
        snprintf(out->hf_model_type, sizeof out->hf_model_type, "llama");
        out->n_layer = presets[i].L;
        out->n_head = presets[i].H;
        out->n_kv_head = presets[i].Hkv;
        out->n_embd = presets[i].C;
        out->n_ff = presets[i].F;
        out->vocab_size = presets[i].V;
        out->n_ctx = presets[i].ctx;
        out->norm_eps = 1e-5f;
        out->rope_theta = 10000.0f;
        out->rope.theta = 10000.0f;
        return true;
    }
    return false;
}

/* Checks a Llama-family config (ANNEAL_ERR_ARG naming the field): positive sizes,
 * n_head divisible into n_embd and by n_kv_head, n_ff > 0, RoPE base > 0 and a valid
 * scaling, biases as the model_type has them, no dropout. */
static anneal_status llama_config_check(const anneal_model_config *c) {
    if (!c) return anneal_set_error(ANNEAL_ERR_ARG, "llama: NULL config");
    if (c->arch[0] && strcmp(c->arch, "llama"))
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: the config is of architecture '%.32s'", c->arch);
    if (c->n_layer <= 0 || c->n_head <= 0 || c->n_embd <= 0 || c->vocab_size <= 0 || c->n_ctx <= 0 || c->n_ff <= 0)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "llama: sizes must be positive (n_layer %d, n_head %d, n_embd %d, n_ff %d, "
                                "vocab_size %d, n_ctx %d)",
                                c->n_layer, c->n_head, c->n_embd, c->n_ff, c->vocab_size, c->n_ctx);
    if (c->n_embd % c->n_head || (c->n_embd / c->n_head) % 2)
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: n_embd %d must be n_head %d times an even head size",
                                c->n_embd, c->n_head);
    int hkv = c->n_kv_head ? c->n_kv_head : c->n_head;
    if (hkv < 0 || hkv > c->n_head || c->n_head % hkv)
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: n_kv_head %d must divide n_head %d", c->n_kv_head, c->n_head);
    if (c->tp_size > 1 && (c->n_head % c->tp_size || hkv % c->tp_size || c->n_ff % c->tp_size || c->tp_rank < 0 ||
                           c->tp_rank >= c->tp_size))
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: n_head %d, n_kv_head %d and n_ff %d must be divisible by --tp %d "
                                "(tensor parallelism splits heads and MLP width evenly over a group)", c->n_head, hkv,
                                c->n_ff, c->tp_size);
    if (!(c->norm_eps > 0.0f)) return anneal_set_error(ANNEAL_ERR_ARG, "llama: norm_eps must be positive");
    if (!(c->rope_theta > 0.0f) || !isfinite(c->rope_theta))
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: rope_theta %g must be positive", (double)c->rope_theta);
    if (c->rope.theta != 0.0f && c->rope.theta != c->rope_theta)
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: rope.theta %g differs from rope_theta %g",
                                (double)c->rope.theta, (double)c->rope_theta);
    const anneal_rope_desc *r = &c->rope;
    if (r->scaling == ANNEAL_ROPE_SCALING_LINEAR && !(r->factor > 0.0f))
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: linear rope scaling needs factor > 0 (got %g)",
                                (double)r->factor);
    if (r->scaling == ANNEAL_ROPE_SCALING_LLAMA3 &&
        !(r->factor > 0.0f && r->low_freq_factor > 0.0f && r->high_freq_factor > r->low_freq_factor &&
          r->original_max_pos > 0))
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "llama: llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                                "and original_max_position_embeddings > 0");
    if ((unsigned)r->scaling > ANNEAL_ROPE_SCALING_LLAMA3)
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: unknown rope scaling %d", (int)r->scaling);
    if (c->dropout != 0.0f)
        return anneal_set_error(ANNEAL_ERR_ARG,
                                "llama: dropout %g is not supported (Llama-family models have no dropout layers)",
                                (double)c->dropout);
    if ((unsigned)c->recompute > ANNEAL_RECOMPUTE_ATTN)
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: unknown recompute mode %d", (int)c->recompute);
    const char *t = anneal_llama_hf_type(c);
    if (!strcmp(t, "llama")) {
        if (c->qkv_bias != c->out_bias)
            return anneal_set_error(ANNEAL_ERR_ARG,
                                    "llama: model_type llama has biases on all four attention projections or none "
                                    "(attention_bias): qkv_bias %d, out_bias %d",
                                    c->qkv_bias, c->out_bias);
    } else if (!strcmp(t, "qwen2")) {
        if (!c->qkv_bias || c->out_bias)
            return anneal_set_error(ANNEAL_ERR_ARG, "llama: model_type qwen2 has q/k/v biases and no o_proj bias");
    } else if (!strcmp(t, "mistral")) {
        if (c->qkv_bias || c->out_bias)
            return anneal_set_error(ANNEAL_ERR_ARG, "llama: model_type mistral has no attention biases");
    } else {
        return anneal_set_error(ANNEAL_ERR_ARG, "llama: hf_model_type '%.32s' is not llama, mistral or qwen2", t);
    }
    return ANNEAL_OK;
}

/* ------------------------------------------------------------------ create */

static const anneal_model_ops llama_ops;

/* Tensor parallelism splits the vocabulary too (embedding rows, lm head columns) when
 * it divides evenly; otherwise both stay whole on every rank. */
static bool vocab_parallel(const anneal_model_config *c) {
    return c->tp_size > 1 && !c->tp_vocab_whole && c->vocab_size % c->tp_size == 0;
}

static void llama_free(anneal_llama *m) {
    if (!m) return;
    anneal_params_free(m->base.params);
    free(m->blocks);
    free(m);
}

/* Registers every parameter in transformers' order: embed_tokens, each layer (q, k, v,
 * o projections, gate, up, down, input_layernorm, post_attention_layernorm), norm,
 * lm_head (untied only). */
static anneal_model *llama_create(const anneal_model_config *cfg, anneal_device dev) {
    anneal_llama *m = calloc(1, sizeof *m);
    if (!m || !(m->blocks = calloc((size_t)cfg->n_layer, sizeof *m->blocks)) ||
        !(m->base.params = anneal_params_new_on(dev))) {
        if (m) free(m->blocks);
        free(m);
        anneal_set_error(ANNEAL_ERR_OOM, "llama: out of memory");
        return NULL;
    }
    m->base.ops = &llama_ops;
    m->base.cfg = *cfg;
    snprintf(m->base.cfg.arch, sizeof m->base.cfg.arch, "llama");
    if (!m->base.cfg.hf_model_type[0]) snprintf(m->base.cfg.hf_model_type, sizeof m->base.cfg.hf_model_type, "llama");
    m->base.device = dev;
    m->rope = cfg->rope;
    m->rope.theta = cfg->rope_theta;
    anneal_params *ps = m->base.params;
    int64_t C = cfg->n_embd;
    float eps = cfg->norm_eps;
    /* tensor parallelism: this rank's query and key/value heads and MLP width */
    int tp = cfg->tp_size > 1 ? cfg->tp_size : 1, hkv = cfg->n_kv_head ? cfg->n_kv_head : cfg->n_head;
    int64_t V = vocab_parallel(cfg) ? cfg->vocab_size / tp : cfg->vocab_size;
    anneal_status s = anneal_nn_embedding_create(&m->embed, ps, "model.embed_tokens", V, C);
    anneal_nn_attention_config ac = {.n_embd = C, .n_head = cfg->n_head / tp, .n_kv_head = hkv / tp,
                                     .head_dim = C / cfg->n_head,
                                     .layout = ANNEAL_WEIGHT_OUT_IN, .qkv_bias = cfg->qkv_bias,
                                     .out_bias = cfg->out_bias, .q_name = "q_proj", .k_name = "k_proj",
                                     .v_name = "v_proj", .out_name = "o_proj", .rope = &m->rope};
    for (int l = 0; l < cfg->n_layer && s == ANNEAL_OK; l++) {
        anneal_llama_block *b = &m->blocks[l];
        b->model = m;
        b->layer = l;
        char p[96], q[128];
        snprintf(p, sizeof p, "model.layers.%d", l);
        snprintf(q, sizeof q, "%s.self_attn", p);
        s = anneal_nn_attention_create(&b->attn, ps, q, &ac);
        snprintf(q, sizeof q, "%s.mlp", p);
        if (s == ANNEAL_OK) s = anneal_nn_mlp_create_swiglu(&b->mlp, ps, q, C, cfg->n_ff / tp, ANNEAL_WEIGHT_OUT_IN, false);
        snprintf(q, sizeof q, "%s.input_layernorm", p);
        if (s == ANNEAL_OK) s = anneal_nn_rms_norm_create(&b->input_layernorm, ps, q, C, eps);
        snprintf(q, sizeof q, "%s.post_attention_layernorm", p);
        if (s == ANNEAL_OK) s = anneal_nn_rms_norm_create(&b->post_attention_layernorm, ps, q, C, eps);
    }
    if (s == ANNEAL_OK) s = anneal_nn_rms_norm_create(&m->norm, ps, "model.norm", C, eps);
    if (s == ANNEAL_OK && !cfg->tie_embeddings)
        s = anneal_nn_dense_create(&m->lm_head, ps, "lm_head", C, V, ANNEAL_WEIGHT_OUT_IN, false);
    if (s != ANNEAL_OK) {
        llama_free(m);
        return NULL;
    }
    return &m->base;
}

/* N(0, 0.02) for the embedding, the projections and the head; the projections into the
 * residual stream (o_proj, down_proj) N(0, 0.02 / sqrt(2 n_layer)) as GPT-2's; biases
 * zero, RMSNorm weights one. */
static anneal_status llama_init(anneal_llama *m, uint64_t seed) {
    anneal_manual_seed(seed);
    int L = m->base.cfg.n_layer;
    float std = 0.02f, proj_std = 0.02f / sqrtf(2.0f * (float)L);
    anneal_status s = anneal_init_normal_(m->embed.weight, 0.0f, std);
    for (int l = 0; l < L && s == ANNEAL_OK; l++) {
        anneal_llama_block *b = &m->blocks[l];
        anneal_nn_dense *in[5] = {&b->attn.q, &b->attn.k, &b->attn.v, &b->mlp.gate, &b->mlp.up};
        for (int i = 0; i < 5 && s == ANNEAL_OK; i++) s = anneal_init_normal_(in[i]->weight, 0.0f, std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->attn.out.weight, 0.0f, proj_std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->mlp.down.weight, 0.0f, proj_std);
        if (s == ANNEAL_OK) s = anneal_init_fill_(b->input_layernorm.weight, 1.0f);
        if (s == ANNEAL_OK) s = anneal_init_fill_(b->post_attention_layernorm.weight, 1.0f);
    }
    if (s == ANNEAL_OK) s = anneal_init_fill_(m->norm.weight, 1.0f);
    if (s == ANNEAL_OK && m->lm_head.weight) s = anneal_init_normal_(m->lm_head.weight, 0.0f, std);
    return s;
}

/* ----------------------------------------------------------------- forward */

/* q/k/v projections + RoPE + causal attention of one layer (ctx = the block): in[0] =
 * the input_layernorm output (B, T, C) -> (B, T, Hq D) before o_proj. Also the
 * recompute region of ANNEAL_RECOMPUTE_ATTN. */
static anneal_tensor *attn_core(void *ctx, anneal_tensor *const *in) {
    const anneal_llama_block *b = ctx;
    return anneal_nn_attention_core(&b->attn, &b->model->base.ctx, in[0], NULL, 0);
}

/* One decoder layer on x (B, T, C): kv NULL for training (attn recompute as the config
 * says), or the positions after the cached ones. */
/* A row-parallel projection under tensor parallelism: this rank's input columns of the
 * weight, the partial products summed over the group (g), the bias added once after. */
static anneal_tensor *row_parallel(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x) {
    anneal_dense_opts o = {.layout = d->layout, .compute = ctx->compute};
    anneal_tensor *y = ctx->tp->reduce_out(ctx->tp->user, anneal_dense(x, d->weight, NULL, &o));
    return d->bias ? anneal_add(y, d->bias) : y;
}

/* The tensor-parallel layer (Megatron-LM): f before the column-parallel q/k/v and
 * gate/up, g after the row-parallel o_proj and down_proj. */
static anneal_tensor *block_forward_tp(const anneal_llama_block *b, anneal_tensor *x, anneal_kv_cache *kv) {
    const anneal_model *m = &b->model->base;
    const anneal_nn_ctx *ctx = &m->ctx;
    const anneal_nn_tp *tp = ctx->tp;
    if (!tp) {
        anneal_set_error(ANNEAL_ERR_STATE, "llama: a tensor-parallel model (tp_size %d) runs without its group (ctx.tp)",
                         m->cfg.tp_size);
        return NULL;
    }
    anneal_tensor *h = tp->copy_in(tp->user, anneal_nn_rms_norm_forward(&b->input_layernorm, x));
    anneal_tensor *att = kv ? anneal_nn_attention_core(&b->attn, ctx, h, kv, b->layer)
                         : m->cfg.recompute == ANNEAL_RECOMPUTE_ATTN ? anneal_checkpoint(attn_core, (void *)b, 1, &h)
                                                                     : attn_core((void *)b, &h);
    x = anneal_add(x, row_parallel(&b->attn.out, ctx, att));
    h = tp->copy_in(tp->user, anneal_nn_rms_norm_forward(&b->post_attention_layernorm, x));
    anneal_tensor *up = anneal_nn_dense_forward(&b->mlp.up, ctx, h);
    anneal_tensor *g = anneal_nn_dense_forward_act(&b->mlp.gate, ctx, h, ANNEAL_ACT_SILU_MUL, up);
    return anneal_add(x, row_parallel(&b->mlp.down, ctx, g));
}

/* y + the layer's bias (if any). */
static anneal_tensor *plus_bias(anneal_tensor *y, const anneal_nn_dense *d) { return d->bias ? anneal_add(y, d->bias) : y; }

/* ctx.tp's deterministic column-parallel projection of h through d (chunks: heads). */
static anneal_tensor *det_col(const anneal_nn_ctx *ctx, const anneal_nn_dense *d, anneal_tensor *h, int chunks) {
    return ctx->tp->det_col(ctx->tp->user, h, d->weight, d->bias, d->layout, 1, chunks, ctx->compute);
}

/* (B, T, H*D) as (B, H, T, D) heads. */
static anneal_tensor *as_heads(anneal_tensor *t, int64_t H, int64_t D) {
    if (!t) return NULL;
    return anneal_transpose(anneal_reshape(t, 4, (int64_t[]){t->shape[0], t->shape[1], H, D}), 1, 2);
}

/* The layer under --deterministic (ctx.deterministic, any tp_size): every projection
 * through ctx.tp's det_col / det_row, this rank's query heads (key/value heads; in the
 * MLP gcd(n_ff, n_head) parts) as the chunks (parallel's tp_det.c): one process and
 * every --tp layout, the same bits.
 * det_attn_core: q/k/v and attention (c = the block; ANNEAL_RECOMPUTE_ATTN's region). */
static anneal_tensor *det_attn_core(void *c, anneal_tensor *const *in) {
    const anneal_llama_block *b = c;
    const anneal_nn_ctx *ctx = &b->model->base.ctx;
    const anneal_nn_attention *at = &b->attn;
    int Hq = at->n_head, Hkv = at->n_kv_head;
    int64_t D = at->head_dim;
    anneal_attention_opts ao = {.causal = true, .compute = ctx->compute, .rope = at->has_rope ? &at->rope : NULL};
    anneal_tensor *o = anneal_attention_ex(as_heads(det_col(ctx, &at->q, in[0], Hq), Hq, D),
                                           as_heads(det_col(ctx, &at->k, in[0], Hkv), Hkv, D),
                                           as_heads(det_col(ctx, &at->v, in[0], Hkv), Hkv, D), &ao);
    return o ? anneal_reshape(anneal_transpose(o, 1, 2), 3, (int64_t[]){o->shape[0], o->shape[2], Hq * D}) : NULL;
}

/* The MLP's chunks on this rank: gcd(n_ff, n_head) canonical ones (the trainer checks
 * that --tp divides them). */
static int mlp_chunks(const anneal_model_config *c) {
    int a = c->n_ff, b = c->n_head;
    while (b) {
        int r = a % b;
        a = b;
        b = r;
    }
    return a / (c->tp_size > 1 ? c->tp_size : 1);
}

static anneal_tensor *block_forward_det(const anneal_llama_block *b, anneal_tensor *x) {
    const anneal_nn_ctx *ctx = &b->model->base.ctx;
    const anneal_nn_attention *at = &b->attn;
    int Hq = at->n_head, F = mlp_chunks(&b->model->base.cfg);
    anneal_tensor *h = anneal_nn_rms_norm_forward(&b->input_layernorm, x);
    anneal_tensor *o = b->model->base.cfg.recompute == ANNEAL_RECOMPUTE_ATTN
                           ? anneal_checkpoint(det_attn_core, (void *)b, 1, &h) : det_attn_core((void *)b, &h);
    o = ctx->tp->det_row(ctx->tp->user, o, at->out.weight, at->out.layout, Hq, ctx->compute);
    x = anneal_add(x, plus_bias(o, &at->out));
    h = anneal_nn_rms_norm_forward(&b->post_attention_layernorm, x);
    anneal_tensor *up = det_col(ctx, &b->mlp.up, h, F);
    h = anneal_mul(anneal_silu(det_col(ctx, &b->mlp.gate, h, F)), up);
    h = ctx->tp->det_row(ctx->tp->user, h, b->mlp.down.weight, b->mlp.down.layout, F, ctx->compute);
    return anneal_add(x, plus_bias(h, &b->mlp.down));
}

static anneal_tensor *block_forward(const anneal_llama_block *b, anneal_tensor *x, anneal_kv_cache *kv) {
    const anneal_model *m = &b->model->base;
    const anneal_nn_ctx *ctx = &m->ctx;
    if (!kv && ctx->deterministic && ctx->tp && ctx->tp->det_row) return block_forward_det(b, x);
    if (m->cfg.tp_size > 1) return block_forward_tp(b, x, kv);
    /* attention: RMSNorm -> q, k, v (+ RoPE) -> causal GQA attention -> o_proj -> residual */
    anneal_tensor *h = anneal_nn_rms_norm_forward(&b->input_layernorm, x);
    anneal_tensor *att = kv ? anneal_nn_attention_core(&b->attn, ctx, h, kv, b->layer)
                         : m->cfg.recompute == ANNEAL_RECOMPUTE_ATTN ? anneal_checkpoint(attn_core, (void *)b, 1, &h)
                                                                     : attn_core((void *)b, &h);
    x = anneal_add(x, anneal_nn_attention_out(&b->attn, ctx, att));
    /* MLP: RMSNorm -> down(silu(gate h) * up h) (the SiLU product in the gate GEMM) -> residual */
    h = anneal_nn_rms_norm_forward(&b->post_attention_layernorm, x);
    return anneal_add(x, anneal_nn_mlp_forward(&b->mlp, ctx, h));
}

/* One layer between the model's block hook calls (ZeRO-3 gathers its parameters). */
static anneal_tensor *hooked_block_run(const void *blk, anneal_tensor *x, anneal_kv_cache *kv) {
    const anneal_llama_block *b = blk;
    if (anneal_model_block_enter(&b->model->base, b->layer) != ANNEAL_OK) return NULL;
    return anneal_model_block_leave(&b->model->base, b->layer, block_forward(b, x, kv));
}

/* hooked_block_run in a scope of its own (block_scope.c). */
static anneal_tensor *hooked_block(const anneal_llama_block *b, anneal_tensor *x, anneal_kv_cache *kv) {
    return anneal_model_scoped_block(hooked_block_run, b, x, kv);
}

/* One training layer as a recompute region (ctx is the block). */
static anneal_tensor *block_region(void *ctx, anneal_tensor *const *in) { return hooked_block(ctx, in[0], NULL); }

/* Final hidden states (B, T, C) of ids (B, T): positions [0, T), or with a cache the
 * positions after the cached ones. */
static anneal_tensor *hidden(anneal_llama *m, anneal_tensor *ids, anneal_kv_cache *kv) {
    if (!m || !ids) return NULL;
    const anneal_model_config *cfg = &m->base.cfg;
    if (ids->ndim != 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "llama: ids must be (B, T), got %d dims", ids->ndim);
        return NULL;
    }
    int64_t T = ids->shape[1], pos0 = anneal_kv_cache_len(kv);
    if (pos0 + T > cfg->n_ctx) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "llama: sequence length %lld exceeds n_ctx (max_position_embeddings) %d",
                         (long long)(pos0 + T), cfg->n_ctx);
        return NULL;
    }
    const anneal_nn_tp *tp = m->base.ctx.tp;
    anneal_tensor *x = !vocab_parallel(cfg) ? anneal_nn_embedding_forward(&m->embed, ids) /* (B, T, C); positions are RoPE's */
                       : tp ? tp->vocab_embed(tp->user, m->embed.weight, ids, cfg->tp_rank * m->embed.weight->shape[0])
                            : NULL; /* the layer reports the missing group */
    for (int l = 0; l < cfg->n_layer; l++) {
        anneal_llama_block *b = &m->blocks[l];
        x = !kv && cfg->recompute == ANNEAL_RECOMPUTE_BLOCK ? anneal_checkpoint(block_region, b, 1, &x)
                                                            : hooked_block(b, x, kv);
    }
    return anneal_nn_rms_norm_forward(&m->norm, x);
}

/* The lm head's weight (vocab, C): the embedding when tied. */
static anneal_tensor *head_weight(const anneal_llama *m) {
    return m->lm_head.weight ? m->lm_head.weight : m->embed.weight;
}

/* logits = h @ W^T (B, T, vocab). */
static anneal_tensor *lm_head(anneal_llama *m, anneal_tensor *h) {
    if (vocab_parallel(&m->base.cfg)) { /* this rank's columns, then every rank's (inference) */
        const anneal_nn_tp *tp = m->base.ctx.tp;
        if (!h || !tp || !tp->vocab_gather) {
            if (h) anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "llama: the logits of a vocabulary-parallel model (--tp %d) "
                                    "need its group's gather (ctx.tp)", m->base.cfg.tp_size);
            return NULL;
        }
        anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m->base.ctx.compute};
        return tp->vocab_gather(tp->user, anneal_dense(h, head_weight(m), NULL, &o));
    }
    if (m->base.params->head) return anneal_nn_quant_head_forward(m->base.params, &m->base.ctx, h); /* int8 head */
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m->base.ctx.compute};
    return anneal_dense(h, head_weight(m), NULL, &o);
}

/* ------------------------------------------------------ the model interface */

static void op_free(anneal_model *m) { llama_free((anneal_llama *)m); }

static anneal_status op_init(anneal_model *m, uint64_t seed) { return llama_init((anneal_llama *)m, seed); }

static anneal_tensor *op_loss(anneal_model *mm, anneal_tensor *ids, anneal_tensor *targets) {
    /* lm head + cross-entropy fused in row chunks: no (B, T, V) logits are made */
    anneal_llama *m = (anneal_llama *)mm;
    anneal_tensor *h = hidden(m, ids, NULL);
    if (vocab_parallel(&mm->cfg) && h) {
        /* this rank's V/N columns of the logits, the softmax's sums over the group */
        const anneal_nn_tp *tp = mm->ctx.tp;
        anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = mm->ctx.compute};
        anneal_tensor *logits = anneal_dense(tp->copy_in(tp->user, h), head_weight(m), NULL, &o);
        return tp->vocab_loss(tp->user, logits, targets, mm->cfg.tp_rank * head_weight(m)->shape[0], -100);
    }
    if (mm->params->head) return anneal_nn_quant_head_loss(mm->params, &mm->ctx, h, targets, -100); /* int8 head */
    return anneal_linear_cross_entropy_ex(h, head_weight(m), targets, -100, mm->ctx.compute);
}

static anneal_tensor *op_logits(anneal_model *mm, anneal_tensor *ids) {
    anneal_llama *m = (anneal_llama *)mm;
    return lm_head(m, hidden(m, ids, NULL));
}

static anneal_kv_cache *op_kv_cache_new(anneal_model *m, int64_t batch, int64_t max_len) {
    const anneal_model_config *c = &m->cfg;
    int hkv = c->n_kv_head ? c->n_kv_head : c->n_head;
    if (c->tp_size > 1) hkv /= c->tp_size; /* this rank's heads */
    return anneal_kv_cache_new_dtype(m->device, c->n_layer, batch, hkv, c->n_embd / c->n_head, max_len,
                                     m->ctx.kv_dtype, m);
}

static anneal_tensor *op_forward_cached(anneal_model *mm, anneal_kv_cache *kv, anneal_tensor *ids, int64_t rows) {
    anneal_llama *m = (anneal_llama *)mm;
    anneal_tensor *h = hidden(m, ids, kv);
    if (h && rows < h->shape[1]) h = anneal_narrow(h, 1, h->shape[1] - rows, rows);
    return lm_head(m, h);
}

/* f32 contiguous CPU data of t, or NULL. */
static const float *f32_data(const anneal_tensor *t) {
    return t && t->dtype == ANNEAL_F32 && t->device == ANNEAL_CPU && anneal_is_contiguous(t) ? anneal_data(t) : NULL;
}

bool anneal_llama_decode_plan(anneal_model *mm, anneal_decode_plan *p) {
    anneal_llama *m = (anneal_llama *)mm;
    const anneal_model_config *c = &mm->cfg;
    if (c->tp_size > 1) return false; /* the decode engine runs whole models */
    int64_t C = c->n_embd;
    p->n_layer = c->n_layer;
    p->C = C;
    p->Hq = c->n_head;
    p->Hkv = c->n_kv_head ? c->n_kv_head : c->n_head;
    p->D = C / c->n_head;
    p->F = c->n_ff;
    p->V = c->vocab_size;
    p->eps = m->norm.eps;
    p->rms = true;
    p->tok_emb = f32_data(m->embed.weight);
    p->pos_emb = NULL;
    p->rope = &m->rope;
    p->nf_w = f32_data(m->norm.weight);
    p->nf_b = NULL;
    bool ok = p->tok_emb && p->nf_w;
    if (ok && m->lm_head.weight)
        ok = anneal_decode_dense(&m->lm_head, &p->head);
    else
        p->head = (anneal_gemv_weight){.w = p->tok_emb, .dtype = ANNEAL_F32, .out_in = true, .in = C, .out = p->V};
    for (int l = 0; l < c->n_layer && ok; l++) {
        const anneal_llama_block *b = &m->blocks[l];
        anneal_decode_block_plan *d = &p->blocks[l];
        memset(d, 0, sizeof *d);
        d->n1_w = f32_data(b->input_layernorm.weight);
        d->n2_w = f32_data(b->post_attention_layernorm.weight);
        ok = d->n1_w && d->n2_w && b->input_layernorm.eps == p->eps && b->post_attention_layernorm.eps == p->eps &&
             !b->attn.packed && b->attn.has_rope && anneal_decode_dense(&b->attn.q, &d->q) &&
             anneal_decode_dense(&b->attn.k, &d->k) && anneal_decode_dense(&b->attn.v, &d->v) &&
             anneal_decode_dense(&b->attn.out, &d->o) && anneal_decode_dense(&b->mlp.gate, &d->fc) &&
             anneal_decode_dense(&b->mlp.up, &d->up) && anneal_decode_dense(&b->mlp.down, &d->down);
    }
    return ok;
}

/* Training FLOPs per token: 6 per weight of every matrix product (q, k, v, o, gate,
 * up, down of each layer and the lm head; the embedding is a lookup unless it is the
 * tied head; norms and biases are negligible), plus attention's QK^T and AV over T
 * keys: 2 * 2 * T * Hq D forward per layer, times 3 with backward (12 L T Hq D; no
 * discount for the causal mask, as GPT-2's count). */
static double op_flops(const anneal_model *m, int64_t T) {
    const anneal_model_config *c = &m->cfg;
    double C = c->n_embd, D = (double)c->n_embd / c->n_head, Hq = c->n_head;
    double Hkv = c->n_kv_head ? c->n_kv_head : c->n_head, F = c->n_ff, V = c->vocab_size, L = c->n_layer;
    double per_layer = C * Hq * D + 2.0 * C * Hkv * D + Hq * D * C + 3.0 * C * F;
    return 6.0 * (L * per_layer + C * V) + 12.0 * L * (double)T * Hq * D;
}

/* Pipeline stage of blocks [first, last) (model.h's stage_forward): hidden()'s embedding,
 * blocks and final norm, and loss()'s fused head, split where the stage ends. */
static anneal_tensor *op_stage_forward(anneal_model *mm, int first, int last, anneal_tensor *in, anneal_tensor *targets) {
    anneal_llama *m = (anneal_llama *)mm;
    const anneal_model_config *cfg = &mm->cfg;
    anneal_tensor *x = in;
    if (first == 0) {
        if (in->ndim != 2 || in->shape[1] > cfg->n_ctx) {
            anneal_set_error(ANNEAL_ERR_SHAPE, "llama: stage ids must be (B, T <= n_ctx %d)", cfg->n_ctx);
            return NULL;
        }
        const anneal_nn_tp *tp = mm->ctx.tp; /* --tp with --pp: hidden()'s vocabulary-parallel lookup */
        x = !vocab_parallel(cfg) ? anneal_nn_embedding_forward(&m->embed, in)
            : tp ? tp->vocab_embed(tp->user, m->embed.weight, in, cfg->tp_rank * m->embed.weight->shape[0]) : NULL;
    }
    for (int l = first; l < last; l++)
        x = cfg->recompute == ANNEAL_RECOMPUTE_BLOCK ? anneal_checkpoint(block_region, &m->blocks[l], 1, &x)
                                                     : hooked_block(&m->blocks[l], x, NULL);
    if (last < cfg->n_layer) return x;
    anneal_tensor *h = anneal_nn_rms_norm_forward(&m->norm, x);
    if (!targets) return lm_head(m, h); /* no targets: the logits (the pipeline's samples) */
    if (vocab_parallel(cfg) && mm->ctx.tp) { /* --tp with --pp: as op_loss */
        const anneal_nn_tp *tp = mm->ctx.tp;
        anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = mm->ctx.compute};
        anneal_tensor *logits = anneal_dense(tp->copy_in(tp->user, h), head_weight(m), NULL, &o);
        return tp->vocab_loss(tp->user, logits, targets, cfg->tp_rank * head_weight(m)->shape[0], -100);
    }
    return anneal_linear_cross_entropy_ex(h, head_weight(m), targets, -100, mm->ctx.compute);
}

/* Where parameter i is used (model.h's param_span): embed_tokens by the embedding (and
 * the head when tied), model.layers.<l>.* by block l, model.norm and lm_head after. */
static void op_param_span(const anneal_model *mm, int i, int *first, int *last) {
    const anneal_llama *m = (const anneal_llama *)mm;
    const anneal_tensor *t = mm->params->items[i].tensor;
    int L = mm->cfg.n_layer, l = -1;
    if (t == m->embed.weight) *first = -1, *last = m->lm_head.weight ? -1 : L;
    else if (sscanf(mm->params->items[i].name, "model.layers.%d.", &l) == 1 && l >= 0 && l < L) *first = *last = l;
    else *first = *last = L;
}

static const anneal_model_ops llama_ops = {
    .free = op_free,
    .init = op_init,
    .loss = op_loss,
    .logits = op_logits,
    .kv_cache_new = op_kv_cache_new,
    .forward_cached = op_forward_cached,
    .flops_per_token = op_flops,
    .hf_import = anneal_llama_hf_import,
    .hf_export = anneal_llama_hf_export,
    .onnx_graph = anneal_llama_onnx_graph,
    .stage_forward = op_stage_forward,
    .param_span = op_param_span,
};

/* The model_types of the family: other types (gemma, phi, ...) are refused by the
 * registry with the list of these. */
static const char *const llama_hf_types[] = {"llama", "mistral", "qwen2", NULL};

const anneal_model_arch anneal_llama_arch = {
    .name = "llama",
    .hf_model_types = llama_hf_types,
    .hf_architecture = "LlamaForCausalLM", /* config_to_hf writes the model_type's own */
    .preset = llama_preset,
    .preset_names = llama_preset_names,
    .config_check = llama_config_check,
    .config_from_hf = anneal_llama_config_from_hf,
    .config_to_hf = anneal_llama_config_to_hf,
    .create = llama_create,
    .gguf = &anneal_llama_gguf,
};
