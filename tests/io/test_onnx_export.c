/* ONNX export (anneal_model_save_onnx, `anneal export --format onnx`), proven by the
 * real clients (tests/io/onnx_run.py in the .venv: onnx.checker.check_model with
 * full_check on the path, onnxruntime 1.20 on the CPU):
 * - GPT-2 tiny, llama-tiny (GQA 4/2, untied head, theta 500000 with linear scaling,
 *   attention_bias: biases on q, k, v and o) and
 *   a Qwen2-like config (q/k/v biases, GQA 8/2, tied head, theta 1e6 with llama3
 *   scaling), random weights (biases and norms too): onnxruntime's logits equal
 *   anneal's (max |a - b| / max |b| <= 1e-4) at batch 2 and two sequence lengths in one
 *   session (dynamic axes);
 * - with the KV cache: a prompt then 5 greedy steps in onnxruntime (presents fed back
 *   as pasts) give anneal_model_forward_cached's logits and tokens;
 * - the command line: --onnx-kv-cache and --external-data from a Hugging Face
 *   directory and from a bf16 one (converted to f32), and --ckpt RUN of a training run,
 *   checked and run the same way;
 * - bad cases without Python: an unwritable path, an architecture without an ONNX
 *   exporter, a LoRA adapter (nothing written), a failed graph, an unknown --format,
 *   ONNX flags with --format hf, --dtype bf16 with --format onnx; the automatic switch to
 *   external data above the limit (lowered for the test). */
#include "anneal/anneal.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define BATCH 2
#define STEPS 5
#define PROMPT 4

static char tmpdir[256];
static char out[1 << 16], err[1 << 16];

/* Runs a shell command, stdout into out, stderr into err; returns the exit code. */
static int sh(const char *cmd) {
    char full[8192], errpath[400];
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", tmpdir);
    snprintf(full, sizeof full, "%s 2>'%s'", cmd, errpath);
    FILE *f = popen(full, "r");
    if (!f) return -1;
    size_t got = fread(out, 1, sizeof out - 1, f);
    out[got] = '\0';
    int st = pclose(f);
    FILE *e = fopen(errpath, "rb");
    size_t ge = e ? fread(err, 1, sizeof err - 1, e) : 0;
    err[ge] = '\0';
    if (e) fclose(e);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static bool setup(void) {
    if (tmpdir[0]) return true;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_onnx_XXXXXX");
    return mkdtemp(tmpdir) != NULL;
}

static bool exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static int64_t file_size(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 ? (int64_t)st.st_size : -1;
}

/* The three configs: "gpt2", "llama", "qwen2". */
static bool config_of(const char *which, anneal_model_config *c) {
    if (!strcmp(which, "gpt2")) return anneal_model_preset("tiny", c);
    if (!anneal_model_preset("llama-tiny", c)) return false;
    if (!strcmp(which, "llama")) {
        c->rope_theta = c->rope.theta = 500000.0f;
        c->rope.scaling = ANNEAL_ROPE_SCALING_LINEAR;
        c->rope.factor = 2.0f;
        c->qkv_bias = c->out_bias = true; /* Llama's attention_bias: all four projections */
        return true;
    }
    snprintf(c->hf_model_type, sizeof c->hf_model_type, "qwen2");
    c->n_head = 8;
    c->n_kv_head = 2;
    c->qkv_bias = true;
    c->tie_embeddings = true;
    c->rope_theta = c->rope.theta = 1000000.0f;
    c->rope.scaling = ANNEAL_ROPE_SCALING_LLAMA3;
    c->rope.factor = 8.0f;
    c->rope.low_freq_factor = 1.0f;
    c->rope.high_freq_factor = 4.0f;
    c->rope.original_max_pos = 64;
    return true;
}

/* A model of config `which` with random weights: every parameter N(0, 0.08) (biases
 * too), norm weights N(1, 0.08), from seed. */
static anneal_model *make_model(const char *which, uint64_t seed) {
    anneal_model_config c;
    if (!config_of(which, &c)) return NULL;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    if (!m || anneal_model_init(m, seed) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    anneal_manual_seed(seed + 1);
    for (int i = 0; i < m->params->n; i++) {
        const char *n = m->params->items[i].name;
        bool norm = strstr(n, "norm.weight") || strstr(n, "ln_") || strstr(n, "layernorm.weight");
        bool is_norm_w = norm && strstr(n, ".weight");
        if (anneal_init_normal_(m->params->items[i].tensor, is_norm_w ? 1.0f : 0.0f, 0.08f) != ANNEAL_OK) {
            anneal_model_free(m);
            return NULL;
        }
    }
    return m;
}

/* Deterministic ids < vocab (n of them) as int32 and int64. */
static void make_ids(int32_t *i32, int64_t *i64, int n, int vocab, uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        i32[i] = (int32_t)(x % (uint64_t)vocab);
        i64[i] = i32[i];
    }
}

static bool write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    bool ok = f && fwrite(p, 1, n, f) == n;
    if (f) fclose(f);
    return ok;
}

