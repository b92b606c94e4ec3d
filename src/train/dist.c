/* The distributed side of a training run (`mpirun -np N anneal train ...`): what the
 * ranks must agree on before the first step, the gradient sync (DDP or ZeRO) that
 * run_step drives, and the collectives around checkpoints, evaluation and stopping.
 *
 * The rules that keep a job from hanging: every rank runs the same loop and calls
 * the same collectives in the same order; decisions that could differ between ranks
 * (a setup failure, a stop signal that reached one rank, a non-finite loss) are made
 * from reduced values every rank holds; a failure on one rank alone in the middle of
 * a step ends the whole job at once (anneal_comm_abort) with that rank's message.
 *
 * The single-process path (no communicator, or one rank without ZeRO) is left exactly
 * as it was: every function here is then a no-op, so a world-size-1 run is
 * bit-identical to the trainer without distribution. */
#include "train_internal.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The version string ranks compare: the release and the layout of the settings (two
 * builds of one release from the same sources, e.g. compiled on each host, agree; a
 * build with other settings does not). ANNEAL_TEST_FAKE_VERSION (tests) replaces it. */
static const char *build_id(void) {
    static char buf[160];
    const char *fake = getenv("ANNEAL_TEST_FAKE_VERSION");
    if (fake && *fake) return fake;
    int n_opts = 0;
    anneal_train_options(&n_opts);
    snprintf(buf, sizeof buf, "%s (%d settings, config layout %zu bytes)", anneal_version(), n_opts,
             sizeof(anneal_train_config));
    return buf;
}

/* FNV-1a 64 of a string. */
static uint64_t hash_text(const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; s && *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ULL;
    return h;
}

bool anneal_train_dist_active(const trainer *t) { return t->ddp != NULL; }

static anneal_status restate(anneal_status code, const char *prefix);

/* --grad-compress powersgd (a world-1 run then also takes the sync's path: the low-rank
 * approximation changes the update even alone). */
static bool compressing(const trainer *t) { return t->cfg.grad_compress && !strcmp(t->cfg.grad_compress, "powersgd"); }

/* The PowerSGD state file of this rank at step in dir. */
static void psgd_path(const trainer *t, const char *dir, int64_t step, char *out, size_t n) {
    snprintf(out, n, "%s/powersgd_rank%d_step%08lld.bin", dir, t->rank, (long long)step);
}

/* PowerSGD on the sync; a resume loads this rank's state of the checkpoint's step
 * (written next to the checkpoint by anneal_train_dist_ckpt_end). */
static anneal_status make_powersgd(trainer *t) {
    anneal_powersgd_config pc = anneal_powersgd_defaults();
    pc.rank = (int)t->cfg.powersgd_rank;
    pc.warmup_steps = t->cfg.powersgd_warmup_steps;
    pc.seed = (uint64_t)t->cfg.seed;
    t->psgd = anneal_powersgd_new(t->ddp, pc);
    if (!t->psgd) return restate(anneal_last_status(), "--grad-compress powersgd: ");
    if (!t->resume_ckpt[0] || t->st.step == 0) return ANNEAL_OK;
    char tmp[PATH_MAX], path[PATH_MAX + 64];
    snprintf(tmp, sizeof tmp, "%s", t->resume_ckpt);
    psgd_path(t, dirname(tmp), t->st.step, path, sizeof path);
    anneal_status st = anneal_powersgd_load(t->psgd, path);
    return st == ANNEAL_OK ? ANNEAL_OK : restate(st, "--resume with --grad-compress powersgd: ");
}

/* Removes this rank's PowerSGD files of steps before `step` whose checkpoint directory
 * is gone (pruned by --keep). Best effort. */
