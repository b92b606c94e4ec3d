/* Fuzzes the safetensors reader (anneal_safetensors_open: header length, JSON header,
 * dtypes, shapes, offsets, overlaps, metadata): the input is the file. Every entry of a
 * file that opens is looked up, its bytes read and loaded as a tensor, so an offset
 * or size the validation let through shows up under ASan. */
#include "anneal/io.h"
#include "fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *p = fuzz_write("model.safetensors", data, size);
    anneal_safetensors *st = NULL;
    if (anneal_safetensors_open(p, &st) == ANNEAL_OK) {
        anneal_scope *sc = anneal_scope_open();
        volatile uint8_t sink = 0;
        for (int i = 0; i < st->n_entries; i++) {
            const anneal_st_entry *e = &st->entries[i];
            if (anneal_safetensors_find(st, e->name) != e) abort();
            const uint8_t *b = anneal_safetensors_data(st, e);
            for (uint64_t k = 0; k < e->end - e->begin; k++) sink ^= b[k];
            (void)anneal_safetensors_load(st, e->name, ANNEAL_F32);
            anneal_clear_error();
        }
        for (int i = 0; i < st->n_metadata; i++)
            if (!anneal_safetensors_meta(st, st->metadata_keys[i])) abort();
        anneal_scope_close(sc);
        anneal_safetensors_close(st);
        (void)sink;
    }
    anneal_clear_error();
    return 0;
}
