/* GGUF without Python (src/io/gguf_read.c, gguf_write.c, gguf_model.c): metadata and
 * tensors written and read back (every value type anneal writes, f32 exact, f16/bf16
 * rounded as the core conversions, Q8_0 against a reference quantizer written here
 * from llama.cpp's quantize_row_q8_0_ref); models exported and imported (GPT-2 and
 * Llama with GQA: f32 parameters and logits bit-identical, q8_0 parameters equal to the
 * dequantized weights in the file's layout); the tokenizer through tokenizer.ggml.*;
 * the CLI (export --format gguf, generate --model FILE.gguf); and bad input: every
 * truncation of a valid file, bad magic, versions, absurd counts and lengths, unknown
 * value and tensor types, misaligned and out-of-file offsets, overlapping tensors,
 * overflowing shapes, an unknown architecture, missing keys and tensors. */
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

#include "anneal/anneal.h"
#include "test.h"
#include "gguf_test_util.h"

static char g_dir[64];

static const char *tmp_path(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

static uint8_t *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)len + 1);
    if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = (size_t)len;
    return b;
}

/* ------------------------------------------------------------ raw builder */

typedef struct raw {
    uint8_t b[4096];
    size_t n;
} raw;

static void r_bytes(raw *r, const void *p, size_t n) {
    memcpy(r->b + r->n, p, n);
    r->n += n;
}
static void r_u32(raw *r, uint32_t v) { r_bytes(r, &v, 4); }
static void r_u64(raw *r, uint64_t v) { r_bytes(r, &v, 8); }
static void r_str(raw *r, const char *s) {
    r_u64(r, strlen(s));
    r_bytes(r, s, strlen(s));
}
static void r_header(raw *r, uint32_t version, uint64_t nt, uint64_t nkv) {
    r->n = 0;
    r_bytes(r, "GGUF", 4);
    r_u32(r, version);
    r_u64(r, nt);
    r_u64(r, nkv);
}
static void r_tensor(raw *r, const char *name, uint32_t nd, const uint64_t *ne, uint32_t type, uint64_t off) {
    r_str(r, name);
    r_u32(r, nd);
    for (uint32_t d = 0; d < nd; d++) r_u64(r, ne[d]);
    r_u32(r, type);
    r_u64(r, off);
}
static void r_pad(raw *r, size_t align) {
    while (r->n % align) r->b[r->n++] = 0;
}

/* Opens r from memory: the status (and the error text in *msg). */
static anneal_status r_open(const raw *r, const char **msg) {
    anneal_clear_error();
    anneal_gguf *g = NULL;
    anneal_status s = anneal_gguf_open_memory(r->b, r->n, "bad.gguf", &g);
    *msg = anneal_last_error();
    anneal_gguf_close(g);
    return s;
}

#define CHECK_BAD(r, status, text)                                                                                   \
    do {                                                                                                           \
        const char *_m;                                                                                            \
        anneal_status _s = r_open(r, &_m);                                                                         \
        CHECK(_s == (status), "status %d, wanted %d (%s)", (int)_s, (int)(status), _m ? _m : "");                   \
        CHECK(_m && strstr(_m, text), "error \"%s\" does not say \"%s\"", _m ? _m : "(none)", text);               \
    } while (0)

/* ------------------------------------------------------------ reference Q8_0 */

/* llama.cpp's quantize_row_q8_0_ref and dequantize_row_q8_0, for one block of 32. */
static void ref_q8_0(const float *x, float *y) {
    float amax = 0;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
    float dh = anneal_f16_to_f32(anneal_f32_to_f16(d));
    for (int j = 0; j < 32; j++) y[j] = dh * (float)(int8_t)roundf(x[j] * id);
}

/* ------------------------------------------------------------ tests */

