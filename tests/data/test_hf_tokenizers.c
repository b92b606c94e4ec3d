/* Hugging Face tokenizers in anneal: tokenizer.json files of each kind built with the
 * `tokenizers` library (tests/fixtures/gen_hf_tokenizers.py: byte-level BPE with GPT-2's,
 * Llama 3's and Qwen2's regexes, SentencePiece-style BPE with byte fallback as Llama 2
 * and Mistral ship it, each with added tokens special and not) must encode every text to
 * exactly the ids `tokenizers` gave (committed in reference.json), and decode them to
 * the text tokenizers' decoder gives. */
#include "anneal/anneal.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FIX "tests/fixtures/hf_tokenizers"

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    rewind(f);
    char *b = malloc((size_t)len + 1);
    if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[len] = 0;
    if (n) *n = (size_t)len;
    return b;
}

static cJSON *load_json(const char *rel) {
    char *s = slurp(anneal_test_path(rel), NULL);
    if (!s) return NULL;
    cJSON *j = cJSON_Parse(s);
    free(s);
    return j;
}

/* Compares anneal's ids and decoding of text with a reference case. */
static void check_case(const char *name, const anneal_tokenizer *t, const cJSON *c, const char *text, size_t n,
                       const char *label) {
    const cJSON *ids = cJSON_GetObjectItem(c, "ids");
    int want_n = cJSON_GetArraySize(ids);
    anneal_ids got = {0};
    anneal_status s = anneal_tokenizer_encode(t, text, n, true, &got);
    CHECK(s == ANNEAL_OK, "%s %s: encode failed: %s", name, label, anneal_last_error());
    int first_diff = -1;
    for (int i = 0; i < want_n || i < (int)got.n; i++) {
        int w = i < want_n ? cJSON_GetArrayItem(ids, i)->valueint : -1;
        int g = i < (int)got.n ? got.ids[i] : -1;
        if (w != g) {
            first_diff = i;
            break;
        }
    }
    if (first_diff >= 0) {
        int i = first_diff;
        CHECK(false, "%s %s: %zu ids, tokenizers gives %d; first difference at %d: anneal %d, tokenizers %d", name,
              label, got.n, want_n, i, i < (int)got.n ? got.ids[i] : -1,
              i < want_n ? cJSON_GetArrayItem(ids, i)->valueint : -1);
    }
    /* decoding: tokenizers' decoder output (null in the file: the text itself) */
    const cJSON *dec = cJSON_GetObjectItem(c, "decoded");
    const char *want = cJSON_IsString(dec) ? dec->valuestring : text;
    size_t wn = cJSON_IsString(dec) ? strlen(want) : n;
    char *out = NULL;
    size_t on = 0;
    if (first_diff < 0 && anneal_tokenizer_decode(t, got.ids, got.n, &out, &on) == ANNEAL_OK) {
        CHECK(on == wn && memcmp(out, want, wn) == 0, "%s %s: decodes to \"%.80s\", tokenizers to \"%.80s\"", name,
              label, out, want);
    }
    free(out);
    anneal_ids_free(&got);
}

/* Every tokenizer of the fixture, every inline text. */
TEST(inline_texts_match_tokenizers) {
    cJSON *ref = load_json(FIX "/reference.json");
    REQUIRE(ref);
    int n_tok = 0;
    for (cJSON *tk = ref->child; tk; tk = tk->next, n_tok++) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/%s", anneal_test_path(FIX), tk->string);
        anneal_tokenizer *t = NULL;
        anneal_status s = anneal_tokenizer_load(dir, &t);
        CHECK(s == ANNEAL_OK, "%s: %s", tk->string, anneal_last_error());
        if (s) continue;
        int k = 0;
        for (cJSON *c = tk->child; c; c = c->next, k++) {
            const cJSON *text = cJSON_GetObjectItem(c, "text");
            if (!cJSON_IsString(text)) continue;
            char label[64];
            snprintf(label, sizeof label, "text %d", k);
            check_case(tk->string, t, c, text->valuestring, strlen(text->valuestring), label);
            /* BOS: what encode(add_special_tokens=True) puts first */
            const cJSON *wb = cJSON_GetObjectItem(c, "with_bos");
            const cJSON *ids = cJSON_GetObjectItem(c, "ids");
            bool hf_adds = cJSON_GetArraySize(wb) > 0 &&
                           (cJSON_GetArraySize(ids) == 0 ||
                            cJSON_GetArrayItem(wb, 0)->valueint != cJSON_GetArrayItem(ids, 0)->valueint ||
                            cJSON_GetArraySize(wb) > cJSON_GetArraySize(ids));
            if (k == 0) {
                CHECK(anneal_tokenizer_adds_bos(t) == hf_adds, "%s: adds BOS %d, tokenizers %d", tk->string,
                      anneal_tokenizer_adds_bos(t), hf_adds);
                if (hf_adds)
                    CHECK(anneal_tokenizer_bos(t) == cJSON_GetArrayItem(wb, 0)->valueint, "%s: BOS %d, tokenizers %d",
                          tk->string, anneal_tokenizer_bos(t), cJSON_GetArrayItem(wb, 0)->valueint);
            }
        }
        anneal_tokenizer_free(t);
    }
    CHECK(n_tok == 7, "reference.json has %d tokenizers", n_tok);
    cJSON_Delete(ref);
}

