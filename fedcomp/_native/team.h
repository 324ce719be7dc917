/* fedcomp/_native/team.h: running one body on several threads at once, for the kernels that split
 * work themselves (wire.c's run2, sbc.c's encode_many). Included by each kernel's one .c file.
 *
 * torch's CPU builds run their parallel ops on an OpenMP team whose workers spin for a few
 * milliseconds after each op before they sleep. A thread of our own started right after a torch op
 * shares a core with that spinning worker and runs at half speed; the worker itself, handed the
 * work, starts at once (measured in wire.c: cast + CRC after a `half()` 11.4-11.9 ms on our own
 * thread, 7.1-7.3 ms on the team). So the work runs on the OpenMP runtime already loaded in the
 * process (libgomp's GOMP_parallel, found by name: no link-time dependency) when there is one and
 * the caller allows it, else on POSIX threads of our own.
 *
 * The team must not be used in a process forked after it ran (its workers are gone there and
 * GOMP_parallel hangs): the Python callers pass use_team = 0 when their pid is not the loader's. */
#ifndef FEDCOMP_TEAM_H
#define FEDCOMP_TEAM_H

typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_t)(void);
static gomp_parallel_t GOMP_PARALLEL = NULL;
static omp_int_t OMP_THREAD_NUM = NULL, OMP_NUM_THREADS = NULL;
static int OMP_LOOKED = 0;

#if defined(__linux__) || defined(__APPLE__)
#include <dlfcn.h>
#include <pthread.h>
#define HAVE_DLSYM 1
#define HAVE_PTHREADS 1
#endif

/* Whether the process has an OpenMP runtime loaded (looked up once). */
static inline int omp_found(void) {
#ifdef HAVE_DLSYM
    if (!OMP_LOOKED) {
        GOMP_PARALLEL = (gomp_parallel_t)dlsym(RTLD_DEFAULT, "GOMP_parallel");
        OMP_THREAD_NUM = (omp_int_t)dlsym(RTLD_DEFAULT, "omp_get_thread_num");
        OMP_NUM_THREADS = (omp_int_t)dlsym(RTLD_DEFAULT, "omp_get_num_threads");
        OMP_LOOKED = 1;
    }
#endif
    return GOMP_PARALLEL != NULL && OMP_THREAD_NUM != NULL && OMP_NUM_THREADS != NULL;
}

#ifdef HAVE_PTHREADS
static inline void *team_thread(void *arg) {
    void **pair = arg;
    ((void (*)(void *))pair[0])(pair[1]);
    return NULL;
}
#endif

#define TEAM_MAX 16

/* The next of n tasks a body of team_run takes (`next`: the job's counter, from 0), or -1 when
 * every task is taken: the threads that are there share the tasks in turn. */
static inline Py_ssize_t team_next(Py_ssize_t *next, Py_ssize_t n) {
    Py_ssize_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    return i < n ? i : -1;
}

/* body(arg) on up to `threads` threads at once (at least one), the calling thread one of them
 * (call it with the GIL released). Each call must take its own share of the work (team_next): the
 * runtime may grant fewer threads, down to the calling thread alone, which then does it all. */
static inline void team_run(void (*body)(void *), void *arg, int threads, int use_team) {
    if (threads < 1) threads = 1;
    if (threads > TEAM_MAX) threads = TEAM_MAX;
    if (threads > 1 && use_team && omp_found()) {
        GOMP_PARALLEL(body, arg, (unsigned)threads, 0);
        return;
    }
#ifdef HAVE_PTHREADS
    pthread_t ids[TEAM_MAX];
    void *pair[2] = {(void *)body, arg};
    int started = 0;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&ids[started], NULL, team_thread, pair) == 0) started++;
    body(arg);
    for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
#else
    body(arg);
#endif
}

#endif
