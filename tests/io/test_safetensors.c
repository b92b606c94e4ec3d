/* safetensors reader/writer: round trips of every dtype (0-dim, zero-size dims,
 * unaligned entries, escaped metadata), the PyTorch-written GPT-2 fixture, every
 * malformed-header case, truncations and header mutations, and atomic writes that
 * fail cleanly (missing directory, write error mid-file, target is a directory). */
#include "anneal/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"

/* ------------------------------------------------------------------ helpers */

/* Fresh directory under /tmp; returns a static buffer (one per test is enough). */
static const char *make_tmpdir(void) {
    static char dir[64];
    snprintf(dir, sizeof dir, "/tmp/anneal_st_XXXXXX");
    return mkdtemp(dir);
}

/* Removes dir and the plain files in it (the tests create nothing deeper...
 * except one test's sub-directory, removed by name). */
static void remove_tmpdir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (unlink(p) != 0) rmdir(p);
    }
    closedir(d);
    rmdir(dir);
}

/* Number of entries of dir whose name contains ".tmp." (leftover temporaries). */
static int count_temps(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    if (!d) return -1;
    while ((e = readdir(d)))
        if (strstr(e->d_name, ".tmp.")) n++;
    closedir(d);
    return n;
}

static bool write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* Reads a whole file into a malloc'd buffer; *n its size. NULL on failure. */
static uint8_t *read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = (size_t)sz;
    return b;
}

/* Writes a raw safetensors file: 8-byte length (declared, or strlen(json) when
 * declared == UINT64_MAX), the json text, then data_len bytes 0, 1, 2, ... */
static bool write_raw(const char *path, uint64_t declared, const char *json, size_t data_len) {
    size_t jl = strlen(json);
    size_t n = 8 + jl + data_len;
    uint8_t *b = malloc(n);
    uint64_t hl = declared == UINT64_MAX ? jl : declared;
    memcpy(b, &hl, 8);
    memcpy(b + 8, json, jl);
    for (size_t i = 0; i < data_len; i++) b[8 + jl + i] = (uint8_t)i;
    bool ok = write_bytes(path, b, n);
    free(b);
    return ok;
}

/* Opens path expecting failure with `code` and a message naming the path. */
static void expect_open_fails(const char *path, anneal_status code, const char *what) {
    anneal_clear_error();
    anneal_safetensors *st = (anneal_safetensors *)0x1;
    anneal_status s = anneal_safetensors_open(path, &st);
    CHECK(s == code, "%s: status %d, want %d (%s)", what, (int)s, (int)code, anneal_last_error());
    CHECK(st == NULL, "%s: out not NULL on failure", what);
    CHECK(strstr(anneal_last_error(), path) != NULL, "%s: message '%s' lacks the path", what,
          anneal_last_error());
    if (s == ANNEAL_OK) anneal_safetensors_close(st);
}

/* Reference lr schedule (the fixture's): warmup then cosine, in double. */
static double ref_lr(int s) {
    const double max_lr = 1e-2, min_lr = 1e-3;
    const int W = 3, S = 10;
    if (s < W) return max_lr * (s + 1) / W;
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + cos(M_PI * (s - W) / (double)(S - W)));
}

/* ---------------------------------------------------------------- round trip */

