/* Llama-family parity with Hugging Face transformers, both ways.
 *
 * transformers -> anneal: the random models tests/fixtures/gen_hf_llama.py built and
 * saved with transformers 4.39 (committed in tests/fixtures/hf_llama/: Llama with GQA
 * and linear rope scaling, Llama with MQA, attention biases, a tied head and llama3
 * rope scaling, Qwen2 with q/k/v biases, Mistral with a tied head) load through
 * config.json + hf_import and give transformers' logits, loss and every parameter
 * gradient in f32; bf16 stays close. The same generator run live (when the Python
 * clients of scripts/pyenv.sh exist) gives models that match too.
 *
 * anneal -> transformers: a llama-tiny trained a few steps by `anneal train`, and a
 * qwen2-type MQA tied model made by the library, written as config.json +
 * model.safetensors, load in transformers' AutoModelForCausalLM with no missing or
 * unexpected keys and give anneal's logits. */
#include <unistd.h>

#include "llama_fixture.h"

static const char *const variants[] = {"llama_gqa", "llama_mqa_tied", "qwen2", "mistral"};
enum { N_VARIANTS = 4 };

/* Checks one HF directory's model against its reference in f32. Tolerances: logits
 * 1e-4 of their scale (measured 4e-7 .. 6e-7), loss 1e-5 relative (measured 0: the
 * same f32 value), gradients 1e-4 of each tensor's scale (measured 9e-7 .. 2.2e-6). */
static void check_f32(const char *dir) {
    anneal_model *m = llama_fx_load(dir);
    if (!m) return;
    llama_fx_errors e = llama_fx_compare(m, dir);
    printf("  %s: logits %.2e, loss %.2e, %d gradients, worst %.2e (%s)\n", dir, e.logits, e.loss, e.n_grads, e.grad,
           e.worst_grad ? e.worst_grad : "-");
    CHECK(e.logits <= 1e-4, "%s: logits relative error %.3g", dir, e.logits);
    CHECK(e.loss <= 1e-5, "%s: loss relative error %.3g", dir, e.loss);
    CHECK(e.grad <= 1e-4, "%s: gradient of %s: relative error %.3g", dir, e.worst_grad ? e.worst_grad : "?", e.grad);
    CHECK(e.n_grads == m->params->n, "%s: %d of %d gradients compared", dir, e.n_grads, m->params->n);
    anneal_model_free(m);
}

TEST(fixtures_match_transformers_f32) {
    for (int i = 0; i < N_VARIANTS; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/fixtures/hf_llama/%s", variants[i]);
        check_f32(anneal_test_path(rel));
    }
}

/* Every fixture at a lower matrix-product precision against the f32 reference; the
 * logits must differ from f32's (the precision is in effect) and stay within the
 * tolerances (relative to each tensor's scale). */
static void check_low_precision(anneal_dtype dt, double tol_logits, double tol_loss, double tol_grad) {
    for (int i = 0; i < N_VARIANTS; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/fixtures/hf_llama/%s", variants[i]);
        const char *dir = anneal_test_path(rel);
        anneal_model *m = llama_fx_load(dir);
        if (!m) continue;
        REQUIRE(anneal_model_set_compute(m, dt) == ANNEAL_OK);
        llama_fx_errors e = llama_fx_compare(m, dir);
        printf("  %s %s: logits %.2e, loss %.2e, gradients worst %.2e (%s)\n", anneal_dtype_name(dt), variants[i],
               e.logits, e.loss, e.grad, e.worst_grad ? e.worst_grad : "-");
        CHECK(e.logits <= tol_logits && e.logits > 0, "%s: %s logits relative error %.3g", dir, anneal_dtype_name(dt),
              e.logits);
        CHECK(e.loss <= tol_loss, "%s: %s loss relative error %.3g", dir, anneal_dtype_name(dt), e.loss);
        CHECK(e.grad <= tol_grad, "%s: %s gradient of %s: relative error %.3g", dir, anneal_dtype_name(dt),
              e.worst_grad ? e.worst_grad : "?", e.grad);
        anneal_model_free(m);
    }
}

