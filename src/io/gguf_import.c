/* Models from GGUF through the model interface: the keys become a config, and a tensor
 * source presents the file's tensors under their Hugging Face names (dequantized,
 * un-permuted, un-transposed) to the architecture's hf_import, which checks every name
 * and shape as it does for safetensors; the tokenizer comes from tokenizer.ggml.*. */
#include "gguf_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct src_entry {
    char hf[256];
    const anneal_gguf_tensor *t;
    anneal_gguf_layout layout;
} src_entry;

typedef struct import_ctx {
    const anneal_gguf *g;
    const anneal_model_config *cfg;
    src_entry *e;
    int n;
    const char **names;
} import_ctx;

/* The file's tensor shown under Hugging Face name `name`, or NULL. */
static const src_entry *find_entry(const import_ctx *x, const char *name) {
    for (int i = 0; i < x->n; i++)
        if (!strcmp(x->e[i].hf, name)) return &x->e[i];
    return NULL;
}

/* The HF shape of an entry: the file's dims reversed (numpy order), then un-transposed. */
static int entry_shape(const src_entry *e, int64_t *shape) {
    int nd = e->t->n_dims;
    for (int d = 0; d < nd; d++) shape[d] = e->t->ne[nd - 1 - d];
    if (e->layout == ANNEAL_GGUF_TRANSPOSED && nd == 2) {
        int64_t s = shape[0];
        shape[0] = shape[1];
        shape[1] = s;
    }
    return nd;
}

/* Tensor source info: the Hugging Face shape and the stored dtype (Q8_0 shows as f32). */
static bool src_info(void *ctx, const char *name, anneal_dtype *dtype, int *ndim, int64_t *shape) {
    const src_entry *e = find_entry(ctx, name);
    if (!e) return false;
    *dtype = e->t->type == ANNEAL_GGML_F16 ? ANNEAL_F16 : e->t->type == ANNEAL_GGML_BF16 ? ANNEAL_BF16 : ANNEAL_F32;
    *ndim = entry_shape(e, shape);
    return true;
}

/* Tensor source get: dequantized to f32, transposed or permuted back to the Hugging
 * Face layout, in the current scope (NULL + error on failure). */
static anneal_tensor *src_get(void *ctx, const char *name) {
    import_ctx *x = ctx;
    const src_entry *e = find_entry(x, name);
    if (!e) return NULL;
    int64_t shape[ANNEAL_GGUF_MAX_DIMS];
    int nd = entry_shape(e, shape);
    if (nd > 2) {
        anneal_set_error(ANNEAL_ERR_SHAPE, "%s: tensor %s has %d dimensions", x->g->path, e->t->cname, nd);
        return NULL;
    }
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= shape[d];
    float *raw = malloc((size_t)(n ? n : 1) * sizeof *raw);
    anneal_tensor *t = anneal_empty_on(ANNEAL_CPU, ANNEAL_F32, nd, shape);
    anneal_status r = raw && t ? anneal_gguf_tensor_to_f32(e->t, raw) : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", x->g->path);
    int64_t hshape[2] = {shape[0], nd > 1 ? shape[1] : 1};
    if (!r) r = anneal_gguf_relayout(e->layout, false, nd, hshape, anneal_gguf_layout_heads(e->layout, x->cfg), raw, anneal_data(t), e->t->cname);
    free(raw);
    return r ? NULL : t;
}

/* A required positive integer key <arch>.<key> (bounded so sizes stay in int). */
static anneal_status need_int(const anneal_gguf *g, const char *arch, const char *key, int64_t max, int *out) {
    char k[96];
    int64_t v;
    snprintf(k, sizeof k, "%s.%s", arch, key);
    if (!anneal_gguf_find_kv(g, k)) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata %s is missing", g->path, k);
    if (!anneal_gguf_get_int(g, k, &v) || v <= 0 || v > max)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata %s is not an integer in 1..%lld", g->path, k,
                                (long long)max);
    *out = (int)v;
    return ANNEAL_OK;
}

