/* Data loader: exact windows in order (shuffle off) on shards of counting tokens
 * 0,1,2,... (so row contents can be asserted exactly), a true permutation per epoch
 * with shuffle on, rank sharding equal to the world=1 order, exact cursor restore
 * across an epoch boundary with and without prefetch, windows across shard
 * boundaries, and every error case. Shards are written with the shard writer into
 * a temporary directory that is removed at the end. */
#include "anneal/loader.h"
#include "anneal/shard.h"
#include "data/permutation.h"
#include "test.h"

#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_root[] = "/tmp/anneal_test_loader_XXXXXX";

/* "<root>/<rel>" in one of 8 rotating buffers. */
static const char *tpath(const char *rel) {
    static char bufs[8][512];
    static int next;
    char *b = bufs[next++ & 7];
    snprintf(b, sizeof bufs[0], "%s/%s", g_root, rel);
    return b;
}

/* Creates the directory <root>/<rel> and returns its path. */
static const char *tdir(const char *rel) {
    const char *p = tpath(rel);
    mkdir(p, 0700);
    return p;
}

/* Writes a shard of the n tokens first, first+1, ... at path. */
static bool write_counting(const char *path, uint32_t vocab, uint64_t fp, int32_t first,
                           int64_t n) {
    anneal_shard_writer *w = NULL;
    if (anneal_shard_writer_open(path, vocab, -1, fp, &w)) return false;
    int32_t buf[256];
    for (int64_t i = 0; i < n;) {
        int64_t k = n - i < 256 ? n - i : 256;
        for (int64_t j = 0; j < k; j++) buf[j] = first + (int32_t)(i + j);
        if (anneal_shard_writer_append(w, buf, (size_t)k)) {
            anneal_shard_writer_abort(w);
            return false;
        }
        i += k;
    }
    return anneal_shard_writer_finish(w) == ANNEAL_OK;
}

static anneal_loader_config cfg_of(int64_t B, int64_t T, uint64_t seed, bool shuffle, int rank,
                                   int world, bool prefetch) {
    anneal_loader_config c = {B, T, seed, shuffle, rank, world, prefetch};
    return c;
}

/* Opens a loader or returns NULL after recording a test failure. */
static anneal_loader *open_or_fail(const char *path, const char *split, anneal_loader_config c) {
    anneal_clear_error();
    anneal_loader *l = NULL;
    anneal_status st = anneal_loader_open(path, split, &c, &l);
    CHECK(st == ANNEAL_OK && l, "open %s (%s): %s %s", path, split ? split : "-",
          anneal_status_name(st), anneal_last_error());
    return st == ANNEAL_OK ? l : NULL;
}

/* Checks that every row of a batch of counting tokens is one window: ids[t] = ids[0] + t,
 * targets[t] = ids[0] + t + 1, ids[0] a multiple of T. Returns false on the first bad row. */
static bool rows_are_windows(const int32_t *ids, const int32_t *tg, int64_t B, int64_t T,
                             int32_t base) {
    for (int64_t b = 0; b < B; b++) {
        const int32_t *r = ids + b * T, *g = tg + b * T;
        if ((r[0] - base) % T != 0) return false;
        for (int64_t t = 0; t < T; t++)
            if (r[t] != r[0] + t || g[t] != r[0] + t + 1) return false;
    }
    return true;
}

/* A counting-token dataset of W windows of T (N = W*T + 1 tokens) in <root>/<name>/train_000.bin. */
static const char *counting_dir(const char *name, uint64_t W, int64_t T) {
    const char *d = tdir(name);
    char file[600];
    snprintf(file, sizeof file, "%s/train_000.bin", d);
    int64_t n = (int64_t)W * T + 1;
    bool ok = write_counting(file, n > 50000 ? (uint32_t)n : 50000, 0xabcdef, 0, n);
    CHECK(ok, "writing %s: %s", file, anneal_last_error());
    return d;
}

/* -------------------------------------------------------------- permutation */

TEST(permutation_is_a_bijection) {
    static const uint64_t sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 100, 1000, 4097, 65537};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        uint64_t n = sizes[k];
        unsigned char *seen = malloc(n);
        REQUIRE(seen);
        for (uint64_t epoch = 0; epoch < 3; epoch++) {
            memset(seen, 0, n);
            anneal_perm p;
            anneal_perm_init(&p, n, 1234, epoch);
            int bad = 0;
            for (uint64_t x = 0; x < n; x++) {
                uint64_t y = anneal_perm_apply(&p, x);
                if (y >= n || seen[y])
                    bad++;
                else
                    seen[y] = 1;
            }
            CHECK(bad == 0, "n=%llu epoch %llu: %d values out of range or repeated",
                  (unsigned long long)n, (unsigned long long)epoch, bad);
        }
        free(seen);
    }
}

