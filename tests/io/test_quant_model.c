/* Quantized models end to end in the library: GPT-2 tiny and llama-tiny (random
 * weights) quantized weight-only (per channel, group 32), dynamic and static keep their
 * logits within a stated bound of f32; the cached (generation) forward agrees with the
 * full one; a quantized directory written and read back gives the same logits bit for
 * bit; training, LoRA and Hugging Face export are refused; and the reader refuses every
 * malformed directory with a message naming the problem. */
#include "anneal/anneal.h"
#include "models/decode_engine.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[256];

static bool make_tmpdir(void) {
    if (tmpdir[0]) return true;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/anneal_quant_XXXXXX");
    return mkdtemp(tmpdir) != NULL;
}

static anneal_model *fresh(const char *preset) {
    anneal_model_config cfg;
    if (!anneal_model_preset(preset, &cfg)) return NULL;
    anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
    if (m && anneal_model_init(m, 1234) != ANNEAL_OK) anneal_model_free(m), m = NULL;
    return m;
}

/* Random ids (B, T) below vocab, the same for a given salt. */
static anneal_tensor *ids_of(int B, int T, int vocab, uint64_t salt) {
    int32_t buf[4 * 64];
    uint64_t s = 0x9e3779b97f4a7c15ULL ^ salt;
    for (int i = 0; i < B * T; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        buf[i] = (int32_t)((s >> 33) % (uint64_t)vocab);
    }
    return anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, buf);
}

/* Host copy of the logits of m on ids (malloc'd, numel in *n). */
static float *logits_of(anneal_model *m, anneal_tensor *ids, int64_t *n) {
    anneal_scope *sc = anneal_scope_open();
    anneal_no_grad_begin();
    anneal_tensor *l = anneal_model_logits(m, ids);
    anneal_no_grad_end();
    float *out = NULL;
    if (l) {
        *n = anneal_numel(l);
        out = malloc((size_t)*n * sizeof *out);
        if (anneal_to_f32_buffer(l, out) != ANNEAL_OK) free(out), out = NULL;
    }
    anneal_scope_close(sc);
    return out;
}

/* max |a - b| / max |b|. */
static double rel_err(const float *a, const float *b, int64_t n) {
    double d = 0, r = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i])), r = fmax(r, fabs((double)b[i]));
    return d / (r > 0 ? r : 1);
}

typedef struct qcase {
    anneal_quant_mode mode;
    int64_t group;
    double bound; /* on rel_err vs f32 */
} qcase;

/* Measured on AVX-512 (random N(0, 0.02) weights, 2 x 16 ids; GPT-2 tiny / llama-tiny):
 * weight-only 0.0037 / 0.0051, group 32 0.0029 / -, dynamic 0.0052 / 0.0081, static
 * (calibrated on 2 batches of other ids) 0.0072 / 0.030 of the largest |logit|. Bounds
 * 2.5-3x the worse one: an int8 path that were wrong (a scale off by a step, a dropped
 * row, a transposed weight) is far past them. */
static const qcase CASES[] = {
    {ANNEAL_QUANT_WEIGHT_ONLY, 0, 0.015},
    {ANNEAL_QUANT_WEIGHT_ONLY, 32, 0.009},
    {ANNEAL_QUANT_DYNAMIC, 0, 0.025},
    {ANNEAL_QUANT_STATIC, 0, 0.08},
};

/* Quantizes m in case c (static: calibrated on two batches of other ids). */
static anneal_status quantize(anneal_model *m, const qcase *c) {
    if (c->mode == ANNEAL_QUANT_STATIC) {
        anneal_status s = anneal_nn_calibrate_begin(m->params);
        for (int b = 0; b < 2 && s == ANNEAL_OK; b++) {
            anneal_scope *sc = anneal_scope_open();
            int64_t n;
            float *l = logits_of(m, ids_of(2, 16, m->cfg.vocab_size, 100 + (uint64_t)b), &n);
            if (!l) s = anneal_last_status();
            free(l);
            anneal_scope_close(sc);
        }
        if (s == ANNEAL_OK) s = anneal_nn_calibrate_end(m->params, ANNEAL_CALIB_MINMAX, 0);
        if (s != ANNEAL_OK) return s;
    }
    return anneal_nn_quantize(m->params, c->mode, c->group);
}

