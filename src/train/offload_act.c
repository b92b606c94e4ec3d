/* --offload activations in the trainer: the activation offloader of
 * src/autograd/saved_offload.c (saved activations in an unlinked file of --offload-dir
 * or the run directory between forward and backward), installed on the training
 * thread for the whole run, and the parsing of --offload's list
 * (none | optimizer | activations | optimizer,activations). */
#include "train_internal.h"

#include <string.h>

/* Calls fn on each comma-separated item of list (NULL: none); false when fn does. */
static bool each_item(const char *list, bool (*fn)(const char *item, size_t n, const void *arg), const void *arg) {
    for (const char *p = list; p && *p;) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (!fn(p, n, arg)) return false;
        p = e ? e + 1 : p + n;
    }
    return true;
}

static bool known(const char *item, size_t n, const void *arg) {
    (void)arg;
    static const char *const names[] = {"none", "optimizer", "activations"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && !strncmp(item, names[i], n)) return true;
    return false;
}

static bool differs(const char *item, size_t n, const void *arg) {
    const char *what = arg;
    return !(strlen(what) == n && !strncmp(item, what, n));
}

bool anneal_train_offload_valid(const char *list) {
    return list && *list && list[strlen(list) - 1] != ',' && each_item(list, known, NULL);
}

bool anneal_train_offload_wants(const char *list, const char *what) {
    return list && !each_item(list, differs, what);
}

anneal_status anneal_train_setup_offload_act(trainer *t, bool *usage) {
    const anneal_train_config *c = &t->cfg;
    if (!anneal_train_offload_wants(c->offload, "activations")) return ANNEAL_OK;
    if (t->device != ANNEAL_CPU) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--offload activations with --device %s: the file tier is for CPU runs "
                                "(the GPU version, pinned host memory on a stream of its own, is not built)",
                                anneal_device_name(t->device));
    }
    const char *dir = c->offload_dir ? c->offload_dir : t->run_dir;
    t->act_offload = anneal_act_offload_new(dir, 0);
    if (!t->act_offload) {
        *usage = anneal_last_status() == ANNEAL_ERR_ARG;
        return anneal_last_status();
    }
    anneal_act_offload_install(t->act_offload);
    if (t->rank == 0)
        anneal_progress_note(t->prog, "activations offloaded: saved tensors of 64 KiB and more go to a memory-mapped "
                             "file in %s between forward and backward", dir);
    return ANNEAL_OK;
}

void anneal_train_offload_act_free(trainer *t) {
    if (!t->act_offload) return;
    anneal_act_offload_stats s = anneal_act_offload_stats_get(t->act_offload);
    if (t->rank == 0 && t->prog && s.n_evicted > 0)
        anneal_progress_note(t->prog, "activation offload: %.1f MiB written, %.1f MiB read back, file %.1f MiB at most, "
                             "%.0f ms of CPU time in the hooks", (double)s.evicted_bytes / 1048576.0,
                             (double)s.restored_bytes / 1048576.0, (double)s.file_bytes / 1048576.0,
                             (double)s.hook_ns / 1e6);
    anneal_act_offload_free(t->act_offload);
    t->act_offload = NULL;
}
