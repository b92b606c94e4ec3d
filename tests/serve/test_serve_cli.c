/* `anneal serve`'s flags: bad values are usage errors naming the flag (exit 2), an
 * address that is not one and a port already taken are errors saying so (exit 1),
 * --help lists the flags. */
#include "test.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static char err[1 << 14];

/* Runs "$ANNEAL_BIN serve args" with stdout and stderr into err; returns the exit code. */
static int run(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' serve %s 2>&1", getenv("ANNEAL_BIN"), args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(err, 1, sizeof err - 1, f);
    err[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(bad_flags_name_the_flag) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    static const struct {
        const char *args, *flag;
        int rc;
    } cases[] = {
        {"", "--ckpt", 2},
        {"--ckpt a --model b", "--ckpt", 2},
        {"--model tiny --port 70000", "--port", 2},
        {"--model tiny --port -1", "--port", 2},
        {"--model tiny --slots 0", "--slots", 2},
        {"--model tiny --queue 0", "--queue", 2},
        {"--model tiny --max-body 10", "--max-body", 2},
        {"--model tiny --max-tokens -5", "--max-tokens", 2},
        {"--model tiny --request-timeout 0", "--request-timeout", 2},
        {"--model tiny --grace -1", "--grace", 2},
        {"--model tiny --max-connections 0", "--max-connections", 2},
        {"--model tiny --dtype fp8", "--dtype", 2},
        {"--model tiny --kv-dtype fp8", "--kv-dtype", 2},
        {"--model tiny --slots abc", "--slots", 2},
        {"--model tiny --bogus 1", "--bogus", 2},
        {"--model tiny --tokenizer tests/fixtures/hf_tokenizers/llama3_bl --host not-an-address --port 0", "--host", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = run(cases[i].args);
        CHECK(rc == cases[i].rc && strstr(err, cases[i].flag), "serve %s: exit %d (want %d), output: %s",
              cases[i].args, rc, cases[i].rc, err);
    }
    CHECK(run("--help") == 0 && strstr(err, "--slots") && strstr(err, "--request-timeout"), "%s", err);
}

TEST(port_in_use_is_an_error) {
    if (!getenv("ANNEAL_BIN")) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 1) == 0);
    socklen_t len = sizeof a;
    REQUIRE(getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    char args[256];
    snprintf(args, sizeof args, "--model tiny --tokenizer tests/fixtures/hf_tokenizers/llama3_bl --port %d", ntohs(a.sin_port));
    int rc = run(args);
    CHECK(rc == 1 && strstr(err, "cannot listen on 127.0.0.1"), "exit %d: %s", rc, err);
    close(fd);
}

int main(void) {
    RUN(bad_flags_name_the_flag);
    RUN(port_in_use_is_an_error);
    return anneal_test_summary();
}
