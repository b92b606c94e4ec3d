/* Loading a Hugging Face tokenizer.json (+ tokenizer_config.json beside it): the BPE
 * model (byte-level or SentencePiece-style with byte fallback), normalizer,
 * pre-tokenizer, decoder, post-processor and added tokens. What anneal cannot run
 * exactly is refused by name (ANNEAL_ERR_UNSUPPORTED); what is malformed is
 * ANNEAL_ERR_FORMAT naming the file and the entry. */
#include "tokenizer_impl.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#define META "\xE2\x96\x81" /* U+2581 '▁' */

/* The "type" string of a JSON object, or NULL. */
static const char *json_type(const cJSON *o) {
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
    return cJSON_IsString(ty) ? ty->valuestring : NULL;
}

static const cJSON *get(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

static bool is_null(const cJSON *v) { return !v || cJSON_IsNull(v); }

/* A JSON string field, or NULL. */
static const char *get_str(const cJSON *o, const char *k) {
    const cJSON *v = get(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* Reads a JSON number that must be an id: an integer in [0, INT32_MAX). -1 if not. */
static int64_t json_id(const cJSON *v) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d < (double)INT32_MAX) || d != (double)(int64_t)d) return -1;
    return (int64_t)d;
}

static const char *key_or(const char *s) { return s ? s : "?"; }

/* What the pipeline around the model says, gathered before the vocabulary is read. */
typedef struct hf_shape {
    bool byte_level;       /* a ByteLevel pre-tokenizer */
    bool byte_level_regex; /* ... with use_regex (GPT-2's pattern) */
    const char *split;     /* a Split pre-tokenizer's regex (Oniguruma syntax), or NULL */
    bool split_literal;    /* the Split pattern is a String, not a Regex */
    bool dec_byte_fallback;/* decoder turns "<0xNN>" into bytes */
    bool dec_replace;      /* decoder turns ▁ into spaces */
} hf_shape;

/* normalizer: null, or Prepend("▁") / Replace(" ", "▁"), alone or in a Sequence. */
static anneal_status parse_normalizer(const char *path, const cJSON *n, anneal_tokenizer *t) {
    if (is_null(n)) return ANNEAL_OK;
    const char *ty = json_type(n);
    if (ty && strcmp(ty, "Sequence") == 0) {
        const cJSON *seq = get(n, "normalizers");
        if (!cJSON_IsArray(seq))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: normalizer Sequence without a \"normalizers\" array", path);
        for (const cJSON *it = seq->child; it; it = it->next) {
            anneal_status s = parse_normalizer(path, it, t);
            if (s) return s;
        }
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "NFC") == 0) {
        t->sp.norm_nfc = true;
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "Prepend") == 0) {
        const char *p = get_str(n, "prepend");
        if (!p || strcmp(p, META) != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: normalizer Prepend(\"%s\") is not supported (only \"▁\")",
                                    path, key_or(p));
        t->sp.norm_prepend = true;
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "Replace") == 0) {
        const cJSON *pat = get(n, "pattern");
        const char *from = get_str(pat, "String"), *to = get_str(n, "content");
        if (!from || !to || strcmp(from, " ") != 0 || strcmp(to, META) != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: normalizer Replace is supported only as Replace(\" \", \"▁\")", path);
        t->sp.norm_replace = true;
        return ANNEAL_OK;
    }
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                            "%s: normalizer \"%s\" is not supported (anneal supports none, NFC, and Prepend(\"▁\") "
                            "and Replace(\" \", \"▁\") as Llama 2 uses)",
                            path, ty ? ty : "(no type)");
}

