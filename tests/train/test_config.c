/* Training settings: parsing one flag value (kinds, ranges, errors that name the
 * flag), settings that replace each other, JSON layers (config files, the config a
 * checkpoint saves) and the round trip config -> JSON -> config. */
#include "anneal/train.h"
#include "test.h"

#include <string.h>

/* Sets name=value and expects failure with a message containing want. */
static void expect_error(const char *name, const char *value, const char *want) {
    anneal_train_config c;
    anneal_train_config_init(&c);
    anneal_clear_error();
    anneal_status st = anneal_train_config_set(&c, name, value);
    CHECK(st == ANNEAL_ERR_ARG, "--%s %s: status %d", name, value ? value : "(bare)", (int)st);
    CHECK(strstr(anneal_last_error(), want) != NULL, "--%s %s: message '%s' lacks '%s'", name,
          value ? value : "(bare)", anneal_last_error(), want);
    anneal_clear_error();
    anneal_train_config_free(&c);
}

TEST(defaults_and_values) {
    anneal_train_config c;
    anneal_train_config_init(&c);
    CHECK_TRUE(c.batch == 8 && c.seq == 64 && c.accum == 1 && c.steps == 100 && c.tokens == 0);
    CHECK_TRUE(c.shuffle && !c.synthetic && !c.resume && c.max_bad_steps == 5 && c.min_lr < 0 && c.dropout < 0);
    REQUIRE(anneal_train_config_set(&c, "batch", "16") == ANNEAL_OK);
    REQUIRE(anneal_train_config_set(&c, "lr", "3e-4") == ANNEAL_OK);
    REQUIRE(anneal_train_config_set(&c, "shuffle", "off") == ANNEAL_OK);
    REQUIRE(anneal_train_config_set(&c, "synthetic", NULL) == ANNEAL_OK); /* bare flag = on */
    REQUIRE(anneal_train_config_set(&c, "data", "some/dir") == ANNEAL_OK);
    REQUIRE(anneal_train_config_set(&c, "schedule", "wsd") == ANNEAL_OK);
    REQUIRE(anneal_train_config_set(&c, "dropout", "0") == ANNEAL_OK);
    CHECK_TRUE(c.batch == 16 && c.lr == 3e-4 && !c.shuffle && c.synthetic && c.dropout == 0.0);
    CHECK_TRUE(c.data && !strcmp(c.data, "some/dir") && c.schedule && !strcmp(c.schedule, "wsd"));
    /* --resume with and without a directory */
    REQUIRE(anneal_train_config_set(&c, "resume", NULL) == ANNEAL_OK);
    CHECK_TRUE(c.resume && c.resume_dir == NULL);
    REQUIRE(anneal_train_config_set(&c, "resume", "runs/a") == ANNEAL_OK);
    CHECK_TRUE(c.resume && c.resume_dir && !strcmp(c.resume_dir, "runs/a"));
    anneal_train_config_free(&c);
}

TEST(bad_values_name_the_flag) {
    expect_error("steps", "abc", "--steps");
    expect_error("steps", "0", "--steps");
    expect_error("steps", "1.5", "--steps");
    expect_error("batch", "-3", "--batch");
    expect_error("lr", "0", "--lr");
    expect_error("lr", "nan", "--lr");
    expect_error("dropout", "1", "--dropout");
    expect_error("beta2", "1.0", "--beta2");
    expect_error("shuffle", "maybe", "--shuffle");
    expect_error("model", "gpt5", "--model");
    expect_error("schedule", "zigzag", "--schedule");
    expect_error("max-bad-steps", "0", "--max-bad-steps");
    expect_error("data", "", "--data");
    expect_error("data", NULL, "--data");
    expect_error("frobnicate", "1", "--frobnicate");
    expect_error("resume", "", "--resume");
}

