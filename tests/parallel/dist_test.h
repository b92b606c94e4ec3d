/* Shared main() of the distributed tests: runs every test in this process (the
 * single-process communicator, world 1, when no launcher started us), then, when the
 * build has MPI and mpirun exists, runs the same binary again as
 *   mpirun -np 2 --allow-run-as-root --oversubscribe <self>
 * with OMP_NUM_THREADS=1 per rank (and OpenMPI's shared-memory single copy off, which
 * containers without ptrace rights lack), and fails when any rank fails. Under mpirun the
 * tests use the MPI communicator (world 2). Header-only. */
#ifndef ANNEAL_TESTS_DIST_TEST_H
#define ANNEAL_TESTS_DIST_TEST_H

#include "anneal/anneal.h"
#include "anneal/parallel.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static anneal_comm *g_comm; /* the communicator every test uses */

static inline bool dt_under_launcher(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

/* Runs this binary under mpirun with 2 ranks; 0 when every rank passed (or mpirun is
 * not there: skipped with a message). */
static inline int dt_relaunch(void) {
    if (!anneal_comm_mpi_available()) {
        printf("SKIP 2-rank run: this build has no MPI (install libopenmpi-dev)\n");
        return 0;
    }
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        printf("SKIP 2-rank run: mpirun not found (install openmpi-bin)\n");
        return 0;
    }
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        printf("FAIL: cannot find this executable for mpirun\n");
        return 1;
    }
    self[n] = 0;
    setenv("OMP_NUM_THREADS", "1", 1);
    /* OpenMPI's own allocations look like leaks to LeakSanitizer; the world-1 run
     * above keeps leak checking for anneal's code. */
    if (anneal_test_sanitized()) setenv("ASAN_OPTIONS", "detect_leaks=0", 1);
    char cmd[5000];
    /* vader's single-copy (CMA) needs ptrace rights that containers often lack. */
    snprintf(cmd, sizeof cmd,
             "mpirun -np 2 --allow-run-as-root --oversubscribe --timeout 600 -x OMP_NUM_THREADS "
             "--mca btl_vader_single_copy_mechanism none '%s'", self);
    printf("running: %s\n", cmd);
    fflush(stdout);
    int st = system(cmd);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
        printf("FAIL: the 2-rank run failed (status %d)\n", st);
        return 1;
    }
    printf("2-rank run passed\n");
    return 0;
}

/* main() body: tests run by run_all with g_comm set; with also_thread the 2-rank run
 * is repeated with ANNEAL_DDP_PROGRESS=thread (the gradient sync's progress thread). */
static inline int dt_main_ex(void (*run_all)(void), bool also_thread) {
    bool launched = dt_under_launcher();
    g_comm = anneal_comm_init();
    if (!g_comm) {
        printf("FAIL: anneal_comm_init: %s\n", anneal_last_error());
        return 1;
    }
    printf("rank %d of %d (%s)\n", anneal_comm_rank(g_comm), anneal_comm_size(g_comm),
           anneal_comm_backend(g_comm));
    run_all();
    int rc = anneal_test_summary();
    anneal_comm_free(g_comm);
    if (!launched && rc == 0) rc = dt_relaunch();
    if (!launched && rc == 0 && also_thread) {
        printf("again with ANNEAL_DDP_PROGRESS=thread\n");
        setenv("ANNEAL_DDP_PROGRESS", "thread", 1);
        rc = dt_relaunch();
    }
    return rc;
}

static inline int dt_main(void (*run_all)(void)) { return dt_main_ex(run_all, false); }

static inline int dt_rank(void) { return anneal_comm_rank(g_comm); }
static inline int dt_world(void) { return anneal_comm_size(g_comm); }

/* True on every rank when ok is true on every rank (a min-reduction through a sum), so
 * a failure on one rank makes all ranks stop before the next collective. */
static inline bool dt_all(bool ok) {
    float v = ok ? 1.0f : 0.0f;
    if (anneal_comm_allreduce(g_comm, &v, 1, ANNEAL_F32, ANNEAL_REDUCE_SUM) != ANNEAL_OK) return false;
    return v == (float)dt_world();
}

#endif
