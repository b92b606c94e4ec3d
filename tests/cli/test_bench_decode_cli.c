/* `anneal bench decode` and bench/decode.py end to end through the built binary. No
 * timing is asserted: the JSON has every documented field, positive finite speeds, the
 * KV cache's bytes for each --kv-dtype, the weight bytes of the preset; bad flags are
 * usage errors naming the flag; the Python driver's tiny check run (transformers beside
 * anneal) prints its table and ratios. */
#include "test.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static char buf[1 << 16];

/* Runs cmd (through the shell) capturing stdout+stderr into out; returns the exit code. */
static int sh(const char *cmd, char *out, size_t cap) {
    static char full[8192];
    snprintf(full, sizeof full, "%.8000s 2>&1", cmd);
    FILE *f = popen(full, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static double num(const cJSON *o, const char *k) { return cJSON_GetNumberValue(cJSON_GetObjectItem(o, k)); }

TEST(bench_decode_json_per_kv_dtype) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *kvs[3] = {"f32", "bf16", "int8"};
    const double elem[3] = {4, 2, 1};
    for (int i = 0; i < 3; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "'%s' bench decode --model tiny --prompt-len 24 --gen 6 --batch 2 --threads 2 "
                                  "--kv-dtype %s --json%s", bin, kvs[i], i == 1 ? " --prompt-rounds 3" : "");
        int rc = sh(cmd, buf, sizeof buf);
        CHECK(rc == 0, "exit %d: %s", rc, buf);
        const char *js = strchr(buf, '{');
        cJSON *o = js ? cJSON_Parse(js) : NULL;
        REQUIRE(o != NULL);
        const char *keys[] = {"prompt_tok_s", "decode_tok_s", "decode_ms_per_step", "gb_s", "bandwidth_gb_s",
                              "peak_rss_mib"};
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
            CHECK(num(o, keys[k]) > 0 && isfinite(num(o, keys[k])), "%s: %s = %g", kvs[i], keys[k], num(o, keys[k]));
        /* tiny: 2 layers x (k, v) x 2 slots x 4 heads x 30 positions x 16 dims (+ int8 scales) */
        double rows = 2.0 * 2 * 2 * 4 * 30;
        double want = rows * 16 * elem[i] + (i == 2 ? rows * 4 : 0);
        CHECK(num(o, "kv_cache_bytes") == want, "%s: kv_cache_bytes %g, want %g", kvs[i], num(o, "kv_cache_bytes"), want);
        /* tiny's matrices: per layer 64x192 + 64x64 + 64x256 + 256x64, and the tied head 512x64, f32 */
        CHECK(num(o, "weight_bytes") == 4.0 * (2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 512 * 64),
              "weight_bytes %g", num(o, "weight_bytes"));
        CHECK(num(o, "batch") == 2 && num(o, "gen") == 6, "%s", js);
        cJSON_Delete(o);
    }
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' bench decode --model llama-tiny --prompt-len 8 --gen 4 --dtype bf16 --threads 2", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 0 && strstr(buf, "tok/s") && strstr(buf, "GB/s") && strstr(buf, "peak RSS"),
          "text form: %s", buf);
}

TEST(bench_decode_bad_flags) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const struct {
        const char *args, *expect;
        int rc;
    } cases[] = {
        {"bench decode --prompt-len 4", "--model", 2},
        {"bench decode --model tiny --ckpt x", "--model", 2},
        {"bench decode --model tiny --kv-dtype f16", "--kv-dtype", 2},
        {"bench decode --model tiny --dtype fp16", "--dtype", 2},
        {"bench decode --model tiny --batch 0", "--batch", 2},
        {"bench decode --model tiny --gen 0", "--gen", 2},
        {"bench decode --model tiny --prompt-len 0", "--prompt-len", 2},
        {"bench decode --model tiny --prompt-rounds 0", "--prompt-rounds", 2},
        {"bench decode --model tiny --prompt-len 250 --gen 10", "n_ctx", 2},
        {"bench decode --model no_such_preset_or_dir", "--model", 2},
        {"bench decode --ckpt /nonexistent/anneal_run", "--ckpt", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "'%s' %s", bin, cases[i].args);
        int rc = sh(cmd, buf, sizeof buf);
        CHECK(rc == cases[i].rc, "'%s': exit %d, want %d (%s)", cases[i].args, rc, cases[i].rc, buf);
        CHECK(strstr(buf, cases[i].expect) != NULL, "'%s' does not name %s: %s", cases[i].args, cases[i].expect, buf);
    }
}

TEST(decode_py_tiny_runs_side_by_side) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *py = anneal_test_python("torch,transformers");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' bench/decode.py --tiny --bin '%s' --prompt-len 16 --gen 4 --threads 2", py, bin);
    int rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    CHECK(strstr(buf, "anneal (fp32, f32 KV)") && strstr(buf, "transformers (fp32)"), "rows: %s", buf);
    CHECK(strstr(buf, "anneal / transformers (fp32): prompt") && strstr(buf, "decode"), "ratios: %s", buf);
    CHECK(strstr(buf, "llama.cpp"), "the llama.cpp row or its skip note: %s", buf);
}

/* The OpenMP wait the tool picks when the user sets none: a bounded spin
 * (GOMP_SPINCOUNT=20000) for bench decode, whose steps are many short parallel regions;
 * a variable the user set is kept as it is. */
TEST(bench_decode_waits_by_a_bounded_spin) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    static const char *envs[3] = {"env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u ANNEAL_NO_REEXEC",
                                  "env -u GOMP_SPINCOUNT -u ANNEAL_NO_REEXEC OMP_WAIT_POLICY=passive",
                                  "env -u OMP_WAIT_POLICY -u ANNEAL_NO_REEXEC GOMP_SPINCOUNT=7"};
    static const char *want[3][2] = {{"", "20000"}, {"passive", ""}, {"", "7"}};
    for (int i = 0; i < 3; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "%s '%s' bench decode --model tiny --prompt-len 4 --gen 2 --threads 2 --json", envs[i],
                 bin);
        int rc = sh(cmd, buf, sizeof buf);
        CHECK(rc == 0, "exit %d: %s", rc, buf);
        const char *js = strchr(buf, '{');
        cJSON *o = js ? cJSON_Parse(js) : NULL;
        REQUIRE(o != NULL);
        const char *pol = cJSON_GetStringValue(cJSON_GetObjectItem(o, "omp_wait_policy"));
        const char *spin = cJSON_GetStringValue(cJSON_GetObjectItem(o, "gomp_spincount"));
        CHECK(pol && spin && !strcmp(pol, want[i][0]) && !strcmp(spin, want[i][1]),
              "%s: OMP_WAIT_POLICY '%s' GOMP_SPINCOUNT '%s', want '%s' '%s'", envs[i], pol ? pol : "(none)",
              spin ? spin : "(none)", want[i][0], want[i][1]);
        cJSON_Delete(o);
    }
}

int main(void) {
    RUN(bench_decode_json_per_kv_dtype);
    RUN(bench_decode_bad_flags);
    RUN(bench_decode_waits_by_a_bounded_spin);
    RUN(decode_py_tiny_runs_side_by_side);
    return anneal_test_summary();
}
