/* The kernels' own thread pool: a parallel loop's chunks shared by the calling thread and helper
 * threads that spin between regions only while the caller is in a step (pool.c says why). */
#ifndef GUIDESPEC_POOL_H
#define GUIDESPEC_POOL_H

/* items [begin, end) of a loop, run by thread `thread` (0: the caller; < the loop's threads) */
typedef void (*pool_task)(void* ctx, int begin, int end, int thread);

/* task over items [0, n) in chunks of `chunk` items, taken in increasing order as threads come
 * free, on up to `threads` threads (the caller one of them); on the caller alone when `parallel`
 * is 0 (a region not worth its team: parallel.h). Returns when every item is done. */
void pool_for(int n, int chunk, int threads, int parallel, pool_task task, void* ctx);

/* The caller is about to wait (for the next step's inputs, for a bitmask): the helpers sleep now
 * instead of spinning on the core the host's other processes need, until the next region. */
void pool_park(void);

/* How long a helper spins after a region when nobody parks it, in microseconds (default 1000) */
void pool_set_spin_us(long us);
#endif
