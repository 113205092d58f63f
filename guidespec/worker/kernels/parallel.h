/* When a kernel's parallel region is worth its team.
 *
 * Waking OpenMP's threads for a region costs microseconds when they spin, and a scheduler tick
 * when one of them was descheduled (a 2-core host running the scheduler and a worker's two
 * threads): a tiny model's decode step spent 30% of rank 0's loop in its decoder stack's ten
 * regions a step, each a few thousand multiply-adds. A region of fewer than PARALLEL_MIN_WORK
 * multiply-adds (or their like) runs on the calling thread. Each output is computed by one
 * thread whatever the count, so results do not change. */
#ifndef GUIDESPEC_PARALLEL_H
#define GUIDESPEC_PARALLEL_H
#define PARALLEL_MIN_WORK ((size_t)1 << 18)
#endif