/* Reads exactly n bytes of path into a malloc'd buffer (NULL otherwise). */
static void *read_file(const char *path, size_t n) {
    FILE *f = fopen(path, "rb");
    void *p = f ? malloc(n ? n : 1) : NULL;
    bool ok = p && fread(p, 1, n, f) == n && fgetc(f) == EOF;
    if (f) fclose(f);
    if (!ok) {
        free(p);
        return NULL;
    }
    return p;
}

/* max |a - b| / max |b|. */
static double rel_err(const float *a, const float *b, int64_t n) {
    double d = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]);
        if (!(e <= d)) d = e; /* NaN sticks */
        if (fabs((double)b[i]) > mx) mx = fabs((double)b[i]);
    }
    return mx > 0 ? d / mx : d;
}

/* anneal's logits (B, T, V) of ids into a malloc'd buffer. */
static float *anneal_logits(anneal_model *m, const int32_t *ids, int T) {
    int64_t shape[2] = {BATCH, T};
    anneal_scope *sc = anneal_scope_open();
    anneal_no_grad_begin();
    anneal_tensor *t = anneal_model_logits(m, anneal_from_data(ANNEAL_I32, 2, shape, ids));
    float *buf = t ? malloc((size_t)anneal_numel(t) * sizeof(float)) : NULL;
    if (buf && anneal_to_f32_buffer(t, buf) != ANNEAL_OK) {
        free(buf);
        buf = NULL;
    }
    anneal_no_grad_end();
    anneal_scope_close(sc);
    return buf;
}

/* anneal's greedy decode with its KV cache: the last-row logits of the prompt and of
 * each of STEPS steps ((STEPS + 1), B, V) and the tokens (STEPS, B). */
static bool anneal_decode(anneal_model *m, const int32_t *prompt, float *rows, int64_t *toks) {
    const int64_t V = m->cfg.vocab_size;
    anneal_kv_cache *kv = anneal_model_kv_cache_new(m, BATCH, 32);
    if (!kv) return false;
    int32_t ids[BATCH * PROMPT];
    memcpy(ids, prompt, sizeof ids);
    int T = PROMPT;
    bool ok = true;
    for (int step = 0; step <= STEPS && ok; step++) {
        anneal_scope *sc = anneal_scope_open();
        int64_t shape[2] = {BATCH, T};
        anneal_tensor *lg = anneal_model_forward_cached(m, kv, anneal_from_data(ANNEAL_I32, 2, shape, ids));
        float *all = lg ? malloc((size_t)anneal_numel(lg) * sizeof(float)) : NULL;
        ok = all && anneal_to_f32_buffer(lg, all) == ANNEAL_OK;
        for (int b = 0; b < BATCH && ok; b++) {
            const float *last = all + ((int64_t)b * T + (T - 1)) * V;
            memcpy(rows + ((int64_t)step * BATCH + b) * V, last, (size_t)V * sizeof(float));
            int64_t best = 0;
            for (int64_t v = 1; v < V; v++)
                if (last[v] > last[best]) best = v;
            if (step < STEPS) toks[step * BATCH + b] = best;
            ids[b] = (int32_t)best;
        }
        free(all);
        anneal_scope_close(sc);
        T = 1;
    }
    anneal_kv_cache_free(kv);
    return ok;
}

