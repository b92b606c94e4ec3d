/* Everything before the first step of a run: resolving where the run lives (a new
 * run directory, or the one a resume continues), the data (train/val shards or
 * synthetic tokens, the tokenizer for samples), the model config (preset, HF
 * config.json, checkpoint, --init), weights (random, --init, or the checkpoint),
 * the optimizer, the schedule, logs, the checkpointer and the MFU denominator. */
#include "train_internal.h"
#include "anneal/cuda.h"
#include "anneal/prepare.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Records a usage error (a setting is at fault). */
#define USAGE(...) (*usage = true, anneal_set_error(ANNEAL_ERR_ARG, __VA_ARGS__))

/* Re-records the current error message with a prefix ("--data: ..."). */
static anneal_status prefix_error(const char *prefix) {
    anneal_status code = anneal_last_status();
    if (code == ANNEAL_OK) code = ANNEAL_ERR_IO;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", anneal_last_error());
    anneal_clear_error();
    return anneal_set_error(code, "%s%s", prefix, msg);
}

/* buf = a "/" b; false (and buf truncated) when it does not fit. */
static bool path_join(char *buf, size_t n, const char *a, const char *b) {
    int k = snprintf(buf, n, "%s/%s", a, b);
    return k >= 0 && (size_t)k < n;
}

static bool is_dir(const char *p) {
    struct stat sb;
    return p && stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static bool exists(const char *p) {
    struct stat sb;
    return p && stat(p, &sb) == 0;
}

/* mkdir -p. */
static int mkdir_p(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return ENAMETOOLONG;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return errno;
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return errno;
    return is_dir(buf) ? 0 : ENOTDIR;
}

/* Replaces *s (a path that exists) by its absolute form, so a saved config still
 * names it when a resume runs from another directory. */
static void absolutize(char **s) {
    if (!*s || **s == '/' || !strcmp(*s, "gpt2")) return;
    char *r = realpath(*s, NULL);
    if (r) free(*s), *s = r;
}

/* True when dir already holds a run: a `latest` pointer or a ckpt_* directory. */
static bool holds_run(const char *dir, char *what, size_t n) {
    char p[PATH_MAX];
    if (!path_join(p, sizeof p, dir, "latest")) return false;
    if (exists(p)) {
        snprintf(what, n, "%s", p);
        return true;
    }
    DIR *d = opendir(dir);
    if (!d) return false;
    bool found = false;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, "ckpt_", 5)) {
            if (!path_join(what, n, dir, e->d_name)) snprintf(what, n, "%s", e->d_name);
            found = true;
            break;
        }
    closedir(d);
    return found;
}

/* True when dir has a file <split>_*.bin. */
static bool has_split(const char *dir, const char *split) {
    DIR *d = opendir(dir);
    if (!d) return false;
    size_t k = strlen(split);
    bool found = false;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (!strncmp(e->d_name, split, k) && e->d_name[k] == '_' && n > 4 && !strcmp(e->d_name + n - 4, ".bin")) {
            found = true;
            break;
        }
    }
    closedir(d);
    return found;
}

/* runs/<YYYYmmdd-HHMMSS>[-N] that does not exist yet. */
static void default_run_dir(char *buf, size_t n) {
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    char stamp[32];
    strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
    snprintf(buf, n, "runs/%s", stamp);
    for (int i = 2; exists(buf) && i < 1000; i++) snprintf(buf, n, "runs/%s-%d", stamp, i);
}

anneal_status anneal_train_resume_config(const anneal_train_config *c, char *ckpt_dir, size_t ckpt_dir_len,
                                         char **config_json) {
    *config_json = NULL;
    const char *arg = c->resume_dir ? c->resume_dir : c->out;
    if (!arg)
        return anneal_set_error(ANNEAL_ERR_ARG, "--resume: which run? give --resume DIR or --out DIR");
    if (anneal_checkpoint_resolve(arg, ckpt_dir, ckpt_dir_len) != ANNEAL_OK) return prefix_error("--resume: ");
    anneal_model_config mc;
    if (anneal_checkpoint_read_config(ckpt_dir, &mc, config_json) != ANNEAL_OK) return prefix_error("--resume: ");
    return ANNEAL_OK;
}

/* Loads the tokenizer for samples. An explicit --tokenizer that fails or does not
 * match the data is an error; the one prepare.json names only turns samples off. */