TEST(round_trip_all_dtypes) {
    const char *dir = make_tmpdir();
    REQUIRE(dir);
    char path[256];
    snprintf(path, sizeof path, "%s/rt.safetensors", dir);

    float f32[6] = {1.5f, -2.25f, 0.0f, 3e-38f, -1e30f, 42.0f};
    uint16_t bf16[5] = {0x3FC0, 0xC010, 0x0000, 0x7F80, 0x3E20}; /* 1.5 -2.25 0 inf 0.15625 */
    uint16_t f16[4] = {0x3E00, 0xC000, 0x0001, 0x7BFF};           /* 1.5 -2 2^-24 65504 */
    int32_t i32 = -123456789;                                     /* 0-dim scalar */
    int64_t i64[3] = {INT64_MIN, -1, INT64_MAX};
    uint16_t u16[4] = {0, 1, 65535, 4242};
    uint8_t u8[7] = {0, 1, 2, 3, 250, 254, 255}; /* odd size: what follows is unaligned */
    int8_t i8_empty[1] = {0};
    float f32_unaligned[3] = {7.0f, -8.5f, 1e-3f};
    int64_t s_f32[2] = {2, 3}, s_bf16[1] = {5}, s_f16[3] = {1, 2, 2}, s_i64[1] = {3};
    int64_t s_u16[2] = {2, 2}, s_u8[1] = {7}, s_i8[2] = {4, 0}, s_f32u[1] = {3};
    anneal_st_write_entry w[] = {
        {"a.f32", ANNEAL_F32, 2, s_f32, f32},
        {"b.bf16", ANNEAL_BF16, 1, s_bf16, bf16},
        {"c.f16", ANNEAL_F16, 3, s_f16, f16},
        {"d.i32.scalar", ANNEAL_I32, 0, NULL, &i32},
        {"e.i64", ANNEAL_I64, 1, s_i64, i64},
        {"f.u16", ANNEAL_U16, 2, s_u16, u16},
        {"g.u8", ANNEAL_U8, 1, s_u8, u8},
        {"h.i8.empty", ANNEAL_I8, 2, s_i8, i8_empty},
        {"i.f32.unaligned \"quoted\" \\ é", ANNEAL_F32, 1, s_f32u, f32_unaligned},
    };
    const int n = (int)(sizeof w / sizeof w[0]);
    const size_t sizes[] = {24, 10, 8, 4, 24, 8, 7, 0, 12};
    const char *mk[] = {"format", "note", "empty"};
    const char *mv[] = {"pt", "line1\nline2 \"q\" \\ \x01 ünï", ""};

    anneal_clear_error();
    anneal_status s = anneal_safetensors_write(path, n, w, 3, mk, mv);
    REQUIRE(s == ANNEAL_OK);
    CHECK(count_temps(dir) == 0, "temporary left behind");

    /* Framing: length, '{' first, space padding to a multiple of 8, data size. */
    size_t fsz;
    uint8_t *raw = read_bytes(path, &fsz);
    REQUIRE(raw);
    uint64_t hlen;
    memcpy(&hlen, raw, 8);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += sizes[i];
    CHECK(hlen % 8 == 0, "header length %llu not a multiple of 8", (unsigned long long)hlen);
    CHECK(fsz == 8 + hlen + total, "file size %zu vs %llu", fsz,
          (unsigned long long)(8 + hlen + total));
    CHECK(raw[8] == '{', "header does not start with '{'");
    size_t last = 8 + hlen - 1;
    while (last > 8 && raw[last] == ' ') last--;
    CHECK(raw[last] == '}', "header padding is not spaces after '}'");
    free(raw);

    anneal_safetensors *st = NULL;
    s = anneal_safetensors_open(path, &st);
    REQUIRE(s == ANNEAL_OK && st);
    CHECK(st->n_entries == n, "n_entries %d", st->n_entries);
    CHECK(st->data_size == total, "data_size %llu", (unsigned long long)st->data_size);
    uint64_t off = 0;
    for (int i = 0; i < n && i < st->n_entries; i++) {
        /* Entries come back in offset order == the order written. */
        const anneal_st_entry *e = &st->entries[i];
        CHECK(strcmp(e->name, w[i].name) == 0, "entry %d name '%s'", i, e->name);
        CHECK(anneal_safetensors_find(st, w[i].name) == e, "find '%s'", w[i].name);
        CHECK(e->dtype == w[i].dtype && e->ndim == w[i].ndim, "entry %d dtype/ndim", i);
        for (int d = 0; d < w[i].ndim; d++)
            CHECK(e->shape[d] == w[i].shape[d], "entry %d dim %d", i, d);
        CHECK(e->begin == off && e->end == off + sizes[i], "entry %d offsets [%llu,%llu)", i,
              (unsigned long long)e->begin, (unsigned long long)e->end);
        if (sizes[i])
            CHECK(memcmp(anneal_safetensors_data(st, e), w[i].data, sizes[i]) == 0,
                  "entry %d bytes differ", i);
        off += sizes[i];
    }
    CHECK(anneal_safetensors_find(st, "nope") == NULL, "find of a missing name");
    CHECK(st->n_metadata == 3, "n_metadata %d", st->n_metadata);
    for (int i = 0; i < 3; i++) {
        const char *v = anneal_safetensors_meta(st, mk[i]);
        CHECK(v && strcmp(v, mv[i]) == 0, "metadata '%s' = '%s'", mk[i], v ? v : "(null)");
    }
    CHECK(anneal_safetensors_meta(st, "missing") == NULL, "missing metadata key");

    /* Loads: same dtype copies; float conversions; unaligned source. */
    anneal_tensor *t = anneal_safetensors_load(st, "b.bf16", ANNEAL_F32);
    REQUIRE(t);
    const float want_bf[5] = {1.5f, -2.25f, 0.0f, INFINITY, 0.15625f};
    const float *tf = anneal_data(t);
    for (int i = 0; i < 5; i++) CHECK(tf[i] == want_bf[i], "bf16->f32 [%d] %g", i, tf[i]);
    CHECK(t->dtype == ANNEAL_F32 && t->ndim == 1 && t->shape[0] == 5, "bf16->f32 shape/dtype");
    anneal_release(t);

    t = anneal_safetensors_load(st, "c.f16", ANNEAL_F32);
    REQUIRE(t);
    const float want_f16[4] = {1.5f, -2.0f, 5.9604644775390625e-08f, 65504.0f};
    tf = anneal_data(t);
    for (int i = 0; i < 4; i++) CHECK(tf[i] == want_f16[i], "f16->f32 [%d] %g", i, tf[i]);
    anneal_release(t);

    t = anneal_safetensors_load(st, "a.f32", ANNEAL_BF16);
    REQUIRE(t);
    /* 1.5, -2.25, 0, 42 are exact in bf16; the others round to the nearest bf16. */
    const uint16_t *tb = anneal_data(t);
    CHECK(tb[0] == 0x3FC0 && tb[1] == 0xC010 && tb[2] == 0 && tb[5] == 0x4228,
          "f32->bf16 %04x %04x %04x %04x", tb[0], tb[1], tb[2], tb[5]);
    anneal_release(t);

    t = anneal_safetensors_load(st, w[8].name, ANNEAL_F32);
    REQUIRE(t);
    CHECK(memcmp(anneal_data(t), f32_unaligned, 12) == 0, "unaligned f32 entry");
    anneal_release(t);

    t = anneal_safetensors_load(st, "d.i32.scalar", ANNEAL_I32);
    REQUIRE(t);
    CHECK(t->ndim == 0 && *(int32_t *)anneal_data(t) == i32, "0-dim i32 scalar");
    anneal_release(t);

    t = anneal_safetensors_load(st, "h.i8.empty", ANNEAL_I8);
    REQUIRE(t);
    CHECK(t->ndim == 2 && t->shape[0] == 4 && t->shape[1] == 0, "zero-size dim");
    anneal_release(t);

    anneal_clear_error();
    CHECK(anneal_safetensors_load(st, "e.i64", ANNEAL_F32) == NULL, "i64 -> f32 must fail");
    CHECK(anneal_last_status() == ANNEAL_ERR_DTYPE, "status %d", (int)anneal_last_status());
    CHECK(strstr(anneal_last_error(), path) && strstr(anneal_last_error(), "e.i64"),
          "message '%s'", anneal_last_error());
    anneal_clear_error();
    CHECK(anneal_safetensors_load(st, "absent", ANNEAL_F32) == NULL, "missing entry must fail");
    CHECK(strstr(anneal_last_error(), path) && strstr(anneal_last_error(), "absent"),
          "message '%s'", anneal_last_error());
    anneal_clear_error();
    anneal_safetensors_close(st);
    anneal_safetensors_close(NULL);

    /* Overwriting replaces the file atomically; no metadata means no __metadata__. */
    s = anneal_safetensors_write(path, 1, w, 0, NULL, NULL);
    CHECK(s == ANNEAL_OK, "overwrite");
    st = NULL;
    s = anneal_safetensors_open(path, &st);
    REQUIRE(s == ANNEAL_OK);
    CHECK(st->n_entries == 1 && st->n_metadata == 0 && st->data_size == 24, "overwritten file");
    anneal_safetensors_close(st);

    /* Zero entries is a valid (empty) file. */
    s = anneal_safetensors_write(path, 0, NULL, 0, NULL, NULL);
    CHECK(s == ANNEAL_OK, "empty write");
    st = NULL;
    CHECK(anneal_safetensors_open(path, &st) == ANNEAL_OK && st && st->n_entries == 0, "empty open");
    anneal_safetensors_close(st);
    CHECK(count_temps(dir) == 0, "temporary left behind");
    remove_tmpdir(dir);
}