/* One pre-tokenizer step (see parse_pre_tokenizer). */
static anneal_status parse_pre_step(const char *path, const cJSON *p, anneal_tokenizer *t, hf_shape *sh) {
    const char *ty = json_type(p);
    if (ty && strcmp(ty, "ByteLevel") == 0) {
        if (sh->byte_level)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: two ByteLevel pre-tokenizers", path);
        sh->byte_level = true;
        const cJSON *re = get(p, "use_regex");
        sh->byte_level_regex = !cJSON_IsFalse(re);
        t->add_prefix_space = cJSON_IsTrue(get(p, "add_prefix_space"));
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "Split") == 0) {
        if (sh->split || sh->byte_level)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: a Split pre-tokenizer is supported once, before ByteLevel", path);
        const cJSON *pat = get(p, "pattern");
        const char *re = get_str(pat, "Regex"), *lit = get_str(pat, "String");
        const char *beh = get_str(p, "behavior");
        if (!re && !lit)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: Split pre-tokenizer without a Regex or String pattern", path);
        if (!beh || strcmp(beh, "Isolated") != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: Split pre-tokenizer behavior \"%s\" is not supported (only Isolated)", path,
                                    key_or(beh));
        if (cJSON_IsTrue(get(p, "invert")))
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: Split pre-tokenizer with invert true is not supported",
                                    path);
        sh->split = re ? re : lit;
        sh->split_literal = !re;
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "Metaspace") == 0) {
        const char *rep = get_str(p, "replacement");
        if (!rep || strcmp(rep, META) != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: Metaspace replacement \"%s\" is not supported (only \"▁\")",
                                    path, key_or(rep));
        const char *scheme = get_str(p, "prepend_scheme");
        const cJSON *aps = get(p, "add_prefix_space");
        t->sp.meta = true;
        if (scheme && strcmp(scheme, "always") == 0) t->sp.meta_prepend = 1;
        else if (scheme && strcmp(scheme, "first") == 0) t->sp.meta_prepend = 2;
        else if (scheme && strcmp(scheme, "never") == 0) t->sp.meta_prepend = 0;
        else if (scheme)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: Metaspace prepend_scheme \"%s\" is not supported", path,
                                    scheme);
        else t->sp.meta_prepend = 1;
        if (cJSON_IsFalse(aps)) t->sp.meta_prepend = 0; /* tokenizers <= 0.15: add_prefix_space gates it */
        t->sp.meta_split = !cJSON_IsFalse(get(p, "split"));
        return ANNEAL_OK;
    }
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                            "%s: pre_tokenizer \"%s\" is not supported (anneal supports ByteLevel, "
                            "Sequence[Split(Regex), ByteLevel] and Metaspace)",
                            path, ty ? ty : "(no type)");
}

/* pre_tokenizer: ByteLevel, Split + ByteLevel, Metaspace (alone or in a Sequence). */
static anneal_status parse_pre_tokenizer(const char *path, const cJSON *p, anneal_tokenizer *t, hf_shape *sh) {
    if (is_null(p)) return ANNEAL_OK;
    const char *ty = json_type(p);
    if (ty && strcmp(ty, "Sequence") == 0) {
        const cJSON *seq = get(p, "pretokenizers");
        if (!cJSON_IsArray(seq))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: pre_tokenizer Sequence without a \"pretokenizers\" array",
                                    path);
        for (const cJSON *it = seq->child; it; it = it->next) {
            anneal_status s = parse_pre_step(path, it, t, sh);
            if (s) return s;
        }
        return ANNEAL_OK;
    }
    return parse_pre_step(path, p, t, sh);
}

/* decoder: ByteLevel; or Replace("▁", " "), ByteFallback, Fuse, Strip(" ", n, 0),
 * Metaspace (SentencePiece-style), alone or in a Sequence. */
