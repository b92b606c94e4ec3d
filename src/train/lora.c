/* LoRA fine-tuning in the trainer: after the base weights are in place (the model's
 * init, then --init), the adapters are added (--lora-rank/--lora-alpha/--lora-targets/
 * --lora-dropout, or a PEFT directory with --lora-init) and every base parameter is
 * frozen (bf16 dense weights under --dtype bf16: the products are the same, the memory
 * half). The run records the base (its path and a fingerprint of its weights) in the
 * train state, so its checkpoints hold only the adapters and their optimizer state. A
 * resume rebuilds the base from that path, refuses it when its fingerprint changed,
 * adds the same adapters and lets the checkpoint fill them. --init of a LoRA checkpoint
 * (which the checkpoint load gives with its base and adapters) continues its adapters. */
#include "train_internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "anneal/peft.h"

/* The targets when --lora-targets is not given: PEFT's defaults for the model type. */
static const char *default_targets(const char *arch) {
    return strcmp(arch, "gpt2") == 0 ? "c_attn" : "q_proj,v_proj";
}

static bool is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static bool has_file(const char *dir, const char *name) {
    char p[PATH_MAX + 64];
    struct stat sb;
    return (size_t)snprintf(p, sizeof p, "%s/%s", dir, name) < sizeof p && stat(p, &sb) == 0;
}

/* Base weights from path into m, as --init reads them: a checkpoint (or run)
 * directory, a Hugging Face model directory (model.safetensors), or a weights file. */
static anneal_status load_base(anneal_model *m, const char *path) {
    if (is_dir(path) && (has_file(path, "state.json") || has_file(path, "latest") || !has_file(path, "config.json"))) {
        char ck[PATH_MAX];
        anneal_train_state tmp;
        anneal_status s = anneal_checkpoint_resolve(path, ck, sizeof ck);
        return s == ANNEAL_OK ? anneal_checkpoint_load(ck, m, NULL, &tmp) : s;
    }
    return anneal_model_load_hf_weights(m, path); /* a model directory, a weights file or a sharded index */
}

/* Splits "a,b,c" into t (at most 64 names, pointing into buf). */
static int split_targets(char *buf, const char **t, int max) {
    int n = 0;
    for (char *p = strtok(buf, ","); p && n < max; p = strtok(NULL, ",")) t[n++] = p;
    return n;
}

/* The run's LoRA settings from the adapters ps has (a resume repeats them). */
static anneal_status settings_from(anneal_train_config *c, const anneal_params *ps) {
    char *tg = strdup(ps->lora.targets);
    if (!tg) return anneal_set_error(ANNEAL_ERR_OOM, "lora: out of memory");
    free(c->lora_targets);
    c->lora_targets = tg;
    c->lora_rank = ps->lora.rank;
    c->lora_alpha = ps->lora.alpha;
    c->lora_dropout = ps->lora.dropout;
    return ANNEAL_OK;
}

/* Adds the adapters of the run's settings (or of --lora-init) to the model. */
static anneal_status add_adapters(trainer *t, anneal_dtype base_dtype, bool *usage) {
    anneal_train_config *c = &t->cfg;
    anneal_params *ps = t->model->params;
    if (c->lora_init && !(c->resume)) {
        char real[PATH_MAX];
        const char *dir = realpath(c->lora_init, real) ? real : c->lora_init;
        anneal_peft_config pc;
        anneal_status s = anneal_peft_read_config(dir, &pc);
        if (s != ANNEAL_OK) {
            *usage = true;
            return anneal_set_error(s, "--lora-init: %s", anneal_last_error());
        }
        int rank = pc.rank;
        double alpha = pc.alpha;
        anneal_peft_config_free(&pc);
        if ((c->lora_rank && c->lora_rank != rank) || (c->lora_alpha > 0 && (float)c->lora_alpha != (float)alpha)) {
            *usage = true;
            return anneal_set_error(ANNEAL_ERR_ARG, "--lora-init %s has r %d, lora_alpha %g, but --lora-rank %lld, "
                                    "--lora-alpha %g were given", dir, rank, alpha, (long long)c->lora_rank, c->lora_alpha);
        }
        if ((s = anneal_peft_load(dir, ps, base_dtype)) != ANNEAL_OK) return s;
        return settings_from(c, ps); /* the run's settings are the adapter's from now on */
    }
    char *buf = strdup(c->lora_targets ? c->lora_targets : default_targets(t->model->cfg.arch));
    if (!buf) return anneal_set_error(ANNEAL_ERR_OOM, "--lora-targets: out of memory");
    const char *targets[64];
    int n = split_targets(buf, targets, 64);
    anneal_lora_config lc = {.rank = (int)c->lora_rank,
                             .alpha = c->lora_alpha > 0 ? (float)c->lora_alpha : (float)c->lora_rank,
                             .dropout = (float)c->lora_dropout, .targets = targets, .n_targets = n,
                             .base_dtype = base_dtype};
    anneal_status s = anneal_lora_apply(ps, &lc);
    free(buf);
    if (s != ANNEAL_OK) {
        *usage = s == ANNEAL_ERR_ARG;
        return anneal_set_error(s, "--lora-targets: %s", anneal_last_error());
    }
    return ANNEAL_OK;
}

/* --init was a LoRA checkpoint: its adapters (and their base, which the checkpoint
 * load rebuilt and checked) go on training in this new run, with a fresh optimizer. */
