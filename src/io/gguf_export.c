/* Models to GGUF through the model interface: the architecture's hf_export puts its
 * Hugging Face tensors, its anneal_gguf_arch table renames and lays them out as
 * llama.cpp's convert_hf_to_gguf.py does, the config becomes the <arch>.* keys and the
 * tokenizer tokenizer.ggml.*. */
#include "gguf_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct export_ctx {
    const anneal_model *m;
    const anneal_gguf_arch *a;
    anneal_gguf_writer *w;
    anneal_ggml_type type;
} export_ctx;

/* The stored type of a tensor as the converter picks it: 1-D and the position
 * embedding F32; Q8_0 rows that are not whole blocks fall back to F16. */
static anneal_ggml_type pick_type(anneal_ggml_type want, const char *gguf_name, int ndim, int64_t row) {
    if (ndim <= 1 || !strcmp(gguf_name, "position_embd.weight")) return ANNEAL_GGML_F32;
    if (want == ANNEAL_GGML_Q8_0 && row % ANNEAL_GGUF_QK8_0) return ANNEAL_GGML_F16;
    return want;
}

/* The export sink: renames, lays out and stores one Hugging Face tensor (and GPT-2's
 * output copy of the embedding). */
static anneal_status export_put(void *ctx, const char *name, const anneal_tensor *t) {
    export_ctx *x = ctx;
    char gname[256];
    const anneal_gguf_name *e = anneal_gguf_map_name(x->a, name, true, gname, sizeof gname);
    if (!e)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "gguf: tensor %s of the %s model has no GGUF name", name,
                                x->a->name);
    int ndim = t->ndim;
    if (ndim < 1 || ndim > 2) return anneal_set_error(ANNEAL_ERR_SHAPE, "gguf: tensor %s has %d dimensions", name, ndim);
    int64_t shape[2] = {t->shape[0], ndim > 1 ? t->shape[1] : 1}, n = shape[0] * shape[1];
    float *src = malloc((size_t)(n ? n : 1) * sizeof *src), *dst = malloc((size_t)(n ? n : 1) * sizeof *dst);
    anneal_status r = src && dst ? anneal_to_f32_buffer(t, src) : anneal_set_error(ANNEAL_ERR_OOM, "gguf: out of memory");
    if (!r) r = anneal_gguf_relayout(e->layout, true, ndim, shape, anneal_gguf_layout_heads(e->layout, &x->m->cfg), src, dst, name);
    int64_t gshape[2] = {shape[0], shape[1]};
    if (e->layout == ANNEAL_GGUF_TRANSPOSED) gshape[0] = shape[1], gshape[1] = shape[0];
    anneal_ggml_type ty = pick_type(x->type, gname, ndim, ndim > 1 ? gshape[1] : gshape[0]);
    if (!r) r = anneal_gguf_put_tensor(x->w, gname, ndim, gshape, ty, dst);
    if (!r && x->a->output_copy && !strcmp(gname, "token_embd.weight"))
        r = anneal_gguf_put_tensor(x->w, "output.weight", ndim, gshape, ty, dst);
    free(src);
    free(dst);
    return r;
}

/* general.file_type of a weight type (llama_ftype: 0 f32, 1 f16, 7 q8_0, 32 bf16). */
static uint32_t file_type(anneal_ggml_type t) {
    switch (t) {
    case ANNEAL_GGML_F16: return 1;
    case ANNEAL_GGML_Q8_0: return 7;
    case ANNEAL_GGML_BF16: return 32;
    default: return 0;
    }
}

/* The <arch>.* hyperparameters of c. */
static anneal_status put_hparams(anneal_gguf_writer *w, const anneal_gguf_arch *a, const anneal_model_config *c) {
    char k[96];
    anneal_status r = ANNEAL_OK;
#define PUT_U32(key, v) (snprintf(k, sizeof k, "%s." key, a->name), r = r ? r : anneal_gguf_put_u32(w, k, (uint32_t)(v)))
#define PUT_F32(key, v) (snprintf(k, sizeof k, "%s." key, a->name), r = r ? r : anneal_gguf_put_f32(w, k, (float)(v)))
    int n_ff = c->n_ff ? c->n_ff : 4 * c->n_embd;
    if (a->rope) PUT_U32("vocab_size", c->vocab_size);
    PUT_U32("context_length", c->n_ctx);
    PUT_U32("embedding_length", c->n_embd);
    PUT_U32("block_count", c->n_layer);
    PUT_U32("feed_forward_length", n_ff);
    PUT_U32("attention.head_count", c->n_head);
    if (a->rope) {
        PUT_U32("attention.head_count_kv", c->n_kv_head ? c->n_kv_head : c->n_head);
        PUT_F32("rope.freq_base", c->rope.theta > 0 ? c->rope.theta : c->rope_theta);
        PUT_U32("rope.dimension_count", c->n_embd / c->n_head);
    }
    if (a->rms_norm) PUT_F32("attention.layer_norm_rms_epsilon", c->norm_eps);
    else PUT_F32("attention.layer_norm_epsilon", c->norm_eps);
    if (a->rope && c->rope.scaling == ANNEAL_ROPE_SCALING_LINEAR) {
        snprintf(k, sizeof k, "%s.rope.scaling.type", a->name);
        if (!r) r = anneal_gguf_put_str(w, k, "linear", 6);
        PUT_F32("rope.scaling.factor", c->rope.factor);
    }
#undef PUT_U32
#undef PUT_F32
    return r;
}

/* tokenizer.ggml.* of tok, its tokens padded to the model's vocabulary with "[PAD<i>]"
 * of type UNUSED as the converter does (llama.cpp takes n_vocab from the token list). */