static anneal_status parse_decoder(const char *path, const cJSON *d, anneal_tokenizer *t, hf_shape *sh) {
    if (is_null(d)) return ANNEAL_OK;
    const char *ty = json_type(d);
    if (ty && strcmp(ty, "Sequence") == 0) {
        const cJSON *seq = get(d, "decoders");
        if (!cJSON_IsArray(seq))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: decoder Sequence without a \"decoders\" array", path);
        for (const cJSON *it = seq->child; it; it = it->next) {
            anneal_status s = parse_decoder(path, it, t, sh);
            if (s) return s;
        }
        return ANNEAL_OK;
    }
    if (ty && (strcmp(ty, "ByteLevel") == 0 || strcmp(ty, "Fuse") == 0)) return ANNEAL_OK;
    if (ty && strcmp(ty, "ByteFallback") == 0) {
        sh->dec_byte_fallback = true;
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "Replace") == 0) {
        const char *from = get_str(get(d, "pattern"), "String"), *to = get_str(d, "content");
        if (!from || !to || strcmp(from, META) != 0 || strcmp(to, " ") != 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: decoder Replace is supported only as Replace(\"▁\", \" \")", path);
        sh->dec_replace = true;
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "Strip") == 0) {
        const char *c = get_str(d, "content");
        const cJSON *start = get(d, "start"), *stop = get(d, "stop");
        if (!c || strcmp(c, " ") != 0 || !cJSON_IsNumber(start) || !cJSON_IsNumber(stop) || stop->valuedouble != 0 ||
            start->valuedouble > 1 || start->valuedouble < 0)
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                    "%s: decoder Strip is supported only as Strip(\" \", start 0 or 1, stop 0)", path);
        t->dec_strip_space = start->valuedouble == 1;
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "Metaspace") == 0) {
        sh->dec_replace = true;
        const char *scheme = get_str(d, "prepend_scheme");
        t->dec_strip_space = !cJSON_IsFalse(get(d, "add_prefix_space")) && !(scheme && strcmp(scheme, "never") == 0);
        return ANNEAL_OK;
    }
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: decoder \"%s\" is not supported", path, ty ? ty : "(no type)");
}

/* The SpecialToken ids of a TemplateProcessing "single" template, before and after the
 * sequence (as token strings; NULL if none). */
static anneal_status parse_template(const char *path, const cJSON *pp, const char **first, const char **last) {
    const cJSON *single = get(pp, "single");
    if (!cJSON_IsArray(single))
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: TemplateProcessing without a \"single\" array", path);
    bool seen_seq = false;
    int i = 0;
    for (const cJSON *it = single->child; it; it = it->next, i++) {
        const cJSON *sp = get(it, "SpecialToken"), *sq = get(it, "Sequence");
        if (sq) {
            seen_seq = true;
        } else if (sp && get_str(sp, "id")) {
            if (!seen_seq && !*first) *first = get_str(sp, "id");
            else if (seen_seq) *last = get_str(sp, "id");
            else
                return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                        "%s: TemplateProcessing with two special tokens before the text", path);
        } else {
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: post_processor single[%d] is neither a SpecialToken nor a "
                                    "Sequence", path, i);
        }
    }
    return ANNEAL_OK;
}

/* post_processor: null, ByteLevel, TemplateProcessing (BOS / EOS), or a Sequence. */
static anneal_status parse_post(const char *path, const cJSON *pp, const char **bos, const char **eos) {
    if (is_null(pp)) return ANNEAL_OK;
    const char *ty = json_type(pp);
    if (ty && strcmp(ty, "Sequence") == 0) {
        const cJSON *seq = get(pp, "processors");
        if (!cJSON_IsArray(seq))
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: post_processor Sequence without a \"processors\" array", path);
        for (const cJSON *it = seq->child; it; it = it->next) {
            anneal_status s = parse_post(path, it, bos, eos);
            if (s) return s;
        }
        return ANNEAL_OK;
    }
    if (ty && strcmp(ty, "ByteLevel") == 0) return ANNEAL_OK;
    if (ty && strcmp(ty, "TemplateProcessing") == 0) return parse_template(path, pp, bos, eos);
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: post_processor \"%s\" is not supported", path,
                            ty ? ty : "(no type)");
}

/* A token's text in a tokenizer_config.json: a string or an AddedToken object. */
static const char *config_token(const cJSON *v) {
    if (cJSON_IsString(v)) return v->valuestring;
    if (cJSON_IsObject(v)) return get_str(v, "content");
    return NULL;
}

/* Reads tokenizer_config.json next to path (if any): BOS/EOS, add_bos_token,
 * add_eos_token, chat_template. */