TEST(permutation_depends_on_seed_and_epoch) {
    enum { N = 1000 };
    uint64_t a[N], b[N], c[N], d[N];
    anneal_perm pa, pb, pc, pd;
    anneal_perm_init(&pa, N, 7, 0);
    anneal_perm_init(&pb, N, 7, 1);
    anneal_perm_init(&pc, N, 8, 0);
    anneal_perm_init(&pd, N, 7, 0);
    int same_ab = 0, same_ac = 0, fixed = 0, diff_ad = 0;
    for (uint64_t x = 0; x < N; x++) {
        a[x] = anneal_perm_apply(&pa, x);
        b[x] = anneal_perm_apply(&pb, x);
        c[x] = anneal_perm_apply(&pc, x);
        d[x] = anneal_perm_apply(&pd, x);
        same_ab += a[x] == b[x];
        same_ac += a[x] == c[x];
        fixed += a[x] == x;
        diff_ad += a[x] != d[x];
    }
    /* a random permutation agrees with another (or the identity) in ~1 place */
    CHECK(same_ab < 20, "epochs 0 and 1 agree in %d of %d places", same_ab, N);
    CHECK(same_ac < 20, "seeds 7 and 8 agree in %d of %d places", same_ac, N);
    CHECK(fixed < 20, "%d fixed points of %d", fixed, N);
    CHECK(diff_ad == 0, "same seed and epoch differ in %d places", diff_ad);
    /* huge domain (2^40 + 3): values in range, no collisions among 2000 samples */
    anneal_perm ph;
    uint64_t big = ((uint64_t)1 << 40) + 3;
    anneal_perm_init(&ph, big, 99, 5);
    static uint64_t ys[2000];
    int out = 0, dup = 0;
    for (int i = 0; i < 2000; i++) {
        ys[i] = anneal_perm_apply(&ph, (uint64_t)i * 549755813ull % big);
        out += ys[i] >= big;
        for (int j = 0; j < i; j++) dup += ys[j] == ys[i];
    }
    CHECK(out == 0 && dup == 0, "n=2^40+3: %d out of range, %d collisions", out, dup);
}

/* ------------------------------------------------------------- shuffle off */

/* Step s, row b of rank `rank` reads window (s*B*world + rank*B + b) mod W. */
static void check_sequential(int64_t B, int rank, int world, bool prefetch) {
    const int64_t T = 8;
    const uint64_t W = 125; /* not a multiple of B*world: epochs end mid-batch */
    char name[64];
    snprintf(name, sizeof name, "seq_%lld_%d_%d_%d", (long long)B, rank, world, prefetch);
    const char *d = counting_dir(name, W, T);
    anneal_loader *l = open_or_fail(d, "train", cfg_of(B, T, 5, false, rank, world, prefetch));
    if (!l) return;
    CHECK(anneal_loader_windows(l) == W, "windows %llu",
          (unsigned long long)anneal_loader_windows(l));
    int32_t *ids = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
    int bad = 0;
    for (uint64_t s = 0; s < 100; s++) { /* 100*B*world windows: several epochs */
        if (anneal_loader_next(l, ids, tg)) {
            bad++;
            break;
        }
        for (int64_t b = 0; b < B; b++) {
            uint64_t g = s * B * world + rank * B + b, w = g % W;
            for (int64_t t = 0; t < T; t++)
                if (ids[b * T + t] != (int32_t)(w * T + t) ||
                    tg[b * T + t] != (int32_t)(w * T + t + 1))
                    bad++;
        }
        anneal_loader_cursor c = anneal_loader_get_cursor(l);
        uint64_t next = (s + 1) * B * world;
        if (c.epoch != next / W || c.index != next % W || c.step != s + 1) bad++;
    }
    CHECK(bad == 0, "B=%lld rank %d/%d prefetch %d: %d wrong elements or cursors", (long long)B,
          rank, world, prefetch, bad);
    free(ids);
    free(tg);
    anneal_loader_free(l);
}

TEST(shuffle_off_reads_consecutive_windows) {
    check_sequential(3, 0, 1, false);
    check_sequential(3, 0, 1, true);
    check_sequential(3, 1, 2, false);
    check_sequential(4, 2, 3, true);
    check_sequential(1, 0, 1, false);
}

