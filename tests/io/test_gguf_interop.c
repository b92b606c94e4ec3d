/* GGUF files anneal writes, read by the real clients (tests/fixtures/gguf_clients.py in
 * the .venv of scripts/pyenv.sh):
 *   - gguf-py 0.10's GGUFReader finds every metadata key llama.cpp's converter writes for
 *     gpt2 and llama, with its type and value, and every tensor with anneal's name, type,
 *     shape and offset;
 *   - the stored Q8_0, F16 and BF16 bytes equal gguf.quants.quantize of the same floats
 *     (llama.cpp's reference quantizers, bit for bit);
 *   - llama-cpp-python 0.3.36 loads a random GPT-2 with the real GPT-2 tokenizer
 *     (../shared/data/gpt2) and a llama-tiny (GQA 4/2, a tokenizer trained here), in f32
 *     and q8_0, and a llama-tiny with a SentencePiece-style tokenizer (Llama 2's shape,
 *     tests/fixtures/hf_tokenizers/llama2_sp, written as tokenizer.ggml.model "llama") and
 *     one with Llama 3's byte-level tokenizer (llama3_bl with ignore_merges, pre "llama-bpe"):
 *     its tokenization of the prompt equals anneal's, and its greedy
 *     continuation equals anneal's `generate` on the model read back from the same file. */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <sys/stat.h>
#include <unistd.h>

#include "anneal/anneal.h"
#include "test.h"
#include "gguf_test_util.h"

static char g_dir[64];
static const char *g_py;

static const char *tmp_path(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

/* Runs the client script with args; its stdout (malloc'd) or NULL on failure. */
static char *client(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s %s > %s/py.out 2> %s/py.err", g_py,
             anneal_test_path("tests/fixtures/gguf_clients.py"), args, g_dir, g_dir);
    int rc = system(cmd);
    if (rc != 0) {
        snprintf(cmd, sizeof cmd, "tail -5 %s/py.err >&2", g_dir);
        if (system(cmd)) {}
        return NULL;
    }
    FILE *f = fopen(tmp_path("py.out"), "rb");
    if (!f) return NULL;
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strdup(buf);
}

static bool need_python(void) {
    g_py = anneal_test_python("gguf,llama_cpp,numpy");
    return g_py != NULL;
}