static void prune_powersgd(trainer *t, int64_t step) {
    DIR *dir = opendir(t->run_dir);
    if (!dir) return;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "powersgd_rank%d_step", t->rank);
    for (struct dirent *e; (e = readdir(dir));) {
        long long s;
        char tail[8];
        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) continue;
        if (sscanf(e->d_name + strlen(prefix), "%lld%7s", &s, tail) != 2 || strcmp(tail, ".bin") || s >= step) continue;
        char ck[PATH_MAX + 32], f[PATH_MAX + 300];
        snprintf(ck, sizeof ck, "%s/ckpt_%08lld", t->run_dir, s);
        if (access(ck, F_OK) == 0) continue;
        snprintf(f, sizeof f, "%s/%s", t->run_dir, e->d_name);
        unlink(f);
    }
    closedir(dir);
}

/* True when the run needs the collective path at all. */
static bool distributed(const trainer *t) { return t->comm && (t->world > 1 || t->cfg.zero > 0 || compressing(t)); }

/* Re-records the current error with a prefix. */
static anneal_status restate(anneal_status code, const char *prefix) {
    if (code == ANNEAL_OK) code = ANNEAL_ERR_STATE;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", anneal_last_error());
    anneal_clear_error();
    return anneal_set_error(code, "%s%s", prefix, msg);
}

anneal_status anneal_train_dist_agree(trainer *t, anneal_status local, const char *phase) {
    if (!t->comm || t->world <= 1) return local;
    int32_t *all = calloc((size_t)t->world, sizeof *all);
    if (!all) anneal_comm_abort(t->comm, 1, "out of memory");
    int32_t mine = local == ANNEAL_OK ? 0 : 1;
    char keep[1024] = "";
    if (local != ANNEAL_OK) snprintf(keep, sizeof keep, "%s", anneal_last_error());
    anneal_clear_error();
    anneal_status st = anneal_comm_all_gather(t->comm, &mine, all, 1, ANNEAL_I32);
    if (st != ANNEAL_OK) {
        free(all);
        return restate(st, "cannot reach the other ranks: ");
    }
    char failed[256] = "";
    int n_failed = 0;
    for (int r = 0; r < t->world; r++) {
        if (!all[r]) continue;
        size_t k = strlen(failed);
        if (k + 16 < sizeof failed) snprintf(failed + k, sizeof failed - k, "%s%d", n_failed ? ", " : "", r);
        n_failed++;
    }
    free(all);
    if (local != ANNEAL_OK) return anneal_set_error(local, "%s", keep);
    if (n_failed == 0) return ANNEAL_OK;
    return anneal_set_error(ANNEAL_ERR_STATE, "stopping: %s failed on rank%s %s (see %s message)", phase,
                            n_failed > 1 ? "s" : "", failed, n_failed > 1 ? "their" : "its");
}

/* Broadcasts rank 0's text (NUL-terminated, malloc'd on the others into *out). */
static anneal_status broadcast_text(trainer *t, const char *mine, char **out) {
    *out = NULL;
    int32_t len = t->rank == 0 ? (int32_t)strlen(mine) + 1 : 0;
    anneal_status st = anneal_comm_broadcast(t->comm, &len, 1, ANNEAL_I32, 0);
    if (st != ANNEAL_OK) return st;
    char *buf = malloc((size_t)len > 0 ? (size_t)len : 1);
    if (!buf) anneal_comm_abort(t->comm, 1, "out of memory");
    if (t->rank == 0) memcpy(buf, mine, (size_t)len);
    st = anneal_comm_broadcast(t->comm, buf, len, ANNEAL_I8, 0);
    if (st != ANNEAL_OK) {
        free(buf);
        return st;
    }
    buf[len > 0 ? len - 1 : 0] = '\0';
    *out = buf;
    return ANNEAL_OK;
}