/* bf16, measured over the four variants: logits 6.9e-3 .. 2.1e-2 of their scale, loss
 * 8.6e-6 .. 6.2e-4 relative, the worst gradient 1.2e-2 .. 5.5e-2 of its tensor's
 * scale; tolerances ~10x the worst. */
TEST(fixtures_bf16_close_to_f32) { check_low_precision(ANNEAL_BF16, 2e-1, 6e-3, 5e-1); }

/* f16, measured: logits 1.0e-3 .. 1.4e-3, loss 7e-7 .. 1.7e-5, the worst gradient
 * 2.1e-3 .. 6.9e-3; tolerances ~10x the worst. */
TEST(fixtures_f16_close_to_f32) { check_low_precision(ANNEAL_F16, 1.5e-2, 2e-4, 7e-2); }

/* ------------------------------------------------------------------ live */

static char g_tmp[64];

/* Runs a shell command; true when it exits 0. */
static bool sh(const char *cmd) {
    int rc = system(cmd);
    if (rc != 0) anneal_test_fail(__FILE__, __LINE__, "command failed (%d): %s", rc, cmd);
    return rc == 0;
}

TEST(generator_run_live_matches) {
    const char *py = anneal_test_python("torch,transformers,safetensors");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    char out[128], cmd[2048];
    snprintf(out, sizeof out, "%s/live", g_tmp);
    snprintf(cmd, sizeof cmd, "%s %s %s > %s/gen.log 2>&1", py, anneal_test_path("tests/fixtures/gen_hf_llama.py"), out,
             g_tmp);
    if (!sh(cmd)) return;
    for (int i = 0; i < N_VARIANTS; i++) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/%s", out, variants[i]);
        check_f32(dir);
    }
}

/* ---------------------------------------------------- anneal -> transformers */

/* The Python side: loads dir with AutoModelForCausalLM (no missing/unexpected keys,
 * else exit 3), runs ids (from dir/ids.txt: B lines of T ids) in f32 and writes the
 * logits to dir/hf_logits.bin (raw little-endian f32). */
static const char *const load_py =
    "import sys, numpy as np, torch\n"
    "from transformers import AutoModelForCausalLM\n"
    "d = sys.argv[1]\n"
    "torch.set_num_threads(1)\n"
    "m, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True, attn_implementation='eager')\n"
    "bad = {k: v for k, v in info.items() if v}\n"
    "if bad:\n"
    "    print('loading info:', bad); sys.exit(3)\n"
    "m.eval()\n"
    "ids = torch.tensor(np.loadtxt(d + '/ids.txt', dtype=np.int64, ndmin=2))\n"
    "with torch.no_grad():\n"
    "    out = m(input_ids=ids).logits.float().numpy()\n"
    "out.astype('<f4').tofile(d + '/hf_logits.bin')\n"
    "print(type(m).__name__, tuple(out.shape))\n";

/* Writes m's config.json + model.safetensors into dir, has transformers load them and
 * compares its logits for fixed ids with m's (relative to their scale: 1e-4). */