static anneal_status load_tokenizer(trainer *t) {
    const anneal_train_config *c = &t->cfg;
    bool explicit_tok = c->tokenizer != NULL;
    char *spec = NULL;
    if (explicit_tok) spec = strdup(c->tokenizer);
    else if (c->data && !c->synthetic && anneal_prepare_tokenizer_spec(c->data, &spec) != ANNEAL_OK)
        return prefix_error("--data: ");
    if (!spec) {
        if (c->sample_every > 0)
            anneal_progress_note(t->prog, "note: no tokenizer (give --tokenizer): samples are off");
        return ANNEAL_OK;
    }
    anneal_status st = anneal_tokenizer_load(spec, &t->tok);
    if (st != ANNEAL_OK) {
        if (explicit_tok) {
            free(spec);
            return prefix_error("--tokenizer: ");
        }
        anneal_progress_note(t->prog, "note: cannot load the tokenizer %s named in prepare.json of %s (%s): samples are "
                                      "off, checkpoints carry no tokenizer",
                             spec, c->data, anneal_last_error());
        anneal_clear_error();
        free(spec);
        return ANNEAL_OK;
    }
    uint64_t fp = anneal_tokenizer_fingerprint(t->tok);
    if (t->data_fingerprint && fp != t->data_fingerprint) {
        anneal_tokenizer_free(t->tok);
        t->tok = NULL;
        if (explicit_tok) {
            anneal_status e = anneal_set_error(ANNEAL_ERR_ARG,
                                               "--tokenizer %s: fingerprint %016llx does not match the data's %016llx "
                                               "(the shards were made with another tokenizer)",
                                               spec, (unsigned long long)fp, (unsigned long long)t->data_fingerprint);
            free(spec);
            return e;
        }
        anneal_progress_note(t->prog, "note: tokenizer %s (named in prepare.json of %s) does not match the data's "
                                      "fingerprint: samples are off, checkpoints carry no tokenizer", spec, c->data);
    }
    free(spec);
    return ANNEAL_OK;
}

/* Where the run lives and, for a resume, which checkpoint it continues from (nothing
 * is created yet). */
static anneal_status resolve_run_dir(trainer *t, bool *usage, anneal_model_config *ck_cfg) {
    anneal_train_config *c = &t->cfg;
    if (c->resume) {
        char *json = NULL;
        if (anneal_train_resume_config(c, t->resume_ckpt, sizeof t->resume_ckpt, &json) != ANNEAL_OK) {
            *usage = anneal_last_status() == ANNEAL_ERR_ARG;
            return anneal_last_status();
        }
        free(json);
        if (anneal_checkpoint_read_config(t->resume_ckpt, ck_cfg, NULL) != ANNEAL_OK) return prefix_error("--resume: ");
        const char *arg = c->resume_dir ? c->resume_dir : c->out;
        if (c->out) {
            snprintf(t->run_dir, sizeof t->run_dir, "%s", c->out);
        } else {
            /* --resume RUN_DIR continues in RUN_DIR; --resume RUN_DIR/ckpt_N in RUN_DIR */
            char *ra = realpath(arg, NULL), *rc = realpath(t->resume_ckpt, NULL);
            bool is_ckpt = ra && rc && !strcmp(ra, rc);
            if (is_ckpt) {
                char tmp[PATH_MAX];
                snprintf(tmp, sizeof tmp, "%s", rc);
                snprintf(t->run_dir, sizeof t->run_dir, "%s", dirname(tmp));
            } else {
                snprintf(t->run_dir, sizeof t->run_dir, "%s", arg);
            }
            free(ra);
            free(rc);
        }
    } else if (c->out) {
        snprintf(t->run_dir, sizeof t->run_dir, "%s", c->out);
    } else {
        default_run_dir(t->run_dir, sizeof t->run_dir);
    }
    /* a new run (or a resume into another directory) must not clobber a run */
    char what[PATH_MAX + 16];
    if (holds_run(t->run_dir, what, sizeof what)) {
        char *a = realpath(t->run_dir, NULL), *b = NULL;
        if (c->resume) {
            char tmp[PATH_MAX];
            snprintf(tmp, sizeof tmp, "%s", t->resume_ckpt);
            b = realpath(dirname(tmp), NULL);
        }
        bool same = a && b && !strcmp(a, b);
        free(a);
        free(b);
        if (!same)
            return USAGE("--out %s: already holds a run (%s): continue it with --resume %s, or choose another --out",
                         t->run_dir, what, t->run_dir);
    }
    return ANNEAL_OK;
}

/* Creates the run directory and opens the logs (last in setup, so a run refused for
 * its settings leaves nothing behind). */
static anneal_status create_run_dir(trainer *t) {
    int e = mkdir_p(t->run_dir);
    if (e) return anneal_set_error(ANNEAL_ERR_IO, "--out %s: cannot create the run directory: %s", t->run_dir, strerror(e));
    char log[PATH_MAX + 16];
    path_join(log, sizeof log, t->run_dir, "log.jsonl");
    if (anneal_jsonl_open(log, &t->log) != ANNEAL_OK) return prefix_error("--out: ");
    if (t->cfg.log_jsonl && anneal_jsonl_open(t->cfg.log_jsonl, &t->log_extra) != ANNEAL_OK)
        return prefix_error("--log-jsonl: ");
    return anneal_train_open_telemetry(t);
}