static anneal_model *model_of(anneal_model_config *c, uint64_t seed) {
    anneal_model *m = anneal_model_new(c, ANNEAL_CPU);
    if (m && anneal_model_init(m, seed) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    return m;
}

/* Scales the parameters whose name holds one of the parts (f32 on the CPU): random
 * weights at init scale give near-uniform attention, which would not notice keys or
 * queries in the wrong order; scaled, the attention is peaked and the test sees it. */
static void scale_params(anneal_model *m, const char *const *parts, float by) {
    for (int i = 0; i < m->params->n; i++) {
        bool hit = false;
        for (int k = 0; parts[k]; k++) hit |= strstr(m->params->items[i].name, parts[k]) != NULL;
        if (!hit) continue;
        float *d = anneal_data(m->params->items[i].tensor);
        for (int64_t j = 0; j < anneal_numel(m->params->items[i].tensor); j++) d[j] *= by;
    }
}

/* A small byte-level tokenizer trained here (no ../shared needed). */
static anneal_tokenizer *trained_tokenizer(int32_t vocab) {
    const char *txt = tmp_path("corpus.txt");
    FILE *f = fopen(txt, "w");
    if (!f) return NULL;
    static const char *words[] = {"the", "model", "anneal", "writes", "files", "that", "llama", "reads", " and ", "then"};
    uint64_t s = 1;
    for (int i = 0; i < 4000; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        fprintf(f, "%s%s", words[(s >> 33) % 10], (s >> 20) % 7 ? " " : ".\n");
    }
    fclose(f);
    const char *files[] = {txt};
    anneal_tokenizer *tok = NULL;
    if (anneal_bpe_train(files, 1, vocab, tmp_path("tok")) != ANNEAL_OK ||
        anneal_tokenizer_load(tmp_path("tok"), &tok) != ANNEAL_OK)
        return NULL;
    return tok;
}

/* ------------------------------------------------------------ gguf-py */

/* Every tensor anneal's reader sees, as GGUFReader sees it; and the keys. */
static void check_read(const char *path, const char *const *keys) {
    char args[600];
    snprintf(args, sizeof args, "read '%s'", path);
    char *out = client(args);
    REQUIRE(out);
    cJSON *j = cJSON_Parse(out);
    free(out);
    REQUIRE(j);
    anneal_gguf *g = NULL;
    REQUIRE(anneal_gguf_open(path, &g) == ANNEAL_OK);
    CHECK(cJSON_GetObjectItem(j, "alignment")->valueint == (int)g->alignment, "alignment");
    const cJSON *kv = cJSON_GetObjectItem(j, "kv"), *ts = cJSON_GetObjectItem(j, "tensors");
    for (int i = 0; keys[i]; i++) CHECK(cJSON_GetObjectItem(kv, keys[i]), "%s: gguf-py finds no %s", path, keys[i]);
    CHECK(cJSON_GetArraySize(ts) == g->n_tensors, "%s: %d tensors, anneal %lld", path, cJSON_GetArraySize(ts),
          (long long)g->n_tensors);
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const anneal_gguf_tensor *t = &g->tensors[i];
        const cJSON *e = cJSON_GetArrayItem(ts, (int)i);
        char ty[16];
        snprintf(ty, sizeof ty, "%s", anneal_ggml_type_name(t->type));
        for (char *p = ty; *p; p++) *p = (char)toupper((unsigned char)*p);
        const cJSON *shape = cJSON_GetArrayItem(e, 2);
        bool same = e && !strcmp(cJSON_GetArrayItem(e, 0)->valuestring, t->cname) &&
                    !strcmp(cJSON_GetArrayItem(e, 1)->valuestring, ty) && cJSON_GetArraySize(shape) == t->n_dims &&
                    (uint64_t)cJSON_GetArrayItem(e, 3)->valuedouble == g->data_offset + t->offset;
        for (int d = 0; same && d < t->n_dims; d++) same = cJSON_GetArrayItem(shape, d)->valuedouble == (double)t->ne[d];
        CHECK(same, "%s: tensor %lld (%s %s) is not what gguf-py reads", path, (long long)i, t->cname, ty);
    }
    /* a few values */
    int64_t v;
    if (anneal_gguf_get_int(g, "general.file_type", &v))
        CHECK(cJSON_GetArrayItem(cJSON_GetObjectItem(kv, "general.file_type"), 1)->valueint == (int)v, "file_type");
    anneal_gguf_close(g);
    cJSON_Delete(j);
}

TEST(gguf_py_reads_anneal_files) {
    if (!need_python()) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    anneal_tokenizer *tok = trained_tokenizer(400);
    REQUIRE(tok);
    static const char *const gpt2_keys[] = {
        "general.architecture", "general.name", "general.file_type", "general.quantization_version",
        "gpt2.context_length", "gpt2.embedding_length", "gpt2.block_count", "gpt2.feed_forward_length",
        "gpt2.attention.head_count", "gpt2.attention.layer_norm_epsilon", "tokenizer.ggml.model", "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", NULL};
    static const char *const llama_keys[] = {
        "general.architecture", "llama.vocab_size", "llama.context_length", "llama.embedding_length",
        "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
        "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.rope.dimension_count",
        "tokenizer.ggml.tokens", "tokenizer.ggml.merges", NULL};
    const char *presets[] = {"tiny", "llama-tiny"};
    for (int k = 0; k < 2; k++) {
        anneal_model_config c;
        REQUIRE(anneal_model_preset(presets[k], &c));
        anneal_model *m = model_of(&c, 3);
        REQUIRE(m);
        REQUIRE(anneal_model_save_gguf(m, tmp_path("r.gguf"),
                                       &(anneal_gguf_save_opts){.type = ANNEAL_GGML_Q8_0, .tokenizer = tok}) == ANNEAL_OK);
        check_read(tmp_path("r.gguf"), k ? llama_keys : gpt2_keys);
        anneal_model_free(m);
    }
    anneal_tokenizer_free(tok);
}