static void check_preset(const char *preset) {
    REQUIRE(make_tmpdir());
    anneal_model *ref = fresh(preset);
    REQUIRE(ref);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *ids = ids_of(2, 16, ref->cfg.vocab_size, 1);
    int64_t n = 0, n2 = 0;
    float *want = logits_of(ref, ids, &n);
    REQUIRE(want);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        const qcase *c = &CASES[i];
        anneal_model *m = fresh(preset);
        REQUIRE(m);
        anneal_status s = quantize(m, c);
        if (s != ANNEAL_OK && c->group && strstr(anneal_last_error(), "does not divide")) {
            /* llama-tiny's 176-wide MLP: group 32 refused, naming the layer */
            printf("  %s group %lld: refused (%s)\n", preset, (long long)c->group, anneal_last_error());
            anneal_clear_error();
            anneal_model_free(m);
            continue;
        }
        REQUIRE(s == ANNEAL_OK);
        CHECK(m->params->quant == c->mode, "mode recorded");
        float *got = logits_of(m, ids, &n2);
        REQUIRE(got && n2 == n);
        double e = rel_err(got, want, n);
        printf("  %s %s group %lld: max |logit - f32| = %.4f of max |logit|\n", preset, anneal_quant_mode_name(c->mode),
               (long long)c->group, e);
        CHECK(e < c->bound, "%s %s: %.4g >= %.4g", preset, anneal_quant_mode_name(c->mode), e, c->bound);
        CHECK(e > 0, "%s %s: logits equal f32: the int8 path did not run", preset, anneal_quant_mode_name(c->mode));
        /* the cached forward (generation: one row at a time, the streaming kernels) */
        anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 2, 16);
        REQUIRE(kv);
        double ce = 0;
        for (int t = 0; t < 16; t++) {
            anneal_scope *s2 = anneal_scope_open();
            int32_t col[2];
            for (int b = 0; b < 2; b++) col[b] = (int32_t)anneal_item_at(ids, b * 16 + t);
            anneal_tensor *lt = anneal_model_forward_cached(m, kv, anneal_from_data(ANNEAL_I32, 2, (int64_t[]){2, 1}, col));
            REQUIRE(lt);
            int64_t V = m->cfg.vocab_size;
            for (int b = 0; b < 2; b++)
                for (int64_t v = 0; v < V; v++)
                    ce = fmax(ce, fabs(anneal_item_at(lt, b * V + v) - got[(b * 16 + t) * V + v]));
            anneal_scope_close(s2);
        }
        anneal_kv_cache_free(kv);
        CHECK(ce < 1e-3, "%s %s: the cached forward differs by %.3g", preset, anneal_quant_mode_name(c->mode), ce);
        /* written and read back: the same logits, bit for bit */
        char dir[400];
        snprintf(dir, sizeof dir, "%s/%s_%d", tmpdir, preset, (int)i);
        REQUIRE(anneal_quant_save(m, dir, &(anneal_quant_save_opts){.calib_method = "minmax", .calib_batches = 2}) == ANNEAL_OK);
        CHECK(anneal_quant_dir_is_quantized(dir), "%s: not recognised", dir);
        anneal_model *back = NULL;
        REQUIRE(anneal_model_load_hf(dir, ANNEAL_CPU, &back) == ANNEAL_OK);
        /* the load's temporaries went back to the system, not to the allocator's cache */
        CHECK(anneal_memory_stats_get(ANNEAL_CPU).cached_bytes == 0, "%s: %lld bytes cached after the load", preset,
              (long long)anneal_memory_stats_get(ANNEAL_CPU).cached_bytes);
        float *again = logits_of(back, ids, &n2);
        REQUIRE(again);
        CHECK(memcmp(again, got, (size_t)n * sizeof *got) == 0, "%s %s: logits after the round trip differ", preset,
              anneal_quant_mode_name(c->mode));
        /* refusals: training (no backward), LoRA, Hugging Face export, quantizing twice */
        anneal_clear_error();
        anneal_tensor *loss = anneal_model_loss(back, ids, ids);
        CHECK(!loss && strstr(anneal_last_error(), "no backward"), "training: %s", anneal_last_error());
        anneal_clear_error();
        char hf[420];
        snprintf(hf, sizeof hf, "%s/hf_%d", tmpdir, (int)i);
        CHECK(anneal_model_save_hf(back, hf, NULL) != ANNEAL_OK && strstr(anneal_last_error(), "int8"), "export: %s",
              anneal_last_error());
        anneal_clear_error();
        const char *targets[] = {"c_attn"};
        CHECK(anneal_lora_apply(back->params, &(anneal_lora_config){.rank = 2, .alpha = 4, .targets = targets, .n_targets = 1}) ==
                  ANNEAL_ERR_UNSUPPORTED, "lora on int8 accepted");
        anneal_clear_error();
        CHECK(anneal_nn_quantize(back->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_ERR_STATE, "quantized twice");
        anneal_clear_error();
        free(again), free(got);
        anneal_model_free(back);
        anneal_model_free(m);
    }
    free(want);
    anneal_scope_close(sc);
    anneal_model_free(ref);
}