anneal_status anneal_train_create_run_dir(trainer *t) { return create_run_dir(t); }

/* Opens the train (and, when present, val) split or the synthetic streams. */
static anneal_status open_data(trainer *t, bool *usage, int32_t synth_vocab) {
    anneal_train_config *c = &t->cfg;
    if (c->synthetic) {
        anneal_train_source_open_synthetic(&t->train, anneal_train_det_rows(t), c->seq, (uint64_t)c->seed, 0, synth_vocab, t->data_rank, t->data_world);
        /* --deterministic: every rank reads the whole val batches one process reads */
        anneal_train_source_open_synthetic(&t->val, t->local_batch, c->seq, (uint64_t)c->seed, 1, synth_vocab,
                                           c->deterministic ? 0 : t->data_rank, c->deterministic ? 1 : t->data_world);
        t->has_val = true;
        return ANNEAL_OK;
    }
    if (!is_dir(c->data)) {
        if (exists(c->data))
            return anneal_set_error(ANNEAL_ERR_IO, "--data %s: not a directory (give the directory anneal prepare wrote)",
                                    c->data);
        return anneal_set_error(ANNEAL_ERR_IO, "--data %s: no such directory", c->data);
    }
    if (!has_split(c->data, "train"))
        return anneal_set_error(ANNEAL_ERR_IO, "--data %s: no train_*.bin shards (make them with anneal prepare)", c->data);
    /* shards without prepare.json: a prepare that was killed (some shards may be missing) */
    if (anneal_prepare_check_dir(c->data) != ANNEAL_OK) return prefix_error("--data: ");
    if (anneal_train_source_open_loader(&t->train, c->data, "train", anneal_train_det_rows(t), c->seq, (uint64_t)c->seed, c->shuffle, true,
                                 t->data_rank, t->data_world) != ANNEAL_OK) {
        *usage = anneal_last_status() == ANNEAL_ERR_ARG; /* too few tokens for --seq */
        return prefix_error("--data: ");
    }
    t->data_fingerprint = anneal_loader_fingerprint(t->train.loader);
    if (has_split(c->data, "val") && c->eval_batches > 0) {
        if (anneal_train_source_open_loader(&t->val, c->data, "val", t->local_batch, c->seq, (uint64_t)c->seed, false, false,
                                            c->deterministic ? 0 : t->data_rank, c->deterministic ? 1 : t->data_world) !=
            ANNEAL_OK) {
            if (anneal_last_status() != ANNEAL_ERR_ARG) return prefix_error("--data (val split): ");
            /* printed once the settings are known good (a bad --seq is told first) */
            snprintf(t->val_note, sizeof t->val_note, "note: val split unusable (%s): no evaluation", anneal_last_error());
            anneal_clear_error();
        } else if (anneal_loader_fingerprint(t->val.loader) != t->data_fingerprint) {
            return anneal_set_error(ANNEAL_ERR_FORMAT, "--data %s: val and train shards come from different tokenizers",
                                    c->data);
        } else {
            t->has_val = true;
        }
    } else if (c->eval_batches > 0 && c->eval_every > 0) {
        anneal_progress_note(t->prog, "note: %s has no val_*.bin shards: no evaluation", c->data);
    }
    return ANNEAL_OK;
}

/* The model config: --config, --model, the checkpoint being resumed, --init's, or
 * the tiny preset; the data's vocabulary for presets. */
