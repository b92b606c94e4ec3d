/* Loading tokenizers: GPT-2's encoder.json + vocab.bpe, Hugging Face tokenizer.json
 * (BPE model, ByteLevel pre-tokenizer), and the --tokenizer resolver. Every problem is
 * an error naming the file (and line, key or index) and what is wrong. */
#include "tokenizer_impl.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

/* Reads a JSON number that must be an id: an integer in [0, INT32_MAX). -1 if not. */
static int64_t json_id(const cJSON *v) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d < (double)INT32_MAX) || d != (double)(int64_t)d) return -1;
    return (int64_t)d;
}

/* A token as its JSON key, for messages. */
static const char *key_or(const char *s) { return s ? s : "?"; }

static bool is_special_name(const char *s) {
    size_t n = strlen(s);
    return n >= 4 && s[0] == '<' && s[1] == '|' && s[n - 2] == '|' && s[n - 1] == '>';
}

/* Finds the first missing id in [0, n) given seen[], for "ids are not dense" messages. */
static int32_t first_missing(const unsigned char *seen, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (!seen[i]) return i;
    return n;
}

/* Adds the token with key key (byte-level string, or literal if literal) as the next id. */
static anneal_status add_key(anneal_tokenizer *t, const char *path, const char *key, bool literal,
                             int32_t id, char *scratch) {
    size_t kn = strlen(key), n;
    const char *bytes = key;
    if (literal) {
        n = kn;
    } else {
        if (!anneal_bpe_str_to_bytes(key, kn, scratch, &n))
            return anneal_set_error(ANNEAL_ERR_FORMAT,
                                    "%s: token \"%.60s\" (id %d) is not a byte-level string (it has a "
                                    "character outside GPT-2's byte-to-unicode table)",
                                    path, key, (int)id);
        bytes = scratch;
    }
    if (n == 0) return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token id %d is empty", path, (int)id);
    int32_t dup;
    anneal_status s = anneal_tok_add_token(t, bytes, n, &dup);
    if (s && dup >= 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: tokens %d and %d have the same bytes (\"%.60s\")", path,
                                (int)dup, (int)id, key);
    return s;
}

/* Looks up a byte-level merge side; error names where. */
static anneal_status merge_side(anneal_tokenizer *t, const char *s, size_t n, char *scratch,
                                const char *where, const char *vocab_path, int32_t *id) {
    size_t bn;
    if (!anneal_bpe_str_to_bytes(s, n, scratch, &bn) || (*id = anneal_tok_lookup(t, scratch, bn)) < 0)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: \"%.*s\" is not a token of %s", where,
                                (int)(n > 60 ? 60 : n), s, vocab_path);
    return ANNEAL_OK;
}

/* Adds merge (a, b) given as byte-level strings; `where` names the line or index. */
static anneal_status add_merge_str(anneal_tokenizer *t, const char *a, size_t an, const char *b, size_t bn,
                                   char *scratch, const char *where, const char *vocab_path,
                                   unsigned char *produced) {
    int32_t l = -1, r = -1, m = -1;
    int why;
    anneal_status s = merge_side(t, a, an, scratch, where, vocab_path, &l);
    if (!s) s = merge_side(t, b, bn, scratch, where, vocab_path, &r);
    if (s) return s;
    s = anneal_tok_add_merge(t, l, r, &m, &why);
    if (s && why == 1)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: the merged token \"%.*s%.*s\" is not in %s", where,
                                (int)(an > 60 ? 60 : an), a, (int)(bn > 60 ? 60 : bn), b, vocab_path);
    if (s && why == 2)
        return anneal_set_error(ANNEAL_ERR_FORMAT, "%s: merge \"%.*s %.*s\" repeats merge %d", where,
                                (int)(an > 60 ? 60 : an), a, (int)(bn > 60 ? 60 : bn), b, (int)m);
    if (s) return s;
    if (produced) produced[m] = 1;
    return ANNEAL_OK;
}