/* The config of a GGUF file of architecture a (anneal's arch `arch`). */
static anneal_status read_config(const anneal_gguf *g, const anneal_gguf_arch *a, const char *arch,
                                 anneal_model_config *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->arch, sizeof c->arch, "%s", arch);
    const char *an = a->name;
    anneal_status r = need_int(g, an, "block_count", 4096, &c->n_layer);
    if (!r) r = need_int(g, an, "context_length", 1 << 24, &c->n_ctx);
    if (!r) r = need_int(g, an, "embedding_length", 1 << 20, &c->n_embd);
    if (!r) r = need_int(g, an, "feed_forward_length", 1 << 22, &c->n_ff);
    if (!r) r = need_int(g, an, "attention.head_count", 1 << 12, &c->n_head);
    if (r) return r;
    char k[96];
    double eps;
    snprintf(k, sizeof k, "%s.attention.%s", an, a->rms_norm ? "layer_norm_rms_epsilon" : "layer_norm_epsilon");
    if (!anneal_gguf_get_float(g, k, &eps) || !(eps > 0 && eps < 1))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata %s is missing or not a float in (0, 1)", g->path, k);
    c->norm_eps = (float)eps;
    const anneal_gguf_tensor *emb = anneal_gguf_find_tensor(g, "token_embd.weight");
    if (!emb || emb->n_dims != 2 || emb->ne[1] <= 0 || emb->ne[1] > (1 << 24))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no 2-D token_embd.weight tensor to take the vocabulary size from",
                                g->path);
    c->vocab_size = (int)emb->ne[1];
    if (emb->ne[0] != c->n_embd)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token_embd.weight has rows of %lld, not embedding_length %d",
                                g->path, (long long)emb->ne[0], c->n_embd);
    /* every weight the model will have is in the file, at a byte or more each: so the
     * hyperparameters cannot make anneal allocate more than the file could hold */
    double weights = (double)c->vocab_size * c->n_embd +
                     (double)c->n_layer * (2.0 * c->n_embd * c->n_embd + 2.0 * c->n_embd * c->n_ff) +
                     (a->rope ? 0.0 : (double)c->n_ctx * c->n_embd);
    if (weights > (double)g->size)
        return anneal_set_error(ANNEAL_ERR_FORMAT,
                                "%s: the hyperparameters describe %.0f weights or more, more than the file's %llu bytes hold",
                                g->path, weights, (unsigned long long)g->size);
    if (!a->rope) {
        if (c->n_ff == 4 * c->n_embd) c->n_ff = 0;
        return ANNEAL_OK;
    }
    snprintf(c->hf_model_type, sizeof c->hf_model_type, "%s", an);
    int64_t v;
    snprintf(k, sizeof k, "%s.attention.head_count_kv", an);
    c->n_kv_head = c->n_head;
    if (anneal_gguf_find_kv(g, k) && (!anneal_gguf_get_int(g, k, &v) || v <= 0 || v > c->n_head))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata %s is not an integer in 1..%d", g->path, k, c->n_head);
    if (anneal_gguf_find_kv(g, k)) c->n_kv_head = (int)v;
    snprintf(k, sizeof k, "%s.rope.dimension_count", an);
    if (anneal_gguf_get_int(g, k, &v) && v != c->n_embd / c->n_head)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: %s %lld differs from the head size %d (anneal rotates whole heads)",
                                g->path, k, (long long)v, c->n_embd / c->n_head);
    double theta = 10000.0;
    snprintf(k, sizeof k, "%s.rope.freq_base", an);
    if (anneal_gguf_find_kv(g, k) && (!anneal_gguf_get_float(g, k, &theta) || !(theta > 0)))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata %s is not a positive float", g->path, k);
    c->rope_theta = c->rope.theta = (float)theta;
    anneal_gguf_str st;
    snprintf(k, sizeof k, "%s.rope.scaling.type", an);
    if (anneal_gguf_get_str(g, k, &st) && !(st.n == 4 && !memcmp(st.s, "none", 4))) {
        double f;
        char fk[96];
        snprintf(fk, sizeof fk, "%s.rope.scaling.factor", an);
        if (!(st.n == 6 && !memcmp(st.s, "linear", 6)))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: rope scaling \"%.*s\" is not read (none and linear are)",
                                    g->path, (int)(st.n > 32 ? 32 : st.n), st.s);
        if (!anneal_gguf_get_float(g, fk, &f) || !(f > 0))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is missing or not positive", g->path, fk);
        c->rope.scaling = ANNEAL_ROPE_SCALING_LINEAR;
        c->rope.factor = (float)f;
    }
    c->tie_embeddings = !anneal_gguf_find_tensor(g, "output.weight");
    c->qkv_bias = anneal_gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
    c->out_bias = anneal_gguf_find_tensor(g, "blk.0.attn_output.bias") != NULL;
    return ANNEAL_OK;
}

