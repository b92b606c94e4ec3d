/* anneal plot and anneal report through the built binary: the PNG is a PNG of the
 * requested size (signature, IHDR), the SVG's root element has the requested size,
 * bad arguments and logs are refused naming them; the report's figures come from a
 * log written here (best val loss, bits per byte from prepare.json, checkpoints). */
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

static char buf[1 << 16];

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

static size_t slurp(const char *path, unsigned char *out, size_t cap) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t n = fread(out, 1, cap, f);
    fclose(f);
    return n;
}

static void put_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f) fputs(text, f), fclose(f);
}

static char tmp[64];

/* Two short runs for the plots (made once). */
static bool make_runs(const char *bin) {
    char cmd[1024];
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 "'%s' train --synthetic --steps 12 --batch 2 --seq 16 --threads 1 --eval-every 4 --eval-batches 2 "
                 "--lr %s --out '%s/run%d'",
                 bin, i ? "3e-3" : "1e-3", tmp, i);
        if (sh(cmd, buf, sizeof buf) != 0) return false;
    }
    return true;
}

TEST(plot_png_and_svg_of_the_requested_size) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    REQUIRE(make_runs(bin));
    char cmd[2048], out[256];
    snprintf(out, sizeof out, "%s/p.png", tmp);
    snprintf(cmd, sizeof cmd, "'%s' plot '%s/run0' '%s/run1' --out '%s' --width 900 --height 600", bin, tmp, tmp, out);
    int rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0 && strstr(buf, out), "exit %d: %s", rc, buf);
    static unsigned char img[1 << 22];
    size_t n = slurp(out, img, sizeof img);
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    REQUIRE(n > 33);
    CHECK(!memcmp(img, sig, 8), "PNG signature");
    CHECK(!memcmp(img + 12, "IHDR", 4), "IHDR first");
    unsigned w = (unsigned)img[16] << 24 | (unsigned)img[17] << 16 | (unsigned)img[18] << 8 | img[19];
    unsigned h = (unsigned)img[20] << 24 | (unsigned)img[21] << 16 | (unsigned)img[22] << 8 | img[23];
    CHECK(w == 900 && h == 600, "PNG is %ux%u", w, h);
    CHECK(n > 10000, "a %zu-byte PNG has no curves in it", n);
    /* SVG, tokens on a log axis */
    snprintf(out, sizeof out, "%s/p.svg", tmp);
    snprintf(cmd, sizeof cmd, "'%s' plot '%s/run0' '%s/run1/' --out '%s' --x tokens --log-x --width 800 --height 500", bin,
             tmp, tmp, out);
    rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    n = slurp(out, img, sizeof img - 1);
    img[n] = 0;
    const char *root = strstr((char *)img, "<svg");
    CHECK(!strncmp((char *)img, "<?xml", 5) && root, "not an SVG document");
    CHECK(root && strstr(root, "width=\"800pt\"") && strstr(root, "height=\"500pt\"") &&
              strstr(root, "viewBox=\"0 0 800 500\""),
          "SVG size: %.200s", root ? root : "");
    CHECK(strstr((char *)img, "</svg>") != NULL, "SVG not closed");
    /* the default output: RUN_DIR/plot.png */
    snprintf(cmd, sizeof cmd, "'%s' plot '%s/run0'", bin, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 0, "%s", buf);
    snprintf(out, sizeof out, "%s/run0/plot.png", tmp);
    struct stat sb;
    CHECK(stat(out, &sb) == 0 && sb.st_size > 0, "default plot.png missing");
}

TEST(plot_refuses_bad_input) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' plot '%s/run0' --out '%s/x.jpg'", bin, tmp, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "x.jpg") && strstr(buf, ".png"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' plot '%s/nosuch' --out '%s/x.png'", bin, tmp, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 1 && strstr(buf, "nosuch"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' plot '%s/run0' --x time", bin, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "--x time"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' plot '%s/run0' --width 10", bin, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "--width"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' plot", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 2, "%s", buf);
    /* a broken line in the middle of a log names file and line; a log with no steps */
    char p[256];
    snprintf(p, sizeof p, "%s/bad.jsonl", tmp);
    put_file(p, "{\"type\":\"start\",\"tokens_per_step\":32}\n{oops\n{\"type\":\"step\",\"step\":1,\"loss\":1}\n");
    snprintf(cmd, sizeof cmd, "'%s' plot '%s' --out '%s/x.png'", bin, p, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 1 && strstr(buf, "bad.jsonl:2"), "%s", buf);
    put_file(p, "{\"type\":\"start\",\"tokens_per_step\":32}\n");
    CHECK(sh(cmd, buf, sizeof buf) == 1 && strstr(buf, "no step or eval records"), "%s", buf);
    /* a torn last line (a crash mid-write) is skipped */
    put_file(p, "{\"type\":\"start\",\"tokens_per_step\":32}\n{\"type\":\"step\",\"step\":1,\"loss\":1,\"lr\":0.1}\n"
                "{\"type\":\"step\",\"st");
    CHECK(sh(cmd, buf, sizeof buf) == 0, "%s", buf);
}

