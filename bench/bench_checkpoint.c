/* Checkpoint cost for a GPT-2 model (default 124M) with AdamW state: how long training
 * stalls for the snapshot (anneal_checkpointer_save returning) versus the whole
 * background write (until anneal_checkpointer_wait returns), for the first save
 * (snapshot buffers allocated and faulted in) and later ones (buffers reused); the
 * synchronous save; and loading (checksums + copies).
 * Build and run (from the repository root; writes ~3 GB under /tmp):
 *   gcc -std=c11 -O2 -D_GNU_SOURCE -DANNEAL_VERSION='"0.1.0"' -fopenmp -Iinclude -Isrc \
 *       bench/bench_checkpoint.c $(find src/core src/autograd src/ops src/cpu src/io src/nn \
 *       src/optim src/models -name '*.c') -lcjson -lm -lpthread \
 *       -o /tmp/bench_checkpoint && /tmp/bench_checkpoint [preset] [dir]
 * Figures depend on the disk (fsync) and the page cache; run on an idle machine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "anneal/anneal.h"
#include "io/checkpoint_internal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "bench_checkpoint: %s: %s\n", what, anneal_last_error());
    exit(1);
}

int main(int argc, char **argv) {
    const char *preset = argc > 1 ? argv[1] : "124M";
    const char *run = argc > 2 ? argv[2] : "/tmp/anneal_bench_ckpt";
    anneal_model_config cfg;
    if (!anneal_model_preset(preset, &cfg)) die("unknown preset");
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (!m || anneal_model_init(m, 1) != ANNEAL_OK) die("model");
    anneal_optimizer *opt = anneal_optimizer_new(m->params, anneal_optim_defaults(ANNEAL_OPTIM_ADAMW));
    if (!opt || anneal_optimizer_init_state(opt) != ANNEAL_OK) die("optimizer");
    double mb = (double)anneal_model_num_params(m) * 4 / 1e6;
    printf("GPT-2 %s: %.1f M params, model %.0f MB + AdamW moments %.0f MB\n", preset,
           (double)anneal_model_num_params(m) / 1e6, mb, 2 * mb);
    anneal_ckpt_remove_tree(run);
    anneal_train_state st;
    memset(&st, 0, sizeof st);
    st.best_val_loss = 3.5;

    anneal_checkpointer *c = anneal_checkpointer_new(run, 2);
    if (!c) die("checkpointer");
    for (int i = 0; i < 3; i++) {
        st.step = i + 1;
        double t0 = now_s();
        if (anneal_checkpointer_save(c, m, opt, &st, "{\"bench\":true}") != ANNEAL_OK) die("save");
        double t1 = now_s();
        if (anneal_checkpointer_wait(c) != ANNEAL_OK) die("write");
        double t2 = now_s();
        printf("async save %d (%s buffers): training stalls %.0f ms (snapshot); write finishes after %.2f s\n",
               i + 1, i ? "reused" : "new", 1e3 * (t1 - t0), t2 - t0);
    }
    anneal_checkpointer_free(c);

    st.step = 10;
    double t0 = now_s();
    if (anneal_checkpoint_save(run, m, opt, &st, NULL, 2) != ANNEAL_OK) die("sync save");
    double t1 = now_s();
    printf("sync save: %.2f s\n", t1 - t0);

    char dir[1024];
    if (anneal_checkpoint_resolve(run, dir, sizeof dir) != ANNEAL_OK) die("resolve");
    t0 = now_s();
    anneal_train_state got;
    if (anneal_checkpoint_load(dir, m, opt, &got) != ANNEAL_OK) die("load");
    t1 = now_s();
    printf("load (checksums + params + moments): %.2f s\n", t1 - t0);
    t0 = now_s();
    uint64_t bytes, h;
    char p[1100];
    snprintf(p, sizeof p, "%s/optimizer.safetensors", dir);
    if (anneal_ckpt_hash_file(p, &bytes, &h) != ANNEAL_OK) die("hash");
    t1 = now_s();
    printf("fnv1a64 of optimizer.safetensors (%.0f MB, page cache): %.2f s (%.2f GB/s)\n", (double)bytes / 1e6,
           t1 - t0, (double)bytes / 1e9 / (t1 - t0));
    anneal_optimizer_free(opt);
    anneal_model_free(m);
    anneal_ckpt_remove_tree(run);
    return 0;
}
