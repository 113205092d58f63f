/* fp32 linear layers on the CPU over packed weights: y[M, N] = x[M, K] @ w[N, K]^T + bias[N].
 *
 * The weight is packed once, at load, as blocks of 16 output rows: wp[N/16][K][16] holds
 * w[16b + i][k] at [b][k][i] (the last block zero-padded). A tile multiplies two vectors of
 * outputs (2 x VW: two blocks with AVX-512, one block with AVX2) by up to 6 input rows: per k it
 * loads the two weight vectors, broadcasts each row's x[k], and accumulates 2 x 6 vectors of
 * products in registers (12 accumulators: AVX2's 16 registers hold them with the two weight
 * vectors and the broadcast); no horizontal sums, one sequential pass over the weight whatever
 * M is.
 *
 * Why: decoding and verifying drafts multiply a few rows by large weights. With the usual
 * [N, K] layout, torch's BLAS reaches ~11 GB/s on such shapes here, and a row-blocked kernel
 * costs 1.6-2x more for 2-4 rows than for one; packed, 1-8 rows cost about what one row costs
 * (the weight is read once), so verifying 4 drafted tokens costs about a 1-token step. For
 * prefill-sized M the same tiles run near the machine's peak. Each output is summed over k in
 * order, the same way whatever M, the tile and the vector width are: a row's result does not
 * depend on the rest of the batch.
 *
 * VW, the vector width, is the machine's own (vec.h).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "parallel.h"
#include "pool.h"
#include "vec.h"

/* VW outputs from n0 (sum + bias), cut at N */
static inline void store_vec(vf acc, const float* bias, float* y, int n0, int N) {
    if (N - n0 >= VW) {  /* a whole vector: one store (a lane-by-lane one cost as much as the sums at K = 64) */
        st(y + n0, bias ? acc + ld(bias + n0) : acc);
        return;
    }
    float lanes[VW];
    memcpy(lanes, &acc, sizeof lanes);
    int n = N - n0 < VW ? N - n0 : VW;
    for (int i = 0; i < n; i++) y[n0 + i] = lanes[i] + (bias ? bias[n0 + i] : 0.f);
}

/* The tiles also read int8 weights with one fp32 scale per output row: w[n][k] ~ scale[n] * q[n][k],
 * packed the same way (qp[N/16][K][16]). Each int8 vector is widened to fp32 in registers; the
 * row's scale multiplies the finished sum. A quarter of the fp32 weight's bytes to read: for a
 * draft model made of the target's quantized weights (worker/drafting/draft_model.py). */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
static inline vf ldq(const signed char* p) {  /* VW int8 -> VW fp32 (GCC scalarizes __builtin_convertvector here) */
#if VW == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
    vf v; for (int i = 0; i < VW; i++) v[i] = (float)p[i]; return v;
#endif
}
static inline vf unscaled(vf acc, const float* scale, int n0) { (void)scale; (void)n0; return acc; }
static inline vf scaled(vf acc, const float* scale, int n0) { return acc * ld(scale + n0); }

/* where output n's weight for k = 0 sits in the packed layout (n a multiple of VW) */
static inline size_t packed_at(int n, int K) { return (size_t)(n / 16) * K * 16 + n % 16; }

/* The sums of MC input rows x the two output vectors from n0 (the second one only if `two`), in
   acc0[c] and acc1[c], weights of type WT read by LOAD */
#define TILE_SUMS(MC, WT, LOAD)                                                                   \
    vf acc0[MC], acc1[MC];                                                                        \
    for (int c = 0; c < MC; c++) { acc0[c] = (vf){0}; acc1[c] = (vf){0}; }                        \
    const WT* w0 = wp + packed_at(n0, K);                                                         \
    const WT* w1 = wp + packed_at(n0 + VW, K);                                                    \
    if (two) {                                                                                    \
        for (int k = 0; k < K; k++) {                                                             \
            vf a = LOAD(w0 + (size_t)k * 16), b = LOAD(w1 + (size_t)k * 16);                      \
            for (int c = 0; c < MC; c++) {                                                        \
                float s = x[(size_t)c * K + k];                                                   \
                acc0[c] += a * s;                                                                 \
                acc1[c] += b * s;                                                                 \
            }                                                                                     \
        }                                                                                         \
    } else {                                                                                      \
        for (int k = 0; k < K; k++) {                                                             \
            vf a = LOAD(w0 + (size_t)k * 16);                                                     \
            for (int c = 0; c < MC; c++) acc0[c] += a * x[(size_t)c * K + k];                     \
        }                                                                                         \
    }

