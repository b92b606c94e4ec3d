/* JSON-lines records of a run (schema in docs/FORMATS.md, "Training log"): each
 * record goes to <run>/log.jsonl and to --log-jsonl, one line each, flushed. */
#include "train_internal.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <time.h>

anneal_status anneal_train_log_json(trainer *t, void *obj) {
    cJSON *o = obj;
    if (!o) return anneal_set_error(ANNEAL_ERR_OOM, "log: out of memory");
    anneal_train_telemetry_record(t, o);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s) return anneal_set_error(ANNEAL_ERR_OOM, "log: out of memory");
    anneal_status st = ANNEAL_OK;
    anneal_jsonl *logs[2] = {t->log, t->log_extra};
    for (int i = 0; i < 2; i++) {
        if (!logs[i]) continue;
        if (anneal_jsonl_write(logs[i], s) != ANNEAL_OK) {
            /* a log that cannot be written (full disk) must not stop training: say so once */
            anneal_progress_note(t->prog, "warning: %s (log records are being lost)", anneal_last_error());
            anneal_clear_error();
            anneal_jsonl_close(logs[i]);
            if (i == 0) t->log = NULL;
            else t->log_extra = NULL;
            st = ANNEAL_ERR_IO;
        }
    }
    free(s);
    return st;
}

void anneal_train_log_start(trainer *t) {
    cJSON *o = cJSON_CreateObject();
    char stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    cJSON_AddStringToObject(o, "type", "start");
    cJSON_AddStringToObject(o, "time", stamp);
    cJSON_AddStringToObject(o, "version", anneal_version());
    cJSON_AddNumberToObject(o, "step", (double)t->st.step);
    cJSON_AddNumberToObject(o, "total_steps", (double)t->total_steps);
    cJSON_AddNumberToObject(o, "tokens_per_step", (double)t->tokens_per_step);
    if (t->resume_ckpt[0]) cJSON_AddStringToObject(o, "resumed_from", t->resume_ckpt);
    else cJSON_AddNullToObject(o, "resumed_from");
    cJSON *m = cJSON_AddObjectToObject(o, "model");
    cJSON_AddNumberToObject(m, "n_layer", t->mcfg.n_layer);
    cJSON_AddNumberToObject(m, "n_head", t->mcfg.n_head);
    cJSON_AddNumberToObject(m, "n_embd", t->mcfg.n_embd);
    cJSON_AddNumberToObject(m, "vocab_size", t->mcfg.vocab_size);
    cJSON_AddNumberToObject(m, "n_ctx", t->mcfg.n_ctx);
    cJSON_AddNumberToObject(m, "params", (double)anneal_model_num_params(t->model));
    cJSON_AddNumberToObject(o, "flops_per_token", t->flops_per_token);
    cJSON_AddNumberToObject(o, "peak_gflops", t->peak_gflops);
    cJSON_AddStringToObject(o, "peak_source", t->peak_source);
    cJSON_AddStringToObject(o, "device", t->cfg.device ? t->cfg.device : "cpu"); /* --device as given */
    cJSON_AddNumberToObject(o, "threads", anneal_get_num_threads());
    /* the CPU and the kernel path of each family (anneal info's table), so a log says
     * what ran where */
    char cpu_model[160];
    cJSON *cpu = cJSON_AddObjectToObject(o, "cpu");
    cJSON_AddStringToObject(cpu, "model", anneal_cpu_model_name(cpu_model, sizeof cpu_model));
    const char *isa_limit = anneal_cpu_isa_limit_name(NULL);
    cJSON_AddStringToObject(cpu, "isa_limit", isa_limit ? isa_limit : "?");
    anneal_cpu_kernel_info kernels[16];
    int nk = anneal_cpu_kernel_report(kernels, 16);
    cJSON *kj = cJSON_AddObjectToObject(cpu, "kernels");
    for (int i = 0; i < nk && i < 16; i++) cJSON_AddStringToObject(kj, kernels[i].family, kernels[i].path);
    cJSON_AddStringToObject(o, "dtype", anneal_precision_name(t->dtype));
    if (t->use_scaler) cJSON_AddNumberToObject(o, "loss_scale", (double)t->scaler.scale);
    else cJSON_AddNullToObject(o, "loss_scale");
    cJSON *cfg = cJSON_Parse(t->config_json);
    if (cfg) cJSON_AddItemToObject(o, "config", cfg);
    anneal_train_log_json(t, o);
}
