/* Saved-tensor hooks and the activation offloader (src/autograd/saved_offload.c):
 * a small residual MLP stack trained with and without the offloader gives the same
 * loss and gradients bit for bit (also with a recompute region and over repeated
 * steps, which reuse the file), live activation bytes at the peak drop, an evicted
 * storage still reads its values (through the file) and one that outlives the
 * offloader is brought back into memory, the file's descriptor is closed and nothing
 * is left in the directory, and bad directories are clear errors. */
#include "anneal/anneal.h"
#include "test.h"

#include <dirent.h>
#include <unistd.h>

enum { N = 512, D = 64, H = 256, LAYERS = 4 }; /* activations of 128 KiB (N x D) and 512 KiB (N x H) */

typedef struct {
    anneal_tensor *ln_w[LAYERS], *ln_b[LAYERS], *w1[LAYERS], *w2[LAYERS];
    anneal_tensor *x;
    anneal_scope *scope;
} net;

/* Parameters (charged to the parameters category, as a model's are) and an input. */
static void net_init(net *n) {
    anneal_manual_seed(11);
    n->scope = anneal_scope_new();
    anneal_scope_enter(n->scope);
    anneal_mem_category mc = anneal_memory_category_set(ANNEAL_MEM_PARAMETERS);
    for (int l = 0; l < LAYERS; l++) {
        n->ln_w[l] = anneal_randn(ANNEAL_F32, 1, (int64_t[]){D}, 1.0f, 0.1f);
        n->ln_b[l] = anneal_randn(ANNEAL_F32, 1, (int64_t[]){D}, 0.0f, 0.1f);
        n->w1[l] = anneal_randn(ANNEAL_F32, 2, (int64_t[]){H, D}, 0.0f, 0.1f);
        n->w2[l] = anneal_randn(ANNEAL_F32, 2, (int64_t[]){D, H}, 0.0f, 0.1f);
        anneal_set_requires_grad(n->ln_w[l], true);
        anneal_set_requires_grad(n->ln_b[l], true);
        anneal_set_requires_grad(n->w1[l], true);
        anneal_set_requires_grad(n->w2[l], true);
    }
    anneal_memory_category_set(mc);
    n->x = anneal_randn(ANNEAL_F32, 2, (int64_t[]){N, D}, 0.0f, 1.0f);
    anneal_scope_leave();
}

static anneal_tensor **all_params(net *n, int *count) {
    static anneal_tensor *p[4 * LAYERS];
    for (int l = 0; l < LAYERS; l++) p[4 * l] = n->ln_w[l], p[4 * l + 1] = n->ln_b[l], p[4 * l + 2] = n->w1[l], p[4 * l + 3] = n->w2[l];
    *count = 4 * LAYERS;
    return p;
}

typedef struct {
    net *n;
    int l;
} mlp_ctx;

/* h + w2 . gelu(w1 . layer_norm(h)) */
static anneal_tensor *mlp(void *ctx, anneal_tensor *const *in) {
    mlp_ctx *c = ctx;
    anneal_tensor *a = anneal_layer_norm(in[0], c->n->ln_w[c->l], c->n->ln_b[c->l], 1e-5f);
    anneal_tensor *g = anneal_gelu(anneal_linear(a, c->n->w1[c->l], NULL), true);
    return anneal_add(in[0], anneal_linear(g, c->n->w2[c->l], NULL));
}

/* One forward + backward; the loss's bits and the gradients' bytes into out. */
static void step(net *n, bool region, float *loss, float *grads, int64_t *n_grads) {
    int np;
    anneal_tensor **p = all_params(n, &np);
    for (int i = 0; i < np; i++) anneal_grad_clear(p[i]);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *h = n->x;
    mlp_ctx ctx[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        ctx[l] = (mlp_ctx){n, l};
        h = region && l == 1 ? anneal_checkpoint(mlp, &ctx[l], 1, &h) : mlp(&ctx[l], &h);
    }
    anneal_tensor *y = anneal_mean(anneal_mul(h, h));
    anneal_status st = y ? anneal_backward(y) : anneal_last_status();
    CHECK(st == ANNEAL_OK, "backward: %s", anneal_last_error());
    *loss = y ? (float)anneal_item(y) : NAN;
    int64_t k = 0;
    for (int i = 0; i < np; i++) {
        if (!p[i]->grad) continue;
        anneal_to_f32_buffer(p[i]->grad, grads + k);
        k += anneal_numel(p[i]);
    }
    *n_grads = k;
    anneal_scope_close(s);
}

static int64_t n_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int64_t n = 0;
    for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static int n_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

static char g_dir[256];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/anneal_saved_offload_XXXXXX");
    if (!mkdtemp(g_dir)) g_dir[0] = '\0';
}

enum { MAXG = LAYERS * (2 * D + 2 * H * D) };