static anneal_status resolve_model(trainer *t, bool *usage, const anneal_model_config *ck_cfg) {
    anneal_train_config *c = &t->cfg;
    anneal_model_config mc;
    bool from_preset = false;
    if (c->config) {
        if (anneal_model_config_from_hf_file(c->config, &mc) != ANNEAL_OK) {
            *usage = true;
            return prefix_error("--config: ");
        }
        snprintf(t->model_source_buf, sizeof t->model_source_buf, "config %s", c->config);
    } else if (c->model) {
        if (!anneal_model_preset(c->model, &mc)) return USAGE("--model: unknown preset '%s'", c->model);
        from_preset = true;
        snprintf(t->model_source_buf, sizeof t->model_source_buf, "preset %s", c->model);
    } else if (c->resume) {
        mc = *ck_cfg;
        snprintf(t->model_source_buf, sizeof t->model_source_buf, "from the checkpoint");
    } else if (c->init) {
        char cfgp[PATH_MAX + 16];
        if (anneal_quant_dir_is_quantized(c->init))
            return USAGE("--init %s: an int8 quantized model cannot be trained (it runs inference only): "
                         "train the float model it was quantized from", c->init);
        if (anneal_train_init_is_checkpoint(c->init)) {
            char ck[PATH_MAX];
            if (anneal_checkpoint_resolve(c->init, ck, sizeof ck) != ANNEAL_OK ||
                anneal_checkpoint_read_config(ck, &mc, NULL) != ANNEAL_OK)
                return prefix_error("--init: ");
        } else if (is_dir(c->init)) { /* a Hugging Face model directory */
            if (anneal_hf_config_path(c->init, cfgp, sizeof cfgp) != ANNEAL_OK) return prefix_error("--init: ");
            if (anneal_model_config_from_hf_file(cfgp, &mc) != ANNEAL_OK) return prefix_error("--init: ");
        } else {
            char tmp[PATH_MAX];
            snprintf(tmp, sizeof tmp, "%s", c->init);
            if (!path_join(cfgp, sizeof cfgp, dirname(tmp), "config.json") || !exists(cfgp))
                return USAGE("--init %s: cannot tell the model's shape: give --model or --config (no config.json beside it)",
                             c->init);
            if (anneal_model_config_from_hf_file(cfgp, &mc) != ANNEAL_OK) return prefix_error("--init: ");
        }
        snprintf(t->model_source_buf, sizeof t->model_source_buf, "the config of --init");
    } else {
        anneal_model_preset("tiny", &mc);
        from_preset = true;
        snprintf(t->model_source_buf, sizeof t->model_source_buf, "preset tiny");
    }
    t->model_source = t->model_source_buf;
    int32_t data_vocab = c->synthetic ? 0 : t->train.vocab;
    if (from_preset && !c->init && data_vocab > 0) mc.vocab_size = data_vocab;
    if (data_vocab > mc.vocab_size)
        return USAGE("--data: the shards use a vocabulary of %d ids but the model's vocab_size is %d", data_vocab,
                     mc.vocab_size);
    if (c->dropout >= 0) mc.dropout = (float)c->dropout;
    mc.recompute = ANNEAL_RECOMPUTE_NONE;
    if (c->recompute && !anneal_recompute_parse(c->recompute, &mc.recompute))
        return USAGE("--recompute: unknown mode '%s' (none, attn, block)", c->recompute);
    if (anneal_model_config_check(&mc) != ANNEAL_OK) {
        *usage = true;
        return prefix_error(c->config ? "--config: " : "model: ");
    }
    if (c->seq > mc.n_ctx) return USAGE("--seq: %lld is more than the model's n_ctx %d", (long long)c->seq, mc.n_ctx);
    if (c->resume) {
        const anneal_model_config *k = ck_cfg;
        if (strcmp(k->arch, mc.arch))
            return USAGE("--resume: the checkpoint %s holds a %s model but this run asks for %s: a resume cannot change "
                         "the architecture (start a new run, e.g. with --init %s)",
                         t->resume_ckpt, k->arch, mc.arch, t->resume_ckpt);
        if (k->n_layer != mc.n_layer || k->n_head != mc.n_head || k->n_embd != mc.n_embd ||
            k->vocab_size != mc.vocab_size || k->n_ctx != mc.n_ctx || k->n_kv_head != mc.n_kv_head ||
            k->n_ff != mc.n_ff)
            return USAGE("--resume: the checkpoint %s holds a model of n_layer %d, n_head %d, n_embd %d, vocab %d, "
                         "n_ctx %d, but this run asks for n_layer %d, n_head %d, n_embd %d, vocab %d, n_ctx %d: a resume "
                         "cannot change the model's shape (start a new run, e.g. with --init %s)",
                         t->resume_ckpt, k->n_layer, k->n_head, k->n_embd, k->vocab_size, k->n_ctx, mc.n_layer,
                         mc.n_head, mc.n_embd, mc.vocab_size, mc.n_ctx, t->resume_ckpt);
    }
    t->mcfg = mc;
    return ANNEAL_OK;
}

static anneal_status build_model_tagged(trainer *t, bool *usage);

/* Weights: random init, then --init, or everything from the resumed checkpoint; their
 * storages are charged to the parameters in the memory breakdown. */
static anneal_status build_model(trainer *t, bool *usage) {
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_PARAMETERS);
    anneal_status st = build_model_tagged(t, usage);
    anneal_memory_category_set(mc);
    return st;
}