/* Names the settings where this rank's resolved config differs from rank 0's. */
static void config_diff(const char *mine, const char *ref, char *buf, size_t n) {
    buf[0] = '\0';
    cJSON *a = cJSON_Parse(mine), *b = cJSON_Parse(ref);
    size_t k = 0;
    for (cJSON *it = a ? a->child : NULL; it; it = it->next) {
        cJSON *o = cJSON_GetObjectItemCaseSensitive(b, it->string);
        if (o && cJSON_Compare(it, o, true)) continue;
        char *va = cJSON_PrintUnformatted(it), *vb = o ? cJSON_PrintUnformatted(o) : NULL;
        int w = snprintf(buf + k, n - k, "%s--%s %s here, %s on rank 0", k ? "; " : "", it->string, va ? va : "?",
                         vb ? vb : "unset");
        free(va);
        free(vb);
        if (w < 0 || (size_t)w >= n - k) break;
        k += (size_t)w;
    }
    for (cJSON *it = b ? b->child : NULL; it; it = it->next) {
        if (cJSON_GetObjectItemCaseSensitive(a, it->string)) continue;
        int w = snprintf(buf + k, n - k, "%s--%s unset here, set on rank 0", k ? "; " : "", it->string);
        if (w < 0 || (size_t)w >= n - k) break;
        k += (size_t)w;
    }
    cJSON_Delete(a);
    cJSON_Delete(b);
}

/* Every rank must run the same build with the same resolved settings: otherwise the
 * ranks would compute different things (or call different collectives and hang). */
static anneal_status check_same_run(trainer *t, bool *usage) {
    char *ref_version = NULL, *ref_config = NULL;
    const char *version = build_id();
    anneal_status st = broadcast_text(t, version, &ref_version);
    if (st == ANNEAL_OK) st = broadcast_text(t, t->config_json, &ref_config);
    if (st != ANNEAL_OK) {
        free(ref_version);
        free(ref_config);
        return restate(st, "cannot reach the other ranks: ");
    }
    /* the hash all-reduce is what every rank agrees on; the texts only explain */
    uint64_t hv = hash_text(version), hc = hash_text(t->config_json);
    float bad[2] = {hv != hash_text(ref_version) ? 1.0f : 0.0f, hc != hash_text(ref_config) ? 1.0f : 0.0f};
    float mine[2] = {bad[0], bad[1]};
    st = anneal_comm_allreduce(t->comm, bad, 2, ANNEAL_F32, ANNEAL_REDUCE_SUM);
    if (st != ANNEAL_OK) {
        free(ref_version);
        free(ref_config);
        return restate(st, "cannot reach the other ranks: ");
    }
    if (mine[0] > 0) {
        st = anneal_set_error(ANNEAL_ERR_STATE, "this rank runs anneal %s but rank 0 runs %s: every rank must run the "
                                                "same anneal binary", version, ref_version);
    } else if (mine[1] > 0) {
        char diff[1024];
        config_diff(t->config_json, ref_config, diff, sizeof diff);
        *usage = true;
        st = anneal_set_error(ANNEAL_ERR_ARG, "the settings of this rank differ from rank 0's (%s): every rank must "
                                              "be started with the same flags and config file", diff);
    } else if (bad[0] > 0) {
        st = anneal_set_error(ANNEAL_ERR_STATE, "stopping: %g rank(s) run another anneal build than rank 0 (%s)",
                              (double)bad[0], ref_version);
    } else if (bad[1] > 0) {
        *usage = true;
        st = anneal_set_error(ANNEAL_ERR_ARG, "stopping: %g rank(s) were started with other settings than rank 0 "
                                              "(see their messages)", (double)bad[1]);
    }
    free(ref_version);
    free(ref_config);
    return st;
}

/* Optimizer state tensor names of the run's optimizer (AdamW). */
static const char *const state_names[] = {"exp_avg", "exp_avg_sq"};

/* Replaces the plain optimizer setup made by the sharded one of d, moving over its
 * state when a resume restored it. Collective. */