static anneal_status read_config(const char *json_path, anneal_tokenizer *t) {
    char cpath[PATH_MAX];
    const char *slash = strrchr(json_path, '/');
    int dn = slash ? (int)(slash - json_path) : 0;
    if (snprintf(cpath, sizeof cpath, "%.*s%stokenizer_config.json", dn, json_path, slash ? "/" : "") >= (int)sizeof cpath)
        return ANNEAL_OK;
    struct stat st;
    if (stat(cpath, &st) != 0) return ANNEAL_OK;
    char *buf;
    size_t len;
    cJSON *root = NULL;
    anneal_status s = anneal_tok_read_file(cpath, &buf, &len);
    if (s) return s;
    s = anneal_tok_parse_json(cpath, buf, len, &root);
    if (!s && !cJSON_IsObject(root)) s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: expected a JSON object", cpath);
    const char *names[2] = {"bos_token", "eos_token"};
    int32_t *ids[2] = {&t->bos, &t->eos};
    for (int k = 0; k < 2 && !s; k++) {
        const cJSON *v = get(root, names[k]);
        if (is_null(v)) continue;
        const char *c = config_token(v);
        if (!c)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is neither a string nor a token object", cpath, names[k]);
        else if ((*ids[k] = anneal_tok_lookup(t, c, strlen(c))) < 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s \"%.60s\" is not a token of the tokenizer", cpath, names[k], c);
    }
    const char *flags[2] = {"add_bos_token", "add_eos_token"};
    bool *vals[2] = {&t->add_bos, &t->add_eos};
    for (int k = 0; k < 2 && !s; k++) {
        const cJSON *v = get(root, flags[k]);
        if (is_null(v)) continue;
        if (!cJSON_IsBool(v)) s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: %s is not true or false", cpath, flags[k]);
        else *vals[k] = cJSON_IsTrue(v);
    }
    const cJSON *ct = s ? NULL : get(root, "chat_template");
    if (!s && cJSON_IsArray(ct)) { /* [{"name": ..., "template": ...}]: the "default" one */
        const cJSON *pick = NULL;
        for (const cJSON *it = ct->child; it; it = it->next)
            if (get_str(it, "name") && strcmp(get_str(it, "name"), "default") == 0) pick = it;
        ct = pick ? get(pick, "template") : NULL;
    }
    if (!s && ct && cJSON_IsString(ct) && !(t->chat_template = strdup(ct->valuestring)))
        s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", cpath);
    else if (!s && ct && !cJSON_IsString(ct) && !cJSON_IsNull(ct))
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: chat_template is not a string", cpath);
    cJSON_Delete(root);
    if (s) {
        free(buf);
        return s;
    }
    t->hf_config = buf;
    t->hf_config_len = len;
    return ANNEAL_OK;
}

/* Turns a vocab key (or merge side) into the token's model bytes in scratch. */
static bool key_bytes(const anneal_tokenizer *t, const char *k, size_t kn, char *scratch, size_t *n) {
    if (t->kind == TOK_BYTE_LEVEL) return anneal_bpe_str_to_bytes(k, kn, scratch, n);
    memcpy(scratch, k, kn);
    *n = kn;
    return true;
}

/* Adds merge (a, b), both given as vocabulary keys; `where` names the entry. */
static anneal_status add_merge(anneal_tokenizer *t, const char *path, const char *a, size_t an, const char *b,
                               size_t bn, char *scratch, const char *where) {
    int32_t id[2] = {-1, -1};
    const char *side[2] = {a, b};
    size_t sn[2] = {an, bn};
    for (int k = 0; k < 2; k++) {
        size_t n;
        if (!key_bytes(t, side[k], sn[k], scratch, &n) || (id[k] = anneal_tok_lookup(t, scratch, n)) < 0)
            return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%.*s\" is not a token of %s", where,
                                    (int)(sn[k] > 60 ? 60 : sn[k]), side[k], path);
    }
    int32_t m = -1;
    int why;
    anneal_status s = anneal_tok_add_merge(t, id[0], id[1], &m, &why);
    if (s && why == 1)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the merged token \"%.*s%.*s\" is not in %s", where,
                                (int)(an > 60 ? 60 : an), a, (int)(bn > 60 ? 60 : bn), b, path);
    if (s && why == 2)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: merge \"%.*s %.*s\" repeats merge %d", where,
                                (int)(an > 60 ? 60 : an), a, (int)(bn > 60 ? 60 : bn), b, (int)m);
    return s;
}

