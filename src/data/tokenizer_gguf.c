/* Tokenizers to and from GGUF's tokenizer.ggml.* vocabulary, as llama.cpp's converter
 * writes it. Byte-level BPE (model "gpt2"): tokens in id order as byte-level strings
 * (added tokens as their text, CONTROL when special, USER_DEFINED otherwise), merges as
 * "left right" in rank order, bos/eos ids. SentencePiece-style BPE (model "llama"):
 * pieces as they are, "<0xNN>" tokens of type BYTE, the unknown token UNKNOWN, scores
 * that make llama.cpp's score-driven merging pick anneal's merge order (-rank of the
 * merge that makes a token), and the merges as well, which the import reads (a
 * tokenizer.json of Llama 2's shape is made from them and read by the Hugging Face
 * loader, so both kinds of files behave as their tokenizer.json would). */
#include "pretokenize.h"
#include "tokenizer_impl.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define META "\xE2\x96\x81" /* U+2581, the metaspace */

typedef struct owned {
    char **tokens, **merges;
    size_t *token_len, *merge_len;
    int32_t *types;
    float *scores;
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
        free(o->scores);
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

/* Byte-level pre-tokenizers llama.cpp knows by name (tokenizer.ggml.pre) besides GPT-2's:
 * the Hugging Face Split regex each stands for, and whether llama.cpp then takes a
 * piece that is a token as that token (tokenizers' ignore_merges). */
static const struct {
    const char *pre, *regex;
    bool ignore_merges;
} known_pre[] = {
    {"llama-bpe",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     true},
};

/* The known_pre entry whose regex anneal translates to `pattern` (-1 if none). */
static int find_pre(const char *pattern) {
    for (int i = 0; pattern && i < (int)(sizeof known_pre / sizeof *known_pre); i++) {
        const char *why = NULL;
        char *pat = anneal_hf_regex_to_pcre(known_pre[i].regex, &why);
        bool same = pat && !strcmp(pat, pattern);
        free(pat);
        if (same) return i;
    }
    return -1;
}

/* The GGUF token type of id in a SentencePiece-style tokenizer. */
static int32_t sp_type(const anneal_tokenizer *t, int32_t id) {
    bool special = false;
    if (is_added(t, id, &special)) return special ? (id == t->sp.unk ? 2 : 3) : 4;
    if (id == t->sp.unk) return 2;
    for (int b = 0; b < 256; b++)
        if (t->sp.byte_tok[b] == id) return 6;
    return 1;
}

anneal_status anneal_tokenizer_to_gguf(const anneal_tokenizer *t, anneal_tokenizer_gguf *out) {
    if (!t || !out) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer to gguf: NULL argument");
    memset(out, 0, sizeof *out);
    bool sp = t->kind == TOK_SENTENCEPIECE;
    if (sp && !(t->sp.norm_prepend && t->sp.norm_replace && !t->sp.meta && !t->sp.norm_nfc && !t->pattern &&
                !t->ignore_merges))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "tokenizer to gguf: a SentencePiece-style tokenizer other than Llama 2's shape "
                                "(normalizer Prepend + Replace, no Metaspace pre-tokenizer) is not written as GGUF yet");
    int pre = sp ? -1 : find_pre(t->pattern);
    if (!sp && (t->pre_none || t->add_prefix_space || t->sp.norm_nfc || (t->pattern && pre < 0) ||
                (!t->pattern && t->ignore_merges)))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "tokenizer to gguf: a byte-level tokenizer with a pre-tokenizer other than GPT-2's and "
                                "Llama 3's (Qwen2, NFC, add_prefix_space) is not written as GGUF yet");
    if (pre >= 0 && t->ignore_merges != known_pre[pre].ignore_merges)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "tokenizer to gguf: llama.cpp's \"%s\" pre-tokenizer %s merges for pieces that are tokens "
                                "and this tokenizer %s (its tokenizer.json's ignore_merges): llama.cpp would encode "
                                "differently",
                                known_pre[pre].pre, known_pre[pre].ignore_merges ? "ignores" : "keeps",
                                t->ignore_merges ? "ignores them" : "does not");
    owned *o = calloc(1, sizeof *o);
    if (!o) return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer to gguf: out of memory");
    out->owned = o;
    int32_t n = t->n_vocab;
    o->tokens = calloc((size_t)n, sizeof *o->tokens);
    o->token_len = calloc((size_t)n, sizeof *o->token_len);
    o->types = calloc((size_t)n, sizeof *o->types);
    o->scores = sp ? calloc((size_t)n, sizeof *o->scores) : NULL;
    o->merges = calloc((size_t)(t->n_merges ? t->n_merges : 1), sizeof *o->merges);
    o->merge_len = calloc((size_t)(t->n_merges ? t->n_merges : 1), sizeof *o->merge_len);
    if (!o->tokens || !o->token_len || !o->types || (sp && !o->scores) || !o->merges || !o->merge_len) goto oom;
    o->n_tokens = n;
    for (int32_t i = 0; i < n; i++) {
        size_t len;
        const char *b = tok_bytes(t, i, &len);
        bool special = false;
        bool added = is_added(t, i, &special);
        o->tokens[i] = malloc(2 * len + 1);
        if (!o->tokens[i]) goto oom;
        if (added || sp) {
            memcpy(o->tokens[i], b, len);
            o->token_len[i] = len;
            o->types[i] = sp ? sp_type(t, i) : special ? 3 : 4;
        } else {
            o->token_len[i] = anneal_bpe_bytes_to_str(b, len, o->tokens[i]);
            o->types[i] = 1;
        }
        o->tokens[i][o->token_len[i]] = '\0';
        if (sp) o->scores[i] = -1e9f; /* made by no merge */
    }
    o->n_merges = t->n_merges;
    for (int32_t r = 0; r < t->n_merges; r++) {
        size_t ll, rl;
        const char *l = tok_bytes(t, t->merges[r].left, &ll), *rb = tok_bytes(t, t->merges[r].right, &rl);
        char *m = malloc(2 * (ll + rl) + 2);
        if (!m) goto oom;
        size_t a = sp ? (memcpy(m, l, ll), ll) : anneal_bpe_bytes_to_str(l, ll, m);
        m[a] = ' ';
        size_t bl = sp ? (memcpy(m + a + 1, rb, rl), rl) : anneal_bpe_bytes_to_str(rb, rl, m + a + 1);
        m[a + 1 + bl] = '\0';
        o->merges[r] = m;
        o->merge_len[r] = a + 1 + bl;
        if (sp && o->scores[t->merges[r].merged] == -1e9f) o->scores[t->merges[r].merged] = -(float)r;
    }
    out->model = sp ? "llama" : "gpt2";
    out->pre = sp ? "default" : pre >= 0 ? known_pre[pre].pre : "gpt-2";
    out->n_tokens = n;
    out->tokens = (const char *const *)o->tokens;
    out->token_len = o->token_len;
    out->token_type = o->types;
    out->scores = o->scores;
    out->n_merges = o->n_merges;
    out->merges = (const char *const *)o->merges;
    out->merge_len = o->merge_len;
    out->bos = t->bos >= 0 ? t->bos : -1;
    out->eos = t->eos >= 0 ? t->eos : t->eot;
    out->unk = sp ? t->sp.unk : -1;
    out->add_bos = t->add_bos ? 1 : 0;
    out->chat_template = t->chat_template;
    return ANNEAL_OK;