TEST(steps_and_tokens_replace_each_other) {
    anneal_train_config c;
    anneal_train_config_init(&c);
    REQUIRE(anneal_train_config_set(&c, "tokens", "1000") == ANNEAL_OK);
    CHECK_TRUE(c.tokens == 1000 && c.steps == 0);
    REQUIRE(anneal_train_config_set(&c, "steps", "7") == ANNEAL_OK);
    CHECK_TRUE(c.tokens == 0 && c.steps == 7);
    REQUIRE(anneal_train_config_set(&c, "config", "x.json") == ANNEAL_OK);
    REQUIRE(anneal_train_config_set(&c, "model", "tiny") == ANNEAL_OK);
    CHECK_TRUE(c.config == NULL && c.model && !strcmp(c.model, "tiny"));
    anneal_train_config_free(&c);
}

TEST(json_layers) {
    anneal_train_config c;
    anneal_train_config_init(&c);
    const char *js = "{\"batch\": 4, \"lr\": 0.002, \"shuffle\": false, \"synthetic\": true, \"data\": null,"
                     " \"schedule\": \"linear\", \"sample-prompt\": \"In the beginning\"}";
    REQUIRE(anneal_train_config_apply_json(&c, js, "cfg.json", NULL) == ANNEAL_OK);
    CHECK_TRUE(c.batch == 4 && c.lr == 0.002 && !c.shuffle && c.synthetic && c.data == NULL);
    CHECK_TRUE(c.schedule && !strcmp(c.schedule, "linear"));
    CHECK_TRUE(c.sample_prompt && !strcmp(c.sample_prompt, "In the beginning"));
    /* skipped keys are ignored, unknown keys and bad values are errors naming the file */
    const char *skip[] = {"out", NULL};
    CHECK_TRUE(anneal_train_config_apply_json(&c, "{\"out\": 5}", "s.json", skip) == ANNEAL_OK);
    anneal_clear_error();
    CHECK_TRUE(anneal_train_config_apply_json(&c, "{\"bach\": 5}", "cfg.json", NULL) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "cfg.json") && strstr(anneal_last_error(), "bach"), "%s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_train_config_apply_json(&c, "{\"batch\": 0}", "cfg.json", NULL) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "cfg.json") && strstr(anneal_last_error(), "--batch"), "%s", anneal_last_error());
    anneal_clear_error();
    CHECK_TRUE(anneal_train_config_apply_json(&c, "{\"batch\": [1]}", "cfg.json", NULL) == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_train_config_apply_json(&c, "[1, 2]", "cfg.json", NULL) == ANNEAL_ERR_FORMAT);
    anneal_clear_error();
    CHECK_TRUE(anneal_train_config_apply_json(&c, "{\"batch\": 4", "cfg.json", NULL) == ANNEAL_ERR_FORMAT);
    anneal_clear_error();
    anneal_train_config_free(&c);
}