TEST(gpt2_tiny_quantized_logits_stay_near_f32) { check_preset("tiny"); }
TEST(llama_tiny_quantized_logits_stay_near_f32) { check_preset("llama-tiny"); }

/* ------------------------------------------------------------ bad input */

static bool write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(text, 1, strlen(text), f) == strlen(text);
    return fclose(f) == 0 && ok;
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) free(s), s = NULL;
    if (s) s[n] = '\0';
    fclose(f);
    return s;
}

/* A copy of the directory src at dst: config.json with `from` replaced by `to` (NULL:
 * unchanged), model.safetensors with entry `drop` left out and entry `retype` stored as
 * F32 of its shape (or, with reshape, as a (1) F32). */
static bool variant(const char *src, const char *dst, const char *from, const char *to, const char *drop,
                    const char *retype, bool reshape) {
    char p[600];
    if (mkdir(dst, 0755) != 0) return false;
    snprintf(p, sizeof p, "%s/config.json", src);
    char *cfg = read_text(p);
    if (!cfg) return false;
    if (from) {
        char *at = strstr(cfg, from);
        if (!at) return free(cfg), false;
        size_t n = strlen(cfg) + strlen(to) + 1;
        char *e = malloc(n);
        snprintf(e, n, "%.*s%s%s", (int)(at - cfg), cfg, to, at + strlen(from));
        free(cfg);
        cfg = e;
    }
    snprintf(p, sizeof p, "%s/config.json", dst);
    bool ok = write_text(p, cfg);
    free(cfg);
    anneal_safetensors *st = NULL;
    snprintf(p, sizeof p, "%s/model.safetensors", src);
    if (!ok || anneal_safetensors_open(p, &st) != ANNEAL_OK) return false;
    anneal_st_write_entry *w = calloc((size_t)st->n_entries, sizeof *w);
    float *f32 = NULL, one = 1.0f;
    int n = 0;
    static const int64_t one_shape[1] = {1};
    for (int i = 0; i < st->n_entries; i++) {
        const anneal_st_entry *e = &st->entries[i];
        if (drop && !strcmp(e->name, drop)) continue;
        w[n] = (anneal_st_write_entry){.name = e->name, .dtype = e->dtype, .ndim = e->ndim, .shape = e->shape,
                                       .data = anneal_safetensors_data(st, e)};
        if (retype && !strcmp(e->name, retype)) {
            if (reshape) {
                w[n].dtype = ANNEAL_F32, w[n].ndim = 1, w[n].shape = one_shape, w[n].data = &one;
            } else {
                int64_t k = 1;
                for (int d = 0; d < e->ndim; d++) k *= e->shape[d];
                f32 = calloc((size_t)k, sizeof *f32);
                w[n].dtype = ANNEAL_F32, w[n].data = f32;
            }
        }
        n++;
    }
    snprintf(p, sizeof p, "%s/model.safetensors", dst);
    ok = anneal_safetensors_write(p, n, w, 0, NULL, NULL) == ANNEAL_OK;
    free(w), free(f32);
    anneal_safetensors_close(st);
    return ok;
}