/* One window exactly (N = T+1): W = 1, every row is tokens 0..T, shuffle on or off. */
TEST(single_window) {
    const char *d = counting_dir("one_window", 1, 8);
    for (int sh = 0; sh < 2; sh++) {
        anneal_loader *l = open_or_fail(d, "train", cfg_of(3, 8, 1, sh, 0, 1, sh));
        if (!l) return;
        int32_t ids[24], tg[24];
        int bad = 0;
        for (int s = 0; s < 4; s++) {
            REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK);
            for (int i = 0; i < 24; i++) bad += ids[i] != i % 8 || tg[i] != i % 8 + 1;
        }
        anneal_loader_cursor c = anneal_loader_get_cursor(l);
        CHECK(bad == 0 && c.epoch == 12 && c.index == 0 && c.step == 4,
              "shuffle %d: %d bad, cursor (%llu, %llu, %llu)", sh, bad, (unsigned long long)c.epoch,
              (unsigned long long)c.index, (unsigned long long)c.step);
        anneal_loader_free(l);
    }
}

/* -------------------------------------------------------------- shuffle on */

/* The first n global windows (one rank, world 1, batch B) of a loader over counting tokens. */
static bool served_windows(const char *d, int64_t B, int64_t T, uint64_t seed, bool prefetch,
                           uint64_t *w, uint64_t n) {
    anneal_loader *l = open_or_fail(d, "train", cfg_of(B, T, seed, true, 0, 1, prefetch));
    if (!l) return false;
    int32_t *ids = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
    bool ok = true;
    for (uint64_t g = 0; g < n && ok;) {
        ok = anneal_loader_next(l, ids, tg) == ANNEAL_OK && rows_are_windows(ids, tg, B, T, 0);
        for (int64_t b = 0; b < B && g < n; b++) w[g++] = (uint64_t)ids[b * T] / T;
    }
    free(ids);
    free(tg);
    anneal_loader_free(l);
    return ok;
}

TEST(shuffle_on_is_a_permutation_per_epoch) {
    enum { W = 60, T = 8, E = 3 };
    const char *d = counting_dir("shuffle", W, T);
    uint64_t a[W * E], b[W * E], c[W * E];
    REQUIRE(served_windows(d, 7, T, 42, false, a, W * E)); /* B=7: epochs end mid-batch */
    REQUIRE(served_windows(d, 7, T, 42, true, b, W * E));
    REQUIRE(served_windows(d, 7, T, 43, false, c, W * E));
    for (int e = 0; e < E; e++) {
        int seen[W] = {0}, bad = 0, fixed = 0;
        for (int k = 0; k < W; k++) {
            uint64_t w = a[e * W + k];
            if (w >= W || seen[w]++) bad++;
            fixed += w == (uint64_t)k;
        }
        CHECK(bad == 0, "epoch %d is not a permutation (%d bad)", e, bad);
        CHECK(fixed < W / 3, "epoch %d has %d fixed points: not shuffled", e, fixed);
    }
    int same01 = 0, same12 = 0, same_seed = 0, diff_pref = 0, matches_perm = 0;
    for (int k = 0; k < W; k++) {
        same01 += a[k] == a[W + k];
        same12 += a[W + k] == a[2 * W + k];
        same_seed += a[k] == c[k];
    }
    for (int g = 0; g < W * E; g++) {
        diff_pref += a[g] != b[g];
        anneal_perm p;
        anneal_perm_init(&p, W, 42, (uint64_t)g / W);
        matches_perm += anneal_perm_apply(&p, (uint64_t)g % W) == a[g];
    }
    CHECK(same01 < W / 3 && same12 < W / 3, "epochs agree in %d / %d of %d places", same01, same12,
          W);
    CHECK(same_seed < W / 3, "seeds 42 and 43 agree in %d of %d places", same_seed, W);
    CHECK(diff_pref == 0, "prefetch changes %d windows", diff_pref);
    CHECK(matches_perm == W * E, "only %d of %d windows follow the epoch permutation", matches_perm,
          W * E);
    uint64_t a2[W * E];
    REQUIRE(served_windows(d, 7, T, 42, false, a2, W * E));
    CHECK(memcmp(a, a2, sizeof a) == 0, "same seed, different order");
}

/* ---------------------------------------------------------------- sharding */

