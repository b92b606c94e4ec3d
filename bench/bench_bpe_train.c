/* BPE trainer throughput: trains on a text file at several vocabulary sizes and thread
 * counts and prints the time of each phase and corpus MB/s (whole run).
 * Build and run (from the repository root; the KJV text comes from Debian's bible-kjv):
 *   bible gen1:1-rev22:21 > /tmp/kjv.txt
 *   gcc -std=c11 -O3 -D_GNU_SOURCE -DANNEAL_VERSION='"0.1.0"' -fopenmp -Iinclude -Isrc \
 *       bench/bench_bpe_train.c src/data/bpe_train.c src/data/bpe_train_count.c \
 *       src/data/pretokenize.c src/data/tokenizer.c src/core/fs.c src/core/status.c \
 *       src/core/threads.c -lcjson -lpcre2-8 -lm -o /tmp/bench_bpe_train
 *   /tmp/bench_bpe_train /tmp/kjv.txt 4096 8192
 * (if tokenizer.c needs more of the library, link build/libanneal.a instead). */
#include "data/bpe_train.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s FILE VOCAB... (runs with 1 and 2 threads)\n", argv[0]);
        return 2;
    }
    const char *file = argv[1];
    int threads[2] = {1, 2};
    for (int v = 2; v < argc; v++) {
        int32_t vocab = atoi(argv[v]);
        for (int ti = 0; ti < 2; ti++) {
            anneal_bpe_train_opts opts = {.n_threads = threads[ti]};
            anneal_bpe_train_stats st;
            if (anneal_bpe_train_ex(&file, 1, vocab, "/tmp/anneal_bench_bpe_train", &opts, &st) != ANNEAL_OK) {
                fprintf(stderr, "error: %s\n", anneal_last_error());
                return 1;
            }
            double total = st.count_seconds + st.merge_seconds + st.write_seconds;
            double mb = (double)st.total_bytes / 1e6;
            printf("vocab %5d threads %d: %.2f MB, %zu distinct pieces: count %.3f s (%.1f MB/s), merges %.3f s, "
                   "write %.3f s, total %.3f s = %.1f MB/s\n",
                   (int)st.vocab_size, threads[ti], mb, st.distinct_pieces, st.count_seconds,
                   mb / st.count_seconds, st.merge_seconds, st.write_seconds, total, mb / total);
        }
    }
    return 0;
}