/* Checks `model` (and the KV-cache `kv_model` when not NULL) with onnx_run.py against
 * m: logits at T = 5 and 11, batch 2, and the decode loop. */
static void check_with_runtime(anneal_model *m, const char *tag, const char *model, const char *kv_model,
                               const char *py) {
    const int Ts[2] = {5, 11};
    const int V = m->cfg.vocab_size;
    char spec[4096], p[512], ids_path[2][512], lg_path[2][512];
    int32_t i32[2][BATCH * 11];
    int64_t i64[2][BATCH * 11];
    int n = snprintf(spec, sizeof spec, "{\"model\": \"%s\", \"runs\": [", model);
    for (int r = 0; r < 2; r++) {
        make_ids(i32[r], i64[r], BATCH * Ts[r], V, 7 + (uint64_t)r);
        snprintf(ids_path[r], sizeof ids_path[r], "%s/%s_ids%d.bin", tmpdir, tag, r);
        snprintf(lg_path[r], sizeof lg_path[r], "%s/%s_ort%d.bin", tmpdir, tag, r);
        REQUIRE(write_file(ids_path[r], i64[r], sizeof(int64_t) * BATCH * (size_t)Ts[r]));
        n += snprintf(spec + n, sizeof spec - (size_t)n, "%s{\"ids\": \"%s\", \"shape\": [%d, %d], \"out\": \"%s\"}",
                      r ? ", " : "", ids_path[r], BATCH, Ts[r], lg_path[r]);
    }
    n += snprintf(spec + n, sizeof spec - (size_t)n, "]");
    int32_t prompt32[BATCH * PROMPT];
    int64_t prompt64[BATCH * PROMPT];
    char pr_path[512], rows_path[512], toks_path[512];
    if (kv_model) {
        make_ids(prompt32, prompt64, BATCH * PROMPT, V, 99);
        snprintf(pr_path, sizeof pr_path, "%s/%s_prompt.bin", tmpdir, tag);
        snprintf(rows_path, sizeof rows_path, "%s/%s_rows.bin", tmpdir, tag);
        snprintf(toks_path, sizeof toks_path, "%s/%s_toks.bin", tmpdir, tag);
        REQUIRE(write_file(pr_path, prompt64, sizeof prompt64));
        n += snprintf(spec + n, sizeof spec - (size_t)n,
                      ", \"decode\": {\"model\": \"%s\", \"ids\": \"%s\", \"shape\": [%d, %d], \"steps\": %d, "
                      "\"out_logits\": \"%s\", \"out_tokens\": \"%s\"}",
                      kv_model, pr_path, BATCH, PROMPT, STEPS, rows_path, toks_path);
    }
    snprintf(spec + n, sizeof spec - (size_t)n, "}");
    snprintf(p, sizeof p, "%s/%s_spec.json", tmpdir, tag);
    REQUIRE(write_file(p, spec, strlen(spec)));
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s'", py, anneal_test_path("tests/io/onnx_run.py"), p);
    int rc = sh(cmd);
    if (rc != 0) TEST_FAIL("%s: onnx_run.py exited %d: %s", tag, rc, err);
    for (int r = 0; r < 2; r++) {
        size_t nl = (size_t)BATCH * (size_t)Ts[r] * (size_t)V;
        float *ort = read_file(lg_path[r], nl * sizeof(float));
        float *ref = anneal_logits(m, i32[r], Ts[r]);
        REQUIRE(ort && ref);
        double e = rel_err(ort, ref, (int64_t)nl);
        printf("  %s: batch %d, T %d: onnxruntime vs anneal logits, max|diff|/max|ref| = %.2e\n", tag, BATCH, Ts[r], e);
        CHECK(e <= 1e-4, "%s: relative error %.3e", tag, e);
        free(ort);
        free(ref);
    }
    if (kv_model) {
        size_t nr = (size_t)(STEPS + 1) * BATCH * (size_t)V;
        float *rows = read_file(rows_path, nr * sizeof(float)), *ref = malloc(nr * sizeof(float));
        int64_t *toks = read_file(toks_path, sizeof(int64_t) * STEPS * BATCH), ref_toks[STEPS * BATCH];
        REQUIRE(rows && toks && ref);
        REQUIRE(anneal_decode(m, prompt32, ref, ref_toks));
        double e = rel_err(rows, ref, (int64_t)nr);
        printf("  %s: KV-cache decode, prompt %d + %d steps: max|diff|/max|ref| = %.2e, tokens %s\n", tag, PROMPT,
               STEPS, e, memcmp(toks, ref_toks, sizeof ref_toks) ? "DIFFER" : "equal");
        CHECK(e <= 1e-4, "%s: relative error %.3e", tag, e);
        CHECK(memcmp(toks, ref_toks, sizeof ref_toks) == 0, "%s: greedy tokens differ", tag);
        free(rows);
        free(ref);
        free(toks);
    }
}

