/* TensorBoard event files: CRC-32C and TFRecord framing against known vectors (C
 * only), the writer's file read back frame by frame, and a tiny CLI training run whose
 * event file TensorBoard's EventAccumulator (the venv's tensorboard) reads: every
 * scalar of log.jsonl with its step and value, the samples and the settings. */
#include "test.h"

#include "anneal/telemetry.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char buf[1 << 20];

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

/* Known CRC-32C values (RFC 3720 B.4 and the "123456789" check value) and TFRecord
 * masked CRCs (the values TensorBoard's own masked_crc32c gives). */
TEST(crc32c_known_vectors) {
    CHECK(anneal_crc32c(0, "123456789", 9) == 0xE3069283u, "got %08x", anneal_crc32c(0, "123456789", 9));
    unsigned char z[32] = {0}, f[32], inc[32];
    memset(f, 0xff, sizeof f);
    for (int i = 0; i < 32; i++) inc[i] = (unsigned char)i;
    CHECK(anneal_crc32c(0, z, 32) == 0x8A9136AAu, "zeros %08x", anneal_crc32c(0, z, 32));
    CHECK(anneal_crc32c(0, f, 32) == 0x62A8AB43u, "ones %08x", anneal_crc32c(0, f, 32));
    CHECK(anneal_crc32c(0, inc, 32) == 0x46DD794Eu, "ascending %08x", anneal_crc32c(0, inc, 32));
    /* continuing a CRC over a split buffer gives the CRC of the whole */
    CHECK(anneal_crc32c(anneal_crc32c(0, "1234", 4), "56789", 5) == 0xE3069283u, "split");
    CHECK(anneal_crc32c_masked("123456789", 9) == 0xc78ab0e5u, "masked %08x", anneal_crc32c_masked("123456789", 9));
    CHECK(anneal_crc32c_masked("", 0) == 0xa282ead8u, "masked empty");
    struct { uint64_t n; uint32_t crc; } hv[] = {{0, 0x07980329u}, {24, 0x224b7fa3u}, {300, 0x9d5bfef2u}};
    for (int i = 0; i < 3; i++) {
        unsigned char h[12];
        anneal_tfrecord_header(hv[i].n, h);
        uint64_t n = 0;
        uint32_t c = 0;
        for (int k = 0; k < 8; k++) n |= (uint64_t)h[k] << (8 * k);
        for (int k = 0; k < 4; k++) c |= (uint32_t)h[8 + k] << (8 * k);
        CHECK(n == hv[i].n && c == hv[i].crc, "length %llu: header crc %08x, want %08x", (unsigned long long)hv[i].n, c,
              hv[i].crc);
    }
}

/* The one event file in dir (path into out). */
static bool find_event_file(const char *dir, char *out, size_t cap) {
    DIR *d = opendir(dir);
    if (!d) return false;
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)))
        if (strstr(e->d_name, "tfevents")) snprintf(out, cap, "%s/%s", dir, e->d_name), found++;
    closedir(d);
    return found == 1;
}

/* Reads a TFRecord file checking every frame; returns the number of records or -1. */
static int count_frames(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    int n = 0;
    for (;;) {
        unsigned char h[12];
        size_t got = fread(h, 1, 12, f);
        if (got == 0) break;
        if (got != 12) { n = -1; break; }
        uint64_t len = 0;
        uint32_t c = 0;
        for (int k = 0; k < 8; k++) len |= (uint64_t)h[k] << (8 * k);
        for (int k = 0; k < 4; k++) c |= (uint32_t)h[8 + k] << (8 * k);
        if (c != anneal_crc32c_masked(h, 8) || len > (1u << 24)) { n = -1; break; }
        unsigned char *d = malloc(len + 4);
        if (!d || fread(d, 1, len + 4, f) != len + 4) { free(d); n = -1; break; }
        uint32_t dc = 0;
        for (int k = 0; k < 4; k++) dc |= (uint32_t)d[len + (size_t)k] << (8 * k);
        bool ok = dc == anneal_crc32c_masked(d, len);
        free(d);
        if (!ok) { n = -1; break; }
        n++;
    }
    fclose(f);
    return n;
}