TEST(report_summarises_a_log) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    char d[256], p[512], cmd[2048];
    snprintf(d, sizeof d, "%s/rep", tmp);
    mkdir(d, 0755);
    snprintf(p, sizeof p, "%s/data", tmp);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/data/prepare.json", tmp);
    /* 4000 bytes in 1000 tokens: 4 bytes per token */
    put_file(p, "{\"format\":\"anneal-prepare\",\"bytes\":4000,\"train_tokens\":900,\"val_tokens\":100}\n");
    snprintf(p, sizeof p, "%s/log.jsonl", d);
    char text[4096];
    snprintf(text, sizeof text,
             "{\"type\":\"start\",\"time\":\"2026-01-01T00:00:00Z\",\"version\":\"0.1.0\",\"step\":0,\"total_steps\":4,"
             "\"tokens_per_step\":100,\"model\":{\"n_layer\":2,\"n_head\":4,\"n_embd\":64,\"vocab_size\":512,\"n_ctx\":256,"
             "\"params\":149000},\"peak_gflops\":100,\"peak_source\":\"given\",\"dtype\":\"fp32\","
             "\"config\":{\"data\":\"%s/data\",\"batch\":2,\"seq\":50,\"accum\":1,\"lr\":0.001,\"warmup\":1,\"seed\":1}}\n"
             "{\"type\":\"step\",\"step\":1,\"loss\":6.0,\"lr\":0.001,\"tokens_per_s\":1000,\"mfu\":0.1,\"ms\":100,\"tokens\":100}\n"
             "{\"type\":\"step\",\"step\":2,\"loss\":5.0,\"lr\":0.001,\"tokens_per_s\":1000,\"mfu\":0.3,\"ms\":100,\"tokens\":200}\n"
             "{\"type\":\"eval\",\"step\":2,\"val_loss\":4.5}\n"
             "{\"type\":\"step\",\"step\":3,\"loss\":4.0,\"lr\":0.001,\"tokens_per_s\":1000,\"mfu\":0.2,\"ms\":100,\"tokens\":300}\n"
             "{\"type\":\"eval\",\"step\":3,\"val_loss\":4.8}\n"
             "{\"type\":\"summary\",\"step\":3,\"seconds\":2.5,\"skipped_steps\":0,\"peak_rss_bytes\":1048576,"
             "\"peak_allocator_bytes\":2097152,\"interrupted\":true}\n",
             tmp);
    put_file(p, text);
    snprintf(cmd, sizeof cmd, "'%s' report '%s'", bin, d);
    int rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0, "exit %d: %s", rc, buf);
    CHECK(strstr(buf, "progress: 3 of 4 steps, 300 tokens, 0 skipped (last invocation interrupted)"), "%s", buf);
    CHECK(strstr(buf, "best val loss: 4.5000 at step 2 (2 evaluations)"), "%s", buf);
    CHECK(strstr(buf, "MFU 20.0%"), "%s", buf);
    CHECK(strstr(buf, "throughput: 1.0k tokens/s"), "%s", buf);
    CHECK(strstr(buf, "train loss: 6.0000 first, 4.0000 last"), "%s", buf);
    /* 4.5 nats/token / ln 2 / 4 bytes per token */
    char want[128];
    snprintf(want, sizeof want, "bits per byte (val): %.4f (best val loss; 4.000 bytes per token", 4.5 / log(2.0) / 4.0);
    CHECK(strstr(buf, want), "want '%s' in %s", want, buf);
    CHECK(strstr(buf, "checkpoints: 0"), "%s", buf);
    /* a real run's report names its checkpoint */
    snprintf(cmd, sizeof cmd, "'%s' report '%s/run0'", bin, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 0 && strstr(buf, "ckpt_00000012") && strstr(buf, "synthetic data: no text"), "%s",
          buf);
    /* bad input */
    snprintf(cmd, sizeof cmd, "'%s' report '%s/nosuch'", bin, tmp);
    CHECK(sh(cmd, buf, sizeof buf) == 1 && strstr(buf, "nosuch"), "%s", buf);
    put_file(p, "{\"type\":\"step\",\"step\":1}\n");
    snprintf(cmd, sizeof cmd, "'%s' report '%s'", bin, d);
    CHECK(sh(cmd, buf, sizeof buf) == 1 && strstr(buf, "no start record"), "%s", buf);
    put_file(p, "[1,2]\n{\"type\":\"start\"}\n");
    CHECK(sh(cmd, buf, sizeof buf) == 1 && strstr(buf, "log.jsonl:1"), "%s", buf);
    snprintf(cmd, sizeof cmd, "'%s' report", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 2, "%s", buf);
}

int main(void) {
    snprintf(tmp, sizeof tmp, "/tmp/anneal_plot_XXXXXX");
    if (!mkdtemp(tmp)) return 1;
    RUN(plot_png_and_svg_of_the_requested_size);
    RUN(plot_refuses_bad_input);
    RUN(report_summarises_a_log);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) return 1;
    return anneal_test_summary();
}