TEST(metadata_and_tensors_round_trip) {
    for (int pass = 0; pass < 2; pass++) {
        uint32_t align = pass ? 64 : 0;
        anneal_gguf_writer *w = anneal_gguf_writer_new(align);
        REQUIRE(w);
        const char *strs[] = {"a", "", "h\xC3\xA9llo"};
        size_t lens[] = {1, 0, 6};
        int32_t ints[] = {-3, 7, 1 << 30};
        float fl[] = {0.5f, -2.25f};
        REQUIRE(anneal_gguf_put_u32(w, "k.u32", 4000000000u) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_i32(w, "k.i32", -17) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_f32(w, "k.f32", 1e-5f) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_bool(w, "k.bool", true) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_str(w, "k.str", "gpt2", 4) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_str_array(w, "k.strs", 3, strs, lens) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_i32_array(w, "k.ints", 3, ints) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_f32_array(w, "k.floats", 2, fl) == ANNEAL_OK);
        CHECK(anneal_gguf_put_u32(w, "k.u32", 1) == ANNEAL_ERR_ARG, "a repeated key is refused");
        float *a = anneal_test_rand_buf(15, -3, 3), *b = anneal_test_rand_buf(8, -3, 3), *c = anneal_test_rand_buf(4, -3, 3),
              *q = anneal_test_rand_buf(128, -2, 2);
        q[5] = 0; /* one block all zero: d = 0 */
        for (int j = 32; j < 64; j++) q[j] = 0;
        REQUIRE(anneal_gguf_put_tensor(w, "a", 2, (int64_t[]){3, 5}, ANNEAL_GGML_F32, a) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_tensor(w, "b", 2, (int64_t[]){2, 4}, ANNEAL_GGML_F16, b) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_tensor(w, "c", 1, (int64_t[]){4}, ANNEAL_GGML_BF16, c) == ANNEAL_OK);
        REQUIRE(anneal_gguf_put_tensor(w, "q", 2, (int64_t[]){2, 64}, ANNEAL_GGML_Q8_0, q) == ANNEAL_OK);
        CHECK(anneal_gguf_put_tensor(w, "q2", 2, (int64_t[]){2, 33}, ANNEAL_GGML_Q8_0, q) == ANNEAL_ERR_ARG,
              "q8_0 rows must be whole blocks");
        REQUIRE(anneal_gguf_writer_save(w, tmp_path("m.gguf")) == ANNEAL_OK);
        anneal_gguf_writer_free(w);

        anneal_gguf *g = NULL;
        REQUIRE(anneal_gguf_open(tmp_path("m.gguf"), &g) == ANNEAL_OK);
        CHECK(g->version == 3, "version %u", g->version);
        CHECK(g->alignment == (pass ? 64u : 32u), "alignment %u", g->alignment);
        int64_t iv;
        double dv;
        bool bv;
        anneal_gguf_str sv;
        CHECK(anneal_gguf_get_int(g, "k.u32", &iv) && iv == 4000000000LL, "u32");
        CHECK(anneal_gguf_get_int(g, "k.i32", &iv) && iv == -17, "i32");
        CHECK(anneal_gguf_get_float(g, "k.f32", &dv) && (float)dv == 1e-5f, "f32");
        CHECK(anneal_gguf_get_bool(g, "k.bool", &bv) && bv, "bool");
        CHECK(anneal_gguf_get_str(g, "k.str", &sv) && sv.n == 4 && !memcmp(sv.s, "gpt2", 4), "str");
        CHECK(!anneal_gguf_get_int(g, "k.str", &iv) && !anneal_gguf_get_str(g, "k.nope", &sv), "type and absence");
        const anneal_gguf_kv *kv = anneal_gguf_find_kv(g, "k.strs");
        REQUIRE(kv && kv->type == ANNEAL_GGUF_ARRAY && kv->arr_type == ANNEAL_GGUF_STRING && kv->arr_n == 3);
        for (int i = 0; i < 3; i++) {
            anneal_gguf_str s = anneal_gguf_array_str(kv, (uint64_t)i);
            CHECK(s.n == lens[i] && !memcmp(s.s, strs[i], lens[i]), "string %d", i);
        }
        kv = anneal_gguf_find_kv(g, "k.ints");
        REQUIRE(kv && kv->arr_type == ANNEAL_GGUF_INT32 && kv->arr_n == 3);
        CHECK(!memcmp(kv->val, ints, sizeof ints), "int array");
        kv = anneal_gguf_find_kv(g, "k.floats");
        REQUIRE(kv && kv->arr_type == ANNEAL_GGUF_FLOAT32 && kv->arr_n == 2);
        CHECK(!memcmp(kv->val, fl, sizeof fl), "float array");
        REQUIRE(g->n_tensors == 4);
        for (int i = 0; i < 4; i++) {
            CHECK(g->tensors[i].offset % g->alignment == 0, "tensor %d offset %llu", i,
                  (unsigned long long)g->tensors[i].offset);
            CHECK((g->data_offset + g->tensors[i].offset) % g->alignment == 0, "tensor %d absolute offset", i);
        }
        const anneal_gguf_tensor *ta = anneal_gguf_find_tensor(g, "a"), *tb = anneal_gguf_find_tensor(g, "b"),
                                 *tc = anneal_gguf_find_tensor(g, "c"), *tq = anneal_gguf_find_tensor(g, "q");
        REQUIRE(ta && tb && tc && tq);
        CHECK(ta->n_dims == 2 && ta->ne[0] == 5 && ta->ne[1] == 3 && ta->type == ANNEAL_GGML_F32, "a's shape is ne order");
        CHECK(tq->type == ANNEAL_GGML_Q8_0 && tq->nbytes == 4 * 34, "q8_0 blocks: %llu bytes",
              (unsigned long long)tq->nbytes);
        float out[128], ref[128];
        REQUIRE(anneal_gguf_tensor_to_f32(ta, out) == ANNEAL_OK);
        CHECK(!memcmp(out, a, 15 * sizeof *out), "f32 is exact");
        REQUIRE(anneal_gguf_tensor_to_f32(tb, out) == ANNEAL_OK);
        for (int i = 0; i < 8; i++) CHECK(out[i] == anneal_f16_to_f32(anneal_f32_to_f16(b[i])), "f16 %d", i);
        REQUIRE(anneal_gguf_tensor_to_f32(tc, out) == ANNEAL_OK);
        for (int i = 0; i < 4; i++) CHECK(out[i] == anneal_bf16_to_f32(anneal_f32_to_bf16(c[i])), "bf16 %d", i);
        REQUIRE(anneal_gguf_tensor_to_f32(tq, out) == ANNEAL_OK);
        for (int blk = 0; blk < 4; blk++) ref_q8_0(q + 32 * blk, ref + 32 * blk);
        for (int i = 0; i < 128; i++) CHECK(out[i] == ref[i], "q8_0 %d: %g vs reference %g", i, out[i], ref[i]);
        for (int i = 32; i < 64; i++) CHECK(out[i] == 0.0f, "zero block");
        anneal_gguf_close(g);
        free(a), free(b), free(c), free(q);
    }
}

TEST(every_truncation_is_an_error) {
    anneal_gguf_writer *w = anneal_gguf_writer_new(0);
    REQUIRE(w);
    float x[64] = {1, 2, 3};
    const char *s[] = {"x", "yy"};
    REQUIRE(anneal_gguf_put_str(w, "general.architecture", "gpt2", 4) == ANNEAL_OK);
    REQUIRE(anneal_gguf_put_str_array(w, "t", 2, s, (size_t[]){1, 2}) == ANNEAL_OK);
    REQUIRE(anneal_gguf_put_tensor(w, "w", 2, (int64_t[]){2, 32}, ANNEAL_GGML_Q8_0, x) == ANNEAL_OK);
    REQUIRE(anneal_gguf_put_tensor(w, "v", 1, (int64_t[]){3}, ANNEAL_GGML_F32, x) == ANNEAL_OK);
    REQUIRE(anneal_gguf_writer_save(w, tmp_path("t.gguf")) == ANNEAL_OK);
    anneal_gguf_writer_free(w);
    size_t n;
    uint8_t *b = read_all(tmp_path("t.gguf"), &n);
    REQUIRE(b);
    anneal_gguf *g = NULL;
    REQUIRE(anneal_gguf_open_memory(b, n, "t", &g) == ANNEAL_OK);
    uint64_t end = 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        uint64_t e = g->data_offset + g->tensors[i].offset + g->tensors[i].nbytes;
        end = e > end ? e : end;
    }
    anneal_gguf_close(g);
    int bad = 0;
    for (size_t cut = 0; cut < end; cut++) {
        anneal_clear_error();
        anneal_status st = anneal_gguf_open_memory(b, cut, "t", &g);
        if (st == ANNEAL_OK) {
            anneal_gguf_close(g);
            bad++;
            CHECK(false, "a file cut at %zu of %llu bytes opened", cut, (unsigned long long)end);
        }
        if (bad > 3) break;
    }
    anneal_clear_error();
    CHECK(anneal_gguf_open_memory(b, (size_t)end - 1, "t", &g) == ANNEAL_ERR_FORMAT &&
              strstr(anneal_last_error(), "past the end"),
          "cut in the data: %s", anneal_last_error());
    free(b);
}

