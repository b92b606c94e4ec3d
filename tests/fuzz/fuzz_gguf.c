/* Fuzz harness of the GGUF reader (issue 16's convention): parses the input from memory
 * with anneal_gguf_open_memory and, when it opens, walks what the public API exposes
 * (every metadata value, every string of string arrays, every tensor dequantized), so a
 * bound the parser failed to check shows as an out-of-bounds read; then, for a file that
 * parses, the model and tokenizer import (anneal_model_load_gguf) on a scratch copy,
 * removed again. No output, no exit, nothing leaked. */
#include "anneal/gguf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* The import reads a path: the input goes to a scratch file, loaded, then removed. */
static void fuzz_import(const uint8_t *data, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "%s/anneal_fuzz_gguf_XXXXXX.gguf", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    int fd = mkstemps(path, 5);
    if (fd < 0) return;
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(fd, data + off, size - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    close(fd);
    anneal_model *m = NULL;
    anneal_tokenizer *tok = NULL;
    if (off == size && anneal_model_load_gguf(path, ANNEAL_CPU, &m, &tok) == ANNEAL_OK) {
        anneal_model_free(m);
        anneal_tokenizer_free(tok);
    }
    unlink(path);
    anneal_clear_error();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    anneal_gguf *g = NULL;
    if (anneal_gguf_open_memory(data, size, "fuzz", &g) != ANNEAL_OK) {
        anneal_clear_error();
        return 0;
    }
    volatile uint64_t sink = 0;
    for (int64_t i = 0; i < g->n_kv; i++) {
        const anneal_gguf_kv *kv = &g->kv[i];
        int64_t v;
        double d;
        char key[64];
        size_t n = kv->key.n < sizeof key - 1 ? (size_t)kv->key.n : sizeof key - 1;
        for (size_t k = 0; k < n; k++) key[k] = kv->key.s[k];
        key[n] = '\0';
        if (anneal_gguf_get_int(g, key, &v)) sink += (uint64_t)v;
        if (anneal_gguf_get_float(g, key, &d)) sink += (uint64_t)(d == d);
        if (kv->type == ANNEAL_GGUF_STRING && kv->str.n) sink += (uint8_t)kv->str.s[kv->str.n - 1];
        for (uint64_t k = 0; kv->arr_strs && k < kv->arr_n && k < 4096; k++) {
            anneal_gguf_str s = anneal_gguf_array_str(kv, k);
            if (s.n) sink += (uint8_t)s.s[s.n - 1];
        }
    }
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const anneal_gguf_tensor *t = &g->tensors[i];
        uint64_t n = 1;
        for (int k = 0; k < t->n_dims; k++) n *= (uint64_t)t->ne[k];
        if (n > (1u << 20)) continue; /* dequantize only what is small enough to allocate */
        float *f = malloc((size_t)(n ? n : 1) * sizeof *f);
        if (f && anneal_gguf_tensor_to_f32(t, f) == ANNEAL_OK && n) sink += (uint64_t)(f[n - 1] == f[n - 1]);
        free(f);
    }
    (void)sink;
    anneal_gguf_close(g);
    anneal_clear_error();
    fuzz_import(data, size);
    return 0;
}