/* Builds the per-id decoded bytes of a SentencePiece-style tokenizer: "<0xNN>" -> the
 * byte, ▁ -> space, added tokens as their content. */
static anneal_status build_decoded(anneal_tokenizer *t, const hf_shape *sh, const unsigned char *is_added,
                                   const char *path) {
    t->dec = malloc(t->bytes_len + 1);
    t->dec_off = malloc(((size_t)t->n_vocab + 1) * sizeof *t->dec_off);
    if (!t->dec || !t->dec_off) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    size_t o = 0;
    t->dec_off[0] = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t n;
        const char *b = tok_bytes(t, id, &n);
        unsigned hx;
        char tail;
        if (!is_added[id] && sh->dec_byte_fallback && n == 6 && sscanf(b, "<0x%2X%c", &hx, &tail) == 2 && tail == '>' &&
            t->sp.byte_tok[hx & 0xFF] == id) {
            t->dec[o++] = (char)hx;
        } else if (!is_added[id] && sh->dec_replace) {
            for (size_t i = 0; i < n;) {
                if (i + 3 <= n && memcmp(b + i, META, 3) == 0) {
                    t->dec[o++] = ' ';
                    i += 3;
                } else {
                    t->dec[o++] = b[i++];
                }
            }
        } else {
            memcpy(t->dec + o, b, n);
            o += n;
        }
        t->dec_off[id + 1] = o;
    }
    return ANNEAL_OK;
}

/* Finds "<0xNN>" tokens (byte fallback). */
static void find_byte_tokens(anneal_tokenizer *t) {
    for (int b = 0; b < 256; b++) {
        char k[8];
        snprintf(k, sizeof k, "<0x%02X>", b);
        t->sp.byte_tok[b] = anneal_tok_lookup(t, k, 6);
    }
}

/* Escapes a literal string for PCRE2 (a Split String pattern). */
static char *quote_literal(const char *s) {
    size_t n = strlen(s);
    char *o = malloc(2 * n + 1), *p = o;
    if (!o) return NULL;
    for (size_t i = 0; i < n; i++) {
        if (strchr("\\^$.|?*+()[]{}", s[i])) *p++ = '\\';
        *p++ = s[i];
    }
    *p = 0;
    return o;
}

