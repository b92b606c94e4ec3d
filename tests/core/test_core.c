/* Core: dtype conversions, Philox known answers, tensors and views, scopes and
 * ownership, allocator statistics and out-of-memory errors. */
#include "anneal/anneal.h"
#include "test.h"

TEST(philox_known_answers) {
    /* Random123 kat_vectors for philox4x32-10 */
    uint32_t r[4];
    anneal_philox4x32(0, 0, 0, r);
    CHECK(r[0] == 0x6627e8d5u && r[1] == 0xe169c58du && r[2] == 0xbc57ac4cu && r[3] == 0x9b00dbd8u,
          "zero: %08x %08x %08x %08x", r[0], r[1], r[2], r[3]);
    anneal_philox4x32(~0ULL, ~0ULL, ~0ULL, r);
    CHECK(r[0] == 0x408f276du && r[1] == 0x41c83b0eu && r[2] == 0xa20bc7c6u && r[3] == 0x6d5451fdu,
          "ones: %08x %08x %08x %08x", r[0], r[1], r[2], r[3]);
    anneal_philox4x32(0x299f31d0a4093822ULL, 0x0370734413198a2eULL, 0x85a308d3243f6a88ULL, r);
    CHECK(r[0] == 0xd16cfe09u && r[1] == 0x94fdccebu && r[2] == 0x5001e420u && r[3] == 0x24126ea1u,
          "pi: %08x %08x %08x %08x", r[0], r[1], r[2], r[3]);
}

TEST(rng_state_replays) {
    anneal_manual_seed(3);
    anneal_rng_state s0 = anneal_rng_get();
    uint64_t a = anneal_rng_reserve(10);
    uint64_t b = anneal_rng_reserve(1);
    CHECK_TRUE(a == 0 && b == 12); /* whole Philox blocks of 4 */
    anneal_rng_set(s0);
    CHECK_TRUE(anneal_rng_reserve(10) == a);
}

TEST(bf16_f16_conversions) {
    /* every f16 value round-trips through f32 exactly */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = anneal_f16_to_f32((uint16_t)h);
        uint16_t back = anneal_f32_to_f16(f);
        bool nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
        if (nan ? !isnan(f) : back != h) bad++;
    }
    CHECK(bad == 0, "%d f16 values do not round-trip", bad);
    CHECK_NEAR(anneal_f16_to_f32(0x3c00), 1.0, 0);
    CHECK_NEAR(anneal_f16_to_f32(0x0001), 5.960464477539063e-08, 0); /* smallest subnormal */
    CHECK_TRUE(anneal_f32_to_f16(65520.0f) == 0x7c00);                 /* rounds to inf */
    CHECK_TRUE(anneal_f32_to_f16(65519.0f) == 0x7bff);                 /* max finite */
    CHECK_TRUE(anneal_f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00);        /* tie to even */
    CHECK_TRUE(anneal_f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02);
    CHECK_TRUE(anneal_f32_to_bf16(1.0f) == 0x3f80);
    CHECK_TRUE(anneal_f32_to_bf16(1.0f + 1.0f / 256) == 0x3f80);        /* tie to even */
    CHECK_TRUE(anneal_f32_to_bf16(1.0f + 3.0f / 256) == 0x3f82);
    CHECK_TRUE(isnan(anneal_bf16_to_f32(anneal_f32_to_bf16(NAN))));
    for (uint32_t h = 0; h < 65536; h += 7) {
        float f = anneal_bf16_to_f32((uint16_t)h);
        if (!isnan(f)) CHECK_TRUE(anneal_f32_to_bf16(f) == h);
    }
}

TEST(tensor_basics_and_errors) {
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *t = anneal_zeros(ANNEAL_F32, 3, (int64_t[]){2, 3, 4});
    REQUIRE(t);
    CHECK_TRUE(anneal_numel(t) == 24 && anneal_size(t, -1) == 4 && anneal_size(t, 3) == -1);
    CHECK_TRUE(anneal_is_contiguous(t) && t->strides[0] == 12);
    anneal_tensor *sc = anneal_scalar(2.5f);
    CHECK_TRUE(sc->ndim == 0 && anneal_numel(sc) == 1 && anneal_item(sc) == 2.5);
    anneal_clear_error();
    CHECK_TRUE(anneal_empty(ANNEAL_F32, 9, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 1}) == NULL);
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_empty(ANNEAL_F32, 1, (int64_t[]){-3}) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    CHECK_TRUE(anneal_empty((anneal_dtype)99, 1, (int64_t[]){3}) == NULL && anneal_last_status() == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    CHECK_TRUE(anneal_empty(ANNEAL_F32, 2, (int64_t[]){1LL << 40, 1LL << 40}) == NULL &&
               anneal_last_status() == ANNEAL_ERR_OOM);
    anneal_clear_error();
    /* alias outside the storage is refused */
    CHECK_TRUE(anneal_alias(t, 1, (int64_t[]){30}, (int64_t[]){1}, 0) == NULL && anneal_last_status() == ANNEAL_ERR_ARG);
    anneal_clear_error();
    anneal_tensor *i = anneal_zeros(ANNEAL_I32, 1, (int64_t[]){3});
    CHECK_TRUE(anneal_set_requires_grad(i, true) == ANNEAL_ERR_DTYPE);
    anneal_clear_error();
    /* the first error is kept */
    anneal_set_error(ANNEAL_ERR_SHAPE, "first");
    anneal_set_error(ANNEAL_ERR_ARG, "second");
    CHECK_TRUE(anneal_last_status() == ANNEAL_ERR_SHAPE && !strcmp(anneal_last_error(), "first"));
    anneal_clear_error();
    CHECK_TRUE(anneal_last_status() == ANNEAL_OK && !strcmp(anneal_last_error(), ""));
    anneal_scope_close(s);
}

