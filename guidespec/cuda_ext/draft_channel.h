/* The draft channel: model drafts (worker rank 0 -> scheduler) and their masks (scheduler ->
 * rank 0) through one shared-memory segment, as plain C with no Python in any function.
 *
 * A draft step is a ping-pong on two sequence words: rank 0 writes the step's draft tokens and
 * publishes the tag (step, draft index) in draft_seq; the scheduler, waiting on it, fills one
 * bitmask row per drafting row and publishes the same tag in mask_seq; rank 0, waiting on that,
 * copies the rows out. One slot each way is enough: each side writes again only after the other
 * answered. Waits spin briefly, then sleep on a futex (shared between processes), up to a
 * deadline, and look at the peer's pid between sleeps: a dead peer ends the wait at once.
 *
 * A mask that does not come (timeout, dead peer) or that carries another tag (stale) is never
 * used: the waiter zeroes its output rows (forbid every token, so no draft is accepted), writes
 * the error into the channel's error slot with the step and draft index, and returns the code.
 *
 * The same functions are what a CUDA stream calls back (host_callbacks.cu) and what the CPU
 * worker calls directly or through gs_host_stream (a thread that runs enqueued host functions
 * in order, as cudaLaunchHostFunc does).
 */
#ifndef GUIDESPEC_DRAFT_CHANNEL_H
#define GUIDESPEC_DRAFT_CHANNEL_H

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    GS_OK = 0,
    GS_TIMEOUT = 1,    /* no answer before the deadline */
    GS_STALE = 2,      /* an answer for another step or draft index */
    GS_PEER_GONE = 3,  /* the other process died */
    GS_TOO_LARGE = 4,  /* more rows or tokens than the channel holds */
    GS_BAD_CHANNEL = 5 /* not a channel, or another layout */
};

#define GS_DRAFTS_DONE (-1) /* draft index of "rank 0 drafts no more this step" */
#define GS_VERIFY (-2)      /* draft index of a step's verify masks (before its draft 0) */

size_t gs_channel_bytes(int32_t max_rows, int32_t max_tokens, int32_t num_words);
int gs_channel_init(void *base, int32_t max_rows, int32_t max_tokens, int32_t num_words, int32_t spin_us);
int gs_channel_check(const void *base, int32_t max_rows, int32_t max_tokens, int32_t num_words);

/* offsets (bytes from base) of the arrays: rows [max_rows], lens [max_rows], tokens [max_tokens],
 * mask [max_rows][num_words], mask_ids [max_rows] (which logits row each verify mask row is for) */
size_t gs_channel_offset(const void *base, int32_t which);

/* rank 0 */
int gs_publish_drafts(void *base, int64_t step, int32_t draft_index, const int32_t *rows, int32_t num_rows,
                      const int32_t *lens, const int32_t *tokens, int32_t num_tokens);
int gs_publish_done(void *base, int64_t step); /* no more drafts this step */
int gs_wait_mask(void *base, int64_t step, int32_t draft_index, int64_t timeout_us, int32_t peer_pid,
                 int32_t *out, int32_t num_rows);

/* the scheduler: the next tag of `step` after `last_index` (GS_OK with *draft_index, which is
 * GS_DRAFTS_DONE when rank 0 is done), GS_TIMEOUT, GS_PEER_GONE or GS_STALE */
int gs_wait_drafts(void *base, int64_t step, int32_t last_index, int64_t timeout_us, int32_t peer_pid,
                   int32_t *draft_index, int32_t *num_rows, int32_t *num_tokens);
int gs_publish_mask(void *base, int64_t step, int32_t draft_index, int32_t num_rows);
/* the scheduler, for a fused step (worker/drafting/step_graph.py): the step's verify mask rows (already in the
 * mask array), row i for logits row ids[i], before any draft of the step */
int gs_publish_verify_mask(void *base, int64_t step, const int32_t *ids, int32_t num_rows);

/* the error slot: the last failed wait (code, step, draft index); cleared by gs_clear_error */
int32_t gs_last_error(const void *base, int64_t *step, int32_t *draft_index);
void gs_clear_error(void *base);

/* host-callback trampolines: their argument blocks live as long as the graph (or the stream's
 * work); fields behind pointers are read when the callback runs, so a replay sees this step's */
typedef struct {
    void *channel;
    const int64_t *step;
    int32_t draft_index;
    const int32_t *rows, *lens, *tokens;
    const int32_t *num_rows, *num_tokens;
    int32_t *status; /* GS_* of the callback */
} gs_publish_args;