/* The awkward texts of ../shared/data/tokenizer/ (sample.txt, the head of kjv_head.txt). */
TEST(shared_texts_match_tokenizers) {
    cJSON *ref = load_json(FIX "/reference.json");
    REQUIRE(ref);
    bool missing = false;
    for (cJSON *tk = ref->child; tk; tk = tk->next) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/%s", anneal_test_path(FIX), tk->string);
        anneal_tokenizer *t = NULL;
        if (anneal_tokenizer_load(dir, &t) != ANNEAL_OK) continue; /* reported above */
        for (cJSON *c = tk->child; c; c = c->next) {
            const cJSON *file = cJSON_GetObjectItem(c, "file");
            if (!cJSON_IsString(file)) continue;
            char rel[256];
            snprintf(rel, sizeof rel, "../shared/data/tokenizer/%s", file->valuestring);
            size_t n;
            char *text = slurp(anneal_test_path(rel), &n);
            if (!text) {
                missing = true;
                continue;
            }
            size_t want = (size_t)cJSON_GetObjectItem(c, "bytes")->valuedouble;
            CHECK(n >= want, "%s is shorter than when the fixture was made", rel);
            if (n >= want) check_case(tk->string, t, c, text, want, file->valuestring);
            free(text);
        }
        anneal_tokenizer_free(t);
    }
    cJSON_Delete(ref);
    if (missing) SKIP_PROMISED("../shared/data/tokenizer/ (sample.txt, kjv_head.txt) is absent");
}

/* Appends text as a JSON string element to the array arr. */
static void add_text(cJSON *arr, const char *text, size_t n) {
    char *c = malloc(n + 1);
    memcpy(c, text, n);
    c[n] = 0;
    cJSON_AddItemToArray(arr, cJSON_CreateString(c));
    free(c);
}

static bool write_str(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(s, 1, strlen(s), f) == strlen(s);
    return fclose(f) == 0 && ok;
}

/* Compares a JSON array of ids with n ids. */
static bool same_ids(const cJSON *arr, const int32_t *ids, size_t n) {
    if (cJSON_GetArraySize(arr) != (int)n) return false;
    size_t i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++)
        if (e->valueint != ids[i]) return false;
    return true;
}

/* anneal_tokenizer_save_hf, then transformers' AutoTokenizer.from_pretrained and tokenizers'
 * Tokenizer.from_file on what it wrote: the same ids as anneal on every text (BOS too), and
 * the same decoding. For each fixture, GPT-2's files and a tokenizer anneal trains; the
 * directory `anneal tokenizer train` writes is loaded by AutoTokenizer as it is. */
