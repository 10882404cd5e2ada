/* One job at a time on a thread of the cache core's own, beside the inference thread (_cache_core.c).
 *
 * Why: a decode step's plan and commit are ~30 us of C at the 397B shape (host_time's GPU path), work
 * whose results the step needs later than it starts them: the plan after the step's first launches and
 * copies up (GpuExperts.begin, ~40 us of Python), the commit only at its reads' landing. A job runs on
 * this thread without the GIL while the inference thread goes on in Python; whoever calls into the core
 * next waits for it first, so the core's state is only ever touched by one thread at a time.
 *
 * The thread spins for a while after each job (WORKER_SPIN_NS), so the next one starts at once instead of
 * after a futex wake and a reschedule, and sleeps on a condition variable past that. A step's jobs come
 * ~30 us and ~150 us apart on the null driver, and a real GPU's layer step is 1-3 ms at the 397B shape;
 * with a 200 us spin the thread slept between steps on host_time's GPU path, and the wake (the signal's
 * syscall on the caller, the thread's reschedule) took back ~10 us of the ~25 us it saves: 182-188 us a
 * step against 174-177 with 2 ms (this 2-vCPU EPYC). So a decode keeps one core busy, and an idle daemon
 * none (2 ms after its last step). Where the process may use only one CPU, jobs run inline on the
 * caller's thread: a spinning thread would only take the caller's core.
 */
#ifndef FOMOE_CORE_WORKER_H
#define FOMOE_CORE_WORKER_H

#include <Python.h>  /* (first: its pyconfig.h sets _GNU_SOURCE, which CPU_COUNT needs) */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

enum { WORKER_IDLE = 0, WORKER_QUEUED = 1, WORKER_DONE = 2 };
#define WORKER_FORKED (-2)     /* worker_wait's rc for a job queued in the parent of a forked child */
#define WORKER_TAKEN (-3)      /* worker_wait's rc where another thread waited for the same job and took it */
#define WORKER_SPIN_NS 2000000 /* the thread's wait for a next job before it sleeps */
#define CALLER_SPIN_NS 50000   /* a caller's wait for a job before it blocks (and lets other Python threads run) */

typedef struct {
    pthread_t thread;
    int started;              /* a thread runs, in process `pid` */
    int inline_only;          /* one CPU: jobs run on the caller's thread */
    pid_t pid;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    atomic_int phase;         /* WORKER_IDLE, _QUEUED (set by the caller), _DONE (set by whoever ran it) */
    atomic_int sleeping, waiting, stop;
    int (*run)(void *);
    void *arg;
    int rc;                   /* the job's: 0, or -1 with its failure kept by the job's owner */
    long long runs;           /* jobs run on the thread (not inline) */
} Worker;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *worker_main(void *arg) {
    Worker *w = arg;
#ifdef __linux__
    pthread_setname_np(pthread_self(), "fomoe-cache");  /* (what `top -H` and /proc call the spinning thread) */
#endif
    for (;;) {
        if (atomic_load(&w->phase) != WORKER_QUEUED) {
            int64_t until = mono_ns() + WORKER_SPIN_NS;
            for (int i = 1; atomic_load(&w->phase) != WORKER_QUEUED && !atomic_load(&w->stop); i++) {
                cpu_relax();
                if (!(i & 63) && mono_ns() > until) break;
            }
            /* sleeping is set under the lock before the last look at phase; the caller sets phase before it
               looks at sleeping: one of the two sees the other's store, so no job waits for a wake */
            pthread_mutex_lock(&w->mu);
            atomic_store(&w->sleeping, 1);
            while (atomic_load(&w->phase) != WORKER_QUEUED && !atomic_load(&w->stop)) pthread_cond_wait(&w->wake, &w->mu);
            atomic_store(&w->sleeping, 0);
            pthread_mutex_unlock(&w->mu);
        }
        if (atomic_load(&w->phase) != WORKER_QUEUED) return NULL;  /* stopped, with no job left */
        w->rc = w->run(w->arg);
        w->runs++;
        atomic_store(&w->phase, WORKER_DONE);
        if (atomic_load(&w->waiting)) {
            pthread_mutex_lock(&w->mu);
            pthread_cond_broadcast(&w->done);
            pthread_mutex_unlock(&w->mu);
        }
    }
}