/* NAME##MC: the tile's sums finished by FINISH, plus the bias, stored into y [MC][N]; NAME##MC##o:
   the same into out [MC][2 * VW] (lanes past N hold their sums without a bias: the picks skip them) */
#define DEFINE_TILE(NAME, MC, WT, LOAD, FINISH)                                                   \
static void NAME##MC(const float* x, int K, const WT* wp, const float* scale, const float* bias, \
                     float* y, int N, int n0, int two) {                                          \
    TILE_SUMS(MC, WT, LOAD)                                                                       \
    for (int c = 0; c < MC; c++) {                                                                \
        store_vec(FINISH(acc0[c], scale, n0), bias, y + (size_t)c * N, n0, N);                    \
        if (two) store_vec(FINISH(acc1[c], scale, n0 + VW), bias, y + (size_t)c * N, n0 + VW, N); \
    }                                                                                             \
}                                                                                                 \
static void NAME##MC##o(const float* x, int K, const WT* wp, const float* scale, const float* bias, \
                        float* out, int N, int n0, int two) {                                     \
    TILE_SUMS(MC, WT, LOAD)                                                                       \
    for (int c = 0; c < MC; c++) {                                                                \
        float* row = out + (size_t)c * 2 * VW;                                                    \
        st(row, FINISH(acc0[c], scale, n0));                                                      \
        if (two) st(row + VW, FINISH(acc1[c], scale, n0 + VW));                                  \
        if (bias) store_vec(ld(row), bias, row - n0, n0, N);                                      \
        if (bias && two) store_vec(ld(row + VW), bias, row - n0, n0 + VW, N);                   \
    }                                                                                             \
}
#define DEFINE_TILES(NAME, WT, LOAD, FINISH)                                                      \
    DEFINE_TILE(NAME, 1, WT, LOAD, FINISH) DEFINE_TILE(NAME, 2, WT, LOAD, FINISH)                 \
    DEFINE_TILE(NAME, 3, WT, LOAD, FINISH) DEFINE_TILE(NAME, 4, WT, LOAD, FINISH)                 \
    DEFINE_TILE(NAME, 5, WT, LOAD, FINISH) DEFINE_TILE(NAME, 6, WT, LOAD, FINISH)                 \
    static void (*const NAME##s[7])(const float*, int, const WT*, const float*, const float*, float*, int, int, int) = \
        {0, NAME##1, NAME##2, NAME##3, NAME##4, NAME##5, NAME##6};                                 \
    static void (*const NAME##os[7])(const float*, int, const WT*, const float*, const float*, float*, int, int, int) = \
        {0, NAME##1o, NAME##2o, NAME##3o, NAME##4o, NAME##5o, NAME##6o};
DEFINE_TILES(tile, float, ld, unscaled)
DEFINE_TILES(tileq, signed char, ldq, scaled)

/* A loop over tiles' arguments (the picks' fields only for them) */
typedef struct {
    const float* x;
    const void* wp;
    const float *scale, *bias;
    float* y;
    int M, N, K, padded;
    const int32_t *mask_of_row, *bitmask;
    int W;
    vf* tops;
    vi *firsts, *nans;
    float* scratch;         /* the picks': 6 x K floats a thread */
    const uint8_t* sparse;  /* the picks': rows whose mask allows tokens in few tiles (NULL: none) */
} tiles_args;

/* each thread owns whole tiles of 2 x VW outputs: their weights stay in its cache while every
   input row passes over them (the padded width is a multiple of 16, so only with VW = 16 can a
   last tile have one vector) */
#define DEFINE_RUN(TILES, WT)                                                                     \
static void TILES##_run(void* ctx, int begin, int end, int thread) {                              \
    const tiles_args* a = ctx;                                                                    \
    int M = a->M, N = a->N, K = a->K;                                                             \
    (void)thread;                                                                                 \
    for (int p = begin; p < end; p++) {                                                           \
        int n0 = 2 * VW * p, two = a->padded - n0 > VW;                                           \
        for (int m0 = 0; m0 < M; m0 += 6) {                                                       \
            int mc = M - m0 < 6 ? M - m0 : 6;                                                     \
            TILES[mc](a->x + (size_t)m0 * K, K, (const WT*)a->wp, a->scale, a->bias, a->y + (size_t)m0 * N, N, n0, two); \
        }                                                                                         \
    }                                                                                             \
}
DEFINE_RUN(tiles, float)
DEFINE_RUN(tileqs, signed char)

#define RUN_TILES(TILES, WP, SCALE)                                                               \
    int padded = (N + 15) / 16 * 16, ntiles = (padded + 2 * VW - 1) / (2 * VW);                   \
    size_t work = (size_t)M * N * K;                                                              \
    tiles_args a = {x, WP, SCALE, bias, y, M, N, K, padded, 0, 0, 0, 0, 0, 0, 0, 0};              \
    pool_for(ntiles, PARALLEL_CHUNK(ntiles, threads), threads, work >= PARALLEL_MIN_WORK, TILES##_run, &a);

void packed_linear_f32(const float* x, const float* wp, const float* bias, float* y,
                       int M, int N, int K, int threads) {
    RUN_TILES(tiles, wp, (const float*)0)
}

/* scale has ceil(N/16)*16 entries (zero-padded like the blocks) */
void packed_linear_i8(const float* x, const signed char* qp, const float* scale, const float* bias, float* y,
                      int M, int N, int K, int threads) {
    RUN_TILES(tileqs, qp, scale)
}

/* Greedy picks without the logits: for each of the M rows of y = x @ w^T + bias (N outputs), the
 * index argmax_rows_f32 (logits_ops.c) gives of it (the first largest among the tokens its mask
 * allows; the first NaN where there is one; 0 where every allowed value is -inf or none is
 * allowed) and whether the row is dead (no NaN and every allowed value -inf). mask_of_row, bitmask
 * and W as there.
 *
 * Why: a greedy decode step of a small-hidden model wrote its [M, N] logits only for the pick to
 * read them back: at 64 rows of 49,152 that is 12.6 MB each way, a fifth of rank 0's step (tiny
 * model: LM head 3.0 ms, pick 0.8). Each tile's sums go to a buffer the size of the tile instead,
 * and each row keeps, per vector lane, its largest value and the first index that held it (what
 * first_max keeps), per thread; a thread's tiles come in increasing order, so merging the threads
 * lane by lane (the larger value; of equal ones the lower index), then the lanes, gives the first
 * largest of the row. The sums are the tiles' own: every value equals the logits' value. */
static inline void pick_vec(vf v, vi index, int n0, int N, const uint32_t* words, vf* top, vi* first, vi* nan) {
    if (n0 + VW > N || words) {  /* tokens past N, or not allowed: -inf */
        vi keep = index < N;
        if (words) keep &= -((((vi){0} + (int)(words[n0 >> 5] >> (n0 & 31))) >> (index - n0)) & 1);
        v = (vf)(((vi)v & keep) | ((vi)((vf){0} - INFINITY) & ~keep));
    }
    vi greater = v > *top;  /* (false where either is NaN: a row with a NaN is picked again, pick_nan) */
    *top = (vf)(((vi)v & greater) | ((vi)*top & ~greater));
    *first = (index & greater) | (*first & ~greater);
    *nan |= v != v;
}

/* The row's first allowed NaN (as argmax_rows_f32 picks it), its logits computed again: rare */
#define PICK_NAN(TILES, WP, SCALE, r, words, out)                                                 \
    do {                                                                                          \
        float* y = malloc(sizeof(float) * (size_t)padded);                                        \
        for (int p = 0; y && p < ntiles; p++)                                                     \
            TILES[1](x + (size_t)(r) * K, K, WP, SCALE, bias, y, N, 2 * VW * p, padded - 2 * VW * p > VW); \
        for (int t = 0; y && t < N; t++)                                                          \
            if ((!(words) || ((words)[t >> 5] >> (t & 31)) & 1u) && y[t] != y[t]) { out = t; break; } \
        free(y);                                                                                  \
    } while (0)

/* Whether row r needs the `span` tokens' tile from n0 (n0 a multiple of span, span <= 32 dividing
 * 32: the tokens sit in one mask word): a row not marked sparse always does */
static inline int tile_needed(const tiles_args* a, size_t r, int n0, int span) {
    if (!a->sparse[r]) return 1;
    uint32_t word = (uint32_t)a->bitmask[(size_t)a->mask_of_row[r] * a->W + (n0 >> 5)] >> (n0 & 31);
    return span >= 32 ? word != 0 : (word & ((1u << span) - 1)) != 0;
}

/* Which rows' masks allow tokens in at most a quarter of their words (the tiles skipped for them
 * pay for the checks); NULL where none does. A row is read until more than W / 4 of its words
 * are seen to allow tokens. */
static uint8_t* sparse_rows(const int32_t* mask_of_row, const int32_t* bitmask, int W, int M) {
    if (!mask_of_row) return NULL;
    uint8_t* sparse = NULL;
    for (int r = 0; r < M; r++) {
        if (mask_of_row[r] < 0) continue;
        const int32_t* words = bitmask + (size_t)mask_of_row[r] * W;
        int allowing = 0;
        for (int i0 = 0; i0 < W && allowing <= W / 4; i0 += 64) {  /* (blocks: the count vectorizes) */
            int n = W - i0 < 64 ? W - i0 : 64;
            for (int i = 0; i < n; i++) allowing += words[i0 + i] != 0;
        }
        if (allowing > W / 4) continue;
        if (!sparse && !(sparse = calloc((size_t)M, 1))) return NULL;  /* (no memory: no skipping) */
        sparse[r] = 1;
    }
    return sparse;
}

/* one group's tile (rows[0..mc), their inputs at x) and its picks */
#define PICK_GROUP(OTILES, WT, x)                                                                 \
    do {                                                                                          \
        OTILES[mc](x, K, (const WT*)a->wp, a->scale, a->bias, out, N, n0, two);                   \
        for (int c = 0; c < mc; c++) {                                                            \
            size_t row = (size_t)rows[c];                                                         \
            int mask = a->mask_of_row ? a->mask_of_row[row] : -1;                                 \
            const uint32_t* words = mask >= 0 ? (const uint32_t*)(a->bitmask + (size_t)mask * W) : NULL; \
            vf* top = a->tops + me + row;                                                         \
            vi *first = a->firsts + me + row, *nan = a->nans + me + row;                          \
            pick_vec(ld(out + c * 2 * VW), index0, n0, N, words, top, first, nan);                \
            if (two) pick_vec(ld(out + c * 2 * VW + VW), index1, n0 + VW, N, words, top, first, nan); \
        }                                                                                         \
    } while (0)

/* a thread's tiles (increasing: pool_for's chunks are) picked into its lane states. Where some rows
 * are sparse (sparse_rows), a tile is computed only for the rows that need it (a guided row between
 * JSON values allows a few dozen tokens of 49,152: ~2% of the LM head), in groups of up to 6 such
 * rows; a group's rows that are not consecutive are copied together first (scratch: 6 x K floats
 * a thread). A tile skipped for a row would only have offered it -inf: its picks are the same. */
#define DEFINE_PICKS(TILES, OTILES, WT)                                                           \
static void TILES##_picks(void* ctx, int begin, int end, int thread) {                            \
    const tiles_args* a = ctx;                                                                    \
    int M = a->M, N = a->N, K = a->K, W = a->W;                                                   \
    size_t me = (size_t)thread * M;                                                               \
    float* xs = a->scratch + (size_t)thread * 6 * K;                                              \
    float out[6 * 2 * VW] __attribute__((aligned(64)));                                           \
    int rows[6];                                                                                  \
    vi lane;                                                                                      \
    for (int l = 0; l < VW; l++) lane[l] = l;                                                     \
    for (int p = begin; p < end; p++) {                                                           \
        int n0 = 2 * VW * p, two = a->padded - n0 > VW;                                           \
        vi index0 = lane + n0, index1 = lane + (n0 + VW);                                         \
        if (!a->sparse) { /* every row needs every tile */                                       \
            for (int m0 = 0; m0 < M; m0 += 6) {                                                   \
                int mc = M - m0 < 6 ? M - m0 : 6;                                                 \
                for (int c = 0; c < mc; c++) rows[c] = m0 + c;                                    \
                PICK_GROUP(OTILES, WT, a->x + (size_t)m0 * K);                                    \
            }                                                                                     \
            continue;                                                                             \
        }                                                                                         \
        for (int r = 0, mc = 0; r < M; r++) {                                                     \
            if (tile_needed(a, (size_t)r, n0, two ? 2 * VW : VW)) rows[mc++] = r;                 \
            if ((mc < 6 && r < M - 1) || !mc) continue;                                           \
            const float* x = a->x + (size_t)rows[0] * K;                                          \
            if (rows[mc - 1] - rows[0] != mc - 1) { /* not consecutive: gathered */               \
                for (int c = 0; c < mc; c++) memcpy(xs + (size_t)c * K, a->x + (size_t)rows[c] * K, sizeof(float) * K); \
                x = xs;                                                                           \
            }                                                                                     \
            PICK_GROUP(OTILES, WT, x);                                                            \
            mc = 0;                                                                               \
        }                                                                                         \
    }                                                                                             \
}
DEFINE_PICKS(tiles, tileos, float)
DEFINE_PICKS(tileqs, tileqos, signed char)

#define RUN_PICKS(TILES, WP, SCALE)                                                               \
    int padded = (N + 15) / 16 * 16, ntiles = (padded + 2 * VW - 1) / (2 * VW);                   \
    size_t work = (size_t)M * N * K;                                                              \
    int team = threads > 0 ? threads : 1;                                                         \
    size_t states = (size_t)team * M;                                                             \
    vf* tops = aligned_alloc(sizeof(vf), sizeof(vf) * states); /* (vectors: aligned) */          \
    vi* firsts = aligned_alloc(sizeof(vi), sizeof(vi) * states);                                  \
    vi* nans = aligned_alloc(sizeof(vi), sizeof(vi) * states);                                    \
    float* scratch = malloc(sizeof(float) * 6 * (size_t)K * team);                                \
    if (!tops || !firsts || !nans || !scratch) {                                                  \
        free(tops); free(firsts); free(nans); free(scratch);                                      \
        return -1;                                                                                \
    }                                                                                             \
    for (size_t i = 0; i < states; i++) {                                                         \
        tops[i] = (vf){0} - INFINITY;                                                             \
        firsts[i] = nans[i] = (vi){0};                                                            \
    }                                                                                             \
    uint8_t* sparse = sparse_rows(mask_of_row, bitmask, W, M);                                    \
    tiles_args a = {x, WP, SCALE, bias, 0, M, N, K, padded, mask_of_row, bitmask, W, tops, firsts, nans, scratch, sparse}; \
    pool_for(ntiles, PARALLEL_CHUNK(ntiles, team), team, work >= PARALLEL_MIN_WORK, TILES##_picks, &a); \
    int failed = 0;                                                                               \
    for (int r = 0; r < M; r++) {                                                                 \
        vf m = tops[r];                                                                           \
        vi at = firsts[r], nan = nans[r];                                                         \
        for (int t = 1; t < team; t++) {  /* lane by lane: the larger value, of equal ones the lower index */ \
            vf v = tops[(size_t)t * M + r];                                                       \
            vi i = firsts[(size_t)t * M + r];                                                     \
            vi take = (v > m) | ((v == m) & (i < at));                                            \
            m = (vf)(((vi)v & take) | ((vi)m & ~take));                                           \
            at = (i & take) | (at & ~take);                                                       \
            nan |= nans[(size_t)t * M + r];                                                       \
        }                                                                                         \
        float top = -INFINITY;                                                                    \
        int pick = N, any_nan = 0;                                                                \
        for (int l = 0; l < VW; l++) {                                                            \
            top = m[l] > top ? m[l] : top;                                                        \
            any_nan |= nan[l];                                                                    \
        }                                                                                         \
        for (int l = 0; l < VW; l++)                                                              \
            if (m[l] == top && at[l] < pick) pick = at[l];                                        \
        if (top == -INFINITY) pick = 0;                                                           \
        if (any_nan) {                                                                            \
            int mask = mask_of_row ? mask_of_row[r] : -1, found = -1;                             \
            const uint32_t* words = mask >= 0 ? (const uint32_t*)(bitmask + (size_t)mask * W) : NULL; \
            PICK_NAN(TILES, WP, SCALE, r, words, found);                                          \
            failed |= found < 0;                                                                  \
            pick = found;                                                                         \
        }                                                                                         \
        best[r] = pick;                                                                           \
        dead[r] = !any_nan && top == -INFINITY;                                                   \
    }                                                                                             \
    free(tops);                                                                                   \
    free(firsts);                                                                                 \
    free(nans);                                                                                   \
    free(scratch);                                                                                \
    free(sparse);                                                                                 \
    return -failed;

int packed_linear_argmax_f32(const float* x, const float* wp, const float* bias, int M, int N, int K,
                             const int32_t* mask_of_row, const int32_t* bitmask, int W, int64_t* best,
                             uint8_t* dead, int threads) {
    RUN_PICKS(tiles, wp, (const float*)0)
}

int packed_linear_argmax_i8(const float* x, const signed char* qp, const float* scale, const float* bias, int M,
                            int N, int K, const int32_t* mask_of_row, const int32_t* bitmask, int W,
                            int64_t* best, uint8_t* dead, int threads) {
    RUN_PICKS(tileqs, qp, scale)
}

/* Rows ids[0..n) of a packed fp32 weight wp[ceil(N/16)][K][16] (an embedding lookup): out[n][K].
 * Returns the index of the first id outside [0, N) (nothing of it written), or -1. torch's
 * indexing of the packed layout took three tensor ops, 11-16 µs a step. */
int packed_rows_f32(const float* wp, int N, int K, const int64_t* ids, int n, float* out) {
    for (int i = 0; i < n; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= N) return i;
        const float* src = wp + (size_t)(id / 16) * K * 16 + id % 16;
        for (int k = 0; k < K; k++) out[(size_t)i * K + k] = src[(size_t)k * 16];
    }
    return -1;
}
