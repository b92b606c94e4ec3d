/* The Prometheus endpoint: its text passes `promtool check metrics` (Debian's
 * prometheus), bad flags are refused, and a scrape of a running `anneal train
 * --metrics-port` over a plain socket, twice, shows the step counter rising. */
#include "test.h"

#include "anneal/telemetry.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

static bool have_promtool(void) { return system("command -v promtool >/dev/null 2>&1") == 0; }

/* Runs promtool check metrics on text; returns its exit code, output in buf. */
static int promtool_check(const char *text) {
    char path[] = "/tmp/anneal_prom_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    size_t n = strlen(text);
    bool ok = write(fd, text, n) == (ssize_t)n;
    close(fd);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
    int rc = ok ? sh(cmd, buf, sizeof buf) : -1;
    unlink(path);
    return rc;
}

/* The value of a sample line "name value" in an exposition text (NaN if absent). */
static double sample(const char *text, const char *name) {
    size_t k = strlen(name);
    for (const char *p = text; p && *p;) {
        if (!strncmp(p, name, k) && p[k] == ' ') return strtod(p + k + 1, NULL);
        p = strchr(p, '\n');
        if (p) p++;
    }
    return NAN;
}

/* GET /metrics from 127.0.0.1:port with a plain socket; the body into out (0 on
 * success, -1 when nobody listens or the answer is not a 200). */
static int scrape(int port, char *out, size_t cap) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
        close(s);
        return -1;
    }
    const char req[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(s, req, sizeof req - 1) != (ssize_t)(sizeof req - 1)) {
        close(s);
        return -1;
    }
    size_t n = 0;
    for (;;) {
        ssize_t k = read(s, out + n, cap - 1 - n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        n += (size_t)k;
        if (n >= cap - 1) break;
    }
    close(s);
    out[n] = 0;
    if (strncmp(out, "HTTP/1.", 7) || !strstr(out, " 200 ")) return -1;
    char *body = strstr(out, "\r\n\r\n");
    if (!body) return -1;
    memmove(out, body + 4, strlen(body + 4) + 1);
    return 0;
}

/* A port nobody listens on now (bind to 0, read it, close). */
static int free_port(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(s, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(s, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(s);
    return port;
}

TEST(render_passes_promtool) {
    anneal_metrics *m = NULL;
    REQUIRE(anneal_metrics_start(NULL, 0, &m) == ANNEAL_OK);
    CHECK(anneal_metrics_port(m) > 0, "port %d", anneal_metrics_port(m));
    cJSON *st = cJSON_Parse("{\"type\":\"start\",\"step\":0,\"total_steps\":10,\"tokens_per_step\":128,"
                            "\"config\":{\"batch\":4,\"accum\":2}}");
    cJSON *s1 = cJSON_Parse("{\"type\":\"step\",\"step\":1,\"loss\":5.5,\"lr\":0.001,\"grad_norm\":1.5,"
                            "\"tokens_per_s\":1000,\"mfu\":0.1,\"ms\":120,\"tokens\":128,\"memory_bytes\":4096,"
                            "\"skipped\":false}");
    cJSON *s2 = cJSON_Parse("{\"type\":\"step\",\"step\":2,\"loss\":5.0,\"lr\":0.002,\"grad_norm\":1.0,"
                            "\"tokens_per_s\":1100,\"mfu\":0.11,\"ms\":3,\"tokens\":256,\"memory_bytes\":4096,"
                            "\"skipped\":true}");
    cJSON *ev = cJSON_Parse("{\"type\":\"eval\",\"step\":2,\"val_loss\":5.25}");
    anneal_metrics_record(m, st);
    anneal_metrics_record(m, s1);
    anneal_metrics_record(m, s2);
    anneal_metrics_record(m, ev);
    anneal_metrics_rank_step_seconds(m, 2, (double[]){0.12, 0.13});
    char *text = anneal_metrics_render(m);
    REQUIRE(text != NULL);
    CHECK(sample(text, "anneal_steps_total") == 2, "%s", text);
    CHECK(sample(text, "anneal_tokens_total") == 256, "tokens");
    CHECK(sample(text, "anneal_samples_total") == 16, "samples: batch 4 x accum 2 per step");
    CHECK(sample(text, "anneal_skipped_steps_total") == 1, "skipped");
    CHECK(sample(text, "anneal_val_loss") == 5.25, "val loss");
    CHECK(sample(text, "anneal_learning_rate") == 0.002, "lr");
    CHECK(sample(text, "anneal_step_duration_seconds_count") == 2, "histogram count");
    CHECK(strstr(text, "anneal_step_duration_seconds_bucket{le=\"0.005\"} 1\n") != NULL, "3 ms in the first bucket");
    CHECK(strstr(text, "anneal_step_duration_seconds_bucket{le=\"0.1\"} 1\n") != NULL, "120 ms above 0.1 s");
    CHECK(strstr(text, "anneal_step_duration_seconds_bucket{le=\"0.25\"} 2\n") != NULL, "cumulative");
    CHECK(strstr(text, "anneal_rank_step_duration_seconds{rank=\"1\"} 0.13") != NULL, "per rank");
    if (have_promtool()) {
        int rc = promtool_check(text);
        CHECK(rc == 0, "promtool: %d %s\n%s", rc, buf, text);
    } else {
        anneal_test_skip_promised("promtool missing (scripts/bootstrap.sh installs Debian's prometheus)");
    }
    /* the endpoint serves the same text; other paths are 404 */
    static char got[1 << 16];
    CHECK(scrape(anneal_metrics_port(m), got, sizeof got) == 0 && sample(got, "anneal_steps_total") == 2, "%s", got);
    free(text);
    cJSON_Delete(st), cJSON_Delete(s1), cJSON_Delete(s2), cJSON_Delete(ev);
    anneal_metrics_stop(m);
}

TEST(bad_addresses_are_refused) {
    anneal_metrics *m = NULL;
    CHECK(anneal_metrics_start("not-an-ip", 0, &m) == ANNEAL_ERR_ARG && !m && strstr(anneal_last_error(), "not-an-ip"),
          "%s", anneal_last_error());
    anneal_clear_error();
    CHECK(anneal_metrics_start(NULL, 70000, &m) == ANNEAL_ERR_ARG, "port out of range");
    anneal_clear_error();
    /* a port in use */
    anneal_metrics *a = NULL;
    REQUIRE(anneal_metrics_start(NULL, 0, &a) == ANNEAL_OK);
    CHECK(anneal_metrics_start(NULL, anneal_metrics_port(a), &m) == ANNEAL_ERR_IO && !m, "port in use accepted");
    anneal_clear_error();
    anneal_metrics_stop(a);
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' train --synthetic --steps 1 --metrics-port 70000", bin);
    CHECK(sh(cmd, buf, sizeof buf) == 2 && strstr(buf, "--metrics-port"), "%s", buf);
}

TEST(scrape_during_training_sees_steps_rise) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    char tmpl[] = "/tmp/anneal_metrics_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != NULL);
    int port = free_port();
    REQUIRE(port > 0);
    char out[300], ports[16], logp[300];
    snprintf(out, sizeof out, "%s/run", tmpl);
    snprintf(logp, sizeof logp, "%s/stdout", tmpl);
    snprintf(ports, sizeof ports, "%d", port);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        FILE *f = freopen(logp, "w", stdout);
        (void)f;
        dup2(fileno(stdout), 2);
        execl(bin, bin, "train", "--synthetic", "--steps", "1000000", "--batch", "2", "--seq", "16", "--threads", "1",
              "--ckpt-every", "0", "--out", out, "--metrics-port", ports, (char *)NULL);
        _exit(127);
    }
    static char a[1 << 16], b[1 << 16];
    double s1 = NAN, s2 = NAN;
    struct timespec nap = {0, 50 * 1000 * 1000};
    /* wait for the server and a first step (60 s at most: ASan builds start slowly) */
    for (int i = 0; i < 1200 && !(s1 >= 1); i++) {
        if (scrape(port, a, sizeof a) == 0) s1 = sample(a, "anneal_steps_total");
        if (!(s1 >= 1)) nanosleep(&nap, NULL);
    }
    for (int i = 0; i < 1200 && !(s2 > s1); i++) {
        nanosleep(&nap, NULL);
        if (scrape(port, b, sizeof b) == 0) s2 = sample(b, "anneal_steps_total");
    }
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(s1 >= 1 && s2 > s1, "steps_total %g then %g", s1, s2);
    CHECK(sample(b, "anneal_tokens_total") == s2 * 32, "tokens %g at %g steps", sample(b, "anneal_tokens_total"), s2);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "train ended with status %d", status);
    if (have_promtool()) CHECK(promtool_check(b) == 0, "promtool on the scrape: %s", buf);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpl);
    CHECK(system(cmd) == 0, "cleanup");
}