TEST(save_hf_loads_in_transformers) {
    const char *py = anneal_test_python("transformers,tokenizers");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    char tmpl[] = "/tmp/anneal_hf_tok_XXXXXX";
    char *tmp = mkdtemp(tmpl);
    REQUIRE(tmp);
    cJSON *ref = load_json(FIX "/reference.json");
    REQUIRE(ref);
    /* the texts: the fixture's inline ones, the awkward sample, some KJV */
    cJSON *texts = cJSON_CreateArray();
    for (cJSON *c = ref->child->child; c; c = c->next) {
        const cJSON *t = cJSON_GetObjectItem(c, "text");
        if (cJSON_IsString(t)) add_text(texts, t->valuestring, strlen(t->valuestring));
    }
    size_t n;
    char *sample = slurp(anneal_test_path("../shared/data/tokenizer/sample.txt"), &n);
    if (sample) add_text(texts, sample, n);
    free(sample);
    char *kjv = slurp(anneal_test_path(FIX "/kjv_excerpt.txt"), &n);
    REQUIRE(kjv);
    add_text(texts, kjv + 20000, 3000);
    /* the tokenizers: each fixture, GPT-2's files, one anneal trains */
    enum { MAX_TOK = 10 };
    anneal_tokenizer *toks[MAX_TOK] = {0};
    char dirs[MAX_TOK][300];
    int nt = 0;
    for (cJSON *tk = ref->child; tk && nt < MAX_TOK - 3; tk = tk->next) {
        char src[256];
        snprintf(src, sizeof src, "%s/%s", anneal_test_path(FIX), tk->string);
        if (anneal_tokenizer_load(src, &toks[nt]) != ANNEAL_OK) continue;
        snprintf(dirs[nt], sizeof dirs[nt], "%s/%s", tmp, tk->string);
        nt++;
    }
    if (anneal_tokenizer_load("gpt2", &toks[nt]) == ANNEAL_OK) {
        snprintf(dirs[nt], sizeof dirs[nt], "%s/gpt2", tmp);
        nt++;
    } else {
        anneal_clear_error();
    }
    char kjv_path[300], trained[300];
    snprintf(kjv_path, sizeof kjv_path, "%s", anneal_test_path(FIX "/kjv_excerpt.txt"));
    snprintf(trained, sizeof trained, "%s/trained", tmp);
    const char *files[1] = {kjv_path};
    REQUIRE(anneal_bpe_train(files, 1, 600, trained) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_load(trained, &toks[nt]) == ANNEAL_OK);
    snprintf(dirs[nt], sizeof dirs[nt], "%s/trained_hf", tmp);
    nt++;
    for (int i = 0; i < nt; i++)
        CHECK(anneal_tokenizer_save_hf(toks[i], dirs[i]) == ANNEAL_OK, "save_hf %s: %s", dirs[i], anneal_last_error());
    /* the trainer's own directory (loaded by anneal from encoder.json + vocab.bpe) */
    anneal_tokenizer *tr2 = NULL;
    REQUIRE(anneal_tokenizer_load(trained, &tr2) == ANNEAL_OK);
    toks[nt] = tr2;
    snprintf(dirs[nt], sizeof dirs[nt], "%s", trained);
    nt++;
    /* anneal's generated tokenizer.json reads back as the same tokenizer */
    char back[320];
    snprintf(back, sizeof back, "%s/trained_hf/tokenizer.json", tmp);
    anneal_tokenizer *rt = NULL;
    CHECK(anneal_tokenizer_load(back, &rt) == ANNEAL_OK, "%s: %s", back, anneal_last_error());
    if (rt) CHECK_TRUE(anneal_tokenizer_fingerprint(rt) == anneal_tokenizer_fingerprint(tr2));
    anneal_tokenizer_free(rt);

    char tpath[320], opath[320];
    snprintf(tpath, sizeof tpath, "%s/texts.json", tmp);
    snprintf(opath, sizeof opath, "%s/out.json", tmp);
    char *tj = cJSON_PrintUnformatted(texts);
    REQUIRE(write_str(tpath, tj));
    free(tj);
    char cmd[4096];
    int o = snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' '%s'", py, anneal_test_path("tests/fixtures/hf_tokenizer_check.py"),
                     tpath, opath);
    for (int i = 0; i < nt; i++) o += snprintf(cmd + o, sizeof cmd - (size_t)o, " '%s'", dirs[i]);
    CHECK(system(cmd) == 0, "%s failed", cmd);
    char *outs = slurp(opath, NULL);
    cJSON *res = outs ? cJSON_Parse(outs) : NULL;
    free(outs);
    REQUIRE(res);
    int compared = 0;
    for (int i = 0; i < nt; i++) {
        const cJSON *rows = cJSON_GetObjectItem(res, dirs[i]);
        CHECK(cJSON_GetArraySize(rows) == cJSON_GetArraySize(texts), "%s: no results", dirs[i]);
        int k = 0, bad = 0;
        const cJSON *row = rows ? rows->child : NULL;
        for (const cJSON *t = texts->child; t && row; t = t->next, row = row->next, k++) {
            anneal_ids ids = {0};
            REQUIRE(anneal_tokenizer_encode(toks[i], t->valuestring, strlen(t->valuestring), true, &ids) == ANNEAL_OK);
            bool a = same_ids(cJSON_GetObjectItem(row, "auto"), ids.ids, ids.n);
            bool f = same_ids(cJSON_GetObjectItem(row, "fast"), ids.ids, ids.n);
            if ((!a || !f) && bad++ < 3)
                CHECK(false, "%s text %d: anneal's %zu ids differ from AutoTokenizer's (%s) / Tokenizer's (%s)", dirs[i],
                      k, ids.n, a ? "same" : "differ", f ? "same" : "differ");
            /* with special tokens: BOS first when the tokenizer adds it */
            anneal_ids sp = {0};
            if (anneal_tokenizer_adds_bos(toks[i])) anneal_ids_push(&sp, anneal_tokenizer_bos(toks[i]));
            for (size_t j = 0; j < ids.n; j++) anneal_ids_push(&sp, ids.ids[j]);
            if (!same_ids(cJSON_GetObjectItem(row, "auto_special"), sp.ids, sp.n) && bad++ < 3)
                CHECK(false, "%s text %d: with special tokens, AutoTokenizer's ids are not anneal's BOS + ids", dirs[i], k);
            char *dec = NULL;
            size_t dn;
            const cJSON *hd = cJSON_GetObjectItem(row, "decoded");
            if (a && anneal_tokenizer_decode(toks[i], ids.ids, ids.n, &dec, &dn) == ANNEAL_OK && cJSON_IsString(hd) &&
                (dn != strlen(hd->valuestring) || memcmp(dec, hd->valuestring, dn)) && bad++ < 3)
                CHECK(false, "%s text %d: anneal decodes \"%.60s\", AutoTokenizer \"%.60s\"", dirs[i], k, dec,
                      hd->valuestring);
            free(dec);
            compared++;
            anneal_ids_free(&sp);
            anneal_ids_free(&ids);
        }
    }
    CHECK(nt >= 8 && compared == nt * cJSON_GetArraySize(texts), "compared %d texts of %d tokenizers", compared, nt);
    if (getenv("ANNEAL_TEST_VERBOSE")) printf("  compared %d texts of %d tokenizers\n", compared, nt);
    for (int i = 0; i < nt; i++) anneal_tokenizer_free(toks[i]);
    cJSON_Delete(res);
    cJSON_Delete(texts);
    cJSON_Delete(ref);
    free(kjv);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    CHECK_TRUE(system(cmd) == 0);
}