static anneal_status make_zero_optimizer(trainer *t) {
    anneal_optimizer *plain = t->opt;
    anneal_params *ps = t->model->params;
    anneal_optimizer *z = anneal_optimizer_new_zero(ps, anneal_optimizer_config(plain), t->ddp);
    /* (a failure here, out of memory, may leave the other ranks inside a collective) */
    if (!z) return anneal_train_dist_fatal(t, restate(anneal_last_status(), "ZeRO optimizer: "));
    anneal_status st = ANNEAL_OK;
    if (t->resume_ckpt[0]) {
        /* the checkpoint holds the full state (any world size wrote it): assemble the full
         * tensors, fill them, keep this rank's shard */
        st = anneal_optimizer_init_state(z);
        anneal_status g = anneal_optimizer_gather_state(z); /* collective: every rank calls it */
        if (st == ANNEAL_OK) st = g;
        for (int i = 0; i < ps->n && st == ANNEAL_OK; i++) {
            for (int j = 0; j < 2 && st == ANNEAL_OK; j++) {
                anneal_tensor *src = anneal_optimizer_state(plain, i, state_names[j]);
                anneal_tensor *dst = anneal_optimizer_state(z, i, state_names[j]);
                if (!src || !dst || anneal_numel(src) != anneal_numel(dst))
                    st = anneal_set_error(ANNEAL_ERR_STATE, "ZeRO optimizer: no full state %s for %s to restore",
                                          state_names[j], ps->items[i].name);
                else memcpy(anneal_data(dst), anneal_data(src), (size_t)anneal_numel(src) * sizeof(float));
            }
            if (st == ANNEAL_OK) st = anneal_optimizer_set_param_steps(z, i, anneal_optimizer_param_steps(plain, i));
        }
        if (st == ANNEAL_OK) st = anneal_optimizer_set_step_count(z, anneal_optimizer_step_count(plain));
        /* every rank must reach the scatter (collective) even if its copy failed */
        anneal_status sc = anneal_optimizer_scatter_state(z);
        if (st == ANNEAL_OK) st = sc;
    }
    anneal_optimizer_free(plain);
    t->opt = z;
    return st;
}

anneal_status anneal_train_dist_setup(trainer *t, bool *usage) {
    if (!distributed(t)) return ANNEAL_OK;
    anneal_status st = t->world > 1 ? check_same_run(t, usage) : ANNEAL_OK;
    if (st != ANNEAL_OK) return st;
    /* the fp16 loss scaler unscales and checks the full gradients in .grad, which ZeRO
     * replaces by each rank's shard (every rank takes this branch: same settings) */
    if (t->use_scaler && t->cfg.zero > 0) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--zero %lld: not available with the fp16 loss scaler yet (use --zero 0, "
                                                "or --dtype bf16)", (long long)t->cfg.zero);
    }
    /* an overflow step would carry Inf into the error feedback, and the scale would
     * change the units of the error between steps */
    if (t->use_scaler && compressing(t)) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--grad-compress powersgd: not available with the fp16 loss scaler "
                                                "(use --dtype bf16 or fp32)");
    }
    if (t->cfg.pp > 1) { /* --pp: stages x replicas (pipeline.c) */
        st = anneal_train_dist_agree(t, anneal_train_pp_build(t, usage), "setting up the pipeline");
        if (st == ANNEAL_OK) st = anneal_train_dist_agree(t, anneal_train_pp_optimizer(t), "setting up the optimizer");
        /* PowerSGD on the stage's sync over its data group (the replicas of the stage) */
        if (st == ANNEAL_OK && compressing(t))
            st = anneal_train_dist_agree(t, t->ddp ? make_powersgd(t) : ANNEAL_OK, "setting up PowerSGD");
        if (st == ANNEAL_OK)
            st = anneal_train_dist_agree(t, t->rank == 0 ? anneal_train_create_run_dir(t) : ANNEAL_OK,
                                         "creating the run directory");
        return st;
    }
    if (t->cfg.zero == 3 && (st = anneal_train_zero3_check(t, usage)) != ANNEAL_OK) return st;
    anneal_ddp_config dc = anneal_ddp_defaults();
    dc.bucket_bytes = (int64_t)(t->cfg.bucket_mb * 1048576.0);
    if (dc.bucket_bytes < 4) dc.bucket_bytes = 4;
    dc.overlap = t->cfg.overlap;
    dc.zero_stage = (int)t->cfg.zero;
    int *groups = t->cfg.zero == 3 ? anneal_zero3_groups(t->model) : NULL; /* buckets follow the blocks */
    dc.groups = groups;
    /* --tp: the sync runs over the replicas (the ranks holding the same shards) */
    t->ddp = t->cfg.zero != 3 || groups ? anneal_ddp_new(anneal_train_tp_dp_comm(t), t->model->params, dc) : NULL;
    free(groups);
    if (!t->ddp) st = restate(anneal_last_status(), "gradient sync: ");
    if (st == ANNEAL_OK && compressing(t)) st = make_powersgd(t);
    if (st == ANNEAL_OK) st = anneal_train_det_attach(t); /* --deterministic: the ordered combine */
    st = anneal_train_dist_agree(t, st, "setting up the gradient sync");
    if (st != ANNEAL_OK) return st;
    /* a new run: every rank starts from rank 0's weights (the same seed gives the same
     * ones anyway; --init files could differ between hosts); a resume: the same */
    if ((st = anneal_ddp_broadcast_params(t->ddp)) != ANNEAL_OK) return restate(st, "broadcast of the parameters: ");
    /* ZeRO-3: from here on each rank keeps its shard of the parameters (collective) */
    if (t->cfg.zero == 3 && !(t->z3 = anneal_zero3_new(t->ddp, t->model)))
        return anneal_train_dist_fatal(t, restate(anneal_last_status(), "ZeRO-3: "));
    if (t->cfg.zero > 0) st = make_zero_optimizer(t);
    if ((st = anneal_train_dist_agree(t, st, "setting up the optimizer")) != ANNEAL_OK) return st;
    /* only now, so a job refused for its settings leaves no run directory behind */
    if (t->world > 1) st = anneal_train_dist_agree(t, t->rank == 0 ? anneal_train_create_run_dir(t) : ANNEAL_OK,
                                            "creating the run directory");
    return st;
}