/* world ranks of batch B give, step by step, the rows of one world=1 loader of batch B*world. */
static void check_ranks(const char *d, bool shuffle, int world, int64_t B, int steps) {
    const int64_t T = 8;
    anneal_loader *all = open_or_fail(d, "train", cfg_of(B * world, T, 9, shuffle, 0, 1, false));
    anneal_loader *r[4] = {0};
    bool ok = all != NULL;
    for (int k = 0; k < world; k++)
        ok &= (r[k] = open_or_fail(d, "train", cfg_of(B, T, 9, shuffle, k, world, k & 1))) != NULL;
    int32_t *ia = malloc(sizeof(int32_t) * B * world * T),
            *ta = malloc(sizeof(int32_t) * B * world * T);
    int32_t *ir = malloc(sizeof(int32_t) * B * T), *tr = malloc(sizeof(int32_t) * B * T);
    int bad = 0;
    for (int s = 0; s < steps && ok; s++) {
        ok = anneal_loader_next(all, ia, ta) == ANNEAL_OK;
        for (int k = 0; k < world && ok; k++) {
            ok = anneal_loader_next(r[k], ir, tr) == ANNEAL_OK;
            bad += memcmp(ir, ia + k * B * T, sizeof(int32_t) * B * T) != 0;
            bad += memcmp(tr, ta + k * B * T, sizeof(int32_t) * B * T) != 0;
        }
    }
    CHECK(ok && bad == 0, "world %d shuffle %d: %d rank batches differ from the world=1 batch",
          world, shuffle, bad);
    free(ia);
    free(ta);
    free(ir);
    free(tr);
    anneal_loader_free(all);
    for (int k = 0; k < world; k++) anneal_loader_free(r[k]);
}

TEST(ranks_split_the_global_order) {
    enum { W = 60, T = 8 };
    const char *d = counting_dir("ranks", W, T);
    for (int sh = 0; sh < 2; sh++) {
        check_ranks(d, sh, 2, 3, 25); /* 150 windows: crosses two epoch boundaries */
        check_ranks(d, sh, 3, 2, 25);
        check_ranks(d, sh, 4, 5, 7);
    }
    /* one epoch (W = 10 steps x 2 ranks x 3 rows): ranks disjoint, together every window */
    for (int sh = 0; sh < 2; sh++) {
        int owner[W];
        for (int k = 0; k < W; k++) owner[k] = -1;
        int bad = 0;
        for (int rank = 0; rank < 2; rank++) {
            anneal_loader *l = open_or_fail(d, "train", cfg_of(3, T, 3, sh, rank, 2, true));
            if (!l) return;
            int32_t ids[3 * T], tg[3 * T];
            for (int s = 0; s < 10; s++) {
                REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK);
                for (int b = 0; b < 3; b++) {
                    int w = ids[b * T] / T;
                    if (owner[w] != -1) bad++;
                    owner[w] = rank;
                }
            }
            anneal_loader_free(l);
        }
        for (int k = 0; k < W; k++) bad += owner[k] == -1;
        CHECK(bad == 0, "shuffle %d: ranks overlap or miss windows (%d)", sh, bad);
    }
}

/* ------------------------------------------------------------------ cursor */

/* 7 steps, cursor, 5 recorded steps (crossing the epoch end at step 10); a new loader
 * set to the cursor gives the same 5; so does rewinding the first loader. */
static void check_resume(const char *d, bool pf_a, bool pf_b, int rank, int world) {
    enum { T = 8, B = 4 };
    anneal_loader *a = open_or_fail(d, "train", cfg_of(B, T, 77, true, rank, world, pf_a));
    if (!a) return;
    int32_t ids[B * T], tg[B * T], rec_i[5][B * T], rec_t[5][B * T];
    for (int s = 0; s < 7; s++) REQUIRE(anneal_loader_next(a, ids, tg) == ANNEAL_OK);
    anneal_loader_cursor c = anneal_loader_get_cursor(a);
    uint64_t pos = 7ull * B * world, W = anneal_loader_windows(a);
    CHECK(c.epoch == pos / W && c.index == pos % W && c.step == 7, "cursor (%llu, %llu, %llu)",
          (unsigned long long)c.epoch, (unsigned long long)c.index, (unsigned long long)c.step);
    for (int s = 0; s < 5; s++) REQUIRE(anneal_loader_next(a, rec_i[s], rec_t[s]) == ANNEAL_OK);
    CHECK(anneal_loader_get_cursor(a).epoch >= 1, "the 5 steps should cross an epoch boundary");

    anneal_loader *b = open_or_fail(d, "train", cfg_of(B, T, 77, true, rank, world, pf_b));
    if (!b) {
        anneal_loader_free(a);
        return;
    }
    REQUIRE(anneal_loader_next(b, ids, tg) == ANNEAL_OK); /* a prefetched batch to drop */
    REQUIRE(anneal_loader_set_cursor(b, c) == ANNEAL_OK);
    int bad = 0;
    for (int s = 0; s < 5; s++) {
        REQUIRE(anneal_loader_next(b, ids, tg) == ANNEAL_OK);
        bad += memcmp(ids, rec_i[s], sizeof ids) != 0 || memcmp(tg, rec_t[s], sizeof tg) != 0;
    }
    anneal_loader_cursor cb = anneal_loader_get_cursor(b), ca = anneal_loader_get_cursor(a);
    CHECK(bad == 0, "prefetch %d -> %d rank %d/%d: %d of 5 restored batches differ", pf_a, pf_b,
          rank, world, bad);
    CHECK(cb.epoch == ca.epoch && cb.index == ca.index && cb.step == ca.step,
          "cursors differ after replay");
    REQUIRE(anneal_loader_set_cursor(a, c) == ANNEAL_OK); /* rewind in place */
    bad = 0;
    for (int s = 0; s < 5; s++) {
        REQUIRE(anneal_loader_next(a, ids, tg) == ANNEAL_OK);
        bad += memcmp(ids, rec_i[s], sizeof ids) != 0 || memcmp(tg, rec_t[s], sizeof tg) != 0;
    }
    CHECK(bad == 0, "rewind with prefetch %d: %d of 5 batches differ", pf_a, bad);
    anneal_loader_free(a);
    anneal_loader_free(b);
}