TEST(reader_refuses_malformed_directories) {
    REQUIRE(make_tmpdir());
    char wo[400], dyn[400], st[400];
    anneal_model *m = fresh("tiny");
    REQUIRE(m && anneal_nn_quantize(m->params, ANNEAL_QUANT_WEIGHT_ONLY, 32) == ANNEAL_OK);
    snprintf(wo, sizeof wo, "%s/bad_src_wo", tmpdir);
    REQUIRE(anneal_quant_save(m, wo, NULL) == ANNEAL_OK);
    anneal_model_free(m);
    m = fresh("tiny");
    REQUIRE(m && anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_OK);
    snprintf(dyn, sizeof dyn, "%s/bad_src_dyn", tmpdir);
    REQUIRE(anneal_quant_save(m, dyn, NULL) == ANNEAL_OK);
    anneal_model_free(m);
    m = fresh("tiny");
    REQUIRE(m && anneal_nn_calibrate_begin(m->params) == ANNEAL_OK);
    anneal_scope *sc = anneal_scope_open();
    int64_t n;
    free(logits_of(m, ids_of(1, 8, 512, 3), &n));
    anneal_scope_close(sc);
    REQUIRE(anneal_nn_calibrate_end(m->params, ANNEAL_CALIB_PERCENTILE, 99.9) == ANNEAL_OK);
    REQUIRE(anneal_nn_quantize(m->params, ANNEAL_QUANT_STATIC, 0) == ANNEAL_OK);
    snprintf(st, sizeof st, "%s/bad_src_static", tmpdir);
    REQUIRE(anneal_quant_save(m, st, NULL) == ANNEAL_OK);
    anneal_model_free(m);
    char hd[400];
    m = fresh("tiny");
    REQUIRE(m && anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_OK && anneal_model_quantize_head(m) == ANNEAL_OK);
    snprintf(hd, sizeof hd, "%s/bad_src_head", tmpdir);
    REQUIRE(anneal_quant_save(m, hd, NULL) == ANNEAL_OK);
    anneal_model_free(m);
    const char *L = "transformer.h.0.attn.c_attn";
    char qw[128], sc_name[128], in_name[128];
    snprintf(qw, sizeof qw, "%s.qweight", L);
    snprintf(sc_name, sizeof sc_name, "%s.weight_scale", L);
    snprintf(in_name, sizeof in_name, "%s.input_scale", L);
    struct {
        const char *what, *src, *from, *to, *drop, *retype;
        bool reshape;
        const char *expect;
    } cases[] = {
        {"another method", wo, "\"anneal-int8\"", "\"gptq\"", NULL, NULL, false, "quant_method \"gptq\""},
        {"unknown mode", wo, "\"weight-only\"", "\"int4\"", NULL, NULL, false, "mode int4"},
        {"bits", wo, "\"bits\":\t8", "\"bits\":\t4", NULL, NULL, false, "bits must be 8"},
        {"group not dividing", wo, "\"group_size\":\t32", "\"group_size\":\t48", NULL, NULL, false, "does not divide"},
        {"negative group", wo, "\"group_size\":\t32", "\"group_size\":\t-32", NULL, NULL, false, "group_size must be"},
        {"group with dynamic", dyn, "\"group_size\":\t0", "\"group_size\":\t32", NULL, NULL, false, "groups are for weight-only"},
        {"group size changed", wo, "\"group_size\":\t32", "\"group_size\":\t64", NULL, NULL, false, "weight_scale must be"},
        {"qweight as f32", dyn, NULL, NULL, NULL, qw, false, "qweight must be i8"},
        {"scale shape", dyn, NULL, NULL, NULL, sc_name, true, "weight_scale must be"},
        {"qweight missing", dyn, NULL, NULL, qw, NULL, false, "qweight is missing"},
        {"unknown layer", dyn, "\"transformer.h.0.attn.c_attn\"", "\"transformer.h.0.attn.nope\"", NULL, NULL, false,
         "not a quantizable dense layer"},
        {"lm_head listed", dyn, "\"transformer.h.0.attn.c_attn\"", "\"lm_head\"", NULL, NULL, false,
         "not a quantizable dense layer"},
        {"static input scale missing", st, NULL, NULL, in_name, NULL, false, "input_scale is missing"},
        {"input scale in dynamic", st, "\"static\"", "\"dynamic\"", NULL, NULL, false, "is for static mode"},
        {"no modules", dyn, "\"modules\"", "\"modulez\"", NULL, NULL, false, "modules must be"},
        {"head with version 1", hd, "\"format_version\":\t2", "\"format_version\":\t1", NULL, NULL, false,
         "lm_head needs format_version 2"},
        {"version 2 without head", hd, "\"lm_head\"", "\"lm_headz\"", NULL, NULL, false, "lm_head must be"},
        {"head mode", hd, "\"lm_head\":\t\"dynamic\"", "\"lm_head\":\t\"weight-only\"", NULL, NULL, false,
         "lm_head must be \"dynamic\""},
        {"head qweight missing", hd, NULL, NULL, "lm_head.qweight", NULL, false, "lm_head.qweight is missing"},
        {"head scale shape", hd, NULL, NULL, NULL, "lm_head.weight_scale", true, "lm_head.weight_scale must be"},
        {"version 3", hd, "\"format_version\":\t2", "\"format_version\":\t3", NULL, NULL, false, "must be 1 or 2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dst[450];
        snprintf(dst, sizeof dst, "%s/bad_%d", tmpdir, (int)i);
        REQUIRE(variant(cases[i].src, dst, cases[i].from, cases[i].to, cases[i].drop, cases[i].retype, cases[i].reshape));
        anneal_model *back = NULL;
        anneal_clear_error();
        anneal_status s = anneal_model_load_hf(dst, ANNEAL_CPU, &back);
        CHECK(s != ANNEAL_OK && !back, "%s: loaded", cases[i].what);
        CHECK(strstr(anneal_last_error(), cases[i].expect) != NULL, "%s: '%s' lacks '%s'", cases[i].what,
              anneal_last_error(), cases[i].expect);
        anneal_model_free(back);
    }
    /* an unchanged copy loads (the variants differ only where the cases say) */
    char ok_dir[450];
    snprintf(ok_dir, sizeof ok_dir, "%s/bad_control", tmpdir);
    REQUIRE(variant(st, ok_dir, NULL, NULL, NULL, NULL, false));
    anneal_model *back = NULL;
    CHECK(anneal_model_load_hf(ok_dir, ANNEAL_CPU, &back) == ANNEAL_OK, "control: %s", anneal_last_error());
    anneal_model_free(back);
    anneal_clear_error();
    /* the writer's own refusals */
    m = fresh("tiny");
    REQUIRE(m);
    snprintf(ok_dir, sizeof ok_dir, "%s/not_quantized", tmpdir);
    CHECK(anneal_quant_save(m, ok_dir, NULL) == ANNEAL_ERR_STATE, "an f32 model saved as quantized");
    anneal_clear_error();
    CHECK(anneal_nn_quantize(m->params, ANNEAL_QUANT_STATIC, 0) == ANNEAL_ERR_STATE &&
              strstr(anneal_last_error(), "calibrated"), "static without calibration: %s", anneal_last_error());
    anneal_clear_error();
    CHECK(anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 32) == ANNEAL_ERR_ARG, "group with dynamic");
    anneal_clear_error();
    REQUIRE(anneal_nn_quantize(m->params, ANNEAL_QUANT_DYNAMIC, 0) == ANNEAL_OK);
    CHECK(anneal_quant_save(m, wo, NULL) != ANNEAL_OK && strstr(anneal_last_error(), "not empty"), "over a directory: %s",
          anneal_last_error());
    anneal_clear_error();
    anneal_model_free(m);
}