/* ------------------------------------------------------------ bad input */

static char bad_dir[256];

/* Writes j as bad_dir/tokenizer.json. */
static void put_json(const char *name, cJSON *j) {
    char p[320];
    snprintf(p, sizeof p, "%s/%s", bad_dir, name);
    char *t = cJSON_PrintUnformatted(j);
    REQUIRE(t && write_str(p, t));
    free(t);
}

static cJSON *fixture(const char *name) {
    char rel[128];
    snprintf(rel, sizeof rel, FIX "/%s/tokenizer.json", name);
    return load_json(rel);
}

static cJSON *obj(cJSON *j, const char *k) { return cJSON_GetObjectItem(j, k); }

/* The first id past every vocab and added token. */
static int next_id(cJSON *j) {
    int n = 0;
    for (cJSON *e = obj(obj(j, "model"), "vocab")->child; e; e = e->next)
        if (e->valueint >= n) n = e->valueint + 1;
    for (cJSON *e = obj(j, "added_tokens")->child; e; e = e->next)
        if (obj(e, "id")->valueint >= n) n = obj(e, "id")->valueint + 1;
    return n;
}

static void set(cJSON *o, const char *k, cJSON *v) {
    if (cJSON_GetObjectItem(o, k)) cJSON_ReplaceItemInObject(o, k, v);
    else cJSON_AddItemToObject(o, k, v);
}

/* Loads bad_dir and expects status want with every substring in the message. */
static void expect(const char *what, anneal_status want, const char *sub1, const char *sub2) {
    anneal_tokenizer *t = NULL;
    anneal_clear_error();
    anneal_status s = anneal_tokenizer_load(bad_dir, &t);
    const char *msg = anneal_last_error();
    CHECK(s == want && t == NULL && strstr(msg, sub1) && (!sub2 || strstr(msg, sub2)),
          "%s: status %d (want %d), message \"%s\" (want \"%s\"%s%s)", what, (int)s, (int)want, msg, sub1,
          sub2 ? ", " : "", sub2 ? sub2 : "");
    anneal_tokenizer_free(t);
}

/* Every malformed or unsupported part of a tokenizer.json / tokenizer_config.json is
 * refused with a message naming the file and the part. */
