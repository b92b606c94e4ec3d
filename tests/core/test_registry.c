/* The backend registry and the device contract: tables missing the version 1
 * essentials or written for a newer version are refused with a message; a table
 * registered on an extension device id gets its name, its memory and its kernels (here
 * the CPU's slots on a second, host-memory device); ops on it run through it, and an op
 * its supports_op declines fails with ANNEAL_ERR_UNSUPPORTED naming the backend and the
 * device instead of calling a missing kernel; copies between devices go through the
 * host; the gradient sync refuses parameters its communicator cannot address. */
#include "anneal/anneal.h"
#include "backend_clone.h"
#include "test.h"

#include <string.h>

#define EXT ANNEAL_DEVICE_EXT

static anneal_backend g_ext;
static bool g_decline_matmul, g_decline_gqa;
static int g_syncs;

/* The CPU's answer, except for what a test makes the device decline. */
static bool ext_supports(void *ctx, const anneal_op_query *q) {
    if (q->kind == ANNEAL_OP_MATMUL && g_decline_matmul) return false;
    if (q->kind == ANNEAL_OP_ATTENTION && g_decline_gqa && q->attention && q->attention->Hq != q->attention->Hkv)
        return false;
    const anneal_backend *cpu = anneal_backend_get(ANNEAL_CPU);
    return cpu->supports_op(cpu->ctx, q);
}

static anneal_status ext_sync(void *ctx) {
    g_syncs++;
    return ANNEAL_OK;
}

/* A second device made of the CPU's slots (host memory), named "testdev". */
static bool ext_register(void) {
    if (!anneal_test_cpu_clone(&g_ext, "testdev", EXT)) return false;
    g_ext.supports_op = ext_supports;
    g_ext.synchronize = ext_sync;
    return anneal_backend_register(&g_ext) == ANNEAL_OK;
}

static void expect_refused(const anneal_backend *b, const char *substr, const char *what) {
    anneal_clear_error();
    CHECK(anneal_backend_register(b) == ANNEAL_ERR_ARG, "%s: registered", what);
    CHECK(strstr(anneal_last_error(), substr) != NULL, "%s: message '%s' lacks '%s'", what, anneal_last_error(),
          substr);
    anneal_clear_error();
}

TEST(refuses_incomplete_or_newer_tables) {
    const anneal_backend *cpu = anneal_backend_get(ANNEAL_CPU);
    REQUIRE(cpu && cpu->version == ANNEAL_BACKEND_VERSION && !strcmp(cpu->name, "cpu"));
    anneal_backend b = *cpu;
    b.device = EXT + 1;
    b.name = "half";
    b.alloc = NULL;
    expect_refused(&b, "'alloc'", "no alloc");
    b = *cpu;
    b.device = EXT + 1;
    b.synchronize = NULL;
    expect_refused(&b, "'synchronize'", "no synchronize");
    b = *cpu;
    b.device = EXT + 1;
    b.copy_to_host = NULL;
    expect_refused(&b, "'copy_to_host'", "no copy_to_host");
    b = *cpu;
    b.device = EXT + 1;
    b.version = ANNEAL_BACKEND_VERSION + 1;
    expect_refused(&b, "version", "a newer version");
    b.version = 0;
    expect_refused(&b, "version", "version 0");
    b = *cpu;
    b.device = (anneal_device)ANNEAL_DEVICE_COUNT;
    expect_refused(&b, "device id", "device id out of range");
    expect_refused(NULL, "NULL", "NULL table");
    /* none of them took the slot: the device still has no backend */
    anneal_clear_error();
    CHECK_TRUE(anneal_backend_get(EXT + 1) == NULL && anneal_last_status() == ANNEAL_ERR_DEVICE);
    CHECK(!strcmp(anneal_device_name(EXT + 1), "device3"), "unregistered name %s", anneal_device_name(EXT + 1));
    anneal_clear_error();
}