TEST(writer_frames_every_record) {
    char tmpl[] = "/tmp/anneal_tb_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != NULL);
    char dir[256], path[512];
    snprintf(dir, sizeof dir, "%s/a/b", tmpl);
    anneal_tb_writer *w = NULL;
    REQUIRE(anneal_tb_open(dir, &w) == ANNEAL_OK);
    CHECK(anneal_tb_scalar(w, "x", 1, 0.0) == ANNEAL_OK, "scalar");
    CHECK(anneal_tb_scalar(w, "x", 2, 2.5) == ANNEAL_OK, "scalar");
    CHECK(anneal_tb_text(w, "t", 2, "hello") == ANNEAL_OK, "text");
    /* already on disk before close: a crash loses nothing written */
    REQUIRE(find_event_file(dir, path, sizeof path));
    CHECK(count_frames(path) == 4, "frames %d before close", count_frames(path));
    anneal_tb_close(w);
    CHECK(count_frames(path) == 4, "frames %d", count_frames(path));
    /* a corrupted byte is caught by the frame check (the check itself can fail) */
    FILE *f = fopen(path, "r+b");
    REQUIRE(f != NULL);
    fseek(f, 20, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, 20, SEEK_SET);
    fputc(ch ^ 0x40, f);
    fclose(f);
    CHECK(count_frames(path) == -1, "corruption not seen");
    /* a directory that cannot be made: an error naming it */
    snprintf(dir, sizeof dir, "%s/file", tmpl);
    FILE *g = fopen(dir, "w");
    REQUIRE(g != NULL);
    fclose(g);
    snprintf(dir, sizeof dir, "%s/file/sub", tmpl);
    CHECK(anneal_tb_open(dir, &w) != ANNEAL_OK && w == NULL && strstr(anneal_last_error(), "file"), "%s",
          anneal_last_error());
    anneal_clear_error();
    CHECK(anneal_tb_open("", &w) == ANNEAL_ERR_ARG, "empty dir");
    anneal_clear_error();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpl);
    CHECK(system(cmd) == 0, "cleanup");
}

/* The [step, value] pairs of a tag in the reader's JSON. */
static const cJSON *series(const cJSON *root, const char *kind, const char *tag) {
    return cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, kind), tag);
}

/* Checks that the reader's series for tag holds exactly the log's (step, key) values. */
static void check_series(const cJSON *tb, const cJSON *log, const char *type, const char *key, const char *tag) {
    const cJSON *s = series(tb, "scalars", tag);
    CHECK(cJSON_IsArray(s), "tag %s missing", tag);
    if (!s) return;
    int n = 0;
    for (const cJSON *r = log->child; r; r = r->next) {
        if (strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(r, "type")), type)) continue;
        const cJSON *v = cJSON_GetObjectItem(r, key);
        if (!cJSON_IsNumber(v)) continue;
        const cJSON *e = cJSON_GetArrayItem(s, n++);
        CHECK(e != NULL, "%s: %d values, the log has more", tag, n - 1);
        if (!e) return;
        double step = cJSON_GetArrayItem(e, 0)->valuedouble, val = cJSON_GetArrayItem(e, 1)->valuedouble;
        double want = (double)(float)v->valuedouble; /* TensorBoard scalars are float32 */
        CHECK(step == cJSON_GetNumberValue(cJSON_GetObjectItem(r, "step")), "%s: step %g", tag, step);
        CHECK(val == want, "%s at step %g: %.9g, log %.9g", tag, step, val, want);
    }
    CHECK(n > 0 && n == cJSON_GetArraySize(s), "%s: %d in the log, %d in TensorBoard", tag, n, cJSON_GetArraySize(s));
}

