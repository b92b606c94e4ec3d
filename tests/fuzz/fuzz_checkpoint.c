/* Fuzzes checkpoint reading (src/io/checkpoint_load.c: `latest`, state.json with the
 * trainer state, file sizes and checksums, config.json through the registry; then the
 * tensors into a model and AdamW): the input is state.json FUZZ_SEP config.json
 * FUZZ_SEP latest of a run directory whose ckpt_00000006 holds the golden checkpoint's
 * model.safetensors and optimizer.safetensors (tests/fixtures/golden_ckpt; a missing
 * part leaves the golden file). A model is built only when the config is small (the
 * size of a model a checkpoint asks for is the user's choice, not a parser's). */
#include "anneal/checkpoint.h"
#include "anneal/optim.h"
#include "fuzz/fuzz_util.h"

#include <limits.h>

static char golden[3][64 << 10]; /* state.json, config.json, latest */
static size_t golden_len[3];

/* Copies the golden checkpoint into scratch/run once. */
static void setup_once(void) {
    static bool done;
    if (done) return;
    done = true;
    const char *src = getenv("ANNEAL_SOURCE_DIR");
    char base[PATH_MAX];
    snprintf(base, sizeof base, "%s/tests/fixtures/golden_ckpt", src ? src : ".");
    char d[600];
    snprintf(d, sizeof d, "%s/run", fuzz_dir());
    mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/run/ckpt_00000006", fuzz_dir());
    mkdir(d, 0755);
    static const char *const names[] = {"ckpt_00000006/state.json", "ckpt_00000006/config.json", "latest",
                                        "ckpt_00000006/model.safetensors", "ckpt_00000006/optimizer.safetensors"};
    for (int i = 0; i < 5; i++) {
        char p[PATH_MAX + 64], dst[128];
        snprintf(p, sizeof p, "%s/%s", base, names[i]);
        FILE *f = fopen(p, "rb");
        if (!f) {
            fprintf(stderr, "fuzz_checkpoint: %s missing (run from the source root or set ANNEAL_SOURCE_DIR)\n", p);
            abort();
        }
        static char buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        if (i < 3) memcpy(golden[i], buf, n < sizeof golden[i] ? n : sizeof golden[i]), golden_len[i] = n;
        snprintf(dst, sizeof dst, "run/%s", names[i]);
        fuzz_write(dst, buf, n);
    }
}

/* True when cfg's model is small enough to build for every input. */
static bool small(const anneal_model_config *c) {
    double e = c->n_embd, ff = c->n_ff > 0 ? c->n_ff : 4.0 * c->n_embd;
    double n = (double)c->n_layer * (4 * e * e + 3 * e * ff) + ((double)c->vocab_size + c->n_ctx) * e;
    return c->n_layer >= 0 && c->n_embd >= 0 && c->vocab_size >= 0 && c->n_ctx >= 0 && n < 2e6 && c->n_ctx <= 4096;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup_once();
    const uint8_t *part[3];
    size_t len[3];
    int n = fuzz_split(data, size, part, len, 3);
    static const char *const files[] = {"run/ckpt_00000006/state.json", "run/ckpt_00000006/config.json", "run/latest"};
    for (int i = 0; i < 3; i++) {
        if (i < n) fuzz_write(files[i], part[i], len[i]);
        else fuzz_write(files[i], golden[i], golden_len[i]);
    }
    char dir[PATH_MAX];
    anneal_model_config cfg;
    char *config_json = NULL;
    if (anneal_checkpoint_resolve(fuzz_path("run"), dir, sizeof dir) == ANNEAL_OK &&
        anneal_checkpoint_read_config(dir, &cfg, &config_json) == ANNEAL_OK && small(&cfg)) {
        bool is_lora = false;
        char base[1024];
        uint64_t fp = 0;
        (void)anneal_checkpoint_lora_base(dir, &is_lora, base, sizeof base, &fp);
        anneal_clear_error();
        anneal_model *m = anneal_model_new(&cfg, ANNEAL_CPU);
        if (m) {
            anneal_optimizer *opt = anneal_optimizer_new(m->params, anneal_optim_defaults(ANNEAL_OPTIM_ADAMW));
            anneal_train_state st;
            (void)anneal_checkpoint_load(dir, m, opt, &st);
            anneal_clear_error();
            anneal_optimizer_free(opt);
            anneal_model_free(m);
        }
    }
    free(config_json);
    anneal_clear_error();
    return 0;
}