/* ----------------------------------------------------------- python fixture */

TEST(reads_pytorch_fixture) {
    const char *path = anneal_test_path("tests/fixtures/gpt2_tiny.safetensors");
    CHECK(access(path, R_OK) == 0, "%s (committed) not found", path);
    anneal_clear_error();
    anneal_safetensors *st = NULL;
    REQUIRE(anneal_safetensors_open(path, &st) == ANNEAL_OK);
    /* 28 parameters x (init, grad., final.) + input_ids, targets, logits, loss,
     * losses, grad_norms, lrs, final_loss. */
    CHECK(st->n_entries == 92, "n_entries %d", st->n_entries);
    const char *meta_want[][2] = {{"n_layer", "2"}, {"n_head", "4"},   {"n_embd", "64"},
                                  {"vocab_size", "300"}, {"n_ctx", "64"}, {"batch", "4"},
                                  {"seq", "32"},     {"steps", "10"},  {"warmup", "3"}};
    for (size_t i = 0; i < sizeof meta_want / sizeof meta_want[0]; i++) {
        const char *v = anneal_safetensors_meta(st, meta_want[i][0]);
        CHECK(v && strcmp(v, meta_want[i][1]) == 0, "meta %s = %s", meta_want[i][0], v ? v : "(null)");
    }
    CHECK(anneal_safetensors_meta(st, "torch_version") != NULL, "torch_version");

    struct {
        const char *name;
        anneal_dtype dt;
        int ndim;
        int64_t shape[3];
    } want[] = {
        {"transformer.wte.weight", ANNEAL_F32, 2, {300, 64}},
        {"transformer.wpe.weight", ANNEAL_F32, 2, {64, 64}},
        {"transformer.h.1.attn.c_attn.weight", ANNEAL_F32, 2, {64, 192}},
        {"transformer.h.0.mlp.c_proj.weight", ANNEAL_F32, 2, {256, 64}},
        {"grad.transformer.h.0.mlp.c_fc.bias", ANNEAL_F32, 1, {256}},
        {"final.transformer.ln_f.bias", ANNEAL_F32, 1, {64}},
        {"input_ids", ANNEAL_I32, 2, {4, 32}},
        {"targets", ANNEAL_I32, 2, {4, 32}},
        {"logits", ANNEAL_F32, 3, {4, 32, 300}},
        {"loss", ANNEAL_F32, 0, {0}},
        {"losses", ANNEAL_F32, 1, {10}},
        {"lrs", ANNEAL_F32, 1, {10}},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const anneal_st_entry *e = anneal_safetensors_find(st, want[i].name);
        CHECK(e, "missing %s", want[i].name);
        if (!e) continue;
        CHECK(e->dtype == want[i].dt && e->ndim == want[i].ndim, "%s dtype/ndim", want[i].name);
        for (int d = 0; d < want[i].ndim; d++)
            CHECK(e->shape[d] == want[i].shape[d], "%s dim %d = %lld", want[i].name, d,
                  (long long)e->shape[d]);
    }

    /* A few values, bit-exact, as printed by the generator (seed 1234). */
    anneal_tensor *wte = anneal_safetensors_load(st, "transformer.wte.weight", ANNEAL_F32);
    anneal_tensor *ids = anneal_safetensors_load(st, "input_ids", ANNEAL_I32);
    anneal_tensor *tg = anneal_safetensors_load(st, "targets", ANNEAL_I32);
    anneal_tensor *lg = anneal_safetensors_load(st, "logits", ANNEAL_F32);
    anneal_tensor *loss = anneal_safetensors_load(st, "loss", ANNEAL_F32);
    anneal_tensor *losses = anneal_safetensors_load(st, "losses", ANNEAL_F32);
    anneal_tensor *lrs = anneal_safetensors_load(st, "lrs", ANNEAL_F32);
    anneal_tensor *ln = anneal_safetensors_load(st, "transformer.h.0.ln_1.weight", ANNEAL_F32);
    REQUIRE(wte && ids && tg && lg && loss && losses && lrs && ln);
    uint32_t bits;
    memcpy(&bits, (float *)anneal_data(wte), 4);
    CHECK(bits == 3162749804u, "wte[0,0] bits %u", bits);
    memcpy(&bits, (float *)anneal_data(wte) + 299 * 64 + 63, 4);
    CHECK(bits == 3155756709u, "wte[299,63] bits %u", bits);
    const int32_t *pi = anneal_data(ids), *pt = anneal_data(tg);
    CHECK(pi[0] == 201 && pi[1] == 232 && pi[2] == 125 && pi[3] == 132, "input_ids[0,:4]");
    int n_ign = 0;
    for (int i = 0; i < 128; i++) {
        CHECK(pi[i] >= 0 && pi[i] < 300, "input_ids[%d] = %d", i, pi[i]);
        CHECK(pt[i] == -100 || (pt[i] >= 0 && pt[i] < 300), "targets[%d] = %d", i, pt[i]);
        n_ign += pt[i] == -100;
    }
    CHECK(n_ign == 5 && pt[50] == -100 && pt[108] == -100, "ignored targets %d", n_ign);
    memcpy(&bits, anneal_data(loss), 4);
    CHECK(bits == 1085715863u, "loss bits %u", bits);
    float l0 = *(float *)anneal_data(loss);
    CHECK(((float *)anneal_data(losses))[0] == l0, "losses[0] == loss");
    for (int i = 0; i < 64; i++) CHECK(((float *)anneal_data(ln))[i] == 1.0f, "ln_1.weight[%d]", i);
    for (int s = 0; s < 10; s++)
        CHECK_NEAR(((float *)anneal_data(lrs))[s], ref_lr(s), 1e-7 * ref_lr(s));

    /* Independent check tying logits, targets and loss: mean CE in double. */
    const float *L = anneal_data(lg);
    double sum = 0;
    int cnt = 0;
    for (int r = 0; r < 128; r++) {
        if (pt[r] < 0) continue;
        double mx = -INFINITY, se = 0;
        for (int v = 0; v < 300; v++) mx = fmax(mx, L[r * 300 + v]);
        for (int v = 0; v < 300; v++) se += exp(L[r * 300 + v] - mx);
        sum += mx + log(se) - L[r * 300 + pt[r]];
        cnt++;
    }
    CHECK_NEAR(sum / cnt, l0, 1e-5);
    anneal_release(wte);
    anneal_release(ids);
    anneal_release(tg);
    anneal_release(lg);
    anneal_release(loss);
    anneal_release(losses);
    anneal_release(lrs);
    anneal_release(ln);
    anneal_safetensors_close(st);
}

