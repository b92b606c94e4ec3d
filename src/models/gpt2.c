/* GPT-2, written with the public op API and read top to bottom: embeddings, N
 * pre-LN blocks (attention then MLP, each added to the residual stream), final
 * LayerNorm, lm head tied to the token embedding. Parameter names and layouts are
 * Hugging Face's, so weights load and save without renaming or transposing. */
#include "anneal/autograd.h"
#include "anneal/models.h"
#include "anneal/ops.h"
#include "gpt2_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool anneal_gpt2_preset(const char *name, anneal_gpt2_config *out) {
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
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(name, presets[i].name) && (!presets[i].alias || strcmp(name, presets[i].alias)))
            continue;
        *out = (anneal_gpt2_config){.n_layer = presets[i].L, .n_head = presets[i].H,
                                    .n_embd = presets[i].C, .vocab_size = presets[i].V,
                                    .n_ctx = presets[i].ctx, .dropout = 0.0f, .ln_eps = 1e-5f};
        return true;
    }
    return false;
}

bool anneal_recompute_parse(const char *s, anneal_recompute_mode *out) {
    static const struct {
        const char *name;
        anneal_recompute_mode mode;
    } names[] = {{"none", ANNEAL_RECOMPUTE_NONE}, {"off", ANNEAL_RECOMPUTE_NONE},
                 {"attn", ANNEAL_RECOMPUTE_ATTN}, {"block", ANNEAL_RECOMPUTE_BLOCK},
                 {"on", ANNEAL_RECOMPUTE_BLOCK}};
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].mode;
            return true;
        }
    return false;
}

const char *anneal_recompute_name(anneal_recompute_mode m) {
    switch (m) {
    case ANNEAL_RECOMPUTE_NONE: return "none";
    case ANNEAL_RECOMPUTE_BLOCK: return "block";
    case ANNEAL_RECOMPUTE_ATTN: return "attn";
    }
    return "?";
}

anneal_status anneal_gpt2_config_check(const anneal_gpt2_config *c) {
    if (!c) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: NULL config");
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
    if (!(c->ln_eps > 0.0f))
        return anneal_set_error(ANNEAL_ERR_ARG, "gpt2: ln_eps must be positive");
    return ANNEAL_OK;
}

/* Registers "transformer.<suffix>" with the given shape. */
static anneal_tensor *param(anneal_gpt2 *m, const char *suffix, int ndim, int64_t d0, int64_t d1,
                            bool decay) {
    char name[128];
    snprintf(name, sizeof name, "transformer.%s", suffix);
    int64_t shape[2] = {d0, d1};
    return anneal_params_create(m->params, name, ndim, shape, decay);
}

anneal_gpt2 *anneal_gpt2_new(const anneal_gpt2_config *cfg) {
    if (anneal_gpt2_config_check(cfg) != ANNEAL_OK) return NULL;
    anneal_gpt2 *m = calloc(1, sizeof *m);
    if (!m || !(m->blocks = calloc((size_t)cfg->n_layer, sizeof *m->blocks)) ||
        !(m->params = anneal_params_new())) {
        if (m) free(m->blocks);
        free(m);
        anneal_set_error(ANNEAL_ERR_OOM, "gpt2: out of memory");
        return NULL;
    }
    m->cfg = *cfg;
    int64_t C = cfg->n_embd;
    bool ok = true;
    ok &= (m->wte = param(m, "wte.weight", 2, cfg->vocab_size, C, false)) != NULL;
    ok &= (m->wpe = param(m, "wpe.weight", 2, cfg->n_ctx, C, false)) != NULL;
    for (int l = 0; l < cfg->n_layer && ok; l++) {
        anneal_gpt2_block *b = &m->blocks[l];
        b->model = m;
        char s[96];
#define P(field, suffix, nd, d0, d1, decay)                                   \
        snprintf(s, sizeof s, "h.%d.%s", l, suffix);                          \
        ok &= (b->field = param(m, s, nd, d0, d1, decay)) != NULL;
        P(ln_1_w, "ln_1.weight", 1, C, 0, false)
        P(ln_1_b, "ln_1.bias", 1, C, 0, false)
        P(c_attn_w, "attn.c_attn.weight", 2, C, 3 * C, true)
        P(c_attn_b, "attn.c_attn.bias", 1, 3 * C, 0, false)
        P(attn_proj_w, "attn.c_proj.weight", 2, C, C, true)
        P(attn_proj_b, "attn.c_proj.bias", 1, C, 0, false)
        P(ln_2_w, "ln_2.weight", 1, C, 0, false)
        P(ln_2_b, "ln_2.bias", 1, C, 0, false)
        P(c_fc_w, "mlp.c_fc.weight", 2, C, 4 * C, true)
        P(c_fc_b, "mlp.c_fc.bias", 1, 4 * C, 0, false)
        P(mlp_proj_w, "mlp.c_proj.weight", 2, 4 * C, C, true)
        P(mlp_proj_b, "mlp.c_proj.bias", 1, C, 0, false)
#undef P
    }
    ok &= (m->ln_f_w = param(m, "ln_f.weight", 1, C, 0, false)) != NULL;
    ok &= (m->ln_f_b = param(m, "ln_f.bias", 1, C, 0, false)) != NULL;
    if (!ok) {
        anneal_gpt2_free(m);
        return NULL;
    }
    return m;
}

