/* The caching allocator: freed storage is reused for the same size class, the
 * statistics add up (reserved = live blocks + cache), the limit still gives
 * ANNEAL_ERR_OOM and empties the cache before it would be crossed, blocks are
 * 64-byte aligned, fresh zeros are not written (so not resident until used), and
 * releasing the cache gives every free block back. */
#include "anneal/anneal.h"
#include "test.h"

#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

static anneal_memory_stats stats(void) { return anneal_memory_stats_get(ANNEAL_CPU); }

/* A caller-owned f32 tensor of n elements. */
static anneal_tensor *owned(int64_t n) {
    anneal_scope_enter(NULL);
    anneal_tensor *t = anneal_empty(ANNEAL_F32, 1, &n);
    anneal_scope_leave();
    return t;
}

TEST(freed_storage_is_reused) {
    anneal_memory_release_cache(ANNEAL_CPU);
    anneal_tensor *a = owned(100000);
    REQUIRE(a);
    void *data = a->storage->data;
    anneal_release(a);
    anneal_memory_stats s0 = stats();
    anneal_tensor *b = owned(100000); /* same class: the same block comes back */
    REQUIRE(b);
    anneal_memory_stats s1 = stats();
    CHECK(b->storage->data == data, "a freed block of the same size was not reused");
    CHECK(s1.n_system_allocs == s0.n_system_allocs, "system allocations %lld -> %lld on a cache hit",
          (long long)s0.n_system_allocs, (long long)s1.n_system_allocs);
    CHECK_TRUE(s1.n_allocs == s0.n_allocs + 1);
    /* A slightly different size in the same class reuses it too (99,000 floats round up
     * to the class of 100,000: both in (2^18, 2^19] bytes, 2^15-byte steps). */
    anneal_release(b);
    anneal_tensor *c = owned(99000);
    REQUIRE(c);
    CHECK(c->storage->data == data, "same-class request did not reuse the block");
    anneal_release(c);
    /* A scope's tensors go back to the cache when it closes. */
    anneal_scope *sc = anneal_scope_open();
    for (int k = 0; k < 4; k++) REQUIRE(anneal_empty(ANNEAL_F32, 1, (int64_t[]){5000}));
    anneal_scope_close(sc);
    anneal_memory_stats s2 = stats();
    sc = anneal_scope_open();
    for (int k = 0; k < 4; k++) REQUIRE(anneal_empty(ANNEAL_F32, 1, (int64_t[]){5000}));
    anneal_scope_close(sc);
    CHECK(stats().n_system_allocs == s2.n_system_allocs, "reopening the same scope allocated %lld blocks",
          (long long)(stats().n_system_allocs - s2.n_system_allocs));
}

TEST(statistics_add_up) {
    anneal_memory_release_cache(ANNEAL_CPU);
    anneal_memory_stats s0 = stats();
    CHECK_TRUE(s0.cached_bytes == 0);
    CHECK_TRUE(s0.reserved_bytes >= s0.live_bytes);
    anneal_memory_reset_peak(ANNEAL_CPU);
    anneal_tensor *a = owned(1000);   /* 4000 B -> 4032 B block (64-byte steps) */
    anneal_tensor *b = owned(300000); /* 1,200,000 B -> 1,310,720 B block (2^20 + 2 * 2^17) */
    REQUIRE(a && b);
    anneal_memory_stats s1 = stats();
    CHECK(s1.live_bytes - s0.live_bytes == 4000 + 1200000, "live grew by %lld",
          (long long)(s1.live_bytes - s0.live_bytes));
    CHECK(s1.reserved_bytes - s0.reserved_bytes == 4032 + 1310720, "reserved grew by %lld",
          (long long)(s1.reserved_bytes - s0.reserved_bytes));
    CHECK_TRUE(s1.peak_bytes == s1.live_bytes && s1.peak_reserved_bytes == s1.reserved_bytes);
    anneal_release(b);
    anneal_memory_stats s2 = stats();
    CHECK_TRUE(s2.live_bytes == s1.live_bytes - 1200000);
    CHECK_TRUE(s2.cached_bytes == 1310720 && s2.reserved_bytes == s1.reserved_bytes);
    CHECK_TRUE(s2.peak_bytes == s1.peak_bytes); /* the peak stays */
    anneal_release(a);
    anneal_memory_stats s3 = stats();
    CHECK_TRUE(s3.live_bytes == s0.live_bytes);
    CHECK_TRUE(s3.cached_bytes == 1310720 + 4032);
    CHECK(s3.reserved_bytes == s3.cached_bytes + s0.reserved_bytes, "reserved %lld, cached %lld, before %lld",
          (long long)s3.reserved_bytes, (long long)s3.cached_bytes, (long long)s0.reserved_bytes);
    anneal_memory_reset_peak(ANNEAL_CPU);
    anneal_memory_stats s4 = stats();
    CHECK_TRUE(s4.peak_bytes == s4.live_bytes && s4.peak_reserved_bytes == s4.reserved_bytes);
    /* Large requests waste at most 1/8: the block of n bytes is < 1.125 n (n > 4 KiB). */
    for (int64_t n = 1025; n < 5000000; n = n * 3 + 7) {
        int64_t r0 = stats().reserved_bytes - stats().cached_bytes;
        anneal_tensor *t = owned(n);
        REQUIRE(t);
        int64_t block = stats().reserved_bytes - stats().cached_bytes - r0;
        CHECK(block >= n * 4 && (double)block < 1.125 * (double)(n * 4) + 64, "%lld bytes got a block of %lld",
              (long long)(n * 4), (long long)block);
        anneal_release(t);
    }
}

