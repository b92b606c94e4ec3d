/* --offload optimizer in the trainer: the AdamW made by setup (with the state a resume
 * restored into it) is replaced by the file-backed one of src/optim/offload.c, in
 * --offload-dir or the run directory (one file per rank: with --tp over the rank's
 * shards, with --pp over its stage). Checkpoints take the state out of the file and
 * put it back (dist.c's ckpt_begin / ckpt_end; the streamed ones of --tp and --pp,
 * tp_ckpt.c and pp_ckpt.c, themselves). */
#include "train_internal.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

int64_t anneal_train_rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long long size = 0, rss = 0;
    if (!f) return 0;
    int n = fscanf(f, "%lld %lld", &size, &rss);
    fclose(f);
    long pg = sysconf(_SC_PAGESIZE);
    return n == 2 && pg > 0 ? (int64_t)rss * pg : 0;
}

/* The state, step counts and step count of plain copied into off (whose state tensors
 * are then written to its file and freed). */
static anneal_status move_state(anneal_optimizer *plain, anneal_optimizer *off, const anneal_params *ps) {
    static const char *const names[] = {"exp_avg", "exp_avg_sq"};
    anneal_status st = anneal_optimizer_offload_gather(off);
    for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
        if (!ps->items[i].trainable) continue;
        for (int k = 0; k < 2 && st == ANNEAL_OK; k++) {
            anneal_tensor *src = anneal_optimizer_state(plain, i, names[k]);
            anneal_clear_error(); /* no state yet: zeros */
            anneal_tensor *dst = anneal_optimizer_state(off, i, names[k]);
            if (!dst) st = anneal_last_status();
            else if (src) st = anneal_copy_(dst, src);
        }
        if (st == ANNEAL_OK) st = anneal_optimizer_set_param_steps(off, i, anneal_optimizer_param_steps(plain, i));
    }
    if (st == ANNEAL_OK) st = anneal_optimizer_set_step_count(off, anneal_optimizer_step_count(plain));
    anneal_status sc = anneal_optimizer_offload_scatter(off);
    return st == ANNEAL_OK ? sc : st;
}

anneal_status anneal_train_setup_offload(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    if (!anneal_train_offload_wants(c->offload, "optimizer")) return ANNEAL_OK; /* offload_act.c */
    if (c->zero > 0) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--offload optimizer: not available with --zero %lld yet (the ZeRO "
                                "optimizer keeps its own shard of the state)", (long long)c->zero);
    }
    const char *dir = c->offload_dir ? c->offload_dir : t->run_dir;
    /* the parameters t->opt steps: the model's (with --tp its shards), or with --pp the stage's */
    anneal_params *ps = t->pp ? anneal_train_pp_opt_params(t) : t->model->params;
    anneal_optimizer *off = anneal_optimizer_new_offload(ps, anneal_optimizer_config(t->opt), dir, 0);
    if (!off) {
        *usage = anneal_last_status() == ANNEAL_ERR_ARG;
        return anneal_last_status();
    }
    anneal_status st = move_state(t->opt, off, ps);
    if (st != ANNEAL_OK) {
        anneal_optimizer_free(off);
        return st;
    }
    anneal_optimizer_free(t->opt);
    t->opt = off;
    if (t->rank == 0)
        anneal_progress_note(t->prog, "optimizer state offloaded: %.1f MiB%s in a memory-mapped file in %s (stepped in 16 "
                             "MiB chunks)", (double)anneal_optimizer_offload_bytes(off) / 1048576.0,
                             t->world > 1 ? " (rank 0's; every rank has a file of its own)" : "", dir);
    return ANNEAL_OK;
}