TEST(json_round_trip) {
    anneal_train_config a, b;
    anneal_train_config_init(&a);
    anneal_train_config_init(&b);
    const char *kv[][2] = {{"model", "d6"}, {"data", "/x/y"}, {"batch", "3"}, {"seq", "17"}, {"accum", "2"},
                           {"tokens", "123456"}, {"lr", "0.000123456789"}, {"min-lr", "1e-5"}, {"warmup", "7"},
                           {"schedule", "wsd"}, {"weight-decay", "0.01"}, {"beta1", "0.8"}, {"beta2", "0.99"},
                           {"eps", "1e-6"}, {"clip", "0.5"}, {"dropout", "0.1"}, {"shuffle", "off"},
                           {"seed", "42"}, {"threads", "1"}, {"recompute", "on"}, {"eval-every", "5"},
                           {"eval-batches", "3"}, {"sample-every", "9"}, {"sample-tokens", "11"},
                           {"sample-temperature", "0"}, {"sample-prompt", "Amen"}, {"ckpt-every", "4"},
                           {"keep", "2"}, {"max-bad-steps", "3"}, {"peak-gflops", "99.5"}, {"log-every", "6"}};
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        REQUIRE(anneal_train_config_set(&a, kv[i][0], kv[i][1]) == ANNEAL_OK);
    char *js = anneal_train_config_to_json(&a);
    REQUIRE(js != NULL);
    REQUIRE(anneal_train_config_apply_json(&b, js, "round trip", NULL) == ANNEAL_OK);
    CHECK_TRUE(!strcmp(b.model, "d6") && !strcmp(b.data, "/x/y") && !strcmp(b.schedule, "wsd"));
    CHECK_TRUE(b.batch == 3 && b.seq == 17 && b.accum == 2 && b.tokens == 123456 && b.steps == 0);
    CHECK_TRUE(b.lr == a.lr && b.min_lr == a.min_lr && b.warmup == 7 && b.weight_decay == a.weight_decay);
    CHECK_TRUE(b.beta1 == a.beta1 && b.beta2 == a.beta2 && b.eps == a.eps && b.clip == a.clip);
    CHECK_TRUE(b.dropout == a.dropout && !b.shuffle && b.seed == 42 && b.threads == 1 && b.recompute);
    CHECK_TRUE(b.eval_every == 5 && b.eval_batches == 3 && b.sample_every == 9 && b.sample_tokens == 11);
    CHECK_TRUE(b.sample_temperature == 0 && !strcmp(b.sample_prompt, "Amen") && b.ckpt_every == 4);
    CHECK_TRUE(b.keep == 2 && b.max_bad_steps == 3 && b.peak_gflops == 99.5 && b.log_every == 6);
    /* unset values stay unset */
    anneal_train_config d;
    anneal_train_config_init(&d);
    char *js2 = anneal_train_config_to_json(&d);
    anneal_train_config e;
    anneal_train_config_init(&e);
    REQUIRE(anneal_train_config_apply_json(&e, js2, "defaults", NULL) == ANNEAL_OK);
    CHECK_TRUE(e.min_lr < 0 && e.dropout < 0 && e.model == NULL && e.steps == 100 && e.tokens == 0);
    free(js);
    free(js2);
    anneal_train_config_free(&a);
    anneal_train_config_free(&b);
    anneal_train_config_free(&d);
    anneal_train_config_free(&e);
}

TEST(copy_is_deep) {
    anneal_train_config a, b;
    anneal_train_config_init(&a);
    REQUIRE(anneal_train_config_set(&a, "data", "d") == ANNEAL_OK);
    REQUIRE(anneal_train_config_set(&a, "resume", "r") == ANNEAL_OK);
    REQUIRE(anneal_train_config_copy(&b, &a) == ANNEAL_OK);
    CHECK_TRUE(b.data != a.data && !strcmp(b.data, "d") && b.resume_dir != a.resume_dir && !strcmp(b.resume_dir, "r"));
    anneal_train_config_free(&a);
    CHECK_TRUE(!strcmp(b.data, "d"));
    anneal_train_config_free(&b);
}

TEST(option_table) {
    int n = 0;
    const anneal_train_option *o = anneal_train_options(&n);
    const char *spec[] = {"model", "config", "init", "data", "tokenizer", "batch", "seq", "accum", "steps", "tokens",
                          "lr", "min-lr", "warmup", "schedule", "weight-decay", "beta1", "beta2", "eps", "clip",
                          "dropout", "shuffle", "seed", "threads", "recompute", "eval-every", "eval-batches",
                          "sample-every", "ckpt-every", "keep", "out", "resume", "log-jsonl", "max-bad-steps",
                          "synthetic"};
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++)
        CHECK(anneal_train_option_find(spec[i]) != NULL, "flag --%s missing", spec[i]);
    for (int i = 0; i < n; i++) CHECK(o[i].help && strlen(o[i].help) > 5, "--%s has no help", o[i].name);
}

int main(void) {
    RUN(defaults_and_values);
    RUN(bad_values_name_the_flag);
    RUN(steps_and_tokens_replace_each_other);
    RUN(json_layers);
    RUN(json_round_trip);
    RUN(copy_is_deep);
    RUN(option_table);
    return anneal_test_summary();
}