static anneal_status build_model_tagged(trainer *t, bool *usage) {
    anneal_train_config *c = &t->cfg;
    /* on the device of --device (resolved in setup); checkpoints and --init load into it */
    bool stage_only = anneal_train_pp_stage_only(t); /* --pp: only this stage's parameters (pp_setup.c) */
    /* --tp alone: none here (every source checked, nothing read); tp.c's make_shards fills
     * and cuts the tensors a batch at a time (anneal_train_fill_held) */
    bool part = stage_only || anneal_train_tp_by_param(t);
    anneal_params_defer_storage(part);
    t->model = anneal_model_new(&t->mcfg, t->device);
    anneal_params_defer_storage(false);
    if (!t->model) return prefix_error("model: ");
    if (stage_only && anneal_train_pp_hold_stage(t) != ANNEAL_OK) return prefix_error("model: ");
    if (!c->resume) {
        if (anneal_model_init(t->model, (uint64_t)c->seed) != ANNEAL_OK) return prefix_error("model init: ");
        if (c->init) {
            anneal_status st;
            if (anneal_train_init_is_checkpoint(c->init)) {
                char ck[PATH_MAX];
                anneal_train_state tmp;
                st = anneal_checkpoint_resolve(c->init, ck, sizeof ck);
                if (st == ANNEAL_OK) st = anneal_checkpoint_load(ck, t->model, NULL, &tmp);
                /* ids of another tokenizer (of the same vocabulary size) mean other tokens: refused as --resume does */
                if (st == ANNEAL_OK && tmp.tokenizer_fingerprint && t->data_fingerprint &&
                    tmp.tokenizer_fingerprint != t->data_fingerprint)
                    return USAGE("--init: the checkpoint %s was trained on data of tokenizer %016llx but --data %s has "
                                 "%016llx (the same ids would mean other tokens)",
                                 ck, (unsigned long long)tmp.tokenizer_fingerprint, c->data,
                                 (unsigned long long)t->data_fingerprint);
            } else { /* a model directory, a .safetensors file or a sharded set's index */
                st = anneal_model_load_hf_weights(t->model, c->init);
            }
            if (st != ANNEAL_OK) return prefix_error("--init: ");
        }
    }
    /* LoRA (lora.c): adapters on the base, the base frozen; on resume the base rebuilt first */
    anneal_status ls = anneal_train_setup_lora(t, usage);
    if (ls != ANNEAL_OK) return ls;
    anneal_optim_config oc = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    oc.beta1 = c->beta1;
    oc.beta2 = c->beta2;
    oc.eps = c->eps;
    oc.weight_decay = c->weight_decay;
    t->opt = anneal_optimizer_new(t->model->params, oc);
    if (!t->opt) return prefix_error("optimizer: ");
    t->st.best_val_loss = NAN;
    t->st.tokenizer_fingerprint = t->data_fingerprint;
    if (c->resume) {
        anneal_train_state st;
        /* --pp stage only: the stage's optimizer state is read with its optimizer (pipeline.c);
         * --tp alone by parameter: in batches, sliced (tp.c) */
        if (anneal_checkpoint_load(t->resume_ckpt, t->model, part ? NULL : t->opt, &st) != ANNEAL_OK)
            return prefix_error("--resume: ");
        if (st.tokenizer_fingerprint && t->data_fingerprint && st.tokenizer_fingerprint != t->data_fingerprint)
            return USAGE("--resume: the checkpoint was trained on data of tokenizer %016llx but --data %s has %016llx",
                         (unsigned long long)st.tokenizer_fingerprint, c->data, (unsigned long long)t->data_fingerprint);
        t->st = st;
        t->st.tokenizer_fingerprint = t->data_fingerprint;
        if (anneal_train_source_set_cursor(&t->train, st.cursor) != ANNEAL_OK)
            return prefix_error("--resume: cannot restore the data position (--batch or --seq changed?): ");
        anneal_rng_set(st.rng);
    }
    return ANNEAL_OK;
}

/* The MFU denominator of a CPU run without --peak-gflops: the FMA (or bf16 dot-product)
 * microbenchmark of the run's matmul precision on this process's threads, summed over
 * the ranks, since the step's tokens are the whole job's. ANNEAL_TEST_PEAK_GFLOPS
 * stands in for this process's measurement (a test of the loop's re-measure on a
 * disturbed start-up figure). Collective when distributed: every rank calls it. */
static anneal_status measured_peak(trainer *t) {
    const char *isa = "?";
    int th = anneal_get_num_threads();
    const char *fake = getenv("ANNEAL_TEST_PEAK_GFLOPS");
    t->peak_gflops = fake && *fake ? strtod(fake, NULL) : anneal_peak_gflops_measure_dtype(th, 0.05, t->dtype, &isa);
    if (fake && *fake) isa = "ANNEAL_TEST_PEAK_GFLOPS";
    if (t->comm && t->world > 1) {
        float v = (float)t->peak_gflops;
        anneal_status st = anneal_comm_allreduce(t->comm, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_SUM);
        if (st != ANNEAL_OK) return st;
        t->peak_gflops = v;
        snprintf(t->peak_source_buf, sizeof t->peak_source_buf, "measured: %s microbenchmark, %d threads x %d ranks",
                 isa, th, t->world);
    } else {
        snprintf(t->peak_source_buf, sizeof t->peak_source_buf, "measured: %s microbenchmark, %d threads", isa, th);
    }
    t->peak_source = t->peak_source_buf;
    return ANNEAL_OK;
}