/* ------------------------------------------------------------- bad headers */

TEST(rejects_malformed_files) {
    const char *dir = make_tmpdir();
    REQUIRE(dir);
    char path[256];
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    const uint64_t AUTO = UINT64_MAX;

    /* Framing. */
    REQUIRE(write_bytes(path, "", 0));
    expect_open_fails(path, ANNEAL_ERR_FORMAT, "empty file");
    REQUIRE(write_bytes(path, "\x02\0\0\0\0", 5));
    expect_open_fails(path, ANNEAL_ERR_FORMAT, "5-byte file");
    REQUIRE(write_raw(path, 1000, "{}", 0));
    expect_open_fails(path, ANNEAL_ERR_FORMAT, "header length beyond file");
    REQUIRE(write_raw(path, (uint64_t)200 << 20, "{}", 0));
    expect_open_fails(path, ANNEAL_ERR_FORMAT, "absurd header length");
    REQUIRE(write_raw(path, UINT64_MAX - 3, "{}", 0));
    expect_open_fails(path, ANNEAL_ERR_FORMAT, "header length near 2^64");
    REQUIRE(write_raw(path, 0, "", 16));
    expect_open_fails(path, ANNEAL_ERR_FORMAT, "zero header length");

    /* Each case: header text, data bytes, what. All must give ANNEAL_ERR_FORMAT. */
    static const struct {
        const char *json;
        size_t data;
        const char *what;
    } cases[] = {
        {"{abc", 0, "not JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}", 4, "unterminated"},
        {"{} x", 0, "trailing garbage"},
        {"[1,2]", 0, "array root"},
        {"\"str\"", 0, "string root"},
        {"{\"a\":5}", 0, "entry not an object"},
        {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "missing dtype"},
        {"{\"a\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "dtype not a string"},
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, "unknown dtype F64"},
        {"{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "lower-case dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "missing shape"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,4]}}", 4, "shape not array"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "negative dim"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, "fractional dim"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4, "string dim"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,4]}}", 4, "huge dim"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1,
         "nine dims"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "missing data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, "one offset"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, "three offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{\"b\":0}}}", 4, "offsets object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, "negative offset"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 8, "begin > end"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "end > data size"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 8, "size mismatch"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,6]}}", 12, "size mismatch 2"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],"
         "\"data_offsets\":[0,0]}}",
         0, "numel overflow"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4503599627370496,1024],\"data_offsets\":[0,0]}}", 0,
         "numel x size overflow"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, "overlap"},
        {"{\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]},"
         "\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}",
         8, "containment"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, "duplicate name"},
        {"{\"__metadata__\":{\"k\":1}}", 0, "metadata value not string"},
        {"{\"__metadata__\":{\"k\":\"v\",\"j\":null}}", 0, "metadata null value"},
        {"{\"__metadata__\":[\"k\"]}", 0, "metadata not object"},
        {"{\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}}", 0, "duplicate metadata key"},
        {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate __metadata__"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        REQUIRE(write_raw(path, AUTO, cases[i].json, cases[i].data));
        expect_open_fails(path, ANNEAL_ERR_FORMAT, cases[i].what);
    }

    /* Embedded NUL inside the declared header (cJSON would stop there). */
    {
        const char j[] = "{}\0{\"a\":1}";
        uint8_t b[8 + sizeof j - 1];
        uint64_t hl = sizeof j - 1;
        memcpy(b, &hl, 8);
        memcpy(b + 8, j, sizeof j - 1);
        REQUIRE(write_bytes(path, b, sizeof b));
        expect_open_fails(path, ANNEAL_ERR_FORMAT, "embedded NUL");
    }

    /* Valid edge cases that must be accepted: holes, trailing bytes, empty entries,
     * unaligned offsets, whitespace padding, 8 dims, shared zero-size offsets. */
    static const char *ok[] = {
        "{}",
        "{}      ",
        "{\"a\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[1,4]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[5,9]}}",
        "{\"a\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[0,0]},"
        "\"b\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]},"
        "\"c\":{\"dtype\":\"I8\",\"shape\":[0],\"data_offsets\":[4,4]}}",
        "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,2],\"data_offsets\":[0,2]}}",
        "{\"__metadata__\":{}}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        REQUIRE(write_raw(path, AUTO, ok[i], 16));
        anneal_clear_error();
        anneal_safetensors *st = NULL;
        anneal_status s = anneal_safetensors_open(path, &st);
        CHECK(s == ANNEAL_OK, "valid case %zu rejected: %s", i, anneal_last_error());
        anneal_safetensors_close(st);
    }

    /* I/O errors: missing file, a directory. */
    char missing[300];
    snprintf(missing, sizeof missing, "%s/does_not_exist.safetensors", dir);
    expect_open_fails(missing, ANNEAL_ERR_IO, "missing file");
    expect_open_fails(dir, ANNEAL_ERR_IO, "directory");
    anneal_clear_error();
    CHECK(anneal_safetensors_open(NULL, NULL) == ANNEAL_ERR_ARG, "NULL arguments");
    anneal_clear_error();
    remove_tmpdir(dir);
}

