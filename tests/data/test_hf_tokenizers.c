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
    CHECK(n_tok == 6, "reference.json has %d tokenizers", n_tok);
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

int main(void) {
    RUN(inline_texts_match_tokenizers);
    RUN(shared_texts_match_tokenizers);
    return anneal_test_summary();
}