anneal_status anneal_train_dist_mean(trainer *t, double *x) {
    if (!distributed(t) || t->world <= 1) return ANNEAL_OK;
    float v = (float)*x;
    anneal_status st = anneal_comm_allreduce(t->comm, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_MEAN);
    if (st == ANNEAL_OK) *x = v;
    return st;
}

anneal_status anneal_train_dist_any(trainer *t, bool *flag) {
    if (!t->comm || t->world <= 1) return ANNEAL_OK;
    float v = *flag ? 1.0f : 0.0f;
    anneal_status st = anneal_comm_allreduce(t->comm, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_SUM);
    if (st == ANNEAL_OK) *flag = v > 0;
    return st;
}

anneal_status anneal_train_dist_ckpt_begin(trainer *t) {
    /* --offload optimizer: the state comes out of its file for the snapshot */
    anneal_status so = anneal_optimizer_offload_gather(t->opt);
    if (so != ANNEAL_OK) return so;
    if (t->ddp && t->cfg.zero > 0) {
        if (t->z3 && (so = anneal_zero3_gather_all(t->z3)) != ANNEAL_OK) return so; /* the full parameters */
        if ((so = anneal_optimizer_gather_state(t->opt)) != ANNEAL_OK) return so;
    }
    return ANNEAL_OK;
}

anneal_status anneal_train_dist_save_powersgd(trainer *t) {
    if (!t->psgd) return ANNEAL_OK;
    /* every rank's own error feedback and Q, next to rank 0's checkpoint; the run
     * directory exists on rank 0's host, the others make it on theirs */
    char path[PATH_MAX + 64];
    mkdir(t->run_dir, 0755);
    psgd_path(t, t->run_dir, t->st.step, path, sizeof path);
    anneal_status st = anneal_powersgd_save(t->psgd, path);
    if (st != ANNEAL_OK) return restate(st, "PowerSGD state: ");
    prune_powersgd(t, t->st.step);
    return ANNEAL_OK;
}