static void check_transformers_reads(anneal_model *m, const char *dir, const char *py) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    if (!sh(cmd)) return;
    char *json = anneal_model_config_to_hf_json(&m->cfg);
    REQUIRE(json);
    FILE *f = fopen(llama_fx_join(dir, "config.json"), "w");
    REQUIRE(f);
    fputs(json, f);
    fclose(f);
    free(json);
    REQUIRE(anneal_model_save_safetensors(m, llama_fx_join(dir, "model.safetensors")) == ANNEAL_OK);
    enum { B = 2, T = 9 };
    int32_t idv[B * T];
    f = fopen(llama_fx_join(dir, "ids.txt"), "w");
    REQUIRE(f);
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            idv[b * T + t] = (int32_t)((b * 37 + t * 11 + 5) % m->cfg.vocab_size);
            fprintf(f, "%d%c", idv[b * T + t], t + 1 < T ? ' ' : '\n');
        }
    }
    fclose(f);
    f = fopen(llama_fx_join(dir, "load.py"), "w");
    REQUIRE(f);
    fputs(load_py, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s %s/load.py %s > %s/load.log 2>&1 || (cat %s/load.log; false)", py, dir, dir, dir, dir);
    if (!sh(cmd)) return;
    int64_t V = m->cfg.vocab_size, n = B * T * V;
    float *hf = malloc((size_t)n * sizeof *hf);
    f = fopen(llama_fx_join(dir, "hf_logits.bin"), "rb");
    bool ok = hf && f && fread(hf, sizeof *hf, (size_t)n, f) == (size_t)n;
    if (f) fclose(f);
    CHECK(ok, "%s: hf_logits.bin has not %lld floats", dir, (long long)n);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *ids = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, idv);
    anneal_no_grad_begin();
    anneal_tensor *got = anneal_contiguous(anneal_model_logits(m, ids));
    anneal_no_grad_end();
    CHECK(got && anneal_numel(got) == n, "logits: %s", anneal_last_error());
    if (ok && got) {
        double e = llama_fx_rel_err(anneal_data(got), hf, n);
        printf("  %s: transformers' logits vs anneal's: %.2e of their scale\n", dir, e);
        CHECK(e <= 1e-4, "%s: transformers' logits differ from anneal's by %.3g of their scale", dir, e);
    }
    anneal_scope_close(sc);
    free(hf);
}

TEST(trained_llama_loads_in_transformers) {
    const char *py = anneal_test_python("torch,transformers,numpy");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP("ANNEAL_BIN is not set (run through ctest)");
    char cmd[2048], ck[256];
    snprintf(cmd, sizeof cmd,
             "%s train --model llama-tiny --synthetic --steps 6 --batch 2 --seq 32 --lr 3e-3 --threads 2 --out %s/run "
             "> %s/train.log 2>&1 || (cat %s/train.log; false)",
             bin, g_tmp, g_tmp, g_tmp);
    if (!sh(cmd)) return;
    snprintf(ck, sizeof ck, "%s/run/ckpt_00000006", g_tmp);
    anneal_model *m = llama_fx_load(ck); /* the checkpoint's own config.json + model.safetensors */
    if (!m) return;
    CHECK_TRUE(!m->cfg.tie_embeddings && !strcmp(m->cfg.arch, "llama") && m->cfg.n_kv_head == 2);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/export_llama", g_tmp);
    check_transformers_reads(m, dir, py);
    anneal_model_free(m);
}

TEST(qwen2_mqa_tied_loads_in_transformers) {
    const char *py = anneal_test_python("torch,transformers,numpy");
    if (!py) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-tiny", &c));
    snprintf(c.hf_model_type, sizeof c.hf_model_type, "qwen2");
    c.n_kv_head = 1, c.qkv_bias = true, c.tie_embeddings = true, c.vocab_size = 97, c.rope_theta = 1e6f;
    c.rope.theta = c.rope_theta;
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(m);
    REQUIRE(anneal_model_init(m, 5) == ANNEAL_OK);
    /* non-zero biases and norm weights, so a misplaced tensor shows */
    anneal_manual_seed(9);
    for (int i = 0; i < m->params->n; i++) {
        anneal_param *p = &m->params->items[i];
        if (strstr(p->name, ".bias")) CHECK_TRUE(anneal_init_normal_(p->tensor, 0.0f, 0.1f) == ANNEAL_OK);
        if (strstr(p->name, "norm.weight")) CHECK_TRUE(anneal_init_normal_(p->tensor, 1.0f, 0.2f) == ANNEAL_OK);
    }
    char dir[256];
    snprintf(dir, sizeof dir, "%s/export_qwen2", g_tmp);
    check_transformers_reads(m, dir, py);
    anneal_model_free(m);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/anneal_llama_hf_XXXXXX");
    if (!mkdtemp(g_tmp)) return 1;
    RUN(fixtures_match_transformers_f32);
    RUN(fixtures_bf16_close_to_f32);
    RUN(fixtures_f16_close_to_f32);
    RUN(generator_run_live_matches);
    RUN(trained_llama_loads_in_transformers);
    RUN(qwen2_mqa_tied_loads_in_transformers);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_tmp);
    return anneal_test_summary();
}