TEST(stored_bytes_equal_gguf_quants) {
    if (!need_python()) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    static const struct {
        anneal_ggml_type t;
        const char *name;
    } types[] = {{ANNEAL_GGML_Q8_0, "Q8_0"}, {ANNEAL_GGML_F16, "F16"}, {ANNEAL_GGML_BF16, "BF16"}};
    for (int k = 0; k < 3; k++) {
        int64_t shape[2] = {6, 96};
        float *x = anneal_test_rand_buf(6 * 96, -3, 3);
        for (int j = 0; j < 32; j++) x[j] = 0;                  /* an all-zero block */
        for (int j = 32; j < 64; j++) x[j] = (float)(j - 48) / 2; /* exact halves: rounding away from zero */
        x[100] = 1e-8f;
        anneal_gguf_writer *w = anneal_gguf_writer_new(0);
        REQUIRE(w && anneal_gguf_put_tensor(w, "x", 2, shape, types[k].t, x) == ANNEAL_OK);
        REQUIRE(anneal_gguf_writer_save(w, tmp_path("q.gguf")) == ANNEAL_OK);
        anneal_gguf_writer_free(w);
        FILE *f = fopen(tmp_path("x.f32"), "wb");
        REQUIRE(f);
        fwrite(x, sizeof *x, 6 * 96, f);
        fclose(f);
        free(x);
        char args[700];
        snprintf(args, sizeof args, "quant '%s' '%s' %s", tmp_path("q.gguf"), tmp_path("x.f32"), types[k].name);
        char *out = client(args);
        CHECK(out && !strncmp(out, "equal", 5), "%s: anneal's bytes differ from gguf.quants' (%s)", types[k].name,
              out ? out : "no output");
        free(out);
    }
}

/* ------------------------------------------------------------ llama.cpp */

typedef struct collect {
    int32_t ids[64];
    int n;
} collect;

static bool on_token(int32_t id, void *user) {
    collect *c = user;
    if (c->n < 64) c->ids[c->n++] = id;
    return true;
}

/* Exports m (with tok) as type, reads it back in anneal and compares prompt ids and the
 * greedy continuation with llama.cpp's on the same file. */
static void check_llama_cpp(anneal_model *m, anneal_tokenizer *tok, anneal_ggml_type type, const char *text, int n_new) {
    const char *path = tmp_path("l.gguf");
    REQUIRE(anneal_model_save_gguf(m, path, &(anneal_gguf_save_opts){.type = type, .tokenizer = tok}) == ANNEAL_OK);
    anneal_model *b = NULL;
    anneal_tokenizer *bt = NULL;
    REQUIRE(anneal_model_load_gguf(path, ANNEAL_CPU, &b, &bt) == ANNEAL_OK && bt);
    anneal_ids prompt = {0};
    REQUIRE(anneal_tokenizer_encode(bt, text, strlen(text), false, &prompt) == ANNEAL_OK);
    collect c = {0};
    anneal_sampler_config sc = {.temperature = 0, .top_k = 0, .top_p = 1, .seed = 1};
    REQUIRE(anneal_model_generate(b, prompt.ids, (int64_t)prompt.n, n_new, &sc, -1, on_token, &c) == ANNEAL_OK);
    char args[1200];
    snprintf(args, sizeof args, "llama '%s' %d '%s'", path, n_new, text);
    char *out = client(args);
    CHECK(out, "llama-cpp-python could not load %s (%s, %s)", path, m->cfg.arch, anneal_ggml_type_name(type));
    cJSON *j = out ? cJSON_Parse(out) : NULL;
    free(out);
    const cJSON *lp = cJSON_GetObjectItem(j, "prompt"), *lg = cJSON_GetObjectItem(j, "gen");
    bool same_prompt = lp && cJSON_GetArraySize(lp) == (int)prompt.n;
    for (int i = 0; same_prompt && i < (int)prompt.n; i++) same_prompt = cJSON_GetArrayItem(lp, i)->valueint == prompt.ids[i];
    CHECK(same_prompt, "%s %s: llama.cpp tokenizes the prompt differently", m->cfg.arch, anneal_ggml_type_name(type));
    bool same_gen = lg && cJSON_GetArraySize(lg) == c.n;
    for (int i = 0; same_gen && i < c.n; i++) same_gen = cJSON_GetArrayItem(lg, i)->valueint == c.ids[i];
    if (!same_gen) {
        fprintf(stderr, "anneal:   ");
        for (int i = 0; i < c.n; i++) fprintf(stderr, " %d", c.ids[i]);
        fprintf(stderr, "\nllama.cpp:");
        for (int i = 0; lg && i < cJSON_GetArraySize(lg); i++) fprintf(stderr, " %d", cJSON_GetArrayItem(lg, i)->valueint);
        fprintf(stderr, "\n");
    }
    CHECK(same_gen, "%s %s: llama.cpp's greedy continuation differs from anneal's", m->cfg.arch,
          anneal_ggml_type_name(type));
    cJSON_Delete(j);
    anneal_ids_free(&prompt);
    anneal_tokenizer_free(bt);
    anneal_model_free(b);
}

