/* What fuzzing and the input review of issue 16 found, one test each (each fails
 * without its fix):
 * - a PEFT adapter_config.json whose r the file's tensors do not have: refused before
 *   any adapter is made (the rank, and what it allocates, bounded by the file);
 * - `anneal report` on a log whose step/tokens fields are huge or NaN: a summary, not an
 *   undefined conversion (found by fuzz_log; regressions/log/report_nan_step). */
#include "anneal/anneal.h"
#include "test.h"
#include "train/train_util.h"

/* Writes a safetensors file of F32 tensors (names[i], shape rows[i] x cols[i], zeros). */
static bool write_zeros(const char *path, int n, const char *const *names, const int64_t *rows, const int64_t *cols) {
    anneal_st_write_entry e[4];
    int64_t shapes[4][2];
    float *bufs[4] = {0};
    bool ok = n <= 4;
    for (int i = 0; ok && i < n; i++) {
        shapes[i][0] = rows[i], shapes[i][1] = cols[i];
        bufs[i] = calloc((size_t)(rows[i] * cols[i]) + 1, sizeof(float));
        e[i] = (anneal_st_write_entry){.name = names[i], .dtype = ANNEAL_F32, .ndim = 2, .shape = shapes[i],
                                       .data = bufs[i]};
        ok = bufs[i] != NULL;
    }
    ok = ok && anneal_safetensors_write(path, n, e, 0, NULL, NULL) == ANNEAL_OK;
    for (int i = 0; i < n; i++) free(bufs[i]);
    return ok;
}

TEST(peft_rank_checked_against_the_file_first) {
    const char *dir = tu_mkdtemp("fuzzfind");
    REQUIRE(dir);
    char p[600];
    /* the config says r = 4096, the tensors are r = 2 */
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    FILE *f = fopen(p, "w");
    REQUIRE(f);
    fputs("{\"peft_type\":\"LORA\",\"r\":4096,\"lora_alpha\":8,\"lora_dropout\":0.0,\"target_modules\":[\"c_attn\"],"
          "\"bias\":\"none\",\"fan_in_fan_out\":true}",
          f);
    fclose(f);
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    const char *names[2] = {"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight",
                            "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"};
    int64_t rows[2] = {2, 48}, cols[2] = {16, 2};
    REQUIRE(write_zeros(p, 2, names, rows, cols));
    anneal_model_config cfg;
    REQUIRE(anneal_model_preset("tiny", &cfg));
    cfg.n_layer = 1, cfg.n_embd = 16, cfg.n_head = 2, cfg.vocab_size = 32, cfg.n_ctx = 8;
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    REQUIRE(m);
    int64_t before = anneal_memory_stats_get(ANNEAL_CPU).live_bytes;
    anneal_status s = anneal_peft_load(dir, m->params, ANNEAL_F32);
    CHECK(s == ANNEAL_ERR_SHAPE, "status %d: %s", (int)s, anneal_last_error());
    CHECK(strstr(anneal_last_error(), "r = 4096") && strstr(anneal_last_error(), "lora_A.weight"), "%s",
          anneal_last_error());
    CHECK(m->params->lora.rank == 0, "adapters of rank %d were made before the file was checked",
          m->params->lora.rank);
    CHECK(anneal_memory_stats_get(ANNEAL_CPU).live_bytes == before, "%lld bytes allocated for a refused adapter",
          (long long)(anneal_memory_stats_get(ANNEAL_CPU).live_bytes - before));
    anneal_clear_error();
    /* the same file with the right r loads */
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    f = fopen(p, "w");
    REQUIRE(f);
    fputs("{\"peft_type\":\"LORA\",\"r\":2,\"lora_alpha\":8,\"lora_dropout\":0.0,\"target_modules\":[\"c_attn\"],"
          "\"bias\":\"none\",\"fan_in_fan_out\":true}",
          f);
    fclose(f);
    s = anneal_peft_load(dir, m->params, ANNEAL_F32);
    CHECK(s == ANNEAL_OK, "%s", anneal_last_error());
    CHECK(m->params->lora.rank == 2, "rank %d", m->params->lora.rank);
    anneal_model_free(m);
    anneal_clear_error();
    tu_rmrf(dir);
}

TEST(report_survives_huge_and_nan_counts) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP("ANNEAL_BIN is not set (ctest sets it)");
    const char *dir = tu_mkdtemp("fuzzfind");
    REQUIRE(dir);
    char p[600], out[600], args[1400];
    snprintf(p, sizeof p, "%s/log.jsonl", dir);
    snprintf(out, sizeof out, "%s/out.txt", dir);
    FILE *f = fopen(p, "w");
    REQUIRE(f);
    fputs("{\"type\":\"start\",\"model\":{},\"config\":{}}\n"
          "{\"type\":\"step\",\"step\":1e300,\"tokens\":-1e300,\"loss\":1}\n"
          "{\"type\":\"eval\",\"val_loss\":2}\n"
          "{\"type\":\"summary\",\"skipped_steps\":1e19}\n",
          f);
    fclose(f);
    snprintf(args, sizeof args, "report %s", dir);
    int rc = tu_run_anneal(args, out, 0);
    const char *text = tu_slurp(out);
    CHECK(rc == 0, "exit %d: %s", rc, text);
    CHECK(strstr(text, "9223372036854775807 of") != NULL, "%s", text);
    CHECK(strstr(text, "at step -1") != NULL, "no step: -1 (%s)", text);
    tu_rmrf(dir);
}

int main(void) {
    RUN(peft_rank_checked_against_the_file_first);
    RUN(report_survives_huge_and_nan_counts);
    return anneal_test_summary();
}
