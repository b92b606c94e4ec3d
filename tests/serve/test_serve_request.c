/* The request validator of `anneal serve` (anneal_serve_request_parse): valid bodies
 * of both endpoints with every field, and malformed JSON, wrong types, absurd values,
 * unknown and unsupported fields, each refused with 400 naming the field; the error
 * JSON's shape; stop-string scanning (cut, hold back, several strings); UTF-8 cleaning
 * of generated text. */
#include "anneal/serve.h"
#include "serve/serve_internal.h"
#include "test.h"

#include <cjson/cJSON.h>

static anneal_status parse(const char *body, anneal_serve_kind kind, anneal_serve_request *r, anneal_serve_error *e) {
    anneal_serve_limits lim = anneal_serve_limits_default();
    lim.max_tokens = 1000;
    return anneal_serve_request_parse(body, strlen(body), kind, &lim, r, e);
}

TEST(valid_completion_with_every_field) {
    anneal_serve_request r;
    anneal_serve_error e;
    const char *body = "{\"model\": \"m\", \"prompt\": \"Hello\", \"max_tokens\": 7, \"temperature\": 0.5, "
                       "\"top_p\": 0.25, \"n\": 1, \"stream\": true, \"stream_options\": {\"include_usage\": true}, "
                       "\"stop\": [\"a\", \"bc\"], \"seed\": -3, \"user\": \"u\", \"presence_penalty\": 0, "
                       "\"frequency_penalty\": 0, \"logit_bias\": {}, \"logprobs\": null, \"best_of\": 1, "
                       "\"echo\": false, \"suffix\": null}";
    REQUIRE(parse(body, ANNEAL_SERVE_COMPLETION, &r, &e) == ANNEAL_OK);
    CHECK(!strcmp(r.model, "m") && !strcmp(r.prompt, "Hello"), "%s %s", r.model, r.prompt);
    CHECK_TRUE(r.max_tokens == 7 && r.temperature == 0.5 && r.top_p == 0.25 && r.stream && r.include_usage);
    CHECK_TRUE(r.n_stop == 2 && !strcmp(r.stop[0], "a") && !strcmp(r.stop[1], "bc"));
    CHECK_TRUE(r.has_seed && r.seed == (uint64_t)-3);
    anneal_serve_request_free(&r);
    /* defaults; a stop string; ids as the prompt; a list of one prompt */
    REQUIRE(parse("{\"prompt\": \"x\", \"stop\": \"\\n\"}", ANNEAL_SERVE_COMPLETION, &r, &e) == ANNEAL_OK);
    CHECK_TRUE(r.max_tokens == -1 && r.temperature == 1 && r.top_p == 1 && !r.stream && !r.has_seed && !r.model);
    CHECK_TRUE(r.n_stop == 1 && !strcmp(r.stop[0], "\n"));
    anneal_serve_request_free(&r);
    REQUIRE(parse("{\"prompt\": [5, 6, 7]}", ANNEAL_SERVE_COMPLETION, &r, &e) == ANNEAL_OK);
    CHECK_TRUE(!r.prompt && r.n_prompt_ids == 3 && r.prompt_ids[2] == 7);
    anneal_serve_request_free(&r);
    REQUIRE(parse("{\"prompt\": [\"one\"], \"temperature\": null}", ANNEAL_SERVE_COMPLETION, &r, &e) == ANNEAL_OK);
    CHECK_TRUE(!strcmp(r.prompt, "one") && r.temperature == 1);
    anneal_serve_request_free(&r);
}

TEST(valid_chat) {
    anneal_serve_request r;
    anneal_serve_error e;
    const char *body = "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, "
                       "{\"role\": \"user\", \"content\": \"hi\", \"name\": \"bob\"}], \"max_completion_tokens\": 9, "
                       "\"tools\": [], \"response_format\": null}";
    REQUIRE(parse(body, ANNEAL_SERVE_CHAT, &r, &e) == ANNEAL_OK);
    CHECK_TRUE(r.kind == ANNEAL_SERVE_CHAT && r.n_messages == 2 && r.max_tokens == 9);
    CHECK_TRUE(!strcmp(r.messages[0].role, "system") && !strcmp(r.messages[1].content, "hi"));
    anneal_serve_request_free(&r);
}