TEST(llama_cpp_gpt2_real_tokenizer) {
    if (!need_python()) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    anneal_tokenizer *tok = NULL;
    if (anneal_tokenizer_load("gpt2", &tok) != ANNEAL_OK)
        SKIP_PROMISED("needs GPT-2's tokenizer files (../shared/data/gpt2): %s", anneal_last_error());
    anneal_model_config c;
    REQUIRE(anneal_model_preset("tiny", &c));
    c.vocab_size = 50257;
    c.n_ctx = 128;
    anneal_model *m = model_of(&c, 42);
    REQUIRE(m);
    scale_params(m, (const char *const[]){"c_attn.weight", "wte", NULL}, 12.0f);
    check_llama_cpp(m, tok, ANNEAL_GGML_F32, "The quick brown fox jumps over the lazy dog, and", 16);
    check_llama_cpp(m, tok, ANNEAL_GGML_Q8_0, "The quick brown fox jumps over the lazy dog, and", 16);
    anneal_model_free(m);
    anneal_tokenizer_free(tok);
}

TEST(llama_cpp_llama_tiny) {
    if (!need_python()) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    anneal_tokenizer *tok = trained_tokenizer(400);
    REQUIRE(tok);
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-tiny", &c));
    anneal_model *m = model_of(&c, 42);
    REQUIRE(m);
    scale_params(m, (const char *const[]){"q_proj", "k_proj", "embed_tokens", "lm_head", NULL}, 12.0f);
    check_llama_cpp(m, tok, ANNEAL_GGML_F32, "then the model writes files that", 16);
    check_llama_cpp(m, tok, ANNEAL_GGML_Q8_0, "then the model writes files that", 16);
    anneal_model_free(m);
    anneal_tokenizer_free(tok);
}


TEST(llama_cpp_llama_sentencepiece) {
    if (!need_python()) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    anneal_tokenizer *tok = NULL;
    REQUIRE(anneal_tokenizer_load(anneal_test_path("tests/fixtures/hf_tokenizers/llama2_sp"), &tok) == ANNEAL_OK);
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-tiny", &c));
    c.vocab_size = anneal_tokenizer_vocab_size(tok);
    anneal_model *m = model_of(&c, 7);
    REQUIRE(m);
    scale_params(m, (const char *const[]){"q_proj", "k_proj", "embed_tokens", "lm_head", NULL}, 12.0f);
    check_llama_cpp(m, tok, ANNEAL_GGML_F32, "In the beginning God created the heaven and the earth.", 16);
    check_llama_cpp(m, tok, ANNEAL_GGML_Q8_0, "And the earth was without form, and void", 16);
    anneal_model_free(m);
    anneal_tokenizer_free(tok);
}


TEST(llama_cpp_llama3_tokenizer) {
    if (!need_python()) SKIP_PROMISED("needs the Python clients (make test sets them up: scripts/pyenv.sh)");
    anneal_tokenizer *tok = NULL;
    REQUIRE(anneal_test_llama3_tokenizer(g_dir, &tok) == ANNEAL_OK);
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-tiny", &c));
    c.vocab_size = anneal_tokenizer_vocab_size(tok);
    anneal_model *m = model_of(&c, 9);
    REQUIRE(m);
    scale_params(m, (const char *const[]){"q_proj", "k_proj", "embed_tokens", "lm_head", NULL}, 12.0f);
    check_llama_cpp(m, tok, ANNEAL_GGML_F32, "Hello, world!  It is 2024 and 12345 things.", 16);
    check_llama_cpp(m, tok, ANNEAL_GGML_Q8_0, "In the beginning God created the heaven", 16);
    anneal_model_free(m);
    anneal_tokenizer_free(tok);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/anneal_gguf_interop_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    RUN(gguf_py_reads_anneal_files);
    RUN(stored_bytes_equal_gguf_quants);
    RUN(llama_cpp_gpt2_real_tokenizer);
    RUN(llama_cpp_llama_tiny);
    RUN(llama_cpp_llama_sentencepiece);
    RUN(llama_cpp_llama3_tokenizer);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd)) {}
    return anneal_test_summary();
}
