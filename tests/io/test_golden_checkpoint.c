/* A checkpoint written by an earlier build must keep loading and resume exactly:
 * tests/fixtures/golden_ckpt (gen_golden_checkpoint.sh: format_version 1, a 2-layer GPT-2
 * stopped at step 6 of 12, with dropout) is copied to a temporary run directory and
 * resumed by the CLI; steps 7-12 must give the losses and gradient norms that the
 * uninterrupted run gave when the fixture was made (expected.json).
 *
 * Tolerance: 1e-6 relative (about 8 f32 ulps). Measured: 0 (bit-identical) on the CPU that
 * made the fixture (AVX-512 with AVX512-BF16, one thread); another ISA may sum in another
 * order. A format change that loses or misreads any state (weights, AdamW moments, step
 * counts, the RNG offset that drives dropout, the data cursor, the schedule) moves the
 * losses by far more. */
#include "anneal/anneal.h"
#include "test.h"
#include "../train/train_util.h"

#include <cjson/cJSON.h>

#define GOLDEN_RTOL 1e-6

TEST(golden_checkpoint_loads_and_resumes_exactly) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *dir = tu_mkdtemp("golden");
    REQUIRE(dir);
    char cmd[1024], args[1024], out[600], log[600];
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s/run'", anneal_test_path("tests/fixtures/golden_ckpt"), dir);
    REQUIRE(system(cmd) == 0);
    snprintf(out, sizeof out, "%s/out.txt", dir);
    snprintf(args, sizeof args, "train --resume %s/run", dir);
    int rc = tu_run_anneal(args, out, 0);
    CHECK(rc == 0, "resuming the golden checkpoint: exit %d: %s", rc, tu_slurp(out));
    cJSON *exp = cJSON_Parse(tu_slurp(anneal_test_path("tests/fixtures/golden_ckpt/expected.json")));
    REQUIRE(exp);
    const cJSON *steps = cJSON_GetObjectItem(exp, "steps"), *loss = cJSON_GetObjectItem(exp, "loss"),
                *norm = cJSON_GetObjectItem(exp, "grad_norm");
    REQUIRE(cJSON_GetArraySize(steps) == 6 && cJSON_GetArraySize(loss) == 6 && cJSON_GetArraySize(norm) == 6);
    double got_l[12], got_n[12];
    for (int i = 0; i < 12; i++) got_l[i] = got_n[i] = NAN;
    snprintf(log, sizeof log, "%s/run/log.jsonl", dir);
    int hi = tu_read_steps(log, "loss", NAN, got_l, NULL, NULL, 12);
    tu_read_steps(log, "grad_norm", NAN, got_n, NULL, NULL, 12);
    CHECK(hi == 12, "the resumed run logged up to step %d, not 12", hi);
    double worst = 0;
    for (int i = 0; i < 6; i++) {
        const int s = cJSON_GetArrayItem(steps, i)->valueint;
        REQUIRE(s >= 7 && s <= 12);
        const double wl = cJSON_GetArrayItem(loss, i)->valuedouble, wn = cJSON_GetArrayItem(norm, i)->valuedouble;
        const double el = fabs(got_l[s - 1] - wl) / fabs(wl), en = fabs(got_n[s - 1] - wn) / fabs(wn);
        CHECK(el <= GOLDEN_RTOL, "step %d: loss %.9g, the fixture's run %.9g", s, got_l[s - 1], wl);
        CHECK(en <= GOLDEN_RTOL, "step %d: grad norm %.9g, the fixture's run %.9g", s, got_n[s - 1], wn);
        worst = fmax(worst, fmax(el, en));
    }
    printf("  steps 7-12 after resuming the golden checkpoint: worst relative difference %.3g\n", worst);
    cJSON_Delete(exp);
    tu_rmrf(dir);
}

/* The fixture is what the test says: format_version 1, small. */
TEST(golden_checkpoint_is_format_1_and_small) {
    const char *state = tu_slurp(anneal_test_path("tests/fixtures/golden_ckpt/ckpt_00000006/state.json"));
    cJSON *j = cJSON_Parse(state);
    REQUIRE(j);
    const cJSON *v = cJSON_GetObjectItem(j, "format_version");
    CHECK(cJSON_IsNumber(v) && v->valueint == 1, "format_version %s", cJSON_IsNumber(v) ? "not 1" : "missing");
    cJSON_Delete(j);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "test $(du -sk '%s' | cut -f1) -lt 1024", anneal_test_path("tests/fixtures/golden_ckpt"));
    CHECK(system(cmd) == 0, "tests/fixtures/golden_ckpt is 1 MB or more");
}

int main(void) {
    RUN(golden_checkpoint_loads_and_resumes_exactly);
    RUN(golden_checkpoint_is_format_1_and_small);
    return anneal_test_summary();
}