TEST(bad_headers) {
    raw r;
    const char *m;
    r_header(&r, 3, 0, 0);
    memcpy(r.b, "GGUG", 4);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "not a GGUF file");
    r_header(&r, 1, 0, 0);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "version 1");
    r_header(&r, 4, 0, 0);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "version 4");
    r_header(&r, 2, 0, 0);
    CHECK(r_open(&r, &m) == ANNEAL_OK, "version 2 with nothing in it opens: %s", m);
    r_header(&r, 3, 1ULL << 60, 0);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "tensors cannot fit");
    r_header(&r, 3, 0, 1ULL << 60);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "metadata entries cannot fit");
    /* a key whose length runs past the end */
    r_header(&r, 3, 0, 1);
    r_u64(&r, 1ULL << 62);
    r_bytes(&r, "abcdefghijklmnopqrstuvwxyz", 26);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "truncated");
    /* unknown value type */
    r_header(&r, 3, 0, 1);
    r_str(&r, "k");
    r_u32(&r, 13);
    r_u64(&r, 0);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "unknown value type 13");
    /* an array of arrays */
    r_header(&r, 3, 0, 1);
    r_str(&r, "k");
    r_u32(&r, ANNEAL_GGUF_ARRAY);
    r_u32(&r, ANNEAL_GGUF_ARRAY);
    r_u64(&r, 1);
    r_u64(&r, 0);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "array of unsupported type 9");
    /* an array of strings whose count cannot fit */
    r_header(&r, 3, 0, 1);
    r_str(&r, "k");
    r_u32(&r, ANNEAL_GGUF_ARRAY);
    r_u32(&r, ANNEAL_GGUF_STRING);
    r_u64(&r, 1ULL << 40);
    r_u64(&r, 0);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "strings cannot fit");
    /* an array of int32 whose bytes overflow */
    r_header(&r, 3, 0, 1);
    r_str(&r, "k");
    r_u32(&r, ANNEAL_GGUF_ARRAY);
    r_u32(&r, ANNEAL_GGUF_INT32);
    r_u64(&r, 1ULL << 63);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "overflow");
    /* a duplicate key */
    r_header(&r, 3, 0, 2);
    for (int i = 0; i < 2; i++) {
        r_str(&r, "dup");
        r_u32(&r, ANNEAL_GGUF_UINT8);
        r_bytes(&r, "\1", 1);
    }
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "appears twice");
    /* alignment not a power of two, and of the wrong type */
    r_header(&r, 3, 0, 1);
    r_str(&r, "general.alignment");
    r_u32(&r, ANNEAL_GGUF_UINT32);
    r_u32(&r, 48);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "not a power of two");
    r_header(&r, 3, 0, 1);
    r_str(&r, "general.alignment");
    r_u32(&r, ANNEAL_GGUF_UINT64);
    r_u64(&r, 32);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "not a uint32");
}

/* One tensor "w" (ne, type, offset) and data_bytes of zeros after the padding. */
static void one_tensor(raw *r, uint32_t nd, const uint64_t *ne, uint32_t type, uint64_t off, size_t data_bytes) {
    r_header(r, 3, 1, 0);
    r_tensor(r, "w", nd, ne, type, off);
    r_pad(r, 32);
    memset(r->b + r->n, 0, data_bytes);
    r->n += data_bytes;
}

TEST(bad_tensors) {
    raw r;
    const char *m;
    one_tensor(&r, 1, (uint64_t[]){4}, ANNEAL_GGML_F32, 0, 16);
    CHECK(r_open(&r, &m) == ANNEAL_OK, "the base case opens: %s", m);
    one_tensor(&r, 0, NULL, ANNEAL_GGML_F32, 0, 16);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "0 dimensions");
    one_tensor(&r, 5, (uint64_t[]){1, 1, 1, 1, 1}, ANNEAL_GGML_F32, 0, 16);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "5 dimensions");
    one_tensor(&r, 1, (uint64_t[]){4}, 2 /* Q4_0 */, 0, 16);
    CHECK_BAD(&r, ANNEAL_ERR_UNSUPPORTED, "ggml type 2");
    one_tensor(&r, 1, (uint64_t[]){4}, 1000, 0, 16);
    CHECK_BAD(&r, ANNEAL_ERR_UNSUPPORTED, "ggml type 1000");
    one_tensor(&r, 1, (uint64_t[]){33}, ANNEAL_GGML_Q8_0, 0, 64);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "whole blocks");
    one_tensor(&r, 2, (uint64_t[]){1ULL << 62, 1ULL << 62}, ANNEAL_GGML_F32, 0, 16);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "overflows");
    one_tensor(&r, 1, (uint64_t[]){1ULL << 63}, ANNEAL_GGML_F32, 0, 16);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "dimension 0");
    one_tensor(&r, 1, (uint64_t[]){4}, ANNEAL_GGML_F32, 4, 32);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "not a multiple of the alignment");
    one_tensor(&r, 1, (uint64_t[]){4}, ANNEAL_GGML_F32, 1ULL << 40, 16);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "past the end");
    one_tensor(&r, 1, (uint64_t[]){8}, ANNEAL_GGML_F32, 0, 16);
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "past the end");
    /* two tensors: a duplicate name, then an overlap */
    for (int k = 0; k < 2; k++) {
        r_header(&r, 3, 2, 0);
        r_tensor(&r, "w", 1, (uint64_t[]){8}, ANNEAL_GGML_F32, 0);
        r_tensor(&r, k ? "v" : "w", 1, (uint64_t[]){8}, ANNEAL_GGML_F32, 0);
        r_pad(&r, 32);
        memset(r.b + r.n, 0, 64);
        r.n += 64;
        CHECK_BAD(&r, ANNEAL_ERR_FORMAT, k ? "overlap" : "appears twice");
    }
    /* a NUL inside a name */
    r_header(&r, 3, 1, 0);
    r_u64(&r, 3);
    r_bytes(&r, "a\0b", 3);
    r_u32(&r, 1);
    r_u64(&r, 4);
    r_u32(&r, 0);
    r_u64(&r, 0);
    r_pad(&r, 32);
    memset(r.b + r.n, 0, 16);
    r.n += 16;
    CHECK_BAD(&r, ANNEAL_ERR_FORMAT, "NUL");
}

/* ------------------------------------------------------------ models */

static anneal_model *new_model(const char *preset, void (*edit)(anneal_model_config *), uint64_t seed) {
    anneal_model_config cfg;
    if (!anneal_model_preset(preset, &cfg)) return NULL;
    if (edit) edit(&cfg);
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (m && anneal_model_init(m, seed) != ANNEAL_OK) {
        anneal_model_free(m);
        return NULL;
    }
    return m;
}

static float *logits_of(anneal_model *m, int64_t *n) {
    anneal_scope *s = anneal_scope_open();
    int32_t ids[2 * 9];
    for (int i = 0; i < 18; i++) ids[i] = (int32_t)((i * 37 + 5) % m->cfg.vocab_size);
    anneal_tensor *l = anneal_model_logits(m, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){2, 9}, ids));
    *n = l ? anneal_numel(l) : 0;
    float *h = l ? malloc((size_t)*n * sizeof *h) : NULL;
    if (h && anneal_to_f32_buffer(l, h) != ANNEAL_OK) {
        free(h);
        h = NULL;
    }
    anneal_scope_close(s);
    return h;
}

static float *param_f32(const anneal_model *m, const char *name, int64_t *n) {
    anneal_param *p = anneal_params_find(m->params, name);
    if (!p) return NULL;
    *n = anneal_numel(p->tensor);
    float *h = malloc((size_t)*n * sizeof *h);
    if (h) anneal_to_f32_buffer(p->tensor, h);
    return h;
}

static void llama_untied_biased(anneal_model_config *c) {
    c->tie_embeddings = false;
    c->out_bias = false;
}