TEST(cursor_restores_the_next_batches) {
    const char *d = counting_dir("cursor", 40, 8); /* W=40, B=4: an epoch is 10 steps */
    for (int pa = 0; pa < 2; pa++)
        for (int pb = 0; pb < 2; pb++) check_resume(d, pa, pb, 0, 1);
    check_resume(d, true, false, 1, 2);
    check_resume(d, false, true, 0, 3);
}

/* The cursor is a data position: a run resumed with another batch size continues with
 * the windows that followed (B=4 -> B=2: two small batches = the next big one). */
TEST(cursor_is_a_data_position) {
    const char *d = counting_dir("cursor_b", 40, 8);
    anneal_loader *a = open_or_fail(d, "train", cfg_of(4, 8, 5, true, 0, 1, false));
    anneal_loader *b = open_or_fail(d, "train", cfg_of(2, 8, 5, true, 0, 1, true));
    if (!a || !b) {
        anneal_loader_free(a);
        anneal_loader_free(b);
        return;
    }
    int32_t ia[32], ta[32], ib[32], tb[32];
    for (int s = 0; s < 9; s++) REQUIRE(anneal_loader_next(a, ia, ta) == ANNEAL_OK);
    REQUIRE(anneal_loader_set_cursor(b, anneal_loader_get_cursor(a)) == ANNEAL_OK);
    int bad = 0;
    for (int s = 0; s < 3; s++) { /* crosses the epoch end at 40 windows */
        REQUIRE(anneal_loader_next(a, ia, ta) == ANNEAL_OK);
        REQUIRE(anneal_loader_next(b, ib, tb) == ANNEAL_OK);
        REQUIRE(anneal_loader_next(b, ib + 16, tb + 16) == ANNEAL_OK);
        bad += memcmp(ia, ib, sizeof ia) != 0 || memcmp(ta, tb, sizeof ta) != 0;
    }
    CHECK(bad == 0, "%d of 3 steps differ after changing B", bad);
    anneal_loader_free(a);
    anneal_loader_free(b);
}

/* Prefetch on and off give the same sequence, also around set_cursor; freeing with a
 * job in flight (right after open or set_cursor) is clean. */
TEST(prefetch_gives_the_same_sequence) {
    const char *d = counting_dir("prefetch", 50, 8);
    anneal_loader *l[2];
    for (int p = 0; p < 2; p++) l[p] = open_or_fail(d, "train", cfg_of(6, 8, 11, true, 1, 2, p));
    if (!l[0] || !l[1]) return;
    int32_t ids[2][48], tg[2][48];
    int bad = 0;
    anneal_loader_cursor saved = {0, 0, 0};
    for (int s = 0; s < 60; s++) {
        if (s == 5) saved = anneal_loader_get_cursor(l[1]);
        if (s == 30 || s == 45) /* jump back, several times in a row on the prefetching one */
            for (int p = 0; p < 2; p++)
                for (int k = 0; k < 3; k++)
                    REQUIRE(anneal_loader_set_cursor(l[p], saved) == ANNEAL_OK);
        for (int p = 0; p < 2; p++) REQUIRE(anneal_loader_next(l[p], ids[p], tg[p]) == ANNEAL_OK);
        bad +=
            memcmp(ids[0], ids[1], sizeof ids[0]) != 0 || memcmp(tg[0], tg[1], sizeof tg[0]) != 0;
        bad += !rows_are_windows(ids[1], tg[1], 6, 8, 0);
    }
    CHECK(bad == 0, "%d of 60 batches differ between prefetch off and on", bad);
    anneal_loader_free(l[0]);
    anneal_loader_free(l[1]);
    for (int k = 0; k < 20; k++) {
        anneal_loader *q = open_or_fail(d, "train", cfg_of(6, 8, 11, true, 0, 1, true));
        if (!q) return;
        if (k & 1) {
            anneal_loader_cursor c = {3, 7, 100};
            REQUIRE(anneal_loader_set_cursor(q, c) == ANNEAL_OK);
        }
        anneal_loader_free(q);
    }
}