TEST(bad_files_are_refused_by_name) {
    snprintf(bad_dir, sizeof bad_dir, "/tmp/anneal_badtok_XXXXXX");
    REQUIRE(mkdtemp(bad_dir));
    const anneal_status U = ANNEAL_ERR_UNSUPPORTED, F = ANNEAL_ERR_FORMAT;
    cJSON *j;
    /* the fixtures themselves load from a copy */
    j = fixture("llama2_sp");
    REQUIRE(j);
    put_json("tokenizer.json", j);
    anneal_tokenizer *t = NULL;
    REQUIRE(anneal_tokenizer_load(bad_dir, &t) == ANNEAL_OK);
    anneal_tokenizer_free(t);
    cJSON_Delete(j);
#define CASE(fix, label, want, s1, s2, ...)  \
    do {                                     \
        j = fixture(fix);                    \
        REQUIRE(j);                          \
        cJSON *m = obj(j, "model");          \
        (void)m;                             \
        __VA_ARGS__;                         \
        put_json("tokenizer.json", j);       \
        cJSON_Delete(j);                     \
        expect(label, want, s1, s2);         \
    } while (0)
    CASE("llama2_sp", "Unigram", U, "tokenizer.json", "Unigram", set(m, "type", cJSON_CreateString("Unigram")));
    CASE("gpt2_bl", "WordPiece", U, "tokenizer.json", "WordPiece", set(m, "type", cJSON_CreateString("WordPiece")));
    CASE("llama2_sp", "NFKC", U, "tokenizer.json", "normalizer \"NFKC\"",
         set(j, "normalizer", cJSON_Parse("{\"type\": \"NFKC\"}")));
    CASE("qwen2_bl", "NFD", U, "tokenizer.json", "normalizer \"NFD\"",
         set(j, "normalizer", cJSON_Parse("{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFD\"}]}")));
    CASE("llama2_sp", "Prepend", U, "tokenizer.json", "Prepend",
         set(j, "normalizer", cJSON_Parse("{\"type\": \"Prepend\", \"prepend\": \"x\"}")));
    CASE("llama2_sp", "Replace", U, "tokenizer.json", "Replace",
         set(j, "normalizer",
             cJSON_Parse("{\"type\": \"Replace\", \"pattern\": {\"String\": \"a\"}, \"content\": \"b\"}")));
    CASE("llama3_bl", "Split behavior", U, "tokenizer.json", "Removed",
         set(cJSON_GetArrayItem(obj(obj(j, "pre_tokenizer"), "pretokenizers"), 0), "behavior",
             cJSON_CreateString("Removed")));
    CASE("llama3_bl", "Split invert", U, "tokenizer.json", "invert",
         set(cJSON_GetArrayItem(obj(obj(j, "pre_tokenizer"), "pretokenizers"), 0), "invert", cJSON_CreateTrue()));
    CASE("llama3_bl", "bad regex", U, "tokenizer.json", "PCRE2",
         set(cJSON_GetArrayItem(obj(obj(j, "pre_tokenizer"), "pretokenizers"), 0), "pattern",
             cJSON_Parse("{\"Regex\": \"(\\\\p{L}\"}")));
    CASE("llama3_bl", "\\S in a class", U, "tokenizer.json", "\\S inside a character class",
         set(cJSON_GetArrayItem(obj(obj(j, "pre_tokenizer"), "pretokenizers"), 0), "pattern",
             cJSON_Parse("{\"Regex\": \"[\\\\S]+\"}")));
    CASE("llama3_bl", "Split + ByteLevel(use_regex)", U, "tokenizer.json", "use_regex",
         set(cJSON_GetArrayItem(obj(obj(j, "pre_tokenizer"), "pretokenizers"), 1), "use_regex", cJSON_CreateTrue()));
    CASE("gpt2_bl", "Whitespace", U, "tokenizer.json", "Whitespace",
         set(j, "pre_tokenizer", cJSON_Parse("{\"type\": \"Whitespace\"}")));
    CASE("mistral_sp", "Metaspace replacement", U, "tokenizer.json", "replacement",
         set(obj(j, "pre_tokenizer"), "replacement", cJSON_CreateString("_")));
    CASE("gpt2_bl", "ByteLevel + byte_fallback", U, "tokenizer.json", "byte_fallback",
         set(m, "byte_fallback", cJSON_CreateTrue()));
    CASE("llama2_sp", "decoder", U, "tokenizer.json", "decoder \"WordPiece\"",
         set(j, "decoder", cJSON_Parse("{\"type\": \"WordPiece\"}")));
    CASE("llama2_sp", "Strip", U, "tokenizer.json", "Strip",
         set(j, "decoder", cJSON_Parse("{\"type\": \"Strip\", \"content\": \" \", \"start\": 2, \"stop\": 0}")));
    CASE("llama2_sp", "post_processor", U, "tokenizer.json", "BertProcessing",
         set(j, "post_processor", cJSON_Parse("{\"type\": \"BertProcessing\"}")));
    CASE("llama2_sp", "template token", F, "tokenizer.json", "<nope>",
         set(j, "post_processor",
             cJSON_Parse("{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<nope>\"}}, "
                         "{\"Sequence\": {\"id\": \"A\"}}]}")));
    CASE("llama2_sp", "dropout", U, "tokenizer.json", "dropout", set(m, "dropout", cJSON_CreateNumber(0.1)));
    CASE("gpt2_bl", "duplicate id", F, "tokenizer.json", "used twice",
         set(obj(m, "vocab"), "zzzz", cJSON_CreateNumber(5)));
    CASE("gpt2_bl", "missing id", F, "tokenizer.json", "not dense",
         cJSON_DeleteItemFromObject(obj(m, "vocab"), "!"));
    CASE("gpt2_bl", "negative id", F, "tokenizer.json", "not an integer",
         set(obj(m, "vocab"), "zzzz", cJSON_CreateNumber(-3)));
    CASE("gpt2_bl", "huge id", F, "tokenizer.json", "not dense",
         set(obj(m, "vocab"), "zzzz", cJSON_CreateNumber(2000000000)));
    CASE("gpt2_bl", "fractional id", F, "tokenizer.json", "not an integer",
         set(obj(m, "vocab"), "zzzz", cJSON_CreateNumber(2.5)));
    CASE("llama2_sp", "added token vs vocab", F, "added_tokens[1]", "<s>",
         set(cJSON_GetArrayItem(obj(j, "added_tokens"), 1), "content", cJSON_CreateString("<bos>")));
    CASE("llama2_sp", "added twice", F, "tokenizer.json", "added twice",
         set(cJSON_GetArrayItem(obj(j, "added_tokens"), 1), "id", cJSON_CreateNumber(0)));
    CASE("llama2_sp", "added no content", F, "added_tokens[1]", "content",
         cJSON_DeleteItemFromObject(cJSON_GetArrayItem(obj(j, "added_tokens"), 1), "content"));
    CASE("llama2_sp", "added same bytes", F, "tokenizer.json", "same bytes",
         set(cJSON_GetArrayItem(obj(j, "added_tokens"), 4), "content", cJSON_CreateString("<s>")));
    CASE("llama2_sp", "merge of unknown token", F, "merges[0]", "is not a token",
         cJSON_ReplaceItemInArray(obj(m, "merges"), 0, cJSON_CreateString("\xe2\x96\x81 qqqq")));
    CASE("llama2_sp", "merge result unknown", F, "merges[0]", "merged token",
         cJSON_ReplaceItemInArray(obj(m, "merges"), 0, cJSON_CreateString("<s> </s>")));
    CASE("llama2_sp", "merge repeated", F, "merges[1]", "repeats merge 0",
         cJSON_ReplaceItemInArray(obj(m, "merges"), 1,
                                  cJSON_Duplicate(cJSON_GetArrayItem(obj(m, "merges"), 0), true)));
    CASE("llama2_sp", "merge not a pair", F, "merges[2]", "left right",
         cJSON_ReplaceItemInArray(obj(m, "merges"), 2, cJSON_CreateString("abc")));
    CASE("llama2_sp", "unk_token", F, "tokenizer.json", "unk_token", set(m, "unk_token", cJSON_CreateString("<?>")));
    CASE("llama2_sp", "no byte tokens", F, "tokenizer.json", "<0xNN>", {
        cJSON *v = obj(m, "vocab");
        for (int b = 0; b < 256; b++) {
            char k[8], nk[12];
            snprintf(k, sizeof k, "<0x%02X>", b);
            snprintf(nk, sizeof nk, "<byte%02X>", b);
            cJSON *e = cJSON_DetachItemFromObject(v, k);
            cJSON_AddItemToObject(v, nk, e);
        }
    });
    CASE("gpt2_bl", "no model", F, "tokenizer.json", "no \"model\"", cJSON_DeleteItemFromObject(j, "model"));
    CASE("gpt2_bl", "no merges", F, "tokenizer.json", "merges", cJSON_DeleteItemFromObject(m, "merges"));
    CASE("gpt2_bl", "byte-level key", F, "tokenizer.json", "byte-level string",
         set(obj(m, "vocab"), "\xe2\x96\x81x", cJSON_CreateNumber(next_id(j))));
    /* tokenizer_config.json beside a good tokenizer.json */
    j = fixture("llama2_sp");
    put_json("tokenizer.json", j);
    cJSON_Delete(j);
    char cfg[320];
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", bad_dir);
    REQUIRE(write_str(cfg, "{\"bos_token\": \"<start>\"}"));
    expect("bos_token", F, "tokenizer_config.json", "bos_token \"<start>\"");
    REQUIRE(write_str(cfg, "{\"eos_token\": {\"content\": \"</t>\"}}"));
    expect("eos_token object", F, "tokenizer_config.json", "eos_token");
    REQUIRE(write_str(cfg, "{\"eos_token\": 7}"));
    expect("eos_token number", F, "tokenizer_config.json", "eos_token");
    REQUIRE(write_str(cfg, "{\"add_bos_token\": \"yes\"}"));
    expect("add_bos_token", F, "tokenizer_config.json", "add_bos_token");
    REQUIRE(write_str(cfg, "{\"bos_token\": \"<s>\", "));
    expect("truncated config", F, "tokenizer_config.json", "invalid JSON");
    REQUIRE(write_str(cfg, "[1, 2]"));
    expect("config not an object", F, "tokenizer_config.json", "object");
    REQUIRE(write_str(cfg, "{\"bos_token\": {\"content\": \"</s>\"}, \"add_bos_token\": false}"));
    t = NULL;
    REQUIRE(anneal_tokenizer_load(bad_dir, &t) == ANNEAL_OK);
    CHECK_TRUE(anneal_tokenizer_bos(t) == 2 && !anneal_tokenizer_adds_bos(t));
    anneal_tokenizer_free(t);
    unlink(cfg);
    /* a truncated tokenizer.json; a directory with no tokenizer */
    char tj[320];
    snprintf(tj, sizeof tj, "%s/tokenizer.json", bad_dir);
    REQUIRE(write_str(tj, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0"));
    expect("truncated", F, "tokenizer.json", "truncated");
    unlink(tj);
    expect("empty directory", ANNEAL_ERR_IO, bad_dir, "tokenizer.json");
    rmdir(bad_dir);
#undef CASE
}

/* What save_hf writes loads back as the same tokenizer (fingerprint, specials, BOS, chat
 * template), for the fixtures, GPT-2's files and a trained tokenizer; no Python needed. */
TEST(save_hf_round_trips) {
    char tmpl[] = "/tmp/anneal_rt_XXXXXX";
    char *tmp = mkdtemp(tmpl);
    REQUIRE(tmp);
    const char *names[] = {"gpt2_bl", "llama3_bl", "qwen2_bl", "qwen2_nfc", "zephyr_bl", "llama2_sp", "mistral_sp",
                           "gpt2", "trained"};
    char kjv[300], trained[300];
    snprintf(kjv, sizeof kjv, "%s", anneal_test_path(FIX "/kjv_excerpt.txt"));
    snprintf(trained, sizeof trained, "%s/trained_src", tmp);
    const char *files[1] = {kjv};
    REQUIRE(anneal_bpe_train(files, 1, 400, trained) == ANNEAL_OK);
    for (int i = 0; i < 9; i++) {
        char src[300], dst[300];
        if (i < 7) snprintf(src, sizeof src, "%s/%s", anneal_test_path(FIX), names[i]);
        else snprintf(src, sizeof src, "%s", i == 7 ? "gpt2" : trained);
        anneal_tokenizer *a = NULL, *b = NULL;
        if (anneal_tokenizer_load(src, &a) != ANNEAL_OK) {
            CHECK(i == 7, "%s: %s", src, anneal_last_error()); /* GPT-2's files may be absent */
            anneal_clear_error();
            continue;
        }
        snprintf(dst, sizeof dst, "%s/%s", tmp, names[i]);
        CHECK(anneal_tokenizer_save_hf(a, dst) == ANNEAL_OK, "%s: %s", dst, anneal_last_error());
        CHECK(anneal_tokenizer_load(dst, &b) == ANNEAL_OK, "%s: %s", dst, anneal_last_error());
        if (b) {
            const char *ca = anneal_tokenizer_chat_template(a), *cb = anneal_tokenizer_chat_template(b);
            CHECK(anneal_tokenizer_fingerprint(a) == anneal_tokenizer_fingerprint(b) &&
                      anneal_tokenizer_vocab_size(a) == anneal_tokenizer_vocab_size(b) &&
                      anneal_tokenizer_eot(a) == anneal_tokenizer_eot(b) &&
                      anneal_tokenizer_bos(a) == anneal_tokenizer_bos(b) &&
                      anneal_tokenizer_adds_bos(a) == anneal_tokenizer_adds_bos(b) && !ca == !cb &&
                      (!ca || strcmp(ca, cb) == 0),
                  "%s: what save_hf wrote loads as another tokenizer", names[i]);
        }
        anneal_tokenizer_free(a);
        anneal_tokenizer_free(b);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dst);
        CHECK_TRUE(system(cmd) == 0);
    }
    /* files of the source directory come along; saving into the source directory is fine */
    char src_dir[300], sp_map[360], cmd2[800];
    snprintf(src_dir, sizeof src_dir, "%s/src_copy", tmp);
    snprintf(cmd2, sizeof cmd2, "mkdir -p '%s' && cp '%s/llama2_sp/'* '%s/'", src_dir, anneal_test_path(FIX), src_dir);
    REQUIRE(system(cmd2) == 0);
    snprintf(sp_map, sizeof sp_map, "%s/special_tokens_map.json", src_dir);
    REQUIRE(write_str(sp_map, "{\"bos_token\": \"<s>\"}"));
    anneal_tokenizer *c = NULL;
    REQUIRE(anneal_tokenizer_load(src_dir, &c) == ANNEAL_OK);
    char dst2[320];
    snprintf(dst2, sizeof dst2, "%s/copied", tmp);
    CHECK(anneal_tokenizer_save_hf(c, dst2) == ANNEAL_OK, "%s", anneal_last_error());
    CHECK(anneal_tokenizer_save_hf(c, src_dir) == ANNEAL_OK, "%s", anneal_last_error());
    anneal_tokenizer_free(c);
    snprintf(sp_map, sizeof sp_map, "%s/copied/special_tokens_map.json", tmp);
    char *m = slurp(sp_map, NULL);
    CHECK(m && strcmp(m, "{\"bos_token\": \"<s>\"}") == 0, "special_tokens_map.json not copied");
    free(m);
    /* a directory that cannot be made */
    anneal_tokenizer *a = NULL;
    char src[300];
    snprintf(src, sizeof src, "%s/gpt2_bl", anneal_test_path(FIX));
    REQUIRE(anneal_tokenizer_load(src, &a) == ANNEAL_OK);
    anneal_clear_error();
    CHECK_TRUE(anneal_tokenizer_save_hf(a, "/proc/anneal_no/such") != ANNEAL_OK &&
               strstr(anneal_last_error(), "/proc/anneal_no/such"));
    CHECK_TRUE(anneal_tokenizer_save_hf(NULL, tmp) == ANNEAL_ERR_ARG);
    anneal_tokenizer_free(a);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    CHECK_TRUE(system(cmd) == 0);
}

/* A Hugging Face GPT-2 directory with vocab.json + merges.txt and no tokenizer.json
 * loads as GPT-2's own files. */
TEST(vocab_json_and_merges_txt) {
    anneal_tokenizer *g = NULL;
    if (anneal_tokenizer_load("gpt2", &g) != ANNEAL_OK) {
        anneal_clear_error();
        SKIP("GPT-2's files (data/gpt2) are not there");
    }
    char tmpl[] = "/tmp/anneal_vm_XXXXXX";
    char *tmp = mkdtemp(tmpl);
    REQUIRE(tmp);
    anneal_tokenizer *h = NULL;
    /* GPT-2's files found through save_hf's directory: write them under the HF names */
    size_t n;
    char p[300];
    const char *src[2] = {"data/gpt2/encoder.json", "data/gpt2/vocab.bpe"};
    const char *dst[2] = {"vocab.json", "merges.txt"};
    bool ok = true;
    for (int i = 0; i < 2 && ok; i++) {
        char *b = slurp(anneal_test_path(src[i]), &n);
        if (!b) {
            snprintf(p, sizeof p, "../shared/%s", src[i]);
            b = slurp(anneal_test_path(p), &n);
        }
        ok = b != NULL;
        snprintf(p, sizeof p, "%s/%s", tmp, dst[i]);
        if (b) ok = write_str(p, b);
        free(b);
    }
    if (ok) {
        CHECK(anneal_tokenizer_load(tmp, &h) == ANNEAL_OK, "%s", anneal_last_error());
        if (h) CHECK_TRUE(anneal_tokenizer_fingerprint(h) == anneal_tokenizer_fingerprint(g));
    }
    anneal_tokenizer_free(h);
    anneal_tokenizer_free(g);
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s", tmp, dst[i]);
        unlink(p);
    }
    rmdir(tmp);
}

