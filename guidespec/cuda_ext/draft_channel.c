/* The draft channel and the host stream (see draft_channel.h). Plain C11, Linux futexes. */
#define _GNU_SOURCE
#include "draft_channel.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define GS_MAGIC 0x74666172647367ULL /* "gsdraft" */
#define SPINS 2000
#define MAX_SLEEP_NS 5000000L /* a sleeping waiter looks at its peer every 5 ms */

typedef struct {
    uint64_t magic;
    int32_t max_rows, max_tokens, num_words, spin_us; /* spin_us: a waiter's polling time before it sleeps */
    _Alignas(64) _Atomic uint64_t draft_seq;
    _Atomic uint32_t draft_bell;
    int32_t draft_rows, draft_tokens;
    _Alignas(64) _Atomic uint64_t mask_seq;
    _Atomic uint32_t mask_bell;
    int32_t mask_rows;
    _Alignas(64) _Atomic int32_t error;
    int32_t error_index;
    int64_t error_step;
    _Alignas(64) char end[];
} header;

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t offset_of(int32_t max_rows, int32_t max_tokens, int32_t which) {
    size_t at = sizeof(header);
    if (which > 0) at += round64((size_t)max_rows * 4); /* lens after rows */
    if (which > 1) at += round64((size_t)max_rows * 4); /* tokens after lens */
    if (which > 2) at += round64((size_t)max_tokens * 4); /* mask after tokens */
    return at;
}

/* mask_ids after the mask */
static size_t ids_offset(int32_t max_rows, int32_t max_tokens, int32_t num_words) {
    return offset_of(max_rows, max_tokens, 3) + round64((size_t)max_rows * (size_t)num_words * 4);
}

size_t gs_channel_bytes(int32_t max_rows, int32_t max_tokens, int32_t num_words) {
    return ids_offset(max_rows, max_tokens, num_words) + (size_t)max_rows * 4;
}

size_t gs_channel_offset(const void *base, int32_t which) {
    const header *h = (const header *)base;
    return which == 4 ? ids_offset(h->max_rows, h->max_tokens, h->num_words) : offset_of(h->max_rows, h->max_tokens, which);
}

int gs_channel_init(void *base, int32_t max_rows, int32_t max_tokens, int32_t num_words, int32_t spin_us) {
    if (max_rows < 1 || max_tokens < 1 || num_words < 1 || spin_us < 0) return GS_BAD_CHANNEL;
    header *h = (header *)base;
    memset(h, 0, sizeof(header));
    h->max_rows = max_rows, h->max_tokens = max_tokens, h->num_words = num_words, h->spin_us = spin_us;
    atomic_thread_fence(memory_order_release);
    h->magic = GS_MAGIC;
    return GS_OK;
}

int gs_channel_check(const void *base, int32_t max_rows, int32_t max_tokens, int32_t num_words) {
    const header *h = (const header *)base;
    return h->magic == GS_MAGIC && h->max_rows == max_rows && h->max_tokens == max_tokens
        && h->num_words == num_words ? GS_OK : GS_BAD_CHANNEL;
}

/* a tag orders a step's exchanges: (step, 0) its verify masks, (step, draft index + 1), DONE last */
static uint64_t tag(int64_t step, int32_t index) {
    uint64_t key = index == GS_DRAFTS_DONE ? 255u : index == GS_VERIFY ? 0u : (uint64_t)(index + 1);
    return ((uint64_t)step << 8) | key;
}
static int32_t index_of(uint64_t t) {
    uint64_t key = t & 255u;
    return key == 255u ? GS_DRAFTS_DONE : key == 0u ? GS_VERIFY : (int32_t)key - 1;
}