/* set_cursor while the worker is still filling a large batch: the stale batch must be
 * dropped. Every batch is compared with a non-prefetching loader set to the same cursor. */
TEST(prefetch_drops_stale_batches) {
    enum { B = 64, T = 512, W = 300 };
    const char *d = counting_dir("stale", W, T);
    anneal_loader *p = open_or_fail(d, "train", cfg_of(B, T, 21, true, 0, 1, true));
    anneal_loader *q = open_or_fail(d, "train", cfg_of(B, T, 21, true, 0, 1, false));
    int32_t *buf = malloc(sizeof(int32_t) * B * T * 4);
    if (!p || !q || !buf) {
        anneal_loader_free(p);
        anneal_loader_free(q);
        free(buf);
        REQUIRE(false);
    }
    int32_t *ip = buf, *tp = buf + B * T, *iq = buf + 2 * B * T, *tq = buf + 3 * B * T;
    int bad = 0;
    for (uint64_t k = 0; k < 150; k++) {
        anneal_loader_cursor c = {k % 5, (k * 37) % W, k};
        if (anneal_loader_next(p, ip, tp)) bad++; /* posts a job, then we jump at once */
        if (anneal_loader_set_cursor(p, c) || anneal_loader_set_cursor(q, c)) bad++;
        if (k % 3 == 0 && anneal_loader_set_cursor(p, c)) bad++; /* twice in a row */
        if (anneal_loader_next(p, ip, tp) || anneal_loader_next(q, iq, tq)) bad++;
        bad += memcmp(ip, iq, sizeof(int32_t) * B * T) != 0 ||
               memcmp(tp, tq, sizeof(int32_t) * B * T) != 0;
    }
    CHECK(bad == 0, "%d of 150 batches after set_cursor differ from the synchronous loader", bad);
    free(buf);
    anneal_loader_free(p);
    anneal_loader_free(q);
}

/* ------------------------------------------------------------ shard layout */

TEST(windows_cross_shard_boundaries) {
    const char *d = tdir("multi");
    char f[4][600];
    snprintf(f[0], sizeof f[0], "%s/train_002.bin", d); /* written first: order comes from names */
    snprintf(f[1], sizeof f[1], "%s/train_001.bin", d);
    snprintf(f[2], sizeof f[2], "%s/train_000.bin", d);
    snprintf(f[3], sizeof f[3], "%s/val_000.bin", d);
    REQUIRE(write_counting(f[0], 50000, 1, 103, 148)); /* 103..250 */
    REQUIRE(write_counting(f[1], 50000, 1, 100, 3));   /* 100..102: a window spans 3 shards */
    REQUIRE(write_counting(f[2], 50000, 1, 0, 100));   /* 0..99 */
    REQUIRE(write_counting(f[3], 50000, 1, 9000, 50)); /* another split, ignored */
    REQUIRE(write_counting(tpath("multi/xtrain_000.bin"), 50000, 2, 0, 10));
    FILE *junk = fopen(tpath("multi/train_notes.txt"), "w");
    if (junk) fclose(junk);

    enum { T = 7, B = 5 }; /* N = 251: W = 35 = 7 steps of 5 */
    anneal_loader *l = open_or_fail(d, "train", cfg_of(B, T, 0, false, 0, 1, false));
    if (!l) return;
    CHECK(anneal_loader_windows(l) == 35, "windows %llu",
          (unsigned long long)anneal_loader_windows(l));
    int32_t ids[B * T], tg[B * T];
    int bad = 0;
    for (int s = 0; s < 7; s++) {
        REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                int32_t w = s * B + b;
                bad += ids[b * T + t] != w * T + t || tg[b * T + t] != w * T + t + 1;
            }
    }
    CHECK(bad == 0, "%d wrong tokens across shard boundaries (window 14 = tokens 98..105)", bad);
    anneal_loader_free(l);

    l = open_or_fail(d, "train", cfg_of(B, T, 4, true, 0, 1, true));
    if (!l) return;
    bad = 0;
    for (int s = 0; s < 14; s++) {
        REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK);
        bad += !rows_are_windows(ids, tg, B, T, 0);
    }
    CHECK(bad == 0, "shuffled rows are not windows");
    anneal_loader_free(l);

    l = open_or_fail(d, "val", cfg_of(2, 7, 0, false, 0, 1, false)); /* val: 9000..9049, W = 7 */
    if (!l) return;
    CHECK(anneal_loader_windows(l) == 7, "val windows %llu",
          (unsigned long long)anneal_loader_windows(l));
    REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK);
    CHECK(ids[0] == 9000 && ids[7] == 9007 && tg[13] == 9014, "val batch %d %d %d", ids[0], ids[7],
          tg[13]);
    anneal_loader_free(l);
}