TEST(event_accumulator_reads_a_training_run) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    const char *py = anneal_test_python("tensorboard");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    char tmpl[] = "/tmp/anneal_tbrun_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != NULL);
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "'%s' train --synthetic --steps 6 --batch 2 --seq 16 --eval-every 3 --eval-batches 2 --threads 2 "
             "--dtype fp16 --out '%s/run' --tensorboard '%s/tb'",
             bin, tmpl, tmpl);
    int rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0, "train exit %d: %s", rc, buf);
    CHECK(strstr(buf, "tensorboard: ") != NULL, "no tensorboard line: %s", buf);
    snprintf(cmd, sizeof cmd, "'%s' '%s/tests/obs/read_tensorboard.py' '%s/tb'", py,
             getenv("ANNEAL_SOURCE_DIR") ? getenv("ANNEAL_SOURCE_DIR") : ".", tmpl);
    rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0, "reader exit %d: %s", rc, buf);
    cJSON *tb = cJSON_Parse(buf);
    REQUIRE(tb != NULL);
    /* the log, as an array of records */
    char logp[512];
    snprintf(logp, sizeof logp, "%s/run/log.jsonl", tmpl);
    FILE *f = fopen(logp, "r");
    REQUIRE(f != NULL);
    cJSON *log = cJSON_CreateArray();
    static char line[1 << 16];
    while (fgets(line, sizeof line, f)) cJSON_AddItemToArray(log, cJSON_Parse(line));
    fclose(f);
    check_series(tb, log, "step", "loss", "train/loss");
    check_series(tb, log, "step", "lr", "train/lr");
    check_series(tb, log, "step", "grad_norm", "train/grad_norm");
    check_series(tb, log, "step", "loss_scale", "train/loss_scale");
    check_series(tb, log, "step", "tokens_per_s", "perf/tokens_per_s");
    check_series(tb, log, "step", "mfu", "perf/mfu");
    check_series(tb, log, "step", "memory_bytes", "perf/memory_bytes");
    check_series(tb, log, "eval", "val_loss", "val/loss");
    CHECK(cJSON_GetArraySize(series(tb, "scalars", "train/loss")) == 6, "6 steps");
    CHECK(cJSON_GetArraySize(series(tb, "scalars", "val/loss")) == 2, "evaluations at 3 and 6");
    const cJSON *cfg = cJSON_GetArrayItem(series(tb, "texts", "config"), 0);
    CHECK(cfg && strstr(cJSON_GetStringValue(cJSON_GetArrayItem(cfg, 1)), "\"steps\":\t6"), "settings text");
    cJSON_Delete(tb);
    cJSON_Delete(log);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpl);
    CHECK(system(cmd) == 0, "cleanup");
}

/* Sample texts and settings through the record mapping, read by EventAccumulator. */
TEST(event_accumulator_reads_samples) {
    const char *py = anneal_test_python("tensorboard");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    char tmpl[] = "/tmp/anneal_tbtext_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != NULL);
    anneal_tb_writer *w = NULL;
    REQUIRE(anneal_tb_open(tmpl, &w) == ANNEAL_OK);
    const char *recs[] = {"{\"type\":\"sample\",\"step\":7,\"text\":\"In the beginning \u00e9\"}",
                          "{\"type\":\"sample\",\"step\":14,\"text\":\"second\"}",
                          "{\"type\":\"checkpoint\",\"step\":14,\"dir\":\"x\"}"};
    for (int i = 0; i < 3; i++) {
        cJSON *o = cJSON_Parse(recs[i]);
        CHECK(o && anneal_tb_record(w, o) == ANNEAL_OK, "record %d", i);
        cJSON_Delete(o);
    }
    anneal_tb_close(w);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' '%s/tests/obs/read_tensorboard.py' '%s'", py,
             getenv("ANNEAL_SOURCE_DIR") ? getenv("ANNEAL_SOURCE_DIR") : ".", tmpl);
    int rc = sh(cmd, buf, sizeof buf);
    CHECK(rc == 0, "reader exit %d: %s", rc, buf);
    cJSON *tb = cJSON_Parse(buf);
    REQUIRE(tb != NULL);
    const cJSON *s = series(tb, "texts", "samples");
    CHECK(cJSON_GetArraySize(s) == 2, "two samples: %s", buf);
    const cJSON *e0 = cJSON_GetArrayItem(s, 0), *e1 = cJSON_GetArrayItem(s, 1);
    CHECK(e0 && cJSON_GetArrayItem(e0, 0)->valuedouble == 7 &&
              !strcmp(cJSON_GetStringValue(cJSON_GetArrayItem(e0, 1)), "In the beginning \xc3\xa9"),
          "%s", buf);
    CHECK(e1 && cJSON_GetArrayItem(e1, 0)->valuedouble == 14, "%s", buf);
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(tb, "scalars")) == 0, "no scalars from these records");
    cJSON_Delete(tb);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpl);
    CHECK(system(cmd) == 0, "cleanup");
}

int main(void) {
    RUN(crc32c_known_vectors);
    RUN(writer_frames_every_record);
    RUN(event_accumulator_reads_a_training_run);
    RUN(event_accumulator_reads_samples);
    return anneal_test_summary();
}
