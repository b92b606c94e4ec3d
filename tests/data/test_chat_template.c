/* Chat templates (src/data/chat_template.c): anneal_chat_format renders the
 * conversation exactly as transformers' apply_chat_template(..., tokenize=False) does
 * for the Llama 3, ChatML (Qwen2), Llama 2, Mistral and Zephyr templates of the fixtures
 * (tests/fixtures/hf_tokenizers/chat.json, and live when the Python clients are there);
 * no template, or one anneal does not know, is a clear error. */
#include "anneal/anneal.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FIX "tests/fixtures/hf_tokenizers"

static char *slurp(const char *path) {
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
    return b;
}

static cJSON *load_json(const char *path) {
    char *s = slurp(path);
    cJSON *j = s ? cJSON_Parse(s) : NULL;
    free(s);
    return j;
}

static bool put(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(s, 1, strlen(s), f) == strlen(s);
    return fclose(f) == 0 && ok;
}

/* The messages of a JSON list as anneal_chat_message (views into the JSON). */
static size_t to_messages(const cJSON *list, anneal_chat_message *m, size_t cap) {
    size_t n = 0;
    for (const cJSON *e = list->child; e && n < cap; e = e->next, n++) {
        m[n].role = cJSON_GetObjectItem(e, "role")->valuestring;
        m[n].content = cJSON_GetObjectItem(e, "content")->valuestring;
    }
    return n;
}

/* Checks anneal against one rendering: a string, or {"error": ...} (anneal must fail
 * with ANNEAL_ERR_ARG and the same message). */
static void check_render(const char *name, const anneal_tokenizer *t, const cJSON *msgs, bool gen, const cJSON *want,
                         int k) {
    anneal_chat_message m[16];
    size_t n = to_messages(msgs, m, 16);
    char *text = NULL;
    size_t len = 0;
    anneal_clear_error();
    anneal_status s = anneal_chat_format(t, m, n, gen, &text, &len);
    const cJSON *err = cJSON_GetObjectItem(want, "error");
    if (cJSON_IsString(want)) {
        CHECK(s == ANNEAL_OK, "%s conversation %d: %s", name, k, anneal_last_error());
        if (s == ANNEAL_OK)
            CHECK(len == strlen(want->valuestring) && memcmp(text, want->valuestring, len) == 0,
                  "%s conversation %d (generation prompt %d):\n anneal:       \"%s\"\n transformers: \"%s\"", name, k,
                  gen, text, want->valuestring);
    } else {
        CHECK(s == ANNEAL_ERR_ARG && cJSON_IsString(err) && strstr(anneal_last_error(), err->valuestring),
              "%s conversation %d: anneal gives %d (%s), transformers raises \"%s\"", name, k, (int)s,
              s ? anneal_last_error() : text, cJSON_IsString(err) ? err->valuestring : "?");
    }
    free(text);
}

TEST(committed_renderings_match) {
    cJSON *chat = load_json(anneal_test_path(FIX "/chat.json"));
    REQUIRE(chat);
    int n_tpl = 0;
    for (cJSON *tk = chat->child; tk; tk = tk->next, n_tpl++) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/%s", anneal_test_path(FIX), tk->string);
        anneal_tokenizer *t = NULL;
        REQUIRE(anneal_tokenizer_load(dir, &t) == ANNEAL_OK);
        CHECK_TRUE(anneal_tokenizer_chat_template(t) != NULL);
        int k = 0;
        for (cJSON *e = tk->child; e; e = e->next, k++) {
            bool gen = cJSON_IsTrue(cJSON_GetObjectItem(e, "add_generation_prompt"));
            const cJSON *want = cJSON_GetObjectItem(e, "text");
            if (!want) want = e;
            check_render(tk->string, t, cJSON_GetObjectItem(e, "messages"), gen, want, k);
        }
        anneal_tokenizer_free(t);
    }
    CHECK(n_tpl == 5, "chat.json has %d templates", n_tpl);
    cJSON_Delete(chat);
}