TEST(supports_follows_slots_and_supports_op) {
    const anneal_backend *cpu = anneal_backend_get(ANNEAL_CPU);
    anneal_backend b = *cpu;
    b.supports_op = NULL;
    b.rope = NULL;
    anneal_op_query rope = {.kind = ANNEAL_OP_ROPE, .dtype = ANNEAL_F32};
    anneal_op_query copy = {.kind = ANNEAL_OP_COPY, .dtype = ANNEAL_BF16};
    CHECK_TRUE(!anneal_backend_supports(&b, &rope)); /* no slot: no kernel */
    CHECK_TRUE(anneal_backend_supports(&b, &copy));  /* a slot without supports_op: yes */
    b.matmul = NULL;
    anneal_matmul_desc d = {.batch = 1, .M = 1, .N = 1, .K = 1, .compute = ANNEAL_F32};
    anneal_op_query mm = {.kind = ANNEAL_OP_MATMUL, .dtype = ANNEAL_F32, .matmul = &d};
    CHECK_TRUE(!anneal_backend_supports(&b, &mm));
    CHECK_TRUE(anneal_backend_supports(cpu, &mm));
    d.epilogue = ANNEAL_EPILOGUE_BIAS;
    d.batch = 4; /* the CPU's GEMM epilogue is per product */
    CHECK_TRUE(!anneal_backend_supports(cpu, &mm));
    mm.dtype = ANNEAL_BF16; /* f32 storage only */
    d.batch = 1;
    CHECK_TRUE(!anneal_backend_supports(cpu, &mm));
    CHECK_TRUE(!anneal_backend_supports(NULL, &mm));
}

TEST(extension_device_runs_ops_through_its_table) {
    REQUIRE(ext_register());
    CHECK(!strcmp(anneal_device_name(EXT), "testdev"), "name %s", anneal_device_name(EXT));
    anneal_scope *s = anneal_scope_open();
    float av[6] = {1, 2, 3, 4, 5, 6}, bv[6] = {6, 5, 4, 3, 2, 1}, out[6];
    anneal_tensor *a = anneal_from_data_on(EXT, ANNEAL_F32, 2, (int64_t[]){2, 3}, av);
    anneal_tensor *b = anneal_from_data_on(EXT, ANNEAL_F32, 2, (int64_t[]){2, 3}, bv);
    REQUIRE(a && b && a->device == EXT);
    anneal_tensor *c = anneal_add(a, b);
    REQUIRE(c && c->device == EXT);
    REQUIRE(anneal_to_f32_buffer(c, out) == ANNEAL_OK);
    for (int i = 0; i < 6; i++) CHECK(out[i] == 7.0f, "add[%d] = %g", i, (double)out[i]);
    CHECK(anneal_memory_stats_get(EXT).live_bytes > 0, "the device's allocator holds the tensors");
    /* an op across devices is refused */
    anneal_tensor *h = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){2, 3}, av);
    anneal_clear_error();
    CHECK_TRUE(anneal_add(a, h) == NULL && anneal_last_status() == ANNEAL_ERR_DEVICE);
    anneal_clear_error();
    /* a declined kernel: the op names itself, the backend and the device */
    g_decline_matmul = true;
    anneal_tensor *bt = anneal_transpose(b, 0, 1);
    anneal_tensor *m = anneal_matmul(a, bt);
    CHECK_TRUE(m == NULL && anneal_last_status() == ANNEAL_ERR_UNSUPPORTED);
    const char *msg = anneal_last_error();
    CHECK(strstr(msg, "matmul") && strstr(msg, "testdev") && strstr(msg, "device 2"), "message '%s'", msg);
    anneal_clear_error();
    CHECK_TRUE(anneal_linear(a, b, NULL) == NULL && anneal_last_status() == ANNEAL_ERR_UNSUPPORTED);
    CHECK(strstr(anneal_last_error(), "linear: the testdev backend"), "message '%s'", anneal_last_error());
    anneal_clear_error();
    /* the same product without the decline: the CPU's kernel on this device's memory */
    g_decline_matmul = false;
    m = anneal_matmul(a, bt);
    REQUIRE(m && m->device == EXT);
    REQUIRE(anneal_to_f32_buffer(m, out) == ANNEAL_OK);
    CHECK(out[0] == 1 * 6 + 2 * 5 + 3 * 4 && out[3] == 4 * 3 + 5 * 2 + 6 * 1, "matmul %g %g", (double)out[0],
          (double)out[3]);
    /* grouped-query attention declined by one device's supports_op */
    g_decline_gqa = true;
    anneal_tensor *q = anneal_zeros_like(anneal_from_data_on(EXT, ANNEAL_F32, 4, (int64_t[]){1, 2, 3, 2}, (float[12]){0}));
    anneal_tensor *k = anneal_from_data_on(EXT, ANNEAL_F32, 4, (int64_t[]){1, 1, 3, 2}, (float[6]){0});
    CHECK_TRUE(anneal_attention(q, k, k, true, 0) == NULL && anneal_last_status() == ANNEAL_ERR_UNSUPPORTED);
    CHECK(strstr(anneal_last_error(), "2 query heads over 1 key/value heads"), "message '%s'", anneal_last_error());
    anneal_clear_error();
    g_decline_gqa = false;
    anneal_scope_close(s);
}