TEST(offload_is_bit_identical_and_lowers_peak) {
    REQUIRE(g_dir[0]);
    net n;
    net_init(&n);
    float *g0 = malloc(MAXG * sizeof(float)), *g1 = malloc(MAXG * sizeof(float));
    REQUIRE(g0 && g1);
    for (int region = 0; region < 2; region++) {
        float l0, l1;
        int64_t k0, k1;
        anneal_memory_reset_peak(ANNEAL_CPU);
        step(&n, region, &l0, g0, &k0);
        int64_t peak0 = anneal_memory_categories_get(ANNEAL_CPU).at_peak[ANNEAL_MEM_ACTIVATIONS];
        int64_t fds = n_fds();
        anneal_act_offload *o = anneal_act_offload_new(g_dir, 0);
        REQUIRE(o);
        CHECK(n_fds() == fds + 1, "%lld descriptors, %lld before", (long long)n_fds(), (long long)fds);
        CHECK(n_entries(g_dir) == 0, "the file is visible in %s", g_dir);
        anneal_act_offload_install(o);
        int64_t file_after_first = 0;
        for (int rep = 0; rep < 3; rep++) { /* later steps reuse the file */
            anneal_memory_reset_peak(ANNEAL_CPU);
            step(&n, region, &l1, g1, &k1);
            int64_t peak1 = anneal_memory_categories_get(ANNEAL_CPU).at_peak[ANNEAL_MEM_ACTIVATIONS];
            CHECK(memcmp(&l0, &l1, sizeof l0) == 0, "region %d rep %d: loss %.9g offloaded, %.9g not", region, rep,
                  l1, l0);
            CHECK(k0 == k1 && memcmp(g0, g1, (size_t)k0 * sizeof(float)) == 0,
                  "region %d rep %d: gradients differ", region, rep);
            anneal_act_offload_stats s = anneal_act_offload_stats_get(o);
            if (rep == 0) {
                file_after_first = s.file_bytes;
                printf("    region %d: activations at the peak %.2f MiB plain, %.2f MiB offloaded; %lld evicted, "
                       "%lld read back, file %.1f MiB\n", region, peak0 / 1048576.0, peak1 / 1048576.0,
                       (long long)s.n_evicted, (long long)s.n_restored, s.file_bytes / 1048576.0);
                CHECK(s.n_evicted > 0 && s.n_restored > 0, "nothing went through the file");
                /* every record but the first one backward reads was announced ahead */
                CHECK(s.prefetched_bytes > 0 && s.prefetched_bytes < s.evicted_bytes &&
                      s.prefetched_bytes >= s.evicted_bytes - (int64_t)N * H * 4,
                      "%lld of %lld bytes read ahead", (long long)s.prefetched_bytes, (long long)s.evicted_bytes);
                /* measured 6.77 -> 2.27 MiB (plain), 7.02 -> 3.27 MiB (one layer recomputed: its
                 * replay's activations stay in memory) */
                CHECK(peak1 * 2 <= peak0, "activations at the peak: %lld offloaded vs %lld", (long long)peak1,
                      (long long)peak0);
            } else {
                CHECK(s.file_bytes == file_after_first, "the file grew from %lld to %lld bytes on a later step",
                      (long long)file_after_first, (long long)s.file_bytes);
            }
        }
        anneal_act_offload_free(o);
        CHECK(n_fds() == fds, "%lld descriptors after free, %lld before", (long long)n_fds(), (long long)fds);
        CHECK(n_entries(g_dir) == 0, "something was left in %s", g_dir);
        /* hooks removed: the next step keeps its activations */
        step(&n, region, &l1, g1, &k1);
        CHECK(memcmp(&l0, &l1, sizeof l0) == 0, "after free: %.9g vs %.9g", l1, l0);
    }
    free(g0);
    free(g1);
    anneal_scope_free(n.scope);
}

/* A storage evicted during forward still reads its values (through the file); one that
 * outlives the offloader (a graph never backpropagated, kept by the caller) is brought
 * back into memory by free, values intact. */
TEST(evicted_storage_reads_and_survives) {
    REQUIRE(g_dir[0]);
    net n;
    net_init(&n);
    anneal_act_offload *o = anneal_act_offload_new(g_dir, 0);
    REQUIRE(o);
    anneal_act_offload_install(o);
    anneal_scope *s = anneal_scope_open();
    mlp_ctx ctx = {&n, 0};
    anneal_tensor *first = mlp(&ctx, &n.x), *h = first;
    float *want = malloc(N * D * sizeof(float)), *got = malloc(N * D * sizeof(float));
    REQUIRE(want && got);
    anneal_no_grad_begin();
    anneal_tensor *copy = anneal_clone(first);
    anneal_no_grad_end();
    anneal_to_f32_buffer(copy, want);
    for (int l = 1; l < LAYERS; l++) {
        ctx.l = l;
        h = mlp(&ctx, &h);
    }
    CHECK(anneal_storage_evicted(first->storage), "the first layer's output was not evicted");
    anneal_to_f32_buffer(first, got);
    CHECK(memcmp(want, got, N * D * sizeof(float)) == 0, "an evicted tensor reads other values");
    anneal_tensor *keep = anneal_retain(first);
    anneal_scope_close(s); /* no backward: the graph goes, keep stays */
    anneal_act_offload_free(o);
    CHECK(!anneal_storage_evicted(keep->storage), "still evicted after the offloader was freed");
    anneal_to_f32_buffer(keep, got);
    CHECK(memcmp(want, got, N * D * sizeof(float)) == 0, "the survivor came back with other values");
    anneal_release(keep);
    free(want);
    free(got);
    anneal_scope_free(n.scope);
}