/* ignore_merges (Llama 3): a piece that is a token is that token, whatever the merges
 * would make (tokenizers 0.15 cannot write it, so this tokenizer is made by hand). */
TEST(ignore_merges_takes_whole_pieces) {
    cJSON *j = fixture("gpt2_bl");
    REQUIRE(j);
    snprintf(bad_dir, sizeof bad_dir, "/tmp/anneal_im_XXXXXX");
    REQUIRE(mkdtemp(bad_dir));
    cJSON *m = obj(j, "model"), *v = obj(m, "vocab");
    /* "Ġzqx" is a token no merge makes */
    int n = next_id(j);
    cJSON_AddItemToObject(v, "\xc4\xa0zqx", cJSON_CreateNumber(n));
    put_json("tokenizer.json", j);
    anneal_tokenizer *t = NULL;
    REQUIRE(anneal_tokenizer_load(bad_dir, &t) == ANNEAL_OK);
    anneal_ids a = {0};
    REQUIRE(anneal_tokenizer_encode(t, " zqx", 4, true, &a) == ANNEAL_OK);
    CHECK(a.n > 1, "without ignore_merges, \" zqx\" is %zu ids", a.n);
    anneal_ids_free(&a);
    anneal_tokenizer_free(t);
    set(m, "ignore_merges", cJSON_CreateTrue());
    put_json("tokenizer.json", j);
    REQUIRE(anneal_tokenizer_load(bad_dir, &t) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_encode(t, "a zqx", 5, true, &a) == ANNEAL_OK);
    CHECK(a.n == 2 && a.ids[1] == n, "with ignore_merges: %zu ids", a.n);
    anneal_ids_free(&a);
    anneal_tokenizer_free(t);
    cJSON_Delete(j);
    char p[320];
    snprintf(p, sizeof p, "%s/tokenizer.json", bad_dir);
    unlink(p);
    rmdir(bad_dir);
}

int main(void) {
    RUN(inline_texts_match_tokenizers);
    RUN(shared_texts_match_tokenizers);
    RUN(save_hf_round_trips);
    RUN(save_hf_loads_in_transformers);
    RUN(bad_files_are_refused_by_name);
    RUN(ignore_merges_takes_whole_pieces);
    RUN(vocab_json_and_merges_txt);
    return anneal_test_summary();
}
