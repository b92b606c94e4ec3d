/* Replays fuzz inputs without libFuzzer (any compiler): each argument is a file or a
 * directory of files (a missing directory is fine: a harness without found crashes
 * has none), every file is fed once to the harness's LLVMFuzzerTestOneInput. A crash
 * or sanitizer report fails the test; the count replayed is printed. This is how the
 * seed corpus and every regression input run in each ordinary build (ctest
 * fuzz/replay_<name>). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Optional, as in libFuzzer: called once before the first input. */
__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv);

/* Feeds one file; returns 1 if it could not be read. */
static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: %s: cannot open\n", path);
        return 1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            uint8_t *b2 = realloc(buf, cap * 2);
            if (!b2) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b2, cap *= 2;
        }
    }
    fclose(f);
    if (!buf) return 1;
    /* a private copy of exactly n bytes, so ASan catches a read past the input */
    uint8_t *exact = malloc(n ? n : 1);
    if (!exact) return 1;
    memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv) {
    int files = 0, bad = 0;
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) continue;
        if (!S_ISDIR(sb.st_mode)) {
            bad += replay_file(argv[i]), files++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d) continue;
        char *names[4096];
        int n = 0;
        struct dirent *e;
        while ((e = readdir(d)) && n < 4096)
            if (e->d_name[0] != '.') names[n++] = strdup(e->d_name);
        closedir(d);
        qsort(names, (size_t)n, sizeof *names, cmp_str);
        for (int k = 0; k < n; k++) {
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", argv[i], names[k]);
            if (stat(p, &sb) == 0 && S_ISREG(sb.st_mode)) {
                printf("replay %s\n", p);
                fflush(stdout);
                bad += replay_file(p), files++;
            }
            free(names[k]);
        }
    }
    printf("replayed %d inputs, %d unreadable\n", files, bad);
    return bad ? 1 : 0;
}