/* mpirun -np 2: rank 0 serves the endpoint with every rank's step time. */
TEST(distributed_run_serves_per_rank_step_time) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    if (system("command -v mpirun >/dev/null 2>&1") != 0) SKIP_PROMISED("mpirun not found (bootstrap installs openmpi-bin)");
    char tmpl[] = "/tmp/anneal_metrics_mpi_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != NULL);
    int port = free_port();
    REQUIRE(port > 0);
    char cmd[2048], logp[300];
    snprintf(logp, sizeof logp, "%s/stdout", tmpl);
    /* as tests/parallel/test_train_dist.c runs MPI: no CMA, leak checks off for the ranks */
    snprintf(cmd, sizeof cmd,
             "exec mpirun -np 2 --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "
             "--mca btl_vader_single_copy_mechanism none%s '%s' train --synthetic --steps 1000000 --batch 2 --seq 16 "
             "--threads 1 --ckpt-every 0 --out '%s/run' --metrics-port %d > '%s' 2>&1",
             anneal_test_sanitized() ? " -x ASAN_OPTIONS=detect_leaks=0" : "", bin, tmpl, port, logp);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    static char a[1 << 16];
    bool seen = false;
    struct timespec nap = {0, 100 * 1000 * 1000};
    for (int i = 0; i < 900 && !seen; i++) { /* 90 s at most */
        if (scrape(port, a, sizeof a) == 0 && strstr(a, "anneal_rank_step_duration_seconds{rank=\"1\"} ")) seen = true;
        else nanosleep(&nap, NULL);
    }
    kill(pid, SIGTERM); /* mpirun forwards it: both ranks stop together with a checkpoint */
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(seen, "no per-rank step time in %s", a);
    if (seen) {
        const char *r0 = strstr(a, "anneal_rank_step_duration_seconds{rank=\"0\"} ");
        CHECK(r0 && strtod(r0 + strlen("anneal_rank_step_duration_seconds{rank=\"0\"} "), NULL) > 0, "rank 0: %s", a);
        if (have_promtool()) CHECK(promtool_check(a) == 0, "promtool: %s", buf);
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpl);
    CHECK(system(cmd) == 0, "cleanup");
}

int main(void) {
    RUN(render_passes_promtool);
    RUN(bad_addresses_are_refused);
    RUN(scrape_during_training_sees_steps_rise);
    RUN(distributed_run_serves_per_rank_step_time);
    return anneal_test_summary();
}