void anneal_gpt2_free(anneal_gpt2 *m) {
    if (!m) return;
    anneal_params_free(m->params);
    free(m->blocks);
    free(m);
}

anneal_status anneal_gpt2_init(anneal_gpt2 *m, uint64_t seed) {
    if (!m) return anneal_set_error(ANNEAL_ERR_ARG, "gpt2_init: NULL model");
    anneal_manual_seed(seed);
    float std = 0.02f, proj_std = 0.02f / sqrtf(2.0f * (float)m->cfg.n_layer);
    anneal_status s = anneal_init_normal_(m->wte, 0.0f, std);
    if (s == ANNEAL_OK) s = anneal_init_normal_(m->wpe, 0.0f, std);
    for (int l = 0; l < m->cfg.n_layer && s == ANNEAL_OK; l++) {
        anneal_gpt2_block *b = &m->blocks[l];
        /* biases are already zero */
        anneal_tensor *ones[2] = {b->ln_1_w, b->ln_2_w};
        for (int i = 0; i < 2 && s == ANNEAL_OK; i++) s = anneal_init_fill_(ones[i], 1.0f);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->c_attn_w, 0.0f, std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->attn_proj_w, 0.0f, proj_std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->c_fc_w, 0.0f, std);
        if (s == ANNEAL_OK) s = anneal_init_normal_(b->mlp_proj_w, 0.0f, proj_std);
    }
    if (s == ANNEAL_OK) s = anneal_init_fill_(m->ln_f_w, 1.0f);
    return s;
}

/* conv1d (w (in, out)) at the model's compute precision, with an optional GELU. */
static anneal_tensor *conv1d(const anneal_gpt2 *m, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b, bool gelu) {
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_IN_OUT, .act = gelu ? ANNEAL_ACT_GELU_TANH : ANNEAL_ACT_NONE,
                           .compute = m->compute};
    return anneal_dense(x, w, b, &o);
}

/* qkv GEMM + causal attention of one block (ctx): in[0] = ln_1 output (B,T,C) ->
 * (B,T,C). Also the recompute region of ANNEAL_RECOMPUTE_ATTN. */
static anneal_tensor *attn_forward(void *ctx, anneal_tensor *const *in) {
    const anneal_gpt2_block *b = ctx;
    anneal_tensor *qkv = conv1d(b->model, in[0], b->c_attn_w, b->c_attn_b, false); /* (B,T,3C) */
    int H = b->model->cfg.n_head;
    return anneal_attention_packed(qkv, H, H, &(anneal_attention_opts){.causal = true, .compute = b->model->compute});
}

/* The attention part of block b on h (B,T,C): in a recompute region in attn mode, so
 * backward replays it instead of keeping qkv and the attention's saved tensors. */
static anneal_tensor *gpt2_attention(const anneal_gpt2_block *b, anneal_tensor *h) {
    if (b->model->cfg.recompute == ANNEAL_RECOMPUTE_ATTN)
        return anneal_checkpoint(attn_forward, (void *)b, 1, &h);
    return attn_forward((void *)b, &h);
}