static void llama_tied(anneal_model_config *c) { c->tie_embeddings = true; }

/* f32 export + import: every parameter and the logits bit-identical. */
static void check_f32_round_trip(const char *preset, void (*edit)(anneal_model_config *)) {
    anneal_model *m = new_model(preset, edit, 11);
    REQUIRE(m);
    const char *p = tmp_path("rt.gguf");
    REQUIRE(anneal_model_save_gguf(m, p, &(anneal_gguf_save_opts){.type = ANNEAL_GGML_F32}) == ANNEAL_OK);
    anneal_model *b = NULL;
    REQUIRE(anneal_model_load_gguf(p, ANNEAL_CPU, &b, NULL) == ANNEAL_OK);
    CHECK(!strcmp(b->cfg.arch, m->cfg.arch) && b->cfg.n_layer == m->cfg.n_layer && b->cfg.n_head == m->cfg.n_head &&
              b->cfg.n_embd == m->cfg.n_embd && b->cfg.vocab_size == m->cfg.vocab_size && b->cfg.n_ctx == m->cfg.n_ctx &&
              b->cfg.tie_embeddings == m->cfg.tie_embeddings && b->cfg.norm_eps == m->cfg.norm_eps,
          "%s: the config comes back", preset);
    CHECK(b->params->n == m->params->n, "%s: %d parameters, wanted %d", preset, b->params->n, m->params->n);
    for (int i = 0; i < m->params->n; i++) {
        int64_t n1 = 0, n2 = 0;
        float *x = param_f32(m, m->params->items[i].name, &n1), *y = param_f32(b, m->params->items[i].name, &n2);
        CHECK(x && y && n1 == n2 && !memcmp(x, y, (size_t)n1 * sizeof *x), "%s: parameter %s differs", preset,
              m->params->items[i].name);
        free(x), free(y);
    }
    int64_t n1 = 0, n2 = 0;
    float *l1 = logits_of(m, &n1), *l2 = logits_of(b, &n2);
    CHECK(l1 && l2 && n1 == n2 && !memcmp(l1, l2, (size_t)n1 * sizeof *l1), "%s: logits are not bit-identical", preset);
    free(l1), free(l2);
    anneal_model_free(m);
    anneal_model_free(b);
}

TEST(models_f32_round_trip) {
    check_f32_round_trip("tiny", NULL);
    check_f32_round_trip("llama-tiny", NULL);
    check_f32_round_trip("llama-tiny", llama_tied);
    check_f32_round_trip("llama-tiny", llama_untied_biased);
}

/* The q8_0 expectation of an HF tensor: quantized in the GGUF layout (transposed for
 * GPT-2's Conv1D weights; Q/K row permutation moves whole rows, so blocks are those of
 * the HF rows), f16 for rows that are not whole blocks, f32 for 1-D and wpe. */
static void expected_q8(const char *name, const float *x, int ndim, const int64_t *shape, bool transposed, float *y) {
    int64_t n = ndim == 2 ? shape[0] * shape[1] : shape[0];
    if (ndim == 1 || strstr(name, "wpe")) {
        memcpy(y, x, (size_t)n * sizeof *y);
        return;
    }
    int64_t rows = transposed ? shape[1] : shape[0], cols = transposed ? shape[0] : shape[1];
    float *g = malloc((size_t)n * sizeof *g), *q = malloc((size_t)n * sizeof *q);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) g[r * cols + c] = transposed ? x[c * rows + r] : x[r * cols + c];
    if (cols % 32)
        for (int64_t i = 0; i < n; i++) q[i] = anneal_f16_to_f32(anneal_f32_to_f16(g[i]));
    else
        for (int64_t b = 0; b < n / 32; b++) ref_q8_0(g + 32 * b, q + 32 * b);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            if (transposed) y[c * rows + r] = q[r * cols + c];
            else y[r * cols + c] = q[r * cols + c];
        }
    free(g), free(q);
}

static void check_q8_round_trip(const char *preset) {
    anneal_model *m = new_model(preset, NULL, 5);
    REQUIRE(m);
    const char *p = tmp_path("q8.gguf");
    REQUIRE(anneal_model_save_gguf(m, p, &(anneal_gguf_save_opts){.type = ANNEAL_GGML_Q8_0}) == ANNEAL_OK);
    anneal_model *b = NULL;
    REQUIRE(anneal_model_load_gguf(p, ANNEAL_CPU, &b, NULL) == ANNEAL_OK);
    int changed = 0;
    for (int i = 0; i < m->params->n; i++) {
        const char *name = m->params->items[i].name;
        const anneal_tensor *t = m->params->items[i].tensor;
        bool tr = !strcmp(preset, "tiny") && t->ndim == 2 &&
                  (strstr(name, "c_attn") || strstr(name, "c_proj") || strstr(name, "c_fc"));
        int64_t n1 = 0, n2 = 0;
        float *x = param_f32(m, name, &n1), *y = param_f32(b, name, &n2), *want = malloc((size_t)n1 * sizeof *want);
        expected_q8(name, x, t->ndim, t->shape, tr, want);
        CHECK(n1 == n2 && !memcmp(y, want, (size_t)n1 * sizeof *y), "%s: %s is not the dequantized q8_0", preset, name);
        changed += memcmp(x, y, (size_t)n1 * sizeof *x) != 0;
        free(x), free(y), free(want);
    }
    CHECK(changed > 0, "%s: q8_0 changed no weight", preset);
    anneal_model_free(m);
    anneal_model_free(b);
}

TEST(models_q8_0_are_the_dequantized_weights) {
    check_q8_round_trip("tiny");
    check_q8_round_trip("llama-tiny");
}