oom:
    anneal_tokenizer_gguf_free(out);
    return anneal_set_error(ANNEAL_ERR_OOM, "tokenizer to gguf: out of memory");
}

/* A JSON string of s[0..n) (cJSON copies it). */
static cJSON *jstr(const char *s, size_t n) {
    char *c = malloc(n + 1);
    if (!c) return NULL;
    memcpy(c, s, n);
    c[n] = '\0';
    cJSON *j = cJSON_CreateString(c);
    free(c);
    return j;
}

/* Writes text to dir/name. */
static anneal_status put_file(const char *dir, const char *name, const char *text, const char *what) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    size_t n = strlen(text);
    bool ok = f && fwrite(text, 1, n, f) == n;
    if (f && fclose(f)) ok = false;
    return ok ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_IO, "%s: cannot write a temporary %s", what, p);
}

/* The "llama" vocabulary: a tokenizer.json + tokenizer_config.json of Llama 2's shape
 * in a private temporary directory, read by anneal_tokenizer_load_hf, then removed. */
static anneal_status sp_from_gguf(const anneal_tokenizer_gguf *v, int32_t n_tok, const char *what,
                                  anneal_tokenizer **out) {
    if (!v->merges || v->n_merges <= 0)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: a \"llama\" (SentencePiece) vocabulary without tokenizer.ggml.merges (scores only) "
                                "is not read yet",
                                what);
    cJSON *root = cJSON_CreateObject(), *model = cJSON_CreateObject(), *vocab = cJSON_CreateObject(),
          *merges = cJSON_CreateArray(), *added = cJSON_CreateArray(), *cfg = cJSON_CreateObject();
    anneal_status s = root && model && vocab && merges && added && cfg ? ANNEAL_OK
                                                                       : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
    bool byte_fallback = false;
    for (int32_t i = 0; !s && i < n_tok; i++) {
        int32_t ty = v->token_type ? v->token_type[i] : 1;
        cJSON *key = jstr(v->tokens[i], v->token_len[i]);
        if (!key) {
            s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
            break;
        }
        if (cJSON_GetObjectItemCaseSensitive(vocab, key->valuestring))
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token %d \"%.60s\" appears twice", what, (int)i, key->valuestring);
        else
            cJSON_AddNumberToObject(vocab, key->valuestring, i);
        byte_fallback |= ty == 6;
        if (ty == 2 || ty == 3 || ty == 4) {
            cJSON *a = cJSON_CreateObject();
            cJSON_AddNumberToObject(a, "id", i);
            cJSON_AddStringToObject(a, "content", key->valuestring);
            cJSON_AddBoolToObject(a, "single_word", 0);
            cJSON_AddBoolToObject(a, "lstrip", 0);
            cJSON_AddBoolToObject(a, "rstrip", 0);
            cJSON_AddBoolToObject(a, "normalized", ty == 4);
            cJSON_AddBoolToObject(a, "special", ty != 4);
            cJSON_AddItemToArray(added, a);
        }
        cJSON_Delete(key);
    }
    for (int32_t r = 0; !s && r < v->n_merges; r++) cJSON_AddItemToArray(merges, jstr(v->merges[r], v->merge_len[r]));
    char dir[] = "/tmp/anneal_gguf_tok_XXXXXX";
    char *json = NULL, *cjson = NULL;
    bool made = false;
    if (!s) {
        cJSON_AddStringToObject(model, "type", "BPE");
        if (v->unk >= 0 && v->unk < n_tok) cJSON_AddItemToObject(model, "unk_token", jstr(v->tokens[v->unk], v->token_len[v->unk]));
        cJSON_AddBoolToObject(model, "fuse_unk", 1);
        cJSON_AddBoolToObject(model, "byte_fallback", byte_fallback);
        cJSON_AddItemToObject(model, "vocab", vocab);
        cJSON_AddItemToObject(model, "merges", merges);
        vocab = merges = NULL;
        cJSON_AddItemToObject(root, "added_tokens", added);
        added = NULL;
        cJSON *norm = cJSON_Parse("{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":\"" META
                                  "\"},{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"" META "\"}]}");
        cJSON *dec = cJSON_Parse("{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"" META
                                 "\"},\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\","
                                 "\"content\":\" \",\"start\":1,\"stop\":0}]}");
        cJSON_AddItemToObject(root, "normalizer", norm);
        cJSON_AddNullToObject(root, "pre_tokenizer");
        cJSON_AddItemToObject(root, "decoder", dec);
        cJSON_AddItemToObject(root, "model", model);
        model = NULL;
        if (v->bos >= 0) cJSON_AddItemToObject(cfg, "bos_token", jstr(v->tokens[v->bos], v->token_len[v->bos]));
        if (v->eos >= 0) cJSON_AddItemToObject(cfg, "eos_token", jstr(v->tokens[v->eos], v->token_len[v->eos]));
        cJSON_AddBoolToObject(cfg, "add_bos_token", v->add_bos != 0); /* llama.cpp's default for "llama": true */
        cJSON_AddBoolToObject(cfg, "add_eos_token", 0);
        if (v->chat_template) cJSON_AddStringToObject(cfg, "chat_template", v->chat_template);
        json = cJSON_PrintUnformatted(root);
        cjson = cJSON_PrintUnformatted(cfg);
        if (!json || !cjson || !norm || !dec) s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
    }
    if (!s && !(made = mkdtemp(dir) != NULL)) s = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot make a temporary directory", what);
    if (!s) s = put_file(dir, "tokenizer.json", json, what);
    if (!s) s = put_file(dir, "tokenizer_config.json", cjson, what);
    if (!s) {
        char p[64];
        snprintf(p, sizeof p, "%s/tokenizer.json", dir);
        s = anneal_tokenizer_load_hf(p, out);
        if (s) anneal_set_error(s, "%s: its SentencePiece vocabulary: %s", what, anneal_last_error());
    }
    if (made) {
        char p[64];
        snprintf(p, sizeof p, "%s/tokenizer.json", dir);
        unlink(p);
        snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
        unlink(p);
        rmdir(dir);
    }
    if (*out) { /* what was read from the temporary directory is not a file to copy back */
        free((*out)->hf_dir);
        (*out)->hf_dir = NULL;
    }
    free(json);
    free(cjson);
    cJSON_Delete(root);
    cJSON_Delete(model);
    cJSON_Delete(vocab);
    cJSON_Delete(merges);
    cJSON_Delete(added);
    cJSON_Delete(cfg);
    return s;
}

