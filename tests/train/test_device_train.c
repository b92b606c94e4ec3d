/* The trainer on a device other than the CPU: anneal_train_run with --device emu (the
 * test backend of tests/backends/emu_backend.h, whose memory the host cannot touch and
 * whose copies to the host arrive only at a synchronize) next to the same run on the
 * CPU. Gradient accumulation, dropout, evaluation, samples and periodic checkpoints are
 * on. The logged losses, gradient norms, validation losses and samples are identical, and so is
 * every file of every checkpoint; a run started on emu resumes on the CPU, and one
 * started on the CPU resumes on emu, continuing bit for bit. The host never reads emu
 * memory behind the device's back and never refills an uploaded buffer before the
 * synchronize (emu_stats). Bad --device values are usage errors naming the flag. */
#include "anneal/train.h"
#include "backends/emu_backend.h"
#include "test.h"
#include "device_train_util.h"

TEST(emu_trains_like_the_cpu_and_resumes_across_devices) {
    REQUIRE(emu_register() == ANNEAL_OK);
    const char *dir = tu_mkdtemp("devtrain");
    REQUIRE(dir);
    char out[600], p[700];
    snprintf(out, sizeof out, "%s/run", dir);
    make_tokenizer(dir);

    /* straight runs on each device */
    REQUIRE(run(out, NULL, false, 0) == ANNEAL_OK);
    park(dir, "cpu");
    int64_t calls0 = emu_stats.calls;
    REQUIRE(run(out, "emu", false, 0) == ANNEAL_OK);
    park(dir, "emu");
    CHECK(emu_stats.calls > calls0 + 100, "%lld emu kernel calls: the model did not run on emu",
          (long long)(emu_stats.calls - calls0));
    /* emu started on a device: a run on it resumes on the CPU, and the other way round */
    REQUIRE(run(out, "emu", false, HALF) == ANNEAL_OK);
    REQUIRE(run(out, "cpu", true, 0) == ANNEAL_OK);
    park(dir, "emu_then_cpu");
    REQUIRE(run(out, "cpu", false, HALF) == ANNEAL_OK);
    REQUIRE(run(out, "emu", true, 0) == ANNEAL_OK);
    park(dir, "cpu_then_emu");
    CHECK(emu_stats.foreign == 0, "%lld foreign tensors reached emu", (long long)emu_stats.foreign);
    CHECK(emu_stats.host_reuse == 0, "%lld uploaded host buffers were refilled before the synchronize",
          (long long)emu_stats.host_reuse);

    trace cpu, emu, ec, ce;
    snprintf(p, sizeof p, "%s/cpu", dir);
    read_trace(p, &cpu);
    snprintf(p, sizeof p, "%s/emu", dir);
    read_trace(p, &emu);
    snprintf(p, sizeof p, "%s/emu_then_cpu", dir);
    read_trace(p, &ec);
    snprintf(p, sizeof p, "%s/cpu_then_emu", dir);
    read_trace(p, &ce);
    CHECK(isfinite(cpu.loss[0]) && isfinite(cpu.val[HALF - 1]) && isfinite(cpu.val[STEPS - 1]), "cpu trace %g %g %g",
          cpu.loss[0], cpu.val[HALF - 1], cpu.val[STEPS - 1]);
    CHECK(!tokdir[0] || (cpu.sample[HALF - 1][0] && cpu.sample[STEPS - 1][0]), "no samples logged");
    check_same_trace(&cpu, &emu, "emu vs cpu");
    check_same_trace(&cpu, &ec, "emu then cpu vs cpu");
    check_same_trace(&cpu, &ce, "cpu then emu vs cpu");

    char a[600], b[600];
    snprintf(a, sizeof a, "%s/cpu", dir);
    const char *others[3] = {"emu", "emu_then_cpu", "cpu_then_emu"};
    for (int i = 0; i < 3; i++) {
        snprintf(b, sizeof b, "%s/%s", dir, others[i]);
        check_same_ckpt(a, b, "ckpt_00000003", i > 0, others[i]);
        check_same_ckpt(a, b, "ckpt_00000006", false, others[i]);
    }
    /* the start record names the device */
    snprintf(p, sizeof p, "%s/emu/log.jsonl", dir);
    const char *text = tu_slurp(p);
    CHECK(text && strstr(text, "\"device\":\"emu\""), "no \"device\":\"emu\" in the start record");
    tu_rmrf(dir);
}