TEST(copies_between_devices_go_through_the_host) {
    REQUIRE(ext_register());
    anneal_scope *s = anneal_scope_open();
    float v[6] = {1, -2, 3.5f, 4, 5, -6}, out[6];
    anneal_tensor *h = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){2, 3}, v);
    anneal_set_requires_grad(h, true);
    anneal_tensor *d = anneal_to_device(h, EXT);
    REQUIRE(d && d->device == EXT && d->grad_fn == NULL && !d->requires_grad); /* not differentiable */
    CHECK_TRUE(anneal_to_device(d, EXT) == d);
    /* into a strided bf16 view on the CPU: converted on the way */
    anneal_tensor *back = anneal_zeros(ANNEAL_BF16, 2, (int64_t[]){3, 2});
    REQUIRE(anneal_copy_(anneal_transpose(back, 0, 1), d) == ANNEAL_OK);
    REQUIRE(anneal_to_f32_buffer(anneal_transpose(back, 0, 1), out) == ANNEAL_OK);
    for (int i = 0; i < 6; i++) CHECK(out[i] == v[i], "[%d] %g vs %g", i, (double)out[i], (double)v[i]);
    anneal_tensor *r = anneal_to_device(d, ANNEAL_CPU);
    REQUIRE(r && r->device == ANNEAL_CPU && anneal_to_f32_buffer(r, out) == ANNEAL_OK);
    CHECK_TRUE(!memcmp(out, v, sizeof v));
    g_syncs = 0;
    CHECK_TRUE(anneal_device_synchronize(EXT) == ANNEAL_OK && g_syncs == 1);
    anneal_clear_error();
    CHECK_TRUE(anneal_device_synchronize((anneal_device)99) == ANNEAL_ERR_DEVICE);
    anneal_clear_error();
    CHECK_TRUE(anneal_to_device(h, (anneal_device)(EXT + 4)) == NULL && anneal_last_status() == ANNEAL_ERR_DEVICE);
    anneal_clear_error();
    anneal_scope_close(s);
}

TEST(gradient_sync_refuses_memory_its_communicator_cannot_reach) {
    REQUIRE(ext_register());
    anneal_comm *c = anneal_comm_init();
    REQUIRE(c);
    /* a parameter set whose one parameter lives on the extension device (sets make CPU
     * tensors: this one's is swapped for a device tensor owned by the same scope) */
    anneal_params *ps = anneal_params_new();
    REQUIRE(ps && anneal_params_create(ps, "w", 1, (int64_t[]){4}, true));
    anneal_scope_enter(ps->scope);
    anneal_tensor *w = anneal_from_data_on(EXT, ANNEAL_F32, 1, (int64_t[]){4}, (float[4]){1, 2, 3, 4});
    anneal_scope_leave();
    REQUIRE(w && anneal_set_requires_grad(w, true) == ANNEAL_OK);
    ps->items[0].tensor = w;
    anneal_clear_error();
    anneal_ddp *d = anneal_ddp_new(c, ps, anneal_ddp_defaults());
    CHECK_TRUE(d == NULL && anneal_last_status() == ANNEAL_ERR_UNSUPPORTED);
    CHECK(strstr(anneal_last_error(), "the MPI communicator works on host memory") &&
              strstr(anneal_last_error(), "'w'") && strstr(anneal_last_error(), "testdev"),
          "message '%s'", anneal_last_error());
    anneal_clear_error();
    anneal_ddp_free(d);
    anneal_params_free(ps);
    anneal_comm_free(c);
}

int main(void) {
    RUN(refuses_incomplete_or_newer_tables);
    RUN(supports_follows_slots_and_supports_op);
    RUN(extension_device_runs_ops_through_its_table);
    RUN(copies_between_devices_go_through_the_host);
    RUN(gradient_sync_refuses_memory_its_communicator_cannot_reach);
    return anneal_test_summary();
}
