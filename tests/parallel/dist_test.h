/* Shared main() of the distributed tests: runs every test in this process (the
 * single-process communicator, world 1, when no launcher started us), then runs the same
 * binary again as
 *   mpirun -np N --allow-run-as-root --oversubscribe <self>
 * for N = 2 (and 3, 4 where the test asks: dt_main_worlds) with OMP_NUM_THREADS=1 per
 * rank (and OpenMPI's shared-memory single copy off, which containers without ptrace
 * rights lack); each mpirun is a test that fails when any rank fails and is a promised
 * skip without MPI. Under mpirun the tests use the MPI communicator. Header-only. */
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

static int dt_np;              /* ranks of the run dt_mpirun_test starts */
static const char *dt_np_env;  /* "NAME=value" set for that run only, or NULL */

/* Runs this binary under
 *   mpirun -np dt_np --allow-run-as-root --oversubscribe <self>
 * (OpenMPI as root needs the first flag; 3 and 4 ranks on 2 cores need the second) as a
 * test of this process: it fails when any rank fails, and is a promised skip (a failure
 * under ANNEAL_TEST_STRICT=1) when the build has no MPI or mpirun is missing, since
 * scripts/bootstrap.sh installs OpenMPI. */
static void dt_mpirun_test(void) {
    if (!anneal_comm_mpi_available())
        SKIP_PROMISED("%d-rank run: this build has no MPI (bootstrap installs libopenmpi-dev; rebuild)", dt_np);
    if (system("command -v mpirun >/dev/null 2>&1") != 0)
        SKIP_PROMISED("%d-rank run: mpirun not found (bootstrap installs openmpi-bin)", dt_np);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    REQUIRE(n > 0);
    self[n] = 0;
    setenv("OMP_NUM_THREADS", "1", 1);
    /* OpenMPI's own allocations look like leaks to LeakSanitizer; the world-1 run
     * keeps leak checking for anneal's code. */
    if (anneal_test_sanitized()) setenv("ASAN_OPTIONS", "detect_leaks=0", 1);
    char env_name[64] = "";
    if (dt_np_env) {
        const char *eq = strchr(dt_np_env, '=');
        snprintf(env_name, sizeof env_name, "%.*s", (int)(eq - dt_np_env), dt_np_env);
        setenv(env_name, eq + 1, 1);
    }
    char cmd[5000];
    /* vader's single-copy (CMA) needs ptrace rights that containers often lack. */
    snprintf(cmd, sizeof cmd,
             "mpirun -np %d --allow-run-as-root --oversubscribe --timeout 600 -x OMP_NUM_THREADS%s%s "
             "--mca btl_vader_single_copy_mechanism none '%s'",
             dt_np, env_name[0] ? " -x " : "", env_name, self);
    printf("running: %s%s%s\n", dt_np_env ? dt_np_env : "", dt_np_env ? " " : "", cmd);
    fflush(stdout);
    int st = system(cmd);
    if (env_name[0]) unsetenv(env_name);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the %d-rank run failed (status %d)", dt_np, st);
}

/* main() body: the tests run by run_all with g_comm set, in this process (world 1),
 * then, unless this process is a rank itself, the whole binary again under mpirun once
 * per entry of worlds[0..n_worlds) (each run a test of its own: mpirun_np<N>), and with
 * also_thread the 2-rank run once more with ANNEAL_DDP_PROGRESS=thread (the gradient
 * sync's progress thread). A rank exits 0 when it only skipped (mpirun would call 77 a
 * failure). */
static inline int dt_main_worlds(void (*run_all)(void), const int *worlds, int n_worlds, bool also_thread) {
    bool launched = dt_under_launcher();
    g_comm = anneal_comm_init();
    if (!g_comm) {
        printf("FAIL: anneal_comm_init: %s\n", anneal_last_error());
        return 1;
    }
    printf("rank %d of %d (%s)\n", anneal_comm_rank(g_comm), anneal_comm_size(g_comm),
           anneal_comm_backend(g_comm));
    run_all();
    anneal_comm_free(g_comm);
    if (launched) {
        int rc = anneal_test_summary();
        return rc == ANNEAL_TEST_SKIP_CODE ? 0 : rc;
    }
    static char names[8][48];
    for (int i = 0; i < n_worlds && i < 7 && anneal_test_failed == 0; i++) {
        dt_np = worlds[i];
        dt_np_env = NULL;
        snprintf(names[i], sizeof names[i], "mpirun_np%d", worlds[i]);
        anneal_test_run(names[i], dt_mpirun_test);
    }
    if (also_thread && anneal_test_failed == 0) {
        dt_np = 2;
        dt_np_env = "ANNEAL_DDP_PROGRESS=thread";
        anneal_test_run("mpirun_np2_progress_thread", dt_mpirun_test);
    }
    return anneal_test_summary();
}

/* dt_main_worlds with the one 2-rank run. */
static inline int dt_main_ex(void (*run_all)(void), bool also_thread) {
    static const int two[] = {2};
    return dt_main_worlds(run_all, two, 1, also_thread);
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
