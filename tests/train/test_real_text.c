/* The tiny preset learns real text: a 512-id BPE tokenizer is learned from the KJV
 * excerpt in ../shared (or the `bible` program's output), the text is prepared into
 * train/val shards, and 50 steps must bring the loss from ln 512 = 6.24 to below 5.5
 * on train and 5.4 on val (the text's unigram entropy is ~5.18 nats; 50 steps land
 * around 5.1-5.2). */
#include "anneal/train.h"
#include "test.h"
#include "train_util.h"

#include <math.h>

TEST(tiny_learns_kjv) {
    TU_DIR_AND_DATA(dir, data, "realtext");
    char out[300];
    snprintf(out, sizeof out, "%s/run", dir);
    anneal_train_config c;
    anneal_train_config_init(&c);
    const char *kv[][2] = {{"model", "tiny"}, {"data", data}, {"steps", "50"}, {"batch", "8"}, {"seq", "64"},
                           {"lr", "3e-3"}, {"warmup", "5"}, {"eval-batches", "10"}, {"ckpt-every", "0"},
                           {"peak-gflops", "100"}, {"sample-every", "50"}, {"sample-tokens", "16"}, {"out", out}};
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) REQUIRE(anneal_train_config_set(&c, kv[i][0], kv[i][1]) == ANNEAL_OK);
    FILE *devnull = fopen("/dev/null", "w");
    anneal_train_result r;
    anneal_status st = anneal_train_run(&c, devnull, &r);
    fclose(devnull);
    anneal_train_config_free(&c);
    REQUIRE(st == ANNEAL_OK);
    char logp[400];
    snprintf(logp, sizeof logp, "%s/log.jsonl", out);
    double l[50];
    REQUIRE(tu_read_losses(logp, l, NULL, 50) == 50);
    double first = 0, last = 0;
    for (int i = 0; i < 10; i++) first += l[i] / 10, last += l[40 + i] / 10;
    CHECK(fabs(l[0] - log(512.0)) < 0.1, "first loss %g, expected about ln 512 = 6.24", l[0]);
    CHECK(r.train_loss < 5.5, "train loss after 50 steps %g", r.train_loss);
    CHECK(r.val_loss < 5.4, "val loss after 50 steps %g", r.val_loss);
    CHECK(last < first - 0.7, "mean loss of steps 1-10 %g, of 41-50 %g", first, last);
    /* the tokenizer prepare.json names was found, so the run ended with a sample */
    CHECK_TRUE(tu_count_records(logp, "sample") == 1);
    printf("    tiny on KJV: loss %.3f -> train %.3f, val %.3f\n", l[0], r.train_loss, r.val_loss);
    tu_rmrf(dir);
}

int main(void) {
    RUN(tiny_learns_kjv);
    return anneal_test_summary();
}