/* Copies a GGUF string into a NUL-terminated malloc'd one. */
static char *gguf_strdup(anneal_gguf_str s) {
    char *p = malloc(s.n + 1);
    if (p) {
        memcpy(p, s.s, s.n);
        p[s.n] = '\0';
    }
    return p;
}

/* The tokenizer of tokenizer.ggml.* (*out NULL when there is no tokenizer.ggml.model). */
static anneal_status read_tokenizer(const anneal_gguf *g, anneal_tokenizer **out) {
    *out = NULL;
    anneal_gguf_str model, pre = {0};
    if (!anneal_gguf_get_str(g, "tokenizer.ggml.model", &model)) return ANNEAL_OK;
    const anneal_gguf_kv *tk = anneal_gguf_find_kv(g, "tokenizer.ggml.tokens");
    const anneal_gguf_kv *ty = anneal_gguf_find_kv(g, "tokenizer.ggml.token_type");
    const anneal_gguf_kv *mg = anneal_gguf_find_kv(g, "tokenizer.ggml.merges");
    if (!tk || tk->type != ANNEAL_GGUF_ARRAY || tk->arr_type != ANNEAL_GGUF_STRING || tk->arr_n == 0 ||
        tk->arr_n > (1u << 24))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokenizer.ggml.tokens is missing or not an array of strings",
                                g->path);
    if (ty && (ty->type != ANNEAL_GGUF_ARRAY || ty->arr_type != ANNEAL_GGUF_INT32 || ty->arr_n != tk->arr_n))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokenizer.ggml.token_type is not an int32 array of %llu", g->path,
                                (unsigned long long)tk->arr_n);
    if (mg && (mg->type != ANNEAL_GGUF_ARRAY || mg->arr_type != ANNEAL_GGUF_STRING || mg->arr_n > (1u << 24)))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokenizer.ggml.merges is not an array of strings", g->path);
    int32_t n = (int32_t)tk->arr_n, nm = mg ? (int32_t)mg->arr_n : 0;
    const char **toks = malloc((size_t)n * sizeof *toks), **merges = malloc((size_t)(nm ? nm : 1) * sizeof *merges);
    size_t *tl = malloc((size_t)n * sizeof *tl), *ml = malloc((size_t)(nm ? nm : 1) * sizeof *ml);
    int32_t *types = malloc((size_t)n * sizeof *types);
    char *model_s = gguf_strdup(model), *pre_s = NULL, *tmpl = NULL;
    anneal_gguf_str s;
    if (anneal_gguf_get_str(g, "tokenizer.ggml.pre", &pre)) pre_s = gguf_strdup(pre);
    if (anneal_gguf_get_str(g, "tokenizer.chat_template", &s)) tmpl = gguf_strdup(s);
    anneal_status r = toks && merges && tl && ml && types && model_s ? ANNEAL_OK
                                                                    : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", g->path);
    for (int32_t i = 0; !r && i < n; i++) {
        anneal_gguf_str t = anneal_gguf_array_str(tk, (uint64_t)i);
        toks[i] = t.s;
        tl[i] = (size_t)t.n;
        types[i] = 1;
        if (ty) memcpy(&types[i], ty->val + 4 * (size_t)i, 4);
    }
    for (int32_t i = 0; !r && i < nm; i++) {
        anneal_gguf_str t = anneal_gguf_array_str(mg, (uint64_t)i);
        merges[i] = t.s;
        ml[i] = (size_t)t.n;
    }
    int64_t bos = -1, eos = -1, unk = -1;
    if (!anneal_gguf_get_int(g, "tokenizer.ggml.unknown_token_id", &unk)) unk = -1;
    bool add_bos = false;
    bool has_add = anneal_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos);
    if (!anneal_gguf_get_int(g, "tokenizer.ggml.bos_token_id", &bos)) bos = -1;
    if (!anneal_gguf_get_int(g, "tokenizer.ggml.eos_token_id", &eos)) eos = -1;
    anneal_tokenizer_gguf v = {.model = model_s, .pre = pre_s, .n_tokens = n, .tokens = toks, .token_len = tl,
                               .token_type = types, .n_merges = nm, .merges = merges, .merge_len = ml,
                               .bos = bos >= 0 && bos < n ? (int32_t)bos : -1, .eos = eos >= 0 && eos < n ? (int32_t)eos : -1,
                               .unk = unk >= 0 && unk < n ? (int32_t)unk : -1,
                               .add_bos = has_add ? add_bos : -1, .chat_template = tmpl};
    if (!r) r = anneal_tokenizer_from_gguf(&v, g->path, out);
    free(toks);
    free(merges);
    free(tl);
    free(ml);
    free(types);
    free(model_s);
    free(pre_s);
    free(tmpl);
    return r;
}

