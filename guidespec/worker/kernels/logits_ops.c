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

/* logits [*][V]: row rows[i] keeps the tokens bitmask row i allows (bit j of word w: token
   32 w + j) and the others become -inf. bitmask [n][W], W * 32 >= V. */
void apply_bitmask_f32(float* logits, int V, const int64_t* rows, const int32_t* bitmask, int W, int n,
                       int threads) {
    #pragma omp parallel for schedule(dynamic, PARALLEL_CHUNK(n, threads)) num_threads(threads) if (n >= 8)
    for (int i = 0; i < n; i++) {
        float* row = logits + (size_t)rows[i] * V;
        const uint32_t* words = (const uint32_t*)(bitmask + (size_t)i * W);
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

/* For each of R rows of logits [R][V]: the index of its largest value (the first one where
   several tie, the first NaN where there is one: as torch.argmax) and whether every value is
   -inf (a row whose mask allows nothing; its index is then 0). With mask_of_row (NULL: none),
   row r whose mask_of_row[r] = i >= 0 is read as if bitmask row i had been applied to it
   (apply_bitmask_f32, then this): only the tokens the mask allows are read, so a guided greedy
   row costs one pass over its allowed tokens instead of a write pass and a read pass over all. */
void argmax_rows_f32(const float* logits, int R, int V, const int32_t* mask_of_row, const int32_t* bitmask, int W,
                     int64_t* best, uint8_t* dead, int threads) {
    #pragma omp parallel for schedule(dynamic, PARALLEL_CHUNK(R, threads)) num_threads(threads) if (R >= 8)
    for (int r = 0; r < R; r++) {
        const float* row = logits + (size_t)r * V;
        int mask = mask_of_row ? mask_of_row[r] : -1;
        float top = -INFINITY;
        int at = 0;
        if (mask >= 0) {
            const uint32_t* words = (const uint32_t*)(bitmask + (size_t)mask * W);
            int nan = 0;
            for (int w = 0; w < W && !nan; w++) {
                for (uint32_t word = words[w]; word; word &= word - 1) {
                    int t = 32 * w + __builtin_ctz(word);
                    if (t >= V) break;
                    float v = row[t];
                    if (v > top || isnan(v)) {
                        top = v;
                        at = t;
                        if (isnan(v)) { nan = 1; break; }
                    }
                }
            }
        } else {
            top = row[0];
            if (!isnan(top))
                for (int t = 1; t < V; t++) {
                    float v = row[t];
                    if (v > top || isnan(v)) {
                        top = v;
                        at = t;
                        if (isnan(v)) break;
                    }
                }
        }
        best[r] = at;
        dead[r] = top == -INFINITY;
    }
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
