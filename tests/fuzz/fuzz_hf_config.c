/* Fuzzes Hugging Face config.json (anneal_model_config_from_hf_json, the registry's
 * model_type dispatch and each architecture's reader; _from_hf_file for the file
 * path): the input is the file. A config that reads and passes its architecture's
 * check is written back (anneal_model_config_to_hf_json) and must read back to the
 * same text. */
#include "anneal/model.h"
#include "fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *json = fuzz_cstr(data, size);
    anneal_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    if (anneal_model_config_from_hf_json(json, "config.json", &cfg) == ANNEAL_OK &&
        anneal_model_config_check(&cfg) == ANNEAL_OK) {
        char *a = anneal_model_config_to_hf_json(&cfg);
        if (a) {
            anneal_model_config again;
            memset(&again, 0, sizeof again);
            if (anneal_model_config_from_hf_json(a, "written config.json", &again) != ANNEAL_OK) abort();
            char *b = anneal_model_config_to_hf_json(&again);
            if (!b || strcmp(a, b) != 0) abort(); /* not a fixed point: a setting is lost or changed */
            free(b);
            free(a);
        }
    }
    anneal_clear_error();
    if (size < 4096) { /* the file path too (reads the same text) */
        memset(&cfg, 0, sizeof cfg);
        (void)anneal_model_config_from_hf_file(fuzz_write("config.json", data, size), &cfg);
        anneal_clear_error();
    }
    free(json);
    return 0;
}
