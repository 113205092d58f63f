/* The last passes over the logits before tokens are picked, one call each: a grammar's bitmask
 * applied to the rows it names, and the greedy pick of every row.
 *
 * Why: at batch 1 a row is 49,152 floats, and torch spent ~0.6 ms applying a bitmask to it
 * (unpacking the bits to booleans, masked_fill, an indexed copy back) and ~0.3 ms in the five
 * small ops of a greedy pick: together a tenth of a decode step. A greedy row's mask is read by
 * its pick instead where nothing else needs the masked logits (argmax_rows_f32).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "parallel.h"
#include "pool.h"
#include "vec.h"

typedef struct {
    float* logits;
    int V;
    const int64_t* rows;
    const int32_t* bitmask;
    int W;
} mask_args;

static void mask_rows(void* ctx, int begin, int end, int thread) {
    const mask_args* a = ctx;
    int V = a->V, W = a->W;
    (void)thread;
    for (int i = begin; i < end; i++) {
        float* row = a->logits + (size_t)a->rows[i] * V;
        const uint32_t* words = (const uint32_t*)(a->bitmask + (size_t)i * W);
        for (int w = 0; w < W; w++) {
            uint32_t word = words[w];
            if (word == 0xffffffffu) continue;
            int first = 32 * w, last = first + 32 < V ? first + 32 : V;
            if (word == 0) {  /* a grammar's usual word: nothing allowed (a plain store, vectorized) */
                for (int t = first; t < last; t++) row[t] = -INFINITY;
                continue;
            }
            for (int t = first; t < last; t++)
                if (!((word >> (t - first)) & 1u)) row[t] = -INFINITY;
        }
    }
}

/* logits [*][V]: row rows[i] keeps the tokens bitmask row i allows (bit j of word w: token
   32 w + j) and the others become -inf. bitmask [n][W], W * 32 >= V. */
void apply_bitmask_f32(float* logits, int V, const int64_t* rows, const int32_t* bitmask, int W, int n,
                       int threads) {
    mask_args a = {logits, V, rows, bitmask, W};
    pool_for(n, PARALLEL_CHUNK(n, threads), threads, n >= 8, mask_rows, &a);
}

static inline int allowed(const uint32_t* words, int t) { return !words || (words[t >> 5] >> (t & 31)) & 1u; }

/* The index of row[0..V)'s largest value among the tokens ``words`` allows (NULL: all), the first
   where several tie, the first NaN where there is one (as torch.argmax of the masked row; 0 where
   every value is -inf or none is allowed), in vectors: each lane keeps its largest value and the
   first index that held it, and of the lanes holding the row's largest the lowest index wins. A
   masked-out token reads as -inf. The scalar loop (a compare and branch per token, which GCC does
   not vectorize) was a fifth of a batch-64 decode step of the tiny model (64 rows of 49,152). A
   row with a NaN is read again by that loop. (VW divides 32: a vector's bits lie in one word.) */
static int first_max(const float* row, int V, const uint32_t* words) {
    int t = 0, at = 0;
    float top = -INFINITY;
    vi nan = {0}, lane;
    for (int l = 0; l < VW; l++) lane[l] = l;
    const vf none = (vf){0} - INFINITY;
    if (V >= VW) {
        vf m = none;
        vi first = {0}, index = lane - VW;
        for (t = 0; t + VW <= V; t += VW) {
            vf v = ld(row + t);
            index += VW;
            if (words) {
                vi keep = -(((vi){0} + (int)(words[t >> 5] >> (t & 31)) >> lane) & 1);
                v = (vf)(((vi)v & keep) | ((vi)none & ~keep));
            }
            vi greater = v > m;  /* (false where either is NaN: lanes keep their first value) */
            m = (vf)(((vi)v & greater) | ((vi)m & ~greater));
            first = (index & greater) | (first & ~greater);
            nan |= v != v;
        }
        for (int l = 0; l < VW; l++) top = m[l] > top ? m[l] : top;
        at = V;
        for (int l = 0; l < VW; l++)
            if (m[l] == top && first[l] < at) at = first[l];
        if (top == -INFINITY) at = 0;
    }
    for (; t < V; t++) {
        if (!allowed(words, t)) continue;
        float v = row[t];
        if (v > top) {
            top = v;
            at = t;
        }
        nan[0] |= v != v;
    }
    int any_nan = 0;
    for (int l = 0; l < VW; l++) any_nan |= nan[l];
    if (any_nan) {
        for (t = 0; t < V; t++)
            if (allowed(words, t) && isnan(row[t])) return t;
    }
    return at;
}