anneal_status anneal_tokenizer_load_gpt2(const char *encoder_json, const char *vocab_bpe,
                                         anneal_tokenizer **out) {
    if (out) *out = NULL;
    if (!encoder_json || !vocab_bpe || !out) return anneal_set_error(ANNEAL_ERR_ARG, "load_gpt2: NULL argument");
    char *ebuf = NULL, *vbuf = NULL, *scratch = NULL;
    size_t elen, vlen;
    cJSON *root = NULL, **by_id = NULL;
    unsigned char *seen = NULL, *produced = NULL;
    int32_t *cand = NULL;
    int n_cand = 0;
    anneal_tokenizer *t = NULL;
    anneal_status s = anneal_tok_read_file(encoder_json, &ebuf, &elen);
    if (!s) s = anneal_tok_read_file(vocab_bpe, &vbuf, &vlen);
    if (!s) s = anneal_tok_parse_json(encoder_json, ebuf, elen, &root);
    if (!s && !cJSON_IsObject(root))
        s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: expected a JSON object of token -> id", encoder_json);
    int32_t n = 0;
    if (!s) {
        n = (int32_t)cJSON_GetArraySize(root);
        if (n <= 0) s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: no tokens", encoder_json);
    }
    if (!s) {
        by_id = calloc((size_t)n, sizeof *by_id);
        seen = calloc((size_t)n, 1);
        produced = calloc((size_t)n, 1);
        cand = malloc((size_t)n * sizeof *cand);
        scratch = malloc(elen + vlen + 16);
        t = anneal_tok_new();
        if (!by_id || !seen || !produced || !cand || !scratch || !t)
            s = anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", encoder_json);
    }
    /* ids: integers, unique, dense 0..n-1 */
    for (cJSON *it = root ? root->child : NULL; !s && it; it = it->next) {
        int64_t id = json_id(it);
        if (id < 0 && cJSON_IsNumber(it))
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token \"%.60s\" has id %g, not an integer in 0..%d",
                                 encoder_json, key_or(it->string), it->valuedouble, INT32_MAX - 1);
        else if (id < 0)
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: token \"%.60s\" has an id that is not a number",
                                 encoder_json, key_or(it->string));
        else if (id >= n)
            s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                 "%s: ids are not dense: token \"%.60s\" has id %lld but there are %d tokens "
                                 "(id %d is missing)",
                                 encoder_json, key_or(it->string), (long long)id, (int)n, (int)first_missing(seen, n));
        else if (seen[id])
            s = anneal_set_error(ANNEAL_ERR_FORMAT, "%s: id %lld is used twice (\"%.60s\" and \"%.60s\")",
                                 encoder_json, (long long)id, key_or(by_id[id]->string), key_or(it->string));
        else {
            seen[id] = 1;
            by_id[id] = it;
        }
    }
    for (int32_t id = 0; !s && id < n; id++) {
        const char *key = by_id[id]->string;
        bool special = is_special_name(key);
        if (special) cand[n_cand++] = id;
        s = add_key(t, encoder_json, key, special, id, scratch);
    }
    /* vocab.bpe: "#version" line, then "left right" per line */
    int lineno = 0, first_merge_line = 0;
    for (char *p = vbuf; !s && p && p < vbuf + vlen;) {
        char *nl = memchr(p, '\n', (size_t)(vbuf + vlen - p));
        char *end = nl ? nl : vbuf + vlen;
        lineno++;
        size_t ln = (size_t)(end - p);
        if (ln && p[ln - 1] == '\r') ln--;
        char where[64 + PATH_MAX];
        snprintf(where, sizeof where, "%s:%d", vocab_bpe, lineno);
        if (lineno == 1 && ln >= 8 && memcmp(p, "#version", 8) == 0) {
        } else if (ln == 0) {
        } else {
            if (!first_merge_line) first_merge_line = lineno;
            char *sp = memchr(p, ' ', ln);
            if (!sp || sp == p || sp == p + ln - 1 || memchr(sp + 1, ' ', (size_t)(p + ln - sp - 1)))
                s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                     "%s: expected two tokens separated by one space, found \"%.*s\"", where,
                                     (int)(ln > 80 ? 80 : ln), p);
            else
                s = add_merge_str(t, p, (size_t)(sp - p), sp + 1, (size_t)(p + ln - sp - 1), scratch, where,
                                  encoder_json, produced);
        }
        p = nl ? nl + 1 : NULL;
    }
    /* specials: "<|...|>" tokens no merge makes; any other multi-byte token that no merge
     * makes means the two files do not belong together (or vocab.bpe is truncated) */
    int n_special = 0;
    for (int i = 0; !s && i < n_cand; i++)
        if (!produced[cand[i]]) cand[n_special++] = cand[i];
    for (int32_t id = 0; !s && id < n; id++) {
        size_t len;
        tok_bytes(t, id, &len);
        bool special = false;
        for (int i = 0; i < n_special; i++) special |= cand[i] == id;
        if (len > 1 && !produced[id] && !special)
            s = anneal_set_error(ANNEAL_ERR_FORMAT,
                                 "%s: token \"%.60s\" (id %d) of %s is made by no merge (is %s truncated, or "
                                 "from another tokenizer?)",
                                 vocab_bpe, key_or(by_id[id]->string), (int)id, encoder_json, vocab_bpe);
    }
    if (!s) s = anneal_tok_finish(t, cand, n_special, encoder_json);
    if (!s) t->bos = t->eot; /* GPT-2: <|endoftext|> is BOS and EOS (transformers' bos_token too), never added */
    cJSON_Delete(root);
    free(ebuf);
    free(vbuf);
    free(scratch);
    free(by_id);
    free(seen);
    free(produced);
    free(cand);
    if (s) {
        anneal_tokenizer_free(t);
        return s;
    }
    *out = t;
    return ANNEAL_OK;
}