/* A single file path (split ignored), with 32-bit token ids (vocab > 65536). */
TEST(single_file_and_wide_ids) {
    const char *f = tpath("wide.bin");
    REQUIRE(write_counting(f, 100000, 0x77, 70000, 9 * 4 + 1));
    anneal_loader *l = open_or_fail(f, NULL, cfg_of(2, 9, 0, false, 0, 1, true));
    if (!l) return;
    CHECK(anneal_loader_windows(l) == 4 && anneal_loader_vocab_size(l) == 100000 &&
              anneal_loader_fingerprint(l) == 0x77,
          "windows %llu vocab %u fingerprint %llx", (unsigned long long)anneal_loader_windows(l),
          anneal_loader_vocab_size(l), (unsigned long long)anneal_loader_fingerprint(l));
    int32_t ids[18], tg[18];
    REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK);
    REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK); /* windows 2, 3 */
    CHECK(ids[0] == 70018 && ids[9] == 70027 && tg[17] == 70036, "ids %d %d, last target %d",
          ids[0], ids[9], tg[17]);
    anneal_loader_free(l);
}

/* ------------------------------------------------------------------ errors */

/* Opens and expects failure with `code` and every needle in the message. */
static void expect_open_error(const char *path, const char *split, anneal_loader_config c,
                              anneal_status code, const char *n1, const char *n2) {
    anneal_clear_error();
    anneal_loader *l = (anneal_loader *)&c; /* must be reset to NULL */
    anneal_status st = anneal_loader_open(path, split, &c, &l);
    const char *msg = anneal_last_error();
    CHECK(st == code && l == NULL, "%s (%s): got %s, want %s (%s)", path ? path : "(null)",
          split ? split : "-", anneal_status_name(st), anneal_status_name(code), msg);
    CHECK(!n1 || strstr(msg, n1), "message '%s' lacks '%s'", msg, n1);
    CHECK(!n2 || strstr(msg, n2), "message '%s' lacks '%s'", msg, n2);
    if (st == ANNEAL_OK) anneal_loader_free(l);
    anneal_clear_error();
}