typedef struct {
    void *channel;
    const int64_t *step;
    int32_t draft_index;
    int64_t timeout_us;
    int32_t peer_pid;
    int32_t *out; /* page-locked on a GPU: the mask's host-to-device copy follows in the stream */
    const int32_t *num_rows;
    int32_t *status;
} gs_wait_args;

void gs_cb_publish_drafts(void *args);
void gs_cb_wait_mask(void *args);

/* Where a stream reaches a host function is when the device has done the work before it, so
 * the times a trampoline records are the step's timeline inside a graph: how long the device
 * stood still waiting for the grammar. */

/* The draft steps of a fixed-shape graph (worker/drafting/draft_graph.py): B rows, each drafting up to K
 * tokens; one argument block per draft index j, read by both callbacks of that draft step.
 * gs_cb_graph_publish publishes the rows whose grammar masks draft step j (masked[b] > j) and
 * that want more than j drafts, each with its tokens past its final ones:
 * produced[b][:produced_len[b]] then drafts[0..j-1][b] (what the graph copied device-to-host
 * before the callback); gs_cb_graph_wait waits for their mask and lays out one mask row per graph
 * row in `out`: the scheduler's row where it was published, all ones (allow all) for rows not
 * masked at step j. On a failed wait the published rows are all zero (forbid every token),
 * status[1] keeps the first error, and every later draft step of the replay publishes nothing
 * and forbids every token of its masked rows. */
typedef struct {
    void *channel;
    const int64_t *step;
    int32_t draft_index;
    int32_t batch;        /* B */
    int32_t max_produced; /* P: the row stride of `produced` */
    int32_t num_words;    /* W */
    int64_t timeout_us;
    int32_t peer_pid;
    const int32_t *batch_rows;   /* [B]: the step's batch row of each graph row (what is published) */
    const int32_t *wanted;       /* [B]: drafts the row wants (0: a padding row) */
    const int32_t *masked;       /* [B]: how many of the row's draft steps its grammar masks, from the first */
    const int32_t *produced;     /* [B][P] */
    const int32_t *produced_len; /* [B] */
    const int32_t *drafts;       /* [K][B]: draft j of every row, as target ids */
    int32_t *rows, *lens, *tokens; /* scratch for the published layout: [B], [B], [B * (P + K)] */
    int32_t *mask_rows;            /* scratch [B][W]: the scheduler's rows, in published order */
    int32_t *out;                  /* [B][W] */
    int32_t *published;            /* rows published at this draft index */
    int32_t *status;               /* [2]: the first failed publish, the first failed wait (GS_*) */
    int64_t *times;                /* [3]: when rows were published, the mask's wait began and ended
                                      (CLOCK_REALTIME ns; left as they are where nothing is published) */
} gs_graph_step_args;

void gs_cb_graph_publish(void *args);
void gs_cb_graph_wait(void *args);

/* The verify masks of a fused step (worker/drafting/step_graph.py): wait for the scheduler's (step, GS_VERIFY)
 * rows, lay them out in `out` [num_rows][W] at the graph row of their logits row (padded_of[id]),
 * all ones (allow all) in the rows of unguided requests. On a failed wait, or rows that do not
 * fit the graph (a stale layout), every row is zero (forbid every token) and *status says why. */
typedef struct {
    void *channel;
    const int64_t *step;
    int64_t timeout_us;
    int32_t peer_pid;
    int32_t num_rows;         /* the graph's logits rows: B * n */
    int32_t num_words;        /* W */
    int32_t num_ids;          /* entries of padded_of */
    const int32_t *padded_of; /* [num_ids]: the graph row of each of the step's logits rows (-1: none) */
    const int32_t *enabled;   /* 0: wait for nothing, allow every row (a graph's warm-up on padding) */
    int32_t *out;             /* [num_rows][W], page-locked on a GPU */
    int32_t *status;          /* GS_* */
    int64_t *times;           /* [2]: when the wait began and ended (CLOCK_REALTIME ns; left as they
                                 are where it waits for nothing) */
} gs_verify_args;

void gs_cb_verify_wait(void *args);

/* a CPU "stream": host functions run in order on one thread */
typedef struct gs_host_stream gs_host_stream;
gs_host_stream *gs_host_stream_create(int32_t capacity);
int gs_host_stream_enqueue(gs_host_stream *stream, void (*fn)(void *), void *args);
void gs_host_stream_synchronize(gs_host_stream *stream);
void gs_host_stream_destroy(gs_host_stream *stream);

#ifdef __cplusplus
}
#endif
#endif