TEST(scopes_own_and_free) {
    int64_t live0 = anneal_memory_stats_get(ANNEAL_CPU).live_bytes;
    anneal_scope *outer = anneal_scope_open();
    anneal_tensor *kept = NULL;
    {
        anneal_scope *inner = anneal_scope_open();
        for (int k = 0; k < 10; k++) anneal_zeros(ANNEAL_F32, 1, (int64_t[]){1000});
        anneal_tensor *v = anneal_zeros(ANNEAL_F32, 2, (int64_t[]){10, 10});
        kept = anneal_transpose(v, 0, 1); /* a view keeps its storage alive */
        CHECK_TRUE(anneal_scope_count(inner) == 12);
        anneal_keep(kept, outer);
        CHECK_TRUE(anneal_scope_count(inner) == 11 && anneal_scope_count(outer) == 1);
        anneal_scope_close(inner);
    }
    CHECK_TRUE(anneal_memory_stats_get(ANNEAL_CPU).live_bytes - live0 == 400);
    CHECK_NEAR(anneal_item_at(kept, 5), 0.0, 0);
    anneal_scope_close(outer);
    CHECK_TRUE(anneal_memory_stats_get(ANNEAL_CPU).live_bytes == live0);
    /* caller-owned mode */
    anneal_scope_enter(NULL);
    anneal_tensor *own = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){5});
    anneal_scope_leave();
    CHECK_TRUE(own->_scope == NULL);
    anneal_release(own);
    CHECK_TRUE(anneal_memory_stats_get(ANNEAL_CPU).live_bytes == live0);
}

TEST(memory_limit_gives_oom) {
    anneal_scope *s = anneal_scope_open();
    anneal_memory_stats st = anneal_memory_stats_get(ANNEAL_CPU);
    anneal_memory_set_limit(ANNEAL_CPU, st.live_bytes + 4096);
    anneal_clear_error();
    anneal_tensor *a = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){512});
    CHECK_TRUE(a != NULL);
    anneal_tensor *b = anneal_add(a, a); /* needs another 2 KiB: fits */
    CHECK_TRUE(b != NULL);
    anneal_tensor *c = anneal_mul(a, b); /* over the cap */
    CHECK_TRUE(c == NULL && anneal_last_status() == ANNEAL_ERR_OOM);
    CHECK(strstr(anneal_last_error(), "out of memory") != NULL, "%s", anneal_last_error());
    anneal_memory_set_limit(ANNEAL_CPU, 0);
    anneal_clear_error();
    CHECK_TRUE(anneal_mul(a, b) != NULL);
    anneal_memory_reset_peak(ANNEAL_CPU);
    CHECK_TRUE(anneal_memory_stats_get(ANNEAL_CPU).peak_bytes == anneal_memory_stats_get(ANNEAL_CPU).live_bytes);
    anneal_scope_close(s);
}

TEST(copy_strided_and_convert) {
    anneal_scope *s = anneal_scope_open();
    float v[6] = {1, 2, 3, 4, 5, 6};
    anneal_tensor *x = anneal_from_data(ANNEAL_F32, 2, (int64_t[]){2, 3}, v);
    anneal_tensor *t = anneal_transpose(x, 0, 1);
    anneal_tensor *d = anneal_empty(ANNEAL_BF16, 2, (int64_t[]){3, 2});
    CHECK_TRUE(anneal_copy_(d, t) == ANNEAL_OK);
    float expect[6] = {1, 4, 2, 5, 3, 6};
    for (int k = 0; k < 6; k++) CHECK_NEAR(anneal_item_at(d, k), expect[k], 0);
    anneal_tensor *i64 = anneal_empty(ANNEAL_I64, 2, (int64_t[]){3, 2});
    CHECK_TRUE(anneal_copy_(i64, d) == ANNEAL_OK && anneal_item_at(i64, 5) == 6);
    anneal_tensor *wrong = anneal_empty(ANNEAL_F32, 1, (int64_t[]){6});
    anneal_clear_error();
    CHECK_TRUE(anneal_copy_(wrong, x) == ANNEAL_ERR_SHAPE);
    anneal_clear_error();
    anneal_scope_close(s);
}

int main(void) {
    RUN(philox_known_answers);
    RUN(rng_state_replays);
    RUN(bf16_f16_conversions);
    RUN(tensor_basics_and_errors);
    RUN(scopes_own_and_free);
    RUN(memory_limit_gives_oom);
    RUN(copy_strided_and_convert);
    return anneal_test_summary();
}
