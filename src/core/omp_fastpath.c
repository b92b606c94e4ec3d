/* Opt-in: a faster path for one-thread OpenMP regions. Not part of libanneal: the
 * anneal command and its tests link this object (CMake target
 * anneal_omp_fastpath); a program embedding libanneal links it too if it wants it,
 * knowing that it replaces libgomp's GOMP_parallel for the whole process.
 *
 * Why: libgomp gives every parallel region that runs on one thread (an `if` clause that
 * is false, num_threads(1), or OMP_NUM_THREADS=1) a team of its own that it
 * allocates and frees on the spot (it caches only teams of 2+ threads), so each
 * small kernel below its parallel threshold costs a malloc/free pair: hundreds per
 * training step. This object overrides libgomp's GOMP_parallel (the entry
 * GCC calls for `#pragma omp parallel`): a one-thread region outside any other
 * region runs its body directly, as the orphaned constructs OpenMP defines for
 * sequential code (thread 0 of 1, barriers return at once); every other region goes
 * to libgomp through its GOMP_parallel_start / GOMP_parallel_end pair, which is what
 * GOMP_parallel itself does (minus proc_bind clauses, which anneal does not use).
 * GCC + libgomp only; other toolchains call their runtime as usual. */
#include <omp.h>

#if defined(_OPENMP) && defined(__GNUC__) && !defined(__clang__) && !defined(ANNEAL_NO_GOMP_SHIM)
void GOMP_parallel_start(void (*fn)(void *), void *data, unsigned num_threads);
void GOMP_parallel_end(void);
void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
    (void)flags;
    if (omp_get_level() == 0 && (num_threads == 1 || (num_threads == 0 && omp_get_max_threads() == 1))) {
        fn(data);
        return;
    }
    GOMP_parallel_start(fn, data, num_threads);
    fn(data);
    GOMP_parallel_end();
}
#endif
