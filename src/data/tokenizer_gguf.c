/* Tokenizers to and from GGUF's tokenizer.ggml.* vocabulary, as llama.cpp's converter
 * writes it for byte-level BPE (model "gpt2"): tokens in id order as byte-level
 * strings (added tokens as their text, CONTROL when special, USER_DEFINED otherwise),
 * merges as "left right" in rank order, bos/eos ids. */
#include "tokenizer_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct owned {
    char **tokens, **merges;
    size_t *token_len, *merge_len;
    int32_t *types;
    int32_t n_tokens, n_merges;
} owned;

void anneal_tokenizer_gguf_free(anneal_tokenizer_gguf *v) {
    if (!v) return;
    owned *o = v->owned;
    if (o) {
        for (int32_t i = 0; o->tokens && i < o->n_tokens; i++) free(o->tokens[i]);
        for (int32_t i = 0; o->merges && i < o->n_merges; i++) free(o->merges[i]);
        free(o->tokens);
        free(o->merges);
        free(o->token_len);
        free(o->merge_len);
        free(o->types);
        free(o);
    }
    memset(v, 0, sizeof *v);
}

/* True when id is one of tok's added tokens (set *special to its flag). */
static bool is_added(const anneal_tokenizer *t, int32_t id, bool *special) {
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].id == id) {
            *special = t->added[i].special;
            return true;
        }
    if (t->is_special && t->is_special[id]) {
        *special = true;
        return true;
    }
    return false;
}

anneal_status anneal_tokenizer_to_gguf(const anneal_tokenizer *t, anneal_tokenizer_gguf *out) {
    if (!t || !out) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer to gguf: NULL argument");
    memset(out, 0, sizeof *out);
    if (t->kind != TOK_BYTE_LEVEL)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "tokenizer to gguf: SentencePiece-style tokenizers are not written as GGUF yet "
                                "(byte-level BPE with GPT-2's pre-tokenizer is)");
    if (t->pattern || t->pre_none || t->add_prefix_space || t->ignore_merges || t->sp.norm_nfc)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "tokenizer to gguf: a byte-level tokenizer with a pre-tokenizer other than GPT-2's "
                                "(Llama 3, Qwen2) is not written as GGUF yet");
    owned *o = calloc(1, sizeof *o);
    if (!o) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer to gguf: out of memory");
    out->owned = o;
    int32_t n = t->n_vocab;
    o->tokens = calloc((size_t)n, sizeof *o->tokens);
    o->token_len = calloc((size_t)n, sizeof *o->token_len);
    o->types = calloc((size_t)n, sizeof *o->types);
    o->merges = calloc((size_t)(t->n_merges ? t->n_merges : 1), sizeof *o->merges);
    o->merge_len = calloc((size_t)(t->n_merges ? t->n_merges : 1), sizeof *o->merge_len);
    if (!o->tokens || !o->token_len || !o->types || !o->merges || !o->merge_len) goto oom;
    o->n_tokens = n;
    for (int32_t i = 0; i < n; i++) {
        size_t len;
        const char *b = tok_bytes(t, i, &len);
        bool special = false;
        bool added = is_added(t, i, &special);
        o->tokens[i] = malloc(2 * len + 1);
        if (!o->tokens[i]) goto oom;
        if (added) {
            memcpy(o->tokens[i], b, len);
            o->token_len[i] = len;
            o->types[i] = special ? 3 : 4;
        } else {
            o->token_len[i] = anneal_bpe_bytes_to_str(b, len, o->tokens[i]);
            o->types[i] = 1;
        }
        o->tokens[i][o->token_len[i]] = '\0';
    }
    o->n_merges = t->n_merges;
    for (int32_t r = 0; r < t->n_merges; r++) {
        size_t ll, rl;
        const char *l = tok_bytes(t, t->merges[r].left, &ll), *rb = tok_bytes(t, t->merges[r].right, &rl);
        char *m = malloc(2 * (ll + rl) + 2);
        if (!m) goto oom;
        size_t a = anneal_bpe_bytes_to_str(l, ll, m);
        m[a] = ' ';
        size_t bl = anneal_bpe_bytes_to_str(rb, rl, m + a + 1);
        m[a + 1 + bl] = '\0';
        o->merges[r] = m;
        o->merge_len[r] = a + 1 + bl;
    }
    out->model = "gpt2";
    out->pre = "gpt-2";
    out->n_tokens = n;
    out->tokens = (const char *const *)o->tokens;
    out->token_len = o->token_len;
    out->token_type = o->types;
    out->n_merges = o->n_merges;
    out->merges = (const char *const *)o->merges;
    out->merge_len = o->merge_len;
    out->bos = t->bos >= 0 ? t->bos : -1;
    out->eos = t->eos >= 0 ? t->eos : t->eot;
    out->add_bos = t->add_bos ? 1 : 0;
    out->chat_template = t->chat_template;
    return ANNEAL_OK;