/* Library export of config `which`, with and without the cache, checked by the runtime. */
static void parity(const char *which) {
    const char *py = anneal_test_python("onnx,onnxruntime,numpy");
    if (!py) SKIP_PROMISED("needs the Python clients onnx + onnxruntime (make test sets them up: scripts/pyenv.sh)");
    REQUIRE(setup());
    anneal_model *m = make_model(which, 1234);
    REQUIRE(m);
    char plain[512], kv[512];
    snprintf(plain, sizeof plain, "%s/%s.onnx", tmpdir, which);
    snprintf(kv, sizeof kv, "%s/%s_kv.onnx", tmpdir, which);
    anneal_onnx_save_opts o = {0};
    REQUIRE(anneal_model_save_onnx(m, plain, &o) == ANNEAL_OK);
    o.kv_cache = true;
    REQUIRE(anneal_model_save_onnx(m, kv, &o) == ANNEAL_OK);
    char data[600];
    snprintf(data, sizeof data, "%s.data", plain);
    CHECK_TRUE(!exists(data)); /* small models keep their weights inline */
    check_with_runtime(m, which, plain, kv, py);
    anneal_model_free(m);
}

TEST(gpt2_tiny_matches_onnxruntime) { parity("gpt2"); }
TEST(llama_tiny_matches_onnxruntime) { parity("llama"); }
TEST(qwen2_like_gqa_biases_matches_onnxruntime) { parity("qwen2"); }

/* `anneal export --format onnx` from a Hugging Face directory (f32, and bf16 converted),
 * with --external-data and --onnx-kv-cache. */
TEST(cli_external_data_and_kv_cache) {
    const char *py = anneal_test_python("onnx,onnxruntime,numpy");
    if (!py) SKIP_PROMISED("needs the Python clients onnx + onnxruntime (make test sets them up: scripts/pyenv.sh)");
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("needs ANNEAL_BIN (the CLI; ctest sets it)");
    REQUIRE(setup());
    for (int bf16 = 0; bf16 < 2; bf16++) {
        anneal_model *m = make_model(bf16 ? "qwen2" : "gpt2", 77);
        REQUIRE(m);
        char dir[512], file[512], kvfile[512], data[600], cmd[2048];
        snprintf(dir, sizeof dir, "%s/hf%d", tmpdir, bf16);
        anneal_hf_save_opts ho = {.dtype = bf16 ? ANNEAL_BF16 : ANNEAL_F32};
        REQUIRE(anneal_model_save_hf(m, dir, &ho) == ANNEAL_OK);
        if (bf16) { /* the reference is the model as the bf16 directory holds it */
            anneal_model_free(m);
            m = NULL;
            REQUIRE(anneal_model_load_hf(dir, ANNEAL_CPU, &m) == ANNEAL_OK);
        }
        snprintf(file, sizeof file, "%s/cli%d.onnx", tmpdir, bf16);
        snprintf(kvfile, sizeof kvfile, "%s/cli%d_kv.onnx", tmpdir, bf16);
        snprintf(cmd, sizeof cmd, "'%s' export --model '%s' --format onnx --out '%s' --external-data", bin, dir, file);
        int rc = sh(cmd);
        if (rc != 0) TEST_FAIL("%s: exit %d: %s", cmd, rc, err);
        snprintf(cmd, sizeof cmd, "'%s' export --model '%s' --format onnx --out '%s' --onnx-kv-cache", bin, dir,
                 kvfile);
        rc = sh(cmd);
        if (rc != 0) TEST_FAIL("%s: exit %d: %s", cmd, rc, err);
        snprintf(data, sizeof data, "%s.data", file);
        /* the weights are in the data file, the graph alone in the model file */
        int64_t params = anneal_model_num_params(m);
        printf("  %s: %s %lld bytes, %s.data %lld bytes (%lld parameters)\n", bf16 ? "bf16 dir" : "f32 dir", file,
               (long long)file_size(file), file, (long long)file_size(data), (long long)params);
        CHECK_TRUE(file_size(data) >= params * 4);
        CHECK_TRUE(file_size(file) < params * 4 / 4);
        check_with_runtime(m, bf16 ? "cli_bf16" : "cli_f32", file, kvfile, py);
        anneal_model_free(m);
    }
}