TEST(refused_bodies_name_their_field) {
    static const struct {
        anneal_serve_kind kind;
        const char *body, *param;
    } cases[] = {
        {ANNEAL_SERVE_COMPLETION, "", ""},
        {ANNEAL_SERVE_COMPLETION, "{", ""},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\"} trailing", ""},
        {ANNEAL_SERVE_COMPLETION, "[]", ""},
        {ANNEAL_SERVE_COMPLETION, "\"str\"", ""},
        {ANNEAL_SERVE_COMPLETION, "{}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": null}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": {}}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": []}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": [\"a\", \"b\"]}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": [[1], [2]]}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": [1, -2]}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": [1, 2.5]}", "prompt"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"model\": 3}", "model"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": \"5\"}", "max_tokens"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 0}", "max_tokens"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 1001}", "max_tokens"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 1e12}", "max_tokens"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 1.5}", "max_tokens"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"temperature\": -1}", "temperature"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"temperature\": 2.01}", "temperature"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"temperature\": true}", "temperature"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"top_p\": 7}", "top_p"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"top_p\": 0}", "top_p"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"n\": 2}", "n"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"n\": \"1\"}", "n"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"stream\": 1}", "stream"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}", "stream_options"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": {\"x\": 1}}", "stream_options"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"stop\": 5}", "stop"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"stop\": \"\"}", "stop"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"stop\": [\"a\", 1]}", "stop"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"stop\": [\"a\", \"b\", \"c\", \"d\", \"e\"]}", "stop"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"seed\": 1.5}", "seed"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"seed\": \"1\"}", "seed"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"seed\": 1e30}", "seed"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"user\": 1}", "user"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": 3}", "logprobs"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"echo\": true}", "echo"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"suffix\": \"s\"}", "suffix"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"best_of\": 3}", "best_of"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": 100}}", "logit_bias"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"frequency_penalty\": 0.5}", "frequency_penalty"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"messages\": []}", "messages"},
        {ANNEAL_SERVE_COMPLETION, "{\"prompt\": \"x\", \"bogus\": 1}", "bogus"},
        {ANNEAL_SERVE_CHAT, "{\"prompt\": \"x\"}", "prompt"},
        {ANNEAL_SERVE_CHAT, "{}", "messages"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": {}}", "messages"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": []}", "messages"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [3]}", "messages[0]"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"content\": \"x\"}]}", "messages[0].role"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"god\", \"content\": \"x\"}]}",
         "messages[1].role"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"role\": \"user\"}]}", "messages[0].content"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
         "messages[0].content"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": []}]}",
         "messages[0].tool_calls"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{}]}", "tools"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_completion_tokens\": 0}",
         "max_completion_tokens"},
        {ANNEAL_SERVE_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"echo\": true}", "echo"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        anneal_serve_request r;
        anneal_serve_error e;
        anneal_status s = parse(cases[i].body, cases[i].kind, &r, &e);
        CHECK(s == ANNEAL_ERR_ARG && e.http_status == 400 && !strcmp(e.param, cases[i].param) && e.message[0],
              "case %zu %s: status %d http %d param '%s' (want '%s'): %s", i, cases[i].body, s, e.http_status, e.param,
              cases[i].param, e.message);
        CHECK_TRUE(!r.prompt && !r.messages && !r.model && r.n_stop == 0); /* nothing left allocated */
        char *json = anneal_serve_error_json(&e);
        cJSON *j = cJSON_Parse(json);
        const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
        CHECK(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(err, "message")) &&
                  cJSON_IsString(cJSON_GetObjectItemCaseSensitive(err, "type")) &&
                  cJSON_GetObjectItemCaseSensitive(err, "param") && cJSON_GetObjectItemCaseSensitive(err, "code"),
              "error JSON %s", json);
        cJSON_Delete(j);
        free(json);
    }
    /* a stop list of 10,000 and one stop string too long */
    size_t n = 10000 * 4 + 64;
    char *big = malloc(n), *p = big;
    p += sprintf(p, "{\"prompt\": \"x\", \"stop\": [");
    for (int i = 0; i < 10000; i++) p += sprintf(p, "%s\"a\"", i ? "," : "");
    sprintf(p, "]}");
    anneal_serve_request r;
    anneal_serve_error e;
    CHECK_TRUE(parse(big, ANNEAL_SERVE_COMPLETION, &r, &e) == ANNEAL_ERR_ARG && !strcmp(e.param, "stop"));
    p = big + sprintf(big, "{\"prompt\": \"x\", \"stop\": \"");
    memset(p, 'a', 300);
    sprintf(p + 300, "\"}");
    CHECK_TRUE(parse(big, ANNEAL_SERVE_COMPLETION, &r, &e) == ANNEAL_ERR_ARG && !strcmp(e.param, "stop"));
    free(big);
    /* bytes that are not NUL-terminated are read within their length only */
    const char body[] = "{\"prompt\": \"x\"}GARBAGE";
    anneal_serve_limits lim = anneal_serve_limits_default();
    CHECK_TRUE(anneal_serve_request_parse(body, 15, ANNEAL_SERVE_COMPLETION, &lim, &r, &e) == ANNEAL_OK);
    anneal_serve_request_free(&r);
}