TEST(f16_and_bf16_files_load) {
    anneal_model *m = new_model("llama-tiny", NULL, 3);
    REQUIRE(m);
    for (int k = 0; k < 2; k++) {
        anneal_ggml_type ty = k ? ANNEAL_GGML_BF16 : ANNEAL_GGML_F16;
        REQUIRE(anneal_model_save_gguf(m, tmp_path("h.gguf"), &(anneal_gguf_save_opts){.type = ty}) == ANNEAL_OK);
        anneal_model *b = NULL;
        REQUIRE(anneal_model_load_gguf(tmp_path("h.gguf"), ANNEAL_CPU, &b, NULL) == ANNEAL_OK);
        int64_t n = 0;
        float *x = param_f32(m, "model.layers.0.self_attn.k_proj.weight", &n),
              *y = param_f32(b, "model.layers.0.self_attn.k_proj.weight", &n);
        for (int64_t i = 0; i < n; i++) {
            float want = k ? anneal_bf16_to_f32(anneal_f32_to_bf16(x[i])) : anneal_f16_to_f32(anneal_f32_to_f16(x[i]));
            if (y[i] != want) {
                CHECK(false, "%s: k_proj[%lld] %g, wanted %g", k ? "bf16" : "f16", (long long)i, y[i], want);
                break;
            }
        }
        free(x), free(y);
        float *nx = param_f32(m, "model.norm.weight", &n), *ny = param_f32(b, "model.norm.weight", &n);
        CHECK(!memcmp(nx, ny, (size_t)n * sizeof *nx), "1-D tensors stay f32");
        free(nx), free(ny);
        anneal_model_free(b);
    }
    anneal_model_free(m);
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

TEST(tokenizer_round_trip) {
    anneal_tokenizer *tok = trained_tokenizer(400);
    REQUIRE(tok);
    anneal_model *m = new_model("tiny", NULL, 1);
    REQUIRE(m);
    REQUIRE(anneal_tokenizer_vocab_size(tok) <= m->cfg.vocab_size);
    const char *p = tmp_path("tok.gguf");
    REQUIRE(anneal_model_save_gguf(m, p, &(anneal_gguf_save_opts){.type = ANNEAL_GGML_F32, .tokenizer = tok}) ==
            ANNEAL_OK);
    anneal_gguf *g = NULL;
    REQUIRE(anneal_gguf_open(p, &g) == ANNEAL_OK);
    const anneal_gguf_kv *kv = anneal_gguf_find_kv(g, "tokenizer.ggml.tokens");
    CHECK(kv && kv->arr_n == (uint64_t)m->cfg.vocab_size, "tokens padded to the model's vocabulary");
    anneal_gguf_str last = anneal_gguf_array_str(kv, kv->arr_n - 1);
    CHECK(last.n == 8 && !memcmp(last.s, "[PAD511]", 8), "the last token is [PAD511]");
    anneal_gguf_close(g);
    anneal_model *b = NULL;
    anneal_tokenizer *t2 = NULL;
    REQUIRE(anneal_model_load_gguf(p, ANNEAL_CPU, &b, &t2) == ANNEAL_OK);
    REQUIRE(t2);
    CHECK(anneal_tokenizer_vocab_size(t2) == anneal_tokenizer_vocab_size(tok), "vocab %d vs %d",
          anneal_tokenizer_vocab_size(t2), anneal_tokenizer_vocab_size(tok));
    CHECK(anneal_tokenizer_fingerprint(t2) == anneal_tokenizer_fingerprint(tok), "fingerprints differ");
    CHECK(anneal_tokenizer_eot(t2) == anneal_tokenizer_eot(tok) && anneal_tokenizer_bos(t2) == anneal_tokenizer_bos(tok),
          "bos/eos");
    const char *text = "then the model writes files that llama reads.<|endoftext|> and";
    anneal_ids a = {0}, c = {0};
    REQUIRE(anneal_tokenizer_encode(tok, text, strlen(text), true, &a) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_encode(t2, text, strlen(text), true, &c) == ANNEAL_OK);
    CHECK(a.n == c.n && !memcmp(a.ids, c.ids, a.n * sizeof *a.ids), "ids differ");
    anneal_ids_free(&a), anneal_ids_free(&c);
    anneal_tokenizer *t3 = NULL;
    REQUIRE(anneal_gguf_load_tokenizer(p, &t3) == ANNEAL_OK && t3);
    CHECK(anneal_tokenizer_fingerprint(t3) == anneal_tokenizer_fingerprint(tok), "tokenizer alone");
    anneal_tokenizer_free(t3);
    anneal_tokenizer_free(t2);
    anneal_tokenizer_free(tok);
    anneal_model_free(m);
    anneal_model_free(b);
}


/* SentencePiece-style (Llama 2's shape) as tokenizer.ggml.model "llama": the same ids,
 * text, BOS and fingerprint back; and the vocabularies anneal does not read, by name. */
TEST(sentencepiece_tokenizer_round_trip) {
    anneal_tokenizer *tok = NULL;
    REQUIRE(anneal_tokenizer_load(anneal_test_path("tests/fixtures/hf_tokenizers/llama2_sp"), &tok) == ANNEAL_OK);
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-tiny", &c));
    c.vocab_size = anneal_tokenizer_vocab_size(tok) + 3; /* padded with [PAD<i>] */
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(m);
    const char *p = tmp_path("sp.gguf");
    REQUIRE(anneal_model_save_gguf(m, p, &(anneal_gguf_save_opts){.tokenizer = tok}) == ANNEAL_OK);
    anneal_gguf *g = NULL;
    REQUIRE(anneal_gguf_open(p, &g) == ANNEAL_OK);
    anneal_gguf_str s;
    CHECK(anneal_gguf_get_str(g, "tokenizer.ggml.model", &s) && s.n == 5 && !memcmp(s.s, "llama", 5), "model llama");
    const anneal_gguf_kv *sc = anneal_gguf_find_kv(g, "tokenizer.ggml.scores");
    CHECK(sc && sc->arr_type == ANNEAL_GGUF_FLOAT32 && sc->arr_n == (uint64_t)c.vocab_size, "scores for every token");
    int64_t unk;
    CHECK(anneal_gguf_get_int(g, "tokenizer.ggml.unknown_token_id", &unk) && unk == 0, "<unk> is id 0");
    anneal_gguf_close(g);
    anneal_tokenizer *t2 = NULL;
    REQUIRE(anneal_gguf_load_tokenizer(p, &t2) == ANNEAL_OK && t2);
    /* GGUF has no place for added tokens' single_word / lstrip / rstrip / normalized flags
     * (this fixture's <mask>, Amen, Jehovah and " selah" have them), so the fingerprint,
     * which covers them, differs; vocabulary, merges and every other setting come back */
    CHECK(anneal_tokenizer_vocab_size(t2) == anneal_tokenizer_vocab_size(tok), "vocabulary size");
    for (int32_t id = 0; id < anneal_tokenizer_vocab_size(tok); id++) {
        size_t l1, l2;
        const char *b1 = anneal_tokenizer_token_bytes(tok, id, &l1), *b2 = anneal_tokenizer_token_bytes(t2, id, &l2);
        if (l1 != l2 || memcmp(b1, b2, l1)) {
            CHECK(false, "token %d differs", (int)id);
            break;
        }
    }
    CHECK(anneal_tokenizer_bos(t2) == anneal_tokenizer_bos(tok) && anneal_tokenizer_adds_bos(t2) &&
              anneal_tokenizer_eot(t2) == anneal_tokenizer_eot(tok),
          "bos/eos");
    const char *texts[] = {"In the beginning God created the heaven and the earth.", "  two  spaces\nand a newline",
                           "caf\xC3\xA9 \xE2\x9C\x93 </s> <s>x<|im_start|>user\n"};
    for (int k = 0; k < 3; k++) {
        anneal_ids a = {0}, b = {0};
        REQUIRE(anneal_tokenizer_encode(tok, texts[k], strlen(texts[k]), true, &a) == ANNEAL_OK);
        REQUIRE(anneal_tokenizer_encode(t2, texts[k], strlen(texts[k]), true, &b) == ANNEAL_OK);
        CHECK(a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof *a.ids), "text %d: ids differ", k);
        char *d1 = NULL, *d2 = NULL;
        size_t l1, l2;
        REQUIRE(anneal_tokenizer_decode(tok, a.ids, a.n, &d1, &l1) == ANNEAL_OK);
        REQUIRE(anneal_tokenizer_decode(t2, b.ids, b.n, &d2, &l2) == ANNEAL_OK);
        CHECK(l1 == l2 && !memcmp(d1, d2, l1), "text %d: decoding differs", k);
        free(d1), free(d2);
        anneal_ids_free(&a), anneal_ids_free(&b);
    }
    anneal_tokenizer_free(t2);
    /* a "llama" vocabulary with scores only (no merges), and an unknown model */
    anneal_tokenizer_gguf v;
    REQUIRE(anneal_tokenizer_to_gguf(tok, &v) == ANNEAL_OK);
    v.n_merges = 0;
    anneal_clear_error();
    CHECK(anneal_tokenizer_from_gguf(&v, "x.gguf", &t2) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "merges"),
          "scores only: %s", anneal_last_error());
    v.model = "bert";
    anneal_clear_error();
    CHECK(anneal_tokenizer_from_gguf(&v, "x.gguf", &t2) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "bert"),
          "bert: %s", anneal_last_error());
    v.model = "gpt2";
    v.pre = "qwen2";
    anneal_clear_error();
    CHECK(anneal_tokenizer_from_gguf(&v, "x.gguf", &t2) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "qwen2"),
          "pre qwen2: %s", anneal_last_error());
    anneal_tokenizer_gguf_free(&v);
    anneal_tokenizer_free(tok);
    /* Llama 3's regex without ignore_merges (llama.cpp's llama-bpe ignores merges) and
     * Qwen2's are refused on export, by name */
    REQUIRE(anneal_tokenizer_load(anneal_test_path("tests/fixtures/hf_tokenizers/llama3_bl"), &tok) == ANNEAL_OK);
    anneal_clear_error();
    CHECK(anneal_tokenizer_to_gguf(tok, &v) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "llama-bpe") &&
              strstr(anneal_last_error(), "ignore_merges"),
          "llama3 without ignore_merges: %s", anneal_last_error());
    anneal_tokenizer_free(tok);
    REQUIRE(anneal_tokenizer_load(anneal_test_path("tests/fixtures/hf_tokenizers/qwen2_bl"), &tok) == ANNEAL_OK);
    anneal_clear_error();
    CHECK(anneal_tokenizer_to_gguf(tok, &v) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "Qwen2"),
          "qwen2: %s", anneal_last_error());
    anneal_tokenizer_free(tok);
    anneal_model_free(m);
}

