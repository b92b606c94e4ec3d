/* Fuzz harness (issue 16 convention) for the quantized model directory reader
 * (anneal_quant_load, src/io/quant_read.c): the input is the directory's config.json
 * (the architecture's config plus "quantization_config"), beside a fixed
 * model.safetensors of a GPT-2 "tiny" quantized dynamic, written once per process into
 * the harness's scratch directory (fuzz_util.h: removed at exit). No output, no exit;
 * the model is freed. */
#include "anneal/anneal.h"
#include "fuzz_util.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[300];

/* The scratch subdirectory q with model.safetensors of a quantized tiny GPT-2. */
static bool setup(void) {
    if (dir[0]) return true;
    char q[300];
    snprintf(q, sizeof q, "%s/q", fuzz_dir());
    anneal_model_config cfg;
    anneal_model *m = anneal_model_preset("tiny", &cfg) ? anneal_model_new(&cfg, ANNEAL_CPU) : NULL;
    bool ok = m && anneal_model_init(m, 1) == ANNEAL_OK && anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_OK &&
              anneal_quant_save(m, q, NULL) == ANNEAL_OK;
    anneal_model_free(m);
    anneal_clear_error();
    if (ok) snprintf(dir, sizeof dir, "%s", q);
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!setup()) return 0;
    char path[340];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    size_t w = fwrite(data, 1, size, f);
    fclose(f);
    if (w != size) return 0;
    anneal_model *m = NULL;
    if (anneal_quant_load(dir, ANNEAL_CPU, &m) == ANNEAL_OK) anneal_model_free(m);
    anneal_clear_error();
    return 0;
}