anneal_status anneal_tokenizer_from_gguf(const anneal_tokenizer_gguf *v, const char *what, anneal_tokenizer **out) {
    if (out) *out = NULL;
    if (!v || !out || !what) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer from gguf: NULL argument");
    bool sp = v->model && !strcmp(v->model, "llama");
    if (!v->model || (strcmp(v->model, "gpt2") && !sp))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: tokenizer.ggml.model \"%s\" is not read yet (anneal reads \"gpt2\", byte-level BPE, "
                                "and \"llama\", SentencePiece-style BPE)",
                                what, v->model ? v->model : "(none)");
    int pre = -1;
    for (int i = 0; !sp && v->pre && i < (int)(sizeof known_pre / sizeof *known_pre); i++)
        if (!strcmp(v->pre, known_pre[i].pre)) pre = i;
    if (!sp && v->pre && strcmp(v->pre, "gpt-2") && pre < 0)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "%s: tokenizer.ggml.pre \"%s\" is not read yet (anneal reads \"gpt-2\" and \"llama-bpe\")", what,
                                v->pre);
    if (v->n_tokens <= 0 || !v->tokens || !v->token_len)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokenizer.ggml.tokens is missing or empty", what);
    /* the converter pads the vocabulary to the model's with UNUSED "[PAD<i>]" tokens: not anneal's */
    int32_t n_tok = v->n_tokens;
    while (n_tok > 0 && v->token_type && v->token_type[n_tok - 1] == 5 && v->token_len[n_tok - 1] > 5 &&
           !memcmp(v->tokens[n_tok - 1], "[PAD", 4))
        n_tok--;
    if (sp) return sp_from_gguf(v, n_tok, what, out);
    size_t maxlen = 0;
    for (int32_t i = 0; i < n_tok; i++) maxlen = v->token_len[i] > maxlen ? v->token_len[i] : maxlen;
    for (int32_t r = 0; r < v->n_merges; r++) maxlen = v->merge_len[r] > maxlen ? v->merge_len[r] : maxlen;
    char *scratch = malloc(maxlen + 1);
    int32_t *special = malloc((size_t)(n_tok ? n_tok : 1) * sizeof *special);
    anneal_tokenizer *t = anneal_tok_new();
    anneal_status s = scratch && special && t ? ANNEAL_OK : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
    int n_special = 0, n_user = 0;
    for (int32_t i = 0; !s && i < n_tok; i++) {
        int32_t ty = v->token_type ? v->token_type[i] : 1;
        const char *b = v->tokens[i];
        size_t bl = v->token_len[i];
        if (ty == 3 || ty == 4) {
            if (ty == 3) special[n_special++] = i;
            n_user += ty == 4;
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
    if (!s && pre >= 0) {
        const char *why = NULL;
        t->ignore_merges = known_pre[pre].ignore_merges;
        if (!(t->pattern = anneal_hf_regex_to_pcre(known_pre[pre].regex, &why)))
            s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
    }
    /* USER_DEFINED tokens are added tokens that are not special (matched in any text, as
     * tokenizers does): then every added token is listed, specials flagged */
    if (!s && n_user) {
        t->added = calloc((size_t)(n_special + n_user), sizeof *t->added);
        if (!t->added) s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
        for (int32_t i = 0; !s && i < n_tok; i++) {
            int32_t ty = v->token_type[i];
            if (ty != 3 && ty != 4) continue;
            tok_added *a = &t->added[t->n_added];
            a->id = i;
            a->special = ty == 3;
            if (!(a->norm = malloc(v->token_len[i] ? v->token_len[i] : 1))) {
                s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", what);
                break;
            }
            memcpy(a->norm, v->tokens[i], v->token_len[i]);
            a->norm_len = v->token_len[i];
            t->n_added++;
        }
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