static int cpus_available(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* the thread, started at the first job (and again in a forked child, where it does not exist); 0 when jobs
   run inline */
static int worker_ready(Worker *w) {
    if (w->inline_only) return 0;
    if (w->started && w->pid == getpid()) return 1;
    if (cpus_available() < 2) {
        w->inline_only = 1;
        return 0;
    }
    /* (in a forked child the parent's thread is gone; its mutex and conditions are set up anew) */
    if (pthread_mutex_init(&w->mu, NULL) || pthread_cond_init(&w->wake, NULL) || pthread_cond_init(&w->done, NULL)) {
        w->inline_only = 1;
        return 0;
    }
    atomic_store(&w->stop, 0), atomic_store(&w->sleeping, 0), atomic_store(&w->waiting, 0);
    if (pthread_create(&w->thread, NULL, worker_main, w)) {
        w->inline_only = 1;  /* no thread to be had: inline from now on */
        w->started = 0;
        return 0;
    }
    w->started = 1, w->pid = getpid();
    return 1;
}

/* run(arg) on the thread (inline where there is none); the worker must be idle */
static void worker_submit(Worker *w, int (*run)(void *), void *arg) {
    w->run = run, w->arg = arg;
    if (!worker_ready(w)) {
        w->rc = run(arg);
        atomic_store(&w->phase, WORKER_DONE);
        return;
    }
    atomic_store(&w->phase, WORKER_QUEUED);
    if (atomic_load(&w->sleeping)) {
        pthread_mutex_lock(&w->mu);
        pthread_cond_signal(&w->wake);
        pthread_mutex_unlock(&w->mu);
    }
}

static inline int worker_busy(Worker *w) { return atomic_load(&w->phase) != WORKER_IDLE; }

/* wait for the job (with the GIL held: spinning, then blocked without it) and return its rc; the worker
   is idle after. Two Python threads may wait at once (the GIL lets the second in while the first is
   blocked): the first to find the job done takes it, the other gets WORKER_TAKEN. */
static int worker_wait(Worker *w) {
    if (atomic_load(&w->phase) == WORKER_QUEUED && w->started && w->pid != getpid()) {
        atomic_store(&w->phase, WORKER_IDLE);  /* forked with a job queued: its thread is the parent's */
        return WORKER_FORKED;
    }
    if (atomic_load(&w->phase) == WORKER_QUEUED) {
        int64_t until = mono_ns() + CALLER_SPIN_NS;
        for (int i = 1; atomic_load(&w->phase) == WORKER_QUEUED; i++) {
            cpu_relax();
            if (!(i & 63) && mono_ns() > until) break;
        }
        if (atomic_load(&w->phase) == WORKER_QUEUED) {
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&w->mu);
            atomic_store(&w->waiting, 1);
            while (atomic_load(&w->phase) == WORKER_QUEUED) pthread_cond_wait(&w->done, &w->mu);
            atomic_store(&w->waiting, 0);
            pthread_mutex_unlock(&w->mu);
            Py_END_ALLOW_THREADS
        }
    }
    int done = WORKER_DONE;
    return atomic_compare_exchange_strong(&w->phase, &done, WORKER_IDLE) ? w->rc : WORKER_TAKEN;
}

/* the thread stopped and joined (the caller has waited for any job first) */
static void worker_close(Worker *w) {
    if (!w->started || w->pid != getpid()) return;
    pthread_mutex_lock(&w->mu);
    atomic_store(&w->stop, 1);
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&w->mu), pthread_cond_destroy(&w->wake), pthread_cond_destroy(&w->done);
    w->started = 0;
}

#endif
