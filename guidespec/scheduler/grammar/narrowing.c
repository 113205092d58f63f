/* Early closing's narrowing of a step's mask rows, every row in one call (closing.py's
 * ``narrow_rows``; its NumPy twin there is the reference and the fallback).
 *
 * A mask row is `words` 32-bit words, bit t of word t / 32 allowing token t. Each row is narrowed
 * to the first of the tiers (closing's classes, each a whole mask row and the few words holding
 * its tokens) that it allows (NARROWED); a row allowing none loses its banned tokens (the words
 * listed for it, and-ed with the bits kept) where it allows any other token (UNBANNED, told for
 * a row with banned tokens listed that allows another, whether it allowed a banned one or not:
 * closing.py's ``unban``); any other row is left as it was (KEPT).
 *
 * With `ask`, a row whose narrowing would change it is left as it was and marked ASK unless it
 * allows two of the probe's one-character tokens (then no text is forced next: closing.py's
 * ``forces_nothing``): the caller asks the grammar whether it forces a text there, and narrows
 * the rows where it does not in a second call without `ask`. A row that narrowing leaves as it
 * is needs no question.
 */

#include <stddef.h>
#include <stdint.h>

enum { KEPT = 0, NARROWED = 1, UNBANNED = 2, ASK = 3 };

/* Whether the row allows a token `tier` (a whole row) does not: scanned a few words at a time, to the
 * first such word (a row the narrowing would change mostly has one early). */
static int beyond(const uint32_t *row, const uint32_t *tier, int64_t words) {
    for (int64_t w = 0; w < words; w += 16) {
        int64_t end = w + 16 < words ? w + 16 : words;
        uint32_t any = 0;
        for (int64_t k = w; k < end; k++)
            any |= row[k] & ~tier[k];
        if (any)
            return 1;
    }
    return 0;
}

/* Whether the row allows any token, scanned as `beyond` is. */
static int any_set(const uint32_t *row, int64_t words) {
    for (int64_t w = 0; w < words; w += 16) {
        int64_t end = w + 16 < words ? w + 16 : words;
        uint32_t any = 0;
        for (int64_t k = w; k < end; k++)
            any |= row[k];
        if (any)
            return 1;
    }
    return 0;
}

/* bitmask: num_rows mask rows, `stride` words apart; rows: the n rows to narrow; tiers: num_tiers whole
 * rows of `words` words; tier_words[tier_ends[t - 1] .. tier_ends[t]): tier t's nonzero words
 * (tier_ends[-1] read as 0); probe, probe_words: the one-character tokens' row and its nonzero
 * words; banned[3i], banned[3i + 1], banned[3i + 2]: row i's banned words (ascending), each one's
 * bits kept, and their count (0: none banned). status: one of KEPT, NARROWED, UNBANNED, ASK a row. */
void closing_narrow_rows(uint32_t *bitmask, int64_t stride, int64_t words, int64_t num_rows, const int64_t *rows, int64_t n,
                         const uint32_t *tiers, const int32_t *tier_words, const int32_t *tier_ends, int32_t num_tiers,
                         const uint32_t *probe, const int32_t *probe_words, int32_t num_probe_words,
                         const int64_t *banned, int32_t ask, uint8_t *status) {
    for (int64_t i = 0; i < n; i++) {
        status[i] = KEPT;
        if (rows[i] < 0 || rows[i] >= num_rows)
            continue;  /* (never asked: the caller's rows are the bitmask's) */
        uint32_t *row = bitmask + rows[i] * stride;
        int free = !ask;
        if (ask) {
            int singles = 0;
            for (int32_t k = 0; k < num_probe_words && singles < 2; k++)
                singles += __builtin_popcount(row[probe_words[k]] & probe[probe_words[k]]);
            free = singles >= 2;
        }
        int done = 0;
        for (int32_t t = 0; t < num_tiers && !done; t++) {
            const uint32_t *tier = tiers + (int64_t)t * words;
            int32_t first = t ? tier_ends[t - 1] : 0, end = tier_ends[t];
            int64_t hits = 0;
            for (int32_t k = first; k < end; k++)
                hits += __builtin_popcount(row[tier_words[k]] & tier[tier_words[k]]);
            if (!hits)
                continue;
            done = 1;
            status[i] = NARROWED;
            if (!beyond(row, tier, words))
                break;  /* it allows that tier's tokens alone: nothing to narrow */
            if (!free) {
                status[i] = ASK;
                break;
            }
            uint32_t kept[end - first > 0 ? end - first : 1];
            for (int32_t k = first; k < end; k++)
                kept[k - first] = row[tier_words[k]] & tier[tier_words[k]];
            for (int64_t w = 0; w < words; w++)
                row[w] = 0;
            for (int32_t k = first; k < end; k++)
                row[tier_words[k]] = kept[k - first];
        }
        if (done)
            continue;
        const int32_t *listed = (const int32_t *)banned[3 * i];
        const uint32_t *keep = (const uint32_t *)banned[3 * i + 1];
        int64_t count = banned[3 * i + 2];
        if (!count || listed[count - 1] >= words)
            continue;  /* (a banned word past the row, never made: the tokens are the vocabulary's) */
        uint32_t old[count];
        int gone = 0;
        for (int64_t k = 0; k < count; k++) {
            old[k] = row[listed[k]];
            row[listed[k]] = old[k] & keep[k];
            gone |= row[listed[k]] != old[k];
        }
        int others = any_set(row, words);
        if (gone && (!others || !free)) {  /* (banned tokens alone, or nothing: they stay) */
            for (int64_t k = 0; k < count; k++)
                row[listed[k]] = old[k];
            if (others)  /* cleared, where a text may be forced next */
                status[i] = ASK;
            continue;
        }
        if (!others)
            continue;
        status[i] = UNBANNED;
    }
}
