/* Early closing's cycle detector (closing.py's ``RepeatDetector``, whose Python twin is the
 * reference and the fallback): a request's last tokens and, for each period p, how many of the
 * latest tokens equal the token p places before them. The sequence ends in a cycle of period p
 * once that count reaches max(2p, min_span).
 *
 * A call a token, a fixed loop over the periods: a looping output repeats its token at many
 * periods at once, where the Python twin's work grows with them (~3.5 µs a token at batch 64).
 */

#include <stdint.h>

#define REPEATS_MAX_PERIOD 64

typedef struct {
    int32_t head;        /* where the next token goes in `history` (a ring of max_period tokens) */
    int32_t count;       /* tokens in `history` */
    int32_t max_period;  /* 1 .. REPEATS_MAX_PERIOD */
    int32_t min_span;
    int32_t history[REPEATS_MAX_PERIOD];
    int32_t runs[REPEATS_MAX_PERIOD + 1];  /* by period */
} repeats_t;

int64_t repeats_bytes(void) { return sizeof(repeats_t); }

/* Record a token; the shortest period of a cycle the sequence now ends in (0: none). */
int32_t repeats_add(repeats_t *d, int32_t token) {
    int32_t periods = d->max_period, shortest = 0;
    for (int32_t p = 1; p <= periods; p++) {
        int32_t run = 0;
        if (p <= d->count && d->history[(d->head - p + periods) % periods] == token)
            run = d->runs[p] + 1;
        d->runs[p] = run;
        if (!shortest && run >= (2 * p > d->min_span ? 2 * p : d->min_span))
            shortest = p;
    }
    d->history[d->head] = token;
    d->head = (d->head + 1) % periods;
    if (d->count < periods)
        d->count++;
    return shortest;
}

/* repeats_add for n requests' detectors at once (a step's guided rows: one call, not n) */
void repeats_add_many(repeats_t *const *states, const int32_t *tokens, int32_t n, int32_t *periods) {
    for (int32_t i = 0; i < n; i++)
        periods[i] = repeats_add(states[i], tokens[i]);
}