/* ------------------------------------------------------------ int8 lm head */

/* Mean cross-entropy of logits (rows, V) against targets, in double. */
static double mean_ce(const float *l, const anneal_tensor *targets, int64_t rows, int64_t V) {
    double sum = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = l + r * V;
        double mx = x[0], z = 0;
        for (int64_t v = 1; v < V; v++) mx = fmax(mx, x[v]);
        for (int64_t v = 0; v < V; v++) z += exp(x[v] - mx);
        sum += log(z) + mx - x[(int64_t)anneal_item_at(targets, r)];
    }
    return sum / (double)rows;
}

static bool file_has(const char *path, const char *text) {
    char *s = read_text(path);
    bool has = s && strstr(s, text);
    free(s);
    return has;
}

/* Measured on Zen 3 (AVX2; random N(0, 0.02) weights, 2 x 16 ids): the int8 head moves
 * the int8 model's logits by max 0.0033 (GPT-2 tiny weight-only), 0.0048 (dynamic),
 * llama-tiny 0.0063 / 0.0085 of the largest |logit|; against f32, the whole int8 model
 * with its head 0.0038 / 0.0065 and 0.0084 / 0.0107. Bounds 2.3-2.8x the worse: a head
 * read with a wrong scale, row or transposition is far past them. */