anneal_tensor *anneal_gpt2_block_apply(const anneal_gpt2_block *b, int layer, anneal_tensor *x,
                                       anneal_gpt2_attend_fn attend, void *ctx) {
    const anneal_gpt2_config *cfg = &b->model->cfg;
    float p = cfg->dropout;
    bool train = b->model->training;
    /* attention: LN -> qkv (B,T,3C) -> causal attention (B,T,C) -> proj -> dropout -> residual */
    anneal_tensor *h = anneal_layer_norm(x, b->ln_1_w, b->ln_1_b, cfg->ln_eps);
    const anneal_gpt2 *m = b->model;
    anneal_tensor *att = attend ? attend(ctx, layer, conv1d(m, h, b->c_attn_w, b->c_attn_b, false))
                                : gpt2_attention(b, h);
    anneal_tensor *a = anneal_dropout(conv1d(m, att, b->attn_proj_w, b->attn_proj_b, false), p, train);
    /* residual add + ln_2 in one pass: s = x + a (the residual stream), h = LN(s) */
    anneal_tensor *s;
    h = anneal_add_layer_norm(x, a, b->ln_2_w, b->ln_2_b, cfg->ln_eps, &s);
    /* MLP: fc + GELU(tanh) fused (B,T,4C) -> proj (B,T,C) -> dropout -> residual */
    anneal_tensor *f = conv1d(m, h, b->c_fc_w, b->c_fc_b, true);
    anneal_tensor *o = anneal_dropout(conv1d(m, f, b->mlp_proj_w, b->mlp_proj_b, false), p, train);
    return anneal_add(s, o);
}

/* One training block as a recompute region (ctx is the block). x: (B, T, C). */
static anneal_tensor *block_forward(void *ctx, anneal_tensor *const *in) {
    const anneal_gpt2_block *b = ctx;
    return anneal_gpt2_block_apply(b, (int)(b - b->model->blocks), in[0], NULL, NULL);
}

anneal_tensor *anneal_gpt2_hidden(anneal_gpt2 *m, anneal_tensor *ids) {
    if (!m || !ids) return NULL;
    if (ids->ndim != 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "gpt2: ids must be (B, T), got %d dims", ids->ndim);
        return NULL;
    }
    int64_t T = ids->shape[1];
    if (T > m->cfg.n_ctx) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "gpt2: sequence length %lld exceeds n_ctx %d",
                         (long long)T, m->cfg.n_ctx);
        return NULL;
    }
    /* token + position embeddings: (B, T, C) + (T, C) */
    anneal_tensor *pos = anneal_arange(ids->device, 0, T);
    anneal_tensor *x = anneal_add(anneal_embedding(ids, m->wte), anneal_embedding(pos, m->wpe));
    x = anneal_dropout(x, m->cfg.dropout, m->training);
    for (int l = 0; l < m->cfg.n_layer; l++) {
        anneal_gpt2_block *b = &m->blocks[l];
        x = m->cfg.recompute == ANNEAL_RECOMPUTE_BLOCK ? anneal_checkpoint(block_forward, b, 1, &x)
                                                       : block_forward(b, &x);
    }
    return anneal_layer_norm(x, m->ln_f_w, m->ln_f_b, m->cfg.ln_eps);
}

anneal_tensor *anneal_gpt2_forward(anneal_gpt2 *m, anneal_tensor *ids) {
    /* lm head tied to wte (V, C): logits = h @ wte^T */
    anneal_dense_opts o = {.layout = ANNEAL_WEIGHT_OUT_IN, .compute = m ? m->compute : ANNEAL_F32};
    return anneal_dense(anneal_gpt2_hidden(m, ids), m ? m->wte : NULL, NULL, &o);
}

anneal_tensor *anneal_gpt2_loss(anneal_gpt2 *m, anneal_tensor *ids, anneal_tensor *targets) {
    /* lm head + cross-entropy fused in row chunks: no (B, T, V) logits are made */
    return anneal_linear_cross_entropy_ex(anneal_gpt2_hidden(m, ids), m ? m->wte : NULL, targets, -100,
                                          m ? m->compute : ANNEAL_F32);
}

int64_t anneal_gpt2_num_params(const anneal_gpt2 *m) { return m ? anneal_params_numel(m->params) : 0; }

double anneal_gpt2_flops_per_token(const anneal_gpt2 *m, int64_t T) {
    const anneal_gpt2_config *c = &m->cfg;
    return 6.0 * (double)anneal_gpt2_num_params(m) + 12.0 * c->n_layer * (double)T * c->n_embd;
}