/* The automatic switch to external data: above inline_max_bytes of weights (2 GB by
 * default; lowered here so that a tiny model crosses it), not below. */
TEST(external_data_above_the_limit) {
    REQUIRE(setup());
    anneal_model *m = make_model("llama", 5);
    REQUIRE(m);
    char below[512], above[512], data[600];
    snprintf(below, sizeof below, "%s/below.onnx", tmpdir);
    snprintf(above, sizeof above, "%s/above.onnx", tmpdir);
    int64_t bytes = anneal_model_num_params(m) * 4;
    anneal_onnx_save_opts o = {.inline_max_bytes = (uint64_t)bytes * 2};
    REQUIRE(anneal_model_save_onnx(m, below, &o) == ANNEAL_OK);
    snprintf(data, sizeof data, "%s.data", below);
    CHECK(!exists(data) && file_size(below) > bytes, "below the limit: %lld bytes inline", (long long)file_size(below));
    o.inline_max_bytes = (uint64_t)bytes / 2;
    REQUIRE(anneal_model_save_onnx(m, above, &o) == ANNEAL_OK);
    snprintf(data, sizeof data, "%s.data", above);
    CHECK(file_size(data) >= bytes && file_size(above) < bytes / 4, "above the limit: %lld + %lld bytes",
          (long long)file_size(above), (long long)file_size(data));
    const char *py = anneal_test_python("onnx,onnxruntime,numpy");
    if (py) check_with_runtime(m, "auto_external", above, NULL, py);
    anneal_model_free(m);
    if (!py) SKIP_PROMISED("needs the Python clients onnx + onnxruntime (make test sets them up: scripts/pyenv.sh)");
}

/* `anneal export --ckpt RUN`: a training run's latest checkpoint (llama-tiny after two
 * steps), checked against the checkpoint as anneal loads it. */
TEST(cli_from_a_training_run) {
    const char *py = anneal_test_python("onnx,onnxruntime,numpy");
    if (!py) SKIP_PROMISED("needs the Python clients onnx + onnxruntime (make test sets them up: scripts/pyenv.sh)");
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("needs ANNEAL_BIN (the CLI; ctest sets it)");
    REQUIRE(setup());
    char cmd[2048], file[512], kvfile[512], ckpt[512];
    snprintf(cmd, sizeof cmd, "'%s' train --synthetic --model llama-tiny --steps 2 --seq 16 --batch 2 --out '%s/run'",
             bin, tmpdir);
    int rc = sh(cmd);
    if (rc != 0) TEST_FAIL("%s: exit %d: %s", cmd, rc, err);
    snprintf(file, sizeof file, "%s/run.onnx", tmpdir);
    snprintf(kvfile, sizeof kvfile, "%s/run_kv.onnx", tmpdir);
    snprintf(cmd, sizeof cmd, "'%s' export --ckpt '%s/run' --format onnx --out '%s'", bin, tmpdir, file);
    if ((rc = sh(cmd)) != 0) TEST_FAIL("%s: exit %d: %s", cmd, rc, err);
    snprintf(cmd, sizeof cmd, "'%s' export --ckpt '%s/run' --format onnx --onnx-kv-cache --out '%s'", bin, tmpdir,
             kvfile);
    if ((rc = sh(cmd)) != 0) TEST_FAIL("%s: exit %d: %s", cmd, rc, err);
    snprintf(ckpt, sizeof ckpt, "%s/run/ckpt_00000002", tmpdir);
    anneal_model *m = NULL;
    REQUIRE(anneal_model_load_hf(ckpt, ANNEAL_CPU, &m) == ANNEAL_OK);
    check_with_runtime(m, "run", file, kvfile, py);
    anneal_model_free(m);
}

