/* The trainer on a GPU (skipped without one, or in a build without CUDA): the small
 * synthetic run of device_train_util.h with --device cuda next to the same run on the
 * CPU (gradient accumulation, dropout, evaluation, samples, periodic checkpoints): the
 * logged losses, gradient norms and validation losses agree closely (other kernels and
 * summation orders, so not bit for bit), a run started on the GPU resumes on the CPU
 * and one started on the CPU resumes on the GPU, and the start record names the device. */
#include "device_train_util.h"

#include <math.h>

/* Within tol of each other (both NaN counts as equal). */
static bool close_to(double a, double b, double tol) { return (isnan(a) && isnan(b)) || fabs(a - b) <= tol; }

/* On a machine with a GPU (skipped elsewhere): the same run with --device cuda logs
 * losses, norms and validation losses close to the CPU's (other kernels, other
 * summation orders: not the same bits), and a run started on the GPU resumes on the CPU
 * and the other way round. */
TEST(cuda_trains_close_to_the_cpu_and_resumes_across_devices) {
    char why[512] = "";
    if (anneal_cuda_device_count(why, sizeof why) <= 0) SKIP("no GPU: %s", why);
    const char *dir = tu_mkdtemp("devtrain_cuda");
    REQUIRE(dir);
    char out[600], p[700];
    snprintf(out, sizeof out, "%s/run", dir);
    make_tokenizer(dir);
    REQUIRE(run(out, "cpu", false, 0) == ANNEAL_OK);
    park(dir, "cpu");
    REQUIRE(run(out, "cuda", false, 0) == ANNEAL_OK);
    park(dir, "cuda");
    REQUIRE(run(out, "cuda", false, HALF) == ANNEAL_OK);
    REQUIRE(run(out, "cpu", true, 0) == ANNEAL_OK);
    park(dir, "cuda_then_cpu");
    REQUIRE(run(out, "cpu", false, HALF) == ANNEAL_OK);
    REQUIRE(run(out, "cuda", true, 0) == ANNEAL_OK);
    park(dir, "cpu_then_cuda");
    trace tr[4];
    const char *names[4] = {"cpu", "cuda", "cuda_then_cpu", "cpu_then_cuda"};
    for (int k = 0; k < 4; k++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[k]);
        read_trace(p, &tr[k]);
    }
    for (int k = 1; k < 4; k++)
        for (int i = 0; i < STEPS; i++) {
            CHECK(close_to(tr[0].loss[i], tr[k].loss[i], 2e-3), "%s: step %d loss %.9g vs cpu %.9g", names[k], i + 1,
                  tr[k].loss[i], tr[0].loss[i]);
            CHECK(close_to(tr[0].norm[i], tr[k].norm[i], 2e-3 * (1 + tr[0].norm[i])), "%s: step %d grad norm %.9g vs cpu %.9g",
                  names[k], i + 1, tr[k].norm[i], tr[0].norm[i]);
            CHECK(close_to(tr[0].val[i], tr[k].val[i], 2e-3), "%s: step %d val loss %.9g vs cpu %.9g", names[k], i + 1,
                  tr[k].val[i], tr[0].val[i]);
        }
    snprintf(p, sizeof p, "%s/cuda/log.jsonl", dir);
    const char *text = tu_slurp(p);
    CHECK(strstr(text, "\"device\":\"cuda\""), "no \"device\":\"cuda\" in the start record");
    tu_rmrf(dir);
}

int main(void) {
    devnull = fopen("/dev/null", "w");
    RUN(cuda_trains_close_to_the_cpu_and_resumes_across_devices);
    fclose(devnull);
    return anneal_test_summary();
}