static anneal_status continue_init_adapters(trainer *t, bool *usage) {
    anneal_train_config *c = &t->cfg;
    if (c->lora_rank || c->lora_init) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_ARG, "--init %s is a LoRA checkpoint: its adapters continue as they are "
                                "(leave out --lora-rank and --lora-init)", c->init);
    }
    char ck[PATH_MAX];
    bool is_lora = false;
    uint64_t fp = 0;
    if (anneal_checkpoint_resolve(c->init, ck, sizeof ck) != ANNEAL_OK ||
        anneal_checkpoint_lora_base(ck, &is_lora, t->st.lora_base, sizeof t->st.lora_base, &fp) != ANNEAL_OK)
        return anneal_set_error(anneal_last_status(), "--init: %s", anneal_last_error());
    t->st.lora_base_fingerprint = fp;
    return settings_from(c, t->model->params);
}

anneal_status anneal_train_setup_lora(trainer *t, bool *usage) {
    anneal_train_config *c = &t->cfg;
    if (!c->resume && anneal_lora_count(t->model->params) > 0) {
        if (t->world > 1 || c->zero > 0) {
            *usage = true;
            return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--init: LoRA runs on one process without --zero");
        }
        return continue_init_adapters(t, usage);
    }
    anneal_dtype dt = ANNEAL_F32;
    if (c->dtype && !anneal_train_dtype_parse(c->dtype, &dt)) dt = ANNEAL_F32; /* precision.c reports it */
    anneal_dtype base_dtype = dt == ANNEAL_BF16 ? ANNEAL_BF16 : ANNEAL_F32;
    bool ck_lora = false;
    char base[sizeof t->st.lora_base] = "";
    uint64_t fp = 0;
    if (c->resume) {
        if (anneal_checkpoint_lora_base(t->resume_ckpt, &ck_lora, base, sizeof base, &fp) != ANNEAL_OK)
            return anneal_set_error(anneal_last_status(), "--resume: %s", anneal_last_error());
        if (!ck_lora && c->lora_rank) {
            *usage = true;
            return anneal_set_error(ANNEAL_ERR_ARG, "--resume: %s is not a LoRA checkpoint but --lora-rank %lld is set",
                                    t->resume_ckpt, (long long)c->lora_rank);
        }
        if (!ck_lora) return ANNEAL_OK;
    } else if (!c->lora_rank && !c->lora_init) {
        return ANNEAL_OK;
    }
    if (t->world > 1 || c->zero > 0) {
        *usage = true;
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "--lora-rank: LoRA runs on one process without --zero (data "
                                "parallel LoRA is not supported yet)");
    }
    anneal_params *ps = t->model->params;
    if (c->resume) {
        /* the base again: the architecture's init with the run's seed, then its weights */
        if (anneal_model_init(t->model, (uint64_t)c->seed) != ANNEAL_OK) return anneal_last_status();
        if (base[0] && load_base(t->model, base) != ANNEAL_OK)
            return anneal_set_error(anneal_last_status(), "--resume: the LoRA base %s: %s", base, anneal_last_error());
        uint64_t now = anneal_params_fingerprint(ps, false);
        if (now != fp)
            return anneal_set_error(ANNEAL_ERR_ARG, "--resume: the base weights of %s changed since the checkpoint %s "
                                    "was written (fingerprint %016llx, the checkpoint's %016llx): the adapters belong to "
                                    "the base they were trained on", base[0] ? base : "the architecture's init",
                                    t->resume_ckpt, (unsigned long long)now, (unsigned long long)fp);
    } else {
        /* the base as --init left it (or the architecture's init) */
        if (c->init) {
            char real[PATH_MAX];
            const char *p = realpath(c->init, real) ? real : c->init;
            if (strlen(p) >= sizeof base) return anneal_set_error(ANNEAL_ERR_ARG, "--init: path %s is too long", p);
            memcpy(base, p, strlen(p) + 1);
        }
        if (!(fp = anneal_params_fingerprint(ps, false))) return anneal_last_status();
    }
    anneal_status s = add_adapters(t, base_dtype, usage);
    if (s != ANNEAL_OK) return s;
    t->st.lora_base_fingerprint = fp;
    snprintf(t->st.lora_base, sizeof t->st.lora_base, "%s", base);
    anneal_memory_release_cache(t->model->device); /* the f32 copies of weights now kept in bf16 */
    return ANNEAL_OK;
}

void anneal_train_note_lora(trainer *t) {
    const anneal_params *ps = t->model ? t->model->params : NULL;
    if (!ps || anneal_lora_count(ps) == 0) return;
    bool bf16 = false;
    for (int i = 0; i < ps->n; i++) bf16 |= ps->items[i].tensor->dtype == ANNEAL_BF16;
    anneal_progress_note(t->prog, "lora: rank %d, alpha %g, dropout %g on %s (%d layers): %.3fM trainable of %.2fM "
                         "parameters, the base frozen%s; base %s (fingerprint %016llx)", ps->lora.rank,
                         (double)ps->lora.alpha, (double)ps->lora.dropout, ps->lora.targets, anneal_lora_count(ps),
                         (double)anneal_params_numel_trainable(ps) / 1e6, (double)anneal_params_numel(ps) / 1e6,
                         bf16 ? " (dense weights in bf16)" : "", t->st.lora_base[0] ? t->st.lora_base : "the seeded init",
                         (unsigned long long)t->st.lora_base_fingerprint);
}