/* --------------------------------------------------------- bad cases */

/* The builder: a failed call makes every later one return NULL, the first error is
 * kept, and a failed graph is not written. */
TEST(graph_builder_errors_propagate) {
    REQUIRE(setup());
    anneal_onnx_graph *g = anneal_onnx_graph_new("g");
    REQUIRE(g);
    int64_t d[2] = {2, 3};
    anneal_tensor *a = anneal_zeros(ANNEAL_F32, 2, d), *b = anneal_zeros(ANNEAL_F32, 2, d);
    anneal_tensor *ids = anneal_zeros(ANNEAL_I32, 2, d);
    REQUIRE(a && b && ids);
    const char *x = anneal_onnx_input(g, "x", ANNEAL_ONNX_FLOAT, 2, (int64_t[]){-1, 3}, (const char *[]){"n", NULL});
    const char *w = anneal_onnx_weight(g, "w", a, true);
    CHECK_TRUE(x && w && anneal_onnx_weight(g, "w", a, true) == w); /* the same initializer again */
    CHECK_TRUE(anneal_onnx_op2(g, "MatMul", x, w) != NULL);
    CHECK_TRUE(anneal_onnx_op2(g, "Add", x, NULL) == NULL);          /* a NULL input: no node, no error */
    CHECK_TRUE(anneal_onnx_graph_status(g) == ANNEAL_OK);
    CHECK_TRUE(anneal_onnx_weight(g, "ids", ids, false) == NULL);     /* not a float */
    CHECK(anneal_onnx_graph_status(g) == ANNEAL_ERR_DTYPE, "status %d", (int)anneal_onnx_graph_status(g));
    CHECK_TRUE(anneal_onnx_weight(g, "w", b, true) == NULL);          /* a name twice: later errors ... */
    CHECK_TRUE(anneal_onnx_op1(g, "Relu", x) == NULL);                /* ... and calls return NULL */
    CHECK(anneal_onnx_graph_status(g) == ANNEAL_ERR_DTYPE, "the first error is kept: %d",
          (int)anneal_onnx_graph_status(g));
    char p[512];
    snprintf(p, sizeof p, "%s/failed.onnx", tmpdir);
    CHECK_TRUE(anneal_onnx_save(g, p, NULL) != ANNEAL_OK && !exists(p));
    anneal_onnx_graph_free(g);
    /* a duplicate name with other contents is its own error */
    anneal_clear_error();
    g = anneal_onnx_graph_new("g2");
    REQUIRE(g);
    CHECK_TRUE(anneal_onnx_weight(g, "w", a, false) != NULL);
    CHECK_TRUE(anneal_onnx_weight(g, "w", b, false) == NULL);
    CHECK(anneal_onnx_graph_status(g) == ANNEAL_ERR_ARG && strstr(anneal_last_error(), "given twice"),
          "error: %s", anneal_last_error());
    anneal_onnx_graph_free(g);
    anneal_release(a);
    anneal_release(b);
    anneal_release(ids);
    anneal_clear_error();
}

TEST(unwritable_path_is_an_error) {
    REQUIRE(setup());
    anneal_model *m = make_model("gpt2", 1);
    REQUIRE(m);
    char p[512];
    snprintf(p, sizeof p, "%s/no/such/dir/m.onnx", tmpdir);
    anneal_onnx_save_opts o = {.external_data = true};
    CHECK_TRUE(anneal_model_save_onnx(m, p, &o) == ANNEAL_ERR_IO);
    CHECK(strstr(anneal_last_error(), "no/such/dir") != NULL, "error: %s", anneal_last_error());
    anneal_clear_error();
    anneal_model_free(m);
}