/* The hook pair itself: pack sees the saves of forward only (not those of a recompute
 * region's forward nor of backward), unpack's copy is read instead, its error fails
 * the backward. */
typedef struct {
    int packs, unpacks, copies;
    bool fail;
} hook_counts;

static void count_pack(anneal_tensor *t, void *user) {
    (void)t;
    ((hook_counts *)user)->packs++;
}

static anneal_status copy_unpack(anneal_tensor *t, anneal_tensor **use, void *user) {
    hook_counts *h = user;
    h->unpacks++;
    if (h->fail) return anneal_set_error(ANNEAL_ERR_IO, "unpack refused");
    if (!anneal_is_contiguous(t)) return ANNEAL_OK;
    anneal_scope_enter(NULL);
    *use = anneal_clone(t);
    anneal_scope_leave();
    h->copies++;
    return ANNEAL_OK;
}

TEST(hooks_see_forward_saves_and_errors_fail_backward) {
    net n;
    net_init(&n);
    float l0, l1;
    int64_t k0, k1;
    float *g0 = malloc(MAXG * sizeof(float)), *g1 = malloc(MAXG * sizeof(float));
    REQUIRE(g0 && g1);
    step(&n, true, &l0, g0, &k0);
    hook_counts h = {0};
    anneal_set_saved_tensor_hooks(count_pack, copy_unpack, &h);
    anneal_scope *s1 = anneal_scope_open(); /* the saves of one layer */
    mlp_ctx c0 = {&n, 0};
    mlp(&c0, &n.x);
    anneal_scope_close(s1);
    int per_layer = h.packs;
    h.packs = 0;
    step(&n, false, &l1, g1, &k1);
    int plain = h.packs;
    h = (hook_counts){0};
    step(&n, true, &l1, g1, &k1);
    CHECK(memcmp(&l0, &l1, sizeof l0) == 0 && k0 == k1 && memcmp(g0, g1, (size_t)k0 * sizeof(float)) == 0,
          "copies from unpack changed the result");
    /* the region's inner saves are not packed, only its input; backward packs nothing */
    CHECK(per_layer >= 4 && h.packs == plain - per_layer + 1, "%d packs with a region, %d without, %d per layer",
          h.packs, plain, per_layer);
    CHECK(h.unpacks > h.packs && h.copies > 0, "%d unpacks, %d copies (the replay's nodes are asked too)", h.unpacks,
          h.copies);
    h.fail = true;
    anneal_scope *s = anneal_scope_open();
    mlp_ctx ctx = {&n, 0};
    anneal_tensor *y = anneal_mean(mlp(&ctx, &n.x));
    CHECK(anneal_backward(y) == ANNEAL_ERR_IO && strstr(anneal_last_error(), "unpack refused"), "%s",
          anneal_last_error());
    anneal_clear_error();
    anneal_scope_close(s);
    anneal_set_saved_tensor_hooks(NULL, NULL, NULL);
    free(g0);
    free(g1);
    anneal_scope_free(n.scope);
}

TEST(bad_directories) {
    anneal_clear_error();
    CHECK(!anneal_act_offload_new("/nonexistent_dir_for_anneal", 0), "a missing directory was accepted");
    CHECK(anneal_last_status() == ANNEAL_ERR_IO && strstr(anneal_last_error(), "No such file"), "%s",
          anneal_last_error());
    anneal_clear_error();
    CHECK(!anneal_act_offload_new("/proc/self/status", 0), "a file was accepted as a directory");
    CHECK(strstr(anneal_last_error(), "not a directory"), "%s", anneal_last_error());
    anneal_clear_error();
    int64_t fds = n_fds();
    /* /sys refuses new files even to root */
    CHECK(!anneal_act_offload_new("/sys", 0), "a directory without write access was accepted");
    CHECK(anneal_last_status() == ANNEAL_ERR_IO && strstr(anneal_last_error(), "cannot create the activation file"),
          "%s", anneal_last_error());
    CHECK(n_fds() == fds, "a descriptor leaked");
    anneal_clear_error();
}

int main(void) {
    make_dir();
    RUN(offload_is_bit_identical_and_lowers_peak);
    RUN(evicted_storage_reads_and_survives);
    RUN(hooks_see_forward_saves_and_errors_fail_backward);
    RUN(bad_directories);
    if (g_dir[0]) rmdir(g_dir);
    return anneal_test_summary();
}