anneal_status anneal_train_dist_ckpt_end(trainer *t) {
    anneal_status so = anneal_optimizer_offload_scatter(t->opt); /* back into the file */
    if (so != ANNEAL_OK) return so;
    if ((so = anneal_train_dist_save_powersgd(t)) != ANNEAL_OK) return so;
    if (!t->ddp || t->cfg.zero == 0) return ANNEAL_OK;
    if (t->z3 && (so = anneal_zero3_release_all(t->z3)) != ANNEAL_OK) return so;
    return anneal_optimizer_scatter_state(t->opt);
}

void anneal_train_dist_log_bytes(trainer *t, cJSON *o, bool summary) {
    if (!t->psgd) return;
    anneal_powersgd_stats s = anneal_powersgd_stats_get(t->psgd);
    int64_t a = summary ? s.total_bytes : s.last_bytes, b = summary ? s.total_bytes_uncompressed : s.last_bytes_uncompressed;
    cJSON_AddNumberToObject(o, "comm_bytes", (double)a);
    cJSON_AddNumberToObject(o, "comm_bytes_uncompressed", (double)b);
    if (summary && b > 0)
        anneal_progress_note(t->prog, "  PowerSGD (rank %lld): %.3g MB handed to all-reduce per rank vs %.3g MB "
                             "uncompressed (%.1fx less)", (long long)t->cfg.powersgd_rank, (double)a / 1e6,
                             (double)b / 1e6, a > 0 ? (double)b / (double)a : 0.0);
}

/* This rank's bytes: parameters, gradients (with buckets), optimizer state. */
static void memory_of(trainer *t, double out[3]) {
    int64_t n = anneal_params_numel(t->model->params);
    if (t->ddp) {
        anneal_ddp_memory m = anneal_ddp_memory_get(t->ddp);
        out[0] = (double)m.param_bytes;
        /* PowerSGD's error feedback, P, Q and scratch count as gradient memory */
        out[1] = (double)(m.grad_bytes + m.bucket_bytes + anneal_powersgd_memory_bytes(t->psgd) +
                          anneal_train_det_memory_bytes(t)); /* --deterministic: its sums and buffers */
        if (t->z3) anneal_train_zero3_memory(t, out); /* ZeRO-3: parameters and gradients, their peaks */
        int64_t owned = t->cfg.zero > 0 ? anneal_ddp_shard_numel(t->ddp) : n;
        out[2] = (double)owned * 2.0 * sizeof(float); /* AdamW: exp_avg + exp_avg_sq */
        if (anneal_optimizer_is_offloaded(t->opt)) out[2] = 0; /* in its file (--offload optimizer) */
    } else {
        out[0] = out[1] = out[2] = (double)n * sizeof(float);
        out[2] *= 2.0;
    }
    anneal_train_pp_memory(t, out); /* --pp: the whole model held, the stage's gradients and state */
}

void anneal_train_dist_note_memory(trainer *t) {
    double m[3];
    memory_of(t, m);
    for (int i = 0; i < 3; i++) t->dist_mem_peak[i] = fmax(t->dist_mem_peak[i], m[i]);
}

