/* anneal train: trains a GPT-2 model with AdamW, gradient clipping and an LR
 * schedule. Data for now is synthetic: token sequences from a fixed random sparse
 * Markov chain (each token has 4 possible successors), so the loss must fall from
 * ln(vocab) toward ln(4) ~ 1.39 — a quick end-to-end check of the whole engine. */
#include "anneal/anneal.h"
#include "args.h"
#include "commands.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Successor j (0..3) of token t in the synthetic chain. */
static int32_t successor(uint64_t seed, int32_t t, uint32_t j, int32_t vocab) {
    uint32_t r[4];
    anneal_philox4x32(seed ^ 0x5eedULL, 7, (uint64_t)t, r);
    return (int32_t)(r[j & 3] % (uint32_t)vocab);
}

/* Fills ids (B, T) and targets (B, T) with the next B windows of the chain. */
static void synthetic_batch(uint64_t seed, int64_t step, int64_t B, int64_t T, int32_t vocab,
                            int32_t *ids, int32_t *targets) {
    for (int64_t b = 0; b < B; b++) {
        uint32_t r[4];
        anneal_philox4x32(seed, 11, (uint64_t)(step * B + b), r);
        int32_t tok = (int32_t)(r[0] % (uint32_t)vocab);
        for (int64_t t = 0; t <= T; t++) {
            if (t < T) ids[b * T + t] = tok;
            if (t > 0) targets[b * T + t - 1] = tok;
            anneal_philox4x32(seed, 12, (uint64_t)((step * B + b) * (T + 1) + t), r);
            tok = successor(seed, tok, r[0], vocab);
        }
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int anneal_cmd_train(int argc, char **argv) {
    const char *model = "tiny", *schedule = "cosine";
    int64_t steps = 100, batch = 8, seq = 64, warmup = 10, seed = 1337, threads = 0, log_every = 1;
    double lr = 1e-3, min_lr = -1, wd = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, clip = 1.0,
           dropout = 0.0;
    bool synthetic = true, recompute = false, help = false;
    cli_flag flags[] = {
        {"model", ARG_STRING, "preset: tiny, d6, 124M, 350M, 774M, 1.5B (default tiny)", &model, 0},
        {"synthetic", ARG_BOOL, "train on synthetic Markov-chain tokens (default on; the only source yet)", &synthetic, 0},
        {"steps", ARG_INT, "optimizer steps (default 100)", &steps, 0},
        {"batch", ARG_INT, "sequences per step B (default 8)", &batch, 0},
        {"seq", ARG_INT, "sequence length T (default 64)", &seq, 0},
        {"lr", ARG_FLOAT, "peak learning rate (default 1e-3)", &lr, 0},
        {"min-lr", ARG_FLOAT, "final learning rate (default lr/10)", &min_lr, 0},
        {"warmup", ARG_INT, "linear warmup steps (default 10)", &warmup, 0},
        {"schedule", ARG_STRING, "constant, cosine, linear or wsd (default cosine)", &schedule, 0},
        {"weight-decay", ARG_FLOAT, "AdamW weight decay on matmul weights (default 0.1)", &wd, 0},
        {"beta1", ARG_FLOAT, "AdamW beta1 (default 0.9)", &beta1, 0},
        {"beta2", ARG_FLOAT, "AdamW beta2 (default 0.95)", &beta2, 0},
        {"eps", ARG_FLOAT, "AdamW epsilon (default 1e-8)", &eps, 0},
        {"clip", ARG_FLOAT, "global gradient-norm clip, 0 = off (default 1.0)", &clip, 0},
        {"dropout", ARG_FLOAT, "dropout probability (default 0)", &dropout, 0},
        {"recompute", ARG_BOOL, "recompute each block in backward (activation checkpointing)", &recompute, 0},
        {"seed", ARG_INT, "seed for init, data and dropout (default 1337)", &seed, 0},
        {"threads", ARG_INT, "CPU threads (default: all cores)", &threads, 0},
        {"log-every", ARG_INT, "print every N steps (default 1)", &log_every, 0},
        {"help", ARG_BOOL, "show this help", &help, 0},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    if (!cli_parse("train", argc, argv, flags, nf)) return 2;
    if (help) {
        cli_usage("train", "Trains a GPT-2 model and prints the loss per step.", flags, nf);
        return 0;
    }
    anneal_gpt2_config cfg;
    if (!anneal_gpt2_preset(model, &cfg)) {
        fprintf(stderr, "anneal train: --model: unknown preset '%s' (tiny, d6, 124M, 350M, 774M, 1.5B)\n", model);
        return 2;
    }
    anneal_schedule sch = {0};
    if (!anneal_schedule_parse(schedule, &sch.kind)) {
        fprintf(stderr, "anneal train: --schedule: unknown schedule '%s' (constant, cosine, linear, wsd)\n", schedule);
        return 2;
    }
    if (!synthetic) {
        fprintf(stderr, "anneal train: --synthetic off needs --data, which this build does not have yet\n");
        return 2;
    }
    struct { const char *flag; bool bad; } checks[] = {
        {"steps", steps <= 0}, {"batch", batch <= 0}, {"seq", seq <= 0 || seq > cfg.n_ctx},
        {"lr", !(lr > 0)}, {"warmup", warmup < 0}, {"clip", clip < 0},
        {"dropout", !(dropout >= 0 && dropout < 1)}, {"threads", threads < 0}, {"log-every", log_every <= 0},
        {"beta1", !(beta1 >= 0 && beta1 < 1)}, {"beta2", !(beta2 >= 0 && beta2 < 1)}, {"eps", !(eps > 0)},
    };
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++)
        if (checks[i].bad) {
            fprintf(stderr, "anneal train: --%s: value out of range%s\n", checks[i].flag,
                    !strcmp(checks[i].flag, "seq") ? " (1..n_ctx of the model)" : "");
            return 2;
        }
    if (threads > 0) anneal_set_num_threads((int)threads);
    cfg.dropout = (float)dropout;
    cfg.recompute = recompute;
    sch.max_lr = lr;
    sch.min_lr = min_lr >= 0 ? min_lr : lr / 10;
    sch.warmup_steps = warmup;
    sch.total_steps = steps;
    sch.decay_steps = steps / 5;

    anneal_gpt2 *m = anneal_gpt2_new(&cfg);
    if (!m || anneal_gpt2_init(m, (uint64_t)seed) != ANNEAL_OK) {
        fprintf(stderr, "anneal train: %s\n", anneal_last_error());
        anneal_gpt2_free(m);
        return 1;
    }
    m->training = true;
    anneal_optim_config oc = anneal_optim_defaults(ANNEAL_OPTIM_ADAMW);
    oc.beta1 = beta1;
    oc.beta2 = beta2;
    oc.eps = eps;
    oc.weight_decay = wd;
    anneal_optimizer *opt = anneal_optimizer_new(m->params, oc);
    if (!opt) {
        fprintf(stderr, "anneal train: %s\n", anneal_last_error());
        anneal_gpt2_free(m);
        return 1;
    }
    int64_t n_params = anneal_gpt2_num_params(m);
    printf("model %s: %d layers, %d heads, %d channels, vocab %d, %.2fM parameters\n", model, cfg.n_layer,
           cfg.n_head, cfg.n_embd, cfg.vocab_size, (double)n_params / 1e6);
    printf("data: synthetic Markov chain (4 successors per token: best possible loss ln 4 = %.3f)\n", log(4.0));
    printf("batch %lld x seq %lld, %lld steps, threads %d\n", (long long)batch, (long long)seq,
           (long long)steps, anneal_get_num_threads());
    fflush(stdout);

    int rc = 0;
    double first_loss = NAN, last_loss = NAN;
    double *step_ms = calloc((size_t)steps, sizeof *step_ms);
    if (!step_ms) {
        fprintf(stderr, "anneal train: out of memory\n");
        anneal_optimizer_free(opt);
        anneal_gpt2_free(m);
        return 1;
    }
    for (int64_t step = 0; step < steps; step++) {
        double t0 = now_ms();
        anneal_manual_seed((uint64_t)seed * 1000003ULL + (uint64_t)step); /* dropout stream per step */
        anneal_scope *s = anneal_scope_open();
        int64_t shape[2] = {batch, seq};
        anneal_tensor *ids = anneal_empty(ANNEAL_I32, 2, shape);
        anneal_tensor *tg = anneal_empty(ANNEAL_I32, 2, shape);
        if (ids && tg)
            synthetic_batch((uint64_t)seed, step, batch, seq, cfg.vocab_size, anneal_data(ids), anneal_data(tg));
        anneal_tensor *loss = anneal_gpt2_loss(m, ids, tg);
        float norm = 0;
        double cur_lr = anneal_schedule_lr(&sch, step);
        anneal_status st = loss ? anneal_backward(loss) : anneal_last_status();
        if (st == ANNEAL_OK)
            st = clip > 0 ? anneal_clip_grad_norm(m->params, (float)clip, &norm) : anneal_grad_norm(m->params, &norm);
        double lv = loss ? anneal_item(loss) : NAN;
        if (st == ANNEAL_OK && isfinite(norm) && isfinite(lv)) st = anneal_optimizer_step(opt, cur_lr);
        anneal_params_zero_grad(m->params);
        anneal_scope_close(s);
        if (st != ANNEAL_OK) {
            fprintf(stderr, "anneal train: step %lld failed: %s\n", (long long)step, anneal_last_error());
            rc = 1;
            break;
        }
        double ms = now_ms() - t0;
        step_ms[step] = ms;
        if (step == 0) first_loss = lv;
        last_loss = lv;
        if (step % log_every == 0 || step == steps - 1) {
            double tps = (double)(batch * seq) / (ms / 1e3);
            printf("step %5lld/%lld  loss %.4f  lr %.2e  norm %.3f  %.1f ms  %.0f tok/s\n", (long long)step + 1,
                   (long long)steps, lv, cur_lr, (double)norm, ms, tps);
            fflush(stdout);
        }
    }
    if (rc == 0) {
        /* median over steps after the first (which warms caches and allocates state) */
        int64_t first = steps > 1 ? 1 : 0, n = steps - first;
        qsort(step_ms + first, (size_t)n, sizeof *step_ms, cmp_double);
        double ms = step_ms[first + n / 2];
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        anneal_memory_stats mem = anneal_memory_stats_get(ANNEAL_CPU);
        printf("done: loss %.4f -> %.4f; %.1f ms/step, %.0f tok/s (median after step 1); "
               "peak tensor memory %.1f MiB, peak RSS %.1f MiB\n",
               first_loss, last_loss, ms, (double)(batch * seq) / (ms / 1e3),
               (double)mem.peak_bytes / 1048576.0, (double)ru.ru_maxrss / 1024.0);
    }
    free(step_ms);
    anneal_optimizer_free(opt);
    anneal_gpt2_free(m);
    return rc;
}
