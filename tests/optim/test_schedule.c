/* Learning-rate schedules: warmup boundaries, known points of each kind (cosine
 * midpoint and end, linear quarter points, WSD plateau and decay), values past the
 * end, every step against the formulas in double, degenerate settings (no warmup,
 * total <= warmup, zero/oversized WSD decay, negative steps) and name parsing. */
#include "anneal/anneal.h"
#include "test.h"

/* f32 results of double formulas: compare with a relative 1e-6. */
#define LR_TOL(x) (1e-6 * fabs(x) + 1e-12)
#define CHECK_LR(sch, step, want) CHECK_NEAR(anneal_schedule_lr(&(sch), (step)), (want), LR_TOL(want))

static anneal_schedule make(anneal_schedule_kind kind, int64_t warmup, int64_t total, int64_t decay) {
    return (anneal_schedule){.kind = kind, .max_lr = 6e-4f, .min_lr = 6e-5f, .warmup_steps = warmup,
                             .total_steps = total, .decay_steps = decay};
}

TEST(warmup) {
    anneal_schedule_kind kinds[4] = {ANNEAL_SCHED_CONSTANT, ANNEAL_SCHED_COSINE, ANNEAL_SCHED_LINEAR,
                                     ANNEAL_SCHED_WSD};
    for (int k = 0; k < 4; k++) {
        anneal_schedule s = make(kinds[k], 10, 110, 20);
        double max = s.max_lr;
        CHECK_LR(s, 0, max * 1 / 10);
        CHECK_LR(s, 4, max * 5 / 10);
        CHECK_LR(s, 9, max); /* last warmup step reaches max_lr */
        CHECK_LR(s, 10, max); /* first step after warmup: progress 0 */
        for (int64_t i = 1; i < 10; i++)
            CHECK(anneal_schedule_lr(&s, i) > anneal_schedule_lr(&s, i - 1), "kind %d step %lld", k, (long long)i);
    }
}

TEST(constant) {
    anneal_schedule s = make(ANNEAL_SCHED_CONSTANT, 5, 100, 0);
    CHECK_LR(s, 5, s.max_lr);
    CHECK_LR(s, 99, s.max_lr);
    CHECK_LR(s, 1000000, s.max_lr);
    s.warmup_steps = 0;
    CHECK_LR(s, 0, s.max_lr);
}

TEST(cosine_points) {
    anneal_schedule s = make(ANNEAL_SCHED_COSINE, 10, 110, 0);
    double max = s.max_lr, min = s.min_lr;
    CHECK_LR(s, 60, (max + min) / 2);                        /* midpoint of the decay */
    CHECK_LR(s, 35, min + 0.5 * (max - min) * (1 + cos(M_PI * 0.25)));
    CHECK_LR(s, 110, min);                                   /* end */
    CHECK_LR(s, 5000, min);                                  /* stays at the end value */
    /* every step against the formula; non-increasing after warmup */
    for (int64_t i = 10; i <= 120; i++) {
        double p = fmin(1.0, (double)(i - 10) / 100.0);
        CHECK_LR(s, i, min + 0.5 * (max - min) * (1 + cos(M_PI * p)));
        if (i > 10) CHECK(anneal_schedule_lr(&s, i) <= anneal_schedule_lr(&s, i - 1), "step %lld", (long long)i);
    }
    /* no warmup: starts at max */
    s.warmup_steps = 0;
    CHECK_LR(s, 0, max);
    CHECK_LR(s, 55, (max + min) / 2);
    /* the GPT-2 fixture's schedule (max 1e-2, min 1e-3, W 3, S 10) at s = 6 */
    anneal_schedule g = {.kind = ANNEAL_SCHED_COSINE, .max_lr = 1e-2f, .min_lr = 1e-3f, .warmup_steps = 3,
                         .total_steps = 10};
    CHECK_LR(g, 6, 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + cos(M_PI * 3.0 / 7.0)));
}

TEST(linear_points) {
    anneal_schedule s = make(ANNEAL_SCHED_LINEAR, 0, 100, 0);
    double max = s.max_lr, min = s.min_lr;
    CHECK_LR(s, 0, max);
    CHECK_LR(s, 25, max + (min - max) * 0.25);
    CHECK_LR(s, 50, (max + min) / 2);
    CHECK_LR(s, 100, min);
    CHECK_LR(s, 101, min);
    s.warmup_steps = 20;
    CHECK_LR(s, 60, max + (min - max) * 0.5);
}