/* The MFU denominator of a run on a device other than the CPU without --peak-gflops:
 * the datasheet's dense peak of the GPU for the run's matmul precision (f32: the
 * CUDA cores' FMA rate, TF32 being off by default) for the GPUs anneal is tested on,
 * else 0 (MFU is not reported) and the source says to give --peak-gflops. */
static void device_peak(trainer *t) {
    t->peak_gflops = 0;
    snprintf(t->peak_source_buf, sizeof t->peak_source_buf, "unknown for %s: give --peak-gflops",
             anneal_device_name(t->device));
    t->peak_source = t->peak_source_buf;
    if (t->device != ANNEAL_CUDA) return;
    anneal_device dev;
    int ordinal = -1;
    anneal_cuda_device_info info;
    if (anneal_train_device_parse(t->cfg.device, &dev, &ordinal) != ANNEAL_OK ||
        anneal_cuda_device_info_get(ordinal < 0 ? 0 : ordinal, &info) != ANNEAL_OK) {
        anneal_clear_error();
        return;
    }
    /* dense TFLOP/s: f32 (CUDA cores), bf16/f16 (tensor cores) */
    static const struct { const char *name; double f32, half; } table[] = {
        {"H100 PCIe", 51.2, 756.0}, {"H100 NVL", 60.0, 835.0}, {"H100", 66.9, 989.4},
        {"H200", 66.9, 989.4},      {"H800", 66.9, 989.4},     {"A100", 19.5, 312.0},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strstr(info.name, table[i].name)) {
            t->peak_gflops = 1e3 * (t->dtype == ANNEAL_F32 ? table[i].f32 : table[i].half);
            snprintf(t->peak_source_buf, sizeof t->peak_source_buf, "datasheet: %.60s, %s", info.name,
                     t->dtype == ANNEAL_F32 ? "fp32 CUDA cores" : "tensor cores, dense");
            return;
        }
    snprintf(t->peak_source_buf, sizeof t->peak_source_buf, "unknown for %.60s: give --peak-gflops", info.name);
}

/* Threads of one rank when --threads is 0 (all cores) and OMP_NUM_THREADS is unset:
 * the CPUs this process may run on, shared evenly by the job's ranks on this host when
 * the launcher did not bind them (every rank sees every CPU), so `mpirun -np 2` on 2
 * cores runs 2 x 1 threads instead of 2 x 2 fighting over the cores; a bound rank
 * (mpirun's default --bind-to core) already sees only its own CPUs. */
static int default_rank_threads(const anneal_comm *comm) {
    cpu_set_t mine;
    int online = (int)sysconf(_SC_NPROCESSORS_ONLN), allowed = online;
    if (sched_getaffinity(0, sizeof mine, &mine) == 0) allowed = CPU_COUNT(&mine);
    int local = anneal_comm_local_size(comm);
    int n = allowed >= online && local > 1 ? allowed / local : allowed;
    return n > 0 ? n : 1;
}