/* Path of the file part of p (after the last '/'). */
static const char *base(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

TEST(open_errors) {
    anneal_loader_config ok = cfg_of(2, 8, 0, true, 0, 1, false);
    const char *d = counting_dir("errors", 10, 8);
    const char *missing = tpath("no_such_dir");
    expect_open_error(missing, "train", ok, ANNEAL_ERR_IO, missing, NULL);
    expect_open_error(d, "test", ok, ANNEAL_ERR_IO, d, "'test'");
    expect_open_error(d, NULL, ok, ANNEAL_ERR_ARG, d, NULL);
    expect_open_error(d, "train", cfg_of(0, 8, 0, true, 0, 1, false), ANNEAL_ERR_ARG, "B=0", NULL);
    expect_open_error(d, "train", cfg_of(-2, 8, 0, true, 0, 1, false), ANNEAL_ERR_ARG, "B=-2",
                      NULL);
    expect_open_error(d, "train", cfg_of(2, 0, 0, true, 0, 1, false), ANNEAL_ERR_ARG, "T=0", NULL);
    expect_open_error(d, "train", cfg_of(2, -1, 0, true, 0, 1, false), ANNEAL_ERR_ARG, "T=-1",
                      NULL);
    expect_open_error(d, "train", cfg_of(2, 8, 0, true, 2, 2, false), ANNEAL_ERR_ARG, "rank 2",
                      "world=2");
    expect_open_error(d, "train", cfg_of(2, 8, 0, true, -1, 2, false), ANNEAL_ERR_ARG, "rank -1",
                      NULL);
    expect_open_error(d, "train", cfg_of(2, 8, 0, true, 0, 0, false), ANNEAL_ERR_ARG, "world=0",
                      NULL);
    expect_open_error(NULL, "train", ok, ANNEAL_ERR_ARG, NULL, NULL);
    expect_open_error(d, "train", cfg_of(2, 81, 0, true, 0, 1, false), ANNEAL_ERR_ARG, "81 tokens",
                      "82");

    /* too few tokens, over two shards */
    const char *few = tdir("few");
    REQUIRE(write_counting(tpath("few/train_0.bin"), 100, 3, 0, 3));
    REQUIRE(write_counting(tpath("few/train_1.bin"), 100, 3, 3, 2));
    expect_open_error(few, "train", ok, ANNEAL_ERR_ARG, "5 tokens", "9");

    /* fingerprint and vocab mismatches name both files */
    tdir("fp");
    REQUIRE(write_counting(tpath("fp/train_0.bin"), 100, 3, 0, 40));
    REQUIRE(write_counting(tpath("fp/train_1.bin"), 100, 4, 0, 40));
    expect_open_error(tpath("fp"), "train", ok, ANNEAL_ERR_FORMAT, "train_0.bin", "train_1.bin");
    tdir("vocab");
    REQUIRE(write_counting(tpath("vocab/train_0.bin"), 100, 3, 0, 40));
    REQUIRE(write_counting(tpath("vocab/train_1.bin"), 200, 3, 0, 40));
    expect_open_error(tpath("vocab"), "train", ok, ANNEAL_ERR_FORMAT, "train_0.bin", "train_1.bin");

    /* a corrupted (one token byte flipped) and a truncated shard: the shard reader's error, naming it */
    tdir("bad");
    const char *good = tpath("bad/train_0.bin"), *bad = tpath("bad/train_1.bin");
    REQUIRE(write_counting(good, 100, 3, 0, 40));
    REQUIRE(write_counting(bad, 100, 3, 0, 40));
    FILE *fp = fopen(bad, "r+b");
    REQUIRE(fp);
    fseek(fp, -2, SEEK_END);
    int ch = fgetc(fp);
    fseek(fp, -2, SEEK_END);
    fputc(ch ^ 0x01, fp); /* the id stays < vocab: only the checksum can tell */
    fclose(fp);
    anneal_clear_error();
    anneal_loader *l = NULL;
    anneal_status st = anneal_loader_open(tpath("bad"), "train", &ok, &l);
    CHECK(st != ANNEAL_OK && l == NULL && strstr(anneal_last_error(), base(bad)),
          "corrupted shard: %s '%s'", anneal_status_name(st), anneal_last_error());
    anneal_loader_free(l);
    REQUIRE(truncate(bad, 20) == 0);
    anneal_clear_error();
    st = anneal_loader_open(bad, NULL, &ok, &l);
    CHECK(st != ANNEAL_OK && l == NULL && strstr(anneal_last_error(), base(bad)),
          "truncated shard: %s '%s'", anneal_status_name(st), anneal_last_error());
    anneal_loader_free(l);
    anneal_clear_error();
}

TEST(call_errors) {
    const char *d = counting_dir("call_errors", 10, 8);
    for (int p = 0; p < 2; p++) {
        anneal_loader *l = open_or_fail(d, "train", cfg_of(2, 8, 0, true, 0, 1, p));
        if (!l) return;
        int32_t ids[16], tg[16];
        anneal_clear_error();
        anneal_loader_cursor c = {0, 10, 0}; /* index == W */
        CHECK(anneal_loader_set_cursor(l, c) == ANNEAL_ERR_ARG && strstr(anneal_last_error(), "10"),
              "bad cursor: '%s'", anneal_last_error());
        anneal_loader_cursor c0 = anneal_loader_get_cursor(l);
        CHECK(c0.epoch == 0 && c0.index == 0 && c0.step == 0, "a rejected cursor moved the loader");
        anneal_clear_error();
        CHECK(anneal_loader_next(l, NULL, tg) == ANNEAL_ERR_ARG, "NULL ids accepted");
        anneal_clear_error();
        CHECK(anneal_loader_next(NULL, ids, tg) == ANNEAL_ERR_ARG, "NULL loader accepted");
        anneal_clear_error();
        REQUIRE(anneal_loader_next(l, ids, tg) == ANNEAL_OK);
        anneal_loader_free(l);
    }
    anneal_clear_error();
    CHECK(anneal_loader_set_cursor(NULL, (anneal_loader_cursor){0, 0, 0}) == ANNEAL_ERR_ARG,
          "NULL loader");
    anneal_clear_error();
    anneal_loader_free(NULL);
    CHECK(anneal_loader_windows(NULL) == 0, "windows of NULL");
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

int main(void) {
    if (!mkdtemp(g_root)) {
        fprintf(stderr, "cannot create a temporary directory\n");
        return 1;
    }
    RUN(permutation_is_a_bijection);
    RUN(permutation_depends_on_seed_and_epoch);
    RUN(shuffle_off_reads_consecutive_windows);
    RUN(single_window);
    RUN(shuffle_on_is_a_permutation_per_epoch);
    RUN(ranks_split_the_global_order);
    RUN(cursor_restores_the_next_batches);
    RUN(cursor_is_a_data_position);
    RUN(prefetch_gives_the_same_sequence);
    RUN(prefetch_drops_stale_batches);
    RUN(windows_cross_shard_boundaries);
    RUN(single_file_and_wide_ids);
    RUN(open_errors);
    RUN(call_errors);
    nftw(g_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return anneal_test_summary();
}