/* Llama 3's tokenizer (the fixture with ignore_merges true, as Llama 3's own file has it)
 * as pre "llama-bpe": fingerprint, ids and BOS back. */
TEST(llama3_tokenizer_round_trip) {
    anneal_tokenizer *tok = NULL, *t2 = NULL;
    REQUIRE(anneal_test_llama3_tokenizer(g_dir, &tok) == ANNEAL_OK);
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-tiny", &c));
    c.vocab_size = anneal_tokenizer_vocab_size(tok);
    anneal_model *m = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(m);
    const char *p = tmp_path("l3.gguf");
    REQUIRE(anneal_model_save_gguf(m, p, &(anneal_gguf_save_opts){.tokenizer = tok}) == ANNEAL_OK);
    anneal_gguf *g = NULL;
    REQUIRE(anneal_gguf_open(p, &g) == ANNEAL_OK);
    anneal_gguf_str s;
    CHECK(anneal_gguf_get_str(g, "tokenizer.ggml.pre", &s) && s.n == 9 && !memcmp(s.s, "llama-bpe", 9), "pre llama-bpe");
    anneal_gguf_close(g);
    REQUIRE(anneal_gguf_load_tokenizer(p, &t2) == ANNEAL_OK && t2);
    /* the fixture's <mask>, Amen, Jehovah and " selah" carry flags GGUF cannot hold (see
     * sentencepiece_tokenizer_round_trip), so the tokens are compared, not the fingerprint */
    CHECK(anneal_tokenizer_vocab_size(t2) == anneal_tokenizer_vocab_size(tok), "vocabulary size");
    for (int32_t id = 0; id < anneal_tokenizer_vocab_size(tok); id++) {
        size_t l1, l2;
        const char *b1 = anneal_tokenizer_token_bytes(tok, id, &l1), *b2 = anneal_tokenizer_token_bytes(t2, id, &l2);
        if (l1 != l2 || memcmp(b1, b2, l1)) {
            CHECK(false, "token %d differs", (int)id);
            break;
        }
    }
    CHECK(anneal_tokenizer_bos(t2) == anneal_tokenizer_bos(tok) &&
              anneal_tokenizer_adds_bos(t2) == anneal_tokenizer_adds_bos(tok),
          "bos");
    const char *text = "Hello, world!  It's 2024\n\n  and 12345 <|begin_of_text|>caf\xC3\xA9 Jehovah";
    anneal_ids a = {0}, b = {0};
    REQUIRE(anneal_tokenizer_encode(tok, text, strlen(text), true, &a) == ANNEAL_OK);
    REQUIRE(anneal_tokenizer_encode(t2, text, strlen(text), true, &b) == ANNEAL_OK);
    CHECK(a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof *a.ids), "ids differ");
    anneal_ids_free(&a), anneal_ids_free(&b);
    anneal_tokenizer_free(t2);
    anneal_tokenizer_free(tok);
    anneal_model_free(m);
}

/* Rewrites a file with metadata key `key` renamed to `to` (same length). */
static void rename_key(const char *src, const char *dst, const char *key, const char *to) {
    size_t n;
    uint8_t *b = read_all(src, &n);
    for (size_t i = 0; b && i + strlen(key) <= n; i++)
        if (!memcmp(b + i, key, strlen(key))) {
            memcpy(b + i, to, strlen(to));
            break;
        }
    FILE *f = fopen(dst, "wb");
    if (f && b) fwrite(b, 1, n, f);
    if (f) fclose(f);
    free(b);
}