/* Every truncation of a valid file is rejected; random header bytes never crash. */
TEST(rejects_truncations_and_mutations) {
    const char *dir = make_tmpdir();
    REQUIRE(dir);
    char path[256], cut[256];
    snprintf(path, sizeof path, "%s/full.safetensors", dir);
    snprintf(cut, sizeof cut, "%s/cut.safetensors", dir);
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint8_t b[3] = {9, 8, 7};
    int64_t sa[2] = {2, 3}, sb[1] = {3};
    anneal_st_write_entry w[] = {{"a", ANNEAL_F32, 2, sa, a}, {"b", ANNEAL_U8, 1, sb, b}};
    const char *k[] = {"k"}, *v[] = {"v"};
    anneal_clear_error();
    REQUIRE(anneal_safetensors_write(path, 2, w, 1, k, v) == ANNEAL_OK);
    size_t n;
    uint8_t *raw = read_bytes(path, &n);
    REQUIRE(raw);
    for (size_t len = 0; len < n; len++) {
        REQUIRE(write_bytes(cut, raw, len));
        anneal_clear_error();
        anneal_safetensors *st = NULL;
        anneal_status s = anneal_safetensors_open(cut, &st);
        CHECK(s == ANNEAL_ERR_FORMAT, "truncated to %zu of %zu bytes: status %d", len, n, (int)s);
        CHECK(strstr(anneal_last_error(), cut) != NULL, "message '%s'", anneal_last_error());
        anneal_safetensors_close(st);
    }

    /* Deterministic header mutations (LCG): either a clean error naming the file or a
     * file whose entries all lie inside the data section. */
    uint64_t hlen;
    memcpy(&hlen, raw, 8);
    uint32_t x = 12345;
    uint8_t *m = malloc(n);
    int accepted = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(m, raw, n);
        int flips = 1 + it % 3;
        for (int f = 0; f < flips; f++) {
            x = x * 1664525u + 1013904223u;
            size_t pos = (x >> 8) % (8 + hlen);
            x = x * 1664525u + 1013904223u;
            static const char alphabet[] = "{}[]\":,0123456789-.eE \\abdFIU";
            m[pos] = (x >> 24) & 1 ? (uint8_t)(x >> 8) : (uint8_t)alphabet[(x >> 8) % (sizeof alphabet - 1)];
        }
        REQUIRE(write_bytes(cut, m, n));
        anneal_clear_error();
        anneal_safetensors *st = NULL;
        anneal_status s = anneal_safetensors_open(cut, &st);
        if (s == ANNEAL_OK) {
            accepted++;
            for (int i = 0; i < st->n_entries; i++) {
                const anneal_st_entry *e = &st->entries[i];
                CHECK(e->begin <= e->end && e->end <= st->data_size, "accepted bad entry");
                CHECK(e->ndim >= 0 && e->ndim <= ANNEAL_MAX_DIMS, "accepted bad ndim");
            }
            anneal_safetensors_close(st);
        } else {
            CHECK(s == ANNEAL_ERR_FORMAT, "mutation %d: status %d", it, (int)s);
            CHECK(strstr(anneal_last_error(), cut) != NULL, "mutation %d: message '%s'", it,
                  anneal_last_error());
        }
    }
    CHECK(accepted < 3000, "every mutation accepted");
    free(m);
    free(raw);
    anneal_clear_error();
    remove_tmpdir(dir);
}