/* The same over a sparse mask: only the allowed tokens are read (a JSON grammar's usual row
   allows a few of 49,152), one at a time. */
static int first_max_sparse(const float* row, int V, const uint32_t* words, int W) {
    float top = -INFINITY;
    int at = 0;
    for (int w = 0; w < W; w++) {
        for (uint32_t word = words[w]; word; word &= word - 1) {
            int t = 32 * w + __builtin_ctz(word);
            if (t >= V) return at;
            float v = row[t];
            if (isnan(v)) return t;
            if (v > top) {
                top = v;
                at = t;
            }
        }
    }
    return at;
}

typedef struct {
    const float* logits;
    int V;
    const int32_t *mask_of_row, *bitmask;
    int W;
    int64_t* best;
    uint8_t* dead;
} argmax_args;

static void argmax_some(void* ctx, int begin, int end, int thread) {
    const argmax_args* a = ctx;
    int V = a->V, W = a->W;
    (void)thread;
    for (int r = begin; r < end; r++) {
        const float* row = a->logits + (size_t)r * V;
        int mask = a->mask_of_row ? a->mask_of_row[r] : -1;
        const uint32_t* words = mask >= 0 ? (const uint32_t*)(a->bitmask + (size_t)mask * W) : NULL;
        int at;
        if (!words) {
            at = first_max(row, V, NULL);
        } else {
            int sampled = 0;  /* every eighth word: the sparse read wins below a token in sixteen */
            for (int w = 0; w < W; w += 8) sampled += __builtin_popcount(words[w]);
            at = sampled * 8 < V / 16 ? first_max_sparse(row, V, words, W) : first_max(row, V, words);
        }
        a->best[r] = at;
        a->dead[r] = row[at] == -INFINITY || !allowed(words, at);
    }
}

/* For each of R rows of logits [R][V]: the index of its largest value (the first one where
   several tie, the first NaN where there is one: as torch.argmax) and whether every value is
   -inf (a row whose mask allows nothing; its index is then 0). With mask_of_row (NULL: none),
   row r whose mask_of_row[r] = i >= 0 is read as if bitmask row i had been applied to it
   (apply_bitmask_f32, then this): only the tokens the mask allows are read, so a guided greedy
   row costs one pass over its allowed tokens instead of a write pass and a read pass over all. */
void argmax_rows_f32(const float* logits, int R, int V, const int32_t* mask_of_row, const int32_t* bitmask, int W,
                     int64_t* best, uint8_t* dead, int threads) {
    argmax_args a = {logits, V, mask_of_row, bitmask, W, best, dead};
    pool_for(R, PARALLEL_CHUNK(R, threads), threads, R >= 8, argmax_some, &a);
}

/* For each of n bitmask rows [n][W]: the one token it allows, or -1 where it allows none or more
   than one (bits past the vocabulary counted; a lone one there gives -1 too). A row stops at its
   second set bit, so a grammar's usual rows (many tokens allowed) cost a few words, not W: at a
   262k vocabulary a row is 8,192 words, and counting every bit of a step's rows cost more than
   the rest of its mask work. */
void single_token_rows(const int32_t* bitmask, int n, int W, int V, int64_t* out) {
    for (int i = 0; i < n; i++) {
        const uint32_t* words = (const uint32_t*)(bitmask + (size_t)i * W);
        int64_t token = -1;
        int seen = 0;
        for (int w = 0; w < W && seen < 2; w++) {
            uint32_t word = words[w];
            if (!word) continue;
            seen += __builtin_popcount(word);
            token = 32 * (int64_t)w + __builtin_ctz(word);
        }
        out[i] = seen == 1 && token < V ? token : -1;
    }
}