static anneal_status put_tokenizer(anneal_gguf_writer *w, const anneal_tokenizer *tok, int32_t n_vocab) {
    anneal_tokenizer_gguf v;
    anneal_status r = anneal_tokenizer_to_gguf(tok, &v);
    if (r) return r;
    int32_t n = v.n_tokens > n_vocab ? v.n_tokens : n_vocab;
    const char **toks = malloc((size_t)n * sizeof *toks);
    size_t *len = malloc((size_t)n * sizeof *len);
    int32_t *types = malloc((size_t)n * sizeof *types);
    float *scores = malloc((size_t)n * sizeof *scores);
    char *pads = malloc((size_t)(n - v.n_tokens) * 24 + 1);
    if (!toks || !len || !types || !scores || !pads) r = anneal_set_error(ANNEAL_ERR_OOM, "gguf export: out of memory");
    for (int32_t i = 0; !r && i < n; i++) {
        scores[i] = v.scores && i < v.n_tokens ? v.scores[i] : -1e9f;
        if (i < v.n_tokens) {
            toks[i] = v.tokens[i], len[i] = v.token_len[i], types[i] = v.token_type[i];
            continue;
        }
        char *p = pads + (size_t)(i - v.n_tokens) * 24;
        len[i] = (size_t)snprintf(p, 24, "[PAD%d]", (int)i);
        toks[i] = p;
        types[i] = 5; /* UNUSED */
    }
    if (!r) r = anneal_gguf_put_str(w, "tokenizer.ggml.model", v.model, strlen(v.model));
    if (!r) r = anneal_gguf_put_str(w, "tokenizer.ggml.pre", v.pre, strlen(v.pre));
    if (!r) r = anneal_gguf_put_str_array(w, "tokenizer.ggml.tokens", n, toks, len);
    if (!r && v.scores) r = anneal_gguf_put_f32_array(w, "tokenizer.ggml.scores", n, scores);
    if (!r) r = anneal_gguf_put_i32_array(w, "tokenizer.ggml.token_type", n, types);
    free(scores);
    free(toks);
    free(len);
    free(types);
    free(pads);
    if (!r) r = anneal_gguf_put_str_array(w, "tokenizer.ggml.merges", v.n_merges, v.merges, v.merge_len);
    if (!r && v.bos >= 0) r = anneal_gguf_put_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)v.bos);
    if (!r && v.eos >= 0) r = anneal_gguf_put_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)v.eos);
    if (!r && v.unk >= 0) r = anneal_gguf_put_u32(w, "tokenizer.ggml.unknown_token_id", (uint32_t)v.unk);
    if (!r) r = anneal_gguf_put_bool(w, "tokenizer.ggml.add_bos_token", v.add_bos == 1);
    if (!r && v.chat_template)
        r = anneal_gguf_put_str(w, "tokenizer.chat_template", v.chat_template, strlen(v.chat_template));
    anneal_tokenizer_gguf_free(&v);
    return r;
}

anneal_status anneal_model_save_gguf(const anneal_model *m, const char *path, const anneal_gguf_save_opts *opts) {
    if (!m || !path) return anneal_set_error(ANNEAL_ERR_ARG, "gguf export: NULL argument");
    if (anneal_params_require_float(m->params, "gguf export") != ANNEAL_OK) return anneal_last_status();
    anneal_gguf_save_opts o = opts ? *opts : (anneal_gguf_save_opts){0};
    const anneal_gguf_arch *a = m->arch ? m->arch->gguf : NULL;
    if (!a)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "gguf export: the %s architecture has no GGUF table", m->cfg.arch);
    if (o.type != ANNEAL_GGML_F32 && o.type != ANNEAL_GGML_F16 && o.type != ANNEAL_GGML_BF16 && o.type != ANNEAL_GGML_Q8_0)
        return anneal_set_error(ANNEAL_ERR_ARG, "gguf export: tensor type %u is not written (f32, f16, bf16, q8_0)",
                                (unsigned)o.type);
    if (a->check) {
        anneal_status r = a->check(&m->cfg);
        if (r) return r;
    }
    if (o.tokenizer && anneal_tokenizer_vocab_size(o.tokenizer) > m->cfg.vocab_size)
        return anneal_set_error(ANNEAL_ERR_ARG, "gguf export: the tokenizer has %d ids, more than the model's %d",
                                anneal_tokenizer_vocab_size(o.tokenizer), m->cfg.vocab_size);
    anneal_gguf_writer *w = anneal_gguf_writer_new(0);
    if (!w) return anneal_last_status();
    char name[96];
    snprintf(name, sizeof name, "anneal %s", a->name);
    const char *nm = o.name ? o.name : name;
    anneal_status r = anneal_gguf_put_str(w, "general.architecture", a->name, strlen(a->name));
    if (!r) r = anneal_gguf_put_str(w, "general.name", nm, strlen(nm));
    if (!r) r = put_hparams(w, a, &m->cfg);
    if (!r) r = anneal_gguf_put_u32(w, "general.file_type", file_type(o.type));
    if (!r) r = anneal_gguf_put_u32(w, "general.quantization_version", 2);
    if (!r && o.tokenizer) r = put_tokenizer(w, o.tokenizer, m->cfg.vocab_size);
    export_ctx x = {m, a, w, o.type};
    anneal_tensor_sink sink = {.ctx = &x, .put = export_put};
    if (!r) r = anneal_model_hf_export(m, &sink);
    if (!r) r = anneal_gguf_writer_save(w, path);
    anneal_gguf_writer_free(w);
    return r;
}