anneal_status anneal_train_dist_report_memory(trainer *t, const char *when) {
    if (!distributed(t)) return ANNEAL_OK;
    enum { K = 5 }; /* the 3 figures; the allocator's peaks of the parameter and optimizer categories */
    float mine[K], *all = calloc((size_t)t->world * K, sizeof *all);
    if (!all) anneal_comm_abort(t->comm, 1, "out of memory");
    double m[3];
    memory_of(t, m);
    bool peak = t->dist_mem_peak[0] > 0; /* steps ran: report the most seen in one */
    for (int i = 0; i < 3 && peak; i++) m[i] = t->dist_mem_peak[i];
    if (peak) when = "peak in a step";
    for (int i = 0; i < 3; i++) mine[i] = (float)(m[i] / 1048576.0);
    anneal_memory_categories cat = anneal_memory_categories_get(anneal_model_device(t->model));
    mine[3] = (float)((double)cat.peak[ANNEAL_MEM_PARAMETERS] / 1048576.0);
    mine[4] = (float)((double)cat.peak[ANNEAL_MEM_OPTIMIZER] / 1048576.0);
    anneal_status st = anneal_comm_all_gather(t->comm, mine, all, K, ANNEAL_F32);
    if (st == ANNEAL_OK && t->rank == 0) {
        for (int r = 0; r < t->world; r++)
            anneal_progress_note(t->prog,
                                 "memory %s, rank %d: parameters %.1f MiB, gradients %.1f MiB, optimizer state %.1f MiB "
                                 "(total %.1f MiB)",
                                 when, r, (double)all[K * r], (double)all[K * r + 1], (double)all[K * r + 2],
                                 (double)(all[K * r] + all[K * r + 1] + all[K * r + 2]));
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "memory");
        cJSON_AddStringToObject(o, "when", when);
        cJSON_AddNumberToObject(o, "step", (double)t->st.step);
        cJSON_AddNumberToObject(o, "zero", (double)t->cfg.zero);
        cJSON *ranks = cJSON_AddArrayToObject(o, "ranks");
        for (int r = 0; r < t->world; r++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "param_mib", (double)all[K * r]);
            cJSON_AddNumberToObject(e, "grad_mib", (double)all[K * r + 1]);
            cJSON_AddNumberToObject(e, "optim_mib", (double)all[K * r + 2]);
            /* measured: the allocator's highest parameter / optimizer-state bytes since the start */
            cJSON_AddNumberToObject(e, "param_peak_mib", (double)all[K * r + 3]);
            cJSON_AddNumberToObject(e, "optim_peak_mib", (double)all[K * r + 4]);
            cJSON_AddItemToArray(ranks, e);
        }
        anneal_train_log_json(t, o);
    }
    free(all);
    return st;
}

void anneal_train_dist_print_header(trainer *t) {
    if (!distributed(t)) return; /* one process: nothing to say */
    const anneal_train_config *c = &t->cfg;
    anneal_progress_note(t->prog,
                         "distributed: %d rank%s (%s), ZeRO stage %lld, gradient buckets %g MiB, overlap %s, "
                         "per-rank batch %lld (global %lld), %d thread%s per rank%s",
                         t->world, t->world > 1 ? "s" : "", anneal_comm_backend(t->comm), (long long)c->zero,
                         c->bucket_mb, c->overlap ? "on" : "off", (long long)t->local_batch, (long long)c->batch,
                         anneal_get_num_threads(), anneal_get_num_threads() > 1 ? "s" : "",
                         t->psgd ? ", PowerSGD gradient compression" : "");
    anneal_train_pp_print_header(t); /* --pp: the rank layout and the ideal bubble */
    if (t->psgd)
        anneal_progress_note(t->prog, "PowerSGD: rank %lld, plain all-reduce for the first %lld steps, error feedback "
                             "and warm start", (long long)c->powersgd_rank, (long long)c->powersgd_warmup_steps);
}

anneal_status anneal_train_dist_full_params(trainer *t, bool on) {
    if (!t->z3) return ANNEAL_OK;
    return anneal_train_dist_fatal(t, on ? anneal_zero3_gather_all(t->z3) : anneal_zero3_release_all(t->z3));
}

void anneal_train_dist_teardown(trainer *t) {
    anneal_train_det_free(t); /* its comm hook goes before the sync */
    anneal_zero3_free(t->z3); /* before the sync it registered with */
    t->z3 = NULL;
    anneal_powersgd_free(t->psgd);
    t->psgd = NULL;
    if (t->ddp) anneal_ddp_free(t->ddp);
    t->ddp = NULL;
    anneal_train_pp_teardown(t); /* after the sync that used its groups */
}

anneal_status anneal_train_dist_fatal(trainer *t, anneal_status st) {
    if (st == ANNEAL_OK || !t->comm || t->world <= 1) return st;
    char msg[1200];
    snprintf(msg, sizeof msg, "rank %d: anneal train: %s (ending the job)", t->rank, anneal_last_error());
    anneal_comm_abort(t->comm, 1, msg);
    return st; /* not reached */
}
