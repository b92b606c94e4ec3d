/* Shared by the GGUF tests (test_gguf.c, test_gguf_interop.c). */
#ifndef ANNEAL_TEST_GGUF_UTIL_H
#define ANNEAL_TEST_GGUF_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "anneal/anneal.h"
#include "test.h"

/* Llama 3's fixture tokenizer (tests/fixtures/hf_tokenizers/llama3_bl) with
 * "ignore_merges": true, as Llama 3's own tokenizer.json has it, copied into dir/l3tok. */
static anneal_status anneal_test_llama3_tokenizer(const char *dir, anneal_tokenizer **tok) {
    char d[600], p[700];
    snprintf(d, sizeof d, "%s/l3tok", dir);
    mkdir(d, 0700);
    const char *names[] = {"tokenizer.json", "tokenizer_config.json"};
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "tests/fixtures/hf_tokenizers/llama3_bl/%s", names[k]);
        FILE *in = fopen(anneal_test_path(p), "rb");
        if (!in) return ANNEAL_ERR_IO;
        char *text = malloc(1 << 20);
        size_t n = text ? fread(text, 1, (1 << 20) - 1, in) : 0;
        fclose(in);
        if (!text) return ANNEAL_ERR_OOM;
        text[n] = '\0';
        snprintf(p, sizeof p, "%s/%s", d, names[k]);
        FILE *f = fopen(p, "wb");
        if (!f) {
            free(text);
            return ANNEAL_ERR_IO;
        }
        char *at = k == 0 ? strstr(text, "\"type\": \"BPE\"") : NULL;
        if (at) {
            fwrite(text, 1, (size_t)(at - text), f);
            fputs("\"ignore_merges\": true, ", f);
            fputs(at, f);
        } else {
            fwrite(text, 1, n, f);
        }
        fclose(f);
        free(text);
    }
    return anneal_tokenizer_load(d, tok);
}

#endif