TEST(stop_scan_cuts_and_holds_back) {
    char *stop[] = {"END", "xyz"};
    size_t cut, safe;
    const char *t = "hello E";
    CHECK_TRUE(!anneal_serve_stop_scan(t, strlen(t), 0, stop, 2, &cut, &safe) && safe == 6); /* "E" held */
    t = "hello EN";
    CHECK_TRUE(!anneal_serve_stop_scan(t, strlen(t), 6, stop, 2, &cut, &safe) && safe == 6);
    t = "hello ENX";
    CHECK_TRUE(!anneal_serve_stop_scan(t, strlen(t), 6, stop, 2, &cut, &safe) && safe == 9);
    t = "hello END more";
    CHECK_TRUE(anneal_serve_stop_scan(t, strlen(t), 6, stop, 2, &cut, &safe) && cut == 6);
    t = "a xyz b END";
    CHECK_TRUE(anneal_serve_stop_scan(t, strlen(t), 0, stop, 2, &cut, &safe) && cut == 2); /* the first occurrence */
    t = "xy";
    CHECK_TRUE(!anneal_serve_stop_scan(t, strlen(t), 0, stop, 2, &cut, &safe) && safe == 0);
    CHECK_TRUE(!anneal_serve_stop_scan("abc", 3, 0, NULL, 0, &cut, &safe) && safe == 3);
    CHECK_TRUE(!anneal_serve_stop_scan("", 0, 0, stop, 2, &cut, &safe) && safe == 0);
}

TEST(utf8_clean) {
    char *s = anneal_serve_utf8_clean("a\xC3\xA9\xFF" "b\xE2\x82", 7);
    CHECK(!strcmp(s, "a\xC3\xA9\xEF\xBF\xBD" "b\xEF\xBF\xBD\xEF\xBF\xBD"), "%s", s);
    free(s);
    s = anneal_serve_utf8_clean("x\0y", 3);
    CHECK_TRUE(!strcmp(s, "x\xEF\xBF\xBDy"));
    free(s);
}

int main(void) {
    RUN(valid_completion_with_every_field);
    RUN(valid_chat);
    RUN(refused_bodies_name_their_field);
    RUN(stop_scan_cuts_and_holds_back);
    RUN(utf8_clean);
    return anneal_test_summary();
}
