/* Fuzzes the token shard reader (anneal_shard_open, docs/FORMATS.md "Token shards"):
 * the input is the file. A shard that opens must hold what its header says: every id
 * below vocab_size (read back here, so ASan sees any out-of-map access). */
#include "anneal/shard.h"
#include "fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *p = fuzz_write("train_000000.bin", data, size);
    for (int verify = 0; verify < 2; verify++) {
        anneal_shard *s = NULL;
        if (anneal_shard_open(p, verify == 1, &s) == ANNEAL_OK) {
            for (uint64_t i = 0; i < s->info.n_tokens; i++)
                if (anneal_shard_token(s, i) >= s->info.vocab_size) abort();
            anneal_shard_close(s);
        }
        anneal_clear_error();
    }
    return 0;
}
