/* Threads: pinning puts each OpenMP worker on one CPU of the allowed set (distinct
 * CPUs while there are enough), and turning it off gives the whole set back; a
 * one-thread parallel region (an `if` clause that is false) runs its body once with
 * thread 0 of 1 and allocates nothing (anneal's GOMP_parallel guard). */
#include "anneal/anneal.h"
#include "test.h"

#include <omp.h>
#include <sched.h>

TEST(pinning_puts_each_worker_on_one_cpu) {
    cpu_set_t allowed;
    REQUIRE(sched_getaffinity(0, sizeof allowed, &allowed) == 0);
    int ncpu = CPU_COUNT(&allowed);
    anneal_set_num_threads(2);
    char desc[64];
    anneal_status st = anneal_set_thread_pinning(true, desc, sizeof desc);
    if (st == ANNEAL_ERR_UNSUPPORTED) SKIP("sched_setaffinity refused here: %s", anneal_last_error());
    REQUIRE(st == ANNEAL_OK);
    int cpu_of[2] = {-1, -1}, count_of[2] = {0, 0};
#pragma omp parallel num_threads(2)
    {
        cpu_set_t mine;
        if (sched_getaffinity(0, sizeof mine, &mine) == 0) {
            int k = omp_get_thread_num();
            count_of[k] = CPU_COUNT(&mine);
            for (int c = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &mine)) cpu_of[k] = c;
        }
    }
    for (int k = 0; k < 2; k++) {
        CHECK(count_of[k] == 1, "worker %d may run on %d CPUs", k, count_of[k]);
        CHECK(cpu_of[k] >= 0 && CPU_ISSET(cpu_of[k], &allowed), "worker %d on CPU %d outside the allowed set", k,
              cpu_of[k]);
    }
    if (ncpu >= 2) CHECK(cpu_of[0] != cpu_of[1], "both workers on CPU %d", cpu_of[0]);
    char expect[32];
    snprintf(expect, sizeof expect, "%d,%d", cpu_of[0], cpu_of[1]);
    CHECK(!strcmp(desc, expect), "description '%s', workers on %s", desc, expect);
    /* kernels still give the right answer on pinned workers */
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *x = anneal_zeros(ANNEAL_F32, 1, (int64_t[]){100000});
    anneal_tensor *y = anneal_add_scalar(x, 2.0f);
    REQUIRE(y);
    CHECK_NEAR(anneal_item_at(y, 99999), 2.0, 0);
    anneal_scope_close(s);
    /* off: every worker gets the whole allowed set back */
    REQUIRE(anneal_set_thread_pinning(false, desc, sizeof desc) == ANNEAL_OK);
    CHECK_TRUE(!strcmp(desc, "off"));
#pragma omp parallel num_threads(2)
    {
        cpu_set_t mine;
        if (sched_getaffinity(0, sizeof mine, &mine) == 0) count_of[omp_get_thread_num()] = CPU_COUNT(&mine);
    }
    CHECK(count_of[0] == ncpu && count_of[1] == ncpu, "after unpinning: %d and %d of %d CPUs", count_of[0],
          count_of[1], ncpu);
}

TEST(one_thread_regions_run_serially) {
    int runs = 0, nth = -1, tid = -1;
    long sum = 0;
    volatile int small = 0;
#pragma omp parallel if (small)
    {
#pragma omp atomic
        runs++;
        nth = omp_get_num_threads();
        tid = omp_get_thread_num();
#pragma omp for schedule(static) reduction(+ : sum)
        for (int i = 0; i < 1000; i++) sum += i;
#pragma omp barrier
    }
    CHECK(runs == 1 && nth == 1 && tid == 0, "runs %d, threads %d, id %d", runs, nth, tid);
    CHECK(sum == 499500, "sum %ld", sum);
    /* a real region still gets its team */
    int team = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        team = omp_get_num_threads();
    }
    CHECK(team == 2, "team of %d", team);
    /* nested one-thread regions inside a team keep their own numbering */
    int inner_ok = 1;
#pragma omp parallel num_threads(2) reduction(&& : inner_ok)
    {
#pragma omp parallel if (small)
        inner_ok = omp_get_num_threads() == 1 && omp_get_thread_num() == 0;
    }
    CHECK_TRUE(inner_ok);
}

int main(void) {
    RUN(one_thread_regions_run_serially);
    RUN(pinning_puts_each_worker_on_one_cpu);
    return anneal_test_summary();
}