TEST(architecture_without_exporter_is_refused) {
    REQUIRE(setup());
    anneal_model *m = make_model("gpt2", 1);
    REQUIRE(m);
    anneal_model_ops ops = *m->ops;
    ops.onnx_graph = NULL; /* as an architecture registered without one */
    const anneal_model_ops *saved = m->ops;
    m->ops = &ops;
    char p[512];
    snprintf(p, sizeof p, "%s/none.onnx", tmpdir);
    CHECK_TRUE(anneal_model_save_onnx(m, p, NULL) == ANNEAL_ERR_UNSUPPORTED);
    CHECK(strstr(anneal_last_error(), "no ONNX exporter") != NULL, "error: %s", anneal_last_error());
    CHECK_TRUE(!exists(p));
    anneal_clear_error();
    m->ops = saved;
    anneal_model_free(m);
}

TEST(lora_adapter_is_refused_and_nothing_written) {
    REQUIRE(setup());
    anneal_model *m = make_model("llama", 1);
    REQUIRE(m);
    const char *targets[1] = {"v_proj"};
    anneal_lora_config lc = {.rank = 2, .alpha = 4, .targets = targets, .n_targets = 1};
    REQUIRE(anneal_lora_apply(m->params, &lc) == ANNEAL_OK);
    char p[512];
    snprintf(p, sizeof p, "%s/lora.onnx", tmpdir);
    CHECK_TRUE(anneal_model_save_onnx(m, p, NULL) == ANNEAL_ERR_UNSUPPORTED);
    CHECK(strstr(anneal_last_error(), "LoRA") != NULL && strstr(anneal_last_error(), "v_proj") != NULL, "error: %s",
          anneal_last_error());
    CHECK_TRUE(!exists(p));
    anneal_clear_error();
    anneal_model_free(m);
}

TEST(cli_refusals) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("needs ANNEAL_BIN (the CLI; ctest sets it)");
    REQUIRE(setup());
    anneal_model *m = make_model("gpt2", 3);
    REQUIRE(m);
    char dir[512], cmd[2048];
    snprintf(dir, sizeof dir, "%s/hf_bad", tmpdir);
    REQUIRE(anneal_model_save_hf(m, dir, NULL) == ANNEAL_OK);
    anneal_model_free(m);
    snprintf(cmd, sizeof cmd, "'%s' export --model '%s' --format tflite --out '%s/x'", bin, dir, tmpdir);
    CHECK_TRUE(sh(cmd) == 2);
    CHECK(strstr(err, "unknown format 'tflite'") != NULL, "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "'%s' export --model '%s' --format hf --onnx-kv-cache --out '%s/y'", bin, dir, tmpdir);
    CHECK_TRUE(sh(cmd) == 2);
    CHECK(strstr(err, "--format onnx") != NULL, "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "'%s' export --model '%s' --format onnx --dtype bf16 --out '%s/z.onnx'", bin, dir,
             tmpdir);
    CHECK_TRUE(sh(cmd) == 2);
    CHECK(strstr(err, "f32 weights") != NULL, "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "'%s' export --model '%s' --format onnx --out '%s/missing/m.onnx'", bin, dir, tmpdir);
    CHECK_TRUE(sh(cmd) == 1);
    CHECK(strstr(err, "missing/m.onnx") != NULL, "stderr: %s", err);
}

/* Removes tmpdir and what is in it (one level). */
static void cleanup(void) {
    if (!tmpdir[0]) return;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
}

int main(void) {
    RUN(unwritable_path_is_an_error);
    RUN(architecture_without_exporter_is_refused);
    RUN(lora_adapter_is_refused_and_nothing_written);
    RUN(cli_refusals);
    RUN(graph_builder_errors_propagate);
    RUN(external_data_above_the_limit);
    RUN(gpt2_tiny_matches_onnxruntime);
    RUN(llama_tiny_matches_onnxruntime);
    RUN(qwen2_like_gqa_biases_matches_onnxruntime);
    RUN(cli_external_data_and_kv_cache);
    RUN(cli_from_a_training_run);
    cleanup();
    return anneal_test_summary();
}
