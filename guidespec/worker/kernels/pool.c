/* The kernels' own thread pool (pool.h).
 *
 * Why: OpenMP's helper threads spin for milliseconds after each parallel region (libgomp's
 * default) so that the next region starts at once. In the engine rank 0 runs a step's regions
 * and then waits: for the scheduler's next inputs, or for a bitmask the scheduler is still
 * filling. On a 2-core host its spinning helper took the core the scheduler needed for exactly
 * that work: the tiny model's decoder stack cost 0.40-0.50 ms at 64 rows alone and 1.4-1.9 ms
 * as the engine's "forward" span, and OMP_WAIT_POLICY=PASSIVE (a sleep after every region) won
 * 30% at batch 1 and lost 15% at batch 64, where a step has ~20 regions. Here the helpers spin
 * between regions as OpenMP's do, and sleep as soon as the caller says it is about to wait
 * (pool_park, from the worker's loop), or after a millisecond without a region
 * (pool_set_spin_us); the next region wakes them (the caller starts on its chunks meanwhile).
 * A helper left out of a region's team (a smaller `threads`: the worker's core_share.py gives a
 * core back to the scheduler) sleeps at once, not spinning on the core it was left out to free.
 *
 * A loop's items are handed out in chunks from one counter, (generation << 32 | next item): a
 * thread takes a chunk with one compare-and-swap, which fails if the loop it read is no longer
 * the current one, so a late helper never runs a chunk of a finished loop (nor of the next,
 * whose fields it may have read half-written: pool_for). The caller returns
 * when the finished items count n; each item is run by exactly one thread, in the same way
 * whichever, so results do not depend on the number of threads or on who ran what.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "pool.h"

#define MAX_HELPERS 255

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ volatile("yield")
#else
#define RELAX() ((void)0)
#endif

static _Atomic uint64_t counter;  /* generation << 32 | the next item of that generation's loop */
static _Atomic(pool_task) job_task;
static _Atomic(void*) job_ctx;
static _Atomic int job_n, job_chunk, job_team;
static _Atomic int finished;      /* items of the current loop done */
static _Atomic unsigned parks;    /* pool_park calls */
static _Atomic int sleepers;      /* helpers asleep on `bell` */
static _Atomic long spin_ns = 1000000;  /* a helper's spin after a region when nobody parks it */
static int helpers;               /* started (under `caller`) */
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;  /* one loop at a time */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t bell = PTHREAD_COND_INITIALIZER;
static _Thread_local int in_task;  /* a task's thread: a loop inside it runs on that thread */

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Chunks of generation gen's loop run on this thread until none is left (or the loop is gone) */
static void run_chunks(uint32_t gen, int thread) {
    uint64_t v = atomic_load_explicit(&counter, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen) return;
        int n = atomic_load_explicit(&job_n, memory_order_relaxed);
        int chunk = atomic_load_explicit(&job_chunk, memory_order_relaxed);
        pool_task task = atomic_load_explicit(&job_task, memory_order_relaxed);
        void* ctx = atomic_load_explicit(&job_ctx, memory_order_relaxed);
        /* (the fields before the swap: it succeeds only if they were this loop's, see pool_for) */
        atomic_thread_fence(memory_order_acquire);
        uint32_t begin = (uint32_t)v;
        if (begin >= (uint32_t)n) return;
        if (!atomic_compare_exchange_weak(&counter, &v, v + (uint64_t)chunk)) continue;
        int end = n - (int)begin < chunk ? n : (int)begin + chunk;
        task(ctx, (int)begin, end, thread);
        atomic_fetch_add_explicit(&finished, end - (int)begin, memory_order_release);
        v = atomic_load_explicit(&counter, memory_order_acquire);
    }
}