anneal_status anneal_model_load_gguf(const char *path, anneal_device dev, anneal_model **out, anneal_tokenizer **tok) {
    if (out) *out = NULL;
    if (tok) *tok = NULL;
    if (!path || !out) return anneal_set_error(ANNEAL_ERR_ARG, "gguf import: NULL argument");
    anneal_gguf *g = NULL;
    anneal_status r = anneal_gguf_open(path, &g);
    if (r) return r;
    anneal_gguf_str an;
    const anneal_model_arch *arch = NULL;
    if (!anneal_gguf_get_str(g, "general.architecture", &an)) {
        r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: metadata general.architecture is missing", path);
    } else {
        int na;
        const anneal_model_arch *const *all = anneal_model_archs(&na);
        char known[256] = "";
        for (int i = 0; i < na; i++) {
            if (!all[i]->gguf) continue;
            if (strlen(all[i]->gguf->name) == an.n && !memcmp(all[i]->gguf->name, an.s, an.n)) arch = all[i];
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", known[0] ? ", " : "", all[i]->gguf->name);
        }
        if (!arch)
            r = anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: architecture \"%.*s\" is not one anneal reads from GGUF (%s)",
                                 path, (int)(an.n > 64 ? 64 : an.n), an.s, known);
    }
    anneal_model_config cfg;
    if (!r) r = read_config(g, arch->gguf, arch->name, &cfg);
    if (!r) r = anneal_model_config_check(&cfg);
    import_ctx x = {.g = g, .cfg = &cfg};
    if (!r) {
        x.e = calloc((size_t)(g->n_tensors ? g->n_tensors : 1), sizeof *x.e);
        x.names = calloc((size_t)(g->n_tensors ? g->n_tensors : 1) + 1, sizeof *x.names);
        if (!x.e || !x.names) r = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    for (int64_t i = 0; !r && i < g->n_tensors; i++) {
        src_entry *e = &x.e[x.n];
        const anneal_gguf_name *m = anneal_gguf_map_name(arch->gguf, g->tensors[i].cname, false, e->hf, sizeof e->hf);
        if (!m) snprintf(e->hf, sizeof e->hf, "%s", g->tensors[i].cname); /* hf_import names it as unknown */
        e->t = &g->tensors[i];
        e->layout = m ? m->layout : ANNEAL_GGUF_SAME;
        if (e->layout == ANNEAL_GGUF_TRANSPOSED && e->t->n_dims != 2)
            r = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tensor %s is not 2-D", path, e->t->cname);
        x.names[x.n++] = e->hf;
    }
    anneal_model *m = NULL;
    if (!r && !(m = anneal_model_new(&cfg, dev))) r = anneal_last_status();
    if (!r) {
        anneal_tensor_source src = {.ctx = &x, .what = path, .info = src_info, .get = src_get, .n = x.n, .names = x.names};
        anneal_scope *sc = anneal_scope_open();
        r = anneal_model_hf_import(m, &src);
        anneal_scope_close(sc);
    }
    if (!r && tok) r = read_tokenizer(g, tok);
    free(x.e);
    free(x.names);
    anneal_gguf_close(g);
    if (r) {
        anneal_model_free(m);
        if (tok) anneal_tokenizer_free(*tok), *tok = NULL;
        return r;
    }
    *out = m;
    return ANNEAL_OK;
}

anneal_status anneal_gguf_load_tokenizer(const char *path, anneal_tokenizer **tok) {
    if (tok) *tok = NULL;
    if (!path || !tok) return anneal_set_error(ANNEAL_ERR_ARG, "gguf tokenizer: NULL argument");
    anneal_gguf *g = NULL;
    anneal_status r = anneal_gguf_open(path, &g);
    if (!r) r = read_tokenizer(g, tok);
    anneal_gguf_close(g);
    return r;
}
