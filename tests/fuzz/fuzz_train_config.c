/* Fuzzes the training settings file (`anneal train --config-file`,
 * anneal_train_config_apply_json, and the "config" object a checkpoint's state.json
 * stores): the input is the file's text. Settings that apply are written back
 * (anneal_train_config_to_json) and must apply to a fresh config and write the same
 * text again. */
#include "anneal/train.h"
#include "fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *json = fuzz_cstr(data, size);
    anneal_train_config c;
    anneal_train_config_init(&c);
    if (anneal_train_config_apply_json(&c, json, "run.json", NULL) == ANNEAL_OK) {
        char *a = anneal_train_config_to_json(&c);
        if (a) {
            anneal_train_config d;
            anneal_train_config_init(&d);
            if (anneal_train_config_apply_json(&d, a, "written config", NULL) != ANNEAL_OK) abort();
            char *b = anneal_train_config_to_json(&d);
            if (!b || strcmp(a, b) != 0) abort();
            free(b);
            anneal_train_config_free(&d);
            free(a);
        }
    }
    anneal_clear_error();
    anneal_train_config_free(&c);
    free(json);
    return 0;
}