static void check_head(const char *preset) {
    REQUIRE(make_tmpdir());
    anneal_model *ref = fresh(preset);
    REQUIRE(ref);
    anneal_scope *sc = anneal_scope_open();
    anneal_tensor *ids = ids_of(2, 16, ref->cfg.vocab_size, 1), *targets = ids_of(2, 16, ref->cfg.vocab_size, 9);
    int64_t n = 0, n2 = 0;
    float *want = logits_of(ref, ids, &n);
    REQUIRE(want);
    const int64_t V = ref->cfg.vocab_size;
    static const struct {
        anneal_quant_mode mode;
        double head_bound, f32_bound;
    } cases[] = {{ANNEAL_QUANT_WEIGHT_ONLY, 0.015, 0.02}, {ANNEAL_QUANT_DYNAMIC, 0.02, 0.03}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *mn = anneal_quant_mode_name(cases[i].mode);
        anneal_model *m = fresh(preset);
        REQUIRE(m && anneal_nn_quantize(m->params, cases[i].mode, 0) == ANNEAL_OK);
        float *f32_head = logits_of(m, ids, &n2);
        REQUIRE(f32_head && n2 == n);
        CHECK(anneal_model_quantize_head(m) == ANNEAL_OK, "%s: %s", mn, anneal_last_error());
        REQUIRE(m->params->head);
        CHECK(m->params->head->mode == cases[i].mode, "%s: head mode %d", mn, (int)m->params->head->mode);
        CHECK(anneal_model_quantize_head(m) == ANNEAL_ERR_STATE, "%s: head quantized twice", mn);
        anneal_clear_error();
        float *got = logits_of(m, ids, &n2);
        REQUIRE(got && n2 == n);
        double eh = rel_err(got, f32_head, n), ef = rel_err(got, want, n);
        printf("  %s %s int8 head: max |logit - f32 head| = %.4f, |logit - f32 model| = %.4f of max |logit|\n", preset,
               mn, eh, ef);
        CHECK(eh > 0, "%s %s: the int8 head did not run", preset, mn);
        CHECK(eh < cases[i].head_bound, "%s %s: head error %.4g >= %.4g", preset, mn, eh, cases[i].head_bound);
        CHECK(ef < cases[i].f32_bound, "%s %s: error vs f32 %.4g >= %.4g", preset, mn, ef, cases[i].f32_bound);
        /* the loss (eval's path) reads the int8 head: the mean cross-entropy of these logits */
        anneal_scope *s1 = anneal_scope_open();
        anneal_no_grad_begin();
        anneal_tensor *loss = anneal_model_loss(m, ids, targets);
        anneal_no_grad_end();
        REQUIRE(loss);
        double lw = mean_ce(got, targets, 32, V), lg = anneal_item(loss);
        CHECK(fabs(lg - lw) < 1e-4 * fmax(1.0, fabs(lw)), "%s %s: loss %.7g, the logits' cross-entropy %.7g", preset, mn,
              lg, lw);
        anneal_scope_close(s1);
        /* past one chunk of 256 rows, some targets ignored: the chunked loss is still the mean */
        {
            enum { B = 3, T = 100 };
            int32_t bi[B * T], bt[B * T];
            uint64_t r = 77;
            for (int k = 0; k < B * T; k++) {
                r = r * 6364136223846793005ULL + 1442695040888963407ULL;
                bi[k] = (int32_t)((r >> 33) % (uint64_t)V);
                bt[k] = k % 7 == 3 ? -100 : (int32_t)((r >> 17) % (uint64_t)V);
            }
            anneal_scope *s3 = anneal_scope_open();
            anneal_tensor *bids = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, bi);
            anneal_tensor *btg = anneal_from_data(ANNEAL_I32, 2, (int64_t[]){B, T}, bt);
            int64_t nl = 0;
            float *bl = logits_of(m, bids, &nl);
            REQUIRE(bl && nl == (int64_t)B * T * V);
            double want_sum = 0;
            int count = 0;
            for (int k = 0; k < B * T; k++) {
                if (bt[k] == -100) continue;
                const float *x = bl + (int64_t)k * V;
                double mx = x[0], z = 0;
                for (int64_t v = 1; v < V; v++) mx = fmax(mx, x[v]);
                for (int64_t v = 0; v < V; v++) z += exp(x[v] - mx);
                want_sum += log(z) + mx - x[bt[k]];
                count++;
            }
            anneal_no_grad_begin();
            anneal_tensor *bloss = anneal_model_loss(m, bids, btg);
            anneal_no_grad_end();
            REQUIRE(bloss);
            double wl = want_sum / count, gl = anneal_item(bloss);
            CHECK(fabs(gl - wl) < 1e-4 * fmax(1.0, fabs(wl)), "%s %s: %d rows: loss %.7g, want %.7g", preset, mn, B * T, gl,
                  wl);
            free(bl);
            anneal_scope_close(s3);
        }
        /* decoding: the engine's slots step (the GEMV path) against the full forward */
        anneal_kv_cache *kv = anneal_model_kv_cache_new(m, 2, 16);
        REQUIRE(kv);
        int64_t before = anneal_decode_engine_steps();
        double ce = 0;
        for (int t = 0; t < 16; t++) {
            anneal_scope *s2 = anneal_scope_open();
            int32_t col[2];
            for (int b = 0; b < 2; b++) col[b] = (int32_t)anneal_item_at(ids, b * 16 + t);
            anneal_tensor *lt = anneal_model_decode_slots(m, kv, (int64_t[]){0, 1}, col, 2);
            REQUIRE(lt);
            for (int b = 0; b < 2; b++)
                for (int64_t v = 0; v < V; v++)
                    ce = fmax(ce, fabs(anneal_item_at(lt, b * V + v) - got[(b * 16 + t) * V + v]));
            anneal_scope_close(s2);
        }
        anneal_kv_cache_free(kv);
        CHECK(anneal_decode_engine_steps() == before + 16, "%s %s: the decode engine did not run", preset, mn);
        CHECK(ce < 1e-3, "%s %s: decoding differs from the full forward by %.3g", preset, mn, ce);
        /* format_version 2 with the head written and read back bit for bit */
        char dir[400], cfgp[420];
        snprintf(dir, sizeof dir, "%s/head_%s_%d", tmpdir, preset, (int)i);
        REQUIRE(anneal_quant_save(m, dir, NULL) == ANNEAL_OK);
        snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
        CHECK(file_has(cfgp, "\"format_version\":\t2") && file_has(cfgp, "\"lm_head\":"), "%s: not version 2", cfgp);
        anneal_model *back = NULL;
        REQUIRE(anneal_model_load_hf(dir, ANNEAL_CPU, &back) == ANNEAL_OK);
        CHECK(back->params->head && back->params->head->mode == cases[i].mode, "%s %s: head not read back", preset, mn);
        float *again = logits_of(back, ids, &n2);
        REQUIRE(again);
        CHECK(memcmp(again, got, (size_t)n * sizeof *got) == 0, "%s %s: logits after the round trip differ", preset, mn);
        free(again);
        anneal_model_free(back);
        /* the f32-head directory (format_version 1, as before the int8 head) still loads, head float */
        anneal_model *m1 = fresh(preset);
        REQUIRE(m1 && anneal_nn_quantize(m1->params, cases[i].mode, 0) == ANNEAL_OK);
        snprintf(dir, sizeof dir, "%s/headless_%s_%d", tmpdir, preset, (int)i);
        REQUIRE(anneal_quant_save(m1, dir, NULL) == ANNEAL_OK);
        snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
        CHECK(file_has(cfgp, "\"format_version\":\t1") && !file_has(cfgp, "\"lm_head\":"), "%s: not version 1", cfgp);
        REQUIRE(anneal_model_load_hf(dir, ANNEAL_CPU, &back) == ANNEAL_OK);
        CHECK(!back->params->head, "%s: a version 1 directory gave an int8 head", dir);
        again = logits_of(back, ids, &n2);
        REQUIRE(again);
        CHECK(memcmp(again, f32_head, (size_t)n * sizeof *got) == 0, "%s %s: version 1 logits differ", preset, mn);
        free(again);
        anneal_model_free(back);
        anneal_model_free(m1);
        free(got), free(f32_head);
        anneal_model_free(m);
    }
    free(want);
    anneal_scope_close(sc);
    anneal_model_free(ref);
}

TEST(gpt2_tiny_int8_head) { check_head("tiny"); }
TEST(llama_tiny_int8_head) { check_head("llama-tiny"); }

int main(void) {
    RUN(gpt2_tiny_quantized_logits_stay_near_f32);
    RUN(llama_tiny_quantized_logits_stay_near_f32);
    RUN(reader_refuses_malformed_directories);
    RUN(gpt2_tiny_int8_head);
    RUN(llama_tiny_int8_head);
    if (tmpdir[0]) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    }
    return anneal_test_summary();
}