static void* helper_main(void* arg) {
    int id = (int)(intptr_t)arg;
    in_task = 1;
    uint32_t seen = (uint32_t)(atomic_load(&counter) >> 32);
    unsigned awake_since = atomic_load(&parks);
    long idle_from = now_ns();
    int benched = 0;  /* left out of the last loop's team: it sleeps until the next loop */
    for (unsigned spins = 0;; spins++) {
        uint32_t gen = (uint32_t)(atomic_load(&counter) >> 32);
        if (gen != seen && !(gen & 1)) {  /* (odd: the next loop's fields are being written) */
            seen = gen;
            awake_since = atomic_load(&parks);  /* (a park before this loop is not for after it) */
            benched = id >= atomic_load_explicit(&job_team, memory_order_relaxed);
            if (!benched) run_chunks(gen, id);
            idle_from = now_ns();
            continue;
        }
        long spin = atomic_load_explicit(&spin_ns, memory_order_relaxed);
        if (benched || atomic_load_explicit(&parks, memory_order_relaxed) != awake_since ||
            (spins % 256 == 0 && now_ns() - idle_from > spin)) {
            benched = 0;
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleepers, 1);
            while ((uint32_t)(atomic_load(&counter) >> 32) == seen) pthread_cond_wait(&bell, &lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&lock);
            continue;
        }
        RELAX();
    }
    return 0;
}

static void start_helpers(int wanted) {
    if (wanted > MAX_HELPERS) wanted = MAX_HELPERS;
    sigset_t all, old;
    sigfillset(&all);  /* (signals stay the caller's: Python's handlers run on its main thread) */
    int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};  /* (a fault's handler, faulthandler's, still runs) */
    for (size_t i = 0; i < sizeof faults / sizeof *faults; i++) sigdelset(&all, faults[i]);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (helpers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper_main, (void*)(intptr_t)(helpers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;  /* (fewer helpers: the loops still finish, on fewer threads) */
        pthread_setname_np(thread, "gs-kernels");  /* (as top and py-spy show it) */
        helpers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, 0);
}

static void after_fork(void) {  /* the child has none of the parent's helpers */
    pthread_mutex_init(&caller, 0);
    pthread_mutex_init(&lock, 0);
    pthread_cond_init(&bell, 0);
    helpers = 0;
    atomic_store(&sleepers, 0);
}

__attribute__((constructor)) static void register_fork(void) { pthread_atfork(0, 0, after_fork); }

void pool_for(int n, int chunk, int threads, int parallel, pool_task task, void* ctx) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    if (!parallel || threads < 2 || n <= chunk || in_task || pthread_mutex_trylock(&caller)) {
        task(ctx, 0, n, 0);  /* (a loop inside a task, or beside another caller's: this thread's) */
        return;
    }
    if (helpers < threads - 1) start_helpers(threads - 1);
    /* The generation goes odd while the loop's fields are written, even when they are: a helper
       that read the last loop's counter (finished, its next item at its end) and then this loop's
       n would otherwise take a chunk past the last loop's end, under this loop's task, and count
       it towards this loop's items. Odd, the counter matches no helper's stale value and offers
       no chunk; the fence orders it before the fields, so a helper that read any of them fails
       its swap (run_chunks' fence). */
    uint32_t gen = (uint32_t)(atomic_load(&counter) >> 32) + 2;  /* (even) */
    atomic_store_explicit(&counter, (uint64_t)(gen - 1) << 32, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&job_task, task, memory_order_relaxed);
    atomic_store_explicit(&job_ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&job_n, n, memory_order_relaxed);
    atomic_store_explicit(&job_chunk, chunk, memory_order_relaxed);
    atomic_store_explicit(&job_team, threads, memory_order_relaxed);
    atomic_store_explicit(&finished, 0, memory_order_relaxed);
#ifdef POOL_PUBLISH_DELAY_NS /* (tests: widens the window in which a late helper meets the next loop's fields) */
    for (long until = now_ns() + POOL_PUBLISH_DELAY_NS; now_ns() < until;) RELAX();
#endif
    atomic_store(&counter, (uint64_t)gen << 32);  /* the loop is on: (its fields before it) */
    if (atomic_load(&sleepers)) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&bell);
        pthread_mutex_unlock(&lock);
    }
    in_task = 1;
    run_chunks(gen, 0);
    in_task = 0;
    while (atomic_load_explicit(&finished, memory_order_acquire) < n) RELAX();  /* chunks other threads hold */
    pthread_mutex_unlock(&caller);
}

void pool_park(void) { atomic_fetch_add(&parks, 1); }

void pool_set_spin_us(long us) { atomic_store(&spin_ns, us * 1000); }