TEST(bad_models) {
    anneal_model *m = new_model("tiny", NULL, 2);
    REQUIRE(m);
    const char *p = tmp_path("good.gguf"), *bad = tmp_path("bad.gguf");
    REQUIRE(anneal_model_save_gguf(m, p, &(anneal_gguf_save_opts){.type = ANNEAL_GGML_F32}) == ANNEAL_OK);
    anneal_model *b = NULL;
    /* an architecture anneal does not have */
    size_t n;
    uint8_t *raw = read_all(p, &n);
    REQUIRE(raw);
    uint8_t *at = memmem(raw, n, "gpt2\x0e", 5); /* "gpt2" of general.architecture, then the next key's length */
    if (!at) at = memmem(raw, n, "gpt2", 4);
    REQUIRE(at);
    memcpy(at, "mamb", 4);
    FILE *f = fopen(bad, "wb");
    REQUIRE(f);
    fwrite(raw, 1, n, f);
    fclose(f);
    free(raw);
    anneal_clear_error();
    CHECK(anneal_model_load_gguf(bad, ANNEAL_CPU, &b, NULL) == ANNEAL_ERR_UNSUPPORTED && !b &&
              strstr(anneal_last_error(), "\"mamb\"") && strstr(anneal_last_error(), "gpt2, llama"),
          "unknown architecture: %s", anneal_last_error());
    /* a missing hyperparameter */
    rename_key(p, bad, "gpt2.block_count", "gpt2.block_cnt_");
    anneal_clear_error();
    CHECK(anneal_model_load_gguf(bad, ANNEAL_CPU, &b, NULL) == ANNEAL_ERR_FORMAT &&
              strstr(anneal_last_error(), "gpt2.block_count is missing"),
          "missing key: %s", anneal_last_error());
    /* a missing tensor (renamed: then also an unknown one) */
    rename_key(p, bad, "blk.1.ffn_up.weight", "blk.1.ffn_xx.weight");
    anneal_clear_error();
    CHECK(anneal_model_load_gguf(bad, ANNEAL_CPU, &b, NULL) != ANNEAL_OK && !b &&
              strstr(anneal_last_error(), "blk.1.ffn_xx.weight"),
          "renamed tensor: %s", anneal_last_error());
    /* an output.weight that is not the embedding (GPT-2 ties them) */
    anneal_gguf_writer *w = anneal_gguf_writer_new(0);
    anneal_gguf *g = NULL;
    REQUIRE(w && anneal_gguf_open(p, &g) == ANNEAL_OK);
    for (int64_t i = 0; i < g->n_kv; i++) {
        const anneal_gguf_kv *kv = &g->kv[i];
        char key[128];
        snprintf(key, sizeof key, "%.*s", (int)kv->key.n, kv->key.s);
        if (kv->type == ANNEAL_GGUF_STRING) anneal_gguf_put_str(w, key, kv->str.s, kv->str.n);
        else if (kv->type == ANNEAL_GGUF_UINT32) {
            uint32_t u;
            memcpy(&u, kv->val, 4); /* values in the file are not aligned */
            anneal_gguf_put_u32(w, key, u);
        } else if (kv->type == ANNEAL_GGUF_FLOAT32) {
            float f;
            memcpy(&f, kv->val, 4);
            anneal_gguf_put_f32(w, key, f);
        }
    }
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const anneal_gguf_tensor *t = &g->tensors[i];
        int64_t shape[4], nel = 1;
        for (int d = 0; d < t->n_dims; d++) shape[d] = t->ne[t->n_dims - 1 - d], nel *= t->ne[d];
        float *x = malloc((size_t)nel * sizeof *x);
        anneal_gguf_tensor_to_f32(t, x);
        if (!strcmp(t->cname, "output.weight")) x[3] += 1.0f;
        anneal_gguf_put_tensor(w, t->cname, t->n_dims, shape, ANNEAL_GGML_F32, x);
        free(x);
    }
    anneal_gguf_close(g);
    REQUIRE(anneal_gguf_writer_save(w, bad) == ANNEAL_OK);
    anneal_gguf_writer_free(w);
    anneal_clear_error();
    CHECK(anneal_model_load_gguf(bad, ANNEAL_CPU, &b, NULL) != ANNEAL_OK && !b && strstr(anneal_last_error(), "lm_head.weight differs"),
          "untied output: %s", anneal_last_error());
    anneal_model_free(m);
    /* qwen2 and llama3 rope scaling are refused on export */
    anneal_model_config c;
    REQUIRE(anneal_model_preset("llama-tiny", &c));
    snprintf(c.hf_model_type, sizeof c.hf_model_type, "qwen2");
    c.qkv_bias = true;
    m = anneal_model_new(&c, ANNEAL_CPU);
    REQUIRE(m);
    anneal_clear_error();
    CHECK(anneal_model_save_gguf(m, bad, NULL) == ANNEAL_ERR_UNSUPPORTED && strstr(anneal_last_error(), "qwen2"),
          "qwen2: %s", anneal_last_error());
    anneal_model_free(m);
    anneal_clear_error();
    CHECK(anneal_model_load_gguf(tmp_path("none.gguf"), ANNEAL_CPU, &b, NULL) == ANNEAL_ERR_IO, "a missing file");
}


/* Files llama.cpp's own writer made (gguf-py's GGUFWriter: tests/fixtures/gen_gguf_corpus.py,
 * committed as the fuzz seeds): every value type read, a GPT-2 with its tokenizer loaded. */
TEST(reads_files_gguf_py_wrote) {
    anneal_gguf *g = NULL;
    REQUIRE(anneal_gguf_open(anneal_test_path("tests/fuzz/corpus/gguf/all_types.gguf"), &g) == ANNEAL_OK);
    int64_t v;
    double d;
    bool b;
    anneal_gguf_str s;
    CHECK(anneal_gguf_get_int(g, "u8", &v) && v == 7, "u8");
    CHECK(anneal_gguf_get_int(g, "i8", &v) && v == -7, "i8");
    CHECK(anneal_gguf_get_int(g, "u16", &v) && v == 700, "u16");
    CHECK(anneal_gguf_get_int(g, "i16", &v) && v == -700, "i16");
    CHECK(anneal_gguf_get_int(g, "u32", &v) && v == 70000, "u32");
    CHECK(anneal_gguf_get_int(g, "i32", &v) && v == -70000, "i32");
    CHECK(anneal_gguf_get_int(g, "u64", &v) && v == (1LL << 40), "u64");
    CHECK(anneal_gguf_get_int(g, "i64", &v) && v == -(1LL << 40), "i64");
    CHECK(anneal_gguf_get_float(g, "f32", &d) && d == 0.5, "f32");
    CHECK(anneal_gguf_get_float(g, "f64", &d) && d == 0.25, "f64");
    CHECK(anneal_gguf_get_bool(g, "b", &b) && b, "bool");
    CHECK(anneal_gguf_get_str(g, "s", &s) && s.n == 6 && !memcmp(s.s, "h\xC3\xA9llo", 6), "string");
    const anneal_gguf_kv *kv = anneal_gguf_find_kv(g, "a_str");
    CHECK(kv && kv->arr_n == 3 && anneal_gguf_array_str(kv, 1).n == 2, "string array");
    float f[4][128];
    const char *names[] = {"f32", "f16", "bf16", "q8_0"};
    for (int k = 0; k < 4; k++) {
        const anneal_gguf_tensor *t = anneal_gguf_find_tensor(g, names[k]);
        REQUIRE(t && t->ne[0] == 64 && t->ne[1] == 2);
        REQUIRE(anneal_gguf_tensor_to_f32(t, f[k]) == ANNEAL_OK);
    }
    for (int i = 0; i < 128; i++) {
        CHECK(f[1][i] == anneal_f16_to_f32(anneal_f32_to_f16(f[0][i])), "f16 %d", i);
        CHECK(f[2][i] == anneal_bf16_to_f32(anneal_f32_to_bf16(f[0][i])), "bf16 %d", i);
    }
    float ref[128];
    for (int blk = 0; blk < 4; blk++) ref_q8_0(f[0] + 32 * blk, ref + 32 * blk);
    CHECK(!memcmp(ref, f[3], sizeof ref), "gguf-py's q8_0 is the reference's");
    anneal_gguf_close(g);
    anneal_model *m = NULL;
    anneal_tokenizer *tok = NULL;
    REQUIRE(anneal_model_load_gguf(anneal_test_path("tests/fuzz/corpus/gguf/gpt2_tok.gguf"), ANNEAL_CPU, &m, &tok) ==
            ANNEAL_OK);
    CHECK(m->cfg.n_layer == 1 && m->cfg.n_embd == 32 && m->cfg.vocab_size == 260 && m->cfg.n_ctx == 8, "config");
    REQUIRE(tok);
    anneal_ids ids = {0};
    REQUIRE(anneal_tokenizer_encode(tok, " the<|endoftext|>", 17, true, &ids) == ANNEAL_OK);
    CHECK(ids.n == 2 && ids.ids[0] == 258 && ids.ids[1] == 259, "\" the\" is token 258, <|endoftext|> 259");
    anneal_ids_free(&ids);
    anneal_tokenizer_free(tok);
    anneal_model_free(m);
}

