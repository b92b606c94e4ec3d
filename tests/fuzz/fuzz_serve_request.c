/* Fuzz harness for the request validator of `anneal serve` (anneal_serve_request_parse):
 * any bytes, as a completions body and as a chat body; a success is freed, a refusal's
 * error JSON is built and freed. Seed corpus: tests/fuzz/corpus/serve_request/. */
#include "anneal/serve.h"

#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    anneal_serve_limits lim = anneal_serve_limits_default();
    for (int k = 0; k < 2; k++) {
        anneal_serve_request r;
        anneal_serve_error e;
        if (anneal_serve_request_parse((const char *)data, size, k ? ANNEAL_SERVE_CHAT : ANNEAL_SERVE_COMPLETION, &lim,
                                       &r, &e) == ANNEAL_OK) {
            anneal_serve_request_free(&r);
        } else {
            free(anneal_serve_error_json(&e));
        }
    }
    return 0;
}
