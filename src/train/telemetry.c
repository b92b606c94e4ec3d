/* --tensorboard and --metrics-port: the run's records fed to TensorBoard event files
 * and the Prometheus endpoint (src/obs/tensorboard.c, metrics.c). Rank 0 only. */
#include "train_internal.h"

#include <stdio.h>
#include <stdlib.h>

anneal_status anneal_train_open_telemetry(trainer *t) {
    const anneal_train_config *c = &t->cfg;
    if (c->tensorboard) {
        char dir[PATH_MAX + 16];
        if (c->tensorboard_dir) snprintf(dir, sizeof dir, "%s", c->tensorboard_dir);
        else snprintf(dir, sizeof dir, "%s/tensorboard", t->run_dir);
        if (anneal_tb_open(dir, &t->tb) != ANNEAL_OK) return ANNEAL_ERR_IO;
        anneal_progress_note(t->prog, "tensorboard: %s (tensorboard --logdir %s)", anneal_tb_path(t->tb), dir);
    }
    if (c->metrics_port > 0) {
        if (anneal_metrics_start(c->metrics_addr, (int)c->metrics_port, &t->metrics) != ANNEAL_OK) return ANNEAL_ERR_IO;
        anneal_progress_note(t->prog, "metrics: http://%s:%d/metrics", c->metrics_addr ? c->metrics_addr : "127.0.0.1",
                             anneal_metrics_port(t->metrics));
    }
    return ANNEAL_OK;
}

void anneal_train_telemetry_record(trainer *t, const void *record) {
    if (t->metrics) anneal_metrics_record(t->metrics, record);
    if (t->tb && anneal_tb_record(t->tb, record) != ANNEAL_OK) {
        anneal_progress_note(t->prog, "warning: %s (TensorBoard records are being lost)", anneal_last_error());
        anneal_clear_error();
        anneal_tb_close(t->tb);
        t->tb = NULL;
    }
}

anneal_status anneal_train_telemetry_step_times(trainer *t, double ms) {
    /* the flag is the same on every rank (the settings are checked equal): all call or none */
    if (t->cfg.metrics_port <= 0 || !t->comm || t->world <= 1) return ANNEAL_OK;
    float mine = (float)(ms / 1e3), *all = calloc((size_t)t->world, sizeof *all);
    if (!all) return anneal_set_error(ANNEAL_ERR_OOM, "metrics: out of memory");
    anneal_status st = anneal_comm_all_gather(t->comm, &mine, all, 1, ANNEAL_F32);
    if (st == ANNEAL_OK && t->metrics) {
        double *sec = malloc((size_t)t->world * sizeof *sec);
        if (sec) {
            for (int r = 0; r < t->world; r++) sec[r] = all[r];
            anneal_metrics_rank_step_seconds(t->metrics, t->world, sec);
            free(sec);
        }
    }
    free(all);
    return st;
}

void anneal_train_close_telemetry(trainer *t) {
    anneal_tb_close(t->tb);
    t->tb = NULL;
    anneal_metrics_stop(t->metrics);
    t->metrics = NULL;
}