/* --------------------------------------------------------------- write failures */

TEST(write_failures_leave_target_intact) {
    const char *dir = make_tmpdir();
    REQUIRE(dir);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    float a[4] = {1, 2, 3, 4};
    int64_t sa[1] = {4};
    anneal_st_write_entry good = {"a", ANNEAL_F32, 1, sa, a};
    anneal_clear_error();
    REQUIRE(anneal_safetensors_write(path, 1, &good, 0, NULL, NULL) == ANNEAL_OK);
    size_t n0;
    uint8_t *orig = read_bytes(path, &n0);
    REQUIRE(orig);

    /* Checks path still holds the original bytes and nothing else was left behind. */
#define EXPECT_INTACT(what)                                                                  \
    do {                                                                                     \
        size_t n1;                                                                           \
        uint8_t *now = read_bytes(path, &n1);                                                \
        CHECK(now && n1 == n0 && memcmp(now, orig, n0) == 0, "%s: target modified", what);   \
        free(now);                                                                           \
        CHECK(count_temps(dir) == 0, "%s: temporary left behind", what);                     \
    } while (0)

    /* Missing directory. */
    char nodir[300];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/x.safetensors", dir);
    anneal_clear_error();
    anneal_status s = anneal_safetensors_write(nodir, 1, &good, 0, NULL, NULL);
    CHECK(s == ANNEAL_ERR_IO, "missing dir: status %d", (int)s);
    CHECK(strstr(anneal_last_error(), nodir) != NULL, "message '%s'", anneal_last_error());
    CHECK(access(nodir, F_OK) != 0, "file created in a missing dir?");

    /* A write error in the middle of the data (file size limit): 1 MiB > 64 KiB. */
    {
        size_t big_n = 1 << 18;
        float *big = calloc(big_n, sizeof(float));
        int64_t sbig[1] = {(int64_t)big_n};
        anneal_st_write_entry e[2] = {{"a", ANNEAL_F32, 1, sa, a},
                                      {"big", ANNEAL_F32, 1, sbig, big}};
        struct rlimit old, lim;
        getrlimit(RLIMIT_FSIZE, &old);
        lim = old;
        lim.rlim_cur = 64 << 10;
        void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
        REQUIRE(setrlimit(RLIMIT_FSIZE, &lim) == 0);
        anneal_clear_error();
        s = anneal_safetensors_write(path, 2, e, 0, NULL, NULL);
        setrlimit(RLIMIT_FSIZE, &old);
        signal(SIGXFSZ, prev);
        CHECK(s == ANNEAL_ERR_IO, "mid-write failure: status %d", (int)s);
        CHECK(strstr(anneal_last_error(), path) != NULL, "message '%s'", anneal_last_error());
        EXPECT_INTACT("mid-write failure");
        free(big);
    }

    /* Target is a directory: the rename fails, the temporary is removed. */
    {
        char sub[300];
        snprintf(sub, sizeof sub, "%s/sub.tmpdir", dir);
        REQUIRE(mkdir(sub, 0700) == 0);
        char inner[320];
        snprintf(inner, sizeof inner, "%s/keep", sub);
        REQUIRE(write_bytes(inner, "x", 1)); /* non-empty: rename() cannot replace it */
        anneal_clear_error();
        s = anneal_safetensors_write(sub, 1, &good, 0, NULL, NULL);
        CHECK(s == ANNEAL_ERR_IO, "target is a directory: status %d", (int)s);
        CHECK(strstr(anneal_last_error(), sub) != NULL, "message '%s'", anneal_last_error());
        CHECK(count_temps(dir) == 0, "temporary left after failed rename");
        unlink(inner);
        rmdir(sub);
    }

    /* Read-only directory (root ignores permissions, so only as a normal user). */
    if (geteuid() != 0) {
        char ro[300], rofile[320];
        snprintf(ro, sizeof ro, "%s/ro", dir);
        snprintf(rofile, sizeof rofile, "%s/f.safetensors", ro);
        REQUIRE(mkdir(ro, 0700) == 0);
        REQUIRE(anneal_safetensors_write(rofile, 1, &good, 0, NULL, NULL) == ANNEAL_OK);
        chmod(ro, 0500);
        float other[4] = {9, 9, 9, 9};
        anneal_st_write_entry ge = {"a", ANNEAL_F32, 1, sa, other};
        anneal_clear_error();
        s = anneal_safetensors_write(rofile, 1, &ge, 0, NULL, NULL);
        CHECK(s == ANNEAL_ERR_IO, "read-only dir: status %d", (int)s);
        chmod(ro, 0700);
        anneal_safetensors *st = NULL;
        anneal_clear_error();
        CHECK(anneal_safetensors_open(rofile, &st) == ANNEAL_OK, "read-only dir: file damaged");
        if (st) {
            CHECK(memcmp(anneal_safetensors_data(st, &st->entries[0]), a, 16) == 0, "old data");
            anneal_safetensors_close(st);
        }
        unlink(rofile);
        rmdir(ro);
    }

    /* Invalid arguments fail before anything touches the disk. */
    int64_t neg[1] = {-1}, s2[1] = {2};
    anneal_st_write_entry bad[][2] = {
        {{"x", ANNEAL_F32, 1, sa, a}, {"x", ANNEAL_F32, 1, sa, a}},            /* duplicate */
        {{"x", ANNEAL_F32, 1, sa, a}, {"__metadata__", ANNEAL_F32, 1, sa, a}}, /* reserved */
        {{"x", ANNEAL_F32, 1, sa, a}, {"y", ANNEAL_DTYPE_COUNT, 1, sa, a}},    /* dtype */
        {{"x", ANNEAL_F32, 1, sa, a}, {"y", ANNEAL_F32, 1, neg, a}},           /* dim < 0 */
        {{"x", ANNEAL_F32, 1, sa, a}, {"y", ANNEAL_F32, 9, sa, a}},            /* ndim */
        {{"x", ANNEAL_F32, 1, sa, a}, {"y", ANNEAL_F32, 1, s2, NULL}},         /* no data */
        {{"x", ANNEAL_F32, 1, sa, a}, {NULL, ANNEAL_F32, 1, sa, a}},           /* no name */
        {{"x", ANNEAL_F32, 1, sa, a}, {"bad\xff utf8", ANNEAL_F32, 1, sa, a}}, /* not UTF-8 */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        anneal_clear_error();
        s = anneal_safetensors_write(path, 2, bad[i], 0, NULL, NULL);
        CHECK(s == ANNEAL_ERR_ARG, "bad case %zu: status %d", i, (int)s);
        CHECK(strstr(anneal_last_error(), path) != NULL, "bad case %zu: '%s'", i,
              anneal_last_error());
        EXPECT_INTACT("invalid arguments");
    }
    const char *dk[] = {"k", "k"}, *dv[] = {"1", "2"};
    anneal_clear_error();
    CHECK(anneal_safetensors_write(path, 1, &good, 2, dk, dv) == ANNEAL_ERR_ARG, "dup meta key");
    EXPECT_INTACT("duplicate metadata key");
#undef EXPECT_INTACT
    free(orig);
    anneal_clear_error();
    remove_tmpdir(dir);
}

int main(void) {
    RUN(round_trip_all_dtypes);
    RUN(reads_pytorch_fixture);
    RUN(rejects_malformed_files);
    RUN(rejects_truncations_and_mutations);
    RUN(write_failures_leave_target_intact);
    return anneal_test_summary();
}