/* No template; templates anneal does not know; NULL arguments. */
TEST(unknown_templates_are_errors) {
    char tmpl[] = "/tmp/anneal_chat_XXXXXX";
    char *tmp = mkdtemp(tmpl);
    REQUIRE(tmp);
    anneal_chat_message m[1] = {{"user", "hi"}};
    char *text = NULL;
    anneal_tokenizer *t = NULL;
    /* gpt2_bl's fixture has no chat_template */
    char dir[256];
    snprintf(dir, sizeof dir, "%s/gpt2_bl", anneal_test_path(FIX));
    REQUIRE(anneal_tokenizer_load(dir, &t) == ANNEAL_OK);
    anneal_clear_error();
    CHECK_TRUE(anneal_chat_format(t, m, 1, true, &text, NULL) == ANNEAL_ERR_UNSUPPORTED && !text);
    CHECK_TRUE(strstr(anneal_last_error(), "no chat_template") != NULL);
    CHECK_TRUE(anneal_chat_format(NULL, m, 1, true, &text, NULL) == ANNEAL_ERR_ARG);
    anneal_chat_message bad[1] = {{"user", NULL}};
    CHECK_TRUE(anneal_chat_format(t, bad, 1, true, &text, NULL) == ANNEAL_ERR_ARG);
    anneal_tokenizer_free(t);
    /* a copy of it with other templates */
    char src[300], cmd[700], cfg[300];
    snprintf(src, sizeof src, "%s/tokenizer.json", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s/'", src, tmp);
    REQUIRE(system(cmd) == 0);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", tmp);
    const char *tpls[] = {
        "{\"chat_template\": \"{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}\"}",
        "{\"chat_template\": \"{{ '<|start_header_id|>' }}{{ tools }}<|end_header_id|><|eot_id|>\"}",
        "{\"chat_template\": \"{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}\"}",
        "{\"chat_template\": 42}",
    };
    const char *want[] = {"not one anneal knows", "tools", "[INST]", "chat_template is not a string"};
    for (int i = 0; i < 4; i++) {
        REQUIRE(put(cfg, tpls[i]));
        t = NULL;
        anneal_clear_error();
        anneal_status s = anneal_tokenizer_load(tmp, &t);
        if (i == 3) {
            CHECK(s == ANNEAL_ERR_FORMAT && strstr(anneal_last_error(), want[i]) &&
                      strstr(anneal_last_error(), "tokenizer_config.json"),
                  "template %d: %s", i, anneal_last_error());
            anneal_tokenizer_free(t);
            continue;
        }
        REQUIRE(s == ANNEAL_OK);
        s = anneal_chat_format(t, m, 1, true, &text, NULL);
        CHECK(s == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), want[i]), "template %d: %d %s", i, (int)s,
              anneal_last_error());
        free(text);
        text = NULL;
        anneal_tokenizer_free(t);
    }
    unlink(cfg);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    CHECK_TRUE(system(cmd) == 0);
}

/* transformers itself, on conversations with awkward content. */
TEST(live_transformers_match) {
    const char *py = anneal_test_python("transformers,jinja2");
    if (!py) SKIP_PROMISED("needs the Python clients with jinja2 (make test sets them up: scripts/pyenv.sh)");
    char tmpl[] = "/tmp/anneal_chat_XXXXXX";
    char *tmp = mkdtemp(tmpl);
    REQUIRE(tmp);
    const char *convs =
        "[[{\"role\": \"user\", \"content\": \"  spaces\\t and tabs \\n\"}],"
        " [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"naïve 中文 🙂\"}],"
        " [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \" b \"},"
        "  {\"role\": \"user\", \"content\": \"\\u3000c\\u00a0\"}],"
        " [{\"role\": \"assistant\", \"content\": \"first\"}],"
        " [{\"role\": \"user\", \"content\": \"\"}]]";
    char cpath[300], opath[300];
    snprintf(cpath, sizeof cpath, "%s/convs.json", tmp);
    snprintf(opath, sizeof opath, "%s/out.json", tmp);
    REQUIRE(put(cpath, convs));
    const char *names[] = {"llama3_bl", "qwen2_bl", "llama2_sp", "mistral_sp", "zephyr_bl"};
    char cmd[3000];
    int o = snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' '%s'", py, anneal_test_path("tests/fixtures/hf_chat_check.py"),
                     cpath, opath);
    for (int i = 0; i < 5; i++) o += snprintf(cmd + o, sizeof cmd - (size_t)o, " '%s/%s'", anneal_test_path(FIX), names[i]);
    REQUIRE(system(cmd) == 0);
    cJSON *res = load_json(opath), *cj = cJSON_Parse(convs);
    REQUIRE(res && cj);
    int checked = 0;
    for (int i = 0; i < 5; i++) {
        char dir[300];
        snprintf(dir, sizeof dir, "%s/%s", anneal_test_path(FIX), names[i]);
        anneal_tokenizer *t = NULL;
        REQUIRE(anneal_tokenizer_load(dir, &t) == ANNEAL_OK);
        const cJSON *rows = cJSON_GetObjectItem(res, dir);
        int k = 0;
        const cJSON *row = rows ? rows->child : NULL;
        for (const cJSON *c = cj->child; c && row; c = c->next, row = row->next, k++)
            for (int gen = 0; gen < 2; gen++, checked++)
                check_render(names[i], t, c, gen, cJSON_GetArrayItem(row, gen), k);
        anneal_tokenizer_free(t);
    }
    CHECK(checked == 50, "checked %d renderings", checked);
    cJSON_Delete(res);
    cJSON_Delete(cj);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    CHECK_TRUE(system(cmd) == 0);
}

int main(void) {
    RUN(committed_renderings_match);
    RUN(unknown_templates_are_errors);
    RUN(live_transformers_match);
    return anneal_test_summary();
}
