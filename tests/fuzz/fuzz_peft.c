/* Fuzzes PEFT adapter directories (src/io/peft.c: anneal_peft_read_config,
 * anneal_peft_load into a tiny GPT-2): the input is adapter_config.json FUZZ_SEP
 * adapter_model.safetensors. Loading must check the file before it sizes anything
 * from it: a rank in the config is believed only as far as the file's tensors hold it. */
#include "anneal/models.h"
#include "anneal/peft.h"
#include "fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool made;
    if (!made) {
        char d[600];
        snprintf(d, sizeof d, "%s/adapter", fuzz_dir());
        mkdir(d, 0755);
        made = true;
    }
    const uint8_t *part[2];
    size_t len[2];
    int n = fuzz_split(data, size, part, len, 2);
    fuzz_write("adapter/adapter_config.json", part[0], len[0]);
    if (n > 1) fuzz_write("adapter/adapter_model.safetensors", part[1], len[1]);
    else fuzz_unlink("adapter/adapter_model.safetensors");
    const char *dir = fuzz_path("adapter");
    anneal_peft_config c;
    if (anneal_peft_read_config(dir, &c) == ANNEAL_OK) anneal_peft_config_free(&c);
    anneal_clear_error();
    anneal_model_config cfg;
    if (!anneal_model_preset("tiny", &cfg)) abort();
    cfg.n_layer = 1, cfg.n_embd = 16, cfg.n_head = 2, cfg.vocab_size = 32, cfg.n_ctx = 8;
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (!m) abort();
    (void)anneal_peft_load(dir, m->params, ANNEAL_F32);
    anneal_clear_error();
    anneal_model_free(m);
    return 0;
}
