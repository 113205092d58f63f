/* When a kernel's parallel region is worth its team (pool.c's threads).
 *
 * Handing a region to the helper threads costs microseconds when they spin, and a scheduler tick
 * when one of them was descheduled (a 2-core host running the scheduler and a worker's two
 * threads): a tiny model's decode step spent 30% of rank 0's loop in its decoder stack's ten
 * regions a step, each a few thousand multiply-adds. A region of fewer than PARALLEL_MIN_WORK
 * multiply-adds (or their like) runs on the calling thread. Each output is computed by one
 * thread whatever the count, so results do not change. */
#ifndef GUIDESPEC_PARALLEL_H
#define GUIDESPEC_PARALLEL_H
#define PARALLEL_MIN_WORK ((size_t)1 << 18)

/* The chunk of a loop of n items shared by `threads` threads: an eighth of a thread's share.
 * A static split hands each thread its half up front, so a region lasts as long as its slowest
 * thread: where the host's other processes (the scheduler's grammar work on a 2-core host) take a
 * core from one of them for a millisecond, the region waits that millisecond. In chunks taken as
 * threads come free, the other thread takes over the preempted one's share: a batch-64 LM head
 * beside a core another process keeps half busy took 4.9-10.3 ms in halves (mean of 200), 3.0-3.7 ms
 * in chunks (2.3-2.9 ms alone). Each output is still one thread's: results do not change. */
#define PARALLEL_CHUNK(n, threads) ((n) / (8 * (threads)) > 1 ? (n) / (8 * (threads)) : 1)
#endif