anneal_status anneal_train_setup(trainer *t, const anneal_train_config *cfg, FILE *out, bool *usage) {
    anneal_comm *comm = t->comm; /* the one field the caller sets (dist.c) */
    memset(t, 0, sizeof *t);
    *usage = false;
    t->out = out;
    t->comm = comm;
    t->rank = comm ? anneal_comm_rank(comm) : 0;
    t->world = comm ? anneal_comm_size(comm) : 1;
    t->last_ckpt_step = -1;
    if (anneal_train_config_copy(&t->cfg, cfg) != ANNEAL_OK) return ANNEAL_ERR_OOM;
    anneal_train_config *c = &t->cfg;
    t->prog = anneal_progress_new(out, out && isatty(fileno(out)), c->log_every);

    /* settings that only make sense together */
    if (c->synthetic && c->data) return USAGE("--synthetic and --data: give one of them");
    if (!c->synthetic && !c->data)
        return USAGE("--data DIR is required (shards from anneal prepare), or --synthetic for generated tokens");
    if (c->min_lr >= 0 && c->min_lr > c->lr) return USAGE("--min-lr: %g is above --lr %g", c->min_lr, c->lr);
    anneal_status pl = anneal_train_pp_layout(t, usage); /* --pp: replicas = world / pp (pipeline.c) */
    if (pl != ANNEAL_OK) return pl;
    anneal_status tps = anneal_train_tp_begin(t, usage); /* --tp: the rank groups (tp.c) */
    if (tps != ANNEAL_OK) return tps;
    if (c->tp > 1) { /* the data is split over the tensor-parallel groups' replicas */
        t->data_rank = anneal_train_tp_data_rank(t);
        t->data_world = anneal_train_tp_data_world(t);
    }
    if (!c->deterministic && c->batch % t->data_world != 0)
        return USAGE("--batch %lld is not divisible by the %d %s (--batch is the global batch of a micro-step, "
                     "split evenly over the %s)", (long long)c->batch, t->data_world,
                     c->pp > 1 || c->tp > 1 ? "replicas" : "ranks",
                     c->pp > 1 || c->tp > 1 ? "data-parallel replicas" : "ranks");
    t->local_batch = c->deterministic ? c->batch : c->batch / t->data_world; /* deterministic.c: whole micro-batches */
    /* --device: where the model trains (cuda:N chooses the GPU before its first use) */
    t->device = ANNEAL_CPU;
    if (anneal_train_device_resolve(c->device, &t->device) != ANNEAL_OK) {
        *usage = true;
        return anneal_last_status();
    }
    if (t->device != ANNEAL_CPU && t->world > 1)
        return USAGE("--device %s with --np > 1 (%d ranks) needs a communicator for %s (NCCL for CUDA): not built "
                     "yet; train data-parallel on the CPU, or on one device with one process",
                     c->device, t->world, anneal_device_name(t->device));
    if (t->device != ANNEAL_CPU && c->zero > 0)
        return USAGE("--zero %lld with --device %s: ZeRO's sharded state is built for CPU runs only (not built for "
                     "other devices yet)", (long long)c->zero, c->device);
    if (t->device != ANNEAL_CPU && c->offload && strcmp(c->offload, "none"))
        return USAGE("--offload %s with --device %s: the file tier is for CPU runs only (the GPU version, pinned "
                     "host memory on a stream of its own, is not built yet)", c->offload, c->device);
    if (anneal_train_det_check(t) != ANNEAL_OK) return *usage = true, anneal_last_status(); /* --deterministic */
    size_t rows = (size_t)(t->local_batch * c->seq);
    /* the step's micro-batches each in a buffer of their own when they fit in 64 MiB, so
     * a device reads them without a synchronize between micro-batches */
    t->host_bufs = 1;
    if (t->device != ANNEAL_CPU && c->accum > 1 && (double)rows * 8.0 * (double)c->accum <= 64.0 * 1048576.0)
        t->host_bufs = c->accum;
    t->host_ids = malloc((size_t)t->host_bufs * rows * sizeof *t->host_ids);
    t->host_tg = malloc((size_t)t->host_bufs * rows * sizeof *t->host_tg);
    t->losses = calloc((size_t)c->accum, sizeof *t->losses);
    t->host_losses = calloc((size_t)c->accum, sizeof *t->host_losses);
    if (!t->host_ids || !t->host_tg || !t->losses || !t->host_losses)
        return anneal_set_error(ANNEAL_ERR_OOM, "train: out of memory for a batch of %lld x %lld",
                                (long long)t->local_batch, (long long)c->seq);
    if (c->threads > 0) anneal_set_num_threads((int)c->threads);
    else if (t->comm && !getenv("OMP_NUM_THREADS")) anneal_set_num_threads(default_rank_threads(t->comm));
    if (c->pin_threads && anneal_set_thread_pinning(true, t->pin_desc, sizeof t->pin_desc) != ANNEAL_OK)
        return prefix_error("--pin-threads: ");
    /* --model DIR names a model to start from: the same as --init DIR */
    anneal_model_config preset_cfg;
    if (c->model && !anneal_model_preset(c->model, &preset_cfg)) {
        if (c->init) return USAGE("--model %s and --init %s: give the starting weights once", c->model, c->init);
        c->init = c->model;
        c->model = NULL;
    }
    absolutize(&c->data);
    absolutize(&c->config);
    absolutize(&c->init);
    if (c->tokenizer && exists(c->tokenizer)) absolutize(&c->tokenizer);
    const char *hook = getenv("ANNEAL_TEST_INJECT_NAN");
    if (anneal_train_parse_nan_steps(hook, &t->nan_steps, &t->n_nan_steps) != ANNEAL_OK) return anneal_last_status();
    if (anneal_train_parse_inf_grad(getenv("ANNEAL_TEST_INF_GRAD"), &t->inf_rank, &t->inf_steps, &t->n_inf_steps) !=
        ANNEAL_OK)
        return anneal_last_status();

    anneal_model_config ck_cfg;
    memset(&ck_cfg, 0, sizeof ck_cfg);
    anneal_status st;
    if ((st = resolve_run_dir(t, usage, &ck_cfg))) return st;
    /* synthetic tokens use the vocabulary of the model they train */
    anneal_model_config pre;
    int32_t synth_vocab = 512;
    if (c->config && anneal_model_config_from_hf_file(c->config, &pre) == ANNEAL_OK) synth_vocab = pre.vocab_size;
    else if (c->model && anneal_model_preset(c->model, &pre)) synth_vocab = pre.vocab_size;
    else if (c->resume) synth_vocab = ck_cfg.vocab_size;
    else if (c->init && !anneal_train_init_is_checkpoint(c->init)) { /* a Hugging Face model's vocabulary */
        char cfgp[PATH_MAX + 16];
        if (anneal_hf_config_path(c->init, cfgp, sizeof cfgp) == ANNEAL_OK &&
            anneal_model_config_from_hf_file(cfgp, &pre) == ANNEAL_OK)
            synth_vocab = pre.vocab_size;
    } else if (c->init) {
        char ck[PATH_MAX];
        if (anneal_checkpoint_resolve(c->init, ck, sizeof ck) == ANNEAL_OK &&
            anneal_checkpoint_read_config(ck, &pre, NULL) == ANNEAL_OK)
            synth_vocab = pre.vocab_size;
    }
    anneal_clear_error();
    if ((st = open_data(t, usage, synth_vocab))) return st;
    if ((st = resolve_model(t, usage, &ck_cfg))) return st;
    if (t->val_note[0]) anneal_progress_note(t->prog, "%s", t->val_note);
    /* the tokenizer: for samples, and carried by every checkpoint */
    if ((c->sample_every > 0 || c->tokenizer || (c->data && !c->synthetic)) && (st = load_tokenizer(t))) {
        *usage = st == ANNEAL_ERR_ARG;
        return st;
    }
    if ((st = build_model(t, usage))) return st;
    if ((st = anneal_train_tp_shard(t, usage))) return st; /* --tp: this rank's shards (tp.c) */
    if ((st = anneal_train_setup_precision(t, usage))) return st; /* --dtype, fp16 loss scaler */
    /* distributed: rank 0 creates it once every rank's setup worked (anneal_train_dist_setup) */
    if (t->world == 1 && (st = create_run_dir(t))) return st;

    /* length and schedule */
    t->tokens_per_step = c->batch * c->seq * c->accum;
    t->total_steps = c->tokens > 0 ? (c->tokens + t->tokens_per_step - 1) / t->tokens_per_step : c->steps;
    t->start_step = t->st.step;
    anneal_schedule_parse(c->schedule ? c->schedule : "cosine", &t->sch.kind);
    t->sch.max_lr = c->lr;
    t->sch.min_lr = c->min_lr >= 0 ? c->min_lr : c->lr / 10;
    t->sch.warmup_steps = c->warmup;
    t->sch.total_steps = t->total_steps;
    t->sch.decay_steps = t->total_steps / 5 > 0 ? t->total_steps / 5 : 1;

    /* evaluation size: at most one pass over the val split */
    t->eval_batches = c->eval_batches;
    if (t->has_val && !c->synthetic) {
        uint64_t w = anneal_train_source_windows(&t->val),
                 per = (uint64_t)(t->local_batch * (c->deterministic ? 1 : t->world));
        int64_t cap = (int64_t)(w / per > 0 ? w / per : 1);
        if (t->eval_batches > cap) t->eval_batches = cap;
    }

    t->flops_per_token = anneal_model_flops_per_token(t->model, c->seq);
    if (c->peak_gflops > 0) {
        t->peak_gflops = c->peak_gflops;
        t->peak_source = "--peak-gflops";
    } else if (t->device != ANNEAL_CPU) {
        device_peak(t); /* a datasheet figure, or none (MFU not reported) */
    } else {
        anneal_status st = measured_peak(t);
        if (st != ANNEAL_OK) return st;
    }

    t->config_json = anneal_train_config_to_json(c);
    t->ckpt = anneal_checkpointer_new(t->run_dir, (int)c->keep);
    if (!t->config_json || !t->ckpt) return prefix_error("checkpointer: ");
    anneal_checkpointer_set_tokenizer(t->ckpt, t->tok); /* tokenizer.json + tokenizer_config.json in each checkpoint */
    return ANNEAL_OK;
}

void anneal_train_teardown(trainer *t) {
    anneal_train_offload_act_free(t); /* first: it may bring tensors back before the model goes */
    if (t->ckpt) anneal_checkpointer_free(t->ckpt);
    anneal_optimizer_free(t->opt);
    anneal_model_free(t->model);
    anneal_train_tp_teardown(t);
    anneal_train_source_close(&t->train);
    anneal_train_source_close(&t->val);
    anneal_tokenizer_free(t->tok);
    anneal_jsonl_close(t->log);
    anneal_jsonl_close(t->log_extra);
    anneal_train_close_telemetry(t);
    anneal_progress_free(t->prog);
    free(t->config_json);
    free(t->nan_steps);
    free(t->inf_steps);
    free(t->host_ids);
    free(t->host_tg);
    free(t->losses);
    free(t->host_losses);
    anneal_train_config_free(&t->cfg);
    memset(t, 0, sizeof *t);
}