/* Random byte changes of a valid model file: every one loads or fails with an error
 * (ASan/UBSan builds check that nothing is read out of bounds). */
TEST(mutated_files_fail_cleanly) {
    size_t n;
    uint8_t *orig = read_all(anneal_test_path("tests/fuzz/corpus/gguf/gpt2_tok.gguf"), &n);
    REQUIRE(orig);
    uint8_t *b = malloc(n);
    uint64_t s = 99;
    int loaded = 0, failed = 0;
    for (int round = 0; round < 60; round++) {
        memcpy(b, orig, n);
        int changes = 1 + round % 4;
        for (int k = 0; k < changes; k++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            size_t at = (size_t)(s >> 33) % (round % 2 ? 2048 : n); /* half of them in the header */
            b[at] = (uint8_t)(s >> 17);
        }
        FILE *f = fopen(tmp_path("mut.gguf"), "wb");
        REQUIRE(f);
        fwrite(b, 1, n, f);
        fclose(f);
        anneal_model *m = NULL;
        anneal_tokenizer *tok = NULL;
        anneal_clear_error();
        if (anneal_model_load_gguf(tmp_path("mut.gguf"), ANNEAL_CPU, &m, &tok) == ANNEAL_OK) loaded++;
        else {
            failed++;
            CHECK(anneal_last_error() && *anneal_last_error(), "a failure without a message");
            CHECK(!m && !tok, "a failure left a model or tokenizer");
        }
        anneal_model_free(m);
        anneal_tokenizer_free(tok);
    }
    CHECK(loaded + failed == 60, "every mutation ran");
    free(b);
    free(orig);
}

TEST(cli_export_generate) {
    const char *bin = getenv("ANNEAL_BIN");
    if (!bin) SKIP_PROMISED("ANNEAL_BIN not set (run through ctest)");
    anneal_tokenizer *tok = trained_tokenizer(400);
    REQUIRE(tok);
    anneal_tokenizer_free(tok);
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' export --model tiny --format gguf --gguf-type q8_0 --tokenizer '%s' --out '%s' 2>'%s/err.txt' && "
             "'%s' generate --model '%s' --prompt 'the model' --temperature 0 --max-tokens 6 >'%s/gen.txt' 2>>'%s/err.txt'",
             bin, tmp_path("tok"), tmp_path("cli.gguf"), g_dir, bin, tmp_path("cli.gguf"), g_dir, g_dir);
    int rc = system(cmd);
    if (rc) {
        snprintf(cmd, sizeof cmd, "cat '%s/err.txt' >&2", g_dir);
        if (system(cmd)) {}
    }
    CHECK(rc == 0, "export + generate failed");
    size_t n;
    char *gen = (char *)read_all(tmp_path("gen.txt"), &n);
    CHECK(gen && n > 9 && !strncmp(gen, "the model", 9), "generate printed the prompt and its continuation");
    free(gen);
    /* eval on shards of the same tokenizer: f32 file and the HF directory of the same weights agree */
    snprintf(cmd, sizeof cmd,
             "'%s' prepare --tokenizer '%s/tok' --input '%s/corpus.txt' --out '%s/data' --val-fraction 0.2 >/dev/null 2>&1 && "
             "'%s' export --model tiny --format gguf --tokenizer '%s/tok' --out '%s/f32.gguf' 2>/dev/null && "
             "'%s' eval --model '%s/f32.gguf' --data '%s/data' --batch 2 --seq 32 --max-batches 2 --json >'%s/eval.json' "
             "2>'%s/err.txt'",
             bin, g_dir, g_dir, g_dir, bin, g_dir, g_dir, bin, g_dir, g_dir, g_dir, g_dir);
    rc = system(cmd);
    if (rc) {
        snprintf(cmd, sizeof cmd, "cat '%s/err.txt' >&2", g_dir);
        if (system(cmd)) {}
    }
    CHECK(rc == 0, "eval --model FILE.gguf failed");
    char *ev = (char *)read_all(tmp_path("eval.json"), &n);
    double loss = ev && strstr(ev, "\"loss\"") ? atof(strstr(ev, "\"loss\"") + 7) : 0;
    CHECK(loss > 5.0 && loss < 7.5, "eval of a random 512-id model: loss %g near ln 512 = 6.24 (%s)", loss, ev ? ev : "no output");
    free(ev);
    snprintf(cmd, sizeof cmd, "'%s' export --model tiny --format gguf --gguf-type q4_0 --out '%s' 2>/dev/null", bin,
             tmp_path("x.gguf"));
    rc = system(cmd);
    CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "an unknown --gguf-type is a usage error");
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --max-tokens 2 2>/dev/null >/dev/null", bin, tmp_path("bad.gguf"));
    FILE *f = fopen(tmp_path("bad.gguf"), "wb");
    if (f) fputs("GGUF", f), fclose(f);
    rc = system(cmd);
    CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 1, "a truncated file is an error");
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/anneal_gguf_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    RUN(metadata_and_tensors_round_trip);
    RUN(every_truncation_is_an_error);
    RUN(bad_headers);
    RUN(bad_tensors);
    RUN(models_f32_round_trip);
    RUN(models_q8_0_are_the_dequantized_weights);
    RUN(f16_and_bf16_files_load);
    RUN(tokenizer_round_trip);
    RUN(sentencepiece_tokenizer_round_trip);
    RUN(llama3_tokenizer_round_trip);
    RUN(bad_models);
    RUN(reads_files_gguf_py_wrote);
    RUN(mutated_files_fail_cleanly);
    RUN(cli_export_generate);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd)) {}
    return anneal_test_summary();
}