static void futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen, long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t wall_ns(void) { /* the trace's clock: Python's time.time() */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int peer_gone(int32_t pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

static void publish(_Atomic uint64_t *seq, _Atomic uint32_t *bell, uint64_t t) {
    atomic_store_explicit(seq, t, memory_order_release);
    atomic_fetch_add_explicit(bell, 1, memory_order_release);
    futex_wake(bell);
}

/* wait until `ready(seq)` is > 0 (GS_OK) or < 0 (GS_STALE), or the deadline, or the peer's death */
typedef int (*readiness)(uint64_t seen, uint64_t want);

static int wait_for(_Atomic uint64_t *seq, _Atomic uint32_t *bell, readiness ready, uint64_t want,
                    int64_t timeout_us, int32_t peer_pid, int32_t spin_us, uint64_t *seen_out) {
    int64_t start = now_ns(), deadline = start + timeout_us * 1000;
    int64_t spin_until = start + (int64_t)(spin_us < timeout_us ? spin_us : timeout_us) * 1000;
    for (long i = 0;; i++) {
        uint32_t bell_seen = atomic_load_explicit(bell, memory_order_acquire);
        uint64_t seen = atomic_load_explicit(seq, memory_order_acquire);
        int r = ready(seen, want);
        if (r != 0) {
            *seen_out = seen;
            return r > 0 ? GS_OK : GS_STALE;
        }
        if (i < SPINS || (spin_us > 0 && now_ns() < spin_until)) continue;
        int64_t left = deadline - now_ns();
        if (left <= 0) return GS_TIMEOUT;
        if (peer_gone(peer_pid)) return GS_PEER_GONE;
        futex_wait(bell, bell_seen, left < MAX_SLEEP_NS ? (long)left : MAX_SLEEP_NS);
    }
}

static void record_error(header *h, int code, int64_t step, int32_t index) {
    h->error_step = step, h->error_index = index;
    atomic_store_explicit(&h->error, code, memory_order_release);
}

int gs_publish_drafts(void *base, int64_t step, int32_t draft_index, const int32_t *rows, int32_t num_rows,
                      const int32_t *lens, const int32_t *tokens, int32_t num_tokens) {
    header *h = (header *)base;
    if (h->magic != GS_MAGIC) return GS_BAD_CHANNEL;
    if (num_rows < 0 || num_rows > h->max_rows || num_tokens < 0 || num_tokens > h->max_tokens
        || draft_index < 0 || draft_index > 250) {
        record_error(h, GS_TOO_LARGE, step, draft_index);
        return GS_TOO_LARGE;
    }
    char *at = (char *)base;
    memcpy(at + offset_of(h->max_rows, h->max_tokens, 0), rows, (size_t)num_rows * 4);
    memcpy(at + offset_of(h->max_rows, h->max_tokens, 1), lens, (size_t)num_rows * 4);
    memcpy(at + offset_of(h->max_rows, h->max_tokens, 2), tokens, (size_t)num_tokens * 4);
    h->draft_rows = num_rows, h->draft_tokens = num_tokens;
    publish(&h->draft_seq, &h->draft_bell, tag(step, draft_index));
    return GS_OK;
}

int gs_publish_done(void *base, int64_t step) {
    header *h = (header *)base;
    if (h->magic != GS_MAGIC) return GS_BAD_CHANNEL;
    h->draft_rows = 0, h->draft_tokens = 0;
    publish(&h->draft_seq, &h->draft_bell, tag(step, GS_DRAFTS_DONE));
    return GS_OK;
}

static int mask_ready(uint64_t seen, uint64_t want) { return seen == want ? 1 : (seen > want ? -1 : 0); }

int gs_wait_mask(void *base, int64_t step, int32_t draft_index, int64_t timeout_us, int32_t peer_pid,
                 int32_t *out, int32_t num_rows) {
    header *h = (header *)base;
    size_t bytes = (size_t)(num_rows > 0 ? num_rows : 0) * (size_t)h->num_words * 4;
    if (h->magic != GS_MAGIC || num_rows < 0 || num_rows > h->max_rows) {
        if (h->magic == GS_MAGIC && num_rows > h->max_rows) bytes = (size_t)h->max_rows * (size_t)h->num_words * 4;
        memset(out, 0, bytes);
        return GS_BAD_CHANNEL;
    }
    uint64_t seen = 0;
    int code = wait_for(&h->mask_seq, &h->mask_bell, mask_ready, tag(step, draft_index), timeout_us, peer_pid,
                        h->spin_us, &seen);
    if (code == GS_OK && h->mask_rows != num_rows) code = GS_STALE;
    if (code != GS_OK) {
        memset(out, 0, bytes); /* forbid every token: no draft of this step is accepted */
        record_error(h, code, step, draft_index);
        return code;
    }
    memcpy(out, (char *)base + offset_of(h->max_rows, h->max_tokens, 3), bytes);
    return GS_OK;
}

static int drafts_ready(uint64_t seen, uint64_t want) {
    /* want: the tag after which a newer tag of the same step is awaited */
    if ((seen >> 8) > (want >> 8)) return -1;
    return ((seen >> 8) == (want >> 8) && (seen & 255u) > (want & 255u)) ? 1 : 0;
}

int gs_wait_drafts(void *base, int64_t step, int32_t last_index, int64_t timeout_us, int32_t peer_pid,
                   int32_t *draft_index, int32_t *num_rows, int32_t *num_tokens) {
    header *h = (header *)base;
    if (h->magic != GS_MAGIC) return GS_BAD_CHANNEL;
    uint64_t after = ((uint64_t)step << 8) | (uint64_t)(last_index + 1); /* last_index -1: none yet */
    uint64_t seen = 0;
    int code = wait_for(&h->draft_seq, &h->draft_bell, drafts_ready, after, timeout_us, peer_pid, h->spin_us, &seen);
    if (code != GS_OK) return code;
    *draft_index = index_of(seen);
    *num_rows = h->draft_rows, *num_tokens = h->draft_tokens;
    return GS_OK;
}

int gs_publish_mask(void *base, int64_t step, int32_t draft_index, int32_t num_rows) {
    header *h = (header *)base;
    if (h->magic != GS_MAGIC) return GS_BAD_CHANNEL;
    if (num_rows < 0 || num_rows > h->max_rows) return GS_TOO_LARGE;
    h->mask_rows = num_rows;
    publish(&h->mask_seq, &h->mask_bell, tag(step, draft_index));
    return GS_OK;
}

int gs_publish_verify_mask(void *base, int64_t step, const int32_t *ids, int32_t num_rows) {
    header *h = (header *)base;
    if (h->magic != GS_MAGIC) return GS_BAD_CHANNEL;
    if (num_rows < 0 || num_rows > h->max_rows) return GS_TOO_LARGE;
    memcpy((char *)base + ids_offset(h->max_rows, h->max_tokens, h->num_words), ids, (size_t)num_rows * 4);
    h->mask_rows = num_rows;
    publish(&h->mask_seq, &h->mask_bell, tag(step, GS_VERIFY));
    return GS_OK;
}

int32_t gs_last_error(const void *base, int64_t *step, int32_t *draft_index) {
    const header *h = (const header *)base;
    int32_t code = atomic_load_explicit(&((header *)base)->error, memory_order_acquire);
    if (step) *step = h->error_step;
    if (draft_index) *draft_index = h->error_index;
    return code;
}

void gs_clear_error(void *base) { atomic_store_explicit(&((header *)base)->error, GS_OK, memory_order_release); }

/* ------------------------------------------------------------------ trampolines */

void gs_cb_publish_drafts(void *args) {
    gs_publish_args *a = (gs_publish_args *)args;
    *a->status = gs_publish_drafts(a->channel, *a->step, a->draft_index, a->rows, *a->num_rows, a->lens, a->tokens,
                                   *a->num_tokens);
}

void gs_cb_wait_mask(void *args) {
    gs_wait_args *a = (gs_wait_args *)args;
    *a->status = gs_wait_mask(a->channel, *a->step, a->draft_index, a->timeout_us, a->peer_pid, a->out, *a->num_rows);
}

void gs_cb_graph_publish(void *args) {
    gs_graph_step_args *a = (gs_graph_step_args *)args;
    int32_t n = 0, m = 0, j = a->draft_index;
    *a->published = 0;
    if (a->status[0] != GS_OK || a->status[1] != GS_OK) return; /* an earlier draft step failed */
    for (int32_t b = 0; b < a->batch; b++) {
        if (a->masked[b] <= j || a->wanted[b] <= j) continue; /* masked: its first draft steps */
        int32_t produced = a->produced_len[b];
        if (produced < 0 || produced > a->max_produced) produced = 0;
        a->rows[n] = a->batch_rows[b];
        a->lens[n] = produced + j;
        memcpy(a->tokens + m, a->produced + (size_t)b * (size_t)a->max_produced, (size_t)produced * 4);
        m += produced;
        for (int32_t i = 0; i < j; i++) a->tokens[m++] = a->drafts[(size_t)i * (size_t)a->batch + (size_t)b];
        n++;
    }
    if (n == 0) return;
    int code = gs_publish_drafts(a->channel, *a->step, j, a->rows, n, a->lens, a->tokens, m);
    if (code != GS_OK) {
        a->status[0] = code;
        return;
    }
    *a->published = n;
    if (a->times != NULL) a->times[0] = wall_ns();
}

void gs_cb_graph_wait(void *args) {
    gs_graph_step_args *a = (gs_graph_step_args *)args;
    size_t row_bytes = (size_t)a->num_words * 4;
    int32_t n = *a->published, failed = a->status[0] != GS_OK || a->status[1] != GS_OK;
    if (n > 0) {
        if (a->times != NULL) a->times[1] = wall_ns();
        int code = gs_wait_mask(a->channel, *a->step, a->draft_index, a->timeout_us, a->peer_pid, a->mask_rows, n);
        if (a->times != NULL) a->times[2] = wall_ns();
        if (code != GS_OK) { /* the rows are zero: every token forbidden */
            if (a->status[1] == GS_OK) a->status[1] = code;
            failed = 1;
        }
    }
    int32_t k = 0, j = a->draft_index;
    for (int32_t b = 0; b < a->batch; b++) {
        int32_t *row = a->out + (size_t)b * (size_t)a->num_words;
        if (a->masked[b] <= j) { /* its grammar does not mask this draft step */
            memset(row, 0xff, row_bytes);
        } else if (n > 0 && a->wanted[b] > j) {
            memcpy(row, a->mask_rows + (size_t)k++ * (size_t)a->num_words, row_bytes);
        } else if (failed) {
            memset(row, 0, row_bytes);
        } else { /* masked, but drafting no further: its picks are cut on the host */
            memset(row, 0xff, row_bytes);
        }
    }
}

void gs_cb_verify_wait(void *args) {
    gs_verify_args *a = (gs_verify_args *)args;
    header *h = (header *)a->channel;
    size_t row_bytes = (size_t)a->num_words * 4, bytes = (size_t)a->num_rows * row_bytes;
    int code = h->magic == GS_MAGIC && a->num_words == h->num_words ? GS_OK : GS_BAD_CHANNEL;
    uint64_t seen = 0;
    if (code == GS_OK && !*a->enabled) {
        memset(a->out, 0xff, bytes);
        *a->status = GS_OK;
        return;
    }
    if (a->times != NULL) a->times[0] = wall_ns();
    if (code == GS_OK)
        code = wait_for(&h->mask_seq, &h->mask_bell, mask_ready, tag(*a->step, GS_VERIFY), a->timeout_us, a->peer_pid,
                        h->spin_us, &seen);
    if (a->times != NULL) a->times[1] = wall_ns();
    if (code == GS_OK) {
        const int32_t *ids = (const int32_t *)((char *)a->channel + ids_offset(h->max_rows, h->max_tokens, h->num_words));
        const char *mask = (const char *)a->channel + offset_of(h->max_rows, h->max_tokens, 3);
        memset(a->out, 0xff, bytes); /* rows without a mask: unguided */
        for (int32_t i = 0; i < h->mask_rows && code == GS_OK; i++) {
            int32_t id = ids[i], row = id >= 0 && id < a->num_ids ? a->padded_of[id] : -1;
            if (row < 0 || row >= a->num_rows) code = GS_STALE; /* a row this graph does not have */
            else memcpy((char *)a->out + (size_t)row * row_bytes, mask + (size_t)i * row_bytes, row_bytes);
        }
    }
    if (code != GS_OK) {
        memset(a->out, 0, bytes); /* forbid every token: the step fails, nothing is accepted */
        if (h->magic == GS_MAGIC) record_error(h, code, *a->step, GS_VERIFY);
    }
    *a->status = code;
}

/* ------------------------------------------------------------------ the host stream */

typedef struct {
    void (*fn)(void *);
    void *args;
} task;

struct gs_host_stream {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    task *tasks;
    int32_t capacity, head, count, running, stop;
};

static void *run_stream(void *arg) {
    gs_host_stream *s = (gs_host_stream *)arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (s->count == 0 && !s->stop) pthread_cond_wait(&s->changed, &s->lock);
        if (s->count == 0 && s->stop) break;
        task t = s->tasks[s->head];
        s->head = (s->head + 1) % s->capacity;
        s->count--, s->running = 1;
        pthread_mutex_unlock(&s->lock);
        t.fn(t.args); /* in order, one at a time: as a CUDA stream runs host functions */
        pthread_mutex_lock(&s->lock);
        s->running = 0;
        pthread_cond_broadcast(&s->changed);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

gs_host_stream *gs_host_stream_create(int32_t capacity) {
    gs_host_stream *s = (gs_host_stream *)calloc(1, sizeof(gs_host_stream));
    if (s == NULL || capacity < 1) {
        free(s);
        return NULL;
    }
    s->tasks = (task *)calloc((size_t)capacity, sizeof(task));
    s->capacity = capacity;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->changed, NULL);
    if (s->tasks == NULL || pthread_create(&s->thread, NULL, run_stream, s) != 0) {
        free(s->tasks);
        free(s);
        return NULL;
    }
    return s;
}

int gs_host_stream_enqueue(gs_host_stream *s, void (*fn)(void *), void *args) {
    pthread_mutex_lock(&s->lock);
    while (s->count == s->capacity) pthread_cond_wait(&s->changed, &s->lock);
    s->tasks[(s->head + s->count) % s->capacity] = (task){fn, args};
    s->count++;
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->lock);
    return GS_OK;
}

void gs_host_stream_synchronize(gs_host_stream *s) {
    pthread_mutex_lock(&s->lock);
    while (s->count > 0 || s->running) pthread_cond_wait(&s->changed, &s->lock);
    pthread_mutex_unlock(&s->lock);
}

void gs_host_stream_destroy(gs_host_stream *s) {
    if (s == NULL) return;
    pthread_mutex_lock(&s->lock);
    s->stop = 1;
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->changed);
    free(s->tasks);
    free(s);
}