/* ----------------------------------------------------------------- resolver */

/* dst = a + b (PATH_MAX bytes); false (dst empty) if it does not fit. */
static bool join(char *dst, const char *a, const char *b) {
    int n = snprintf(dst, PATH_MAX, "%s%s", a, b);
    if (n < 0 || n >= PATH_MAX) {
        dst[0] = 0;
        return false;
    }
    return true;
}

static bool is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static bool is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Loads dir/encoder.json + dir/vocab.bpe, else dir/tokenizer.json (with
 * tokenizer_config.json), else dir/vocab.json + dir/merges.txt; *found false if none is
 * there. */
static anneal_status load_dir(const char *dir, anneal_tokenizer **out, bool *found) {
    char e[PATH_MAX], v[PATH_MAX], j[PATH_MAX];
    *found = true;
    if (join(e, dir, "/encoder.json") && join(v, dir, "/vocab.bpe") && is_file(e) && is_file(v))
        return anneal_tokenizer_load_gpt2(e, v, out);
    if (join(j, dir, "/tokenizer.json") && is_file(j)) return anneal_tokenizer_load_hf(j, out);
    /* a Hugging Face GPT-2 directory without tokenizer.json: the same two files, renamed */
    if (join(e, dir, "/vocab.json") && join(v, dir, "/merges.txt") && is_file(e) && is_file(v))
        return anneal_tokenizer_load_gpt2(e, v, out);
    *found = false;
    return ANNEAL_ERR_IO;
}

anneal_status anneal_tokenizer_load(const char *spec, anneal_tokenizer **out) {
    if (out) *out = NULL;
    if (!spec || !*spec || !out) return anneal_set_error(ANNEAL_ERR_ARG, "tokenizer: empty --tokenizer argument");
    bool found;
    if (strcmp(spec, "gpt2") == 0) {
        const char *env = getenv("ANNEAL_GPT2_DIR");
        if (env && *env) {
            anneal_status s = load_dir(env, out, &found);
            if (!found)
                return anneal_set_error(ANNEAL_ERR_IO, "tokenizer gpt2: ANNEAL_GPT2_DIR=%s holds no encoder.json + vocab.bpe",
                                        env);
            return s;
        }
        /* the source tree (ctest's ANNEAL_SOURCE_DIR, the working directory, next to the
         * executable's build directory), then ../shared/data/gpt2 */
        char cand[9][PATH_MAX];
        int nc = 0;
        const char *src = getenv("ANNEAL_SOURCE_DIR");
        if (src && *src) join(cand[nc++], src, "/data/gpt2");
#ifdef ANNEAL_SOURCE_ROOT /* the build may pass the source tree's path */
        join(cand[nc++], ANNEAL_SOURCE_ROOT, "/data/gpt2");
#endif
        join(cand[nc++], "data/gpt2", "");
        char exe[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n > 0) {
            exe[n] = 0;
            char *slash = strrchr(exe, '/');
            if (slash) {
                *slash = 0;
                join(cand[nc++], exe, "/../data/gpt2");
                join(cand[nc++], exe, "/../../data/gpt2");
                join(cand[nc++], exe, "/../share/anneal/gpt2");
            }
        }
        if (src && *src) join(cand[nc++], src, "/../shared/data/gpt2");
        join(cand[nc++], "../shared/data/gpt2", "");
        for (int i = 0; i < nc; i++) {
            char e[PATH_MAX], v[PATH_MAX];
            if (cand[i][0] && join(e, cand[i], "/encoder.json") && join(v, cand[i], "/vocab.bpe") && is_file(e) &&
                is_file(v))
                return anneal_tokenizer_load_gpt2(e, v, out);
        }
        return anneal_set_error(ANNEAL_ERR_IO,
                                "tokenizer gpt2: GPT-2's encoder.json + vocab.bpe not found (looked in data/gpt2 "
                                "of the source tree and ../shared/data/gpt2); set ANNEAL_GPT2_DIR");
    }
    if (is_dir(spec)) {
        anneal_status s = load_dir(spec, out, &found);
        if (!found)
            return anneal_set_error(ANNEAL_ERR_IO, "tokenizer %s: the directory holds neither tokenizer.json "
                                    "nor encoder.json + vocab.bpe (or vocab.json + merges.txt)", spec);
        return s;
    }
    if (is_file(spec)) return anneal_tokenizer_load_hf(spec, out);
    return anneal_set_error(ANNEAL_ERR_IO, "tokenizer %s: no such file or directory (expected gpt2, a directory or "
                            "a tokenizer.json)", spec);
}
