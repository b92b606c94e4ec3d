/* Hugging Face model directories without Python: anneal_model_save_hf round trips
 * (f32 one file, f32 sharded, bf16, f16: names, index, config torch_dtype, values back
 * exactly or as the stored rounding), and every kind of bad directory gives a clear
 * error naming the file and the tensor: malformed or incomplete index, missing shard,
 * shard paths that leave the directory (.., absolute, symlink), a tensor in two shards
 * or listed twice, a tensor the index names but its shard lacks, a shard tensor the
 * index does not list, a truncated shard, PyTorch pickles (.bin), no config.json, a
 * shape mismatch. A failed export (non-empty target, a write failing half way) leaves
 * nothing behind; export refuses unknown formats by name. */
#include "anneal/anneal.h"
#include "test.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <dirent.h>

static char tmp[128];

static anneal_model_config small_cfg(void) {
    anneal_model_config c = {.n_layer = 2, .n_head = 2, .n_embd = 32, .vocab_size = 67, .n_ctx = 16, .norm_eps = 1e-5f};
    snprintf(c.arch, sizeof c.arch, "gpt2");
    return c;
}

static anneal_model *small_model(void) {
    anneal_model_config c = small_cfg();
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (m && anneal_model_init(m, 42) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    return m;
}

static const char *path(const char *a, const char *b) {
    static char bufs[8][512];
    static int k;
    char *p = bufs[k++ % 8];
    if (b) snprintf(p, 512, "%s/%s/%s", tmp, a, b);
    else snprintf(p, 512, "%s/%s", tmp, a);
    return p;
}

static bool write_text(const char *p, const char *text) {
    FILE *f = fopen(p, "wb");
    if (!f) return false;
    bool ok = fwrite(text, 1, strlen(text), f) == strlen(text);
    return fclose(f) == 0 && ok;
}

static char *read_text(const char *p) {
    FILE *f = fopen(p, "rb");
    if (!f) return NULL;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static int sh(const char *cmd) {
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Copies directory a to b (under tmp). */
static bool copy_dir(const char *a, const char *b) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", path(b, NULL), path(a, NULL), path(b, NULL));
    return sh(cmd) == 0;
}

/* Every parameter of a equals b's, or b's rounded to dt. */
static void check_same_params(const anneal_model *a, const anneal_model *b, anneal_dtype dt, const char *what) {
    REQUIRE(a->params->n == b->params->n);
    for (int i = 0; i < a->params->n; i++) {
        const anneal_tensor *x = a->params->items[i].tensor, *y = b->params->items[i].tensor;
        int64_t n = anneal_numel(x);
        REQUIRE(n == anneal_numel(y));
        const float *px = anneal_data(x), *py = anneal_data(y);
        int64_t bad = -1;
        for (int64_t j = 0; j < n && bad < 0; j++) {
            float want = dt == ANNEAL_BF16 ? anneal_bf16_to_f32(anneal_f32_to_bf16(py[j]))
                       : dt == ANNEAL_F16  ? anneal_f16_to_f32(anneal_f32_to_f16(py[j]))
                                           : py[j];
            if (memcmp(&px[j], &want, sizeof want)) bad = j;
        }
        CHECK(bad < 0, "%s: %s[%lld] differs", what, a->params->items[i].name, (long long)bad);
    }
}

/* The error of loading dir contains every one of the (NULL-ended) words. */
static void expect_load_error(const char *dir, anneal_status want, const char *const *words) {
    anneal_clear_error();
    anneal_model *m = NULL;
    anneal_status r = anneal_model_load_hf(dir, ANNEAL_CPU, &m);
    CHECK(r != ANNEAL_OK && m == NULL, "%s: loaded", dir);
    if (want != ANNEAL_OK) CHECK(r == want, "%s: status %d, want %d (%s)", dir, (int)r, (int)want, anneal_last_error());
    for (int i = 0; words[i]; i++)
        CHECK(strstr(anneal_last_error(), words[i]), "%s: error '%s' lacks '%s'", dir, anneal_last_error(), words[i]);
    anneal_model_free(m);
    anneal_clear_error();
}

static bool setup(void) {
    if (tmp[0]) return true;
    snprintf(tmp, sizeof tmp, "/tmp/anneal_hf_dir_XXXXXX");
    return mkdtemp(tmp) != NULL;
}

/* Saved sets: "one" (f32, one file) and "sharded" (f32, 8 KB shards). */
static bool have_sets(void) {
    static int done;
    if (done) return done > 0;
    anneal_model *m = small_model();
    anneal_hf_save_opts one = {0}, sh8 = {.max_shard_bytes = 8000};
    done = m && anneal_model_save_hf(m, path("one", NULL), &one) == ANNEAL_OK &&
                   anneal_model_save_hf(m, path("sharded", NULL), &sh8) == ANNEAL_OK
               ? 1
               : -1;
    if (done < 0) fprintf(stderr, "save: %s\n", anneal_last_error());
    anneal_model_free(m);
    return done > 0;
}

TEST(save_and_load_round_trip) {
    REQUIRE(setup());
    anneal_model *m = small_model();
    REQUIRE(m);
    struct {
        const char *name;
        anneal_dtype dt;
        uint64_t shard;
        const char *torch;
    } cases[] = {
        {"rt_f32", ANNEAL_F32, 0, "float32"},
        {"rt_f32_sharded", ANNEAL_F32, 8000, "float32"},
        {"rt_bf16", ANNEAL_BF16, 5000, "bfloat16"},
        {"rt_f16", ANNEAL_F16, 0, "float16"},
    };
    for (int i = 0; i < 4; i++) {
        anneal_hf_save_opts o = {.dtype = cases[i].dt, .max_shard_bytes = cases[i].shard};
        const char *dir = path(cases[i].name, NULL);
        CHECK(anneal_model_save_hf(m, dir, &o) == ANNEAL_OK, "%s: %s", dir, anneal_last_error());
        char *cfg = read_text(path(cases[i].name, "config.json"));
        REQUIRE(cfg);
        char want[64];
        snprintf(want, sizeof want, "\"%s\"", cases[i].torch);
        CHECK(strstr(cfg, want) && strstr(cfg, "GPT2LMHeadModel"), "%s: config.json %s", dir, cfg);
        CHECK(access(path(cases[i].name, "generation_config.json"), F_OK) == 0, "%s: no generation_config.json", dir);
        bool sharded = access(path(cases[i].name, "model.safetensors.index.json"), F_OK) == 0;
        CHECK(sharded == (cases[i].shard > 0), "%s: index present %d", dir, sharded);
        CHECK(sharded != (access(path(cases[i].name, "model.safetensors"), F_OK) == 0), "%s: both or neither", dir);
        if (sharded) {
            char *idx = read_text(path(cases[i].name, "model.safetensors.index.json"));
            REQUIRE(idx);
            CHECK(strstr(idx, "total_size") && strstr(idx, "\"transformer.wte.weight\"") && strstr(idx, "-of-000"),
                  "%s: index %s", dir, idx);
            /* every shard within the size unless it holds a single larger tensor */
            anneal_hf_weights *w = NULL;
            REQUIRE(anneal_hf_weights_open(dir, &w) == ANNEAL_OK);
            CHECK(anneal_hf_weights_source(w)->n == m->params->n, "%s: %d tensors", dir, anneal_hf_weights_source(w)->n);
            anneal_hf_weights_close(w);
        }
        anneal_model *b = NULL;
        CHECK(anneal_model_load_hf(dir, ANNEAL_CPU, &b) == ANNEAL_OK, "%s: %s", dir, anneal_last_error());
        if (b) check_same_params(b, m, cases[i].dt, dir);
        anneal_model_free(b);
        /* no temporary left beside it */
        DIR *d = opendir(tmp);
        struct dirent *de;
        while (d && (de = readdir(d))) CHECK(!strstr(de->d_name, ".tmp."), "leftover %s", de->d_name);
        if (d) closedir(d);
    }
    /* a weights file or an index given directly, config.json found beside it */
    anneal_model *b = NULL;
    CHECK(anneal_model_load_hf(path("rt_f32", "model.safetensors"), ANNEAL_CPU, &b) == ANNEAL_OK, "%s", anneal_last_error());
    anneal_model_free(b);
    b = NULL;
    CHECK(anneal_model_load_hf(path("rt_bf16", "model.safetensors.index.json"), ANNEAL_CPU, &b) == ANNEAL_OK, "%s",
          anneal_last_error());
    anneal_model_free(b);
    anneal_model_free(m);
}

/* The index's first shard name (model-00001-of-0000N.safetensors). */
static const char *first_shard(void) {
    static char name[64];
    char *idx = read_text(path("sharded", "model.safetensors.index.json"));
    char *p = idx ? strstr(idx, "model-00001-of-") : NULL;
    if (!p) return NULL;
    snprintf(name, sizeof name, "%.*s", (int)(strstr(p, ".safetensors") - p) + 12, p);
    return name;
}

/* Rewrites the sharded copy's index with the first shard's name replaced by repl. */
static bool index_with_first_shard_as(const char *dir, const char *repl) {
    const char *first = first_shard();
    char *idx = first ? read_text(path("sharded", "model.safetensors.index.json")) : NULL;
    if (!idx) return false;
    static char outb[1 << 16];
    size_t o = 0, fl = strlen(first);
    for (const char *p = idx; *p;) {
        if (!strncmp(p, first, fl)) {
            o += (size_t)snprintf(outb + o, sizeof outb - o, "%s", repl);
            p += fl;
        } else {
            outb[o++] = *p++;
        }
    }
    outb[o] = '\0';
    return write_text(path(dir, "model.safetensors.index.json"), outb);
}

TEST(bad_index_and_shards_are_named) {
    REQUIRE(setup());
    REQUIRE(have_sets());
    const char *first = first_shard();
    REQUIRE(first);

    REQUIRE(copy_dir("sharded", "bad_json"));
    REQUIRE(write_text(path("bad_json", "model.safetensors.index.json"), "{\"weight_map\": {\"a\": "));
    expect_load_error(path("bad_json", NULL), ANNEAL_ERR_FORMAT,
                      (const char *[]){"model.safetensors.index.json", "invalid JSON", NULL});

    REQUIRE(write_text(path("bad_json", "model.safetensors.index.json"), "{\"metadata\": {}}"));
    expect_load_error(path("bad_json", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"index.json", "weight_map", NULL});

    REQUIRE(write_text(path("bad_json", "model.safetensors.index.json"), "{\"weight_map\": {\"transformer.wte.weight\": 3}}"));
    expect_load_error(path("bad_json", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"transformer.wte.weight", "not a file name", NULL});

    REQUIRE(copy_dir("sharded", "missing"));
    REQUIRE(unlink(path("missing", first)) == 0);
    expect_load_error(path("missing", NULL), ANNEAL_ERR_IO, (const char *[]){first, "missing", "transformer.", NULL});

    REQUIRE(copy_dir("sharded", "dotdot"));
    REQUIRE(index_with_first_shard_as("dotdot", "../one/model.safetensors"));
    expect_load_error(path("dotdot", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"../one/model.safetensors", "leaves", NULL});

    REQUIRE(copy_dir("sharded", "absolute"));
    REQUIRE(index_with_first_shard_as("absolute", path("one", "model.safetensors")));
    expect_load_error(path("absolute", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"absolute path", NULL});

    REQUIRE(copy_dir("sharded", "symlink"));
    REQUIRE(unlink(path("symlink", first)) == 0);
    REQUIRE(symlink(path("sharded", first), path("symlink", first)) == 0);
    expect_load_error(path("symlink", NULL), ANNEAL_ERR_FORMAT, (const char *[]){first, "outside the model directory", NULL});

    /* the first shard's tensors all mapped to the second shard, which lacks them */
    REQUIRE(copy_dir("sharded", "lacks"));
    REQUIRE(index_with_first_shard_as("lacks", "model-00002-of-00000.safetensors"));
    {
        char *idx = read_text(path("lacks", "model.safetensors.index.json"));
        REQUIRE(idx);
        char second[64];
        snprintf(second, sizeof second, "%s", first);
        second[10] = '2'; /* model-00002-of-... */
        char fixed[1 << 16];
        size_t o = 0;
        for (const char *p = idx; *p;) {
            if (!strncmp(p, "model-00002-of-00000.safetensors", 32)) o += (size_t)snprintf(fixed + o, sizeof fixed - o, "%s", second), p += 32;
            else fixed[o++] = *p++;
        }
        fixed[o] = '\0';
        REQUIRE(write_text(path("lacks", "model.safetensors.index.json"), fixed));
        expect_load_error(path("lacks", NULL), ANNEAL_ERR_FORMAT, (const char *[]){second, "does not hold it", NULL});
    }

    REQUIRE(copy_dir("sharded", "trunc"));
    REQUIRE(truncate(path("trunc", first), 200) == 0);
    expect_load_error(path("trunc", NULL), ANNEAL_ERR_FORMAT, (const char *[]){first, NULL});

    /* hand-made sets: s1 {a, b}, s2 {b, c} */
    mkdir(path("two", NULL), 0755);
    REQUIRE(write_text(path("two", "config.json"), read_text(path("one", "config.json"))));
    float v[4] = {1, 2, 3, 4};
    int64_t shp[1] = {4};
    anneal_st_write_entry ab[2] = {{"a", ANNEAL_F32, 1, shp, v}, {"b", ANNEAL_F32, 1, shp, v}};
    anneal_st_write_entry bc[2] = {{"b", ANNEAL_F32, 1, shp, v}, {"c", ANNEAL_F32, 1, shp, v}};
    REQUIRE(anneal_safetensors_write(path("two", "s1.safetensors"), 2, ab, 0, NULL, NULL) == ANNEAL_OK);
    REQUIRE(anneal_safetensors_write(path("two", "s2.safetensors"), 2, bc, 0, NULL, NULL) == ANNEAL_OK);
    REQUIRE(write_text(path("two", "model.safetensors.index.json"),
                       "{\"weight_map\": {\"a\": \"s1.safetensors\", \"b\": \"s1.safetensors\", \"c\": \"s2.safetensors\"}}"));
    expect_load_error(path("two", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"'b'", "two shards", "s2.safetensors", NULL});
    REQUIRE(write_text(path("two", "model.safetensors.index.json"),
                       "{\"weight_map\": {\"a\": \"s1.safetensors\", \"a\": \"s1.safetensors\", \"b\": \"s1.safetensors\"}}"));
    expect_load_error(path("two", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"\"a\"", "duplicate key", NULL});
    REQUIRE(write_text(path("two", "model.safetensors.index.json"), "{\"weight_map\": {\"a\": \"s1.safetensors\"}}"));
    expect_load_error(path("two", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"s1.safetensors", "'b'", "does not list", NULL});
}

TEST(pickles_configs_and_shapes) {
    REQUIRE(setup());
    REQUIRE(have_sets());
    static const char zip[] = "PK\3\4pytorch_model/data.pkl....";
    mkdir(path("bin", NULL), 0755);
    REQUIRE(write_text(path("bin", "config.json"), read_text(path("one", "config.json"))));
    REQUIRE(write_text(path("bin", "pytorch_model.bin"), zip));
    expect_load_error(path("bin", NULL), ANNEAL_ERR_UNSUPPORTED,
                      (const char *[]){"pytorch_model.bin", "safetensors", "convert", NULL});
    expect_load_error(path("bin", "pytorch_model.bin"), ANNEAL_ERR_UNSUPPORTED, (const char *[]){"convert", NULL});
    /* a pickle under a safetensors name (the old "header length ... is absurd") */
    REQUIRE(write_text(path("bin", "model.safetensors"), "\x80\x02}q\x00(X\x05\x00\x00\x00"));
    expect_load_error(path("bin", NULL), ANNEAL_ERR_UNSUPPORTED, (const char *[]){"model.safetensors", "pickle", NULL});

    REQUIRE(copy_dir("one", "nocfg"));
    REQUIRE(unlink(path("nocfg", "config.json")) == 0);
    expect_load_error(path("nocfg", NULL), ANNEAL_ERR_IO, (const char *[]){"config.json", "nocfg", NULL});

    mkdir(path("empty", NULL), 0755);
    expect_load_error(path("empty", NULL), ANNEAL_ERR_IO, (const char *[]){"model.safetensors", NULL});

    /* n_embd 32 -> 34 in config.json: every weight has the wrong shape; the first is named */
    REQUIRE(copy_dir("one", "shape"));
    char *cfg = read_text(path("shape", "config.json"));
    REQUIRE(cfg);
    char *p = strstr(cfg, "\"n_embd\":");
    REQUIRE(p);
    char patched[1 << 14];
    snprintf(patched, sizeof patched, "%.*s\"n_embd\": 34, %s", (int)(p - cfg), cfg, strchr(p, ',') + 1);
    REQUIRE(write_text(path("shape", "config.json"), patched));
    expect_load_error(path("shape", NULL), ANNEAL_ERR_FORMAT, (const char *[]){"transformer.wte.weight", "(67, 32)", "(67, 34)", NULL});
}

TEST(failed_exports_leave_nothing) {
    REQUIRE(setup());
    anneal_model *m = small_model();
    REQUIRE(m);
    anneal_hf_save_opts o = {0};
    /* a non-empty target is refused and left alone */
    mkdir(path("full", NULL), 0755);
    REQUIRE(write_text(path("full", "keep.txt"), "mine"));
    CHECK(anneal_model_save_hf(m, path("full", NULL), &o) == ANNEAL_ERR_IO && strstr(anneal_last_error(), "not empty"),
          "%s", anneal_last_error());
    CHECK(read_text(path("full", "keep.txt")) && !strcmp(read_text(path("full", "keep.txt")), "mine"), "touched");
    CHECK(access(path("full", "config.json"), F_OK) != 0, "wrote into a non-empty directory");
    /* an empty directory is taken */
    mkdir(path("emptyout", NULL), 0755);
    CHECK(anneal_model_save_hf(m, path("emptyout", NULL), &o) == ANNEAL_OK, "%s", anneal_last_error());
    /* a store type that is not a float */
    anneal_hf_save_opts bad = {.dtype = ANNEAL_I32};
    CHECK(anneal_model_save_hf(m, path("i32", NULL), &bad) == ANNEAL_ERR_ARG, "%s", anneal_last_error());
    CHECK(access(path("i32", NULL), F_OK) != 0, "a failed export left its directory");
    /* a write failing half way (files may not exceed 4 KB: the shards fail after config.json) */
    struct rlimit old, lim;
    REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    lim = old;
    lim.rlim_cur = 4096;
    REQUIRE(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    anneal_status r = anneal_model_save_hf(m, path("half", NULL), &o);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CHECK(r == ANNEAL_ERR_IO, "status %d: %s", (int)r, anneal_last_error());
    CHECK(access(path("half", NULL), F_OK) != 0, "a failed export left %s", path("half", NULL));
    DIR *d = opendir(tmp);
    struct dirent *de;
    while (d && (de = readdir(d))) CHECK(!strstr(de->d_name, ".tmp."), "leftover %s", de->d_name);
    if (d) closedir(d);
    anneal_clear_error();
    anneal_model_free(m);
}

TEST(commands_refuse_other_formats_and_bad_model_dirs) {
    if (!getenv("ANNEAL_BIN")) SKIP("ANNEAL_BIN not set (run through ctest)");
    REQUIRE(setup());
    REQUIRE(have_sets());
    struct {
        const char *args, *expect;
        int rc;
    } cases[] = {
        {"export --model %s/one --format gguf --gguf-type q4_k --out %s/g", "--gguf-type", 2},
        {"export --model %s/one --format hf --external-data --out %s/g", "--format onnx", 2},
        {"export --model %s/one --format safetensors --out %s/g", "unknown format 'safetensors'", 2},
        {"export --model %s/one --dtype int8 --out %s/g", "--dtype", 2},
        {"export --model %s/one --max-shard-size 2XB --out %s/g", "--max-shard-size", 2},
        {"export --model %s/one", "--out", 2},
        {"export --model %s/one --out %s/one", "not empty", 1},
        {"export --model %s/nowhere --out %s/g", "nowhere", 2},
        /* the same loader behind eval, generate and train --model (dirs of pickles_configs_and_shapes) */
        {"eval --model %s/bin --data %s/nodata --json", "convert", 1},
        {"generate --model %s/nocfg --prompt a --max-tokens 1", "config.json", 1},
        {"generate --hf-model %s/sharded --prompt a --max-tokens 1 --tokenizer %s/missing-tok", "missing-tok", 1},
        {"train --model %s/bin --synthetic --steps 1 --seq 8 --out %s/g", "convert", 1},
        {"train --model %s/one --init %s/one --synthetic --steps 1 --out %s/g", "once", 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[1024], cmd[2048];
        snprintf(args, sizeof args, cases[i].args, tmp, tmp, tmp);
        snprintf(cmd, sizeof cmd, "'%s' %s%s 2>'%s/err.txt'", getenv("ANNEAL_BIN"), args,
                 strncmp(args, "export", 6) ? "" : " --tokenizer none", tmp);
        int rc = sh(cmd);
        char *e = read_text(path("err.txt", NULL));
        CHECK(rc == cases[i].rc, "%s: exit %d, want %d (%s)", args, rc, cases[i].rc, e ? e : "");
        CHECK(e && strstr(e, cases[i].expect), "%s: stderr lacks '%s': %s", args, cases[i].expect, e ? e : "");
        CHECK(access(path("g", NULL), F_OK) != 0, "%s: wrote %s/g", args, tmp);
    }
    /* and the one that works: bf16 shards of a model directory, read back */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' export --model %s/one --dtype bf16 --max-shard-size 6KB --out %s/g 2>'%s/err.txt'",
             getenv("ANNEAL_BIN"), tmp, tmp, tmp);
    CHECK(sh(cmd) == 0, "%s", read_text(path("err.txt", NULL)));
    anneal_model *m = NULL;
    CHECK(anneal_model_load_hf(path("g", NULL), ANNEAL_CPU, &m) == ANNEAL_OK, "%s", anneal_last_error());
    CHECK(access(path("g", "model-00001-of-00005.safetensors"), F_OK) == 0 ||
              access(path("g", "model.safetensors.index.json"), F_OK) == 0,
          "no shards");
    anneal_model_free(m);
}

int main(void) {
    RUN(save_and_load_round_trip);
    RUN(bad_index_and_shards_are_named);
    RUN(pickles_configs_and_shapes);
    RUN(failed_exports_leave_nothing);
    RUN(commands_refuse_other_formats_and_bad_model_dirs);
    int rc = anneal_test_summary();
    if (tmp[0]) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp);
    }
    return rc;
}