oom:
    anneal_tokenizer_gguf_free(out);
    return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer to gguf: out of memory");
}

anneal_status anneal_tokenizer_from_gguf(const anneal_tokenizer_gguf *v, const char *what, anneal_tokenizer **out) {
    if (out) *out = NULL;
    if (!v || !out || !what) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer from gguf: NULL argument");
    if (!v->model || strcmp(v->model, "gpt2"))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: tokenizer.ggml.model \"%s\" is not read yet (anneal reads \"gpt2\", byte-level BPE)",
                                what, v->model ? v->model : "(none)");
    if (v->pre && strcmp(v->pre, "gpt-2"))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: tokenizer.ggml.pre \"%s\" is not read yet (anneal reads GPT-2's, \"gpt-2\")", what,
                                v->pre);
    if (v->n_tokens <= 0 || !v->tokens || !v->token_len)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokenizer.ggml.tokens is missing or empty", what);
    /* the converter pads the vocabulary to the model's with UNUSED "[PAD<i>]" tokens: not anneal's */
    int32_t n_tok = v->n_tokens;
    while (n_tok > 0 && v->token_type && v->token_type[n_tok - 1] == 5 && v->token_len[n_tok - 1] > 5 &&
           !memcmp(v->tokens[n_tok - 1], "[PAD", 4))
        n_tok--;
    size_t maxlen = 0;
    for (int32_t i = 0; i < n_tok; i++) maxlen = v->token_len[i] > maxlen ? v->token_len[i] : maxlen;
    for (int32_t r = 0; r < v->n_merges; r++) maxlen = v->merge_len[r] > maxlen ? v->merge_len[r] : maxlen;
    char *scratch = malloc(maxlen + 1);
    int32_t *special = malloc((size_t)(n_tok ? n_tok : 1) * sizeof *special);
    anneal_tokenizer *t = anneal_tok_new();
    anneal_status s = scratch && special && t ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
    int n_special = 0;
    for (int32_t i = 0; !s && i < n_tok; i++) {
        int32_t ty = v->token_type ? v->token_type[i] : 1;
        const char *b = v->tokens[i];
        size_t bl = v->token_len[i];
        if (ty == 3 || ty == 4) {
            special[n_special++] = i;
        } else if (!anneal_bpe_str_to_bytes(v->tokens[i], v->token_len[i], scratch, &bl)) {
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token %d \"%.*s\" is not a byte-level string", what, (int)i,
                                 (int)(v->token_len[i] > 60 ? 60 : v->token_len[i]), v->tokens[i]);
            break;
        } else {
            b = scratch;
        }
        int32_t dup = -1;
        s = anneal_tok_add_token(t, b, bl, &dup);
        if (s && dup >= 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokens %d and %d have the same bytes", what, (int)dup, (int)i);
    }
    for (int32_t r = 0; !s && r < v->n_merges; r++) {
        const char *m = v->merges[r];
        size_t ml = v->merge_len[r];
        const char *sp = memchr(m, ' ', ml);
        int32_t ids[2] = {-1, -1};
        const char *part[2] = {m, sp ? sp + 1 : NULL};
        size_t plen[2] = {sp ? (size_t)(sp - m) : 0, sp ? ml - (size_t)(sp - m) - 1 : 0};
        if (!sp || !plen[0] || !plen[1] || memchr(sp + 1, ' ', plen[1])) {
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: merge %d \"%.*s\" is not two tokens separated by one space",
                                 what, (int)r, (int)(ml > 60 ? 60 : ml), m);
            break;
        }
        for (int k = 0; k < 2 && !s; k++) {
            size_t bl;
            if (!anneal_bpe_str_to_bytes(part[k], plen[k], scratch, &bl) || (ids[k] = anneal_tok_lookup(t, scratch, bl)) < 0)
                s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: merge %d: \"%.*s\" is not a token", what, (int)r,
                                     (int)(plen[k] > 60 ? 60 : plen[k]), part[k]);
        }
        int32_t merged;
        int why = 0;
        if (!s && anneal_tok_add_merge(t, ids[0], ids[1], &merged, &why))
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: merge %d \"%.*s\" %s", what, (int)r, (int)(ml > 60 ? 60 : ml), m,
                                 why == 1 ? "makes a token that is not in the vocabulary" : "repeats an earlier merge");
    }
    if (!s) {
        t->kind = TOK_BYTE_LEVEL;
        t->eos = v->eos >= 0 && v->eos < n_tok ? v->eos : -1;
        s = anneal_tok_finish(t, special, n_special, what);
    }
    if (!s) {
        t->bos = v->bos >= 0 && v->bos < n_tok ? v->bos : -1;
        t->add_bos = v->add_bos == 1;
        if (v->chat_template && !(t->chat_template = strdup(v->chat_template)))
            s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
    }
    free(scratch);
    free(special);
    if (s) {
        anneal_tokenizer_free(t);
        return s;
    }
    *out = t;
    return ANNEAL_OK;
}