TEST(bad_devices_are_usage_errors_naming_the_flag) {
    anneal_train_config c;
    anneal_train_config_init(&c);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "bogus") == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "--device") && strstr(anneal_last_error(), "bogus"), "%s", anneal_last_error());
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cuda:x") == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cuda:-1") == ANNEAL_ERR_ARG);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cpu") == ANNEAL_OK);
    CHECK_TRUE(anneal_train_config_set(&c, "device", "cuda:0") == ANNEAL_OK); /* the syntax; the run checks the GPU */
    /* the device is not saved with the settings: checkpoints are the same files anywhere */
    char *json = anneal_train_config_to_json(&c);
    CHECK(json && !strstr(json, "\"device\""), "%s", json ? json : "(null)");
    free(json);
    /* a config file's "device" reads like the flag */
    CHECK_TRUE(anneal_train_config_apply_json(&c, "{\"device\": \"nope\"}", "cfg.json", NULL) == ANNEAL_ERR_ARG);
    CHECK(strstr(anneal_last_error(), "cfg.json") && strstr(anneal_last_error(), "--device"), "%s",
          anneal_last_error());
    anneal_clear_error();
    anneal_device dev = ANNEAL_DEVICE_COUNT;
    CHECK_TRUE(anneal_train_device_resolve("cpu", &dev) == ANNEAL_OK && dev == ANNEAL_CPU);
    CHECK_TRUE(anneal_train_device_resolve(NULL, &dev) == ANNEAL_OK && dev == ANNEAL_CPU);
    if (!anneal_cuda_built() || anneal_cuda_device_count(NULL, 0) == 0) {
        /* no GPU here: cuda says why (not built, or no GPU), as a usage error of the run */
        CHECK_TRUE(anneal_train_device_resolve("cuda:99", &dev) == ANNEAL_ERR_ARG);
        CHECK(strstr(anneal_last_error(), "--device") &&
                  (strstr(anneal_last_error(), "no CUDA backend") || strstr(anneal_last_error(), "GPU")),
              "%s", anneal_last_error());
        anneal_clear_error();
        const char *dir = tu_mkdtemp("devtrain_bad");
        REQUIRE(dir);
        char out[600];
        snprintf(out, sizeof out, "%s/run", dir);
        anneal_train_config_free(&c);
        config(&c, out, "cuda");
        anneal_train_result r;
        CHECK_TRUE(anneal_train_run(&c, devnull, &r) == ANNEAL_ERR_ARG && r.usage_error);
        CHECK(strstr(anneal_last_error(), "--device cuda"), "%s", anneal_last_error());
        anneal_clear_error();
        tu_rmrf(dir);
    }
    anneal_train_config_free(&c);
}

/* The trainer leaves nothing live on the device; its cached blocks are released (the
 * emu device's blocks sit behind tagged addresses the leak checker cannot follow). */
TEST(nothing_left_on_the_device) {
    anneal_memory_stats st = anneal_memory_stats_get(EMU);
    CHECK(st.live_bytes == 0, "%lld bytes still live on emu", (long long)st.live_bytes);
    anneal_memory_release_cache(EMU);
    CHECK_TRUE(anneal_memory_stats_get(EMU).reserved_bytes == 0);
}

int main(void) {
    devnull = fopen("/dev/null", "w");
    RUN(bad_devices_are_usage_errors_naming_the_flag);
    RUN(emu_trains_like_the_cpu_and_resumes_across_devices);
    RUN(nothing_left_on_the_device);
    fclose(devnull);
    return anneal_test_summary();
}