TEST(limit_is_enforced_and_empties_the_cache) {
    anneal_memory_release_cache(ANNEAL_CPU);
    anneal_tensor *big = owned(1 << 20); /* 4 MiB, then cached */
    REQUIRE(big);
    anneal_release(big);
    anneal_memory_stats s0 = stats();
    CHECK_TRUE(s0.cached_bytes >= (4 << 20));
    /* Cap live bytes at live + 1 MiB. A 512 KiB tensor fits the cap, but a new block
     * would push reserved (live + the 4 MiB cache) past it: the cache is emptied first. */
    anneal_memory_set_limit(ANNEAL_CPU, s0.live_bytes + (1 << 20));
    anneal_clear_error();
    anneal_tensor *a = owned(128 * 1024);
    CHECK(a != NULL, "%s", anneal_last_error());
    anneal_memory_stats s1 = stats();
    CHECK(s1.cached_bytes == 0, "cache of %lld bytes kept past the limit", (long long)s1.cached_bytes);
    /* Over the cap on live bytes: OOM with a message, nothing allocated. */
    anneal_tensor *b = owned(256 * 1024);
    CHECK_TRUE(b == NULL && anneal_last_status() == ANNEAL_ERR_OOM);
    CHECK(strstr(anneal_last_error(), "limit") != NULL, "%s", anneal_last_error());
    CHECK_TRUE(stats().live_bytes == s1.live_bytes);
    anneal_memory_set_limit(ANNEAL_CPU, 0);
    anneal_clear_error();
    b = owned(256 * 1024);
    CHECK_TRUE(b != NULL);
    anneal_release(a);
    anneal_release(b);
}

TEST(blocks_are_aligned) {
    const int64_t sizes[] = {0, 1, 3, 15, 16, 17, 1000, 1025, 4097, 65537, 300001};
    anneal_tensor *t[sizeof sizes / sizeof sizes[0]];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        anneal_scope_enter(NULL);
        t[i] = anneal_empty(ANNEAL_U8, 1, &sizes[i]);
        anneal_scope_leave();
        REQUIRE(t[i]);
        CHECK((uintptr_t)t[i]->storage->data % 64 == 0, "%lld bytes: data %p is not 64-byte aligned",
              (long long)sizes[i], t[i]->storage->data);
        if (sizes[i]) memset(t[i]->storage->data, 0xab, (size_t)sizes[i]); /* the whole request is usable */
    }
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) anneal_release(t[i]);
    /* zeros() of a reused (dirty) block is still all zero */
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *z = anneal_zeros(ANNEAL_U8, 1, (int64_t[]){300001});
    REQUIRE(z);
    const unsigned char *p = anneal_data(z);
    int64_t bad = 0;
    for (int64_t i = 0; i < 300001; i++) bad += p[i] != 0;
    CHECK(bad == 0, "%lld nonzero bytes in zeros() over a reused block", (long long)bad);
    anneal_scope_close(s);
}