TEST(wsd_points) {
    anneal_schedule s = make(ANNEAL_SCHED_WSD, 10, 100, 20);
    double max = s.max_lr, min = s.min_lr;
    for (int64_t i = 10; i <= 80; i++) CHECK_LR(s, i, max); /* stable plateau up to total - decay */
    CHECK_LR(s, 85, max + (min - max) * 0.25);
    CHECK_LR(s, 90, (max + min) / 2);
    CHECK_LR(s, 99, max + (min - max) * 0.95);
    CHECK_LR(s, 100, min);
    CHECK_LR(s, 250, min);
    /* decay over the whole run after warmup (decay = total - warmup) is linear */
    s.decay_steps = 90;
    CHECK_LR(s, 55, (max + min) / 2);
}

TEST(degenerate_settings) {
    /* total <= warmup: min_lr right after warmup (the end value; no division by zero) */
    anneal_schedule s = make(ANNEAL_SCHED_COSINE, 10, 10, 0);
    CHECK_LR(s, 9, s.max_lr);
    CHECK_LR(s, 10, s.min_lr);
    s.total_steps = 3;
    CHECK_LR(s, 10, s.min_lr);
    CHECK_LR(s, 2, s.max_lr * 3 / 10); /* warmup is unaffected */
    s.kind = ANNEAL_SCHED_LINEAR;
    CHECK_LR(s, 10, s.min_lr);
    s.total_steps = 0;
    s.warmup_steps = 0;
    CHECK_LR(s, 0, s.min_lr);
    /* WSD without a decay: max until total, then min */
    anneal_schedule w = make(ANNEAL_SCHED_WSD, 5, 50, 0);
    CHECK_LR(w, 49, w.max_lr);
    CHECK_LR(w, 50, w.min_lr);
    w.decay_steps = -3;
    CHECK_LR(w, 49, w.max_lr);
    /* WSD decay longer than the run after warmup: it starts when warmup ends */
    w.decay_steps = 100;
    CHECK_LR(w, 4, w.max_lr);
    CHECK_LR(w, 5, w.max_lr);
    CHECK_LR(w, 5 + 45 / 3, w.max_lr + (w.min_lr - w.max_lr) / 3.0);
    CHECK_LR(w, 50, w.min_lr);
    /* negative warmup counts as none; negative steps as step 0 */
    anneal_schedule c = make(ANNEAL_SCHED_COSINE, -4, 100, 0);
    CHECK_LR(c, 0, c.max_lr);
    CHECK_LR(c, 50, (c.max_lr + (double)c.min_lr) / 2);
    anneal_schedule c2 = make(ANNEAL_SCHED_COSINE, 10, 100, 0);
    CHECK_LR(c2, -7, c2.max_lr / 10);
    /* everything finite for any step */
    anneal_schedule_kind kinds[4] = {ANNEAL_SCHED_CONSTANT, ANNEAL_SCHED_COSINE, ANNEAL_SCHED_LINEAR,
                                     ANNEAL_SCHED_WSD};
    for (int k = 0; k < 4; k++)
        for (int64_t t = -1; t <= 2; t++)
            for (int64_t wu = -1; wu <= 2; wu++) {
                anneal_schedule z = make(kinds[k], wu, t, t);
                for (int64_t i = -2; i < 5; i++) CHECK_TRUE(isfinite(anneal_schedule_lr(&z, i)));
            }
    /* NULL and unknown kinds: 0 with an error */
    anneal_clear_error();
    CHECK_TRUE(anneal_schedule_lr(NULL, 3) == 0.0f && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_schedule u = make((anneal_schedule_kind)9, 0, 10, 0);
    CHECK_TRUE(anneal_schedule_lr(&u, 3) == 0.0f && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
}

TEST(parse) {
    anneal_schedule_kind k = (anneal_schedule_kind)-1;
    CHECK_TRUE(anneal_schedule_parse("constant", &k) && k == ANNEAL_SCHED_CONSTANT);
    CHECK_TRUE(anneal_schedule_parse("cosine", &k) && k == ANNEAL_SCHED_COSINE);
    CHECK_TRUE(anneal_schedule_parse("linear", &k) && k == ANNEAL_SCHED_LINEAR);
    CHECK_TRUE(anneal_schedule_parse("wsd", &k) && k == ANNEAL_SCHED_WSD);
    k = ANNEAL_SCHED_LINEAR;
    CHECK_TRUE(!anneal_schedule_parse("cos", &k) && k == ANNEAL_SCHED_LINEAR); /* out untouched */
    CHECK_TRUE(!anneal_schedule_parse("", &k));
    CHECK_TRUE(!anneal_schedule_parse("cosine ", &k));
    CHECK_TRUE(!anneal_schedule_parse(NULL, &k));
    CHECK_TRUE(!anneal_schedule_parse("wsd", NULL));
}

int main(void) {
    RUN(warmup);
    RUN(constant);
    RUN(cosine_points);
    RUN(linear_points);
    RUN(wsd_points);
    RUN(degenerate_settings);
    RUN(parse);
    return anneal_test_summary();
}