anneal_status anneal_tokenizer_load_hf(const char *path, anneal_tokenizer **out) {
    if (out) *out = NULL;
    if (!path || !out) return anneal_set_error(ANNEAL_ERR_ARG, "load_hf: NULL argument");
    char *buf = NULL, *scratch = NULL;
    size_t len;
    cJSON *root = NULL;
    const cJSON **by_id = NULL;
    const char **content = NULL;
    unsigned char *is_added = NULL, *seen = NULL;
    int32_t *special = NULL;
    int n_special = 0;
    hf_shape sh = {0};
    const char *bos_name = NULL, *eos_name = NULL;
    anneal_tokenizer *t = anneal_tok_new();
    anneal_status s = t ? anneal_tok_read_file(path, &buf, &len) : anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    if (!s) s = anneal_tok_parse_json(path, buf, len, &root);
    const cJSON *model = NULL, *vocab = NULL, *merges = NULL, *added = NULL;
    if (!s) {
        model = get(root, "model");
        if (!cJSON_IsObject(root) || !cJSON_IsObject(model))
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: not a tokenizer.json (no \"model\" object)", path);
    }
    if (!s) {
        const char *ty = json_type(model);
        vocab = get(model, "vocab");
        merges = get(model, "merges");
        if (ty && strcmp(ty, "BPE") != 0)
            s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                 "%s: model type \"%s\" is not supported (anneal loads BPE: byte-level or "
                                 "SentencePiece-style with byte fallback)",
                                 path, ty);
        else if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: model needs a \"vocab\" object and a \"merges\" array", path);
    }
    if (!s) {
        const cJSON *d = get(model, "dropout");
        const cJSON *pre = get(model, "continuing_subword_prefix");
        const cJSON *suf = get(model, "end_of_word_suffix");
        if (cJSON_IsNumber(d) && d->valuedouble != 0)
            s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "%s: BPE dropout is not supported", path);
        else if ((cJSON_IsString(pre) && pre->valuestring[0]) || (cJSON_IsString(suf) && suf->valuestring[0]))
            s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                 "%s: continuing_subword_prefix / end_of_word_suffix are not supported", path);
        t->ignore_merges = cJSON_IsTrue(get(model, "ignore_merges"));
        t->sp.byte_fallback = cJSON_IsTrue(get(model, "byte_fallback"));
        t->sp.fuse_unk = cJSON_IsTrue(get(model, "fuse_unk"));
    }
    if (!s) s = parse_normalizer(path, get(root, "normalizer"), t);
    if (!s) s = parse_pre_tokenizer(path, get(root, "pre_tokenizer"), t, &sh);
    if (!s) s = parse_decoder(path, get(root, "decoder"), t, &sh);
    if (!s) s = parse_post(path, get(root, "post_processor"), &bos_name, &eos_name);
    /* which kind of BPE this is */
    if (!s) {
        bool sp_marks = t->sp.norm_prepend || t->sp.norm_replace || t->sp.meta || t->sp.byte_fallback;
        if (sh.byte_level && sp_marks)
            s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                 "%s: a ByteLevel pre-tokenizer together with the metaspace or byte_fallback is not "
                                 "supported",
                                 path);
        else if (sh.byte_level) {
            t->kind = TOK_BYTE_LEVEL;
            if (sh.split && sh.byte_level_regex)
                s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                     "%s: a Split pre-tokenizer followed by ByteLevel with use_regex true is not "
                                     "supported (Llama 3 and Qwen2 set use_regex false)",
                                     path);
        } else if (sp_marks) {
            t->kind = TOK_SENTENCEPIECE;
        } else {
            s = anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                 "%s: no ByteLevel pre_tokenizer and no metaspace or byte_fallback: anneal needs "
                                 "byte-level BPE or SentencePiece-style BPE",
                                 path);
        }
    }
    /* the regex: GPT-2's (ByteLevel use_regex), a Split's, or none */
    if (!s) {
        const char *why = NULL;
        char *pat = NULL;
        if (sh.split && sh.split_literal) pat = quote_literal(sh.split);
        else if (sh.split) pat = anneal_hf_regex_to_pcre(sh.split, &why);
        else if (sh.byte_level_regex) pat = anneal_hf_regex_to_pcre(ANNEAL_GPT2_HF_PATTERN, &why);
        if (sh.split || sh.byte_level_regex) {
            if (!pat)
                s = anneal_set_error(why && strcmp(why, "out of memory") ? ANNEAL_ERR_UNSUPPORTED : ANNEAL_ERR_OOM,
                                     "%s: the pre-tokenizer regex has %s, which anneal cannot translate for PCRE2",
                                     path, why ? why : "out of memory");
            else if (strcmp(pat, ANNEAL_GPT2_PATTERN) == 0) /* anneal's own files: GPT-2 as gpt-3-encoder runs it */
                free(pat);
            else
                t->pattern = pat;
        } else {
            t->pre_none = true;
        }
    }
    /* ids: vocab entries and added tokens, dense 0..n-1 */
    int32_t n = 0;
    if (!s) {
        added = get(root, "added_tokens");
        if (!is_null(added) && !cJSON_IsArray(added))
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"added_tokens\" is not an array", path);
        for (const cJSON *it = vocab->child; !s && it; it = it->next) {
            int64_t id = json_id(it);
            if (id < 0)
                s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: vocab token \"%.60s\" has an id that is not an integer >= 0",
                                     path, key_or(it->string));
            else if (id >= n)
                n = (int32_t)id + 1;
        }
        int i = 0;
        for (const cJSON *it = cJSON_IsArray(added) ? added->child : NULL; !s && it; it = it->next, i++) {
            int64_t id = json_id(get(it, "id"));
            const cJSON *c = get(it, "content");
            if (id < 0 || !cJSON_IsString(c) || !c->valuestring[0])
                s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                     "%s: added_tokens[%d] needs an integer \"id\" and a non-empty \"content\"", path, i);
            else if (id >= n)
                n = (int32_t)id + 1;
        }
    }
    if (!s && n == 0) s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the vocabulary is empty", path);
    if (!s) { /* dense ids need as many entries as the largest id + 1 (checked before allocating) */
        int64_t entries = cJSON_GetArraySize(vocab) + (cJSON_IsArray(added) ? cJSON_GetArraySize(added) : 0);
        if ((int64_t)n > entries)
            s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                 "%s: ids are not dense: the largest id is %d but there are only %lld vocab and added "
                                 "entries",
                                 path, (int)n - 1, (long long)entries);
    }
    int n_added = 0;
    if (!s) {
        n_added = cJSON_IsArray(added) ? cJSON_GetArraySize(added) : 0;
        by_id = calloc((size_t)n, sizeof *by_id);
        content = calloc((size_t)n, sizeof *content);
        is_added = calloc((size_t)n, 1);
        seen = calloc((size_t)n, 1);
        special = malloc((size_t)(n_added + 1) * sizeof *special);
        scratch = malloc(len + 16);
        t->added = calloc((size_t)(n_added + 1), sizeof *t->added);
        if (!by_id || !content || !is_added || !seen || !special || !scratch || !t->added)
            s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    for (const cJSON *it = s ? NULL : vocab->child; !s && it; it = it->next) {
        int64_t id = json_id(it);
        if (seen[id])
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: vocab id %lld is used twice (\"%.60s\" and \"%.60s\")", path,
                                 (long long)id, key_or(by_id[id]->string), key_or(it->string));
        seen[id] = 1;
        by_id[id] = it;
    }
    int i = 0;
    for (const cJSON *it = (!s && cJSON_IsArray(added)) ? added->child : NULL; !s && it; it = it->next, i++) {
        int64_t id = json_id(get(it, "id"));
        const char *c = get_str(it, "content");
        if (is_added[id]) {
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: added_tokens[%d]: id %lld is added twice", path, i,
                                 (long long)id);
            break;
        }
        if (seen[id]) { /* also in the vocabulary: the same token */
            const char *k = by_id[id]->string;
            size_t bn;
            bool same = strcmp(k, c) == 0 || (key_bytes(t, k, strlen(k), scratch, &bn) && bn == strlen(c) &&
                                              memcmp(scratch, c, bn) == 0);
            if (!same) {
                s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                     "%s: added_tokens[%d] \"%.60s\" has id %lld, which the vocab gives to \"%.60s\"",
                                     path, i, c, (long long)id, k);
                break;
            }
        }
        is_added[id] = 1;
        seen[id] = 1;
        content[id] = c;
        bool sp = cJSON_IsTrue(get(it, "special"));
        const cJSON *nz = get(it, "normalized");
        tok_added *a = &t->added[t->n_added++];
        a->id = (int32_t)id;
        a->special = sp;
        a->single_word = cJSON_IsTrue(get(it, "single_word"));
        a->lstrip = cJSON_IsTrue(get(it, "lstrip"));
        a->rstrip = cJSON_IsTrue(get(it, "rstrip"));
        a->normalized = nz ? cJSON_IsTrue(nz) : !sp;
        size_t cn = strlen(c);
        if (a->normalized && (t->sp.norm_nfc || t->sp.norm_prepend || t->sp.norm_replace)) {
            s = anneal_tok_normalize(t, c, cn, &a->norm, &a->norm_len);
        } else if (!(a->norm = malloc(cn))) {
            s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
        } else {
            memcpy(a->norm, c, cn);
            a->norm_len = cn;
        }
        if (sp) special[n_special++] = (int32_t)id;
    }
    for (int32_t id = 0; !s && id < n; id++) {
        if (!seen[id]) {
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: ids are not dense: id %d is missing (the largest is %d)", path,
                                 (int)id, (int)n - 1);
            break;
        }
        const char *k;
        size_t bn;
        if (is_added[id]) {
            k = content[id];
            bn = strlen(k);
            memcpy(scratch, k, bn);
        } else {
            k = by_id[id]->string;
            if (!key_bytes(t, k, strlen(k), scratch, &bn)) {
                s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                     "%s: token \"%.60s\" (id %d) is not a byte-level string (it has a character "
                                     "outside GPT-2's byte-to-unicode table)",
                                     path, k, (int)id);
                break;
            }
        }
        if (bn == 0) {
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token id %d is empty", path, (int)id);
            break;
        }
        int32_t dup;
        s = anneal_tok_add_token(t, scratch, bn, &dup);
        if (s && dup >= 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokens %d and %d have the same bytes (\"%.60s\")", path,
                                 (int)dup, (int)id, k);
    }
    i = 0;
    for (const cJSON *it = s ? NULL : merges->child; !s && it; it = it->next, i++) {
        char where[64 + PATH_MAX];
        snprintf(where, sizeof where, "%s: merges[%d]", path, i);
        if (cJSON_IsString(it)) {
            const char *a = it->valuestring, *sp = strchr(a, ' ');
            size_t ln = strlen(a);
            if (!sp || sp == a || !sp[1] || strchr(sp + 1, ' '))
                s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: expected \"left right\", found \"%.80s\"", where, a);
            else
                s = add_merge(t, path, a, (size_t)(sp - a), sp + 1, ln - (size_t)(sp - a) - 1, scratch, where);
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(it->child) &&
                   cJSON_IsString(it->child->next)) {
            const char *a = it->child->valuestring, *b = it->child->next->valuestring;
            s = add_merge(t, path, a, strlen(a), b, strlen(b), scratch, where);
        } else {
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: expected a \"left right\" string or a [left, right] pair", where);
        }
    }
    /* unknown token, byte fallback, decoded bytes */
    if (!s) {
        const char *unk = get_str(model, "unk_token");
        if (unk && (t->sp.unk = anneal_tok_lookup(t, unk, strlen(unk))) < 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: unk_token \"%.60s\" is not in the vocabulary", path, unk);
    }
    if (!s && t->kind == TOK_SENTENCEPIECE) {
        find_byte_tokens(t);
        if (t->sp.byte_fallback) {
            int have = 0;
            for (int b = 0; b < 256; b++) have += t->sp.byte_tok[b] >= 0;
            if (have == 0)
                s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                     "%s: byte_fallback is set but the vocabulary has no \"<0xNN>\" byte tokens", path);
        }
        if (!s) s = build_decoded(t, &sh, is_added, path);
    }
    /* BOS / EOS from the post-processor; tokenizer_config.json overrides */
    if (!s && bos_name) {
        t->bos = anneal_tok_lookup(t, bos_name, strlen(bos_name));
        t->add_bos = t->bos >= 0;
        if (t->bos < 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: post_processor adds \"%.60s\", which is not a token", path,
                                 bos_name);
    }
    if (!s && eos_name) {
        t->eos = anneal_tok_lookup(t, eos_name, strlen(eos_name));
        t->add_eos = t->eos >= 0;
        if (t->eos < 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: post_processor adds \"%.60s\", which is not a token", path,
                                 eos_name);
    }
    if (!s) s = read_config(path, t);
    if (!s) s = anneal_tok_finish(t, special, n_special, path);
    if (!s) {
        t->hf_json = buf;
        t->hf_json_len = len;
        buf = NULL;
        const char *slash = strrchr(path, '/');
        t->hf_dir = slash ? strndup(path, (size_t)(slash - path)) : strdup(".");
        if (!t->hf_dir) s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", path);
    }
    cJSON_Delete(root);
    free(buf);
    free(scratch);
    free(by_id);
    free(content);
    free(is_added);
    free(seen);
    free(special);
    if (s) {
        anneal_tokenizer_free(t);
        return s;
    }
    *out = t;
    return ANNEAL_OK;
}