/* Resident bytes of this process (/proc/self/statm), or -1. */
static int64_t resident_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, res = -1;
    if (f) {
        if (fscanf(f, "%ld %ld", &size, &res) != 2) res = -1;
        fclose(f);
    }
    return res < 0 ? -1 : (int64_t)res * sysconf(_SC_PAGESIZE);
}

/* zeros() on a cache miss takes memory the backend hands out zeroed (alloc_zeroed) and
 * does not write it: 64 MiB of zeros do not become resident until used, and read as
 * zeros. */
TEST(fresh_zeros_are_not_written) {
    anneal_memory_release_cache(ANNEAL_CPU);
    int64_t before = resident_bytes();
    /* under a sanitizer its allocator decides what is resident: the values are checked only */
    bool see = before >= 0 && !anneal_test_sanitized();
    const int64_t n = 16 << 20; /* 64 MiB of f32 */
    anneal_tensor *z = owned(0);
    anneal_release(z);
    anneal_scope_enter(NULL);
    z = anneal_zeros(ANNEAL_F32, 1, &n);
    anneal_scope_leave();
    REQUIRE(z);
    int64_t grew = resident_bytes() - before;
    if (see) CHECK(grew < (8 << 20), "64 MiB of fresh zeros made %.1f MiB resident", (double)grew / (1 << 20));
    else printf("    resident memory not checked (%s)\n", before < 0 ? "no /proc/self/statm" : "sanitizer");
    const float *p = anneal_data(z);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i += 1021) bad += p[i] != 0.0f;
    CHECK(bad == 0, "%lld nonzero samples in fresh zeros", (long long)bad);
    anneal_release(z);
}

TEST(release_cache_gives_blocks_back) {
    anneal_tensor *keep = owned(777);
    anneal_tensor *a = owned(50000), *b = owned(2000);
    REQUIRE(keep && a && b);
    anneal_release(a);
    anneal_release(b);
    anneal_memory_stats s0 = stats();
    CHECK_TRUE(s0.cached_bytes > 0);
    int64_t freed = anneal_memory_release_cache(ANNEAL_CPU);
    anneal_memory_stats s1 = stats();
    CHECK(freed >= s0.cached_bytes, "released %lld of %lld cached bytes", (long long)freed, (long long)s0.cached_bytes);
    CHECK_TRUE(s1.cached_bytes == 0 && s1.reserved_bytes == s0.reserved_bytes - s0.cached_bytes);
    CHECK_TRUE(s1.live_bytes == s0.live_bytes);
    memset(anneal_data(keep), 0, 777 * sizeof(float)); /* a live tensor's block is still ours */
    /* after a release the next request is a system allocation again */
    anneal_tensor *c = owned(50000);
    REQUIRE(c);
    CHECK_TRUE(stats().n_system_allocs > s1.n_system_allocs);
    anneal_release(c);
    anneal_release(keep);
    CHECK_TRUE(anneal_memory_stats_get((anneal_device)99).live_bytes == 0); /* bad device: zeros */
    CHECK_TRUE(anneal_memory_release_cache((anneal_device)99) == 0);
}

TEST(headers_and_nodes_are_pooled) {
    /* A graph built, backpropagated and freed twice: the second time takes nothing
     * from the system (tensor headers, storage records, nodes, edges, scopes). */
    anneal_tensor *w = owned(64);
    REQUIRE(w && anneal_set_requires_grad(w, true) == ANNEAL_OK);
    int64_t sys[3];
    for (int round = 0; round < 3; round++) {
        anneal_scope *s = anneal_scope_open();
        anneal_tensor *y = anneal_mul(w, w);
        anneal_tensor *l = anneal_sum(anneal_add(y, w));
        REQUIRE(l && anneal_backward(l) == ANNEAL_OK);
        anneal_scope_close(s);
        anneal_grad_clear(w);
        sys[round] = stats().n_system_allocs;
    }
    CHECK(sys[2] == sys[1], "round 3 took %lld blocks/objects from the system", (long long)(sys[2] - sys[1]));
    anneal_release(w);
}

int main(void) {
    RUN(freed_storage_is_reused);
    RUN(statistics_add_up);
    RUN(limit_is_enforced_and_empties_the_cache);
    RUN(blocks_are_aligned);
    RUN(fresh_zeros_are_not_written);
    RUN(release_cache_gives_blocks_back);
    RUN(headers_and_nodes_are_pooled);
    return anneal_test_summary();
}
